"""The cost model and the weekly cost report.

Inputs per host: its price (USD/hour, ``hosts add --usd-per-hour``) and the stored
samples. Definitions:

* **uptime** (h): seconds covered by samples (the host was up and scraped); gaps are
  not charged;
* **busy** (h): seconds with requests running or tokens generated; **utilisation** =
  busy / uptime (fraction 0..1);
* **output tokens**: tokens generated for users (``specpilot:user_generation_tokens``,
  warm-up and heartbeat requests left out; vLLM's own count when the engine does not
  report it);
* **cost** (USD) = USD/hour x uptime; **USD per million output tokens** = cost /
  (tokens / 1e6);
* **busy throughput** (tokens/s) = output tokens / busy seconds: what the host
  delivers while it has work;
* **saving against a baseline**: the busy throughput measured while the baseline was in
  force, ``k0`` (samples at K = 0, no speculation) or ``version:N`` (the time version
  N of that host was in force), over the report's week and the 30 days before it. The
  tokens served would have needed ``tokens / baseline throughput`` busy seconds;
  ``saving_usd`` = (those seconds - the busy seconds used) x USD/hour / 3600, and
  ``saving_fraction`` = 1 - baseline throughput / busy throughput, and
  ``baseline_usd_per_million_tokens`` = (cost + saving_usd) / million tokens: what the same
  tokens would have cost over the same uptime (idle time included, as in
  ``usd_per_million_tokens``, so the two compare directly). All three compare
  throughputs measured at whatever load each period had; the report says how many
  busy seconds each figure rests on.

Days are UTC days. Samples come from the 60 s roll-ups, and the 3600 s ones where the
60 s ones are no longer kept (beyond 30 days).
"""

from __future__ import annotations

import csv
import io
import time
from dataclasses import asdict, dataclass, field
from datetime import datetime, timedelta, timezone
from typing import Any, TextIO

from sqlalchemy import select

from .models import ConfigVersion, Host
from .samples import Retention, rows_for_hosts
from .store import ControlError, Store, active_host, list_hosts
from .versions import APPLIED

DAY_S = 86400.0
WEEK_S = 7 * DAY_S
BASELINE_LOOKBACK_S = 30 * DAY_S
MIN_BASELINE_BUSY_S = 60.0
_COLUMNS = ("covered_s", "busy_s", "output_tokens", "user_output_tokens", "k", "draft_tokens", "accepted_tokens")


class BadBaseline(ControlError, ValueError):
    """A baseline other than ``k0`` or ``version:N``."""


@dataclass
class Totals:
    """Cost figures over a span (see the module docstring for definitions)."""

    uptime_h: float = 0.0
    busy_h: float = 0.0
    output_tokens: float = 0.0
    usd: float = 0.0
    draft_tokens: float = 0.0
    accepted_tokens: float = 0.0
    k_seconds: float = 0.0
    k_covered_s: float = 0.0

    def add(self, row: dict[str, Any], usd_per_hour: float) -> None:
        covered = row.get("covered_s") or 0.0
        self.uptime_h += covered / 3600.0
        self.busy_h += (row.get("busy_s") or 0.0) / 3600.0
        user = row.get("user_output_tokens")
        self.output_tokens += user if user is not None else (row.get("output_tokens") or 0.0)
        self.usd += usd_per_hour * covered / 3600.0
        self.draft_tokens += row.get("draft_tokens") or 0.0
        self.accepted_tokens += row.get("accepted_tokens") or 0.0
        if row.get("k") is not None:
            self.k_seconds += row["k"] * covered
            self.k_covered_s += covered

    def merge(self, other: "Totals") -> None:
        for f in self.__dataclass_fields__:
            setattr(self, f, getattr(self, f) + getattr(other, f))

    def figures(self) -> dict[str, Any]:
        """``uptime_h, busy_h, utilisation (0..1), output_tokens, usd,
        usd_per_million_tokens, busy_tokens_per_s, acceptance_rate (0..1), mean_k``."""
        return {
            "uptime_h": round(self.uptime_h, 4),
            "busy_h": round(self.busy_h, 4),
            "utilisation": round(self.busy_h / self.uptime_h, 4) if self.uptime_h > 0 else None,
            "output_tokens": int(round(self.output_tokens)),
            "usd": round(self.usd, 4),
            "usd_per_million_tokens": round(self.usd / (self.output_tokens / 1e6), 4)
            if self.output_tokens > 0
            else None,
            "busy_tokens_per_s": round(self.output_tokens / (self.busy_h * 3600.0), 3) if self.busy_h > 0 else None,
            "acceptance_rate": round(self.accepted_tokens / self.draft_tokens, 4) if self.draft_tokens > 0 else None,
            "mean_k": round(self.k_seconds / self.k_covered_s, 3) if self.k_covered_s > 0 else None,
        }


@dataclass
class WeeklyReport:
    """The weekly cost report (data for the dashboard; :meth:`to_csv` for export).

    Attributes:
        start, end: the period (unix s, UTC). baseline: ``k0`` or ``version:N``.
        hosts: per host: name, gpu_kind, usd_per_hour, :meth:`Totals.figures`, and
            baseline_tokens_per_s, baseline_busy_s, baseline_usd_per_million_tokens,
            saving_usd, saving_fraction, baseline_note.
        days: per UTC day and host: day (``YYYY-MM-DD``), host, the figures.
        fleet: the figures over all hosts, plus saving_usd (sum of the known savings).
        fleet_days: per UTC day over all hosts.
    """

    start: float
    end: float
    baseline: str
    hosts: list[dict[str, Any]] = field(default_factory=list)
    days: list[dict[str, Any]] = field(default_factory=list)
    fleet: dict[str, Any] = field(default_factory=dict)
    fleet_days: list[dict[str, Any]] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def to_csv(self, out: TextIO | None = None) -> str:
        """Write one table (``scope`` = day, week or fleet-week) as CSV; returns the text."""
        buf = out or io.StringIO()
        cols = [
            "scope",
            "period",
            "host",
            "uptime_h",
            "busy_h",
            "utilisation",
            "output_tokens",
            "usd",
            "usd_per_million_tokens",
            "busy_tokens_per_s",
            "acceptance_rate",
            "mean_k",
            "baseline_tokens_per_s",
            "saving_usd",
            "saving_fraction",
        ]
        w = csv.DictWriter(buf, fieldnames=cols, extrasaction="ignore", lineterminator="\n")
        w.writeheader()
        period = f"{_day(self.start)}..{_day(self.end - 1)}"
        for d in self.days:
            w.writerow({"scope": "day", "period": d["day"], **d})
        for d in self.fleet_days:
            w.writerow({"scope": "day", "period": d["day"], "host": "(fleet)", **d})
        for h in self.hosts:
            w.writerow({"scope": "week", "period": period, "host": h["host"], **h})
        w.writerow({"scope": "week", "period": period, "host": "(fleet)", **self.fleet})
        if out is None:
            assert isinstance(buf, io.StringIO)
            return buf.getvalue()
        return ""


def _day(t: float) -> str:
    return datetime.fromtimestamp(t, tz=timezone.utc).strftime("%Y-%m-%d")


def _rows(store: Store, host_ids: list[int], start: float, end: float) -> list[dict[str, Any]]:
    """Sample rows over ``[start, end)``: 60 s roll-ups where they are kept, 3600 s before."""
    cutoff = int((time.time() - Retention().minute_s) // 3600 + 1) * 3600
    rows = []
    if start < cutoff:
        rows += rows_for_hosts(store, host_ids, start, min(end, cutoff), 3600, _COLUMNS)
    if end > cutoff:
        rows += rows_for_hosts(store, host_ids, max(start, cutoff), end, 60, _COLUMNS)
    return rows


def _baseline_windows(store: Store, host_id: int, version: int) -> list[tuple[float, float]]:
    """The spans (unix s) during which version ``version`` was the applied config."""
    with store.reader() as s:
        applied = list(
            s.execute(
                select(ConfigVersion.version, ConfigVersion.finished_at)
                .where(ConfigVersion.host_id == host_id, ConfigVersion.status == APPLIED)
                .order_by(ConfigVersion.version)
            )
        )
    spans: list[tuple[float, float]] = []
    for i, (v, at) in enumerate(applied):
        if v == version:
            until = applied[i + 1][1] if i + 1 < len(applied) else time.time()
            assert at is not None and until is not None  # an applied version has finished_at
            spans.append((at, until))
    return spans


def check_baseline(baseline: str) -> None:
    """Raises BadBaseline unless ``baseline`` is ``k0`` or ``version:N``."""
    if baseline != "k0" and not (baseline.startswith("version:") and baseline[8:].isdigit()):
        raise BadBaseline(f"unknown baseline {baseline!r}: use 'k0' (no speculation) or 'version:N'")


def baseline_throughput(
    store: Store, host: Host, baseline: str, start: float, end: float
) -> tuple[float | None, float, str]:
    """Busy throughput (tokens/s) measured under ``baseline`` between ``start`` and ``end``.

    Returns:
        ``(tokens/s or None, busy seconds it rests on, note)``.
    Raises:
        BadBaseline: not ``k0`` or ``version:N``.
    """
    check_baseline(baseline)
    if baseline == "k0":
        rows = [r for r in _rows(store, [host.id], start, end) if r.get("k") is not None and r["k"] == 0]
        label = "samples at K = 0"
    else:
        version = int(baseline[8:])
        spans = _baseline_windows(store, host.id, version)
        rows = []
        for a, b in spans:
            rows += _rows(store, [host.id], max(a, start), min(b, end))
        label = f"samples while version {version} was in force"
        if not spans:
            return None, 0.0, f"version {version} of {host.name} was never applied"
    t = Totals()
    for r in rows:
        t.add(r, 0.0)
    busy_s = t.busy_h * 3600.0
    if busy_s < MIN_BASELINE_BUSY_S or t.output_tokens <= 0:
        return None, busy_s, f"not enough {label} ({busy_s:.0f} busy s; need {MIN_BASELINE_BUSY_S:.0f})"
    return t.output_tokens / busy_s, busy_s, f"{label}: {busy_s:.0f} busy s"


def weekly_report(
    store: Store, end: float | None = None, host: str | None = None, baseline: str = "k0"
) -> WeeklyReport:
    """The cost report for the 7 days before ``end`` (unix s, default now).

    Args:
        host: one host (None: the whole fleet); baseline: ``k0`` or ``version:N``.
    Raises:
        UnknownHost; BadBaseline.
    """
    now = time.time()
    end = now if end is None else end
    start = end - WEEK_S
    if host:
        with store.reader() as s:
            hosts = [active_host(s, host)]
    else:
        hosts = list_hosts(store)
    check_baseline(baseline)
    rep = WeeklyReport(start=start, end=end, baseline=baseline)
    rows = _rows(store, [h.id for h in hosts], start, end)
    per_host: dict[int, Totals] = {h.id: Totals() for h in hosts}
    per_day: dict[tuple[str, int], Totals] = {}
    fleet_day: dict[str, Totals] = {}
    by_id = {h.id: h for h in hosts}
    for r in rows:
        h = by_id[r["host_id"]]
        per_host[h.id].add(r, h.usd_per_hour)
        day = _day(r["t"])
        per_day.setdefault((day, h.id), Totals()).add(r, h.usd_per_hour)
        fleet_day.setdefault(day, Totals()).add(r, h.usd_per_hour)
    fleet = Totals()
    saving_total = 0.0
    for h in hosts:
        tot = per_host[h.id]
        fleet.merge(tot)
        fig = tot.figures()
        base_tps, base_busy, note = baseline_throughput(store, h, baseline, start - BASELINE_LOOKBACK_S, end)
        saving_usd = saving_fraction = base_usd_m = None
        if base_tps and fig["busy_tokens_per_s"]:
            needed_s = tot.output_tokens / base_tps
            saving_usd = round((needed_s - tot.busy_h * 3600.0) * h.usd_per_hour / 3600.0, 4)
            saving_fraction = round(1.0 - base_tps / fig["busy_tokens_per_s"], 4)
            saving_total += saving_usd
        if saving_usd is not None and tot.output_tokens > 0:
            # the same tokens and uptime, with the busy time the baseline would have needed:
            # comparable with usd_per_million_tokens (idle time is paid in both)
            base_usd_m = round((tot.usd + saving_usd) / (tot.output_tokens / 1e6), 4)
        rep.hosts.append(
            {
                "host": h.name,
                "gpu_kind": h.gpu_kind,
                "usd_per_hour": h.usd_per_hour,
                **fig,
                "baseline_tokens_per_s": None if base_tps is None else round(base_tps, 3),
                "baseline_busy_s": round(base_busy, 1),
                "baseline_usd_per_million_tokens": base_usd_m,
                "saving_usd": saving_usd,
                "saving_fraction": saving_fraction,
                "baseline_note": note,
            }
        )
    for (day, hid), tot in sorted(per_day.items(), key=lambda kv: (kv[0][0], by_id[kv[0][1]].name)):
        rep.days.append({"day": day, "host": by_id[hid].name, **tot.figures()})
    rep.fleet_days = [{"day": d, **t.figures()} for d, t in sorted(fleet_day.items())]
    rep.fleet = {**fleet.figures(), "saving_usd": round(saving_total, 4)}
    return rep


def week_ending(date_text: str) -> float:
    """Unix s of the end of UTC day ``YYYY-MM-DD`` (the report then covers that day and
    the six before it).

    Raises:
        ValueError: not a date.
    """
    d = datetime.strptime(date_text, "%Y-%m-%d").replace(tzinfo=timezone.utc)
    return (d + timedelta(days=1)).timestamp()
