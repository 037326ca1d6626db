"""Qwen2.5-shaped configs for benchmarks (random init; no download)."""
from transformers import Qwen2Config

SHAPES = {
    "0.5b": dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
                 num_key_value_heads=2, vocab_size=151936, tie_word_embeddings=True),
    "1.5b": dict(hidden_size=1536, intermediate_size=8960, num_hidden_layers=28, num_attention_heads=12,
                 num_key_value_heads=2, vocab_size=151936, tie_word_embeddings=True),
    "3b": dict(hidden_size=2048, intermediate_size=11008, num_hidden_layers=36, num_attention_heads=16,
               num_key_value_heads=2, vocab_size=151936, tie_word_embeddings=True),
    "7b": dict(hidden_size=3584, intermediate_size=18944, num_hidden_layers=28, num_attention_heads=28,
               num_key_value_heads=4, vocab_size=152064, tie_word_embeddings=False),
}


def qwen_config(shape: str, *, layers: int | None = None, seq: int = 4096) -> Qwen2Config:
    kw = dict(SHAPES[shape])
    if layers is not None:
        kw["num_hidden_layers"] = layers
    cfg = Qwen2Config(max_position_embeddings=max(seq, 32768), rope_theta=1e6, **kw)
    cfg._attn_implementation = "sdpa"
    return cfg
