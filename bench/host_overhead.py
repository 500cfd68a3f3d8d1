"""Engines side by side on one GPU: the engine host against bare ``vllm serve``, or a dual
engine host's routing modes against each other.

Every ``--engine`` (same spec syntax as :mod:`bench.gpu_bench`: ``serve:NAME:ARGS``,
``host:NAME:ARGS``, ``dual:NAME:ARGS``; ARGS may start with ``NAME=value`` environment
settings) is started in turn and left running, each with its share of GPU memory
(``--gpu-memory-utilization`` in its ARGS). Once all are up, the closed-loop loads run
round-robin over the rows (``--rounds`` rounds: row 1, 2, ..., then again; a dual engine
host gives one row per ``--modes`` routing mode, set with ``PUT /control/config`` before
each window), so that drift of the machine over time hits every row alike, and
single-request TTFTs are taken the same way. Ratios are of medians, against the first row.

Throughput is vLLM's own ``vllm:generation_tokens_total`` over each window (tokens/s), as
in :mod:`bench.gpu_bench`; TTFT in ms of one streamed 32-token request.

Typical use on a GPU host (docs/gpu.md), to split the engine host's cost into its parts::

    python -m bench.host_overhead --loads 64 --rounds 3 \\
      --engine 'serve:bare:--gpu-memory-utilization 0.2 --no-enable-prefix-caching' \\
      --engine 'host:host:--k-max 0 --no-prefix-caching --gpu-memory-utilization 0.2' \\
      --engine 'serve:hook:--gpu-memory-utilization 0.2 --no-enable-prefix-caching --async-scheduling \\
                --scheduler-cls engine_host.scheduler.SpecPilotAsyncScheduler' \\
      --engine 'serve:stats:VLLM_PLUGINS=specpilot_stats --gpu-memory-utilization 0.2 --no-enable-prefix-caching'

Results: ``--out/overhead.json`` (rewritten after each step) and a table on stdout.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shlex
import statistics
import sys
import time
from pathlib import Path

import httpx

from engine_host.model import prepare_default_model
from engine_host.process import EngineHostProcess

from .gpu_bench import closed_loop, log_lines, make_engine, ttft, wait_url
from .workloads import Workload


def summarize(res: dict) -> str:
    """Markdown table: per row (engine, or engine/routing mode) and cell (workload@load),
    median tokens/s with every window, the ratio of medians to the first row, TTFT p50."""
    rows = res["rows"]
    cells = list(dict.fromkeys(k for r in rows for k in r.get("loads", {})))
    base = rows[0] if rows else {}
    head = "| row | " + " | ".join(f"{k} tok/s (windows) | x {base.get('name')}" for k in cells) + " | TTFT p50 ms |"
    lines = [head, "|" + "---|" * (2 + 2 * len(cells))]
    for r in rows:
        out = []
        for k in cells:
            runs = r.get("loads", {}).get(k, [])
            b = base.get("loads", {}).get(k, [])
            med = statistics.median(runs) if runs else None
            bmed = statistics.median(b) if b else None
            out.append(f"{med:.0f} ({', '.join(f'{x:.0f}' for x in runs)})" if med else "-")
            out.append(f"{med / bmed:.3f}" if med and bmed else "-")
        tt = r.get("ttft_ms", [])
        lines.append(f"| {r['name']} | " + " | ".join(out) + f" | {round(statistics.median(tt), 2) if tt else '-'} |")
    return "\n".join(lines)


async def set_routing(eh: EngineHostProcess, mode: str) -> None:
    """PUT the dual engine host's routing mode (plain, auto, speculative)."""
    async with httpx.AsyncClient(base_url=eh.url, headers=eh.control_headers, timeout=30) as c:
        r = await c.put("/control/config", json={"routing": mode})
        r.raise_for_status()


async def run(args: argparse.Namespace) -> dict:
    """Start the engines, take the loads and TTFTs round-robin, stop them.

    Returns:
        ``{"engines": [...], "rows": [{"name", "loads": {"WORKLOAD@cN": [tokens/s, ...]},
        "ttft_ms": [...]}], "args"}``, also written to ``--out/overhead.json`` after each
        window. An engine that does not come up is recorded with its ``error`` and left out.
    """
    out = args.out
    (out / "logs").mkdir(parents=True, exist_ok=True)
    model = str(prepare_default_model(quiet=True))
    name_m = Path(model).name
    res: dict = {"engines": [], "rows": [], "args": {k: str(v) for k, v in vars(args).items()}}
    rows: list[tuple[dict, EngineHostProcess, str | None]] = []  # (row record, process, routing mode)
    procs: list[tuple[dict, EngineHostProcess]] = []
    t_begin = time.monotonic()

    def save() -> None:
        (out / "overhead.json").write_text(json.dumps(res, indent=1))

    try:
        for spec in args.engine:
            if procs and time.monotonic() - t_begin > args.start_budget:
                print(f"start budget of {args.start_budget:.0f} s spent: {spec!r} left out", flush=True)
                break
            name, eh, kind = make_engine(spec, model, out / "logs")
            rec = {"name": name, "kind": kind, "command": shlex.join(eh.command()), "env": eh.env}
            print(f"== {name}: {rec['command']}", flush=True)
            res["engines"].append(rec)
            eh.start()
            try:
                rec["health_s"] = round(await wait_url(eh, "/health", 900), 1)
                if kind != "serve":
                    rec["ready_s"] = round(await wait_url(eh, "/ready", 900), 1)
            except Exception as exc:
                rec["error"] = f"{type(exc).__name__}: {exc}"
                print(f"  {name} failed: {rec['error']}\n{eh.log_tail(30)}", flush=True)
                eh.stop()
                rec["vllm_log"] = log_lines(eh.log_path)
                save()
                continue
            print(f"  up in {rec.get('ready_s', rec['health_s'])} s", flush=True)
            procs.append((rec, eh))
            for mode in (args.modes if kind == "dual" else [None]):
                row = {"name": f"{name}/{mode}" if mode else name, "loads": {}, "ttft_ms": []}
                res["rows"].append(row)
                rows.append((row, eh, mode))
            save()
        cells = [(wl, conc) for wl in args.workloads for conc in args.loads]
        for rnd in range(args.rounds):
            for wl, conc in cells:
                for row, eh, mode in rows:
                    if mode:
                        await set_routing(eh, mode)
                    if args.warm > 0:  # untimed: caches, and the routing split settling after a switch
                        await closed_loop(eh.url, name_m, conc, args.warm, args.max_tokens, args.seed + 99, wl)
                    r = await closed_loop(eh.url, name_m, conc, args.duration, args.max_tokens, args.seed + rnd, wl)
                    row["loads"].setdefault(f"{wl}@c{conc}", []).append(r["tokens_per_s"])
                    print(f"  round {rnd + 1} {wl}@c{conc} {row['name']}: {r['tokens_per_s']} tok/s", flush=True)
                    save()
            ttft_wl = {row["name"]: Workload("chat", seed=args.seed + 7 + rnd) for row, _, _ in rows}
            for row, eh, mode in rows:
                if mode:
                    await set_routing(eh, mode)
                for _ in range(args.ttfts):
                    row["ttft_ms"].append(await ttft(eh.url, name_m, ttft_wl[row["name"]]))
            save()
    finally:
        for rec, eh in procs:
            eh.stop()
            rec["vllm_log"] = log_lines(eh.log_path)
        save()
    return res


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.host_overhead", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--engine", action="append", required=True,
                    help="serve:NAME:ARGS, host:NAME:ARGS or dual:NAME:ARGS (repeatable; the first is the baseline)")
    ap.add_argument("--modes", type=lambda s: [x for x in s.split(",") if x], default=["plain", "auto"],
                    help="routing modes measured on each dual engine host, each a row of its own")
    ap.add_argument("--workloads", type=lambda s: [x for x in s.split(",") if x], default=["chat"],
                    help="harness workloads whose prompts the clients send (chat: open-ended, code: predictable)")
    ap.add_argument("--loads", type=lambda s: [int(x) for x in s.split(",") if x], default=[64],
                    help="concurrencies (closed loop)")
    ap.add_argument("--rounds", type=int, default=3, help="rounds over all engines")
    ap.add_argument("--duration", type=float, default=6.0, help="seconds per window")
    ap.add_argument("--warm", type=float, default=3.0, help="seconds of untimed load before each window")
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--ttfts", type=int, default=3, help="single-request TTFTs per engine per round")
    ap.add_argument("--start-budget", type=float, default=420.0,
                    help="seconds after which no further engine is started (the loads still run)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "gpu-results")))
    args = ap.parse_args(argv)
    res = asyncio.run(run(args))
    print(summarize(res), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
