"""``python -m control`` as an operator uses it: subprocesses against a stand-in engine host
and an SQLite store; errors are one clear line, never a traceback."""

from __future__ import annotations

import csv
import os
import subprocess
import sys
from types import SimpleNamespace

import pytest

from control.cli import build_parser, k_in_force, main, os_user
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
        return subprocess.run(
            [sys.executable, "-m", "control", "--db", db, *args],
            capture_output=True,
            text=True,
            env={**env, **(env_extra or {})},
            timeout=120,
        )

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
    assert lines[1].split()[0] == "3" and os_user() in lines[1] and "protect latency" in lines[1]
    assert "import" in lines[-1]
    r = cli("config", "diff", "--host", "gpu1", "1", "3")
    assert "speculation.k" in r.stdout and "batch.max_num_seqs" in r.stdout
    r = cli("config", "rollback", "--host", "gpu1", "2", "--reason", "cap hurt throughput")
    assert r.returncode == 0 and "version 4 applied" in r.stdout and fake.config["batch"]["max_num_seqs"] is None
    r = cli("config", "show", "--host", "gpu1")
    assert r.returncode == 0 and "K in force 4" in r.stdout and "version 4" in r.stdout
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


def test_hosts_add_update_changes_only_what_it_names(cli, fake):
    """--update without --usd-per-hour or --gpu keeps the host's price and GPU kind (it set the
    price to 0 before); a non-finite price is refused and changes nothing."""
    assert cli("hosts", "add", "gpu1", fake.url, "--usd-per-hour", "2.5", "--gpu", "H100").returncode == 0
    r = cli("hosts", "add", "gpu1", fake.url, "--update")
    assert r.returncode == 0, r.stderr
    assert "USD 2.5/hour, GPU H100" in r.stdout
    r = cli("hosts", "add", "gpu1", fake.url, "--update", "--usd-per-hour", "inf")
    assert r.returncode != 0 and "finite" in r.stderr
    r = cli("hosts", "add", "gpu1", fake.url, "--update", "--usd-per-hour", "3")
    assert "USD 3/hour, GPU H100" in r.stdout
    r = cli("hosts", "add", "gpu2", fake.url)
    assert "USD 0/hour, GPU -" in r.stdout  # a new host without a price costs 0 until one is set


def test_errors_are_one_clear_line(cli, fake):
    cli("hosts", "add", "gpu1", fake.url)
    cases = [
        (("config", "apply", "--host", "gpu1", "--k", "99", "--reason", "deeper"), 2, "K_max"),
        (("config", "apply", "--host", "gpu1", "--k", "2"), 2, "--reason"),
        (("config", "apply", "--host", "gpu1", "--reason", "nothing"), 1, "nothing to change"),
        (("config", "apply", "--host", "nope", "--k", "1", "--reason", "test"), 1, "no engine host named 'nope'"),
        (("config", "rollback", "--host", "gpu1", "42", "--reason", "test"), 1, "no config version 42"),
        (("hosts", "add", "bad", "localhost:8000"), 1, "bad URL"),
        (("config", "apply", "--host", "gpu1", "--patch", "{not json", "--reason", "test"), 1, "error:"),
        (("report", "weekly", "--baseline", "yesterday"), 1, "unknown baseline"),
    ]
    for args, code, text in cases:
        r = cli(*args)
        assert r.returncode == code, (args, r.stdout, r.stderr)
        assert text in r.stderr and "Traceback" not in r.stderr, (args, r.stderr)
    r = cli(
        "config",
        "apply",
        "--host",
        "gpu1",
        "--k",
        "1",
        "--reason",
        "test",
        env_extra={"SPECPILOT_CONTROL_TOKEN": "bad"},
    )
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


# --------------------------------------------------------------------------- as an on-call engineer uses it


def _run_main(capsys, argv: list[str]) -> SimpleNamespace:
    """``python -m control ARGS`` in this process (much faster than a subprocess)."""
    try:
        code = main(argv)
    except SystemExit as exc:  # argparse's usage errors
        code = exc.code
    out = capsys.readouterr()
    return SimpleNamespace(returncode=code, stdout=out.out, stderr=out.err)


@pytest.fixture
def cli_fast(tmp_path, monkeypatch, capsys):
    """The CLI run in-process against an SQLite store, ``$USER`` set to someone else."""
    db = f"sqlite:///{tmp_path / 'cli.db'}"
    monkeypatch.setenv("SPECPILOT_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("SPECPILOT_CONTROL_TOKEN", TOKEN)
    monkeypatch.setenv("USER", "carol")
    monkeypatch.delenv("SPECPILOT_DB_URL", raising=False)
    monkeypatch.delenv("SPECPILOT_DB", raising=False)

    def run(*args: str) -> SimpleNamespace:
        return _run_main(capsys, ["--db", db, *args])

    return run


def _versions(cli_fast) -> int:
    return len(
        cli_fast("config", "history", "--json").stdout
        and __import__("json").loads(cli_fast("config", "history", "--json").stdout)
    )


def test_host_defaults_to_the_only_host_and_several_hosts_are_listed(cli_fast, fake):
    r = cli_fast("config", "show")
    assert r.returncode == 1 and "no engine host is registered" in r.stderr and "hosts add" in r.stderr
    cli_fast("hosts", "add", "gpu1", fake.url)
    r = cli_fast("config", "apply", "--k", "2", "--mode", "fixed", "--reason", "one host, no --host")
    assert r.returncode == 0, r.stderr
    assert "host gpu1: version 2 applied" in r.stdout and fake.config["speculation"]["k"] == 2
    assert cli_fast("config", "show").returncode == 0
    assert cli_fast("config", "history").stdout.splitlines()[1].split()[0] == "2"
    cli_fast("hosts", "add", "gpu2", fake.url)
    for args in (
        ("config", "show"),
        ("config", "apply", "--k", "3", "--reason", "which host?"),
        ("config", "history"),
        ("config", "rollback", "1", "--reason", "which host?"),
    ):
        r = cli_fast(*args)
        assert r.returncode == 1, (args, r.stdout, r.stderr)
        assert "--host is required: 2 hosts are registered (gpu1, gpu2)" in r.stderr, args
    assert fake.config["speculation"]["k"] == 2


def test_reason_follows_the_dashboards_rule(cli_fast, fake):
    from control.reason import MIN_REASON_CHARS, REASON_RULE, check_reason

    cli_fast("hosts", "add", "gpu1", fake.url)
    for reason in ("x", "   ", "ab "):
        r = cli_fast("config", "apply", "--k", "3", "--reason", reason)
        assert r.returncode == 2 and REASON_RULE in r.stderr and "Traceback" not in r.stderr, (reason, r.stderr)
    assert fake.config["speculation"]["k"] == 0 and _versions(cli_fast) == 1  # nothing recorded
    assert MIN_REASON_CHARS == 4 and check_reason("  slow  ") == "slow"
    assert cli_fast("config", "apply", "--k", "3", "--mode", "fixed", "--reason", "slow").returncode == 0


def test_an_apply_that_changes_nothing_records_nothing(cli_fast, fake):
    cli_fast("hosts", "add", "gpu1", fake.url)
    assert cli_fast("config", "apply", "--mode", "fixed", "--k", "3", "--reason", "pin K").returncode == 0
    puts = len(fake.puts)
    r = cli_fast("config", "apply", "--mode", "fixed", "--k", "3", "--reason", "pin K again")
    assert r.returncode == 0 and "no change: version 2 in force on gpu1 already has this config" in r.stdout
    r = cli_fast("config", "rollback", "2", "--reason", "back to 2")
    assert r.returncode == 0 and "no change" in r.stdout
    assert _versions(cli_fast) == 2 and len(fake.puts) == puts
    # the engine drifted from version 2 (changed behind the control plane): re-sending it is a change
    fake.config["speculation"]["k"] = 5
    r = cli_fast("config", "apply", "--mode", "fixed", "--k", "3", "--reason", "re-sync")
    assert r.returncode == 0 and "version 3 applied" in r.stdout and fake.config["speculation"]["k"] == 3


def test_weekly_csv_dash_means_standard_output(cli_fast, fake, tmp_path, monkeypatch):
    cli_fast("hosts", "add", "gpu1", fake.url, "--usd-per-hour", "2.5")
    monkeypatch.chdir(tmp_path)
    r = cli_fast("report", "weekly", "--csv", "-")
    assert r.returncode == 0, r.stderr
    assert not (tmp_path / "-").exists()
    rows = list(csv.DictReader(r.stdout.splitlines()))
    assert rows and rows[-1]["scope"] == "week" and rows[-1]["host"] == "(fleet)"
    assert "fleet:" not in r.stdout  # the CSV alone, for a pipe
    r = cli_fast("report", "weekly", "--csv", "-", "--json")
    assert r.returncode == 1 and "choose one" in r.stderr


def test_store_variable_either_name(tmp_path, fake, monkeypatch, capsys):
    db = f"sqlite:///{tmp_path / 'alias.db'}"
    monkeypatch.setenv("SPECPILOT_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("SPECPILOT_CONTROL_TOKEN", TOKEN)

    def run(env_extra, *args):
        for name in ("SPECPILOT_DB_URL", "SPECPILOT_DB"):
            monkeypatch.delenv(name, raising=False)
        for name, value in env_extra.items():
            monkeypatch.setenv(name, value)
        return _run_main(capsys, list(args))

    assert run({"SPECPILOT_DB": db}, "hosts", "add", "gpu1", fake.url).returncode == 0
    assert "gpu1" in run({"SPECPILOT_DB_URL": db}, "hosts", "list").stdout  # the same store by either name
    assert "gpu1" in run({"SPECPILOT_DB_URL": db, "SPECPILOT_DB": db}, "hosts", "list").stdout
    r = run({"SPECPILOT_DB_URL": db, "SPECPILOT_DB": f"sqlite:///{tmp_path / 'other.db'}"}, "hosts", "list")
    assert r.returncode == 1 and "name different stores" in r.stderr
    assert not (tmp_path / "other.db").exists()


def test_author_is_the_os_user_and_another_name_is_on_behalf_of(cli_fast, fake):
    cli_fast("hosts", "add", "gpu1", fake.url)
    me = os_user()
    # $USER is whatever the caller sets (the fixture says carol): it signs nothing
    assert cli_fast("config", "apply", "--k", "1", "--mode", "fixed", "--reason", "mine").returncode == 0
    assert cli_fast("config", "apply", "--k", "2", "--reason", "asked by dana", "--author", "dana").returncode == 0
    assert cli_fast("config", "apply", "--k", "3", "--reason", "myself", "--author", me).returncode == 0
    import json

    authors = [v["author"] for v in json.loads(cli_fast("config", "history", "--json").stdout)]
    assert authors[:3] == [me, f"{me} on behalf of dana", me] and "carol" not in authors
    r = cli_fast("config", "apply", "--k", "4", "--reason", "nobody", "--author", " ")
    assert r.returncode == 1 and "--author" in r.stderr


def test_k_in_force_is_the_k_of_the_next_step(cli_fast, fake):
    cli_fast("hosts", "add", "gpu1", fake.url)
    real_state = fake._state

    def idle_state():  # an idle engine: its last step ran at K = 0, whatever the config says
        st = real_state()
        st["speculation"]["k_current"] = 0
        return st

    fake._state = idle_state
    r = cli_fast("config", "apply", "--mode", "fixed", "--k", "3", "--reason", "pin K at 3")
    assert r.returncode == 0 and "K in force: 3" in r.stdout, r.stdout
    r = cli_fast("config", "show")
    assert "K in force 3 (last step 0)" in r.stdout

    def adaptive_state():  # an engine host that reports the policy's next K
        st = real_state()
        st["speculation"].update(mode="adaptive", k_current=0, k_next=5)
        return st

    fake._state = adaptive_state
    assert "K in force 5 (last step 0)" in cli_fast("config", "show").stdout


def test_k_in_force_from_state_documents():
    assert k_in_force({"speculation": {"mode": "adaptive", "k_next": 4, "k_current": 1}}) == 4
    assert k_in_force({"speculation": {"mode": "fixed", "k": 3, "k_current": 0}}) == 3
    assert k_in_force({"speculation": {"mode": "off", "k_current": 2}}) == 0
    assert k_in_force({"speculation": {"mode": "adaptive", "k_current": 2}}) == 2
