"""Helpers for tests and benchmarks of the control plane: a throwaway PostgreSQL server,
a stand-in engine host (HTTP, same API shapes, real config validation) and a TCP relay
that can be cut to simulate a host going down.

Nothing here is used by the running control plane.
"""

from __future__ import annotations

import atexit
import glob
import json
import os
import pwd
import shutil
import socket
import subprocess
import tempfile
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlparse

from engine_host.config import ConfigError, EngineLimits, LiveConfig, apply_patch, diff_configs


def free_port() -> int:
    """An unused TCP port on 127.0.0.1."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# --------------------------------------------------------------------------- PostgreSQL

def postgres_bin_dir() -> Path | None:
    """Folder with ``initdb``/``pg_ctl`` (Debian's ``/usr/lib/postgresql/N/bin`` or PATH)."""
    found = sorted(glob.glob("/usr/lib/postgresql/*/bin/initdb"), key=lambda p: int(p.split("/")[4]))
    if found:
        return Path(found[-1]).parent
    initdb = shutil.which("initdb")
    return Path(initdb).parent if initdb else None


def psycopg_installed() -> bool:
    """True when the ``psycopg`` driver imports."""
    try:
        import psycopg  # noqa: F401

        return True
    except ImportError:
        return False


class PostgresServer:
    """A PostgreSQL cluster in a temporary folder, listening on 127.0.0.1 only, trust auth.

    When run as root, the cluster runs as the ``postgres`` system user (``initdb``
    refuses root). :meth:`new_database` returns the URL of a fresh, empty database.

    Raises:
        RuntimeError: binaries missing or the server did not start (with its log).
    """

    def __init__(self) -> None:
        self.bin = postgres_bin_dir()
        if self.bin is None:
            raise RuntimeError("PostgreSQL binaries not found (apt-get install postgresql)")
        self.port = free_port()
        self.dir = Path(tempfile.mkdtemp(prefix="specpilot-pg-"))
        self.data = self.dir / "data"
        self.log = self.dir / "server.log"
        self._n = 0
        self._lock = threading.Lock()
        self.user: str | None = None
        if os.geteuid() == 0:
            self.user = "postgres"
            pw = pwd.getpwnam(self.user)
            os.chmod(self.dir, 0o755)
            os.chown(self.dir, pw.pw_uid, pw.pw_gid)

    def _run(self, *args: str) -> subprocess.CompletedProcess[str]:
        cmd = [str(self.bin / args[0]), *args[1:]]
        if self.user:
            cmd = ["runuser", "-u", self.user, "--", *cmd]
        return subprocess.run(cmd, capture_output=True, text=True, cwd=self.dir, timeout=120)

    def start(self) -> "PostgresServer":
        r = self._run("initdb", "-D", str(self.data), "-A", "trust", "-U", "postgres", "-E", "UTF8", "--no-sync")
        if r.returncode:
            raise RuntimeError(f"initdb failed: {r.stderr or r.stdout}")
        opts = f"-p {self.port} -k {self.dir} -c listen_addresses=127.0.0.1 -c fsync=off -c max_connections=100"
        r = self._run("pg_ctl", "-D", str(self.data), "-l", str(self.log), "-o", opts, "-w", "-t", "60", "start")
        if r.returncode:
            log = self.log.read_text(errors="replace") if self.log.exists() else ""
            raise RuntimeError(f"PostgreSQL did not start: {r.stderr or r.stdout}\n{log[-2000:]}")
        return self

    @property
    def admin_url(self) -> str:
        return f"postgresql+psycopg://postgres@127.0.0.1:{self.port}/postgres"

    def new_database(self) -> str:
        """Create an empty database; returns its SQLAlchemy URL."""
        import psycopg

        with self._lock:
            self._n += 1
            name = f"specpilot_{os.getpid()}_{self._n}"
        with psycopg.connect(f"host=127.0.0.1 port={self.port} user=postgres dbname=postgres", autocommit=True) as c:
            c.execute(f'CREATE DATABASE "{name}"')
        return f"postgresql+psycopg://postgres@127.0.0.1:{self.port}/{name}"

    def stop(self) -> None:
        if self.data.exists():
            self._run("pg_ctl", "-D", str(self.data), "-m", "immediate", "-w", "stop")
        shutil.rmtree(self.dir, ignore_errors=True)


_SHARED_PG: PostgresServer | None = None

#: Store back-ends the store tests run against.
BACKENDS = ("sqlite", "postgresql")


def why_no_postgres() -> str | None:
    """Why PostgreSQL tests cannot run here (None when they can)."""
    if postgres_bin_dir() is None:
        return "PostgreSQL binaries not found (apt-get install postgresql)"
    if not psycopg_installed():
        return "the psycopg driver is not installed (pip install 'specpilot[postgres]')"
    return None


def database_url(backend: str, tmp_path: Path) -> str:
    """A fresh, empty database for one test: an SQLite file in ``tmp_path`` or a new
    database on the shared throwaway PostgreSQL server.

    PostgreSQL missing: the test is skipped, or fails when ``CI=true`` (CI must run both).
    """
    if backend == "sqlite":
        return f"sqlite:///{tmp_path / 'specpilot.db'}"
    missing = why_no_postgres()
    if missing:
        import pytest

        if os.environ.get("CI", "").lower() == "true":
            pytest.fail(f"CI runs the store tests on PostgreSQL too: {missing}")
        pytest.skip(missing)
    return shared_postgres().new_database()


def shared_postgres() -> PostgresServer:
    """One throwaway server per test process (stopped at exit)."""
    global _SHARED_PG
    if _SHARED_PG is None:
        _SHARED_PG = PostgresServer().start()
        atexit.register(_SHARED_PG.stop)
    return _SHARED_PG


# --------------------------------------------------------------------------- fake engine host

class FakeEngineMetrics:
    """``/metrics`` of a stand-in engine host: the ``vllm:*`` and ``specpilot:*`` series
    the collector reads, with the same names and bucket layouts as the real ones,
    driven by :meth:`serve` and the gauges."""

    LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0)

    def __init__(self, k_max: int = 8, started_at: float | None = None):
        from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

        r = self.registry = CollectorRegistry()
        self.generation = Counter("vllm:generation_tokens", "gen", registry=r)
        self.user_generation = Counter("specpilot:user_generation_tokens", "user gen", registry=r)
        self.prompt = Counter("vllm:prompt_tokens", "prompt", registry=r)
        self.success = Counter("vllm:request_success", "finished", ["finished_reason"], registry=r)
        self.drafts = Counter("vllm:spec_decode_num_drafts", "drafts", registry=r)
        self.draft_tokens = Counter("vllm:spec_decode_num_draft_tokens", "draft tokens", registry=r)
        self.accepted = Counter("vllm:spec_decode_num_accepted_tokens", "accepted", registry=r)
        self.accepted_pos = Counter("vllm:spec_decode_num_accepted_tokens_per_pos", "per pos", ["position"], registry=r)
        self.draft_pos = Counter("specpilot:spec_decode_num_draft_tokens_per_pos", "per pos", ["position"], registry=r)
        self.hist = {name: Histogram(name, name, buckets=self.LATENCY_BUCKETS, registry=r) for name in (
            "vllm:time_to_first_token_seconds", "vllm:inter_token_latency_seconds",
            "vllm:e2e_request_latency_seconds", "vllm:request_queue_time_seconds")}
        self.running = Gauge("vllm:num_requests_running", "running", registry=r)
        self.waiting = Gauge("vllm:num_requests_waiting", "waiting", registry=r)
        self.kv = Gauge("vllm:kv_cache_usage_perc", "kv", registry=r)
        self.k = Gauge("specpilot:speculation_k", "k", registry=r)
        self.mode = Gauge("specpilot:speculation_mode_info", "mode", ["mode"], registry=r)
        self.version = Gauge("specpilot:config_version", "version", registry=r)
        self.max_num_seqs = Gauge("specpilot:max_num_seqs", "cap", registry=r)
        self.start = Gauge("specpilot:engine_start_time_seconds", "start", registry=r)
        self.start.set(started_at or time.time())
        self.mode.labels("fixed").set(1)
        self.max_num_seqs.set(8)
        self.version.set(1)
        for i in range(k_max):
            self.accepted_pos.labels(str(i))

    def serve(self, requests: int = 1, output_tokens: int = 50, prompt_tokens: int = 20, ttft_s: float = 0.05,
              itl_s: float = 0.02, queue_s: float = 0.001, drafts: int = 0, draft_tokens: int = 0,
              accepted: int = 0, accepted_per_pos: list[int] | None = None,
              draft_tokens_per_pos: list[int] | None = None) -> None:
        """Count ``requests`` finished requests with these figures (per request)."""
        for _ in range(requests):
            self.generation.inc(output_tokens)
            self.user_generation.inc(output_tokens)
            self.prompt.inc(prompt_tokens)
            self.success.labels("length").inc()
            self.hist["vllm:time_to_first_token_seconds"].observe(ttft_s)
            for _ in range(max(0, output_tokens - 1)):
                self.hist["vllm:inter_token_latency_seconds"].observe(itl_s)
            self.hist["vllm:e2e_request_latency_seconds"].observe(ttft_s + itl_s * max(0, output_tokens - 1))
            self.hist["vllm:request_queue_time_seconds"].observe(queue_s)
        self.drafts.inc(drafts)
        self.draft_tokens.inc(draft_tokens)
        self.accepted.inc(accepted)
        for i, n in enumerate(accepted_per_pos or []):
            self.accepted_pos.labels(str(i)).inc(n)
        for i, n in enumerate(draft_tokens_per_pos or []):
            self.draft_pos.labels(str(i)).inc(n)

    def text(self) -> str:
        from prometheus_client import generate_latest

        return generate_latest(self.registry).decode()


class FakeEngineHost:
    """A stand-in engine host for store-level tests: ``/health``, ``/ready``,
    ``/control/state``, ``PUT /control/config`` (validated with the real
    :func:`engine_host.config.apply_patch`), ``/control/warmup/runs`` and ``/metrics``
    (text set by the test), behind the same bearer token rule.

    Attributes:
        config: the live config (dict); version: the engine's config version;
        pid, started_at: identity reported in ``/control/state``;
        metrics: :class:`FakeEngineMetrics` behind ``/metrics``; put_delay_s: delay before answering a PUT;
        refuse: when set, every PUT is refused (422) with these ``{"loc", "msg"}`` errors;
        puts: the bodies received by ``PUT /control/config`` in order;
        puts_arrived: PUTs that have arrived, counted before ``put_delay_s``.
    """

    def __init__(self, token: str = "fake-token", limits: dict[str, Any] | None = None, port: int | None = None):
        self.token = token
        self.limits = EngineLimits.model_validate(limits or {
            "model": "fake", "k_max": 8, "max_num_seqs": 8, "max_num_batched_tokens": 2048, "max_model_len": 1024})
        self.config: dict[str, Any] = LiveConfig().model_dump(mode="json")
        self.version = 1
        self.pid = 4242
        self.started_at = time.time()
        self.metrics = FakeEngineMetrics(k_max=self.limits.k_max, started_at=self.started_at)
        self.warmup_runs: list[dict[str, Any]] = []
        self.put_delay_s = 0.0
        self.refuse: list[dict[str, Any]] | None = None
        self.puts: list[dict[str, Any]] = []
        self.puts_arrived = 0
        self.lock = threading.Lock()
        self.port = port or free_port()
        self._server: ThreadingHTTPServer | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def restart(self) -> None:
        """Simulate an engine restart: new identity, start-up config, version 1."""
        with self.lock:
            self.pid += 1
            self.started_at = time.time()
            self.config = LiveConfig().model_dump(mode="json")
            self.version = 1
            self.metrics = FakeEngineMetrics(k_max=self.limits.k_max, started_at=self.started_at)

    def _state(self) -> dict[str, Any]:
        spec = self.config["speculation"]
        return {
            "config_version": self.version, "config": self.config,
            "speculation": {"mode": spec["mode"], "k_current": spec["k"], "k": spec["k"], "k_min": spec["k_min"],
                            "k_max": spec["k_max"], "k_max_engine": self.limits.k_max},
            "batch": {"max_num_seqs": self.config["batch"]["max_num_seqs"] or self.limits.max_num_seqs,
                      "max_num_batched_tokens": self.limits.max_num_batched_tokens, "running": 0, "waiting": 0},
            "limits": self.limits.model_dump(mode="json"), "controller": {},
            "engine": {"pid": self.pid, "started_at": self.started_at, "core_pid": self.pid + 1,
                       "core_started_at": self.started_at, "phase": "ready"},
        }

    def _put(self, body: Any) -> tuple[int, dict[str, Any]]:
        with self.lock:
            self.puts_arrived += 1
        if self.put_delay_s:
            time.sleep(self.put_delay_s)
        with self.lock:
            self.puts.append(body)
            if self.refuse:
                err = ConfigError(self.refuse)
                return err.status, {"detail": err.errors, "message": str(err)}
            current = LiveConfig.model_validate(self.config)
            try:
                new = apply_patch(current, body, self.limits)
            except ConfigError as exc:
                return exc.status, {"detail": exc.errors, "message": str(exc)}
            old = self.version
            self.version += 1
            self.config = new.model_dump(mode="json")
            self.metrics.version.set(self.version)
            self.metrics.k.set(self.config["speculation"]["k"])
            return 200, {"config_version": self.version, "previous_version": old, "config": self.config,
                         "diff": diff_configs(current.model_dump(mode="json"), self.config), "applied": True,
                         "apply_latency_ms": 1.0}

    def start(self) -> "FakeEngineHost":
        fake = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *a: Any) -> None:  # quiet
                pass

            def _send(self, status: int, body: Any, ctype: str = "application/json") -> None:
                data = body.encode() if isinstance(body, str) else json.dumps(body).encode()
                self.send_response(status)
                self.send_header("Content-Type", ctype)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def _authorised(self) -> bool:
                if self.headers.get("Authorization", "") == f"Bearer {fake.token}":
                    return True
                self._send(401, {"detail": "control endpoints need 'Authorization: Bearer <token>'"})
                return False

            def do_GET(self) -> None:  # noqa: N802
                u = urlparse(self.path)
                if u.path == "/health":
                    return self._send(200, {})
                if u.path == "/ready":
                    return self._send(200, {"ready": True, "phase": "ready"})
                if u.path == "/metrics":
                    return self._send(200, fake.metrics.text(), "text/plain; version=0.0.4")
                if u.path.startswith("/control/") and not self._authorised():
                    return None
                if u.path == "/control/state":
                    with fake.lock:
                        return self._send(200, fake._state())
                if u.path == "/control/warmup/runs":
                    after = int(parse_qs(u.query).get("after_id", ["0"])[0])
                    return self._send(200, {"runs": [r for r in fake.warmup_runs if r["id"] > after]})
                if u.path == "/control/samples":
                    return self._send(200, {"now": time.time(), "samples": []})
                return self._send(404, {"detail": "not found"})

            def do_PUT(self) -> None:  # noqa: N802
                if urlparse(self.path).path != "/control/config":
                    return self._send(404, {"detail": "not found"})
                if not self._authorised():
                    return None
                n = int(self.headers.get("Content-Length") or 0)
                try:
                    body = json.loads(self.rfile.read(n) or b"null")
                except ValueError:
                    return self._send(422, {"detail": [{"loc": ["body"], "msg": "malformed JSON"}], "message": "malformed JSON"})
                status, answer = fake._put(body)
                return self._send(status, answer)

        self._server = ThreadingHTTPServer(("127.0.0.1", self.port), Handler)
        self._server.daemon_threads = True
        threading.Thread(target=self._server.serve_forever, daemon=True).start()
        return self

    def stop(self) -> None:
        if self._server:
            self._server.shutdown()
            self._server.server_close()
            self._server = None

    def __enter__(self) -> "FakeEngineHost":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


# --------------------------------------------------------------------------- TCP relay

class TcpRelay:
    """Forwards 127.0.0.1:``port`` to ``target_port``; :meth:`cut` closes the listener
    and every open connection (the host looks down), :meth:`restore` listens again."""

    def __init__(self, target_port: int, port: int | None = None):
        self.target_port = target_port
        self.port = port or free_port()
        self._listener: socket.socket | None = None
        self._conns: list[socket.socket] = []
        self._lock = threading.Lock()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def restore(self) -> "TcpRelay":
        ls = socket.socket()
        ls.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        ls.bind(("127.0.0.1", self.port))
        ls.listen(64)
        self._listener = ls
        threading.Thread(target=self._accept, args=(ls,), daemon=True).start()
        return self

    start = restore

    def _accept(self, ls: socket.socket) -> None:
        while True:
            try:
                client, _ = ls.accept()
            except OSError:
                return
            try:
                upstream = socket.create_connection(("127.0.0.1", self.target_port), timeout=5)
            except OSError:
                client.close()
                continue
            with self._lock:
                self._conns += [client, upstream]
            for a, b in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pipe, args=(a, b), daemon=True).start()

    @staticmethod
    def _pipe(src: socket.socket, dst: socket.socket) -> None:
        try:
            while True:
                data = src.recv(65536)
                if not data:
                    break
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

    def cut(self) -> None:
        if self._listener:
            try:
                self._listener.shutdown(socket.SHUT_RDWR)  # wakes the thread blocked in accept()
            except OSError:
                pass
            self._listener.close()
            self._listener = None
        with self._lock:
            conns, self._conns = self._conns, []
        for s in conns:
            try:
                s.shutdown(socket.SHUT_RDWR)
                s.close()
            except OSError:
                pass

    stop = cut


# --------------------------------------------------------------------------- synthetic samples

def _bucket_of(value_s: float, bounds: tuple[float, ...] = FakeEngineMetrics.LATENCY_BUCKETS) -> str:
    lower = 0.0
    for b in bounds:
        if value_s <= b:
            return f"{lower!r}:{b!r}"
        lower = b
    return f"{lower!r}:inf"


def synthetic_sample(t: int, *, tokens_per_s: float = 100.0, busy: bool = True, k: float = 2.0,
                     kv_cache_usage: float = 0.3, ttft_s: float = 0.05, itl_s: float = 0.02, queue_s: float = 0.001,
                     acceptance: float = 0.6, requests: float = 2.0, running: float = 2.0, waiting: float = 0.0,
                     mode: str = "fixed", config_version: int = 1, covered_s: float = 1.0) -> dict[str, Any]:
    """A plausible 1 s sample row (``MetricSample`` columns) for tests and benchmarks:
    ``tokens_per_s`` tokens/s while ``busy``, latencies in s (stored in ms and as
    histogram buckets), ``acceptance`` fraction 0..1 of ``k`` drafted tokens per step."""
    tokens = tokens_per_s * covered_s if busy else 0.0
    draft_tokens = tokens * k / (1 + k * acceptance) if busy and k else 0.0
    drafts = draft_tokens / k if k else 0.0
    accepted = draft_tokens * acceptance
    per_pos = [round(drafts * acceptance ** (i + 1), 3) for i in range(int(k))] if busy and k else None
    hist = None
    if busy and requests:
        hist = {"ttft": {_bucket_of(ttft_s): requests}, "itl": {_bucket_of(itl_s): max(tokens - requests, 0.0)},
                "e2e": {_bucket_of(ttft_s + itl_s * tokens / max(requests, 1)): requests},
                "queue": {_bucket_of(queue_s): requests}}
    lat = {}
    for kind, v in (("ttft", ttft_s), ("itl", itl_s), ("e2e", ttft_s + itl_s * tokens / max(requests, 1)),
                    ("queue", queue_s)):
        for p in ("p50", "p95", "p99"):
            lat[f"{kind}_{p}_ms"] = round(v * 1000.0, 3) if hist else None
    return {
        "resolution_s": 1, "t": int(t), "covered_s": covered_s, "busy_s": covered_s if busy else 0.0,
        "output_tokens": tokens, "user_output_tokens": tokens, "prompt_tokens": tokens / 2,
        "requests_finished": requests if busy else 0.0, "output_tokens_per_s": tokens / covered_s, **lat,
        "kv_cache_usage": kv_cache_usage, "kv_cache_usage_max": kv_cache_usage,
        "running": running if busy else 0.0, "running_max": running if busy else 0.0,
        "waiting": waiting, "waiting_max": waiting,
        "num_drafts": drafts, "draft_tokens": draft_tokens, "accepted_tokens": accepted,
        "acceptance_rate": acceptance if draft_tokens else None,
        "accepted_per_pos": per_pos,
        "acceptance_per_position": [round(acceptance ** (i + 1), 4) for i in range(int(k))] if per_pos else None,
        "k": k, "mode": mode, "config_version": config_version, "max_num_seqs": 8, "hist": hist,
    }


# --------------------------------------------------------------------------- Prometheus

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

    Raises:
        RuntimeError: binary missing or the server did not become ready (with its log).
    """

    def __init__(self, targets: list[str], scrape_interval_s: float = 1.0, rule_files: list[Path] | None = None,
                 extra_scrape_configs: list[dict[str, Any]] | None = None):
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
            "scrape_configs": [{"job_name": "specpilot_engine", "static_configs": [{"targets": self.targets}]},
                               *self.extra_scrape_configs],
        }
        path = self.dir / "prometheus.yml"
        path.write_text(json.dumps(cfg))  # JSON is YAML
        return path

    def start(self, timeout_s: float = 60.0) -> "PrometheusServer":
        import httpx

        cfg = self._write_config()
        with open(self.log, "wb") as log:
            self._proc = subprocess.Popen(
                [self.binary, f"--config.file={cfg}", f"--storage.tsdb.path={self.dir / 'data'}",
                 f"--web.listen-address=127.0.0.1:{self.port}", "--web.enable-lifecycle",
                 "--storage.tsdb.retention.time=1d", "--log.level=warn"],
                stdout=log, stderr=subprocess.STDOUT, cwd=self.dir, start_new_session=True)
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
