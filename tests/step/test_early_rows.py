"""Note: [Early rows]: the next forward's embedding rows, updated before the rest of the embedding.

The rows computed on copies equal what the whole slab's AdamW writes, bit for bit; a session whose
forward takes them early trains bit-identically to one that waits for the whole update (which the
equivalence tests hold equal to HF + torch.optim.AdamW); the worker updates every other landed unit
before the embedding's whole slab.
"""
from __future__ import annotations

import math
import threading
from types import SimpleNamespace

import pytest
import torch

from conftest import VOCAB, make_batches, train_session
from megatrain_nb import Session
from megatrain_nb.config import OptimConfig
from megatrain_nb.step.early_rows import EarlyRows
from megatrain_nb.host.optim import HostAdamW


def _store(rows: int, width: int, grad_dtype, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    n = rows * width
    unit = SimpleNamespace(master=torch.randn(n, generator=g), grad=torch.randn(n, generator=g).to(grad_dtype),
                           exp_avg=torch.randn(n, generator=g) * 0.1, exp_avg_sq=torch.rand(n, generator=g) * 0.01,
                           compact=None)
    return SimpleNamespace(units={-1: unit}, step_count=lambda u: torch.tensor(3.0), grad_of=lambda u: unit.grad,
                           rows=None)  # a slab (the rows' own: tests/host/test_embed_grad.py)


@pytest.mark.parametrize("width", [64, 192])
@pytest.mark.parametrize("grad_dtype,scale", [(torch.float32, 1.0), (torch.float32, 0.37), (torch.bfloat16, 1.0),
                                              (torch.bfloat16, 0.5)])
def test_updated_rows_equal_the_slab_update_bitwise(width, grad_dtype, scale, monkeypatch):
    store = _store(997, width, grad_dtype)
    opt = HostAdamW(store, OptimConfig(lr=1e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1))
    monkeypatch.setattr(HostAdamW, "chunk_numel", 64 * 41)  # chunks that cut rows, as a 151936-row table's do
    monkeypatch.setattr(HostAdamW, "rows_numel", width * 7)  # the rows' copies 7 rows at a time: 37 pieces and a part
    rows = torch.unique(torch.randint(0, 997, (300,), generator=torch.Generator().manual_seed(1)))
    before = {k: getattr(store.units[-1], k).clone() for k in ("master", "exp_avg", "exp_avg_sq", "grad")}
    early = opt.updated_rows(-1, rows, width, lr=2e-3, grad_scale=scale)
    for k, t in before.items():
        assert torch.equal(getattr(store.units[-1], k), t), f"{k} changed: the rows are computed on copies"
    opt.update(-1, lr=2e-3, grad_scale=scale)
    assert torch.equal(early, store.units[-1].master.view(-1, width)[rows])
    assert opt.steps_done(-1) == 4


def test_updated_rows_write_into_one_kept_buffer():
    """Each step's rows go where the last step's were (no fresh pages to fault in, none to unmap); a larger
    request takes a larger buffer, and every result is the rows' update, whatever was in the buffer."""
    store = _store(997, 64, torch.float32)
    opt = HostAdamW(store, OptimConfig(lr=1e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1))
    ask = lambda ids: opt.updated_rows(-1, ids, 64, lr=2e-3)  # noqa: E731
    want = {n: HostAdamW(_store(997, 64, torch.float32), opt.cfg).updated_rows(-1, torch.arange(n) * 3, 64, lr=2e-3)
            for n in (200, 120, 300)}
    a = ask(torch.arange(200) * 3)
    assert torch.equal(a, want[200])
    b = ask(torch.arange(120) * 3)
    assert b.data_ptr() == a.data_ptr() and torch.equal(b, want[120])  # fewer rows: the same buffer
    c = ask(torch.arange(300) * 3)
    assert torch.equal(c, want[300])
    assert ask(torch.arange(200) * 3).data_ptr() == c.data_ptr()


def test_serve_frees_the_last_rows_with_the_lock_released(worker):
    """Freeing the last step's rows (0.4-0.6 GB a step at 7B-14B, where they were a tensor of their own) unmaps
    their pages for tens of ms: under the lock, the packer woken by this serve could not take the new rows."""
    e = EarlyRows(64, worker)
    free = []

    class Rows:  # the last step's rows: their release looks whether another thread could take the lock
        def __del__(self):
            t = threading.Thread(target=lambda: free.append(e.cond.acquire(blocking=False) and (e.cond.release() or True)))
            t.start()
            t.join()

    e.served = (0, torch.tensor([1]), Rows())
    assert e.request(1, torch.tensor([[2, 3]]))
    assert e.serve(1, lambda ids: torch.zeros(len(ids), 64))
    assert free == [True]


@pytest.fixture
def worker():
    """An Adam worker whose versions the tests set by hand (no step ever opens)."""
    from megatrain_nb.step.workers import AdamWorker

    w = AdamWorker([-1], lambda *a: None, threading.Event())
    yield w
    w.close()


def test_take_waits_for_the_served_rows_or_the_whole_update(worker):
    cond, version = worker.cond, worker.version
    e = EarlyRows(64, worker)
    master = torch.arange(10 * 64, dtype=torch.float32)
    ids = torch.tensor([[7, 2, 7]])
    assert e.request(1, ids) and not e.ready(1)
    got = []
    t = threading.Thread(target=lambda: got.append(e.take(ids, 1, master)))
    t.start()
    t.join(0.2)
    assert t.is_alive()  # neither served nor updated: the packer waits
    with cond:
        version[-1] = 1  # the whole update landed without serving (a skipped step, say)
        cond.notify_all()
    t.join(5)
    assert torch.equal(got[0], master.view(-1, 64)[[7, 2, 7]])
    assert not e.request(1, ids)  # already updated: nothing to ask
    with cond:
        version[-1] = 0
    assert not EarlyRows(48, worker).request(1, ids)  # not whole lanes: never
    from megatrain_nb.step import early_rows

    many = torch.arange(early_rows.MAX_BYTES // (64 * 4) + 1)
    assert not EarlyRows(64, worker).request(1, many)  # rows past MAX_BYTES
    assert EarlyRows(64, worker).request(1, many[:-1])  # up to it


def test_an_idle_worker_waits_for_the_request_and_goes_on_when_it_is_refused(worker, monkeypatch):
    """The embedding is the last unit left: ``serve`` waits for the next step's request, served or refused."""
    from megatrain_nb.step import early_rows

    monkeypatch.setattr(early_rows, "WAIT_S", 30.0)
    e = EarlyRows(64, worker)
    got = []
    t = threading.Thread(target=lambda: got.append(e.serve(1, lambda ids: ids[:, None].float().expand(-1, 64), wait=True)))
    t.start()
    t.join(0.2)
    assert t.is_alive()  # nothing asked yet: it waits
    assert e.request(1, torch.tensor([[4, 1, 4]]))
    t.join(5)
    assert got == [True] and e.ready(1)
    assert torch.equal(e.take(torch.tensor([[1, 4]]), 1, master=None)[:, 0], torch.tensor([1.0, 4.0]))
    t = threading.Thread(target=lambda: got.append(e.serve(2, lambda ids: 1 / 0, wait=True)))
    t.start()
    t.join(0.2)
    assert t.is_alive()
    assert not e.request(2, torch.arange(early_rows.MAX_BYTES // (64 * 4) + 1))  # too many rows: refused
    t.join(5)
    assert not t.is_alive() and got == [True, False]  # it went on at once, nothing computed


def test_the_worker_waits_for_the_request_only_with_no_other_unit_left():
    from megatrain_nb.step.workers import AdamWorker, Box

    calls = []
    abort = threading.Event()
    w = AdamWorker([-1, 0, 1], lambda u, lr, scale: calls.append(("adam", u)), abort)
    w.early = lambda u, step, lr, scale, last: u == -1 and calls.append(("rows", u, last))  # none served
    try:
        for gate in (False, True):
            loss = Box(abort)
            w.begin(step=int(gate), lr=1e-3, gate=gate, clip=lambda norms: (0.0, 1.0), loss=loss)
            loss.put(1.0)
            for u in (1, 0):
                w.land(u, 1.0)
            if not gate:
                w.wait_version(0, 1)  # the host kept up: 1 and 0 are updated when the embedding lands
            w.land(-1, 1.0)
            w.wait_all(int(gate) + 1)
    finally:
        w.close()
    assert calls == [("adam", 1), ("adam", 0), ("rows", -1, True), ("adam", -1),  # the last unit: it may wait
                     ("rows", -1, False), ("adam", -1), ("adam", 0), ("adam", 1)]  # gated: the others are left


@pytest.mark.parametrize("family", ["llama", "llama_tied"])
def test_rows_go_early_where_the_host_keeps_up(hf_dir, monkeypatch, family):
    """The worker keeps up (the unpacker hands each unit over 50 ms apart), so it is idle when the embedding lands
    and waits for the next step's request: the rows are served every step but the first (a tied head still waits
    for the whole update, at its load). Without the wait (``WAIT_S`` 0) none is served here."""
    from megatrain_nb.step import early_rows

    monkeypatch.setattr(early_rows, "WAIT_S", 10.0)  # a slow machine's request comes in time
    s = Session.from_pretrained(hf_dir(family, hidden_size=64), lr=1e-3)
    try:
        s.engine.delays = {"host-unpack": 0.05}  # a loaded CI machine's worker could fall behind the landings
        batches = make_batches(VOCAB, 4)
        train_session(s, batches)
        served = s.engine.early.count
    finally:
        s.close()
    assert served == len(batches) - 1


@pytest.mark.parametrize("family,grad_clip", [("llama_tied", None), ("llama", None), ("llama", 0.05)])
def test_a_forward_on_early_rows_trains_equal_to_one_that_waits(hf_dir, family, grad_clip):
    d = hf_dir(family, hidden_size=64)
    batches = make_batches(VOCAB, 4)
    runs = {}
    for early in (True, False):
        s = Session.from_pretrained(d, lr=1e-3, weight_decay=0.1, grad_clip=grad_clip)
        try:
            s.engine.early.on = early
            s.engine.delays = {"host-adam": 0.03}  # the next step asks for its rows before the worker gets there
            losses = train_session(s, batches)  # back to back: reading a trace between steps would wait for updates
            spans = s.trace.to_dataframe()
            s.engine.drain()
            runs[early] = (losses, s.engine.early.count, {u: s.store.units[u].master.clone() for u in s.store.units})
        finally:
            s.close()
        if not grad_clip:
            assert ("adam-rows" in set(spans[spans.lane == "host-adam"].op)) == early  # traced on the host-adam lane
    (l1, served, m1), (l0, none, m0) = runs[True], runs[False]
    assert none == 0 and (served >= len(batches) - 1 or grad_clip)  # gated: the worker most often gets there first
    assert l1 == l0
    assert all(torch.equal(m1[u], m0[u]) for u in m1)


def test_the_worker_updates_the_others_before_the_embedding_whose_rows_went_first():
    from megatrain_nb.step.workers import AdamWorker, Box

    calls = []
    abort = threading.Event()
    w = AdamWorker([-1, 0, 1, 2], lambda u, lr, scale: calls.append(("adam", u)), abort)
    w.early = lambda u, step, lr, scale, last: u == -1 and not calls.append(("rows", u, step))
    try:
        loss = Box(abort)
        w.begin(step=0, lr=1e-3, gate=True, clip=lambda norms: (0.0, 1.0), loss=loss)  # gate: all land first
        for u in (2, 1, 0, -1):
            w.land(u, 1.0)
        loss.put(1.0)
        w.wait_all(1)
    finally:
        w.close()
    assert calls == [("rows", -1, 0), ("adam", 0), ("adam", 1), ("adam", 2), ("adam", -1)]


@pytest.mark.parametrize("landings,want", [
    (((-1, 1.0), (1, 1.0), (0, math.nan)), [("rows", -1), ("adam", 1), ("adam", -1)]),
    (((1, 1.0), (0, math.nan), (-1, 1.0)), [("adam", 1)]),
], ids=["embedding-lands-first", "embedding-lands-last"])
def test_a_non_finite_unit_skips_the_units_that_landed_after_it_whatever_the_update_order(landings, want):
    """Note: [Non-finite gradients] by landing order: a unit that landed before the non-finite one keeps its update,
    one after it is skipped, though every unit has landed and the worker goes in forward order (embedding first).
    The embedding's rows go out early only where its own verdict is finite; then its whole update runs."""
    from megatrain_nb.step.workers import AdamWorker, Box

    calls = []
    abort = threading.Event()
    w = AdamWorker([-1, 0, 1], lambda u, lr, scale: calls.append(("adam", u)), abort)
    w.early = lambda u, step, lr, scale, last: u == -1 and not calls.append(("rows", u))
    try:
        loss = Box(abort)
        w.begin(step=0, lr=1e-3, gate=False, clip=lambda norms: (0.0, 1.0), loss=loss)
        for u, norm in landings:  # all land before the loss: the worker finds every unit there
            w.land(u, norm)
        loss.put(1.0)
        w.wait_all(1)
    finally:
        w.close()
    assert calls == want
    assert w.stats["skipped"] and w.stats["applied"] == len([c for c in want if c[0] == "adam"])


@pytest.mark.parametrize("family", ["llama", "llama_tied"])
def test_early_rows_train_equal_to_hf_with_torch_adamw(hf_dir, tmp_path, monkeypatch, family):
    """The equivalence test's comparison (losses and saved weights against HF + torch.optim.AdamW) with the
    host AdamW slowed so that every step's forward takes its embedding rows early."""
    import helpers

    made = []

    class Slowed(Session):
        @classmethod
        def from_pretrained(cls, *a, **k):
            s = Session.from_pretrained(*a, **k)
            s.engine.delays = {"host-adam": 0.02}
            made.append(s)
            return s

    monkeypatch.setattr(helpers, "Session", Slowed)  # the Session that compare builds
    helpers.compare(hf_dir(family, hidden_size=64), family, tmp_path, weight_decay=0.1)
    assert made and made[0].engine.early.count >= 3  # of 5 steps: the 2nd and later gathered early rows


def test_rows_served_for_other_ids_are_not_used(worker):
    """A step that failed after its rows were served runs again, perhaps on another batch: rows that were
    not asked for come from the whole update, never from a neighbour in the served set."""
    cond, version = worker.cond, worker.version
    e = EarlyRows(64, worker)
    master = torch.arange(10 * 64, dtype=torch.float32)
    assert e.request(1, torch.tensor([2, 7]))
    assert e.serve(1, lambda ids: -master.view(-1, 64)[ids])  # "updated" rows: negated
    assert torch.equal(e.take(torch.tensor([7, 2]), 1, master), -master.view(-1, 64)[[7, 2]])
    with cond:
        version[-1] = 1
    assert torch.equal(e.take(torch.tensor([3, 7]), 1, master), master.view(-1, 64)[[3, 7]])  # 3 was not served
    version[-1] = 0
    assert e.request(1, torch.tensor([3, 7])) and e.served is None  # asked again for the same step: served dropped


def test_a_resumed_run_takes_early_rows_and_equals_the_uninterrupted_one(hf_dir, tmp_path):
    """Resume replaces the worker's version counts (``AdamWorker.set_version``): early rows read them through
    the worker, never a stale copy (which would wait forever for rows no update serves)."""
    d = hf_dir("llama_tied", hidden_size=64)
    batches = make_batches(VOCAB, 4)
    whole = Session.from_pretrained(d, lr=1e-3)
    try:
        want = train_session(whole, batches)
    finally:
        whole.close()
    first = Session.from_pretrained(d, lr=1e-3)
    try:
        head = train_session(first, batches[:2])
        first.save_checkpoint(tmp_path / "ck")
    finally:
        first.close()
    s = Session.resume(tmp_path / "ck")
    try:
        s.engine.delays = {"host-adam": 0.03}
        tail = train_session(s, batches[2:])
        assert s.engine.early.count >= 1
    finally:
        s.close()
    assert head + tail == want


def test_a_union_asked_first_serves_each_micro_batch(worker):
    """A pass asks for its micro-batches' rows at once, then each micro-batch for its own: the union stays the
    request (one asked alone would replace it) and every micro-batch takes its rows from the one set served."""
    e = EarlyRows(64, worker)
    master = torch.arange(10 * 64, dtype=torch.float32)
    a, b = torch.tensor([[7, 2, 7]]), torch.tensor([[3, 2, 9]])
    assert e.request(1, torch.cat([a, b]))
    assert e.request(1, a) and e.request(1, b)
    assert e.wanted[1].tolist() == [2, 3, 7, 9]  # not replaced by either micro-batch's own
    assert e.serve(1, lambda ids: -master.view(-1, 64)[ids])
    for ids in (a, b):
        assert torch.equal(e.take(ids, 1, master), -master.view(-1, 64)[ids.flatten()])  # served: no whole update
    assert e.request(1, a) and e.served is not None  # covered by what was served: kept
    assert e.request(1, torch.tensor([4])) and e.served is None  # not covered: asked anew, as a step run again


CUDA = pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")])


@pytest.mark.parametrize("device", ["cpu", CUDA])
@pytest.mark.parametrize("family", ["llama", "llama_tied"])
def test_micro_batches_take_one_served_set_and_train_equal_to_waiting(hf_dir, family, device):
    """``micro_batch_size=1`` splits each batch of 2 into two forwards: both gather from the one set of rows served
    for the pass (the union of their ids), and training is bitwise that of a session that waits. On CUDA the
    embedding is placed on the host ("auto" keeps a model this small on the card, where no row is served)."""
    d = hf_dir(family, hidden_size=64)
    batches = make_batches(VOCAB, 4, batch=2)
    runs = {}
    for early in (True, False):
        s = Session.from_pretrained(d, lr=1e-3, weight_decay=0.1, micro_batch_size=1, device=device,
                                    placement="host")
        try:
            s.engine.early.on = early
            s.engine.delays = {"host-adam": 0.03}  # the next step asks for its rows before the worker gets there
            losses = train_session(s, batches)
            s.engine.drain()
            served = s.engine.early.served
            runs[early] = (losses, s.engine.early.count, {u: s.store.units[u].master.clone() for u in s.store.units})
        finally:
            s.close()
        if early:
            assert served is not None and served[1].tolist() == batches[-1]["input_ids"].unique().tolist()
    (l1, n1, m1), (l0, n0, m0) = runs[True], runs[False]
    assert n0 == 0 and n1 >= len(batches) - 1
    assert l1 == l0
    assert all(torch.equal(m1[u], m0[u]) for u in m1)
