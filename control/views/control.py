"""The Control page's data and actions: a proposed change checked with the engine's own
config model, and the apply itself (through :func:`control.apply.apply_change`)."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from engine_host.config import ConfigError, EngineLimits, LiveConfig, RestartRequired, apply_patch, diff_configs

from ..auth import User
from ..store import Store
from .common import ChangeOutcome, ViewError, describe_error, get_host, require, require_reason, run_change


@dataclass
class ChangePreview:
    """A proposed change checked against the config in force.

    Attributes:
        ok: valid and different from the config in force.
        new_config: the config it would put in force (``LiveConfig`` dict), when valid.
        diff: ``[{"field", "old", "new"}]`` against the config in force.
        errors: ``{field path: message}`` for inline display (``speculation.k`` ...).
        restart_required: the change needs an engine restart (refused).
    """

    ok: bool
    new_config: dict[str, Any] | None
    diff: list[dict[str, Any]]
    errors: dict[str, str]
    restart_required: bool = False


#: Patterns of the config model, said in words (pydantic reports the raw pattern).
PATTERN_WORDS = {
    r"^[A-Za-z0-9_.-]+$": "use only letters, digits and _ . - (no spaces)",
}


def human_message(msg: str) -> str:
    """A validation message as a sentence a user can act on: pydantic's ``String should
    match pattern '...'`` becomes what the pattern allows; other messages lose pydantic's
    ``Value error, `` prefix."""
    msg = msg.removeprefix("Value error, ")
    m = re.match(r"String should match pattern '(.*)'$", msg)
    if m:
        return PATTERN_WORDS.get(m.group(1), "this value has characters or a form that is not allowed")
    return msg


def errors_by_field(exc: ConfigError) -> dict[str, str]:
    """A :class:`ConfigError`'s errors keyed by dotted field path (``speculation.k``),
    as human sentences (:func:`human_message`)."""
    out: dict[str, str] = {}
    for e in exc.errors:
        loc = ".".join(str(x) for x in e.get("loc", []) if x not in ("body",))
        msg = human_message(str(e.get("msg", "invalid")))
        out[loc or "config"] = (out[loc or "config"] + "; " + msg) if loc in out else msg
    return out


def preview_change(current: dict[str, Any], limits: dict[str, Any], patch: dict[str, Any]) -> ChangePreview:
    """Validate a partial config against the config in force and the engine's start-up
    limits with the engine's own rules (:func:`engine_host.config.apply_patch`).

    Args:
        current: the config in force (``LiveConfig`` dict).
        limits: the engine's start-up settings (``EngineLimits`` dict).
        patch: the change (any subset of the ``LiveConfig`` JSON).
    Returns:
        The :class:`ChangePreview`; ``errors`` keyed by dotted field path.
    """
    try:
        cur = LiveConfig.model_validate(current or {})
        lim = EngineLimits.model_validate(limits)
    except Exception as exc:
        return ChangePreview(False, None, [], {"config": f"the engine's config cannot be read: {describe_error(exc)}"})
    try:
        new = apply_patch(cur, patch, lim)
    except RestartRequired as exc:
        return ChangePreview(False, None, [], errors_by_field(exc), restart_required=True)
    except ConfigError as exc:
        return ChangePreview(False, None, [], errors_by_field(exc))
    diff = diff_configs(cur.model_dump(mode="json"), new.model_dump(mode="json"))
    if not diff:
        return ChangePreview(
            False, new.model_dump(mode="json"), [], {"config": "nothing changes: this is the config in force"}
        )
    return ChangePreview(True, new.model_dump(mode="json"), diff, {})


def apply_change(store: Store, name: str, patch: dict[str, Any], user: User | None, reason: str) -> ChangeOutcome:
    """Apply a change to a host as ``user`` (operators only, re-checked against the
    users file now), recorded in the history with the user's name as author and
    ``reason`` (:func:`control.apply.apply_change`).

    Raises:
        PermissionDenied: the user may not apply (or was removed).
        ViewError: no reason given, or the host is unknown.
    """
    from .. import apply as apply_mod

    user = require(user, "apply")
    reason = require_reason(reason)
    get_host(store, name)
    return run_change(
        store,
        name,
        lambda: apply_mod.apply_change(store, name, patch, reason=reason, author=user.name, interface="dashboard"),
    )


__all__ = [
    "ChangeOutcome",
    "ChangePreview",
    "ViewError",
    "apply_change",
    "errors_by_field",
    "human_message",
    "preview_change",
]
