"""SpecPilot's ``vllm.general_plugins`` entry point: runs in every vLLM process.

vLLM calls :func:`register` once in each of its processes (API server, engine core,
workers) when the plugin's name, ``specpilot_general``, is in ``VLLM_PLUGINS`` (the
launcher puts it there). Each concern that must act inside vLLM's own processes has
its own module; this function only calls them.
"""

from __future__ import annotations


def register() -> None:
    """Called by vLLM's ``load_general_plugins()`` in each vLLM process. Never raises."""
    from . import orphan_guard, vllm_patches

    orphan_guard.install()
    vllm_patches.install()
