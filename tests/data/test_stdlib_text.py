"""megatrain_nb.data.stdlib_text: the standard library's sources as training text (tokenizer, windows, batches)."""
import pytest
import torch

from megatrain_nb.data.stdlib_text import (HELDOUT_MODULES, TRAIN_MODULES, batches, stdlib_data, stdlib_text,
                                           text_tokenizer, windows)

VOCAB, SEQ = 512, 64


@pytest.fixture(scope="module")
def data():
    return stdlib_data(vocab_size=VOCAB, seq=SEQ)


def test_the_tokenizer_round_trips_the_text(data):
    tok = data["tokenizer"]
    assert tok.get_vocab_size() == VOCAB
    train, heldout = stdlib_text(TRAIN_MODULES), stdlib_text(HELDOUT_MODULES)
    piece = train[10_000:12_000]  # code, docstrings, indentation and newlines
    ids = tok.encode(piece).ids
    assert tok.decode(ids) == piece
    assert len(ids) < len(piece) / 2  # the merges compress: under half a token per byte of this text
    unseen = heldout[:2000] + " naïve — ünïcode"  # text it never trained on, bytes outside ASCII too
    assert tok.decode(tok.encode(unseen).ids) == unseen


def test_windows_have_the_asked_shape_and_ids_under_the_vocab(data):
    for rows in (data["train"], data["heldout"]):
        assert rows.dtype == torch.long and rows.dim() == 2 and rows.shape[1] == SEQ
        assert 0 <= int(rows.min()) and int(rows.max()) < VOCAB
    assert len(data["train"]) > 1000 and len(data["heldout"]) >= 16
    tok, text = data["tokenizer"], stdlib_text(HELDOUT_MODULES)
    n = len(tok.encode(text).ids)
    assert windows(tok, text, 100).shape == (n // 100, 100)  # whole rows only, the tail dropped
    assert stdlib_text(TRAIN_MODULES).startswith(tok.decode(data["train"][0].tolist()))  # the text's first tokens


def test_the_heldout_modules_are_not_in_the_train_text():
    assert not set(HELDOUT_MODULES) & set(TRAIN_MODULES)
    train, heldout = stdlib_text(TRAIN_MODULES), stdlib_text(HELDOUT_MODULES)
    assert "class shlex" in heldout and "class shlex" not in train
    lines = [s for s in heldout.splitlines() if len(s.strip()) > 40]  # its longer lines: its own, not boilerplate
    assert len(lines) > 50
    assert sum(s in train for s in lines) < 0.1 * len(lines)


def test_stdlib_data_is_deterministic(data):
    again = stdlib_data(vocab_size=VOCAB, seq=SEQ)
    assert torch.equal(again["train"], data["train"]) and torch.equal(again["heldout"], data["heldout"])
    assert again["tokenizer"].get_vocab() == data["tokenizer"].get_vocab()


def test_batches_are_seeded_epochs_with_labels_equal_to_the_inputs(data):
    rows = data["train"][:10]
    bs = batches(rows, batch=4, steps=5, seed=3)
    assert len(bs) == 5 and all(b["input_ids"].shape == (4, SEQ) for b in bs)
    assert all(torch.equal(b["labels"], b["input_ids"]) and b["labels"] is not b["input_ids"] for b in bs)
    seen = torch.cat([b["input_ids"] for b in bs[:2]] + [bs[2]["input_ids"][:2]])  # the first epoch: 10 rows
    assert sorted(map(tuple, seen.tolist())) == sorted(map(tuple, rows.tolist()))  # each row once
    same, other = batches(rows, batch=4, steps=5, seed=3), batches(rows, batch=4, steps=5, seed=4)
    assert all(torch.equal(a["input_ids"], b["input_ids"]) for a, b in zip(bs, same))
    assert not all(torch.equal(a["input_ids"], b["input_ids"]) for a, b in zip(bs, other))


def test_errors_name_the_value_and_the_fix(data):
    with pytest.raises(ValueError, match=r"3 rows, fewer than batch=4: give a smaller batch"):
        batches(data["train"][:3], batch=4, steps=1)
    with pytest.raises(FileNotFoundError, match="no_such_module.py"):
        stdlib_text(("no_such_module.py",))
    with pytest.raises(ValueError, match="vocab_size=100"):
        text_tokenizer("abc", 100)
