"""Batches for the trainer: a learnable synthetic task and JSONL text / prompt-response files.

Owns: turning token sources into ``{"input_ids", "labels"[, "attention_mask"]}`` LongTensor
batches of shape (batch, seq), the byte-level fallback tokenizer, epoch order and the resumable
position in the data.
Does not own: models, devices or the training loop — the engine knows nothing about tokenization
and this module knows nothing about the engine.
"""
from __future__ import annotations

import json
import os
import warnings
from pathlib import Path
from typing import Iterator

import torch

IGNORE = -100  # label of a position that carries no loss (HF's ignore_index)
KINDS = ("copy", "successor")
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json", "spiece.model")


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


# ---- JSONL --------------------------------------------------------------------------------
def jsonl_batches(path: str | os.PathLike, tokenizer_dir: str | os.PathLike | None, batch: int, seq: int, *,
                  seed: int = 0, vocab_size: int | None = None) -> "JsonlBatches":
    """Batches from a JSONL file of ``{"text": ...}`` or ``{"prompt": ..., "response": ...}`` lines.

    Every line is read, checked and tokenized here, so a bad line fails before training starts.

    Args:
        path: the JSONL file.
        tokenizer_dir: an HF model directory. Its tokenizer is used when it has one
            (``AutoTokenizer.from_pretrained``); otherwise, or when None, bytes of the UTF-8 text,
            modulo the vocabulary, with a warning.
        batch, seq: rows per batch, tokens per row.
        seed: shuffles each epoch's order (epoch e uses seed + e).
        vocab_size: for the byte fallback; None reads ``config.json`` of ``tokenizer_dir``, else 256.
    Returns:
        JsonlBatches: an endless iterator with ``state_dict()`` / ``load_state_dict()``.
    Raises:
        FileNotFoundError: ``path`` does not exist.
        ValueError: an empty file, malformed JSON or a line without "text" or "prompt"+"response"
            (names the line number), or no example left with a supervised token.
    Example:
        >>> it = jsonl_batches("train.jsonl", "my-model", batch=8, seq=512)     # doctest: +SKIP
        >>> b = next(it); saved = it.state_dict()                               # doctest: +SKIP
    """
    return JsonlBatches(path, tokenizer_dir, batch, seq, seed=seed, vocab_size=vocab_size)


class JsonlBatches:
    """Packs whole examples into rows of ``seq`` tokens, ``batch`` rows at a time, cycling epochs.

    Each row holds as many whole examples (in the epoch's shuffled order) as fit; the rest of the
    row is padding (attention_mask 0, labels -100). An example longer than ``seq`` is truncated.
    The first token of each example is labelled -100, so no example learns to predict the next
    one. The position (epoch, index of the next example) is the whole state: resuming from a
    ``state_dict`` gives exactly the batches an uninterrupted run would have seen.
    """

    def __init__(self, path, tokenizer_dir, batch: int, seq: int, *, seed: int = 0, vocab_size: int | None = None):
        for name, v in (("batch", batch), ("seq", seq)):
            if not isinstance(v, int) or v < 1:
                raise ValueError(f"{name}={v!r}: must be an int >= 1")
        if seq < 2:
            raise ValueError(f"seq={seq}: need at least 2 tokens per row (a token and the one it predicts)")
        self.path, self.batch, self.seq, self.seed = Path(path), batch, seq, seed
        if not self.path.is_file():  # before the tokenizer: a wrong path is the one message shown
            raise FileNotFoundError(f"data file {str(self.path)!r} does not exist"
                                    + (" (it is a directory)" if self.path.is_dir() else ""))
        encode, self.pad_id, self.bos_id, self.eos_id = _tokenizer(tokenizer_dir, vocab_size)
        self.examples = self._read(encode)  # [(ids, labels)], lists of int
        self.epoch, self.index = 0, 0
        self._order_epoch, self._order = -1, []

    # ---- reading --------------------------------------------------------------------------
    def _read(self, encode) -> list[tuple[list[int], list[int]]]:
        examples, truncated, dropped = [], 0, []
        with self.path.open(encoding="utf-8") as fh:
            for n, line in enumerate(fh, start=1):
                if not line.strip():
                    continue
                try:
                    rec = json.loads(line)
                except json.JSONDecodeError as e:
                    raise ValueError(f"{self.path}:{n}: not valid JSON ({e.msg} at column {e.colno})") from None
                ids, labels = self._example(rec, n, encode)
                if len(ids) > self.seq:
                    ids, labels, truncated = ids[:self.seq], labels[:self.seq], truncated + 1
                labels[0] = IGNORE  # Note: packed rows never learn to predict across examples
                if all(x == IGNORE for x in labels[1:]):
                    dropped.append(n)
                    continue
                examples.append((ids, labels))
        if not examples and not dropped:
            raise ValueError(f"{self.path} holds no examples: the file is empty")
        if not examples:
            raise ValueError(f"{self.path}: no example keeps a supervised token within seq={self.seq} "
                             f"(lines {dropped[:5]}...); raise --seq or shorten the prompts")
        if dropped:
            warnings.warn(f"{self.path}: skipped {len(dropped)} example(s) with no supervised token within "
                          f"seq={self.seq} (first at line {dropped[0]})", stacklevel=3)
        if truncated:
            warnings.warn(f"{self.path}: truncated {truncated} example(s) longer than seq={self.seq}", stacklevel=3)
        return examples

    def _example(self, rec, n: int, encode) -> tuple[list[int], list[int]]:
        if isinstance(rec, dict) and isinstance(rec.get("text"), str):
            ids = self._wrap(encode(rec["text"]), eos=True)
            return ids, list(ids)
        if isinstance(rec, dict) and isinstance(rec.get("prompt"), str) and isinstance(rec.get("response"), str):
            p = self._wrap(encode(rec["prompt"]), eos=False)
            r = self._wrap(encode(rec["response"]), eos=True, bos=False)
            return p + r, [IGNORE] * len(p) + r
        if isinstance(rec, dict):
            wrong = [f"{k!r} is {type(rec[k]).__name__}" for k in ("text", "prompt", "response")
                     if k in rec and not isinstance(rec[k], str)]
            got = f"{', '.join(wrong)}, not a string" if wrong else f"keys {sorted(rec)}"
        else:
            got = f"a JSON {type(rec).__name__}"
        raise ValueError(f"{self.path}:{n}: expected an object with a string \"text\", or string \"prompt\" and "
                         f"\"response\"; got {got}")

    def _wrap(self, ids: list[int], *, eos: bool, bos: bool = True) -> list[int]:
        head = [self.bos_id] if bos and self.bos_id is not None and ids[:1] != [self.bos_id] else []
        tail = [self.eos_id] if eos and self.eos_id is not None else []
        return head + ids + tail

    # ---- iteration ------------------------------------------------------------------------
    def _example_at(self, epoch: int, index: int) -> tuple[list[int], list[int]]:
        if epoch != self._order_epoch:
            g = torch.Generator().manual_seed(self.seed + epoch)
            self._order, self._order_epoch = torch.randperm(len(self.examples), generator=g).tolist(), epoch
        return self.examples[self._order[index]]

    def _take(self) -> tuple[list[int], list[int]]:
        ex = self._example_at(self.epoch, self.index)
        self.index += 1
        if self.index == len(self.examples):
            self.epoch, self.index = self.epoch + 1, 0
        return ex

    def __iter__(self) -> "JsonlBatches":
        return self

    def __next__(self) -> dict:
        """{"input_ids", "labels", "attention_mask"}: each (batch, seq) long."""
        B, T = self.batch, self.seq
        ids = torch.full((B, T), self.pad_id, dtype=torch.long)
        labels = torch.full((B, T), IGNORE, dtype=torch.long)
        mask = torch.zeros((B, T), dtype=torch.long)
        for r in range(B):
            used = 0
            while True:
                ex_ids, ex_labels = self._example_at(self.epoch, self.index)
                if used and used + len(ex_ids) > T:
                    break  # the next example starts the next row
                self._take()
                n = len(ex_ids)
                ids[r, used:used + n] = torch.tensor(ex_ids)
                labels[r, used:used + n] = torch.tensor(ex_labels)
                mask[r, used:used + n] = 1
                used += n
                if used == T:
                    break
        return {"input_ids": ids, "labels": labels, "attention_mask": mask}

    def state_dict(self) -> dict:
        """The position of the next example: ``{"epoch", "index", "seed", "num_examples"}``."""
        return {"epoch": self.epoch, "index": self.index, "seed": self.seed, "num_examples": len(self.examples)}

    def load_state_dict(self, state: dict) -> None:
        """Resume at a position from ``state_dict``; raises ValueError if it belongs to other data."""
        if state.get("num_examples") != len(self.examples) or state.get("seed") != self.seed:
            raise ValueError(f"state is for {state.get('num_examples')} examples with seed {state.get('seed')}, "
                             f"but this file has {len(self.examples)} with seed {self.seed}")
        if not 0 <= state["index"] < len(self.examples) or state["epoch"] < 0:
            raise ValueError(f"state position (epoch {state['epoch']}, index {state['index']}) is out of range")
        self.epoch, self.index = int(state["epoch"]), int(state["index"])


def _tokenizer(model_dir, vocab_size: int | None):
    """(encode(str) -> list[int], pad_id, bos_id, eos_id) from the model's tokenizer, or bytes."""
    d = None if model_dir is None else Path(model_dir)
    if d is not None and any((d / f).exists() for f in _TOKENIZER_FILES):
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(str(d))
        pad = next((t for t in (tok.pad_token_id, tok.eos_token_id) if t is not None), 0)
        encode = lambda s: tok(s, add_special_tokens=False)["input_ids"]  # noqa: E731  (bos/eos: _wrap)
        return encode, pad, tok.bos_token_id, tok.eos_token_id
    if vocab_size is None and d is not None and (d / "config.json").exists():
        vocab_size = json.loads((d / "config.json").read_text()).get("vocab_size")
    V = vocab_size or 256
    where = "no model directory given" if d is None else f"{str(d)!r} has no tokenizer files"
    warnings.warn(f"{where}: tokenizing as UTF-8 bytes modulo vocab_size={V} (fine for smoke tests, "
                  "meaningless for a pretrained model)", stacklevel=4)
    return (lambda s: [b % V for b in s.encode("utf-8")]), 0, None, None
