"""denormals.py: the Adam worker's thread and its OpenMP pool flush subnormals (Note: [Subnormals]), so a
fused AdamW step on subnormal moments gives what it gives on zeros, and costs no more than on normal moments."""
from __future__ import annotations

import statistics
import threading
import time
import types

import pytest
import torch

from megatrain_nb.config import OptimConfig
from megatrain_nb.host.denormals import flush_denormals, pool_flushes, subnormals
from megatrain_nb.host.optim import HostAdamW
from megatrain_nb.step.workers import AdamWorker, Box

def _in_adam_worker(fn, threads: int | None = None):
    """``fn()`` run as one unit's update in an AdamWorker (the thread the engine's host updates run on)."""
    out = []
    w = AdamWorker([0], lambda u, lr, scale: out.append(fn()), threading.Event())
    try:
        w.threads = threads
        w.begin(step=0, lr=1e-3, gate=False, clip=lambda n: (1.0, 0.0), loss=Box(value=1.0, ready=True))
        w.land(0, 1.0, step=0)
        w.wait_version(0, 1)
    finally:
        w.close()
    return out[0]


def _in_plain_thread(fn):
    """``fn()`` on a new thread that does not flush, whatever the main thread's MXCSR (a thread inherits it, and
    compact_kernel.c leaves its caller flushing)."""
    out = []
    t = threading.Thread(target=lambda: out.append((torch.set_flush_denormal(False), fn())[1]))
    t.start()
    t.join()
    return out[0]


def _one_unit(master, grad, exp_avg, exp_avg_sq) -> HostAdamW:
    """A HostAdamW over a store stand-in with one unit holding these (n,) fp32 tensors."""
    unit = types.SimpleNamespace(master=master, grad=grad, exp_avg=exp_avg, exp_avg_sq=exp_avg_sq, compact=None)
    store = types.SimpleNamespace(units={0: unit}, step_count=lambda u: torch.zeros(()), grad_of=lambda u: unit.grad)
    return HostAdamW(store, OptimConfig(lr=1e-3, weight_decay=0.1))


def _is_subnormal(t: torch.Tensor) -> torch.Tensor:
    """From the bits (exponent 0, mantissa not): a comparison on a flushing thread reads a subnormal as 0."""
    b = t.view(torch.int32)
    return ((b & 0x7F800000) == 0) & ((b & 0x007FFFFF) != 0)


def _bits(*ts: torch.Tensor) -> list[torch.Tensor]:
    """int32 views: compared as bits, whatever this thread's MXCSR (and code words read as fp32 can be NaNs)."""
    return [t.view(torch.int32) for t in ts]


@pytest.fixture(scope="module")
def flushing():
    if not _in_plain_thread(flush_denormals):
        pytest.skip("this CPU has no flush-to-zero torch can set (torch.set_flush_denormal returned False)")


def test_the_adam_workers_update_on_subnormal_moments_equals_the_update_on_zeros(flushing):
    """Every thread of the worker's pool flushes (two at least, whatever the machine): a HostAdamW step whose
    moments hold subnormals gives bit for bit the step on zeros in their place; a plain thread keeps them."""
    n = 1 << 18  # a multiple of 64: the kernel's vector lanes fall alike in both runs
    g = torch.Generator().manual_seed(0)
    p0, grad = torch.randn(n, generator=g) * 0.02, torch.randn(n, generator=g) * 1e-3
    grad[::4] = 0.0  # a row untouched this step: exp_avg * 0.9 of a subnormal is subnormal unless flushed
    sub = torch.arange(n) % 3 == 0
    m0, v0 = torch.randn(n, generator=g) * 1e-4, torch.rand(n, generator=g) * 1e-8
    m0[sub], v0[sub] = subnormals(int(sub.sum())), subnormals(int(sub.sum()))

    def step(m, v):
        p, m, v = p0.clone(), m.clone(), v.clone()
        _one_unit(p, grad.clone(), m, v).update(0, 1e-3)
        return p, m, v

    def flushed():
        return pool_flushes(), step(m0, v0)

    ok, (p, m, v) = _in_adam_worker(flushed, threads=max(2, torch.get_num_threads()))
    want = step(m0.masked_fill(sub, 0.0), v0.masked_fill(sub, 0.0))  # main thread, unflushed: no subnormal arises
    assert ok
    assert all(torch.equal(a, b) for a, b in zip(_bits(p, m, v), _bits(*want)))
    assert not _is_subnormal(m).any() and not _is_subnormal(v).any()
    kept = _in_plain_thread(lambda: step(m0, v0))[1]
    assert _is_subnormal(kept).any()  # the test can fail: unflushed, 0.9 * 1e-39 stays subnormal


@pytest.mark.parametrize("update", ["update_host", "update_torch"])
def test_the_adam_workers_compact_update_on_subnormal_moments_equals_the_update_on_zeros(flushing, update):
    """Compact state alike: subnormal moments of its fp32-kept span are flushed in the worker. ``update_torch`` (the
    host's path where no C compiler is found) is torch ops on the worker's thread and pool alone; the C kernel
    sets the same bits on its own threads, which leaves its caller flushing too, so only the former can fail
    in a plain thread."""
    from megatrain_nb.host import compact_host, compact_state as cs

    n = 1 << 16
    lay = cs.Layout("int8", n, ((0, n // 2),))  # the first half keeps fp32 moments, the second is quantized
    g = torch.Generator().manual_seed(0)
    p0, grad = torch.randn(n, generator=g) * 0.02, torch.randn(n, generator=g) * 1e-3
    grad[: n // 2: 4] = 0.0  # rows untouched this step: their 0.9 * 1e-39 stays subnormal unless flushed
    m0, v0 = torch.zeros(lay.words), torch.zeros(lay.words)
    kept_m, kept_v = cs.parts(m0, lay)[2], cs.parts(v0, lay)[2]  # (n // 2,) fp32 views into the slabs
    kept_m.copy_(torch.randn(n // 2, generator=g) * 1e-4), kept_v.copy_(torch.rand(n // 2, generator=g) * 1e-8)
    sub = torch.arange(n // 2) % 3 == 0
    kept_m[sub], kept_v[sub] = subnormals(int(sub.sum())), subnormals(int(sub.sum()))

    def step(m, v):
        p, m, v = p0.clone(), m.clone(), v.clone()
        (compact_host.update_host if update == "update_host" else cs.update_torch)(lay, p, grad, m, v, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.1,
                            step=torch.tensor(1.0))
        return _bits(p, m, v)

    got = _in_adam_worker(lambda: step(m0, v0), threads=max(2, torch.get_num_threads()))
    zm, zv = m0.clone(), v0.clone()
    cs.parts(zm, lay)[2][sub], cs.parts(zv, lay)[2][sub] = 0.0, 0.0
    want = step(zm, zv)  # no subnormal arises: the same whether this thread flushes or not
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    assert not _is_subnormal(cs.parts(got[1].view(torch.float32), lay)[2]).any()
    if update == "update_torch":
        kept = cs.parts(_in_plain_thread(lambda: step(m0, v0))[1].view(torch.float32), lay)[2]
        assert _is_subnormal(kept).any()  # the test can fail: unflushed, 0.9 * 1e-39 stays subnormal


def test_a_pool_made_before_the_flush_keeps_subnormals(flushing):
    """Note: [Subnormals]: MXCSR is copied into a pool's threads when they are made, at the calling thread's
    first parallel op; a flush after it reaches the calling thread alone. Why the worker flushes first thing."""
    def late():
        before = torch.get_num_threads()
        torch.set_num_threads(2)  # a pool thread beside this one, whatever the machine
        try:
            subnormals(1 << 17).mul(1.0)  # makes the pool, unflushed
            flush_denormals()
            return pool_flushes()
        finally:
            torch.set_num_threads(before)  # torch keeps the last count set for threads started later

    assert not _in_plain_thread(late)


def _cpu() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), "unknown CPU")
    except OSError:
        return "unknown CPU"


def _subnormal_over_normal(n: int, threads: int, pairs: int = 9) -> float:
    """Rate of torch's fused AdamW (HostAdamW.update) with both moments subnormal and zero grads (a row no longer
    seen: shared/LIMITS.md's worst case) over its rate with normal moments, on the calling thread with ``threads``
    intra-op threads: the median of back-to-back pairs (a pair shares a noisy host's slow spells)."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        g = torch.Generator().manual_seed(0)
        p, grad = torch.randn(n, generator=g) * 0.02, torch.randn(n, generator=g) * 1e-3
        m, v = torch.empty(n), torch.empty(n)
        seeds = {"normal": (torch.randn(n, generator=g) * 1e-4, torch.rand(n, generator=g) * 1e-8, grad),
                 "subnormal": (subnormals(n), subnormals(n), torch.zeros(n))}
        opt = {k: _one_unit(p, s[2], m, v) for k, s in seeds.items()}
        ratios = []
        for r in range(pairs + 1):  # the first pair warms the pool and the pages
            t = {}
            for k, (m0, v0, _) in seeds.items():
                m.copy_(m0), v.copy_(v0)  # bitwise copies: a flushed step leaves zeros, so reseed every time
                t0 = time.perf_counter()
                opt[k].update(0, 1e-5)
                t[k] = time.perf_counter() - t0
            if r:
                ratios.append(t["normal"] / t["subnormal"])
        return statistics.median(ratios)
    finally:
        torch.set_num_threads(before)  # torch keeps the last count set for threads started later


def test_subnormal_moments_cost_the_adam_worker_no_more_than_normal_ones(flushing):
    """Held within 0.8x of the normal rate in the worker; where an unflushed thread shows no slowdown of its own
    there is nothing to hold and the test says so. A core is left to the waiting main thread and the OS, so that
    on a small host their noise does not decide; a worker that does not flush fails each of its three tries."""
    n, threads = 1 << 24, max(1, torch.get_num_threads() - 1)  # 16M: past the caches, as a layer's slab is
    plain = _in_plain_thread(lambda: _subnormal_over_normal(n, threads))
    if plain >= 0.8:
        pytest.skip(f"no subnormal slowdown to hold on {_cpu()}: unflushed, with {threads} threads, subnormal "
                    f"moments ran at {plain:.2f}x the normal rate")
    tries = []
    while len(tries) < 3 and max(tries, default=0.0) < 0.8:
        tries.append(_in_adam_worker(lambda: _subnormal_over_normal(n, threads)))
    assert max(tries) >= 0.8, (f"on {_cpu()} with {threads} threads the Adam worker updated subnormal moments at "
                               f"{tries}x the normal rate (unflushed {plain:.2f}x): its pool does not flush "
                               "(Note: [Subnormals])")
