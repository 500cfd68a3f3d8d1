"""``python -m bench draft-layers``: acceptance per draft position of the default model's
truncated drafts (its first N layers), on the bench workloads.

For each N, one engine host (eager) runs ``draft_model`` speculation at fixed K with the
draft cut to N layers; requests of each workload (code, docs, chat) are sent one at a
time and vLLM's counters give, per workload, the acceptance at each draft position
``accepted_per_pos[j] / drafts`` (the draft model always drafts K tokens) and the mean
accepted length. Output tokens/s at that K is printed too (one client; noisy on a shared
CPU). Results are printed as a Markdown table and written as JSON.

Usage::

    python -m bench draft-layers --layers 4,8,12,16 --k 4 --requests 6 --out draft_layers.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families

from engine_host.model import prepare_default_model, prepare_truncated_draft
from engine_host.process import EngineHostProcess

from .workloads import prompt_pool


def spec_counters(url: str) -> tuple[float, list[float]]:
    """(drafts, accepted per position) summed over vLLM's ``/metrics`` counters."""
    drafts, per_pos = 0.0, {}
    for fam in text_string_to_metric_families(httpx.get(url + "/metrics", timeout=30).text):
        for s in fam.samples:
            if s.name == "vllm:spec_decode_num_drafts_total":
                drafts += s.value
            elif s.name == "vllm:spec_decode_num_accepted_tokens_per_pos_total":
                j = int(s.labels["position"])
                per_pos[j] = per_pos.get(j, 0.0) + s.value
    return drafts, [per_pos.get(j, 0.0) for j in range(max(per_pos, default=-1) + 1)]


def run_requests(url: str, model: str, workload: str, n: int, max_tokens: int) -> tuple[int, float]:
    """Send ``n`` prompts of ``workload`` one after another (non-streaming); returns
    (completion tokens, seconds)."""
    tokens, t0 = 0, time.monotonic()
    with httpx.Client(base_url=url, timeout=300) as c:
        for p in prompt_pool(workload)[:n]:
            body = p.body(model, max_tokens)
            body["stream"] = False
            body.pop("stream_options", None)
            r = c.post(p.path, json=body)
            r.raise_for_status()
            tokens += r.json()["usage"]["completion_tokens"]
    return tokens, time.monotonic() - t0


def measure(layers: int | None, k: int, workloads: list[str], n: int, max_tokens: int, log_dir: Path) -> dict:
    """One engine: truncated draft with ``layers`` layers (None: n-gram); per-workload figures."""
    target = str(prepare_default_model(quiet=True))
    if layers is None:
        args = ["--speculative-method", "ngram"]
        label = "ngram"
    else:
        args = [
            "--speculative-method",
            "draft_model",
            "--draft-model",
            str(prepare_truncated_draft(layers, quiet=True)),
        ]
        label = f"L{layers}"
    eh = EngineHostProcess(
        model=target,
        log_path=log_dir / f"draft-layers-{label}.log",
        extra_args=[
            "--enforce-eager",
            "--k-max",
            str(k),
            "--speculation-mode",
            "fixed",
            "--k",
            str(k),
            "--max-num-seqs",
            "4",
            "--max-model-len",
            "2048",
            "--warmup",
            "quick",
            "--no-prefix-caching",
            *args,
        ],
    )
    eh.start()
    out: dict = {"draft": label, "k": k, "workloads": {}}
    try:
        out["ready_s"] = round(eh.wait_ready(timeout_s=600), 1)
        name = Path(target).name
        for w in workloads:
            d0, a0 = spec_counters(eh.url)
            tokens, secs = run_requests(eh.url, name, w, n, max_tokens)
            d1, a1 = spec_counters(eh.url)
            drafts = d1 - d0
            acc = [(a1[j] - (a0[j] if j < len(a0) else 0.0)) / drafts if drafts else None for j in range(len(a1))]
            out["workloads"][w] = {
                "drafts": drafts,
                "acceptance_per_position": acc,
                "mean_accepted": sum(a for a in acc if a) if drafts else None,
                "output_tokens_per_s": round(tokens / secs, 1),
                "tokens": tokens,
            }
            print(json.dumps({label: {w: out["workloads"][w]}}), flush=True)
    finally:
        eh.stop()
    return out


def table(results: list[dict]) -> str:
    """Markdown table: one row per draft and workload."""
    k = max(r["k"] for r in results)
    head = (
        "| draft | workload | " + " | ".join(f"pos {j + 1}" for j in range(k)) + " | accepted/step | tok/s (1 client) |"
    )
    rows = [head, "|" + "---|" * (k + 4)]
    for r in results:
        for w, v in r["workloads"].items():
            acc = v["acceptance_per_position"] or []
            cells = [f"{acc[j]:.2f}" if j < len(acc) and acc[j] is not None else "-" for j in range(k)]
            mean = f"{v['mean_accepted']:.2f}" if v["mean_accepted"] is not None else "-"
            rows.append(f"| {r['draft']} | {w} | " + " | ".join(cells) + f" | {mean} | {v['output_tokens_per_s']} |")
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    """CLI entry point."""
    p = argparse.ArgumentParser(prog="python -m bench draft-layers", description=__doc__.split("\n\n")[0])
    p.add_argument("--layers", default="4,8,12,16", help="comma-separated layer counts; 'ngram' adds an n-gram row")
    p.add_argument("--k", type=int, default=4, help="draft length K (tokens)")
    p.add_argument("--workloads", default="code,docs,chat")
    p.add_argument("--requests", type=int, default=6, help="requests per workload")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--out", type=Path, default=Path("draft_layers.json"))
    args = p.parse_args(argv)
    results = []
    log_dir = args.out.resolve().parent
    for item in [s.strip() for s in args.layers.split(",") if s.strip()]:
        layers = None if item == "ngram" else int(item)
        results.append(measure(layers, args.k, args.workloads.split(","), args.requests, args.max_tokens, log_dir))
        args.out.write_text(json.dumps(results, indent=1))
    print(table(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
