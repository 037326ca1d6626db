"""Post-training on CUDA: the reference read through the h2d stream equals the weights it froze, and batched
generation with left padding equals transformers' on the same GPU. Marked gpu: skipped without CUDA."""
import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig

from megatrain_nb import Session

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


@pytest.fixture
def model_dir(tmp_path):
    torch.manual_seed(0)
    c = LlamaConfig(vocab_size=1024, hidden_size=256, intermediate_size=688, num_hidden_layers=4,
                    num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=512, eos_token_id=None)
    AutoModelForCausalLM.from_config(c).save_pretrained(tmp_path / "m")  # fp32 files
    return tmp_path / "m"


def _batch(B=4, T=96, seed=0):
    ids = torch.randint(0, 1024, (B, T), generator=torch.Generator().manual_seed(seed))
    return {"input_ids": ids, "labels": ids.clone()}


@pytest.mark.parametrize("chunk", [None, 4096])
@pytest.mark.parametrize("placement", ["auto", "stream", "host"])
def test_reference_on_cuda_equals_the_weights_it_froze(model_dir, tmp_path, monkeypatch, placement, chunk):
    """From the loaded fp32 files (cast through ``put``) and from a bf16 snapshot (read through the staging ring,
    in many reads when the chunk is small): the reference's log-probs equal the policy's at that moment, and stay
    so after training moved the policy."""
    from megatrain_nb.post import reference

    if chunk:
        monkeypatch.setattr(reference, "CHUNK", chunk)
    b = _batch()
    s = Session.from_pretrained(model_dir, device="cuda", lr=1e-3, placement=placement)
    try:
        assert torch.equal(s.logprobs(b, ref=True), s.logprobs(b))  # the files as loaded: the same bf16 weights
        for k in range(3):
            s.step(_batch(seed=k + 1))
        s.freeze_reference(tmp_path / "frozen")
        frozen = s.logprobs(b)
        for _ in range(2):  # twice: the ring and the layer buffers reused
            assert torch.equal(s.logprobs(b, ref=True), frozen)
        s.step(_batch(seed=9))
        assert (s.logprobs(b) - frozen).abs().max() > 1e-3  # the policy moved; the reference did not
        assert torch.equal(s.logprobs(b, ref=True), frozen)
    finally:
        s.close()


def test_batched_greedy_generation_with_left_padding_equals_hf_on_cuda(model_dir):
    """Prompts of different lengths, left-padded into one batch: each row's greedy tokens equal HF's greedy
    ``generate`` of that prompt alone, fp32 on the same GPU; sampling is seeded."""
    prompts = [torch.randint(0, 1024, (n,), generator=torch.Generator().manual_seed(n)) for n in (5, 17, 11)]
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).cuda().eval()
    want = [hf.generate(p.view(1, -1).cuda(), max_new_tokens=12, do_sample=False, pad_token_id=0)[0, len(p):].cpu()
            for p in prompts]
    del hf
    s = Session.from_pretrained(model_dir, device="cuda", dtype=torch.float32)
    try:
        for cache in (True, False):
            r = s.generate(prompts, max_new_tokens=12, cache_weights=cache)
            got = [c for c in r.sequences[:, r.prompt_width:]]
            for g, w in zip(got, want):
                assert torch.equal(g, w), (cache, g.tolist(), w.tolist())
        a = s.generate(prompts, max_new_tokens=8, do_sample=True, seed=3, num_return_sequences=2)
        b = s.generate(prompts, max_new_tokens=8, do_sample=True, seed=3, num_return_sequences=2)
        assert torch.equal(a.sequences, b.sequences) and a.sequences.max() < 1024
    finally:
        s.close()
