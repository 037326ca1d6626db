"""megatrain_nb.post.rollout through Session.generate's batched path: left-padded batches equal one prompt at a
time, each row stops at its EOS, the sampling log-probs equal the HF model's, seeds reproduce."""
import pytest
import torch

from megatrain_nb import Session
from megatrain_nb.post.rollout import Rollouts
from sft_helpers import make_model_dir, make_tokenizer


@pytest.fixture(scope="module")
def tok():
    return make_tokenizer()


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory, tok):
    return make_model_dir(tmp_path_factory.mktemp("m") / "tiny", tok, seed=2)


@pytest.fixture(scope="module")
def session(model_dir):
    s = Session.from_pretrained(model_dir, device="cpu", dtype=torch.float32)
    yield s
    s.close()


def _prompts(tok) -> list[torch.Tensor]:
    texts = ["What is 7 plus", "Hello", "The capital of France is Paris and the"]
    return [torch.tensor([tok.bos_token_id] + tok(t, add_special_tokens=False)["input_ids"]) for t in texts]


@pytest.mark.parametrize("cache_weights", [False, True], ids=["streamed", "cached"])
def test_batched_greedy_equals_one_prompt_at_a_time(session, tok, cache_weights):
    prompts = _prompts(tok)
    r = session.generate(prompts, max_new_tokens=10, cache_weights=cache_weights)
    assert isinstance(r, Rollouts)
    assert r.prompt_lengths.tolist() == [len(p) for p in prompts]
    for b, p in enumerate(prompts):
        one = session.generate(p, max_new_tokens=10, cache_weights=cache_weights)
        assert r.completions()[b] == one[len(p):].tolist()
        P = r.prompt_width
        assert r.sequences[b, P - len(p):P].tolist() == p.tolist() and not r.attention_mask[b, :P - len(p)].any()


def test_num_return_sequences_shapes_and_texts(session, tok):
    prompts = ["What is 7 plus", "Hello"]
    r = session.generate(prompts, max_new_tokens=5, do_sample=True, num_return_sequences=3, tokenizer=tok)
    N, T = r.sequences.shape
    assert N == 6 and r.prompt_index.tolist() == [0, 0, 0, 1, 1, 1] and T == r.prompt_width + 5
    assert r.completion_mask.shape == r.attention_mask.shape == (6, T) and r.logprobs is None
    assert not r.completion_mask[:, :r.prompt_width].any()
    assert len(r.texts) == 6 and r.texts[0] == tok.decode(r.completions()[0], skip_special_tokens=True)
    b = r.batch(advantages=torch.zeros(6))
    assert set(b) == {"input_ids", "attention_mask", "position_ids", "labels", "advantages"}
    assert ((b["labels"] != -100) == r.completion_mask).all()
    one = session.generate("Hello", max_new_tokens=4, do_sample=True, num_return_sequences=2, tokenizer=tok)
    assert one.sequences.shape[0] == 2 and one.prompt_index.tolist() == [0, 0]


def test_each_row_stops_at_its_eos(model_dir, tok):
    s = Session.from_pretrained(model_dir, device="cpu", dtype=torch.float32)
    try:
        prompts = _prompts(tok)
        s.config.eos_token_id = None
        free = s.generate(prompts, max_new_tokens=8)  # no eos: every row runs 8 tokens
        assert free.completion_mask.sum(1).tolist() == [8, 8, 8]
        rows = free.completions()
        stop = next(t for t in rows[0][2:] if t not in rows[1] and t not in rows[0][:2])  # row 0's, row 1 never
        s.config.eos_token_id = stop
        r = s.generate(prompts, max_new_tokens=8)
    finally:
        s.close()
    got = r.completions()
    k = rows[0].index(stop)
    assert got[0] == rows[0][:k + 1]  # through its EOS, then padding
    assert got[1] == rows[1] and r.completion_mask[1].sum() == 8  # the other row runs on
    P = r.prompt_width
    assert not r.attention_mask[0, P + k + 1:].any() and (r.batch()["labels"][0, P + k + 1:] == -100).all()


def test_logprobs_equal_the_hf_models(session, model_dir, tok):
    from transformers import AutoModelForCausalLM

    r = session.generate(_prompts(tok), max_new_tokens=6, do_sample=True, temperature=0.7, num_return_sequences=2,
                         return_logprobs=True, seed=5)
    hf = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32,
                                              attn_implementation=session.arch.model.config._attn_implementation).eval()
    b = r.batch()
    with torch.no_grad():
        logits = hf(input_ids=b["input_ids"], attention_mask=b["attention_mask"], position_ids=b["position_ids"]).logits
    want = torch.zeros_like(r.logprobs)
    want[:, 1:] = torch.log_softmax(logits[:, :-1].float() / 0.7, -1).gather(-1, r.sequences[:, 1:, None])[..., 0]
    want = want * r.completion_mask
    assert (b["old_logp"] - want).abs().max() < 1e-5
    assert (r.logprobs[~r.completion_mask] == 0).all() and (r.logprobs[r.completion_mask] < 0).all()


def test_sampling_is_seeded(session, tok):
    kw = dict(max_new_tokens=6, do_sample=True, temperature=1.3, num_return_sequences=3, return_logprobs=True)
    state = torch.random.get_rng_state()
    a, b = (session.generate(_prompts(tok), seed=1, **kw) for _ in range(2))
    c = session.generate(_prompts(tok), seed=2, **kw)
    assert torch.equal(torch.random.get_rng_state(), state)
    assert torch.equal(a.sequences, b.sequences) and torch.equal(a.logprobs, b.logprobs)
    assert not torch.equal(a.sequences, c.sequences)


def test_bad_batched_arguments(session, tok):
    with pytest.raises(ValueError, match="num_return_sequences=0"):
        session.generate(_prompts(tok), max_new_tokens=2, num_return_sequences=0)
    with pytest.raises(ValueError, match="need tokenizer="):
        session.generate(["a", "b"], max_new_tokens=2)
    with pytest.raises(ValueError, match="prompts is empty"):
        session.generate([], max_new_tokens=2)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        session.generate([torch.tensor([1, 10_000])], max_new_tokens=2)


HOOK = pytest.mark.skipif(not hasattr(Session, "logprobs"), reason="needs Session.logprobs and step(loss=)")


@HOOK
def test_rollout_logprobs_equal_the_training_sides(session, tok):
    r = session.generate(_prompts(tok), max_new_tokens=5, do_sample=True, num_return_sequences=2,
                         return_logprobs=True, seed=3)
    b = r.batch()
    assert (session.logprobs(b) - b["old_logp"]).abs().max() < 1e-5
    ref = session.logprobs(b, ref=True)  # nothing trained yet: the files are the weights
    assert (ref - b["old_logp"]).abs().max() < 1e-5


@HOOK
def test_train_grpo_runs_and_logs(model_dir, tok):
    s = Session.from_pretrained(model_dir, device="cpu", dtype=torch.float32, lr=1e-3)
    try:
        prompts = ["What is 7 plus", "Hello", "The capital of"]
        want = tok("two", add_special_tokens=False)["input_ids"][0]
        reward = lambda ps, cs: [float(want in c) for c in cs]  # noqa: E731
        df = s.train_grpo([torch.tensor(tok(p)["input_ids"]) for p in prompts], reward, steps=3, group_size=4,
                          prompts_per_step=2, max_new_tokens=4, beta=0.1, progress=False)
        assert list(df.columns) == ["step", "reward_mean", "reward_std", "loss", "kl", "clip_ratio",
                                    "completion_len", "seconds"]
        assert df.step.tolist() == [1, 2, 3] and df.kl.notna().all() and (df.kl >= 0).all()
        with pytest.raises(ValueError, match="prompts_per_step=5"):
            s.train_grpo(prompts, reward, steps=1, prompts_per_step=5, tokenizer=tok)
    finally:
        s.close()


@HOOK
def test_train_grpo_records_reward_shows_the_bar_and_refreshes_the_dashboard(model_dir, tok, monkeypatch):
    """Each step's reward mean is in the session's history (so its dashboard); the bar's postfix carries
    reward, KL and clip fraction; the dashboard opens and refreshes as train's does."""
    import tqdm.auto

    from megatrain_nb import training
    import megatrain_nb.view.dashboard as dashboard_mod

    postfixes, draws = [], []

    class Bar(tqdm.auto.tqdm):
        def set_postfix(self, *a, **kw):
            postfixes.append(dict(*a, **{k: v for k, v in kw.items() if k != "refresh"}))
            super().set_postfix(*a, **kw)

    class FakeDashboard:
        def __init__(self, s):
            self.s = s

        def display(self):
            pass

        def update(self):
            draws.append(len(self.s.history))

    monkeypatch.setattr(tqdm.auto, "tqdm", Bar)
    monkeypatch.setattr(training, "in_jupyter", lambda: True)
    monkeypatch.setattr(dashboard_mod, "Dashboard", FakeDashboard)
    s = Session.from_pretrained(model_dir, device="cpu", dtype=torch.float32, lr=1e-3)
    try:
        prompts = [torch.tensor(tok(p)["input_ids"]) for p in ["What is 7 plus", "Hello", "The capital of"]]
        reward = lambda ps, cs: [float(i % 3 == 0) for i in range(len(cs))]  # noqa: E731
        df = s.train_grpo(prompts, reward, steps=2, group_size=2, prompts_per_step=2, max_new_tokens=3,
                          beta=0.1, refresh_s=0.0)
        hist = s.history_dataframe()
        assert hist.reward_mean.tolist() == pytest.approx(df.reward_mean.tolist())
        assert {"kl", "clip_ratio/region_mean"} <= set(hist.columns)
        assert [set(p) for p in postfixes] == [{"reward", "kl", "clip"}] * 2
        assert postfixes[-1] == {"reward": f"{df.reward_mean.iloc[-1]:.3f}", "kl": f"{df.kl.iloc[-1]:.4f}",
                                 "clip": f"{df.clip_ratio.iloc[-1]:.3f}"}
        assert draws == [1, 2, 2]  # every step (refresh_s=0), then the final state
        fig = s.plot_history()
        assert {"reward_mean", "kl", "clip_ratio/region_mean"} <= {t.name for t in fig.data}
        draws.clear()
        s.train_grpo(prompts, reward, steps=1, group_size=2, max_new_tokens=2, dashboard=False, progress=False)
        assert draws == [] and len(s.history) == 3
    finally:
        s.close()
