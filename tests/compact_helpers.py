"""Real text for fine-tuning runs, built locally: Python's own standard library sources, a byte-level BPE
tokenizer trained on them, fixed batches of token windows and a small Llama config sized so that most of its
tensors have 4096 values or more (the ones a compact ``optimizer_state`` quantizes).

Used by tests/host/test_compact_finetune.py and notebooks/01_memory_hierarchy.ipynb; nothing is downloaded.
"""
from __future__ import annotations

import sysconfig
from pathlib import Path

import torch

TRAIN_MODULES = ("textwrap.py", "difflib.py", "argparse.py", "pathlib.py", "fractions.py", "statistics.py",
                 "heapq.py", "bisect.py", "calendar.py")
HELDOUT_MODULES = ("shlex.py",)  # never trained on: the held-out loss


def stdlib_text(modules: tuple[str, ...]) -> str:
    """The source (code and docstrings) of ``modules``, files under the running Python's stdlib, joined."""
    root = Path(sysconfig.get_paths()["stdlib"])
    return "\n".join((root / m).read_text(encoding="utf-8") for m in modules)


def text_tokenizer(text: str, vocab_size: int = 512):
    """A byte-level BPE ``tokenizers.Tokenizer`` of ``vocab_size`` tokens trained on ``text`` (every byte encodes)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    bpe.train_from_iterator([text], trainers.BpeTrainer(vocab_size=vocab_size, show_progress=False,
                                                        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    return bpe


def windows(tok, text: str, seq: int) -> torch.Tensor:
    """``text`` tokenized and cut into whole non-overlapping rows: (n, seq) long."""
    ids = torch.tensor(tok.encode(text).ids)  # (tokens,) long
    return ids[: len(ids) // seq * seq].view(-1, seq)


def batches(rows: torch.Tensor, *, batch: int, steps: int, seed: int = 0) -> list[dict]:
    """``steps`` batches of ``batch`` rows, epoch after epoch in a seeded order; labels are the inputs (HF shifts)."""
    g = torch.Generator().manual_seed(seed)
    order = torch.cat([torch.randperm(len(rows), generator=g) for _ in range(steps * batch // len(rows) + 1)])
    return [{"input_ids": rows[order[k * batch:(k + 1) * batch]], "labels": rows[order[k * batch:(k + 1) * batch]]}
            for k in range(steps)]


def stdlib_data(*, vocab_size: int = 512, seq: int = 128) -> dict:
    """{"tokenizer", "train": (n, seq) rows of TRAIN_MODULES, "heldout": (m, seq) rows of HELDOUT_MODULES}."""
    tok = text_tokenizer(stdlib_text(TRAIN_MODULES), vocab_size)
    return {"tokenizer": tok, "train": windows(tok, stdlib_text(TRAIN_MODULES), seq),
            "heldout": windows(tok, stdlib_text(HELDOUT_MODULES), seq)}


def llama_config(vocab_size: int, *, layers: int = 3, hidden: int = 128, intermediate: int = 320, seq: int = 128):
    """A small Llama: 4 heads (2 kv heads), untied head; each projection has >= 8192 values, norms 128."""
    from transformers import LlamaConfig

    return LlamaConfig(vocab_size=vocab_size, hidden_size=hidden, intermediate_size=intermediate,
                       num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                       max_position_embeddings=seq, tie_word_embeddings=False)
