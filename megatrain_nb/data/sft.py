"""Supervised fine-tuning data: records -> tokenized examples -> rows of ``seq`` tokens, resumably.

Owns: reading records (JSONL, JSON, Parquet, a ``datasets.Dataset`` or a list of dicts), detecting
one record format per source (chat, alpaca, prompt/response, text) and naming it in errors,
rendering chats with the tokenizer's chat template with loss on assistant turns only, packing
examples into rows where each attends only to itself (Note: [Document masking] in packing.py) or
one example per padded row, epoch order and the resumable position. ``data.sft_batches`` and
``data.jsonl_batches`` are its public doors.
Does not own: models, devices, the engine or the attention itself.

Note: [Assistant tokens] a chat template marks no turns, so the assistant's tokens are found by
rendering: for each assistant turn k, the text of turns < k with the generation prompt, then of
turns <= k; the characters between the two are that turn's (its content and end-of-turn marks).
The whole conversation is tokenized once, and a token is supervised when its first character
lies in an assistant span (``return_offsets_mapping``). A template that renders an earlier turn
differently once later turns follow (one that drops past reasoning, say) is refused by name.
"""
from __future__ import annotations

import json
import os
import warnings
from pathlib import Path

import torch

IGNORE = -100  # as data.IGNORE (HF's ignore_index); data imports this module lazily, not the reverse
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json", "spiece.model")
FORMATS = {  # name -> (required string keys, how a record of it looks, for errors)
    "chat": (("messages",), '{"messages": [{"role": ..., "content": ...}, ...]}'),
    "alpaca": (("instruction", "output"), '{"instruction": ..., "input": ..., "output": ...}'),
    "prompt/response": (("prompt", "response"), '{"prompt": ..., "response": ...}'),
    "text": (("text",), '{"text": ...}'),
}


# ---- tokenizers ---------------------------------------------------------------------------
def load_tokenizer(tokenizer):
    """A loaded HF tokenizer as is; a model directory's tokenizer; None for a directory without one."""
    if tokenizer is None or not isinstance(tokenizer, (str, os.PathLike)):
        return tokenizer
    d = Path(tokenizer)
    if not d.is_dir():
        raise FileNotFoundError(f"tokenizer {str(d)!r}: no such directory; pass a model directory or a loaded tokenizer")
    if not any((d / f).exists() for f in TOKENIZER_FILES):
        return None
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(d))


def prompt_ids(tok, prompt) -> list[int]:
    """Token ids of a generation prompt, as training saw its kind: a chat (list of messages) through the
    chat template with the generation prompt; a string as a prompt/response prompt (BOS + text)."""
    if isinstance(prompt, str):
        enc = _Encoder(tok, None)
        return enc.wrap(enc.encode(prompt), eos=False)
    if isinstance(prompt, (list, tuple)) and all(isinstance(m, dict) for m in prompt):
        _needs_template(tok, "generate")
        text = tok.apply_chat_template(list(prompt), tokenize=False, add_generation_prompt=True)
        return tok(text, add_special_tokens=False)["input_ids"]
    raise TypeError(f"prompt is {type(prompt).__name__}: pass a string, a list of chat messages "
                    "[{'role': ..., 'content': ...}] or a LongTensor of token ids")


def _needs_template(tok, where: str) -> None:
    if tok is None or not getattr(tok, "chat_template", None):
        name = "the byte fallback (no tokenizer)" if tok is None else type(tok).__name__
        raise ValueError(f"{where}: chat messages need a tokenizer with a chat template, and {name} has none; set "
                         "tokenizer.chat_template to a Jinja template (or use a model directory whose "
                         "tokenizer_config.json has one), or write the records as {\"prompt\", \"response\"}")


def encoder(tokenizer, vocab_size: int | None = None, *, stacklevel: int = 2) -> "_Encoder":
    """The records' encoder: ``tokenizer`` (a directory or a loaded HF tokenizer) loaded, or UTF-8 bytes modulo
    ``vocab_size`` (256 if None) with a warning where there is none (``stacklevel``: the user's call)."""
    tok = load_tokenizer(tokenizer)
    if tok is None:
        where = "no tokenizer given" if tokenizer is None else f"{str(tokenizer)!r} has no tokenizer files"
        warnings.warn(f"{where}: tokenizing as UTF-8 bytes modulo vocab_size={vocab_size or 256} (fine for smoke "
                      "tests, meaningless for a pretrained model)", stacklevel=stacklevel + 1)
    return _Encoder(tok, vocab_size)


class _Encoder:
    """Text -> ids with the HF tokenizer, or UTF-8 bytes modulo ``vocab_size`` without one."""

    def __init__(self, tok, vocab_size: int | None):
        self.tok = tok
        if tok is None:
            self.vocab = vocab_size or 256
            self.pad_id, self.bos_id, self.eos_id = 0, None, None
        else:
            self.pad_id = next((t for t in (tok.pad_token_id, tok.eos_token_id) if t is not None), 0)
            self.bos_id, self.eos_id = tok.bos_token_id, tok.eos_token_id

    def encode(self, text: str) -> list[int]:
        if self.tok is None:
            return [b % self.vocab for b in text.encode("utf-8")]
        return self.tok(text, add_special_tokens=False)["input_ids"]  # bos / eos: wrap

    def wrap(self, ids: list[int], *, eos: bool, bos: bool = True) -> list[int]:
        head = [self.bos_id] if bos and self.bos_id is not None and ids[:1] != [self.bos_id] else []
        return head + ids + ([self.eos_id] if eos and self.eos_id is not None else [])

    def chat(self, messages: list[dict], where: str) -> tuple[list[int], list[int]]:
        """(ids, labels) of a conversation; labels on assistant turns only (Note: [Assistant tokens])."""
        tok = self.tok
        _needs_template(tok, where)
        render = lambda ms, gen=False: tok.apply_chat_template(ms, tokenize=False, add_generation_prompt=gen)  # noqa: E731
        text, spans = render(messages), []
        for k, m in enumerate(messages):
            if m["role"] != "assistant":
                continue
            before = render(messages[:k], True) if k else ""
            upto = render(messages[:k + 1])
            if not (upto.startswith(before) and text.startswith(upto)):
                raise ValueError(f"{where}: the chat template renders the turns before assistant turn {k} differently "
                                 "once later turns follow, so that turn's tokens cannot be located; use a template "
                                 "that renders earlier turns unchanged, or split the conversation")
            spans.append((len(before), len(upto)))
        enc = tok(text, add_special_tokens=False, return_offsets_mapping=True)
        labels = [t if any(a <= s < b for a, b in spans) else IGNORE
                  for t, (s, _) in zip(enc["input_ids"], enc["offset_mapping"])]
        return list(enc["input_ids"]), labels


# ---- records ------------------------------------------------------------------------------
def read_records(source) -> tuple[str, list]:
    """(name of the source, [(where, record)]) where ``where`` names the line / record / row for errors."""
    if isinstance(source, (list, tuple)):
        return "records", [(f"record {k}", r) for k, r in enumerate(source, start=1)]
    if not isinstance(source, (str, os.PathLike)):
        if hasattr(source, "column_names") and hasattr(source, "__iter__"):  # a datasets.Dataset
            return "dataset", [(f"dataset row {k}", r) for k, r in enumerate(source, start=1)]
        raise TypeError(f"source is {type(source).__name__}: pass a .jsonl / .json / .parquet path, a "
                        "datasets.Dataset or a list of dicts")
    path = Path(source)
    if not path.is_file():
        raise FileNotFoundError(f"data file {str(path)!r} does not exist" + (" (it is a directory)" if path.is_dir() else ""))
    if path.suffix == ".parquet":
        try:
            import pyarrow.parquet as pq
        except ImportError:
            raise ImportError(f"{path}: reading Parquet needs pyarrow: pip install 'megatrain_nb[datasets]'") from None
        return str(path), [(f"{path}: row {k}", r) for k, r in enumerate(pq.read_table(path).to_pylist(), start=1)]
    if path.suffix == ".json":
        try:
            records = json.loads(path.read_text(encoding="utf-8"))
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}:{e.lineno}: not valid JSON ({e.msg} at column {e.colno})") from None
        if not isinstance(records, list):
            raise ValueError(f"{path}: a .json file must hold a list of records, not a JSON {type(records).__name__} "
                             "(or write one record per line as .jsonl)")
        return str(path), [(f"{path}: record {k}", r) for k, r in enumerate(records, start=1)]
    out = []
    with path.open(encoding="utf-8") as fh:
        for n, line in enumerate(fh, start=1):
            if line.strip():
                try:
                    out.append((f"{path}:{n}", json.loads(line)))
                except json.JSONDecodeError as e:
                    raise ValueError(f"{path}:{n}: not valid JSON ({e.msg} at column {e.colno})") from None
    return str(path), out


def detect_format(rec) -> str | None:
    """The format whose keys ``rec`` has ("chat", "alpaca", "prompt/response", "text"), or None."""
    if isinstance(rec, dict):
        for name, (keys, _) in FORMATS.items():
            if all(k in rec for k in keys):
                return name
    return None


def _check(rec, fmt: str, where: str, first: str) -> None:
    """Raise naming ``where`` unless ``rec`` is a well-formed record of ``fmt``."""
    keys, shape = FORMATS[fmt]
    got = detect_format(rec)
    if got != fmt:
        what = f"keys {sorted(rec)}" if isinstance(rec, dict) else f"a JSON {type(rec).__name__}"
        raise ValueError(f"{where}: expected a {fmt!r} record {shape}, the format of this data ({first}); got {what}")
    strings = [k for k in keys + (("input",) if fmt == "alpaca" else ()) if k in rec and k != "messages"]
    wrong = [f"{k!r} is {type(rec[k]).__name__}" for k in strings if not isinstance(rec[k], str)]
    if wrong:
        raise ValueError(f"{where}: {', '.join(wrong)}, not a string ({fmt!r} record {shape})")
    if fmt == "chat":
        ms = rec["messages"]
        bad = (not isinstance(ms, list) or not ms or
               not all(isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
                       for m in ms))
        if bad:
            raise ValueError(f"{where}: \"messages\" must be a non-empty list of {{\"role\": str, \"content\": str}}")
        if not any(m["role"] == "assistant" for m in ms):
            raise ValueError(f"{where}: the conversation has no \"assistant\" turn, so nothing would be learned")


def tokenize(rec, fmt: str, enc: _Encoder, where: str) -> tuple[list[int], list[int]]:
    """(ids, labels) of one checked record. Prompt parts carry -100; text is supervised throughout."""
    if fmt == "chat":
        return enc.chat(rec["messages"], where)
    if fmt == "text":
        ids = enc.wrap(enc.encode(rec["text"]), eos=True)
        return ids, list(ids)
    if fmt == "alpaca":
        prompt = rec["instruction"] + (f"\n\n{rec['input']}" if rec.get("input") else "") + "\n\n"
        response = rec["output"]
    else:
        prompt, response = rec["prompt"], rec["response"]
    p = enc.wrap(enc.encode(prompt), eos=False)
    r = enc.wrap(enc.encode(response), eos=True, bos=False)
    return p + r, [IGNORE] * len(p) + r


# ---- batches ------------------------------------------------------------------------------
class SftBatches:
    """Rows of ``seq`` tokens, ``batch`` rows at a time, cycling shuffled epochs; see ``data.sft_batches``.

    Attributes:
        examples: [(ids, labels)] lists of int, in the source's order.
        format: the detected record format.
        first_record: the source's first record (the CLI's sample prompt comes from it).
        enc: the tokenizer in use (``enc.tok``; None for the byte fallback).
    """

    def __init__(self, source, tokenizer, *, batch: int, seq: int, pack: bool = True, seed: int = 0,
                 overlong: str = "error", vocab_size: int | None = None):
        for name, v in (("batch", batch), ("seq", seq)):
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"{name}={v!r}: must be an int >= 1")
        if seq < 2:
            raise ValueError(f"seq={seq}: need at least 2 tokens per row (a token and the one it predicts)")
        if overlong not in ("error", "truncate"):
            raise ValueError(f"overlong={overlong!r}: 'error' or 'truncate'")
        self.batch, self.seq, self.pack, self.seed = batch, seq, pack, seed
        self.enc = encoder(tokenizer, vocab_size, stacklevel=4)
        self.name, records = read_records(source)
        self.examples = self._read(records, overlong)
        self.epoch, self.index = 0, 0
        self._order_epoch, self._order = -1, []

    def _read(self, records: list, overlong: str) -> list[tuple[list[int], list[int]]]:
        if not records:
            raise ValueError(f"{self.name} holds no records: the data is empty")
        where0, rec0 = records[0]
        self.format, self.first_record = detect_format(rec0), rec0
        if self.format is None:
            shapes = "; ".join(f"{k}: {v[1]}" for k, v in FORMATS.items())
            got = f"keys {sorted(rec0)}" if isinstance(rec0, dict) else f"a JSON {type(rec0).__name__}"
            raise ValueError(f"{where0}: got {got}, which is none of the record formats ({shapes})")
        first = f"detected from {where0}"
        examples, truncated, dropped = [], 0, []
        for where, rec in records:
            _check(rec, self.format, where, first)
            ids, labels = tokenize(rec, self.format, self.enc, where)
            if len(ids) > self.seq:
                if overlong == "error":
                    raise ValueError(f"{where}: the example is {len(ids)} tokens, longer than seq={self.seq}; raise "
                                     "seq, or shorten or split the example")
                ids, labels, truncated = ids[:self.seq], labels[:self.seq], truncated + 1
            labels[0] = IGNORE  # Note: [Document masking] nothing is learned across the seam of a packed row
            if all(x == IGNORE for x in labels[1:]):
                dropped.append(where)
                continue
            examples.append((ids, labels))
        if not examples:
            raise ValueError(f"{self.name}: no example keeps a supervised token within seq={self.seq} "
                             f"({', '.join(dropped[:3])}...); raise seq or shorten the prompts")
        if dropped:
            warnings.warn(f"{self.name}: skipped {len(dropped)} example(s) with no supervised token within "
                          f"seq={self.seq} (first: {dropped[0]})", stacklevel=4)
        if truncated:
            warnings.warn(f"{self.name}: truncated {truncated} example(s) longer than seq={self.seq}", stacklevel=4)
        return examples

    # ---- iteration ------------------------------------------------------------------------
    def _order_of(self, epoch: int) -> list[int]:
        if epoch != self._order_epoch:
            g = torch.Generator().manual_seed(self.seed + epoch)
            self._order, self._order_epoch = torch.randperm(len(self.examples), generator=g).tolist(), epoch
        return self._order

    def _rows(self, cursor: list, stop_at_epoch_end: bool) -> dict | None:
        """Up to ``batch`` rows from ``cursor`` = [epoch, index] (advanced in place); None when stopped."""
        B, T = self.batch, self.seq
        ids = torch.full((B, T), self.enc.pad_id, dtype=torch.long)
        labels = torch.full((B, T), IGNORE, dtype=torch.long)
        pos = torch.zeros((B, T), dtype=torch.long)
        rows = 0
        for r in range(B):
            used = 0
            while not (stop_at_epoch_end and cursor[0] > 0):
                ex_ids, ex_labels = self.examples[self._order_of(cursor[0])[cursor[1]]]
                n = len(ex_ids)
                if used and (not self.pack or used + n > T):
                    break  # the next example starts the next row
                ids[r, used:used + n], labels[r, used:used + n] = torch.tensor(ex_ids), torch.tensor(ex_labels)
                pos[r, used:used + n] = torch.arange(n)  # Note: [Document masking] positions restart per example
                used += n
                cursor[1] += 1
                if cursor[1] == len(self.examples):
                    cursor[0], cursor[1] = cursor[0] + 1, 0
                if used == T:
                    break
            if not used:
                break
            pos[r, used:] = torch.arange(T - used)  # the padding is an example of its own: nothing attends to it
            rows += 1
        if not rows:
            return None
        return {"input_ids": ids[:rows], "labels": labels[:rows], "position_ids": pos[:rows]}

    def __iter__(self) -> "SftBatches":
        return self

    def __next__(self) -> dict:
        """{"input_ids", "labels", "position_ids"}: each (batch, seq) long."""
        cursor = [self.epoch, self.index]
        out = self._rows(cursor, stop_at_epoch_end=False)
        self.epoch, self.index = cursor
        return out

    def one_pass(self):
        """Batches of every example once, in epoch 0's order, the last one with fewer rows if the
        examples run out; leaves the training position alone (``Session.evaluate`` reads this)."""
        cursor = [0, 0]
        while (b := self._rows(cursor, stop_at_epoch_end=True)) is not None:
            yield b

    def state_dict(self) -> dict:
        """The position of the next example: ``{"epoch", "index", "seed", "num_examples"}``."""
        return {"epoch": self.epoch, "index": self.index, "seed": self.seed, "num_examples": len(self.examples)}

    def load_state_dict(self, state: dict) -> None:
        """Resume at a position from ``state_dict``; raises ValueError if it belongs to other data."""
        if state.get("num_examples") != len(self.examples) or state.get("seed") != self.seed:
            raise ValueError(f"state is for {state.get('num_examples')} examples with seed {state.get('seed')}, "
                             f"but this data has {len(self.examples)} with seed {self.seed}")
        if not 0 <= state["index"] < len(self.examples) or state["epoch"] < 0:
            raise ValueError(f"state position (epoch {state['epoch']}, index {state['index']}) is out of range")
        self.epoch, self.index = int(state["epoch"]), int(state["index"])
