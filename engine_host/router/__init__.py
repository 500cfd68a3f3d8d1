"""The dual engine host: a plain engine and a speculative engine behind one address.

``python -m engine_host.router [--model M] [--port 8000] [--k-max 8] [--gpu-memory-utilization 0.4] ...``

starts two engine hosts (the *plain* one with ``--k-max 0``: no speculative config, so
vLLM keeps async scheduling, its newest model runner and full CUDA graphs; the
*speculative* one with n-gram drafts and SpecPilot's adaptive K) and serves, on one port,
the OpenAI API (each request to the engine chosen by the traffic split from the two
engines' measured TPOT, named in the header ``x-specpilot-engine``), ``/health``,
``/ready``, ``/metrics`` (both engines under an ``engine`` label, plus
``specpilot:router_*``) and ``/control/*`` (the speculative engine's, with the routing
added: see :mod:`engine_host.router.app`).

Two fronts serve that port:

* ``--front engine`` (default): the plain engine host itself listens on the port and
  routes inside vLLM's server (:mod:`engine_host.router.front`): a request for the plain
  engine costs no extra hop; one for the speculative engine is relayed over HTTP.
* ``--front relay``: a separate router process (:func:`engine_host.router.app.app_from_env`
  under uvicorn) relays every request; ``--workers N`` runs N of them (each keeps its own
  split from the same TPOT polls; with N > 1 the ``router`` figures are the answering
  worker's). ``--plain-url`` and ``--spec-url`` attach it to engine hosts already running.

Modules (this package imports none of them itself, so that :mod:`engine_host.config` can
import the settings alone):

    settings   RouterSettings: the routing mode and the split's settings (one default each),
               also the ``router`` section of the live config
    split      TrafficSplit: the share of requests for each engine (pure logic)
    metrics    vLLM's TPOT histogram read for the split; both engines' /metrics merged
    state      the backends, the split, the HTTP client, the TPOT poll loop, the routing file
    app        the FastAPI routers (OpenAI relay, health and metrics, control) and the app
    front      the in-engine front: ASGI middleware inside the plain engine's vLLM server
    cli        the command line: start or attach to both engine hosts, serve, stop them
"""
