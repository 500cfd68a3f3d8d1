"""``python -m bench policy-bursts``: which steps the adaptive policy drafts in, burst by burst,
on the scheduler hook without vLLM.

Bursts of ``--batch`` decode requests of two kinds follow each other in ``--pattern`` order,
the engine drained between bursts: in a burst of kind ``r`` every draft is rejected, in a burst
of kind ``q`` (requests that quote their prompt) ``--accepted`` tokens of each draft are
accepted. The hook (``engine_host.scheduler``) runs on the stand-in scheduler of
``python -m bench hook-cost`` in ``adaptive`` mode (``--mode``) with its config's defaults, as under vLLM's
``AsyncScheduler`` unless ``--sync``: a step verifies the drafts proposed at the K of the step
before it. Each burst's requests are new. Prints, per kind, the steps at K > 0 of each burst
after ``--settle`` bursts.

The hook's clocks advance 0.1 ms per reading and ``--step-ms`` per step (the model's forward,
outside the hook: a step that runs more of the hook's code takes longer, the same in every run),
so the figures are the same on every machine; they say what the policy decides, not what a step
costs on an engine. On a GPU host the same pattern is
measured by ``python -m bench paired`` with bursts of one workload each (docs/gpu.md).
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import statistics
import sys
import tempfile
import types
from typing import Any, Callable, Iterator

from bench.engine_control import BenchError
from bench.hook_cost import _SchedulerStandIn, staggered_births, standin_request, turn_over

KINDS = {"r": "drafts rejected", "q": "drafts accepted (quotes)"}


@contextlib.contextmanager
def _tick_clock(step_s: float = 0.0) -> Iterator[Callable[[], None]]:
    """The scheduler hook's clocks (wall, thread CPU, monotonic) as one counter that advances
    0.1 ms per reading, restored afterwards; yields a function that moves it on by ``step_s``
    (s), called once per step (what the step takes outside the hook)."""
    import engine_host.scheduler as scheduler_module

    ticks = itertools.count()
    moved = [0.0]

    def now() -> float:
        return 1000.0 + next(ticks) * 1e-4 + moved[0]

    def advance() -> None:
        moved[0] += step_s

    saved = scheduler_module.time
    scheduler_module.time = types.SimpleNamespace(perf_counter=now, thread_time=now, monotonic=now, time=now)  # type: ignore[assignment]
    try:
        yield advance
    finally:
        scheduler_module.time = saved


def _burst(
    hook: Any,
    steps: int,
    accepted: int,
    async_order: bool,
    turnover: int = 0,
    tag: str = "",
    advance: Callable[[], None] = lambda: None,
) -> int:
    """``steps`` steps of the hook's running requests, each draft with ``accepted`` tokens
    accepted, then one step with none running (drained); returns the steps scheduled at K > 0.
    With ``turnover`` > 0 each request finishes after that many steps (staggered) and a new
    one (ids ``TAG-tN``) takes its place, as with closed-loop clients; vLLM names the
    finished ones in the next step's output. ``advance`` runs after each step is scheduled
    (the clock's step, :func:`_tick_clock`)."""
    drafted = 0
    prev_k = 0
    pending: tuple[Any, int] | None = None
    born = staggered_births(hook.running, turnover)
    ids = itertools.count()

    def add(request: Any) -> None:  # past the hook's add_request: the bursts' requests name no class
        _SchedulerStandIn.add_request(hook, request)

    for step_n in range(steps):
        turn_over(hook, born, step_n, turnover, lambda: standin_request(f"{tag}-t{next(ids)}", 0), add)
        hook.has_requests()
        out = hook.schedule()
        advance()
        k = out.num_spec_tokens_to_schedule
        drafted += k > 0
        step: tuple[Any, int] | None = (out, prev_k)
        prev_k = k
        if async_order:  # step i + 1 is scheduled before step i's output is handed back
            step, pending = pending, step
            if step is None:
                continue
        assert step is not None
        out_i, verified = step
        if verified:
            for req in hook.running:
                hook.make_spec_decoding_stats(None, verified, min(accepted, verified), request_id=req.request_id)
        hook.update_from_output(out_i, None)
    running, hook.running = hook.running, []
    hook.has_requests()
    out = hook.schedule()
    out.finished_req_ids = {req.request_id for req in running}  # as vLLM names them in the next step
    hook.update_from_output(out, None)
    hook.running = running
    return drafted


def run(
    batch: int,
    steps: int,
    pattern: str,
    repeat: int,
    accepted: int,
    async_scheduling: bool,
    mode: str = "adaptive",
    price: tuple[float, float] | None = None,
    turnover: int = 0,
    step_ms: float = 2.0,
) -> dict[str, list[int]]:
    """Steps at K > 0 of each burst, per kind (``r``, ``q``), over ``repeat`` repetitions of
    ``pattern``, the hook in ``mode`` (``adaptive``, ``adaptive_pooled``, ...). ``price``:
    ``(draft_token_cost, step_cost)`` (fractions of a plain step) the per-request gate prices
    drafting at instead of the step-time model's figures (``_gate_costs``), which on the
    stand-in say what its tick clock measures, not what a step costs on an engine.
    ``turnover``: steps after which each request finishes and a new one of the same kind takes
    its place (0: a burst's requests run throughout). ``step_ms``: what a step takes outside the
    hook (ms, >= 0; 2 ms: a decode step at a small batch on an H200, docs/gpu.md).

    Raises:
        ValueError: a kind outside ``r``/``q`` in ``pattern``, a size below 1, or a negative ``step_ms``.
    """
    if not pattern or set(pattern) - set(KINDS):
        raise ValueError(f"--pattern takes the letters r and q only, got {pattern!r}")
    if batch < 1 or steps < 1 or repeat < 1 or accepted < 0 or turnover < 0 or step_ms < 0:
        raise ValueError("--batch, --steps and --repeat need values >= 1, --accepted, --turnover and --step-ms >= 0")
    from bench.hook_cost import standin_hook

    out: dict[str, list[int]] = {k: [] for k in KINDS}
    with tempfile.TemporaryDirectory() as folder, _tick_clock(step_ms / 1e3) as advance:
        hook, channel = standin_hook(mode, batch, folder, async_scheduling=async_scheduling)
        if price is not None:
            hook._gate_costs = lambda b, k: price
        try:
            for n, kind in enumerate(pattern * repeat):
                # each burst's requests are new, as on an engine: a request's own estimate starts
                # where the requests before it leave its class's prior (engine_host.request_gate)
                hook.running = [standin_request(f"b{n}-r{i}", 0) for i in range(batch)]
                hook.requests = {r.request_id: r for r in hook.running}
                drafted = _burst(
                    hook, steps, accepted if kind == "q" else 0, async_scheduling, turnover, f"b{n}", advance
                )
                out[kind].append(drafted)
        finally:
            channel.close()
    return out


def main(argv: list[str] | None = None) -> int:
    """Command line; see the module docstring."""
    ap = argparse.ArgumentParser(
        prog="python -m bench policy-bursts", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--batch", type=int, default=48, help="decode requests per burst (default: 48)")
    ap.add_argument("--steps", type=int, default=290, help="steps per burst (default: 290, host 27's at 64 clients)")
    ap.add_argument(
        "--pattern",
        default="qrr",
        help="burst kinds in order, repeated: q = drafts accepted (quotes), r = rejected (default: qrr, "
        "as docs, code, shift on host 27)",
    )
    ap.add_argument("--repeat", type=int, default=11, help="repetitions of the pattern (default: 11)")
    ap.add_argument("--settle", type=int, default=3, help="bursts left out of the figures at the start (default: 3)")
    ap.add_argument("--accepted", type=int, default=2, help="tokens accepted of each draft in a q burst (default: 2)")
    ap.add_argument(
        "--turnover",
        type=int,
        default=0,
        metavar="STEPS",
        help="each request finishes after STEPS steps and a new one of the burst's kind takes its place "
        "(closed-loop clients); 0 (default): a burst's requests run throughout",
    )
    ap.add_argument(
        "--step-ms",
        type=float,
        default=2.0,
        help="what a step takes outside the hook, ms (default: 2.0, a decode step at a small batch on an H200)",
    )
    ap.add_argument("--sync", action="store_true", help="synchronous scheduling (the CPU build) instead of async")
    ap.add_argument(
        "--mode",
        default="adaptive",
        help="the hook's mode (bench mode string; default: adaptive; adaptive_pooled: the per-request gate's "
        "pooled prior)",
    )
    ap.add_argument(
        "--price",
        metavar="TOKEN,STEP",
        help="the per-request gate's price of one verified draft token and of a step at K > 0, fractions of a "
        "plain step (e.g. 0.02,0.29: one request on an H200, docs/gpu.md host 30), instead of what the "
        "stand-in's clock gives",
    )
    args = ap.parse_args(argv)
    price = None
    if args.price:
        try:
            token_cost, step_cost = (float(v) for v in args.price.split(","))
        except ValueError:
            print(f"error: --price takes TOKEN,STEP, two fractions, got {args.price!r}", file=sys.stderr)
            return 2
        if token_cost < 0 or step_cost < 0:
            print("error: --price takes costs >= 0", file=sys.stderr)
            return 2
        price = (token_cost, step_cost)
    if not args.mode.startswith("adaptive"):
        print(
            f"error: --mode takes an adaptive mode (adaptive, adaptive_pooled...), got {args.mode!r}", file=sys.stderr
        )
        return 2
    try:
        res = run(
            args.batch,
            args.steps,
            args.pattern,
            args.repeat,
            args.accepted,
            not args.sync,
            args.mode,
            price,
            args.turnover,
            args.step_ms,
        )
    except (ValueError, BenchError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    kinds = args.pattern * args.repeat
    priced = "" if price is None else f", drafting priced at {price[0]} / {price[1]}"
    if args.turnover:
        priced += f", each request replaced after {args.turnover} steps"
    print(
        f"{args.mode}, {args.batch} requests, {args.steps} steps per burst, {'sync' if args.sync else 'async'} "
        f"scheduling{priced}; steps at K > 0 per burst after the first {args.settle} bursts:\n"
    )
    print("| bursts | kind | mean | min | max | each |")
    print("|---:|---|---:|---:|---:|---|")
    for kind, label in KINDS.items():
        # the kind's bursts after the settle: their positions in the whole sequence
        positions = [i for i, c in enumerate(kinds) if c == kind]
        seen = [n for n, i in zip(res[kind], positions) if i >= args.settle]
        if not seen:
            continue
        each = ", ".join(str(n) for n in seen)
        print(f"| {len(seen)} | {label} | {statistics.mean(seen):.1f} | {min(seen)} | {max(seen)} | {each} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
