"""The small Llama the compact-moment fine-tuning runs train: sized so that most of its tensors have 4096 values or
more (the ones a compact ``optimizer_state`` quantizes). The text they train on is the package's
(``megatrain_nb.data.stdlib_text``: the standard library's sources, a BPE trained on them, batches of windows).

Used by tests/host/test_compact_finetune.py and notebooks/01_memory_hierarchy.ipynb; nothing is downloaded.
"""
from __future__ import annotations


def llama_config(vocab_size: int, *, layers: int = 3, hidden: int = 128, intermediate: int = 320, seq: int = 128):
    """A small Llama: 4 heads (2 kv heads), untied head; each projection has >= 8192 values, norms 128."""
    from transformers import LlamaConfig

    return LlamaConfig(vocab_size=vocab_size, hidden_size=hidden, intermediate_size=intermediate,
                       num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                       max_position_embeddings=seq, tie_word_embeddings=False)
