"""The host's AdamW beside what a `stream` step runs at the same time: PCIe copies both ways, a busy driver thread.

In a 3B x 1 `stream` trace (H200, 2026-12-02) the host's AdamW ran 2.08 G params/s, against 3.48 alone
(`bench/host_adam.py`), and the state loads 40 GB/s against 55 alone (../shared/LIMITS.md). This says which
of the step's other work takes it: the DMA's share of host memory, or a core of the AdamW's thread team.
    python bench/host_contention.py --out out/host_contention.jsonl      (needs CUDA for the DMA rows)
One JSON row per (threads, beside): the AdamW's G params/s (median update of one 3B layer, bf16 grads, as the
engine's worker runs it), and the copies' GB/s each way while it ran. ``beside``: "alone", "dma" (pinned 1 GiB
host<->device copies, both ways on two streams, looping), "spin" (a Python thread that never sleeps, as the
engine's driver), "dma+spin"; ``switch_ms``: the interpreter's switch interval (sys.setswitchinterval) for the spinning
thread's rows: how long the worker may wait for the GIL between its Python-level calls. ``cast``: the row's updates also cast the new master into a bf16 copy, chunk by
chunk (what a bf16 load from the host would cost the worker).
"""
from __future__ import annotations

import argparse
import itertools
import statistics
import sys
import threading
import time

import torch

from host_adam import stand_in_store  # bench/ is on sys.path when this runs as a script
from rows import emit

from megatrain_nb.config import OptimConfig
from megatrain_nb.host.optim import HostAdamW, _fused


class Dma:
    """Pinned host<->device copies of ``gib`` GiB each way, looping on two streams until stopped."""

    def __init__(self, gib: float):
        n = int(gib * (1 << 30))
        self.h_in, self.h_out = (torch.empty(n, dtype=torch.uint8, pin_memory=True) for _ in range(2))
        self.d_in, self.d_out = (torch.empty(n, dtype=torch.uint8, device="cuda") for _ in range(2))
        self.streams = torch.cuda.Stream(), torch.cuda.Stream()
        self.stop, self.bytes, self.thread = threading.Event(), 0, None

    def _loop(self) -> None:
        while not self.stop.is_set():
            with torch.cuda.stream(self.streams[0]):
                self.d_in.copy_(self.h_in, non_blocking=True)
            with torch.cuda.stream(self.streams[1]):
                self.h_out.copy_(self.d_out, non_blocking=True)
            for s in self.streams:
                s.synchronize()
            self.bytes += self.h_in.numel()

    def __enter__(self):
        self.stop.clear()
        self.bytes, self.t0 = 0, time.perf_counter()
        self.thread = threading.Thread(target=self._loop, daemon=True)
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.stop.set()
        self.thread.join()
        self.GBps_each = self.bytes / (time.perf_counter() - self.t0) / 1e9


class Spin:
    """A Python thread that never sleeps (the engine's driver launching kernels)."""

    def __enter__(self):
        self.stop = threading.Event()

        def run():
            x = 0
            while not self.stop.is_set():
                x += 1
        self.thread = threading.Thread(target=run, daemon=True)
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.stop.set()
        self.thread.join()


def _adam(n: int, threads: int, reps: int, cast: bool) -> float:
    """Median seconds of one HostAdamW.update on an ``n``-element unit with bf16 grads, in a thread of its own
    with ``threads`` intra-op threads (as the engine's worker); ``cast``: each chunk's new master is also cast
    into a bf16 copy right after its update."""
    store = stand_in_store(n, torch.bfloat16)
    unit, opt = store.units[0], HostAdamW(store, OptimConfig(lr=1e-5))
    out, times = torch.empty(n, dtype=torch.bfloat16), []
    scratch, step = torch.empty(min(n, opt.chunk_numel)), torch.zeros(())

    def one():
        t0 = time.perf_counter()
        if cast:  # the worker's chunk loop (HostAdamW._update_in_chunks), each chunk's master cast while warm
            state, group, c = opt.opts[0].state[unit.master], opt.opts[0].param_groups[0], opt.chunk_numel
            for a in range(0, n, c):
                b = min(n, a + c)
                gs = scratch[:b - a].copy_(unit.grad[a:b])
                _fused(group, 1e-5, unit.master[a:b], gs, state["exp_avg"][a:b], state["exp_avg_sq"][a:b], step.zero_())
                out[a:b].copy_(unit.master[a:b])
        else:
            opt.update(0, 1e-5)
        times.append(time.perf_counter() - t0)

    def run():
        torch.set_num_threads(threads)
        one()  # warm-up: scratch, thread team
        times.clear()
        for _ in range(reps):
            one()
    t = threading.Thread(target=run)
    t.start()
    t.join()
    return statistics.median(times)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--numel", type=int, default=77_070_336, help="default: one Qwen2.5-3B layer")
    ap.add_argument("--threads", type=int, nargs="+", default=None, help="default: all cores, then -2, half")
    ap.add_argument("--reps", type=int, default=9)
    ap.add_argument("--dma-gib", type=float, default=1.0)
    ap.add_argument("--beside", nargs="+", default=None, help="only these: alone spin dma dma+spin")
    ap.add_argument("--chunks", type=int, nargs="+", default=None,
                    help="HostAdamW.chunk_numel values (default: the worker's): the upcast's chunk, in or out of cache")
    ap.add_argument("--no-cast", action="store_true", help="skip the rows that also cast to bf16")
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    cores = torch.get_num_threads()
    threads = a.threads or sorted({cores, cores - 2, cores // 2}, reverse=True)
    cuda = torch.cuda.is_available()
    dma = Dma(a.dma_gib) if cuda else None
    if dma is not None:
        with dma:
            time.sleep(2.0)
        emit(dict(bench="host_contention", beside="dma only", dma_GBps_each=round(dma.GBps_each, 1)), a.out)
    switch = sys.getswitchinterval()
    for beside, switch_ms in (("alone", None), ("spin", switch * 1e3), ("spin", 0.5), ("dma", None),
                              ("dma+spin", switch * 1e3), ("dma+spin", 0.5)):
        if ("dma" in beside and dma is None) or (a.beside and beside not in a.beside):
            continue
        sys.setswitchinterval(switch if switch_ms is None else switch_ms / 1e3)
        for cast, chunk, th in itertools.product((False,) if a.no_cast else (False, True),
                                                 a.chunks or [HostAdamW.chunk_numel], threads):
            HostAdamW.chunk_numel = chunk
            ctx = [Spin()] if "spin" in beside else []
            ctx += [dma] if "dma" in beside else []
            for c in ctx:
                c.__enter__()
            try:
                t = _adam(a.numel, th, a.reps, cast)
            finally:
                for c in reversed(ctx):
                    c.__exit__(None, None, None)
            emit(dict(bench="host_contention", beside=beside, switch_ms=switch_ms, cast=cast, threads=th, cores=cores,
                      ms=round(t * 1e3, 2), gparams_per_s=round(a.numel / t / 1e9, 3),
                      dma_GBps_each=round(dma.GBps_each, 1) if "dma" in beside else None,
                      chunk=HostAdamW.chunk_numel, torch=torch.__version__), a.out)


if __name__ == "__main__":
    main()
