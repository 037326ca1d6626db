"""megatrain_nb.preference: standard and conversational records, labels on completions only, adjacent whole
pairs, truncation, sources, resume, errors, and a batch through losses.dpo."""
import pytest
import torch

from megatrain_nb.post import losses
from megatrain_nb.data import preference_batches
from megatrain_nb.data.sft import IGNORE
from sft_helpers import assert_resumes, make_tokenizer, write_jsonl


@pytest.fixture(scope="module")
def tok():
    return make_tokenizer()


def plain(n: int) -> list[dict]:
    return [{"prompt": f"What is {k} plus two?", "chosen": f" It is {k + 2}." + " Four" * (k % 3),
             "rejected": f" Tell me a story {k}."} for k in range(n)]


def chat(n: int) -> list[dict]:
    out = []
    for k in range(n):
        prompt = [{"role": "system", "content": "you are concise"}] if k % 2 else []
        prompt += [{"role": "user", "content": "Say hello."}, {"role": "assistant", "content": "Hello there!"},
                   {"role": "user", "content": f"What is {k} plus two?"}]
        out.append({"prompt": prompt, "chosen": [{"role": "assistant", "content": f"It is {k + 2}."}],
                    "rejected": [{"role": "assistant", "content": "Tell me a story."}]})
    return out


def _row(b, r):
    """(ids, labels) of row r without its padding."""
    n = int(b["attention_mask"][r].sum())
    assert (b["attention_mask"][r, :n] == 1).all() and (b["labels"][r, n:] == IGNORE).all()
    return b["input_ids"][r, :n].tolist(), b["labels"][r, :n].tolist()


def _supervised(tok, ids, labels) -> str:
    assert all(lab in (IGNORE, t) for t, lab in zip(ids, labels))  # labels are the input ids or -100
    return tok.decode([t for t, lab in zip(ids, labels) if lab != IGNORE])


def test_standard_records_label_the_completion_only(tok):
    recs = plain(3)
    it = preference_batches(recs, tok, batch=6, seq=64, shuffle=False)
    assert it.format == "standard" and len(it) == 1
    b = next(it)
    assert set(b) == {"input_ids", "labels", "attention_mask", "pair"}
    assert b["pair"].tolist() == [0, 0, 1, 1, 2, 2]
    for k, rec in enumerate(recs):
        (ci, cl), (ri, rl) = _row(b, 2 * k), _row(b, 2 * k + 1)
        assert _supervised(tok, ci, cl) == rec["chosen"] + "<|im_end|>"
        assert _supervised(tok, ri, rl) == rec["rejected"] + "<|im_end|>"
        prompt = [tok.bos_token_id] + tok(rec["prompt"], add_special_tokens=False)["input_ids"]
        assert ci[:len(prompt)] == ri[:len(prompt)] == prompt  # the same prompt on both rows, unsupervised
        assert cl[:len(prompt)] == [IGNORE] * len(prompt)


def test_conversational_records_label_the_new_assistant_turn_only(tok):
    recs = chat(2)
    it = preference_batches(recs, tok, batch=4, seq=128, shuffle=False)
    assert it.format == "conversational"
    b = next(it)
    for k, rec in enumerate(recs):
        for side, key in enumerate(("chosen", "rejected")):
            ids, labels = _row(b, 2 * k + side)
            full = tok.apply_chat_template(rec["prompt"] + rec[key], tokenize=False)
            assert ids == tok(full, add_special_tokens=False)["input_ids"]
            # the prompt's own assistant turn ("Hello there!") and the generation prompt carry no loss
            assert _supervised(tok, ids, labels) == rec[key][0]["content"] + "<|im_end|>\n"
            first = next(t for t, lab in enumerate(labels) if lab != IGNORE)
            assert tok.decode(ids[:first]).endswith("<|im_start|>assistant\n")


def test_pairs_stay_adjacent_and_whole_across_shuffled_epochs(tok):
    recs = plain(7)
    it = preference_batches(recs, tok, batch=4, seq=64, seed=2)
    assert len(it) == 4  # 7 pairs, 2 per batch
    seen = []
    for _ in range(7):  # two epochs: batches top up from the next epoch, pairs stay whole
        b = next(it)
        assert b["input_ids"].shape == (4, 64) and b["pair"].tolist() == [0, 0, 1, 1]
        for k in range(2):
            ci, cl = _row(b, 2 * k)
            ri, rl = _row(b, 2 * k + 1)
            match = [j for j, rec in enumerate(recs) if _supervised(tok, ci, cl) == rec["chosen"] + "<|im_end|>"]
            assert len(match) == 1 and _supervised(tok, ri, rl) == recs[match[0]]["rejected"] + "<|im_end|>"
            seen.append(match[0])
    assert sorted(seen[:7]) == list(range(7)) and sorted(seen[7:]) == sorted(it._order_of(1)[:7])
    assert seen[:7] != list(range(7))  # shuffled


def test_one_pass_yields_every_pair_once_and_keeps_the_position(tok):
    it = preference_batches(plain(5), tok, batch=4, seq=64)
    next(it)
    state = it.state_dict()
    sizes = [b["input_ids"].shape[0] for b in it.one_pass()]
    assert sizes == [4, 4, 2] and it.state_dict() == state


def test_long_prompts_lose_their_start_and_long_completions_their_end(tok):
    long_prompt = "numbers one two three four five six seven eight nine ten " * 4
    recs = [{"prompt": long_prompt, "chosen": " Four.", "rejected": " Hello there, how can I help you today?"}]
    seq = 24
    with pytest.warns(UserWarning, match="truncated 1 pair"):
        b = next(preference_batches(recs, tok, batch=2, seq=seq))
    ends = [tok(" Four.", add_special_tokens=False)["input_ids"],
            tok(" Hello there, how can I help you today?", add_special_tokens=False)["input_ids"]]
    prompt = tok(long_prompt, add_special_tokens=False)["input_ids"]
    for r in range(2):
        ids, labels = _row(b, r)
        assert len(ids) <= seq
        n_completion = sum(lab != IGNORE for lab in labels)
        assert ids[-n_completion:] == ends[r][:n_completion] + [tok.eos_token_id] * (n_completion > len(ends[r]))
        assert ids[:-n_completion] == prompt[len(prompt) - (len(ids) - n_completion):]  # the prompt's end
    # rows of a pair keep the same prompt: room for the longer completion, the prompt keeping >= seq // 2
    assert _row(b, 0)[0][:seq - len(ends[1]) - 1] == _row(b, 1)[0][:seq - len(ends[1]) - 1]

    long_answer = " Tell me a story about a cat and a dog." * 6
    with pytest.warns(UserWarning, match="truncated"):
        b = next(preference_batches([{"prompt": long_prompt, "chosen": long_answer, "rejected": "no"}], tok,
                                    batch=2, seq=seq, max_prompt=10))
    ids, labels = _row(b, 0)
    assert len(ids) == seq and labels[:10] == [IGNORE] * 10 and IGNORE not in labels[10:]
    assert ids[:10] == prompt[-10:] and ids[10:] == tok(long_answer, add_special_tokens=False)["input_ids"][:seq - 10]


def test_sources_jsonl_list_and_dataset_agree(tmp_path, tok):
    recs = chat(3)
    want = preference_batches(recs, tok, batch=2, seq=128).pairs
    assert preference_batches(write_jsonl(tmp_path / "p.jsonl", recs), tok, batch=2, seq=128).pairs == want
    datasets = pytest.importorskip("datasets")
    assert preference_batches(datasets.Dataset.from_list(recs), tok, batch=2, seq=128).pairs == want


def test_resume_gives_the_same_next_batches(tmp_path, tok):
    f = write_jsonl(tmp_path / "p.jsonl", plain(5))
    state = assert_resumes(lambda: preference_batches(f, tok, batch=4, seq=64, seed=5), skip=4)
    with pytest.raises(ValueError, match="same seed and shuffle"):
        preference_batches(f, tok, batch=4, seq=64, seed=6).load_state_dict(state)
    with pytest.raises(ValueError, match="out of range"):
        preference_batches(f, tok, batch=4, seq=64, seed=5).load_state_dict({**state, "index": 99})


def test_a_side_without_a_supervised_token_is_skipped():
    recs = [{"prompt": "a", "chosen": "", "rejected": "b"}, {"prompt": "a", "chosen": "c", "rejected": "b"}]
    with pytest.warns(UserWarning) as caught:
        it = preference_batches(recs, None, batch=2, seq=8)  # bytes: no EOS, so "" has no token
    assert any("skipped 1 pair" in str(w.message) and "record 1" in str(w.message) for w in caught)
    assert it.records == [1]


def test_batches_feed_dpo(tok):
    it = preference_batches(chat(4), tok, batch=4, seq=128)
    mbs = [next(it)]
    ctx = losses.LossContext.from_batches(mbs)
    b = mbs[0]
    on = b["labels"] != IGNORE
    on[:, 0] = False
    logp = torch.where(on, -torch.rand(on.shape), 0.0).requires_grad_(True)
    loss = losses.dpo(logp, {**b, "ref_logps": torch.zeros(4)}, ctx)
    loss.backward()
    assert torch.isfinite(loss) and (logp.grad[~on] == 0).all() and ctx.sequences == 4


@pytest.mark.parametrize("records, kwargs, where, words", [
    (plain(1) + [{"prompt": "p", "chosen": "c"}], {}, "record 2", ["missing field 'rejected'"]),
    ([{"chosen": "c", "rejected": "r"}], {}, "record 1", ["missing field 'prompt'", '"prompt": str']),
    (plain(1) + chat(1), {}, "record 2", ["conversational record", "standard", "record 1"]),
    ([{"prompt": "p", "chosen": 3, "rejected": "r"}], {}, "record 1", ["field 'chosen' is int"]),
    ([{**chat(1)[0], "rejected": [{"role": "user", "content": "x"}]}], {}, "record 1",
     ["'rejected' has no \"assistant\" turn"]),
    (["just text"], {}, "record 1", ["got a str"]),
    (plain(2), {"batch": 3}, "batch=3", ["even", "batch=4"]),
    (plain(2), {"max_prompt": 64}, "max_prompt=64", ["[1, seq=64)"]),
    ([], {}, "records holds no records", []),
])
def test_errors_name_the_record_and_the_fix(tok, records, kwargs, where, words):
    with pytest.raises(ValueError) as e:
        preference_batches(records, tok, **{"batch": 2, "seq": 64, **kwargs})
    for w in [where] + words:
        assert w in str(e.value), str(e.value)


def test_jsonl_errors_name_the_line_and_chats_need_a_template(tmp_path):
    f = write_jsonl(tmp_path / "bad.jsonl", plain(2) + [{"prompt": "p", "rejected": "r"}])
    with pytest.raises(ValueError, match=r"bad\.jsonl:3: missing field 'chosen'"):
        preference_batches(f, make_tokenizer(), batch=2, seq=64)
    with pytest.raises(ValueError, match=r"record 1: chat messages need a tokenizer with a chat template"):
        preference_batches(chat(1), make_tokenizer(chat_template=None), batch=2, seq=64)
