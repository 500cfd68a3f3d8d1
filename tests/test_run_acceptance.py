"""Acceptance by run state (engine_host/run_acceptance.py): E(K) at a depth other than the
one measured, on traffic whose drafts are accepted in runs of copied text."""

import random

import pytest

from engine_host.acceptance import AcceptanceEstimator
from engine_host.config import SpeculationConfig
from engine_host.controller import SpeculationController, StepObservation
from engine_host.request_gate import RequestDraftGate
from engine_host.run_acceptance import RunStateAcceptance, extrapolated_r

K_MAX = 8


class _CopyingRequest:
    """A request whose text alternates copied runs (every draft token accepted until the run
    ends; mean ``copy_mean`` tokens) and new text (nothing accepted; mean ``gap_mean`` tokens)."""

    def __init__(self, rng: random.Random, copy_mean: float, gap_mean: float):
        self.rng, self.copy_mean, self.gap_mean = rng, copy_mean, gap_mean
        self.copy, self.gap = 0, self._length(gap_mean)

    def _length(self, mean: float) -> int:
        return 1 + int(self.rng.expovariate(1.0 / mean))

    def step(self, k: int) -> int:
        """One verification step at depth ``k``: the draft tokens accepted."""
        if self.copy > 0:
            accepted = min(k, self.copy)
            self.copy -= accepted
            if self.copy > 0:
                self.copy -= 1  # the step's own token copies on
            if self.copy == 0:
                self.gap = self._length(self.gap_mean)
            return accepted
        self.gap -= 1
        if self.gap <= 0:
            self.copy = self._length(self.copy_mean)
        return 0


def _serve(
    k: int,
    steps: int,
    seed: int,
    batch: int = 4,
    feed=None,
    copy_mean=10.0,
    gap_mean=25.0,
    request_tokens: int | None = None,
    reqs: list[_CopyingRequest] | None = None,
) -> float:
    """Serve ``batch`` copying requests ``steps`` steps at static depth ``k``; returns the
    tokens per request-step; ``feed(observation)`` gets each step's StepObservation. With
    ``request_tokens``, a request that has generated that many tokens ends and a new one (in
    new text, its first draft after no other) takes its place. ``reqs``: serve these requests
    (``batch`` of them, carried on from an earlier call) instead of new ones."""
    rng = random.Random(seed)
    if reqs is None:
        reqs = [_CopyingRequest(rng, copy_mean, gap_mean) for _ in range(batch)]
    made = [0] * batch
    full = [False] * batch
    tokens = 0
    for _ in range(steps):
        hist, fhist, n_full = [0] * K_MAX, [0] * K_MAX, 0
        for j, req in enumerate(reqs):
            a = req.step(k)
            tokens += a + 1
            for i in range(min(a, K_MAX)):
                hist[i] += 1
            if full[j]:
                n_full += 1
                for i in range(min(a, K_MAX)):
                    fhist[i] += 1
            full[j] = a == k
            made[j] += a + 1
            if request_tokens is not None and made[j] >= request_tokens:
                reqs[j], made[j], full[j] = _CopyingRequest(rng, copy_mean, gap_mean), 0, False
        if feed is not None:
            drafted = [batch if i < k else 0 for i in range(K_MAX)]
            feed(
                StepObservation(
                    batch_size=batch,
                    k_drafted=k,
                    num_draft_tokens=batch * k,
                    num_accepted_tokens=sum(hist[:k]),
                    accepted_hist=hist,
                    draft_hist=drafted,
                    step_time_s=0.02,
                    pure_decode=True,
                    full_batch=n_full,
                    full_accepted_hist=fhist,
                    full_draft_hist=[n_full if i < k else 0 for i in range(K_MAX)],
                )
            )
    return tokens / (steps * batch)


def _controller(run_states: bool) -> SpeculationController:
    spec = SpeculationConfig(mode="fixed", k=K_MAX)
    spec.adaptive.ema_alpha = 0.0005  # a long memory: the test compares means, not noise
    return SpeculationController(K_MAX, spec, run_states=run_states)


def test_run_states_price_a_shallower_depth_from_drafts_measured_deeper():
    """Measured at K = 8 on copied runs, the per-position estimate over all requests prices
    K = 4 far below what static K = 4 serves (K = 8 uses runs up in fewer steps, so fewer of
    its steps fall inside one), which made the adaptive policy keep K = 8 where K = 4 served
    more; the run states' stationary E(K) comes within a few percent at K = 2, 4 and 8."""
    truth = {k: _serve(k, 30_000, seed=0) for k in (2, 4, 8)}
    states, plain = _controller(True), _controller(False)
    for ctl in (states, plain):
        _serve(8, 30_000, seed=1, feed=ctl.observe)
    e_states, _ = states.curves(K_MAX)
    e_plain, _ = plain.curves(K_MAX)
    assert states.run_states is not None and states.run_states.ready()
    for k in (2, 4, 8):
        assert e_states[k] == pytest.approx(truth[k], rel=0.03)
    assert e_plain[4] < truth[4] * 0.93  # what the run states replace
    true_ratio = truth[8] / truth[4]
    assert e_states[8] / e_states[4] == pytest.approx(true_ratio, abs=0.02)
    assert e_plain[8] / e_plain[4] > true_ratio + 0.05


def test_the_chain_is_anchored_to_the_share_measured_when_requests_end(monkeypatch):
    """Requests of 64 tokens start in new text, so fewer of their steps follow a whole draft
    than the chain's stationary share says, and the chain alone prices every depth 8-12 %
    high; anchored to the share measured at the depth in force it comes within a few percent
    at K = 2, 4 and 8 (measured at K = 8), and the share at the depth measured is the one
    measured."""
    kw = {"copy_mean": 20.0, "gap_mean": 10.0, "request_tokens": 64}
    truth = {k: _serve(k, 30_000, seed=0, **kw) for k in (2, 4, 8)}
    anchored = _controller(True)
    _serve(8, 30_000, seed=1, feed=anchored.observe, **kw)
    e, _ = anchored.curves(K_MAX)
    for k in (2, 4, 8):
        assert e[k] == pytest.approx(truth[k], rel=0.03)
    states = anchored.run_states
    assert states is not None
    assert states.full_share(8) == pytest.approx(states.measured_share(8), abs=1e-6)
    assert states.measured_share(4) is None  # never served at K = 4
    monkeypatch.setattr(RunStateAcceptance, "_anchor", lambda self, ra, rb: 0.0)
    chain = _controller(True)
    _serve(8, 30_000, seed=1, feed=chain.observe, **kw)
    e_chain, _ = chain.curves(K_MAX)
    assert e_chain[4] > truth[4] * 1.06  # what the anchor corrects


def test_run_states_extrapolate_a_deeper_depth_by_the_deepest_conditional():
    """Measured at K = 4, the deeper depths are priced by the conditional acceptance measured
    at position 4 within each state: E(8) / E(4) within a few percent of static K = 8's over
    static K = 4's (a prior of 0.5 per position would take every run as ending at position 5)."""
    truth = {k: _serve(k, 30_000, seed=0) for k in (4, 8)}
    ctl = _controller(True)
    _serve(4, 30_000, seed=1, feed=ctl.observe)
    e, d = ctl.curves(K_MAX)
    assert e[8] / e[4] == pytest.approx(truth[8] / truth[4], abs=0.03)
    assert d[4] == pytest.approx(4.0) and d[8] == pytest.approx(8.0, rel=0.01)  # every draft full length
    states = ctl.run_states
    assert states is not None
    r_after = extrapolated_r(states.after_full)
    cond_4 = r_after[3] / r_after[2]
    assert r_after[7] == pytest.approx(r_after[3] * cond_4**4)
    # the estimator alone would take positions 5..8 at its prior
    assert states.after_full.r()[7] < r_after[7]


def test_a_share_measured_is_the_chains_share_and_evidence_gates_the_curves():
    """Before both states carry MIN_STATE_REQUEST_STEPS at position 1 the aggregate's E(K)
    stands; the stationary share follows p_B / (1 - p_A + p_B); run_states=False is the
    aggregate alone."""
    ctl = _controller(True)
    agg = ctl.curves(K_MAX)
    est = AcceptanceEstimator(K_MAX, alpha=0.0005)
    assert agg[0] == pytest.approx([est.expected_tokens(k) for k in range(K_MAX + 1)])
    rs = RunStateAcceptance(4, alpha=0.05)
    assert not rs.ready() and rs.curves(4) is None
    for _ in range(200):  # after a full draft: 0.9 at every position; otherwise 0.1 at position 1 only
        rs.observe(1, 10, [5, 0, 0, 0], [10, 0, 0, 0], 5, [4, 0, 0, 0], [5, 0, 0, 0])
    assert rs.ready()
    p_a, p_b = 4 / 5, 1 / 5
    assert rs.full_share(1) == pytest.approx(p_b / (1 - p_a + p_b), abs=0.01)
    e, _ = rs.curves(1)
    assert e[1] == pytest.approx(1.0 + 0.5 * p_a + 0.5 * p_b, abs=0.01)  # the measured mix (share 0.5)
    assert _controller(False).run_states is None


def test_the_gate_tells_which_drafts_followed_one_accepted_in_full():
    """observe_many's ``after_full``: per verification, whether the request's previous verified
    draft was accepted in full (a request's first, and a skipped entry, say False)."""
    gate = RequestDraftGate()
    flags: list[bool] = []
    gate.observe_many([("a", 4, 4), ("b", 4, 1), (None, 4, 4), ("c", 0, 0)], flags)
    assert flags == [False, False, False, False]
    flags = []
    gate.observe_many([("a", 4, 2), ("b", 4, 4), ("c", 2, 2)], flags)
    assert flags == [True, False, False]
    flags = []
    gate.observe_many([("a", 4, 4), ("b", 3, 3), ("c", 2, 0)], flags)
    assert flags == [False, True, True]


def test_the_hook_folds_the_run_states_histograms(tmp_path, monkeypatch):
    """The scheduler hook splits a step's verifications by run state: ``_fhist`` / ``_fdhist``
    count those whose request's previous draft was accepted in full, ``_full_n`` their number,
    and the controller's run states learn from them."""
    from bench.hook_cost import standin_hook
    from engine_host import envs

    monkeypatch.setenv(envs.RUN_STATES, "1")
    hook, channel = standin_hook("fixed:4", 2, str(tmp_path), async_scheduling=True)
    try:
        assert hook._run_states
        for rid, d, a in (("a", 4, 4), ("b", 4, 1), ("c", 4, 4)):
            hook.make_spec_decoding_stats(None, d, a, request_id=rid)
        hook._fold_verified()
        assert hook._full_n == 0 and hook._fhist == [0, 0, 0, 0]
        hook._hist = [0] * 4
        hook._dhist = [0] * 4
        for rid, d, a in (("a", 4, 2), ("b", 4, 4), ("c", 3, 3)):
            hook.make_spec_decoding_stats(None, d, a, request_id=rid)
        hook._fold_verified()
        assert hook._full_n == 2  # a and c followed a full draft
        assert hook._fhist == [2, 2, 1, 0]
        assert hook._fdhist == [2, 2, 2, 1]
    finally:
        channel.close()
