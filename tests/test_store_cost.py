"""The cost model and the weekly report on constructed samples (numbers worked out by
hand), and the fleet views; on SQLite and PostgreSQL."""

from __future__ import annotations

import csv
import io
import time

import pytest
from sqlalchemy import update

from control.cost import BadBaseline, week_ending, weekly_report
from control.fleet import fleet_series, fleet_status
from control.models import ConfigVersion
from control.samples import insert_samples
from control.store import Store, add_host
from control.versions import record_version
from tests.support import BACKENDS, database_url, synthetic_sample

DAY = 86400


@pytest.fixture(params=BACKENDS)
def store(request, tmp_path):
    s = Store.open(database_url(request.param, tmp_path))
    yield s
    s.close()


def _minutes(start: int, n: int, **kw) -> list[dict]:
    rows = []
    for i in range(n):
        r = synthetic_sample(start + 60 * i, covered_s=60.0, **kw)
        r["resolution_s"] = 60
        rows.append(r)
    return rows


@pytest.fixture
def fleet(store):
    """Host a (3.6 USD/h): 1 h at K=0 and 100 tokens/s, 1 h at K=4 and 150 tokens/s, 2 h idle.
    Host b (1 USD/h): 1 h at K=2 and 50 tokens/s. All on one UTC day D."""
    day = int(time.time() // DAY) * DAY - DAY
    a = add_host(store, "a", "http://127.0.0.1:9", usd_per_hour=3.6, gpu_kind="H100")
    b = add_host(store, "b", "http://127.0.0.1:10", usd_per_hour=1.0, gpu_kind="L4")
    insert_samples(
        store,
        a.id,
        _minutes(day, 60, tokens_per_s=100.0, k=0.0, acceptance=0.0)
        + _minutes(day + 3600, 60, tokens_per_s=150.0, k=4.0, acceptance=0.7)
        + _minutes(day + 7200, 120, busy=False, k=4.0),
    )
    insert_samples(store, b.id, _minutes(day, 60, tokens_per_s=50.0, k=2.0, acceptance=0.5))
    for n, at in ((1, day), (2, day + 3600)):  # versions 1 (K=0) and 2 (K=4) of host a, applied at these times
        v = record_version(
            store,
            a.id,
            config={"speculation": {"k": 0 if n == 1 else 4}},
            author="t",
            reason="r",
            source="apply",
            base=None,
            status="applied",
        )
        with store.writer() as s:
            s.execute(update(ConfigVersion).where(ConfigVersion.id == v.id).values(finished_at=at))
    return day


def test_weekly_report_per_host_figures(store, fleet):
    rep = weekly_report(store, end=fleet + DAY)
    a = next(h for h in rep.hosts if h["host"] == "a")
    assert a["uptime_h"] == pytest.approx(4.0) and a["busy_h"] == pytest.approx(2.0)
    assert a["utilisation"] == pytest.approx(0.5)
    assert a["output_tokens"] == 900_000
    assert a["usd"] == pytest.approx(14.4)
    assert a["usd_per_million_tokens"] == pytest.approx(16.0)
    assert a["busy_tokens_per_s"] == pytest.approx(125.0)
    # Baseline K=0 measured at 100 tokens/s: serving 900k tokens would have taken 2.5 busy hours.
    assert a["baseline_tokens_per_s"] == pytest.approx(100.0)
    assert a["saving_usd"] == pytest.approx(1.8)
    assert a["saving_fraction"] == pytest.approx(0.2)
    # the same 4 h of uptime with 2.5 h busy instead of 2: 16.2 USD for 0.9 M tokens
    assert a["baseline_usd_per_million_tokens"] == pytest.approx(18.0)
    b = next(h for h in rep.hosts if h["host"] == "b")
    assert b["usd"] == pytest.approx(1.0) and b["output_tokens"] == 180_000
    assert b["saving_usd"] is None and "not enough" in b["baseline_note"]


def test_weekly_report_days_and_fleet(store, fleet):
    rep = weekly_report(store, end=fleet + DAY)
    day = time.strftime("%Y-%m-%d", time.gmtime(fleet))
    assert [(d["day"], d["host"]) for d in rep.days] == [(day, "a"), (day, "b")]
    assert rep.fleet["usd"] == pytest.approx(15.4)
    assert rep.fleet["output_tokens"] == 1_080_000
    assert rep.fleet["usd_per_million_tokens"] == pytest.approx(15.4 / 1.08, abs=1e-3)
    assert rep.fleet["saving_usd"] == pytest.approx(1.8)
    assert rep.fleet_days[0]["usd"] == pytest.approx(15.4)
    rows = list(csv.DictReader(io.StringIO(rep.to_csv())))
    assert [(r["scope"], r["host"]) for r in rows] == [
        ("day", "a"),
        ("day", "b"),
        ("day", "(fleet)"),
        ("week", "a"),
        ("week", "b"),
        ("week", "(fleet)"),
    ]
    assert float(rows[3]["usd"]) == pytest.approx(14.4) and float(rows[3]["saving_usd"]) == pytest.approx(1.8)


def test_baseline_can_be_an_earlier_config_version(store, fleet):
    rep = weekly_report(store, end=fleet + DAY, host="a", baseline="version:1")
    (a,) = rep.hosts
    assert a["baseline_tokens_per_s"] == pytest.approx(100.0) and a["saving_usd"] == pytest.approx(1.8)
    rep2 = weekly_report(store, end=fleet + DAY, host="a", baseline="version:2")
    assert rep2.hosts[0]["baseline_tokens_per_s"] == pytest.approx(150.0)
    assert rep2.hosts[0]["saving_usd"] == pytest.approx(-1.2)  # 900k tokens at 150 tokens/s: 6000 busy s, not 7200
    assert weekly_report(store, end=fleet + DAY, host="a", baseline="version:9").hosts[0]["saving_usd"] is None
    with pytest.raises(BadBaseline):
        weekly_report(store, baseline="k=0")


def test_a_week_without_data_is_all_zero(store, fleet):
    rep = weekly_report(store, end=fleet - 30 * DAY)
    assert rep.days == [] and rep.fleet["usd"] == 0 and rep.fleet["usd_per_million_tokens"] is None


def test_week_ending_is_the_end_of_that_utc_day():
    assert week_ending("2026-11-22") - week_ending("2026-11-21") == DAY
    with pytest.raises(ValueError):
        week_ending("last week")


def test_fleet_series_sums_rates_averages_fractions_and_takes_worst_latency(store, fleet):
    s = fleet_series(
        store, ["output_tokens_per_s", "kv_cache_usage", "ttft_p99_ms"], fleet, fleet + 120, resolution_s=60
    )
    assert s["t"] == [fleet, fleet + 60]
    assert s["output_tokens_per_s"] == [150.0, 150.0]  # 100 + 50
    assert s["kv_cache_usage"][0] == pytest.approx(0.3)
    assert s["hosts"]["a"]["output_tokens_per_s"] == [100.0, 100.0]


def test_fleet_status_lists_every_host(store, fleet):
    now = time.time()
    a = add_host(store, "c", "http://127.0.0.1:11")
    insert_samples(store, a.id, [synthetic_sample(int(now) - 2)])
    rows = {r["host"]: r for r in fleet_status(store, now=now)}
    assert set(rows) == {"a", "b", "c"}
    assert rows["c"]["up"] and not rows["a"]["up"]  # a has no recent 1 s sample
    assert rows["a"]["control_version"] == 2 and rows["c"]["output_tokens_per_s"] == 100.0
