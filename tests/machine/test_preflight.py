"""preflight.py: byte counts equal what HostStore and Engine allocate; a configuration that does not
fit fails before anything is allocated, naming GiB needed vs available and the settings to change."""
from __future__ import annotations

import dataclasses
import os
import types

import pytest
import torch

from conftest import FAMILIES, make_config
from megatrain_nb import Session
from megatrain_nb.config import MOMENT_STAGING_BYTES
from megatrain_nb.host import compact_state
from megatrain_nb.machine import preflight
from megatrain_nb.config import MOMENT_STAGING_BYTES, EngineConfig
from megatrain_nb.model.hf import load_architecture
from megatrain_nb.host.host_store import HostStore
from megatrain_nb.machine.preflight import PreflightError, check, estimate, gib, oom_advice


def _bound(store: HostStore) -> dict:
    """``store.bytes_report()`` with the embedding's gradient rows at the most a step can touch, the whole table: what
    estimate counts without a step's shape (Note: [Embedding rows] in host/embed_grad.py; none are held before a
    step)."""
    rep = store.bytes_report()
    if store.rows is None:
        return rep
    bound = (store.rows.rows + 1) * 4 * store.rows.width + 8 * store.rows.rows  # and take's zero row
    total = rep["total"] - rep["grad_rows"] + bound
    return {**rep, "grad_rows": bound, "total": total, "bytes_per_param": total / rep["params"]}


def _fake_ram(monkeypatch, available: int, total: int = 1 << 40) -> None:
    import psutil

    monkeypatch.setattr(psutil, "virtual_memory", lambda: types.SimpleNamespace(available=available, total=total))


def _fake_cuda(monkeypatch, free: int, **settings) -> EngineConfig:
    """An EngineConfig that says "cuda" on this CPU-only machine, with ``free`` device bytes."""
    cfg = EngineConfig(**settings)
    cfg.device = "cuda"  # after validation, which would refuse it here
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (free, max(free, 1 << 40)))  # budget.device_free reads it
    return cfg


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("family", FAMILIES)
def test_store_estimate_equals_bytes_report(family, dtype):
    arch = load_architecture(make_config(family))
    want = HostStore(arch, grad_dtype=dtype).bytes_report()  # slabs (Note: [Gradient ring])
    assert estimate(arch, EngineConfig(dtype=dtype, grad_ring=False))["store"] == want
    assert estimate(arch.config, EngineConfig(dtype=dtype, grad_ring=False))["store"] == want  # from a config, too
    store = HostStore(arch, grad_dtype=dtype, slabs=None)
    ring = _bound(store)
    assert estimate(arch, EngineConfig(dtype=dtype))["store"] == ring and ring["grad_ring"] > 0
    V, H = arch.embed.weight.shape
    if arch.tied:  # only the embedding's fp32 slab: the head's gradient lands in it whole
        assert store.rows is None and ring["grad"] == 4 * V * H and ring["grad_rows"] == 0
    else:  # no slab at all: the embedding's touched rows, at most the whole table
        assert ring["grad"] == 0 and ring["grad_rows"] == (V + 1) * 4 * H + 8 * V
    assert estimate(arch, EngineConfig(dtype=dtype), batch=2, seq=8)["store"]["grad_rows"] == (
        0 if arch.tied else (min(V, 16) + 1) * 4 * H + 8 * min(V, 16))  # a step's shape bounds them by its tokens
    assert estimate(arch, EngineConfig(dtype=dtype), grad_clip=1.0)["store"] == want  # clipping keeps the slabs


@pytest.mark.parametrize("family", ["llama", "llama_tied", "mixtral"])
def test_store_estimate_with_pinned_shadow(family, monkeypatch):
    """pin_store adds a compute-dtype shadow; pinning is faked here (no CUDA), the sizes are real."""
    monkeypatch.setattr(HostStore, "_pinned_block", staticmethod(lambda nbytes: torch.zeros(nbytes, dtype=torch.uint8)))
    arch = load_architecture(make_config(family))
    want = _bound(HostStore(arch, grad_dtype=torch.bfloat16, shadow_dtype=torch.bfloat16, slabs=None))
    cfg = _fake_cuda(monkeypatch, 1 << 40, dtype=torch.bfloat16, pin_store=True)
    est = estimate(arch, cfg)
    assert est["store"] == want and est["store"]["shadow"] > 0 and est["settings"]["pin_store"] is True


@pytest.mark.parametrize("family", ["llama", "llama_tied"])
def test_engine_buffers_equal_what_the_engine_allocates(family):
    s = Session.from_config(make_config(family), seed=0, weight_slots=3, transfer_chunk_bytes=1 << 20,
                            pinned_budget_bytes=8 << 20)
    e = s.engine
    nbytes = lambda ts: sum(t.numel() * t.element_size() for t in ts)  # noqa: E731
    est = estimate(s)
    assert est["host"]["staging"] == nbytes(e.io.staging.bufs + e.io.gstaging)
    dev = est["device"]
    assert dev["weight_slots"] == nbytes(e.slots) and dev["grad_slots"] == nbytes(e.gslots)
    assert dev["head_slots"] == nbytes([e.head_slot, e.head_gslot])
    assert est["host"]["store"] == _bound(s.store)["total"]  # as allocated, the embedding's rows at their bound
    assert est["host"]["device_buffers"] == dev["needed"]  # on "cpu" the device is host RAM
    s.close()


def test_cast_on_device_pins_the_master_and_adds_device_landing_buffers(monkeypatch):
    arch = load_architecture(make_config("llama"))
    cfg = _fake_cuda(monkeypatch, 1 << 40, dtype=torch.bfloat16, transfer_chunk_bytes=1 << 20,
                     pinned_budget_bytes=8 << 20, cast_on_device=False, pin_store=None)
    plain = estimate(arch, cfg)
    cfg.cast_on_device = True  # after validation (needs CUDA)
    est = estimate(arch, cfg)
    assert est["store"]["shadow"] == 0 and est["store"]["total"] == plain["store"]["total"] - plain["store"]["shadow"]
    late = 2 * MOMENT_STAGING_BYTES  # "auto" on CUDA: moments' staging too (Note: [Late moments])
    chunk = (est["host"]["staging"] - late) // 8 // 2  # 8 bf16 buffers of one chunk each (Note: [Staging])
    assert est["device"]["cast_stage"] == 2 * chunk * 4 and plain["device"]["cast_stage"] == 0


def test_activations_follow_the_settings():
    arch = load_architecture(make_config("llama"))
    small = estimate(arch, batch=2, seq=12)["device"]
    big = estimate(arch, batch=8, seq=12)["device"]
    assert big["activations"] == 4 * small["activations"] and big["logits"] == 4 * small["logits"]
    keep_all = estimate(arch, EngineConfig(checkpoint_every=0), batch=8, seq=12)["device"]
    recompute = estimate(arch, EngineConfig(checkpoint_every=1), batch=8, seq=12)["device"]
    assert recompute["activations"] < keep_all["activations"]
    mb = estimate(arch, EngineConfig(micro_batch_size=2), batch=8, seq=12)["device"]
    assert mb["logits"] == big["logits"] // 4
    assert estimate(arch)["device"]["activations"] == 0  # no shape: buffers only
    with pytest.raises(ValueError, match="both batch and seq"):
        estimate(arch, batch=2)


def test_short_host_ram_names_both_numbers(monkeypatch):
    arch = load_architecture(make_config("llama"))
    _fake_ram(monkeypatch, available=1000)
    est = estimate(arch, batch=2, seq=12)  # estimate never raises
    assert not est["fits_host"] and not est["fits"] and est["host"]["available"] == 1000
    with pytest.raises(PreflightError) as info:
        check(arch, batch=2, seq=12)
    msg = str(info.value)
    assert isinstance(info.value, MemoryError) and isinstance(info.value, ValueError)
    assert f"needs {gib(est['host']['needed'])}" in msg and f"{gib(1000)} available" in msg
    assert "smaller model" in msg and "checkpoint_every=1" in msg and "micro_batch_size=1" in msg


def test_short_host_ram_with_pinned_store_suggests_pin_store_false(monkeypatch):
    arch = load_architecture(make_config("llama", vocab_size=600_000))  # on meta: nothing is allocated
    cfg = _fake_cuda(monkeypatch, 1 << 40, dtype=torch.bfloat16, pin_store=True)
    _fake_ram(monkeypatch, available=1 << 20)
    est = estimate(arch, cfg)
    assert est["settings"]["pinned_budget_bytes"] == 512 << 20 and est["host"]["staging"] > 256 << 20  # 8 chunks (config.pinned_budget)
    with pytest.raises(PreflightError, match=r"pin_store=False \(saves .* GiB\).*pinned_budget_bytes=134217728"):
        check(arch, cfg)


def test_short_device_memory_names_both_numbers(monkeypatch):
    arch = load_architecture(make_config("llama"))
    cfg = _fake_cuda(monkeypatch, free=10_000, weight_slots=4, dtype=torch.float32)
    with pytest.raises(PreflightError) as info:
        check(arch, cfg, batch=4, seq=12)
    msg = str(info.value)
    est = estimate(arch, cfg, batch=4, seq=12)
    assert est["fits_host"] and not est["fits_device"]
    assert f"needs {gib(est['device']['needed'])}, {gib(10_000)} free" in msg
    for advice in ("weight_slots=2 (now 4", "micro_batch_size=2", "checkpoint_every=1", "dtype=torch.bfloat16",
                   "device='cpu'"):
        assert advice in msg, (advice, msg)
    assert est["device"]["workspace"] > 0 and est["host"]["device_buffers"] == 0


def test_fits_returns_the_estimate():
    arch = load_architecture(make_config("llama"))
    est = check(arch, batch=2, seq=12)
    assert est["fits"] and est["host"]["needed"] < est["host"]["available"]


def test_oom_advice():
    err = torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB.\n(details)")
    cfg = EngineConfig(micro_batch_size=8, checkpoint_every=0, weight_slots=3, loss_chunk_tokens=1024)
    text = oom_advice(err, cfg, (8, 4096))
    assert "batch 8 x seq 4096" in text and "Tried to allocate 2.00 GiB" in text and "(details)" not in text
    for advice in ("micro_batch_size=4 (now 8", "checkpoint_every=1 (now 0", "weight_slots=2 (now 3",
                   "loss_chunk_tokens=512 (now 1024: 1024 positions a chunk)"):
        assert advice in text, (advice, text)
    assert "device='cpu'" not in text  # already there
    # the default (None) takes 1024 tokens a chunk: 128 positions at 8 rows, nothing to halve; 1024 at one row
    auto = dataclasses.replace(cfg, loss_chunk_tokens=None)
    assert "loss_chunk_tokens" not in oom_advice(err, auto, (8, 4096))
    assert "loss_chunk_tokens=512 (now None: 1024 positions" in oom_advice(err, auto, (1, 4096))
    assert oom_advice(err, dataclasses.replace(cfg, micro_batch_size=1), torch.Size([1, 16])).count("micro_batch") == 0


def test_invalid_pin_store_is_a_value_error():
    arch = load_architecture(make_config("llama"))
    with pytest.raises(ValueError, match="pin_store=True needs device='cuda'"):
        estimate(arch, EngineConfig(pin_store=True))


def test_session_pinning_rule_is_the_one_used(monkeypatch):
    """estimate resolves pin_store/cast_on_device=None with the one rule Session uses too
    (preflight.resolve_pinning)."""
    import megatrain_nb.machine.preflight as preflight_mod

    arch = load_architecture(make_config("llama"))
    monkeypatch.setattr(preflight_mod, "resolve_pinning", lambda cfg, arch, **kw: (True, False))
    assert estimate(arch)["store"]["shadow"] > 0


def _store_bytes(arch, **kw) -> int:
    """The store as HostStore allocates it under these settings, with no pinned copy (a CPU estimate)."""
    return estimate(arch, EngineConfig(device="cpu"), **kw)["store"]["total"]


@pytest.mark.parametrize("settings, ram, want", [
    ({}, lambda store, copy: 1.01 * store, (False, True)),  # auto: the store fits in 90% of RAM: pin the fp32 master, cast on the device
    ({}, lambda store, copy: 0.99 * store, (False, False)),
    ({"cast_on_device": False}, lambda store, copy: 1.01 * (store + copy), (True, False)),  # a pinned copy, where it fits too
    ({"cast_on_device": False}, lambda store, copy: 0.99 * (store + copy), (False, False)),
    ({"pin_store": True}, lambda store, copy: 1, (True, False)),  # explicit settings are obeyed
    ({"pin_store": False}, lambda store, copy: 100 * store, (False, False)),
    ({"cast_on_device": True}, lambda store, copy: 1, (False, True)),
])
def test_pinning_rule(monkeypatch, settings, ram, want):
    """Auto pinning on CUDA by host RAM (90% usable) against the store's bytes, a pinned copy's beside it."""
    arch = load_architecture(make_config("llama"))
    params = sum(p.numel() for p in arch.model.parameters())
    cfg = _fake_cuda(monkeypatch, 1 << 40)
    _fake_ram(monkeypatch, available=1 << 40, total=int(ram(_store_bytes(arch), params * cfg.dtype.itemsize) / 0.9))
    for k, v in settings.items():
        setattr(cfg, k, v)  # after validation, which refuses pinning without CUDA
    assert preflight.resolve_pinning(cfg, arch) == want
    est = estimate(arch, cfg)
    assert (est["settings"]["pin_store"], est["settings"]["cast_on_device"]) == want


def test_pinning_needs_cuda():
    arch = load_architecture(make_config("llama"))
    cfg = EngineConfig()
    cfg.cast_on_device = True  # after validation, which refuses it too
    with pytest.raises(ValueError, match="cast_on_device=True needs device='cuda'"):
        preflight.resolve_pinning(cfg, arch)
    assert preflight.resolve_pinning(EngineConfig(), arch) == (False, False)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_estimate_equals_what_the_session_allocates():
    s = Session.from_config(make_config("llama_tied"), seed=0, device="cuda", transfer_chunk_bytes=1 << 20,
                            pinned_budget_bytes=8 << 20)
    e = s.engine
    nbytes = lambda ts: sum(t.numel() * t.element_size() for t in ts)  # noqa: E731
    est = check(s, batch=2, seq=12)
    host = lambda r: {k: v for k, v in r.items() if k not in ("device_resident", "fp32_moment_params", "gradients")}  # noqa: E731  (a device figure, a count, words)
    assert est["store"] == host(s.memory_report()) and est["store"]["shadow"] == 0  # auto on CUDA: the master is pinned
    assert s.store.units[0].master.is_pinned() and est["settings"]["cast_on_device"] is True
    late = 2 * MOMENT_STAGING_BYTES  # Note: [Late moments]: made once auto makes a group resident, counted before
    assert est["host"]["staging"] == nbytes(e.io.staging.bufs + e.io.gstaging) + late
    assert all(t.is_pinned() for t in e.io.staging.bufs)
    dev = est["device"]
    assert dev["weight_slots"] == nbytes(e.slots) and dev["grad_slots"] == nbytes(e.gslots)
    assert dev["head_slots"] == nbytes([e.head_slot, e.head_gslot])
    assert 0 < dev["available"] <= torch.cuda.get_device_properties(0).total_memory
    assert est["host"]["device_buffers"] == 0
    s.close()
    # untied: the embedding's gradient is its touched rows (Note: [Embedding rows]); without a step's shape the
    # estimate counts the whole table's rows, the most a step can touch; the store holds none before a step
    rows = lambda r: {k: v for k, v in host(r).items() if k not in ("grad_rows", "total", "bytes_per_param")}  # noqa: E731
    s = Session.from_config(make_config("llama"), seed=0, device="cuda", cast_on_device=False)
    est, rep = estimate(s), s.memory_report()
    V, H = s.arch.embed.weight.shape
    assert rows(est["store"]) == rows(rep) and est["store"]["shadow"] > 0  # pin_store: auto without the cast
    assert est["store"]["grad_rows"] == (V + 1) * 4 * H + 8 * V and rep["grad_rows"] == 0
    assert est["store"]["total"] - est["store"]["grad_rows"] == rep["total"]
    s.close()
    s = Session.from_config(make_config("llama"), seed=0, device="cuda", cast_on_device=True)
    est, rep = estimate(s), s.memory_report()
    assert rows(est["store"]) == rows(rep) and est["store"]["shadow"] == 0
    assert est["store"]["total"] - est["store"]["grad_rows"] == rep["total"]
    assert est["device"]["cast_stage"] == nbytes(s.engine.io.dev_stage) > 0
    s.close()


def test_cuda_allocator_grows_segments_unless_the_user_chose(monkeypatch):
    """Note: [Allocator]: expandable segments before CUDA starts; a user's own setting is kept."""
    from megatrain_nb.machine.preflight import ALLOCATOR, cuda_allocator

    monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF", raising=False)
    monkeypatch.delenv("PYTORCH_ALLOC_CONF", raising=False)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: False)
    assert cuda_allocator() == "set" and os.environ["PYTORCH_CUDA_ALLOC_CONF"] == ALLOCATOR
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "max_split_size_mb:512")
    assert cuda_allocator() == "user's setting" and os.environ["PYTORCH_CUDA_ALLOC_CONF"] == "max_split_size_mb:512"


# ---- optimizer_state: compact Adam moments (compact_state.py) --------------------------------------------
TINY_QWEN2 = dict(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, vocab_size=1000, tie_word_embeddings=False)
# one layer's tensors in binding.Layout's order, every size a multiple of its 64-value alignment (no padding):
# q 128x128 | q bias | k 64x128 | k bias | v 64x128 | v bias | o 128x128 | gate, up 256x128 | down 128x256 | 2 norms
LAYER = [16384, 128, 8192, 64, 8192, 64, 16384, 32768, 32768, 32768, 128, 128]
LAYER_KEPT = 128 + 64 + 64 + 2 * 128  # the tensors under 4096 values keep fp32 moments
EMBED, HEAD = 1000 * 128, 128 + 1000 * 128  # head: final norm (kept), then lm_head


def _qwen2(**overrides):
    from transformers import Qwen2Config

    return Qwen2Config(**{**TINY_QWEN2, **overrides})


def _words(n: int, kept: int, block: int, bits: int) -> int:
    """One compact moment's fp32 words, by hand: codes, one fp32 scale a block, the kept values (Note: [Compact slab])."""
    blocks = -(-n // block)
    return blocks * block * bits // 8 // 4 + blocks + kept


def _cuda_cast(monkeypatch) -> EngineConfig:
    """host_table's default: the engine on CUDA with cast_on_device (bf16 grads, 512 MiB pinned staging)."""
    cfg = _fake_cuda(monkeypatch, 1 << 40, dtype=torch.bfloat16)
    cfg.cast_on_device = True  # after validation (needs CUDA)
    return cfg


@pytest.mark.parametrize("state, block, bits", [("int8", 256, 8), ("int4", 128, 4)])
def test_compact_moments_counted_by_hand(state, block, bits):
    arch = load_architecture(_qwen2())
    n_layer = sum(LAYER)
    N = EMBED + 2 * n_layer + HEAD
    layer = _words(n_layer, LAYER_KEPT, block, bits)
    for keep, embed in ((None, EMBED), ((), _words(EMBED, 0, block, bits))):  # () quantizes the embedding too
        words = embed + 2 * layer + _words(HEAD, 128, block, bits)
        est = estimate(arch, EngineConfig(dtype=torch.bfloat16, grad_ring=False), optimizer_state=state,
                       keep_fp32=keep)  # slabs: every unit's grads counted (Note: [Gradient ring])
        s, per = est["store"], est["bytes_per_param"]
        assert s["params"] == N and s["exp_avg"] == s["exp_avg_sq"] == 4 * words
        assert s["total"] == 4 * N + (4 * EMBED + 2 * (N - EMBED)) + 8 * words  # master, grads (fp32 embedding's)
        assert per["moments"] == 8 * words / N and per["master"] == 4.0 and per["shadow"] == 0.0
        assert per["store"] == pytest.approx(per["master"] + per["grad"] + per["moments"]) == s["bytes_per_param"]
        assert per["host"] == est["host"]["needed"] / N
        assert est["settings"]["optimizer_state"] == state and est["settings"]["keep_fp32"] == keep
    # a layer alone (whole blocks): compact_state.bytes_per_param of every value, plus its kept values in fp32
    assert 8 * layer == pytest.approx(compact_state.bytes_per_param(state) * n_layer + 8 * LAYER_KEPT, rel=1e-12)
    fp32 = estimate(arch, EngineConfig(dtype=torch.bfloat16))
    assert fp32["store"]["exp_avg"] == 4 * N and fp32["bytes_per_param"]["moments"] == 8.0
    with pytest.raises(ValueError, match="optimizer_state='fp16'"):
        estimate(arch, optimizer_state="fp16")


def test_compact_store_estimate_equals_bytes_report():
    """Once HostStore holds compact moments, estimate counts what it allocates (a tiny model, allocated)."""
    import inspect

    if "optimizer_state" not in inspect.signature(HostStore).parameters:
        pytest.skip("HostStore does not take optimizer_state yet")
    arch = load_architecture(_qwen2())
    for state in ("int8", "int4"):
        want = _bound(HostStore(arch, grad_dtype=torch.bfloat16, optimizer_state=state, slabs=None))
        assert estimate(arch, EngineConfig(dtype=torch.bfloat16), optimizer_state=state)["store"] == want


def test_short_host_ram_names_the_optimizer_state_that_fits(monkeypatch):
    config = _qwen2()
    arch = load_architecture(config)
    need = {k: estimate(arch, optimizer_state=k)["host"]["needed"] for k in ("fp32", "int8", "int4")}
    assert need["fp32"] > need["int8"] > need["int4"]
    avail = (need["fp32"] + need["int8"]) // 2
    _fake_ram(monkeypatch, available=avail)

    def no_store(*a, **k):
        raise AssertionError("the host store was allocated before the check")

    monkeypatch.setattr(HostStore, "__init__", no_store)
    with pytest.raises(PreflightError) as info:
        Session.from_config(config, seed=0)  # checks before it allocates
    msg = str(info.value)
    assert f"needs {gib(need['fp32'])} with optimizer_state='fp32' (" in msg and f"{gib(avail)} available" in msg
    assert f"optimizer_state='int8' needs {gib(need['int8'])} (fits)" in msg
    assert f"optimizer_state='int4' needs {gib(need['int4'])} (fits)" in msg
    assert "To fit, change one of: optimizer_state='int8' (needs" in msg and "smaller model" in msg
    assert check(arch, optimizer_state="int8")["fits"]

    _fake_ram(monkeypatch, available=need["int4"] - 1)
    with pytest.raises(PreflightError) as info:
        check(arch, optimizer_state="int8")
    msg = str(info.value)
    assert f"needs {gib(need['int8'])} with optimizer_state='int8'" in msg
    assert f"no optimizer_state fits: 'fp32' needs {gib(need['fp32'])}, 'int4' needs {gib(need['int4'])}" in msg


def test_session_optimizer_state_is_estimated(monkeypatch):
    """estimate(session) counts the session's OptimConfig.optimizer_state (fp32 here: the store's own)."""
    s = Session.from_config(_qwen2(), seed=0, optimizer_state="fp32")
    assert estimate(s)["store"] == _bound(s.store) and estimate(s)["settings"]["optimizer_state"] == "fp32"
    s.optim_cfg.optimizer_state = "int8"  # what estimate reads; the store is the integrator's
    assert estimate(s)["store"]["exp_avg"] < s.store.bytes_report()["exp_avg"]
    s.close()


@pytest.mark.parametrize("state", ["fp32", "int8", "int4"])
def test_pinning_rule_counts_the_store_as_allocated(monkeypatch, state):
    """The moments of ``optimizer_state``, and the gradients where they stay: by default the ring's buffers and the
    embedding's rows, with ``grad_clip`` a slab a parameter. Four layers: the ring is then smaller than the slabs."""
    arch = load_architecture(make_config("llama", num_hidden_layers=4))
    ring, slabs = _store_bytes(arch, optimizer_state=state), _store_bytes(arch, optimizer_state=state, grad_clip=1.0)
    assert ring < slabs
    cfg = _fake_cuda(monkeypatch, 1 << 40)
    other = "int8" if state == "fp32" else "fp32"  # RAM between two states' stores: the smaller one alone casts
    theirs = _store_bytes(arch, optimizer_state=other)
    _fake_ram(monkeypatch, available=1 << 40, total=int((ring + theirs) / 2 / 0.9))
    assert ring != theirs and preflight.resolve_pinning(cfg, arch, optimizer_state=state) == (False, ring < theirs)
    _fake_ram(monkeypatch, available=1 << 40, total=int((ring + slabs) / 2 / 0.9))  # between the two
    assert preflight.resolve_pinning(cfg, arch, optimizer_state=state) == (False, True)
    assert preflight.resolve_pinning(cfg, arch, optimizer_state=state, grad_clip=1.0) == (False, False)
    assert estimate(arch, cfg, optimizer_state=state)["settings"]["cast_on_device"]
    assert not estimate(arch, cfg, optimizer_state=state, grad_clip=1.0)["settings"]["cast_on_device"]


def test_host_table_extrapolates_layers_exactly(monkeypatch):
    """max_layers: the deepest model of this width whose estimate fits, checked against estimate at that depth."""
    cfg = _cuda_cast(monkeypatch)
    deep = {k: estimate(_qwen2(num_hidden_layers=5), cfg, optimizer_state=k)["host"]["needed"]
            for k in ("fp32", "int8", "int4")}
    for k, need in deep.items():
        for host, layers in ((need, 5), (need - 1, 4)):
            df = preflight.host_table(_qwen2(), host_bytes=host).set_index("optimizer_state")
            assert df.loc[k, "max_layers"] == layers, (k, host)
            assert df.loc[k, "max_params"] == EMBED + layers * sum(LAYER) + HEAD
    two = estimate(_qwen2(), cfg, optimizer_state="int8")
    row = preflight.host_table(_qwen2(), host_bytes=1 << 40).set_index("optimizer_state").loc["int8"]
    assert row["host_GiB"] * (1 << 30) == pytest.approx(two["host"]["needed"])
    assert row["store"] == two["store"]["bytes_per_param"] and row["moments"] == two["bytes_per_param"]["moments"]
    assert row["model"] == "Qwen2 552,064"  # no name given: the class and the count


def test_host_table_with_grad_clip_counts_slabs_as_estimate_does(monkeypatch):
    """With grad_clip every unit keeps a gradient slab: the table says so and its bytes are estimate's."""
    cfg = _cuda_cast(monkeypatch)
    ring = preflight.host_table(_qwen2(), host_bytes=1 << 40).set_index("optimizer_state")
    slabs = preflight.host_table(_qwen2(), host_bytes=1 << 40, grad_clip=1.0).set_index("optimizer_state")
    assert (ring.gradients == "ring").all() and (slabs.gradients == "slabs").all()
    for state in ("fp32", "int8", "int4"):
        est = estimate(_qwen2(), cfg, optimizer_state=state, grad_clip=1.0)
        assert slabs.loc[state, "host_GiB"] * (1 << 30) == pytest.approx(est["host"]["needed"])
        assert slabs.loc[state, "grad"] == est["bytes_per_param"]["grad"]
        # slabs: a bf16 gradient for every non-embedding parameter, fp32 for the embedding's; the ring: its buffers
        N = EMBED + 2 * sum(LAYER) + HEAD
        assert slabs.loc[state, "grad"] * N == 4 * EMBED + 2 * (N - EMBED)
        assert ring.loc[state, "grad"] * N == pytest.approx(4 * EMBED + 4 * 128 + 8 * 1000)  # the embedding's rows,
        # the whole table's, and a zero row
        assert slabs.loc[state, "max_layers"] <= ring.loc[state, "max_layers"]


def test_qwen25_14b_fits_118_gib_with_int8_not_fp32(monkeypatch):
    from megatrain_nb.machine.shape import QWEN25

    df = preflight.host_table({"14B": QWEN25["14B"]}, host_bytes=118 << 30).set_index("optimizer_state")
    assert (df.params == 14_770_033_664).all() and (df.layers == 48).all()
    assert not df.loc["fp32", "fits"] and df.loc["int8", "fits"] and df.loc["int4", "fits"]
    assert df.loc["fp32", "host_GiB"] > 170 and df.loc["int8", "host_GiB"] < 118  # the gradient ring's, not slabs
    assert df.loc["fp32", "max_layers"] < 48 <= df.loc["int8", "max_layers"] < df.loc["int4", "max_layers"]
    # the table's bytes are estimate's, under the engine's CUDA default (cast_on_device)
    est = estimate(_qwen2(**{k: v for k, v in QWEN25["14B"].items() if k != "model_type"}), _cuda_cast(monkeypatch),
                   optimizer_state="int8")
    assert df.loc["int8", "host_GiB"] * (1 << 30) == pytest.approx(est["host"]["needed"])
    _fake_ram(monkeypatch, available=118 << 30)
    with pytest.raises(PreflightError, match=r"optimizer_state='fp32' \(12\.4 bytes a parameter\), 118\.00 GiB "
                                             r"available; optimizer_state='int8' needs 93\.\d\d GiB \(fits\).*"
                                             r"gradient ring 2\.48 GiB"):  # two layers' buffers and the head's region
        check(_qwen2(**{k: v for k, v in QWEN25["14B"].items() if k != "model_type"}), _cuda_cast(monkeypatch))


def test_qwen25_32b_fits_125_gib_at_no_setting():
    from megatrain_nb.machine.shape import QWEN25

    df = preflight.host_table({"32B": QWEN25["32B"]}, host_bytes=125 << 30)
    assert list(df.optimizer_state) == ["fp32", "int8", "int4"] and not df.fits.any()
    assert (df.max_layers < 64).all() and df.host_GiB.min() > 160  # the gradient ring's, not slabs
