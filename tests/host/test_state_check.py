"""Note: [Non-finite state] (state_check.py): a step whose update would write non-finite weights from a bad
optimizer state (a negative or NaN exp_avg_sq, a NaN moment or master) is skipped and reported like a
non-finite gradient, with nothing written; the pure check, and the public API on the CPU for fp32 and
compact moments, overlapped and gated."""
from __future__ import annotations

import math
import warnings

import pytest
import torch

from conftest import make_batches
from megatrain_nb import Session
from megatrain_nb.host import compact_state, state_check

VOCAB = 96


# ---- the check itself ------------------------------------------------------------------------------
@pytest.mark.parametrize("where,value", [("v", -1.0), ("v", math.nan), ("v", -math.nan), ("v", math.inf),
                                         ("m", math.nan), ("m", -math.inf), ("p", math.nan), ("p", math.inf)])
def test_state_ok_refuses_each_bad_value(where, value):
    t = {k: torch.rand(10_000) for k in "pmv"}
    assert bool(state_check.state_ok(t["p"], t["m"], t["v"]))
    t[where][1234] = value
    assert not bool(state_check.state_ok(t["p"], t["m"], t["v"]))


def test_a_sum_that_overflows_is_not_a_bad_state():
    """Values near fp32's largest: the one-pass sum overflows, the exact test then says they are finite."""
    big = torch.full((1000,), 3e38)
    assert not math.isfinite(float(big.sum()))
    assert bool(state_check.state_ok(big, big, big))
    assert bool(state_check.state_ok(torch.zeros(0), torch.zeros(0), torch.zeros(0)))


@pytest.mark.parametrize("kind", compact_state.KINDS)
def test_compact_ok_reads_scales_and_kept_positions(kind):
    lay = compact_state.Layout(kind=kind, n=4096 + 100, spans=((4096, 4196),))
    g = torch.Generator().manual_seed(0)
    m, v = torch.randn(lay.n, generator=g), torch.rand(lay.n, generator=g)
    ms, vs = torch.zeros(lay.words), torch.zeros(lay.words)
    compact_state.quantize_into(ms, lay, 0, m)
    compact_state.quantize_into(vs, lay, 1, v)
    assert bool(state_check.compact_ok(lay, ms, vs))
    for slab, part, value in [(vs, 1, -1.0), (vs, 1, math.nan), (vs, 2, -1.0), (ms, 1, math.nan), (ms, 2, math.inf)]:
        bad = slab.clone()
        compact_state.parts(bad, lay)[part][0] = value
        pair = (bad, vs) if slab is ms else (ms, bad)
        assert not bool(state_check.compact_ok(lay, *pair)), (part, value)
    codes = compact_state.parts(vs.clone(), lay)[0]
    codes.fill_(255)  # any code decodes to a map entry: no bad value can hide there
    assert bool(state_check.compact_ok(lay, ms, vs))


# ---- through the public API ---------------------------------------------------------------------------
def _session(kind: str, **settings) -> Session:
    """2 layers whose projections (64 x 128) are quantized under a compact ``optimizer_state``."""
    from transformers import LlamaConfig

    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    return Session.from_config(cfg, seed=0, lr=1e-3, optimizer_state=kind, **{"trace": False, **settings})


def _corrupt(s: Session, unit: int, value: float) -> None:
    """Write ``value`` into unit ``unit``'s exp_avg_sq through the store: an fp32 entry, or a compact block's scale."""
    u = s.store.units[unit]
    if u.compact is None:
        u.exp_avg_sq[7] = value
    else:
        compact_state.parts(u.exp_avg_sq, u.compact)[1][0] = value


def _state(s: Session) -> dict:
    return {u: (x.master.clone(), x.exp_avg.clone(), x.exp_avg_sq.clone(), s.engine.optim.steps_done(u))
            for u, x in s.store.units.items()}


def _same(a, b) -> bool:
    """Bit for bit (a compact slab's code words may read as NaN floats)."""
    return all(torch.equal(x.view(torch.int32), y.view(torch.int32)) for x, y in zip(a[:3], b[:3])) and a[3] == b[3]


def _warned_step(s, batch, unit: int):
    """A step that warns of ``unit``'s optimizer state: (its result, every unit's state before, after)."""
    before = _state(s)
    with pytest.warns(UserWarning, match=rf"optimizer state of units \[{unit}\]"):
        r = s.step(batch)
    s.engine.drain()
    return r, before, _state(s)


def _raises_and_changes_nothing(s, batch, units: str) -> None:
    """Under nonfinite="raise", the step raises naming ``units``' optimizer state (a regex), and no unit changed."""
    before = _state(s)
    with pytest.raises(FloatingPointError, match=rf"optimizer state of units {units}.*no update was applied"):
        s.step(batch)
    s.engine.drain()
    after = _state(s)
    assert all(_same(before[u], after[u]) for u in before)


@pytest.mark.parametrize("kind", ["fp32", "int8", "int4"])
@pytest.mark.parametrize("value", [-1.0, math.nan])
@pytest.mark.parametrize("gated", [False, True])
def test_a_bad_moment_skips_the_step_with_nothing_written(kind, value, gated):
    """Overlapped (the default), the head lands first, so a bad head skips every unit; gated (grad_clip), a bad
    layer 0 does. Fixed, training goes on."""
    s = _session(kind, **({"grad_clip": 1.0} if gated else {}))
    try:
        batches = make_batches(VOCAB, 3)
        s.step(batches[0])
        s.engine.drain()
        bad = 0 if gated else s.store.order[-1]  # the head (forward order: embedding, layers, head)
        if kind != "fp32" and bad == 0:
            assert s.store.units[0].compact is not None  # the layer's moments are compact indeed
        keep = s.store.units[bad].exp_avg_sq.clone()
        _corrupt(s, bad, value)
        r, before, after = _warned_step(s, batches[1], bad)
        assert r.skipped and s.skipped_steps == 1 and math.isfinite(r.loss)
        assert all(_same(before[u], after[u]) for u in before), [u for u in before if not _same(before[u], after[u])]
        s.store.units[bad].exp_avg_sq.copy_(keep)
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            r = s.step(batches[2])
        s.engine.drain()
        assert not r.skipped and all(torch.isfinite(x.master).all() for x in s.store.units.values())
        assert all(s.engine.optim.steps_done(u) == before[u][3] + 1 for u in before)
    finally:
        s.close()


@pytest.mark.parametrize("slow", [False, True], ids=["prompt", "slow-worker"])
def test_overlapped_units_after_a_bad_one_are_skipped_those_before_keep_theirs(slow):
    """Note: [Non-finite gradients]'s rule: layer 0 lands after the head and layer 1, before the embedding.
    ``slow``: the worker's first update sleeps until every unit has landed, so it takes the rest in forward order
    (the embedding first): the same units are skipped."""
    s = _session("fp32")
    try:
        batches = make_batches(VOCAB, 2)
        s.step(batches[0])
        s.engine.drain()
        s.store.units[0].exp_avg[3] = math.nan
        if slow:
            s.engine.delays = {"host-adam": 0.5}
        r, before, after = _warned_step(s, batches[1], 0)
        assert r.skipped and _same(before[0], after[0]) and _same(before[-1], after[-1])
        assert not _same(before[1], after[1])  # landed before layer 0: updated
    finally:
        s.close()


def test_nonfinite_raise_raises_with_nothing_applied():
    s = _session("fp32", nonfinite="raise")
    try:
        batches = make_batches(VOCAB, 2)
        s.step(batches[0])
        s.engine.drain()
        unused = sorted(set(range(VOCAB)) - set(batches[1]["input_ids"].flatten().tolist()))[0]
        s.store.units[-1].master.view(VOCAB, -1)[unused, 0] = math.inf  # a row the forward never reads: the loss is finite
        _raises_and_changes_nothing(s, batches[1], r"\[-1\]")
    finally:
        s.close()


@pytest.mark.parametrize("kind", ["fp32", "int8"])
@pytest.mark.parametrize("gated,slow", [(False, False), (False, True), (True, False)])
def test_a_bad_resident_moment_skips_the_step_with_nothing_written(kind, gated, slow):
    """A resident unit's state lives on the device (on the CPU: DeviceAdamW's own tensors); its check folds
    into its norm there, before the copy to the host. ``slow``: every unit has landed before the worker reaches
    layer 0 (it goes in forward order then, the embedding first); the embedding is skipped all the same."""
    s = _session(kind, placement={0: "resident", 1: "resident"}, **({"grad_clip": 1.0} if gated else {}))
    try:
        batches = make_batches(VOCAB, 3)
        s.step(batches[0])
        s.engine.drain()
        if slow:
            s.engine.delays = {"host-adam": 0.5}
        r0 = s.engine.dev_opt.of[0]
        a, b = r0.seg(0)
        keep = r0.exp_avg_sq[a:b].clone()
        r0.exp_avg_sq[a + 5] = -1.0
        before = {u: (r.master.clone(), r.exp_avg.clone(), r.exp_avg_sq.clone(), float(r.steps[u]))
                  for u, r in s.engine.dev_opt.of.items()}
        host = {u: s.store.units[u].master.clone() for u in (-1,)}
        with pytest.warns(UserWarning, match=r"optimizer state of units \[0\]"):
            r = s.step(batches[1])
        s.engine.drain()
        assert r.skipped
        for u, (p, m, v, n) in before.items():
            if u == 1 and not gated:
                continue  # overlapped, layer 1 lands before layer 0: its update stands (Note: [Non-finite gradients])
            x = s.engine.dev_opt.of[u]
            assert torch.equal(x.master, p) and float(x.steps[u]) == n, u
            if kind == "fp32":  # compact: drain's write-back re-quantizes the device's moments (Note: [Resident compact])
                assert torch.equal(x.exp_avg, m) and torch.equal(x.exp_avg_sq.view(torch.int32), v.view(torch.int32)), u
        assert torch.equal(s.store.units[-1].master, host[-1])  # lands after layer 0: skipped too
        r0.exp_avg_sq[a:b] = keep
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            assert not s.step(batches[2]).skipped
    finally:
        s.close()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("kind", ["fp32", "int8", "int4"])
@pytest.mark.parametrize("settings", [dict(placement={0: "resident", 1: "resident"}), dict(placement="host"),
                                      dict(placement={0: "resident"}, grad_clip=1.0)])
def test_cuda_a_bad_moment_skips_the_step(kind, settings):
    """On CUDA: the host guard (pinned slabs, cast_on_device) and the resident check on the compute stream,
    whose verdict must reach the norm's copy to the host before it is read."""
    s = _session(kind, device="cuda", **settings)
    try:
        batches = make_batches(VOCAB, 3)
        s.step(batches[0])
        s.engine.drain()
        res = s.engine.dev_opt.of.get(0)
        if res is not None:
            a, _ = res.seg(0)
            target, at = res.exp_avg_sq, a + 5
        else:
            u = s.store.units[0]
            target, at = (u.exp_avg_sq, 5) if u.compact is None else (compact_state.parts(u.exp_avg_sq, u.compact)[1], 0)
        keep = target.clone()  # whole: a compact write-back re-quantizes the NaN's block on the device too
        target[at] = float("nan")
        with pytest.warns(UserWarning, match=r"optimizer state of units \[0\]"):
            assert s.step(batches[1]).skipped
        s.engine.drain()
        target.copy_(keep)
        assert not s.step(batches[2]).skipped
        s.engine.drain()
        assert all(torch.isfinite(x.master).all() for x in s.store.units.values())
    finally:
        s.close()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_state_ok_decides_on_the_device():
    big = torch.full((1000,), 3e38, device="cuda")  # an fp32 sum would overflow; the fp64 one does not
    assert bool(state_check.state_ok(big, big, big))
    for where, value in [(0, math.nan), (1, -math.inf), (2, -1.0), (2, math.nan)]:
        t = [torch.rand(10_000, device="cuda") for _ in range(3)]
        t[where][77] = value
        ok = state_check.state_ok(*t)
        assert ok.device.type == "cuda" and not bool(ok), (where, value)


# ---- "device" units: their state checked on the stream it arrives on (Note: [Streamed state check]) ----------
@pytest.mark.parametrize("kind", ["fp32", "int8", "int4"])
@pytest.mark.parametrize("value", [-1.0, math.nan])
def test_a_bad_streamed_unit_is_skipped_with_nothing_written(kind, value):
    """Layer 1 placed "device", ungated: its state comes in during the step; a bad one is not updated, the
    units after it in the optimizer stream's order (layer 0, "device" too) neither, the step is skipped and
    names it. Fixed, training goes on and the skipped unit's step count catches up with no gap."""
    s = _session(kind, placement={0: "device", 1: "device"})
    try:
        batches = make_batches(VOCAB, 3)
        s.step(batches[0])
        s.engine.drain()
        assert set(s.engine.dev_opt.streamed) >= {0, 1} and not s.engine.device_updates.gate
        if kind != "fp32":
            assert s.store.units[1].compact is not None  # the layer's moments are compact indeed
        keep = s.store.units[1].exp_avg_sq.clone()
        _corrupt(s, 1, value)
        r, before, after = _warned_step(s, batches[1], 1)
        assert r.skipped and s.skipped_steps == 1 and math.isfinite(r.loss)
        for u in (1, 0):  # the bad one, and the streamed unit whose update follows it
            assert _same(before[u], after[u]), u
        s.store.units[1].exp_avg_sq.copy_(keep)
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            r = s.step(batches[2])
        s.engine.drain()
        assert not r.skipped and all(torch.isfinite(x.master).all() for x in s.store.units.values())
        for u in (0, 1):
            assert s.engine.optim.steps_done(u) == before[u][3] + 1, u
            assert not _same(before[u], _state(s)[u]), u
    finally:
        s.close()


def test_a_bad_streamed_head_is_skipped_with_nothing_written():
    """The head group placed "device" (Note: [Streamed head]): its state is checked where it arrives too, and,
    first on the optimizer stream, its verdict skips the "device" layers' updates after it."""
    s = _session("fp32", placement={0: "device", 1: "device", 2: "device"})
    try:
        batches = make_batches(VOCAB, 2)
        s.step(batches[0])
        s.engine.drain()
        assert s.engine.device_updates.head_streamed
        s.store.units[2].exp_avg_sq[3] = -1.0
        r, before, after = _warned_step(s, batches[1], 2)
        assert r.skipped
        assert all(_same(before[u], after[u]) for u in (0, 1, 2))
    finally:
        s.close()


def test_a_good_streamed_state_trains_as_before():
    """The check changes nothing where the state is good: "device" layers equal "host" ones bit for bit."""
    batches = make_batches(VOCAB, 3)
    out = []
    for placement in ({0: "device", 1: "device"}, "host"):
        s = _session("fp32", placement=placement)
        try:
            for b in batches:
                assert not s.step(b).skipped
            s.engine.drain()
            out.append(_state(s))
        finally:
            s.close()
    assert all(torch.equal(out[0][u][0], out[1][u][0]) for u in out[1])


def test_a_bad_streamed_unit_raises_under_nonfinite_raise():
    """nonfinite="raise" gates the step: the "device" unit updates on the host, where its landing is checked."""
    s = _session("fp32", placement={0: "device", 1: "device"}, nonfinite="raise")
    try:
        batches = make_batches(VOCAB, 2)
        s.step(batches[0])
        s.engine.drain()
        _corrupt(s, 1, -1.0)
        _raises_and_changes_nothing(s, batches[1], r"\[1\]")
    finally:
        s.close()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("kind", ["fp32", "int8", "int4"])
@pytest.mark.parametrize("lane", ["h2d", "compute"])
def test_cuda_a_bad_streamed_unit_is_checked_after_its_state_arrives(kind, lane):
    """On CUDA, a delay on the copy-in stream (or on the compute stream): a check that did not wait for the
    state's copy would read the state slot's last contents (a good state) and let the bad one update; a
    report that did not wait for the check would read a finite norm."""
    s = _session(kind, device="cuda", placement={0: "device", 1: "device", 2: "device"})
    try:
        batches = make_batches(VOCAB, 3)
        s.step(batches[0])
        s.engine.drain()
        assert set(s.engine.dev_opt.streamed) >= {0, 1, 2}
        keep = s.store.units[1].exp_avg_sq.clone()
        _corrupt(s, 1, math.nan)
        before = _state(s)
        s.engine.delays = {lane: 200_000_000}  # GPU cycles (~0.1 s) before each copy in / each layer's backward
        with pytest.warns(UserWarning, match=r"optimizer state of units \[1\]"):
            assert s.step(batches[1]).skipped
        s.engine.drain()
        after = _state(s)
        assert _same(before[1], after[1]) and _same(before[0], after[0])
        s.store.units[1].exp_avg_sq.copy_(keep)
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            assert not s.step(batches[2]).skipped
        s.engine.drain()
        assert all(torch.isfinite(x.master).all() for x in s.store.units.values())
    finally:
        s.close()


# ---- Note: [Checked state] ---------------------------------------------------------------------------
def test_checked_reads_a_unit_again_only_once_something_else_wrote_it():
    from types import SimpleNamespace

    from torch.optim.adamw import adamw

    unit = SimpleNamespace(master=torch.rand(5000), exp_avg=torch.rand(5000), exp_avg_sq=torch.rand(5000), compact=None)
    c = state_check.Checked()
    assert c.ok(3, unit) and c.ok(3, unit) and c.reads == 1  # nothing wrote it between
    adamw([unit.master], [torch.randn(5000)], [unit.exp_avg], [unit.exp_avg_sq], [], [torch.zeros(())], fused=True,
          amsgrad=False, beta1=0.9, beta2=0.999, lr=1e-3, weight_decay=0.01, eps=1e-8, maximize=False)
    assert c.ok(3, unit) and c.reads == 1  # its own update (torch's fused AdamW) leaves the mark as it was
    unit.exp_avg_sq[7] = -1.0  # by hand: the version moves
    assert not c.ok(3, unit) and not c.ok(3, unit) and c.reads == 3  # a bad unit is read every time
    unit.exp_avg_sq[7] = 1.0
    assert c.ok(3, unit) and c.reads == 4
    unit.master[100:200].view(10, 10)[2, 3] = math.nan  # through a view of a view
    assert not c.ok(3, unit) and c.reads == 5
    unit.master = torch.rand(5000)  # another slab (a reallocation): its address differs
    assert c.ok(3, unit) and c.reads == 6
    assert c.ok(4, unit) and c.reads == 7  # each unit its own mark


def test_ahead_reads_the_unmarked_units_once_and_names_those_that_fail():
    """Note: [Checked ahead]: the units without a mark are read, the good ones marked (then not read again),
    a bad one named and left unmarked, read again by ``ok`` at its landing."""
    from types import SimpleNamespace

    units = {u: SimpleNamespace(master=torch.rand(3000), exp_avg=torch.rand(3000), exp_avg_sq=torch.rand(3000),
                                compact=None) for u in range(4)}
    units[2].exp_avg_sq[5] = -1.0
    c = state_check.Checked()
    assert c.ok(0, units[0]) and c.reads == 1
    assert c.unmarked(units) == [1, 2, 3]
    assert c.ahead(units) == [2] and c.reads == 4
    assert c.unmarked(units) == [2]
    assert c.ok(1, units[1]) and c.ok(3, units[3]) and c.reads == 4  # marked ahead: a landing reads nothing
    assert not c.ok(2, units[2]) and c.reads == 5
    units[3].master[0] = 0.5  # by hand
    assert c.ahead(units) == [2] and c.reads == 7


@pytest.mark.parametrize("kind", ["fp32", "int8"])
def test_a_step_after_a_load_or_a_write_reads_its_units_on_the_driver_before_the_step(kind, monkeypatch):
    """Note: [Checked ahead]: the first step reads every host unit before its clock starts, on the driver's thread,
    and its landings (the unpacker's) read none; a slab written by hand is read ahead of the next step too,
    and, bad, again at its landing, where its step is skipped."""
    import threading

    LANDING = "megatrain-host-unpack"  # the unpacker's thread, where units land (transfers.py)
    readers = []
    unit_ok = state_check.unit_ok
    monkeypatch.setattr(state_check, "unit_ok", lambda unit: readers.append(threading.current_thread().name) or unit_ok(unit))
    s = _session(kind, placement="host", trace=True)
    try:
        batches = make_batches(VOCAB, 3)
        s.step(batches[0])
        s.engine.drain()
        ops = {sp[1] for sp in s.engine.trace.spans}
        assert len(readers) == len(s.store.order) and LANDING not in readers, readers
        assert "state-check" in ops, "the reads are traced on the driver's lane"
        del readers[:]
        assert not s.step(batches[1]).skipped
        s.engine.drain()
        assert readers == [] or kind != "fp32"  # compact: torch's ops (no C kernel) advance the mark
        del readers[:]
        _corrupt(s, 0, -1.0)
        r, before, after = _warned_step(s, batches[2], 0)
        assert r.skipped and _same(before[0], after[0])
        assert readers.count(LANDING) >= 1 and len(readers) > readers.count(LANDING), readers  # ahead, then landing
    finally:
        s.close()


@pytest.mark.parametrize("kind", ["fp32", "int8"])
def test_a_good_state_is_read_at_its_first_landing_and_again_only_once_written(kind):
    """Through the public API: the first step reads every host unit; the next ones read none (fp32: torch's
    fused AdamW; compact: the C kernel, where it builds, else torch's ops, which advance the mark); a slab
    written by hand is read at the next landing, and its step skipped."""
    s = _session(kind, placement="host")
    try:
        batches = make_batches(VOCAB, 4)
        s.step(batches[0])
        s.engine.drain()
        first = s.engine.checked.reads
        assert first == len(s.store.order)
        for b in batches[1:3]:
            assert not s.step(b).skipped
        s.engine.drain()
        if kind == "fp32":
            assert s.engine.checked.reads == first
        else:
            assert s.engine.checked.reads in (first, 3 * first)
        reads = s.engine.checked.reads
        _corrupt(s, 0, -1.0)
        r, before, after = _warned_step(s, batches[3], 0)
        assert r.skipped and _same(before[0], after[0])
        assert s.engine.checked.reads >= reads + 1
    finally:
        s.close()


def test_a_resident_units_verdict_is_computed_again_only_once_its_group_is_written():
    """Verdicts (Note: [Checked state]): resident on the CPU, each unit's verdict is computed once its group's
    moments are in and kept while only its updates write the group; a value written into the device buffers by hand
    is seen at the next step, which is skipped."""
    s = _session("fp32", placement={0: "resident", 1: "resident"})
    try:
        batches = make_batches(VOCAB, 5)
        for b in batches[:2]:
            assert not s.step(b).skipped
        s.engine.drain()
        v = s.engine.device_updates.verdicts
        reads = v.reads
        assert reads >= 2 and set(v.kept) >= {0, 1}
        for b in batches[2:4]:
            assert not s.step(b).skipped
        s.engine.drain()
        assert v.reads == reads  # nothing but the groups' own updates wrote them
        r0 = s.engine.device_updates.opt.of[0]
        a, _ = r0.seg(0)
        r0.exp_avg_sq[a + 5] = -1.0
        with pytest.warns(UserWarning, match=r"optimizer state of units \[0\]"):
            assert s.step(batches[4]).skipped
        assert v.reads == reads + 1
    finally:
        s.close()


def test_marks_tell_a_new_tensor_from_a_freed_one():
    from types import SimpleNamespace

    unit = SimpleNamespace(master=torch.rand(4096), exp_avg=torch.rand(4096), exp_avg_sq=torch.rand(4096))
    m = state_check.mark(unit)
    assert state_check.holds(m, unit)
    unit.exp_avg = torch.rand(4096)  # the old one freed; the new one may sit at its address, with version 0 too
    assert not state_check.holds(m, unit)
    assert not state_check.holds(None, unit)
