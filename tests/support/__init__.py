"""Test doubles and throwaway servers for the tests and benchmarks (not part of the
product): a stand-in engine host, synthetic samples, PostgreSQL, Prometheus, a TCP relay."""

from .fake_engine import FakeEngineHost, FakeEngineMetrics, synthetic_sample
from .net import TcpRelay, free_port
from .postgres import (
    BACKENDS,
    PostgresServer,
    database_url,
    postgres_bin_dir,
    psycopg_installed,
    shared_postgres,
    why_no_postgres,
)
from .prometheus import PrometheusServer, why_no_prometheus

__all__ = [
    "BACKENDS",
    "FakeEngineHost",
    "FakeEngineMetrics",
    "PostgresServer",
    "PrometheusServer",
    "TcpRelay",
    "database_url",
    "free_port",
    "postgres_bin_dir",
    "psycopg_installed",
    "shared_postgres",
    "synthetic_sample",
    "why_no_postgres",
    "why_no_prometheus",
]
