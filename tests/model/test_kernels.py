"""megatrain_nb.model.kernels: the experts implementation chosen (setting or auto) and reported, the
grouped GEMM actually running on views of the streamed slab (no copies of the stacked expert weights),
the sink-attention choice, and the active-parameter count that model TFLOPS uses.

Training equality of each experts implementation with HF + AdamW: test_equivalence.py
(``test_experts_implementations``)."""
from __future__ import annotations

import pytest
import torch

from conftest import VOCAB, make_batches, make_config
from helpers import spy_grouped_mm
from megatrain_nb import EngineConfig, Session
from megatrain_nb.model import kernels
from megatrain_nb.model.hf import load_architecture

MOE = ("mixtral", "qwen3_moe", "gpt_oss")


# ---- the choice ------------------------------------------------------------------------------------
@pytest.mark.parametrize("family", MOE)
def test_auto_is_grouped_mm_on_the_cpu_and_a_setting_wins(family):
    arch = load_architecture(make_config(family))
    impl, why = kernels.choose_experts(arch, None, "cpu", torch.float32)
    assert (impl, why.startswith("auto")) == ("grouped_mm", True)
    for setting in kernels.EXPERTS_IMPLEMENTATIONS:
        assert kernels.choose_experts(arch, setting, "cpu", torch.float32)[0] == setting


def test_dense_models_have_no_experts_implementation():
    arch = load_architecture(make_config("llama"))
    impl, why = kernels.choose_experts(arch, "grouped_mm", "cpu", torch.float32)
    assert impl is None and "no experts" in why
    assert kernels.install(arch, experts=None, device="cpu", dtype=torch.float32)["experts"] is None


def test_grouped_mm_refusals_name_the_reason(monkeypatch):
    if torch.cuda.is_available():
        pytest.skip("the CUDA branch is exercised on the GPU")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda dev=None: (7, 5))
    assert "bf16" in kernels.grouped_mm_refusal("cuda", torch.float32)
    assert "8.0" in kernels.grouped_mm_refusal("cuda", torch.bfloat16)
    assert kernels.grouped_mm_refusal("cpu", torch.float32) is None
    arch = load_architecture(make_config("mixtral"))
    assert kernels.choose_experts(arch, None, "cuda", torch.bfloat16)[0] == "eager"  # auto falls back
    for setting in ("grouped_mm", "megatrain_grouped_mm"):
        with pytest.raises(ValueError, match=f"experts_implementation='{setting}'.*8.0"):
            kernels.choose_experts(arch, setting, "cuda", torch.bfloat16)


def test_bad_setting_is_refused_by_the_config():
    with pytest.raises(ValueError, match="experts_implementation='loop'"):
        EngineConfig(experts_implementation="loop")
    arch = load_architecture(make_config("mixtral"))
    with pytest.raises(ValueError, match="experts_implementation='loop'"):
        kernels.choose_experts(arch, "loop", "cpu", torch.float32)


# ---- what runs: grouped GEMMs over views of the slab ------------------------------------------------
@pytest.mark.parametrize("experts", ["grouped_mm", "megatrain_grouped_mm", "eager"])
@pytest.mark.parametrize("family", MOE)
def test_session_runs_its_choice_on_views_of_the_slab(family, experts, monkeypatch):
    """Every grouped GEMM's weight is a view of a weight slot (its storage is the slot's, not a copy);
    eager runs none."""
    calls = spy_grouped_mm(monkeypatch)
    s = Session.from_config(make_config(family), device="cpu", experts_implementation=experts)
    try:
        assert s.kernels["experts"] == experts and s.kernels["experts_reason"] == f"experts_implementation={experts!r}"
        assert s.arch.model.config._experts_implementation == experts
        s.step(make_batches(VOCAB, 1)[0])
        slabs = {t.untyped_storage().data_ptr() for t in s.engine.slots}
    finally:
        s.close()
    if experts == "eager":
        assert calls == []
    else:
        moe_layers = sum(1 for t in s.arch.layers if kernels.experts_modules(t))
        assert len(calls) >= 2 * moe_layers, f"{len(calls)} grouped GEMMs for {moe_layers} MoE layers"
        assert set(calls) <= slabs, "an expert weight reached grouped_mm as a copy, not a view of a slot"


# ---- attention with sinks ----------------------------------------------------------------------------
def test_sink_attention_is_eager_on_the_cpu_and_others_keep_their_own():
    gpt = load_architecture(make_config("gpt_oss"))
    assert kernels.has_sinks(gpt) and kernels.choose_attention(gpt, "cpu")[0] == "eager"
    llama = load_architecture(make_config("llama"))
    assert not kernels.has_sinks(llama) and kernels.choose_attention(llama, "cpu") == ("sdpa", "the config's own")


@pytest.mark.filterwarnings("ignore:_compile flag on create_block_mask:DeprecationWarning")  # transformers' own call
def test_transformers_flex_attention_refuses_sinks_on_the_cpu():
    """The premise of eager on the CPU (Note: [Sink attention]): transformers' flex path needs the log-sum-exp,
    which it does not ask for on the CPU. If a later transformers runs it, this fails: then test flex against
    eager here and let choose_attention pick flex on the CPU too."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    m = AutoModelForCausalLM.from_config(make_config("gpt_oss"), dtype=torch.float32, attn_implementation="flex_attention")
    ids = make_batches(VOCAB, 1)[0]["input_ids"]
    with pytest.raises(ValueError, match="sinks cannot be run on CPU"):
        m(input_ids=ids, labels=ids)


def test_sink_attention_is_flex_on_cuda_from_head_dim_16():
    """The choice alone (no GPU needed: nothing runs). The compiled flex kernel refuses head_dim under 16."""
    impl, why = kernels.choose_attention(load_architecture(make_config("gpt_oss", head_dim=16)), "cuda")
    assert impl == "flex_attention" and "sinks" in why
    impl, why = kernels.choose_attention(load_architecture(make_config("gpt_oss")), "cuda")  # head_dim 8
    assert impl == "eager" and "head_dim 8" in why


# ---- active parameters ---------------------------------------------------------------------------------
def _hand_count_gpt_oss(h=32, heads=4, kv=2, hd=8, experts=4, top_k=2, inter=32, vocab=VOCAB, layers=2):
    attn = heads + (h * heads * hd + heads * hd) + 2 * (h * kv * hd + kv * hd) + (heads * hd * h + h)  # sinks q k v o
    router = experts * h + experts
    per_expert = h * 2 * inter + 2 * inter + inter * h + h  # gate_up (+ bias), down (+ bias)
    layer_all = attn + router + experts * per_expert + 2 * h
    layer_active = attn + router + top_k * per_expert + 2 * h
    rest = 2 * vocab * h + h  # embedding, untied lm_head, final norm
    return layers * layer_active + rest, layers * layer_all + rest


def _hand_count_qwen3_moe(h=32, heads=4, kv=2, hd=8, experts=4, top_k=2, moe=32, dense=64, vocab=VOCAB,
                          dense_layers=1, moe_layers=1):
    attn = h * heads * hd + 2 * h * kv * hd + heads * hd * h + 2 * hd  # q k v o, q / k norms
    dense_layer = attn + 3 * h * dense + 2 * h
    moe_all = attn + experts * h + experts * 3 * h * moe + 2 * h  # router, experts
    moe_active = attn + experts * h + top_k * 3 * h * moe + 2 * h
    rest = 2 * vocab * h + h
    return (dense_layers * dense_layer + moe_layers * moe_active + rest,
            dense_layers * dense_layer + moe_layers * moe_all + rest)


def test_active_params_of_gpt_oss_match_a_hand_count():
    arch = load_architecture(make_config("gpt_oss"))
    active, total = _hand_count_gpt_oss()
    assert sum(p.numel() for p in arch.model.parameters()) == total
    assert arch.active_params() == active == 25584


def test_active_params_of_qwen3_moe_match_a_hand_count():
    arch = load_architecture(make_config("qwen3_moe"))  # layer 0 dense (mlp_only_layers), layer 1 MoE
    active, total = _hand_count_qwen3_moe()
    assert sum(p.numel() for p in arch.model.parameters()) == total
    assert arch.active_params() == active


def test_active_params_of_a_dense_model_are_all_of_them():
    arch = load_architecture(make_config("llama_tied"))
    assert arch.active_params() == sum(p.numel() for p in arch.model.parameters())


def test_step_tflops_count_active_params():
    s = Session.from_config(make_config("gpt_oss"), device="cpu")
    try:
        r = s.step(make_batches(VOCAB, 1)[0])
        assert s.store.num_params() == _hand_count_gpt_oss()[1]
    finally:
        s.close()
    assert r.tflops == pytest.approx(6 * 25584 * r.tokens / r.seconds / 1e12, rel=1e-12)
