"""Fleet scale: the embedded collector against Prometheus, with N stand-in engine hosts.

For each N (default 1, 10, 50, 200) this starts N stand-in engine hosts serving
realistic ``/metrics`` (``control.testing.FakeEngineHost``, every series the collector
reads, moving every second), then, side by side in one run:

* embedded: ``python -m control collect`` (the collector daemon, a separate process)
  scraping all N every second into a fresh SQLite store for ``--seconds`` s: its CPU
  (% of one core, from /proc), whether it kept up (1 s samples written / expected), and
  the store's growth (bytes per 1 s sample row, hence per host-day with the default
  retention: 1 440 minute roll-ups and 24 hour roll-ups a day, plus the last hour of
  1 s rows held);
* prometheus: a real Prometheus (Debian's package) scraping the same N every second for
  the same time: its CPU (% of one core), samples appended per second, and its
  write-ahead log growth per host-day (an upper bound of its disk use: blocks are
  compressed further);
* pages (``--pages``): the Fleet and Live pages rendered (Streamlit's AppTest, the page
  script on the server) with 7 days of stored samples for N hosts, median of
  ``--repeats`` renders after the first.

    python -m bench fleet [--hosts 1,10,50,200] [--seconds 20] [--pages 1,10,50] [--json FILE]

Timings on a shared machine are noisy: compare the columns of one run.
"""

from __future__ import annotations

import json
import os
import signal
import sqlite3
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from engine_host import envs

ROOT = Path(__file__).resolve().parent.parent


def cpu_seconds(pid: int) -> float:
    """User + system CPU time (s) of a process so far (Linux ``/proc/PID/stat``)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _dir_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


class StandIns:
    """N stand-in engine hosts, each serving one request a second (tokens, latencies,
    drafts move in /metrics)."""

    def __init__(self, n: int):
        from control.testing import FakeEngineHost

        self.fakes = [FakeEngineHost(token="bench-fleet-token").start() for _ in range(n)]
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._feed, daemon=True)
        self._thread.start()

    def _feed(self) -> None:
        while not self._stop.wait(1.0):
            for f in self.fakes:
                f.metrics.serve(requests=1, output_tokens=60, drafts=20, draft_tokens=40, accepted=25,
                                accepted_per_pos=[15, 10])

    def stop(self) -> None:
        self._stop.set()
        for f in self.fakes:
            f.stop()


def embedded(standins: StandIns, seconds: float, warm_s: float = 6.0) -> dict[str, Any]:
    """The collector daemon over the stand-ins: CPU, samples kept up, store growth."""
    from control.store import Store, add_host

    home = Path(tempfile.mkdtemp(prefix="specpilot-bench-fleet-"))
    db = home / "specpilot.db"
    url = f"sqlite:///{db}"
    with Store.open(url) as store:
        for i, f in enumerate(standins.fakes):
            add_host(store, f"host-{i:03d}", f.url)
    env = {**os.environ, "PYTHONPATH": str(ROOT), "SPECPILOT_CONTROL_TOKEN": "bench-fleet-token",
           "SPECPILOT_HOME": str(home)}
    proc = subprocess.Popen([sys.executable, "-m", "control", "--db", url, "collect"], cwd=ROOT, env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)

    def rows() -> int:
        with sqlite3.connect(db) as c:
            return c.execute("select count(*) from metric_samples where resolution_s = 1").fetchone()[0]

    def size() -> int:  # pages in use after a checkpoint (the WAL folded in), in bytes
        with sqlite3.connect(db) as c:
            c.execute("pragma wal_checkpoint(truncate)")
            pages, free, page = (c.execute(f"pragma {p}").fetchone()[0] for p in
                                 ("page_count", "freelist_count", "page_size"))
        return (pages - free) * page

    try:
        time.sleep(warm_s)
        c0, r0, s0, t0 = cpu_seconds(proc.pid), rows(), size(), time.monotonic()
        time.sleep(seconds)
        c1, r1, s1, t1 = cpu_seconds(proc.pid), rows(), size(), time.monotonic()
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    n = len(standins.fakes)
    span = t1 - t0
    written = r1 - r0
    bytes_per_row = (s1 - s0) / written if written else None
    return {
        "cpu_pct_of_one_core": round(100 * (c1 - c0) / span, 1),
        "samples_per_s": round(written / span, 1), "kept_up_frac": round(written / (n * span), 3),
        "bytes_per_sample_row": None if bytes_per_row is None else round(bytes_per_row),
        "store_mb_per_host_day": None if bytes_per_row is None else round(bytes_per_row * (1440 + 24) / 1e6, 3),
        "raw_hour_mb_per_host": None if bytes_per_row is None else round(bytes_per_row * 3600 / 1e6, 2),
    }


def prometheus(standins: StandIns, seconds: float, warm_s: float = 6.0) -> dict[str, Any] | None:
    """A real Prometheus over the stand-ins: CPU, samples appended, WAL growth."""
    import httpx

    from control.promsource import instance_of
    from control.testing import PrometheusServer, why_no_prometheus

    if why_no_prometheus():
        return None
    prom = PrometheusServer([instance_of(f.url) for f in standins.fakes], scrape_interval_s=1.0).start()

    def own(name: str) -> float:  # Prometheus' own /metrics
        from prometheus_client.parser import text_string_to_metric_families

        text = httpx.get(f"{prom.url}/metrics", timeout=10).text
        return sum(smp.value for fam in text_string_to_metric_families(text) for smp in fam.samples
                   if smp.name == name)

    def appended() -> float:
        return own("prometheus_tsdb_head_samples_appended_total")

    try:
        time.sleep(warm_s)
        pid = prom._proc.pid
        wal = prom.dir / "data" / "wal"
        c0, a0, w0, t0 = cpu_seconds(pid), appended(), _dir_bytes(wal), time.monotonic()
        time.sleep(seconds)
        c1, a1, w1, t1 = cpu_seconds(pid), appended(), _dir_bytes(wal), time.monotonic()
        series = own("prometheus_tsdb_head_series")
    finally:
        prom.stop()
    n = len(standins.fakes)
    span = t1 - t0
    return {
        "cpu_pct_of_one_core": round(100 * (c1 - c0) / span, 1),
        "samples_per_s": round((a1 - a0) / span), "head_series": int(series),
        "wal_mb_per_host_day": round((w1 - w0) / span * 86400 / n / 1e6, 1),
    }


def pages(n: int, repeats: int, days: float = 7.0) -> dict[str, Any]:
    """Fleet and Live page render time (s) with ``days`` of samples for ``n`` hosts."""
    from streamlit.testing.v1 import AppTest

    from bench.bench_dashboard import APP, seed_store
    from control.auth import User
    from control.testing import FakeEngineHost

    home = Path(tempfile.mkdtemp(prefix="specpilot-bench-pages-"))
    os.environ[envs.HOME] = str(home)
    url = f"sqlite:///{home / 'specpilot.db'}"
    os.environ[envs.DB_URL] = url
    os.environ["BENCH_FLEET_TOKEN"] = "bench-fleet-token"
    fakes = [FakeEngineHost(token="bench-fleet-token").start() for _ in range(n)]
    try:
        t = time.perf_counter()
        seed_store(url, [(f"host-{i:03d}", f.url, "BENCH_FLEET_TOKEN") for i, f in enumerate(fakes)], days=days)
        seed_s = time.perf_counter() - t
        at = AppTest.from_file(str(APP), default_timeout=300)
        at.session_state["user"] = User("bench", "operator")
        at.session_state["selected_host"] = "host-000"
        at.run()
        out: dict[str, Any] = {"seed_s": round(seed_s, 1), "db_mb": round((home / "specpilot.db").stat().st_size / 1e6, 1)}
        for page in ("pages/fleet.py", "pages/live.py"):
            times = []
            for _ in range(repeats + 1):
                t = time.perf_counter()
                at.switch_page(page).run()
                times.append(time.perf_counter() - t)
                if at.exception:
                    raise RuntimeError(f"{page}: {at.exception[0].message}")
            out[page.split("/")[1][:-3]] = {"first_s": round(times[0], 3), "median_s": round(statistics.median(times[1:]), 3)}
        return out
    finally:
        for f in fakes:
            f.stop()


def run(hosts: list[int], seconds: float, page_hosts: list[int], repeats: int) -> dict[str, Any]:
    """Every N: embedded and Prometheus side by side, then the pages."""
    results: dict[str, Any] = {"seconds": seconds, "collect": {}, "pages": {}}
    for n in hosts:
        standins = StandIns(n)
        try:
            emb = embedded(standins, seconds)
            prom = prometheus(standins, seconds)
        finally:
            standins.stop()
        results["collect"][n] = {"embedded": emb, "prometheus": prom}
        print(f"N={n:4d}  embedded: {json.dumps(emb)}\n        prometheus: {json.dumps(prom)}", flush=True)
    for n in page_hosts:
        results["pages"][n] = pages(n, repeats)
        print(f"N={n:4d}  pages (7 days): {json.dumps(results['pages'][n])}", flush=True)
    return results


def add_arguments(p: Any) -> None:
    """Options of ``python -m bench fleet``."""
    p.add_argument("--hosts", default="1,10,50,200", help="numbers of stand-in hosts for the collection figures")
    p.add_argument("--seconds", type=float, default=20.0, help="measured seconds per N and mode")
    p.add_argument("--pages", default="1,10,50", help="numbers of hosts for the page render times ('' for none)")
    p.add_argument("--repeats", type=int, default=3, help="timed renders per page after the first")
    p.add_argument("--json", type=Path, default=None, help="write the figures as JSON here")


def main(args: Any) -> int:
    """Run with parsed ``args`` (see :func:`add_arguments`)."""
    ints = lambda s: [int(x) for x in s.split(",") if x.strip()]
    out = run(ints(args.hosts), args.seconds, ints(args.pages), args.repeats)
    if args.json:
        args.json.write_text(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    import argparse

    ap = argparse.ArgumentParser(prog="python -m bench.bench_fleet", description=__doc__.split("\n\n")[0])
    add_arguments(ap)
    sys.exit(main(ap.parse_args()))
