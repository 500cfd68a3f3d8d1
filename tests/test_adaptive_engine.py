"""Adaptive speculation on the real engine (CPU, eager): K follows the traffic, and
every baseline mode runs on the same engine and reports its K."""

from __future__ import annotations

import concurrent.futures as cf
import time

import httpx
import pytest

from bench.workloads import prompt_pool

pytestmark = pytest.mark.engine

MODEL = "SmolLM2-135M-Instruct"
# Copy-style traffic: a cycle repeated in the prompt, which a greedy model continues and
# the n-gram proposer predicts from the prompt, so deep drafts are accepted.
COPY_PROMPTS = [
    "red apple, green pear, yellow banana, purple plum, orange mango, " * 4,
    "The quick brown fox jumps over the lazy dog. " * 4,
    "def add(a, b):\n    return a + b\n\n" * 4,
]


def _drive(engine_host, bodies: list[dict], seconds: float, concurrency: int = 4) -> int:
    """Send requests round-robin for ``seconds``; returns the completion tokens received."""
    t_end = time.monotonic() + seconds
    tokens = 0

    def worker(i: int) -> int:
        n, j = 0, i
        with httpx.Client(base_url=engine_host.url, timeout=120) as c:
            while time.monotonic() < t_end:
                body = bodies[j % len(bodies)]
                path = "/v1/chat/completions" if "messages" in body else "/v1/completions"
                r = c.post(path, json=body)
                r.raise_for_status()
                n += r.json()["usage"]["completion_tokens"]
                j += 1
        return n

    with cf.ThreadPoolExecutor(concurrency) as pool:
        for n in pool.map(worker, range(concurrency)):
            tokens += n
    return tokens


def _spec_counters(engine_host) -> dict[str, float]:
    """vLLM's speculative-decoding counters from ``/metrics``: drafts and accepted at position 0."""
    from prometheus_client.parser import text_string_to_metric_families

    out = {"drafts": 0.0, "pos0": 0.0}
    for fam in text_string_to_metric_families(httpx.get(engine_host.url + "/metrics", timeout=30).text):
        for s in fam.samples:
            if s.name == "vllm:spec_decode_num_drafts_total":
                out["drafts"] += s.value
            elif s.name == "vllm:spec_decode_num_accepted_tokens_per_pos_total" and s.labels.get("position") == "0":
                out["pos0"] += s.value
    return out


def _steps_delta(before: list[int], after: list[int]) -> list[int]:
    return [a - b for a, b in zip(after, before)]


def _mean_k(steps: list[int]) -> float:
    total = sum(steps)
    return sum(k * n for k, n in enumerate(steps)) / total if total else 0.0


def test_copy_traffic_drives_adaptive_k_up(engine_host, control, restore_config):
    r = control.put("/control/config", json={"speculation": {"mode": "adaptive", "k_min": 0, "k_max": 8}})
    assert r.status_code == 200, r.text
    c0 = _spec_counters(engine_host)
    bodies = [
        {"model": MODEL, "prompt": p, "max_tokens": 64, "temperature": 0, "ignore_eos": True} for p in COPY_PROMPTS
    ]
    # where K goes under copy traffic, not how fast it gets there: the first seconds (the
    # estimates still at their priors, K low) are left out of the steps counted. One CI run
    # on a slow 2-core machine got only 83 steps in a 14 s window that began with them, 27
    # of them at K <= 2 from the start (mean K 2.6), the policy's K then at 4.
    _drive(engine_host, bodies, seconds=5)
    before = control.get("/control/state").json()["controller"]["steps_at_k"]
    _drive(engine_host, bodies, seconds=12)
    st = control.get("/control/state").json()
    c1 = _spec_counters(engine_host)
    steps = _steps_delta(before, st["controller"]["steps_at_k"])
    assert st["speculation"]["mode"] == "adaptive"
    assert _mean_k(steps) >= 3.0, f"steps at K = 0..8: {steps}; policy: {st['controller']['policy']}"
    # Not asserted: the policy's K at the end. Its last observations are most likely the
    # drain tail (one request left, generating past the copied text with ignore_eos, where
    # drafts stop being accepted), so K = 0 there is right; one CI run saw k_best 0 at batch
    # size 1 after a mean K above 3 over the traffic.
    # the controller's estimate agrees with vLLM's own counters: first-position
    # acceptance of a draft = r_1 / q_1 (per decode request-step) against
    # accepted_per_pos[0] / drafts over the same traffic
    ctl = st["controller"]
    est = ctl["acceptance_per_position"][0] / ctl["draft_reach_per_position"][0]
    measured = (c1["pos0"] - c0["pos0"]) / (c1["drafts"] - c0["drafts"])
    assert abs(est - measured) < 0.25, (est, measured)
    # E(8) at the end, after the drain tail (batch 1, no draft accepted) that the change
    # detector may already have read as a drop: still clearly above one token per step
    # (one run ended at 1.287), where chat traffic stays near 1.0.
    assert ctl["expected_tokens_per_step"]["8"] > 1.2, ctl


def test_open_ended_sampled_traffic_drives_k_to_at_most_1(engine_host, control, restore_config):
    r = control.put("/control/config", json={"speculation": {"mode": "adaptive", "k_min": 0, "k_max": 8}})
    assert r.status_code == 200, r.text
    chat = [p for p in prompt_pool("chat")][:16]
    bodies = [
        {"model": MODEL, "messages": p.messages, "max_tokens": 64, "temperature": 0.7, "seed": i, "ignore_eos": True}
        for i, p in enumerate(chat)
    ]
    _drive(engine_host, bodies, seconds=8)  # let the estimates follow the new traffic
    before = control.get("/control/state").json()["controller"]["steps_at_k"]
    _drive(engine_host, bodies, seconds=10)
    st = control.get("/control/state").json()
    steps = _steps_delta(before, st["controller"]["steps_at_k"])
    # most steps run at K <= 1; the rest are short explorations of other depths. Bursts have
    # a set length, so where a busy 2-core machine gives only ~130 steps in the window they
    # took 30 % of them once (91 of 129 at K <= 1): two thirds is the bar, not three quarters.
    # (The policy's K of the moment is not asserted: it is the K of the last step's batch, and
    # when one request is left, a step at K = 8 costs this CPU 5-12 % more than one at K = 0
    # (docs/benchmarks.md), so a lone request whose drafts were accepted now and then is rightly
    # given deep drafts.)
    assert sum(steps[:2]) >= 0.65 * sum(steps), (steps, st["controller"])


@pytest.mark.parametrize(
    "spec,expect_k",
    [
        ({"mode": "batch_table", "table": [[1, 2, 5], [3, 8, 1]]}, {5}),
        ({"mode": "threshold"}, {2}),
        ({"mode": "heuristic", "k_min": 1, "k_max": 6}, set(range(1, 7))),
        ({"mode": "fixed", "k": 3}, {3}),
        ({"mode": "off"}, {0}),
    ],
)
def test_each_baseline_mode_runs_and_reports_its_k(engine_host, control, restore_config, spec, expect_k):
    r = control.put("/control/config", json={"speculation": spec})
    assert r.status_code == 200, r.text
    before = control.get("/control/state").json()["controller"]["steps_at_k"]
    body = {"model": MODEL, "prompt": COPY_PROMPTS[0], "max_tokens": 24, "temperature": 0, "ignore_eos": True}
    assert httpx.post(engine_host.url + "/v1/completions", json=body, timeout=120).status_code == 200
    st = control.get("/control/state").json()
    assert st["speculation"]["mode"] == spec["mode"]
    assert st["controller"]["mode"] == spec["mode"]
    used = {k for k, n in enumerate(_steps_delta(before, st["controller"]["steps_at_k"])) if n > 0}
    assert used and used <= expect_k, (used, expect_k)
    assert st["speculation"]["k_current"] in expect_k
    m = httpx.get(engine_host.url + "/metrics").text
    assert f'specpilot:speculation_mode_info{{mode="{spec["mode"]}"}} 1.0' in m
