"""The collector daemon: scrapes every registered engine host's ``/metrics``, stores
samples, evaluates alert rules, records gaps, notices engine restarts.

One thread per host scrapes at wall-clock-aligned ticks (every ``interval_s``, 1 s by
default), so a slow or dead host never delays the others. Per tick and host:

* scrape ``/metrics`` (no retry: the next tick is the retry) and parse it with
  prometheus-client's parser (only the families the samples need);
* on failure: open a collection gap (from the last good scrape) once, evaluate the
  rules with ``up = 0``; the daemon keeps running;
* on success: close an open gap; when the engine's start time differs from the one
  last seen, run :func:`control.apply.reconcile` (first contact: import its config;
  restart: re-apply the last applied version); read ``/control/state`` and compare it
  with the store (:func:`control.drift.check`: a mismatch is recorded as config drift
  and raises the ``config_drift`` alert); build and store the 1 s sample
  (:class:`control.sampling.SampleBuilder`); evaluate the rules;
* when the collector starts (after a crash, a stop, a machine reboot), the span since
  the host's last stored sample is recorded as a gap (``the collector was not
  running``), so that views show it as a gap, not as zeros or an interpolation;
* every ``warmup_sync_s``: copy new warm-up/heartbeat runs into the store.

The main thread follows the host list (hosts added or removed while it runs) and
downsamples every ``maintenance_s`` seconds. Every write is one transaction, so a
daemon killed mid-write leaves the database consistent.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Callable

from sqlalchemy import func, select

from .alerts import AlertEvaluator
from .apply import reconcile
from .client import EngineClient, EngineError, TokenMissing
from .drift import check as check_drift
from .drift import open_drift
from .metrics_parse import parse_metrics
from .models import CollectionGap, Host, MetricSample
from .samples import Retention, close_gap, downsample, insert_samples, open_gap
from .sampling import ENGINE_START, FAMILIES, SampleBuilder
from .store import Store, get_host, list_hosts
from .warmup import sync_runs

log = logging.getLogger("specpilot.collector")

COLLECTOR_DOWN = "no collection: the collector was not running"
COLLECTOR_STALLED = "no collection: the collector was stalled"


def last_covered(store: Store, host_id: int) -> float | None:
    """The end (unix s) of what the store covers for a host: its newest sample's
    interval end (any resolution) or the end of its newest gap; None when it has neither."""
    with store.reader() as s:
        sample_end = s.scalar(
            select(func.max(MetricSample.t + MetricSample.resolution_s)).where(MetricSample.host_id == host_id)
        )
        gap_end = s.scalar(select(func.max(CollectionGap.ended_at)).where(CollectionGap.host_id == host_id))
    ends = [float(x) for x in (sample_end, gap_end) if x is not None]
    return max(ends) if ends else None


def record_closed_gap(store: Store, host_id: int, started_at: float, ended_at: float, reason: str) -> int:
    """Record a gap that is over already (e.g. while the collector was not running); returns its id."""
    with store.writer() as s:
        gap = CollectionGap(host_id=host_id, started_at=started_at, ended_at=ended_at, reason=reason)
        s.add(gap)
        s.flush()
        return gap.id


class HostCollector:
    """Scrapes one host; :meth:`tick` is one scrape cycle (used by the thread and by tests).

    Args:
        store: the store; host: the host row; evaluator: shared alert evaluator;
        window_s: trailing window (s) of percentiles and acceptance;
        timeout_s: scrape timeout (s); interval_s: scrape interval (s): a span of more
        than two intervals without samples before the first scrape is a gap.
    """

    def __init__(
        self,
        store: Store,
        host: Host,
        evaluator: AlertEvaluator,
        window_s: float = 10.0,
        timeout_s: float = 2.0,
        warmup_sync_s: float = 15.0,
        eval_lock: threading.Lock | None = None,
        interval_s: float = 1.0,
    ):
        self.store = store
        self.host = host
        self.evaluator = evaluator
        self.builder = SampleBuilder(window_s)
        self.client = EngineClient.for_host(host, need_token=False, timeout_s=timeout_s, retries=0)
        self.up: bool | None = None
        self.last_ok: float | None = None
        self.known_start = host.engine_started_at
        self.warmup_sync_s = warmup_sync_s
        self._last_warmup_sync = 0.0
        self._eval_lock = eval_lock or threading.Lock()
        self._token_warned = False
        self.samples_written = 0
        self.interval_s = interval_s
        # where the store's coverage ends: a gap from there if the first scrape comes later
        self.covered_until = last_covered(store, host.id)
        self.last_ok = self.covered_until
        self.drift_open = open_drift(store, host.name) is not None
        self._ctl: EngineClient | None = None
        self._ctl_retry_at = 0.0

    def close(self) -> None:
        self.client.close()
        if self._ctl is not None:
            self._ctl.close()

    def _drift_value(self) -> int:
        return 1 if self.drift_open else 0

    def _evaluate(self, t: float, values: dict) -> None:
        with self._eval_lock:
            for msg in self.evaluator.evaluate(self.host.id, t, values):
                log.warning("host %s: alert %s", self.host.name, msg)

    def _down(self, t: float, reason: str) -> None:
        if self.up is not False:
            open_gap(self.store, self.host.id, self.last_ok if self.last_ok is not None else t, reason)
            log.warning("host %s: down (%s); recording a gap", self.host.name, reason)
        self.up = False
        self.builder.reset()
        self._evaluate(t, {"up": 0, "config_drift": self._drift_value()})

    def _reconcile(self, start: float) -> None:
        try:
            with self._control_client() as client:
                res = reconcile(self.store, self.host.name, client=client, interface="collector")
        except TokenMissing as exc:
            if not self._token_warned:
                log.warning("host %s: %s; restarts cannot be handled", self.host.name, exc)
                self._token_warned = True
            return
        except EngineError as exc:
            log.warning("host %s: cannot read its state yet (%s); will retry", self.host.name, exc)
            return
        self.known_start = start
        self.host = get_host(self.store, self.host.name)  # identity as just recorded
        if res.imported:
            log.info("host %s: first contact, imported its config as version %s", self.host.name, res.imported)
        for note in res.notes:
            log.warning("host %s: %s", self.host.name, note)
        if res.reapplied:
            log.warning(
                "host %s: re-applied as version %s: %s", self.host.name, res.reapplied.version, res.reapplied.status
            )

    def _control_client(self) -> EngineClient:
        return EngineClient.for_host(self.host, timeout_s=5.0)

    def _check_drift(self, t: float) -> None:
        """Read ``/control/state`` and compare it with the store (no token: skipped)."""
        if self._ctl is None:
            if time.monotonic() < self._ctl_retry_at:
                return
            try:
                self._ctl = EngineClient.for_host(self.host, timeout_s=5.0, retries=0)
            except TokenMissing:
                self._ctl_retry_at = time.monotonic() + 30.0
                return
        try:
            state = self._ctl.state()
        except EngineError as exc:
            log.debug("host %s: no state for the drift check (%s)", self.host.name, exc)
            return
        was = self.drift_open
        drift = check_drift(self.store, self.host.name, state, now=t)
        self.drift_open = drift is not None
        if drift is not None and not was:
            log.warning(
                "host %s: config drift: store version %s, engine config version %s (python -m control "
                "config drift --host %s)",
                self.host.name,
                drift.store_version,
                drift.engine_version,
                self.host.name,
            )
        elif was and not self.drift_open:
            log.warning("host %s: config drift over", self.host.name)

    def tick(self, t: float) -> dict | None:
        """One scrape at ``t`` (unix s). Returns the stored sample row (None when none)."""
        try:
            text = self.client.metrics_text()
            snap = parse_metrics(text, FAMILIES)
        except (EngineError, ValueError) as exc:
            self._down(t, str(exc))
            return None
        if self.up is not True:
            if close_gap(self.store, self.host.id, t):
                log.warning("host %s: back; gap closed", self.host.name)
            elif self.up is None and self.covered_until is not None and t - self.covered_until > 2 * self.interval_s:
                record_closed_gap(self.store, self.host.id, self.covered_until, t, COLLECTOR_DOWN)
                log.warning(
                    "host %s: nothing collected for %.0f s before this start; recorded as a gap",
                    self.host.name,
                    t - self.covered_until,
                )
        elif self.last_ok is not None and t - self.last_ok > 3 * self.interval_s:
            # this process did not scrape for a while (stopped, suspended, starved)
            record_closed_gap(self.store, self.host.id, self.last_ok + self.interval_s, t, COLLECTOR_STALLED)
            log.warning("host %s: no scrape for %.0f s; recorded as a gap", self.host.name, t - self.last_ok)
        self.up, self.last_ok = True, t
        start = snap.value(ENGINE_START)
        if start is not None and (self.known_start is None or abs(start - self.known_start) > 1e-3):
            self._reconcile(start)
        if start is None or (self.known_start is not None and abs(start - self.known_start) <= 1e-3):
            self._check_drift(t)  # not before a restart is reconciled (its re-apply is not drift)
        row = self.builder.feed(snap, t)
        if row is not None:
            insert_samples(self.store, self.host.id, [row])
            self.samples_written += 1
        self._evaluate(t, {**(row or {}), "up": 1, "config_drift": self._drift_value()})
        if self.warmup_sync_s and time.monotonic() - self._last_warmup_sync > self.warmup_sync_s:
            self._last_warmup_sync = time.monotonic()
            try:
                with self._control_client() as c:
                    sync_runs(self.store, self.host, c)
            except (EngineError, TokenMissing):
                pass
        return row


def _sleep_until_tick(stop: threading.Event, interval_s: float) -> float | None:
    now = time.time()
    nxt = (int(now / interval_s) + 1) * interval_s
    if stop.wait(nxt - now):
        return None
    return nxt


class Collector:
    """The daemon: a scraping thread per host, host-list following and downsampling.

    Args:
        store: the store; interval_s: scrape interval (s); window_s: trailing window
        (s) of percentiles and acceptance; maintenance_s: seconds between downsampling
        runs; hosts_refresh_s: seconds between reads of the host list.
    """

    def __init__(
        self,
        store: Store,
        interval_s: float = 1.0,
        window_s: float = 10.0,
        maintenance_s: float = 60.0,
        hosts_refresh_s: float = 5.0,
        retention: Retention = Retention(),
        on_tick: Callable[[str, dict | None], None] | None = None,
    ):
        if interval_s < 1.0:
            raise ValueError(
                f"the scrape interval must be at least 1 s (samples are stored per second), got {interval_s}"
            )
        self.store = store
        self.interval_s = interval_s
        self.window_s = window_s
        self.maintenance_s = maintenance_s
        self.hosts_refresh_s = hosts_refresh_s
        self.retention = retention
        self.on_tick = on_tick
        self.evaluator = AlertEvaluator(store)
        self._eval_lock = threading.Lock()
        self._stop = threading.Event()
        self._threads: dict[str, tuple[threading.Thread, threading.Event, tuple]] = {}
        self._main: threading.Thread | None = None

    # ------------------------------------------------------------------ per host

    def _host_loop(self, host: Host, stop: threading.Event) -> None:
        hc = HostCollector(
            self.store, host, self.evaluator, self.window_s, eval_lock=self._eval_lock, interval_s=self.interval_s
        )
        try:
            while not stop.is_set():
                t = _sleep_until_tick(stop, self.interval_s)
                if t is None:
                    break
                try:
                    row = hc.tick(t)
                    if self.on_tick:
                        self.on_tick(host.name, row)
                except Exception:  # the daemon outlives any one bad tick
                    log.exception("host %s: tick failed", host.name)
        finally:
            hc.close()

    def _sync_hosts(self) -> None:
        hosts = {h.name: h for h in list_hosts(self.store)}
        for name, (thread, stop, key) in list(self._threads.items()):
            h = hosts.get(name)
            if h is None or (h.url, h.token_env, h.id) != key or not thread.is_alive():
                stop.set()
                thread.join(timeout=5)
                del self._threads[name]
                if h is None:
                    log.info("host %s: removed; no longer collected", name)
        for name, h in hosts.items():
            if name not in self._threads:
                stop = threading.Event()
                thread = threading.Thread(target=self._host_loop, args=(h, stop), name=f"collect-{name}", daemon=True)
                self._threads[name] = (thread, stop, (h.url, h.token_env, h.id))
                thread.start()
                log.info("host %s: collecting %s/metrics every %g s", name, h.url, self.interval_s)

    # ------------------------------------------------------------------ main loop

    def run(self) -> None:
        """Run until :meth:`stop` (or KeyboardInterrupt)."""
        next_maint = 0.0
        next_hosts = 0.0
        try:
            while not self._stop.is_set():
                now = time.monotonic()
                if now >= next_hosts:
                    try:
                        self._sync_hosts()
                    except Exception:
                        log.exception("reading the host list failed")
                    next_hosts = now + self.hosts_refresh_s
                if now >= next_maint:
                    try:
                        stats = downsample(self.store, retention=self.retention)
                        log.debug("downsampled: %s", stats)
                    except Exception:
                        log.exception("downsampling failed")
                    next_maint = now + self.maintenance_s
                self._stop.wait(min(next_hosts, next_maint) - time.monotonic())
        finally:
            for _thread, stop, _ in self._threads.values():
                stop.set()
            for thread, _, _ in self._threads.values():
                thread.join(timeout=10)
            self._threads.clear()

    def mark_down(self, host_name: str, t: float, why: str) -> list[str]:
        """Record at once that a host is down for certain (its supervised process exited
        at ``t``, unix s): open its gap and its ``up`` alerts without waiting for the
        rules' ``for_s``. The host's scraping thread goes on (and closes both when it is back).

        Returns:
            Messages of the alerts opened.
        Raises:
            UnknownHost.
        """
        host = get_host(self.store, host_name)
        open_gap(self.store, host.id, t, why)
        with self._eval_lock:
            opened = self.evaluator.open_now(host.id, t, "up", 0, why)
        for msg in opened:
            log.warning("host %s: alert %s", host_name, msg)
        return opened

    def start(self) -> "Collector":
        """Run in a background thread (see :meth:`stop`)."""
        self._main = threading.Thread(target=self.run, name="collector", daemon=True)
        self._main.start()
        return self

    def stop(self, timeout_s: float = 15.0) -> None:
        """Stop all threads (waits up to ``timeout_s`` s)."""
        self._stop.set()
        if self._main is not None:
            self._main.join(timeout=timeout_s)
