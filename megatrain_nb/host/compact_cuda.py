"""The device's AdamW over compact moments: one Triton kernel, one program per quantization block.

Owns: the CUDA form of ``compact_state.update_torch`` (same arithmetic, same maps and rounding) and the
per-layout masks of kept positions it reads. Does not own: the schemes, the slab layout or when updates run
(compact_state.py, optim.py).
Why a kernel: in torch ops the update of one 7B layer's compact state took ~40 ms on the H200 (~30 launches
per chunk, each a pass through memory), longer than the layer's backward; as one kernel it is a single
pass over the state, bound by the device's memory bandwidth.
"""
from __future__ import annotations

import torch

from . import compact_state as cs

_MASKS: dict = {}  # (spans, n, device) -> (n,) uint8 on the device: 1 where the moment stays fp32
_MAPS: dict = {}  # (kind, device) -> the two maps on the device

try:
    import triton
    import triton.language as tl
except ImportError:  # then compact_state.update_torch's ops run
    triton = None


def available() -> bool:
    """Whether the kernel can run (Triton imports); else ``compact_state.update_torch``'s ops run."""
    return triton is not None and _KERNEL[0] is not None


if triton is not None:
    @triton.jit
    def _nearest(x, q_ptr, NQ: tl.constexpr, LOG: tl.constexpr):
        """max{i: q[i] <= x} by branchless binary search (as torchao), then up where x is past the midpoint."""
        c = tl.zeros(x.shape, dtype=tl.int32)
        for s in tl.static_range(LOG):
            c += tl.where(x >= tl.load(q_ptr + c + (NQ >> (s + 1))), NQ >> (s + 1), 0)
        up = tl.minimum(c + 1, NQ - 1)
        lo = tl.load(q_ptr + c)
        return tl.where(x - lo >= (tl.load(q_ptr + up) - lo) * 0.5, up, c)

    @triton.jit
    def adamw(p_ptr, g_ptr, mc_ptr, ms_ptr, vc_ptr, vs_ptr, qm_ptr, qv_ptr, kept_ptr, found_ptr, bc_ptr, n,
              lr, w1, w2, eps, decay, grad_scale, BITS: tl.constexpr, B: tl.constexpr, NQ: tl.constexpr,
              LOG: tl.constexpr, KEPT: tl.constexpr, FOUND: tl.constexpr):
        k = tl.program_id(0).to(tl.int64)
        offs = k * B + tl.arange(0, B)
        inb = offs < n
        if BITS == 8:
            cm = tl.load(mc_ptr + offs, mask=inb, other=0).to(tl.int32)
            cv = tl.load(vc_ptr + offs, mask=inb, other=0).to(tl.int32)
        else:  # two codes a byte, the first in the high nibble (torchao's packing)
            half = k * (B // 2) + tl.arange(0, B // 2)
            bm = tl.load(mc_ptr + half).to(tl.int32)
            bv = tl.load(vc_ptr + half).to(tl.int32)
            cm = tl.interleave(bm >> 4, bm & 15)
            cv = tl.interleave(bv >> 4, bv & 15)
        mi = tl.load(qm_ptr + cm) * tl.load(ms_ptr + k)
        vi = tl.load(qv_ptr + cv) * tl.load(vs_ptr + k)
        gi = tl.load(g_ptr + offs, mask=inb, other=0.0).to(tl.float32) * grad_scale
        mi = mi + w1 * (gi - mi)
        vi = vi + w2 * (gi * gi - vi)
        bc1 = tl.load(bc_ptr)
        bc2s = tl.load(bc_ptr + 1)
        pi = tl.load(p_ptr + offs, mask=inb, other=0.0)
        new = pi - decay * pi
        new = new - lr * (mi / bc1) / (tl.sqrt_rn(vi) / bc2s + eps)
        live = inb
        if KEPT:
            live = live & (tl.load(kept_ptr + offs, mask=inb, other=1) == 0)
        mi = tl.where(live, mi, 0.0)
        vi = tl.where(live, vi, 0.0)
        ok = tl.full([B], 1, tl.int32)  # 0 where a non-finite step is skipped: nothing is written
        if FOUND:
            ok = ok * (tl.load(found_ptr) == 0.0).to(tl.int32)
        tl.store(p_ptr + offs, new, mask=live & (ok != 0))
        am = tl.maximum(tl.max(tl.abs(mi), axis=0), 1e-12)
        av = tl.maximum(tl.max(tl.abs(vi), axis=0), 1e-12)
        qm = _nearest(mi / am, qm_ptr, NQ, LOG)
        qv = _nearest(vi / av, qv_ptr, NQ, LOG)
        if BITS == 8:
            tl.store(mc_ptr + offs, qm.to(tl.uint8), mask=inb & (ok != 0))
            tl.store(vc_ptr + offs, qv.to(tl.uint8), mask=inb & (ok != 0))
        else:
            hm, lm = tl.split(tl.reshape(qm, (B // 2, 2)))
            hv, lv = tl.split(tl.reshape(qv, (B // 2, 2)))
            okh = tl.max(ok, axis=0) != 0
            tl.store(mc_ptr + half, ((hm << 4) | lm).to(tl.uint8), mask=okh)
            tl.store(vc_ptr + half, ((hv << 4) | lv).to(tl.uint8), mask=okh)
        oks = tl.max(ok, axis=0) != 0
        tl.store(ms_ptr + k, am, mask=oks)
        tl.store(vs_ptr + k, av, mask=oks)


_KERNEL = [adamw if triton is not None else None]  # tests swap in None to run the torch ops


def _kept_mask(lay: cs.Layout, device) -> torch.Tensor | None:
    if not lay.spans:
        return None
    key = (lay.spans, lay.n, str(device))
    if key not in _MASKS:
        mask = torch.zeros(lay.nblocks * cs.BLOCK[lay.kind], dtype=torch.uint8, device=device)
        for a, b in lay.spans:
            mask[a:b] = 1
        _MASKS[key] = mask
    return _MASKS[key]


def update(lay: cs.Layout, p: torch.Tensor, g: torch.Tensor, m: torch.Tensor, v: torch.Tensor, *, lr: float,
           betas: tuple[float, float], eps: float, weight_decay: float, step: torch.Tensor, grad_scale: float = 1.0,
           found_inf: torch.Tensor | None = None) -> None:
    """``compact_state.update_torch`` on CUDA tensors, in one kernel over the quantized positions (the kept
    spans by torch's fused AdamW after it). ``step``: 0-dim fp32 on the device, the count after this step."""
    kind = lay.kind
    if (kind, p.device) not in _MAPS:
        _MAPS[kind, p.device] = tuple(q.to(p.device) for q in cs.qmaps(kind))
    qm, qv = _MAPS[kind, p.device]
    b1, b2 = betas
    bc = torch.stack([1 - torch.pow(b1, step), torch.sqrt(1 - torch.pow(b2, step))]).float()  # no host sync
    mc, ms, m32 = cs.parts(m, lay)
    vc, vs, v32 = cs.parts(v, lay)
    kept = _kept_mask(lay, p.device)
    B, NQ = cs.BLOCK[kind], 1 << cs.BITS[kind]
    _KERNEL[0][(lay.nblocks,)](
        p, g, mc, ms, vc, vs, qm, qv, p if kept is None else kept, p if found_inf is None else found_inf, bc, lay.n,
        lr, 1 - b1, 1 - b2, eps, lr * weight_decay, grad_scale, BITS=cs.BITS[kind], B=B, NQ=NQ,
        LOG=NQ.bit_length() - 1, KEPT=kept is not None, FOUND=found_inf is not None)
    cs.fp32_spans(lay, p, g, m32, v32, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay,
                   step=step - (1 if found_inf is None else 1 - found_inf), grad_scale=grad_scale, found_inf=found_inf)
