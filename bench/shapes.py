"""Qwen2.5-shaped configs for benchmarks, and gpt-oss-20b's shape for the MoE plan (random init; no download)."""
from transformers import Qwen2Config

from megatrain_nb.machine.shape import QWEN25

SHAPES = {
    "tiny": dict(hidden_size=64, intermediate_size=160, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, vocab_size=512, tie_word_embeddings=True),  # CPU tests of the benchmarks
    "0.5b": dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
                 num_key_value_heads=2, vocab_size=151936, tie_word_embeddings=True),
    "1.5b": dict(hidden_size=1536, intermediate_size=8960, num_hidden_layers=28, num_attention_heads=12,
                 num_key_value_heads=2, vocab_size=151936, tie_word_embeddings=True),
    # the Qwen2.5 shapes the planner and the preflight know (megatrain_nb.machine.shape.QWEN25): 3b, 7b, 14b, 32b
    **{name.lower(): {k: v for k, v in shape.items() if k != "model_type"} for name, shape in QWEN25.items()},
}


def widened(kw: dict, width: float) -> dict:
    """A shape `width` times as wide: same head size, heads, KV heads and MLP scaled with the hidden size.

    >>> w = widened(SHAPES["3b"], 1.5)
    >>> w["hidden_size"], w["num_attention_heads"], w["num_key_value_heads"], w["intermediate_size"]
    (3072, 24, 3, 16512)
    """
    head_dim = kw["hidden_size"] // kw["num_attention_heads"]
    heads = max(1, round(kw["num_attention_heads"] * width))
    kv = max(1, round(kw["num_key_value_heads"] * width))
    while heads % kv:  # grouped-query attention needs KV heads to divide the heads
        kv -= 1
    return dict(kw, hidden_size=heads * head_dim, num_attention_heads=heads, num_key_value_heads=kv,
                intermediate_size=64 * round(kw["intermediate_size"] * width / 64))


def qwen_config(shape: str, *, layers: int | None = None, seq: int = 4096, width: float = 1.0) -> Qwen2Config:
    kw = dict(SHAPES[shape])
    if layers is not None:
        kw["num_hidden_layers"] = layers
    if width != 1.0:
        kw = widened(kw, width)
    cfg = Qwen2Config(max_position_embeddings=max(seq, 32768), rope_theta=1e6, **kw)
    cfg._attn_implementation = "sdpa"
    return cfg


def count_params(cfg) -> int:
    """Parameters of a Qwen2 config, from its shapes alone (nothing allocated)."""
    d, f, L, V = cfg.hidden_size, cfg.intermediate_size, cfg.num_hidden_layers, cfg.vocab_size
    kv = cfg.num_key_value_heads * (d // cfg.num_attention_heads)
    layer = d * d + 2 * d * kv + (d + 2 * kv) + d * d + 3 * d * f + 2 * d  # q k v (+bias) o, mlp, two norms
    return V * d * (1 if cfg.tie_word_embeddings else 2) + L * layer + d


# gpt-oss-20b as released (its config.json): 24 layers alternating sliding (128) and full attention with sinks,
# 32 experts of which 4 per token, yarn rope x32 over 4096 positions. 20.91B parameters, 4.19B active a token
# (the experts at 4/32; embedding and lm_head counted), for model_shape / plan / a GptOssConfig.
GPT_OSS_20B = dict(model_type="gpt_oss", hidden_size=2880, intermediate_size=2880, num_hidden_layers=24,
                   num_attention_heads=64, num_key_value_heads=8, head_dim=64, num_local_experts=32,
                   num_experts_per_tok=4, vocab_size=201088, tie_word_embeddings=False, attention_bias=True,
                   sliding_window=128, layer_types=["sliding_attention", "full_attention"] * 12,
                   max_position_embeddings=131072, rms_norm_eps=1e-5, swiglu_limit=7.0,
                   rope_parameters=dict(rope_type="yarn", factor=32.0, beta_fast=32.0, beta_slow=1.0, truncate=False,
                                        original_max_position_embeddings=4096, rope_theta=150000.0))


def gpt_oss_config(*, layers: int | None = None):
    """A transformers GptOssConfig of gpt-oss-20b's shape (``layers`` fewer for a smaller run)."""
    from transformers import GptOssConfig

    kw = {k: v for k, v in GPT_OSS_20B.items() if k != "model_type"}
    if layers is not None:
        kw.update(num_hidden_layers=layers, layer_types=kw["layer_types"][:layers])
    return GptOssConfig(**kw)
