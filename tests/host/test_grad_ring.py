"""The gradient ring (host/grad_ring.py, Note: [Gradient ring]): lending, back-pressure, spills, and training
with it equal to training with slabs (bitwise) and to HF + torch.optim.AdamW."""
from __future__ import annotations

import threading
import time

import pytest
import torch

from conftest import VOCAB, load_reference, make_batches, rel, train_reference, train_session
from helpers import BETAS, EPS, LR
from megatrain_nb import Session
from megatrain_nb.host.grad_ring import BUFFERS, OVERFLOW_HOST_MARGIN, GradRing, RingAborted, layout, ring_bytes, slab_reason

DEEP = 6  # layers: more ring units than buffers, so the ring is reused within a step
WIDE_VOCAB = 640  # an untied head of 640 x 32 = 20,480 values beside a llama layer's 9,344: the ring's largest unit


# ---- the ring alone ------------------------------------------------------------------------------
def test_take_waits_for_a_release_and_reuses_the_buffer():
    ring = GradRing({0: 100, 1: 70, 2: 10}, torch.float32, buffers=2)
    assert ring.nbytes == 2 * 128 * 4 and ring_bytes({-1: 999, 0: 100, 1: 70}, 4, 2) == ring.nbytes  # not the embedding
    a, b = ring.take(0), ring.take(1)
    assert a.numel() == 100 and b.numel() == 70 and ring.take(0) is a  # held: the same buffer again (a later pass)
    assert ring.would_wait(2)
    got = {}
    t = threading.Thread(target=lambda: got.setdefault("c", ring.take(2)))
    t.start()
    time.sleep(0.2)
    assert "c" not in got  # back-pressure: no free buffer until unit 0's update has read its gradients
    ring.release(0)
    t.join(5)
    assert got["c"].data_ptr() == a.data_ptr() and ring.waits == 1
    ring.release(5)  # a unit that holds nothing (the device updated it): no-op
    with pytest.raises(RuntimeError, match="unit 0 holds no gradient buffer"):
        ring.get(0)


def test_overflow_takes_plain_buffers_while_the_allowance_holds_then_waits():
    ring = GradRing({0: 100, 1: 100, 2: 100, 3: 100}, torch.float32, buffers=1)  # 128 elements a buffer, 400 B a unit
    assert ring.room(OVERFLOW_HOST_MARGIN + 900) == 900 and ring.room(10**12) == 1600  # at most every unit at once
    ring.room(OVERFLOW_HOST_MARGIN + 800)  # two units' overflow
    a = ring.take(0)  # the ring's buffer
    b, c = ring.take(1), ring.take(2)  # no free buffer: overflow, no wait
    assert ring.waits == 0 and ring.overflowed == 2 and ring.overflow_bytes == 800 and ring.overflow_peak == 800
    assert all(x.data_ptr() != a.data_ptr() for x in (b, c)) and not ring.would_wait(0)
    assert ring.would_wait(3)  # the allowance is spent: back-pressure again
    got = {}
    t = threading.Thread(target=lambda: got.setdefault("d", ring.take(3)))
    t.start()
    time.sleep(0.2)
    assert "d" not in got
    ring.release(1)  # its overflow buffer goes to the pool, and unit 3 takes it
    t.join(5)
    assert got["d"].data_ptr() == b.data_ptr() and ring.waits == 1 and ring.overflow_bytes == 800
    for u in (0, 2, 3):
        ring.release(u)
    assert ring.overflow_bytes == 800 and not ring.held  # pooled for the next step: no page faults each step
    ring.room(OVERFLOW_HOST_MARGIN - 100)  # the host filled up: what is pooled beyond the allowance goes
    assert ring.overflow == 700 and ring.overflow_bytes == 400
    ring.room(0)
    assert ring.overflow == 0 and ring.overflow_bytes == 0 and ring.would_wait(1) is False  # a free buffer: no wait
    ring.take(0)
    assert ring.would_wait(1)  # no allowance: the ring alone, as before


def test_reset_returns_overflow_buffers_to_the_pool():
    ring = GradRing({0: 8, 1: 8}, torch.float32, buffers=1)
    ring.room(OVERFLOW_HOST_MARGIN + 64)
    ring.take(0), ring.take(1)
    ring.reset()  # a failed step
    assert not ring.held and ring.free == [0] and ring.overflow_bytes == 32 and ring._over == {}


def test_spill_and_abort_and_reset():
    ring = GradRing({0: 8, 1: 8, 2: 8}, torch.float32, buffers=1)
    ring.take(0)
    abort = threading.Event()
    abort.set()
    with pytest.raises(RingAborted):
        ring.take(1, abort)
    ring.spill = True  # a gated step: every gradient at once, beyond the ring
    s1 = ring.take(1)
    assert ring.spilled == 1 and all(s1.data_ptr() != b.data_ptr() for b in ring.bufs)
    ring.reset()
    assert not ring.held and ring.free == [0]


def test_spill_buffers_stay_while_steps_spill_and_go_with_the_first_that_does_not():
    ring = GradRing({0: 8, 1: 8, 2: 8}, torch.float32, buffers=1)
    base = ring.nbytes
    ring.spill = True  # "auto"'s passes: every step holds every gradient
    first = {u: ring.take(u).data_ptr() for u in (0, 1, 2)}  # unit 0 the ring's buffer, 1 and 2 spill
    for u in (0, 1, 2):
        ring.release(u)
    assert ring.nbytes == base + 2 * 8 * 4  # the two spill buffers kept for the next step
    again = {u: ring.take(u).data_ptr() for u in (0, 1, 2)}
    assert again == first and ring.spilled == 4  # the same memory, not allocated afresh
    for u in (0, 1, 2):
        ring.release(u)
    ring.spill = False  # a step that waits for the ring: the spill buffers go
    assert ring.nbytes == base and ring.take(0).data_ptr() == first[0]
    ring.release(0)
    ring.spill = True
    ring.take(0), ring.take(1)
    ring.reset()  # a failed step: nothing held, nothing kept
    assert ring.nbytes == base and not ring.held and ring.free == [0]


def test_the_largest_unit_takes_a_region_the_others_share_while_it_is_free():
    """An untied head three layers wide: two layer-wide buffers and a head-wide region (2 layer slots), not three
    head-wide buffers; the head takes the region whole, layers the plain buffers first."""
    ring = GradRing({-1: 999, 0: 100, 1: 100, 2: 100, 3: 300}, torch.float32)
    assert layout(ring.numel) == (128, 3, 320) and (ring.big, ring.region, len(ring.slots)) == (3, (2, 3), 4)
    assert ring.nbytes == ring_bytes(ring.numel, 4) == (2 * 128 + 320) * 4 < BUFFERS * 320 * 4
    head = ring.take(3)  # first out in a backward: every slot free
    assert head.numel() == 300 and head.data_ptr() == ring.bufs[-1].data_ptr()
    a, b = ring.take(2), ring.take(1)
    assert {a.data_ptr(), b.data_ptr()} == {ring.bufs[0].data_ptr(), ring.bufs[1].data_ptr()}  # the plain ones
    assert ring.would_wait(0)  # three units held, as with three equal buffers
    ring.release(3)
    c = ring.take(0)  # the region's first slot, now the head is out
    assert c.data_ptr() == ring.bufs[-1].data_ptr() and c.numel() == 100
    assert ring.would_wait(3)  # the head waits for the whole region
    ring.release(2), ring.release(1)
    assert ring.would_wait(3) and not ring.would_wait(1)  # unit 0 still holds a region slot
    ring.release(0)
    assert not ring.would_wait(3) and ring.free == [0, 1, 2, 3]
    assert "2 buffers of 128 elements and unit 3's 320" in ring.describe()


def test_after_the_head_any_three_units_fit_at_once():
    """Once the head is out, no layer's copy waits while fewer than BUFFERS units hold slots, in any order of
    releases (the region's two slots and the plain buffers): no wait that equal buffers would not have."""
    g = torch.Generator().manual_seed(0)
    ring = GradRing({0: 100, 1: 100, 2: 100, 3: 100, 4: 100, 5: 300}, torch.float32)
    for _ in range(20):  # steps
        ring.take(5)
        held, todo = [5], [4, 3, 2, 1, 0]
        while todo or held:
            if todo and len(held) < BUFFERS:
                assert not ring.would_wait(todo[0]), (held, ring.free)
                ring.take(todo[0])
                held.append(todo.pop(0))
            else:  # any landed unit's update may finish first (the worker reads them in order; the test does not)
                ring.release(held.pop(int(torch.randint(len(held), (1,), generator=g))))
        assert ring.free == list(range(len(ring.slots))) and ring.waits == 0


def test_slab_reason_names_what_needs_gradients_at_rest():
    ok = dict(enabled=True, grad_clip=None, overlap_optimizer=True, nonfinite="skip", pass_batch_size=None, shared=False)
    assert slab_reason(**ok) is None
    assert "grad_clip" in slab_reason(**{**ok, "grad_clip": 1.0})
    assert "overlap_optimizer" in slab_reason(**{**ok, "overlap_optimizer": False})
    assert "nonfinite" in slab_reason(**{**ok, "nonfinite": "raise"})
    assert "pass_batch_size" in slab_reason(**{**ok, "pass_batch_size": 1})
    assert "shared" in slab_reason(**{**ok, "shared": True})
    assert slab_reason(**{**ok, "enabled": False}) == "grad_ring=False"


# ---- memory_report -------------------------------------------------------------------------------
def test_memory_report_shows_the_ring_by_default_and_slabs_with_grad_clip(hf_dir):
    d = hf_dir("llama", num_hidden_layers=DEEP)
    s = Session.from_pretrained(d, lr=LR)
    rep = s.memory_report()
    emb = s.store.units[-1].layout.numel
    largest = max(u.layout.numel for k, u in s.store.units.items() if k != -1)
    assert rep["grad"] == 0 and rep["grad_rows"] == 0  # no slab at all; no rows touched yet
    assert rep["grad_ring"] == BUFFERS * (-(-largest // 64) * 64) * 4 > 0
    assert rep["gradients"].startswith("ring") and "no grad_clip, one pass" in rep["gradients"]
    assert "the embedding's touched rows" in rep["gradients"]
    assert all(s.store.units[u].grad is None for u in range(-1, DEEP + 1))
    (batch,) = make_batches(VOCAB, 1, seed=3)
    s.step(batch)
    touched = batch["input_ids"].unique().numel()
    H = s.arch.embed.weight.shape[1]
    assert 0 < touched < VOCAB
    assert s.memory_report()["grad_rows"] == (touched + 1) * 4 * H + 8 * touched < 4 * emb  # the rows, a zero row, their ids
    s.close()
    c = Session.from_pretrained(d, lr=LR, grad_clip=1.0)
    rep = c.memory_report()
    n = sum(u.layout.numel for u in c.store.units.values())
    assert rep["grad_ring"] == 0 and rep["grad_rows"] == 0 and rep["grad"] == 4 * emb + 4 * (n - emb)  # fp32 on CPU
    assert rep["gradients"] == "slabs: grad_clip needs every unit's gradient before any update"
    c.close()


# ---- training: ring equals slabs, bitwise, and HF ---------------------------------------------------
def _train(d, batches, **settings):
    s = Session.from_pretrained(d, device="cpu", dtype=torch.float32, lr=LR, betas=BETAS, eps=EPS, **settings)
    try:
        losses = train_session(s, batches)
        s.engine.drain()
        masters = {u: s.store.units[u].master.clone() for u in s.store.order}
        return s, losses, masters
    finally:
        s.close()


@pytest.mark.parametrize("family,placement,state", [
    ("llama", "host", "fp32"), ("llama_tied", "host", "int8"), ("mixtral", "host", "int4"),
    ("llama", {0: "resident", 3: "resident"}, "fp32"), ("llama_tied", {-1: "resident", 6: "resident", 2: "resident"}, "int8"),
    ("qwen3_moe", {1: "device", 4: "device"}, "fp32"), ("gpt_oss", {0: "resident", 2: "device"}, "int4"),
])
def test_ring_trains_bitwise_as_slabs(hf_dir, family, placement, state):
    d = hf_dir(family, num_hidden_layers=DEEP)
    batches = make_batches(VOCAB, 3)
    kw = dict(placement=placement, optimizer_state=state, weight_slots=DEEP)
    ring, ring_losses, ring_w = _train(d, batches, **kw)
    slab, slab_losses, slab_w = _train(d, batches, grad_ring=False, **kw)
    assert ring.store.ring is not None and slab.store.ring is None
    assert ring_losses == slab_losses
    # a resident unit with compact moments differs between two runs with slabs too (its write-back): not compared
    skip = {u for u, v in placement.items() if v == "resident"} if isinstance(placement, dict) and state != "fp32" else set()
    assert all(torch.equal(ring_w[u], slab_w[u]) for u in ring_w if u not in skip)
    assert not ring.store.ring.held  # every buffer came back


@pytest.mark.parametrize("placement,state", [("host", "fp32"), ("host", "int8"), ({0: "resident", 4: "device"}, "fp32")])
def test_a_head_wider_than_the_layers_trains_through_its_region_as_slabs(hf_dir, placement, state):
    d = hf_dir("llama", num_hidden_layers=DEEP, vocab_size=WIDE_VOCAB)
    batches = make_batches(VOCAB, 3)
    kw = dict(placement=placement, optimizer_state=state, weight_slots=DEEP)
    ring, ring_losses, ring_w = _train(d, batches, **kw)
    _, slab_losses, slab_w = _train(d, batches, grad_ring=False, **kw)
    assert ring.store.ring.big == DEEP and len(ring.store.ring.bufs) == BUFFERS  # the head: two buffers and a region
    assert ring_losses == slab_losses and all(torch.equal(ring_w[u], slab_w[u]) for u in ring_w)
    assert not ring.store.ring.held


def _slow_host_adamw(monkeypatch, seconds: float = 0.05) -> None:
    """The host AdamW sleeps ``seconds`` before each unit's update (undone by ``monkeypatch.undo``)."""
    from megatrain_nb.host import optim

    slow = optim.HostAdamW.update

    def sleepy(self, u, lr, grad_scale=1.0):
        time.sleep(seconds)
        return slow(self, u, lr, grad_scale)

    monkeypatch.setattr(optim.HostAdamW, "update", sleepy)


@pytest.mark.parametrize("vocab", [VOCAB, WIDE_VOCAB])
def test_slow_host_adamw_fills_the_ring_and_training_still_equals_hf(hf_dir, monkeypatch, vocab):
    """The host AdamW sleeps before each update: the ring fills, copies out wait (``wait-ring`` spans), and the
    weights still equal HF + torch.optim.AdamW's and the slabs' bit for bit; with equal buffers, and with a head
    wider than the layers (its region)."""
    d = hf_dir("llama", num_hidden_layers=DEEP, **({} if vocab == VOCAB else {"vocab_size": vocab}))
    batches = make_batches(VOCAB, 3)
    _slow_host_adamw(monkeypatch)
    s = Session.from_pretrained(d, device="cpu", dtype=torch.float32, lr=LR, betas=BETAS, eps=EPS,
                                grad_ring_overflow=False)
    try:
        got = train_session(s, batches)
        trace = s.trace.to_dataframe()
        s.engine.drain()
        ring_w = {u: s.store.units[u].master.clone() for u in s.store.order}
        assert s.store.ring.waits > 0 and s.store.ring.spilled == 0  # back-pressure, never a spill
        assert s.store.ring.overflowed == 0 and s.memory_report()["grad_ring_overflow"] == 0
        assert s.store.ring.big == (None if vocab == VOCAB else DEEP)
        assert (trace.op == "wait-ring").any() and set(trace[trace.op == "wait-ring"].lane) == {"host-unpack"}
        out = d.parent / f"{d.name}-ring-slow"
        s.save_pretrained(out)
    finally:
        s.close()
    monkeypatch.undo()
    _, slab_losses, slab_w = _train(d, batches, grad_ring=False)
    assert got == slab_losses and all(torch.equal(ring_w[u], slab_w[u]) for u in ring_w)
    ref = load_reference(d, "sdpa")
    want, _, _ = train_reference(ref, batches, lr=LR, betas=BETAS, eps=EPS, weight_decay=0.0)
    assert max(abs(a - b) / abs(b) for a, b in zip(got, want)) < 1e-5
    from transformers import AutoModelForCausalLM

    saved = AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32).state_dict()
    assert max(rel(saved[k], v) for k, v in ref.state_dict().items()) < 1e-4


@pytest.mark.parametrize("vocab", [VOCAB, WIDE_VOCAB])
def test_slow_host_adamw_overflows_where_the_host_has_room_and_still_equals_the_slabs(hf_dir, monkeypatch, vocab):
    """The default: the host AdamW sleeps, every ring buffer is held, and the copies out take overflow buffers
    instead of waiting (no ``wait-ring`` span); the weights equal the slabs' bit for bit. Under a ``host_memory``
    that leaves nothing past the margin, the same steps wait as with the overflow off; so they do with no budget
    where the process already holds its share of the machine (Note: [Spare host] in ``machine/budget.py``)."""
    d = hf_dir("llama", num_hidden_layers=DEEP, **({} if vocab == VOCAB else {"vocab_size": vocab}))
    batches = make_batches(VOCAB, 3)
    _slow_host_adamw(monkeypatch)
    s = Session.from_pretrained(d, device="cpu", dtype=torch.float32, lr=LR, betas=BETAS, eps=EPS)
    try:
        got = train_session(s, batches)
        trace = s.trace.to_dataframe()
        s.engine.drain()
        ring = s.store.ring
        over_w = {u: s.store.units[u].master.clone() for u in s.store.order}
        assert ring.overflowed > 0 and ring.waits == 0 and not (trace.op == "wait-ring").any()
        biggest = max(ring.numel.values()) * 4
        assert 0 < ring.overflow_peak <= s.memory_report()["grad_ring_overflow"] <= sum(ring.numel.values()) * 4
        assert ring.overflow_peak >= biggest and not ring.held  # at least one unit's; each update released its buffer
    finally:
        s.close()
    from megatrain_nb.machine.budget import host_rss

    tight = Session.from_pretrained(d, device="cpu", dtype=torch.float32, lr=LR, betas=BETAS, eps=EPS,
                                    host_memory=host_rss() + (1 << 30))  # under the 4 GiB margin: no room
    try:
        train_session(tight, batches[:1])
        assert tight.store.ring.overflow == 0 and tight.store.ring.overflowed == 0 and tight.store.ring.waits > 0
    finally:
        tight.close()
    from megatrain_nb.machine import budget

    monkeypatch.setattr(budget, "HOST_SHARE", host_rss() / 2 / budget.host_total())  # no budget, past the share
    full = Session.from_pretrained(d, device="cpu", dtype=torch.float32, lr=LR, betas=BETAS, eps=EPS)
    try:  # Note [Spare host]: the process holds more of the machine than it plans to: no overflow, waits
        train_session(full, batches[:1])
        assert full.store.ring.overflow == 0 and full.store.ring.overflowed == 0 and full.store.ring.waits > 0
    finally:
        full.close()
    monkeypatch.undo()
    _, slab_losses, slab_w = _train(d, batches, grad_ring=False)
    assert got == slab_losses and all(torch.equal(over_w[u], slab_w[u]) for u in over_w)


@pytest.mark.parametrize("vocab", [VOCAB, WIDE_VOCAB])
def test_gated_steps_spill_beyond_the_ring(hf_dir, vocab):
    """A gated step (as "auto"'s trial step is) holds every gradient at once: it takes spill buffers beyond the
    ring instead of waiting for one forever, as many bytes as ``spill_bytes`` counts (the units that find no free
    slot: fewer than all, the ring's buffers and region hold the first to land), and equals slabs bitwise."""
    from megatrain_nb.host.grad_ring import spill_bytes

    d = hf_dir("llama", num_hidden_layers=DEEP, vocab_size=vocab)
    batches = make_batches(VOCAB, 2)
    s = Session.from_pretrained(d, device="cpu", dtype=torch.float32, lr=LR, betas=BETAS, eps=EPS)
    real = s.engine._step

    def gated(mbs, n_valid, hook):  # every update waits for every gradient, as a trial step of "auto" does
        s.engine.device_updates.gate = True
        return real(mbs, n_valid, hook)

    s.engine._step = gated
    try:
        got = train_session(s, batches)
        s.engine.drain()
        w = {u: s.store.units[u].master.clone() for u in s.store.order}
        ring = s.store.ring
        assert ring.spilled > 0 and not ring.held
        assert ring.spilled_numel * 4 == len(batches) * spill_bytes(ring.numel, 4)  # each step's spill, counted
        assert spill_bytes(ring.numel, 4) < sum(ring.numel.values()) * 4
        assert (ring.big is not None) == (vocab == WIDE_VOCAB)  # the region's layout, and the equal buffers'
    finally:
        s.close()
    _, want, slab_w = _train(d, batches, grad_ring=False)
    assert got == want and all(torch.equal(w[u], slab_w[u]) for u in w)


def test_a_trial_runs_only_where_the_host_holds_its_spill(hf_dir):
    """"auto"'s trial step holds every gradient at once: the search enters it only where the host has room for
    that beside what the process holds, under ``host_memory`` where set; else it says why and keeps A."""
    from megatrain_nb.host.grad_ring import spill_bytes
    from megatrain_nb.machine.budget import host_rss
    from megatrain_nb.step.device_updates import SPILL_HOST_MARGIN

    d = hf_dir("llama", num_hidden_layers=DEEP)
    roomy = Session.from_pretrained(d, device="cpu", dtype=torch.float32)
    try:
        need = spill_bytes(roomy.store.ring.numel, 4)
        assert 0 < need < sum(n for u, n in roomy.store.ring.numel.items() if u != -1) * 4  # less what the ring holds
        assert roomy.engine.device_updates._no_room_for_spill() is None  # a tiny model's spill on a box with GiBs free
    finally:
        roomy.close()
    budget = host_rss() + SPILL_HOST_MARGIN // 2  # the runtime fits; a trial's spill and its margin do not
    tight = Session.from_pretrained(d, device="cpu", dtype=torch.float32, host_memory=budget)
    try:
        why = tight.engine.device_updates._no_room_for_spill()
        assert why is not None and f"host_memory={budget}" in why and "GiB free" in why, why
    finally:
        tight.close()
    slabs = Session.from_pretrained(d, device="cpu", dtype=torch.float32, host_memory=budget, grad_ring=False)
    try:
        assert slabs.store.ring is None and slabs.engine.device_updates._no_room_for_spill() is None  # slabs: already held
    finally:
        slabs.close()
