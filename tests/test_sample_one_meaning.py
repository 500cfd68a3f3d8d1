"""One sample, one meaning: the engine host's ring buffer and the collector build the same
figures from the same requests (user tokens/s, windowed latency percentiles on vLLM's
buckets, acceptance per position = accepted_j / draft_tokens_j)."""

from __future__ import annotations

import time
from types import SimpleNamespace as NS

import pytest
from prometheus_client import CollectorRegistry, generate_latest

from control.metrics_parse import parse_metrics
from control.sampling import FAMILIES, SampleBuilder
from engine_host.sample import Interval, Sample, SampleWindow, acceptance, bucket_of, latency_edges
from engine_host.stats import SampleRing


def _sched(drafts=0, draft_tokens=0, accepted=0, acc_pos=(), draft_pos=()):
    sd = NS(
        num_drafts=drafts,
        num_draft_tokens=draft_tokens,
        num_accepted_tokens=accepted,
        num_accepted_tokens_per_pos=list(acc_pos),
        num_draft_tokens_per_pos=list(draft_pos),
    )
    return NS(num_running_reqs=2, num_waiting_reqs=0, kv_cache_usage=0.25, spec_decoding_stats=sd)


def _iter(gen, ttft=(), itl=(), finished=(), internal_gen=0, internal_ttft=()):
    it = NS(
        num_generation_tokens=gen,
        num_prompt_tokens=10,
        time_to_first_tokens_iter=list(ttft),
        inter_token_latencies_iter=list(itl),
        finished_requests=list(finished),
    )
    if internal_gen or internal_ttft:
        it._specpilot_internal = {"ttft": set(internal_ttft), "itl": set(), "gen": internal_gen}
    return it


def test_acceptance_per_position_divides_by_draft_tokens_at_that_position():
    rate, per = acceptance(30, 20, [10, 10, 5, 5], [8, 6, 4, 2])
    assert rate == round(20 / 30, 4)
    assert per == [0.8, 0.6, 0.8, 0.4]
    assert acceptance(0, 0, [], []) == (None, None)
    assert acceptance(10, 5, None, [3, 2]) == (0.5, None)  # per-position drafts unknown: no guess
    assert acceptance(10, 5, [10, 0], [5, 0]) == (0.5, [0.5, None])


def test_bucket_of_uses_vllm_edges():
    edges = latency_edges("ttft")
    assert edges[:3] == [0.001, 0.005, 0.01]
    assert bucket_of(0.05, edges) == (0.04, 0.06)
    assert bucket_of(0.04, edges) == (0.02, 0.04)  # upper edge inclusive, as Prometheus' le
    assert bucket_of(1e6, edges)[1] == float("inf")
    with pytest.raises(KeyError):
        latency_edges("nope")


def test_window_counts_user_tokens_and_keeps_window_of_latencies():
    w = SampleWindow(window_s=2.0)
    s1 = w.add(
        Interval(t=0, covered_s=1.0, output_tokens=120, user_output_tokens=100, hist={"ttft": {(0.25, 0.5): 1.0}})
    )
    assert s1.output_tokens_per_s == 100.0 and s1.internal_output_tokens == 20
    assert 250 < s1.ttft_p50_ms <= 500
    s2 = w.add(Interval(t=1, covered_s=1.0, output_tokens=50))  # source without a user counter
    assert s2.output_tokens_per_s == 50.0 and s2.user_output_tokens is None
    assert s2.ttft_p50_ms is not None  # the slow request is still in the 2 s window
    assert w.add(Interval(t=2, covered_s=1.0)).ttft_p50_ms is None
    with pytest.raises(ValueError):
        Sample(t=0, covered_s=1.0, unknown_field=1)


def test_ring_and_collector_give_the_same_sample_for_the_same_requests():
    ring = SampleRing()
    base = int(time.time())
    ring._reset_bucket(base)
    reg = CollectorRegistry()

    class RingCollector:
        def collect(self):
            return ring.metric_families()

    reg.register(RingCollector())

    def scrape(gen, drafts, draft_tokens, accepted, acc_pos):
        vllm = (
            "# TYPE vllm:generation_tokens_total counter\n"
            f"vllm:generation_tokens_total {gen}\n"
            "# TYPE vllm:spec_decode_num_drafts_total counter\n"
            f"vllm:spec_decode_num_drafts_total {drafts}\n"
            "# TYPE vllm:spec_decode_num_draft_tokens_total counter\n"
            f"vllm:spec_decode_num_draft_tokens_total {draft_tokens}\n"
            "# TYPE vllm:spec_decode_num_accepted_tokens_total counter\n"
            f"vllm:spec_decode_num_accepted_tokens_total {accepted}\n"
            "# TYPE vllm:spec_decode_num_accepted_tokens_per_pos_total counter\n"
            + "".join(
                f'vllm:spec_decode_num_accepted_tokens_per_pos_total{{position="{i}"}} {n}\n'
                for i, n in enumerate(acc_pos)
            )
        )
        return parse_metrics(vllm + generate_latest(reg).decode(), FAMILIES)

    builder = SampleBuilder(window_s=10.0)
    assert builder.feed(scrape(0, 0, 0, 0, [0, 0]), base) is None
    # One second: a user request (TTFT 0.3 s, 3 ITLs) and a heartbeat (TTFT 2 s, 40 tokens).
    ring.record(
        _sched(drafts=10, draft_tokens=15, accepted=9, acc_pos=[7, 2], draft_pos=[10, 5]),
        _iter(
            gen=60,
            ttft=[0.3, 2.0],
            itl=[0.03, 0.03, 0.2],
            finished=[
                NS(request_id="user-1", e2e_latency=0.6, queued_time=0.01),
                NS(request_id="specpilot-heartbeat-1", e2e_latency=2.5, queued_time=0.0),
            ],
            internal_gen=40,
            internal_ttft=[1],
        ),
        now=base + 0.5,
    )
    collected = builder.feed(scrape(60, 10, 15, 9, [7, 2]), base + 1)
    [own] = ring.samples(now=base + 1.5)
    assert own["t"] == collected["t"] == base
    for col in (
        "output_tokens",
        "user_output_tokens",
        "output_tokens_per_s",
        "ttft_p50_ms",
        "ttft_p99_ms",
        "itl_p50_ms",
        "itl_p99_ms",
        "e2e_p50_ms",
        "queue_p99_ms",
        "acceptance_rate",
        "acceptance_per_position",
        "draft_tokens_per_pos",
        "accepted_per_pos",
    ):
        assert own[col] == collected[col], col
    assert own["output_tokens_per_s"] == 20.0  # the heartbeat's 40 tokens are not user throughput
    assert own["ttft_p99_ms"] < 500  # nor is its 2 s TTFT
    assert own["acceptance_per_position"] == [0.7, 0.4]
    assert set(own) == set(Sample.model_fields)


def test_ring_keeps_its_last_seconds_after_a_long_idle_spell():
    ring = SampleRing(seconds=5)
    base = int(time.time()) - 100_000
    ring._reset_bucket(base)
    ring.record(_sched(), _iter(gen=7), now=base + 0.5)
    calls = []
    ring.k_source = lambda: calls.append(1) or {"k_current": 2}
    out = ring.samples(now=base + 100_000.5)
    assert len(calls) <= 6  # not one sample built per idle second (100 000 of them)
    assert [s["t"] for s in out] == list(range(base + 99_995, base + 100_000))
    assert all(s["output_tokens"] == 0 for s in out)


def test_a_step_of_many_latencies_counts_as_each_alone_and_skips_internal_ones():
    """A full batch's step brings one ITL per request: counted at once, they fill the same
    buckets and sums as one by one, at the bucket edges and past the last one too, and the
    values of internal requests (warm-up, heartbeats) stay out."""
    edges = latency_edges("itl")
    values = [edges[0] / 2, edges[0], edges[3], edges[3] * 1.01, edges[-1], edges[-1] * 2, 0.0123, 0.0123]
    batched, single = SampleRing(), SampleRing()
    skip = {1, 5}
    it = _iter(len(values), itl=values)
    it._specpilot_internal = {"ttft": set(), "itl": skip, "gen": 2}
    batched.record(_sched(), it)
    for i, v in enumerate(values):
        if i not in skip:
            single._observe("itl", v)
    (counts_b, sum_b), (counts_s, sum_s) = batched.latency_totals["itl"], single.latency_totals["itl"]
    assert counts_b == counts_s and sum(counts_b.values()) == len(values) - len(skip)
    assert sum_b == pytest.approx(sum_s, rel=1e-12)
    assert batched._hist["itl"] == single._hist["itl"]
    lone = SampleRing()
    lone.record(_sched(), _iter(1, itl=[edges[2]]))  # one value: the single path
    assert lone.latency_totals["itl"] == ({bucket_of(edges[2], edges): 1.0}, edges[2])
