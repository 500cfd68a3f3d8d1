"""Settings in one home: every SPECPILOT_* variable is declared and read in engine_host.envs."""

from __future__ import annotations

import re
import warnings
from pathlib import Path

import pytest

from control.db import default_url
from engine_host import envs

ROOT = Path(__file__).resolve().parent.parent


def test_store_url_prefers_the_new_name_and_reads_the_old_one_with_a_warning():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert (
            envs.db_url({envs.DB_URL: "sqlite:///a.db", envs.DB_URL_DEPRECATED: "sqlite:///b.db"}) == "sqlite:///a.db"
        )
        assert envs.db_url({}) is None
    with pytest.warns(FutureWarning, match="SPECPILOT_DB_URL"):
        assert envs.db_url({envs.DB_URL_DEPRECATED: "sqlite:///b.db"}) == "sqlite:///b.db"


def test_the_store_opens_the_deprecated_url_too(monkeypatch, tmp_path):
    monkeypatch.delenv(envs.DB_URL, raising=False)
    monkeypatch.setenv(envs.DB_URL_DEPRECATED, f"sqlite:///{tmp_path / 'old.db'}")
    with pytest.warns(FutureWarning):
        assert default_url() == f"sqlite:///{tmp_path / 'old.db'}"
    monkeypatch.setenv(envs.DB_URL, f"sqlite:///{tmp_path / 'new.db'}")
    assert default_url() == f"sqlite:///{tmp_path / 'new.db'}"


def test_readers_give_documented_defaults():
    assert envs.warmup({}) == "full"
    assert envs.metrics_source({envs.METRICS_SOURCE: " Prometheus "}) == "prometheus"
    assert envs.metrics_source({}) == "embedded"
    assert envs.chromium({}) == "/usr/bin/chromium"
    assert envs.control_token({envs.CONTROL_TOKEN: ""}) is None
    assert envs.home_dir({envs.HOME: "~/x"}) == Path("~/x").expanduser()


def test_every_variable_the_product_names_is_declared_in_envs():
    names = set()
    for pkg in ("engine_host", "control", "dashboard", "bench", "migrations"):
        for path in (ROOT / pkg).rglob("*.py"):
            names |= set(re.findall(r"SPECPILOT_[A-Z0-9_]*[A-Z0-9]", path.read_text()))
    assert names - set(envs.VARIABLES) - {"SPECPILOT_VENV"} == set()
    assert all(doc for doc in envs.VARIABLES.values())


def test_an_empty_step_trace_setting_in_an_engine_spec_turns_the_trace_off():
    """scripts/gpu/paired_table.sh's `k0_notrace` engine host: ``SPECPILOT_STEP_TRACE=`` before its
    arguments overrides the trace path the run exports, and an empty path is no trace."""
    from bench.gpu_bench import split_env
    from engine_host import envs

    env, argv = split_env("SPECPILOT_STEP_TRACE= --core-cpu auto --k 0")
    assert env == {envs.STEP_TRACE: ""} and argv == ["--core-cpu", "auto", "--k", "0"]
    assert envs.step_trace({envs.STEP_TRACE: "/tmp/steps.csv"} | env) is None  # the spec's setting wins
    assert envs.step_trace({envs.STEP_TRACE: "/tmp/steps.csv"}) == "/tmp/steps.csv"
