"""The scheduler hook's lean path at K = 0 (``engine_host.scheduler``, ``LEAN_SAMPLE``).

While the policy holds K at 0 and learns nothing from steps (fixed at 0, off), a step only
checks the config's sequence number, keeps the step clock and counts itself; every
``LEAN_SAMPLE``-th output is still observed. These tests drive the real hook on the stand-in
scheduler of ``python -m bench hook-cost``.

The stand-in schedules in microseconds, so the step-time model would learn from the wall
clock's jitter, and on a machine whose cores are busy the hook's decisions (and these tests)
would vary from run to run. The hook reads a clock that advances 0.1 ms per reading instead,
and 2 ms more per step (``STEP_S``, the model's forward on a GPU): a step that runs more of the
hook's code takes longer, the same in every run."""

from __future__ import annotations

import contextlib
import itertools
import time
import types

import pytest

import engine_host.scheduler as scheduler_module
from bench.hook_cost import standin_hook
from engine_host.config import LiveConfig
from engine_host.step_clock import DecodeStretch

# what a step takes outside the hook (s): :func:`_run` moves the clock by this much per step
STEP_S = 2e-3
_elapsed = [0.0]  # s the steps moved the clock by (``_run``)


@pytest.fixture(autouse=True)
def _steady_clock(monkeypatch):
    """The scheduler hook's clocks (wall, thread CPU, monotonic) as one counter that advances
    0.1 ms per reading, plus ``STEP_S`` per step that :func:`_run` runs."""
    ticks = itertools.count()
    _elapsed[0] = 0.0

    def now() -> float:
        return 1000.0 + next(ticks) * 1e-4 + _elapsed[0]

    monkeypatch.setattr(
        scheduler_module, "time", types.SimpleNamespace(perf_counter=now, thread_time=now, monotonic=now, time=now)
    )


@pytest.fixture(autouse=True)
def _hook_stays_in(monkeypatch):
    """At a static K = 0 the hook steps aside between state publishes (tests/test_hook_aside.py);
    these tests keep it on its lean path, which it takes in between and in the adaptive
    policy's rests."""
    monkeypatch.setenv("SPECPILOT_HOOK_ASIDE", "0")


@pytest.fixture(autouse=True)
def _every_step_teaches(monkeypatch):
    """The stand-in runs one endless lone request: the rule that a lone request's first
    decode steps do not teach the step-time model (``DecodeStretch``) would only drop the
    stand-in's first steps, and these tests compare the lean and the full path, not that
    rule (tested on its own below)."""
    monkeypatch.setattr(DecodeStretch, "SETTLE_STEPS", 0)


@contextlib.contextmanager
def _standin(mode: str, batch: int, folder, **kwargs):
    """The hook on the stand-in scheduler (``bench.hook_cost.standin_hook``); its config
    channel is closed afterwards."""
    hook, channel = standin_hook(mode, batch, str(folder), **kwargs)
    try:
        yield hook
    finally:
        channel.close()


def _run(
    hook, n: int, accept=lambda i: 0, start: int = 0, async_order: bool = False, runner_out: object = None
) -> list[int]:
    """n steps as in an engine: a step verifies the drafts proposed at the K the step
    before it was scheduled at, and ``accept(step)`` of each request's draft tokens are
    accepted; returns the K each step was scheduled at. With ``async_order`` as on vLLM's
    ``AsyncScheduler``: step i + 1 is scheduled before step i's output is handed back."""
    ks = []
    for i in range(start, start + n):
        hook.has_requests()
        out = hook.schedule()
        _elapsed[0] += STEP_S  # the step's forward
        k = out.num_spec_tokens_to_schedule
        ks.append(k)
        step = (out, getattr(hook, "_test_prev_k", 0), i)  # (output, drafts it verifies, index)
        hook._test_prev_k = k
        if async_order:
            step, hook._test_pending = getattr(hook, "_test_pending", None), step
            if step is None:
                continue
        out, verified, j = step
        if verified:
            for req in hook.running:
                hook.make_spec_decoding_stats(None, verified, min(accept(j), verified), request_id=req.request_id)
        hook.update_from_output(out, runner_out)
    return ks


def _write(channel, version: int, mode: str, warmup_k: int | None = None, **spec) -> None:
    cfg = LiveConfig().model_dump(mode="json")
    cfg["speculation"]["mode"] = mode
    cfg["speculation"].update(spec)
    channel.write_config(version, cfg, warmup_k=warmup_k)


@pytest.fixture
def hook_at_k0(tmp_path):
    hook, channel = standin_hook("fixed:0", 2, str(tmp_path))
    yield hook, channel
    channel.close()


def test_at_fixed_k0_steps_take_the_lean_path_and_every_step_is_still_counted(hook_at_k0):
    hook, _ = hook_at_k0
    _run(hook, 1)
    assert hook._lean
    assert hook.dynamic_sd_lookup is hook._zero_lookup  # vLLM's K lookup is a list of zeros
    hook._publish(time.monotonic())
    ctl = hook.controller
    at_k, total, index, busy, overhead = (
        list(ctl.steps_at_k),
        ctl.total_steps,
        hook._step_index,
        hook._busy_s,
        hook._overhead_s,
    )
    _run(hook, 200)
    hook._publish(time.monotonic())  # the counts reach the controller before a state is published
    assert ctl.steps_at_k[0] - at_k[0] == 200
    assert ctl.steps_at_k[1:] == at_k[1:]
    assert ctl.total_steps - total == 200
    assert hook._step_index - index == 200
    assert hook._busy_s > busy and hook._overhead_s > overhead
    assert ctl.k_current == 0


def _publish_drained(hook) -> None:
    """The engine drains (no request running) and waits for work (``has_requests``), which
    writes the step trace's rows out; the running requests are put back afterwards."""
    running, hook.running = hook.running, []
    hook._publish(time.monotonic())
    hook.busy = False
    assert not hook.has_requests()
    hook.running, hook.busy = running, True


def _observed_on_lean_path(hook, n: int) -> int:
    """Run one step, then ``n`` more with no publish in between; returns how many of the
    ``n`` outputs reached the controller (``observe_quiet``)."""
    hook._publish_due = float("inf")  # no publish inside the loop
    _run(hook, 1)
    hook._observe_quiet()  # the first (full) step's observation
    seen: list[int] = []
    observe_quiet = hook.controller.observe_quiet
    hook.controller.observe_quiet = lambda steps: (seen.append(len(steps)), observe_quiet(steps))
    _run(hook, n)
    hook._observe_quiet()
    return sum(seen)


def test_the_lean_path_samples_outputs_for_the_step_time_model(hook_at_k0):
    hook, _ = hook_at_k0
    n = 20 * hook.LEAN_SAMPLE
    assert _observed_on_lean_path(hook, n) == n // hook.LEAN_SAMPLE  # one output in LEAN_SAMPLE is observed


def test_a_step_trace_keeps_the_lean_path_and_writes_a_row_for_every_step(tmp_path, monkeypatch):
    # profiling with $SPECPILOT_STEP_TRACE must not change what it profiles: the hook still
    # skips most outputs at K = 0, and the trace still has one row per step
    trace = tmp_path / "steps.csv"
    monkeypatch.setenv("SPECPILOT_STEP_TRACE", str(trace))
    with _standin("fixed:0", 2, tmp_path) as hook:
        assert hook._trace is not None
        n = 10 * hook.LEAN_SAMPLE
        assert _observed_on_lean_path(hook, n) == n // hook.LEAN_SAMPLE  # one output in LEAN_SAMPLE is observed
        files = list(tmp_path.glob("steps.csv.*"))
        assert len(files) == 1
        assert n + 1 < hook.TRACE_FLUSH_ROWS
        hook._publish(time.monotonic())  # busy, fewer rows than TRACE_FLUSH_ROWS: kept, no text made yet
        assert hook.has_requests()
        assert files[0].read_text().splitlines()[1:] == [] and hook._trace.pending == n + 1
        running, hook.running = hook.running, []
        hook._publish(time.monotonic())  # drained: still kept, the last outputs go first
        assert files[0].read_text().splitlines()[1:] == []
        hook.running = running
        _publish_drained(hook)  # waits for work: written out
        rows = files[0].read_text().splitlines()[1:]
        assert len(rows) == n + 1 and hook._trace.pending == 0
        # every row: K 0 verified and proposed, both requests decoding, of 2, with their context
        assert {tuple(r.split(",")[2:6]) for r in rows} == {("0", "0", "2", "2")}
        assert {r.split(",")[7] for r in rows} == {"400"}
        # a busy engine writes them out once TRACE_FLUSH_ROWS are kept, at the next publish
        hook.TRACE_FLUSH_ROWS = hook.LEAN_SAMPLE
        hook._publish_due = float("inf")
        _run(hook, hook.LEAN_SAMPLE - 1)
        hook._publish(time.monotonic())
        assert len(files[0].read_text().splitlines()[1:]) == n + 1  # one row short: still kept
        _run(hook, 1)
        hook._publish(time.monotonic())
        assert len(files[0].read_text().splitlines()[1:]) == n + 1 + hook.LEAN_SAMPLE


@pytest.mark.parametrize("lean", ["1", "0"])
def test_the_step_trace_names_each_outputs_hook_path_and_times_vllms_own_work(tmp_path, monkeypatch, lean):
    """Each row names the hook's path (``lean`` at a static K = 0, ``full`` with
    ``SPECPILOT_HOOK_LEAN=0``) and holds the time of vLLM's own ``schedule()`` for the step and
    ``update_from_output()`` for the output, measured around the stand-in's (which here take 2 and
    4 ticks of the module's 100 µs clock), so that ``bench step-trace`` can tell whether vLLM's work
    per step differs with the hook's path."""
    from bench.hook_cost import _SchedulerStandIn
    from bench.step_trace import read_trace, vllm_table

    def ticks(n):
        for _ in range(n):
            scheduler_module.time.perf_counter()

    monkeypatch.setenv("SPECPILOT_HOOK_LEAN", lean)
    monkeypatch.setenv("SPECPILOT_STEP_TRACE", str(tmp_path / "steps.csv"))
    sched, upd = _SchedulerStandIn.schedule, _SchedulerStandIn.update_from_output
    monkeypatch.setattr(_SchedulerStandIn, "schedule", lambda self, *a, **k: ticks(2) or sched(self, *a, **k))
    monkeypatch.setattr(_SchedulerStandIn, "update_from_output", lambda self, *a, **k: ticks(4) or upd(self, *a, **k))
    with _standin("fixed:0", 2, tmp_path) as hook:
        _run(hook, 3 * hook.LEAN_SAMPLE)
        _publish_drained(hook)  # writes the trace out
    steps = read_trace(next(tmp_path.glob("steps.csv.*")))[1:]  # (the first step is decided on the full path)
    assert {st.path for st in steps} == {"lean" if lean == "1" else "full"}
    # the clock read before and after each: one tick more than the stand-in's own. On the full path
    # the hook decides K inside vLLM's schedule() (its K lookup), and that span is taken out; the
    # read that opens it is left in (one tick here, a fraction of a microsecond in an engine)
    sched_us = 300.0 if lean == "1" else 400.0
    assert {(st.vllm_schedule_us, st.vllm_update_us) for st in steps} == {(sched_us, 500.0)}
    table = vllm_table([steps])
    assert table[2] == f"| 2-4 | {steps[0].path} | {len(steps)} | {sched_us} | 500.0 |"


@pytest.mark.parametrize("mode", ["fixed:0", "fixed:2"])  # the lean path's rows and the full path's
def test_the_step_trace_records_the_cuda_graph_mode_vllm_reports_for_each_step(tmp_path, monkeypatch, mode):
    from vllm.compilation.cuda_graph import CUDAGraphStat
    from vllm.config.compilation import CUDAGraphMode

    monkeypatch.setenv("SPECPILOT_STEP_TRACE", str(tmp_path / "steps.csv"))
    stat = CUDAGraphStat(
        num_unpadded_tokens=2, num_padded_tokens=2, num_paddings=0, runtime_mode=str(CUDAGraphMode.FULL)
    )
    with _standin(mode, 2, tmp_path) as hook:
        _run(hook, 40, runner_out=types.SimpleNamespace(cudagraph_stats=stat))
        _run(hook, 40, start=40)  # vLLM without --cudagraph-metrics (or the CPU build): no mode
        _publish_drained(hook)  # writes the trace out
    rows = next(tmp_path.glob("steps.csv.*")).read_text().splitlines()
    assert rows[0].split(",")[8] == "graph"
    assert [r.split(",")[8] for r in rows[1:]] == ["FULL"] * 40 + [""] * 40


def test_the_step_trace_records_each_steps_verified_tokens_and_the_gates_estimate(tmp_path, monkeypatch):
    """With the per-request gate on, each row of the full path holds the draft and accepted
    tokens its output verified, the running requests' highest acceptance estimate and the
    newest one's class prior; at a static K the estimate columns stay empty."""
    from bench.step_trace import read_trace

    monkeypatch.setenv("SPECPILOT_STEP_TRACE", str(tmp_path / "a" / "steps.csv"))
    (tmp_path / "a").mkdir()
    with _standin("adaptive", 1, tmp_path / "a", async_scheduling=True) as hook:
        _run(hook, 60, accept=lambda i: 4, async_order=True)  # every draft token accepted
        _publish_drained(hook)  # writes the trace out
    steps = read_trace(next((tmp_path / "a").glob("steps.csv.*")))
    verified = [st for st in steps if st.draft_tokens]
    assert verified and all(st.accepted_tokens == st.draft_tokens for st in verified)
    assert all(st.estimate is not None and st.prior is not None for st in verified)
    assert verified[-1].estimate > 0.9 > verified[0].prior  # its own drafts took it above the prior
    # and what the gate priced a draft token and a drafting step at
    assert all(st.token_cost is not None and st.step_cost is not None and st.step_cost >= 0 for st in verified)
    # each drafting step names the hook's rule that set its K (a lone request: the policy's or its own)
    assert {st.rule for st in steps if st.k_proposed > 0} <= {"policy", "lone", "probe", "explore"}
    assert all(st.rule for st in steps if st.k_proposed > 0)
    monkeypatch.setenv("SPECPILOT_STEP_TRACE", str(tmp_path / "f" / "steps.csv"))
    (tmp_path / "f").mkdir()
    with _standin("fixed:2", 1, tmp_path / "f") as hook:
        _run(hook, 20, accept=lambda i: 1)
        _publish_drained(hook)  # writes the trace out
    steps = read_trace(next((tmp_path / "f").glob("steps.csv.*")))
    assert sum(st.draft_tokens or 0 for st in steps) == 2 * 19 and sum(st.accepted_tokens or 0 for st in steps) == 19
    assert {st.estimate for st in steps} == {None} and {st.step_cost for st in steps} == {None}
    assert {st.rule for st in steps if st.k_proposed > 0} == {"policy"}  # a static K
    # above TRACE_ESTIMATE_MAX_BATCH requests the estimates are not traced (their own cost)
    monkeypatch.setenv("SPECPILOT_STEP_TRACE", str(tmp_path / "b" / "steps.csv"))
    (tmp_path / "b").mkdir()
    with _standin("adaptive", 9, tmp_path / "b", async_scheduling=True) as hook:
        assert hook.TRACE_ESTIMATE_MAX_BATCH == 8
        _run(hook, 60, accept=lambda i: 4, async_order=True)
        _publish_drained(hook)  # writes the trace out
    steps = read_trace(next((tmp_path / "b").glob("steps.csv.*")))
    assert any(st.draft_tokens for st in steps) and {st.estimate for st in steps} == {None}


def test_acceptance_estimates_fade_on_the_lean_path_as_they_do_step_by_step(tmp_path, monkeypatch):
    """The skipped steps' request-steps are folded in at once; the fade compounds, so the
    acceptance estimates end where step-by-step observation leaves them."""
    hooks = []
    for lean in ("1", "0"):
        monkeypatch.setenv("SPECPILOT_K0_LEAN", lean)
        hook, channel = standin_hook("fixed:0", 2, str(tmp_path / lean))
        acc = hook.controller.acceptance
        for _ in range(30):  # measured drafts before speculation was turned off
            acc.observe(4, 2, [2, 1, 1, 0], [2, 2, 2, 2])
        hooks.append((hook, channel))
    try:
        for hook, _ in hooks:
            _run(hook, 300)
            hook._publish(time.monotonic())
        (lean, _), (full, _) = hooks
        assert lean._lean and not full._lean
        a, b = lean.controller.acceptance, full.controller.acceptance
        for name in ("num", "den", "drf", "cnum", "cden"):
            assert getattr(a, name) == pytest.approx(getattr(b, name), rel=1e-6, abs=1e-12), name
        # a position whose evidence falls below the freshness threshold inside the skipped
        # steps returns toward the prior from the start of them, not from the step it fell
        assert a.cond == pytest.approx(b.cond, rel=2e-2)
        assert lean.controller.total_steps == full.controller.total_steps
        assert lean.controller.steps_at_k == full.controller.steps_at_k
    finally:
        for _, channel in hooks:
            channel.close()


def test_a_new_config_leaves_the_lean_path_at_the_next_step(hook_at_k0):
    hook, channel = hook_at_k0
    _run(hook, 3)
    assert hook._lean
    _write(channel, 2, "adaptive")
    hook.schedule()  # the sequence number moved: the full path reads the config
    assert not hook._lean
    assert hook.dynamic_sd_lookup is hook._live_lookup
    assert hook.controller.policy.name == "adaptive"
    hook.update_from_output(hook.schedule(), None)
    assert not hook._lean  # adaptive decides K every step here (synchronous, gate on)


def test_a_batch_cap_is_applied_on_the_lean_path(hook_at_k0):
    hook, channel = hook_at_k0
    _run(hook, 3)
    cfg = LiveConfig().model_dump(mode="json")
    cfg["speculation"]["mode"] = "fixed"
    cfg["speculation"]["k"] = 0
    cfg["batch"]["max_num_seqs"] = 8
    hook._publish(time.monotonic())
    counted = sum(hook.controller.steps_at_k)
    channel.write_config(2, cfg)
    _run(hook, 3)
    assert hook._lean  # still K = 0
    assert hook.max_num_running_reqs == 8
    hook._publish(time.monotonic())
    assert sum(hook.controller.steps_at_k) - counted == 3  # the step that read the config too


def test_a_warmup_k_leaves_the_lean_path_and_returning_to_k0_enters_it_again(hook_at_k0):
    hook, channel = hook_at_k0
    _run(hook, 3)
    _write(channel, 1, "fixed", warmup_k=3, k=0)
    _run(hook, 2)
    assert not hook._lean
    assert hook.schedule().num_spec_tokens_to_schedule == 3
    _write(channel, 1, "fixed", warmup_k=None, k=0)
    _run(hook, 3)
    assert hook._lean
    assert hook.schedule().num_spec_tokens_to_schedule == 0


def test_fixed_k_above_zero_and_the_switch_off_never_take_the_lean_path(tmp_path, monkeypatch):
    with _standin("fixed:4", 1, tmp_path / "k4") as hook:
        _run(hook, 5)
        assert not hook._lean
    monkeypatch.setenv("SPECPILOT_K0_LEAN", "0")
    with _standin("fixed:0", 1, tmp_path / "off") as hook:
        _run(hook, 5)
        assert not hook._lean
        assert hook.dynamic_sd_lookup is hook._live_lookup
    # the hook alone on its full path (an adaptive engine host's steps at K = 0), Model Runner
    # V2's draft bookkeeping still skipped
    monkeypatch.delenv("SPECPILOT_K0_LEAN")
    monkeypatch.setenv("SPECPILOT_HOOK_LEAN", "0")
    from engine_host import envs

    assert envs.k0_lean_on() and not envs.hook_lean_on()
    with _standin("fixed:0", 1, tmp_path / "hook") as hook:
        _run(hook, 5)
        assert not hook._lean and hook._lean_skipped == 0
    monkeypatch.setenv("SPECPILOT_HOOK_LEAN", "1")
    with _standin("fixed:0", 1, tmp_path / "lean") as hook:
        _run(hook, 5)
        assert hook._lean


def test_the_controller_says_which_policies_hold_a_static_k():
    from engine_host.config import SpeculationConfig
    from engine_host.controller import SpeculationController

    ctl = SpeculationController(4, SpeculationConfig(mode="fixed", k=0))
    assert ctl.static_k() == 0
    ctl.configure(SpeculationConfig(mode="fixed", k=3))
    assert ctl.static_k() == 3
    ctl.configure(SpeculationConfig(mode="off"))
    assert ctl.static_k() == 0
    ctl.configure(SpeculationConfig(mode="adaptive"))
    assert ctl.static_k() is None
    with pytest.raises(ValueError):
        ctl.skip_quiet(-1, 0)
    with pytest.raises(ValueError):
        ctl.count_scheduled_at_zero(-2)


# --- the adaptive policy rests on the lean path while it holds K at 0 (LEAN_SPAN) ------------


@pytest.mark.parametrize("batch", [1, 8])
def test_adaptive_rests_at_k0_and_probes_and_explores_as_often_as_step_by_step(tmp_path, monkeypatch, batch):
    """Under async scheduling, where drafts do not pay the adaptive policy holds K at 0 and
    the hook rests on the lean path between its explorations and the gate's probes: nearly
    every step is lean, every step is counted, and the steps at K > 0 (the probes and
    explorations) come as often as with the lean path switched off. (Not step for step: the
    policy's goodput comparisons read a step-time model that learned from every step in one
    hook and from one output in LEAN_SAMPLE in the other.)"""
    runs = {}
    for name, lean in (("rest", "1"), ("full", "0")):
        monkeypatch.setenv("SPECPILOT_K0_LEAN", lean)
        with _standin("adaptive", batch, tmp_path / name, async_scheduling=True) as hook:
            lean_steps = 0
            ks = []
            for _ in range(1500):
                lean_steps += hook._lean
                ks.extend(_run(hook, 1))
            hook._publish(time.monotonic())
            assert sum(hook.controller.steps_at_k) == hook._step_index == len(ks)  # every step counted
            runs[name] = (ks, lean_steps, hook.controller.policy.steps)
    (ks_rest, lean_rest, policy_rest), (ks_full, lean_full, policy_full) = runs["rest"], runs["full"]
    assert lean_full == 0
    assert lean_rest > (0.75 if batch == 1 else 0.85) * len(ks_rest)
    spec_rest, spec_full = sum(k > 0 for k in ks_rest), sum(k > 0 for k in ks_full)
    assert 0 < spec_full < 0.1 * len(ks_full)  # probes and explorations; K = 0 otherwise
    assert abs(spec_rest - spec_full) <= max(3, 0.3 * spec_full)
    # the policy's own step count (explorations aside) moved on through the rests too
    assert abs(policy_rest - policy_full) <= 0.05 * len(ks_rest)


def test_adaptive_leaves_the_rest_when_drafts_start_to_pay(tmp_path):
    with _standin("adaptive", 8, tmp_path, async_scheduling=True) as hook:
        _run(hook, 600)
        assert hook._lean and hook.controller.policy.current == 0
        ks = _run(hook, 1500, accept=lambda i: 4, start=600)  # every draft token accepted from now on
        assert not hook._lean
        assert ks[-200:].count(0) == 0  # speculating again
        assert sum(hook.controller.steps_at_k) == hook._step_index


def test_adaptive_leaves_the_rest_when_the_engine_drains(tmp_path):
    with _standin("adaptive", 2, tmp_path, async_scheduling=True) as hook:
        _run(hook, 200)
        assert hook._lean and hook._resting
        running = hook.running
        hook.running = []
        _run(hook, 1)
        assert not hook._lean  # a new request is decided afresh
        hook.running = running
        _run(hook, 5)
        assert hook._lean


def test_adaptive_does_not_rest_where_the_gate_drops_drafts_request_by_request(tmp_path):
    """Synchronous scheduling with the per-request gate on: each request's probe count
    advances every step, so adaptive decides every step; without the gate it rests."""
    with _standin("adaptive", 4, tmp_path / "gate") as hook:
        _run(hook, 300)
        assert not hook._lean
    with _standin("adaptive_step", 4, tmp_path / "step") as hook:
        _run(hook, 300)
        assert hook._lean


def test_the_adaptive_policy_says_how_long_it_holds_k0():
    from engine_host.config import SpeculationConfig
    from engine_host.controller import SpeculationController

    ctl = SpeculationController(4, SpeculationConfig(mode="adaptive"))
    pol = ctl.policy
    pol.current, pol.explore_left, pol.steps, pol.next_explore = 0, 0, 100, 105
    pol._decided_at = 99
    assert ctl.may_rest() and ctl.rest_steps() == 4  # the 5th step asked explores, as before
    ctl.count_scheduled_at_zero(4)
    assert pol.steps == 104 and ctl.rest_steps() == 0
    pol.next_explore = 400
    assert ctl.rest_steps() == 11  # the 16th step after the last comparison compares again
    pol._decided_at = 104
    assert ctl.rest_steps() == 16
    assert ctl.rest_steps(4) == 64  # a large batch's rest (the hook's scale), still before the exploration
    pol.next_explore = 150
    assert ctl.rest_steps(4) == 45
    pol.next_explore = 400
    pol.current = 2
    assert ctl.rest_steps() == 0  # speculating: asked every step
    pol.current, pol.explore_left = 0, 3
    assert ctl.rest_steps() == 0  # an exploration burst runs
    ctl.configure(SpeculationConfig(mode="fixed", k=0))
    assert ctl.rest_steps() >= 1 << 62
    ctl.configure(SpeculationConfig(mode="fixed", k=2))
    assert ctl.rest_steps() == 0 and not ctl.may_rest()
    ctl.configure(SpeculationConfig(mode="heuristic"))
    assert ctl.rest_steps() == 0 and not ctl.may_rest()


def test_steps_skipped_on_the_lean_path_age_the_per_depth_step_times():
    """A depth's step time measured ``fresh_steps`` engine steps ago is no longer used,
    however few of those steps the lean path observed: a slow K = 4 measurement does not
    price K = 4 for sixteen times longer while the policy rests."""
    from engine_host.config import SpeculationConfig
    from engine_host.controller import SpeculationController, batch_bucket

    ctl = SpeculationController(4, SpeculationConfig(mode="adaptive"))
    tm = ctl.step_time
    for _ in range(50):
        tm.observe(1, 1, 0.002, 0, 0)
        tm.observe(1, 5, 0.003, 4, 4)
    tm.observe(1, 5, 0.030, 4, 4)  # one very slow K = 4 step
    cell = tm.cells[(batch_bucket(1), 4)]
    assert tm.steps - cell[2] <= tm.fresh_steps and tm.correction(1, 4) != tm.correction(1)
    ctl.skip_quiet(tm.fresh_steps + 1, tm.fresh_steps + 1)
    assert tm.steps - cell[2] > tm.fresh_steps  # stale: the bucket's correction is used
    assert tm.correction(1, 4) == tm.correction(1)


def test_a_probe_that_pays_ends_the_rest_as_soon_as_its_result_is_back(tmp_path, monkeypatch):
    """Async scheduling, one request (mixed traffic at 1 client): after a stretch whose
    drafts were all rejected, a new request whose drafts are all accepted is found by the
    gate's probe. Its drafts are verified one step after they were proposed, while the next
    step is already scheduled: the rest must not begin in between, so the request drafts from
    the step after the probe's result on (it once waited out a whole span at K = 0)."""
    import types

    runs = {}
    for name, lean in (("rest", "1"), ("full", "0")):
        monkeypatch.setenv("SPECPILOT_K0_LEAN", lean)
        with _standin("adaptive", 1, tmp_path / name, async_scheduling=True) as hook:
            _run(hook, 400, async_order=True)  # nothing accepted: K held at 0
            assert hook._resting == (name == "rest")
            req = types.SimpleNamespace(request_id="docs", spec_token_ids=[], num_output_tokens=8)
            hook.running, hook.requests = [req], {"docs": req}
            ks = _run(hook, 64, accept=lambda i: 4, start=400, async_order=True)
            runs[name] = ks
    rest, full = runs["rest"], runs["full"]
    probe = next(i for i, k in enumerate(rest) if k)
    assert probe < 16  # the gate's probe, within probe_every steps of the request's own first step
    assert all(k > 0 for k in rest[probe + 3 :])  # its result acted on at once: no rest in between
    assert sum(k > 0 for k in full) >= 48  # with the lean path off: drafting from shortly after it


def test_finished_requests_leave_the_gate_while_the_adaptive_policy_rests(tmp_path):
    """The gate forgets finished requests at a full-path step every ``GATE_FORGET_EVERY``
    steps. Lean steps skip the gate, so a forget due on a multiple of that count (the old
    rule, ``step % 256 == 0``) was missed whenever the step that landed there was lean: while
    the policy rested at K = 0, requests that had finished stayed in the gate."""
    with _standin("adaptive", 2, tmp_path, async_scheduling=True) as hook:
        every = hook.GATE_FORGET_EVERY
        _run(hook, 50)
        for i in range(2):  # requests the engine has finished, still known to the gate
            hook._gate.observe(f"done-{i}", 2, 0)
        assert {"done-0", "done-1"} <= set(hook._gate._reqs)
        lean = 0
        for _ in range(2 * every):
            lean += hook._lean
            _run(hook, 1)
        assert lean > every  # mostly resting on the lean path
        assert not {"done-0", "done-1"} & set(hook._gate._reqs)
        assert set(hook._gate._reqs) <= {r.request_id for r in hook.running}


def test_the_state_read_while_idle_counts_steps_of_requests_that_were_aborted(tmp_path, monkeypatch):
    """A request ended by its client (a stop string, a disconnect) leaves the engine through
    an abort, with no last output to publish on: the engine's first idle check publishes."""
    from bench import hook_cost

    monkeypatch.setattr(hook_cost._SchedulerStandIn, "has_requests", lambda self: bool(self.running))
    # no publish falls due by time within the 40 steps, however slowly a loaded machine runs them
    monkeypatch.setattr("engine_host.scheduler.PUBLISH_INTERVAL_S", 3600.0)
    with _standin("fixed:0", 2, tmp_path) as hook:
        channel = hook._channel
        _run(hook, 1)
        hook._publish(time.monotonic())
        first = channel.read_state()
        _run(hook, 40)
        assert channel.read_state()["step_index"] == first["step_index"]
        hook.running = []  # both requests aborted
        assert not hook.has_requests()
        state = channel.read_state()
        assert state["step_index"] == first["step_index"] + 40
        assert sum(state["controller"]["steps_at_k"]) - sum(first["controller"]["steps_at_k"]) == 40
        assert state["running"] == 0
        hook.has_requests()  # idle again, nothing new: no publish
        assert channel.read_state()["published_at"] == state["published_at"]


def test_the_hook_names_each_new_request_greedy_or_sampled_for_the_gate(tmp_path, monkeypatch):
    from types import SimpleNamespace

    from bench import hook_cost

    monkeypatch.setattr(hook_cost._SchedulerStandIn, "add_request", lambda self, request: None, raising=False)
    with _standin("adaptive", 1, tmp_path) as hook:
        for rid, temperature in (("chat", 0.7), ("code", 0.0), ("near-zero", 1e-6)):
            hook.add_request(SimpleNamespace(request_id=rid, sampling_params=SimpleNamespace(temperature=temperature)))
        hook.add_request(SimpleNamespace(request_id="pooling", sampling_params=None))
        assert hook._gate._class == {"chat": "sampled", "code": "greedy", "near-zero": "greedy", "pooling": "greedy"}
    with _standin("fixed:0", 1, tmp_path / "k0") as hook:  # gate off: nothing kept (the lean path never forgets)
        hook.add_request(SimpleNamespace(request_id="chat", sampling_params=SimpleNamespace(temperature=0.7)))
        assert hook._gate._class == {}


def test_a_lone_request_whose_drafts_do_not_pay_rests_even_where_the_policy_holds_k_above_zero(tmp_path, monkeypatch):
    """Mixed traffic at 1 client: after requests that quote, the policy's own K (pooled over
    the traffic) stays above 0 while a chat request runs, and the gate holds every one of
    that request's steps at K = 0 but its probes. The hook rests on the lean path between
    those probes instead of asking the policy every step, and about as many steps run at
    K > 0 as with the lean path off. A request that joins the lone one ends the rest at once."""
    import types

    runs = {}
    for name, lean in (("rest", "1"), ("full", "0")):
        monkeypatch.setenv("SPECPILOT_K0_LEAN", lean)
        with _standin("adaptive", 1, tmp_path / name, async_scheduling=True) as hook:
            monkeypatch.setattr(hook.controller.policy, "k_for_batch", lambda b: 4)
            monkeypatch.setattr(hook.controller.policy, "rest_steps", lambda scale=1: 0)
            lean_steps, ks = 0, []
            for _ in range(600):
                lean_steps += hook._lean
                ks.extend(_run(hook, 1, async_order=True))
            hook._publish(time.monotonic())
            assert sum(hook.controller.steps_at_k) == hook._step_index  # every step counted
            runs[name] = (ks, lean_steps)
            if name == "rest":
                assert hook._lean
                joined = types.SimpleNamespace(request_id="joined", spec_token_ids=[], num_output_tokens=1)
                hook.running.append(joined)
                hook.requests["joined"] = joined
                _run(hook, 1, start=600, async_order=True)
                assert not hook._lean  # decided afresh at the joined request's first step
    (ks_rest, lean_rest), (ks_full, lean_full) = runs["rest"], runs["full"]
    assert lean_full == 0 and lean_rest > 0.8 * len(ks_rest)
    # the same steps at K > 0, give or take the decisions the step-time model's drift moves
    # within a rest (as for the policy's own rests above: the slope's prior, which the
    # stand-in's flat step times wear down, moves a probe or two), and probes backed off
    spec_rest, spec_full = sum(k > 0 for k in ks_rest), sum(k > 0 for k in ks_full)
    assert abs(spec_rest - spec_full) <= max(3, spec_full // 4)
    assert 0 < spec_rest <= 3 + 600 // 64 + 6


def _hold_policy_at_k4(hook, monkeypatch, steps_to_explore: int = 1 << 62) -> None:
    """The adaptive policy's own K held at 4, never resting or exploring by itself; its next
    exploration ``steps_to_explore`` steps away (its ``k_for_batch`` would never start one)."""
    policy = hook.controller.policy
    monkeypatch.setattr(policy, "k_for_batch", lambda b: 4)
    monkeypatch.setattr(policy, "rest_steps", lambda scale=1: 0)
    monkeypatch.setattr(policy, "steps_to_explore", lambda: steps_to_explore)
    monkeypatch.setattr(hook.controller, "exploring", lambda: False)


def test_a_batch_whose_drafts_do_not_pay_rests_between_probes_under_async_scheduling(tmp_path, monkeypatch):
    """Async scheduling, 8 requests whose drafts are all rejected, the policy's own K held at 4:
    the gate's batch rule holds the steps at K = 0 but its all-request probes. The hook rests on
    the lean path between them (spans of at most GATE_COST_EVERY steps) instead of running its
    full path at every step, with about as many steps at K > 0 as on the full path
    (``SPECPILOT_HOOK_LEAN=0``). A request that joins ends the rest at its first step."""
    import types

    runs = {}
    for name, lean in (("rest", "1"), ("full", "0")):
        monkeypatch.setenv("SPECPILOT_HOOK_LEAN", lean)
        with _standin("adaptive", 8, tmp_path / name, async_scheduling=True) as hook:
            _hold_policy_at_k4(hook, monkeypatch)
            decided = []  # the steps the hook decided on its full path
            decide = hook._decide_k
            monkeypatch.setattr(hook, "_decide_k", lambda b, d=decide, seen=decided: seen.append(b) or d(b))
            ks = _run(hook, 800, async_order=True)
            hook._publish(time.monotonic())
            assert sum(hook.controller.steps_at_k) == hook._step_index  # every step counted
            runs[name] = (ks, len(decided))
            if name == "rest":
                for i in range(2 * hook.GATE_COST_EVERY):
                    if hook._lean:
                        break
                    _run(hook, 1, start=800 + i, async_order=True)
                assert hook._lean
                joined = types.SimpleNamespace(request_id="joined", spec_token_ids=[], num_output_tokens=1)
                hook.running.append(joined)
                hook.requests["joined"] = joined
                _run(hook, 1, start=900, async_order=True)
                assert not hook._lean  # decided afresh at the joined request's first step
    (ks_rest, full_rest), (ks_full, full_full) = runs["rest"], runs["full"]
    assert full_full == 800  # (the stand-in's first step is decided too)
    # at least one step in GATE_COST_EVERY + 1 decided on the full path, and few more
    every = scheduler_module._SpecPilotHook.GATE_COST_EVERY + 1
    assert 800 // every <= full_rest <= 0.2 * 800
    spec_rest, spec_full = sum(k > 0 for k in ks_rest), sum(k > 0 for k in ks_full)
    assert 0 < spec_full and abs(spec_rest - spec_full) <= max(3, spec_full // 4)


def test_a_large_batchs_rest_runs_on_when_a_request_joins(tmp_path, monkeypatch):
    """At 2 * BATCH_PAYS_REQUESTS requests or more a request that joins does not end the batch's
    rest (the full path keeps the batch's answer through a join there too); the span still ends
    within GATE_COST_EVERY * (B // BATCH_PAYS_REQUESTS) steps, and the joined request is priced
    at the next full-path step."""
    import types

    cls = scheduler_module._SpecPilotHook
    most = cls.GATE_COST_EVERY * 2  # B // BATCH_PAYS_REQUESTS = 2
    with _standin("adaptive", 2 * cls.BATCH_PAYS_REQUESTS, tmp_path, async_scheduling=True) as hook:
        _hold_policy_at_k4(hook, monkeypatch)
        _run(hook, 300, async_order=True)
        for i in range(2 * cls.GATE_COST_EVERY):
            if hook._lean and hook._lean_left >= 2:
                break
            _run(hook, 1, start=300 + i, async_order=True)
        assert hook._lean and hook._lean_left >= 2
        joined = types.SimpleNamespace(request_id="joined", spec_token_ids=[], num_output_tokens=1)
        hook.running.append(joined)
        hook.requests["joined"] = joined
        _run(hook, 1, start=400, async_order=True)
        assert hook._lean  # the span runs on
        decided = []
        decide = hook._decide_k
        monkeypatch.setattr(hook, "_decide_k", lambda b, d=decide, seen=decided: seen.append(b) or d(b))
        _run(hook, most, start=401, async_order=True)
        assert decided and decided[0] == 2 * cls.BATCH_PAYS_REQUESTS + 1  # the joined request is in the batch


def _rests(hook, monkeypatch, steps: int) -> tuple[int, int, int]:
    """Run ``steps`` async steps of the stand-in ``hook``: ``(its longest rest span, steps at
    K > 0, steps on the full path)``, every step counted by the controller."""
    spans: list[int] = []
    enter = hook._enter_lean
    monkeypatch.setattr(hook, "_enter_lean", lambda span, e=enter, seen=spans: seen.append(span) or e(span))
    ks = _run(hook, steps, async_order=True)
    hook._publish(time.monotonic())
    assert sum(hook.controller.steps_at_k) == hook._step_index  # every step counted
    return max(spans), sum(k > 0 for k in ks), hook._step_index - hook._lean_steps


def test_rest_spans_grow_with_a_large_batch_under_span_scaling(tmp_path, monkeypatch):
    """With span scaling (the default; ``SPECPILOT_REST_SPAN_SCALING=0`` turns it off), 64
    requests whose drafts are all rejected and the policy's own K held at 4 rest for up to
    GATE_COST_EVERY * 4 steps between full-path steps (GATE_COST_EVERY without it), with as many
    probes at K > 0 give or take three; 8 requests rest as before."""
    cls = scheduler_module._SpecPilotHook
    runs = {}
    for scaling in ("0", "1"):
        monkeypatch.setenv("SPECPILOT_REST_SPAN_SCALING", scaling)
        for b in (8, 4 * cls.BATCH_PAYS_REQUESTS):
            with _standin("adaptive", b, tmp_path / f"{scaling}-{b}", async_scheduling=True) as hook:
                _hold_policy_at_k4(hook, monkeypatch)
                runs[scaling, b] = _rests(hook, monkeypatch, 800)
    assert runs["0", 8][0] == runs["1", 8][0] == cls.GATE_COST_EVERY
    assert runs["0", 64][0] == cls.GATE_COST_EVERY
    assert cls.GATE_COST_EVERY < runs["1", 64][0] <= 4 * cls.GATE_COST_EVERY
    assert runs["1", 64][2] < runs["0", 64][2]  # fewer steps on the full path
    assert runs["1", 64][1] > 0 and abs(runs["1", 64][1] - runs["0", 64][1]) <= 3  # the probes still run


def test_the_policys_own_rests_grow_with_a_large_batch_under_span_scaling(tmp_path, monkeypatch):
    """64 requests whose drafts are all rejected under async scheduling: the adaptive policy holds
    K at 0 itself, and rests for up to LEAN_SPAN * 4 steps between full-path steps
    (LEAN_SPAN with ``SPECPILOT_REST_SPAN_SCALING=0``), exploring as often."""
    cls = scheduler_module._SpecPilotHook
    runs = {}
    for scaling in ("0", "1"):
        monkeypatch.setenv("SPECPILOT_REST_SPAN_SCALING", scaling)
        with _standin("adaptive", 4 * cls.BATCH_PAYS_REQUESTS, tmp_path / scaling, async_scheduling=True) as hook:
            runs[scaling] = _rests(hook, monkeypatch, 1200)
    assert runs["0"][0] <= cls.LEAN_SPAN < runs["1"][0] <= 4 * cls.LEAN_SPAN
    assert runs["1"][2] < 0.7 * runs["0"][2]  # fewer steps on the full path (explorations bound both)
    assert runs["1"][1] > 0 and abs(runs["1"][1] - runs["0"][1]) <= 3, runs  # the explorations still run


@pytest.mark.parametrize("to_explore", [1 << 62, 3])
def test_a_batchs_rest_ends_before_the_policys_next_exploration(tmp_path, monkeypatch, to_explore):
    """The spans of a batch's rest (above) are at most GATE_COST_EVERY steps long and end before
    the policy's next exploration (``SpeculationController.steps_to_explore``), which runs past
    the gate."""
    most = min(to_explore, scheduler_module._SpecPilotHook.GATE_COST_EVERY)
    with _standin("adaptive", 8, tmp_path, async_scheduling=True) as hook:
        _hold_policy_at_k4(hook, monkeypatch, steps_to_explore=to_explore)
        spans: list[int] = []
        enter = hook._enter_lean
        monkeypatch.setattr(hook, "_enter_lean", lambda span, e=enter, seen=spans: seen.append(span) or e(span))
        _run(hook, 300, async_order=True)
        assert spans and max(spans) == most


def test_a_verification_that_accepted_half_its_drafts_starts_the_async_probes_wait_again(tmp_path, monkeypatch):
    """Under async scheduling probes that accept nothing back off to 4 x probe_every steps; a
    verification that accepted at least half its drafts brings the wait back to probe_every,
    one that accepted fewer leaves it backed off (on sampled chat, where a draft token is
    accepted now and then, the wait otherwise seldom backed off: docs/gpu.md, host 37). With
    ``SPECPILOT_PROBE_PRIOR=0`` any accepted token brings it back, as before."""
    for prior in ("1", "0"):
        monkeypatch.setenv("SPECPILOT_PROBE_PRIOR", prior)
        with _standin("adaptive", 1, tmp_path / prior, async_scheduling=True) as hook:
            _run(hook, 400, async_order=True)  # nothing accepted
            every = hook._gate.probe_every
            assert hook._probe_interval == hook.PROBE_BACKOFF * every
            rid = hook.running[0].request_id
            hook.make_spec_decoding_stats(None, 4, 0, request_id=rid)
            assert hook._probe_interval == hook.PROBE_BACKOFF * every  # rejected: still backed off
            hook.make_spec_decoding_stats(None, 4, 1, request_id=rid)
            assert hook._probe_interval == (hook.PROBE_BACKOFF * every if prior == "1" else every)
            hook._probe_interval = hook.PROBE_BACKOFF * every
            hook.make_spec_decoding_stats(None, 4, 2, request_id=rid)
            assert hook._probe_interval == every


def test_a_lone_requests_first_decode_steps_do_not_teach_the_step_time_model(tmp_path, monkeypatch):
    """After a prefill at one request, the hook hands the step-time model only the decode
    steps past the first ``DecodeStretch.SETTLE_STEPS``; at two requests, every one."""
    monkeypatch.setattr(DecodeStretch, "SETTLE_STEPS", 3)
    monkeypatch.setenv("SPECPILOT_K0_LEAN", "0")
    for batch, expected in ((1, 5 - 3), (2, 5)):
        with _standin("fixed:0", batch, tmp_path / str(batch)) as hook:
            _run(hook, 20)
            hook._observe_quiet()
            model = hook.controller.step_time
            out = hook.schedule()  # a step that prefills one request
            rid = hook.running[0].request_id
            out.num_scheduled_tokens = {**out.num_scheduled_tokens, rid: 300}
            out.total_num_scheduled_tokens = sum(out.num_scheduled_tokens.values())
            hook.update_from_output(out, None)
            hook._observe_quiet()
            before = model.steps
            _run(hook, 5)
            hook._observe_quiet()
            assert model.steps - before == expected


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_the_hook_tells_the_controller_when_the_engine_drains(tmp_path, async_scheduling):
    # the adaptive policy brings its next exploration forward for the next burst
    # (AdaptivePolicy.drained); resting on the lean path at K = 0 or not, a drained engine's
    # output reaches the controller
    with _standin("adaptive", 8, tmp_path, async_scheduling=async_scheduling) as hook:
        calls: list[int] = []
        hook.controller.drained = lambda: calls.append(hook._step_index)
        _run(hook, 300)
        assert calls == []
        running, hook.running = hook.running, []
        _run(hook, 2, start=300)
        assert len(calls) == 2
        hook.running = running
        _run(hook, 20, start=302)
        assert len(calls) == 2


@pytest.mark.parametrize("async_scheduling", [True, False])
def test_a_burst_that_quotes_is_drafted_after_bursts_that_do_not(tmp_path, async_scheduling):
    # host 27 (docs/gpu.md): bursts of one kind each, the engine drained between them. Held at
    # K = 0 by bursts whose drafts were rejected, the adaptive engine host served most bursts
    # that quote without drafts: its explorations came every 320 steps, longer than a burst,
    # and the per-request gate, whose estimates were the rejected bursts', answered K = 0 to
    # them. After a drain the next burst is explored within explore_every steps, and an
    # exploration at several requests runs past the gate (python -m bench policy-bursts).
    with _standin("adaptive", 16, tmp_path, async_scheduling=async_scheduling) as hook:
        running = hook.running
        drafted = []
        for burst in range(9):
            quotes = burst % 3 == 2  # two bursts whose drafts are all rejected, then one that quotes
            n_accepted = 2 if quotes else 0
            ks = _run(hook, 250, accept=lambda i, n=n_accepted: n, start=burst * 1000, async_order=async_scheduling)
            hook.running = []  # drained
            _run(hook, 1, start=burst * 1000 + 500)
            hook.running = running
            if quotes:
                drafted.append(sum(k > 0 for k in ks))
        assert all(n >= 150 for n in drafted), drafted


def test_an_exploration_past_the_gate_verifies_every_requests_draft(tmp_path):
    # synchronous scheduling: the gate drops the drafts of requests whose estimates do not pay,
    # but not an exploration's, which measures the whole batch
    with _standin("adaptive", 8, tmp_path) as hook:
        _run(hook, 600)  # drafts rejected: the policy holds K at 0
        for req in hook.running:  # and each request's drafts were rejected: none pays
            for _ in range(20):
                hook._gate.observe(req.request_id, 4, 0)
        hook._gate_costs = lambda b, k: (0.3, 0.05)  # a verified draft token costs 0.3 of a request-step
        policy = hook.controller.policy
        policy.next_explore = policy.steps + 2  # an exploration now
        verified = []
        for i in range(8):
            for req in hook.running:
                req.spec_token_ids = [-1] * hook._k_decided  # the proposer's drafts of the last step
            _run(hook, 1, start=600 + i)
            verified.append((hook._drafts_explored, sum(1 for r in hook.running if r.spec_token_ids)))
        explored = [n for was, n in verified if was]
        assert explored and all(n == 8 for n in explored), verified
        assert all(n == 0 for was, n in verified if not was)  # the gate's own decisions: dropped


def _lone_code_requests_drafting(tmp_path, mode: str) -> tuple[int, int]:
    """Greedy requests one at a time under async scheduling, docs (every draft token
    accepted) and code (every draft rejected) in turn, each finished request named in the
    next step's output as vLLM does (``finished_req_ids``): the code requests' steps at K > 0
    and the docs requests' steps at K > 0."""
    hook, channel = standin_hook(mode, 1, str(tmp_path), async_scheduling=True)
    try:
        finished: list[str] = []
        schedule = hook.schedule

        def schedule_naming_finished():
            out = schedule()
            out.finished_req_ids = set(finished)
            finished.clear()
            return out

        hook.schedule = schedule_naming_finished
        # priced as on a GPU at one request: a verified draft token 2 % of a plain step, a step
        # at K > 0 29 % over one at K = 0 (the stand-in's own step times say nothing)
        hook._gate_costs = lambda b, k: (0.02, 0.29)
        at_k = {"code": 0, "docs": 0}
        start = 0
        for i in range(10):
            for kind in ("docs", "code"):
                rid = f"{kind}-{i}"
                req = types.SimpleNamespace(
                    request_id=rid, spec_token_ids=[], num_output_tokens=8, num_computed_tokens=200
                )
                hook.running = [req]
                hook.requests = {rid: req}
                hook._gate.set_class(rid, "greedy")
                ks = _run(hook, 40, accept=(lambda j: 4) if kind == "docs" else (lambda j: 0), start=start)
                start += 40
                if i >= 3:  # after the class's first requests
                    at_k[kind] += sum(1 for k in ks if k > 0)
                finished.append(rid)
        return at_k["code"], at_k["docs"]
    finally:
        channel.close()


def test_the_mixture_prior_stops_a_rejecting_request_sooner_and_keeps_the_quoting_ones(tmp_path):
    """Between greedy requests that quote, a greedy request whose drafts are all rejected
    starts at the pooled prior's high mean and drafts for several steps; with the mixture
    prior (the default: the acceptance of the class's finished requests) it stops after fewer,
    and the quoting requests still draft."""
    (tmp_path / "p").mkdir()
    (tmp_path / "m").mkdir()
    code_pooled, docs_pooled = _lone_code_requests_drafting(tmp_path / "p", "adaptive_pooled")
    code_mix, docs_mix = _lone_code_requests_drafting(tmp_path / "m", "adaptive")
    assert code_mix <= code_pooled / 2
    assert docs_mix >= 0.9 * docs_pooled


def test_at_k_above_zero_a_step_with_a_prefill_hands_the_controller_only_its_decodes(tmp_path, monkeypatch):
    """A step's decode batch is the requests scheduled for 1 + their drafts tokens: a request
    that prefills in the same step (more tokens, no drafts) is not one, nor one whose drafts
    were cut; every request of a step of decodes only is."""
    monkeypatch.setenv("SPECPILOT_K0_LEAN", "0")
    with _standin("fixed:2", 4, tmp_path) as hook:
        _run(hook, 3)
        seen: list[int] = []
        observe = hook.controller.observe
        hook.controller.observe = lambda obs: (seen.append(obs.batch_size), observe(obs))
        ids = [req.request_id for req in hook.running]
        out = hook.schedule()
        assert out.num_spec_tokens_to_schedule == 2
        for rid in ids:
            hook.make_spec_decoding_stats(None, 2, 1, request_id=rid)
        hook.update_from_output(out, None)  # decodes only
        out = hook.schedule()
        del out.scheduled_spec_decode_tokens[ids[0]]  # its step prefills 300 tokens, no drafts
        out.num_scheduled_tokens[ids[0]] = 300
        out.scheduled_spec_decode_tokens[ids[1]] = [-1]  # one of its two drafts cut: 2 tokens
        out.num_scheduled_tokens[ids[1]] = 2
        out.num_scheduled_tokens[ids[2]] = 1  # scheduled without drafts: 1 token
        out.scheduled_spec_decode_tokens[ids[3]] = [-1, -1, -1]  # (a draft longer than its tokens)
        out.total_num_scheduled_tokens = sum(out.num_scheduled_tokens.values())
        hook.make_spec_decoding_stats(None, 2, 1, request_id=ids[1])
        hook.update_from_output(out, None)
        assert seen == [4, 1]  # the cut one's 1 + 1 tokens make it a decode; the others not


@pytest.mark.parametrize("mode", ["fixed:0", "fixed:2"])  # the lean path's rows and the full path's
def test_the_step_trace_is_kept_out_of_the_hooks_clock(tmp_path, monkeypatch, mode):
    """A trace row that takes 50 ticks of the module's clock: with the trace on, the hook's clock
    holds what it holds without it (the two reads that time each row aside), and the trace's time
    is reported on its own (``overhead.trace_seconds``)."""
    from engine_host.step_trace import StepTrace

    add = StepTrace.add

    def slow_add(self, *a, **k):
        for _ in range(50):
            scheduler_module.time.perf_counter()
        return add(self, *a, **k)

    monkeypatch.setattr(StepTrace, "add", slow_add)
    seconds = {}
    for traced in (False, True):
        if traced:
            monkeypatch.setenv("SPECPILOT_STEP_TRACE", str(tmp_path / "steps.csv"))
        with _standin(mode, 2, tmp_path / str(traced)) as hook:
            n = 3 * hook.LEAN_SAMPLE
            _run(hook, n)
            hook._publish(time.monotonic())
            seconds[traced] = (hook._overhead_s, hook._trace_s)
    (base, none), (with_trace, traced_s) = seconds[False], seconds[True]
    assert none == 0.0 and traced_s >= n * 50e-4  # every row's 50 ticks, counted apart
    assert with_trace - base <= n * 2e-4 + 1e-9  # at most the two reads per row that time it


def test_the_lean_paths_steps_teach_the_step_time_model_what_a_plain_step_takes(tmp_path, monkeypatch):
    """While the adaptive policy rests at K = 0 its steps run on the lean path, which hands
    them back as counts and their mean time (``SpeculationController.skip_quiet``): a plain
    step is then priced at what the lean steps take, below the full path's steps at K = 0
    (where the policy decides, and which run more of the hook's code). With
    ``SPECPILOT_LEAN_STEP_TIMES=0`` only the full path's steps teach it, as before."""
    plain = {}
    for times in ("1", "0"):
        monkeypatch.setenv("SPECPILOT_LEAN_STEP_TIMES", times)
        with _standin("adaptive", 1, tmp_path / times, async_scheduling=True) as hook:
            _run(hook, 400, async_order=True)  # nothing accepted: resting at K = 0
            hook._publish(time.monotonic())  # the lean path's counts reach the controller
            model = hook.controller.step_time
            steps = hook.controller.total_steps
            assert steps >= 390 and model.steps <= steps  # every step counted once
            assert bool(model._lean_at) == (times == "1")  # K = 0's cell learns from the lean steps
            plain[times] = model.predict(1, 0)
    # the stand-in's clock: 2 ms a step and 0.1 ms per clock reading of the hook's
    assert STEP_S < plain["1"] < plain["0"] - 2e-4
