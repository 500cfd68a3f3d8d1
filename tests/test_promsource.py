"""Prometheus as the metric source: the same windowed figures as the embedded collector
on the same engine (a stand-in engine host driven step by step; the real engine host is
in test_grafana_dashboard.py), with a real Prometheus (Debian's package) scraping every
second beside the real collector daemon."""

from __future__ import annotations

import math
import os
import time

import pytest

from control.collector import Collector
from control.promsource import (
    ENV_SOURCE,
    ENV_URL,
    FIGURES,
    MetricSourceError,
    PrometheusSource,
    host_window,
    instance_of,
    metrics_source,
    queries,
    store_window,
)
from control.store import Store, add_host
from tests.support import FakeEngineHost, PrometheusServer, why_no_prometheus


def _need_prometheus():
    missing = why_no_prometheus()
    if missing:
        if os.environ.get("CI", "").lower() == "true":
            pytest.fail(f"CI runs the Prometheus tests: {missing}")
        pytest.skip(missing)


def test_source_setting_is_checked(monkeypatch):
    monkeypatch.delenv(ENV_SOURCE, raising=False)
    monkeypatch.delenv(ENV_URL, raising=False)
    assert metrics_source() == "embedded"
    monkeypatch.setenv(ENV_SOURCE, "prometheus")
    with pytest.raises(MetricSourceError, match="needs a server URL"):
        metrics_source()
    monkeypatch.setenv(ENV_SOURCE, "influx")
    with pytest.raises(MetricSourceError, match="not a metric source"):
        metrics_source()


def test_instance_label_comes_from_the_host_url():
    assert instance_of("http://127.0.0.1:8000") == "127.0.0.1:8000"
    assert instance_of("https://gpu-3.example.com/") == "gpu-3.example.com:443"
    with pytest.raises(ValueError):
        instance_of("not a url")


def test_queries_escape_instances_and_refuse_bad_windows():
    q = queries(["a.b:80"], 30)
    assert 'instance=~"a\\\\.b:80"' in q["output_tokens"] and "offset 30s" in q["output_tokens"]
    assert "histogram_quantile(0.99" in q["ttft_p99_ms"]
    with pytest.raises(ValueError):
        queries([], 30)
    with pytest.raises(ValueError):
        queries(["a:1"], 0)


@pytest.fixture
def fake(monkeypatch):
    f = FakeEngineHost(token="secret-token").start()
    monkeypatch.setenv("SPECPILOT_CONTROL_TOKEN", f.token)
    yield f
    f.stop()


def test_prometheus_and_collector_give_the_same_window_figures(fake, tmp_path, monkeypatch):
    _need_prometheus()
    store = Store.open(f"sqlite:///{tmp_path / 'specpilot.db'}")
    add_host(store, "h1", fake.url)
    m = fake.metrics
    m.kv.set(0.42)
    m.running.set(3)
    m.waiting.set(1)
    m.k.set(2)
    collector = Collector(store, interval_s=1.0, hosts_refresh_s=0.5).start()
    prom = PrometheusServer([instance_of(fake.url)], scrape_interval_s=1.0).start()
    try:
        prom.wait_scraped("vllm:generation_tokens_total")
        time.sleep(2.5)  # both have a flat baseline
        t0 = math.floor(time.time()) - 1
        m.serve(
            requests=7,
            output_tokens=40,
            ttft_s=0.03,
            itl_s=0.015,
            queue_s=0.002,
            drafts=50,
            draft_tokens=100,
            accepted=62,
            accepted_per_pos=[40, 22],
        )
        time.sleep(2.2)
        m.serve(
            requests=5,
            output_tokens=90,
            ttft_s=0.3,
            itl_s=0.07,
            queue_s=0.2,
            drafts=30,
            draft_tokens=60,
            accepted=18,
            accepted_per_pos=[12, 6],
        )
        time.sleep(3.5)  # both scraped the final values at least twice
        end = math.floor(time.time()) - 1
        window = end - t0
        src = PrometheusSource(prom.url)
        from_prom = src.window([instance_of(fake.url)], end, window)[instance_of(fake.url)]
        from_store = store_window(store, "h1", end, window)
        # the figures are the ones served (not merely equal to each other)
        assert from_store["output_tokens"] == 7 * 40 + 5 * 90
        assert from_store["requests_finished"] == 12
        assert from_store["acceptance_rate"] == pytest.approx(80 / 160)
        for f in FIGURES:
            a, b = from_store[f], from_prom[f]
            assert (a is None) == (b is None), (f, a, b)
            if a is not None:
                assert b == pytest.approx(a, rel=1e-6, abs=1e-6), (f, a, b)
        # the setting picks the source
        monkeypatch.setenv(ENV_SOURCE, "prometheus")
        monkeypatch.setenv(ENV_URL, prom.url)
        assert host_window(store, "h1", end, window)["output_tokens"] == from_store["output_tokens"]
        rows = src.samples(instance_of(fake.url), end - 5, end, step_s=1.0, window_s=window)
        assert rows and rows[-1]["output_tokens"] == from_store["output_tokens"]
    finally:
        prom.stop()
        collector.stop()
        store.close()


def test_an_unreachable_prometheus_is_a_clear_error():
    from tests.support import free_port

    src = PrometheusSource(f"http://127.0.0.1:{free_port()}", timeout_s=2)
    with pytest.raises(MetricSourceError, match="did not answer"):
        src.window(["127.0.0.1:1"], window_s=10)
