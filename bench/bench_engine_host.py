"""Engine-host benchmarks (figures, not tests).

1. Hook overhead: output tokens/s of the SpecPilot engine host at fixed K against plain
   vLLM (``vllm serve`` with the same model and the same ngram K, vLLM's own scheduler,
   no SpecPilot plugins), engines alternated A/B/A/B in one run. Target ratio >= 0.99.
2. Config latency: time from ``PUT /control/config`` to the engine core's
   acknowledgement, and how many engine steps pass before the new K is used, under load.
   Target: the next step.
3. Start-up time to ready, eager and compiled.

Run::

    python -m bench engine-host [--rounds 2] [--duration 20] [--concurrency 8] [--skip-compiled]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import time
from pathlib import Path

import httpx

from engine_host.model import prepare_default_model
from engine_host.process import EngineHostProcess, free_port

PROMPTS = [
    "Copy this list exactly, then copy it again: red apple, green pear, yellow banana, purple plum, "
    "orange mango, red apple, green pear, yellow banana, purple plum, orange mango,",
    'def fibonacci(n):\n    """Return the n-th Fibonacci number."""\n',
    "Write a short poem about the ocean at night.",
    "Explain in simple words why the sky is blue.",
]


class PlainVllm(EngineHostProcess):
    """``vllm serve`` without SpecPilot (no scheduler hook, no plugins)."""

    def __init__(self, model: str, k: int, extra: list[str], **kw):
        super().__init__(model=model, **kw)
        self.k = k
        self.extra = extra

    def command(self) -> list[str]:
        cmd = [
            sys.executable,
            "-m",
            "engine_host.serve",
            "serve",
            self.model,
            "--served-model-name",
            Path(self.model).name,
            "--host",
            self.host,
            "--port",
            str(self.port),
            "--no-async-scheduling",
        ]
        if self.k > 0:
            cmd += [
                "--speculative-config",
                json.dumps(
                    {
                        "method": "ngram",
                        "num_speculative_tokens": self.k,
                        "prompt_lookup_min": 2,
                        "prompt_lookup_max": 4,
                    }
                ),
            ]
        return cmd + self.extra

    def start(self):
        self.env.update({"VLLM_PLUGINS": "", "VLLM_CPU_KVCACHE_SPACE": "2", "VLLM_TARGET_DEVICE": "cpu"})
        return super().start()

    def wait_ready(self, timeout_s: float = 400.0) -> float:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if not self.alive():
                raise RuntimeError(self.log_tail())
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return time.monotonic() - (self.started_at or 0)
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        raise RuntimeError("plain vLLM not ready:\n" + self.log_tail())


async def load(url: str, model: str, concurrency: int, duration_s: float, max_tokens: int = 96) -> dict:
    """Closed-loop load: ``concurrency`` workers, temperature 0, ignore_eos. Returns tokens/s."""
    tokens = 0
    requests = 0
    t_end = time.monotonic() + duration_s

    async def worker(i: int, client: httpx.AsyncClient):
        nonlocal tokens, requests
        j = i
        while time.monotonic() < t_end:
            r = await client.post(
                "/v1/completions",
                json={
                    "model": model,
                    "prompt": PROMPTS[j % len(PROMPTS)],
                    "max_tokens": max_tokens,
                    "temperature": 0,
                    "ignore_eos": True,
                },
            )
            r.raise_for_status()
            tokens += r.json()["usage"]["completion_tokens"]
            requests += 1
            j += 1

    t0 = time.monotonic()
    async with httpx.AsyncClient(base_url=url, timeout=300) as client:
        await asyncio.gather(*(worker(i, client) for i in range(concurrency)))
    wall = time.monotonic() - t0
    return {"tokens_per_s": tokens / wall, "requests": requests, "wall_s": wall}


async def config_latency(eh: EngineHostProcess, model: str, n: int = 20) -> dict:
    """PUT alternating K values under load.

    Returns the median/max time from PUT to the engine core's acknowledgement (ms), the
    engine steps from acknowledgement to the first step scheduled with the new K, and
    the median step time (ms) for comparison.
    """
    lat, gaps, step_ms = [], [], []
    hdr = eh.control_headers
    async with httpx.AsyncClient(base_url=eh.url, timeout=60) as c:
        bg = asyncio.create_task(load(eh.url, model, 4, 4.0 + n * 0.4))
        await asyncio.sleep(2.0)
        for i in range(n):
            r = await c.put(
                "/control/config", headers=hdr, json={"speculation": {"mode": "fixed", "k": 2 + 2 * (i % 2)}}
            )
            body = r.json()
            lat.append(body["apply_latency_ms"])
            await asyncio.sleep(0.3)
            st = (await c.get("/control/state", headers=hdr)).json()
            ack, first = st.get("config_ack_step"), st.get("k_first_use_step")
            if ack is not None and first is not None:
                gaps.append(first - ack)
            t = st["controller"]["step_time_ms"].get(str(st["speculation"]["k_current"]))
            if t:
                step_ms.append(t)
        await bg
    return {
        "puts": n,
        "apply_latency_ms_median": round(statistics.median(lat), 3),
        "apply_latency_ms_max": round(max(lat), 3),
        "steps_from_ack_to_first_use": sorted(set(gaps)),
        "step_time_ms_median": round(statistics.median(step_ms), 3) if step_ms else None,
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m bench engine-host", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--rounds", type=int, default=2, help="A/B rounds (engine starts = 2 x rounds)")
    ap.add_argument("--duration", type=float, default=20.0, help="seconds of load per engine (s)")
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--k", type=int, default=4, help="fixed K for both engines")
    ap.add_argument("--skip-compiled", action="store_true", help="skip the compiled start-up measurement")
    ap.add_argument("--out", default=None, help="write the figures as JSON here")
    args = ap.parse_args(argv)

    model = str(prepare_default_model(quiet=True))
    name = Path(model).name
    home = Path(os.environ.get("TMPDIR", "/tmp")) / f"specpilot-bench-{os.getpid()}"
    common = ["--max-num-seqs", "16", "--max-model-len", "2048", "--enforce-eager"]
    results: dict = {"k": args.k, "concurrency": args.concurrency, "duration_s": args.duration, "rounds": []}
    startup = {"eager": [], "compiled": []}
    cfg_lat = None
    for rnd in range(args.rounds):
        row = {}
        for kind in ("specpilot", "plain"):
            if kind == "specpilot":
                eh = EngineHostProcess(
                    model=model,
                    port=free_port(),
                    env={"SPECPILOT_HOME": str(home)},
                    extra_args=common + ["--k-max", str(args.k), "--speculation-mode", "fixed", "--k", str(args.k)],
                )
            else:
                eh = PlainVllm(
                    model,
                    args.k,
                    [
                        "--max-num-seqs",
                        "16",
                        "--max-model-len",
                        "2048",
                        "--enforce-eager",
                        "--gpu-memory-utilization",
                        "0.3",
                    ],
                    port=free_port(),
                    env={"SPECPILOT_HOME": str(home)},
                )
            with eh:
                t = eh.wait_ready()
                if kind == "specpilot":
                    startup["eager"].append(round(t, 1))
                asyncio.run(load(eh.url, name, 2, 3.0))  # warm
                r = asyncio.run(load(eh.url, name, args.concurrency, args.duration))
                row[kind] = round(r["tokens_per_s"], 2)
                if kind == "specpilot" and rnd == 0:
                    cfg_lat = asyncio.run(config_latency(eh, name))
                    st = httpx.get(eh.url + "/control/state", headers=eh.control_headers).json()
                    row["hook_overhead_fraction"] = st["overhead"]["fraction"]
            print(f"round {rnd + 1} {kind}: {row[kind]} tokens/s", flush=True)
        row["ratio"] = round(row["specpilot"] / row["plain"], 4)
        results["rounds"].append(row)
    if not args.skip_compiled:
        eh = EngineHostProcess(
            model=model,
            port=free_port(),
            env={"SPECPILOT_HOME": str(home)},
            extra_args=["--max-num-seqs", "16", "--max-model-len", "2048", "--k-max", "8"],
        )
        with eh:
            startup["compiled"].append(round(eh.wait_ready(timeout_s=600), 1))
    sp = [r["specpilot"] for r in results["rounds"]]
    pl = [r["plain"] for r in results["rounds"]]
    results["ratio_of_means"] = round(statistics.mean(sp) / statistics.mean(pl), 4)
    results["config_latency"] = cfg_lat
    results["startup_to_ready_s"] = startup
    print(json.dumps(results, indent=2))
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
