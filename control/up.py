"""``python -m control up``: the main job.

1. start an engine host (``python -m engine_host``, default model, port 8000;
   ``--enforce-eager`` on the CPU build of vLLM) with the control token of
   ``$SPECPILOT_HOME`` (so ``python -m control ...`` in another shell finds it);
2. wait until it is ready, printing its phase and the time spent;
3. register it in the store as host ``local`` (idempotent: the URL is updated);
4. run the collector (in this process) and, when the dashboard is installed
   (``dashboard/__main__.py``), ``python -m dashboard`` as a child process;
5. print the URLs; Ctrl-C (or SIGTERM) stops everything, children first.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import signal
import subprocess
import sys
import time
from typing import Any

from .store import DEFAULT_TOKEN_ENV


def add_up_arguments(p: argparse.ArgumentParser) -> None:
    """The options of ``python -m control up``."""
    p.add_argument("--port", type=int, default=8000, help="engine host port")
    p.add_argument("--address", default="127.0.0.1", help="engine host and dashboard listen address")
    p.add_argument("--model", default=None, help="model for the engine host (default: the prepared default model)")
    p.add_argument("--name", default="local", help="host name in the store")
    p.add_argument("--usd-per-hour", type=float, default=None, help="machine price (USD/hour) recorded for the host")
    p.add_argument("--gpu", default=None, help="accelerator kind recorded for the host (default: cpu or gpu)")
    p.add_argument("--engine-arg", action="append", default=[], metavar="ARG",
                   help="extra 'python -m engine_host' argument (repeatable), e.g. --engine-arg=--k-max=4")
    p.add_argument("--interval", type=float, default=1.0, help="collector scrape interval (s)")
    p.add_argument("--dashboard-port", type=int, default=8501, help="dashboard port")
    p.add_argument("--no-dashboard", action="store_true", help="do not start the dashboard")
    p.add_argument("--ready-timeout", type=float, default=900.0, help="seconds to wait for the engine host")


def dashboard_available() -> bool:
    """True when ``python -m dashboard`` exists (``dashboard/__main__.py``)."""
    try:
        return importlib.util.find_spec("dashboard.__main__") is not None
    except (ImportError, ValueError):
        return False


def wait_ready(eh: Any, timeout_s: float, out=sys.stdout) -> float:
    """Poll ``/ready`` until 200, printing the phase as it changes and every 15 s.

    Returns:
        Seconds from start to ready.
    Raises:
        engine_host.process.EngineHostError: the process exited (with its log tail) or timed out.
    """
    import httpx

    from engine_host.process import EngineHostError

    t0 = time.monotonic()
    last_phase, last_print = None, 0.0
    while True:
        elapsed = time.monotonic() - t0
        if not eh.alive():
            raise EngineHostError(f"the engine host exited ({eh.proc.returncode}); log {eh.log_path}:\n{eh.log_tail()}")
        if elapsed > timeout_s:
            raise EngineHostError(f"the engine host was not ready after {timeout_s:.0f} s; log {eh.log_path}")
        try:
            r = httpx.get(eh.url + "/ready", timeout=2.0)
            phase = "ready" if r.status_code == 200 else (r.json().get("phase") or "starting")
        except (httpx.HTTPError, ValueError):
            phase = "loading the model"
        if phase == "warmup_failed":
            raise EngineHostError(f"the engine host's warm-up failed; log {eh.log_path}:\n{eh.log_tail()}")
        if phase != last_phase or elapsed - last_print >= 15:
            print(f"  engine host: {phase} ({elapsed:.0f} s)", file=out, flush=True)
            last_phase, last_print = phase, elapsed
        if phase == "ready":
            return elapsed
        time.sleep(1.0)


def _stop_child(proc: subprocess.Popen, timeout_s: float = 20.0) -> None:
    if proc.poll() is not None:
        return
    try:
        os.killpg(proc.pid, signal.SIGINT)
        proc.wait(timeout=timeout_s)
    except (ProcessLookupError, subprocess.TimeoutExpired):
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait(timeout=10)


def run_up(args: argparse.Namespace) -> int:
    """Run the main job until Ctrl-C / SIGTERM. Returns the exit status."""
    from engine_host.auth import control_token
    from engine_host.launcher import is_cpu_build
    from engine_host.process import EngineHostError, EngineHostProcess

    from .collector import Collector
    from .store import Store, add_host, origin

    store = Store.open(args.db)
    token, created = control_token()
    os.environ[DEFAULT_TOKEN_ENV] = token
    cpu = is_cpu_build()
    extra = (["--enforce-eager"] if cpu and "--enforce-eager" not in args.engine_arg else []) + list(args.engine_arg)
    eh = EngineHostProcess(port=args.port, host=args.address, model=args.model, extra_args=extra, token=token)
    def on_signal(signum: int, _frame: Any) -> None:
        raise KeyboardInterrupt  # also ends a start-up still waiting for the engine

    # Ctrl-C and SIGTERM both stop everything, even where SIGINT was inherited as
    # ignored (a job started in the background by a non-interactive shell)
    previous = {sig: signal.signal(sig, on_signal) for sig in (signal.SIGINT, signal.SIGTERM)}
    collector = None
    dashboard = None
    try:
        print(f"SpecPilot: starting the engine host on {eh.url} (log {eh.log_path})", flush=True)
        eh.start()
        seconds = wait_ready(eh, args.ready_timeout)
        print(f"SpecPilot: engine host ready in {seconds:.0f} s", flush=True)
        add_host(store, args.name, eh.url, usd_per_hour=args.usd_per_hour or 0.0,
                 gpu_kind=args.gpu or ("cpu" if cpu else "gpu"), update=True, origin_=origin("up"))
        if not args.no_dashboard and dashboard_available():
            from dashboard.__main__ import bootstrap_user

            bootstrap_user()  # first start: the admin's password, framed, before the collector's log lines
        collector = Collector(store, interval_s=args.interval).start()
        if not args.no_dashboard and dashboard_available():
            cmd = [sys.executable, "-m", "dashboard", "--port", str(args.dashboard_port), "--address", args.address]
            if args.db:
                cmd += ["--db", args.db]
            dashboard = subprocess.Popen(cmd, start_new_session=True)
        print("\nSpecPilot is up:")
        print(f"  OpenAI API     {eh.url}/v1")
        print(f"  metrics        {eh.url}/metrics")
        if dashboard:
            print(f"  dashboard      http://{args.address}:{args.dashboard_port}")
        print(f"  store          {store.engine.url.render_as_string()}")
        print(f"  host           '{args.name}' (python -m control config show --host {args.name})")
        if created:
            print(f"  control token  {token}  (saved in $SPECPILOT_HOME/control_token)")
        print("Ctrl-C stops everything.", flush=True)
        while True:
            if not eh.alive():
                print(f"error: the engine host exited ({eh.proc.returncode}); log {eh.log_path}", file=sys.stderr)
                return 1
            time.sleep(1.0)
    except KeyboardInterrupt:
        return 0
    except EngineHostError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    finally:
        print("SpecPilot: stopping", flush=True)
        for sig in previous:  # a second Ctrl-C must not cut the clean-up short
            signal.signal(sig, signal.SIG_IGN)
        try:
            if dashboard is not None:
                _stop_child(dashboard)
            if collector is not None:
                collector.stop()
            eh.stop()
            store.close()
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)
        print("SpecPilot: stopped", flush=True)
