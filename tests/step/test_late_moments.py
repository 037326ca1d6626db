"""Late moments (late_moments.py): groups made resident bring their moments in during the step.

On the CPU the thread runs as on CUDA (its copies are plain ones). Each test makes the thread slow
(``LateMoments.delay``) and fills the moment buffers a group arrives with with NaN, so that anything
that reads them before the thread has written them shows in the numbers.
"""
from __future__ import annotations

import threading

import pytest
import torch

from conftest import VOCAB, make_batches, train_session
from helpers import LR, compare, head_unit, losses_under
from megatrain_nb import Session
from megatrain_nb.host.optim import DeviceAdamW
from megatrain_nb.step.late_moments import LateMoments
from step_helpers import slow_nan


@pytest.fixture
def slow_nan_moments(monkeypatch):
    return slow_nan(monkeypatch)


@pytest.mark.parametrize("family,gated", [("llama", False), ("llama_tied", False), ("llama", True)])
def test_updates_wait_for_moments_that_come_late(hf_dir, tmp_path, slow_nan_moments, family, gated):
    d = hf_dir(family)
    L_ = head_unit(d)
    compare(d, family, tmp_path, steps=3, grad_clip=0.5 if gated else None,
            placement={u: "resident" for u in range(-1, L_ + 1)})
    assert slow_nan_moments, "no update waited for a group's moments"
    assert not all(done for _, done in slow_nan_moments), "every upload had finished before its wait: nothing shown"


def _failing_copies(hf_dir, monkeypatch, fails) -> tuple:
    """Every group resident in the tiny Llama; ``load_moments`` raises "copy N failed" (N from 1) where
    ``fails(group, failures so far, the head's unit)``. Returns (session, batches, the losses of a run with
    no failure, the failures: (group, thread name), the head's unit)."""
    d = hf_dir("llama")
    L_ = head_unit(d)
    resident = {u: "resident" for u in range(-1, L_ + 1)}
    batches = make_batches(VOCAB, 3)
    want = losses_under(d, batches, resident)
    load, failed = DeviceAdamW.load_moments, []

    def flaky(self, r, put):
        if fails(r.units, failed, L_):
            failed.append((r.units, threading.current_thread().name))
            raise RuntimeError(f"copy {len(failed)} failed")
        return load(self, r, put)

    monkeypatch.setattr(DeviceAdamW, "load_moments", flaky)
    return Session.from_pretrained(d, lr=LR, placement=resident), batches, want, failed, L_


def test_a_failed_upload_fails_the_step_and_the_next_trains_on_equal(hf_dir, monkeypatch, slow_nan_moments):
    """The upload's error is the step's; nothing was applied, the moments come in again from the host."""
    def first_on_thread(g, failed, head):
        return threading.current_thread().name == "megatrain-host-moments" and not failed

    s, batches, want, failed, L_ = _failing_copies(hf_dir, monkeypatch, first_on_thread)
    try:
        with pytest.raises(RuntimeError, match="copy 1 failed"):
            s.step(batches[0])
        assert [g for g, _ in failed] == [(L_,)]  # the backward's first group: nothing had updated yet
        got = train_session(s, batches)
    finally:
        s.close()
    assert got == want


def test_a_copy_that_fails_again_in_the_recovery_fails_the_next_step_not_the_recovery(hf_dir, monkeypatch):
    s, batches, want, failed, L_ = _failing_copies(hf_dir, monkeypatch,
                                                   lambda g, failed, head: g == (head,) and len(failed) < 2)
    try:
        with pytest.raises(RuntimeError, match="copy 1 failed"):  # on the thread, then in the recovery
            s.step(batches[0])
        assert len(failed) == 2 and failed[0][1] == "megatrain-host-moments"  # the recovery's own try: quietly
        with pytest.raises(RuntimeError, match="copy 2 failed"):  # its group's first update raises it
            s.step(batches[0])
        got = train_session(s, batches)  # the recovery after that brought the moments in
    finally:
        s.close()
    assert got == want


def test_a_skipped_gated_step_writes_back_the_moments_it_never_used(hf_dir, slow_nan_moments):
    """A non-finite gated step updates no resident group, so no update waited for their moments: a
    write-back after it still writes the host's own moments back, not the buffers' NaN."""
    import warnings

    d = hf_dir("llama")
    L_ = head_unit(d)
    s = Session.from_pretrained(d, lr=LR, grad_clip=1.0, nonfinite="skip",
                                placement={u: "resident" for u in (-1, 1, 2, L_)})
    try:
        with torch.no_grad():
            s.store.units[1].master[:] = float("nan")  # layer 1 arrives with NaN weights: the loss is NaN
        before = {u: (s.store.units[u].exp_avg.clone(), s.store.units[u].exp_avg_sq.clone()) for u in (-1, 2, L_)}
        with warnings.catch_warnings(record=True):
            warnings.simplefilter("always")
            r = s.step(make_batches(VOCAB, 1)[0])
        assert r.skipped
        assert s.engine.device_updates.late.pending  # no update asked for them
        s.engine.drain()  # a checkpoint's write-back
        for u, (m, v) in before.items():
            assert torch.equal(s.store.units[u].exp_avg, m) and torch.equal(s.store.units[u].exp_avg_sq, v), u
    finally:
        s.close()


def test_the_trace_shows_the_moments_coming_in(hf_dir):
    d = hf_dir("llama")
    L_ = head_unit(d)
    s = Session.from_pretrained(d, lr=LR, placement={u: "resident" for u in (-1, 0, L_)})
    try:
        train_session(s, make_batches(VOCAB, 1))
        df = s.trace.to_dataframe()
    finally:
        s.close()
    ins = df[(df.lane == "host-moments") & (df.op == "moments-in")]
    assert sorted(ins.layer) == [-1, 0, L_]
    assert (ins.bytes > 0).all() and (ins.end_ms >= ins.start_ms).all()
    arrive = df[(df.lane == "driver") & (df.op == "arrive")]
    assert sorted(arrive.layer) == [-1, 0, L_]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("state,gated", [("fp32", False), ("int4", False), ("int8", True)])
def test_late_moments_on_cuda_leave_results_bit_identical(tmp_path, monkeypatch, state, gated):
    """On the thread's own stream and staging, slowed and with NaN until written: the same bits as at full speed."""
    from transformers import AutoModelForCausalLM

    from helpers import GPU_MIXED, gpu_config, gpu_run

    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(gpu_config(attn="eager")).save_pretrained(tmp_path)
    kw = dict(placement=GPU_MIXED, optimizer_state=state, grad_clip=1.0 if gated else None, checkpoint_every=2)
    base_l, base_w = gpu_run(tmp_path, {}, **kw)
    seen = slow_nan(monkeypatch)
    monkeypatch.setattr(LateMoments, "delay", 0.3)  # a step of this model takes tens of ms on the GPU
    l, w = gpu_run(tmp_path, {}, **kw)
    assert seen and not all(done for _, done in seen)
    assert l == base_l
    assert all(torch.equal(a, b) for a, b in zip(w, base_w))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("state", ["int8", "int4"])
def test_compact_moments_of_a_layer_with_an_alignment_tail_come_in_whole_on_cuda(tmp_path, monkeypatch, state):
    """Note: [Alignment tail] in compact_state.py: hidden 96 leaves each layer's slab 32 positions past its compact
    moment's end. Its device buffers NaN first (``DeviceAdamW.poison``) or zero: the same bits, no step skipped."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    from helpers import gpu_run

    c = LlamaConfig(vocab_size=1024, hidden_size=96, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                    num_key_value_heads=2, max_position_embeddings=512)
    c._attn_implementation = "eager"
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(c).save_pretrained(tmp_path)
    kw = dict(placement={0: "resident", 1: "resident"}, optimizer_state=state)
    monkeypatch.setattr(DeviceAdamW, "poison", 0.0)
    base_l, base_w = gpu_run(tmp_path, {}, **kw)
    monkeypatch.setattr(DeviceAdamW, "poison", float("nan"))
    l, w = gpu_run(tmp_path, {}, **kw)
    assert l == base_l
    assert all(torch.equal(a, b) for a, b in zip(w, base_w))
    assert all(bool(torch.isfinite(x).all()) for x in w)
