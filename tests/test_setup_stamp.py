"""The set-up stamp of scripts/setup.sh: a virtualenv set up with a superset of the extras
asked for is up to date (``make run`` right after ``make test`` installs nothing)."""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
RUNTIME = "cpu,model,dashboard,postgres,prometheus"
BASH = shutil.which("bash")

pytestmark = pytest.mark.skipif(BASH is None, reason="needs bash")


def _covers(venv: Path, hash_: str, extras: str) -> bool:
    r = subprocess.run(
        [
            BASH,
            "-c",
            f'set -euo pipefail; source "{ROOT}/scripts/setup_stamp.sh"; stamp_covers "$0" "$1" "$2"',
            str(venv),
            hash_,
            extras,
        ],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert r.returncode in (0, 1), r.stderr
    return r.returncode == 0


def test_a_stamp_covers_every_subset_of_its_extras(tmp_path):
    (tmp_path / f".specpilot-setup-abc-{RUNTIME.replace(',', '_')}_test").touch()
    assert _covers(tmp_path, "abc", RUNTIME)  # make run after make test
    assert _covers(tmp_path, "abc", RUNTIME + ",test")
    assert _covers(tmp_path, "abc", "test,cpu")  # any order
    assert not _covers(tmp_path, "abc", "gpu,model")  # another build
    assert not _covers(tmp_path, "abc", "cpu,model,dash")  # a prefix of an extra is not the extra
    assert not _covers(tmp_path, "def", RUNTIME)  # pyproject or the scripts changed
    assert not _covers(tmp_path / "none", "abc", RUNTIME)  # no venv yet


def test_runtime_setup_after_test_setup_installs_nothing(tmp_path):
    repo = tmp_path / "repo"
    (repo / "scripts").mkdir(parents=True)
    for f in ("pyproject.toml", "scripts/setup.sh", "scripts/setup_stamp.sh"):
        shutil.copy(ROOT / f, repo / f)
    log = tmp_path / "calls.log"
    venv_bin = repo / ".venv" / "bin"
    venv_bin.mkdir(parents=True)
    stub = venv_bin / "python"
    stub.write_text(f'#!/bin/sh\necho "$@" >> "{log}"\n')
    stub.chmod(0o755)
    fake_bin = tmp_path / "bin"  # no GPU here, whatever the machine has
    fake_bin.mkdir()
    (fake_bin / "nvidia-smi").write_text("#!/bin/sh\nexit 1\n")
    (fake_bin / "nvidia-smi").chmod(0o755)
    digest = hashlib.sha256(
        b"".join((repo / f).read_bytes() for f in ("pyproject.toml", "scripts/setup.sh", "scripts/setup_stamp.sh"))
    ).hexdigest()
    (repo / ".venv" / f".specpilot-setup-{digest[:16]}-{RUNTIME.replace(',', '_')}_test").touch()
    env = {**os.environ, "PATH": f"{fake_bin}:{os.environ['PATH']}", "SPECPILOT_VENV": ".venv"}
    r = subprocess.run([BASH, "scripts/setup.sh"], cwd=repo, env=env, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert "is up to date" in r.stdout
    calls = log.read_text()
    assert "pip install" not in calls and "engine_host.model" in calls
