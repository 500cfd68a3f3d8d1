"""The dual engine host's metrics: vLLM's TPOT histogram read for the split, both engines'
``/metrics`` merged under an ``engine`` label, and the router's own ``specpilot:router_*``
series. Parsing is prometheus-client's (:func:`text_string_to_metric_families`).

:func:`select_families` (cut an exposition text down to a few families before parsing) is
shared with the control plane's collector (``control.metrics_parse``).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.parser import text_string_to_metric_families

from .settings import ENGINES, ROUTING_MODES
from .split import TrafficSplit

TPOT_FAMILY = "vllm:request_time_per_output_token_seconds"

_SUFFIXES = ("_bucket", "_count", "_sum", "_total", "_created")


def family_name(sample_name: str) -> str:
    """The metric family of a sample name (``_bucket``, ``_count``, ``_sum``, ``_total``,
    ``_created`` removed)."""
    for suffix in _SUFFIXES:
        if sample_name.endswith(suffix):
            return sample_name[: -len(suffix)]
    return sample_name


def select_families(text: str, families: frozenset[str] | set[str]) -> str:
    """The lines of ``text`` (samples and their ``# HELP``/``# TYPE`` lines) that belong
    to the metric families named in ``families`` (names without ``_total``/``_bucket``...)."""
    keep = []
    for line in text.splitlines():
        if line.startswith("#"):
            parts = line.split(None, 3)
            name = parts[2] if len(parts) > 2 else ""
        else:
            name = line.split("{", 1)[0].split(" ", 1)[0]
        if name in families or family_name(name) in families:
            keep.append(line)
    return "\n".join(keep) + "\n"


def tpot_totals(metrics_text: str) -> tuple[float, float] | None:
    """``(sum_s, count)`` of vLLM's TPOT histogram in a ``/metrics`` text (all label sets
    added), or None when the family is absent.

    Raises:
        ValueError: the text is not Prometheus exposition format.
    """
    # only the one family is parsed: vLLM's full exposition is large and this runs 4x a second
    return _tpot_from(text_string_to_metric_families(select_families(metrics_text, {TPOT_FAMILY})))


def local_tpot_totals() -> tuple[float, float] | None:
    """``(sum_s, count)`` of vLLM's TPOT histogram in this process's Prometheus registry
    (the in-engine front reads its own engine so, without rendering the whole exposition
    4x a second), or None when vLLM has not registered it here."""
    from prometheus_client import REGISTRY

    # the registry's name index (prometheus_client's, unchanged since 0.4) finds the one collector
    collector = getattr(REGISTRY, "_names_to_collectors", {}).get(TPOT_FAMILY + "_sum")
    return None if collector is None else _tpot_from(collector.collect())


def _tpot_from(families: Iterable[Any]) -> tuple[float, float] | None:
    total_s = count = 0.0
    found = False
    for fam in families:
        if fam.name != TPOT_FAMILY:
            continue
        for s in fam.samples:
            if s.name == TPOT_FAMILY + "_sum":
                total_s += s.value
                found = True
            elif s.name == TPOT_FAMILY + "_count":
                count += s.value
    return (total_s, count) if found else None


def relabel(metrics_text: str, engine: str) -> list[Metric]:
    """Parsed metric families of one engine with ``engine=<name>`` added to every sample.

    Raises:
        ValueError: the text is not Prometheus exposition format.
    """
    out = []
    for fam in text_string_to_metric_families(metrics_text):
        m = Metric(fam.name, fam.documentation, fam.type, fam.unit)
        for s in fam.samples:
            m.add_sample(s.name, dict(s.labels, engine=engine), s.value, s.timestamp, s.exemplar)
        out.append(m)
    return out


class _Families:
    """A one-shot collector for :func:`prometheus_client.generate_latest`."""

    def __init__(self, families: list[Metric]):
        self.families = families

    def collect(self):  # noqa: D102
        return iter(self.families)


def merged_metrics(texts: Mapping[str, str], split: TrafficSplit, in_flight: Mapping[str, int]) -> bytes:
    """One exposition text: each engine's families merged under an ``engine`` label,
    plus the router's own ``specpilot:router_*`` series.

    Args:
        texts: ``{engine: its /metrics text}`` for the engines that answered.
        split: the traffic split (share, TPOT per engine, requests routed, mode).
        in_flight: requests in flight per engine.
    Raises:
        ValueError: a text is not Prometheus exposition format.
    """
    by_name: dict[str, Metric] = {}
    for engine, text in texts.items():
        for fam in relabel(text, engine):
            have = by_name.get(fam.name)
            if have is None:
                by_name[fam.name] = fam
            else:
                have.samples.extend(fam.samples)
    d = split.describe()
    share = GaugeMetricFamily(
        "specpilot:router_speculative_share", "share of new requests sent to the speculative engine (0..1)"
    )
    share.add_metric([], d["p_speculative"])
    tpot = GaugeMetricFamily(
        "specpilot:router_tpot_seconds",
        "EWMA of each engine's windowed TPOT as the router sees it (s/token)",
        labels=["engine"],
    )
    routed = CounterMetricFamily("specpilot:router_requests_routed", "requests sent to each engine", labels=["engine"])
    inflight = GaugeMetricFamily(
        "specpilot:router_requests_in_flight", "requests in flight per engine", labels=["engine"]
    )
    for e in ENGINES:
        w = split.windows[e].tpot_s
        if w is not None:
            tpot.add_metric([e], w)
        routed.add_metric([e], d["routed"][e])
        inflight.add_metric([e], in_flight.get(e, 0))
    mode = GaugeMetricFamily(
        "specpilot:router_mode_info", "routing mode in force (1 for the one in force)", labels=["mode"]
    )
    for m in ROUTING_MODES:
        mode.add_metric([m], 1.0 if d["mode"] == m else 0.0)
    reg = CollectorRegistry(auto_describe=False)
    reg.register(_Families([*by_name.values(), share, tpot, routed, inflight, mode]))
    return generate_latest(reg)
