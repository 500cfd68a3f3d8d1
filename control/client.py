"""HTTP client for one engine host (``engine_host``'s API).

Reads (``GET``) are retried on connection errors, timeouts and 502/503/504 (they are
idempotent); ``PUT /control/config`` is sent once, never retried: a retry of an apply
that did reach the engine would apply it twice. Every failure becomes one of the
errors below, whose message names the host and says what to do.

The control token is read at use time from the environment variable the host was
registered with (default ``SPECPILOT_CONTROL_TOKEN``); for that default variable the
token file of a local engine host (``$SPECPILOT_HOME/control_token``) is the fallback.
"""

from __future__ import annotations

import functools
import os
import time
from typing import Any

import httpx
from pydantic import BaseModel, ValidationError

from engine_host.http_keepalive import client_limits
from engine_host.schema import ApplyAnswer, ControlState, Sample

from .store import DEFAULT_TOKEN_ENV, ControlError

DEFAULT_TIMEOUT_S = 5.0
# above the engine host's longest answer: lock wait + ACK_TIMEOUT_S + lock wait to withdraw (about 20 s)
PUT_TIMEOUT_S = 30.0


class EngineError(ControlError):
    """The engine host answered with an error (``status``: HTTP status)."""

    def __init__(self, message: str, status: int | None = None):
        super().__init__(message)
        self.status = status


class EngineUnreachable(EngineError):
    """No answer: connection refused, DNS failure, timeout (the host is down or the URL is wrong)."""


class EngineAuthError(EngineError):
    """401: the control token is missing or wrong."""


class EngineRefused(EngineError):
    """422 (invalid config) or 409 (needs a restart); ``errors``: ``[{"loc", "msg"}]``."""

    def __init__(self, message: str, status: int, errors: list[dict[str, Any]]):
        super().__init__(message, status)
        self.errors = errors


class TokenMissing(EngineAuthError):
    """The variable that should hold the host's control token is not set."""


def resolve_token(token_env: str = DEFAULT_TOKEN_ENV) -> str:
    """The control token from ``$token_env`` (default variable: also the local token file).

    Raises:
        TokenMissing: the variable is unset (and no local token file applies).
    """
    value = os.environ.get(token_env)
    if value:
        return value.strip()
    if token_env == DEFAULT_TOKEN_ENV:
        from engine_host.home import home

        path = home() / "control_token"
        if path.is_file():
            return path.read_text().strip()
    raise TokenMissing(
        f"the control token is not set: export {token_env}=<the engine host's control token> "
        "(printed by the engine host on first start; stored in its $SPECPILOT_HOME/control_token)"
    )


@functools.lru_cache(maxsize=1)
def _ssl_context() -> Any:
    """One verifying SSL context (httpx's defaults: the CA bundle of ``$SSL_CERT_FILE``,
    ``$SSL_CERT_DIR`` or certifi) shared by every client: building one loads the whole CA
    bundle, which a page that makes one client per host of a fleet paid once per host."""
    return httpx.create_ssl_context()


class EngineClient:
    """Client for one engine host.

    Args:
        url: base URL (``http://host:port``); token: control token (None: only the
        public endpoints work); name: host name used in messages; timeout_s: per
        request (s); retries: extra attempts for GETs; backoff_s: first retry delay
        (doubles each time).
    """

    def __init__(
        self,
        url: str,
        token: str | None = None,
        *,
        name: str | None = None,
        timeout_s: float = DEFAULT_TIMEOUT_S,
        retries: int = 2,
        backoff_s: float = 0.2,
    ):
        self.url = url.rstrip("/")
        self.name = name or self.url
        self.retries = retries
        self.backoff_s = backoff_s
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        self._http = httpx.Client(
            base_url=self.url,
            headers=headers,
            verify=_ssl_context(),
            timeout=httpx.Timeout(timeout_s, connect=min(timeout_s, 3.0)),
            limits=client_limits(),
        )

    @classmethod
    def for_host(cls, host: Any, *, need_token: bool = True, **kwargs: Any) -> "EngineClient":
        """A client for a registered host (``control.models.Host``).

        Raises:
            TokenMissing: ``need_token`` and the host's token variable is unset.
        """
        token = None
        try:
            token = resolve_token(host.token_env)
        except TokenMissing:
            if need_token:
                raise
        return cls(host.url, token, name=host.name, **kwargs)

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> "EngineClient":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------------ plumbing

    def _where(self) -> str:
        return f"engine host {self.name!r}" + (f" ({self.url})" if self.name != self.url else "")

    def _raise_for(self, r: httpx.Response) -> None:
        if r.status_code < 400:
            return
        if r.status_code == 401:
            raise EngineAuthError(
                f"{self._where()} refused the control token (401): check the variable that "
                "holds it (hosts add --token-env)",
                401,
            )
        try:
            body = r.json()
        except ValueError:
            body = {}
        if r.status_code in (409, 422) and isinstance(body, dict) and isinstance(body.get("detail"), list):
            msg = body.get("message") or "; ".join(str(e.get("msg")) for e in body["detail"])
            kind = "needs an engine restart" if r.status_code == 409 else "invalid config"
            raise EngineRefused(f"{self._where()} refused the config ({kind}): {msg}", r.status_code, body["detail"])
        detail = body.get("detail") if isinstance(body, dict) else None
        raise EngineError(f"{self._where()} answered HTTP {r.status_code}: {detail or r.text[:200]}", r.status_code)

    def _get(self, path: str, params: dict[str, Any] | None = None) -> httpx.Response:
        delay = self.backoff_s
        for attempt in range(self.retries + 1):
            try:
                r = self._http.get(path, params=params)
                if r.status_code in (502, 503, 504) and attempt < self.retries and path != "/ready":
                    time.sleep(delay)
                    delay *= 2
                    continue
                return r
            except httpx.InvalidURL as exc:
                raise EngineUnreachable(f"bad URL for {self._where()}: {exc}") from None
            except httpx.TransportError as exc:
                if attempt >= self.retries:
                    raise EngineUnreachable(f"{self._where()} is unreachable: {_describe(exc)}") from None
                time.sleep(delay)
                delay *= 2
        raise AssertionError("unreachable")  # pragma: no cover

    def _get_json(self, path: str, params: dict[str, Any] | None = None) -> Any:
        r = self._get(path, params)
        self._raise_for(r)
        try:
            return r.json()
        except ValueError:
            raise EngineError(
                f"{self._where()} answered {path} with something other than JSON (is this URL an engine host?)",
                r.status_code,
            ) from None

    def _validated(self, model: type[BaseModel], body: Any, path: str) -> dict[str, Any]:
        """``body`` checked against the engine host's contract (``engine_host.schema``),
        as a JSON dict (fields the host left out get the contract's defaults)."""
        try:
            return model.model_validate(body).model_dump(mode="json")
        except ValidationError as exc:
            raise EngineError(
                f"{self._where()} answered {path} with a body that does not match the engine host's "
                f"contract ({model.__name__}): {exc.error_count()} error(s), first: "
                f"{'.'.join(map(str, exc.errors()[0]['loc']))}: {exc.errors()[0]['msg']}"
            ) from None

    # ------------------------------------------------------------------ API

    def health(self) -> bool:
        """True when ``GET /health`` answers 200.

        Raises:
            EngineUnreachable: no answer.
        """
        return self._get("/health").status_code == 200

    def ready(self) -> dict[str, Any]:
        """``GET /ready``: ``{"ready": bool, "phase": str, ...}`` (503 is not an error here)."""
        r = self._get("/ready")
        if r.status_code not in (200, 503):
            self._raise_for(r)
        try:
            return r.json()
        except ValueError:
            return {"ready": r.status_code == 200, "phase": "unknown"}

    def metrics_text(self) -> str:
        """``GET /metrics``: Prometheus text (``vllm:*`` and ``specpilot:*``)."""
        r = self._get("/metrics")
        self._raise_for(r)
        return r.text

    def state(self) -> dict[str, Any]:
        """``GET /control/state``: a :class:`engine_host.schema.ControlState` as a dict
        (config_version, config, speculation{k_current, k_next, ...}, batch, limits,
        controller, engine{pid, started_at, ...}).

        Raises:
            EngineUnreachable, EngineAuthError, EngineError (also: a body off the contract).
        """
        return self._validated(ControlState, self._get_json("/control/state"), "/control/state")

    def samples(self, since: float | None = None) -> list[dict[str, Any]]:
        """``GET /control/samples``: the engine's per-second samples after ``since`` (unix s)."""
        body = self._get_json("/control/samples", {"since": since} if since is not None else None)
        samples = body.get("samples") if isinstance(body, dict) else None
        if not isinstance(samples, list):
            raise EngineError(f"{self._where()} answered /control/samples without a list of samples")
        return [self._validated(Sample, s, "/control/samples") for s in samples]

    def warmup_runs(self, after_id: int = 0) -> list[dict[str, Any]]:
        """``GET /control/warmup/runs``: warm-up and heartbeat runs with ``id > after_id``."""
        return self._get_json("/control/warmup/runs", {"after_id": after_id}).get("runs", [])

    def put_config(self, config: dict[str, Any], timeout_s: float = PUT_TIMEOUT_S) -> dict[str, Any]:
        """``PUT /control/config`` once (no retry).

        Returns:
            The engine's answer (:class:`engine_host.schema.ApplyAnswer` as a dict):
            config_version, previous_version, config, diff, applied, apply_latency_ms, k_next.
        Raises:
            EngineRefused: 422/409 with the engine's reasons. EngineAuthError: 401.
            EngineUnreachable: not connected, or no answer within ``timeout_s`` (the
            engine may still apply it). EngineError: other HTTP errors (503: no ack).
        """
        try:
            r = self._http.put("/control/config", json=config, timeout=timeout_s)
        except httpx.InvalidURL as exc:
            raise EngineUnreachable(f"bad URL for {self._where()}: {exc}") from None
        except httpx.TransportError as exc:
            raise EngineUnreachable(f"{self._where()} is unreachable: {_describe(exc)}") from None
        self._raise_for(r)
        try:
            body = r.json()
        except ValueError:
            raise EngineError(
                f"{self._where()} answered PUT /control/config with something other than JSON", r.status_code
            ) from None
        if isinstance(body, dict) and "config_version" in body:  # the dual host may answer a routing-only change
            return self._validated(ApplyAnswer, body, "PUT /control/config")
        return body


def _describe(exc: httpx.TransportError) -> str:
    if isinstance(exc, httpx.ConnectError):
        return f"cannot connect ({exc or 'connection refused'}); is it running?"
    if isinstance(exc, httpx.TimeoutException):
        return f"no answer in time ({type(exc).__name__})"
    return f"{type(exc).__name__}: {exc}"
