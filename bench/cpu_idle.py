"""``python -m bench cpu-idle``: does a CPU run a burst of work at another speed after it idled?

Why: on the offline GPU hosts (KVM guests) one engine's median decode step at one request fell,
burst by burst, in two clusters about a third apart, even with the engine core's step loop pinned
to one CPU (docs/gpu.md, host 39), and bursts of different engines seconds apart hardly agreed.
Each engine idles for 1-4 s between its bursts while the others run. One candidate: where the
hypervisor runs a vCPU after the guest halted it, redrawn at every wake-up (docs/gpu.md, host 40, has
what this tool found).

What it does, on ``--cpu`` (this process pinned there): ``--bursts`` bursts of ``--burst-s`` of
a spin loop that counts its iterations (iterations/s per burst, the speed of the CPU for that
burst), each after a gap of ``--gap`` seconds (drawn uniformly between its two ends) spent in
one of the ``--modes``:

* ``sleep``: the process sleeps (the vCPU may halt, as an idle engine's would);
* ``spin``: the process spins through the gap (the vCPU never halts);
* ``idle-spinner``: the process sleeps while a child process pinned to the same CPU spins
  at the ``SCHED_IDLE`` policy throughout (it takes the CPU only when nothing else wants it:
  the vCPU never halts, and the bursts run as on a CPU of their own).

Modes alternate burst by burst in a seeded random order. Prints, per mode: bursts, median and
p10/p90 of the burst speed (M iterations/s), the share of bursts slower than 0.8 of the fastest
decile of all bursts, and writes every burst as JSON with ``--out``. Linux only.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import time
from pathlib import Path

from .cpu_spin import Spinner, spin_rate

MODES = ("sleep", "spin", "idle-spinner")


def run(cpu: int, bursts: int, burst_s: float, gap: tuple[float, float], modes: list[str], seed: int) -> list[dict]:
    """The bursts (see the module docstring): rows ``{"i", "mode", "gap_s", "per_s"}``."""
    rng = random.Random(seed)
    order = [m for _ in range(bursts) for m in modes]
    rng.shuffle(order)
    mask = os.sched_getaffinity(0)
    os.sched_setaffinity(0, {cpu})
    rows: list[dict] = []
    try:
        for i, mode in enumerate(order):
            g = rng.uniform(*gap)
            child = Spinner(cpu, idle=True) if mode == "idle-spinner" else None
            if mode == "spin":
                spin_rate(g)
            else:
                time.sleep(g)
            rate = spin_rate(burst_s)
            if child is not None:
                child.stop()
            rows.append({"i": i, "mode": mode, "gap_s": round(g, 3), "per_s": round(rate)})
            print(f"\r{i + 1}/{len(order)} bursts", end="", file=sys.stderr, flush=True)
    finally:
        os.sched_setaffinity(0, mask)
        print(file=sys.stderr)
    return rows


def summary(rows: list[dict]) -> list[dict]:
    """Per mode: bursts, median, p10, p90 (iterations/s) and the share of bursts below 0.8 of
    the fastest decile of all bursts (the slow cluster's share)."""
    allr = sorted(r["per_s"] for r in rows)
    fast = allr[int(0.9 * (len(allr) - 1))] if allr else 0
    out = []
    for mode in dict.fromkeys(r["mode"] for r in rows):
        v = sorted(r["per_s"] for r in rows if r["mode"] == mode)
        q = statistics.quantiles(v, n=10) if len(v) >= 2 else [v[0]] * 9
        out.append(
            {
                "mode": mode,
                "bursts": len(v),
                "median": statistics.median(v),
                "p10": q[0],
                "p90": q[-1],
                "slow_share": sum(x < 0.8 * fast for x in v) / len(v),
            }
        )
    return out


def _gap(text: str) -> tuple[float, float]:
    try:
        lo, _, hi = text.partition(",")
        a, b = float(lo), float(hi or lo)
    except ValueError:
        raise argparse.ArgumentTypeError(f"bad gap {text!r}: use LOW,HIGH seconds, e.g. 0.5,2") from None
    if a < 0 or b < a:
        raise argparse.ArgumentTypeError(f"bad gap {text!r}: need 0 <= LOW <= HIGH")
    return a, b


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m bench cpu-idle",
        description="Whether a CPU runs bursts of work at another speed after idling: bursts of a spin loop "
        "after gaps spent asleep, spinning, or asleep beside a SCHED_IDLE spinner on the same CPU.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--cpu", type=int, required=True, help="CPU to run on")
    p.add_argument("--bursts", type=int, default=30, help="bursts per mode")
    p.add_argument("--burst-s", type=float, default=0.3, help="length of a burst (s)")
    p.add_argument("--gap", type=_gap, default=(0.5, 2.0), help="gap before each burst, LOW,HIGH (s)")
    p.add_argument("--modes", default=",".join(MODES), help=f"comma-separated, of {', '.join(MODES)}")
    p.add_argument("--seed", type=int, default=0, help="order of the modes and the gaps")
    p.add_argument("--out", type=Path, default=None, help="write every burst and the summary as JSON here")
    args = p.parse_args(argv)
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    bad = [m for m in modes if m not in MODES]
    if bad or not modes:
        print(f"error: unknown mode(s) {bad or modes}: use {', '.join(MODES)}", file=sys.stderr)
        return 2
    if not hasattr(os, "sched_setaffinity"):
        print("error: this platform cannot set CPU affinity (Linux only)", file=sys.stderr)
        return 2
    if args.cpu not in range(os.cpu_count() or 0):
        print(f"error: no CPU {args.cpu} here (CPUs 0-{(os.cpu_count() or 1) - 1})", file=sys.stderr)
        return 2
    if args.bursts < 1 or args.burst_s <= 0:
        print("error: --bursts must be >= 1 and --burst-s > 0", file=sys.stderr)
        return 2
    rows = run(args.cpu, args.bursts, args.burst_s, args.gap, modes, args.seed)
    table = summary(rows)
    print(
        f"CPU {args.cpu}: {args.bursts} bursts of {args.burst_s:g} s per mode, gaps {args.gap[0]:g}-{args.gap[1]:g} s"
    )
    print("| gap spent | bursts | median M it/s | p10 | p90 | slow share (< 0.8 of the fastest decile) |")
    print("|---|---:|---:|---:|---:|---:|")
    for t in table:
        print(
            f"| {t['mode']} | {t['bursts']} | {t['median'] / 1e6:.2f} | {t['p10'] / 1e6:.2f} | "
            f"{t['p90'] / 1e6:.2f} | {t['slow_share']:.2f} |"
        )
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({"args": {**vars(args), "out": str(args.out)}, "summary": table, "rows": rows}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
