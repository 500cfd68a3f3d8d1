"""Store benchmark: 7 days of 1 s samples for 4 hosts, written and downsampled the way the
collector does it, then the store's size and the time to load chart series.

    python -m bench store                       # SQLite in a temporary folder
    python -m bench store --db postgresql+psycopg://user@host/db
    python -m bench store --days 1 --hosts 2    # quicker

Per simulated hour and host, 3600 one-second rows go in (one transaction, as the
collector's per-second writes would add up to), then :func:`control.samples.downsample`
runs with the simulated clock (1 s rows kept for an hour, 60 s roll-ups for 30 days,
3600 s beyond). Printed: rows per resolution, store size (bytes), write and downsampling
time, and the median time to load chart series (7 days of one host at the automatic
resolution, 1 hour at 1 s, 7 days of the fleet). Target: a 7-day series in < 200 ms.
Figures only; nothing is asserted.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import statistics
import tempfile
import time
from pathlib import Path

from sqlalchemy import func, select, text

from control.fleet import fleet_series
from control.models import MetricSample
from control.samples import downsample, insert_samples, series
from control.store import Store, add_host
from tests.support import synthetic_sample

CHART = [
    "output_tokens_per_s",
    "ttft_p50_ms",
    "ttft_p99_ms",
    "itl_p99_ms",
    "kv_cache_usage",
    "running",
    "acceptance_rate",
    "k",
]


def simulate_hour(rng: random.Random, start: int, host_index: int) -> list[dict]:
    """3600 plausible 1 s rows: a daily traffic cycle, idle stretches, K and acceptance moving."""
    rows = []
    for i in range(3600):
        t = start + i
        day_phase = math.sin(2 * math.pi * ((t % 86400) / 86400.0))
        busy = rng.random() < 0.55 + 0.4 * day_phase
        k = float(rng.choice((0, 2, 4, 4, 6)))
        rows.append(
            synthetic_sample(
                t,
                busy=busy,
                tokens_per_s=max(5.0, 120 + 80 * day_phase + rng.gauss(0, 15) + 10 * host_index),
                k=k,
                kv_cache_usage=min(1.0, max(0.0, 0.35 + 0.3 * day_phase + rng.gauss(0, 0.05))),
                ttft_s=max(0.005, rng.lognormvariate(-3.0, 0.6)),
                itl_s=max(0.002, rng.lognormvariate(-4.0, 0.3)),
                queue_s=max(0.0, rng.lognormvariate(-6.0, 1.0)),
                acceptance=min(0.95, max(0.05, rng.gauss(0.6, 0.1))),
                requests=float(rng.randint(1, 4)),
                running=float(rng.randint(1, 8)),
                waiting=float(rng.randint(0, 2)),
            )
        )
    return rows


def store_size(store: Store, url: str) -> int:
    """Bytes on disk: SQLite file after a WAL checkpoint, or pg_database_size."""
    if store.dialect == "sqlite":
        with store.engine.connect() as c:
            c.exec_driver_sql("PRAGMA wal_checkpoint(TRUNCATE)")
        path = Path(store.engine.url.database)
        return sum(p.stat().st_size for p in (path, Path(f"{path}-wal")) if p.exists())
    with store.engine.connect() as c:
        return int(c.execute(text("SELECT pg_database_size(current_database())")).scalar())


def timed(fn, repeat: int = 7) -> tuple[float, object]:
    """Median wall time (ms) of ``fn()`` over ``repeat`` runs, and its last result."""
    times, out = [], None
    for _ in range(repeat):
        t0 = time.perf_counter()
        out = fn()
        times.append((time.perf_counter() - t0) * 1000.0)
    return statistics.median(times), out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench store", description=__doc__.split("\n\n")[0])
    p.add_argument("--db", default=None, help="store URL (default: SQLite in a temporary folder)")
    p.add_argument("--days", type=float, default=7.0)
    p.add_argument("--hosts", type=int, default=4)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default=None, help="also write the figures to this file")
    args = p.parse_args(argv)

    tmp = tempfile.TemporaryDirectory(prefix="specpilot-bench-store-")
    url = args.db or f"sqlite:///{Path(tmp.name) / 'bench.db'}"
    store = Store.open(url)
    rng = random.Random(args.seed)
    now = int(time.time() // 3600) * 3600
    hours = int(args.days * 24)
    start = now - hours * 3600
    hosts = [add_host(store, f"gpu{i}", f"http://10.0.0.{i + 1}:8000", usd_per_hour=2.0) for i in range(args.hosts)]
    write_s = down_s = 0.0
    t_all = time.perf_counter()
    for h in range(hours):
        hour_start = start + h * 3600
        for i, host in enumerate(hosts):
            rows = simulate_hour(rng, hour_start, i)
            t0 = time.perf_counter()
            insert_samples(store, host.id, rows)
            write_s += time.perf_counter() - t0
        t0 = time.perf_counter()
        downsample(store, now=hour_start + 3600 + 5)
        down_s += time.perf_counter() - t0
        if h % 24 == 23:
            print(f"  simulated {(h + 1) / 24:.0f} day(s) ({time.perf_counter() - t_all:.0f} s)", flush=True)
    with store.reader() as s:
        counts = dict(
            s.execute(select(MetricSample.resolution_s, func.count()).group_by(MetricSample.resolution_s)).all()
        )
    size = store_size(store, url)
    end = now
    week_ms, week = timed(lambda: series(store, "gpu0", CHART, end - 7 * 86400, end))
    hour_ms, hour = timed(lambda: series(store, "gpu0", CHART, end - 3600, end, resolution_s=1))
    fleet_ms, fleet = timed(
        lambda: fleet_series(store, ["output_tokens_per_s", "ttft_p99_ms"], end - 7 * 86400, end), repeat=3
    )
    figures = {
        "backend": store.dialect,
        "days": args.days,
        "hosts": args.hosts,
        "samples_simulated": hours * 3600 * args.hosts,
        "rows": {f"{r}s": n for r, n in sorted(counts.items())},
        "store_bytes": size,
        "store_mib": round(size / 2**20, 1),
        "write_s": round(write_s, 1),
        "downsample_s": round(down_s, 1),
        "series_7d_one_host_ms": round(week_ms, 1),
        "series_7d_points": len(week["t"]),
        "series_7d_resolution_s": week["resolution_s"],
        "series_1h_one_host_ms": round(hour_ms, 1),
        "series_1h_points": len(hour["t"]),
        "series_7d_fleet_ms": round(fleet_ms, 1),
        "series_7d_fleet_points": len(fleet["t"]),
    }
    print(json.dumps(figures, indent=2))
    print(
        f"7-day chart series: {week_ms:.1f} ms for {len(week['t'])} points at {week['resolution_s']} s "
        f"(target < 200 ms: {'met' if week_ms < 200 else 'NOT met'}); store {figures['store_mib']} MiB"
    )
    if args.json:
        Path(args.json).write_text(json.dumps(figures, indent=2))
    store.close()
    tmp.cleanup()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
