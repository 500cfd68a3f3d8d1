"""Metric samples in the store, on SQLite and PostgreSQL: chart series, downsampling to
1 min / 1 h with retention, gaps, the collector against a stand-in host (gap when it is
down, samples when it is up), and a writer killed mid-write."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest
from sqlalchemy import func, select, text

from control.alerts import AlertEvaluator
from control.collector import Collector, HostCollector
from control.models import MetricSample
from control.samples import (
    Retention,
    choose_resolution,
    downsample,
    gaps,
    insert_samples,
    latest_sample,
    samples,
    series,
)
from control.store import Store, UnknownHost, add_host, get_host
from control.versions import history
from tests.support import BACKENDS, FakeEngineHost, database_url, synthetic_sample

T0 = 1_700_000_000 - (1_700_000_000 % 3600)  # an hour boundary


@pytest.fixture(params=BACKENDS)
def db_url(request, tmp_path):
    return database_url(request.param, tmp_path)


@pytest.fixture
def store(db_url):
    s = Store.open(db_url)
    yield s
    s.close()


def _count(store: Store, resolution: int) -> int:
    with store.reader() as s:
        return s.scalar(select(func.count()).select_from(MetricSample).where(MetricSample.resolution_s == resolution))


def test_series_returns_columns_in_time_order(store):
    h = add_host(store, "h", "http://127.0.0.1:9")
    insert_samples(store, h.id, [synthetic_sample(T0 + i, tokens_per_s=10.0 * i) for i in range(5)][::-1])
    s = series(store, "h", ["output_tokens_per_s", "ttft_p99_ms"], T0, T0 + 5, resolution_s=1)
    assert s["resolution_s"] == 1 and s["t"] == [T0 + i for i in range(5)]
    assert s["output_tokens_per_s"] == [0.0, 10.0, 20.0, 30.0, 40.0]
    assert latest_sample(store, "h")["t"] == T0 + 4
    with pytest.raises(ValueError):
        series(store, "h", ["no_such_column"], T0, T0 + 5)
    with pytest.raises(UnknownHost):
        series(store, "other", ["k"], T0, T0 + 5)


def test_resolution_follows_range_and_retention():
    now = T0 + 30 * 86400
    assert choose_resolution(now - 600, now, now=now) == 1
    assert choose_resolution(now - 2 * 3600, now, now=now) == 60  # 1 s rows are kept for an hour
    assert choose_resolution(now - 7 * 86400, now, now=now) == 60
    assert choose_resolution(now - 7 * 86400, now, now=now, max_points=1000) == 3600
    assert choose_resolution(now - 90 * 86400, now, now=now) == 3600


def test_downsampling_rolls_up_minutes_and_hours_and_applies_retention(store):
    h = add_host(store, "h", "http://127.0.0.1:9")
    rows = [synthetic_sample(T0 + i, tokens_per_s=100.0 if (i // 60) % 2 else 50.0, k=2.0) for i in range(2 * 3600)]
    insert_samples(store, h.id, rows)
    now = T0 + 2 * 3600 + 10
    stats = downsample(store, now=now)
    assert stats["rolled_60"] == 120 and stats["rolled_3600"] == 2
    assert _count(store, 1) == 3590  # only 1 s rows of the last hour (since now - 3600 s) are kept
    minute = series(store, "h", ["output_tokens_per_s", "output_tokens", "covered_s"], T0, now, resolution_s=60)
    assert minute["t"][:3] == [T0, T0 + 60, T0 + 120]
    assert minute["output_tokens_per_s"][:2] == [50.0, 100.0] and minute["covered_s"][0] == 60
    hour = samples(store, "h", T0, now, resolution_s=3600)
    assert [r["output_tokens"] for r in hour] == [75.0 * 3600] * 2
    assert hour[0]["ttft_p99_ms"] == pytest.approx(59.7, abs=0.5)  # from merged buckets (0.04, 0.06]
    assert downsample(store, now=now) == {"rolled_60": 0, "rolled_3600": 0, "deleted": 0}  # idempotent
    later = now + 31 * 86400
    downsample(store, now=later, retention=Retention(hour_s=40 * 86400))
    assert _count(store, 1) == 0 and _count(store, 60) == 0 and _count(store, 3600) == 2
    downsample(store, now=later + 10 * 86400, retention=Retention(hour_s=40 * 86400))
    assert _count(store, 3600) == 0


def test_gaps_open_once_and_close(store):
    from control.samples import close_gap, open_gap

    h = add_host(store, "h", "http://127.0.0.1:9")
    g1 = open_gap(store, h.id, 100.0, "refused")
    assert open_gap(store, h.id, 105.0, "refused again") == g1
    assert close_gap(store, h.id, 130.0) == 1 and close_gap(store, h.id, 140.0) == 0
    (g,) = gaps(store, "h", 0, 1000)
    assert (g.started_at, g.ended_at, g.reason) == (100.0, 130.0, "refused")
    assert gaps(store, "h", 200, 300) == []


@pytest.fixture
def fake(monkeypatch):
    f = FakeEngineHost(token="tok").start()
    monkeypatch.setenv("SPECPILOT_CONTROL_TOKEN", "tok")
    yield f
    f.stop()


def test_host_collector_stores_samples_records_gap_and_handles_restart(store, fake):
    add_host(store, "h", fake.url)
    hc = HostCollector(store, get_host(store, "h"), AlertEvaluator(store), window_s=5.0, warmup_sync_s=0)
    t = float(T0)
    assert hc.tick(t) is None  # baseline; first contact imports the engine's config
    assert [v.source for v in history(store, "h")] == ["import"]
    for i in range(1, 4):
        fake.metrics.serve(requests=2, ttft_s=0.05)
        row = hc.tick(t + i)
        assert row["output_tokens"] == 100 and row["ttft_p50_ms"] is not None
    fake.stop()
    assert hc.tick(t + 4) is None and hc.tick(t + 5) is None
    (gap,) = gaps(store, "h", 0, t + 100)
    assert gap.started_at == t + 3 and gap.ended_at is None  # from the last good scrape
    # The engine restarts with its start-up config; the collector re-applies the last applied version.
    from control.apply import apply_change

    fake.start()
    apply_change(store, "h", {"speculation": {"k": 5}}, reason="deeper")
    fake.restart()
    assert fake.config["speculation"]["k"] == 0
    assert hc.tick(t + 6) is None  # new counters: no sample, but the restart is handled
    (gap,) = gaps(store, "h", 0, t + 100)
    assert gap.ended_at == t + 6
    last = history(store, "h")[0]
    assert last.source == "reapply" and last.status == "applied" and last.rollback_of == 2
    assert fake.config["speculation"]["k"] == 5
    fake.metrics.serve(requests=1)
    assert hc.tick(t + 7)["output_tokens"] == 50
    assert len(samples(store, "h", 0, t + 100)) == 4
    hc.close()


def test_collector_daemon_follows_hosts_and_keeps_running_when_one_is_down(store, fake):
    add_host(store, "up", fake.url)
    add_host(store, "down", "http://127.0.0.1:9")
    seen = []
    c = Collector(store, interval_s=1.0, hosts_refresh_s=0.5, on_tick=lambda name, row: seen.append(name)).start()
    try:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and len(samples(store, "up", 0, time.time() + 10)) < 2:
            fake.metrics.serve(requests=1)
            time.sleep(0.3)
    finally:
        c.stop()
    assert len(samples(store, "up", 0, time.time() + 10)) >= 2
    assert "down" in seen and gaps(store, "down", 0, time.time() + 10)


_WRITER = """
import sys, time
from control.store import Store, get_host
from control.samples import insert_samples
from tests.support import synthetic_sample
store = Store.open(sys.argv[1])
hid = get_host(store, "h").id
t = int(sys.argv[2])
print("writing", flush=True)
while True:
    insert_samples(store, hid, [synthetic_sample(t + i) for i in range(10)])
    t += 10
"""


def test_writer_killed_mid_write_leaves_a_consistent_store(store, db_url):
    add_host(store, "h", "http://127.0.0.1:9")
    proc = subprocess.Popen([sys.executable, "-c", _WRITER, db_url, str(T0)], stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "writing"
    time.sleep(1.5)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    proc.stdout.close()
    reopened = Store.open(db_url)
    try:
        n = _count(reopened, 1)
        assert n > 0 and n % 10 == 0  # whole transactions only
        if reopened.dialect == "sqlite":
            with reopened.engine.connect() as conn:
                assert conn.execute(text("PRAGMA integrity_check")).scalar() == "ok"
        insert_samples(reopened, get_host(reopened, "h").id, [synthetic_sample(T0 - 1)])  # still writable
    finally:
        reopened.close()
