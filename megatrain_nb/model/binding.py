"""Bind weightless layer templates to views of a flat weight buffer; never copies.

Owns: the flat layout of a unit's parameters (name, shape, aligned offset), making parameter
views (leaves that collect gradients into a flat gradient buffer), calling a template with them, a
template's copy whose parameters are such views (``bound``: the random init writes through it), and
the saved-tensor hooks that let an autograd graph outlive the slot its weights came from.
Does not own: which slot holds which layer (the engine says), nor any copies between devices.

Note: [Binding cost] the driver binds a layer once per layer op, and at small batches the GPU runs
a layer faster than the host enqueues it: what binding costs on the host is step time. So a
buffer's views are made once and kept while the buffer lives (``Layout.views``), a template's
parameter places are found once (``call``), and no saved-tensor hook runs for weights that never
move (``SlotRefs.hooks``). The design log records what it costs.
"""
from __future__ import annotations

import contextlib
import copy
import dataclasses
import weakref

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

    def __post_init__(self):
        object.__setattr__(self, "_cache", {})  # id(flat) -> (weakref to flat, its data_ptr, dtype, name -> view)

    def views(self, flat: torch.Tensor, requires_grad: bool = False) -> dict[str, torch.Tensor]:
        """name -> view of ``flat`` (no copy). With requires_grad each view is a fresh autograd leaf.

        Without requires_grad the views are the ones made for ``flat`` before (Note: [Binding cost]):
        don't change their metadata (``requires_grad_``, ``.grad``); the dict itself is the caller's.
        """
        views = self._views(flat)
        if requires_grad:
            return {n: v.detach().requires_grad_() for n, v in views.items()}
        return dict(views)

    def _views(self, flat: torch.Tensor) -> dict[str, torch.Tensor]:
        """The views of ``flat``, made at its first use; made again if its memory moved (``set_``, ``.data =``).
        An entry lives as long as ``flat`` does: it holds no reference to it, only views of its storage."""
        cache, key = self._cache, id(flat)
        hit = cache.get(key)
        if hit is not None and hit[0]() is flat and hit[1] == flat.data_ptr() and hit[2] == flat.dtype:
            return hit[3]
        base = flat.detach()  # a view's ``_base`` would keep ``flat`` itself alive, and with it this entry
        views = {n: base[o:o + s.numel()].view(s) for n, s, o in zip(self.names, self.shapes, self.offsets)}

        def drop(ref, key=key):  # flat is gone: so are its views (they would keep its storage alive)
            if cache.get(key, (None,))[0] is ref:
                del cache[key]

        cache[key] = (weakref.ref(flat, drop), flat.data_ptr(), flat.dtype, views)
        return views

    def items(self):
        return zip(self.names, self.shapes, self.offsets)


_PLACES: "weakref.WeakKeyDictionary[nn.Module, dict]" = weakref.WeakKeyDictionary()


def _places(template: nn.Module, names: tuple[str, ...]) -> list | None:
    """[(the owning submodule's ``_parameters``, attribute, name)] for ``names``, found once per template;
    None when a name is not a parameter there (a buffer, a plain attribute): ``functional_call`` binds it."""
    per = _PLACES.setdefault(template, {})
    if names not in per:
        where = []
        for n in names:
            prefix, _, attr = n.rpartition(".")
            try:
                d = template.get_submodule(prefix)._parameters
            except AttributeError:
                d = {}
            where.append((d, attr, n))
        per[names] = where if all(a in d for d, a, _ in where) else None
    return per[names]


def call(template: nn.Module, params: dict[str, torch.Tensor], *args, **kwargs):
    """Run a weightless template with ``params`` bound for this call only; returns its first output.

    Binds as ``torch.func.functional_call(template, params, args, kwargs, tie_weights=False)`` does
    (each named parameter's entry in its submodule's ``_parameters`` swapped, restored after), with the
    places found once per template (Note: [Binding cost]). A template's submodules stay the ones it
    was built with (``lean.py`` and ``tiling.py`` change forwards, not children).
    """
    where = _places(template, tuple(params))
    if where is None:
        out = torch.func.functional_call(template, params, args, kwargs, tie_weights=False)
    else:
        old = [d[a] for d, a, _ in where]
        try:
            for d, a, n in where:
                d[a] = params[n]
            out = template(*args, **kwargs)
        finally:
            for (d, a, _), o in zip(where, old):
                d[a] = o
    return out[0] if isinstance(out, tuple) else out


def bound(template: nn.Module, params: dict[str, torch.Tensor]) -> nn.Module:
    """A copy of ``template`` (its parameters on the meta device) whose parameters named in ``params`` (by the
    template's own names) are those tensors: what is done to them is done to the tensors.

    Example:
        >>> w = torch.zeros(2, 3)
        >>> _ = bound(nn.Linear(3, 2, bias=False, device="meta"), {"weight": w}).weight.data.fill_(1.0)
        >>> w.sum().item()
        6.0
    """
    mod = copy.deepcopy(template)
    own = dict(mod.named_parameters())
    for name, t in params.items():
        owner, _, leaf = name.rpartition(".")
        p = own[name]
        if t.shape != p.shape:
            raise ValueError(f"{name}: the tensor given is {tuple(t.shape)}, the template's parameter {tuple(p.shape)}")
        (mod.get_submodule(owner) if owner else mod)._parameters[leaf] = nn.Parameter(t, requires_grad=False)
    return mod


def grads_into(params: dict[str, torch.Tensor], flat_grad: torch.Tensor, layout: Layout) -> None:
    """Point each leaf's .grad at its place in ``flat_grad`` so autograd accumulates there in place.

    The places are ``layout``'s cached views of ``flat_grad``: pass the buffer itself (not a fresh slice
    of it each call) to reuse them."""
    for n, v in layout._views(flat_grad).items():
        params[n].grad = v


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

    def hooks(self, flat: torch.Tensor | None = None):
        """The saved-tensor hooks for a call whose weights are views of ``flat``; none (a null context)
        when ``flat`` is not a weight slot: a resident unit's buffer never moves, and each saved tensor's
        hook costs host time (Note: [Binding cost])."""
        if flat is not None and not any(flat is s for s in self.slots):
            return contextlib.nullcontext()
        return torch.autograd.graph.saved_tensors_hooks(self.pack, self.unpack)
