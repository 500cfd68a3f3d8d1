"""Reading an engine host's ``/metrics`` (Prometheus text) with prometheus-client's parser,
and the histogram arithmetic the collector needs.

:func:`parse_metrics` sums each series over the labels that only say *where* it was
measured (``engine``, ``model_name``: several engine cores behind one API server) and
keeps the labels that say *what* (``position``, ``mode``, ``k``, ``le``...). Gauges in
``_perc`` (fractions 0..1) are averaged over engines instead of summed.

Histograms are kept cumulative by upper bound (s); :func:`bucket_delta` turns two
scrapes into per-bucket counts of the interval, and :func:`quantile` interpolates a
quantile from such counts the way PromQL's ``histogram_quantile`` does.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from prometheus_client.parser import text_string_to_metric_families

from engine_host.router.metrics import select_families  # one definition, shared with the dual host's router

# one definition of the bucket arithmetic, shared with the engine's ring buffer (engine_host.sample)
from engine_host.sample import Bucket, encode_buckets, merge_buckets, quantile

__all__ = [
    "Bucket",
    "Snapshot",
    "bucket_delta",
    "decode_buckets",
    "encode_buckets",
    "merge_buckets",
    "parse_metrics",
    "quantile",
    "select_families",
]

#: Labels that locate a series rather than qualify it: summed over.
LOCATION_LABELS = frozenset({"engine", "model_name"})

LabelKey = tuple[tuple[str, str], ...]


@dataclass
class Snapshot:
    """One scrape: ``series[(sample name, ((label, value), ...))] = value``.

    Counter samples keep their ``_total`` name (``vllm:generation_tokens_total``),
    histogram buckets their ``_bucket`` name with an ``le`` label; ``_created`` samples
    are dropped.
    """

    series: dict[tuple[str, LabelKey], float] = field(default_factory=dict)

    def value(self, name: str, **labels: str) -> float | None:
        """The value of ``name`` with exactly these labels (None when absent)."""
        return self.series.get((name, tuple(sorted(labels.items()))))

    def by_label(self, name: str, label: str) -> dict[str, float]:
        """``{label value: value}`` for the series of ``name`` that carry ``label``."""
        out: dict[str, float] = {}
        for (n, labels), v in self.series.items():
            if n == name:
                d = dict(labels)
                if label in d:
                    out[d[label]] = out.get(d[label], 0.0) + v
        return out

    def histogram(self, name: str) -> dict[float, float]:
        """Cumulative counts by upper bound (s, ``math.inf`` for ``+Inf``) of histogram
        ``name`` (without ``_bucket``); empty when absent."""
        return {float(le): v for le, v in self.by_label(name + "_bucket", "le").items()}


def parse_metrics(text: str, families: frozenset[str] | set[str] | None = None) -> Snapshot:
    """Parse Prometheus text exposition into a :class:`Snapshot`.

    Args:
        text: the body of ``GET /metrics``.
        families: parse only these metric families (see :func:`select_families`); None: all.
    Raises:
        ValueError: the text is not Prometheus exposition format.
    """
    if families is not None:
        text = select_families(text, families)
    sums: dict[tuple[str, LabelKey], float] = {}
    counts: dict[tuple[str, LabelKey], int] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name.endswith("_created"):
                continue
            key = (s.name, tuple(sorted((k, v) for k, v in s.labels.items() if k not in LOCATION_LABELS)))
            sums[key] = sums.get(key, 0.0) + float(s.value)
            counts[key] = counts.get(key, 0) + 1
    snap = Snapshot()
    for key, total in sums.items():
        snap.series[key] = total / counts[key] if key[0].endswith("_perc") else total
    return snap


def bucket_delta(new: dict[float, float], old: dict[float, float] | None) -> dict[Bucket, float]:
    """Per-bucket (not cumulative) counts observed between two scrapes of one histogram.

    Args:
        new, old: cumulative counts by upper bound (from :meth:`Snapshot.histogram`);
            ``old`` None or empty: everything counted since the engine started.
    Returns:
        ``{(lower s, upper s): count}`` with only non-zero buckets (each keeps its lower
        edge, so quantiles stay exact without the empty buckets); empty when the counts
        went down (an engine restart: the caller should start over).
    """
    old = old or {}
    out: dict[Bucket, float] = {}
    prev_new = prev_old = 0.0
    lower = 0.0
    for le in sorted(new):
        cum_new, cum_old = new[le], old.get(le, 0.0)
        d = (cum_new - prev_new) - (cum_old - prev_old)
        prev_new, prev_old = cum_new, cum_old
        if d < 0:
            return {}
        if d > 0:
            out[(lower, le)] = d
        lower = le
    return out


def decode_buckets(data: dict[str, float] | None) -> dict[Bucket, float]:
    """Inverse of :func:`encode_buckets`."""
    out: dict[Bucket, float] = {}
    for key, n in (data or {}).items():
        lo, _, hi = key.partition(":")
        out[(float(lo), float(hi))] = float(n)
    return out
