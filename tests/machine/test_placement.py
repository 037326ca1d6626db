"""Placement: the pure choice (placement.py), and every placement trains equal to HF + torch.optim.AdamW.

On the CPU a "resident" unit's state lives in separate tensors updated by DeviceAdamW (the same fused
kernel as the host's), so the equality tolerances are test_equivalence's.
"""
from __future__ import annotations

import pytest
import torch

from conftest import VOCAB, families, load_reference, make_batches, rel, train_reference, train_session
from helpers import LR, compare, head_unit, losses_under
from megatrain_nb import Session
from megatrain_nb.machine import placement as placing

L = 4
NUMEL = {-1: 1000, 0: 300, 1: 300, 2: 300, 3: 300, 4: 50}


# ---- the pure choice ------------------------------------------------------------------------------
def test_auto_fills_forward_order_within_the_free_memory():
    per_layer = placing.resident_bytes(0, 300, 2, tied=True)
    head = placing.resident_bytes(-1, 1000, 2, tied=True) + placing.resident_bytes(4, 50, 2, tied=True)
    free = placing.RESERVE_BYTES + head + 2 * per_layer + per_layer // 2
    c = placing.choose(NUMEL, mode="auto", free_bytes=free, dtype_bytes=2, tied=True, cuda=True)
    assert [c[u].placement for u in (-1, 0, 1, 2, 3, 4)] == ["resident", "resident", "resident", "host", "host",
                                                              "resident"]
    assert "fits" in c[0].reason and "left" in c[2].reason


def test_untied_head_comes_last_and_alone():
    c = placing.choose(NUMEL, mode="auto", free_bytes=1 << 40, dtype_bytes=2, tied=False, cuda=True)
    assert all(ch.placement == "resident" for ch in c.values())
    assert placing.groups(L, tied=False)[-1] == (L,) and placing.groups(L, tied=True)[0] == (L, -1)


def test_host_keeps_nothing_and_stream_streams_the_head_group_and_first_layers():
    c = placing.choose(NUMEL, mode="host", free_bytes=1 << 40, dtype_bytes=2, tied=True, cuda=True)
    assert {ch.placement for ch in c.values()} == {"host"} and all("placement='host'" in ch.reason for ch in c.values())
    s = placing.choose(NUMEL, mode="stream", free_bytes=1 << 40, dtype_bytes=2, tied=True, cuda=True, share=0.5)
    assert [s[u].placement for u in (-1, 0, 1, 2, 3, 4)] == ["device", "device", "device", "host", "host", "device"]
    assert "first 2 of 4 layers" in s[0].reason and "Streamed head" in s[-1].reason
    u = placing.choose(NUMEL, mode="stream", free_bytes=1 << 40, dtype_bytes=2, tied=False, cuda=True, share=0.5)
    assert [u[k].placement for k in (-1, 0, 1, 2, 3, 4)] == ["host", "device", "device", "host", "host", "device"]
    assert "untied embedding updates on the host" in u[-1].reason


def test_stream_extras_count_the_head_groups_state_when_it_streams():
    """Note: [Streamed head]: 12 bytes a parameter in and nothing on the host, against 4 in and the host's AdamW."""
    numel = {-1: 1000, 0: 300, 1: 300, 2: 50}
    assert placing.stream_extras(numel, tied=True) == {"host_extra": 0.0, "in_extra": 12 * 1050 / 600}
    assert placing.stream_extras(numel, tied=False) == {"host_extra": 1000 / 600, "in_extra": 12 * 50 / 600}
    assert placing.stream_extras(numel, tied=True, head_streamed=False) == {"host_extra": 1050 / 600,
                                                                            "in_extra": 4 * 1050 / 600}


def test_stream_share_balances_pcie_against_host_adam():
    """Note: [Host window]: the host's side is its updates and the forward's loads of its layers (4 bytes a
    parameter), which wait for them; PCIe's, every byte in."""
    a, b = 3.5e9, 55e9
    f = placing.stream_share(a, b)
    assert (8 + 12 * f) / b == pytest.approx((1 - f) / a + 4 * (1 - f) / b)  # Note: [Streamed updates]
    held = placing.stream_share(a, b, cached=True)  # weights in once; a "device" unit's not at all (Note: [Held weights])
    assert (4 * (1 - held) + 12 * held) / b == pytest.approx((1 - held) / a + 4 * (1 - held) / b)
    assert placing.stream_share(1e15, b) == 0.0 and placing.stream_share(1.0, b) == pytest.approx(1.0)
    w = placing.stream_share(a, b, cached=True, window=0.75)  # its side fits 3/4 of the step
    assert 0.75 * (4 * (1 - w) + 12 * w) / b == pytest.approx((1 - w) / a + 4 * (1 - w) / b) and w > held
    compact = placing.stream_share(a, b, cached=True, window=0.75, state_bytes=6.03)  # int8 moments cross in fewer
    assert compact > w  # bytes: more layers stream
    extra = placing.stream_share(a, b, cached=True, window=0.75, host_extra=0.1, in_extra=1.0)
    g = 1 - extra
    assert 0.75 * (1.0 + 4 * g + 12 * extra) / b == pytest.approx((0.1 + g) / a + 4 * g / b)


def test_auto_waits_for_a_measuring_step_and_never_places_on_cpu():
    first = placing.choose(NUMEL, mode="auto", free_bytes=None, dtype_bytes=2, tied=True, cuda=True)
    cpu = placing.choose(NUMEL, mode="auto", free_bytes=1 << 40, dtype_bytes=4, tied=True, cuda=False)
    assert {c.placement for c in first.values()} == {c.placement for c in cpu.values()} == {"host"}
    assert "measuring" in first[0].reason and "cpu" in cpu[0].reason


@pytest.mark.parametrize("bad,match", [("gpu", "use one of"), ({7: "resident"}, "placement key 7"),
                                       ({0: "device-ish"}, r"placement\[0\]"), ({-1: "resident"}, "placed alike"),
                                       ({-1: "device", 4: "host"}, "placed alike"),
                                       (["host"], "use one of")])
def test_bad_placement_names_the_value_and_fix(bad, match):
    with pytest.raises(ValueError, match=match):
        placing.validate(bad, L, tied=True)


def test_an_untied_embedding_does_not_stream():
    with pytest.raises(ValueError, match=r"placement\[-1\]='device': an untied embedding"):
        placing.validate({-1: "device"}, L, tied=False)
    assert placing.validate({-1: "device", L: "device"}, L, tied=True) == {-1: "device", L: "device"}
    assert placing.validate({L: "device"}, L, tied=False) == {L: "device"}


def test_json_keys_come_back_as_units():
    assert placing.validate({"-1": "resident", "4": "resident", "0": "host"}, L, tied=True) == \
        {-1: "resident", 4: "resident", 0: "host"}


# ---- equality with HF + torch.optim.AdamW -----------------------------------------------------------
MIXES = {
    "all_resident": lambda L: {u: "resident" for u in range(-1, L + 1)},
    "layers_resident": lambda L: {u: "resident" for u in range(L)},
    "head_group_only": lambda L: {-1: "resident", L: "resident"},
    "alternating": lambda L: {u: "resident" for u in range(-1, L + 1) if u % 2 == 0} | {-1: "resident", L: "resident"},
    "streamed_layers": lambda L: {0: "device", L - 1: "device"},
    "streamed_head": lambda L: {-1: "device", L: "device"},  # untied: the head alone (below)
    "stream_all": lambda L: {u: "device" for u in range(-1, L + 1)},
    "every_kind": lambda L: {-1: "resident", L: "resident", 0: "device", 1: "resident"} | {u: "device" for u in range(2, L)},
}


@pytest.mark.parametrize("mix", list(MIXES))
@pytest.mark.parametrize("family", families("llama", "llama_tied", "mixtral"))
def test_placements_train_equal_to_reference(hf_dir, family, mix, tmp_path):
    d = hf_dir(family)
    import json
    L_ = json.loads((d / "config.json").read_text())["num_hidden_layers"]
    tied = json.loads((d / "config.json").read_text()).get("tie_word_embeddings", False)
    mix_ = MIXES[mix](L_)
    if not tied and mix == "head_group_only":
        mix_ = {-1: "resident"}  # untied: the embedding alone
    if not tied and mix in ("streamed_head", "stream_all"):
        mix_.pop(-1)  # an untied embedding does not stream (Note: [Streamed head])
    compare(d, family, tmp_path, placement=mix_)


@pytest.mark.parametrize("kind", ["int8", "int4"])
def test_resident_compact_units_train_equal_whatever_their_buffers_held(hf_dir, kind, tmp_path, monkeypatch):
    """Note: [Resident compact] fp32 moments on the device: every unit resident, the run equals the reference.
    Each new device buffer is NaN first (``DeviceAdamW.poison``), so that a position no load writes (a layer's
    alignment tail, Note: [Alignment tail] in compact_state.py) fails the run every time, not when the allocator
    happens to hand out a negative there."""
    from megatrain_nb.host.optim import DeviceAdamW

    monkeypatch.setattr(DeviceAdamW, "poison", float("nan"))
    d = hf_dir("llama")
    import json
    cfg = json.loads((d / "config.json").read_text())
    assert cfg["hidden_size"] % 64 != 0  # a layer's last tensor, a norm of hidden_size values, leaves a tail
    compare(d, "llama", tmp_path, placement=MIXES["all_resident"](cfg["num_hidden_layers"]), optimizer_state=kind)


@pytest.mark.parametrize("family", families("llama_tied", "qwen3_moe"))
def test_resident_with_clip_decay_schedule_and_recompute(hf_dir, family, tmp_path):
    compare(hf_dir(family), family, tmp_path, steps=6, schedule=("linear", 1, 5), weight_decay=0.1, grad_clip=0.5,
            checkpoint_every=1, micro_batch_size=1, pad=True, placement={u: "resident" for u in (-1, 0, 2)} |
            ({} if family != "llama_tied" else {}) | {head_unit(hf_dir(family)): "resident"})


@pytest.mark.parametrize("family", families("llama", "mixtral"))
def test_a_weight_slot_per_layer_reuses_the_forwards_weights_and_trains_equal(hf_dir, family, tmp_path):
    """What placement "stream" resolves weight_slots=None to on a GPU with room (placement.weight_slots):
    every layer keeps its slot from the forward to the backward, so the backward loads no weights; and a
    "device" unit's update refills its slot, so the next forward loads none of it (Note: [Held weights])."""
    d = hf_dir(family)
    L_ = head_unit(d)
    compare(d, family, tmp_path, placement={0: "device", L_ - 1: "device"}, weight_slots=L_)
    s = Session.from_pretrained(d, lr=LR, weight_slots=L_, placement={0: "device"})
    try:
        for n, batch in enumerate(make_batches(VOCAB, 3)):
            s.step(batch)
            df = s.trace.to_dataframe()
            loads = df[(df.lane == "h2d") & (df.op == "h2d") & df.layer.between(0, L_ - 1)]  # decoder layers' weights
            assert set(loads.phase) == {"fwd"}, loads[["layer", "phase"]]
            assert sorted(loads.layer) == list(range(0 if n == 0 else 1, L_)), (n, sorted(loads.layer))
        e = s.engine
        slot = e.slot_of(0)
        assert e.slot_current[slot] and not any(c for k, c in enumerate(e.slot_current) if k != slot)
        e.device_updates.settle()
        n0 = e.store.units[0].layout.numel
        assert torch.equal(e.slots[slot][:n0], e.store.units[0].master.to(e.dtype))  # the held slot is the new master
    finally:
        s.close()


def test_held_weights_with_recompute_micro_batches_and_clip(hf_dir, tmp_path):
    """Held weights (Note: [Held weights]) under every layer recomputed and two micro-batches, and with a gate
    (grad_clip: "device" units update on the host, so nothing is held) train equal to the reference."""
    d = hf_dir("llama", num_hidden_layers=4)
    compare(d, "llama", tmp_path, placement={0: "device", 1: "device", 3: "device"}, weight_slots=4,
            checkpoint_every=1, micro_batch_size=1)
    compare(d, "llama", tmp_path, placement={0: "device", 1: "device"}, weight_slots=4, grad_clip=0.5)


@pytest.mark.parametrize("slots", [2, 3])
def test_streamed_units_with_fewer_slots_than_layers_train_equal(hf_dir, slots, tmp_path):
    """More layers than weight slots: the backward loads weights again, and only the units its slots keep at
    the end are refilled by their update (Note: [Held weights]); the rest load as before."""
    d = hf_dir("llama", num_hidden_layers=5)
    compare(d, "llama", tmp_path, placement={0: "device", 2: "device", 4: "device"}, weight_slots=slots)


@pytest.mark.parametrize("head", [False, True])
@pytest.mark.parametrize("family", families("llama_tied"))
def test_held_weights_survive_a_generation_between_steps(hf_dir, family, head):
    """A forward-only pass between steps loads into the weight slots (``Engine.stream_layers``) and the head
    slot: what it leaves there is current, the next step computes from it, and the training is the same as
    without it; with the head group streamed too (Note: [Streamed head])."""
    d = hf_dir(family)
    L_ = head_unit(d)
    batches = make_batches(VOCAB, 4)
    masters = []
    mix = {0: "device", 1: "device"} | ({-1: "device", L_: "device"} if head else {})
    for between in (False, True):
        s = Session.from_pretrained(d, lr=LR, weight_slots=L_, placement=mix)
        try:
            for n, b in enumerate(batches):
                s.step(b)
                if between and n == 1:
                    assert s.generate(torch.tensor([[1, 2, 3]]), max_new_tokens=2).shape[-1] == 5
            s.engine.device_updates.settle()
            s.engine.adam.wait_all(len(batches))
            masters.append({u: unit.master.clone() for u, unit in s.engine.store.units.items()})
        finally:
            s.close()
    assert all(torch.equal(masters[0][u], masters[1][u]) for u in masters[0])


def test_stream_gets_a_slot_per_layer_where_they_fit():
    G = 2**30
    assert placing.weight_slots(None, "stream", 36, 154 << 20, 140 * G) == 36  # 3B on the H200: 5.4 GiB
    assert placing.weight_slots(None, "stream", 80, 1712 << 20, 140 * G) == 2  # 70B layers: 134 GiB, no
    assert placing.weight_slots(None, "stream", 36, 154 << 20, None) == 2  # no device figure (the CPU)
    assert placing.weight_slots(None, "auto", 36, 154 << 20, 140 * G) == 2
    assert placing.weight_slots(5, "stream", 36, 154 << 20, 140 * G) == 5
    assert placing.stream_share(2.1e9, 49e9, cached=True) > placing.stream_share(2.1e9, 49e9)


def test_placement_frame_says_what_and_why(hf_dir):
    d = hf_dir("llama_tied")
    L_ = head_unit(d)
    s = Session.from_pretrained(d, lr=LR, placement={0: "resident", -1: "resident", L_: "resident"})
    try:
        df = s.placement
        assert list(df.columns) == ["unit", "name", "placement", "params", "device_GiB", "moments", "reason"]
        assert set(df.moments) == {"fp32"}
        assert df.set_index("unit").placement.to_dict() == {-1: "resident", **{i: "host" for i in range(1, L_)},
                                                           0: "resident", L_: "resident"}
        assert df.set_index("unit").loc[1, "reason"] == "not named in the placement dict"
        assert (df.device_GiB[df.placement == "resident"] > 0).all() and (df.device_GiB[df.placement == "host"] == 0).all()
        assert s.memory_report()["device_resident"] == pytest.approx(df.device_GiB.sum() * 2**30)
    finally:
        s.close()


def test_resident_state_reaches_the_host_only_when_read(hf_dir, tmp_path):
    """Between steps the host master of a resident unit is stale; save_pretrained/checkpoint write it back."""
    d = hf_dir("llama")
    s = Session.from_pretrained(d, lr=LR, placement={0: "resident"})
    try:
        before = s.store.units[0].master.clone()
        train_session(s, make_batches(VOCAB, 2))
        s.engine.adam.wait_all(s.engine.steps_done)
        assert torch.equal(s.store.units[0].master, before), "the host copy should not be written every step"
        assert not torch.equal(s.engine.dev_opt.of[0].master, before)
        s.save_pretrained(tmp_path / "out")
        assert torch.equal(s.store.units[0].master, s.engine.dev_opt.of[0].master)
        assert s.optim.steps_done(0) == 2
    finally:
        s.close()


@pytest.mark.parametrize("first,then", [("host", {0: "resident", 2: "resident"}),
                                        ({0: "resident", -1: "resident"}, "host"),
                                        ({0: "device", 1: "resident"}, {0: "resident", 1: "device"}),
                                        ({0: "device", 2: "device"}, {0: "device", 2: "resident"})])
def test_resume_is_bitwise_across_placements(hf_dir, tmp_path, first, then):
    """Checkpoint format unchanged: a run saved under one placement resumes under another bit for bit."""
    d = hf_dir("llama")
    batches = make_batches(VOCAB, 5)
    want = losses_under(d, batches, first)
    s = Session.from_pretrained(d, lr=LR, placement=first)
    try:
        train_session(s, batches[:2])
        s.save_checkpoint(tmp_path / "ck")
    finally:
        s.close()
    r = Session.resume(tmp_path / "ck", placement=then)
    try:
        got = train_session(r, batches[2:])
    finally:
        r.close()
    assert got == want[2:]


def test_a_failed_step_leaves_resident_state_untouched(hf_dir):
    """A step that fails before its backward changes nothing (docs/engine.md [Failed steps]), resident
    units included: training goes on equal to a run that never saw it."""
    d = hf_dir("llama")
    batches = make_batches(VOCAB, 3)
    want = losses_under(d, batches, {0: "resident", 1: "resident"})
    s = Session.from_pretrained(d, lr=LR, placement={0: "resident", 1: "resident"})
    try:
        train_session(s, batches[:1])
        state = s.engine.dev_opt.of[0].master.clone()
        s.engine._loss = lambda *a: (_ for _ in ()).throw(RuntimeError("boom"))
        with pytest.raises(RuntimeError, match="boom"):
            s.step(batches[1])
        del s.engine._loss
        assert torch.equal(s.engine.dev_opt.of[0].master, state)
        got = train_session(s, batches[1:])
    finally:
        s.close()
    assert got == want[1:]


@pytest.mark.parametrize("family", families("llama_tied", "llama"))
def test_a_streamed_head_group_is_held_and_its_rows_gathered_on_the_device(hf_dir, family):
    """Note: [Streamed head]: after the first step the head slot holds the head group's new weights (its
    update cast them), so no step loads the head's weights again; its state comes in and goes out each
    step; a tied embedding's rows are gathered from the head slot, not on the host, and no gradient of
    the group crosses to the host."""
    d = hf_dir(family)
    L_ = head_unit(d)
    tied = family == "llama_tied"
    s = Session.from_pretrained(d, lr=LR, placement={L_: "device", 0: "device"} | ({-1: "device"} if tied else {}))
    outs = 0
    try:
        for n, batch in enumerate(make_batches(VOCAB, 3)):
            s.step(batch)
            df = s.trace.to_dataframe()
            head = df[df.layer == L_]
            assert (set(head[head.lane == "h2d"].op) == ({"h2d", "state-in"} if n == 0 else {"state-in"})), (n, head)
            group = df[df.layer.isin([L_, -1] if tied else [L_])]  # its write-back lands the group's last unit
            outs += int((group.op == "state-out").sum())  # in its step's trace, or the next's: no step waits for it
            assert group[group.lane == "d2h"].bytes.sum() == 0  # at most its norm: no gradient goes out
            embed = df[(df.layer == -1) & df.lane.isin(["h2d", "d2h"])]
            assert embed.empty if tied else set(embed.lane) == {"h2d", "d2h"}, embed
        assert outs >= 2, outs
        e = s.engine
        assert e.head_current
        e.device_updates.settle()
        n = e.head_layout.numel
        master = torch.cat([e.store.units[L_].master] + ([e.store.units[-1].master] if tied else []))
        assert torch.equal(e.head_slot[:n], master.to(e.dtype))  # the held slot is the written-back master
        assert e.optim.steps_done(L_) == 0 and int(e.dev_opt.streamed[L_]) == 3  # counted on the device
        s.close()
        assert e.optim.steps_done(L_) == 3  # close wrote the device's count back to the host
    finally:
        s.close()


def _hold_write_backs(monkeypatch, s, unit: int, gates: list) -> None:
    """Each state write-back of ``unit`` reaches the writer thread only once the event it appends to ``gates``
    is set."""
    import threading

    io = s.engine.io
    grads = io.grads

    def held(u, src, segs, done, phase, **kw):
        if kw.get("op") == "state-out" and u == unit:
            gates.append(threading.Event())
            io.writer.submit(gates[-1].wait)  # the writer reaches this write-back after that
        return grads(u, src, segs, done, phase, **kw)

    monkeypatch.setattr(io, "grads", held)


@pytest.mark.parametrize("family, held", [("llama_tied", -1), ("llama_tied", 0), ("llama", "head")],
                         ids=["head_group", "layer", "untied_head"])
def test_no_step_waits_for_a_state_write_back(hf_dir, monkeypatch, family, held):
    """Note: [Late write-backs], [Streamed head]: a step returns before a "device" unit's state is back on
    the host (the writer is held up here); the next step's state load, settle and the reported grad norm
    wait for what they need, and the run equals one whose write-backs were never held. The grad norms are
    those of a run that updates everything on the host."""
    import threading

    d = hf_dir(family)
    L_ = head_unit(d)
    held = L_ if held == "head" else held
    mix = {L_: "device", 0: "device"} | ({-1: "device"} if family == "llama_tied" else {})
    batches = make_batches(VOCAB, 3)
    norms = {}
    for p in ("host", mix):
        clean = Session.from_pretrained(d, lr=LR, placement=p)
        try:
            norms[str(p)] = [(r.loss, r.grad_norm) for r in map(clean.step, batches)]
        finally:
            clean.close()
    want = norms[str(mix)]
    assert [n for _, n in want] == pytest.approx([n for _, n in norms["host"]], rel=1e-5)
    s = Session.from_pretrained(d, lr=LR, placement=mix)
    try:
        gates, got, du = [], [], s.engine.device_updates
        _hold_write_backs(monkeypatch, s, held, gates)
        for b in batches:
            r = s.step(b)
            pending = du.head_written if held in (-1, L_) else du.writes[-1]
            assert not pending.done  # returned before it landed
            assert s.engine.adam.version[held] < s.engine.steps_done  # so the worker has not counted it
            got.append((r.loss, r.grad_norm))
            threading.Timer(0.05, gates[-1].set).start()  # the next step's state load waits for it
        s.engine.settle()
        assert pending.done and not du.writes
        assert all(v == len(batches) for v in s.engine.adam.version.values())
    finally:
        s.close()
    assert got == want


def test_state_written_back_in_pieces_trains_equal(hf_dir, monkeypatch, tmp_path):
    """transfers.STATE_OUT_CHUNK_BYTES: a write-back in many small copies (here 1 KiB) is the same state."""
    from megatrain_nb.step import transfers

    monkeypatch.setattr(transfers, "STATE_OUT_CHUNK_BYTES", 1024)
    d = hf_dir("llama_tied")
    compare(d, "llama_tied", tmp_path, placement={u: "device" for u in range(-1, head_unit(d) + 1)})


@pytest.mark.parametrize("late", [False, True], ids=["landed", "write_back_late"])
def test_a_failed_step_with_the_head_group_streamed_trains_on_equal(hf_dir, monkeypatch, late):
    """A step that fails after the head group's state load was queued (Note: [Streamed head]) leaves no
    state buffer waiting for a write-back that never comes, and the head slot is loaded again. ``late``:
    the step before it returned with a layer's write-back still held up (Note: [Late write-backs]); the
    failure waits for it, so that nothing is half-written, and the run goes on equal."""
    import threading

    d = hf_dir("llama_tied")
    L_ = head_unit(d)
    mix = {-1: "device", L_: "device", 0: "device"}
    batches = make_batches(VOCAB, 3)
    want = losses_under(d, batches, mix)
    s = Session.from_pretrained(d, lr=LR, placement=mix)
    try:
        gates = []
        if late:
            _hold_write_backs(monkeypatch, s, 0, gates)
        train_session(s, batches[:1])
        if late:
            assert not s.engine.device_updates.writes[-1].done
            threading.Timer(0.2, gates[-1].set).start()
        s.engine._loss = lambda *a: (_ for _ in ()).throw(RuntimeError("boom"))
        with pytest.raises(RuntimeError, match="boom"):
            s.step(batches[1])
        del s.engine._loss
        assert not s.engine.head_current and not s.engine.device_updates.writes
        for g in gates:
            g.set()  # later write-backs of layer 0 are not held
        monkeypatch.undo()
        got = train_session(s, batches[1:])
    finally:
        s.close()
    assert got == want[1:]


@pytest.mark.parametrize("nonfinite", ["skip", "raise"])
def test_non_finite_loss_skips_resident_updates_too(hf_dir, nonfinite):
    """Overlapped device updates decide on the device (found_inf); gated ones on the host: neither applies."""
    import math
    import warnings

    d = hf_dir("llama")
    L_ = head_unit(d)
    s = Session.from_pretrained(d, lr=LR, nonfinite=nonfinite, placement={u: "resident" for u in (-1, 1, 2, L_)})
    try:
        train_session(s, make_batches(VOCAB, 1))
        s.engine.settle()  # the first step's host updates are applied before we look
        with torch.no_grad():
            s.engine.dev_opt.of[1].w[:] = float("nan")  # layer 1's weights, all of them: the loss becomes NaN (a few
            # q_proj entries did not with transformers 5.24, whose CPU attention returned finite outputs)
        before = {u: (s.engine.dev_opt.of[u].master.clone(), float(s.engine.dev_opt.of[u].steps[u])) for u in (-1, 2, L_)}
        host0 = s.store.units[0].master.clone()
        if nonfinite == "raise":
            with pytest.raises(FloatingPointError, match="no update was applied"):
                s.step(make_batches(VOCAB, 1, seed=5)[0])
        else:
            with warnings.catch_warnings(record=True):
                warnings.simplefilter("always")
                r = s.step(make_batches(VOCAB, 1, seed=5)[0])
            assert r.skipped and math.isnan(r.loss) and s.skipped_steps == 1
        s.engine.adam.wait_all(s.engine.steps_done)
        for u, (m, n) in before.items():
            assert torch.equal(s.engine.dev_opt.of[u].master, m), u
            assert float(s.engine.dev_opt.of[u].steps[u]) == n == 1.0, u
        assert torch.equal(s.store.units[0].master, host0)
    finally:
        s.close()


# ---- the auto search (pure) -------------------------------------------------------------------------
GiB = 2**30
HEAD = [(6 * GiB, 0.10)] + [(1 * GiB, 0.02)] * 8  # (device bytes, host AdamW s) of the groups A leaves on the host


def _fake_planner(search: placing.Search, steps: dict, wait_a: float = 0.0, c_step=None):
    """A planner that predicts ``steps[c]`` s for the candidate whose budget it is asked about (any budget
    but A's and B's is one of C's: ``c_step(bytes)`` where given), and ``wait_a`` s of A's forward waiting
    for host updates (none for the others)."""
    def predict(free):
        c = next((k for k in ("A", "B") if search.free.get(k) == free), "C")
        if c == "C" and c_step is not None:
            return c_step(free), 0.0
        return steps[c], wait_a if c == "A" else 0.0
    return predict


def _run_search(steps: dict, *, wait_a=0.15, kept=40, fits=False, host_bound=True, step_s=None):
    """Drive a search as the engine does (one ``place`` / ``after_step`` per step); returns it and the
    phases the steps ran in, the measuring step's first."""
    s = placing.Search()
    ran = [s.phase]
    s.measured(free=1 * GiB, keep=[True] * kept + [False], layer_bytes=2 * GiB, checkpoint_bytes=GiB // 64,
               everything_fits=fits, host_bound=host_bound, head=HEAD)
    if s.phase == "plan":
        s.planned(_fake_planner(s, steps, wait_a))
    while s.phase != "done":
        ran.append(s.phase)
        s.stepped(step_s or 9.0, keep=[True] * 35 + [False] * 6)
    for t in (3.30, 3.26, 3.25, 3.24):  # settled steps of the winner
        ran.append(s.phase)
        if s.observing:
            s.stepped(t, keep=[True] * 35 + [False] * 6)
    return s, ran


def _settled_at(ran: list) -> int:
    """The first step (1-based) that ran the final placement."""
    return next(i for i, p in enumerate(ran) if p == "done") + 1


@pytest.mark.parametrize("steps,winner", [({"A": 3.41, "C": 3.21, "B": 3.50}, "C"),
                                          ({"A": 3.41, "C": 3.40, "B": 2.90}, "B"),
                                          ({"A": 3.20, "C": 3.40, "B": 3.50}, "A")])
def test_search_takes_the_planners_best_and_settles_by_the_third_step(steps, winner):
    s, ran = _run_search(steps)
    assert s.winner == winner and s.predicted == steps, (s.predicted, s.summary())
    assert _settled_at(ran) <= 3, ran
    assert ran[:_settled_at(ran) - 1] == ["measure"] + ([] if winner == "A" else [winner + "1"]), ran
    # nothing is timed against anything: only the winner's settled steps, for the summary
    assert set(s.seconds) == {winner} and s.seconds[winner] == 3.25 and s.observed == [3.30, 3.26, 3.25]
    assert s.NAMES[winner] + " (planner: " in s.summary() and "measured 3.250 s" in s.summary(), s.summary()
    assert all(f"{v:.3f} s" in s.summary() for v in steps.values()), s.summary()


def test_a_candidate_with_fewer_residents_wins_within_the_margin():
    s, ran = _run_search({"A": 3.26, "C": 3.21, "B": 3.50})  # C is 1.6% faster: A moves nothing and needs no trial
    assert s.winner == "A" and _settled_at(ran) == 2 and "within 2%" in s.summary()
    assert _run_search({"A": 3.50, "C": 3.40, "B": 3.35})[0].winner == "C"  # B 1.5% faster than C: C
    assert _run_search({"A": 3.30, "C": 3.21, "B": 3.50})[0].winner == "C"  # C 2.7% faster: C
    assert placing.pick({"A": 1.0, "B": 0.94}) == ("B", "predicted fastest")


def test_c_budget_is_the_planners_best_up_to_the_predicted_wait_of_a():
    s, _ = _run_search({"A": 1.0, "C": 0.9, "B": 1.3}, wait_a=0.15)
    # every budget predicted alike: the fewest bytes, the reserve (A overshot nothing: 1 GiB < 2 GiB) and the head group
    assert s.free["C"] == placing.RESERVE_BYTES + 6 * GiB and s.winner == "C" and s.c_groups == (1, 4)
    # budgets up to the cover: the head group and three layers, 0.10 + 3 * 0.02 >= 0.15; the planner's best is the second
    asked = []

    def c_step(free):
        asked.append((free - placing.RESERVE_BYTES) // GiB)
        return {6: 0.95, 7: 0.90, 8: 0.92, 9: 0.93}[(free - placing.RESERVE_BYTES) // GiB]
    s = placing.Search()
    s.measured(free=1 * GiB, keep=[True] * 40 + [False], layer_bytes=2 * GiB, checkpoint_bytes=GiB // 64,
               everything_fits=False, head=HEAD)
    s.planned(_fake_planner(s, {"A": 1.0, "B": 1.3}, 0.15, c_step))
    assert asked == [6, 7, 8, 9] and s.free["C"] == placing.RESERVE_BYTES + 7 * GiB and s.predicted["C"] == 0.90
    assert s.winner == "C" and "the forward's head resident 0.900 s with its first 2 groups resident, the best of 4" \
        in s.summary(), s.summary()
    s, _ = _run_search({"A": 1.0, "B": 1.3}, wait_a=0.02)  # under 3% of A's step: C is not a candidate
    assert "C" not in s.predicted and "C" not in s.free and s.winner == "A"
    s, _ = _run_search({"A": 1.0, "B": 1.3}, wait_a=0.15, kept=2)  # C's budget would reach B's
    assert "C" not in s.predicted


def test_search_takes_a_at_once_when_nothing_is_worth_predicting():
    for kw in (dict(fits=True), dict(kept=0), dict(host_bound=False)):  # long context: the host hides
        s, ran = _run_search({"A": 9.0, "C": 1.0, "B": 1.0}, **kw)
        assert (s.winner, s.predicted, _settled_at(ran)) == ("A", {}, 2), kw
    s = placing.Search()
    s.measured(free=10, keep=[True, False], layer_bytes=4, checkpoint_bytes=1, everything_fits=False)
    s.planned(None)  # the planner cannot read the model
    assert (s.phase, s.winner, s.candidate) == ("done", "A", "A") and "cannot predict" in s.summary()
    assert placing.Search.done_with(123).free["A"] == 123 and placing.Search.done_with(1).candidate == "A"


def test_a_trial_that_runs_out_of_memory_falls_back_to_a():
    s = placing.Search()
    s.measured(free=1 * GiB, keep=[True] * 40 + [False], layer_bytes=2 * GiB, checkpoint_bytes=GiB // 64,
               everything_fits=False, head=HEAD)
    s.planned(_fake_planner(s, {"A": 3.41, "C": 3.21, "B": 3.50}, 0.15))
    assert s.phase == "C1" and s.candidate == "C" and s.trial and s.keep.get("C") is None
    s.abandon()  # C1 ran out of device memory
    assert (s.phase, s.winner, s.candidate) == ("done", "A", "A") and not s.trial
    assert "ran out of device memory" in s.summary() and "the forward's head resident 3.210 s" in s.summary()
    for t in (3.5, 3.4, 3.41):
        s.stepped(t, keep=[True] * 41)
    assert s.seconds == {"C": float("inf"), "A": 3.41} and not s.observing


def test_no_room_for_a_trial_keeps_a_and_says_why():
    s = placing.Search()
    s.measured(free=1 * GiB, keep=[True] * 40 + [False], layer_bytes=2 * GiB, checkpoint_bytes=GiB // 64,
               everything_fits=False, head=HEAD)
    s.planned(_fake_planner(s, {"A": 3.41, "C": 3.21, "B": 3.50}, 0.15), no_trial="the host has 1.0 GiB free")
    assert (s.phase, s.winner, s.trial) == ("done", "A", False), s.summary()
    assert "the forward's head resident was predicted fastest, but its trial step cannot run: the host has 1.0 GiB" \
        in s.summary(), s.summary()
    s = placing.Search()
    s.measured(free=1 * GiB, keep=[True] * 40 + [False], layer_bytes=2 * GiB, checkpoint_bytes=GiB // 64,
               everything_fits=False, head=HEAD)
    s.planned(_fake_planner(s, {"A": 3.20, "C": 3.40, "B": 3.50}, 0.15), no_trial="the host has 1.0 GiB free")
    assert s.winner == "A" and "trial" not in s.summary()  # A won anyway: nothing to explain


def test_a_trial_keeps_the_policy_its_first_forward_chose():
    s, ran = _run_search({"A": 3.41, "C": 3.40, "B": 2.90})
    assert s.keep["B"] == [True] * 35 + [False] * 6 and s.keep["A"] == [True] * 40 + [False]


def _in_trial(hf_dir, phase: str):
    """(a twin's losses over three batches, the batches, a session one step in whose next step is the
    search's trial ``phase``, with activations first's policy to fall back to)."""
    d = hf_dir("llama")
    batches = make_batches(VOCAB, 3)
    twin = Session.from_pretrained(d, lr=LR)
    try:
        want = train_session(twin, batches)
    finally:
        twin.close()
    s = Session.from_pretrained(d, lr=LR)
    try:
        train_session(s, batches[:1])
    except BaseException:
        s.close()
        raise
    s.engine.device_updates.search = placing.Search(phase=phase, free={"A": 0, "B": 0, "C": 0},
                                                    keep={"A": [True] * s.engine.L})
    return want, batches, s


@pytest.mark.parametrize("where", ["_forward", "_loss"])
def test_a_residency_first_trial_that_runs_out_of_memory_falls_back_without_losing_the_step(hf_dir, where):
    """An OOM before any update of a B trial step: the same batch runs again as activations first."""
    want, batches, s = _in_trial(hf_dir, "B1")
    try:
        L_ = s.engine.L
        real, calls = getattr(s.engine, where), []

        def oom_once(*a, **k):
            calls.append(1)
            if len(calls) == 1:
                raise torch.OutOfMemoryError("CUDA out of memory (simulated)")
            return real(*a, **k)

        setattr(s.engine, where, oom_once)
        got = train_session(s, batches[1:])
        # in the forward, B1 has no activation policy yet: the retry must not start the search over
        assert len(calls) == 3 and s.engine.device_updates.search.winner == "A" and s.engine.device_updates.search.phase == "done"
        assert s.engine.keep == [True] * L_
        assert "ran out of device memory" in s.placement.reason.iloc[0]
    finally:
        s.close()
    assert got == want[1:]


def test_resident_bytes_follow_groups_in_and_out(hf_dir):
    s = Session.from_pretrained(hf_dir("llama"), lr=LR, placement={0: "resident", -1: "resident"})
    try:
        train_session(s, make_batches(VOCAB, 1))
        s.engine.drain()  # the worker has counted every unit of the step before the groups change under it
        opt = s.engine.dev_opt
        want = sum(t.numel() * t.element_size() for r in opt.groups.values()
                   for t in (r.w, r.grad, r.master, r.exp_avg, r.exp_avg_sq, r.egrad) if t is not None)
        assert opt.nbytes == want > 0
        opt.remove((0,))
        assert opt.nbytes < want
    finally:
        s.close()


@pytest.mark.parametrize("share", [0.0, None])
def test_state_slots_one_per_streamed_layer_or_two_in_turn_train_equal(hf_dir, tmp_path, monkeypatch, share):
    """placement.state_slots: with room, every "device" layer gets its own state slot (its load need not
    wait for another layer's write-back); without (share 0), two slots in turn. Both equal HF + AdamW."""
    from megatrain_nb.machine import placement as placing

    if share is not None:
        monkeypatch.setattr(placing, "STATE_SLOT_SHARE", share)
    d = hf_dir("llama")
    L_ = head_unit(d)
    streamed = {u: "device" for u in range(L_)}
    compare(d, "llama", tmp_path, placement=streamed)
    s = Session.from_pretrained(d, lr=LR, placement=streamed)
    try:
        s.step(make_batches(VOCAB, 1)[0])
        assert len(s.engine.device_updates.sslots) == (2 if share == 0.0 else L_)
    finally:
        s.close()


@pytest.mark.parametrize("phase", ["C1", "B1"])
def test_a_trial_that_runs_out_of_memory_in_its_backward_runs_the_batch_again(hf_dir, phase):
    """Note: [Auto search] a trial's first step is gated: an OOM half-way through its backward (the head's and
    the last layers' gradients already on the host) applies nothing, and the batch runs again as the best
    candidate so far. Before, the updates had started with the loss, and the error ended the run (3B x 16,
    H200, 2026-12-02)."""
    want, batches, s = _in_trial(hf_dir, phase)
    try:
        L_ = s.engine.L
        real, calls = s.engine._reduced, []

        def oom_in_backward(unit, *a, **k):
            calls.append(unit)
            if len(calls) == 3:  # the head and layer L-1 have landed; layer L-2's backward runs out
                assert s.engine._gated and not s.engine._committed
                raise torch.OutOfMemoryError("CUDA out of memory (simulated)")
            return real(unit, *a, **k)

        s.engine._reduced = oom_in_backward
        got = train_session(s, batches[1:])
        assert calls[:3] == [L_, L_ - 1, L_ - 2] and calls[3] == L_  # the batch ran again from its loss
        assert s.engine.device_updates.search.phase == "done" and s.engine.device_updates.search.winner == "A"
    finally:
        s.close()
    assert got == want[1:]


@pytest.mark.parametrize("mode,leaving", [("auto", True), ({0: "resident"}, False)])
def test_a_new_batch_size_caps_kept_layers_without_the_residents_that_leave(hf_dir, monkeypatch, mode, leaving):
    """Under "auto" a new batch size's measuring step runs with nothing resident, so the keep cap and the
    share are chosen from the device memory in use less the residents' bytes (H200, 2026-12-02: 7B x 8 after x 2
    kept 6 layers, 24 in a fresh process). A placement dict keeps its residents: they count."""
    from types import SimpleNamespace

    GiB = 1 << 30
    s = Session.from_pretrained(hf_dir("llama"), lr=LR, lean_activations=False)
    try:
        e = s.engine
        seen = []
        monkeypatch.setattr(e.ckpts, "reset", lambda lb, memory: seen.append(memory()[0]))
        monkeypatch.setattr(e.dev, "cuda", True)  # _place_checkpoints alone, with the allocator's figures faked
        monkeypatch.setattr(torch.cuda, "memory_allocated", lambda *a: 50 * GiB)
        monkeypatch.setattr(torch.cuda, "get_device_properties", lambda *a: SimpleNamespace(total_memory=140 * GiB))
        monkeypatch.setattr(e.dev_opt, "nbytes", 30 * GiB)
        monkeypatch.setattr(e.device_updates, "mode", mode)
        e._place_checkpoints([{"input_ids": torch.zeros(2, 12, dtype=torch.long)}])
        assert seen == [(20 if leaving else 50) * GiB]
    finally:
        monkeypatch.undo()
        s.close()


def test_stream_rate_balances_the_host_rate_with_the_head_groups_state_and_starts_over(hf_dir):
    """Note: [Stream rate]: the share comes from the host's AdamW rate since it was last set, counting the
    head group's state, which streams whatever the share (Note: [Streamed head]); the count restarts."""
    d = hf_dir("llama_tied")
    s = Session.from_pretrained(d, lr=LR, placement="stream")
    try:
        du, L = s.engine.device_updates, s.engine.L
        numel = {u: unit.layout.numel for u, unit in s.engine.store.units.items()}
        layers = sum(numel[i] for i in range(L))
        du.adam_rate = (2_000_000, 1e-3)  # 2 G params/s
        du.stream_rate()
        cached = s.engine.cfg.weight_slots >= L  # a tiny model's two layers fill its two slots
        want = placing.stream_share(2e9, placing.PCIE_IN_STEP_BYTES_PER_S, cached=cached, window=placing.HOST_WINDOW,
                                    host_extra=0.0, in_extra=12 * (numel[L] + numel[-1]) / layers)
        assert du.share == pytest.approx(want) and du.rated == 1 and du.adam_rate == (0, 0.0)
        assert want < placing.stream_share(2e9, placing.PCIE_IN_STEP_BYTES_PER_S, cached=cached,
                                           window=placing.HOST_WINDOW)  # its state in
        du.stream_rate()  # nothing updated since: the share stands
        assert du.share == pytest.approx(want) and du.rated == 1
    finally:
        s.close()


def test_stream_rate_counts_compact_state_in_the_bytes_a_streamed_layer_brings(hf_dir):
    """With optimizer_state="int8" a "device" layer's state crosses in ~6 bytes a parameter, not 12: the share
    streamed counts the bytes the store holds (its master and compact moments), so more layers stream."""
    d = hf_dir("llama_tied", hidden_size=128, intermediate_size=320)  # tensors of 4096 values and more: compact
    shares = {}
    for state in ("fp32", "int8"):
        s = Session.from_pretrained(d, lr=LR, placement="stream", optimizer_state=state)
        try:
            du, L, units = s.engine.device_updates, s.engine.L, s.engine.store.units
            numel = {u: unit.layout.numel for u, unit in units.items()}
            held = sum(u.master.nbytes + u.exp_avg.nbytes + u.exp_avg_sq.nbytes for u in (units[0],)) / numel[0]
            head = sum(units[u].master.nbytes + units[u].exp_avg.nbytes + units[u].exp_avg_sq.nbytes for u in (L, -1))
            du.adam_rate = (2_000_000, 1e-3)
            du.stream_rate()
            want = placing.stream_share(2e9, placing.PCIE_IN_STEP_BYTES_PER_S, cached=s.engine.cfg.weight_slots >= L,
                                        window=placing.HOST_WINDOW, state_bytes=held, host_extra=0.0,
                                        in_extra=head / sum(numel[i] for i in range(L)))
            assert du.share == pytest.approx(want)
            shares[state] = (du.share, held)
        finally:
            s.close()
    assert shares["fp32"][1] == 12 and shares["int8"][1] < 7
    assert shares["int8"][0] > shares["fp32"][0]


@pytest.mark.parametrize("family", ["llama", "llama_tied"])
def test_state_loads_start_while_the_packer_waits_for_a_host_update(hf_dir, family):
    """Note: [Early state]: with the host's updates held up (a delay per unit), the packer starts the backward's
    first state loads while it waits for the forward's host updates; the run equals one without the delay."""
    d = hf_dir(family, num_hidden_layers=4)  # layers 0, 1 "device"; 2, 3 on the host, 3 updated first
    L_ = head_unit(d)
    mix = {0: "device", 1: "device"} | ({-1: "device", L_: "device"} if family == "llama_tied" else {})
    batches = make_batches(VOCAB, 4)
    want = losses_under(d, batches, mix)
    s = Session.from_pretrained(d, lr=LR, placement=mix)
    try:
        s.engine.delays["host-adam"] = 0.05  # seconds per unit update: every forward load of a host unit waits
        got = train_session(s, batches)
        runs = s.engine.io.early_runs
    finally:
        s.close()
    assert runs >= len(batches) - 1  # one a step, from the second (the first step's forward loads wait for nothing)
    assert got == want
