"""Tables and charts from benchmark results (the dicts of :func:`bench.runner.run_cell`).

* :func:`summary_rows` / :func:`group_ratios`: one row per cell, and per
  (workload, load) group the ratios the targets are stated in: adaptive / best static K,
  adaptive / K=0, adaptive / plain vLLM (output tokens/s), and on ``shift`` adaptive
  against the best other mode (tokens/s and mean ITL).
* :func:`write_summary`: ``summary.md``, ``summary.csv``, ``summary.json``.
* :func:`cell_figure` / :func:`summary_figure`: Plotly figures, written as HTML (with
  ``plotly.min.js`` once beside them, so they open offline) and PNG when Kaleido and a
  Chromium are available.
"""

from __future__ import annotations

import csv
import json
import logging
from pathlib import Path
from typing import Any, Sequence

from .engine_control import static_k
from .runner import headline

log = logging.getLogger("bench.report")

TARGET_VS_BEST_STATIC = 0.95
TARGET_VS_K0 = 0.98
TARGET_SHIFT_GAIN = 1.10


def summary_rows(results: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """One :func:`bench.runner.headline` row per result, in input order."""
    return [headline(r) for r in results]


def _ratio(a: float | None, b: float | None) -> float | None:
    return round(a / b, 3) if a is not None and b else None


def group_ratios(rows: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per (workload, load): the ratios of the targets (output tokens/s unless noted).

    Keys: ``best_static_mode``, ``adaptive_vs_best_static`` (target >= 0.95),
    ``adaptive_vs_k0`` (target >= 0.98), ``adaptive_vs_plain``, ``best_other_mode``,
    ``adaptive_vs_best_other`` (tokens/s), ``best_other_itl_vs_adaptive`` (lowest
    mean ITL of the other same-engine modes / adaptive's mean ITL; above 1 = adaptive
    faster per token), and ``meets_*`` flags (None when a ratio could not be computed).
    """
    groups: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for r in rows:
        groups.setdefault((r["workload"], r["load"]), []).append(r)
    out = []
    for (wl, load), rs in groups.items():
        by_mode = {r["mode"]: r for r in rs}
        tps = {m: r["output_tokens_per_s"] for m, r in by_mode.items()}
        # the controller with its per-request gate (adaptive, adaptive:LO-HI), not adaptive_step
        adaptive = next((m for m in by_mode if m == "adaptive" or m.startswith("adaptive:")), None)
        statics = {m: v for m, v in tps.items() if static_k(m) is not None}
        best_static = max(statics, key=lambda m: statics[m]) if statics else None
        k0 = next((m for m in ("fixed:0", "off") if m in by_mode), None)
        plain = "plain" if "plain" in by_mode else None
        others = {m: v for m, v in tps.items() if m != adaptive and m != "plain"}
        best_other = max(others, key=lambda m: others[m]) if others else None
        itl_others = [
            r["itl_mean_ms"]
            for m, r in by_mode.items()
            if m not in (adaptive, "plain") and r["itl_mean_ms"] is not None
        ]
        a = tps.get(adaptive) if adaptive else None
        g: dict[str, Any] = {
            "workload": wl,
            "load": load,
            "adaptive_mode": adaptive,
            "adaptive_tokens_per_s": a,
            "best_static_mode": best_static,
            "best_static_tokens_per_s": statics.get(best_static) if best_static else None,
            "k0_tokens_per_s": tps.get(k0) if k0 else None,
            "plain_tokens_per_s": tps.get(plain) if plain else None,
            "adaptive_vs_best_static": _ratio(a, statics.get(best_static) if best_static else None),
            "adaptive_vs_k0": _ratio(a, tps.get(k0) if k0 else None),
            "adaptive_vs_plain": _ratio(a, tps.get(plain) if plain else None),
            "best_other_mode": best_other,
            "adaptive_vs_best_other": _ratio(a, others.get(best_other) if best_other else None),
            "best_other_itl_vs_adaptive": _ratio(
                min(itl_others) if itl_others else None, by_mode[adaptive]["itl_mean_ms"] if adaptive else None
            ),
        }
        g["meets_vs_best_static"] = (
            None if g["adaptive_vs_best_static"] is None else g["adaptive_vs_best_static"] >= TARGET_VS_BEST_STATIC
        )
        g["meets_vs_k0"] = None if g["adaptive_vs_k0"] is None else g["adaptive_vs_k0"] >= TARGET_VS_K0
        if wl == "shift":
            vals = [v for v in (g["adaptive_vs_best_other"], g["best_other_itl_vs_adaptive"]) if v is not None]
            g["meets_shift_gain"] = (max(vals) >= TARGET_SHIFT_GAIN) if vals else None
        out.append(g)
    return out


def _fmt(v: Any, nd: int = 1) -> str:
    if v is None:
        return "-"
    if isinstance(v, bool):
        return "yes" if v else "**no**"
    if isinstance(v, float):
        return f"{v:.{nd}f}"
    return str(v)


def _pct(fraction: float | None) -> str:
    return "-" if fraction is None else f"{100 * fraction:.2f}"


def markdown_tables(rows: Sequence[dict[str, Any]], ratios: Sequence[dict[str, Any]]) -> str:
    """Markdown: output tokens/s by (workload, load) x mode, the ratios, then per-cell details."""
    modes: list[str] = []
    for r in rows:
        if r["mode"] not in modes:
            modes.append(r["mode"])
    cells = {(r["workload"], r["load"], r["mode"]): r for r in rows}
    keys: list[tuple[str, str]] = []
    for r in rows:
        if (r["workload"], r["load"]) not in keys:
            keys.append((r["workload"], r["load"]))
    lines = [
        "### Output tokens/s (client-side, inside the window)",
        "",
        "| workload | load | " + " | ".join(modes) + " |",
        "|---|---|" + "---:|" * len(modes),
    ]
    for wl, load in keys:
        vals = [_fmt(cells.get((wl, load, m), {}).get("output_tokens_per_s")) for m in modes]
        lines.append(f"| {wl} | {load} | " + " | ".join(vals) + " |")
    lines += [
        "",
        "### Ratios (targets: adaptive >= 0.95 x best static K, >= 0.98 x K=0; shift: >= 1.10 x every other mode)",
        "",
        "| workload | load | best static | adaptive / best static | adaptive / K=0 | adaptive / plain | "
        "best other | adaptive / best other (tok/s) | best other ITL / adaptive ITL | meets static | meets K=0 | meets shift |",
        "|---|---|---|---:|---:|---:|---|---:|---:|---|---|---|",
    ]
    for g in ratios:
        lines.append(
            f"| {g['workload']} | {g['load']} | {_fmt(g['best_static_mode'])} | {_fmt(g['adaptive_vs_best_static'], 3)} | "
            f"{_fmt(g['adaptive_vs_k0'], 3)} | {_fmt(g['adaptive_vs_plain'], 3)} | {_fmt(g['best_other_mode'])} | "
            f"{_fmt(g['adaptive_vs_best_other'], 3)} | {_fmt(g['best_other_itl_vs_adaptive'], 3)} | "
            f"{_fmt(g['meets_vs_best_static'])} | {_fmt(g['meets_vs_k0'])} | {_fmt(g.get('meets_shift_gain'))} |"
        )
    lines += [
        "",
        "### Per cell",
        "",
        "| workload | load | mode | tok/s | goodput tok/s | TTFT p50/p95/p99 ms | ITL mean/p50/p95/p99 ms | "
        "E2E p50/p95/p99 ms | finished | acceptance | mean K | hook % of busy |",
        "|---|---|---|---:|---:|---|---|---|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(
            f"| {r['workload']} | {r['load']} | {r['mode']} | {_fmt(r['output_tokens_per_s'])} | "
            f"{_fmt(r['goodput_tokens_per_s'])} | {_fmt(r['ttft_p50_ms'], 0)}/{_fmt(r['ttft_p95_ms'], 0)}/{_fmt(r['ttft_p99_ms'], 0)} | "
            f"{_fmt(r['itl_mean_ms'])}/{_fmt(r['itl_p50_ms'])}/{_fmt(r['itl_p95_ms'])}/{_fmt(r['itl_p99_ms'])} | "
            f"{_fmt(r['e2e_p50_ms'], 0)}/{_fmt(r['e2e_p95_ms'], 0)}/{_fmt(r['e2e_p99_ms'], 0)} | {r['requests_finished']} | "
            f"{_fmt(r['acceptance_rate'], 3)} | {_fmt(r['mean_k'], 2)} | {_pct(r.get('hook_cpu_share'))} |"
        )
    return "\n".join(lines) + "\n"


def write_summary(
    results: Sequence[dict[str, Any]], out_dir: Path, meta: dict[str, Any] | None = None
) -> dict[str, Path]:
    """Write ``summary.md``, ``summary.csv`` and ``summary.json`` into ``out_dir``.

    Returns:
        ``{"md": path, "csv": path, "json": path}``.
    """
    out_dir.mkdir(parents=True, exist_ok=True)
    rows = summary_rows(results)
    ratios = group_ratios(rows)
    md = out_dir / "summary.md"
    header = ""
    if meta and meta.get("command"):
        header = f"Command: `{meta['command']}`\n\n"
    md.write_text(header + markdown_tables(rows, ratios))
    csv_path = out_dir / "summary.csv"
    if rows:
        with csv_path.open("w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=list(rows[0]))
            w.writeheader()
            w.writerows(rows)
    js = out_dir / "summary.json"
    js.write_text(json.dumps({"meta": meta or {}, "rows": rows, "ratios": ratios}, indent=2))
    return {"md": md, "csv": csv_path, "json": js}


_PHASE_COLOURS = {"code": "rgba(31,119,180,0.08)", "docs": "rgba(44,160,44,0.08)", "chat": "rgba(214,39,40,0.08)"}


def cell_figure(result: dict[str, Any]):
    """Plotly figure of one run: K over time, output tokens/s over time, acceptance rate."""
    import plotly.graph_objects as go
    from plotly.subplots import make_subplots

    fig = make_subplots(
        rows=3,
        cols=1,
        shared_xaxes=True,
        vertical_spacing=0.06,
        subplot_titles=("Draft length K (tokens)", "Output tokens/s", "Acceptance rate (0..1)"),
    )
    tl = result["k"]["timeline"]
    fig.add_trace(
        go.Scatter(
            x=[p["t_s"] for p in tl],
            y=[p["k"] for p in tl],
            mode="lines",
            line_shape="hv",
            name="K (polled /control/state)",
        ),
        row=1,
        col=1,
    )
    ss = result["server_samples"]
    fig.add_trace(
        go.Scatter(x=[s["t_s"] for s in ss], y=[s["k"] for s in ss], mode="markers", name="K (per-second sample)"),
        row=1,
        col=1,
    )
    series = result["throughput_series"]
    fig.add_trace(
        go.Scatter(x=[i + 0.5 for i in range(len(series))], y=series, mode="lines+markers", name="client tokens/s"),
        row=2,
        col=1,
    )
    fig.add_trace(
        go.Scatter(
            x=[s["t_s"] + 0.5 for s in ss],
            y=[s["output_tokens_per_s"] for s in ss],
            mode="lines",
            line_dash="dot",
            name="server tokens/s",
        ),
        row=2,
        col=1,
    )
    fig.add_trace(
        go.Scatter(
            x=[s["t_s"] + 0.5 for s in ss],
            y=[s["acceptance_rate"] for s in ss],
            mode="lines+markers",
            name="acceptance (per second)",
        ),
        row=3,
        col=1,
    )
    spec = result["spec"]
    if spec["workload"] == "shift":
        phases = result.get("workload_series") or []
        for i, (t, wl) in enumerate(phases):
            end = phases[i + 1][0] if i + 1 < len(phases) else spec["duration_s"]
            fig.add_vrect(
                x0=t,
                x1=end,
                fillcolor=_PHASE_COLOURS.get(wl, "rgba(0,0,0,0.05)"),
                line_width=0,
                annotation_text=wl,
                annotation_position="top left",
                row="all",
                col=1,
            )
    c = result["client"]
    load = spec["load"]["label"] or (
        f"rate {spec['load']['rate_per_s']}/s"
        if spec["load"]["rate_per_s"]
        else f"concurrency {spec['load']['concurrency']}"
    )
    fig.update_layout(
        title=f"{spec['workload']} / {load} / {spec['mode']}: {c['output_tokens_per_s']:.1f} tok/s, "
        f"acceptance {result['acceptance']['acceptance_rate']}, mean K {result['k']['mean_k_steps']}",
        height=780,
        width=1000,
        template="plotly_white",
    )
    fig.update_xaxes(title_text="seconds since start", row=3, col=1)
    fig.update_yaxes(range=[-0.05, 1.05], row=3, col=1)
    return fig


def summary_figure(rows: Sequence[dict[str, Any]]):
    """Grouped bars: output tokens/s per mode for each (workload, load)."""
    import plotly.graph_objects as go

    modes: list[str] = []
    for r in rows:
        if r["mode"] not in modes:
            modes.append(r["mode"])
    fig = go.Figure()
    for m in modes:
        rs = [r for r in rows if r["mode"] == m]
        fig.add_trace(
            go.Bar(name=m, x=[f"{r['workload']}/{r['load']}" for r in rs], y=[r["output_tokens_per_s"] for r in rs])
        )
    fig.update_layout(
        barmode="group",
        title="Output tokens/s by workload/load and mode",
        yaxis_title="tokens/s",
        template="plotly_white",
        height=560,
        width=1200,
    )
    return fig


def save_pngs(figs_and_paths: Sequence[tuple[Any, Path]]) -> str | None:
    """Write many PNGs with one Kaleido browser session (much faster than one each).

    Returns:
        None on success, else the error message (HTML charts are unaffected).
    """
    if not figs_and_paths:
        return None
    try:
        import plotly.io as pio

        pio.write_images([f for f, _ in figs_and_paths], [str(p) for _, p in figs_and_paths])
        return None
    except Exception as exc:  # Kaleido or Chromium missing
        msg = f"{type(exc).__name__}: {exc}".splitlines()[0][:300]
        log.warning("PNG export unavailable (%s); kept the HTML charts", msg)
        return msg


def save_figure(fig, path_html: Path, png: bool = True) -> dict[str, str | None]:
    """Write ``path_html`` (plotly.js shared in the same folder) and, when ``png`` and
    Kaleido works, the PNG next to it.

    Returns:
        ``{"html": path, "png": path or None, "png_error": message or None}``.
    """
    path_html.parent.mkdir(parents=True, exist_ok=True)
    fig.write_html(str(path_html), include_plotlyjs="directory")
    out: dict[str, str | None] = {"html": str(path_html), "png": None, "png_error": None}
    if png:
        path_png = path_html.with_suffix(".png")
        try:
            fig.write_image(str(path_png))
            out["png"] = str(path_png)
        except Exception as exc:  # Kaleido or Chromium missing: HTML only
            out["png_error"] = f"{type(exc).__name__}: {exc}".splitlines()[0][:300]
            log.warning("PNG export unavailable (%s); kept the HTML chart", out["png_error"])
    return out
