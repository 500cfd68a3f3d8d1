"""``python -m bench step-time-replay``: the step-time model replayed over a recorded step trace."""

from __future__ import annotations

import random
import statistics
from pathlib import Path

import pytest

from bench import step_time_replay as rep
from bench.step_trace import Step, read_trace
from engine_host.step_clock import DecodeStretch
from engine_host.step_trace import StepTrace


def _trace(n: int = 3000, premium: float = 1.2, outliers: float = 0.05, seed: int = 1, tail: float = 0.0) -> list[Step]:
    """Batch-1 pure-decode steps, alternating spells of 50 at K = 0 and at K = 4; a K = 4
    step costs ``premium`` times a K = 0 step; a share ``outliers`` of steps takes 3x, and a
    share ``tail`` of the K = 4 steps 5x."""
    rnd = random.Random(seed)
    steps, t = [], 0.0
    for i in range(n):
        k = 4 if (i // 50) % 2 else 0
        dt = 0.002 * (premium if k else 1.0) * rnd.uniform(0.95, 1.05)
        if rnd.random() < outliers:
            dt *= 3
        if k and rnd.random() < tail:
            dt *= 5
        steps.append(Step(t, t + dt, k, k, 1, 1, 1 + k))
        t += dt
    return steps


def test_the_measured_premium_is_the_ratio_of_median_step_times_and_of_means():
    measured = rep.measured_premiums(_trace(), [1], 4)
    assert set(measured) == {(1, 4)}  # only K = 4 ran beside K = 0
    premium, n_k, n_0, of_means = measured[(1, 4)]
    assert premium == pytest.approx(1.2, abs=0.02) and of_means == pytest.approx(1.2, abs=0.04)
    assert n_k > 1000 and n_0 > 1000
    # a slow tail only at K = 4 (one step in 10 at 5x): the medians do not see it, the means do
    premium, _, _, of_means = rep.measured_premiums(_trace(tail=0.1), [1], 4)[(1, 4)]
    assert premium == pytest.approx(1.2, abs=0.03) and of_means > 1.5


def test_the_replay_prices_k_near_the_measured_premium_and_a_smaller_alpha_narrows_its_swings():
    steps = _trace()
    (plain,) = rep.rows(steps, [1], 4)
    (slow,) = rep.rows(steps, [1], 4, alpha=0.02)
    assert plain.priced and len(plain.priced) == len(slow.priced)
    for row in (plain, slow):
        assert row.quantile(0.5) == pytest.approx(1.2, abs=0.03)
    # one step in 20 at 3x: the mean of the last ten or so steps swings by tens of points
    assert plain.quantile(0.9) - plain.quantile(0.1) > 0.3
    assert slow.quantile(0.9) - slow.quantile(0.1) < plain.quantile(0.9) - plain.quantile(0.1)
    assert slow.within(0.10) > plain.within(0.10)


def _requests(n: int = 60, steps_per_request: int = 40, draft_steps: int = 8, slow_first: int = 3) -> list[Step]:
    """Lone requests one after another: a prefill, then decode steps at batch 1 that draft
    at K = 4 (1.2x a K = 0 step) for the first ``draft_steps`` steps and then run at K = 0
    (as a request whose drafts stop paying); its first ``slow_first`` decode steps take 2x."""
    steps, t = [], 0.0
    for _ in range(n):
        steps.append(Step(t, t + 0.01, 0, 0, 0, 1, 300))  # the prefill
        t += 0.01
        for i in range(steps_per_request):
            k = 4 if i < draft_steps else 0
            dt = 0.002 * (1.2 if k else 1.0) * (2.0 if i < slow_first else 1.0)
            steps.append(Step(t, t + dt, k, k, 1, 1, 1 + k))
            t += dt
        t += 0.2  # idle until the next request
    return steps


def test_a_lone_requests_first_decode_steps_do_not_set_the_price_of_drafting():
    # the product's rule (engine_host.step_clock.DecodeStretch), replayed: without it each
    # request's slow first steps would stay in the K = 4 cell through the K = 0 steps after
    priced = rep.replay(_requests(), [1], 4)[(1, 4)]
    late = priced[len(priced) // 2 :]
    assert statistics.median(late) == pytest.approx(1.2, abs=0.03)


def test_only_steps_at_a_priced_batch_are_sampled_and_prefills_are_not_observed():
    steps = _trace(400, outliers=0.0)
    assert all(not v for v in rep.replay(steps, [2], 4).values())  # no step at batch 2: nothing sampled
    # a prefill before every decode step of batch 1: neither the prefills nor the decode
    # steps right after them teach the model, and a step that taught nothing is not sampled
    mixed = [x for s in steps for x in (Step(s.t_scheduled, s.t_scheduled, 0, 0, 0, 1, 500), s)]
    assert all(not v for v in rep.replay(mixed, [1], 4).values())
    priced = rep.replay(steps, [1], 4)[(1, 4)]
    # every pure-decode step at batch 1 past the first SETTLE_STEPS (DecodeStretch)
    assert len(priced) == 400 - DecodeStretch.SETTLE_STEPS


def test_the_command_prints_a_row_per_batch_and_k_and_refuses_bad_arguments(tmp_path: Path, capsys):
    path = tmp_path / "steps.csv.1"
    trace = StepTrace(str(path))
    for s in _trace(1200):
        trace.add(s.t_scheduled, s.t_output, s.k_drafted, s.k_proposed, s.decode, s.requests, s.tokens)
    trace.flush()
    assert len(read_trace(path)) == 1200
    assert rep.main([str(path), "--batches", "1,8", "--set", "alpha=0.02"]) == 0
    out = capsys.readouterr().out
    row = next(line for line in out.splitlines() if line.startswith("| 1, 4 |"))
    median, mean = (float(v) for v in row.split("|")[2].split("(")[0].split(","))
    assert median == pytest.approx(1.2, abs=0.02) and mean == pytest.approx(1.2, abs=0.05)
    assert "alpha=0.02" in out
    # steps of 2-2.4 ms: with idle spells from 1 ms on, none is measured
    assert rep.main([str(path), "--batches", "1", "--max-gap-ms", "1"]) == 0
    assert "no batch of 1 has 20 measured steps" in capsys.readouterr().out
    assert "| 8," not in out  # no steps at batch 8
    for bad in (["--set", "no_such_arg=1"], ["--set", "cell_clip"], ["--batches", "one"], ["--batches", "0"]):
        with pytest.raises(SystemExit):
            rep.main([str(path), *bad])
    with pytest.raises(SystemExit):
        rep.main([str(tmp_path / "missing.csv")])


def test_within_counts_priced_premiums_near_the_premium_of_means_not_of_medians():
    # the model's cells are means: a slow tail that lifts the mean step is part of the price
    row = rep.PremiumRow(
        batch=8, k=4, measured=1.04, steps_k=100, steps_0=300, priced=(1.20, 1.22, 1.05), measured_mean=1.21
    )
    assert row.within(0.05) == 2 / 3


def _bursts() -> list[Step]:
    """Batch-8 bursts with idle gaps: fast bursts at K = 0 (3 ms a step), and one slow burst
    (every step 1.5x: a shared GPU) that drafts at K = 4 for its first 30 steps (1.45x the
    slow burst's plain step) before running at K = 0, as host 26's burst 72 did."""
    steps, t = [], 0.0

    def burst(n0: int, k_first: int, slow: float) -> None:
        nonlocal t
        for i in range(k_first + n0):
            k = 4 if i < k_first else 0
            dt = 0.003 * slow * (1.45 if k else 1.0)
            steps.append(Step(t, t + dt, k, k, 8, 8, 8 * (1 + k)))
            t += dt
        t += 1.0  # idle

    for _ in range(5):
        burst(200, 0, 1.0)
    burst(60, 30, 1.5)
    for _ in range(2):
        burst(200, 0, 1.0)
    return steps


def test_a_depth_measured_in_a_slow_burst_is_priced_against_that_bursts_plain_steps():
    # the engine's model (premium_window_s): K = 4 against the plain steps after it in the
    # same burst; the model before it: against the K = 0 cell learned in the fast bursts
    engine = rep.replay(_bursts(), [8], 4)[(8, 4)]
    before = rep.replay(_bursts(), [8], 4, premium_window_s=None, premium_first=False)[(8, 4)]
    assert engine and before
    assert engine[-1] == pytest.approx(1.45, abs=0.05)
    assert before[-1] > 1.9  # 1.45 x 1.5: the burst's slowness lent to the depth


def test_set_none_gives_the_model_before_the_near_premium(tmp_path: Path, capsys):
    path = tmp_path / "steps.csv.1"
    trace = StepTrace(str(path))
    for s in _bursts():
        trace.add(s.t_scheduled, s.t_output, s.k_drafted, s.k_proposed, s.decode, s.requests, s.tokens)
    trace.flush()
    args = [str(path), "--batches", "8", "--min-steps", "5", "--set", "premium_window_s=none"]
    assert rep.main([*args, "--set", "premium_first=false"]) == 0
    assert "premium_window_s=None, premium_first=False" in capsys.readouterr().out
    with pytest.raises(SystemExit):  # a window of 0 s is refused with the reason
        rep.main([str(path), "--set", "premium_window_s=0"])
