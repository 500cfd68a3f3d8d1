"""A throwaway PostgreSQL server for the store tests, and the per-test database URL for
each store back-end."""

from __future__ import annotations

import atexit
import glob
import os
import pwd
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path

from .net import free_port


def postgres_bin_dir() -> Path | None:
    """Folder with ``initdb``/``pg_ctl`` (Debian's ``/usr/lib/postgresql/N/bin`` or PATH)."""
    found = sorted(glob.glob("/usr/lib/postgresql/*/bin/initdb"), key=lambda p: int(p.split("/")[4]))
    if found:
        return Path(found[-1]).parent
    initdb = shutil.which("initdb")
    return Path(initdb).parent if initdb else None


def psycopg_installed() -> bool:
    """True when the ``psycopg`` driver imports."""
    try:
        import psycopg  # noqa: F401

        return True
    except ImportError:
        return False


class PostgresServer:
    """A PostgreSQL cluster in a temporary folder, listening on 127.0.0.1 only, trust auth.

    When run as root, the cluster runs as the ``postgres`` system user (``initdb``
    refuses root). :meth:`new_database` returns the URL of a fresh, empty database.

    Raises:
        RuntimeError: binaries missing or the server did not start (with its log).
    """

    def __init__(self) -> None:
        self.bin = postgres_bin_dir()
        if self.bin is None:
            raise RuntimeError("PostgreSQL binaries not found (apt-get install postgresql)")
        self.port = free_port()
        self.dir = Path(tempfile.mkdtemp(prefix="specpilot-pg-"))
        self.data = self.dir / "data"
        self.log = self.dir / "server.log"
        self._n = 0
        self._lock = threading.Lock()
        self.user: str | None = None
        if os.geteuid() == 0:
            self.user = "postgres"
            pw = pwd.getpwnam(self.user)
            os.chmod(self.dir, 0o755)
            os.chown(self.dir, pw.pw_uid, pw.pw_gid)

    def _run(self, *args: str) -> subprocess.CompletedProcess[str]:
        cmd = [str(self.bin / args[0]), *args[1:]]
        if self.user:
            cmd = ["runuser", "-u", self.user, "--", *cmd]
        return subprocess.run(cmd, capture_output=True, text=True, cwd=self.dir, timeout=120)

    def start(self) -> "PostgresServer":
        r = self._run("initdb", "-D", str(self.data), "-A", "trust", "-U", "postgres", "-E", "UTF8", "--no-sync")
        if r.returncode:
            raise RuntimeError(f"initdb failed: {r.stderr or r.stdout}")
        opts = f"-p {self.port} -k {self.dir} -c listen_addresses=127.0.0.1 -c fsync=off -c max_connections=100"
        r = self._run("pg_ctl", "-D", str(self.data), "-l", str(self.log), "-o", opts, "-w", "-t", "60", "start")
        if r.returncode:
            log = self.log.read_text(errors="replace") if self.log.exists() else ""
            raise RuntimeError(f"PostgreSQL did not start: {r.stderr or r.stdout}\n{log[-2000:]}")
        return self

    @property
    def admin_url(self) -> str:
        return f"postgresql+psycopg://postgres@127.0.0.1:{self.port}/postgres"

    def new_database(self) -> str:
        """Create an empty database; returns its SQLAlchemy URL."""
        import psycopg

        with self._lock:
            self._n += 1
            name = f"specpilot_{os.getpid()}_{self._n}"
        with psycopg.connect(f"host=127.0.0.1 port={self.port} user=postgres dbname=postgres", autocommit=True) as c:
            c.execute(f'CREATE DATABASE "{name}"')
        return f"postgresql+psycopg://postgres@127.0.0.1:{self.port}/{name}"

    def stop(self) -> None:
        if self.data.exists():
            self._run("pg_ctl", "-D", str(self.data), "-m", "immediate", "-w", "stop")
        shutil.rmtree(self.dir, ignore_errors=True)


_SHARED_PG: PostgresServer | None = None

#: Store back-ends the store tests run against.
BACKENDS = ("sqlite", "postgresql")


def why_no_postgres() -> str | None:
    """Why PostgreSQL tests cannot run here (None when they can)."""
    if postgres_bin_dir() is None:
        return "PostgreSQL binaries not found (apt-get install postgresql)"
    if not psycopg_installed():
        return "the psycopg driver is not installed (pip install 'specpilot[postgres]')"
    return None


def database_url(backend: str, tmp_path: Path) -> str:
    """A fresh, empty database for one test: an SQLite file in ``tmp_path`` or a new
    database on the shared throwaway PostgreSQL server.

    PostgreSQL missing: the test is skipped, or fails when ``CI=true`` (CI must run both).
    """
    if backend == "sqlite":
        return f"sqlite:///{tmp_path / 'specpilot.db'}"
    missing = why_no_postgres()
    if missing:
        import pytest

        if os.environ.get("CI", "").lower() == "true":
            pytest.fail(f"CI runs the store tests on PostgreSQL too: {missing}")
        pytest.skip(missing)
    return shared_postgres().new_database()


def shared_postgres() -> PostgresServer:
    """One throwaway server per test process (stopped at exit)."""
    global _SHARED_PG
    if _SHARED_PG is None:
        _SHARED_PG = PostgresServer().start()
        atexit.register(_SHARED_PG.stop)
    return _SHARED_PG
