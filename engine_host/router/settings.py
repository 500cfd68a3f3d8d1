"""The dual engine host's routing settings: one pydantic model, one default per field.

:class:`RouterSettings` is used by the command line of ``python -m engine_host.router``
(its options and their defaults), by the live ``PUT /control/config {"router": {...}}``
(validation), by the traffic split (:class:`engine_host.router.split.TrafficSplit` holds
one) and by the live config (:class:`engine_host.config.LiveConfig` carries it as its
``router`` section, so routing changes are versioned, audited and rolled back like the
rest of a config). What each setting does is explained in :mod:`engine_host.router.split`.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

PLAIN = "plain"
SPECULATIVE = "speculative"
ENGINES = (PLAIN, SPECULATIVE)
RoutingMode = Literal["auto", "plain", "speculative"]
ROUTING_MODES: tuple[str, ...] = RoutingMode.__args__  # type: ignore[attr-defined]
#: The numeric settings of the split (all of :class:`RouterSettings` but ``mode``).
SPLIT_SETTINGS = (
    "p_min",
    "p_max",
    "eta",
    "tpot_margin",
    "p_probe",
    "probe_every_s",
    "probe_s",
    "probe_backoff",
    "probe_every_max_s",
)
#: Initial share of requests for the speculative engine (fraction 0..1): a start-up value
#: (``--p-start``), not a setting; the share moves from there.
DEFAULT_P_START = 0.1


def _number(default: float, description: str, **bounds: Any) -> Any:
    # strict: true and "0.5" are refused, not read as 1.0 and 0.5; NaN and infinity too
    return Field(default, description=description, strict=True, allow_inf_nan=False, **bounds)


class RouterSettings(BaseModel):
    """How the dual engine host splits requests between its plain and speculative engine.

    Shares are fractions 0..1 of new requests; times are seconds (monotonic clock).

    Raises (on construction or ``model_validate``):
        pydantic.ValidationError (a ValueError): an unknown setting, a value that is not a
            number (booleans and strings included) or not finite, a value outside its
            bounds, ``p_min > p_max``, or ``probe_s > probe_every_s`` while probes are on.
    """

    model_config = ConfigDict(extra="forbid")

    mode: RoutingMode = Field(
        "auto", description="auto: follow the engines' TPOT; plain or speculative: every request to that engine"
    )
    p_min: float = _number(
        0.01,
        "floor of the speculative engine's share (fraction 0..1); resting there, it gets only probes",
        ge=0.0,
        le=1.0,
    )
    p_max: float = _number(
        0.97,
        "largest share of requests for the speculative engine (fraction 0..1); below 1 "
        "keeps the plain engine's TPOT measured",
        ge=0.0,
        le=1.0,
    )
    eta: float = _number(
        0.5, "step of the share's multiplicative update per poll (every 0.25 s), in (0, 5]", gt=0.0, le=5.0
    )
    tpot_margin: float = _number(
        0.0,
        "fraction (0..10) by which the speculative engine's TPOT must beat the "
        "plain engine's before it gains traffic (both share the host's GPU and cores)",
        ge=0.0,
        le=10.0,
    )
    p_probe: float = _number(0.1, "share sent to the speculative engine during a probe (fraction 0..1)", ge=0.0, le=1.0)
    probe_every_s: float = _number(
        20.0,
        "seconds from the share's coming to rest to the first probe of the "
        "speculative engine; 0: no probes, a constant share of p_min instead",
        ge=0.0,
    )
    probe_s: float = _number(1.0, "length of a probe (s), at most probe_every_s", gt=0.0)
    probe_backoff: float = _number(
        2.0,
        "factor (1..10) on the time to the next probe after each probe that "
        "leaves the share at its floor; 1: a probe every probe_every_s seconds",
        ge=1.0,
        le=10.0,
    )
    probe_every_max_s: float = _number(300.0, "longest time between probes (s) that the backoff reaches", ge=0.0)

    @model_validator(mode="after")
    def _check_together(self) -> RouterSettings:
        if self.p_min > self.p_max:
            raise ValueError(f"need 0 <= p_min <= p_max <= 1, got p_min={self.p_min}, p_max={self.p_max}")
        if self.probe_every_s > 0.0 and self.probe_s > self.probe_every_s:
            raise ValueError(
                f"probe_s must be in (0, probe_every_s], got probe_s={self.probe_s}, probe_every_s={self.probe_every_s}"
            )
        return self

    def split_settings(self) -> dict[str, float]:
        """The numeric settings (:data:`SPLIT_SETTINGS`) as ``{name: float}``."""
        return {k: float(getattr(self, k)) for k in SPLIT_SETTINGS}

    def patched(self, patch: Any) -> RouterSettings:
        """These settings with ``patch`` (any subset of the fields, a JSON object) applied.

        Raises:
            ValueError: ``patch`` is not an object, or the result is invalid; the message
                names each setting and says why (:func:`describe_errors`).
        """
        if not isinstance(patch, dict):
            raise ValueError("router settings must be a JSON object")
        try:
            return RouterSettings.model_validate({**self.model_dump(), **patch})
        except ValidationError as exc:
            raise ValueError(describe_errors(exc)) from None


def describe_errors(exc: ValidationError) -> str:
    """One line naming each invalid router setting and the reason, e.g.
    ``"speed: unknown router setting (known: mode, p_min, ...); eta: must be > 0"``."""
    parts = []
    for e in exc.errors(include_url=False):
        loc = ".".join(str(x) for x in e["loc"])
        if e["type"] == "extra_forbidden":
            msg = f"unknown router setting (known: {', '.join(RouterSettings.model_fields)})"
        elif e["type"] in ("float_type", "float_parsing"):
            msg = f"must be a number, got {e.get('input')!r}"
        else:
            msg = str(e["msg"]).removeprefix("Value error, ")
        parts.append(f"{loc}: {msg}" if loc else msg)
    return "; ".join(parts)
