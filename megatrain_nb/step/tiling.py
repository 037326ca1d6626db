"""Long context inside one layer: token-wise parts tiled along the sequence, fused attention, no T x T mask.

Owns: the sequence-tiled autograd function (``Tiled``) and the wrapping of a layer template's
token-wise submodules with it (its RMSNorms and a dense SwiGLU MLP: their whole-sequence
intermediates then exist one tile at a time, in the forward and in the backward), the choice of
rows per tile for a step (``SequenceTiling.prepare``), the SDPA backend the layers run with at long
context (named, never the math kernel, which builds T x T scores), and the refusal of batches for
which Hugging Face would build a T x T mask or score matrix — before any memory is spent.
Does not own: where a layer's checkpoint lives (``planner.place_checkpoints`` decides, the engine
parks), the chunked loss (``Engine._loss``), or any weights (templates stay weightless; the
weights arrive as the views ``binding.call`` binds for one call).

Note: [Tiled recompute] a tiled submodule saves only its input (and its weights, through whatever
saved-tensor hooks are active: ``binding.SlotRefs`` turns weight-slot views into tokens, so the
weights come back from whichever slot holds the layer at backward time) and runs its forward
again, one tile at a time, inside its own backward. The price is one more forward of the MLP per
layer and step (about 2/9 of the layer's matmul FLOPs); what it buys at 512K tokens on the 7B shape
is the MLP's 4 x T x 18944 saved activations (80 GB in bf16) and the norms' fp32 copies (22 GB per
layer). So tiling is on only where the untiled layer would be large (``AUTO_FRACTION``).
"""
from __future__ import annotations

import contextlib
import copy
import operator

import torch
from torch import nn

from ..machine.budget import memory_total
from .transfers import chunks

AUTO_FRACTION = 1 / 8  # tile_tokens=None: tile once one untiled layer's activations exceed this share of memory
AUTO_ROWS = 16384  # rows per tile when tiling is on and tile_tokens is None: GEMMs of 16K rows run at full rate
MASK_LIMIT_BYTES = 1 << 30  # a T x T mask or score matrix above this is refused, not built
ATTENTION_BACKENDS = ("flash", "cudnn", "efficient", "math")  # EngineConfig.attention_backend's choices


class LongContextError(ValueError):
    """A batch that Hugging Face would run with a T x T mask or score matrix too large to build."""


class Tiled(torch.autograd.Function):
    """``fn(x, params)`` computed tile by tile over the rows of ``x``; backward recomputes each tile.

    Saves ``x`` and ``params`` only (Note: [Tiled recompute]). Weight gradients of low-precision
    params are summed over tiles in fp32 and cast once, so a tiled bf16 step rounds them once as the
    untiled matmul does. ``rows >= x.shape[0]``: one tile, ``x`` of any shape, gradients as autograd
    makes them (``lean.py``'s norms: save the input, recompute the forward in the backward).
    """

    @staticmethod
    def forward(ctx, fn, rows: int, x: torch.Tensor, *params: torch.Tensor):  # x: (n, H)
        ctx.fn, ctx.rows = fn, rows
        ctx.save_for_backward(x, *params)
        if rows >= x.shape[0]:
            return fn(x, params)  # one tile (lean.py's norms): no output buffer, x keeps its shape
        out = None
        for a, b in chunks(x.shape[0], rows):
            y = fn(x[a:b], params)
            if out is None:
                out = y.new_empty((x.shape[0], *y.shape[1:]))
            out[a:b] = y
        return out

    @staticmethod
    def backward(ctx, gy: torch.Tensor):
        x, *params = ctx.saved_tensors
        need_x, need_p = ctx.needs_input_grad[2], ctx.needs_input_grad[3:]
        gx = torch.empty_like(x) if need_x else None
        ps = [p.detach().requires_grad_(need) for p, need in zip(params, need_p)]
        if ctx.rows >= x.shape[0]:  # one tile (lean.py's norms): autograd's own gradients, nothing summed or copied
            xc = x.detach().requires_grad_(need_x)
            with torch.enable_grad():
                y = ctx.fn(xc, ps)
            got = iter(torch.autograd.grad(y, [t for t in (xc, *ps) if t.requires_grad], gy))
            return None, None, next(got) if need_x else None, *(next(got) if need else None for need in need_p)
        low = (torch.bfloat16, torch.float16)
        acc = [torch.zeros(p.shape, device=p.device, dtype=torch.float32 if p.dtype in low else p.dtype)
               if need else None for p, need in zip(params, need_p)]
        for a, b in chunks(x.shape[0], ctx.rows):
            xc = x[a:b].detach().requires_grad_(need_x)
            with torch.enable_grad():
                y = ctx.fn(xc, ps)
            wrt = [t for t in (xc, *ps) if t.requires_grad]
            got = iter(torch.autograd.grad(y, wrt, gy[a:b]))
            if need_x:
                gx[a:b] = next(got)
            for g, need in zip(acc, need_p):
                if need:
                    g += next(got)
        grads = [None if g is None else g.to(p.dtype) for g, p in zip(acc, params)]
        return None, None, gx, *grads


class TiledForward:
    """Stands in for a submodule's ``forward``: plain below ``rows`` tokens, ``Tiled`` above."""

    def __init__(self, module: nn.Module):
        self.module = module
        # below the tile size: a forward installed before (lean.py's), else HF's own; params bound by the caller
        self.plain = module.__dict__.get("forward") or type(module).forward.__get__(module)
        self.twin = copy.deepcopy(module)  # weightless (meta) twin: called with explicit params, also in backward
        self.twin.__dict__.pop("forward", None)  # the twin runs HF's own forward
        self.names = [n for n, _ in module.named_parameters()]
        self.get = [operator.attrgetter(n) for n in self.names]
        self.rows = 0  # 0: plain; set per step by SequenceTiling.prepare

    def __call__(self, x: torch.Tensor, *args, **kwargs):
        n = x.numel() // x.shape[-1]
        if args or kwargs or not self.rows or n <= self.rows:
            return self.plain(x, *args, **kwargs)
        params = [g(self.module) for g in self.get]  # the views bound for this call
        y = Tiled.apply(self._fn, self.rows, x.reshape(n, x.shape[-1]), *params)
        return y.view(*x.shape[:-1], y.shape[-1])

    def _fn(self, x: torch.Tensor, params) -> torch.Tensor:
        return torch.func.functional_call(self.twin, dict(zip(self.names, params)), (x,), tie_weights=False)


def is_norm(m: nn.Module) -> bool:
    """Whether ``m`` is an RMSNorm with a weight (a token-wise child ``tile_layer`` and ``lean`` wrap)."""
    return type(m).__name__.endswith("RMSNorm") and isinstance(getattr(m, "weight", None), nn.Parameter)


def is_dense_mlp(m: nn.Module) -> bool:
    """Whether ``m`` is a dense gated MLP (gate, up and down projections; no experts)."""
    return all(isinstance(getattr(m, n, None), nn.Linear) for n in ("gate_proj", "up_proj", "down_proj")) and \
        not any(isinstance(c, nn.ModuleList) for c in m.children())


def tile_layer(template: nn.Module) -> list[str]:
    """Wrap a weightless layer template's token-wise children (its RMSNorms, a dense SwiGLU MLP).

    Each wrapped child runs HF's own forward unchanged until ``SequenceTiling.prepare`` gives it a
    number of rows per tile; then inputs with more rows run through ``Tiled``. MoE blocks, attention
    and anything else stay as they are. Idempotent.

    Args:
        template: a decoder layer from ``hf.Architecture.templates`` (parameters on meta).
    Returns:
        Names of the wrapped children, e.g. ["input_layernorm", "mlp", "post_attention_layernorm"].
    Example:
        >>> arch = load_architecture(config)                   # doctest: +SKIP
        >>> tile_layer(arch.templates[0])                      # doctest: +SKIP
        ['input_layernorm', 'mlp', 'post_attention_layernorm']
    """
    out = []
    for name, child in template.named_children():
        if isinstance(child.__dict__.get("forward"), TiledForward):
            out.append(name)
        elif is_norm(child) or is_dense_mlp(child):
            child.forward = TiledForward(child)
            out.append(name)
    return sorted(out)


class SequenceTiling:
    """The engine's one handle on long context: wraps the templates, then per step checks the batch,
    sets rows per tile and opens the attention backend.

    Args:
        arch: the ``hf.Architecture`` whose templates are wrapped (in place).
        tile_tokens: ``EngineConfig.tile_tokens`` — rows per tile; 0 never tiles; None tiles in
            ``AUTO_ROWS`` rows once one untiled layer's activations would exceed ``AUTO_FRACTION`` of
            device memory (of host RAM on "cpu").
        attention_backend: ``EngineConfig.attention_backend`` — "flash", "cudnn", "efficient" (that one
            first, the other fused ones after it), "math", or None: at long context (T x T scores above
            ``MASK_LIMIT_BYTES``) the fused backends in torch's own order, never math; below it, every
            backend in torch's order, as the plain HF model runs. ``backend`` names the one chosen.
        device: the engine's device.
        dtype_bytes: compute dtype size.
        lean: ``EngineConfig.lean_activations`` — the templates carry ``lean.py``'s forwards, so an untiled
            layer keeps less (the planner's estimate with lean) and tiling starts later.
    Example:
        >>> tiler = SequenceTiling(arch, tile_tokens=None, attention_backend=None, device="cuda")  # doctest: +SKIP
        >>> tiler.prepare(mbs); with tiler.attention(): ...                                       # doctest: +SKIP
    """

    def __init__(self, arch, *, tile_tokens: int | None, attention_backend: str | None, device, dtype_bytes: int = 2,
                 lean: bool = False, device_memory: int | None = None):
        self.arch, self.tile_tokens, self.backend_setting = arch, tile_tokens, attention_backend
        self.device, self.d, self.lean = torch.device(device), dtype_bytes, lean
        self.device_memory = device_memory  # EngineConfig.device_memory: tile_tokens=None's threshold is its share
        for t in arch.templates:
            tile_layer(t)
        self.wrapped = [c.forward for t in arch.templates for c in t.children()
                        if isinstance(c.__dict__.get("forward"), TiledForward)]
        self.rows = 0  # rows per tile this step (0: plain)
        self.backend: str | None = None  # the backend this step's attention runs with; None: torch's default
        self._tokens = None

    # ---- per step ------------------------------------------------------------------------
    def prepare(self, mbs: list[dict]) -> None:
        """Before a step: refuse T x T masks and scores, choose rows per tile and the attention backend.

        Drops an all-ones ``attention_mask`` (the same attention without a mask), so Hugging Face
        takes its ``is_causal`` path. Touches no device memory.

        Raises:
            LongContextError: the batch has padding, or the model runs eager attention or a sliding
                window, at a length where Hugging Face would build a T x T mask or score matrix larger
                than ``MASK_LIMIT_BYTES``; names the size and what to change.
        """
        cfg = self.arch.config
        for mb in mbs:
            mask = mb["attention_mask"]
            if mask is not None and bool(mask.all()):  # host tensor: no device sync
                mb["attention_mask"] = mask = None
            b, T = mb["input_ids"].shape
            _refuse_square(cfg, b, T, mask is not None, self.d)
        tokens = max(mb["input_ids"].numel() for mb in mbs)
        if tokens != self._tokens:
            self._tokens = tokens
            self.rows = self.rows_for(tokens)
            for f in self.wrapped:
                f.rows = self.rows
            self.backend = self._backend_for(max(mb["input_ids"].shape[1] for mb in mbs),
                                             max(mb["input_ids"].shape[0] for mb in mbs))

    def rows_for(self, tokens: int) -> int:
        """Rows per tile for micro-batches of ``tokens`` tokens (0: untiled)."""
        if self.tile_tokens is not None:
            return self.tile_tokens if tokens > self.tile_tokens else 0
        total = memory_total(self.device, self.device_memory)
        return AUTO_ROWS if auto_tiles(self.arch.config, tokens, total, self.d, lean=self.lean) else 0

    def attention(self):
        """Context for a step's compute: the fused SDPA backends at long context, nothing at short context."""
        if self.backend is None:
            return contextlib.nullcontext()
        return _kernel(self.backend_setting)

    def _backend_for(self, T: int, b: int) -> str | None:
        heads = getattr(self.arch.config, "num_attention_heads", 1)
        if self.backend_setting is None and b * heads * T * T * 4 <= MASK_LIMIT_BYTES:
            return None  # short: torch chooses among all its kernels, as the plain HF model does
        return chosen_backend(self.arch.config, self.device, self.d, self.backend_setting)


def _kernel(setting: str | None):
    """sdpa_kernel over the fused backends (torch's own order), or ``setting`` first; math only when named."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    fused = {"flash": SDPBackend.FLASH_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION,
             "efficient": SDPBackend.EFFICIENT_ATTENTION}
    if setting is None:
        return sdpa_kernel(list(fused.values()))
    if setting == "math":
        return sdpa_kernel([SDPBackend.MATH])
    return sdpa_kernel([fused[setting]] + [v for k, v in fused.items() if k != setting], set_priority=True)


def chosen_backend(config, device, dtype_bytes: int = 2, setting: str | None = None) -> str:
    """The SDPA backend torch picks for this model's attention under ``_kernel(setting)``: its name.

    Asked of torch's own dispatcher (``torch._fused_sdp_choice``) with small tensors of the model's
    head layout, causal, no mask and grouped K/V passed as Hugging Face passes them without a mask
    (``enable_gqa=True``, so K/V are never repeated to every query head).

    Raises:
        LongContextError: no fused kernel accepts it (only the math kernel, whose T x T scores would
            not fit, or nothing).
    """
    device = torch.device(device)
    heads = config.num_attention_heads
    kv = getattr(config, "num_key_value_heads", None) or heads
    hd = getattr(config, "head_dim", None) or config.hidden_size // heads
    dt = {2: torch.bfloat16, 4: torch.float32}.get(dtype_bytes, torch.float16)
    q = torch.zeros(1, heads, 128, hd, device=device, dtype=dt)
    k = torch.zeros(1, kv, 128, hd, device=device, dtype=dt)
    names = {0: "math", 1: "flash", 2: "efficient", 3: "cudnn"}
    try:
        with _kernel(setting):
            got = names.get(int(torch._fused_sdp_choice(q, k, k, None, 0.0, True, scale=None, enable_gqa=kv != heads)))
    except RuntimeError as e:
        got, why = None, str(e).splitlines()[0]
    else:
        why = f"torch chose {got}"
    if got is None or (got == "math" and setting != "math"):
        raise LongContextError(f"no fused attention kernel accepts {heads} heads x head_dim {hd} in {dt} on {device} "
                               f"({why}); the math kernel would build T x T scores. Use dtype=torch.bfloat16 on CUDA, "
                               "another attention_backend, or a shorter seq")
    return got


def _refuse_square(config, b: int, T: int, padded: bool, d: int) -> None:
    """Raise where Hugging Face would build a (b, 1, T, T) mask or (b, heads, T, T) scores too large to hold."""
    impl = getattr(config, "_attn_implementation", None) or "sdpa"
    heads = getattr(config, "num_attention_heads", 1)
    window = getattr(config, "sliding_window", None)
    if getattr(config, "use_sliding_window", True) is False:
        window = None
    if impl == "eager" and b * heads * T * T * d > MASK_LIMIT_BYTES:
        raise LongContextError(
            f"{type(config).__name__} runs eager attention (attn_implementation={impl!r}): at seq {T} x batch {b} its "
            f"scores are {b * heads * T * T * d / 2**30:.1f} GiB per layer. Use a model that runs 'sdpa', or seq <= "
            f"{_max_T(b * heads * d)}")
    why = "padding in attention_mask" if padded else f"a sliding window of {window}" if window and T > window else None
    if why and b * T * T > MASK_LIMIT_BYTES:
        raise LongContextError(
            f"the batch has {why}: at seq {T} x batch {b} Hugging Face would build a (b, 1, T, T) attention mask of "
            f"{b * T * T / 2**30:.1f} GiB (limit {MASK_LIMIT_BYTES / 2**30:.0f} GiB) before the first layer. Pass "
            "unpadded rows without attention_mask (one sequence per row, or packed with labels -100 at the joins; "
            f"the causal flag needs no mask), or seq <= {_max_T(b)}")


def _max_T(per_square: int) -> int:
    return int((MASK_LIMIT_BYTES / per_square) ** 0.5)


def auto_tiles(config, tokens: int, total_bytes: int, dtype_bytes: int = 2, *, lean: bool = True) -> bool:
    """tile_tokens=None's rule: one untiled layer's activations (planner's estimate) above ``AUTO_FRACTION``.

    Args:
        config: a transformers config, or a ``shape.model_shape`` dict.
        tokens: tokens per micro-batch.
        total_bytes: device memory (host RAM on "cpu").
        lean: the layers run ``lean.py``'s forwards (``EngineConfig.lean_activations``).
    """
    from ..machine.shape import act_bytes_per_token, model_shape

    try:
        shape = config if isinstance(config, dict) and "params_per_layer" in config else model_shape(config)
        per_token = act_bytes_per_token(shape, dtype_bytes, lean=lean)
    except (ValueError, KeyError, TypeError):
        return False
    return tokens > AUTO_ROWS and tokens * per_token > AUTO_FRACTION * total_bytes
