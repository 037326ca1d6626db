"""Helpers shared by tests in several folders (fixtures live in conftest.py; data-parallel helpers in
dp_helpers.py; chat data and tokenizers in sft_helpers.py).

- the equivalence check: a Session against the HF model + ``torch.optim.AdamW`` (``compare``, its LR, BETAS, EPS);
- real model shapes for the planner (``QWEN25_7B``);
- placements: ``losses_under`` and ``head_unit``;
- the CUDA tests' model, batches and run (``gpu_config``, ``gpu_batches``, ``gpu_run``, ``GPU_MIXED``);
- a spy on the grouped GEMMs of MoE experts (``spy_grouped_mm``).
"""
from __future__ import annotations

import pytest
import torch
from transformers import (AutoModelForCausalLM, LlamaConfig, get_cosine_schedule_with_warmup,
                          get_linear_schedule_with_warmup)

from conftest import (BATCH, SEQ, VOCAB, load_reference, make_batches, record, rel_scalar, train_reference,
                      train_session, weight_diffs)
from megatrain_nb import Session

# ---- streamed equals plain (test_equivalence.py and the mechanisms held to it) --------------------
TOL = 1e-5
LR, BETAS, EPS = 2e-3, (0.9, 0.95), 1e-7
# Note: [Key bias] the gradient of a k_proj bias is exactly zero (softmax ignores a constant added to
# every score of a query); what autograd returns is rounding noise, which Adam turns into steps of
# noise/(|noise|+eps) * lr. Two correct implementations then differ by noise, so these tensors are
# held to an absolute bound of lr per step instead of the relative tolerance.
NOISE_ONLY = ("self_attn.k_proj.bias",)


def compare(d, family, tmp_path, *, steps=5, batch=BATCH, seq=SEQ, pad=False, weight_decay=0.0, grad_clip=None,
            schedule=None, reference_experts=None, **engine) -> dict:
    """Train a Session from ``d`` and the HF reference on the same batches; assert and record the diffs.

    ``schedule``: (lr_schedule, warmup_steps, total_steps) or None (constant). ``reference_experts``: the
    reference's experts implementation (None: transformers' default).
    """
    settings = dict(device="cpu", dtype=torch.float32, lr=LR, betas=BETAS, eps=EPS, weight_decay=weight_decay,
                    grad_clip=grad_clip, **engine)
    make_sched = None
    if schedule is not None:
        name, warm, total = schedule
        settings.update(lr_schedule=name, warmup_steps=warm, total_steps=total)
        hf = {"cosine": get_cosine_schedule_with_warmup, "linear": get_linear_schedule_with_warmup}[name]
        make_sched = lambda opt: hf(opt, warm, total)  # noqa: E731
    s = Session.from_pretrained(d, **settings)
    try:
        ref = load_reference(d, s.arch.model.config._attn_implementation, reference_experts)
        pad_id = (s.config.pad_token_id or 0) if pad else None
        batches = make_batches(VOCAB, steps, batch=batch, seq=seq, pad_id=pad_id)
        got = train_session(s, batches)
        lrs = [r.lr for r in s.history]
        want, norms, ref_lrs = train_reference(ref, batches, lr=LR, betas=BETAS, eps=EPS, weight_decay=weight_decay,
                                               grad_clip=grad_clip, schedule=make_sched)
        out = tmp_path / "trained"
        s.save_pretrained(out)
    finally:
        s.close()
    loss_diff = max(rel_scalar(a, b) for a, b in zip(got, want))
    assert loss_diff <= TOL, f"{family}: losses {got} vs reference {want}"
    assert lrs == pytest.approx(ref_lrs, rel=1e-12, abs=1e-15), "StepResult.lr differs from the reference's lr"
    diffs = weight_diffs(out, ref)
    ref_sd = ref.state_dict()
    saved = AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32).state_dict()
    checked, noise_gap = {}, 0.0
    for name, dw in diffs.items():
        if name.endswith(NOISE_ONLY):
            gap = (saved[name] - ref_sd[name]).abs().max().item()
            assert gap <= LR * steps, f"{family}: {name} moved {gap} away from the reference"
            noise_gap = max(noise_gap, gap)
        else:
            checked[name] = dw
    worst = max(checked, key=checked.get)
    assert checked[worst] <= TOL, f"{family}: {worst} rel diff {checked[worst]:.2e}; all over tol: " + \
        str({k: f"{v:.1e}" for k, v in checked.items() if v > TOL})
    record(family, loss_diff, checked[worst], noise_gap)
    return dict(losses=got, ref_losses=want, norms=norms, loss_diff=loss_diff, weight_diff=checked[worst])


# ---- model shapes ----------------------------------------------------------------------------
QWEN25_7B = dict(model_type="qwen2", hidden_size=3584, intermediate_size=18944, num_hidden_layers=28,
                 num_attention_heads=28, num_key_value_heads=4, vocab_size=152064, tie_word_embeddings=False)


# ---- placements ------------------------------------------------------------------------------
def losses_under(d, batches, placement) -> list[float]:
    """The losses of a fresh session trained on ``batches`` under ``placement``, closed after."""
    s = Session.from_pretrained(d, lr=LR, placement=placement)
    try:
        return train_session(s, batches)
    finally:
        s.close()


def head_unit(d) -> int:
    """The head's unit index of the checkpoint in ``d`` (its number of layers)."""
    import json
    return json.loads((d / "config.json").read_text())["num_hidden_layers"]


# ---- CUDA (marked gpu) -------------------------------------------------------------------------
GPU_MIXED = {-1: "resident", 1: "resident", 3: "resident"}  # embedding, two layers; the (untied) head on the host


def gpu_config(layers=4, attn="sdpa", tied=False):
    """A Llama config of the CUDA tests: hidden 256, vocab 1024, ``layers`` layers."""
    c = LlamaConfig(vocab_size=1024, hidden_size=256, intermediate_size=688, num_hidden_layers=layers,
                    num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=512,
                    tie_word_embeddings=tied)
    c._attn_implementation = attn
    return c


def gpu_batches(n, B=4, T=128, seed=0):
    """``n`` id batches of a learnable repeat-the-motif task (B rows of T tokens, vocab 1024)."""
    g = torch.Generator().manual_seed(seed)
    base = torch.randint(0, 1024, (B, 16), generator=g)
    out = []
    for _ in range(n):  # a learnable repeat-the-motif task, so the loss moves
        ids = base.repeat(1, T // 16)
        ids[:, ::7] = torch.randint(0, 1024, ids[:, ::7].shape, generator=g)
        out.append(ids)
    return out


def gpu_run(model_dir, delays, steps=3, **kw):
    """(losses, final masters) of ``steps`` CUDA steps of ``model_dir`` under ``delays`` and settings ``kw``."""
    s = Session.from_pretrained(model_dir, device="cuda", lr=1e-3, **kw)
    s.engine.delays = delays
    losses = [s.step({"input_ids": ids}).loss for ids in gpu_batches(steps, seed=1)]
    s.engine.drain()
    weights = [s.store.units[u].master.clone() for u in s.store.order]
    s.close()
    return losses, weights


# ---- MoE kernels (tests/model) --------------------------------------------------------------------
def spy_grouped_mm(monkeypatch) -> list:
    """Record each ``torch.nn.functional.grouped_mm`` call's weight storage (``mat_b``'s data pointer) while it
    runs as before; returns the list the calls append to."""
    import torch.nn.functional as F

    calls, real = [], F.grouped_mm

    def spy(mat_a, mat_b, *a, **k):
        calls.append(mat_b.untyped_storage().data_ptr())
        return real(mat_a, mat_b, *a, **k)

    monkeypatch.setattr(F, "grouped_mm", spy)
    return calls
