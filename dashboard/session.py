"""Dashboard sessions that survive a browser reload: a signed cookie.

After a login the browser holds ``specpilot_session``, a token signed with
itsdangerous (HMAC-SHA1 over the payload and a timestamp, keyed with the dashboard's
secret) that names the user. A new browser session (a reload, a new tab, a deep link)
reads it through ``st.context.cookies`` and is logged in again when:

* the signature holds and the token is at most ``MAX_AGE_S`` seconds old;
* the user still exists in the users file with the same role and the same password
  hash (changing the password or removing the user ends every session).

Logging out deletes the cookie and keeps this browser session logged out. The cookie
is written by a few lines of JavaScript (``st.html``; Streamlit cannot set response
headers), so it is not HttpOnly: it holds no secret, only a signed claim.

The secret is ``$SPECPILOT_SESSION_SECRET``, else a random key kept in
``$SPECPILOT_HOME/dashboard-session.key`` (mode 0600, made on first use).
"""

from __future__ import annotations

import hashlib
import os
import secrets
from pathlib import Path

from itsdangerous import BadSignature, SignatureExpired, URLSafeTimedSerializer

from control.views.common import AuthError, User, load_users
from engine_host import envs

COOKIE = "specpilot_session"
#: How long a session survives without a new login (s): one working day.
MAX_AGE_S = 12 * 3600
ENV_SECRET = envs.SESSION_SECRET
_SALT = "specpilot-dashboard-session"


def _secret() -> str:
    env = envs.session_secret()
    if env:
        return env
    from engine_host.home import home

    path = Path(home()) / "dashboard-session.key"
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.write(fd, secrets.token_hex(32).encode())
        finally:
            os.close(fd)
    return path.read_text().strip()


def _serializer() -> URLSafeTimedSerializer:
    return URLSafeTimedSerializer(_secret(), salt=_SALT)


def _fingerprint(user: User) -> str:
    """A short digest of the user's password hash: a new password ends old sessions."""
    return hashlib.sha256(user.password_hash.encode()).hexdigest()[:16]


def issue(user: User) -> str:
    """A signed session token for ``user`` (URL-safe text: letters, digits, ``-_.``)."""
    return _serializer().dumps({"u": user.name, "r": user.role, "f": _fingerprint(user)})


def restore(token: str | None, max_age_s: float = MAX_AGE_S) -> User | None:
    """The user a session token names, or None when there is no token, it is forged or
    older than ``max_age_s`` seconds, or the user was removed, changed role or password
    since (or the users file cannot be read)."""
    if not token:
        return None
    try:
        data = _serializer().loads(token, max_age=max_age_s)
        user = load_users().get(str(data.get("u")))
    except (BadSignature, SignatureExpired, AuthError, AttributeError, ValueError):
        return None
    if user is None or user.role != data.get("r") or _fingerprint(user) != data.get("f"):
        return None
    return user


def set_cookie_script(token: str, max_age_s: float = MAX_AGE_S) -> str:
    """The ``<script>`` that stores the token in the browser (path ``/``, SameSite=Strict)."""
    if not all(c.isalnum() or c in "-_." for c in token):
        raise ValueError("a session token is URL-safe text")
    return f"<script>document.cookie = '{COOKIE}={token}; Max-Age={int(max_age_s)}; Path=/; SameSite=Strict';</script>"


def clear_cookie_script() -> str:
    """The ``<script>`` that deletes the session cookie."""
    return f"<script>document.cookie = '{COOKIE}=; Max-Age=0; Path=/; SameSite=Strict';</script>"
