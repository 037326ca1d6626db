"""Soak: 500 steps of a tiny model on the CPU leak neither host memory nor threads, within a time limit.

What a leak would look like here: a per-step tensor, trace record or Box kept alive (RSS grows by
the step), or a worker thread started per step (thread count grows). Step 50 is the baseline: by
then the allocator, autograd and the trace recorder have reached their steady state.
"""
from __future__ import annotations

import gc
import threading
import time

import pytest
import torch

from conftest import make_batches, make_config
from megatrain_nb import Session

STEPS, BASELINE = 500, 50
MAX_GROWTH = 30 << 20  # bytes of RSS between step 50 and step 500
MAX_SECONDS = 170.0


def _rss() -> int:
    import psutil

    gc.collect()
    return psutil.Process().memory_info().rss


def _os_threads() -> int:
    import psutil

    return psutil.Process().num_threads()


@pytest.mark.slow
def test_soak_500_steps(capsys):
    t0 = time.perf_counter()
    cfg = make_config("llama", vocab_size=64, hidden_size=32, num_hidden_layers=2)
    batches = make_batches(cfg.vocab_size, 20, batch=2, seq=16)  # cycled: the data is not under test
    s = Session.from_config(cfg, seed=0)
    rss, threads, os_threads, losses = {}, {}, {}, []
    for k in range(1, STEPS + 1):
        losses.append(s.step(batches[k % len(batches)]).loss)
        if k == BASELINE or k % 100 == 0:
            s.engine.drain()  # measure between steps, not with an update in flight
            rss[k], threads[k], os_threads[k] = _rss(), threading.active_count(), _os_threads()
    s.close()
    seconds = time.perf_counter() - t0
    growth = rss[STEPS] - rss[BASELINE]
    with capsys.disabled():
        print(f"\nsoak: {STEPS} steps in {seconds:.1f} s ({torch.get_num_threads()} torch threads); RSS "
              f"{rss[BASELINE] / 2**20:.1f} MiB at step {BASELINE} -> {rss[STEPS] / 2**20:.1f} MiB at step "
              f"{STEPS} ({growth / 2**20:+.2f} MiB); Python threads {threads}; OS threads {os_threads}")
    assert all(map(lambda x: x == x and x < 10, losses)), "a loss went non-finite or diverged"
    assert growth < MAX_GROWTH, f"RSS grew {growth / 2**20:.1f} MiB from step {BASELINE} to {STEPS}: {rss}"
    assert len(set(threads.values())) == 1, f"Python thread count changed: {threads}"
    assert len(set(os_threads.values())) == 1, f"OS thread count changed: {os_threads}"
    assert seconds <= MAX_SECONDS, f"{STEPS} steps took {seconds:.1f} s, limit {MAX_SECONDS} s"
    assert sum(losses[-20:]) / 20 < sum(losses[:20]) / 20, "500 steps on 20 batches should lower the loss"


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_soak_100_steps_on_cuda(capsys):
    """100 streamed steps on the GPU: host RSS, device memory and threads flat after warm-up."""
    cfg = make_config("llama", vocab_size=1024, hidden_size=256, intermediate_size=688, num_hidden_layers=4)
    batches = make_batches(cfg.vocab_size, 10, batch=4, seq=256)
    s = Session.from_config(cfg, seed=0, device="cuda")
    rss, dev, peak, threads = {}, {}, {}, {}
    for k in range(1, 101):
        s.step(batches[k % len(batches)])
        if k in (10, 50, 100):
            s.engine.drain()
            rss[k], threads[k] = _rss(), threading.active_count()
            dev[k], peak[k] = torch.cuda.memory_allocated(), torch.cuda.max_memory_allocated()
    s.close()
    with capsys.disabled():
        print(f"\ncuda soak: RSS {[round(v / 2**20, 1) for v in rss.values()]} MiB, device allocated "
              f"{[round(v / 2**20, 1) for v in dev.values()]} MiB, peak {[round(v / 2**20, 1) for v in peak.values()]}"
              f" MiB, threads {threads}")
    assert rss[100] - rss[10] < MAX_GROWTH, rss
    assert dev[100] == dev[10] and peak[100] == peak[10], (dev, peak)
    assert len(set(threads.values())) == 1, threads
