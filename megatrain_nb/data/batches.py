"""Batches for the trainer: a learnable synthetic task, and fine-tuning data (chat, alpaca,
prompt/response, text) through ``sft.py``.

Owns: the public doors to batches of ``{"input_ids", "labels"[, "position_ids"]}`` LongTensors of
shape (batch, seq); the synthetic tasks themselves. Reading, tokenizing and packing fine-tuning
records is ``sft.py``'s.
Does not own: models, devices or the training loop — the engine knows nothing about tokenization
and this module knows nothing about the engine.
"""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Iterator

import torch

from .sft import TOKENIZER_FILES, IGNORE, SftBatches  # noqa: F401  (IGNORE, TOKENIZER_FILES: public here)

KINDS = ("copy", "successor")


# ---- synthetic ----------------------------------------------------------------------------
def synthetic_batches(vocab_size: int, batch: int, seq: int, *, seed: int = 0, kind: str = "copy",
                      period: tuple[int, int] = (8, 24), alphabet: int = 512) -> Iterator[dict]:
    """An endless stream of batches of a synthetic task; tokens come from ``[0, min(alphabet, vocab_size))``.

    ``kind="copy"``: each row is a random motif of ``period`` tokens (length drawn per row)
    repeated to fill ``seq``. The first occurrence cannot be predicted, so its labels are -100;
    every later token copies the one a period earlier. The loss falls from ``ln(vocab_size)`` to
    ``ln(alphabet)`` within a few dozen steps (the model learns which tokens occur); going lower
    needs in-context copying (induction heads), which the tiny demo model has not learned after
    200 steps on CPU.

    ``kind="successor"``: a hidden permutation of the alphabet, fixed by ``seed``, gives each
    token's successor; each row starts at a random token and follows it. A model learns the table
    without attention, so the loss falls *below* ``ln(alphabet)`` within a few dozen steps (the
    tiny model: 9.1 -> ~4.2 in 40 steps at lr 1e-3) and towards 0 with more.

    Args:
        vocab_size: the model's vocabulary.
        batch, seq: rows per batch and tokens per row.
        seed: the stream is a pure function of the arguments (same seed, same batches).
        kind: "copy" or "successor".
        period: "copy" only: (shortest, longest) motif length, inclusive.
        alphabet: how many distinct token ids the task uses.
    Yields:
        {"input_ids": (batch, seq) long, "labels": (batch, seq) long, -100 where unpredictable}
    Raises:
        ValueError: an unknown kind, a non-positive size, or a motif that cannot repeat within seq.
    Example:
        >>> b = next(synthetic_batches(4096, batch=2, seq=64))
        >>> b["input_ids"].shape, b["labels"].dtype
        (torch.Size([2, 64]), torch.int64)
    """
    if kind not in KINDS:
        raise ValueError(f"kind={kind!r}: choose one of {KINDS}")
    for name, v in (("vocab_size", vocab_size), ("batch", batch), ("seq", seq), ("alphabet", alphabet)):
        if not isinstance(v, int) or isinstance(v, bool) or v < 1:
            raise ValueError(f"{name}={v!r}: must be an int >= 1")
    n_tokens = min(alphabet, vocab_size)
    if kind == "successor":
        if seq < 2:
            raise ValueError(f"seq={seq}: need at least 2 tokens per row (a token and its successor)")
        return _successor_stream(n_tokens, batch, seq, seed)
    lo, hi = period
    if not 1 <= lo <= hi or 2 * hi > seq:
        raise ValueError(f"period={period!r} with seq={seq}: need 1 <= shortest <= longest and 2*longest <= seq "
                         "so every row repeats its motif at least once (raise seq or lower period)")
    return _copy_stream(n_tokens, batch, seq, seed, lo, hi)


def _copy_stream(n_tokens: int, batch: int, seq: int, seed: int, lo: int, hi: int) -> Iterator[dict]:
    g = torch.Generator().manual_seed(seed)
    pos = torch.arange(seq)
    while True:
        p = torch.randint(lo, hi + 1, (batch, 1), generator=g)  # (batch, 1) motif length per row
        motif = torch.randint(0, n_tokens, (batch, hi), generator=g)  # (batch, hi) long
        ids = motif.gather(1, pos.expand(batch, seq) % p)  # (batch, seq): row r repeats motif[r, :p[r]]
        labels = ids.masked_fill(pos < p, IGNORE)  # the first motif is unpredictable
        yield {"input_ids": ids, "labels": labels}


def _successor_stream(n_tokens: int, batch: int, seq: int, seed: int) -> Iterator[dict]:
    g = torch.Generator().manual_seed(seed)
    succ = torch.randperm(n_tokens, generator=g)  # (n_tokens,) long: the hidden successor table
    while True:
        ids = torch.empty(batch, seq, dtype=torch.long)
        ids[:, 0] = torch.randint(0, n_tokens, (batch,), generator=g)
        for t in range(1, seq):
            ids[:, t] = succ[ids[:, t - 1]]
        yield {"input_ids": ids, "labels": ids.clone()}


# ---- fine-tuning data (sft.py) -------------------------------------------------------------
def sft_batches(source, tokenizer, *, batch: int, seq: int, pack: bool = True, seed: int = 0) -> SftBatches:
    """Batches for supervised fine-tuning from a file or a data set of records, as notebooks bring them.

    Every record is read, checked and tokenized here, so a bad one fails before training starts,
    named by its line (JSONL), record (JSON) or row (Parquet, ``datasets.Dataset``). The record
    format is detected once per source from the first record and named in every error:

    - chat ``{"messages": [{"role", "content"}, ...]}``: rendered with the tokenizer's chat
      template; loss on every assistant turn (its content and end-of-turn marks) and nowhere else;
    - alpaca ``{"instruction", "input" (optional), "output"}``: prompt ``instruction\n\ninput\n\n``;
    - ``{"prompt", "response"}``: BOS + prompt + response + EOS, loss on the response and EOS;
    - ``{"text"}``: BOS + text + EOS, loss throughout.

    ``pack=True`` fills each row with whole examples in the epoch's order; each attends only to
    itself: its ``position_ids`` restart at 0 and its first token carries no label, so nothing is
    attended or predicted across the seam (docs/api.md, Note: [Document masking] in packing.py).
    ``pack=False`` puts one example per row. The rest of a row is padding (labels -100, positions
    restarting at 0: an example of its own that nothing attends to).

    Args:
        source: a ``.jsonl`` / ``.json`` (a list of records) / ``.parquet`` path (Parquet needs
            pyarrow: the ``datasets`` extra), a ``datasets.Dataset`` or a list of dicts.
        tokenizer: a model directory or a loaded HF tokenizer (a fast one for chat records). A
            directory without tokenizer files, or None, tokenizes UTF-8 bytes, with a warning.
        batch, seq: rows per batch, tokens per row.
        pack: several examples per row (True) or one (False).
        seed: shuffles each epoch (epoch e uses seed + e).
    Returns:
        SftBatches: an endless iterator of ``{"input_ids", "labels", "position_ids"}`` (batch, seq)
        long tensors with ``state_dict()`` / ``load_state_dict()`` and ``one_pass()`` (every
        example once, for ``Session.evaluate``).
    Raises:
        FileNotFoundError: the path does not exist.
        ValueError: empty data, invalid JSON, a record of another format or with wrong types, a
            conversation without an assistant turn, chat records with a tokenizer without a chat
            template, an example longer than ``seq`` (each naming its line / record / row), or no
            example with a supervised token.
    Example:
        >>> it = sft_batches("chats.jsonl", "my-model", batch=8, seq=1024)        # doctest: +SKIP
        >>> b = next(it); saved = it.state_dict()                                 # doctest: +SKIP
    """
    return SftBatches(source, tokenizer, batch=batch, seq=seq, pack=pack, seed=seed)


def jsonl_batches(path: str | os.PathLike, tokenizer_dir: str | os.PathLike | None, batch: int, seq: int, *,
                  seed: int = 0, vocab_size: int | None = None) -> SftBatches:
    """``sft_batches`` of a file with packing, truncating (with a warning) what exceeds ``seq``.

    Kept for existing callers: the same rows as ``sft_batches(path, tokenizer_dir, batch=batch,
    seq=seq)`` except that an over-long example is cut to ``seq`` instead of refused.

    Args:
        path: the data file (any format ``sft_batches`` reads).
        tokenizer_dir: an HF model directory, or None for UTF-8 bytes modulo the vocabulary.
        batch, seq, seed: as ``sft_batches``.
        vocab_size: for the byte fallback; None reads ``config.json`` of ``tokenizer_dir``, else 256.
    Returns:
        SftBatches (``JsonlBatches`` is the same class).
    Raises:
        As ``sft_batches``, less the over-long example.
    Example:
        >>> it = jsonl_batches("train.jsonl", "my-model", batch=8, seq=512)     # doctest: +SKIP
    """
    d = None if tokenizer_dir is None else Path(tokenizer_dir)
    if vocab_size is None and d is not None and (d / "config.json").exists():
        vocab_size = json.loads((d / "config.json").read_text()).get("vocab_size")
    return SftBatches(path, tokenizer_dir, batch=batch, seq=seq, seed=seed, overlong="truncate", vocab_size=vocab_size)


JsonlBatches = SftBatches  # the name before sft_batches
