"""Draft length per request: the goodput law applied to each running request.

vLLM's draft length K is one number per step. Inside one step, though, each request's
drafts can be kept or dropped before verification: a request whose drafts are dropped is
verified without drafts and costs the step no verification work. :class:`RequestDraftGate`
keeps an acceptance estimate per request and decides, each step, which requests' drafts
are worth verifying.

The rule (SmartSpec/TurboSpec goodput, arXiv 2406.14066; expected accepted tokens of a
draft of length K with per-token acceptance ``a``, Leviathan et al., arXiv 2211.17192)::

    x_i(K) = sum_{j=1..K} a_i^j              extra tokens request i gains per step
    c      = (T(B, K) - T(B, 0)) / (K * T(B, 0))
                                             cost of one verified draft token, as a
                                             fraction of one request's plain decode step
    verify i's drafts  iff  x_i(K) >= (1 + margin) * K * c

i.e. request i's drafts are verified only when the tokens they are expected to add per
unit of step time beat what plain decoding yields in that time.

``a_i`` is the maximum-likelihood per-token acceptance under the prefix rule (a draft is
accepted up to its first rejected token, so one verification of a k-token draft with n
accepted is n successes and, when n < k, one failure; the tokens after the first
rejection are never judged): ``a_i = accepted / (accepted + rejections)``, with a Beta
prior of strength ``prior_accepted + prior_rejected`` whose mean is the traffic's own
per-token acceptance (the same estimate pooled over the tokens judged in every request's
recent verifications, ``pool_decay``; ``prior_accepted / (prior_accepted +
prior_rejected)`` before any), so a new request starts where the requests before it
stood: in traffic whose drafts are rejected (chat) a new request is not drafted at the
prior's depth for its first steps, in traffic that quotes (docs) it is drafted from its
first step. Where the engine names a request's class (:meth:`RequestDraftGate.set_class`;
the scheduler hook: ``greedy`` or ``sampled`` from its temperature), the pool is the
class's own: a sampled chat request after greedy requests that quote starts at what
sampled requests were accepted at, not at the quoting requests' rate, and a greedy one
after chat is not held at chat's. Requests without a class share one pool.

With ``prior="mixture"`` (the engine host's default, ``speculation.adaptive.prior``; this
class's own default stays ``"pooled"``) a request's prior is instead the distribution of
per-request acceptance over its class's finished requests, kept on a grid of ``MIXTURE_GRID``
points: the distribution that maximises the likelihood of the class's last
``mixture_requests`` finished requests (the nonparametric maximum-likelihood mixing
distribution, J. Kiefer and J. Wolfowitz, Ann. Math. Statist. 27, 1956), fitted by EM (N. Laird,
"Nonparametric maximum likelihood estimation of a mixing distribution", JASA 73, 1978) every
``MIXTURE_REFIT_EVERY`` finished requests, ``MIXTURE_EM_ITERATIONS`` iterations from the
previous fit. A running request's estimate is its posterior mean under that distribution (the
likelihood of its verifications is ``a^accepted (1 - a)^rejections`` by the prefix rule above).
The pooled prior weighs requests by the tokens they had judged, so greedy requests that quote
set a greedy class's mean and a greedy request that rejects needs many rejected drafts to leave
it; where a class's requests split into ones that accept and ones that reject, the mixture's
posterior moves to the rejecting ones after one or two rejected drafts, and its mean is over
requests, not tokens. The fit weighs the whole window's likelihoods at once: a class of chat
requests that each verify only one to four drafts, nearly all rejected, gives weak evidence
per request, and a recursion that mixes in one request's posterior at a time (Newton's, tried
first) stayed near its starting shape for hundreds of such requests (docs/gpu.md, host 31).
Until a class has ``MIXTURE_MIN_REQUESTS`` finished requests its requests are estimated
under the pooled prior: a distribution over requests needs requests (a class seen for the first
time does not start at another class's, e.g. greedy requests after chat), and under the
starting shape alone (the configured Beta prior's, uniform by default) a request whose every
draft is rejected would stay near 0.08, where its own fading counts (``decay``) leave it.
Accepted / drafted would be the mean accepted *fraction*, ``x_i(k) / k``, not ``a_i``;
used as ``a`` it underestimates x_i(k) (at a = 0.8, k = 8 it gives 0.7 tokens instead
of 3.3) and drops drafts that pay. A request whose drafts were dropped is drafted again
every ``probe_every`` of its steps, so one that starts accepting (e.g. it begins to
quote its prompt) is picked up again. With ``probe_backoff`` above 1 (the engine host's
default, 4; this class's own default stays 1) a probe that finds no draft or whose draft is
mostly rejected doubles the request's wait before the next, up to ``probe_backoff`` times
``probe_every``, and a verification that accepts at least half its draft brings it back; a
request whose class's finished requests' drafts seldom pay (``paying_share`` under
``PROBE_NEW_SHARE``) starts at the longest wait; and where drafts are dropped request by
request (synchronous scheduling) the probes of a step at K > 0 that no request's drafts pay for
take along every other request past half its wait (:meth:`RequestDraftGate.plan_batch`): a
step at K > 0 costs the proposer's run and the draft fetch whatever it verifies, so probes
taken one request at a time made sampled chat at 4 clients run one step in ten at K > 0
(docs/benchmarks.md).

With ``gain="calibrated"`` (the engine host's default, ``speculation.adaptive.gain``; this
class's own default stays ``"geometric"``) a request's ``x_i(K)`` is read against what its
class's drafts yielded. Each verification is counted by the bin of ``ACCEPTANCE_BUCKETS`` its
request's estimate stood in when the draft was priced, with the tokens drafted and accepted;
per bin, a j-token draft's measured gain is how far drafts were accepted, position by position
(the Kaplan-Meier estimate, shorter drafts counted up to their length), and the gain used is
that and the geometric one weighted by the bin's verifications (``_cal_read``), or the
geometric one where that is more. The geometric
law takes every position to be accepted with the same ``a`` given the one before; text copied
from the prompt (code, docs) is accepted a long way or not at all, so a request whose last
draft was rejected at its first token reads as a low ``a`` while its next draft, when the
n-gram proposer finds one, may well be copied to its end, and the class's verifications at
that estimate say how often (docs/benchmarks.md). Where drafts are rejected whatever the
estimate (sampled chat), the geometric gain stands. The measured gain only raises a price:
lowered below a draft's cost, a bin would be drafted no more and its counts would not learn
again, e.g. that the requests of a quoting burst, at the estimate that the rejecting burst
before them left its counts at, copy (``python -m bench policy-bursts``). The same
gain prices the request's own depth (:meth:`RequestDraftGate.depth`) and a batch's K
(:meth:`RequestDraftGate.batch_gains`).

The gate also sets the step's K: when the hook decides K for the next step and no running
request's drafts would pay (:meth:`RequestDraftGate.plan`, counting toward each request's
probe), that step runs at K = 0. A step at K > 0 costs something even when every draft is
then dropped (the proposer's run, and on the CPU the engine core's fetch of the drafts:
docs/benchmarks.md), so at batch 1 a request whose drafts do not pay costs what plain
decoding costs between its probes, and a new request is drafted from its first step on.
Under async scheduling (GPU) the drafts reach the scheduler as placeholders and cannot be
dropped per request; there the gate sets only the step's K, and probes every request at once
(one step at the controller's K after ``probe_every`` steps at K = 0), so that a batch of
many planned-out requests does not draft in every step for one request's probe.

No vLLM import (NumPy fits the mixture prior); the scheduler hook (``engine_host.scheduler``) calls it.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np

ACCEPTANCE_BUCKETS = (0.0, 0.2, 0.4, 0.6, 0.8)  # lower edges of the histogram's bins
# per-token acceptance at which a class's distribution of per-request acceptance is kept
# (``prior="mixture"``, module doc)
MIXTURE_GRID = tuple((i + 0.5) / 10.0 for i in range(10))
_LOG_A = tuple(math.log(a) for a in MIXTURE_GRID)
_LOG_R = tuple(math.log(1.0 - a) for a in MIXTURE_GRID)
_GRID = np.asarray(MIXTURE_GRID)
_LOG_AR = np.array([_LOG_A, _LOG_R])  # (2, len(MIXTURE_GRID)): (accepted, rejections) @ it
# estimates due together (``acceptance_many``) from which one array operation is cheaper than
# one exponential per grid point each
MIXTURE_ARRAY_FROM = 4
# a request's mixture estimate is recomputed once its counts (accepted, rejections) moved by
# this fraction of its judged tokens
MIXTURE_RECOMPUTE = 0.05
# finished requests a class's distribution needs before the mixture prior is used for it
MIXTURE_MIN_REQUESTS = 4
# a class's distribution is fitted when MIXTURE_MIN_REQUESTS of its requests have finished and
# again after every MIXTURE_REFIT_EVERY, with MIXTURE_EM_ITERATIONS iterations from the last fit
MIXTURE_REFIT_EVERY = 8
MIXTURE_EM_ITERATIONS = 20
# share of the starting shape kept in every fitted distribution (``_refit``)
MIXTURE_FLOOR = 0.02
# share of every fitted distribution kept at the lowest grid point: any class may at any time
# get requests whose drafts are all rejected (``_refit``)
MIXTURE_REJECTING = 0.1
# probe_backoff > 1: a request whose class has fewer than this share of requests whose drafts
# pay (``RequestDraftGate.paying_share``) waits the longest between probes from its start
PROBE_NEW_SHARE = 0.1
PRIORS = ("pooled", "mixture")  # a new request's prior (module doc)
GAINS = ("calibrated", "geometric")  # how a draft's expected accepted tokens are read (module doc)
# gain="calibrated": the longest draft whose positions are kept apart (tokens; longer ones are
# counted as this long), the fading of a class's counts per verification counted, the most
# verifications of one step counted (a larger step's are sampled evenly), the verifications of
# one bin at which its measured gain weighs as much as the geometric one, and the
# pseudo-verifications a position's measured acceptance starts from (``_cal_read``)
CALIBRATION_MAX_DRAFT = 16
CALIBRATION_DECAY = 0.995
CALIBRATION_PER_STEP = 8
CALIBRATION_READ_EVERY = 8  # verifications counted between two readings of the counts (``_curves``)
CALIBRATION_STRENGTH = 8.0
CALIBRATION_POSITION_PRIOR = 2.0
_CAL_BINS = len(ACCEPTANCE_BUCKETS)
# (ACCEPTANCE_BUCKETS are equal bins of 0..1: an estimate's bin is int(a * _CAL_BINS))
assert ACCEPTANCE_BUCKETS == tuple(i / _CAL_BINS for i in range(_CAL_BINS))
_CAL_CENTRES = tuple((i + 0.5) / _CAL_BINS for i in range(_CAL_BINS))
_CAL_RENORM = 1e100  # a class's counts are scaled back once the next verification's weight passes this


@dataclass(slots=True)
class _RequestStats:
    drafted: float = 0.0  # draft tokens verified (decayed count)
    accepted: float = 0.0  # of those, accepted (decayed count)
    rejections: float = 0.0  # verifications that ended at a rejected token (decayed count)
    steps_gated: int = 0  # consecutive steps whose drafts were dropped
    probe_pending: bool = False  # a probe was planned: its drafts are verified once
    offered: float = 0.0  # steps at K > 0 after which the request could have had a draft (decayed)
    found: float = 0.0  # of those, steps it had one (decayed)
    est: float = 0.0  # its acceptance under the mixture prior (``_mixture_acceptance``'s cache)
    est_ver: int = -1  # the distributions' version est was computed at (-1: none)
    est_accepted: float = -1.0  # accepted and rejections when est was computed
    est_rejections: float = -1.0
    seen: float = -1.0  # the acceptance estimate last handed out for it (-1: none; gain="calibrated")
    probe_wait: int = 0  # steps kept from drafting before its next probe (0: probe_every; probe_backoff)
    probing: bool = False  # its draft was let through as a probe: the verification sets probe_wait
    planned: bool = False  # plan() has seen it (its first wait is set then)
    full: bool = False  # its last verified draft was accepted in full (engine_host.run_acceptance)


class RequestDraftGate:
    """Per-request acceptance estimates and the verify-or-drop decision.

    Args:
        prior_accepted: Beta prior pseudo-count of accepted tokens (>= 0).
        prior_rejected: Beta prior pseudo-count of rejected tokens (>= 0). The prior's
            strength is ``prior_accepted + prior_rejected``; its mean is the pooled
            acceptance (below), which starts at ``prior_accepted / (prior_accepted +
            prior_rejected)``: with the defaults (1, 1) a request with no verified drafts
            on an engine that has verified none is estimated at 0.5.
        decay: factor (0..1] applied to a request's counts before each new observation,
            so its estimate follows its recent text.
        margin: fraction (>= 0) by which a request's drafts must beat plain decoding.
        probe_every: a request whose drafts were dropped this many steps in a row is
            drafted again (steps, >= 1).
        pool_decay: factor (0..1) applied to the pooled counts of every request's
            verifications once per token each new verification judges (its accepted tokens
            and its rejection, if any; memory about ``1 / (1 - pool_decay)`` judged tokens);
            0 keeps the prior's mean fixed at ``prior_accepted / (prior_accepted +
            prior_rejected)``.
        prior: ``"pooled"`` (a Beta prior at the class's pooled mean) or ``"mixture"`` (the
            distribution over the class's finished requests; module doc).
        mixture_requests: the last finished requests of a class its distribution is fitted
            to under ``prior="mixture"`` (>= 1).
        gain: ``"geometric"`` (a k-token draft at acceptance ``a`` yields ``sum_j a^j``
            tokens) or ``"calibrated"`` (that, moved toward what the class's drafts verified
            at a like estimate yielded; module doc).
        probe_backoff: the most a request's wait between probes grows to, in multiples of
            ``probe_every`` (>= 1; 1: every request is probed every ``probe_every`` steps).
            Above 1, a probe that finds no draft or whose draft is mostly rejected doubles
            the request's wait, a verification that accepts at least half its draft brings it
            back to ``probe_every``, a request whose class's drafts seldom pay starts at the
            longest wait, and the probes of a step at K > 0 that no request's drafts pay for
            take along every request past half its wait (:meth:`plan_batch`; module doc).
    Raises:
        ValueError: a parameter out of range.
    """

    def __init__(
        self,
        prior_accepted: float = 1.0,
        prior_rejected: float = 1.0,
        decay: float = 0.9,
        margin: float = 0.0,
        probe_every: int = 16,
        pool_decay: float = 0.98,
        prior: str = "pooled",
        mixture_requests: int = 128,
        gain: str = "geometric",
        probe_backoff: int = 1,
    ):
        if prior_accepted < 0 or prior_rejected < 0 or prior_accepted + prior_rejected <= 0:
            raise ValueError("the prior's pseudo-counts must be >= 0 and not both 0")
        if not 0.0 < decay <= 1.0:
            raise ValueError("decay must be in (0, 1]")
        if margin < 0:
            raise ValueError("margin must be >= 0")
        if probe_every < 1:
            raise ValueError("probe_every must be >= 1 step")
        if not 0.0 <= pool_decay <= 1.0:
            raise ValueError("pool_decay must be in [0, 1]")
        if prior not in PRIORS:
            raise ValueError(f"prior must be one of {', '.join(PRIORS)}, got {prior!r}")
        if mixture_requests < 1:
            raise ValueError("mixture_requests must be >= 1")
        if gain not in GAINS:
            raise ValueError(f"gain must be one of {', '.join(GAINS)}, got {gain!r}")
        if probe_backoff < 1:
            raise ValueError("probe_backoff must be >= 1")
        self.prior_accepted = prior_accepted
        self.prior_rejected = prior_rejected
        self.decay = decay
        self.margin = margin
        self.probe_every = probe_every
        self.pool_decay = pool_decay
        self.prior = prior
        self.mixture_requests = mixture_requests
        self.gain_model = gain
        self.probe_backoff = probe_backoff
        # gain="calibrated", per class (None: requests with no class) and bin of ACCEPTANCE_BUCKETS
        # its verifications' estimates stood in: the decayed counts of those that reached draft
        # position j = 1..D (D = CALIBRATION_MAX_DRAFT) and of those that accepted it; the weight
        # the class's next verification is counted with (each weighs 1 / CALIBRATION_DECAY times
        # the one before it, so that fading the counts costs nothing per verification); the bins
        # counted into since they were last read; and per bin what was read: (weight of the
        # measured gain, measured gain of a j-token draft for j = 0..D, tokens)
        self._cal_reached: dict[str | None, list[list[float]]] = {}
        self._cal_passed: dict[str | None, list[list[float]]] = {}
        self._cal_w: dict[str | None, float] = {}
        self._cal_dirty: set[tuple[str | None, int]] = set()
        self._cal_unread = 0  # verifications counted since the last reading
        self._cal_curve: dict[str | None, list[tuple[float, list[float]]]] = {}
        self._cal_stride = 1  # every how many verifications of a step one is counted
        # prior="mixture": per class (None: every request's), the distribution over MIXTURE_GRID
        # (starting at the configured Beta prior's shape), its mean and the finished requests
        # folded in; each class's version, which its running requests' cached estimates are
        # checked against (a fit of one class leaves the others' estimates standing)
        beta = [a ** (prior_accepted - 1.0) * (1.0 - a) ** (prior_rejected - 1.0) for a in MIXTURE_GRID]
        mix0 = [w / sum(beta) for w in beta]
        self._mix0 = mix0
        self._mix: dict[str | None, list[float]] = {None: list(mix0)}
        self._mix_mean: dict[str | None, float] = {None: sum(w * a for w, a in zip(mix0, MIXTURE_GRID))}
        self._mix_n: dict[str | None, int] = {None: 0}
        # the scaled likelihoods over MIXTURE_GRID of the class's last mixture_requests finished
        # requests, a ring of rows (the next row to write is the class's count modulo its length)
        self._mix_win: dict[str | None, np.ndarray] = {None: self._new_window()}
        self._mix_ver = 0  # the last version handed out (unique over classes)
        self._mix_vers: dict[str | None, int] = {None: 0}
        # [accepted, rejections] over recent verifications (decayed counts), per request
        # class; None: every request's (``summary``'s prior) and that of requests with no class
        self._pools: dict[str | None, list[float]] = {None: [0.0, 0.0]}
        self._class: dict[str, str] = {}  # request id -> its class (set_class)
        self._reqs: dict[str, _RequestStats] = {}
        self.last_total = 0  # requests with drafts considered in the last step
        self.last_verified = 0  # of those, drafts kept for verification

    # -- measurements ----------------------------------------------------------
    def observe(self, req_id: str, num_draft_tokens: int, num_accepted_tokens: int) -> None:
        """Fold in one verification of request ``req_id`` (tokens drafted, tokens accepted)."""
        self.observe_many(((req_id, num_draft_tokens, num_accepted_tokens),))

    def observe_many(
        self, verifications: Iterable[tuple[str | None, int, int]], after_full: list[bool] | None = None
    ) -> None:
        """Fold in verifications in order, each ``(request id, tokens drafted, tokens
        accepted)`` as :meth:`observe` takes one; an id of None or a verification with no
        draft tokens is skipped. The scheduler hook hands over a step's verifications in one
        call: it runs once per request with drafts at every step at K > 0.

        ``after_full``: a list this appends to, one entry per verification in order, whether
        the request's previous verified draft was accepted in full (False for a skipped one
        and for a request's first): the run state its draft was proposed in
        (:mod:`engine_host.run_acceptance`)."""
        reqs = self._reqs
        decay = self.decay
        pool_decay = self.pool_decay
        pools = self._pools
        classes = self._class
        every = pools[None]
        calibrated = self.gain_model == "calibrated"
        i, stride = -1, self._cal_stride
        for req_id, drafted, accepted in verifications:
            if drafted <= 0 or req_id is None:
                if after_full is not None:
                    after_full.append(False)
                continue
            s = reqs.get(req_id)
            if s is None:
                s = reqs[req_id] = _RequestStats()
            n = accepted if accepted < drafted else drafted
            if n < 0:
                n = 0
            if after_full is not None:
                after_full.append(s.full)
            s.full = n == drafted
            rejected = 1.0 if n < drafted else 0.0
            s.drafted = s.drafted * decay + drafted
            s.accepted = s.accepted * decay + n
            s.rejections = s.rejections * decay + rejected
            if n > 0 and 2 * n >= drafted:  # half its draft or more accepted: probed at probe_every again
                s.probe_wait = 0
            elif s.probing:  # a probe mostly rejected: the wait before the next one doubles
                s.probe_wait = self._longer_wait(s.probe_wait)
            s.probing = False
            if calibrated:
                i += 1
                if i % stride == 0:  # by the estimate its draft was priced at, before this verification
                    cls = classes.get(req_id)
                    self._cal_count(cls, s.seen if s.seen >= 0.0 else self.prior_mean(cls), drafted, n)
            if pool_decay > 0.0:
                # one factor per token judged (each accepted token and the rejection, if any): a
                # verification of 8 accepted tokens weighs as the 8 judgments it is, and it fades
                # as fast as 8 rejections would, so after copy traffic a run of rejected chat
                # drafts brings the prior down within about 1 / (1 - pool_decay) of them
                f = pool_decay ** (n + rejected)
                every[0] = every[0] * f + n
                every[1] = every[1] * f + rejected
                cls = classes.get(req_id)
                if cls is not None:
                    pool = pools.get(cls)
                    if pool is None:
                        pool = pools[cls] = [0.0, 0.0]
                    pool[0] = pool[0] * f + n
                    pool[1] = pool[1] * f + rejected
        if calibrated:  # the next step's verifications sampled by this one's number
            self._cal_stride = max(1, (i + 1) // CALIBRATION_PER_STEP)

    def _cal_count(self, cls: str | None, estimate: float, drafted: int, accepted: int) -> None:
        """Count one verification of a request of class ``cls`` whose acceptance estimate stood
        at ``estimate`` (fraction 0..1) when its ``drafted``-token draft was priced, of which
        ``accepted`` tokens were accepted (``gain="calibrated"``, module doc)."""
        reached = self._cal_reached.get(cls)
        if reached is None:
            reached = self._cal_reached[cls] = [[0.0] * CALIBRATION_MAX_DRAFT for _ in range(_CAL_BINS)]
            self._cal_passed[cls] = [[0.0] * CALIBRATION_MAX_DRAFT for _ in range(_CAL_BINS)]
            self._cal_w[cls] = 1.0
        b = int(estimate * _CAL_BINS)
        if b >= _CAL_BINS:
            b = _CAL_BINS - 1
        d = drafted if drafted < CALIBRATION_MAX_DRAFT else CALIBRATION_MAX_DRAFT
        n = accepted if accepted < d else d
        w = self._cal_w[cls]
        r, p = reached[b], self._cal_passed[cls][b]
        for j in range(n + 1 if n < d else d):  # positions 1..n + 1 reached (up to d)
            r[j] += w
        for j in range(n):  # positions 1..n accepted
            p[j] += w
        self._cal_dirty.add((cls, b))
        self._cal_unread += 1
        w /= CALIBRATION_DECAY
        if w > _CAL_RENORM:
            for rows in (reached, self._cal_passed[cls]):
                for row in rows:
                    row[:] = [x / w for x in row]
            self._cal_dirty.update((cls, i) for i in range(_CAL_BINS))
            w = 1.0
        self._cal_w[cls] = w

    def _curves(self, cls: str | None) -> list[tuple[float, list[float]]] | None:
        """Class ``cls``'s measured gains per bin (``_cal_read``), read again first once
        ``CALIBRATION_READ_EVERY`` verifications were counted since the last reading (at once for
        a class not read yet); None before any verification of the class was counted."""
        if self._cal_unread >= CALIBRATION_READ_EVERY or (self._cal_unread and cls not in self._cal_curve):
            self._cal_read()
        return self._cal_curve.get(cls)

    def _cal_read(self) -> None:
        """Read, for each class counted into since the last reading, per bin what a j-token
        draft yielded: position j's acceptance is the share of the verifications that reached
        it (drafted at least j tokens, accepted at least j - 1) and accepted it, started with
        ``CALIBRATION_POSITION_PRIOR`` pseudo-verifications at the bin's centre for position 1
        and, past it, at the class's share over all its bins (itself started at 0.5 with one):
        how far a draft runs once its first token is accepted is the text's, more than the
        estimate's, and a bin of few drafts borrows it from the others. The gain of a j-token
        draft is the sum over positions up to j of the product of those shares (the
        Kaplan-Meier estimate of how far a draft is accepted, shorter drafts counted up to their
        length; E. L. Kaplan and P. Meier, JASA 53, 1958). The measured gain's weight is ``n /
        (n + CALIBRATION_STRENGTH)`` with ``n`` the bin's verifications, each faded by
        ``CALIBRATION_DECAY`` per verification of its class counted after it."""
        dirty, self._cal_dirty = self._cal_dirty, set()
        self._cal_unread = 0
        prior = CALIBRATION_POSITION_PRIOR
        for cls in {c for c, _ in dirty}:
            scale = 1.0 / (self._cal_w[cls] * CALIBRATION_DECAY)  # the newest verification's weight: 1
            reached_by_bin, passed_by_bin = self._cal_reached[cls], self._cal_passed[cls]
            pooled = [  # the class's share of each position's reaching drafts that accepted it
                (sum(p) * scale + 0.5) / (sum(r) * scale + 1.0)
                for r, p in zip(zip(*reached_by_bin), zip(*passed_by_bin))
            ]
            curves: list[tuple[float, list[float]]] = []
            for b, (reached, passed) in enumerate(zip(reached_by_bin, passed_by_bin)):
                x = [0.0]
                surv, total = 1.0, 0.0
                starts = [_CAL_CENTRES[b], *pooled[1:]]  # position 1 at the bin's centre, the others the class's
                for r, p, start in zip(reached, passed, starts):
                    surv *= (p * scale + prior * start) / (r * scale + prior)
                    total += surv
                    x.append(total)
                n = reached[0] * scale
                curves.append((n / (n + CALIBRATION_STRENGTH), x))
            self._cal_curve[cls] = curves

    def set_class(self, req_id: str, cls: str) -> None:
        """Name the class of request ``req_id`` (e.g. ``"sampled"``): its prior's mean is
        then pooled over requests of that class only (module doc). Forgotten with the
        request (:meth:`forget`)."""
        self._class[req_id] = cls

    def request_class(self, req_id: str) -> str | None:
        """The class named for request ``req_id`` (:meth:`set_class`), None when none was."""
        return self._class.get(req_id)

    def observe_offer(self, req_id: str, drafted: bool) -> None:
        """Fold in one step at K > 0 after which request ``req_id`` (past its prefill)
        could have got a draft: ``drafted`` says whether the proposer found one (an n-gram
        proposer finds none where the text does not repeat)."""
        s = self._reqs.get(req_id)
        if s is None:
            s = self._reqs[req_id] = _RequestStats()
        s.offered = s.offered * self.decay + 1.0
        s.found = s.found * self.decay + (1.0 if drafted else 0.0)
        if s.probe_pending and not drafted and self.probe_backoff > 1:
            # its probe found no draft: spent, and the wait before the next one doubles
            s.probe_pending = False
            s.probe_wait = self._longer_wait(s.probe_wait)

    def _longer_wait(self, wait: int) -> int:
        """A request's wait between probes after a probe that found nothing: double its
        ``wait`` (0: ``probe_every``), at most ``probe_backoff`` times ``probe_every`` (steps)."""
        every = self.probe_every
        return min(2 * (wait or every), self.probe_backoff * every) if self.probe_backoff > 1 else 0

    def draft_rate(self, req_id: str) -> float:
        """Estimated share (fraction 0..1) of steps at K > 0 after which the request has a
        draft: ``(found + 1) / (offered + 1)``, 1.0 before any offer (a new request is
        assumed to draft)."""
        s = self._reqs.get(req_id)
        if s is None:
            return 1.0
        return (s.found + 1.0) / (s.offered + 1.0)

    def prior_mean(self, cls: str | None = None) -> float:
        """Mean (fraction 0..1) of a new request's prior: the per-token acceptance pooled
        over recent verifications of requests of class ``cls`` (None: of every request),
        itself starting at the configured prior's mean (module doc); under ``prior="mixture"``
        the mean of the class's distribution over its finished requests."""
        if self.prior == "mixture" and self._mixture_ready(cls):
            return self._mix_mean[cls]
        a0, r0 = self.prior_accepted, self.prior_rejected
        acc, rej = self._pools.get(cls) or (0.0, 0.0)
        return (acc + a0) / (acc + rej + a0 + r0)

    def acceptance(self, req_id: str) -> float:
        """Estimated per-token acceptance ``a`` of the request's drafts, fraction 0..1:
        the probability that the next draft token is accepted given the ones before it
        were (``accepted / (accepted + rejections)`` with the Beta prior; under
        ``prior="mixture"`` the posterior mean over the class's distribution; module doc)."""
        cls = self._class.get(req_id)
        s = self._reqs.get(req_id)
        if self.prior == "mixture" and self._mixture_ready(cls):
            a = self._mixture_acceptance(req_id, cls)
        else:
            m = self.prior_mean(cls)
            if s is None:
                return m
            strength = self.prior_accepted + self.prior_rejected
            a = (s.accepted + strength * m) / (s.accepted + s.rejections + strength)
        if s is not None:
            s.seen = a
        return a

    def acceptance_many(self, req_ids: Iterable[str]) -> list[float]:
        """:meth:`acceptance` of each request of ``req_ids``, in order (fractions 0..1); the
        first list of :meth:`batch_terms`."""
        return self.batch_terms(req_ids)[0]

    def batch_terms(self, req_ids: Iterable[str]) -> tuple[list[float], list[float]]:
        """``(acceptance, draft rate)`` of each request of ``req_ids``, in order: what
        :meth:`acceptance` and :meth:`draft_rate` give each (fractions 0..1), in one pass over
        the requests. Pricing a batch asks for every running request's terms; under
        ``prior="mixture"`` the estimates due to be computed again (``_mixture_kept``) are
        computed together, as one array of likelihoods over ``MIXTURE_GRID`` scaled per
        request, where one at a time costs ``len(MIXTURE_GRID)`` exponentials each. Raises
        nothing: a request the gate has not seen gets its class's prior and a rate of 1.0."""
        reqs, classes = self._reqs, self._class
        out: list[float] = []
        rates: list[float] = []
        due: list[tuple[int, _RequestStats, str | None]] = []
        mixture = self.prior == "mixture"
        ready: dict[str | None, bool] = {}  # per class: estimated under its distribution
        pooled: dict[str | None, float] = {}  # per class: the pooled prior's mean (prior_mean)
        strength = self.prior_accepted + self.prior_rejected
        vers, means = self._mix_vers, self._mix_mean
        # acceptance, draft_rate and _mixture_kept written out: this loop runs over every running
        # request (tests/test_request_gate.py checks that the results are theirs)
        seen: list[_RequestStats | None] = []  # each request's stats, to keep its estimate as seen
        for rid in req_ids:
            cls = classes.get(rid)
            s = reqs.get(rid)
            seen.append(s)
            rates.append(1.0 if s is None else (s.found + 1.0) / (s.offered + 1.0))
            on = ready.get(cls)
            if on is None:
                on = ready[cls] = mixture and self._mixture_ready(cls)
            if not on:
                m = pooled.get(cls)
                if m is None:
                    m = pooled[cls] = self.prior_mean(cls)
                out.append(m if s is None else (s.accepted + strength * m) / (s.accepted + s.rejections + strength))
                continue
            if s is None or s.accepted + s.rejections <= 0.0:
                out.append(means[cls])
                continue
            n, r = s.accepted, s.rejections
            if s.est_ver == vers[cls] and abs(n - s.est_accepted) + abs(r - s.est_rejections) < MIXTURE_RECOMPUTE * (
                n + r
            ):
                out.append(s.est)
                continue
            due.append((len(out), s, cls))
            out.append(0.0)
        if len(due) < MIXTURE_ARRAY_FROM:
            for i, s, cls in due:
                out[i] = self._mixture_estimate(s, cls)
            self._keep_seen(seen, out)
            return out, rates
        counts = np.array([(s.accepted, s.rejections) for _, s, _ in due])
        logs = counts @ _LOG_AR  # (m, len(MIXTURE_GRID)): log a^accepted (1 - a)^rejections
        like = np.exp(logs - logs.max(axis=1, keepdims=True))
        names = list({cls: None for _, _, cls in due})
        g = np.array([self._mix[c] for c in names])[[names.index(cls) for _, _, cls in due]]
        w = like * g
        z = w.sum(axis=1)
        est = (w @ _GRID) / np.where(z > 0.0, z, 1.0)
        for (i, s, cls), e, zi in zip(due, est.tolist(), z.tolist()):
            e = e if zi > 0.0 else means[cls]
            s.est, s.est_ver, s.est_accepted, s.est_rejections = e, vers[cls], s.accepted, s.rejections
            out[i] = e
        self._keep_seen(seen, out)
        return out, rates

    def _keep_seen(self, stats: list[_RequestStats | None], estimates: list[float]) -> None:
        """Keep each request's estimate as the one its next verification is counted by
        (``gain="calibrated"``; ``observe_many``)."""
        if self.gain_model != "calibrated":
            return
        for s, a in zip(stats, estimates):
            if s is not None:
                s.seen = a

    def _mixture_ready(self, cls: str | None) -> bool:
        """Whether requests of class ``cls`` are estimated under its distribution: it needs
        ``MIXTURE_MIN_REQUESTS`` finished requests of the class (the pooled prior before)."""
        return self._mix_n.get(cls, 0) >= MIXTURE_MIN_REQUESTS

    @staticmethod
    def _likelihood(accepted: float, rejections: float) -> list[float]:
        """``a^accepted (1 - a)^rejections`` at each point of ``MIXTURE_GRID``, scaled so that
        the largest is 1 (long runs of verifications would underflow unscaled)."""
        logs = [accepted * la + rejections * lr for la, lr in zip(_LOG_A, _LOG_R)]
        top = max(logs)
        return [math.exp(x - top) for x in logs]

    def _mixture_acceptance(self, req_id: str, cls: str | None) -> float:
        s = self._reqs.get(req_id)
        kept = self._mixture_kept(s, cls)
        if kept is not None or s is None:  # (s None: kept is the class's mean)
            return self._mix_mean[cls] if kept is None else kept
        return self._mixture_estimate(s, cls)

    def _mixture_kept(self, s: _RequestStats | None, cls: str | None) -> float | None:
        """The estimate of a request with stats ``s`` under class ``cls``'s distribution where
        it needs no computing: the class's mean before any verified draft, the cached one
        while the distributions are the same and its counts moved by less than
        ``MIXTURE_RECOMPUTE`` of its judged tokens (with counts that fade by ``decay``, a
        request whose drafts are accepted alike settles at the same counts step after step);
        None where it is due to be computed again."""
        if s is None or s.accepted + s.rejections <= 0.0:
            return self._mix_mean[cls]
        n, r = s.accepted, s.rejections
        moved = abs(n - s.est_accepted) + abs(r - s.est_rejections)
        if s.est_ver == self._mix_vers[cls] and moved < MIXTURE_RECOMPUTE * (n + r):
            return s.est
        return None

    def _mixture_estimate(self, s: _RequestStats, cls: str | None) -> float:
        """The posterior mean of ``s``'s acceptance under class ``cls``'s distribution,
        computed and kept as ``s.est`` (``_mixture_acceptance``'s cache)."""
        n, r = s.accepted, s.rejections
        ver = self._mix_vers[cls]
        exp = math.exp
        z = est = 0.0
        g = self._mix[cls]
        for w, la, lr, a in zip(g, _LOG_A, _LOG_R, MIXTURE_GRID):  # unscaled: the fast path
            p = w * exp(n * la + r * lr)
            z += p
            est += p * a
        if z <= 1e-280:
            z = est = 0.0
            for w, x, a in zip(g, self._likelihood(n, r), MIXTURE_GRID):
                z += w * x
                est += w * x * a
        est = est / z if z > 0.0 else self._mix_mean[cls]
        s.est, s.est_ver, s.est_accepted, s.est_rejections = est, ver, n, r
        return est

    def _fold_finished(self, req_id: str, s: _RequestStats) -> None:
        """Fold a finished request's verifications into its class's window of finished
        requests and every class's, and fit the distributions again every
        ``MIXTURE_REFIT_EVERY`` of them (``prior="mixture"``, module doc)."""
        if self.prior != "mixture" or s.accepted + s.rejections <= 0.0:
            return
        like = self._likelihood(s.accepted, s.rejections)
        cls = self._class.get(req_id)
        if cls not in self._mix:  # a class seen for the first time starts at the starting shape
            self._mix[cls] = list(self._mix0)
            self._mix_n[cls] = 0
            self._mix_win[cls] = self._new_window()
            self._mix_ver += 1
            self._mix_vers[cls] = self._mix_ver
        for key in (None, cls) if cls is not None else (None,):
            count = self._mix_n[key]
            self._mix_win[key][count % self.mixture_requests] = like
            self._mix_n[key] = count + 1
            # every request's distribution (key None) only estimates requests with no class, which
            # the scheduler hook never leaves, and the summary: fitted a quarter as often
            every = MIXTURE_REFIT_EVERY if key is cls else 4 * MIXTURE_REFIT_EVERY
            if (count + 1) % every == 0 or count + 1 == MIXTURE_MIN_REQUESTS:
                self._refit(key)

    def _new_window(self) -> np.ndarray:
        return np.zeros((self.mixture_requests, len(MIXTURE_GRID)))

    def _refit(self, key: str | None) -> None:
        """Fit class ``key``'s distribution over ``MIXTURE_GRID`` to the likelihoods of its
        window of finished requests by EM (module doc): ``g <- g * mean_i(L_i / (L_i . g))``,
        ``MIXTURE_EM_ITERATIONS`` times from the previous fit, then blended with
        ``MIXTURE_FLOOR`` of the starting shape and ``MIXTURE_REJECTING`` at the lowest grid
        point. A fit to a window of requests that all reject puts nearly all its mass on the
        lowest grid point, and a new request whose drafts are accepted must still be able to
        leave it after a verification or two: an accepted token is strong evidence (``a / 0.05``
        per token), so a small floor does. The other way round is slower: a draft rejected at
        its first token weighs only ``0.95 / (1 - a)`` against a high ``a``, so after a window of
        requests that quote, a new request whose drafts are rejected needs a share of the mass
        kept where its drafts would be, or it drafts for many steps (``python -m bench prior-fit
        --then``; figures in docs/engine_host.md)."""
        like = self._mix_win[key][: min(self._mix_n[key], self.mixture_requests)]  # (requests, grid points)
        like_t = np.ascontiguousarray(like.T) * (1.0 / like.shape[0])
        g = np.asarray(self._mix[key], dtype=np.float64)
        for _ in range(MIXTURE_EM_ITERATIONS):
            z = like.dot(g)  # each request's likelihood under g
            np.maximum(z, 1e-300, out=z)
            np.reciprocal(z, out=z)
            g = g * like_t.dot(z)
        g = (1.0 - MIXTURE_FLOOR - MIXTURE_REJECTING) * g / g.sum() + MIXTURE_FLOOR * np.asarray(self._mix0)
        g[0] += MIXTURE_REJECTING
        self._mix[key] = g.tolist()
        self._mix_mean[key] = float(g @ np.asarray(MIXTURE_GRID))
        self._mix_ver += 1
        self._mix_vers[key] = self._mix_ver

    def forget(self, live_ids: set[str] | None = None, req_id: str | None = None) -> None:
        """Drop one finished request, or every request not in ``live_ids``."""
        if req_id is not None:
            s = self._reqs.pop(req_id, None)
            if s is not None:
                self._fold_finished(req_id, s)
            self._class.pop(req_id, None)
        if live_ids is not None:
            for rid in [r for r in self._reqs if r not in live_ids]:
                self._fold_finished(rid, self._reqs.pop(rid))
            for rid in [r for r in self._class if r not in live_ids]:
                del self._class[rid]

    # -- decisions ---------------------------------------------------------------
    @staticmethod
    def expected_gain(a: float, k: int) -> float:
        """``sum_{j=1..k} a^j``: expected accepted tokens of a k-token draft (tokens)."""
        if k <= 0 or a <= 0.0:
            return 0.0
        if a >= 1.0:
            return float(k)
        return a * (1.0 - a**k) / (1.0 - a)

    def gain(self, cls: str | None, a: float, k: int) -> float:
        """Expected accepted tokens (tokens, 0..k) of a k-token draft of a request of class
        ``cls`` whose acceptance estimate is ``a`` (fraction 0..1). ``gain="geometric"``:
        :meth:`expected_gain`. ``gain="calibrated"``: ``max(G, w * m + (1 - w) * G)``, with ``G =
        sum_j a^j``, ``m`` what the class's verified drafts at an estimate in the same bin of
        ``ACCEPTANCE_BUCKETS`` yielded at this length and ``w`` its weight (``_cal_read``;
        the geometric gain alone before any). Never below the geometric gain: a bin whose
        drafts were rejected and which is then priced under its cost is drafted no more, so
        its counts would not learn that a new request at that estimate copies (module doc).
        Raises nothing."""
        geo = self.expected_gain(a, k)
        if k <= 0 or self.gain_model != "calibrated":
            return geo
        curves = self._curves(cls)
        if curves is None:
            return geo
        w, x = curves[min(max(int(a * _CAL_BINS), 0), _CAL_BINS - 1)]
        return max(geo, w * x[min(k, CALIBRATION_MAX_DRAFT)] + (1.0 - w) * geo)

    def batch_gains(self, req_ids: Iterable[str], k: int) -> tuple[list[float], float]:
        """``(gain, rate)`` of a batch: ``gain[j] = sum_i r_i * (x_i(j) - x_i(j - 1))`` for j =
        1..k (``gain[0]`` = 0; tokens), what the j-th draft position adds to the batch's
        expected accepted tokens, and ``rate = sum_i r_i``, the requests expected to have a
        draft; ``x_i`` is :meth:`gain` at request i's class and estimate, ``r_i`` its draft
        rate (:meth:`batch_terms`). Formula: the goodput law (Leviathan et al., arXiv
        2211.17192) summed over the batch. Raises nothing."""
        ids = req_ids if isinstance(req_ids, list) else list(req_ids)
        total = [0.0] * (k + 1)
        rate = 0.0
        classes = self._class
        plain = self.gain_model != "calibrated" or not self._cal_w
        marginals: dict[tuple[str | None, int], tuple[float, list[float]]] = {}
        zeros = [0.0] * (CALIBRATION_MAX_DRAFT + 1)
        for rid, a, r in zip(ids, *self.batch_terms(ids)):
            rate += r
            if plain:  # the geometric law: position j adds a^j
                p = r
                for j in range(1, k + 1):
                    p *= a
                    total[j] += p
                continue
            cls = classes.get(rid)
            b = min(max(int(a * _CAL_BINS), 0), _CAL_BINS - 1)
            steps = marginals.get((cls, b))
            if steps is None:  # the bin's measured gain at each length, weighted, and the geometric's weight
                cc = self._curves(cls)
                w, x = (0.0, zeros) if cc is None else cc[b]
                x = x + [x[-1]] * max(k - CALIBRATION_MAX_DRAFT, 0)
                steps = marginals[(cls, b)] = (1.0 - w, [w * x[j] for j in range(1, k + 1)])
            # gain() written out (it runs per request): x(j) = max(G(j), w * m(j) + (1 - w) * G(j)),
            # G(j) = sum_{i<=j} a^i; position j adds x(j) - x(j - 1)
            p, geo, before, wg = 1.0, 0.0, 0.0, steps[0]
            for j, wm in enumerate(steps[1], 1):
                p *= a
                geo += p
                x_j = wm + wg * geo
                if x_j < geo:
                    x_j = geo
                total[j] += r * (x_j - before)
                before = x_j
        return total, rate

    def depth(self, req_id: str, draft_token_cost: float, k_max: int) -> int:
        """The request's own draft length (tokens, 0..``k_max``) by the marginal rule: the
        j-th draft token is accepted with probability ``p_j`` (``a^j`` under the geometric
        gain, Leviathan et al., arXiv 2211.17192; the step of :meth:`gain` from j - 1 to j)
        and costs ``c = draft_token_cost`` to verify, so positions are added while ``p_j >=
        (1 + margin) * c``. A request with no verified drafts is judged at the prior's mean."""
        a = self.acceptance(req_id)
        if k_max <= 0 or a <= 0.0:
            return 0
        if a >= 1.0:
            return k_max
        bar = (1.0 + self.margin) * max(draft_token_cost, 1e-12)
        curves = self._curves(self._class.get(req_id)) if self.gain_model == "calibrated" else None
        if curves is not None:  # p_j = x(j) - x(j - 1) under gain(), written out
            w, x = curves[min(int(a * _CAL_BINS), _CAL_BINS - 1)]
            j, p, geo, before, top = 0, a, a, 0.0, CALIBRATION_MAX_DRAFT
            while j < k_max:
                x_next = max(geo, w * x[min(j + 1, top)] + (1.0 - w) * geo)
                if x_next - before < bar:
                    break
                j, before = j + 1, x_next
                p *= a
                geo += p
            return j
        j, p = 0, a
        while j < k_max and p >= bar:
            j += 1
            p *= a
        return j

    def pays(self, req_id: str, k: int, draft_token_cost: float) -> bool:
        """True when verifying a k-token draft of this request beats plain decoding.

        Args:
            req_id: the request.
            k: its draft's length (tokens).
            draft_token_cost: ``c`` of the module docstring (fraction of a plain
                request-step per verified draft token, >= 0).
        """
        if k <= 0:
            return False
        x = self.gain(self._class.get(req_id), self.acceptance(req_id), k)
        return x >= (1.0 + self.margin) * k * max(draft_token_cost, 0.0)

    def allows(self, req_id: str, k: int, draft_token_cost: float) -> bool:
        """The decision for this step: verify the request's k-token draft or drop it.

        Counts the step: a request dropped for its wait in a row (``probe_every`` steps,
        longer while its probes back off: ``probe_backoff``) is let through once (a probe),
        so a request that starts accepting is drafted again.
        """
        s = self._reqs.get(req_id)
        self.last_total += 1
        if s is not None and s.probe_pending:  # drafted for a probe (plan): verify them
            s.probe_pending = False
            s.probing = True
            s.steps_gated = 0
            self.last_verified += 1
            return True
        if self.pays(req_id, k, draft_token_cost):
            if s is not None:
                s.steps_gated = 0
            self.last_verified += 1
            return True
        if s is None:
            s = self._reqs[req_id] = _RequestStats()
        s.steps_gated += 1
        if s.steps_gated >= (s.probe_wait or self.probe_every):
            s.steps_gated = 0
            s.probing = True
            self.last_verified += 1
            return True
        return False

    def explored(self, req_id: str) -> None:
        """Request ``req_id``'s draft of this step is verified whatever its estimate: the
        adaptive policy explores a depth for the whole batch (``engine_host.scheduler``,
        ``EXPLORE_PAST_GATE_MIN_BATCH``). Counts as a verified draft and as the request's
        probe."""
        self.last_total += 1
        self.last_verified += 1
        s = self._reqs.get(req_id)
        if s is not None:
            s.steps_gated = 0
            s.probe_pending = False

    def plan(self, req_id: str, k: int, draft_token_cost: float, step_cost: float = 0.0, probe: bool = True) -> bool:
        """Whether request ``req_id`` should get a k-token draft in the next step at all:
        True when drafting pays for it, or (``probe`` True) it is due for a probe.

        Drafting pays when ``r * (x(k) - k * c) >= step_cost`` (times ``1 + margin``):
        ``r`` the share of steps in which it has a draft (:meth:`draft_rate`), ``x(k)``
        the expected accepted tokens of its k-token draft, ``c = draft_token_cost``, and
        ``step_cost`` what a step at K > 0 costs with no draft verified, as a fraction of a
        plain step (the proposer and the draft fetch; >= 0).

        The step's K is one number: when no running request should get a draft, the
        scheduler hook schedules the next step at K = 0, which also spares the proposer
        and the engine core's draft fetch that a step at K > 0 pays even with every
        draft dropped. Each call counts one step the request is kept from drafting;
        after its wait (``probe_every`` of them, longer while its probes back off:
        ``probe_backoff``) it plans a probe, and :meth:`allows` then lets that
        draft through once, so a request that starts accepting is found again. With
        ``probe`` False nothing is counted and no probe is planned: the caller probes
        (under async scheduling, where drafts cannot be dropped per request, the hook runs
        one step at K > 0 for every request at once every ``probe_every`` steps).
        """
        return self._plan(req_id, k, draft_token_cost, step_cost, probe) > 0

    def _plan(self, req_id: str, k: int, draft_token_cost: float, step_cost: float, probe: bool) -> int:
        """:meth:`plan`'s answer as 0 (no draft), 1 (its drafts pay) or 2 (a probe)."""
        s = self._reqs.get(req_id)
        if probe and self.probe_backoff > 1 and (s is None or not s.planned):
            # its first wait: the longest where few of its class's requests' drafts pay
            if s is None:
                s = self._reqs[req_id] = _RequestStats()
            s.planned = True
            share = self.paying_share(self._class.get(req_id), k, draft_token_cost, step_cost)
            if s.probe_wait == 0 and share < PROBE_NEW_SHARE:
                s.probe_wait = self.probe_backoff * self.probe_every
        if k > 0:
            surplus = self.gain(self._class.get(req_id), self.acceptance(req_id), k) - k * max(draft_token_cost, 0.0)
            if self.draft_rate(req_id) * surplus >= (1.0 + self.margin) * max(step_cost, 0.0) and surplus >= 0.0:
                if s is not None:
                    s.steps_gated = 0
                return 1
        if not probe:
            return 0
        if s is None:
            s = self._reqs[req_id] = _RequestStats()
        s.steps_gated += 1
        if s.steps_gated >= (s.probe_wait or self.probe_every):
            s.steps_gated = 0
            s.probe_pending = True
            return 2
        return 0

    def plan_batch(self, req_ids: Iterable[str], k: int, draft_token_cost: float, step_cost: float = 0.0) -> bool:
        """Whether the next step should run at depth ``k`` for requests ``req_ids`` whose drafts
        are verified or dropped one by one (synchronous scheduling): :meth:`plan` for each
        (each one's probe count advances), True when any of them wants a draft. With
        ``probe_backoff`` above 1, when only probes want one the step's K > 0 is paid anyway,
        so every other request at least half way through its wait is probed with them: the
        probes of a batch share their steps at K > 0 rather than each paying one (``c`` and
        ``step_cost`` as in :meth:`plan`). Raises nothing."""
        ids = req_ids if isinstance(req_ids, list) else list(req_ids)
        pays = probes = False
        for rid in ids:
            why = self._plan(rid, k, draft_token_cost, step_cost, True)
            if why == 1:
                pays = True
            elif why == 2:
                probes = True
        if probes and not pays and self.probe_backoff > 1 and len(ids) > 1:
            every, reqs = self.probe_every, self._reqs
            for rid in ids:
                s = reqs.get(rid)
                if s is not None and not s.probe_pending and 2 * s.steps_gated >= (s.probe_wait or every):
                    s.steps_gated = 0
                    s.probe_pending = True
        return pays or probes

    def batch_pays(self, req_ids: Iterable[str], k: int, draft_token_cost: float, step_cost: float = 0.0) -> bool:
        """Whether a step at depth ``k`` pays for a batch whose requests all verify their
        drafts (vLLM's async scheduling, where drafts cannot be dropped request by request):
        ``sum_i r_i * (x_i(k) - k * c) >= (1 + margin) * B * step_cost`` over the ``B`` requests
        ``req_ids``, with ``r_i``, ``x_i`` and ``c`` as in :meth:`plan` (``c`` and ``step_cost``:
        fractions of a plain step; the sum is in tokens, a plain step yields ``B``). One
        request whose own drafts pay does not carry a batch whose other requests' drafts are
        rejected: each of them still pays ``k * c`` for its verification. Nothing is counted.
        Formula: the goodput law (Leviathan et al., arXiv 2211.17192) summed over the batch."""
        if k <= 0:
            return False
        kc = k * max(draft_token_cost, 0.0)
        net = 0.0
        ids = req_ids if isinstance(req_ids, list) else list(req_ids)
        n = len(ids)
        if self.gain_model == "calibrated" and self._cal_w:  # gain() written out: it runs per request
            classes = self._class
            kk = min(k, CALIBRATION_MAX_DRAFT)
            curves: dict[str | None, list[tuple[float, list[float]]] | None] = {}
            for rid, a, r in zip(ids, *self.batch_terms(ids)):
                x_geo = float(k) if a >= 1.0 else (a * (1.0 - a**k) / (1.0 - a) if a > 0.0 else 0.0)
                cls = classes.get(rid)
                cc = curves[cls] if cls in curves else curves.setdefault(cls, self._curves(cls))
                if cc is not None:
                    w, x = cc[min(int(a * _CAL_BINS), _CAL_BINS - 1)]
                    x_geo = max(x_geo, w * x[kk] + (1.0 - w) * x_geo)
                net += r * (x_geo - kc)
        else:
            gain = self.expected_gain
            for a, r in zip(*self.batch_terms(ids)):
                net += r * (gain(a, k) - kc)
        return n > 0 and net > 0.0 and net >= (1.0 + self.margin) * n * max(step_cost, 0.0)

    def paying_share(self, cls: str | None, k: int, draft_token_cost: float, step_cost: float = 0.0) -> float:
        """The share (fraction 0..1) of class ``cls``'s requests whose k-token drafts pay: the
        mass of its distribution of per-request acceptance (``prior="mixture"``, module doc)
        at the grid points ``a`` where one request's drafting pays by :meth:`batch_pays`'s rule,
        ``x(a, k) - k * c >= (1 + margin) * step_cost`` (``c`` and ``step_cost`` as there,
        fractions of a plain step; a new request assumed to draft, ``r = 1``). The chance that a
        new request of the class is one whose drafts would pay, before any of its drafts is
        verified. 1.0 under the pooled prior and while the class has fewer than
        ``MIXTURE_MIN_REQUESTS`` finished requests: no distribution over requests to read
        (module doc); 0.0 at ``k <= 0``. Formula: the goodput law (Leviathan et al., arXiv
        2211.17192) at each grid point. Raises nothing."""
        if k <= 0:
            return 0.0
        if self.prior != "mixture" or not self._mixture_ready(cls):
            return 1.0
        kc = k * max(draft_token_cost, 0.0)
        bar = (1.0 + self.margin) * max(step_cost, 0.0)
        share = 0.0
        for w, a in zip(self._mix[cls], MIXTURE_GRID):
            surplus = self.gain(cls, a, k) - kc
            if surplus > 0.0 and surplus >= bar:
                share += w
        return min(share, 1.0)

    def begin_step(self) -> None:
        """Reset the per-step counts (called before the step's decisions)."""
        self.last_total = 0
        self.last_verified = 0

    def summary(self) -> dict:
        """JSON-able: requests drafted / considered in the last step, the distribution
        of per-request acceptance over the requests with verified drafts (counts per bin
        of ``ACCEPTANCE_BUCKETS``), ``prior_acceptance``: where a new request's
        estimate starts (:meth:`prior_mean`, fraction 0..1), and
        ``prior_acceptance_by_class``: the same per request class seen so far, ``prior``:
        which prior a new request starts from (``pooled`` or ``mixture``), and ``gain``: how a
        draft's expected tokens are read (``calibrated`` or ``geometric``)."""
        hist = [0] * len(ACCEPTANCE_BUCKETS)
        for rid, s in self._reqs.items():
            if s.drafted <= 0:
                continue
            a = self.acceptance(rid)
            i = max(j for j, lo in enumerate(ACCEPTANCE_BUCKETS) if a >= lo)
            hist[i] += 1
        return {
            "requests_with_drafts": self.last_total,
            "requests_verified": self.last_verified,
            "acceptance_bins": list(ACCEPTANCE_BUCKETS),
            "acceptance_hist": hist,
            "prior_acceptance": round(self.prior_mean(), 4),
            "prior_acceptance_by_class": {
                cls: round(self.prior_mean(cls), 4)
                for cls in sorted(k for k in {*self._pools, *self._mix} if k is not None)
            },
            "prior": self.prior,
            "gain": self.gain_model,
        }


def draft_token_cost(t_plain_s: float, t_spec_s: float, k: int) -> float:
    """``c = (T(B, K) - T(B, 0)) / (K * T(B, 0))``: cost of one verified draft token as a
    fraction of one request's plain decode step (>= 0). ``t_plain_s``/``t_spec_s`` are
    step times (s) for the same batch at depth 0 and K."""
    if k <= 0 or t_plain_s <= 0:
        return 0.0
    return max(t_spec_s - t_plain_s, 0.0) / (k * t_plain_s)
