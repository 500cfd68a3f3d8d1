"""Engines compared burst by burst on the same prompts: a paired A/B whose pairs are
seconds apart, for hosts whose speed moves between cells.

Where a host's speed moves from minute to minute (the offline GPU hosts of docs/gpu.md),
cells of one engine taken after another's mix the engines' difference with the host's
drift. This benchmark sends the *same* burst of prompts to every arm back to back (one
request per client, ``c`` clients at once), in an order that changes every round so that
each arm goes first, and follows each other arm, equally often (:func:`arm_order`), and
compares the arms round by round, so the drift falls on every arm alike; two arms on one
server measure what the method resolves.

An arm is one running server, given as ``NAME=URL[,mode=MODE][,token-env=VAR]``: an engine
host (``mode`` is set once through ``PUT /control/config`` before the first burst, with the
bearer token read from ``$VAR``, default ``$SPECPILOT_CONTROL_TOKEN``) or a bare vLLM server
(no ``mode``). The first arm is the baseline unless ``--baseline`` names another.

``--per-client N`` makes a burst ``c`` closed-loop clients that send N requests each, the
next as soon as the previous one ends. With N = 1 (the default) a burst of ``c`` > 1 lasts as
long as its slowest request: an engine that speeds up most requests but not that one gains
almost nothing, and one that slows only that one loses it all (at 8 clients of mixed traffic,
the sampled chat request sets the burst's end). With N > 1 a request that ends early frees its
client for the next, as under a user's load, and the ramp-down is one request in N.

After a burst the next arm waits ``--settle-ms`` and, after an engine host's burst, until
that engine host shows no request running: the server aborts a request that the client ended
at a stop string after the client has its answer, and its last steps belong to its own burst,
not to the next arm's.

Per burst: output tokens over the time from sending the burst to its last token (tokens/s;
with ``c`` > 1 this includes the burst's ramp-down, the same for every arm since every arm
gets the same prompts), the median TTFT (ms) and, for engine hosts, the engine steps by K
and the hook's time from ``/control/state``. Per cell (workload, clients) and arm against
the baseline: the pooled ratio (sum of tokens over sum of time, arm over baseline) with a
95 % percentile-bootstrap interval over rounds (Efron, Ann. Statist. 7 (1979) 1-26), the
median and range of the per-round ratios, and in how many rounds the arm was faster.

Example (plain vLLM on :8100, the engine host on :8000)::

    python -m bench paired --arm plain=http://127.0.0.1:8100 \\
        --arm k0=http://127.0.0.1:8000,mode=fixed:0 --arm adaptive=http://127.0.0.1:8001,mode=adaptive \\
        --workloads chat,docs --clients 1,8 --rounds 40 --time-budget 500 --out bench/results/paired

    python -m bench paired ... --workloads mixed --clients 8 --per-client 4   # closed-loop clients

    python -m bench paired --report bench/results/paired/paired.json      # the table again (.json.xz too)
    python -m bench paired --report FILE --baseline k4                       # the same rounds against arm k4
    python -m bench paired --report FILE --twin k0=k0b      # A/A: two engine hosts started alike, k0b against k0
    python -m bench paired --report c1.json.xz c64.json.xz   # both tables, then each arm over all their cells
    python -m bench paired --report start1/paired.json start2/paired.json \\
        --pool plain=plain+plain_b --pool adaptive=adaptive+adaptive_b   # every process and start of an arm as one

Results: ``--out/paired.json`` (rewritten after every round) and a Markdown table on stdout.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import lzma
import math
import os
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import numpy as np
from tqdm import tqdm

from engine_host import envs
from engine_host.http_keepalive import client_limits

from .engine_control import BenchError, EngineControl, overhead_delta, steps_at_k_delta
from .loadgen import stream_request
from .metrics import RequestRecord
from .workloads import WORKLOADS, Prompt, Workload

BOOTSTRAP_RESAMPLES = 4000


@dataclass(frozen=True)
class Arm:
    """One server under comparison.

    Attributes:
        name: row label.
        url: base URL (``http://host:port``).
        mode: speculation mode set once before the first burst (``bench matrix``'s mode
            strings: ``fixed:0``, ``adaptive``...); None leaves the server as it is.
        token_env: environment variable holding the control token.
    """

    name: str
    url: str
    mode: str | None = None
    token_env: str = envs.CONTROL_TOKEN


def parse_arm(text: str) -> Arm:
    """``"k0=http://127.0.0.1:8000,mode=fixed:0,token-env=A_TOKEN"`` -> :class:`Arm`.

    Raises:
        ValueError: no ``NAME=`` or URL, or an option other than ``mode`` / ``token-env``.
    """
    name, sep, rest = text.partition("=")
    if not sep or not name.strip() or not rest.strip():
        raise ValueError(f"an arm looks like NAME=URL[,mode=MODE][,token-env=VAR], got {text!r}")
    url, *opts = rest.split(",")
    if not url.startswith(("http://", "https://")):
        raise ValueError(f"arm {name!r}: the URL must start with http:// or https://, got {url!r}")
    fields: dict[str, str] = {}
    for opt in opts:
        key, sep, value = opt.partition("=")
        key = key.strip().replace("_", "-")
        if not sep or key not in ("mode", "token-env") or not value.strip():
            raise ValueError(f"arm {name!r}: options are mode=MODE and token-env=VAR, got {opt!r}")
        fields[key] = value.strip()
    return Arm(name.strip(), url.rstrip("/"), fields.get("mode"), fields.get("token-env", envs.CONTROL_TOKEN))


def arm_order(arms: list[str], round_index: int) -> list[str]:
    """The arms in the order they run in round ``round_index`` (0-based): a Williams design
    (E. J. Williams, "Experimental designs balanced for the estimation of residual effects of
    treatments", Australian Journal of Scientific Research A 2, 1949). Over every ``n`` rounds
    (``n`` arms, even) or ``2 n`` rounds (odd) each arm goes first equally often and runs
    right after each other arm equally often. The arms share one device, so what an arm's
    engine still does after its burst has ended (an aborted request's last steps; on the CPU
    build, vLLM's worker process spinning a core for a second after its last step) falls on
    the arm after it; a plain rotation would always hand that to the same arm."""
    n = len(arms)
    if n <= 2:
        k = round_index % max(n, 1)
        return arms[k:] + arms[:k]
    base, lo, hi = [0], 1, n - 1  # 0, 1, n-1, 2, n-2, ...
    while len(base) < n:
        base.append(lo)
        lo += 1
        if len(base) < n:
            base.append(hi)
            hi -= 1
    period = n if n % 2 == 0 else 2 * n
    r = round_index % period
    row = [arms[(b + r) % n] for b in base]
    return row if r < n else row[::-1]


def burst_figures(records: list[RequestRecord]) -> dict[str, Any]:
    """One burst's figures: ``tokens`` (output tokens), ``wall_s`` (send to last token, s),
    ``tok_s`` (tokens/s), ``ttft_ms`` (median), ``errors`` (failed requests)."""
    ends = [r.done_s if r.done_s is not None else (r.chunks[-1][0] if r.chunks else 0.0) for r in records]
    wall = max(ends) if ends else 0.0
    tokens = sum(r.output_tokens for r in records)
    ttfts = [r.ttft_ms for r in records if r.ttft_ms is not None]
    return {
        "tokens": tokens,
        "wall_s": round(wall, 5),
        "tok_s": round(tokens / wall, 3) if wall > 0 else None,
        "ttft_ms": round(statistics.median(ttfts), 3) if ttfts else None,
        "errors": sum(1 for r in records if r.error),
    }


def pooled_ratio(arm: list[dict[str, Any]], base: list[dict[str, Any]]) -> float | None:
    """(Σ tokens / Σ wall) of ``arm`` over the same of ``base`` (bursts of the same rounds)."""
    ta, wa = sum(b["tokens"] for b in arm), sum(b["wall_s"] for b in arm)
    tb, wb = sum(b["tokens"] for b in base), sum(b["wall_s"] for b in base)
    if wa <= 0 or wb <= 0 or tb <= 0:
        return None
    return (ta / wa) / (tb / wb)


def bootstrap_interval(
    arm: list[dict[str, Any]], base: list[dict[str, Any]], resamples: int = BOOTSTRAP_RESAMPLES, seed: int = 0
) -> tuple[float, float] | None:
    """95 % percentile-bootstrap interval of :func:`pooled_ratio`, resampling rounds (pairs
    of bursts) with replacement (Efron, Ann. Statist. 7 (1979) 1-26). None with fewer than
    3 rounds."""
    n = len(arm)
    if n < 3 or len(base) != n:
        return None
    ta = np.array([b["tokens"] for b in arm], float)
    wa = np.array([b["wall_s"] for b in arm], float)
    tb = np.array([b["tokens"] for b in base], float)
    wb = np.array([b["wall_s"] for b in base], float)
    idx = np.random.default_rng(seed).integers(0, n, size=(resamples, n))
    num, den = ta[idx].sum(1) / wa[idx].sum(1), tb[idx].sum(1) / wb[idx].sum(1)
    ratios = num / np.where(den > 0, den, np.nan)
    lo, hi = np.nanpercentile(ratios, [2.5, 97.5])
    return float(lo), float(hi)


def _same_rounds(
    res: dict[str, Any], cell: str, arm: str, base: str
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """The bursts of ``arm`` and of ``base`` in ``cell`` over the rounds both completed, in round order."""
    by: dict[str, dict[int, dict[str, Any]]] = {}
    for b in res["bursts"]:
        if b["cell"] == cell and b["arm"] in (arm, base):
            by.setdefault(b["arm"], {})[b["round"]] = b
    rounds = sorted(set(by.get(arm, {})) & set(by.get(base, {})))
    return [by[arm][r] for r in rounds], [by[base][r] for r in rounds]


def _cell_pairs(res: dict[str, Any], arm: str, base: str) -> list[tuple[list[dict[str, Any]], list[dict[str, Any]]]]:
    """Per cell of ``res``, :func:`_same_rounds` of ``arm`` and ``base`` (cells with fewer than 3
    such rounds left out)."""
    pairs = [_same_rounds(res, cell, arm, base) for cell in res["cells"]]
    return [p for p in pairs if len(p[0]) >= 3]


def geomean_over_cells(
    pairs: list[tuple[list[dict[str, Any]], list[dict[str, Any]]]],
    resamples: int = BOOTSTRAP_RESAMPLES,
    seed: int = 0,
) -> tuple[float, tuple[float, float]] | None:
    """The geometric mean over cells of :func:`pooled_ratio` (arm over base, per cell), with a
    95 % percentile-bootstrap interval that resamples each cell's rounds independently (Efron,
    Ann. Statist. 7 (1979) 1-26). ``pairs``: per cell, the arm's and the base's bursts of the
    same rounds. A target stated per cell that one cell's rounds cannot resolve can be read over
    all cells at once: n cells narrow the interval by about the square root of n.

    Returns:
        ``(geometric mean, (lo, hi))``, or None without a cell.
    """
    if not pairs:
        return None
    rng = np.random.default_rng(seed)
    logs = np.zeros(resamples)
    point = 0.0
    for arm, base in pairs:
        ta = np.array([b["tokens"] for b in arm], float)
        wa = np.array([b["wall_s"] for b in arm], float)
        tb = np.array([b["tokens"] for b in base], float)
        wb = np.array([b["wall_s"] for b in base], float)
        point += float(np.log((ta.sum() / wa.sum()) / (tb.sum() / wb.sum())))
        idx = rng.integers(0, len(arm), size=(resamples, len(arm)))
        logs += np.log((ta[idx].sum(1) / wa[idx].sum(1)) / (tb[idx].sum(1) / wb[idx].sum(1)))
    n = len(pairs)
    lo, hi = np.percentile(logs / n, [2.5, 97.5])
    return float(np.exp(point / n)), (float(np.exp(lo)), float(np.exp(hi)))


def render_over_cells(results: list[dict[str, Any]]) -> str:
    """Markdown: per arm, :func:`geomean_over_cells` against each result's baseline over every
    cell of ``results`` that holds the arm (one or more results, e.g. the 1- and 64-client runs
    of one table, or two runs of which one left an arm out: each arm's row counts its own cells).

    Raises:
        ValueError: the results' baselines differ.
    """
    base = results[0]["baseline"]
    arms: list[str] = []
    for res in results:
        if res["baseline"] != base:
            raise ValueError(f"the results' baselines differ ({base!r}, {res['baseline']!r})")
        arms += [a for a in res["arms"] if a != base and a not in arms]
    lines = [
        f"Over the cells: geometric mean of each cell's x `{base}`, 95 % bootstrap interval resampling each cell's "
        "rounds.",
        "",
        "| arm | cells | x base, geometric mean | 95 % interval |",
        "|---|---:|---:|---|",
    ]
    for arm in arms:
        pairs = [p for res in results if arm in res["arms"] for p in _cell_pairs(res, arm, base)]
        got = geomean_over_cells(pairs)
        if got is None:
            continue
        gm, (lo, hi) = got
        lines.append(f"| `{arm}` | {len(pairs)} | {gm:.3f} | [{lo:.3f}, {hi:.3f}] |")
    return "\n".join(lines)


def summarize(res: dict[str, Any]) -> list[dict[str, Any]]:
    """One row per (cell, arm) against the baseline arm, over the rounds both completed.

    Returns:
        dicts with ``cell``, ``arm``, ``rounds``, ``tok_s`` (pooled, tokens/s), ``x_base``
        (pooled ratio), ``ci95`` ([lo, hi] or None), ``per_round`` (median, min, max of the
        round ratios), ``faster`` (rounds where the arm beat the baseline), ``ttft_ms``
        (median of burst medians), and, from engine hosts, ``steps``, ``steps_k_gt0``,
        ``draft_tokens``, ``accepted_tokens`` and ``hook_share`` (fraction 0..1 of busy time).
    """
    base = res["baseline"]
    rows = []
    for cell in res["cells"]:
        bursts = [b for b in res["bursts"] if b["cell"] == cell]
        by_arm: dict[str, dict[int, dict[str, Any]]] = {}
        for b in bursts:
            by_arm.setdefault(b["arm"], {})[b["round"]] = b
        for arm in res["arms"]:
            mine, theirs = by_arm.get(arm, {}), by_arm.get(base, {})
            rounds = sorted(set(mine) & set(theirs))
            a = [mine[r] for r in rounds]
            b = [theirs[r] for r in rounds]
            per = [x["tok_s"] / y["tok_s"] for x, y in zip(a, b) if x["tok_s"] and y["tok_s"]]
            ci = bootstrap_interval(a, b) if arm != base else None
            wall = sum(x["wall_s"] for x in a)
            row: dict[str, Any] = {
                "cell": cell,
                "arm": arm,
                "rounds": len(rounds),
                "tok_s": round(sum(x["tokens"] for x in a) / wall, 2) if wall > 0 else None,
                "x_base": pooled_ratio(a, b),
                "ci95": list(ci) if ci else None,
                "per_round": [statistics.median(per), min(per), max(per)] if per else None,
                "faster": sum(1 for x in per if x > 1.0),
                "ttft_ms": statistics.median(ttfts)
                if (ttfts := [x["ttft_ms"] for x in a if x["ttft_ms"] is not None])
                else None,
            }
            engine = [x for x in a if x.get("steps_at_k") is not None]
            if engine:
                row["steps"] = sum(sum(x["steps_at_k"]) for x in engine)
                row["steps_k_gt0"] = sum(sum(x["steps_at_k"][1:]) for x in engine)
                hook = [x["overhead"] for x in engine if x.get("overhead")]
                busy = sum(h["busy_seconds"] for h in hook)
                row["hook_share"] = sum(h["hook_seconds"] for h in hook) / busy if busy > 0 else None
                if hook and len(hook) == len(engine) and all("lean_steps" in h and "aside_steps" in h for h in hook):
                    # the steps the hook ran its full path on (neither lean nor stood aside)
                    row["steps_full_path"] = max(
                        row["steps"] - sum(h["lean_steps"] + h["aside_steps"] for h in hook), 0
                    )
            row["draft_tokens"] = sum(x.get("draft_tokens", 0) for x in a)
            row["accepted_tokens"] = sum(x.get("accepted_tokens", 0) for x in a)
            rows.append(row)
    return rows


def _steps_cell(r: dict[str, Any]) -> str:
    """The table's steps column: ``steps (at K > 0)``, and the steps on the hook's full path
    where the engine host counted them."""
    if "steps" not in r:
        return "-"
    full = f"; full path {r['steps_full_path']}" if "steps_full_path" in r else ""
    return f"{r['steps']} ({r['steps_k_gt0']}{full})"


def render(res: dict[str, Any]) -> str:
    """Markdown table of :func:`summarize` (ratios against the baseline arm)."""

    def f(v: Any, fmt: str = "{:.3f}") -> str:
        return "-" if v is None else fmt.format(v)

    n = int(res.get("per_client", 1) or 1)
    burst = "Bursts of `c` requests" if n == 1 else f"Bursts of `c` closed-loop clients, {n} requests each"
    lines = [
        f"Baseline: `{res['baseline']}`. {burst} (the same prompts for every arm), arms "
        "in a balanced order each round; x base = pooled tokens/s over the baseline's in the same rounds, with a 95 % "
        "bootstrap interval over rounds.",
        "",
        "| cell | arm | rounds | tok/s | x base | 95 % interval | per round: median [min, max] | rounds faster "
        "| TTFT p50 ms | steps (K > 0) | accepted / draft tokens | hook share |",
        "|---|---|---:|---:|---:|---|---|---:|---:|---|---|---:|",
    ]
    for r in summarize(res):
        base = r["arm"] == res["baseline"]
        per = r["per_round"]
        lines.append(
            "| "
            + " | ".join(
                [
                    r["cell"],
                    f"`{r['arm']}`",
                    str(r["rounds"]),
                    f(r["tok_s"], "{:.1f}"),
                    "1.000" if base else f(r["x_base"]),
                    "-" if base or not r["ci95"] else f"[{r['ci95'][0]:.3f}, {r['ci95'][1]:.3f}]",
                    "-" if base or not per else f"{per[0]:.3f} [{per[1]:.3f}, {per[2]:.3f}]",
                    "-" if base else f"{r['faster']} of {r['rounds']}",
                    f(r["ttft_ms"], "{:.2f}"),
                    _steps_cell(r),
                    f"{int(r['accepted_tokens'])} / {int(r['draft_tokens'])}" if r["draft_tokens"] else "-",
                    f(r.get("hook_share"), "{:.2%}"),
                ]
            )
            + " |"
        )
    return "\n".join(lines)


def twin_rows(res: dict[str, Any], arm: str, twin: str) -> list[dict[str, Any]]:
    """An A/A control: per cell, arm ``twin`` against arm ``arm``, two servers started with the
    same arguments, over the rounds both completed.

    Returns:
        dicts with ``cell``, ``rounds``, ``x`` (pooled ratio ``twin`` over ``arm``; None
        without time), ``ci95`` ([lo, hi] or None) and ``faster`` (rounds the twin was faster).

    Raises:
        ValueError: ``arm`` or ``twin`` names no arm of the result, or both name the same one.
    """
    for name in (arm, twin):
        if name not in res["arms"]:
            raise ValueError(f"--twin names {name!r}, no arm of this result ({', '.join(res['arms'])})")
    if arm == twin:
        raise ValueError(f"--twin {arm}={twin}: an arm is no twin of itself")
    rows = []
    for cell in res["cells"]:
        a, b = _same_rounds(res, cell, twin, arm)
        ci = bootstrap_interval(a, b)
        per = [x["tok_s"] / y["tok_s"] for x, y in zip(a, b) if x["tok_s"] and y["tok_s"]]
        rows.append(
            {
                "cell": cell,
                "rounds": len(a),
                "x": pooled_ratio(a, b),
                "ci95": list(ci) if ci else None,
                "faster": sum(1 for x in per if x > 1.0),
            }
        )
    return rows


def render_twin(res: dict[str, Any], arm: str, twin: str) -> str:
    """Markdown of :func:`twin_rows`: the A/A table and what it says about the other ratios.

    The spread it reports, the largest ``|ln x|`` over the cells (as a percentage, ``exp - 1``),
    is how far a ratio between two servers of this result moved with no difference between
    them; and how many of the intervals over rounds left 1 out, against the 1 in 20 that
    95 % intervals leave out by chance when they hold the noise (more than that: something
    that differs between processes and not between rounds, which the intervals miss).

    Raises:
        ValueError: as :func:`twin_rows`.
    """
    rows = twin_rows(res, arm, twin)
    lines = [
        f"A/A control: `{twin}` against `{arm}` (two servers started alike; any difference is the processes', "
        "not the configuration's).",
        "",
        f"| cell | rounds | x `{arm}` | 95 % interval | rounds faster |",
        "|---|---:|---:|---|---:|",
    ]
    logs, outside = [], []
    for r in rows:
        x, ci = r["x"], r["ci95"]
        lines.append(
            f"| {r['cell']} | {r['rounds']} | {'-' if x is None else f'{x:.3f}'} | "
            f"{'-' if not ci else f'[{ci[0]:.3f}, {ci[1]:.3f}]'} | {r['faster']} of {r['rounds']} |"
        )
        if x:
            logs.append((abs(math.log(x)), r["cell"], x))
        if ci and (ci[0] > 1.0 or ci[1] < 1.0):
            outside.append(r["cell"])
    if logs:
        worst = max(logs)
        gm = math.exp(statistics.fmean(math.log(x) for _, _, x in logs))
        spread = math.exp(worst[0]) - 1.0
        lines += [
            "",
            f"Geometric mean {gm:.3f} over {len(logs)} cell{'s' if len(logs) != 1 else ''}; "
            f"the largest difference {spread:.1%} ({worst[1]}): "
            f"with no difference between the two, a cell's ratio moved by up to ±{spread:.1%}. Intervals over "
            f"rounds that leave out 1.000: {len(outside)} of {len(logs)}"
            + (f" ({', '.join(outside)})" if outside else "")
            + ", against about 1 in 20 by chance when the intervals hold the noise.",
        ]
    return "\n".join(lines)


def pool_arms(res: dict[str, Any], name: str, members: list[str]) -> dict[str, Any]:
    """``res`` with the arms ``members`` (servers started alike, e.g. an arm and its A/A twin)
    read as one arm ``name``: per cell and round that every member completed, one burst whose
    tokens, wall time (s), draft and accepted tokens, steps by K and hook times are the
    members' sums, so its pooled ratio is the members' tokens over their time together.

    What two processes started alike differ by (the A/A tables) is a property of the process,
    not of the round, so the interval over rounds does not hold it; an arm run as several
    processes, and the table run over several starts (one result each, read together), spreads
    it over them. The result's other arms are kept; a baseline among ``members`` becomes ``name``.

    Returns:
        a new result dict (``res`` is not changed).

    Raises:
        ValueError: fewer than two members, a member that names no arm of ``res``, or ``name``
            already the name of an arm that is not a member.
    """
    if len(set(members)) < 2:
        raise ValueError(f"--pool {name}: give two or more different arms to pool, got {'+'.join(members)!r}")
    for m in members:
        if m not in res["arms"]:
            raise ValueError(f"--pool {name}: {m!r} names no arm of this result ({', '.join(res['arms'])})")
    if name in res["arms"] and name not in members:
        raise ValueError(f"--pool {name}: that is already another arm's name")
    by: dict[tuple[str, int], dict[str, dict[str, Any]]] = {}
    for b in res["bursts"]:
        if b["arm"] in members:
            by.setdefault((b["cell"], b["round"]), {})[b["arm"]] = b
    pooled = []
    for (cell, rnd), got in by.items():
        if len(got) < len(set(members)):
            continue
        parts = list(got.values())
        wall = sum(p["wall_s"] for p in parts)
        tokens = sum(p["tokens"] for p in parts)
        ttfts = [p["ttft_ms"] for p in parts if p.get("ttft_ms") is not None]
        burst: dict[str, Any] = {
            "arm": name,
            "cell": cell,
            "round": rnd,
            "tokens": tokens,
            "wall_s": round(wall, 5),
            "tok_s": round(tokens / wall, 3) if wall > 0 else None,
            "ttft_ms": statistics.median(ttfts) if ttfts else None,
            "errors": sum(p.get("errors", 0) for p in parts),
            "draft_tokens": sum(p.get("draft_tokens", 0) for p in parts),
            "accepted_tokens": sum(p.get("accepted_tokens", 0) for p in parts),
        }
        ks = [p.get("steps_at_k") for p in parts]
        if all(k is not None for k in ks):
            width = max(len(k) for k in ks)
            burst["steps_at_k"] = [sum(k[i] for k in ks if i < len(k)) for i in range(width)]
        hooks = [p.get("overhead") for p in parts]
        if all(hooks):
            keys = set.intersection(*(set(h) for h in hooks))
            burst["overhead"] = {
                k: sum(h[k] for h in hooks) for k in keys if all(isinstance(h[k], (int, float)) for h in hooks)
            }
        pooled.append(burst)
    arms = []
    for a in res["arms"]:
        if a in members:
            if name not in arms:
                arms.append(name)
        else:
            arms.append(a)
    out = dict(res)
    out["arms"] = arms
    out["bursts"] = [b for b in res["bursts"] if b["arm"] not in members] + pooled
    if res["baseline"] in members:
        out["baseline"] = name
    return out


def _pools(specs: list[str]) -> list[tuple[str, list[str]]]:
    """``--pool NAME=ARM+ARM[+...]`` values as ``(name, members)``.

    Raises:
        ValueError: a value is not of that form.
    """
    out = []
    for spec in specs:
        name, sep, rest = spec.partition("=")
        members = [m.strip() for m in rest.split("+") if m.strip()]
        if not sep or not name.strip() or len(members) < 2:
            raise ValueError(f"--pool takes NAME=ARM+ARM[+...] (two or more arm names), got {spec!r}")
        out.append((name.strip(), members))
    return out


def load_result(path: Path) -> dict[str, Any]:
    """A ``paired.json`` written by this benchmark, plain or ``xz``-compressed (``.xz``).

    Raises:
        ValueError: the file cannot be read or is not such a result (the message says which).
    """
    try:
        raw = lzma.decompress(path.read_bytes()) if path.suffix == ".xz" else path.read_bytes()
        res = json.loads(raw)
    except (OSError, lzma.LZMAError, ValueError) as exc:
        raise ValueError(f"cannot read {path}: {exc}") from None
    if not isinstance(res, dict) or not {"baseline", "arms", "cells", "bursts"} <= set(res):
        raise ValueError(f"{path} is not a result of python -m bench paired")
    return res


class _Client:
    """One arm's HTTP and control clients, served model and state reads."""

    def __init__(self, arm: Arm, timeout_s: float):
        self.arm = arm
        self.http = httpx.AsyncClient(base_url=arm.url, timeout=timeout_s, limits=client_limits())
        self.control = EngineControl(arm.url, os.environ.get(arm.token_env))
        self.model = ""
        self.is_host = False

    async def setup(self) -> None:
        try:
            self.model = await self.control.served_model()
            self.is_host = bool(await self.control.state())
            if self.arm.mode is not None:
                await self.control.apply_mode(self.arm.mode)
        except BenchError as exc:
            raise BenchError(f"arm {self.arm.name!r} (token from ${self.arm.token_env}): {exc}") from None

    async def snapshot(self) -> tuple[dict[str, Any], dict[str, Any]]:
        state = await self.control.state() if self.is_host else {}
        return state, await self.control.counters()

    async def settled_snapshot(self, pause_s: float, timeout_s: float = 1.0) -> tuple[dict[str, Any], dict[str, Any]]:
        """:meth:`snapshot` once the server has let go of the burst: after ``pause_s`` (s)
        and, on an engine host, once its published state shows no request running (up to
        ``timeout_s``, s). A request that the client ended at a stop string is aborted by
        the server after the client has its answer; the engine core publishes its state
        once it has taken the abort, so a read right away could miss the burst's last steps,
        and those steps would still run while the next arm's burst starts on the same
        device."""
        if pause_s > 0:
            await asyncio.sleep(pause_s)
        if self.is_host:
            deadline = time.perf_counter() + timeout_s
            while True:
                state = await self.control.state()
                batch = state.get("batch") or {}
                if not (batch.get("running") or batch.get("waiting")) or time.perf_counter() >= deadline:
                    break
                await asyncio.sleep(0.01)
            return state, await self.control.counters()
        return {}, await self.control.counters()

    async def aclose(self) -> None:
        await self.http.aclose()
        await self.control.aclose()


async def _burst(
    client: _Client, prompts: list[Prompt], max_tokens: int, clients: int | None = None, settle_s: float = 0.0
) -> dict[str, Any]:
    """One burst on one arm: ``clients`` clients (default: one per prompt) each send their
    share of ``prompts`` (client i: prompts i, i + clients, ...) one after another, the next as
    soon as the previous one ends (a closed loop); returns :func:`burst_figures` and, from an
    engine host, the steps by K and the hook's time over the burst, read once the server has
    let go of it (:meth:`_Client.settled_snapshot`, ``settle_s``).

    Raises:
        BenchError: a request failed.
    """
    state0, count0 = await client.snapshot()
    t0 = time.perf_counter()
    recs = [RequestRecord(index=i, workload=p.workload, source=p.source, sent_s=0.0) for i, p in enumerate(prompts)]
    n = clients or len(prompts)

    async def closed_loop(i: int) -> None:
        for j in range(i, len(prompts), n):
            recs[j].sent_s = time.perf_counter() - t0
            await stream_request(client.http, prompts[j], client.model, max_tokens, recs[j], t0)

    await asyncio.gather(*(closed_loop(i) for i in range(n)))
    out = burst_figures(recs)
    state1, count1 = await client.settled_snapshot(settle_s)
    if out["errors"]:
        first = next(r.error for r in recs if r.error)
        raise BenchError(f"arm {client.arm.name!r}: {out['errors']} of {len(recs)} requests failed: {first}")
    out["draft_tokens"] = count1["draft_tokens"] - count0["draft_tokens"]
    out["accepted_tokens"] = count1["accepted_tokens"] - count0["accepted_tokens"]
    if client.is_host:
        out["steps_at_k"] = steps_at_k_delta(state0, state1)
        out["overhead"] = overhead_delta(state0, state1)
    return out


async def run(args: argparse.Namespace, arms: list[Arm]) -> dict[str, Any]:
    """Warm-up rounds, then ``--rounds`` rounds of every cell, every arm in a balanced order (:func:`arm_order`);
    ``paired.json`` rewritten after each round. Returns the result document."""
    clients = {a.name: _Client(a, args.request_timeout) for a in arms}
    names = [a.name for a in arms]
    cells = [(w, c) for w in args.workloads for c in args.clients]
    res: dict[str, Any] = {
        "command": " ".join(sys.argv),
        "started_at_unix": time.time(),
        "baseline": args.baseline or names[0],
        "arms": names,
        "arm_specs": [a.__dict__ for a in arms],
        "cells": [f"{w}@c{c}" for w, c in cells],
        "max_tokens": args.max_tokens,
        "per_client": args.per_client,
        "bursts": [],
    }
    out = args.out / "paired.json"
    args.out.mkdir(parents=True, exist_ok=True)
    try:
        for c in clients.values():
            await c.setup()
        # shift moves code -> docs -> chat every 8 requests (every arm gets the same ones)
        streams = {cell: Workload(cell[0], seed=args.seed, period_requests=8) for cell in cells}
        total = args.warm_rounds + args.rounds
        bar = tqdm(total=total, desc="rounds", unit="round", file=sys.stderr, disable=args.quiet, dynamic_ncols=True)
        started, took = time.monotonic(), 0.0
        for r in range(total):
            if args.time_budget and time.monotonic() - started + took > args.time_budget:
                print(f"time budget reached after {r - args.warm_rounds} rounds", file=sys.stderr)
                break
            t_round = time.monotonic()
            for (w, c), label in zip(cells, res["cells"]):
                prompts = [streams[(w, c)].next_prompt() for _ in range(c * args.per_client)]
                for name in arm_order(names, r):
                    b = await _burst(clients[name], prompts, args.max_tokens, c, args.settle_ms / 1e3)
                    if r >= args.warm_rounds:
                        res["bursts"].append({"round": r - args.warm_rounds, "cell": label, "arm": name, **b})
            took = time.monotonic() - t_round
            out.write_text(json.dumps(res, indent=1))
            bar.update(1)
        bar.close()
    finally:
        for c in clients.values():
            await c.aclose()
    return res


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m bench paired",
        description="Running servers compared burst by burst on the same prompts, arms in a balanced order every round.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=__doc__.split("Example", 1)[1] if __doc__ else None,
    )
    p.add_argument(
        "--arm",
        action="append",
        default=[],
        metavar="NAME=URL[,mode=MODE][,token-env=VAR]",
        help="a server to compare (two or more); the first is the baseline unless --baseline",
    )
    p.add_argument(
        "--baseline",
        help="arm every ratio is taken against (default: the first --arm; with --report: another arm of it)",
    )
    p.add_argument("--workloads", default="chat", help=f"comma-separated, from {', '.join(WORKLOADS)} (default chat)")
    p.add_argument("--clients", default="1", help="comma-separated burst sizes: requests sent at once (default 1)")
    p.add_argument("--rounds", type=int, default=30, help="measured rounds (default 30)")
    p.add_argument(
        "--per-client",
        type=int,
        default=1,
        metavar="N",
        help="requests each client sends per burst, one after another (a closed loop; default 1: "
        "the burst ends with its slowest request)",
    )
    p.add_argument("--warm-rounds", type=int, default=1, help="untimed rounds first (default 1)")
    p.add_argument("--max-tokens", type=int, default=128, help="output cap per request, tokens (default 128)")
    p.add_argument("--seed", type=int, default=0, help="prompt order and chat sampling seeds (default 0)")
    p.add_argument("--time-budget", type=float, default=0.0, help="stop before a round that would pass this many s")
    p.add_argument("--request-timeout", type=float, default=300.0, help="per request, s (default 300)")
    p.add_argument(
        "--settle-ms",
        type=float,
        default=20.0,
        help="after each burst, wait this long (and, on an engine host, until no request runs) before "
        "reading its counters and starting the next arm (default 20; on the CPU build 1100: vLLM's worker "
        "spins a core for 1 s after its last step, docs/benchmarks.md)",
    )
    p.add_argument("--out", type=Path, default=None, help="results folder (default bench/results/<time>-paired)")
    p.add_argument(
        "--report",
        type=Path,
        nargs="+",
        metavar="RESULT",
        help="print the table of earlier paired.json files (or .json.xz) and, over all their cells, each arm's "
        "geometric mean with its interval, and exit",
    )
    p.add_argument(
        "--twin",
        action="append",
        default=[],
        metavar="ARM=TWIN",
        help="two arms started with the same arguments (an A/A control): also print TWIN against ARM per cell, "
        "how far a ratio moved with no difference behind it, and how many intervals left 1 out",
    )
    p.add_argument(
        "--pool",
        action="append",
        default=[],
        metavar="NAME=ARM+ARM",
        help="read arms started alike (an arm and its A/A twins) as one arm NAME: their tokens over their time "
        "together, round by round; with several --report results (e.g. one per start of the engines) each "
        "result's members are pooled, so a ratio is read over every process and start",
    )
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    return p


def _twins(specs: list[str]) -> list[tuple[str, str]]:
    """``--twin ARM=TWIN`` values as pairs.

    Raises:
        ValueError: a value is not of that form.
    """
    out = []
    for spec in specs:
        arm, sep, twin = spec.partition("=")
        if not sep or not arm.strip() or not twin.strip():
            raise ValueError(f"--twin takes ARM=TWIN (two arm names), got {spec!r}")
        out.append((arm.strip(), twin.strip()))
    return out


def main(argv: list[str] | None = None) -> int:
    """``python -m bench paired``; exit status 2 with a message on bad input or a failed request."""
    args = build_parser().parse_args(argv)
    try:
        if args.report:
            results = []
            pools = _pools(args.pool)
            for path in args.report:
                res = load_result(path)
                for name, members in pools:
                    res = pool_arms(res, name, members)
                if args.baseline:  # the same rounds read against another arm (e.g. the best static K)
                    if args.baseline not in res["arms"]:
                        raise ValueError(
                            f"--baseline {args.baseline!r} names no arm of {path} ({', '.join(res['arms'])})"
                        )
                    res["baseline"] = args.baseline
                results.append(res)
            twins = _twins(args.twin)
            text = []
            for res in results:
                text += [render(res)] + [render_twin(res, a, t) for a, t in twins]
            text.append(render_over_cells(results))
            print("\n\n".join(text))
            return 0
        arms = [parse_arm(a) for a in args.arm]
        if len(arms) < 2:
            raise ValueError("give at least two --arm")
        if len({a.name for a in arms}) != len(arms):
            raise ValueError("arm names must differ")
        if args.baseline and args.baseline not in {a.name for a in arms}:
            raise ValueError(f"--baseline {args.baseline!r} names no arm")
        twins = _twins(args.twin)
        pools = _pools(args.pool)
        probe = {"baseline": arms[0].name, "arms": [a.name for a in arms], "cells": [], "bursts": []}
        for name, members in pools:  # refused here, before the run, as --report would refuse it
            probe = pool_arms(probe, name, members)
        for a, t in twins:
            if a not in {x.name for x in arms} or t not in {x.name for x in arms} or a == t:
                raise ValueError(f"--twin {a}={t} must name two different arms")
        args.workloads = [w.strip() for w in args.workloads.split(",") if w.strip()]
        for w in args.workloads:
            if w not in WORKLOADS:
                raise ValueError(f"unknown workload {w!r}; choose from {', '.join(WORKLOADS)}")
        try:
            args.clients = [int(c) for c in args.clients.split(",")]
        except ValueError:
            raise ValueError(f"--clients takes whole numbers separated by commas, got {args.clients!r}") from None
        if (
            any(c < 1 for c in args.clients)
            or args.rounds < 1
            or args.warm_rounds < 0
            or args.max_tokens < 1
            or args.per_client < 1
            or args.settle_ms < 0
        ):
            raise ValueError(
                "--clients, --per-client, --rounds and --max-tokens must be >= 1, --warm-rounds and --settle-ms >= 0"
            )
        args.out = args.out or Path("bench/results") / f"{time.strftime('%Y%m%d-%H%M%S')}-paired"
        res = asyncio.run(run(args, arms))
    except (ValueError, BenchError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except httpx.TransportError as exc:
        print(f"error: cannot reach a server: {exc or type(exc).__name__}. Is every --arm URL up?", file=sys.stderr)
        return 2
    print(render(res))
    for a, t in twins:
        print()
        print(render_twin(res, a, t))
    print()
    print(render_over_cells([res]))
    if pools:  # the same rounds with the pooled arms read as one (the results file keeps every arm)
        shown = res
        for name, members in pools:
            shown = pool_arms(shown, name, members)
        print()
        print(render(shown))
        print()
        print(render_over_cells([shown]))
    print(f"results: {args.out / 'paired.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
