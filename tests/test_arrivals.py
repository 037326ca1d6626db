"""Arrivals (arrivals.py): groups made resident come in during the step they are first resident in.

On the CPU the thread runs as on CUDA (its copies are plain ones). Each test makes the thread slow
(``Arrivals.delay``) and fills the buffers a group is made with with NaN, so that anything that reads
them before the thread has written them shows in the numbers.
"""
from __future__ import annotations

import threading

import pytest
import torch

from conftest import VOCAB, make_batches, train_session
from megatrain_nb import Session
from megatrain_nb.host.optim import DeviceAdamW
from megatrain_nb.machine import placement as placing
from megatrain_nb.step.arrivals import Arrivals
from test_equivalence import LR, compare
from test_placement import _head, _losses


@pytest.fixture
def slow_nan(monkeypatch):
    return _slow_nan(monkeypatch)


def _slow_nan(monkeypatch, delay: float = 0.05) -> list:
    """Every copy sleeps first; a group is made with NaN everywhere until the thread writes it. Returns the
    list of (group, whether its copies had finished) at each wait of an update for it."""
    monkeypatch.setattr(Arrivals, "delay", delay)
    add = DeviceAdamW.add

    def nan_add(self, units, upload=None, fill=True):
        r = add(self, units, upload, fill)
        if not fill:
            for t in (r.master, r.exp_avg, r.exp_avg_sq, r.w):
                t.fill_(float("nan"))
        return r

    monkeypatch.setattr(DeviceAdamW, "add", nan_add)
    seen = []
    state = Arrivals.state

    def spy(self, g, stream):
        if g in self.moments:
            seen.append((g, self.moments[g].done))
        return state(self, g, stream)

    monkeypatch.setattr(Arrivals, "state", spy)
    return seen


@pytest.mark.parametrize("family,gated", [("llama", False), ("llama_tied", False), ("llama", True)])
def test_reads_and_updates_wait_for_groups_that_come_late(hf_dir, tmp_path, slow_nan, family, gated):
    d = hf_dir(family)
    L_ = _head(d)
    compare(d, family, tmp_path, steps=3, grad_clip=0.5 if gated else None,
            placement={u: "resident" for u in range(-1, L_ + 1)})
    assert slow_nan, "no update waited for a group's moments"
    assert not all(done for _, done in slow_nan), "every copy had finished before its wait: nothing shown"


def _placed_midway(d, batches, placement) -> tuple[list, list]:
    """Two steps all on the host, its AdamW slowed, then ``placement`` from the third: losses and masters."""
    s = Session.from_pretrained(d, lr=LR, placement="host")
    s.engine.io.delays["host-adam"] = 0.02  # the host's updates of step 2 are still running when step 3 starts
    try:
        got = train_session(s, batches[:2])
        du = s.engine.device_updates
        du.mode = placing.validate(placement, du.L, du.arch.tied)
        got += train_session(s, batches[2:])
        s.engine.drain()
        return got, [s.store.units[u].master.clone() for u in s.store.order]
    finally:
        s.close()


def test_groups_made_resident_take_the_hosts_last_update_first(hf_dir, monkeypatch):
    """A group made resident between steps is still the host's to update for the step before: its master
    comes in once that update is applied, whatever the order the threads run in."""
    d = hf_dir("llama")
    L_ = _head(d)
    batches = make_batches(VOCAB, 4)
    resident = {u: "resident" for u in (-1, 0, 1, L_)}
    want = _placed_midway(d, batches, resident)
    _slow_nan(monkeypatch)
    got = _placed_midway(d, batches, resident)
    assert got[0] == want[0]
    assert all(torch.equal(a, b) for a, b in zip(got[1], want[1]))
    host = _placed_midway(d, batches, "host")  # and it moved as a run that never placed anything resident
    assert got[0][:3] == host[0][:3]


def test_a_failed_copy_fails_the_step_and_the_next_trains_on_equal(hf_dir, monkeypatch, slow_nan):
    """The copy's error is the step's; nothing was applied; what did not come in comes in from the host."""
    d = hf_dir("llama")
    L_ = _head(d)
    resident = {u: "resident" for u in range(-1, L_ + 1)}
    batches = make_batches(VOCAB, 3)
    want = _losses(d, batches, resident)
    load, failed = DeviceAdamW.load_moments, []

    def flaky(self, r, put):
        if threading.current_thread().name == "megatrain-host-arrive" and not failed:
            failed.append(r.units)
            raise RuntimeError("the copy failed")
        return load(self, r, put)

    monkeypatch.setattr(DeviceAdamW, "load_moments", flaky)
    s = Session.from_pretrained(d, lr=LR, placement=resident)
    try:
        with pytest.raises(RuntimeError, match="the copy failed"):
            s.step(batches[0])
        assert failed == [(L_,)]  # the backward's first group: nothing had updated yet
        got = train_session(s, batches)
    finally:
        s.close()
    assert got == want


def test_a_skipped_gated_step_writes_back_the_state_it_never_used(hf_dir, slow_nan):
    """A non-finite gated step updates no resident group, so no update waited for their moments: a
    write-back after it still writes the host's own state back, not the buffers' NaN."""
    import warnings

    d = hf_dir("llama")
    L_ = _head(d)
    s = Session.from_pretrained(d, lr=LR, grad_clip=1.0, nonfinite="skip",
                                placement={u: "resident" for u in (-1, 1, 2, L_)})
    try:
        with torch.no_grad():
            s.store.units[1].master[:] = float("nan")  # layer 1 arrives with NaN weights: the loss is NaN
        before = {u: [getattr(s.store.units[u], k).clone() for k in ("master", "exp_avg", "exp_avg_sq")]
                  for u in (-1, 2, L_)}
        with warnings.catch_warnings(record=True):
            warnings.simplefilter("always")
            r = s.step(make_batches(VOCAB, 1)[0])
        assert r.skipped
        assert s.engine.device_updates.arrivals.moments  # no update asked for them
        s.engine.drain()  # a checkpoint's write-back
        for u, state in before.items():
            for k, t in zip(("master", "exp_avg", "exp_avg_sq"), state):
                assert torch.equal(getattr(s.store.units[u], k), t), (u, k)
    finally:
        s.close()


def test_the_trace_shows_each_group_coming_in(hf_dir):
    d = hf_dir("llama")
    L_ = _head(d)
    s = Session.from_pretrained(d, lr=LR, placement={u: "resident" for u in (-1, 0, L_)})
    try:
        train_session(s, make_batches(VOCAB, 1))
        df = s.trace.to_dataframe()
    finally:
        s.close()
    lane = df[df.lane == "host-arrive"]
    for op in ("arrive-wait", "arrive", "moments-in"):
        assert sorted(lane[lane.op == op].layer) == [-1, 0, L_], op
    assert (lane[lane.op != "arrive-wait"].bytes > 0).all() and (lane.end_ms >= lane.start_ms).all()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("state,gated", [("fp32", False), ("int4", False), ("int8", True)])
def test_arrivals_on_cuda_leave_results_bit_identical(tmp_path, monkeypatch, state, gated):
    """On the thread's own stream and staging, slowed and NaN until written: the same bits as at full speed."""
    from transformers import AutoModelForCausalLM

    from test_gpu import MIXED, _config, _run

    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(_config(attn="eager")).save_pretrained(tmp_path)
    kw = dict(placement=MIXED, optimizer_state=state, grad_clip=1.0 if gated else None, checkpoint_every=2)
    base_l, base_w = _run(tmp_path, {}, **kw)
    seen = _slow_nan(monkeypatch, delay=0.3)  # a step of this model takes tens of ms on the GPU
    l, w = _run(tmp_path, {}, **kw)
    assert seen and not all(done for _, done in seen)
    assert l == base_l
    assert all(torch.equal(a, b) for a, b in zip(w, base_w))
