"""``python -m control up``: the main job.

1. start an engine host (``python -m engine_host``, default model, port 8000;
   ``--enforce-eager`` on the CPU build of vLLM) with the control token of
   ``$SPECPILOT_HOME`` (so ``python -m control ...`` in another shell finds it);
2. wait until it is ready, printing its phase and the time spent;
3. register it in the store as host ``local`` (idempotent: the URL is updated; a price
   or GPU kind already recorded is kept unless ``--usd-per-hour`` / ``--gpu`` is given);
4. run the collector (in this process) and, when the dashboard is installed
   (``dashboard/__main__.py``), ``python -m dashboard`` as a child process;
5. print the URLs, then supervise (:class:`Supervisor`): when the engine host exits,
   the collector and the dashboard keep running, the host-down alert opens at once, the
   exit and each restart are recorded in the audit trail, and the engine host is started
   again after 1, 2, 4 ... 60 s (back to 1 s once a start has stayed up for 60 s); the
   collector then notices the new engine and re-applies the last applied version
   (:func:`control.apply.reconcile`). An engine host whose ``/health`` says its engine
   is dead (503), or that does not answer for ``--liveness-s`` s, is killed and handled
   the same way. A dashboard that exits is restarted the same way.
   Ctrl-C (or SIGTERM) stops everything, children first.

No child outlives ``control up``: each is started with ``PR_SET_PDEATHSIG`` (Linux), so
the kernel signals it when ``control up`` dies, even by ``kill -9`` (the dashboard gets
SIGTERM, the engine host SIGKILL); an engine host's process group is killed after it
exits (anything it left behind in it).
"""

from __future__ import annotations

import argparse
import ctypes
import importlib.util
import logging
import os
import signal
import subprocess
import sys
import time
from typing import Any, Callable, NoReturn

from engine_host.process import EngineHostProcess

from .store import DEFAULT_TOKEN_ENV

log = logging.getLogger("specpilot.up")
PR_SET_PDEATHSIG = 1
BACKOFF_START_S, BACKOFF_MAX_S, STABLE_AFTER_S = 1.0, 60.0, 60.0


def add_up_arguments(p: argparse.ArgumentParser) -> None:
    """The options of ``python -m control up``."""
    p.add_argument("--port", type=int, default=8000, help="engine host port")
    p.add_argument("--address", default="127.0.0.1", help="engine host and dashboard listen address")
    p.add_argument("--model", default=None, help="model for the engine host (default: the prepared default model)")
    p.add_argument("--name", default="local", help="host name in the store")
    p.add_argument("--usd-per-hour", type=float, default=None, help="machine price (USD/hour) recorded for the host")
    p.add_argument("--gpu", default=None, help="accelerator kind recorded for the host (default: cpu or gpu)")
    p.add_argument(
        "--engine-arg",
        action="append",
        default=[],
        metavar="ARG",
        help="extra 'python -m engine_host' argument (repeatable), e.g. --engine-arg=--k-max=4",
    )
    p.add_argument("--interval", type=float, default=1.0, help="collector scrape interval (s)")
    p.add_argument("--dashboard-port", type=int, default=8501, help="dashboard port")
    p.add_argument("--no-dashboard", action="store_true", help="do not start the dashboard")
    p.add_argument("--ready-timeout", type=float, default=900.0, help="seconds to wait for the engine host")
    p.add_argument(
        "--liveness-s",
        type=float,
        default=30.0,
        help="restart an engine host whose /health has failed for this long (s; 0: only on exit)",
    )


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


def die_with_parent(parent_pid: int, sig: int = signal.SIGTERM) -> Callable[[], None]:
    """A ``preexec_fn`` for children of ``control up``: SIGINT back to its default (a job
    started in the background inherits it ignored), and ``PR_SET_PDEATHSIG`` so that the
    kernel sends ``sig`` to the child when its parent dies (however it dies). Exits at
    once when the parent is gone already. No-op on systems without ``prctl``."""

    def setup() -> None:
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        try:
            libc = ctypes.CDLL(None, use_errno=True)
            libc.prctl(PR_SET_PDEATHSIG, int(sig), 0, 0, 0)
        except (OSError, AttributeError):
            return
        if os.getppid() != parent_pid:  # the parent died before prctl took effect
            os._exit(1)

    return setup


class SupervisedEngineHost(EngineHostProcess):
    """An engine host that dies with the process that started it (``PR_SET_PDEATHSIG``
    with SIGKILL)."""

    def _preexec(self) -> Callable[[], None]:
        # SIGKILL: an engine host told to stop (SIGTERM) after its parent died was seen to
        # hang in its shutdown; its engine core and workers die with it (engine_host)
        return die_with_parent(os.getpid(), signal.SIGKILL)


def kill_group(pgid: int, grace_s: float = 5.0) -> None:
    """SIGTERM, then SIGKILL after ``grace_s`` s, to what is left of process group
    ``pgid`` (e.g. an engine core left behind by an engine host that exited)."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(pgid, sig)
        except (ProcessLookupError, PermissionError):
            return
        deadline = time.monotonic() + grace_s
        while time.monotonic() < deadline:
            try:
                os.killpg(pgid, 0)
            except (ProcessLookupError, PermissionError):
                return
            time.sleep(0.1)


class Backoff:
    """Restart delays 1, 2, 4 ... ``max_s`` s; back to the start once a run lasted
    ``stable_s`` s."""

    def __init__(
        self, start_s: float = BACKOFF_START_S, max_s: float = BACKOFF_MAX_S, stable_s: float = STABLE_AFTER_S
    ):
        self.start_s, self.max_s, self.stable_s = start_s, max_s, stable_s
        self._next = start_s

    def delay(self, ran_s: float) -> float:
        """The delay (s) before the next start, given how long the last run lasted (s)."""
        if ran_s >= self.stable_s:
            self._next = self.start_s
        d = self._next
        self._next = min(self.max_s, self._next * 2)
        return d


def register_host(
    store: Any, name: str, url: str, usd_per_hour: float | None, gpu_kind: str | None, default_gpu_kind: str
) -> Any:
    """Register (or update the URL of) the host ``control up`` runs. A price (USD/hour)
    or GPU kind already recorded is kept unless given (not None): a restart must not
    rewrite the cost history.

    Returns:
        The host row.
    Raises:
        control.store.BadHostSpec: invalid name, URL or price.
    """
    from .store import UnknownHost, add_host, get_host, origin

    try:
        old = get_host(store, name)
    except UnknownHost:
        old = None
    price = usd_per_hour if usd_per_hour is not None else (old.usd_per_hour if old is not None else 0.0)
    kind = gpu_kind or (old.gpu_kind if old is not None and old.gpu_kind else default_gpu_kind)
    return add_host(store, name, url, usd_per_hour=price, gpu_kind=kind, update=True, origin_=origin("up"))


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


def wait_port_free(address: str, port: int, timeout_s: float = 60.0, out=sys.stdout) -> bool:
    """Wait until nothing listens on ``address:port`` (e.g. the engine host of a previous
    ``control up`` that was killed is still shutting down). Returns True when free."""
    import socket

    t0, said = time.monotonic(), False
    while time.monotonic() - t0 < timeout_s:
        with socket.socket() as s:
            s.settimeout(1.0)
            if s.connect_ex((address if address not in ("0.0.0.0", "") else "127.0.0.1", port)) != 0:
                return True
        if not said:
            print(
                f"SpecPilot: port {port} is still in use (a previous engine host shutting down?); waiting",
                file=out,
                flush=True,
            )
            said = True
        time.sleep(0.5)
    return False


def start_dashboard(cmd: list[str]) -> subprocess.Popen:
    """Start the dashboard as a child that dies with this process."""
    return subprocess.Popen(cmd, start_new_session=True, preexec_fn=die_with_parent(os.getpid()))


class Supervisor:
    """Keeps the engine host (and the dashboard) of ``control up`` running.

    Args:
        store: the store; name: the host's name in it; collector: the running
        :class:`control.collector.Collector`; make_engine: builds a fresh (not started)
        engine host; engine: the one running; dashboard_cmd / dashboard: the dashboard's
        argv and process (None: none); ready_timeout_s: how long a restart may take (s);
        liveness_s: an engine host whose ``/health`` has not answered 200 for this long
        (s), or that answered 503 twice in a row (vLLM's answer once its engine core is
        dead), is killed and restarted like one that exited (0: off); probe_s: seconds
        between ``/health`` probes.

    :meth:`run` loops until KeyboardInterrupt (Ctrl-C, SIGTERM). ``engine`` and
    ``dashboard`` are always the current processes (for the clean-up).
    """

    def __init__(
        self,
        store: Any,
        name: str,
        collector: Any,
        make_engine: Callable[[], Any],
        engine: Any,
        dashboard_cmd: list[str] | None,
        dashboard: subprocess.Popen | None,
        ready_timeout_s: float,
        liveness_s: float = 30.0,
        probe_s: float = 1.0,
        poll_s: float = 0.5,
        out=sys.stdout,
    ):
        self.store, self.name, self.collector = store, name, collector
        self.make_engine, self.engine = make_engine, engine
        self.dashboard_cmd, self.dashboard = dashboard_cmd, dashboard
        self.ready_timeout_s, self.poll_s, self.out = ready_timeout_s, poll_s, out
        self.engine_backoff, self.dashboard_backoff = Backoff(), Backoff()
        self.restarts = 0
        self.liveness_s, self.probe_s = liveness_s, probe_s
        self._last_healthy = self._next_probe = time.monotonic()
        self._dead_answers = 0
        self._engine_up_since = time.monotonic()
        self._dashboard_up_since = time.monotonic()

    def _say(self, msg: str) -> None:
        print(f"SpecPilot: {msg}", file=self.out, flush=True)

    def _audit(self, action: str, outcome: str, message: str, detail: dict[str, Any]) -> None:
        from .apply import SYSTEM_ACTOR
        from .store import origin, record_audit

        try:
            record_audit(
                self.store,
                actor=SYSTEM_ACTOR,
                origin=origin("up"),
                action=action,
                outcome=outcome,
                host_name=self.name,
                message=message,
                detail=detail,
            )
        except Exception:  # the store may be unreachable; supervision goes on
            log.exception("could not record %s in the audit trail", action)

    def _probe(self) -> None:
        """Kill an engine host that stopped answering ``/health`` for ``liveness_s`` s."""
        import httpx

        now = time.monotonic()
        if not self.liveness_s or now < self._next_probe:
            return
        self._next_probe = now + self.probe_s
        try:
            status = httpx.get(self.engine.url + "/health", timeout=2.0).status_code
        except httpx.HTTPError:
            status = None
        self._dead_answers = self._dead_answers + 1 if status == 503 else 0
        why = None
        if status == 200:
            self._last_healthy = time.monotonic()
        elif self._dead_answers >= 2:  # vLLM answers 503 only once its engine core is dead
            why = "its engine is dead (/health answers 503)"
        elif time.monotonic() - self._last_healthy > self.liveness_s:
            why = f"no answer on /health for {self.liveness_s:.0f} s"
        if why:
            self._say(f"the engine host is alive but {why}; killing it")
            self._audit("engine_host.kill", "failed", why, {"pid": self.engine.proc.pid})
            kill_group(self.engine.proc.pid, grace_s=0.0)
            self.engine.proc.wait()
            self._dead_answers = 0

    def run(self) -> NoReturn:
        while True:
            self._probe()
            if not self.engine.alive():
                self._engine_exited()
            if self.dashboard is not None and self.dashboard.poll() is not None:
                self._dashboard_exited()
            time.sleep(self.poll_s)

    def _engine_exited(self) -> None:
        from engine_host.process import EngineHostError

        t_exit = time.time()
        code = self.engine.proc.returncode
        why = f"the engine host exited ({code})"
        self.engine.stop()  # closes its log
        kill_group(self.engine.proc.pid, grace_s=2.0)
        try:
            self.collector.mark_down(self.name, t_exit, why)
        except Exception:
            log.exception("could not record the host as down")
        delay = self.engine_backoff.delay(time.monotonic() - self._engine_up_since)
        self._say(f"{why}; log {self.engine.log_path}; restarting it in {delay:.0f} s")
        self._audit(
            "engine_host.exit",
            "failed",
            f"{why}; restart in {delay:.0f} s",
            {"returncode": code, "restart_in_s": delay},
        )
        time.sleep(delay)
        self.restarts += 1
        self.engine = self.make_engine()
        wait_port_free(self.engine.host, self.engine.port, out=self.out)
        self.engine.start()
        self._engine_up_since = time.monotonic()
        self._audit(
            "engine_host.restart",
            "ok",
            f"restart {self.restarts} of the engine host (after {why})",
            {"restart": self.restarts, "delay_s": delay, "previous_returncode": code},
        )
        try:
            seconds = wait_ready(self.engine, self.ready_timeout_s, out=self.out)
        except EngineHostError as exc:
            self._say(f"the restarted engine host did not become ready: {exc}")
            if self.engine.alive():
                self.engine.stop()
            return  # the next loop sees it dead and restarts it after a longer delay
        self._last_healthy = time.monotonic()
        self._say(f"engine host ready again in {seconds:.0f} s; the collector re-applies the last applied version")

    def _dashboard_exited(self) -> None:
        assert self.dashboard is not None and self.dashboard_cmd is not None  # run() checks the dashboard
        code = self.dashboard.returncode
        delay = self.dashboard_backoff.delay(time.monotonic() - self._dashboard_up_since)
        self._say(f"the dashboard exited ({code}); restarting it in {delay:.0f} s")
        self._audit(
            "dashboard.restart",
            "ok",
            f"the dashboard exited ({code}); restarted after {delay:.0f} s",
            {"returncode": code, "delay_s": delay},
        )
        time.sleep(delay)
        self.dashboard = start_dashboard(self.dashboard_cmd)
        self._dashboard_up_since = time.monotonic()


def run_up(args: argparse.Namespace) -> int:
    """Run the main job until Ctrl-C / SIGTERM. Returns the exit status."""
    from engine_host.auth import control_token
    from engine_host.launcher import is_cpu_build
    from engine_host.process import EngineHostError

    from .collector import Collector
    from .store import Store

    store = Store.open(args.db)
    token, created = control_token()
    os.environ[DEFAULT_TOKEN_ENV] = token
    cpu = is_cpu_build()
    extra = (["--enforce-eager"] if cpu and "--enforce-eager" not in args.engine_arg else []) + list(args.engine_arg)

    def make_engine() -> SupervisedEngineHost:
        return SupervisedEngineHost(port=args.port, host=args.address, model=args.model, extra_args=extra, token=token)

    eh = make_engine()
    dashboard_cmd: list[str] | None = None
    sup: Supervisor | None = None

    def on_signal(signum: int, _frame: Any) -> None:
        raise KeyboardInterrupt  # also ends a start-up still waiting for the engine

    # Ctrl-C and SIGTERM both stop everything, even where SIGINT was inherited as
    # ignored (a job started in the background by a non-interactive shell)
    previous = {sig: signal.signal(sig, on_signal) for sig in (signal.SIGINT, signal.SIGTERM)}
    collector = None
    dashboard = None
    try:
        wait_port_free(args.address, args.port)
        print(f"SpecPilot: starting the engine host on {eh.url} (log {eh.log_path})", flush=True)
        eh.start()
        seconds = wait_ready(eh, args.ready_timeout)
        print(f"SpecPilot: engine host ready in {seconds:.0f} s", flush=True)
        register_host(store, args.name, eh.url, args.usd_per_hour, args.gpu, "cpu" if cpu else "gpu")
        if not args.no_dashboard and dashboard_available():
            from dashboard.__main__ import bootstrap_user

            bootstrap_user()  # first start: the admin's password, framed, before the collector's log lines
        collector = Collector(store, interval_s=args.interval).start()
        if not args.no_dashboard and dashboard_available():
            dashboard_cmd = [
                sys.executable,
                "-m",
                "dashboard",
                "--port",
                str(args.dashboard_port),
                "--address",
                args.address,
            ]
            if args.db:
                dashboard_cmd += ["--db", args.db]
            dashboard = start_dashboard(dashboard_cmd)
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
        sup = Supervisor(
            store,
            args.name,
            collector,
            make_engine,
            eh,
            dashboard_cmd,
            dashboard,
            args.ready_timeout,
            liveness_s=args.liveness_s,
        )
        sup.run()
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
            if sup is not None:
                eh, dashboard = sup.engine, sup.dashboard
            if dashboard is not None:
                _stop_child(dashboard)
            if collector is not None:
                collector.stop()
            eh.stop()
            if eh.proc is not None:
                kill_group(eh.proc.pid, grace_s=2.0)
            store.close()
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)
        print("SpecPilot: stopped", flush=True)
