"""SpecPilot engine host: vLLM's OpenAI-compatible server with SpecPilot's
live-speculation scheduler hook, control endpoints and statistics.

Modules:
    home        the data directory (``SPECPILOT_HOME``) and the paths inside it
    model       preparation of the default model (GGUF -> safetensors folder)
    config      the live config: pydantic models and validation (shared with control/)
    channel     the shared-memory channel between the API process and the engine core
    scheduler   the ``Scheduler`` subclass that applies K and batch caps each step
    controller  speculation-depth policies (fixed, adaptive goodput, baselines)
    stats       per-second samples for live views (a vLLM stat-logger plugin)
    plugin      the ``/control/*``, ``/ready`` routes and ``specpilot:*`` metrics
    launcher    ``python -m engine_host``: builds and runs ``vllm serve``
    router      the dual engine host: a plain and a speculative engine behind one address
"""
