"""Dashboard users, roles and password hashing.

Two roles:

* ``viewer``: reads every page, changes nothing;
* ``operator``: may also apply configs and roll back (the audit trail records the
  operator's name as the author).

Users come from a TOML file, ``$SPECPILOT_USERS_FILE`` or ``$SPECPILOT_HOME/users.toml``::

    [users.alice]
    role = "operator"
    password_hash = "$argon2id$v=19$m=65536,t=3,p=4$..."

and/or from the environment, ``SPECPILOT_USERS`` holding JSON
``{"alice": {"role": "operator", "password_hash": "$argon2id$..."}}`` (entries there
override the file's). Only Argon2id hashes are stored (argon2-cffi, the OWASP
recommendation); a password is never stored, logged or shown. Add users with
``python -m dashboard users add NAME --role operator`` (password prompted, or read from
``$SPECPILOT_NEW_PASSWORD``).
"""

from __future__ import annotations

import json
import os
import re
import tempfile
import threading
import time
import tomllib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from argon2 import PasswordHasher
from argon2.exceptions import InvalidHashError, VerificationError, VerifyMismatchError

from engine_host import envs

__all__ = [
    "ROLES",
    "User",
    "AuthError",
    "users_file",
    "load_users",
    "hash_password",
    "verify_password",
    "add_user",
    "remove_user",
    "authenticate",
    "can",
]

ENV_USERS_FILE = envs.USERS_FILE
ENV_USERS = envs.USERS
ENV_NEW_PASSWORD = envs.NEW_PASSWORD

#: What each role may do. ``view``: read pages; ``apply``: change a host's config;
#: ``rollback``: apply an earlier version again.
ROLES: dict[str, frozenset[str]] = {
    "viewer": frozenset({"view"}),
    "operator": frozenset({"view", "apply", "rollback"}),
}
NAME_RE = re.compile(r"^[A-Za-z0-9_.@-]{1,64}$")
MIN_PASSWORD_LEN = 8
#: Failed logins for one name within ``LOCKOUT_WINDOW_S`` seconds before it is locked
#: for ``LOCKOUT_S`` seconds.
MAX_FAILURES = 5
LOCKOUT_WINDOW_S = 300.0
LOCKOUT_S = 60.0

_hasher = PasswordHasher()
_DUMMY_HASH = _hasher.hash("specpilot-no-such-user")
_stores: dict[str | None, Any] = {}
_stores_lock = threading.Lock()


class AuthError(ValueError):
    """A user cannot be added, or a login is refused; the message says why (never the
    password)."""


@dataclass(frozen=True)
class User:
    """A dashboard user.

    Attributes:
        name: login name (also the author recorded in the audit trail).
        role: ``viewer`` or ``operator``.
        password_hash: Argon2id hash (PHC string).
    """

    name: str
    role: str
    password_hash: str = ""

    def can(self, action: str) -> bool:
        """True when the user's role allows ``action`` (``view``, ``apply``, ``rollback``)."""
        return action in ROLES.get(self.role, frozenset())


def can(user: User | None, action: str) -> bool:
    """True when ``user`` is logged in and its role allows ``action``."""
    return user is not None and user.can(action)


def users_file() -> Path:
    """Path of the users file: ``$SPECPILOT_USERS_FILE`` or ``$SPECPILOT_HOME/users.toml``."""
    env = envs.users_file()
    if env:
        return Path(env).expanduser()
    from engine_host.home import home

    return home() / "users.toml"


def hash_password(password: str) -> str:
    """Argon2id hash (PHC string, with its own random salt) of ``password``.

    Raises:
        AuthError: the password is shorter than ``MIN_PASSWORD_LEN`` characters.
    """
    if len(password) < MIN_PASSWORD_LEN:
        raise AuthError(f"a password needs at least {MIN_PASSWORD_LEN} characters")
    return _hasher.hash(password)


def verify_password(password_hash: str, password: str) -> bool:
    """True when ``password`` matches ``password_hash`` (constant time in the password)."""
    try:
        return _hasher.verify(password_hash, password)
    except (VerifyMismatchError, VerificationError, InvalidHashError):
        return False


def _check_entry(name: str, entry: object, source: str) -> User:
    if not NAME_RE.match(name):
        raise AuthError(f"{source}: user name {name!r} may only hold letters, digits and _.@-")
    if not isinstance(entry, dict):
        raise AuthError(f"{source}: user {name!r} must be a table with role and password_hash")
    role = entry.get("role")
    if role not in ROLES:
        raise AuthError(f"{source}: user {name!r} has role {role!r}; roles are {', '.join(ROLES)}")
    ph = entry.get("password_hash")
    if not isinstance(ph, str) or not ph.startswith("$argon2"):
        raise AuthError(f"{source}: user {name!r} needs an Argon2 password_hash (python -m dashboard users add)")
    return User(name=name, role=role, password_hash=ph)


def load_users(path: Path | None = None) -> dict[str, User]:
    """Users from the users file and ``$SPECPILOT_USERS`` (which wins on equal names).

    Args:
        path: users file (default :func:`users_file`); a missing file means no users.
    Returns:
        Users by name.
    Raises:
        AuthError: the file or the variable is malformed (names the entry).
    """
    path = path or users_file()
    users: dict[str, User] = {}
    if path.exists():
        try:
            data = tomllib.loads(path.read_text())
        except tomllib.TOMLDecodeError as exc:
            raise AuthError(f"{path}: not valid TOML: {exc}") from None
        for name, entry in (data.get("users") or {}).items():
            users[name] = _check_entry(name, entry, str(path))
    env = envs.users()
    if env:
        try:
            data = json.loads(env)
        except ValueError as exc:
            raise AuthError(f"${ENV_USERS}: not valid JSON: {exc}") from None
        if not isinstance(data, dict):
            raise AuthError(f"${ENV_USERS}: must be a JSON object of users")
        for name, entry in data.items():
            users[name] = _check_entry(name, entry, f"${ENV_USERS}")
    return users


def _toml_str(value: str) -> str:
    return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'


def _write_users(path: Path, users: dict[str, User]) -> None:
    lines = ["# SpecPilot dashboard users (python -m dashboard users add/remove). Argon2id hashes only.", ""]
    for u in sorted(users.values(), key=lambda u: u.name):
        lines += [
            f"[users.{_toml_str(u.name)}]",
            f"role = {_toml_str(u.role)}",
            f"password_hash = {_toml_str(u.password_hash)}",
            "",
        ]
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".users-", suffix=".toml")
    try:
        with os.fdopen(fd, "w") as f:
            f.write("\n".join(lines))
        os.chmod(tmp, 0o600)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def _file_users(path: Path) -> dict[str, User]:
    if not path.exists():
        return {}
    data = tomllib.loads(path.read_text())
    return {n: _check_entry(n, e, str(path)) for n, e in (data.get("users") or {}).items()}


def add_user(name: str, role: str, password: str, path: Path | None = None, replace: bool = False) -> User:
    """Add (or with ``replace``, update) a user in the users file (written atomically,
    mode 0600).

    Raises:
        AuthError: bad name or role, short password, or the user exists and not ``replace``.
    """
    if not NAME_RE.match(name):
        raise AuthError(f"user name {name!r} may only hold letters, digits and _.@- (1-64 characters)")
    if role not in ROLES:
        raise AuthError(f"role {role!r} is unknown; roles are {', '.join(ROLES)}")
    path = path or users_file()
    users = _file_users(path)
    if name in users and not replace:
        raise AuthError(f"user {name!r} exists in {path} (use --replace to change role or password)")
    user = User(name=name, role=role, password_hash=hash_password(password))
    users[name] = user
    _write_users(path, users)
    return user


def remove_user(name: str, path: Path | None = None) -> None:
    """Remove a user from the users file.

    Raises:
        AuthError: no such user in the file.
    """
    path = path or users_file()
    users = _file_users(path)
    if name not in users:
        raise AuthError(f"no user {name!r} in {path}")
    del users[name]
    _write_users(path, users)


def _lockout_store(store: Any) -> Any:
    """The store holding lock-out state: ``store``, else the dashboard's
    (``$SPECPILOT_DB``, ``$SPECPILOT_DB_URL``, else the SQLite file in ``$SPECPILOT_HOME``),
    opened once per process and URL."""
    if store is not None:
        return store
    from .db import default_url
    from .store import Store

    url = os.environ.get("SPECPILOT_DB") or os.environ.get("SPECPILOT_DB_URL") or default_url()
    with _stores_lock:
        if url not in _stores:
            _stores[url] = Store.open(url)
        return _stores[url]


def failures(store: Any, name: str, now: float | None = None) -> list[float]:
    """Times (unix s) of the failed logins for ``name`` within ``LOCKOUT_WINDOW_S``
    seconds before ``now``, oldest first (from the store's ``login_failures``)."""
    from sqlalchemy import select

    from .models import LoginFailure

    now = time.time() if now is None else now
    with store.reader() as s:
        return list(
            s.scalars(
                select(LoginFailure.failed_at)
                .where(LoginFailure.name == name, LoginFailure.failed_at > now - LOCKOUT_WINDOW_S)
                .order_by(LoginFailure.failed_at)
            )
        )


def _record_failure(store: Any, name: str, now: float) -> None:
    from sqlalchemy import delete

    from .models import LoginFailure

    with store.writer() as s:
        s.execute(delete(LoginFailure).where(LoginFailure.failed_at <= now - LOCKOUT_WINDOW_S))
        s.add(LoginFailure(name=name[:64], failed_at=now))


def _clear_failures(store: Any, name: str) -> None:
    from sqlalchemy import delete

    from .models import LoginFailure

    with store.writer() as s:
        s.execute(delete(LoginFailure).where(LoginFailure.name == name[:64]))


def _locked(store: Any, name: str, now: float) -> bool:
    times = failures(store, name[:64], now)
    return len(times) >= MAX_FAILURES and now - times[-1] < LOCKOUT_S


def authenticate(name: str, password: str, users: dict[str, User] | None = None, store: Any = None) -> User:
    """Check a login.

    Unknown names cost the same hash verification as known ones. After
    ``MAX_FAILURES`` failures within ``LOCKOUT_WINDOW_S`` seconds a name is locked for
    ``LOCKOUT_S`` seconds. Failures are kept in the store (``login_failures``), so a
    dashboard restart does not reset them.

    Args:
        store: the control plane's :class:`control.store.Store` (default: the
            dashboard's, see :func:`_lockout_store`).
    Returns:
        The :class:`User`.
    Raises:
        AuthError: wrong name or password (one message for both), or locked out.
        control.db.StoreError: the store cannot be opened.
    """
    store = _lockout_store(store)
    now = time.time()
    name = (name or "").strip()
    if _locked(store, name, now):
        raise AuthError(f"too many failed logins for {name!r}: try again in a minute")
    users = load_users() if users is None else users
    user = users.get(name)
    ok = verify_password(user.password_hash if user else _DUMMY_HASH, password or "")
    if not (ok and user):
        _record_failure(store, name, now)
        raise AuthError("wrong user name or password")
    _clear_failures(store, name)
    return user
