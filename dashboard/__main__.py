"""``python -m dashboard``: start the SpecPilot dashboard, or manage its users.

    python -m dashboard [--port 8501] [--address 127.0.0.1] [--db URL]
    python -m dashboard users add NAME --role operator|viewer [--replace]
    python -m dashboard users remove NAME
    python -m dashboard users list

Starting is a thin wrapper over ``streamlit run dashboard/app.py`` with headless
settings (no browser opened, no usage statistics, no file watcher, no tracebacks shown
to users). The store is read from ``--db`` or ``$SPECPILOT_DB_URL``, else the SQLite file
in ``$SPECPILOT_HOME``. ``users add`` prompts for the password twice, or reads it from
``$SPECPILOT_NEW_PASSWORD``. On a first start with no user at all, an operator ``admin``
is created with a random password, printed once.
"""

from __future__ import annotations

import argparse
import getpass
import os
import sys
from pathlib import Path

from engine_host import envs

APP = Path(__file__).resolve().parent / "app.py"
ENV_DB = envs.DB_URL


def streamlit_argv(port: int, address: str) -> list[str]:
    """The ``streamlit run`` command line the dashboard is started with."""
    return [
        sys.executable,
        "-m",
        "streamlit",
        "run",
        str(APP),
        "--server.port",
        str(port),
        "--server.address",
        address,
        "--server.headless",
        "true",
        "--server.fileWatcherType",
        "none",
        "--server.runOnSave",
        "false",
        "--browser.gatherUsageStats",
        "false",
        "--client.showErrorDetails",
        "none",
        "--client.toolbarMode",
        "viewer",
        "--theme.base",
        "light",
        "--global.developmentMode",
        "false",
    ]


def _users(args: argparse.Namespace) -> int:
    from control import auth

    try:
        if args.users_cmd == "list":
            users = auth.load_users()
            if not users:
                print(f"no users (file: {auth.users_file()})")
            for u in sorted(users.values(), key=lambda u: u.name):
                print(f"{u.name}\t{u.role}")
            return 0
        if args.users_cmd == "remove":
            auth.remove_user(args.name)
            print(f"removed {args.name} from {auth.users_file()}")
            return 0
        password = envs.new_password()
        if password is None:
            if not sys.stdin.isatty():
                print(f"no terminal to prompt on: set ${auth.ENV_NEW_PASSWORD}", file=sys.stderr)
                return 2
            password = getpass.getpass(f"password for {args.name}: ")
            if getpass.getpass("again: ") != password:
                print("the passwords differ", file=sys.stderr)
                return 2
        user = auth.add_user(args.name, args.role, password, replace=args.replace)
        print(f"{'updated' if args.replace else 'added'} {user.name} ({user.role}) in {auth.users_file()}")
        return 0
    except auth.AuthError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


def bootstrap_user() -> str | None:
    """On a first start with no user configured, add an operator ``admin`` with a random
    password and print it once (only its Argon2id hash is stored, in the users file).

    Returns:
        The password, or None when users exist (or the users file cannot be read).
    """
    import secrets

    from control import auth

    try:
        if auth.load_users():
            return None
    except auth.AuthError as exc:
        print(f"warning: {exc}", file=sys.stderr)
        return None
    password = secrets.token_urlsafe(12)
    auth.add_user("admin", "operator", password)
    print(first_start_box(password, str(auth.users_file())), flush=True)
    return password


def first_start_box(password: str, users_file: str) -> str:
    """The first start's login, framed so that it stands out among log lines."""
    lines = [
        "SpecPilot dashboard: first start. Log in with",
        "",
        "    user name  admin",
        f"    password   {password}",
        "",
        "The password is shown only this once (stored hashed in",
        f"{users_file}).",
        "Add users: python -m dashboard users add NAME --role viewer|operator",
    ]
    width = max(len(x) for x in lines)
    bar = "+" + "-" * (width + 2) + "+"
    return "\n".join(["", bar, *[f"| {x.ljust(width)} |" for x in lines], bar, ""])


def main(argv: list[str] | None = None) -> int:
    """Parse the command line; start the app (does not return) or run a users command."""
    parser = argparse.ArgumentParser(prog="python -m dashboard", description=__doc__.split("\n\n")[0])
    parser.add_argument("--port", type=int, default=8501, help="port to serve on (default 8501)")
    parser.add_argument("--address", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    parser.add_argument("--db", default=None, help=f"store URL (default ${ENV_DB}, else SQLite in $SPECPILOT_HOME)")
    parser.add_argument(
        "--no-bootstrap-user", action="store_true", help="do not create an 'admin' operator when no user is configured"
    )
    sub = parser.add_subparsers(dest="cmd")
    users = sub.add_parser("users", help="manage dashboard users (viewer, operator)")
    usub = users.add_subparsers(dest="users_cmd", required=True)
    add = usub.add_parser("add", help="add a user (password prompted or from $SPECPILOT_NEW_PASSWORD)")
    add.add_argument("name")
    add.add_argument("--role", required=True, help="viewer (read only) or operator (may apply and roll back)")
    add.add_argument("--replace", action="store_true", help="change an existing user's role or password")
    rm = usub.add_parser("remove", help="remove a user")
    rm.add_argument("name")
    usub.add_parser("list", help="list users and roles")
    args = parser.parse_args(argv)
    if args.cmd == "users":
        return _users(args)
    env = dict(os.environ)
    if args.db:
        env[ENV_DB] = args.db
        env.pop(envs.DB_URL_DEPRECATED, None)
    if not args.no_bootstrap_user:
        bootstrap_user()
    argv_st = streamlit_argv(args.port, args.address)
    print(f"SpecPilot dashboard: http://{args.address}:{args.port}", flush=True)
    os.execve(sys.executable, argv_st, env)
    return 0  # pragma: no cover


if __name__ == "__main__":
    sys.exit(main())
