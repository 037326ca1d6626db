"""Preference data: TRL's ``prompt`` / ``chosen`` / ``rejected`` records -> rows of (chosen, rejected) pairs
for ``losses.dpo``, resumably.

Owns: checking preference records (plain strings or TRL's conversational messages) and naming the
bad one, tokenizing each side as ``sft`` tokenizes a prompt and its response (chat template, BOS /
EOS), the truncation policy, the pair layout, epoch order and the resumable position.
Does not own: the loss, the reference model's log-probs, models or devices.

Note: [Pair layout] row ``2k`` of a batch holds pair k's chosen completion and row ``2k + 1`` its
rejected one, each after the pair's prompt; ``batch["pair"]`` is ``[0, 0, 1, 1, ...]``. A batch
holds ``batch // 2`` whole pairs, so any split of it into micro-batches of an even number of rows
keeps every pair whole, as ``losses.dpo`` needs.

Note: [Truncation] a side longer than ``seq`` tokens loses prompt tokens from the LEFT (the end of
the prompt, next to the completion, is kept; a BOS there goes first) and completion tokens from the
RIGHT (its EOS goes first). With ``L`` the pair's longer completion, each side keeps the last
``min(len(prompt), max(seq - L, max_prompt))`` prompt tokens and then as much of its completion as
fits: short completions leave the whole remaining room to the prompt, long ones are cut so that the
prompt keeps at least ``max_prompt`` tokens (``seq // 2`` unless set). Both sides of a pair are cut
alike. A pair left with a side without a supervised token is skipped, with a warning.
"""
from __future__ import annotations

import math
import warnings

import torch

from . import sft
from .sft import IGNORE, encoder, read_records

KEYS = ("prompt", "chosen", "rejected")
FORMATS = {  # name -> how a record of it looks, for errors
    "standard": '{"prompt": str, "chosen": str, "rejected": str}',
    "conversational": '{"prompt": [{"role", "content"}, ...], "chosen": [{"role": "assistant", "content"}], '
                      '"rejected": [...]}',
}


def _is_messages(x) -> bool:
    return (isinstance(x, list) and len(x) > 0 and
            all(isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
                for m in x))


def _format_of(rec, where: str) -> str:
    """The record's format; raises naming ``where`` and the field that is missing or of the wrong kind."""
    if not isinstance(rec, dict):
        raise ValueError(f"{where}: got a {type(rec).__name__}, not a preference record {FORMATS['standard']}")
    missing = [k for k in KEYS if k not in rec]
    if missing:
        raise ValueError(f"{where}: missing field {missing[0]!r} (the record has {sorted(rec)}); a preference record "
                         f"is {FORMATS['standard']} or {FORMATS['conversational']}")
    conv = isinstance(rec["prompt"], list)  # the prompt decides which format the record means to be
    bad = [k for k in KEYS if not (_is_messages(rec[k]) if conv else isinstance(rec[k], str))]
    if bad:
        v = rec[bad[0]]
        what = "a list, empty or not all messages," if isinstance(v, list) else type(v).__name__
        raise ValueError(f"{where}: field {bad[0]!r} is {what}; the fields must be all strings {FORMATS['standard']} "
                         "or all non-empty lists of chat messages {\"role\": str, \"content\": str}")
    if not conv:
        return "standard"
    for k in ("chosen", "rejected"):
        if not any(m["role"] == "assistant" for m in rec[k]):
            raise ValueError(f"{where}: field {k!r} has no \"assistant\" turn, so it has nothing to learn from")
    return "conversational"


def _side(enc: "sft._Encoder", rec: dict, key: str, fmt: str, where: str) -> tuple[list[int], list[int], list[int]]:
    """(prompt ids, completion ids, completion labels) of the ``key`` side of a checked record."""
    if fmt == "standard":  # as sft's prompt/response: BOS + prompt, then completion + EOS
        completion = enc.wrap(enc.encode(rec[key]), eos=True, bos=False)
        return enc.wrap(enc.encode(rec["prompt"]), eos=False), completion, list(completion)
    tok = enc.tok
    ids, labels = enc.chat(rec["prompt"] + rec[key], where)  # assistant turns (sft's Note: [Assistant tokens])
    head = tok.apply_chat_template(rec["prompt"], tokenize=False, add_generation_prompt=True)
    text = tok.apply_chat_template(rec["prompt"] + rec[key], tokenize=False)
    if not text.startswith(head):
        raise ValueError(f"{where}: the chat template renders the prompt differently once {key!r} follows, so the "
                         "completion's tokens cannot be located; use a template that renders earlier turns unchanged")
    starts = [s for s, _ in tok(text, add_special_tokens=False, return_offsets_mapping=True)["offset_mapping"]]
    n = sum(1 for s in starts if s < len(head))  # tokens of the prompt and its generation prompt: no loss there
    return ids[:n], ids[n:], labels[n:]


def _truncate(sides: list, seq: int, max_prompt: int) -> tuple[list, bool]:
    """Both sides cut to ``seq`` tokens by Note: [Truncation]; whether anything was cut."""
    longest = max(len(c) for _, c, _ in sides)
    out, cut = [], False
    for p, c, lab in sides:
        keep = min(len(p), max(seq - longest, max_prompt))
        room = seq - keep
        cut |= keep < len(p) or len(c) > room
        out.append((p[len(p) - keep:], c[:room], lab[:room]))
    return out, cut


class PreferenceBatches:
    """Batches of whole (chosen, rejected) pairs, cycling epochs; see ``preference_batches``.

    Attributes:
        pairs: [((ids, labels) chosen, (ids, labels) rejected)] lists of int, in the source's order.
        records: the source position (0-based) of each pair's record.
        format: "standard" or "conversational".
        enc: the tokenizer in use (``enc.tok``; None for the byte fallback).
    """

    def __init__(self, source, tokenizer, *, batch: int, seq: int, seed: int = 0, shuffle: bool = True,
                 max_prompt: int | None = None):
        for name, v in (("batch", batch), ("seq", seq)):
            if not isinstance(v, int) or isinstance(v, bool) or v < 2:
                raise ValueError(f"{name}={v!r}: must be an int >= 2")
        if batch % 2:
            raise ValueError(f"batch={batch}: rows come as (chosen, rejected) pairs, so batch must be even; "
                             f"use batch={batch + 1} ({(batch + 1) // 2} pairs) or batch={batch - 1}")
        max_prompt = seq // 2 if max_prompt is None else max_prompt
        if not isinstance(max_prompt, int) or not 1 <= max_prompt < seq:
            raise ValueError(f"max_prompt={max_prompt!r}: must be an int in [1, seq={seq}); it is the prompt tokens "
                             "kept when completions are long (Note: [Truncation])")
        self.batch, self.seq, self.seed, self.shuffle, self.max_prompt = batch, seq, seed, shuffle, max_prompt
        self.enc = encoder(tokenizer, stacklevel=4)
        self.name, records = read_records(source)
        self._read(records)
        self.epoch, self.index = 0, 0
        self._order_epoch, self._order = -1, []

    def _read(self, records: list) -> None:
        if not records:
            raise ValueError(f"{self.name} holds no records: the data is empty")
        where0, rec0 = records[0]
        self.format = _format_of(rec0, where0)
        self.pairs, self.records, truncated, dropped = [], [], 0, []
        for k, (where, rec) in enumerate(records):
            fmt = _format_of(rec, where)
            if fmt != self.format:
                raise ValueError(f"{where}: a {fmt} record, but this data is {self.format} (detected from {where0}); "
                                 "write every record in one format")
            sides, cut = _truncate([_side(self.enc, rec, key, fmt, where) for key in ("chosen", "rejected")],
                                   self.seq, self.max_prompt)
            rows = []
            for p, c, lab in sides:
                labels = [IGNORE] * len(p) + lab
                labels[0] = IGNORE  # nothing predicts a row's first token
                rows.append((p + c, labels))
            if any(all(x == IGNORE for x in labels) for _, labels in rows):
                dropped.append(where)
                continue
            truncated += cut
            self.pairs.append(tuple(rows))
            self.records.append(k)
        if not self.pairs:
            raise ValueError(f"{self.name}: no pair keeps a supervised token on both sides within seq={self.seq} "
                             f"({', '.join(dropped[:3])}...); raise seq or lower max_prompt")
        if dropped:
            warnings.warn(f"{self.name}: skipped {len(dropped)} pair(s) left with a side without a supervised token "
                          f"within seq={self.seq} (first: {dropped[0]})", stacklevel=4)
        if truncated:
            warnings.warn(f"{self.name}: truncated {truncated} pair(s) longer than seq={self.seq} (prompt from the "
                          f"left, completions from the right, the prompt keeping >= {self.max_prompt} tokens)",
                          stacklevel=4)

    # ---- iteration ------------------------------------------------------------------------
    def _order_of(self, epoch: int) -> list[int]:
        if epoch != self._order_epoch:
            if self.shuffle:
                g = torch.Generator().manual_seed(self.seed + epoch)
                self._order = torch.randperm(len(self.pairs), generator=g).tolist()
            else:
                self._order = list(range(len(self.pairs)))
            self._order_epoch = epoch
        return self._order

    def _collate(self, picks: list[int]) -> dict:
        """The batch of pairs ``picks`` (indices into ``pairs``), by Note: [Pair layout]."""
        B, T = 2 * len(picks), self.seq
        ids = torch.full((B, T), self.enc.pad_id, dtype=torch.long)
        labels = torch.full((B, T), IGNORE, dtype=torch.long)
        mask = torch.zeros((B, T), dtype=torch.long)
        for k, i in enumerate(picks):
            for side, (row_ids, row_labels) in enumerate(self.pairs[i]):
                r, n = 2 * k + side, len(row_ids)
                ids[r, :n], labels[r, :n], mask[r, :n] = torch.tensor(row_ids), torch.tensor(row_labels), 1
        return {"input_ids": ids, "labels": labels, "attention_mask": mask,
                "pair": torch.arange(len(picks)).repeat_interleave(2)}

    def __len__(self) -> int:
        """Batches per epoch: every pair once, the last batch topped up from the next epoch."""
        return math.ceil(len(self.pairs) / (self.batch // 2))

    def __iter__(self) -> "PreferenceBatches":
        return self

    def __next__(self) -> dict:
        """{"input_ids", "labels", "attention_mask"}: (batch, seq) long; "pair": (batch,) long."""
        picks = []
        while len(picks) < self.batch // 2:
            picks.append(self._order_of(self.epoch)[self.index])
            self.index += 1
            if self.index == len(self.pairs):
                self.epoch, self.index = self.epoch + 1, 0
        return self._collate(picks)

    def one_pass(self):
        """Batches of every pair once, in epoch 0's order, the last one with fewer pairs if they run
        out; leaves the training position alone (for evaluation)."""
        order, step = list(self._order_of(0)), self.batch // 2
        for a in range(0, len(order), step):
            yield self._collate(order[a:a + step])

    def state_dict(self) -> dict:
        """The position of the next pair: ``{"epoch", "index", "seed", "shuffle", "num_pairs"}``."""
        return {"epoch": self.epoch, "index": self.index, "seed": self.seed, "shuffle": self.shuffle,
                "num_pairs": len(self.pairs)}

    def load_state_dict(self, state: dict) -> None:
        """Resume at a position from ``state_dict``; raises ValueError if it belongs to other data."""
        mine = self.state_dict()
        other = {k: state.get(k) for k in ("num_pairs", "seed", "shuffle")}
        if other != {k: mine[k] for k in other}:
            raise ValueError(f"state is for {other}, but this data has {({k: mine[k] for k in other})}; load the "
                             "state into batches built from the same data with the same seed and shuffle")
        if not 0 <= state.get("index", -1) < len(self.pairs) or state.get("epoch", -1) < 0:
            raise ValueError(f"state position (epoch {state.get('epoch')}, index {state.get('index')}) is out of "
                             f"range for {len(self.pairs)} pairs")
        self.epoch, self.index = int(state["epoch"]), int(state["index"])


def preference_batches(source, tokenizer, *, batch: int, seq: int, seed: int = 0, shuffle: bool = True,
                       max_prompt: int | None = None) -> PreferenceBatches:
    """Batches of (chosen, rejected) pairs for ``losses.dpo`` from TRL's preference records.

    Every record is read, checked and tokenized here, so a bad one fails before training starts,
    named by its line (JSONL), record (JSON, list) or row (Parquet, ``datasets.Dataset``). Two
    formats, detected from the first record, as TRL's preference data sets hold them:

    - standard ``{"prompt": str, "chosen": str, "rejected": str}``: each side is BOS + prompt +
      completion + EOS, as ``sft`` tokenizes ``{"prompt", "response"}``;
    - conversational ``{"prompt": [messages], "chosen": [{"role": "assistant", ...}], "rejected":
      [...]}``: each side is ``prompt + chosen`` (or ``+ rejected``) through the tokenizer's chat
      template; the prompt ends with the generation prompt.

    Labels are the input ids on the completion (for chats: its assistant turns with their
    end-of-turn marks) and -100 on the prompt and the padding. Each row is right-padded to ``seq``
    (``attention_mask`` 0 there). Pairs are adjacent and never split (Note: [Pair layout]); long
    sides are cut by Note: [Truncation].

    Args:
        source: a ``.jsonl`` / ``.json`` / ``.parquet`` path, a ``datasets.Dataset`` or a list of dicts.
        tokenizer: a model directory or a loaded HF tokenizer (with a chat template for chats);
            None tokenizes UTF-8 bytes, with a warning.
        batch: rows per batch, even: ``batch // 2`` pairs.
        seq: tokens per row.
        seed: shuffles each epoch (epoch e uses seed + e).
        shuffle: False keeps the source's order.
        max_prompt: prompt tokens kept when completions are long (default ``seq // 2``).
    Returns:
        PreferenceBatches: an endless iterator of ``{"input_ids", "labels", "attention_mask"}``
        (batch, seq) long and ``"pair"`` (batch,) long, with ``len`` (batches per epoch),
        ``state_dict()`` / ``load_state_dict()`` and ``one_pass()``.
    Raises:
        FileNotFoundError: the path does not exist.
        ValueError: an odd ``batch``, empty data, invalid JSON, a record that is not a dict, lacks a
            field or mixes formats (each naming its line / record / row and the field), chats with
            a tokenizer without a chat template, or no pair with a supervised token on both sides.
    Example:
        >>> import warnings
        >>> records = [{"prompt": "2+2=", "chosen": "4", "rejected": "5"}]
        >>> with warnings.catch_warnings():
        ...     warnings.simplefilter("ignore")  # no tokenizer: UTF-8 bytes
        ...     it = preference_batches(records, None, batch=2, seq=6)
        >>> b = next(it)
        >>> b["pair"].tolist(), b["labels"].tolist()
        ([0, 0], [[-100, -100, -100, -100, 52, -100], [-100, -100, -100, -100, 53, -100]])
    """
    return PreferenceBatches(source, tokenizer, batch=batch, seq=seq, seed=seed, shuffle=shuffle,
                             max_prompt=max_prompt)
