"""An fp32 master as two 16-bit planes: its bf16 weights and the rest, exactly.

Owns: the codec between an fp32 tensor and (R, D), R its bf16 rounding (the compute-dtype weights a
device already holds) and D the 16 bits that give the fp32 back, on the host or the device, and the
in-place forms of both on a host master slab. Does not own: when a unit's slab is split (host_store.py,
device_updates.py) or any copy.

Note: [Split master] at small batches under placement "stream" the step is bound by PCIe in (on the
H200, 2026-12-02, 3B x 1: the h2d lane busy 719 of 728 ms), and 12 bytes of each streamed parameter are its
fp32 master and moments. The device holds the layer's bf16 weights when its state arrives (Note:
[Held weights] in placement.py): R = bf16(master), rounded to nearest even. So the host keeps a
"device" layer's master slab as two planes, [R | D], D = bits(master) - bits(R) * 2**16, and sends D
alone: 10 bytes a parameter in instead of 12 (its weights, when loaded, 2 instead of 4). D lies in
[-2**15, 2**15]: one value too many for 16 bits. +2**15 (a tie that rounded down to an even R) is
stored as -2**15 with the sign bit of the parameter's exp_avg_sq set; that moment is never negative,
so the sign bit is free, and joining clears it. The codec is exact: joining gives the fp32 bits back
(``tests/host/test_split_master.py``), so every placement trains as before, bitwise. On CUDA each direction is one Triton kernel (a pass of
16 bytes an element): in torch's elementwise ops the codec took ~12 passes, and beside the backward at
3B x 4 it slowed the compute stream by 7% (H200, 2026-12-02: busy 97.4% of an 889 ms step, against 95.4% of 830
without the split); the CPU runs the same arithmetic in torch ops, and ``tests/test_gpu.py`` holds the
two equal.
"""
from __future__ import annotations

import torch

CHUNK = 1 << 24  # elements a pass: the device's temporaries stay at ~200 MB whatever the layer
_SIGN = -2 ** 31  # int32 with only the sign bit set


def applies(dtype: torch.dtype, numel: int) -> bool:
    """Whether a unit of ``numel`` elements can be split for compute dtype ``dtype``: bf16 is an fp32's
    top 16 bits rounded, and D travels as an fp32 view of half the elements (an even count)."""
    return dtype == torch.bfloat16 and numel % 2 == 0


def enabled(setting: bool | None, bf16: bool, shadow: bool, shared: bool, compact: bool = False) -> bool:
    """``EngineConfig.split_master`` resolved for an engine (and the planner): bf16 compute, no pinned
    compute-dtype copy (``pin_store``: it already is the weights), one process's own store, fp32 moments
    (``compact``: the tie marks live in the sign bits of an fp32 exp_avg_sq).

    Raises:
        ValueError: ``setting`` is True where it cannot apply.
    """
    ok = bf16 and not shadow and not shared and not compact
    if setting and not ok:
        raise ValueError(f"split_master=True: needs bf16 compute (bf16={bf16}), no pin_store copy (pin_store={shadow}), "
                         f"a store of this process's own (shared={shared}) and optimizer_state='fp32' (compact="
                         f"{compact}); use split_master=None")
    return ok and setting is not False


def planes(master: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(R, D) views of a split slab: master (numel,) fp32 -> two (numel,) int16 planes of its bytes."""
    n = master.numel()
    bits = master.view(torch.int16)
    return bits[:n], bits[n:]


def weights(master: torch.Tensor) -> torch.Tensor:
    """The R plane of a split slab as the compute-dtype weights: (numel,) bf16, a view (pinned if it is)."""
    return master.view(torch.bfloat16)[:master.numel()]


def split_into(m: torch.Tensor, r: torch.Tensor, d: torch.Tensor, v: torch.Tensor) -> None:
    """Encode: ``m`` (n,) fp32 (read) -> ``r`` (n,) int16 = bits of bf16(m), ``d`` (n,) int16; marks ties
    in the sign bit of ``v`` (n,) fp32, exp_avg_sq. ``m`` must not overlap ``r``, ``d`` or ``v``."""
    if _on_cuda("split", m, r, d, v):
        return
    mb, vb = m.view(torch.int32), v.view(torch.int32)
    for a, b in _pieces(m.numel()):
        r[a:b].copy_(m[a:b].to(torch.bfloat16).view(torch.int16))
        x = mb[a:b] - r[a:b].to(torch.int32) * 65536  # in [-2**15, 2**15]: no int32 overflow (module note)
        tie = x == 2 ** 15
        d[a:b].copy_(torch.where(tie, -2 ** 15, x))  # int32 -> int16, in range
        vb[a:b].copy_(torch.where(tie, vb[a:b] | _SIGN, vb[a:b]))


def join_into(out: torch.Tensor, r: torch.Tensor, d: torch.Tensor, v: torch.Tensor) -> None:
    """Decode: ``r``, ``d`` (n,) int16 -> ``out`` (n,) fp32; clears the tie marks in ``v`` (n,) fp32.
    ``out`` must not overlap ``r`` or ``d``."""
    if _on_cuda("join", out, r, d, v):
        return
    ob, vb = out.view(torch.int32), v.view(torch.int32)
    for a, b in _pieces(out.numel()):
        x = d[a:b].to(torch.int32)
        x += ((x == -2 ** 15) & (vb[a:b] < 0)).to(torch.int32) * 65536  # a marked tie: +2**15
        x += r[a:b].to(torch.int32) * 65536
        ob[a:b].copy_(x)
        vb[a:b].bitwise_and_(0x7FFFFFFF)


def split_(master: torch.Tensor, exp_avg_sq: torch.Tensor) -> None:
    """A host slab in place: fp32 master -> [R | D] (a temporary copy of the slab)."""
    r, d = planes(master)
    split_into(master.clone(), r, d, exp_avg_sq)


def join_(master: torch.Tensor, exp_avg_sq: torch.Tensor) -> None:
    """A host slab in place: [R | D] -> fp32 master (temporary copies of the planes)."""
    r, d = planes(master)
    join_into(master, r.clone(), d.clone(), exp_avg_sq)


def _pieces(n: int):
    """(start, end) of the torch ops' passes: ``CHUNK`` elements at a time."""
    for a in range(0, n, CHUNK):
        yield a, min(n, a + CHUNK)


def _on_cuda(name: str, m, r, d, v) -> bool:
    """Run the CUDA kernel ``name`` where ``m`` is on the GPU and Triton is there; whether it ran."""
    k = _kernels() if m.is_cuda else None
    if k is not None:
        k.launch(getattr(k, name), m, r, d, v)
    return k is not None


_KERNELS: list = []  # [the Triton kernels, or None where Triton cannot be imported]


def _kernels():
    """The CUDA kernels (built on first use), or None without Triton: then torch's ops run the codec."""
    if not _KERNELS:
        try:
            _KERNELS.append(_build())
        except ImportError:
            _KERNELS.append(None)
    return _KERNELS[0]


def _build():
    import types

    import triton
    import triton.language as tl

    @triton.jit
    def split(m_ptr, r_ptr, d_ptr, v_ptr, n, BLOCK: tl.constexpr):  # m fp32, r d int16, v int32 (bits)
        offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < n
        m = tl.load(m_ptr + offs, mask=mask)
        vb = tl.load(v_ptr + offs, mask=mask)
        rb = m.to(tl.bfloat16).to(tl.int16, bitcast=True)  # round to nearest even, as torch's cast
        x = m.to(tl.int32, bitcast=True) - rb.to(tl.int32) * 65536
        tie = x == 32768
        tl.store(r_ptr + offs, rb, mask=mask)
        tl.store(d_ptr + offs, tl.where(tie, -32768, x).to(tl.int16), mask=mask)
        tl.store(v_ptr + offs, tl.where(tie, vb | -2147483648, vb), mask=mask)

    @triton.jit
    def join(m_ptr, r_ptr, d_ptr, v_ptr, n, BLOCK: tl.constexpr):  # m int32 (bits), r d int16, v int32 (bits)
        offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < n
        d = tl.load(d_ptr + offs, mask=mask).to(tl.int32)
        vb = tl.load(v_ptr + offs, mask=mask)
        d = tl.where((d == -32768) & (vb < 0), 32768, d)
        tl.store(m_ptr + offs, tl.load(r_ptr + offs, mask=mask).to(tl.int32) * 65536 + d, mask=mask)
        tl.store(v_ptr + offs, vb & 2147483647, mask=mask)

    def launch(kernel, m, r, d, v):
        n, block = m.numel(), 4096
        mm = m if kernel is split else m.view(torch.int32)
        kernel[(triton.cdiv(n, block),)](mm, r, d, v.view(torch.int32), n, BLOCK=block)

    return types.SimpleNamespace(split=split, join=join, launch=launch)
