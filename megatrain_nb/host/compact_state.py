"""Compact Adam moments: block-wise 8-bit or 4-bit ``exp_avg`` / ``exp_avg_sq`` beside the exact fp32 master.

Owns: the schemes (bitsandbytes' 8-bit dynamic maps in blocks of 256, torchao's 4-bit maps in blocks of 128,
one fp32 absmax scale per block), which positions of a unit keep fp32 moments (``Layout``: tensors under
4096 values and those the user names, by default the input embedding), how a unit's compact moment is laid
out in its store slab (``parts``), its bytes (``moment_words``, ``bytes_per_param``), conversion from and to
fp32 (``quantize_into``, ``dequantize``), and one AdamW step over compact moments in torch ops, ``update_torch``:
the reference, the host's path where no C compiler is found, and the device's where Triton is missing (``optim.py``
chooses ``compact_cuda``'s kernel on CUDA when it runs).
Does not own: when updates run, placement, streams (optim.py, device_updates.py), or the fp32 path.
The host's kernel is ``compact_host.py``'s, the device's ``compact_cuda.py``'s; both match ``update_torch``.

Note: [Compact slab] a compact moment of a unit with n positions lives in one flat fp32 slab of
``moment_words`` words, so that every copy of a unit's state (transfers, checkpoints, the shared store) moves
it as it moves fp32 moments: [codes: ceil(n/B)*B bytes (int8) or half that (int4), as words | scales:
ceil(n/B) fp32 | exempt: the kept positions' fp32 moments, span after span]. All zeros is the zero moment.

Note: [Alignment tail] a unit's flat slabs hold ``layout.numel`` positions, its tensors each starting
64-aligned (binding.ALIGN); ``Layout.n`` ends at its last tensor's end, so the slab's last
``numel - n`` positions (no parameter's, zero gradient) have no compact moment. Their fp32 moment is zero:
``dequantize`` writes it, whatever ``out`` held. A resident group's device moments are fp32 buffers of
``numel`` (made with ``torch.empty``): were the tail left as allocated, the fused AdamW would read the
allocator's old bytes there (a negative ``exp_avg_sq`` gives a NaN master, which fails ``check_state``).

Note: [Subnormals] on the H200 host (Intel Xeon) torch's fused CPU AdamW ran 8-13x slower when moments were
subnormal (shared/LIMITS.md). The host's C kernel sets flush-to-zero and denormals-are-zero on each of its threads;
``denormals.py`` does the same for the fp32 path's threads.
"""
from __future__ import annotations

import dataclasses
import fnmatch
import math

import torch

KINDS = ("int8", "int4")
BLOCK = {"int8": 256, "int4": 128}
BITS = {"int8": 8, "int4": 4}
MIN_QUANTIZED = 4096  # tensors under this many values keep fp32 moments (bitsandbytes' min_8bit_size)
DEFAULT_KEEP = ("*embed_tokens*", "*wte*", "*word_embeddings*")  # the input embedding, by its usual names


def _dynamic_map(signed: bool, max_exponent_bits: int, total_bits: int) -> list[float]:
    """The dynamic quantization map of bitsandbytes (Dettmers 2015), as torchao writes it (no zero padding,
    so that 4 bits work too): ``2 ** total_bits`` sorted values in [-1, 1] (signed) or [0, 1]."""
    data = []
    non_sign_bits = total_bits - 1
    additional = 2 ** (non_sign_bits - max_exponent_bits) - 1
    for i in range(max_exponent_bits):
        items = int(2 ** (i + non_sign_bits - max_exponent_bits) + 1 if signed
                    else 2 ** (i + non_sign_bits - max_exponent_bits + 1) + 1)
        bounds = torch.linspace(0.1, 1, items)
        means = (bounds[:-1] + bounds[1:]) / 2.0
        data += ((10 ** (-(max_exponent_bits - 1) + i)) * means).tolist()  # fp32 products, as torchao rounds them
        if signed:
            data += (-(10 ** (-(max_exponent_bits - 1) + i)) * means).tolist()
    if additional > 0:
        bounds = torch.linspace(0.1, 1, additional + 1)
        means = (bounds[:-1] + bounds[1:]) / 2.0
        data += ((10 ** (-(max_exponent_bits - 1) + i)) * means).tolist()
        if signed:
            data += (-(10 ** (-(max_exponent_bits - 1) + i)) * means).tolist()
    data += [0.0, 1.0]
    assert len(data) == 2 ** total_bits
    return sorted(data)


_MAPS: dict = {}


def qmaps(kind: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(exp_avg's map, exp_avg_sq's map), fp32 on the CPU: int8 the signed and unsigned dynamic maps
    (bitsandbytes' Adam8bit, torchao's AdamW8bit); int4 the signed 4-bit dynamic map (3 exponent bits) and
    the linear map without zero for the second moment (torchao's AdamW4bit, Li et al. 2023)."""
    if kind not in _MAPS:
        if kind == "int8":
            m, v = _dynamic_map(True, 7, 8), _dynamic_map(False, 7, 8)
        elif kind == "int4":
            m, v = _dynamic_map(True, 3, 4), torch.linspace(0, 1, 17)[1:].tolist()
        else:
            raise ValueError(f"optimizer_state={kind!r}: compact kinds are {KINDS}")
        _MAPS[kind] = (torch.tensor(m, dtype=torch.float32), torch.tensor(v, dtype=torch.float32))
    return _MAPS[kind]


def code_bytes(kind: str, nblocks: int) -> int:
    return nblocks * BLOCK[kind] * BITS[kind] // 8


@dataclasses.dataclass(frozen=True)
class Layout:
    """Where a unit's compact moment lives in its slab (Note: [Compact slab])."""

    kind: str
    n: int  # positions of the unit
    spans: tuple[tuple[int, int], ...]  # sorted [a, b) positions whose moments stay fp32

    @property
    def nblocks(self) -> int:
        return -(-self.n // BLOCK[self.kind])

    @property
    def kept(self) -> int:
        return sum(b - a for a, b in self.spans)

    @property
    def words(self) -> int:
        """fp32 words of one moment's slab."""
        return code_bytes(self.kind, self.nblocks) // 4 + self.nblocks + self.kept

    def span_offsets(self) -> list[tuple[int, int, int]]:
        """(a, b, offset in the exempt part) of each kept span."""
        out, off = [], 0
        for a, b in self.spans:
            out.append((a, b, off))
            off += b - a
        return out


def layout_for(kind: str, names_shapes: list[tuple[str, int, int]], keep=None) -> Layout | None:
    """The compact layout of a unit, or None where every position keeps fp32 moments.

    Args:
        kind: "int8" or "int4" ("fp32": None).
        names_shapes: (checkpoint name, offset, numel) of each tensor of the unit's flat slab, in order.
        keep: name patterns of tensors that keep fp32 moments (None: ``DEFAULT_KEEP``).
    """
    if kind == "fp32":
        return None
    keep = DEFAULT_KEEP if keep is None else keep
    n = max((o + k for _, o, k in names_shapes), default=0)
    spans = []
    for name, off, numel in sorted(names_shapes, key=lambda t: t[1]):
        if numel < MIN_QUANTIZED or any(fnmatch.fnmatch(name, pat) for pat in keep):
            if spans and spans[-1][1] == off:
                spans[-1] = (spans[-1][0], off + numel)
            else:
                spans.append((off, off + numel))
    if sum(b - a for a, b in spans) == n:
        return None
    return Layout(kind=kind, n=n, spans=tuple(spans))


def moment_words(kind: str, n: int, kept: int = 0) -> int:
    """fp32 words of one compact moment of ``n`` positions, ``kept`` of them fp32 (Note: [Compact slab])."""
    if kind == "fp32":
        return n
    nb = -(-n // BLOCK[kind])
    return code_bytes(kind, nb) // 4 + nb + kept


def bytes_per_param(kind: str) -> float:
    """Host bytes a quantized parameter's two moments take, scales included (fp32: 8)."""
    if kind == "fp32":
        return 8.0
    return 2 * (BITS[kind] / 8 + 4 / BLOCK[kind])


def parts(slab: torch.Tensor, lay: Layout) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(codes uint8, scales fp32 (nblocks,), exempt fp32 (kept,)): views into one moment's slab (any device)."""
    cw = code_bytes(lay.kind, lay.nblocks) // 4
    return (slab[:cw].view(torch.uint8), slab[cw:cw + lay.nblocks], slab[cw + lay.nblocks:cw + lay.nblocks + lay.kept])


# ---- torch-op codec: the device's path, the reference for the C kernel, conversions ----------------------

def codes_of(x: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """Nearest entry of sorted map ``q`` for each value of ``x`` (ties up), as torchao's quantize_*_with_qmap."""
    c = (torch.searchsorted(q, x, right=True) - 1).clamp_(0, q.numel() - 1)
    up = (c + 1).clamp_(max=q.numel() - 1)
    lo = q[c]
    return torch.where(x - lo >= (q[up] - lo) * 0.5, up, c).to(torch.uint8)


def _pack(codes: torch.Tensor, bits: int) -> torch.Tensor:
    if bits == 8:
        return codes
    c = codes.view(-1, 2)
    return (c[:, 0] << 4) | c[:, 1]


def _unpack(codes: torch.Tensor, bits: int) -> torch.Tensor:
    if bits == 8:
        return codes
    return torch.stack([codes >> 4, codes & 15], dim=-1).flatten()


def _block_range(lay: Layout, k0: int, k1: int) -> tuple[int, int]:
    B = BLOCK[lay.kind]
    return k0 * B, min(lay.n, k1 * B)


def _kept_mask(lay: Layout, a: int, b: int, device) -> torch.Tensor | None:
    """(b - a,) bool: positions of [a, b) that keep fp32 moments (None if none do)."""
    hits = [(max(x, a), min(y, b)) for x, y in lay.spans if x < b and y > a]
    if not hits:
        return None
    mask = torch.zeros(b - a, dtype=torch.bool, device=device)
    for x, y in hits:
        mask[x - a:y - a] = True
    return mask


def dequantize(slab: torch.Tensor, lay: Layout, which: int, out: torch.Tensor | None = None,
               chunk_blocks: int = 1 << 16) -> torch.Tensor:
    """A moment as fp32 (n,) from its compact slab (``which`` 0: exp_avg, 1: exp_avg_sq), chunk by chunk.
    ``out``: (m,) fp32 with m >= n, e.g. a unit's whole flat slab; every position is written, those from n
    on zero (Note: [Alignment tail])."""
    codes, scales, kept = parts(slab, lay)
    q = qmaps(lay.kind)[which].to(slab.device)
    out = torch.empty(lay.n, dtype=torch.float32, device=slab.device) if out is None else out
    if out.numel() < lay.n:
        raise ValueError(f"dequantize: out has {out.numel()} elements, the moment {lay.n}; pass one of at least "
                         f"{lay.n}")
    out[lay.n:].zero_()
    B, bits = BLOCK[lay.kind], BITS[lay.kind]
    for k0 in range(0, lay.nblocks, chunk_blocks):
        k1 = min(lay.nblocks, k0 + chunk_blocks)
        cb = codes[k0 * B * bits // 8:k1 * B * bits // 8]
        vals = (q[_unpack(cb, bits).int()].view(k1 - k0, B) * scales[k0:k1].view(-1, 1)).flatten()
        a, b = _block_range(lay, k0, k1)
        out[a:b] = vals[:b - a]
    for a, b, o in lay.span_offsets():
        out[a:b] = kept[o:o + b - a]
    return out


def _quantize_blocks(x: torch.Tensor, lay: Layout, which: int, codes: torch.Tensor, scales: torch.Tensor,
                     k0: int, k1: int, skip: torch.Tensor | None = None) -> None:
    """Blocks [k0, k1) of a moment from fp32 ``x`` (their positions; kept positions must hold 0); ``skip``
    (0-dim bool, any device): where true, the blocks keep what they hold (a skipped step, no host sync)."""
    B, bits = BLOCK[lay.kind], BITS[lay.kind]
    a, b = _block_range(lay, k0, k1)
    xb = torch.zeros((k1 - k0) * B, dtype=torch.float32, device=x.device)
    xb[:b - a] = x
    xb = xb.view(-1, B)
    s = xb.abs().amax(-1).clamp_(min=1e-12)
    c = _pack(codes_of((xb / s.view(-1, 1)).flatten(), qmaps(lay.kind)[which].to(x.device)), bits)
    cs = slice(k0 * B * bits // 8, k1 * B * bits // 8)
    if skip is not None:
        s, c = torch.where(skip, scales[k0:k1], s), torch.where(skip, codes[cs], c)
    scales[k0:k1] = s
    codes[cs] = c


def quantize_into(slab: torch.Tensor, lay: Layout, which: int, x: torch.Tensor, chunk_blocks: int = 1 << 16) -> None:
    """Store fp32 moment ``x`` (n,) into its compact slab, chunk by chunk (a conversion; ``x`` is not changed)."""
    codes, scales, kept = parts(slab, lay)
    for a, b, o in lay.span_offsets():
        kept[o:o + b - a] = x[a:b]
    for k0 in range(0, lay.nblocks, chunk_blocks):
        k1 = min(lay.nblocks, k0 + chunk_blocks)
        a, b = _block_range(lay, k0, k1)
        xs = x[a:b]
        mask = _kept_mask(lay, a, b, x.device)
        if mask is not None:
            xs = xs.masked_fill(mask, 0.0)
        _quantize_blocks(xs, lay, which, codes, scales, k0, k1)


def fp32_spans(lay: Layout, p, g, m32, v32, *, lr, betas, eps, weight_decay, step, grad_scale,
                found_inf=None) -> None:
    """Kept positions: torch's fused AdamW on their fp32 moments (``step``: the count before this step)."""
    from torch.optim.adamw import adamw

    for a, b, o in lay.span_offsets():
        gs = g[a:b].float() * grad_scale if grad_scale != 1.0 or g.dtype != torch.float32 else g[a:b]
        adamw([p[a:b]], [gs], [m32[o:o + b - a]], [v32[o:o + b - a]], [], [step.clone()], fused=True,
              amsgrad=False, beta1=betas[0], beta2=betas[1], lr=lr, weight_decay=weight_decay, eps=eps,
              maximize=False, found_inf=found_inf)


def update_torch(lay: Layout, p: torch.Tensor, g: torch.Tensor, m: torch.Tensor, v: torch.Tensor, *, lr: float,
                 betas: tuple[float, float], eps: float, weight_decay: float, step: torch.Tensor,
                 grad_scale: float = 1.0, found_inf: torch.Tensor | None = None, chunk_blocks: int = 1 << 15) -> None:
    """One AdamW step of a unit over compact moments, in torch ops (any device), in place.

    Args:
        p: (n,) fp32 master.  g: (n,) gradients, any float dtype.  m, v: the moments' slabs (fp32 words).
        step: 0-dim fp32 step count *after* this step (as the fused kernel sees it); not changed here.
        found_inf: 0-dim fp32 on ``p``'s device; 1.0 leaves everything as it was (as the fused kernel's flag).
    """
    b1, b2 = betas
    t = step.double().item() if step.device.type == "cpu" else None
    if t is not None:
        bc1, bc2s = 1 - b1 ** t, math.sqrt(1 - b2 ** t)
    else:  # stays on the device: no host sync
        bc1, bc2s = 1 - torch.pow(b1, step), torch.sqrt(1 - torch.pow(b2, step))
    mc, ms, m32 = parts(m, lay)
    vc, vs, v32 = parts(v, lay)
    qm, qv = (q.to(p.device) for q in qmaps(lay.kind))
    B, bits = BLOCK[lay.kind], BITS[lay.kind]
    skip = None if found_inf is None else found_inf > 0
    for k0 in range(0, lay.nblocks, chunk_blocks):
        k1 = min(lay.nblocks, k0 + chunk_blocks)
        a, b = _block_range(lay, k0, k1)
        cs = slice(k0 * B * bits // 8, k1 * B * bits // 8)
        mi = (qm[_unpack(mc[cs], bits).int()].view(-1, B) * ms[k0:k1].view(-1, 1)).flatten()[:b - a]
        vi = (qv[_unpack(vc[cs], bits).int()].view(-1, B) * vs[k0:k1].view(-1, 1)).flatten()[:b - a]
        gi = g[a:b].float()
        if grad_scale != 1.0:
            gi = gi * grad_scale
        mi = mi + (1 - b1) * (gi - mi)
        vi = vi + (1 - b2) * (gi * gi - vi)
        pi = p[a:b]
        mask = _kept_mask(lay, a, b, p.device)
        new = pi - (lr * weight_decay) * pi
        new = new - lr * (mi / bc1) / (vi.sqrt() / bc2s + eps)
        if mask is not None:
            new = torch.where(mask, pi, new)
            mi, vi = mi.masked_fill(mask, 0.0), vi.masked_fill(mask, 0.0)
        if skip is not None:
            new = torch.where(skip, pi, new)
        pi.copy_(new)
        _quantize_blocks(mi, lay, 0, mc, ms, k0, k1, skip)
        _quantize_blocks(vi, lay, 1, vc, vs, k0, k1, skip)
    fp32_spans(lay, p, g, m32, v32, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay,
                step=step - (1 if found_inf is None else 1 - found_inf), grad_scale=grad_scale, found_inf=found_inf)
