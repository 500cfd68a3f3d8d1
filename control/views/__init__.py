"""What the dashboard's pages show and do, as plain data: one view module per page,
mirroring ``dashboard/pages/``.

* :mod:`.common`: the store (opened once per process, :func:`.common.open_store`),
  hosts and their state, stored samples, user and reason checks, errors;
* :mod:`.live`, :mod:`.control`, :mod:`.history`, :mod:`.fleet` (with canary rollouts),
  :mod:`.alerts`, :mod:`.cost`, :mod:`.planner`: one page each.

Views take the :class:`control.store.Store` as their first argument and call the
control plane's domain modules through it (no SQL of their own). Pages hold
presentation only.

The names below are re-exported for the Planner page, which reads
``views.planner_view``, ``views.planner_curves``, ``views.planner_points_for_display``,
``views.PlannerView``, ``views.planner.what_if`` and ``views.describe_error``.
"""

from __future__ import annotations

from . import planner
from .common import HostStatus, PermissionDenied, ViewError, describe_error
from .planner import PlannerView, planner_curves, planner_points_for_display, planner_view

__all__ = [
    "HostStatus",
    "PermissionDenied",
    "PlannerView",
    "ViewError",
    "describe_error",
    "planner",
    "planner_curves",
    "planner_points_for_display",
    "planner_view",
]
