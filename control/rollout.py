"""Canary rollout of one config change across hosts, with automatic rollback.

``python -m control config rollout --hosts a,b,c --canary a --watch 600 --guard
'ttft_p99_ms <= 1.1 * baseline' --guard 'output_tokens_per_s >= 0.95 * baseline'
--k 4 --reason ...``:

1. ``canary``: the change is applied to the canary (a new config version, as
   ``python -m control config apply`` does). A failed apply ends the rollout
   (``failed``); nothing else is touched.
2. ``watch``: for ``watch_s`` seconds the canary runs the new config. Then its figures
   over the watch window (:data:`control.promsource.FIGURES`, from the metric source in
   force: the store or Prometheus) are compared with the baseline: the mean of the other
   hosts' figures over the same window (``baseline = others``), or the canary's own
   figures over the ``watch_s`` seconds before the change (``baseline = self``, the
   default when the canary is the only host). Every guard must hold; a guard without
   data on either side fails. A failed guard rolls the canary back to the version it
   had (a new version, ``source = rollback``): ``rolled_back``.
3. ``stages``: the other hosts get the change one by one, in the order given:
   ``succeeded``. A host whose apply fails stops the rollout there (``failed``; the
   hosts already changed keep the new config, the message says which).

The rollout is a row of the ``rollouts`` table, written at every step: each step
(``apply``, ``watch``, ``rollback``) with its outcome and the config version it made.
The process running it renews ``heartbeat_at`` every second. A rollout whose process
died (no heartbeat for ``STALE_S`` seconds) is taken over by :func:`resume` (``python
-m control config rollout --resume``): interrupted while applying to the canary, it
is rolled back; in its watch, the watch goes on to its planned end; in its stages, the
remaining hosts are changed. The returned message says which.

Guards use a small grammar, parsed without ``eval``::

    guard    := FIGURE OP bound
    bound    := NUMBER | "baseline" | NUMBER "*" "baseline" | "baseline" "*" NUMBER
    OP       := "<" | "<=" | ">" | ">="

where FIGURE is one of :data:`control.promsource.FIGURES` (``ttft_p99_ms`` ms,
``output_tokens_per_s`` tokens/s, ``acceptance_rate`` 0..1 ...).
"""

from __future__ import annotations

import logging
import operator
import re
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from sqlalchemy import select

from engine_host.config import LiveConfig

from .apply import apply_change, rollback
from .models import Rollout
from .promsource import FIGURES, host_window
from .store import ControlError, Store, current_user, get_host
from .versions import last_applied

log = logging.getLogger("specpilot.rollout")

RUNNING, SUCCEEDED, ROLLED_BACK, FAILED = "running", "succeeded", "rolled_back", "failed"
#: Seconds without a heartbeat after which a running rollout counts as abandoned.
STALE_S = 5.0
HEARTBEAT_S = 1.0
#: Seconds the figures are given to settle (the last scrapes written) before the watch is judged.
SETTLE_S = 2.0

_OPS = {"<": operator.lt, "<=": operator.le, ">": operator.gt, ">=": operator.ge}
_NUM = r"[0-9]+(?:\.[0-9]+)?"
_GUARD = re.compile(
    rf"^\s*(?P<fig>[a-z][a-z0-9_]*)\s*(?P<op><=|>=|<|>)\s*(?:"
    rf"(?P<f1>{_NUM})\s*\*\s*baseline|baseline\s*\*\s*(?P<f2>{_NUM})|(?P<b>baseline)|(?P<n>{_NUM}))\s*$"
)


class RolloutError(ControlError):
    """A rollout cannot start or go on (bad guard, host, change; message fit for a user)."""


@dataclass(frozen=True)
class Guard:
    """One parsed guard: ``figure op factor * baseline`` or ``figure op threshold``.

    Attributes:
        text: as written; figure: a :data:`FIGURES` name; op: ``<``, ``<=``, ``>``, ``>=``;
        factor: multiplies the baseline (None: absolute ``threshold``).
    """

    text: str
    figure: str
    op: str
    factor: float | None
    threshold: float | None

    def check(self, value: float | None, baseline: float | None) -> tuple[bool, str]:
        """``(holds, explanation)`` for the canary's ``value`` against ``baseline``."""
        bound = self.threshold if self.factor is None else (None if baseline is None else self.factor * baseline)
        if value is None or bound is None:
            return False, f"{self.text}: no data (canary {value}, baseline {baseline})"
        ok = _OPS[self.op](value, bound)
        return ok, f"{self.text}: {self.figure} = {value:.4g} {'holds' if ok else 'fails'} against {bound:.4g}"


def parse_guard(text: str) -> Guard:
    """Parse one guard (grammar in the module docstring).

    Raises:
        RolloutError: not a guard, or an unknown figure.
    """
    m = _GUARD.match(text or "")
    if not m:
        raise RolloutError(
            f"not a guard: {text!r}; write e.g. 'ttft_p99_ms <= 1.1 * baseline' or 'acceptance_rate >= 0.5'"
        )
    fig = m["fig"]
    if fig not in FIGURES:
        raise RolloutError(f"unknown figure {fig!r} in guard {text!r}; known: {', '.join(FIGURES)}")
    factor = float(m["f1"] or m["f2"]) if (m["f1"] or m["f2"]) else (1.0 if m["b"] else None)
    return Guard(text=text.strip(), figure=fig, op=m["op"], factor=factor, threshold=float(m["n"]) if m["n"] else None)


FiguresFn = Callable[[Store, str, float, int], dict[str, float | None]]


def _figures(store: Store, host: str, end: float, window_s: int) -> dict[str, float | None]:
    return host_window(store, host, end, window_s)


def _mean(rows: Sequence[dict[str, float | None]]) -> dict[str, float | None]:
    out: dict[str, float | None] = {}
    for f in FIGURES:
        vals = [v for r in rows if (v := r.get(f)) is not None]
        out[f] = sum(vals) / len(vals) if vals else None
    return out


def create(
    store: Store,
    *,
    hosts: Sequence[str],
    canary: str,
    patch: dict[str, Any],
    watch_s: float,
    guards: Sequence[str],
    reason: str,
    author: str | None = None,
    baseline: str | None = None,
) -> int:
    """Check and record a rollout (nothing is applied yet); returns its id.

    Args:
        hosts: host names, in the order the change reaches them; canary: one of them
        (moved first); patch: the change (``LiveConfig`` JSON subset); watch_s: s;
        guards: guard texts; baseline: ``others`` or ``self`` (default: ``others`` when
        there are other hosts).
    Raises:
        RolloutError: bad hosts, canary, guard, watch time or baseline; ValueError: empty
        reason; UnknownHost.
    """
    if not reason or not reason.strip():
        raise ValueError("a reason is required for every config change")
    hosts = [h.strip() for h in hosts if h.strip()]
    if not hosts or len(set(hosts)) != len(hosts):
        raise RolloutError(f"--hosts must name distinct hosts, got {hosts}")
    if canary not in hosts:
        raise RolloutError(f"the canary {canary!r} is not one of the hosts {hosts}")
    if not watch_s or watch_s < 1:
        raise RolloutError(f"the watch time must be at least 1 s, got {watch_s}")
    if not guards:
        raise RolloutError("at least one --guard is required (e.g. 'ttft_p99_ms <= 1.1 * baseline')")
    parsed = [parse_guard(g) for g in guards]
    for h in hosts:
        get_host(store, h)
    if not isinstance(patch, dict) or not patch:
        raise RolloutError("the change is empty")
    try:
        LiveConfig.model_validate(_merge(LiveConfig().model_dump(mode="json"), patch))
    except Exception as exc:
        raise RolloutError(f"invalid change: {exc}") from exc
    baseline = baseline or ("others" if len(hosts) > 1 else "self")
    if baseline not in ("others", "self") or (baseline == "others" and len(hosts) == 1):
        raise RolloutError(f"baseline must be 'others' (with other hosts) or 'self', got {baseline!r}")
    order = [canary] + [h for h in hosts if h != canary]
    now = time.time()
    with store.writer() as s:
        r = Rollout(
            created_at=now,
            updated_at=now,
            author=author or current_user(),
            reason=reason.strip(),
            patch=patch,
            hosts=order,
            canary=canary,
            watch_s=float(watch_s),
            guards=[g.text for g in parsed],
            baseline=baseline,
            phase="canary",
            status=RUNNING,
            steps=[],
        )
        s.add(r)
        s.flush()
        return r.id


def _merge(base: dict[str, Any], patch: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for k, v in patch.items():
        out[k] = _merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def get(store: Store, rollout_id: int) -> Rollout:
    """One rollout.

    Raises:
        RolloutError: no such rollout.
    """
    with store.reader() as s:
        r = s.get(Rollout, rollout_id)
        if r is None:
            raise RolloutError(f"no rollout {rollout_id}")
        return r


def list_rollouts(store: Store, limit: int = 50) -> list[Rollout]:
    """Rollouts, newest first."""
    with store.reader() as s:
        return list(s.scalars(select(Rollout).order_by(Rollout.id.desc()).limit(limit)))


class _Runner:
    """Runs one rollout in this process, writing every step."""

    def __init__(
        self, store: Store, rollout_id: int, figures: FiguresFn, interface: str, sleep: Callable[[float], None]
    ):
        self.store, self.id, self.figures, self.interface, self.sleep = store, rollout_id, figures, interface, sleep
        self.owner = uuid.uuid4().hex

    # ---------------------------------------------------------------- persistence

    def _update(self, **values: Any) -> Rollout:
        with self.store.writer() as s:
            r = s.get(Rollout, self.id, with_for_update=True)
            assert r is not None  # claimed by this runner
            for k, v in values.items():
                setattr(r, k, v)
            r.updated_at = r.heartbeat_at = time.time()
            s.flush()
            return r

    def _step(self, **step: Any) -> None:
        with self.store.writer() as s:
            r = s.get(Rollout, self.id, with_for_update=True)
            assert r is not None  # claimed by this runner
            r.steps = [*r.steps, {"at": time.time(), **step}]
            r.updated_at = r.heartbeat_at = time.time()

    def claim(self, stale_s: float) -> Rollout:
        """Take the rollout (new, or abandoned for ``stale_s`` s)."""
        now = time.time()
        with self.store.writer() as s:
            r = s.get(Rollout, self.id, with_for_update=True)
            if r is None:
                raise RolloutError(f"no rollout {self.id}")
            if r.status != RUNNING:
                raise RolloutError(f"rollout {self.id} is over ({r.status})")
            if r.owner and r.heartbeat_at and now - r.heartbeat_at < stale_s:
                raise RolloutError(
                    f"rollout {self.id} is being run by another process (heartbeat {now - r.heartbeat_at:.1f} s ago)"
                )
            r.owner, r.heartbeat_at = self.owner, now
            s.flush()
            return r

    def _beat_until(self, t_end: float) -> None:
        while True:
            left = t_end - time.time()
            if left <= 0:
                return
            self.sleep(min(HEARTBEAT_S, left))
            self._update()

    # ---------------------------------------------------------------- steps

    def _apply(self, r: Rollout, host: str) -> bool:
        res = apply_change(
            self.store,
            host,
            r.patch,
            reason=f"rollout {r.id}: {r.reason}",
            author=r.author,
            interface=self.interface,
            source="apply",
        )
        self._step(host=host, action="apply", version=res.version, outcome=res.status, message=res.message)
        log.info("rollout %s: %s version %s %s", r.id, host, res.version, res.status)
        return res.ok

    def _rollback_canary(self, r: Rollout, why: str) -> Rollout:
        base = r.canary_base_version
        if base is None:
            return self._update(phase="done", status=FAILED, message=f"{why}; the canary had no version to return to")
        res = rollback(
            self.store,
            r.canary,
            base,
            reason=f"rollout {r.id} rolled back: {why}",
            author=r.author,
            interface=self.interface,
        )
        self._step(
            host=r.canary,
            action="rollback",
            version=res.version,
            outcome=res.status,
            message=res.message,
            rollback_of=base,
        )
        status = ROLLED_BACK if res.ok else FAILED
        msg = f"{why}; canary {r.canary} rolled back to version {base} as version {res.version}"
        if not res.ok:
            msg += f" - the rollback failed too: {res.message}"
        return self._update(phase="done", status=status, message=msg)

    def run(self, r: Rollout) -> Rollout:
        if r.phase == "canary":
            base = last_applied(self.store, get_host(self.store, r.canary).id)
            baseline = None
            if r.baseline == "self":
                baseline = self.figures(self.store, r.canary, time.time(), int(r.watch_s))
            r = self._update(canary_base_version=base.version if base else None, baseline_figures=baseline)
            if not self._apply(r, r.canary):
                return self._update(
                    phase="done",
                    status=FAILED,
                    message=f"the change could not be applied to the canary {r.canary}; no host was changed",
                )
            r = self._update(phase="watch", watch_started_at=time.time())
        if r.phase == "watch":
            assert r.watch_started_at is not None  # set with phase "watch"
            self._beat_until(r.watch_started_at + r.watch_s + SETTLE_S)
            end = float(int(time.time() - SETTLE_S))
            window = max(1, int(min(r.watch_s, end - r.watch_started_at)))
            canary = self.figures(self.store, r.canary, end, window)
            if r.baseline == "others":
                baseline = _mean([self.figures(self.store, h, end, window) for h in r.hosts if h != r.canary])
            else:
                baseline = r.baseline_figures or {}
            checks = [
                parse_guard(g).check(canary.get(parse_guard(g).figure), baseline.get(parse_guard(g).figure))
                for g in r.guards
            ]
            ok = all(c[0] for c in checks)
            self._step(
                host=r.canary,
                action="watch",
                outcome="passed" if ok else "failed",
                window_s=window,
                guards=[c[1] for c in checks],
                canary={f: canary.get(f) for f in FIGURES},
                baseline={f: baseline.get(f) for f in FIGURES},
            )
            if not ok:
                failed = "; ".join(c[1] for c in checks if not c[0])
                return self._rollback_canary(r, f"guard failed ({failed})")
            r = self._update(phase="stages")
        if r.phase == "stages":
            done = {st["host"] for st in r.steps if st["action"] == "apply" and st["outcome"] == "applied"}
            for host in r.hosts:
                if host in done:
                    continue
                if not self._apply(r, host):
                    changed = [h for h in r.hosts if h in done]
                    return self._update(
                        phase="done",
                        status=FAILED,
                        message=f"the change could not be applied to {host}; stopped there "
                        f"(hosts with the new config: {', '.join(changed)})",
                    )
                done.add(host)
            return self._update(
                phase="done", status=SUCCEEDED, message=f"every host has the change: {', '.join(r.hosts)}"
            )
        return r


def run(
    store: Store,
    rollout_id: int,
    *,
    figures: FiguresFn = _figures,
    interface: str = "cli",
    sleep: Callable[[float], None] = time.sleep,
    stale_s: float = STALE_S,
) -> Rollout:
    """Run (or take over) a rollout to its end in this process.

    Returns:
        The rollout row at the end (``status``, ``message``, ``steps``).
    Raises:
        RolloutError: no such rollout, over already, or run by a live process;
        and what :func:`control.apply.apply_change` raises for a host (token missing...).
    """
    runner = _Runner(store, rollout_id, figures, interface, sleep)
    r = runner.claim(stale_s)
    return runner.run(r)


def resume(
    store: Store, *, figures: FiguresFn = _figures, interface: str = "cli", stale_s: float = STALE_S
) -> list[tuple[Rollout, str]]:
    """Take over every running rollout whose process died (no heartbeat for ``stale_s`` s)
    and bring it to its end.

    Returns:
        ``[(rollout at the end, what was done: "resumed ..." or "rolled back ...")]``.
    """
    now = time.time()
    with store.reader() as s:
        abandoned = list(s.scalars(select(Rollout).where(Rollout.status == RUNNING).order_by(Rollout.id)))
    out = []
    for r in abandoned:
        if r.heartbeat_at is not None and now - r.heartbeat_at < stale_s:
            continue
        runner = _Runner(store, r.id, figures, interface, time.sleep)
        try:
            r = runner.claim(stale_s)
        except RolloutError:
            continue
        if r.phase == "canary":
            applied = [st for st in r.steps if st["action"] == "apply"]
            if r.canary_base_version is not None and (applied or _canary_changed(store, r)):
                done = runner._rollback_canary(r, "the control process died while applying to the canary")
                out.append((done, f"rolled back rollout {r.id}: interrupted while applying to the canary"))
            else:
                done = runner._update(
                    phase="done",
                    status=FAILED,
                    message="the control process died before the canary was changed; no host was changed",
                )
                out.append((done, f"ended rollout {r.id}: interrupted before any change"))
            continue
        what = "resumed its watch of the canary" if r.phase == "watch" else "resumed applying to the other hosts"
        done = runner.run(r)
        out.append((done, f"{what} (rollout {r.id}): {done.status}"))
    return out


def _canary_changed(store: Store, r: Rollout) -> bool:
    v = last_applied(store, get_host(store, r.canary).id)
    return v is not None and v.version != r.canary_base_version
