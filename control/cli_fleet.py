"""Fleet commands of ``python -m control``: ``config rollout`` (canary rollout with
automatic rollback, :mod:`control.rollout`), ``config rollouts`` (their status) and
``export-metrics`` (the control plane's Prometheus series, :mod:`control.exporter`).
Registered by :func:`control.cli.build_parser`."""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable
from typing import Any

EXIT_OK, EXIT_ERROR = 0, 1


def _rollout_dict(r: Any) -> dict[str, Any]:
    return {
        c: getattr(r, c)
        for c in (
            "id",
            "status",
            "phase",
            "canary",
            "hosts",
            "watch_s",
            "guards",
            "baseline",
            "patch",
            "reason",
            "author",
            "created_at",
            "updated_at",
            "message",
            "steps",
        )
    }


def _print_rollout(r: Any) -> None:
    print(f"rollout {r.id}: {r.status} ({r.phase}) - {r.message or ''}".rstrip(" -"))
    for st in r.steps:
        line = f"  {st['host']}: {st['action']} {st['outcome']}"
        if st.get("version") is not None:
            line += f" (version {st['version']})"
        if st.get("guards"):
            line += " - " + "; ".join(st["guards"])
        elif st.get("message"):
            line += f" - {st['message']}"
        print(line)


def cmd_config_rollout(args: argparse.Namespace) -> int:
    from . import rollout
    from .cli import _author, _patch_from_args, _store

    with _store(args) as store:
        if args.resume:
            done = rollout.resume(store)
            if not done:
                print("no abandoned rollout to resume")
            for r, what in done:
                print(what)
                _print_rollout(r)
            return EXIT_OK if all(r.status == rollout.SUCCEEDED for r, _ in done) else EXIT_ERROR
        if args.id is not None:
            r = rollout.run(store, args.id)
        else:
            if not args.hosts or not args.canary or args.watch is None or not args.reason:
                raise ValueError("give --hosts, --canary, --watch, --guard and --reason (or --resume / --id N)")
            rid = rollout.create(
                store,
                hosts=args.hosts.split(","),
                canary=args.canary,
                patch=_patch_from_args(args),
                watch_s=args.watch,
                guards=args.guard or [],
                reason=args.reason,
                author=_author(args.author),
                baseline=args.baseline,
            )
            print(
                f"rollout {rid}: applying to the canary {args.canary}, then watching it for {args.watch:g} s",
                flush=True,
            )
            r = rollout.run(store, rid)
    if args.json:
        print(json.dumps(_rollout_dict(r), indent=2, default=str))
    else:
        _print_rollout(r)
    return EXIT_OK if r.status == rollout.SUCCEEDED else EXIT_ERROR


def cmd_config_rollouts(args: argparse.Namespace) -> int:
    from .cli import _store
    from .rollout import list_rollouts

    with _store(args) as store:
        rows = list_rollouts(store, limit=args.limit)
    if args.json:
        print(json.dumps([_rollout_dict(r) for r in rows], indent=2, default=str))
        return EXIT_OK
    if not rows:
        print("no rollouts")
    for r in rows:
        _print_rollout(r)
    return EXIT_OK


def cmd_export_metrics(args: argparse.Namespace) -> int:
    from .cli import _store
    from .exporter import serve

    with _store(args) as store:
        server, _ = serve(store, args.port, addr=args.addr)
        print(
            f"serving the control plane's series on http://{args.addr}:{args.port}/metrics (Ctrl-C stops)", flush=True
        )
        try:
            while True:
                time.sleep(3600)
        except KeyboardInterrupt:
            print("stopped")
        finally:
            server.shutdown()
    return EXIT_OK


def add_rollout_commands(
    config: argparse._SubParsersAction,
    command: Callable[..., argparse.ArgumentParser],
    fmt: argparse.ArgumentParser,
    patch_options: Callable[[argparse.ArgumentParser], None],
) -> None:
    """``config rollout`` and ``config rollouts`` under the ``config`` group."""
    c = command(
        config,
        "rollout",
        "canary rollout of a change across hosts: apply to the canary, watch it "
        "against the baseline, then the others in order, or roll the canary back",
        cmd_config_rollout,
        [fmt],
    )
    c.add_argument("--hosts", default=None, help="hosts in the order the change reaches them, e.g. a,b,c")
    c.add_argument("--canary", default=None, help="the host that gets the change first (one of --hosts)")
    c.add_argument("--watch", type=float, default=None, help="seconds the canary is watched before the others")
    c.add_argument(
        "--guard",
        action="append",
        default=None,
        help="'FIGURE OP [N *] baseline' or 'FIGURE OP N', e.g. 'ttft_p99_ms <= 1.1 * baseline'; "
        "repeat for several (all must hold)",
    )
    c.add_argument(
        "--baseline",
        choices=["others", "self"],
        default=None,
        help="compare with the other hosts over the watch (default with other hosts) or with the "
        "canary's own window before the change",
    )
    from .cli import _reason_arg

    c.add_argument(
        "--reason", default=None, type=_reason_arg, help="why (required for a new rollout, at least 4 characters)"
    )
    c.add_argument(
        "--author", default=None, help="who asked for it, when not you: recorded as 'YOU on behalf of AUTHOR'"
    )
    c.add_argument(
        "--resume",
        action="store_true",
        help="take over rollouts whose process died: resume them, or roll the canary back",
    )
    c.add_argument("--id", type=int, default=None, help="run (take over) this recorded rollout")
    patch_options(c)
    c = command(config, "rollouts", "rollouts with their steps, newest first", cmd_config_rollouts, [fmt])
    c.add_argument("--limit", type=int, default=20)


def add_fleet_commands(sub: argparse._SubParsersAction, common: argparse.ArgumentParser) -> None:
    """``export-metrics``."""
    c = sub.add_parser(
        "export-metrics",
        help="serve the control plane's Prometheus series (config drift)",
        parents=[common],
        description="Serve specpilot:control_config_version per host on /metrics for Prometheus "
        "(deploy/prometheus/specpilot-rules.yml, alert SpecPilotConfigDrift).",
    )
    c.set_defaults(fn=cmd_export_metrics)
    c.add_argument("--port", type=int, default=9464)
    c.add_argument("--addr", default="0.0.0.0")


def add_source_options(common: argparse.ArgumentParser) -> None:
    """``--metrics-source`` and ``--prometheus-url`` on every command."""
    common.add_argument(
        "--metrics-source",
        choices=["embedded", "prometheus"],
        default=argparse.SUPPRESS,
        help="where windowed figures come from: the embedded collector's store (default) or a "
        "Prometheus server ($SPECPILOT_METRICS_SOURCE)",
    )
    common.add_argument(
        "--prometheus-url",
        default=argparse.SUPPRESS,
        help="Prometheus server for --metrics-source prometheus ($SPECPILOT_PROMETHEUS_URL)",
    )


def apply_source_options(args: argparse.Namespace) -> None:
    """Put the metric-source options in the environment (the dashboard and processes
    started from here inherit them)."""
    from .promsource import configure

    configure(getattr(args, "metrics_source", None), getattr(args, "prometheus_url", None))
