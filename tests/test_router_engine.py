"""The dual engine host on the real CPU engine: a plain and a speculative engine host
behind ``python -m engine_host.router``, driven over HTTP as a client would."""

from __future__ import annotations

import time

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

pytestmark = pytest.mark.engine

MODEL = "SmolLM2-135M-Instruct"
COPY = "red apple, green pear, yellow banana, purple plum, orange mango, " * 4


@pytest.fixture(scope="module")
def router(default_model, tmp_path_factory, artifacts_dir):
    from engine_host.process import RouterProcess

    home = tmp_path_factory.mktemp("router-home")
    rp = RouterProcess(
        model=default_model,
        env={"SPECPILOT_HOME": str(home)},
        extra_args=[
            "--speculation-mode",
            "fixed",
            "--p-start",
            "0.5",
            "--p-min",
            "0.5",
            "--p-max",
            "0.5",
            "--",
            "--enforce-eager",
            "--max-num-seqs",
            "4",
            "--max-model-len",
            "1024",
            "--warmup",
            "quick",
        ],
        log_path=artifacts_dir / "router.log",
    )
    rp.start()
    try:
        rp.wait_ready(timeout_s=600)
        yield rp
    finally:
        rp.stop()
    assert not rp.alive()


def _complete(url: str, n: int, max_tokens: int = 16) -> list[str]:
    """``n`` completions of ``max_tokens`` tokens each, one after another; the engine that
    answered each. Tests that only look at where requests go send short ones (4 tokens:
    still several per request, so each engine's TPOT is measured)."""
    engines = []
    with httpx.Client(base_url=url, timeout=120) as c:
        for _ in range(n):
            body = {"model": MODEL, "prompt": COPY, "max_tokens": max_tokens, "temperature": 0}
            r = c.post("/v1/completions", json=body)
            assert r.status_code == 200, r.text
            assert r.json()["usage"]["completion_tokens"] == max_tokens
            engines.append(r.headers["x-specpilot-engine"])
    return engines


def test_openai_client_streams_through_the_router(router):
    from openai import OpenAI

    client = OpenAI(base_url=router.url + "/v1", api_key="none")
    assert [m.id for m in client.models.list().data] == [MODEL]
    chunks = list(
        client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": "What is the capital of France?"}],
            max_tokens=12,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert "Paris" in text
    assert chunks[-1].usage.completion_tokens > 0


def test_routing_modes_send_requests_where_they_say(router):
    h = router.control_headers
    r = httpx.put(router.url + "/control/config", headers=h, timeout=60, json={"routing": "plain"})
    assert r.status_code == 200, r.text
    assert set(_complete(router.url, 3)) == {"plain"}
    before = httpx.get(router.url + "/control/state", headers=h, timeout=30).json()["controller"]["steps_at_k"]
    r = httpx.put(
        router.url + "/control/config",
        headers=h,
        timeout=60,
        json={"routing": "speculative", "speculation": {"mode": "fixed", "k": 4}},
    )
    assert r.status_code == 200, r.text
    assert r.json()["config"]["speculation"]["k"] == 4
    assert set(_complete(router.url, 3)) == {"speculative"}
    st = httpx.get(router.url + "/control/state", headers=h, timeout=30).json()
    assert st["controller"]["steps_at_k"][4] > before[4]
    assert st["router"]["mode"] == "speculative"
    # a bad routing is refused with the reason and changes nothing
    r = httpx.put(
        router.url + "/control/config",
        headers=h,
        timeout=60,
        json={"routing": "fastest", "speculation": {"mode": "fixed", "k": 2}},
    )
    assert r.status_code == 422 and "routing must be one of" in r.text
    st = httpx.get(router.url + "/control/state", headers=h, timeout=30).json()
    assert st["router"]["mode"] == "speculative" and st["config"]["speculation"]["k"] == 4
    # an engine-invalid patch is refused by the engine, and routing stays as it was
    r = httpx.put(
        router.url + "/control/config",
        headers=h,
        timeout=60,
        json={"routing": "plain", "speculation": {"mode": "fixed", "k": 99}},
    )
    assert r.status_code == 422, r.text
    assert httpx.get(router.url + "/control/state", headers=h, timeout=30).json()["router"]["mode"] == "speculative"
    assert httpx.get(router.url + "/control/state", timeout=30).status_code == 401


def test_auto_routing_measures_both_engines_and_metrics_name_them(router):
    # the share is pinned at 0.5 here (--p-min = --p-max); how it moves is unit-tested
    h = router.control_headers
    r = httpx.put(
        router.url + "/control/config",
        headers=h,
        timeout=60,
        json={"routing": "auto", "speculation": {"mode": "adaptive", "k_min": 0, "k_max": 8}},
    )
    assert r.status_code == 200, r.text
    assert set(_complete(router.url, 24, max_tokens=4)) == {"plain", "speculative"}
    st = httpx.get(router.url + "/control/state", headers=h, timeout=30).json()["router"]
    assert st["mode"] == "auto"
    # every worker polls both engines: whichever answers has measured both TPOTs
    assert st["tpot_ms"]["plain"] and st["tpot_ms"]["speculative"]
    engines = set()
    for fam in text_string_to_metric_families(httpx.get(router.url + "/metrics", timeout=30).text):
        for s in fam.samples:
            if s.name == "vllm:generation_tokens_total":
                engines.add(s.labels["engine"])
    assert engines == {"plain", "speculative"}
    health = httpx.get(router.url + "/health", timeout=30)
    assert health.status_code == 200 and health.json()["engines"] == {"plain": 200, "speculative": 200}


def test_split_settings_change_live_and_a_resting_speculative_engine_gets_only_probes(router):
    h = router.control_headers
    pinned = {
        "p_min": 0.5,
        "p_max": 0.5,
        "probe_every_s": 20.0,
        "probe_s": 1.0,
        "p_probe": 0.1,
        "tpot_margin": 0.0,
        "probe_backoff": 2.0,
    }

    def put(body: dict) -> httpx.Response:
        return httpx.put(router.url + "/control/config", headers=h, timeout=60, json=body)

    try:
        # the share rests at its floor (p = p_min < p_max; a margin no engine clears keeps it
        # there) and the next probe is an hour away
        r = put(
            {"routing": "auto", "router": {"p_max": 0.97, "tpot_margin": 10.0, "probe_every_s": 3600.0, "probe_s": 1.0}}
        )
        assert r.status_code == 200, r.text
        st = r.json()["router"]
        assert st["resting"] and st["settings"]["probe_every_s"] == 3600.0
        assert set(_complete(router.url, 8, max_tokens=4)) == {"plain"}
        # a probe that never ends, at share 1 (each 2 s probe starts as the last one ends, no
        # backoff), from 2 s after the change on: every request goes to the speculative engine
        r = put({"router": {"probe_every_s": 2.0, "probe_s": 2.0, "p_probe": 1.0, "probe_backoff": 1.0}})
        assert r.status_code == 200, r.text
        deadline = time.monotonic() + 30.0
        while (httpx.get(router.url + "/control/state", headers=h, timeout=30).json()["router"]["probes"] or {}).get(
            "next_in_s"
        ) != 0.0:
            assert time.monotonic() < deadline, "the probe did not start within 30 s"
            time.sleep(0.2)
        assert set(_complete(router.url, 4, max_tokens=4)) == {"speculative"}
        # invalid settings are refused with the reason, and nothing changes
        r = put({"routing": "plain", "router": {"probe_s": 5.0}})
        assert r.status_code == 422 and "probe_s" in r.json()["message"]
        st = httpx.get(router.url + "/control/state", headers=h, timeout=30).json()["router"]
        assert st["mode"] == "auto" and st["settings"]["p_probe"] == 1.0
    finally:
        assert put({"router": pinned}).status_code == 200
