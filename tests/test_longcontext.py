"""Tests for megatrain_nb.longcontext (checkpoint placement) and plan()'s long-context predictions."""
from __future__ import annotations

import dataclasses
import warnings

import pytest

from megatrain_nb.longcontext import PlacementError, keep_cap, pinned_bytes, place_checkpoints
from megatrain_nb.planner import H200, plan
from test_planner import QWEN25_7B


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


def test_pinned_bytes_round_up_to_a_power_of_two():
    assert [pinned_bytes(n) for n in (1, 4096, 4097, 3 << 30)] == [1, 4096, 8192, 4 << 30]


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


def test_256k_fits_the_h200_and_512k_says_what_would():
    p = _plan(262144)
    assert p.fits_device and p.fits_host and p.recomputed_layers >= 20
    assert sum(p.device_bytes.values()) <= H200.device_mem_bytes
    big = _plan(524288)
    assert not big.fits_device and big.advice and big.advice[0].startswith("Device: needs")
    assert big.advice[-1].startswith("Fits with")
    gh200 = dataclasses.replace(H200, host_mem_bytes=480 << 30, name="H200 with the paper's 480 GB host")
    roomy = plan(QWEN25_7B, batch=1, seq=524288, cast_on_device=True, hardware=gh200)
    assert roomy.fits_device and roomy.fits_host and roomy.parked > 0  # the host takes the checkpoints
    assert roomy.host_bytes["parked_checkpoints"] == roomy.parked * (4 << 30)  # 3.5 GiB each, pinned: 4 GiB


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
        old = plan(QWEN25_7B, batch=1, seq=seq, tile_tokens=0, offload_checkpoints=False, lean_activations=False)
        assert old.step_ms / 1e3 == pytest.approx(measured, rel=0.10)
