"""Tokens per step measured at each draft length K served, blended into the priced E(K).

The adaptive policy prices a depth K by ``E(K) = 1 + sum_{i<=K} r_i`` read from per-position
acceptance (:class:`~engine_host.acceptance.AcceptanceEstimator`). n-gram drafts are accepted in
runs, so acceptance measured at the depth the engine runs at does not carry over to another:
at K = 8 a copied run is used up in fewer steps than at K = 4, a smaller share of K = 8's steps
fall inside runs, and positions 1..4 measured at K = 8 price K = 4 below what K = 4 itself
yields (docs/engine_host.md, "Acceptance by run state").

This module measures what each depth K yielded when it was served: decode tokens per
request-step (``1 + accepted / B`` of each step verified at K, weighted by its B requests) and
draft tokens per request-step, as exponentially weighted sums that fade with every decode
request-step at any depth (memory about ``1 / alpha`` request-steps). :meth:`DepthTokens.blend`
then moves the model's E(K) and D(K) toward the measured values by the evidence behind them:
``E'(K) = (w_K * E_meas(K) + w_0 * E(K)) / (w_K + w_0)``, ``w_0`` request-steps of prior
weight. A depth served all the time is priced by what it yielded; one only explored now and
then, by both; one never served, by the model. The adaptive policy's explorations of the
neighbouring depths (K* - 1 and K* + 1) then measure them, so that the choice can move one depth
at a time toward the depth that serves most (a hill climb on measured tokens per step, with the
step times of :class:`~engine_host.controller.StepTimeModel`).

Off by default (``SPECPILOT_DEPTH_TOKENS=1`` turns it on, engine_host/envs.py): a trial for
side-by-side benchmarks.
"""

from __future__ import annotations

from typing import Any


class DepthTokens:
    """Decode tokens and draft tokens per request-step measured at each depth K served.

    Args:
        k_max: the engine's K_max (tokens); depths 1..k_max are tracked.
        alpha: fade per decode request-step (fraction 0..1); memory about ``1/alpha``
            request-steps.
        prior_weight: ``w_0``, the model's weight in :meth:`blend` (request-steps).

    Raises:
        ValueError: ``k_max`` below 1, ``alpha`` outside (0, 1) or a negative ``prior_weight``.
    """

    def __init__(self, k_max: int, alpha: float = 0.0025, prior_weight: float = 16.0):
        if k_max < 1:
            raise ValueError(f"k_max must be at least 1, got {k_max}")
        if not 0.0 < alpha < 1.0:
            raise ValueError(f"alpha must be in (0, 1), got {alpha}")
        if prior_weight < 0.0:
            raise ValueError(f"prior_weight must be >= 0, got {prior_weight}")
        self.k_max = k_max
        self.alpha = alpha
        self.prior_weight = prior_weight
        self.clock = 0  # decode request-steps seen, at every depth
        n = k_max + 1
        self._tok = [0.0] * n  # weighted decode tokens (per request-step units)
        self._drf = [0.0] * n  # weighted draft tokens
        self._w = [0.0] * n  # weight, request-steps
        self._at = [0] * n  # clock of the last fade of each depth

    def _faded(self, k: int) -> float:
        """The fade factor of depth ``k``'s sums since their last update."""
        return (1.0 - self.alpha) ** (self.clock - self._at[k])

    def tick(self, request_steps: int) -> None:
        """Time passes by ``request_steps`` decode request-steps (any depth, K = 0 included)."""
        if request_steps > 0:
            self.clock += request_steps

    def observe(self, k: int, batch_size: int, accepted: int, drafted: int) -> None:
        """Fold in one decode step verified at depth ``k`` (call :meth:`tick` for its
        request-steps as well, as for every step).

        Args:
            k: the depth its drafts were proposed at (tokens); 0 or less is ignored.
            batch_size: decode requests in the step.
            accepted: draft tokens accepted in the step, all requests together.
            drafted: draft tokens verified in the step, all requests together.
        """
        if k <= 0 or batch_size <= 0:
            return
        k = min(k, self.k_max)
        f = self._faded(k)
        self._tok[k] = self._tok[k] * f + batch_size + max(accepted, 0)
        self._drf[k] = self._drf[k] * f + max(drafted, 0)
        self._w[k] = self._w[k] * f + batch_size
        self._at[k] = self.clock

    def forget(self, factor: float) -> None:
        """Scale every depth's evidence by ``factor`` (0..1; a detected change of workload)."""
        for k in range(self.k_max + 1):
            self._tok[k] *= factor
            self._drf[k] *= factor
            self._w[k] *= factor

    def weight(self, k: int) -> float:
        """Evidence behind depth ``k`` now (request-steps, faded)."""
        if not 0 < k <= self.k_max:
            return 0.0
        return self._w[k] * self._faded(k)

    def measured(self, k: int) -> tuple[float, float] | None:
        """``(E, D)`` measured at depth ``k``: decode tokens and draft tokens per request-step
        (tokens), or None where nothing was measured."""
        if not 0 < k <= self.k_max or self._w[k] <= 0.0:
            return None
        return self._tok[k] / self._w[k], self._drf[k] / self._w[k]

    def blend(self, e: list[float], d: list[float]) -> tuple[list[float], list[float]]:
        """The model's ``E(K)`` and ``D(K)`` (lists over K = 0..k_hi, tokens) moved toward the
        values measured at each depth by their evidence (module doc); new lists."""
        e2, d2 = list(e), list(d)
        w0 = self.prior_weight
        for k in range(1, min(len(e), self.k_max + 1)):
            m = self.measured(k)
            if m is None:
                continue
            w = self.weight(k)
            if w + w0 <= 0.0:
                continue
            e2[k] = (w * m[0] + w0 * e[k]) / (w + w0)
            if k < len(d):
                d2[k] = (w * m[1] + w0 * d[k]) / (w + w0)
        return e2, d2

    def describe(self) -> dict[str, Any]:
        """Per depth measured: E and D (tokens per request-step) and the evidence behind them."""
        out: dict[str, Any] = {}
        for k in range(1, self.k_max + 1):
            m = self.measured(k)
            if m is not None:
                out[str(k)] = {
                    "tokens_per_request_step": round(m[0], 4),
                    "draft_per_request_step": round(m[1], 4),
                    "request_steps": round(self.weight(k), 1),
                }
        return out
