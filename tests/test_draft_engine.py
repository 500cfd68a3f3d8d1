"""Draft-model speculation on the real engine (CPU, eager): the default model drafted by its
own first layers. One engine host for the module, which also guards its OpenAI API with a key;
the module's last test kills its API process with kill -9 (nothing of the engine host may
outlive it), so it must stay last."""

from __future__ import annotations

import os
import signal
import time

import httpx
import psutil
import pytest

from tests.test_engine_host import metric_values

pytestmark = pytest.mark.engine

MODEL = "SmolLM2-135M-Instruct"
K_MAX = 4
PROMPT = "red apple, green pear, yellow banana, purple plum, orange mango, " * 4
API_KEY = "sk-draft-host-7f3a9c"
KEY = {"Authorization": f"Bearer {API_KEY}"}


@pytest.fixture(scope="module")
def draft_host(default_model, tmp_path_factory, artifacts_dir):
    """Engine host with ``--speculative-method draft_model`` and the truncated draft, K_max=4,
    its OpenAI API behind ``API_KEY`` (``$SPECPILOT_API_KEY``)."""
    from engine_host.model import prepare_truncated_draft
    from engine_host.process import EngineHostProcess

    draft = prepare_truncated_draft(quiet=True)
    eh = EngineHostProcess(
        model=default_model,
        extra_args=[
            "--enforce-eager",
            "--k-max",
            str(K_MAX),
            "--max-num-seqs",
            "4",
            "--max-model-len",
            "1024",
            "--speculation-mode",
            "fixed",
            "--k",
            "0",
            "--warmup",
            "quick",
            "--speculative-method",
            "draft_model",
            "--draft-model",
            str(draft),
        ],
        env={"SPECPILOT_HOME": str(tmp_path_factory.mktemp("draft-home")), "SPECPILOT_API_KEY": API_KEY},
        log_path=artifacts_dir / "engine-host-draft.log",
    )
    eh.start()
    try:
        eh.wait_ready(timeout_s=float(os.environ.get("SPECPILOT_TEST_READY_TIMEOUT", "400")))
        yield eh
    finally:
        eh.stop()


@pytest.fixture
def dcontrol(draft_host):
    with httpx.Client(base_url=draft_host.url, headers=draft_host.control_headers, timeout=60.0) as c:
        yield c


def _complete(host, max_tokens: int = 24) -> None:
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
    assert httpx.post(host.url + "/v1/completions", json=body, headers=KEY, timeout=300).status_code == 200


def _counters(host) -> tuple[float, float]:
    m = metric_values(host.url)
    return m.get("vllm:spec_decode_num_drafts_total", 0.0), m.get("vllm:spec_decode_num_draft_tokens_total", 0.0)


def test_state_and_metrics_name_the_method_and_draft(draft_host, dcontrol):
    st = dcontrol.get("/control/state").json()
    assert st["speculation"]["method"] == "draft_model"
    assert st["speculation"]["draft_name"].startswith(f"{MODEL}-draft-L")
    assert st["controller"]["step_time_model"]["draft_passes"] is True
    m = httpx.get(draft_host.url + "/metrics").text
    assert f'specpilot:speculation_info{{draft="{st["speculation"]["draft_name"]}",method="draft_model"}} 1.0' in m


def test_draft_tokens_per_step_follow_live_k_and_none_at_k0(draft_host, dcontrol):
    def aside_steps() -> int:
        return dcontrol.get("/control/state").json()["overhead"]["aside_steps"]

    for k in (0, 3, 1, 0):
        r = dcontrol.put("/control/config", json={"speculation": {"mode": "fixed", "k": k}})
        assert r.status_code == 200, r.text
        d0, t0 = _counters(draft_host)
        a0 = aside_steps()
        at_k0 = dcontrol.get("/control/state").json()["controller"]["steps_at_k"][0]
        _complete(draft_host)
        d1, t1 = _counters(draft_host)
        if k == 0:
            assert t1 == t0, f"K=0 drafted {t1 - t0} tokens"
            # the hook stood aside (vLLM's own schedule() and update_from_output() ran) and stepped
            # back in for the next config, which took effect at once; the steps it stood aside for
            # count at K = 0 (24 tokens: 23 decode steps at least)
            assert aside_steps() > a0
            assert dcontrol.get("/control/state").json()["controller"]["steps_at_k"][0] - at_k0 >= 23
        else:  # a draft model always drafts K tokens per request-step
            assert d1 > d0 and (t1 - t0) == pytest.approx(k * (d1 - d0)), (k, d1 - d0, t1 - t0)
            assert aside_steps() == a0
        assert dcontrol.get("/control/state").json()["speculation"]["k_current"] == k


def test_acceptance_per_position_is_reported(draft_host, dcontrol):
    assert dcontrol.put("/control/config", json={"speculation": {"mode": "fixed", "k": K_MAX}}).status_code == 200
    _complete(draft_host, 32)
    st = dcontrol.get("/control/state").json()
    acc = st["controller"]["acceptance_per_position"]
    assert len(acc) == K_MAX and all(0.0 <= a <= 1.0 for a in acc)
    assert acc == sorted(acc, reverse=True)  # r_i: positions 1..i all accepted
    m = metric_values(draft_host.url)
    assert all(f"specpilot:acceptance_per_position|position={i}" in m for i in range(1, K_MAX + 1))
    assert any(k.startswith("vllm:spec_decode_num_accepted_tokens_per_pos_total|position=") for k in m)


def test_adaptive_mode_runs_and_reports_its_k(draft_host, dcontrol):
    r = dcontrol.put("/control/config", json={"speculation": {"mode": "adaptive"}})
    assert r.status_code == 200, r.text
    before = dcontrol.get("/control/state").json()["controller"]["steps_at_k"]
    t_end = time.monotonic() + 8
    while time.monotonic() < t_end:
        _complete(draft_host, 24)
    st = dcontrol.get("/control/state").json()
    assert st["controller"]["mode"] == "adaptive"
    assert 0 <= st["speculation"]["k_current"] <= K_MAX
    steps = [a - b for a, b in zip(st["controller"]["steps_at_k"], before)]
    assert sum(steps) > 0
    assert set(st["controller"]["predicted_goodput_tokens_per_s"]) == {str(k) for k in range(K_MAX + 1)}
    # each draft token costs a pass of the draft (16 of 30 layers plus the LM head): the
    # learned step time at K=4 is well above K=0's (n-gram drafts cost ~1.1x on this CPU)
    times = st["controller"]["step_time_ms"]
    assert times["4"] > 1.3 * times["0"], st["controller"]
    assert metric_values(draft_host.url)["specpilot:speculation_k"] in range(K_MAX + 1)
    dcontrol.put("/control/config", json={"speculation": {"mode": "fixed", "k": 0}})


def test_zz_kill_9_of_the_api_process_leaves_no_engine_core_or_worker(draft_host):
    """Last in the module: the key guards the OpenAI API and no process of the engine host
    shows it on its command line; kill -9 of the API process alone, and its engine core and
    worker die with it."""
    api = psutil.Process(draft_host.proc.pid)  # the launcher execs vLLM's server: same PID
    children = api.children(recursive=True)
    try:
        names = " ".join(p.name() + " " + " ".join(p.cmdline()) for p in children)
        assert "EngineCore" in names, names
        models = draft_host.url + "/v1/models"
        assert httpx.get(models, timeout=10).status_code == 401
        assert httpx.get(models, headers=KEY, timeout=10).status_code == 200
        for p in [api, *children]:
            assert API_KEY not in " ".join(p.cmdline()), p.cmdline()

        os.kill(api.pid, signal.SIGKILL)  # only the API process, not its group
        draft_host.proc.wait(timeout=10)
        gone, alive = psutil.wait_procs(children, timeout=15)
        assert not alive, [(p.pid, p.name()) for p in alive]
    finally:
        for p in children:  # never leave them behind, whatever the outcome
            try:
                p.kill()
            except psutil.Error:
                pass
