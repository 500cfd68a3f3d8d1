"""``python -m bench cpu-pairs``: which of the host's CPUs slow each other down.

Why: on the offline GPU hosts (KVM guests that report one thread per core) the median step of
one request moved burst by burst between two clusters about a third apart, in every engine
alike (docs/gpu.md, hosts 36-38). A step of a small model at one request is bound by the
engine core's CPU work, so a busy thread on a CPU that shares a physical core with the engine
core's (a hyperthread sibling that the guest cannot see) is one candidate; pinning the step
loop (``python -m engine_host --core-cpu N``) only helps if nothing busy runs beside it.

For each CPU ``i`` of ``--cpus``: a spin loop pinned to ``i`` counts its iterations for
half of ``--seconds`` alone and then ``--seconds`` beside a busy process pinned to another CPU
``j``, ``--repeat`` times for every ``j`` in turn; ``slowdown`` = alone rate / rate with ``j`` busy, the median over
the repeats (1.0: independent; a hyperthread sibling typically 1.2-1.6; one measurement alone
can catch the CPU at another clock, hence the repeats). Prints a table, and writes JSON with ``--out``:
``{"cpus": [...], "rows": [{"cpu", "busy", "slowdown"}, ...], "siblings": {cpu: [busy CPUs
at or above --threshold]}, "reported_siblings": {cpu: "thread_siblings_list"}}``.
Linux only (CPU affinity).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from tqdm import tqdm

from .cpu_spin import Spinner, spin_rate


def reported_siblings(cpu: int) -> str | None:
    """The kernel's ``thread_siblings_list`` of ``cpu`` (what the guest is told), or None."""
    try:
        return Path(f"/sys/devices/system/cpu/cpu{cpu}/topology/thread_siblings_list").read_text().strip()
    except OSError:
        return None


def measure(
    cpus: list[int], others: list[int], seconds: float, repeat: int = 3, progress: bool = True
) -> list[dict[str, Any]]:
    """Slowdown of a spin loop on each CPU of ``cpus`` while each CPU of ``others`` (itself
    left out) runs a busy process, ``repeat`` times alternately alone and beside it. Runs in
    a thread pinned in turn to each CPU; restores its mask afterwards.

    Returns:
        Rows ``{"cpu", "busy", "slowdown", "alone_per_s"}`` (slowdown: the median over the
        repeats of the rate alone over the rate beside the busy CPU right after;
        alone_per_s: the median rate alone, iterations/s).
    """
    mask = os.sched_getaffinity(0)
    rows: list[dict[str, Any]] = []
    total = sum(1 for i in cpus for j in others if j != i)
    bar = tqdm(total=total, desc="CPU pairs", disable=not progress, file=sys.stderr)
    try:
        for i in cpus:
            os.sched_setaffinity(0, {i})
            spin_rate(seconds)  # settle on the CPU
            for j in others:
                if j == i:
                    continue
                spinner = Spinner(j, busy=False)
                ratios, alones = [], []
                for _ in range(repeat):  # alone, then beside the busy CPU, as the clocks are now
                    alone = spin_rate(seconds / 2)
                    spinner.go.set()
                    time.sleep(0.01)
                    ratios.append(alone / spin_rate(seconds))
                    spinner.go.clear()
                    time.sleep(0.01)
                    alones.append(alone)
                spinner.stop()
                rows.append(
                    {
                        "cpu": i,
                        "busy": j,
                        "slowdown": round(statistics.median(ratios), 3),
                        "alone_per_s": round(statistics.median(alones)),
                    }
                )
                bar.update()
    finally:
        os.sched_setaffinity(0, mask)
        bar.close()
    return rows


def siblings(rows: list[dict[str, Any]], threshold: float) -> dict[int, list[int]]:
    """For each measured CPU, the busy CPUs that slowed it by ``threshold`` or more."""
    out: dict[int, list[int]] = {}
    for r in rows:
        out.setdefault(r["cpu"], [])
        if r["slowdown"] >= threshold:
            out[r["cpu"]].append(r["busy"])
    return out


def _cpu_list(text: str) -> list[int]:
    """``13,15`` -> [13, 15] (comma-separated CPU indices)."""
    try:
        return [int(t) for t in text.split(",") if t.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"bad CPU list {text!r}: use comma-separated indices, e.g. 13,15") from None


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m bench cpu-pairs",
        description="Which CPUs slow each other down (hyperthread siblings a hypervisor hides): a spin loop on "
        "each CPU of --cpus, alone and beside a busy process on every other CPU.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--cpus", type=_cpu_list, default=None, help="CPUs to measure (default: every CPU allowed)")
    p.add_argument("--seconds", type=float, default=0.2, help="length of one measurement beside a busy CPU (s)")
    p.add_argument("--repeat", type=int, default=3, help="measurements per pair (the median is kept)")
    p.add_argument("--threshold", type=float, default=1.15, help="slowdown at which a busy CPU counts as a sibling")
    p.add_argument("--out", type=Path, default=None, help="write the rows and siblings as JSON here")
    args = p.parse_args(argv)
    if not hasattr(os, "sched_setaffinity"):
        print("error: this platform cannot set CPU affinity (Linux only)", file=sys.stderr)
        return 2
    allowed = sorted(os.sched_getaffinity(0))
    cpus = args.cpus if args.cpus is not None else allowed
    online = set(range(os.cpu_count() or 0))
    bad = [c for c in cpus if c not in online]
    if bad:
        print(f"error: no such CPU here: {bad} (CPUs 0-{max(online)})", file=sys.stderr)
        return 2
    others = sorted(online)
    if args.repeat < 1 or args.seconds <= 0:
        print("error: --repeat must be >= 1 and --seconds > 0", file=sys.stderr)
        return 2
    rows = measure(cpus, others, args.seconds, args.repeat)
    sib = siblings(rows, args.threshold)
    print(f"| CPU | alone (M it/s) | slowest beside | slowdown | siblings (>= {args.threshold:.2f}) | kernel says |")
    print("|---:|---:|---:|---:|---|---|")
    for c in cpus:
        mine = [r for r in rows if r["cpu"] == c]
        worst = max(mine, key=lambda r: r["slowdown"])
        print(
            f"| {c} | {worst['alone_per_s'] / 1e6:.2f} | {worst['busy']} | {worst['slowdown']:.3f} | "
            f"{','.join(map(str, sib[c])) or '-'} | {reported_siblings(c) or '?'} |"
        )
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        doc = {
            "cpus": cpus,
            "repeat": args.repeat,
            "threshold": args.threshold,
            "seconds": args.seconds,
            "rows": rows,
            "siblings": {str(k): v for k, v in sib.items()},
            "reported_siblings": {str(c): reported_siblings(c) for c in cpus},
        }
        args.out.write_text(json.dumps(doc, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
