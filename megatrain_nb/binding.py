"""Bind weightless layer templates to views of a flat weight buffer; never copies.

Owns: the flat layout of a unit's parameters (name, shape, aligned offset), making parameter
views (leaves that collect gradients into a flat gradient buffer), calling a template with them,
and the saved-tensor hooks that let an autograd graph outlive the slot its weights came from.
Does not own: which slot holds which layer (the engine says), nor any copies between devices.
"""
from __future__ import annotations

import dataclasses

import torch
from torch import nn

ALIGN = 64  # elements: every parameter view starts 256-byte aligned in fp32, 128 in bf16


@dataclasses.dataclass(frozen=True)
class Layout:
    """Where each parameter of a unit lives in its flat buffer."""

    names: tuple[str, ...]
    shapes: tuple[torch.Size, ...]
    offsets: tuple[int, ...]
    numel: int  # padded total

    @classmethod
    def build(cls, params: list[tuple[str, torch.Size]]) -> "Layout":
        names, shapes, offsets, off = [], [], [], 0
        for name, shape in params:
            names.append(name)
            shapes.append(torch.Size(shape))
            offsets.append(off)
            off += -(-torch.Size(shape).numel() // ALIGN) * ALIGN
        return cls(tuple(names), tuple(shapes), tuple(offsets), off)

    def views(self, flat: torch.Tensor, requires_grad: bool = False) -> dict[str, torch.Tensor]:
        """name -> view of ``flat`` (no copy). With requires_grad each view is a fresh autograd leaf."""
        out = {}
        for n, s, o in zip(self.names, self.shapes, self.offsets):
            v = flat[o:o + s.numel()].view(s)
            out[n] = v.detach().requires_grad_() if requires_grad else v
        return out

    def items(self):
        return zip(self.names, self.shapes, self.offsets)


def call(template: nn.Module, params: dict[str, torch.Tensor], *args, **kwargs):
    """Run a weightless template with ``params`` bound for this call only; returns its first output."""
    out = torch.func.functional_call(template, params, args, kwargs, tie_weights=False)
    return out[0] if isinstance(out, tuple) else out


def grads_into(params: dict[str, torch.Tensor], flat_grad: torch.Tensor, layout: Layout) -> None:
    """Point each leaf's .grad at its place in ``flat_grad`` so autograd accumulates there in place."""
    for n, s, o in layout.items():
        params[n].grad = flat_grad[o:o + s.numel()].view(s)


class SlotRefs:
    """Saved-tensor hooks: a weight saved for backward is kept as (layer, offset, shape, stride).

    Note: [Slot reuse] a layer whose activations are kept from the forward holds an autograd graph
    that saved its weights — views of a device slot that later layers overwrite. The pack hook
    replaces such a view by a token; the unpack hook rebuilds it from whichever slot holds that
    layer when its backward runs. The engine guarantees the layer is resident then.
    """

    def __init__(self, slots: list[torch.Tensor], where):
        self.ptr = {s.untyped_storage().data_ptr(): i for i, s in enumerate(slots)}
        self.slots = slots
        self.where = where  # callable: slot index -> layer it holds; and layer -> slot (see engine)

    def pack(self, t: torch.Tensor):
        s = self.ptr.get(t.untyped_storage().data_ptr()) if t.device.type != "meta" else None
        if s is None:
            return t
        return (self.where.layer_in(s), t.storage_offset(), tuple(t.shape), t.stride())

    def unpack(self, x):
        if not isinstance(x, tuple):
            return x
        layer, offset, shape, stride = x
        return self.slots[self.where.slot_of(layer)].as_strided(shape, stride, offset)

    def hooks(self):
        return torch.autograd.graph.saved_tensors_hooks(self.pack, self.unpack)
