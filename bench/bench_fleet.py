"""Fleet scale: the embedded collector against Prometheus, with N stand-in engine hosts.

For each N (default 1, 10, 50, 200) this starts N stand-in engine hosts serving
realistic ``/metrics`` (``tests.support.FakeEngineHost``, every series the collector
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
  ``--repeats`` renders after the first; with ``--prometheus-pages`` the same pages in
  Prometheus mode: a real Prometheus holding 7 days for the N hosts (backfilled with
  ``promtool tsdb create-blocks-from openmetrics``, one sample every ``--prom-step`` s),
  then scraping the stand-ins every second for 75 s.

    python -m bench fleet [--hosts 1,10,50,200] [--seconds 20] [--pages 1,10,50]
                          [--prometheus-pages] [--prom-step 60] [--json FILE]

Timings on a shared machine are noisy: compare the columns of one run.
"""

from __future__ import annotations

import json
import os
import shutil
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
        from tests.support import FakeEngineHost

        self.fakes = [FakeEngineHost(token="bench-fleet-token").start() for _ in range(n)]
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._feed, daemon=True)
        self._thread.start()

    def _feed(self) -> None:
        while not self._stop.wait(1.0):
            for f in self.fakes:
                f.metrics.serve(
                    requests=1, output_tokens=60, drafts=20, draft_tokens=40, accepted=25, accepted_per_pos=[15, 10]
                )

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
    env = {
        **os.environ,
        "PYTHONPATH": str(ROOT),
        "SPECPILOT_CONTROL_TOKEN": "bench-fleet-token",
        "SPECPILOT_HOME": str(home),
    }
    proc = subprocess.Popen(
        [sys.executable, "-m", "control", "--db", url, "collect"],
        cwd=ROOT,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )

    def rows() -> int:
        with sqlite3.connect(db) as c:
            return c.execute("select count(*) from metric_samples where resolution_s = 1").fetchone()[0]

    def size() -> int:  # pages in use after a checkpoint (the WAL folded in), in bytes
        with sqlite3.connect(db) as c:
            c.execute("pragma wal_checkpoint(truncate)")
            pages, free, page = (
                c.execute(f"pragma {p}").fetchone()[0] for p in ("page_count", "freelist_count", "page_size")
            )
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
        "samples_per_s": round(written / span, 1),
        "kept_up_frac": round(written / (n * span), 3),
        "bytes_per_sample_row": None if bytes_per_row is None else round(bytes_per_row),
        "store_mb_per_host_day": None if bytes_per_row is None else round(bytes_per_row * (1440 + 24) / 1e6, 3),
        "raw_hour_mb_per_host": None if bytes_per_row is None else round(bytes_per_row * 3600 / 1e6, 2),
    }


def prometheus(standins: StandIns, seconds: float, warm_s: float = 6.0) -> dict[str, Any] | None:
    """A real Prometheus over the stand-ins: CPU, samples appended, WAL growth."""
    import httpx

    from control.promsource import instance_of
    from tests.support import PrometheusServer, why_no_prometheus

    if why_no_prometheus():
        return None
    prom = PrometheusServer([instance_of(f.url) for f in standins.fakes], scrape_interval_s=1.0).start()

    def own(name: str) -> float:  # Prometheus' own /metrics
        from prometheus_client.parser import text_string_to_metric_families

        text = httpx.get(f"{prom.url}/metrics", timeout=10).text
        return sum(smp.value for fam in text_string_to_metric_families(text) for smp in fam.samples if smp.name == name)

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
        "samples_per_s": round((a1 - a0) / span),
        "head_series": int(series),
        "wal_mb_per_host_day": round((w1 - w0) / span * 86400 / n / 1e6, 1),
    }


def pages(n: int, repeats: int, days: float = 7.0, prometheus: bool = False, prom_step_s: int = 60) -> dict[str, Any]:
    """Fleet and Live page render time (s) with ``days`` of samples for ``n`` hosts: from
    the embedded store, then (``prometheus``) from a real Prometheus holding the same span
    (:func:`prometheus_pages`), with the same stand-ins and the same store."""
    from bench.bench_dashboard import seed_store

    home = Path(tempfile.mkdtemp(prefix="specpilot-bench-pages-"))
    os.environ[envs.HOME] = str(home)
    url = f"sqlite:///{home / 'specpilot.db'}"
    os.environ[envs.DB_URL] = url
    os.environ["BENCH_FLEET_TOKEN"] = "bench-fleet-token"
    standins = StandIns(n)
    try:
        t = time.perf_counter()
        seed_store(
            url, [(f"host-{i:03d}", f.url, "BENCH_FLEET_TOKEN") for i, f in enumerate(standins.fakes)], days=days
        )
        seed_s = time.perf_counter() - t
        out: dict[str, Any] = {
            "seed_s": round(seed_s, 1),
            "db_mb": round((home / "specpilot.db").stat().st_size / 1e6, 1),
        }
        out.update(_render(repeats))
        if prometheus:
            out["prometheus"] = prometheus_pages(standins.fakes, repeats, days=days, step_s=prom_step_s)
        return out
    finally:
        standins.stop()
        shutil.rmtree(home, ignore_errors=True)  # 7 days for 50 hosts is a quarter GB


BLOCK_S = 7200  # Prometheus' block length: one OpenMetrics file per block keeps promtool to one pass each


def backfill_blocks(
    template: str,
    instances: list[str],
    start: float,
    end: float,
    out: Path,
    step_s: int = 60,
    job: str = "specpilot_engine",
) -> dict[str, Any]:
    """Write ``[start, end)`` (unix s) of samples for every ``instance`` as Prometheus TSDB
    blocks into ``out``, one sample every ``step_s`` s, through ``promtool tsdb
    create-blocks-from openmetrics`` (one OpenMetrics file per 2 h block).

    ``template`` is an engine host's ``/metrics`` text: every series in it (``*_created``
    left out) is written for every instance, labelled ``instance`` and ``job`` as a scrape
    would: counters and histograms grow with a daily load cycle (the dashboard
    benchmark's, :func:`bench.bench_dashboard._load`), gauges follow it or keep the
    template's value. Returns ``{"samples", "series", "blocks", "seconds"}``.

    Raises:
        RuntimeError: promtool missing or refusing a file (with its message).
    """
    import shutil

    import numpy as np
    from prometheus_client.parser import text_string_to_metric_families

    from control.sampling import HISTOGRAMS

    promtool = shutil.which("promtool")
    if promtool is None:
        raise RuntimeError("promtool not found (Debian: apt-get install prometheus)")
    t0 = time.perf_counter()
    series: dict[str, list[tuple[dict[str, str], float]]] = {}
    for fam in text_string_to_metric_families(template):
        for smp in fam.samples:
            if not smp.name.endswith("_created"):
                series.setdefault(smp.name, []).append((dict(smp.labels), float(smp.value)))
    ts = np.arange(int(start) // step_s * step_s, int(end), step_s, dtype=np.int64)
    hist_kind = {metric: kind for kind, metric in HISTOGRAMS.items()}
    rng = np.random.default_rng(7)
    values: list[dict[str, list[np.ndarray]]] = []
    for i in range(len(instances)):
        day = (ts % 86400) / 86400
        lam = np.maximum(
            0.05, 1.6 + 1.3 * np.sin(2 * np.pi * (day - 0.3)) + 0.2 * (i % 5) + rng.normal(0, 0.15, len(ts))
        )
        n = lam * step_s
        lat = {"ttft": 0.06 + 0.04 * lam, "itl": 0.014 + 0.003 * lam, "e2e": 1.0 + 0.3 * lam, "queue": 0.005 * lam}
        per_name: dict[str, list[np.ndarray]] = {}
        for name, label_sets in series.items():
            arrays = []
            for labels, v in label_sets:
                base = name.rsplit("_", 1)[0]
                kind = hist_kind.get(base)
                if kind and name.endswith("_bucket"):
                    le = float(labels["le"])
                    arrays.append(np.cumsum(n * (le >= lat[kind])))
                elif kind and name.endswith("_count"):
                    arrays.append(np.cumsum(n))
                elif kind and name.endswith("_sum"):
                    arrays.append(np.cumsum(n * lat[kind]))
                elif name.endswith("_total"):
                    per_request = {
                        "vllm:generation_tokens_total": 180.0,
                        "specpilot:user_generation_tokens_total": 180.0,
                        "vllm:prompt_tokens_total": 300.0,
                        "vllm:spec_decode_num_drafts_total": 50.0,
                        "vllm:spec_decode_num_draft_tokens_total": 100.0,
                        "vllm:spec_decode_num_accepted_tokens_total": 62.0,
                    }.get(name, 1.0)
                    if name == "vllm:spec_decode_num_accepted_tokens_per_pos_total":
                        per_request = 40.0 * 0.6 ** int(labels.get("position", 0))
                    arrays.append(np.cumsum(n * per_request))
                elif name == "vllm:kv_cache_usage_perc":
                    arrays.append(np.minimum(0.97, 0.15 * lam + 0.1))
                elif name == "vllm:num_requests_running":
                    arrays.append(np.minimum(8.0, 1.2 * lam))
                elif name == "vllm:num_requests_waiting":
                    arrays.append(np.maximum(0.0, 1.2 * lam - 8.0))
                else:
                    arrays.append(np.full(len(ts), v))
            per_name[name] = arrays
        values.append(per_name)

    def label_text(labels: dict[str, str], inst: str) -> str:
        items = {**labels, "instance": inst, "job": job}
        return ",".join(f'{k}="{v}"' for k, v in items.items())

    out.mkdir(parents=True, exist_ok=True)
    blocks = 0
    samples = 0
    first = int(ts[0]) // BLOCK_S * BLOCK_S
    for a in range(first, int(ts[-1]) + 1, BLOCK_S):
        lo, hi = np.searchsorted(ts, [a, a + BLOCK_S])
        if lo == hi:
            continue
        t_txt = [str(int(t)) for t in ts[lo:hi]]
        path = out / f"backfill-{a}.om"
        with open(path, "w") as f:
            for name, label_sets in series.items():
                f.write(f"# TYPE {name} unknown\n")
                for i, inst in enumerate(instances):
                    for (labels, _), arr in zip(label_sets, values[i][name]):
                        prefix = f"{name}{{{label_text(labels, inst)}}} "
                        f.write("\n".join(f"{prefix}{v:.9g} {t}" for v, t in zip(arr[lo:hi].tolist(), t_txt)))
                        f.write("\n")
                        samples += int(hi - lo)
            f.write("# EOF\n")
        r = subprocess.run(
            [promtool, "tsdb", "create-blocks-from", "openmetrics", "-q", str(path), str(out)],
            capture_output=True,
            text=True,
        )
        path.unlink()
        if r.returncode != 0:
            raise RuntimeError(f"promtool refused {path.name}: {(r.stderr or r.stdout)[-1000:]}")
        blocks += 1
    return {
        "samples": samples,
        "series": sum(len(v) for v in series.values()) * len(instances),
        "blocks": blocks,
        "seconds": round(time.perf_counter() - t0, 1),
    }


def prometheus_pages(
    fakes: list[Any], repeats: int, days: float = 7.0, step_s: int = 60, live_s: float = 75.0
) -> dict[str, Any]:
    """Fleet and Live page render time (s) in Prometheus mode: a real Prometheus holding
    ``days`` of backfilled samples (one every ``step_s`` s) for every stand-in, then
    scraping them every second for ``live_s`` s, so the Fleet page's minute is live data.
    Uses the store already seeded for the hosts (versions, alerts)."""
    import httpx

    from control.promsource import ENV_SOURCE, ENV_URL, instance_of
    from control.store import Store
    from control.views import common
    from control.views import fleet as fleet_views
    from tests.support import PrometheusServer, why_no_prometheus

    if why_no_prometheus():
        return {"skipped": why_no_prometheus()}
    instances = [instance_of(f.url) for f in fakes]
    template = httpx.get(f"{fakes[0].url}/metrics", timeout=10).text
    prom = PrometheusServer(instances, scrape_interval_s=1.0, retention=f"{int(days) + 2}d")
    now = time.time()
    try:
        bf = backfill_blocks(template, instances, now - days * 86400, now - 120, prom.dir / "data", step_s=step_s)
        print(f"        backfilled {json.dumps(bf)}", flush=True)
        prom.start(timeout_s=300)
        prom.wait_scraped("vllm:generation_tokens_total", timeout_s=120)
        time.sleep(live_s)
        os.environ[ENV_SOURCE], os.environ[ENV_URL] = "prometheus", prom.url
        common._CLIENTS.clear()  # the first render makes its clients again, as in the embedded run
        out: dict[str, Any] = {"backfill": bf, "tsdb_mb": round(_dir_bytes(prom.dir / "data") / 1e6, 1)}
        out.update(_render(repeats))
        with Store.open(envs.db_url()) as store:  # the figures came from Prometheus, not merely the time
            table = fleet_views.fleet_overview(store)
        out["hosts_with_figures"] = int(table["output_tokens_per_s"].notna().sum())
        return out
    finally:
        os.environ.pop(ENV_SOURCE, None)
        os.environ.pop(ENV_URL, None)
        prom.stop()


def _render(repeats: int) -> dict[str, Any]:
    """First and median render time (s) of the Fleet and Live pages in a fresh app session."""
    from streamlit.testing.v1 import AppTest

    from bench.bench_dashboard import APP
    from control.auth import User

    at = AppTest.from_file(str(APP), default_timeout=300)
    at.session_state["user"] = User("bench", "operator")
    at.session_state["selected_host"] = "host-000"
    at.run()
    out: dict[str, Any] = {}
    for page in ("pages/fleet.py", "pages/live.py"):
        times = []
        for _ in range(repeats + 1):
            t = time.perf_counter()
            at.switch_page(page).run()
            times.append(time.perf_counter() - t)
            if at.exception:
                raise RuntimeError(f"{page}: {at.exception[0].message}")
        out[page.split("/")[1][:-3]] = {
            "first_s": round(times[0], 3),
            "median_s": round(statistics.median(times[1:]), 3),
        }
    return out


def run(
    hosts: list[int],
    seconds: float,
    page_hosts: list[int],
    repeats: int,
    prometheus_pages_: bool = False,
    prom_step_s: int = 60,
) -> dict[str, Any]:
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
        results["pages"][n] = pages(n, repeats, prometheus=prometheus_pages_, prom_step_s=prom_step_s)
        print(f"N={n:4d}  pages (7 days): {json.dumps(results['pages'][n])}", flush=True)
    return results


def add_arguments(p: Any) -> None:
    """Options of ``python -m bench fleet``."""
    p.add_argument("--hosts", default="1,10,50,200", help="numbers of stand-in hosts for the collection figures")
    p.add_argument("--seconds", type=float, default=20.0, help="measured seconds per N and mode")
    p.add_argument("--pages", default="1,10,50", help="numbers of hosts for the page render times ('' for none)")
    p.add_argument("--repeats", type=int, default=3, help="timed renders per page after the first")
    p.add_argument(
        "--prometheus-pages",
        action="store_true",
        help="also time the pages in Prometheus mode (7 days backfilled with promtool, then live scrapes)",
    )
    p.add_argument("--prom-step", type=int, default=60, help="seconds between backfilled samples")
    p.add_argument("--json", type=Path, default=None, help="write the figures as JSON here")


def main(args: Any) -> int:
    """Run with parsed ``args`` (see :func:`add_arguments`)."""
    ints = lambda s: [int(x) for x in s.split(",") if x.strip()]
    out = run(ints(args.hosts), args.seconds, ints(args.pages), args.repeats, args.prometheus_pages, args.prom_step)
    if args.json:
        args.json.write_text(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    import argparse

    ap = argparse.ArgumentParser(prog="python -m bench.bench_fleet", description=__doc__.split("\n\n")[0])
    add_arguments(ap)
    sys.exit(main(ap.parse_args()))
