"""Passes on CUDA (Note: [Passes] in step/passes.py): in bf16, a pass a micro-batch sums the gradients as
``micro_batch_size`` does, whether they wait in a resident buffer, the head's grad slot, the pinned host grad
slab (added through the staging) or, the embedding's rows, on the device. Marked gpu: skipped without CUDA."""
import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig

from megatrain_nb import Session

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


@pytest.fixture(params=[False, True], ids=["untied", "tied"])
def model_dir(tmp_path, request):
    torch.manual_seed(0)
    c = LlamaConfig(vocab_size=1024, hidden_size=256, intermediate_size=688, num_hidden_layers=4,
                    num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=512,
                    tie_word_embeddings=request.param)
    AutoModelForCausalLM.from_config(c).save_pretrained(tmp_path / "m")
    return tmp_path / "m"


def _batches(n=3, B=4, T=128):
    g = torch.Generator().manual_seed(0)
    out = []
    for _ in range(n):
        ids = torch.randint(0, 1024, (B, T), generator=g)
        out.append({"input_ids": ids, "labels": ids.clone()})
    return out


def _train(d, **settings):
    s = Session.from_pretrained(d, device="cuda", lr=1e-3, **settings)
    try:
        losses = [s.step(b).loss for b in _batches()]
        s.engine.drain()
        return losses, {u: (x.master.clone(), x.exp_avg.clone(), x.exp_avg_sq.clone()) for u, x in s.store.units.items()}
    finally:
        s.close()


@pytest.mark.parametrize("placement", ["host", "auto", "mix"])
def test_passes_equal_micro_batches_on_cuda(model_dir, placement):
    where = {"mix": {-1: "resident", 0: "resident", 4: "resident"}}.get(placement, placement)
    want_loss, want = _train(model_dir, micro_batch_size=1, placement=where)
    got_loss, got = _train(model_dir, pass_batch_size=1, placement=where)
    assert got_loss == want_loss
    for u in want:
        for a, b, what in zip(got[u], want[u], ("master", "exp_avg", "exp_avg_sq")):
            assert torch.equal(a, b), f"unit {u} {what}: {(a - b).abs().max().item()}"


def test_passes_refuse_stream_on_cuda(model_dir):
    s = Session.from_pretrained(model_dir, device="cuda", lr=1e-3, placement="stream", pass_batch_size=2)
    try:
        with pytest.raises(ValueError, match="placement=\"auto\" or \"host\" with passes"):
            s.step(_batches(1)[0])
    finally:
        s.close()
