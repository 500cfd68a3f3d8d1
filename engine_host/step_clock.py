"""Which engine step an output belongs to, and how long that step took.

With synchronous scheduling vLLM's engine core calls ``schedule()`` and then
``update_from_output()`` for the same step, one after the other. With async scheduling
(vLLM's ``AsyncScheduler``, the default on Model Runner V2) it schedules step N+1 *before*
it hands over the output of step N, so "the last ``schedule()``" is the wrong step: its
time is too recent (the step looks too short) and its K is the next step's.

:class:`StepClock` keeps the scheduled steps in order (a FIFO: vLLM hands outputs back in
the order it scheduled them) and measures a step from the later of its own ``schedule()``
and the previous step's output: on a busy async engine the device starts step N when step
N-1 is done, so consecutive outputs bound a step; after an idle spell the step starts when
it was scheduled. On a synchronous engine both rules give the old answer, the time from
``schedule()`` to its output.

A step may also carry the object ``schedule()`` returned (vLLM's ``SchedulerOutput``, which
the engine core hands back with the step's output): an output is then matched to its own step
by that object, and the output of a step that was never recorded (scheduled while the hook
stepped aside, ``engine_host.scheduler``) pops nothing.
"""

from __future__ import annotations

from collections import deque
from typing import NamedTuple


class ScheduledStep(NamedTuple):
    """One scheduled step: when (``time.perf_counter()`` s) and with which K. A named tuple:
    one is made every engine step, and a frozen dataclass costs several times as much to
    build."""

    t_scheduled: float
    k_drafted: int  # K of the drafts verified in this step
    k_proposed: int  # K chosen in this step for the next drafts
    vllm_schedule_s: float = 0.0  # vLLM's own schedule() for this step (s; 0.0: not measured)
    key: object = None  # what schedule() returned for this step (None: match by order only)
    rule: str = ""  # which of the hook's rules set k_proposed ("": not recorded; engine_host.step_trace)


class StepClock:
    """FIFO of scheduled steps, matched to their outputs.

    Args:
        depth: the most steps kept in flight (vLLM's async path keeps at most 2;
            older entries are dropped if outputs ever go missing).
    """

    def __init__(self, depth: int = 8):
        self._pending: deque[ScheduledStep] = deque(maxlen=depth)
        self._t_last_output = 0.0

    def scheduled(
        self,
        t: float,
        k_drafted: int,
        k_proposed: int,
        vllm_schedule_s: float = 0.0,
        key: object = None,
        rule: str = "",
    ) -> None:
        """Record a ``schedule()`` call made at ``t`` (s), in which vLLM's own scheduler took
        ``vllm_schedule_s`` (s) and returned ``key`` (its output comes back with it); ``rule``
        names the hook's rule that set ``k_proposed`` (``engine_host.step_trace``)."""
        self._pending.append(ScheduledStep(t, k_drafted, k_proposed, vllm_schedule_s, key, rule))

    def clear(self) -> None:
        """Forget the steps in flight (their outputs will not be matched)."""
        self._pending.clear()

    @property
    def in_flight(self) -> int:
        """Steps scheduled whose output has not come back yet."""
        return len(self._pending)

    def output(self, t: float, key: object = None) -> tuple[float, ScheduledStep | None]:
        """An output came back at ``t`` (s), for the step whose ``schedule()`` returned ``key``
        (None: the oldest step in flight): its step and the step's duration (s). Steps recorded
        before a matched one are dropped (their outputs went missing).

        Returns:
            ``(step_time_s, step)``; ``(0.0, None)`` when no step was recorded, or none with
            ``key`` (nothing is popped then).
        """
        pending = self._pending
        last, self._t_last_output = self._t_last_output, t
        if not pending:
            return 0.0, None
        step = pending[0]
        if key is not None and step.key is not key and step.key is not None:
            older = next((i for i, s in enumerate(pending) if s.key is key), -1)
            if older < 0:
                return 0.0, None
            for _ in range(older):
                pending.popleft()
            step = pending[0]
        pending.popleft()
        return max(0.0, t - max(step.t_scheduled, last)), step


class DecodeStretch:
    """How many pure-decode steps with the same number of requests came right before a step,
    and whether the step's time should teach the step-time model.

    A request's first decode steps cost more than its later ones: its inputs are prepared
    and, with drafts, the proposer starts on it. At ``SETTLE_MAX_BATCH`` requests or fewer
    the whole step is that request's, and a depth's price learned from those first steps
    overstates what drafting costs for the rest of the request; there a pure-decode step
    teaches the model only after ``SETTLE_STEPS`` pure-decode steps of the same batch. At
    larger batches one request's start is a small part of a step and batches change often:
    every pure-decode step teaches it. (Step traces by position after a change of batch:
    docs/gpu.md.)
    """

    SETTLE_STEPS = 3
    SETTLE_MAX_BATCH = 1

    __slots__ = ("_batch", "_run")

    def __init__(self) -> None:
        self._batch = -1
        self._run = 0

    def step(self, requests: int, pure: bool) -> int:
        """Fold in one step's output (``requests`` in the step; ``pure``: every one of
        them only decoded) and return how many pure-decode steps with as many requests
        came right before it: 0 after a prefill, a change of batch, or at the start."""
        if pure and requests == self._batch:
            self._run += 1
        else:
            self._run = 0
        self._batch = requests if pure else -1
        return self._run

    def teaches(self, requests: int, pure: bool) -> bool:
        """:meth:`step`, then whether this step's time may teach the step-time model: a
        pure-decode step past its batch's first ``SETTLE_STEPS`` at ``SETTLE_MAX_BATCH``
        requests or fewer, any pure-decode step at larger batches."""
        run = self.step(requests, pure)
        return pure and (requests > self.SETTLE_MAX_BATCH or run >= self.SETTLE_STEPS)
