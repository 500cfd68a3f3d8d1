"""Control-side reliability without an engine (real SQLite, real processes, the stand-in
engine host of ``tests.support`` for HTTP): apply leases say whom they wait for and are
released when their holder died; config drift is detected by content and by the version
mapping, recorded with both sides, alerted, and resolved by re-apply or adopt; a
supervised restart is not drift; collector downtime is a gap; ``control up`` keeps a
host's price; its children die with it; restart back-off."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import httpx
import pytest

from control import drift
from control.alerts import AlertEvaluator, events
from control.apply import apply_change, reconcile, rollback
from control.collector import COLLECTOR_DOWN, HostCollector
from control.samples import gaps, insert_samples
from control.store import Store, add_host, audit_events, get_host
from control.up import Backoff, register_host
from control.versions import ApplyBusy, acquire_lease, history, release_lease, version_in_force
from tests.support import FakeEngineHost, synthetic_sample


@pytest.fixture
def db(tmp_path):
    return f"sqlite:///{tmp_path / 'specpilot.db'}"


@pytest.fixture
def store(db):
    s = Store.open(db)
    yield s
    s.close()


@pytest.fixture
def fake(monkeypatch):
    f = FakeEngineHost(token="tok").start()
    monkeypatch.setenv("SPECPILOT_CONTROL_TOKEN", "tok")
    yield f
    f.stop()


def _env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": os.getcwd()}


# --------------------------------------------------------------------------- leases

_HOLDER = """
import os, sys, time
from control.store import Store, get_host
from control.versions import acquire_lease
store = Store.open(sys.argv[1])
acquire_lease(store, get_host(store, "h").id, ttl_s=60, who="cli (test)")
print("held", flush=True)
if sys.argv[2] == "die":
    os.kill(os.getpid(), 9)  # killed mid-apply: the lease is never given back
time.sleep(60)
"""


def test_a_lease_whose_holder_died_is_released_at_once(store, db):
    add_host(store, "h", "http://127.0.0.1:9")
    p = subprocess.run(
        [sys.executable, "-c", _HOLDER, db, "die"], capture_output=True, text=True, env=_env(), timeout=60
    )
    assert p.returncode == -signal.SIGKILL and "held" in p.stdout
    t0 = time.monotonic()
    token = acquire_lease(store, get_host(store, "h").id, wait_s=5.0)  # the old code waited out the 60 s lease
    assert time.monotonic() - t0 < 3.0
    release_lease(store, get_host(store, "h").id, token)
    (ev,) = [e for e in audit_events(store, host="h") if e.action == "config.lease_released"]
    assert "its process is gone" in ev.message and "cli (test)" in ev.message


def test_a_waiting_apply_says_whom_it_waits_for(store, db):
    add_host(store, "h", "http://127.0.0.1:9")
    holder = subprocess.Popen(
        [sys.executable, "-c", _HOLDER, db, "live"], stdout=subprocess.PIPE, text=True, env=_env()
    )
    try:
        assert holder.stdout.readline().strip() == "held"
        told: list[str] = []
        with pytest.raises(ApplyBusy) as exc:
            acquire_lease(store, get_host(store, "h").id, wait_s=1.0, on_wait=told.append)
        for text in (str(exc.value), told[0]):
            assert f"cli (test) pid {holder.pid}" in text and " since " in text and "lease until" in text
    finally:
        holder.kill()
        holder.wait()


# --------------------------------------------------------------------------- drift


def _put(fake: FakeEngineHost, body: dict) -> dict:
    """A change made straight on the engine, behind the control plane's back."""
    r = httpx.put(fake.url + "/control/config", json=body, headers={"Authorization": "Bearer tok"})
    r.raise_for_status()
    return r.json()


def test_drift_is_recorded_with_both_sides_alerted_and_resolved_by_reapply_or_adopt(store, fake):
    add_host(store, "h", fake.url)
    hc = HostCollector(store, get_host(store, "h"), AlertEvaluator(store), warmup_sync_s=0)
    t = time.time()
    hc.tick(t)
    assert drift.open_drift(store, "h") is None and version_in_force(store, "h").version == 1

    _put(fake, {"speculation": {"mode": "fixed", "k": 4}})  # e.g. a failed apply the core carried out later
    hc.tick(t + 1)
    d = drift.open_drift(store, "h")
    assert (d.store_version, d.store_engine_version, d.engine_version) == (1, 1, 2)
    assert d.engine_config["speculation"]["k"] == 4 and {x["field"] for x in d.diff} >= {"speculation.k"}
    assert [e["rule"] for e in events(store, host="h", open_only=True)] == ["config_drift"]
    assert any(e.action == "config.drift" for e in audit_events(store, host="h"))
    hc.tick(t + 2)
    assert len(drift.drifts(store, "h")) == 1  # recorded once, not per scrape

    res = drift.reapply(store, "h", reason="back to what the store says")
    assert res.ok and fake.config["speculation"]["k"] == 0
    hc.tick(t + 3)
    assert drift.open_drift(store, "h") is None and not events(store, host="h", open_only=True)
    assert drift.drifts(store, "h")[0]["resolution"] == "reapply"

    _put(fake, {"speculation": {"mode": "fixed", "k": 2}})
    hc.tick(t + 4)
    assert drift.open_drift(store, "h") is not None
    v = drift.adopt(store, "h", reason="the engine was tuned by hand; keep it")
    assert (v.source, v.status, v.config["speculation"]["k"]) == ("adopt", "applied", 2)
    hc.tick(t + 5)
    assert drift.open_drift(store, "h") is None and version_in_force(store, "h").version == v.version
    with pytest.raises(drift.NoDrift):
        drift.adopt(store, "h", reason="nothing to adopt")
    hc.close()


def test_same_content_under_another_engine_version_is_drift(store, fake):
    add_host(store, "h", fake.url)
    reconcile(store, "h")
    _put(fake, {"speculation": {"mode": "fixed", "k": 0}})  # same content, the engine's counter moved on
    d = drift.check(store, "h", fake._state())
    assert d is not None and d.diff == [] and (d.store_engine_version, d.engine_version) == (1, 2)


def test_a_supervised_restart_that_reapplies_the_last_version_is_not_drift(store, fake):
    add_host(store, "h", fake.url)
    hc = HostCollector(store, get_host(store, "h"), AlertEvaluator(store), warmup_sync_s=0)
    t = time.time()
    hc.tick(t)
    assert apply_change(store, "h", {"speculation": {"k": 3}}, reason="deeper").ok  # store v2 = engine v2
    fake.restart()  # the engine's counter starts again at 1 with its start-up config
    hc.tick(t + 1)
    top = history(store, "h")[0]
    assert top.source == "reapply" and top.status == "applied" and fake.config["speculation"]["k"] == 3
    assert drift.open_drift(store, "h") is None and version_in_force(store, "h").version == top.version
    # a restarted engine that already runs the version in force (engine version 1 again)
    assert rollback(store, "h", 1, reason="back to the start").ok
    fake.restart()
    hc.tick(t + 2)
    assert history(store, "h")[0].source == "rollback" and fake.version == 1
    assert drift.open_drift(store, "h") is None
    hc.close()


def test_dashboard_drift_action_requires_an_operator_and_a_reason(store, fake):
    from control.auth import User

    add_host(store, "h", fake.url)
    reconcile(store, "h")
    _put(fake, {"speculation": {"mode": "fixed", "k": 4}})
    drift.check(store, "h", fake._state())
    viewer, op = User("vic", "viewer", ""), User("olga", "operator", "")
    with pytest.raises(PermissionError):
        drift.resolve_as_user(store, "h", "adopt", viewer, "keep it")
    with pytest.raises(ValueError):
        drift.resolve_as_user(store, "h", "adopt", op, "")
    assert len(history(store, "h")) == 1  # nothing recorded by the refusals
    assert "adopted" in drift.resolve_as_user(store, "h", "adopt", op, "keep the hand-tuned K")
    assert history(store, "h")[0].author == "olga"


# --------------------------------------------------------------------------- gaps, alerts


def test_collector_downtime_is_recorded_as_a_gap(store, fake):
    h = add_host(store, "h", fake.url)
    t0 = int(time.time()) - 600
    insert_samples(store, h.id, [synthetic_sample(t) for t in range(t0, t0 + 5)])
    hc = HostCollector(store, get_host(store, "h"), AlertEvaluator(store), warmup_sync_s=0)  # 10 min later
    now = time.time()
    hc.tick(now)
    (g,) = gaps(store, "h", 0, now + 10)
    assert (g.started_at, g.ended_at, g.reason) == (t0 + 5, now, COLLECTOR_DOWN)
    hc.tick(now + 1)
    assert len(gaps(store, "h", 0, now + 10)) == 1
    hc.close()


def test_a_collector_starting_while_the_host_is_down_dates_the_gap_from_the_last_sample(store):
    h = add_host(store, "h", "http://127.0.0.1:9")
    t0 = int(time.time()) - 300
    insert_samples(store, h.id, [synthetic_sample(t) for t in range(t0, t0 + 3)])
    hc = HostCollector(store, get_host(store, "h"), AlertEvaluator(store), warmup_sync_s=0)
    hc.tick(time.time())
    (g,) = gaps(store, "h", 0, time.time() + 10)
    assert g.started_at == t0 + 3 and g.ended_at is None
    hc.close()


def test_open_now_opens_host_down_without_waiting_for_the_rule(store):
    h = add_host(store, "h", "http://127.0.0.1:9")
    ev = AlertEvaluator(store)
    t = time.time()
    assert ev.open_now(h.id, t, "up", 0, "the engine host exited (-9)")
    (e,) = events(store, host="h", open_only=True)
    assert e["rule"] == "host_down" and e["started_at"] == t and "exited" in e["message"]
    ev.evaluate(h.id, t + 1, {"up": 0})
    assert len(events(store, host="h")) == 1
    ev.evaluate(h.id, t + 2, {"up": 1})
    assert not events(store, host="h", open_only=True)


# --------------------------------------------------------------------------- control up


def test_control_up_keeps_a_recorded_price_and_gpu_kind(store):
    add_host(store, "local", "http://127.0.0.1:8000", usd_per_hour=2.5, gpu_kind="H100")
    h = register_host(store, "local", "http://127.0.0.1:8001", None, None, "cpu")
    assert (h.url, h.usd_per_hour, h.gpu_kind) == ("http://127.0.0.1:8001", 2.5, "H100")
    h = register_host(store, "local", "http://127.0.0.1:8001", 3.0, "L4", "cpu")
    assert (h.usd_per_hour, h.gpu_kind) == (3.0, "L4")
    h = register_host(store, "fresh", "http://127.0.0.1:8002", None, None, "cpu")
    assert (h.usd_per_hour, h.gpu_kind) == (0.0, "cpu")


def test_restart_backoff_doubles_to_60_s_and_resets_after_a_stable_run():
    b = Backoff()
    assert [b.delay(2.0) for _ in range(8)] == [1, 2, 4, 8, 16, 32, 60, 60]
    assert b.delay(61.0) == 1 and b.delay(0.5) == 2


_MIDDLE = """
import os, subprocess, sys, time
from control.up import die_with_parent
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"], start_new_session=True,
                         preexec_fn=die_with_parent(os.getpid()))
print(child.pid, flush=True)
time.sleep(120)
"""


def test_children_die_with_their_parent_even_on_kill_9():
    middle = subprocess.Popen([sys.executable, "-c", _MIDDLE], stdout=subprocess.PIPE, text=True, env=_env())
    child = int(middle.stdout.readline())
    try:
        middle.kill()
        middle.wait()
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and _alive(child):
            time.sleep(0.1)
        assert not _alive(child)
    finally:
        if _alive(child):
            os.kill(child, signal.SIGKILL)


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except OSError:
        return False


def test_a_collector_that_stalled_records_the_stall_as_a_gap(store, fake):
    from control.collector import COLLECTOR_STALLED

    add_host(store, "h", fake.url)
    hc = HostCollector(store, get_host(store, "h"), AlertEvaluator(store), warmup_sync_s=0)
    t = time.time()
    hc.tick(t)
    hc.tick(t + 1)
    hc.tick(t + 9)  # e.g. SIGSTOP for 8 s
    (g,) = gaps(store, "h", 0, t + 100)
    assert (g.started_at, g.ended_at, g.reason) == (t + 2, t + 9, COLLECTOR_STALLED)
    hc.close()


def test_cli_shows_a_drift_with_both_sides_and_adopts_it(store, db, fake, capsys):
    from control.cli import main

    add_host(store, "h", fake.url)
    reconcile(store, "h")
    assert main(["--db", db, "config", "drift", "--host", "h"]) == 0
    assert "no open config drift" in capsys.readouterr().out
    _put(fake, {"speculation": {"mode": "fixed", "k": 4}})
    drift.check(store, "h", fake._state())
    assert main(["--db", db, "config", "drift", "--host", "h"]) == 0
    out = capsys.readouterr().out
    assert (
        "store:  version 1" in out and "engine: config version 2" in out and "speculation.k: store 0 / engine 4" in out
    )
    assert main(["--db", db, "config", "adopt", "--host", "h", "--reason", "keep it"]) == 0
    assert "version 2 applied (adopted the engine's config version 2)" in capsys.readouterr().out
    assert main(["--db", db, "config", "reapply", "--host", "h", "--reason", "nothing to do"]) == 1
    assert "no open config drift" in capsys.readouterr().err


def test_alerts_page_shows_a_drift_and_an_operator_adopts_it(store, db, fake, monkeypatch, tmp_path):
    from pathlib import Path

    import streamlit as st
    from streamlit.testing.v1 import AppTest

    from control import auth
    from control.auth import User

    monkeypatch.setenv("SPECPILOT_HOME", str(tmp_path / "home"))  # nothing touches a shared store
    monkeypatch.setenv("SPECPILOT_DB_URL", db)
    monkeypatch.setenv("SPECPILOT_USERS_FILE", str(tmp_path / "users.toml"))
    auth.add_user("olga", "operator", "operator-password")  # actions re-check the user against this file
    add_host(store, "h", fake.url)
    reconcile(store, "h")
    _put(fake, {"speculation": {"mode": "fixed", "k": 4}})
    drift.check(store, "h", fake._state())
    st.cache_data.clear()
    st.cache_resource.clear()
    try:
        at = AppTest.from_file(str(Path(__file__).resolve().parent.parent / "dashboard" / "app.py"), default_timeout=60)
        at.session_state["user"] = User("olga", "operator")
        at.run()
        at.switch_page("pages/alerts.py").run()
        assert not at.exception, at.exception
        (w,) = [w.value for w in at.warning if "store's version in force is 1" in str(w.value)]
        assert "engine runs its config version 2" in w and "speculation.k" in w
        at.text_input(key="drift_reason_1").input("keep the hand-tuned K")
        adopt_button = [b for b in at.button if "Adopt" in str(b.label)][0]
        adopt_button.click().run()
        assert not at.exception, at.exception
        assert any("adopted" in str(s.value) for s in at.success), [s.value for s in at.success]
        assert history(store, "h")[0].source == "adopt" and history(store, "h")[0].author == "olga"
    finally:
        st.cache_data.clear()
        st.cache_resource.clear()


def test_fault_summary_counts_orphans_losses_and_misses_per_case():
    from bench.faults import _descendants, summarise

    ps = {10: (1, "up", True), 11: (10, "engine_host", True), 12: (11, "VLLM::EngineCore", True), 13: (1, "x", True)}
    assert _descendants(10, ps) == {11, 12}
    cases = [
        {
            "process": "engine-host",
            "signal": "KILL",
            "recovery_s": 40.0,
            "orphans": [],
            "lost": 0,
            "misrecorded": 0,
            "integrity": "ok",
        },
        {
            "process": "engine-host",
            "signal": "KILL",
            "recovery_s": None,
            "orphans": ["13 x"],
            "lost": 1,
            "misrecorded": 2,
            "integrity": "ok",
        },
    ]
    row = summarise(cases, 38.0).splitlines()[2].split()
    assert row[:7] == ["engine-host", "KILL", "2", "1", "1", "2", "ok"] and row[-1] == "1"


def test_fault_bench_waits_for_the_lease_through_a_released_one(tmp_path):
    """A lease given back is stored as JSON null: the wait reads it as "not held" (it raised
    AttributeError on None and ended the fault run), and sees the lease once the process holds it."""
    import json
    import sqlite3
    import subprocess
    import sys
    from types import SimpleNamespace

    from bench.faults import Run

    db = tmp_path / "store.db"
    with sqlite3.connect(db) as c:
        c.execute("CREATE TABLE hosts (name TEXT, apply_lock_info TEXT)")
        c.execute("INSERT INTO hosts VALUES ('local', 'null')")
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        run = SimpleNamespace(db_path=db)
        assert Run.wait_for_lease_of(run, proc, timeout_s=0.2) is False
        with sqlite3.connect(db) as c:
            c.execute("UPDATE hosts SET apply_lock_info = ?", (json.dumps({"pid": proc.pid, "user": "op"}),))
        assert Run.wait_for_lease_of(run, proc, timeout_s=5) is True
    finally:
        proc.kill()
        proc.wait()
