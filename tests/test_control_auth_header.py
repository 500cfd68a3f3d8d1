"""The control token check on odd headers (pure logic: a Starlette request from an ASGI scope)."""

from __future__ import annotations

import pytest
from fastapi import HTTPException
from starlette.requests import Request

from engine_host.auth import ENV_TOKEN, require_control_token


def request_with(header: bytes | None) -> Request:
    headers = [(b"authorization", header)] if header is not None else []
    return Request({"type": "http", "method": "GET", "path": "/control/state", "headers": headers})


@pytest.mark.parametrize(
    "header",
    [
        "Bearer tökén".encode(),
        b"Bearer \xff\xfe",
        "Bearer \u00e9".encode("latin-1"),
        b"Bearer",
        None,
        b"Basic abc",
        b"Bearer wrong",
    ],
)
def test_any_wrong_or_non_ascii_token_is_401_with_www_authenticate(monkeypatch, header):
    monkeypatch.setenv(ENV_TOKEN, "right-token")
    with pytest.raises(HTTPException) as exc:
        require_control_token(request_with(header))
    assert exc.value.status_code == 401
    assert exc.value.headers == {"WWW-Authenticate": "Bearer"}


def test_the_right_token_passes(monkeypatch):
    monkeypatch.setenv(ENV_TOKEN, "right-token")
    assert require_control_token(request_with(b"Bearer right-token")) is None
    assert require_control_token(request_with(b"bearer  right-token ")) is None
