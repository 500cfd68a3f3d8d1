"""Cold start against warm: TTFT of the first real request (figures, not a test).

Three engine hosts side by side in one run, same model and settings:

* A: start-up warm-up ``full`` (every K in 0..K_max) and a heartbeat schedule;
* B: start-up warm-up ``full``, no heartbeats;
* C: warm-up ``off`` and no heartbeats (the contrast).

For each: TTFT (ms, client-side, streamed) of the first real request right after
``/ready``; the steady-state median TTFT of the next ``--steady`` requests; then, after
``--idle`` seconds without traffic (all three idle at once), the TTFT of the first request
again. Ratios are against the engine's own steady-state median. Target: <= 1.5x for A.

Run::

    python -m bench warmup [--idle 600] [--steady 20] [--heartbeat-interval 60] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import httpx

from engine_host.model import prepare_default_model
from engine_host.process import EngineHostProcess

PROMPT = "Write one sentence about the history of the bicycle."


def ttft_ms(url: str, model: str, prompt: str = PROMPT, max_tokens: int = 16) -> float:
    """TTFT (ms) of one streamed completion, measured from sending to the first text chunk."""
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True}
    t0 = time.perf_counter()
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=300) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if line.startswith("data: ") and '"text"' in line:
                return (time.perf_counter() - t0) * 1000.0
    raise RuntimeError("no token received")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m bench warmup", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--idle", type=float, default=600.0, help="idle period before the second cold request (s)")
    ap.add_argument("--steady", type=int, default=20, help="requests for the steady-state median")
    ap.add_argument("--heartbeat-interval", type=float, default=60.0, help="A's heartbeat interval (s)")
    ap.add_argument("--out", default=None, help="write the figures as JSON here")
    args = ap.parse_args(argv)

    model = str(prepare_default_model(quiet=True))
    name = Path(model).name
    common = [
        "--enforce-eager",
        "--k-max",
        "8",
        "--max-num-seqs",
        "16",
        "--max-model-len",
        "2048",
        "--speculation-mode",
        "adaptive",
    ]
    # 1 GiB of KV cache each: three engines share this machine's memory
    common += ["--kv-cache-space-gib", "1"]
    engines = {
        "warm-up + heartbeats": EngineHostProcess(model=model, extra_args=common + ["--warmup", "full"]),
        "warm-up, no heartbeats": EngineHostProcess(model=model, extra_args=common + ["--warmup", "full"]),
        "no warm-up, no heartbeats": EngineHostProcess(model=model, extra_args=common + ["--warmup", "off"]),
    }
    out: dict = {"idle_s": args.idle, "steady_requests": args.steady, "engines": {}}
    try:
        for label, eh in engines.items():
            eh.start()
            ready_s = eh.wait_ready(timeout_s=600)
            first = ttft_ms(eh.url, name)
            steady = [ttft_ms(eh.url, name) for _ in range(args.steady)]
            out["engines"][label] = {
                "ready_s": round(ready_s, 1),
                "first_after_ready_ms": round(first, 1),
                "steady_median_ms": round(statistics.median(steady), 1),
            }
            print(label, out["engines"][label], flush=True)
        hb = {
            "warmup": {
                "heartbeats": [
                    {
                        "name": "keepwarm",
                        "interval_s": args.heartbeat_interval,
                        "idle_s": min(30.0, args.heartbeat_interval / 2),
                        "max_tokens": 8,
                    }
                ]
            }
        }
        a = engines["warm-up + heartbeats"]
        httpx.put(a.url + "/control/config", headers=a.control_headers, json=hb, timeout=30).raise_for_status()
        print(f"idle for {args.idle:.0f} s ...", flush=True)
        time.sleep(args.idle)
        for label, eh in engines.items():
            row = out["engines"][label]
            row["first_after_idle_ms"] = round(ttft_ms(eh.url, name), 1)
            row["x_steady_after_ready"] = round(row["first_after_ready_ms"] / row["steady_median_ms"], 2)
            row["x_steady_after_idle"] = round(row["first_after_idle_ms"] / row["steady_median_ms"], 2)
        runs = httpx.get(a.url + "/control/warmup/runs", headers=a.control_headers).json()["runs"]
        out["engines"]["warm-up + heartbeats"]["heartbeats_run"] = sum(
            1 for r in runs if r["kind"] == "heartbeat" and r["outcome"] == "ok"
        )
    finally:
        for eh in engines.values():
            eh.stop()
    print(json.dumps(out, indent=2))
    if args.out:
        Path(args.out).write_text(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
