"""``python -m control`` as an operator uses it: subprocesses against a stand-in engine host
and an SQLite store; errors are one clear line, never a traceback."""

from __future__ import annotations

import csv
import os
import subprocess
import sys

import pytest

from control.cli import build_parser, main
from tests.support import FakeEngineHost

TOKEN = "cli-token"


@pytest.fixture
def fake():
    f = FakeEngineHost(token=TOKEN).start()
    yield f
    f.stop()


@pytest.fixture
def cli(tmp_path):
    db = f"sqlite:///{tmp_path / 'cli.db'}"
    env = {**os.environ, "SPECPILOT_HOME": str(tmp_path / "home"), "SPECPILOT_CONTROL_TOKEN": TOKEN, "USER": "carol"}
    env.pop("SPECPILOT_DB_URL", None)

    def run(*args: str, env_extra: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "control", "--db", db, *args], capture_output=True, text=True,
                              env={**env, **(env_extra or {})}, timeout=120)

    return run


def _commands(parser) -> list[list[str]]:
    out = [[]]
    for action in parser._actions:
        if action.__class__.__name__ == "_SubParsersAction":
            for name, sub in action.choices.items():
                out += [[name, *rest] for rest in _commands(sub)]
    return out


def test_every_command_has_help(capsys):
    commands = _commands(build_parser())
    assert ["config", "apply"] in commands and ["report", "weekly"] in commands and ["up"] in commands
    for cmd in commands:
        with pytest.raises(SystemExit) as exc:
            main([*cmd, "--help"])
        assert exc.value.code == 0
        assert "usage: python -m control" in capsys.readouterr().out


def test_operator_session(cli, fake, tmp_path):
    r = cli("hosts", "add", "gpu1", fake.url, "--usd-per-hour", "2.5", "--gpu", "H100")
    assert r.returncode == 0, r.stderr
    assert "config history starts at version 1" in r.stdout
    r = cli("hosts", "list")
    assert "gpu1" in r.stdout and "H100" in r.stdout and TOKEN not in r.stdout
    r = cli("config", "apply", "--host", "gpu1", "--mode", "fixed", "--k", "4", "--reason", "copy-heavy traffic")
    assert r.returncode == 0, r.stderr
    assert "version 2 applied" in r.stdout and "speculation.k: 0 -> 4" in r.stdout
    assert fake.config["speculation"]["k"] == 4
    r = cli("config", "apply", "--host", "gpu1", "--max-num-seqs", "2", "--reason", "protect latency")
    assert r.returncode == 0 and "version 3 applied" in r.stdout
    r = cli("config", "history", "--host", "gpu1")
    lines = r.stdout.splitlines()
    assert lines[1].split()[0] == "3" and "carol" in lines[1] and "protect latency" in lines[1]
    assert "import" in lines[-1]
    r = cli("config", "diff", "--host", "gpu1", "1", "3")
    assert "speculation.k" in r.stdout and "batch.max_num_seqs" in r.stdout
    r = cli("config", "rollback", "--host", "gpu1", "2", "--reason", "cap hurt throughput")
    assert r.returncode == 0 and "version 4 applied" in r.stdout and fake.config["batch"]["max_num_seqs"] is None
    r = cli("config", "show", "--host", "gpu1")
    assert r.returncode == 0 and "K now 4" in r.stdout and "version 4" in r.stdout
    r = cli("audit", "--host", "gpu1")
    assert "config.rollback" in r.stdout and "cli@" in r.stdout
    r = cli("alerts", "rules")
    assert "low_acceptance" in r.stdout and "acceptance_rate < 0.5" in r.stdout
    r = cli("alerts", "rule", "kv_cache_full", "--threshold", "0.8")
    assert r.returncode == 0 and "kv_cache_usage > 0.8" in r.stdout
    assert cli("alerts", "list").returncode == 0
    out = tmp_path / "week.csv"
    r = cli("report", "weekly", "--csv", str(out))
    assert r.returncode == 0 and "fleet:" in r.stdout
    rows = list(csv.DictReader(out.open()))
    assert rows[-1]["scope"] == "week" and rows[-1]["host"] == "(fleet)"
    r = cli("hosts", "remove", "gpu1")
    assert r.returncode == 0 and "gpu1" not in cli("hosts", "list").stdout


def test_errors_are_one_clear_line(cli, fake):
    cli("hosts", "add", "gpu1", fake.url)
    cases = [
        (("config", "apply", "--host", "gpu1", "--k", "99", "--reason", "deeper"), 2, "K_max"),
        (("config", "apply", "--host", "gpu1", "--k", "2"), 2, "--reason"),
        (("config", "apply", "--host", "gpu1", "--reason", "nothing"), 1, "nothing to change"),
        (("config", "apply", "--host", "nope", "--k", "1", "--reason", "x"), 1, "no engine host named 'nope'"),
        (("config", "rollback", "--host", "gpu1", "42", "--reason", "x"), 1, "no config version 42"),
        (("hosts", "add", "bad", "localhost:8000"), 1, "bad URL"),
        (("config", "apply", "--host", "gpu1", "--patch", "{not json", "--reason", "x"), 1, "error:"),
        (("report", "weekly", "--baseline", "yesterday"), 1, "unknown baseline"),
    ]
    for args, code, text in cases:
        r = cli(*args)
        assert r.returncode == code, (args, r.stdout, r.stderr)
        assert text in r.stderr and "Traceback" not in r.stderr, (args, r.stderr)
    r = cli("config", "apply", "--host", "gpu1", "--k", "1", "--reason", "x", env_extra={"SPECPILOT_CONTROL_TOKEN": "bad"})
    assert r.returncode == 1 and "refused the control token (401)" in r.stderr and "Traceback" not in r.stderr


def test_engine_down_apply_fails_and_retry_succeeds(cli, fake):
    cli("hosts", "add", "gpu1", fake.url)
    fake.stop()
    r = cli("config", "apply", "--host", "gpu1", "--k", "3", "--reason", "during outage")
    assert r.returncode == 1 and "version 2 failed" in r.stdout and "unreachable" in r.stdout
    r = cli("config", "show", "--host", "gpu1")
    assert r.returncode == 1 and "cannot read its state" in r.stdout
    fake.start()
    r = cli("config", "apply", "--host", "gpu1", "--k", "3", "--reason", "retry")
    assert r.returncode == 0 and "version 3 applied" in r.stdout
    assert "failed" in cli("config", "history", "--host", "gpu1").stdout
