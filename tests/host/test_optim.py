"""HostAdamW (a unit at a time, over host slabs) against torch.optim.AdamW; OptimConfig's schedules
against transformers' schedulers; OptimConfig's validation."""
from __future__ import annotations

import math

import pytest
import torch
from transformers import (get_constant_schedule, get_constant_schedule_with_warmup, get_cosine_schedule_with_warmup,
                          get_linear_schedule_with_warmup)

from conftest import rel
from megatrain_nb.config import OptimConfig
from megatrain_nb.model.hf import load_architecture
from megatrain_nb.host.host_store import HostStore
from megatrain_nb.host.optim import HostAdamW

STEPS = 50


@pytest.fixture(scope="module")
def arch():
    from conftest import make_config

    return load_architecture(make_config("qwen2"))  # weights and biases: several shapes per unit


def _store(arch, grad_dtype=torch.float32, seed=0):
    store = HostStore(arch, grad_dtype=grad_dtype)
    g = torch.Generator().manual_seed(seed)
    for unit in store.units.values():
        for v in unit.layout.views(unit.master).values():
            v.copy_(torch.randn(v.shape, generator=g) * 0.1)
    return store


def _train(arch, cfg, grad_dtype, *, steps: int, seed: int):
    """A fresh store and HostAdamW after ``steps`` updates of every unit with seeded random grads (clip factor 0.5)."""
    store = _store(arch, grad_dtype)
    opt = HostAdamW(store, cfg)
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        for u in store.order:
            store.units[u].grad.copy_(torch.randn(store.units[u].layout.numel, generator=g))
            opt.update(u, cfg.lr, 0.5)
    return store, opt


def _reference(store, u, cfg):
    """The unit's parameters as separate tensors under torch.optim.AdamW (the default, non-fused kernel)."""
    unit = store.units[u]
    params = [torch.nn.Parameter(v.clone()) for v in unit.layout.views(unit.master).values()]
    opt = torch.optim.AdamW(params, lr=cfg.lr, betas=cfg.betas, eps=cfg.eps, weight_decay=cfg.weight_decay)
    return params, opt


@pytest.mark.parametrize("grad_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("grad_scale", [1.0, 0.37])
@pytest.mark.parametrize("weight_decay", [0.0, 0.1])
def test_host_adamw_matches_torch_adamw(arch, weight_decay, grad_scale, grad_dtype):
    cfg = OptimConfig(lr=3e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=weight_decay, lr_schedule="cosine",
                      warmup_steps=5, total_steps=STEPS)
    store = _store(arch, grad_dtype)
    opt = HostAdamW(store, cfg)
    units = [-1, 0, arch.num_layers]  # embedding, a layer, the head
    refs = {u: _reference(store, u, cfg) for u in units}
    g = torch.Generator().manual_seed(1)
    for step in range(STEPS):
        lr = cfg.lr_at(step)
        for u in units:
            unit = store.units[u]
            grad = torch.randn(unit.layout.numel, generator=g).to(unit.grad.dtype)  # as it lands from the device
            unit.grad.copy_(grad)
            opt.update(u, lr, grad_scale)
            params, ref = refs[u]
            for p, v in zip(params, unit.layout.views(grad.float()).values()):
                p.grad = v * grad_scale  # what clip_grad_norm_ leaves in .grad
            ref.param_groups[0]["lr"] = lr
            ref.step()
    for u in units:
        unit = store.units[u]
        params, ref = refs[u]
        assert opt.steps_done(u) == STEPS
        for (name, got), p in zip(unit.layout.views(unit.master).items(), params):
            assert rel(got, p.detach()) <= 1e-6, (u, name)
            st = ref.state[p]
            assert rel(unit.layout.views(unit.exp_avg)[name], st["exp_avg"]) <= 1e-6, (u, name)
            assert rel(unit.layout.views(unit.exp_avg_sq)[name], st["exp_avg_sq"]) <= 1e-6, (u, name)


def test_chunked_update_equals_whole_slab_update(arch, monkeypatch):
    """Chunk boundaries (here far smaller than a unit) change no bit: the kernel is elementwise, every
    chunk sees the same step, and a multiple of 64 elements keeps each chunk on the same vector lanes
    (an odd size such as 4097 does move last bits)."""
    cfg = OptimConfig(lr=1e-3, weight_decay=0.1)
    out = []
    for chunk in (1 << 30, 1024, 1088, 4096 + 64):
        monkeypatch.setattr(HostAdamW, "chunk_numel", chunk)
        store, opt = _train(arch, cfg, torch.bfloat16, steps=4, seed=3)
        assert all(opt.steps_done(u) == 4 for u in store.order)
        out.append([torch.cat([store.units[u].master, store.units[u].exp_avg, store.units[u].exp_avg_sq])
                    for u in store.order])
    for other in out[1:]:
        assert all(torch.equal(a, b) for a, b in zip(out[0], other))


def test_grad_norm_of_a_long_host_tensor_is_accurate():
    """Note [Host norms]: 2^25 + 3 fp32 values (rows of 4096 plus a tail) against an fp64 reference."""
    from megatrain_nb.host.optim import grad_norm

    x = torch.randn((1 << 25) + 3, generator=torch.Generator().manual_seed(0)) * 1e-3
    want = x.double().square().sum().sqrt().item()
    got = grad_norm(x)
    assert got.shape == () and abs(got.item() - want) / want < 1e-7
    assert grad_norm(x[:1000]).item() == pytest.approx(x[:1000].double().norm().item(), rel=1e-6)  # short: one call
    assert not torch.isfinite(grad_norm(torch.cat([x, torch.tensor([float("nan")])])))


def test_host_adamw_is_deterministic(arch):
    cfg = OptimConfig(lr=1e-3, weight_decay=0.1)
    out = []
    for _ in range(2):
        store, _ = _train(arch, cfg, torch.float32, steps=5, seed=2)
        out.append({u: store.units[u].master.clone() for u in store.order})
    assert all(torch.equal(out[0][u], out[1][u]) for u in out[0])


def test_update_leaves_grad_slab_and_padding_alone(arch):
    """The clip factor scales a scratch copy, never the landed gradients; alignment padding (zero
    weight, zero gradient, as the engine's device slots give it) stays zero under weight decay."""
    store = _store(arch, torch.bfloat16)
    opt = HostAdamW(store, OptimConfig(lr=1e-2, weight_decay=0.1))
    unit = store.units[0]
    used = torch.zeros(unit.layout.numel, dtype=torch.bool)
    for _, s, o in unit.layout.items():
        used[o:o + s.numel()] = True
    assert not used.all(), "the layout should have padding for this test to mean anything"
    unit.grad.copy_(torch.randn(unit.layout.numel) * used)
    before, master = unit.grad.clone(), unit.master.clone()
    for _ in range(3):
        opt.update(0, 1e-2, 0.25)
    assert torch.equal(unit.grad, before)
    assert unit.master.grad is None
    assert torch.count_nonzero(unit.master[~used]) == 0
    assert not torch.equal(unit.master[used], master[used])


@pytest.mark.parametrize("grad_clip", [None, 0.5, 1e6])
def test_clip_factor_matches_clip_grad_norm(arch, grad_clip):
    store = _store(arch)
    opt = HostAdamW(store, OptimConfig(grad_clip=grad_clip))
    g = torch.Generator().manual_seed(3)
    grads = {u: torch.randn(store.units[u].layout.numel, generator=g) for u in store.order}
    norms = {u: float(torch.linalg.vector_norm(grads[u])) for u in store.order}
    total, factor = opt.clip_factor(norms)
    params = []
    for u in store.order:
        p = torch.nn.Parameter(torch.zeros(store.units[u].layout.numel))
        p.grad = grads[u].clone()
        params.append(p)
    want = torch.nn.utils.clip_grad_norm_(params, grad_clip if grad_clip is not None else math.inf)
    assert total == pytest.approx(float(want), rel=1e-6)
    if grad_clip is None or grad_clip > total:
        assert factor == 1.0
    for u, p in zip(store.order, params):
        assert rel(grads[u] * factor, p.grad) <= 1e-6


# ---- schedules -------------------------------------------------------------------------------
SCHEDULES = [
    ("constant", 0, None, lambda o, w, t: get_constant_schedule(o)),
    ("constant", 3, None, lambda o, w, t: get_constant_schedule_with_warmup(o, w)),
    ("linear", 0, 10, get_linear_schedule_with_warmup),
    ("linear", 3, 10, get_linear_schedule_with_warmup),
    ("cosine", 0, 10, get_cosine_schedule_with_warmup),
    ("cosine", 3, 10, get_cosine_schedule_with_warmup),
    ("cosine", 2, 6, get_cosine_schedule_with_warmup),
]


@pytest.mark.parametrize("name, warmup, total, hf", SCHEDULES,
                         ids=[f"{n}-w{w}-t{t}" for n, w, t, _ in SCHEDULES])
def test_lr_at_matches_transformers(name, warmup, total, hf):
    cfg = OptimConfig(lr=3e-4, lr_schedule=name, warmup_steps=warmup, total_steps=total)
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=cfg.lr)
    sched = hf(opt, warmup, total)
    for step in range((total or 12) + 4):  # past total_steps too
        assert cfg.lr_at(step) == pytest.approx(opt.param_groups[0]["lr"], rel=1e-12, abs=1e-18), step
        opt.step()
        sched.step()


# ---- validation ----------------------------------------------------------------------------------
@pytest.mark.parametrize("kw, match", [
    (dict(lr=-1.0), r"lr=-1\.0"),
    (dict(lr=math.inf), r"lr=inf"),
    (dict(betas=(0.9, 1.0)), r"betas=\(0\.9, 1\.0\)"),
    (dict(betas=(-0.1, 0.9)), r"betas=\(-0\.1, 0\.9\)"),
    (dict(eps=-1e-8), r"eps=-1e-08"),
    (dict(weight_decay=-1.0), r"weight_decay=-1\.0"),
    (dict(grad_clip=0.0), r"grad_clip=0\.0"),
    (dict(grad_clip=-2.0), r"grad_clip=-2\.0"),
    (dict(lr_schedule="step"), r"lr_schedule='step'"),
    (dict(warmup_steps=-3), r"warmup_steps=-3"),
    (dict(lr_schedule="linear"), r"total_steps=None"),
    (dict(lr_schedule="cosine", warmup_steps=10, total_steps=5), r"total_steps=5, warmup_steps=10"),
], ids=lambda x: ",".join(f"{k}={v}" for k, v in x.items()) if isinstance(x, dict) else "")
def test_optim_config_names_the_bad_field(kw, match):
    with pytest.raises(ValueError, match=match):
        OptimConfig(**kw)


def test_optim_config_is_keyword_only():
    with pytest.raises(TypeError):
        OptimConfig(1e-3)  # noqa
