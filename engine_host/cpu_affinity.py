"""A CPU of its own for the engine core's step loop (``python -m engine_host --core-cpu N``).

At low load a step of a small model is bound by the engine core's CPU work (scheduling,
input preparation, kernel launches, output handling), so a step loop that shares its CPU
with the API server, vLLM's I/O threads or another engine runs slower, and by how much
depends on where the operating system put each thread at the time. With ``--core-cpu N``
the launcher keeps itself, and so everything it starts (``vllm serve``'s API server, the
engine core's other threads, the GPU driver's threads), off CPU ``N``, and the scheduler
hook pins the thread that runs the engine core's step loop to ``N`` at its first step
(after vLLM has started its I/O threads, which keep the mask they were born with). The CPU
need not be in the launcher's own mask (a script may keep all its engine hosts off the CPUs it
hands out), only one that a thread of the process can take: the launcher tries it first.

Linux only (``os.sched_setaffinity``); elsewhere the option is refused with a clear error.
"""

from __future__ import annotations

import logging
import os
import threading
from typing import Callable

logger = logging.getLogger(__name__)


class CpuAffinityError(ValueError):
    """A CPU that cannot be given to the engine core's step loop (the reason in the message)."""


def allowed_cpus() -> set[int]:
    """The CPUs this thread may run on (``os.sched_getaffinity(0)``).

    Raises:
        CpuAffinityError: the platform has no CPU affinity calls.
    """
    get = getattr(os, "sched_getaffinity", None)
    if get is None:
        raise CpuAffinityError("this platform cannot set CPU affinity (Linux only)")
    return set(get(0))


def pin_refused(cpu: int) -> str | None:
    """Why a thread of this process could not be pinned to ``cpu`` (a trial in a short-lived
    thread: the CPU may lie outside this process's current mask but inside what it may take),
    or None when it could."""
    reason: list[str] = []

    def trial() -> None:
        try:
            os.sched_setaffinity(0, {cpu})
        except (AttributeError, OSError, ValueError, OverflowError) as exc:
            reason.append(str(exc) or type(exc).__name__)

    t = threading.Thread(target=trial, name="specpilot-cpu-trial")
    t.start()
    t.join()
    return reason[0] if reason else None


def check_core_cpu(
    cpu: int, allowed: set[int] | None = None, refused: Callable[[int], str | None] = pin_refused
) -> set[int]:
    """The CPUs left for everything but the step loop when it gets ``cpu``.

    Args:
        cpu: CPU index for the engine core's step loop.
        allowed: the CPUs this process runs on now (default :func:`allowed_cpus`).
        refused: why ``cpu`` cannot be had (default :func:`pin_refused`, a real trial).

    Returns:
        ``allowed`` less ``cpu`` (never empty).

    Raises:
        CpuAffinityError: ``cpu`` is negative, cannot be had here, or is all that ``allowed`` holds.
    """
    allowed = allowed_cpus() if allowed is None else set(allowed)
    if cpu < 0:
        raise CpuAffinityError(f"--core-cpu must be a CPU index >= 0, got {cpu}")
    why = refused(cpu)
    if why is not None:
        raise CpuAffinityError(
            f"CPU {cpu} cannot be given to the step loop here ({why}; this process runs on {_span(allowed)})"
        )
    rest = allowed - {cpu}
    if not rest:
        raise CpuAffinityError(f"CPU {cpu} is the only CPU this process runs on: nothing left for the API server")
    return rest


def keep_off(cpu: int) -> set[int]:
    """Keep the calling thread, and every process or thread it starts from now on, off
    ``cpu`` (the launcher, before it becomes ``vllm serve``).

    Returns:
        The CPUs the calling thread may now run on.

    Raises:
        CpuAffinityError: as :func:`check_core_cpu`.
    """
    rest = check_core_cpu(cpu)
    os.sched_setaffinity(0, rest)
    return rest


def pin_calling_thread(cpu: int) -> bool:
    """Pin the calling thread (only it: Linux's ``sched_setaffinity`` on thread id 0) to
    ``cpu``. Never raises: a CPU that cannot be had is logged and the thread keeps its mask.

    Returns:
        True when pinned.
    """
    try:
        os.sched_setaffinity(0, {cpu})
    except (AttributeError, OSError, ValueError) as exc:
        logger.warning("SpecPilot: could not pin the engine core's step loop to CPU %d: %s", cpu, exc)
        return False
    logger.info("SpecPilot: the engine core's step loop runs on CPU %d only", cpu)
    return True


def calling_thread_cpus() -> list[int]:
    """The CPUs the calling thread may run on, ascending (empty where unknown)."""
    try:
        return sorted(allowed_cpus())
    except CpuAffinityError:
        return []


def _span(cpus: set[int]) -> str:
    """``0-3,8`` style text of a CPU set (for messages)."""
    out: list[str] = []
    run: list[int] = []
    for c in sorted(cpus):
        if run and c == run[-1] + 1:
            run.append(c)
            continue
        if run:
            out.append(f"{run[0]}-{run[-1]}" if len(run) > 1 else str(run[0]))
        run = [c]
    if run:
        out.append(f"{run[0]}-{run[-1]}" if len(run) > 1 else str(run[0]))
    return ",".join(out) or "none"
