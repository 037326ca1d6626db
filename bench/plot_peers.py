"""bench/peers.py's rows -> DataFrames -> markdown tables and plotly figures (HTML and PNG) for docs/.

    python bench/plot_peers.py out/peers.jsonl [more.jsonl ...] --docs docs --name peers_h200

writes docs/<name>_batch.{html,png} (model TFLOPS against batch, one line per system, per model),
docs/<name>_depth.* and docs/<name>_width.* (megatrain_nb's TFLOPS and peak GPU memory against depth and
width), and prints the tables for docs/benchmarks.md. PNGs need kaleido (and a Chrome it can drive);
without it the HTML is written and the script says so. Imports plotly only to draw: peers.py uses
`summary_markdown` on the GPU machine, which has no plotly.
"""
from __future__ import annotations

import argparse
import json
import os

import pandas as pd

REFERENCES = ("megatrain-auto", "megatrain")  # ratios are against the first of these with ok rows
# The peers' targets at equal tokens per step: (batch, peer, megatrain_nb / peer must be >= this).
# Twin-Flow's "above at every batch" is a ratio > 1.
TARGETS = ((1, "native", 1.0), (1, "fsdp2-offload", 4.0), (4, "native", 1.2), (4, "fsdp2-offload", 2.5),
           (4, "zero3-offload", 3.5), (16, "zero3-offload", 1.4),
           *((b, "zero3-twinflow", 1.0) for b in (1, 4, 8, 16)))
SHORT = {"oom": "OOM", "skipped": "skipped", "not-run": "not run", "unsupported": "unsupported", "error": "error",
         "crashed": "crashed", "timeout": "timeout", "host-oom": "host OOM", "refused": "refused"}


def load_rows(paths) -> list[dict]:
    """Rows of one or more JSONL files, in order (later rows of the same key win in `frame`)."""
    rows = []
    for p in paths:
        with open(p) as f:
            rows += [json.loads(ln) for ln in f if ln.strip()]
    return rows


def frame(rows) -> pd.DataFrame:
    """One row per (sweep, system, model, batch): the last one measured; `model` labels the shape."""
    df = pd.DataFrame(rows)
    for c in ("layers", "hidden", "params", "model_tflops", "step_s", "optimizer_share", "peak_gpu_gib",
              "host_rss_peak_gib", "tokens_per_s", "compute_busy_share"):
        if c not in df:
            df[c] = None
    df["width"] = df.get("width", pd.Series(1.0, index=df.index)).fillna(1.0).astype(float)
    df["model"] = [_model(r) for r in df.itertuples()]
    keys = ["sweep", "system", "shape", "layers", "width", "batch"]
    return df.drop_duplicates(keys, keep="last").reset_index(drop=True)


def _model(r) -> str:
    w = "" if r.width == 1.0 else f" x{r.width:g} wide"
    layers = "" if pd.isna(r.layers) else f" {int(r.layers)}L"
    return f"{r.shape}{layers}{w}"


def reference(df: pd.DataFrame) -> str | None:
    """The megatrain_nb system that ratios are taken against: the first of REFERENCES with an ok row."""
    ok = set(df[df.status == "ok"].system)
    return next((s for s in REFERENCES if s in ok), None)


def ratios(df: pd.DataFrame) -> pd.DataFrame:
    """megatrain_nb's model TFLOPS over each peer's, per model and batch (equal tokens per step).

    Returns:
        sweep, model, batch, system, tflops, reference, ref_tflops, ratio (NaN where either side has no ok row).
    """
    ref = reference(df)
    cols = ["sweep", "model", "batch", "system", "tflops", "reference", "ref_tflops", "ratio"]
    if ref is None:
        return pd.DataFrame(columns=cols)
    core = df[df.sweep.isin(["core", "7b"])]
    core = core[core.system.isin(set(core[core.status == "ok"].system))]  # systems that ran at least once
    ref_t = core[(core.system == ref) & (core.status == "ok")].set_index(["model", "batch"]).model_tflops
    out = []
    for r in core[core.system != ref].itertuples():
        t = r.model_tflops if r.status == "ok" else float("nan")
        rt = ref_t.get((r.model, r.batch), float("nan"))
        out.append((r.sweep, r.model, r.batch, r.system, t, ref, rt, rt / t if t == t and t else float("nan")))
    return pd.DataFrame(out, columns=cols)


def targets(df: pd.DataFrame, shape: str = "3b") -> pd.DataFrame:
    """The peers' targets against the measured ratios at `shape`: batch, peer, need, ratio, met."""
    rt = ratios(df[df["shape"] == shape])
    out = []
    for b, peer, need in TARGETS:
        hit = rt[(rt.batch == b) & (rt.system == peer)].ratio
        r = float(hit.iloc[0]) if len(hit) else float("nan")
        met = bool(r > need if peer == "zero3-twinflow" else r >= need) if r == r else None
        out.append((b, peer, need, r, met))
    return pd.DataFrame(out, columns=["batch", "peer", "need", "ratio", "met"])


def bound(r) -> str:
    """What limits a megatrain_nb point: 'compute' when the compute stream is >= 90% busy, else its longest wait."""
    waits = r.get("waits_ms") if isinstance(r, dict) else getattr(r, "waits_ms", None)
    busy = r.get("compute_busy_share") if isinstance(r, dict) else getattr(r, "compute_busy_share", None)
    if busy is None or busy != busy:
        return "-"
    if busy >= 0.9 or not isinstance(waits, dict) or not waits:
        return "compute" if busy >= 0.9 else "-"
    k = max(waits, key=waits.get)
    return f"{k} ({waits[k]:.0f} ms idle)"


def sweep_table(g: pd.DataFrame, x: str) -> pd.DataFrame:
    """A depth or width sweep: each point's TFLOPS and peak GPU memory, also relative to the system's first
    ok point (the issue's "drop <= 5%" and "flat within 5%"), and what bounds it."""
    rows = []
    for system, s in g.groupby("system", sort=False):
        ok = s[s.status == "ok"]
        t0 = ok.model_tflops.iloc[0] if len(ok) else float("nan")
        m0 = ok.peak_gpu_gib.iloc[0] if len(ok) else float("nan")
        for r in s.to_dict("records"):
            good = r["status"] == "ok"
            rows.append({"system": system, x: r[x], "params (B)": round(r["params"] / 1e9, 2) if r["params"] else None,
                         "batch": r["batch"], "status": r["status"],
                         "model TFLOPS": r["model_tflops"] if good else None,
                         "vs first": round(r["model_tflops"] / t0, 3) if good else None,
                         "peak GPU GiB": r["peak_gpu_gib"] if good else None,
                         "peak GPU vs first": round(r["peak_gpu_gib"] / m0, 3) if good and m0 else None,
                         "host RSS GiB": r["host_rss_peak_gib"], "compute busy": r.get("compute_busy_share"),
                         "bound by": bound(r) if good else str(r.get("error") or "")[:120]})
    return pd.DataFrame(rows)


def _cell(r) -> str:
    if r.status != "ok":
        return SHORT.get(r.status, r.status)
    return f"{r.model_tflops:.1f}" if r.model_tflops >= 1 else f"{r.model_tflops:.2g}"  # tiny CPU runs: 0.00012


def _md(df: pd.DataFrame) -> str:
    head = "| " + " | ".join(map(str, df.columns)) + " |"
    rule = "|" + "---|" * len(df.columns)
    body = ["| " + " | ".join("" if v is None or (isinstance(v, float) and v != v) else str(v) for v in row) + " |"
            for row in df.itertuples(index=False)]
    return "\n".join([head, rule, *body])


def summary_markdown(rows) -> str:
    """The run's tables for docs/benchmarks.md: TFLOPS by batch, the details, ratios, targets, sweeps."""
    if not rows:
        return "(no rows)"
    df = frame(rows)
    parts = []
    core = df[df.sweep.isin(["core", "7b"])]
    for model, g in core.groupby("model", sort=False):
        piv = g.assign(cell=[_cell(r) for r in g.itertuples()]).pivot(index="system", columns="batch", values="cell")
        piv = piv.reindex(list(dict.fromkeys(g.system)))
        piv.columns = [f"batch {b}" for b in piv.columns]
        parts.append(f"### {model}, seq {int(g.seq.iloc[0])}: model TFLOPS\n\n" + _md(piv.reset_index()))
        d = g[["system", "batch", "status", "step_s", "model_tflops", "tokens_per_s", "optimizer_share",
               "peak_gpu_gib", "host_rss_peak_gib"]]
        parts.append(_md(d))
        fails = g[g.status != "ok"]
        if len(fails):
            parts.append("\n".join(f"- {r.system} batch {r.batch}: {r.status}: {str(r.error)[:240]}"
                                   for r in fails.itertuples()))
    rt = ratios(df)
    if len(rt):
        piv = rt.pivot_table(index=["model", "system"], columns="batch", values="ratio", sort=False,
                             dropna=False).round(2)
        piv.columns = [f"batch {b}" for b in piv.columns]
        parts.append(f"### {rt.reference.iloc[0]} / peer, model TFLOPS at equal tokens per step\n\n"
                     + _md(piv.reset_index()))
        tg = targets(df)
        if tg.ratio.notna().any():
            tg = tg.assign(ratio=tg.ratio.round(2), met=tg.met.map({True: "yes", False: "**no**", None: "-"}))
            parts.append("### Targets against the peers (3B)\n\n" + _md(tg))
    for sweep, x in (("depth", "layers"), ("width", "hidden")):
        g = df[df.sweep == sweep].sort_values(["system", x])
        if len(g):
            parts.append(f"### {sweep} sweep\n\n" + _md(sweep_table(g, x)))
    return "\n\n".join(parts)


def figures(df: pd.DataFrame) -> dict:
    """Plotly figures: 'batch' (TFLOPS vs batch per system, a panel per model), 'depth' and 'width'
    (TFLOPS and peak GPU GiB vs layers / hidden size, one trace of each per system); only those with rows."""
    import plotly.graph_objects as go
    from plotly.subplots import make_subplots

    ok = df[df.status == "ok"]
    figs = {}
    core = ok[ok.sweep.isin(["core", "7b"])]
    if len(core):
        models = list(dict.fromkeys(core.model))
        fig = make_subplots(rows=1, cols=len(models), subplot_titles=models)
        palette = px_colors()
        color = {s: palette[k % len(palette)] for k, s in enumerate(dict.fromkeys(core.system))}  # one per system
        shown = set()
        for i, m in enumerate(models, 1):
            for system, g in core[core.model == m].groupby("system", sort=False):
                g = g.sort_values("batch")
                fig.add_trace(go.Scatter(x=g.batch, y=g.model_tflops, name=system, legendgroup=system,
                                         showlegend=system not in shown, mode="lines+markers",
                                         line=dict(color=color[system]), marker=dict(color=color[system])), row=1, col=i)
                shown.add(system)
            fig.update_xaxes(title_text="batch (sequences of %d tokens)" % int(core.seq.iloc[0]), type="log",
                             tickvals=sorted(set(core[core.model == m].batch)), row=1, col=i)
            fig.update_yaxes(title_text="model TFLOPS (6·N·tokens/s)", row=1, col=i)
        fig.update_layout(title="Model TFLOPS against batch, one process per system", template="plotly_white")
        figs["batch"] = fig
    for sweep, x, label in (("depth", "layers", "decoder layers"), ("width", "hidden", "hidden size")):
        g = ok[ok.sweep == sweep]
        if not len(g):
            continue
        fig = make_subplots(specs=[[{"secondary_y": True}]])
        palette = px_colors()
        for k, (system, s) in enumerate(g.groupby("system", sort=False)):
            s, c = s.sort_values(x), palette[k % len(palette)]  # a system's two lines share its colour
            fig.add_trace(go.Scatter(x=s[x], y=s.model_tflops, name=f"{system} TFLOPS", mode="lines+markers",
                                     line=dict(color=c), marker=dict(color=c)), secondary_y=False)
            fig.add_trace(go.Scatter(x=s[x], y=s.peak_gpu_gib, name=f"{system} peak GPU GiB", mode="lines+markers",
                                     line=dict(dash="dot", color=c), marker=dict(color=c, symbol="diamond")),
                          secondary_y=True)
        fig.update_xaxes(title_text=label, tickvals=sorted(set(g[x])))
        fig.update_yaxes(title_text="model TFLOPS", rangemode="tozero", secondary_y=False)
        fig.update_yaxes(title_text="peak GPU GiB", rangemode="tozero", secondary_y=True)
        fig.update_layout(title=f"megatrain_nb against {label}, batch {int(g.batch.iloc[0])} × {int(g.seq.iloc[0])}",
                          template="plotly_white")
        figs[sweep] = fig
    return figs


def px_colors() -> list[str]:
    """Plotly's default qualitative colours: a system keeps one across every panel of a figure."""
    import plotly.express as px

    return list(px.colors.qualitative.Plotly)


def write(figs: dict, docs: str, name: str, *, png: bool = True) -> list[str]:
    """Each figure as docs/<name>_<key>.html and .png; returns the paths written (PNG needs kaleido)."""
    os.makedirs(docs, exist_ok=True)
    written = []
    for key, fig in figs.items():
        base = os.path.join(docs, f"{name}_{key}")
        fig.write_html(base + ".html", include_plotlyjs="cdn")
        written.append(base + ".html")
        if not png:
            continue
        for attempt in (1, 2):  # kaleido's browser link sometimes drops a first message on a busy machine
            try:
                fig.write_image(base + ".png", width=1100, height=500, scale=1)
                written.append(base + ".png")
                break
            except Exception as e:  # noqa: BLE001 - kaleido or its Chrome missing: HTML only, said once
                if attempt == 2:
                    print(f"no PNG for {key}: {type(e).__name__}: {e}")
    return written


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("rows", nargs="+", help="JSONL files from bench/peers.py")
    ap.add_argument("--docs", default="docs")
    ap.add_argument("--name", default="peers")
    ap.add_argument("--no-figures", action="store_true", help="only print the tables")
    a = ap.parse_args(argv)
    rows = load_rows(a.rows)
    print(summary_markdown(rows))
    if not a.no_figures:
        for p in write(figures(frame(rows)), a.docs, a.name):
            print("wrote", p)


if __name__ == "__main__":
    main()
