"""The live config of an engine host: what can change while the engine runs.

One set of pydantic models, used by the engine host's HTTP API, the engine-core
scheduler hook, the control plane's store and the dashboard's forms, so that a field
is defined (and validated) once.

A config has these sections:

* ``speculation``: the speculation policy and its parameters (draft length K in
  tokens, bounds, tables);
* ``batch``: caps on running sequences (``max_num_seqs``) and on tokens per engine
  step (``max_num_batched_tokens``), at or below the engine's start-up values;
* ``warmup``: heartbeat schedules;
* ``router`` (a dual engine host only, ``python -m engine_host.router``): the routing mode
  and traffic split's settings (:class:`engine_host.router.settings.RouterSettings`).
  Absent (None, and left out of dumps) on a host that serves one engine, which refuses it.

Start-up settings (model, K_max, batch ceilings, max_model_len) are described by
:class:`EngineLimits`; changing them needs a restart, so a request that tries is
refused with HTTP 409 (:class:`RestartRequired`).
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_serializer, model_validator

from .router.settings import RouterSettings

SpeculationMode = Literal["off", "fixed", "adaptive", "batch_table", "threshold", "heuristic"]
SPECULATION_MODES: tuple[str, ...] = SpeculationMode.__args__  # type: ignore[attr-defined]

#: Rows a batch table may have.
MAX_TABLE_ROWS = 1024
#: Floor of the live ``max_num_batched_tokens`` cap (tokens), see :func:`min_batched_tokens`.
MIN_BATCHED_TOKENS = 256


class _Strict(BaseModel):
    # One validation for every field: unknown fields refused, strict types ("4" is not
    # an int, true is not 1), no Infinity/NaN in any float field.
    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)


class AdaptiveParams(_Strict):
    """Tuning of the adaptive goodput controller (see ``engine_host.controller``)."""

    margin: float = Field(0.05, ge=0.0, le=1.0, description="speculation must beat K=0 goodput by this fraction")
    hysteresis: float = Field(0.03, ge=0.0, le=1.0, description="a new K must beat the current one by this fraction")
    ema_alpha: float = Field(
        0.01,
        gt=0.0,
        le=1.0,
        description="weight of one decode request-step in the acceptance estimates "
        "(memory about 1/ema_alpha request-steps)",
    )
    explore_every: int = Field(40, ge=0, description="steps between explorations of a neighbouring K (0: never)")
    per_request: bool = Field(
        True,
        description="verify drafts only of the requests whose own acceptance makes "
        "them pay (engine_host.request_gate); the others are verified without drafts, and a "
        "step in which none pays runs at K = 0 (under async scheduling only the latter)",
    )
    probe_every: int = Field(
        16,
        ge=1,
        le=10000,
        description="a request whose drafts were dropped is drafted again after this many steps "
        "(under async scheduling: one step for every request after this many steps at K = 0)",
    )
    prior: Literal["mixture", "pooled"] = Field(
        "mixture",
        description="where a request's acceptance estimate starts under the per-request gate: "
        "'mixture', the distribution of acceptance over its class's finished requests, so that one "
        "rejected draft moves a request to the class's requests that reject; 'pooled', a Beta "
        "prior at the acceptance pooled over its class's recent draft tokens "
        "(engine_host.request_gate)",
    )
    gain: Literal["calibrated", "geometric"] = Field(
        "calibrated",
        description="how the per-request gate reads a draft's expected accepted tokens: "
        "'calibrated', the geometric law moved toward what the class's drafts at a like "
        "acceptance estimate yielded, so drafts of copied text that are accepted a long way "
        "or not at all are priced as they pay; 'geometric', sum of a^j over the draft's "
        "positions (engine_host.request_gate)",
    )


class ThresholdParams(_Strict):
    """The threshold loop copied from blog posts: every ``interval_s`` seconds, raise K
    by 1 when the acceptance rate is above ``raise_above``, lower it under
    ``lower_below``, switch speculation off under ``off_below``; K stays within
    ``k_low..k_high`` while on."""

    interval_s: float = Field(10.0, gt=0.0)
    raise_above: float = Field(0.75, ge=0.0, le=1.0)
    lower_below: float = Field(0.6, ge=0.0, le=1.0)
    off_below: float = Field(0.4, ge=0.0, le=1.0)
    k_low: int = Field(2, ge=1)
    k_high: int = Field(8, ge=1)


class SpeculationConfig(_Strict):
    """Speculation policy.

    Modes:
        off:         K = 0 (no drafts).
        fixed:       static K = ``k``.
        adaptive:    K chosen each step in ``k_min..k_max`` by goodput (arXiv 2406.14066).
        batch_table: K by batch size from ``table`` (vLLM's
                     ``num_speculative_tokens_per_batch_size`` semantics).
        threshold:   the 10 s acceptance-threshold loop (:class:`ThresholdParams`).
        heuristic:   transformers' assisted generation: all drafts accepted -> K += 2,
                     otherwise K -= 1 (floor 1), within ``k_min..k_max``.
    """

    mode: SpeculationMode = "fixed"
    k: int = Field(0, ge=0, description="draft length K (tokens) for mode 'fixed'")
    k_min: int = Field(0, ge=0, description="lower bound of K for adaptive/heuristic (tokens)")
    k_max: int | None = Field(None, ge=0, description="upper bound of K (tokens); None = engine K_max")
    table: list[tuple[int, int, int]] | None = Field(
        None,
        max_length=MAX_TABLE_ROWS,
        description="batch_table: [(batch_start, batch_end, K), ...], inclusive ranges starting at 1",
    )
    adaptive: AdaptiveParams = Field(default_factory=AdaptiveParams)
    threshold: ThresholdParams = Field(default_factory=ThresholdParams)

    @field_validator("table", mode="before")
    @classmethod
    def _rows_as_tuples(cls, value: Any) -> Any:
        # JSON has no tuples: accept each row as a 3-element array (elements stay strict ints)
        if isinstance(value, list):
            return [tuple(row) if isinstance(row, list) else row for row in value]
        return value

    @model_validator(mode="after")
    def _check_bounds(self) -> "SpeculationConfig":
        if self.k_max is not None and self.k_min > self.k_max:
            raise ValueError(f"k_min={self.k_min} is above k_max={self.k_max}")
        if self.mode == "batch_table":
            if not self.table:
                raise ValueError("mode 'batch_table' needs a non-empty 'table' of (batch_start, batch_end, K)")
            prev_end = 0
            for start, end, k in sorted(self.table):
                if start < 1 or end < start or k < 0:
                    raise ValueError(f"table entry ({start}, {end}, {k}) is invalid: need 1 <= start <= end, K >= 0")
                if start <= prev_end:
                    raise ValueError("table ranges overlap")
                prev_end = end
            if min(s for s, _, _ in self.table) != 1:
                raise ValueError("the first table range must start at batch size 1")
        if self.threshold.k_low > self.threshold.k_high:
            raise ValueError("threshold.k_low is above threshold.k_high")
        return self


class BatchConfig(_Strict):
    """Batch caps in force (None = the start-up value)."""

    max_num_seqs: int | None = Field(None, ge=1, description="cap on running sequences")
    max_num_batched_tokens: int | None = Field(None, ge=1, description="cap on tokens per engine step")


class HeartbeatSchedule(_Strict):
    """A heartbeat: synthetic requests that keep the engine warm.

    Exactly one of ``interval_s`` (every N seconds) and ``cron`` (a 5-field cron
    expression, evaluated in UTC by croniter) is set. With ``idle_s`` set, a due
    heartbeat is skipped while real traffic flowed in the last ``idle_s`` seconds.
    Heartbeat requests are excluded from user-facing latency and cost figures and
    counted on their own (``specpilot:internal_requests_total``).
    """

    name: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.-]+$")
    interval_s: float | None = Field(None, gt=0, description="seconds between heartbeats")
    cron: str | None = Field(None, description="cron expression (UTC), e.g. '*/5 * * * *'")
    prompts: list[str] = Field(default_factory=lambda: ["Hello! Please reply with a short greeting."], min_length=1)
    max_tokens: int = Field(8, ge=1, le=1024, description="tokens generated per heartbeat request")
    idle_s: float | None = Field(30.0, ge=0, description="run only after this many seconds without real traffic")
    enabled: bool = True

    @model_validator(mode="after")
    def _check_schedule(self) -> "HeartbeatSchedule":
        if (self.interval_s is None) == (self.cron is None):
            raise ValueError("set exactly one of 'interval_s' and 'cron'")
        if self.cron is not None:
            from croniter import croniter

            if not croniter.is_valid(self.cron):
                raise ValueError(f"invalid cron expression {self.cron!r}")
        if any(not p.strip() for p in self.prompts):
            raise ValueError("prompts must not be empty")
        return self


class WarmupConfig(_Strict):
    """Heartbeat schedules, versioned with the rest of the config."""

    heartbeats: list[HeartbeatSchedule] = Field(default_factory=list)

    @model_validator(mode="after")
    def _unique_names(self) -> "WarmupConfig":
        names = [h.name for h in self.heartbeats]
        if len(names) != len(set(names)):
            raise ValueError("heartbeat names must be unique")
        return self


class LiveConfig(_Strict):
    """The full config in force on an engine host (what a config version stores)."""

    speculation: SpeculationConfig = Field(default_factory=SpeculationConfig)
    batch: BatchConfig = Field(default_factory=BatchConfig)
    warmup: WarmupConfig = Field(default_factory=WarmupConfig)
    router: RouterSettings | None = Field(
        None,
        description="routing between the plain and the speculative "
        "engine of a dual engine host; None on a host that serves one engine",
    )

    @model_serializer(mode="wrap")
    def _leave_out_absent_router(self, handler: Any):  # no return type: the schema stays the model's
        # a one-engine host's config dumps exactly as before the router section existed
        data = handler(self)
        if self.router is None and isinstance(data, dict):
            data.pop("router", None)
        return data


class EngineLimits(_Strict):
    """Start-up settings of an engine: fixed until a restart."""

    model: str
    k_max: int = Field(ge=0, description="num_speculative_tokens the engine was started with (0: no speculation)")
    max_num_seqs: int = Field(ge=1)
    max_num_batched_tokens: int = Field(ge=1)
    max_model_len: int = Field(ge=1)
    speculative_method: str | None = "ngram"
    draft_model: str | None = Field(
        None, description="draft model or head the engine loaded (path or hub id); None for n-gram drafts"
    )
    dual: bool = Field(
        False,
        description="a dual engine host (python -m engine_host.router: a plain and a "
        "speculative engine behind one address); only there does the config's router section apply",
    )


class ConfigError(ValueError):
    """A config request that is refused; nothing changes.

    Attributes:
        status: HTTP status to answer with (422 invalid, 409 needs a restart).
        errors: list of ``{"loc": [...], "msg": str}`` naming each field and reason.
    """

    status = 422

    def __init__(self, errors: list[dict[str, Any]]):
        self.errors = errors
        super().__init__("; ".join(f"{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in errors))


class RestartRequired(ConfigError):
    """The change needs an engine restart (HTTP 409)."""

    status = 409


def _deep_merge(base: dict[str, Any], patch: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for key, value in patch.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = _deep_merge(out[key], value)
        else:
            out[key] = value
    return out


_RESTART_FIELDS = ("model", "k_max", "max_num_seqs", "max_num_batched_tokens", "max_model_len", "speculative_method")


def apply_patch(current: LiveConfig, patch: dict[str, Any], limits: EngineLimits) -> LiveConfig:
    """Merge a partial config into the one in force and validate the result.

    Args:
        current: the config in force.
        patch: any subset of the ``LiveConfig`` JSON (nested dicts), optionally with an
            ``engine`` section naming start-up settings (which must equal the limits).
        limits: the engine's start-up settings.
    Returns:
        The new config (``current`` is not modified).
    Raises:
        RestartRequired: the patch asks to change a start-up setting, or to speculate
            on an engine started without speculation (409).
        ConfigError: invalid values, unknown fields, K above K_max, caps above the
            start-up values (422); ``errors`` names each field.
    """
    if not isinstance(patch, dict):
        raise ConfigError([{"loc": ["body"], "msg": "the config must be a JSON object"}])
    patch = dict(patch)
    engine = patch.pop("engine", None)
    if engine is not None:
        if not isinstance(engine, dict):
            raise ConfigError([{"loc": ["engine"], "msg": "must be an object"}])
        unknown = sorted(set(engine) - set(_RESTART_FIELDS))
        if unknown:
            raise ConfigError([{"loc": ["engine", u], "msg": "unknown start-up setting"} for u in unknown])
        wrong_type = [k for k, v in engine.items() if not _same_type(v, getattr(limits, k))]
        if wrong_type:
            raise ConfigError(
                [
                    {
                        "loc": ["engine", k],
                        "msg": f"must be {type(getattr(limits, k)).__name__}, "
                        f"like the start-up value {getattr(limits, k)!r}",
                    }
                    for k in wrong_type
                ]
            )
        changed = [k for k, v in engine.items() if v != getattr(limits, k)]
        if changed:
            raise RestartRequired(
                [
                    {
                        "loc": ["engine", k],
                        "msg": f"{k} is a start-up setting ({getattr(limits, k)!r} now); "
                        f"changing it to {engine[k]!r} needs an engine restart",
                    }
                    for k in changed
                ]
            )
    try:
        merged = _deep_merge(current.model_dump(mode="json"), patch)
        new = LiveConfig.model_validate(merged)
    except ValidationError as exc:
        raise ConfigError([{"loc": list(e["loc"]), "msg": e["msg"]} for e in exc.errors(include_url=False)]) from None
    validate_against_limits(new, limits)
    return new


def _same_type(value: Any, current: Any) -> bool:
    if current is None or value is None:
        return True
    if isinstance(value, bool) != isinstance(current, bool):
        return False
    return isinstance(value, type(current))


def min_batched_tokens(limits: EngineLimits, max_num_seqs: int | None = None) -> int:
    """Floor of the live ``max_num_batched_tokens`` cap (tokens).

    A step must hold a decode token plus K_max draft tokens for every running sequence
    (``max_num_seqs * (1 + K_max)``) and a prefill chunk of at least
    :data:`MIN_BATCHED_TOKENS`; below that a long prompt is prefilled a few tokens per
    step (a 1,120-token prompt took minutes at a cap of 1). Never above the start-up value.

    Args:
        limits: the engine's start-up settings.
        max_num_seqs: the running-sequence cap in force (None: the start-up value).
    """
    seqs = max_num_seqs or limits.max_num_seqs
    return min(limits.max_num_batched_tokens, max(MIN_BATCHED_TOKENS, seqs * (1 + limits.k_max)))


def validate_against_limits(config: LiveConfig, limits: EngineLimits) -> None:
    """Check a config against the engine's start-up settings.

    Every K of the config (``k``, ``k_min``, ``k_max``, batch-table K, threshold
    ``k_low``/``k_high``) must be within the engine's K_max; caps must lie between their
    floor (``max_num_seqs`` >= 1, ``max_num_batched_tokens`` >= :func:`min_batched_tokens`)
    and the start-up value.

    Raises:
        RestartRequired: speculation asked of an engine started without it.
        ConfigError: K, bounds or caps outside what the engine can run, naming each field; a router
            section on a host that is not a dual engine host.
    """
    spec = config.speculation
    errors: list[dict[str, Any]] = []
    if config.router is not None and not limits.dual:
        errors.append(
            {
                "loc": ["router"],
                "msg": "routing settings apply only to a dual engine host "
                "(python -m engine_host.router); this engine host serves one engine",
            }
        )
    if limits.k_max == 0 and spec.mode != "off":
        raise RestartRequired(
            [
                {
                    "loc": ["speculation", "mode"],
                    "msg": "the engine was started without speculative decoding (K_max=0); "
                    "restart it with --k-max N to use mode " + repr(spec.mode),
                }
            ]
        )
    restart_hint = f"the engine's K_max is {limits.k_max} (a start-up setting: restart with a larger --k-max)"
    if spec.k > limits.k_max:
        errors.append({"loc": ["speculation", "k"], "msg": f"K={spec.k} is above K_max: {restart_hint}"})
    if spec.k_max is not None and spec.k_max > limits.k_max:
        errors.append({"loc": ["speculation", "k_max"], "msg": f"k_max={spec.k_max} is above K_max: {restart_hint}"})
    if spec.k_min > limits.k_max:
        errors.append({"loc": ["speculation", "k_min"], "msg": f"k_min={spec.k_min} is above K_max: {restart_hint}"})
    for i, (_start, _end, k) in enumerate(spec.table or []):
        if k > limits.k_max:
            errors.append({"loc": ["speculation", "table", i], "msg": f"K={k} is above K_max: {restart_hint}"})
    th, th_default = spec.threshold, ThresholdParams()
    for name in ("k_low", "k_high"):
        value = getattr(th, name)
        # the defaults (2..8) are clamped to a smaller K_max (ThresholdPolicy runs within
        # 0..K_max), also when the threshold policy is chosen: an operator is not refused
        # over a field they never set; a bound they set above K_max is refused
        if value > limits.k_max and value != getattr(th_default, name):
            errors.append(
                {"loc": ["speculation", "threshold", name], "msg": f"{name}={value} is above K_max: {restart_hint}"}
            )
    if spec.mode == "heuristic" and (spec.k_max if spec.k_max is not None else limits.k_max) < 1:
        errors.append({"loc": ["speculation", "k_max"], "msg": "heuristic mode needs k_max >= 1"})
    b = config.batch
    if b.max_num_seqs is not None and b.max_num_seqs > limits.max_num_seqs:
        errors.append(
            {
                "loc": ["batch", "max_num_seqs"],
                "msg": f"{b.max_num_seqs} is above the start-up max_num_seqs={limits.max_num_seqs} "
                "(raising the ceiling needs a restart)",
            }
        )
    if b.max_num_batched_tokens is not None and b.max_num_batched_tokens > limits.max_num_batched_tokens:
        errors.append(
            {
                "loc": ["batch", "max_num_batched_tokens"],
                "msg": f"{b.max_num_batched_tokens} is above the start-up "
                f"max_num_batched_tokens={limits.max_num_batched_tokens} (raising the ceiling needs a restart)",
            }
        )
    if b.max_num_batched_tokens is not None and b.max_num_batched_tokens <= limits.max_num_batched_tokens:
        floor = min_batched_tokens(limits, b.max_num_seqs)
        if b.max_num_batched_tokens < floor:
            errors.append(
                {
                    "loc": ["batch", "max_num_batched_tokens"],
                    "msg": f"{b.max_num_batched_tokens} is below the floor of {floor} tokens per step "
                    f"(max_num_seqs x (1 + K_max) = {(b.max_num_seqs or limits.max_num_seqs) * (1 + limits.k_max)}, "
                    f"at least {MIN_BATCHED_TOKENS}, at most the start-up value)",
                }
            )
    if errors:
        raise ConfigError(errors)


def effective_k_bounds(spec: SpeculationConfig, limits_k_max: int) -> tuple[int, int]:
    """Return ``(k_min, k_max)`` in force: the config's bounds clamped to the engine's K_max."""
    k_hi = limits_k_max if spec.k_max is None else min(spec.k_max, limits_k_max)
    return min(spec.k_min, k_hi), k_hi


def diff_configs(old: dict[str, Any], new: dict[str, Any], prefix: str = "") -> list[dict[str, Any]]:
    """Field-by-field difference of two config dicts.

    Returns:
        ``[{"field": "speculation.k", "old": 2, "new": 4}, ...]`` sorted by field.
    """
    out: list[dict[str, Any]] = []
    for key in sorted(set(old) | set(new)):
        path = f"{prefix}{key}"
        a, b = old.get(key), new.get(key)
        if isinstance(a, dict) and isinstance(b, dict):
            out.extend(diff_configs(a, b, path + "."))
        elif a != b:
            out.append({"field": path, "old": a, "new": b})
    return out
