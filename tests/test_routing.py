"""The dual engine host's traffic split and metrics merging (pure logic, no engine)."""

from __future__ import annotations

import pytest
from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from engine_host.router.metrics import merged_metrics, tpot_totals
from engine_host.router.settings import PLAIN, SPECULATIVE
from engine_host.router.split import TpotWindow, TrafficSplit
from engine_host.router.state import Backend, RouterState


def test_tpot_window_is_the_mean_over_requests_finished_since_the_last_poll():
    w = TpotWindow(alpha=1.0)
    assert w.update(1.0, 100, now=0.0) is None  # first poll: a baseline only
    assert w.update(1.0, 100, now=0.5) is None  # nothing finished
    assert w.update(1.5, 110, now=1.0) == pytest.approx(0.05)
    assert w.tpot_s == pytest.approx(0.05) and w.is_fresh(1.0, 5.0) and not w.is_fresh(7.0, 5.0)
    assert w.update(0.2, 4, now=1.5) is None  # counters went back: the engine restarted
    assert w.update(0.3, 6, now=2.0) == pytest.approx(0.05)


def feed(split: TrafficSplit, tpot_plain: float, tpot_spec: float, polls: int, t0: float = 0.0) -> float:
    s = {PLAIN: [0.0, 0.0], SPECULATIVE: [0.0, 0.0]}
    for i in range(polls + 1):
        now = t0 + 0.5 * i
        for e, t in ((PLAIN, tpot_plain), (SPECULATIVE, tpot_spec)):
            s[e][0] += 10 * t
            s[e][1] += 10
            split.observe(e, s[e][0], s[e][1], now)
        split.update(now)
    return split.p


def test_share_follows_the_engine_with_the_lower_tpot():
    split = TrafficSplit(p=0.1, seed=1)
    assert feed(split, tpot_plain=0.006, tpot_spec=0.003, polls=20) == pytest.approx(split.p_max)
    split = TrafficSplit(p=0.5, seed=1)
    assert feed(split, tpot_plain=0.004, tpot_spec=0.012, polls=20) == pytest.approx(split.p_min)
    split = TrafficSplit(p=0.5, seed=1)
    assert feed(split, tpot_plain=0.005, tpot_spec=0.005, polls=20) == pytest.approx(0.5)


def test_stale_tpot_does_not_move_the_share():
    split = TrafficSplit(p=0.2, max_age_s=5.0)
    split.observe(PLAIN, 0.0, 0, 0.0)
    split.observe(SPECULATIVE, 0.0, 0, 0.0)
    split.observe(PLAIN, 0.05, 10, 0.5)
    split.observe(SPECULATIVE, 0.01, 10, 0.5)
    split.update(30.0)  # both last measured 29.5 s ago
    assert split.p == pytest.approx(0.2) and split.updates == 0


def test_choose_draws_by_share_and_fixed_modes_send_everything_to_one_engine():
    split = TrafficSplit(p=0.25, seed=3)
    picks = [split.choose() for _ in range(4000)]
    assert 0.22 < picks.count(SPECULATIVE) / len(picks) < 0.28
    split.set_mode(PLAIN)
    assert {split.choose() for _ in range(50)} == {PLAIN}
    split.set_mode(SPECULATIVE)
    assert {split.choose() for _ in range(50)} == {SPECULATIVE}
    assert split.routed[PLAIN] + split.routed[SPECULATIVE] == 4100
    with pytest.raises(ValueError, match="routing must be one of"):
        split.set_mode("random")
    assert split.mode == SPECULATIVE
    with pytest.raises(ValueError, match="p_min"):
        TrafficSplit(p_min=0.6, p_max=0.4)


def _engine_text(tpot_values: list[float], tokens: float) -> str:
    reg = CollectorRegistry()
    h = Histogram("vllm:request_time_per_output_token_seconds", "TPOT", ["model_name"], registry=reg)
    c = Counter("vllm:generation_tokens", "tokens", ["model_name"], registry=reg)
    for v in tpot_values:
        h.labels("m").observe(v)
    c.labels("m").inc(tokens)
    return generate_latest(reg).decode()


def test_tpot_totals_read_vllms_histogram():
    assert tpot_totals(_engine_text([0.01, 0.03], 5)) == (pytest.approx(0.04), 2.0)
    assert tpot_totals("# nothing here\n") is None


def test_merged_metrics_label_each_engine_and_add_router_series():
    state = RouterState(
        backends={PLAIN: Backend(PLAIN, "http://p", "t"), SPECULATIVE: Backend(SPECULATIVE, "http://s", "t")}
    )
    text = merged_metrics(
        {PLAIN: _engine_text([0.01], 100), SPECULATIVE: _engine_text([0.02], 40)}, state.split, state.in_flight()
    ).decode()
    gen = {}
    names = set()
    for fam in text_string_to_metric_families(text):
        names.add(fam.name)
        for s in fam.samples:
            if s.name == "vllm:generation_tokens_total":
                gen[s.labels["engine"]] = s.value
    assert gen == {PLAIN: 100.0, SPECULATIVE: 40.0}
    assert {"specpilot:router_speculative_share", "specpilot:router_requests_routed"} <= names


def test_down_engines_are_reported_not_crashed(monkeypatch):
    from fastapi.testclient import TestClient

    from engine_host.process import free_port
    from engine_host.router.app import create_app

    monkeypatch.setenv("SPECPILOT_CONTROL_TOKEN", "tok")
    down = {e: Backend(e, f"http://127.0.0.1:{free_port()}", "tok") for e in (PLAIN, SPECULATIVE)}
    state = RouterState(backends=down)
    auth = {"Authorization": "Bearer tok"}
    with TestClient(create_app(state)) as c:
        h = c.get("/health")
        assert h.status_code == 503 and h.json()["engines"][PLAIN].startswith("down")
        assert c.get("/ready").status_code == 503
        r = c.post("/v1/completions", json={"model": "m", "prompt": "x"})
        assert r.status_code == 502 and "did not answer" in r.json()["error"]["message"]
        assert c.get("/control/samples", headers=auth).status_code == 503
        assert c.get("/control/state", headers=auth).status_code == 503
        r = c.put("/control/config", headers=auth, json={"routing": "plain", "speculation": {"mode": "off"}})
        assert r.status_code == 503
        assert state.split.mode == "auto"  # refused: routing unchanged
        assert c.get("/metrics").status_code == 200


def test_in_engine_front_serves_plain_requests_in_process_and_relays_the_rest(monkeypatch):
    import httpx
    from fastapi import FastAPI
    from fastapi.testclient import TestClient

    from engine_host.router.front import INTERNAL_HEADER, RouterFront

    monkeypatch.setenv("SPECPILOT_CONTROL_TOKEN", "tok")
    inner = FastAPI()  # stands in for vLLM's app (the plain engine's own routes)
    inner_hits: list[str] = []

    @inner.post("/v1/completions")
    async def inner_completions() -> dict:
        inner_hits.append("/v1/completions")
        return {"engine": "inner"}

    @inner.get("/ready")
    async def inner_ready() -> dict:
        inner_hits.append("/ready")
        return {"ready": True}

    seen: list[tuple[str, str | None]] = []  # (url, internal header) of the front's own HTTP calls

    def upstream(request: httpx.Request) -> httpx.Response:
        seen.append((str(request.url), request.headers.get(INTERNAL_HEADER)))
        if request.url.path == "/v1/completions":  # streamed as an engine does (the relay reads it raw)
            return httpx.Response(
                200,
                headers={"content-type": "application/json"},
                stream=httpx.ByteStream(b'{"engine": "speculative-upstream"}'),
            )
        return httpx.Response(200, json={"ready": True})

    backends = {
        PLAIN: Backend(PLAIN, "http://127.0.0.1:1", "tok", extra_headers={INTERNAL_HEADER: "1"}),
        SPECULATIVE: Backend(SPECULATIVE, "http://127.0.0.1:2", "tok"),
    }
    state = RouterState(backends=backends, split=TrafficSplit(seed=0))
    state.client = httpx.AsyncClient(transport=httpx.MockTransport(upstream))
    c = TestClient(RouterFront(inner, state))

    state.split.set_mode(PLAIN)
    r = c.post("/v1/completions", json={"prompt": "x"})
    assert r.json() == {"engine": "inner"} and r.headers["x-specpilot-engine"] == "plain"
    assert seen == [] and backends[PLAIN].inflight == 0  # no HTTP hop for the plain engine

    state.split.set_mode(SPECULATIVE)
    r = c.post("/v1/completions", json={"prompt": "x"})
    assert r.json() == {"engine": "speculative-upstream"} and r.headers["x-specpilot-engine"] == "speculative"
    assert seen == [("http://127.0.0.1:2/v1/completions", None)]
    assert inner_hits == ["/v1/completions"]
    assert state.split.routed == {PLAIN: 1, SPECULATIVE: 1}

    # /ready is the router's (both engines), and it reaches its own engine past the front
    seen.clear()
    r = c.get("/ready")
    assert r.status_code == 200 and r.json()["engines"] == {PLAIN: 200, SPECULATIVE: 200}
    assert ("http://127.0.0.1:1/ready", "1") in seen
    # with the internal header a request goes to the engine's own route, unrouted
    r = c.post("/v1/completions", json={"prompt": "x"}, headers={INTERNAL_HEADER: "1"})
    assert r.json() == {"engine": "inner"} and "x-specpilot-engine" not in r.headers
    assert c.get("/ready", headers={INTERNAL_HEADER: "1"}).json() == {"ready": True}
    assert state.split.routed == {PLAIN: 1, SPECULATIVE: 1}


def test_local_tpot_reads_the_histogram_from_this_process_registry():
    from prometheus_client import REGISTRY, Histogram

    from engine_host.router.metrics import TPOT_FAMILY, local_tpot_totals

    h = Histogram(TPOT_FAMILY, "test", labelnames=["model_name"])
    try:
        h.labels("a").observe(0.02)
        h.labels("b").observe(0.04)
        total, count = local_tpot_totals()
        assert count == 2 and abs(total - 0.06) < 1e-9
    finally:
        REGISTRY.unregister(h)
    assert local_tpot_totals() is None


def test_cpu_engines_get_half_the_cores_unpinned_and_a_short_spin(monkeypatch):
    from engine_host import launcher
    from engine_host.router.cli import cpu_child_env

    monkeypatch.setattr(launcher, "is_cpu_build", lambda: True)
    assert cpu_child_env({}, ncpu=2) == {
        "VLLM_CPU_OMP_THREADS_BIND": "nobind",
        "OMP_NUM_THREADS": "1",
        "KMP_BLOCKTIME": "5",
    }
    assert cpu_child_env({}, ncpu=16)["OMP_NUM_THREADS"] == "8"
    # the operator's own settings win
    assert cpu_child_env({"OMP_NUM_THREADS": "3"}, ncpu=16) == {
        "VLLM_CPU_OMP_THREADS_BIND": "nobind",
        "KMP_BLOCKTIME": "5",
    }
    assert cpu_child_env({"VLLM_CPU_OMP_THREADS_BIND": "0"}, ncpu=2) == {}
    monkeypatch.setattr(launcher, "is_cpu_build", lambda: False)
    assert cpu_child_env({}, ncpu=16) == {}  # the GPU build sets its own threads


def test_tpot_margin_sends_traffic_only_to_a_clearly_faster_speculative_engine():
    # 10 % faster per token is within a 25 % margin: the share falls to p_min
    split = TrafficSplit(p=0.5, seed=1, tpot_margin=0.25)
    assert feed(split, tpot_plain=0.0044, tpot_spec=0.0040, polls=80) == pytest.approx(split.p_min)
    # without the margin the same TPOTs pull traffic towards the speculative engine
    assert feed(TrafficSplit(p=0.5, seed=1), tpot_plain=0.0044, tpot_spec=0.0040, polls=40) > 0.9
    # twice as fast per token clears the margin
    split = TrafficSplit(p=0.1, seed=1, tpot_margin=0.25)
    assert feed(split, tpot_plain=0.008, tpot_spec=0.004, polls=40) == pytest.approx(split.p_max)


def test_split_settings_change_live_and_bad_ones_change_nothing():
    split = TrafficSplit(p=0.5)
    before = split.settings()
    for bad, match in (
        ({"tpot_margin": -0.1}, "tpot_margin"),
        ({"p_min": 0.9, "p_max": 0.5}, "p_min"),
        ({"eta": 0}, "eta"),
        ({"speed": 1}, "unknown"),
        ({"p_min": "low"}, "number"),
        ({"p_min": True}, "number"),
    ):
        with pytest.raises(ValueError, match=match):
            split.configure(bad)
        assert split.settings() == before and split.p == 0.5
    assert split.configure({"p_max": 0.3, "tpot_margin": 0.2}) == {**before, "p_max": 0.3, "tpot_margin": 0.2}
    assert split.p == 0.3  # clipped into the new bounds
    assert split.describe()["settings"]["tpot_margin"] == 0.2


def test_router_config_sets_split_settings_live_and_shares_them_through_the_mode_file(monkeypatch, tmp_path):
    from fastapi.testclient import TestClient

    from engine_host.process import free_port
    from engine_host.router.app import create_app

    monkeypatch.setenv("SPECPILOT_CONTROL_TOKEN", "tok")
    mode_file = tmp_path / "router.routing"
    mode_file.write_text('{"mode": "auto"}')  # as main() first writes it
    down = {e: Backend(e, f"http://127.0.0.1:{free_port()}", "tok") for e in (PLAIN, SPECULATIVE)}
    state = RouterState(backends=down, mode_file=mode_file)
    other = RouterState(backends=down, mode_file=mode_file)  # a second relay worker
    auth = {"Authorization": "Bearer tok"}
    with TestClient(create_app(state)) as c:
        r = c.put("/control/config", headers=auth, json={"router": {"tpot_margin": 0.3, "p_min": 0.0}})
        assert r.status_code == 200, r.text
        assert r.json()["router"]["settings"]["tpot_margin"] == 0.3
        r = c.put("/control/config", headers=auth, json={"routing": "plain", "router": {"tpot_margin": -1}})
        assert r.status_code == 422 and "tpot_margin" in r.json()["message"]
        assert state.split.mode == "auto" and state.split.tpot_margin == 0.3  # refused: nothing changed
    other.follow_mode()
    assert other.split.tpot_margin == 0.3 and other.split.p_min == 0.0 and other.split.mode == "auto"


def test_resting_speculative_engine_gets_only_probes():
    split = TrafficSplit(p=0.01, p_min=0.01, p_probe=0.5, probe_every_s=20.0, probe_s=1.0, probe_backoff=1.0, seed=2)
    assert split.resting()
    split.update(100.0)  # comes to rest at 100 s: the first probe starts at 120 s
    between = [split.choose(now=100.0 + 2.0 + i * 0.01) for i in range(500)]  # 102..107 s: no probe
    assert set(between) == {PLAIN}
    during = [split.choose(now=120.0 + i * 0.001) for i in range(500)]  # 120..120.5 s: a probe
    assert 0.4 < during.count(SPECULATIVE) / len(during) < 0.6
    assert split.probe_schedule(130.0) == {"every_s": 20.0, "next_in_s": 10.0}  # backoff 1: every 20 s
    # once p is above its floor, the share is p at every instant
    split.configure({"p_min": 0.001})
    split.p = 0.3
    assert not split.resting() and split.share_now(103.0) == 0.3 and split.probe_schedule(103.0) is None
    # pinned bounds never rest; probe_every_s = 0 is the constant trickle at p_min
    assert not TrafficSplit(p=0.5, p_min=0.5, p_max=0.5).resting()
    trickle = TrafficSplit(p=0.01, p_min=0.01, probe_every_s=0.0)
    assert not trickle.resting() and trickle.share_now(103.0) == 0.01
    with pytest.raises(ValueError, match="probe_s"):
        split.configure({"probe_s": 30.0})
    with pytest.raises(ValueError, match="probe_backoff"):
        split.configure({"probe_backoff": 0.5})
    assert split.settings()["probe_backoff"] == 1.0  # refused: nothing changed


def _probe_starts(split: TrafficSplit, t0: float, t1: float, dt: float = 0.25) -> list[float]:
    """Times (s) in [t0, t1) at which a probe starts, polling every dt s as the router does."""
    starts, on = [], False
    for i in range(int((t1 - t0) / dt)):
        now = t0 + i * dt
        split.update(now)
        now_on = split.share_now(now) > 0
        if now_on and not on:
            starts.append(now)
        on = now_on
    return starts


def test_probes_back_off_while_the_speculative_engine_keeps_losing_and_start_afresh_when_it_wins():
    split = TrafficSplit(p=0.01, p_min=0.01, p_probe=0.1, probe_every_s=20.0, probe_s=1.0, seed=1)
    assert split.settings()["probe_backoff"] == 2.0 and split.settings()["probe_every_max_s"] == 300.0
    starts = _probe_starts(split, 0.0, 1500.0)
    gaps = [b - a for a, b in zip(starts, starts[1:])]
    assert starts[0] == 20.0
    assert gaps[:5] == [40.0, 80.0, 160.0, 300.0, 300.0]  # doubling, capped at 300 s
    # a probe shows the speculative engine faster: the share leaves its floor, the schedule resets
    t = starts[-1] + 300.0
    for i in range(8):
        split.observe(PLAIN, 1.0 * (i + 1), 100.0 * (i + 1), t + i * 0.25)  # TPOT 10 ms
        split.observe(SPECULATIVE, 0.5 * (i + 1), 100.0 * (i + 1), t + i * 0.25)  # TPOT 5 ms
        split.update(t + i * 0.25)
    assert split.p > 0.01 and not split.resting() and split.probe_schedule(t + 2.0) is None
    # it comes back to rest: probes start again 20 s after, not 300 s
    split.p = 0.01
    assert _probe_starts(split, t + 10.0, t + 75.0) == [t + 30.0, t + 70.0]
    # the same settings again, or another share for probes, leave the schedule running
    split.configure({**split.settings(), "p_probe": 0.2})
    assert split.probe_schedule(t + 80.0)["every_s"] == 80.0
    # a change of the schedule's settings starts it afresh
    split.configure({"probe_every_max_s": 30.0})
    later = _probe_starts(split, t + 100.0, t + 220.0)
    assert [b - a for a, b in zip(later, later[1:])][:3] == [30.0, 30.0, 30.0]
