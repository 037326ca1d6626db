"""What one MoE experts module's forward and backward take on the GPU, by implementation and by kernel.

An experts module of the shape's width (gpt-oss-20b's by default: 32 experts of 2880 -> 2 x 2880 -> 2880, biases,
the clamped gate) in bf16, a step's tokens routed uniformly at random to top_k experts. Each implementation
(transformers' "grouped_mm" and ours, ``megatrain_nb/model/experts.py``) runs forward, then backward from one fixed
output gradient; the medians of ``--repeats`` timed runs after two untimed, by CUDA events; outputs and gradients
are compared against the first implementation's; ``--profile`` prints each one's kernels by device time. One
JSON row per implementation.

Run from the repository root on a GPU, e.g. (gpt-oss-20b's experts, a step of 8 x 4096 tokens):
    python bench/experts_cost.py --shape gpt-oss-20b --tokens 32768 --profile --rows bench/results/DATE-experts.jsonl
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))
from rows import emit  # noqa: E402
from shapes import gpt_oss_config  # noqa: E402

from megatrain_nb.model import experts  # noqa: E402


def _module(cfg, device, dtype):
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssExperts

    torch.manual_seed(0)
    m = GptOssExperts(cfg).to(device=device, dtype=dtype)
    with torch.no_grad():
        for p in m.parameters():
            p.normal_(0, 0.02)
    return m


def _run(m, impl, x, idx, w, dy):
    m.config._experts_implementation = impl
    for p in m.parameters():
        p.grad = None
    x.grad = None
    y = m(x, idx, w)
    y.backward(dy)
    return y


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", default="gpt-oss-20b", help="a gpt-oss shape of bench/shapes.py (default: %(default)s)")
    ap.add_argument("--tokens", type=int, default=32768, help="a step's tokens (default: %(default)s, 8 x 4096)")
    ap.add_argument("--repeats", type=int, default=5, help="timed runs per implementation (default: %(default)s)")
    ap.add_argument("--impl", nargs="+", default=["grouped_mm", experts.NAME],
                    help="implementations, the first the reference (default: %(default)s)")
    ap.add_argument("--profile", action="store_true", help="print each implementation's kernels by device time")
    ap.add_argument("--rows", default=None, help="append each implementation's JSON row here (bench/rows.py)")
    a = ap.parse_args(argv)
    if not torch.cuda.is_available():
        ap.error("this measures CUDA kernels: run it on a GPU")
    experts.register()
    dev, dt = torch.device("cuda"), torch.bfloat16
    cfg = gpt_oss_config(a.shape, layers=1)
    m = _module(cfg, dev, dt)
    g = torch.Generator(device=dev).manual_seed(1)
    T, E, k, H = a.tokens, cfg.num_local_experts, cfg.num_experts_per_tok, cfg.hidden_size
    x = torch.randn(T, H, device=dev, dtype=dt, generator=g).requires_grad_()
    logits = torch.randn(T, E, device=dev, generator=g)
    top, idx = logits.topk(k, dim=-1)
    w = torch.softmax(top, dim=-1).to(dt)
    dy = torch.randn(T, H, device=dev, dtype=dt, generator=g)
    ref = None
    for impl in a.impl:
        for _ in range(2):
            _run(m, impl, x, idx, w, dy)
        fwd, bwd = [], []
        for _ in range(a.repeats):
            for p in m.parameters():
                p.grad = None
            x.grad = None
            m.config._experts_implementation = impl
            e = [torch.cuda.Event(enable_timing=True) for _ in range(3)]
            e[0].record()
            y = m(x, idx, w)
            e[1].record()
            y.backward(dy)
            e[2].record()
            torch.cuda.synchronize()  # the events' times are read on the host
            fwd.append(e[0].elapsed_time(e[1]))
            bwd.append(e[1].elapsed_time(e[2]))
        grads = {"x": x.grad.float(), **{n: p.grad.float() for n, p in m.named_parameters()}}
        row = {"impl": impl, "shape": a.shape, "tokens": T, "top_k": k, "experts": E,
               "fwd_ms": round(statistics.median(fwd), 3), "bwd_ms": round(statistics.median(bwd), 3),
               "gpu": torch.cuda.get_device_name()}
        if ref is None:
            ref = (y.float(), grads)
        else:
            row["out_max_rel"] = float((y.float() - ref[0]).abs().max() / ref[0].abs().max())
            row["grad_max_rel"] = {n: float((gr - ref[1][n]).abs().max() / ref[1][n].abs().max())
                                   for n, gr in grads.items()}
        print(f"{impl:>24}: forward {row['fwd_ms']:.2f} ms, backward {row['bwd_ms']:.2f} ms"
              + (f", out rel {row['out_max_rel']:.1e}, grads rel max {max(row['grad_max_rel'].values()):.1e}"
                 if "out_max_rel" in row else ""), flush=True)
        if a.profile:
            from torch.profiler import ProfilerActivity, profile

            with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                _run(m, impl, x, idx, w, dy)
                torch.cuda.synchronize()  # the profile closes on finished kernels
            print(prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=22), flush=True)
        if a.rows:
            emit(row, a.rows)


if __name__ == "__main__":
    main()
