"""Where a decode step's time goes: an engine with an n-gram config at K = 0 against a
plain engine (no speculative config), on the same chat prompts.

    python -m bench profile-step [--clients 4] [--seconds 20] [--rate 100]
    python -m bench profile-step --attach STATE [--engines plain,ngram] [--workload code]   # engines already up
    python -m bench profile-step --report DIR   # an earlier run's table, its raw samples counted again

Starts both engine hosts (eager, one after the other so they do not share the CPU while
measured), sends the ``chat`` workload (``--workload``: any of ``bench.workloads.WORKLOADS``,
e.g. ``code``, where an adaptive engine host switches K) with N concurrent clients, and samples every
vLLM process of the engine with py-spy (PyPI ``py-spy``) for ``--seconds``. Each sample's
stack is put in one component (SpecPilot's step trace, SpecPilot's hook and controller, model
forward, n-gram proposer, draft-model or EAGLE speculator, sampler and rejection sampler, input
preparation, scheduler, output processing, other; :func:`component_of`). Prints, per engine and
component, the share of the busy samples of the process that runs the model and its
CPU time in ms per engine step (samples / rate / steps; steps from ``/control/state``). With
``--attach`` the API server's process is sampled too (:data:`FRONTEND_COMPONENTS`), in a second
table: vLLM's front end and SpecPilot's plugins run there, beside the engine core.
"""

from __future__ import annotations

import argparse
import collections
import json
import lzma
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, Callable

import httpx

from .workloads import WORKLOADS

#: frames of the draft-model and EAGLE speculators (V1 ``draft_model``/``eagle``, V2
#: ``standalone_ar``/``target_dependent_ar``/``eagle``): everything they call, the draft
#: model's own forward included, is counted as theirs
DRAFT_SPECULATOR_KEYS = (
    "DraftModelSpeculator",
    "StandaloneARSpeculator",
    "spec_decode/draft_model",
    "spec_decode/eagle",
    "spec_decode/standalone_ar",
    "spec_decode/target_dependent_ar",
)

#: the step trace of the benchmarks (``$SPECPILOT_STEP_TRACE``), told apart from the rest of SpecPilot
TRACE_KEYS = ("engine_host/step_trace", "_trace_row", "_untime_trace")

COMPONENTS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("SpecPilot step trace (benchmarks only)", TRACE_KEYS),
    ("SpecPilot hook and controller", ("engine_host/",)),
    (
        "n-gram proposer",
        ("ngram_proposer", "batch_propose", "propose_draft_token_ids", "NgramGPUSpeculator", "spec_decode/ngram"),
    ),
    ("draft-model / EAGLE speculator", DRAFT_SPECULATOR_KEYS),
    ("sampler / rejection sampler", ("rejection_sampler", "sampler.py", "_sample", "logits_processor")),
    ("model forward", ("forward", "torch/nn/modules", "_call_impl", "attention", "model_executor/models")),
    ("input preparation", ("_prepare_inputs", "_update_states", "prepare_", "input_batch", "_calc_spec_decode")),
    ("output / bookkeeping", ("_bookkeeping", "output", "update_from_output", "tolist")),
    ("scheduler", ("scheduler.py", "core/sched")),
)


def component_of(stack: str) -> str:
    """The component a collapsed stack (``frame;frame;...``) belongs to.

    The draft-model / EAGLE speculator when any frame is one of theirs
    (:data:`DRAFT_SPECULATOR_KEYS`). Else SpecPilot's own (its step trace, :data:`TRACE_KEYS`,
    or the hook and controller) when the innermost frame of vLLM or SpecPilot is SpecPilot's:
    a SpecPilot wrapper around a vLLM method (``engine_host.vllm_patches``, the hook's
    ``super()`` calls) does not take vLLM's work under it. Else innermost-first matching of
    :data:`COMPONENTS` over the frames that are not SpecPilot's (the first component found
    scanning from the leaf)."""
    frames = stack.split(";")
    if any(k in frame for frame in frames for k in DRAFT_SPECULATOR_KEYS):
        return "draft-model / EAGLE speculator"
    for frame in reversed(frames):
        if "engine_host/" in frame:
            return COMPONENTS[0][0] if any(k in frame for k in TRACE_KEYS) else COMPONENTS[1][0]
        if "vllm/" in frame:
            break
    for frame in reversed(frames):
        if "engine_host/" in frame:
            continue
        for name, keys in COMPONENTS[2:]:
            if any(k in frame for k in keys):
                return name
    return "other"


#: components of the API-server process (vLLM's OpenAI-compatible server and its engine client),
#: innermost vLLM or SpecPilot frame first
FRONTEND_COMPONENTS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("SpecPilot (stat logger, endpoints, plugins)", ("engine_host/",)),
    ("vLLM output processing and detokenization", ("output_processor", "detokeniz", "v1/engine/async_llm")),
    ("vLLM metrics and stat loggers", ("v1/metrics",)),
    ("vLLM OpenAI server and input processing", ("entrypoints", "input_processor", "v1/engine/processor", "tokeniz")),
)


def frontend_component_of(stack: str) -> str:
    """The component (:data:`FRONTEND_COMPONENTS`) of one collapsed stack of the API-server
    process: that of the innermost frame of vLLM or SpecPilot, "other" when none matches
    (the event loop, HTTP libraries, threads outside vLLM)."""
    for frame in reversed(stack.split(";")):
        if "engine_host/" in frame or "vllm/" in frame:
            for name, keys in FRONTEND_COMPONENTS:
                if any(k in frame for k in keys):
                    return name
    return "other"


def components_of(path: Path, classify: Callable[[str], str] | None = None) -> collections.Counter:
    """Samples per component (``classify``, default :func:`component_of`) of one py-spy ``raw``
    file (lines ``frame;frame;... COUNT``; ``PATH.xz``, xz-compressed, where ``PATH`` is not
    there); an empty counter for a missing file. Lines that do not end in a count are skipped."""
    classify = classify or component_of
    comps: collections.Counter = collections.Counter()
    packed = path.with_name(path.name + ".xz")
    if not path.exists() and packed.exists():
        text = lzma.decompress(packed.read_bytes()).decode()
    else:
        text = path.read_text() if path.exists() else ""
    if text:
        for line in text.splitlines():
            stack, _, n = line.rpartition(" ")
            if stack and n.isdigit():
                comps[classify(stack)] += int(n)
    return comps


def _engine_pids(root_pid: int) -> list[int]:
    out = subprocess.run(["ps", "-eo", "pid,ppid"], capture_output=True, text=True).stdout.split("\n")[1:]
    children = collections.defaultdict(list)
    for line in out:
        parts = line.split()
        if len(parts) == 2:
            children[int(parts[1])].append(int(parts[0]))
    seen, todo = [], [root_pid]
    while todo:
        p = todo.pop()
        seen.append(p)
        todo.extend(children.get(p, []))
    return seen


def _load(url: str, model: str, clients: int, stop: threading.Event, workload: str = "chat") -> list[threading.Thread]:
    """``clients`` threads sending requests of ``workload`` (64 tokens each) until ``stop`` is
    set; returns them. A request cut off after ``stop`` is set (the engine is being stopped)
    ends its thread quietly."""
    from .workloads import Workload

    wl = Workload(workload, seed=1)
    lock = threading.Lock()

    def client() -> None:
        with httpx.Client(base_url=url, timeout=120) as c:
            while not stop.is_set():
                with lock:
                    p = wl.next_prompt()
                try:
                    c.post(p.path, json=p.body(model, 64))
                except httpx.HTTPError:
                    if stop.is_set():
                        return
                    raise

    threads = [threading.Thread(target=client, daemon=True) for _ in range(clients)]
    for t in threads:
        t.start()
    return threads


def _py_spy(explicit: str | None = None) -> str:
    """Path of the py-spy executable: ``explicit``, the one next to this Python, or on PATH.

    Raises:
        FileNotFoundError: none found (install it: ``pip install py-spy``).
    """
    for cand in (explicit, str(Path(sys.executable).parent / "py-spy"), shutil.which("py-spy")):
        if cand and Path(cand).exists():
            return cand
    raise FileNotFoundError("py-spy not found: pip install 'py-spy>=0.4' (or pass --py-spy PATH)")


def _sample(
    pids: list[int], seconds: float, rate: int, out_dir: Path, tag: str, py_spy: str, frontend: int | None = None
) -> dict:
    """py-spy every process of ``pids`` at once for ``seconds``; returns ``{"pid",
    "components": {name: samples}, "wall_s"}`` for the process with the most model-forward
    samples (the one running the model), and with ``frontend`` (the API server's pid, one of
    ``pids``) ``"frontend": {"pid", "components"}`` by :func:`frontend_component_of`."""
    procs, files = [], []
    for pid in pids:
        f = out_dir / f"pyspy-{tag}-{pid}.txt"
        files.append((pid, f))
        cmd = [py_spy, "record", "-p", str(pid), "-d", str(int(seconds)), "-r", str(rate), "-f", "raw"]
        procs.append(
            subprocess.Popen(
                [*cmd, "-o", str(f), "--nonblocking"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
            )
        )
    t0 = time.monotonic()
    for p in procs:
        p.wait()
    wall = time.monotonic() - t0
    best: dict = {}
    for pid, f in files:
        if pid == frontend:
            continue
        comps = components_of(f)
        # the process that runs the model (on CPU the executor's worker, not the engine core,
        # which has as many samples: it spins while the worker computes)
        if comps["model forward"] > best.get("components", {}).get("model forward", -1):
            best = {"pid": pid, "components": dict(comps)}
    if frontend is not None:
        f = dict(files)[frontend]
        best["frontend"] = {"pid": frontend, "components": dict(components_of(f, frontend_component_of))}
    return {"wall_s": wall, **best}


def profile(
    extra: list[str], clients: int, seconds: float, rate: int, out_dir: Path, py_spy: str, workload: str = "chat"
) -> dict:
    """Start one engine host with ``extra`` arguments, load it, sample it; returns
    ``{"steps": n, "wall_s": s, "rate", "pid", "components": {name: count}}`` for the
    process with the most samples (the one running the model)."""
    from engine_host.process import EngineHostProcess

    tag = "plain" if "0" == extra[1] else "spec"
    eh = EngineHostProcess(
        extra_args=["--enforce-eager", "--max-num-seqs", "16", "--no-prefix-caching", *extra],
        log_path=out_dir / f"engine-{tag}.log",
    )
    eh.start()
    try:
        eh.wait_ready(timeout_s=600)
        model = httpx.get(eh.url + "/v1/models").json()["data"][0]["id"]
        stop = threading.Event()
        threads = _load(eh.url, model, clients, stop, workload)
        time.sleep(5)  # let the batch fill
        pids = [p for p in _engine_pids(eh.proc.pid) if p != eh.proc.pid]
        s0 = httpx.get(eh.url + "/control/state", headers=eh.control_headers).json()["engine"]["step_index"]
        res = _sample(pids, seconds, rate, out_dir, tag, py_spy)
        s1 = httpx.get(eh.url + "/control/state", headers=eh.control_headers).json()["engine"]["step_index"]
        stop.set()
        for t in threads:  # their requests in flight finish before the engine stops
            t.join(timeout=60)
    finally:
        stop.set()
        eh.stop()
    return {"steps": s1 - s0, "rate": rate, **res}


def _engine_steps(url: str) -> float:
    """Engine steps with output so far: the count of vLLM's ``vllm:iteration_tokens_total``
    histogram (one observation per step)."""
    from .gpu_bench import metric_total

    return metric_total(httpx.get(url + "/metrics", timeout=30).text, "vllm:iteration_tokens_total_count")


def profile_attached(
    live: dict,
    clients: int,
    seconds: float,
    rate: int,
    out_dir: Path,
    py_spy: str,
    mode: str | None = None,
    workload: str = "chat",
) -> dict:
    """Load an engine that is already up (a ``bench host-overhead --keep`` state entry:
    ``{"name", "url", "pid", "token"}``, plain ``vllm serve`` or engine host), sample its
    processes; returns what :func:`profile` returns, steps from vLLM's metrics. ``mode``
    (e.g. ``fixed:4``, see ``bench.engine_control``) is applied first on an engine host.

    Raises:
        BenchError: the engine host refused ``mode``.
    """
    url = live["url"]
    if mode and live.get("kind", "host") == "host" and live.get("token"):  # bare vLLM: left as it is
        import asyncio

        from .engine_control import EngineControl

        async def _apply() -> None:
            ctl = EngineControl(url, live["token"])
            try:
                await ctl.apply_mode(mode)
            finally:
                await ctl.aclose()

        asyncio.run(_apply())
    model = httpx.get(url + "/v1/models", timeout=30).json()["data"][0]["id"]
    stop = threading.Event()
    clients_running = _load(url, model, clients, stop, workload)
    try:
        time.sleep(5)  # let the batch fill
        api = int(live["pid"])  # the API server (vLLM's OpenAI-compatible server); the engine core below it
        pids = [api] + [p for p in _engine_pids(api) if p != api]
        s0 = _engine_steps(url)
        res = _sample(pids, seconds, rate, out_dir, live["name"], py_spy, frontend=api if len(pids) > 1 else None)
        s1 = _engine_steps(url)
    finally:
        stop.set()
        for t in clients_running:  # their last requests end before the next engine is loaded
            t.join(timeout=120)
    return {"steps": s1 - s0, "rate": rate, **res}


def _component_rows(names: list[str], columns: dict[str, tuple[dict, dict]]) -> list[str]:
    """Markdown rows: a header, then per component name its CPU ms per engine step and share
    of the process's samples, one column pair per engine. ``columns``: engine name ->
    (result with ``rate`` and ``steps``, ``{component: samples}``)."""
    lines = [
        f"| component | {' | '.join(f'{n}: ms/step | share' for n in columns)} |",
        "|---|" + "---:|---:|" * len(columns),
    ]
    for c in names:
        cells = []
        for r, comps in columns.values():
            share = comps.get(c, 0) / (sum(comps.values()) or 1)
            ms = comps.get(c, 0) / r["rate"] * 1000.0 / max(r["steps"], 1)
            cells.append(f"{ms:.3f} | {share:.1%}")
        lines.append(f"| {c} | {' | '.join(cells)} |")
    return lines


def table(results: dict) -> str:
    """Markdown: per component, CPU ms per engine step and share of the model process's
    samples, one column pair per engine; steps/s last. Where the API server was sampled,
    a second table of its components (:data:`FRONTEND_COMPONENTS`)."""
    names = [c for c, _ in COMPONENTS] + ["other"]
    lines = _component_rows(names, {n: (r, r.get("components", {})) for n, r in results.items()})
    lines.append("| steps/s | " + " | ".join(f"{r['steps'] / r['wall_s']:.1f} | " for r in results.values()) + "|")
    fronts = {n: (r, r["frontend"].get("components", {})) for n, r in results.items() if r.get("frontend")}
    if fronts:
        lines += [
            "",
            "API server process (vLLM's OpenAI-compatible server, its engine client and SpecPilot's plugins):",
            "",
        ]
        lines += _component_rows([c for c, _ in FRONTEND_COMPONENTS] + ["other"], fronts)
    return "\n".join(lines)


def _raw_samples(folder: Path, name: str, pid: Any) -> Path | None:
    """The raw samples of process ``pid`` in ``folder`` as :func:`components_of` takes them
    (``pyspy-NAME-PID.txt``, else any ``pyspy-*-PID.txt``; each also found xz-compressed),
    None when there are none."""
    for f in [folder / f"pyspy-{name}-{pid}.txt", *sorted(folder.glob(f"pyspy-*-{pid}.txt*"))]:
        base = f.with_suffix("") if f.suffix == ".xz" else f
        if base.exists() or base.with_name(base.name + ".xz").exists():
            return base
    return None


def reread(folder: Path) -> dict:
    """The results of an earlier run (``FOLDER/profile.json`` and the raw samples beside it,
    ``pyspy-TAG-PID.txt``), each engine's components, and its API server's where they were
    sampled, counted again from the raw samples as :func:`component_of` and
    :func:`frontend_component_of` count them now; where a raw file is missing the counts on
    record are kept.

    Raises:
        FileNotFoundError: no ``profile.json`` in ``folder``.
        ValueError: ``profile.json`` is not a run's results.
    """
    results = json.loads((folder / "profile.json").read_text())
    if not isinstance(results, dict) or not all(isinstance(r, dict) and "steps" in r for r in results.values()):
        raise ValueError(f"{folder / 'profile.json'} does not hold profile-step results")
    for name, r in results.items():
        raw = _raw_samples(folder, name, r.get("pid"))
        if raw is not None:
            r["components"] = dict(components_of(raw))
        front = r.get("frontend")
        raw = _raw_samples(folder, name, front.get("pid")) if isinstance(front, dict) else None
        if raw is not None:
            front["components"] = dict(components_of(raw, frontend_component_of))
    return results


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m bench profile-step",
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    ap.add_argument("--clients", type=int, default=4, help="concurrent clients")
    ap.add_argument(
        "--workload",
        default="chat",
        choices=WORKLOADS,
        help="the prompts the clients send (code: an adaptive engine host switches K from step to step)",
    )
    ap.add_argument("--seconds", type=float, default=20.0, help="sampling time per engine (s)")
    ap.add_argument("--rate", type=int, default=100, help="py-spy samples per second")
    ap.add_argument("--out", type=Path, default=None, help="folder for logs, raw samples and profile.json")
    ap.add_argument(
        "--attach",
        type=Path,
        default=None,
        metavar="STATE",
        help="profile the engines a `bench host-overhead --keep --state STATE` call left up (e.g. plain "
        "vLLM and the engine host on a GPU) instead of starting CPU engine hosts",
    )
    ap.add_argument("--engines", default=None, help="with --attach: comma-separated engine names (default: all)")
    ap.add_argument(
        "--mode",
        default=None,
        help="with --attach: speculation mode applied to each engine host first (e.g. fixed:4; "
        "plain vLLM is left as it is)",
    )
    ap.add_argument("--py-spy", default=None, help="py-spy executable (default: next to Python, or on PATH)")
    ap.add_argument(
        "--report",
        type=Path,
        default=None,
        metavar="DIR",
        help="print the table of an earlier run's folder (its profile.json and raw samples), the samples "
        "counted again as this version attributes them; starts and samples nothing",
    )
    ap.add_argument(
        "--spec-first",
        action="store_true",
        help="without --attach: profile the n-gram engine before the plain one (the engines run one "
        "after the other; swapping the order tells a difference between them from a drift of the host)",
    )
    args = ap.parse_args(argv)
    if args.report is not None:
        try:
            print(table(reread(args.report)))
        except (OSError, ValueError) as e:
            print(f"profile-step: {e}", file=sys.stderr)
            return 2
        return 0
    try:
        py_spy = _py_spy(args.py_spy)
        live = []
        if args.attach:
            live = json.loads(args.attach.read_text()).get("live", [])
            if args.engines:
                want = args.engines.split(",")
                live = [e for n in want for e in live if e["name"] == n]
            if not live:
                raise ValueError(f"no engine up in {args.attach}" + (f" named {args.engines}" if args.engines else ""))
    except (FileNotFoundError, ValueError, json.JSONDecodeError) as e:
        print(f"profile-step: {e}", file=sys.stderr)
        return 2
    out = args.out or Path(tempfile.mkdtemp(prefix="profile-step-"))
    out.mkdir(parents=True, exist_ok=True)
    results = {}
    if live:
        for e in live:
            print(f"profiling {e['name']} ({e['url']}) ...", file=sys.stderr, flush=True)
            results[e["name"]] = profile_attached(
                e, args.clients, args.seconds, args.rate, out, py_spy, args.mode, args.workload
            )
    else:
        engines = [
            ("plain", ["--k-max", "0"]),
            ("ngram K=0", ["--k-max", "8", "--speculation-mode", "fixed", "--k", "0"]),
        ]
        for name, extra in reversed(engines) if args.spec_first else engines:
            print(f"profiling {name} ...", file=sys.stderr, flush=True)
            results[name] = profile(extra, args.clients, args.seconds, args.rate, out, py_spy, args.workload)
    (out / "profile.json").write_text(json.dumps(results, indent=1))
    print(table(results))
    print(f"(raw samples and logs in {out})", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
