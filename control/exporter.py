"""The control plane's own Prometheus series, for alert rules that compare the control
plane's view with the engines' (``deploy/prometheus/specpilot-rules.yml``).

``python -m control export-metrics --port 9464`` serves, computed from the store at
scrape time, per registered host:

* ``specpilot:control_config_version{host, engine_instance}``: the engine's config
  version recorded when the control plane last applied (or imported) a config; the
  drift alert fires when the engine's own ``specpilot:config_version`` differs;
* ``specpilot:control_version{host, engine_instance}``: the control plane's version
  number of that config (as in ``python -m control config history``).

``engine_instance`` is the ``host:port`` of the host's URL, the ``instance`` label its
engine series get from Prometheus.
"""

from __future__ import annotations

import logging
import threading
from typing import Any

from .promsource import instance_of
from .store import Store, list_hosts
from .versions import last_applied

log = logging.getLogger("specpilot.exporter")


class ControlPlaneCollector:
    """prometheus-client custom collector reading the store at each scrape."""

    def __init__(self, store: Store):
        self.store = store

    def collect(self):
        from prometheus_client.core import GaugeMetricFamily

        engine = GaugeMetricFamily(
            "specpilot:control_config_version",
            "Engine config version the control plane last applied or imported.",
            labels=["host", "engine_instance"],
        )
        ours = GaugeMetricFamily(
            "specpilot:control_version",
            "The control plane's number of the config version last applied.",
            labels=["host", "engine_instance"],
        )
        for h in list_hosts(self.store):
            v = last_applied(self.store, h.id)
            if v is None:
                continue
            labels = [h.name, instance_of(h.url)]
            ours.add_metric(labels, float(v.version))
            if v.engine_version is not None:
                engine.add_metric(labels, float(v.engine_version))
        yield engine
        yield ours


def serve(store: Store, port: int, addr: str = "0.0.0.0") -> tuple[Any, threading.Thread]:
    """Serve ``/metrics`` on ``addr:port`` in a background thread, always in the text
    exposition format (prometheus-client's OpenMetrics output would rename
    ``specpilot:x`` to ``specpilot_x``).

    Returns:
        ``(server, thread)``; ``server.shutdown()`` stops it.
    Raises:
        OSError: the port is taken.
    """
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    from prometheus_client import (
        CONTENT_TYPE_LATEST,
        CollectorRegistry,
        generate_latest,
    )

    registry = CollectorRegistry()
    registry.register(ControlPlaneCollector(store))

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            if self.path.split("?")[0] != "/metrics":
                self.send_error(404)
                return
            try:
                body, status = generate_latest(registry), 200
            except Exception as exc:  # the store is unreachable: say so, keep serving
                log.warning("export failed: %s", exc)
                body, status = f"# export failed: {exc}\n".encode(), 503
            self.send_response(status)
            self.send_header("Content-Type", CONTENT_TYPE_LATEST)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: Any) -> None:
            pass

    server = ThreadingHTTPServer((addr, port), Handler)
    server.daemon_threads = True
    thread = threading.Thread(target=server.serve_forever, name="control-exporter", daemon=True)
    thread.start()
    return server, thread
