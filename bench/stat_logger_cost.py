"""``python -m bench stat-logger-cost``: the CPU time SpecPilot's stat logger adds to one engine step.

vLLM's API server calls every stat logger once per engine step, on the event loop that also
streams the responses (``AsyncLLM``'s output handler). SpecPilot's logger
(``engine_host.stats.SpecPilotStatLogger``) folds the step into the per-second ring behind
``/control/samples``; a full batch brings one inter-token latency per running request, so its
cost grows with the batch. Timed here, on the same synthetic steps of ``--batch`` requests
(uniform ITLs in 2-20 ms, one request in ten at its first token):

* ``SampleRing.record``: what the logger runs per step;
* the same, with the latencies counted one value at a time (``SampleRing._observe``), as the
  logger did before it counted a step's latencies at once;
* vLLM's own Prometheus histograms for the same TTFT and ITL values (``prometheus_client``
  ``Histogram.observe`` per value, on vLLM's buckets), what vLLM's ``PrometheusStatLogger`` spends
  on those two series alone: the column to read the others against.

Prints microseconds per step for each batch size. No engine is started.
"""

from __future__ import annotations

import argparse
import random
import sys
import time
import types
from collections.abc import Callable

from engine_host.sample import latency_edges
from engine_host.stats import SampleRing


def _steps(batch: int, n: int, seed: int = 0) -> list[types.SimpleNamespace]:
    """``n`` synthetic ``IterationStats``-shaped steps of ``batch`` requests."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        first = [i for i in range(batch) if rng.random() < 0.1]
        out.append(
            types.SimpleNamespace(
                finished_requests=[],
                num_generation_tokens=batch,
                num_prompt_tokens=0,
                time_to_first_tokens_iter=[rng.uniform(0.01, 0.2) for _ in first],
                inter_token_latencies_iter=[rng.uniform(0.002, 0.02) for _ in range(batch - len(first))],
            )
        )
    return out


def _time(fn: Callable[[types.SimpleNamespace], None], steps: list[types.SimpleNamespace], repeat: int) -> float:
    """Best of ``repeat`` passes over ``steps``: µs per step."""
    best = float("inf")
    for _ in range(repeat):
        t0 = time.perf_counter()
        for s in steps:
            fn(s)
        best = min(best, (time.perf_counter() - t0) / len(steps))
    return best * 1e6


class _OneByOne(SampleRing):
    """The ring as it was before it counted a step's latencies at once: one bucket lookup and
    two dict updates a value."""

    def _observe_many(self, kind: str, values: list[float], skip=()) -> None:  # type: ignore[override]
        for i, v in enumerate(values):
            if i not in skip:
                self._observe(kind, v)


def measure(batch: int, steps: int = 2000, repeat: int = 5) -> dict[str, float]:
    """µs per step (float) of the three paths (module doc) at ``batch`` running requests."""
    from prometheus_client import CollectorRegistry, Histogram

    work = _steps(batch, steps)
    sched = types.SimpleNamespace(
        num_running_reqs=batch, num_waiting_reqs=0, kv_cache_usage=0.1, spec_decoding_stats=None
    )
    ring = SampleRing()
    one = _OneByOne()
    reg = CollectorRegistry()
    ttft = Histogram("bench_ttft_seconds", "TTFT", buckets=latency_edges("ttft"), registry=reg)
    itl = Histogram("bench_itl_seconds", "ITL", buckets=latency_edges("itl"), registry=reg)

    def prometheus(s: types.SimpleNamespace) -> None:
        for v in s.time_to_first_tokens_iter:
            ttft.observe(v)
        for v in s.inter_token_latencies_iter:
            itl.observe(v)

    return {
        "record": _time(lambda s: ring.record(sched, s), work, repeat),
        "one_by_one": _time(lambda s: one.record(sched, s), work, repeat),
        "vllm_prometheus": _time(prometheus, work, repeat),
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m bench stat-logger-cost",
        description=__doc__.split("\n\n")[0].split(": ", 1)[1],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    ap.add_argument("--batch", default="1,8,64", help="running requests per step, comma-separated")
    ap.add_argument("--steps", type=int, default=2000, help="synthetic steps per pass")
    ap.add_argument("--repeat", type=int, default=5, help="passes; the fastest counts")
    args = ap.parse_args(argv)
    try:
        batches = [int(b) for b in args.batch.split(",")]
        if any(b < 1 for b in batches) or args.steps < 1 or args.repeat < 1:
            raise ValueError
    except ValueError:
        print(f"--batch needs positive integers (got {args.batch!r}); --steps, --repeat >= 1", file=sys.stderr)
        return 2
    print(
        "| running requests | SpecPilot stat logger, µs/step | the same, one value at a time | "
        "vLLM's TTFT and ITL histograms, µs/step | logger / vLLM's histograms |"
    )
    print("|---:|---:|---:|---:|---:|")
    for b in batches:
        r = measure(b, args.steps, args.repeat)
        print(
            f"| {b} | {r['record']:.1f} | {r['one_by_one']:.1f} | {r['vllm_prometheus']:.1f} | "
            f"{r['record'] / r['vllm_prometheus']:.2f} |"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
