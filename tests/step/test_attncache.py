"""Tests for megatrain_nb.step.attncache (attention outputs kept from the forward, Note: [Attention cache]): the
kernel's own gradients from the kept node, only the output and log-sum-exp kept, whole training equal to
HF + AdamW and bit-equal to the uncached recompute, the planner's and the placement's share of memory."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from conftest import families, make_batches, make_config
from helpers import QWEN25_7B, compare
from megatrain_nb import Session
from megatrain_nb.step.attncache import AttentionCache, entry_bytes
from megatrain_nb.machine.longcontext import (DEVICE_RESERVE, KEEP_SHARE, LONG_SHARE, MAX_BLOCK, Checkpoints, PlacementError, backward_peak,
                                      cache_bytes, cache_first, keep_cap, layer_bytes, parked_bytes, place_cache,
                                      place_checkpoints)
from megatrain_nb.machine.shape import model_shape
from megatrain_nb.machine.planner import plan


def _qkv(dtype, heads=4, kv_heads=2, T=24, D=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(2, heads, T, D, generator=g).to(dtype), torch.randn(2, kv_heads, T, D, generator=g).to(dtype),
            torch.randn(2, kv_heads, T, D, generator=g).to(dtype))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_replayed_attention_has_the_kernels_own_output_and_gradients(dtype):
    """Grouped K/V (enable_gqa), causal: the replay returns the forward's output and, in the backward, the
    gradients the kernel gives the recomputed q, k, v, bit for bit; the entry is gone after its backward."""
    q, k, v = _qkv(dtype)
    kw = dict(is_causal=True, enable_gqa=True)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    want = F.scaled_dot_product_attention(*leaves, **kw)
    g = torch.randn_like(want)
    want.backward(g)

    cache = AttentionCache()
    with torch.no_grad(), cache.capture(3, 1):
        first = F.scaled_dot_product_attention(q, k, v, **kw)
    assert len(cache) == 1 and not first.requires_grad
    re = [t.clone().requires_grad_() for t in (q, k, v)]  # the recompute's q, k, v: equal values, new tensors
    with cache.replay(3, 1):
        got = F.scaled_dot_product_attention(*re, **kw)
    assert len(cache) == 0 and cache.replayed == 1
    got.backward(g)
    assert torch.equal(first, want.detach()) and torch.equal(got.detach(), want.detach())
    for a, b in zip(re, leaves):
        assert torch.equal(a.grad, b.grad)


def test_an_entry_keeps_only_the_output_and_the_log_sum_exp():
    """q, k and v become placeholders (their memory goes with the forward); the entry's bytes are
    ``entry_bytes``: what the planner and the placement count per cached layer."""
    q, k, v = _qkv(torch.float32, heads=4, kv_heads=2, T=32, D=16)
    cache = AttentionCache()
    with torch.no_grad(), cache.capture(0, 0):
        F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    assert cache.nbytes == entry_bytes(tokens=2 * 32, heads=4, head_dim=16, dtype_bytes=4)
    assert cache.nbytes < q.nbytes + k.nbytes + v.nbytes + q.nbytes  # without q, k, v beside the output


def test_replay_without_an_entry_runs_the_kernel_and_a_changed_shape_is_named():
    q, k, v = _qkv(torch.float32)
    cache = AttentionCache()
    with cache.replay(0, 0):  # nothing captured: the kernel runs
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    assert y.shape == q.shape and cache.replayed == 0
    with torch.no_grad(), cache.capture(0, 0):
        F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    with pytest.raises(RuntimeError, match="layer 0's recompute called SDPA"), cache.replay(0, 0):
        F.scaled_dot_product_attention(q[:, :, :8], k[:, :, :8], v[:, :, :8], is_causal=True, enable_gqa=True)


@pytest.mark.parametrize("family, engine", [
    ("qwen2", dict(checkpoint_every=1)),
    ("llama", dict(checkpoint_every=2, micro_batch_size=1, offload_checkpoints=True, tile_tokens=48)),
])
def test_cached_attention_trains_like_hf(hf_dir, family, engine, tmp_path, monkeypatch):
    """Every recomputed layer cached (attention_cache=True on the CPU): equal to HF + torch.optim.AdamW,
    with blocks, micro-batches, parked inputs and tiling beside it."""
    counts = []
    replay = AttentionCache._replay
    monkeypatch.setattr(AttentionCache, "_replay", lambda self, *a: counts.append(1) or replay(self, *a))
    compare(hf_dir(family, max_position_embeddings=512), family, tmp_path, steps=3, batch=2,
            seq=96 if engine.get("tile_tokens") else 24, attention_cache=True, **engine)
    assert counts, "no layer replayed its attention: the test compared nothing cached"


@pytest.mark.parametrize("family", families())
def test_every_family_trains_like_hf_with_every_layer_cached(hf_dir, family, tmp_path, monkeypatch):
    """Masks (sliding windows), sinks, q/k norms, soft caps, MoE: whatever the family hands SDPA, the kept
    node is the kernel's own, so the cached recompute trains equal to HF + AdamW. Families on eager
    attention call no SDPA: nothing is cached and the run is the plain recompute."""
    counts = []
    replay = AttentionCache._replay
    monkeypatch.setattr(AttentionCache, "_replay", lambda self, *a: counts.append(1) or replay(self, *a))
    compare(hf_dir(family), family, tmp_path, steps=2, checkpoint_every=1, attention_cache=True)
    from conftest import attn_of
    assert bool(counts) == (attn_of(family) == "sdpa"), f"{family}: {len(counts)} replays"


def test_cached_attention_is_bit_equal_to_the_recompute_and_reported():
    cfg = make_config("qwen2", num_hidden_layers=4)
    batches = make_batches(cfg.vocab_size, 3, batch=2, seq=20)
    runs = {}
    for cached in (False, True):
        s = Session.from_config(cfg, seed=0, checkpoint_every=2, attention_cache=cached)
        runs[cached] = [s.step(b).loss for b in batches]
        s.engine.drain()
        runs[cached, "w"] = [s.store.units[u].master.clone() for u in s.store.order]
        a = s.activations
        assert a["attention_cached"] == (4 if cached else 0)
        assert s.engine.attn_cache.captured == s.engine.attn_cache.replayed == (4 * 3 if cached else 0)
        assert len(s.engine.attn_cache) == 0  # every entry went with its backward
        s.close()
    assert runs[True] == runs[False]
    assert all(torch.equal(a, b) for a, b in zip(runs[True, "w"], runs[False, "w"]))


def test_a_failed_step_drops_its_entries_and_the_next_trains(monkeypatch):
    cfg = make_config("llama", num_hidden_layers=3)
    s = Session.from_config(cfg, seed=0, checkpoint_every=1, attention_cache=True)
    batch = make_batches(cfg.vocab_size, 1, batch=1, seq=16)[0]
    boom = s.engine._loss
    monkeypatch.setattr(s.engine, "_loss", lambda *a: (_ for _ in ()).throw(RuntimeError("boom")))
    with pytest.raises(RuntimeError, match="boom"):
        s.step(batch)
    assert len(s.engine.attn_cache) == 0  # the forward had cached three layers
    monkeypatch.setattr(s.engine, "_loss", boom)
    assert s.step(batch).loss > 0 and len(s.engine.attn_cache) == 0
    s.close()


def _walked_peak(layers, block, parked, cached, act, lean, transient, ckpt, cache):
    """The backward's device bytes walked block by block with explicit sets: which inputs and caches are
    alive when each block's backward runs (Note: [Attention cache placement])."""
    starts = list(range(0, layers, block))
    inputs = {x for k, x in enumerate(starts) if k >= parked}  # the parked ones come back one at a time
    alive, peak = set(cached), 0
    for x in reversed(starts):
        end = min(x + block, layers)
        work = sum(lean if i in cached else act for i in range(x, end))
        peak = max(peak, len(inputs | {x}) * ckpt + len(alive) * cache + work + transient)
        inputs.discard(x)
        alive -= set(range(x, end))
    return peak


def test_backward_peak_is_the_walk_and_caching_the_last_layers_lowers_it():
    kw = dict(act=10, lean=7, transient=3)
    for layers, block, parked, n in [(28, 2, 3, 6), (28, 3, 3, 9), (7, 3, 0, 2), (5, 4, 1, 5), (6, 1, 6, 0)]:
        last = set(range(layers - n, layers))
        got = backward_peak(layers=layers, block=block, parked=parked, cached=n, ckpt_bytes=2, cache_bytes=4, **kw)
        assert sum(got.values()) == _walked_peak(layers, block, parked, last, ckpt=2, cache=4, **kw)
        assert sum(got.values()) <= _walked_peak(layers, block, parked, set(range(n)), ckpt=2, cache=4, **kw)
    # 7B at 512K, blocks of 2, 3 parked, 6 cached: the last six cost two lean saved sets less at the peak
    lb = layer_bytes(model_shape(QWEN25_7B), 524288, 2, 16384, 0, seq=524288)
    args = (28, 2, 3, lb["act"], lb["act"] - lb["attn_out"], lb["transient"], lb["boundary"], lb["cache"])
    first, last = _walked_peak(28, 2, 3, set(range(6)), *args[3:]), _walked_peak(28, 2, 3, set(range(22, 28)), *args[3:])
    assert first - last == 2 * lb["attn_out"] > 7 << 30


def test_cache_placement_fits_the_walk_and_one_more_cached_layer_would_not():
    kw = dict(act=10, lean=8, transient=3, ckpt_bytes=1, cache_bytes=2)
    # nothing cached: the placement place_checkpoints makes (blocks of 2, 4 of 14 inputs parked)
    assert place_cache(layers=28, cache_bytes=0, ckpt_bytes=1, device_free=30, act=10, lean=10, transient=0, host_free=5,
                       host_each=1) == (0, 2, 4) == (0, *place_checkpoints(layers=28, ckpt_bytes=1, device_free=30,
                                                                         reserve=lambda k: 10 * k, host_free=5, host_each=1))
    n, block, parked = place_cache(layers=28, device_free=60, host_free=5, host_each=1, **kw)
    peak = lambda n, K, p: sum(backward_peak(layers=28, block=K, parked=p, cached=n, **kw).values())  # noqa: E731
    assert 0 < n < 28 and peak(n, block, parked) <= 60 and parked <= 5
    assert all(peak(n + 1, K, p) > 60 for K in range(1, MAX_BLOCK + 1) for p in range(6))  # nor any block, any parking
    with pytest.raises(PlacementError, match="fit nowhere"):
        place_cache(layers=28, device_free=12, host_free=0, host_each=1, **kw)
    # a kept layer (5) costs five cached ones (1): the cap keeps fewer where every recomputed layer is cached
    r = lambda k: 10 * k  # noqa: E731  backward working set with blocks of k
    plain = keep_cap(layers=28, act=5, boundary=1, used=0, budget=80, reserve=r, host_free=0, host_each=1)
    cached = keep_cap(layers=28, act=5, boundary=1, used=0, budget=80, reserve=r, host_free=0, host_each=1, extra=1)
    assert cached < plain
    place_checkpoints(layers=28 - cached, ckpt_bytes=1, device_free=80 - 5 * cached - (28 - cached), reserve=r,
                      host_free=0, host_each=1)


def test_the_engine_caches_the_last_layers_and_the_cache_may_reach_the_long_share():
    """Checkpoints on measured memory (7B at 512K, 10 GiB in use, 12 GiB of host RAM): at 0.85 the inputs fit
    and one layer's cache; the cache then reaches LONG_SHARE, on the last layers, within it."""
    G, s = 1 << 30, model_shape(QWEN25_7B)
    lb = layer_bytes(s, 524288, 2, 16384, 0, seq=524288)
    memory = lambda: (10 * G, 140 * G, 12 * G)  # noqa: E731  device in use, device in all, host free
    c = Checkpoints(28, checkpoint_every=None, offload_checkpoints=None, attention_cache=None)
    c.reset(lb, memory)
    c.parked(0, lb["boundary"], memory)
    parked = sum(c.park.values())
    n = len(c.cached)
    assert c.share == LONG_SHARE and n > 1 and c.cached == frozenset(range(28 - n, 28))
    at_keep_share = place_cache(layers=28, cache_bytes=lb["cache"], ckpt_bytes=lb["boundary"], act=lb["act"],
                                lean=lb["act"] - lb["attn_out"], transient=lb["transient"], host_free=12 * G,
                                host_each=parked_bytes(lb["boundary"]),
                                device_free=KEEP_SHARE * 140 * G - DEVICE_RESERVE - (10 * G - lb["boundary"]))
    assert at_keep_share[0] < n
    worst = backward_peak(layers=28, block=c.block, parked=parked, cached=n, act=lb["act"], lean=lb["act"] - lb["attn_out"],
                          transient=lb["transient"], ckpt_bytes=lb["boundary"], cache_bytes=lb["cache"])
    assert sum(worst.values()) <= LONG_SHARE * 140 * G - DEVICE_RESERVE - (10 * G - lb["boundary"])
    assert parked * parked_bytes(lb["boundary"]) <= 12 * G


def test_planner_caches_at_long_context_and_predicts_a_shorter_step():
    """7B shape on the H200 profile at 256K: the cache goes to (almost) every recomputed layer, each cached
    recompute skips the attention forward, and the device total still fits."""
    kw = dict(batch=1, seq=262144, cast_on_device=True, placement="auto")
    off, on = plan(QWEN25_7B, attention_cache=False, **kw), plan(QWEN25_7B, **kw)
    assert off.attention_cached == 0 and "attention_cache" not in {k for k, v in off.device_bytes.items() if v}
    assert on.attention_cached >= 20 and on.fits_device and on.fits_host
    entry = 262144 * 28 * (128 * 2 + 4)  # the caches alive at the backward's worst block (backward_peak)
    assert on.device_bytes["attention_cache"] % entry == 0 and 0 < on.device_bytes["attention_cache"] <= on.attention_cached * entry
    assert on.layer_ms["recompute_cached"] < 0.9 * on.layer_ms["fwd"]
    assert on.step_ms < 0.95 * off.step_ms
    assert on.summary()["attention_cached"] == on.attention_cached


_CUDA = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


@pytest.mark.parametrize("backend", [pytest.param(b, marks=_CUDA) for b in ("cudnn", "flash", "efficient")])
def test_fused_kernels_replay_their_gradients_and_keep_only_output_and_lse_on_cuda(backend):
    """Each fused kernel (asked first, the others after it, as ``tiling._kernel`` does) at the 7B head
    layout: the replayed gradients are the kernel's own, and the entry holds no copy of q, k or v."""
    from megatrain_nb.step.tiling import _kernel

    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(1, h, 1024, 128, device="cuda", generator=g, dtype=torch.bfloat16) for h in (28, 4, 4))
    kw = dict(is_causal=True, enable_gqa=True)
    with _kernel(backend):
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        want = F.scaled_dot_product_attention(*leaves, **kw)
        dy = torch.randn_like(want)
        want.backward(dy)
        cache = AttentionCache()
        with torch.no_grad(), cache.capture(0, 0):
            F.scaled_dot_product_attention(q, k, v, **kw)
        kept = cache.nbytes
        re = [t.clone().requires_grad_() for t in (q, k, v)]
        with cache.replay(0, 0):
            got = F.scaled_dot_product_attention(*re, **kw)
        got.backward(dy)
    assert kept <= entry_bytes(tokens=1024, heads=28, head_dim=128, dtype_bytes=2) * 1.05 + 65536
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    for a, b in zip(re, leaves):
        torch.testing.assert_close(a.grad, b.grad, rtol=2e-2, atol=2e-3)  # fused backwards may sum in any order


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cached_attention_trains_like_the_recompute_on_cuda():
    cfg = make_config("qwen2", num_hidden_layers=4)
    batches = make_batches(cfg.vocab_size, 3, batch=2, seq=256)
    runs = {}
    for cached in (False, True):
        s = Session.from_config(cfg, seed=0, device="cuda", checkpoint_every=1, attention_cache=cached)
        runs[cached] = [s.step(b).loss for b in batches]
        assert s.activations["attention_cached"] == (4 if cached else 0)
        assert len(s.engine.attn_cache) == 0
        s.close()
    assert runs[True] == pytest.approx(runs[False], rel=2e-2)


def test_auto_caches_at_long_context_only_and_first_where_it_saves_more_per_byte():
    """attention_cache=None: nothing at 4096 tokens (short-context policies stay as they were), the cache
    from ~22K on the 7B shape; before kept layers where the attention's share of a forward per cache byte
    beats a whole forward per kept byte."""
    s = model_shape(QWEN25_7B)
    lb = {T: layer_bytes(s, T, 2, 16384 if T > 65536 else 0, 121 * 1024, seq=T) for T in (4096, 32768, 262144)}
    assert cache_bytes(lb[4096], None) == 0 and cache_bytes(lb[4096], True) == lb[4096]["cache"] > 0
    assert cache_bytes(lb[32768], None) == lb[32768]["cache"] and cache_bytes(lb[262144], False) == 0
    assert lb[262144]["attn_share"] > 0.75 and lb[4096]["attn_share"] < 0.1
    assert cache_first(lb[262144]) == lb[262144]["cache"]  # a kept tiled layer costs 8x the bytes of a cache
    assert cache_first({**lb[4096], "act": 2 * lb[4096]["boundary"]}) == 0  # a cheap layer to keep: keep it


def test_layer_memory_bench_counts_the_cache_as_the_estimate_on_the_cpu(tmp_path):
    """bench/layer_memory.py (the H200's measure of act / transient / cache against longcontext's
    estimates): on the CPU its rows carry the estimates and the cache's bytes, equal to entry_bytes."""
    import json
    import runpy
    import sys

    out = tmp_path / "rows.jsonl"
    argv = sys.argv
    sys.argv = ["layer_memory.py", "--device", "cpu", "--shape", "tiny", "--seq", "512", "--rows", "128", "--out", str(out)]
    try:
        runpy.run_path(str(__import__("pathlib").Path(__file__).parents[2] / "bench" / "layer_memory.py"), run_name="__main__")
    finally:
        sys.argv = argv
    (row,) = [json.loads(ln) for ln in out.read_text().splitlines()]
    assert row["status"] == "ok" and row["rows"] == 128
    assert row["cache"] == row["est_cache"] == entry_bytes(tokens=512, heads=4, head_dim=16, dtype_bytes=4)
    assert row["est_act_cached"] < row["est_act"] and row["est_transient"] > 0


def test_cache_placement_matches_a_brute_force_search():
    """``place_cache`` against trying every cached count, block length and parked count on small random
    cases: the same most-cached count, and for it the same block rule (the shortest block parking nothing,
    else the fewest parked inputs, the shorter block on a tie)."""
    import random

    rng = random.Random(0)
    for _ in range(300):
        layers = rng.randint(1, 12)
        kw = dict(act=rng.randint(2, 9), transient=rng.randint(0, 6), ckpt_bytes=rng.randint(1, 3),
                  cache_bytes=rng.randint(1, 4))
        kw["lean"] = kw["act"] - rng.randint(0, 2)
        device_free, host_free = rng.randint(5, 90), rng.randint(-2, 8)
        block = rng.choice([None, None, 1, 2, 3])

        def fits(n, K, p):
            return (p == 0 or p <= host_free) and sum(backward_peak(layers=layers, block=K, parked=p, cached=n,
                                                                    **kw).values()) <= device_free
        want = None
        for n in range(layers, -1, -1):
            options = [(K, min(p for p in range(-(-layers // K) + 1) if fits(n, K, p)))
                       for K in ([block] if block else range(1, MAX_BLOCK + 1))
                       if any(fits(n, K, p) for p in range(-(-layers // K) + 1))]
            if options:
                free_of_host = [o for o in options if o[1] == 0]
                want = (n, *(free_of_host[0] if free_of_host else min(options, key=lambda o: (o[1], o[0]))))
                break
        args = dict(layers=layers, ckpt_bytes=kw["ckpt_bytes"], cache_bytes=kw["cache_bytes"], act=kw["act"],
                    lean=kw["lean"], transient=kw["transient"], device_free=device_free, host_free=host_free,
                    host_each=1, block=block)
        if want is None:
            with pytest.raises(PlacementError):
                place_cache(**args)
        else:
            assert place_cache(**args) == want, (args, want)
