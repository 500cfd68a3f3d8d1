"""Drift commands of ``python -m control config``: ``drift`` (what differs between the
engine and the store), ``reapply`` (send the store's version in force again) and
``adopt`` (record the engine's config as a new version). Logic: :mod:`control.drift`.
Registered by :func:`control.cli.build_parser`."""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable
from typing import Any

EXIT_OK, EXIT_ERROR = 0, 1


def _when(t: float | None) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%SZ", time.gmtime(t)) if t else "-"


def cmd_config_drift(args: argparse.Namespace) -> int:
    from . import drift
    from .cli import _store

    with _store(args) as store:
        rows = drift.drifts(store, args.host, open_only=not args.all, limit=args.limit)
    if args.json:
        print(json.dumps(rows, indent=2, default=str))
        return EXIT_OK
    if not rows:
        print(f"host {args.host}: no {'' if args.all else 'open '}config drift")
        return EXIT_OK
    for d in rows:
        state = "open" if d["ended_at"] is None else f"ended {_when(d['ended_at'])} ({d['resolution']})"
        print(f"drift {d['id']} on {d['host']}: detected {_when(d['detected_at'])}, {state}")
        print(f"  store:  version {d['store_version']} (applied as engine version {d['store_engine_version']})")
        print(f"  engine: config version {d['engine_version']} (engine started {_when(d['engine_started_at'])})")
        for x in d["diff"] or [{"field": "(same content; the version numbers differ)", "old": "", "new": ""}]:
            print(f"  {x['field']}: store {json.dumps(x['old'])} / engine {json.dumps(x['new'])}")
    if any(d["ended_at"] is None for d in rows):
        print(f"resolve with: python -m control config reapply|adopt --host {args.host} --reason '...'")
    return EXIT_OK


def cmd_config_reapply(args: argparse.Namespace) -> int:
    from . import drift
    from .cli import _print_result, _store

    with _store(args) as store:
        res = drift.reapply(store, args.host, reason=args.reason, author=args.author, interface="cli")
    return _print_result(res)


def cmd_config_adopt(args: argparse.Namespace) -> int:
    from . import drift
    from .cli import _diff_text, _store

    with _store(args) as store:
        v = drift.adopt(store, args.host, reason=args.reason, author=args.author, interface="cli")
    print(f"host {args.host}: version {v.version} applied (adopted the engine's config version {v.engine_version})")
    print(f"  change: {_diff_text(v.diff)}")
    return EXIT_OK


def add_drift_commands(
    config: Any,
    command: Callable[..., argparse.ArgumentParser],
    fmt: argparse.ArgumentParser,
    author: argparse.ArgumentParser,
) -> None:
    """Add ``drift``, ``reapply`` and ``adopt`` to the ``config`` command group."""
    c = command(config, "drift", "config drift between the engine and the store (both sides)", cmd_config_drift, [fmt])
    c.add_argument("--host", required=True)
    c.add_argument("--all", action="store_true", help="also drifts that ended")
    c.add_argument("--limit", type=int, default=20)
    c = command(
        config,
        "reapply",
        "resolve a drift: send the store's version in force to the engine again (as a new version)",
        cmd_config_reapply,
        [author],
    )
    c.add_argument("--host", required=True)
    c = command(
        config, "adopt", "resolve a drift: record the engine's config as a new version", cmd_config_adopt, [author]
    )
    c.add_argument("--host", required=True)
