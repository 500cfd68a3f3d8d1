"""The scheduler hook's lean path at K = 0 (``engine_host.scheduler``, ``LEAN_SAMPLE``).

While the policy holds K at 0 and learns nothing from steps (fixed at 0, off), a step only
checks the config's sequence number, keeps the step clock and counts itself; every
``LEAN_SAMPLE``-th output is still observed. These tests drive the real hook on the stand-in
scheduler of ``python -m bench hook-cost``."""

from __future__ import annotations

import time

import pytest

from bench.hook_cost import standin_hook
from engine_host.config import LiveConfig


def _steps(hook, n: int) -> None:
    for _ in range(n):
        hook.has_requests()
        out = hook.schedule()
        hook.update_from_output(out, None)


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
    _steps(hook, 1)
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
    _steps(hook, 200)
    hook._publish(time.monotonic())  # the counts reach the controller before a state is published
    assert ctl.steps_at_k[0] - at_k[0] == 200
    assert ctl.steps_at_k[1:] == at_k[1:]
    assert ctl.total_steps - total == 200
    assert hook._step_index - index == 200
    assert hook._busy_s > busy and hook._overhead_s > overhead
    assert ctl.k_current == 0


def test_the_lean_path_samples_outputs_for_the_step_time_model(hook_at_k0):
    hook, _ = hook_at_k0
    hook._publish_due = float("inf")  # no publish inside the loop
    _steps(hook, 1)
    hook._observe_quiet()  # the first (full) step's observation
    seen: list[int] = []
    observe_quiet = hook.controller.observe_quiet
    hook.controller.observe_quiet = lambda steps: (seen.append(len(steps)), observe_quiet(steps))
    n = 20 * hook.LEAN_SAMPLE
    _steps(hook, n)
    hook._observe_quiet()
    assert sum(seen) == n // hook.LEAN_SAMPLE  # one output in LEAN_SAMPLE is observed


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
            _steps(hook, 300)
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
    _steps(hook, 3)
    assert hook._lean
    _write(channel, 2, "adaptive")
    hook.schedule()  # the sequence number moved: the full path reads the config
    assert not hook._lean
    assert hook.dynamic_sd_lookup is hook._live_lookup
    assert hook.controller.policy.name == "adaptive"
    hook.update_from_output(hook.schedule(), None)
    assert not hook._lean  # adaptive decides K every step


def test_a_batch_cap_is_applied_on_the_lean_path(hook_at_k0):
    hook, channel = hook_at_k0
    _steps(hook, 3)
    cfg = LiveConfig().model_dump(mode="json")
    cfg["speculation"]["mode"] = "fixed"
    cfg["speculation"]["k"] = 0
    cfg["batch"]["max_num_seqs"] = 8
    hook._publish(time.monotonic())
    counted = sum(hook.controller.steps_at_k)
    channel.write_config(2, cfg)
    _steps(hook, 3)
    assert hook._lean  # still K = 0
    assert hook.max_num_running_reqs == 8
    hook._publish(time.monotonic())
    assert sum(hook.controller.steps_at_k) - counted == 3  # the step that read the config too


def test_a_warmup_k_leaves_the_lean_path_and_returning_to_k0_enters_it_again(hook_at_k0):
    hook, channel = hook_at_k0
    _steps(hook, 3)
    _write(channel, 1, "fixed", warmup_k=3, k=0)
    _steps(hook, 2)
    assert not hook._lean
    assert hook.schedule().num_spec_tokens_to_schedule == 3
    _write(channel, 1, "fixed", warmup_k=None, k=0)
    _steps(hook, 3)
    assert hook._lean
    assert hook.schedule().num_spec_tokens_to_schedule == 0


def test_fixed_k_above_zero_and_the_switch_off_never_take_the_lean_path(tmp_path, monkeypatch):
    hook, channel = standin_hook("fixed:4", 1, str(tmp_path / "k4"))
    try:
        _steps(hook, 5)
        assert not hook._lean
    finally:
        channel.close()
    monkeypatch.setenv("SPECPILOT_K0_LEAN", "0")
    hook, channel = standin_hook("fixed:0", 1, str(tmp_path / "off"))
    try:
        _steps(hook, 5)
        assert not hook._lean
        assert hook.dynamic_sd_lookup is hook._live_lookup
    finally:
        channel.close()


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
