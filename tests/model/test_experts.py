"""megatrain_nb.model.experts: our experts forward against transformers' "grouped_mm" (Note: [Experts around the
GEMMs]): the same output and gradients, bit for bit in fp32 on the CPU where the gate runs eager; the row moves'
backward as the adjoint gather; what it refuses. Training equality with HF + AdamW: test_equivalence.py
(``test_experts_implementations``); bf16 on CUDA: test_gpu_moe.py."""
from __future__ import annotations

import pytest
import torch

from conftest import make_config
from megatrain_nb.model import experts
from megatrain_nb.model.kernels import experts_modules

MOE = ("mixtral", "qwen3_moe", "gpt_oss")


def _experts_module(family):
    """The first experts module of a tiny ``family`` model, its weights (and biases) drawn at scale 0.5."""
    from transformers import AutoModelForCausalLM

    experts.register()
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(make_config(family), dtype=torch.float32)
    mod = experts_modules(model)[0][1]
    with torch.no_grad():
        for p in mod.parameters():
            p.normal_(0, 0.5)
    return mod


def _run(mod, impl, x, idx, w, dy):
    mod.config._experts_implementation = impl
    x = x.detach().requires_grad_()
    for p in mod.parameters():
        p.grad = None
    y = mod(x, idx, w)
    y.backward(dy)
    return y.detach(), x.grad, {n: p.grad for n, p in mod.named_parameters()}


@pytest.mark.parametrize("family", MOE)
def test_forward_and_gradients_equal_transformers_grouped_mm(family):
    mod = _experts_module(family)
    g = torch.Generator().manual_seed(1)
    T, E = 48, mod.num_experts
    top_k = 2
    x = torch.randn(T, mod.gate_up_proj.shape[1 if mod.is_transposed else 2], generator=g)
    top, idx = torch.randn(T, E, generator=g).topk(top_k, dim=-1)
    w = torch.softmax(top, dim=-1)
    dy = torch.randn(T, x.shape[1], generator=g)
    y0, dx0, dp0 = _run(mod, "grouped_mm", x, idx, w, dy)
    y1, dx1, dp1 = _run(mod, experts.NAME, x, idx, w, dy)
    assert torch.equal(y1, y0) and torch.equal(dx1, dx0), family
    assert dp1.keys() == dp0.keys() and all(torch.equal(dp1[n], dp0[n]) for n in dp0), \
        {n: (dp1[n] - dp0[n]).abs().max().item() for n in dp0}
    if mod.has_bias:  # the bias gradient is each expert's rows summed: none of them lost to a skipped expert
        assert dp1["down_proj_bias"].abs().sum(-1).gt(0).sum() == idx.unique().numel()


def test_the_row_moves_are_adjoint_gathers():
    """To experts order and back: forward values as indexing gives them, each backward the other's forward."""
    g = torch.Generator().manual_seed(2)
    T, k, H = 10, 3, 5
    ids = torch.randint(0, 4, (T * k,), generator=g)
    _, order = torch.sort(ids)
    inverse = torch.empty_like(order)
    inverse[order] = torch.arange(order.numel())
    rows = torch.randn(T, H, generator=g, dtype=torch.float64, requires_grad=True)
    pairs = torch.randn(T * k, H, generator=g, dtype=torch.float64, requires_grad=True)
    assert torch.equal(experts._ToExperts.apply(rows, order // k, inverse, k), rows[order // k])
    assert torch.equal(experts._FromExperts.apply(pairs, order // k, inverse, k), pairs[inverse].view(T, k, H).sum(1))
    assert torch.autograd.gradcheck(lambda r: experts._ToExperts.apply(r, order // k, inverse, k), (rows,))
    assert torch.autograd.gradcheck(lambda p: experts._FromExperts.apply(p, order // k, inverse, k), (pairs,))


def test_the_gpt_oss_gate_is_its_own_on_the_cpu():
    mod = _experts_module("gpt_oss")
    h = torch.randn(16, mod.gate_up_proj.shape[-1]) * 10  # past the clamp's limit too
    assert torch.equal(experts.gate(mod, h), mod._apply_gate(h))


def test_expert_parallelism_is_left_to_transformers():
    mod = _experts_module("gpt_oss")
    mod._is_expert_parallel = True
    with pytest.raises(NotImplementedError, match="expert parallelism.*'grouped_mm'"):
        experts.experts_forward(mod, torch.zeros(2, 4), torch.zeros(2, 2, dtype=torch.long), torch.ones(2, 2))


def test_register_is_idempotent():
    from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS

    assert experts.register() == experts.register() == experts.NAME
    assert ALL_EXPERTS_FUNCTIONS[experts.NAME] is experts.experts_forward
