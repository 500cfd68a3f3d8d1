"""Engines side by side on one GPU: the engine host against bare ``vllm serve``, or a dual
engine host's routing modes against each other.

Every ``--engine`` (same spec syntax as :mod:`bench.gpu_bench`: ``serve:NAME:ARGS``,
``host:NAME:ARGS``, ``dual:NAME:ARGS``; ARGS may start with ``NAME=value`` environment
settings) is started in turn and left running, each with its share of GPU memory
(``--gpu-memory-utilization`` in its ARGS). Once all are up, the closed-loop loads run
round-robin over the rows (``--rounds`` rounds: row 1, 2, ..., then again; a dual engine
host gives one row per ``--modes`` routing mode, set with ``PUT /control/config`` before
each window), so that drift of the machine over time hits every row alike, and
single-request TTFTs are taken the same way.

Throughput is vLLM's own ``vllm:generation_tokens_total`` over each window (tokens/s), as
in :mod:`bench.gpu_bench`; TTFT in ms of one streamed 32-token request. The table gives,
per row and cell, the median over windows, the ratio of medians to the baseline row, and the
ratios taken round by round (each window against the baseline's window of the same round:
their spread says how well repetitions agree once the machine's drift is paired out).

Runs longer than one command may last: ``--state FILE --keep`` leaves the engines running
(they run in sessions of their own) and records them with the windows so far; a later call
with the same ``--state`` attaches to them, starts only the ``--engine`` specs not yet up,
appends its windows, and stops every engine unless ``--keep`` is given again. ``--only``
picks the engines measured in one call, ``--time-budget`` ends a call before a round that
would not fit.

Typical use on a GPU host (docs/gpu.md), to split the engine host's cost into its parts::

    python -m bench host-overhead --loads 64 --rounds 3 \\
      --engine 'serve:bare:--gpu-memory-utilization 0.2 --no-enable-prefix-caching' \\
      --engine 'host:host:--k-max 0 --no-prefix-caching --gpu-memory-utilization 0.2' \\
      --engine 'serve:hook:--gpu-memory-utilization 0.2 --no-enable-prefix-caching --async-scheduling \\
                --scheduler-cls engine_host.scheduler.SpecPilotAsyncScheduler' \\
      --engine 'serve:stats:VLLM_PLUGINS=specpilot_stats --gpu-memory-utilization 0.2 --no-enable-prefix-caching'

    python -m bench host-overhead --report overhead.json --baseline ngram4   # table only

Results: ``--out/overhead.json`` (rewritten after each step) and a table on stdout.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shlex
import shutil
import signal
import statistics
import sys
import time
from pathlib import Path

import httpx

from engine_host.model import prepare_default_model

from .gpu_bench import closed_loop, log_lines, make_engine, ttft, wait_url
from .workloads import Workload


def _fmt_ratio(x: float | None) -> str:
    return f"{x:.3f}" if x is not None else "-"


def summarize(res: dict, baseline: str | None = None) -> str:
    """Markdown table, one line per row (engine, or engine/routing mode) and cell
    (``WORKLOAD@cN``): median tokens/s with every window, the ratio of medians to the
    baseline row (default: the first row), and the per-round ratios to the baseline (each
    window over the baseline's window of the same round) as ``median [min, max] (n)``;
    TTFT p50 in ms, with the TTFT of the first request after warm-up where it was taken.

    Raises:
        KeyError: ``baseline`` names no row.
    """
    rows = res["rows"]
    if not rows:
        return "(no rows)"
    by_name = {r["name"]: r for r in rows}
    base = by_name[baseline] if baseline else rows[0]
    cells = list(dict.fromkeys(k for r in rows for k in r.get("loads", {})))
    lines = [
        f"| row | cell | tok/s median (windows) | x {base['name']} (medians) | "
        f"x {base['name']} per round: median [min, max] (n) | TTFT p50 ms |",
        "|---|---|---|---:|---|---:|",
    ]
    for r in rows:
        tt = r.get("ttft_ms", [])
        tt_s = f"{statistics.median(tt):.2f}" if tt else "-"
        if r.get("ttft_first_ms"):
            tt_s += f" (first after warm-up: {r['ttft_first_ms'][0]:.2f})"
        for k in cells:
            runs = r.get("loads", {}).get(k, [])
            if not runs:
                continue
            b = base.get("loads", {}).get(k, [])
            med = statistics.median(runs)
            ratio = med / statistics.median(b) if b and statistics.median(b) > 0 else None
            paired = paired_ratios(r, base, k)
            p_s = (
                f"{statistics.median(paired):.3f} [{min(paired):.3f}, {max(paired):.3f}] ({len(paired)})"
                if paired and r is not base
                else "-"
            )
            lines.append(
                f"| {r['name']} | {k} | {med:.0f} ({', '.join(f'{x:.0f}' for x in runs)}) | "
                f"{_fmt_ratio(ratio)} | {p_s} | {tt_s} |"
            )
    split_lines = []
    for r in rows:
        for k, seen in (r.get("router") or {}).items():
            ps = [x["p_speculative"] for x in seen if x.get("p_speculative") is not None]
            sent = [x["spec_requests"] for x in seen if x.get("spec_requests") is not None]
            sent_s = (
                f"{sum(1 for n in sent if n > 0)} of {len(sent)} ({', '.join(str(n) for n in sent)})" if sent else "-"
            )
            if ps:
                split_lines.append(
                    f"| {r['name']} | {k} | {statistics.median(ps):.3f} "
                    f"[{min(ps):.3f}, {max(ps):.3f}] ({len(ps)}) | {sent_s} |"
                )
    if split_lines:
        lines += [
            "",
            "| row | cell | share sent to the speculative engine at window ends: median [min, max] (n) "
            "| windows with requests to the speculative engine (requests per window) |",
            "|---|---|---|---|",
            *split_lines,
        ]
    return "\n".join(lines)


def paired_ratios(row: dict, base: dict, cell: str) -> list[float]:
    """Per-round ratios ``row / base`` for one cell, pairing windows by round id
    (``row["rounds"][cell]``; rows without round ids pair by position)."""
    a, b = row.get("loads", {}).get(cell, []), base.get("loads", {}).get(cell, [])
    ra = row.get("rounds", {}).get(cell, list(range(len(a))))
    rb = dict(zip(base.get("rounds", {}).get(cell, list(range(len(b)))), b))
    return [x / rb[i] for i, x in zip(ra, a) if rb.get(i)]


class AttachedEngine:
    """An engine left running by an earlier call (``--keep``): its URL, control token and
    process group, enough to load it, switch its routing and stop it."""

    def __init__(self, url: str, token: str, pid: int, log_path: str):
        self.url, self.token, self.pid, self.log_path = url, token, pid, Path(log_path)

    @property
    def control_headers(self) -> dict[str, str]:
        """``Authorization`` header for ``/control/*``."""
        return {"Authorization": f"Bearer {self.token}"}

    def alive(self) -> bool:
        """True while the process exists and is not a zombie."""
        try:
            os.kill(self.pid, 0)
            return Path(f"/proc/{self.pid}/stat").read_text().split(")")[-1].split()[0] != "Z"
        except (OSError, IndexError):
            return False

    def stop(self, timeout_s: float = 30.0) -> None:
        """SIGINT to the process group, SIGTERM after ``timeout_s``, SIGKILL 10 s later."""
        for sig, wait in ((signal.SIGINT, timeout_s), (signal.SIGTERM, 10.0), (signal.SIGKILL, 10.0)):
            try:
                os.killpg(self.pid, sig)
            except ProcessLookupError:
                return
            deadline = time.monotonic() + wait
            while time.monotonic() < deadline and self.alive():
                time.sleep(0.2)
            if not self.alive():
                return


def parse_mode(item: str) -> tuple[str, dict[str, float]]:
    """A ``--modes`` item: a routing mode, optionally with split settings for that row,
    ``MODE[:KEY=VALUE...]`` (``auto:tpot_margin=0.25:p_min=0``) -> ``("auto", {...})``.

    Raises:
        ValueError: an unknown mode, key or a value that is not a number.
    """
    from engine_host.router.settings import ROUTING_MODES, SPLIT_SETTINGS

    mode, *pairs = item.split(":")
    if mode not in ROUTING_MODES:
        raise ValueError(f"routing mode must be one of {', '.join(ROUTING_MODES)}, got {mode!r}")
    settings = {}
    for pair in pairs:
        key, eq, value = pair.partition("=")
        if not eq or key not in SPLIT_SETTINGS:
            raise ValueError(f"{pair!r}: expected KEY=VALUE with KEY one of {', '.join(SPLIT_SETTINGS)}")
        settings[key] = float(value)
    return mode, settings


async def router_state(eh) -> dict | None:
    """The dual engine host's ``router`` section of ``/control/state`` (share, settings,
    TPOT per engine, requests routed), or None when it does not answer."""
    try:
        async with httpx.AsyncClient(base_url=eh.url, headers=eh.control_headers, timeout=30) as c:
            r = await c.get("/control/state")
            r.raise_for_status()
            return r.json().get("router")
    except (httpx.HTTPError, ValueError):
        return None


async def set_routing(eh, item: str, base_settings: dict | None = None) -> None:
    """PUT the dual engine host's routing mode (a ``--modes`` item, :func:`parse_mode`) with
    its split settings on top of ``base_settings`` (the engine's own at the start), so that
    rows without settings run with the engine's defaults whatever row ran before."""
    mode, settings = parse_mode(item)
    body: dict = {"routing": mode}
    if base_settings or settings:
        body["router"] = {**(base_settings or {}), **settings}
    async with httpx.AsyncClient(base_url=eh.url, headers=eh.control_headers, timeout=30) as c:
        r = await c.put("/control/config", json=body)
        r.raise_for_status()


def load_state(path: Path | None) -> tuple[dict | None, list[dict]]:
    """``(results, live engines)`` from a ``--state`` file, or ``(None, [])`` when there is none."""
    if path is None or not path.exists():
        return None, []
    st = json.loads(path.read_text())
    return st["res"], st["live"]


async def _wait_up(started, engines: dict, live: list, res: dict, args, save) -> None:
    """Wait until one started engine answers ``/health`` (and ``/ready`` for engine hosts),
    then record it in ``engines``, ``live`` and the result rows; an engine that does not come
    up within 900 s is stopped and recorded with its ``error``."""
    name, eh, kind, rec = started
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
        return
    print(f"  {name} up in {rec.get('ready_s', rec['health_s'])} s", flush=True)
    engines[name] = (rec, eh, kind)
    live.append(
        {"name": name, "kind": kind, "url": eh.url, "token": eh.token, "pid": eh.proc.pid, "log_path": str(eh.log_path)}
    )
    for mode in args.modes if kind == "dual" else [None]:
        rname = f"{name}/{mode}" if mode else name
        if not any(r["name"] == rname for r in res["rows"]):
            res["rows"].append({"name": rname, "loads": {}, "rounds": {}, "ttft_ms": []})
    save()


async def run(args: argparse.Namespace) -> dict:
    """Start (or attach to) the engines, take the loads and TTFTs round-robin, stop them
    unless ``--keep``.

    Returns:
        ``{"engines": [...], "rows": [{"name", "loads": {"WORKLOAD@cN": [tokens/s, ...]},
        "rounds": {"WORKLOAD@cN": [round id, ...]}, "ttft_ms": [...]}], "rounds": N, "args"}``,
        also written to ``--out/overhead.json`` after each window. An engine that does not
        come up is recorded with its ``error`` and left out.
    """
    out = args.out
    # engines kept for a later call log next to the state file: --out may be emptied between calls
    logs = args.state.parent / "logs" if args.state else out / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    (out / "logs").mkdir(parents=True, exist_ok=True)
    model = str(prepare_default_model(quiet=True)) if args.model == "default" else args.model
    name_m = Path(model).name
    res, live = load_state(args.state)
    res = res or {"engines": [], "rows": [], "rounds": 0}
    res.setdefault("calls", []).append({k: str(v) for k, v in vars(args).items()})
    engines: dict[str, tuple[dict, object, str]] = {}  # name -> (engine record, process, kind)
    t_begin = time.monotonic()

    def save() -> None:
        (out / "overhead.json").write_text(json.dumps(res, indent=1))
        if args.state:
            args.state.parent.mkdir(parents=True, exist_ok=True)
            args.state.write_text(json.dumps({"res": res, "live": live}, indent=1))

    for lv in live:  # engines an earlier call left running
        eh = AttachedEngine(lv["url"], lv["token"], lv["pid"], lv["log_path"])
        rec = next(e for e in res["engines"] if e["name"] == lv["name"])
        if eh.alive():
            engines[lv["name"]] = (rec, eh, lv["kind"])
            print(f"== {lv['name']}: attached ({eh.url}, pid {eh.pid})", flush=True)
        else:
            rec["error"] = "gone before a later call attached"
            print(f"== {lv['name']}: gone, left out", flush=True)
    live[:] = [lv for lv in live if lv["name"] in engines]
    started: list = []  # every engine process started in this call
    try:
        todo = []  # (name, process, kind, record) of engines started and not yet waited for
        for spec in args.engine or []:
            name = spec.partition(":")[2].partition(":")[0] or spec
            if name in engines:
                continue
            if (engines or todo) and time.monotonic() - t_begin > args.start_budget:
                print(f"start budget of {args.start_budget:.0f} s spent: {spec!r} left out", flush=True)
                break
            name, eh, kind = make_engine(spec, model, logs)
            rec = {"name": name, "kind": kind, "command": shlex.join(eh.command()), "env": eh.env}
            print(f"== {name}: {rec['command']}", flush=True)
            res["engines"] = [e for e in res["engines"] if e["name"] != name] + [rec]
            eh.start()
            started.append(eh)
            todo.append((name, eh, kind, rec))
            if args.parallel_start:
                continue  # waited for below, all together
            await _wait_up(todo.pop(), engines, live, res, args, save)
        if todo:
            await asyncio.gather(*(_wait_up(t, engines, live, res, args, save) for t in todo))
        only = set(args.only) if args.only else set(engines)
        for ename, (_, _, kind) in engines.items():  # this call's --modes, on engines attached too
            for mode in args.modes if kind == "dual" else []:
                if not any(r["name"] == f"{ename}/{mode}" for r in res["rows"]):
                    res["rows"].append({"name": f"{ename}/{mode}", "loads": {}, "rounds": {}, "ttft_ms": []})
        rows = []  # (row record, process, routing mode)
        for row in res["rows"]:
            ename, _, mode = row["name"].partition("/")
            kind = engines[ename][2] if ename in engines else None
            if ename in only and kind is not None and (kind != "dual" or mode in args.modes):
                rows.append((row, engines[ename][1], mode or None))
        cells = [(wl, conc) for wl in args.workloads for conc in args.loads]
        # the first request an engine serves after its warm-up, before any load (the target
        # compares it with the steady-state TTFTs taken after each round)
        fresh = {id(eh) for eh in started}
        for row, eh, mode in rows:
            if id(eh) in fresh and not mode and "ttft_first_ms" not in row:
                row["ttft_first_ms"] = [await ttft(eh.url, name_m, Workload("chat", seed=args.seed + 5))]
                print(f"  {row['name']}: first request after warm-up, TTFT {row['ttft_first_ms'][0]} ms", flush=True)
        save()
        # per dual engine: its split settings as first seen (kept in the results, so that a later
        # call does not take the settings a row of the last call left in force for the defaults)
        known = res.setdefault("router_settings_at_start", {})
        base_settings: dict[int, dict | None] = {}
        for row, eh, mode in rows:
            ename = row["name"].partition("/")[0]
            if mode and id(eh) not in base_settings:
                if ename not in known:
                    known[ename] = ((await router_state(eh)) or {}).get("settings")
                base_settings[id(eh)] = known[ename]
        t_round = len(cells) * len(rows) * (args.warm + args.duration + 2.0)  # first guess, then measured
        for _ in range(args.rounds):
            left = args.time_budget - (time.monotonic() - t_begin) if args.time_budget else None
            if left is not None and left < t_round * 1.05:
                print(f"time budget: {left:.0f} s left, a round took {t_round:.0f} s: stopping", flush=True)
                break
            t0 = time.monotonic()
            rnd = res["rounds"]
            res["rounds"] += 1
            for wl, conc in cells:
                for row, eh, mode in rows:
                    if mode:
                        await set_routing(eh, mode, base_settings.get(id(eh)))
                    if args.warm > 0:  # untimed: caches, and the routing split settling after a switch
                        await closed_loop(eh.url, name_m, conc, args.warm, args.max_tokens, args.seed + 99, wl)
                    before = ((await router_state(eh) or {}).get("routed") or {}) if mode else {}
                    r = await closed_loop(eh.url, name_m, conc, args.duration, args.max_tokens, args.seed + rnd, wl)
                    cell = f"{wl}@c{conc}"
                    row["loads"].setdefault(cell, []).append(r["tokens_per_s"])
                    row.setdefault("rounds", {}).setdefault(cell, []).append(rnd)
                    extra = ""
                    if mode:  # where the split stood at the window's end
                        st = await router_state(eh) or {}
                        seen = {k: st.get(k) for k in ("p_speculative", "tpot_ms", "routed", "probes")}
                        # requests sent to the speculative engine during the timed window
                        seen["spec_requests"] = (seen["routed"] or {}).get("speculative", 0) - before.get(
                            "speculative", 0
                        )
                        row.setdefault("router", {}).setdefault(cell, []).append(seen)
                        extra = (
                            f" (p_speculative {seen['p_speculative']}, {seen['spec_requests']} requests to the "
                            f"speculative engine, TPOT ms {seen['tpot_ms']})"
                        )
                    print(f"  round {rnd + 1} {cell} {row['name']}: {r['tokens_per_s']} tok/s{extra}", flush=True)
                    save()
            ttft_wl = {row["name"]: Workload("chat", seed=args.seed + 7 + rnd) for row, _, _ in rows}
            for row, eh, mode in rows:
                if mode:
                    await set_routing(eh, mode, base_settings.get(id(eh)))
                for _ in range(args.ttfts):
                    row["ttft_ms"].append(await ttft(eh.url, name_m, ttft_wl[row["name"]]))
            save()
            t_round = time.monotonic() - t0
    finally:
        up = {id(e[1]) for e in engines.values()}
        for eh in started:  # interrupted while starting: never leave one behind, --keep or not
            if id(eh) not in up:
                eh.stop()
        if not args.keep:
            for rec, eh, _ in engines.values():
                eh.stop()
                rec["vllm_log"] = log_lines(eh.log_path)
            live.clear()
        if logs != out / "logs":
            for _, eh, _ in engines.values():
                if eh.log_path.exists():
                    shutil.copy(eh.log_path, out / "logs" / eh.log_path.name)
        save()
    return res


def main(argv: list[str] | None = None) -> int:
    """Command line; see the module docstring."""
    ap = argparse.ArgumentParser(
        prog="python -m bench host-overhead", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument(
        "--engine",
        action="append",
        help="serve:NAME:ARGS, host:NAME:ARGS or dual:NAME:ARGS (repeatable; the first is the baseline)",
    )
    ap.add_argument(
        "--modes",
        type=lambda s: [x for x in s.split(",") if x],
        default=["plain", "auto"],
        help="routing modes measured on each dual engine host, each a row of its own; a mode may "
        "carry split settings for its row, MODE:KEY=VALUE... (e.g. auto:tpot_margin=0.25); "
        "the p_speculative seen at each window's end is recorded",
    )
    ap.add_argument(
        "--workloads",
        type=lambda s: [x for x in s.split(",") if x],
        default=["chat"],
        help="harness workloads whose prompts the clients send (chat: open-ended, code: predictable)",
    )
    ap.add_argument(
        "--loads", type=lambda s: [int(x) for x in s.split(",") if x], default=[64], help="concurrencies (closed loop)"
    )
    ap.add_argument("--rounds", type=int, default=3, help="rounds over all engines")
    ap.add_argument("--duration", type=float, default=6.0, help="seconds per window")
    ap.add_argument("--warm", type=float, default=3.0, help="seconds of untimed load before each window")
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--ttfts", type=int, default=3, help="single-request TTFTs per engine per round")
    ap.add_argument(
        "--start-budget",
        type=float,
        default=420.0,
        help="seconds after which no further engine is started (the loads still run)",
    )
    ap.add_argument(
        "--time-budget",
        type=float,
        default=None,
        help="seconds for this call: no round is begun that the last round's time says would not fit",
    )
    ap.add_argument(
        "--state",
        type=Path,
        default=None,
        help="file recording the engines left running and the windows so far (see --keep); "
        "a later call continues its results: delete it to start afresh",
    )
    ap.add_argument("--keep", action="store_true", help="leave the engines running for a later call with --state")
    ap.add_argument(
        "--parallel-start",
        action="store_true",
        help="start every engine at once, then wait for all (give each --kv-cache-memory-bytes in its ARGS: "
        "vLLM's memory profiling assumes no other process on the GPU changes its memory while it runs)",
    )
    ap.add_argument(
        "--only",
        type=lambda s: [x for x in s.split(",") if x],
        default=None,
        help="engine names measured in this call (default: all)",
    )
    ap.add_argument("--baseline", default=None, help="row the table's ratios are taken against (default: the first)")
    ap.add_argument(
        "--report", type=Path, default=None, help="print the table of an overhead.json and exit (no engine is started)"
    )
    ap.add_argument(
        "--model",
        default="default",
        help="model folder (Hugging Face layout) served by every engine; 'default': the prepared default model",
    )
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "gpu-results")))
    args = ap.parse_args(argv)
    if args.model != "default" and not (Path(args.model) / "config.json").is_file():
        ap.error(f"--model {args.model}: no config.json there")
    if args.report:
        try:
            print(summarize(json.loads(args.report.read_text()), args.baseline))
        except (OSError, ValueError, KeyError) as exc:
            ap.error(f"--report {args.report}: {type(exc).__name__}: {exc}")
        return 0
    for item in args.modes:
        try:
            parse_mode(item)
        except ValueError as exc:
            ap.error(f"--modes {item!r}: {exc}")
    if not args.engine and not (args.state and args.state.exists()):
        ap.error("give at least one --engine, or a --state file of engines left running")
    if args.keep and not args.state:
        ap.error("--keep needs --state (the file a later call attaches from)")
    res = asyncio.run(run(args))
    try:
        print(summarize(res, args.baseline), flush=True)
    except KeyError:
        print(summarize(res), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
