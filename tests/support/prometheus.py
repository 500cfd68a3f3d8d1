"""A real Prometheus server (Debian's package) in a temporary folder for tests."""

from __future__ import annotations

import json
import shutil
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

from .net import free_port


def why_no_prometheus() -> str | None:
    """Why Prometheus tests cannot run here (None when they can)."""
    missing = [b for b in ("prometheus", "promtool") if shutil.which(b) is None]
    if missing:
        return f"{' and '.join(missing)} not found (apt-get install prometheus; scripts/setup.sh --test does it)"
    return None


class PrometheusServer:
    """A real Prometheus (Debian's package) in a temporary folder, on 127.0.0.1 only,
    scraping ``targets`` (``host:port``, job ``specpilot_engine``) every ``scrape_interval_s``.

    Args:
        targets: ``host:port`` of the engine hosts (their ``/metrics``).
        scrape_interval_s: scrape and rule evaluation interval (s).
        rule_files: rule files to load (copied next to the config).
        extra_scrape_configs: more ``scrape_configs`` entries (e.g. the control plane's exporter).
        retention: how long the server keeps samples (Prometheus duration, e.g. ``1d``,
            ``15d``); blocks placed in ``dir / "data"`` before :meth:`start` (a backfill)
            are kept if younger.

    Raises:
        RuntimeError: binary missing or the server did not become ready (with its log).
    """

    def __init__(
        self,
        targets: list[str],
        scrape_interval_s: float = 1.0,
        rule_files: list[Path] | None = None,
        extra_scrape_configs: list[dict[str, Any]] | None = None,
        retention: str = "1d",
    ):
        self.retention = retention
        self.extra_scrape_configs = list(extra_scrape_configs or [])
        self.binary = shutil.which("prometheus")
        if self.binary is None:
            raise RuntimeError(why_no_prometheus() or "prometheus not found")
        self.targets = list(targets)
        self.scrape_interval_s = scrape_interval_s
        self.rule_files = [Path(p) for p in (rule_files or [])]
        self.port = free_port()
        self.dir = Path(tempfile.mkdtemp(prefix="specpilot-prom-"))
        self.log = self.dir / "prometheus.log"
        self._proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def _write_config(self) -> Path:
        for f in self.rule_files:
            shutil.copy(f, self.dir / f.name)
        iv = f"{self.scrape_interval_s:g}s"
        cfg = {
            "global": {"scrape_interval": iv, "evaluation_interval": iv, "scrape_timeout": iv},
            "rule_files": [f.name for f in self.rule_files],
            "scrape_configs": [
                {"job_name": "specpilot_engine", "static_configs": [{"targets": self.targets}]},
                *self.extra_scrape_configs,
            ],
        }
        path = self.dir / "prometheus.yml"
        path.write_text(json.dumps(cfg))  # JSON is YAML
        return path

    def start(self, timeout_s: float = 60.0) -> "PrometheusServer":
        import httpx

        cfg = self._write_config()
        with open(self.log, "wb") as log:
            self._proc = subprocess.Popen(
                [
                    self.binary,
                    f"--config.file={cfg}",
                    f"--storage.tsdb.path={self.dir / 'data'}",
                    f"--web.listen-address=127.0.0.1:{self.port}",
                    "--web.enable-lifecycle",
                    f"--storage.tsdb.retention.time={self.retention}",
                    "--log.level=warn",
                ],
                stdout=log,
                stderr=subprocess.STDOUT,
                cwd=self.dir,
                start_new_session=True,
            )
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self._proc.poll() is not None:
                break
            try:
                if httpx.get(f"{self.url}/-/ready", timeout=1.0).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        text = self.log.read_text(errors="replace") if self.log.exists() else ""
        self.stop()
        raise RuntimeError(f"Prometheus did not become ready:\n{text[-2000:]}")

    def set_targets(self, targets: list[str]) -> None:
        """Change the scraped targets and reload the configuration."""
        import httpx

        self.targets = list(targets)
        self._write_config()
        httpx.post(f"{self.url}/-/reload", timeout=10.0).raise_for_status()

    def wait_scraped(self, metric: str = "up", n: int | None = None, timeout_s: float = 30.0) -> None:
        """Wait until ``metric`` has a sample for every target (or ``n`` series)."""
        import httpx

        want = len(self.targets) if n is None else n
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            r = httpx.get(f"{self.url}/api/v1/query", params={"query": metric}, timeout=5.0).json()
            if len(r.get("data", {}).get("result", [])) >= want:
                return
            time.sleep(0.2)
        try:
            targets = httpx.get(f"{self.url}/api/v1/targets", timeout=5.0).json()["data"]["activeTargets"]
            why = "; ".join(f"{t['scrapeUrl']}: {t['health']} {t.get('lastError') or ''}" for t in targets)
        except (httpx.HTTPError, KeyError, ValueError) as exc:
            why = str(exc)
        raise RuntimeError(f"Prometheus did not scrape {metric} from {want} target(s) in {timeout_s:g} s ({why})")

    def stop(self) -> None:
        if self._proc is not None and self._proc.poll() is None:
            self._proc.terminate()
            try:
                self._proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait()
        self._proc = None
        shutil.rmtree(self.dir, ignore_errors=True)

    def __enter__(self) -> "PrometheusServer":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
