"""Real text without a download: the running Python's own standard library sources, a byte-level BPE trained on
them, and batches of token windows cut from them.

Why it exists: models and datasets cannot be downloaded where the tests, the notebooks and the GPU benchmarks
run, yet a loss that falls on random tokens says little. Every Python ships its standard library as source, code
and docstrings, a few hundred KB of real text that is the same wherever the same Python runs. ``TRAIN_MODULES``
are trained on; ``HELDOUT_MODULES`` never are (a held-out loss).

Owns: reading those files, training the tokenizer on them (``tokenizers``, which transformers brings), cutting
the tokens into (n, seq) rows and drawing seeded batches of ``{"input_ids", "labels"}`` from them.
Does not own: models or their configs (a test's or a benchmark's), devices or the step.
"""
from __future__ import annotations

import sysconfig
from pathlib import Path

import torch

TRAIN_MODULES = ("textwrap.py", "difflib.py", "argparse.py", "pathlib.py", "fractions.py", "statistics.py",
                 "heapq.py", "bisect.py", "calendar.py")
HELDOUT_MODULES = ("shlex.py",)  # never trained on: the held-out loss


def stdlib_text(modules: tuple[str, ...]) -> str:
    """The source (code and docstrings) of ``modules``, files under the running Python's stdlib, joined by newlines.

    Args:
        modules: file names relative to the stdlib folder, e.g. ``("textwrap.py",)``.
    Returns:
        The files' text, in the order given.
    Raises:
        FileNotFoundError: a module that is not a file there (a package such as ``pathlib/`` on a newer Python).
    Example:
        >>> "def wrap(" in stdlib_text(("textwrap.py",))
        True
    """
    root = Path(sysconfig.get_paths()["stdlib"])
    missing = [m for m in modules if not (root / m).is_file()]
    if missing:
        raise FileNotFoundError(f"{missing}: not files under this Python's stdlib ({root}); name modules that are "
                                f"single .py files there, e.g. {TRAIN_MODULES[:3]}")
    return "\n".join((root / m).read_text(encoding="utf-8") for m in modules)


def text_tokenizer(text: str, vocab_size: int = 512):
    """A byte-level BPE trained on ``text``: every byte encodes, so any string round-trips.

    Args:
        text: the training text.
        vocab_size: tokens at most (256 bytes and the merges learned); fewer where the text has too few pairs.
    Returns:
        A ``tokenizers.Tokenizer``; ``get_vocab_size()`` is at most ``vocab_size``.
    Raises:
        ValueError: ``vocab_size`` under 256, the byte alphabet.
    Example:
        >>> tok = text_tokenizer("def f(x):\\n    return x + 1\\n" * 20, 300)
        >>> tok.decode(tok.encode("return x").ids)
        'return x'
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    if vocab_size < 256:
        raise ValueError(f"vocab_size={vocab_size}: a byte-level BPE needs at least its 256 bytes; give 256 or more")
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    bpe.train_from_iterator([text], trainers.BpeTrainer(vocab_size=vocab_size, show_progress=False,
                                                        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    return bpe


def windows(tok, text: str, seq: int) -> torch.Tensor:
    """``text`` tokenized by ``tok`` and cut into whole non-overlapping rows of ``seq`` tokens (the tail dropped).

    Args:
        tok: a ``tokenizers.Tokenizer`` (``text_tokenizer``'s).
        text: the text.
        seq: tokens per row.
    Returns:
        (n, seq) long; n is 0 where the text holds fewer than ``seq`` tokens.
    Example:
        >>> tok = text_tokenizer("abc abd abe " * 50, 260)
        >>> windows(tok, "abc abd abe " * 50, 16).shape[1]
        16
    """
    ids = torch.tensor(tok.encode(text).ids, dtype=torch.long)  # (tokens,) long
    return ids[: len(ids) // seq * seq].view(-1, seq)


def batches(rows: torch.Tensor, *, batch: int, steps: int, seed: int = 0) -> list[dict]:
    """``steps`` batches of ``batch`` rows, epoch after epoch, each epoch in a seeded order.

    Args:
        rows: (n, seq) long, e.g. ``stdlib_data()["train"]``.
        batch: rows per batch.
        steps: batches to return.
        seed: the order is a pure function of ``rows``, ``batch``, ``steps`` and ``seed``.
    Returns:
        ``[{"input_ids": (batch, seq) long, "labels": a copy of them}]``: labels are the inputs (HF shifts them).
    Raises:
        ValueError: ``rows`` holds fewer than ``batch`` rows.
    Example:
        >>> bs = batches(torch.arange(12).view(6, 2), batch=4, steps=3)
        >>> len(bs), bs[0]["input_ids"].shape
        (3, torch.Size([4, 2]))
    """
    if len(rows) < batch:
        raise ValueError(f"{len(rows)} rows, fewer than batch={batch}: give a smaller batch, shorter rows "
                         f"(seq={rows.shape[-1]}) or more text (more modules)")
    g = torch.Generator().manual_seed(seed)
    order = torch.cat([torch.randperm(len(rows), generator=g) for _ in range(steps * batch // len(rows) + 1)])
    out = []
    for k in range(steps):
        ids = rows[order[k * batch:(k + 1) * batch]]  # (batch, seq) long, a copy
        out.append({"input_ids": ids, "labels": ids.clone()})
    return out


def stdlib_data(*, vocab_size: int = 512, seq: int = 128, train: tuple[str, ...] = TRAIN_MODULES,
                heldout: tuple[str, ...] = HELDOUT_MODULES) -> dict:
    """A tokenizer trained on the ``train`` modules and both sets of modules cut into rows of ``seq`` tokens.

    Args:
        vocab_size: the tokenizer's size at most; keep it at or under the model's vocabulary.
        seq: tokens per row.
        train, heldout: stdlib module files (``stdlib_text``); the tokenizer sees ``train`` only.
    Returns:
        ``{"tokenizer", "train": (n, seq) long, "heldout": (m, seq) long}``; the same on every call.
    Raises:
        FileNotFoundError, ValueError: as ``stdlib_text`` and ``text_tokenizer``.
    Example:
        >>> d = stdlib_data(vocab_size=512, seq=64)
        >>> d["train"].shape[1], int(d["train"].max()) < 512
        (64, True)
    """
    text = stdlib_text(train)
    tok = text_tokenizer(text, vocab_size)
    return {"tokenizer": tok, "train": windows(tok, text, seq), "heldout": windows(tok, stdlib_text(heldout), seq)}
