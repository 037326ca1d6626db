"""Lean activations: a decoder layer's norms and dense gated MLP keep less for their backward.

Owns: the forwards ``lean_layer`` installs on a weightless layer template's RMSNorms and dense gated
MLP (Note: [Lean activations]), the autograd function of the MLP's second half (``GatedDown``), and
switching them on and off for an architecture's templates (``prepare``: the engine's one call).
Does not own: the one-tile recompute of a norm (``tiling.Tiled``, shared with sequence tiling), the
detection of norms and dense MLPs (``tiling.is_norm`` / ``is_dense_mlp``), the memory arithmetic
(``shape.act_bytes_per_token``), or any weights (they arrive as the views ``binding.call`` binds;
saved weights go through whatever saved-tensor hooks are active, e.g. ``binding.SlotRefs``).

Note: [Lean activations] per token of one layer (d = compute dtype bytes, h = hidden, I = intermediate),
Hugging Face's eager modules keep for the backward:
  each RMSNorm: an fp32 copy of its input (4h), its normalized output cast back (d*h), and the next
  matmul keeps its output (d*h); a dense gated MLP: gate, act(gate), up and act(gate)*up (4*d*I).
A lean norm is ``tiling.Tiled`` with one tile: it keeps its input (d*h) and weight and runs HF's own
forward again inside its backward (elementwise), differentiated by autograd. A lean MLP runs gate_proj
and up_proj as HF does (they keep their shared input x) and ``GatedDown`` for down_proj(act(gate) * up):
it keeps gate, up and W_down (2*d*I) and recomputes act(gate) * up (elementwise) in its backward.
Saved: 4h per norm (8h per layer) and 2*d*I per MLP; shape.py's Note: [Activation estimate] has
the formula. Cost: one elementwise forward of the norms and of act(gate) * up per layer in the
backward, no matmul; and host time: each norm's backward is a nested autograd call (~90 us on a
2-core CPU), which ``GatedDown`` avoids for silu and gelu by running the same aten backward kernels
autograd runs (``act_grad_of``; any other activation goes through autograd).
Gradients are made by the same kernels on the same tensors as HF's: bitwise in bf16 (the compute
dtype on CUDA; tests/test_lean.py, CPU); in fp32 a norm's input gradient sums its three terms in
another order (rel ~1e-7). Low-precision weight grads come out of one matmul in the compute dtype, as
autograd's, and accumulate into the engine's flat grad buffer as HF's do.
"""
from __future__ import annotations

import copy

import torch
import torch.nn.functional as F
from torch import nn

from .tiling import Tiled, is_dense_mlp, is_norm, TiledForward


class GatedDown(torch.autograd.Function):
    """``down_proj(act(gate) * up)`` that saves gate, up and W_down only (Note: [Lean activations]).

    Backward recomputes ``h = act(gate) * up``, makes ``grad_h = grad_out @ W`` and
    ``grad_W = grad_out^T @ h`` as autograd's linear (mm) backward does, and backprops ``grad_h``
    through the product and ``act``: with ``act_grad`` (the aten backward kernel autograd itself
    runs for silu / gelu: ``act_grad_of``), else with autograd on the recomputed product.
    """

    @staticmethod
    def forward(ctx, act, act_grad, gate: torch.Tensor, up: torch.Tensor, weight: torch.Tensor, *bias: torch.Tensor):
        # gate, up: (..., I) compute dtype; weight: (H, I); bias: () or ((H,),)
        ctx.act, ctx.act_grad = act, act_grad
        ctx.save_for_backward(gate, up, weight)  # through SlotRefs: the weight comes back from its slot
        return F.linear(act(gate) * up, weight, *bias)

    @staticmethod
    def backward(ctx, gy: torch.Tensor):  # gy: (..., H)
        gate, up, weight = ctx.saved_tensors
        need_gate, need_up, need_w, *need_b = ctx.needs_input_grad[2:]
        g2 = gy.reshape(-1, gy.shape[-1])  # (n, H), as matmul folds a (..., I) input before its mm
        gb = [g2.sum(0) if need else None for need in need_b]  # addmm's bias gradient
        gh = g2.mm(weight).view(gate.shape) if need_gate or need_up else None  # mm_mat1_backward
        if ctx.act_grad is not None:  # no autograd graph: the kernels autograd's MulBackward and act backward run
            a = ctx.act(gate)
            gw = g2.t().mm((a * up).reshape(-1, gate.shape[-1])) if need_w else None  # mm_mat2_backward
            g_up = gh * a if need_up else None
            g_gate = ctx.act_grad(gh * up, gate) if need_gate else None
            return None, None, g_gate, g_up, gw, *gb
        with torch.enable_grad():
            gd, ud = gate.detach().requires_grad_(need_gate), up.detach().requires_grad_(need_up)
            h = ctx.act(gd) * ud  # (..., I): the down_proj input, recomputed
        gw = g2.t().mm(h.detach().reshape(-1, h.shape[-1])) if need_w else None
        wrt = [t for t in (gd, ud) if t.requires_grad]
        got = iter(torch.autograd.grad(h, wrt, gh) if wrt else ())
        return None, None, next(got) if need_gate else None, next(got) if need_up else None, gw, *gb


def act_grad_of(act):
    """The aten kernel autograd runs for ``act``'s backward, ``(grad, input) -> grad_input``, when ``act``
    computes ``F.silu`` or ``F.gelu`` (exact or tanh) bit for bit on a probe; else None (autograd)."""
    g = torch.Generator().manual_seed(0)
    z = torch.randn(257, generator=g) * 4
    try:
        with torch.no_grad():
            y, yb = act(z), act(z.bfloat16())
    except Exception:
        return None
    if torch.equal(y, F.silu(z)) and torch.equal(yb, F.silu(z.bfloat16())):
        return torch.ops.aten.silu_backward
    for how in ("none", "tanh"):
        if torch.equal(y, F.gelu(z, approximate=how)) and torch.equal(yb, F.gelu(z.bfloat16(), approximate=how)):
            return lambda grad, x, how=how: torch.ops.aten.gelu_backward(grad, x, approximate=how)
    return None


class _LeanNorm:
    """A norm's forward: ``Tiled`` with one tile (keeps its input and weight); HF's when no graph is built."""

    def __init__(self, module: nn.Module):
        self.module = module
        self.plain = type(module).forward.__get__(module)  # HF's own; params bound by the caller
        self.twin = copy.copy(module)  # shallow: its own parameter dict, swapped in the backward
        self.twin._parameters = dict(module._parameters)
        self.twin.__dict__.pop("forward", None)
        self.names = [n for n, p in module._parameters.items() if p is not None]

    def __call__(self, x: torch.Tensor, *args, **kwargs):
        if args or kwargs or not torch.is_grad_enabled():
            return self.plain(x, *args, **kwargs)
        return Tiled.apply(self._fn, x.shape[0], x, *(getattr(self.module, n) for n in self.names))

    def _fn(self, x: torch.Tensor, params) -> torch.Tensor:
        """HF's forward with ``params``: the bound views in the forward, the weightless twin in the backward."""
        if all(p is getattr(self.module, n) for n, p in zip(self.names, params)):
            return self.plain(x)  # inside binding.call: no reparametrization needed
        keep = dict(self.twin._parameters)
        self.twin._parameters.update(zip(self.names, params))  # driver thread only: nothing else runs the twin
        try:
            return type(self.module).forward(self.twin, x)
        finally:
            self.twin._parameters = keep


class _LeanMLP:
    """A dense gated MLP's forward: gate_proj and up_proj as HF, then ``GatedDown``."""

    def __init__(self, module: nn.Module):
        self.module = module
        self.plain = type(module).forward.__get__(module)
        self.act_grad = act_grad_of(module.act_fn)

    def __call__(self, x: torch.Tensor, *args, **kwargs):
        m = self.module
        if args or kwargs or not torch.is_grad_enabled():
            return self.plain(x, *args, **kwargs)
        gate, up, down = m.gate_proj(x), m.up_proj(x), m.down_proj  # the views bound for this call
        bias = () if down.bias is None else (down.bias,)
        return GatedDown.apply(m.act_fn, self.act_grad, gate, up, down.weight, *bias)


def _is_gated(m: nn.Module) -> bool:
    """A dense MLP whose own forward is ``down_proj(act_fn(gate_proj(x)) * up_proj(x))``: tried on a small twin."""
    if not (is_dense_mlp(m) and callable(getattr(m, "act_fn", None))):
        return False
    twin = nn.Module()
    g = torch.Generator().manual_seed(0)
    for name, (i, o) in (("gate_proj", (8, 16)), ("up_proj", (8, 16)), ("down_proj", (16, 8))):
        lin = nn.Linear(i, o, bias=getattr(m, name).bias is not None)
        with torch.no_grad():
            for p in lin.parameters():
                p.copy_(torch.randn(p.shape, generator=g))
        twin.add_module(name, lin)
    twin.act_fn = m.act_fn
    x = torch.randn(3, 8, generator=g)
    try:
        with torch.no_grad():
            got = type(m).forward(twin, x)
    except Exception:  # a forward that needs more than these four: not the pattern
        return False
    want = twin.down_proj(twin.act_fn(twin.gate_proj(x)) * twin.up_proj(x))
    return isinstance(got, torch.Tensor) and got.shape == want.shape and torch.equal(got, want)


def _install(child: nn.Module, fwd) -> None:
    """``fwd`` as the child's forward below any sequence tiling (tiling wins above its tile size)."""
    current = child.__dict__.get("forward")
    if isinstance(current, TiledForward):
        current.plain = fwd or type(child).forward.__get__(child)
    elif fwd is None:
        child.__dict__.pop("forward", None)
    else:
        child.forward = fwd


def _lean_of(child: nn.Module):
    current = child.__dict__.get("forward")
    return current.plain if isinstance(current, TiledForward) else current


def lean_layer(template: nn.Module, on: bool = True) -> list[str]:
    """Install (or, with ``on=False``, remove) lean forwards on a layer template's direct children.

    Its RMSNorms and a dense gated MLP (gate_proj, up_proj, down_proj, any elementwise act_fn: SwiGLU,
    GeGLU) get the forwards of Note: [Lean activations]; MoE blocks, attention and anything not
    recognised stay as they are. Idempotent; works under ``tiling.tile_layer``'s wrapping too
    (installed before or after it).

    Args:
        template: a decoder layer from ``hf.Architecture.templates`` (parameters on meta), or any
            decoder layer with real weights.
        on: True installs, False restores Hugging Face's own forwards.
    Returns:
        Names of the children that run lean (after this call), e.g.
        ["input_layernorm", "mlp", "post_attention_layernorm"]; [] with ``on=False``.
    Example:
        >>> arch = load_architecture(config)                   # doctest: +SKIP
        >>> lean_layer(arch.templates[0])                      # doctest: +SKIP
        ['input_layernorm', 'mlp', 'post_attention_layernorm']
    """
    out = []
    for name, child in template.named_children():
        lean = isinstance(_lean_of(child), (_LeanNorm, _LeanMLP))
        if not on:
            if lean:
                _install(child, None)
        elif lean:
            out.append(name)
        elif (is_norm(child) and not any(True for _ in child.children())) or _is_gated(child):
            _install(child, _LeanNorm(child) if is_norm(child) else _LeanMLP(child))
            out.append(name)
    return sorted(out)


# Note: [Lean auto] lean costs every layer a little backward time and spares recompute only where the
# activations do not all fit. Measured on the H200 (3B shape, bench/results/h200-2026-12-01-placement.jsonl):
# lean's backward took 11% longer at 4 x 4096 (8% of a layer's forward + backward) and 3B x 1 ran 236
# instead of 284 TFLOPS with nothing to spare; a recomputed layer costs its forward again, about a
# third of its forward + backward. So lean pays when the layers it keeps from recompute outweigh its
# cost on all of them. Where an untiled layer without lean is large enough for sequence tiling (long
# context), tiling takes the norms and the MLP instead (they keep only their inputs, fewer bytes than
# lean's): under auto the tiling threshold is the one without lean, and lean stays off.
LEAN_COST = 0.08  # lean's backward time, as a share of a layer's forward + backward (H200, 3B x 4)
RECOMPUTE_COST = 1 / 3  # a recomputed layer: its forward again


def choose(layers: int, kept_plain: int, kept_lean: int, *, large: bool = False) -> tuple[bool, str]:
    """``lean_activations=None`` (auto): lean for this batch size, and why (Note: [Lean auto]).

    Args:
        layers: decoder layers.
        kept_plain, kept_lean: layers the activation policy would keep without and with lean.
        large: one untiled layer without lean is as large as sequence tiling's threshold (tiling runs).
    Example:
        >>> choose(36, kept_plain=26, kept_lean=36)[0], choose(36, kept_plain=36, kept_lean=36)[0]
        (True, False)
    """
    spared = max(0, kept_lean - kept_plain)
    if large:
        return False, "sequence tiling takes the norms and the MLP (long context)"
    if spared * RECOMPUTE_COST > layers * LEAN_COST:
        return True, f"keeps {spared} more of {layers} layers from recompute"
    return False, (f"spares {spared} of {layers} layers from recompute: less than its cost on every layer"
                   if spared else "every layer that fits is kept without it")


def auto(shape: dict, *, tokens: int, dtype_bytes: int, room, tiled: bool = False) -> tuple[bool, str]:
    """The engine's ``lean_activations=None`` for one batch size: ``choose`` from the layers each way keeps.

    Args:
        shape: ``shape.model_shape`` of the model.
        tokens: tokens of the whole batch (every micro-batch's activations are kept).
        dtype_bytes: compute dtype bytes.
        room: (device bytes the activation budget leaves, the device's total bytes), or None on the CPU.
        tiled: sequence tiling runs this batch.
    Returns:
        (on, why), as ``choose``.
    """
    from ..machine.shape import act_bytes_per_token
    from .tiling import auto_tiles

    if room is None:
        return False, "device 'cpu': activations live in host RAM"
    free, total = room

    def kept(on):  # as Engine._keep_now decides, layer after layer (4 GiB of headroom, two layers ahead)
        act = tokens * act_bytes_per_token(shape, dtype_bytes, lean=on)
        return min(shape["layers"], max(0, int((free - (4 << 30)) // act) - 1))

    return choose(shape["layers"], kept(False), kept(True),
                  large=tiled or auto_tiles(shape, tokens, total, dtype_bytes, lean=False))


def prepare(arch, on: bool) -> list[list[str]]:
    """The engine's one call: every template of ``arch`` lean (``on``) or Hugging Face's own.

    Args:
        arch: an ``hf.Architecture`` (its templates are changed in place).
        on: ``EngineConfig.lean_activations``.
    Returns:
        Per template, the children that run lean.
    Raises:
        ValueError: ``on`` is not a bool.
    Example:
        >>> prepare(load_architecture(config), on=True)        # doctest: +SKIP
        [['input_layernorm', 'mlp', 'post_attention_layernorm']]
    """
    if not isinstance(on, bool):
        raise ValueError(f"lean_activations={on!r}: use True or False")
    return [lean_layer(t, on) for t in arch.templates]


# ---- measuring what a layer keeps -------------------------------------------------------------
def saved_bytes(fn, exclude=()) -> int:
    """Bytes autograd keeps for the backward of ``fn()``: unique storages packed by saved-tensor hooks.

    Args:
        fn: a callable that builds a graph (its output is held until the count is made).
        exclude: tensors whose storages do not count (weights, inputs shared with other layers).
    Returns:
        The sum of ``untyped_storage().nbytes()`` over distinct storages saved, excluded ones left out.
    Example:
        >>> w = torch.randn(4, 4, requires_grad=True)
        >>> x = torch.randn(8, 4, requires_grad=True)
        >>> saved_bytes(lambda: (x @ w).relu(), exclude=[w])   # x (128 B) and the relu output (128 B)
        256
    """
    skip = {t.untyped_storage().data_ptr() for t in exclude}
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor):
        s = t.untyped_storage()
        if s.data_ptr() not in skip:
            seen[s.data_ptr()] = s.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    del out
    return sum(seen.values())


def layer_bytes_per_token(config, *, lean: bool, tokens: int = 64, dtype: torch.dtype = torch.bfloat16,
                          seed: int = 0) -> float:
    """Measured activation bytes per token that one decoder layer of ``config`` keeps for its backward.

    Builds the architecture's first layer template, binds random weights of the full shape (CPU),
    runs it on ``tokens`` tokens of one sequence with every input requiring grad, and counts with
    ``saved_bytes``: the layer input and every intermediate count; weights and the rotary cos/sin
    (computed once per step and shared by all layers) do not.

    Args:
        config: a transformers decoder config.
        lean: run the layer with lean activations (``lean_layer``) or with Hugging Face's own forwards.
        tokens: sequence length of the one row.
        dtype: compute dtype of weights and activations.
    Returns:
        Bytes per token.
    Example:
        >>> layer_bytes_per_token(qwen_config("3b"), lean=True)   # doctest: +SKIP
    """
    from ..model.binding import call
    from ..model.hf import load_architecture

    arch = load_architecture(config)
    prepare(arch, lean)
    t = arch.templates[0]
    g = torch.Generator().manual_seed(seed)
    params = {n: (torch.randn(p.shape, generator=g) * 0.02).to(dtype).requires_grad_() for n, p in t.named_parameters()}
    x = torch.randn(1, tokens, arch.embed.weight.shape[1], generator=g).to(dtype).requires_grad_()
    h0, calls = arch.prelude(x, None)
    args, kwargs = calls[0]
    shared = [a for a in (*args, *kwargs.values()) for a in (a if isinstance(a, (tuple, list)) else (a,))
              if isinstance(a, torch.Tensor)]
    return saved_bytes(lambda: call(t, params, h0, *args, **kwargs), exclude=[*params.values(), *shared]) / tokens
