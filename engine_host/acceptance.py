"""Per-position acceptance of drafts, estimated online (the adaptive policy's E(K)).

Pure Python, no vLLM import: :class:`AcceptanceEstimator` is fed by
:class:`engine_host.controller.SpeculationController` once per decode step.
"""

from __future__ import annotations


class AcceptanceEstimator:
    """Online estimates per draft position i = 1..K_max, per decode request-step:

    * ``r_i``: positions 1..i all accepted (requests with no n-gram draft count as 0);
    * ``q_i``: the draft reached position i (the n-gram proposer's draft length is
      often shorter than K, and verifying costs only the tokens really drafted).

    Each is a ratio of exponentially weighted sums whose unit is one decode
    *request-step* (a step with B decode requests weighs B), so the memory is about
    ``1/alpha`` request-steps whatever the batch size: at batch 1 a single request no
    longer dominates the estimate, at batch 32 a workload change is followed within a
    few steps. Time passes for every position at every decode step, at any K (K = 0
    included), so a position that is no longer drafted loses weight; under
    ``fresh_weight`` request-steps of weight it is *stale*. ``r_1`` is measured; deeper,
    ``r_i = r_(i-1) * a_i`` with ``a_i`` the conditional acceptance of position i, measured
    on the requests whose positions 1..i-1 were all accepted (exponentially weighted the
    same way; the last value with at least ``fresh_weight`` request-steps of such evidence,
    ``prior_decay`` before any; once that evidence has faded, one below ``prior_decay`` returns
    toward it with the same memory, and one above it too while position i is drafted (steps
    at K >= i) and still not measured): a workload change seen at shallow depth moves the deep
    estimates at once, and they keep the shape of n-gram drafts (a draft whose first
    tokens are accepted tends to be accepted further). Explorations then measure them.
    (Taking ``r_i`` itself where position i was fresh mixed windows: a short exploration at
    a new depth in which no request got that far read as "never accepted", and every depth
    beyond it was priced at nothing for the rest of the traffic.)

    A change detector shortens the memory at a change of workload: beside the estimate of
    position 1 it keeps a short one (memory about ``1/(detect_factor * alpha)``
    request-steps, from consecutive steps of at most ``detect_max_batch`` decode requests:
    at batch 1, 1/alpha request-steps are 1/alpha steps). When the short estimate carries
    enough weight and stands at least
    ``detect_min_gap`` (absolute) and a factor ``detect_ratio`` away from the long one (a drop
    only down to ``detect_floor``), the
    weights of every position are multiplied by ``forget``, so that the request-steps after
    the change outweigh those before it; the conditional acceptances used for stale positions
    are kept. Without it, a change from a quoting workload (acceptance 0.5) to one that
    accepts nothing keeps the deep estimates high for about ``1/alpha`` request-steps, long
    enough for a short run of requests to be served at a K that only costs.

    n-gram acceptance comes in bursts: code at batch 1 accepts runs of drafts where it
    repeats its prompt and nothing for tens of steps in between, at a steady mean. A drop
    therefore also needs the run of request-steps with nothing accepted at position 1 to be
    longer than ``detect_run_factor`` times the longest such run completed since the last
    change (that reference fades with a memory of ``4/alpha`` request-steps). A workload
    whose drafts are accepted steadily has short runs, so a change after it is seen as soon
    as before; a bursty one is not taken for a change at each of its quiet stretches (each
    such false change forgot every weight, and the estimate fell to the stretch's 0, where
    nothing more is measured at K = 0).

    Args:
        k_max: number of draft positions tracked (the engine's K_max).
        alpha: weight of one decode request-step, 0..1 (memory about 1/alpha request-steps).
        prior_decay: prior conditional acceptance per position, 0..1.
        fresh_weight: weight (request-steps) under which a position is stale.
        detect_factor: the short estimate's alpha is ``min(0.5, detect_factor * alpha)``
            (0 turns the detector off).
        detect_ratio: factor (> 1) between the short and the long estimate of position 1
            that counts as a change.
        detect_min_gap: absolute gap (fraction 0..1) that counts as a change.
        detect_floor: a drop counts only when the short estimate is at most this (fraction
            0..1): a workload that accepts (nearly) nothing.
        detect_max_batch: the detector watches steps of at most this many decode requests
            only (at a larger batch the long memory passes in a few steps anyway, and the
            requests' own ups and downs look like changes).
        forget: factor (0..1) applied to every weight at a change.
        detect_run_factor: a drop needs the current run of request-steps with nothing
            accepted to exceed this many times the longest run completed since the last
            change (>= 0; 0: no such condition).
    """

    def __init__(
        self,
        k_max: int,
        alpha: float = 0.01,
        prior_decay: float = 0.5,
        fresh_weight: float = 4.0,
        detect_factor: float = 5.0,
        detect_ratio: float = 3.0,
        detect_min_gap: float = 0.1,
        detect_floor: float = 0.02,
        detect_max_batch: int = 1,
        forget: float = 0.01,
        detect_run_factor: float = 2.0,
    ):
        self.k_max = k_max
        self.alpha = alpha
        self.fresh_weight = fresh_weight
        self.detect_factor = detect_factor
        self.detect_ratio = detect_ratio
        self.detect_min_gap = detect_min_gap
        self.detect_floor = detect_floor
        self.detect_max_batch = detect_max_batch
        self.forget = forget
        self.short_num = 0.0  # short estimate of position 1: weighted accepted, weight
        self.short_den = 0.0
        self.changes = 0  # workload changes detected
        self.detect_run_factor = detect_run_factor
        self.zero_run = 0  # request-steps in a row (small batches) with nothing accepted at position 1
        self.zero_run_ref = 0.0  # longest such run completed since the last change (fading)
        w0 = 0.5 * alpha  # the prior weighs half a request-step
        self.num = [w0 * prior_decay ** (i + 1) for i in range(k_max)]
        self.drf = [w0] * k_max
        self.den = [w0] * k_max
        self.prior_decay = prior_decay
        self.cond = [prior_decay] * k_max
        # evidence for cond[i] (0-based i >= 1): weighted requests with positions 1..i+1 all
        # accepted (cnum) among those with 1..i accepted (cden), from steps drafted at depth > i
        self.cnum = [0.0] * k_max
        self.cden = [0.0] * k_max
        self.observed_request_steps = [0] * k_max

    def _scale_weights(self, factor: float) -> None:
        """Multiply every position's weights (accepted, drafted, observed) by ``factor``."""
        for arr in (self.num, self.drf, self.den, self.cnum, self.cden):
            for i in range(self.k_max):
                arr[i] *= factor

    def _fade(self, request_steps: int) -> float:
        """Fade every weight by ``request_steps`` decode request-steps; returns the weight
        (0..1) that ``request_steps`` new request-steps carry."""
        f = (1.0 - self.alpha) ** request_steps
        self._scale_weights(f)
        for i in range(self.k_max):
            if 0.0 < self.den[i] < 1e-150:  # long spells at K=0: keep the ratios defined
                self.num[i] *= 1e100
                self.drf[i] *= 1e100
                self.den[i] *= 1e100
            if 0.0 < self.cden[i] < 1e-150:
                self.cnum[i] *= 1e100
                self.cden[i] *= 1e100
        return 1.0 - f

    def observe(
        self, k_drafted: int, batch_size: int, accepted_hist: list[int], draft_hist: list[int] | None = None
    ) -> None:
        """Fold in one decode step.

        Args:
            k_drafted: depth K (tokens) the verified drafts were proposed at; 0 means no
                speculation in this step (time passes, nothing is measured).
            batch_size: decode requests in the step.
            accepted_hist: ``accepted_hist[i]`` = requests with >= i+1 accepted tokens.
            draft_hist: ``draft_hist[i]`` = requests whose draft had >= i+1 tokens
                (None: every request drafted ``k_drafted`` tokens).
        """
        if batch_size <= 0:
            return
        g = self._fade(batch_size)
        # a conditional acceptance that is no longer measured returns toward the prior with
        # the estimates' memory. One below the prior, measured in another workload (e.g. 0 in
        # chat, where a draft's first token is accepted now and then and its second never),
        # would otherwise keep every later workload at the depth it was measured at, since
        # the controller never drafts deep enough to measure it again. One above the prior
        # returns only while its position is drafted and still not measured: when the
        # controller does not draft that deep it keeps the shape of the drafts measured before
        # (class doc), but when it does and hardly any request gets that far (copy traffic,
        # then open-ended chat whose first token is accepted now and then), a depth measured
        # in the old workload would price every deep draft of the new one as accepted.
        need = min(self.fresh_weight * self.alpha, 0.5)
        for i in range(1, self.k_max):
            if self.cden[i] < need and (self.cond[i] < self.prior_decay or i < k_drafted):
                self.cond[i] += g * (self.prior_decay - self.cond[i])
        if k_drafted <= 0:
            return
        depth = min(k_drafted, self.k_max)
        for i in range(depth):
            acc = accepted_hist[i] if i < len(accepted_hist) else 0
            drf = draft_hist[i] if draft_hist is not None and i < len(draft_hist) else batch_size
            self.num[i] += g * acc / batch_size
            self.drf[i] += g * drf / batch_size
            self.den[i] += g
            self.observed_request_steps[i] += batch_size
            given = (accepted_hist[i - 1] if i - 1 < len(accepted_hist) else 0) if i > 0 else 0
            if given > 0:  # requests that could have had position i+1 accepted
                self.cnum[i] += g * min(acc, given) / batch_size
                self.cden[i] += g * given / batch_size
        # remember the conditional acceptance measured now: position 1 from its estimate,
        # deeper ones from requests that reached them with every earlier position accepted
        # (a ratio r_i / r_(i-1) of the two estimates, as before, read a few request-steps
        # at a new depth in which no request got that far as "position i is never
        # accepted", and the depths beyond it were extrapolated to nothing from then on)
        if self.fresh(0):
            self.cond[0] = min(self.num[0] / self.den[0], 1.0)
        for i in range(1, depth):
            if self.cden[i] >= need:
                self.cond[i] = min(self.cnum[i] / self.cden[i], 1.0)
        self._detect_change(accepted_hist[0] / batch_size if accepted_hist else 0.0, batch_size)

    def _detect_change(self, accepted_1: float, batch_size: int) -> None:
        """Fold position 1's acceptance of one step (fraction 0..1 of its ``batch_size``
        decode requests) into the short estimate; at a change, forget (class doc)."""
        a_s = min(0.5, self.detect_factor * self.alpha)
        if a_s <= 0.0:
            return
        if batch_size > self.detect_max_batch:  # detect from consecutive small batches only
            self.short_num = self.short_den = 0.0
            self.zero_run = 0
            return
        self.zero_run_ref *= (1.0 - self.alpha / 4.0) ** batch_size
        if accepted_1 > 0.0:
            self.zero_run_ref = max(self.zero_run_ref, float(self.zero_run))
            self.zero_run = 0
        else:
            self.zero_run += batch_size
        f = (1.0 - a_s) ** batch_size
        self.short_num = self.short_num * f + (1.0 - f) * accepted_1
        self.short_den = self.short_den * f + (1.0 - f)
        if self.short_den < 0.6 or self.den[0] <= 0.0:
            return
        short, long = self.short_num / self.short_den, self.num[0] / self.den[0]
        lo, hi = min(short, long), max(short, long)
        # a drop counts only down to (nearly) nothing accepted: at a batch of several requests
        # the short estimate dips whenever they are all past the text they copy at once
        if short < long and short > self.detect_floor:
            return
        if short < long and self.zero_run <= self.detect_run_factor * self.zero_run_ref:
            return  # no longer quiet than the workload's own quiet stretches (class doc)
        if hi - lo >= self.detect_min_gap and hi >= self.detect_ratio * lo:
            self._scale_weights(self.forget)
            self.short_num = self.short_den = 0.0
            self.zero_run = 0
            self.zero_run_ref = 0.0
            self.changes += 1

    def weight(self, i: int) -> float:
        """Evidence behind position ``i`` (0-based): its measured weight in decode
        request-steps (the prior's half request-step included; at most about ``1/alpha``)."""
        return self.den[i] / self.alpha if self.alpha > 0 else 0.0

    def fresh(self, i: int) -> bool:
        """True when position ``i`` (0-based) carries at least ``fresh_weight`` request-steps."""
        return self.observed_request_steps[i] > 0 and self.den[i] >= min(self.fresh_weight * self.alpha, 0.5)

    def _deepest_fresh(self) -> int:
        return max((i for i in range(self.k_max) if self.fresh(i)), default=-1)

    def r(self) -> list[float]:
        """``r_i`` for i = 1..K_max (fractions 0..1, non-increasing): ``r_1`` measured,
        ``r_i = r_(i-1) * a_i`` beyond (class doc)."""
        out, prev = [], 1.0
        for i in range(self.k_max):
            if i == 0:
                v = self.num[0] / self.den[0] if self.den[0] > 0 else self.cond[0]
            else:
                v = prev * self.cond[i]
            v = min(prev, v, 1.0)
            out.append(v)
            prev = v
        return out

    def q(self) -> list[float]:
        """``q_i``: chance that a decode request's draft reaches position i (0..1);
        a stale position is taken as reached whenever the one before is (cost errs high)."""
        deepest = max(self._deepest_fresh(), 0)
        out, prev = [], 1.0
        for i in range(self.k_max):
            v = (self.drf[i] / self.den[i] if self.den[i] > 0 else 1.0) if i <= deepest else prev
            v = min(prev, v, 1.0)
            out.append(v)
            prev = v
        return out

    def conditional(self) -> list[float]:
        """Conditional acceptance ``a_j = r_j / r_{j-1}`` per position (fractions 0..1)."""
        r, out, prev = self.r(), [], 1.0
        for v in r:
            out.append(v / prev if prev > 1e-9 else 0.0)
            prev = v
        return out

    def expected_tokens(self, k: int) -> float:
        """``E(K) = 1 + sum_{i<=K} r_i``: tokens per request per verification step."""
        return 1.0 + sum(self.r()[: max(0, min(k, self.k_max))])

    def expected_draft(self, k: int) -> float:
        """``D(K) = sum_{i<=K} q_i``: draft tokens per request at depth K."""
        return sum(self.q()[: max(0, min(k, self.k_max))])
