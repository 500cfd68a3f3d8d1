"""Alert rules as data and their events (start and end), on SQLite and PostgreSQL."""

from __future__ import annotations

import pytest

from control.alerts import AlertEvaluator, BadRule, events, list_rules, set_rule
from control.store import Store, add_host
from tests.support import BACKENDS, database_url


@pytest.fixture(params=BACKENDS)
def store(request, tmp_path):
    s = Store.open(database_url(request.param, tmp_path))
    yield s
    s.close()


@pytest.fixture
def host_id(store):
    return add_host(store, "h", "http://127.0.0.1:9").id


def _run(ev: AlertEvaluator, host_id: int, t0: float, values: list[dict]) -> None:
    for i, v in enumerate(values):
        ev.evaluate(host_id, t0 + i, v)


def test_low_acceptance_fires_after_five_minutes_and_closes(store, host_id):
    ev = AlertEvaluator(store)
    _run(ev, host_id, 1000.0, [{"up": 1, "acceptance_rate": 0.3}] * 299)
    assert events(store) == []  # not yet 5 minutes
    _run(ev, host_id, 1299.0, [{"up": 1, "acceptance_rate": 0.25}] * 2)
    (e,) = events(store, open_only=True)
    assert e["rule"] == "low_acceptance" and e["started_at"] == 1000.0 and e["ended_at"] is None
    assert e["value"] == 0.25 and e["peak"] == 0.25
    _run(ev, host_id, 1301.0, [{"up": 1, "acceptance_rate": 0.8}])
    (e,) = events(store)
    assert e["ended_at"] == 1301.0 and events(store, open_only=True) == []


def test_a_brief_dip_does_not_fire(store, host_id):
    ev = AlertEvaluator(store)
    _run(
        ev,
        host_id,
        0.0,
        [{"up": 1, "acceptance_rate": 0.3}] * 200
        + [{"up": 1, "acceptance_rate": 0.9}]
        + [{"up": 1, "acceptance_rate": 0.3}] * 200,
    )
    assert events(store) == []


def test_missing_values_do_not_breach(store, host_id):
    ev = AlertEvaluator(store)
    _run(ev, host_id, 0.0, [{"up": 1, "acceptance_rate": None, "kv_cache_usage": None}] * 400)
    assert events(store) == []


def test_kv_cache_queue_time_and_host_down(store, host_id):
    ev = AlertEvaluator(store)
    _run(ev, host_id, 0.0, [{"up": 1, "kv_cache_usage": 0.95, "queue_p99_ms": 800.0}])
    assert {e["rule"] for e in events(store, open_only=True)} == {"kv_cache_full", "queue_time_p99"}
    _run(ev, host_id, 1.0, [{"up": 0}] * 6)  # down: the other rules see no value and close
    open_ = events(store, open_only=True)
    assert [e["rule"] for e in open_] == ["host_down"] and open_[0]["started_at"] == 1.0
    _run(ev, host_id, 7.0, [{"up": 1}])
    assert events(store, open_only=True) == []
    assert {e["rule"]: e["ended_at"] for e in events(store)} == {
        "kv_cache_full": 1.0,
        "queue_time_p99": 1.0,
        "host_down": 7.0,
    }


def test_rules_are_editable_data(store, host_id):
    set_rule(store, "kv_cache_full", threshold=0.5, for_s=2.0)
    set_rule(
        store,
        "high_ttft",
        metric="ttft_p99_ms",
        op=">",
        threshold=1000.0,
        severity="critical",
        description="slow first tokens",
    )
    set_rule(store, "queue_time_p99", enabled=False)
    ev = AlertEvaluator(store)
    _run(ev, host_id, 0.0, [{"up": 1, "kv_cache_usage": 0.6, "ttft_p99_ms": 1500.0, "queue_p99_ms": 900.0}] * 3)
    assert {e["rule"] for e in events(store)} == {"kv_cache_full", "high_ttft"}
    assert {r.name for r in list_rules(store, enabled_only=True)} == {
        "kv_cache_full",
        "high_ttft",
        "low_acceptance",
        "host_down",
        "config_drift",
    }
    with pytest.raises(BadRule):
        set_rule(store, "x", metric="no_such_metric", op=">", threshold=1)
    with pytest.raises(BadRule):
        set_rule(store, "x", metric="k", op="!=", threshold=1)
    with pytest.raises(BadRule):
        set_rule(store, "y")  # a new rule needs a definition


def test_rule_scoped_to_one_host(store, host_id):
    other = add_host(store, "other", "http://127.0.0.1:10").id
    set_rule(store, "only_other", metric="running", op=">", threshold=5, host="other")
    ev = AlertEvaluator(store)
    ev.evaluate(host_id, 0.0, {"up": 1, "running": 9})
    ev.evaluate(other, 0.0, {"up": 1, "running": 9})
    assert [(e["rule"], e["host"]) for e in events(store)] == [("only_other", "other")]


def test_open_events_survive_a_daemon_restart(store, host_id):
    ev = AlertEvaluator(store)
    ev.evaluate(host_id, 0.0, {"up": 1, "kv_cache_usage": 0.99})
    again = AlertEvaluator(store)  # a new daemon process
    again.evaluate(host_id, 5.0, {"up": 1, "kv_cache_usage": 0.99})
    assert len(events(store)) == 1  # continued, not duplicated
    again.evaluate(host_id, 6.0, {"up": 1, "kv_cache_usage": 0.1})
    (e,) = events(store)
    assert (e["started_at"], e["ended_at"]) == (0.0, 6.0)


def test_disabling_a_rule_closes_its_open_events(store, host_id):
    ev = AlertEvaluator(store, reload_s=0.0)
    ev.evaluate(host_id, 0.0, {"up": 1, "kv_cache_usage": 0.99})
    set_rule(store, "kv_cache_full", enabled=False)
    ev.evaluate(host_id, 1.0, {"up": 1, "kv_cache_usage": 0.99})
    (e,) = events(store)
    assert e["ended_at"] == 1.0
