"""Config versions through the apply flow, on SQLite and PostgreSQL, against a stand-in
engine host (real config validation, same HTTP shapes; the real engine is in
test_control_engine.py): apply, refusal, rollback, history, diff, engine down, concurrent
writers, interrupted applies, immutability."""

from __future__ import annotations

import multiprocessing as mp
import threading
import time

import pytest

from control.apply import ConfigRefused, HostNeverSeen, apply_change, reconcile, rollback
from control.client import EngineAuthError, TokenMissing
from control.models import ConfigVersion
from control.store import (
    BadHostSpec,
    Store,
    UnknownHost,
    add_host,
    audit_events,
    get_host,
    list_hosts,
    remove_host,
)
from control.versions import UnknownVersion, diff_versions, get_version, history
from tests.support import BACKENDS, FakeEngineHost, database_url


@pytest.fixture(params=BACKENDS)
def db_url(request, tmp_path):
    return database_url(request.param, tmp_path)


@pytest.fixture
def store(db_url):
    s = Store.open(db_url)
    yield s
    s.close()


@pytest.fixture
def fake(monkeypatch):
    f = FakeEngineHost(token="secret-token").start()
    monkeypatch.setenv("SPECPILOT_CONTROL_TOKEN", f.token)
    yield f
    f.stop()


@pytest.fixture
def host(store, fake):
    add_host(store, "h1", fake.url, usd_per_hour=2.0, gpu_kind="H100")
    return "h1"


def test_first_contact_imports_the_engine_config_as_version_1(store, host, fake):
    res = reconcile(store, host)
    assert res.imported == 1 and not res.restarted
    v = get_version(store, host, 1)
    assert v.source == "import" and v.status == "applied" and v.config == fake.config
    h = get_host(store, host)
    assert h.engine_pid == fake.pid and h.engine_limits["k_max"] == 8


def test_apply_records_version_sends_full_config_and_records_outcome(store, host, fake):
    res = apply_change(
        store, host, {"speculation": {"mode": "fixed", "k": 4}}, reason="copy-heavy traffic", author="alice"
    )
    assert res.ok and res.version == 2  # version 1: the engine's own config, imported first
    assert res.diff == [{"field": "speculation.k", "old": 0, "new": 4}]
    assert fake.config["speculation"]["k"] == 4
    assert fake.puts[-1] == res.config  # the full config, not the patch
    v = get_version(store, host, 2)
    assert (v.author, v.reason, v.status, v.engine_version) == ("alice", "copy-heavy traffic", "applied", fake.version)
    assert v.finished_at >= v.created_at and v.engine_message


def test_invalid_config_is_refused_before_anything_is_recorded(store, host, fake):
    apply_change(store, host, {"speculation": {"k": 2}}, reason="start")
    before = [v.version for v in history(store, host)]
    puts = len(fake.puts)
    with pytest.raises(ConfigRefused) as exc:
        apply_change(store, host, {"speculation": {"k": 99}}, reason="too deep")
    assert exc.value.errors[0]["loc"] == ["speculation", "k"] and "K_max" in str(exc.value)
    with pytest.raises(ConfigRefused):
        apply_change(store, host, {"speculation": {"mode": "warp"}}, reason="bad mode")
    with pytest.raises(ConfigRefused) as exc:
        apply_change(store, host, {"engine": {"k_max": 16}}, reason="restart-only")
    assert exc.value.restart_required
    assert [v.version for v in history(store, host)] == before
    assert len(fake.puts) == puts
    refused = [e for e in audit_events(store, host=host) if e.outcome == "refused"]
    assert len(refused) == 3 and "K_max" in refused[-1].message


def test_reason_is_required(store, host):
    with pytest.raises(ValueError):
        apply_change(store, host, {"speculation": {"k": 1}}, reason="  ")


def test_rollback_applies_an_earlier_version_as_a_new_version(store, host, fake):
    apply_change(store, host, {"speculation": {"k": 4}}, reason="k4")
    apply_change(store, host, {"batch": {"max_num_seqs": 2}}, reason="cap")
    res = rollback(store, host, 2, reason="cap hurt latency", author="bob")
    assert res.ok and res.version == 4
    v = get_version(store, host, 4)
    assert v.source == "rollback" and v.rollback_of == 2 and v.reason == "cap hurt latency"
    assert v.config == get_version(store, host, 2).config == fake.config
    assert v.diff == [{"field": "batch.max_num_seqs", "old": 2, "new": None}]
    assert [x.version for x in history(store, host)] == [4, 3, 2, 1]
    with pytest.raises(UnknownVersion):
        rollback(store, host, 42, reason="no such version")


def test_diff_between_any_two_versions(store, host):
    apply_change(store, host, {"speculation": {"mode": "adaptive", "k_min": 1, "k_max": 6}}, reason="adaptive")
    apply_change(store, host, {"batch": {"max_num_seqs": 4}}, reason="cap")
    d = diff_versions(store, host, 1, 3)
    assert {x["field"] for x in d} == {
        "speculation.mode",
        "speculation.k_min",
        "speculation.k_max",
        "batch.max_num_seqs",
    }
    assert diff_versions(store, host, 3, 3) == []


def test_engine_down_during_apply_is_recorded_as_failed_and_retry_works(store, host, fake):
    apply_change(store, host, {"speculation": {"k": 3}}, reason="before the outage")
    fake.stop()
    res = apply_change(store, host, {"speculation": {"k": 5}}, reason="during the outage")
    assert res.status == "failed" and "unreachable" in res.message
    v = get_version(store, host, res.version)
    assert v.status == "failed" and v.config["speculation"]["k"] == 5  # nothing lost
    fake.start()
    assert fake.config["speculation"]["k"] == 3  # the engine kept its last good config
    retry = apply_change(store, host, {"speculation": {"k": 5}}, reason="retry after the outage")
    assert retry.ok and retry.version == res.version + 1
    assert retry.diff == [{"field": "speculation.k", "old": 3, "new": 5}]  # based on the last applied one
    assert fake.config["speculation"]["k"] == 5


def test_engine_refusal_is_recorded_as_failed_with_its_message(store, host, fake):
    reconcile(store, host)
    # The engine checks more than the control plane can (e.g. heartbeat prompts against its tokenizer).
    fake.refuse = [{"loc": ["warmup", "heartbeats", 0, "prompts", 0], "msg": "prompt of 2000 tokens exceeds"}]
    res = apply_change(store, host, {"warmup": {"heartbeats": [{"name": "hb", "interval_s": 60}]}}, reason="keep warm")
    assert res.status == "failed" and "prompt of 2000 tokens" in res.message
    assert fake.config["warmup"]["heartbeats"] == []
    assert get_version(store, host, res.version).engine_message == res.message


def test_never_reached_host_cannot_be_validated(store, monkeypatch):
    monkeypatch.setenv("SPECPILOT_CONTROL_TOKEN", "x")
    add_host(store, "ghost", "http://127.0.0.1:9")
    with pytest.raises(HostNeverSeen):
        apply_change(store, "ghost", {"speculation": {"k": 1}}, reason="x")
    assert history(store, "ghost") == []


def test_wrong_or_missing_token_is_a_clear_error_and_records_nothing(store, host, fake, monkeypatch):
    monkeypatch.setenv("SPECPILOT_CONTROL_TOKEN", "wrong")
    with pytest.raises(EngineAuthError, match="401"):
        apply_change(store, host, {"speculation": {"k": 1}}, reason="x")
    add_host(store, "h2", fake.url, token_env="H2_TOKEN")
    with pytest.raises(TokenMissing, match="H2_TOKEN"):
        apply_change(store, "h2", {"speculation": {"k": 1}}, reason="x")
    assert history(store, host) == [] and history(store, "h2") == []


def test_unknown_host_and_bad_host_specs(store, fake):
    with pytest.raises(UnknownHost, match="no engine host named 'nope'"):
        apply_change(store, "nope", {"speculation": {"k": 1}}, reason="x")
    for name, url in (("a", "localhost:8000"), ("a", "ftp://x"), ("bad name", "http://x:1"), ("a", "http://x:port")):
        with pytest.raises(BadHostSpec):
            add_host(store, name, url)
    with pytest.raises(BadHostSpec):
        add_host(store, "a", "http://x:1", usd_per_hour=-1)
    add_host(store, "a", "http://x:1")
    with pytest.raises(BadHostSpec, match="already"):
        add_host(store, "a", "http://x:2")


def test_removed_host_keeps_its_history_and_comes_back(store, host, fake):
    apply_change(store, host, {"speculation": {"k": 2}}, reason="x")
    remove_host(store, host)
    assert [h.name for h in list_hosts(store)] == []
    with pytest.raises(UnknownHost):
        history(store, host)
    add_host(store, host, fake.url)
    assert [v.version for v in history(store, host)] == [2, 1]


def test_versions_are_immutable(store, host):
    apply_change(store, host, {"speculation": {"k": 2}}, reason="x")
    with store.writer() as s:
        v = s.get(ConfigVersion, get_version(store, host, 2).id)
        v.reason = "rewritten history"
        with pytest.raises(ValueError, match="immutable"):
            s.flush()
        s.rollback()
    with store.writer() as s:
        v = s.get(ConfigVersion, get_version(store, host, 2).id)
        v.status = "failed"
        with pytest.raises(ValueError, match="outcome"):
            s.flush()
        s.rollback()
    assert get_version(store, host, 2).reason == "x"


def test_concurrent_applies_from_threads_are_serialised_in_order(store, host, fake):
    reconcile(store, host)
    fake.put_delay_s = 0.02
    errors = []

    def operator(k: int) -> None:
        try:
            for i in range(4):
                apply_change(
                    store,
                    host,
                    {"speculation": {"k": k}, "batch": {"max_num_seqs": 1 + i}},
                    reason=f"operator {k} change {i}",
                    author=f"op{k}",
                )
        except Exception as exc:  # pragma: no cover - reported below
            errors.append(exc)

    threads = [threading.Thread(target=operator, args=(k,)) for k in (1, 2, 3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    versions = sorted(history(store, host), key=lambda v: v.version)
    assert [v.version for v in versions] == list(range(1, 14))
    assert all(v.status == "applied" for v in versions)
    # The engine received the versions in the order they were numbered, each exactly once.
    assert fake.puts == [v.config for v in versions[1:]]
    assert [v.engine_version for v in versions] == sorted(v.engine_version for v in versions)
    assert fake.config == versions[-1].config


def _apply_in_process(db_url: str, url: str, token: str, k: int, n: int) -> None:
    import os

    os.environ["SPECPILOT_CONTROL_TOKEN"] = token
    store = Store.open(db_url)
    for i in range(n):
        apply_change(
            store,
            "h1",
            {"speculation": {"k": k}, "batch": {"max_num_seqs": 1 + i}},
            reason=f"process {k} change {i}",
            author=f"proc{k}",
        )
    store.close()


def test_concurrent_writers_in_several_processes_lose_no_version(store, db_url, host, fake):
    reconcile(store, host)
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=_apply_in_process, args=(db_url, fake.url, fake.token, k, 4)) for k in (1, 2, 3)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(120)
    assert [p.exitcode for p in procs] == [0, 0, 0]
    versions = sorted(history(store, host), key=lambda v: v.version)
    assert [v.version for v in versions] == list(range(1, 14))
    assert all(v.status == "applied" for v in versions)
    assert fake.puts == [v.config for v in versions[1:]]
    for k in (1, 2, 3):  # each writer's own changes in its own order
        mine = [v.reason for v in versions if v.author == f"proc{k}"]
        assert mine == [f"process {k} change {i}" for i in range(4)]


def _apply_and_hang(db_url: str, token: str) -> None:
    import os

    os.environ["SPECPILOT_CONTROL_TOKEN"] = token
    store = Store.open(db_url)
    apply_change(store, "h1", {"speculation": {"k": 6}}, reason="interrupted", lease_ttl_s=2.0)


def test_apply_interrupted_mid_flight_is_resolved_by_the_next_apply(store, db_url, host, fake):
    reconcile(store, host)
    fake.put_delay_s = 3.0
    p = mp.get_context("spawn").Process(target=_apply_and_hang, args=(db_url, fake.token))
    p.start()
    arrived = fake.puts_arrived
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and not (
        any(v.status == "pending" for v in history(store, host)) and fake.puts_arrived > arrived
    ):
        time.sleep(0.05)
    p.kill()  # killed after recording 'pending' and sending the config, before the outcome
    p.join()
    assert [v.status for v in history(store, host)] == ["pending", "applied"]
    time.sleep(3.5)  # the engine still applies what it received; the dead process' lease expires
    fake.put_delay_s = 0.0
    res = apply_change(store, host, {"batch": {"max_num_seqs": 3}}, reason="next change")
    assert res.ok and any("interrupted" in n for n in res.notes)
    v2 = get_version(store, host, 2)
    assert v2.status == "applied" and "confirmed" in v2.engine_message
    assert res.diff == [{"field": "batch.max_num_seqs", "old": None, "new": 3}]  # based on version 2
