"""The planner's steady step against measured H200 rows, per placement (host, auto, stream).

Runs anywhere (the planner is arithmetic plus a small simulation):
    python bench/planner_placement.py [--results bench/results/h200-2026-12-01-placement.jsonl]
Each bench/throughput.py row is re-planned with the settings it ran with (shape, batch, seq, weight
slots, cast_on_device, placement) on the `H200` profile; for "auto" the planner makes its own choice
of resident units, printed beside the engine's. The error is planner / measured - 1.
Rows record the state slots they streamed through (`state_slots`, since 78fd0e9); those without
ran with two, and the planner models what each row ran with. Rows that record the host's AdamW rate inside
their steps (`host_adam_G_params_per_s`, from 2026-12-02) are planned with it: the H200 profile's
is the rate alone (3.48 G params/s), and `stream` steps ran it at 1.1-2.7. Rows with `streamed_head` (from
2026-12-02) streamed the tied head group too (Note: [Streamed head]), and count it in `streamed_units`.
bench/peers.py rows of megatrain_nb (``system`` megatrain-*) are planned with the defaults they ran with on CUDA
(placement from their settings, "auto" when unset; the planner makes the activation, lean and split choices);
the later ones record their host AdamW rate too.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, os.path.dirname(__file__))
from shapes import bench_config  # noqa: E402

from megatrain_nb.machine.planner import H200, plan  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent


def _lean(r: dict) -> bool | None:
    """The row's lean activations: what it ran with, None (the engine's choice) for a peers row, off before they were."""
    v = r.get("lean_activations", False)
    return None if v is None else bool(v)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--results", default=str(ROOT / "bench" / "results" / "h200-2026-12-01-placement.jsonl"))
    a = ap.parse_args(argv)
    from megatrain_nb.machine import placement as placing

    rows = [json.loads(line) for line in Path(a.results).read_text().splitlines() if line.strip()]
    print("| run | shape | batch | placement | measured s | planner s | error | resident (engine / planner) |")
    print("|---|---|---|---|---|---|---|---|")
    errors = []
    for r in rows:
        if str(r.get("system", "")).startswith("megatrain") and r.get("status") == "ok":  # a bench/peers.py row:
            r = dict(r, placement=r["settings"].get("placement") or "auto", slots=None, cast_on_device=True,
                     pin_store=False, lean_activations=None, split_master=None)  # the defaults on CUDA it ran with
        if "placement" not in r:
            continue
        cfg = bench_config(r["shape"], layers=r["layers"], seq=r["seq"])
        ran = r.get("state_slots", 2)  # rows from before throughput.py recorded it streamed through two
        placing.state_slots = lambda n, *_, k=ran: 0 if not n else k
        placement = r["placement"]
        if placement == "stream" and r.get("streamed_units") is not None:  # the share the engine measured its way to
            L = cfg.num_hidden_layers  # the head group streamed: counted in streamed_units (s9 on)
            head = ((L, -1) if cfg.tie_word_embeddings else (L,)) if r.get("streamed_head") else ()
            placement = dict.fromkeys([*range(r["streamed_units"] - len(head)), *head], "device")
        rate = r.get("host_adam_G_params_per_s")  # the host's AdamW in the row's own steps (throughput.py, since s8)
        hw = H200 if not rate else dataclasses.replace(H200, host_adam_params_per_s=rate * 1e9)
        p = plan(cfg, batch=r["batch"], seq=r["seq"], hardware=hw, weight_slots=r.get("slots", 2),
                 cast_on_device=bool(r.get("cast_on_device")), pin_store=bool(r.get("pin_store")),
                 placement=placement, lean_activations=_lean(r),
                 split_master=r.get("split_master", False))  # rows without the field: fp32 masters
        got, want = p.steady_step_ms / 1e3, r["step_s"]
        err = got / want - 1
        errors.append(abs(err))
        resident = sum(v == "resident" for v in p.placement.values())
        print(f"| {r.get('run', '')} | {r['shape']} | {r['batch']} | {r['placement']} | {want:.3f} | {got:.3f} | "
              f"{err:+.1%} | {r.get('resident_units', '?')} / {resident} |")
    if errors:
        print(f"\n{sum(e <= 0.10 for e in errors)} of {len(errors)} rows within 10%; largest error {max(errors):.1%}")


if __name__ == "__main__":
    main()
