"""The host's AdamW over compact moments: a fused C kernel (``compact_kernel.c``), built at first use, called by ctypes.

Owns: building and loading the kernel (cached by source hash under ``$MEGATRAIN_CACHE`` or ~/.cache/megatrain_nb),
its lookup tables (the maps' thresholds, found exactly and checked against ``compact_state``'s rounding), and
``update_host``: ``compact_state.update_torch``'s step on CPU tensors, the kept spans by torch's fused AdamW after it.
Does not own: the schemes, the slab layout or the reference arithmetic (``compact_state.py``), the device's kernel
(``compact_cuda.py``), when updates run (``optim.py``).

Why our own kernel: on the H100 host (16 Xeon cores, 2026-12-02, ``bench/host_adam.py``) torch's fused fp32 AdamW ran
4.92 G params/s and this kernel 5.06 (int8) and 7.29 (int4); torchao's AdamW8bit / AdamW4bit on CPU tensors ran at
0.011x / 0.014x fp32's (eight dependent gathers a value, built for ``torch.compile`` on CUDA) and bitsandbytes'
0.50.2 CPU AdamW8bit at 0.031x (its update in torch ops). Each thread sets flush-to-zero and denormals-are-zero and
restores its float mode after (Note: [Subnormals] in denormals.py).
"""
from __future__ import annotations

import ctypes
import hashlib
import math
import os
import subprocess
import tempfile
import threading
import warnings
from pathlib import Path

import torch

from .compact_state import BITS, BLOCK, Layout, codes_of, fp32_spans, parts, qmaps, update_torch

_lib = None
_lib_lock = threading.Lock()
_warned_fallback = False  # one warning per process for host updates in torch ops
_tables: dict = {}


def _cache_dir() -> Path:
    root = os.environ.get("MEGATRAIN_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "megatrain_nb")
    return Path(root)


def kernel():
    """The compiled C kernel (ctypes library), built on first use; None where no C compiler works (the torch
    path then runs, with a warning)."""
    global _lib
    with _lib_lock:
        if _lib is None:
            _lib = _build() or False
        return _lib or None


def _build():
    src = Path(__file__).with_name("compact_kernel.c")
    code = src.read_bytes()
    tag = hashlib.sha256(code + os.uname().machine.encode()).hexdigest()[:16]
    out = _cache_dir() / f"compact_kernel_{tag}.so"
    if not out.exists():
        cc = os.environ.get("CC", "cc")
        out.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=out.parent) as tmp:
            obj = Path(tmp) / out.name
            cmd = [cc, "-O3", "-march=native", "-fno-math-errno", "-ffp-contract=off", "-fopenmp", "-shared", "-fPIC", "-o", str(obj), str(src), "-lm"]
            try:
                subprocess.run(cmd, check=True, capture_output=True, timeout=120)
            except (OSError, subprocess.SubprocessError) as e:
                global _warned_fallback
                _warned_fallback = True
                err = getattr(e, "stderr", b"") or b""
                warnings.warn(f"compact optimizer state: building the host kernel failed ({' '.join(cmd)}: "
                              f"{err.decode(errors='replace')[-300:] or e}); host updates use torch ops, several "
                              "times slower. Install a C compiler with OpenMP (gcc) or set CC.", stacklevel=3)
                return None
            os.replace(obj, out)  # atomic: other processes see a whole library or none
    lib = ctypes.CDLL(str(out))
    P, I64, F, I = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float, ctypes.c_int
    lib.adamw_compact.argtypes = [P, P, I, F, I64, P, P, P, P, I, I, P, P, P, P, P, P, P, I64, F, F, F, F, F, F, I]
    lib.adamw_compact.restype = None
    lib.table_layout.argtypes = [P]
    lib.table_layout.restype = I
    return lib


def _float_of_key(k: torch.Tensor) -> torch.Tensor:
    """fp32 of monotone int64 keys (the inverse of ``_key_of``)."""
    return torch.where(k < 0, k ^ 0x7FFFFFFF, k).to(torch.int32).view(torch.float32)


def _key_of(x: torch.Tensor) -> torch.Tensor:
    """int64 keys in the order of the fp32 values ``x`` (-0.0 just below +0.0)."""
    b = x.contiguous().view(torch.int32).long()
    return torch.where(b < 0, b ^ 0x7FFFFFFF, b)


def _thresholds(q: torch.Tensor) -> torch.Tensor:
    """(N - 1,) fp32: t[c] the least float in (q[c], q[c+1]] that ``codes_of`` sends to c + 1, found by
    bisection in float order; Note: [Code by threshold count] in compact_kernel.c."""
    lo, hi = _key_of(q[:-1]), _key_of(q[1:])  # the rule is false at q[c], true at q[c+1]
    half = (q[1:] - q[:-1]) * 0.5
    while bool((hi - lo > 1).any()):
        mid = (lo + hi) // 2
        up = (_float_of_key(mid) - q[:-1]) >= half
        hi, lo = torch.where(up, mid, hi), torch.where(up, lo, mid)
    t = _float_of_key(hi)
    codes = torch.arange(1, q.numel())
    if not (torch.equal(codes_of(t, q).long(), codes)
            and torch.equal(codes_of(torch.nextafter(t, torch.tensor(-math.inf)), q).long(), codes - 1)):
        raise RuntimeError("compact optimizer state: the map's thresholds disagree with codes_of")
    return t


def _bucket(x: torch.Tensor, lo: int, hi: int, half: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(bucket index, low key bits) of fp32 values ``x``, as compact_kernel.c's code_scalar computes them."""
    b = x.contiguous().view(torch.int32).long() & 0xFFFFFFFF
    neg = b >> 31
    k = (((b >> 16) & 0x7FFF) - (lo - 1)).clamp(0, hi - lo + 1) + neg * half
    low = torch.where(neg == 1, ~b, b) & 0xFFFF
    return k, low


def _bucket_table(q: torch.Tensor, t: torch.Tensor, lo: int, hi: int, half: int) -> torch.Tensor:
    """(2 * half,) int32 entries ``count << 17 | low`` (Note: [Code by threshold count] in compact_kernel.c),
    checked against ``codes_of`` on every threshold, its neighbours, the buckets' edges and random values."""
    kt, lowt = _bucket(t, lo, hi, half)
    edge = {0, hi - lo + 1, half, half + hi - lo + 1}  # shared buckets: no threshold may fall inside
    if len(set(kt.tolist())) != kt.numel() or edge & set(kt.tolist()):
        raise RuntimeError("compact optimizer state: a bucket of the code table holds two thresholds")
    h = torch.arange(lo - 1, hi + 1, dtype=torch.int64)  # bucket k's top 16 bits (k = 0 stands for all below lo)
    h[0] = 0
    first_pos = (h << 16).to(torch.int32).view(torch.float32)  # the least value of each positive bucket
    first_neg = ((h << 16) | 0x8000FFFF).to(torch.int32).view(torch.float32)  # and of each negative one
    first_neg[-1] = -math.inf
    first_neg[0] = -first_pos[1].item()  # bucket 0 spans -2^-23 .. 2^-23 over both halves
    first = torch.cat([first_pos, first_neg])
    count = torch.searchsorted(t, first, right=False)  # thresholds below each bucket
    low = torch.full((2 * half,), 0x10000, dtype=torch.int64)
    low[kt] = lowt
    tab = ((count << 17) | low).to(torch.int32)
    g = torch.Generator().manual_seed(0)
    probe = torch.cat([t, torch.nextafter(t, torch.tensor(-math.inf)), torch.nextafter(t, torch.tensor(math.inf)), q,
                       first_pos, first_neg[1:-1], torch.tensor([0.0, -0.0, 1.0, -1.0, 1e-30, -1e-30]),
                       torch.rand(4096, generator=g) * 2 - 1, torch.exp(-30 * torch.rand(4096, generator=g))])
    k, lw = _bucket(probe, lo, hi, half)
    e = tab[k].long() & 0xFFFFFFFF
    if not torch.equal((e >> 17) + (lw >= (e & 0x1FFFF)).long(), codes_of(probe, q).long()):
        raise RuntimeError("compact optimizer state: the code table disagrees with codes_of")
    return tab


def _table(kind: str) -> tuple:
    """((q, thresholds, table) of exp_avg's map, the same of exp_avg_sq's): the C kernel's inputs."""
    if kind not in _tables:
        layout = torch.zeros(3, dtype=torch.int32)
        kernel().table_layout(layout.data_ptr())
        lo, hi, half = layout.tolist()
        out = []
        for q in qmaps(kind):
            t = _thresholds(q)
            out.append((q.contiguous(), torch.cat([t, torch.tensor([math.inf])]), _bucket_table(q, t, lo, hi, half)))
        _tables[kind] = out
    return _tables[kind]


_spans_cache: dict = {}


def _spans_tensor(lay: Layout) -> torch.Tensor:
    key = lay.spans
    if key not in _spans_cache:
        _spans_cache[key] = torch.tensor([x for s in lay.spans for x in s] or [0], dtype=torch.int64)
    return _spans_cache[key]


def update_host(lay: Layout, p: torch.Tensor, g: torch.Tensor, m: torch.Tensor, v: torch.Tensor, *, lr: float,
                betas: tuple[float, float], eps: float, weight_decay: float, step: torch.Tensor,
                grad_scale: float = 1.0) -> None:
    """``update_torch`` on CPU tensors by the fused C kernel (same arithmetic; the torch path where none builds).

    ``step`` (0-dim fp32, CPU) is the count after this step; not changed here.
    """
    global _warned_fallback
    lib = kernel()
    if lib is None and not _warned_fallback:
        _warned_fallback = True
        warnings.warn("compact optimizer state: no host kernel; host updates use torch ops, several times slower",
                      stacklevel=2)
    if lib is None or g.dtype not in (torch.float32, torch.bfloat16):
        return update_torch(lay, p, g, m, v, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, step=step,
                            grad_scale=grad_scale)
    for t in (p, g, m, v):
        if t.device.type != "cpu" or not t.is_contiguous():
            raise ValueError("update_host needs contiguous CPU tensors")
    b1, b2 = betas
    t = float(step.item())  # host tensor: no sync
    (qm, tm, tabm), (qv, tv, tabv) = _table(lay.kind)
    mc, ms, m32 = parts(m, lay)
    vc, vs, v32 = parts(v, lay)
    spans = _spans_tensor(lay)
    bc1, bc2s = 1 - b1 ** t, math.sqrt(1 - b2 ** t)
    lib.adamw_compact(p.data_ptr(), g.data_ptr(), int(g.dtype == torch.bfloat16), float(grad_scale), lay.n,
                      mc.data_ptr(), ms.data_ptr(), vc.data_ptr(), vs.data_ptr(), BITS[lay.kind], BLOCK[lay.kind],
                      qm.data_ptr(), tm.data_ptr(), tabm.data_ptr(), qv.data_ptr(), tv.data_ptr(), tabv.data_ptr(),
                      spans.data_ptr(), len(lay.spans), lr / bc1, 1 - b1, 1 - b2, eps, lr * weight_decay, 1 / bc2s,
                      torch.get_num_threads())
    fp32_spans(lay, p, g, m32, v32, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, step=step - 1,
                grad_scale=grad_scale)
