"""The planner's predictions against measured H200 rows: step time, model TFLOPS, peak GPU memory.

Runs anywhere (no GPU: the planner is arithmetic plus a small simulation):
    python bench/planner_vs_measured.py [--results bench/results_h200_2026-11-29_pinned.jsonl] [--shape 3b]

Each measured row (bench/throughput.py) is re-planned with the settings it ran with: batch, seq,
weight slots, checkpoint_every, overlap, pin_store and the 2 GiB pinned pool. Model TFLOPS is computed for both sides with the benchmark's formula,
6 * N(all parameters) * tokens / step time. Peak GPU memory: the planner's sum of every device
category (its 2 GiB reserve included) against torch.cuda.max_memory_allocated.

A second table shows the step time under three planner variants: without pin_store (packing
modelled, which these runs did not do), as run (the main table), and as run with the host AdamW
rate measured from the recorded batch-1 trace (tests/data/trace_3b_b1.json.gz), which includes the
refresh of the pinned bf16 copy; that variant is fitted to this data, not a prediction.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, os.path.dirname(__file__))
from shapes import qwen_config  # noqa: E402

from megatrain_nb.planner import H200, model_shape, plan  # noqa: E402
from megatrain_nb.trace import Trace  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results_h200_2026-11-29_pinned.jsonl"
TRACE_B1 = ROOT / "tests" / "data" / "trace_3b_b1.json.gz"
_GIB = float(1 << 30)


def measured_adam_rate(trace_path: Path, params_per_layer: int) -> float:
    """Host AdamW params/s of the decoder layers in a recorded trace (median layer span)."""
    df = Trace.load(trace_path).to_dataframe()
    adam = df[(df.lane == "host-adam") & (df.layer >= 0) & (df.op == "adam")]
    adam = adam[adam.layer < adam.layer.max()]  # the head unit (last index) is not a decoder layer
    return params_per_layer / (adam.dur_ms.median() / 1e3)


def predict(row: dict, hardware, pin_store: bool | None = None) -> dict:
    """Plan the setting of one measured row; predicted step ms, model TFLOPS (benchmark formula), GiB."""
    cfg = qwen_config(row["shape"], layers=row["layers"], seq=row["seq"])
    pin = bool(row.get("pin_store")) if pin_store is None else pin_store
    p = plan(cfg, batch=row["batch"], seq=row["seq"], hardware=hardware, weight_slots=row.get("slots", 2),
             checkpoint_every=row.get("checkpoint_every"), overlap_optimizer=row.get("overlap", True),
             pin_store=pin)
    return {"step_ms": p.step_ms, "tflops": 6 * row["params"] * row["tokens"] / p.step_ms / 1e9,
            "gpu_gib": sum(p.device_bytes.values()) / _GIB, "reserve_gib": p.device_bytes["reserve"] / _GIB,
            "recomputed": p.recomputed_layers, "bottleneck": p.bottleneck,
            "n_params": p.shape["n_params"]}


def err(pred: float, meas: float) -> str:
    return f"{(pred - meas) / meas * 100:+.1f}%"


def main(argv=None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--results", default=str(RESULTS), help="JSON lines written by bench/throughput.py")
    ap.add_argument("--shape", default="3b", help="which shape's rows to compare")
    a = ap.parse_args(argv)
    rows = [json.loads(line) for line in Path(a.results).read_text().splitlines() if line.strip()]
    rows = [r for r in rows if r["shape"] == a.shape and r.get("checkpoint_every") is None]
    if not rows:
        raise SystemExit(f"no {a.shape!r} rows without checkpoint_every in {a.results}")
    P = model_shape(qwen_config(a.shape, layers=rows[0]["layers"]))["params_per_layer"]
    # the measured rate already includes the refresh cast: make the planner's own cast free
    fitted = dataclasses.replace(H200, host_adam_params_per_s=measured_adam_rate(TRACE_B1, P),
                                 host_cast_elems_per_s=1e15)
    out = []
    print(f"## {a.shape} shape on {rows[0]['gpu']}: planner (settings as run) vs measured "
          f"({Path(a.results).name})\n")
    print("| batch × seq | step ms pred | meas | err | model TFLOPS pred | meas | err "
          "| peak GPU GiB pred | meas | err | recomputed pred / meas | predicted bound |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        p = predict(r, H200)
        assert p["n_params"] == r["params"], (p["n_params"], r["params"])  # same model as the run
        m_ms = r["step_s"] * 1e3
        print(f"| {r['batch']} × {r['seq']} | {p['step_ms']:.0f} | {m_ms:.0f} | {err(p['step_ms'], m_ms)} "
              f"| {p['tflops']:.1f} | {r['model_tflops']:.1f} | {err(p['tflops'], r['model_tflops'])} "
              f"| {p['gpu_gib']:.1f} | {r['peak_gpu_gib']:.1f} | {err(p['gpu_gib'], r['peak_gpu_gib'])} "
              f"| {p['recomputed']} / {r['recomputed_layers']} | {p['bottleneck']} |")
        out.append({"batch": r["batch"], "seq": r["seq"], "measured_step_ms": m_ms, "pred": p,
                    "measured_tflops": r["model_tflops"], "measured_gpu_gib": r["peak_gpu_gib"]})
    print(f"\nPeak GPU 'pred' includes the planner's {out[0]['pred']['reserve_gib']:.0f} GiB reserve "
          "(CUDA context, workspaces, slack); max_memory_allocated counts no context.\n")
    print(f"## Step time (ms) under three planner variants; host AdamW rate "
          f"{H200.host_adam_params_per_s / 1e9:.2f} G params/s (H200 profile) vs "
          f"{fitted.host_adam_params_per_s / 1e9:.2f} G params/s (measured, batch-1 trace)\n")
    print("| batch × seq | measured | without pin_store (packing) | err | as run | err "
          "| + measured AdamW rate (fitted) | err |")
    print("|---|---|---|---|---|---|---|---|")
    for r, o in zip(rows, out):
        m_ms = o["measured_step_ms"]
        ship, fit = predict(r, H200, pin_store=False), predict(r, fitted)
        o.update(shipped=ship, fitted=fit)
        print(f"| {r['batch']} × {r['seq']} | {m_ms:.0f} | {ship['step_ms']:.0f} | {err(ship['step_ms'], m_ms)} "
              f"| {o['pred']['step_ms']:.0f} | {err(o['pred']['step_ms'], m_ms)} "
              f"| {fit['step_ms']:.0f} | {err(fit['step_ms'], m_ms)} |")
    return out


if __name__ == "__main__":
    main()
