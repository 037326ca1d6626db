"""Device bytes of one decoder layer's forward and backward at long context, measured beside the estimates
the engine places checkpoints and cached attention outputs with (``longcontext.layer_bytes``).

    python bench/layer_memory.py --seq 64k 128k --backends cudnn flash      # on the H200 (~1 minute)
    python bench/layer_memory.py --device cpu --shape tiny --seq 256         # the rows' schema, no meaning
    python bench/layer_memory.py --results bench/results/h200-2026-12-01-layer-memory.jsonl  # measured rows
                                                                             # against today's estimates

One layer of the shape at full width, random weights in the compute dtype, tiled as the engine tiles it
(``tiling.SequenceTiling``, 16K rows) and run under the named SDPA kernel, one sequence:
Bytes in the rows (``est_*``: the estimates); GiB on stderr.
  act        allocator bytes the forward leaves (its saved set and its output) — estimate ``act``;
  transient  the backward's peak above that, less the weights' gradients (the engine writes those into
             its gradient slot) — estimate ``transient`` less the next parked input fetched ahead (one
             layer alone fetches none);
  cache      what ``attncache.AttentionCache`` keeps of the layer's attention — estimate ``cache``;
  act_cached the forward of the recompute of a cached layer (no second attention output) — ``act`` -
             ``attn_out``.
On the CPU the allocator counts nothing: the rows carry the estimates and the cache bytes only.
"""
from __future__ import annotations

import argparse
import contextlib
import os
import sys

import torch

sys.path[:0] = [os.path.dirname(os.path.abspath(__file__)), os.path.dirname(os.path.dirname(os.path.abspath(__file__)))]
from long_context import tokens  # noqa: E402
from rows import emit  # noqa: E402
from shapes import qwen_config  # noqa: E402

from megatrain_nb.step.attncache import AttentionCache  # noqa: E402
from megatrain_nb.model.binding import call  # noqa: E402
from megatrain_nb.model.hf import load_architecture  # noqa: E402
from megatrain_nb.machine.longcontext import layer_bytes  # noqa: E402
from megatrain_nb.machine.shape import act_bytes_per_token, model_shape  # noqa: E402
from megatrain_nb.step.tiling import SequenceTiling, _kernel  # noqa: E402

_GIB = 1 << 30


def allocated(dev) -> int:
    return torch.cuda.memory_allocated(dev) if dev.type == "cuda" else 0


def measure(cfg, T: int, backend: str | None, dev: torch.device, dtype: torch.dtype, rows: int) -> dict:
    arch = load_architecture(cfg)
    tiler = SequenceTiling(arch, tile_tokens=rows, attention_backend=backend, device=dev, dtype_bytes=dtype.itemsize)
    tiler.prepare([{"input_ids": torch.zeros(1, T, dtype=torch.long), "attention_mask": None}])
    t = arch.templates[0]
    g = torch.Generator().manual_seed(0)
    params = {n: (torch.randn(p.shape, generator=g) * 0.02).to(dev, dtype).requires_grad_() for n, p in t.named_parameters()}
    x = (torch.randn(1, T, cfg.hidden_size, generator=g) * 0.5).to(dev, dtype)
    with torch.no_grad():
        h0, calls = arch.prelude(x, None)
    args, kwargs = calls[0]
    wgrad = sum(p.numel() * p.element_size() for p in params.values())
    cache = AttentionCache()
    out = {}
    with tiler.attention():
        for cached in (False, True):
            xi = h0.detach().requires_grad_()
            if cached:
                with torch.no_grad(), cache.capture(0, 0):
                    call(t, {n: p.detach() for n, p in params.items()}, xi.detach(), *args, **kwargs)
                out["cache"] = cache.nbytes
            base = allocated(dev)
            with torch.enable_grad(), (cache.replay(0, 0) if cached else contextlib.nullcontext()):
                y = call(t, params, xi, *args, **kwargs)
            act = allocated(dev) - base
            if dev.type == "cuda":
                torch.cuda.synchronize(dev)
                torch.cuda.reset_peak_memory_stats(dev)
            before = allocated(dev)
            y.backward(torch.randn_like(y))
            peak = torch.cuda.max_memory_allocated(dev) if dev.type == "cuda" else 0
            out["act_cached" if cached else "act"] = act
            out["transient_cached" if cached else "transient"] = max(0, peak - before - wgrad) if peak else 0
            del y, xi
            for p in params.values():
                p.grad = None
    return out


def estimates(shape: str, T: int, rows: int, d: int) -> dict:
    """``longcontext``'s estimates of what ``measure`` measures (the layer alone fetches no parked input)."""
    s = model_shape(qwen_config(shape, layers=1, seq=T))
    est = layer_bytes(s, T, d, rows, act_bytes_per_token(s, d, lean=False), seq=T)
    return dict(est_act=est["act"], est_act_cached=est["act"] - est["attn_out"],
                est_transient=est["transient"] - T * s["hidden"] * d, est_cache=est["cache"])


def show(row: dict) -> None:
    print(f"  {row['seq'] // 1024}K {row['backend']}: " + ", ".join(
        f"{k} {row[k] / _GIB:.2f} / est {row['est_' + k] / _GIB:.2f} GiB" for k in ("act", "act_cached", "transient", "cache")
        if k in row), file=sys.stderr)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", default="7b")
    ap.add_argument("--seq", type=tokens, nargs="+", default=[tokens("64k")])
    ap.add_argument("--backends", nargs="+", default=["cudnn", "flash", "efficient"])
    ap.add_argument("--rows", type=int, default=16384, help="rows per tile (tiling.AUTO_ROWS)")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--out", default=None)
    ap.add_argument("--results", default=None, help="re-estimate the measured rows of this file with today's "
                    "longcontext (no device): measured / estimate per row")
    a = ap.parse_args(argv)
    if a.results:
        import json
        for line in open(a.results):
            row = json.loads(line)
            if row.get("status") == "ok" and row.get("device", "").startswith("cuda"):
                show({**row, **estimates(row["shape"], row["seq"], row["rows"], 2)})
        return
    dev = torch.device(a.device)
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    d = dtype.itemsize
    for T in a.seq:
        cfg = qwen_config(a.shape, layers=1, seq=T)
        rows = a.rows if T > a.rows else 0
        for backend in (a.backends if dev.type == "cuda" else [None]):
            try:
                with _kernel(backend) if backend else contextlib.nullcontext():
                    got = measure(cfg, T, backend, dev, dtype, rows)
                status = "ok"
            except (RuntimeError, torch.OutOfMemoryError) as e:
                got, status = {}, f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
            row = dict(shape=a.shape, seq=T, backend=backend, rows=rows, status=status, device=str(dev),
                       gpu=torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu",
                       **got, **estimates(a.shape, T, rows, d))
            emit(row, a.out)
            show(row)
            if dev.type == "cuda":
                torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
