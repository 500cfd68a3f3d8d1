"""``python -m bench.planner_check``: the planner's engine model against measured latency.

For one draft length K, on a real engine host: serve a little traffic so the controller
measures T(B, K) and E(K), then for each request rate (Poisson arrivals) first *predict*
the mean latency from ``/control/state`` alone (:func:`control.planner.plan`, no prior
sweep), then *measure* it, and print both side by side with their ratio. The workload
figures the planner needs (mean output tokens per request, prefill time) are taken from
the warm-up traffic's own measurements.

    python -m bench.planner_check --start-engine --k 2 --rates 0.5,1,2,4 --duration 40
    python -m bench.planner_check --url http://127.0.0.1:8000 --k 0 --rates 1,2

Measured figures go to docs/control.md ("Planner"), not into code.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
from typing import Any

import httpx

from control.planner import plan

from .loadgen import Load, run_load
from .workloads import WORKLOADS, Workload

ENV_TOKEN = "SPECPILOT_CONTROL_TOKEN"


def _summary(records: list[Any]) -> dict[str, float | None]:
    done = [r for r in records if r.done_s is not None and not r.error and not r.cancelled]
    if not done:
        return {"n": 0, "latency_s": None, "output_tokens": None, "ttft_s": None}
    return {
        "n": len(done),
        "latency_s": statistics.fmean(r.done_s - r.sent_s for r in done),
        "output_tokens": statistics.fmean(r.output_tokens for r in done),
        "ttft_s": statistics.median((r.ttft_ms or 0.0) / 1000.0 for r in done),
    }


def check(
    url: str,
    headers: dict[str, str],
    model: str,
    k: int,
    rates: list[float],
    duration_s: float,
    warm_s: float,
    max_tokens: int,
    workload: str,
) -> list[dict[str, Any]]:
    """Predict, then measure, at each rate; returns one row per rate (seconds, requests/s)."""
    with httpx.Client(base_url=url, headers=headers, timeout=60.0) as c:
        r = c.put("/control/config", json={"speculation": {"mode": "fixed", "k": k}})
        r.raise_for_status()
        records, _ = asyncio.run(
            run_load(url, model, Workload(workload, seed=1), Load(concurrency=1), warm_s, max_tokens=max_tokens)
        )
        warm = _summary(records)
        rows = []
        for i, rate in enumerate(rates):
            state = c.get("/control/state").json()
            rep = plan(
                [],
                state,
                rate_rps=rate,
                output_tokens=warm["output_tokens"] or max_tokens,
                prefill_s=warm["ttft_s"] or 0.0,
            )
            ans = rep.answer
            records, _ = asyncio.run(
                run_load(
                    url,
                    model,
                    Workload(workload, seed=2 + i),
                    Load(rate=rate),
                    duration_s,
                    max_tokens=max_tokens,
                    seed=i,
                )
            )
            got = _summary(records)
            rows.append(
                {
                    "k": k,
                    "rate_rps": rate,
                    "predicted_s": ans.latency_s if ans else None,
                    "measured_s": got["latency_s"],
                    "predicted_batch": ans.effective_batch if ans else None,
                    "saturation_rps": ans.saturation_rps if ans else None,
                    "extrapolated": ans.extrapolated if ans else None,
                    "n": got["n"],
                    "problem": rep.engine_problem,
                }
            )
    return rows


def _fmt(v: Any, spec: str = ".2f") -> str:
    return "-" if v is None else (format(v, spec) if isinstance(v, float) else str(v))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.planner_check", description=__doc__.splitlines()[0])
    ap.add_argument("--url", default=None, help="engine host base URL (or --start-engine)")
    ap.add_argument("--start-engine", action="store_true", help="start an engine host on the default model here")
    ap.add_argument("--token-env", default=ENV_TOKEN, help="environment variable holding the control token")
    ap.add_argument("--k", type=int, default=2, help="draft length K (tokens), fixed mode")
    ap.add_argument("--rates", default="0.5,1,2", help="request rates (requests/s), comma-separated")
    ap.add_argument("--duration", type=float, default=40.0, help="measurement window per rate (s)")
    ap.add_argument("--warm", type=float, default=20.0, help="traffic at one client before the first prediction (s)")
    ap.add_argument("--max-tokens", type=int, default=64, help="output cap per request (tokens)")
    ap.add_argument("--workload", choices=WORKLOADS, default="chat")
    args = ap.parse_args(argv)
    rates = [float(x) for x in args.rates.split(",") if x.strip()]
    eh = None
    if args.start_engine:
        from engine_host.model import prepare_default_model
        from engine_host.process import EngineHostProcess

        eh = EngineHostProcess(
            model=str(prepare_default_model(quiet=True)),
            extra_args=[
                "--enforce-eager",
                "--k-max",
                "8",
                "--max-num-seqs",
                "16",
                "--max-model-len",
                "2048",
                "--no-prefix-caching",
            ],
        ).start()
        eh.wait_ready(timeout_s=600)
        url, headers = eh.url, eh.control_headers
    elif args.url:
        token = os.environ.get(args.token_env)
        url, headers = args.url.rstrip("/"), ({"Authorization": f"Bearer {token}"} if token else {})
    else:
        ap.error("give --url or --start-engine")
    try:
        model = httpx.get(url + "/v1/models", timeout=30).json()["data"][0]["id"]
        rows = check(url, headers, model, args.k, rates, args.duration, args.warm, args.max_tokens, args.workload)
    finally:
        if eh is not None:
            eh.stop()
    print(
        f"{'K':>2} {'rate/s':>7} {'predicted s':>12} {'measured s':>11} {'pred/meas':>9} {'B pred':>7} "
        f"{'sat/s':>6} {'extrap':>6} {'n':>4}"
    )
    for r in rows:
        ratio = (r["predicted_s"] / r["measured_s"]) if r["predicted_s"] and r["measured_s"] else None
        print(
            f"{r['k']:>2} {r['rate_rps']:>7.2f} {_fmt(r['predicted_s']):>12} {_fmt(r['measured_s']):>11} "
            f"{_fmt(ratio):>9} {_fmt(r['predicted_batch'], '.1f'):>7} {_fmt(r['saturation_rps']):>6} "
            f"{_fmt(r['extrapolated']):>6} {r['n']:>4}" + (f"  ({r['problem']})" if r["problem"] else "")
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
