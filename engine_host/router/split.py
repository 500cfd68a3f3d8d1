"""The traffic split between a plain engine and a speculative engine (pure logic, no HTTP).

Why two engines: in vLLM 0.26 an engine with an n-gram speculative config runs the V1
model runner with synchronous scheduling, and at K = 0 it decodes far slower than a plain
engine on a GPU (figures in docs/gpu.md). No K chosen *inside* that engine can recover plain
decoding's speed, so "speculation steps aside" has to mean: the request goes to an engine
that has no speculative config at all.

The split: each new request goes to the speculative engine with probability ``p`` and
to the plain engine otherwise. ``p`` follows the time per output token (TPOT) that each
engine's own vLLM reports (``vllm:request_time_per_output_token_seconds``, windowed over
the requests finished since the last poll): after each poll where both are fresh,

    p <- clip(p * (TPOT_plain / TPOT_spec) ** eta, p_min, p_max)

so traffic moves towards the engine that currently gives a request more tokens per
second, until both give the same (a Wardrop equilibrium of the two "routes"; under load
a request's TPOT grows with its engine's batch, which is what stops the flow). On
predictable traffic the speculative engine's adaptive K makes its TPOT the lower one and
``p`` rises to ``p_max``; on open-ended traffic or under load ``p`` falls to ``p_min``.

Resting and probes: while ``p`` rests at ``p_min`` the speculative engine gets *no*
requests, except during a probe of ``probe_s`` seconds every ``probe_every_s`` seconds,
when it gets the share ``p_probe``. A constant trickle would keep it stepping most of the
time under load, and its steps take GPU time slices and host cores from the plain engine
(docs/gpu.md, "what the speculative engine's floor costs"). Probes bunch the same few
requests into one short burst, so the engine is busy a small part of the time and its TPOT
is still measured (a probe's requests refresh it, and ``p`` moves again if it has become
the faster engine). ``probe_every_s = 0`` restores the constant trickle at ``p_min``.

Backoff: each probe that leaves the share at its floor multiplies the time to the next one
by ``probe_backoff``, up to ``probe_every_max_s`` (with the defaults: 20, 40, 80, 160,
300, 300 s...). The first probe comes ``probe_every_s`` after the share reaches its floor,
and the interval starts again from ``probe_every_s`` once the share leaves it (or the
schedule's settings change). Even bunched, a probe costs more than its share
(docs/gpu.md), because a probe's requests decode at the speculative engine's slower TPOT
for seconds after the probe's second, while both processes share the GPU. The backoff is
the usual answer to a measurement that costs every time it comes back negative (binary
exponential backoff, as in Ethernet: Metcalfe & Boggs, "Ethernet: distributed packet
switching for local computer networks", CACM 19(7), 1976): a speculative engine that keeps
losing is asked ever less often, down to one probe per ``probe_every_max_s``, while a
change of traffic is still seen within minutes.

The margin: with ``tpot_margin`` m > 0 the update uses ``TPOT_plain / (TPOT_spec (1 +
m))``, so the speculative engine gains traffic only while it is more than m faster per
token, and the split settles where it is exactly that much faster. Both engines share one
GPU and the host's cores: every request the speculative engine serves also slows the plain
engine's steps, a cost that neither engine's own TPOT shows to the requests choosing it.
Equalizing TPOT is the *selfish* equilibrium, and with such shared costs it can be worse
for the whole than sending everything one way (Roughgarden & Tardos, "How bad is selfish
routing?", J. ACM 49(2), 2002). The margin prices that interference in; by default it is
0, the plain Wardrop split (docs/gpu.md says why). It can be changed live (``PUT
/control/config`` with ``{"router": {"tpot_margin": m}}``).

Settings: every setting named here (``p_min``, ``p_max``, ``eta``, ``tpot_margin``,
``p_probe``, ``probe_every_s``, ``probe_s``, ``probe_backoff``, ``probe_every_max_s``) and
the routing ``mode`` are fields of :class:`engine_host.router.settings.RouterSettings`,
with their one default, units and bounds there.
"""

from __future__ import annotations

import math
import random
import time
from dataclasses import dataclass
from typing import Any

from .settings import DEFAULT_P_START, ENGINES, PLAIN, ROUTING_MODES, SPECULATIVE, RouterSettings


@dataclass
class TpotWindow:
    """TPOT of one engine over the requests finished between two polls of its metrics.

    Attributes:
        tpot_s: EWMA of the windowed mean TPOT (s per output token), None before data.
        last_sum_s, last_count: the histogram's ``_sum`` (s) and ``_count`` at the last poll.
        fresh_at: monotonic time (s) of the last window that held a finished request.
    """

    alpha: float = 0.5
    tpot_s: float | None = None
    last_sum_s: float | None = None
    last_count: float | None = None
    fresh_at: float | None = None

    def update(self, sum_s: float, count: float, now: float) -> float | None:
        """Fold in a poll of the histogram (cumulative ``sum_s`` seconds over ``count``
        requests). Returns the window's mean TPOT (s/token), or None when no request
        finished since the last poll (or the counters went back: an engine restart)."""
        prev_sum, prev_count = self.last_sum_s, self.last_count
        self.last_sum_s, self.last_count = sum_s, count
        if prev_sum is None or prev_count is None or count < prev_count:
            return None
        n = count - prev_count
        if n <= 0:
            return None
        window = max(sum_s - prev_sum, 0.0) / n
        self.tpot_s = window if self.tpot_s is None else self.tpot_s + self.alpha * (window - self.tpot_s)
        self.fresh_at = now
        return window

    def is_fresh(self, now: float, max_age_s: float) -> bool:
        """True when a request finished within ``max_age_s`` seconds."""
        return self.fresh_at is not None and now - self.fresh_at <= max_age_s


class TrafficSplit:
    """Share ``p`` (0..1) of new requests sent to the speculative engine (module docstring).

    Args:
        settings: the routing mode and the split's settings
            (:class:`~engine_host.router.settings.RouterSettings`; default: its defaults).
        p: initial share (fraction 0..1), clipped into ``[p_min, p_max]``.
        max_age_s: a TPOT older than this (s) does not move ``p``.
        seed: seed of the per-request draw.
        **changes: settings that replace those of ``settings`` (``p_min=0.05``...).

    The settings read as attributes (``split.p_min``, ``split.mode``...); they change
    only through :meth:`configure` and :meth:`set_mode`, all at once and validated.

    Raises:
        ValueError: invalid settings (the message names each one).
    """

    def __init__(
        self,
        settings: RouterSettings | None = None,
        *,
        p: float = DEFAULT_P_START,
        max_age_s: float = 5.0,
        seed: int | None = None,
        **changes: Any,
    ):
        base = settings or RouterSettings()
        self.config = base.patched(changes) if changes else base
        self.p = min(max(p, self.config.p_min), self.config.p_max)
        self.max_age_s = max_age_s
        self.windows: dict[str, TpotWindow] = {e: TpotWindow() for e in ENGINES}
        self.routed: dict[str, int] = {e: 0 for e in ENGINES}
        self.updates = 0
        self._rng = random.Random(seed)
        self._probe_interval_s = self.config.probe_every_s  # start-to-start, grows by probe_backoff
        self._next_probe_at: float | None = None  # monotonic s; None: not scheduled (not resting)

    def __getattr__(self, name: str) -> Any:
        # split.p_min reads split.config.p_min (only called for names not found otherwise)
        if name in RouterSettings.model_fields and "config" in self.__dict__:
            return getattr(self.__dict__["config"], name)
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

    def settings(self) -> dict[str, float]:
        """The numeric settings in force: ``p_min``, ``p_max``, ``p_probe`` (fractions 0..1),
        ``eta``, ``tpot_margin`` (fraction >= 0), ``probe_every_s``, ``probe_s``,
        ``probe_every_max_s`` (s), ``probe_backoff`` (factor >= 1)."""
        return self.config.split_settings()

    def check_settings(self, patch: Any) -> RouterSettings:
        """The settings that ``patch`` (any subset of :class:`RouterSettings`' fields)
        would leave in force, validated; nothing is changed.

        Raises:
            ValueError: ``patch`` is not an object, names an unknown setting, or leaves
                an invalid one (bounds in :class:`RouterSettings`); the message names each.
        """
        return self.config.patched(patch)

    def configure(self, patch: Any) -> dict[str, float]:
        """Apply a settings patch (see :meth:`check_settings`; ``mode`` included) all at
        once, clip ``p`` into the new bounds, and return the numeric settings now in
        force. A change of the probes' schedule (``probe_every_s``, ``probe_backoff``,
        ``probe_every_max_s``) starts it afresh; other settings, or the same values
        again, leave it running.

        Raises:
            ValueError: as :meth:`check_settings`; nothing changes then.
        """
        new = self.check_settings(patch)
        schedule = ("probe_every_s", "probe_backoff", "probe_every_max_s")
        changed = any(getattr(new, k) != getattr(self.config, k) for k in schedule)
        self.config = new
        self.p = min(max(self.p, new.p_min), new.p_max)
        if changed:
            self._reset_probes()
        return new.split_settings()

    def set_mode(self, mode: str) -> None:
        """``auto`` (follow TPOT), ``plain`` or ``speculative`` (all requests to one engine).

        Raises:
            ValueError: an unknown mode.
        """
        if mode not in ROUTING_MODES:
            raise ValueError(f"routing must be one of {', '.join(ROUTING_MODES)}, got {mode!r}")
        self.config = self.config.model_copy(update={"mode": mode})

    def observe(self, engine: str, sum_s: float, count: float, now: float) -> None:
        """Fold in one poll of ``engine``'s TPOT histogram (cumulative sum in s, count)."""
        self.windows[engine].update(sum_s, count, now)

    def update(self, now: float) -> float:
        """Move ``p`` towards the engine with the lower TPOT; returns the new ``p``."""
        c = self.config
        ws, wp = self.windows[SPECULATIVE], self.windows[PLAIN]
        if ws.tpot_s and wp.tpot_s and ws.is_fresh(now, self.max_age_s) and wp.is_fresh(now, self.max_age_s):
            ratio = wp.tpot_s / (ws.tpot_s * (1.0 + c.tpot_margin))
            self.p = min(max(self.p * math.exp(c.eta * math.log(ratio)), c.p_min), c.p_max)
            self.updates += 1
        if self.resting():
            self._probe_on(now)  # keeps the schedule (and its backoff) current between requests
        else:
            self._reset_probes()
        return self.p

    def _reset_probes(self) -> None:
        self._probe_interval_s = self.config.probe_every_s
        self._next_probe_at = None

    def _probe_on(self, now: float) -> bool:
        """Whether a probe is on at ``now`` (monotonic s) while resting; advances the
        schedule past probes that have ended, each one backing the interval off."""
        c = self.config
        if self._next_probe_at is None:
            self._probe_interval_s = c.probe_every_s
            self._next_probe_at = now + self._probe_interval_s
        cap = max(c.probe_every_max_s, c.probe_every_s)
        while now >= self._next_probe_at + c.probe_s:
            self._probe_interval_s = min(self._probe_interval_s * c.probe_backoff, cap)
            self._next_probe_at += self._probe_interval_s
        return now >= self._next_probe_at

    def resting(self) -> bool:
        """True while ``p`` rests at its floor ``p_min`` (below ``p_max``): only probes then
        reach the speculative engine."""
        c = self.config
        return c.p_min < c.p_max and self.p <= c.p_min and c.probe_every_s > 0

    def share_now(self, now: float | None = None) -> float:
        """Share (0..1) of a request arriving at ``now`` (monotonic s) that goes to the
        speculative engine in ``auto``: ``p``, or while resting ``p_probe`` during a probe
        and 0 between probes (see :meth:`probe_schedule`)."""
        if not self.resting():
            return self.p
        now = time.monotonic() if now is None else now
        return self.config.p_probe if self._probe_on(now) else 0.0

    def probe_schedule(self, now: float | None = None) -> dict[str, float] | None:
        """While resting: ``{"every_s": interval now (s), "next_in_s": s to the next probe's
        start (0 during a probe)}``; None otherwise."""
        if not self.resting():
            return None
        now = time.monotonic() if now is None else now
        on = self._probe_on(now)
        assert self._next_probe_at is not None
        return {
            "every_s": round(self._probe_interval_s, 3),
            "next_in_s": 0.0 if on else round(self._next_probe_at - now, 3),
        }

    def choose(self, now: float | None = None) -> str:
        """The engine for the next request arriving at ``now`` (monotonic s; default: the
        clock's); counts it."""
        mode = self.config.mode
        if mode == "auto":
            engine = SPECULATIVE if self._rng.random() < self.share_now(now) else PLAIN
        else:
            engine = mode
        self.routed[engine] += 1
        return engine

    def describe(self) -> dict:
        """JSON-able state: mode, share, settings, TPOT per engine (ms), requests routed."""
        c = self.config
        return {
            "mode": c.mode,
            "p_speculative": round(self.p, 4),
            "p_bounds": [c.p_min, c.p_max],
            "resting": self.resting(),
            "probes": self.probe_schedule(),
            "settings": self.settings(),
            "tpot_ms": {
                e: (round(w.tpot_s * 1000.0, 3) if w.tpot_s is not None else None) for e, w in self.windows.items()
            },
            "routed": dict(self.routed),
            "updates": self.updates,
        }
