"""The step-time model prices a draft model's forward passes (pure logic, synthetic steps)."""

from __future__ import annotations

import random

import pytest

from engine_host.config import SpeculationConfig
from engine_host.controller import SpeculationController, StepObservation, StepTimeModel


def test_draft_pass_cost_is_learned_apart_from_verified_tokens():
    m = StepTimeModel(alpha=0.2, draft_passes=True, draft_cost_ratio=0.1)
    rng = random.Random(1)
    for _ in range(30):
        for b in (1, 2, 4, 8):
            for k in (0, 1, 2, 4, 6):
                x = b * (k + 1)
                m.observe(b, x, 0.010 + 0.001 * x + 0.004 * m.passes(k) + rng.uniform(-1e-4, 1e-4), k)
    t0, t1, td = m.coefficients3()
    assert td == pytest.approx(0.004, rel=0.1)
    assert t1 == pytest.approx(0.001, rel=0.1) and t0 == pytest.approx(0.010, rel=0.1)
    # an unmeasured depth (K=8) is priced with its passes: 7 extra passes of 4 ms
    assert m.predict(1, 8) == pytest.approx(0.010 + 0.001 * 9 + 0.004 * 7, rel=0.1)


def test_without_variation_in_k_the_draft_term_stays_at_its_prior():
    m = StepTimeModel(draft_passes=True, draft_cost_ratio=0.5)
    for _ in range(100):
        m.observe(1, 5, 0.02, 4)
    t0, t1, td = m.coefficients3()
    assert td == pytest.approx(0.5 * (t0 + t1), rel=0.3)
    assert m.predict(1, 4) == pytest.approx(0.02, rel=0.05)  # the measured cell is kept


def test_ngram_model_prices_a_step_at_k_above_0_not_each_draft_pass():
    # n-gram drafts: no draft passes, but a step at K > 0 costs 1 ms more at equal tokens
    # (the engine core's draft fetch); the third term is that, once per step at any K > 0
    m = StepTimeModel()
    rng = random.Random(2)
    for _ in range(40):
        for b in (1, 2, 4):
            for k in (0, 2, 4, 8):
                x = b * (1 + k)
                m.observe(b, x, 0.01 + 0.002 * x + (0.001 if k else 0.0) + rng.uniform(-1e-4, 1e-4), k)
    t0, t1, td = m.coefficients3()
    assert td == pytest.approx(0.001, rel=0.2)
    assert t1 == pytest.approx(0.002, rel=0.05) and t0 == pytest.approx(0.01, rel=0.05)
    # the same at every depth: K = 8 and K = 1 differ by their verified tokens only
    assert m.predict(1, 8, 0.0) == pytest.approx(m.predict(1, 1, 0.0), rel=0.03)
    assert m.predict(1, 1, 0.0) - m.predict(1, 0, 0.0) == pytest.approx(0.001, rel=0.3)


def run(ctl: SpeculationController, steps: int, accept: float, t_pass: float, seed: int = 0) -> list[int]:
    """Batch 1, acceptance ``accept`` per position, step time 10 ms + 1 ms per verified token
    + ``t_pass`` per extra draft pass at the depth the drafter runs at."""
    rng = random.Random(seed)
    k_prev, now, out = 0, 0.0, []
    for _ in range(steps):
        k = ctl.k_for_batch(1)
        n = 0
        while n < k_prev and rng.random() < accept:
            n += 1
        hist = [1 if i < n else 0 for i in range(ctl.k_engine)]
        dt = 0.010 + 0.001 * (1 + k_prev) + t_pass * max(k - 1, 0)
        now += dt
        ctl.observe(StepObservation(1, k_prev, k_prev, n, hist, dt, True, now, k_proposed=k))
        k_prev = k
        out.append(k)
    return out


def test_chosen_k_falls_when_each_draft_token_costs_a_draft_pass():
    spec = SpeculationConfig(mode="adaptive")
    ngram_like = SpeculationController(8, spec, draft_passes=True, draft_cost_ratio=0.05)
    cheap = run(ngram_like, 1500, 0.8, t_pass=0.0)[-500:]
    drafty = SpeculationController(8, spec, draft_passes=True, draft_cost_ratio=0.05)
    costly = run(drafty, 1500, 0.8, t_pass=0.006)[-500:]
    mean = lambda ks: sum(ks) / len(ks)  # noqa: E731
    assert mean(costly) < mean(cheap) - 1.5, (mean(costly), mean(cheap))
    snap, cheap_snap = drafty.snapshot(1), ngram_like.snapshot(1)
    assert snap["step_time_model"]["draft_passes"] is True
    assert snap["step_time_model"]["td_ms_per_draft_pass"] > 1.0  # prior: 0.05 x ~12 ms = 0.6 ms
    # T(1, K) is learned to grow with K several times faster than with free drafts
    slope = lambda s: (s["step_time_ms"]["6"] - s["step_time_ms"]["2"]) / 4  # noqa: E731
    assert slope(snap) > 2.5 * slope(cheap_snap), (slope(snap), slope(cheap_snap))


def test_scheduler_reads_method_draft_and_cost_prior_from_vllm_config():
    from types import SimpleNamespace as NS

    from engine_host.scheduler import _draft_cost, _draft_of

    hf = lambda layers: NS(num_hidden_layers=layers, hidden_size=576)  # noqa: E731
    target = NS(hf_config=hf(30), model="/m/t")
    draft = NS(hf_config=hf(8), model="/m/t-draft-L8")
    vcfg = NS(model_config=target, speculative_config=NS(method="draft_model", draft_model_config=draft, model="/m/x"))
    assert _draft_of(vcfg.speculative_config) == "/m/t-draft-L8"
    assert _draft_cost(vcfg) == (True, pytest.approx(8 / 30))
    ngram = NS(model_config=target, speculative_config=NS(method="ngram", draft_model_config=None, model="ngram"))
    assert _draft_of(ngram.speculative_config) is None and _draft_cost(ngram)[0] is False
    assert _draft_of(None) is None
