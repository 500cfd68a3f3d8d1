"""Speculation-depth policies: the adaptive goodput controller and its baselines.

Pure Python, no vLLM import: the scheduler hook (``engine_host.scheduler``) feeds one
:class:`StepObservation` per engine step and asks :meth:`SpeculationController.k_for_batch`
for the draft length K of the next step. Unit tests drive it with constructed statistics.

The control law (adaptive mode):

* expected tokens per verification step at depth K (Leviathan et al. 2023,
  arXiv 2211.17192)::

      E(K) = 1 + sum_{i=1..K} prod_{j<=i} a_j = 1 + sum_{i=1..K} r_i

  with ``a_j`` the conditional acceptance at draft position j and
  ``r_i = prod_{j<=i} a_j`` the chance that positions 1..i are all accepted, estimated
  online per decode request-step (requests whose n-gram proposer found no draft count
  as zero, so E(K) is what a step really yields);
* goodput for batch size B (SmartSpec/TurboSpec, arXiv 2406.14066)::

      G(K) = B * E(K) / T(B, K)     [tokens/s]

  with ``T(B, K)`` the measured step time (s) for that batch-size bucket and depth,
  learned online, with the fallback model ``t0 + t1 * B * (K + 1)`` plus a cost per
  step of drafting (a draft model's passes; for n-gram drafts the engine core's fetch
  of the drafts, which happens outside the step), and never below T(B, 0) (verifying
  drafts is never faster than plain decoding);
* ``K* = argmax G(K)`` over ``k_min..k_max``, with hysteresis, K = 0 unless
  speculation beats plain decoding by a margin, and periodic exploration of
  neighbouring depths so the estimates stay fresh. Under load T grows with B*(K+1)
  and the best K falls (Kong et al., arXiv 2605.15051).

Baselines, selectable on the same engine: ``fixed``, ``off``, ``batch_table`` (vLLM's
``num_speculative_tokens_per_batch_size``), ``threshold`` (the 10 s acceptance loop of
blog posts) and ``heuristic`` (transformers' assisted generation schedule).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from .acceptance import AcceptanceEstimator
from .config import SpeculationConfig, effective_k_bounds
from .depth_acceptance import DepthTokens
from .run_acceptance import RunStateAcceptance


@dataclass
class StepObservation:
    """What one engine step measured (produced by the scheduler hook).

    Attributes:
        batch_size: decode requests in the step (running requests verifying drafts
            or generating one token).
        k_drafted: draft length K the verified drafts were proposed with (tokens).
        num_draft_tokens: draft tokens verified this step (all requests).
        num_accepted_tokens: draft tokens accepted this step.
        accepted_hist: ``accepted_hist[i]`` = requests with at least i+1 accepted
            draft tokens (length K_max of the engine).
        draft_hist: ``draft_hist[i]`` = requests whose draft had at least i+1 tokens
            (None: every request drafted ``k_drafted`` tokens).
        step_time_s: wall time of the step (schedule -> outputs), seconds.
        draft_fetch_s: time (s) the engine core spent fetching this step's drafts from the
            worker after the previous step's output (``EngineCore.post_step``, synchronous
            scheduling at K > 0): outside ``step_time_s``, yet part of what drafting costs
            (1.2-1.4 ms of a 24 ms step at batch 1 on the CPU, docs/benchmarks.md).
        pure_decode: True when no prefill shared the step and, at one request, the request's
            first decode steps are past (``engine_host.step_clock.DecodeStretch``): the
            step time is usable for T.
        now: monotonic timestamp (s).
        k_proposed: depth K the drafter ran at in this step for the next one (tokens;
            None: same as ``k_drafted``); a draft model's passes follow it.
        full_batch: of the decode requests, those whose previous verified draft was accepted
            in full (``engine_host.run_acceptance``); 0 when not counted.
        full_accepted_hist, full_draft_hist: ``accepted_hist`` and ``draft_hist`` of those
            requests alone (None: none counted).
        warmup: the step served the start-up warm-up (synthetic prompts at forced depths):
            its step time is learned, its acceptance is not (it says nothing about the
            traffic the engine will serve), nor does the policy react to it.
    """

    batch_size: int
    k_drafted: int
    num_draft_tokens: int
    num_accepted_tokens: int
    accepted_hist: list[int]
    step_time_s: float
    pure_decode: bool
    now: float = field(default_factory=time.monotonic)
    draft_hist: list[int] | None = None
    k_proposed: int | None = None
    warmup: bool = False
    draft_fetch_s: float = 0.0
    full_batch: int = 0
    full_accepted_hist: list[int] | None = None
    full_draft_hist: list[int] | None = None


def _always() -> bool:
    return True


def batch_bucket(batch_size: int) -> int:
    """Bucket index of a batch size: 0 for 1, 1 for 2-3, 2 for 4-7, ... (log2)."""
    return max(0, int(batch_size).bit_length() - 1)


class StepTimeModel:
    """Step time ``T(B, K)`` in seconds, learned online from pure-decode steps.

    The cost of a step follows the tokens it verifies, ``x = B * (1 + D(K))`` with D(K)
    the expected draft length (:meth:`AcceptanceEstimator.expected_draft`):
    ``T = (t0 + t1 * x) * c``, with ``t0, t1`` fitted by exponentially weighted least
    squares on the measured (tokens, time) of every step (the fallback model of
    SmartSpec, arXiv 2406.14066), with a ridge holding ``t1`` near ``SLOPE_PRIOR_RATIO * t0``
    while the tokens per step have hardly varied, and ``c`` a correction, measured / fitted: per
    (batch-size bucket, K) where that depth ran recently at that batch size (its mean step
    time over the current fit at its mean tokens, :meth:`correction`), else per batch-size
    bucket (a weighted mean of each step's ratio). The corrections absorb what a line cannot
    (a GPU step is nearly flat in tokens at small batch; on a CPU, verifying a draft
    costs more than its share of tokens) and follow drift (longer contexts) quickly.

    With a draft model or an EAGLE head (``draft_passes=True``) drafting K tokens takes K
    sequential forward passes of the drafter after the target's pass (vLLM's proposer runs
    one pass on the verified tokens, even at K = 0, to keep the draft's KV cache in step,
    then K - 1 single-token passes). The model then has a third term,
    ``T = (t0 + t1 * x + td * P) * c`` with ``P = max(K - 1, 0)`` the extra draft passes and
    ``td`` (s per pass) fitted with t0 and t1. This is the cost coefficient
    ``c = td / T(B, 0)`` of Leviathan et al. (arXiv 2211.17192, section 3.4: the time of one
    draft run over one target run), learned online instead of assumed, and SmartSpec's
    (arXiv 2406.14066) split of a step into proposal and verification time. While K has not
    varied enough to separate td from t0, td is held near a prior ``draft_cost_ratio *
    T(B=1, K=0)`` by a ridge term worth ``prior_steps`` steps (the ratio comes from the draft's
    size against the target's).

    For n-gram drafts (``draft_passes=False``) proposing costs no forward pass, but every
    step that verifies drafts (K > 0) pays a cost that does not follow its tokens: the
    engine core's fetch of the drafts from the worker before the step (``draft_fetch_s`` of
    :class:`StepObservation`, added to the step's time), which vLLM skips at K = 0. Measured
    at batch 1 on the CPU with chat traffic, where drafts are rare (docs/benchmarks.md): 1.2-1.4
    ms per step at K = 1, 4 and 8 alike, 5-6 % of a 24 ms step, and the whole difference
    between K = 8 and K = 0 for a step without a draft. The third term is then this cost,
    ``P = 1`` at K > 0 and 0 at K = 0 (``td`` in s per step), fitted the same way with a
    prior ``spec_step_cost_ratio * T(B=1, K=0)``. Without it, only the per-(bucket, K)
    corrections knew that K > 0 costs more than its verified tokens at equal x; after
    ``fresh_steps`` steps at K = 0 they fall back to the bucket's, and every depth was
    priced as K = 0 plus its few verified tokens. Under async scheduling (GPU) there is no
    fetch; the fixed cost is the proposer's, paid in the step that proposes for the next one.
    So ``P = 1`` for a step that verifies drafts *or* runs the proposer (:meth:`extra`), and
    a (bucket, K) correction learns only from steps that verified and proposed at the same
    depth: where K changes, a step pays one depth's verification and another's proposal.

    Args:
        alpha: weight of one step in the corrections, 0..1.
        forget: forgetting factor of the regression (per step), 0..1.
        fresh_steps: a (bucket, K) correction is used while that cell was measured within
            this many pure-decode steps.
        cell_steps: steps from which a (bucket, K) correction counts fully (fewer: blended
            with the bucket's).
        draft_passes: True when the drafter is a model (draft_model, EAGLE, MTP).
        draft_cost_ratio: prior of td / T(1, 0) with draft passes, fraction (> 0).
        prior_steps: weight of the prior on td, in steps.
        spec_step_cost_ratio: prior of td / T(1, 0) for n-gram drafts (the per-step cost at
            K > 0), fraction (>= 0); 0.05 from the fetch measured on the CPU.
        premium_window_s: None (default): a step at K > 0 takes its premium sample against
            K = 0's cell at its batch-size bucket, wherever and whenever that was measured.
            Set (s): against plain steps of the same bucket measured within this long of it,
            before or after (``now`` of :meth:`observe`; at least ``PREMIUM_WINDOW_STEPS``
            plain steps' time), and a step with none near it waits for the next plain step
            (dropped once out of the window). Steps that slow down together for a while for a
            reason unrelated to K (a shared GPU, longer contexts, clocks) then do not lend
            their slowness to the depth measured in that while (docs/gpu.md, host 26).
        premium_first: price a depth K > 0 at ``T(B, 0) * premium`` wherever its premium is
            known and K = 0's cell is fresh, also while its own cell is fresh (default False:
            only once that cell is stale or still blending). The engine host's controller
            sets both (:class:`SpeculationController`); the defaults keep the model before
            them, for ``bench step-time-replay`` comparisons.
        premium_borrow: a depth K > 0 with no premium of its own at a batch-size bucket (never
            run there beside plain steps) is priced by the premium of the same depth at the
            next bucket down or up, ``T(B, K) = T(B, 0) * premium``, instead of by the
            bucket's correction, which is learned mostly from plain steps (default False; the
            engine host's controller sets it). With ``--max-num-seqs 64``, 64 requests are a
            bucket of their own that an adaptive engine rarely drafts in (docs/gpu.md, host 27).

    Raises:
        ValueError: ``premium_window_s`` set and not > 0.
    """

    def __init__(
        self,
        alpha: float = 0.1,
        forget: float = 0.995,
        fresh_steps: int = 400,
        cell_steps: int = 8,
        draft_passes: bool = False,
        draft_cost_ratio: float = 0.25,
        prior_steps: float = 4.0,
        spec_step_cost_ratio: float = 0.05,
        premium_window_s: float | None = None,
        premium_first: bool = False,
        premium_borrow: bool = False,
    ):
        if premium_window_s is not None and not premium_window_s > 0:
            raise ValueError(f"premium_window_s must be > 0 s, got {premium_window_s}")
        self.premium_window_s = premium_window_s
        self.premium_first = premium_first
        self.premium_borrow = premium_borrow
        # premium_window_s: per bucket [recent plain step over the fitted line (ratio), when (s)],
        # and the K > 0 steps still waiting for a plain step near them: (K, s, batch size, when s)
        self._plain_near: dict[int, list[float]] = {}
        self._premium_wait: dict[int, list[tuple[int, float, int, float]]] = {}
        self.alpha = alpha
        self.forget = forget
        self.fresh_steps = fresh_steps
        self.cell_steps = cell_steps
        self.draft_passes = draft_passes
        self.draft_cost_ratio = draft_cost_ratio
        self.prior_steps = prior_steps
        self.spec_step_cost_ratio = spec_step_cost_ratio
        self.buckets: dict[int, list[float]] = {}  # bucket -> [correction, n]
        self._lean_at: dict[int, int] = {}  # bucket -> self.steps at its last lean observation
        # (bucket, K) -> [mean step time (s), n, last step, mean tokens x, mean P,
        #                 premium over a plain step of the same batch (ratio), its n,
        #                 mean batch size (requests)]
        self.cells: dict[tuple[int, int], list[float]] = {}
        self.steps = 0
        self._s = [0.0] * 5  # n, sx, st, sxx, sxt
        self._sp = [0.0] * 4  # sp, spp, sxp, spt (third term: draft passes or speculative steps)
        self._coef: tuple[float, float, float] | None = None  # coefficients3(), fitted at step _coef_step
        self._coef_step = 0

    @staticmethod
    def passes(k: int | None) -> int:
        """Draft forward passes beyond the one every step runs, at depth ``k``."""
        return max(int(k or 0) - 1, 0)

    def extra(self, k: int | None, k_proposed: int | None = None) -> int:
        """The third term's count P for a step verifying drafts of depth ``k`` while the
        drafter runs at ``k_proposed`` (default ``k``): extra draft passes at ``k_proposed``
        with draft passes, else 1 for a step that verifies drafts (they were fetched) or
        runs the proposer (``k_proposed`` > 0), and 0 for a step that does neither.

        Under async scheduling a step proposes for the next one, so where K changes the
        two differ, and the n-gram proposer's cost is paid in the step that runs it, not in
        the one that verifies its drafts (step traces in docs/gpu.md)."""
        if self.draft_passes:
            return self.passes(k if k_proposed is None else k_proposed)
        return 1 if (k or 0) > 0 or (k_proposed or 0) > 0 else 0

    def _prior_ratio(self) -> float:
        return self.draft_cost_ratio if self.draft_passes else self.spec_step_cost_ratio

    def observe(
        self,
        batch_size: int,
        tokens: int,
        step_time_s: float,
        k: int | None = None,
        k_proposed: int | None = None,
        now: float | None = None,
        weight: int = 1,
        lean: bool = False,
    ) -> None:
        """Fold in one pure-decode step of ``batch_size`` requests verifying ``tokens``
        (drafts proposed at depth ``k``; None: no per-depth correction). ``k_proposed``:
        the depth the drafter ran at in this step (default ``k``). ``step_time_s`` includes
        the fetch of the step's drafts (:attr:`StepObservation.draft_fetch_s`). ``now``:
        when the step ended (monotonic s), used with ``premium_window_s``. ``weight``: the
        observation stands for this many steps alike (>= 1; the scheduler hook's lean path
        hands over its steps' mean time), folded in as that many observations of it would
        be, at the cost of one. ``lean``: the steps ran on the hook's lean path at K = 0;
        while such steps were observed at this batch-size bucket within ``fresh_steps``
        steps, K = 0's cell (``T(B, 0)`` and the premium of every K > 0 over it) learns from
        them only: a step at K = 0 on the hook's full path (where the policy decides, or
        right after drafts were verified) takes longer than the lean steps that stand where
        drafting would not, and drafting is worth what it costs over those (docs/engine_host.md).
        Such a step still teaches the fit and the bucket's correction."""
        if batch_size <= 0 or tokens <= 0 or step_time_s <= 0 or not math.isfinite(step_time_s) or weight < 1:
            return
        self.steps += weight
        f = self.forget
        if weight == 1:
            fw, g = f, 1.0
        else:  # weight observations alike: every sum fades by f^w and gains 1 + f + ... + f^(w-1) of them
            fw = f**weight
            g = (1.0 - fw) / (1.0 - f) if f < 1.0 else float(weight)
        s = self._s
        x = float(tokens)
        s[0] = fw * s[0] + g
        s[1] = fw * s[1] + g * x
        s[2] = fw * s[2] + g * step_time_s
        s[3] = fw * s[3] + g * x * x
        s[4] = fw * s[4] + g * x * step_time_s
        p = float(self.extra(k, k_proposed))
        sp = self._sp
        sp[0] = fw * sp[0] + g * p
        sp[1] = fw * sp[1] + g * p * p
        sp[2] = fw * sp[2] + g * x * p
        sp[3] = fw * sp[3] + g * p * step_time_s
        t0, t1, td = self.coefficients3()
        ratio = step_time_s / max(t0 + t1 * x + td * p, 1e-9)
        b = batch_bucket(batch_size)
        cell = self.buckets.setdefault(b, [1.0, 0.0])
        a = max(self.alpha, 1.0 / (cell[1] + 1.0))
        cell[0] += (a if weight == 1 else 1.0 - (1.0 - a) ** weight) * (ratio - cell[0])
        cell[1] += weight
        # a (bucket, K) cell learns from steps that verified and proposed at one depth: one
        # where K changed pays for one depth's verification and another's proposal; K = 0's
        # from lean steps only while there are any (``lean``)
        if lean:
            self._lean_at[b] = self.steps
        elif k == 0 and self.steps - self._lean_at.get(b, -(1 << 62)) <= self.fresh_steps:
            return
        if k is not None and (k_proposed is None or k_proposed == k):
            kc = self.cells.get((b, k))
            if kc is None or self.steps - weight + 1 - kc[2] > self.fresh_steps:  # (the first of weight steps)
                # a stale cell starts again from this step; its premium over K = 0 is kept
                premium, n_premium = (kc[5], kc[6]) if kc is not None else (1.0, 0.0)
                kc = self.cells[(b, k)] = [
                    step_time_s,
                    float(weight),
                    float(self.steps),
                    x,
                    p,
                    premium,
                    n_premium,
                    float(batch_size),
                ]
            else:
                a = max(self.alpha, 1.0 / (kc[1] + 1.0))
                if weight > 1:
                    a = 1.0 - (1.0 - a) ** weight
                kc[0] += a * (step_time_s - kc[0])
                kc[3] += a * (x - kc[3])
                kc[4] += a * (p - kc[4])
                kc[7] += a * (batch_size - kc[7])
                kc[1] += weight
                kc[2] = float(self.steps)
            if self.premium_window_s is not None and now is not None:
                self._premium_near(b, k, batch_size, step_time_s, now, t0, t1, weight)
                return
            c0 = self._plain_cell(b) if k > 0 else None
            if c0 is not None:
                # this step against a plain step of the same batch, measured now (correction())
                t_plain = (t0 + t1 * batch_size) * c0[0] / max(t0 + t1 * c0[3] + td * c0[4], 1e-9)
                self._premium_sample(b, k, step_time_s / max(t_plain, 1e-9))

    #: With ``premium_window_s``: a plain step is near a step at K > 0 within at least this
    #: many plain steps' time (a CPU step takes 50-100 ms; the hook observes one plain step
    #: in ``LEAN_SAMPLE`` on its lean path).
    PREMIUM_WINDOW_STEPS = 32
    #: Weight of one plain step in the recent plain step time near a step at K > 0.
    PLAIN_NEAR_ALPHA = 0.1
    #: Steps at K > 0 kept per bucket while they wait for a plain step near them.
    PREMIUM_WAIT_MAX = 256

    def _premium_near(
        self, b: int, k: int, batch_size: int, step_time_s: float, now: float, t0: float, t1: float, weight: int = 1
    ) -> None:
        """``premium_window_s``: a plain step (``k`` = 0) updates its bucket's recent plain
        time (its ratio to the fitted line t0 + t1 * B, s) and gives the steps at K > 0
        waiting near it their premium samples; a step at K > 0 takes its sample now when a
        plain step of its bucket is near, else waits. A waiting step is priced against the
        line as fitted when its sample is taken, as the plain steps' ratio is (at start-up
        the fit moves a lot in a few steps)."""
        base = max(t0 + t1 * batch_size, 1e-9)
        ref = self._plain_near.get(b)
        floor = self.premium_window_s or 0.0
        if k == 0:
            window = max(floor, self.PREMIUM_WINDOW_STEPS * step_time_s)
            if ref is None or now - ref[1] > window:
                ref = self._plain_near[b] = [step_time_s / base, now]
            else:  # (weight plain steps alike: the weight of one, compounded)
                a = self.PLAIN_NEAR_ALPHA if weight == 1 else 1.0 - (1.0 - self.PLAIN_NEAR_ALPHA) ** weight
                ref[0] += a * (step_time_s / base - ref[0])
                ref[1] = now
            waiting = self._premium_wait.pop(b, None)
            for k_w, t_w, b_w, when in waiting or ():
                if now - when <= window:
                    self._premium_sample(b, k_w, t_w / (ref[0] * max(t0 + t1 * b_w, 1e-9)))
            return
        if ref is not None and now - ref[1] <= max(floor, self.PREMIUM_WINDOW_STEPS * ref[0] * base):
            self._premium_sample(b, k, step_time_s / (ref[0] * base))
            return
        waiting = self._premium_wait.setdefault(b, [])
        waiting.append((k, step_time_s, batch_size, now))
        if len(waiting) > self.PREMIUM_WAIT_MAX:
            del waiting[0]

    def _premium_sample(self, b: int, k: int, sample: float) -> None:
        """Fold one premium sample (ratio, clamped to ``PREMIUM_MIN..PREMIUM_MAX``) into the
        (bucket ``b``, depth ``k``) cell."""
        kc = self.cells.get((b, k))
        if kc is None:
            return
        sample = min(max(sample, self.PREMIUM_MIN), self.PREMIUM_MAX)
        a = max(self.alpha, 1.0 / (kc[6] + 1.0))
        kc[5] += a * (sample - kc[5])
        kc[6] += 1.0

    def _plain_cell(self, bucket: int) -> list[float] | None:
        """K = 0's cell at this batch-size bucket when it holds at least ``cell_steps`` steps,
        the last within ``fresh_steps`` steps (``T(B, 0)`` there is a measurement), else None."""
        c0 = self.cells.get((bucket, 0))
        if c0 is None or c0[1] < self.cell_steps or self.steps - c0[2] > self.fresh_steps:
            return None
        return c0

    def skip(self, steps: int) -> None:
        """``steps`` engine steps passed without being observed (the scheduler hook's lean
        path observes one output in ``LEAN_SAMPLE``): they count toward the age of every
        (bucket, K) cell, so a depth measured ``fresh_steps`` engine steps ago is no longer
        fresh however few of the steps since were observed."""
        if steps > 0:
            self.steps += steps

    #: Bounds of one step's premium sample (its time over a plain step's, :meth:`observe`):
    #: a timing hiccup or a step that ran beside a prefill moves the mean by a bounded amount.
    PREMIUM_MIN = 0.5
    PREMIUM_MAX = 20.0

    #: Once ``FIT_EVERY_AFTER`` steps are in, the fit is solved again every ``FIT_EVERY``
    #: steps instead of every step: it runs in the engine core's thread between steps, and
    #: with ``forget`` = 0.995 a few steps move it by a fraction of a percent, far less than
    #: one step's own noise. Before that (start-up, the warm-up's sweep over depths) every
    #: step refits.
    FIT_EVERY = 4
    FIT_EVERY_AFTER = 256
    #: The slope's prior, ``t1 / t0 = r``: the time of one more token in a step as a share
    #: of the step's fixed time. A line through steps whose tokens hardly varied (a lone
    #: request decoding at K = 0 before any draft was accepted, then one or two verified
    #: drafts) cannot tell the slope from the noise; each verified draft token would then be
    #: priced at ``r / (1 + r * x)`` of a step of ``x`` tokens (0.048 at batch 1). Before it,
    #: one point was split 0.8 / 0.2 of the mean step over the mean tokens and one slow step
    #: with a draft set the slope alone, which overpriced a lone request's first drafts
    #: (docs/engine_host.md, "The line's slope before the tokens per step vary").
    SLOPE_PRIOR_RATIO = 0.05
    #: Weight of that prior in the fit (x² * steps: as many steps one token from the mean
    #: tokens); a trace's drafts outweigh it within a few verified drafts.
    SLOPE_PRIOR_WEIGHT = 16.0

    def coefficients3(self) -> tuple[float, float, float]:
        """``(t0 [s], t1 [s per token], td [s per unit of P])``: td per extra draft pass with
        draft passes, else per step at K > 0 (see the class doc); fitted on every step up
        to at most ``FIT_EVERY`` - 1 steps ago."""
        age = self.steps - self._coef_step
        if self._coef is None or age >= self.FIT_EVERY or (age > 0 and self.steps <= self.FIT_EVERY_AFTER):
            self._coef = self._fit3()
            self._coef_step = self.steps
        return self._coef

    def _fit3(self) -> tuple[float, float, float]:
        n, sx, st, sxx, sxt = self._s
        spp_, spp, sxp, spt = self._sp
        t0l, t1l = self.coefficients()
        prior = self._prior_ratio() * (t0l + t1l)
        if n < 1e-9:
            return t0l, t1l, prior
        lam, lam1 = self.prior_steps, self.SLOPE_PRIOR_WEIGHT
        # weighted least squares on (1, x, P) with ridges on td and t1 toward their priors
        a = [[n, sx, spp_], [sx, sxx + lam1, sxp], [spp_, sxp, spp + lam]]
        b = [st, sxt + lam1 * self._slope_prior(), spt + lam * prior]
        var = sxx - sx * sx / n
        sol = _solve3(a, b) if var > 1e-6 * max(1.0, sxx) else None
        if sol is None:
            # the tokens per step did not vary (one batch size, no drafts found): the slope
            # is the line's, and (t0, td) are fitted on what is left, so that K = 0 against
            # K > 0 at the same tokens still sets td
            if spp - spp_ * spp_ / n <= 1e-6 * max(1.0, spp):  # nor did P: the line, td its prior
                return t0l, t1l, prior
            rt, rpt = st - t1l * sx, spt - t1l * sxp + lam * prior
            det = n * (spp + lam) - spp_ * spp_
            td = max((n * rpt - spp_ * rt) / det, 0.0)
            t0 = (rt - td * spp_) / n
            return (t0, t1l, td) if t0 >= 0.0 else (t0l, t1l, prior)
        t0, t1, td = sol
        if t1 < 1e-7 or t0 < 0 or td < 0:  # keep the physical signs; fall back to the line
            td = max(td, 0.0)
            rest_t = st - td * spp_
            rest_xt = sxt - td * sxp
            t1 = max((rest_xt - sx * rest_t / n + lam1 * self._slope_prior()) / (max(var, 0.0) + lam1), 1e-7)
            t0 = max(rest_t / n - t1 * sx / n, 0.0)
        return t0, t1, td

    def coefficients(self) -> tuple[float, float]:
        """``(t0 [s], t1 [s per token])`` of the fitted line."""
        n, sx, st, sxx, sxt = self._s
        if n < 1e-9:
            return 0.02, 0.02 * self.SLOPE_PRIOR_RATIO
        var = sxx - sx * sx / n
        mean_t, mean_x = st / n, sx / n
        lam, t1p = self.SLOPE_PRIOR_WEIGHT, self._slope_prior()
        # least squares with a ridge on the slope toward its prior (SLOPE_PRIOR_RATIO)
        t1 = max((sxt - sx * st / n + lam * t1p) / (max(var, 0.0) + lam), 1e-7)
        t0 = max(mean_t - t1 * mean_x, 0.0)
        return t0, t1

    def _slope_prior(self) -> float:
        """The slope of the prior line through the mean step (s per token):
        ``t0 + t1 * x = t`` at ``t1 = SLOPE_PRIOR_RATIO * t0``."""
        n, sx, st = self._s[0], self._s[1], self._s[2]
        if n < 1e-9:
            return 0.02 * self.SLOPE_PRIOR_RATIO
        r = self.SLOPE_PRIOR_RATIO
        return max(r * (st / n) / (1.0 + r * max(sx / n, 1.0)), 1e-7)

    def correction(
        self, batch_size: int, k: int | None = None, coef: tuple[float, float, float] | None = None
    ) -> float:
        """Measured / fitted for this batch size (and depth, where measured recently).

        A depth's correction is its cell's mean measured step time over what the current fit
        (``coef``, default :meth:`coefficients3`) gives at the cell's mean tokens and P: the
        fit moves as steps come in (at start-up the warm-up runs each depth in turn, each
        against a line fitted on the shallower ones), and a ratio taken against an earlier
        fit would price that depth by the fit's old error for ``fresh_steps`` steps. A cell of
        fewer than ``cell_steps`` steps is blended with the bucket's correction in proportion
        (the warm-up gives each depth two steps per batch size, often at other tokens per
        step than the traffic's).

        Where a depth K > 0 ran at this batch size for at least ``cell_steps`` steps while
        K = 0 was measured there too, its cell also keeps a *premium*: the mean of its steps'
        time over a plain step's at the same batch size (``T(B, 0)`` from the K = 0 cell when
        each step came in, or with ``premium_window_s`` from plain steps near it in time).
        While K = 0's cell is fresh, a cell not measured within ``fresh_steps`` steps (or one
        still blending; any cell with ``premium_first``) is priced by that premium,
        ``T(B, K) = T(B, 0) * premium`` at the cell's tokens, rather than by the bucket's
        correction: the bucket's correction is learned mostly from steps at K = 0, and the
        fitted line, pulled by other batch sizes, prices a speculative step at a small batch
        well below its measured premium once the traffic has moved to larger batches
        (docs/gpu.md, the step trace of host 23). A ratio between two depths at one batch
        size holds while both drift with longer contexts."""
        b = batch_bucket(batch_size)
        cell = self.buckets.get(b)
        c_bucket = cell[0] if cell else 1.0
        if k is not None:
            kc = self.cells.get((b, k))
            borrowed = None
            if self.premium_borrow and k > 0 and (kc is None or kc[6] < self.cell_steps):
                borrowed = self._borrowed(b, batch_size, k, coef if coef is not None else self.coefficients3())
                if kc is None and borrowed is not None:
                    return borrowed
            if kc is not None:
                t0, t1, td = coef if coef is not None else self.coefficients3()
                line = max(t0 + t1 * kc[3] + td * kc[4], 1e-9)
                fallback = c_bucket if borrowed is None else borrowed
                if k > 0 and kc[6] >= self.cell_steps and self._plain_cell(b) is not None:  # its premium
                    t_plain = (t0 + t1 * batch_size) * self.correction(batch_size, 0, (t0, t1, td))
                    fallback = t_plain * max(kc[5], 1.0) / line
                    if self.premium_first:
                        return fallback
                if self.steps - kc[2] <= self.fresh_steps:
                    w = min(1.0, kc[1] / self.cell_steps)
                    return w * kc[0] / line + (1.0 - w) * fallback
                return fallback
        return c_bucket

    def _borrowed(self, b: int, batch_size: int, k: int, coef: tuple[float, float, float]) -> float | None:
        """``premium_borrow``: the correction that prices depth ``k`` at ``batch_size``
        (bucket ``b``) by the premium of ``k`` at bucket ``b - 1`` or ``b + 1`` (the one with
        more premium samples), at that cell's draft tokens per request; None when neither has
        ``cell_steps`` premium samples or K = 0 at ``b`` is not fresh."""
        if self._plain_cell(b) is None:
            return None
        best = None
        for nb in (b - 1, b + 1):
            nc = self.cells.get((nb, k))
            if nc is not None and nc[6] >= self.cell_steps and (best is None or nc[6] > best[6]):
                best = nc
        if best is None:
            return None
        t0, t1, td = coef
        x = batch_size * best[3] / max(best[7], 1.0)
        line = max(t0 + t1 * x + td * best[4], 1e-9)
        t_plain = (t0 + t1 * batch_size) * self.correction(batch_size, 0, coef)
        return t_plain * max(best[5], 1.0) / line

    def predict_tokens(self, batch_size: int, tokens: float, k: int | None = None) -> float:
        """Predicted step time (s) for ``batch_size`` requests verifying ``tokens`` at depth ``k``
        (the drafter, if a model, running at depth ``k`` too)."""
        coef = self.coefficients3()
        t0, t1, td = coef
        return max((t0 + t1 * tokens + td * self.extra(k)) * self.correction(batch_size, k, coef), 1e-6)

    def predict(self, batch_size: int, k: int, draft_per_request: float | None = None) -> float:
        """Predicted step time (s) at depth ``k``; ``draft_per_request`` = D(K) (default K)."""
        d = float(k) if draft_per_request is None else draft_per_request
        return self.predict_tokens(batch_size, batch_size * (1.0 + d), k)

    def predict_curve(self, batch_size: int, drafts: list[float]) -> list[float]:
        """Predicted step times (s) for K = 0..len(drafts)-1, none below the one at K = 0.

        Args:
            batch_size: decode requests per step.
            drafts: ``drafts[k]`` = D(K) for K = k, draft tokens per request
                (:meth:`AcceptanceEstimator.expected_draft`).

        A step that verifies drafts is never faster than a plain decode step plus what
        every speculative step pays (the prior ratio of the third term: the draft fetch and
        the rejection sampler for n-gram drafts, the drafter's pass with a draft model), so
        every K > 0 is predicted at least ``T(B, 0) * (1 + ratio)``. Without this floor,
        corrections per depth measured at different moments (other contexts, another
        regime of the host's clocks or scheduling) can make a speculative K look as cheap
        as plain decoding by the noise of the measurements, and drafts that are accepted a
        few percent of the time would look like they pay. Deeper depths are not floored by
        shallower ones: a few noisy exploration steps at one depth must not hide every
        depth beyond it.
        """
        if not drafts:
            return []
        t_plain = self.predict(batch_size, 0, drafts[0])
        t_spec = t_plain * (1.0 + self.spec_floor_ratio())
        return [t_plain] + [max(self.predict(batch_size, k, d), t_spec) for k, d in enumerate(drafts) if k > 0]

    def spec_floor_ratio(self) -> float:
        """The least a step at K > 0 costs over a plain step, fraction of ``T(B, 0)``: the
        prior ratio of the third term (``draft_cost_ratio`` with draft passes, else
        ``spec_step_cost_ratio``)."""
        return max(self._prior_ratio(), 0.0)


def _solve3(a: list[list[float]], b: list[float]) -> tuple[float, float, float] | None:
    """Solve the 3x3 system ``a @ v = b`` by Gaussian elimination with partial pivoting;
    None when singular. Written out for speed: it runs once per engine step."""
    m0 = [a[0][0], a[0][1], a[0][2], b[0]]
    m1 = [a[1][0], a[1][1], a[1][2], b[1]]
    m2 = [a[2][0], a[2][1], a[2][2], b[2]]
    m = [m0, m1, m2]
    # singular below 1e-12 of the first column's scale: a[0][0] for the first pivot, the
    # chosen first pivot for the later ones
    tol = 1e-12 * max(1.0, abs(m0[0]))
    for c in range(3):
        piv = c
        best = abs(m[c][c])
        for r in range(c + 1, 3):
            v = abs(m[r][c])
            if v > best:
                piv, best = r, v
        if best < tol:
            return None
        if piv != c:
            m[c], m[piv] = m[piv], m[c]
            if c == 0:
                tol = 1e-12 * max(1.0, abs(m[0][0]))
        mc = m[c]
        d = mc[c]
        for r in range(3):
            if r != c:
                mr = m[r]
                f = mr[c] / d
                if f != 0.0:
                    for j in range(c, 4):
                        mr[j] -= f * mc[j]
    return m[0][3] / m[0][0], m[1][3] / m[1][1], m[2][3] / m[2][2]


class Policy:
    """A speculation-depth policy. Subclasses decide K; the controller clamps it."""

    name = "policy"
    #: True when the last :meth:`k_for_batch` answered an exploration's K (a depth tried to
    #: measure it, not the one the policy chose)
    exploring_step = False

    def __init__(self, spec: SpeculationConfig, k_engine: int, ctl: "SpeculationController"):
        self.spec = spec
        self.k_lo, self.k_hi = effective_k_bounds(spec, k_engine)
        self.ctl = ctl

    def k_for_batch(self, batch_size: int) -> int:
        """Draft length K (tokens) for the next step at this batch size."""
        raise NotImplementedError

    def observe(self, obs: StepObservation) -> None:
        """Learn from one step (default: nothing)."""

    def rest_steps(self, scale: int = 1) -> int:
        """Steps (>= 0) for which this policy holds K at 0 without being asked: the
        scheduler hook may schedule that many steps at K = 0 without :meth:`k_for_batch`
        and report them with :meth:`skip`; ``scale`` (>= 1) lengthens a policy's own rest
        between two decisions by that factor (the hook's, for a large batch). Default 0 (ask
        every step)."""
        return 0

    def skip(self, steps: int) -> None:
        """``steps`` steps were scheduled at K = 0 without :meth:`k_for_batch` (within
        :meth:`rest_steps`); default: nothing to count."""

    def steps_to_explore(self) -> int:
        """Steps (>= 0) that may be scheduled without :meth:`k_for_batch` before this policy
        would start an exploration: 0 while one runs. Default: unbounded (``2**62``), a policy
        that does not explore."""
        return 1 << 62

    def drained(self) -> None:
        """The engine ran out of requests; the next ones may be of another kind
        (default: nothing to do)."""

    def end_exploration(self) -> None:
        """The exploration whose step :meth:`k_for_batch` just answered was left to the
        per-request gate (none of the running requests' classes may pay): end it there
        (default: nothing to do, a policy that does not explore)."""

    def describe(self) -> dict[str, Any]:
        """Policy-specific state for ``/control/state``."""
        return {}


class OffPolicy(Policy):
    """K = 0 always."""

    name = "off"

    def k_for_batch(self, batch_size: int) -> int:
        return 0


class FixedPolicy(Policy):
    """Static K (vLLM's default use of speculative decoding)."""

    name = "fixed"

    def k_for_batch(self, batch_size: int) -> int:
        return self.spec.k


class BatchTablePolicy(Policy):
    """K by batch size from a table of inclusive ranges, with vLLM's semantics for
    ``num_speculative_tokens_per_batch_size``: gaps carry the previous K forward, batch
    sizes past the last range use its K, K is clamped to the engine's K_max."""

    name = "batch_table"

    def __init__(self, spec: SpeculationConfig, k_engine: int, ctl: "SpeculationController"):
        super().__init__(spec, k_engine, ctl)
        self.ranges = sorted(spec.table or [(1, 1 << 30, spec.k)])

    def k_for_batch(self, batch_size: int) -> int:
        k = self.ranges[0][2]
        for start, _end, kk in self.ranges:
            if batch_size >= start:
                k = kk
            else:
                break
        return k

    def describe(self) -> dict[str, Any]:
        return {"table": [list(r) for r in self.ranges]}


class ThresholdPolicy(Policy):
    """The acceptance-threshold loop engineers copy from blog posts.

    Every ``interval_s`` seconds: weighted acceptance (accepted / draft tokens over the
    interval) above ``raise_above`` -> K += 1; under ``off_below`` -> K = 0 (off);
    under ``lower_below`` -> K -= 1; K within ``k_low..k_high`` while on. While off it
    measures nothing, so it re-probes at ``k_low`` after 6 intervals.
    """

    name = "threshold"

    def __init__(self, spec: SpeculationConfig, k_engine: int, ctl: "SpeculationController"):
        super().__init__(spec, k_engine, ctl)
        p = spec.threshold
        self.p = p
        self.low = min(p.k_low, self.k_hi)
        self.high = min(p.k_high, self.k_hi)
        self.k = self.low
        self.window_start: float | None = None
        self.drafted = 0
        self.accepted = 0
        self.off_intervals = 0
        self.last_rate: float | None = None

    def k_for_batch(self, batch_size: int) -> int:
        return self.k

    def observe(self, obs: StepObservation) -> None:
        if self.window_start is None:
            self.window_start = obs.now
        self.drafted += obs.num_draft_tokens
        self.accepted += obs.num_accepted_tokens
        if obs.now - self.window_start < self.p.interval_s:
            return
        self.window_start = obs.now
        if self.k == 0:
            self.off_intervals += 1
            if self.off_intervals >= 6:
                self.k, self.off_intervals = self.low, 0
        elif self.drafted > 0:
            rate = self.accepted / self.drafted
            self.last_rate = rate
            if rate > self.p.raise_above:
                self.k = min(self.k + 1, self.high)
            elif rate < self.p.off_below:
                self.k = 0
            elif rate < self.p.lower_below:
                self.k = max(self.k - 1, self.low)
        self.drafted = self.accepted = 0

    def describe(self) -> dict[str, Any]:
        return {"last_acceptance_rate": self.last_rate, "interval_s": self.p.interval_s}


class HeuristicPolicy(Policy):
    """transformers' assisted-generation schedule ("heuristic"): after a step in which
    every draft token was accepted, K += 2; after one with a rejection, K -= 1 (never
    below 1). Steps without drafts leave K unchanged. Starts at k_max."""

    name = "heuristic"

    def __init__(self, spec: SpeculationConfig, k_engine: int, ctl: "SpeculationController"):
        super().__init__(spec, k_engine, ctl)
        self.floor = max(1, self.k_lo)
        self.k = max(self.floor, self.k_hi)

    def k_for_batch(self, batch_size: int) -> int:
        return self.k

    def observe(self, obs: StepObservation) -> None:
        if obs.num_draft_tokens <= 0:
            return
        if obs.num_accepted_tokens >= obs.num_draft_tokens:
            self.k = min(self.k + 2, self.k_hi)
        else:
            self.k = max(self.k - 1, self.floor)


class AdaptivePolicy(Policy):
    """Goodput-maximising K (module docstring; arXiv 2406.14066, 2211.17192, 2605.15051).

    Every ``DECIDE_EVERY`` steps at one batch size, and at once when the batch size
    changes: ``G(K) = B * E(K) / T(B, K)`` for K in ``k_min..k_max``; the best K
    replaces the current one only when it beats it by ``hysteresis``; any K > 0 must
    beat K = 0 by ``margin``. Now and then it spends a short burst at a neighbouring K
    (K*+1 and K*-1 in turn; K=1 when off) so that acceptance and step-time estimates stay
    fresh after a workload change; the interval starts at ``explore_every`` steps and
    doubles (up to 8x) while the decision holds, and resets when it moves. After the engine
    drains, the next burst of several requests is explored within ``explore_every`` steps
    (:meth:`drained`). A turn to K = 0 that stands on less evidence at position 1 than one
    exploration measures (``BURST_REQUEST_STEPS``, e.g. a workload's first few drafts, or the
    first after a detected change) brings the next exploration to ``THIN_OFF_EXPLORE`` of
    ``explore_every`` steps away, at a step with ``DRAIN_EXPLORE_MIN_BATCH`` requests or more.
    """

    name = "adaptive"
    BURST_REQUEST_STEPS = 16  # decode request-steps measured per exploration
    MAX_BACKOFF = 8  # exploration interval grows up to explore_every * MAX_BACKOFF while K holds
    # the goodput comparison is redone every DECIDE_EVERY steps at one batch size (and at once
    # when the batch size changes): evaluating T(B, K) and E(K) for every K is the largest part
    # of the hook's own per-step work (python -m bench hook-cost; figures in docs/gpu.md), while
    # the estimates it reads move over tens of request-steps
    DECIDE_EVERY = 8
    # while the choice is K = 0 and the scheduler hook rests on its lean path (rest_steps)
    REST_DECIDE_EVERY = 16
    # after the engine drained, the first step with at least this many requests (decode)
    # brings the next exploration to at most explore_every steps away (drained()); a lone
    # request is left to the per-request gate's probes, where an exploration at K = 1 would
    # take 17 steps (BURST_REQUEST_STEPS at batch 1)
    DRAIN_EXPLORE_MIN_BATCH = 4
    # a turn to K = 0 on thin evidence (under BURST_REQUEST_STEPS request-steps at position 1)
    # explores again within this fraction of explore_every: on copy traffic the first drafts of
    # each request (the turn from the prompt into the answer) are often all rejected, and a
    # turn-off read from them alone held K at 0 for explore_every steps (docs/engine_host.md)
    THIN_OFF_EXPLORE = 0.25

    def __init__(self, spec: SpeculationConfig, k_engine: int, ctl: "SpeculationController"):
        super().__init__(spec, k_engine, ctl)
        self.p = spec.adaptive
        self.current = min(max(self.k_lo, min(2, self.k_hi)), self.k_hi)
        self.steps = 0
        self.explore_left = 0
        self.explore_k: int | None = None
        self.explore_cycle = 0
        self.interval = self.p.explore_every
        self.next_explore = self.p.explore_every
        self.last_goodput: dict[int, float] = {}
        self.last_batch = 1
        self._decided_at = -self.DECIDE_EVERY  # self.steps of the last goodput comparison
        self._decided_batch = 0
        self._after_drain = False  # drained() since the last step with several requests
        self._thin_off = False  # turned to K = 0 on thin evidence, not yet brought forward

    def goodput(self, batch_size: int) -> dict[int, float]:
        """Predicted goodput (tokens/s) per K in bounds at this batch size."""
        b = max(1, batch_size)
        e, d = self.ctl.curves(self.k_hi)
        t = self.ctl.step_time.predict_curve(b, d)
        return {k: b * e[k] / t[k] for k in range(0, self.k_hi + 1) if k >= self.k_lo or k == 0}

    def _best(self, batch_size: int) -> int:
        g = self.goodput(batch_size)
        self.last_goodput = g
        best = max((k for k in g if k >= self.k_lo), key=lambda k: g[k])
        cur = self.current if self.current in g else best
        if best != cur and g[best] < g[cur] * (1.0 + self.p.hysteresis):
            best = cur
        if best > 0 and self.k_lo == 0:
            # speculation must pay: turning it on needs the full margin over K=0,
            # staying on the margin less the hysteresis
            need = self.p.margin if cur == 0 else max(self.p.margin - self.p.hysteresis, 0.0)
            if g[best] < g[0] * (1.0 + need):
                best = 0
        return best

    def k_for_batch(self, batch_size: int) -> int:
        self.last_batch = batch_size
        if self.explore_left > 0 and self.explore_k is not None:
            self.explore_left -= 1
            self.exploring_step = True
            return self.explore_k
        self.exploring_step = False
        if batch_size == self._decided_batch and self.steps - self._decided_at < self.DECIDE_EVERY:
            best = self.current
        else:
            best = self._best(batch_size)
            self._decided_at, self._decided_batch = self.steps, batch_size
        if best != self.current:
            self.interval = self.p.explore_every  # the decision moved: look around more
            # turned off on thin evidence: look again soon (THIN_OFF_EXPLORE)
            self._thin_off = best == 0 and self.ctl.acceptance.weight(0) < self.BURST_REQUEST_STEPS
        self.current = best
        self.steps += 1
        if self._thin_off and batch_size >= self.DRAIN_EXPLORE_MIN_BATCH:
            self._thin_off = False
            soon = self.steps + max(1, round(self.THIN_OFF_EXPLORE * self.p.explore_every))
            self.next_explore = min(self.next_explore, soon)
        if self._after_drain and batch_size >= self.DRAIN_EXPLORE_MIN_BATCH:
            self._after_drain = False
            if self.ctl.burst_may_pay():  # (the scheduler hook's answer: its requests' classes)
                self.next_explore = min(self.next_explore, self.steps + self.p.explore_every)
        if self.p.explore_every and self.k_hi > self.k_lo and self.steps >= self.next_explore:
            self.explore_k = self._pick_exploration()
            # long enough to measure about BURST_REQUEST_STEPS request-steps; the first
            # step verifies drafts of the previous depth
            burst = 1 + max(2, math.ceil(self.BURST_REQUEST_STEPS / max(1, batch_size)))
            self.explore_left = burst if self.explore_k != self.current else 0
            self.next_explore = self.steps + self.interval
            self.interval = min(self.interval * 2, self.p.explore_every * self.MAX_BACKOFF)
        return self.current

    def rest_steps(self, scale: int = 1) -> int:
        """While the policy's choice is K = 0 and no exploration burst runs: the steps
        until its next goodput comparison, ``REST_DECIDE_EVERY`` (times ``scale``) steps after the last, or
        its next exploration (:meth:`k_for_batch` starts one when ``steps`` reaches
        ``next_explore``), whichever comes first; 0 otherwise. Resting that long and then
        asking again explores at the same steps as asking every step, and compares goodput
        half as often: at K = 0 nothing is measured, and the estimates the comparison reads
        move only by the acceptance estimates' fade and the step times still sampled. The
        comparison that asking every step makes at once when the batch size changes waits
        for the rest's end."""
        if self.current != 0 or self.explore_left > 0:
            return 0
        n = self._decided_at + self.REST_DECIDE_EVERY * max(scale, 1) - self.steps
        if self.p.explore_every and self.k_hi > self.k_lo:
            n = min(n, self.next_explore - self.steps - 1)
        return max(n, 0)

    def skip(self, steps: int) -> None:
        self.steps += steps

    def steps_to_explore(self) -> int:
        if self.explore_left > 0:
            return 0
        if not (self.p.explore_every and self.k_hi > self.k_lo):
            return 1 << 62
        return max(self.next_explore - self.steps - 1, 0)

    def drained(self) -> None:
        """The engine drained: at the first later step with ``DRAIN_EXPLORE_MIN_BATCH``
        requests or more, the next exploration comes within ``explore_every`` steps,
        whatever its backed-off interval, unless the controller's ``burst_may_pay()`` says
        that none of those requests is of a class whose drafts may pay (the scheduler
        hook's per-request gate: fewer than ``PROBE_NEW_SHARE`` of each class's finished
        requests had drafts that pay at the policy's deepest K; its explorations then keep
        their backed-off interval). Requests that arrive together after an idle
        spell are often of one new kind (a batch job, a client's burst), and while K holds
        at 0 nothing tells the policy that their drafts would be accepted: a backed-off
        interval (``MAX_BACKOFF`` times ``explore_every``) can be longer than the whole
        burst. The interval itself is kept, so a burst whose drafts do not pay costs one
        short exploration."""
        self._after_drain = True

    def end_exploration(self) -> None:
        """End the running exploration after its first step (:meth:`Policy.end_exploration`):
        its other steps would each take the scheduler hook's full path and be held at the
        policy's choice by the gate; the next exploration keeps its backed-off interval."""
        self.explore_left = 0

    def _pick_exploration(self) -> int:
        """The deeper neighbour (K+1) and the shallower one (K-1) in turn; from K=0 only
        K=1, whose acceptance also sets the extrapolated deeper estimates."""
        self.explore_cycle += 1
        cur = self.current
        if cur <= self.k_lo:
            return min(cur + 1, self.k_hi)
        if cur >= self.k_hi:
            return max(cur - 1, self.k_lo)
        return min(cur + 1, self.k_hi) if self.explore_cycle % 2 else max(cur - 1, self.k_lo)

    def describe(self) -> dict[str, Any]:
        return {
            "k_best": self.current,
            "exploring": self.explore_left > 0,
            "goodput_tokens_per_s": {str(k): round(v, 2) for k, v in self.last_goodput.items()},
            "margin": self.p.margin,
            "hysteresis": self.p.hysteresis,
        }


POLICIES: dict[str, type[Policy]] = {
    p.name: p for p in (OffPolicy, FixedPolicy, BatchTablePolicy, ThresholdPolicy, HeuristicPolicy, AdaptivePolicy)
}


class SpeculationController:
    """Owns the estimates and the active policy; the scheduler hook's only contact.

    The acceptance and step-time estimates learn in every mode, so the state shown to
    operators stays meaningful whatever the policy.

    Args:
        k_engine: the engine's K_max (num_speculative_tokens at start-up), tokens.
        spec: the initial speculation config.
        draft_passes: True when drafts come from a model (draft model, EAGLE, MTP): each
            draft token costs a forward pass (see :class:`StepTimeModel`).
        draft_cost_ratio: prior of one draft pass over one target step, fraction.
        run_states: keep acceptance apart by run state as well
            (:class:`~engine_host.run_acceptance.RunStateAcceptance`) and price each depth by
            the stationary E(K) of the two states once both are measured (:meth:`curves`);
            False: E(K) from the aggregate per-position estimates alone.
        depth_tokens: measure the tokens per request-step each depth K yielded when served
            (:class:`~engine_host.depth_acceptance.DepthTokens`) and move the priced E(K) and
            D(K) toward them by their evidence (:meth:`curves`).
    """

    #: A step at K > 0 takes its premium sample against plain steps measured within this long
    #: (s; at least 32 plain steps' time: :class:`StepTimeModel`, ``premium_window_s``).
    PREMIUM_WINDOW_S = 0.5

    def __init__(
        self,
        k_engine: int,
        spec: SpeculationConfig | None = None,
        draft_passes: bool = False,
        draft_cost_ratio: float = 0.25,
        run_states: bool = True,
        depth_tokens: bool = False,
    ):
        self.k_engine = k_engine
        spec = spec or SpeculationConfig(mode="fixed", k=k_engine)
        self.acceptance = AcceptanceEstimator(max(k_engine, 1), alpha=spec.adaptive.ema_alpha)
        self.run_states = (
            RunStateAcceptance(max(k_engine, 1), alpha=spec.adaptive.ema_alpha) if run_states and k_engine > 0 else None
        )
        self._changes_seen = 0  # the aggregate's detected changes already passed on to the others
        # a quarter of the estimates' fade: a neighbouring depth is measured only in explorations
        self.depth_tokens = (
            DepthTokens(k_engine, alpha=spec.adaptive.ema_alpha / 4.0) if depth_tokens and k_engine > 0 else None
        )
        # a depth's premium against plain steps near it in time, and priced by it wherever it
        # is known (StepTimeModel: premium_window_s, premium_first; docs/gpu.md, host 26)
        self.step_time = StepTimeModel(
            draft_passes=draft_passes,
            draft_cost_ratio=draft_cost_ratio,
            premium_window_s=self.PREMIUM_WINDOW_S,
            premium_first=True,
            premium_borrow=True,
        )
        self.steps_at_k = [0] * (k_engine + 1)
        self.k_current = 0
        self.total_steps = 0
        self.drafted_total = 0
        self.accepted_total = 0
        self.policy: Policy = OffPolicy(spec, k_engine, self)
        # whether the requests of a burst after a drain may be ones whose drafts pay, asked by
        # the adaptive policy before it brings its next exploration near (AdaptivePolicy.drained);
        # the scheduler hook answers from its per-request gate's classes, else always True
        self.burst_may_pay: Callable[[], bool] = _always
        self._table_cache: tuple[float, dict[str, list[float]]] | None = None
        self.configure(spec)

    def configure(self, spec: SpeculationConfig) -> None:
        """Switch policy (estimates are kept)."""
        self.acceptance.alpha = spec.adaptive.ema_alpha
        if self.run_states is not None:
            self.run_states.alpha = spec.adaptive.ema_alpha
        self.policy = POLICIES[spec.mode](spec, self.k_engine, self)

    def k_for_batch(self, batch_size: int) -> int:
        """K (tokens) for the next step, clamped to ``0..K_max``; counts the step."""
        k = self.policy.k_for_batch(batch_size)
        k = 0 if k < 0 else (self.k_engine if k > self.k_engine else k)
        self.k_current = k
        self.steps_at_k[k] += 1
        return k

    def static_k(self) -> int | None:
        """The K (tokens, clamped to ``0..K_max``) of a policy that holds one depth whatever
        the batch and learns nothing from steps (``off``: 0, ``fixed``: its K); None for
        every other policy. The scheduler hook's lean path (``engine_host.scheduler``) runs
        while this is 0."""
        policy = self.policy
        if isinstance(policy, OffPolicy):
            return 0
        if type(policy) is FixedPolicy:
            return max(0, min(int(policy.spec.k), self.k_engine))
        return None

    def drained(self) -> None:
        """The scheduler hook saw the engine run out of requests (:meth:`Policy.drained`)."""
        self.policy.drained()

    def end_exploration(self) -> None:
        """The running exploration was left to the per-request gate: the policy ends it
        (:meth:`Policy.end_exploration`)."""
        self.policy.end_exploration()

    def exploring(self) -> bool:
        """Whether the K of the last :meth:`k_for_batch` was an exploration's
        (:attr:`Policy.exploring_step`)."""
        return self.policy.exploring_step

    def rest_steps(self, scale: int = 1) -> int:
        """Steps (>= 0) the scheduler hook may schedule at K = 0 without asking
        :meth:`k_for_batch`: unbounded (``2**62``) while :meth:`static_k` is 0, the
        adaptive policy's :meth:`AdaptivePolicy.rest_steps` while it holds K at 0 (its rest
        between two decisions ``scale`` times as long), else 0."""
        if self.static_k() == 0:
            return 1 << 62
        return max(int(self.policy.rest_steps(scale)), 0)

    def steps_to_explore(self) -> int:
        """Steps (>= 0) the scheduler hook may schedule without :meth:`k_for_batch` before the
        active policy would start an exploration (:meth:`Policy.steps_to_explore`; ``2**62``
        for a policy that never explores)."""
        return max(int(self.policy.steps_to_explore()), 0)

    def may_rest(self) -> bool:
        """Whether the active policy can hold K at 0 without being asked every step
        (:meth:`rest_steps`): a static K of 0 (``off``, ``fixed`` at 0) or the adaptive
        policy."""
        return self.static_k() == 0 or isinstance(self.policy, AdaptivePolicy)

    def count_scheduled_at_zero(self, steps: int) -> None:
        """Count ``steps`` engine steps the scheduler hook scheduled at K = 0 without asking
        :meth:`k_for_batch` (its lean path, taken within :meth:`rest_steps`); the policy
        counts them too (:meth:`Policy.skip`).

        Raises:
            ValueError: a negative count.
        """
        if steps < 0:
            raise ValueError(f"negative step count: {steps}")
        self.steps_at_k[0] += steps
        if steps:
            self.k_current = 0
            self.policy.skip(steps)

    def skip_quiet(self, steps: int, request_steps: int, timed: tuple[int, float, float] | None = None) -> None:
        """Fold in ``steps`` quiet steps at K = 0 that the scheduler hook handed back without
        observing them one by one (its lean path), with ``request_steps`` requests in them
        all together: they count in :attr:`total_steps`, and the acceptance estimates fade
        by ``request_steps`` request-steps, as they would have one step at a time (the fade
        compounds: :meth:`AcceptanceEstimator._fade`; a position whose evidence falls below
        the freshness threshold inside these steps returns toward the prior from the first
        of them rather than from the step it fell).

        ``timed``: ``(n, batch_size, step_time_s)``, the ``n`` of those steps that may teach
        the step-time model (pure decode, past a lone request's first steps), their mean
        requests and mean time (s). They teach it as one observation of weight ``n`` at K = 0
        (:meth:`StepTimeModel.observe`): while the policy rests at K = 0 its steps run on the
        hook's lean path, and a step on the full path (where the policy decides, or right
        after drafts were verified) takes longer than those, so a model that saw only the full
        path's steps at K = 0 would price a step at K > 0 against a plain step slower than the
        one it replaces (docs/engine_host.md). The other steps count toward the age of the
        model's per-depth measurements (:meth:`StepTimeModel.skip`).

        Raises:
            ValueError: a negative count, or ``timed`` with more steps than ``steps``.
        """
        if steps < 0 or request_steps < 0:
            raise ValueError(f"negative step counts: steps={steps}, request_steps={request_steps}")
        n = timed[0] if timed is not None else 0
        if not 0 <= n <= steps:
            raise ValueError(f"timed steps {n} not within 0..{steps}")
        self.total_steps += steps
        self.step_time.skip(steps - n)
        if timed is not None and n > 0:
            b = max(1, round(timed[1]))
            # now: they are the plain steps near the steps at K > 0 around them (premium_window_s)
            self.step_time.observe(b, b, timed[2], 0, 0, now=time.monotonic(), weight=n, lean=True)
        if request_steps > 0:
            self._fade_acceptance(request_steps)

    def _fade_acceptance(self, request_steps: int) -> None:
        """Time passes for the acceptance estimates by ``request_steps`` decode request-steps
        at K = 0 (nothing measured)."""
        zeros = [0] * max(self.k_engine, 1)
        self.acceptance.observe(0, request_steps, zeros, zeros)
        if self.run_states is not None:
            self.run_states.observe(0, request_steps, zeros, zeros, 0, None, None)
        if self.depth_tokens is not None:
            self.depth_tokens.tick(request_steps)

    def curves(self, k_hi: int) -> tuple[list[float], list[float]]:
        """``(E, D)`` for K = 0..``k_hi``: expected tokens per request per step (``E(K)``,
        tokens) and draft tokens per request (``D(K)``, tokens) that the adaptive policy prices
        each depth by. From the run states' stationary shares once both states are measured
        (:meth:`RunStateAcceptance.curves`, arXiv 2211.17192 per state), else ``E(K) = 1 +
        sum_{i<=K} r_i`` and ``D(K) = sum_{i<=K} q_i`` of the aggregate estimates; with depth
        tokens, both moved toward the tokens measured at each depth served
        (:meth:`DepthTokens.blend`)."""
        both = self.run_states.curves(k_hi) if self.run_states is not None else None
        if both is not None:
            e, d = both
        else:
            r, q = self.acceptance.r(), self.acceptance.q()
            e, d = [1.0], [0.0]
            for k in range(1, k_hi + 1):
                e.append(e[-1] + (r[k - 1] if k - 1 < len(r) else 0.0))
                d.append(d[-1] + (q[k - 1] if k - 1 < len(q) else 1.0))
        if self.depth_tokens is not None:
            return self.depth_tokens.blend(e, d)
        return e, d

    def record_scheduled(self, k_policy: int, k: int) -> None:
        """The engine scheduled the step counted by :meth:`k_for_batch` at ``k`` tokens where
        the policy chose ``k_policy`` (the scheduler hook's per-request decisions move it:
        ``engine_host.scheduler``). The step is counted at ``k`` instead, and ``k_current``
        (the K of the last engine step) says ``k``; ``k`` is clamped to ``0..K_max``."""
        k = 0 if k < 0 else (self.k_engine if k > self.k_engine else k)
        if k == k_policy:
            return
        if 0 <= k_policy < len(self.steps_at_k) and self.steps_at_k[k_policy] > 0:
            self.steps_at_k[k_policy] -= 1
        self.steps_at_k[k] += 1
        self.k_current = k

    def observe(self, obs: StepObservation) -> None:
        """Fold in one step's measurements and let the policy react (a warm-up step
        teaches the step-time model only: see :class:`StepObservation`)."""
        self.total_steps += 1
        if obs.pure_decode:
            self.step_time.observe(
                obs.batch_size,
                obs.batch_size + obs.num_draft_tokens,
                obs.step_time_s + max(obs.draft_fetch_s, 0.0),
                obs.k_drafted,
                obs.k_proposed,
                obs.now,
            )
        if obs.warmup:
            return
        self.drafted_total += obs.num_draft_tokens
        self.accepted_total += obs.num_accepted_tokens
        acc = self.acceptance
        acc.observe(obs.k_drafted, obs.batch_size, obs.accepted_hist, obs.draft_hist)
        states, depths = self.run_states, self.depth_tokens
        if acc.changes != self._changes_seen:  # a change of workload: the other estimates forget too
            self._changes_seen = acc.changes
            if states is not None:
                states.forget(acc.forget)
            if depths is not None:
                depths.forget(acc.forget)
        if depths is not None:
            depths.tick(obs.batch_size)
            depths.observe(obs.k_drafted, obs.batch_size, obs.num_accepted_tokens, obs.num_draft_tokens)
        if states is not None:
            states.observe(
                obs.k_drafted,
                obs.batch_size,
                obs.accepted_hist,
                obs.draft_hist,
                obs.full_batch,
                obs.full_accepted_hist,
                obs.full_draft_hist,
            )
        self.policy.observe(obs)

    def observe_quiet(self, steps: Sequence[tuple[int, int | None, float, bool, float]]) -> None:
        """Fold in quiet decode steps, oldest first: steps that verified no draft, fetched
        none and served no warm-up. Each is ``(batch_size [requests], k_proposed [tokens]
        or None, step_time_s [s], pure_decode, now [monotonic s])``.

        The same as :meth:`observe` of a :class:`StepObservation` with no drafts for each
        step, without building one for a policy that does not learn from steps (every
        policy but the threshold and heuristic baselines): the scheduler hook keeps such
        steps and hands them over a few at a time (``engine_host.scheduler``). For those
        policies the acceptance estimates fade by the steps' request-steps in one go, as in
        :meth:`skip_quiet` (the fade compounds; a position whose evidence falls below the
        freshness threshold inside these steps returns toward the prior from the first of
        them): one fade instead of one per step, the larger part of a quiet step's cost."""
        policy = self.policy
        learns = type(policy).observe is not Policy.observe
        tm_observe = self.step_time.observe
        acc_observe = self.acceptance.observe
        zeros = [0] * max(self.k_engine, 1)
        request_steps = 0
        for batch_size, k_proposed, step_time_s, pure, now in steps:
            self.total_steps += 1
            if pure:
                tm_observe(batch_size, batch_size, step_time_s, 0, k_proposed, now)
            if not learns:
                request_steps += batch_size
                continue
            acc_observe(0, batch_size, zeros, zeros)
            if self.run_states is not None:
                self.run_states.observe(0, batch_size, zeros, zeros, 0, None, None)
            if self.depth_tokens is not None:
                self.depth_tokens.tick(batch_size)
            policy.observe(
                StepObservation(
                    batch_size=batch_size,
                    k_drafted=0,
                    num_draft_tokens=0,
                    num_accepted_tokens=0,
                    accepted_hist=zeros,
                    draft_hist=zeros,
                    step_time_s=step_time_s,
                    pure_decode=pure,
                    now=now,
                    k_proposed=k_proposed,
                )
            )
        if request_steps > 0:
            self._fade_acceptance(request_steps)

    #: Batch sizes at which :meth:`snapshot` tabulates T(B, K) for the planner.
    PLANNER_BATCH_GRID = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, 96, 128, 192, 256)

    def step_time_table(self) -> dict[str, list[float]]:
        """``T(B, K)`` in milliseconds for every B of :data:`PLANNER_BATCH_GRID` and K = 0..K_max:
        ``{"<B>": [T(B, 0), T(B, 1), ...]}``, from the same model the policy uses
        (:meth:`StepTimeModel.predict_curve` with the current draft-reach estimates)."""
        acc, tm = self.acceptance, self.step_time
        drafts = [acc.expected_draft(k) for k in range(0, self.k_engine + 1)]
        return {str(b): [round(t * 1000.0, 4) for t in tm.predict_curve(b, drafts)] for b in self.PLANNER_BATCH_GRID}

    def _step_time_table_cached(self, max_age_s: float = 1.0) -> dict[str, list[float]]:
        """:meth:`step_time_table`, recomputed at most every ``max_age_s`` seconds: the state
        is published several times a second from the engine core, the table moves slowly."""
        now = time.monotonic()
        cached = self._table_cache
        if cached is None or now - cached[0] >= max_age_s:
            cached = self._table_cache = (now, self.step_time_table())
        return cached[1]

    def measured_batch_sizes(self) -> list[int] | None:
        """``[smallest, largest]`` decode batch size (requests) whose step times the model
        has measured (the ends of the measured log2 buckets); None before any pure-decode step."""
        seen = [b for b, cell in self.step_time.buckets.items() if cell[1] > 0]
        if not seen:
            return None
        return [1 << min(seen), (1 << (max(seen) + 1)) - 1]

    def snapshot(self, batch_size: int | None = None) -> dict[str, Any]:
        """JSON-able state: K, estimates per position, E(K), T(B, K), goodput per K.

        Per-position estimates (``acceptance_per_position``, ``conditional_acceptance``,
        ``draft_reach_per_position``) are None at positions never measured since the
        engine started (``acceptance_measured_request_steps[i]`` = 0): the policy still
        works from its prior there (see :class:`AcceptanceEstimator`), but a prior is not
        an estimate and is not reported as one. ``step_time_ms_by_batch`` tabulates
        T(B, K) (ms) over a grid of batch sizes and ``step_time_measured_batch`` says which
        batch sizes were measured (the capacity planner, :mod:`control.planner`, reads both).
        """
        b = batch_size or getattr(self.policy, "last_batch", 1) or 1
        r = self.acceptance.r()
        ks = range(0, self.k_engine + 1)
        acc, tm = self.acceptance, self.step_time
        e_k, d_k = self.curves(self.k_engine)
        times = tm.predict_curve(b, d_k)
        counts = list(acc.observed_request_steps[: self.k_engine])

        def measured(values: list[float]) -> list[float | None]:
            return [
                round(v, 4) if i < len(counts) and counts[i] > 0 else None
                for i, v in enumerate(values[: self.k_engine])
            ]

        e = {str(k): round(e_k[k], 4) for k in ks}
        t = {str(k): round(times[k] * 1000.0, 3) for k in ks}
        g = {str(k): round(b * e_k[k] / times[k], 2) for k in ks}
        t0, t1, td = self.step_time.coefficients3()
        return {
            "mode": self.policy.name,
            "k_current": self.k_current,
            "k_bounds": [self.policy.k_lo, self.policy.k_hi],
            "batch_size": b,
            "acceptance_rate": (self.accepted_total / self.drafted_total) if self.drafted_total else None,
            "acceptance_per_position": measured(r),
            "conditional_acceptance": measured(self.acceptance.conditional()),
            "draft_reach_per_position": measured(self.acceptance.q()),
            "acceptance_measured_request_steps": counts,
            "acceptance_changes_detected": acc.changes,
            "acceptance_by_run_state": (
                self.run_states.describe(self.k_engine) if self.run_states is not None else None
            ),
            "tokens_per_step_by_depth_served": (
                self.depth_tokens.describe() if self.depth_tokens is not None else None
            ),
            "expected_tokens_per_step": e,
            "step_time_ms": t,
            "step_time_ms_by_batch": self._step_time_table_cached(),
            "step_time_measured_batch": self.measured_batch_sizes(),
            "step_time_model": {
                "t0_ms": round(t0 * 1000, 4),
                "t1_ms_per_token": round(t1 * 1000, 5),
                "td_ms_per_draft_pass": round(td * 1000, 4) if self.step_time.draft_passes else 0.0,
                "ts_ms_per_speculative_step": 0.0 if self.step_time.draft_passes else round(td * 1000, 4),
                "draft_passes": self.step_time.draft_passes,
            },
            "predicted_goodput_tokens_per_s": g,
            "steps_at_k": list(self.steps_at_k),
            "total_steps": self.total_steps,
            "policy": self.policy.describe(),
        }
