"""megatrain_nb.data.packing through Session.step: packed examples attend only to themselves.

A packed row's loss equals the token-weighted mean of its examples run one per row, and its
gradients are the token-weighted sum of theirs: a neighbour changes nothing. lr=0 keeps the
weights fixed across the steps compared; each step's gradients are read from the host grad slabs.
"""
import pytest
import torch

from megatrain_nb import Session
from megatrain_nb.data import IGNORE, sft_batches
from megatrain_nb.data.packing import document_starts, install, suits_varlen, varlen_kwargs
from sft_helpers import chats, make_model_dir, make_tokenizer, write_jsonl


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    tok = make_tokenizer()
    return make_model_dir(tmp_path_factory.mktemp("m") / "tiny", tok)


def _grads(s: Session) -> dict[int, torch.Tensor]:
    s.engine.drain()
    return {u: unit.grad.clone() for u, unit in s.store.units.items()}


def _row(examples, seq: int, pad_id: int, packed: bool = True) -> dict:
    """One row of ``examples`` (ids, labels) followed by padding; positions restart per example if ``packed``."""
    ids, labels, pos = [], [], []
    for e_ids, e_labels in examples:
        ids += e_ids
        labels += e_labels
        pos += list(range(len(e_ids))) if packed else list(range(len(pos), len(pos) + len(e_ids)))
    n = seq - len(ids)
    return {"input_ids": torch.tensor([ids + [pad_id] * n]), "labels": torch.tensor([labels + [IGNORE] * n]),
            "position_ids": torch.tensor([pos + list(range(n))])}


def _supervised(b) -> int:
    return int((b["labels"][:, 1:] != IGNORE).sum())


def test_packed_row_equals_its_examples_one_per_row(model_dir, tmp_path):
    tok_examples = sft_batches(write_jsonl(tmp_path / "c.jsonl", chats(3)), model_dir, batch=1, seq=256).examples
    a, b = tok_examples[0], tok_examples[1]
    pad = 0
    s = Session.from_pretrained(model_dir, lr=0.0, grad_ring=False)  # slabs: the gradients are compared
    try:
        alone = [_row([e], 256, pad) for e in (a, b)]
        losses, grads = [], []
        for row in alone:
            losses.append(s.step(row).loss)
            grads.append(_grads(s))
        both = _row([a, b], 256, pad)
        loss_ab = s.step(both).loss
        g_ab = _grads(s)
        n = [_supervised(r) for r in alone]
        assert abs(loss_ab - (losses[0] * n[0] + losses[1] * n[1]) / sum(n)) < 1e-6
        for u in g_ab:  # gradient of a token-weighted mean: the examples' own gradients, weighted
            want = (grads[0][u] * n[0] + grads[1][u] * n[1]) / sum(n)
            err = (g_ab[u] - want).norm() / want.norm()
            assert err < 1e-5, (u, float(err))
        # the check can fail: the same row attending across the seam (positions running on) differs
        s.step(_row([a, b], 256, pad, packed=False))
        g_cross = _grads(s)
        assert (g_cross[0] - g_ab[0]).norm() / g_ab[0].norm() > 1e-3
    finally:
        s.close()


def test_packed_batch_loss_equals_unpacked_batch(model_dir, tmp_path):
    f = write_jsonl(tmp_path / "c.jsonl", chats(6))
    packed = next(sft_batches(f, model_dir, batch=2, seq=200, seed=2))
    n_examples = int(((packed["position_ids"] == 0) & (packed["input_ids"] != 0)).sum())
    unpacked = next(sft_batches(f, model_dir, batch=n_examples, seq=128, pack=False, seed=2))
    assert _supervised(packed) == _supervised(unpacked)  # the same examples, as rows of their own
    s = Session.from_pretrained(model_dir, lr=0.0)
    try:
        assert abs(s.step(packed).loss - s.step(unpacked).loss) < 1e-6
    finally:
        s.close()


def test_varlen_kwargs_from_restarts():
    pos = torch.tensor([[0, 1, 2, 0, 1, 0], [0, 1, 2, 3, 0, 1]])
    assert document_starts(pos).tolist() == [[True, False, False, True, False, True],
                                             [True, False, False, False, True, False]]
    kw = varlen_kwargs(pos, torch.device("cpu"))
    assert kw["cu_seq_lens_q"].tolist() == [0, 3, 5, 6, 10, 12] and kw["max_length_q"] == 4
    assert kw["cu_seq_lens_q"].dtype == torch.int32


def test_install_chooses_varlen_only_where_it_applies():
    from transformers import LlamaConfig, MistralConfig

    cfg = LlamaConfig(num_hidden_layers=1, hidden_size=32, intermediate_size=64, num_attention_heads=4)
    cfg._attn_implementation = "sdpa"
    assert install(cfg, torch.device("cpu"), torch.bfloat16) == "sdpa"  # no CUDA here: transformers' masks
    assert "bf16" in suits_varlen(cfg, torch.float32)
    m = MistralConfig(num_hidden_layers=1, hidden_size=32, intermediate_size=64, num_attention_heads=4, sliding_window=8)
    m._attn_implementation = "sdpa"
    assert "sliding" in suits_varlen(m, torch.bfloat16)
    assert suits_varlen(cfg, torch.bfloat16) is None


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_varlen_step_matches_transformers_masks_on_cuda(model_dir, tmp_path):
    """On CUDA in bf16: the varlen path's loss and gradients match transformers' block mask path."""
    from megatrain_nb.data.packing import VARLEN, varlen_available

    if not varlen_available():
        pytest.skip("this torch has no torch.nn.attention.varlen")
    f = write_jsonl(tmp_path / "c.jsonl", chats(12))
    batch = next(sft_batches(f, model_dir, batch=2, seq=256))
    out = {}
    for varlen in (True, False):
        s = Session.from_pretrained(model_dir, lr=0.0, device="cuda", dtype=torch.bfloat16,
                                    grad_ring=False)  # slabs: the gradients are compared
        if not varlen:
            s.arch.config._attn_implementation = "sdpa"
        assert (s.arch.config._attn_implementation == VARLEN) == varlen
        loss = s.step(batch).loss
        out[varlen] = (loss, _grads(s))
        s.close()
    assert abs(out[True][0] - out[False][0]) < 2e-2 * abs(out[False][0])
    for u in out[True][1]:
        a, b = out[True][1][u].float(), out[False][1][u].float()
        assert (a - b).norm() / b.norm() < 5e-2, u
