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


class StepClock:
    """FIFO of scheduled steps, matched to their outputs.

    Args:
        depth: the most steps kept in flight (vLLM's async path keeps at most 2;
            older entries are dropped if outputs ever go missing).
    """

    def __init__(self, depth: int = 8):
        self._pending: deque[ScheduledStep] = deque(maxlen=depth)
        self._t_last_output = 0.0

    def scheduled(self, t: float, k_drafted: int, k_proposed: int) -> None:
        """Record a ``schedule()`` call made at ``t`` (s)."""
        self._pending.append(ScheduledStep(t, k_drafted, k_proposed))

    @property
    def in_flight(self) -> int:
        """Steps scheduled whose output has not come back yet."""
        return len(self._pending)

    def output(self, t: float) -> tuple[float, ScheduledStep | None]:
        """An output came back at ``t`` (s): its step and the step's duration (s).

        Returns:
            ``(step_time_s, step)``; ``(0.0, None)`` when no step was recorded.
        """
        step = self._pending.popleft() if self._pending else None
        last, self._t_last_output = self._t_last_output, t
        if step is None:
            return 0.0, None
        return max(0.0, t - max(step.t_scheduled, last)), step
