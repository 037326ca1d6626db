"""Attention outputs kept from the forward, so that a recomputed layer's backward skips its attention forward.

Owns: the capture of one layer's SDPA call in the forward (its autograd node kept with the output and
the log-sum-exp it saved; q, k and v dropped), its replay when the layer is recomputed (the kept output
returned without running the kernel; in the backward the kept node runs with the recomputed q, k and v
put back in place of the dropped ones), and the bytes the kept entries hold.
Does not own: which layers are cached (``longcontext.place_cache`` decides, ``Checkpoints`` holds the
choice, ``Engine`` asks it per layer), the kernel (``tiling.SequenceTiling``'s backend), or any weights.

Note: [Attention cache] a recomputed layer's backward runs its forward again from the block input:
at long context most of that is the attention forward (7B shape at 256K: ~0.8 s of a layer's ~5.4 s),
while the attention's own backward needs only q, k, v, the output and the log-sum-exp. The forward
runs the SDPA call once with autograd on, through ``_Inject`` (q, k, v as outputs of a node that holds
no tensor), under saved-tensor hooks that turn q, k and v (anything sharing their storage) into
placeholders; what the kernel saved besides (output, log-sum-exp, RNG offsets) stays. That costs
``entry_bytes`` per layer (B*T*(heads*head_dim*dtype + heads*4)), an eighth of what keeping the whole
tiled layer costs at 7B shape. The recompute calls ``_Replay`` instead of the kernel: it returns the
kept output, and its backward runs the kept node with the recomputed q, k, v (bit-equal: the same
operations on the same input) standing in for the placeholders. The gradients are those of the
uncached recompute: the same backward kernel on the same tensors. The numbers differ from an uncached
run only where the kernel's no-grad and grad-mode forwards differ, and there the cached run is the
consistent one (its forward output is the one its backward differentiates).
"""
from __future__ import annotations

import contextlib

import torch
from torch.overrides import TorchFunctionMode

_SDPA = torch.nn.functional.scaled_dot_product_attention
_QKV = ("query", "key", "value")


def entry_bytes(*, tokens: int, heads: int, head_dim: int, dtype_bytes: int) -> int:
    """Bytes one cached layer keeps for ``tokens`` tokens: the attention output in the compute dtype and
    the fp32 log-sum-exp per head (Note: [Attention cache])."""
    return tokens * heads * (head_dim * dtype_bytes + 4)


class _Entry:
    """One SDPA call's kept autograd node: ``out`` (its output, the node behind it), ``anchor`` (the leaf
    its gradients flow to), ``shapes`` (q, k, v at capture), ``nbytes`` (what it keeps)."""

    __slots__ = ("out", "anchor", "shapes", "nbytes", "current", "grads")

    def __init__(self):
        self.out = self.anchor = self.current = self.grads = None
        self.shapes, self.nbytes = (), 0


class _Inject(torch.autograd.Function):
    """q, k, v as outputs of a node that holds none of them; its backward hands their gradients to the entry."""

    @staticmethod
    def forward(ctx, entry, anchor, *qkv):
        ctx.entry = entry
        return tuple(t.view_as(t) for t in qkv)

    @staticmethod
    def backward(ctx, *grads):
        ctx.entry.grads = grads
        return None, grads[0].new_zeros(0), *(None for _ in grads)


class _Replay(torch.autograd.Function):
    """The kept output in place of the kernel's; backward: the kept node with the recomputed q, k, v."""

    @staticmethod
    def forward(ctx, entry, *qkv):
        ctx.entry = entry
        ctx.save_for_backward(*qkv)
        return entry.out.detach()

    @staticmethod
    def backward(ctx, g):
        e, ctx.entry = ctx.entry, None
        e.current = ctx.saved_tensors
        try:
            with torch.enable_grad():
                torch.autograd.grad(e.out, e.anchor, g)
            grads = e.grads
        finally:
            e.out = e.anchor = e.current = e.grads = None  # the kept node goes with this backward
        return None, *grads


class _Mode(TorchFunctionMode):
    """Routes the SDPA calls inside one layer call to ``AttentionCache``; every other function runs as is."""

    def __init__(self, cache: AttentionCache, key: tuple, replay: bool):
        super().__init__()
        self.cache, self.key, self.replay, self.n = cache, key, replay, 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is not _SDPA:
            return func(*args, **kwargs)
        args, kwargs = _positional(args, kwargs)
        key, self.n = (*self.key, self.n), self.n + 1
        if self.replay:
            return self.cache._replay(key, func, args, kwargs)
        return self.cache._capture(key, func, args, kwargs)


def _positional(args, kwargs):
    """SDPA's (query, key, value, ...) as positional arguments."""
    args = list(args)
    for name in _QKV[len(args):]:
        if name in kwargs:
            args.append(kwargs.pop(name))
    return tuple(args), kwargs


class AttentionCache:
    """The engine's kept attention outputs, one entry per (layer, micro-batch, SDPA call).

    Example:
        >>> import torch, torch.nn.functional as F
        >>> cache = AttentionCache()
        >>> q, k = torch.randn(1, 2, 8, 4), torch.randn(1, 2, 8, 4)
        >>> with torch.no_grad(), cache.capture(0, 0):       # the forward: the kernel runs, its node is kept
        ...     y = F.scaled_dot_product_attention(q, k, k, is_causal=True)
        >>> qr = q.clone().requires_grad_()                   # the recompute: q, k, v again
        >>> with cache.replay(0, 0):
        ...     yr = F.scaled_dot_product_attention(qr, k, k, is_causal=True)
        >>> bool(torch.equal(y, yr)), len(cache)
        (True, 0)
        >>> yr.sum().backward(); qr.grad.shape
        torch.Size([1, 2, 8, 4])
    """

    def __init__(self):
        self.entries: dict[tuple, _Entry] = {}
        self.captured = self.replayed = 0  # SDPA calls this step (counters for tests and the activation report)

    def __len__(self) -> int:
        return len(self.entries)

    @property
    def nbytes(self) -> int:
        """Bytes the entries waiting for their backward keep."""
        return sum(e.nbytes for e in self.entries.values())

    def capture(self, layer: int, mb: int):
        """Context for layer ``layer``'s forward on micro-batch ``mb``: its SDPA calls keep their node."""
        return _Mode(self, (layer, mb), replay=False)

    def replay(self, layer: int, mb: int):
        """Context for the layer's recompute: its SDPA calls return the kept output (nothing when none
        was kept)."""
        if (layer, mb, 0) not in self.entries:
            return contextlib.nullcontext()
        return _Mode(self, (layer, mb), replay=True)

    def clear(self) -> None:
        """Drop every entry (a failed step: its backward will not come)."""
        self.entries.clear()

    def _capture(self, key, func, args, kwargs):
        q, k, v = args[:3]
        e = _Entry()
        roots = [t.untyped_storage().data_ptr() for t in (q, k, v)]
        seen = set()

        def pack(t):
            p = t.untyped_storage().data_ptr()
            if p in roots and t.numel():
                return roots.index(p), t.shape, t.stride(), t.storage_offset()
            if p not in seen:
                seen.add(p)
                e.nbytes += t.untyped_storage().nbytes()
            return t

        def unpack(x):
            if isinstance(x, tuple):
                j, size, stride, offset = x
                return e.current[j].as_strided(size, stride, offset)
            return x

        e.anchor = q.new_empty(0).requires_grad_()
        with torch.enable_grad(), torch.autograd.graph.saved_tensors_hooks(pack, unpack):
            qkv = _Inject.apply(e, e.anchor, q.detach(), k.detach(), v.detach())
            out = func(*qkv, *args[3:], **kwargs)
        e.out, e.shapes = out, tuple(t.shape for t in (q, k, v))
        self.entries[key] = e
        self.captured += 1
        return out.detach()

    def _replay(self, key, func, args, kwargs):
        e = self.entries.pop(key, None)
        if e is None:
            return func(*args, **kwargs)
        q, k, v = args[:3]
        if tuple(t.shape for t in (q, k, v)) != e.shapes:
            raise RuntimeError(f"attention cache: layer {key[0]}'s recompute called SDPA with q, k, v of "
                               f"{[tuple(t.shape) for t in (q, k, v)]}, its forward with {[tuple(s) for s in e.shapes]}")
        self.replayed += 1
        return _Replay.apply(e, q, k, v)
