"""Note: [Warm recompute]: the measuring step runs its first layer once more without autograd. That leaves
training bit-identical (the output is dropped, the random state forked, even with dropout drawing), is
traced, and its seconds leave the measured step's time. On the CPU no step measures, so ``due`` is forced."""
import torch

from helpers import LR
from megatrain_nb import Session
from megatrain_nb.step import warmup


def _run(d, steps, force, monkeypatch, calls):
    real = warmup.recompute

    def counted(eng, *a):
        calls.append(eng.steps_done)
        return real(eng, *a)

    monkeypatch.setattr(warmup, "due", lambda eng, k, kept: force and k == 0 and kept and eng.steps_done == 0)
    monkeypatch.setattr(warmup, "recompute", counted)
    s = Session.from_pretrained(d, lr=LR, trace=True)
    try:
        losses = [s.step(b).loss for b in steps]
        s.engine.settle()  # every update of the last step applied
        masters = {u: unit.master.clone() for u, unit in s.engine.store.units.items()}
        return losses, masters, s.engine.device_updates.t_start
    finally:
        s.close()


def test_warm_recompute_leaves_training_bit_identical_and_is_traced(hf_dir, monkeypatch):
    d = hf_dir("llama", attention_dropout=0.5)  # a dropout that would draw from the random state
    g = torch.Generator().manual_seed(0)
    batches = [{"input_ids": torch.randint(0, 64, (2, 16), generator=g)} for _ in range(3)]
    warm, plain = [], []
    torch.manual_seed(0)
    lw, mw, _ = _run(d, batches, True, monkeypatch, warm)
    torch.manual_seed(0)
    lp, mp, _ = _run(d, batches, False, monkeypatch, plain)
    assert warm == [0] and plain == []  # once, in the first step; never when not due
    assert lw == lp
    assert all(torch.equal(mw[u], mp[u]) for u in mw)


def test_warm_recompute_takes_its_seconds_out_of_the_measured_step(hf_dir):
    d = hf_dir("llama")
    s = Session.from_pretrained(d, lr=LR, trace=True)
    try:
        s.step({"input_ids": torch.randint(0, 64, (2, 16))})
        eng = s.engine
        unit = eng.store.units[0]
        params = unit.layout.views(unit.master.to(eng.dtype))
        x = torch.randn(2, 16, eng.arch.config.hidden_size, dtype=eng.dtype)
        h0, calls = eng.arch.prelude(x, None, **eng.arch.position_kwargs(None, eng.dev.device))
        before = eng.device_updates.t_start
        eng.rec.begin_step(99)
        seconds = warmup.recompute(eng, 0, params, h0, calls[0])
        spans = eng.rec.end_step().to_dataframe()
        assert seconds > 0 and eng.device_updates.t_start == before + seconds
        assert "warm-recompute" in set(spans[spans.lane == "driver"].op)
    finally:
        s.close()
