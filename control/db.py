"""Database engines and migrations.

The store is SQLite by default (``$SPECPILOT_HOME/specpilot.db``, WAL mode) or any
SQLAlchemy URL (``postgresql+psycopg://user@host/db``). The schema is created and
upgraded only by the Alembic revisions in ``migrations/``: :func:`open_engine` runs
``alembic upgrade head`` through Alembic's command API every time it opens a store.

SQLite specifics: foreign keys on, a 30 s busy timeout, and write transactions that
start with ``BEGIN IMMEDIATE`` (take the write lock before the first read), so that
concurrent writers in several processes queue up instead of failing with
"database is locked" on a stale snapshot. Use :func:`writer` for such transactions.
"""

from __future__ import annotations

from pathlib import Path

from sqlalchemy import Engine, create_engine, event
from sqlalchemy.engine import make_url
from sqlalchemy.exc import ArgumentError

from engine_host import envs

ENV_DB = envs.DB_URL
SQLITE_BUSY_TIMEOUT_S = 30.0


class StoreError(RuntimeError):
    """The store cannot be opened (bad URL, missing driver, migration failure)."""


def default_url() -> str:
    """``$SPECPILOT_DB_URL`` when set, else ``sqlite:///$SPECPILOT_HOME/specpilot.db``."""
    env = envs.db_url()
    if env:
        return env
    from engine_host.home import home

    return f"sqlite:///{home() / 'specpilot.db'}"


def migrations_dir() -> Path:
    """Folder of the Alembic environment (``migrations/`` beside ``control/``)."""
    import migrations

    return Path(next(iter(migrations.__path__))).resolve()


def alembic_config(engine: Engine | None = None, connection=None):
    """An Alembic ``Config`` for ``migrations/``; with ``connection`` the revisions run on it."""
    from alembic.config import Config

    cfg = Config()
    cfg.set_main_option("script_location", str(migrations_dir()))
    if engine is not None:
        cfg.set_main_option("sqlalchemy.url", engine.url.render_as_string(hide_password=False).replace("%", "%%"))
    if connection is not None:
        cfg.attributes["connection"] = connection
    return cfg


def _sqlite_setup(engine: Engine) -> None:
    @event.listens_for(engine, "connect")
    def _on_connect(dbapi_conn, _record):  # noqa: ANN001
        dbapi_conn.isolation_level = None  # SQLAlchemy's "begin" event below starts transactions
        cur = dbapi_conn.cursor()
        cur.execute(f"PRAGMA busy_timeout = {int(SQLITE_BUSY_TIMEOUT_S * 1000)}")
        cur.execute("PRAGMA journal_mode = WAL")
        cur.execute("PRAGMA synchronous = NORMAL")
        cur.execute("PRAGMA foreign_keys = ON")
        cur.close()

    @event.listens_for(engine, "begin")
    def _on_begin(conn):  # noqa: ANN001
        conn.exec_driver_sql("BEGIN IMMEDIATE" if conn.get_execution_options().get("sp_write") else "BEGIN")


def create_db_engine(url: str | None = None) -> Engine:
    """An SQLAlchemy engine for ``url`` (default :func:`default_url`), without migrating.

    Raises:
        StoreError: malformed URL or missing database driver.
    """
    url = url or default_url()
    try:
        parsed = make_url(url)
    except ArgumentError as exc:
        raise StoreError(f"bad database URL {url!r}: {exc}") from None
    kwargs: dict = {}
    if parsed.get_backend_name() == "sqlite":
        db = parsed.database
        if db and db != ":memory:" and not db.startswith("file:"):
            Path(db).expanduser().parent.mkdir(parents=True, exist_ok=True)
        kwargs["connect_args"] = {"timeout": SQLITE_BUSY_TIMEOUT_S, "check_same_thread": False}
    else:
        kwargs["pool_pre_ping"] = True
    try:
        engine = create_engine(parsed, **kwargs)
    except (ImportError, ArgumentError) as exc:
        raise StoreError(
            f"cannot open {parsed.render_as_string()}: {exc} (PostgreSQL needs: pip install 'specpilot[postgres]')"
        ) from None
    if parsed.get_backend_name() == "sqlite":
        _sqlite_setup(engine)
    return engine


def writer(engine: Engine) -> Engine:
    """The same engine for write transactions (``BEGIN IMMEDIATE`` on SQLite)."""
    return engine.execution_options(sp_write=True)


def upgrade(engine: Engine, revision: str = "head") -> None:
    """Run the Alembic revisions up to ``revision`` (in one write transaction).

    Raises:
        StoreError: a revision failed (the transaction is rolled back).
    """
    from alembic import command

    try:
        with writer(engine).begin() as conn:
            command.upgrade(alembic_config(connection=conn), revision)
    except Exception as exc:  # surfaced with the database named
        raise StoreError(f"migrating {engine.url.render_as_string()} to {revision} failed: {exc}") from exc


def downgrade(engine: Engine, revision: str = "base") -> None:
    """Run the Alembic downgrades to ``revision`` (``base``: empty schema)."""
    from alembic import command

    with writer(engine).begin() as conn:
        command.downgrade(alembic_config(connection=conn), revision)


def current_revision(engine: Engine) -> str | None:
    """The revision the database is at (None: not under migration control)."""
    from alembic.runtime.migration import MigrationContext

    with engine.connect() as conn:
        return MigrationContext.configure(conn).get_current_revision()


def open_engine(url: str | None = None) -> Engine:
    """Open the store at ``url`` and upgrade its schema to the newest revision.

    Raises:
        StoreError: bad URL, missing driver, unreachable server or failed migration.
    """
    engine = create_db_engine(url)
    try:
        upgrade(engine)
    except StoreError:
        engine.dispose()
        raise
    return engine
