"""step/embedding.py: Note: [Unique rows]: a streamed embedding sends each distinct row of a micro-batch once and
spreads them to their tokens on the device; early rows go as they were served, uncopied."""
from __future__ import annotations

import threading

import pytest
import torch

from conftest import VOCAB, make_batches, train_session
from megatrain_nb import Session
from megatrain_nb.step import embedding
from megatrain_nb.step.early_rows import EarlyRows


def _repeating(n: int, distinct: int) -> list[dict]:
    """Batches whose tokens come from ``distinct`` ids only (text repeats its common tokens)."""
    out = []
    for b in make_batches(VOCAB, n, seq=24):
        b["input_ids"] = b["input_ids"] % distinct + 3
        out.append(b)
    return out


@pytest.mark.parametrize("family", ["llama", "llama_tied"])
def test_the_forward_loads_each_distinct_row_once(hf_dir, family):
    batches = _repeating(3, distinct=7)
    s = Session.from_pretrained(hf_dir(family, hidden_size=64), lr=1e-3)
    try:
        train_session(s, batches)
        spans = s.trace.to_dataframe()
        size = s.engine.dtype.itemsize
    finally:
        s.close()
    loads = spans[(spans.lane == "h2d") & (spans.layer == -1) & (spans.phase == "fwd")]
    assert len(loads) == 1  # the last step's (the trace keeps one)
    distinct = batches[-1]["input_ids"].unique().numel()
    assert distinct < batches[-1]["input_ids"].numel()
    assert loads.bytes.iloc[0] == distinct * 64 * size


@pytest.mark.parametrize("family", ["llama", "llama_tied"])
def test_each_token_gets_its_row(hf_dir, family):
    """The rows spread on the device are each token's row of the master, in the compute dtype; after a step too
    (its update pending or applied). The equivalence tests train on random tokens, which repeat too."""
    batches = _repeating(2, distinct=5)
    s = Session.from_pretrained(hf_dir(family, hidden_size=64), lr=1e-3)
    try:
        for b in batches:
            s.engine.drain()
            ids = b["input_ids"]
            E, box = embedding.gather(s.engine, {"input_ids": ids})
            box.get()  # on the CPU: copied and spread
            want = s.store.units[-1].master.view(-1, 64).index_select(0, ids.flatten()).to(s.engine.dtype)
            assert E.shape == (*ids.shape, 64)
            assert torch.equal(E.reshape(-1, 64).cpu(), want)
            s.step(b)
    finally:
        s.close()


def test_early_rows_asked_as_served_come_uncopied():
    from megatrain_nb.step.workers import AdamWorker

    w = AdamWorker([-1], lambda *a: None, threading.Event())
    try:
        e = EarlyRows(64, w)
        ids = torch.tensor([2, 5, 9])
        assert e.request(1, ids)
        rows = torch.randn(3, 64)
        assert e.serve(1, lambda want: rows)
        assert e.take(ids, 1, master=None).data_ptr() == rows.data_ptr()  # no copy: sent as served
        assert torch.equal(e.take(torch.tensor([9, 2, 2]), 1, master=None), rows[[2, 0, 0]])  # per token: gathered
    finally:
        w.close()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("early", [False, True])
def test_each_token_gets_its_row_on_cuda_behind_a_slow_copy(hf_dir, early):
    """On CUDA the spread runs on the h2d stream after the rows' copy, which a sleep delays: a compute stream that
    did not wait for the load's event would read the buffer before the rows are in it. With ``early``, the rows
    come as the worker served them, ahead of the embedding's update."""
    s = Session.from_pretrained(hf_dir("llama", hidden_size=64), device="cuda", lr=1e-3, weight_decay=0.1,
                                placement="host")  # "auto" keeps a model this small on the card: no load at all
    try:
        assert -1 not in s.engine.dev_opt.of  # the embedding is updated on the host and its rows loaded
        batches = _repeating(2, distinct=5)
        s.engine.early.on = early
        s.engine.delays = {"h2d": 20_000_000, "host-adam": 0.1 if early else 0.0}
        s.step(batches[0])
        ids = batches[1]["input_ids"]
        E, box = embedding.gather(s.engine, {"input_ids": ids})
        dev = s.engine.dev
        dev.wait(dev.compute, box.get())
        with torch.cuda.stream(dev.compute):
            got = E.clone()
        torch.cuda.synchronize()
        served = s.engine.early.count
        s.engine.drain()  # the embedding's update applied: the rows the forward must have read
        want = s.store.units[-1].master.view(-1, 64).index_select(0, ids.flatten()).to(s.engine.dtype)
        assert torch.equal(got.reshape(-1, 64).cpu(), want)
        assert served == (1 if early else 0)
    finally:
        s.close()
