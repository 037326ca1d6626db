"""The embedding's gradient as touched rows (host/embed_grad.py, Note [Embedding rows]): the same bits as the dense
slab in every read the update and the early rows make, and a session keeps the slab only where it must.

Training with the rows against slabs, bit for bit, under every placement and moment form, is
tests/host/test_grad_ring.py's (the ring's runs hold rows, the slabs' runs a slab).
"""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from conftest import VOCAB, make_batches
from helpers import LR
from megatrain_nb import Session
from megatrain_nb.config import OptimConfig
from megatrain_nb.host import embed_grad
from megatrain_nb.host.embed_grad import RowGrad, rows_bytes
from megatrain_nb.host.optim import HostAdamW, grad_norm

ROWS, WIDTH = 1000, 96  # a width that is not a multiple of 64: chunks fall inside rows


def _step_rows(seed: int, n: int = 3000, dtype=torch.bfloat16):
    """(ids, rows): ``n`` token ids with many repeats, their gradient rows in ``dtype``."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, ROWS // 4, (n,), generator=g) * 3  # every third row of the first three quarters
    return ids, torch.randn(n, WIDTH, generator=g).to(dtype)


def _dense(ids, rows, piece: int) -> torch.Tensor:
    """The slab as the engine filled it: zeros, then index_add_ of the rows in fp32, ``piece`` rows at a time."""
    slab = torch.zeros(ROWS, WIDTH)
    for a in range(0, len(ids), piece):
        slab.index_add_(0, ids[a:a + piece], rows[a:a + piece].float())
    return slab


@pytest.mark.parametrize("add", ["index_add", "scatter_add"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("cast_numel", [None, WIDTH * 37])
def test_rows_hold_the_slabs_bits_and_its_norm(dtype, cast_numel, add, monkeypatch):
    """The slab's bits whether the rows come 512 at a time or ``CAST_NUMEL`` elements' worth (37 rows) through
    the kept fp32 buffer, added by either op."""
    monkeypatch.setattr(embed_grad, "ADD", add)
    if cast_numel:
        monkeypatch.setattr(embed_grad, "CAST_NUMEL", cast_numel)
    r = RowGrad(ROWS, WIDTH)
    for seed in (0, 1):  # a second step overwrites the first: no row of it stays
        ids, rows = _step_rows(seed, dtype=dtype)
        flat = r.scatter(ids, rows, piece=None if cast_numel else 512)
        slab = _dense(ids, rows, 512)
        touched = torch.unique(ids)
        assert torch.equal(r.ids, touched)
        assert torch.equal(r.vals, slab[touched])
        assert torch.equal(grad_norm(flat), grad_norm(slab.index_select(0, touched).flatten()))
    assert r.nbytes == (touched.numel() + 1) * 4 * WIDTH + touched.numel() * 8 == rows_bytes(touched.numel(), WIDTH)


def test_scatter_add_has_the_bits_of_index_add_at_a_step_s_size(monkeypatch):
    """Large enough for torch's parallel paths (40K tokens of 512 distinct ids, rows of 256): the same sums, bit
    for bit, whichever op adds them (each element's adds in token order)."""
    g = torch.Generator().manual_seed(5)
    ids = torch.randint(0, 512, (40000,), generator=g) * 7
    rows = torch.randn(40000, 256, generator=g).to(torch.bfloat16)
    got = {}
    for add in ("index_add", "scatter_add"):
        monkeypatch.setattr(embed_grad, "ADD", add)
        r = RowGrad(4096, 256)
        got[add] = r.scatter(ids, rows).view(torch.int32).clone()
    assert torch.equal(got["index_add"], got["scatter_add"])


def test_dense_pieces_are_the_slab_wherever_they_start_and_end():
    r = RowGrad(ROWS, WIDTH)
    ids, rows = _step_rows(2)
    r.scatter(ids, rows)
    flat = _dense(ids, rows, 1 << 16).flatten()
    scratch = torch.full((1000 + 2 * WIDTH,), float("nan"))  # whatever it held before: every element is written
    for a, b in [(0, 1000), (50, 1000), (1000, 1064), (ROWS * WIDTH - 700, ROWS * WIDTH), (96 * 750, 96 * 751)]:
        assert torch.equal(r.dense(a, b, scratch), flat[a:b]), (a, b)


def test_take_gives_touched_rows_and_zeros_elsewhere():
    r = RowGrad(ROWS, WIDTH)
    ids, rows = _step_rows(3)
    r.scatter(ids, rows)
    slab = _dense(ids, rows, 1 << 16)
    want = torch.tensor([0, 1, 3, 999, 3, 600, 747])  # touched, untouched, repeated, past the last touched
    assert torch.equal(r.take(want), slab[want])
    out = torch.full((len(want), WIDTH), float("nan"))  # whatever the kept buffer held: every row is written
    assert r.take(want, out=out) is out and torch.equal(out, slab[want])
    r.clear()
    assert torch.equal(r.take(want), torch.zeros(len(want), WIDTH))


def test_rows_of_the_wrong_shape_are_refused():
    with pytest.raises(ValueError, match=r"rows of shape \(3, 95\) for 3 ids of width 96"):
        RowGrad(ROWS, WIDTH).scatter(torch.tensor([1, 2, 3]), torch.zeros(3, 95))


def _stores(width: int, seed: int = 0):
    """(slab store, rows store): one embedding of ROWS x ``width`` with equal master and moments, its gradient as a
    dense fp32 slab in one and as the touched rows in the other (every third row of the first three quarters)."""
    g = torch.Generator().manual_seed(seed)
    n = ROWS * width
    master, m, v = torch.randn(n, generator=g), torch.randn(n, generator=g) * 0.1, torch.rand(n, generator=g) * 0.01
    ids = torch.randint(0, ROWS // 4, (3000,), generator=g) * 3
    rows = torch.randn(3000, width, generator=g).to(torch.bfloat16)
    slab = torch.zeros(ROWS, width).index_add_(0, ids, rows.float())
    r = RowGrad(ROWS, width)
    r.scatter(ids, rows)

    def store(grad, held):
        unit = SimpleNamespace(master=master.clone(), grad=grad, exp_avg=m.clone(), exp_avg_sq=v.clone(), compact=None)
        return SimpleNamespace(units={-1: unit}, step_count=lambda u: torch.tensor(3.0), rows=held,
                               grad_of=lambda u: unit.grad)
    return store(slab.flatten(), None), store(None, r)


@pytest.mark.parametrize("width", [64, 96])
@pytest.mark.parametrize("scale", [1.0, 0.37])
def test_the_update_and_early_rows_from_rows_equal_the_slabs_bitwise(width, scale, monkeypatch):
    """Chunks that cut rows (as a 151936-row table's do): every chunk made dense equals the slab's piece, so the
    fused AdamW writes the same bits; the early rows (Note: [Early rows]) too."""
    monkeypatch.setattr(HostAdamW, "chunk_numel", 64 * 41)
    monkeypatch.setattr(HostAdamW, "rows_numel", width * 2)  # the early rows' copies two rows at a time
    cfg = OptimConfig(lr=1e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    (slab, rows), want = _stores(width), torch.tensor([0, 3, 4, 600, 999])  # touched, untouched, past the last
    a, b = HostAdamW(slab, cfg), HostAdamW(rows, cfg)
    early = b.updated_rows(-1, want, width, lr=2e-3, grad_scale=scale)
    assert torch.equal(early, a.updated_rows(-1, want, width, lr=2e-3, grad_scale=scale))
    a.update(-1, lr=2e-3, grad_scale=scale)
    b.update(-1, lr=2e-3, grad_scale=scale)
    for k in ("master", "exp_avg", "exp_avg_sq"):
        assert torch.equal(getattr(slab.units[-1], k), getattr(rows.units[-1], k)), k
    assert torch.equal(early, rows.units[-1].master.view(-1, width)[want])
    assert a.steps_done(-1) == b.steps_done(-1) == 4


@pytest.mark.parametrize("family,kw,why", [
    ("llama", {}, None),
    ("llama_tied", {}, "tied: the head's gradient lands in it whole"),
    ("llama", {"optimizer_state": "int8", "compact_keep_fp32": (), "vocab_size": 640},  # 640 x 32: quantized
     "compact embedding moments read a whole slab"),
    ("llama", {"grad_clip": 1.0}, "grad_clip"),
])
def test_a_session_keeps_the_embeddings_slab_only_where_it_must(hf_dir, family, kw, why):
    kw = dict(kw)  # the parameter set stays as pytest holds it
    over = {k: kw.pop(k) for k in list(kw) if k == "vocab_size"}
    s = Session.from_pretrained(hf_dir(family, num_hidden_layers=2, **over), device="cpu", lr=LR, **kw)
    try:
        emb = s.store.units[-1]
        s.step(make_batches(VOCAB, 1, seed=4)[0])
        rep = s.memory_report()
        if why is None:
            assert emb.grad is None and s.store.rows is not None and rep["grad_rows"] > 0
            assert "the embedding's touched rows" in rep["gradients"]
            with pytest.raises(ValueError, match="held as rows"):
                s.store.grad_of(-1)
        else:
            assert emb.grad is not None and s.store.rows is None and rep["grad_rows"] == 0
            assert why in rep["gradients"]
    finally:
        s.close()
