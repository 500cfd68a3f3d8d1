"""What the dashboard's pages show and do, as plain data.

Pages hold presentation only: every query and every decision they need lives here,
built on the control plane's public API (store, engine-host client, apply/rollback,
alerts, costs, fleet) and on :mod:`engine_host.config` for validation, so that a field
is defined once. Everything returns plain values or pandas DataFrames with units in
column names (``_ms``, ``_s``, ``_per_s``, ``_usd``, fractions 0..1 named ``_frac`` or
documented), times as timezone-aware UTC datetimes.

A host that is down is data, not an exception: :func:`host_status` answers
``up=False`` with the reason, and the live views fall back to what the store holds.
The engine's control token never leaves this module (nor the client below it).
"""

from __future__ import annotations

import math
import os
import time
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Iterable

import pandas as pd

from engine_host.config import (
    ConfigError,
    EngineLimits,
    LiveConfig,
    RestartRequired,
    apply_patch,
    diff_configs,
)

from . import planner
from .auth import User

ENV_DB = "SPECPILOT_DB"
#: Seconds the dashboard waits for an engine host before calling it down.
STATE_TIMEOUT_S = 1.5

PCTS = ("p50", "p95", "p99")
LATENCY_KINDS = ("ttft", "itl", "e2e", "queue")


class ViewError(RuntimeError):
    """A page's request cannot be served; the message is fit to show to a user."""


class PermissionDenied(ViewError):
    """The user's role does not allow the action."""


def describe_error(exc: BaseException) -> str:
    """A one-line, user-facing description of an error (no traceback, no secrets)."""
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    return text[:300]


def _utc(ts: float | int | datetime | None) -> datetime | None:
    if ts is None:
        return None
    if isinstance(ts, datetime):
        return ts if ts.tzinfo else ts.replace(tzinfo=timezone.utc)
    return datetime.fromtimestamp(float(ts), tz=timezone.utc)


# --------------------------------------------------------------------------- store access
# The control plane's store and client (control/store.py, control/client.py ...) are
# reached only through the functions in this section.


def db_url() -> str | None:
    """The store URL the dashboard was started with (``--db`` / ``$SPECPILOT_DB``),
    None for the default SQLite file in ``$SPECPILOT_HOME``."""
    return os.environ.get(ENV_DB) or os.environ.get("SPECPILOT_DB_URL") or None


_BACKEND: Any = None


def set_backend(backend: Any) -> None:
    """Replace the store/engine access object (tests and benchmarks); None restores the
    default :class:`StoreBackend`."""
    global _BACKEND
    _BACKEND = backend


def _backend() -> Any:
    global _BACKEND
    if _BACKEND is None:
        _BACKEND = StoreBackend(db_url())
    return _BACKEND


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


def list_hosts() -> list[HostInfo]:
    """Registered engine hosts, by name."""
    return sorted(_backend().list_hosts(), key=lambda h: h.name)


def get_host(name: str) -> HostInfo:
    """One registered host.

    Raises:
        ViewError: no host of that name.
    """
    for h in list_hosts():
        if h.name == name:
            return h
    raise ViewError(f"no engine host named {name!r} is registered")


@dataclass
class HostStatus:
    """What an engine host says now (``GET /control/state``), or why it says nothing.

    Attributes:
        name: host name.
        url: engine host URL.
        up: answered within ``STATE_TIMEOUT_S`` seconds.
        phase: ``ready``, ``warming_up``, ``loading`` ... or ``down``.
        error: why it is down (connection refused, timeout, HTTP status).
        config_version: version in force on the engine.
        mode: speculation mode in force.
        k_current: draft length K in force now (tokens).
        k_min, k_max: bounds in force (tokens); k_max_engine: the start-up K_max.
        max_num_seqs, max_num_batched_tokens: caps in force.
        running, waiting: requests now.
        controller: the controller's estimates (acceptance per position, E(K), step
            time T(B,K) in ms, predicted goodput per K in tokens/s, steps per K).
        config: the full config in force (a ``LiveConfig`` dict).
        limits: the engine's start-up settings (``EngineLimits`` dict).
        router: a dual engine host's ``router`` section (mode, share sent to the
            speculative engine, settings, TPOT per engine in ms); empty for one engine.
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


def status_from_state(name: str, url: str, state: dict[str, Any]) -> HostStatus:
    """Turn a ``GET /control/state`` answer into a :class:`HostStatus`."""
    spec = state.get("speculation") or {}
    batch = state.get("batch") or {}
    eng = state.get("engine") or {}
    return HostStatus(
        name=name,
        url=url,
        up=True,
        phase=str(eng.get("phase") or "unknown"),
        config_version=state.get("config_version"),
        mode=spec.get("mode"),
        k_current=spec.get("k_current"),
        k_min=spec.get("k_min"),
        k_max=spec.get("k_max"),
        k_max_engine=spec.get("k_max_engine"),
        max_num_seqs=batch.get("max_num_seqs"),
        max_num_batched_tokens=batch.get("max_num_batched_tokens"),
        running=batch.get("running"),
        waiting=batch.get("waiting"),
        controller=state.get("controller") or {},
        config=state.get("config") or {},
        limits=state.get("limits") or {},
        router=state.get("router") or {},
        per_request=spec.get("per_request") or {},
        engine_started_at=_utc(eng.get("started_at")),
    )


def per_request_line(status: HostStatus) -> str | None:
    """One line on draft length per request: how many running requests had their drafts
    verified in the last step, and how per-request acceptance is spread (requests per
    acceptance bin). None when the engine does not report it (no speculation, older engine)."""
    pr = status.per_request or {}
    if not pr or not status.k_max_engine:
        return None
    if not pr.get("enabled"):
        return "Draft length per request: off (every request verifies the step's K; adaptive mode turns it on)"
    bins = pr.get("acceptance_bins") or []
    hist = pr.get("acceptance_hist") or []
    spread = ", ".join(f"{n} at {lo:.0%}-{(bins[i + 1] if i + 1 < len(bins) else 1.0):.0%}"
                       for i, (lo, n) in enumerate(zip(bins, hist)) if n)
    return (f"Draft length per request: {pr.get('requests_verified', 0)} of {pr.get('requests_with_drafts', 0)} "
            f"requests with drafts verified them in the last step · per-request acceptance: {spread or 'no data yet'}")


def routing_summary(router: dict[str, Any]) -> str | None:
    """One line on a dual engine host's routing from its ``router`` section, e.g.
    ``routing auto · speculative engine resting: probes of 1 s every 80 s at 10%, next in
    31 s · TPOT plain 4.1 ms, speculative 10.6 ms`` (the interval as backed off now); None
    for a single engine host."""
    if not router or not router.get("mode"):
        return None
    parts = [f"routing {router['mode']}"]
    p = router.get("p_speculative")
    if router["mode"] == "auto" and isinstance(p, (int, float)):
        settings = router.get("settings") or {}
        if router.get("resting") and settings.get("probe_every_s"):
            probes = router.get("probes") or {}
            every = probes.get("every_s", settings["probe_every_s"])
            share = (f"speculative engine resting: probes of {settings.get('probe_s', 1):g} s every "
                     f"{every:g} s at {settings.get('p_probe', 0):.0%}")
            if isinstance(probes.get("next_in_s"), (int, float)):
                share += " (probing now)" if probes["next_in_s"] <= 0 else f", next in {probes['next_in_s']:.0f} s"
        else:
            share = f"{p:.0%} to the speculative engine"
        parts.append(share)
    tpot = router.get("tpot_ms") or {}
    shown = [f"{e} {v:.1f} ms" for e, v in tpot.items() if isinstance(v, (int, float))]
    if shown:
        parts.append("TPOT " + ", ".join(shown))
    return " · ".join(parts)


def host_status(name: str) -> HostStatus:
    """Ask one engine host for its state (timeout ``STATE_TIMEOUT_S`` s); never raises
    for a host that is down or unreachable."""
    host = get_host(name)
    try:
        state = _backend().engine_state(name, timeout_s=STATE_TIMEOUT_S)
    except Exception as exc:  # down, refused, timeout, 401, 5xx: all shown as DOWN
        return HostStatus(name=name, url=host.url, up=False, error=describe_error(exc))
    return status_from_state(name, host.url, state)


# --------------------------------------------------------------------------- live series

LIVE_COLUMNS = [
    "t",
    *(f"{kind}_{p}_ms" for kind in LATENCY_KINDS for p in PCTS),
    "output_tokens_per_s",
    "requests_per_s",
    "kv_cache_usage",
    "running",
    "waiting",
    "acceptance_rate",
    "k",
    "mode",
    "config_version",
    "max_num_seqs",
]


def samples_frame(samples: Iterable[dict[str, Any]]) -> pd.DataFrame:
    """Per-second samples (the engine host's ``/control/samples`` shape, or the store's
    flat shape) as a DataFrame with :data:`LIVE_COLUMNS` (ms, tokens/s, requests/s,
    KV cache usage and acceptance as fractions 0..1, K in tokens)."""
    rows = []
    for s in samples:
        row: dict[str, Any] = {"t": _utc(s.get("t"))}
        for kind in LATENCY_KINDS:
            nested = s.get(f"{kind}_ms")
            for p in PCTS:
                flat = s.get(f"{kind}_{p}_ms", s.get(f"{kind}_ms_{p}"))
                row[f"{kind}_{p}_ms"] = nested.get(p) if isinstance(nested, dict) else flat
        row["output_tokens_per_s"] = s.get("output_tokens_per_s")
        rps = s.get("requests_per_s")
        if rps is None and s.get("requests_finished") is not None:
            rps = float(s["requests_finished"]) / float(s.get("interval_s") or 1.0)
        row["requests_per_s"] = rps
        for key in ("kv_cache_usage", "running", "waiting", "acceptance_rate", "k", "mode", "config_version",
                    "max_num_seqs"):
            row[key] = s.get(key)
        row["acceptance_per_position"] = s.get("acceptance_per_position")
        rows.append(row)
    df = pd.DataFrame(rows, columns=[*LIVE_COLUMNS, "acceptance_per_position"])
    if not df.empty:
        df = df.sort_values("t").reset_index(drop=True)
        num = [c for c in df.columns if c not in ("t", "mode", "acceptance_per_position")]
        df[num] = df[num].apply(pd.to_numeric, errors="coerce")
    return df


@dataclass
class LiveView:
    """Everything the Live page draws for one host.

    Attributes:
        status: the host now (up or down).
        series: per-second samples of the window (:func:`samples_frame` columns).
        markers: config changes in the window: ``t`` (UTC), ``version``, ``label``,
            ``author``, ``reason``.
        acceptance_per_position: ``position`` (1..K), ``measured`` (window mean of
            accepted/drafted at that position, 0..1), ``estimated`` (the controller's
            P(positions 1..i all accepted), 0..1).
        goodput_by_k: ``k``, ``predicted_goodput_tokens_per_s``, ``expected_tokens_per_step``,
            ``step_time_ms`` from the controller (why it chose K).
        source: ``store`` (collector samples) or ``engine`` (the host's own ring buffer).
        window_s: the window (seconds).
    """

    status: HostStatus
    series: pd.DataFrame
    markers: pd.DataFrame
    acceptance_per_position: pd.DataFrame
    goodput_by_k: pd.DataFrame
    source: str
    window_s: float

    def latest(self, column: str) -> Any:
        """Last non-null value of a series column (None when there is none)."""
        if self.series.empty or column not in self.series:
            return None
        col = self.series[column].dropna()
        return None if col.empty else col.iloc[-1].item() if hasattr(col.iloc[-1], "item") else col.iloc[-1]

    def window_mean(self, column: str) -> float | None:
        """Mean of a column over the window (None when empty)."""
        if self.series.empty or column not in self.series:
            return None
        col = self.series[column].dropna()
        return None if col.empty else float(col.mean())


def markers_from_series(series: pd.DataFrame) -> pd.DataFrame:
    """Config changes seen in samples (where ``config_version`` changes)."""
    cols = ["t", "version", "label", "author", "reason"]
    if series.empty or series["config_version"].dropna().empty:
        return pd.DataFrame(columns=cols)
    v = series[["t", "config_version"]].dropna()
    changed = v[v["config_version"].diff().fillna(0) != 0]
    return pd.DataFrame({
        "t": changed["t"].values,
        "version": changed["config_version"].astype(int).values,
        "label": [f"v{int(x)}" for x in changed["config_version"]],
        "author": None,
        "reason": None,
    }, columns=cols)


def _acceptance_table(series: pd.DataFrame, controller: dict[str, Any]) -> pd.DataFrame:
    measured: list[list[float]] = []
    if not series.empty:
        for per_pos in series["acceptance_per_position"].dropna():
            if isinstance(per_pos, (list, tuple)):
                for i, v in enumerate(per_pos):
                    while len(measured) <= i:
                        measured.append([])
                    if v is not None:
                        measured[i].append(float(v))
    est = list(controller.get("acceptance_per_position") or [])
    n = max(len(measured), len(est))
    return pd.DataFrame({
        "position": list(range(1, n + 1)),
        "measured": [(sum(m) / len(m)) if i < len(measured) and measured[i] else None
                     for i, m in enumerate(measured + [[]] * (n - len(measured)))],
        "estimated": [est[i] if i < len(est) else None for i in range(n)],
    })


def _goodput_table(controller: dict[str, Any]) -> pd.DataFrame:
    g = controller.get("predicted_goodput_tokens_per_s") or {}
    e = controller.get("expected_tokens_per_step") or {}
    st_ = controller.get("step_time_ms") or {}
    ks = sorted({int(k) for k in (*g, *e, *st_)})
    return pd.DataFrame({
        "k": ks,
        "predicted_goodput_tokens_per_s": [g.get(str(k), g.get(k)) for k in ks],
        "expected_tokens_per_step": [e.get(str(k), e.get(k)) for k in ks],
        "step_time_ms": [st_.get(str(k), st_.get(k)) for k in ks],
    })


def live_view(name: str, window_s: float = 600.0) -> LiveView:
    """The Live page's data for one host over the last ``window_s`` seconds.

    Samples come from the store (the collector's 1 s samples); when the store holds
    none for the window (collector not running yet) the engine host's own ring buffer
    (last 10 minutes) is used. A host that is down gives ``status.up == False`` and
    whatever the store still holds.
    """
    status = host_status(name)
    since = time.time() - window_s
    source = "store"
    try:
        samples = _backend().stored_samples(name, since=since)
    except Exception:
        samples = []
    if not samples and status.up:
        try:
            samples = _backend().engine_samples(name, since=since, timeout_s=STATE_TIMEOUT_S)
            source = "engine"
        except Exception:
            samples = []
    series = samples_frame(samples)
    markers = version_markers(name, since)
    if markers.empty:
        markers = markers_from_series(series)
    return LiveView(
        status=status,
        series=series,
        markers=markers,
        acceptance_per_position=_acceptance_table(series, status.controller),
        goodput_by_k=_goodput_table(status.controller),
        source=source,
        window_s=window_s,
    )


# --------------------------------------------------------------------------- config & control


@dataclass
class ChangePreview:
    """A proposed change checked against the config in force.

    Attributes:
        ok: valid and different from the config in force.
        new_config: the config it would put in force (``LiveConfig`` dict), when valid.
        diff: ``[{"field", "old", "new"}]`` against the config in force.
        errors: ``{field path: message}`` for inline display (``speculation.k`` ...).
        restart_required: the change needs an engine restart (refused).
    """

    ok: bool
    new_config: dict[str, Any] | None
    diff: list[dict[str, Any]]
    errors: dict[str, str]
    restart_required: bool = False


def _errors_by_field(exc: ConfigError) -> dict[str, str]:
    out: dict[str, str] = {}
    for e in exc.errors:
        loc = ".".join(str(x) for x in e.get("loc", []) if x not in ("body",))
        msg = str(e.get("msg", "invalid"))
        msg = msg.removeprefix("Value error, ")
        out[loc or "config"] = (out[loc or "config"] + "; " + msg) if loc in out else msg
    return out


def preview_change(current: dict[str, Any], limits: dict[str, Any], patch: dict[str, Any]) -> ChangePreview:
    """Validate a partial config against the config in force and the engine's start-up
    limits with the engine's own rules (:func:`engine_host.config.apply_patch`).

    Args:
        current: the config in force (``LiveConfig`` dict).
        limits: the engine's start-up settings (``EngineLimits`` dict).
        patch: the change (any subset of the ``LiveConfig`` JSON).
    Returns:
        The :class:`ChangePreview`; ``errors`` keyed by dotted field path.
    """
    try:
        cur = LiveConfig.model_validate(current or {})
        lim = EngineLimits.model_validate(limits)
    except Exception as exc:
        return ChangePreview(False, None, [], {"config": f"the engine's config cannot be read: {describe_error(exc)}"})
    try:
        new = apply_patch(cur, patch, lim)
    except RestartRequired as exc:
        return ChangePreview(False, None, [], _errors_by_field(exc), restart_required=True)
    except ConfigError as exc:
        return ChangePreview(False, None, [], _errors_by_field(exc))
    diff = diff_configs(cur.model_dump(mode="json"), new.model_dump(mode="json"))
    if not diff:
        return ChangePreview(False, new.model_dump(mode="json"), [], {"config": "nothing changes: this is the config in force"})
    return ChangePreview(True, new.model_dump(mode="json"), diff, {})


def _require(user: User | None, action: str) -> User:
    if user is None or not user.can(action):
        who = "nobody is logged in" if user is None else f"{user.name} is a {user.role}"
        raise PermissionDenied(f"only operators may {action}: {who}")
    return user


def require_reason(reason: str | None) -> str:
    """The reason for a change, stripped.

    Raises:
        ViewError: empty or shorter than 4 characters.
    """
    r = (reason or "").strip()
    if len(r) < 4:
        raise ViewError("a reason is required (at least 4 characters): say why, for the history")
    return r


@dataclass
class ChangeOutcome:
    """What the engine said about an apply or a rollback.

    Attributes:
        applied: the engine runs the new version.
        version: the version number recorded in the store (None if nothing was recorded).
        message: the engine's message (refusal reason, or what took effect).
        diff: the change as applied.
        engine_version: the engine's own config version after the call.
        k_current: K in force right after (tokens).
    """

    applied: bool
    version: int | None
    message: str
    diff: list[dict[str, Any]] = field(default_factory=list)
    engine_version: int | None = None
    k_current: int | None = None


def apply_change(name: str, patch: dict[str, Any], user: User | None, reason: str) -> ChangeOutcome:
    """Apply a change to a host as ``user`` (operators only), recorded in the history
    with the user's name as author and ``reason``.

    Raises:
        PermissionDenied: the user may not apply.
        ViewError: no reason given, or the host is unknown.
    """
    user = _require(user, "apply")
    reason = require_reason(reason)
    get_host(name)
    return _backend().apply(name, patch, author=user.name, reason=reason)


def rollback(name: str, version: int, user: User | None, reason: str) -> ChangeOutcome:
    """Put an earlier version back in force as a new version (operators only).

    Raises:
        PermissionDenied / ViewError: as :func:`apply_change`.
    """
    user = _require(user, "rollback")
    reason = require_reason(reason)
    get_host(name)
    return _backend().rollback(name, int(version), author=user.name, reason=reason)


# --------------------------------------------------------------------------- history

HISTORY_COLUMNS = ["host", "version", "created_at", "author", "reason", "outcome", "message", "applied_at",
                   "source", "diff_text", "diff", "config"]


def diff_text(diff: list[dict[str, Any]] | None) -> str:
    """A diff as one line per field: ``speculation.k: 2 → 4``."""
    if not diff:
        return ""
    return "\n".join(f"{d['field']}: {d.get('old')!r} → {d.get('new')!r}" for d in diff)


def history(host: str | None = None, since: datetime | None = None, until: datetime | None = None,
            limit: int = 500) -> pd.DataFrame:
    """Config versions, newest first: :data:`HISTORY_COLUMNS` (times UTC; ``outcome`` is
    ``applied``, ``failed`` or ``pending``; ``source`` ``apply``, ``rollback to vN``,
    ``import`` (the engine's own config at first contact) or ``reapply`` (after an engine
    restart); ``diff_text`` one change per line).

    Args:
        host: one host, or None for all.
        since, until: keep versions created in this span.
        limit: most rows returned.
    """
    rows = _backend().versions(host=host, since=since, until=until, limit=limit)
    df = pd.DataFrame(rows, columns=[c for c in HISTORY_COLUMNS if c != "diff_text"])
    df["diff_text"] = [diff_text(d) for d in df["diff"]] if not df.empty else []
    if not df.empty:
        df = df.sort_values(["created_at", "version"], ascending=False).reset_index(drop=True)
    return df[HISTORY_COLUMNS]


def version_markers(name: str, since: float) -> pd.DataFrame:
    """Config versions of a host created after ``since`` (unix s), as chart markers:
    ``t``, ``version``, ``label`` (``v12``), ``author``, ``reason``."""
    cols = ["t", "version", "label", "author", "reason"]
    try:
        df = history(host=name, since=_utc(since))
    except Exception:
        return pd.DataFrame(columns=cols)
    if df.empty:
        return pd.DataFrame(columns=cols)
    df = df[df["outcome"] == "applied"]
    t = df["applied_at"].fillna(df["created_at"])
    return pd.DataFrame({"t": t.values, "version": df["version"].values,
                         "label": [f"v{v}" for v in df["version"]], "author": df["author"].values,
                         "reason": df["reason"].values}, columns=cols).sort_values("t")


# --------------------------------------------------------------------------- alerts


@dataclass
class AlertSummary:
    """Open alerts across the fleet for the banner on every page.

    Attributes:
        open_count: number of open alerts.
        lines: one short line per open alert, most severe first (``host: rule since HH:MM``).
    """

    open_count: int
    lines: list[str]


ALERT_COLUMNS = ["id", "host", "rule", "severity", "message", "value", "started_at", "ended_at", "open", "duration_s"]


def alerts(open_only: bool = False, host: str | None = None, since: datetime | None = None,
           limit: int = 500) -> pd.DataFrame:
    """Alerts, newest first: :data:`ALERT_COLUMNS` (times UTC, ``duration_s`` seconds,
    to now for open ones)."""
    rows = _backend().alerts(open_only=open_only, host=host, since=since, limit=limit)
    df = pd.DataFrame(rows, columns=[c for c in ALERT_COLUMNS if c not in ("open", "duration_s")])
    now = datetime.now(timezone.utc)
    if df.empty:
        return pd.DataFrame(columns=ALERT_COLUMNS)
    df["open"] = df["ended_at"].isna()
    end = df["ended_at"].where(~df["open"], now)
    df["duration_s"] = [(e - s).total_seconds() if s is not None else None for s, e in zip(df["started_at"], end)]
    return df.sort_values("started_at", ascending=False).reset_index(drop=True)[ALERT_COLUMNS]


def alert_summary() -> AlertSummary:
    """Open alerts across all hosts, for the banner."""
    df = alerts(open_only=True)
    order = {"critical": 0, "warning": 1, "info": 2}
    if df.empty:
        return AlertSummary(0, [])
    df = df.assign(_o=df["severity"].map(lambda s: order.get(str(s), 3))).sort_values(["_o", "started_at"])
    lines = [f"{r.host}: {r.message or r.rule} (since {r.started_at:%H:%M} UTC)" for r in df.itertuples()]
    return AlertSummary(len(df), lines)


# --------------------------------------------------------------------------- fleet


def fleet_overview() -> pd.DataFrame:
    """All hosts at a glance, one row each: ``host``, ``state`` (UP/DOWN/phase),
    ``mode``, ``k_current`` (tokens), ``running``, ``max_num_seqs``, ``waiting``,
    ``open_alerts``, ``output_tokens_per_s`` and ``ttft_p99_ms`` (last minute, from the
    store), ``usd_per_hour``, ``gpu_kind``, ``url``, ``error``."""
    open_alerts = alerts(open_only=True)
    counts = open_alerts.groupby("host").size().to_dict() if not open_alerts.empty else {}
    rows = []
    since = time.time() - 60
    for h in list_hosts():
        s = host_status(h.name)
        try:
            recent = samples_frame(_backend().stored_samples(h.name, since=since))
        except Exception:
            recent = samples_frame([])
        rows.append({
            "host": h.name,
            "state": s.label,
            "mode": s.mode,
            "k_current": s.k_current,
            "running": s.running,
            "max_num_seqs": s.max_num_seqs,
            "waiting": s.waiting,
            "open_alerts": int(counts.get(h.name, 0)),
            "output_tokens_per_s": float(recent["output_tokens_per_s"].mean()) if not recent.empty else None,
            "ttft_p99_ms": float(recent["ttft_p99_ms"].max()) if not recent["ttft_p99_ms"].dropna().empty else None,
            "usd_per_hour": h.usd_per_hour,
            "gpu_kind": h.gpu_kind,
            "url": h.url,
            "error": s.error,
        })
    return pd.DataFrame(rows)


# --------------------------------------------------------------------------- cost review


@dataclass
class WeeklyReport:
    """The weekly cost review.

    Attributes:
        start, end: the week (UTC).
        summary: one row per host: ``host``, ``usd`` (cost of the week), ``output_tokens``,
            ``usd_per_million_tokens``, ``utilisation`` (0..1), ``baseline_usd_per_million_tokens``,
            ``saving_usd`` (against the baseline), ``saving_frac`` (0..1).
        daily: one row per host and day: ``host``, ``day`` (date), ``usd``, ``output_tokens``,
            ``usd_per_million_tokens``, ``utilisation``.
        baseline: what the saving is measured against (text).
        csv: the report as CSV (bytes, UTF-8).
    """

    start: datetime
    end: datetime
    summary: pd.DataFrame
    daily: pd.DataFrame
    baseline: str
    csv: bytes


def weekly_report(host: str | None = None, end: datetime | None = None, baseline: str = "k0") -> WeeklyReport:
    """The weekly cost report from the control plane's cost model (:mod:`control.cost`)
    for the 7 days before ``end`` (all hosts, or one).

    Args:
        baseline: ``k0`` (no speculation) or ``version:N`` (that config version's period).
    """
    return _backend().weekly_report(host=host, end=end, baseline=baseline)


SUMMARY_COLUMNS = ["host", "usd", "output_tokens", "usd_per_million_tokens", "utilisation",
                   "baseline_usd_per_million_tokens", "saving_usd", "saving_frac", "busy_tokens_per_s",
                   "acceptance_rate", "mean_k", "uptime_h", "baseline_note"]
DAILY_COLUMNS = ["host", "day", "usd", "output_tokens", "usd_per_million_tokens", "utilisation"]


def report_from_cost(rep: Any) -> WeeklyReport:
    """A :class:`control.cost.WeeklyReport` as the dashboard's :class:`WeeklyReport`."""
    summary = pd.DataFrame([{**h, "saving_frac": h.get("saving_fraction")} for h in rep.hosts])
    summary = summary.reindex(columns=SUMMARY_COLUMNS)
    daily = pd.DataFrame(rep.days).reindex(columns=DAILY_COLUMNS)
    if not daily.empty:
        daily["day"] = pd.to_datetime(daily["day"]).dt.date
    base = "K = 0 (no speculation)" if rep.baseline == "k0" else rep.baseline.replace("version:", "config version ")
    return WeeklyReport(start=_utc(rep.start), end=_utc(rep.end), summary=summary, daily=daily, baseline=base,
                        csv=rep.to_csv().encode("utf-8"))


# --------------------------------------------------------------------------- planner


@dataclass
class PlannerView:
    """The Planner page's data for one host.

    Attributes:
        fits: fitted model per K (:class:`control.planner.LatencyFit`).
        problems: K -> why it could not be fitted.
        points: measured points (``k``, ``rate_rps``, ``latency_s``, ``t_start``, ``n_requests``).
        days: how far back the samples go (days).
        window_s: window of samples per measured point (seconds).
    """

    fits: dict[int, planner.LatencyFit]
    problems: dict[int, str]
    points: pd.DataFrame
    days: float
    window_s: float


def planner_view(name: str, days: float = 7.0, window_s: float = 60.0) -> PlannerView:
    """Fit Kong et al.'s latency model per K from the host's stored samples of the last
    ``days`` days (points of ``window_s`` seconds at constant K)."""
    since = time.time() - days * 86400.0
    samples = _backend().stored_samples(name, since=since, resolution_s=1 if window_s < 60 else 60,
                                        columns=("k", "e2e_p50_ms"))
    pts = planner.points_from_samples(samples, window_s=window_s)
    fits, problems = planner.fit_per_k(pts)
    df = pd.DataFrame([p.__dict__ for p in pts], columns=["k", "rate_rps", "latency_s", "t_start", "n_requests"])
    return PlannerView(fits=fits, problems=problems, points=df, days=days, window_s=window_s)


def planner_points_for_display(view: PlannerView, max_per_k: int = 120) -> pd.DataFrame:
    """Measured points to draw: each K's points as they are when there are at most
    ``max_per_k``, else binned by request rate (``max_per_k`` equal-width bins) to the
    mean rate and mean latency of each bin. Columns ``k``, ``rate_rps`` (requests/s),
    ``latency_s`` (seconds), ``n`` (windows behind the point). The fit always uses every
    point; this only keeps the chart light (thousands of SVG markers take seconds to draw)."""
    cols = ["k", "rate_rps", "latency_s", "n"]
    if view.points.empty:
        return pd.DataFrame(columns=cols)
    frames = []
    for k, g in view.points.groupby("k"):
        if len(g) <= max_per_k:
            frames.append(g.assign(n=1)[cols])
            continue
        bins = pd.cut(g["rate_rps"], bins=max_per_k)
        agg = g.groupby(bins, observed=True).agg(rate_rps=("rate_rps", "mean"), latency_s=("latency_s", "mean"),
                                                 n=("latency_s", "size")).reset_index(drop=True)
        frames.append(agg.assign(k=k)[cols])
    return pd.concat(frames, ignore_index=True)


def planner_curves(view: PlannerView, rate_max_rps: float | None = None, n: int = 200) -> pd.DataFrame:
    """Predicted mean latency against request rate for every fitted K: ``k``,
    ``rate_rps`` (requests/s), ``latency_s`` (seconds), up to ``rate_max_rps`` (default
    1.2x the highest saturation rate or measured rate)."""
    if not view.fits:
        return pd.DataFrame(columns=["k", "rate_rps", "latency_s"])
    if rate_max_rps is None:
        finite = [f.saturation_rps for f in view.fits.values() if math.isfinite(f.saturation_rps)]
        measured = float(view.points["rate_rps"].max()) if not view.points.empty else 1.0
        rate_max_rps = 1.1 * max(finite + [measured])
    frames = []
    for k, f in sorted(view.fits.items()):
        r, lat = planner.curve(f, rate_max_rps, n=n)
        frames.append(pd.DataFrame({"k": k, "rate_rps": r, "latency_s": lat}))
    return pd.concat(frames, ignore_index=True)


# --------------------------------------------------------------------------- the store backend

_ENGINES: dict[str, Any] = {}


def store_engine(url: str | None = None) -> Any:
    """The SQLAlchemy engine of the store (opened and migrated once per process)."""
    from . import db

    key = url or db.default_url()
    if key not in _ENGINES:
        _ENGINES[key] = db.open_engine(key)
    return _ENGINES[key]


def _requests_in(hist: dict[str, Any] | None) -> tuple[float | None, float | None]:
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


class StoreBackend:
    """Store and engine-host access on top of the control plane's public API: reads
    query the store's models (``control.models``) directly, changes go through the
    control plane's apply and rollback (validate, record pending, send, record outcome).

    Args:
        url: store URL (default ``$SPECPILOT_DB`` or the SQLite file in ``$SPECPILOT_HOME``).
    """

    #: Sample resolution (s) used for a span of this many seconds or less.
    RESOLUTIONS = ((3600.0, 1), (3 * 86400.0, 60), (math.inf, 3600))

    def __init__(self, url: str | None = None):
        self.url = url
        self._clients: dict[tuple[str, str, str], Any] = {}
        self._store: Any = None

    @property
    def engine(self) -> Any:
        return store_engine(self.url)

    @property
    def store(self) -> Any:
        """The control plane's :class:`control.store.Store` on the same database."""
        if self._store is None:
            from .store import Store

            self._store = Store(self.engine)
        return self._store

    def _session(self) -> Any:
        from sqlalchemy.orm import Session

        return Session(self.engine)

    def _host(self, session: Any, name: str) -> Any:
        from sqlalchemy import select

        from .models import Host

        h = session.scalars(select(Host).where(Host.name == name, Host.removed_at.is_(None))).first()
        if h is None:
            raise ViewError(f"no engine host named {name!r} is registered")
        return h

    def list_hosts(self) -> list[HostInfo]:
        from sqlalchemy import select

        from .models import Host

        with self._session() as s:
            return [HostInfo(h.name, h.url, h.gpu_kind, h.usd_per_hour)
                    for h in s.scalars(select(Host).where(Host.removed_at.is_(None)).order_by(Host.name))]

    def _client(self, name: str) -> Any:
        """A cached engine-host client (control plane's :class:`control.client.EngineClient`)
        with a short timeout and no retries: the dashboard would rather say DOWN than hang."""
        from .client import EngineClient

        with self._session() as s:
            h = self._host(s, name)
            key = (h.name, h.url, h.token_env)
            host = h
        c = self._clients.get(key)
        if c is None:
            c = EngineClient.for_host(host, need_token=False, timeout_s=STATE_TIMEOUT_S, retries=0)
            self._clients[key] = c
        return c

    def engine_state(self, name: str, timeout_s: float = STATE_TIMEOUT_S) -> dict[str, Any]:
        return self._client(name).state()

    def engine_samples(self, name: str, since: float, timeout_s: float = STATE_TIMEOUT_S) -> list[dict[str, Any]]:
        return self._client(name).samples(since)

    def stored_samples(self, name: str, since: float, until: float | None = None,
                       resolution_s: int | None = None, columns: Iterable[str] | None = None) -> list[dict[str, Any]]:
        """Stored samples of a host from ``since`` to ``until`` (unix s), oldest first, at
        ``resolution_s`` (1, 60 or 3600 s; default: by span, :data:`RESOLUTIONS`); only
        ``columns`` of ``metric_samples`` when given (``t``, ``covered_s`` and ``hist`` are
        always read)."""
        from sqlalchemy import select

        from .models import MetricSample
        from .promsource import metrics_source, prometheus_samples

        until = until or time.time()
        res = resolution_s or next(r for span, r in self.RESOLUTIONS if until - since <= span)
        if metrics_source() == "prometheus":  # --metrics-source prometheus: the same figures from Prometheus
            with self._session() as s:
                url = self._host(s, name).url
            return prometheus_samples(url, since, until, step_s=res)
        wanted = None if columns is None else set(columns) | {"t", "covered_s", "hist"}
        cols = [c for c in MetricSample.__table__.columns if c.name not in ("host_id", "resolution_s")
                and (wanted is None or c.name in wanted)]
        with self._session() as s:
            hid = self._host(s, name).id
            rows = s.execute(select(*cols).where(MetricSample.host_id == hid, MetricSample.resolution_s == res,
                                                 MetricSample.t >= since, MetricSample.t <= until)
                             .order_by(MetricSample.t)).mappings().all()
        out = []
        for r in rows:
            d = dict(r)
            covered = d.get("covered_s") or float(res)
            d["interval_s"] = covered
            n, e2e_mean = _requests_in(d.pop("hist", None))
            d["requests_finished"] = n
            d["e2e_ms_mean"] = e2e_mean
            d["requests_per_s"] = None if n is None else n / covered
            out.append(d)
        return out

    def versions(self, host: str | None = None, since: datetime | None = None, until: datetime | None = None,
                 limit: int = 500) -> list[dict[str, Any]]:
        from sqlalchemy import select

        from .models import ConfigVersion, Host

        q = select(ConfigVersion, Host.name).join(Host, Host.id == ConfigVersion.host_id)
        if host:
            q = q.where(Host.name == host)
        if since:
            q = q.where(ConfigVersion.created_at >= since.timestamp())
        if until:
            q = q.where(ConfigVersion.created_at <= until.timestamp())
        q = q.order_by(ConfigVersion.created_at.desc(), ConfigVersion.version.desc()).limit(limit)
        with self._session() as s:
            return [{
                "host": hname, "version": v.version, "created_at": _utc(v.created_at),
                "author": v.author, "reason": v.reason, "outcome": v.status, "message": v.engine_message,
                "source": f"rollback to v{v.rollback_of}" if v.source == "rollback" and v.rollback_of else v.source,
                "applied_at": _utc(v.finished_at) if v.status == "applied" else None,
                "diff": v.diff or [], "config": v.config,
            } for v, hname in s.execute(q)]

    def alerts(self, open_only: bool = False, host: str | None = None, since: datetime | None = None,
               limit: int = 500) -> list[dict[str, Any]]:
        from sqlalchemy import or_, select

        from .models import AlertEvent, AlertRule, Host

        q = (select(AlertEvent, AlertRule, Host.name).join(AlertRule, AlertRule.id == AlertEvent.rule_id)
             .join(Host, Host.id == AlertEvent.host_id))
        if open_only:
            q = q.where(AlertEvent.ended_at.is_(None))
        if host:
            q = q.where(Host.name == host)
        if since:
            q = q.where(or_(AlertEvent.ended_at.is_(None), AlertEvent.ended_at >= since.timestamp()))
        q = q.order_by(AlertEvent.started_at.desc()).limit(limit)
        with self._session() as s:
            return [{
                "id": e.id, "host": hname, "rule": r.name, "severity": r.severity, "message": e.message,
                "value": e.value, "started_at": _utc(e.started_at), "ended_at": _utc(e.ended_at),
            } for e, r, hname in s.execute(q)]

    def _change(self, name: str, author: str, reason: str, call: Any) -> ChangeOutcome:
        from .apply import ConfigRefused
        from .store import ControlError

        try:
            r = call()
        except ConfigRefused as exc:
            return ChangeOutcome(False, None, f"refused, nothing recorded: {exc}")
        except (ControlError, ValueError) as exc:
            return ChangeOutcome(False, None, describe_error(exc))
        k_now = None
        if r.ok:
            try:
                k_now = (self.engine_state(name).get("speculation") or {}).get("k_current")
            except Exception:
                k_now = None
        message = r.message or ""
        if r.notes:
            message = (message + " " + "; ".join(r.notes)).strip()
        return ChangeOutcome(r.ok, r.version, message, r.diff, r.engine_version, k_now)

    def apply(self, name: str, patch: dict[str, Any], author: str, reason: str) -> ChangeOutcome:
        from .apply import apply_change

        return self._change(name, author, reason, lambda: apply_change(
            self.store, name, patch, reason=reason, author=author, interface="dashboard"))

    def rollback(self, name: str, version: int, author: str, reason: str) -> ChangeOutcome:
        from .apply import rollback

        return self._change(name, author, reason, lambda: rollback(
            self.store, name, version, reason=reason, author=author, interface="dashboard"))

    def weekly_report(self, host: str | None = None, end: datetime | None = None,
                      baseline: str = "k0") -> WeeklyReport:
        from . import cost

        rep = cost.weekly_report(self.store, end=None if end is None else end.timestamp(), host=host,
                                 baseline=baseline)
        return report_from_cost(rep)
