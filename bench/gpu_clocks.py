"""``python -m bench gpu-clocks``: the GPU's clocks, power and load sampled on the host's
monotonic clock, for reading beside step traces.

Why: on the offline GPU hosts one engine's median decode step moved burst by burst between
two clusters (docs/gpu.md, hosts 36-37) in every engine alike, and neither the CPU the engine
core ran on nor the engine explained it. A GPU that lowers its clocks while idle between an
arm's bursts and raises them again during the next is one candidate; this sampler records what
the GPU reports so that ``python -m bench step-trace TRACE --gpu-clocks FILE`` can read each
burst's median step against the clocks during it.

Writes CSV rows ``t_s,sm_mhz,mem_mhz,power_w,temp_c,util_pct,pstate`` (``t_s``:
``time.perf_counter()``, the host's monotonic clock that the engine cores' step traces use; MHz;
W; degrees C; percent 0..100; P-state number, 0 fastest) every ``--interval-ms`` until stopped
(SIGTERM or SIGINT) or its parent process ends, flushed each second. Reads NVML through the copy vLLM ships
(``vllm.third_party.pynvml``), or ``pynvml`` where that is installed. It only reads: no clock or
power setting is changed.
"""

from __future__ import annotations

import argparse
import csv
import lzma
import os
import signal
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

FIELDS = ("t_s", "sm_mhz", "mem_mhz", "power_w", "temp_c", "util_pct", "pstate")


@dataclass(frozen=True)
class ClockSample:
    """One sample: ``t`` (s, ``time.perf_counter()``), the SM and memory clocks (MHz), board
    power (W), temperature (degrees C), GPU utilisation (percent 0..100) and P-state (0 fastest)."""

    t: float
    sm_mhz: float
    mem_mhz: float
    power_w: float
    temp_c: float
    util_pct: float
    pstate: int


def _nvml() -> Any:
    """The NVML bindings: vLLM's copy first, then ``pynvml``.

    Raises:
        RuntimeError: neither is importable.
    """
    try:
        from vllm.third_party import pynvml  # type: ignore[import-not-found,unused-ignore]

        return pynvml
    except ImportError:
        pass
    try:
        import pynvml  # type: ignore[import-not-found,unused-ignore]

        return pynvml
    except ImportError as exc:
        raise RuntimeError("no NVML bindings: install vLLM's CUDA build or nvidia-ml-py") from exc


def read_clocks(path: str | Path) -> list[ClockSample]:
    """The samples of a file written by :func:`main`, in time order (``.xz``: compressed, as
    ``scripts/gpu/paired_table.sh`` leaves it).

    Raises:
        OSError: the file cannot be read.
        ValueError: it is not such a file (its header lacks a column of :data:`FIELDS`).
    """
    opener = lzma.open if str(path).endswith(".xz") else open
    with opener(path, "rt", newline="", encoding="utf-8") as f:
        reader = csv.DictReader(f)
        missing = [c for c in FIELDS if c not in (reader.fieldnames or [])]
        if missing:
            raise ValueError(f"{path}: not a GPU clock file (no column {', '.join(missing)})")
        out = []
        for row in reader:
            try:
                out.append(
                    ClockSample(
                        float(row["t_s"]),
                        float(row["sm_mhz"]),
                        float(row["mem_mhz"]),
                        float(row["power_w"]),
                        float(row["temp_c"]),
                        float(row["util_pct"]),
                        int(row["pstate"]),
                    )
                )
            except (TypeError, ValueError):
                continue  # a row cut short when the sampler was stopped
    out.sort(key=lambda s: s.t)
    return out


def sample(nvml: Any, handle: Any) -> ClockSample:
    """One :class:`ClockSample` of the GPU ``handle`` now."""
    util = nvml.nvmlDeviceGetUtilizationRates(handle)
    return ClockSample(
        time.perf_counter(),
        float(nvml.nvmlDeviceGetClockInfo(handle, nvml.NVML_CLOCK_SM)),
        float(nvml.nvmlDeviceGetClockInfo(handle, nvml.NVML_CLOCK_MEM)),
        nvml.nvmlDeviceGetPowerUsage(handle) / 1e3,
        float(nvml.nvmlDeviceGetTemperature(handle, nvml.NVML_TEMPERATURE_GPU)),
        float(util.gpu),
        int(nvml.nvmlDeviceGetPerformanceState(handle)),
    )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m bench gpu-clocks",
        description=__doc__.split("\n\n")[0] if __doc__ else None,
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    ap.add_argument("--out", required=True, help="the CSV file to write")
    ap.add_argument("--interval-ms", type=float, default=100.0, help="time between samples, ms (>= 10)")
    ap.add_argument("--device", type=int, default=0, help="the GPU's NVML index")
    ap.add_argument("--seconds", type=float, default=0.0, help="stop after this long (0: when signalled)")
    args = ap.parse_args(argv)
    if args.interval_ms < 10:
        ap.error("--interval-ms must be >= 10")
    try:
        nvml = _nvml()
        nvml.nvmlInit()
        handle = nvml.nvmlDeviceGetHandleByIndex(args.device)
    except Exception as exc:  # NVMLError has no common base outside the bindings
        print(f"error: cannot read the GPU through NVML: {exc}", file=sys.stderr)
        return 2
    stop = False

    def _stop(*_: Any) -> None:
        nonlocal stop
        stop = True

    before = {sig: signal.signal(sig, _stop) for sig in (signal.SIGTERM, signal.SIGINT)}
    end = time.perf_counter() + args.seconds if args.seconds > 0 else float("inf")
    parent = os.getppid()  # the sampler does not outlive the run that started it
    period = args.interval_ms / 1e3
    try:
        with open(args.out, "w", newline="") as f:
            w = csv.writer(f)
            w.writerow(FIELDS)
            flushed = time.perf_counter()
            while not stop and time.perf_counter() < end and os.getppid() == parent:
                s = sample(nvml, handle)
                w.writerow(
                    (
                        f"{s.t:.6f}",
                        f"{s.sm_mhz:.0f}",
                        f"{s.mem_mhz:.0f}",
                        f"{s.power_w:.1f}",
                        f"{s.temp_c:.0f}",
                        f"{s.util_pct:.0f}",
                        s.pstate,
                    )
                )
                if s.t - flushed >= 1.0:
                    f.flush()
                    flushed = s.t
                time.sleep(max(period - (time.perf_counter() - s.t), 0.0))
    finally:
        for sig, handler in before.items():
            signal.signal(sig, handler)
    nvml.nvmlShutdown()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
