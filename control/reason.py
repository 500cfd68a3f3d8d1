"""The rule for the reason of a config change, one place for every interface.

Every config change (apply, rollback, rollout) carries a reason that the history and the
audit trail show to the next on-call engineer. The CLI (``--reason``) and the dashboard
(the reason field of every change form) check it with :func:`check_reason`.
"""

from __future__ import annotations

from .store import ControlError

#: Fewest characters of a reason, after stripping white space.
MIN_REASON_CHARS = 4
REASON_RULE = f"a reason is required (at least {MIN_REASON_CHARS} characters): say why, for the history"


class ReasonRefused(ControlError, ValueError):
    """The reason is missing or too short; nothing was changed."""


def check_reason(reason: str | None) -> str:
    """The reason, stripped of surrounding white space.

    Args:
        reason: the text given (None or empty counts as missing).
    Returns:
        The stripped reason.
    Raises:
        ReasonRefused: missing, or shorter than :data:`MIN_REASON_CHARS` characters.
    """
    r = (reason or "").strip()
    if len(r) < MIN_REASON_CHARS:
        raise ReasonRefused(REASON_RULE + (f" (got {r!r})" if r else ""))
    return r
