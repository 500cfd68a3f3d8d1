"""``python -m bench step-trace``: the wall time of an engine step by the K it verified and proposed.

Reads the files an engine host writes with ``$SPECPILOT_STEP_TRACE`` set
(``engine_host.step_trace``: one row per step output, times of the engine core's clock) and
measures each step of a busy decode stretch as the interval between its output and the
previous step's output. Under async scheduling that interval is the later step's wall time
whatever overlaps what; with synchronous scheduling it also holds the engine core's work
between the steps, which a step at K > 0 adds to as well.

Only intervals between two pure-decode steps with the same number of requests count (a
prefill, a request's end or an idle spell in between would stretch them), and only those
shorter than ``--max-gap-ms``.

With ``--cells`` (a ``bench matrix`` results folder, run on the engine's host: the cells record
their window on the same clock) it first prints one row per cell. With ``--paired RESULT --arm
ARM`` (a ``bench paired`` result whose arm ARM was the traced engine) the same per cell of the
result, at ``--requests`` batch sizes: the arm's bursts are matched in order to the run of the
trace's bursts whose step counts agree with each burst's ``steps_at_k`` (the latest such run),
then where each burst's time went, the probes, and which of the scheduler hook's rules set K
(``rule_table``, where the trace records the rule).

Prints, per batch size (requests): steps, median, mean and 90th percentile ms per step by
the K the step verified (``k_drafted``), by the K chosen in the step for the next drafts
(``k_proposed``), and by the transition from the previous step's verified K. First, per
range of batch sizes, every step of the trace: how many verified drafts (K > 0), and the
median ms of a pure-decode step after another of the same batch (the rows above) against
one right after a prefill or a change of batch (under async scheduling the new request's
inputs are prepared then), each at K = 0 and K > 0. Where the trace records them (``path``,
``vllm_schedule_us``, ``vllm_update_us``), then per range and hook path (``lean``, ``full``) the
median time of vLLM's own ``schedule()`` and ``update_from_output()`` (``vllm_table``): whether
vLLM's work per step, outside the hook's clock, grows with the hook's path. Where the trace records each step's CUDA
graph mode (the engine host runs vLLM with ``--cudagraph-metrics`` on a GPU while tracing), also
by K verified and graph mode (``FULL``, ``PIECEWISE``, ``NONE``): a decode step that missed its
FULL graph costs more at any K. With ``--lone N``, also each request that ran alone and drafted
(``lone_table``): how many of its steps drafted, what they had accepted, and where the trace
records it the per-request gate's estimate. With ``--against TRACE`` (engines side by side on one
host), each other engine's K = 0 steps against the first file's burst by burst (``matched_table``):
the host's speed moves between bursts by more than engines differ, and a median over a whole run
mixes the two. Where the trace records the CPU the engine core ran on (``cpu``), each burst's median
step by the CPU most of it ran on (``cpu_table``). With ``--gpu-clocks FILE`` (``python -m bench
gpu-clocks`` sampling the GPU meanwhile), each burst's median step by the GPU's SM clock during it
(``clock_table``).

Example::

    SPECPILOT_STEP_TRACE=/tmp/steps.csv python -m engine_host ...   # then load it
    python -m bench step-trace /tmp/steps.csv.* --since 30
    python -m bench step-trace steps-k0.csv.xz --paired c64.json.xz --arm k0 --requests 33-64
    python -m bench step-trace steps-k0.csv.xz --against steps-k0b.csv.xz --against steps-mixture.csv.xz
    python -m bench step-trace steps-k0.csv.xz --gpu-clocks gpu-clocks.csv
"""

from __future__ import annotations

import argparse
import bisect
import csv
import json
import lzma
import statistics
from collections import defaultdict
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Iterable, Sequence

from .gpu_clocks import ClockSample, read_clocks


@dataclass(frozen=True)
class Step:
    """One row of a step trace (``engine_host.step_trace``); times in s."""

    t_scheduled: float
    t_output: float
    k_drafted: int
    k_proposed: int
    decode: int
    requests: int
    tokens: int
    context: int = 0  # tokens in the KV cache of the step's requests (0: not in the trace)
    graph: str = ""  # the step's CUDA graph mode: FULL, PIECEWISE, NONE ("": not in the trace)
    draft_tokens: int | None = None  # draft tokens the step's output verified (None: not in the trace)
    accepted_tokens: int | None = None  # of those, accepted
    estimate: float | None = None  # the running requests' highest acceptance estimate (fraction)
    prior: float | None = None  # a new request's start in the newest running request's class
    token_cost: float | None = None  # the gate's price of one verified draft token (fraction of a plain step)
    step_cost: float | None = None  # its price of a step at K > 0 that verifies no draft (fraction)
    path: str = ""  # the hook's path that handled the output: lean, full ("": not in the trace)
    vllm_schedule_us: float | None = None  # vLLM's own schedule() for the step (µs; None: not in the trace)
    vllm_update_us: float | None = None  # vLLM's own update_from_output() for the output (µs)
    cpu: int | None = None  # the CPU the engine core's thread ran on (None: not in the trace)
    gc_us: float | None = None  # Python's garbage collections since the row before (µs; None: none)
    gc_gen: int | None = None  # the oldest generation they collected
    rule: str = ""  # the hook's rule that set k_proposed ("": lean path, not decided, or not in the trace)


@dataclass(frozen=True)
class Interval:
    """A busy decode step measured output to output: wall time (s), its batch and K, and its
    requests' KV-cache length (tokens; 0 where the trace does not record it)."""

    seconds: float
    requests: int
    k_drafted: int
    k_proposed: int
    k_drafted_before: int
    t_output: float  # when the step's output came back (s, the engine core's clock)
    context: int = 0
    graph: str = ""


def read_trace(path: str | Path) -> list[Step]:
    """The rows of one trace file (``.xz``: compressed), in file order.

    Raises:
        ValueError: the file is not a step trace (missing columns).
    """
    opener = lzma.open if str(path).endswith(".xz") else open
    with opener(path, "rt", newline="", encoding="utf-8") as f:
        reader = csv.DictReader(f)
        need = {"t_scheduled_s", "t_output_s", "k_drafted", "k_proposed", "decode", "requests", "tokens"}
        if not reader.fieldnames or not need <= set(reader.fieldnames):
            raise ValueError(f"{path}: not a step trace (columns {reader.fieldnames})")
        return [
            Step(
                float(r["t_scheduled_s"]),
                float(r["t_output_s"]),
                int(r["k_drafted"]),
                int(r["k_proposed"]),
                int(r["decode"]),
                int(r["requests"]),
                int(r["tokens"]),
                int(r.get("context") or 0),  # traces before the column: 0
                r.get("graph") or "",  # traces before the column, or vLLM without --cudagraph-metrics
                _count(r.get("draft_tokens")),
                _count(r.get("accepted_tokens")),
                _fraction(r.get("estimate")),
                _fraction(r.get("prior")),
                _fraction(r.get("token_cost")),
                _fraction(r.get("step_cost")),
                r.get("path") or "",
                _fraction(r.get("vllm_schedule_us")),
                _fraction(r.get("vllm_update_us")),
                _count(r.get("cpu")),
                _fraction(r.get("gc_us")),
                _count(r.get("gc_gen")),
                r.get("rule") or "",
            )
            for r in reader
        ]


def _fraction(value: str | None) -> float | None:
    return float(value) if value else None


def _count(value: str | None) -> int | None:
    return int(value) if value else None


def lone_requests(steps: Sequence[Step]) -> list[list[Step]]:
    """The stretches of one engine core's trace in which one request ran alone, one per request:
    from the step after its prefill (a step that did not only decode) to the last step before
    the next prefill or a step with more than one request. Stretches of one step are left out."""
    out: list[list[Step]] = []
    cur: list[Step] = []
    for st in steps:
        if st.requests == 1 and st.decode == 1:
            cur.append(st)
            continue
        if len(cur) > 1:
            out.append(cur)
        cur = []
    if len(cur) > 1:
        out.append(cur)
    return out


def gain_table(traces: Sequence[Sequence[Step]]) -> list[str]:
    """Markdown rows: the per-request gate (``engine_host.request_gate``, the engine host's
    mixture prior, every request of one class) replayed over the verifications of the requests
    that ran alone in the traces (:func:`lone_requests`; a static-K engine's, whose drafts were
    all verified), each draft priced first as the scheduler hook prices it. Per bin of the
    estimate a draft would have been priced at: the drafts, their mean estimate (fraction 0..1),
    the geometric law's expected accepted tokens at each draft's length (``sum_j a^j``; tokens),
    the tokens they had accepted (tokens), and what the calibrated gain read for the bin's mean
    estimate at the longest draft seen, once every draft was counted (tokens). Empty when no
    lone request verified a draft."""
    from engine_host.request_gate import ACCEPTANCE_BUCKETS, RequestDraftGate

    gate = RequestDraftGate(prior="mixture", gain="calibrated")
    rows: list[tuple[float, float, int]] = []  # (estimate, geometric tokens, accepted tokens)
    k_max = 0
    n = 0
    for steps in traces:
        for req in lone_requests(steps):
            n += 1
            rid = f"r{n}"
            gate.set_class(rid, "lone")
            for st in req:
                if not st.draft_tokens:
                    continue
                a = gate.acceptance(rid)
                rows.append((a, RequestDraftGate.expected_gain(a, st.draft_tokens), st.accepted_tokens or 0))
                k_max = max(k_max, st.draft_tokens)
                gate.observe(rid, st.draft_tokens, st.accepted_tokens or 0)
            gate.forget(req_id=rid)
    if not rows:
        return []
    out = [
        f"| estimate | drafts | mean estimate | geometric tokens | tokens accepted | calibrated gain at K = {k_max} |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    edges = [*ACCEPTANCE_BUCKETS, 1.0]
    for lo, hi in zip(edges, edges[1:]):
        sel = [r for r in rows if lo <= r[0] < hi or (hi == 1.0 and r[0] >= 1.0)]
        if not sel:
            continue
        mean_a = sum(r[0] for r in sel) / len(sel)
        geo = sum(r[1] for r in sel) / len(sel)
        acc = sum(r[2] for r in sel) / len(sel)
        out.append(
            f"| {lo:.0%}-{hi:.0%} | {len(sel)} | {mean_a:.3f} | {geo:.2f} | {acc:.2f} | "
            f"{gate.gain('lone', mean_a, k_max):.2f} |"
        )
    return out


def lone_table(traces: Sequence[Sequence[Step]], limit: int = 40) -> list[str]:
    """Markdown: each lone request that drafted (``lone_requests``), up to ``limit`` of them:
    its steps, those at K > 0 (``k_proposed``: the K chosen for the next drafts), the draft and
    accepted tokens its verifications held, and, where the trace records them (a hook with the
    per-request gate on), its class prior at its first step and its acceptance estimate after
    its first verification, at its last step at K > 0 and at its end (fractions 0..1), and what
    the gate priced a draft token and a step at K > 0 at, at its last step at K > 0 (fractions of
    a plain step). Under async scheduling a step's drafts are verified one step after they were
    proposed."""

    def f(v: float | None) -> str:
        return "-" if v is None else f"{v:.3f}"

    rows = [
        "| request | steps | steps at K > 0 (first .. last) | accepted / draft tokens | prior at start | "
        "estimate: first verified / last K > 0 / end | token / step cost at last K > 0 |",
        "|---:|---:|---|---|---:|---|---|",
    ]
    n = 0
    for steps in traces:
        for req in lone_requests(steps):
            at_k = [i for i, st in enumerate(req) if st.k_proposed > 0]
            if not at_k:
                continue
            n += 1
            if n > limit:
                continue
            if req[0].draft_tokens is None:  # a trace from before the column
                tokens = "-"
            else:
                tokens = f"{sum(st.accepted_tokens or 0 for st in req)} / {sum(st.draft_tokens or 0 for st in req)}"
            first = next((st.estimate for st in req if st.draft_tokens), None)
            last = req[at_k[-1]].estimate
            prior = next((st.prior for st in req if st.prior is not None), None)
            rows.append(
                f"| {n} | {len(req)} | {len(at_k)} ({at_k[0] + 1} .. {at_k[-1] + 1}) | {tokens} | "
                f"{f(prior)} | {f(first)} / {f(last)} / {f(req[-1].estimate)} | "
                f"{f(req[at_k[-1]].token_cost)} / {f(req[at_k[-1]].step_cost)} |"
            )
    if n > limit:
        rows.append(f"\n({n - limit} more lone requests that drafted not shown; --lone N shows more)")
    if n == 0:
        return ["no lone request drafted"]
    return rows


def _same_decode_batch(prev: Step, cur: Step) -> bool:
    """Both steps only decoded, with the same number of requests (``cur``'s interval from
    ``prev`` is then one decode step of that batch)."""
    return bool(cur.requests) and cur.decode == cur.requests and prev.decode == prev.requests == cur.requests


def busy_intervals(steps: Sequence[Step], max_gap_s: float = 0.05, since_s: float = 0.0) -> list[Interval]:
    """Output-to-output intervals of consecutive pure-decode steps with the same batch.

    Args:
        steps: one engine core's rows, in order.
        max_gap_s: longer intervals are dropped (idle spells, s).
        since_s: drop steps whose output came less than this long after the first row (s).

    Returns:
        One :class:`Interval` per counted step, in order.
    """
    out: list[Interval] = []
    if not steps:
        return out
    t0 = steps[0].t_output
    for prev, cur in zip(steps, steps[1:]):
        if cur.t_output - t0 < since_s:
            continue
        if not _same_decode_batch(prev, cur):
            continue
        dt = cur.t_output - prev.t_output
        if 0.0 < dt <= max_gap_s:
            out.append(
                Interval(
                    dt,
                    cur.requests,
                    cur.k_drafted,
                    cur.k_proposed,
                    prev.k_drafted,
                    cur.t_output,
                    cur.context,
                    cur.graph,
                )
            )
    return out


BATCH_RANGES = ((1, 1), (2, 4), (5, 8), (9, 16), (17, 32), (33, 64), (65, 128), (129, 1 << 30))


def _range_label(lo: int, hi: int) -> str:
    return str(lo) if lo == hi else (f"{lo}+" if hi >= 1 << 30 else f"{lo}-{hi}")


def _range_index(requests: int) -> int:
    """The index in ``BATCH_RANGES`` of the range holding ``requests`` (>= 1)."""
    return next(i for i, (lo, hi) in enumerate(BATCH_RANGES) if lo <= requests <= hi)


def range_table(traces: Sequence[Sequence[Step]], max_gap_s: float = 0.05, since_s: float = 0.0) -> list[str]:
    """Markdown rows, one per range of batch sizes (``BATCH_RANGES``, requests) with steps:
    every step of every trace (``traces``: one engine core's rows each, in order), those
    that verified drafts (K > 0), and the median ms of a pure-decode step by what came
    before it, at K = 0 and K > 0: another pure-decode step of the same batch (as
    :func:`busy_intervals` counts), or a prefill or a change of batch. Intervals longer
    than ``max_gap_s`` (s) are idle spells and left out; ``since_s`` as in
    :func:`busy_intervals`."""
    n = len(BATCH_RANGES)
    steps = [0] * n
    drafted = [0] * n
    times: list[dict[tuple[bool, bool], list[float]]] = [defaultdict(list) for _ in range(n)]

    for trace in traces:
        if not trace:
            continue
        t0 = trace[0].t_output
        for i, cur in enumerate(trace):
            if cur.requests <= 0 or cur.t_output - t0 < since_s:
                continue
            j = _range_index(cur.requests)
            steps[j] += 1
            drafted[j] += cur.k_drafted > 0
            if i == 0 or cur.decode != cur.requests:
                continue
            prev = trace[i - 1]
            dt = cur.t_output - prev.t_output
            if 0.0 < dt <= max_gap_s:
                after_pure = prev.decode == prev.requests == cur.requests
                times[j][(after_pure, cur.k_drafted > 0)].append(dt * 1e3)

    def med(v: list[float]) -> str:
        return f"{statistics.median(v):.3f} ({len(v)})" if v else "-"

    lines = [
        "| requests | steps | K > 0 | after a pure-decode step: K = 0 / K > 0, median ms (steps) "
        "| after a prefill or a change of batch: K = 0 / K > 0 |",
        "|---|---:|---:|---|---|",
    ]
    for j, (lo, hi) in enumerate(BATCH_RANGES):
        if not steps[j]:
            continue
        t = times[j]
        lines.append(
            f"| {_range_label(lo, hi)} | {steps[j]} | {drafted[j]} ({drafted[j] / steps[j]:.0%}) "
            f"| {med(t[(True, False)])} / {med(t[(True, True)])} | {med(t[(False, False)])} / {med(t[(False, True)])} |"
        )
    return lines


def _row(label: str, values: list[float], contexts: list[int]) -> str:
    ms = sorted(v * 1e3 for v in values)
    p90 = ms[min(len(ms) - 1, int(0.9 * len(ms)))]
    ctx = f"{statistics.median(contexts):.0f}" if any(contexts) else "-"
    return f"| {label} | {len(ms)} | {statistics.median(ms):.3f} | {statistics.fmean(ms):.3f} | {p90:.3f} | {ctx} |"


def table(intervals: Iterable[Interval], key: str, min_steps: int = 20) -> list[str]:
    """Markdown rows, per batch size and value of ``key`` (an :class:`Interval` field name,
    ``transition``, or ``graph``: the K verified and the step's CUDA graph mode), of steps,
    median / mean / p90 ms per step, and the median KV-cache length per request (tokens; ``-``
    for a trace without it): a group of longer contexts costs more per step whatever its K."""
    groups: dict[tuple[int, str], list[Interval]] = defaultdict(list)
    for iv in intervals:
        if key == "transition":
            label = f"{iv.k_drafted_before} -> {iv.k_drafted}"
        elif key == "graph":
            label = f"{iv.k_drafted}, {iv.graph}"
        else:
            label = str(getattr(iv, key))
        groups[(iv.requests, label)].append(iv)
    head = "k_drafted, graph" if key == "graph" else key
    lines = [
        f"| requests, {head} | steps | median ms | mean ms | p90 ms | context tokens per request (median) |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for (b, label), ivs in sorted(groups.items()):
        if len(ivs) >= min_steps:
            lines.append(_row(f"{b}, {label}", [iv.seconds for iv in ivs], [iv.context // max(b, 1) for iv in ivs]))
    return lines


def vllm_table(traces: Sequence[Sequence[Step]], since_s: float = 0.0) -> list[str]:
    """Markdown rows, one per range of batch sizes (``BATCH_RANGES``) and hook path (``lean``,
    ``full``), of the pure-decode steps (every request only decoded) whose trace records vLLM's
    own times: steps, and the median µs of vLLM's ``schedule()`` for the step and of its
    ``update_from_output()`` for the output (``engine_host.step_trace``). Empty when no row
    records them (traces written before the columns). ``since_s`` as in :func:`busy_intervals`.

    What it tells: whether vLLM's own work per step, outside the hook's clock, differs with the
    hook's path (one engine's lean and full steps, or two engines side by side)."""
    groups: dict[tuple[int, str], tuple[list[float], list[float]]] = defaultdict(lambda: ([], []))
    for trace in traces:
        if not trace:
            continue
        t0 = trace[0].t_output
        for st in trace:
            if st.vllm_update_us is None or st.requests <= 0 or st.decode != st.requests or st.t_output - t0 < since_s:
                continue
            sched, upd = groups[(_range_index(st.requests), st.path or "-")]
            if st.vllm_schedule_us is not None:
                sched.append(st.vllm_schedule_us)
            upd.append(st.vllm_update_us)
    if not groups:
        return []
    lines = [
        "| requests | hook path | steps | vLLM schedule() median µs | vLLM update_from_output() median µs |",
        "|---|---|---:|---:|---:|",
    ]
    for (j, path), (sched, upd) in sorted(groups.items()):
        lo, hi = BATCH_RANGES[j]
        med_s = f"{statistics.median(sched):.1f}" if sched else "-"
        lines.append(f"| {_range_label(lo, hi)} | {path} | {len(upd)} | {med_s} | {statistics.median(upd):.1f} |")
    return lines


@dataclass(frozen=True)
class Burst:
    """One busy spell of a trace: when its first output came (s, the engine core's clock, which
    is the host's monotonic clock: traces of engines on one host share it), and per range of
    batch sizes (``BATCH_RANGES`` index) the K = 0 pure-decode steps measured as
    :func:`busy_intervals` does: wall ms, vLLM's ``schedule()`` µs and ``update_from_output()`` µs
    (``nan`` where the trace does not record them)."""

    t_start: float
    steps: dict[int, list[tuple[float, float, float]]]
    cpus: dict[int, int] = field(default_factory=dict)  # CPU -> rows of the burst on it (traces with the column)
    t_end: float = 0.0  # when its last output came (s, the same clock)

    def cpu(self) -> int | None:
        """The CPU most of the burst's rows ran on (None: not in the trace)."""
        return max(self.cpus, key=lambda c: self.cpus[c]) if self.cpus else None


def bursts(steps: Sequence[Step], max_gap_s: float = 0.05) -> list[Burst]:
    """``steps`` (one engine core's rows, in order) cut into bursts at idle spells: an
    output-to-output interval longer than ``max_gap_s`` (s) starts a new one. Only K = 0 steps
    are kept (like against like across engines whose K differs)."""
    out: list[Burst] = []
    if not steps:
        return out
    nan = float("nan")
    cur = Burst(steps[0].t_output, defaultdict(list))
    for prev, st in zip(steps, steps[1:]):
        dt = st.t_output - prev.t_output
        if dt > max_gap_s:
            if cur.steps:
                out.append(replace(cur, t_end=prev.t_output))
            cur = Burst(st.t_output, defaultdict(list))
            continue
        if st.cpu is not None:
            cur.cpus[st.cpu] = cur.cpus.get(st.cpu, 0) + 1
        if dt > 0.0 and st.k_drafted == 0 and _same_decode_batch(prev, st):
            cur.steps[_range_index(st.requests)].append(
                (
                    dt * 1e3,
                    st.vllm_schedule_us if st.vllm_schedule_us is not None else nan,
                    st.vllm_update_us if st.vllm_update_us is not None else nan,
                )
            )
    if cur.steps:
        out.append(replace(cur, t_end=steps[-1].t_output))
    return out


def cpu_table(traces: Sequence[Sequence[Step]], max_gap_s: float = 0.05, min_steps: int = 20) -> list[str]:
    """Markdown rows, one per range of batch sizes and CPU: the bursts (:func:`bursts`, K = 0
    pure-decode steps) whose rows ran mostly on that CPU (the trace's ``cpu`` column), and the
    median and 10th-90th percentile of their median step (ms). Empty when no row records the
    CPU. What it tells: whether a burst's speed follows the core the engine core ran on (on a
    host of several NUMA nodes, map CPUs to nodes with ``lscpu``)."""
    import numpy as np

    groups: dict[tuple[int, int], list[float]] = defaultdict(list)
    for trace in traces:
        for b in bursts(trace, max_gap_s):
            cpu = b.cpu()
            if cpu is None:
                continue
            for j, rows in b.steps.items():
                if len(rows) >= min_steps:
                    groups[(j, cpu)].append(float(np.median([r[0] for r in rows])))
    if not groups:
        return []
    lines = [
        "| requests | CPU (most of the burst) | bursts | median step ms (median of bursts) | p10-p90 ms |",
        "|---|---:|---:|---:|---|",
    ]
    for (j, cpu), meds in sorted(groups.items()):
        lo, hi = BATCH_RANGES[j]
        p10, p90 = np.percentile(meds, [10, 90])
        lines.append(
            f"| {_range_label(lo, hi)} | {cpu} | {len(meds)} | {float(np.median(meds)):.3f} | {p10:.3f}-{p90:.3f} |"
        )
    return lines


def clock_table(
    traces: Sequence[Sequence[Step]],
    clocks: Sequence[ClockSample],
    max_gap_s: float = 0.05,
    min_steps: int = 20,
    band_mhz: float = 100.0,
) -> list[str]:
    """Markdown rows, one per range of batch sizes and band of the GPU's SM clock: the bursts
    (:func:`bursts`, K = 0 pure-decode steps) whose median SM clock over their span (samples of
    ``python -m bench gpu-clocks``, the same host's monotonic clock) falls in the band
    (``band_mhz`` MHz wide), the median and 10th-90th percentile of their median step (ms), and
    their median power (W) and P-state. Under each range, Spearman's rank correlation between a
    burst's SM clock and its median step (Spearman, Am. J. Psychol. 15 (1904) 72-101): near -1
    when bursts run slower at lower clocks. Empty without a burst that has samples.
    """
    import numpy as np

    if not clocks:
        return []
    ts = np.array([c.t for c in clocks])
    groups: dict[tuple[int, int], list[tuple[float, float, int]]] = defaultdict(list)
    pairs: dict[int, list[tuple[float, float]]] = defaultdict(list)
    for trace in traces:
        for b in bursts(trace, max_gap_s):
            lo, hi = (int(i) for i in np.searchsorted(ts, [b.t_start, b.t_end]))
            inside = list(clocks[lo:hi])
            if not inside and 0 < lo < len(clocks):  # a burst shorter than the sampling interval
                inside = [clocks[lo - 1]]
            if not inside:
                continue
            sm = float(np.median([c.sm_mhz for c in inside]))
            power = float(np.median([c.power_w for c in inside]))
            pstate = int(np.median([c.pstate for c in inside]))
            for j, rows in b.steps.items():
                if len(rows) >= min_steps:
                    med = float(np.median([r[0] for r in rows]))
                    groups[(j, int(sm // band_mhz))].append((med, power, pstate))
                    pairs[j].append((sm, med))
    if not groups:
        return []
    lines = [
        "| requests | SM clock, MHz (burst median) | bursts | median step ms (median of bursts) | p10-p90 ms "
        "| power W | P-state |",
        "|---|---|---:|---:|---|---:|---:|",
    ]
    for (j, band), rows in sorted(groups.items()):
        lo, hi = BATCH_RANGES[j]
        meds = [r[0] for r in rows]
        p10, p90 = np.percentile(meds, [10, 90])
        lines.append(
            f"| {_range_label(lo, hi)} | {band * band_mhz:.0f}-{(band + 1) * band_mhz:.0f} | {len(rows)} "
            f"| {float(np.median(meds)):.3f} | {p10:.3f}-{p90:.3f} | {float(np.median([r[1] for r in rows])):.0f} "
            f"| {int(np.median([r[2] for r in rows]))} |"
        )
    lines.append("")
    for j, xy in sorted(pairs.items()):
        if len(xy) < 3:
            continue
        lo, hi = BATCH_RANGES[j]
        rho = _spearman([x for x, _ in xy], [y for _, y in xy])
        lines.append(f"{_range_label(lo, hi)} requests: {len(xy)} bursts, Spearman's rho (SM clock, step) {rho:+.2f}")
    return lines


def _spearman(x: Sequence[float], y: Sequence[float]) -> float:
    """Spearman's rank correlation of ``x`` and ``y`` (ties take their mean rank); 0.0 where
    either is constant."""
    import numpy as np

    def ranks(v: Sequence[float]) -> np.ndarray:
        a = np.asarray(v, float)
        order = a.argsort(kind="mergesort")
        r = np.empty(len(a))
        r[order] = np.arange(len(a), dtype=float)
        for value in np.unique(a):  # ties: their mean rank
            tied = a == value
            r[tied] = r[tied].mean()
        return r

    rx, ry = ranks(x), ranks(y)
    if rx.std() == 0 or ry.std() == 0:
        return 0.0
    return float(np.corrcoef(rx, ry)[0, 1])


def matched_table(
    base: Sequence[Step],
    others: Sequence[tuple[str, Sequence[Step]]],
    max_gap_s: float = 0.05,
    match_s: float = 10.0,
    min_steps: int = 20,
    resamples: int = 2000,
) -> list[str]:
    """Markdown rows: each of ``others`` (``(name, steps)``) against ``base``, burst by burst.

    Engines side by side on one host (``bench paired``) take turns on the same prompts, and the
    host's speed moves between bursts by more than the engines differ: a median over a whole
    run mixes the engines' difference with how many of each one's bursts fell in slow
    spells. Here each burst of an other engine is matched to the base engine's burst that
    started nearest in time (within ``match_s``, s; the same round of ``bench paired``), and,
    per range of batch sizes, with at least ``min_steps`` K = 0 pure-decode steps in both, the
    difference of their median step (ms) and of vLLM's own ``schedule()`` and
    ``update_from_output()`` (µs) is taken. Each row (ranges with 3 or more matched bursts) gives the median of those differences
    with a 95 % percentile-bootstrap interval over the matched bursts (``resamples``
    resamples; Efron, Ann. Statist. 7 (1979) 1-26), and the spread of the base engine's
    per-burst median step (10th-90th percentile, ms): what the host's state alone moves."""
    import numpy as np

    rng = np.random.default_rng(0)
    base_bursts = bursts(base, max_gap_s)
    starts = np.array([b.t_start for b in base_bursts]) if base_bursts else np.array([])
    lines = [
        "| engine against base | requests | bursts matched | step ms: median difference [95 %] | vLLM schedule() µs "
        "| vLLM update_from_output() µs | base's median step per burst, p10-p90 ms |",
        "|---|---|---:|---|---|---|---|",
    ]

    def cell(values: list[float], fmt: str) -> str:
        v = np.array([x for x in values if x == x])  # nan: not in the trace
        if len(v) < 3:
            return "-"
        meds = np.median(v[rng.integers(0, len(v), size=(resamples, len(v)))], axis=1)
        lo, hi = np.percentile(meds, [2.5, 97.5])
        return f"{fmt.format(float(np.median(v)))} [{fmt.format(float(lo))}, {fmt.format(float(hi))}]"

    for name, steps in others:
        pairs: dict[int, list[tuple[np.ndarray, np.ndarray]]] = defaultdict(list)
        for b in bursts(steps, max_gap_s):
            if not len(starts):
                break
            i = int(np.argmin(np.abs(starts - b.t_start)))
            if abs(starts[i] - b.t_start) > match_s:
                continue
            for j, mine in b.steps.items():
                theirs = base_bursts[i].steps.get(j, [])
                if len(mine) >= min_steps and len(theirs) >= min_steps:
                    # per column (step ms, schedule() µs, update µs): the burst's median
                    pairs[j].append((np.median(mine, axis=0), np.median(theirs, axis=0)))
        for j in sorted(pairs):
            ps = pairs[j]
            if len(ps) < 3:
                continue
            lo, hi = BATCH_RANGES[j]
            base_meds = [t[0] for _, t in ps]
            p10, p90 = np.percentile(base_meds, [10, 90])
            lines.append(
                f"| {name} | {_range_label(lo, hi)} | {len(ps)} | "
                f"{cell([m[0] - t[0] for m, t in ps], '{:+.3f}')} | {cell([m[1] - t[1] for m, t in ps], '{:+.1f}')} | "
                f"{cell([m[2] - t[2] for m, t in ps], '{:+.1f}')} | {p10:.2f}-{p90:.2f} |"
            )
    if len(lines) == 2:
        return ["no burst matched the base engine's (within the time window, with enough K = 0 steps)"]
    return lines


@dataclass(frozen=True)
class CellWindow:
    """A benchmark cell's measured window (``bench matrix`` cell JSON, ``window_perf_s``)."""

    label: str
    start: float
    end: float


def cell_windows(folder: str | Path) -> list[CellWindow]:
    """Every cell JSON under ``folder`` (recursively) that records ``window_perf_s``, by start.

    The label is the file's path under ``folder`` without ``.json`` (``round-1/chat-low-adaptive``).
    """
    root = Path(folder)
    out: list[CellWindow] = []
    for path in sorted(root.rglob("*.json")):
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            continue
        win = data.get("window_perf_s") if isinstance(data, dict) else None
        if isinstance(win, list) and len(win) == 2:
            out.append(CellWindow(str(path.relative_to(root).with_suffix("")), float(win[0]), float(win[1])))
    return sorted(out, key=lambda c: c.start)


def cell_table(intervals: Sequence[Interval], cells: Sequence[CellWindow], min_steps: int = 20) -> list[str]:
    """Markdown rows, one per cell: busy steps, median and mean ms per step, mean K verified,
    and median ms per step by verified K (``K:median(steps)``, groups of ``min_steps`` or more)."""
    lines = [
        "| cell | steps | median ms | mean ms | mean K verified | median ms by K verified |",
        "|---|---:|---:|---:|---:|---|",
    ]
    for c in cells:
        inside = [iv for iv in intervals if c.start <= iv.t_output <= c.end]
        if not inside:
            continue
        ms = [iv.seconds * 1e3 for iv in inside]
        by_k: dict[int, list[float]] = defaultdict(list)
        for iv in inside:
            by_k[iv.k_drafted].append(iv.seconds * 1e3)
        per_k = " ".join(
            f"{k}:{statistics.median(v):.3f}({len(v)})" for k, v in sorted(by_k.items()) if len(v) >= min_steps
        )
        mean_k = statistics.fmean(iv.k_drafted for iv in inside)
        lines.append(
            f"| {c.label} | {len(ms)} | {statistics.median(ms):.3f} | {statistics.fmean(ms):.3f} | {mean_k:.2f} | {per_k} |"
        )
    return lines


# the idle spells, s, that may separate one arm's bursts in a trace, tried longest first: at 64
# clients an arm's bursts are seconds apart, at one client two of them can follow within 0.1 s
# (the arm last in one cell and first in the next), where a longer spell would join them
PAIRED_GAPS_S = (0.5, 0.2, 0.05, 0.02)


def paired_windows(
    steps: Sequence[Step], result: dict, arm: str, gap_s: float | None = None
) -> tuple[list[CellWindow], list[int]]:
    """The bursts of arm ``arm`` in a ``bench paired`` result (``result``, as
    ``bench.paired.load_result`` reads it; ``bursts`` in the order they ran) matched, in order, to
    a run of consecutive bursts of one engine's trace (``steps``: runs of steps separated by more
    than ``gap_s`` s with no step; between its bursts an arm's engine waits while the others run):
    the run whose step counts agree with the result's ``steps_at_k`` in the most bursts, the
    latest of those (a trace also holds earlier runs and whatever ran after, e.g. a profile).
    With ``gap_s`` None each spell of :data:`PAIRED_GAPS_S` is tried and the one whose bursts
    agree best is kept (the longest of equals).

    Returns:
        One :class:`CellWindow` per burst, labelled with its cell (``docs@c64``), and the index
        of every burst whose steps in the trace differ from the result's ``steps_at_k`` by more
        than 3 (empty when the two agree: each burst was matched to its own steps).
    Raises:
        ValueError: the arm has no bursts in the result, or the trace has fewer bursts.
    """
    mine = [b for b in result.get("bursts", []) if b.get("arm") == arm]
    if not mine:
        raise ValueError(f"no bursts of arm {arm!r} in the result")
    best: tuple[list[CellWindow], list[int]] | None = None
    for gap in PAIRED_GAPS_S if gap_s is None else (gap_s,):
        got = _windows_at_gap(steps, mine, gap)
        if got is not None and (best is None or len(got[1]) < len(best[1])):
            best = got
    if best is None:
        raise ValueError(f"the trace has fewer bursts than the result's {len(mine)} of arm {arm!r}")
    return best


def _windows_at_gap(steps: Sequence[Step], mine: list[dict], gap_s: float) -> tuple[list[CellWindow], list[int]] | None:
    """:func:`paired_windows` with the trace cut into bursts at idle spells over ``gap_s`` s;
    None when that leaves fewer bursts than ``mine``."""
    runs: list[list[Step]] = []
    for i, st in enumerate(steps):
        if not runs or st.t_scheduled - steps[i - 1].t_output > gap_s:
            runs.append([])
        runs[-1].append(st)
    if len(runs) < len(mine):
        return None

    def mismatches(start: int) -> list[int]:
        out = []
        for i, (burst, run) in enumerate(zip(mine, runs[start : start + len(mine)])):
            counted = burst.get("steps_at_k")
            if counted is not None and abs(sum(counted) - len(run)) > 3:
                out.append(i)
        return out

    starts = range(len(runs) - len(mine), -1, -1)  # latest first: ties keep the latest
    best = min(starts, key=lambda s: len(mismatches(s)))
    windows = [
        CellWindow(str(burst.get("cell")), run[0].t_output, run[-1].t_output)
        for burst, run in zip(mine, runs[best : best + len(mine)])
    ]
    return windows, mismatches(best)


def gc_table(traces: Sequence[Sequence[Step]], min_steps: int = 20, max_gap_s: float = 0.05) -> list[str]:
    """Markdown rows, one per kind of decode step (:func:`step_kind`: the hook's path at K = 0,
    drafting): steps, steps with a garbage collection of the engine core's process in them
    (the trace's ``gc_us``), collections of generation 2, the collector's ms per 1000 steps,
    and the median step (output to output, ms) with a collection and without. Whether an
    engine whose steps allocate more is slower through the collector. A step longer than
    ``max_gap_s`` (s) is an idle spell and left out. Empty when the traces record no collection
    (traces before the column, or nothing collected)."""
    per: dict[str, list[list[float]]] = {}
    gen2: dict[str, int] = defaultdict(int)
    gc_s: dict[str, float] = defaultdict(float)
    seen = False
    for steps in traces:
        for prev, st in zip(steps, steps[1:]):
            dt = st.t_output - prev.t_output
            if st.decode != st.requests or st.decode < 1 or dt <= 0 or dt > max_gap_s:
                continue
            kind = step_kind(st)
            with_gc, without = per.setdefault(kind, [[], []])
            if st.gc_us is not None:
                seen = True
                with_gc.append(dt * 1e3)
                gc_s[kind] += st.gc_us / 1e6
                gen2[kind] += st.gc_gen == 2
            else:
                without.append(dt * 1e3)
    if not seen:
        return []
    lines = [
        "| path | steps | with a collection | of generation 2 | collector ms per 1000 steps "
        "| median ms with | median ms without |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for kind in STEP_KINDS:
        if kind not in per:
            continue
        with_gc, without = per[kind]
        n = len(with_gc) + len(without)
        if n < min_steps:
            continue
        med_with = f"{statistics.median(with_gc):.3f}" if with_gc else "-"
        med_without = f"{statistics.median(without):.3f}" if without else "-"
        lines.append(
            f"| {kind} | {n} | {len(with_gc)} | {gen2[kind]} | {gc_s[kind] * 1e6 / n:.2f} | {med_with} | {med_without} |"
        )
    return lines


def step_kind(st: Step) -> str:
    """What a step did, for :func:`burst_time_table`: ``prefill`` (some request in it did not
    only decode), ``drafting`` (it verified drafts or proposed them for the next step), else the
    hook's path at K = 0 (``lean``, ``full``; ``-`` in a trace without the column)."""
    if st.decode != st.requests or st.decode == 0:
        return "prefill"
    if st.k_drafted > 0 or st.k_proposed > 0:
        return "drafting"
    return st.path or "-"


STEP_KINDS = ("lean", "full", "-", "drafting", "prefill")


def burst_time_table(steps: Sequence[Step], windows: Sequence[CellWindow]) -> list[str]:
    """Markdown rows, one per cell of ``windows`` (:func:`paired_windows`): where a burst's time
    went, per burst on average: its time from first to last output (ms), and per kind of step
    (:func:`step_kind`) the steps, their output-to-output time (ms) and ms per step. Two engines'
    tables of the same result tell what a cell's difference in tokens/s is made of (e.g. the
    adaptive engine's drafting steps against the K = 0 steps they replace)."""
    per: dict[str, dict[str, list[float]]] = {}
    spans: dict[str, list[float]] = defaultdict(list)
    t_out = [st.t_output for st in steps]
    for w in windows:
        lo, hi = bisect.bisect_left(t_out, w.start), bisect.bisect_right(t_out, w.end)
        rows = steps[lo:hi]
        if len(rows) < 2:
            continue
        spans[w.label].append((rows[-1].t_output - rows[0].t_output) * 1e3)
        kinds = per.setdefault(w.label, defaultdict(lambda: [0.0, 0.0]))
        for prev, st in zip(rows, rows[1:]):
            k = kinds[step_kind(st)]
            k[0] += 1
            k[1] += (st.t_output - prev.t_output) * 1e3
    head = " | ".join(f"{k}: steps, ms" for k in STEP_KINDS)
    lines = [f"| cell | bursts | ms first to last output | {head} |", "|---|---:|---:|" + "---|" * len(STEP_KINDS)]
    for label, kinds in per.items():
        n = len(spans[label])
        cells = []
        for k in STEP_KINDS:
            steps_n, ms = kinds.get(k, [0.0, 0.0])
            cells.append(f"{steps_n / n:.2f}, {ms / n:.2f} ({ms / steps_n:.3f}/step)" if steps_n else "-")
        lines.append(f"| {label} | {n} | {sum(spans[label]) / n:.2f} | " + " | ".join(cells) + " |")
    return lines


def probe_table(steps: Sequence[Step], windows: Sequence[CellWindow]) -> list[str]:
    """Markdown rows, one per cell of ``windows`` (:func:`paired_windows`): the drafting of an
    engine that switches K, burst by burst. A *probe* is a run of steps that propose drafts
    (``k_proposed`` > 0), begun after one that did not; under async scheduling its last drafts
    are verified in the step after it. Per cell: bursts, probes per burst, steps per probe
    (mean), bursts whose first step (the prefill) already proposed, so that the first decode
    step verified drafts (a probe at once: the wait ran out before the request came, or its
    class's prior pays), the median steps from one probe's start to the next's within a burst,
    and the mean output-to-output ms of the decode steps that only proposed, verified and
    proposed, and only verified. Where an adaptive engine's probes go on traffic that never
    accepts (chat at one client; docs/gpu.md, host 38). Empty when no burst proposed drafts
    (a static K = 0 engine)."""
    t_out = [st.t_output for st in steps]
    per: dict[str, dict[str, list[float]]] = {}
    for w in windows:
        lo, hi = bisect.bisect_left(t_out, w.start), bisect.bisect_right(t_out, w.end)
        rows = steps[lo:hi]
        c = per.setdefault(w.label, defaultdict(list))
        c["bursts"].append(1.0)
        starts: list[int] = []
        run = 0
        for i, st in enumerate(rows):
            if st.k_proposed > 0:
                if run == 0:
                    starts.append(i)
                    if i == 0:
                        c["at_once"].append(1.0)
                run += 1
            elif run:
                c["lengths"].append(float(run))
                run = 0
            if i > 0 and st.decode >= 1 and (st.k_proposed > 0 or st.k_drafted > 0):
                kind = ("both" if st.k_drafted > 0 else "propose") if st.k_proposed > 0 else "verify"
                c[kind].append((st.t_output - rows[i - 1].t_output) * 1e3)
        if run:
            c["lengths"].append(float(run))
        c["probes"].append(float(len(starts)))
        c["gaps"] += [float(b - a) for a, b in zip(starts, starts[1:])]
    if not any(sum(c["probes"]) for c in per.values()):
        return []
    lines = [
        "| cell | bursts | probes per burst | steps per probe | drafted from the prefill | steps between "
        "probes (median) | ms/step: proposing | verifying and proposing | verifying |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for label, c in per.items():
        n = len(c["bursts"])

        def mean(key: str, c: dict[str, list[float]] = c) -> str:
            return f"{statistics.fmean(c[key]):.3f}" if c[key] else "-"

        gaps = f"{statistics.median(c['gaps']):.0f}" if c["gaps"] else "-"
        steps_per = f"{statistics.fmean(c['lengths']):.2f}" if c["lengths"] else "-"
        lines.append(
            f"| {label} | {n} | {sum(c['probes']) / n:.2f} | {steps_per} "
            f"| {len(c['at_once'])} of {n} | {gaps} | {mean('propose')} | {mean('both')} | {mean('verify')} |"
        )
    return lines


RULES = ("policy", "explore", "held", "batch", "lone", "probe", "gate", "warmup")


def rule_table(steps: Sequence[Step], windows: Sequence[CellWindow]) -> list[str]:
    """Markdown rows, one per cell of ``windows`` (:func:`paired_windows`): which of the scheduler
    hook's rules set the K of the steps that proposed drafts (``k_proposed`` > 0), per burst on
    average, as ``steps (K proposed: steps ...)`` per rule (``engine_host.step_trace``'s ``rule``
    column), and the steps the gate held at K = 0 (rule ``gate``). Empty when the trace has no
    rule column or no step in the windows proposed drafts."""
    t_out = [st.t_output for st in steps]
    per: dict[str, dict[str, dict[int, int]]] = {}
    bursts_n: dict[str, int] = defaultdict(int)
    for w in windows:
        lo, hi = bisect.bisect_left(t_out, w.start), bisect.bisect_right(t_out, w.end)
        bursts_n[w.label] += 1
        cell = per.setdefault(w.label, defaultdict(lambda: defaultdict(int)))
        for st in steps[lo:hi]:
            if st.rule and (st.k_proposed > 0 or st.rule == "gate"):
                cell[st.rule][st.k_proposed] += 1
    if not any(per.values()):
        return []
    lines = ["| cell | bursts | " + " | ".join(RULES) + " |", "|---|---:|" + "---|" * len(RULES)]
    for label, cell in per.items():
        n = bursts_n[label]
        cells = []
        for rule in RULES:
            ks = cell.get(rule)
            if not ks:
                cells.append("-")
                continue
            total = sum(ks.values())
            by_k = " ".join(f"{k}:{v / n:.1f}" for k, v in sorted(ks.items()))
            cells.append(f"{total / n:.1f} ({by_k})")
        lines.append(f"| {label} | {n} | " + " | ".join(cells) + " |")
    return lines


def paired_cell_table(
    intervals: Sequence[Interval], windows: Sequence[CellWindow], requests: tuple[int, int], min_steps: int = 20
) -> list[str]:
    """Markdown rows, one per cell of ``windows`` (:func:`paired_windows`, merged by label), of
    the busy decode steps with ``requests[0]..requests[1]`` requests inside them: steps and median
    ms per step by K verified (``K:median(steps)``, groups of ``min_steps`` or more)."""
    lo, hi = requests
    by_cell: dict[str, dict[int, list[float]]] = {}
    for w in windows:
        ks = by_cell.setdefault(w.label, defaultdict(list))
        for iv in intervals:
            if w.start <= iv.t_output <= w.end and lo <= iv.requests <= hi:
                ks[iv.k_drafted].append(iv.seconds * 1e3)
    lines = [
        f"| cell | steps at {_range_label(lo, hi)} requests | median ms by K verified (steps) |",
        "|---|---:|---|",
    ]
    for label, ks in by_cell.items():
        n = sum(len(v) for v in ks.values())
        if not n:
            continue
        per_k = " ".join(
            f"{k}:{statistics.median(v):.3f}({len(v)})" for k, v in sorted(ks.items()) if len(v) >= min_steps
        )
        lines.append(f"| {label} | {n} | {per_k or '-'} |")
    return lines


def _print_titled(title: str, rows: list[str]) -> None:
    """Print a table's markdown ``rows`` under ``title``, each followed by a blank line; nothing
    when there are no rows."""
    if rows:
        print(title)
        print()
        print("\n".join(rows))
        print()


def _requests_range(text: str) -> tuple[int, int]:
    lo, _, hi = text.partition("-")
    try:
        a, b = int(lo), int(hi or lo)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected LO-HI requests (e.g. 33-64), got {text!r}") from None
    if a < 1 or b < a:
        raise argparse.ArgumentTypeError(f"expected 1 <= LO <= HI, got {text!r}")
    return a, b


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m bench step-trace",
        description=__doc__.split("\n\n")[0] if __doc__ else None,
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    ap.add_argument("files", nargs="+", help="trace files ($SPECPILOT_STEP_TRACE.PID)")
    ap.add_argument("--max-gap-ms", type=float, default=50.0, help="longer output-to-output intervals are idle spells")
    ap.add_argument("--since", type=float, default=0.0, help="skip the first seconds of each trace (warm-up)")
    ap.add_argument(
        "--cells", help="a `bench matrix` results folder: also one row per cell, from its window (same host's clock)"
    )
    ap.add_argument(
        "--paired",
        metavar="RESULT",
        help="a `bench paired` result (paired.json, .xz too) the traced engine ran in: also one row per cell of "
        "--arm, its bursts matched in order to the trace's run of bursts whose step counts agree (one trace file)",
    )
    ap.add_argument("--arm", help="with --paired: the arm that was the traced engine (e.g. adaptive, k0)")
    ap.add_argument(
        "--requests",
        type=_requests_range,
        default=(33, 64),
        metavar="LO-HI",
        help="with --paired: the batch sizes the per-cell rows count",
    )
    ap.add_argument(
        "--against",
        action="append",
        default=[],
        metavar="TRACE",
        help="another engine's trace on the same host (repeatable): its K = 0 steps against the first file's, "
        "burst by burst (each burst matched to the first engine's nearest in time), per range of batch sizes",
    )
    ap.add_argument(
        "--match-s", type=float, default=10.0, help="with --against: the farthest apart two matched bursts start, s"
    )
    ap.add_argument(
        "--gpu-clocks",
        metavar="FILE",
        help="samples of `python -m bench gpu-clocks` taken while the traced engines ran (same host): each burst's "
        "median step by the GPU's SM clock during it",
    )
    ap.add_argument("--min-steps", type=int, default=20, help="groups with fewer steps are not printed")
    ap.add_argument(
        "--lone",
        type=int,
        default=0,
        metavar="N",
        help="also each of the first N requests that ran alone and drafted: its steps at K > 0, tokens accepted, "
        "the per-request gate's estimate and what it priced drafting at",
    )
    ap.add_argument(
        "--gain",
        action="store_true",
        help="also the per-request gate replayed over the lone requests' verifications (a static-K engine's "
        "trace): per bin of the estimate, the geometric law's expected tokens against the tokens accepted",
    )
    args = ap.parse_args(argv)
    if args.paired and (not args.arm or len(args.files) != 1):
        ap.error("--paired needs --arm and exactly one trace file (the arm's engine)")
    if args.against and len(args.files) != 1:
        ap.error("--against needs exactly one trace file (the base engine's)")
    intervals: list[Interval] = []
    traces: list[list[Step]] = []
    for f in args.files:
        try:
            steps = read_trace(f)
        except (OSError, ValueError) as exc:
            ap.error(str(exc))
        traces.append(steps)
        intervals += busy_intervals(steps, args.max_gap_ms / 1e3, args.since)
    if not intervals:
        print("no busy decode stretches in the trace")
        return 1
    print("\n".join(range_table(traces, args.max_gap_ms / 1e3, args.since)))
    print()
    if args.gain:
        gain_rows = gain_table(traces)
        print("The per-request gate replayed over the lone requests' drafts, by the estimate each was priced at:")
        print()
        print("\n".join(gain_rows) if gain_rows else "no lone request verified a draft")
        print()
    vllm_rows = vllm_table(traces, args.since)
    if vllm_rows:
        print("\n".join(vllm_rows))
        print()
    cpu_rows = cpu_table(traces, args.max_gap_ms / 1e3, args.min_steps)
    if cpu_rows:
        print("\n".join(cpu_rows))
        print()
    gc_rows = gc_table(traces, args.min_steps, args.max_gap_ms / 1e3)
    _print_titled("Decode steps with a garbage collection of the engine core's process in them:", gc_rows)
    if args.gpu_clocks:
        try:
            clocks = read_clocks(args.gpu_clocks)
        except (OSError, ValueError) as exc:
            ap.error(str(exc))
        clock_rows = clock_table(traces, clocks, args.max_gap_ms / 1e3, args.min_steps)
        print(
            "\n".join(clock_rows) if clock_rows else f"no burst of the trace falls in the samples of {args.gpu_clocks}"
        )
        print()
    if args.cells:
        cells = cell_windows(args.cells)
        if not cells:
            ap.error(f"{args.cells}: no cell JSON with window_perf_s")
        print("\n".join(cell_table(intervals, cells, args.min_steps)))
        print()
    if args.paired:
        from .paired import load_result

        try:
            windows, off = paired_windows(traces[0], load_result(Path(args.paired)), args.arm)
        except ValueError as exc:
            ap.error(str(exc))
        print("\n".join(paired_cell_table(intervals, windows, args.requests, args.min_steps)))
        if off:
            print(f"\n{len(off)} of {len(windows)} bursts differ from the result's step counts: not matched")
        print()
        print("Where a burst's time went, per burst (steps by kind: output-to-output ms):")
        print()
        print("\n".join(burst_time_table(traces[0], windows)))
        print()
        _print_titled("Probes (runs of steps that propose drafts), per burst:", probe_table(traces[0], windows))
        _print_titled("Which rule set K, per burst (steps; K proposed: steps):", rule_table(traces[0], windows))
    if args.against:
        others = []
        for f in args.against:
            try:
                others.append((Path(f).name, read_trace(f)))
            except (OSError, ValueError) as exc:
                ap.error(str(exc))
        rows = matched_table(traces[0], others, args.max_gap_ms / 1e3, args.match_s, args.min_steps)
        print(f"Against {Path(args.files[0]).name}, burst by burst (K = 0 pure-decode steps):")
        print()
        print("\n".join(rows))
        print()
    if args.lone > 0:
        print("\n".join(lone_table(traces, args.lone)))
        print()
    keys = ["k_drafted", "k_proposed", "transition"]
    if any(iv.graph for iv in intervals):  # vLLM ran with --cudagraph-metrics
        keys.append("graph")
    for key in keys:
        print("\n".join(table(intervals, key, args.min_steps)))
        print()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
