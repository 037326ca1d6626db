"""Tests for megatrain_nb.step.tiling: tiled equals untiled (function, layer, whole training vs HF + AdamW at a
sequence far longer than the hidden size), the T x T refusals, the named attention kernel."""
from __future__ import annotations

import pytest
import torch

from conftest import make_batches, make_config, rel
from helpers import compare
from megatrain_nb import Session
from megatrain_nb.step import tiling
from megatrain_nb.model.hf import load_architecture
from megatrain_nb.step.tiling import LongContextError, SequenceTiling, Tiled, tile_layer


def _bound(layer, seed=0):
    """Real fp32 parameters for a meta layer template: name -> leaf."""
    g = torch.Generator().manual_seed(seed)
    return {n: (torch.randn(p.shape, generator=g) * 0.2).requires_grad_() for n, p in layer.named_parameters()}


@pytest.mark.parametrize("part", ["mlp", "input_layernorm"])
def test_tiled_function_equals_the_plain_module(part):
    arch = load_architecture(make_config("qwen2", hidden_size=64, intermediate_size=128))
    mod = getattr(arch.templates[0], part)
    params = _bound(mod)
    x = torch.randn(300, 64, requires_grad=True)
    fn = lambda xc, ps: torch.func.functional_call(mod, dict(zip(params, ps)), (xc,))  # noqa: E731
    y = Tiled.apply(fn, 64, x, *params.values())
    gy = torch.randn_like(y)
    got = torch.autograd.grad(y, [x, *params.values()], gy)
    y0 = torch.func.functional_call(mod, params, (x,))
    want = torch.autograd.grad(y0, [x, *params.values()], gy)
    torch.testing.assert_close(y, y0, rtol=1e-6, atol=1e-6)
    for a, b in zip(got, want):  # the tiles sum a weight's gradient in another order: fp32 rounding apart
        assert rel(a, b) <= 1e-6


def test_tile_layer_wraps_norms_and_dense_mlp_only():
    dense = load_architecture(make_config("qwen2"))
    assert tile_layer(dense.templates[0]) == ["input_layernorm", "mlp", "post_attention_layernorm"]
    assert tile_layer(dense.templates[0]) == ["input_layernorm", "mlp", "post_attention_layernorm"]  # idempotent
    moe = load_architecture(make_config("mixtral"))
    assert "mlp" not in tile_layer(moe.templates[0])


def test_a_tiled_layer_equals_the_untiled_layer_bitwise_in_forward():
    """The wrapped template run above the tile size gives HF's layer output (fp32, CPU)."""
    cfg = make_config("llama", hidden_size=64, intermediate_size=128)
    plain, tiled = load_architecture(cfg), load_architecture(cfg)
    tiler = SequenceTiling(tiled, tile_tokens=32, attention_backend=None, device="cpu", dtype_bytes=4)
    mbs = [{"input_ids": torch.zeros(1, 200, dtype=torch.long), "attention_mask": None}]
    tiler.prepare(mbs)
    assert tiler.rows == 32
    params = _bound(plain.templates[0])
    x = torch.randn(1, 200, 64)
    with torch.no_grad():
        h0, calls = plain.prelude(x, None)
        want = torch.func.functional_call(plain.templates[0], params, (h0, *calls[0][0]), calls[0][1])
        _, calls_t = tiled.prelude(x, None)
        got = torch.func.functional_call(tiled.templates[0], params, (h0, *calls_t[0][0]), calls_t[0][1])
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("family, engine", [
    ("qwen2", dict(tile_tokens=64)),  # every layer kept (CPU): tiles' weights come back through SlotRefs
    ("qwen2", dict(tile_tokens=64, checkpoint_every=1)),  # recomputed layers, tiled inside
    ("llama", dict(tile_tokens=48, checkpoint_every=2, micro_batch_size=1, offload_checkpoints=True)),
])
def test_long_sequence_trains_like_hf(hf_dir, family, engine, tmp_path, monkeypatch):
    """seq 384 >> hidden 32: the tiled, streamed model trains equal to HF + torch.optim.AdamW."""
    calls = []
    apply = Tiled.apply
    monkeypatch.setattr(Tiled, "apply", lambda *a: calls.append(a[1]) or apply(*a))
    compare(hf_dir(family, max_position_embeddings=512), family, tmp_path, steps=3, batch=2, seq=384, **engine)
    assert calls and set(calls) == {engine["tile_tokens"]}, "tiling never ran: the test compared nothing tiled"


def test_padding_at_long_context_is_refused_before_anything_changes(monkeypatch):
    monkeypatch.setattr(tiling, "MASK_LIMIT_BYTES", 1000)  # a (1, 1, 64, 64) mask is 4096 bytes
    cfg = make_config("llama")
    s = Session.from_config(cfg, seed=0, device="cpu")
    before = [s.store.units[u].master.clone() for u in s.store.order]
    b = make_batches(cfg.vocab_size, 1, batch=2, seq=40, pad_id=0)[0]
    with pytest.raises(LongContextError, match=r"padding in attention_mask.*\(b, 1, T, T\) attention mask"):
        s.step(b)
    s.engine.drain()
    assert s.engine.steps_done == 0 and not s.history
    assert all(torch.equal(a, s.store.units[u].master) for a, u in zip(before, s.store.order))
    b["attention_mask"] = torch.ones_like(b["input_ids"])  # all ones: the same as no mask, so it runs
    assert s.step(b).loss > 0
    s.close()


def test_eager_attention_at_long_context_is_refused(monkeypatch):
    monkeypatch.setattr(tiling, "MASK_LIMIT_BYTES", 1000)
    cfg = make_config("gemma2")  # eager: T x T scores per head
    s = Session.from_config(cfg, seed=0, device="cpu")
    with pytest.raises(LongContextError, match="eager attention"):
        s.step({"input_ids": torch.zeros(1, 64, dtype=torch.long)})
    s.close()


def test_attention_kernel_is_chosen_and_named(monkeypatch):
    cfg = make_config("llama")
    s = Session.from_config(cfg, seed=0, device="cpu")
    s.step({"input_ids": torch.zeros(1, 16, dtype=torch.long)})
    assert s.engine.tiler.backend is None  # short: torch's own choice, as the HF model
    monkeypatch.setattr(tiling, "MASK_LIMIT_BYTES", 1000)
    s.step({"input_ids": torch.zeros(1, 32, dtype=torch.long)})
    assert s.engine.tiler.backend == "flash"  # long: CPU has one fused kernel
    s.close()
    assert tiling.chosen_backend(cfg, "cpu", 4, "efficient") == "flash"  # tried first; CPU lacks it: the next fused one
    from torch.nn.attention import SDPBackend, sdpa_kernel

    monkeypatch.setattr(tiling, "_kernel", lambda setting: sdpa_kernel([SDPBackend.EFFICIENT_ATTENTION]))
    with pytest.raises(LongContextError, match="no fused attention kernel"):
        tiling.chosen_backend(cfg, "cpu", 4)


def test_mixed_device_and_host_checkpoints_train_bitwise_like_device_checkpoints():
    """Some block inputs parked, the others on the device (as Checkpoints._place decides on CUDA): same bits."""
    cfg = make_config("llama", num_hidden_layers=5)
    batches = make_batches(cfg.vocab_size, 3, batch=2, seq=10)
    runs = {}
    for mixed in (False, True):
        s = Session.from_config(cfg, seed=0, checkpoint_every=1)
        if mixed:
            s.engine.ckpts._place = lambda i0, n, memory: {i: i % 2 == 0 for i in range(i0, 5)}  # noqa: E731
        runs[mixed] = [s.step(b).loss for b in batches]
        s.engine.drain()
        runs[(mixed, "w")] = [s.store.units[u].master.clone() for u in s.store.order]
        if mixed:
            assert s.engine.ckpts.park == {0: True, 1: False, 2: True, 3: False, 4: True}
            assert not s.engine.offload.parked and not s.engine.offload.fetched  # every park came back
        s.close()
    assert runs[True] == runs[False]
    assert all(torch.equal(a, b) for a, b in zip(runs[(True, "w")], runs[(False, "w")]))


def test_config_validates_the_new_settings():
    from megatrain_nb.config import EngineConfig

    with pytest.raises(ValueError, match="tile_tokens=-1"):
        EngineConfig(tile_tokens=-1)
    with pytest.raises(ValueError, match="attention_backend='fast'"):
        EngineConfig(attention_backend="fast")


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=[
    pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")])])
def test_parked_inputs_split_across_reused_host_chunks_train_bitwise_like_device_ones(device):
    """Note: [Parked chunks]: each parked input spans whole host chunks; a longer context reuses the shorter
    one's chunks (on the H200, 512K after 256K found the 256K buffers still counted in use) and the dE
    buffer in the compute dtype is made anew, the old one freed."""
    import gc
    import math
    import weakref

    cfg = make_config("llama", num_hidden_layers=3)
    H, got = cfg.hidden_size, {}
    for offload in (False, True):
        s = Session.from_config(cfg, seed=0, checkpoint_every=1, offload_checkpoints=offload, device=device,
                                placement="host")  # auto on CUDA keeps the embedding resident: no host dE
        e, d = s.engine, s.engine.dtype.itemsize
        e.offload.pool.chunk_bytes = 1000  # an input of 16 x H fp32 spans several chunks, the last one partly
        losses = [s.step({"input_ids": torch.arange(16).view(1, 16) % cfg.vocab_size}).loss]
        if offload:
            per_input = math.ceil(16 * H * d / 1000)
            assert e.offload.pool.made == 3 * per_input and not e.offload.pool.idle
            old_dE = weakref.ref(e._dE_host)
        e.keep = None  # what more tokens do under checkpoint_every=None: the placement is chosen again
        e._place_checkpoints([{"input_ids": torch.zeros(1, 64, dtype=torch.long)}])
        if offload:
            assert e.offload.pool.idle_bytes == 3 * per_input * 1000  # given back, counted free for the next
        losses.append(s.step({"input_ids": torch.arange(64).view(1, 64) % cfg.vocab_size}).loss)
        if offload:
            gc.collect()
            assert old_dE() is None and e._dE_host.numel() == 64 * H and e._dE_host.dtype == e.dtype
            assert e.offload.pool.made == 3 * math.ceil(64 * H * d / 1000) and not e.offload.pool.idle  # reused
        s.engine.drain()
        got[offload] = (losses, [s.store.units[u].master.clone() for u in s.store.order])
        s.close()
    assert got[True][0] == got[False][0]
    assert all(torch.equal(a, b) for a, b in zip(got[True][1], got[False][1]))
