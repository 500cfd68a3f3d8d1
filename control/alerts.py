"""Alert rules (data in the store) and their evaluation by the collector.

A rule fires on a host when ``<metric> <op> <threshold>`` has held for ``for_s``
seconds; the event starts when the condition began and ends when it stops holding. The
metric is a field of the 1 s sample (``acceptance_rate`` and latency percentiles are
over the collector's trailing window) or ``up`` (1 when the scrape worked, 0 when not).
A missing value (no drafts, no requests in the window) does not breach a rule.

The default rules come with the schema (migration 0001): ``low_acceptance``
(acceptance < 0.5 for 300 s), ``kv_cache_full`` (KV cache usage > 0.9),
``queue_time_p99`` (queue time P99 > 500 ms), ``host_down`` (up < 1 for 5 s); migration
0009 adds ``config_drift`` (``config_drift`` > 0: the engine's config differs from the
store's version in force, :mod:`control.drift`).

A supervisor that knows for certain that a host is down (``control up`` saw the engine
host's process exit) opens ``up`` rules at once with :meth:`AlertEvaluator.open_now`
instead of waiting their ``for_s``.
"""

from __future__ import annotations

import operator
import time
from dataclasses import dataclass
from typing import Any, Callable

from sqlalchemy import select

from .models import AlertEvent, AlertRule, Host
from .samples import SERIES_COLUMNS
from .store import ControlError, Store, active_host, audit, current_user

OPS: dict[str, Callable[[float, float], bool]] = {
    "<": operator.lt,
    "<=": operator.le,
    ">": operator.gt,
    ">=": operator.ge,
}
METRICS = ("up", "config_drift") + SERIES_COLUMNS


class UnknownRule(ControlError, LookupError):
    """No alert rule of that name."""


class BadRule(ControlError, ValueError):
    """An alert rule definition is invalid."""


def _check(metric: str, op: str, threshold: float, for_s: float) -> None:
    if metric not in METRICS or metric in (
        "mode",
        "accepted_per_pos",
        "draft_tokens_per_pos",
        "acceptance_per_position",
    ):
        raise BadRule(f"unknown metric {metric!r}; use one of: up, config_drift, {', '.join(SERIES_COLUMNS)}")
    if op not in OPS:
        raise BadRule(f"unknown comparison {op!r}; use one of {', '.join(OPS)}")
    if for_s < 0:
        raise BadRule("for_s must be >= 0 seconds")
    float(threshold)


def list_rules(store: Store, enabled_only: bool = False) -> list[AlertRule]:
    """Alert rules by name."""
    q = select(AlertRule).order_by(AlertRule.name)
    if enabled_only:
        q = q.where(AlertRule.enabled.is_(True))
    with store.reader() as s:
        return list(s.scalars(q))


def set_rule(
    store: Store,
    name: str,
    *,
    metric: str | None = None,
    op: str | None = None,
    threshold: float | None = None,
    for_s: float | None = None,
    severity: str | None = None,
    enabled: bool | None = None,
    host: str | None = None,
    description: str | None = None,
    actor: str | None = None,
    origin_: str = "api",
) -> AlertRule:
    """Create a rule or change fields of an existing one (only the arguments given).

    Args:
        metric: sample field or ``up``; op: ``<``, ``<=``, ``>``, ``>=``; threshold: in
        the metric's unit (ms, fraction 0..1, tokens/s ...); for_s: seconds the
        condition must hold; host: limit to one host (None: every host).
    Raises:
        BadRule: invalid definition, or a new rule without metric/op/threshold.
        UnknownHost: ``host`` not registered.
    """
    with store.writer() as s:
        rule = s.scalars(select(AlertRule).where(AlertRule.name == name)).first()
        if rule is None:
            if metric is None or op is None or threshold is None:
                raise BadRule(f"new rule {name!r} needs a metric, a comparison and a threshold")
            rule = AlertRule(
                name=name,
                metric=metric,
                op=op,
                threshold=threshold,
                for_s=for_s or 0.0,
                severity=severity or "warning",
                enabled=True if enabled is None else enabled,
            )
            s.add(rule)
        for attr, value in (
            ("metric", metric),
            ("op", op),
            ("threshold", threshold),
            ("for_s", for_s),
            ("severity", severity),
            ("enabled", enabled),
            ("description", description),
        ):
            if value is not None:
                setattr(rule, attr, value)
        if host is not None:
            rule.host_id = active_host(s, host).id if host else None
        _check(rule.metric, rule.op, rule.threshold, rule.for_s)
        audit(
            s,
            actor=actor or current_user(),
            origin=origin_,
            action="alert_rule.set",
            outcome="ok",
            message=f"rule {name}: {rule.metric} {rule.op} {rule.threshold:g} for {rule.for_s:g} s"
            f"{'' if rule.enabled else ' (disabled)'}",
        )
        s.flush()
        return rule


def events(
    store: Store, host: str | None = None, open_only: bool = False, since: float | None = None, limit: int = 500
) -> list[dict[str, Any]]:
    """Alert events, newest first: dicts with ``id, rule, severity, host, started_at,
    ended_at`` (unix s, None while open), ``value, peak, message``.

    Raises:
        UnknownHost: ``host`` given and not registered.
    """
    q = (
        select(AlertEvent, AlertRule.name, AlertRule.severity, Host.name)
        .join(AlertRule, AlertRule.id == AlertEvent.rule_id)
        .join(Host, Host.id == AlertEvent.host_id)
        .order_by(AlertEvent.started_at.desc())
        .limit(limit)
    )
    if open_only:
        q = q.where(AlertEvent.ended_at.is_(None))
    if since is not None:
        q = q.where((AlertEvent.ended_at.is_(None)) | (AlertEvent.ended_at >= since))
    with store.reader() as s:
        if host:
            q = q.where(AlertEvent.host_id == active_host(s, host).id)
        return [
            {
                "id": ev.id,
                "rule": rn,
                "severity": sev,
                "host": hn,
                "started_at": ev.started_at,
                "ended_at": ev.ended_at,
                "value": ev.value,
                "peak": ev.peak,
                "message": ev.message,
            }
            for ev, rn, sev, hn in s.execute(q)
        ]


@dataclass
class _State:
    since: float | None = None  # when the condition began (unix s)
    event_id: int | None = None
    peak: float | None = None


class AlertEvaluator:
    """Evaluates the enabled rules on each sample of each host and writes events.

    Rules are re-read from the store every ``reload_s`` seconds, so edits take effect
    while the daemon runs. Open events found in the store at start-up are continued
    (closed when their condition no longer holds).
    """

    def __init__(self, store: Store, reload_s: float = 5.0):
        self.store = store
        self.reload_s = reload_s
        self._rules: list[AlertRule] = []
        self._loaded_at = 0.0
        self._state: dict[tuple[int, int], _State] = {}
        with store.reader() as s:
            for ev in s.scalars(select(AlertEvent).where(AlertEvent.ended_at.is_(None))):
                self._state[(ev.rule_id, ev.host_id)] = _State(since=ev.started_at, event_id=ev.id, peak=ev.peak)

    def _rules_now(self) -> list[AlertRule]:
        if time.monotonic() - self._loaded_at > self.reload_s:
            self._rules = list_rules(self.store, enabled_only=True)
            self._loaded_at = time.monotonic()
        return self._rules

    def evaluate(self, host_id: int, t: float, values: dict[str, Any]) -> list[str]:
        """Evaluate every rule for one host at ``t`` (unix s).

        Args:
            values: the sample's fields plus ``up`` (1 or 0); a down host passes ``{"up": 0}``.
        Returns:
            Messages of the events opened or closed (for the daemon's log).
        """
        changes = []
        active_rules = set()
        for rule in self._rules_now():
            if rule.host_id is not None and rule.host_id != host_id:
                continue
            active_rules.add(rule.id)
            value = values.get(rule.metric)
            breach = value is not None and OPS[rule.op](float(value), rule.threshold)
            st = self._state.setdefault((rule.id, host_id), _State())
            if breach and value is not None:  # a breach has a value
                if st.since is None:
                    st.since = t
                worse = max if rule.op in (">", ">=") else min
                st.peak = float(value) if st.peak is None else worse(st.peak, float(value))
                if st.event_id is None and t - st.since >= rule.for_s:
                    msg = f"{rule.name}: {rule.metric} = {float(value):.4g} {rule.op} {rule.threshold:g}" + (
                        f" for {rule.for_s:g} s" if rule.for_s else ""
                    )
                    with self.store.writer() as s:
                        ev = AlertEvent(
                            rule_id=rule.id,
                            host_id=host_id,
                            started_at=st.since,
                            value=float(value),
                            peak=st.peak,
                            message=msg,
                        )
                        s.add(ev)
                        s.flush()
                        st.event_id = ev.id
                    changes.append(f"opened {msg}")
            elif st.since is not None or st.event_id is not None:
                changes += self._close(rule.name, st, t)
        for (rule_id, hid), st in list(self._state.items()):  # rules disabled or deleted meanwhile
            if hid == host_id and rule_id not in active_rules and st.event_id is not None:
                changes += self._close(f"rule {rule_id}", st, t)
        return changes

    def open_now(self, host_id: int, t: float, metric: str, value: float, why: str) -> list[str]:
        """Open every enabled rule on ``metric`` that ``value`` breaches for one host at
        once (without waiting its ``for_s``), because the condition is known for certain
        (e.g. ``up = 0``: the engine host's process exited). Rules already open stay as
        they are; the next :meth:`evaluate` continues or closes them as usual.

        Args:
            t: when the condition began (unix s); why: added to the event's message.
        Returns:
            Messages of the events opened.
        """
        opened = []
        for rule in self._rules_now():
            if rule.metric != metric or (rule.host_id is not None and rule.host_id != host_id):
                continue
            if not OPS[rule.op](float(value), rule.threshold):
                continue
            st = self._state.setdefault((rule.id, host_id), _State())
            if st.event_id is not None:
                continue
            st.since = t if st.since is None else min(st.since, t)
            st.peak = float(value)
            msg = f"{rule.name}: {rule.metric} = {float(value):.4g} {rule.op} {rule.threshold:g} ({why})"
            with self.store.writer() as s:
                ev = AlertEvent(
                    rule_id=rule.id, host_id=host_id, started_at=st.since, value=float(value), peak=st.peak, message=msg
                )
                s.add(ev)
                s.flush()
                st.event_id = ev.id
            opened.append(f"opened {msg}")
        return opened

    def _close(self, name: str, st: _State, t: float) -> list[str]:
        out = []
        if st.event_id is not None:
            with self.store.writer() as s:
                ev = s.get(AlertEvent, st.event_id)
                if ev is not None and ev.ended_at is None:
                    ev.ended_at, ev.peak = t, st.peak
            out.append(f"closed {name}")
        st.since = st.event_id = st.peak = None
        return out
