"""The SpecPilot data directory.

Everything SpecPilot writes lives under one folder: ``$SPECPILOT_HOME`` when set,
otherwise ``~/.specpilot``. Layout::

    models/<name>/        prepared Hugging Face model folders
    control_token         the engine host's control bearer token (mode 0600)
    run/                  control channels of running engine hosts
    specpilot.db          the control plane's SQLite store
    logs/                 process logs of the main job
"""

from __future__ import annotations

from pathlib import Path

from . import envs

ENV_HOME = envs.HOME


def home() -> Path:
    """Return the data directory, creating it if needed.

    Returns:
        Absolute path of ``$SPECPILOT_HOME`` (default ``~/.specpilot``).
    Raises:
        OSError: the folder cannot be created.
    """
    path = envs.home_dir().resolve()
    path.mkdir(parents=True, exist_ok=True)
    return path


def subdir(name: str) -> Path:
    """Return ``home()/name``, creating it if needed."""
    path = home() / name
    path.mkdir(parents=True, exist_ok=True)
    return path
