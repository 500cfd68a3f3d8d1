"""Acceptance by run state: E(K) that knows a deeper draft uses up a copied run sooner.

n-gram drafts are accepted in runs: while a request copies its prompt (code to continue, a
document to quote) draft after draft is accepted in full, and between such runs hardly any
is. Per-position acceptance ``r_i`` measured at one depth K therefore does not carry over to
another: at K = 8 a run of 12 copied tokens is used up in two steps (8, then 4 of 8), at K = 4
in three (4, 4, 4), so a larger share of K = 4's steps fall inside runs and its measured
``r_1`` is higher. ``E(K) = 1 + sum_{i<=K} r_i`` read from acceptance measured at the depth the
engine runs at then prices every other depth as if its steps fell inside runs as often, and
overrates the deeper one: the adaptive policy chose K = 8 on code and docs at 4 clients where
static K = 4 served more (docs/benchmarks.md).

This module keeps the acceptance apart for the two states a decode request can be in:

* ``after_full``: its last verified draft was accepted in full (it is inside a run);
* ``otherwise``: its last draft had a rejected token, or it has had none.

Each state has its own :class:`~engine_host.controller.AcceptanceEstimator` (``r^A_i``,
``q^A_i`` and ``r^B_i``, ``q^B_i``). A request moves between the states as a two-state Markov
chain whose transition at depth K is "the draft was accepted in full", with chance
``p_A(K) = r^A_K`` from ``after_full`` and ``p_B(K) = r^B_K`` from ``otherwise``. Its stationary
share of ``after_full`` steps is

    pi_A(K) = p_B(K) / (1 - p_A(K) + p_B(K)),

and the tokens a request gains per step at depth K, averaged over the states it visits at that
depth, are

    E(K) = pi_A(K) * E_A(K) + (1 - pi_A(K)) * E_B(K),   E_s(K) = 1 + sum_{i<=K} r^s_i,

(the same for the draft tokens ``D(K)``). The chain is anchored to the share measured: a
request starts outside any run (its first draft follows its prefill) and ends after a few
dozen steps, so the share of ``after_full`` steps measured at the depth in force can sit
well off the chain's stationary share there. The log-odds of the share measured at each
depth with evidence, less the chain's at that depth, averaged by evidence, is added to the
chain's log-odds at every depth,

    logit pi(K) = logit pi_A(K) + sum_k w_k (logit s_k - logit pi_A(k)) / sum_k w_k,

so that at the depth measured ``E(K)`` is what the requests served there gained, and the
chain models only how the share moves with K, as runs are used up faster or slower. The
throughput of a depth is its tokens per step over its step time (renewal-reward), which the
adaptive policy's goodput ``G(K) = B * E(K) / T(B, K)`` already is (arXiv 2211.17192 for
``E(K)`` with independent positions; the two-state chain is the Gilbert-Elliott model of
bursty channels, applied to draft runs).
"""

from __future__ import annotations

import math
from typing import Any

from .acceptance import AcceptanceEstimator

#: Request-steps of evidence at position 1 each state needs before its curve is used (below
#: it, the aggregate estimate's E(K) stands).
MIN_STATE_REQUEST_STEPS = 16.0

#: Request-steps at one depth before the share measured there anchors the chain.
MIN_SHARE_REQUEST_STEPS = 16.0

#: Shares are clipped to [SHARE_CLIP, 1 - SHARE_CLIP] before their log-odds are taken.
SHARE_CLIP = 1e-3


def extrapolated_r(est: AcceptanceEstimator) -> list[float]:
    """``r_i`` of ``est`` for i = 1..K_max (fractions 0..1, non-increasing), with every position
    deeper than its deepest measured one extrapolated by the conditional acceptance measured
    there rather than by the prior: within a run state a draft's acceptance goes on as it went
    at the deepest position measured (a copied run continues with about the same chance token
    after token), and the stationary share at a deeper K (:meth:`RunStateAcceptance.full_share`)
    is ``r_K`` itself, so a prior of 0.5 per position would price every depth past the one
    measured as leaving the run at once. A position counts as measured when its conditional
    acceptance has ``fresh_weight`` request-steps of evidence (requests that reached it with
    every earlier position accepted), not merely when it was drafted: a position drafted in a
    few steps that no request reached keeps the prior's conditional. With only position 1
    measured, or none, the estimator's own ``r`` stands."""
    r = est.r()
    need = min(est.fresh_weight * est.alpha, 0.5)
    deepest = -1
    for i in range(est.k_max):
        if not est.fresh(i) or (i > 0 and est.cden[i] < need):
            break
        deepest = i
    if deepest < 1:
        return r
    a = r[deepest] / r[deepest - 1] if r[deepest - 1] > 1e-9 else 0.0
    for i in range(deepest + 1, est.k_max):
        r[i] = r[i - 1] * a
    return r


def _stationary(p_a: float, p_b: float) -> float:
    """Stationary share (0..1) of the ``after_full`` state of the two-state chain whose draft
    is accepted in full with chance ``p_a`` from it and ``p_b`` from the other (module doc)."""
    den = 1.0 - p_a + p_b
    if den <= 1e-9:  # every draft accepted in full from either state: always inside a run
        return 1.0
    return min(max(p_b / den, 0.0), 1.0)


def _logit(p: float) -> float:
    p = min(max(p, SHARE_CLIP), 1.0 - SHARE_CLIP)
    return math.log(p / (1.0 - p))


def _sigmoid(x: float) -> float:
    return 1.0 / (1.0 + math.exp(-x)) if x >= 0 else math.exp(x) / (1.0 + math.exp(x))


def _cumulative(values: list[float], k_hi: int, past: float) -> list[float]:
    """``[0, v_1, v_1 + v_2, ...]`` up to ``k_hi`` terms (``past`` for positions beyond the list)."""
    out = [0.0]
    for k in range(1, k_hi + 1):
        out.append(out[-1] + (values[k - 1] if k - 1 < len(values) else past))
    return out


class RunStateAcceptance:
    """Per-position acceptance kept apart by run state, and the stationary E(K) (module doc).

    Args:
        k_max: draft positions tracked (the engine's K_max), >= 1.
        alpha: weight of one decode request-step in each state's estimate, 0..1.
        min_request_steps: evidence (request-steps at position 1) each state needs before
            :meth:`curves` answers (>= 0).
    Raises:
        ValueError: ``k_max`` < 1 or ``min_request_steps`` < 0.
    """

    def __init__(self, k_max: int, alpha: float = 0.01, min_request_steps: float = MIN_STATE_REQUEST_STEPS):
        if k_max < 1:
            raise ValueError("k_max must be >= 1")
        if min_request_steps < 0:
            raise ValueError("min_request_steps must be >= 0")
        self.k_max = k_max
        self.min_request_steps = min_request_steps
        # no change detector of their own: the aggregate estimate's forgets both (forget())
        self.after_full = AcceptanceEstimator(k_max, alpha=alpha, detect_factor=0.0)
        self.otherwise = AcceptanceEstimator(k_max, alpha=alpha, detect_factor=0.0)
        # the share of decode request-steps after a whole draft, measured per depth K (index
        # K; weights fade by request-step over all depths, as the estimators' do)
        self._share_num = [0.0] * (k_max + 1)
        self._share_den = [0.0] * (k_max + 1)

    @property
    def alpha(self) -> float:
        return self.after_full.alpha

    @alpha.setter
    def alpha(self, value: float) -> None:
        self.after_full.alpha = self.otherwise.alpha = value

    def observe(
        self,
        k_drafted: int,
        batch_size: int,
        accepted_hist: list[int],
        draft_hist: list[int] | None,
        full_batch: int,
        full_accepted_hist: list[int] | None,
        full_draft_hist: list[int] | None,
    ) -> None:
        """Fold in one decode step.

        Args:
            k_drafted: depth K (tokens) the verified drafts were proposed at; 0: no
                speculation (time passes for both states, nothing is measured).
            batch_size: decode requests in the step.
            accepted_hist, draft_hist: the step's histograms over every decode request, as
                :meth:`AcceptanceEstimator.observe` takes them.
            full_batch: of the decode requests, those whose previous draft was accepted in
                full (``0..batch_size``).
            full_accepted_hist, full_draft_hist: the histograms of those requests alone
                (None: none of them).
        """
        if batch_size <= 0:
            return
        if k_drafted <= 0:
            self.after_full.observe(0, batch_size, accepted_hist, draft_hist)
            self.otherwise.observe(0, batch_size, accepted_hist, draft_hist)
            return
        n_full = min(max(full_batch, 0), batch_size)
        f = (1.0 - self.alpha) ** batch_size
        k = min(k_drafted, self.k_max)
        for j in range(self.k_max + 1):
            self._share_num[j] *= f
            self._share_den[j] *= f
        self._share_num[k] += (1.0 - f) * n_full / batch_size
        self._share_den[k] += 1.0 - f
        n = len(accepted_hist)
        fa = full_accepted_hist or [0] * n
        fd = full_draft_hist or [0] * n
        if n_full:
            self.after_full.observe(k_drafted, n_full, list(fa), list(fd))
        if batch_size > n_full:
            rest_a = [max(accepted_hist[i] - (fa[i] if i < len(fa) else 0), 0) for i in range(n)]
            rest_d = None
            if draft_hist is not None:
                rest_d = [max(draft_hist[i] - (fd[i] if i < len(fd) else 0), 0) for i in range(len(draft_hist))]
            self.otherwise.observe(k_drafted, batch_size - n_full, rest_a, rest_d)

    def forget(self, factor: float) -> None:
        """Scale both states' weights by ``factor`` (0..1): the aggregate estimate detected a
        change of workload (:class:`AcceptanceEstimator`, ``forget``)."""
        self.after_full._scale_weights(factor)
        self.otherwise._scale_weights(factor)
        for j in range(self.k_max + 1):
            self._share_num[j] *= factor
            self._share_den[j] *= factor

    def ready(self) -> bool:
        """Both states carry ``min_request_steps`` request-steps at position 1."""
        return (
            self.after_full.weight(0) >= self.min_request_steps and self.otherwise.weight(0) >= self.min_request_steps
        )

    def measured_share(self, k: int) -> float | None:
        """Share (0..1) of decode request-steps at depth ``k`` (tokens) that followed a draft
        accepted in full, as measured (faded like the estimates); None with fewer than
        ``MIN_SHARE_REQUEST_STEPS`` request-steps at that depth."""
        if not 1 <= k <= self.k_max or self.alpha <= 0:
            return None
        if self._share_den[k] / self.alpha < MIN_SHARE_REQUEST_STEPS:
            return None
        return self._share_num[k] / self._share_den[k]

    def _anchor(self, ra: list[float], rb: list[float]) -> float:
        """Log-odds to add to the chain's share (module doc): the evidence-weighted mean, over
        the depths with a measured share, of its log-odds less the chain's there; 0 with none."""
        num = den = 0.0
        for k in range(1, self.k_max + 1):
            s = self.measured_share(k)
            if s is None:
                continue
            w = self._share_den[k]
            num += w * (_logit(s) - _logit(_stationary(ra[k - 1], rb[k - 1])))
            den += w
        return num / den if den > 0 else 0.0

    def full_share(self, k: int) -> float:
        """``pi(K)``: the share (0..1) of a request's steps at depth ``k`` (tokens, >= 1) that
        follow a draft accepted in full: the chain's stationary share, anchored to the shares
        measured (module doc)."""
        k = max(1, min(k, self.k_max))
        ra, rb = extrapolated_r(self.after_full), extrapolated_r(self.otherwise)
        return self._share(ra, rb, k, self._anchor(ra, rb))

    @staticmethod
    def _share(ra: list[float], rb: list[float], k: int, offset: float) -> float:
        pi = _stationary(ra[k - 1], rb[k - 1])
        return _sigmoid(_logit(pi) + offset) if offset else pi

    def curves(self, k_hi: int) -> tuple[list[float], list[float]] | None:
        """``(E, D)`` for K = 0..``k_hi``: tokens per request per step ``E(K)`` and draft tokens
        per request ``D(K)`` averaged over the stationary shares of the two states (module
        doc); None until :meth:`ready`."""
        if not self.ready():
            return None
        ra, rb = extrapolated_r(self.after_full), extrapolated_r(self.otherwise)
        qa, qb = self.after_full.q(), self.otherwise.q()
        ea, eb = _cumulative(ra, k_hi, 0.0), _cumulative(rb, k_hi, 0.0)
        da, db = _cumulative(qa, k_hi, 1.0), _cumulative(qb, k_hi, 1.0)
        offset = self._anchor(ra, rb)
        e, d = [1.0], [0.0]
        for k in range(1, k_hi + 1):
            pi = self._share(ra, rb, min(k, self.k_max), offset)
            e.append(1.0 + pi * ea[k] + (1.0 - pi) * eb[k])
            d.append(pi * da[k] + (1.0 - pi) * db[k])
        return e, d

    def describe(self, k_hi: int) -> dict[str, Any]:
        """JSON-able: each state's per-position acceptance and evidence, and the stationary
        share of ``after_full`` steps per depth (None where not measured)."""

        def measured(est: AcceptanceEstimator) -> list[float | None]:
            return [round(v, 4) if est.observed_request_steps[i] > 0 else None for i, v in enumerate(est.r())]

        return {
            "ready": self.ready(),
            "after_full_acceptance_per_position": measured(self.after_full),
            "otherwise_acceptance_per_position": measured(self.otherwise),
            "after_full_request_steps": round(self.after_full.weight(0), 1),
            "otherwise_request_steps": round(self.otherwise.weight(0), 1),
            "full_share_by_k": {str(k): round(self.full_share(k), 4) for k in range(1, max(k_hi, 1) + 1)},
            "measured_full_share_by_k": {
                str(k): (None if (m := self.measured_share(k)) is None else round(m, 4))
                for k in range(1, max(k_hi, 1) + 1)
            },
        }
