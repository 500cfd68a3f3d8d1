"""Integration tests of the engine host: the real vLLM engine (CPU, eager) on the default model."""

from __future__ import annotations

import concurrent.futures as cf
import json
import os
import signal
import threading
import time

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

pytestmark = pytest.mark.engine

MODEL = "SmolLM2-135M-Instruct"
COPY_PROMPT = (
    "Copy this list exactly, then copy it again: red apple, green pear, yellow banana, purple plum, "
    "orange mango, red apple, green pear, yellow banana, purple plum, orange mango, red apple, green pear,"
)


def metric_values(url: str) -> dict[str, float]:
    """Prometheus samples of ``url/metrics`` keyed by name plus sorted labels."""
    text = httpx.get(url + "/metrics", timeout=10).text
    out: dict[str, float] = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            key = s.name + "".join(
                f"|{k}={v}" for k, v in sorted(s.labels.items()) if k not in ("engine", "model_name")
            )
            out[key] = s.value
    return out


def client(engine_host) -> openai.OpenAI:
    return openai.OpenAI(base_url=engine_host.url + "/v1", api_key="unused", timeout=120)


def test_chat_completion_through_openai_client_returns_text_and_usage(engine_host):
    c = client(engine_host)
    models = [m.id for m in c.models.list().data]
    assert MODEL in models
    r = c.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "What is the capital of France?"}],
        max_tokens=24,
        temperature=0,
    )
    text = r.choices[0].message.content
    assert text and text.strip()
    assert "paris" in text.lower()
    assert 0 < r.usage.completion_tokens <= 24
    assert r.usage.prompt_tokens > 5
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens


def test_streaming_yields_chunks_and_final_usage(engine_host):
    c = client(engine_host)
    stream = c.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Write two sentences about the sea."}],
        max_tokens=32,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    content = [ch for ch in chunks if ch.choices and ch.choices[0].delta.content]
    assert len(content) >= 3
    assert chunks[-1].usage is not None
    assert 0 < chunks[-1].usage.completion_tokens <= 32


def test_the_step_trace_is_written_out_when_the_engine_waits_for_work(engine_host):
    """With ``$SPECPILOT_STEP_TRACE`` the engine core keeps a row per step and writes them out
    once it waits for work again, with the engine still up (not at its exit): a request's decode
    steps are in the file within moments of its answer."""
    from bench.step_trace import read_trace

    def rows() -> int:
        files = list(engine_host.step_trace.parent.glob(engine_host.step_trace.name + ".*"))
        return sum(len(read_trace(f)) for f in files)

    before = rows()
    r = client(engine_host).completions.create(model=MODEL, prompt="One, two, three,", max_tokens=16, temperature=0)
    assert r.usage.completion_tokens >= 8
    deadline = time.monotonic() + 10
    while rows() < before + r.usage.completion_tokens - 1 and time.monotonic() < deadline:
        time.sleep(0.1)
    assert rows() >= before + r.usage.completion_tokens - 1  # its decode steps (the first token is the prefill's)
    steps = read_trace(next(engine_host.step_trace.parent.glob(engine_host.step_trace.name + ".*")))
    assert {st.path for st in steps[-8:]} <= {"lean", "full"} and steps[-1].t_output > steps[-1].t_scheduled


def test_completions_endpoint_answers(engine_host):
    r = client(engine_host).completions.create(
        model=MODEL, prompt="The alphabet starts with A, B, C,", max_tokens=8, temperature=0
    )
    assert r.choices[0].text
    assert r.usage.completion_tokens > 0


def test_ready_health_and_state_shape(engine_host, control):
    assert httpx.get(engine_host.url + "/health").status_code == 200
    ready = httpx.get(engine_host.url + "/ready").json()
    assert ready["ready"] is True and ready["warmup"]["runs"] >= 1
    st = control.get("/control/state").json()
    for key in ("mode", "k_current", "k_max"):
        assert key in st["speculation"]
    assert st["batch"]["max_num_seqs"] == 8
    assert st["batch"]["max_num_batched_tokens"] > 0
    assert isinstance(st["config_version"], int)
    assert st["engine"]["pid"] > 0 and st["engine"]["started_at"] > 0
    assert st["speculation"]["k_max_engine"] == 8


def test_k_change_takes_effect_without_restart(engine_host, control, restore_config):
    c = client(engine_host)
    assert control.put("/control/config", json={"speculation": {"mode": "fixed", "k": 0}}).status_code == 200
    pid_before = control.get("/control/state").json()["engine"]["pid"]
    key = "vllm:spec_decode_num_draft_tokens_total"
    d0 = metric_values(engine_host.url).get(key, 0.0)
    c.completions.create(model=MODEL, prompt=COPY_PROMPT, max_tokens=48, temperature=0)
    d1 = metric_values(engine_host.url).get(key, 0.0)
    assert d1 == d0, "K=0 must propose no draft tokens"
    # this engine host writes a step trace, a row a step: its hook never stands aside at K = 0
    # (tests/test_draft_engine.py has one that does)
    assert control.get("/control/state").json()["overhead"]["aside_steps"] == 0

    r = control.put("/control/config", json={"speculation": {"mode": "fixed", "k": 4}})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["config"]["speculation"]["k"] == 4 and body["applied"] is True
    assert body["config_version"] == body["previous_version"] + 1
    c.completions.create(model=MODEL, prompt=COPY_PROMPT, max_tokens=48, temperature=0)
    m = metric_values(engine_host.url)
    assert m.get(key, 0.0) > d1, "K=4 must propose draft tokens"
    assert m["specpilot:speculation_k"] == 4
    assert m["specpilot:config_version"] == body["config_version"]
    st = control.get("/control/state").json()
    assert st["engine"]["pid"] == pid_before
    assert st["speculation"]["k_current"] == 4
    assert st["controller"]["steps_at_k"][4] > 0


def test_lower_running_cap_limits_concurrency_then_raise(engine_host, control, restore_config):
    r = control.put("/control/config", json={"batch": {"max_num_seqs": 2}})
    assert r.status_code == 200, r.text
    assert control.get("/control/state").json()["batch"]["max_num_seqs"] == 2
    seen_running: list[float] = []
    stop = threading.Event()

    def watch():
        while not stop.is_set():
            try:
                m = metric_values(engine_host.url)
                seen_running.append(m.get("vllm:num_requests_running", 0.0))
                st = control.get("/control/state").json()
                seen_running.append(st["batch"]["running"])
            except httpx.HTTPError:
                pass
            time.sleep(0.05)

    t = threading.Thread(target=watch)
    t.start()
    c = client(engine_host)
    try:
        with cf.ThreadPoolExecutor(8) as pool:
            futs = [
                pool.submit(
                    c.completions.create,
                    model=MODEL,
                    prompt=f"Count from {i} to {i + 20}:",
                    max_tokens=24,
                    temperature=0,
                )
                for i in range(8)
            ]
            results = [f.result() for f in futs]
    finally:
        stop.set()
        t.join()
    assert len(results) == 8 and all(r.choices[0].text for r in results)
    assert seen_running and max(seen_running) <= 2
    st = control.get("/control/state").json()
    assert st["batch"]["max_running_seen_since_config"] <= 2
    r = control.put("/control/config", json={"batch": {"max_num_seqs": 8}})
    assert r.status_code == 200 and control.get("/control/state").json()["batch"]["max_num_seqs"] == 8


def _ok_request(engine_host):
    r = client(engine_host).completions.create(model=MODEL, prompt="Hello", max_tokens=4, temperature=0)
    assert r.choices[0].text is not None


def test_control_without_token_is_401_and_engine_keeps_serving(engine_host):
    for headers in (
        {},
        {"Authorization": "Bearer wrong"},
        {"Authorization": "Basic abc"},
        {"Authorization": "Bearer tökén".encode()},
    ):
        r = httpx.get(engine_host.url + "/control/state", headers=headers)
        assert r.status_code == 401 and r.headers["www-authenticate"] == "Bearer"
        assert (
            httpx.put(engine_host.url + "/control/config", headers=headers, json={"speculation": {"k": 1}}).status_code
            == 401
        )
    _ok_request(engine_host)


@pytest.mark.parametrize(
    "body,field",
    [
        ({"speculation": {"mode": "fixed", "k": -1}}, "k"),
        ({"speculation": {"mode": "fixed", "k": 9}}, "k"),
        ({"batch": {"max_num_seqs": 64}}, "max_num_seqs"),
        ({"batch": {"max_num_batched_tokens": 10**7}}, "max_num_batched_tokens"),
        ({"speculation": {"depth": 3}}, "depth"),
        ({"bogus": 1}, "bogus"),
        ({"speculation": {"mode": "warp"}}, "mode"),
        ({"speculation": {"k": "4"}}, "k"),
        ({"speculation": {"k": True}}, "k"),
        ({"speculation": {"mode": "batch_table", "table": [[1, 8, 50]]}}, "table"),
        ({"speculation": {"threshold": {"k_high": 100}}}, "k_high"),
        ({"batch": {"max_num_batched_tokens": 1}}, "max_num_batched_tokens"),
    ],
)
def test_invalid_config_is_422_and_changes_nothing(engine_host, control, body, field):
    before = control.get("/control/state").json()
    r = control.put("/control/config", json=body)
    assert r.status_code == 422, r.text
    assert any(field in [str(x) for x in e["loc"]] for e in r.json()["detail"]), r.json()
    after = control.get("/control/state").json()
    assert after["config_version"] == before["config_version"]
    assert after["config"] == before["config"]
    _ok_request(engine_host)


def test_malformed_json_is_422(engine_host, control):
    r = control.put("/control/config", content=b'{"speculation": ', headers={"content-type": "application/json"})
    assert r.status_code == 422
    assert "malformed" in r.json()["message"]
    _ok_request(engine_host)


def test_restart_only_change_is_409(engine_host, control):
    before = control.get("/control/state").json()["config_version"]
    r = control.put("/control/config", json={"engine": {"k_max": 16}})
    assert r.status_code == 409
    assert "restart" in r.json()["message"]
    r = control.put("/control/config", json={"engine": {"model": "another-model"}})
    assert r.status_code == 409
    assert control.get("/control/state").json()["config_version"] == before
    _ok_request(engine_host)


def test_bad_inference_requests_get_openai_400(engine_host):
    url = engine_host.url + "/v1/completions"
    r = httpx.post(url, json={"model": MODEL, "prompt": "hi " * 3000, "max_tokens": 10})
    assert r.status_code == 400 and "error" in r.json()
    r = httpx.post(url, content=b"{not json", headers={"content-type": "application/json"})
    assert r.status_code == 400 and "error" in r.json()
    r = httpx.post(url, json={"model": MODEL, "prompt": "hi", "max_tokens": -5})
    assert r.status_code == 400 and "error" in r.json()
    _ok_request(engine_host)


def test_metrics_keep_vllm_names_and_add_specpilot_series(engine_host):
    m = metric_values(engine_host.url)
    for name in (
        "vllm:num_requests_running",
        "vllm:kv_cache_usage_perc",
        "vllm:generation_tokens_total",
        "specpilot:speculation_k",
        "specpilot:max_num_seqs",
        "specpilot:max_num_batched_tokens",
        "specpilot:config_version",
        "specpilot:speculation_mode_info|mode=fixed",
        "specpilot:user_time_to_first_token_seconds_count",
        "specpilot:user_inter_token_latency_seconds_bucket",
    ):
        assert any(k == name or k.startswith(name + "|") for k in m), name


def test_samples_report_per_second_throughput_and_k(engine_host, control):
    t0 = time.time()
    client(engine_host).completions.create(model=MODEL, prompt=COPY_PROMPT, max_tokens=32, temperature=0)
    time.sleep(2.2)
    samples = control.get("/control/samples", params={"since": t0 - 1}).json()["samples"]
    assert samples, "no samples"
    assert all(s["t"] > t0 - 1 for s in samples)
    busy = [s for s in samples if s["output_tokens_per_s"] > 0]
    assert busy and busy[0]["ttft_p50_ms"] is not None
    assert all("k" in s and "kv_cache_usage" in s and "acceptance_per_position" in s for s in samples)


# --- warm-up and heartbeats ---------------------------------------------------------


def test_ready_only_after_startup_warmup_covering_each_k(engine_host, control):
    st = control.get("/control/state").json()
    ready_at = st["engine"]["ready_at"]
    runs = control.get("/control/warmup/runs").json()
    warm = [r for r in runs["runs"] if r["kind"] == "warmup"]
    assert warm and all(r["outcome"] == "ok" for r in warm)
    assert {r["k"] for r in warm} == set(range(0, 9))
    assert [r["k"] for r in warm if r["detail"] == "chat"] == [8]  # the chat path too, at the last K
    assert max(r["started_at"] + r["duration_s"] for r in warm) <= ready_at + 0.05
    m = metric_values(engine_host.url)
    for k in range(0, 9):
        assert m.get(f"specpilot:warmup_steps_total|k={k}", 0) > 0, k
    assert m["specpilot:warmup_duration_seconds"] > 0


def _runs_after(control, after_id: int, name: str) -> list[dict]:
    return [
        r
        for r in control.get("/control/warmup/runs", params={"after_id": after_id}).json()["runs"]
        if r["kind"] == "heartbeat" and r["schedule"] == name
    ]


def _last_run_id(control) -> int:
    runs = control.get("/control/warmup/runs").json()["runs"]
    return runs[-1]["id"] if runs else 0


def test_heartbeat_fires_is_recorded_excluded_from_user_figures_and_stops(engine_host, control, restore_config):
    t0 = time.time()
    mark = _last_run_id(control)
    r = control.put(
        "/control/config",
        json={
            "warmup": {
                "heartbeats": [{"name": "hb1", "interval_s": 1.0, "idle_s": 0, "max_tokens": 6, "prompts": ["Say hi."]}]
            }
        },
    )
    assert r.status_code == 200, r.text
    time.sleep(4.5)
    runs = _runs_after(control, mark, "hb1")
    ok = [x for x in runs if x["outcome"] == "ok"]
    assert len(ok) >= 2
    assert all(x["ttft_s"] is not None and x["ttft_s"] > 0 and x["duration_s"] >= x["ttft_s"] for x in ok)
    samples = control.get("/control/samples", params={"since": t0}).json()["samples"]
    assert sum(s["internal_output_tokens"] for s in samples) > 0
    assert sum(s["output_tokens_per_s"] for s in samples) == 0, "heartbeat tokens must not count as user throughput"
    m = metric_values(engine_host.url)
    assert m["specpilot:warmup_runs_total|kind=heartbeat|outcome=ok"] >= 2
    assert m["specpilot:internal_generation_tokens_total"] > 0
    # removal stops it (a heartbeat already in flight may still finish and be recorded)
    mark2 = _last_run_id(control)
    assert control.put("/control/config", json={"warmup": {"heartbeats": []}}).status_code == 200
    removed_at = time.time()
    time.sleep(2.5)
    assert [x for x in _runs_after(control, mark2, "hb1") if x["started_at"] > removed_at] == []


def test_heartbeat_skips_while_real_traffic_flows(engine_host, control, restore_config):
    stop = threading.Event()

    def traffic():
        c = client(engine_host)
        while not stop.is_set():
            c.completions.create(model=MODEL, prompt="Tell me about rivers.", max_tokens=16, temperature=0)

    t = threading.Thread(target=traffic)
    t.start()
    try:
        time.sleep(1.0)
        mark = _last_run_id(control)
        r = control.put(
            "/control/config",
            json={"warmup": {"heartbeats": [{"name": "hb-idle", "interval_s": 1.0, "idle_s": 3.0, "max_tokens": 4}]}},
        )
        assert r.status_code == 200, r.text
        time.sleep(3.5)
    finally:
        stop.set()
        t.join()
    runs = _runs_after(control, mark, "hb-idle")
    assert runs and all(x["outcome"] == "skipped" for x in runs), runs
    assert "real traffic" in runs[0]["detail"]


@pytest.mark.parametrize(
    "hb,field",
    [
        ({"name": "bad", "cron": "61 * * * *"}, "heartbeats"),
        ({"name": "bad", "interval_s": 0}, "interval_s"),
        ({"name": "bad", "interval_s": -5}, "interval_s"),
        ({"name": "bad"}, "heartbeats"),
        ({"name": "bad", "interval_s": 5, "prompts": ["word " * 1100], "max_tokens": 8}, "prompts"),
    ],
)
def test_invalid_heartbeat_schedules_are_refused(engine_host, control, hb, field):
    before = control.get("/control/state").json()["config_version"]
    r = control.put("/control/config", json={"warmup": {"heartbeats": [hb]}})
    assert r.status_code == 422, r.text
    assert any(field in [str(x) for x in e["loc"]] for e in r.json()["detail"]), r.json()
    assert control.get("/control/state").json()["config_version"] == before


# --- bodies of any shape get an answer that names the cause (issue 18: 4, 5, 6, 15) ----------


@pytest.mark.parametrize(
    "raw,status,cause",
    [
        (b'{"speculation": {"threshold": {"interval_s": Infinity}}}', 422, "interval_s"),
        (b'{"warmup": {"heartbeats": [{"name": "h", "interval_s": 5, "idle_s": NaN}]}}', 422, "idle_s"),
        (b"[" * 100_000 + b"]" * 100_000, 422, "nested deeper"),
        (b'{"speculation": ' * 40 + b"1" + b"}" * 40, 422, "nested deeper"),
        (
            b'{"warmup": {"heartbeats": [{"name": "h", "interval_s": 5, "prompts": ["' + b"x" * (2 << 20) + b'"]}]}}',
            413,
            "1048576 bytes",
        ),
    ],
)
def test_odd_bodies_are_refused_naming_the_cause(engine_host, control, raw, status, cause):
    before = control.get("/control/state").json()
    r = control.put("/control/config", content=raw, headers={"content-type": "application/json"})
    assert r.status_code == status, r.text[:300]
    assert cause in r.text
    after = control.get("/control/state").json()
    assert after["config_version"] == before["config_version"] and after["config"] == before["config"]


def test_a_config_over_16_kib_is_applied(engine_host, control):
    hb = [{"name": f"big{i}", "interval_s": 3600.0, "enabled": False, "prompts": ["word " * 820]} for i in range(4)]
    body = {"warmup": {"heartbeats": hb}}
    assert len(json.dumps(body)) > 16 * 1024
    try:
        r = control.put("/control/config", json=body)
        assert r.status_code == 200, r.text[:300]
        st = control.get("/control/state").json()
        assert st["config_version"] == r.json()["config_version"]
        assert [h["name"] for h in st["config"]["warmup"]["heartbeats"]] == ["big0", "big1", "big2", "big3"]
    finally:
        control.put("/control/config", json={"warmup": {"heartbeats": []}})


def test_openapi_schema_declares_the_control_bodies(engine_host):
    spec = httpx.get(engine_host.url + "/openapi.json", timeout=30).json()
    put = spec["paths"]["/control/config"]["put"]
    body = put["requestBody"]["content"]["application/json"]["schema"]
    assert {"speculation", "batch", "warmup", "engine"} <= set(body["properties"])
    assert "mode" in body["properties"]["speculation"]["properties"]
    assert {"200", "409", "413", "422"} <= set(put["responses"])
    ok = put["responses"]["200"]["content"]["application/json"]["schema"]
    assert ok["$ref"].endswith("ApplyAnswer")
    state = spec["paths"]["/control/state"]["get"]["responses"]["200"]["content"]["application/json"]["schema"]
    assert state["$ref"].endswith("ControlState")
    assert "k_next" in spec["components"]["schemas"]["SpeculationState"]["properties"]


# --- K in force on an idle engine (issue 19, item 1) ----------------------------------------


def test_k_next_is_the_k_in_force_on_an_idle_engine_right_after_an_apply(engine_host, control, restore_config):
    r = control.put("/control/config", json={"speculation": {"mode": "fixed", "k": 3}})
    assert r.status_code == 200, r.text
    assert r.json()["k_next"] == 3
    st = control.get("/control/state").json()
    assert st["speculation"]["k_next"] == 3  # k_current may still be the last step's K
    assert control.put("/control/config", json={"speculation": {"mode": "off"}}).json()["k_next"] == 0
    assert control.get("/control/state").json()["speculation"]["k_next"] == 0


# --- an apply answered as failed never takes effect later (issue 18, item 3) ------------------


def test_an_apply_the_paused_core_never_acknowledged_is_withdrawn_not_applied_later(
    engine_host, control, restore_config
):
    before = control.get("/control/state").json()
    core_pid = before["engine"]["core_pid"]
    k_before = before["config"]["speculation"]["k"]
    os.kill(core_pid, signal.SIGSTOP)
    try:
        r = control.put("/control/config", json={"speculation": {"mode": "fixed", "k": 5 if k_before != 5 else 6}})
    finally:
        os.kill(core_pid, signal.SIGCONT)
    assert r.status_code == 503, r.text
    assert "withdrawn" in r.text
    time.sleep(2.0)  # the resumed core runs steps and reads the channel
    _ok_request(engine_host)
    after = control.get("/control/state").json()
    assert after["config_version"] == before["config_version"]
    assert after["config"]["speculation"]["k"] == k_before
    # and the engine takes the next apply normally
    r = control.put("/control/config", json={"speculation": {"mode": "fixed", "k": 2}})
    assert r.status_code == 200 and r.json()["config_version"] == before["config_version"] + 1
