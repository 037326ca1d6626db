"""split_master.py: the codec is exact on every kind of fp32 (ties, signs, zeros, subnormals, extremes)."""
import pytest
import torch

from megatrain_nb.host import split_master as sm


def _values(n=200_003 * 2, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, generator=g) * torch.logspace(-40, 38, n).pow(torch.rand(n, generator=g))
    bits = x.view(torch.int32)
    bits[:4096] = (bits[:4096] & ~0xFFFF) | 0x8000  # exact ties: half of them round down to an even R
    specials = torch.tensor([0.0, -0.0, 1e-45, -1e-45, 1.17e-38, -3.4e38, 3.4e38, 1.0, -1.0,
                             float(torch.finfo(torch.float32).max)])
    x[4096:4096 + len(specials)] = specials
    return x


def test_split_then_join_gives_every_bit_back():
    m = _values()
    v = torch.rand(m.numel()) * 1e-3
    r, d = torch.empty(m.numel(), dtype=torch.int16), torch.empty(m.numel(), dtype=torch.int16)
    v0 = v.clone()
    sm.split_into(m, r, d, v)
    assert torch.equal(r.view(torch.bfloat16), m.to(torch.bfloat16)), "R is the bf16 weights the device holds"
    ties = (m.view(torch.int32) - r.to(torch.int32) * 65536) == 2 ** 15
    assert ties.sum() > 1000, "the test must cover the tie that needs the extra bit"
    assert torch.equal(v.view(torch.int32) < 0, ties)
    out = torch.empty_like(m)
    sm.join_into(out, r, d, v)
    assert torch.equal(out.view(torch.int32), m.view(torch.int32))
    assert torch.equal(v.view(torch.int32), v0.view(torch.int32))


def test_in_place_host_slab_round_trip():
    m = _values(seed=1)
    v = torch.rand(m.numel())
    want_m, want_v = m.clone(), v.clone()
    sm.split_(m, v)
    assert not torch.equal(m.view(torch.int32), want_m.view(torch.int32))
    assert torch.equal(sm.weights(m), want_m.to(torch.bfloat16))
    sm.join_(m, v)
    assert torch.equal(m.view(torch.int32), want_m.view(torch.int32))
    assert torch.equal(v.view(torch.int32), want_v.view(torch.int32))


def test_chunked_passes_equal_one_pass(monkeypatch):
    m = _values(seed=2)
    v = torch.rand(m.numel())
    outs = []
    for chunk in (sm.CHUNK, 4096 + 64):
        monkeypatch.setattr(sm, "CHUNK", chunk)
        r, d, vv = torch.empty(m.numel(), dtype=torch.int16), torch.empty(m.numel(), dtype=torch.int16), v.clone()
        sm.split_into(m, r, d, vv)
        outs.append((r, d, vv.view(torch.int32)))
    assert all(torch.equal(a, b) for a, b in zip(*outs))


@pytest.mark.parametrize("dtype,numel,ok", [(torch.bfloat16, 64, True), (torch.bfloat16, 63, False),
                                             (torch.float16, 64, False), (torch.float32, 64, False)])
def test_applies_only_to_bf16_and_even_units(dtype, numel, ok):
    assert sm.applies(dtype, numel) is ok


# ---- the engine with split masters (CPU, bf16 compute: the path CUDA takes) ----------------------------
from conftest import VOCAB, families, make_batches, train_session  # noqa: E402
from megatrain_nb import Session  # noqa: E402


def _run(d, batches, split, slots, mix, checkpoint=None, **kw):
    """Losses, then every unit's (master, exp_avg, exp_avg_sq) bits after a drain; saves a checkpoint after
    two steps when given a path."""
    s = Session.from_pretrained(d, lr=1e-3, weight_decay=0.1, dtype=torch.bfloat16, placement=mix,
                                split_master=split, weight_slots=slots, **kw)
    try:
        losses = []
        for n, b in enumerate(batches):
            losses.append(s.step(b).loss)
            if checkpoint is not None and n == 1:
                s.save_checkpoint(checkpoint)
        if split:
            streamed = {u for u, p in mix.items() if p == "device" and 0 <= u < s.engine.L}
            assert s.store.split == streamed
            with pytest.raises(RuntimeError, match="drain"):
                s.store.views(min(streamed))
        s.engine.drain()
        assert not s.store.split  # a drain gives readers fp32 masters
        state = {u: [t.clone().view(torch.int32) for t in (x.master, x.exp_avg, x.exp_avg_sq)]
                 for u, x in s.store.units.items()}
        return losses, state, s.trace.to_dataframe(), s.store.units[0].layout.numel
    finally:
        s.close()


@pytest.mark.parametrize("slots", ["each", 2], ids=["held", "two_slots"])
@pytest.mark.parametrize("family", families("llama_tied", "llama"))
def test_split_masters_train_bitwise_equal_to_fp32_masters(hf_dir, family, slots):
    """Note: [Split master]: the same losses and the same master and moment bits as fp32 slabs, where D
    alone comes in (a weight slot per layer) and where both planes do (two slots)."""
    import json
    d = hf_dir(family)
    L = json.loads((d / "config.json").read_text())["num_hidden_layers"]
    slots = L if slots == "each" else slots
    mix = {0: "device", L - 1: "device"} | ({-1: "device", L: "device"} if family == "llama_tied" else {})
    batches = make_batches(VOCAB, 4)
    l0, s0, df0, n = _run(d, batches, False, slots, mix)
    l1, s1, df1, _ = _run(d, batches, True, slots, mix)
    assert l1 == l0
    assert all(torch.equal(a, b) for u in s0 for a, b in zip(s0[u], s1[u]))
    state_in = lambda df: set(df[(df.op == "state-in") & (df.layer == 0)].bytes)  # noqa: E731 (the last step's)
    assert state_in(df0) == {12 * n}
    assert state_in(df1) == {(10 if slots == L else 12) * n}  # D alone, or both planes
    weights_in = lambda df: set(df[(df.lane == "h2d") & (df.op == "h2d") & (df.layer == 0)].bytes)  # noqa: E731
    assert weights_in(df1) <= {2 * n}  # R, bf16 as it is (held: none at all)


def test_split_masters_resume_bitwise_and_checkpoints_hold_fp32(hf_dir, tmp_path):
    """A checkpoint taken mid-run holds fp32 masters (the format is unchanged); resumed, the run goes on
    bit for bit, and a run resumed without splitting equals it too."""
    import json
    d = hf_dir("llama")
    L = json.loads((d / "config.json").read_text())["num_hidden_layers"]
    mix = {0: "device", 1: "device"}
    batches = make_batches(VOCAB, 4)
    want, _, _, _ = _run(d, batches, True, L, mix, checkpoint=tmp_path / "ck")
    for split in (True, False):
        r = Session.resume(tmp_path / "ck", split_master=split)
        try:
            assert train_session(r, batches[2:]) == want[2:]
        finally:
            r.close()


def test_split_master_true_needs_bf16():
    from megatrain_nb import EngineConfig
    with pytest.raises(ValueError, match="split_master=True needs dtype=torch.bfloat16"):
        EngineConfig(device="cpu", dtype=torch.float32, split_master=True)


def test_enabled_resolves_the_setting_and_names_why_true_cannot_apply():
    assert sm.enabled(None, bf16=True, shadow=False, shared=False)
    assert not sm.enabled(False, bf16=True, shadow=False, shared=False)
    assert not sm.enabled(None, bf16=True, shadow=False, shared=True)
    with pytest.raises(ValueError, match="pin_store=True"):
        sm.enabled(True, bf16=True, shadow=True, shared=False)
