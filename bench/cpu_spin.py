"""Spin loops for the CPU probes (``bench cpu-pairs``, ``bench cpu-idle``): a loop that
measures the calling thread's speed, and a busy child process pinned to one CPU that ends with
its parent. Standard library only (the probes run on hosts with a bare Python). Linux only."""

from __future__ import annotations

import multiprocessing as mp
import os
import time
from typing import Any


def spin_rate(seconds: float) -> float:
    """Spin ``seconds`` (s) in the calling thread; its speed in iterations/s of a loop that
    reads the monotonic clock."""
    n = 0
    clock = time.perf_counter
    end = clock() + seconds
    while clock() < end:
        n += 1
    return n / seconds


def _spin(cpu: int, go: Any, stop: Any, idle: bool, parent: int) -> None:
    """The child's loop: pinned to ``cpu`` (at the SCHED_IDLE policy with ``idle``), busy
    while ``go`` is set, until ``stop`` is set or its parent ``parent`` is gone."""
    os.sched_setaffinity(0, {cpu})
    if idle:
        try:
            os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))  # type: ignore[attr-defined]
        except (AttributeError, OSError):
            os.nice(19)
    while not stop.is_set() and os.getppid() == parent:
        if not go.wait(0.005):
            continue
        for _ in range(10000):
            pass


class Spinner:
    """A busy process pinned to ``cpu`` (``idle``: at the SCHED_IDLE policy, so it takes the
    CPU only when nothing else wants it); it spins while :attr:`go` is set (from the start
    with ``busy``) and ends at :meth:`stop`, or by itself within a few ms when this process
    is gone (even killed with SIGKILL)."""

    def __init__(self, cpu: int, busy: bool = True, idle: bool = False) -> None:
        ctx = mp.get_context("fork")
        self.go, self._stop = ctx.Event(), ctx.Event()
        if busy:
            self.go.set()
        self.process = ctx.Process(target=_spin, args=(cpu, self.go, self._stop, idle, os.getpid()), daemon=True)
        self.process.start()

    def stop(self) -> None:
        """End the process (killed when it does not end within 5 s)."""
        self._stop.set()
        self.process.join(5)
        if self.process.is_alive():
            self.process.kill()
            self.process.join(5)
