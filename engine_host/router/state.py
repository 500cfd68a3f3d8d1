"""What one router process holds: the two backends, the traffic split, the HTTP client,
the TPOT poll loop, and the routing file that keeps several router processes agreed.

Several processes route at once with ``--front relay --workers N`` (uvicorn workers), and
with the in-engine front when vLLM runs several API-server processes. Each keeps its own
split, fed by its own polls; the routing mode and settings are shared through a file
under ``$SPECPILOT_HOME/run`` (JSON, the :class:`~engine_host.router.settings.RouterSettings`
in force), written whole with an atomic rename and checked with one ``stat()`` before each
request and poll.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from .. import envs
from ..http_keepalive import client_limits
from .metrics import tpot_totals
from .settings import RouterSettings
from .split import TrafficSplit

POLL_INTERVAL_S = 0.25
ENV_ROUTER_CONFIG = envs.ROUTER_CONFIG


@dataclass
class Backend:
    """One engine host behind the router: base URL, control token, requests in flight.

    Attributes:
        extra_headers: sent with every request the router makes to it (the in-engine
            front marks requests to its own engine, see :mod:`engine_host.router.front`).
        local_tpot: reads the TPOT histogram's ``(sum_s, count)`` without HTTP (the
            in-engine front's own engine); None: poll ``/metrics``.
    """

    name: str
    url: str
    token: str
    inflight: int = 0
    last_error: str | None = None
    extra_headers: dict[str, str] = field(default_factory=dict)
    local_tpot: Callable[[], tuple[float, float] | None] | None = None

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.token}", **self.extra_headers}


@dataclass
class RouterState:
    """Everything one router process holds (one instance per app).

    Attributes:
        mode_file: the routing file shared by the router processes (None: this one only).
    """

    backends: dict[str, Backend]
    split: TrafficSplit = field(default_factory=TrafficSplit)
    client: httpx.AsyncClient | None = None
    poll_errors: int = 0
    mode_file: Path | None = None
    _mode_mtime: float = 0.0
    _poll_task: asyncio.Task[None] | None = None

    async def start(self) -> None:
        """Open the HTTP client and start :func:`poll_loop` (in the running event loop)."""
        if self.client is None:
            limits = client_limits(max_connections=1024, max_keepalive_connections=256)
            self.client = httpx.AsyncClient(timeout=httpx.Timeout(600.0, connect=10.0), limits=limits)
        if self._poll_task is None:
            self._poll_task = asyncio.create_task(poll_loop(self))

    async def aclose(self) -> None:
        """Stop polling and close the HTTP client."""
        if self._poll_task is not None:
            self._poll_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._poll_task
            self._poll_task = None
        if self.client is not None:
            await self.client.aclose()
            self.client = None

    def in_flight(self) -> dict[str, int]:
        """Requests in flight per engine."""
        return {e: b.inflight for e, b in self.backends.items()}

    def publish_mode(self, mode: str | None = None, settings: dict[str, Any] | None = None) -> None:
        """Set the routing mode and/or split settings (:meth:`TrafficSplit.configure`) here
        and, through :attr:`mode_file`, in every router process.

        Raises:
            ValueError: an unknown mode or invalid settings (nothing changes).
        """
        patch = dict(settings or {})
        if mode is not None:
            patch["mode"] = mode
        if patch:
            self.split.configure(patch)
        if self.mode_file is not None:
            write_routing_file(self.mode_file, self.split.config)
            self._mode_mtime = self.mode_file.stat().st_mtime

    def follow_mode(self) -> None:
        """Take up the routing mode and settings another router process published (a
        file that cannot be read or holds invalid settings is ignored)."""
        if self.mode_file is None:
            return
        try:
            mtime = self.mode_file.stat().st_mtime
            if mtime != self._mode_mtime:
                self._mode_mtime = mtime
                self.split.configure(json.loads(self.mode_file.read_text()))
        except (OSError, ValueError):
            pass


def write_routing_file(path: Path, settings: RouterSettings) -> None:
    """Write ``settings`` to the routing file ``path`` whole (atomic rename)."""
    tmp = path.with_suffix(f".{os.getpid()}.tmp")
    tmp.write_text(settings.model_dump_json())
    os.replace(tmp, path)


async def poll_loop(state: RouterState) -> None:
    """Every :data:`POLL_INTERVAL_S`: read both engines' TPOT histograms, move the split."""
    assert state.client is not None
    while True:
        now = time.monotonic()
        for name, b in state.backends.items():
            try:
                totals = b.local_tpot() if b.local_tpot is not None else None
                if totals is None:
                    r = await state.client.get(b.url + "/metrics", headers=b.extra_headers or None, timeout=5.0)
                    r.raise_for_status()
                    totals = tpot_totals(r.text)
                if totals is not None:
                    state.split.observe(name, totals[0], totals[1], now)
                b.last_error = None
            except (httpx.HTTPError, ValueError) as exc:
                state.poll_errors += 1
                b.last_error = f"{type(exc).__name__}: {exc}"
        state.split.update(now)
        state.follow_mode()
        await asyncio.sleep(POLL_INTERVAL_S)


def state_from_config(cfg: dict[str, Any], token: str) -> RouterState:
    """A :class:`RouterState` from the JSON that ``python -m engine_host.router`` passes in
    ``$SPECPILOT_ROUTER_CONFIG``: ``{"backends": {name: url}, "p_start": share,
    "router": RouterSettings JSON, "mode_file": path, "front": "engine"|"relay"}``.

    Raises:
        KeyError, ValueError: a config that lacks a key or holds invalid settings.
    """
    backends = {name: Backend(name, url, token) for name, url in cfg["backends"].items()}
    split = TrafficSplit(RouterSettings.model_validate(cfg.get("router") or {}), p=cfg["p_start"])
    state = RouterState(backends=backends, split=split, mode_file=Path(cfg["mode_file"]))
    state.follow_mode()
    return state


def router_config_from_env() -> dict[str, Any] | None:
    """The parsed ``$SPECPILOT_ROUTER_CONFIG``, or None when it is not set."""
    raw = envs.router_config()
    return json.loads(raw) if raw else None
