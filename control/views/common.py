"""What every dashboard page needs: the store, the registered hosts, an engine host's
state, stored samples, user and reason checks, and the errors pages show.

Views are plain functions of a :class:`control.store.Store` (opened once per process
with :func:`open_store`; the dashboard holds it in ``st.cache_resource``) that call the
control plane's domain modules (``control.store``, ``control.samples``,
``control.versions``, ``control.alerts``, ``control.cost``, ``control.apply``,
``control.warmup``): no SQL lives in ``control.views``. Everything returns plain
values or pandas DataFrames with units in column names (``_ms``, ``_s``, ``_per_s``,
``_usd``, fractions 0..1 named ``_frac`` or documented), times as timezone-aware UTC
datetimes.

A host that is down is data, not an exception: :func:`host_status` answers
``up=False`` with the reason. The engine's control token never leaves the engine-host
client below this module.
"""

from __future__ import annotations

import math
import threading
import time
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Callable, Iterable

import pandas as pd

from engine_host import envs

from .. import samples as samples_mod
from .. import store as store_mod
from ..auth import AuthError, User
from ..store import Store

__all__ = [
    "AuthError",
    "ChangeOutcome",
    "HostInfo",
    "HostStatus",
    "PermissionDenied",
    "Store",
    "User",
    "ViewError",
    "describe_error",
    "engine_client",
    "get_host",
    "host_status",
    "k_in_force",
    "list_hosts",
    "load_users",
    "login",
    "open_store",
    "require",
    "require_reason",
    "samples_frame",
    "status_from_state",
    "stored_samples",
    "version_in_force",
]

ENV_DB = envs.DB_URL
#: Seconds the dashboard waits for an engine host before calling it down.
STATE_TIMEOUT_S = 1.5

PCTS = ("p50", "p95", "p99")
LATENCY_KINDS = ("ttft", "itl", "e2e", "queue")


class ViewError(RuntimeError):
    """A page's request cannot be served; the message is fit to show to a user."""


class PermissionDenied(ViewError):
    """The user's role does not allow the action (or the user no longer exists)."""


def describe_error(exc: BaseException) -> str:
    """A one-line, user-facing description of an error (no traceback, no secrets)."""
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    return text[:300]


def utc(ts: float | int | datetime | None) -> datetime | None:
    """Unix seconds (or a datetime) as a timezone-aware UTC datetime; None stays None."""
    if ts is None:
        return None
    if isinstance(ts, datetime):
        return ts if ts.tzinfo else ts.replace(tzinfo=timezone.utc)
    return datetime.fromtimestamp(float(ts), tz=timezone.utc)


# --------------------------------------------------------------------------- the store


def db_url() -> str | None:
    """The store URL the dashboard was started with (``--db`` / ``$SPECPILOT_DB_URL``),
    None for the default SQLite file in ``$SPECPILOT_HOME``."""
    return envs.db_url()


_STORES: dict[str | None, Store] = {}
_STORES_LOCK = threading.Lock()


def open_store(url: str | None = None) -> Store:
    """The control plane's store at ``url`` (default :func:`db_url`), opened and
    migrated once per process and URL.

    Raises:
        control.db.StoreError: bad URL, missing driver, unreachable server, failed migration.
    """
    key = url if url is not None else db_url()
    with _STORES_LOCK:
        if key not in _STORES:
            _STORES[key] = Store.open(key)
        return _STORES[key]


# --------------------------------------------------------------------------- users and reasons


def load_users() -> dict[str, User]:
    """The dashboard's users by name (:func:`control.auth.load_users`).

    Raises:
        AuthError: the users file or ``$SPECPILOT_USERS`` is malformed.
    """
    from .. import auth

    return auth.load_users()


def login(store: Store, name: str, password: str, users: dict[str, User] | None = None) -> User:
    """Check a login, with the lock-out kept in ``store`` (:func:`control.auth.authenticate`).

    Raises:
        AuthError: wrong name or password (one message for both), or locked out.
    """
    from .. import auth

    return auth.authenticate(name, password, users, store=store)


def require(user: User | None, action: str) -> User:
    """The user, re-checked against the users file now: still there, and with a role
    that allows ``action`` (``apply``, ``rollback``). A user removed (or demoted) while
    a browser tab stays open can no longer act from it.

    Raises:
        PermissionDenied: nobody logged in, the user was removed, or the role forbids it.
    """
    from .. import auth

    if user is None:
        raise PermissionDenied(f"only operators may {action}: nobody is logged in")
    try:
        current = auth.load_users().get(user.name)
    except auth.AuthError as exc:
        raise PermissionDenied(f"the users file cannot be read: {exc}") from None
    if current is None:
        raise PermissionDenied(f"user {user.name!r} no longer exists: log in again")
    if not current.can(action):
        raise PermissionDenied(f"only operators may {action}: {current.name} is a {current.role}")
    return current


def require_reason(reason: str | None) -> str:
    """The reason for a change, stripped, by the rule the CLI uses too
    (:func:`control.reason.check_reason`).

    Raises:
        ViewError: empty or shorter than :data:`control.reason.MIN_REASON_CHARS` characters.
    """
    from ..reason import ReasonRefused, check_reason

    try:
        return check_reason(reason)
    except ReasonRefused as exc:
        raise ViewError(str(exc)) from None


# --------------------------------------------------------------------------- hosts


@dataclass(frozen=True)
class HostInfo:
    """A registered engine host.

    Attributes:
        name: the host's name in the store.
        url: base URL of its engine host (``http://host:port``).
        gpu_kind: accelerator kind (free text, e.g. ``H100``; ``cpu``).
        usd_per_hour: what the machine costs (USD/hour).
    """

    name: str
    url: str
    gpu_kind: str | None = None
    usd_per_hour: float | None = None


def list_hosts(store: Store) -> list[HostInfo]:
    """Registered engine hosts, by name (:func:`control.store.list_hosts`)."""
    return [HostInfo(h.name, h.url, h.gpu_kind, h.usd_per_hour) for h in store_mod.list_hosts(store)]


def get_host(store: Store, name: str) -> HostInfo:
    """One registered host.

    Raises:
        ViewError: no host of that name.
    """
    try:
        h = store_mod.get_host(store, name)
    except store_mod.UnknownHost:
        raise ViewError(f"no engine host named {name!r} is registered") from None
    return HostInfo(h.name, h.url, h.gpu_kind, h.usd_per_hour)


_CLIENTS: dict[tuple[int, str, str, str], Any] = {}
_CLIENTS_LOCK = threading.Lock()


def engine_client(store: Store, name: str) -> Any:
    """A cached engine-host client (:class:`control.client.EngineClient`) with a short
    timeout and no retries: the dashboard would rather say DOWN than hang.

    Raises:
        ViewError: no host of that name.
    """
    from ..client import EngineClient

    try:
        h = store_mod.get_host(store, name)
    except store_mod.UnknownHost:
        raise ViewError(f"no engine host named {name!r} is registered") from None
    key = (id(store), h.name, h.url, h.token_env)
    with _CLIENTS_LOCK:
        c = _CLIENTS.get(key)
        if c is None:
            c = EngineClient.for_host(h, need_token=False, timeout_s=STATE_TIMEOUT_S, retries=0)
            _CLIENTS[key] = c
    return c


@dataclass
class HostStatus:
    """What an engine host says now (``GET /control/state``), or why it says nothing.

    Attributes:
        name: host name.
        url: engine host URL.
        up: answered within ``STATE_TIMEOUT_S`` seconds.
        phase: ``ready``, ``warming_up``, ``loading`` ... or ``down``.
        error: why it is down (connection refused, timeout, HTTP status).
        config_version: the engine's own config counter (restarts at 1 with the engine;
            the control plane's version in force is the History page's number).
        mode: speculation mode in force.
        k_current: draft length K of the engine's last step (tokens; 0 while idle).
        k_next: K the policy uses for the next step (tokens), idle or not: the engine's
            ``speculation.k_next`` where it reports it, else the configured K in fixed
            mode (0 in mode off), else ``k_current``.
        k_min, k_max: bounds in force (tokens); k_max_engine: the start-up K_max.
        max_num_seqs, max_num_batched_tokens: caps in force.
        running, waiting: requests now.
        controller: the controller's estimates (acceptance per position, E(K), step
            time T(B,K) in ms, predicted goodput per K in tokens/s, steps per K).
        config: the full config in force (a ``LiveConfig`` dict).
        limits: the engine's start-up settings (``EngineLimits`` dict).
        router: a dual engine host's ``router`` section (mode, share sent to the
            speculative engine, settings, TPOT per engine in ms); empty for one engine.
        core_cpu: the CPU the engine core's step loop has to itself (``--core-cpu``), None
            when it is not pinned.
        checked_at: when this was read (UTC).
    """

    name: str
    url: str
    up: bool
    phase: str = "down"
    error: str | None = None
    config_version: int | None = None
    mode: str | None = None
    k_current: int | None = None
    k_next: int | None = None
    k_min: int | None = None
    k_max: int | None = None
    k_max_engine: int | None = None
    max_num_seqs: int | None = None
    max_num_batched_tokens: int | None = None
    running: int | None = None
    waiting: int | None = None
    controller: dict[str, Any] = field(default_factory=dict)
    config: dict[str, Any] = field(default_factory=dict)
    limits: dict[str, Any] = field(default_factory=dict)
    router: dict[str, Any] = field(default_factory=dict)
    per_request: dict[str, Any] = field(default_factory=dict)
    engine_started_at: datetime | None = None
    core_cpu: int | None = None
    checked_at: datetime = field(default_factory=lambda: datetime.now(timezone.utc))

    @property
    def speculation(self) -> str:
        """The method and draft the engine speculates with, e.g. ``draft_model · draft
        SmolLM2-135M-Instruct-draft-L8`` or ``ngram``; ``""`` when unknown."""
        method = self.limits.get("speculative_method")
        if not self.limits:
            return ""
        if not method:
            return "none"
        draft = self.limits.get("draft_model")
        return f"{method} · draft {Path(str(draft)).name}" if draft else str(method)

    @property
    def label(self) -> str:
        """``UP``, ``DOWN`` or the phase in capitals (``WARMING_UP``)."""
        if not self.up:
            return "DOWN"
        return "UP" if self.phase == "ready" else self.phase.upper()


def k_in_force(spec: dict[str, Any], config: dict[str, Any] | None = None) -> int | None:
    """The K the policy uses for the next step (tokens), idle or not, from a
    ``/control/state`` ``speculation`` section: ``k_next`` when the engine reports it;
    else, for an engine that does not, the configured K in mode ``fixed`` (0 in mode
    ``off``) and ``k_current`` (the last step's K) in the other modes."""
    if spec.get("k_next") is not None:
        return spec.get("k_next")
    conf = (config or {}).get("speculation") or {}
    mode = spec.get("mode") or conf.get("mode")
    if mode == "off":
        return 0
    if mode == "fixed":
        k = spec.get("k", conf.get("k"))
        if k is not None:
            return k
    return spec.get("k_current")


def status_from_state(name: str, url: str, state: dict[str, Any]) -> HostStatus:
    """Turn a ``GET /control/state`` answer into a :class:`HostStatus`."""
    spec = state.get("speculation") or {}
    batch = state.get("batch") or {}
    eng = state.get("engine") or {}
    config = state.get("config") or {}
    return HostStatus(
        name=name,
        url=url,
        up=True,
        phase=str(eng.get("phase") or "unknown"),
        config_version=state.get("config_version"),
        mode=spec.get("mode"),
        k_current=spec.get("k_current"),
        k_next=k_in_force(spec, config),
        k_min=spec.get("k_min"),
        k_max=spec.get("k_max"),
        k_max_engine=spec.get("k_max_engine"),
        max_num_seqs=batch.get("max_num_seqs"),
        max_num_batched_tokens=batch.get("max_num_batched_tokens"),
        running=batch.get("running"),
        waiting=batch.get("waiting"),
        controller=state.get("controller") or {},
        config=config,
        limits=state.get("limits") or {},
        router=state.get("router") or {},
        per_request=spec.get("per_request") or {},
        engine_started_at=utc(eng.get("started_at")),
        core_cpu=eng.get("core_cpu"),
    )


def host_status(store: Store, name: str) -> HostStatus:
    """Ask one engine host for its state (timeout ``STATE_TIMEOUT_S`` s); never raises
    for a host that is down or unreachable.

    Raises:
        ViewError: no host of that name.
    """
    host = get_host(store, name)
    try:
        state = engine_client(store, name).state()
    except Exception as exc:  # down, refused, timeout, 401, 5xx: all shown as DOWN
        return HostStatus(name=name, url=host.url, up=False, error=describe_error(exc))
    return status_from_state(name, host.url, state)


def version_in_force(store: Store, name: str) -> int | None:
    """The control plane's config version applied last on a host (the History page's
    number; :func:`control.versions.last_applied`), None when there is none."""
    from ..versions import last_applied

    try:
        v = last_applied(store, store_mod.get_host(store, name).id)
    except store_mod.UnknownHost:
        return None
    return None if v is None else v.version


# --------------------------------------------------------------------------- samples


def requests_in(hist: dict[str, Any] | None) -> tuple[float | None, float | None]:
    """Requests finished in a sample's interval and their mean E2E latency (ms), from
    the sample's E2E histogram: per-bucket counts keyed ``"lower:upper"`` in seconds
    (the collector's encoding). The mean takes each bucket's midpoint (its lower edge
    for the open ``+Inf`` bucket)."""
    buckets = (hist or {}).get("e2e")
    if not isinstance(buckets, dict) or not buckets:
        return None, None
    n = 0.0
    weighted = 0.0
    for key, count in buckets.items():
        lo, _, hi = str(key).partition(":")
        try:
            lo_f, hi_f = float(lo), float(hi or lo)
        except ValueError:
            continue
        mid = lo_f if math.isinf(hi_f) else (lo_f + hi_f) / 2.0
        n += float(count)
        weighted += float(count) * mid
    return n, (1000.0 * weighted / n if n > 0 else None)


def stored_samples(
    store: Store, name: str, since: float, until: float | None = None, resolution_s: int | None = None
) -> list[dict[str, Any]]:
    """Stored samples of a host from ``since`` to ``until`` (unix s), oldest first
    (:func:`control.samples.samples`), at ``resolution_s`` (1, 60 or 3600 s; default
    :func:`control.samples.choose_resolution`). Each row also has ``interval_s`` (the
    seconds it covers) and ``e2e_ms_mean`` (mean E2E latency in ms from its histogram,
    :func:`requests_in`). With ``--metrics-source prometheus`` the same figures come
    from Prometheus.

    Raises:
        ViewError: no host of that name.
    """
    from ..promsource import metrics_source, prometheus_samples

    until = until or time.time()
    res = resolution_s or samples_mod.choose_resolution(since, until)
    if metrics_source() == "prometheus":
        return prometheus_samples(get_host(store, name).url, since, until, step_s=res)
    try:
        rows = samples_mod.samples(store, name, since, until, resolution_s=res)
    except store_mod.UnknownHost:
        raise ViewError(f"no engine host named {name!r} is registered") from None
    for d in rows:
        d["interval_s"] = d.get("covered_s") or float(res)
        d["e2e_ms_mean"] = requests_in(d.pop("hist", None))[1]
    return rows


#: Sample fields the Live page takes as they are (fractions 0..1, requests, K in tokens, mode).
PLAIN_COLUMNS = (
    "kv_cache_usage",
    "running",
    "waiting",
    "acceptance_rate",
    "k",
    "mode",
    "config_version",
    "max_num_seqs",
)

LIVE_COLUMNS = [
    "t",
    *(f"{kind}_{p}_ms" for kind in LATENCY_KINDS for p in PCTS),
    "output_tokens_per_s",
    "requests_per_s",
    *PLAIN_COLUMNS,
]


def samples_frame(samples: Iterable[dict[str, Any]]) -> pd.DataFrame:
    """Samples (:class:`engine_host.sample.Sample` rows: the engine host's
    ``/control/samples``, the store and Prometheus mode give the same shape) as a DataFrame
    with :data:`LIVE_COLUMNS` (ms, tokens/s, requests/s, KV cache usage and acceptance as
    fractions 0..1, K in tokens)."""
    rows = []
    for s in samples:
        row: dict[str, Any] = {"t": utc(s.get("t"))}
        for kind in LATENCY_KINDS:
            for p in PCTS:
                row[f"{kind}_{p}_ms"] = s.get(f"{kind}_{p}_ms")
        row["output_tokens_per_s"] = s.get("output_tokens_per_s")
        rps = s.get("requests_per_s")
        if rps is None and s.get("requests_finished") is not None:
            rps = float(s["requests_finished"]) / float(s.get("covered_s") or s.get("interval_s") or 1.0)
        row["requests_per_s"] = rps
        for key in PLAIN_COLUMNS:
            row[key] = s.get(key)
        row["acceptance_per_position"] = s.get("acceptance_per_position")
        rows.append(row)
    df = pd.DataFrame(rows, columns=[*LIVE_COLUMNS, "acceptance_per_position"])
    if not df.empty:
        df = df.sort_values("t").reset_index(drop=True)
        num = [c for c in df.columns if c not in ("t", "mode", "acceptance_per_position")]
        df[num] = df[num].apply(pd.to_numeric, errors="coerce")
    return df


# --------------------------------------------------------------------------- changes


@dataclass
class ChangeOutcome:
    """What the engine said about an apply or a rollback.

    Attributes:
        applied: the engine runs the new version.
        version: the version number recorded in the store (None if nothing was recorded).
        message: the engine's message (refusal reason, or what took effect).
        diff: the change as applied.
        engine_version: the engine's own config version after the call.
        k_in_force: K in force right after (tokens): the K the policy uses for the next
            step (:func:`k_in_force`), idle or not.
    """

    applied: bool
    version: int | None
    message: str
    diff: list[dict[str, Any]] = field(default_factory=list)
    engine_version: int | None = None
    k_in_force: int | None = None


def run_change(store: Store, name: str, call: Callable[[], Any]) -> ChangeOutcome:
    """Run an apply or a rollback of :mod:`control.apply` and say what happened (a
    refused change, an unknown host or a busy lease become a ``ChangeOutcome`` with
    ``applied=False`` and the reason; after success the engine is asked for the K in
    force)."""
    from ..apply import ConfigRefused
    from ..store import ControlError

    try:
        r = call()
    except ConfigRefused as exc:
        return ChangeOutcome(False, None, f"refused, nothing recorded: {exc}")
    except (ControlError, ValueError) as exc:
        return ChangeOutcome(False, None, describe_error(exc))
    k_now = None
    if r.ok:
        try:
            state = engine_client(store, name).state()
            k_now = k_in_force(state.get("speculation") or {}, state.get("config") or {})
        except Exception:
            k_now = None
    message = r.message or ""
    if r.notes:
        message = (message + " " + "; ".join(r.notes)).strip()
    return ChangeOutcome(r.ok, r.version, message, r.diff, r.engine_version, k_now)
