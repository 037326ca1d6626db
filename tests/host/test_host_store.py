"""host_store.carve (Note [Pinned arena]) and the pinned slabs HostStore carves with it.

Pinning itself needs CUDA; here the block allocator is a plain zeroed uint8 tensor, and what is
under test is the carving: sizes, dtypes, zeroes, alignment, no overlap, few blocks, little waste.
"""
from __future__ import annotations

import pytest
import torch

from conftest import make_config
from megatrain_nb.model.hf import load_architecture
from megatrain_nb.host.host_store import HostStore, carve

ALIGN = 4096


def _blocks():
    made = []

    def alloc(nbytes: int) -> torch.Tensor:
        made.append(torch.zeros(nbytes, dtype=torch.uint8))
        return made[-1]

    return made, alloc


def _nbytes(n: int, dtype: torch.dtype) -> int:
    return n * torch.tensor([], dtype=dtype).element_size()


def test_carved_slabs_are_disjoint_aligned_zeroed_views_of_power_of_two_blocks():
    want = {("emb", "master"): (3_111_649, torch.float32)}
    for i in range(12):
        want[(i, "master")] = (770_703 + i, torch.float32)
        want[(i, "grad")] = (770_703 + i, torch.bfloat16)
    made, alloc = _blocks()
    out = carve(want, alloc, align=ALIGN)
    assert out.keys() == want.keys()
    spans = []
    for k, (n, dt) in want.items():
        t = out[k]
        assert t.shape == (n,) and t.dtype == dt and not t.any(), k
        block = next(b for b in made if b.data_ptr() <= t.data_ptr() < b.data_ptr() + b.numel())
        start = t.data_ptr() - block.data_ptr()
        assert start % ALIGN == 0 and start + _nbytes(n, dt) <= block.numel(), k
        spans.append((t.data_ptr(), t.data_ptr() + _nbytes(n, dt)))
    spans.sort()
    assert all(a_end <= b_start for (_, a_end), (b_start, _) in zip(spans, spans[1:])), "slabs overlap"
    assert all(b.numel() & (b.numel() - 1) == 0 for b in made), "every block is a power of two"
    need = sum(-(-_nbytes(n, dt) // ALIGN) * ALIGN for n, dt in want.values())
    rounded_one_by_one = sum(1 << (_nbytes(n, dt) - 1).bit_length() for n, dt in want.values())
    total = sum(b.numel() for b in made)
    assert need <= total < need + max(_nbytes(n, dt) for n, dt in want.values())  # at most one slab's worth over
    assert total < rounded_one_by_one
    out[(0, "grad")].fill_(1)  # writes stay in their slab
    assert out[(0, "grad")].all() and not any(out[k].any() for k in want if k != (0, "grad"))


def test_a_slab_larger_than_the_rest_together_gets_its_own_block():
    made, alloc = _blocks()
    out = carve({"big": (10_000, torch.float32), "small": (10, torch.float32)}, alloc, align=64)
    assert [b.numel() for b in made][0] == 1 << (40_000 - 1).bit_length()
    assert out["big"].numel() == 10_000 and out["small"].numel() == 10


@pytest.mark.parametrize("settings", [dict(pin_master=True), dict(shadow_dtype=torch.bfloat16)],
                         ids=["pinned-master", "pinned-shadow"])
def test_store_carves_its_pinned_slabs_from_blocks(monkeypatch, settings):
    """What would be pinned on CUDA comes out of a few blocks; the moments and the embedding's fp32
    grads stay pageable; every slab is zeroed and the byte report counts only what is asked."""
    arch = load_architecture(make_config("llama"))
    made, alloc = _blocks()
    monkeypatch.setattr(HostStore, "_pinned_block", staticmethod(alloc))
    store = HostStore(arch, grad_dtype=torch.bfloat16, **settings)
    report = store.bytes_report()
    assert report["shadow"] == (sum(u.layout.numel for u in store.units.values()) * 2 if "shadow_dtype" in settings else 0)
    assert report["total"] == sum(report[k] for k in ("master", "grad", "exp_avg", "exp_avg_sq", "shadow"))
    in_blocks = lambda t: any(b.data_ptr() <= t.data_ptr() < b.data_ptr() + b.numel() for b in made)  # noqa: E731
    for u, unit in store.units.items():
        assert in_blocks(unit.master) == ("pin_master" in settings), u
        assert in_blocks(unit.grad) == (u != -1), u
        assert not in_blocks(unit.exp_avg) and not in_blocks(unit.exp_avg_sq)
        if "shadow_dtype" in settings:
            assert in_blocks(unit.shadow) and unit.shadow.dtype == torch.bfloat16
        assert not unit.master.any() and not unit.grad.any()
    assert 1 <= len(made) <= 4


def test_a_failed_block_falls_back_to_pinning_slab_by_slab(monkeypatch):
    def refuse(nbytes):
        raise RuntimeError("no pinned block of that size")

    monkeypatch.setattr(HostStore, "_pinned_block", staticmethod(refuse))
    monkeypatch.setattr(HostStore, "_alloc", staticmethod(lambda n, dtype, pin: torch.zeros(n, dtype=dtype)))
    arch = load_architecture(make_config("llama"))
    with pytest.warns(UserWarning, match="pinning each slab on its own"):
        store = HostStore(arch, grad_dtype=torch.bfloat16, pin_master=True)
    assert all(u.master.numel() == u.layout.numel for u in store.units.values())


def test_a_session_on_carved_slabs_trains_checkpoints_resumes_and_exports(monkeypatch, tmp_path):
    """On CUDA the masters share a few pinned blocks; everything that reads or writes slabs (AdamW,
    safetensors checkpoints, resume, the HF export) must not care. Forced here on the CPU."""
    from transformers import AutoModelForCausalLM

    from conftest import make_batches
    from megatrain_nb import Session
    from megatrain_nb import Session as _Session
    resume = _Session.resume
    from megatrain_nb.host.checkpoint import save_checkpoint

    made, alloc = _blocks()
    monkeypatch.setattr(HostStore, "_pinned_block", staticmethod(alloc))
    init = HostStore.__init__
    monkeypatch.setattr(HostStore, "__init__", lambda self, arch, **kw: init(self, arch, **{**kw, "pin_master": True}))
    cfg = make_config("llama")
    batches = make_batches(cfg.vocab_size, 3, batch=2, seq=8)
    s = Session.from_config(cfg, seed=0)
    shared = {u.master.untyped_storage().data_ptr() for u in s.store.units.values()}
    assert len(shared) < len(s.store.units)  # slabs do share blocks
    s.step(batches[0])
    save_checkpoint(s, tmp_path / "ck")
    s.save_pretrained(tmp_path / "hf")
    exported = s.store.views(0)["model.layers.0.mlp.up_proj.weight"].clone()
    want = [s.step(b).loss for b in batches[1:]]
    s.close()
    r = resume(tmp_path / "ck")
    assert [r.step(b).loss for b in batches[1:]] == want
    r.close()
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "hf")
    ref = dict(model.named_parameters())["model.layers.0.mlp.up_proj.weight"]
    assert torch.equal(ref.detach(), exported)


# ---- random init (HostStore.init_random) ------------------------------------------------------------
def _peak_cpu_bytes(fn) -> int:
    """The most bytes torch held allocated on the CPU at once while ``fn`` ran, from the profiler's allocation
    and free records (leaf events only, so an op's nested allocations count once)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    events = sorted((e for e in prof.events() if e.cpu_memory_usage and not e.cpu_children),
                    key=lambda e: e.time_range.start)
    held = peak = 0
    for e in events:
        held += e.cpu_memory_usage
        peak = max(peak, held)
    return peak


def _init_by_copies(store, seed: int) -> dict[str, torch.Tensor]:
    """Each unit initialised as a module of its own (``to_empty`` + ``_init_weights``, the unit's seed), the
    way a copy of the unit would be: the values ``init_random`` must write into the masters."""
    import copy

    arch, L, out = store.arch, store.num_layers, {}
    for u in store.order:
        torch.manual_seed(seed * 1_000_003 + u + 1)
        if 0 <= u < L:
            mods = [(arch.layers[u], store.units[u].prefix)]
        elif u == -1:
            mods = [(arch.embed, arch.embed_name.removesuffix("weight"))]
        else:
            mods = [(arch.norm, arch.norm_prefix)] + ([] if arch.tied else [(arch.head, arch.head_name.removesuffix("weight"))])
        for template, prefix in mods:
            mod = copy.deepcopy(template).to_empty(device="cpu")
            mod.apply(arch.model._init_weights)
            out.update({prefix + n: p.detach().clone() for n, p in mod.named_parameters()})
    return out


@pytest.mark.parametrize("family,tied", [("llama", False), ("qwen2", True), ("gpt_oss", False), ("qwen3_moe", False)])
def test_random_init_writes_into_the_masters_what_a_copy_of_each_unit_draws_and_holds_no_copy(family, tied):
    """``init_random`` equals initialising a copy of each unit (same seeds, bit for bit), without one: the most it
    holds at once is a small part of its largest unit (gpt-oss-20b's layer in fp32 was 3.1 GiB at the load's peak)."""
    from megatrain_nb import Session

    s = Session.from_config(make_config(family, tie_word_embeddings=tied, intermediate_size=256), seed=0, device="cpu")
    try:
        store = s.store
        largest = max(u.layout.numel for u in store.units.values()) * 4
        peak = _peak_cpu_bytes(lambda: store.init_random(7))
        want = _init_by_copies(store, 7)
        got = {k: v for u in store.order for k, v in store.views(u).items()}
        assert set(want) <= set(got) and all(torch.equal(got[k], v) for k, v in want.items())
        assert store.arch.tied == tied
        assert peak < largest // 4, (peak, largest)
        assert _peak_cpu_bytes(lambda: _init_by_copies(store, 7)) >= largest  # what the bound tells apart
    finally:
        s.close()
