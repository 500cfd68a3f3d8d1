"""From Prometheus text to samples: prometheus-client's parser, histogram bucket deltas
and quantiles, windowed percentiles, acceptance, counter resets, roll-ups."""

from __future__ import annotations

import math

import pytest

from control.metrics_parse import (
    bucket_delta,
    decode_buckets,
    encode_buckets,
    merge_buckets,
    parse_metrics,
    quantile,
    select_families,
)
from control.sampling import FAMILIES, SampleBuilder, rollup
from tests.support import FakeEngineMetrics

TEXT = """# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="m"} 3.0
vllm:num_requests_running{engine="1",model_name="m"} 2.0
# HELP vllm:kv_cache_usage_perc KV-cache usage. 1 means 100 percent usage.
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.2
vllm:kv_cache_usage_perc{engine="1",model_name="m"} 0.4
# HELP vllm:generation_tokens_total Number of generation tokens processed.
# TYPE vllm:generation_tokens_total counter
vllm:generation_tokens_total{engine="0",model_name="m"} 100.0
vllm:generation_tokens_created{engine="0",model_name="m"} 1.7e+09
# HELP vllm:spec_decode_num_accepted_tokens_per_pos_total Accepted tokens per draft position.
# TYPE vllm:spec_decode_num_accepted_tokens_per_pos_total counter
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="m",position="0"} 7.0
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="m",position="1"} 3.0
# HELP vllm:time_to_first_token_seconds Histogram of time to first token in seconds.
# TYPE vllm:time_to_first_token_seconds histogram
vllm:time_to_first_token_seconds_bucket{engine="0",le="0.04",model_name="m"} 0.0
vllm:time_to_first_token_seconds_bucket{engine="0",le="0.06",model_name="m"} 4.0
vllm:time_to_first_token_seconds_bucket{engine="0",le="0.1",model_name="m"} 4.0
vllm:time_to_first_token_seconds_bucket{engine="0",le="+Inf",model_name="m"} 5.0
vllm:time_to_first_token_seconds_count{engine="0",model_name="m"} 5.0
vllm:time_to_first_token_seconds_sum{engine="0",model_name="m"} 0.4
# HELP specpilot:speculation_mode_info Speculation mode in force (1 for the mode).
# TYPE specpilot:speculation_mode_info gauge
specpilot:speculation_mode_info{mode="adaptive"} 1.0
# HELP other_metric Not read by the collector.
# TYPE other_metric gauge
other_metric 42.0
"""


def test_parser_sums_over_engines_averages_fractions_and_drops_created():
    snap = parse_metrics(TEXT)
    assert snap.value("vllm:num_requests_running") == 5.0
    assert snap.value("vllm:kv_cache_usage_perc") == pytest.approx(0.3)
    assert snap.value("vllm:generation_tokens_total") == 100.0
    assert not any(name.endswith("_created") for name, _ in snap.series)
    assert snap.by_label("vllm:spec_decode_num_accepted_tokens_per_pos_total", "position") == {"0": 7.0, "1": 3.0}
    assert snap.by_label("specpilot:speculation_mode_info", "mode") == {"adaptive": 1.0}
    assert snap.histogram("vllm:time_to_first_token_seconds") == {0.04: 0.0, 0.06: 4.0, 0.1: 4.0, math.inf: 5.0}


def test_reading_only_the_needed_families_gives_the_same_values():
    full = parse_metrics(TEXT)
    part = parse_metrics(TEXT, FAMILIES)
    assert part.value("other_metric") is None and full.value("other_metric") == 42.0
    assert all(full.series[k] == v for k, v in part.series.items())
    assert "other_metric" not in select_families(TEXT, FAMILIES)


def test_malformed_metrics_text_is_an_error():
    with pytest.raises(ValueError):
        parse_metrics("vllm:x{broken 1\n")


def test_bucket_delta_keeps_lower_edges_and_detects_resets():
    old = {0.04: 0.0, 0.06: 4.0, 0.1: 4.0, math.inf: 5.0}
    new = {0.04: 1.0, 0.06: 5.0, 0.1: 8.0, math.inf: 9.0}
    assert bucket_delta(new, old) == {(0.0, 0.04): 1.0, (0.06, 0.1): 3.0}
    assert bucket_delta(old, None) == {(0.04, 0.06): 4.0, (0.1, math.inf): 1.0}
    assert bucket_delta(old, new) == {}  # counts went down: engine restart


def test_quantile_interpolates_inside_the_bucket_like_promql():
    b = {(0.04, 0.06): 4.0}
    assert quantile(0.5, b) == pytest.approx(0.05)
    assert quantile(1.0, b) == pytest.approx(0.06)
    two = {(0.0, 0.1): 50.0, (0.1, 0.2): 50.0}
    assert quantile(0.5, two) == pytest.approx(0.1)
    assert quantile(0.99, two) == pytest.approx(0.198)
    assert quantile(0.99, {(0.0, 0.1): 1.0, (10.0, math.inf): 99.0}) == 10.0  # +Inf: the last finite edge
    assert quantile(0.5, {}) is None


def test_buckets_survive_json_and_merge():
    a = {(0.04, 0.06): 2.0, (10.0, math.inf): 1.0}
    assert decode_buckets(encode_buckets(a)) == a
    assert merge_buckets([a, {(0.04, 0.06): 1.0}]) == {(0.04, 0.06): 3.0, (10.0, math.inf): 1.0}


def _feed(builder: SampleBuilder, m: FakeEngineMetrics, t: float):
    return builder.feed(parse_metrics(m.text(), FAMILIES), t)


def test_sample_rows_have_throughput_windowed_percentiles_and_acceptance():
    m = FakeEngineMetrics(k_max=4)
    b = SampleBuilder(window_s=3.0)
    assert _feed(b, m, 1000.0) is None  # the first scrape is the baseline
    m.serve(
        requests=2,
        output_tokens=50,
        ttft_s=0.3,
        itl_s=0.03,
        queue_s=0.7,
        drafts=10,
        draft_tokens=30,
        accepted=20,
        accepted_per_pos=[8, 6, 4, 2],
        draft_tokens_per_pos=[10, 10, 5, 5],
    )  # half the drafts stopped after 2 tokens
    m.running.set(2)
    m.kv.set(0.5)
    m.k.set(4)
    row = _feed(b, m, 1001.0)
    assert row["t"] == 1000 and row["covered_s"] == 1.0 and row["busy_s"] == 1.0
    assert row["output_tokens"] == 100 and row["output_tokens_per_s"] == 100.0
    assert row["requests_finished"] == 2 and row["prompt_tokens"] == 40
    assert 250 < row["ttft_p50_ms"] <= 500 and 500 < row["queue_p99_ms"] <= 750
    assert row["itl_p50_ms"] == pytest.approx(30.0)  # all ITLs in the (0.02, 0.04] bucket -> midpoint
    assert row["acceptance_rate"] == round(20 / 30, 4)
    # accepted_j / draft_tokens_j: not accepted_j / drafts (0.4, 0.2 at positions 3 and 4)
    assert row["acceptance_per_position"] == [0.8, 0.6, 0.8, 0.4]
    assert (row["kv_cache_usage"], row["running"], row["k"], row["mode"]) == (0.5, 2, 4, "fixed")
    # Later seconds with fast requests: the slow ones stay in the window (3 s), then leave it.
    m.running.set(0)
    for t in (1002.0, 1003.0):
        m.serve(requests=1, ttft_s=0.05)
        row = _feed(b, m, t)
        assert row["ttft_p99_ms"] > 250
    m.serve(requests=1, ttft_s=0.05)
    row = _feed(b, m, 1004.0)
    assert row["ttft_p99_ms"] <= 60 and row["acceptance_rate"] is None  # no drafts in the window any more


def test_idle_seconds_are_not_busy_and_have_no_latency():
    m = FakeEngineMetrics()
    b = SampleBuilder()
    _feed(b, m, 10.0)
    row = _feed(b, m, 11.0)
    assert row["busy_s"] == 0.0 and row["output_tokens_per_s"] == 0.0
    assert row["ttft_p99_ms"] is None and row["hist"] is None


def test_counter_reset_or_new_engine_start_gives_no_sample_then_starts_over():
    m = FakeEngineMetrics(started_at=100.0)
    b = SampleBuilder()
    _feed(b, m, 1.0)
    m.serve(requests=3)
    assert _feed(b, m, 2.0)["output_tokens"] == 150
    m2 = FakeEngineMetrics(started_at=200.0)  # the engine restarted: counters from zero
    assert _feed(b, m2, 3.0) is None
    m2.serve(requests=1)
    assert _feed(b, m2, 4.0)["output_tokens"] == 50


def test_rollup_sums_weights_and_merges_histograms_exactly():
    m = FakeEngineMetrics(k_max=2)
    b = SampleBuilder(window_s=1.0)
    _feed(b, m, 0.0)
    rows = []
    for i, (ttft, kv, k) in enumerate([(0.05, 0.2, 0), (0.3, 0.6, 2), (0.05, 0.4, 2)], start=1):
        m.serve(
            requests=2,
            ttft_s=ttft,
            drafts=4,
            draft_tokens=8,
            accepted=6,
            accepted_per_pos=[4, 2],
            draft_tokens_per_pos=[4, 4],
        )
        m.kv.set(kv)
        m.k.set(k)
        rows.append(_feed(b, m, float(i)))
    up = rollup(rows, 60, 0)
    assert up["resolution_s"] == 60 and up["t"] == 0
    assert up["output_tokens"] == 300 and up["covered_s"] == 3.0 and up["output_tokens_per_s"] == 100.0
    assert up["kv_cache_usage"] == pytest.approx(0.4) and up["kv_cache_usage_max"] == 0.6
    assert up["k"] == pytest.approx(4 / 3, abs=1e-3)
    assert up["acceptance_rate"] == 0.75 and up["acceptance_per_position"] == [1.0, 0.5]
    merged = merge_buckets(decode_buckets(r["hist"]["ttft"]) for r in rows)
    assert up["ttft_p99_ms"] == pytest.approx(quantile(0.99, merged) * 1000, abs=1e-3)
    assert 250 < up["ttft_p99_ms"] <= 500 and up["ttft_p50_ms"] <= 60
    again = rollup([up], 3600, 0)  # roll-ups of roll-ups keep the same figures
    for col in ("output_tokens", "ttft_p99_ms", "acceptance_rate", "kv_cache_usage", "kv_cache_usage_max"):
        assert again[col] == pytest.approx(up[col])
    assert rollup([], 60, 0) is None
