"""``python -m bench spread RUN1 RUN2 ...``: repeated matrix runs side by side.

Each RUN is a results folder of ``python -m bench matrix`` (its per-cell JSON files). For every
(workload, load) the table gives, per mode, the output tokens/s of each run, their mean and
spread, and then the ratios the targets are stated in, run by run: adaptive against plain vLLM,
against the best static K (``fixed:K``) and, for ``shift``, against the best other mode, with
their median over the runs. A target counts as met in a cell only when it holds in every run.
Where the cells recorded it, a third table gives the scheduler hook's CPU time as a share of
the engine's busy time inside each cell, run by run.

Spread of a cell: (max - min) / mean over the runs, a fraction 0..1.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path
from typing import Any

LOAD_ORDER = ("low", "medium", "high")


def _cell_docs(folder: Path) -> dict[tuple[str, str, str], dict[str, Any]]:
    """``{(workload, load label, mode): cell document}`` of one results folder."""
    cells: dict[tuple[str, str, str], dict[str, Any]] = {}
    for path in sorted(folder.glob("*.json")):
        if path.name in ("summary.json", "results.json"):
            continue
        doc = json.loads(path.read_text())
        if not isinstance(doc, dict) or "spec" not in doc or "client" not in doc:
            continue
        spec = doc["spec"]
        cells[(spec["workload"], spec["load"]["label"], spec["mode"])] = doc
    return cells


def load_runs(folders: list[Path]) -> list[dict[tuple[str, str, str], float]]:
    """Per run, ``{(workload, load label, mode): output tokens/s}`` from its cell files.

    Raises:
        ValueError: a folder holds no cell results.
    """
    runs = []
    for folder in folders:
        cells = {k: float(d["client"]["output_tokens_per_s"]) for k, d in _cell_docs(folder).items()}
        if not cells:
            raise ValueError(f"no cell results (*.json) in {folder}")
        runs.append(cells)
    return runs


def load_hook_shares(folders: list[Path]) -> list[dict[tuple[str, str, str], float]]:
    """Per run, ``{(workload, load label, mode): the scheduler hook's CPU time as a fraction
    0..1 of the engine's busy time inside the cell}`` (``overhead_window`` of the cell
    file); cells without it (plain `vllm serve`, which has no hook, and results written
    before it was recorded) are left out."""
    out = []
    for folder in folders:
        shares = {}
        for k, d in _cell_docs(folder).items():
            v = (d.get("overhead_window") or {}).get("cpu_fraction")
            if v is not None:
                shares[k] = float(v)
        out.append(shares)
    return out


def _median(values: list[float | None]) -> float | None:
    got = [v for v in values if v is not None]
    return statistics.median(got) if got else None


def _ratios(cells: dict[str, float], workload: str) -> dict[str, float | None]:
    ada = cells.get("adaptive")
    static = {m: v for m, v in cells.items() if m.startswith("fixed:")}
    others = {m: v for m, v in cells.items() if m not in ("adaptive", "plain")}
    out: dict[str, float | None] = {"plain": None, "static": None, "other": None}
    if ada is None:
        return out
    if cells.get("plain"):
        out["plain"] = ada / cells["plain"]
    if static:
        out["static"] = ada / max(static.values())
    if workload == "shift" and others:
        out["other"] = ada / max(others.values())
    return out


def spread_table(
    runs: list[dict[tuple[str, str, str], float]],
    hook_shares: list[dict[tuple[str, str, str], float]] | None = None,
) -> dict[str, Any]:
    """The rows of the side-by-side table (see the module docstring).

    Args:
        runs: :func:`load_runs`.
        hook_shares: :func:`load_hook_shares` of the same folders, or None.
    Returns:
        ``{"cells": [{"workload", "load", "mode", "runs": [tok/s...], "mean", "spread",
        "hook_cpu_share": [fraction 0..1 or None per run]}], "groups": [{"workload", "load",
        "x_plain": [...], "x_best_static": [...], "x_best_other": [...] (shift only), and
        the median of each over the runs ("x_plain_median", ...)}]}``; a value is None where
        a run lacks the cell.
    """
    keys = sorted({k for r in runs for k in r}, key=lambda k: (_workload_rank(k[0]), k[0], _load_rank(k[1]), k[2]))
    cells = []
    for w, ld, m in keys:
        vals = [r.get((w, ld, m)) for r in runs]
        got = [v for v in vals if v is not None]
        mean = statistics.fmean(got) if got else None
        spread = (max(got) - min(got)) / mean if got and mean else None
        hooks = [h.get((w, ld, m)) for h in hook_shares] if hook_shares else [None] * len(runs)
        cells.append(
            {
                "workload": w,
                "load": ld,
                "mode": m,
                "runs": vals,
                "mean": mean,
                "spread": spread,
                "hook_cpu_share": hooks,
            }
        )
    groups = []
    for w, ld in dict.fromkeys((k[0], k[1]) for k in keys):
        per_run = []
        for r in runs:
            per_run.append(_ratios({m: v for (w2, l2, m), v in r.items() if (w2, l2) == (w, ld)}, w))
        g: dict[str, Any] = {
            "workload": w,
            "load": ld,
            "x_plain": [p["plain"] for p in per_run],
            "x_best_static": [p["static"] for p in per_run],
        }
        if w == "shift":
            g["x_best_other"] = [p["other"] for p in per_run]
        for key in ("x_plain", "x_best_static", "x_best_other"):
            if key in g:
                g[key + "_median"] = _median(g[key])
        groups.append(g)
    return {"cells": cells, "groups": groups}


def _workload_rank(name: str) -> int:
    from .workloads import WORKLOADS

    return WORKLOADS.index(name) if name in WORKLOADS else len(WORKLOADS)


def _load_rank(label: str) -> int:
    return LOAD_ORDER.index(label) if label in LOAD_ORDER else len(LOAD_ORDER)


def _f(v: float | None, fmt: str = "{:.1f}") -> str:
    return "-" if v is None else fmt.format(v)


def render(table: dict[str, Any], n_runs: int) -> str:
    """Two Markdown tables: tokens/s per run with mean and spread, and the target ratios."""
    modes = list(dict.fromkeys(c["mode"] for c in table["cells"]))
    by = {(c["workload"], c["load"], c["mode"]): c for c in table["cells"]}
    lines = [
        "| workload | load | " + " | ".join(modes) + " |",
        "|---|---|" + "---:|" * len(modes),
    ]
    for g in table["groups"]:
        row = []
        for m in modes:
            c = by.get((g["workload"], g["load"], m))
            if c is None or c["mean"] is None:
                row.append("-")
            else:
                runs = " / ".join(_f(v) for v in c["runs"])
                row.append(f"{runs} (±{_f(100 * c['spread'] / 2 if c['spread'] is not None else None, '{:.0f}')} %)")
        lines.append(f"| {g['workload']} | {g['load']} | " + " | ".join(row) + " |")
    lines += [
        "",
        "| workload | load | adaptive / plain (per run) | adaptive / best static K (per run) | shift: adaptive / best other |",
        "|---|---|---|---|---|",
    ]

    def per_run(g: dict[str, Any], key: str) -> str:
        if key not in g:
            return "-"
        text = " / ".join(_f(v, "{:.2f}") for v in g[key])
        if n_runs > 1 and g.get(key + "_median") is not None:
            text += f" (median {g[key + '_median']:.2f})"
        return text

    for g in table["groups"]:
        lines.append(
            f"| {g['workload']} | {g['load']} | {per_run(g, 'x_plain')} | {per_run(g, 'x_best_static')} | "
            f"{per_run(g, 'x_best_other')} |"
        )
    hooked = [c for c in table["cells"] if any(v is not None for v in c.get("hook_cpu_share", []))]
    if hooked:
        lines += [
            "",
            "| workload | load | mode | the hook's CPU time, % of busy time (per run) |",
            "|---|---|---|---|",
        ]
        for c in hooked:
            vals = " / ".join(_f(None if v is None else 100 * v, "{:.2f}") for v in c["hook_cpu_share"])
            lines.append(f"| {c['workload']} | {c['load']} | {c['mode']} | {vals} |")
    lines.append("")
    lines.append(f"{n_runs} runs; a cell's ± is half its spread, (max - min) / mean.")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """Command line; see the module docstring."""
    ap = argparse.ArgumentParser(
        prog="python -m bench spread", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("runs", nargs="+", type=Path, help="results folders of python -m bench matrix")
    ap.add_argument("--json", type=Path, default=None, help="also write the table as JSON here")
    args = ap.parse_args(argv)
    try:
        runs = load_runs(args.runs)
        hooks = load_hook_shares(args.runs)
    except (OSError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    table = spread_table(runs, hooks)
    print(render(table, len(runs)))
    if args.json:
        args.json.write_text(json.dumps(table, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
