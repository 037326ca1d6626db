"""Tests for megatrain_nb.machine.longcontext (checkpoint placement) and plan()'s long-context predictions."""
from __future__ import annotations

import dataclasses
import warnings

import pytest

from helpers import QWEN25_7B
from megatrain_nb.machine.longcontext import (DEVICE_RESERVE, Checkpoints, PlacementError, keep_cap, pinned_bytes,
                                      place_checkpoints, shares)
from megatrain_nb.machine.planner import H200, plan


def test_device_first_then_host_then_longer_blocks():
    r = lambda k: 10 * k  # noqa: E731  backward working set with blocks of k
    assert place_checkpoints(layers=28, ckpt_bytes=1, device_free=40, reserve=r, host_free=0, host_each=1) == (1, 0)
    assert place_checkpoints(layers=28, ckpt_bytes=1, device_free=30, reserve=r, host_free=8, host_each=1) == (2, 4)
    assert place_checkpoints(layers=28, ckpt_bytes=1, device_free=30, reserve=r, host_free=8, host_each=1,
                             block=1) == (1, 8)  # a fixed block length: only the host split is chosen
    with pytest.raises(PlacementError, match="fit nowhere.*blocks of 1: 28 inputs"):
        place_checkpoints(layers=28, ckpt_bytes=1, device_free=30, reserve=r, host_free=0, host_each=1, block=1)


def test_keep_cap_leaves_room_for_the_later_checkpoints():
    r = lambda k: 10 * k  # noqa: E731
    assert keep_cap(layers=4, act=5, boundary=1, used=0, budget=100, reserve=r, host_free=0, host_each=1) == 4
    # 28 layers of 5, budget 60: keeping 6 leaves 30 for 22 checkpoints + 10 of working set (2 short, and
    # blocks of 2 need 20 of working set); keeping 5 leaves 35 for 23 + 10
    cap = keep_cap(layers=28, act=5, boundary=1, used=0, budget=60, reserve=r, host_free=0, host_each=1)
    assert cap == 5
    place_checkpoints(layers=28 - cap, ckpt_bytes=1, device_free=60 - cap * 5, reserve=r, host_free=0, host_each=1)


def test_a_fixed_place_for_the_inputs_still_leaves_them_room():
    """offload_checkpoints=False keeps every block input on the device, so the kept layers leave the
    inputs room, as where it is automatic. Measured on the H200 under device_memory=24GiB, 7B x 8: with no
    cap the greedy rule kept 7 layers and the 21 inputs ran the backward out of memory at 23.67 GiB."""
    from megatrain_nb.machine.longcontext import layer_bytes
    from megatrain_nb.machine.shape import act_bytes_per_token, model_shape

    s, T, d = model_shape(QWEN25_7B), 8 * 4096, 2
    lb = layer_bytes(s, T, d, 16384, act_bytes_per_token(s, d, lean=False), seq=4096)
    total, used = 24 << 30, 4 << 30  # the budget; the slots, the head and the embedding rows
    for setting in (False, True):
        c = Checkpoints(s["layers"], checkpoint_every=None, offload_checkpoints=setting)
        c.reset(lb, lambda: (used, total, 0))  # no host room: True parks regardless (preflight counts it)
        assert c.cap < s["layers"]
        on_device = 0 if setting else (s["layers"] - c.cap) * lb["boundary"]
        assert used + 2 * lb["boundary"] + c.cap * lb["act"] + on_device + lb["act"] + lb["transient"] \
            <= c.share * total - DEVICE_RESERVE
    off = Checkpoints(s["layers"], checkpoint_every=None, offload_checkpoints=False)
    on = Checkpoints(s["layers"], checkpoint_every=None, offload_checkpoints=True)
    for c in (off, on):
        c.reset(lb, lambda: (used, total, 0))
    assert on.cap > off.cap  # inputs in host memory leave the device to kept layers
    pl = plan(QWEN25_7B, batch=8, seq=4096, optimizer_state="int8", device_memory="24GiB", offload_checkpoints=False)
    assert sum(pl.keep) <= off.cap and pl.fits_device


def test_nothing_parked_needs_no_host_ram():
    """On the H200 at 256K after 128K (2026-12-01) host RAM had -0.5 GiB to spare and every
    input fitted on the device: blocks of 1, none parked, is a placement, not an error."""
    r = lambda k: 10 * k  # noqa: E731
    assert place_checkpoints(layers=28, ckpt_bytes=1, device_free=40, reserve=r, host_free=-5, host_each=1) == (1, 0)
    with pytest.raises(PlacementError):
        place_checkpoints(layers=28, ckpt_bytes=1, device_free=30, reserve=r, host_free=-5, host_each=1)


def test_pinned_bytes_are_whole_pages_not_powers_of_two():
    assert [pinned_bytes(n) for n in (1, 4096, 4097, 7 << 29)] == [4096, 4096, 8192, 7 << 29]  # 3.5 GiB stays 3.5


def test_inputs_may_reach_the_long_share_only_where_they_fit_nowhere_else():
    """Note: [Device share]: activation_budget=None places at 0.85 while that fits, then at 0.95; a float fixes it."""
    G = 1 << 30
    assert shares(None) == (0.85, 0.95) and shares(0.7) == (0.7,)
    lb = {"act": 22 * G, "boundary": 7 * G // 2, "transient": 33 * G}  # the 7B shape at 512K, tiled
    def placed(budget, host_free):
        memory = lambda: (10 * G, 140 * G, host_free)  # noqa: E731  device in use, device in all, host free
        c = Checkpoints(28, checkpoint_every=None, offload_checkpoints=None, activation_budget=budget)
        c.reset(lb, memory)
        c.parked(0, lb["boundary"], memory)
        return c.share, c.block, sum(c.park.values())

    # 0.85: 117 GiB - 10 in use leaves 107 for inputs and the backward; 12 GiB of host takes 3 inputs: too few
    share, block, parked = placed(None, 12 * G)
    assert share == 0.95 and parked * lb["boundary"] <= 12 * G
    in_use = 10 * G - lb["boundary"]  # at the first block its input is in use, and one of the inputs placed
    assert 0.95 * 140 * G - DEVICE_RESERVE - in_use >= (14 - parked) * lb["boundary"] + block * lb["act"] + lb["transient"]
    assert placed(None, 200 * G)[0] == 0.85  # a host with room: the keep share suffices
    with pytest.raises(PlacementError):
        placed(0.85, 12 * G)  # fixed by the user: no second share


def _plan(seq, **kw):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return plan(QWEN25_7B, batch=1, seq=seq, cast_on_device=True, **kw)


def test_tiling_turns_on_with_the_context():
    assert _plan(32768).tile_rows == 0 and _plan(131072).tile_rows == 16384 and _plan(262144).tile_rows == 16384
    assert _plan(131072, lean_activations=True).tile_rows == 0  # lean: a smaller untiled layer, tiled later
    assert _plan(131072).settings["lean_activations"] is False  # auto: tiling takes the long-context layer
    assert _plan(131072, tile_tokens=0).tile_rows == 0
    tiled, plain = _plan(262144), _plan(262144, tile_tokens=0)
    per_layer = lambda p: p.device_bytes["recompute_workspace"] / p.block  # noqa: E731
    assert per_layer(tiled) < per_layer(plain) / 2  # 6.3 vs 17.9 hidden-sizes of bytes per token (lean; 32 without)


def test_256k_and_512k_fit_the_h200_with_defaults_and_a_fixed_share_says_what_would():
    p = _plan(262144)
    assert p.fits_device and p.fits_host and p.recomputed_layers >= 20
    assert sum(p.device_bytes.values()) <= H200.device_mem_bytes
    big = _plan(524288)
    assert big.fits_device and big.fits_host and big.parked > 0 and not big.advice  # inputs at 0.95 (Note: [Device share])
    assert sum(big.device_bytes.values()) > 0.85 * H200.device_mem_bytes
    fixed = _plan(524288, activation_budget=0.85, grad_ring=False)  # gradient slabs: 15 GiB less host RAM to park in
    assert not fixed.fits_device and fixed.advice and fixed.advice[0].startswith("Device: needs")
    ringed = _plan(524288, activation_budget=0.85)  # the ring frees that host RAM: some inputs park there instead
    assert ringed.fits_device and ringed.fits_host and ringed.parked > 0
    assert fixed.advice[-1].startswith("Fits with") and "activation_budget=0.95" in fixed.advice[-1]
    gh200 = dataclasses.replace(H200, host_mem_bytes=480 << 30, name="H200 with the paper's 480 GB host")
    roomy = plan(QWEN25_7B, batch=1, seq=524288, cast_on_device=True, hardware=gh200)
    assert roomy.fits_device and roomy.fits_host and roomy.parked > 0  # the host takes the checkpoints
    assert roomy.host_bytes["parked_checkpoints"] == roomy.parked * (7 << 29)  # 3.5 GiB each: 56 whole 64 MiB chunks


def test_attention_makes_step_time_grow_with_the_square_of_the_context():
    t = {s: _plan(s).step_ms for s in (131072, 262144)}
    assert 3.2 < t[262144] / t[131072] < 4.0  # mostly attention (x4), partly linear (x2)
    p = _plan(262144)
    flops = 6 * p.shape["n_params"] * 262144 + 12 * 28 * 3584 * 262144 ** 2
    assert p.paper_tflops == pytest.approx(flops / p.step_ms / 1e9)
    assert p.summary()["paper_tflops"] == p.paper_tflops


def test_attention_is_counted_once_and_fits_the_rows_measured_before_tiling():
    """Note: [Attention time]: keys within 4096 at the layer rate (main's model), the rest at attn_tflops."""
    short = plan(QWEN25_7B, batch=4, seq=4096)
    main_model = plan(QWEN25_7B, batch=4, seq=4096, hardware=dataclasses.replace(H200, attn_tflops=None))
    assert short.layer_ms == main_model.layer_ms  # at 4096 nothing beyond the layer rate's attention
    T, q = 32768, 28 * 128
    p = _plan(T, tile_tokens=0, lean_activations=False)  # lean adds its own backward time (LEAN_COST)
    elementwise = T * (3584 + 18944) * H200.elementwise_s_per_token_dim * 1e3
    near = (2 * 233_057_792 * T + 2 * T * 4096 * q) / (H200.bf16_tflops * 1e9)
    far = 2 * T * (T - 4096) * q / (H200.attn_tflops * 1e9)
    assert p.layer_ms["fwd"] == pytest.approx(near + far + elementwise / 3)
    assert p.layer_ms["bwd"] == pytest.approx(2 * near + 2.5 * far + 2 * elementwise / 3)
    # LIMITS.md: 7B x 1, default settings before tiling, checkpoint placement and lean: 32K 5.06 s, 128K 42.7 s
    for seq, measured in ((32768, 5.06), (131072, 42.7)):
        old = plan(QWEN25_7B, batch=1, seq=seq, tile_tokens=0, offload_checkpoints=False, lean_activations=False,
                   attention_cache=False)  # nor an attention cache
        assert old.step_ms / 1e3 == pytest.approx(measured, rel=0.10)


@pytest.mark.gpu
@pytest.mark.skipif(not __import__("torch").cuda.is_available(), reason="needs CUDA")
def test_exact_pinned_buffers_are_page_locked_copy_asynchronously_and_go_back():
    """transfers.pinned_exact: registered at its size, non_blocking copies both ways, freed with the tensor."""
    import gc

    import psutil
    import torch

    from megatrain_nb.step.transfers import pinned_exact

    n = (3 << 27) + 5  # 1.5 GiB + 20 bytes of int32: torch's pinned allocator would take 2 GiB
    before = psutil.Process().memory_info().rss
    buf = pinned_exact(n, torch.int32)
    assert buf.is_pinned() and buf.numel() == n
    grown = psutil.Process().memory_info().rss - before
    assert (3 << 29) <= grown < (3 << 29) + (256 << 20)  # the pages are locked in, no more than them
    src = torch.arange(n, device="cuda", dtype=torch.int32)
    s = torch.cuda.Stream()
    with torch.cuda.stream(s):
        s.wait_stream(torch.cuda.current_stream())
        buf.copy_(src, non_blocking=True)
        back = torch.empty_like(src).copy_(buf, non_blocking=True)
    s.synchronize()
    assert torch.equal(back, src) and buf[-1].item() == n - 1
    del buf
    gc.collect()
    assert psutil.Process().memory_info().rss - before < (256 << 20)  # unregistered and back to the OS


def test_host_chunks_are_made_once_and_handed_back_for_reuse():
    """transfers.HostChunks (Note: [Parked chunks]): whole chunks per input, idle bytes counted, no new chunk
    while idle ones cover a request; an Offload's release gives its inputs' chunks back."""
    import torch

    from megatrain_nb.step.transfers import HostChunks, Offload, Streams

    dev = Streams(torch.device("cpu"))
    pool = HostChunks(dev, chunk_bytes=100)
    a = pool.take(250)  # three chunks, the last one half used
    assert len(a) == 3 and pool.made == 3 and pool.idle_bytes == 0 and all(c.numel() == 100 for c in a)
    pool.give(a)
    assert pool.idle_bytes == 300
    b = pool.take(420)  # the three idle ones and two new
    assert len(b) == 5 and pool.made == 5 and pool.idle_bytes == 0 and all(any(c is x for x in b) for c in a)

    class Rec:  # the trace recorder's two calls Offload makes
        def cuda_begin(self, *a):
            return None

        def cuda_end(self, *a):
            pass

    off = Offload(dev, Rec())
    off.pool.chunk_bytes = 64
    h = torch.arange(50, dtype=torch.float32).view(5, 10)  # 200 bytes: four chunks, the last one 8 bytes
    off.park(3, [h])
    assert off.take(3)[0].equal(h) and off.pool.made == 4
    off.release()
    assert off.pool.idle_bytes == 4 * 64 and not off.host
    off.park(5, [h * 2])
    assert off.take(5)[0].equal(h * 2) and off.pool.made == 4  # the released chunks again


def test_activation_budget_none_is_the_default_and_bad_values_are_named():
    from megatrain_nb.config import EngineConfig

    assert EngineConfig().activation_budget is None and EngineConfig().keep_share == 0.85
    assert EngineConfig(activation_budget=0.7).keep_share == 0.7
    for bad in (0, 1.5, -0.1):
        with pytest.raises(ValueError, match=f"activation_budget={bad!r}: a fraction in"):
            EngineConfig(activation_budget=bad)
    with pytest.raises(ValueError, match="activation_budget must be a fraction"):
        _plan(4096, activation_budget=2.0)


def test_session_reports_its_activation_policy():
    import torch

    from conftest import make_config
    from megatrain_nb import Session

    s = Session.from_config(make_config("llama", num_hidden_layers=3), seed=0, checkpoint_every=1, offload_checkpoints=True)
    assert s.activations == {}
    s.step({"input_ids": torch.zeros(1, 16, dtype=torch.long)})
    a = s.activations
    assert (a["tokens"], a["kept_layers"], a["recomputed_layers"], a["block"]) == (16, 0, 3, 1)
    assert a["parked_inputs"] == [0, 1, 2] and a["tile_rows"] == 0 and a["device_share"] == 0.85
    assert a["lean"] is False and "lean_activations" in a["lean_reason"]
    s.close()
