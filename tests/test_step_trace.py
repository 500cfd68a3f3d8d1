"""The engine core's per-step trace ($SPECPILOT_STEP_TRACE) and ``python -m bench step-trace``."""

from __future__ import annotations

import json
import os
import statistics
from dataclasses import replace
from pathlib import Path

import pytest

from bench import step_trace as bst
from engine_host import envs
from engine_host.step_trace import HEADER, StepTrace, step_trace_from_env


def _write(path: Path, rows: list[tuple]) -> None:
    t = StepTrace(str(path))
    for r in rows:
        t.add(*r)
    t.flush()


def test_trace_is_written_on_flush_only_and_appends(tmp_path: Path) -> None:
    path = tmp_path / "steps.csv"
    t = StepTrace(str(path))
    t.add(1.0, 1.002, 0, 2, 1, 1, 1, 40)
    assert path.read_text() == HEADER  # buffered: no I/O in the step
    t.flush()
    t.add(1.002, 1.005, 2, 2, 1, 1, 3, 41, path="full", vllm_schedule_s=250e-6, vllm_update_s=0.001, rule="probe")
    t.flush()
    t.flush()  # nothing buffered: nothing written
    lines = path.read_text().splitlines()
    assert lines[0] + "\n" == HEADER
    cells = [ln.split(",") for ln in lines[1:]]
    cpus = [c[18] for c in cells]
    assert all(c.isdigit() for c in cpus)  # the CPU the writer's thread ran on (Linux)
    assert [",".join(c[:18]) for c in cells] == [
        "1.000000,1.002000,0,2,1,1,1,40,,0,0,,,,,,,",
        "1.002000,1.005000,2,2,1,1,3,41,,0,0,,,,,full,250.0,1000.0",
    ]
    assert [c[19:21] for c in cells] == [["", ""], ["", ""]]  # garbage collections not timed
    assert [c[21] for c in cells] == ["", "probe"]  # the hook's rule that set the step's K
    steps = bst.read_trace(path)
    assert (steps[0].path, steps[0].vllm_schedule_us, steps[0].vllm_update_us) == ("", None, None)
    assert (steps[1].path, steps[1].vllm_schedule_us, steps[1].vllm_update_us) == ("full", 250.0, 1000.0)
    assert (steps[0].rule, steps[1].rule) == ("", "probe")
    assert steps[1].cpu == int(cpus[1]) and steps[1].cpu in os.sched_getaffinity(0)
    assert bst.vllm_table([steps[:1]]) == []  # nothing recorded: no table
    # a second writer (engine restarted with the same file) appends, no second header
    StepTrace(str(path)).flush()
    assert path.read_text().count("t_scheduled_s") == 1


def test_buffer_is_bounded(tmp_path: Path) -> None:
    t = StepTrace(str(tmp_path / "s.csv"), max_rows=3)
    for i in range(5):
        t.add(float(i), float(i) + 0.001, 0, 0, 1, 1, 1)
    assert t.dropped == 2
    t.flush()
    rows = bst.read_trace(tmp_path / "s.csv")
    assert [r.t_scheduled for r in rows] == [2.0, 3.0, 4.0]


def test_from_env_names_the_file_by_pid(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(envs.STEP_TRACE, raising=False)
    assert step_trace_from_env() is None
    monkeypatch.setenv(envs.STEP_TRACE, str(tmp_path / "steps.csv"))
    t = step_trace_from_env()
    assert t is not None and t.path.startswith(str(tmp_path / "steps.csv."))
    assert Path(t.path).read_text() == HEADER
    import gc

    assert t._on_gc in gc.callbacks  # the engine core's trace times garbage collections
    t.close()


def test_busy_intervals_keep_only_pure_decode_steps_of_one_batch(tmp_path: Path) -> None:
    path = tmp_path / "s.csv"
    rows = [
        # t_sched, t_out, k_drafted, k_proposed, decode, requests, tokens
        (0.0, 0.010, 0, 0, 0, 1, 30),  # prefill
        (0.009, 0.012, 0, 0, 1, 1, 1),  # after a prefill: not counted
        (0.011, 0.014, 0, 2, 1, 1, 1),  # 2 ms at K = 0
        (0.013, 0.017, 2, 2, 1, 1, 3),  # 3 ms at K = 2
        (0.016, 0.020, 2, 0, 1, 1, 3),  # 3 ms at K = 2
        (0.019, 0.021, 0, 0, 1, 2, 2),  # batch changed: not counted
        (0.500, 0.600, 0, 0, 2, 2, 2),  # idle spell: longer than max gap
    ]
    _write(path, rows)
    iv = bst.busy_intervals(bst.read_trace(path), max_gap_s=0.05)
    assert [(round(x.seconds * 1e3, 3), x.k_drafted, x.k_drafted_before) for x in iv] == [
        (2.0, 0, 0),
        (3.0, 2, 0),
        (3.0, 2, 2),
    ]
    lines = bst.table(iv, "k_drafted", min_steps=1)
    assert "| 1, 0 | 1 | 2.000 |" in lines[2] and "| 1, 2 | 2 | 3.000 |" in lines[3]
    assert any("0 -> 2" in line for line in bst.table(iv, "transition", min_steps=1))


def test_the_table_gives_each_groups_context_per_request_and_reads_traces_without_it(tmp_path: Path) -> None:
    # t_sched, t_out, k_drafted, k_proposed, decode, requests, tokens, context (2 requests)
    rows = [(0.001 * i, 0.001 * (i + 1), 0, 0, 2, 2, 2, 200 + 2 * i) for i in range(6)]  # timed: 1..5
    rows += [(0.006 + 0.002 * i, 0.007 + 0.002 * (i + 1), 4, 4, 2, 2, 10, 1000 + 10 * i) for i in range(5)]
    _write(tmp_path / "s.csv", rows)
    iv = bst.busy_intervals(bst.read_trace(tmp_path / "s.csv"))
    lines = bst.table(iv, "k_drafted", min_steps=1)
    assert lines[2].endswith("| 103 |") and lines[3].endswith("| 510 |")  # median context / 2 requests
    # a trace written before the context column: read, the column shown as "-"
    old = tmp_path / "old.csv"
    old.write_text(
        "t_scheduled_s,t_output_s,k_drafted,k_proposed,decode,requests,tokens\n"
        + "".join(f"{0.001 * i:.6f},{0.001 * (i + 1):.6f},0,0,1,1,1\n" for i in range(4))
    )
    steps = bst.read_trace(old)
    assert [s.context for s in steps] == [0] * 4
    assert bst.table(bst.busy_intervals(steps), "k_drafted", min_steps=1)[2].endswith("| - |")


def test_the_range_table_counts_every_step_and_splits_steps_by_what_came_before(tmp_path: Path) -> None:
    rows = [
        # t_sched, t_out, k_drafted, k_proposed, decode, requests, tokens
        (0.0, 0.010, 0, 0, 0, 1, 30),  # prefill (batch 1): counted as a step, not timed
        (0.009, 0.015, 0, 4, 1, 1, 1),  # after a prefill: 5 ms at K = 0
        (0.014, 0.017, 4, 4, 1, 1, 5),  # after a pure step: 2 ms at K = 4
        (0.016, 0.019, 4, 0, 1, 1, 5),  # 2 ms at K = 4
        (0.018, 0.020, 0, 0, 1, 1, 1),  # 1 ms at K = 0
        (0.019, 0.030, 0, 0, 5, 6, 40),  # a new request's prefill joins (batch 6): not timed
        (0.029, 0.037, 4, 4, 6, 6, 30),  # after a prefill, batch 6: 7 ms at K = 4
        (0.036, 0.041, 4, 4, 6, 6, 30),  # after a pure step: 4 ms at K = 4
    ]
    _write(tmp_path / "s.csv", rows)
    lines = bst.range_table([bst.read_trace(tmp_path / "s.csv")], max_gap_s=0.05)
    assert lines[2] == "| 1 | 5 | 2 (40%) | 1.000 (1) / 2.000 (2) | 5.000 (1) / - |"
    assert lines[3] == "| 5-8 | 3 | 2 (67%) | - / 4.000 (1) | - / 7.000 (1) |"
    assert len(lines) == 4  # ranges without steps are left out


def test_cells_split_the_trace_by_their_windows(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    trace = tmp_path / "steps.csv.1"
    rows = []
    t = 10.0
    for k, dt in ((0, 0.002), (4, 0.003)):  # cell A at K = 0, 2 ms; cell B at K = 4, 3 ms
        for _ in range(30):
            rows.append((t - dt, t, k, k, 1, 1, 1 + k))
            t += dt
        t += 1.0  # between cells
    _write(trace, rows)
    cells = tmp_path / "results" / "round-1"
    cells.mkdir(parents=True)
    (cells / "chat-low-fixed0.json").write_text(json.dumps({"window_perf_s": [9.9, 10.1]}))
    (cells / "chat-low-fixed4.json").write_text(json.dumps({"window_perf_s": [11.0, 11.2]}))
    (cells / "spread.json").write_text("[]")  # not a cell
    assert bst.main([str(trace), "--cells", str(tmp_path / "results"), "--min-steps", "5"]) == 0
    out = capsys.readouterr().out
    assert "| round-1/chat-low-fixed0 | 29 | 2.000 | 2.000 | 0.00 | 0:2.000(29) |" in out
    assert "| round-1/chat-low-fixed4 | 29 | 3.000 | 3.000 | 4.00 | 4:3.000(29) |" in out


def test_not_a_trace_is_refused(tmp_path: Path) -> None:
    bad = tmp_path / "x.csv"
    bad.write_text("a,b\n1,2\n")
    with pytest.raises(SystemExit) as exc:
        bst.main([str(bad)])
    assert exc.value.code == 2


def test_the_graph_table_splits_a_batchs_steps_by_their_cuda_graph_mode(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # batch 8 at K = 4: FULL steps of 4 ms, then PIECEWISE ones of 6 ms (a decode batch that
    # missed its FULL graph)
    rows = [(0.004 * i, 0.004 * (i + 1), 4, 4, 8, 8, 40, 1600, "FULL") for i in range(6)]
    t = 0.024
    rows += [(t + 0.006 * i, t + 0.006 * (i + 1), 4, 4, 8, 8, 40, 1700, "PIECEWISE") for i in range(5)]
    _write(tmp_path / "s.csv", rows)
    steps = bst.read_trace(tmp_path / "s.csv")
    assert {s.graph for s in steps} == {"FULL", "PIECEWISE"}
    lines = bst.table(bst.busy_intervals(steps), "graph", min_steps=1)
    assert lines[0].startswith("| requests, k_drafted, graph |")
    assert lines[2].startswith("| 8, 4, FULL | 5 | 4.000 |") and lines[3].startswith("| 8, 4, PIECEWISE | 5 | 6.000 |")
    assert bst.main([str(tmp_path / "s.csv"), "--min-steps", "1"]) == 0
    assert "| 8, 4, PIECEWISE | 5 | 6.000 |" in capsys.readouterr().out
    # a trace without graph modes prints no graph table
    _write(tmp_path / "plain.csv", [r[:8] for r in rows])
    assert bst.main([str(tmp_path / "plain.csv"), "--min-steps", "1"]) == 0
    assert "graph" not in capsys.readouterr().out


def test_graph_mode_reads_vllms_cudagraph_stat() -> None:
    from vllm.compilation.cuda_graph import CUDAGraphStat
    from vllm.config.compilation import CUDAGraphMode

    from engine_host.step_trace import graph_mode

    for mode in (CUDAGraphMode.FULL, CUDAGraphMode.PIECEWISE, CUDAGraphMode.NONE):
        stat = CUDAGraphStat(num_unpadded_tokens=60, num_padded_tokens=64, num_paddings=4, runtime_mode=str(mode))
        assert graph_mode(stat) == mode.name
    assert graph_mode(None) == ""  # vLLM without --cudagraph-metrics, or the CPU build


def test_the_lone_table_shows_each_lone_request_that_drafted_and_what_the_gate_estimated(tmp_path: Path) -> None:
    # a prefill, then one request alone: 3 steps at K = 4 with every draft rejected, the
    # estimate falling, then K = 0; a second request that never drafts is not listed
    rows: list[tuple] = [(0.0, 0.001, 0, 4, 0, 1, 30, 30, "", 0, 0, None, 0.9)]
    est = [None, 0.6, 0.45, 0.3, 0.3]
    for i in range(5):
        k_drafted = 4 if 1 <= i <= 3 else 0
        rows.append(
            (
                0.001 * (i + 1),
                0.001 * (i + 2),
                k_drafted,
                4 if i < 3 else 0,
                1,
                1,
                1,
                31 + i,
                "",
                k_drafted,
                0,
                est[i],
                0.9,
                0.02,
                0.25 + 0.01 * i,
            )
        )
    rows.append((0.01, 0.011, 0, 0, 0, 1, 30, 30, "", 0, 0, 0.3, 0.9))  # the next request's prefill
    rows += [(0.011 + 0.001 * i, 0.012 + 0.001 * i, 0, 0, 1, 1, 1, 31 + i, "", 0, 0, 0.3, 0.9) for i in range(4)]
    _write(tmp_path / "s.csv", rows)
    steps = bst.read_trace(tmp_path / "s.csv")
    assert [len(r) for r in bst.lone_requests(steps)] == [5, 4]
    table = bst.lone_table([steps])
    assert len(table) == 3
    assert table[2] == "| 1 | 5 | 3 (1 .. 3) | 0 / 12 | 0.900 | 0.600 / 0.450 / 0.300 | 0.020 / 0.270 |"
    # a trace from before the columns: the tokens and estimates read as not known
    old = tmp_path / "old.csv"
    old.write_text(
        "t_scheduled_s,t_output_s,k_drafted,k_proposed,decode,requests,tokens\n"
        + "".join(f"{0.001 * i:.6f},{0.001 * (i + 1):.6f},0,4,1,1,1\n" for i in range(4))
    )
    assert bst.lone_table([bst.read_trace(old)])[2] == "| 1 | 4 | 4 (1 .. 4) | - | - | - / - / - | - / - |"
    assert bst.lone_table([bst.read_trace(tmp_path / "s.csv")[6:]]) == ["no lone request drafted"]


def test_a_paired_results_bursts_are_matched_to_the_traced_engines_bursts(tmp_path: Path, capsys) -> None:
    """``--paired RESULT --arm ARM``: the arm's bursts in the result, in the order run, are the
    trace's last bursts (runs of steps between idle spells); each cell's steps at the batch sizes
    asked are summed over its bursts, and a burst whose step count differs from the result's is
    reported."""
    rows: list[tuple] = []
    t = 100.0
    # a warm-up burst, then three bursts of the arm: code (4 ms steps at K = 0), docs (6 ms at
    # K = 4), code again (4 ms); 40 requests each, 30 steps
    for kind in ("warm", "code", "docs", "code"):
        k, dt = (4, 0.006) if kind == "docs" else (0, 0.004)
        for _ in range(30):
            rows.append((t, t + dt, k, k, 40, 40, 40 * (1 + k), 40 * 500))
            t += dt
        t += 2.0  # the other arms' bursts run meanwhile
    _write(tmp_path / "steps.csv", rows)
    bursts = [
        {"arm": "k0", "cell": cell, "steps_at_k": counts}
        for cell, counts in (("code@c64", [30, 0, 0, 0, 0]), ("docs@c64", [0, 0, 0, 0, 30]), ("code@c64", [30]))
    ]
    bursts.insert(1, {"arm": "plain", "cell": "code@c64", "steps_at_k": None})
    result = {"baseline": "plain", "arms": ["plain", "k0"], "cells": ["code@c64", "docs@c64"], "bursts": bursts}
    (tmp_path / "paired.json").write_text(json.dumps(result))
    steps = bst.read_trace(tmp_path / "steps.csv")
    windows, off = bst.paired_windows(steps, result, "k0")
    assert [w.label for w in windows] == ["code@c64", "docs@c64", "code@c64"] and off == []
    intervals = bst.busy_intervals(steps, 0.05)
    table = bst.paired_cell_table(intervals, windows, (33, 64), min_steps=5)
    assert table[2] == "| code@c64 | 58 | 0:4.000(58) |"  # two bursts of 29 intervals each
    assert table[3] == "| docs@c64 | 29 | 4:6.000(29) |"
    assert bst.paired_cell_table(intervals, windows, (1, 32), min_steps=5)[2:] == []  # no step at 1-32
    result["bursts"][0]["steps_at_k"] = [10]
    assert bst.paired_windows(steps, result, "k0")[1] == [0]
    with pytest.raises(ValueError, match="no bursts of arm"):
        bst.paired_windows(steps, result, "k4")
    assert (
        bst.main(
            [str(tmp_path / "steps.csv"), "--paired", str(tmp_path / "paired.json"), "--arm", "k0", "--min-steps", "5"]
        )
        == 0
    )
    out = capsys.readouterr().out
    assert "| cell | steps at 33-64 requests |" in out and "| docs@c64 | 29 | 4:6.000(29) |" in out
    with pytest.raises(SystemExit):  # --paired without --arm
        bst.main([str(tmp_path / "steps.csv"), "--paired", str(tmp_path / "paired.json")])


def test_a_paired_result_is_matched_to_the_run_of_bursts_whose_step_counts_agree(tmp_path: Path) -> None:
    """A trace that goes on after the paired run (a profile's bursts, here 50 and 70 steps) is
    matched where the step counts agree, not to its last bursts; a trace that agrees nowhere keeps
    the latest run and reports every burst."""
    rows: list[tuple] = []
    t = 100.0
    for n in (30, 20, 30, 25, 50, 70):  # warm-up, the arm's three bursts, then two profile bursts
        for _ in range(n):
            rows.append((t, t + 0.004, 0, 0, 40, 40, 40, 40 * 500))
            t += 0.004
        t += 2.0
    _write(tmp_path / "steps.csv", rows)
    steps = bst.read_trace(tmp_path / "steps.csv")
    result = {"bursts": [{"arm": "k0", "cell": c, "steps_at_k": [n]} for c, n in (("a", 20), ("b", 30), ("c", 25))]}
    windows, off = bst.paired_windows(steps, result, "k0")
    assert off == [] and [round(w.end - w.start, 3) for w in windows] == [0.076, 0.116, 0.096]
    result["bursts"] = [{"arm": "k0", "cell": "a", "steps_at_k": [90]}]
    windows, off = bst.paired_windows(steps, result, "k0")
    assert off == [0] and round(windows[0].end - windows[0].start, 3) == 0.276  # the last burst, 70 steps


def test_an_arms_bursts_that_follow_within_a_tenth_of_a_second_stay_apart(tmp_path: Path) -> None:
    """At one client an arm's two bursts can follow 0.1 s apart (the arm last in one cell and
    first in the next): they are matched as two bursts, not joined into one at the longest idle
    spell; at that spell alone the trace has too few bursts."""
    rows: list[tuple] = []
    t = 100.0
    for n, pause in ((30, 2.0), (20, 0.1), (25, 2.0), (40, 2.0)):
        for _ in range(n):
            rows.append((t, t + 0.004, 0, 0, 1, 1, 1, 500))
            t += 0.004
        t += pause
    _write(tmp_path / "steps.csv", rows)
    steps = bst.read_trace(tmp_path / "steps.csv")
    result = {
        "bursts": [{"arm": "k0", "cell": c, "steps_at_k": [n]} for c, n in (("a", 30), ("b", 20), ("c", 25), ("d", 40))]
    }
    windows, off = bst.paired_windows(steps, result, "k0")
    assert off == [] and [w.label for w in windows] == ["a", "b", "c", "d"]
    assert [round(w.end - w.start, 3) for w in windows] == [0.116, 0.076, 0.096, 0.156]
    with pytest.raises(ValueError, match="fewer bursts"):
        bst.paired_windows(steps, result, "k0", gap_s=0.5)


def _burst_steps(t0: float, n: int, step_s: float, requests: int = 1, sched_us: float = 100.0) -> list[bst.Step]:
    """``n`` pure-decode K = 0 steps of ``requests`` requests from ``t0`` (s), ``step_s`` apart."""
    return [
        bst.Step(
            t0 + i * step_s,
            t0 + (i + 1) * step_s,
            0,
            0,
            requests,
            requests,
            requests,
            vllm_schedule_us=sched_us,
            vllm_update_us=50.0,
        )  # fmt: skip
        for i in range(n)
    ]


def test_engines_are_compared_burst_by_burst_where_the_hosts_state_moves_whole_run_medians(tmp_path, capsys) -> None:
    """The host runs bursts fast (2.0 ms a step) or slow (2.8 ms), shared by the two engines in a
    round; engine B is 0.1 ms slower in every burst but fell in fewer slow bursts, so its whole-run
    median is lower than A's. Matched burst by burst, B is +0.1 ms."""
    a: list[bst.Step] = []
    b: list[bst.Step] = []
    for r in range(12):
        t = 100.0 + 10.0 * r  # a round every 10 s; A's burst, then B's 1 s later
        slow_a = r % 2 == 0
        slow_b = r % 4 == 0  # (B: only half of A's slow rounds were slow for it)
        a += _burst_steps(t, 60, 0.0028 if slow_a else 0.0020)
        b += _burst_steps(t + 1.0, 60, (0.0028 if slow_b else 0.0020) + 0.0001, sched_us=110.0)
    whole_a = statistics.median(iv.seconds for iv in bst.busy_intervals(a))
    whole_b = statistics.median(iv.seconds for iv in bst.busy_intervals(b))
    assert whole_b < whole_a  # the whole-run medians point the wrong way
    rows = bst.matched_table(a, [("b", b)], match_s=5.0)
    (row,) = [r for r in rows if r.startswith("| b | 1 |")]
    cells = [c.strip() for c in row.strip("|").split("|")]
    assert cells[2] == "12"  # every burst matched to the same round's
    diff = float(cells[3].split()[0])
    assert diff == pytest.approx(0.1, abs=0.01)  # pairs: 9 of 12 rounds alike (+0.1), 3 slow for A only (-0.7)
    assert cells[4].startswith("+10.0")  # vLLM's schedule(): 110 against 100 µs in every burst
    # bursts too far apart in time are not matched; the CLI prints the table
    assert bst.matched_table(a, [("b", [s for s in b])], match_s=0.5)[0].startswith("no burst matched")
    fa, fb = tmp_path / "a.csv", tmp_path / "b.csv"
    for path, steps in ((fa, a), (fb, b)):
        _write(path, [(s.t_scheduled, s.t_output, 0, 0, 1, 1, 1) for s in steps])
    assert bst.main([str(fa), "--against", str(fb), "--match-s", "5"]) == 0
    out = capsys.readouterr().out
    assert "burst by burst" in out and "| b.csv | 1 | 12 |" in out


def test_bursts_are_grouped_by_the_cpu_the_engine_core_ran_on() -> None:
    """Bursts mostly on CPU 3 run 2.8 ms a step, those on CPU 0 2.0 ms: the CPU table says so;
    a trace without the column prints no such table."""
    steps: list[bst.Step] = []
    for r in range(6):
        cpu, step_s = (3, 0.0028) if r % 2 else (0, 0.0020)
        for s in _burst_steps(100.0 + 10 * r, 40, step_s):
            steps.append(bst.Step(**{**s.__dict__, "cpu": cpu if s.t_output < 100.0 + 10 * r + 0.1 else 7}))
    rows = bst.cpu_table([steps])
    assert rows[2].startswith("| 1 | 0 | 3 | 2.000 |") and rows[3].startswith("| 1 | 3 | 3 | 2.800 |")
    assert bst.cpu_table([_burst_steps(100.0, 40, 0.002)]) == []


def test_bursts_are_read_against_the_gpus_clock_during_them(tmp_path: Path, capsys) -> None:
    """Bursts of 2.0 ms steps while the GPU's SM clock read 1980 MHz and of 2.8 ms while it read
    1100 MHz: ``--gpu-clocks`` puts them in two bands with their medians, and the rank correlation
    of clock and step is strongly negative; a file that is not the sampler's is refused."""
    rows: list[tuple] = []
    samples = ["t_s,sm_mhz,mem_mhz,power_w,temp_c,util_pct,pstate"]
    t = 100.0
    for i in range(8):
        fast = i % 2 == 0
        dt, sm = (0.002, 1980) if fast else (0.0028 + 0.0001 * i, 1100)
        start = t
        for _ in range(60):
            rows.append((t, t + dt, 0, 0, 1, 1, 1, 300))
            t += dt
        for k in range(int((t - start) / 0.05) + 1):  # a sample every 50 ms during the burst
            samples.append(f"{start + 0.05 * k:.6f},{sm},2619,{150 if fast else 90},40,30,{0 if fast else 2}")
        t += 1.0
    samples.append("bad,row")  # a row cut short when the sampler stopped
    _write(tmp_path / "steps.csv", rows)
    (tmp_path / "clocks.csv").write_text("\n".join(samples) + "\n")
    from bench.gpu_clocks import read_clocks

    clocks = read_clocks(tmp_path / "clocks.csv")
    assert len(clocks) == len(samples) - 2 and clocks[0].sm_mhz == 1980 and clocks[-1].pstate == 2
    table = bst.clock_table([bst.read_trace(tmp_path / "steps.csv")], clocks, min_steps=20)
    assert table[2] == "| 1 | 1100-1200 | 4 | 3.200 | 2.960-3.440 | 90 | 2 |"  # 2.9, 3.1, 3.3, 3.5 ms
    assert table[3] == "| 1 | 1900-2000 | 4 | 2.000 | 2.000-2.000 | 150 | 0 |"
    assert table[-1] == "1 requests: 8 bursts, Spearman's rho (SM clock, step) -0.93"  # ties take mean ranks
    assert bst.main([str(tmp_path / "steps.csv"), "--gpu-clocks", str(tmp_path / "clocks.csv")]) == 0
    assert "| 1 | 1100-1200 | 4 |" in capsys.readouterr().out
    import lzma  # compressed, as scripts/gpu/paired_table.sh leaves it

    (tmp_path / "clocks.csv.xz").write_bytes(lzma.compress((tmp_path / "clocks.csv").read_bytes()))
    assert read_clocks(tmp_path / "clocks.csv.xz") == clocks
    with pytest.raises(SystemExit):
        bst.main([str(tmp_path / "steps.csv"), "--gpu-clocks", str(tmp_path / "steps.csv")])
    assert "not a GPU clock file" in capsys.readouterr().err


def test_the_clock_sampler_says_plainly_when_there_is_no_gpu_to_read(tmp_path: Path, capsys) -> None:
    """On a host without an NVIDIA driver the sampler stops with a clear error and writes nothing."""
    from bench.gpu_clocks import main

    assert main(["--out", str(tmp_path / "c.csv"), "--seconds", "1"]) == 2
    assert "cannot read the GPU through NVML" in capsys.readouterr().err
    assert not (tmp_path / "c.csv").exists()
    with pytest.raises(SystemExit):
        main(["--out", str(tmp_path / "c.csv"), "--interval-ms", "1"])


def test_the_clock_sampler_writes_what_the_reader_reads(tmp_path: Path, monkeypatch) -> None:
    """With NVML answering (a stand-in), ``--seconds`` of samples are written on the host's
    monotonic clock and read back by ``read_clocks``; the process's signal handlers are its own again
    afterwards."""
    import signal
    import time
    from types import SimpleNamespace

    import bench.gpu_clocks as gc

    calls = {"init": 0, "shutdown": 0}
    fake = SimpleNamespace(
        NVML_CLOCK_SM=1,
        NVML_CLOCK_MEM=2,
        NVML_TEMPERATURE_GPU=0,
        nvmlInit=lambda: calls.__setitem__("init", calls["init"] + 1),
        nvmlShutdown=lambda: calls.__setitem__("shutdown", calls["shutdown"] + 1),
        nvmlDeviceGetHandleByIndex=lambda i: ("gpu", i),
        nvmlDeviceGetClockInfo=lambda h, which: 1980 if which == 1 else 3201,
        nvmlDeviceGetPowerUsage=lambda h: 123456,  # mW
        nvmlDeviceGetTemperature=lambda h, kind: 41,
        nvmlDeviceGetUtilizationRates=lambda h: SimpleNamespace(gpu=37, memory=5),
        nvmlDeviceGetPerformanceState=lambda h: 0,
    )
    monkeypatch.setattr(gc, "_nvml", lambda: fake)
    before = time.perf_counter()
    handlers = (signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM))
    assert gc.main(["--out", str(tmp_path / "c.csv"), "--seconds", "0.3", "--interval-ms", "20"]) == 0
    assert (signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)) == handlers  # given back
    clocks = gc.read_clocks(tmp_path / "c.csv")
    assert 5 <= len(clocks) <= 16 and calls == {"init": 1, "shutdown": 1}
    assert before <= clocks[0].t < clocks[-1].t <= time.perf_counter()
    assert (clocks[0].sm_mhz, clocks[0].mem_mhz, clocks[0].power_w, clocks[0].util_pct) == (1980, 3201, 123.5, 37)


def test_a_cells_burst_time_is_split_by_what_its_steps_did() -> None:
    """A burst: a prefill, 10 lean K = 0 steps of 2 ms, a full-path step of 2.5 ms, a step that
    proposed (3 ms) and one that verified (3 ms), 5 lean steps of 2 ms: per burst, its span and
    each kind's steps and time; a second burst of the cell averages in."""

    def burst(t0: float, scale: float) -> list[bst.Step]:
        plan = [("prefill", 0.001)] + [("lean", 0.002)] * 10 + [("full", 0.0025), ("propose", 0.003)]
        plan += [("verify", 0.003)] + [("lean", 0.002)] * 5
        out, t = [], t0
        for kind, dt in plan:
            dt *= scale
            k_drafted, k_proposed = (2, 0) if kind == "verify" else (0, 2) if kind == "propose" else (0, 0)
            path = "full" if kind in ("full", "propose", "verify") else "lean"
            out.append(bst.Step(t, t + dt, k_drafted, k_proposed, 0 if kind == "prefill" else 1, 1, 1, path=path))
            t += dt
        return out

    steps = burst(10.0, 1.0) + burst(20.0, 2.0)
    windows = [bst.CellWindow("chat@c1", steps[0].t_output, steps[18].t_output)]
    windows.append(bst.CellWindow("chat@c1", steps[19].t_output, steps[-1].t_output))
    # at several requests a step is a decode step when every request in it only decoded
    assert bst.step_kind(replace(steps[1], decode=8, requests=8)) == "lean"
    assert bst.step_kind(replace(steps[1], decode=7, requests=8)) == "prefill"
    table = bst.burst_time_table(steps, windows)
    assert table[0].startswith("| cell | bursts | ms first to last output | lean: steps, ms |")
    # per burst: span 38.5 / 77 ms, lean 15 steps (2 / 4 ms each), full 1 (2.5 / 5), drafting 2 (6 / 12 ms);
    # the prefill is where the span starts
    assert table[2] == (
        "| chat@c1 | 2 | 57.75 | 15.00, 45.00 (3.000/step) | 1.00, 3.75 (3.750/step) | - "
        "| 2.00, 9.00 (4.500/step) | - |"
    )


def test_the_trace_times_the_garbage_collections_that_fell_in_each_step(tmp_path: Path) -> None:
    """With ``time_gc`` (the engine core's trace) each row holds the time Python's garbage
    collector ran since the row before and the oldest generation it collected; a row with none
    has both empty. ``bench step-trace`` reads them and tells steps with a collection from the
    others."""
    import gc

    path = tmp_path / "steps.csv"
    t = StepTrace(str(path), time_gc=True)
    try:
        gc.collect(0)  # before the first row: in no step's interval that is read
        t.add(0.998, 1.0, 0, 0, 1, 1, 1, 39, path="lean")
        t.add(1.0, 1.002, 0, 0, 1, 1, 1, 40, path="lean")
        gc.collect(1)
        t.add(1.002, 1.0045, 0, 0, 1, 1, 1, 41, path="lean")
        gc.collect(2)
        gc.collect(0)
        t.add(1.0045, 1.0065, 0, 0, 1, 1, 1, 42, path="full")
        t.flush()
    finally:
        t.close()
    assert t._on_gc not in gc.callbacks
    steps = bst.read_trace(path)[1:]
    assert (steps[0].gc_us, steps[0].gc_gen) == (None, None)
    assert steps[1].gc_us is not None and steps[1].gc_us > 0 and steps[1].gc_gen == 1
    assert steps[2].gc_us is not None and steps[2].gc_gen == 2  # the oldest of the two
    steps = bst.read_trace(path)
    rows = bst.gc_table([steps], min_steps=1)
    assert rows[0].startswith("| path |")
    lean = next(r for r in rows if r.startswith("| lean |"))
    assert lean.split("|")[2:4] == [" 2 ", " 1 "]  # two lean steps, one with a collection


def test_probes_are_counted_burst_by_burst_with_where_they_start_and_what_their_steps_took() -> None:
    """``probe_table``: a run of steps that propose drafts is one probe. Burst 1 drafts from its
    prefill (a probe at once) and probes again 12 steps later for two steps; burst 2 probes once,
    21 steps in. Per cell: 1.5 probes a burst, 4 / 3 steps per probe, 1 of 2 bursts drafted from
    the prefill, 12 steps between probes, and the mean ms of each kind of drafting step."""

    def burst(t0: float, plan: list[tuple[int, int, float]]) -> list[bst.Step]:
        out, t = [], t0
        for i, (k_drafted, k_proposed, dt) in enumerate(plan):
            out.append(bst.Step(t, t + dt, k_drafted, k_proposed, 0 if i == 0 else 1, 1, 1))
            t += dt
        return out

    lean = (0, 0, 0.002)
    first = [(0, 2, 0.001), (2, 0, 0.003)] + [lean] * 10 + [(0, 2, 0.004), (2, 2, 0.005), (2, 0, 0.003)] + [lean] * 5
    second = [(0, 0, 0.001)] + [lean] * 20 + [(0, 2, 0.004), (2, 0, 0.003)]
    steps = burst(10.0, first) + burst(20.0, second)
    n1 = len(first)
    windows = [bst.CellWindow("chat@c1", steps[0].t_output, steps[n1 - 1].t_output)]
    windows.append(bst.CellWindow("chat@c1", steps[n1].t_output, steps[-1].t_output))
    table = bst.probe_table(steps, windows)
    assert table[0].startswith("| cell | bursts | probes per burst | steps per probe | drafted from the prefill |")
    assert table[2] == "| chat@c1 | 2 | 1.50 | 1.33 | 1 of 2 | 12 | 4.000 | 5.000 | 3.000 |"
    plain = burst(30.0, [(0, 0, 0.001)] + [lean] * 5)
    # a static K = 0 engine's burst: no probe, no table
    assert bst.probe_table(plain, [bst.CellWindow("chat@c1", plain[0].t_output, plain[-1].t_output)]) == []


def test_the_rules_that_set_k_are_counted_per_burst_by_the_k_they_proposed() -> None:
    """``rule_table``: per cell, the steps that proposed drafts by the hook's rule that set their
    K, per burst, each with its steps by K proposed, and the steps the gate held at K = 0; lean
    steps (no rule) count nowhere. A trace without the column has no table."""

    def step(t: float, k_proposed: int, rule: str) -> bst.Step:
        return bst.Step(t, t + 0.001, 0, k_proposed, 1, 4, 4, rule=rule)

    first = [step(10.0, 3, "explore"), step(10.01, 3, "explore"), step(10.02, 4, "probe"), step(10.03, 0, "gate")]
    first += [step(10.04 + 0.01 * i, 0, "") for i in range(5)]
    second = [step(20.0, 1, "batch"), step(20.01, 4, "probe"), step(20.02, 0, "gate"), step(20.03, 0, "gate")]
    steps = first + second
    windows = [bst.CellWindow("chat@c8", 9.9, 11.0), bst.CellWindow("chat@c8", 19.9, 21.0)]
    table = bst.rule_table(steps, windows)
    assert table[0] == "| cell | bursts | policy | explore | held | batch | lone | probe | gate | warmup |"
    assert table[2] == "| chat@c8 | 2 | - | 1.0 (3:1.0) | - | 0.5 (1:0.5) | - | 1.0 (4:1.0) | 1.5 (0:1.5) | - |"
    unruled = [bst.Step(st.t_scheduled, st.t_output, 0, st.k_proposed, 1, 4, 4) for st in steps]
    assert bst.rule_table(unruled, windows) == []


def test_the_gate_replayed_over_a_static_k_trace_reads_the_drafts_against_the_geometric_law(tmp_path: Path) -> None:
    # 30 requests alone, each: a prefill, then a draft of 8 rejected at its first token and one
    # accepted whole (copied text). Replayed under the mixture prior, the first drafts are priced
    # at 0.6-0.8 and the second ones, after a rejection, at 0.4-0.6, where the geometric law
    # expects about 1 token: the table puts those at nearly 8 accepted and the first at none;
    # the calibrated gain raises the first bin's price and leaves the other at the law's
    rows: list[tuple] = []
    t = 0.0
    for _ in range(30):
        rows.append((t, t + 0.001, 0, 8, 0, 1, 30, 30, "", 0, 0))
        for accepted in (0, 8, None):
            t += 0.001
            drafted = 0 if accepted is None else 8
            rows.append((t, t + 0.001, 8, 8, 1, 1, 1 + drafted, 31, "", drafted, accepted or 0))
        t += 0.001
    _write(tmp_path / "s.csv", rows)
    table = bst.gain_table([bst.read_trace(tmp_path / "s.csv")])
    assert table[0].endswith("| calibrated gain at K = 8 |")
    by_bin = {r.strip("| ").split(" | ")[0]: [float(v) for v in r.strip("| ").split(" | ")[1:]] for r in table[2:]}
    drafts, _, geometric, accepted, calibrated = by_bin["40%-60%"]
    assert drafts >= 20 and geometric < 1.2 and accepted > 7.0 and calibrated > 4.0
    drafts, _, geometric, accepted, calibrated = by_bin["60%-80%"]
    assert drafts >= 20 and accepted == 0.0 and calibrated >= geometric - 1e-9  # never below the law
    assert bst.gain_table([bst.read_trace(tmp_path / "s.csv")[:1]]) == []
