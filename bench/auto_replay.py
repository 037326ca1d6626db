"""`auto`'s choice replayed: each recorded row's measuring-step inputs through today's ``placement.Search``.

Runs anywhere (the planner is arithmetic plus a small simulation):
    python bench/auto_replay.py bench/results/h100-2026-12-06-defaults.jsonl [--margin 0.02]
Rows of ``bench/throughput.py`` record what `auto`'s measuring step handed the choice (``placement_inputs``:
each candidate's GiB for residents, the layers the activation policy kept, the host's AdamW rate). Given those,
the shape, the batch, the card's memory (or the row's ``device_memory``) and the settings the row ran with, this
prints the planner's prediction per candidate and what ``Search.planned`` picks now, beside what the row
recorded and measured: a change to the planner or to the search shows here, row by row, before a GPU runs it.
Rows without ``placement_inputs`` (before 2026-12-06), or whose search stopped before predicting, are skipped.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(__file__))
from shapes import bench_config  # noqa: E402

from megatrain_nb.config import EngineConfig  # noqa: E402
from megatrain_nb.machine import autoplan  # noqa: E402
from megatrain_nb.machine import placement as placing  # noqa: E402
from megatrain_nb.machine.planner import model_shape  # noqa: E402

CARD_BYTES = {"H100": 81559 << 20, "H200": 143771 << 20}  # total_memory as nvidia-smi reports each card
SETTINGS = ("cast_on_device", "pin_store", "lean_activations", "offload_checkpoints", "optimizer_state",
            "split_master", "checkpoint_every")  # what a row records that the planner reads


def card_bytes(row: dict) -> int:
    """The device bytes the row's engine planned with: its ``device_memory`` budget, else its card's memory."""
    if row.get("device_memory"):
        from megatrain_nb.machine.budget import parse_bytes
        return parse_bytes(row["device_memory"], "device_memory")
    for name, total in CARD_BYTES.items():
        if name in (row.get("gpu") or row.get("machine") or ""):
            return total
    raise ValueError(f"row of {row.get('gpu') or row.get('machine')!r}: not a card this replay knows "
                     f"({', '.join(CARD_BYTES)}); add its memory to CARD_BYTES")


def replay(row: dict) -> placing.Search | None:
    """The search ``row``'s inputs make today, planned; None where the row recorded no inputs to replay."""
    inputs = row.get("placement_inputs") or {}
    free = inputs.get("free_gib") or {}
    if "A" not in free or "B" not in free or not inputs.get("host_adam_G_params_per_s"):
        return None
    cfg = bench_config(row["shape"], layers=row.get("layers"))
    s = model_shape(cfg)
    L = s["layers"]
    numel = {-1: s["embed_params"], L: s["head_params"], **dict.fromkeys(range(L), s["params_per_layer"])}
    rate = inputs["host_adam_G_params_per_s"] * 1e9
    settings = autoplan.plan_settings(EngineConfig(), None)
    settings.update({k: row[k] for k in SETTINGS if k in row and k in settings})
    predict = autoplan.predictor(cfg, batch=row["batch"], seq=row["seq"], numel=numel, dtype_bytes=2, tied=s["tied"],
                                 hardware=autoplan.calibrated(device_bytes=card_bytes(row), adam_params_per_s=rate),
                                 settings=settings)
    free_a = int(free["A"] * 2**30)
    resident = {u for u, c in placing.choose(numel, mode="auto", free_bytes=free_a, dtype_bytes=2, tied=s["tied"],
                                             cuda=True).items() if c.placement == "resident"}
    search = placing.Search()
    search.measured(free=free_a, keep=[True] * inputs["kept_layers"] + [False], layer_bytes=0, checkpoint_bytes=0,
                    everything_fits=False, adam_rate=rate,
                    head=placing.head_groups(numel, resident, dtype_bytes=2, tied=s["tied"], adam_params_per_s=rate))
    search.free["B"] = int(free["B"] * 2**30)  # as the row measured it (``measured`` derives it from the step)
    search.planned(predict)
    search.residents = {c: sum(ch.placement == "resident" for ch in placing.choose(
        numel, mode="auto", free_bytes=b, dtype_bytes=2, tied=s["tied"], cuda=True).values()) for c, b in search.free.items()}
    return search


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("results", nargs="+", help="bench/throughput.py rows (JSON lines)")
    ap.add_argument("--margin", type=float, default=None, help=f"placement.MARGIN for the replay (default {placing.MARGIN})")
    a = ap.parse_args(argv)
    if a.margin is not None:
        placing.MARGIN = a.margin
    for path in a.results:
        with open(path) as f:
            rows = [json.loads(line) for line in f if line.strip()]
        for row in rows:
            search = replay(row)
            if search is None:
                continue
            print(f"{os.path.basename(path)} {row.get('code')} {row['shape']} x {row['batch']}: recorded "
                  f"{row.get('resident_units')} residents, {row.get('model_tflops')} model TFLOPS")
            print(f"  then: {row.get('placement_search')}")
            print(f"  now:  {search.summary()}; residents " +
                  ", ".join(f"{c} {search.residents[c]}" for c in search.ORDER if c in search.residents))


if __name__ == "__main__":
    main()
