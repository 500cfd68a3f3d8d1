"""The offline GPU payload's bundles (scripts/gpu/payload.py): split into parts, checked on
arrival, installed only when complete. No GPU and no network: small stand-in files."""

from __future__ import annotations

import importlib.util
import json
import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def payload():
    spec = importlib.util.spec_from_file_location("gpu_payload", ROOT / "scripts" / "gpu" / "payload.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # dataclasses look their module up there
    spec.loader.exec_module(mod)
    return mod


def _bundle(payload, tmp_path: Path, name: str, files: dict[str, bytes], part_mib: int = 1) -> dict:
    stage = tmp_path / f"stage-{name}"
    for rel, data in files.items():
        (stage / rel).parent.mkdir(parents=True, exist_ok=True)
        (stage / rel).write_bytes(data)
    return payload.split_bundle(stage, tmp_path / "out", name, part_mib)


def _arrive(tmp_path: Path, folders: list[Path]) -> Path:
    parts = tmp_path / "scratch" / "parts"
    parts.mkdir(parents=True, exist_ok=True)
    for d in folders:
        for f in d.iterdir():
            (parts / f.name).write_bytes(f.read_bytes())
    return parts


def test_parts_fit_one_transfer_and_each_folder_carries_the_part_list(payload, tmp_path):
    data = bytes(range(256)) * (3 * 4096 + 17)  # about 3.2 MiB
    summary = _bundle(payload, tmp_path, "qwen15", {"gguf/m.Q4_K_M.gguf": data})
    folders = sorted((tmp_path / "out").glob("qwen15-*"))
    assert len(folders) == len(summary["parts"]) == 4
    for d in folders:
        assert (d / "qwen15.parts.json").is_file()
        assert all(f.stat().st_size <= 1 << 20 for f in d.glob("*.tar.part-*"))


def test_a_bundle_is_installed_only_when_every_part_arrived_intact(payload, tmp_path):
    data = b"gguf" * 700_000
    _bundle(payload, tmp_path, "extra", {"gguf/x.bin": data})
    folders = sorted((tmp_path / "out").glob("extra-*"))
    scratch = tmp_path / "scratch"
    _arrive(tmp_path, folders[:-1])
    assert payload.install(scratch) == {"extra": f"waiting: {len(folders) - 1} of {len(folders)} parts"}
    assert not (scratch / "root" / "gguf").exists()

    parts = _arrive(tmp_path, folders[-1:])
    last = sorted(parts.glob("*.tar.part-*"))[-1]
    good = last.read_bytes()
    last.write_bytes(good[:-1] + bytes([good[-1] ^ 1]))
    assert payload.install(scratch) == {"extra": "corrupt"}

    last.write_bytes(good)
    assert payload.install(scratch) == {"extra": "installed"}
    assert (scratch / "root" / "gguf" / "x.bin").read_bytes() == data
    assert not list(parts.glob("*.tar.part-*"))  # parts removed once unpacked
    assert payload.install(scratch) == {"extra": "already"}


def test_check_reports_missing_parts_per_bundle(payload, tmp_path, capsys):
    _bundle(payload, tmp_path, "extra", {"a.bin": b"x" * 2_500_000})
    folders = sorted((tmp_path / "out").glob("extra-*"))
    parts = _arrive(tmp_path, folders[:1])
    assert payload.check(parts) == 1
    assert json.loads(capsys.readouterr().out.strip())["extra"]["missing"] == len(folders) - 1


def test_033_profile_carries_the_torch_stack_vllm_pins(payload):
    p = payload.PROFILES["0.33.0"]
    assert p.vllm_wheel == "vllm-0.33.0-cp38-abi3-manylinux_2_28_x86_64.whl"
    assert set(p.big_wheels) == {"torch==2.14.0", "triton==3.8.0", "nvidia-nccl-cu13==2.32.3"}
    for w in ("torchvision==0.29.0", "compressed-tensors==0.17.0", "loguru", "xgrammar==0.2.8"):
        assert w in p.wheels
    names = [payload._dist_name(s) for s in p.wheels + p.big_wheels]
    assert len(names) == len(set(names)), "one version of each wheel"


def test_gpu_payload_tooling_is_not_in_the_package_and_the_gpu_extra_is_pinned():
    cfg = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert not (ROOT / "bench" / "gpu_payload.py").exists()
    assert "scripts*" not in cfg["tool"]["setuptools"]["packages"]["find"]["include"]
    gpu = cfg["project"]["optional-dependencies"]["gpu"]
    assert "vllm==0.33.0" in gpu and "torch==2.14.0" in gpu


def test_build_with_qwen_refuses_before_any_work_when_the_model_tools_cannot_import(
    payload, tmp_path, monkeypatch, capsys
):
    """The qwen step needs the project's environment (tqdm, gguf); found missing only after the
    core bundle's minutes of downloads and compression, the whole build would be lost."""
    import bench

    def no_build(*args, **kwargs):
        raise AssertionError("the core bundle was started")

    monkeypatch.setattr(payload, "build_core", no_build)  # a failure here must not download anything
    monkeypatch.setitem(sys.modules, "bench.qwen_models", None)  # importing it raises ImportError,
    monkeypatch.delattr(bench, "qwen_models", raising=False)  # also where another test imported it
    out = tmp_path / "out"
    with pytest.raises(SystemExit) as exc:
        payload.main(["build", "--qwen", "target", "--out", str(out), "--cache", str(tmp_path / "cache")])
    assert exc.value.code == 2
    assert "--qwen needs the project's environment" in capsys.readouterr().err
    assert not out.exists()  # nothing built, nothing downloaded


def test_the_gpu_scripts_parse_and_the_table_script_says_its_usage():
    """The GPU host runs these unattended; a syntax error there costs a whole GPU session."""
    import subprocess

    scripts = sorted((ROOT / "scripts" / "gpu").glob("*.sh"))
    assert any(p.name == "paired_table.sh" for p in scripts)
    for path in scripts:
        res = subprocess.run(["bash", "-n", str(path)], capture_output=True, text=True)
        assert res.returncode == 0, (path.name, res.stderr)
    res = subprocess.run(["bash", str(ROOT / "scripts" / "gpu" / "paired_table.sh")], capture_output=True, text=True)
    assert res.returncode != 0 and "usage: paired_table.sh MODEL RESULTS" in res.stderr


def test_the_table_scripts_vllm_k0_engine_gets_a_speculative_config_vllm_can_read():
    """`SERVE_K0=1`'s engine: the JSON survives the script's quoting and the engine spec's split, and gives
    the engine hosts' ngram_gpu config at K_max with K = 0 at every batch size and no SpecPilot plugin."""
    import os
    import subprocess

    from bench.gpu_bench import split_env
    from engine_host.speculation import NGRAM_LOOKUP

    script = (ROOT / "scripts" / "gpu" / "paired_table.sh").read_text()
    script_lines = script.splitlines()
    start = next(i for i, ln in enumerate(script_lines) if ln.startswith("SPEC_K0="))
    lines = [ln for ln in script_lines if ln.startswith("PLAIN=")] + script_lines[start : start + 2]
    spec_line = next(ln for ln in script_lines if "serve:vk0:" in ln)
    spec = spec_line[spec_line.index("${SERVE_K0:+") :].split("}", 1)[0] + "}"  # the script's own words
    shell = "\n".join(["K_MAX=4 GPU_UTIL=0.14 KV_BYTES=1 SERVE_K0=1", *lines, f'set -- {spec}; printf "%s" "$2"'])
    path = f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"  # python3: this environment's
    res = subprocess.run(
        ["bash", "-c", shell], capture_output=True, text=True, check=True, cwd=ROOT, env={**os.environ, "PATH": path}
    )
    name_args = res.stdout.split(":", 2)
    assert name_args[:2] == ["serve", "vk0"]
    env, argv = split_env(name_args[2])
    assert env == {}  # bench.gpu_bench then starts it with VLLM_PLUGINS="": no SpecPilot part
    config = json.loads(argv[argv.index("--speculative-config") + 1])
    assert config["method"] == "ngram_gpu" and config["num_speculative_tokens"] == 4
    assert {k: config[k] for k in NGRAM_LOOKUP} == NGRAM_LOOKUP
    assert config["num_speculative_tokens_per_batch_size"] == [[1, 1048576, 0]]
