"""``python -m bench paired``: arm parsing, rotation, the pooled ratio and its interval, and
one run against the real engine host (CPU) over HTTP."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from bench.paired import arm_order, bootstrap_interval, parse_arm, pooled_ratio, render, summarize

ROOT = Path(__file__).resolve().parent.parent


def test_an_arm_takes_url_mode_and_token_variable():
    a = parse_arm("k0=http://127.0.0.1:8000/,mode=fixed:0,token-env=A_TOKEN")
    assert (a.name, a.url, a.mode, a.token_env) == ("k0", "http://127.0.0.1:8000", "fixed:0", "A_TOKEN")
    plain = parse_arm("plain=http://h:1")
    assert plain.mode is None and plain.token_env == "SPECPILOT_CONTROL_TOKEN"


@pytest.mark.parametrize(
    "bad", ["http://h:1", "=http://h:1", "x=", "x=h:1", "x=http://h:1,speed=3", "x=http://h:1,mode="]
)
def test_a_malformed_arm_is_refused_with_the_reason(bad):
    with pytest.raises(ValueError, match="arm"):
        parse_arm(bad)


@pytest.mark.parametrize("n", [2, 3, 4, 5, 6])
def test_every_arm_goes_first_equally_often_and_follows_every_other_arm_equally_often(n):
    """Over one period of the design (n rounds for an even number of arms, 2 n for odd),
    each arm runs in each place equally often and right after each other arm equally
    often: no arm always inherits the same arm's trailing work on the shared device."""
    from collections import Counter

    arms = [f"a{i}" for i in range(n)]
    period = n if n % 2 == 0 else 2 * n
    rows = [arm_order(arms, r) for r in range(period)]
    assert all(sorted(row) == arms for row in rows)
    for place in range(n):
        assert Counter(row[place] for row in rows) == Counter({a: period // n for a in arms})
    pairs = Counter((row[i], row[i + 1]) for row in rows for i in range(n - 1))
    assert len(pairs) == n * (n - 1) and len(set(pairs.values())) == 1  # every ordered pair, equally often
    assert [arm_order(arms, r) for r in range(period, 2 * period)] == rows  # the design repeats


def _b(tokens: int, wall: float) -> dict:
    return {"tokens": tokens, "wall_s": wall, "tok_s": tokens / wall, "ttft_ms": 10.0}


def _result(*bursts: dict) -> dict:
    """A paired result of arms ``plain`` (baseline) and ``k0`` in one cell, chat@c1."""
    return {
        "baseline": "plain",
        "arms": ["plain", "k0"],
        "cells": ["chat@c1"],
        "bursts": [{"cell": "chat@c1", **b} for b in bursts],
    }


def test_the_pooled_ratio_weights_rounds_by_their_time():
    arm = [_b(100, 1.0), _b(100, 3.0)]  # 200 tokens in 4 s
    base = [_b(100, 2.0), _b(100, 2.0)]  # 200 tokens in 4 s
    assert pooled_ratio(arm, base) == pytest.approx(1.0)  # the per-round ratios are 2.0 and 0.667


def test_the_interval_holds_the_ratio_and_narrows_with_more_rounds():
    rng = __import__("random").Random(1)

    def rounds(n: int) -> tuple[list, list]:
        base, arm = [], []
        for _ in range(n):
            level = rng.uniform(0.8, 1.25)  # the host's speed, shared by the pair
            base.append(_b(128, 0.3 * level * rng.uniform(0.98, 1.02)))
            arm.append(_b(128, 0.3 * level * 1.05 * rng.uniform(0.98, 1.02)))  # 5 % slower
        return arm, base

    a, b = rounds(10)
    lo10, hi10 = bootstrap_interval(a, b)
    a, b = rounds(160)
    lo, hi = bootstrap_interval(a, b)
    assert lo <= pooled_ratio(a, b) <= hi and hi < 1.0  # resolves the 5 % despite the levels
    assert hi - lo < hi10 - lo10
    assert bootstrap_interval(a[:2], b[:2]) is None


def test_the_summary_compares_each_arm_over_rounds_both_completed():
    res = _result(
        {"round": 0, "arm": "plain", **_b(100, 1.0)},
        {"round": 0, "arm": "k0", **_b(100, 0.5), "steps_at_k": [90, 0, 10]},
        {"round": 1, "arm": "plain", **_b(100, 1.0)},  # k0 never ran round 1
    )
    rows = {r["arm"]: r for r in summarize(res)}
    assert rows["k0"]["rounds"] == 1 and rows["k0"]["x_base"] == pytest.approx(2.0)
    assert rows["k0"]["faster"] == 1 and rows["k0"]["steps"] == 100 and rows["k0"]["steps_k_gt0"] == 10
    assert "| chat@c1 | `k0` | 1 |" in render(res)


def test_bad_input_exits_2_with_the_reason(tmp_path):
    cmd = [sys.executable, "-m", "bench", "paired", "--arm", "a=http://127.0.0.1:9", "--out", str(tmp_path)]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "at least two --arm" in proc.stderr
    assert not list(tmp_path.iterdir())


def _paired_on_host(engine_host, tmp_path, arms: list[str], *args: str):
    """``python -m bench paired`` against the engine host, one arm per ``NAME[,mode=MODE]`` in
    ``arms`` (no warm-up round); returns the finished process and its ``paired.json``."""
    env = dict(os.environ, BENCH_TEST_TOKEN=engine_host.token)
    cmd = [sys.executable, "-m", "bench", "paired", "--warm-rounds", "0", "--out", str(tmp_path), "--quiet", *args]
    for arm in arms:
        name, _, rest = arm.partition(",")
        extra = f",{rest}" if rest else ""
        cmd += ["--arm", f"{name}={engine_host.url}{extra},token-env=BENCH_TEST_TOKEN"]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc, json.loads((tmp_path / "paired.json").read_text())


@pytest.mark.engine
def test_paired_run_on_the_engine_host_reads_steps_and_tokens(engine_host, restore_config, tmp_path):
    proc, res = _paired_on_host(engine_host, tmp_path, ["k0,mode=fixed:0", "same"],
                                "--workloads", "chat,code", "--clients", "1,2", "--rounds", "2",
                                "--max-tokens", "8")  # fmt: skip
    assert len(res["bursts"]) == 2 * 4 * 2  # rounds x cells x arms
    for b in res["bursts"]:
        n = 2 if b["cell"].endswith("c2") else 1
        assert 1 <= b["tokens"] <= 8 * n and b["wall_s"] > 0 and b["errors"] == 0
        # a step per token after the first, code's too: its requests end at stop strings, the
        # server aborts them after the client has its answer, and the burst is read after that
        assert sum(b["steps_at_k"]) >= b["tokens"] // n - 1
        assert b["steps_at_k"][1:] == [0] * (len(b["steps_at_k"]) - 1)  # fixed:0 drafts nothing
    # arms alternate which goes first: round 0 k0 first, round 1 same first
    firsts = [next(b["arm"] for b in res["bursts"] if b["round"] == r) for r in (0, 1)]
    assert firsts == ["k0", "same"]
    assert "| chat@c1 | `same` | 2 |" in proc.stdout


@pytest.mark.engine
def test_closed_loop_clients_send_their_requests_one_after_another(engine_host, restore_config, tmp_path):
    """``--per-client 3`` on the engine host: a burst of 2 clients holds 6 requests."""
    proc, res = _paired_on_host(engine_host, tmp_path, ["a", "b"],
                                "--workloads", "chat", "--clients", "2", "--per-client", "3", "--rounds", "1",
                                "--max-tokens", "4")  # fmt: skip
    assert res["per_client"] == 3 and len(res["bursts"]) == 2
    for b in res["bursts"]:
        assert 6 <= b["tokens"] <= 6 * 4 and b["errors"] == 0
    assert "closed-loop clients, 3 requests each" in proc.stdout


def test_the_report_reads_plain_and_xz_results_and_refuses_other_files(tmp_path, capsys):
    import lzma

    from bench.paired import main

    res = _result({"round": 0, "arm": "plain", **_b(100, 1.0)}, {"round": 0, "arm": "k0", **_b(100, 0.8)})
    (tmp_path / "r.json.xz").write_bytes(lzma.compress(json.dumps(res).encode()))
    assert main(["--report", str(tmp_path / "r.json.xz")]) == 0
    assert "| chat@c1 | `k0` | 1 | 125.0 | 1.250 |" in capsys.readouterr().out
    # the same rounds against another arm, and a name that is no arm refused
    assert main(["--report", str(tmp_path / "r.json.xz"), "--baseline", "k0"]) == 0
    assert "| chat@c1 | `plain` | 1 | 100.0 | 0.800 |" in capsys.readouterr().out
    assert main(["--report", str(tmp_path / "r.json.xz"), "--baseline", "k4"]) == 2
    assert "names no arm" in capsys.readouterr().err
    (tmp_path / "notes.json").write_text('{"rows": []}')
    assert main(["--report", str(tmp_path / "notes.json")]) == 2
    assert "is not a result of python -m bench paired" in capsys.readouterr().err


def test_a_closed_loop_client_sends_its_next_request_when_the_previous_one_ends(monkeypatch):
    """``_burst`` with 2 clients and 6 prompts: never more than 2 requests at once, each
    client's requests in its own order (prompts 0, 2, 4 and 1, 3, 5), all 6 sent."""
    import asyncio
    import types

    from bench import paired

    live, peak, order = [0], [0], []

    async def fake_stream(http, prompt, model, max_tokens, rec, t0):
        live[0] += 1
        peak[0] = max(peak[0], live[0])
        order.append(rec.index)
        await asyncio.sleep(0.01 * (1 + rec.index % 2))
        live[0] -= 1
        rec.output_tokens = 2
        rec.done_s = 0.1

    async def snapshot():
        return {}, {"draft_tokens": 0, "accepted_tokens": 0}

    async def settled_snapshot(pause_s):
        return await snapshot()

    monkeypatch.setattr(paired, "stream_request", fake_stream)
    client = types.SimpleNamespace(
        snapshot=snapshot,
        settled_snapshot=settled_snapshot,
        http=None,
        model="m",
        is_host=False,
        arm=types.SimpleNamespace(name="a"),
    )
    prompts = [types.SimpleNamespace(workload="chat", source="s") for _ in range(6)]
    out = asyncio.run(paired._burst(client, prompts, 8, 2))
    assert peak[0] == 2 and sorted(order) == list(range(6))
    assert [i for i in order if i % 2 == 0] == [0, 2, 4] and [i for i in order if i % 2] == [1, 3, 5]
    assert out["tokens"] == 12
    order.clear()
    asyncio.run(paired._burst(client, prompts, 8))  # default: one client per prompt
    assert peak[0] == 6


def test_a_burst_is_read_once_the_engine_host_shows_no_request_running():
    """The server aborts a request the client ended at a stop string after the client has its
    answer; the engine host's state is read again until it shows no request running (the
    burst's last steps counted in its own burst), and at most for the timeout."""
    import asyncio
    import types

    from bench.paired import Arm, _Client

    client = _Client(Arm("a", "http://127.0.0.1:9"), timeout_s=1.0)
    states = [{"batch": {"running": 1}, "step_index": 10}, {"batch": {"running": 1}, "step_index": 12}]
    states.append({"batch": {"running": 0, "waiting": 0}, "step_index": 13})
    reads = []

    async def state():
        reads.append(1)
        return states[min(len(reads), len(states)) - 1]

    async def counters():
        return {"draft_tokens": 0.0, "accepted_tokens": 0.0}

    client.control = types.SimpleNamespace(state=state, counters=counters)
    client.is_host = True
    got, _ = asyncio.run(client.settled_snapshot(0.0))
    assert got["step_index"] == 13 and len(reads) == 3
    states[2] = {"batch": {"running": 1}, "step_index": 14}  # never settles: given up after the timeout
    reads.clear()
    got, _ = asyncio.run(client.settled_snapshot(0.0, timeout_s=0.05))
    assert got["batch"]["running"] == 1 and 2 <= len(reads) <= 10
    client.is_host = False  # a bare vLLM server: its counters only
    assert asyncio.run(client.settled_snapshot(0.0)) == ({}, {"draft_tokens": 0.0, "accepted_tokens": 0.0})
    asyncio.run(client.http.aclose())


def test_an_a_a_control_reports_what_two_alike_servers_differ_by(tmp_path, capsys):
    """``--twin k0=k0b``: k0b against k0 per cell, the spread, and the cells whose interval over
    rounds leaves out 1 although the two servers were started alike."""
    from bench.paired import main, twin_rows

    bursts = []
    for r in range(12):
        level = 1.0 + 0.05 * (r % 3)  # the host's speed, shared by the round
        for cell, skew in (("chat@c1", 1.0), ("code@c1", 1.08)):  # k0b's process 8 % faster on code
            bursts.append({"cell": cell, "round": r, "arm": "plain", **_b(100, 1.0 * level)})
            bursts.append({"cell": cell, "round": r, "arm": "k0", **_b(100, 1.0 * level * (1.01 if r % 2 else 0.99))})
            bursts.append({"cell": cell, "round": r, "arm": "k0b", **_b(100, 1.0 * level / skew)})
    res = {"baseline": "plain", "arms": ["plain", "k0", "k0b"], "cells": ["chat@c1", "code@c1"], "bursts": bursts}
    rows = {r["cell"]: r for r in twin_rows(res, "k0", "k0b")}
    assert rows["chat@c1"]["x"] == pytest.approx(1.0, abs=0.002) and rows["chat@c1"]["rounds"] == 12
    lo, hi = rows["code@c1"]["ci95"]
    assert rows["code@c1"]["x"] == pytest.approx(1.08, abs=0.002) and lo > 1.0  # resolved, yet only the processes
    (tmp_path / "r.json").write_text(json.dumps(res))
    assert main(["--report", str(tmp_path / "r.json"), "--twin", "k0=k0b"]) == 0
    out = capsys.readouterr().out
    assert "| code@c1 | 12 | 1.080 |" in out and "the largest difference 8.0% (code@c1)" in out
    assert "leave out 1.000: 1 of 2 (code@c1), against about 1 in 20 by chance" in out and "up to ±8.0%" in out
    for bad, why in (("k0=k4", "no arm of this result"), ("k0", "takes ARM=TWIN"), ("k0=k0", "no twin of itself")):
        assert main(["--report", str(tmp_path / "r.json"), "--twin", bad]) == 2
        assert why in capsys.readouterr().err


def test_the_report_reads_several_results_and_gives_each_arm_over_all_their_cells(tmp_path, capsys):
    """Two results (two cells each): k0 is 10 % faster than plain in every cell of both; over the
    four cells its geometric mean is 1.10 and its interval, resampling each cell's rounds,
    is narrower than one cell's. A third result with other arms adds its arms over its cells."""
    from bench.paired import _cell_pairs, geomean_over_cells, main

    rng = __import__("random").Random(3)

    def result(cells: list[str]) -> dict:
        bursts = []
        for cell in cells:
            for r in range(20):
                level = rng.uniform(0.8, 1.25)
                bursts.append({"cell": cell, "round": r, "arm": "plain", **_b(100, level * rng.uniform(0.9, 1.1))})
                bursts.append({"cell": cell, "round": r, "arm": "k0", **_b(110, level * rng.uniform(0.9, 1.1))})
        return {"baseline": "plain", "arms": ["plain", "k0"], "cells": cells, "bursts": bursts}

    r1, r2 = result(["chat@c1", "code@c1"]), result(["docs@c64", "code@c64"])
    pairs = _cell_pairs(r1, "k0", "plain") + _cell_pairs(r2, "k0", "plain")
    gm, (lo, hi) = geomean_over_cells(pairs)
    assert gm == pytest.approx(1.10, abs=0.03) and lo < gm < hi
    one = bootstrap_interval(*pairs[0])
    assert hi - lo < one[1] - one[0]
    for i, res in enumerate((r1, r2)):
        (tmp_path / f"r{i}.json").write_text(json.dumps(res))
    assert main(["--report", str(tmp_path / "r0.json"), str(tmp_path / "r1.json")]) == 0
    out = capsys.readouterr().out
    assert "| chat@c1 | `k0` |" in out and "| docs@c64 | `k0` |" in out
    assert f"| `k0` | 4 | {gm:.3f} | [{lo:.3f}, {hi:.3f}] |" in out
    # read against k0: plain over the four cells
    assert main(["--report", str(tmp_path / "r0.json"), str(tmp_path / "r1.json"), "--baseline", "k0"]) == 0
    assert "| `plain` | 4 | 0.9" in capsys.readouterr().out
    # a third run without k0 but with an arm of its own: each arm over the cells that hold it
    r3 = result(["chat@c1"])
    for b in r3["bursts"]:
        b["arm"] = "adaptive" if b["arm"] == "k0" else b["arm"]
    (tmp_path / "r3.json").write_text(json.dumps(dict(r3, arms=["plain", "adaptive"])))
    assert main(["--report", str(tmp_path / "r0.json"), str(tmp_path / "r1.json"), str(tmp_path / "r3.json")]) == 0
    out = capsys.readouterr().out
    assert f"| `k0` | 4 | {gm:.3f} | [{lo:.3f}, {hi:.3f}] |" in out and "| `adaptive` | 1 | 1.1" in out
    bad = dict(r2, baseline="k0")
    (tmp_path / "bad.json").write_text(json.dumps(bad))
    assert main(["--report", str(tmp_path / "r0.json"), str(tmp_path / "bad.json")]) == 2
    assert "baselines differ" in capsys.readouterr().err


def test_arms_started_alike_are_pooled_into_one_arm_round_by_round(tmp_path, capsys):
    """``--pool plain=plain+plain_b``: per round that both completed, one burst whose tokens and
    time are the two processes' sums, so one slow process of the two moves the pooled ratio by
    half as much; a baseline among the members becomes the pooled arm, the engine hosts' step
    counts and hook times add up, and results of two starts are pooled one by one and read
    together over their cells."""
    from bench.paired import main, pool_arms

    def start(plain_b_wall: float) -> dict:
        bursts = []
        for r in range(6):
            bursts.append({"cell": "chat@c8", "round": r, "arm": "plain", **_b(100, 1.0)})
            bursts.append({"cell": "chat@c8", "round": r, "arm": "plain_b", **_b(100, plain_b_wall)})
            eng = {"steps_at_k": [90, 10], "overhead": {"hook_seconds": 0.01, "busy_seconds": 1.0, "lean_steps": 5}}
            bursts.append({"cell": "chat@c8", "round": r, "arm": "adaptive", **_b(100, 0.9), **eng})
            bursts.append({"cell": "chat@c8", "round": r, "arm": "adaptive_b", **_b(100, 1.1), **eng})
        bursts.append({"cell": "chat@c8", "round": 6, "arm": "plain", **_b(100, 1.0)})  # plain_b never ran round 6
        arms = ["plain", "plain_b", "adaptive", "adaptive_b"]
        return {"baseline": "plain", "arms": arms, "cells": ["chat@c8"], "bursts": bursts}

    res = start(1.5)  # plain_b's process a third slower
    pooled = pool_arms(pool_arms(res, "plain", ["plain", "plain_b"]), "adaptive", ["adaptive", "adaptive_b"])
    assert pooled["arms"] == ["plain", "adaptive"] and pooled["baseline"] == "plain"
    assert "plain_b" in res["arms"] and len(res["bursts"]) == 25  # the input is not changed
    plain = [b for b in pooled["bursts"] if b["arm"] == "plain"]
    assert len(plain) == 6 and plain[0]["tokens"] == 200 and plain[0]["wall_s"] == pytest.approx(2.5)
    rows = {r["arm"]: r for r in summarize(pooled)}
    assert rows["adaptive"]["x_base"] == pytest.approx(2.5 / 2.0)  # 200 tokens in 2.0 s against in 2.5 s
    assert rows["adaptive"]["steps"] == 6 * 200 and rows["adaptive"]["steps_k_gt0"] == 6 * 20
    assert rows["adaptive"]["hook_share"] == pytest.approx(0.01)

    for i, wall in enumerate((1.5, 1.0)):
        (tmp_path / f"s{i}.json").write_text(json.dumps(start(wall)))
    args = ["--report", str(tmp_path / "s0.json"), str(tmp_path / "s1.json")]
    assert main([*args, "--pool", "plain=plain+plain_b", "--pool", "adaptive=adaptive+adaptive_b"]) == 0
    out = capsys.readouterr().out
    assert (
        "| chat@c8 | `adaptive` | 6 | 100.0 | 1.250 |" in out and "| chat@c8 | `adaptive` | 6 | 100.0 | 1.000 |" in out
    )
    assert "| `adaptive` | 2 | 1.118 |" in out and "plain_b" not in out  # sqrt(1.25 * 1.0) over the two starts
    for bad, why in (
        ("plain=plain", "NAME=ARM+ARM"),
        ("p=plain+plain", "two or more different arms"),
        ("p=plain+k9", "'k9' names no arm"),
        ("adaptive=plain+plain_b", "already another arm's name"),
    ):
        assert main([*args, "--pool", bad]) == 2
        assert why in capsys.readouterr().err
    live = ["--arm", "a=http://127.0.0.1:9", "--arm", "b=http://127.0.0.1:9", "--out", str(tmp_path / "live")]
    assert main([*live, "--pool", "a=a+c"]) == 2  # refused before any request is sent
    assert "'c' names no arm" in capsys.readouterr().err and not (tmp_path / "live").exists()
