"""``python -m bench step-time-replay``: what the step-time model priced a depth at, replayed over a step trace.

Feeds the rows of a step trace (``engine_host.step_trace``) to
:class:`engine_host.controller.StepTimeModel`, one by one, as the scheduler hook feeds it:

* only pure-decode steps (every request in the step decoded), and at one request only
  those past the request's first decode steps (``engine_host.step_clock.DecodeStretch``);
* a step's time by the hook's step clock (``engine_host.step_clock``): its output minus the
  later of its own ``schedule()`` and the previous step's output;
* the tokens it verified, the K its drafts were proposed at and the K it proposed at.

After each pure-decode step at batch B, it reads the premium the model prices for depth K
over K = 0 at that batch: ``T(B, K) / T(B, 0)``, each at the tokens of the model's cell for
that depth (B * (1 + K) before there is one). Only steps at B are sampled, because that is
when the adaptive controller prices B.

The measured premium is taken from the same trace: the median wall time of a pure-decode
step at K over one at K = 0, each right after another pure-decode step of the same batch
(``bench step-trace``'s busy intervals), and the same with mean times. Throughput follows the
mean (the time of N steps is N times the mean step), and the model's cells are means too; the
median shows what a typical step costs, without the slow tail.

Prints, per batch size and K with at least ``--min-steps`` measured steps:
* the measured premium, of medians and of means;
* the priced premium's 10th, 50th and 90th percentiles over the replay;
* the share of samples within ``--tolerance`` of the measured premium of means.

The model is built as the engine host's controller builds it (:data:`ENGINE_MODEL_ARGS`).
With ``--set KEY=VALUE`` (repeatable: constructor arguments of ``StepTimeModel``, ``none`` for
None) a second model with those arguments over the engine's is replayed beside it, so that two
settings can be compared on one recorded trace without a GPU; ``--set premium_window_s=none
--set premium_first=false`` is the model before 2026-11-28's seventh stop, and ``--set
premium_borrow=false`` the one before 2026-11-29's second.

Example::

    python -m bench step-time-replay R/steps.csv.1234 --batches 1,8 --set alpha=0.05
"""

from __future__ import annotations

import argparse
import statistics
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

from engine_host.controller import SpeculationController, StepTimeModel, batch_bucket
from engine_host.step_clock import DecodeStretch, StepClock

from .step_trace import Step, busy_intervals, read_trace


@dataclass(frozen=True)
class PremiumRow:
    """One (batch, K) row of a replay: the measured premium and the priced ones.

    ``measured``: median ms at K over median ms at K = 0 (ratio); ``measured_mean``: the
    same of means; ``priced``: the model's ``T(B, K) / T(B, 0)`` at every sampled step
    (ratios, in replay order).
    """

    batch: int
    k: int
    measured: float
    steps_k: int
    steps_0: int
    priced: tuple[float, ...]
    measured_mean: float = float("nan")

    def quantile(self, q: float) -> float:
        """The ``q`` (0..1) quantile of the priced premiums (nearest rank); NaN if none."""
        if not self.priced:
            return float("nan")
        v = sorted(self.priced)
        return v[min(len(v) - 1, max(0, int(q * len(v))))]

    def within(self, tolerance: float) -> float:
        """Share (0..1) of the priced premiums within ``tolerance`` (ratio points) of the
        measured premium of means (:attr:`measured_mean`: the model's cells are means, and
        throughput follows the mean step); NaN if none were sampled."""
        if not self.priced:
            return float("nan")
        return sum(abs(p - self.measured_mean) <= tolerance for p in self.priced) / len(self.priced)


def measured_premiums(
    steps: Sequence[Step], batches: Sequence[int], k_max: int, max_gap_s: float = 0.05
) -> dict[tuple[int, int], tuple[float, int, int, float]]:
    """``{(batch, K): (premium, steps at K, steps at K = 0, premium of means)}`` for K =
    1..``k_max`` at each batch with steps at both: the median output-to-output interval of a
    pure-decode step at K over one at K = 0, each after another pure-decode step of the same
    batch, and the mean interval at K over the mean at K = 0."""
    by: dict[tuple[int, int], list[float]] = {}
    for iv in busy_intervals(steps, max_gap_s):
        if iv.requests in batches and iv.k_drafted == iv.k_proposed:
            by.setdefault((iv.requests, iv.k_drafted), []).append(iv.seconds)
    out: dict[tuple[int, int], tuple[float, int, int, float]] = {}
    for b in batches:
        base = by.get((b, 0))
        for k in range(1, k_max + 1):
            at_k = by.get((b, k))
            if base and at_k:
                out[(b, k)] = (
                    statistics.median(at_k) / statistics.median(base),
                    len(at_k),
                    len(base),
                    statistics.fmean(at_k) / statistics.fmean(base),
                )
    return out


def replay(
    steps: Sequence[Step], batches: Sequence[int], k_max: int, **model_args: Any
) -> dict[tuple[int, int], list[float]]:
    """Replay ``steps`` through a fresh :class:`StepTimeModel` as the engine host builds it
    (:data:`ENGINE_MODEL_ARGS`; ``model_args``: constructor arguments over those) and return
    ``{(batch, K): [priced premium per sampled step]}`` for K = 1..``k_max`` at each of
    ``batches`` (see the module docstring).

    Raises:
        TypeError: an unknown model argument.
    """
    model = StepTimeModel(**{**ENGINE_MODEL_ARGS, **model_args})
    priced: dict[tuple[int, int], list[float]] = {(b, k): [] for b in batches for k in range(1, k_max + 1)}
    wanted = set(batches)
    clock, stretch = StepClock(), DecodeStretch()
    for s in steps:
        clock.scheduled(s.t_scheduled, s.k_drafted, s.k_proposed)
        step_time, _ = clock.output(s.t_output)
        teaches = stretch.teaches(s.decode, s.requests > 0 and s.decode == s.requests)
        if not teaches or step_time <= 0:
            continue
        model.observe(s.requests, max(s.tokens, s.requests), step_time, s.k_drafted, s.k_proposed, s.t_output)
        if s.requests not in wanted:
            continue
        b = s.requests
        plain = model.predict_tokens(b, float(b), 0)
        bucket = batch_bucket(b)
        for k in range(1, k_max + 1):
            cell = model.cells.get((bucket, k))
            x = cell[3] if cell is not None else b * (1.0 + k)
            priced[(b, k)].append(model.predict_tokens(b, x, k) / plain)
    return priced


#: The arguments the engine host's controller builds its step-time model with
#: (``engine_host.controller.SpeculationController``), beyond the class's defaults.
ENGINE_MODEL_ARGS: dict[str, Any] = {
    "premium_window_s": SpeculationController.PREMIUM_WINDOW_S,
    "premium_first": True,
    "premium_borrow": True,
}


def _parse_value(text: str) -> Any:
    low = text.lower()
    if low in ("true", "false"):
        return low == "true"
    if low == "none":
        return None
    for cast in (int, float):
        try:
            return cast(text)
        except ValueError:
            pass
    return text


def rows(
    steps: Sequence[Step],
    batches: Sequence[int],
    k_max: int,
    min_steps: int = 20,
    max_gap_s: float = 0.05,
    **model_args: Any,
) -> list[PremiumRow]:
    """:class:`PremiumRow` per (batch, K) with at least ``min_steps`` measured steps at
    both K and K = 0, from one replay with ``model_args``; measured steps are intervals of
    at most ``max_gap_s`` (s)."""
    measured = measured_premiums(steps, batches, k_max, max_gap_s)
    priced = replay(steps, batches, k_max, **model_args)
    return [
        PremiumRow(b, k, m, nk, n0, tuple(priced[(b, k)]), mm)
        for (b, k), (m, nk, n0, mm) in sorted(measured.items())
        if nk >= min_steps and n0 >= min_steps
    ]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m bench step-time-replay",
        description=__doc__.split("\n\n")[0] if __doc__ else None,
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    ap.add_argument("files", nargs="+", help="trace files ($SPECPILOT_STEP_TRACE.PID), each replayed on its own")
    ap.add_argument("--batches", default="1,8,64", help="comma-separated batch sizes (requests) to price")
    ap.add_argument("--k-max", type=int, default=4, help="deepest K (tokens) to price")
    ap.add_argument("--min-steps", type=int, default=20, help="rows with fewer measured steps are left out")
    ap.add_argument("--tolerance", type=float, default=0.10, help="'within' counts priced premiums this close (ratio)")
    ap.add_argument(
        "--max-gap-ms",
        type=float,
        default=50.0,
        help="measured steps: longer output-to-output intervals are idle spells (a CPU step takes 50-100 ms: 400)",
    )
    ap.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="a StepTimeModel argument for a second model replayed beside the default one",
    )
    args = ap.parse_args(argv)
    try:
        batches = [int(b) for b in args.batches.split(",") if b.strip()]
    except ValueError:
        ap.error(f"--batches: not a list of integers: {args.batches!r}")
    if not batches or min(batches) < 1 or args.k_max < 1:
        ap.error("--batches needs batch sizes >= 1 and --k-max >= 1")
    variant: dict[str, Any] = {}
    for item in args.set:
        key, sep, value = item.partition("=")
        if not sep or not key:
            ap.error(f"--set {item!r}: expected KEY=VALUE")
        variant[key] = _parse_value(value)
    try:
        StepTimeModel(**{**ENGINE_MODEL_ARGS, **variant})
    except (TypeError, ValueError) as exc:
        ap.error(f"--set: {exc}")
    label = ", ".join(f"{k}={v}" for k, v in variant.items())
    for f in args.files:
        try:
            steps = read_trace(f)
        except (OSError, ValueError) as exc:
            ap.error(str(exc))
        print(f"## {Path(f).name}: {len(steps)} steps\n")
        header = "| batch, K | measured: medians, means (steps at K / K = 0) | engine: p10 / p50 / p90, within |"
        sep = "|---|---|---|"
        if variant:
            header += f" {label}: p10 / p50 / p90, within |"
            sep += "---|"
        print(header + "\n" + sep)
        gap = args.max_gap_ms / 1e3
        base = rows(steps, batches, args.k_max, args.min_steps, gap)
        other = rows(steps, batches, args.k_max, args.min_steps, gap, **variant) if variant else []
        for i, r in enumerate(base):
            cells = [
                f"{r.batch}, {r.k}",
                f"{r.measured:.3f}, {r.measured_mean:.3f} ({r.steps_k} / {r.steps_0})",
                _summary(r, args.tolerance),
            ]
            if variant:
                cells.append(_summary(other[i], args.tolerance))
            print("| " + " | ".join(cells) + " |")
        if not base:
            print(f"(no batch of {args.batches} has {args.min_steps} measured steps at K = 0 and at a K > 0)")
        print()
    return 0


def _summary(r: PremiumRow, tolerance: float) -> str:
    if not r.priced:
        return "- (not sampled)"
    return f"{r.quantile(0.1):.3f} / {r.quantile(0.5):.3f} / {r.quantile(0.9):.3f}, {r.within(tolerance):.0%}"


if __name__ == "__main__":
    raise SystemExit(main())
