"""The ``vllm serve`` command the engine host builds (no engine started)."""

from __future__ import annotations

import json

import pytest

from engine_host import launcher


def command(*argv: str) -> list[str]:
    args = launcher.build_parser().parse_args(list(argv))
    return launcher.vllm_command(args, "/models/SmolLM2-135M-Instruct", ["--seed", "3"])


def value(cmd: list[str], flag: str) -> str:
    return cmd[cmd.index(flag) + 1]


def test_speculative_engine_runs_ngram_with_the_synchronous_hook():
    cmd = command("--k-max", "6")
    assert json.loads(value(cmd, "--speculative-config")) == {
        "method": "ngram",
        "num_speculative_tokens": 6,
        "prompt_lookup_min": 2,
        "prompt_lookup_max": 4,
    }
    assert value(cmd, "--scheduler-cls") == "engine_host.scheduler.SpecPilotScheduler"
    assert "--no-async-scheduling" in cmd
    assert value(cmd, "--served-model-name") == "SmolLM2-135M-Instruct"
    assert cmd[-2:] == ["--seed", "3"]  # arguments after '--' go to vllm serve last


@pytest.mark.parametrize("cpu_build,expect_async", [(True, False), (False, True)])
def test_plain_engine_keeps_the_scheduling_vllm_would_choose(monkeypatch, cpu_build, expect_async):
    monkeypatch.setattr(launcher, "is_cpu_build", lambda: cpu_build)
    cmd = command("--k-max", "0")
    assert "--speculative-config" not in cmd
    if expect_async:  # GPU build: async scheduling on, hook on AsyncScheduler
        assert value(cmd, "--scheduler-cls") == "engine_host.scheduler.SpecPilotAsyncScheduler"
        assert "--async-scheduling" in cmd
    else:
        assert value(cmd, "--scheduler-cls") == "engine_host.scheduler.SpecPilotScheduler"
        assert "--no-async-scheduling" in cmd


def test_explicit_flags_win(monkeypatch):
    monkeypatch.setattr(launcher, "is_cpu_build", lambda: False)
    cmd = command(
        "--k-max",
        "0",
        "--no-async-scheduling",
        "--no-prefix-caching",
        "--tensor-parallel-size",
        "2",
        "--distributed-executor-backend",
        "mp",
    )
    assert "--no-async-scheduling" in cmd and "--no-enable-prefix-caching" in cmd
    assert value(cmd, "--tensor-parallel-size") == "2" and value(cmd, "--distributed-executor-backend") == "mp"
    assert "--async-scheduling" in command("--k-max", "4", "--async-scheduling")


@pytest.mark.parametrize(
    "cpu_build,native_fp16,flag,expect",
    [
        (True, False, "auto", "float32"),  # CPU without float16 arithmetic: float32
        (True, True, "auto", "float16"),
        (False, False, "auto", "auto"),  # GPU build: vLLM's own choice
        (True, False, "bfloat16", "bfloat16"),  # an explicit dtype always wins
    ],
)
def test_dtype_auto_follows_the_hardware(monkeypatch, cpu_build, native_fp16, flag, expect):
    monkeypatch.setattr(launcher, "is_cpu_build", lambda: cpu_build)
    monkeypatch.setattr(launcher, "cpu_has_native_fp16", lambda: native_fp16)
    assert value(command("--dtype", flag), "--dtype") == expect


# --- the OpenAI API key never reaches a command line (issue 18, item 12) ---------------


def test_api_key_is_not_on_vllms_command_line():
    cmd = command("--api-key", "s3cret")
    assert "s3cret" not in " ".join(cmd) and "--api-key" not in cmd


def test_api_key_comes_from_a_file_then_the_environment_then_the_flag(tmp_path, capsys):
    key_file = tmp_path / "key"
    key_file.write_text("from-file\n")
    parse = launcher.build_parser().parse_args
    assert (
        launcher.resolve_api_key(parse(["--api-key-file", str(key_file)]), env={"SPECPILOT_API_KEY": "x"})
        == "from-file"
    )
    assert launcher.resolve_api_key(parse([]), env={"SPECPILOT_API_KEY": "from-env"}) == "from-env"
    assert launcher.resolve_api_key(parse([]), env={"VLLM_API_KEY": "vllm-env"}) == "vllm-env"
    assert launcher.resolve_api_key(parse([]), env={}) is None
    assert launcher.resolve_api_key(parse(["--api-key", "flag"]), env={}) == "flag"
    assert "visible in 'ps'" in capsys.readouterr().err
    (tmp_path / "empty").write_text("\n")
    with pytest.raises(SystemExit, match="empty"):
        launcher.resolve_api_key(parse(["--api-key-file", str(tmp_path / "empty")]), env={})


def test_only_vllms_children_arm_the_orphan_guard():
    from engine_host.orphan_guard import should_guard

    assert should_guard(pid=200, env={"SPECPILOT_API_PID": "100"})  # engine core, workers
    assert not should_guard(pid=100, env={"SPECPILOT_API_PID": "100"})  # the engine host itself
    assert not should_guard(pid=200, env={})  # not started by the launcher


def test_the_launcher_starts_vllm_without_importing_it_first(tmp_path, default_model):
    """Everything ``python -m engine_host`` does before it execs ``vllm serve`` (parsing, the
    speculation checks, the control token, the command) imports neither torch nor vLLM:
    ``vllm serve`` imports them itself, so an import here only delays the start."""
    import os
    import subprocess
    import sys

    script = (
        "import os, sys\n"
        "import engine_host.launcher as L\n"
        "def done(*a, **k):\n"
        "    print('HEAVY', sorted(m for m in ('torch', 'vllm', 'transformers') if m in sys.modules))\n"
        "    os._exit(0)\n"
        "os.execvpe = done\n"
        f"sys.argv = ['engine_host', '--model', {default_model!r}, '--port', '0', '--warmup', 'quick']\n"
        "L.main()\n"
    )
    env = {**os.environ, "SPECPILOT_HOME": str(tmp_path)}
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=120)
    assert "HEAVY []" in out.stdout, out.stdout + out.stderr
