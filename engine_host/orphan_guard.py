"""No vLLM process of an engine host outlives the engine host.

vLLM's API-server process (the engine host) starts the engine core, which starts its
workers. When the engine host dies without stopping them (``kill -9``, an OOM kill), the
core and workers are re-parented and would keep running with gigabytes of memory and
the old control channel mapped. Run in each of those child processes (through the
``vllm.general_plugins`` entry point, :mod:`engine_host.vllm_general`), :func:`install`
starts a watchdog thread that notices the re-parenting (``os.getppid()`` changes) and
ends its process: SIGTERM first (vLLM shuts its own children down), SIGKILL after
:data:`GRACE_S`. Workers watch the core the same way, so the chain ends within about
one poll interval per level.

The API process itself is left alone (it is the one whose parent may legitimately go
away, e.g. a shell after ``nohup``): the launcher names its PID in
``$SPECPILOT_API_PID``, and only processes with another PID arm the watchdog.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
from collections.abc import Mapping

from . import envs

ENV_API_PID = envs.API_PID
POLL_S = 0.2
GRACE_S = 3.0

_installed = False


def should_guard(pid: int | None = None, env: Mapping[str, str] | None = None) -> bool:
    """True in a vLLM child process of a SpecPilot engine host (not the API process,
    not a process started some other way)."""
    env = os.environ if env is None else env
    api = envs.api_pid(env)
    if not api.isdigit():
        return False
    return int(api) != (os.getpid() if pid is None else pid)


def _end_self(reason: str) -> None:
    print(f"SpecPilot: {reason}; process {os.getpid()} exits", file=sys.stderr, flush=True)
    try:
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(GRACE_S)
    finally:
        os.kill(os.getpid(), signal.SIGKILL)


def _watch(parent: int) -> None:
    while True:
        time.sleep(POLL_S)
        if os.getppid() != parent:
            _end_self(f"its parent process {parent} is gone")
            return


def install() -> bool:
    """Arm the watchdog in this process when :func:`should_guard` says so (once).

    Returns:
        True when armed (now or before). Never raises.
    """
    global _installed
    if _installed:
        return True
    if not should_guard():
        return False
    parent = os.getppid()
    if parent == 1:  # already orphaned before we got here
        _end_self("started without a parent process")
        return False
    threading.Thread(target=_watch, args=(parent,), name="specpilot-orphan-guard", daemon=True).start()
    _installed = True
    return True
