"""megatrain_nb.data: the synthetic tasks and JSONL batches (shapes, labels, errors, resume)."""
import json
import warnings

import pytest
import torch

from megatrain_nb.data import IGNORE, jsonl_batches, synthetic_batches
from sft_helpers import word_tokenizer


# ---- synthetic -----------------------------------------------------------------------------
@pytest.mark.parametrize("kind", ["copy", "successor"])
def test_synthetic_shapes_dtypes_range(kind):
    b = next(synthetic_batches(4096, 3, 64, kind=kind, alphabet=100))
    assert set(b) == {"input_ids", "labels"}
    for t in b.values():
        assert t.shape == (3, 64) and t.dtype == torch.long
    assert 0 <= int(b["input_ids"].min()) and int(b["input_ids"].max()) < 100
    sup = b["labels"] != IGNORE
    assert torch.equal(b["labels"][sup], b["input_ids"][sup])  # labels are the ids, unshifted (HF shifts)


@pytest.mark.parametrize("kind", ["copy", "successor"])
def test_synthetic_is_deterministic(kind):
    a, b, c = (synthetic_batches(512, 4, 48, seed=s, kind=kind) for s in (7, 7, 8))
    for _ in range(3):
        x, y, z = next(a), next(b), next(c)
        assert torch.equal(x["input_ids"], y["input_ids"]) and torch.equal(x["labels"], y["labels"])
        assert not torch.equal(x["input_ids"], z["input_ids"])


def test_copy_rows_repeat_their_motif_and_mask_the_first():
    b = next(synthetic_batches(1000, 16, 64, period=(3, 20)))
    for ids, labels in zip(b["input_ids"], b["labels"]):
        p = int((labels == IGNORE).sum())  # the first motif is unlabelled
        assert 3 <= p <= 20
        assert (labels[:p] == IGNORE).all() and (labels[p:] != IGNORE).all()
        assert torch.equal(ids[p:], ids[:-p])


def test_successor_follows_one_table_across_rows_and_batches():
    it = synthetic_batches(1000, 8, 32, kind="successor", alphabet=50)
    table = {}
    for _ in range(3):
        ids = next(it)["input_ids"]
        for a, b in zip(ids[:, :-1].flatten().tolist(), ids[:, 1:].flatten().tolist()):
            assert table.setdefault(a, b) == b
    assert len(set(table.values())) == len(table)  # a permutation: no two tokens share a successor


def test_synthetic_errors_name_the_setting():
    with pytest.raises(ValueError, match="kind='reverse'"):
        synthetic_batches(100, 2, 64, kind="reverse")
    with pytest.raises(ValueError, match="period"):
        synthetic_batches(100, 2, 16, period=(8, 24))
    with pytest.raises(ValueError, match="batch=0"):
        synthetic_batches(100, 0, 64)


# ---- JSONL ---------------------------------------------------------------------------------
def _write(path, lines):
    path.write_text("".join((ln if isinstance(ln, str) else json.dumps(ln)) + "\n" for ln in lines))
    return path


def _byte_batches(path, batch, seq, **kw):
    with pytest.warns(UserWarning, match="UTF-8 bytes"):
        return jsonl_batches(path, None, batch, seq, vocab_size=kw.pop("vocab_size", 256), **kw)


def test_text_lines_are_bytes_padded(tmp_path):
    f = _write(tmp_path / "d.jsonl", [{"text": "hello"}])
    b = next(_byte_batches(f, 2, 8))
    assert set(b) == {"input_ids", "labels", "position_ids"}
    for t in b.values():
        assert t.shape == (2, 8) and t.dtype == torch.long
    hello = list(b"hello")
    assert b["input_ids"][0, :5].tolist() == hello
    assert b["position_ids"][0].tolist() == [0, 1, 2, 3, 4] + [0, 1, 2]  # the padding is an example of its own
    assert b["labels"][0].tolist() == [IGNORE] + hello[1:] + [IGNORE] * 3  # first token and padding: no loss
    assert torch.equal(b["input_ids"][1], b["input_ids"][0])  # one example: the next row is the next epoch


def test_bytes_wrap_modulo_vocab(tmp_path):
    f = _write(tmp_path / "d.jsonl", [{"text": "\u00e9t\u00e9"}])  # multi-byte UTF-8
    b = next(_byte_batches(f, 1, 8, vocab_size=100))
    assert b["input_ids"][0, :5].tolist() == [x % 100 for x in "\u00e9t\u00e9".encode()]


def test_prompt_tokens_are_labelled_ignore(tmp_path):
    f = _write(tmp_path / "d.jsonl", [{"prompt": "Q?", "response": "A!"}])
    b = next(_byte_batches(f, 1, 6))
    assert b["input_ids"][0, :4].tolist() == list(b"Q?A!")
    assert b["labels"][0].tolist() == [IGNORE, IGNORE, ord("A"), ord("!"), IGNORE, IGNORE]


def test_short_examples_pack_into_one_row(tmp_path):
    f = _write(tmp_path / "d.jsonl", [{"text": "ab"}, {"text": "cd"}, {"text": "ef"}])
    b = next(_byte_batches(f, 1, 7))
    assert b["position_ids"][0].tolist() == [0, 1] * 3 + [0]  # positions restart: each attends only to itself
    assert sorted(b["input_ids"][0, :6].view(3, 2).tolist()) == [list(b"ab"), list(b"cd"), list(b"ef")]
    assert b["labels"][0, [0, 2, 4, 6]].tolist() == [IGNORE] * 4  # each example's first token, the pad


def test_long_examples_are_truncated_with_a_warning(tmp_path):
    f = _write(tmp_path / "d.jsonl", [{"text": "x" * 50}])
    with pytest.warns(UserWarning, match="truncated 1"):
        b = next(_byte_batches(f, 1, 16))
    assert b["position_ids"][0].tolist() == list(range(16))


def test_model_tokenizer_is_used_when_present(tmp_path):
    tok_dir = word_tokenizer(tmp_path / "model")
    f = _write(tmp_path / "d.jsonl", [{"prompt": "what is", "response": "two"}])
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no byte-fallback warning
        b = next(jsonl_batches(f, tok_dir, 1, 8))
    # <s> what is | two </s>, then <pad>
    assert b["input_ids"][0].tolist() == [1, 4, 5, 6, 2, 0, 0, 0]
    assert b["labels"][0].tolist() == [IGNORE, IGNORE, IGNORE, 6, 2, IGNORE, IGNORE, IGNORE]


@pytest.mark.parametrize("lines, line_no, match", [
    ([{"text": "ok"}, "{not json", {"text": "ok"}], 2, "not valid JSON"),
    ([{"text": "ok"}, {"text": "ok"}, {"prompt": "p"}], 3, "'text' record"),  # one format per file
    ([{"txt": "typo"}], 1, "txt"),
    (['["a list"]'], 1, "list"),
])
def test_malformed_lines_name_the_line(tmp_path, lines, line_no, match):
    f = _write(tmp_path / "bad.jsonl", lines)
    with pytest.raises(ValueError, match=rf"bad\.jsonl:{line_no}:.*{match}"):
        _byte_batches(f, 1, 8)


def test_missing_and_empty_files(tmp_path):
    with pytest.warns(UserWarning, match="no tokenizer given"), pytest.raises(FileNotFoundError, match="nope.jsonl"):
        jsonl_batches(tmp_path / "nope.jsonl", None, 1, 8)
    (tmp_path / "empty.jsonl").write_text("\n\n")
    with pytest.warns(UserWarning), pytest.raises(ValueError, match="empty"):
        jsonl_batches(tmp_path / "empty.jsonl", None, 1, 8)


def test_examples_without_supervised_tokens(tmp_path):
    f = _write(tmp_path / "d.jsonl", [{"prompt": "a long prompt", "response": "r"}])
    with pytest.warns(UserWarning), pytest.raises(ValueError, match="no example keeps a supervised token"):
        jsonl_batches(f, None, 1, 4)


def test_resume_gives_the_same_next_batches(tmp_path):
    f = _write(tmp_path / "d.jsonl", [{"text": f"example {i} " + "z" * (i % 5)} for i in range(7)])
    a = _byte_batches(f, 3, 24, seed=3)
    for _ in range(4):  # past the end of the first epoch
        next(a)
    state = a.state_dict()
    assert state["epoch"] >= 1
    expected = [next(a) for _ in range(3)]
    b = _byte_batches(f, 3, 24, seed=3)
    b.load_state_dict(state)
    for want in expected:
        got = next(b)
        for k in want:
            assert torch.equal(got[k], want[k])


def test_epochs_are_shuffled_by_seed(tmp_path):
    f = _write(tmp_path / "d.jsonl", [{"text": f"{i:02d}"} for i in range(20)])
    first = lambda seed: next(_byte_batches(f, 20, 3, seed=seed))["input_ids"]  # noqa: E731  one example a row
    assert torch.equal(first(1), first(1))
    assert not torch.equal(first(1), first(2))
    assert sorted(first(1)[:, :2].tolist()) == [list(f"{i:02d}".encode()) for i in range(20)]  # each once


def test_load_state_dict_rejects_other_data(tmp_path):
    a = _byte_batches(_write(tmp_path / "a.jsonl", [{"text": "aa"}] * 3), 1, 8)
    b = _byte_batches(_write(tmp_path / "b.jsonl", [{"text": "aa"}] * 4), 1, 8)
    with pytest.raises(ValueError, match="3 examples"):
        b.load_state_dict(a.state_dict())
