"""megatrain_nb.post.reference: the frozen model streamed from safetensors equals the HF model of those files,
after training changed the policy, and holds no copy of the model."""
import pytest
import torch

from megatrain_nb import Session
from megatrain_nb.inference import _run
from megatrain_nb.model.binding import call
from conftest import make_batches


def _logits(s, ids, *, ref: bool) -> torch.Tensor:
    """Forward only, as inference.evaluate runs it: (B, T, V) fp32 logits from the reference's or the policy's
    weights; the reference as a weights source (Note: [Weights source] in inference.py: the embedding table first)."""
    eng, arch = s.engine, s.arch

    def fwd():
        H = arch.embed.weight.shape[1]
        if ref:
            it = s.reference.stream(eng, head=True)
            unit, embed = next(it)
            assert unit == -1 and embed[arch.embed_name].shape == arch.embed.weight.shape
            rows = embed[arch.embed_name].index_select(0, ids.flatten())
        else:
            it = eng.stream_layers(head=True)
            E, box = eng._gather({"input_ids": ids})
            eng._ready(box)
            rows = E.reshape(-1, H)
        h, calls = arch.prelude(arch.embed_rows(rows, tuple(ids.shape)), None)
        for unit, params in it:
            if unit < eng.L:
                h = call(eng._template(unit), params, h, *calls[unit][0], **calls[unit][1])
            else:
                out = arch.logits(params, h).float()
        return out
    return _run(s, fwd)


@pytest.mark.parametrize("family", ["llama", "llama_tied", "mixtral"])
def test_reference_equals_the_loaded_model_after_training(hf_dir, family):
    from conftest import load_reference

    d = hf_dir(family)
    s = Session.from_pretrained(d, device="cpu", dtype=torch.float32, lr=1e-2)
    try:
        batches = make_batches(s.arch.embed.weight.shape[0], 3)
        for b in batches:
            s.step(b)
        ids = batches[0]["input_ids"]
        got, policy = _logits(s, ids, ref=True), _logits(s, ids, ref=False)
        hf = load_reference(d, s.arch.model.config._attn_implementation).eval()
        with torch.no_grad():
            want = hf(input_ids=ids).logits.float()
        assert (got - want).abs().max() < 1e-5
        assert (policy - want).abs().max() > 1e-3  # training did move the policy
        # no model copy: one layer buffer, the head buffer and the staging ring: 2 slots, each the largest
        # tensor of the files (at most CHUNK bytes)
        from megatrain_nb.post.reference import CHUNK, header

        lay = max(s.store.units[i].layout.numel for i in range(s.arch.num_layers))
        largest = max(b - a for f in s.reference.files for *_, a, b in header(f)[1].values())
        assert s.reference.host_bytes() == 4 * (lay + s.engine.head_layout.numel) + 2 * min(largest, CHUNK)
        assert s.reference.host_bytes() < 4 * s.store.num_params()  # less than one fp32 copy of the model
    finally:
        s.close()


def test_freeze_reference_snapshots_bf16(tiny_config, tmp_path):
    s = Session.from_config(tiny_config("llama"), device="cpu", dtype=torch.float32, lr=1e-2)
    try:
        assert s.reference is None
        batches = make_batches(s.arch.embed.weight.shape[0], 3)
        s.step(batches[0])
        ref = s.freeze_reference(tmp_path / "ref")
        assert s.reference is ref and (tmp_path / "ref" / "model.safetensors").exists()
        ids = batches[1]["input_ids"]
        before = _logits(s, ids, ref=False)
        for b in batches[1:]:
            s.step(b)
        got = _logits(s, ids, ref=True)
        assert (got - before).abs().max() < 0.05  # bf16 weights of the frozen policy
        assert (_logits(s, ids, ref=False) - before).abs().max() > 0.05
        tmp_ref = s.freeze_reference()  # a temporary directory, deleted with the object
        where = tmp_ref.path
        assert where.exists()
        s.reference = tmp_ref = None
        import gc
        gc.collect()
        assert not where.exists()
    finally:
        s.close()


def test_reference_refuses_another_models_files(hf_dir, tmp_path):
    from megatrain_nb.post.reference import Reference

    s = Session.from_pretrained(hf_dir("llama"), device="cpu")
    try:
        with pytest.raises(ValueError, match="does not have"):
            Reference(hf_dir("qwen3"), s.store)
        with pytest.raises(FileNotFoundError):
            Reference(tmp_path, s.store)
    finally:
        s.close()


def test_reference_read_through_small_staging_chunks_equals_the_model(hf_dir, monkeypatch):
    """Tensors cut into many reads through a 2-slot ring of 512 bytes (Note: [Reference reads]) land where
    one read of each would put them: the logits equal the HF model's, twice in a row (the ring is reused)."""
    from conftest import load_reference
    from megatrain_nb.post import reference

    monkeypatch.setattr(reference, "CHUNK", 512)
    d = hf_dir("llama_tied")
    s = Session.from_pretrained(d, device="cpu", dtype=torch.float32)
    try:
        ids = make_batches(s.arch.embed.weight.shape[0], 1)[0]["input_ids"]
        hf = load_reference(d, s.arch.model.config._attn_implementation).eval()
        with torch.no_grad():
            want = hf(input_ids=ids).logits.float()
        for _ in range(2):
            assert (_logits(s, ids, ref=True) - want).abs().max() < 1e-5
        assert s.reference._bufs[("ring", False)].shape == (2, 512)
    finally:
        s.close()


def test_a_reference_file_cut_short_names_the_problem(tiny_config, tmp_path):
    """A snapshot rewritten or cut while in use: the pass raises an OSError that says so, and the policy trains on."""
    s = Session.from_config(tiny_config("llama"), device="cpu", dtype=torch.float32, lr=1e-2)
    try:
        b = make_batches(s.arch.embed.weight.shape[0], 2)
        ref = s.freeze_reference(tmp_path / "ref")
        f = ref.files[0]
        f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])  # the same inode: the open descriptor sees it
        with pytest.raises(OSError, match="rewritten or cut after the reference was made"):
            s.logprobs(b[0], ref=True)  # bf16 files, fp32 compute: read through the map (cast)
        import os

        from megatrain_nb.post.reference import read_into

        fd = os.open(f, os.O_RDONLY)  # the plain reads (compute-dtype files) likewise
        try:
            with pytest.raises(OSError, match="ended .* bytes early"):
                read_into(fd, torch.empty(f.stat().st_size + 8, dtype=torch.uint8), 0)
        finally:
            os.close(fd)
        assert s.step(b[1]).loss > 0  # nothing of the policy was touched
    finally:
        s.close()
