"""Integration test of ``python -m bench run`` against the real engine host (CPU, eager):
two modes, a few seconds each, then the JSON results are checked field by field."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.engine


def test_bench_run_two_modes_writes_sane_results(engine_host, control, restore_config, tmp_path):
    out = tmp_path / "bench"
    env = dict(os.environ, BENCH_TEST_TOKEN=engine_host.token)
    cmd = [
        sys.executable,
        "-m",
        "bench",
        "run",
        "--url",
        engine_host.url,
        "--token-env",
        "BENCH_TEST_TOKEN",
        "--workload",
        "shift",
        "--shift-period",
        "2",
        "--mode",
        "fixed:4,adaptive",
        "--concurrency",
        "2",
        "--duration",
        "5",
        "--ramp",
        "1",
        "--max-tokens",
        "32",
        "--settle",
        "0.5",
        "--warmup",
        "1",
        "--out",
        str(out),
        "--no-png",
        "--quiet",
    ]
    proc = subprocess.run(
        cmd, cwd=Path(__file__).resolve().parent.parent, env=env, capture_output=True, text=True, timeout=240
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "Output tokens/s" in proc.stdout

    runs = json.loads((out / "results.json").read_text())["runs"]
    assert [r["spec"]["mode"] for r in runs] == ["fixed:4", "adaptive"]
    for r in runs:
        c = r["client"]
        assert c["window_s"] == 5
        assert c["requests"]["sent"] >= 2 and c["requests"]["failed"] == 0, c["errors"]
        assert c["output_tokens"] > 10
        assert 0 < c["output_tokens_per_s"] < 5000
        assert 0 <= c["goodput_tokens_per_s"] <= c["output_tokens_per_s"]
        for key in ("ttft_ms", "itl_ms", "tpot_ms"):
            p = c[key]
            assert p["n"] > 0 and 0 < p["p50"] <= p["p95"] <= p["p99"] < 60_000, (key, p)
        assert r["apply"]["applied"] is True
        assert r["engine"]["k_max_engine"] == 8
        assert r["k"]["timeline"], "K was sampled during the run"
        assert sum(r["k"]["steps_at_k"]) > 0
        a = r["acceptance"]
        assert a["acceptance_rate"] is None or 0.0 <= a["acceptance_rate"] <= 1.0
        assert len(r["throughput_series"]) == 6  # the 1 s ramp and the 5 s window
        assert r["server_samples"], "per-second samples from /control/samples"
        assert {w for _, w in r["workload_series"]} <= {"code", "docs", "chat"}
        assert (out / "charts" / f"{r['label']}.html").is_file()

    fixed = runs[0]
    assert fixed["k"]["mean_k_steps"] == pytest.approx(4.0, abs=0.5)
    steps = fixed["k"]["steps_at_k"]
    assert max(range(len(steps)), key=steps.__getitem__) == 4  # most steps ran at K=4
    assert {p["k"] for p in fixed["k"]["timeline"]} <= {0, 4, None}  # 0 only on steps without decodes
    assert fixed["acceptance"]["draft_tokens"] > 0
    adaptive = runs[1]
    assert adaptive["controller_end"]["mode"] == "adaptive"
    assert all(0 <= p["k"] <= 8 for p in adaptive["k"]["timeline"] if p["k"] is not None)

    summary = json.loads((out / "summary.json").read_text())
    assert [row["mode"] for row in summary["rows"]] == ["fixed:4", "adaptive"]
    assert (out / "summary.md").is_file() and (out / "summary.csv").is_file()
    assert (out / "charts" / "summary.html").is_file()


def test_bench_fixed_work_sends_the_same_requests_and_waits_for_all(engine_host, control, restore_config, tmp_path):
    out = tmp_path / "bench"
    env = dict(os.environ, BENCH_TEST_TOKEN=engine_host.token)
    cmd = [
        sys.executable,
        "-m",
        "bench",
        "run",
        "--url",
        engine_host.url,
        "--token-env",
        "BENCH_TEST_TOKEN",
        "--workload",
        "code",
        "--mode",
        "fixed:0,fixed:2",
        "--concurrency",
        "2",
        "--requests-per-client",
        "2",
        "--max-tokens",
        "24",
        "--settle",
        "0.2",
        "--warmup",
        "0",
        "--out",
        str(out),
        "--no-png",
        "--quiet",
    ]
    proc = subprocess.run(
        cmd, cwd=Path(__file__).resolve().parent.parent, env=env, capture_output=True, text=True, timeout=240
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    runs = json.loads((out / "results.json").read_text())["runs"]
    sources = []
    for r in runs:
        c = r["client"]
        assert r["spec"]["num_requests"] == 4
        assert c["requests"]["sent"] == 4 and c["requests"]["finished"] == 4 and c["requests"]["cancelled_at_end"] == 0
        ends = [q["done_s"] for q in r["requests"]]
        assert c["window_s"] == pytest.approx(max(ends), abs=0.01)  # tokens/s over the makespan
        assert c["output_tokens_per_s"] == pytest.approx(c["output_tokens"] / c["window_s"], rel=0.01)
        sources.append([q["source"] for q in r["requests"]])
    assert sources[0] == sources[1]  # every mode gets the same prompts


def test_bench_matrix_rounds_write_one_folder_per_round_and_the_spread(engine_host, control, restore_config, tmp_path):
    out = tmp_path / "matrix"
    env = dict(os.environ, BENCH_TEST_TOKEN=engine_host.token)
    cmd = [sys.executable, "-m", "bench", "matrix", "--url", engine_host.url, "--token-env", "BENCH_TEST_TOKEN",
           "--workloads", "code", "--loads", "low", "--modes", "fixed:0,fixed:2", "--rounds", "2",
           "--requests-per-client", "1", "--max-tokens", "16", "--settle", "0.2", "--warmup", "0",
           "--out", str(out), "--no-png", "--quiet"]  # fmt: skip
    proc = subprocess.run(
        cmd, cwd=Path(__file__).resolve().parent.parent, env=env, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    starts = {}
    for r in (1, 2):
        folder = out / f"round-{r}"
        for mode in ("fixed:0", "fixed:2"):
            cell = json.loads((folder / f"code-low-{mode.replace(':', '')}.json").read_text())
            assert cell["spec"]["mode"] == mode and cell["client"]["requests"]["finished"] == 1
            starts[(r, mode)] = cell["started_at_unix"]
        rows = json.loads((folder / "summary.json").read_text())["rows"]
        assert sorted(row["mode"] for row in rows) == ["fixed:0", "fixed:2"]
    # round 2 runs the modes in reverse order, right after round 1
    assert starts[(1, "fixed:0")] < starts[(1, "fixed:2")] < starts[(2, "fixed:2")] < starts[(2, "fixed:0")]
    spread = (out / "spread.md").read_text()
    assert "| code | low |" in spread and "2 runs" in spread
    assert "2 runs" in proc.stdout
