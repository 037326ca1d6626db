"""An MoE experts module's forward for training: transformers' grouped GEMMs, with the work around them cheap.

Owns: ``experts_forward`` (registered with transformers' ``ExpertsInterface`` as "megatrain_grouped_mm" by
``register``), the row moves between token order and expert order, and the experts' gate as one fused kernel.
Does not own: the GEMMs (torch's ``grouped_mm``, as transformers calls it), the choice of implementation
(``kernels.py``), nor the weights (views of the streamed slab, never copied).

Note: [Experts around the GEMMs] transformers' "grouped_mm" forward (``integrations/moe.py``) sorts a step's
(token, expert) pairs by expert and runs one grouped GEMM per projection. What it does around them is what a
training step pays for, once per layer forward and once more in every recompute and backward:
  - the per-expert biases gathered for every pair (``bias[expert_ids]``: an (S, 2I) copy, S = tokens x top_k),
    whose backward accumulates S rows into 32 by ``index_put_`` with duplicates;
  - the tokens gathered into expert order and, at the end, the pairs put back by an index with a permutation;
    both backwards are ``index_put_`` accumulations (a sort of S indices, then atomics);
  - the gate (gpt-oss: clamps, a sigmoid and three products over strided halves of an (S, 2I) tensor) as
    separate elementwise kernels, forward and backward.
Here the same values come from: the biases as a GEMM with the pairs' one-hot expert matrix ((S, E) @ (E, out),
whose backward is the transposed GEMM, accumulated in fp32: no gather, no atomics); the row moves as a
gather whose backward is the adjoint gather and a sum over the top_k (no atomics: every token appears
exactly top_k times); the gate compiled into one kernel each way on CUDA (``torch.compile``, the gate's own
code; eager on the CPU). Forward values equal transformers' bit for bit where the gate runs eager (the
one-hot GEMM adds each bias exactly once; tests/model/test_experts.py); gradients agree to rounding.
"""
from __future__ import annotations

import torch

NAME = "megatrain_grouped_mm"  # the implementation's name in transformers' ExpertsInterface


class _ToExperts(torch.autograd.Function):
    """rows[src]: each token's row once per expert it chose, in expert order; backward sums the top_k."""

    @staticmethod
    def forward(ctx, rows, src, inverse, top_k):  # rows (T, H); src (the pairs' tokens), inverse (S,) int64
        ctx.save_for_backward(inverse)
        ctx.top_k = top_k
        return rows.index_select(0, src)

    @staticmethod
    def backward(ctx, grad):  # grad (S, H) in expert order
        (inverse,) = ctx.saved_tensors
        return _from_experts(grad, inverse, ctx.top_k), None, None, None


def _from_experts(pairs, inverse, top_k):
    """pairs (S, H) in expert order -> (T, H): each token's top_k rows summed (fp32 accumulation, one rounding)."""
    return pairs.index_select(0, inverse).view(-1, top_k, pairs.shape[-1]).sum(dim=1)


class _FromExperts(torch.autograd.Function):
    """The adjoint of ``_ToExperts``: pairs back to token order, each token's top_k summed."""

    @staticmethod
    def forward(ctx, pairs, src, inverse, top_k):
        ctx.save_for_backward(src)
        return _from_experts(pairs, inverse, top_k)

    @staticmethod
    def backward(ctx, grad):  # grad (T, H)
        (src,) = ctx.saved_tensors
        return grad.index_select(0, src), None, None, None


def _linear(x, weight, offsets, bias, onehot, transposed: bool):
    """One projection of every pair by its expert: grouped GEMM, then the bias as a one-hot GEMM."""
    w = weight if transposed else weight.transpose(-2, -1)  # (E, in, out)
    gmm = getattr(torch.nn.functional, "grouped_mm", None) or torch._grouped_mm  # the latter before torch 2.10
    out = gmm(x.to(w.dtype), w, offs=offsets)
    if bias is None:
        return out
    return torch.addmm(out, onehot, bias.to(out.dtype))  # out + bias[expert]: one nonzero term a row, exact


def _gpt_oss_gate(gate_up, alpha: float, limit: float):
    """gpt-oss's gate (``GptOssExperts._apply_gate``): interleaved gate / up, clamped, x * sigmoid(alpha x)."""
    gate, up = gate_up[..., ::2], gate_up[..., 1::2]
    gate = gate.clamp(min=None, max=limit)
    up = up.clamp(min=-limit, max=limit)
    return (up + 1) * (gate * torch.sigmoid(gate * alpha))


_compiled = {}


def _fused(fn):
    """``fn`` compiled once for CUDA tensors (one kernel each way; sizes vary by micro-batch, so dynamic)."""
    if fn not in _compiled:
        _compiled[fn] = torch.compile(fn, dynamic=True)
    return _compiled[fn]


def gate(module, gate_up: torch.Tensor) -> torch.Tensor:
    """The experts' gate on (S, 2I) ``gate_up``: fused on CUDA for the gates we know, the module's own otherwise."""
    if type(module).__name__ == "GptOssExperts" and hasattr(module, "alpha") and hasattr(module, "limit"):
        fn = _fused(_gpt_oss_gate) if gate_up.is_cuda else _gpt_oss_gate
        return fn(gate_up, float(module.alpha), float(module.limit))
    return module._apply_gate(gate_up)


def experts_forward(module, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                    top_k_weights: torch.Tensor) -> torch.Tensor:
    """An experts module's forward (transformers' signature): ``hidden_states`` (T, H), ``top_k_index`` and
    ``top_k_weights`` (T, top_k) -> (T, H), as transformers' "grouped_mm" computes it (Note: [Experts around the
    GEMMs]).

    Raises:
        NotImplementedError: expert parallelism, or a post-expert norm (transformers' own forward handles them).
    """
    if getattr(module, "_is_expert_parallel", False) or getattr(module, "has_post_expert_norm", False):
        raise NotImplementedError(f"{NAME}: expert parallelism and post-expert norms: use 'grouped_mm'")
    top_k = top_k_index.shape[-1]
    E = module.num_experts
    ids = top_k_index.reshape(-1)  # (S,)
    ids_sorted, order = torch.sort(ids)  # pairs in expert order (as transformers sorts); order[j]: the pair at j
    inverse = torch.empty_like(order)
    inverse[order] = torch.arange(order.numel(), device=order.device)  # position of each pair
    src = torch.div(order, top_k, rounding_mode="floor")  # the token of the pair at each position
    # histc, not bincount: bincount's CUDA kernel reads the largest id back to the host (a sync)
    counts = torch.histc(ids_sorted.int() if ids.is_cuda else ids_sorted.float(), bins=E, min=0, max=E - 1)
    offsets = torch.cumsum(counts, 0, dtype=torch.int32)
    onehot = None
    if module.has_bias:
        experts_range = torch.arange(E, device=ids.device)
        onehot = (ids_sorted.unsqueeze(-1) == experts_range).to(hidden_states.dtype)  # (S, E); no host sync
    x = _ToExperts.apply(hidden_states, src, inverse, top_k)  # (S, H)
    if module.has_gate:
        h = _linear(x, module.gate_up_proj, offsets, module.gate_up_proj_bias if module.has_bias else None,
                    onehot, module.is_transposed)
        h = gate(module, h)  # (S, I)
    else:
        h = module.act_fn(_linear(x, module.up_proj, offsets, module.up_proj_bias if module.has_bias else None,
                                  onehot, module.is_transposed))
    y = _linear(h, module.down_proj, offsets, module.down_proj_bias if module.has_bias else None, onehot,
                module.is_transposed)  # (S, H)
    y = y * top_k_weights.reshape(-1)[order].unsqueeze(-1)  # promoted as transformers does
    return _FromExperts.apply(y, src, inverse, top_k).to(hidden_states.dtype)


def register() -> str:
    """Make ``experts_forward`` a transformers experts implementation; returns its name (idempotent)."""
    from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS

    if NAME not in ALL_EXPERTS_FUNCTIONS:
        ALL_EXPERTS_FUNCTIONS.register(NAME, experts_forward)
    return NAME
