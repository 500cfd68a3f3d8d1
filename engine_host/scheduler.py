"""The scheduler hook: vLLM's V1 ``Scheduler`` with live K and live batch caps.

Named in ``--scheduler-cls``, it runs inside vLLM's engine-core process. Each step it

1. checks the control channel's config sequence number (one ``struct`` read) and, when
   a new config version was published, applies it at once: policy, K bounds, caps;
2. lets the controller choose K through vLLM's dynamic speculative decoding path
   (``self.dynamic_sd_lookup[batch_size]`` becomes a live object whose ``__getitem__``
   asks the controller; vLLM sends the result to the workers as
   ``SchedulerOutput.num_spec_tokens_to_schedule``);
3. caps running sequences and tokens per step (``max_num_running_reqs``,
   ``max_num_scheduled_tokens``). A cap below the running count stops admissions and
   drains: it never drops below ``len(self.running)`` (vLLM asserts that);
4. after the step, feeds the controller the verified drafts (per request, through
   ``make_spec_decoding_stats``), the decode batch size and the step time, and
   publishes its state to the channel a few times a second.

``SpecPilotAsyncScheduler`` does the same on top of ``AsyncScheduler`` for engines run
with async scheduling.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from typing import Any

from vllm.v1.core.sched.async_scheduler import AsyncScheduler
from vllm.v1.core.sched.scheduler import Scheduler

from . import cpu_affinity, envs, vllm_compat
from .channel import ACK_APPLIED, ACK_REFUSED, Channel, channel_from_env
from .config import LiveConfig
from .controller import SpeculationController, StepObservation
from .request_gate import PROBE_NEW_SHARE, RequestDraftGate, draft_token_cost
from .step_clock import DecodeStretch, StepClock
from .step_trace import graph_mode, step_trace_from_env

logger = logging.getLogger("specpilot.scheduler")

PUBLISH_INTERVAL_S = 0.25
# time.sleep(0): hands the interpreter to another thread that waits for it (the one sending outputs)
_yield_interpreter = time.sleep


def _add_above(hist: list[int], dhist: list[int], n_acc: list[int], n_draft: list[int]) -> None:
    """Add to ``hist[i]`` the verifications with more than ``i`` tokens accepted and to
    ``dhist[i]`` those with more than ``i`` drafted, from counts by tokens accepted and drafted
    (``n_acc[j]``, ``n_draft[j]``: verifications with exactly ``j``, the last index ``len(hist)``
    or more)."""
    above_a = above_d = 0
    for i in range(len(hist), 0, -1):
        above_a += n_acc[i]
        above_d += n_draft[i]
        hist[i - 1] += above_a
        dhist[i - 1] += above_d


class _LiveLookup:
    """Stands in for vLLM's ``dynamic_sd_lookup`` list: ``lookup[batch_size]`` -> K."""

    __slots__ = ("hook",)

    def __init__(self, hook: "_SpecPilotHook"):
        self.hook = hook

    def __getitem__(self, batch_size: int) -> int:
        return self.hook._decide_k(batch_size)

    def __len__(self) -> int:  # pragma: no cover - vLLM only indexes it
        return self.hook._startup_max_seqs + 1


def _draft_of(spec_cfg: Any) -> str | None:
    """The draft model or head vLLM loaded (its path or hub id), None for methods without
    one (n-gram) and without speculation; MTP reports the target itself."""
    if spec_cfg is None or getattr(spec_cfg, "method", None) in ("ngram", "ngram_gpu", "suffix", None):
        return None
    dmc = getattr(spec_cfg, "draft_model_config", None)
    model = getattr(dmc, "model", None) or getattr(spec_cfg, "model", None)
    return str(model) if model else None


def _draft_cost(vcfg: Any) -> tuple[bool, float]:
    """Whether drafting runs a model (each draft token a forward pass), and the prior of one
    draft pass over one target pass: the ratio of layers x hidden size squared (weights
    touched per token), 0.25 when the configs do not say."""
    spec_cfg = vcfg.speculative_config
    method = getattr(spec_cfg, "method", None)
    if spec_cfg is None or method in (None, "ngram", "ngram_gpu", "suffix"):
        return False, 0.25

    def size(hf: Any) -> float | None:
        hf = getattr(hf, "text_config", None) or hf
        layers, hidden = getattr(hf, "num_hidden_layers", None), getattr(hf, "hidden_size", None)
        return float(layers) * float(hidden) ** 2 if layers and hidden else None

    try:
        d = size(spec_cfg.draft_model_config.hf_config)
        t = size(vcfg.model_config.hf_config)
        if d and t and method == "draft_model":
            return True, min(max(d / t, 0.02), 2.0)
    except AttributeError:
        pass
    return True, 0.25


def _pinned_cpu_from_env() -> int | None:
    """The CPU index the launcher took for the step loop (``$SPECPILOT_CORE_CPU``), else None."""
    try:
        choice = cpu_affinity.parse_core_cpu(envs.core_cpu() or cpu_affinity.OFF)
    except ValueError as exc:
        logger.warning("SpecPilot: %s; the step loop is not pinned", exc)
        return None
    return choice if isinstance(choice, int) else None


class _SpecPilotHook:
    """Mixin with the SpecPilot behaviour; combined with ``Scheduler`` or ``AsyncScheduler``."""

    # Per-request draft dropping edits ``request.spec_token_ids`` before scheduling; with
    # async scheduling those hold placeholders whose count vLLM tracks elsewhere, so there
    # it stays off until checked on that path, and the gate sets only the step's K
    # (``_any_request_wants_drafts``).
    GATE_DRAFTS = True
    # least draft length (tokens) of a lone request's probe when its own estimate does not
    # draft (``_per_request_k``; an exploration's K = 1 would show little): one verification at
    # shallow depth says whether it has started to accept, at a fraction of a deep draft's
    # verification
    PROBE_DEPTH = 2
    # under async scheduling a probe of every running request at once (``_any_request_wants_
    # drafts``) after which still no request's drafts pay doubles the steps at K = 0 before
    # the next, up to PROBE_BACKOFF times ``probe_every``: in traffic whose probes accept
    # nothing (sampled chat), a probe step at K > 0 is paid about every 4 * 16 steps instead
    # of 16; a verification that accepted at least half its drafts starts the wait from
    # ``probe_every`` again
    PROBE_BACKOFF = 4
    # a request that joins starts the async probes' wait from ``probe_every`` again only when
    # at least this share of its class's finished requests had drafts that would pay
    # (``RequestDraftGate.paying_share``, under the mixture prior); else the wait runs on as
    # backed off. On sampled chat at one client every request restarted the wait at 16 steps
    # and any accepted draft token reset it, so the probes' backoff seldom took hold
    # (docs/gpu.md, host 37); a request of a class whose drafts pay (docs after chat) is
    # still probed at ``probe_every``, or drafted at once where its class's prior pays
    PROBE_NEW_SHARE = PROBE_NEW_SHARE
    # the adaptive policy's exploration at a batch of at least this many requests runs whatever
    # the per-request gate says (``_decide_k``), and on the synchronous path its drafts are
    # verified for every request (``_gate_drafts``): an exploration is then a probe of the
    # whole batch. The gate, whose estimates only its verified drafts refresh, would otherwise
    # answer K = 0 to it whenever the batch's estimates are stale from the traffic before, and
    # neither the policy nor the gate would learn that the requests now quote (docs/gpu.md,
    # host 27; python -m bench policy-bursts). A lone request keeps its own probes
    # (``_per_request_k``), where an exploration would take 17 steps. An exploration passes
    # the gate only while some running request is of a class whose drafts may pay
    # (``_classes_may_pay``, the drain rule's test): in a batch of sampled chat behind
    # quoting traffic, the policy still at the quoting traffic's K explored past the gate
    # every few hundred steps, each exploration a step at K > 0 for every request
    # (docs/gpu.md, host 56); such a batch is left to the gate's own probes, and the policy ends
    # the exploration at that step (``SpeculationController.end_exploration``)
    # ($SPECPILOT_EXPLORE_BY_CLASS=0: every exploration passes, as before)
    EXPLORE_PAST_GATE_MIN_BATCH = 4
    # the gate's step-time inputs (``_gate_costs``) are recomputed every GATE_COST_EVERY steps
    # at one (batch size, K): they come from the step-time model, which moves over tens of
    # steps, while pricing them is most of the hook's per-step work at batch 1 under the
    # adaptive policy (python -m bench hook-cost)
    GATE_COST_EVERY = 8
    # REST_SPAN_SCALING: with B >= 2 * BATCH_PAYS_REQUESTS requests running, a rest on the lean
    # path lasts B // BATCH_PAYS_REQUESTS times as long (_rest_span): under async scheduling a
    # batch the gate holds at K = 0 up to GATE_COST_EVERY * (B // BATCH_PAYS_REQUESTS) steps
    # rather than GATE_COST_EVERY, and the adaptive policy's own rest at K = 0 up to that factor
    # times REST_DECIDE_EVERY and LEAN_SPAN: each full-path step there prices all B requests
    # again, and leaves vLLM's own code slower after it (docs/gpu.md, hosts 34-35 and 50). The
    # gate's probes and the policy's explorations still end a span at their step.
    # $SPECPILOT_REST_SPAN_SCALING=0 turns it off (side-by-side benchmarks)
    _rest_span_scaling = True
    # the step trace records the per-request gate's estimates with at most this many requests running
    TRACE_ESTIMATE_MAX_BATCH = 8
    # the step trace's rows are written out when the engine waits for work, or once this many are
    # kept (their text is made then: on a busy engine a few ms every few seconds, not on every step)
    TRACE_FLUSH_ROWS = 512
    # the async gate's kept answer when none is kept: (K, newest running request, batch
    # size, step index, answer), see ``_any_request_wants_drafts``
    _WANTS_STALE: tuple[int, Any, int, int, bool] = (-1, None, 0, -(1 << 62), False)
    # after drafts were verified or a request joined, the async gate prices the batch again
    # (``RequestDraftGate.batch_pays``, a sum over every running request) at the next step
    # with fewer than 2 * BATCH_PAYS_REQUESTS requests, else after B // BATCH_PAYS_REQUESTS
    # steps: its price grows with the batch (python -m bench hook-cost --turnover)
    BATCH_PAYS_REQUESTS = 16
    # finished requests leave the gate at the first full-path step GATE_FORGET_EVERY steps
    # after the last time they did (lean steps skip the gate, so never a fixed step index)
    GATE_FORGET_EVERY = 256
    # a quiet step (a decode step that verified no draft and fetched none, outside the
    # warm-up) is kept and folded into the controller with the next ones, QUIET_STEPS at a
    # time, and before every state publish and config change: between engine steps the
    # hook's code and data have left the CPU's caches, and the controller's update of one
    # step costs several times what it costs run again at once (python -m bench hook-cost
    # --cold). Such a step carries no acceptance, only a step time, so the estimates lag by
    # at most QUIET_STEPS - 1 steps of step time.
    QUIET_STEPS = 8
    # the K decision's time inside vLLM's schedule() (the K lookup) in the step being scheduled (s)
    _decide_s = 0.0
    # EXPLORE_PAST_GATE_MIN_BATCH's class test (set per instance from $SPECPILOT_EXPLORE_BY_CLASS),
    # the explorations it left to the gate (each ended at its first step), the rule that set the
    # K being scheduled (the step trace's ``rule``) and whether the async all-request probe fired
    # in this decision
    _explore_by_class = True
    _explorations_held = 0
    # acceptance kept apart by run state ($SPECPILOT_RUN_STATES; set per instance) and the step's
    # verifications proposed after a draft accepted in full
    _run_states = False
    _full_n = 0
    _k_rule = ""
    _probe_fired = False
    # the hook stands aside (set per instance by _step_aside; False until it first does)
    _aside = False
    # the lean path: while the policy holds K at 0 and learns nothing from steps (off, fixed
    # at 0), with the gate off and no warm-up, a step only checks the config's sequence
    # number (and a batch cap below the start-up limits), keeps the step clock and counts
    # the step; vLLM's K lookup is a list of zeros. One output in LEAN_SAMPLE (and any
    # output with a publish due or the engine drained) still takes the full path, so the
    # step-time model keeps learning; the others are folded in as counts
    # (SpeculationController.skip_quiet). "Speculation off" then costs the engine a few
    # microseconds a step instead of tens (python -m bench hook-cost --cold).
    LEAN_SAMPLE = 16
    # the adaptive policy rests on the same path while it holds K at 0 (a workload whose
    # drafts do not pay), for spans of at most LEAN_SPAN steps that end before its next
    # goodput comparison or exploration and, for a lone request under async scheduling,
    # before the gate's next probe (SpeculationController.rest_steps; a drained engine ends
    # a span too, so a new request is decided afresh); the step after a span takes the full path
    # and decides K again. A span begins only with no drafts in flight, and an output that
    # verified drafts (a probe's) ends it, so what they say is acted on at once. Not where
    # the per-request gate drops drafts request by request (synchronous scheduling), whose
    # per-request probe counts advance every step.
    LEAN_SPAN = 16
    # stepping aside: at a static K = 0 (or off) on the lean path, with the batch caps at their
    # start-up limits and no step trace, the hook takes itself out of vLLM's per-step calls. It
    # sets vLLM's own schedule() and update_from_output() as attributes of the scheduler object,
    # which Python finds before the class's methods, so the engine core calls vLLM's directly (it
    # looks them up on every step: the vLLM shape test pins that). Only has_requests(), which the
    # engine core calls before every step, stays the hook's: it steps back in (removes those
    # attributes) when the config's sequence number changed, a state publish is due or the engine
    # drained; the next output takes the full path, which steps aside again. The steps scheduled
    # meanwhile are counted from vLLM's own step counter (``Scheduler.current_step``), their
    # outputs as one each, their requests as the running ones at the step back in, and their wall
    # time as busy time; with one request running at both ends their mean time teaches the
    # step-time model what a plain step takes, as the lean path's sampled steps do. "Speculation
    # off" then costs a step two comparisons in has_requests() instead of the lean path's frames.
    # Not in the adaptive policy's rests: there its decisions learn from the lean path's steps
    # (the step-time model's price of a plain step at each batch), and stood aside the policy
    # drafted in 34 of 60 steps of a quoting burst where the lean path drafted in 50
    # (python -m bench policy-bursts, docs/engine_host.md).

    # Attributes of vLLM's Scheduler (set in its __init__) that the hook reads and caps.
    max_num_running_reqs: int
    max_num_active_reqs: int
    max_num_scheduled_tokens: int
    dynamic_sd_lookup: list[int] | None

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)  # type: ignore[call-arg]
        sched_cfg = self.scheduler_config  # type: ignore[attr-defined]
        self._startup_max_seqs = int(self.max_num_running_reqs)
        self._startup_max_tokens = int(self.max_num_scheduled_tokens)
        self._has_active_cap = hasattr(self, "max_num_active_reqs")
        self._k_engine = int(getattr(self, "num_spec_tokens", 0) or 0)
        vcfg = self.vllm_config  # type: ignore[attr-defined]
        self._limits = {
            "model": str(vcfg.model_config.model),
            "k_max": self._k_engine,
            "max_num_seqs": self._startup_max_seqs,
            "max_num_batched_tokens": int(sched_cfg.max_num_batched_tokens),
            "max_model_len": int(vcfg.model_config.max_model_len),
            "speculative_method": getattr(vcfg.speculative_config, "method", None),
            "draft_model": _draft_of(vcfg.speculative_config),
        }
        self._channel: Channel | None = channel_from_env()
        # the config's sequence number, read every step without a method call
        self._config_seq_view = self._channel.config_seq_view() if self._channel is not None else None
        self._config = LiveConfig()
        self._config_dump = self._config.model_dump(mode="json")
        self._config_version = 0
        self._config_seq = -1
        self._config_error: str | None = None
        self._applied_at = time.time()
        self._ack_step: int | None = None
        passes, ratio = _draft_cost(vcfg)
        self.controller = SpeculationController(
            self._k_engine,
            self._config.speculation,
            draft_passes=passes,
            draft_cost_ratio=ratio,
            run_states=envs.run_states_on(),
            depth_tokens=envs.depth_tokens_on(),
        )
        # per-request probes backed off and taken together (synchronous scheduling; the async
        # path backs off its all-request probes itself, PROBE_BACKOFF)
        backoff = envs.probe_backoff_on()
        self._gate = RequestDraftGate(probe_backoff=self.PROBE_BACKOFF if backoff else 1)
        # a burst after a drain is explored soon only where its requests' classes may pay
        # (_burst_may_pay; $SPECPILOT_PROBE_BACKOFF=0: every burst, as before)
        self._drain_explores_skipped = 0
        if backoff:
            self.controller.burst_may_pay = self._burst_may_pay
        # explorations past the gate only where a running request's class may pay
        # (EXPLORE_PAST_GATE_MIN_BATCH; $SPECPILOT_EXPLORE_BY_CLASS=0: every one, as before)
        # (the counter of held explorations, the step's rule and the probe flag start from the class's defaults)
        self._explore_by_class = envs.explore_by_class_on()
        self._gate_on = False
        self._gate_fold_finished = False  # fold finished requests into the gate's mixture prior
        self._gate_cost_last = (0.0, 0.0)  # the gate's last (draft_token_cost, step_cost)
        self._cap_seqs = self._startup_max_seqs
        self._cap_tokens = self._startup_max_tokens
        self._caps_steady = False  # True while _apply_caps has nothing to change
        self._max_running_seen = 0
        self._k_decided = 0  # K chosen for the step being scheduled
        self._k_explored = False  # _k_decided is an exploration's K, run past the gate (EXPLORE_PAST_GATE_MIN_BATCH)
        self._drafts_explored = False  # the drafts verified in the step being scheduled are an exploration's
        self._gate_cost_memo: dict[tuple[int, int], tuple[float, float, int]] = {}
        self._steps_planned_out = 0  # steps in a row the gate ran at K = 0 (async probes)
        self._probe_interval = self._gate.probe_every  # steps at K = 0 before the next async probe
        self._batch_k_memo = (0, -(1 << 62))  # (_batch_k's K, step index it was computed at)
        self._wants_memo = self._WANTS_STALE  # the async _any_request_wants_drafts' kept answer
        self._wants_dirty = False  # drafts verified since that answer
        self._lean_newest: Any = None  # the newest running request when the rest span began
        self._probe_newest: Any = None  # the newest running request at the last async probe count
        # $SPECPILOT_PROBE_PRIOR=0: every new request and any accepted draft token restart the
        # async probes' wait (the schedule before PROBE_NEW_SHARE; side-by-side benchmarks)
        self._probe_by_prior = envs.probe_prior_on()
        self._new_request_share: tuple[str | None, float] | None = None  # (class, paying_share) at the last join
        self._gate_forget_at = 0  # step index from which the gate forgets finished requests
        self._k_drafted = 0  # K of the drafts verified in the step being scheduled
        self._k_first_use_step: int | None = None
        self._t_sched = 0.0
        self._clock = StepClock()
        self._stretch = DecodeStretch()
        self._trace = step_trace_from_env()  # $SPECPILOT_STEP_TRACE: one row per step (profiling)
        # the hook may step aside at a static K = 0 ($SPECPILOT_HOOK_ASIDE; not while tracing, whose
        # rows are per step; only on a vLLM that counts its steps)
        self._aside_ok = (
            envs.hook_aside_on() and self._trace is None and isinstance(getattr(self, "current_step", None), int)
        )
        self._aside = False  # the hook stands aside: vLLM's schedule() and update_from_output() run directly
        self._aside_from = (0, 0.0, 0)  # (vLLM's current_step, perf_counter(), running) when it stepped aside
        self._aside_s = 0.0  # wall time stood aside with requests running (s)
        self._aside_steps = 0  # steps vLLM scheduled meanwhile
        self._step_index = 0
        self._published_step = -1  # _step_index at the last state publish
        self.specpilot_last_scheduled_k: int | None = None  # K of the step scheduled last
        self._hist = [0] * max(self._k_engine, 1)
        self._dhist = [0] * max(self._k_engine, 1)
        # the same over the verifications whose request's previous draft was accepted in full
        # (the run state, engine_host.run_acceptance; counted with $SPECPILOT_RUN_STATES=1)
        self._run_states = envs.run_states_on()
        self._fhist = [0] * max(self._k_engine, 1)
        self._fdhist = [0] * max(self._k_engine, 1)
        self._full_n = 0
        self._drafted = 0
        self._accepted = 0
        self._verified: list[tuple[str | None, int, int]] = []  # (request id, drafted, accepted) this step
        self._quiet: list[tuple[int, int | None, float, bool, float]] = []  # kept quiet steps (QUIET_STEPS)
        self._overhead_s = 0.0  # wall time inside the hook's spans (s)
        self._trace_s = 0.0  # of which the step trace's rows and writes, taken out of the clocks (s)
        self._overhead_cpu_s = 0.0  # this thread's CPU time inside the same spans (s)
        self._busy_s = 0.0
        self._t_output_done = 0.0  # perf_counter() when the hook last handed back a step's outputs
        self._draft_fetch_s = 0.0  # the engine core's fetch of the next step's drafts (s)
        self._last_publish = 0.0
        self._started_at = time.time()
        self._warmup_k: int | None = None
        self._warmup_steps = [0] * (self._k_engine + 1)
        self._live_lookup = _LiveLookup(self)
        self._zero_lookup = [0] * (self._startup_max_seqs + 2)  # the lean path's K lookup
        self._lean = False  # steps take the lean path (LEAN_SAMPLE)
        self._rest_span_scaling = envs.rest_span_scaling_on()
        self._lean_allowed = envs.hook_lean_on()  # $SPECPILOT_K0_LEAN / _HOOK_LEAN=0: never (side-by-side benchmarks)
        self._lean_ok = False  # the config allows it (a static K = 0 or adaptive, no warm-up, no per-request drops)
        self._lean_scheduled = 0  # steps scheduled on the lean path since the last flush
        self._lean_steps = 0  # steps on the lean path or stood aside since the start (flushed ones)
        self._lean_skipped = 0  # outputs handed back on it without an observation
        self._lean_request_steps = 0  # requests in those outputs, all together
        # of those, the pure-decode ones past their batch's first steps (DecodeStretch.teaches):
        # their count, requests and time (s), which teach the step-time model in one go
        # (SpeculationController.skip_quiet); $SPECPILOT_LEAN_STEP_TIMES=0: not kept
        self._lean_timed = self._lean_timed_requests = 0
        self._lean_timed_s = 0.0
        self._lean_times_on = envs.lean_step_times_on()
        self._lean_outputs = 0  # outputs on the lean path (every LEAN_SAMPLE-th is observed)
        self._lean_left = 0  # steps the lean path may still schedule (a rest span; huge at a static K = 0)
        self._lean_probe_count = False  # the span's steps count toward the gate's async probe
        self._lean_join_ends = False  # a request that joins ends the span at its first step
        self._resting = False  # the lean path runs a rest span of the adaptive policy
        self._publish_due = 0.0  # perf_counter() when the next state publish is due
        # --core-cpu: the step loop's own CPU (the launcher sets the index it took), pinned at the
        # first step, after vLLM has started its I/O threads
        self._pin_cpu = _pinned_cpu_from_env()
        # at that step an engine host on the GPU build, pinned or not, starts keeping its threads
        # off the CPUs that other engine hosts' step loops hold (cpu_affinity.CoreCpuKeeper); the
        # CPU build's vLLM binds its own compute threads, so an unpinned one there moves nothing
        self._pin_pending = self._pin_cpu is not None or not vllm_compat.is_cpu_build()
        self._core_cpu: int | None = None  # the CPU the step loop was pinned to
        self._cpu_keeper: cpu_affinity.CoreCpuKeeper | None = None  # keeps the rest off it
        if self._k_engine > 0:
            # vLLM's dynamic speculative decoding path, made live.
            self.dynamic_sd_lookup = self._live_lookup  # type: ignore[assignment]
        self._poll_config(force=True)
        self._publish(time.monotonic())
        logger.info(
            "SpecPilot scheduler hook active (K_max=%d, channel=%s)",
            self._k_engine,
            self._channel and self._channel.path,
        )

    # -- config ------------------------------------------------------------
    def _poll_config(self, force: bool = False) -> bool:
        ch = self._channel
        if ch is None:
            return False
        seq = ch.config_seq()
        if seq == self._config_seq and not force:
            return False
        # decide under the command lock, so the API cannot give up on (withdraw) a command
        # between our read and our decision; busy: try again at the next step
        if not ch.try_lock():
            return False
        try:
            return self._take_config(ch, force)
        finally:
            ch.unlock()

    def _take_config(self, ch: Channel, force: bool) -> bool:
        seq, payload = ch.read_config()
        self._config_seq = seq
        if not payload:
            return False
        wk = payload.get("warmup_k")
        wk = None if wk is None else max(0, min(int(wk), self._k_engine))
        if wk != self._warmup_k:
            self._warmup_k = wk
            self._update_lean_ok()
            self._publish(time.monotonic())
        version = int(payload.get("version", 0))
        if version == self._config_version and not force:
            return False
        try:
            cfg = LiveConfig.model_validate(payload["config"])
            if self._quiet:  # the steps before the change belong to the policy that ran them
                self._observe_quiet()
            if self._lean:  # the step being scheduled goes through the live lookup (counted)
                self._leave_lean()
            self._flush_lean()
            self.controller.configure(cfg.speculation)
        except Exception as exc:  # keep the last good config
            self._config_error = f"version {version} refused by the engine core: {exc}"
            logger.error(self._config_error)
            self._publish(time.monotonic())
            ch.write_ack(seq, ACK_REFUSED)
            return False
        self._config = cfg
        self._config_dump = cfg.model_dump(mode="json")
        self._config_version = version
        self._gate_on = cfg.speculation.mode == "adaptive" and cfg.speculation.adaptive.per_request
        if not self._gate_on:
            self._gate.begin_step()  # the per-step counts say nothing while the gate is off
        self._gate.probe_every = cfg.speculation.adaptive.probe_every
        self._gate.prior = cfg.speculation.adaptive.prior
        self._gate.gain_model = cfg.speculation.adaptive.gain
        self._gate_fold_finished = self._gate_on and self._gate.prior == "mixture"
        self._probe_interval = self._gate.probe_every
        self._config_error = None
        self._cap_seqs = cfg.batch.max_num_seqs or self._startup_max_seqs
        self._cap_tokens = cfg.batch.max_num_batched_tokens or self._startup_max_tokens
        self._applied_at = time.time()
        self._ack_step = self._step_index
        self._k_first_use_step = None
        self._max_running_seen = len(self.running)  # type: ignore[attr-defined]
        self._caps_steady = False
        self._apply_caps()
        self._update_lean_ok()
        self._publish(time.monotonic())
        ch.write_ack(seq, ACK_APPLIED)
        return True

    # -- the lean path (LEAN_SAMPLE) ---------------------------------------------
    def _update_lean_ok(self) -> None:
        """Whether the config allows the lean path; leaves it at once when not."""
        self._lean_ok = (
            self._lean_allowed
            and self.controller.may_rest()
            and self._warmup_k is None
            and not (self._gate_on and self.GATE_DRAFTS)
            and (self._config_seq_view is not None or self._channel is None)
        )
        if not self._lean_ok and self._lean:
            self._leave_lean()

    def _rest_span(self) -> int:
        """Steps the lean path may schedule from now (0: none): the controller's
        :meth:`~engine_host.controller.SpeculationController.rest_steps`, at most
        ``LEAN_SPAN`` for a policy that decides K (unbounded at a static K = 0); from
        ``2 * BATCH_PAYS_REQUESTS`` requests the policy's rest and this bound are
        ``B // BATCH_PAYS_REQUESTS`` times as long (the ``REST_SPAN_SCALING`` comment). With the gate
        on and one request running, the span ends before the gate's next all-request probe
        (``_any_request_wants_drafts``), and it is taken also while the policy's own K is
        above 0: the gate held this step at K = 0 because the request's drafts do not pay,
        and until its next probe it holds every step there, so asking the policy meanwhile
        only costs the hook's time (the policy counts the steps, ``Policy.skip``). Under async
        scheduling the same holds for several requests whose batch the gate held at K = 0
        (``RequestDraftGate.batch_pays``), the span then at most ``GATE_COST_EVERY`` steps
        (``B // BATCH_PAYS_REQUESTS`` times that from ``2 * BATCH_PAYS_REQUESTS`` requests) and
        ending before the policy's next exploration. A request that joins ends the lone
        request's span at its first step, and the batch's below ``2 * BATCH_PAYS_REQUESTS``
        requests (above, the full path keeps the batch's answer through a join too)."""
        self._lean_probe_count = self._lean_join_ends = False
        b = len(self.running)  # type: ignore[attr-defined]
        # from 2 * BATCH_PAYS_REQUESTS requests a rest lasts B // BATCH_PAYS_REQUESTS times as long
        # (_rest_span_scaling; $SPECPILOT_REST_SPAN_SCALING=0: not): the full path that ends it
        # prices the whole batch again
        scale = max(b // self.BATCH_PAYS_REQUESTS, 1) if self._rest_span_scaling else 1
        span = self.controller.rest_steps(scale)
        if span >= 1 << 62:
            return span
        lone = self._gate_on and b == 1
        if lone:
            self._lean_probe_count = self._lean_join_ends = True
            to_probe = self._probe_interval - self._steps_planned_out - 1
            span = to_probe if span <= 0 else min(span, to_probe)
            return max(span, 0)
        if span <= 0 and self._gate_on and not self.GATE_DRAFTS and b > 1:
            # async, several requests: the batch rule held this step at K = 0 while the policy's K
            # is above 0 (the policy's own rests take the branch below). Until the all-request
            # probe the batch is held there unless it changes; the span also ends within
            # GATE_COST_EVERY steps, so that requests that finished are priced out as often as
            # the kept answer allows (_any_request_wants_drafts), and before the policy's next
            # exploration, which runs past the gate (EXPLORE_PAST_GATE_MIN_BATCH). A request that
            # joins ends the span below 2 * BATCH_PAYS_REQUESTS requests; above, the full path
            # itself keeps the batch's answer for B // BATCH_PAYS_REQUESTS steps after a join, and
            # one request among 32 or more seldom turns it, so the span runs on (under closed-loop
            # load a request joins every few steps: ending there, few spans would outlast a step)
            self._lean_probe_count = True
            self._lean_join_ends = b < 2 * self.BATCH_PAYS_REQUESTS
            to_probe = self._probe_interval - self._steps_planned_out - 1
            # (at 2 * BATCH_PAYS_REQUESTS or more the span runs on through joins, and the answers
            # the full path keeps GATE_COST_EVERY steps have all run out after it: scaled as above)
            return max(min(to_probe, self.GATE_COST_EVERY * scale, self.controller.steps_to_explore()), 0)
        return max(min(span, self.LEAN_SPAN * scale), 0)

    def _enter_lean(self, span: int) -> None:
        self._lean = True
        running = self.running  # type: ignore[attr-defined]
        self._lean_newest = running[-1] if running else None
        self._lean_left = span
        self._resting = span < 1 << 62  # a span of a policy that decides K (not a static K = 0)
        self._lean_outputs = 0
        self._t_output_done = 0.0
        if self._k_engine > 0:
            self.dynamic_sd_lookup = self._zero_lookup  # type: ignore[assignment]

    def _leave_lean(self) -> None:
        self._flush_lean()
        self._lean = False
        if self._k_engine > 0:
            self.dynamic_sd_lookup = self._live_lookup  # type: ignore[assignment]

    def _flush_lean(self) -> None:
        """Hand the lean path's step counts to the controller."""
        if self._lean_scheduled:
            self._lean_steps += self._lean_scheduled
            self.controller.count_scheduled_at_zero(self._lean_scheduled)
            if self._lean_probe_count:  # steps at K = 0 toward the gate's next probe
                self._steps_planned_out += self._lean_scheduled
            self._lean_scheduled = 0
        if self._lean_skipped:
            timed = self._lean_timed
            self.controller.skip_quiet(
                self._lean_skipped,
                self._lean_request_steps,
                timed=(timed, self._lean_timed_requests / timed, self._lean_timed_s / timed) if timed else None,
            )
            self._lean_skipped = self._lean_request_steps = self._lean_timed = self._lean_timed_requests = 0
            self._lean_timed_s = 0.0

    def _apply_caps(self) -> None:
        if self._caps_steady:
            return
        running = len(self.running)  # type: ignore[attr-defined]
        cap = min(max(self._cap_seqs, running), self._startup_max_seqs)
        self.max_num_running_reqs = cap
        if self._has_active_cap:
            self.max_num_active_reqs = cap
        self.max_num_scheduled_tokens = min(self._cap_tokens, self._startup_max_tokens)
        # without a cap below the start-up limits these values hold until the next config
        # (one that lowers max_num_seqs is followed down step by step as requests finish)
        self._caps_steady = self._cap_seqs >= self._startup_max_seqs and self._cap_tokens >= self._startup_max_tokens

    def _decide_k(self, batch_size: int) -> int:
        t = time.perf_counter()
        c = time.thread_time()
        self._k_explored = False
        if self._warmup_k is not None:  # start-up warm-up covering each depth
            k = self._warmup_k
            self._warmup_steps[k] += 1
            self._k_rule = "warmup"
        else:
            k = k_policy = self.controller.k_for_batch(batch_size)
            rule = "explore" if self.controller.exploring() else "policy"
            if self._gate_on:
                explored = batch_size >= self.EXPLORE_PAST_GATE_MIN_BATCH and self.controller.exploring()
                if explored and self._explore_by_class and not self._classes_may_pay():
                    # (EXPLORE_PAST_GATE_MIN_BATCH) the gate decides this step, and the policy ends
                    # the exploration, so that the steps after it may rest on the lean path
                    explored = False
                    self._explorations_held += 1
                    self.controller.end_exploration()
                    rule = "held"
                if batch_size > 1 and not self.GATE_DRAFTS:  # (docs/benchmarks.md: not kept on the sync path)
                    kb = self._batch_k(batch_size)
                    if kb > k:
                        k, rule = kb, "batch"
                kr = self._per_request_k(k)
                if kr != k:
                    k, rule = kr, "lone"
                if k > 0 and not explored:
                    self._probe_fired = False
                    if not self._any_request_wants_drafts(k):
                        k, rule = 0, "gate"
                    elif self._probe_fired:
                        rule = "probe"
                self._k_explored = explored and k > 0
                if k != k_policy:  # count the step, and report K, as scheduled
                    self.controller.record_scheduled(k_policy, k)
            self._k_rule = rule
        self._k_decided = k
        if self._k_first_use_step is None:
            self._k_first_use_step = self._step_index
        self._overhead_cpu_s += time.thread_time() - c
        d = time.perf_counter() - t
        self._overhead_s += d
        self._decide_s += d  # (inside vLLM's schedule(), through the K lookup: not vLLM's own time)
        return k

    def _k_next(self, batch_size: int) -> int:
        """K (tokens) the policy will use for the next step, without deciding it: the
        warm-up K; off 0; fixed the configured K; batch_table the table's K at this batch
        size; adaptive and the baselines their current choice. Clamped to 0..K_max."""
        if self._k_engine <= 0:
            return 0
        if self._warmup_k is not None:
            return self._warmup_k
        policy = self.controller.policy
        mode = self._config.speculation.mode
        if mode == "off":
            k = 0
        elif mode == "fixed":
            k = self._config.speculation.k
        elif mode == "batch_table":
            k = policy.k_for_batch(max(1, batch_size))  # a pure table lookup
        else:
            k = getattr(policy, "current", getattr(policy, "k", self.controller.k_current))
        return max(0, min(int(k), self._k_engine))

    # -- vLLM scheduler overrides ---------------------------------------------
    def add_request(self, request: Any) -> None:  # type: ignore[override]
        super().add_request(request)  # type: ignore[misc]
        if self._gate_on:
            # the per-request gate pools a new request's prior over its own class: sampled
            # requests (temperature > 0, vLLM's greedy threshold 1e-5) accept n-gram drafts
            # far less often than greedy ones (engine_host.request_gate). Only while the gate
            # is on: at a static K the lean path never reaches the gate's forget.
            sp = getattr(request, "sampling_params", None)
            temperature = getattr(sp, "temperature", 0.0) or 0.0
            self._gate.set_class(request.request_id, "sampled" if temperature >= 1e-5 else "greedy")

    def has_requests(self) -> bool:  # type: ignore[override]
        # Also called while the engine idles and is woken by a utility call, so a
        # config published while idle is acknowledged without waiting for traffic. With
        # requests, schedule() follows and reads the config itself (vLLM's engine core
        # asks this several times per step).
        busy = super().has_requests()  # type: ignore[misc]
        if self._aside:
            # (the hook steps aside only with a config channel: _step_aside)
            if (
                busy
                and self._config_seq_view[0] == self._config_seq  # type: ignore[index]
                and time.perf_counter() < self._publish_due
            ):
                return True
            self._step_in()
        if not busy:
            t = time.perf_counter()
            c = time.thread_time()
            self._poll_config()
            if self._published_step != self._step_index:
                # drained without a last output (requests aborted: a client's stop string or
                # disconnect): the state read while idle counts every step that ran
                self.controller.drained()
                self._publish(time.monotonic())
            self._overhead_s += time.perf_counter() - t
            self._overhead_cpu_s += time.thread_time() - c
            if self._trace is not None and self._trace.pending:
                # the engine waits for work: the trace's rows are written out now, after the
                # interpreter is handed to the thread sending the last outputs
                _yield_interpreter(0)
                self._flush_trace()
        return busy

    def schedule(self, *args: Any, **kwargs: Any):  # type: ignore[override]
        t = time.perf_counter()
        if self._lean:
            view = self._config_seq_view
            if (
                (view is None or view[0] == self._config_seq)
                and self._lean_left > 0
                # a lone request's span (or a small batch's): a request that joined is decided at its first step
                and (not self._lean_join_ends or (self.running and self.running[-1] is self._lean_newest))  # type: ignore[attr-defined]
            ):  # (view None: no channel)
                self._lean_left -= 1
                if not self._caps_steady:  # a cap below the start-up limits, followed down
                    self._apply_caps()
                self._step_index += 1
                self._lean_scheduled += 1
                # wall time only: a thread-CPU clock read costs more than the rest of the span
                t1 = time.perf_counter()
                d = t1 - t
                self._overhead_s += d
                self._overhead_cpu_s += d
                out = super().schedule(*args, **kwargs)  # type: ignore[misc]
                self._clock.scheduled(t, 0, 0, time.perf_counter() - t1, out)  # (vLLM's own schedule(), for the trace)
                return out
            if self._resting:  # the rest span is over (or a request joined): this step decides K again
                self._leave_lean()
        c = time.thread_time()
        self._t_sched = t
        if self._pin_pending:  # the first step only
            self._pin_step_loop()
        # the cheap checks inline: this runs every engine step with the CPU's caches cold
        view = self._config_seq_view
        if view is None or view[0] != self._config_seq:
            self._poll_config()
        if not self._caps_steady:
            self._apply_caps()
        self._k_drafted = self._k_decided
        self._drafts_explored = self._k_explored
        # with the gate off only its forgetting of finished requests is due (GATE_FORGET_EVERY)
        if self._k_engine > 0 and (self._gate_on or self._step_index >= self._gate_forget_at):
            self._gate_drafts()
        self._overhead_cpu_s += time.thread_time() - c
        t1 = time.perf_counter()
        self._overhead_s += t1 - t
        self._decide_s = 0.0
        self._k_rule = ""  # (set by _decide_k when vLLM asks for this step's K)
        out = super().schedule(*args, **kwargs)  # type: ignore[misc]
        vllm_s = time.perf_counter() - t1 - self._decide_s  # vLLM's own schedule(), less the K decision in it
        # the K the proposer runs with after this step (engine_host.vllm_patches reads it)
        k_sched = getattr(out, "num_spec_tokens_to_schedule", None)
        self.specpilot_last_scheduled_k = k_sched if isinstance(k_sched, int) else None
        self._clock.scheduled(t, self._k_drafted, self._k_decided, vllm_s, out, self._k_rule)
        self._step_index += 1
        return out

    def _pin_step_loop(self) -> None:
        """At the first step (once): pin the thread running the step loop (this one) to
        ``$SPECPILOT_CORE_CPU`` when one was taken, and start the engine host's
        :class:`~engine_host.cpu_affinity.CoreCpuKeeper`."""
        cpu, self._pin_cpu, self._pin_pending = self._pin_cpu, None, False
        base = set(cpu_affinity.calling_thread_cpus())  # the launcher's mask, before the pin (empty: no affinity calls)
        if not base:
            return
        if cpu is not None:
            if not cpu_affinity.pin_calling_thread(cpu):
                return
            self._core_cpu = cpu
        # engine hosts that claimed their CPUs after this one started, and threads born of the
        # pinned step loop, are kept off the step loops' CPUs from now on
        api = envs.api_pid()
        pids = [os.getpid()] + ([int(api)] if api.isdigit() else [])
        step_tid = threading.get_native_id() if cpu is not None else None
        self._cpu_keeper = cpu_affinity.CoreCpuKeeper(cpu, step_tid, pids, base).start()

    def _draft_token_cost(self, batch_size: int, k: int) -> float:
        """Cost ``c`` of one verified draft token at depth ``k`` for ``batch_size``
        requests (``engine_host.request_gate.draft_token_cost``): only verification is
        saved by dropping a request's drafts (a draft model's own passes run for the whole
        batch), so the extra tokens' time at depth k against a plain step."""
        tm = self.controller.step_time
        b = batch_size
        verify_s = tm.predict_tokens(b, b * (1.0 + k), k) - tm.predict_tokens(b, float(b), k)
        t_plain = tm.predict(b, 0)
        return draft_token_cost(t_plain, t_plain + verify_s, k)

    def _gate_costs(self, batch_size: int, k: int) -> tuple[float, float]:
        """``(draft_token_cost, step_cost)`` for ``batch_size`` requests at depth ``k``: the
        cost of one verified draft token (:meth:`_draft_token_cost`, fraction of a plain
        step per token) and what a step at depth k that verifies no draft costs over a plain
        step (fraction 0.., never below the least a K > 0 step costs,
        ``StepTimeModel.spec_floor_ratio``). Kept for ``GATE_COST_EVERY`` steps per
        (batch size, K)."""
        memo = self._gate_cost_memo
        hit = memo.get((batch_size, k))
        if hit is not None and self._step_index - hit[2] < self.GATE_COST_EVERY:
            self._gate_cost_last = (hit[0], hit[1])
            return hit[0], hit[1]
        cost = self._draft_token_cost(batch_size, k)
        tm = self.controller.step_time
        b = batch_size
        t_plain = tm.predict(b, 0)
        step_cost = max(tm.predict_tokens(b, float(b), k) - t_plain, 0.0) / t_plain if t_plain > 0 else 0.0
        step_cost = max(step_cost, tm.spec_floor_ratio())  # never below the least a K > 0 step costs
        if len(memo) > 512:
            memo.clear()
        memo[(batch_size, k)] = (cost, step_cost, self._step_index)
        self._gate_cost_last = (cost, step_cost)
        return cost, step_cost

    def _per_request_k(self, k: int) -> int:
        """The step's K with one running request: the deeper of the controller's ``k`` and
        the request's own depth (``RequestDraftGate.depth``, up to the policy's upper
        bound). The controller's per-position estimates are the traffic's, so after chat a
        new docs request would otherwise run at chat's K = 0, where nothing is learned, until
        the controller explores its way up; with several requests under async scheduling the
        batch's own estimates do this (``_batch_k``). A request whose own depth is 0 is
        offered the controller's K, and at least ``PROBE_DEPTH`` drafts, which
        ``_any_request_wants_drafts`` turns into a probe after ``probe_every`` steps (backed
        off while probes find nothing) and K = 0 otherwise: a new request starts at its class's acceptance
        (``RequestDraftGate.prior_mean``), so a docs request after chat is found by its
        probes. Unchanged when the gate is off."""
        if not self._gate_on:
            return k
        running = self.running  # type: ignore[attr-defined]
        hi = int(getattr(self.controller.policy, "k_hi", self._k_engine))
        if len(running) != 1 or k >= hi:
            return k
        own = self._gate.depth(running[0].request_id, self._gate_costs(1, hi)[0], hi)
        if own == 0:  # a probe, if any, at PROBE_DEPTH at least (an exploration's K = 1 shows little)
            return max(k, min(self.PROBE_DEPTH, hi))
        return max(k, own)

    def _batch_k(self, batch_size: int) -> int:
        """The step's K (tokens) that the running requests' own acceptance estimates make best
        for the whole batch, 0 when none beats plain decoding by the policy's margin. The
        goodput law (Leviathan et al., arXiv 2211.17192: a k-token draft at per-token
        acceptance ``a`` yields ``x(k) = sum_{j<=k} a^j`` tokens, or that as its class's
        drafts measured it: ``RequestDraftGate.gain``) is applied to the batch,
        ``G(K) = (B + sum_i r_i x_i(K)) / T(B, K)``, with ``a_i`` and ``r_i`` each request's
        acceptance and draft rate (``RequestDraftGate``, a new request at its class's prior)
        and ``T`` the step-time model's prediction for the draft tokens verified: under async
        scheduling every request verifies the step's K. Used under async scheduling only
        (``_decide_k``; the synchronous path was tried and not kept: docs/benchmarks.md).

        The controller's own estimates are pooled over the traffic and learn at K = 0 only
        from its explorations, so after chat a batch with requests that quote would wait for
        them; the requests' estimates (verified drafts, class priors) know at once.
        Recomputed every ``GATE_COST_EVERY`` steps."""
        k_memo, at = self._batch_k_memo
        if self._step_index - at < self.GATE_COST_EVERY:
            return k_memo
        hi = int(getattr(self.controller.policy, "k_hi", self._k_engine))
        if hi <= 0:
            return 0
        # gain[j]: sum over requests of r_i times what position j adds (a_i^j under the geometric
        # law); rate: expected requests with a draft
        gain, rate = self._gate.batch_gains([req.request_id for req in self.running], hi)  # type: ignore[attr-defined]
        b = float(batch_size)
        # (every K > 0 at least what a speculative step costs: StepTimeModel.predict_curve)
        times = self.controller.step_time.predict_curve(batch_size, [rate / b * j for j in range(hi + 1)])
        margin = float(getattr(self._config.speculation.adaptive, "margin", 0.0))
        best, best_g = 0, b / times[0] * (1.0 + margin)
        tokens = b  # b + sum_i r_i x_i(j)
        for j in range(1, hi + 1):
            tokens += gain[j]
            g = tokens / times[j]
            if g > best_g:
                best, best_g = j, g
        self._batch_k_memo = (best, self._step_index)
        return best

    def _any_request_wants_drafts(self, k: int) -> bool:
        """False when the per-request gate is on and no running request's drafts would pay
        at depth ``k`` (nor is due for a probe), or under async scheduling the batch's would
        not: the next step then runs at K = 0 (``RequestDraftGate.plan_batch``: each request's
        probes backed off while they find nothing and taken together with the others';
        ``RequestDraftGate.batch_pays``). True whenever the gate is off.

        Where drafts cannot be dropped per request (``GATE_DRAFTS`` False: async
        scheduling), a request's probe would make every request of the step draft, so the
        probes are taken together: after ``probe_every`` steps in a row at K = 0 one step
        runs at depth ``k`` for all. A probe after which the batch's drafts still do not pay
        doubles the steps to the next, up to ``PROBE_BACKOFF`` times ``probe_every``; drafts
        that pay (after a probe's result or with a new request's prior), a verification that
        accepted at least half its drafts, or a request that joined since and whose class's
        requests' drafts pay often enough (``PROBE_NEW_SHARE``) bring them back to
        ``probe_every``; a request that starts alone counts its wait from its own first step.
        There the batch answers (``RequestDraftGate.batch_pays``: the requests' expected gains together
        against what every request's verification costs, since each verifies the step's
        drafts), and the answer is kept for ``GATE_COST_EVERY`` steps at the same K and batch
        until drafts are verified, rather than the batch being priced at every step
        (docs/benchmarks.md)."""
        if not self._gate_on:
            return True
        running = self.running  # type: ignore[attr-defined]
        if not running:
            return True
        b = len(running)
        if self.GATE_DRAFTS:
            cost, step_cost = self._gate_costs(b, k)
            # every request is planned, so each one's probe count advances; probes share their steps
            return self._gate.plan_batch([req.request_id for req in running], k, cost, step_cost)
        # async: every request verifies the step's drafts, so the batch decides: drafting pays
        # when the requests' expected gains together beat what all their verifications cost
        # (RequestDraftGate.batch_pays; one request whose drafts pay, a new one at a high
        # class prior, does not carry 63 whose drafts are rejected). No request keeps a probe
        # count of its own. The answer holds for GATE_COST_EVERY steps at the same K unless the
        # batch changes or drafts are verified (make_spec_decoding_stats), and then for
        # B // BATCH_PAYS_REQUESTS steps (BATCH_PAYS_REQUESTS)
        newest = running[-1]
        memo = self._wants_memo
        age = self._step_index - memo[3]
        if (
            memo[0] == k
            and age < self.GATE_COST_EVERY
            and ((memo[1] is newest and memo[2] == b and not self._wants_dirty) or age < b // self.BATCH_PAYS_REQUESTS)
        ):
            wants = memo[4]
        else:
            cost, step_cost = self._gate_costs(b, k)
            wants = self._gate.batch_pays([req.request_id for req in running], k, cost, step_cost)
            self._wants_memo = (k, newest, b, self._step_index, wants)
            self._wants_dirty = False
        if wants:
            self._probe_newest = newest
            self._probe_interval = self._gate.probe_every
        elif newest is not self._probe_newest:  # a new request, not yet probed
            self._probe_newest = newest
            if not self._probe_by_prior or self._new_request_may_pay(newest, b, k):
                self._probe_interval = self._gate.probe_every
            if self._probe_by_prior and b == 1:
                # a lone request's wait counts from its own first step: the steps of the request
                # before it would otherwise have it drafted from its prefill (docs/gpu.md, host 38)
                self._steps_planned_out = 0
        if wants:
            self._steps_planned_out = 0
        else:
            self._steps_planned_out += 1
            if self._steps_planned_out >= self._probe_interval:
                self._steps_planned_out = 0
                self._probe_interval = min(2 * self._probe_interval, self.PROBE_BACKOFF * self._gate.probe_every)
                wants = self._probe_fired = True
        return wants

    def _new_request_may_pay(self, req: Any, batch_size: int, k: int) -> bool:
        """Whether request ``req``, new to a batch of ``batch_size`` whose drafts at depth ``k``
        do not pay, may be one whose own drafts would: at least ``PROBE_NEW_SHARE`` of its
        class's finished requests had drafts that pay at ``k`` (``RequestDraftGate.paying_share``
        at the gate's current costs; always under the pooled prior)."""
        gate = self._gate
        cost, step_cost = self._gate_costs(batch_size, k)
        cls = gate.request_class(req.request_id)
        share = gate.paying_share(cls, k, cost, step_cost)
        self._new_request_share = (cls, share)
        return share >= self.PROBE_NEW_SHARE

    def _burst_may_pay(self) -> bool:
        """Whether the running requests, the first several after the engine drained, may be
        ones whose drafts pay (``SpeculationController.burst_may_pay``, asked by the adaptive
        policy before it brings its next exploration near): True unless the per-request gate
        is on under the mixture prior and, for every class among them, fewer than
        ``PROBE_NEW_SHARE`` of the class's finished requests had drafts that pay at the
        policy's deepest K (``RequestDraftGate.paying_share`` at the gate's current costs; a
        class with fewer than ``MIXTURE_MIN_REQUESTS`` finished requests may pay). At shallow
        K a class's share turns on a few hundredths of a step's cost; at the deepest K only
        requests that quote pay. Counts the bursts it answers False to. Raises nothing."""
        if self._classes_may_pay():
            return True
        self._drain_explores_skipped += 1
        return False

    def _classes_may_pay(self) -> bool:
        """Whether some running request is of a class whose drafts may pay: True unless the
        per-request gate is on under the mixture prior and, for every class among the running
        requests, fewer than ``PROBE_NEW_SHARE`` of the class's finished requests had drafts
        that pay at the policy's deepest K (``RequestDraftGate.paying_share`` at the gate's
        current costs; a class with fewer than ``MIXTURE_MIN_REQUESTS`` finished requests may
        pay). Asked after a drain (:meth:`_burst_may_pay`) and at an exploration's first step at
        several requests (``EXPLORE_PAST_GATE_MIN_BATCH``). Raises nothing."""
        gate = self._gate
        if not self._gate_on or gate.prior != "mixture":
            return True
        running = self.running  # type: ignore[attr-defined]
        hi = int(getattr(self.controller.policy, "k_hi", self._k_engine))
        if not running or hi <= 0:
            return True
        cost, step_cost = self._gate_costs(len(running), hi)
        seen: set[str | None] = set()
        for req in running:
            cls = gate.request_class(req.request_id)
            if cls not in seen:
                seen.add(cls)
                if gate.paying_share(cls, hi, cost, step_cost) >= self.PROBE_NEW_SHARE:
                    return True
        return False

    def _gate_drafts(self) -> None:
        """Draft length per request (``engine_host.request_gate``): before vLLM schedules
        the step, drop the drafts of running requests whose own acceptance does not pay
        for their verification; vLLM then schedules them without draft tokens."""
        gate = self._gate
        gate.begin_step()
        if self._step_index >= self._gate_forget_at:  # (lean steps skip this method: not a modulo)
            self._gate_forget_at = self._step_index + self.GATE_FORGET_EVERY
            gate.forget(live_ids=set(self.requests))  # type: ignore[attr-defined]
        if not self._gate_on or self._warmup_k is not None or not self.GATE_DRAFTS:
            return
        running = self.running  # type: ignore[attr-defined]
        b = len(running)
        k = self._k_drafted
        if b == 0 or k <= 0:
            return
        cost = self._gate_costs(b, k)[0]
        explored = self._drafts_explored  # an exploration's drafts: every request's is verified
        for req in running:
            drafts = req.spec_token_ids
            if getattr(req, "num_output_tokens", 0) > 0:  # past its prefill: it could have drafted
                gate.observe_offer(req.request_id, bool(drafts))
            if drafts:
                if explored:
                    gate.explored(req.request_id)
                elif not gate.allows(req.request_id, len(drafts), cost):
                    req.spec_token_ids = []

    def make_spec_decoding_stats(self, spec_decoding_stats, num_draft_tokens, num_accepted_tokens, *args, **kwargs):  # type: ignore[override]
        # once per request with drafts, inside vLLM's update_from_output: the verification is
        # kept and folded in with the step's others (_fold_verified) when that returns
        if num_draft_tokens:
            self._wants_dirty = True  # drafts verified: whether drafts pay is asked again
            if num_accepted_tokens and (2 * num_accepted_tokens >= num_draft_tokens or not self._probe_by_prior):
                # at least half the drafts accepted: the async probes' wait starts again from probe_every
                self._probe_interval = self._gate.probe_every
            self._verified.append((kwargs.get("request_id"), num_draft_tokens, num_accepted_tokens))
        return super().make_spec_decoding_stats(  # type: ignore[misc]
            spec_decoding_stats, num_draft_tokens, num_accepted_tokens, *args, **kwargs
        )

    def _fold_verified(self) -> tuple[int, int]:
        """Fold the verifications kept by :meth:`make_spec_decoding_stats` since the last
        call into the per-request gate (:meth:`RequestDraftGate.observe_many`), the step's
        draft and accepted tokens and the per-position histograms (``_hist[i]``:
        verifications with more than ``i`` tokens accepted; ``_dhist[i]``: with more than
        ``i`` drafted; ``_fhist``, ``_fdhist`` and ``_full_n``: the same over the verifications
        proposed after a draft accepted in full, and their number). Returns the step's (draft
        tokens, accepted tokens)."""
        verified = self._verified
        self._verified = []
        after_full: list[bool] | None = [] if self._run_states else None
        self._gate.observe_many(verified, after_full)
        hist, dh = self._hist, self._dhist
        top = len(hist)
        n_acc = [0] * (top + 1)  # verifications by tokens accepted (top: top or more)
        n_draft = [0] * (top + 1)
        drafted = accepted = 0
        for _, d, a in verified:
            drafted += d
            accepted += a
            n_acc[a if a < top else top] += 1
            n_draft[d if d < top else top] += 1
        _add_above(hist, dh, n_acc, n_draft)
        if after_full and any(after_full):
            f_acc = [0] * (top + 1)
            f_draft = [0] * (top + 1)
            n_full = 0
            for (_, d, a), full in zip(verified, after_full):
                if full:
                    n_full += 1
                    f_acc[a if a < top else top] += 1
                    f_draft[d if d < top else top] += 1
            _add_above(self._fhist, self._fdhist, f_acc, f_draft)
            self._full_n += n_full
        self._drafted += drafted
        self._accepted += accepted
        return drafted, accepted

    def update_from_output(self, scheduler_output, model_runner_output):  # type: ignore[override]
        t0 = time.perf_counter()
        outputs = super().update_from_output(scheduler_output, model_runner_output)  # type: ignore[misc]
        t = time.perf_counter()
        # under async scheduling the last schedule() is the *next* step: match outputs to
        # their own step (engine_host.step_clock)
        step_time, step = self._clock.output(t, scheduler_output)
        if self._lean:
            n = self._lean_outputs = self._lean_outputs + 1
            if (
                n % self.LEAN_SAMPLE
                and t < self._publish_due
                and self.running  # type: ignore[attr-defined]
                and not self._verified  # drafts verified (a probe's, in flight when the rest began): observed
            ):
                if self._trace is not None and step is not None:  # profiling: every step has its row
                    self._trace_row(
                        step, t, scheduler_output, 0, 0, None, model_runner_output, path="lean", vllm_update_s=t - t0
                    )
                n_req = len(scheduler_output.num_scheduled_tokens)
                if (
                    self._stretch.teaches(n_req, scheduler_output.total_num_scheduled_tokens == n_req)
                    and self._lean_times_on
                    and step is not None  # (an output of a step scheduled while the hook stood aside: not timed)
                ):
                    self._lean_timed += 1
                    self._lean_timed_requests += n_req
                    self._lean_timed_s += step_time
                self._busy_s += step_time
                self._lean_skipped += 1
                self._lean_request_steps += n_req
                d = time.perf_counter() - t
                self._overhead_s += d
                self._overhead_cpu_s += d
                return outputs
        c = time.thread_time()
        step_drafted = step_accepted = 0
        if self._verified:
            step_drafted, step_accepted = self._fold_verified()
        if self._gate_fold_finished:
            # the mixture prior learns from each finished request at once (vLLM names the
            # requests that finished or were aborted since the last step in its output)
            finished = getattr(scheduler_output, "finished_req_ids", None)
            if finished:
                for req_id in finished:
                    self._gate.forget(req_id=req_id)
        k_drafted = step.k_drafted if step is not None else self._k_drafted
        k_proposed = step.k_proposed if step is not None else self._k_decided
        n_dec = 0
        total = 0
        if self._k_engine > 0:  # without speculation there is nothing for the controller to learn
            spec = scheduler_output.scheduled_spec_decode_tokens
            scheduled = scheduler_output.num_scheduled_tokens
            if not spec and scheduler_output.total_num_scheduled_tokens == len(scheduled):
                n_dec = total = len(scheduled)  # one token each, no drafts: every request only decoded
            else:
                for req_id, n in scheduled.items():
                    total += 1
                    drafts = spec.get(req_id)
                    if n == 1 + (len(drafts) if drafts else 0):
                        n_dec += 1
        if self._trace is not None and step is not None:
            self._trace_row(
                step,
                t,
                scheduler_output,
                k_drafted,
                k_proposed,
                n_dec,
                model_runner_output,
                step_drafted,
                step_accepted,
                path="lean" if self._lean else "full",
                vllm_update_s=t - t0,
            )
        # a lone request's first decode steps do not teach the step-time model (their
        # cost is not what its later steps cost: DecodeStretch); warm-up steps always do
        pure = (
            self._stretch.teaches(n_dec, n_dec == total and n_dec > 0)
            or (self._warmup_k is not None and n_dec == total)
        ) and step is not None  # (not timed: scheduled while the hook stood aside)
        running = len(self.running)  # type: ignore[attr-defined]
        if running > self._max_running_seen:
            self._max_running_seen = running
        now = time.monotonic()
        if n_dec:
            if not self._drafted and not k_drafted and not self._draft_fetch_s and self._warmup_k is None:
                # a quiet step (nothing verified, nothing fetched): kept, and folded in with
                # the next few (see QUIET_STEPS)
                quiet = self._quiet
                quiet.append((n_dec, k_proposed, step_time, pure, now))
                if len(quiet) >= self.QUIET_STEPS:
                    self._observe_quiet()
            else:
                if self._quiet:
                    self._observe_quiet()
                self.controller.observe(
                    StepObservation(
                        batch_size=n_dec,
                        k_drafted=k_drafted,
                        k_proposed=k_proposed,
                        num_draft_tokens=self._drafted,
                        num_accepted_tokens=self._accepted,
                        accepted_hist=list(self._hist),
                        draft_hist=list(self._dhist),
                        step_time_s=step_time,
                        pure_decode=pure,
                        now=now,
                        warmup=self._warmup_k is not None,
                        draft_fetch_s=self._draft_fetch_s,
                        full_batch=min(self._full_n, n_dec),
                        full_accepted_hist=list(self._fhist) if self._full_n else None,
                        full_draft_hist=list(self._fdhist) if self._full_n else None,
                    )
                )
        self._draft_fetch_s = 0.0
        drafted = self._drafted
        if drafted:  # (the histograms only count with drafts)
            self._drafted = self._accepted = 0
            hist, dh = self._hist, self._dhist
            for i in range(len(hist)):
                hist[i] = 0
                dh[i] = 0
            if self._full_n:
                self._full_n = 0
                fh, fdh = self._fhist, self._fdhist
                for i in range(len(fh)):
                    fh[i] = 0
                    fdh[i] = 0
        self._busy_s += step_time
        if running == 0:  # (a drained engine's output always takes this path, lean or not)
            self.controller.drained()
        if now - self._last_publish >= PUBLISH_INTERVAL_S or running == 0:
            self._publish(now)
        if self._lean:
            # drained: a new request is decided afresh; drafts verified: what they say is
            # acted on at the next step (a probe's result raises a request's own depth)
            if self._resting and (running == 0 or drafted):
                self._leave_lean()
        elif (
            self._lean_ok
            and running
            and self._k_decided == 0
            and self.specpilot_last_scheduled_k in (0, None)
            and not drafted  # nothing verified in this step whose result is not acted on yet
            and not k_proposed  # nor drafts in flight (async: proposed here, verified next)
        ):
            span = self._rest_span()
            if span > 0:
                self._enter_lean(span)
        self._overhead_s += time.perf_counter() - t
        self._overhead_cpu_s += time.thread_time() - c
        self._t_output_done = time.perf_counter()
        if (
            self._lean
            and self._aside_ok
            and not self._resting
            and self._caps_steady
            and running
            and self._config_seq_view is not None
        ):
            self._step_aside()
        return outputs

    # -- stepping aside at a static K = 0 -----------------------------------------
    def _step_aside(self) -> None:
        """Take the hook out of vLLM's per-step calls (the class comment above ``__init__``):
        the engine core's ``schedule()`` and ``update_from_output()`` become vLLM's own until
        :meth:`_step_in`."""
        base = super()  # vLLM's class after the hook in the method resolution order
        d = self.__dict__
        d["schedule"] = base.schedule  # type: ignore[attr-defined]
        d["update_from_output"] = base.update_from_output  # type: ignore[attr-defined]
        step = self.current_step  # type: ignore[attr-defined]
        self._aside_from = (step, time.perf_counter(), len(self.running))  # type: ignore[attr-defined]
        self._aside = True

    def _step_in(self) -> None:
        """Put the hook back into vLLM's per-step calls and count the steps vLLM ran while it
        stood aside (at K = 0: the lean path's counts, flushed with them)."""
        d = self.__dict__
        d.pop("schedule", None)
        d.pop("update_from_output", None)
        self._aside = False
        step0, t0, running0 = self._aside_from
        steps = max(0, self.current_step - step0)  # type: ignore[attr-defined]
        dt = time.perf_counter() - t0
        running = len(self.running)  # type: ignore[attr-defined]
        self._step_index += steps
        self._lean_scheduled += steps
        if steps and running == running0 == 1 and self._lean_times_on:
            # a lone request's decode steps (at one client the engine drains between requests): their mean
            # time is a plain step's
            self._lean_timed += steps
            self._lean_timed_requests += steps
            self._lean_timed_s += dt
        # one output a step: the step in flight at the step aside came back meanwhile, the one in flight now comes back to the hook
        self._lean_skipped += steps
        self._lean_request_steps += steps * running
        if running > self._max_running_seen:
            self._max_running_seen = running
        self._busy_s += dt
        self._aside_s += dt
        self._aside_steps += steps
        self._clock.clear()  # the steps in flight were scheduled by vLLM alone: their outputs are not timed
        # the next output takes the full path (the lean path's sample), where the hook steps aside again:
        # after a drain the next request's steps are vLLM's from its first output on
        self._lean_outputs = self.LEAN_SAMPLE - 1

    def _trace_row(
        self,
        step: Any,
        t_output: float,
        out: Any,
        k_drafted: int,
        k_proposed: int,
        n_dec: int | None,
        runner_out: Any = None,
        draft_tokens: int = 0,
        accepted_tokens: int = 0,
        path: str = "full",
        vllm_update_s: float | None = None,
    ) -> None:
        """One row of the step trace (``engine_host.step_trace``): the step as scheduled,
        when its output came back (s), its K verified and proposed, its requests that only
        decoded (``n_dec``), of all it scheduled, their KV-cache length (tokens), the CUDA
        graph mode the model runner reported for it (``runner_out.cudagraph_stats``, set when
        vLLM runs with ``--cudagraph-metrics``), the draft and accepted tokens its output
        verified, and, with the per-request gate on, outside the lean path and at most
        ``TRACE_ESTIMATE_MAX_BATCH`` requests running (the profile's own cost grows with the
        batch), the highest acceptance estimate of the running requests, the newest one's
        class prior, and the gate's last draft-token and step costs (``_gate_costs``); the hook's
        ``path`` that handled the output (``lean``: a lean step whose output is observed, one in
        ``LEAN_SAMPLE``, is still ``lean``), and vLLM's own ``schedule()`` for the step and
        ``update_from_output()`` for the output (s; ``vllm_update_s``), and the hook's rule that set
        the step's K (``ScheduledStep.rule``). ``n_dec`` None: counted here (the lean path's rows).
        Its time is taken out of the hook's clocks (:meth:`_untime_trace`)."""
        assert self._trace is not None
        t0 = time.perf_counter()
        if n_dec is None:
            n_dec = sum(1 for m in out.num_scheduled_tokens.values() if m == 1)
        estimate = prior = token_cost = step_cost = None
        running = self.running  # type: ignore[attr-defined]
        if self._gate_on and running and not self._lean and len(running) <= self.TRACE_ESTIMATE_MAX_BATCH:
            gate = self._gate
            estimate = max(gate.acceptance(r.request_id) for r in running)
            prior = gate.prior_mean(gate.request_class(running[-1].request_id))
            token_cost, step_cost = self._gate_cost_last
        requests = self.requests  # type: ignore[attr-defined]
        context = 0
        for req_id in out.num_scheduled_tokens:
            req = requests.get(req_id)
            if req is not None:  # None: it finished in this step
                context += req.num_computed_tokens
        self._trace.add(
            step.t_scheduled,
            t_output,
            k_drafted,
            k_proposed,
            n_dec,
            len(out.num_scheduled_tokens),
            int(getattr(out, "total_num_scheduled_tokens", 0) or 0),
            context,
            graph_mode(getattr(runner_out, "cudagraph_stats", None)),
            draft_tokens,
            accepted_tokens,
            estimate,
            prior,
            token_cost,
            step_cost,
            path,
            step.vllm_schedule_s,
            vllm_update_s,
            step.rule,
        )
        self._untime_trace(time.perf_counter() - t0)

    def _flush_trace(self) -> None:
        """Write the step trace's rows out, its time kept out of the hook's clocks."""
        assert self._trace is not None
        t0 = time.perf_counter()
        try:
            self._trace.flush()
        except OSError:  # never let profiling break scheduling
            logger.exception("could not write the step trace")
        self._untime_trace(time.perf_counter() - t0)

    def _untime_trace(self, d: float) -> None:
        """Take ``d`` (s) spent on the step trace out of the hook's clocks: the trace is a
        profiling aid the operator turns on, not the hook's cost, and a row per step (its
        context sum and formatting) would otherwise be most of what the lean path's clock holds.
        Kept as ``overhead.trace_seconds`` (wall time; the same taken out of the CPU clock)."""
        self._trace_s += d
        self._overhead_s -= d
        self._overhead_cpu_s -= d

    def _observe_quiet(self) -> None:
        """Fold the kept quiet steps into the controller, oldest first, as the observations
        each step would have made (``QUIET_STEPS``, ``SpeculationController.observe_quiet``)."""
        self.controller.observe_quiet(self._quiet)
        self._quiet.clear()

    def update_draft_token_ids(self, draft_token_ids: Any) -> None:  # type: ignore[override]
        """vLLM's engine core hands over the drafts it fetched from the worker after a step
        (``EngineCore.post_step``, synchronous scheduling at K > 0). The time since this
        step's outputs were handed back, the fetch included, is part of what the next step
        (which verifies these drafts) costs: it is reported with that step
        (:attr:`StepObservation.draft_fetch_s`), since the step clock does not see it."""
        super().update_draft_token_ids(draft_token_ids)  # type: ignore[misc]
        if self._t_output_done > 0.0:
            self._draft_fetch_s += time.perf_counter() - self._t_output_done
            self._t_output_done = 0.0

    # -- state ---------------------------------------------------------------
    def _publish(self, now: float) -> None:
        self._last_publish = now
        self._published_step = self._step_index
        self._publish_due = time.perf_counter() + PUBLISH_INTERVAL_S
        if self._quiet:
            self._observe_quiet()
        self._flush_lean()
        # a busy engine's step trace is written out once TRACE_FLUSH_ROWS rows are kept (an idle
        # one's when it waits for work: has_requests)
        if self._trace is not None and self._trace.pending >= self.TRACE_FLUSH_ROWS:
            self._flush_trace()
        if self._channel is None:
            return
        running = len(self.running)  # type: ignore[attr-defined]
        try:
            waiting = len(self.waiting)  # type: ignore[attr-defined]
        except TypeError:  # pragma: no cover
            waiting = 0
        state = {
            "core_pid": os.getpid(),
            "core_cpu": self._core_cpu,
            "core_thread_cpus": cpu_affinity.calling_thread_cpus(),
            "core_cpu_threads_moved": self._cpu_keeper.moved if self._cpu_keeper is not None else 0,
            "core_started_at": self._started_at,
            "published_at": time.time(),
            "limits": self._limits,
            "config_version": self._config_version,
            "config": self._config_dump,
            "config_applied_at": self._applied_at,
            "config_ack_step": self._ack_step,
            "config_error": self._config_error,
            "k_current": self._k_decided if self._warmup_k is not None else self.controller.k_current,
            "k_next": self._k_next(running),
            "warmup_k": self._warmup_k,
            "warmup_steps_at_k": list(self._warmup_steps),
            "k_first_use_step": self._k_first_use_step,
            "step_index": self._step_index,
            "running": running,
            "waiting": waiting,
            "max_running_seen_since_config": self._max_running_seen,
            "caps_in_force": {
                "max_num_seqs": self._cap_seqs,
                "max_num_batched_tokens": min(self._cap_tokens, self._startup_max_tokens),
                "max_num_running_reqs_now": int(self.max_num_running_reqs),
            },
            "controller": self.controller.snapshot(),
            "per_request": dict(
                self._gate.summary(),
                enabled=self._gate_on,
                # async scheduling: steps at K = 0 between probes of every request now, and as configured
                probe_interval_steps=None if self.GATE_DRAFTS else self._probe_interval,
                probe_every_steps=self._gate.probe_every,
                # async scheduling: the last request that joined a batch whose drafts did not pay,
                # its class and the share of that class's requests whose drafts would (PROBE_NEW_SHARE)
                new_request_paying_share=None
                if self._new_request_share is None
                else {"class": self._new_request_share[0], "share": round(self._new_request_share[1], 4)},
                # bursts after a drain that the adaptive policy did not explore soon: none of their
                # requests' classes may pay (_burst_may_pay)
                drain_explorations_skipped=self._drain_explores_skipped,
                # explorations at several requests left to the gate (and ended at their first step),
                # not run past it: none of the running requests' classes may pay (EXPLORE_PAST_GATE_MIN_BATCH)
                explorations_held=self._explorations_held,
            ),
            "overhead": {
                "hook_seconds": round(self._overhead_s, 6),
                "hook_cpu_seconds": round(self._overhead_cpu_s, 6),
                "busy_seconds": round(self._busy_s, 6),
                "trace_seconds": round(self._trace_s, 6),
                # the hook stood aside (static K = 0): wall time with requests running (s) and steps
                "aside_seconds": round(self._aside_s, 6),
                "aside_steps": self._aside_steps,
                # steps on the lean path, less those stood aside; the rest of step_index took the full path
                "lean_steps": self._lean_steps - self._aside_steps,
                "fraction": (self._overhead_s / self._busy_s) if self._busy_s > 0 else None,
                "cpu_fraction": (self._overhead_cpu_s / self._busy_s) if self._busy_s > 0 else None,
            },
        }
        try:
            self._channel.write_state(state)
        except Exception:  # never let reporting break scheduling
            logger.exception("could not publish SpecPilot state")


class SpecPilotScheduler(_SpecPilotHook, Scheduler):
    """vLLM ``Scheduler`` with SpecPilot's live K and batch caps (synchronous engines)."""


class SpecPilotAsyncScheduler(_SpecPilotHook, AsyncScheduler):
    """vLLM ``AsyncScheduler`` with SpecPilot's live K and batch caps (async scheduling)."""

    GATE_DRAFTS = False
