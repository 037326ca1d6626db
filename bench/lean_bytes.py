"""Activation bytes per token that one decoder layer keeps for its backward: lean vs Hugging Face's forwards.

Run (CPU is enough: bytes, not times):
    python bench/lean_bytes.py                      # Qwen2.5-3B and 7B shapes, bf16, 64 tokens
    python bench/lean_bytes.py --shapes tiny --tokens 32 --dtype float32
    python bench/lean_bytes.py --plan 8 4096        # also the planner's H200 prediction at batch 8 x seq 4096
One layer at full width with random weights, counted with ``torch.autograd.graph.saved_tensors_hooks``
(``lean.layer_bytes_per_token``: unique storages; weights and the shared rotary cos/sin left out),
beside the planner's estimate (``planner.act_bytes_per_token``, Note: [Activation estimate]) and the
saving its formula predicts (8*hidden + 2*d*intermediate; the measured saving is 8 bytes more: the two
norms' fp32 1/rms). ``--plan B T``: ``planner.plan`` on the H200 profile (cast_on_device, placement
"host") with lean off and on: recomputed layers and predicted step (a prediction, not a measurement).
"""
from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))
from shapes import qwen_config  # noqa: E402

from megatrain_nb.step.lean import layer_bytes_per_token  # noqa: E402
from megatrain_nb.machine.planner import act_bytes_per_token, model_shape, plan  # noqa: E402


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", nargs="+", default=["3b", "7b"])
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--plan", nargs=2, type=int, metavar=("BATCH", "SEQ"))
    a = ap.parse_args(argv)
    dtype = getattr(torch, a.dtype)
    d = dtype.itemsize
    print(f"bytes per token of one decoder layer ({a.dtype}, {a.tokens} tokens, CPU, saved_tensors_hooks)")
    print(f"{'shape':<6} {'HF':>9} {'lean':>9} {'saved':>9} {'formula':>9} {'est HF':>9} {'est lean':>9} {'lean/HF':>8}")
    for name in a.shapes:
        cfg = qwen_config(name, layers=1, seq=a.tokens)
        s = model_shape(cfg)
        hf = layer_bytes_per_token(cfg, lean=False, tokens=a.tokens, dtype=dtype)
        lean = layer_bytes_per_token(cfg, lean=True, tokens=a.tokens, dtype=dtype)
        formula = 8 * s["hidden"] + 2 * d * s["intermediate"]
        print(f"{name:<6} {hf:>9.0f} {lean:>9.0f} {hf - lean:>9.0f} {formula:>9d} "
              f"{act_bytes_per_token(s, d, lean=False):>9d} {act_bytes_per_token(s, d, lean=True):>9d} "
              f"{lean / hf:>8.3f}")
    if a.plan:
        B, T = a.plan
        print(f"planner, H200 profile, {B} x {T} tokens, bf16 (predicted)")
        for name in a.shapes:
            for on in (False, True):
                p = plan(qwen_config(name, seq=T), batch=B, seq=T, cast_on_device=True, lean_activations=on)
                print(f"{name:<6} lean={on!s:<5} recomputed {p.recomputed_layers:>2} of {len(p.keep)}, "
                      f"{p.device_bytes['activations_kept'] / max(1, p.kept_layers) / 2**30:.2f} GiB per kept layer, "
                      f"steady step {p.steady_step_ms / 1e3:.2f} s, {p.model_tflops:.0f} model TFLOPS")


if __name__ == "__main__":
    main()
