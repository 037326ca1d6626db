"""Packed rows whose examples attend only to themselves: the attention that keeps documents apart.

Owns: turning a packed row's ``position_ids`` (restarting at 0 at each example) into the
arguments of the attention that confines each example to itself, and the varlen attention
function registered with transformers for it (``install``).
Does not own: building packed rows (``sft.py``), nor calling the layers (``hf.py``, ``engine.py``).

Note: [Document masking] a packed row carries no attention_mask, only position_ids that restart
at 0 where an example begins (its first token's label is -100, so nothing predicts across the
seam either). Two mechanisms keep the examples apart, chosen once per session by ``install``:

- transformers' own (every device, dtype and family; the default): ``create_causal_mask`` sees the
  restarts (``masking_utils.find_packed_sequence_indices``) and builds a block-diagonal causal
  mask, one (B, 1, T, T) bool tensor per micro-batch (16 MiB a row at T = 4096), made once in the
  prelude and shared by every layer. sdpa with an explicit mask runs its memory-efficient kernel
  over the whole T x T square rather than flash over the causal half.
- ``"megatrain_varlen"`` (CUDA, bf16/fp16, a torch with ``torch.nn.attention.varlen``, a model
  without sliding windows or attention softcaps): flash attention over cumulative sequence
  lengths. No mask exists; the work is the sum of each example's own square. Rows without
  position_ids (generation, a user's padded batch) go to transformers' sdpa unchanged.
"""
from __future__ import annotations

import inspect

import torch

VARLEN = "megatrain_varlen"  # the attention implementation name registered with transformers


def document_starts(position_ids: torch.Tensor) -> torch.Tensor:
    """(B, T) bool: True where an example starts (the rule of transformers' packed-sequence detection).

    A token starts an example when its position is not the previous one's plus 1; each row's first
    token starts one.
    """
    starts = torch.ones_like(position_ids, dtype=torch.bool)
    starts[:, 1:] = position_ids[:, 1:] != position_ids[:, :-1] + 1
    return starts


def varlen_kwargs(position_ids: torch.Tensor, device: torch.device) -> dict:
    """The flash-attention kwargs of a packed micro-batch, computed on the host (no device sync).

    Args:
        position_ids: (B, T) long, on the host.
    Returns:
        {"cu_seq_lens_q", "cu_seq_lens_k": (n_examples + 1,) int32 on ``device``, "max_length_q",
        "max_length_k": int}: transformers' names for them, so they reach the attention function.
    """
    starts = document_starts(position_ids).flatten().nonzero().flatten()
    cu = torch.cat([starts, torch.tensor([position_ids.numel()])]).to(torch.int32)
    longest = int((cu[1:] - cu[:-1]).max())
    cu = cu.to(device, non_blocking=True)
    return {"cu_seq_lens_q": cu, "cu_seq_lens_k": cu, "max_length_q": longest, "max_length_k": longest}


def varlen_available() -> bool:
    """Whether this torch has ``torch.nn.attention.varlen.varlen_attn`` and a CUDA device."""
    try:
        from torch.nn.attention.varlen import varlen_attn  # noqa: F401
    except ImportError:
        return False
    return torch.cuda.is_available()


def suits_varlen(config, dtype: torch.dtype) -> str | None:
    """None when ``config`` may use varlen attention in ``dtype``; else the reason it may not."""
    if dtype not in (torch.bfloat16, torch.float16):
        return f"flash attention needs bf16 or fp16, not {dtype}"
    if getattr(config, "_attn_implementation", None) != "sdpa":
        return f"the model uses {config._attn_implementation!r} attention, not sdpa"
    types = set(getattr(config, "layer_types", None) or ["full_attention"])
    if getattr(config, "sliding_window", None) and (types != {"full_attention"} or getattr(config, "use_sliding_window", True)):
        return "the model has sliding-window layers"
    if getattr(config, "attn_logit_softcapping", None):
        return "the model caps attention logits"
    return None


def install(config, device: torch.device, dtype: torch.dtype, *, force: bool = False) -> str:
    """Choose the document masking of packed rows for a session (Note: [Document masking]).

    Sets ``config._attn_implementation`` to ``VARLEN`` when the varlen kernel applies (CUDA, half
    precision, torch has it, the model suits it; ``force`` skips the device and torch checks, for
    tests); otherwise leaves the config alone: transformers' own packed masks then apply.

    Returns:
        The attention implementation now in use (``VARLEN`` or the config's own).
    """
    ok = force or (torch.device(device).type == "cuda" and varlen_available())
    if not ok or suits_varlen(config, dtype) is not None:
        return config._attn_implementation
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(VARLEN, _attention)
    AttentionMaskInterface.register(VARLEN, _mask)
    config._attn_implementation = VARLEN
    return VARLEN


def _mask(*args, **kwargs):
    """Mask builder for VARLEN: none for unpadded rows (packed ones are kept apart by cu_seq_lens), sdpa's otherwise."""
    if kwargs.get("attention_mask") is None:
        return None
    from transformers.masking_utils import sdpa_mask

    return sdpa_mask(*args, **kwargs)


def _attention(module, query, key, value, attention_mask, dropout: float = 0.0, scaling=None, **kwargs):
    """transformers attention function: flash varlen for packed micro-batches, sdpa for anything else.

    query: (B, Hq, T, D); key, value: (B, Hkv, T, D). Returns ((B, T, Hq, D), None) as sdpa does.
    """
    cu = kwargs.get("cu_seq_lens_q")
    if cu is None or dropout:
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      **kwargs)
    B, H, T, D = query.shape
    flat = lambda x: x.transpose(1, 2).reshape(B * T, x.shape[1], D)  # noqa: E731  (B*T, heads, D)
    out = _varlen(flat(query), flat(key), flat(value), cu, kwargs["max_length_q"], scaling)
    return out.view(B, T, H, D), None


def _varlen(q, k, v, cu, longest: int, scale):
    """Causal ``varlen_attn`` across the torch versions that changed its arguments (is_causal, enable_gqa)."""
    from torch.nn.attention.varlen import varlen_attn

    params = inspect.signature(varlen_attn).parameters
    kw = {"scale": scale}
    if "is_causal" in params:
        kw["is_causal"] = True
    else:
        kw["window_size"] = (-1, 0)
    if "enable_gqa" in params and k.shape[1] != q.shape[1]:
        kw["enable_gqa"] = True
    return varlen_attn(q, k, v, cu, cu, longest, longest, **kw)
