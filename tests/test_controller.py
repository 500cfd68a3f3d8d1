"""Unit tests of the speculation-depth policies on constructed statistics (no engine)."""

from __future__ import annotations

import random
from collections import Counter

import pytest

from engine_host.config import SpeculationConfig
from engine_host.controller import (
    AcceptanceEstimator,
    AdaptivePolicy,
    SpeculationController,
    StepObservation,
    StepTimeModel,
    batch_bucket,
)


class Sim:
    """A synthetic engine: acceptance r_i = a**i (positions all-accepted), step time
    t0 + t1 * B * (1 + K) seconds; drafts proposed at one step are verified at the next."""

    def __init__(self, ctl: SpeculationController, seed: int = 0):
        self.ctl = ctl
        self.rng = random.Random(seed)
        self.k_prev = 0
        self.now = 0.0
        self.ks: list[int] = []

    def run(self, steps: int, batch: int, accept: float, t0: float, t1: float) -> list[int]:
        out = []
        for _ in range(steps):
            k = self.ctl.k_for_batch(batch)
            kd = self.k_prev
            hist = [0] * self.ctl.k_engine
            drafted = accepted = 0
            for _r in range(batch):
                drafted += kd
                n = 0
                while n < kd and self.rng.random() < accept:
                    n += 1
                accepted += n
                for i in range(n):
                    hist[i] += 1
            dt = t0 + t1 * batch * (1 + kd)
            self.now += dt
            self.ctl.observe(StepObservation(batch, kd, drafted, accepted, hist, dt, True, self.now))
            self.k_prev = k
            out.append(k)
        self.ks += out
        return out


def mode_of(ks: list[int]) -> int:
    return Counter(ks).most_common(1)[0][0]


def adaptive(k_min=0, k_max=None, **kw) -> SpeculationController:
    return SpeculationController(8, SpeculationConfig(mode="adaptive", k_min=k_min, k_max=k_max, **kw))


def test_zero_acceptance_turns_speculation_off():
    sim = Sim(adaptive())
    ks = sim.run(600, batch=4, accept=0.0, t0=0.02, t1=0.002)
    assert mode_of(ks[-200:]) == 0
    assert sim.ctl.policy.current == 0


def test_high_acceptance_with_cheap_verification_goes_deep():
    sim = Sim(adaptive())
    ks = sim.run(800, batch=1, accept=0.92, t0=0.02, t1=0.0002)
    assert mode_of(ks[-200:]) >= 7


def test_same_acceptance_at_larger_batch_chooses_smaller_k():
    small = Sim(adaptive(), seed=1)
    small.run(800, batch=1, accept=0.85, t0=0.02, t1=0.0005)
    large = Sim(adaptive(), seed=1)
    large.run(800, batch=48, accept=0.85, t0=0.02, t1=0.0005)
    k_small = mode_of(small.ks[-200:])
    k_large = mode_of(large.ks[-200:])
    assert k_large < k_small, (k_small, k_large)


@pytest.mark.parametrize("k_min,k_max", [(0, 3), (2, 5), (4, 4), (1, 8)])
def test_bounds_always_respected(k_min, k_max):
    sim = Sim(adaptive(k_min=k_min, k_max=k_max), seed=3)
    ks = sim.run(300, batch=2, accept=0.9, t0=0.02, t1=0.0003)
    ks += sim.run(300, batch=2, accept=0.0, t0=0.02, t1=0.003)
    assert all(k_min <= k <= k_max for k in ks), sorted(set(ks))


def test_estimates_recover_after_workload_change():
    sim = Sim(adaptive(), seed=5)
    sim.run(500, batch=2, accept=0.9, t0=0.02, t1=0.0005)
    assert mode_of(sim.ks[-100:]) >= 4
    sim.run(500, batch=2, accept=0.0, t0=0.02, t1=0.0005)
    assert mode_of(sim.ks[-100:]) == 0
    sim.run(800, batch=2, accept=0.9, t0=0.02, t1=0.0005)
    assert mode_of(sim.ks[-100:]) >= 4


def test_off_when_speculation_only_matches_plain_decoding():
    # acceptance that makes G(K) about equal to G(0): the margin keeps K at 0
    sim = Sim(adaptive(), seed=7)
    ks = sim.run(600, batch=4, accept=0.12, t0=0.01, t1=0.0025)
    assert mode_of(ks[-200:]) == 0


def test_acceptance_estimator_per_position_and_expected_tokens():
    est = AcceptanceEstimator(4, alpha=1.0)
    # 10 decode requests drafted at K=4: 8 accepted pos 1, 6 accepted pos 1..2, 5 pos 1..3, 0 pos 4
    est.observe(4, 10, [8, 6, 5, 0])
    assert est.r() == pytest.approx([0.8, 0.6, 0.5, 0.0])
    assert est.conditional() == pytest.approx([0.8, 0.75, 5 / 6, 0.0])
    assert est.expected_tokens(2) == pytest.approx(2.4)
    est.observe(1, 10, [5, 0, 0, 0])
    assert est.observed_request_steps == [20, 10, 10, 10]
    # positions beyond the drafted depth are not measured: they are extrapolated from
    # position 1 with the conditional acceptance measured before; one below the prior (0.5)
    # returns toward it with the estimates' memory once its evidence has faded (a 0
    # measured in one workload must not hold every later one at a shallow depth)
    est = AcceptanceEstimator(4, alpha=0.01)
    for _ in range(50):
        est.observe(4, 10, [8, 6, 5, 0])
    est.observe(1, 10, [5, 0, 0, 0])
    assert est.conditional()[1:] == pytest.approx([0.75, 5 / 6, 0.0], abs=0.01)
    for _ in range(100):  # 1000 request-steps at K = 1
        est.observe(1, 10, [5, 0, 0, 0])
    assert est.conditional()[0] == pytest.approx(0.5, abs=0.01)
    assert est.conditional()[1:] == pytest.approx([0.75, 5 / 6, 0.5], abs=0.05)


def test_estimate_weighs_request_steps_so_batch_one_is_not_one_step():
    # batch 1, one step in three has all its drafts accepted, the others none, at random
    rnd = random.Random(3)
    est = AcceptanceEstimator(8, alpha=0.01)
    e8 = []
    for _ in range(30 * 64):
        hit = rnd.random() < 1 / 3
        est.observe(8, 1, [1] * 8 if hit else [0] * 8, [1] * 8 if hit else [0] * 8)
        e8.append(est.expected_tokens(8))
    tail = e8[-3 * 64 * 5 :]
    # true mean E(8) = 1 + 8/3; a per-step EMA (memory 20 steps) swings between 1 and 9
    assert 2.0 < min(tail) and max(tail) < 6.0, (min(tail), max(tail))
    assert est.changes == 0  # noise is not a change of workload


def _docs_then_nothing(est, rnd, docs_steps=800, first=0.46):
    """Docs-like drafts (position 1 accepted ``first``, then 85 % each) at K = 8 and batch 1,
    then a workload that accepts nothing; returns E(8) after each step of the second part."""
    for _ in range(docs_steps):
        n = 0
        if rnd.random() < first:
            n = 1
            while n < 8 and rnd.random() < 0.85:
                n += 1
        est.observe(8, 1, [1 if i < n else 0 for i in range(8)])
    out = []
    for _ in range(300):
        est.observe(8, 1, [0] * 8)
        out.append(est.expected_tokens(8))
    return out


@pytest.mark.parametrize("first", [0.46, 0.25])
def test_a_change_of_workload_is_followed_within_tens_of_request_steps(first):
    with_detector = _docs_then_nothing(AcceptanceEstimator(8, alpha=0.01), random.Random(0), first=first)
    without = _docs_then_nothing(AcceptanceEstimator(8, alpha=0.01, detect_factor=0.0), random.Random(0), first=first)
    assert with_detector[75] < 1.05 and with_detector[150] < 1.01
    assert without[75] > 1.3 and without[150] > 1.1  # memory of 1/alpha = 100 request-steps alone
    est = AcceptanceEstimator(8, alpha=0.01)
    _docs_then_nothing(est, random.Random(0), first=first)
    assert est.changes == 1


@pytest.mark.parametrize("batch", [1, 8])
@pytest.mark.parametrize("p", [0.05, 0.15, 0.2, 0.3, 0.6])
def test_change_detector_is_quiet_at_a_steady_acceptance(batch, p):
    rnd = random.Random(1)
    est = AcceptanceEstimator(8, alpha=0.01)
    for _ in range(20_000 // batch):
        est.observe(8, batch, [sum(rnd.random() < p for _ in range(batch))] + [0] * 7)
    assert est.changes <= 10  # at most one false alarm per 2000 request-steps; it only forgets the past


def test_time_passes_at_k0_and_old_estimates_fade():
    est = AcceptanceEstimator(8, alpha=0.01)
    for _ in range(300):
        est.observe(8, 4, [4] * 8)
    assert est.fresh(7)
    for _ in range(500):
        est.observe(0, 4, [0] * 8)  # speculation off: nothing measured, time passes
    assert not est.fresh(0) and est.r()[7] > 0.9  # kept, but stale
    for _ in range(100_000):  # very long spell at K=0: ratios stay defined
        est.observe(0, 8, [0] * 8)
    assert est.r()[0] > 0.9 and all(d > 0 for d in est.den)
    est.observe(1, 4, [0] * 8)  # one short measurement after it outweighs the old estimate
    assert est.r()[0] < 0.05 and est.r()[7] < 0.05


def test_step_time_model_learns_cost_per_verified_token():
    m = StepTimeModel(alpha=0.2)
    for b in (1, 2, 4, 8, 16):
        for k in (0, 2, 4):
            for _ in range(5):
                m.observe(b, b * (k + 1), 0.01 + 0.001 * b * (k + 1))
    t0, t1 = m.coefficients()
    assert t0 == pytest.approx(0.01, rel=0.05) and t1 == pytest.approx(0.001, rel=0.05)
    assert m.predict(8, 2) == pytest.approx(0.01 + 0.001 * 8 * 3, rel=0.05)
    assert m.predict(32, 6) == pytest.approx(0.01 + 0.001 * 32 * 7, rel=0.1)  # unseen bucket
    # the cost follows the tokens really drafted: half-length drafts cost less
    assert m.predict(8, 6, draft_per_request=3.0) == pytest.approx(m.predict(8, 3), rel=1e-6)
    assert batch_bucket(1) == 0 and batch_bucket(3) == 1 and batch_bucket(8) == 3


def test_a_line_through_one_point_prices_a_token_at_its_prior_and_one_slow_draft_step_moves_it_part_way():
    """A lone request decoding at K = 0 (every step one token): the slope is the prior's,
    a draft token at batch 1 priced at SLOPE_PRIOR_RATIO / (1 + SLOPE_PRIOR_RATIO) of a step,
    not a fifth of it as the 0.8 / 0.2 split of before did. One slow step with a 4-token
    verification then moves the slope part of the way, and steps of every length take over."""
    m = StepTimeModel()
    r = StepTimeModel.SLOPE_PRIOR_RATIO
    for _ in range(60):
        m.observe(1, 1, 0.100)
    t0, t1 = m.coefficients()
    assert t0 + t1 == pytest.approx(0.100, rel=1e-6) and t1 / t0 == pytest.approx(r, rel=1e-6)
    assert m.coefficients3()[1] == pytest.approx(t1, rel=1e-3)
    m.observe(1, 4, 0.160)  # 20 ms a token by itself
    slope = m.coefficients3()[1]
    assert t1 < slope < 0.6 * 0.020  # (the least-squares slope alone: 0.020)
    for i in range(400):  # then 5 ms a token, at 1 to 9 tokens a step
        x = 1 + i % 9
        m.observe(1, x, 0.095 + 0.005 * x)
    assert m.coefficients3()[1] == pytest.approx(0.005, rel=0.05)


def test_fixed_off_and_batch_table_policies():
    ctl = SpeculationController(8, SpeculationConfig(mode="fixed", k=5))
    assert ctl.k_for_batch(3) == 5
    ctl.configure(SpeculationConfig(mode="off"))
    assert ctl.k_for_batch(3) == 0
    ctl.configure(SpeculationConfig(mode="batch_table", table=[(1, 4, 6), (8, 16, 2), (32, 64, 0)]))
    assert [ctl.k_for_batch(b) for b in (1, 4, 5, 8, 20, 40, 100)] == [6, 6, 6, 2, 2, 0, 0]
    assert ctl.steps_at_k[6] == 3


def test_heuristic_policy_follows_transformers_schedule():
    ctl = SpeculationController(8, SpeculationConfig(mode="heuristic", k_min=1, k_max=8))
    assert ctl.k_for_batch(1) == 8
    ctl.observe(StepObservation(1, 8, 8, 3, [1, 1, 1, 0, 0, 0, 0, 0], 0.01, True))
    assert ctl.k_for_batch(1) == 7
    ctl.observe(StepObservation(1, 7, 7, 7, [1] * 7 + [0], 0.01, True))
    assert ctl.k_for_batch(1) == 8  # +2, capped at k_max
    for _ in range(20):
        ctl.observe(StepObservation(1, 1, 1, 0, [0] * 8, 0.01, True))
    assert ctl.k_for_batch(1) == 1  # never below 1
    ctl.observe(StepObservation(1, 1, 0, 0, [0] * 8, 0.01, True))  # no drafts: unchanged
    assert ctl.k_for_batch(1) == 1


def test_threshold_policy_moves_every_interval():
    ctl = SpeculationController(8, SpeculationConfig(mode="threshold"))
    assert ctl.k_for_batch(1) == 2
    t = 0.0

    def feed(rate: float, seconds: float):
        nonlocal t
        end = t + seconds
        while t < end:
            t += 0.5
            ctl.observe(StepObservation(1, 4, 100, int(rate * 100), [0] * 8, 0.01, True, now=t))

    feed(0.9, 10.5)
    assert ctl.k_for_batch(1) == 3
    feed(0.9, 10.5)
    assert ctl.k_for_batch(1) == 4
    feed(0.5, 10.5)
    assert ctl.k_for_batch(1) == 3
    feed(0.1, 10.5)
    assert ctl.k_for_batch(1) == 0


def test_snapshot_exposes_estimates_goodput_and_step_counts():
    sim = Sim(adaptive(), seed=2)
    sim.run(100, batch=2, accept=0.8, t0=0.02, t1=0.0005)
    snap = sim.ctl.snapshot()
    assert snap["mode"] == "adaptive"
    assert len(snap["acceptance_per_position"]) == 8
    assert set(snap["expected_tokens_per_step"]) == {str(k) for k in range(9)}
    assert set(snap["predicted_goodput_tokens_per_s"]) == {str(k) for k in range(9)}
    assert sum(snap["steps_at_k"]) == 100
    assert 0.2 < snap["acceptance_rate"] < 0.85  # accepted / drafted, drafts of several tokens


def test_bucket_correction_captures_flat_small_batch_cost():
    # GPU-like: steps cost the same at small batch whatever the tokens, linear at large batch
    m = StepTimeModel(alpha=0.2)
    for _ in range(30):
        for b in (1, 2):
            for k in (0, 4, 8):
                m.observe(b, b * (k + 1), 0.010)
        for k in (0, 4, 8):
            m.observe(64, 64 * (k + 1), 0.010 + 0.00005 * 64 * (k + 1))
    assert m.predict(1, 8) == pytest.approx(0.010, rel=0.15)
    assert m.predict(64, 8) > 1.5 * m.predict(64, 0)


def test_stale_deep_positions_follow_a_change_seen_at_shallow_depth():
    est = AcceptanceEstimator(8, alpha=0.05)
    for _ in range(40):
        est.observe(8, 4, [4, 4, 4, 4, 4, 4, 4, 4])  # copy-like: everything accepted
    assert est.r()[7] > 0.9
    for _ in range(60):
        est.observe(1, 4, [0] + [0] * 7)  # now only depth 1 observed, nothing accepted
    assert est.r()[0] < 0.05
    assert est.r()[7] < 0.05  # stale deep positions extrapolated, not kept at 1.0
    for _ in range(60):
        est.observe(1, 4, [2] + [0] * 7)  # depth 1 accepts half: deep positions follow with
    assert est.r()[0] == pytest.approx(0.5, abs=0.05)  # the conditional measured before (1.0)
    assert est.r()[7] == pytest.approx(est.r()[0], rel=0.01)


def test_deep_acceptance_of_copy_traffic_fades_when_chat_is_drafted_deep_and_never_gets_there():
    # copy traffic measures every depth at ~1.0; then chat, still drafted at K = 8: its first
    # token is accepted one step in ten, a second one now and then, nothing deeper. The deep
    # positions are drafted but no request reaches them, so what copy measured there must not
    # stay: kept at 1.0 they priced every chat draft of 8 as if its rare accepted first token
    # ran on to the end (the engine then held K at 7-8 on chat after copy traffic)
    rng = random.Random(5)
    est = AcceptanceEstimator(8)
    for _ in range(300):
        est.observe(8, 4, [4] * 8)
    assert min(est.conditional()[1:]) > 0.95
    for _ in range(400):
        hist = [0] * 8
        for _ in range(4):
            if rng.random() < 0.1:
                hist[0] += 1
                if rng.random() < 0.3:
                    hist[1] += 1
        est.observe(8, 4, hist)
    assert est.r()[0] == pytest.approx(0.1, abs=0.05)
    assert max(est.cond[2:]) < 0.55, est.cond  # back at the prior (0.5), not at copy's 1.0
    assert est.expected_tokens(8) < 1.25, est.r()
    # a depth the controller does not draft keeps its shape (the test above): only drafted,
    # unmeasured positions return toward the prior
    for _ in range(200):
        est.observe(8, 4, [4] * 8)
    for _ in range(200):
        est.observe(2, 4, [2, 2] + [0] * 6)
    assert min(est.cond[2:]) > 0.95


def test_chat_to_copy_change_is_found_from_k0():
    sim = Sim(adaptive(), seed=11)
    sim.run(400, batch=1, accept=0.0, t0=0.03, t1=0.0003)
    assert mode_of(sim.ks[-100:]) == 0
    sim.run(600, batch=1, accept=0.9, t0=0.03, t1=0.0003)
    assert mode_of(sim.ks[-150:]) >= 6


def test_per_depth_correction_captures_costs_a_line_misses():
    # verifying 8-token drafts costs 40 % more than the tokens alone say (CPU-like)
    m = StepTimeModel()

    def t(b: int, k: int) -> float:
        return (0.05 + 0.002 * b * (1 + k)) * (1.4 if k == 8 else 1.0)

    for _ in range(60):
        for k in (0, 2, 8):
            m.observe(12, 12 * (1 + k), t(12, k), k)
    for k in (0, 2, 8):
        assert m.predict(12, k) == pytest.approx(t(12, k), rel=0.03), k
    # a depth not run for a long time, with K = 0 not run either, falls back to the batch
    # bucket's correction (its premium over K = 0 has nothing measured to stand on)
    for _ in range(500):
        m.observe(12, 36, t(12, 2), 2)
    assert m.correction(12, 8) == pytest.approx(m.correction(12), rel=1e-9)
    # with K = 0 measured again at this batch size, the premium prices K = 8 as it was
    for _ in range(20):
        m.observe(12, 12, t(12, 0), 0)
    assert m.predict(12, 8) == pytest.approx(t(12, 8), rel=0.05)


def test_a_depth_priced_at_batch_1_keeps_its_premium_after_a_spell_at_larger_batches():
    # GPU-like (docs/gpu.md, host 23's step trace): at batch 1 a step at K = 4 takes 21 % more
    # than one at K = 0, almost all of it fixed (the proposer, the rejection sampler), while at
    # batch 8 the same depth costs 37 %. After 600 steps at batch 8 the batch-1 cell of K = 4
    # is stale; the line fitted across both batch sizes puts K = 4 at batch 1 about 10 % over
    # K = 0, and the gate would draft where it does not pay. The premium keeps the 21 %.
    m = StepTimeModel()
    for i in range(300):
        m.observe(1, 1, 2.1e-3, 0, 0)
        if i % 3 == 0:
            m.observe(1, 5, 2.55e-3, 4, 4)
    assert m.predict(1, 4) / m.predict(1, 0) == pytest.approx(2.55 / 2.1, rel=0.02)
    for i in range(600):
        m.observe(8, 8, 2.3e-3, 0, 0)
        if i % 3 == 0:
            m.observe(8, 40, 3.15e-3, 4, 4)
    for _ in range(20):  # batch 1 again: K = 0's cell is fresh, K = 4's is not
        m.observe(1, 1, 2.1e-3, 0, 0)
    assert m.steps - m.cells[(batch_bucket(1), 4)][2] > m.fresh_steps
    assert m.predict(1, 4) / m.predict(1, 0) == pytest.approx(2.55 / 2.1, rel=0.03)
    assert m.predict(8, 4) / m.predict(8, 0) == pytest.approx(3.15 / 2.3, rel=0.03)
    # the premium is followed when the depth runs at batch 1 again and costs more now
    for _ in range(60):
        m.observe(1, 1, 2.1e-3, 0, 0)
        m.observe(1, 5, 2.9e-3, 4, 4)
    assert m.predict(1, 4) / m.predict(1, 0) == pytest.approx(2.9 / 2.1, rel=0.03)


def test_no_acceptance_stays_off_even_when_a_deeper_k_was_timed_faster():
    # K=0 timed while the host was busier (longer contexts), K=7 later when it was not:
    # with nothing accepted, speculation cannot pay, whatever the two cells say
    ctl = adaptive()
    b = 4
    for i in range(60):
        ctl.observe(StepObservation(b, 0, 0, 0, [0] * 8, 0.040, True, float(i)))
    for i in range(60):
        draft = [1] * 8  # one request in four finds an n-gram draft; none is accepted
        ctl.observe(StepObservation(b, 7, 7, 0, [0] * 8, 0.034, True, 60.0 + i, draft_hist=draft))
    assert ctl.k_for_batch(b) == 0
    times = [ctl.snapshot(b)["step_time_ms"][str(k)] for k in range(9)]
    assert min(times) == times[0], times
    g = ctl.snapshot(b)["predicted_goodput_tokens_per_s"]
    assert all(v <= g["0"] + 0.01 for v in g.values()), g


def test_unmeasured_positions_are_no_data_not_the_prior():
    # a restart: nothing measured yet, the policy runs on its prior, the state says "no data"
    ctl = adaptive()
    snap = ctl.snapshot()
    assert snap["acceptance_per_position"] == [None] * 8
    assert snap["conditional_acceptance"] == [None] * 8
    assert snap["draft_reach_per_position"] == [None] * 8
    assert snap["acceptance_measured_request_steps"] == [0] * 8
    assert snap["step_time_measured_batch"] is None


def test_estimate_converges_fast_after_a_restart_and_deeper_positions_stay_no_data():
    # real traffic at K = 2 with a per-token acceptance of 0.2 (r_1 = 0.2, r_2 = 0.04)
    ctl = SpeculationController(8, SpeculationConfig(mode="fixed", k=2))
    rng = random.Random(3)
    batch = 4
    for step in range(12):  # 48 request-steps, half the estimator's memory
        hist = [0] * 8
        for _ in range(batch):
            n = 0
            while n < 2 and rng.random() < 0.2:
                n += 1
            for i in range(n):
                hist[i] += 1
        ctl.observe(StepObservation(batch, 2, 2 * batch, sum(hist), hist, 0.03, True, float(step)))
    snap = ctl.snapshot()
    acc = snap["acceptance_per_position"]
    assert acc[0] is not None and abs(acc[0] - 0.2) < 0.12, acc  # the 0.5 prior is gone within a few steps
    assert acc[1] is not None and acc[1] < 0.15, acc
    assert acc[2:] == [None] * 6
    assert snap["acceptance_measured_request_steps"][:3] == [48, 48, 0]
    # the control law still has a full curve (E(K) from its prior beyond position 2)
    assert set(snap["expected_tokens_per_step"]) == {str(k) for k in range(9)}


def test_snapshot_tabulates_step_time_over_batch_sizes_for_the_planner():
    sim = Sim(adaptive(), seed=4)
    sim.run(300, batch=4, accept=0.7, t0=0.02, t1=0.001)
    snap = sim.ctl.snapshot()
    table = snap["step_time_ms_by_batch"]
    assert list(table) == [str(b) for b in SpeculationController.PLANNER_BATCH_GRID]
    assert all(len(row) == 9 for row in table.values())
    t_k0 = [row[0] for row in table.values()]
    assert t_k0 == sorted(t_k0)  # larger batches take longer steps
    assert table["4"][0] == pytest.approx(20 + 1 * 4, rel=0.15)  # t0 + t1 * B at K = 0, in ms
    assert snap["step_time_measured_batch"] == [4, 7]


def test_warmup_steps_teach_step_time_but_not_acceptance():
    # the start-up warm-up runs synthetic prompts at every depth: after a restart the
    # acceptance shown (and used) must come from served traffic, not from those prompts
    ctl = adaptive()
    for step in range(50):
        hist = [4, 4, 4, 4, 4, 4, 4, 4]  # warm-up prompts: everything accepted
        ctl.observe(StepObservation(4, 8, 32, 32, hist, 0.05, True, float(step), warmup=True))
    snap = ctl.snapshot()
    assert snap["acceptance_per_position"] == [None] * 8 and snap["acceptance_rate"] is None
    assert snap["step_time_measured_batch"] == [4, 7]  # T(B, K) did learn
    ctl.observe(StepObservation(4, 2, 8, 0, [0] * 8, 0.03, True, 51.0))
    assert ctl.snapshot()["acceptance_per_position"][:3] == [pytest.approx(0.0, abs=0.1)] * 2 + [None]


def _chat_step(
    ctl: SpeculationController, kd: int, t: float, drafted: int = 0, fetch: float = 0.0, warmup: bool = False
) -> None:
    """One batch-1 step verifying ``drafted`` tokens of depth ``kd`` (none accepted) that took
    ``t`` seconds in the step clock, after a draft fetch of ``fetch`` seconds (``warmup``:
    the step time is learned, the acceptance is not)."""
    hist, dh = [0] * ctl.k_engine, [1 if i < drafted else 0 for i in range(ctl.k_engine)]
    obs = StepObservation(1, kd, drafted, 0, hist, t, True, 0.0, draft_hist=dh, k_proposed=kd, warmup=warmup)
    obs.draft_fetch_s = fetch  # set after construction: a model that ignores it must still run
    ctl.observe(obs)


def test_draft_fetch_outside_the_step_is_priced_at_every_k_above_0():
    # the CPU at batch 1 on chat (docs/benchmarks.md): a step takes 24 ms at K = 0; at K > 0
    # the step clock reads 24.6 ms without a draft and the engine core's draft fetch before
    # the step adds 1.8 ms: every K > 0 costs 10 % more than K = 0 at equal verified tokens
    ctl = SpeculationController(8, SpeculationConfig(mode="off"))
    for _ in range(200):
        _chat_step(ctl, 8, 0.0246, fetch=0.0018)
    for i in range(600):  # then K = 0, with short explorations at K = 1 as the policy makes
        if i % 150 < 17:
            _chat_step(ctl, 1, 0.0246, fetch=0.0018)
        else:
            _chat_step(ctl, 0, 0.024)
    tm = ctl.step_time
    t0, t8 = tm.predict(1, 0, 0.0), tm.predict(1, 8, 0.0)
    assert t8 / t0 == pytest.approx(1.10, abs=0.025), (t0, t8)
    assert t0 == pytest.approx(0.024, rel=0.03)
    snap = ctl.snapshot(1)["step_time_model"]
    assert snap["ts_ms_per_speculative_step"] == pytest.approx(2.4, abs=0.6)
    assert snap["td_ms_per_draft_pass"] == 0.0


def test_a_long_spell_at_k0_keeps_the_cost_of_deep_k_at_batch_1():
    # steps at K > 0 cost 10 % more than at K = 0 with the same tokens verified (2.4 ms of
    # 24), and each drafted token 1.3 ms; one step in ten finds an n-gram draft. After 600
    # steps at K = 0 (K = 8's correction is stale), K = 8 must still be priced 10 % dearer
    m = StepTimeModel()
    for i in range(200):
        d = 8 if i % 10 == 0 else 0
        m.observe(1, 1 + d, 0.0264 + 0.0013 * d, 8)
    for i in range(600):
        if i % 150 < 17:
            d = 1 if i % 10 == 0 else 0
            m.observe(1, 1 + d, 0.0264 + 0.0013 * d, 1)
        else:
            m.observe(1, 1, 0.024, 0)
    assert m.predict(1, 8, 0.0) / m.predict(1, 0, 0.0) == pytest.approx(1.10, abs=0.025)
    assert m.predict(1, 8, 0.8) == pytest.approx(0.0264 + 0.0013 * 0.8, rel=0.03)


def test_near_zero_acceptance_chooses_k0_when_deep_k_costs_ten_percent_at_batch_1():
    # the chat trap at 1 client: the step times of the test above (the 2.4 ms partly in the
    # draft fetch outside the step clock), and an acceptance so low that E(8) = 1.08 (one
    # request-step in ten drafts, one in 25 has its first token accepted, half of those the
    # next; the deeper positions that docs measured at 0.9 are back at the prior, as too few
    # chat drafts reach them). K = 8 then yields
    # about 1.08 / 1.14 of K = 0's goodput: the policy must choose K = 0, from K = 2 (its
    # start) as from K = 8 (where docs left it).
    for start in (8, 2):
        ctl = adaptive()
        for i in range(200):
            d = 8 if i % 10 == 0 else 0
            _chat_step(ctl, 8, 0.0252 + 0.0013 * d, drafted=d, fetch=0.0012, warmup=True)
        for i in range(600):
            if i % 150 < 17:
                d = 1 if i % 10 == 0 else 0
                _chat_step(ctl, 1, 0.0252 + 0.0013 * d, drafted=d, fetch=0.0012, warmup=True)
            else:
                _chat_step(ctl, 0, 0.024, warmup=True)
        # docs left whole drafts accepted, then chat (batches of 100: the detector stays out of it)
        for _ in range(10):
            ctl.acceptance.observe(8, 100, [90] * 8, [100] * 8)
        for _ in range(20):
            ctl.acceptance.observe(8, 100, [4, 2, 1, 0, 0, 0, 0, 0], [10] * 8)
        assert ctl.acceptance.expected_tokens(8) == pytest.approx(1.08, abs=0.002)
        ctl.policy.current = start
        ks = [ctl.k_for_batch(1) for _ in range(30)]
        assert ks[0] == 0 and mode_of(ks) == 0, (start, ks)
        g = ctl.snapshot(1)["predicted_goodput_tokens_per_s"]
        assert g["8"] < 0.97 * g["0"], g


def test_a_new_depth_where_no_request_got_that_far_is_not_read_as_never_accepted():
    # copy traffic at 4 clients: positions 1..3 accepted about half the time at K = 3, then a
    # short exploration at K = 4 in which no request gets past position 1 (seen on the engine:
    # position 4's conditional acceptance was set to 0 and every depth beyond 3 was priced
    # at nothing for the rest of the traffic)
    est = AcceptanceEstimator(8, alpha=0.01)
    for i in range(200):
        n = 2 if i % 2 else 0
        est.observe(3, 4, [n, n, n, 0, 0, 0, 0, 0], [4, 4, 4, 0, 0, 0, 0, 0])
    before = est.conditional()[3]
    est.observe(4, 2, [2, 0, 0, 0, 0, 0, 0, 0], [2, 2, 2, 2, 0, 0, 0, 0])
    est.observe(4, 2, [0] * 8, [0] * 8)
    est.observe(4, 4, [0] * 8, [0] * 8)
    assert est.conditional()[3] == pytest.approx(before)
    assert est.r()[3] > 0.1
    # once requests do reach position 4 with 1..3 accepted, their outcome sets it
    for _ in range(40):
        est.observe(4, 4, [3, 3, 3, 1, 0, 0, 0, 0], [4, 4, 4, 4, 0, 0, 0, 0])
    assert est.conditional()[3] == pytest.approx(1 / 3, abs=0.05)


def _bursty(est, rnd, stretches=60):
    """Code-like n-gram acceptance at batch 1, K = 4: quiet stretches of 20-70 steps with
    nothing accepted, then 5-15 steps where it repeats its prompt (position 1 accepted at 0.8;
    mean about 0.14). Returns r_1 after each step."""
    out = []
    for _ in range(stretches):
        for _ in range(rnd.randint(20, 70)):
            est.observe(4, 1, [0] * 4)
            out.append(est.r()[0])
        for _ in range(rnd.randint(5, 15)):
            est.observe(4, 1, [1, 1, 0, 0] if rnd.random() < 0.8 else [0] * 4)
            out.append(est.r()[0])
    return out


def test_bursty_acceptance_is_not_taken_for_a_change_of_workload():
    est = AcceptanceEstimator(4, alpha=0.01)
    r1 = _bursty(est, random.Random(5))
    assert est.changes == 0
    assert min(r1[500:]) > 0.05  # the estimate stays near the mean through each quiet stretch
    # without the run-length condition, quiet stretches read as changes and r_1 fell to ~0
    old = AcceptanceEstimator(4, alpha=0.01, detect_run_factor=0.0)
    r1_old = _bursty(old, random.Random(5))
    assert old.changes >= 1 and min(r1_old[500:]) < 0.01
    # after a bursty workload a real drop is followed by the estimates' own memory (1/alpha)
    for _ in range(400):
        est.observe(4, 1, [0] * 4)
    assert est.r()[0] < 0.01


def test_a_speculative_step_timed_as_cheap_as_a_plain_one_is_still_priced_above_it():
    # the GPU at 1 client on chat: the wall time per step moves between regimes of the host
    # (about 2 and 3 ms) for seconds at a time, so steps at K > 0 can be timed as cheap as
    # steps at K = 0; acceptance is 3 % at the first position and deeper positions were never
    # reached (their conditional acceptance is the prior), so E(4) is about 1.05. A step at
    # K > 0 must still be priced at least the prior per-step cost above K = 0, and the policy
    # must leave K = 4 for K = 0
    ctl = adaptive(k_max=4)
    for i in range(400):
        _chat_step(ctl, i % 5, 0.0022, drafted=1 if i % 5 else 0, warmup=True)
    for _ in range(20):
        ctl.acceptance.observe(1, 100, [3] + [0] * 7, [100] + [0] * 7)
    assert 1.03 < ctl.acceptance.expected_tokens(4) < 1.08
    tm = ctl.step_time
    curve = tm.predict_curve(1, [0.0, 1.0, 2.0, 3.0, 4.0])
    assert min(curve[1:]) >= curve[0] * (1.0 + tm.spec_step_cost_ratio) * 0.999, curve
    ctl.policy.current = 4
    ks = [ctl.k_for_batch(1) for _ in range(30)]
    assert mode_of(ks) == 0, ks


def test_solve3_matches_a_direct_solution_and_refuses_singular_systems():
    """``_solve3`` (the step-time fit's 3x3 least-squares system, written out for speed)."""
    from engine_host.controller import _solve3

    a = [[0.0, 2.0, 1.0], [1.0, 1.0, 0.0], [4.0, 0.0, 3.0]]  # needs a row swap
    x = (1.0, -2.0, 0.5)
    b = [sum(a[r][c] * x[c] for c in range(3)) for r in range(3)]
    got = _solve3(a, b)
    assert got is not None
    assert got == pytest.approx(x)
    assert _solve3([[1.0, 2.0, 3.0], [2.0, 4.0, 6.0], [0.0, 1.0, 1.0]], [1.0, 2.0, 3.0]) is None


def test_the_step_time_fit_is_solved_every_step_at_start_up_then_every_few_steps():
    """The 3x3 fit runs in the engine core's thread between steps: after the start-up
    steps it is solved again every ``FIT_EVERY`` steps, and what it gives then is the fit of
    every step so far."""
    m = StepTimeModel()
    rng = random.Random(3)
    seen = []
    for _ in range(m.FIT_EVERY_AFTER + 4 * m.FIT_EVERY):
        b = rng.choice([1, 2, 4, 8])
        k = rng.choice([0, 2, 4])
        m.observe(b, b * (1 + k), 0.002 + 0.0001 * b * (1 + k) + rng.uniform(0, 1e-4), k)
        seen.append(m.coefficients3())
    early = seen[: m.FIT_EVERY_AFTER]
    assert all(a != b for a, b in zip(early, early[1:]))  # refitted at every start-up step
    late = seen[m.FIT_EVERY_AFTER :]
    runs = [1]
    for a, b in zip(late, late[1:]):
        runs[-1:] = [runs[-1] + 1] if a == b else [runs[-1], 1]
    assert max(runs) == m.FIT_EVERY and min(runs[1:-1]) == m.FIT_EVERY  # then once per FIT_EVERY steps
    m.observe(1, 1, 0.0021, 0)
    assert m.coefficients3() == late[-1] != m._fit3()  # a step came in, not refitted yet
    for _ in range(m.FIT_EVERY - 1):
        m.observe(1, 1, 0.0021, 0)
    assert m.coefficients3() == m._fit3()  # a refit is the fit of every step so far


def test_the_proposer_cost_of_an_async_step_is_priced_where_it_is_paid():
    """Under async scheduling a step proposes for the next one: around each change of K one
    step proposes without verifying and the next verifies without proposing. The n-gram
    proposer's cost is paid in the proposing step (times from an H200, docs/gpu.md): a model
    that charged it to the verifying step, and filed both steps under their verified depth,
    priced K = 4 at about plain decoding."""
    m = StepTimeModel()
    times = {(0, 0): 0.00276, (0, 4): 0.00340, (4, 0): 0.00294, (4, 4): 0.00340}
    k_prev = 0
    for i in range(3000):
        k_next = 4 if (i % 32) >= 24 else 0  # long spells at K = 0 with short runs at K = 4
        m.observe(1, 1 + k_prev, times[(k_prev, k_next)], k_prev, k_next)
        k_prev = k_next
    ratio = m.predict(1, 4, 0.1) / m.predict(1, 0, 0.1)
    assert 1.15 < ratio < 1.35, ratio  # measured (4, 4) over (0, 0): 1.23


@pytest.mark.parametrize("mode", ["off", "fixed", "batch_table", "threshold", "heuristic", "adaptive"])
def test_quiet_steps_folded_together_equal_one_observation_each(mode):
    """``observe_quiet`` (the hook hands over steps without drafts a few at a time) leaves the
    controller's state where one ``observe`` per step leaves it (to the snapshot's rounding: the
    acceptance estimates fade once per group, which compounds to the same), for every policy,
    including those that learn from steps (threshold, heuristic) and after steps with drafts."""

    def fed(quiet_together: bool) -> dict:
        table = [(1, 2, 2), (3, 64, 0)] if mode == "batch_table" else None
        ctl = SpeculationController(4, SpeculationConfig(mode=mode, k=2, table=table))
        rng = random.Random(3)
        now = 0.0
        kept: list = []
        for i in range(300):
            now += 0.01
            b = rng.choice([1, 1, 2, 4])
            st = 0.002 + 0.0001 * b + rng.random() * 1e-4
            kp = rng.choice([0, 2, None])
            if i % 7 == 3:  # a step with drafts: what is kept goes first
                if kept:
                    ctl.observe_quiet(kept)
                    kept = []
                acc = rng.randint(0, b)
                ctl.observe(StepObservation(b, 2, 2 * b, acc, [acc, 0, 0, 0], st, True, now, [b, b, 0, 0], 2))
            elif quiet_together:
                kept.append((b, kp, st, i % 5 != 0, now))
                if len(kept) == 8:
                    ctl.observe_quiet(kept)
                    kept = []
            else:
                z = [0] * 4
                ctl.observe(StepObservation(b, 0, 0, 0, z, st, i % 5 != 0, now, z, kp))
        if kept:
            ctl.observe_quiet(kept)
        ks = [ctl.k_for_batch(b) for b in (1, 2, 4, 8)]
        snap = dict(ctl.snapshot(1), ks=ks)
        snap.pop("step_time_ms_by_batch")  # cached by wall clock
        return snap

    assert fed(True) == fed(False)


def test_a_premium_window_must_be_positive():
    with pytest.raises(ValueError, match="premium_window_s"):
        StepTimeModel(premium_window_s=0.0)


def test_the_controller_prices_a_depth_against_plain_steps_near_it_in_time():
    # a burst where every step is slow (1.5x) drafts first, then runs at K = 0: its K = 4
    # steps cost 1.45x the burst's plain steps, which is the depth's price, not 2.2x the
    # plain steps of the fast bursts before it
    ctl = SpeculationController(4, SpeculationConfig(mode="off"))
    now = 0.0

    def step(k: int, t: float) -> None:
        nonlocal now
        now += t
        ctl.observe(StepObservation(8, k, 8 * k, 0, [0] * 4, t, True, now, draft_hist=[8] * k + [0] * (4 - k)))

    for _ in range(3):
        for _ in range(300):
            step(0, 0.003)
        now += 2.0  # idle
    for _ in range(30):
        step(4, 0.003 * 1.5 * 1.45)
    for _ in range(60):
        step(0, 0.003 * 1.5)
    tm = ctl.step_time
    assert tm.cells[(3, 4)][5] == pytest.approx(1.45, abs=0.05)  # the premium of K = 4 at 8-15 requests
    assert tm.predict(8, 4, 4.0) / tm.predict(8, 0, 0.0) == pytest.approx(1.45, abs=0.1)


def _held_at_k0_after_an_exploration(b: int = 48) -> SpeculationController:
    """An adaptive controller whose goodput comparison always answers K = 0 (drafts that do
    not pay), run until its exploration interval has backed off to its longest and an
    exploration has just ended."""
    ctl = SpeculationController(4, SpeculationConfig(mode="adaptive"))
    policy = ctl.policy
    assert isinstance(policy, AdaptivePolicy)
    policy._best = lambda batch_size: 0  # type: ignore[method-assign]
    for _ in range(3000):
        ctl.k_for_batch(b)
    assert policy.interval == policy.p.explore_every * policy.MAX_BACKOFF
    while ctl.k_for_batch(b) == 0:
        pass
    while ctl.k_for_batch(b) > 0:
        pass
    return ctl


def _steps_to_next_exploration(ctl: SpeculationController, batch_size: int, limit: int = 200) -> int | None:
    for i in range(limit):
        if ctl.k_for_batch(batch_size) > 0:
            return i
    return None


def test_after_a_drain_a_burst_of_several_requests_is_explored_within_explore_every():
    # host 27 (docs/gpu.md): bursts of 64 clients of one kind each, the engine drained between
    # them; held at K = 0 the interval had backed off to 320 steps, longer than a burst, so a
    # burst of requests that quote was served without drafts unless an exploration fell in it
    ctl = _held_at_k0_after_an_exploration()
    assert _steps_to_next_exploration(ctl, 48) is None  # without a drain: not within 200 steps

    ctl = _held_at_k0_after_an_exploration()
    ctl.drained()
    n = _steps_to_next_exploration(ctl, 48)
    assert n is not None and n <= ctl.policy.p.explore_every + 1  # type: ignore[attr-defined]
    policy = ctl.policy
    assert isinstance(policy, AdaptivePolicy)
    assert policy.interval == policy.p.explore_every * policy.MAX_BACKOFF  # the backed-off interval is kept


def test_after_a_drain_a_burst_whose_requests_drafts_may_not_pay_keeps_the_backed_off_interval():
    """``SpeculationController.burst_may_pay`` (the scheduler hook's answer from its requests'
    classes): False leaves the next exploration where the backed-off interval put it; it is
    asked once, at the burst's first step with several requests."""
    asked = []

    def never() -> bool:
        asked.append(1)
        return False

    ctl = _held_at_k0_after_an_exploration()
    ctl.burst_may_pay = never
    ctl.drained()
    assert _steps_to_next_exploration(ctl, 48) is None
    assert asked == [1]


def test_after_a_drain_a_lone_request_is_left_to_the_gate():
    # at one request an exploration takes 17 steps at K = 1: a drain between lone requests
    # does not bring one forward; the first step with several requests does
    ctl = _held_at_k0_after_an_exploration()
    ctl.drained()
    assert _steps_to_next_exploration(ctl, 1, limit=150) is None
    n = _steps_to_next_exploration(ctl, 8, limit=150)
    assert n is not None and n <= ctl.policy.p.explore_every + 1  # type: ignore[attr-defined]


def test_policies_without_explorations_ignore_a_drain():
    for mode in ("off", "fixed"):
        ctl = SpeculationController(4, SpeculationConfig(mode=mode, k=2))
        before = [ctl.k_for_batch(8) for _ in range(5)]
        ctl.drained()
        assert [ctl.k_for_batch(8) for _ in range(5)] == before


def _bursts_without_depth_at_64(model: StepTimeModel) -> StepTimeModel:
    """Plain steps at 1, 48 and 64 requests; K = 4 beside them at 1 request (2x a plain
    step) and at 48 (1.3x), never at 64 (host 27's adaptive engine, docs/gpu.md)."""
    now = 0.0
    for _ in range(600):
        for b, t_plain, t_k4 in ((1, 0.004, 0.008), (48, 0.010, 0.013)):
            for _ in range(8):
                now += t_plain
                model.observe(b, b, t_plain, 0, 0, now)
            for _ in range(8):
                now += t_k4
                model.observe(b, 2 * b, t_k4, 4, 4, now)
        for _ in range(8):
            now += 0.011
            model.observe(64, 64, 0.011, 0, 0, now)
    return model


def test_a_depth_never_run_at_a_bucket_borrows_the_premium_of_the_bucket_next_to_it():
    """K = 4 never ran at 64 requests: with ``premium_borrow`` it is priced there at its
    premium at 32-63 requests, not by a line pulled up by its premium at 1 request."""

    def premiums(borrow: bool) -> tuple[float, float]:
        m = _bursts_without_depth_at_64(StepTimeModel(premium_window_s=0.5, premium_first=True, premium_borrow=borrow))
        return tuple(m.predict(b, 4, 1.0) / m.predict(b, 0, 0.0) for b in (64, 48))  # type: ignore[return-value]

    at64, at48 = premiums(True)
    assert at48 == pytest.approx(1.3, abs=0.02)
    assert at64 == pytest.approx(at48, rel=1e-6)  # borrowed from 32-63, not from 1 (2.0x)
    before, _ = premiums(False)
    assert before > 1.45  # the line's price without it (1.57)


def test_a_borrowed_premium_gives_way_to_the_bucket_own():
    """Once K = 4 runs at 64 requests beside plain steps (1.1x there), its own premium
    prices it, not the one borrowed from 32-63 requests (1.3x)."""
    m = _bursts_without_depth_at_64(StepTimeModel(premium_window_s=0.5, premium_first=True, premium_borrow=True))
    now = 1e4
    for _ in range(40):
        for k, t in ((0, 0.011), (4, 0.0121)):
            for _ in range(4):
                now += t
                m.observe(64, 128 if k else 64, t, k, k, now)
    assert m.predict(64, 4, 1.0) / m.predict(64, 0, 0.0) == pytest.approx(1.1, abs=0.03)
    assert SpeculationController(4, SpeculationConfig(mode="adaptive")).step_time.premium_borrow


def test_the_adaptive_policy_says_how_many_steps_remain_before_its_next_exploration():
    """``steps_to_explore``: the steps the scheduler hook may leave the policy unasked before
    :meth:`AdaptivePolicy.k_for_batch` would start an exploration; 0 while one runs; unbounded
    for a policy that does not explore."""
    ctl = SpeculationController(4, SpeculationConfig(mode="adaptive"))
    policy = ctl.policy
    assert ctl.steps_to_explore() == policy.next_explore - policy.steps - 1 > 0
    policy.skip(policy.next_explore - policy.steps - 1)
    assert ctl.steps_to_explore() == 0
    ctl.k_for_batch(8)  # the exploration starts here
    assert policy.explore_left > 0 and ctl.steps_to_explore() == 0
    while policy.explore_left > 0:
        ctl.k_for_batch(8)
    assert ctl.steps_to_explore() > 0  # the next one is an interval away
    fixed = SpeculationController(4, SpeculationConfig(mode="fixed", k=2))
    assert fixed.steps_to_explore() == 1 << 62


def test_an_exploration_left_to_the_gate_ends_at_its_first_step():
    """``end_exploration`` (the scheduler hook left the exploration to the per-request gate):
    the next step is the policy's own choice again, not an exploration, and the next exploration
    is the backed-off interval away; a policy that does not explore ignores it."""
    ctl = SpeculationController(4, SpeculationConfig(mode="adaptive"))
    policy = ctl.policy
    policy.skip(policy.next_explore - policy.steps - 1)
    ctl.k_for_batch(8)  # the exploration is set here, and runs from the next step
    k = ctl.k_for_batch(8)
    assert ctl.exploring() and k != policy.current and policy.explore_left > 0
    ctl.end_exploration()
    assert ctl.k_for_batch(8) == policy.current and not ctl.exploring()
    assert ctl.steps_to_explore() >= policy.p.explore_every - 2  # an interval from the exploration's start
    fixed = SpeculationController(4, SpeculationConfig(mode="fixed", k=2))
    fixed.end_exploration()
    assert fixed.k_for_batch(8) == 2


@pytest.mark.parametrize("mode, calls", [("adaptive", 1), ("threshold", 8)])
def test_quiet_steps_fade_the_acceptance_estimates_once_per_group(mode, calls):
    """For a policy that does not learn from steps, ``observe_quiet`` fades the acceptance
    estimates once for the whole group, by its request-steps all together (the fade compounds);
    a policy that learns from steps (threshold) still sees them step by step."""
    ctl = SpeculationController(4, SpeculationConfig(mode=mode, k=2))
    seen: list[int] = []
    observe = ctl.acceptance.observe
    ctl.acceptance.observe = lambda k, b, *a: (seen.append(b), observe(k, b, *a))  # type: ignore[method-assign]
    ctl.observe_quiet([(b, 0, 0.002, True, 0.01 * i) for i, b in enumerate((1, 2, 3, 4, 5, 6, 7, 8))])
    assert len(seen) == calls and sum(seen) == 36
    assert ctl.total_steps == 8


def test_an_observation_with_a_weight_is_folded_in_as_that_many_alike():
    """``StepTimeModel.observe(..., weight=n)`` (the lean path's steps handed over as their mean)
    leaves the fit, the bucket's correction and the depth's cell where n observations of the
    same step would, at the cost of one."""
    one, many = StepTimeModel(), StepTimeModel()
    for m in (one, many):
        for i in range(40):
            m.observe(1, 1, 0.020 + 0.0001 * (i % 3), k=0)
            m.observe(1, 5, 0.026, k=4)
    for _ in range(30):
        one.observe(1, 1, 0.015, k=0, k_proposed=0)
    many.observe(1, 1, 0.015, k=0, k_proposed=0, weight=30)
    assert many.steps == one.steps
    assert many.coefficients3() == pytest.approx(one.coefficients3(), rel=1e-9)  # the fit's sums: exact
    # the corrections are ratios to a fit that moved between the n observations: close
    assert many.buckets[batch_bucket(1)][0] == pytest.approx(one.buckets[batch_bucket(1)][0], rel=0.05)
    assert many.cells[(batch_bucket(1), 0)][0] == pytest.approx(one.cells[(batch_bucket(1), 0)][0], rel=1e-9)
    assert many.predict(1, 0) == pytest.approx(one.predict(1, 0), rel=0.01)
    assert many.predict(1, 4) == pytest.approx(one.predict(1, 4), rel=0.01)
    before = many.steps
    many.observe(1, 1, 0.015, k=0, weight=0)  # nothing
    assert many.steps == before


def test_lean_steps_handed_over_with_their_time_price_drafting_against_them(monkeypatch):
    """The scheduler hook's lean path hands its steps back as counts (``skip_quiet``) and, with
    ``timed``, their mean time. A model that saw only the full path's steps at K = 0 (slower:
    the policy decides there) priced a step at K > 0 at a few per cent over plain decoding;
    taught by the lean steps too it prices it against the step it replaces."""
    # s: a K = 0 step on the full path, one on the lean path; a step at K = 4 costs 2.70 ms
    # with no draft found and 0.0125 ms more per draft token verified
    # The engine host's controller prices each step at K > 0 against plain steps near it in
    # time (premium_window_s): the steps are 0.4 s apart here, so only a plain step handed over
    # just before one is near it; the controller's monotonic clock is this loop's
    import types

    import engine_host.controller as controller_module

    clock = [1000.0]
    monkeypatch.setattr(controller_module, "time", types.SimpleNamespace(monotonic=lambda: clock[0]))

    def tick() -> float:
        clock[0] += 0.4
        return clock[0]

    plain_full, lean = 0.0025, 0.0022
    ctl = {name: adaptive(k_max=4) for name in ("full only", "with lean")}
    premium_samples = {}
    for name, c in ctl.items():
        for rep in range(6):
            for _ in range(3):
                c.observe(StepObservation(1, 0, 0, 0, [0] * 8, plain_full, True, tick(), k_proposed=0))
            tick()
            c.skip_quiet(30, 30, timed=(30, 1.0, lean) if name == "with lean" else None)
            for i in range(4):
                d = 4 * (i % 2)
                c.observe(StepObservation(1, 4, d, 0, [0] * 8, 0.0027 + 0.0000125 * d, True, clock[0], k_proposed=4))
            if rep == 0:
                premium_samples[name] = c.step_time.cells[(batch_bucket(1), 4)][6]
        # the steps at K > 0 right after the lean ones kept taking premium samples (against them)
        assert c.step_time.cells[(batch_bucket(1), 4)][6] >= premium_samples[name] + 5 * 4
    full_only, with_lean = (c.step_time for c in ctl.values())
    # a step at K = 4 verifying every draft over a plain one (measured: 2.75 / 2.2 - 1 = 0.25)
    cost = {name: c.step_time.predict(1, 4) / c.step_time.predict(1, 0) - 1.0 for name, c in ctl.items()}
    assert with_lean.predict(1, 0) == pytest.approx(lean, rel=0.01)
    assert full_only.predict(1, 0) == pytest.approx(plain_full, rel=0.01)
    assert cost["full only"] < 0.12 < 0.2 < cost["with lean"] < 0.3
    assert ctl["with lean"].total_steps == ctl["full only"].total_steps
    assert full_only.steps == with_lean.steps  # the timed steps count once, not twice
    with pytest.raises(ValueError):
        ctl["with lean"].skip_quiet(3, 3, timed=(4, 1.0, lean))


def _turned_off_after(zero_steps: int) -> SpeculationController:
    """An adaptive controller at 4 requests whose drafts at K = 2 were rejected in
    ``zero_steps`` steps, asked again at 5 requests (a fresh goodput comparison)."""
    ctl = SpeculationController(4, SpeculationConfig(mode="adaptive"))
    assert ctl.k_for_batch(4) > 0  # the prior's acceptance pays at first
    now = 0.0
    for _ in range(zero_steps):
        now += 0.012
        ctl.observe(StepObservation(4, 2, 8, 0, [0] * 4, 0.012, True, now))
    assert ctl.k_for_batch(5) == 0
    return ctl


def test_a_turn_off_on_thin_evidence_is_explored_again_soon():
    # copy traffic on the CPU engine: each request's first drafts (the turn from the prompt
    # into the answer) were rejected, the policy turned off on those few request-steps and
    # held K = 0 for explore_every steps at 4 requests before the exploration that found
    # its drafts accepted
    thin = _turned_off_after(2)  # 8 request-steps: less than one exploration measures
    policy = thin.policy
    assert isinstance(policy, AdaptivePolicy)
    assert thin.acceptance.weight(0) < policy.BURST_REQUEST_STEPS
    n = _steps_to_next_exploration(thin, 5)
    assert n is not None and n <= round(policy.THIN_OFF_EXPLORE * policy.p.explore_every)
    # on ample evidence the interval stands
    ample = _turned_off_after(40)  # 160 request-steps
    assert ample.acceptance.weight(0) >= policy.BURST_REQUEST_STEPS
    n = _steps_to_next_exploration(ample, 5)
    assert n is None or n > round(policy.THIN_OFF_EXPLORE * policy.p.explore_every)
    # a lone request's turn-off waits for a step with several requests (the gate probes it)
    lone = SpeculationController(4, SpeculationConfig(mode="adaptive"))
    lone.k_for_batch(1)
    lone.observe(StepObservation(1, 2, 2, 0, [0] * 4, 0.012, True, 0.012))
    lone.observe(StepObservation(1, 2, 2, 0, [0] * 4, 0.012, True, 0.024))
    assert lone.k_for_batch(2) == 0
    assert _steps_to_next_exploration(lone, 2, limit=20) is None
    n = _steps_to_next_exploration(lone, 4)
    assert n is not None and n <= round(policy.THIN_OFF_EXPLORE * policy.p.explore_every) + 1
