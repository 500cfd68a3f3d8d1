"""A per-step trace of the engine core: when each step was scheduled and handed back, and its K.

For profiling the cost of draft length K on an engine that runs with async scheduling, where
the hook's step clock (``engine_host.step_clock``) cannot tell what a step at K > 0 costs
from what overlaps it: the interval between two consecutive outputs of a busy engine is the
wall time of the later step, whatever overlaps what. ``python -m bench step-trace FILE`` groups
those intervals by the K each step verified and proposed.

Enabled with ``$SPECPILOT_STEP_TRACE`` (a file path; the engine core appends ``.PID``). The
hook buffers each row's values in memory and makes their text and appends it to the file when
the engine waits for work, or once ``TRACE_FLUSH_ROWS`` rows are kept (``engine_host.scheduler``),
so tracing adds no file I/O and no text formatting to a step. The hook's lean path at K = 0, which
skips most outputs, stays on while tracing; each skipped output still gets its row.

File format: CSV with a header, one row per step output:
``t_scheduled_s,t_output_s`` (``time.perf_counter()`` of the engine core, s),
``k_drafted`` (tokens: the K the drafts this step verified were proposed at; an n-gram
proposer may have found fewer), ``k_proposed`` (tokens: the K chosen in this step for the next
drafts), ``decode`` (requests in the step that only decoded),
``requests`` (requests in the step), ``tokens`` (tokens scheduled in the step), ``context``
(tokens: the KV-cache length of the step's requests after it, summed; a request that finished
in the step is left out; attention's share of a step follows it), ``graph`` (the CUDA graph
mode vLLM's model runner ran the step in: ``FULL``, ``PIECEWISE`` or ``NONE``; empty unless vLLM
runs with ``--cudagraph-metrics``, which the engine host adds on a GPU while tracing, and on
the CPU build), ``draft_tokens`` and ``accepted_tokens`` (tokens: the drafts this step's output
verified, summed over its requests, and how many of them were accepted), ``estimate`` (fraction
0..1: the highest per-request acceptance estimate of the running requests after those
verifications, ``engine_host.request_gate``), ``prior`` (fraction 0..1: where a new request of
the newest running request's class would start), ``token_cost`` (fraction of a plain request-step:
what the gate last priced one verified draft token at) and ``step_cost`` (fraction of a plain
step: what it last priced a step at K > 0 that verifies no draft at). These four are empty when the
per-request gate is off, when more than ``TRACE_ESTIMATE_MAX_BATCH`` (8) requests are running
(the scheduler hook's limit), and on the lean path's rows, where the two token columns are 0.
``path`` (``lean`` or ``full``: the hook's path that handled the output, ``engine_host.scheduler``),
``vllm_schedule_us`` and ``vllm_update_us`` (µs: vLLM's own ``schedule()`` for the step and its own
``update_from_output()`` for the output, inside the hook's overrides and outside the hook's clock:
whether vLLM's work per step differs with the hook's path), ``cpu`` (the CPU the engine core's
thread ran on when the row was added, from the C library's ``sched_getcpu``; empty where it is
not available: a step's speed can follow the core it runs on, and on a host of several NUMA nodes
the node's distance from the GPU), ``gc_us`` and ``gc_gen`` (µs: the time Python's cyclic garbage
collector ran in the engine core's process since the row before, through ``gc.callbacks``, and the
oldest generation it collected; both empty when it did not run: an engine whose steps allocate more
objects sets it off more often, and a collection lands on whatever step is running), ``rule`` (which
of the scheduler hook's rules set ``k_proposed``: ``policy`` (the adaptive policy's K, or a static K),
``explore`` (the policy's exploration: run past the per-request gate at several requests, through the gate's
answer below that), ``held`` (an exploration the class test left to the gate, whose answer still drafted), ``batch``
(the running requests' own estimates raised it, async scheduling), ``lone`` (a lone request's own
depth or probe depth raised it), ``probe`` (the gate's all-request probe, async scheduling), ``gate``
(the gate held the policy's K > 0 at 0), ``warmup``; empty on the lean path and where the hook did
not decide K). Traces written before a column read as context 0, no graph mode, no draft or accepted
tokens, no estimate or costs, no path or vLLM times, no CPU, no collection and no rule.
"""

from __future__ import annotations

import atexit
import ctypes
import gc
import os
import time
from collections import deque
from typing import Callable

from . import envs

HEADER = (
    "t_scheduled_s,t_output_s,k_drafted,k_proposed,decode,requests,tokens,context,graph,"
    "draft_tokens,accepted_tokens,estimate,prior,token_cost,step_cost,path,vllm_schedule_us,vllm_update_us,cpu,"
    "gc_us,gc_gen,rule\n"
)


def _cpu_reader() -> Callable[[], int] | None:
    """The C library's ``sched_getcpu`` (the CPU the calling thread runs on, a vDSO call on
    Linux), or None where the library has none."""
    try:
        fn = ctypes.CDLL(None, use_errno=True).sched_getcpu
    except (OSError, AttributeError):
        return None
    fn.restype = ctypes.c_int
    fn.argtypes = []
    return fn


class StepTrace:
    """Buffered writer of per-step rows (see the module docstring).

    Args:
        path: the trace file (created with its header when it does not exist).
        max_rows: rows kept in memory before the oldest are dropped, when ``flush`` is
            not called (bounded memory on a long run).
        time_gc: time the process's garbage collections for the ``gc_us`` and ``gc_gen``
            columns (a ``gc.callbacks`` hook, until :meth:`close`); False leaves them empty.
    """

    def __init__(self, path: str, max_rows: int = 200_000, time_gc: bool = False):
        self.path = path
        self._rows: deque[tuple] = deque(maxlen=max_rows)
        self.dropped = 0  # rows that fell out of a full buffer
        self._cpu = _cpu_reader()
        # Python's garbage collections since the last row: seconds, the oldest generation (-1:
        # none) and when the running one started (gc.callbacks; removed by close())
        self._gc_s = 0.0
        self._gc_gen = -1
        self._gc_t0 = 0.0
        if time_gc:
            gc.callbacks.append(self._on_gc)
        if not os.path.exists(path):
            with open(path, "w", encoding="utf-8") as f:
                f.write(HEADER)

    def _on_gc(self, phase: str, info: dict) -> None:
        """``gc.callbacks`` hook: time each collection (start to stop) and keep its generation."""
        if phase == "start":
            self._gc_t0 = time.perf_counter()
        elif self._gc_t0:
            self._gc_s += time.perf_counter() - self._gc_t0
            self._gc_t0 = 0.0
            gen = int(info.get("generation", 0))
            if gen > self._gc_gen:
                self._gc_gen = gen

    def close(self) -> None:
        """Stop timing garbage collections (the rows kept stay; :meth:`flush` still writes them)."""
        if self._on_gc in gc.callbacks:
            gc.callbacks.remove(self._on_gc)

    def add(
        self,
        t_scheduled: float,
        t_output: float,
        k_drafted: int,
        k_proposed: int,
        decode: int,
        requests: int,
        tokens: int,
        context: int = 0,
        graph: str = "",
        draft_tokens: int = 0,
        accepted_tokens: int = 0,
        estimate: float | None = None,
        prior: float | None = None,
        token_cost: float | None = None,
        step_cost: float | None = None,
        path: str = "",
        vllm_schedule_s: float | None = None,
        vllm_update_s: float | None = None,
        rule: str = "",
    ) -> None:
        """Record one step's output (times in s of ``time.perf_counter()``; K, tokens and
        context in tokens; ``graph``: the step's CUDA graph mode, "" when not known;
        ``estimate`` and ``prior``: fractions 0..1; ``token_cost`` and ``step_cost``: fractions
        of a plain step; each None when not known; ``path``: ``lean`` or ``full``, "" when not
        known; ``vllm_schedule_s`` and ``vllm_update_s``: s, written in µs, None when not
        measured; ``rule``: the hook's rule that set ``k_proposed``, "" when none)."""
        if len(self._rows) == self._rows.maxlen:
            self.dropped += 1
        cpu = self._cpu() if self._cpu is not None else -1
        if self._gc_gen >= 0:
            gc_s, gc_gen = self._gc_s, self._gc_gen
            self._gc_s, self._gc_gen = 0.0, -1
        else:
            gc_s, gc_gen = 0.0, -1
        # the values as they are: the text is made at flush(), which the hook calls when the
        # engine waits for work or every TRACE_FLUSH_ROWS rows, not on every step
        self._rows.append(
            (
                t_scheduled,
                t_output,
                k_drafted,
                k_proposed,
                decode,
                requests,
                tokens,
                context,
                graph,
                draft_tokens,
                accepted_tokens,
                estimate,
                prior,
                token_cost,
                step_cost,
                path,
                vllm_schedule_s,
                vllm_update_s,
                cpu,
                gc_s,
                gc_gen,
                rule,
            )
        )

    @property
    def pending(self) -> int:
        """Rows buffered, not yet written."""
        return len(self._rows)

    def flush(self) -> None:
        """Append the buffered rows to the file. Raises ``OSError`` when it cannot be written
        (the rows are kept for the next try)."""
        if not self._rows:
            return
        text = [_row_text(r) for r in self._rows]
        with open(self.path, "a", encoding="utf-8") as f:
            f.writelines(text)
        self._rows.clear()


def _row_text(row: tuple) -> str:
    """One buffered row (:meth:`StepTrace.add`'s values, then the CPU, the collection's s and
    generation, and the rule) as its CSV line."""
    (ts, to, kd, kp, dec, req, tok, ctx, graph, dt, at, est, pri, tc, sc, path, vs, vu, cpu, gc_s, gc_gen, rule) = row
    est_s = "" if est is None else f"{est:.3f}"
    pri_s = "" if pri is None else f"{pri:.3f}"
    tc_s = "" if tc is None else f"{tc:.4f}"
    sc_s = "" if sc is None else f"{sc:.4f}"
    vs_s = "" if not vs else f"{vs * 1e6:.1f}"
    vu_s = "" if vu is None else f"{vu * 1e6:.1f}"
    gcs = f"{gc_s * 1e6:.1f},{gc_gen}" if gc_gen >= 0 else ","
    return (
        f"{ts:.6f},{to:.6f},{kd},{kp},{dec},{req},{tok},{ctx},{graph},"
        f"{dt},{at},{est_s},{pri_s},{tc_s},{sc_s},{path},{vs_s},{vu_s},{cpu if cpu >= 0 else ''},{gcs},{rule}\n"
    )


def graph_mode(stats: object) -> str:
    """The CUDA graph mode of one step from vLLM's ``CUDAGraphStat`` (``runtime_mode``:
    ``str(CUDAGraphMode.FULL)``, the mode's name; a qualified ``CUDAGraphMode.FULL`` reads the
    same): ``"FULL"``, ``"PIECEWISE"``, ``"NONE"``; ``""`` for None (vLLM runs without
    ``--cudagraph-metrics``, or the CPU build)."""
    mode = getattr(stats, "runtime_mode", None)
    if mode is None:
        return ""
    return str(mode).rsplit(".", 1)[-1]


def step_trace_from_env() -> StepTrace | None:
    """The engine core's trace when ``$SPECPILOT_STEP_TRACE`` is set (file ``PATH.PID``), else None."""
    path = envs.step_trace()
    if not path:
        return None
    trace = StepTrace(f"{path}.{os.getpid()}", time_gc=True)
    atexit.register(_flush_quietly, trace)
    return trace


def _flush_quietly(trace: StepTrace) -> None:
    try:
        trace.flush()
    except OSError:
        pass
