"""Where an engine step's GPU and CPU time go, in one process, with PyTorch's profiler.

    python -m bench torch-profile --model MODEL [--speculative-method draft_model --draft-model DRAFT]
        [--k 4] [--workload code] [--batches 1,8] [--max-tokens 128] [--out DIR]

Runs vLLM's offline ``LLM`` in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``: the
engine core and the model runner run here), so that ``torch.profiler`` sees both the Python
side and the GPU kernels. vLLM's own scheduler runs every step at the configured K (no
SpecPilot hook); SpecPilot's vLLM patches apply as in an engine host (the general plugin)
unless ``SPECPILOT_VLLM_PATCHES=0``. For each batch size B, the first B prompts of the
workload are generated with a fixed number of output tokens (``ignore_eos``):

1. a timed pass: wall time, output tokens, engine steps (calls of the model runner's
   ``execute_model``), ms per step and tokens/s;
2. a profiled pass of the same prompts: CPU and GPU ms per step in labelled regions of the
   step (target forward, sampling, the draft-model speculator's first pass, decode passes
   and draft forward, the n-gram speculator, the rejection sampler) and the top GPU kernels.

The labelled regions are ``torch.profiler.record_function`` ranges put around those methods
for this run only (the product never does this). GPU ms of a region is the device time of
the kernels launched inside it; a kernel of a CUDA graph is counted where the graph is
launched.

Results: ``DIR/torch-profile.json`` and ``DIR/torch-profile.md`` (one table per batch
size); ``DIR/ops-B.txt`` holds PyTorch's own op table of each profiled pass.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import importlib
import json
import os
import sys
import time
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator

#: (module, class, method, label): the step's regions measured; absent ones are skipped, so
#: one list serves Model Runner V2 (``vllm.v1.worker.gpu``), the V1 runner and the CPU build
REGIONS: tuple[tuple[str, str, str, str], ...] = (
    ("vllm.v1.worker.gpu.model_runner", "GPUModelRunner", "execute_model", "step: execute_model (target forward)"),
    ("vllm.v1.worker.gpu.model_runner", "GPUModelRunner", "sample_tokens", "step: sample_tokens (sampling, drafting)"),
    ("vllm.v1.worker.gpu_model_runner", "GPUModelRunner", "execute_model", "step: execute_model (target forward)"),
    ("vllm.v1.worker.gpu_model_runner", "GPUModelRunner", "sample_tokens", "step: sample_tokens (sampling, drafting)"),
    ("vllm.v1.worker.gpu.spec_decode.rejection_sampler", "RejectionSampler", "__call__", "rejection sampler"),
    ("vllm.v1.worker.gpu.spec_decode.ngram.speculator", "NgramGPUSpeculator", "propose", "n-gram speculator"),
    ("vllm.v1.spec_decode.ngram_proposer", "NgramProposer", "propose", "n-gram speculator"),
    (
        "vllm.v1.worker.gpu.spec_decode.standalone_ar.speculator",
        "StandaloneARSpeculator",
        "propose",
        "draft model: propose (all)",
    ),
    (
        "vllm.v1.worker.gpu.spec_decode.standalone_ar.speculator",
        "StandaloneARSpeculator",
        "_prefill",
        "draft model: first pass",
    ),
    (
        "vllm.v1.worker.gpu.spec_decode.standalone_ar.speculator",
        "StandaloneARSpeculator",
        "_multi_step_decode",
        "draft model: decode passes",
    ),
    (
        "vllm.v1.worker.gpu.spec_decode.standalone_ar.speculator",
        "StandaloneARSpeculator",
        "_run_model",
        "draft model: forward (each pass)",
    ),
    (
        "vllm.v1.worker.gpu.spec_decode.target_dependent_ar.speculator",
        "TargetDependentARSpeculator",
        "propose",
        "EAGLE speculator",
    ),
)

#: the region whose calls count the engine's steps
STEP_LABEL = "step: execute_model (target forward)"


class Regions:
    """Labelled ``record_function`` ranges around :data:`REGIONS`, with call counts.

    Use as a context manager: the methods are wrapped on entry and restored on exit.
    """

    def __init__(self, regions: Iterable[tuple[str, str, str, str]] = REGIONS) -> None:
        self.regions = tuple(regions)
        self.calls: dict[str, int] = {}
        self._restore: list[tuple[type, str, Any]] = []

    def _wrap(self, fn: Callable[..., Any], label: str) -> Callable[..., Any]:
        import torch

        @functools.wraps(fn)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            self.calls[label] = self.calls.get(label, 0) + 1
            with torch.profiler.record_function(label):
                return fn(*args, **kwargs)

        return wrapper

    def __enter__(self) -> "Regions":
        for module_name, cls_name, method, label in self.regions:
            try:
                cls = getattr(importlib.import_module(module_name), cls_name)
            except (ImportError, AttributeError):
                continue
            original = cls.__dict__.get(method)
            if original is None:
                continue
            setattr(cls, method, self._wrap(original, label))
            self._restore.append((cls, method, original))
        return self

    def __exit__(self, *exc: object) -> None:
        for cls, method, original in reversed(self._restore):
            setattr(cls, method, original)
        self._restore.clear()

    @property
    def wrapped(self) -> list[str]:
        """``Class.method`` of every wrapped method."""
        return [f"{c.__name__}.{m}" for c, m, _ in self._restore]

    def reset(self) -> None:
        """Zero the call counts."""
        self.calls.clear()


def _device_us(event: Any, attr: str) -> float:
    """``event``'s device time in us (``device_*`` in newer torch, ``cuda_*`` in older)."""
    for name in (f"{attr.replace('cuda', 'device')}", attr):
        value = getattr(event, name, None)
        if value is not None:
            return float(value)
    return 0.0


def summarize(events: Iterable[Any], labels: Iterable[str], steps: int, top: int = 15) -> dict[str, Any]:
    """Per-step CPU and GPU time of the labelled regions and the top GPU kernels.

    Args:
        events: ``profiler.key_averages()`` entries (``key``, ``count``, ``device_type``,
            ``cpu_time_total``, ``device_time_total``/``cuda_time_total``,
            ``self_device_time_total``; times in us). Kernels, copies and sets are the
            entries whose ``device_type`` is CUDA.
        labels: the region labels to report.
        steps: engine steps in the profiled pass (> 0).
        top: how many kernels to list.
    Returns:
        ``{"regions": {label: {"calls", "cpu_ms_per_step", "gpu_ms_per_step"[,
        "gpu_span_ms_per_step"]}}, "gpu_busy_ms_per_step", ...}``: CPU time of the range, device
        time of the kernels launched inside it, and (where the profiler records the range on the
        GPU too) its span on the GPU from first to last kernel. The rest:
        ``"gpu_busy_ms_per_step", "kernels": [{"name", "calls", "gpu_ms_per_step"}]``.
    Raises:
        ValueError: ``steps`` is not positive.
    """
    if steps <= 0:
        raise ValueError(f"steps must be > 0, got {steps}")
    wanted = set(labels)
    regions: dict[str, dict[str, float]] = {}
    kernels = []
    busy_us = 0.0
    for e in events:
        on_gpu = str(getattr(e, "device_type", "")).rpartition(".")[2] == "CUDA"
        if e.key in wanted:
            r = regions.setdefault(e.key, {"calls": 0, "cpu_ms_per_step": 0.0, "gpu_ms_per_step": 0.0})
            if on_gpu:  # the range as the GPU saw it: first kernel to last, gaps included
                r["gpu_span_ms_per_step"] = _device_us(e, "cuda_time_total") / 1000.0 / steps
            else:
                r["calls"] = int(e.count)
                r["cpu_ms_per_step"] = e.cpu_time_total / 1000.0 / steps
                r["gpu_ms_per_step"] = _device_us(e, "cuda_time_total") / 1000.0 / steps
            continue
        if not on_gpu:
            continue  # a CPU op: its device time is also listed under its kernels
        self_dev = _device_us(e, "self_cuda_time_total")
        busy_us += self_dev
        kernels.append({"name": e.key[:120], "calls": int(e.count), "gpu_ms_per_step": self_dev / 1000.0 / steps})
    kernels.sort(key=lambda k: -k["gpu_ms_per_step"])
    return {
        "regions": {k: regions[k] for k in sorted(regions, key=lambda k: -regions[k]["cpu_ms_per_step"])},
        "gpu_busy_ms_per_step": busy_us / 1000.0 / steps,
        "kernels": kernels[:top],
    }


def table(batch: dict[str, Any]) -> str:
    """Markdown of one batch size's result (:func:`run_batch`)."""
    t = batch["timed"]
    lines = [
        f"### batch {batch['batch']}: {t['steps']} steps, {t['ms_per_step']:.2f} ms/step, "
        f"{t['tokens_per_s']:.1f} tok/s, {t['tokens_per_step']:.2f} tokens/step per request",
        "",
        f"Profiled pass: {batch['profiled']['steps']} steps, {batch['profiled']['ms_per_step']:.2f} ms/step "
        f"(profiler on); GPU busy {batch['profile']['gpu_busy_ms_per_step']:.2f} ms/step.",
        "",
        "| region | calls | CPU ms/step | GPU kernels ms/step | GPU span ms/step |",
        "|---|---:|---:|---:|---:|",
    ]
    for label, r in batch["profile"]["regions"].items():
        span = r.get("gpu_span_ms_per_step")
        lines.append(
            f"| {label} | {r['calls']} | {r['cpu_ms_per_step']:.3f} | {r['gpu_ms_per_step']:.3f} | "
            f"{'' if span is None else f'{span:.3f}'} |"
        )
    lines += ["", "| GPU kernel | calls | GPU ms/step |", "|---|---:|---:|"]
    for k in batch["profile"]["kernels"]:
        name = k["name"].replace("|", "/")
        lines.append(f"| `{name[:90]}` | {k['calls']} | {k['gpu_ms_per_step']:.3f} |")
    return "\n".join(lines)


def _prompts(workload: str, n: int) -> list[Any]:
    from .workloads import prompt_pool

    pool = prompt_pool(workload)
    if not pool:
        raise SystemExit(f"workload {workload!r} has no prompts")
    return [pool[i % len(pool)] for i in range(n)]


def _generate(llm: Any, prompts: list[Any], max_tokens: int) -> int:
    """Generate ``max_tokens`` tokens for each prompt; returns output tokens."""
    from vllm import SamplingParams

    def params(p: Any) -> Any:
        return SamplingParams(max_tokens=max_tokens, temperature=p.temperature, seed=p.seed, ignore_eos=True)

    outs: list[Any] = []
    text = [p for p in prompts if p.endpoint == "completions"]
    chat = [p for p in prompts if p.endpoint != "completions"]
    if text:
        outs += llm.generate([p.prompt for p in text], [params(p) for p in text], use_tqdm=False)
    if chat:
        outs += llm.chat([p.messages for p in chat], [params(p) for p in chat], use_tqdm=False)
    return sum(len(o.outputs[0].token_ids) for o in outs)


@contextlib.contextmanager
def _timer() -> Iterator[dict[str, float]]:
    box: dict[str, float] = {}
    t0 = time.perf_counter()
    try:
        yield box
    finally:
        box["s"] = time.perf_counter() - t0


def parse_llm_args(items: Iterable[str]) -> dict[str, Any]:
    """``["async_scheduling=false", "block_size=32", "x=abc"]`` -> ``{"async_scheduling": False,
    "block_size": 32, "x": "abc"}`` (JSON where it parses, else the text).

    Raises:
        ValueError: an item without ``=`` or with an empty key.
    """
    out: dict[str, Any] = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise ValueError(f"expected KEY=VALUE, got {item!r}")
        try:
            out[key.strip()] = json.loads(value)
        except json.JSONDecodeError:
            out[key.strip()] = value
    return out


def top_frames(raw: str, top: int = 25) -> dict[str, list[tuple[str, int]]]:
    """The busiest frames of a py-spy ``raw`` (collapsed stacks) record.

    Args:
        raw: lines ``frame;frame;...;frame COUNT``.
        top: how many frames per list.
    Returns:
        ``{"self": [(frame, samples)], "inclusive": [(frame, samples)], "samples": [("all", n)]}``:
        the innermost frame of each sample, and every frame a sample passes through
        (counted once per sample).
    """
    own: dict[str, int] = {}
    incl: dict[str, int] = {}
    total = 0
    for line in raw.splitlines():
        stack, _, n = line.rpartition(" ")
        if not stack or not n.isdigit():
            continue
        count = int(n)
        total += count
        frames = stack.split(";")
        own[frames[-1]] = own.get(frames[-1], 0) + count
        for f in set(frames):
            incl[f] = incl.get(f, 0) + count

    def best(d: dict[str, int]) -> list[tuple[str, int]]:
        return sorted(d.items(), key=lambda kv: -kv[1])[:top]

    return {"self": best(own), "inclusive": best(incl), "samples": [("all", total)]}


@contextlib.contextmanager
def _py_spy(exe: str | None, out_file: Path) -> Iterator[dict[str, Any]]:
    """py-spy this process (100 Hz, busy threads, without pausing it) while the block runs; the summary of
    :func:`top_frames` lands in the yielded dict (empty without ``exe``)."""
    import signal
    import subprocess

    box: dict[str, Any] = {}
    if not exe:
        yield box
        return
    cmd = [exe, "record", "-p", str(os.getpid()), "-r", "100", "-f", "raw", "--nonblocking", "-o", str(out_file)]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    time.sleep(1.0)  # attached before the work starts
    try:
        yield box
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            _, err = proc.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            err = b""
        if out_file.exists():
            box.update(top_frames(out_file.read_text()))
        else:
            box["error"] = err.decode(errors="replace")[-500:]


def run_batch(
    llm: Any, regions: Regions, prompts: list[Any], max_tokens: int, out_dir: Path, py_spy: str | None = None
) -> dict[str, Any]:
    """The timed and the profiled pass for one batch of ``prompts`` (see the module doc),
    ``max_tokens`` output tokens each; writes ``out_dir/ops-B.txt`` (and ``pyspy-B.txt``).

    Returns:
        ``{"batch", "timed": {"steps", "wall_s", "tokens", "ms_per_step", "tokens_per_s",
        "tokens_per_step"}, "profiled": {"steps", "wall_s", "ms_per_step"}, "profile"``
        (:func:`summarize`) ``, "py_spy"`` (:func:`top_frames`, empty without py-spy)``}``.
    Raises:
        Whatever vLLM's ``generate`` raises.
    """
    import torch
    from torch.profiler import ProfilerActivity, profile

    n = len(prompts)
    regions.reset()
    with _py_spy(py_spy, out_dir / f"pyspy-{n}.txt") as spy, _timer() as t:
        tokens = _generate(llm, prompts, max_tokens)
    steps = max(regions.calls.get(STEP_LABEL, 0), 1)
    timed = {
        "steps": steps,
        "wall_s": t["s"],
        "tokens": tokens,
        "ms_per_step": t["s"] * 1000.0 / steps,
        "tokens_per_s": tokens / t["s"],
        "tokens_per_step": tokens / steps / n,  # per request: vLLM's mean acceptance length
    }
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    regions.reset()
    with _timer() as tp, profile(activities=activities) as prof:
        _generate(llm, prompts, max_tokens)
    psteps = max(regions.calls.get(STEP_LABEL, 0), 1)
    averages = prof.key_averages()
    sort = "self_cuda_time_total" if torch.cuda.is_available() else "self_cpu_time_total"
    (out_dir / f"ops-{n}.txt").write_text(averages.table(sort_by=sort, row_limit=60, max_name_column_width=90))
    return {
        "batch": n,
        "timed": timed,
        "profiled": {"steps": psteps, "wall_s": tp["s"], "ms_per_step": tp["s"] * 1000.0 / psteps},
        "profile": summarize(averages, {r[3] for r in regions.regions}, psteps),
        "py_spy": spy,
    }


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m bench torch-profile",
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=__doc__.split("\n\n", 2)[2],
    )
    p.add_argument("--model", required=True, help="target model (folder or hub id)")
    p.add_argument(
        "--speculative-method",
        default="none",
        choices=("none", "ngram", "ngram_gpu", "draft_model", "eagle", "eagle3"),
        help="none = plain vLLM (no speculative config)",
    )
    p.add_argument("--draft-model", default=None, help="draft model or EAGLE head folder")
    p.add_argument("--k", type=int, default=4, help="draft length K (num_speculative_tokens), tokens")
    p.add_argument("--workload", default="code", choices=("code", "docs", "chat"))
    p.add_argument("--batches", default="1,8", help="batch sizes (requests at once), comma-separated")
    p.add_argument("--max-tokens", type=int, default=128, help="output tokens per request")
    p.add_argument("--max-model-len", type=int, default=2048)
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--gpu-memory-utilization", type=float, default=0.3, help="fraction 0..1 of GPU memory")
    p.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs, no torch.compile")
    p.add_argument(
        "--llm-arg",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="one more keyword of vLLM's LLM(...), VALUE as JSON when it parses (e.g. async_scheduling=false); repeatable",
    )
    p.add_argument(
        "--py-spy",
        default=None,
        metavar="EXE",
        help="also sample this process with py-spy during each timed pass (DIR/pyspy-B.txt, top frames in the JSON)",
    )
    p.add_argument("--out", type=Path, default=None, help="results folder (default bench/results/<time>-torch-profile)")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        batches = [int(b) for b in args.batches.split(",") if b.strip()]
    except ValueError:
        print(f"--batches: comma-separated integers, got {args.batches!r}", file=sys.stderr)
        return 2
    if not batches or min(batches) < 1:
        print("--batches: at least one batch size >= 1", file=sys.stderr)
        return 2
    try:
        extra = parse_llm_args(args.llm_arg)
    except ValueError as e:
        print(f"--llm-arg: {e}", file=sys.stderr)
        return 2
    if args.speculative_method in ("draft_model", "eagle", "eagle3") and not args.draft_model:
        print(f"--speculative-method {args.speculative_method} needs --draft-model", file=sys.stderr)
        return 2
    out = args.out or Path("bench/results") / f"{time.strftime('%Y%m%d-%H%M%S')}-torch-profile"
    out.mkdir(parents=True, exist_ok=True)
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # engine core in this process

    from vllm import LLM

    from engine_host.speculation import NGRAM_LOOKUP

    kwargs: dict[str, Any] = {
        "model": args.model,
        "max_model_len": args.max_model_len,
        "max_num_seqs": args.max_num_seqs,
        "enable_prefix_caching": False,
        "enforce_eager": args.enforce_eager,
    }
    try:
        import torch

        if torch.cuda.is_available():
            kwargs["gpu_memory_utilization"] = args.gpu_memory_utilization
    except ImportError:  # pragma: no cover - vLLM needs torch
        pass
    if args.speculative_method != "none":
        spec: dict[str, Any] = {"method": args.speculative_method, "num_speculative_tokens": args.k}
        if args.speculative_method in ("ngram", "ngram_gpu"):
            spec.update(NGRAM_LOOKUP)
        if args.draft_model:
            spec["model"] = args.draft_model
        kwargs["speculative_config"] = spec
    kwargs.update(extra)
    t0 = time.monotonic()
    llm = LLM(**kwargs)
    start_s = time.monotonic() - t0
    prompts = _prompts(args.workload, max(batches))
    _generate(llm, prompts[: max(batches)], 16)  # warm-up: first shapes, Triton JIT
    results: dict[str, Any] = {
        "config": {k: v for k, v in vars(args).items() if k != "out"},
        "patches": os.environ.get("SPECPILOT_VLLM_PATCHES", "1") != "0",
        "start_s": start_s,
        "batches": [],
    }
    with Regions() as regions:
        results["wrapped"] = regions.wrapped
        for b in batches:
            r = run_batch(llm, regions, prompts[:b], args.max_tokens, out, py_spy=args.py_spy)
            results["batches"].append(r)
            print(table(r), flush=True)
            print(flush=True)
    (out / "torch-profile.json").write_text(json.dumps(results, indent=1))
    head = (
        f"# torch-profile: {Path(args.model).name}, {args.speculative_method}"
        + (f" ({Path(args.draft_model).name})" if args.draft_model else "")
        + f", K = {args.k}, {args.workload}, {args.max_tokens} tokens; start-up {start_s:.1f} s\n\n"
    )
    (out / "torch-profile.md").write_text(head + "\n\n".join(table(r) for r in results["batches"]) + "\n")
    print(f"results in {out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
