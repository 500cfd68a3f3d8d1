"""A CPU of its own for the engine core's step loop (``python -m engine_host --core-cpu``).

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

``--core-cpu auto`` (the GPU build's default) takes the highest-numbered CPU of the launcher's
mask that no other engine host on the machine holds (never its lowest-numbered CPU): each
engine host holds a lock file (``core-cpu-N.lock`` in :func:`lock_dir`) for its CPU while it
lives (its processes share the lock), so several engine hosts on one machine (one per GPU, or
a benchmark's engines on one GPU) get a CPU each. ``off`` (the
CPU build's default: vLLM's CPU build binds its own compute threads) pins nothing. Either way
the launcher keeps its engine host off the CPUs that other engine hosts' step loops hold.

Linux only (``os.sched_setaffinity``); elsewhere a CPU given by number is refused with a
clear error and ``auto`` pins nothing.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import logging
import os
import tempfile
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

logger = logging.getLogger(__name__)


class CpuAffinityError(ValueError):
    """A CPU that cannot be given to the engine core's step loop (the reason in the message)."""


AUTO = "auto"
OFF = "off"
#: what ``--core-cpu`` and ``$SPECPILOT_CORE_CPU`` take besides a CPU index
CHOICES = (AUTO, OFF)


def parse_core_cpu(text: str) -> int | str:
    """``--core-cpu``'s value: ``"auto"``, ``"off"`` or a CPU index (int >= 0).

    Raises:
        CpuAffinityError: anything else.
    """
    t = text.strip().lower()
    if t in CHOICES:
        return t
    if t.isdigit():
        return int(t)
    raise CpuAffinityError(f"--core-cpu takes auto, off or a CPU index (a whole number >= 0), got {text!r}")


def lock_dir() -> Path:
    """The machine-wide folder of the engine hosts' CPU locks (in the temporary folder, so
    that engine hosts of every user and data directory see each other's)."""
    return Path(tempfile.gettempdir()) / "specpilot-core-cpu"


@dataclass(frozen=True)
class CoreCpuClaim:
    """The CPU an engine host's step loop takes: ``cpu``, ``fd`` (the open lock file, held
    until the process ends; inheritable, so it outlives the launcher's ``exec``) and
    ``how`` (``"auto"`` or ``"given"``)."""

    cpu: int
    fd: int
    how: str


def _lock(folder: Path, cpu: int) -> int | str:
    """Take ``core-cpu-<cpu>.lock`` in ``folder`` (non-blocking): the open descriptor, or why
    not (the holder's pid when it wrote one)."""
    try:
        folder.mkdir(parents=True, exist_ok=True)
        fd = os.open(folder / f"core-cpu-{cpu}.lock", os.O_RDWR | os.O_CREAT, 0o666)
    except OSError as exc:
        return f"its lock file cannot be opened ({exc.strerror or exc})"
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as exc:
        holder = os.pread(fd, 32, 0).decode(errors="replace").strip()
        os.close(fd)
        if exc.errno in (errno.EAGAIN, errno.EACCES, errno.EWOULDBLOCK):
            return f"another engine host (pid {holder or '?'}) holds it"
        return f"its lock file cannot be locked ({exc.strerror or exc})"
    os.ftruncate(fd, 0)
    os.pwrite(fd, str(os.getpid()).encode(), 0)
    os.set_inheritable(fd, True)
    return fd


def claim_core_cpu(
    choice: int | str,
    folder: Path | None = None,
    allowed: set[int] | None = None,
    refused: Callable[[int], str | None] | None = None,
) -> CoreCpuClaim | None:
    """Resolve ``--core-cpu`` to a CPU and hold it for this process.

    Args:
        choice: ``"off"`` (None back), ``"auto"`` (the highest-numbered CPU of ``allowed``
            that can be pinned and no other engine host holds, never the lowest-numbered one,
            where the system's housekeeping usually runs; None when there is none) or a CPU
            index (that CPU, or an error).
        folder: where the locks live (default :func:`lock_dir`).
        allowed: the CPUs this process runs on now (default :func:`allowed_cpus`).
        refused: why a CPU cannot be had (default :func:`pin_refused`, a real trial).

    Returns:
        The claim, or None (nothing to pin).

    Raises:
        CpuAffinityError: a CPU index that cannot be had (:func:`check_core_cpu`) or that
            another engine host holds; an unknown choice.
    """
    if choice == OFF:
        return None
    folder = lock_dir() if folder is None else folder
    refused = pin_refused if refused is None else refused
    if isinstance(choice, int):
        check_core_cpu(choice, allowed, refused)
        got = _lock(folder, choice)
        if isinstance(got, str):
            raise CpuAffinityError(f"CPU {choice} cannot be given to the step loop: {got}")
        return CoreCpuClaim(choice, got, "given")
    if choice != AUTO:
        raise CpuAffinityError(f"--core-cpu takes auto, off or a CPU index, got {choice!r}")
    try:
        mask = allowed_cpus() if allowed is None else set(allowed)
    except CpuAffinityError:
        return None
    for cpu in sorted(mask, reverse=True)[:-1]:  # never the lowest: the system's housekeeping runs there
        if refused(cpu) is not None:
            continue
        got = _lock(folder, cpu)
        if isinstance(got, int):
            return CoreCpuClaim(cpu, got, AUTO)
    return None


def affinity_supported() -> bool:
    """Whether this platform has CPU affinity calls (Linux)."""
    return hasattr(os, "sched_getaffinity") and hasattr(os, "sched_setaffinity")


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


def held_by_others(folder: Path | None = None) -> set[int]:
    """The CPUs whose lock in ``folder`` (default :func:`lock_dir`) an engine host holds
    (this process's own claim included: its lock is taken through another descriptor)."""
    folder = lock_dir() if folder is None else folder
    held: set[int] = set()
    try:
        names = os.listdir(folder)
    except OSError:
        return held
    for name in names:
        stem = name.removeprefix("core-cpu-").removesuffix(".lock")
        if not (name.startswith("core-cpu-") and name.endswith(".lock") and stem.isdigit()):
            continue
        try:
            fd = os.open(folder / name, os.O_RDONLY)
        except OSError:
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except OSError:
            held.add(int(stem))
        finally:
            os.close(fd)  # (closing releases a lock just taken)
    return held


def keep_off(cpu: int | None, others: set[int] | frozenset[int] = frozenset()) -> set[int]:
    """Keep the calling thread, and every process or thread it starts from now on, off
    ``cpu`` (this engine host's step loop's, None: none) and off ``others`` (the step loops'
    CPUs of the other engine hosts on the machine, :func:`held_by_others`) where CPUs remain
    without them (the launcher, before it becomes ``vllm serve``).

    Returns:
        The CPUs the calling thread may now run on.

    Raises:
        CpuAffinityError: as :func:`check_core_cpu`.
    """
    mask = allowed_cpus()
    rest = check_core_cpu(cpu, mask, lambda c: None) if cpu is not None else mask
    rest = (rest - set(others)) or rest
    if rest != mask:
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


def task_ids(pid: int) -> list[int]:
    """The thread ids of process ``pid`` (``/proc/<pid>/task``); empty where unknown."""
    try:
        return sorted(int(t) for t in os.listdir(f"/proc/{pid}/task") if t.isdigit())
    except OSError:
        return []


def process_tree(pid: int) -> list[int]:
    """``pid`` and the ids of all its descendant processes (psutil, which vLLM requires);
    ``[pid]`` alone where they cannot be listed."""
    try:
        import psutil

        return [pid] + [c.pid for c in psutil.Process(pid).children(recursive=True)]
    except Exception:  # no psutil, or the process ended: what is known
        return [pid]


def keep_threads_off(
    tids: list[int],
    off: set[int],
    base: set[int],
    get: Callable[[int], set[int]] | None = None,
    put: Callable[[int, set[int]], None] | None = None,
) -> int:
    """Move each thread of ``tids`` off the CPUs ``off``: a thread whose mask has CPUs left
    without them keeps those; one whose mask holds nothing else (a thread born of the pinned
    step loop inherits its one CPU) gets ``base`` less ``off``. A thread that ended meanwhile,
    or that this process may not change, is passed over.

    Args:
        tids: thread ids (Linux task ids; the step loop's own left out by the caller).
        off: CPU indices to keep free (this engine host's step loop's and other engine hosts').
        base: the CPUs the engine host's other threads were started on (the launcher's mask).
        get, put: ``os.sched_getaffinity`` / ``os.sched_setaffinity`` (tests pass their own).

    Returns:
        How many threads were moved.
    """
    get = (lambda tid: set(os.sched_getaffinity(tid))) if get is None else get
    put = os.sched_setaffinity if put is None else put
    moved = 0
    for tid in tids:
        try:
            mask = get(tid)
            new = (mask - off) or (base - off)
            if not new or new == mask:
                continue
            put(tid, new)
            moved += 1
        except (OSError, ValueError):  # ended, or not ours to change
            continue
    return moved


class CoreCpuKeeper:
    """Keeps an engine host's threads off the CPUs the step loops hold, while it runs.

    The launcher keeps ``vllm serve`` off the CPUs that engine hosts held when it started;
    an engine host started at the same moment or later claims its CPU after that, and a
    thread that the pinned step loop starts inherits its one CPU. Every ``every_s`` (s) a
    daemon thread of the engine core moves each thread of ``pids`` and of their descendant
    processes (the API server's process, the engine core's and its workers), except the step
    loop's, off this engine host's CPU and
    the CPUs other engine hosts' locks hold (:func:`held_by_others`, :func:`keep_threads_off`).
    An engine host whose step loop is not pinned (``cpu`` None) keeps all its threads off the
    other engine hosts' CPUs.

    The descendant processes are listed again every ``TREE_EVERY`` passes, or sooner when
    one listed has ended: listing them (psutil) reads every process of the host, holding the
    interpreter's lock for most of it, while the step loop waits for that lock (an engine's
    processes are all started by its first step). The threads of the processes listed are
    read at every pass.

    Args:
        cpu: the step loop's CPU (int >= 0), or None (not pinned).
        step_tid: the step loop thread's id (``threading.get_native_id()``), or None.
        pids: process ids whose threads, and their descendants' threads, are kept off.
        base: the CPUs the engine host's threads were started on (never empty).
        every_s: seconds between two passes (> 0).
        folder: where the locks live (default :func:`lock_dir`).
    """

    TREE_EVERY = 6  # passes between two listings of the descendant processes

    def __init__(
        self,
        cpu: int | None,
        step_tid: int | None,
        pids: list[int],
        base: set[int],
        every_s: float = 10.0,
        folder: Path | None = None,
    ) -> None:
        self.cpu, self.step_tid, self.pids = cpu, step_tid, list(dict.fromkeys(pids))
        self.base, self.every_s, self.folder = set(base), every_s, folder
        self.moved = 0  # threads moved so far (all passes)
        self._tree: list[int] = []  # pids and their descendants, as last listed
        self._passes = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def keep_off_once(self) -> int:
        """One pass (see the class); returns how many threads it moved."""
        off = held_by_others(self.folder) | ({self.cpu} if self.cpu is not None else set())
        if not off:
            return 0
        tids = [t for pid in self._processes() for t in task_ids(pid) if t != self.step_tid]
        n = keep_threads_off(tids, off, self.base)
        if n:
            logger.info("SpecPilot: moved %d thread(s) off the step loops' CPUs %s", n, _span(off))
        self.moved += n
        return n

    def _processes(self) -> list[int]:
        """The processes whose threads a pass moves: listed again every ``TREE_EVERY``
        passes, or when one of those listed has ended."""
        tree = self._tree
        if not tree or self._passes % self.TREE_EVERY == 0 or not all(os.path.exists(f"/proc/{p}") for p in tree):
            tree = self._tree = list(dict.fromkeys(p for root in self.pids for p in process_tree(root)))
        self._passes += 1
        return tree

    def _run(self) -> None:
        with contextlib.suppress(OSError, ValueError):  # this thread itself never on the step loop's CPU
            own = {self.cpu} if self.cpu is not None else set()
            os.sched_setaffinity(0, (self.base - own) or self.base)
        while True:
            try:
                self.keep_off_once()
            except Exception:  # never take the engine core down over an affinity pass
                logger.exception("SpecPilot: the pass that keeps threads off the step loop's CPU failed")
            if self._stop.wait(self.every_s):
                return

    def start(self) -> CoreCpuKeeper:
        """Start the daemon thread (a pass at once, then one every ``every_s``); returns self."""
        self._thread = threading.Thread(target=self._run, name="specpilot-cpu-keeper", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        """End the daemon thread (waits for it)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join()


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
