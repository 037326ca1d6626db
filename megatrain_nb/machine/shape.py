"""What the planner and the memory rules read of a model config: sizes, parameter counts
(``model_shape``) and the bytes one decoder layer keeps per token for its backward
(``act_bytes_per_token``, Note: [Activation estimate]). A leaf module: no package imports, so that
tiling.py, lean.py, preflight.py, the engine and the planner share it without an import circle.
"""
from __future__ import annotations

_MISSING = object()

# Qwen2.5 base models' shapes (their config.json files), for what-if tables; ``model_shape`` reads them as
# they are, a transformers ``Qwen2Config(**{k: v ... if k != "model_type"})`` builds the model's skeleton.
QWEN25 = {
    "3B": dict(model_type="qwen2", hidden_size=2048, intermediate_size=11008, num_hidden_layers=36,
               num_attention_heads=16, num_key_value_heads=2, vocab_size=151936, tie_word_embeddings=True),
    "7B": dict(model_type="qwen2", hidden_size=3584, intermediate_size=18944, num_hidden_layers=28,
               num_attention_heads=28, num_key_value_heads=4, vocab_size=152064, tie_word_embeddings=False),
    "14B": dict(model_type="qwen2", hidden_size=5120, intermediate_size=13824, num_hidden_layers=48,
                num_attention_heads=40, num_key_value_heads=8, vocab_size=152064, tie_word_embeddings=False),
    "32B": dict(model_type="qwen2", hidden_size=5120, intermediate_size=27648, num_hidden_layers=64,
                num_attention_heads=40, num_key_value_heads=8, vocab_size=152064, tie_word_embeddings=False),
}


def _get(config, name: str, default=_MISSING):
    """Field `name` of a config object or dict; ValueError naming it when missing and no default."""
    value = config.get(name, default) if isinstance(config, dict) else getattr(config, name, default)
    if value is _MISSING or (value is None and default is _MISSING):
        raise ValueError(f"config lacks '{name}', which the planner needs; pass a decoder config "
                         f"(transformers PretrainedConfig or dict) that sets it.")
    return value


def model_shape(config) -> dict:
    """Sizes and parameter counts of a decoder-only transformer.

    Counts: attention q/k/v/o (+ q/k/v bias when `attention_bias` or Qwen2, + q/k norms for Qwen3),
    SwiGLU MLP (3 matrices) or MoE experts + router (+ shared expert), two RMSNorms per layer,
    embedding, final norm, and lm_head unless tied; gpt-oss adds its o_proj bias, attention sinks,
    router bias and expert biases. All layers are taken to be alike (Qwen3-MoE's ``mlp_only_layers``
    are counted as MoE layers).

    Args:
        config: a transformers config (its text config is used for multimodal ones) or a dict
            with the same field names.

    Returns:
        dict: hidden, intermediate, layers, heads, kv_heads, head_dim, vocab, tied, experts,
        experts_per_tok, params_per_layer, active_params_per_layer (per token, for FLOPs: the experts at
        experts_per_tok / experts, all else in full), embed_params, head_params (lm_head unless tied, plus
        final norm), n_params, active_params (what model TFLOPS counts: layers x active_params_per_layer +
        embedding + head; n_params for a dense model), and
        layer_tensors: the values of each of a layer's tensors (the experts' as one), summing to
        params_per_layer (which of them keep fp32 moments under a compact optimizer state).

    Raises:
        ValueError: a required field is missing (the message names it).

    Example:
        >>> s = model_shape(dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        ...     num_attention_heads=4, vocab_size=100, tie_word_embeddings=True))
        >>> s["params_per_layer"], s["n_params"]
        (41088, 88640)
    """
    if not isinstance(config, dict) and hasattr(config, "get_text_config"):
        config = config.get_text_config()
    model_type = str(_get(config, "model_type", ""))
    h = int(_get(config, "hidden_size"))
    layers = int(_get(config, "num_hidden_layers"))
    heads = int(_get(config, "num_attention_heads"))
    kv = int(_get(config, "num_key_value_heads", None) or heads)
    hd = int(_get(config, "head_dim", None) or h // heads)
    vocab = int(_get(config, "vocab_size"))
    tied = bool(_get(config, "tie_word_embeddings", False))
    experts = int(_get(config, "num_experts", None) or _get(config, "num_local_experts", None) or 0)
    bias = _get(config, "attention_bias", None)
    bias = model_type in ("qwen2", "qwen2_moe") if bias is None else bool(bias)
    tensors = [h * heads * hd, h * kv * hd, h * kv * hd, heads * hd * h]  # q k v o
    tensors += [heads * hd, kv * hd, kv * hd] if bias else []
    tensors += [hd, hd] if model_type.startswith("qwen3") else []  # q and k norms
    gpt_oss = model_type == "gpt_oss"  # o_proj bias, attention sinks, router and expert biases
    tensors += [h, heads] if gpt_oss else []
    attn = sum(tensors)
    if experts:
        inter = int(_get(config, "moe_intermediate_size", None) or _get(config, "intermediate_size"))
        top_k = int(_get(config, "num_experts_per_tok"))
        shared = int(_get(config, "shared_expert_intermediate_size", None) or 0)
        shared_p = 3 * h * shared + (h if shared else 0)
        expert = 3 * h * inter + (2 * inter + h if gpt_oss else 0)  # gate, up, down (+ their biases)
        router = h * experts + (experts if gpt_oss else 0)
        mlp, active_mlp = experts * expert + router + shared_p, top_k * expert + router + shared_p
        tensors += [experts * 3 * h * inter] + ([experts * 2 * inter, experts * h] if gpt_oss else [])
        tensors += [h * experts] + ([experts] if gpt_oss else []) + ([h * shared] * 3 + [h] if shared else [])
    else:
        inter, top_k = int(_get(config, "intermediate_size")), 0
        mlp = active_mlp = 3 * h * inter
        tensors += [h * inter] * 3
    tensors += [h, h]  # the two norms
    per_layer, embed = attn + mlp + 2 * h, vocab * h
    head = (0 if tied else vocab * h) + h
    active = attn + active_mlp + 2 * h
    return dict(hidden=h, intermediate=inter, layers=layers, heads=heads, kv_heads=kv, head_dim=hd,
                vocab=vocab, tied=tied, experts=experts, experts_per_tok=top_k,
                params_per_layer=per_layer, active_params_per_layer=active,
                embed_params=embed, head_params=head, n_params=layers * per_layer + embed + head,
                active_params=layers * active + embed + head, layer_tensors=tuple(tensors))


# Note: [Activation estimate]
# Bytes autograd keeps per token for one HF-style decoder layer (d = dtype_bytes, q = heads*head_dim,
# kv = kv_heads*head_dim, I = intermediate, or experts_per_tok * moe size):
#   2 RMSNorms (HF eager keeps an fp32 copy of the input, the cast and the scaled output): 2*(4+2d)*hidden
#   attention (flash SDPA keeps q, k, v after rotary and its output; o_proj keeps a copy): d*(3q + 2kv)
#   SwiGLU MLP (gate, silu(gate), up, product):                                             4*d*I
# With lean activations (lean.py, EngineConfig.lean_activations) a norm keeps only its input and the
# next matmul its output, 2*2d*hidden for the two, and a dense gated MLP keeps gate and up, 2*d*I (MoE
# experts are left as they are: 4*d*I). Lean saves 8*hidden + 2*d*I per token (dense), 8*hidden (MoE).
# A recompute block keeps only its input, d*hidden per token. A loss chunk holds its logits in compute
# dtype plus fp32 logits and their fp32 gradient: (d + 8)*vocab per token of the chunk.


def act_bytes_per_token(s: dict, d: int, lean: bool = True) -> int:
    """Per-token activation bytes of one layer, with lean activations or HF's; see Note: [Activation estimate]."""
    q, kv = s["heads"] * s["head_dim"], s["kv_heads"] * s["head_dim"]
    inter = s["intermediate"] * (s["experts_per_tok"] or 1)
    norms = 2 * (2 * d if lean else 4 + 2 * d) * s["hidden"]
    return norms + d * (3 * q + 2 * kv) + (2 if lean and not s["experts"] else 4) * d * inter


LOSS_CHUNK_TOKENS = 1024  # loss_chunk_tokens=None: tokens (rows x positions) per chunk of the loss


def loss_positions(setting: int | None, rows: int) -> int:
    """Sequence positions per chunk of final norm + lm_head + cross-entropy (``EngineConfig.loss_chunk_tokens``).

    A chunk's logits exist in the compute dtype, in fp32 and as an fp32 gradient at once: rows x positions x
    vocab x (dtype + 8) bytes. With a fixed 1024 positions that grew with the batch: at 3B x 16 x 4096, 16K
    tokens of a 151,936-word vocabulary, ~23 GiB beside the kept activations (the loss chunk was the 9.3 GiB
    allocation "stream" ran out of memory on, on the H200, 2026-12-02). ``None`` keeps a chunk at ``LOSS_CHUNK_TOKENS`` tokens
    across the rows, at least one position; an int is the positions, as set.

    Example:
        >>> loss_positions(None, 1), loss_positions(None, 8), loss_positions(None, 4096), loss_positions(512, 8)
        (1024, 128, 1, 512)
    """
    return setting if setting is not None else max(1, LOSS_CHUNK_TOKENS // max(1, rows))
