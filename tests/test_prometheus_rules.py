"""The shipped Prometheus alert rules (deploy/prometheus/) pass ``promtool check rules``
and their unit tests (``promtool test rules``), and the example config is valid."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

from tests.support import why_no_prometheus

DEPLOY = Path(__file__).resolve().parent.parent / "deploy" / "prometheus"


@pytest.fixture(autouse=True)
def _need_promtool():
    missing = why_no_prometheus()
    if missing:
        if os.environ.get("CI", "").lower() == "true":
            pytest.fail(f"CI runs the Prometheus tests: {missing}")
        pytest.skip(missing)


def _promtool(*args: str, cwd: Path = DEPLOY) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["promtool", *args], capture_output=True, text=True, cwd=cwd, timeout=120)


def test_rules_pass_promtool_check():
    r = _promtool("check", "rules", "specpilot-rules.yml")
    assert r.returncode == 0, r.stdout + r.stderr
    assert "SUCCESS: 7 rules found" in r.stdout


def test_rules_unit_tests_pass():
    r = _promtool("test", "rules", "specpilot-rules.test.yml")
    assert r.returncode == 0, r.stdout + r.stderr


def test_every_required_alert_is_shipped():
    text = (DEPLOY / "specpilot-rules.yml").read_text()
    for name in (
        "SpecPilotLowAcceptance",
        "SpecPilotKVCacheFull",
        "SpecPilotQueueTimeHigh",
        "SpecPilotHostDown",
        "SpecPilotConfigDrift",
    ):
        assert f"alert: {name}" in text
        assert name in (DEPLOY / "specpilot-rules.test.yml").read_text()


def test_a_broken_rule_is_caught(tmp_path):
    """The check is real: a rule with a PromQL error fails it."""
    bad = tmp_path / "bad.yml"
    bad.write_text(
        (DEPLOY / "specpilot-rules.yml")
        .read_text()
        .replace("vllm:kv_cache_usage_perc > 0.9", "vllm:kv_cache_usage_perc >> 0.9")
    )
    assert _promtool("check", "rules", str(bad)).returncode != 0


def test_a_wrong_threshold_fails_the_unit_tests(tmp_path):
    shutil.copy(DEPLOY / "specpilot-rules.test.yml", tmp_path)
    (tmp_path / "specpilot-rules.yml").write_text(
        (DEPLOY / "specpilot-rules.yml")
        .read_text()
        .replace("specpilot:acceptance_rate:rate1m < 0.5", "specpilot:acceptance_rate:rate1m < 0.2")
    )
    assert _promtool("test", "rules", "specpilot-rules.test.yml", cwd=tmp_path).returncode != 0


def test_example_config_is_valid(tmp_path):
    shutil.copy(DEPLOY / "prometheus.yml", tmp_path)
    shutil.copy(DEPLOY / "specpilot-rules.yml", tmp_path)
    r = _promtool("check", "config", str(tmp_path / "prometheus.yml"))
    assert r.returncode == 0, r.stdout + r.stderr
