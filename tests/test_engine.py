"""Engine behaviour that the equivalence tests do not pin down: the activation policy's lifetime."""
import torch

from conftest import make_config
from megatrain_nb import Session


def _batch(vocab, b, t):
    return {"input_ids": torch.randint(0, vocab, (b, t), generator=torch.Generator().manual_seed(b * t))}


def test_activation_policy_is_chosen_again_when_tokens_grow(monkeypatch):
    cfg = make_config("llama", num_hidden_layers=3)
    s = Session.from_config(cfg, seed=0)  # checkpoint_every=None: the policy comes from free memory
    chosen = []
    real = s.engine._keep_now

    def spy(i):
        chosen.append(i)
        return real(i)

    monkeypatch.setattr(s.engine, "_keep_now", spy)
    s.step(_batch(cfg.vocab_size, 2, 8))
    assert chosen == [0, 1, 2] and s.engine._keep_tokens == 16
    s.step(_batch(cfg.vocab_size, 2, 8))  # same size: the policy stands (keep[i] is read back)
    s.step(_batch(cfg.vocab_size, 1, 8))  # fewer tokens: still fits, stands
    assert s.engine._keep_tokens == 16
    s.step(_batch(cfg.vocab_size, 4, 8))  # more tokens than it was chosen for: chosen again
    assert s.engine._keep_tokens == 32
    s.close()


def test_fixed_checkpointing_is_never_rechosen():
    cfg = make_config("llama", num_hidden_layers=3)
    s = Session.from_config(cfg, seed=0, checkpoint_every=1)
    s.step(_batch(cfg.vocab_size, 1, 8))
    s.step(_batch(cfg.vocab_size, 4, 8))
    assert s.engine.keep == [False, False, False]
    assert s.history[-1].recomputed_layers == 3
    s.close()
