"""Tests for megatrain_nb.step.lean: lean activations train equal to HF + AdamW (dense, GeGLU, MoE, with
recompute and under sequence tiling), lean on equals lean off (bitwise in bf16, fp32 rounding apart in
fp32), the bytes a layer keeps shrink by the planner's formula, unknown layers are left alone, bad input.

Tolerances: against HF + torch.optim.AdamW those of tests/test_equivalence.py (rel 1e-5). Lean on vs
off in fp32: rel 1e-6 (a norm's fp32 input gets its three gradient terms summed in another order:
HF sums them in the outer graph, lean inside the norm's own backward; in bf16 the norm's input is
cast to fp32 first, so both sum the same two terms and the runs are bitwise equal).
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from conftest import make_batches, make_config, rel
from megatrain_nb import Session
from megatrain_nb.step import lean
from megatrain_nb.config import EngineConfig
from megatrain_nb.model.hf import load_architecture
from megatrain_nb.step.lean import GatedDown, layer_bytes_per_token, lean_layer
from megatrain_nb.machine.planner import act_bytes_per_token, model_shape, plan
from megatrain_nb.step.tiling import Tiled, tile_layer
from test_equivalence import compare


@pytest.fixture
def counted(monkeypatch):
    """Counts of GatedDown.apply and of Tiled.apply by rows per tile, for what ran."""
    calls = {"mlp": 0, "tiled": []}
    down, tiled = GatedDown.apply, Tiled.apply
    monkeypatch.setattr(GatedDown, "apply", lambda *a: calls.__setitem__("mlp", calls["mlp"] + 1) or down(*a))
    monkeypatch.setattr(Tiled, "apply", lambda *a: calls["tiled"].append(a[1]) or tiled(*a))
    return calls


# ---- equal to HF + AdamW ----------------------------------------------------------------------
@pytest.mark.parametrize("family", ["llama", "qwen2", "gemma2", "mixtral"])
def test_lean_trains_like_hf(hf_dir, family, tmp_path, counted):
    """qwen2: q/k/v biases; gemma2: GeGLU (gelu tanh) and four norms a layer; mixtral: experts left alone."""
    compare(hf_dir(family), family, tmp_path, steps=4, lean_activations=True)
    assert counted["tiled"], "no lean norm ran"
    if family == "mixtral":
        assert counted["mlp"] == 0, "lean touched the MoE block"
    else:
        assert counted["mlp"] > 0, "no lean MLP ran: the test compared nothing lean"


@pytest.mark.parametrize("engine", [dict(checkpoint_every=1), dict(checkpoint_every=2, micro_batch_size=1)])
def test_lean_with_recompute_trains_like_hf(hf_dir, tmp_path, counted, engine):
    compare(hf_dir("qwen2"), "qwen2", tmp_path, steps=4, lean_activations=True, **engine)
    assert counted["mlp"] > 0


def test_tiling_wins_where_it_runs(hf_dir, tmp_path, counted):
    """seq 384 x 2 rows > tile_tokens: every norm and MLP runs tiled (64 rows), none lean; equal to HF."""
    compare(hf_dir("llama", max_position_embeddings=512), "llama", tmp_path, steps=3, batch=2, seq=384,
            tile_tokens=64, lean_activations=True)
    assert counted["mlp"] == 0 and counted["tiled"] and set(counted["tiled"]) == {64}


def test_below_the_tile_size_lean_runs(hf_dir, tmp_path, counted):
    """tile_tokens above the micro-batch: tiling stays plain, and its plain forward is lean's."""
    compare(hf_dir("llama"), "llama", tmp_path, steps=3, tile_tokens=1000, lean_activations=True)
    assert counted["mlp"] > 0 and counted["tiled"] and 1000 not in counted["tiled"]


# ---- lean on equals lean off ----------------------------------------------------------------------
def _train(cfg, lean_on: bool, dtype, steps=3, **engine):
    s = Session.from_config(cfg, seed=0, dtype=dtype, lean_activations=lean_on, **engine)
    try:
        losses = [s.step(b).loss for b in make_batches(cfg.vocab_size, steps, batch=2, seq=12)]
        s.engine.drain()
        return losses, [s.store.units[u].master.clone() for u in s.store.order]
    finally:
        s.close()


@pytest.mark.parametrize("family", ["llama", "qwen2", "gemma2", "mixtral"])
def test_on_equals_off_bitwise_in_bf16(family):
    cfg = make_config(family)
    (l0, w0), (l1, w1) = _train(cfg, False, torch.bfloat16), _train(cfg, True, torch.bfloat16)
    assert l0 == l1
    assert all(torch.equal(a, b) for a, b in zip(w0, w1))


@pytest.mark.parametrize("family", ["llama", "qwen2", "mixtral"])
def test_on_equals_off_in_fp32(family):
    cfg = make_config(family)
    (l0, w0), (l1, w1) = _train(cfg, False, torch.float32), _train(cfg, True, torch.float32)
    assert max(abs(a - b) / abs(b) for a, b in zip(l0, l1)) <= 1e-6
    assert max(rel(a, b) for a, b in zip(w1, w0)) <= 1e-6


def test_one_layer_gradients_bitwise_in_bf16_and_close_in_fp32():
    """The layer alone: output and every gradient; in fp32 only what flows through a norm's input differs."""
    cfg = make_config("qwen2", hidden_size=64, intermediate_size=160)
    for dtype in (torch.bfloat16, torch.float32):
        got = {}
        for on in (False, True):
            arch = load_architecture(cfg)
            lean.prepare(arch, on)
            g = torch.Generator().manual_seed(0)
            ps = {n: (torch.randn(p.shape, generator=g) * 0.2).to(dtype).requires_grad_()
                  for n, p in arch.templates[0].named_parameters()}
            x = torch.randn(2, 20, 64, generator=g).to(dtype).requires_grad_()
            h0, calls = arch.prelude(x, None)
            y = torch.func.functional_call(arch.templates[0], ps, (h0, *calls[0][0]), calls[0][1])
            y = y[0] if isinstance(y, tuple) else y
            y.backward(torch.randn(y.shape, generator=g).to(dtype))
            got[on] = [y.detach(), x.grad] + [p.grad for p in ps.values()]
        if dtype == torch.bfloat16:
            assert all(torch.equal(a, b) for a, b in zip(got[False], got[True]))
        else:
            assert torch.equal(got[False][0], got[True][0])
            assert max(rel(a, b) for a, b in zip(got[True], got[False])) <= 1e-6


# ---- what a layer keeps ---------------------------------------------------------------------
@pytest.mark.parametrize("family, dtype", [("qwen2", torch.bfloat16), ("qwen2", torch.float32),
                                           ("llama", torch.bfloat16), ("mixtral", torch.bfloat16)])
def test_saved_bytes_shrink_by_the_notes_formula(family, dtype):
    """Measured with saved_tensors_hooks (unique storages, weights and rotary cos/sin excluded).

    Reduction: 8*hidden + 2*d*I (dense) or 8*hidden (MoE) per token, the planner's Note, plus the two
    norms' fp32 1/rms (4 bytes per token each), which the Note leaves out. The estimate with lean is at
    most 10% above the measured bytes: it counts o_proj's input as a copy of the attention output (it
    is one on CUDA, a view on the CPU) and 4 bytes of 1/rms less per norm. Dense layers only: for MoE
    the estimate leaves out the router's and the token dispatch's tensors, untouched by lean.
    """
    cfg = make_config(family, hidden_size=64, intermediate_size=160)
    d = dtype.itemsize
    hf = layer_bytes_per_token(cfg, lean=False, dtype=dtype)
    lean_b = layer_bytes_per_token(cfg, lean=True, dtype=dtype)
    s = model_shape(cfg)
    formula = 8 * s["hidden"] + (0 if s["experts"] else 2 * d * s["intermediate"])
    assert hf - lean_b == formula + 2 * 4, (hf, lean_b, formula)
    assert act_bytes_per_token(s, d, lean=False) - act_bytes_per_token(s, d, lean=True) == formula
    est = act_bytes_per_token(s, d, lean=True)
    if not s["experts"]:  # MoE: the estimate leaves out the router's and the dispatch's tensors (not lean's)
        assert lean_b <= est <= 1.10 * lean_b, (est, lean_b)


def test_planner_keeps_more_layers_with_lean():
    """3B shape x 8 x 4096 on the H200 profile: fewer recomputed layers with lean, fewer kept bytes each."""
    cfg = dict(hidden_size=2048, intermediate_size=11008, num_hidden_layers=36, num_attention_heads=16,
               num_key_value_heads=2, vocab_size=151936, tie_word_embeddings=True, model_type="qwen2")
    on, off = plan(cfg, batch=8, seq=4096), plan(cfg, batch=8, seq=4096, lean_activations=False)
    assert on.settings["lean_activations"] and not off.settings["lean_activations"]
    assert on.recomputed_layers < off.recomputed_layers
    per_layer = lambda p: p.device_bytes["activations_kept"] / max(1, p.kept_layers)  # noqa: E731
    assert per_layer(on) == 8 * 4096 * act_bytes_per_token(model_shape(cfg), 2, lean=True)
    assert per_layer(off) == 8 * 4096 * act_bytes_per_token(model_shape(cfg), 2, lean=False)


def test_preflight_counts_lean_and_names_it_as_a_fix():
    from megatrain_nb.machine.preflight import _device_advice, estimate

    cfg = make_config("llama", hidden_size=64, intermediate_size=160)
    on, off = (estimate(cfg, EngineConfig(lean_activations=v, checkpoint_every=0), batch=2, seq=64) for v in (True, False))
    s = model_shape(cfg)
    saved = 2 * 64 * 2 * (8 * s["hidden"] + 2 * 4 * s["intermediate"])  # 2 layers x 128 tokens, fp32 on "cpu"
    assert off["device"]["activations"] - on["device"]["activations"] == saved
    assert any(a.startswith("lean_activations=True") for a in _device_advice(EngineConfig(lean_activations=False), 8, 4096, None))
    assert not any("lean" in a for a in _device_advice(EngineConfig(), 8, 4096, None))


# ---- what lean leaves alone ---------------------------------------------------------------------
class _Mlp(nn.Module):
    def __init__(self):
        super().__init__()
        self.gate_proj, self.up_proj, self.down_proj = nn.Linear(8, 16), nn.Linear(8, 16), nn.Linear(16, 8)
        self.act_fn = nn.SiLU()

    def forward(self, x):
        return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))


class _Lookalike(_Mlp):
    def forward(self, x):  # looks like a gated MLP, computes something else: lean must not replace it
        return self.down_proj(self.act_fn(self.up_proj(x)) * self.gate_proj(x))


class _Layer(nn.Module):
    def __init__(self, mlp: nn.Module):
        super().__init__()
        self.ln, self.fc1, self.fc2, self.mlp = nn.LayerNorm(8), nn.Linear(8, 16), nn.Linear(16, 8), mlp


def test_unrecognised_layers_are_left_as_they_are():
    odd = _Layer(_Lookalike())
    assert lean_layer(odd) == []  # LayerNorm, fc1/fc2 and a lookalike MLP: nothing lean
    assert all("forward" not in m.__dict__ for m in odd.modules())
    assert lean_layer(_Layer(_Mlp())) == ["mlp"]  # the real pattern, with biases
    phi = nn.Module()
    phi.mlp = nn.Module()
    phi.mlp.gate_up_proj, phi.mlp.down_proj = nn.Linear(8, 32), nn.Linear(16, 8)  # fused: not recognised
    assert lean_layer(phi) == []


def test_lean_mlp_with_biases_equals_the_module():
    m = _Mlp()
    x = torch.randn(2, 5, 8, requires_grad=True)
    y0 = m(x)
    g = torch.randn_like(y0)
    want = torch.autograd.grad(y0, [x, *m.parameters()], g)
    assert lean_layer(nn.ModuleDict({"mlp": m})) == ["mlp"]
    y1 = m(x)
    got = torch.autograd.grad(y1, [x, *m.parameters()], g)
    assert torch.equal(y0, y1)
    assert all(rel(a, b) <= 1e-6 for a, b in zip(got, want))  # addmm's bias sum vs ours: fp32 rounding apart


@pytest.mark.parametrize("act, kernel", [(nn.SiLU(), True), (nn.GELU(approximate="tanh"), True), (nn.GELU(), True),
                                         (lambda z: z * torch.sigmoid(z), False), (torch.tanh, False)])
def test_gated_down_equals_autograd_for_any_activation(act, kernel):
    """silu / gelu: autograd's own backward kernels, no nested graph (bitwise); others: autograd itself."""
    assert (lean.act_grad_of(act) is not None) == kernel
    for dtype in (torch.bfloat16, torch.float32):
        g = torch.Generator().manual_seed(0)
        gate, up = (torch.randn(2, 7, 24, generator=g).to(dtype).requires_grad_() for _ in range(2))
        w = (torch.randn(16, 24, generator=g) * 0.2).to(dtype).requires_grad_()
        gy = torch.randn(2, 7, 16, generator=g).to(dtype)
        y0 = F.linear(act(gate) * up, w)
        want = torch.autograd.grad(y0, [gate, up, w], gy)
        y1 = GatedDown.apply(act, lean.act_grad_of(act), gate, up, w)
        got = torch.autograd.grad(y1, [gate, up, w], gy)
        assert torch.equal(y0, y1)
        assert all(torch.equal(a, b) for a, b in zip(got, want)), dtype


def test_on_off_and_tiling_in_either_order():
    """lean_layer after tile_layer, and off again: the same forwards back, tiling's wrapper kept."""
    arch = load_architecture(make_config("qwen2"))
    t = arch.templates[0]
    names = ["input_layernorm", "mlp", "post_attention_layernorm"]
    assert tile_layer(t) == names
    assert lean_layer(t) == names and lean_layer(t) == names  # idempotent
    assert lean_layer(t, on=False) == [] and lean_layer(t, on=False) == []
    assert all(fwd.plain.__func__ is type(fwd.module).forward for fwd in (c.forward for c in t.children())
               if hasattr(fwd, "plain"))
    other = load_architecture(make_config("qwen2")).templates[0]
    assert lean_layer(other) == names and tile_layer(other) == names
    assert lean_layer(other, on=False) == [] and all(c.forward.plain.__func__ is type(c).forward
                                                       for n, c in other.named_children() if n in names)


def test_bad_setting_is_refused_with_its_name():
    with pytest.raises(ValueError, match=r"lean_activations='yes'.*True.*False"):
        EngineConfig(lean_activations="yes")
    with pytest.raises(ValueError, match="lean_activations=1"):
        Session.from_config(make_config("llama"), seed=0, lean_activations=1)
    with pytest.raises(ValueError, match="lean_activations must be None.*True or False"):
        plan(dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  vocab_size=100), batch=1, seq=16, lean_activations="yes")
    with pytest.raises(ValueError, match="lean_activations=None"):
        lean.prepare(load_architecture(make_config("llama")), None)


QWEN_3B_SHAPE = dict(hidden_size=2048, intermediate_size=11008, num_hidden_layers=36, num_attention_heads=16,
                     num_key_value_heads=2, vocab_size=151936, tie_word_embeddings=True)


def test_auto_is_lean_only_where_it_spares_recompute():
    """lean_activations=None: off on the CPU; with a device budget, on where the plain layers would be
    recomputed and lean keeps enough of them (Note: [Lean auto]); the planner decides alike."""
    s = Session.from_config(make_config("llama"), seed=0, lr=1e-3)
    try:
        s.step(make_batches(s.arch.config.vocab_size, 1)[0])
        assert s.engine.lean is False and "cpu" in s.engine.lean_reason
    finally:
        s.close()
    assert lean.choose(36, 26, 36) == (True, "keeps 10 more of 36 layers from recompute")
    assert not lean.choose(28, 6, 12)[0], "6 layers spared of 28: 2.0 layer-forwards against 2.24 of lean's cost"
    assert not lean.choose(28, 0, 20, large=True)[0], "long context: sequence tiling takes the norms and the MLP"
    shape, G = model_shape(QWEN_3B_SHAPE), 2**30
    room = (0.85 * 139.8 * G - 10 * G, 139.8 * G)  # the H200's activation budget less what the step holds
    assert lean.auto(shape, tokens=4 * 4096, dtype_bytes=2, room=room)[0] is False
    assert lean.auto(shape, tokens=8 * 4096, dtype_bytes=2, room=room)[0] is True
    assert lean.auto(shape, tokens=8 * 4096, dtype_bytes=2, room=room, tiled=True)[0] is False
    assert lean.auto(shape, tokens=8 * 4096, dtype_bytes=2, room=None)[0] is False
    assert plan(QWEN_3B_SHAPE, batch=4, seq=4096).settings["lean_activations"] is False  # every layer fits without it
    assert plan(QWEN_3B_SHAPE, batch=8, seq=4096).settings["lean_activations"] is True  # 10 layers spared


# ---- GPU ------------------------------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_lean_same_step_lower_peak():
    """Qwen2.5-3B width, 2 layers, bf16, every layer kept: one step lean on vs off.

    Bounds: gradients of each unit within rel 2^-7 (bf16 rounding of one matmul chain); weights after
    Adam's first step within 2*lr (a sign flip of a near-zero gradient). Peak allocated memory lower
    with lean. (Not by the whole formula, 2 layers x 8 * 2048 tokens x (8*hidden + 4*I) bytes: with two
    layers the peak is the last layer's backward, its working set beside the saved tensors; on the
    H200 this step measured 7.32 vs 6.96 GiB. The exact saving is counted on the CPU with saved-tensor
    hooks, test_saved_bytes_shrink_by_the_notes_formula; at scale, bench/throughput.py's peaks show it.)
    """
    from transformers import Qwen2Config

    cfg = Qwen2Config(hidden_size=2048, intermediate_size=11008, num_hidden_layers=2, num_attention_heads=16,
                      num_key_value_heads=2, vocab_size=8192, max_position_embeddings=4096, tie_word_embeddings=True)
    cfg._attn_implementation = "sdpa"
    lr, B, T = 1e-4, 8, 2048
    ids = torch.randint(0, 8192, (B, T), generator=torch.Generator().manual_seed(0))
    runs = {}
    for on in (False, True):
        torch.cuda.empty_cache()
        s = Session.from_config(cfg, seed=0, device="cuda", lr=lr, checkpoint_every=0, placement="host",
                                lean_activations=on)
        torch.cuda.reset_peak_memory_stats()
        loss = s.step({"input_ids": ids}).loss
        s.engine.drain()
        peak = torch.cuda.max_memory_allocated()
        grads = [s.store.units[u].grad.float().clone() for u in s.store.order]
        weights = [s.store.units[u].master.clone() for u in s.store.order]
        runs[on] = (loss, peak, grads, weights)
        s.close()
    (l0, p0, g0, w0), (l1, p1, g1, w1) = runs[False], runs[True]
    saved = 2 * B * T * (8 * 2048 + 4 * 11008)
    worst_g = max(rel(a, b) for a, b in zip(g1, g0))
    worst_w = max((a - b).abs().max().item() for a, b in zip(w1, w0))
    bitwise = all(torch.equal(a, b) for a, b in zip(g1, g0))
    print(f"\nloss off {l0:.6f} on {l1:.6f}; grads rel {worst_g:.2e} (bitwise: {bitwise}); weights max abs "
          f"{worst_w:.2e}; peak off {p0 / 2**30:.2f} GiB, on {p1 / 2**30:.2f} GiB, "
          f"difference {(p0 - p1) / 2**30:.2f} GiB (formula {saved / 2**30:.2f} GiB)")
    assert abs(l0 - l1) / l0 <= 2 ** -7
    assert worst_g <= 2 ** -7
    assert worst_w <= 2 * lr + 1e-6
    assert p1 < p0
