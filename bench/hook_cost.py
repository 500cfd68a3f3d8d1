"""``python -m bench hook-cost``: the CPU time SpecPilot's scheduler hook adds to one engine step.

The hook (``engine_host.scheduler``) is combined here with a stand-in for vLLM's scheduler
that schedules ``--batch`` one-token decode requests and returns at once, so that the loop
measures only SpecPilot's own work per step: reading the config channel, the batch caps, the
step's K (``dynamic_sd_lookup``), the per-request gate, the step clock, the controller's
estimates (``SpeculationController.observe``) and the state published every 0.25 s. vLLM's own
scheduling, the model and the engine core's other threads are not in it.

Why: the hook's own clock (``overhead.hook_seconds`` in the published state) is wall time
inside its spans of the engine-core thread, and includes whatever holds that thread up there
(another thread of the process taking the GIL, the OS); ``overhead.hook_cpu_seconds`` is the
same thread's CPU time inside the same spans, which leaves those out. This benchmark gives the
code's own cost, for comparison with both clocks and with a step's time (docs/benchmarks.md,
docs/gpu.md).

Prints microseconds per step for each mode given, the hook's own clock over the same loop, and
with ``--profile`` the functions that take the time (cProfile).

``--cold MIB``: in an engine the model's and vLLM's work runs between two calls of the hook,
and the hook's code and data have left the CPU's caches by then; the hot loop alone misses
that. With ``--cold`` each step is preceded by a copy of MIB MiB and a little unrelated Python,
and only the steps themselves are timed.

``--acceptance A``: each draft token of the stand-in is accepted with probability A given the
ones before it were (seeded). With the default 0 nothing is, and the adaptive policy holds K at
0; with 0.8 it drafts, and its per-step path at K > 0 is what is timed (the mean K is printed).

The last column is the time per step in ``make_spec_decoding_stats``, which vLLM calls once per
request with drafts inside its own ``update_from_output``, before the hook's clock starts: the
hook's override of it (with the stand-in's, which does nothing) is part of what the hook costs
at K > 0, and it grows with the batch.

At ``fixed:0`` (and ``off``) the hook takes its lean path (``LEAN_SAMPLE`` in
``engine_host.scheduler``); ``SPECPILOT_K0_LEAN=0`` measures its full per-step path instead.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import tempfile
import time
import types
from typing import Any, Callable

#: Modes measured by default: speculation off inside the engine, a fixed K, adaptive.
DEFAULT_MODES = ("fixed:0", "fixed:4", "adaptive")


class _SchedulerStandIn:
    """The attributes and methods of vLLM's ``Scheduler`` the hook uses, doing no work."""

    def __init__(self, *args: Any, **kwargs: Any):
        self.vllm_config = types.SimpleNamespace(
            model_config=types.SimpleNamespace(model="stand-in", max_model_len=2048, hf_config=None),
            speculative_config=types.SimpleNamespace(method="ngram", num_speculative_tokens=4, draft_model_config=None),
        )
        self.scheduler_config = types.SimpleNamespace(max_num_batched_tokens=8192)
        self.max_num_running_reqs = 64
        self.max_num_scheduled_tokens = 8192
        self.num_spec_tokens = 4
        self.running: list[Any] = []
        self.waiting: list[Any] = []
        self.requests: dict[str, Any] = {}
        self.finished_req_ids: set[str] = set()  # since the last schedule(), as vLLM names them
        self.busy = True  # what has_requests() answers (False: the engine waits for work)
        self.current_step = 0  # vLLM's count of schedule() calls

    def has_requests(self) -> bool:
        return self.busy

    def add_request(self, request: Any) -> None:
        self.running.append(request)
        self.requests[request.request_id] = request

    def finish_request(self, req_id: str) -> None:
        """End request ``req_id``; the next :meth:`schedule`'s output names it, as vLLM's does."""
        self.running = [r for r in self.running if r.request_id != req_id]
        self.requests.pop(req_id, None)
        self.finished_req_ids.add(req_id)

    def schedule(self) -> Any:
        self.current_step += 1
        k = self.dynamic_sd_lookup[len(self.running)]  # type: ignore[attr-defined]
        spec = {r.request_id: [-1] * k for r in self.running} if k else {}
        finished, self.finished_req_ids = self.finished_req_ids, set()
        return types.SimpleNamespace(
            num_spec_tokens_to_schedule=k,
            num_scheduled_tokens={r.request_id: 1 + k for r in self.running},
            total_num_scheduled_tokens=len(self.running) * (1 + k),
            scheduled_spec_decode_tokens=spec,
            finished_req_ids=finished,
        )

    def update_from_output(self, scheduler_output: Any, model_runner_output: Any) -> dict:
        return {}

    def make_spec_decoding_stats(self, *args: Any, **kwargs: Any) -> None:
        return None


class _Evictor:
    """Stands in for what runs on the engine core's CPU between two engine steps: copies
    ``mib`` MiB (the hook's code and data leave the caches) and then runs a little
    unrelated Python (the interpreter itself is warm again, as after vLLM's own code)."""

    def __init__(self, mib: int):
        self.src = bytearray(mib << 20)
        self.dst = bytearray(mib << 20)

    def __call__(self) -> int:
        self.dst[:] = self.src
        objs = [types.SimpleNamespace(a=i, b=[i] * 4, c={"x": i}) for i in range(50)]
        total = sum(o.a + len(o.b) + o.c["x"] for o in objs)
        json.dumps({"k": [o.a for o in objs]})
        return total


def standin_hook(mode: str, batch: int, folder: str, async_scheduling: bool = False) -> tuple[Any, Any]:
    """SpecPilot's scheduler hook on :class:`_SchedulerStandIn`, configured to ``mode`` through
    a config channel in ``folder``, with ``batch`` running decode requests; with
    ``async_scheduling`` as on vLLM's ``AsyncScheduler`` (``SpecPilotAsyncScheduler``: drafts
    are not dropped request by request, the per-request gate probes all requests at once).

    Returns:
        ``(hook, channel)``; close the channel when done.
    Raises:
        BenchError: an unknown mode.
    """
    from bench.engine_control import mode_patch
    from engine_host import envs
    from engine_host.channel import Channel
    from engine_host.config import LiveConfig
    from engine_host.scheduler import _SpecPilotHook

    class Hook(_SpecPilotHook, _SchedulerStandIn):
        GATE_DRAFTS = not async_scheduling

    patch = mode_patch(mode)
    path = os.path.join(folder, "channel")
    channel = Channel(path, create=True)
    cfg = LiveConfig().model_dump(mode="json")
    for key, value in patch.get("speculation", {}).items():
        if isinstance(value, dict):
            cfg["speculation"][key] = {**cfg["speculation"].get(key, {}), **value}
        elif value is not None:
            cfg["speculation"][key] = value
    channel.write_config(1, cfg)
    old = os.environ.get(envs.CHANNEL)
    os.environ[envs.CHANNEL] = path
    try:
        hook = Hook()
    finally:
        if old is None:
            os.environ.pop(envs.CHANNEL, None)
        else:
            os.environ[envs.CHANNEL] = old
    for i in range(batch):  # past the hook's add_request: these requests name no class for the gate
        _SchedulerStandIn.add_request(hook, standin_request(f"r{i}", i))
    return hook, channel


def staggered_births(running: list[Any], turnover: int) -> dict[str, int]:
    """Step index (steps) each of ``running`` started at, spread over ``-turnover .. 0`` so that
    with :func:`turn_over` about ``len(running) / turnover`` of them finish per step."""
    return {r.request_id: -i * turnover // max(len(running), 1) for i, r in enumerate(running)}


def turn_over(
    hook: Any,
    born: dict[str, int],
    now: int,
    turnover: int,
    new_request: Callable[[], Any],
    add: Callable[[Any], None] | None = None,
) -> None:
    """Finish every request of the stand-in ``hook`` that has run ``turnover`` steps or more
    by step ``now`` (:meth:`_SchedulerStandIn.finish_request`: the next ``schedule()`` names
    it) and put ``new_request()``'s request in its place through ``add`` (default
    ``hook.add_request``, which names its class for the gate), recorded in ``born`` as started
    at ``now``. Nothing happens with ``turnover`` 0."""
    if turnover <= 0:
        return
    add = add or hook.add_request
    for r in [r for r in hook.running if now - born[r.request_id] >= turnover]:
        hook.finish_request(r.request_id)
        born.pop(r.request_id)
        fresh = new_request()
        add(fresh)
        born[fresh.request_id] = now


def standin_request(req_id: str, i: int) -> Any:
    """A running decode request of the stand-in; odd ``i`` sampled (temperature 0.7), even greedy
    (the class the hook names for the gate when it is added through ``hook.add_request``)."""
    return types.SimpleNamespace(
        request_id=req_id,
        spec_token_ids=[],
        num_output_tokens=8,
        num_computed_tokens=200,
        sampling_params=types.SimpleNamespace(temperature=0.7 if i % 2 else 0.0),
    )


def measure(
    mode: str,
    batch: int,
    steps: int,
    profile: bool = False,
    cold_mib: int = 0,
    async_scheduling: bool = False,
    acceptance: float = 0.0,
    turnover: int = 0,
) -> dict[str, float]:
    """Run ``steps`` hook steps at ``batch`` decode requests in ``mode`` (``fixed:K``,
    ``adaptive``, ``off``); with ``cold_mib`` > 0 the caches are made cold between steps
    (:class:`_Evictor`), as in an engine, where the model's and vLLM's work runs between
    two calls of the hook; ``async_scheduling``: see :func:`standin_hook`. Each draft token
    is accepted with probability ``acceptance`` (fraction 0..1) given the ones before it
    were (seeded, so runs compare): above about 0.3 the adaptive policy drafts, and its
    per-step path at K > 0 is what is measured. With ``turnover`` > 0 (steps) each request
    finishes after that many steps and a new one takes its place (staggered, so about
    ``batch / turnover`` finish per step), as in an engine serving a stream of requests: what
    the gate does with finished requests (the mixture prior's window and its fits) is then in
    the measurement; with 0 the same requests run throughout.

    Returns:
        ``{"mean_k": the mean K (tokens) of the steps scheduled, over the whole run,
        "us_per_step": wall µs per step of the whole loop, "hook_clock_us_per_step": the
        hook's own clock per step, "hook_cpu_us_per_step": its thread's CPU time inside the
        same spans, per step, "verify_us_per_step": wall µs per step in
        ``make_spec_decoding_stats``, which vLLM calls once per request with drafts inside its
        ``update_from_output``, outside the hook's clock, "requests_finished": requests that
        finished over the whole run, warm-up steps included (``turnover``)}``.
    Raises:
        BenchError: an unknown mode.
    """
    with tempfile.TemporaryDirectory() as d:
        hook, channel = standin_hook(mode, batch, d, async_scheduling)
        rng = random.Random(0)

        def accepted(n: int) -> int:
            a = 0
            while a < n and rng.random() < acceptance:
                a += 1
            return a

        verify_s = [0.0]  # time in make_spec_decoding_stats (the hook's override and the stand-in's)
        born = staggered_births(hook.running, turnover)
        count = [0, len(hook.running)]  # steps so far, requests so far

        def new_request() -> Any:
            count[1] += 1
            return standin_request(f"r{count[1] - 1}", count[1] - 1)

        def step() -> None:
            hook.has_requests()
            out = hook.schedule()
            spec = out.scheduled_spec_decode_tokens
            if spec:
                judged = [(rid, len(d), accepted(len(d))) for rid, d in spec.items()]
                t = time.perf_counter()
                for rid, n, a in judged:
                    hook.make_spec_decoding_stats(None, n, a, request_id=rid)
                verify_s[0] += time.perf_counter() - t
            hook.update_from_output(out, None)
            count[0] += 1
            turn_over(hook, born, count[0], turnover, new_request)

        for _ in range(200):  # warm
            step()
        verify_s[0] = 0.0
        hook._overhead_s = 0.0
        hook._overhead_cpu_s = 0.0
        prof = None
        if profile:
            import cProfile

            prof = cProfile.Profile()
            prof.enable()
        if cold_mib > 0:
            evict = _Evictor(cold_mib)
            wall = 0.0
            for _ in range(steps):
                evict()
                t = time.perf_counter()
                step()
                wall += time.perf_counter() - t
        else:
            t = time.perf_counter()
            for _ in range(steps):
                step()
            wall = time.perf_counter() - t
        if prof is not None:
            import pstats

            prof.disable()
            pstats.Stats(prof, stream=sys.stdout).sort_stats("tottime").print_stats(12)
        channel.close()
        hook._flush_lean()  # steps the lean path has not handed to the controller yet
        ks = hook.controller.steps_at_k
        return {
            "mean_k": sum(k * n for k, n in enumerate(ks)) / max(sum(ks), 1),
            "us_per_step": wall / steps * 1e6,
            "hook_clock_us_per_step": hook._overhead_s / steps * 1e6,
            "hook_cpu_us_per_step": hook._overhead_cpu_s / steps * 1e6,
            "verify_us_per_step": verify_s[0] / steps * 1e6,
            "requests_finished": count[1] - batch,
        }


def main(argv: list[str] | None = None) -> int:
    """Command line; see the module docstring."""
    ap = argparse.ArgumentParser(
        prog="python -m bench hook-cost", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--modes", default=",".join(DEFAULT_MODES), help="comma-separated modes (fixed:K, adaptive, off)")
    ap.add_argument("--batch", default="1,8,64", help="comma-separated decode batch sizes (requests)")
    ap.add_argument("--steps", type=int, default=20000, help="steps per measurement")
    ap.add_argument("--profile", action="store_true", help="also print where the time goes (cProfile)")
    ap.add_argument(
        "--cold",
        type=int,
        default=0,
        metavar="MIB",
        help="make the CPU caches cold between steps by copying MIB MiB (e.g. 64), as the model's and "
        "vLLM's work does in an engine; 0 (default): the loop runs hot",
    )
    ap.add_argument(
        "--async-scheduling",
        action="store_true",
        help="the hook as on vLLM's async scheduler (GPU engines): the per-request gate probes all "
        "requests at once, and the adaptive policy rests on the lean path while it holds K at 0",
    )
    ap.add_argument(
        "--turnover",
        type=int,
        default=0,
        metavar="STEPS",
        help="each request finishes after STEPS steps and a new one (greedy and sampled in turn) takes "
        "its place, staggered; 0 (default): the same requests run throughout",
    )
    ap.add_argument(
        "--acceptance",
        type=float,
        default=0.0,
        metavar="A",
        help="each draft token is accepted with probability A (0..1) given the ones before it were; "
        "0 (default): none is, and the adaptive policy rests at K = 0; 0.8: it drafts",
    )
    args = ap.parse_args(argv)
    from bench.engine_control import BenchError

    try:
        batches = [int(b) for b in args.batch.split(",") if b.strip()]
        modes = [m.strip() for m in args.modes.split(",") if m.strip()]
        if not batches or min(batches) < 1 or args.steps < 1:
            raise ValueError("--batch needs sizes >= 1 and --steps >= 1")
        if args.cold < 0:
            raise ValueError("--cold needs MiB >= 0")
        if not 0.0 <= args.acceptance <= 1.0:
            raise ValueError("--acceptance needs a fraction in 0..1")
        if args.turnover < 0:
            raise ValueError("--turnover needs steps >= 0")
        print(
            "| mode | batch | mean K (tokens) | µs per step (CPU, loop) | hook's own clock µs per step "
            "| its CPU time µs per step | make_spec_decoding_stats µs per step |"
        )
        print("|---|---:|---:|---:|---:|---:|---:|")
        for mode in modes:
            for b in batches:
                r = measure(
                    mode, b, args.steps, args.profile, args.cold, args.async_scheduling, args.acceptance, args.turnover
                )
                print(
                    f"| {mode} | {b} | {r['mean_k']:.2f} | {r['us_per_step']:.1f} | {r['hook_clock_us_per_step']:.1f} "
                    f"| {r['hook_cpu_us_per_step']:.1f} | {r['verify_us_per_step']:.1f} |"
                )
    except (ValueError, BenchError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
