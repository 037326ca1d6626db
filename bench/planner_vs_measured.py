"""The planner's predictions against measured H200 rows: step time, model TFLOPS, peak GPU memory, host bytes.

Runs anywhere (no GPU: the planner is arithmetic plus a small simulation):
    python bench/planner_vs_measured.py [--results bench/results/h200-2026-11-29-host-path.jsonl] [--shape 3b 7b]

Rows: bench/throughput.py rows with checkpoint_every=None and the pinning asked for (default
cast_on_device, the engine's default on CUDA). A later row of the same setting (shape, layers, batch,
seq, pinning) replaces an earlier one, so a results file that grew over a session is compared at its
final code (in the default file: its last 5 rows). Each row is re-planned with the
settings it ran with (batch, seq, weight slots, overlap, pin_store / cast_on_device, the 2 GiB pinned
pool) on the `H200` profile, whose rates were measured apart from these steps (tools/gpu_limits.py;
host AdamW: bench/host_adam.py, one layer in isolation). Model TFLOPS uses the benchmark's formula on
both sides, 6 * N(all parameters) * tokens / step time. Peak GPU memory: the planner's sum of every
device category (its 2 GiB reserve included) against torch.cuda.max_memory_allocated.

Second table: each lane's work in one step, planner vs the row's own recorded trace
(tests/fixtures/trace_*.json.gz whose meta step_s equals the row's), to show which rate is off.
Third table: step time under planner variants: packing (the pinning modelled before cast_on_device),
as run (the prediction: `Plan.step_ms`, one step from cold), the same settings in the steady state
(`Plan.steady_step_ms`: steps back to back, each load waiting for its unit's previous update, the
optimizer's tail overlapping the next forward), and two variants whose rates are read from the row's
own trace — host AdamW alone, then also H2D, layer and loss compute. Those are fitted to the data they
are compared with: they locate the error, they do not predict.
Fourth table: the steady state against the recorded trace (itself a step in a run of steps): the
fitted variants in the steady state, how long the host AdamW lane sits idle within the step, how long
compute waits on the optimizer (`find_stalls`), and the host-unpack time of the embedding's gradients,
which ends the step (the driver returns once they landed).
"""
from __future__ import annotations

import argparse
import dataclasses
import gzip
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, os.path.dirname(__file__))
from shapes import bench_config  # noqa: E402

from megatrain_nb.machine.planner import H200, model_shape, plan  # noqa: E402
from megatrain_nb.view.trace import Trace, find_stalls  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results" / "h200-2026-11-29-host-path.jsonl"
TRACES = ROOT / "tests" / "fixtures"
_GIB = float(1 << 30)
LANES = ("compute", "h2d", "d2h", "host-adam", "host-unpack")


def pinning_of(row: dict) -> str:
    return "cast_on_device" if row.get("cast_on_device") else "pin_store" if row.get("pin_store") else "packing"


def load_rows(path: Path, shapes: list[str], pinning: str) -> list[dict]:
    """Throughput rows of `shapes` and `pinning` ("all": any) without checkpoint_every; the last row
    of each setting wins."""
    latest: dict[tuple, dict] = {}
    for line in path.read_text().splitlines():
        r = json.loads(line) if line.strip() else {}
        if "step_s" not in r or r.get("shape") not in shapes or r.get("checkpoint_every") is not None \
                or pinning not in ("all", pinning_of(r)):
            continue
        key = (r["shape"], r["layers"], r["batch"], r["seq"], pinning_of(r))
        latest.pop(key, None)
        latest[key] = r  # re-inserted: the table keeps the file's order of final rows
    return list(latest.values())


def find_trace(row: dict) -> Trace | None:
    """The recorded trace of this very run: meta shape, batch, seq and step_s equal the row's."""
    for path in sorted(TRACES.glob("trace_*.json.gz")):
        with gzip.open(path, "rt") as f:
            meta = json.load(f).get("meta", {})
        if (meta.get("shape"), meta.get("batch"), meta.get("seq")) == (row["shape"], row["batch"], row["seq"]) \
                and round(meta.get("step_s", -1), 4) == row["step_s"]:
            return Trace.load(path)
    return None


def lane_work(trace: Trace) -> dict:
    """ms of work per lane inside the recorded step (waits excluded), and per-layer medians. A load's
    span covers its DMA and, with cast_on_device, the device casts queued between its chunks."""
    df = trace.to_dataframe()
    df = df[df.op != "wait-update"]
    L = int(df[df.op == "loss"].layer.iloc[0])
    layer = df[(df.layer >= 0) & (df.layer < L)]
    med = lambda lane, op: layer[(layer.lane == lane) & (layer.op == op)].dur_ms.median()  # noqa: E731
    return {"busy": {lane: df[df.lane == lane].dur_ms.sum() for lane in LANES},
            "adam_ms": med("host-adam", "adam"), "fwd_ms": med("compute", "fwd"), "bwd_ms": med("compute", "bwd"),
            "h2d_ms": med("h2d", "h2d"), "loss_ms": df[df.op == "loss"].dur_ms.sum()}


def pcie_bytes_per_layer(p) -> int:
    """Bytes one layer load moves as the planner counts them (the trace's h2d bytes count the bf16
    destination, half the fp32 bytes that cross PCIe under cast_on_device)."""
    df = p.simulate()
    return int(df[(df.lane == "h2d") & (df.layer == 0)].bytes.iloc[0])


def fitted(row: dict, work: dict, *, adam_only: bool, layer_bytes: int):
    """H200 with rates read from the row's own trace (fitted to the data compared with)."""
    s = model_shape(bench_config(row["shape"], layers=row["layers"]))
    P = s["params_per_layer"]
    adam_ms = work["adam_ms"] - (P / H200.host_cast_elems_per_s * 1e3 if row.get("pin_store") else 0)  # the
    # traced update includes pin_store's refresh, which the planner adds at the cast rate
    hw = dataclasses.replace(H200, name=f"H200, rates fitted to the {row['shape']} b{row['batch']} trace",
                             host_adam_params_per_s=P / adam_ms * 1e3)
    if adam_only:
        return hw
    T = row["batch"] * row["seq"]
    layer_ms = work["fwd_ms"] + work["bwd_ms"]
    return dataclasses.replace(hw, h2d_GBps=layer_bytes / work["h2d_ms"] / 1e6,
                               bf16_tflops=6 * s["active_params_per_layer"] * T / layer_ms / 1e9,
                               gemm_tflops=6 * s["vocab"] * s["hidden"] * T / work["loss_ms"] / 1e9)


def predict(row: dict, hardware, **pinning):
    """Plan the setting of one measured row (pinning as run unless given)."""
    cfg = bench_config(row["shape"], layers=row["layers"], seq=row["seq"])
    pinning = pinning or dict(pin_store=bool(row.get("pin_store")), cast_on_device=bool(row.get("cast_on_device")))
    return plan(cfg, batch=row["batch"], seq=row["seq"], hardware=hardware, weight_slots=row.get("slots", 2),
                checkpoint_every=row.get("checkpoint_every"), overlap_optimizer=row.get("overlap", True), **pinning)


def adam_idle_ms(df) -> float:
    """ms between 0 and the step's last end during which the host-adam lane runs nothing."""
    step = max(float(df.end_ms.max()), 0.0)
    adam, busy, until = df[df.lane == "host-adam"], 0.0, 0.0
    for a, b in sorted(zip(adam.start_ms.clip(0, step), adam.end_ms.clip(0, step))):
        busy, until = busy + max(0.0, b - max(a, until)), max(until, b)
    return step - busy


def optimizer_stall_ms(df) -> float:
    """ms compute waited on the optimizer, as `find_stalls` attributes it."""
    st = find_stalls(df)
    return float(st[st.waited_on == "optimizer"].dur_ms.sum())


def embed_grad_ms(df) -> float:
    """host-unpack time of the embedding's gradients (the step's last landing)."""
    return float(df[(df.lane == "host-unpack") & (df.op == "embed_grad")].dur_ms.sum())


def err(pred: float, meas: float) -> str:
    return f"{(pred - meas) / meas * 100:+.1f}%"


def main(argv=None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--results", default=str(RESULTS), help="JSON lines written by bench/throughput.py")
    ap.add_argument("--shape", nargs="+", default=["3b", "7b"], help="which shapes' rows to compare")
    ap.add_argument("--pinning", default="cast_on_device", help="which rows: the default on CUDA (cast_on_device), "
                    "another pinning, or all", choices=["cast_on_device", "pin_store", "packing", "all"])
    a = ap.parse_args(argv)
    rows = load_rows(Path(a.results), a.shape, a.pinning)
    if not rows:
        raise SystemExit(f"no {a.shape} {a.pinning} rows without checkpoint_every in {a.results}")
    out = []
    print(f"## Planner (H200 profile, settings as run) vs measured ({Path(a.results).name}, {rows[0]['gpu']})\n")
    print("| shape | batch × seq | pinning | step ms pred | meas | err | model TFLOPS pred | meas "
          "| peak GPU GiB pred | meas | err | host B/param pred | meas | recomputed pred / meas | predicted bound |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        p = predict(r, H200)
        assert p.shape["n_params"] == r["params"], (p.shape["n_params"], r["params"])  # same model as the run
        m_ms, gpu = r["step_s"] * 1e3, sum(p.device_bytes.values()) / _GIB
        tflops = 6 * r["params"] * r["batch"] * r["seq"] / p.step_ms / 1e9
        print(f"| {r['shape']} | {r['batch']} × {r['seq']} | {pinning_of(r)} | {p.step_ms:.0f} | {m_ms:.0f} "
              f"| {err(p.step_ms, m_ms)} "
              f"| {tflops:.1f} | {r['model_tflops']:.1f} | {gpu:.2f} | {r['peak_gpu_gib']:.2f} | "
              f"{err(gpu, r['peak_gpu_gib'])} | {p.host_bytes_per_param:.2f} | {r.get('host_bytes_per_param', '–')} "
              f"| {p.recomputed_layers} / {r['recomputed_layers']} | {p.bottleneck} |")
        out.append({"row": r, "measured_step_ms": m_ms, "plan": p, "step_err": (p.step_ms - m_ms) / m_ms,
                    "gpu_gib": gpu, "gpu_err": (gpu - r["peak_gpu_gib"]) / r["peak_gpu_gib"]})
    print(f"\nPeak GPU 'pred' includes the planner's {out[0]['plan'].device_bytes['reserve'] / _GIB:.0f} GiB reserve "
          "(CUDA context, workspaces, slack); max_memory_allocated counts no context.\n")

    print("## Work per lane in one step (ms): planner / recorded trace of the same run\n")
    print("| shape | batch | " + " | ".join(LANES) + " | H2D GB/s per layer load | AdamW G params/s per layer |")
    print("|---|---|" + "---|" * (len(LANES) + 2))
    for o in out:
        r, p = o["row"], o["plan"]
        trace = find_trace(r)
        o["trace"] = work = lane_work(trace) if trace is not None else None
        o["trace_df"] = trace.to_dataframe() if trace is not None else None
        if work is None:
            print(f"| {r['shape']} | {r['batch']} | no trace with step_s {r['step_s']} in {TRACES} |")
            continue
        P, o["layer_bytes"] = p.shape["params_per_layer"], pcie_bytes_per_layer(p)
        print(f"| {r['shape']} | {r['batch']} | "
              + " | ".join(f"{p.busy_ms.get(k, 0):.0f} / {work['busy'][k]:.0f}" for k in LANES)
              + f" | {H200.h2d_GBps:.1f} / {o['layer_bytes'] / work['h2d_ms'] / 1e6:.1f} | "
              f"{H200.host_adam_params_per_s / 1e9:.2f} / {P / work['adam_ms'] / 1e6:.2f} |")

    print("\n## Step time (ms) under planner variants (the last two are fitted to each row's own trace)\n")
    print("| shape | batch | measured | packing (no pinning) | err | as run (prediction) | err "
          "| as run, steady state | err | + AdamW rate from trace | err | + H2D, layer, loss rates from trace | err |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for o in out:
        r, m_ms, p = o["row"], o["measured_step_ms"], o["plan"]
        pack = predict(r, H200, pin_store=False, cast_on_device=False).step_ms
        o.update(packing_ms=pack, steady_ms=p.steady_step_ms, steady_err=(p.steady_step_ms - m_ms) / m_ms)
        cells = [f"{pack:.0f} | {err(pack, m_ms)}", f"{p.step_ms:.0f} | {err(p.step_ms, m_ms)}",
                 f"{p.steady_step_ms:.0f} | {err(p.steady_step_ms, m_ms)}"]
        if o["trace"] is not None:
            for k, adam_only in (("fit_adam", True), ("fit_all", False)):
                o[k] = predict(r, fitted(r, o["trace"], adam_only=adam_only, layer_bytes=o["layer_bytes"]))
                o[f"{k}_ms"], o[f"{k}_steady_ms"] = o[k].step_ms, o[k].steady_step_ms
            cells += [f"{o[k]:.0f} | {err(o[k], m_ms)}" for k in ("fit_adam_ms", "fit_all_ms")]
        print(f"| {r['shape']} | {r['batch']} | {m_ms:.0f} | " + " | ".join(cells) + " |")

    print("\n## Steady state (steps back to back) against the recorded trace (fitted variants as above)\n")
    print("| shape | batch | measured | cold | err | steady | err | steady, AdamW fitted | err | steady, all fitted "
          "| err | AdamW idle ms: cold / steady / trace | optimizer stall ms: cold / steady / trace "
          "| embedding grads unpack ms: plan / trace |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for o in out:
        r, m_ms, p, df = o["row"], o["measured_step_ms"], o["plan"], o["trace_df"]
        cells = [f"{p.step_ms:.0f} | {err(p.step_ms, m_ms)}", f"{o['steady_ms']:.0f} | {err(o['steady_ms'], m_ms)}"]
        if df is None:
            print(f"| {r['shape']} | {r['batch']} | {m_ms:.0f} | " + " | ".join(cells) + " | no trace |")
            continue
        cold, steady = p.simulate(), p.simulate_steady()
        cells += [f"{o[k]:.0f} | {err(o[k], m_ms)}" for k in ("fit_adam_steady_ms", "fit_all_steady_ms")]
        cells += [" / ".join(f"{f(x):.0f}" for x in (cold, steady, df)) for f in (adam_idle_ms, optimizer_stall_ms)]
        cells.append(f"{embed_grad_ms(cold):.0f} / {embed_grad_ms(df):.0f}")
        print(f"| {r['shape']} | {r['batch']} | {m_ms:.0f} | " + " | ".join(cells) + " |")
    return out


if __name__ == "__main__":
    main()
