"""Start and stop an engine host as a child process (used by the main job, the tests
and the benchmarks).

Example::

    with EngineHostProcess(port=8000, extra_args=["--enforce-eager"]) as eh:
        eh.wait_ready()
        httpx.get(eh.url + "/control/state", headers=eh.control_headers)
"""

from __future__ import annotations

import os
import secrets
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import IO

import httpx

from .home import subdir


def free_port() -> int:
    """An unused TCP port on 127.0.0.1."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class EngineHostError(RuntimeError):
    """The engine host exited or did not become ready; the message has its log tail."""


def _default_sigint() -> None:
    """In the child before exec: SIGINT back to its default. A process started from a
    shell's background job (``cmd &`` in a script, as CI may run) inherits SIGINT ignored,
    and Python then never turns Ctrl-C into KeyboardInterrupt: such an engine host or
    router would not stop on SIGINT, and a router killed later leaves its engines behind."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


class EngineHostProcess:
    """An engine host (``python -m engine_host``) run as a child process.

    Args:
        port: port to listen on (default: a free one).
        host: address to listen on.
        model: ``--model`` argument (default model when None).
        extra_args: further ``python -m engine_host`` arguments.
        token: control token (default: a fresh random one, passed by environment).
        log_path: where stdout/stderr go (default ``$SPECPILOT_HOME/logs/engine-<port>.log``).
        env: extra environment variables.
    """

    def __init__(
        self,
        port: int | None = None,
        host: str = "127.0.0.1",
        model: str | None = None,
        extra_args: list[str] | None = None,
        token: str | None = None,
        log_path: str | os.PathLike[str] | None = None,
        env: dict[str, str] | None = None,
    ):
        self.port = port or free_port()
        self.host = host
        self.model = model
        self.extra_args = list(extra_args or [])
        self.token = token or secrets.token_urlsafe(24)
        self.log_path = Path(log_path) if log_path else subdir("logs") / f"engine-{self.port}.log"
        self.env = dict(env or {})
        self.proc: subprocess.Popen[bytes] | None = None
        self._log: IO[bytes] | None = None
        self.started_at: float | None = None

    @property
    def url(self) -> str:
        """Base URL, e.g. ``http://127.0.0.1:8000``."""
        return f"http://{self.host}:{self.port}"

    @property
    def control_headers(self) -> dict[str, str]:
        """``Authorization`` header for ``/control/*``."""
        return {"Authorization": f"Bearer {self.token}"}

    def command(self) -> list[str]:
        """The argv that starts this engine host."""
        cmd = [sys.executable, "-m", "engine_host", "--host", self.host, "--port", str(self.port)]
        if self.model:
            cmd += ["--model", self.model]
        return cmd + self.extra_args

    def _preexec(self) -> Callable[[], None]:
        """What the child runs before exec (subclasses add, e.g., dying with the parent)."""
        return _default_sigint

    def start(self) -> "EngineHostProcess":
        """Start the process (returns at once; see :meth:`wait_ready`)."""
        env = dict(os.environ)
        env.update(self.env)
        env["SPECPILOT_CONTROL_TOKEN"] = self.token
        env.setdefault("PYTHONUNBUFFERED", "1")
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self._log = open(self.log_path, "ab")
        self.started_at = time.monotonic()
        self.proc = subprocess.Popen(
            self.command(),
            stdout=self._log,
            stderr=subprocess.STDOUT,
            env=env,
            start_new_session=True,
            preexec_fn=self._preexec(),
        )
        return self

    def log_tail(self, n: int = 40) -> str:
        """Last ``n`` lines of the log."""
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return ""

    def alive(self) -> bool:
        """True while the process runs."""
        return self.proc is not None and self.proc.poll() is None

    def wait_ready(self, timeout_s: float = 300.0) -> float:
        """Wait until ``GET /ready`` answers 200.

        Returns:
            Seconds from start to ready.
        Raises:
            EngineHostError: the process exited or the timeout passed (with the log tail).
        """
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if not self.alive():
                raise EngineHostError(
                    f"engine host exited with {self.proc and self.proc.returncode}:\n{self.log_tail()}"
                )
            try:
                r = httpx.get(self.url + "/ready", timeout=2.0)
                if r.status_code == 200:
                    return time.monotonic() - (self.started_at or time.monotonic())
                if r.status_code == 503 and r.json().get("phase") == "warmup_failed":
                    raise EngineHostError(f"warm-up failed: {r.json()}\n{self.log_tail()}")
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        raise EngineHostError(f"engine host not ready after {timeout_s:.0f} s:\n{self.log_tail()}")

    def stop(self, timeout_s: float = 30.0) -> None:
        """Stop the process group: SIGINT (what Ctrl-C sends), SIGTERM after ``timeout_s``,
        SIGKILL 10 s after that."""
        if self.proc is None:
            return
        for sig, wait in ((signal.SIGINT, timeout_s), (signal.SIGTERM, 10.0), (signal.SIGKILL, 10.0)):
            if self.proc.poll() is not None:
                break
            try:
                os.killpg(self.proc.pid, sig)
            except ProcessLookupError:
                break
            try:
                self.proc.wait(timeout=wait)
                break
            except subprocess.TimeoutExpired:
                continue
        if self._log:
            self._log.close()
            self._log = None

    def __enter__(self) -> "EngineHostProcess":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


class RouterProcess(EngineHostProcess):
    """The dual engine host (``python -m engine_host.router``: a plain and a speculative
    engine behind one address) as a child process; same interface as
    :class:`EngineHostProcess` (``extra_args`` go to ``engine_host.router``)."""

    def command(self) -> list[str]:
        cmd = [sys.executable, "-m", "engine_host.router", "--host", self.host, "--port", str(self.port)]
        if self.model:
            cmd += ["--model", self.model]
        return cmd + self.extra_args
