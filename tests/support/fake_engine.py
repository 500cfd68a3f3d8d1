"""A stand-in engine host (HTTP, the same API shapes, the real config validation) and
synthetic samples, for tests and benchmarks of the control plane.

Its ``/control/state`` and ``PUT /control/config`` bodies are built through the engine
host's contract (:mod:`engine_host.schema`), so their shape cannot drift from the real
engine host's.
"""

from __future__ import annotations

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import parse_qs, urlparse

from engine_host.config import ConfigError, EngineLimits, LiveConfig, apply_patch, diff_configs
from engine_host.schema import ApplyAnswer, ControlState, ErrorAnswer

from .net import free_port


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
        self.hist = {
            name: Histogram(name, name, buckets=self.LATENCY_BUCKETS, registry=r)
            for name in (
                "vllm:time_to_first_token_seconds",
                "vllm:inter_token_latency_seconds",
                "vllm:e2e_request_latency_seconds",
                "vllm:request_queue_time_seconds",
            )
        }
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

    def serve(
        self,
        requests: int = 1,
        output_tokens: int = 50,
        prompt_tokens: int = 20,
        ttft_s: float = 0.05,
        itl_s: float = 0.02,
        queue_s: float = 0.001,
        drafts: int = 0,
        draft_tokens: int = 0,
        accepted: int = 0,
        accepted_per_pos: list[int] | None = None,
        draft_tokens_per_pos: list[int] | None = None,
    ) -> None:
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


def _refusal(err: ConfigError) -> dict[str, Any]:
    return ErrorAnswer.model_validate({"detail": err.errors, "message": str(err)}).model_dump(mode="json")


class FakeEngineHost:
    """A stand-in engine host for store-level tests: ``/health``, ``/ready``,
    ``/control/state``, ``PUT /control/config`` (validated with the real
    :func:`engine_host.config.apply_patch`), ``/control/warmup/runs`` and ``/metrics``
    (text set by the test), behind the same bearer token rule.

    Attributes:
        config: the live config (dict); version: the engine's config version;
        pid, started_at: identity reported in ``/control/state``; core_cpu: the step loop's CPU it reports;
        metrics: :class:`FakeEngineMetrics` behind ``/metrics``; put_delay_s: delay before answering a PUT;
        refuse: when set, every PUT is refused (422) with these ``{"loc", "msg"}`` errors;
        puts: the bodies received by ``PUT /control/config`` in order;
        puts_arrived: PUTs that have arrived, counted before ``put_delay_s``.
    """

    def __init__(self, token: str = "fake-token", limits: dict[str, Any] | None = None, port: int | None = None):
        self.token = token
        self.limits = EngineLimits.model_validate(
            limits
            or {"model": "fake", "k_max": 8, "max_num_seqs": 8, "max_num_batched_tokens": 2048, "max_model_len": 1024}
        )
        self.config: dict[str, Any] = LiveConfig().model_dump(mode="json")
        self.version = 1
        self.pid = 4242
        self.started_at = time.time()
        self.core_cpu: int | None = None  # the step loop's own CPU (--core-cpu), None: not pinned
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
        """``/control/state`` built through :class:`engine_host.schema.ControlState`."""
        spec = self.config["speculation"]
        k_next = 0 if spec["mode"] == "off" else spec["k"]
        state = ControlState(
            config_version=self.version,
            config=LiveConfig.model_validate(self.config),
            speculation={
                "mode": spec["mode"],
                "k_current": spec["k"],
                "k_next": k_next,
                "k": spec["k"],
                "k_min": spec["k_min"],
                "k_max": spec["k_max"],
                "k_max_engine": self.limits.k_max,
            },
            batch={
                "max_num_seqs": self.config["batch"]["max_num_seqs"] or self.limits.max_num_seqs,
                "max_num_batched_tokens": self.limits.max_num_batched_tokens,
                "running": 0,
                "waiting": 0,
            },
            limits=self.limits,
            controller={},
            engine={
                "pid": self.pid,
                "started_at": self.started_at,
                "core_pid": self.pid + 1,
                "core_started_at": self.started_at,
                "core_cpu": self.core_cpu,
                "phase": "ready",
            },
        )
        return state.model_dump(mode="json")

    def _put(self, body: Any) -> tuple[int, dict[str, Any]]:
        with self.lock:
            self.puts_arrived += 1
        if self.put_delay_s:
            time.sleep(self.put_delay_s)
        with self.lock:
            self.puts.append(body)
            if self.refuse:
                err = ConfigError(self.refuse)
                return err.status, _refusal(err)
            current = LiveConfig.model_validate(self.config)
            try:
                new = apply_patch(current, body, self.limits)
            except ConfigError as exc:
                return exc.status, _refusal(exc)
            old = self.version
            self.version += 1
            self.config = new.model_dump(mode="json")
            self.metrics.version.set(self.version)
            self.metrics.k.set(self.config["speculation"]["k"])
            spec = self.config["speculation"]
            answer = ApplyAnswer(
                config_version=self.version,
                previous_version=old,
                config=new,
                diff=diff_configs(current.model_dump(mode="json"), self.config),
                applied=True,
                apply_latency_ms=1.0,
                k_current=spec["k"],
                k_next=0 if spec["mode"] == "off" else spec["k"],
            )
            return 200, answer.model_dump(mode="json")

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
                    return self._send(
                        422, {"detail": [{"loc": ["body"], "msg": "malformed JSON"}], "message": "malformed JSON"}
                    )
                status, answer = fake._put(body)
                return self._send(status, answer)

        self._server = ThreadingHTTPServer(("127.0.0.1", self.port), Handler)
        self._server.daemon_threads = True
        # a short poll, so that stop() (shutdown() waits for the loop's next poll) returns at once
        threading.Thread(target=self._server.serve_forever, kwargs={"poll_interval": 0.02}, daemon=True).start()
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


def _bucket_of(value_s: float, bounds: tuple[float, ...] = FakeEngineMetrics.LATENCY_BUCKETS) -> str:
    lower = 0.0
    for b in bounds:
        if value_s <= b:
            return f"{lower!r}:{b!r}"
        lower = b
    return f"{lower!r}:inf"


def synthetic_sample(
    t: int,
    *,
    tokens_per_s: float = 100.0,
    busy: bool = True,
    k: float = 2.0,
    kv_cache_usage: float = 0.3,
    ttft_s: float = 0.05,
    itl_s: float = 0.02,
    queue_s: float = 0.001,
    acceptance: float = 0.6,
    requests: float = 2.0,
    running: float = 2.0,
    waiting: float = 0.0,
    mode: str = "fixed",
    config_version: int = 1,
    covered_s: float = 1.0,
) -> dict[str, Any]:
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
        hist = {
            "ttft": {_bucket_of(ttft_s): requests},
            "itl": {_bucket_of(itl_s): max(tokens - requests, 0.0)},
            "e2e": {_bucket_of(ttft_s + itl_s * tokens / max(requests, 1)): requests},
            "queue": {_bucket_of(queue_s): requests},
        }
    lat = {}
    for kind, v in (
        ("ttft", ttft_s),
        ("itl", itl_s),
        ("e2e", ttft_s + itl_s * tokens / max(requests, 1)),
        ("queue", queue_s),
    ):
        for p in ("p50", "p95", "p99"):
            lat[f"{kind}_{p}_ms"] = round(v * 1000.0, 3) if hist else None
    return {
        "resolution_s": 1,
        "t": int(t),
        "covered_s": covered_s,
        "busy_s": covered_s if busy else 0.0,
        "output_tokens": tokens,
        "user_output_tokens": tokens,
        "prompt_tokens": tokens / 2,
        "requests_finished": requests if busy else 0.0,
        "output_tokens_per_s": tokens / covered_s,
        **lat,
        "kv_cache_usage": kv_cache_usage,
        "kv_cache_usage_max": kv_cache_usage,
        "running": running if busy else 0.0,
        "running_max": running if busy else 0.0,
        "waiting": waiting,
        "waiting_max": waiting,
        "num_drafts": drafts,
        "draft_tokens": draft_tokens,
        "accepted_tokens": accepted,
        "acceptance_rate": acceptance if draft_tokens else None,
        "accepted_per_pos": per_pos,
        "acceptance_per_position": [round(acceptance ** (i + 1), 4) for i in range(int(k))] if per_pos else None,
        "k": k,
        "mode": mode,
        "config_version": config_version,
        "max_num_seqs": 8,
        "hist": hist,
    }
