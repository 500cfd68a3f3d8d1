"""Alembic environment for the control plane's store.

Run by ``control.db.upgrade`` with a connection in ``config.attributes["connection"]``
(the app's own path), or from the command line with ``alembic.ini`` at the repository
root, the URL taken from ``-x db=URL``, ``$SPECPILOT_DB_URL`` or the default SQLite file.
"""

from __future__ import annotations

from alembic import context

from control.models import Base

config = context.config
target_metadata = Base.metadata


def _run(connection) -> None:
    context.configure(
        connection=connection,
        target_metadata=target_metadata,
        render_as_batch=connection.dialect.name == "sqlite",  # ALTER through table copies
        compare_type=True,
    )
    with context.begin_transaction():
        context.run_migrations()


def run_migrations_online() -> None:
    connection = config.attributes.get("connection")
    if connection is not None:
        _run(connection)
        return
    from control.db import create_db_engine, writer

    url = context.get_x_argument(as_dictionary=True).get("db") or config.get_main_option("sqlalchemy.url") or None
    engine = create_db_engine(url)
    try:
        with writer(engine).connect() as conn:
            _run(conn)
            conn.commit()
    finally:
        engine.dispose()


if context.is_offline_mode():
    raise SystemExit("offline (--sql) migrations are not supported; give a database with -x db=URL")
run_migrations_online()
