"""Streamed equals plain: a Session trained step by step matches the HF model trained with
``torch.optim.AdamW`` on identical batches, for every supported family and engine setting.

Tolerances: per-step loss rel diff <= 1e-5 and per-tensor weight rel diff ||a-b||/||b|| <= 1e-5
after the last step (the streamed path runs the same kernels in fp32 but in a different grouping:
layer by layer, micro-batch by micro-batch, loss in chunks).
"""
from __future__ import annotations

import json

import pytest
import torch
from transformers import AutoModelForCausalLM

from conftest import (VOCAB, families, load_reference, make_batches, record, rel_scalar, train_reference, train_session,
                      weight_diffs)
from helpers import BETAS, EPS, LR, NOISE_ONLY, TOL, compare
from megatrain_nb import Session

# ---- every family, default settings ------------------------------------------------------------
def test_default_settings(hf_dir, family, tmp_path):
    compare(hf_dir(family), family, tmp_path)


# ---- every experts implementation of the MoE families, against HF's own loop over the experts ------
@pytest.fixture
def deterministic():
    """torch's deterministic algorithms for one test, the process's setting restored after.

    batched_mm's gradient of its gathered expert weights is ``index_put_(accumulate=True)``, which on the CPU
    adds with atomics in whatever order the threads run: the plain HF model's expert gradients differ run to
    run (2 threads), and Adam carries that into a gpt-oss expert bias as 0.9e-5 .. 1.4e-5 relative against
    the reference, on either side of the tolerance. Under this switch torch sorts instead and the difference
    is one number (6.8e-6), the rounding of batched against eager alone."""
    before = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    yield
    torch.use_deterministic_algorithms(before)


@pytest.mark.parametrize("experts", ["eager", "grouped_mm", "megatrain_grouped_mm", "batched_mm"])
@pytest.mark.parametrize("family", families("mixtral", "qwen3_moe", "gpt_oss"))
def test_experts_implementations(hf_dir, family, experts, tmp_path, deterministic):
    """Note: [Experts kernel] in model/kernels.py: each implementation the session can run trains as HF's
    eager experts (a Python loop over the experts) with torch.optim.AdamW; the session reports its choice."""
    compare(hf_dir(family), family, tmp_path, experts_implementation=experts, reference_experts="eager")


# ---- activation policies x micro-batching, on a dense and an MoE family --------------------------
@pytest.mark.parametrize("micro_batch_size", [None, 1])
@pytest.mark.parametrize("checkpoint_every", [1, 2, 4, 0])
@pytest.mark.parametrize("family", families("llama", "mixtral"))
def test_checkpointing_and_micro_batches(hf_dir, family, checkpoint_every, micro_batch_size, tmp_path):
    # 4 layers: K=2 makes two recompute blocks, K=4 one block of every layer; batch 3 with
    # micro_batch_size=1 gives three micro-batches per layer visit
    compare(hf_dir(family, num_hidden_layers=4), family, tmp_path, batch=3,
            checkpoint_every=checkpoint_every, micro_batch_size=micro_batch_size)


# ---- batch contents and optimizer settings, every family ---------------------------------------
def test_left_padding(hf_dir, family, tmp_path):
    """Row 0 left-padded: attention_mask 0, pad token ids, labels -100 there."""
    compare(hf_dir(family), family, tmp_path, pad=True, micro_batch_size=1)


@pytest.mark.parametrize("family", families("llama", "llama_tied", "mixtral"))
def test_left_padding_with_padding_idx(hf_dir, family, tmp_path):
    """pad_token_id set: nn.Embedding(padding_idx) gives the pad row no gradient from the embedding
    (tied: the head's gradient for that row still counts)."""
    d = hf_dir(family, pad_token_id=0)
    assert AutoModelForCausalLM.from_pretrained(str(d)).model.embed_tokens.padding_idx == 0
    compare(d, family, tmp_path, pad=True)


def test_weight_decay(hf_dir, family, tmp_path):
    compare(hf_dir(family), family, tmp_path, weight_decay=0.1)


def test_grad_clip(hf_dir, family, tmp_path):
    r = compare(hf_dir(family), family, tmp_path, grad_clip=0.5)
    assert max(r["norms"]) > 0.5, f"gradient norms {r['norms']} never exceed the clip: the test clips nothing"


def test_cosine_schedule_with_warmup(hf_dir, family, tmp_path):
    compare(hf_dir(family), family, tmp_path, steps=6, schedule=("cosine", 2, 6))


@pytest.mark.parametrize("family", families("llama", "qwen3_moe"))
def test_linear_schedule_clip_and_decay_together(hf_dir, family, tmp_path):
    compare(hf_dir(family), family, tmp_path, steps=6, schedule=("linear", 1, 5), weight_decay=0.1, grad_clip=0.5,
            checkpoint_every=1, micro_batch_size=1, pad=True)


# ---- sharded checkpoints ---------------------------------------------------------------------
@pytest.mark.parametrize("family", families("llama", "mixtral"))
def test_load_sharded_checkpoint(hf_dir, family, tmp_path):
    d = hf_dir(family, max_shard_size="20KB")
    index = json.loads((d / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) >= 3, "the fixture should have written several shards"
    assert not (d / "model.safetensors").exists()
    r = compare(d, family, tmp_path)
    single = compare(hf_dir(family), family, tmp_path / "single")
    assert r["losses"] == single["losses"], "sharded and single-file loads must train identically"


@pytest.mark.parametrize("family", families("llama_tied", "mixtral"))
def test_save_sharded(hf_dir, family, tmp_path):
    s = Session.from_pretrained(hf_dir(family), lr=LR)
    try:
        train_session(s, make_batches(VOCAB, 2))
        s.save_pretrained(tmp_path / "one")  # drains pending updates
        s.store.save_pretrained(tmp_path / "many", max_shard_bytes=8 << 10)
    finally:
        s.close()
    index = json.loads((tmp_path / "many" / "model.safetensors.index.json").read_text())
    shards = set(index["weight_map"].values())
    assert len(shards) >= 3 and all((tmp_path / "many" / f).exists() for f in shards)
    assert not (tmp_path / "many" / "model.safetensors").exists()
    assert not list((tmp_path / "many").glob("model-partial-*")) and not list((tmp_path / "one").glob("model-partial-*"))
    one = AutoModelForCausalLM.from_pretrained(str(tmp_path / "one"), dtype=torch.float32).state_dict()
    many = AutoModelForCausalLM.from_pretrained(str(tmp_path / "many"), dtype=torch.float32).state_dict()
    assert set(one) == set(many)
    for k in one:
        assert torch.equal(one[k], many[k]), k
    # and the sharded output loads back into a Session bit for bit
    back = Session.from_pretrained(tmp_path / "many")
    try:
        ref = Session.from_pretrained(tmp_path / "one")
        for u in back.store.order:
            assert torch.equal(back.store.units[u].master, ref.store.units[u].master), u
        ref.close()
    finally:
        back.close()


# ---- other engine settings ---------------------------------------------------------------------
ENGINE_SETTINGS = {
    "loss_chunks_of_5": dict(loss_chunk_tokens=5),  # 12 positions: chunks 5, 5, 2
    "three_slots": dict(weight_slots=3),
    "three_slots_K2": dict(weight_slots=3, checkpoint_every=2),
    "no_overlap": dict(overlap_optimizer=False),
    "no_trace": dict(trace=False),
    "uneven_micro_batches": dict(micro_batch_size=2, batch=3),
}


@pytest.mark.parametrize("setting", list(ENGINE_SETTINGS))
@pytest.mark.parametrize("family", families("llama_tied", "mixtral"))
def test_engine_settings(hf_dir, family, setting, tmp_path):
    compare(hf_dir(family, num_hidden_layers=3), family, tmp_path, **ENGINE_SETTINGS[setting])


def _assert_matches(family: str, got: list, want: list, out, ref) -> None:
    """Losses and saved weights (the zero-gradient NOISE_ONLY tensors aside) within TOL; record them."""
    loss_diff = max(rel_scalar(a, b) for a, b in zip(got, want))
    assert loss_diff <= TOL, (got, want)
    diffs = {k: v for k, v in weight_diffs(out, ref).items() if not k.endswith(NOISE_ONLY)}
    assert max(diffs.values()) <= TOL, {k: v for k, v in diffs.items() if v > TOL}
    record(family, loss_diff, max(diffs.values()))


@pytest.mark.parametrize("family", families("llama", "qwen3_moe"))
def test_batch_shape_changes_between_steps(hf_dir, family, tmp_path):
    """The activation policy is fixed at the first step; later batches may be longer, shorter or wider."""
    d = hf_dir(family)
    shapes = [(2, 12), (3, 16), (1, 8), (4, 5), (2, 12)]
    batches = [make_batches(VOCAB, 1, batch=b, seq=t, seed=10 + k, pad_id=0 if k == 1 else None)[0]
               for k, (b, t) in enumerate(shapes)]
    s = Session.from_pretrained(d, lr=LR, betas=BETAS, eps=EPS, checkpoint_every=2, micro_batch_size=2)
    _train_both_and_compare(family, s, lambda: load_reference(d, s.arch.model.config._attn_implementation),
                            batches, tmp_path)


def _train_both_and_compare(family, s, make_reference, batches, tmp_path):
    """Train the session and its plain-AdamW reference (built by ``make_reference()`` while the session is
    open) on ``batches``, export the session, close it, and compare losses and weights."""
    try:
        ref = make_reference()
        got = train_session(s, batches)
        want, _, _ = train_reference(ref, batches, lr=LR, betas=BETAS, eps=EPS, weight_decay=0.0)
        s.save_pretrained(tmp_path / "out")
    finally:
        s.close()
    _assert_matches(family, got, want, tmp_path / "out", ref)


@pytest.mark.parametrize("family", families("llama", "gpt_oss"))
def test_from_config_matches_reference_built_from_its_weights(tiny_config, family, tmp_path):
    """Session.from_config initialises unit by unit; the reference starts from those weights and the
    very config object the session holds."""
    cfg = tiny_config(family)
    s = Session.from_config(cfg, seed=3, lr=LR, betas=BETAS, eps=EPS)

    def reference():
        s.save_pretrained(tmp_path / "init")
        ref = AutoModelForCausalLM.from_config(s.config, dtype=torch.float32)
        init = AutoModelForCausalLM.from_pretrained(str(tmp_path / "init"), dtype=torch.float32)
        ref.load_state_dict(init.state_dict())
        return ref.train()

    _train_both_and_compare(family, s, reference, make_batches(VOCAB, 4), tmp_path)


def test_back_to_back_steps_do_not_deadlock(hf_dir):
    """Steps called back to back, the host Adam made slow (engine.delays): the next step must wait for
    the previous step's updates, never lose them, and train exactly as steps separated by a drain.
    Regression: AdamWorker.begin() used to reset the shared landed/arrivals while the previous step's
    updates were still running, which deadlocked the next step."""
    import contextlib
    import threading

    batches = make_batches(VOCAB, 4)
    twin = Session.from_pretrained(hf_dir("llama"), lr=LR)
    want = []
    for b in batches:
        want.append(twin.step(b).loss)
        twin.engine.drain()
    s = Session.from_pretrained(hf_dir("llama"), lr=LR)
    s.engine.delays["host-adam"] = 0.01  # seconds per unit update
    losses, errors = [], []

    def run():
        try:
            for b in batches:
                losses.append(s.step(b).loss)  # no drain between steps
        except BaseException as e:  # the abort below surfaces here
            errors.append(e)

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(timeout=6)  # four tiny steps take well under a second, even with the delay
    hung = t.is_alive()
    if hung:
        s.engine.abort.set()  # release the driver and the workers
        t.join(timeout=5)
    with contextlib.suppress(Exception):
        s.engine.drain()
        twin.engine.drain()
        same = all(torch.equal(s.store.units[u].master, twin.store.units[u].master) for u in s.store.order)
    for x in (s, twin):
        with contextlib.suppress(Exception):
            x.close()
    assert not hung, f"deadlocked after {len(losses)} steps"
    assert not errors, errors
    assert losses == want
    assert same
