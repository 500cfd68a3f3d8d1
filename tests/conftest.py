"""Shared fixtures: one real engine host per test session (CPU, eager mode).

Processes started here are always stopped. Logs and screenshots go to
``test-artifacts/`` in the repository root.
"""

from __future__ import annotations

import os
from pathlib import Path

import httpx
import pytest

ARTIFACTS = Path(__file__).resolve().parent.parent / "test-artifacts"


@pytest.fixture(scope="session")
def artifacts_dir() -> Path:
    """Folder for logs and screenshots kept after the run."""
    ARTIFACTS.mkdir(exist_ok=True)
    return ARTIFACTS


@pytest.fixture(scope="session")
def default_model() -> str:
    """Path of the prepared default model (prepared on first use)."""
    from engine_host.model import prepare_default_model

    return str(prepare_default_model(quiet=True))


@pytest.fixture(scope="session")
def engine_host(default_model, tmp_path_factory, artifacts_dir):
    """A real engine host: SmolLM2-135M, ngram speculation K_max=8, max_num_seqs=8.

    Yields the :class:`engine_host.process.EngineHostProcess` (``.url``,
    ``.control_headers``, ``.token``, ``.step_trace``: the step trace's path, the engine
    core's pid appended). Session-scoped: tests that change its config
    must restore it (see ``restore_config``).
    """
    from engine_host.process import EngineHostProcess

    home = tmp_path_factory.mktemp("engine-home")
    eh = EngineHostProcess(
        model=default_model,
        extra_args=[
            "--enforce-eager",
            "--k-max",
            "8",
            "--max-num-seqs",
            "8",
            "--max-model-len",
            "1024",
            "--speculation-mode",
            "fixed",
            "--k",
            "0",
        ],
        env={
            "SPECPILOT_HOME": str(home),
            "SPECPILOT_NGRAM_TRACE": str(home / "ngram-trace.json"),
            "SPECPILOT_STEP_TRACE": str(home / "steps.csv"),  # the engine core appends .PID
        },
        log_path=artifacts_dir / "engine-host.log",
    )
    eh.ngram_trace = home / "ngram-trace.json"
    eh.step_trace = home / "steps.csv"
    eh.start()
    try:
        eh.wait_ready(timeout_s=float(os.environ.get("SPECPILOT_TEST_READY_TIMEOUT", "400")))
        yield eh
    finally:
        eh.stop()


@pytest.fixture
def control(engine_host):
    """An httpx client for ``/control/*`` with the bearer token."""
    with httpx.Client(base_url=engine_host.url, headers=engine_host.control_headers, timeout=60.0) as c:
        yield c


@pytest.fixture
def restore_config(control):
    """Put the engine host back on fixed K=0 with start-up caps after the test."""
    yield
    control.put(
        "/control/config",
        json={
            "speculation": {"mode": "fixed", "k": 0, "k_min": 0, "k_max": None},
            "batch": {"max_num_seqs": None, "max_num_batched_tokens": None},
        },
    )
