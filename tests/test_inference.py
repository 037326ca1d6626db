"""megatrain_nb.inference through Session.evaluate / generate / train(eval_data=...).

Evaluation equals the HF model's loss and leaves training bit-identical; greedy generation equals
``AutoModelForCausalLM.generate`` of the saved weights token for token.
"""
import pytest
import torch

from megatrain_nb import Session
from megatrain_nb.data import sft_batches
from sft_helpers import chats, make_model_dir, make_tokenizer, write_jsonl


@pytest.fixture(scope="module")
def tok():
    return make_tokenizer()


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory, tok):
    return make_model_dir(tmp_path_factory.mktemp("m") / "tiny", tok)


@pytest.fixture(scope="module")
def data_file(tmp_path_factory):
    return write_jsonl(tmp_path_factory.mktemp("d") / "chats.jsonl", chats(10))


def _hf(path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()


def test_evaluate_equals_the_hf_loss(model_dir, data_file):
    batches = list(sft_batches(data_file, model_dir, batch=4, seq=128, pack=False).one_pass())
    ref = _hf(model_dir)
    with torch.no_grad():  # HF: mean over each batch's supervised tokens; weight batches by their token count
        sums = [(ref(input_ids=b["input_ids"], labels=b["labels"], position_ids=b["position_ids"]).loss.item(),
                 int((b["labels"][:, 1:] != -100).sum())) for b in batches]
    want = sum(l * n for l, n in sums) / sum(n for _, n in sums)
    s = Session.from_pretrained(model_dir, micro_batch_size=3)
    try:
        got = s.evaluate(batches)
        assert abs(got - want) < 1e-6 * want
        packed = sft_batches(data_file, model_dir, batch=2, seq=256)
        assert abs(s.evaluate(packed) - want) < 1e-6 * want  # one pass over the same examples, packed
        assert [e["step"] for e in s.eval_history] == [0, 0]
        assert abs(s.evaluate(packed, steps=1) - want) < 0.5 * want  # one batch only
    finally:
        s.close()


@pytest.mark.parametrize("placement", ["host", "mixed"])
def test_evaluate_leaves_training_bit_identical(model_dir, data_file, placement):
    runs = {}
    for with_eval in (False, True):
        data = sft_batches(data_file, model_dir, batch=2, seq=256, seed=4)
        held_out = sft_batches(data_file, model_dir, batch=3, seq=128, pack=False)
        s = Session.from_pretrained(model_dir, lr=1e-3, placement="host" if placement == "host" else {0: "resident"})
        try:
            losses = []
            for k in range(4):
                losses.append(s.step(next(data)).loss)
                if with_eval and k in (0, 2):
                    s.evaluate(held_out)  # between steps, while step k's updates may still be running
            s.engine.drain()
            runs[with_eval] = (losses, {u: (x.master.clone(), (x.exp_avg.clone(), x.exp_avg_sq.clone())) for u, x in s.store.units.items()})
        finally:
            s.close()
    assert runs[True][0] == runs[False][0]
    for u, (w, st) in runs[False][1].items():
        w2, st2 = runs[True][1][u]
        assert torch.equal(w, w2)
        assert all(torch.equal(a, b) for a, b in zip(st, st2))


@pytest.mark.parametrize("placement", ["host", "all_resident"])
@pytest.mark.parametrize("cache_weights", [False, True], ids=["streamed", "cached"])
@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_greedy_generation_equals_hf(tok, tmp_path, data_file, cache_weights, tied, placement):
    """Also from units placed "resident" (placement.py): their weights are read on the device."""
    base = make_model_dir(tmp_path / "base", tok, seed=1, tie_word_embeddings=tied)
    import json
    L = json.loads((base / "config.json").read_text())["num_hidden_layers"]
    s = Session.from_pretrained(base, lr=3e-3, placement="host" if placement == "host" else
                                {u: "resident" for u in range(-1, L + 1)})
    try:
        data = sft_batches(data_file, base, batch=2, seq=256)
        for _ in range(3):  # generate from trained weights, not the file's
            s.step(next(data))
        prompt = torch.tensor([tok.bos_token_id] + tok("What is 7 plus", add_special_tokens=False)["input_ids"])
        got = s.generate(prompt, max_new_tokens=12, cache_weights=cache_weights)
        s.save_pretrained(tmp_path / "out")
        chat = [{"role": "user", "content": "What is 3 plus two?"}]
        text = s.generate(chat, max_new_tokens=10, tokenizer=tok, cache_weights=cache_weights)
    finally:
        s.close()
    ref = _hf(tmp_path / "out")
    want = ref.generate(prompt.view(1, -1), max_new_tokens=12, do_sample=False)
    assert got.dim() == 1 and got.tolist() == want[0].tolist()[:len(got)]
    assert len(got) == want.shape[1]  # same stopping point (max_new_tokens or eos)
    ids = tok(tok.apply_chat_template(chat, tokenize=False, add_generation_prompt=True), add_special_tokens=False,
              return_tensors="pt")["input_ids"]
    want_text = tok.decode(ref.generate(ids, max_new_tokens=10, do_sample=False)[0, ids.shape[1]:],
                           skip_special_tokens=True)
    assert text == want_text


def test_sampling_is_seeded_and_leaves_the_global_rng(model_dir, tok):
    s = Session.from_pretrained(model_dir)
    try:
        prompt = torch.tensor([[tok.bos_token_id, 5, 6]])
        state = torch.random.get_rng_state()
        a = s.generate(prompt, max_new_tokens=8, do_sample=True, temperature=1.5, top_p=0.9, seed=3)
        b = s.generate(prompt, max_new_tokens=8, do_sample=True, temperature=1.5, top_p=0.9, seed=3)
        assert torch.equal(torch.random.get_rng_state(), state)
        assert a.shape[0] == 1 and torch.equal(a, b) and torch.equal(a[:, :3], prompt)
    finally:
        s.close()


def test_bad_generation_arguments(model_dir, tok):
    s = Session.from_pretrained(model_dir)
    try:
        with pytest.raises(ValueError, match="needs tokenizer="):
            s.generate("hello", max_new_tokens=3)
        with pytest.raises(ValueError, match="max_new_tokens=0"):
            s.generate(torch.tensor([1, 2]), max_new_tokens=0)
        with pytest.raises(ValueError, match="one non-empty prompt"):
            s.generate(torch.ones(2, 3, dtype=torch.long), max_new_tokens=3)
        with pytest.raises(ValueError, match="outside the vocabulary"):
            s.generate(torch.tensor([10_000]), max_new_tokens=3)
        with pytest.raises(TypeError, match="steps="):
            s.evaluate(iter([]))
        assert s.engine.steps_done == 0 and not s.eval_history
    finally:
        s.close()


def test_train_plots_eval_loss_next_to_training_loss(model_dir, data_file):
    s = Session.from_pretrained(model_dir, lr=3e-3)
    try:
        held_out = sft_batches(data_file, model_dir, batch=4, seq=128, pack=False)
        before = s.evaluate(held_out)
        df = s.train(sft_batches(data_file, model_dir, batch=2, seq=256), steps=5, eval_data=held_out, eval_every=2,
                     dashboard=False)
        assert [e["step"] for e in s.eval_history] == [0, 2, 4, 5]
        assert df.eval_loss.notna().sum() == 4 and df.eval_loss.iloc[0] == before
        assert df.eval_loss.iloc[-1] < before  # it learned something the held-out set shares
        fig = s.plot_history()
        names = [t.name for t in fig.data]
        assert "eval loss" in names and "training loss" in names  # legend words (palette.METRIC_LABELS)
        trace = fig.data[names.index("eval loss")]
        assert list(trace.x) == [0, 2, 4, 5]
        with pytest.raises(TypeError, match="iterator"):
            s.train(iter([]), steps=1, eval_data=iter([]))
    finally:
        s.close()
