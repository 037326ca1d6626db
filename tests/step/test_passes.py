"""Passes (Note: [Passes] in step/passes.py): a batch run as several forward/backward passes, one update.

On the CPU in fp32 the passes' sum is ``micro_batch_size``'s, bit for bit: the same gradients added in the
same order, whether they wait in a resident unit's buffer, the head's grad slot, the host's grad slab or,
for the embedding's rows, on the device. Against HF + torch.optim.AdamW, test_equivalence's tolerances.
"""
from __future__ import annotations

import functools

import pytest
import torch

from conftest import VOCAB, families, make_batches
from helpers import BETAS, EPS, LR, compare
from megatrain_nb import Session
from megatrain_nb.post import losses
from megatrain_nb.step import passes

BATCH = 4


def _state(s) -> dict:
    s.engine.drain()
    out = {}
    for u, unit in s.store.units.items():
        out[u] = (unit.master.clone(), unit.exp_avg.clone(), unit.exp_avg_sq.clone())
    return out


def _train(d, batches, loss=None, **settings) -> tuple[list[float], dict, list]:
    s = Session.from_pretrained(d, device="cpu", dtype=torch.float32, lr=LR, betas=BETAS, eps=EPS, **settings)
    try:
        rs = [s.step(b, loss=loss) for b in batches]
        return [r.loss for r in rs], _state(s), rs
    finally:
        s.close()


def _same(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for u in a:
        for x, y, what in zip(a[u], b[u], ("master", "exp_avg", "exp_avg_sq")):
            assert torch.equal(x, y), f"unit {u}: {what} differs by {(x - y).abs().max().item()}"


RESIDENT = {-1: "resident", 0: "resident"}  # the embedding and the first layer resident, the rest host


@pytest.mark.parametrize("placement", ["host", "resident_mix", "all_resident"])
@pytest.mark.parametrize("family", families("llama", "llama_tied"))
def test_passes_equal_micro_batches_bit_for_bit(hf_dir, family, placement):
    d = hf_dir(family)
    L = 2
    where = {"host": "host", "resident_mix": RESIDENT | ({L: "resident"} if family == "llama_tied" else {}),
             "all_resident": {u: "resident" for u in range(-1, L + 1)}}[placement]
    batches = make_batches(VOCAB, 3, batch=BATCH, pad_id=0)
    want_loss, want, _ = _train(d, batches, micro_batch_size=1, placement=where)
    got_loss, got, rs = _train(d, batches, pass_batch_size=1, placement=where)
    assert got_loss == want_loss
    _same(got, want)


def test_passes_train_equal_to_the_reference(hf_dir, tmp_path):
    compare(hf_dir("llama"), "llama", tmp_path, batch=BATCH, pass_batch_size=1, pad=True)
    # two passes of two micro-batches: the same terms, summed within each pass first
    compare(hf_dir("llama"), "llama", tmp_path, batch=BATCH, pass_batch_size=2, micro_batch_size=1, pad=True)
    compare(hf_dir("llama_tied"), "llama_tied", tmp_path, batch=BATCH, pass_batch_size=2, checkpoint_every=1,
            placement={-1: "resident", 2: "resident"})


def test_passes_with_a_loss_hook_keep_groups_whole_and_equal_micro_batches(hf_dir):
    """GRPO over two groups of two completions: a pass per group, the global counts over both passes."""
    d = hf_dir("llama")
    batches = make_batches(VOCAB, 2, batch=BATCH)
    g = torch.Generator().manual_seed(3)
    for b in batches:
        b["advantages"] = torch.randn(BATCH, generator=g)
        b["group"] = torch.tensor([0, 0, 1, 1])
    fn = functools.partial(losses.grpo, loss_type="bnpo")
    want_loss, want, _ = _train(d, batches, loss=fn, micro_batch_size=2)
    got_loss, got, _ = _train(d, batches, loss=fn, pass_batch_size=2)
    assert got_loss == want_loss
    _same(got, want)
    with pytest.raises(ValueError, match="pass_batch_size=1 would split a group of group_size=2"):
        _train(d, batches[:1], loss=fn, pass_batch_size=1)


def test_a_failed_pass_applies_nothing(hf_dir):
    """An error in the second pass: no unit was updated, and the same batch then trains as it would have."""
    d = hf_dir("llama")
    batches = make_batches(VOCAB, 2, batch=BATCH)
    _, want, _ = _train(d, batches, pass_batch_size=2)
    s = Session.from_pretrained(d, device="cpu", dtype=torch.float32, lr=LR, betas=BETAS, eps=EPS, pass_batch_size=2)
    try:
        before = _state(s)
        calls = []

        def boom(logp, batch, ctx):
            calls.append(1)
            if len(calls) == 2:
                raise RuntimeError("boom in the second pass")
            return -(logp.sum()) / ctx.tokens

        with pytest.raises(RuntimeError, match="boom in the second pass"):
            s.step(batches[0], loss=boom)
        _same(_state(s), before)
        assert s.engine.steps_done == 0
        for b in batches:
            s.step(b)
        _same(_state(s), want)
    finally:
        s.close()


def test_pass_batch_size_is_checked():
    with pytest.raises(ValueError, match=r"pass_batch_size=0: an int >= 1"):
        from megatrain_nb.config import EngineConfig
        EngineConfig(pass_batch_size=0)


def test_passes_refuse_streamed_units(hf_dir):
    d = hf_dir("llama")
    s = Session.from_pretrained(d, device="cpu", dtype=torch.float32, lr=LR, pass_batch_size=2,
                                placement={0: "device"})
    try:
        with pytest.raises(ValueError, match="placed \"device\""):
            s.step(make_batches(VOCAB, 1, batch=BATCH)[0])
        assert s.engine.steps_done == 0
    finally:
        s.close()


def test_split_and_rows_per_pass():
    mbs = [{"pass": 0}, {"pass": 1}, {"pass": 1}]
    assert [len(p) for p in passes.split(mbs)] == [1, 2]
    with pytest.raises(ValueError, match="consecutive"):
        passes.split([{"pass": 1}, {"pass": 0}])
    assert passes.rows_per_pass(3, None, 8) == 3  # the last pass is smaller
    assert passes.rows_per_pass(None, 6, 8, group_size=4) == 4  # "auto"'s choice rounds to whole groups


def test_uneven_last_pass_trains_equal_to_the_reference(hf_dir, tmp_path):
    compare(hf_dir("llama"), "llama", tmp_path, batch=3, pass_batch_size=2)


def test_a_step_of_passes_is_traced_pass_by_pass(hf_dir):
    """The trace holds each pass's forward of every layer and the earlier passes' gradients coming back in."""
    pytest.importorskip("plotly")
    s = Session.from_pretrained(hf_dir("llama"), device="cpu", dtype=torch.float32, lr=LR, pass_batch_size=2,
                                placement="host")
    try:
        s.step(make_batches(VOCAB, 1, batch=BATCH)[0])
        df = s.trace.to_dataframe()
        assert len(df[(df.op == "fwd") & (df.layer == 0)]) == 2
        assert set(df[df.op == "grad-in"].layer) == {0, 1}  # the host layers' gradients of the first pass
        s.plot_timeline(), s.plot_buffers()
    finally:
        s.close()
