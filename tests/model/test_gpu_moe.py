"""MoE kernels on CUDA (model/kernels.py): grouped_mm against HF's eager experts, on the slots' views,
and gpt-oss's sink attention through flex attention against eager. Marked gpu: skipped without CUDA.

Run on the H200 with `python -m pytest -q -m gpu tests/model/test_gpu_moe.py`.
"""
import pytest
import torch

from conftest import make_config
from helpers import spy_grouped_mm
from megatrain_nb import Session
from megatrain_nb.model import experts as grouped

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

MOE = ("mixtral", "qwen3_moe", "gpt_oss")


def _config(family):
    """A small MoE of ``family``: hidden 256, 8 heads of 32 (flex attention needs 16), 8 experts (top 2), 2 layers,
    vocab 96 (make_config's)."""
    experts = {"num_experts": 8} if family == "qwen3_moe" else {"num_local_experts": 8}
    return make_config(family, head_dim=32, hidden_size=256, intermediate_size=256, num_attention_heads=8, num_key_value_heads=4,
                       **({"moe_intermediate_size": 128} if family == "qwen3_moe" else {}), **experts)


def _hf(family, experts, attn, dtype):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    m = AutoModelForCausalLM.from_config(_config(family), dtype=dtype, attn_implementation=attn,
                                         experts_implementation=experts).cuda()
    return m.train()


def _loss_and_grads(model, ids):
    model.zero_grad(set_to_none=True)
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    return loss.detach().float(), {n: p.grad.float() for n, p in model.named_parameters() if p.grad is not None}


def _rel(a, b):
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


@pytest.mark.parametrize("impl", ["grouped_mm", grouped.NAME])
@pytest.mark.parametrize("family", MOE)
def test_grouped_mm_equals_eager_experts_in_bf16(family, impl):
    """HF's own forward and backward, bf16 on the GPU: grouped GEMMs (transformers' and ours, with its gate
    compiled) vs the loop over experts. Bound: the two sum each expert's products in another order, bf16
    rounding (2^-8) at most per element: 2% of the whole gradient."""
    grouped.register()
    attn = "eager" if family == "gpt_oss" else "sdpa"
    ids = torch.randint(0, 96, (4, 64), generator=torch.Generator().manual_seed(1)).cuda()
    loss_g, grads_g = _loss_and_grads(_hf(family, impl, attn, torch.bfloat16), ids)
    loss_e, grads_e = _loss_and_grads(_hf(family, "eager", attn, torch.bfloat16), ids)
    assert abs(loss_g - loss_e) / loss_e <= 1e-2
    flat_g, flat_e = (torch.cat([g[n].flatten() for n in sorted(grads_e)]) for g in (grads_g, grads_e))
    assert _rel(flat_g, flat_e) <= 2e-2, family  # per tensor, a norm's small gradient differs by up to ~7%


def test_the_compiled_gpt_oss_gate_equals_its_own_in_bf16():
    """The gate as one compiled kernel each way against gpt-oss's eager gate: one rounding against several,
    bf16 (2^-8 relative per element), past the clamp's limit too."""
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssExperts

    mod = GptOssExperts(_config("gpt_oss"))
    h = (torch.randn(4096, 512, device="cuda") * 6).bfloat16().requires_grad_()
    h2 = h.detach().clone().requires_grad_()
    dy = torch.randn(4096, 256, device="cuda").bfloat16()
    y, y2 = grouped.gate(mod, h), mod._apply_gate(h2)
    (y * dy).sum().backward()
    (y2 * dy).sum().backward()
    assert _rel(y.float(), y2.float()) <= 1e-2 and _rel(h.grad.float(), h2.grad.float()) <= 1e-2


@pytest.mark.parametrize("family", MOE)
def test_session_runs_grouped_mm_on_cuda_and_trains_as_eager(family, monkeypatch):
    """Auto picks grouped_mm on CUDA in bf16, its GEMMs (and ours, with the gate compiled inside the engine)
    read the weight slots (no copies; placement "host": every layer streams), and three steps track a session
    forced to eager experts, which runs no grouped GEMM, within bf16 rounding (2% of the loss)."""
    calls = spy_grouped_mm(monkeypatch)
    g = torch.Generator().manual_seed(2)
    batches = [{"input_ids": torch.randint(0, 96, (4, 64), generator=g)} for _ in range(3)]
    losses, seen = {}, {}
    for experts in (None, grouped.NAME, "eager"):
        calls.clear()
        s = Session.from_config(_config(family), device="cuda", lr=1e-3, placement="host",
                                experts_implementation=experts)
        try:
            losses[experts] = [s.step(b).loss for b in batches]
            seen[experts] = (s.kernels["experts"], list(calls), {t.untyped_storage().data_ptr() for t in s.engine.slots})
        finally:
            s.close()
    impl, grouped_calls, slots = seen[None]
    assert impl == "grouped_mm" and grouped_calls and set(grouped_calls) <= slots, "a weight reached grouped_mm as a copy"
    impl, grouped_calls, slots = seen[grouped.NAME]
    assert impl == grouped.NAME and grouped_calls and set(grouped_calls) <= slots
    assert seen["eager"][:2] == ("eager", [])
    for ours in (None, grouped.NAME):
        for a, b in zip(losses[ours], losses["eager"]):
            assert abs(a - b) / b <= 2e-2, (losses, family)


def test_sink_attention_flex_equals_eager_on_cuda():
    """gpt-oss's attention with sinks: transformers' flex attention (softmax renormalised by its log-sum-exp)
    against eager's (B, heads, T, T) scores, fp32 forward and backward on the GPU."""
    ids = torch.randint(0, 96, (2, 64), generator=torch.Generator().manual_seed(3)).cuda()
    loss_f, grads_f = _loss_and_grads(_hf("gpt_oss", "grouped_mm", "flex_attention", torch.float32), ids)
    loss_e, grads_e = _loss_and_grads(_hf("gpt_oss", "grouped_mm", "eager", torch.float32), ids)
    assert abs(loss_f - loss_e) / loss_e <= 1e-4
    for n in grads_e:
        assert _rel(grads_f[n], grads_e[n]) <= 1e-3, n
    assert _rel(grads_f["model.layers.0.self_attn.sinks"], grads_e["model.layers.0.self_attn.sinks"]) <= 1e-3


def test_session_runs_gpt_oss_with_flex_attention(tmp_path):
    """The session chooses flex for sink attention on CUDA and trains as HF eager + AdamW in fp32 (3 steps)."""
    from transformers import AutoModelForCausalLM

    g = torch.Generator().manual_seed(4)
    batches = [torch.randint(0, 96, (2, 64), generator=g) for _ in range(3)]
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(_config("gpt_oss"), dtype=torch.float32).save_pretrained(tmp_path)
    ref = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32, attn_implementation="eager").cuda().train()
    s = Session.from_pretrained(tmp_path, device="cuda", dtype=torch.float32, lr=1e-3, placement="host")
    try:
        assert s.kernels["attention"] == "flex_attention", s.kernels
        got = [s.step({"input_ids": ids}).loss for ids in batches]
    finally:
        s.close()
    opt = torch.optim.AdamW(ref.parameters(), lr=1e-3, weight_decay=0.0)
    want = []
    for ids in batches:
        ids = ids.cuda()
        loss = ref(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        want.append(loss.item())
    for a, b in zip(got, want):
        assert abs(a - b) / b <= 1e-3, (got, want)
