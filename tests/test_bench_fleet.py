"""The fleet benchmark's Prometheus backfill: every series of a stand-in engine host's
/metrics, for every instance, becomes TSDB blocks through promtool, none lost."""

from __future__ import annotations

import json
import os
import shutil

import httpx
import pytest

from bench.bench_fleet import BLOCK_S, backfill_blocks
from tests.support import FakeEngineHost


def test_backfill_writes_every_sample_into_blocks(tmp_path):
    if shutil.which("promtool") is None:
        if os.environ.get("CI", "").lower() == "true":
            pytest.fail("CI runs the Prometheus tests: promtool is missing")
        pytest.skip("promtool is not installed (Debian package prometheus)")
    f = FakeEngineHost(token="t").start()
    try:
        f.metrics.serve(
            requests=1, output_tokens=60, drafts=20, draft_tokens=40, accepted=25, accepted_per_pos=[15, 10]
        )
        template = httpx.get(f"{f.url}/metrics", timeout=10).text
    finally:
        f.stop()
    start = 1_764_000_000 // BLOCK_S * BLOCK_S + 3600  # 3 h across two 2 h blocks
    out = tmp_path / "data"
    r = backfill_blocks(template, ["10.0.0.1:8000", "10.0.0.2:8000"], start, start + 3 * 3600, out, step_s=60)
    assert r["blocks"] == 2
    assert r["samples"] == r["series"] * 180
    metas = [json.loads((d / "meta.json").read_text()) for d in out.iterdir() if (d / "meta.json").exists()]
    assert sum(m["stats"]["numSamples"] for m in metas) == r["samples"]
    assert sum(m["stats"]["numSeries"] for m in metas) >= r["series"]
    assert not list(out.glob("*.om"))  # the OpenMetrics files are removed once converted
