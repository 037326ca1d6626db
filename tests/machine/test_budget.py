"""budget.py: device_memory / host_memory parse clearly, every sizing query reads them, and a model that does
not fit a budget is refused before anything is allocated (Note: [Budgets])."""
from __future__ import annotations

import types

import pytest
import torch
from transformers import LlamaConfig

from conftest import make_config
from megatrain_nb import Session
from megatrain_nb.cli import main
from megatrain_nb.config import EngineConfig
from megatrain_nb.host.host_store import HostStore
from megatrain_nb.machine import budget, planner
from megatrain_nb.machine.autoplan import plan_settings
from megatrain_nb.machine.longcontext import HOST_MARGIN, host_free_bytes
from megatrain_nb.machine.preflight import PreflightError, check, estimate

GiB, MiB = 1 << 30, 1 << 20


@pytest.mark.parametrize("value, want", [
    ("24GiB", 24 * GiB), ("64GB", 64 * 10**9), ("1.5TiB", 3 * (1 << 39)), ("512 MiB", 512 * MiB),
    (" 2gib ", 2 * GiB), ("1000", 1000), (123456789, 123456789), (None, None),
])
def test_budgets_parse(value, want):
    assert budget.parse_bytes(value, "device_memory") == want
    cfg = EngineConfig(device_memory=value, host_memory=value)
    assert cfg.device_memory == want and cfg.host_memory == want


@pytest.mark.parametrize("value", ["24G", "lots", "1e9", "-1GiB", "0GB", 0, -5, 1.5, True, [1]])
@pytest.mark.parametrize("field", ["device_memory", "host_memory"])
def test_bad_budgets_name_the_field_and_the_forms(field, value):
    with pytest.raises(ValueError) as e:
        EngineConfig(**{field: value})
    msg = str(e.value)
    assert msg.startswith(f"{field}={value!r}") and "'24GiB'" in msg and "'64GB'" in msg, msg


def _spy_store(monkeypatch) -> list:
    """Every HostStore construction is recorded (a store allocates the masters, grads and moments)."""
    made, init = [], HostStore.__init__

    def spy(self, *a, **kw):
        made.append(1)
        init(self, *a, **kw)
    monkeypatch.setattr(HostStore, "__init__", spy)
    return made


def _medium():
    """~15M parameters: fp32 moments need ~100 MB more host RAM than int4's, a gap RSS drift cannot cross."""
    return make_config("llama", hidden_size=512, intermediate_size=1536, num_hidden_layers=4, vocab_size=1000,
                       num_attention_heads=8, num_key_value_heads=4)


def test_small_host_memory_refuses_before_allocating(monkeypatch):
    import psutil

    monkeypatch.setattr(psutil, "virtual_memory", lambda: types.SimpleNamespace(available=1 << 40, total=1 << 40))
    made = _spy_store(monkeypatch)
    small = dict(transfer_chunk_bytes=1 << 20, pinned_budget_bytes=8 << 20)
    need = {k: estimate(_medium(), EngineConfig(**small), optimizer_state=k)["host"]["needed"] for k in ("fp32", "int4")}
    assert need["fp32"] - need["int4"] > 80 * MiB
    limit = budget.host_rss() + (need["fp32"] + need["int4"]) // 2  # fp32 does not fit, int4 does
    assert estimate(_medium(), EngineConfig(**small))["fits_host"]  # the machine alone would hold it
    with pytest.raises(PreflightError) as e:
        Session.from_config(_medium(), host_memory=limit, **small)
    msg = str(e.value)
    assert made == []  # refused before a store existed
    assert f"within host_memory={limit}" in msg and "optimizer_state='fp32'" in msg, msg
    assert "optimizer_state='int4' needs" in msg and "(fits)" in msg, msg
    est = estimate(_medium(), EngineConfig(host_memory=limit, **small), optimizer_state="int4")
    assert est["fits_host"] and est["host"]["available"] <= limit


def test_a_host_budget_that_fits_trains():
    s = Session.from_config(make_config("llama"), host_memory="64GiB", device="cpu")
    try:
        ids = torch.randint(0, s.arch.config.vocab_size, (2, 16))
        assert torch.isfinite(torch.tensor(s.step({"input_ids": ids}).loss))
        assert s.engine_cfg.host_memory == 64 * GiB
    finally:
        s.close()


def test_host_available_is_the_smaller_of_machine_and_budget(monkeypatch):
    import psutil

    monkeypatch.setattr(psutil, "virtual_memory", lambda: types.SimpleNamespace(available=100 * GiB, total=128 * GiB))
    monkeypatch.setattr(budget, "host_rss", lambda: 3 * GiB)
    assert budget.host_available() == 100 * GiB  # no budget: the machine's, as before
    assert budget.host_available(20 * GiB) == 17 * GiB  # the budget less what the process holds
    assert budget.host_available(200 * GiB) == 100 * GiB
    assert budget.host_available(2 * GiB) == 0
    assert budget.host_total(20 * GiB) == 20 * GiB and budget.host_total() == 128 * GiB
    assert host_free_bytes(0, 0, 20 * GiB) == 17 * GiB - HOST_MARGIN  # parked inputs read it too
    assert host_free_bytes(GiB, 2 * GiB, 20 * GiB) == 18 * GiB - HOST_MARGIN


def test_host_spare_keeps_the_process_within_its_share_of_the_machine_without_a_budget(monkeypatch):
    """What only speeds a step (the ring's overflow) stops where the process would pass 90% of the machine's RAM;
    a budget stands as it is. The H100 row: gpt-oss-20b held 117.3 of 126 GiB, and psutil still called 8 available."""
    import psutil

    mem = types.SimpleNamespace(available=8 * GiB, total=126 * GiB)
    monkeypatch.setattr(psutil, "virtual_memory", lambda: mem)
    rss = {"now": 117 * GiB}
    monkeypatch.setattr(budget, "host_rss", lambda: rss["now"])
    assert budget.host_available() == 8 * GiB and budget.host_spare() == 0  # past the share: nothing to spare
    rss["now"], mem.available = 100 * GiB, 20 * GiB
    assert budget.host_spare() == int(0.9 * 126 * GiB) - 100 * GiB  # the share, under what psutil calls available
    rss["now"] = 40 * GiB
    assert budget.host_spare() == 20 * GiB  # far within the share: what is available
    rss["now"] = 117 * GiB
    assert budget.host_spare(125 * GiB) == budget.host_available(125 * GiB) == 8 * GiB  # a budget: as it is


def _fake_device(monkeypatch, *, free, total, allocated=0, reserved=0):
    """torch.cuda's memory queries answer these numbers on this CPU-only machine."""
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (free, total))
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device=None: types.SimpleNamespace(total_memory=total))
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device=None: allocated)
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device=None: reserved)


def test_device_free_within_the_budget(monkeypatch):
    _fake_device(monkeypatch, free=10 * GiB, total=80 * GiB, allocated=100 * MiB, reserved=300 * MiB)
    assert budget.device_free("cuda") == 10 * GiB  # no budget: mem_get_info's free bytes, as before
    assert budget.device_free("cuda", GiB) == GiB - 100 * MiB  # the budget less what is allocated
    assert budget.device_free("cuda", 40 * GiB) == 10 * GiB + 200 * MiB  # the machine's, cached blocks reusable
    assert budget.device_free("cuda", 50 * MiB) == 0
    assert budget.device_total("cuda", 24 * GiB) == 24 * GiB and budget.device_total("cuda") == 80 * GiB
    assert budget.device_total("cuda", 100 * GiB) == 80 * GiB
    assert budget.memory_total("cuda", 24 * GiB) == 24 * GiB


def test_preflight_honours_a_device_budget(monkeypatch):
    _fake_device(monkeypatch, free=80 * GiB, total=80 * GiB)
    config = make_config("llama")
    cfg = EngineConfig(dtype=torch.bfloat16, device_memory="700MiB")
    cfg.device = "cuda"  # after validation, which would refuse it here
    est = estimate(config, cfg, batch=1, seq=16)
    assert est["device"]["available"] == 700 * MiB and est["fits_device"]  # the machine has 80 GiB
    with pytest.raises(PreflightError) as e:
        check(config, cfg, batch=64, seq=4096)  # activations and logits of 256K tokens
    msg = str(e.value)
    assert "within device_memory=734003200" in msg and "checkpoint_every=1" in msg and "batch or seq" in msg, msg
    cfg.device_memory = None
    assert estimate(config, cfg, batch=64, seq=4096)["fits_device"]  # without the budget it fits


def test_weight_slots_read_the_device_budget(monkeypatch):
    from megatrain_nb.machine.preflight import resolve_weight_slots
    from megatrain_nb.model.hf import load_architecture

    _fake_device(monkeypatch, free=80 * GiB, total=80 * GiB)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    arch = load_architecture(make_config("llama", num_hidden_layers=4))
    layer = max(sum(p.numel() for p in arch.templates[0].parameters()), 1) * 2
    cfg = EngineConfig(placement="stream", device_memory=layer * 4 * 10 - 1)  # a tenth holds only 3 layers
    cfg.device = "cuda"
    assert resolve_weight_slots(cfg, arch) == 2
    cfg.device_memory = None
    assert resolve_weight_slots(cfg, arch) == 4  # the card's 80 GiB: one slot a layer


def test_planner_honours_the_budgets():
    config = dict(hidden_size=2048, intermediate_size=5632, num_hidden_layers=8, num_attention_heads=16,
                  num_key_value_heads=4, vocab_size=32000)
    free = planner.plan(config, batch=8, seq=4096, placement="auto")
    with pytest.warns(UserWarning, match="does not fit host RAM"):
        tight = planner.plan(config, batch=8, seq=4096, placement="auto", device_memory="8GiB", host_memory="1GiB")
    assert tight.hardware.device_mem_bytes == 8 * GiB and tight.hardware.host_mem_bytes == GiB
    assert "within budgets" in tight.hardware.name and free.hardware is planner.H200
    assert free.fits_host and not tight.fits_host  # ~2B parameters' store is not 1 GiB
    resident = lambda p: sum(c == "resident" for c in p.placement.values())  # noqa: E731
    assert resident(tight) < resident(free)  # "auto" keeps fewer units on an 8 GiB device
    assert planner.plan(config, batch=1, seq=16, device_memory=10 ** 15).hardware is planner.H200  # larger: no change
    kw = plan_settings(EngineConfig(device_memory="8GiB"), None)  # what the engine's choices pass the planner
    assert kw["device_memory"] == 8 * GiB and kw["host_memory"] is None


def test_hardware_within():
    hw = budget.hardware_within(planner.H200, 20 * GiB, None)
    assert hw.device_mem_bytes == 20 * GiB and hw.host_mem_bytes == planner.H200.host_mem_bytes
    assert budget.hardware_within(planner.H200) is planner.H200


def test_cap_device_off_cuda_and_without_budget():
    assert budget.cap_device("cpu", GiB) is None and budget.cap_device("cuda", None) is None


def _cli_error(capsys) -> str:
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and "\n" not in err and "Traceback" not in err, err
    return err


def test_cli_budgets(capsys):
    assert main(["demo", "--device", "cpu", "--device-memory", "24G"]) == 2
    err = _cli_error(capsys)
    assert "--device-memory" in err and "device_memory='24G'" in err and "'24GiB'" in err, err
    assert main(["demo", "--steps", "2", "--device", "cpu", "--host-memory", "1MiB"]) == 2  # the runtime alone is more
    err = _cli_error(capsys)
    assert "Not enough host RAM" in err and "host_memory=1048576" in err, err


# ---- on CUDA (the lead's H200) --------------------------------------------------------------
def _cuda_config(layers=8):
    return LlamaConfig(vocab_size=32000, hidden_size=1024, intermediate_size=2816, num_hidden_layers=layers,
                       num_attention_heads=16, num_key_value_heads=4, max_position_embeddings=2048)


@pytest.fixture
def fresh_cuda():
    """Empty allocator and peak counters before; no cap left behind for later tests (the cap is per process)."""
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    yield
    torch.cuda.set_per_process_memory_fraction(1.0)
    torch.cuda.empty_cache()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("placement", ["auto", "host"])
def test_device_budget_bounds_what_the_allocator_reserves(placement, fresh_cuda):
    """~0.16B parameters (fp32 master and moments ~2.5 GB: "auto" keeps them all on an H200) under a budget of 3 GiB more
    than the process holds already:
    the allocator's peak reservation stays within it, through "auto"'s measuring step and trials."""
    import gc

    gc.collect()
    torch.cuda.empty_cache()
    limit = torch.cuda.memory_allocated() + 3 * GiB  # what earlier tests of this process still hold counts too
    s = Session.from_config(_cuda_config(), device="cuda", device_memory=limit, placement=placement)
    try:
        g = torch.Generator().manual_seed(0)
        for _ in range(4):  # "auto": its measuring step, trials and the winner's first steps
            ids = torch.randint(0, 32000, (4, 1024), generator=g)
            assert torch.isfinite(torch.tensor(s.step({"input_ids": ids}).loss))
        peak = torch.cuda.max_memory_reserved()
        assert peak <= limit, f"reserved {peak / GiB:.2f} GiB under a {limit / GiB:.2f} GiB budget"
        assert peak > limit / 8  # the model did use the device
    finally:
        s.close()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_device_budget_too_small_is_refused_before_allocating(fresh_cuda, monkeypatch):
    made = _spy_store(monkeypatch)
    with pytest.raises(PreflightError) as e:
        Session.from_config(_cuda_config(), device="cuda", device_memory="256MiB")
    assert made == [] and "device_memory=268435456" in str(e.value), str(e.value)
