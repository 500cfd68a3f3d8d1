"""The control token: where it comes from and the FastAPI dependency that checks it.

Imports no vLLM module, so light processes (the engine router) can use it.
"""

from __future__ import annotations

import hmac
import os
import secrets

from fastapi import HTTPException, Request

from . import envs
from .home import home

ENV_TOKEN = envs.CONTROL_TOKEN


def control_token() -> tuple[str, bool]:
    """Return ``(token, created)``: ``$SPECPILOT_CONTROL_TOKEN`` or the token file in the
    data directory, generated (mode 0600) on first start."""
    env = envs.control_token()
    if env:
        return env, False
    path = home() / "control_token"
    if path.is_file():
        return path.read_text().strip(), False
    token = secrets.token_urlsafe(32)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(token + "\n")
    return token, True


def require_control_token(request: Request) -> None:
    """FastAPI dependency: 401 unless ``Authorization: Bearer <control token>``.

    Raises:
        HTTPException: 401 with a ``WWW-Authenticate: Bearer`` header.
    """
    token = envs.control_token() or ""
    header = request.headers.get("authorization", "")
    scheme, _, given = header.partition(" ")
    if not token or scheme.lower() != "bearer" or not hmac.compare_digest(given.strip(), token):
        raise HTTPException(
            status_code=401,
            detail="control endpoints need 'Authorization: Bearer <token>' "
            f"(the engine host's control token, ${ENV_TOKEN} or $SPECPILOT_HOME/control_token)",
            headers={"WWW-Authenticate": "Bearer"},
        )
