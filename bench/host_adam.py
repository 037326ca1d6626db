"""How fast is the host's AdamW: every variant on one unit of --numel parameters, side by side in one process.

Run on the GPU machine's host (or anywhere):
    python bench/host_adam.py --numel 67108864 --reps 5 --threads 16 --out out/host_adam.jsonl
One JSON line per variant (rows.emit): G params/s (median of --reps after one warm-up) and the ratio to torch's
fused fp32 AdamW with fp32 grads measured in the same run (``fp32_fused``):
- fp32: torch's fused CPU AdamW as the engine's worker runs it (HostAdamW.update): fp32 grads, and bf16 grads
  upcast in chunks of --chunks elements (the largest is the whole slab: the upcast goes through DRAM);
  then subnormal moments with flush-to-zero off and on (``torch.set_flush_denormal``).
- ours: compact_host.update_host, int8 and int4 moments, bf16 grads (the C kernel; torch ops where none builds).
- torchao AdamW8bit / AdamW4bit's step on CPU tensors: eager ``single_param_adam`` and, unless --no-compile,
  the same under torch.compile as torchao runs it (timed after the warm-up compiles it).
- bitsandbytes' AdamW8bit (blockwise) on a CPU parameter.
A library that is not installed, or fails here, gets a row saying why instead of a rate.
"""
from __future__ import annotations

import argparse
import statistics
import time
import types

import torch

from rows import emit  # bench/ is on sys.path when this runs as a script

from megatrain_nb.host import compact_host as ch
from megatrain_nb.host import compact_state as cs
from megatrain_nb.config import OptimConfig
from megatrain_nb.host.optim import HostAdamW

LR, BETAS, EPS, WD = 1e-5, (0.9, 0.999), 1e-8, 0.01


def timed(fn, reps: int) -> float:
    """Median seconds of ``fn()`` over ``reps`` calls after one warm-up call."""
    fn()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def stand_in_store(n: int, grad_dtype: torch.dtype, moment: float = 0.0):
    """A HostStore stand-in with one unit of ``n`` elements (random master, small gradients of ``grad_dtype``)."""
    unit = types.SimpleNamespace(master=torch.randn(n) * 0.02, grad=torch.randn(n).to(grad_dtype) * 1e-3,
                                 exp_avg=torch.full((n,), moment), exp_avg_sq=torch.full((n,), moment),
                                 compact=None)  # fp32 moments
    return types.SimpleNamespace(units={0: unit}, step_count=lambda u: torch.zeros(()))


def fp32_variant(n: int, grad_dtype: torch.dtype, chunk: int, moment: float = 0.0):
    HostAdamW.chunk_numel = chunk
    store = stand_in_store(n, grad_dtype, moment)
    if moment:
        store.units[0].grad.zero_()  # moments decay, and stay subnormal over the reps
    opt = HostAdamW(store, OptimConfig(lr=LR))
    return lambda: opt.update(0, LR)


def ours(n: int, kind: str):
    lay = cs.layout_for(kind, [("w", 0, n)], keep=())
    p, g = torch.randn(n) * 0.02, (torch.randn(n) * 1e-3).bfloat16()
    m, v = torch.zeros(lay.words), torch.zeros(lay.words)
    step = torch.tensor(1.0)
    return lambda: ch.update_host(lay, p, g, m, v, lr=LR, betas=BETAS, eps=EPS, weight_decay=WD, step=step)


def torchao_step(n: int, bits: int, compiled: bool):
    from torchao.optim.adam import single_param_adam
    from torchao.optim.subclass_4bit import OptimState4bit
    from torchao.optim.subclass_8bit import OptimState8bit

    State, block = (OptimState8bit, 256) if bits == 8 else (OptimState4bit, 128)
    p, g = torch.randn(n) * 0.02, torch.randn(n) * 1e-3
    m, v = State.zeros(n, signed=True, block_size=block), State.zeros(n, signed=False, block_size=block)
    fn = torch.compile(single_param_adam, fullgraph=True, dynamic=False) if compiled else single_param_adam
    step, lr = torch.tensor(1.0), torch.tensor(LR)
    return lambda: fn(p, g, step, m, v, None, lr, BETAS[0], BETAS[1], WD, EPS, True, False)


def bnb_step(n: int):
    import bitsandbytes as bnb

    p = torch.nn.Parameter(torch.randn(n) * 0.02)
    p.grad = torch.randn(n) * 1e-3
    opt = bnb.optim.AdamW8bit([p], lr=LR, betas=BETAS, eps=EPS, weight_decay=WD, min_8bit_size=4096)
    return opt.step


def variants(a) -> list[tuple[str, str, object]]:
    """(variant, grads, a function building the step) in the order of the rows."""
    n = a.numel
    out = [("fp32_fused", "fp32", lambda: fp32_variant(n, torch.float32, 1 << 40))]
    out += [(f"fp32_fused_chunk_{c if c < n else 'whole'}", "bf16", lambda c=c: fp32_variant(n, torch.bfloat16, c))
            for c in a.chunks]
    out += [(f"fp32_subnormal_ftz_{'on' if ftz else 'off'}", "fp32",
             lambda ftz=ftz: (torch.set_flush_denormal(ftz), fp32_variant(n, torch.float32, 1 << 40, 1e-39))[1])
            for ftz in (False, True)]
    out += [(f"ours_{kind}", "bf16", lambda kind=kind: ours(n, kind)) for kind in cs.KINDS]
    for bits in (8, 4):
        out.append((f"torchao_adamw{bits}bit_eager", "fp32", lambda bits=bits: torchao_step(n, bits, False)))
        if a.compile:
            out.append((f"torchao_adamw{bits}bit_compiled", "fp32", lambda bits=bits: torchao_step(n, bits, True)))
    out.append(("bnb_adamw8bit", "fp32", lambda: bnb_step(n)))
    return out


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--numel", type=int, default=1 << 26, help="parameters of the unit (default 64M)")
    ap.add_argument("--chunks", type=int, nargs="+", default=[1 << 22, 1 << 40], help="bf16 grads' upcast chunks")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's)")
    ap.add_argument("--no-compile", dest="compile", action="store_false", help="skip torchao under torch.compile")
    ap.add_argument("--only", nargs="*", default=None, help="variant name prefixes to run (fp32_fused always runs)")
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    if a.threads:
        torch.set_num_threads(a.threads)
    base = None
    for name, grads, build in variants(a):
        if a.only is not None and name != "fp32_fused" and not any(name.startswith(o) for o in a.only):
            continue
        row = dict(bench="host_adam", variant=name, grads=grads, numel=a.numel, threads=torch.get_num_threads(),
                   torch=torch.__version__)
        try:
            t = timed(build(), a.reps)
        except Exception as e:  # noqa: BLE001 - a library missing or failing here is a row, not a crash
            row.update(gparams_per_s=None, error=f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}")
        else:
            rate = a.numel / t / 1e9
            base = rate if name == "fp32_fused" else base
            row.update(ms=round(t * 1e3, 2), gparams_per_s=round(rate, 3),
                       ratio_to_fp32_fused=round(rate / base, 3) if base else None)
        finally:
            torch.set_flush_denormal(False)
        emit(row, a.out)


if __name__ == "__main__":
    main()
