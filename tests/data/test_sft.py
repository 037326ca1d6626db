"""megatrain_nb.data.sft through data.sft_batches: formats, assistant-only labels, packing, sources, errors, resume."""
import json

import pytest
import torch

from megatrain_nb.data import IGNORE, sft_batches
from sft_helpers import CHATML, assert_resumes, chats, make_tokenizer, write_jsonl


@pytest.fixture(scope="module")
def tok():
    return make_tokenizer()


def _supervised_text(tok, ids, labels) -> str:
    return tok.decode([t for t, lab in zip(ids, labels) if lab != IGNORE])


def test_chat_loss_on_every_assistant_turn_only(tmp_path, tok):
    conv = {"messages": [{"role": "system", "content": "you are concise"},
                         {"role": "user", "content": "What is two plus two?"},
                         {"role": "assistant", "content": "Four."},
                         {"role": "user", "content": "Say hello."},
                         {"role": "assistant", "content": "Hello there!"}]}
    it = sft_batches(write_jsonl(tmp_path / "c.jsonl", [conv]), tok, batch=1, seq=128)
    assert it.format == "chat"
    ids, labels = it.examples[0]
    assert ids == tok(tok.apply_chat_template(conv["messages"], tokenize=False), add_special_tokens=False)["input_ids"]
    # each assistant turn's content and its end-of-turn marks; no system, user or role-header token
    assert _supervised_text(tok, ids, labels) == "Four.<|im_end|>\nHello there!<|im_end|>\n"
    sup = [k for k, lab in enumerate(labels) if lab != IGNORE]
    runs = [k for k in sup if k - 1 not in sup]
    assert len(runs) == 2  # two separate supervised runs: the user turn between them carries no loss
    assert tok.decode(ids[:runs[0]]).endswith("<|im_start|>assistant\n")


@pytest.mark.parametrize("record, fmt, supervised", [
    ({"instruction": "Say hello", "input": "to Ann", "output": "Hello Ann"}, "alpaca", "Hello Ann<|im_end|>"),
    ({"instruction": "Say hello", "output": "Hello"}, "alpaca", "Hello<|im_end|>"),
    ({"prompt": "The capital of France is", "response": " Paris."}, "prompt/response", " Paris.<|im_end|>"),
    ({"text": "Hello there"}, "text", "Hello there<|im_end|>"),  # all but the first token (BOS)
])
def test_other_formats(tmp_path, tok, record, fmt, supervised):
    it = sft_batches(write_jsonl(tmp_path / "d.jsonl", [record]), tok, batch=1, seq=64)
    assert it.format == fmt
    ids, labels = it.examples[0]
    assert ids[0] == tok.bos_token_id and labels[0] == IGNORE
    assert _supervised_text(tok, ids, labels) == supervised


def test_packed_rows_restart_positions_and_keep_examples_whole(tmp_path, tok):
    it = sft_batches(write_jsonl(tmp_path / "c.jsonl", chats(8)), tok, batch=2, seq=200, seed=3)
    b = next(it)
    assert set(b) == {"input_ids", "labels", "position_ids"}
    order = it._order_of(0)
    k = 0
    for r in range(2):
        pos, used = b["position_ids"][r], 0
        while k < len(order) and used + len(it.examples[order[k]][0]) <= 200:
            ids, labels = it.examples[order[k]]
            n = len(ids)
            assert b["input_ids"][r, used:used + n].tolist() == ids and b["labels"][r, used:used + n].tolist() == labels
            assert pos[used:used + n].tolist() == list(range(n))  # positions restart at each example
            assert labels[0] == IGNORE  # nothing predicts an example's first token from its neighbour
            used, k = used + n, k + 1
        assert (b["labels"][r, used:] == IGNORE).all() and pos[used:].tolist() == list(range(200 - used))
        assert used > 0 and (r == 1 or used + len(it.examples[order[k]][0]) > 200)  # filled greedily


def test_unpacked_rows_hold_one_example_each(tmp_path, tok):
    it = sft_batches(write_jsonl(tmp_path / "c.jsonl", chats(5)), tok, batch=5, seq=128, pack=False, seed=1)
    b = next(it)
    for r, k in enumerate(it._order_of(0)):
        ids, labels = it.examples[k]
        assert b["input_ids"][r, :len(ids)].tolist() == ids
        assert b["position_ids"][r, :len(ids)].tolist() == list(range(len(ids)))
        assert (b["labels"][r, len(ids):] == IGNORE).all()


def test_one_pass_yields_every_example_once_and_keeps_the_position(tmp_path, tok):
    it = sft_batches(write_jsonl(tmp_path / "c.jsonl", chats(9)), tok, batch=2, seq=128)
    next(it)
    state = it.state_dict()
    seen = sum(int((b["position_ids"] == 0).logical_and(b["labels"] == IGNORE).sum()) for b in it.one_pass())
    n_pads = sum(int(((b["position_ids"] == 0) & (b["input_ids"] == tok.pad_token_id)).sum()) for b in it.one_pass())
    assert seen - n_pads == 9
    assert it.state_dict() == state


def test_sources_json_parquet_dataset_and_list_agree(tmp_path, tok):
    records = chats(4)
    want = sft_batches(write_jsonl(tmp_path / "c.jsonl", records), tok, batch=1, seq=128).examples
    (tmp_path / "c.json").write_text(json.dumps(records))
    assert sft_batches(tmp_path / "c.json", tok, batch=1, seq=128).examples == want
    assert sft_batches(records, tok, batch=1, seq=128).examples == want
    datasets = pytest.importorskip("datasets")
    ds = datasets.Dataset.from_list(records)
    assert sft_batches(ds, tok, batch=1, seq=128).examples == want
    ds.to_parquet(str(tmp_path / "c.parquet"))
    assert sft_batches(tmp_path / "c.parquet", tok, batch=1, seq=128).examples == want


def test_tokenizer_from_a_model_directory(tmp_path, tok):
    tok.save_pretrained(str(tmp_path / "m"))
    f = write_jsonl(tmp_path / "c.jsonl", chats(3))
    assert sft_batches(f, tmp_path / "m", batch=1, seq=128).examples == sft_batches(f, tok, batch=1, seq=128).examples


@pytest.mark.parametrize("lines, where, words", [
    ([chats(1)[0], chats(1)[0], {"prompt": "p", "response": "r"}], ":3:", ["'chat' record", "detected from", ":1"]),
    ([{"text": "ok"}, "{not json"], ":2:", ["not valid JSON"]),
    ([{"txt": "typo"}], ":1:", ["none of the record formats", "txt"]),
    ([{"text": "ok"}, {"text": 5}], ":2:", ["'text' is int"]),
    ([{"messages": [{"role": "user", "content": "hi"}]}], ":1:", ["no \"assistant\" turn"]),
    ([{"messages": [{"role": "user"}]}], ":1:", ["\"messages\" must be"]),
    ([{"text": "ok"}, {"text": "word " * 200}], ":2:", ["tokens, longer than seq=64", "raise seq"]),
])
def test_bad_records_name_their_line(tmp_path, tok, lines, where, words):
    f = write_jsonl(tmp_path / "bad.jsonl", lines)
    with pytest.raises(ValueError) as e:
        sft_batches(f, tok, batch=1, seq=64)
    msg = str(e.value)
    assert f"bad.jsonl{where}" in msg, msg
    for w in words:
        assert w in msg, msg


def test_missing_chat_template_names_the_fix(tmp_path):
    f = write_jsonl(tmp_path / "c.jsonl", chats(2))
    with pytest.raises(ValueError, match=r"c\.jsonl:1: chat messages need a tokenizer with a chat template.*"
                                         r"chat_template"):
        sft_batches(f, make_tokenizer(chat_template=None), batch=1, seq=128)


def test_template_that_rewrites_earlier_turns_is_refused(tmp_path):
    drops_past = ("{% for m in messages %}{% if loop.last or m['role'] != 'assistant' %}{{ m['content'] }}|"
                  "{% endif %}{% endfor %}{% if add_generation_prompt %}A:{% endif %}")
    with pytest.raises(ValueError, match=r"c\.jsonl:1: the chat template renders"):
        sft_batches(write_jsonl(tmp_path / "c.jsonl", chats(2)), make_tokenizer(drops_past), batch=1, seq=128)


def test_empty_and_missing_data(tmp_path, tok):
    (tmp_path / "e.jsonl").write_text("\n\n")
    with pytest.raises(ValueError, match="holds no records"):
        sft_batches(tmp_path / "e.jsonl", tok, batch=1, seq=64)
    with pytest.raises(FileNotFoundError, match="nope.jsonl"):
        sft_batches(tmp_path / "nope.jsonl", tok, batch=1, seq=64)
    with pytest.raises(ValueError, match="holds no records"):
        sft_batches([], tok, batch=1, seq=64)


def test_resume_gives_the_same_next_batches(tmp_path, tok):
    f = write_jsonl(tmp_path / "c.jsonl", chats(7))
    assert_resumes(lambda: sft_batches(f, tok, batch=2, seq=128, seed=5), skip=5)


def test_chatml_helper_is_what_the_template_says():
    assert "<|im_start|>assistant" in CHATML
