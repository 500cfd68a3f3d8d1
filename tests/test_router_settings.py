"""The dual engine host's routing settings: one model (RouterSettings) with one default per
field, used by the command line, the traffic split and the live config, whose ``router``
section makes routing changes versioned, audited and rolled back by the control plane."""

from __future__ import annotations

import math
import threading
import time

import pytest

from engine_host.config import ConfigError, EngineLimits, LiveConfig, apply_patch, diff_configs
from engine_host.router.settings import SPLIT_SETTINGS, RouterSettings

ONE_ENGINE = EngineLimits(model="m", k_max=8, max_num_seqs=16, max_num_batched_tokens=2048, max_model_len=2048)
DUAL = ONE_ENGINE.model_copy(update={"dual": True})


@pytest.mark.parametrize(
    "patch, named",
    [
        ({"p_min": -0.1}, "p_min"),
        ({"p_max": 1.5}, "p_max"),
        ({"p_min": 0.9, "p_max": 0.5}, "p_min <= p_max"),
        ({"eta": 0}, "eta"),
        ({"eta": 6}, "eta"),
        ({"tpot_margin": -1}, "tpot_margin"),
        ({"p_probe": 2}, "p_probe"),
        ({"probe_every_s": -1}, "probe_every_s"),
        ({"probe_s": 0}, "probe_s"),
        ({"probe_every_s": 5, "probe_s": 6}, "probe_s must be in (0, probe_every_s]"),
        ({"probe_backoff": 0.5}, "probe_backoff"),
        ({"probe_every_max_s": -5}, "probe_every_max_s"),
        ({"mode": "fastest"}, "mode"),
        ({"speed": 1}, "unknown router setting"),
        ({"p_min": True}, "must be a number"),
        ({"p_min": "0.1"}, "must be a number"),
        ({"eta": math.nan}, "eta"),
        ({"probe_every_max_s": math.inf}, "probe_every_max_s"),
    ],
)
def test_invalid_router_settings_are_refused_naming_the_setting(patch, named):
    base = RouterSettings()
    with pytest.raises(ValueError) as exc:
        base.patched(patch)
    assert named in str(exc.value)
    assert base == RouterSettings()  # nothing changed


def test_probes_off_lift_the_bound_of_a_probe_length_and_ints_are_numbers():
    s = RouterSettings().patched({"probe_every_s": 0, "probe_s": 5, "p_min": 0})
    assert s.probe_every_s == 0.0 and s.probe_s == 5.0 and s.p_min == 0.0
    assert s.split_settings() == {k: float(getattr(s, k)) for k in SPLIT_SETTINGS}
    with pytest.raises(ValueError, match="JSON object"):
        s.patched(["p_min", 0.1])


def test_each_setting_has_one_default_used_by_the_split_the_cli_and_the_router_config():
    from engine_host.router.cli import SETTING_OPTIONS, parse_args
    from engine_host.router.split import TrafficSplit
    from engine_host.router.state import state_from_config

    defaults = RouterSettings()
    assert TrafficSplit().config == defaults
    assert TrafficSplit().p_min == parse_args([]).p_min == defaults.p_min  # 0.03 against 0.01 before
    args = parse_args([])
    assert args.router_settings == defaults
    assert {k: getattr(args, k) for k in SETTING_OPTIONS} == {k: getattr(defaults, k) for k in SETTING_OPTIONS}
    state = state_from_config(
        {
            "backends": {"plain": "http://p", "speculative": "http://s"},
            "p_start": 0.1,
            "mode_file": "/nonexistent/router.routing",
        },
        "t",
    )
    assert state.split.config == defaults


def test_cli_options_are_validated_by_the_same_model(capsys):
    from engine_host.router.cli import parse_args

    args = parse_args(["--routing", "plain", "--p-min", "0.05", "--probe-every", "0", "--tpot-margin", "0.2"])
    assert args.router_settings == RouterSettings(mode="plain", p_min=0.05, probe_every_s=0.0, tpot_margin=0.2)
    for argv, named in (
        (["--p-min", "0.9", "--p-max", "0.5"], "p_min"),
        (["--probe-every", "0.5"], "probe_s"),
        (["--eta", "0"], "eta"),
        (["--p-start", "0.99"], "--p-start"),
    ):
        with pytest.raises(SystemExit):
            parse_args(argv)
        assert named in capsys.readouterr().err


def test_live_config_carries_the_router_section_on_a_dual_host_only():
    # a one-engine host's config dumps as before the section existed
    assert "router" not in LiveConfig().model_dump(mode="json")
    assert "router" in LiveConfig.model_json_schema(mode="serialization")["properties"]  # OpenAPI keeps it
    cfg = LiveConfig(router=RouterSettings(p_min=0.02))
    assert LiveConfig.model_validate(cfg.model_dump(mode="json")) == cfg
    with pytest.raises(ConfigError) as exc:
        apply_patch(LiveConfig(), {"router": {"tpot_margin": 0.2}}, ONE_ENGINE)
    assert exc.value.errors[0]["loc"] == ["router"] and "dual engine host" in str(exc.value)
    assert apply_patch(LiveConfig(), {"router": None}, ONE_ENGINE) == LiveConfig()
    # on a dual host a partial section is merged over the one in force
    new = apply_patch(cfg, {"router": {"tpot_margin": 0.2, "mode": "plain"}}, DUAL)
    assert new.router == RouterSettings(p_min=0.02, tpot_margin=0.2, mode="plain")
    assert {d["field"] for d in diff_configs(cfg.model_dump(mode="json"), new.model_dump(mode="json"))} == {
        "router.tpot_margin",
        "router.mode",
    }
    with pytest.raises(ConfigError) as exc:
        apply_patch(cfg, {"router": {"eta": 0, "speed": 1}}, DUAL)
    assert sorted(e["loc"] for e in exc.value.errors) == [["router", "eta"], ["router", "speed"]]


def test_endpoint_extensions_load_the_in_engine_front_by_name(monkeypatch):
    from fastapi import FastAPI

    from engine_host.router import front
    from engine_host.router.state import ENV_ROUTER_CONFIG

    (ext,) = _load_extensions("engine_host.router.front:RouterEndpoints")
    assert isinstance(ext, front.RouterEndpoints)
    monkeypatch.delenv(ENV_ROUTER_CONFIG, raising=False)
    app = FastAPI()
    ext.attach_router(app)  # no router config: not a dual host's plain engine, nothing installed
    assert app.user_middleware == []
    with pytest.raises(ImportError):
        _load_extensions("engine_host.no_such_module:X")


def _load_extensions(spec: str) -> list:
    from engine_host.plugin import load_extensions

    return load_extensions(spec)


# --- the control plane versions routing changes on a dual host -----------------------------


@pytest.fixture
def dual_host(tmp_path, monkeypatch):
    """A dual host's router app served over HTTP (uvicorn in a thread) in front of two
    stand-in engine hosts, and a store with it registered as ``dual`` and a one-engine
    stand-in as ``single``."""
    import uvicorn

    from control.store import Store, add_host
    from engine_host.process import free_port
    from engine_host.router.app import create_app
    from engine_host.router.split import TrafficSplit
    from engine_host.router.state import Backend, RouterState
    from tests.support import FakeEngineHost, database_url

    token = "secret-token"
    monkeypatch.setenv("SPECPILOT_CONTROL_TOKEN", token)
    spec, plain, single = (FakeEngineHost(token=token).start() for _ in range(3))
    state = RouterState(
        backends={"plain": Backend("plain", plain.url, token), "speculative": Backend("speculative", spec.url, token)},
        split=TrafficSplit(RouterSettings(p_min=0.02)),
        mode_file=tmp_path / "router.routing",
    )
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(create_app(state), host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    store = Store.open(database_url("sqlite", tmp_path))
    try:
        deadline = time.monotonic() + 20
        while not server.started:
            assert time.monotonic() < deadline and thread.is_alive(), "the router app did not start"
            time.sleep(0.05)
        add_host(store, "dual", f"http://127.0.0.1:{port}")
        add_host(store, "single", single.url)
        yield store, state, spec
    finally:
        server.should_exit = True
        thread.join(10)
        store.close()
        for f in (spec, plain, single):
            f.stop()


def test_routing_changes_are_versioned_audited_and_rolled_back(dual_host):
    from control.apply import ConfigRefused, apply_change, reconcile, rollback
    from control.store import audit_events
    from control.versions import history

    store, state, spec = dual_host
    assert reconcile(store, "dual").imported == 1
    v1 = history(store, "dual")[-1]
    assert v1.config["router"] == RouterSettings(p_min=0.02).model_dump(mode="json")

    res = apply_change(store, "dual", {"router": {"tpot_margin": 0.25, "mode": "plain"}}, reason="chat-heavy hours")
    assert res.ok, res.message
    assert {d["field"] for d in res.diff} == {"router.tpot_margin", "router.mode"}
    assert state.split.tpot_margin == 0.25 and state.split.mode == "plain" and state.split.p_min == 0.02
    assert not any("differs" in n for n in res.notes)  # the answer's config is the version's, router included
    assert "router" not in spec.puts[-1]  # the section stays with the router, the rest goes to the engine
    # the other router processes take it up through the routing file
    assert RouterSettings.model_validate_json(state.mode_file.read_text()) == state.split.config

    with pytest.raises(ConfigRefused, match="eta"):
        apply_change(store, "dual", {"router": {"eta": 0}}, reason="bad")
    assert len(history(store, "dual")) == 2 and state.split.config.eta == 0.5  # nothing recorded or changed

    back = rollback(store, "dual", 1, reason="back to the split of the start")
    assert back.ok, back.message
    assert state.split.config == RouterSettings(p_min=0.02)
    actions = [(a.action, a.outcome) for a in audit_events(store, "dual")]
    assert actions[:3] == [("config.rollback", "ok"), ("config.apply", "refused"), ("config.apply", "ok")]

    with pytest.raises(ConfigRefused, match="dual engine host"):
        apply_change(store, "single", {"router": {"p_min": 0.1}}, reason="not a dual host")


def test_routing_shorthand_and_router_section_must_agree_and_null_leaves_the_settings(monkeypatch):
    from fastapi.testclient import TestClient

    from engine_host.process import free_port
    from engine_host.router.app import create_app
    from engine_host.router.state import Backend, RouterState

    monkeypatch.setenv("SPECPILOT_CONTROL_TOKEN", "tok")
    down = {e: Backend(e, f"http://127.0.0.1:{free_port()}", "tok") for e in ("plain", "speculative")}
    state = RouterState(backends=down)
    auth = {"Authorization": "Bearer tok"}
    with TestClient(create_app(state)) as c:
        r = c.put("/control/config", headers=auth, json={"routing": "plain", "router": {"mode": "speculative"}})
        assert r.status_code == 422 and "disagree" in r.json()["message"]
        r = c.put("/control/config", headers=auth, json={"router": "fast"})
        assert r.status_code == 422 and "JSON object" in r.json()["message"]
        assert state.split.config == RouterSettings()  # refused: nothing changed
        r = c.put("/control/config", headers=auth, json={"routing": "plain", "router": None})
        assert r.status_code == 200, r.text
        assert state.split.config == RouterSettings(mode="plain")
