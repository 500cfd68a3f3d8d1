"""One benchmark cell: switch the engine to a mode, drive a workload at a load for a
while, and gather client-side latencies, vLLM's acceptance counters and K over time.

The result of :func:`run_cell` is a JSON-able dict (written by ``python -m bench run``
as ``<out>/<label>.json``); :mod:`bench.report` turns results into tables and charts.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import asdict, dataclass, field
from typing import Any, Callable

from .engine_control import EngineControl, StateSampler, mean_k, mode_patch, overhead_delta, steps_at_k_delta
from .loadgen import Load, run_load
from .metrics import SLO, RequestRecord, acceptance_from_counters, makespan_s, summarize, tokens_per_second_series
from .workloads import Workload

SAMPLE_FIELDS = (
    "k",
    "mode",
    "output_tokens_per_s",
    "acceptance_rate",
    "running",
    "waiting",
    "draft_tokens",
    "accepted_tokens",
    "kv_cache_usage",
)
CONTROLLER_FIELDS = (
    "mode",
    "k_current",
    "k_bounds",
    "batch_size",
    "acceptance_rate",
    "acceptance_per_position",
    "conditional_acceptance",
    "acceptance_changes_detected",
    "expected_tokens_per_step",
    "step_time_ms",
    "step_time_model",
    "predicted_goodput_tokens_per_s",
    "steps_at_k",
    "total_steps",
    "policy",
)


@dataclass
class CellSpec:
    """What to run.

    Attributes:
        workload: ``code``, ``docs``, ``chat`` or ``shift``.
        mode: mode string (see :mod:`bench.engine_control`).
        load: offered load.
        duration_s: measurement window (s).
        max_tokens: output cap per request (tokens).
        seed: prompt order, chat sampling seeds and Poisson arrivals.
        shift_period_s: seconds per phase of the shift workload.
        slo: goodput's service-level objective.
        settle_s: pause after the mode switch before the load starts (s).
        ramp_s: the load runs this long before the measured window opens (s), so that the
            window sees a filled batch rather than the start-up burst of prefills; tokens,
            latencies, acceptance counters and K are taken over the window only.
        num_requests: fixed work instead of a time window: the cell sends exactly this many
            requests (the same prompts for every mode) and lasts until all have finished;
            tokens/s is output tokens over that makespan (vLLM ``benchmark_serving``'s
            definition), ``duration_s`` and ``ramp_s`` are then unused.
        shift_period_requests: fixed work, ``shift`` workload: requests per phase.
        timeout_s: fixed work: a cell still running after this long is cut (s).
        load_label: a name for the load (``low``/``medium``/``high`` in a matrix).
        keep_requests: put every request's record in the result.
    """

    workload: str
    mode: str
    load: Load
    duration_s: float = 30.0
    max_tokens: int = 128
    seed: int = 0
    shift_period_s: float = 10.0
    slo: SLO = field(default_factory=SLO)
    settle_s: float = 1.0
    ramp_s: float = 0.0
    num_requests: int | None = None
    shift_period_requests: int = 8
    timeout_s: float = 1800.0
    load_label: str | None = None
    keep_requests: bool = True

    @property
    def label(self) -> str:
        """File-name-safe label ``<workload>-<load>-<mode>``."""
        load = self.load_label or self.load.describe()
        return f"{self.workload}-{load}-{self.mode}".replace(":", "").replace("/", "").replace("=", "")


ProgressFn = Callable[[float, list[RequestRecord]], None]


def _trim_samples(samples: list[dict[str, Any]], t0_unix: float) -> list[dict[str, Any]]:
    out = []
    for s in samples:
        row = {"t_s": round(float(s["t"]) - t0_unix, 3)}
        row.update({k: s.get(k) for k in SAMPLE_FIELDS})
        out.append(row)
    return out


async def run_cell(
    control: EngineControl,
    spec: CellSpec,
    model: str | None = None,
    api_key: str | None = None,
    progress: ProgressFn | None = None,
) -> dict[str, Any]:
    """Run one cell against the engine behind ``control``.

    Returns:
        The result document: ``spec``, ``engine``, ``apply`` (the engine's answer to
        the mode switch), ``client`` (:func:`bench.metrics.summarize`), ``acceptance``
        (:func:`bench.metrics.acceptance_from_counters`), ``k`` (steps at each K,
        step-weighted mean K, polled timeline), ``server_samples`` (per-second samples
        from ``/control/samples``, ``t_s`` relative to the run start), ``throughput_series``
        (client-side tokens/s per second), ``controller_end`` and ``overhead`` (from
        ``/control/state`` after the run; cumulative since the engine started),
        ``overhead_window`` (the hook's own time inside this cell's window,
        :func:`bench.engine_control.overhead_delta`) and ``requests``.
    """
    model = model or await control.served_model()
    applied = await control.apply_mode(spec.mode)
    if spec.settle_s > 0:
        await asyncio.sleep(spec.settle_s)
    fixed_work = spec.num_requests is not None
    workload = Workload(
        spec.workload,
        seed=spec.seed,
        period_s=spec.shift_period_s,
        period_requests=spec.shift_period_requests if fixed_work else None,
    )
    ramp = 0.0 if fixed_work else max(0.0, spec.ramp_s)
    t0 = time.perf_counter()
    t0_unix = time.time()
    at_open: dict[str, Any] = {}

    async def open_window() -> None:  # counters and controller state when the window opens
        if ramp > 0:
            await asyncio.sleep(ramp - (time.perf_counter() - t0))
        at_open["counters"] = await control.counters()
        at_open["state"] = await control.state()

    opening = asyncio.create_task(open_window())
    sampler = StateSampler(control, t0)
    sampling = asyncio.create_task(sampler.run())
    try:
        run_s = spec.timeout_s if fixed_work else ramp + spec.duration_s
        records, _ = await run_load(
            control.url,
            model,
            workload,
            spec.load,
            run_s,
            spec.max_tokens,
            seed=spec.seed,
            api_key=api_key,
            t0=t0,
            progress=progress,
            num_requests=spec.num_requests,
        )
    finally:
        sampling.cancel()
        await asyncio.gather(sampling, return_exceptions=True)
    await opening
    before = at_open["counters"]
    window_s = makespan_s(records) if fixed_work else spec.duration_s
    window_end_unix = t0_unix + ramp + window_s
    after = await control.counters()
    state_end = await control.state()
    await asyncio.sleep(1.05)  # let the sample ring close the last second of the window
    samples = [s for s in await control.samples(t0_unix - 1.0) if float(s["t"]) < window_end_unix]

    steps = steps_at_k_delta(at_open["state"], state_end)
    ctl = state_end.get("controller") or {}
    spec_state = state_end.get("speculation") or {}
    return {
        "label": spec.label,
        "spec": {
            "workload": spec.workload,
            "mode": spec.mode,
            "mode_patch": mode_patch(spec.mode),
            "load": {"label": spec.load_label, "rate_per_s": spec.load.rate, "concurrency": spec.load.concurrency},
            "duration_s": spec.duration_s,
            "max_tokens": spec.max_tokens,
            "seed": spec.seed,
            "shift_period_s": spec.shift_period_s if spec.workload == "shift" else None,
            "settle_s": spec.settle_s,
            "ramp_s": ramp,
            "num_requests": spec.num_requests,
            "shift_period_requests": spec.shift_period_requests if fixed_work and spec.workload == "shift" else None,
            "window_s": round(window_s, 3),
        },
        "started_at_unix": round(t0_unix, 3),
        # time.perf_counter() (CLOCK_MONOTONIC on Linux: the engine core's clock on the same
        # host) at the window's start and end, to match $SPECPILOT_STEP_TRACE rows to cells
        "window_perf_s": [round(t0 + ramp, 6), round(t0 + ramp + window_s, 6)],
        "engine": {
            "url": control.url,
            "model": model,
            "k_max_engine": spec_state.get("k_max_engine"),
            "method": spec_state.get("method"),
            "config_version": state_end.get("config_version"),
            "limits": state_end.get("limits"),
        },
        "apply": {k: applied.get(k) for k in ("config_version", "k_current", "apply_latency_ms", "applied")},
        "client": summarize(records, window_s, spec.slo, start_s=ramp),
        "acceptance": acceptance_from_counters(before, after),
        "k": {
            "steps_at_k": steps,
            "mean_k_steps": mean_k(steps),
            "timeline": [asdict(p) for p in sampler.points],
            "mean_k_polled": (
                round(
                    sum(p.k for p in sampler.points if p.k is not None)
                    / max(1, sum(1 for p in sampler.points if p.k is not None)),
                    3,
                )
                if sampler.points
                else None
            ),
        },
        "server_samples": _trim_samples(samples, t0_unix),
        "throughput_series": tokens_per_second_series(records, ramp + window_s),
        "workload_series": _workload_series(records),
        "controller_end": {k: ctl.get(k) for k in CONTROLLER_FIELDS if k in ctl},
        "overhead": state_end.get("overhead"),
        "overhead_window": overhead_delta(at_open["state"], state_end),
        "requests": [r.to_json() for r in records] if spec.keep_requests else None,
    }


def _workload_series(records: list[RequestRecord]) -> list[list[Any]]:
    """``[[sent_s, base workload], ...]`` where the base workload changes (for shift charts)."""
    out: list[list[Any]] = []
    for r in records:
        if not out or out[-1][1] != r.workload:
            out.append([round(r.sent_s, 3), r.workload])
    return out


def headline(result: dict[str, Any]) -> dict[str, Any]:
    """The figures of one result that go in a summary row (units in the keys)."""
    c, a, k = result["client"], result["acceptance"], result["k"]
    return {
        "workload": result["spec"]["workload"],
        "load": result["spec"]["load"]["label"]
        or (
            f"rate={result['spec']['load']['rate_per_s']}"
            if result["spec"]["load"]["rate_per_s"]
            else f"conc={result['spec']['load']['concurrency']}"
        ),
        "mode": result["spec"]["mode"],
        "output_tokens_per_s": c["output_tokens_per_s"],
        "goodput_tokens_per_s": c["goodput_tokens_per_s"],
        "ttft_p50_ms": c["ttft_ms"]["p50"],
        "ttft_p95_ms": c["ttft_ms"]["p95"],
        "ttft_p99_ms": c["ttft_ms"]["p99"],
        "itl_mean_ms": c["itl_ms"]["mean"],
        "itl_p50_ms": c["itl_ms"]["p50"],
        "itl_p95_ms": c["itl_ms"]["p95"],
        "itl_p99_ms": c["itl_ms"]["p99"],
        "e2e_p50_ms": c["e2e_ms"]["p50"],
        "e2e_p95_ms": c["e2e_ms"]["p95"],
        "e2e_p99_ms": c["e2e_ms"]["p99"],
        "requests_finished": c["requests"]["finished"],
        "acceptance_rate": a["acceptance_rate"],
        "mean_acceptance_length": a["mean_acceptance_length"],
        "mean_k": k["mean_k_steps"],
        # the scheduler hook's CPU time as a fraction 0..1 of the engine's busy time in the
        # window (None for plain `vllm serve`, which has no hook)
        "hook_cpu_share": (result.get("overhead_window") or {}).get("cpu_fraction"),
    }
