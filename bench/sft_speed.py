"""Fine-tuning speed: what packing with document masking costs per step, and evaluation's tokens/s.

Run on the GPU machine, e.g.:
    python bench/sft_speed.py --shape 3b --batch 4 8 --seq 4096 --steps 3 --out bench/results/MACHINE-DATE-fine-tuning.jsonl
One JSON line per (batch, mode), then one summary line per batch. Modes, all on the same tokens
(random ids of a Qwen2.5-shaped random model; no download):
  unpacked  one sequence per row: plain causal attention (sdpa's flash kernel);
  packed    the same rows cut into examples of random lengths (--doc-min..--doc-max tokens) with
            position_ids restarting per example: the session's document masking (varlen on CUDA
            when available; packing.py, Note: [Document masking]);
  packed_hf the packed rows through transformers' own block-diagonal masks (sdpa with a mask),
            what the varlen path replaces;
  eval      Session.evaluate over the unpacked rows (forward only).
Summary: packing_overhead = packed step / unpacked step - 1 (target <= 0.05), and
eval_speedup = eval tokens/s / unpacked training tokens/s (target >= 2.5).
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(__file__))
from rows import emit  # noqa: E402
from shapes import qwen_config  # noqa: E402

from megatrain_nb import Session  # noqa: E402
from megatrain_nb.data.packing import VARLEN  # noqa: E402


def packed(batch: dict, lo: int, hi: int, seed: int) -> dict:
    """The same ids cut into examples of lengths in [lo, hi]: positions restart, first labels -100."""
    g = torch.Generator().manual_seed(seed)
    B, T = batch["input_ids"].shape
    pos = torch.empty(B, T, dtype=torch.long)
    labels = batch["labels"].clone()
    for r in range(B):
        t = 0
        while t < T:
            n = min(int(torch.randint(lo, hi + 1, (1,), generator=g)), T - t)
            pos[r, t:t + n] = torch.arange(n)
            labels[r, t] = -100
            t += n
    return {"input_ids": batch["input_ids"], "labels": labels, "position_ids": pos}


def time_steps(s: Session, batch: dict, steps: int, warmup: int = 1) -> float:
    for _ in range(warmup):  # the activation policy and placement for this shape
        s.step(batch)
    times = [s.step(batch).seconds for _ in range(steps)]
    return statistics.median(times)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", default="3b")
    ap.add_argument("--layers", type=int, default=None)
    ap.add_argument("--batch", type=int, nargs="+", default=[4, 8])
    ap.add_argument("--seq", type=int, default=4096)
    ap.add_argument("--steps", type=int, default=3, help="timed steps per mode, after its warm-up steps")
    ap.add_argument("--doc-min", type=int, default=256)
    ap.add_argument("--doc-max", type=int, default=2048)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--placement", default="auto", help="EngineConfig.placement ('auto' settles in 5 steps)")
    ap.add_argument("--out", default=None, help="append JSON lines here")
    a = ap.parse_args(argv)

    cfg = qwen_config(a.shape, layers=a.layers, seq=a.seq)
    s = Session.from_config(cfg, device=a.device, lr=1e-5, trace=False, placement=a.placement)
    impl = s.arch.config._attn_implementation
    base = dict(bench="sft_speed", shape=a.shape, layers=cfg.num_hidden_layers, seq=a.seq, device=a.device,
                attention=impl, torch=torch.__version__, gpu=torch.cuda.get_device_name() if a.device == "cuda" else None)
    try:
        for B in a.batch:
            g = torch.Generator().manual_seed(B)
            ids = torch.randint(0, cfg.vocab_size, (B, a.seq), generator=g)
            plain = {"input_ids": ids, "labels": ids.clone()}
            pk = packed(plain, a.doc_min, a.doc_max, seed=B)
            n_docs = int((pk["position_ids"] == 0).sum())
            tokens = B * a.seq
            res = {}
            for mode, batch in (("unpacked", plain), ("packed", pk), ("packed_hf", pk)):
                if mode == "packed_hf":
                    if impl != VARLEN:
                        continue  # the packed row already used transformers' masks
                    s.arch.config._attn_implementation = "sdpa"
                dt = time_steps(s, batch, a.steps, warmup=6 if mode == "unpacked" else 1)
                s.arch.config._attn_implementation = impl
                res[mode] = dt
                emit({**base, "batch": B, "mode": mode, "examples": n_docs if mode != "unpacked" else B,
                      "step_s": round(dt, 4), "tokens_per_s": round(tokens / dt)}, a.out)
            s.evaluate([plain])  # warm-up
            t0 = time.perf_counter()
            s.evaluate([plain] * a.steps)
            ev = (time.perf_counter() - t0) / a.steps
            emit({**base, "batch": B, "mode": "eval", "step_s": round(ev, 4), "tokens_per_s": round(tokens / ev)}, a.out)
            summary = {**base, "batch": B, "mode": "summary",
                       "packing_overhead": round(res["packed"] / res["unpacked"] - 1, 4),
                       "eval_speedup": round(res["unpacked"] / ev, 3)}
            if "packed_hf" in res:
                summary["hf_mask_overhead"] = round(res["packed_hf"] / res["unpacked"] - 1, 4)
            emit(summary, a.out)
    finally:
        s.close()


if __name__ == "__main__":
    main()
