"""Unit tests of dashboard users, roles and password hashing (control/auth.py)."""

from __future__ import annotations

import json
import stat
import subprocess
import sys

import pytest

from control import auth


@pytest.fixture
def users_path(tmp_path, monkeypatch):
    path = tmp_path / "users.toml"
    monkeypatch.setenv(auth.ENV_USERS_FILE, str(path))
    monkeypatch.delenv(auth.ENV_USERS, raising=False)
    monkeypatch.setenv("SPECPILOT_HOME", str(tmp_path))
    monkeypatch.delenv("SPECPILOT_DB", raising=False)
    monkeypatch.delenv("SPECPILOT_DB_URL", raising=False)
    return path


def test_password_is_stored_hashed_and_file_is_private(users_path):
    auth.add_user("alice", "operator", "correct horse")
    text = users_path.read_text()
    assert "correct horse" not in text
    assert "$argon2id$" in text
    assert stat.S_IMODE(users_path.stat().st_mode) == 0o600
    users = auth.load_users()
    assert users["alice"].role == "operator"
    assert auth.verify_password(users["alice"].password_hash, "correct horse")
    assert not auth.verify_password(users["alice"].password_hash, "wrong horse")


def test_roles_viewer_reads_operator_changes(users_path):
    auth.add_user("vic", "viewer", "viewer-pass")
    auth.add_user("ops", "operator", "operator-pass")
    vic = auth.authenticate("vic", "viewer-pass")
    ops = auth.authenticate("ops", "operator-pass")
    assert vic.can("view") and not vic.can("apply") and not vic.can("rollback")
    assert ops.can("view") and ops.can("apply") and ops.can("rollback")
    assert not auth.can(None, "view")


def test_wrong_password_and_unknown_user_get_one_message(users_path):
    auth.add_user("alice", "operator", "correct horse")
    with pytest.raises(auth.AuthError, match="wrong user name or password"):
        auth.authenticate("alice", "nope-nope")
    with pytest.raises(auth.AuthError, match="wrong user name or password"):
        auth.authenticate("mallory", "correct horse")


def test_lockout_after_repeated_failures(users_path):
    auth.add_user("alice", "operator", "correct horse")
    for _ in range(auth.MAX_FAILURES):
        with pytest.raises(auth.AuthError):
            auth.authenticate("alice", "bad-password")
    with pytest.raises(auth.AuthError, match="too many failed logins"):
        auth.authenticate("alice", "correct horse")


def test_lockout_survives_a_dashboard_restart(users_path, tmp_path):
    """The failures live in the store: a new process (a restarted dashboard) still
    refuses the locked name."""
    auth.add_user("alice", "operator", "correct horse")
    for _ in range(auth.MAX_FAILURES):
        with pytest.raises(auth.AuthError):
            auth.authenticate("alice", "bad-password")
    code = (
        "from control import auth\n"
        "try:\n    auth.authenticate('alice', 'correct horse')\nexcept auth.AuthError as e:\n    print(e)\n"
        "else:\n    print('logged in')"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env={**__import__("os").environ}
    )
    assert "too many failed logins" in out.stdout, out.stderr


def test_a_successful_login_clears_the_failures(users_path):
    from control.store import Store

    auth.add_user("alice", "operator", "correct horse")
    for _ in range(auth.MAX_FAILURES - 1):
        with pytest.raises(auth.AuthError):
            auth.authenticate("alice", "bad-password")
    auth.authenticate("alice", "correct horse")
    store = Store.open()
    assert auth.failures(store, "alice") == []
    store.close()


def test_add_refuses_bad_input_and_duplicates(users_path):
    with pytest.raises(auth.AuthError, match="at least"):
        auth.add_user("bob", "viewer", "short")
    with pytest.raises(auth.AuthError, match="role"):
        auth.add_user("bob", "admin", "long-enough-pass")
    with pytest.raises(auth.AuthError, match="letters"):
        auth.add_user("bob smith", "viewer", "long-enough-pass")
    auth.add_user("bob", "viewer", "long-enough-pass")
    with pytest.raises(auth.AuthError, match="exists"):
        auth.add_user("bob", "operator", "long-enough-pass")
    auth.add_user("bob", "operator", "another-pass", replace=True)
    assert auth.load_users()["bob"].role == "operator"
    auth.remove_user("bob")
    assert "bob" not in auth.load_users()
    with pytest.raises(auth.AuthError, match="no user"):
        auth.remove_user("bob")


def test_users_from_environment(users_path, monkeypatch):
    monkeypatch.setenv(
        auth.ENV_USERS, json.dumps({"envop": {"role": "operator", "password_hash": auth.hash_password("from-env-pw")}})
    )
    assert auth.authenticate("envop", "from-env-pw").role == "operator"
    monkeypatch.setenv(auth.ENV_USERS, json.dumps({"x": {"role": "operator", "password_hash": "plain"}}))
    with pytest.raises(auth.AuthError, match="Argon2"):
        auth.load_users()


def test_cli_adds_user_with_password_from_env(users_path, tmp_path):
    env = {
        "PATH": "/usr/bin:/bin",
        auth.ENV_USERS_FILE: str(users_path),
        auth.ENV_NEW_PASSWORD: "cli-password-1",
        "SPECPILOT_HOME": str(tmp_path),
    }
    r = subprocess.run(
        [sys.executable, "-m", "dashboard", "users", "add", "carol", "--role", "operator"],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 0, r.stderr
    assert "cli-password-1" not in r.stdout + r.stderr
    assert auth.load_users()["carol"].role == "operator"
    r = subprocess.run(
        [sys.executable, "-m", "dashboard", "users", "list"], env=env, capture_output=True, text=True, timeout=60
    )
    assert r.returncode == 0 and "carol" in r.stdout and "operator" in r.stdout and "argon2" not in r.stdout
    r = subprocess.run(
        [sys.executable, "-m", "dashboard", "users", "add", "dave", "--role", "boss"],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode != 0 and "role" in r.stderr


def test_first_start_creates_one_admin_operator(users_path, capsys):
    from dashboard.__main__ import bootstrap_user

    password = bootstrap_user()
    assert password and len(password) >= 12
    assert auth.authenticate("admin", password).role == "operator"
    out = capsys.readouterr().out
    assert f"| {'    password   ' + password}" in out and "user name  admin" in out  # framed
    assert password not in users_path.read_text()
    assert bootstrap_user() is None  # users exist: nothing added


def test_session_token_names_the_user_until_it_expires_or_the_user_changes(users_path, monkeypatch):
    from dashboard import session

    monkeypatch.setenv(session.ENV_SECRET, "test-secret")
    alice = auth.add_user("alice", "operator", "correct horse")
    token = session.issue(alice)
    assert session.restore(token) == alice
    assert session.restore(token + "x") is None  # forged
    assert session.restore(token, max_age_s=-1) is None  # expired
    monkeypatch.setenv(session.ENV_SECRET, "another-secret")
    assert session.restore(token) is None  # signed with another key
    monkeypatch.setenv(session.ENV_SECRET, "test-secret")
    auth.add_user("alice", "viewer", "correct horse", replace=True)
    assert session.restore(token) is None  # role changed
    auth.remove_user("alice")
    assert session.restore(token) is None  # removed
    assert session.restore(None) is None


def test_session_secret_is_made_once_and_kept_private(users_path, monkeypatch, tmp_path):
    from dashboard import session

    monkeypatch.delenv(session.ENV_SECRET, raising=False)
    alice = auth.add_user("alice", "operator", "correct horse")
    token = session.issue(alice)
    key = tmp_path / "dashboard-session.key"
    assert stat.S_IMODE(key.stat().st_mode) == 0o600
    assert session.restore(token) == alice  # the same key is read back
