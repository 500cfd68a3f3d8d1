"""bench torch-profile: its per-step summary of profiler events and its labelled regions."""

from __future__ import annotations

import sys
import types
from dataclasses import dataclass

import pytest

from bench import torch_profile


@dataclass
class Event:
    key: str
    count: int
    cpu_time_total: float  # us
    device_time_total: float  # us
    self_device_time_total: float  # us
    device_type: str = "DeviceType.CPU"


def test_summary_per_step_regions_and_kernels_without_double_counting():
    events = [
        Event("draft model: decode passes", 10, 50_000.0, 8_000.0, 0.0),
        Event("step: execute_model (target forward)", 10, 20_000.0, 30_000.0, 0.0),
        Event("step: execute_model (target forward)", 10, 0.0, 45_000.0, 45_000.0, "DeviceType.CUDA"),  # GPU span
        Event("aten::mm", 40, 4_000.0, 12_000.0, 12_000.0),  # CPU op: its kernel is listed below
        Event("sm90_gemm_kernel", 40, 0.0, 12_000.0, 12_000.0, "DeviceType.CUDA"),
        Event("flash_fwd_kernel", 20, 0.0, 6_000.0, 6_000.0, "DeviceType.CUDA"),
        Event("Memcpy HtoD (Pinned -> Device)", 10, 0.0, 1_000.0, 1_000.0, "DeviceType.CUDA"),
    ]
    s = torch_profile.summarize(events, ["draft model: decode passes", STEP, "absent region"], steps=10)
    assert list(s["regions"]) == ["draft model: decode passes", STEP]  # by CPU time, absent left out
    assert s["regions"][STEP] == {
        "calls": 10,
        "cpu_ms_per_step": 2.0,
        "gpu_ms_per_step": 3.0,
        "gpu_span_ms_per_step": 4.5,
    }
    assert s["regions"]["draft model: decode passes"]["cpu_ms_per_step"] == 5.0
    assert s["gpu_busy_ms_per_step"] == pytest.approx(1.9)  # kernels and copies, not aten::mm again
    assert [k["name"] for k in s["kernels"]] == [
        "sm90_gemm_kernel",
        "flash_fwd_kernel",
        "Memcpy HtoD (Pinned -> Device)",
    ]
    assert s["kernels"][0]["gpu_ms_per_step"] == pytest.approx(1.2)


STEP = torch_profile.STEP_LABEL


def test_summary_refuses_zero_steps():
    with pytest.raises(ValueError, match="steps"):
        torch_profile.summarize([], [], steps=0)


def test_regions_wrap_count_and_restore(monkeypatch):
    mod = types.ModuleType("fake_runner_mod")

    class Runner:
        def execute_model(self, x):
            return x + 1

    mod.Runner = Runner
    monkeypatch.setitem(sys.modules, "fake_runner_mod", mod)
    original = Runner.__dict__["execute_model"]
    regions = torch_profile.Regions(
        [("fake_runner_mod", "Runner", "execute_model", "step"), ("no.such.module", "X", "y", "absent")]
    )
    with regions:
        assert regions.wrapped == ["Runner.execute_model"]
        r = Runner()
        assert r.execute_model(1) == 2 and r.execute_model(2) == 3
        assert regions.calls == {"step": 2}
        regions.reset()
        assert regions.calls == {}
    assert Runner.__dict__["execute_model"] is original


def test_regions_name_vllm_methods_that_exist():
    """Every V2 region of the list names a method of the installed vLLM's Model Runner V2
    (the list goes stale when vLLM renames them)."""
    import importlib

    missing = []
    for module, cls, method, _ in torch_profile.REGIONS:
        if ".worker.gpu." not in module:
            continue
        try:
            c = getattr(importlib.import_module(module), cls)
        except (ImportError, AttributeError):
            missing.append(f"{module}.{cls}")
            continue
        if method not in c.__dict__:
            missing.append(f"{cls}.{method}")
    assert not missing, missing


def test_cli_refuses_bad_batches_and_missing_draft(capsys):
    assert torch_profile.main(["--model", "m", "--batches", "1,x"]) == 2
    assert "--batches" in capsys.readouterr().err
    assert torch_profile.main(["--model", "m", "--speculative-method", "draft_model"]) == 2
    assert "--draft-model" in capsys.readouterr().err


def test_parse_llm_args_json_or_text():
    assert torch_profile.parse_llm_args(["async_scheduling=false", "block_size=32", "x=abc", "y=a=b"]) == {
        "async_scheduling": False,
        "block_size": 32,
        "x": "abc",
        "y": "a=b",
    }
    with pytest.raises(ValueError, match="KEY=VALUE"):
        torch_profile.parse_llm_args(["novalue"])
    with pytest.raises(ValueError):
        torch_profile.parse_llm_args(["=1"])


def test_top_frames_self_and_inclusive_once_per_sample():
    raw = "main;step;fwd 5\nmain;step;sample 3\nmain;main;idle 2\nbroken line\n"
    t = torch_profile.top_frames(raw)
    assert t["samples"] == [("all", 10)]
    assert t["self"][0] == ("fwd", 5)
    assert dict(t["inclusive"])["main"] == 10  # recursion counted once per sample
    assert dict(t["inclusive"])["step"] == 8
