"""``python -m engine_host.router``: start a plain and a speculative engine host behind
one address (or attach to two running ones), and serve until Ctrl-C / SIGTERM.

The options that set the split (``--routing``, ``--p-min``, ``--p-max``, ``--eta``,
``--tpot-margin``, ``--p-probe``, ``--probe-every``, ``--probe-backoff``,
``--probe-every-max``) take their defaults and help from
:class:`~engine_host.router.settings.RouterSettings` and are validated by it, as a live
``PUT /control/config {"router": {...}}`` is.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import sys
import time
from collections.abc import Mapping
from typing import Any

from pydantic import ValidationError

from ..auth import ENV_TOKEN, control_token
from ..home import subdir
from .settings import DEFAULT_P_START, PLAIN, ROUTING_MODES, SPECULATIVE, RouterSettings, describe_errors
from .state import ENV_ROUTER_CONFIG, write_routing_file

#: command-line option of each setting of :class:`RouterSettings` that has one
SETTING_OPTIONS = {
    "mode": "--routing",
    "p_min": "--p-min",
    "p_max": "--p-max",
    "eta": "--eta",
    "tpot_margin": "--tpot-margin",
    "p_probe": "--p-probe",
    "probe_every_s": "--probe-every",
    "probe_backoff": "--probe-backoff",
    "probe_every_max_s": "--probe-every-max",
}
#: the in-engine front, loaded by the plain engine host's endpoint plugin
FRONT_EXTENSION = "engine_host.router.front:RouterEndpoints"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line of ``python -m engine_host.router``; ``args.router_settings`` is
    the validated :class:`RouterSettings`. Exits with the reason on invalid options."""
    p = argparse.ArgumentParser(
        prog="python -m engine_host.router",
        description="A plain engine and a speculative engine behind one OpenAI-compatible address; "
        "each request goes to the one that currently gives it more tokens per second.",
        epilog="Arguments after '--' go to both engine hosts (python -m engine_host ...). The routing settings "
        'change live: PUT /control/config {"router": {...}}.',
    )
    p.add_argument("--model", default="default", help="model for both engines (default: the default model)")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on")
    p.add_argument("--port", type=int, default=8000, help="port to listen on")
    p.add_argument("--k-max", type=int, default=8, help="K_max of the speculative engine (tokens)")
    p.add_argument("--speculation-mode", default="adaptive", help="speculative engine's initial mode")
    p.add_argument(
        "--gpu-memory-utilization",
        type=float,
        default=None,
        help="GPU memory fraction for EACH engine (GPU build; two engines share one GPU: e.g. 0.4)",
    )
    p.add_argument(
        "--p-start",
        type=float,
        default=DEFAULT_P_START,
        help="initial share of requests for the speculative engine (fraction 0..1)",
    )
    fields = RouterSettings.model_fields
    for name, option in SETTING_OPTIONS.items():
        kind: dict[str, Any] = {"choices": ROUTING_MODES} if name == "mode" else {"type": float}
        p.add_argument(
            option,
            dest=name,
            default=fields[name].default,
            **kind,
            help=f"{fields[name].description} (default: %(default)s)",
        )
    p.add_argument(
        "--front",
        choices=("engine", "relay"),
        default=None,
        help="engine: the plain engine's own server takes the port and routes inside it (plain "
        "requests cost no extra hop); relay: a separate router process relays every request "
        "(default: engine; relay with --plain-url/--spec-url)",
    )
    p.add_argument(
        "--workers",
        type=int,
        default=1,
        help="relay front: router processes (each relays requests; 4 or more at thousands of tokens/s)",
    )
    p.add_argument("--plain-url", default=None, help="relay front: attach to this running plain engine host")
    p.add_argument("--spec-url", default=None, help="relay front: attach to this running speculative engine host")
    p.add_argument("--ready-timeout", type=float, default=900.0, help="seconds to wait for both engines")
    p.add_argument("engine_args", nargs=argparse.REMAINDER, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.engine_args and args.engine_args[0] == "--":
        args.engine_args = args.engine_args[1:]
    if bool(args.plain_url) != bool(args.spec_url):
        p.error("--plain-url and --spec-url go together")
    try:  # the same model as a live change of the split's settings
        args.router_settings = RouterSettings.model_validate({k: getattr(args, k) for k in SETTING_OPTIONS})
    except ValidationError as exc:
        p.error(f"router settings: {describe_errors(exc)}")
    if not args.p_min <= args.p_start <= args.p_max:
        p.error("need 0 <= --p-min <= --p-start <= --p-max <= 1")
    if args.workers < 1:
        p.error("--workers must be at least 1")
    if args.front is None:
        args.front = "relay" if args.plain_url else "engine"
    if args.front == "engine" and args.plain_url:
        p.error("--plain-url/--spec-url attach to running engines: only the relay front can (--front relay)")
    if args.front == "engine" and args.workers > 1:
        p.error("--workers is for the relay front; the engine front runs inside the plain engine's server")
    return args


def cpu_child_env(environ: dict[str, str] | None = None, ncpu: int | None = None) -> dict[str, str]:
    """Environment for the two engine hosts on vLLM's CPU build ({} on the GPU build).

    vLLM's "auto" binding pins each engine's OpenMP threads to the same cores, where a
    second engine beside a busy first one may never finish loading; unpinned, each engine
    starts an OpenMP thread per core, and the Intel OpenMP runtime by default spins 200 ms
    after every parallel region, so two engines slow each other down several times over
    (docs/router.md has the figures). Each engine therefore gets half the cores (at least
    one), unpinned, with vLLM's own short spin (``KMP_BLOCKTIME=5`` ms). Settings already in
    the environment win.

    Args:
        environ: the environment to respect (default ``os.environ``).
        ncpu: cores on this machine (default ``os.cpu_count()``).
    """
    from ..launcher import is_cpu_build  # imports vLLM: not at module level

    have: Mapping[str, str] = os.environ if environ is None else environ
    if not is_cpu_build() or "VLLM_CPU_OMP_THREADS_BIND" in have:
        return {}
    threads = max(1, (ncpu or os.cpu_count() or 2) // 2)
    wanted = {"VLLM_CPU_OMP_THREADS_BIND": "nobind", "OMP_NUM_THREADS": str(threads), "KMP_BLOCKTIME": "5"}
    return {k: v for k, v in wanted.items() if k not in have}


def main(argv: list[str] | None = None) -> int:
    """Start both engine hosts (or attach), then serve until Ctrl-C / SIGTERM.

    ``--front engine``: the speculative engine host starts on a free port, then the plain
    one on ``--port`` with :mod:`engine_host.router.front` inside; this process only watches them.
    ``--front relay``: both start on free ports and uvicorn serves
    :func:`engine_host.router.app.app_from_env`.
    """
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    args = parse_args(argv)
    from ..plugin import ENV_EXTENSIONS  # after the arguments: it loads vLLM (--help stays fast)
    from ..process import EngineHostError, EngineHostProcess

    token, _ = control_token()
    os.environ[ENV_TOKEN] = token
    os.environ.pop(ENV_ROUTER_CONFIG, None)  # set below for the one process that routes
    os.environ.pop(ENV_EXTENSIONS, None)
    mode_file = subdir("run") / f"router-{args.port}.routing"
    write_routing_file(mode_file, args.router_settings)
    config: dict[str, Any] = {
        "p_start": args.p_start,
        "router": args.router_settings.model_dump(mode="json"),
        "mode_file": str(mode_file),
        "front": args.front,
    }
    children: list[tuple[str, EngineHostProcess]] = []
    if args.plain_url:
        config["backends"] = {PLAIN: args.plain_url.rstrip("/"), SPECULATIVE: args.spec_url.rstrip("/")}
    else:
        common = list(args.engine_args)
        if args.model != "default":
            common = ["--model", args.model, *common]
        if args.gpu_memory_utilization is not None:
            common += ["--gpu-memory-utilization", str(args.gpu_memory_utilization)]
        env = cpu_child_env()
        spec = EngineHostProcess(
            token=token,
            env=env,
            extra_args=[*common, "--k-max", str(args.k_max), "--speculation-mode", args.speculation_mode],
        )
        if args.front == "engine":
            self_host = "127.0.0.1" if args.host in ("0.0.0.0", "::", "") else args.host
            config["backends"] = {PLAIN: f"http://{self_host}:{args.port}", SPECULATIVE: spec.url}
            plain = EngineHostProcess(
                port=args.port,
                host=args.host,
                token=token,
                extra_args=[*common, "--k-max", "0"],
                env={**env, ENV_ROUTER_CONFIG: json.dumps(config), ENV_EXTENSIONS: FRONT_EXTENSION},
            )
            # the speculative one first: the plain one takes the public port and answers
            # /ready only once both engines are ready
            children = [(SPECULATIVE, spec), (PLAIN, plain)]
        else:
            plain = EngineHostProcess(token=token, env=env, extra_args=[*common, "--k-max", "0"])
            config["backends"] = {PLAIN: plain.url, SPECULATIVE: spec.url}
            children = [(PLAIN, plain), (SPECULATIVE, spec)]

    def on_sigterm(signum: int, frame: Any) -> None:
        raise KeyboardInterrupt  # start-up is cut short like Ctrl-C; uvicorn has its own handlers later

    signal.signal(signal.SIGTERM, on_sigterm)
    try:
        # on a GPU one after the other: vLLM sizes its KV cache from the GPU memory that
        # changes while it profiles, so an engine starting beside another one sees the other's
        # KV cache appear and fails ("Available KV cache memory: -1.01 GiB", seen on an H100).
        # The CPU build is given its KV cache size, so both start at once there.
        from ..launcher import is_cpu_build

        waves = [children] if is_cpu_build() else [[child] for child in children]
        for wave in waves:
            for name, c in wave:
                print(f"starting the {name} engine host: {c.url} (log {c.log_path})", flush=True)
                c.start()
            for name, c in wave:
                secs = c.wait_ready(timeout_s=args.ready_timeout)
                print(f"  {name} engine host ready in {secs:.1f} s", flush=True)
        b = config["backends"]
        print(
            f"SpecPilot engine router on http://{args.host}:{args.port} ({args.front} front; "
            f"plain {b[PLAIN]}, speculative {b[SPECULATIVE]}, routing {args.mode}"
            + (f", {args.workers} worker(s))" if args.front == "relay" else ")"),
            flush=True,
        )
        if args.front == "engine":
            return watch(children)
        import uvicorn

        os.environ[ENV_ROUTER_CONFIG] = json.dumps(config)
        uvicorn.run(
            "engine_host.router.app:app_from_env",
            factory=True,
            host=args.host,
            port=args.port,
            workers=args.workers,
            log_level="warning",
        )
    except EngineHostError as exc:
        print(f"error: an engine host did not start: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        pass
    finally:
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        for _, c in children:
            c.stop()
    return 0


def watch(children: list[tuple[str, Any]], interval_s: float = 1.0) -> int:
    """Wait while every engine host runs; returns 1 (with the reason on stderr) when one
    exits. Ctrl-C / SIGTERM end the wait with KeyboardInterrupt."""
    while True:
        for name, c in children:
            if not c.alive():
                print(
                    f"error: the {name} engine host exited ({c.proc and c.proc.returncode}):\n{c.log_tail()}",
                    file=sys.stderr,
                )
                return 1
        time.sleep(interval_s)
