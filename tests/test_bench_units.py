"""Unit tests of the benchmark harness: statistics, goodput, Poisson arrivals, workloads,
mode strings, counters and reports (no engine needed)."""

from __future__ import annotations

import json
import math
import os
import sys

import numpy as np
import pytest

from bench import engine_control as ec
from bench import metrics as bm
from bench import workloads as wl
from bench.report import group_ratios, markdown_tables, write_summary

# --- percentiles -----------------------------------------------------------------------


def test_percentiles_match_numpy_linear_interpolation():
    vals = list(range(1, 101))  # 1..100
    p = bm.percentiles(vals)
    assert p["p50"] == pytest.approx(50.5)
    assert p["p95"] == pytest.approx(95.05)
    assert p["p99"] == pytest.approx(99.01)
    assert p["mean"] == pytest.approx(50.5)
    assert p["n"] == 100


def test_percentiles_empty_and_non_finite():
    assert bm.percentiles([]) == {"p50": None, "p95": None, "p99": None, "mean": None, "n": 0}
    p = bm.percentiles([1.0, float("nan"), None, float("inf"), 3.0])
    assert p["n"] == 2 and p["p50"] == pytest.approx(2.0)


def test_percentiles_single_value():
    p = bm.percentiles([7.0])
    assert p["p50"] == p["p95"] == p["p99"] == 7.0


# --- request records, ITL, goodput -------------------------------------------------------


def _rec(sent, chunks, done=None, tokens=None, **kw):
    r = bm.RequestRecord(index=0, workload="code", source="t", sent_s=sent, chunks=list(chunks), done_s=done, **kw)
    r.output_tokens = tokens if tokens is not None else sum(n for _, n in chunks)
    return r


def test_record_latencies_and_per_token_itl():
    # first token at 0.5 s, then a 3-token chunk 0.3 s later, then 1 token 0.1 s later
    r = _rec(0.0, [(0.5, 1), (0.8, 3), (0.9, 1)], done=0.9)
    assert r.ttft_ms == pytest.approx(500.0)
    assert r.e2e_ms == pytest.approx(900.0)
    assert r.tpot_ms == pytest.approx(400.0 / 4)
    assert r.itl_samples_ms() == pytest.approx([100.0, 100.0, 100.0, 100.0])
    assert r.chunk_gaps_ms() == pytest.approx([300.0, 100.0])
    assert r.tokens_within(0.0, 0.85) == 4


def test_cancelled_record_has_no_e2e_but_counts_tokens_in_window():
    r = _rec(1.0, [(1.2, 1), (1.4, 2)], done=None, cancelled=True)
    assert r.e2e_ms is None
    assert r.ttft_ms == pytest.approx(200.0)
    assert bm.throughput([r], window_s=2.0) == pytest.approx(1.5)


def test_goodput_counts_only_requests_meeting_the_slo():
    fast = _rec(0.0, [(0.1, 1), (0.2, 9)], done=0.2)  # TTFT 100 ms, TPOT 11 ms
    slow_ttft = _rec(0.0, [(3.0, 1), (3.1, 9)], done=3.1)  # TTFT 3000 ms
    slow_tpot = _rec(0.0, [(0.1, 1), (5.1, 1)], done=5.1)  # TPOT 5000 ms
    slo = bm.SLO(ttft_ms=2000, tpot_ms=100)
    assert slo.met_by(fast) and not slo.met_by(slow_ttft) and not slo.met_by(slow_tpot)
    window = 10.0
    assert bm.throughput([fast, slow_ttft, slow_tpot], window) == pytest.approx(22 / 10)
    assert bm.goodput([fast, slow_ttft, slow_tpot], window, slo) == pytest.approx(10 / 10)
    s = bm.summarize([fast, slow_ttft, slow_tpot], window, slo)
    assert s["goodput_fraction"] == pytest.approx(10 / 22, abs=1e-4)
    assert s["requests"]["meeting_slo"] == 1
    assert s["requests"]["finished"] == 3


def test_failed_request_never_meets_slo():
    r = _rec(0.0, [(0.1, 1)], done=0.1, error="HTTP 500")
    assert not bm.SLO().met_by(r)
    assert r.e2e_ms is None


def test_tokens_outside_window_do_not_count():
    r = _rec(0.0, [(0.5, 1), (9.5, 1), (10.5, 5)], done=10.5)
    assert bm.throughput([r], 10.0) == pytest.approx(0.2)
    assert bm.tokens_per_second_series([r], 10.0) == [1.0] + [0.0] * 8 + [1.0]


def test_summarize_is_json_serialisable_and_has_all_fields():
    r = _rec(0.0, [(0.1, 1), (0.3, 2)], done=0.3)
    s = bm.summarize([r], 1.0, bm.SLO())
    json.dumps(s)
    for key in ("ttft_ms", "itl_ms", "chunk_itl_ms", "tpot_ms", "e2e_ms"):
        assert set(s[key]) == {"p50", "p95", "p99", "mean", "n"}
    assert s["output_tokens_per_s"] == pytest.approx(3.0)


# --- acceptance from counters -------------------------------------------------------------


def test_acceptance_from_counter_deltas():
    before = {"drafts": 10, "draft_tokens": 40, "accepted_tokens": 20, "accepted_per_pos": [8, 6, 4, 2]}
    after = {"drafts": 30, "draft_tokens": 120, "accepted_tokens": 50, "accepted_per_pos": [24, 14, 8, 4]}
    a = bm.acceptance_from_counters(before, after)
    assert a["acceptance_rate"] == pytest.approx(30 / 80)
    assert a["mean_acceptance_length"] == pytest.approx(1 + 30 / 20)
    assert a["accepted_per_position"] == [16, 8, 4, 2]
    assert a["acceptance_per_position"] == pytest.approx([0.8, 0.4, 0.2, 0.1])


def test_acceptance_without_drafts_is_none():
    z = {"drafts": 0, "draft_tokens": 0, "accepted_tokens": 0, "accepted_per_pos": []}
    a = bm.acceptance_from_counters(z, z)
    assert a["acceptance_rate"] is None and a["mean_acceptance_length"] is None


def test_spec_counters_parse_prometheus_text():
    text = """# HELP vllm:spec_decode_num_drafts_total Number of spec decoding drafts.
# TYPE vllm:spec_decode_num_drafts_total counter
vllm:spec_decode_num_drafts_total{engine="0",model_name="m"} 12.0
# HELP vllm:spec_decode_num_draft_tokens_total Number of draft tokens.
# TYPE vllm:spec_decode_num_draft_tokens_total counter
vllm:spec_decode_num_draft_tokens_total{engine="0",model_name="m"} 48.0
# HELP vllm:spec_decode_num_accepted_tokens_total Number of accepted tokens.
# TYPE vllm:spec_decode_num_accepted_tokens_total counter
vllm:spec_decode_num_accepted_tokens_total{engine="0",model_name="m"} 30.0
# HELP vllm:spec_decode_num_accepted_tokens_per_pos_total Accepted tokens per draft position.
# TYPE vllm:spec_decode_num_accepted_tokens_per_pos_total counter
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="m",position="1"} 9.0
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="m",position="0"} 11.0
"""
    c = ec.spec_counters(text)
    assert c == {"drafts": 12.0, "draft_tokens": 48.0, "accepted_tokens": 30.0, "accepted_per_pos": [11.0, 9.0]}
    assert ec.spec_counters("") == {"drafts": 0.0, "draft_tokens": 0.0, "accepted_tokens": 0.0, "accepted_per_pos": []}


# --- Poisson arrivals ---------------------------------------------------------------------


def test_poisson_arrivals_deterministic_sorted_and_in_range():
    a = bm.poisson_arrivals(5.0, 20.0, seed=3)
    assert a == bm.poisson_arrivals(5.0, 20.0, seed=3)
    assert a != bm.poisson_arrivals(5.0, 20.0, seed=4)
    assert all(0 < x < 20.0 for x in a)
    assert a == sorted(a)


def test_poisson_arrivals_have_the_right_rate_and_exponential_gaps():
    a = np.array(bm.poisson_arrivals(10.0, 2000.0, seed=1))
    assert len(a) / 2000.0 == pytest.approx(10.0, rel=0.03)
    gaps = np.diff(a)
    assert gaps.mean() == pytest.approx(0.1, rel=0.03)
    # exponential: standard deviation equals the mean, P(gap > mean) = 1/e
    assert gaps.std() == pytest.approx(0.1, rel=0.05)
    assert (gaps > 0.1).mean() == pytest.approx(math.exp(-1), abs=0.02)


def test_poisson_arrivals_rejects_bad_rate():
    with pytest.raises(ValueError):
        bm.poisson_arrivals(0.0, 1.0)
    assert bm.poisson_arrivals(1.0, 0.0) == []


# --- workloads ----------------------------------------------------------------------------


def test_prompt_sources_are_the_documented_files():
    he = wl.humaneval_prompts()
    assert len(he) == 164
    assert he[0][0] == "HumanEval/0" and "def has_close_elements" in he[0][1]
    docs = wl.doc_documents()
    assert len(docs) >= 20
    assert {rel for rel, _ in docs} <= set(wl.DOC_MODULES)
    assert all(wl.DOC_MIN_CHARS // 2 <= len(t) <= wl.DOC_MAX_CHARS for _, t in docs)
    json_doc = dict(docs)["json/__init__.py"]
    assert "JSON (JavaScript Object Notation)" in json_doc
    zen = wl.zen_aphorisms()
    assert len(zen) == 19
    assert zen[0] == "Beautiful is better than ugly."
    assert "Namespaces are one honking great idea -- let's do more of those!" in zen


def test_each_base_workload_has_the_documented_settings():
    code = wl.prompt_pool("code")
    assert all(
        p.endpoint == "completions" and p.temperature == 0 and 0 < len(p.stop) <= 4 for p in code
    )  # vLLM: <= 4 stops
    docs = wl.prompt_pool("docs")
    assert len(docs) == len(wl.doc_documents()) * len(wl.DOC_TASKS)
    assert all(p.endpoint == "chat" and p.temperature == 0 for p in docs)
    assert {p.source.rsplit("task ", 1)[1] for p in docs} == {"quote", "extract", "summarise"}
    chat = wl.prompt_pool("chat")
    assert len(chat) == 19 * len(wl.CHAT_TEMPLATES)
    assert all(p.temperature == pytest.approx(0.7) for p in chat)
    for p in code + docs + chat:
        assert p.source  # every prompt names where it came from


def test_workload_is_deterministic_given_seed():
    def seq(name, seed, n=30):
        w = wl.Workload(name, seed=seed)
        return [(p.source, p.seed) for p in (w.next_prompt(0.0) for _ in range(n))]

    for name in ("code", "docs", "chat"):
        assert seq(name, 7) == seq(name, 7)
        assert seq(name, 7) != seq(name, 8)
    chat = [s for _, s in seq("chat", 1)]
    assert all(isinstance(s, int) for s in chat) and len(set(chat)) == len(chat)
    assert all(s is None for _, s in seq("code", 1))


def test_workload_cycles_through_its_pool():
    w = wl.Workload("code", seed=0)
    first = [w.next_prompt().source for _ in range(164)]
    assert len(set(first)) == 164
    assert w.next_prompt().source == first[0]


def test_shift_alternates_every_period():
    w = wl.Workload("shift", seed=0, period_s=5.0)
    got = [w.next_prompt(t).workload for t in (0.0, 4.9, 5.0, 9.9, 10.0, 14.9, 15.0, 31.0)]
    assert got == ["code", "code", "docs", "docs", "chat", "chat", "code", "code"]
    with pytest.raises(ValueError):
        wl.Workload("shift", period_s=0)
    with pytest.raises(ValueError):
        wl.Workload("nope")


def test_request_bodies_stream_with_usage():
    p = wl.Workload("chat", seed=0).next_prompt()
    b = p.body("m", 64)
    assert b["stream"] is True and b["stream_options"] == {"include_usage": True, "continuous_usage_stats": True}
    assert b["messages"][0]["role"] == "user" and b["seed"] == p.seed and b["max_tokens"] == 64
    assert p.path == "/v1/chat/completions"
    c = wl.Workload("code", seed=0).next_prompt()
    assert c.path == "/v1/completions" and "prompt" in c.body("m", 8) and "seed" not in c.body("m", 8)


# --- mode strings -------------------------------------------------------------------------


def _adaptive_spec(lo: int = 0, hi: int | None = None, **params) -> dict:
    """The speculation patch of an adaptive mode: K bounds, then the gate's parameters over
    the defaults (per-request gate on, mixture prior, calibrated gain)."""
    adaptive = {"per_request": True, "prior": "mixture", "gain": "calibrated", **params}
    return {"mode": "adaptive", "k_min": lo, "k_max": hi, "adaptive": adaptive}


@pytest.mark.parametrize(
    "mode,spec",
    [
        ("off", {"mode": "off"}),
        ("fixed:4", {"mode": "fixed", "k": 4}),
        ("adaptive", _adaptive_spec()),
        ("adaptive:1-6", _adaptive_spec(1, 6)),
        ("adaptive_step", _adaptive_spec(per_request=False)),
        ("adaptive_pooled:0-4", _adaptive_spec(0, 4, prior="pooled")),
        ("adaptive_mixture", _adaptive_spec()),
        ("adaptive_geometric", _adaptive_spec(gain="geometric")),
        ("heuristic", {"mode": "heuristic", "k_min": 1, "k_max": None}),
        ("threshold", {"mode": "threshold", "k_min": 0, "k_max": None}),
        ("batch_table", {"mode": "batch_table", "table": ec.DEFAULT_BATCH_TABLE}),
        ("batch_table:1-4=6,5-16=2", {"mode": "batch_table", "table": [[1, 4, 6], [5, 16, 2]]}),
        ("plain", {"mode": "off"}),
    ],
)
def test_mode_patch(mode, spec):
    assert ec.mode_patch(mode) == {"speculation": spec}


@pytest.mark.parametrize("bad", ["fixed", "fixed:x", "adaptive:3", "batch_table:1-4", "turbo", "off:2"])
def test_mode_patch_rejects_malformed(bad):
    with pytest.raises(ec.BenchError):
        ec.mode_patch(bad)


def test_mode_patches_are_valid_live_configs():
    from engine_host.config import EngineLimits, LiveConfig, apply_patch

    limits = EngineLimits(model="m", k_max=8, max_num_seqs=16, max_num_batched_tokens=2048, max_model_len=2048)
    modes = ("off", "fixed:0", "fixed:8", "adaptive", "adaptive_step", "adaptive_pooled", "adaptive_geometric")
    for m in (*modes, "heuristic", "threshold"):
        apply_patch(LiveConfig(), ec.mode_patch(m), limits)
    assert (
        apply_patch(LiveConfig(), ec.mode_patch("adaptive_geometric"), limits).speculation.adaptive.gain == "geometric"
    )
    apply_patch(LiveConfig(), ec.mode_patch("batch_table"), limits)
    # adaptive after adaptive_pooled goes back to the mixture prior, the default
    assert LiveConfig().speculation.adaptive.prior == "mixture"
    cfg = apply_patch(LiveConfig(), ec.mode_patch("adaptive_pooled"), limits)
    assert cfg.speculation.adaptive.prior == "pooled"
    assert apply_patch(cfg, ec.mode_patch("adaptive"), limits).speculation.adaptive.prior == "mixture"
    # adaptive after adaptive_step turns the gate on again (a live config keeps what a patch leaves out)
    cfg = apply_patch(LiveConfig(), ec.mode_patch("adaptive_step"), limits)
    assert cfg.speculation.adaptive.per_request is False
    assert apply_patch(cfg, ec.mode_patch("adaptive"), limits).speculation.adaptive.per_request is True


def test_baseline_modes_run_on_an_engine_with_a_small_k_max():
    """threshold and batch_table without arguments on an engine started with --k-max 4
    (their defaults reach K = 8 and 6): accepted, with every K within 0..4; a table given in
    the mode string is sent as given and refused with the reason."""
    from engine_host.config import ConfigError, EngineLimits, LiveConfig, apply_patch

    k4 = EngineLimits(model="m", k_max=4, max_num_seqs=16, max_num_batched_tokens=2048, max_model_len=2048)
    for m in ("threshold", "batch_table", "heuristic", "adaptive"):
        apply_patch(LiveConfig(), ec.mode_patch(m, k_max_engine=4), k4)
    table = ec.mode_patch("batch_table", k_max_engine=4)["speculation"]["table"]
    assert [k for _, _, k in table] == [4, 4, 2]
    with pytest.raises(ConfigError, match="K=6 is above K_max"):
        apply_patch(LiveConfig(), ec.mode_patch("batch_table:1-4=6", k_max_engine=4), k4)


def test_static_modes_and_mean_k():
    assert ec.static_k("fixed:3") == 3 and ec.static_k("off") == 0 and ec.static_k("adaptive") is None
    assert ec.steps_at_k_delta({"controller": {"steps_at_k": [1, 2]}}, {"controller": {"steps_at_k": [3, 2, 4]}}) == [
        2,
        0,
        4,
    ]
    assert ec.mean_k([2, 0, 2]) == pytest.approx(1.0)
    assert ec.mean_k([]) is None


# --- reports ------------------------------------------------------------------------------


def _row(wl_, load, mode, tps, itl=10.0):
    return {
        "workload": wl_,
        "load": load,
        "mode": mode,
        "output_tokens_per_s": tps,
        "goodput_tokens_per_s": tps,
        "ttft_p50_ms": 1.0,
        "ttft_p95_ms": 2.0,
        "ttft_p99_ms": 3.0,
        "itl_mean_ms": itl,
        "itl_p50_ms": itl,
        "itl_p95_ms": itl,
        "itl_p99_ms": itl,
        "e2e_p50_ms": 1.0,
        "e2e_p95_ms": 1.0,
        "e2e_p99_ms": 1.0,
        "requests_finished": 3,
        "acceptance_rate": 0.5,
        "mean_acceptance_length": 2.0,
        "mean_k": 2.0,
    }


def test_group_ratios_against_best_static_k0_and_plain():
    rows = [
        _row("code", "low", "fixed:0", 50),
        _row("code", "low", "fixed:4", 100),
        _row("code", "low", "adaptive", 96),
        _row("code", "low", "threshold", 80),
        _row("code", "low", "plain", 60),
    ]
    (g,) = group_ratios(rows)
    assert g["best_static_mode"] == "fixed:4"
    assert g["adaptive_vs_best_static"] == pytest.approx(0.96)
    assert g["adaptive_vs_k0"] == pytest.approx(1.92)
    assert g["adaptive_vs_plain"] == pytest.approx(1.6)
    assert g["meets_vs_best_static"] is True and g["meets_vs_k0"] is True
    assert "meets_shift_gain" not in g


def test_shift_gain_by_throughput_or_itl():
    rows = [_row("shift", "high", "fixed:4", 100, itl=20), _row("shift", "high", "adaptive", 105, itl=15)]
    (g,) = group_ratios(rows)
    assert g["adaptive_vs_best_other"] == pytest.approx(1.05)
    assert g["best_other_itl_vs_adaptive"] == pytest.approx(20 / 15, abs=1e-3)
    assert g["meets_shift_gain"] is True
    rows[1]["itl_mean_ms"] = 19.0
    assert group_ratios(rows)[0]["meets_shift_gain"] is False


def test_markdown_and_summary_files(tmp_path):
    rows = [_row("code", "low", "fixed:0", 50.0), _row("code", "low", "adaptive", 40.0)]
    md = markdown_tables(rows, group_ratios(rows))
    assert "| code | low | 50.0 | 40.0 |" in md
    assert "**no**" in md  # 0.8 x K=0 misses the target and says so
    results = [
        {
            "spec": {
                "workload": r["workload"],
                "load": {"label": r["load"], "rate_per_s": None, "concurrency": 1},
                "mode": r["mode"],
            },
            "client": {
                "output_tokens_per_s": r["output_tokens_per_s"],
                "goodput_tokens_per_s": 1.0,
                "ttft_ms": bm.percentiles([1.0]),
                "itl_ms": bm.percentiles([1.0]),
                "e2e_ms": bm.percentiles([]),
                "requests": {"finished": 1},
            },
            "acceptance": {"acceptance_rate": None, "mean_acceptance_length": None},
            "k": {"mean_k_steps": 0.0},
        }
        for r in rows
    ]
    paths = write_summary(results, tmp_path, {"command": "python -m bench matrix"})
    assert paths["md"].read_text().startswith("Command: `python -m bench matrix`")
    assert paths["csv"].read_text().splitlines()[0].startswith("workload,load,mode,output_tokens_per_s")
    data = json.loads(paths["json"].read_text())
    assert data["ratios"][0]["adaptive_vs_k0"] == pytest.approx(0.8)


def test_report_command_rebuilds_summary_from_cell_files(tmp_path):
    from bench.__main__ import main

    for i, (mode, tps) in enumerate((("fixed:0", 50.0), ("adaptive", 60.0))):
        doc = {
            "label": f"code-low-{mode}",
            "started_at_unix": 100.0 + i,
            "spec": {"workload": "code", "load": {"label": "low", "rate_per_s": None, "concurrency": 1}, "mode": mode},
            "client": {
                "output_tokens_per_s": tps,
                "goodput_tokens_per_s": tps,
                "ttft_ms": bm.percentiles([1.0]),
                "itl_ms": bm.percentiles([2.0]),
                "e2e_ms": bm.percentiles([3.0]),
                "requests": {"finished": 1},
            },
            "acceptance": {"acceptance_rate": 0.5, "mean_acceptance_length": 2.0},
            "k": {"mean_k_steps": 1.0},
        }
        (tmp_path / f"{doc['label']}.json").write_text(json.dumps(doc))
    assert main(["report", str(tmp_path), "--no-png"]) == 0
    data = json.loads((tmp_path / "summary.json").read_text())
    assert [r["mode"] for r in data["rows"]] == ["fixed:0", "adaptive"]
    assert data["ratios"][0]["adaptive_vs_k0"] == pytest.approx(1.2)
    assert (tmp_path / "charts" / "summary.html").is_file()
    assert main(["report", str(tmp_path / "empty")]) == 2


def test_poisson_arrivals_limit_gives_exactly_that_many():
    a = bm.poisson_arrivals(2.0, float("inf"), seed=5, limit=7)
    assert len(a) == 7 and a == sorted(a)
    assert a == bm.poisson_arrivals(2.0, a[-1] + 1e-9, seed=5)


def test_shift_by_request_count_gives_every_mode_the_same_sequence():
    w1 = wl.Workload("shift", seed=3, period_requests=2)
    w2 = wl.Workload("shift", seed=3, period_requests=2)
    bases = [w1.next_prompt(elapsed_s=t).workload for t in (0, 50, 100, 0, 3, 9, 1)]
    assert bases == ["code", "code", "docs", "docs", "chat", "chat", "code"]
    assert [w2.next_prompt(0).source for _ in range(7)] == [
        wl.Workload("shift", seed=3, period_requests=2).prompt(b, i).source
        for b, i in [("code", 0), ("code", 1), ("docs", 0), ("docs", 1), ("chat", 0), ("chat", 1), ("code", 2)]
    ]
    with pytest.raises(ValueError):
        wl.Workload("shift", period_requests=0)


def test_makespan_is_the_last_token_or_completion():
    recs = [_rec(0.0, [(0.5, 1), (2.0, 3)], done=2.1), _rec(1.0, [(1.5, 2)], done=None)]
    assert bm.makespan_s(recs) == pytest.approx(2.1)
    assert bm.makespan_s([]) == 0.0


def test_a_bare_vllm_server_runs_mode_plain_only():
    import asyncio

    import httpx

    from bench.engine_control import BenchError, EngineControl

    def vllm_serve(request: httpx.Request) -> httpx.Response:  # no /control/* routes
        return httpx.Response(404, json={"detail": "Not Found"})

    async def go() -> None:
        ec = EngineControl("http://vllm", token=None)
        ec.http = httpx.AsyncClient(base_url="http://vllm", transport=httpx.MockTransport(vllm_serve))
        try:
            assert await ec.state() == {}
            assert await ec.samples(0.0) == []
            assert await ec.apply_mode("plain") == {}
            with pytest.raises(BenchError, match="needs an engine host"):
                await ec.apply_mode("fixed:4")
        finally:
            await ec.aclose()

    asyncio.run(go())


def test_engine_spec_environment_settings_are_split_from_arguments():
    from bench.gpu_bench import split_env

    env, argv = split_env("VLLM_PLUGINS=specpilot_stats A_B=1 --max-num-seqs 64 X=2")
    assert env == {"VLLM_PLUGINS": "specpilot_stats", "A_B": "1"}
    assert argv == ["--max-num-seqs", "64", "X=2"]  # only leading settings are environment
    assert split_env("") == ({}, [])


def test_host_overhead_engine_specs_and_refusal(tmp_path):
    from bench.gpu_bench import make_engine
    from engine_host.process import RouterProcess

    name, eh, kind = make_engine("serve:stats:VLLM_PLUGINS=specpilot_stats --max-num-seqs 8", "/m/model", tmp_path)
    assert (name, kind) == ("stats", "serve")
    assert eh.env == {"VLLM_PLUGINS": "specpilot_stats"} and eh.command()[-2:] == ["--max-num-seqs", "8"]
    name, eh, kind = make_engine("dual:d:--gpu-memory-utilization 0.3 -- --warmup quick", "/m/model", tmp_path)
    assert kind == "dual" and isinstance(eh, RouterProcess) and eh.extra_args[-2:] == ["--warmup", "quick"]
    name, eh, kind = make_engine("plain", "/m/model", tmp_path)
    assert (name, kind) == ("plain", "serve") and eh.env == {}
    with pytest.raises(SystemExit, match="expected plain, serve:NAME:ARGS"):
        make_engine("hots:x:--k-max 0", "/m/model", tmp_path)


def test_host_overhead_table_gives_ratio_of_medians_and_per_round_ratios():
    from bench.host_overhead import summarize

    res = {
        "rows": [
            {
                "name": "bare",
                "loads": {"chat@c64": [100.0, 300.0, 200.0]},
                "rounds": {"chat@c64": [0, 1, 2]},
                "ttft_ms": [20.0, 30.0, 25.0],
            },
            {
                "name": "dual/auto",
                "loads": {"chat@c64": [150.0, 190.0, 170.0]},
                "rounds": {"chat@c64": [0, 2, 3]},
                "ttft_ms": [22.0],
            },
        ]
    }
    lines = summarize(res).splitlines()
    assert "x bare (medians)" in lines[0]
    assert lines[2] == "| bare | chat@c64 | 200 (100, 300, 200) | 1.000 | - | 25.00 |"
    # medians 170 / 200; per round: round 0 150/100, round 2 190/200 (round 3 has no pair)
    assert lines[3] == "| dual/auto | chat@c64 | 170 (150, 190, 170) | 0.850 | 1.225 [0.950, 1.500] (2) | 22.00 |"
    assert "x dual/auto" in summarize(res, "dual/auto").splitlines()[0]
    with pytest.raises(KeyError):
        summarize(res, "nope")


def test_host_overhead_keeps_engines_for_a_later_call_and_stops_them_at_the_end(tmp_path, monkeypatch):
    """Two calls: the first starts an engine (a real process in its own session) and keeps it;
    the second attaches by --state, appends its windows, and stops the process group."""
    import subprocess

    import bench.host_overhead as ho

    procs = []

    class FakeEngine:
        def __init__(self, log_path):
            self.url, self.token, self.env, self.log_path = "http://127.0.0.1:9", "tok", {}, log_path
            self.proc = None

        def command(self):  # SIGINT restored: a shell's background job starts with it ignored
            return [
                sys.executable,
                "-c",
                "import signal, time; signal.signal(signal.SIGINT, signal.SIG_DFL); "
                "print('up', flush=True); time.sleep(300)",
            ]

        def start(self):
            self.log_path.write_text("engine log\n")
            self.proc = subprocess.Popen(self.command(), start_new_session=True, stdout=subprocess.PIPE)
            assert self.proc.stdout.readline() == b"up\n"  # the handler is in place before any SIGINT
            procs.append(self.proc)

        def stop(self):
            self.proc.kill()

    async def fake_wait_url(eh, path, timeout_s):
        return 1.0

    windows = iter(range(1000, 2000, 10))

    async def fake_closed_loop(url, model, conc, duration, max_tokens, seed, wl):
        return {"tokens_per_s": float(next(windows))}

    ttfts = iter([250.0] + [20.0] * 100)  # the first request after warm-up, then steady state

    async def fake_ttft(url, model, wl):
        return next(ttfts)

    monkeypatch.setattr(ho, "make_engine", lambda spec, model, logs: ("e1", FakeEngine(logs / "e1.log"), "serve"))
    monkeypatch.setattr(ho, "wait_url", fake_wait_url)
    monkeypatch.setattr(ho, "closed_loop", fake_closed_loop)
    monkeypatch.setattr(ho, "ttft", fake_ttft)
    monkeypatch.setattr(ho, "prepare_default_model", lambda quiet: tmp_path / "model")
    state, out = tmp_path / "scratch" / "state.json", tmp_path / "out"
    common = ["--state", str(state), "--out", str(out), "--warm", "0", "--duration", "1", "--ttfts", "1"]
    assert ho.main(["--engine", "serve:e1:--x", "--rounds", "2", "--keep", *common]) == 0
    assert procs[0].poll() is None  # left running
    first = json.loads(state.read_text())
    assert [lv["pid"] for lv in first["live"]] == [procs[0].pid]
    assert first["res"]["rows"][0]["loads"]["chat@c64"] == [1000.0, 1010.0]
    assert first["res"]["rows"][0]["ttft_first_ms"] == [250.0]  # taken before any load
    assert first["res"]["rows"][0]["ttft_ms"] == [20.0, 20.0]
    assert "first after warm-up: 250.00" in ho.summarize(first["res"])
    # the second call names the same engine: attached, not started again
    assert ho.main(["--engine", "serve:e1:--x", "--rounds", "1", *common]) == 0
    assert len(procs) == 1
    procs[0].wait(timeout=15)  # stopped through its process group
    done = json.loads((out / "overhead.json").read_text())
    assert done["rows"][0]["loads"]["chat@c64"] == [1000.0, 1010.0, 1020.0]
    assert done["rows"][0]["rounds"]["chat@c64"] == [0, 1, 2] and done["rounds"] == 3
    assert done["rows"][0]["ttft_first_ms"] == [250.0]  # an attached engine is not fresh: not taken again
    assert json.loads(state.read_text())["live"] == []
    assert (out / "logs" / "e1.log").read_text() == "engine log\n"  # copied from the scratch folder


def test_host_overhead_parallel_start_starts_every_engine_before_waiting(tmp_path, monkeypatch):
    """--parallel-start: both engines are started before either is waited for (sequential
    start waits for each in turn); both are then measured, and --model is the served folder."""
    import bench.host_overhead as ho

    events: list[str] = []
    models: list[str] = []

    class FakeProc:
        pid = 4242

    class FakeEngine:
        def __init__(self, name, log_path):
            self.name, self.url, self.token, self.env, self.log_path = name, "http://127.0.0.1:9", "t", {}, log_path
            self.proc = FakeProc()

        def command(self):
            return ["engine", self.name]

        def start(self):
            events.append(f"start {self.name}")

        def stop(self):
            events.append(f"stop {self.name}")

    def fake_make_engine(spec, model, logs):
        models.append(model)
        name = spec.split(":")[1]
        return name, FakeEngine(name, logs / f"{name}.log"), "serve"

    async def fake_wait_url(eh, path, timeout_s):
        events.append(f"wait {eh.name}")
        return 1.0

    async def fake_closed_loop(url, model, conc, duration, max_tokens, seed, wl):
        return {"tokens_per_s": 100.0}

    async def fake_ttft(url, model, wl):
        return 20.0

    monkeypatch.setattr(ho, "make_engine", fake_make_engine)
    monkeypatch.setattr(ho, "wait_url", fake_wait_url)
    monkeypatch.setattr(ho, "closed_loop", fake_closed_loop)
    monkeypatch.setattr(ho, "ttft", fake_ttft)
    model = tmp_path / "m"
    model.mkdir()
    (model / "config.json").write_text("{}")
    common = ["--out", str(tmp_path / "out"), "--warm", "0", "--duration", "1", "--ttfts", "1", "--rounds", "1"]
    engines = ["--engine", "serve:a:--x", "--engine", "serve:b:--y", "--model", str(model)]
    assert ho.main([*engines, "--parallel-start", *common]) == 0
    assert events[:4] == ["start a", "start b", "wait a", "wait b"]
    assert models == [str(model), str(model)]
    done = json.loads((tmp_path / "out" / "overhead.json").read_text())
    assert [r["name"] for r in done["rows"]] == ["a", "b"]
    events.clear()
    assert ho.main([*engines, *common]) == 0  # without it: one engine up before the next starts
    assert events[:4] == ["start a", "wait a", "start b", "wait b"]
    with pytest.raises(SystemExit):
        ho.main(["--engine", "serve:a:--x", "--model", str(tmp_path / "nowhere"), *common])


def test_host_overhead_refuses_keep_without_state_and_a_bad_report(tmp_path, capsys):
    from bench.host_overhead import main

    with pytest.raises(SystemExit):
        main(["--engine", "plain", "--keep"])
    assert "--keep needs --state" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["--report", str(tmp_path / "missing.json")])
    assert "--report" in capsys.readouterr().err
    (tmp_path / "o.json").write_text(json.dumps({"rows": [{"name": "a", "loads": {"code@c8": [5.0]}}]}))
    assert main(["--report", str(tmp_path / "o.json")]) == 0
    assert "| a | code@c8 | 5 (5) | 1.000 | - | - |" in capsys.readouterr().out


def test_host_overhead_modes_carry_split_settings_per_row():
    from bench.host_overhead import parse_mode, summarize

    assert parse_mode("plain") == ("plain", {})
    assert parse_mode("auto:tpot_margin=0.25:p_min=0") == ("auto", {"tpot_margin": 0.25, "p_min": 0.0})
    for bad in ("fastest", "auto:margin=1", "auto:tpot_margin", "auto:tpot_margin=x"):
        with pytest.raises(ValueError):
            parse_mode(bad)
    res = {
        "rows": [
            {"name": "d/plain", "loads": {"chat@c8": [100.0]}, "rounds": {"chat@c8": [0]}, "ttft_ms": []},
            {
                "name": "d/auto",
                "loads": {"chat@c8": [90.0]},
                "rounds": {"chat@c8": [0]},
                "ttft_ms": [],
                "router": {
                    "chat@c8": [{"p_speculative": 0.2, "spec_requests": 0}, {"p_speculative": 0.01, "spec_requests": 7}]
                },
            },
        ]
    }
    text = summarize(res)
    assert "| d/auto | chat@c8 | 0.900 |" not in text  # the share table is separate from the ratios
    assert "| d/auto | chat@c8 | 0.105 [0.010, 0.200] (2) | 1 of 2 (0, 7) |" in text
    res["rows"][1]["router"]["chat@c8"] = [{"p_speculative": 0.2}]  # results of an older bench
    assert "| d/auto | chat@c8 | 0.200 [0.200, 0.200] (1) | - |" in summarize(res)


def test_every_benchmark_entry_point_is_a_command_of_python_m_bench(capsys):
    import re
    from pathlib import Path

    from bench.__main__ import TOOLS, build_parser, main

    root = Path(__file__).resolve().parent.parent / "bench"
    entry_points = {p.stem for p in root.glob("*.py") if re.search(r'^if __name__ == "__main__":', p.read_text(), re.M)}
    # run/matrix/report/workloads/fleet are parsed by bench/__main__ itself; the GPU payload has its own runner
    assert entry_points - {"__main__", "bench_fleet", "gpu_bench", "gpu_payload"} == {m for m, _ in TOOLS.values()}
    text = build_parser().format_help()
    for name in (*TOOLS, "run", "matrix", "report", "workloads", "fleet"):
        assert name in text
    with pytest.raises(SystemExit) as exc:
        main(["store", "--help"])  # the tool's own options
    assert exc.value.code == 0 and "python -m bench store" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        main(["host-overhead", "--engine", "plain", "--keep"])  # the tool's own errors reach the user
    assert "--keep needs --state" in capsys.readouterr().err


def test_spread_puts_runs_side_by_side_with_ratios_per_run(tmp_path, capsys):
    from bench import spread

    def cell(folder, workload, load, mode, tps):
        folder.mkdir(exist_ok=True)
        body = {
            "spec": {"workload": workload, "mode": mode, "load": {"label": load}},
            "client": {"output_tokens_per_s": tps},
        }
        if mode == "adaptive" and workload == "shift":  # the hook's share inside the cell
            body["overhead_window"] = {"cpu_fraction": tps / 10000}
        (folder / f"{workload}-{load}-{mode.replace(':', '')}.json").write_text(json.dumps(body))

    a, b = tmp_path / "a", tmp_path / "b"
    for folder, ada, k0, k4, plain in ((a, 110.0, 100.0, 90.0, 100.0), (b, 90.0, 100.0, 95.0, 110.0)):
        cell(folder, "shift", "low", "adaptive", ada)
        cell(folder, "shift", "low", "fixed:0", k0)
        cell(folder, "shift", "low", "fixed:4", k4)
        cell(folder, "shift", "low", "plain", plain)
        cell(folder, "code", "high", "adaptive", 50.0)
    table = spread.spread_table(spread.load_runs([a, b]), spread.load_hook_shares([a, b]))
    ada = next(c for c in table["cells"] if c["workload"] == "shift" and c["mode"] == "adaptive")
    assert ada["runs"] == [110.0, 90.0] and ada["mean"] == 100.0 and ada["spread"] == pytest.approx(0.2)
    assert ada["hook_cpu_share"] == [pytest.approx(0.011), pytest.approx(0.009)]
    k0 = next(c for c in table["cells"] if c["workload"] == "shift" and c["mode"] == "fixed:0")
    assert k0["hook_cpu_share"] == [None, None]  # not recorded: not made up
    shift = next(g for g in table["groups"] if g["workload"] == "shift")
    assert shift["x_plain"] == [pytest.approx(1.1), pytest.approx(90 / 110)]
    assert shift["x_plain_median"] == pytest.approx((1.1 + 90 / 110) / 2)
    assert shift["x_best_static"] == [pytest.approx(1.1), pytest.approx(0.9)]
    assert shift["x_best_other"] == [pytest.approx(1.1), pytest.approx(0.9)]  # plain is no "other" mode
    assert [g["workload"] for g in table["groups"]] == ["code", "shift"]  # the harness's workload order
    code = table["groups"][0]
    assert code["x_plain"] == [None, None]  # no plain column: no ratio, not a crash
    assert spread.main([str(a), str(b)]) == 0
    out = capsys.readouterr().out
    assert "110.0 / 90.0" in out
    assert "1.10 / 0.82 (median 0.96)" in out
    assert "| shift | low | adaptive | 1.10 / 0.90 |" in out  # the hook's share, % of busy time
    assert spread.main([str(tmp_path / "nothing")]) == 2


def test_the_hooks_share_of_a_cell_is_taken_between_the_window_and_the_end():
    from bench.engine_control import overhead_delta

    def state(hook, cpu, busy):
        return {"overhead": {"hook_seconds": hook, "hook_cpu_seconds": cpu, "busy_seconds": busy}}

    d = overhead_delta(state(1.0, 0.8, 100.0), state(1.5, 1.1, 120.0))
    assert d["busy_seconds"] == pytest.approx(20.0)
    assert d["fraction"] == pytest.approx(0.025) and d["cpu_fraction"] == pytest.approx(0.015)
    assert overhead_delta(state(1.0, 0.8, 100.0), state(0.1, 0.1, 5.0)) is None  # the engine restarted
    assert overhead_delta(state(1.0, 0.8, 100.0), state(1.0, 0.8, 100.0)) is None  # not busy in between
    assert overhead_delta({}, state(1.0, 0.8, 100.0)) is None  # plain vLLM: no hook
    assert overhead_delta(None, None) is None
    assert "lean_steps" not in d  # engine hosts that did not count them
    a, b = state(1.0, 0.8, 100.0), state(1.5, 1.1, 120.0)
    a["overhead"].update(aside_steps=100, lean_steps=40)
    b["overhead"].update(aside_steps=900, lean_steps=52)
    d = overhead_delta(a, b)
    assert (d["aside_steps"], d["lean_steps"]) == (800, 12)


def test_a_paired_cell_shows_the_steps_on_the_hooks_full_path():
    from bench import paired

    def burst(r, arm, steps, hook):
        return {
            "round": r,
            "cell": "chat@c8",
            "arm": arm,
            "tokens": 100,
            "wall_s": 1.0,
            "tok_s": 100.0,
            "ttft_ms": 10.0,
            "errors": 0,
            "draft_tokens": 0,
            "accepted_tokens": 0,
            "steps_at_k": steps,
            "overhead": hook,
        }

    hook = {"hook_seconds": 0.01, "hook_cpu_seconds": 0.01, "busy_seconds": 1.0, "aside_steps": 70, "lean_steps": 20}
    res = {
        "baseline": "plain",
        "arms": ["plain", "k0"],
        "cells": ["chat@c8"],
        "per_client": 1,
        "bursts": [b for r in range(3) for b in (burst(r, "plain", None, None), burst(r, "k0", [100, 0], hook))],
    }
    row = next(r for r in paired.summarize(res) if r["arm"] == "k0")
    assert row["steps"] == 300 and row["steps_full_path"] == 30
    assert "300 (0; full path 30)" in paired.render(res)
    # without the counts (older engine hosts' results), the column as before
    for b in res["bursts"]:
        if b["overhead"]:
            b["overhead"] = {k: v for k, v in hook.items() if k not in ("aside_steps", "lean_steps")}
    assert "| 300 (0) |" in paired.render(res)


def test_metric_total_sums_every_label_set_and_histogram_counts():
    from bench.gpu_bench import metric_total

    page = (
        "# HELP vllm:generation_tokens_total t\n# TYPE vllm:generation_tokens_total counter\n"
        'vllm:generation_tokens_total{model_name="a"} 12.0\nvllm:generation_tokens_total{model_name="b"} 3.0\n'
        "# HELP vllm:iteration_tokens_total t\n# TYPE vllm:iteration_tokens_total histogram\n"
        'vllm:iteration_tokens_total_bucket{le="+Inf"} 5.0\nvllm:iteration_tokens_total_count 5.0\n'
        "vllm:iteration_tokens_total_sum 50.0\n"
    )
    assert metric_total(page, "vllm:generation_tokens_total") == 15.0
    assert metric_total(page, "vllm:iteration_tokens_total_count") == 5.0
    assert metric_total(page, "vllm:absent_total") == 0.0


def test_profile_step_attach_refuses_a_state_without_engines(tmp_path, capsys):
    from bench.profile_step import main, table

    state = tmp_path / "state.json"
    state.write_text(json.dumps({"res": {}, "live": [{"name": "plain", "url": "http://127.0.0.1:9", "pid": 1}]}))
    fake_spy = tmp_path / "py-spy"
    fake_spy.write_text("")
    assert main(["--attach", str(state), "--engines", "ngram", "--py-spy", str(fake_spy)]) == 2
    assert "no engine up" in capsys.readouterr().err
    t = table({"plain": {"rate": 100, "steps": 50, "wall_s": 10.0, "components": {"model forward": 300, "other": 100}}})
    assert "| model forward | 60.000 | 75.0% |" in t and "| steps/s | 5.0 |" in t


def test_profile_step_runs_the_engines_in_the_order_asked(tmp_path, monkeypatch, capsys):
    """The engines are profiled one after the other; --spec-first swaps them, so that a drift
    of the host is told from a difference between the engines."""
    from bench import profile_step

    fake_spy = tmp_path / "py-spy"
    fake_spy.write_text("")
    order: list[str] = []

    workloads: list[str] = []

    def fake_profile(extra, clients, seconds, rate, out, py_spy, workload):
        order.append("plain" if extra[1] == "0" else "spec")
        workloads.append(workload)
        return {"rate": rate, "steps": 10, "wall_s": 1.0, "components": {"model forward": 50}}

    monkeypatch.setattr(profile_step, "profile", fake_profile)
    for flag, want in (([], ["plain", "spec"]), (["--spec-first"], ["spec", "plain"])):
        order.clear()
        assert profile_step.main(["--py-spy", str(fake_spy), "--out", str(tmp_path / "o"), *flag]) == 0
        assert order == want
    assert "| component | ngram K=0: ms/step" in capsys.readouterr().out  # columns in the order run
    assert set(workloads) == {"chat"}  # the default
    workloads.clear()
    assert profile_step.main(["--py-spy", str(fake_spy), "--out", str(tmp_path / "o"), "--workload", "code"]) == 0
    assert workloads == ["code", "code"]
    with pytest.raises(SystemExit) as bad:  # a workload that does not exist: refused before any engine starts
        profile_step.main(["--py-spy", str(fake_spy), "--workload", "poetry"])
    assert bad.value.code == 2 and workloads == ["code", "code"]


def test_profile_components_name_the_speculators_and_the_hook():
    from bench.profile_step import component_of

    v2 = "run_busy_loop (vllm/v1/engine/core.py:1);sample_tokens (vllm/v1/worker/gpu/model_runner.py:2);"
    assert component_of(v2 + "propose (vllm/v1/worker/gpu/spec_decode/ngram/speculator.py:267)") == "n-gram proposer"
    assert component_of("schedule (engine_host/scheduler.py:355);observe (engine_host/controller.py:714)") == (
        "SpecPilot hook and controller"
    )
    assert component_of(v2 + "propose (vllm/v1/worker/gpu/spec_decode/draft_model/speculator.py:9)") == (
        "draft-model / EAGLE speculator"
    )
    ar = v2 + "propose (vllm/v1/worker/gpu/spec_decode/standalone_ar/speculator.py:404);"
    # the draft model's own forward, under the V2 speculator, counts as the speculator's
    assert component_of(ar + "forward (vllm/model_executor/models/qwen2.py:300)") == "draft-model / EAGLE speculator"
    assert component_of(v2 + "forward (vllm/model_executor/models/qwen2.py:300)") == "model forward"
    assert component_of("main (x.py:1)") == "other"


def test_profile_components_leave_vllm_work_under_a_specpilot_wrapper_to_vllm():
    """A SpecPilot frame counts as SpecPilot's only where it is the innermost frame of vLLM or
    SpecPilot: the patch wrapping the model runner's sample_tokens, or the hook's super() call
    into vLLM's scheduler, does not take the vLLM work under it; the step trace has its own row."""
    from bench.profile_step import component_of

    core = "run_busy_loop (vllm/v1/engine/core.py:1);step_with_batch_queue (vllm/v1/engine/core.py:750);"
    wrapped = (
        core
        + "sample_tokens (engine_host/vllm_patches.py:1505);sample_tokens (vllm/v1/worker/gpu/model_runner.py:2232);"
    )
    assert component_of(wrapped + "async_copy_to_np (vllm/v1/worker/gpu/async_utils.py:274)") == "other"
    assert component_of(wrapped + "gumbel_sample (vllm/v1/worker/gpu/sample/sampler.py:80)") == (
        "sampler / rejection sampler"
    )
    hook = core + "_SpecPilotHook.schedule (engine_host/scheduler.py:586);"
    assert component_of(hook + "Scheduler.schedule (vllm/v1/core/sched/scheduler.py:300)") == "scheduler"
    assert component_of(hook + "StepClock.scheduled (engine_host/step_clock.py:49)") == "SpecPilot hook and controller"
    # SpecPilot's own frame with library code (numpy, the time module) below it is still SpecPilot's
    assert component_of(hook + "teaches (engine_host/step_clock.py:108);_amax (numpy/_core/_methods.py:41)") == (
        "SpecPilot hook and controller"
    )
    out = core + "_SpecPilotHook.update_from_output (engine_host/scheduler.py:913);"
    trace = "SpecPilot step trace (benchmarks only)"
    assert component_of(out + "_SpecPilotHook._trace_row (engine_host/scheduler.py:1084)") == trace
    assert component_of(out + "_trace_row (engine_host/scheduler.py:1084);add (engine_host/step_trace.py:163)") == trace
    # vLLM's own update under the hook's super() call: where it goes in plain vLLM's stacks
    vllm_update = "Scheduler.update_from_output (vllm/v1/core/sched/scheduler.py:1200)"
    assert component_of(out + vllm_update) == component_of(core + vllm_update) == "output / bookkeeping"


def test_profile_step_samples_the_api_server_beside_the_engine_core(tmp_path):
    """With --attach the API server's process is sampled too and reported on its own (vLLM's
    front end and SpecPilot's plugins run there); the engine core is still the model's process."""
    import stat

    from bench.profile_step import _sample, reread, table

    api, core = 4242, 4243
    spy = tmp_path / "py-spy"
    spy.write_text(
        "#!/bin/sh\n"  # writes each process's samples where it is told (-p PID ... -o FILE)
        'while [ $# -gt 0 ]; do case "$1" in -p) p=$2; shift;; -o) o=$2; shift;; esac; shift; done\n'
        f'if [ "$p" = {api} ]; then\n'
        '  echo "loop (asyncio/base_events.py:1);record (engine_host/stats.py:203) 7" > "$o"\n'
        '  echo "loop (asyncio/base_events.py:1);process_outputs (vllm/v1/engine/output_processor.py:9) 5" >> "$o"\n'
        '  echo "loop (asyncio/base_events.py:1);select (selectors.py:1) 3" >> "$o"\n'
        "else\n"
        '  echo "busy (vllm/v1/engine/core.py:1);forward (vllm/model_executor/models/qwen2.py:300) 30" > "$o"\n'
        "fi\n"
    )
    spy.chmod(spy.stat().st_mode | stat.S_IEXEC)
    res = _sample([api, core], 1, 100, tmp_path, "f0", str(spy), frontend=api)
    assert res["pid"] == core and res["components"] == {"model forward": 30}
    assert res["frontend"] == {
        "pid": api,
        "components": {
            "SpecPilot (stat logger, endpoints, plugins)": 7,
            "vLLM output processing and detokenization": 5,
            "other": 3,
        },
    }
    results = {"f0": {"steps": 10, "rate": 100, **res}}
    t = table(results)
    assert "API server process" in t and "| SpecPilot (stat logger, endpoints, plugins) | 7.000 | 46.7% |" in t
    (tmp_path / "profile.json").write_text(json.dumps(results))
    assert reread(tmp_path)["f0"]["frontend"]["components"]["other"] == 3  # counted again from its raw file


def test_profile_step_report_counts_an_earlier_runs_raw_samples_again(tmp_path, capsys):
    import lzma

    from bench.profile_step import main

    run = tmp_path / "run"
    run.mkdir()
    stale = {"SpecPilot hook and controller": 100}  # what an older attribution put on record
    results = {
        "f0": {"steps": 10, "rate": 100, "wall_s": 2.0, "pid": 7, "components": stale},
        "plain": {"steps": 10, "rate": 100, "wall_s": 2.0, "pid": 8, "components": {"other": 50}},
    }
    (run / "profile.json").write_text(json.dumps(results))
    wrapped = "core (vllm/v1/engine/core.py:1);sample_tokens (engine_host/vllm_patches.py:1);"
    raw = (
        f"{wrapped}gumbel_sample (vllm/v1/worker/gpu/sample/sampler.py:80) 60\n"
        "x (vllm/v1/engine/core.py:1);update_from_output (engine_host/scheduler.py:903) 40\n"
        "a line cut short (vllm/x.py:1);\n"
    )
    (run / "pyspy-f0-7.txt.xz").write_bytes(lzma.compress(raw.encode()))  # packed, as the results folders keep them
    assert main(["--report", str(run)]) == 0
    out = capsys.readouterr().out
    # 60 samples of vLLM's sampler under the wrapper and 40 of the hook's own, of 10 steps at 100 Hz
    assert "| sampler / rejection sampler | 0.000 | 0.0% | 60.000 | 60.0% |" not in out  # columns: f0 first
    assert "| sampler / rejection sampler | 60.000 | 60.0% | 0.000 | 0.0% |" in out
    assert "| SpecPilot hook and controller | 40.000 | 40.0% | 0.000 | 0.0% |" in out
    assert "| other | 0.000 | 0.0% | 50.000 | 100.0% |" in out  # no raw file: the counts on record
    assert main(["--report", str(tmp_path / "nothing-here")]) == 2
    assert "profile.json" in capsys.readouterr().err


def test_matrix_against_an_engine_that_is_not_up_says_so(tmp_path, capsys):
    import socket

    from bench.__main__ import main

    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    url = f"http://127.0.0.1:{port}"
    rc = main(["matrix", "--url", url, "--workloads", "code", "--loads", "low", "--modes", "fixed:0",
               "--out", str(tmp_path / "out"), "--no-png", "--quiet"])  # fmt: skip
    assert rc == 2
    err = capsys.readouterr().err
    assert f"cannot reach http://127.0.0.1:{port}/" in err and "--start-engine" in err
    assert "Traceback" not in err


def test_matrix_jobs_interleave_rounds_and_put_plain_beside_the_modes(tmp_path):
    from types import SimpleNamespace

    from bench.__main__ import matrix_jobs

    def cell(w, ld, m):
        return SimpleNamespace(label=f"{w}-{ld}-{m}", mode=m)

    groups = [("code", "low"), ("chat", "low")]
    # both engines up: one phase; each group's rounds run back to back, the even round reversed,
    # and the plain cell sits inside every round of its group
    (phase,) = matrix_jobs(groups, ["adaptive", "fixed:0"], cell, tmp_path, rounds=2, plain=True, together=True)
    got = [(j.engine, j.spec.label, j.out.name) for j in phase]
    assert got == [
        ("spec", "code-low-adaptive", "round-1"),
        ("spec", "code-low-fixed:0", "round-1"),
        ("plain", "code-low-plain", "round-1"),
        ("plain", "code-low-plain", "round-2"),
        ("spec", "code-low-fixed:0", "round-2"),
        ("spec", "code-low-adaptive", "round-2"),
        ("spec", "chat-low-adaptive", "round-1"),
        ("spec", "chat-low-fixed:0", "round-1"),
        ("plain", "chat-low-plain", "round-1"),
        ("plain", "chat-low-plain", "round-2"),
        ("spec", "chat-low-fixed:0", "round-2"),
        ("spec", "chat-low-adaptive", "round-2"),
    ]
    # engines one after the other: the plain engine's cells come in a second phase
    spec_phase, plain_phase = matrix_jobs(groups, ["adaptive"], cell, tmp_path, rounds=2, plain=True)
    assert {j.engine for j in spec_phase} == {"spec"} and len(spec_phase) == 4
    assert [(j.spec.label, j.out.name) for j in plain_phase] == [
        ("code-low-plain", "round-1"),
        ("code-low-plain", "round-2"),
        ("chat-low-plain", "round-1"),
        ("chat-low-plain", "round-2"),
    ]
    # one round writes into the folder itself, as before
    (one,) = matrix_jobs(groups, ["adaptive"], cell, tmp_path, rounds=1)
    assert {j.out for j in one} == {tmp_path}
    with pytest.raises(ValueError):
        matrix_jobs(groups, ["adaptive"], cell, tmp_path, rounds=0)


def test_matrix_jobs_shuffle_the_modes_of_every_round_from_the_seed(tmp_path):
    """``--order shuffle``: each (group, round) runs every mode once, in an order drawn from
    the seed: the same for the same seed, not the alternating one in every round."""
    from types import SimpleNamespace

    from bench.__main__ import matrix_jobs

    def cell(w, ld, m):
        return SimpleNamespace(label=f"{w}-{ld}-{m}", mode=m)

    groups = [("chat", "low"), ("code", "low")]
    modes = ["adaptive", "adaptive:0-0", "adaptive_step", "fixed:0"]

    def orders(seed):
        (phase,) = matrix_jobs(
            groups, modes, cell, tmp_path, rounds=6, plain=True, together=True, order="shuffle", seed=seed
        )
        by_round: dict[tuple[str, str], list[str]] = {}
        for j in phase:
            by_round.setdefault((j.spec.label.split("-")[0], j.out.name), []).append(j.spec.mode)
        return by_round

    a = orders(0)
    assert len(a) == 12
    assert all(sorted(v) == sorted(modes + ["plain"]) for v in a.values())  # every mode once per round
    assert a == orders(0)  # reproducible
    assert a != orders(1)
    alternate = [modes + ["plain"], list(reversed(modes + ["plain"]))]
    assert any(v not in alternate for v in a.values())
    assert len({tuple(v) for v in a.values()}) > 2
    with pytest.raises(ValueError):
        matrix_jobs(groups, modes, cell, tmp_path, rounds=2, order="random")


def test_hook_cost_drives_the_real_hook_and_reports_per_step(capsys):
    from bench.hook_cost import main, measure

    r = measure("fixed:4", 2, 300)
    assert 0 < r["hook_clock_us_per_step"] <= r["us_per_step"]
    # the engine-core thread's CPU time inside the same spans: recorded, and not beyond their wall time
    assert 0 < r["hook_cpu_us_per_step"] <= r["hook_clock_us_per_step"] * 1.05 + 0.5
    assert measure("adaptive", 1, 300)["hook_clock_us_per_step"] > 0
    assert r["verify_us_per_step"] > 0  # vLLM's per-request call at K > 0, timed apart
    assert measure("fixed:0", 2, 100)["verify_us_per_step"] == 0.0
    cold = measure("fixed:4", 1, 50, cold_mib=1)  # caches made cold between steps; only the steps timed
    assert 0 < cold["hook_clock_us_per_step"] <= cold["us_per_step"]
    assert main(["--modes", "fixed:0", "--batch", "1", "--steps", "10", "--cold", "-1"]) == 2
    assert "--cold needs MiB >= 0" in capsys.readouterr().err
    assert main(["--modes", "fixed:0", "--batch", "1", "--steps", "100"]) == 0
    assert "| fixed:0 | 1 |" in capsys.readouterr().out
    assert main(["--modes", "nonsense", "--batch", "1", "--steps", "10"]) == 2
    assert "unknown mode" in capsys.readouterr().err
    # accepted drafts: the adaptive policy drafts, and its path at K > 0 is what is timed
    assert measure("adaptive", 1, 600)["mean_k"] < 0.5  # nothing accepted: it holds K at 0
    assert measure("adaptive", 1, 600, async_scheduling=True, acceptance=0.9)["mean_k"] > 2.0
    assert main(["--modes", "adaptive", "--batch", "1", "--steps", "10", "--acceptance", "1.5"]) == 2
    assert "--acceptance needs a fraction in 0..1" in capsys.readouterr().err
    # a stream of requests: each finishes after --turnover steps and a new one takes its place
    r = measure("adaptive", 8, 400, async_scheduling=True, acceptance=0.6, turnover=40)
    assert r["requests_finished"] == pytest.approx(8 * 600 / 40, abs=8)  # warm-up steps included
    assert measure("adaptive", 8, 100)["requests_finished"] == 0
    assert main(["--modes", "adaptive", "--batch", "1", "--steps", "10", "--turnover", "-1"]) == 2
    assert "--turnover needs steps >= 0" in capsys.readouterr().err


def test_matrix_refuses_bad_rounds_and_side_by_side_without_plain(tmp_path, capsys):
    from bench.__main__ import main

    out = tmp_path / "out"
    base = ["matrix", "--url", "http://127.0.0.1:9", "--workloads", "code", "--loads", "low", "--modes", "fixed:0",
            "--out", str(out), "--no-png", "--quiet"]  # fmt: skip
    assert main([*base, "--rounds", "0"]) == 2
    assert "--rounds must be >= 1" in capsys.readouterr().err
    assert main([*base, "--side-by-side"]) == 2
    assert "add --plain-baseline" in capsys.readouterr().err
    assert not out.exists()  # refused before anything was written


def test_cpu_pairs_names_the_cpus_that_slow_a_cpu_down(tmp_path, capsys):
    from bench import cpu_pairs

    rows = [
        {"cpu": 13, "busy": 5, "slowdown": 1.41, "alone_per_s": 1},
        {"cpu": 13, "busy": 6, "slowdown": 1.02, "alone_per_s": 1},
        {"cpu": 15, "busy": 5, "slowdown": 0.98, "alone_per_s": 1},
    ]
    assert cpu_pairs.siblings(rows, 1.15) == {13: [5], 15: []}
    assert cpu_pairs.main(["--cpus", str(10**5)]) == 2
    assert "no such CPU" in capsys.readouterr().err
    out = tmp_path / "pairs.json"
    assert cpu_pairs.main(["--cpus", "0", "--seconds", "0.02", "--out", str(out)]) == 0
    doc = json.loads(out.read_text())
    assert doc["cpus"] == [0] and {r["busy"] for r in doc["rows"]} == set(range(os.cpu_count() or 1)) - {0}
    assert "| 0 |" in capsys.readouterr().out


def test_cpu_idle_reports_each_way_of_spending_the_gap(tmp_path, capsys):
    from bench import cpu_idle

    rows = [{"mode": "sleep", "per_s": v} for v in (5, 10, 10, 10)] + [{"mode": "spin", "per_s": v} for v in (10, 10)]
    table = {t["mode"]: t for t in cpu_idle.summary(rows)}
    assert table["sleep"]["bursts"] == 4 and table["sleep"]["slow_share"] == 0.25
    assert table["spin"]["slow_share"] == 0.0 and table["spin"]["median"] == 10
    assert cpu_idle.main(["--cpu", "0", "--modes", "nap"]) == 2
    assert "unknown mode" in capsys.readouterr().err
    assert cpu_idle.main(["--cpu", str(10**5)]) == 2
    out = tmp_path / "idle.json"
    assert (
        cpu_idle.main(["--cpu", "0", "--bursts", "2", "--burst-s", "0.01", "--gap", "0,0.01", "--out", str(out)]) == 0
    )
    doc = json.loads(out.read_text())
    assert sorted(r["mode"] for r in doc["rows"]) == sorted(list(cpu_idle.MODES) * 2)
    assert "| idle-spinner | 2 |" in capsys.readouterr().out


def test_a_probe_spinner_ends_with_its_parent_even_when_it_is_killed(tmp_path):
    """``bench.cpu_spin.Spinner`` (cpu-pairs, cpu-idle): its busy child must not outlive a
    probe killed with SIGKILL."""
    import signal
    import subprocess
    import time

    code = (
        "import os, sys, time\n"
        "from bench.cpu_spin import Spinner\n"
        "s = Spinner(sorted(os.sched_getaffinity(0))[0], idle=True)\n"
        "print(s.process.pid, flush=True)\n"
        "time.sleep(60)\n"
    )
    probe = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    assert probe.stdout is not None
    child = int(probe.stdout.readline())
    status = f"/proc/{child}/status"
    assert "State:\tZ" not in open(status).read()  # spinning
    probe.send_signal(signal.SIGKILL)
    probe.wait(10)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        try:
            state = open(status).read()
        except FileNotFoundError:
            break
        if "State:\tZ" in state:  # ended; not yet reaped by whoever adopted it
            break
        time.sleep(0.05)
    else:
        os.kill(child, signal.SIGKILL)
        raise AssertionError(f"the spinner {child} outlived its killed parent by 10 s")


def test_stat_logger_cost_prints_a_row_per_batch_and_refuses_bad_batches(capsys):
    from bench import stat_logger_cost

    assert stat_logger_cost.main(["--batch", "1,16", "--steps", "20", "--repeat", "1"]) == 0
    rows = [
        line for line in capsys.readouterr().out.splitlines() if line.startswith("| 1 |") or line.startswith("| 16 |")
    ]
    assert len(rows) == 2 and all(len(r.split("|")) == 7 for r in rows)
    assert stat_logger_cost.main(["--batch", "0"]) == 2
    assert stat_logger_cost.main(["--batch", "x"]) == 2
    assert "--batch" in capsys.readouterr().err
