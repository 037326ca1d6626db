"""Choose the kernels a model's layers run where transformers offers several: the MoE experts'
implementation and, for attention with sinks (gpt-oss), the attention implementation.

Owns: the choice (an explicit setting or the automatic rule), installing it on the weightless
skeleton (``set_experts_implementation`` / ``set_attn_implementation``, which every template and the
reference share), and the report of what was chosen and why (``Session.kernels``).
Does not own: the kernels themselves (transformers' ``integrations/moe.py`` and
``integrations/flex_attention.py``), nor the weights: every implementation reads the experts' stacked
``(experts, ., .)`` parameters as they are, views of the streamed slab (``binding.py``), never copies.

Note: [Experts kernel] transformers runs an experts module (``@use_experts_implementation``) as
"eager" (a Python loop over the experts that got tokens), "grouped_mm" (tokens sorted by expert, one
``torch.nn.functional.grouped_mm`` per projection, fwd and bwd) or "batched_mm" (each token gathers
its experts' weights: (tokens x top_k, out, in) copies, far too much memory to train with). On the
H200 grouped_mm is the CUTLASS grouped GEMM in bf16; on the CPU (torch 2.13) it is the fastest of the
three too: a tiny Qwen3-MoE / gpt-oss (hidden 256, 8 experts, 4 x 64 tokens, fp32, one thread) ran
fwd+bwd in 100 / 110 ms against eager's 194 / 149 and batched_mm's 2474 / 3120, gradients within 1e-7.
So "auto" is grouped_mm wherever torch has it (on CUDA from compute capability 8.0, in bf16 or fp16;
transformers falls back to its own loop for inputs the kernel refuses), else eager. "megatrain_grouped_mm"
runs the same grouped GEMMs with the work around them made cheaper (``experts.py``, Note: [Experts around the
GEMMs]); it is registered with transformers when chosen.

Note: [Sink attention] gpt-oss adds a learned "sink" logit per head to each softmax. SDPA cannot
(transformers refuses it); eager materialises (B, heads, T, T) scores; flex attention runs the
softmax without the sink and renormalises its output by the log-sum-exp it returns, which
transformers does only where flex returns that log-sum-exp: not on the CPU ("Attention sinks cannot
be run on CPU with flex attention"; torch 2.13's flex attention has no backward on the CPU either). So:
flex on CUDA, eager on the CPU (tiny sizes). tests/model/test_gpu_moe.py holds flex against eager on the GPU.
"""
from __future__ import annotations

import torch
from torch import nn

from megatrain_nb.model import experts as grouped

EXPERTS_IMPLEMENTATIONS = ("eager", "grouped_mm", grouped.NAME, "batched_mm")  # EngineConfig.experts_implementation's choices


def experts_modules(module: nn.Module) -> list[tuple[str, nn.Module]]:
    """(name, module) of every experts module in ``module`` that transformers dispatches by implementation."""
    return [(n, m) for n, m in module.named_modules() if hasattr(m, "has_gate") and hasattr(m, "is_transposed")]


def grouped_mm_refusal(device, dtype: torch.dtype) -> str | None:
    """None when torch's grouped GEMM runs on ``device`` in ``dtype``; else why it does not."""
    if not (hasattr(torch.nn.functional, "grouped_mm") or hasattr(torch, "_grouped_mm")):
        return f"torch {torch.__version__} has no grouped_mm"
    dev = torch.device(device)
    if dev.type == "cuda":
        if dtype not in (torch.bfloat16, torch.float16):
            return f"grouped_mm's CUDA kernel is for bf16 / fp16, not {dtype}"
        cap = torch.cuda.get_device_capability(dev)
        if cap < (8, 0):
            return f"grouped_mm needs compute capability 8.0, this GPU has {cap[0]}.{cap[1]}"
    return None


def choose_experts(arch, setting: str | None, device, dtype: torch.dtype) -> tuple[str | None, str]:
    """The experts implementation a session runs (Note: [Experts kernel]) and why.

    Args:
        arch: the model's ``Architecture``.
        setting: ``EngineConfig.experts_implementation``: one of ``EXPERTS_IMPLEMENTATIONS`` or None (auto).
        device, dtype: where and in what the layers compute.
    Returns:
        (implementation, reason); implementation None for a model without experts modules.
    Raises:
        ValueError: ``setting`` is not one of ``EXPERTS_IMPLEMENTATIONS``, or it is "grouped_mm" where
            torch has no grouped GEMM for this device and dtype.
    Example:
        >>> choose_experts(arch, None, "cuda", torch.bfloat16)  # doctest: +SKIP
        ('grouped_mm', 'auto: grouped_mm runs on cuda in torch.bfloat16')
    """
    if setting is not None and setting not in EXPERTS_IMPLEMENTATIONS:
        raise ValueError(f"experts_implementation={setting!r}: use one of {EXPERTS_IMPLEMENTATIONS} or None (auto)")
    if not any(experts_modules(t) for t in arch.templates):
        return None, f"{type(arch.model).__name__} has no experts modules"
    refusal = grouped_mm_refusal(device, dtype)
    if setting in ("grouped_mm", grouped.NAME) and refusal is not None:
        raise ValueError(f"experts_implementation={setting!r}: {refusal}; use 'eager' or None (auto)")
    if setting is not None:
        return setting, f"experts_implementation={setting!r}"
    if refusal is None:
        return "grouped_mm", f"auto: grouped_mm runs on {torch.device(device).type} in {dtype}"
    return "eager", f"auto: {refusal}"


def has_sinks(arch) -> bool:
    """Whether the model's attention adds learned sink logits (gpt-oss's ``self_attn.sinks``)."""
    return any(n.endswith("self_attn.sinks") for t in arch.templates for n, _ in t.named_parameters())


def choose_attention(arch, device) -> tuple[str, str]:
    """The attention implementation a session runs (Note: [Sink attention]) and why.

    Only models with attention sinks are changed; every other model keeps the config's own (sdpa,
    or eager where transformers refuses sdpa; ``packing.install`` may later pick varlen).

    Returns:
        (implementation, reason).
    """
    current = arch.config._attn_implementation
    if not has_sinks(arch):
        return current, "the config's own"
    if torch.device(device).type != "cuda":
        return "eager", "attention sinks: eager on the CPU (transformers' flex attention refuses sinks there)"
    hd = getattr(arch.config, "head_dim", None) or arch.config.hidden_size // arch.config.num_attention_heads
    if hd < 16:  # the compiled flex kernel's limit ("NYI: embedding dimension ... at least 16", torch 2.11 on the H200)
        return "eager", f"attention sinks: head_dim {hd} is under flex attention's 16"
    try:
        from torch.nn.attention.flex_attention import flex_attention  # noqa: F401
    except ImportError:
        return "eager", f"attention sinks: torch {torch.__version__} has no flex_attention"
    if not getattr(type(arch.model), "_supports_flex_attn", False):
        return "eager", f"attention sinks: {type(arch.model).__name__} does not support flex attention"
    return "flex_attention", "attention sinks on CUDA: flex attention (sdpa refuses sinks, eager builds T x T scores)"


def install(arch, *, experts: str | None, device, dtype: torch.dtype) -> dict:
    """Choose and install the experts and attention implementations on ``arch``'s skeleton.

    Args:
        arch: the model's ``Architecture`` (its templates, the prelude and the reference share its config).
        experts: ``EngineConfig.experts_implementation`` (None: auto).
        device, dtype: where and in what the layers compute.
    Returns:
        {"experts": implementation or None, "experts_reason", "attention", "attention_reason"}.
    Raises:
        ValueError: as ``choose_experts``.
    Example:
        >>> install(arch, experts=None, device="cpu", dtype=torch.float32)["experts"]  # doctest: +SKIP
        'grouped_mm'
    """
    impl, why = choose_experts(arch, experts, device, dtype)
    if impl == grouped.NAME:
        grouped.register()
    if impl is not None:
        arch.model.set_experts_implementation(impl)
    attn, attn_why = choose_attention(arch, device)
    if attn != arch.config._attn_implementation:
        arch.model.set_attn_implementation(attn)
    return {"experts": impl, "experts_reason": why, "attention": attn, "attention_reason": attn_why}
