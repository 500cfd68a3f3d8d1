"""Collector cost benchmark: engine output tokens/s with and without the collector daemon
scraping ``/metrics`` every second.

    flock /tmp/specpilot-engine.lock python -m bench collector
    python -m bench collector --window 45 --pairs 4 --concurrency 4

One engine host (default model, CPU eager mode) serves a closed loop of ``--concurrency``
streams of completions. Windows alternate without / with ``python -m control collect``
(a separate process, as deployed, 1 s interval, its own SQLite store), ``--pairs`` times,
so that drift of the shared machine hits both sides alike. Each window's throughput is
the delta of ``vllm:generation_tokens_total`` over the window (tokens/s). Printed: every
window, the medians, the ratio with/without (target >= 0.99) and how many samples the
collector stored, and the collector process' own CPU time per second of wall time
(``/proc/PID/stat``; Linux), and the CPU time the engine host's API server spends per
scrape (measured on the idle engine first). Figures only; nothing is asserted.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx

from control.metrics_parse import parse_metrics

PROMPTS = [
    "Copy this list exactly, then copy it again: red apple, green pear, yellow banana, purple plum, orange mango,",
    "Write a short paragraph about the sea and the people who live by it.",
    'def fibonacci(n):\n    """Return the n-th Fibonacci number."""\n',
    "List the planets of the solar system in order, one per line, with one fact each.",
]


def generated_tokens(url: str) -> float:
    text = httpx.get(url + "/metrics", timeout=10).text
    return parse_metrics(text, {"vllm:generation_tokens"}).value("vllm:generation_tokens_total") or 0.0


def load_loop(url: str, model: str, stop: threading.Event, i: int, max_tokens: int) -> None:
    with httpx.Client(base_url=url, timeout=300) as c:
        n = i
        while not stop.is_set():
            try:
                c.post(
                    "/v1/completions",
                    json={
                        "model": model,
                        "prompt": PROMPTS[n % len(PROMPTS)],
                        "max_tokens": max_tokens,
                        "temperature": 0.7,
                        "ignore_eos": True,
                    },
                )
            except httpx.HTTPError:
                if stop.is_set():
                    return
                time.sleep(0.5)
            n += 1


def cpu_seconds(pid: int) -> float:
    """User + system CPU time (s) of a process so far (Linux ``/proc/PID/stat``)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def scrape_cpu_ms(url: str, pid: int, n: int = 30) -> float:
    """CPU time (ms) the engine host's API-server process spends per ``GET /metrics``,
    measured on an idle engine: CPU over ``n`` back-to-back scrapes minus the process'
    idle CPU rate over the same wall time."""
    c0, t0 = cpu_seconds(pid), time.monotonic()
    time.sleep(5)
    idle_rate = (cpu_seconds(pid) - c0) / (time.monotonic() - t0)
    with httpx.Client(timeout=10) as c:
        c0, t0 = cpu_seconds(pid), time.monotonic()
        for _ in range(n):
            c.get(url + "/metrics")
        wall = time.monotonic() - t0
    return max(0.0, (cpu_seconds(pid) - c0) - idle_rate * wall) / n * 1000.0


def window(url: str, seconds: float) -> float:
    """Output tokens/s over ``seconds`` from the engine's own counter."""
    t0, n0 = time.monotonic(), generated_tokens(url)
    time.sleep(seconds)
    return (generated_tokens(url) - n0) / (time.monotonic() - t0)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench collector", description=__doc__.split("\n\n")[0])
    p.add_argument("--window", type=float, default=40.0, help="seconds per window")
    p.add_argument("--pairs", type=int, default=3, help="without/with window pairs")
    p.add_argument("--concurrency", type=int, default=4, help="concurrent request streams")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--model", default=None, help="engine host model (default: the prepared default model)")
    p.add_argument("--engine-arg", action="append", default=[], help="extra python -m engine_host argument")
    p.add_argument("--json", default=None, help="also write the figures to this file")
    args = p.parse_args(argv)

    from engine_host.model import prepare_default_model
    from engine_host.process import EngineHostProcess

    tmp = Path(tempfile.mkdtemp(prefix="specpilot-bench-collector-"))
    model = args.model or str(prepare_default_model(quiet=True))
    eh = EngineHostProcess(
        model=model,
        env={"SPECPILOT_HOME": str(tmp / "home")},
        log_path=tmp / "engine.log",
        extra_args=[
            "--enforce-eager",
            "--k-max",
            "4",
            "--max-num-seqs",
            "8",
            "--max-model-len",
            "1024",
            "--speculation-mode",
            "fixed",
            "--k",
            "2",
            *args.engine_arg,
        ],
    )
    db = f"sqlite:///{tmp / 'collector.db'}"
    env = {**os.environ, "SPECPILOT_CONTROL_TOKEN": eh.token, "SPECPILOT_HOME": str(tmp / "home")}
    stop = threading.Event()
    threads: list[threading.Thread] = []
    results: dict[str, list[float]] = {"without": [], "with": []}
    collector_cpu: list[float] = []
    collector = None
    try:
        eh.start()
        print(f"engine host starting ({eh.url}) ...", flush=True)
        print(f"ready in {eh.wait_ready(900):.0f} s", flush=True)
        subprocess.run(
            [sys.executable, "-m", "control", "--db", db, "hosts", "add", "local", eh.url],
            env=env,
            check=True,
            capture_output=True,
        )
        served = httpx.get(eh.url + "/v1/models", timeout=10).json()["data"][0]["id"]
        per_scrape_ms = scrape_cpu_ms(eh.url, eh.proc.pid)
        print(f"engine API server: {per_scrape_ms:.1f} ms CPU per /metrics scrape", flush=True)
        threads = [
            threading.Thread(target=load_loop, args=(eh.url, served, stop, i, args.max_tokens), daemon=True)
            for i in range(args.concurrency)
        ]
        for t in threads:
            t.start()
        time.sleep(10)  # settle
        for pair in range(args.pairs):
            for side in ("without", "with"):
                if side == "with":
                    collector = subprocess.Popen(
                        [sys.executable, "-m", "control", "--db", db, "collect", "--interval", "1"],
                        env=env,
                        stdout=subprocess.DEVNULL,
                        stderr=subprocess.DEVNULL,
                    )
                    time.sleep(5)  # the daemon's start-up is not part of its steady cost
                cpu0, t0 = (cpu_seconds(collector.pid), time.monotonic()) if collector else (0.0, 0.0)
                tps = window(eh.url, args.window)
                results[side].append(tps)
                extra = ""
                if collector is not None:
                    share = (cpu_seconds(collector.pid) - cpu0) / (time.monotonic() - t0)
                    collector_cpu.append(share)
                    extra = f"  (collector process: {100 * share:.2f} % of one core)"
                print(f"pair {pair + 1} {side:>7} collector: {tps:7.1f} tokens/s{extra}", flush=True)
                if collector is not None:
                    collector.terminate()
                    collector.wait(30)
                    collector = None
                    time.sleep(2)
        with_med, without_med = statistics.median(results["with"]), statistics.median(results["without"])
        import sqlite3

        con = sqlite3.connect(str(tmp / "collector.db"))
        stored = con.execute("SELECT count(*) FROM metric_samples WHERE resolution_s = 1").fetchone()[0]
        con.close()
        figures = {
            "window_s": args.window,
            "pairs": args.pairs,
            "concurrency": args.concurrency,
            "tokens_per_s_without": [round(x, 1) for x in results["without"]],
            "tokens_per_s_with": [round(x, 1) for x in results["with"]],
            "median_without": round(without_med, 1),
            "median_with": round(with_med, 1),
            "ratio": round(with_med / without_med, 4),
            "ratio_per_pair": [round(w / wo, 4) for w, wo in zip(results["with"], results["without"])],
            "collector_cpu_share_of_one_core": round(statistics.median(collector_cpu), 4),
            "engine_api_cpu_ms_per_scrape": round(per_scrape_ms, 2),
            "samples_stored": stored,
        }
        print(json.dumps(figures, indent=2))
        print(f"ratio with/without collector: {figures['ratio']:.3f} (target >= 0.99)")
        if args.json:
            Path(args.json).write_text(json.dumps(figures, indent=2))
        return 0
    finally:
        stop.set()
        if collector is not None:
            collector.terminate()
        eh.stop()


if __name__ == "__main__":
    raise SystemExit(main())
