"""The Fleet page's table (``control.views.fleet.fleet_overview``): one query for the
figures of every host (``control.fleet.window_figures``), hosts asked for their state in
parallel, the same figures as reading the store host by host, a down host shown as DOWN."""

from __future__ import annotations

import threading
import time

import pandas as pd
import pytest
from sqlalchemy import select

from control import fleet
from control.models import AlertEvent, AlertRule
from control.samples import insert_samples
from control.store import Store, add_host
from control.views import common
from control.views import fleet as fleet_views
from tests.support import FakeEngineHost, free_port, synthetic_sample


@pytest.fixture
def up_host(monkeypatch):
    f = FakeEngineHost(token="fleet-token").start()
    monkeypatch.setenv("SPECPILOT_CONTROL_TOKEN", f.token)
    yield f
    f.stop()


def test_one_query_table_equals_host_by_host_reading_and_shows_a_down_host(up_host, tmp_path):
    store = Store.open(f"sqlite:///{tmp_path / 'specpilot.db'}")
    now = int(time.time())
    a = add_host(store, "a", up_host.url, usd_per_hour=2.5, gpu_kind="H100")
    b = add_host(store, "b", f"http://127.0.0.1:{free_port()}")  # nothing listens there
    # host a: 30 s at 100 tokens/s then 30 s at 200 with a slower TTFT, and an older minute outside the window
    insert_samples(
        store,
        a.id,
        [synthetic_sample(now - 200 + i, tokens_per_s=900.0, ttft_s=2.0) for i in range(60)]
        + [
            synthetic_sample(now - 59 + i, tokens_per_s=100.0 if i < 30 else 200.0, ttft_s=0.05 if i < 30 else 0.3)
            for i in range(60)
        ],
    )
    insert_samples(store, b.id, [synthetic_sample(now - 30 + i, tokens_per_s=40.0) for i in range(29)])
    with store.writer() as s:
        rule = s.scalars(select(AlertRule)).first()
        s.add(AlertEvent(rule_id=rule.id, host_id=a.id, started_at=now - 100, ended_at=None, message="open"))
        s.add(AlertEvent(rule_id=rule.id, host_id=b.id, started_at=now - 900, ended_at=now - 800, message="closed"))
    df = fleet_views.fleet_overview(store, now=now + 0.5)
    rows = {r["host"]: r for r in df.to_dict("records")}
    assert list(df["host"]) == ["a", "b"]
    assert rows["a"]["state"] == "UP" and rows["a"]["k_current"] is not None and pd.isna(rows["a"]["error"])
    assert rows["a"]["output_tokens_per_s"] == pytest.approx(150.0)
    assert rows["a"]["ttft_p99_ms"] == pytest.approx(300.0)
    assert rows["a"]["open_alerts"] == 1 and rows["b"]["open_alerts"] == 0
    assert rows["a"]["usd_per_hour"] == 2.5 and rows["a"]["gpu_kind"] == "H100"
    assert rows["b"]["state"] == "DOWN" and rows["b"]["error"]
    assert rows["b"]["output_tokens_per_s"] == pytest.approx(40.0)
    # the one GROUP BY gives what reading each host's stored samples gives
    for name in ("a", "b"):
        frame = common.samples_frame(common.stored_samples(store, name, since=now + 0.5 - 60, until=now + 0.5))
        assert rows[name]["output_tokens_per_s"] == pytest.approx(float(frame["output_tokens_per_s"].mean()))
        assert rows[name]["ttft_p99_ms"] == pytest.approx(float(frame["ttft_p99_ms"].max()))
    store.close()


def test_hosts_are_asked_for_their_state_in_parallel(tmp_path, monkeypatch):
    """Asked one after another, the first answer would wait for the barrier forever (then DOWN)."""
    store = Store.open(f"sqlite:///{tmp_path / 'specpilot.db'}")
    for i in range(6):
        add_host(store, f"h{i}", f"http://127.0.0.1:{free_port()}")
    barrier = threading.Barrier(3, timeout=10)

    class _Client:
        def state(self):
            barrier.wait()
            return {
                "speculation": {"mode": "fixed", "k_current": 2, "k_next": 2},
                "batch": {"running": 1, "max_num_seqs": 8},
                "engine": {"phase": "ready"},
            }

    monkeypatch.setattr(common, "engine_client", lambda store, name: _Client())
    df = fleet_views.fleet_overview(store)
    assert df["state"].tolist() == ["UP"] * 6
    assert df["k_current"].tolist() == [2] * 6
    assert fleet.open_alert_counts(store) == {}
    store.close()
