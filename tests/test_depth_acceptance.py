"""Tokens per step measured at each depth served (engine_host/depth_acceptance.py), blended
into the adaptive policy's E(K), on traffic whose drafts are accepted in runs of copied text."""

import random

import pytest

from engine_host.config import SpeculationConfig
from engine_host.controller import SpeculationController, StepObservation
from engine_host.depth_acceptance import DepthTokens
from tests.test_run_acceptance import K_MAX, _CopyingRequest, _serve


def _serve_schedule(schedule: list[tuple[int, int]], seed: int, feeds, batch: int = 4) -> None:
    """Serve the same ``batch`` copying requests through ``schedule`` ((depth, steps) spells
    in turn), each step's observation to every one of ``feeds``."""
    rng = random.Random(seed)
    reqs = [_CopyingRequest(rng, 10.0, 25.0) for _ in range(batch)]

    def fan_out(obs: StepObservation) -> None:
        for feed in feeds:
            feed(obs)

    for i, (k, steps) in enumerate(schedule):
        _serve(k, steps, seed=seed + i, batch=batch, feed=fan_out, reqs=reqs)


def _controller(depth_tokens: bool) -> SpeculationController:
    spec = SpeculationConfig(mode="fixed", k=K_MAX)
    spec.adaptive.ema_alpha = 0.0005  # a long memory: the test compares means, not noise
    return SpeculationController(K_MAX, spec, run_states=False, depth_tokens=depth_tokens)


def test_a_depth_explored_now_and_then_is_priced_by_what_it_served():
    """Served at K = 8 with short explorations at K = 4, the per-position estimates price K = 4
    below what K = 4 serves (positions 1..4 read at K = 8, where runs are used up in fewer
    steps); the tokens measured in the explorations bring E(4) nearer, on average over seeds
    (one seed's few explorations are noisy), and keep E(8) where K = 8 serves."""
    truth = {k: _serve(k, 30_000, seed=0) for k in (4, 8)}
    ratio_measured, ratio_plain = [], []
    for seed in range(1, 7):
        measured, plain = _controller(True), _controller(False)
        # an exploration of 5 steps at K = 4 every 205 steps, as the adaptive policy's
        schedule = [(8, 20_000)] + [(4, 5), (8, 200)] * 60
        _serve_schedule(schedule, seed=seed, feeds=[measured.observe, plain.observe])
        e_measured, _ = measured.curves(K_MAX)
        e_plain, _ = plain.curves(K_MAX)
        ratio_measured.append(e_measured[4] / truth[4])
        ratio_plain.append(e_plain[4] / truth[4])
        assert e_measured[8] == pytest.approx(truth[8], rel=0.03)
        assert e_measured[6] == e_plain[6]  # a depth never served keeps the model's price
    mean_measured = sum(ratio_measured) / len(ratio_measured)
    mean_plain = sum(ratio_plain) / len(ratio_plain)
    assert mean_plain < 0.95  # what the measured tokens correct
    assert mean_measured == pytest.approx(1.0, abs=0.05)
    assert mean_measured > mean_plain + 0.02
    described = measured.snapshot()["tokens_per_step_by_depth_served"]
    assert set(described) == {"4", "8"}
    assert plain.snapshot()["tokens_per_step_by_depth_served"] is None


def test_measured_tokens_fade_back_to_the_model_and_are_forgotten_at_a_change():
    depths = DepthTokens(4, alpha=0.001, prior_weight=16.0)
    e, d = [1.0, 1.2, 1.3, 1.4, 1.5], [0.0, 1.0, 2.0, 3.0, 4.0]
    assert depths.blend(e, d) == (e, d)  # nothing measured: the model's curves
    for _ in range(100):
        depths.tick(4)
        depths.observe(2, 4, accepted=6, drafted=8)  # 2.5 tokens a request-step at K = 2
    e2, d2 = depths.blend(e, d)
    assert e2[2] == pytest.approx(2.5, rel=0.05) and d2[2] == pytest.approx(2.0, rel=0.01)
    assert (e2[1], e2[3]) == (e[1], e[3])
    depths.tick(20_000)  # served elsewhere for a long time: back to the model
    assert depths.blend(e, d)[0][2] == pytest.approx(1.3, abs=0.01)
    depths.observe(2, 4, accepted=6, drafted=8)
    w = depths.weight(2)
    depths.forget(0.01)
    assert depths.weight(2) == pytest.approx(w * 0.01)


@pytest.mark.parametrize(
    "kwargs", [{"k_max": 0}, {"k_max": 4, "alpha": 0.0}, {"k_max": 4, "alpha": 1.0}, {"k_max": 4, "prior_weight": -1}]
)
def test_bad_arguments_are_refused(kwargs):
    with pytest.raises(ValueError):
        DepthTokens(**kwargs)
