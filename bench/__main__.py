"""``python -m bench``: the SpecPilot benchmark harness.

Subcommands:
    run        one workload at one load, for one or more speculation modes, on a running engine host
    matrix     workloads x loads x modes, side by side on one engine (optionally started here),
               with an optional plain-vLLM column from a second engine started with --k-max 0
    report     rebuild the summary tables and charts of a results folder
    workloads  where every prompt comes from, and a sample of prompts

    fleet      fleet scale: embedded collector against Prometheus with N stand-in hosts

and every other benchmark of the tree, each with its own options (:data:`TOOLS`;
``python -m bench <command> --help``; ``python -m bench.<module>`` still works):
    engine-host, collector, store, dashboard, warmup, draft-layers, profile-step,
    host-overhead, paired, qwen-models, planner-check, spread, torch-profile, hook-cost, stat-logger-cost, step-trace,
    gpu-clocks, cpu-pairs, cpu-idle, step-time-replay, policy-bursts, prior-fit

Results (JSON per cell, Plotly charts, summary tables) go to ``--out`` (default
``bench/results/<time>-<command>/``).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import shlex
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

import httpx
from tqdm import tqdm

from engine_host import envs

from .engine_control import BenchError, EngineControl, mode_patch
from .loadgen import Load
from .metrics import SLO
from .runner import CellSpec, run_cell
from .workloads import WORKLOADS, SourceMissing, Workload, describe_sources

DEFAULT_LOADS = {"low": "c1", "medium": "c4", "high": "c12"}
DEFAULT_MODES = "fixed:0,fixed:2,fixed:4,fixed:8,adaptive,threshold,heuristic,batch_table"
# Prefix caching off: cells of one workload send the same prompts in the same order, so a
# cached engine would give every cell after the first free prefills.
DEFAULT_ENGINE_ARGS = [
    "--enforce-eager",
    "--k-max",
    "8",
    "--max-num-seqs",
    "16",
    "--max-model-len",
    "2048",
    "--no-prefix-caching",
]
ENV_TOKEN = envs.CONTROL_TOKEN


#: ``python -m bench <command>``: the module of ``bench`` whose ``main(argv)`` runs it, and
#: what it measures. The command's own arguments follow it on the command line.
TOOLS: dict[str, tuple[str, str]] = {
    "engine-host": ("bench_engine_host", "engine host against plain vLLM: hook overhead, config latency, start-up"),
    "collector": ("bench_collector", "engine output tokens/s with and without the collector scraping /metrics"),
    "store": ("bench_store", "store: 7 days of 1 s samples for 4 hosts written, downsampled and read back"),
    "dashboard": ("bench_dashboard", "page render times with 7 days of stored samples for 4 hosts"),
    "warmup": ("bench_warmup", "cold start against warm: TTFT of the first real request"),
    "draft-layers": ("draft_layers", "acceptance per draft position of truncated drafts of the default model"),
    "profile-step": ("profile_step", "where a decode step's time goes: n-gram engine at K = 0 against plain"),
    "host-overhead": ("host_overhead", "engines side by side on one GPU: engine host against bare vllm serve"),
    "paired": (
        "paired",
        "running servers compared burst by burst on the same prompts, arms in a balanced order each round",
    ),
    "qwen-models": ("qwen_models", "fetch and check the opt-in Qwen2.5-Coder benchmark pair"),
    "planner-check": ("planner_check", "the planner's predicted mean latency against measured, rate by rate"),
    "spread": ("spread", "repeated matrix runs side by side: tokens/s per run, spread, target ratios per run"),
    "hook-cost": ("hook_cost", "the CPU time SpecPilot's scheduler hook adds to one step, without vLLM"),
    "stat-logger-cost": ("stat_logger_cost", "the CPU time SpecPilot's stat logger adds to one step, by batch size"),
    "step-trace": ("step_trace", "wall time of an engine step by its K, from $SPECPILOT_STEP_TRACE files"),
    "gpu-clocks": ("gpu_clocks", "the GPU's clocks, power and load sampled on the clock of the step traces"),
    "cpu-pairs": ("cpu_pairs", "which CPUs slow each other down: hyperthread siblings a hypervisor hides"),
    "cpu-idle": ("cpu_idle", "whether a CPU runs a burst of work at another speed after it idled"),
    "step-time-replay": ("step_time_replay", "the step-time model's price of each K replayed over a step trace"),
    "policy-bursts": ("policy_bursts", "the steps the adaptive policy drafts in, burst by burst, without vLLM"),
    "prior-fit": ("prior_fit", "where a new request's acceptance starts after a class's finished requests, per prior"),
    "torch-profile": ("torch_profile", "where a step's CPU and GPU time go, in one process, with PyTorch's profiler"),
}


def run_tool(command: str, argv: list[str]) -> int:
    """Run the :data:`TOOLS` entry ``command`` with its own arguments ``argv``.

    Raises:
        KeyError: ``command`` is not in :data:`TOOLS`.
    """
    import importlib

    module = importlib.import_module(f"bench.{TOOLS[command][0]}")
    return int(module.main(argv) or 0)


def parse_load(text: str) -> Load:
    """``c4`` -> 4 concurrent clients; ``r2.5`` -> Poisson 2.5 requests/s."""
    text = text.strip().lower()
    try:
        if text.startswith("c"):
            return Load(concurrency=int(text[1:]))
        if text.startswith("r"):
            return Load(rate=float(text[1:]))
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"bad load {text!r}: {exc}") from None
    raise argparse.ArgumentTypeError(f"bad load {text!r}: use cN (N concurrent clients) or rX (Poisson X req/s)")


def _csv(text: str) -> list[str]:
    return [t.strip() for t in text.split(",") if t.strip()]


def resolve_token(env_name: str) -> str | None:
    """The control token: ``$<env_name>``, else ``$SPECPILOT_HOME/control_token`` when it exists."""
    tok = os.environ.get(env_name)
    if tok:
        return tok.strip()
    path = envs.home_dir() / "control_token"
    return path.read_text().strip() if path.is_file() else None


def default_out(command: str) -> Path:
    """``bench/results/<YYYYmmdd-HHMMSS>-<command>`` beside this package."""
    return Path(__file__).resolve().parent / "results" / f"{time.strftime('%Y%m%d-%H%M%S')}-{command}"


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--max-tokens", type=int, default=128, help="output cap per request (tokens)")
    p.add_argument("--seed", type=int, default=0, help="prompt order, chat sampling seeds, Poisson arrivals")
    p.add_argument(
        "--shift-period", type=float, default=10.0, help="shift workload: seconds per phase (code, docs, chat)"
    )
    p.add_argument("--slo-ttft-ms", type=float, default=SLO.ttft_ms, help="goodput SLO: highest TTFT (ms)")
    p.add_argument(
        "--slo-tpot-ms", type=float, default=SLO.tpot_ms, help="goodput SLO: highest time per output token (ms)"
    )
    p.add_argument("--settle", type=float, default=1.0, help="pause after each mode switch (s)")
    p.add_argument(
        "--ramp",
        type=float,
        default=5.0,
        help="load runs this long before each measured window opens (s); figures cover the window only",
    )
    p.add_argument(
        "--requests-per-client",
        default=None,
        metavar="R|LOAD=R,...",
        help="fixed work instead of a time window: each cell sends R requests per client "
        "(closed loop) or R x rate x 10 requests (Poisson), the same prompts for every mode, "
        "and lasts until all finish; tokens/s = output tokens / makespan. One R for all loads "
        "or one per load name (e.g. low=8,medium=4,high=3). --duration and --ramp are then unused",
    )
    p.add_argument(
        "--shift-period-requests",
        type=int,
        default=None,
        help="with --requests-per-client: requests per phase of the shift workload "
        "(default: a sixth of the cell's requests, so that each cell cycles code, docs, chat twice)",
    )
    p.add_argument(
        "--warmup",
        type=float,
        default=5.0,
        help="untimed load before the first measured cell on each engine (s; 0: none)",
    )
    p.add_argument(
        "--api-key-env", default=None, help="environment variable holding the OpenAI API key, if the engine needs one"
    )
    p.add_argument("--out", type=Path, default=None, help="results folder (default bench/results/<time>-<command>)")
    p.add_argument("--no-png", action="store_true", help="HTML charts only (no Kaleido PNG export)")
    p.add_argument("--quiet", action="store_true", help="no progress bars")


def build_parser() -> argparse.ArgumentParser:
    """The CLI of ``python -m bench`` (the :data:`TOOLS` commands are listed, parsed by their modules)."""
    p = argparse.ArgumentParser(
        prog="python -m bench",
        description="SpecPilot benchmark harness: real-text workloads against an engine host, speculation modes side by side.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="Modes: off, fixed:K, adaptive[:LO-HI], batch_table[:1-2=6,3-8=4,...], threshold, "
        "heuristic[:LO-HI], plain (engine started with --k-max 0). Loads: cN = N concurrent "
        "clients, rX = Poisson arrivals at X requests/s. See docs/benchmarks.md.",
    )
    sub = p.add_subparsers(dest="command", required=True)

    r = sub.add_parser(
        "run",
        help="one workload and load, one or more modes, on a running engine host",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    r.add_argument("--url", required=True, help="engine host base URL, e.g. http://127.0.0.1:8000")
    r.add_argument("--token-env", default=ENV_TOKEN, help="environment variable holding the control token")
    r.add_argument("--workload", choices=WORKLOADS, required=True)
    r.add_argument("--mode", default="adaptive", help="mode, or several separated by commas (run one after another)")
    g = r.add_mutually_exclusive_group(required=True)
    g.add_argument("--rate", type=float, help="Poisson arrivals (requests/s), open loop")
    g.add_argument("--concurrency", type=int, help="concurrent clients, closed loop")
    r.add_argument("--duration", type=float, default=30.0, help="measurement window per mode (s)")
    _common(r)

    m = sub.add_parser(
        "matrix",
        help="workloads x loads x modes side by side, summary table with ratios",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    m.add_argument("--url", default=None, help="engine host base URL (or --start-engine)")
    m.add_argument("--token-env", default=ENV_TOKEN, help="environment variable holding the control token")
    m.add_argument(
        "--start-engine",
        action="store_true",
        help="start the engine host here (python -m engine_host ... --k-max 8) and stop it afterwards",
    )
    m.add_argument(
        "--plain-baseline",
        action="store_true",
        help="add a 'plain' column: an engine without speculative config (--k-max 0), started here "
        "(with --start-engine) or at --plain-url",
    )
    m.add_argument("--plain-url", default=None, help="base URL of a running plain engine host (--k-max 0)")
    m.add_argument("--plain-token-env", default=ENV_TOKEN, help="environment variable holding the plain engine's token")
    m.add_argument(
        "--model", default=None, help="--model for engines started here (default: the engine host's default)"
    )
    m.add_argument(
        "--engine-args",
        default=" ".join(DEFAULT_ENGINE_ARGS),
        help="further python -m engine_host arguments for engines started here (--k-max is replaced by 0 "
        "for the plain engine)",
    )
    m.add_argument("--workloads", default="code,docs,chat,shift", help="comma-separated workloads")
    m.add_argument("--loads", default="low,medium,high", help="comma-separated load names (see --load-def)")
    m.add_argument(
        "--load-def",
        action="append",
        default=[],
        metavar="NAME=LOAD",
        help="define or override a load, e.g. high=c8 or medium=r1.5 (defaults: "
        + ", ".join(f"{k}={v}" for k, v in DEFAULT_LOADS.items())
        + ")",
    )
    m.add_argument("--modes", default=DEFAULT_MODES, help="comma-separated modes, run in this order in each cell group")
    m.add_argument("--duration", type=float, default=25.0, help="measurement window per cell (s)")
    m.add_argument("--resume", action="store_true", help="skip cells whose JSON already exists in --out")
    m.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="run each (workload, load) group's modes this many times, one round after another, the even "
        "rounds in reverse order (see --order); round r goes to OUT/round-r and the spread over the rounds to "
        "OUT/spread.md",
    )
    m.add_argument(
        "--order",
        choices=("alternate", "shuffle"),
        default="alternate",
        help="order of the modes within a round: alternate (as given, reversed in even rounds) or shuffle (a "
        "fresh random order in every round, from --seed), so that a slow spell of the host that lasts a few "
        "cells does not fall on the same neighbouring modes in every round",
    )
    m.add_argument(
        "--side-by-side",
        action="store_true",
        help="with --start-engine --plain-baseline: keep the plain engine up beside the speculative one and "
        "run each group's plain cell inside the group's round (always so with --plain-url); otherwise the "
        "plain engine is started after the speculative one has run every cell",
    )
    _common(m)

    rp = sub.add_parser("report", help="rebuild summary tables and charts from the cell JSON files of a results folder")
    rp.add_argument("folder", type=Path, help="results folder of a run or matrix")
    rp.add_argument("--no-png", action="store_true", help="HTML charts only")

    w = sub.add_parser("workloads", help="prompt sources and a sample of prompts")
    w.add_argument("--workload", choices=WORKLOADS, default=None, help="show sample prompts of this workload")
    w.add_argument("--n", type=int, default=3, help="how many sample prompts")
    w.add_argument("--seed", type=int, default=0)
    from .bench_fleet import add_arguments as fleet_arguments

    fl = sub.add_parser(
        "fleet",
        help="fleet scale: embedded collector against Prometheus with N stand-in hosts, "
        "page render times with 7 days of data",
    )
    fleet_arguments(fl)
    for name, (_, help_text) in TOOLS.items():
        sub.add_parser(name, help=help_text, add_help=False)  # parsed by the tool itself (run_tool)
    from .faults import add_arguments as faults_arguments

    faults_arguments(
        sub.add_parser(
            "faults",
            help="fault injection into control up: kill -9 / SIGTERM / SIGSTOP of "
            "each process; orphans, recovery time, versions, store integrity",
        )
    )
    return p


def _slo(args: argparse.Namespace) -> SLO:
    return SLO(ttft_ms=args.slo_ttft_ms, tpot_ms=args.slo_tpot_ms)


def _bar(spec: CellSpec, quiet: bool, position: int = 0):
    if quiet:
        return None, None
    fixed_work = spec.num_requests is not None
    bar = tqdm(
        total=spec.num_requests if fixed_work else round(spec.ramp_s + spec.duration_s),
        desc=spec.label[:48],
        unit="req" if fixed_work else "s",
        leave=False,
        position=position,
        file=sys.stderr,
        dynamic_ncols=True,
    )

    def progress(elapsed: float, records: list) -> None:
        toks = sum(n for r in records for _, n in r.chunks)
        done = sum(1 for r in records if r.done_s is not None)
        bar.n = min(done if fixed_work else round(elapsed), bar.total)
        bar.set_postfix(req=len(records), tok_s=f"{toks / max(elapsed, 1e-9):.1f}", refresh=False)
        bar.refresh()

    return bar, progress


async def _warm_up(control: EngineControl, model: str, spec: CellSpec, seconds: float, api_key: str | None) -> None:
    """Untimed load on the first cell's workload so that the first measured cell does not pay
    for cold caches (first prefill shapes, allocator growth)."""
    from .loadgen import run_load
    from .workloads import Workload

    await run_load(
        control.url,
        model,
        Workload(spec.workload, seed=spec.seed + 1000, period_s=spec.shift_period_s),
        spec.load,
        seconds,
        spec.max_tokens,
        seed=spec.seed + 1000,
        api_key=api_key,
    )


@dataclass(frozen=True)
class CellJob:
    """One cell to run: ``engine`` names the engine it runs on (a key of the ``engines`` map
    of :func:`_run_cells`), ``spec`` the cell, ``out`` the folder its JSON goes to."""

    engine: str
    spec: CellSpec
    out: Path


async def _run_cells(
    engines: dict[str, tuple[str, str | None]],
    jobs: Sequence[CellJob],
    api_key: str | None,
    quiet: bool,
    outer=None,
    resume: bool = False,
    warmup_s: float = 0.0,
) -> list[dict[str, Any]]:
    """Run ``jobs`` in order; ``engines`` maps an engine name to its (base URL, control token).

    Each engine gets ``warmup_s`` seconds of untimed load on the workload of its first cell
    before that cell. A cell whose JSON exists in its folder is read back instead of run when
    ``resume`` is set.

    Returns:
        The cell results, in the order of ``jobs``.
    Raises:
        BenchError: an engine is unreachable or refuses a mode.
    """
    from .report import cell_figure, save_figure

    controls: dict[str, EngineControl] = {}
    models: dict[str, str] = {}
    results = []
    try:
        for job in jobs:
            spec, out = job.spec, job.out
            path = out / f"{spec.label}.json"
            if resume and path.is_file():
                results.append(json.loads(path.read_text()))
                if outer is not None:
                    outer.update(1)
                continue
            control = controls.get(job.engine)
            if control is None:
                url, token = engines[job.engine]
                control = controls[job.engine] = EngineControl(url, token)
                models[job.engine] = await control.served_model()
                if warmup_s > 0:
                    await _warm_up(control, models[job.engine], spec, warmup_s, api_key)
            bar, progress = _bar(spec, quiet, position=1 if outer is not None else 0)
            try:
                res = await run_cell(control, spec, model=models[job.engine], api_key=api_key, progress=progress)
            finally:
                if bar is not None:
                    bar.close()
            out.mkdir(parents=True, exist_ok=True)
            path.write_text(json.dumps(res, indent=1))
            save_figure(cell_figure(res), out / "charts" / f"{spec.label}.html", png=False)
            results.append(res)
            c = res["client"]
            line = (
                f"{spec.label}: {c['output_tokens_per_s']:.1f} tok/s, goodput {c['goodput_tokens_per_s']:.1f}, "
                f"TTFT p50 {c['ttft_ms']['p50']} ms, ITL mean {c['itl_ms']['mean']} ms, "
                f"acceptance {res['acceptance']['acceptance_rate']}, mean K {res['k']['mean_k_steps']}"
            )
            if out.name.startswith("round-"):
                line = f"[{out.name}] " + line
            if c["requests"]["failed"]:
                line += f"; {c['requests']['failed']} requests failed, e.g. {c['errors'][0]['error']}"
            (outer.write if outer is not None else (lambda s: print(s, file=sys.stderr)))(line)
            if outer is not None:
                outer.update(1)
    finally:
        for control in controls.values():
            await control.aclose()
    return results


def matrix_jobs(
    groups: Sequence[tuple[str, str]],
    modes: Sequence[str],
    cell: Callable[[str, str, str], CellSpec],
    out: Path,
    rounds: int = 1,
    plain: bool = False,
    together: bool = False,
    order: str = "alternate",
    seed: int = 0,
) -> list[list[CellJob]]:
    """The order of a matrix run's cells, as phases (each a list of jobs run one after another).

    Args:
        groups: (workload, load name) cell groups, in order.
        modes: the speculative engine's modes, in order.
        cell: ``cell(workload, load name, mode) -> CellSpec``.
        out: the results folder; with ``rounds > 1`` round r goes to ``out/round-r``.
        rounds: how many times each group's modes run (>= 1). Even rounds run the modes in
            reverse order, so that a drift of the host over a group weighs on every mode alike.
        plain: add the plain-vLLM column (mode ``plain``, engine ``plain``).
        together: both engines are up at once: each group's plain cell runs inside the group's
            round, beside the modes (one phase). Otherwise the plain engine's cells run in a
            second phase, after every cell of the speculative engine.
        order: ``"alternate"`` (the order above) or ``"shuffle"``: every (group, round) runs its
            modes in a random order drawn from ``seed``, the same for the same arguments.
        seed: the shuffle's seed.
    Returns:
        ``[phase, ...]``; each job's ``engine`` is ``"spec"`` or ``"plain"``.
    Raises:
        ValueError: ``rounds < 1`` or an unknown ``order``.
    """
    if rounds < 1:
        raise ValueError("rounds must be >= 1")
    if order not in ("alternate", "shuffle"):
        raise ValueError(f"order must be alternate or shuffle, not {order!r}")

    def folder(r: int) -> Path:
        return out if rounds == 1 else out / f"round-{r}"

    def ordered(seq: list[str], r: int, g: int = 0) -> list[str]:
        if order == "shuffle":
            shuffled = list(seq)
            random.Random(f"{seed}/{g}/{r}").shuffle(shuffled)
            return shuffled
        return seq if r % 2 == 1 else list(reversed(seq))

    spec_modes = list(modes)
    if plain and together:
        both = spec_modes + ["plain"]
        return [
            [
                CellJob("plain" if m == "plain" else "spec", cell(w, ld, m), folder(r))
                for g, (w, ld) in enumerate(groups)
                for r in range(1, rounds + 1)
                for m in ordered(both, r, g)
            ]
        ]
    phases = [
        [
            CellJob("spec", cell(w, ld, m), folder(r))
            for g, (w, ld) in enumerate(groups)
            for r in range(1, rounds + 1)
            for m in ordered(spec_modes, r, g)
        ]
    ]
    if plain:
        phases.append(
            [CellJob("plain", cell(w, ld, "plain"), folder(r)) for w, ld in groups for r in range(1, rounds + 1)]
        )
    return [p for p in phases if p]


def _finish(results: list[dict[str, Any]], out: Path, png: bool, meta: dict[str, Any]) -> dict[str, Path]:
    from .report import cell_figure, save_figure, save_pngs, summary_figure, summary_rows, write_summary

    paths = write_summary(results, out, meta)
    saved = save_figure(summary_figure(summary_rows(results)), out / "charts" / "summary.html", png=png)
    error = saved["png_error"]
    if png and saved["png"]:
        error = save_pngs([(cell_figure(res), out / "charts" / f"{res['label']}.png") for res in results])
    if error:
        print(f"PNG export unavailable ({error}); HTML charts only", file=sys.stderr)
    return paths


def _num_requests(args: argparse.Namespace, load: Load, label: str | None = None) -> int | None:
    """Requests per cell for ``--requests-per-client`` (None: a time window)."""
    spec = args.requests_per_client
    if spec is None:
        return None
    try:
        if "=" in spec:
            per = {k.strip(): int(v) for k, v in (item.split("=", 1) for item in _csv(spec))}
            if label not in per:
                raise SystemExit(f"error: --requests-per-client names no R for load {label!r}")
            r = per[label]
        else:
            r = int(spec)
    except ValueError:
        raise SystemExit(f"error: --requests-per-client {spec!r}: give R or LOAD=R,... with integers") from None
    if r < 1:
        raise SystemExit("error: --requests-per-client must be >= 1")
    if load.concurrency is not None:
        return r * load.concurrency
    return max(1, round(r * (load.rate or 1.0) * 10))


def _shift_period(args: argparse.Namespace, num_requests: int | None) -> int:
    """Requests per shift phase in fixed-work cells."""
    if args.shift_period_requests is not None:
        if args.shift_period_requests < 1:
            raise SystemExit("error: --shift-period-requests must be >= 1")
        return args.shift_period_requests
    return max(1, (num_requests or 6) // 6)


def _cell_spec(args: argparse.Namespace, workload: str, mode: str, load: Load, label: str | None = None) -> CellSpec:
    """One cell of ``run`` or ``matrix`` from the common options (``label``: the load's name)."""
    n = _num_requests(args, load, label)
    return CellSpec(
        workload=workload,
        mode=mode,
        load=load,
        duration_s=args.duration,
        max_tokens=args.max_tokens,
        seed=args.seed,
        shift_period_s=args.shift_period,
        slo=_slo(args),
        settle_s=args.settle,
        ramp_s=args.ramp,
        num_requests=n,
        shift_period_requests=_shift_period(args, n),
        load_label=label,
    )


def cmd_run(args: argparse.Namespace) -> int:
    """``python -m bench run``."""
    modes = _csv(args.mode)
    for m in modes:
        mode_patch(m)  # validate before touching the engine
    load = Load(rate=args.rate) if args.rate is not None else Load(concurrency=args.concurrency)
    out = args.out or default_out("run")
    out.mkdir(parents=True, exist_ok=True)
    specs = [_cell_spec(args, args.workload, m, load) for m in modes]
    api_key = os.environ.get(args.api_key_env) if args.api_key_env else None
    results = asyncio.run(
        _run_cells(
            {"spec": (args.url, resolve_token(args.token_env))},
            [CellJob("spec", spec, out) for spec in specs],
            api_key,
            args.quiet,
            warmup_s=args.warmup,
        )
    )
    meta = {"command": "python -m bench " + shlex.join(sys.argv[1:]), "finished_at_unix": time.time()}
    (out / "results.json").write_text(json.dumps({"meta": meta, "runs": results}, indent=1))
    paths = _finish(results, out, not args.no_png, meta)
    print(paths["md"].read_text())
    print(f"results: {out}")
    return 0


def _start_engine(args: argparse.Namespace, out: Path, plain: bool):
    from engine_host.process import EngineHostProcess

    extra = shlex.split(args.engine_args)
    if plain:
        if "--k-max" in extra:
            i = extra.index("--k-max")
            extra[i + 1] = "0"
        else:
            extra += ["--k-max", "0"]
    elif "--k-max" not in extra:
        extra += ["--k-max", "8"]
    if not plain:
        extra += ["--speculation-mode", "fixed", "--k", "0"]
    home = out / ("engine-home-plain" if plain else "engine-home")
    home.mkdir(parents=True, exist_ok=True)
    env = {envs.HOME: os.environ.get(envs.HOME, str(home))}
    eh = EngineHostProcess(
        model=args.model, extra_args=extra, env=env, log_path=out / ("engine-plain.log" if plain else "engine.log")
    )
    print(f"starting {'plain ' if plain else ''}engine host: {shlex.join(eh.command())}", file=sys.stderr)
    eh.start()
    try:
        secs = eh.wait_ready(timeout_s=600)
    except Exception:
        eh.stop()
        raise
    print(f"engine ready in {secs:.0f} s at {eh.url}", file=sys.stderr)
    return eh


def cmd_matrix(args: argparse.Namespace) -> int:
    """``python -m bench matrix``."""
    if not args.start_engine and not args.url:
        raise BenchError("give --url of a running engine host, or --start-engine")
    if args.plain_baseline and not args.start_engine and not args.plain_url:
        raise BenchError("--plain-baseline needs --start-engine or --plain-url")
    if args.rounds < 1:
        raise BenchError("--rounds must be >= 1")
    if args.side_by_side and not args.plain_baseline:
        raise BenchError("--side-by-side keeps a plain engine beside the speculative one: add --plain-baseline")
    loads_def = dict(DEFAULT_LOADS)
    for d in args.load_def:
        name, _, val = d.partition("=")
        loads_def[name.strip()] = val.strip()
    loads = {}
    for name in _csv(args.loads):
        if name not in loads_def:
            raise BenchError(f"unknown load {name!r}: define it with --load-def {name}=c4 (or rX)")
        loads[name] = parse_load(loads_def[name])
    workloads = _csv(args.workloads)
    for w in workloads:
        if w not in WORKLOADS:
            raise BenchError(f"unknown workload {w!r}; choose from {', '.join(WORKLOADS)}")
    modes = _csv(args.modes)
    for m in modes:
        mode_patch(m)
    out = args.out or default_out("matrix")
    out.mkdir(parents=True, exist_ok=True)
    api_key = os.environ.get(args.api_key_env) if args.api_key_env else None

    def cell(w: str, lname: str, mode: str) -> CellSpec:
        return _cell_spec(args, w, mode, loads[lname], lname)

    together = bool(args.plain_baseline and (args.plain_url or args.side_by_side))
    groups = [(w, lname) for w in workloads for lname in loads]
    phases = matrix_jobs(
        groups, modes, cell, out, args.rounds, args.plain_baseline, together, order=args.order, seed=args.seed
    )
    outer = (
        None
        if args.quiet
        else tqdm(total=sum(len(p) for p in phases), desc="cells", position=0, file=sys.stderr, dynamic_ncols=True)
    )
    done: list[tuple[Path, dict[str, Any]]] = []  # (folder, cell result)
    started: list[Any] = []
    try:
        for jobs in phases:
            names = sorted({j.engine for j in jobs})
            engines: dict[str, tuple[str, str | None]] = {}
            try:
                for name in names:
                    plain = name == "plain"
                    if args.start_engine:
                        eh = _start_engine(args, out, plain)
                        started.append(eh)
                        engines[name] = (eh.url, eh.token)
                    else:
                        url = args.plain_url if plain else args.url
                        engines[name] = (url, resolve_token(args.plain_token_env if plain else args.token_env))
                got = asyncio.run(
                    _run_cells(engines, jobs, api_key, args.quiet, outer, args.resume, warmup_s=args.warmup)
                )
                done += [(job.out, res) for job, res in zip(jobs, got)]
            finally:
                while started:
                    started.pop().stop()
    finally:
        if outer is not None:
            outer.close()
    meta = {
        "command": "python -m bench " + shlex.join(sys.argv[1:]),
        "finished_at_unix": time.time(),
        "loads": {k: loads_def[k] for k in loads},
        "modes": modes,
        "duration_s": args.duration,
        "rounds": args.rounds,
        "order": args.order,
        "plain_beside_modes": together,
    }
    # rows in workload/load order with the plain column beside the same-engine modes
    order = {g: i for i, g in enumerate(groups)}
    folders = [out] if args.rounds == 1 else [out / f"round-{r}" for r in range(1, args.rounds + 1)]
    for folder in folders:
        mine = [res for f, res in done if f == folder]
        mine.sort(key=lambda r: order.get((r["spec"]["workload"], r["spec"]["load"]["label"]), 0))
        paths = _finish(mine, folder, not args.no_png, meta)
        if args.rounds == 1:
            print(paths["md"].read_text())
    if args.rounds > 1:
        from .spread import load_hook_shares, load_runs, render, spread_table

        text = render(spread_table(load_runs(folders), load_hook_shares(folders)), len(folders))
        (out / "spread.md").write_text(f"Command: `{meta['command']}`\n\n{text}\n")
        print(text)
    print(f"results: {out}")
    return 0


def cmd_report(args: argparse.Namespace) -> int:
    """``python -m bench report FOLDER``: summary and charts again from ``FOLDER/*.json`` cells."""
    results = []
    for path in sorted(args.folder.glob("*.json")):
        if path.name in ("summary.json", "results.json"):
            continue
        doc = json.loads(path.read_text())
        if "client" in doc and "spec" in doc:
            results.append(doc)
    if not results:
        raise BenchError(f"no cell results (*.json) in {args.folder}")
    old = args.folder / "summary.json"
    meta = json.loads(old.read_text()).get("meta", {}) if old.is_file() else {}
    order = {}
    for r in results:  # keep groups together: workload, then load, then mode order of first appearance
        order.setdefault((r["spec"]["workload"], r["spec"]["load"]["label"]), len(order))
    results.sort(
        key=lambda r: (
            r["spec"]["workload"],
            order[(r["spec"]["workload"], r["spec"]["load"]["label"])],
            r["started_at_unix"],
        )
    )
    paths = _finish(results, args.folder, not args.no_png, meta)
    print(paths["md"].read_text())
    return 0


def cmd_workloads(args: argparse.Namespace) -> int:
    """``python -m bench workloads``."""
    for d in describe_sources():
        print(f"{d['workload']}: {d['prompts']} prompts\n  {d['source']}")
    print("shift: code -> docs -> chat, each for --shift-period seconds, repeating")
    if args.workload:
        wl = Workload(args.workload, seed=args.seed)
        for i in range(args.n):
            p = wl.next_prompt(i * wl.period_s if args.workload == "shift" else 0.0)
            text = p.prompt if p.prompt is not None else p.messages[-1]["content"]
            print(f"\n--- [{p.workload}] {p.source} (temperature {p.temperature}, seed {p.seed})\n{text[:600]}")
    return 0


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``python -m bench``."""
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv and argv[0] in TOOLS:
        return run_tool(argv[0], argv[1:])
    args = build_parser().parse_args(argv)
    try:
        if args.command == "fleet":
            from .bench_fleet import main as fleet_main

            return fleet_main(args)
        if args.command == "faults":
            from .faults import main as faults_main

            return faults_main(args)
        return {"run": cmd_run, "matrix": cmd_matrix, "report": cmd_report, "workloads": cmd_workloads}[args.command](
            args
        )
    except (BenchError, SourceMissing) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except httpx.TransportError as exc:  # an engine that is not up, or went away mid-run
        try:
            where = str(exc.request.url)
        except RuntimeError:  # no request attached
            where = "the engine"
        why = str(exc) or type(exc).__name__  # some transport errors carry no message
        print(
            f"error: cannot reach {where}: {why}. Is the engine running? "
            "Check --url / --plain-url, or let the bench start one with --start-engine.",
            file=sys.stderr,
        )
        return 2
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
