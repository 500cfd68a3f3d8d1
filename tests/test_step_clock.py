"""Outputs are matched to the step that was scheduled for them, under sync and async scheduling."""

from __future__ import annotations

from engine_host.step_clock import StepClock


def test_sync_scheduling_measures_from_schedule_to_output():
    clock = StepClock()
    clock.scheduled(10.0, k_drafted=0, k_proposed=4)
    dt, step = clock.output(10.05)
    assert abs(dt - 0.05) < 1e-9 and step.k_proposed == 4
    clock.scheduled(10.06, k_drafted=4, k_proposed=2)
    dt, step = clock.output(10.10)
    assert abs(dt - 0.04) < 1e-9 and (step.k_drafted, step.k_proposed) == (4, 2)


def test_async_scheduling_gives_each_output_its_own_step_and_k():
    """vLLM's AsyncScheduler schedules step N+1 before the output of step N: the last
    schedule() is then the wrong step (too recent, the next K)."""
    clock = StepClock()
    clock.scheduled(0.000, k_drafted=0, k_proposed=4)  # step 1
    clock.scheduled(0.001, k_drafted=4, k_proposed=0)  # step 2, before step 1's output
    dt1, s1 = clock.output(0.020)  # step 1 done
    clock.scheduled(0.021, k_drafted=0, k_proposed=0)  # step 3
    dt2, s2 = clock.output(0.030)  # step 2 ran from step 1's output to now
    assert abs(dt1 - 0.020) < 1e-9 and s1.k_proposed == 4 and s1.k_drafted == 0
    assert abs(dt2 - 0.010) < 1e-9 and s2.k_drafted == 4  # not 0.009 (from its own schedule) nor step 3's K
    assert clock.in_flight == 1


def test_an_idle_spell_does_not_count_as_step_time():
    clock = StepClock()
    clock.scheduled(1.0, 0, 0)
    clock.output(1.01)
    clock.scheduled(5.0, 0, 0)  # 4 s idle in between
    dt, _ = clock.output(5.02)
    assert abs(dt - 0.02) < 1e-9


def test_an_output_without_a_recorded_step_is_not_timed():
    assert StepClock().output(3.0) == (0.0, None)


def test_outputs_are_matched_to_their_steps_by_what_schedule_returned():
    """An output of a step that was never recorded (scheduled while the hook stood aside)
    pops nothing; one whose older steps' outputs went missing drops those."""
    a, b, c = object(), object(), object()
    clock = StepClock()
    clock.scheduled(1.00, 0, 0, key=a)
    assert clock.output(1.01, key=object()) == (0.0, None)  # not a recorded step
    assert clock.in_flight == 1
    dt, step = clock.output(1.03, key=a)
    assert step.key is a and abs(dt - 0.02) < 1e-9  # from the output before (async: the device was busy)
    clock.scheduled(1.04, 0, 1, key=b)
    clock.scheduled(1.05, 0, 2, key=c)
    dt, step = clock.output(1.08, key=c)  # b's output never came
    assert step.k_proposed == 2 and clock.in_flight == 0
    clock.scheduled(1.10, 0, 0, key=a)
    clock.clear()
    assert clock.in_flight == 0 and clock.output(1.2, key=a) == (0.0, None)
