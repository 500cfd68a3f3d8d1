"""GPU measurements of the engine host against plain vLLM (run by ``scripts/gpu/runner.sh``).

Each ``--engine`` is started in turn (one process at a time, CUDA graphs on unless the
engine's arguments say otherwise), measured, and stopped:

* start-up: seconds from process start to ``/health`` answering 200 and, for engine hosts,
  to ``/ready`` (SpecPilot's start-up warm-up included);
* TTFT of the first request after ready, and of single requests after the loads (steady);
* ``--loads``: closed-loop loads of open-ended chat prompts (the harness's ``chat`` workload,
  temperature 0.7, per-request seeds), ``--max-tokens`` with ``ignore_eos``, each
  ``--reps`` times for ``--duration`` seconds. Throughput is vLLM's own counter
  ``vllm:generation_tokens_total`` over the window (from 1 s after the start to the end), so
  the ramp and the drain at the end of a window are left out; the client count is kept too;
* for engine hosts, ``--harness`` runs ``python -m bench run ...`` (the benchmark harness)
  against the same engine, once per workload given;
* the vLLM log lines that say which model runner, CUDA-graph mode and scheduling vLLM chose.

Engines: ``plain`` (``vllm serve``: no speculative config, no SpecPilot scheduler or plugins,
vLLM's defaults; ``serve:NAME:ARGS`` adds ARGS, e.g. a speculative config), ``host:NAME:ARGS``
(``python -m engine_host ARGS``) or ``dual:NAME:ARGS``
(``python -m engine_host.router ARGS``: a plain and a speculative engine behind one address). Results go to
``--out/results.json`` (rewritten after each engine) and the logs to ``--out/logs/``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import shlex
import statistics
import subprocess
import sys
import time
from pathlib import Path

import httpx

from engine_host.model import prepare_default_model
from engine_host.process import EngineHostProcess, RouterProcess

from .workloads import Workload

LOG_PATTERNS = re.compile(
    r"cudagraph|CUDAGraphMode|cuda graph|PIECEWISE|FULL_AND|[Aa]sync scheduling|Model Runner|model runner|"
    r"V2 model|speculative|ngram|SpecPilot|scheduler_cls|Error|error:|Traceback|refuse|not supported|"
    r"Application startup complete|torch.compile|compil|attention backend|Using .* backend"
)


class PlainServe(EngineHostProcess):
    """``vllm serve`` with vLLM's defaults: no speculative config, no SpecPilot parts."""

    def __init__(self, model: str, extra: list[str], **kw):
        super().__init__(model=model, **kw)
        self.extra = extra

    def command(self) -> list[str]:
        return [
            sys.executable,
            "-m",
            "engine_host.serve",
            "serve",
            str(self.model),
            "--served-model-name",
            Path(str(self.model)).name,
            "--host",
            self.host,
            "--port",
            str(self.port),
            *self.extra,
        ]

    def start(self):
        self.env.setdefault("VLLM_PLUGINS", "")  # no plugin of any kind unless the spec names some
        return super().start()


ENV_TOKEN_RE = re.compile(r"^[A-Z_][A-Z0-9_]*=")


def split_env(eargs: str) -> tuple[dict[str, str], list[str]]:
    """Split an engine spec's ARGS into leading ``NAME=value`` environment settings and
    the arguments: ``"VLLM_PLUGINS=specpilot_stats --max-num-seqs 64"`` ->
    ``({"VLLM_PLUGINS": "specpilot_stats"}, ["--max-num-seqs", "64"])``."""
    tokens = shlex.split(eargs)
    env = {}
    while tokens and ENV_TOKEN_RE.match(tokens[0]):
        k, _, v = tokens.pop(0).partition("=")
        env[k] = v
    return env, tokens


def make_engine(spec: str, model: str, logs: Path) -> tuple[str, EngineHostProcess, str]:
    """``(name, process, kind)`` for one ``--engine`` spec; kind is serve (``plain`` and
    ``serve:NAME:ARGS``), host or dual. The process is not started; its log goes to
    ``logs/NAME.log``.

    Raises:
        SystemExit: the spec is not ``plain``, ``serve:NAME:ARGS``, ``host:NAME:ARGS`` or
            ``dual:NAME:ARGS``.
    """
    if spec == "plain":
        return "plain", PlainServe(model, ["--max-model-len", "2048"], log_path=logs / "plain.log"), "serve"
    kind, _, rest = spec.partition(":")
    name, _, eargs = rest.partition(":")
    if kind not in ("serve", "host", "dual") or not name:
        raise SystemExit(f"error: --engine {spec!r}: expected plain, serve:NAME:ARGS, host:NAME:ARGS or dual:NAME:ARGS")
    env, argv = split_env(eargs)
    log = logs / f"{name}.log"
    if kind == "serve":
        return name, PlainServe(model, ["--max-model-len", "2048", *argv], log_path=log, env=env), kind
    cls = RouterProcess if kind == "dual" else EngineHostProcess
    return name, cls(model=model, extra_args=argv, log_path=log, env=env), kind


async def wait_url(eh: EngineHostProcess, path: str, timeout_s: float) -> float:
    deadline = time.monotonic() + timeout_s
    async with httpx.AsyncClient(timeout=2.0) as c:
        while time.monotonic() < deadline:
            if not eh.alive():
                raise RuntimeError(f"exited with {eh.proc and eh.proc.returncode}")
            try:
                r = await c.get(eh.url + path)
                if r.status_code == 200:
                    return time.monotonic() - (eh.started_at or 0)
                if path == "/ready" and r.status_code == 404:
                    raise RuntimeError("/ready answers 404: SpecPilot's endpoint plugin did not load")
                if path == "/ready" and r.status_code == 503 and r.json().get("phase") == "warmup_failed":
                    raise RuntimeError(f"warm-up failed: {r.text[:300]}")
            except httpx.HTTPError:
                pass
            await asyncio.sleep(0.25)
    raise RuntimeError(f"{path} not 200 after {timeout_s:.0f} s")


def metric_total(text: str, sample_name: str) -> float:
    """Sum of every sample named ``sample_name`` (all label sets) in a Prometheus text page,
    parsed with ``prometheus_client``; 0.0 when absent."""
    from prometheus_client.parser import text_string_to_metric_families

    return sum(
        smp.value for fam in text_string_to_metric_families(text) for smp in fam.samples if smp.name == sample_name
    )


async def gen_tokens(c: httpx.AsyncClient) -> float:
    """vLLM's ``vllm:generation_tokens_total`` (tokens) from the engine's ``/metrics``."""
    return metric_total((await c.get("/metrics")).text, "vllm:generation_tokens_total")


def chat_body(model: str, wl: Workload, max_tokens: int, stream: bool = False) -> tuple[str, dict]:
    p = wl.next_prompt(0.0)
    b = p.body(model, max_tokens)
    b["ignore_eos"] = True
    b["stream"] = stream
    if not stream:
        b.pop("stream_options", None)
    else:
        b["stream_options"] = {"include_usage": True}
    return ("/v1/completions" if p.endpoint == "completions" else "/v1/chat/completions"), b


async def ttft(url: str, model: str, wl: Workload) -> float:
    """Milliseconds to the first streamed token of one request (32 tokens)."""
    path, body = chat_body(model, wl, 32, stream=True)
    async with httpx.AsyncClient(base_url=url, timeout=120) as c:
        t0 = time.perf_counter()
        async with c.stream("POST", path, json=body) as r:
            r.raise_for_status()
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line.strip() == "data: [DONE]":
                    continue
                ch = (json.loads(line[6:]).get("choices") or [{}])[0]
                if ch.get("text") or (ch.get("delta") or {}).get("content"):
                    return round((time.perf_counter() - t0) * 1000, 2)
    return float("nan")


async def closed_loop(
    url: str, model: str, concurrency: int, duration: float, max_tokens: int, seed: int, workload: str = "chat"
) -> dict:
    """``concurrency`` clients, each sending the next prompt of ``workload`` as soon as its
    last request finished, for ``duration`` seconds. Returns ``{"tokens_per_s"}`` (vLLM's
    ``vllm:generation_tokens_total`` over the window from 1 s after the start, tokens/s) and
    the client-side figures."""
    wl = Workload(workload, seed=seed)
    t_end = time.monotonic() + duration
    done_tokens = 0
    failed = 0
    limits = httpx.Limits(max_connections=concurrency + 4, max_keepalive_connections=concurrency + 4)
    async with httpx.AsyncClient(base_url=url, timeout=600, limits=limits) as c:

        async def worker() -> None:
            nonlocal done_tokens, failed
            while time.monotonic() < t_end:
                path, body = chat_body(model, wl, max_tokens)
                try:
                    r = await c.post(path, json=body)
                    r.raise_for_status()
                    done_tokens += r.json()["usage"]["completion_tokens"]
                except Exception:
                    failed += 1
                    await asyncio.sleep(0.2)

        async def window() -> tuple[float, float]:
            await asyncio.sleep(1.0)
            g0, t0 = await gen_tokens(c), time.monotonic()
            await asyncio.sleep(max(0.5, t_end - time.monotonic()))
            g1, t1 = await gen_tokens(c), time.monotonic()
            return (g1 - g0), (t1 - t0)

        t0 = time.monotonic()
        res = await asyncio.gather(window(), *(worker() for _ in range(concurrency)))
        wall = time.monotonic() - t0
    toks, secs = res[0]
    return {
        "tokens_per_s": round(toks / secs, 1),
        "window_s": round(secs, 2),
        "client_tokens_per_s_incl_drain": round(done_tokens / wall, 1),
        "failed": failed,
    }


def log_lines(path: Path, limit: int = 80) -> list[str]:
    try:
        lines = path.read_text(errors="replace").splitlines()
    except OSError:
        return []
    keep = [ln.strip()[:400] for ln in lines if LOG_PATTERNS.search(ln)]
    return keep[:limit] + (["..."] + keep[-20:] if len(keep) > limit else [])


async def measure(eh: EngineHostProcess, model: str, is_host: bool, args: argparse.Namespace, rec: dict) -> None:
    rec["health_s"] = round(await wait_url(eh, "/health", 600), 1)
    if is_host:
        rec["ready_s"] = round(await wait_url(eh, "/ready", 600), 1)
    name = Path(model).name
    wl = Workload("chat", seed=args.seed + 7)
    rec["ttft_first_ms"] = await ttft(eh.url, name, wl)
    rec["ttft_second_ms"] = await ttft(eh.url, name, wl)
    if is_host and args.k is not None:
        async with httpx.AsyncClient(base_url=eh.url, headers=eh.control_headers, timeout=30) as c:
            r = await c.put("/control/config", json={"speculation": {"mode": "fixed", "k": args.k}})
            rec["set_k"] = {"k": args.k, "status": r.status_code}
    if args.loads:
        await closed_loop(eh.url, name, max(args.loads), args.warm, args.max_tokens, args.seed + 99)  # warm-up
    loads = {}
    for conc in args.loads:
        runs = [
            await closed_loop(eh.url, name, conc, args.duration, args.max_tokens, args.seed + i)
            for i in range(args.reps)
        ]
        tps = [r["tokens_per_s"] for r in runs]
        loads[f"c{conc}"] = {
            "median_tokens_per_s": statistics.median(tps),
            "runs": runs,
            "spread_pct": round(100 * (max(tps) - min(tps)) / statistics.median(tps), 1),
        }
        print(f"  {rec['name']} c{conc}: {tps} tok/s", flush=True)
    rec["loads"] = loads
    rec["ttft_steady_ms"] = sorted([await ttft(eh.url, name, wl) for _ in range(5)])[2]
    if is_host:
        async with httpx.AsyncClient(base_url=eh.url, headers=eh.control_headers, timeout=30) as c:
            st = (await c.get("/control/state")).json()
        rec["state"] = {k: st.get(k) for k in ("limits", "speculation", "overhead", "warmup", "k_current")}


def run_harness(eh: EngineHostProcess, args: argparse.Namespace, out: Path, rec: dict, is_host: bool = True) -> None:
    """``python -m bench run`` per ``--harness`` cell. On a bare vLLM server (``plain``,
    ``serve:``) the modes are ``plain`` only; on a dual engine host with the relay front also
    ``--mode plain`` against its plain engine's own port (no router in the path). Each
    cell's modes run in the order given (repeat a mode to interleave repetitions); the
    output tokens/s of every run are kept in ``rec["harness"][cell]["runs"]``."""
    env = dict(os.environ, SPECPILOT_CONTROL_TOKEN=eh.token)
    rec["harness"] = {}
    modes = args.modes if is_host else ",".join(["plain"] * max(1, args.modes.split(",").count("plain")))
    targets = [(rec["name"], eh.url, modes)]
    if isinstance(eh, RouterProcess):
        st = httpx.get(eh.url + "/control/state", headers=eh.control_headers, timeout=30).json()
        plain_url = st["router"]["engines"]["plain"]["url"]
        if plain_url.rsplit(":", 1)[-1] != eh.url.rsplit(":", 1)[-1]:  # relay front: its plain engine apart
            targets.append((rec["name"] + "-plain-direct", plain_url, "plain"))
    for (label, url, modes), wl_conc in ((t, w) for w in args.harness for t in targets):
        wl, _, conc = wl_conc.partition("@")
        dest = out / "harness" / f"{label}-{wl}-c{conc}"
        cmd = [
            sys.executable,
            "-m",
            "bench",
            "run",
            "--url",
            url,
            "--workload",
            wl,
            "--mode",
            modes,
            "--concurrency",
            conc,
            "--duration",
            str(args.harness_duration),
            "--warmup",
            "3",
            "--max-tokens",
            str(args.max_tokens),
            "--no-png",
            "--quiet",
            "--out",
            str(dest),
            *shlex.split(args.harness_args),
        ]
        t0 = time.monotonic()
        p = subprocess.run(cmd, env=env, capture_output=True, text=True)
        print(p.stdout[-3000:], p.stderr[-1500:], flush=True)
        summary = dest / "summary.md"
        key = wl_conc if label == rec["name"] else f"{wl_conc} {label}"
        runs = []
        if (dest / "results.json").is_file():
            for r in json.loads((dest / "results.json").read_text())["runs"]:
                runs.append([r["spec"]["mode"], r["client"]["output_tokens_per_s"]])
        print(f"  {key}: " + ", ".join(f"{m} {v:.1f}" for m, v in runs), flush=True)
        rec["harness"][key] = {
            "command": "python -m bench " + shlex.join(cmd[3:]),
            "rc": p.returncode,
            "seconds": round(time.monotonic() - t0, 1),
            "runs": runs,
            "summary_md": summary.read_text() if summary.is_file() else p.stderr[-2000:],
        }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m bench.gpu_bench", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument(
        "--engine",
        action="append",
        required=True,
        help="'plain', 'serve:NAME:ARGS' (vllm serve ARGS, no SpecPilot part), 'host:NAME:ARGS' "
        "(python -m engine_host ARGS) or 'dual:NAME:ARGS' (python -m engine_host.router ARGS); "
        "ARGS may start with NAME=value environment settings (e.g. VLLM_PLUGINS=specpilot_stats); "
        "repeatable, run in order",
    )
    ap.add_argument(
        "--loads",
        type=lambda s: [int(x) for x in s.split(",") if x],
        default=[8, 64],
        help="concurrencies (closed loop)",
    )
    ap.add_argument("--duration", type=float, default=10.0, help="seconds per run")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--warm", type=float, default=4.0, help="seconds of untimed load first")
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--k", type=int, default=None, help="PUT fixed K before the loads (engine hosts)")
    ap.add_argument("--no-loads", action="store_true", help="start-up and TTFT only")
    ap.add_argument(
        "--harness",
        action="append",
        default=[],
        metavar="WORKLOAD@CONC",
        help="after the loads, python -m bench run on this workload and concurrency (bare vLLM "
        "servers: mode plain only, as often as --modes names it)",
    )
    ap.add_argument("--modes", default="fixed:0,fixed:2,fixed:4,fixed:8,adaptive")
    ap.add_argument("--harness-duration", type=float, default=10.0)
    ap.add_argument(
        "--harness-args",
        default="",
        help="further 'python -m bench run' arguments, e.g. '--requests-per-client 6 --ramp 3'",
    )
    ap.add_argument(
        "--model",
        default="default",
        help="'default' (the default model, prepared on first use) or a model folder, e.g. "
        "$SPECPILOT_HOME/models/Qwen2.5-Coder-1.5B-Instruct",
    )
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "gpu-results")))
    args = ap.parse_args(argv)
    if args.no_loads:
        args.loads = []
    out = args.out
    (out / "logs").mkdir(parents=True, exist_ok=True)
    model = str(prepare_default_model(quiet=True)) if args.model == "default" else args.model
    if not Path(model, "config.json").is_file():
        raise SystemExit(f"error: --model {model}: no config.json there")
    res_path = out / "results.json"
    results = json.loads(res_path.read_text()) if res_path.is_file() else {"engines": []}
    for spec in args.engine:
        name, eh, kind = make_engine(spec, model, out / "logs")
        is_host = kind != "serve"
        rec = {"name": name, "command": shlex.join(eh.command()), "env": eh.env, "t_start_unix": time.time()}
        print(f"== {name}: {rec['command']}", flush=True)
        eh.start()
        try:
            asyncio.run(measure(eh, model, is_host, args, rec))
            if args.harness:
                run_harness(eh, args, out, rec, is_host)
        except Exception as exc:
            rec["error"] = f"{type(exc).__name__}: {exc}"
            print(f"  {name} failed: {rec['error']}\n{eh.log_tail(30)}", flush=True)
        finally:
            eh.stop()
        rec["vllm_log"] = log_lines(eh.log_path)
        results["engines"].append(rec)
        res_path.write_text(json.dumps(results, indent=1))
        print(
            json.dumps(
                {k: rec.get(k) for k in ("name", "health_s", "ready_s", "ttft_first_ms", "ttft_steady_ms", "error")}
            ),
            flush=True,
        )
        for k, v in rec.get("loads", {}).items():
            print(f"  {name} {k}: median {v['median_tokens_per_s']} tok/s, spread {v['spread_pct']}%", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
