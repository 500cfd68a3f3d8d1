"""``python -m control``: the control plane's command line.

Every command takes ``--db URL`` (default ``$SPECPILOT_DB_URL``, else the deprecated
``$SPECPILOT_DB``, else SQLite in ``$SPECPILOT_HOME``) and ``--help``. Errors are
one line on stderr (no traceback): exit status 1 for an error or a failed apply, 2 for bad
usage or a refused config.

As an on-call engineer uses it: ``--host`` may be left out when one host is registered;
every change needs a reason (:mod:`control.reason`, the dashboard's rule); a change that
changes nothing records nothing; the author of a change is the operating-system user who
runs the command (``--author NAME`` records "USER on behalf of NAME", never NAME alone).
"""

from __future__ import annotations

import argparse
import getpass
import json
import logging
import os
import sys
from datetime import datetime, timezone
from typing import Any, Callable, Sequence

from .store import DEFAULT_TOKEN_ENV, ControlError

EXIT_OK, EXIT_ERROR, EXIT_USAGE = 0, 1, 2


def _ts(t: float | None) -> str:
    if t is None:
        return "-"
    return datetime.fromtimestamp(t, tz=timezone.utc).strftime("%Y-%m-%d %H:%M:%SZ")


def _fmt(v: Any) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:.4g}" if abs(v) < 1e6 else f"{v:.0f}"
    return str(v)


def _table(rows: list[dict[str, Any]], cols: Sequence[str]) -> str:
    if not rows:
        return "(none)"
    cells = [[_fmt(r.get(c)) for c in cols] for r in rows]
    widths = [max(len(c), *(len(row[i]) for row in cells)) for i, c in enumerate(cols)]
    lines = ["  ".join(c.ljust(w) for c, w in zip(cols, widths))]
    lines += ["  ".join(v.ljust(w) for v, w in zip(row, widths)) for row in cells]
    return "\n".join(lines)


def _diff_text(diff: list[dict[str, Any]]) -> str:
    if not diff:
        return "(no change)"
    return "; ".join(f"{d['field']}: {json.dumps(d['old'])} -> {json.dumps(d['new'])}" for d in diff)


def _print_json(data: Any) -> None:
    print(json.dumps(data, indent=2, default=str))


def _store(args: argparse.Namespace):
    from .store import Store

    return Store.open(args.db)


def db_from_env() -> str | None:
    """The store URL from the environment (:func:`engine_host.envs.db_url`:
    ``$SPECPILOT_DB_URL``, else the deprecated ``$SPECPILOT_DB`` the dashboard used);
    None when neither is set.

    Raises:
        ControlError: both are set to different URLs (the CLI and the dashboard would
            use different stores).
    """
    from engine_host import envs

    url, alias = os.environ.get(envs.DB_URL) or None, os.environ.get(envs.DB_URL_DEPRECATED) or None
    if url and alias and url != alias:
        raise ControlError(
            f"${envs.DB_URL} and ${envs.DB_URL_DEPRECATED} name different stores ({url} and {alias}): "
            "unset one, or give --db"
        )
    return envs.db_url()


def _host_name(store: Any, given: str | None) -> str:
    """``--host``, or the only registered host when it is left out.

    Raises:
        ControlError: left out while no host, or several hosts, are registered.
    """
    if given:
        return given
    from .store import list_hosts

    names = sorted(h.name for h in list_hosts(store))
    if len(names) == 1:
        return names[0]
    if not names:
        raise ControlError("no engine host is registered: add one with 'python -m control hosts add NAME URL'")
    raise ControlError(f"--host is required: {len(names)} hosts are registered ({', '.join(names)})")


def os_user() -> str:
    """The operating-system user running this process (effective user id), not ``$USER``,
    which anyone can set."""
    try:
        import pwd

        return pwd.getpwuid(os.geteuid()).pw_name
    except (ImportError, KeyError):
        return getpass.getuser()


def _author(given: str | None) -> str:
    """Who a change is recorded as: the OS user; with ``--author NAME`` for someone else,
    ``"USER on behalf of NAME"``.

    Raises:
        ControlError: ``--author`` empty or longer than 64 characters.
    """
    real = os_user()
    if given is None:
        return real
    name = given.strip()
    if not name or len(name) > 64:
        raise ControlError(f"--author must be a name of 1 to 64 characters, got {given!r}")
    return real if name == real else f"{real} on behalf of {name}"


def _reason_arg(text: str) -> str:
    """``--reason``, checked with the rule every interface uses (:mod:`control.reason`)."""
    from .reason import ReasonRefused, check_reason

    try:
        return check_reason(text)
    except ReasonRefused as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def k_in_force(state: dict[str, Any]) -> int | None:
    """The K (tokens) the engine uses for its next step, from ``/control/state``:
    ``speculation.k_next``; from an engine host that does not report it, the configured K
    in fixed mode, 0 when off, else the K of the last step."""
    spec = state.get("speculation") or {}
    if spec.get("k_next") is not None:
        return spec["k_next"]
    mode = spec.get("mode")
    if mode == "off":
        return 0
    if mode == "fixed":
        k = spec.get("k")
        return k if k is not None else ((state.get("config") or {}).get("speculation") or {}).get("k")
    return spec.get("k_current")


def _unchanged(store: Any, host_name: str, patch: dict[str, Any]) -> Any:
    """The last applied version when ``patch`` changes nothing on it and the engine runs
    it (or cannot tell); None when the change is real, invalid (left to the apply to
    refuse with its reason) or the engine's config differs (re-sending it is a change)."""
    from engine_host.config import ConfigError, EngineLimits, LiveConfig, apply_patch

    from .client import EngineClient, EngineError
    from .store import get_host
    from .versions import last_applied

    host = get_host(store, host_name)
    base = last_applied(store, host.id)
    if base is None or not host.engine_limits:
        return None
    try:
        new = apply_patch(
            LiveConfig.model_validate(base.config), patch, EngineLimits.model_validate(host.engine_limits)
        )
    except (ConfigError, ValueError):
        return None
    if new.model_dump(mode="json") != base.config:
        return None
    try:
        with EngineClient.for_host(host) as c:
            engine_config = c.state().get("config")
    except (EngineError, ControlError):
        engine_config = None
    if engine_config is not None and engine_config != base.config:
        return None
    return base


def _print_k_in_force(store: Any, host_name: str) -> None:
    from .client import EngineClient, EngineError
    from .store import get_host

    try:
        with EngineClient.for_host(get_host(store, host_name)) as c:
            k = k_in_force(c.state())
    except (EngineError, ControlError) as exc:
        print(f"  K in force: unknown ({exc})")
        return
    print(f"  K in force: {_fmt(k)} (the K the engine uses for its next step)")


def _opt_int(text: str) -> int | None:
    """An integer, or ``none`` (back to the engine's start-up value)."""
    if text.lower() in ("none", "default"):
        return None
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer or 'none', got {text!r}") from None


# --------------------------------------------------------------------------- hosts


def cmd_hosts_add(args: argparse.Namespace) -> int:
    from .apply import reconcile
    from .client import EngineError, TokenMissing
    from .store import add_host

    with _store(args) as store:
        h = add_host(
            store,
            args.name,
            args.url,
            usd_per_hour=args.usd_per_hour,
            gpu_kind=args.gpu,
            token_env=args.token_env,
            origin_=_origin(),
            update=args.update,
        )
        print(
            f"host {h.name}: {h.url} (USD {h.usd_per_hour:g}/hour, GPU {h.gpu_kind or '-'}, token from ${h.token_env})"
        )
        try:
            res = reconcile(store, h.name, interface="cli")
        except TokenMissing as exc:
            print(f"warning: {exc}", file=sys.stderr)
        except EngineError as exc:
            print(f"warning: registered, but {exc}", file=sys.stderr)
        else:
            print(f"reachable; config history starts at version {res.imported}" if res.imported else "reachable")
    return EXIT_OK


def cmd_hosts_list(args: argparse.Namespace) -> int:
    from .fleet import fleet_status

    with _store(args) as store:
        rows = fleet_status(store)
    if args.json:
        _print_json(rows)
        return EXIT_OK
    for r in rows:
        r["status"] = "up" if r["up"] else ("down" if r["last_sample_at"] else "no data")
    print(_table(rows, ["host", "url", "gpu_kind", "usd_per_hour", "status", "control_version", "open_alerts"]))
    return EXIT_OK


def cmd_hosts_remove(args: argparse.Namespace) -> int:
    from .store import remove_host

    with _store(args) as store:
        remove_host(store, args.name, origin_=_origin())
    print(f"host {args.name} removed (its history is kept; 'hosts add {args.name} URL' brings it back)")
    return EXIT_OK


# --------------------------------------------------------------------------- config


def cmd_config_show(args: argparse.Namespace) -> int:
    from .client import EngineClient, EngineError
    from .store import get_host
    from .versions import last_applied

    with _store(args) as store:
        host = get_host(store, _host_name(store, args.host))
        applied = last_applied(store, host.id)
        state, error = None, None
        try:
            with EngineClient.for_host(host) as c:
                state = c.state()
        except (EngineError, ControlError) as exc:
            error = str(exc)
    if args.json:
        _print_json(
            {
                "host": host.name,
                "url": host.url,
                "engine": state,
                "engine_error": error,
                "control_version": applied.version if applied else None,
                "control_config": applied.config if applied else None,
            }
        )
        return EXIT_OK
    print(f"host {host.name} ({host.url})")
    if applied:
        print(
            f"control plane: version {applied.version} applied {_ts(applied.finished_at)} by {applied.author}: "
            f"{applied.reason}"
        )
    if state is None:
        print(f"engine: cannot read its state ({error})")
        if applied:
            print(json.dumps(applied.config, indent=2))
        return EXIT_ERROR
    spec, batch, eng = state.get("speculation", {}), state.get("batch", {}), state.get("engine", {})
    print(
        f"engine: phase {eng.get('phase')}, pid {eng.get('pid')}, started {_ts(eng.get('started_at'))}, "
        f"engine config version {state.get('config_version')}"
    )
    print(
        f"speculation: mode {spec.get('mode')}, K in force {_fmt(k_in_force(state))} (last step "
        f"{_fmt(spec.get('k_current'))}), k {spec.get('k')}, "
        f"k_min {spec.get('k_min')}, k_max {spec.get('k_max')} (engine K_max {spec.get('k_max_engine')})"
    )
    print(
        f"batch: max_num_seqs {batch.get('max_num_seqs')}, max_num_batched_tokens "
        f"{batch.get('max_num_batched_tokens')}, running {batch.get('running')}, waiting {batch.get('waiting')}"
    )
    if applied and state.get("config") != applied.config:
        print(f"note: the engine's config differs from version {applied.version}")
    print(json.dumps(state.get("config"), indent=2))
    return EXIT_OK


def _patch_from_args(args: argparse.Namespace) -> dict[str, Any]:
    patch: dict[str, Any] = json.loads(args.patch) if args.patch else {}
    if not isinstance(patch, dict):
        raise ControlError('--patch must be a JSON object, e.g. \'{"speculation": {"k": 4}}\'')
    spec = patch.setdefault("speculation", {})
    batch = patch.setdefault("batch", {})
    for name, value, section in (
        ("mode", args.mode, spec),
        ("k", args.k, spec),
        ("k_min", args.k_min, spec),
        ("k_max", args.k_max, spec),
        ("max_num_seqs", args.max_num_seqs, batch),
        ("max_num_batched_tokens", args.max_num_batched_tokens, batch),
    ):
        if value is not _UNSET:
            section[name] = value
    patch = {k: v for k, v in patch.items() if v != {}}
    if not patch:
        raise ControlError(
            "nothing to change: give --mode, --k, --k-min, --k-max, --max-num-seqs, --max-num-batched-tokens or --patch"
        )
    return patch


def _print_result(res: Any) -> int:
    from .versions import APPLIED

    head = f"host {res.host}: version {res.version} {res.status}"
    if res.status == APPLIED:
        head += f" (engine version {res.engine_version}, {_fmt(res.apply_latency_ms)} ms)"
    print(head)
    print(f"  change: {_diff_text(res.diff)}")
    if res.status != APPLIED:
        print(f"  reason: {res.message}")
    for note in res.notes:
        print(f"  note: {note}")
    return EXIT_OK if res.status == APPLIED else EXIT_ERROR


def cmd_config_apply(args: argparse.Namespace) -> int:
    from .apply import apply_change

    patch = _patch_from_args(args)
    author = _author(args.author)
    with _store(args) as store:
        name = _host_name(store, args.host)
        same = _unchanged(store, name, patch)
        if same is not None:
            print(f"no change: version {same.version} in force on {name} already has this config; nothing recorded")
            return EXIT_OK
        res = apply_change(store, name, patch, reason=args.reason, author=author, interface="cli")
        code = _print_result(res)
        if res.ok:
            _print_k_in_force(store, name)
    return code


def cmd_config_rollback(args: argparse.Namespace) -> int:
    from .apply import rollback
    from .versions import get_version

    author = _author(args.author)
    with _store(args) as store:
        name = _host_name(store, args.host)
        same = _unchanged(store, name, get_version(store, name, args.version).config)
        if same is not None:
            print(
                f"no change: version {same.version} in force on {name} already has the config of version "
                f"{args.version}; nothing recorded"
            )
            return EXIT_OK
        res = rollback(store, name, args.version, reason=args.reason, author=author, interface="cli")
        code = _print_result(res)
        if res.ok:
            _print_k_in_force(store, name)
    return code


def cmd_config_history(args: argparse.Namespace) -> int:
    from .versions import history

    with _store(args) as store:
        versions = history(store, _host_name(store, args.host), limit=args.limit)
    rows = [
        {
            "version": v.version,
            "created": _ts(v.created_at),
            "author": v.author,
            "source": v.source + (f" of v{v.rollback_of}" if v.rollback_of else ""),
            "status": v.status,
            "engine_v": v.engine_version,
            "reason": v.reason,
            "change": _diff_text(v.diff),
            "message": v.engine_message,
        }
        for v in versions
    ]
    if args.json:
        _print_json(
            [{**r, "config": v.config, "diff": v.diff, "finished_at": v.finished_at} for r, v in zip(rows, versions)]
        )
        return EXIT_OK
    print(_table(rows, ["version", "created", "author", "source", "status", "engine_v", "reason", "change"]))
    return EXIT_OK


def cmd_config_diff(args: argparse.Namespace) -> int:
    from .versions import diff_versions

    with _store(args) as store:
        diff = diff_versions(store, _host_name(store, args.host), args.a, args.b)
    if args.json:
        _print_json(diff)
    elif not diff:
        print(f"versions {args.a} and {args.b} have the same config")
    else:
        print(_table(diff, ["field", "old", "new"]))
    return EXIT_OK


# --------------------------------------------------------------------------- collect, alerts, report


def cmd_collect(args: argparse.Namespace) -> int:
    from .collector import Collector

    with _store(args) as store:
        collector = Collector(store, interval_s=args.interval, window_s=args.window)
        print(
            f"collecting every {args.interval:g} s into {store.engine.url.render_as_string()} (Ctrl-C stops)",
            flush=True,
        )
        try:
            collector.run()
        except KeyboardInterrupt:
            print("stopped")
    return EXIT_OK


def cmd_alerts_list(args: argparse.Namespace) -> int:
    from .alerts import events

    with _store(args) as store:
        evs = events(store, host=args.host, open_only=args.open, limit=args.limit)
    if args.json:
        _print_json(evs)
        return EXIT_OK
    for e in evs:
        e["started"], e["ended"] = _ts(e["started_at"]), _ts(e["ended_at"]) if e["ended_at"] else "open"
    print(_table(evs, ["host", "rule", "severity", "started", "ended", "value", "peak", "message"]))
    return EXIT_OK


def cmd_alerts_rules(args: argparse.Namespace) -> int:
    from .alerts import list_rules

    with _store(args) as store:
        rules = list_rules(store)
    rows = [
        {
            "name": r.name,
            "condition": f"{r.metric} {r.op} {r.threshold:g}",
            "for_s": r.for_s,
            "severity": r.severity,
            "enabled": r.enabled,
            "host": r.host_id or "all",
            "description": r.description,
        }
        for r in rules
    ]
    if args.json:
        _print_json(rows)
    else:
        print(_table(rows, ["name", "condition", "for_s", "severity", "enabled", "host", "description"]))
    return EXIT_OK


def cmd_alerts_rule(args: argparse.Namespace) -> int:
    from .alerts import set_rule

    with _store(args) as store:
        r = set_rule(
            store,
            args.name,
            metric=args.metric,
            op=args.op,
            threshold=args.threshold,
            for_s=args.for_s,
            severity=args.severity,
            enabled=args.enabled,
            host=args.host,
            description=args.description,
            origin_=_origin(),
        )
    print(
        f"rule {r.name}: {r.metric} {r.op} {r.threshold:g} for {r.for_s:g} s, {r.severity}, "
        f"{'enabled' if r.enabled else 'disabled'}"
    )
    return EXIT_OK


def cmd_report_weekly(args: argparse.Namespace) -> int:
    from .cost import week_ending, weekly_report

    try:
        end = week_ending(args.end) if args.end else None
    except ValueError:
        raise ControlError(f"--end must be a date YYYY-MM-DD, got {args.end!r}") from None
    if args.csv == "-" and args.json:
        raise ControlError("--csv - and --json both write to standard output: choose one")
    with _store(args) as store:
        rep = weekly_report(store, end=end, host=args.host, baseline=args.baseline)
    if args.csv == "-":  # the CSV alone on standard output, for a pipe
        rep.to_csv(sys.stdout)
        return EXIT_OK
    if args.csv:
        with open(args.csv, "w", newline="") as f:
            rep.to_csv(f)
    if args.json:
        _print_json(rep.to_dict())
        return EXIT_OK
    print(f"cost report {_ts(rep.start)} .. {_ts(rep.end)} (baseline {rep.baseline})")
    print(
        _table(
            rep.hosts,
            [
                "host",
                "usd_per_hour",
                "uptime_h",
                "utilisation",
                "output_tokens",
                "usd",
                "usd_per_million_tokens",
                "busy_tokens_per_s",
                "baseline_tokens_per_s",
                "saving_usd",
                "saving_fraction",
            ],
        )
    )
    for h in rep.hosts:
        print(f"  {h['host']}: baseline {h['baseline_note']}")
    print("per day:")
    print(
        _table(
            rep.days,
            [
                "day",
                "host",
                "uptime_h",
                "utilisation",
                "output_tokens",
                "usd",
                "usd_per_million_tokens",
                "busy_tokens_per_s",
                "acceptance_rate",
                "mean_k",
            ],
        )
    )
    fleet = rep.fleet
    print(
        f"fleet: {fleet['usd']:.2f} USD for {fleet['output_tokens']} output tokens "
        f"({_fmt(fleet['usd_per_million_tokens'])} USD per million), utilisation {_fmt(fleet['utilisation'])}, "
        f"saving {fleet['saving_usd']:.2f} USD against {rep.baseline}"
    )
    if args.csv:
        print(f"CSV written to {args.csv}")
    return EXIT_OK


def cmd_audit(args: argparse.Namespace) -> int:
    from .store import audit_events

    with _store(args) as store:
        evs = audit_events(store, host=args.host, limit=args.limit)
    rows = [
        {
            "at": _ts(e.at),
            "actor": e.actor,
            "origin": e.origin,
            "action": e.action,
            "host": e.host_name,
            "outcome": e.outcome,
            "message": e.message,
        }
        for e in evs
    ]
    if args.json:
        _print_json(rows)
    else:
        print(_table(rows, ["at", "actor", "action", "host", "outcome", "message", "origin"]))
    return EXIT_OK


def cmd_db_upgrade(args: argparse.Namespace) -> int:
    from .db import current_revision

    with _store(args) as store:
        print(f"{store.engine.url.render_as_string()} at revision {current_revision(store.engine)}")
    return EXIT_OK


def cmd_up(args: argparse.Namespace) -> int:
    from .up import run_up

    return run_up(args)


# --------------------------------------------------------------------------- parser

_UNSET = object()


def _origin() -> str:
    from .store import origin

    return origin("cli")


def _add_patch_options(c: argparse.ArgumentParser) -> None:
    """The options that describe a config change (``config apply``, ``config rollout``)."""
    from engine_host.config import SPECULATION_MODES

    c.add_argument("--mode", choices=SPECULATION_MODES, default=_UNSET, help="speculation mode")
    c.add_argument("--k", type=int, default=_UNSET, help="draft length K for mode fixed (tokens)")
    c.add_argument("--k-min", type=int, default=_UNSET, help="lower bound of K (tokens)")
    c.add_argument("--k-max", type=_opt_int, default=_UNSET, help="upper bound of K (tokens; 'none': engine K_max)")
    c.add_argument(
        "--max-num-seqs", type=_opt_int, default=_UNSET, help="cap on running sequences ('none': start-up value)"
    )
    c.add_argument(
        "--max-num-batched-tokens",
        type=_opt_int,
        default=_UNSET,
        help="cap on tokens per engine step ('none': start-up value)",
    )
    c.add_argument(
        "--patch",
        default=None,
        help="any other change as LiveConfig JSON, e.g. "
        '\'{"speculation": {"mode": "batch_table", "table": [[1, 2, 4], [3, 8, 1]]}}\'',
    )


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of ``python -m control``."""

    common = argparse.ArgumentParser(add_help=False)
    common.add_argument(
        "--db",
        default=argparse.SUPPRESS,
        help="store URL, e.g. sqlite:////path/specpilot.db or postgresql+psycopg://user@host/db "
        "(default: $SPECPILOT_DB_URL, else the deprecated $SPECPILOT_DB, else "
        "$SPECPILOT_HOME/specpilot.db)",
    )
    common.add_argument("-v", "--verbose", action="store_true", default=argparse.SUPPRESS, help="log more")
    from .cli_fleet import add_source_options

    add_source_options(common)
    fmt = argparse.ArgumentParser(add_help=False)
    fmt.add_argument("--json", action="store_true", help="print JSON instead of a table")
    author = argparse.ArgumentParser(add_help=False)
    from .reason import MIN_REASON_CHARS

    author.add_argument(
        "--reason",
        required=True,
        type=_reason_arg,
        help=f"why (required, at least {MIN_REASON_CHARS} characters; shown in the history)",
    )
    author.add_argument(
        "--author",
        default=None,
        help="who asked for it, when not you: recorded as 'YOU on behalf of AUTHOR' (you = the operating-system user)",
    )

    p = argparse.ArgumentParser(
        prog="python -m control",
        parents=[common],
        description="SpecPilot control plane: engine hosts, config versions with audit and rollback, metric "
        "collection, alerts and cost reports.",
        epilog="Run 'python -m control COMMAND --help' for each command.",
    )
    sub = p.add_subparsers(dest="command", metavar="COMMAND", required=True)

    def group(name: str, help_: str) -> argparse._SubParsersAction:
        g = sub.add_parser(name, help=help_, description=help_, parents=[common])
        return g.add_subparsers(dest="subcommand", metavar="SUBCOMMAND", required=True)

    def command(
        parent: argparse._SubParsersAction,
        name: str,
        help_: str,
        fn: Callable[[argparse.Namespace], int],
        parents: Sequence[argparse.ArgumentParser] = (),
    ) -> argparse.ArgumentParser:
        c = parent.add_parser(name, help=help_, description=help_, parents=[common, *parents])
        c.set_defaults(fn=fn)
        return c

    hosts = group("hosts", "register, list and remove engine hosts")
    c = command(
        hosts,
        "add",
        "register an engine host (its control token is read from an environment variable at use time, never stored)",
        cmd_hosts_add,
    )
    c.add_argument("name", help="host name (letters, digits, '-', '_', '.')")
    c.add_argument("url", help="engine host base URL, e.g. http://127.0.0.1:8000")
    c.add_argument(
        "--usd-per-hour",
        type=float,
        default=None,
        help="what the machine costs (USD/hour; default 0, kept by --update)",
    )
    c.add_argument("--gpu", default=None, help="accelerator kind, e.g. H100, L4, cpu (kept by --update when not given)")
    c.add_argument(
        "--token-env", default=DEFAULT_TOKEN_ENV, help="environment variable holding the engine host's control token"
    )
    c.add_argument("--update", action="store_true", help="change the settings of a registered host")
    command(hosts, "list", "list hosts with their status", cmd_hosts_list, [fmt])
    c = command(hosts, "remove", "remove a host (its history is kept)", cmd_hosts_remove)
    c.add_argument("name")

    config = group("config", "show, change, compare and roll back engine configs")
    c = command(config, "show", "the config in force on a host and the last applied version", cmd_config_show, [fmt])
    c.add_argument("--host", default=None, help="engine host (default: the only registered host)")
    c = command(
        config, "apply", "change a host's config as a new version (validated first)", cmd_config_apply, [author]
    )
    c.add_argument("--host", default=None, help="engine host (default: the only registered host)")
    _add_patch_options(c)
    c = command(config, "history", "a host's config versions, newest first", cmd_config_history, [fmt])
    c.add_argument("--host", default=None, help="engine host (default: the only registered host)")
    c.add_argument("--limit", type=int, default=None)
    c = command(config, "diff", "field-by-field difference between two versions", cmd_config_diff, [fmt])
    c.add_argument("--host", default=None, help="engine host (default: the only registered host)")
    c.add_argument("a", type=int, help="from version")
    c.add_argument("b", type=int, help="to version")
    c = command(config, "rollback", "apply an earlier version again, as a new version", cmd_config_rollback, [author])
    c.add_argument("--host", default=None, help="engine host (default: the only registered host)")
    c.add_argument("version", type=int, help="the version to restore")
    from .cli_fleet import add_fleet_commands, add_rollout_commands

    add_rollout_commands(config, command, fmt, _add_patch_options)
    from .cli_drift import add_drift_commands

    add_drift_commands(config, command, fmt, author)
    add_fleet_commands(sub, common)

    c = sub.add_parser(
        "collect",
        help="run the collector daemon",
        parents=[common],
        description="Scrape every registered host's /metrics, store samples, evaluate alert rules, "
        "record gaps, re-apply configs after engine restarts.",
    )
    c.set_defaults(fn=cmd_collect)
    c.add_argument("--interval", type=float, default=1.0, help="scrape interval (s, >= 1)")
    c.add_argument("--window", type=float, default=10.0, help="window of latency percentiles and acceptance (s)")

    alerts = group("alerts", "alert events and rules")
    c = command(alerts, "list", "alert events, newest first", cmd_alerts_list, [fmt])
    c.add_argument("--host", default=None)
    c.add_argument("--open", action="store_true", help="only open alerts")
    c.add_argument("--limit", type=int, default=100)
    command(alerts, "rules", "the alert rules", cmd_alerts_rules, [fmt])
    c = command(alerts, "rule", "create or change an alert rule (only the options given)", cmd_alerts_rule)
    c.add_argument("name")
    c.add_argument(
        "--metric", default=None, help="sample field (acceptance_rate, kv_cache_usage, queue_p99_ms, ...) or 'up'"
    )
    c.add_argument("--op", choices=["<", "<=", ">", ">="], default=None)
    c.add_argument("--threshold", type=float, default=None, help="in the metric's unit (ms, fraction 0..1, ...)")
    c.add_argument("--for-s", type=float, default=None, help="seconds the condition must hold")
    c.add_argument("--severity", default=None)
    c.add_argument("--host", default=None, help="only this host ('' for all hosts)")
    c.add_argument("--description", default=None)
    c.add_argument("--enable", dest="enabled", action="store_true", default=None)
    c.add_argument("--disable", dest="enabled", action="store_false")

    report = group("report", "cost reports")
    c = command(report, "weekly", "cost, tokens, utilisation and saving over 7 days", cmd_report_weekly, [fmt])
    c.add_argument("--host", default=None, help="one host (default: the fleet)")
    c.add_argument(
        "--csv",
        default=None,
        metavar="FILE",
        help="also write the report as CSV ('-': the CSV alone on standard output)",
    )
    c.add_argument("--end", default=None, metavar="YYYY-MM-DD", help="last UTC day of the week (default: now)")
    c.add_argument("--baseline", default="k0", help="'k0' (no speculation) or 'version:N' of the host")

    c = sub.add_parser(
        "audit", help="the audit trail", description="who did what, when, from where", parents=[common, fmt]
    )
    c.set_defaults(fn=cmd_audit)
    c.add_argument("--host", default=None)
    c.add_argument("--limit", type=int, default=50)

    db = group("db", "the store itself")
    command(db, "upgrade", "migrate the store to the newest schema and print its revision", cmd_db_upgrade)

    from .up import add_up_arguments

    c = sub.add_parser(
        "up",
        help="run everything: engine host, collector, dashboard",
        parents=[common],
        description="Start an engine host (default model), wait until it is ready, register it as "
        "host 'local', run the collector and the dashboard (when installed); Ctrl-C "
        "stops all.",
    )
    c.set_defaults(fn=cmd_up)
    add_up_arguments(c)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``python -m control`` and the ``specpilot`` console script."""
    from pydantic import ValidationError

    from .apply import ConfigRefused
    from .db import StoreError

    parser = build_parser()
    args = parser.parse_args(argv)
    args.db = getattr(args, "db", None)  # given before or after the command
    args.verbose = getattr(args, "verbose", False)
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.INFO,
        format="%(asctime)s %(levelname)s %(message)s",
        stream=sys.stderr,
    )
    logging.getLogger("httpx").setLevel(logging.WARNING)
    if not args.verbose:
        logging.getLogger("alembic").setLevel(logging.WARNING)
    try:
        from .cli_fleet import apply_source_options

        args.db = args.db or db_from_env()
        apply_source_options(args)
        return args.fn(args)
    except ConfigRefused as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except (ControlError, StoreError, ValueError, ValidationError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_ERROR
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:  # output piped into head & co.
        sys.stderr.close()
        return EXIT_OK
