"""Warm-up schedules and runs in the store (SQLite and PostgreSQL)."""

from __future__ import annotations

import pydantic
import pytest

from control.store import Store, add_host, get_host
from control.warmup import (
    UnknownSchedule,
    delete_schedule,
    record_runs,
    runs,
    schedules,
    set_schedule,
    sync_runs,
    warmup_patch,
)
from tests.support import BACKENDS, FakeEngineHost, database_url


@pytest.fixture(params=BACKENDS)
def store(request, tmp_path):
    s = Store.open(database_url(request.param, tmp_path))
    yield s
    s.close()


def test_schedules_are_validated_replaced_and_become_a_config_patch(store):
    add_host(store, "h", "http://127.0.0.1:9")
    set_schedule(store, "h", {"name": "every-minute", "interval_s": 60})
    set_schedule(store, "h", {"name": "nightly", "cron": "0 3 * * *", "idle_s": None})
    set_schedule(store, "h", {"name": "every-minute", "interval_s": 30})  # replaced
    assert [(r.name, r.spec.get("interval_s")) for r in schedules(store, "h")] == [
        ("every-minute", 30.0),
        ("nightly", None),
    ]
    patch = warmup_patch(store, "h")
    assert [b["name"] for b in patch["warmup"]["heartbeats"]] == ["every-minute", "nightly"]
    with pytest.raises(pydantic.ValidationError):
        set_schedule(store, "h", {"name": "both", "interval_s": 5, "cron": "* * * * *"})
    with pytest.raises(pydantic.ValidationError):
        set_schedule(store, "h", {"name": "bad cron", "cron": "every day"})
    delete_schedule(store, "h", "nightly")
    with pytest.raises(UnknownSchedule):
        delete_schedule(store, "h", "nightly")


def test_runs_are_copied_once_per_engine_start(store, monkeypatch):
    fake = FakeEngineHost(token="t").start()
    monkeypatch.setenv("SPECPILOT_CONTROL_TOKEN", "t")
    try:
        h = add_host(store, "h", fake.url)
        with store.writer() as s:  # identity as the collector records it
            from control.models import Host

            s.get(Host, h.id).engine_started_at = fake.started_at
        fake.warmup_runs = [
            {
                "id": i,
                "kind": "warmup",
                "schedule": "startup",
                "started_at": 100.0 + i,
                "duration_s": 0.2,
                "ttft_s": 0.05,
                "output_tokens": 8,
                "k": i % 3,
                "outcome": "ok",
                "detail": "",
            }
            for i in range(1, 4)
        ]
        from control.client import EngineClient

        with EngineClient(fake.url, "t") as c:
            assert sync_runs(store, get_host(store, "h"), c) == 3
            fake.warmup_runs.append(
                {
                    "id": 4,
                    "kind": "heartbeat",
                    "schedule": "hb",
                    "started_at": 200.0,
                    "duration_s": 0.1,
                    "ttft_s": None,
                    "output_tokens": 0,
                    "k": None,
                    "outcome": "skipped",
                    "detail": "real traffic",
                }
            )
            assert sync_runs(store, get_host(store, "h"), c) == 1
        assert record_runs(store, h.id, fake.started_at, fake.warmup_runs) == 0  # already stored
        got = runs(store, "h")
        assert [r.run_id for r in got] == [4, 3, 2, 1] and got[0].outcome == "skipped"
    finally:
        fake.stop()
