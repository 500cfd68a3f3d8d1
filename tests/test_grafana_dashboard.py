"""The shipped Grafana dashboard against a real Prometheus scraping the real engine host
(and the control plane's exporter): every panel's query and the config-version
annotation return data; and on this engine, Prometheus mode and the embedded collector
give the same windowed figures.

Run under /work/bin/engine-slot on shared machines (it uses the session engine host)."""

from __future__ import annotations

import json
import math
import os
import threading
import time
from pathlib import Path

import httpx
import pytest

from control.apply import apply_change, reconcile
from control.collector import Collector
from control.exporter import serve as serve_exporter
from control.promsource import PrometheusSource, instance_of, store_window
from control.store import Store, add_host
from tests.support import PrometheusServer, free_port, why_no_prometheus

pytestmark = pytest.mark.engine

ROOT = Path(__file__).resolve().parent.parent
DASHBOARD = ROOT / "deploy" / "grafana" / "specpilot-speculation.json"
RULES = ROOT / "deploy" / "prometheus" / "specpilot-rules.yml"
MODEL = "SmolLM2-135M-Instruct"
PROMPT = "Copy this list exactly, then copy it again: red apple, green pear, yellow banana, purple plum, red apple,"


def dashboard_queries() -> list[tuple[str, str]]:
    """``(where, PromQL)`` of every panel target and annotation of the dashboard."""
    dash = json.loads(DASHBOARD.read_text())
    out = []
    for p in dash["panels"]:
        for t in p.get("targets", []):
            out.append((f"panel {p['title']!r} target {t['refId']}", t["expr"]))
    for a in dash["annotations"]["list"]:
        if a.get("expr"):
            out.append((f"annotation {a['name']!r}", a["expr"]))
    return out


def as_grafana_would(expr: str) -> str:
    """Grafana's variables as Grafana fills them: all instances, a 15 s rate window."""
    return expr.replace("$instance", ".*").replace("$__rate_interval", "15s")


def test_dashboard_json_is_well_formed():
    dash = json.loads(DASHBOARD.read_text())
    titles = {p["title"] for p in dash["panels"]}
    for want in (
        "Draft length K in force",
        "Acceptance per draft position",
        "E(K): tokens per request per step",
        "Goodput: predicted vs measured",
        "Controller overhead",
    ):
        assert want in titles
    assert any(a.get("name") == "Config versions" for a in dash["annotations"]["list"])
    ids = [p["id"] for p in dash["panels"]]
    assert len(ids) == len(set(ids))
    assert len(dashboard_queries()) >= 15


def _load(url: str, stop: threading.Event) -> None:
    with httpx.Client(base_url=url, timeout=120) as c:
        while not stop.is_set():
            c.post("/v1/completions", json={"model": MODEL, "prompt": PROMPT, "max_tokens": 48, "temperature": 0})


def _wait(what, check, timeout_s=60.0):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        v = check()
        if v:
            return v
        time.sleep(0.25)
    pytest.fail(f"timed out after {timeout_s:.0f} s waiting for {what}")


def test_every_panel_returns_data_and_both_sources_agree(engine_host, restore_config, tmp_path, monkeypatch):
    missing = why_no_prometheus()
    if missing:
        if os.environ.get("CI", "").lower() == "true":
            pytest.fail(f"CI runs the Prometheus tests: {missing}")
        pytest.skip(missing)
    monkeypatch.setenv("SPECPILOT_CONTROL_TOKEN", engine_host.token)
    store = Store.open(f"sqlite:///{tmp_path / 'specpilot.db'}")
    add_host(store, "local", engine_host.url)
    reconcile(store, "local")
    export_port = free_port()
    exporter, _ = serve_exporter(store, export_port, addr="127.0.0.1")
    inst = instance_of(engine_host.url)
    prom = PrometheusServer(
        [inst],
        scrape_interval_s=1.0,
        rule_files=[RULES],
        extra_scrape_configs=[
            {
                "job_name": "specpilot_control",
                "honor_labels": True,
                "static_configs": [{"targets": [f"127.0.0.1:{export_port}"]}],
            }
        ],
    )
    collector = Collector(store, interval_s=1.0, hosts_refresh_s=0.5)
    stop = threading.Event()
    loaders = [threading.Thread(target=_load, args=(engine_host.url, stop)) for _ in range(2)]
    try:
        prom.start()
        collector.start()
        res = apply_change(store, "local", {"speculation": {"mode": "fixed", "k": 2}}, reason="dashboard test")
        assert res.ok
        exported = httpx.get(f"http://127.0.0.1:{export_port}/metrics", timeout=10).text
        assert f'engine_instance="{inst}"' in exported, exported
        prom.wait_scraped("specpilot:control_config_version", n=1)
        src = PrometheusSource(prom.url)
        _wait(
            "Prometheus to see the new config version",
            lambda: (
                src.window([inst], window_s=5, figures=["config_version"])[inst]["config_version"]
                == float(res.engine_version)
            ),
        )
        time.sleep(2.5)
        t0 = math.floor(time.time()) - 1
        for t in loaders:
            t.start()
        time.sleep(5)
        assert apply_change(store, "local", {"speculation": {"mode": "fixed", "k": 3}}, reason="dashboard test").ok
        time.sleep(5)
        stop.set()
        for t in loaders:
            t.join(timeout=120)
        time.sleep(4)  # idle again: both sources have the final counters
        end = math.floor(time.time()) - 1
        # the same figures from both sources (counts and histograms; gauges are sampled
        # at different instants by the two scrapers, so they are compared on the stand-in host)
        from_prom = src.window([inst], end, end - t0)[inst]
        from_store = store_window(store, "local", end, end - t0)
        assert from_store["output_tokens"] > 0 and from_store["draft_tokens"] > 0
        for f in (
            "output_tokens",
            "requests_finished",
            "draft_tokens",
            "accepted_tokens",
            "acceptance_rate",
            "ttft_p50_ms",
            "ttft_p99_ms",
            "itl_p50_ms",
            "itl_p99_ms",
            "e2e_p95_ms",
            "queue_p99_ms",
            "k",
            "config_version",
        ):
            a, b = from_store[f], from_prom[f]
            assert a is not None and b == pytest.approx(a, rel=1e-6, abs=1e-6), (f, a, b)
        # every panel returns data over the test's span
        empty = []
        for where, expr in dashboard_queries():
            res = httpx.get(
                f"{prom.url}/api/v1/query_range",
                params={"query": as_grafana_would(expr), "start": t0 - 10, "end": time.time(), "step": "1s"},
                timeout=30,
            ).json()
            assert res["status"] == "success", (where, res)
            values = [float(v) for s in res["data"]["result"] for _, v in s["values"]]
            if not any(math.isfinite(v) for v in values):
                empty.append(where)
        assert not empty, f"no data for: {empty}"
    finally:
        stop.set()
        collector.stop()
        prom.stop()
        exporter.shutdown()
        store.close()
