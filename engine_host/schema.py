"""The engine host's contract: pydantic models of every body that crosses a process boundary.

* :class:`LiveConfig` (defined in :mod:`engine_host.config`): the config in force, what a
  config version stores; :class:`ConfigPatch` is the body of ``PUT /control/config``.
* :class:`CoreState`: what the engine core publishes on the control channel
  (:mod:`engine_host.channel`) for the API process.
* :class:`ControlState`: ``GET /control/state``.
* :class:`ApplyAnswer`: the answer of ``PUT /control/config`` (200);
  :class:`ErrorAnswer` its refusals (409, 413, 422).
* :class:`Sample` (defined in :mod:`engine_host.sample` with its builder): one per-second
  sample of ``GET /control/samples``, the same row the collector stores.
* :class:`WarmupRunsAnswer`: ``GET /control/warmup/runs``.

The engine host's routes declare these models, so the served OpenAPI schema is the
contract; :mod:`control.client` validates answers through them and the test fake of an
engine host builds its bodies with them, so neither can drift from the engine. Units:
times in unix seconds (``*_at``), durations in s or ms as named, K in tokens, fractions 0..1.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from .config import EngineLimits, LiveConfig, SpeculationConfig
from .sample import Sample

__all__ = [
    "ApplyAnswer",
    "BatchState",
    "ConfigPatch",
    "ControlState",
    "CoreState",
    "DiffEntry",
    "EngineIdentity",
    "EngineLimits",
    "EnginePatch",
    "ErrorAnswer",
    "ErrorItem",
    "LiveConfig",
    "Sample",
    "SamplesAnswer",
    "SpeculationConfig",
    "SpeculationState",
    "WarmupRunsAnswer",
    "openapi_schema",
]

Number = int | float


class _Body(BaseModel):
    """A body the engine host writes: every field named, nothing else."""

    model_config = ConfigDict(extra="forbid")


class _Open(BaseModel):
    """A body whose known fields are typed and whose further fields pass through."""

    model_config = ConfigDict(extra="allow")


# --------------------------------------------------------------------------- requests


class EnginePatch(_Body):
    """Start-up settings named in a config patch: each must equal the engine's (else 409)."""

    model: str | None = None
    k_max: int | None = None
    max_num_seqs: int | None = None
    max_num_batched_tokens: int | None = None
    max_model_len: int | None = None
    speculative_method: str | None = None


class ConfigPatch(LiveConfig):
    """Body of ``PUT /control/config``: any subset of :class:`LiveConfig` (sections are
    merged into the config in force, lists replaced), optionally with ``engine``."""

    engine: EnginePatch | None = Field(None, description="start-up settings; naming a different value is 409")


# --------------------------------------------------------------------------- engine core -> API


class CoreState(_Open):
    """What the engine core publishes on the control channel (scheduler hook), a few
    times a second and after each config decision."""

    core_pid: int
    core_started_at: float
    core_cpu: int | None = None
    core_thread_cpus: list[int] | None = None
    core_cpu_threads_moved: int = 0
    published_at: float
    limits: EngineLimits
    config_version: int
    config: dict[str, Any] = Field(description="LiveConfig dump in force")
    config_applied_at: float | None = None
    config_ack_step: int | None = None
    config_error: str | None = None
    k_current: int | None = Field(None, description="K of the last engine step (tokens)")
    k_next: int | None = Field(None, description="K the policy will use for the next step (tokens)")
    warmup_k: int | None = None
    warmup_steps_at_k: list[int] = Field(default_factory=list)
    k_first_use_step: int | None = None
    step_index: int = 0
    running: int = 0
    waiting: int = 0
    max_running_seen_since_config: int = 0
    caps_in_force: dict[str, int] = Field(default_factory=dict)
    controller: dict[str, Any] = Field(default_factory=dict)
    per_request: dict[str, Any] | None = None
    overhead: dict[str, Any] | None = None


# --------------------------------------------------------------------------- GET /control/state


class SpeculationState(_Body):
    """``speculation`` section of :class:`ControlState`."""

    mode: str | None
    k_current: int | None = Field(description="K of the last engine step (tokens); an idle engine keeps the old one")
    k_next: int | None = Field(None, description="K the policy will use for the next step (tokens): the K in force")
    k: int | None = Field(description="configured K for mode 'fixed' (tokens)")
    k_min: int | None
    k_max: int | None = Field(description="upper bound of K in force (tokens)")
    k_max_engine: int | None = Field(description="K_max the engine was started with (tokens)")
    method: str | None = None
    draft_model: str | None = None
    draft_name: str | None = None
    per_request: dict[str, Any] | None = None


class BatchState(_Body):
    """``batch`` section of :class:`ControlState`: caps in force and the scheduler's counts."""

    max_num_seqs: int | None
    max_num_batched_tokens: int | None
    running: int | None
    waiting: int | None
    max_running_seen_since_config: int | None = None


class EngineIdentity(_Body):
    """``engine`` section of :class:`ControlState`: which processes answer."""

    pid: int
    started_at: float
    core_pid: int | None
    core_started_at: float | None
    core_cpu: int | None = Field(None, description="the CPU the engine core's step loop is pinned to (--core-cpu)")
    core_thread_cpus: list[int] | None = Field(None, description="the CPUs the step loop's thread may run on now")
    core_cpu_threads_moved: int | None = Field(
        None,
        description="threads of the engine host moved off the step loops' CPUs since it started (engine hosts "
        "started after it, threads born of the step loop)",
    )
    phase: str = Field(description="loading, warming_up, ready or warmup_failed")
    ready_at: float | None = None
    model: str | None = None
    step_index: int | None = None


class ControlState(_Open):
    """``GET /control/state``. Further top-level sections pass through (the dual engine
    host adds ``router``)."""

    config_version: int | None
    config: LiveConfig
    config_applied_at: float | None = None
    config_error: str | None = None
    config_ack_step: int | None = None
    k_first_use_step: int | None = None
    speculation: SpeculationState
    batch: BatchState
    limits: EngineLimits
    controller: dict[str, Any]
    overhead: dict[str, Any] | None = None
    engine: EngineIdentity
    warmup: dict[str, Any] | None = None


# --------------------------------------------------------------------------- PUT /control/config


class DiffEntry(_Body):
    """One changed field: ``{"field": "speculation.k", "old": 2, "new": 4}``."""

    field: str
    old: Any = None
    new: Any = None


class ApplyAnswer(_Open):
    """200 answer of ``PUT /control/config``: what took effect. Further sections pass
    through (the dual engine host adds ``router`` and ``plain_engine``)."""

    config_version: int
    previous_version: int
    config: LiveConfig
    diff: list[DiffEntry]
    applied: bool
    applied_at: float | None = Field(None, description="unix s the engine core applied it")
    ack_step: int | None = Field(None, description="engine step index at the acknowledgement")
    apply_latency_ms: float
    k_current: int | None = None
    k_next: int | None = Field(None, description="K the policy uses from the next step (tokens)")


class ErrorItem(_Body):
    """One reason a request was refused: the field (``loc``) and what is wrong."""

    loc: list[str | int]
    msg: str


class ErrorAnswer(_Body):
    """A refusal: 409 (needs a restart), 413 (too large), 422 (invalid); nothing changed."""

    detail: list[ErrorItem]
    message: str


# --------------------------------------------------------------------------- samples and runs


class SamplesAnswer(_Body):
    """``GET /control/samples``."""

    now: float
    samples: list[Sample]


class WarmupRunsAnswer(_Body):
    """``GET /control/warmup/runs``."""

    runs: list[dict[str, Any]]
    warmup: dict[str, Any] | None = None
    phase: str | None = None
    warmup_steps_at_k: list[int] | None = None
    heartbeats: list[dict[str, Any]] = Field(default_factory=list)
    internal_requests_total: int = 0


def openapi_schema(model: type[BaseModel]) -> dict[str, Any]:
    """``model``'s JSON schema (validation side) with every ``$ref`` inlined, for an
    OpenAPI ``requestBody`` declared by hand (routes that parse their own body)."""
    schema = model.model_json_schema(mode="validation")
    defs = schema.pop("$defs", {})

    def inline(node: Any) -> Any:
        if isinstance(node, dict):
            ref = node.get("$ref")
            if isinstance(ref, str) and ref.startswith("#/$defs/"):
                rest = {k: v for k, v in node.items() if k != "$ref"}
                return {**inline(defs[ref.rsplit("/", 1)[1]]), **inline(rest)}
            return {k: inline(v) for k, v in node.items()}
        if isinstance(node, list):
            return [inline(v) for v in node]
        return node

    return inline(schema)
