"""Every ``SPECPILOT_*`` environment variable, read in one place (after ``vllm/envs.py``).

Each variable has a name constant (to set it for a child process) and a reader function
(to read it); :data:`VARIABLES` lists them all with their meaning, for docs and
``--help`` texts. Readers take an optional mapping (default ``os.environ``) and return the
raw value, or the documented default, at the time of the call (nothing is cached: tests
and launchers change the environment). The engine host owns this module so that
``engine_host`` imports nothing from ``control``; ``control``, ``dashboard`` and ``bench``
import it.
"""

from __future__ import annotations

import os
import warnings
from pathlib import Path
from typing import Mapping

HOME = "SPECPILOT_HOME"
CONTROL_TOKEN = "SPECPILOT_CONTROL_TOKEN"
CHANNEL = "SPECPILOT_CHANNEL"
WARMUP = "SPECPILOT_WARMUP"
SPECULATION = "SPECPILOT_SPECULATION"
ROUTER_CONFIG = "SPECPILOT_ROUTER_CONFIG"
ENDPOINT_EXTENSIONS = "SPECPILOT_ENDPOINT_EXTENSIONS"
NGRAM_TRACE = "SPECPILOT_NGRAM_TRACE"
STEP_TRACE = "SPECPILOT_STEP_TRACE"
VLLM_PATCHES = "SPECPILOT_VLLM_PATCHES"
DRAFT_DECODE_GRAPHS = "SPECPILOT_DRAFT_DECODE_GRAPHS"
K0_LEAN = "SPECPILOT_K0_LEAN"
HOOK_LEAN = "SPECPILOT_HOOK_LEAN"
HOOK_ASIDE = "SPECPILOT_HOOK_ASIDE"
PROBE_PRIOR = "SPECPILOT_PROBE_PRIOR"
PROBE_BACKOFF = "SPECPILOT_PROBE_BACKOFF"
EXPLORE_BY_CLASS = "SPECPILOT_EXPLORE_BY_CLASS"
RUN_STATES = "SPECPILOT_RUN_STATES"
DEPTH_TOKENS = "SPECPILOT_DEPTH_TOKENS"
REST_SPAN_SCALING = "SPECPILOT_REST_SPAN_SCALING"
LEAN_STEP_TIMES = "SPECPILOT_LEAN_STEP_TIMES"
CORE_CPU = "SPECPILOT_CORE_CPU"
DB_URL = "SPECPILOT_DB_URL"
DB_URL_DEPRECATED = "SPECPILOT_DB"
USERS_FILE = "SPECPILOT_USERS_FILE"
USERS = "SPECPILOT_USERS"
NEW_PASSWORD = "SPECPILOT_NEW_PASSWORD"
METRICS_SOURCE = "SPECPILOT_METRICS_SOURCE"
PROMETHEUS_URL = "SPECPILOT_PROMETHEUS_URL"
CHROMIUM = "SPECPILOT_CHROMIUM"
SESSION_SECRET = "SPECPILOT_SESSION_SECRET"
API_KEY = "SPECPILOT_API_KEY"
API_PID = "SPECPILOT_API_PID"
FAULT_RUN = "SPECPILOT_FAULT_RUN"

#: name -> meaning, for every variable SpecPilot reads (``SPECPILOT_VENV`` is read by
#: ``scripts/setup.sh`` only; tests read their own variables, e.g. the engine start-up timeout).
VARIABLES: dict[str, str] = {
    HOME: "data directory (store, control token, models, logs, run files); default ~/.specpilot",
    CONTROL_TOKEN: "bearer token of the engine host's /control/* endpoints (else $SPECPILOT_HOME/control_token)",
    CHANNEL: "path of the shared-memory file between the API process and the engine core (set by the launcher)",
    WARMUP: "start-up warm-up of the engine host: full, quick or off (set by the launcher; default full)",
    SPECULATION: "JSON of the speculation method and draft in use (set by the launcher for vLLM's processes)",
    ROUTER_CONFIG: "JSON config of the dual engine host's router (set by python -m engine_host.router)",
    ENDPOINT_EXTENSIONS: "module:factory items (comma-separated) the endpoint plugin also attaches (set by the router for the plain engine)",
    NGRAM_TRACE: "file where each process writes the n-gram proposer's call counters (tests, profiling)",
    STEP_TRACE: "file (.PID appended) where the engine core writes one row per step: times and K (profiling; `python -m bench step-trace`)",
    VLLM_PATCHES: "0 leaves vLLM's behaviour at K = 0 unpatched (engine_host/vllm_patches.py; for side-by-side benchmarks), default 1",
    K0_LEAN: "0 keeps the engine on its full per-step path at K = 0: the scheduler hook's lean path (speculation off, and the adaptive policy's rests at K = 0) and Model Runner V2's draft bookkeeping at K = 0 (GPU, ngram_gpu) stay as they were (for side-by-side benchmarks), default 1",
    HOOK_LEAN: f"0 keeps only the scheduler hook on its full per-step path at K = 0, Model Runner V2's draft bookkeeping at K = 0 still skipped: a static K = 0 engine then runs its steps on the path an adaptive engine host's steps at K = 0 take, less the policy's decisions (side-by-side benchmarks; {K0_LEAN}=0 turns off both), default 1",
    PROBE_PRIOR: "0 restarts the adaptive engine's all-request probe wait (async scheduling) at every new request and at any accepted draft token, as before the wait read the new request's class (side-by-side benchmarks), default 1",
    PROBE_BACKOFF: "0 probes each request the adaptive engine's per-request gate keeps from drafting every probe_every steps, each probe at a step of its own (synchronous scheduling), and explores every burst of several requests after the engine drained soon, whatever their classes' drafts paid (as before the probes backed off and the drain's exploration read the classes; side-by-side benchmarks), default 1",
    EXPLORE_BY_CLASS: "0 lets every exploration of the adaptive policy at a batch of several requests run past the per-request gate, whatever the running requests' classes (as before explorations read the classes; side-by-side benchmarks), default 1",
    RUN_STATES: "1 prices each draft length K of the adaptive policy from acceptance kept apart for requests whose previous draft was accepted in full and the rest (engine_host/run_acceptance.py; trial, for side-by-side benchmarks), default 0: from the per-position acceptance over all decode requests",
    DEPTH_TOKENS: "1 moves the adaptive policy's E(K) and D(K) toward the tokens per request-step measured at each draft length K when it was served, by the evidence behind them (engine_host/depth_acceptance.py; trial, for side-by-side benchmarks), default 0: E(K) and D(K) from the per-position acceptance alone",
    HOOK_ASIDE: "0 keeps the scheduler hook in every engine step at a static K = 0 (its lean path) instead of stepping aside between state publishes, so that vLLM's engine core calls vLLM's own schedule() and update_from_output() (side-by-side benchmarks), default 1",
    REST_SPAN_SCALING: "0 keeps the scheduler hook's rests at K = 0 on its lean path as long at B >= 32 running requests as below (8 steps under the per-request gate's batch rule, 16 in the adaptive policy's own rests), where they otherwise last B // 16 times as long (fewer steps on the hook's full path at high load; side-by-side benchmarks), default 1",
    LEAN_STEP_TIMES: "0 keeps the lean path's step times out of the step-time model, which then learns a step at K = 0 only from steps on the hook's full path (side-by-side benchmarks), default 1",
    CORE_CPU: "the engine core's step loop's CPU: auto, off or a CPU index, as --core-cpu (which wins); the launcher sets it to the CPU taken, the engine core pins its step loop there at its first step; default auto on the GPU build, off on the CPU build",
    DRAFT_DECODE_GRAPHS: "0 keeps the draft model's single-token decode passes out of full CUDA graphs (GPU, draft_model; for side-by-side benchmarks), default 1",
    DB_URL: "store URL (SQLAlchemy), default sqlite:///$SPECPILOT_HOME/specpilot.db",
    DB_URL_DEPRECATED: f"deprecated alias of {DB_URL} (read with a warning when {DB_URL} is unset)",
    USERS_FILE: "dashboard users file (TOML), default $SPECPILOT_HOME/users.toml",
    USERS: "dashboard users as JSON (wins over the users file on equal names)",
    NEW_PASSWORD: "password for `python -m dashboard users add` when there is no terminal to prompt on",
    METRICS_SOURCE: "where views read windowed figures: embedded (the store, default) or prometheus",
    PROMETHEUS_URL: "Prometheus server URL for the prometheus metric source",
    API_KEY: "the OpenAI API key the engine host requires (else --api-key-file, $VLLM_API_KEY); never on a command line",
    API_PID: "PID of the engine host's API process (set by the launcher; vLLM's other processes exit when their parent dies)",
    FAULT_RUN: "marks every process of one `python -m bench faults` run (found through /proc/PID/environ)",
    SESSION_SECRET: "key that signs dashboard session cookies (else a random key in $SPECPILOT_HOME/dashboard-session.key)",
    CHROMIUM: "Chromium executable for browser benchmarks and tests, default /usr/bin/chromium",
}


def _env(environ: Mapping[str, str] | None) -> Mapping[str, str]:
    return os.environ if environ is None else environ


def home_dir(environ: Mapping[str, str] | None = None) -> Path:
    """``$SPECPILOT_HOME`` (default ``~/.specpilot``), user-expanded; not created here
    (:func:`engine_host.home.home` creates it)."""
    return Path(_env(environ).get(HOME) or Path.home() / ".specpilot").expanduser()


def control_token(environ: Mapping[str, str] | None = None) -> str | None:
    """``$SPECPILOT_CONTROL_TOKEN``, None when unset or empty."""
    return _env(environ).get(CONTROL_TOKEN) or None


def channel_path(environ: Mapping[str, str] | None = None) -> str | None:
    """``$SPECPILOT_CHANNEL`` (a file path), None when unset or empty."""
    return _env(environ).get(CHANNEL) or None


def warmup(environ: Mapping[str, str] | None = None) -> str:
    """``$SPECPILOT_WARMUP`` (``full``, ``quick`` or ``off``), default ``full``."""
    return _env(environ).get(WARMUP, "full")


def speculation(environ: Mapping[str, str] | None = None) -> str | None:
    """``$SPECPILOT_SPECULATION`` (JSON text), None when unset or empty."""
    return _env(environ).get(SPECULATION) or None


def router_config(environ: Mapping[str, str] | None = None) -> str | None:
    """``$SPECPILOT_ROUTER_CONFIG`` (JSON text), None when unset or empty."""
    return _env(environ).get(ROUTER_CONFIG) or None


def endpoint_extensions(environ: Mapping[str, str] | None = None) -> str | None:
    """``$SPECPILOT_ENDPOINT_EXTENSIONS`` (comma-separated ``module:factory``), None when unset or empty."""
    return _env(environ).get(ENDPOINT_EXTENSIONS) or None


def ngram_trace(environ: Mapping[str, str] | None = None) -> str | None:
    """``$SPECPILOT_NGRAM_TRACE`` (a file path), None when unset or empty."""
    return _env(environ).get(NGRAM_TRACE) or None


def step_trace(environ: Mapping[str, str] | None = None) -> str | None:
    """``$SPECPILOT_STEP_TRACE`` (a file path), None when unset or empty."""
    return _env(environ).get(STEP_TRACE) or None


def vllm_patches_on(environ: Mapping[str, str] | None = None) -> bool:
    """False when ``$SPECPILOT_VLLM_PATCHES`` is ``0`` (vLLM left unpatched), else True."""
    return _env(environ).get(VLLM_PATCHES, "1").strip() != "0"


def k0_lean_on(environ: Mapping[str, str] | None = None) -> bool:
    """False when ``$SPECPILOT_K0_LEAN`` is ``0`` (no lean path at K = 0), else True."""
    return _env(environ).get(K0_LEAN, "1").strip() != "0"


def hook_lean_on(environ: Mapping[str, str] | None = None) -> bool:
    """Whether the scheduler hook may take its lean path at K = 0: False when
    ``$SPECPILOT_K0_LEAN`` or ``$SPECPILOT_HOOK_LEAN`` is ``0``, else True."""
    env = _env(environ)
    return k0_lean_on(env) and env.get(HOOK_LEAN, "1").strip() != "0"


def hook_aside_on(environ: Mapping[str, str] | None = None) -> bool:
    """Whether the scheduler hook may step aside at a static K = 0 (``engine_host.scheduler``,
    ``_SpecPilotHook._step_aside``): False when ``$SPECPILOT_HOOK_ASIDE`` is ``0`` or the lean
    path is off (:func:`hook_lean_on`), else True."""
    env = _env(environ)
    return hook_lean_on(env) and env.get(HOOK_ASIDE, "1").strip() != "0"


def rest_span_scaling_on(environ: Mapping[str, str] | None = None) -> bool:
    """Whether the scheduler hook's rests at K = 0 grow with the batch from 32 requests
    (``_SpecPilotHook._rest_span``): False when ``$SPECPILOT_REST_SPAN_SCALING`` is ``0``, else True."""
    return _env(environ).get(REST_SPAN_SCALING, "1").strip() != "0"


def probe_prior_on(environ: Mapping[str, str] | None = None) -> bool:
    """False when ``$SPECPILOT_PROBE_PRIOR`` is ``0`` (every new request and any accepted draft
    token restart the async probes' wait), else True."""
    return _env(environ).get(PROBE_PRIOR, "1").strip() != "0"


def probe_backoff_on(environ: Mapping[str, str] | None = None) -> bool:
    """False when ``$SPECPILOT_PROBE_BACKOFF`` is ``0`` (the per-request gate probes every
    request every ``probe_every`` steps on its own, ``RequestDraftGate(probe_backoff=1)``, and
    every burst after a drain is explored soon), else True."""
    return _env(environ).get(PROBE_BACKOFF, "1").strip() != "0"


def explore_by_class_on(environ: Mapping[str, str] | None = None) -> bool:
    """False when ``$SPECPILOT_EXPLORE_BY_CLASS`` is ``0`` (the adaptive policy's explorations at
    several requests run past the per-request gate whatever the requests' classes), else True."""
    return _env(environ).get(EXPLORE_BY_CLASS, "1").strip() != "0"


def run_states_on(environ: Mapping[str, str] | None = None) -> bool:
    """True when ``$SPECPILOT_RUN_STATES`` is ``1`` (E(K) from the run states of
    :mod:`engine_host.run_acceptance`), else False (the aggregate per-position acceptance alone)."""
    return _env(environ).get(RUN_STATES, "0").strip() == "1"


def depth_tokens_on(environ: Mapping[str, str] | None = None) -> bool:
    """True when ``$SPECPILOT_DEPTH_TOKENS`` is ``1`` (E(K) moved toward the tokens measured at
    each depth served, :mod:`engine_host.depth_acceptance`), else False."""
    return _env(environ).get(DEPTH_TOKENS, "0").strip() == "1"


def lean_step_times_on(environ: Mapping[str, str] | None = None) -> bool:
    """False when ``$SPECPILOT_LEAN_STEP_TIMES`` is ``0`` (the lean path's step times do not
    teach the step-time model), else True."""
    return _env(environ).get(LEAN_STEP_TIMES, "1").strip() != "0"


def core_cpu(environ: Mapping[str, str] | None = None) -> str | None:
    """``$SPECPILOT_CORE_CPU`` as written (``auto``, ``off`` or a CPU index; parsed by
    ``engine_host.cpu_affinity.parse_core_cpu``), or None when unset or empty."""
    raw = _env(environ).get(CORE_CPU, "").strip()
    return raw or None


def draft_decode_graphs_on(environ: Mapping[str, str] | None = None) -> bool:
    """False when ``$SPECPILOT_DRAFT_DECODE_GRAPHS`` is ``0`` (the draft model's decode passes
    stay out of full CUDA graphs), else True."""
    return _env(environ).get(DRAFT_DECODE_GRAPHS, "1").strip() != "0"


def db_url(environ: Mapping[str, str] | None = None) -> str | None:
    """The store URL: ``$SPECPILOT_DB_URL``, else the deprecated ``$SPECPILOT_DB`` (with a
    ``FutureWarning``), else None (the caller's default SQLite file)."""
    env = _env(environ)
    url = env.get(DB_URL)
    if url:
        return url
    old = env.get(DB_URL_DEPRECATED)
    if old:
        warnings.warn(f"${DB_URL_DEPRECATED} is deprecated: set ${DB_URL} instead", FutureWarning, stacklevel=2)
        return old
    return None


def users_file(environ: Mapping[str, str] | None = None) -> str | None:
    """``$SPECPILOT_USERS_FILE`` (a path), None when unset or empty."""
    return _env(environ).get(USERS_FILE) or None


def users(environ: Mapping[str, str] | None = None) -> str | None:
    """``$SPECPILOT_USERS`` (JSON text), None when unset or empty."""
    return _env(environ).get(USERS) or None


def new_password(environ: Mapping[str, str] | None = None) -> str | None:
    """``$SPECPILOT_NEW_PASSWORD``, None when unset (an empty value is returned as is)."""
    return _env(environ).get(NEW_PASSWORD)


def metrics_source(environ: Mapping[str, str] | None = None) -> str:
    """``$SPECPILOT_METRICS_SOURCE`` stripped and lower-cased, default ``embedded``
    (not validated here: :func:`control.promsource.metric_source` does)."""
    return (_env(environ).get(METRICS_SOURCE) or "embedded").strip().lower()


def prometheus_url(environ: Mapping[str, str] | None = None) -> str | None:
    """``$SPECPILOT_PROMETHEUS_URL``, None when unset or empty."""
    return _env(environ).get(PROMETHEUS_URL) or None


def chromium(environ: Mapping[str, str] | None = None) -> str:
    """``$SPECPILOT_CHROMIUM``, default ``/usr/bin/chromium``."""
    return _env(environ).get(CHROMIUM, "/usr/bin/chromium")


def session_secret(environ: Mapping[str, str] | None = None) -> str | None:
    """``$SPECPILOT_SESSION_SECRET``, None when unset or empty (the dashboard then keeps a random key)."""
    return _env(environ).get(SESSION_SECRET) or None


def api_key(environ: Mapping[str, str] | None = None) -> str | None:
    """``$SPECPILOT_API_KEY`` stripped, None when unset or blank."""
    return (_env(environ).get(API_KEY) or "").strip() or None


def api_pid(environ: Mapping[str, str] | None = None) -> str:
    """``$SPECPILOT_API_PID`` (a PID as text), "" when unset."""
    return _env(environ).get(API_PID, "")
