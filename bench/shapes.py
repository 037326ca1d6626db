"""Configs of the benchmarks' model shapes (random init; no download): Qwen2.5-shaped dense models (``SHAPES``)
and gpt-oss-shaped MoE models (``GPT_OSS``: the released 20b and a tiny one for CPU tests). ``bench_config`` is
the one door from a ``--shape`` name to a config.
"""
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


# A gpt-oss of the same kinds at CPU-test size: hidden 64, 2 layers (sliding 32 then full), 4 experts of which 2 per
# token, 4 heads of 16 (2 KV heads), vocab 512; the 20b's rope.
GPT_OSS_TINY = dict(GPT_OSS_20B, hidden_size=64, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                    num_key_value_heads=2, head_dim=16, num_local_experts=4, num_experts_per_tok=2, vocab_size=512,
                    sliding_window=32, layer_types=["sliding_attention", "full_attention"])
GPT_OSS = {"gpt-oss-20b": GPT_OSS_20B, "gpt-oss-tiny": GPT_OSS_TINY}  # by --shape name


def gpt_oss_config(which: str = "gpt-oss-20b", *, layers: int | None = None):
    """A transformers GptOssConfig of ``GPT_OSS[which]``'s shape (``layers`` deep, still alternating sliding and full)."""
    from transformers import GptOssConfig

    kw = {k: v for k, v in GPT_OSS[which].items() if k != "model_type"}
    if layers is not None:
        kinds = ("sliding_attention", "full_attention")
        kw.update(num_hidden_layers=layers, layer_types=[kinds[i % 2] for i in range(layers)])
    return GptOssConfig(**kw)


def bench_config(shape: str, *, layers: int | None = None, seq: int = 4096):
    """The config of a benchmark's ``--shape``: a Qwen2Config (``SHAPES``) or a GptOssConfig (``GPT_OSS``).

    Args:
        shape: a name in ``SHAPES`` or ``GPT_OSS``.
        layers: the depth, where not the shape's own.
        seq: the longest sequence the run uses.
    Raises:
        ValueError: an unknown shape, a depth under 1, or ``seq`` past a gpt-oss shape's positions.
    """
    if layers is not None and layers < 1:
        raise ValueError(f"layers={layers}: give 1 or more, or none for the shape's own depth")
    if shape in SHAPES:
        return qwen_config(shape, layers=layers, seq=seq)
    if shape not in GPT_OSS:
        raise ValueError(f"shape {shape!r}: choose one of {[*SHAPES, *GPT_OSS]}")
    cfg = gpt_oss_config(shape, layers=layers)
    if seq > cfg.max_position_embeddings:
        raise ValueError(f"seq={seq}: {shape} has {cfg.max_position_embeddings} positions; give a shorter seq")
    return cfg
