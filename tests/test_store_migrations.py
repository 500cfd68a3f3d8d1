"""The store's schema comes only from the Alembic revisions: upgrade from empty to head,
downgrade back to empty, models and migrations agree; on SQLite and PostgreSQL."""

from __future__ import annotations

import pytest
from alembic.autogenerate import compare_metadata
from alembic.migration import MigrationContext
from sqlalchemy import inspect, select, text

from control.db import StoreError, create_db_engine, current_revision, downgrade, open_engine, upgrade
from control.models import AlertRule, Base
from tests.support import BACKENDS, database_url


def _single_head() -> str:
    """The one head of the revision chain (two heads would be a merge mistake)."""
    from alembic.script import ScriptDirectory

    from control.db import alembic_config

    heads = ScriptDirectory.from_config(alembic_config()).get_heads()
    assert len(heads) == 1, f"the migrations have several heads: {heads}"
    return heads[0]


HEAD = _single_head()

TABLES = {
    "hosts",
    "config_versions",
    "audit_events",
    "metric_samples",
    "collection_gaps",
    "alert_rules",
    "alert_events",
    "warmup_schedules",
    "warmup_runs",
}


@pytest.fixture(params=BACKENDS)
def db_url(request, tmp_path):
    return database_url(request.param, tmp_path)


def test_upgrade_from_empty_to_head_then_downgrade_to_empty(db_url):
    engine = create_db_engine(db_url)
    try:
        assert current_revision(engine) is None
        assert not set(inspect(engine).get_table_names()) & TABLES
        upgrade(engine)
        assert current_revision(engine) == HEAD
        assert TABLES <= set(inspect(engine).get_table_names())
        downgrade(engine, "base")
        assert current_revision(engine) is None
        assert not set(inspect(engine).get_table_names()) & TABLES
        upgrade(engine)  # and up again
        assert TABLES <= set(inspect(engine).get_table_names())
    finally:
        engine.dispose()


def test_models_match_the_migrated_schema(db_url):
    engine = open_engine(db_url)
    try:
        with engine.connect() as conn:
            diff = compare_metadata(MigrationContext.configure(conn, opts={"compare_type": True}), Base.metadata)
        assert diff == []
    finally:
        engine.dispose()


def test_default_alert_rules_are_data_in_the_schema(db_url):
    engine = open_engine(db_url)
    try:
        with engine.connect() as conn:
            rules = {r.name: r for r in conn.execute(select(AlertRule.__table__))}
        assert rules["low_acceptance"].metric == "acceptance_rate" and rules["low_acceptance"].op == "<"
        assert rules["low_acceptance"].threshold == 0.5 and rules["low_acceptance"].for_s == 300
        assert rules["kv_cache_full"].threshold == 0.9
        assert rules["queue_time_p99"].metric == "queue_p99_ms" and rules["queue_time_p99"].threshold == 500
        assert rules["host_down"].metric == "up"
    finally:
        engine.dispose()


def test_opening_twice_is_idempotent(db_url):
    for _ in range(2):
        engine = open_engine(db_url)
        assert current_revision(engine) == HEAD
        engine.dispose()


def test_sqlite_store_is_in_wal_mode_with_foreign_keys(tmp_path):
    engine = open_engine(f"sqlite:///{tmp_path / 'x.db'}")
    try:
        with engine.connect() as conn:
            assert conn.execute(text("PRAGMA journal_mode")).scalar() == "wal"
            assert conn.execute(text("PRAGMA foreign_keys")).scalar() == 1
    finally:
        engine.dispose()


def test_default_store_lives_in_specpilot_home(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECPILOT_HOME", str(tmp_path / "home"))
    monkeypatch.delenv("SPECPILOT_DB_URL", raising=False)
    engine = open_engine()
    try:
        assert engine.url.database == str((tmp_path / "home" / "specpilot.db").resolve())
    finally:
        engine.dispose()


@pytest.mark.parametrize("url", ["nonsense://x", "not a url", "postgresql+nodriver://u@h/db"])
def test_bad_database_url_is_a_clear_error(url):
    with pytest.raises(StoreError):
        open_engine(url)
