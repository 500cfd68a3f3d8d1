"""The scheduler hook steps aside at a static K = 0 (``engine_host.scheduler``, ``_step_aside``).

Between two state publishes vLLM's engine core then calls vLLM's own ``schedule()`` and
``update_from_output()``; the hook's ``has_requests()`` steps back in when the config changes,
a publish is due or the engine drains, and every step still counts. These tests drive the real
hook on the stand-in scheduler of ``python -m bench hook-cost`` (which counts its steps in
``current_step`` as vLLM's does), under a clock the tests move by hand."""

from __future__ import annotations

import contextlib
import types

import pytest

import engine_host.scheduler as scheduler_module
from bench.hook_cost import _SchedulerStandIn, standin_hook, standin_request
from engine_host.config import LiveConfig

STEP_S = 2e-3  # what a step takes (s): the clock moves by this much per step
_now = [1000.0]


@pytest.fixture(autouse=True)
def _hand_clock(monkeypatch):
    """The hook's clocks (wall, thread CPU, monotonic) read one value the tests move."""

    def now() -> float:
        return _now[0]

    _now[0] = 1000.0
    monkeypatch.setattr(
        scheduler_module, "time", types.SimpleNamespace(perf_counter=now, thread_time=now, monotonic=now, time=now)
    )


@contextlib.contextmanager
def _standin(mode: str, batch: int, folder, **kwargs):
    hook, channel = standin_hook(mode, batch, str(folder), **kwargs)
    try:
        yield hook, channel
    finally:
        channel.close()


def _run(hook, n: int, async_order: bool = False) -> list[int]:
    """``n`` engine steps in vLLM's engine-core order (``has_requests()``, ``schedule()``, the
    step, ``update_from_output()``; with ``async_order`` step i + 1 is scheduled before step i's
    output comes back). The clock moves ``STEP_S`` per step. Returns each step's K."""
    ks = []
    for _ in range(n):
        if not hook.has_requests():
            break
        out = hook.schedule()
        ks.append(out.num_spec_tokens_to_schedule)
        _now[0] += STEP_S
        if async_order:
            out, hook._test_pending = getattr(hook, "_test_pending", None), out
            if out is None:
                continue
        hook.update_from_output(out, None)
    return ks


def _aside(hook) -> bool:
    return hook._aside and "schedule" in hook.__dict__ and "update_from_output" in hook.__dict__


@pytest.mark.parametrize("async_order", [False, True])
def test_at_a_static_k0_the_hook_steps_aside_and_every_step_still_counts(tmp_path, async_order):
    with _standin("fixed:0", 2, tmp_path, async_scheduling=async_order) as (hook, _):
        _run(hook, 3, async_order)
        assert _aside(hook)
        # vLLM's own methods run: the hook's clock and step index stand still
        overhead, index = hook._overhead_s, hook._step_index
        assert hook.schedule.__func__ is _SchedulerStandIn.schedule
        _run(hook, 40, async_order)  # 80 ms: no publish due (every 0.25 s)
        assert (hook._overhead_s, hook._step_index) == (overhead, index)
        assert hook._aside
        # a publish falls due: the next has_requests() steps back in and counts the steps
        _now[0] += 0.3
        _run(hook, 1, async_order)
        assert hook._step_index == 44 and hook._aside_steps >= 40
        hook._publish(_now[0])
        assert sum(hook.controller.steps_at_k) == hook._step_index == hook.current_step
        assert hook.controller.steps_at_k[0] == 44
        # one output a step: the step in flight under async scheduling comes back later
        assert hook.controller.total_steps == 44 - (1 if async_order else 0)
        assert _aside(hook)  # the published step steps aside again
        state = hook._channel.read_state()
        assert state["step_index"] == 44 and state["overhead"]["aside_steps"] == hook._aside_steps
        # every step is counted on one path: full, lean or stood aside
        lean = state["overhead"]["lean_steps"]
        assert lean >= 0 and lean + state["overhead"]["aside_steps"] <= 44
        assert state["overhead"]["aside_seconds"] > 0
        # the time stood aside with requests running is busy time
        assert state["overhead"]["busy_seconds"] >= state["overhead"]["aside_seconds"]


def test_a_new_config_is_applied_at_the_next_step_while_the_hook_stands_aside(tmp_path):
    with _standin("fixed:0", 1, tmp_path) as (hook, channel):
        _run(hook, 5)
        assert _aside(hook)
        cfg = LiveConfig().model_dump(mode="json")
        cfg["speculation"].update(mode="fixed", k=3)
        channel.write_config(2, cfg)
        ks = _run(hook, 3)
        assert ks[0] == 3 and not hook._aside and "schedule" not in hook.__dict__
        assert channel.read_ack()[0] == channel.config_seq()  # acknowledged
        assert hook._channel.read_state()["config_version"] == 2


def test_the_engine_draining_steps_the_hook_back_in_and_publishes_the_idle_state(tmp_path):
    with _standin("fixed:0", 1, tmp_path) as (hook, _):
        _run(hook, 10)
        assert _aside(hook)
        hook.finish_request("r0")
        hook.busy = False  # nothing left: vLLM's has_requests() says so
        assert hook.has_requests() is False
        assert not hook._aside and "update_from_output" not in hook.__dict__
        state = hook._channel.read_state()
        assert state["running"] == 0 and state["step_index"] == hook.current_step == 10
        # the next request's steps are vLLM's own from its first output on
        _SchedulerStandIn.add_request(hook, standin_request("r1", 2))
        hook.busy = True
        _run(hook, 1)
        assert _aside(hook)


def test_the_hook_stays_in_while_tracing_and_under_a_batch_cap(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECPILOT_STEP_TRACE", str(tmp_path / "steps.csv"))
    with _standin("fixed:0", 1, tmp_path / "trace") as (hook, _):
        _run(hook, 40)
        assert hook._lean and not hook._aside  # the trace writes a row a step
    monkeypatch.delenv("SPECPILOT_STEP_TRACE")
    (tmp_path / "cap").mkdir()
    with _standin("fixed:0", 1, tmp_path / "cap") as (hook, channel):
        cfg = LiveConfig().model_dump(mode="json")
        cfg["speculation"].update(mode="fixed", k=0)
        cfg["batch"]["max_num_seqs"] = 8  # below the start-up limit: followed step by step
        channel.write_config(2, cfg)
        _run(hook, 40)
        assert hook._lean and not hook._aside


def test_hook_aside_0_keeps_the_hook_on_its_lean_path(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECPILOT_HOOK_ASIDE", "0")
    with _standin("fixed:0", 1, tmp_path) as (hook, _):
        _run(hook, 40)
        assert hook._lean and not hook._aside and hook._step_index == 40


def test_after_stepping_back_in_the_output_of_vllms_own_step_is_not_timed_under_async_scheduling(tmp_path):
    with _standin("fixed:0", 1, tmp_path, async_scheduling=True) as (hook, _):
        _run(hook, 5, async_order=True)
        assert _aside(hook)
        _run(hook, 20, async_order=True)
        _now[0] += 0.3
        hook.has_requests()  # steps back in: the step in flight was scheduled by vLLM alone
        assert not hook._aside and hook._clock.in_flight == 0
        timed = []
        real = hook._clock.output

        def output(t, key=None):
            dt, step = real(t, key)
            timed.append((round(dt, 6), step is not None))
            return dt, step

        hook._clock.output = output
        out = hook.schedule()  # recorded by the hook
        _now[0] += STEP_S
        hook.update_from_output(hook._test_pending, None)  # vLLM's step: not timed, nothing popped
        hook._test_pending = out
        # the hook's own step stays in flight, to be matched to its own output
        assert timed == [(0.0, False)] and hook._clock.in_flight == 1
        assert hook._clock._pending[0].key is out


def _adaptive_run(folder, monkeypatch, aside: str, async_order: bool, batch: int, accept_from: int):
    """The adaptive policy over 1,200 steps whose drafts are accepted from step ``accept_from``
    on: the K of each step, the steps the hook stood aside for, and the controller's counts."""
    monkeypatch.setenv("SPECPILOT_HOOK_ASIDE", aside)
    _now[0] = 1000.0
    folder.mkdir()
    with _standin("adaptive", batch, folder, async_scheduling=async_order) as (hook, _):
        ks = []
        prev = 0
        pending = None
        for i in range(1200):
            assert hook.has_requests()
            out = hook.schedule()
            ks.append(out.num_spec_tokens_to_schedule)
            _now[0] += STEP_S
            step = (out, prev, i)
            prev = out.num_spec_tokens_to_schedule
            if async_order:
                step, pending = pending, step
                if step is None:
                    continue
            out, verified, j = step
            if verified:
                for req in hook.running:
                    a = verified if j >= accept_from else 0
                    hook.make_spec_decoding_stats(None, verified, a, request_id=req.request_id)
            hook.update_from_output(out, None)
        hook.has_requests()
        hook._publish(_now[0])
        ctl = hook.controller
        return ks, hook._aside_steps, (list(ctl.steps_at_k), ctl.total_steps, hook._step_index)


@pytest.mark.parametrize("batch", [1, 4])  # async scheduling (synchronous: the gate drops drafts per request, no rests)
def test_the_adaptive_policys_rests_stay_on_the_lean_path(tmp_path, monkeypatch, batch):
    """The adaptive policy learns a plain step's price from its rests' lean steps: it never stands
    aside, and it probes, explores and starts to draft at the same steps with stepping aside
    allowed or not."""
    runs = {
        aside: _adaptive_run(tmp_path / aside, monkeypatch, aside, True, batch, accept_from=700) for aside in ("1", "0")
    }
    (ks, stood, counts), (ks_in, stood_in, counts_in) = runs["1"], runs["0"]
    assert stood == stood_in == 0
    assert ks == ks_in and counts == counts_in
    assert ks[:700].count(0) > 500 and sum(k > 0 for k in ks[700:]) > 150  # rested at K = 0, then drafted
