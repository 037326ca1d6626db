"""Tests for megatrain_nb.machine.planner: parameter counts, bytes, step-time model, simulated timeline."""

from __future__ import annotations

import dataclasses

import pytest
from transformers import Qwen2Config

from helpers import QWEN25_7B
from megatrain_nb.machine.planner import CPU_LAPTOP, H200, Hardware, model_shape, plan
from megatrain_nb.view.trace import LANES, Trace, find_stalls, summarize

QWEN25_3B = dict(model_type="qwen2", hidden_size=2048, intermediate_size=11008, num_hidden_layers=36,
                 num_attention_heads=16, num_key_value_heads=2, vocab_size=151936, tie_word_embeddings=True)
QWEN25_05B = dict(model_type="qwen2", hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                  num_attention_heads=14, num_key_value_heads=2, vocab_size=151936, tie_word_embeddings=True)
FAST_HOST = dataclasses.replace(H200, name="H200 with an infinitely fast host", host_adam_params_per_s=1e15,
                                host_adam_fp32_params_per_s=1e15, host_cast_elems_per_s=1e15)


def test_model_shape_counts_qwen25():
    s7, s3 = model_shape(QWEN25_7B), model_shape(QWEN25_3B)
    assert (s7["params_per_layer"], s7["n_params"]) == (233_057_792, 7_615_616_512)
    assert (s3["params_per_layer"], s3["n_params"]) == (77_076_992, 3_085_938_688)
    assert (s7["head_dim"], s7["kv_heads"], s7["tied"], s3["tied"]) == (128, 4, False, True)
    assert s3["head_params"] == 2048  # tied: only the final norm


def test_model_shape_reads_transformers_configs():
    cfg = Qwen2Config(**{k: v for k, v in QWEN25_7B.items() if k != "model_type"})
    assert model_shape(cfg) == model_shape(QWEN25_7B)


def test_model_shape_moe():
    moe = dict(hidden_size=64, intermediate_size=256, moe_intermediate_size=32, num_hidden_layers=2,
               num_attention_heads=4, vocab_size=100, num_experts=8, num_experts_per_tok=2)
    s = model_shape(moe)
    attn, norms, router = 4 * 64 * 64, 2 * 64, 64 * 8
    assert s["params_per_layer"] == attn + 8 * 3 * 64 * 32 + router + norms
    assert s["active_params_per_layer"] == attn + 2 * 3 * 64 * 32 + router + norms


def test_host_bytes_per_param_is_14_plus_fp32_embedding_grads():
    p = plan(QWEN25_7B, batch=1, seq=4096, pinned_budget_bytes=2 << 30, grad_ring=False)  # slabs
    n, e = p.shape["n_params"], 152064 * 3584
    dE = 4096 * 3584 * 2  # the engine's buffer of the embedding rows' grads (bf16), pinned at its size (whole pages)
    rt = 2 << 30  # H200.host_runtime_bytes: the process's RSS beyond these buffers (CUDA context, torch)
    assert p.host_bytes == {"master_fp32": 4 * n, "adam_moments": 8 * n, "grads": 2 * n + 2 * e, "pinned_pool": 2 << 30,
                            "embedding_grad_rows": dE, "runtime": rt}
    assert sum(p.host_bytes.values()) == 14 * 7_615_616_512 + 2 * e + (2 << 30) + dE + rt
    # bench/results/h200-2026-11-29-host-path.jsonl: host_bytes_per_param 14.14 (7B) and 14.2 (3B), from HostStore
    assert round(p.host_bytes_per_param, 2) == 14.14
    assert round(plan(QWEN25_3B, batch=1, seq=4096, grad_ring=False).host_bytes_per_param, 2) == 14.2
    ring = plan(QWEN25_7B, batch=1, seq=4096, pinned_budget_bytes=2 << 30)  # Note: [Gradient ring]: two layers' buffers
    layer, head = ring.shape["params_per_layer"], ring.shape["head_params"]  # and the head's region (the largest unit)
    rows = 4097 * 4 * 3584 + 8 * 4096  # the embedding's gradient: the rows a step's 4096 tokens touch, at most, (Note:
    assert head > layer and ring.host_bytes["grads"] == rows + 2 * (2 * layer + head)  # [Embedding rows]) and a zero row
    assert plan(QWEN25_7B, batch=1, seq=4096, grad_clip=True).host_bytes["grads"] == 2 * n + 2 * e  # clip: slabs
    assert p.fits_host and p.fits_device
    # the default staging pool: 2 GiB with pageable slabs (every load is packed), 512 MiB with pinned ones (config.pinned_budget)
    assert plan(QWEN25_7B, batch=1, seq=4096).host_bytes["pinned_pool"] == 2 << 30
    assert plan(QWEN25_7B, batch=1, seq=4096, cast_on_device=True).host_bytes["pinned_pool"] == 512 << 20
    assert plan(QWEN25_7B, batch=1, seq=4096, pin_store=True).host_bytes["pinned_pool"] == 512 << 20


def test_layer_times_match_the_measured_figures():
    p = plan(QWEN25_7B, batch=1, seq=4096)
    flops = 6 * 233_057_792 * 4096 + 6 * 4096 ** 2 * 28 * 128  # layer matmuls + causal attention, fwd+bwd
    elementwise = 4096 * (3584 + 18944) * 2.1e-11 * 1e3  # the memory-bound rest, fwd+bwd
    assert p.layer_ms["fwd"] + p.layer_ms["bwd"] == pytest.approx(flops / 609e9 + elementwise)  # 11.94; measured 11.9
    for B, measured in ((4, 46.0), (16, 191.0)):  # LIMITS.md: the same layer at 4 and 16 x 4096
        q = plan(QWEN25_7B, batch=B, seq=4096, lean_activations=False)  # measured before lean existed
        assert q.layer_ms["fwd"] + q.layer_ms["bwd"] == pytest.approx(measured, rel=0.04)
    small = plan(QWEN25_3B, batch=1, seq=4096)  # launch-bound: the floors measured in the 3B x 1 trace
    assert (small.layer_ms["fwd"], small.layer_ms["bwd"]) == H200.layer_launch_ms
    assert p.layer_ms["h2d"] == pytest.approx(233_057_792 * 2 / 55.1e6)  # 8.46 ms; measured 8.5
    assert p.layer_ms["adam"] == pytest.approx(233_057_792 / 3.48e6)  # bf16 grads: bench/host_adam.py, 16M chunks
    emb = p.simulate().query("lane == 'host-adam' and layer == -1").dur_ms
    assert emb.tolist() == [pytest.approx(152064 * 3584 / 3.90e6, abs=1e-3)]  # fp32 grads, no upcast


def test_step_time_grows_with_tokens():
    steps = [plan(QWEN25_7B, batch=b, seq=s).step_ms for b, s in ((1, 256), (1, 4096), (4, 4096), (16, 4096))]
    assert steps == sorted(steps) and len(set(steps)) == 4


def test_bottlenecks():
    assert plan(QWEN25_7B, batch=16, seq=4096).bottleneck == "compute"
    assert plan(QWEN25_7B, batch=1, seq=256, hardware=FAST_HOST).bottleneck == "pcie"
    assert plan(QWEN25_7B, batch=1, seq=256, pinned_budget_bytes=0).bottleneck == "pcie"  # pageable copies
    # On the measured H200 host, CPU AdamW (7.6e9 params / 3.48e9 per s = 2.2 s) outlasts the backward
    # until about 16 x 4096 tokens per step.
    assert plan(QWEN25_7B, batch=1, seq=4096).bottleneck == "host-adam"
    assert plan(QWEN25_7B, batch=4, seq=4096).bottleneck == "host-adam"


def test_simulate_has_trace_columns_and_ends_at_step_ms():
    p = plan(QWEN25_3B, batch=4, seq=4096)
    df = p.simulate()
    assert list(df.columns) == list(Trace(step=0).to_dataframe().columns)
    assert set(df.lane) == set(LANES) - {"device-adam", "d2h-state", "driver", "h2d-moments", "host-moments"}  # nothing
    # resident or streamed; no driver
    assert df.end_ms.max() == pytest.approx(p.step_ms) and (df.dur_ms >= 0).all()
    comp = df[df.lane == "compute"]
    assert comp.op.value_counts().to_dict() == {"fwd": 36, "bwd": 36, "loss": 1, "embed_bwd": 1}
    loads = df[df.lane == "h2d"].layer.value_counts()
    assert sorted(loads[loads == 1].index) == [-1, 34, 35, 36]  # embedding rows, 2 layers still resident, head
    assert (df[df.lane == "host-adam"].layer.value_counts() == 1).all()  # one update per unit
    assert p.busy_ms["compute"] == pytest.approx(comp.dur_ms.sum())
    assert p.model_tflops == pytest.approx(6 * (36 * 77_076_992 + 151936 * 2048) * 16384 / p.step_ms / 1e9)
    assert len(find_stalls(df)) > 0


def test_checkpointing():
    none, every = plan(QWEN25_3B, batch=4, seq=4096, checkpoint_every=0), plan(QWEN25_3B, batch=4, seq=4096,
                                                                                 checkpoint_every=1)
    auto = plan(QWEN25_3B, batch=4, seq=4096)
    assert (none.recomputed_layers, every.recomputed_layers, auto.recomputed_layers) == (0, 36, 0)
    assert every.busy_ms["compute"] - none.busy_ms["compute"] == pytest.approx(36 * none.layer_ms["fwd"])
    assert every.attention_cached == 0  # 4096 tokens: attention_cache=None caches none (longcontext.CACHE_SHARE)
    forced = plan(QWEN25_3B, batch=4, seq=4096, checkpoint_every=1, attention_cache=True)
    n = forced.attention_cached  # these recomputes skip the attention forward (Note: [Attention cache])
    assert n > 0 and forced.busy_ms["compute"] - none.busy_ms["compute"] == pytest.approx(
        (36 - n) * none.layer_ms["fwd"] + n * forced.layer_ms["recompute_cached"])
    boundary = 16384 * 2048 * 2  # one saved layer input per recompute block
    assert every.device_bytes["activations_kept"] == 0 and every.device_bytes["checkpoints"] == 36 * boundary
    fours = plan(QWEN25_3B, batch=4, seq=4096, checkpoint_every=4)  # blocks of 4 layers, as the engine runs them
    assert fours.recomputed_layers == 36 and fours.device_bytes["checkpoints"] == 9 * boundary
    assert fours.device_bytes["recompute_workspace"] == 4 * every.device_bytes["recompute_workspace"]
    big = plan(QWEN25_7B, batch=16, seq=4096, lean_activations=False)  # auto keeps the first layers that fit;
    assert big.keep == [True] * 6 + [False] * 22 and big.fits_device and not big.attention_cached  # 4096: no cache
    # a cached attention output (0.5 GB) saves 6% of a forward, a kept layer (14.7 GB) all of it: the cache is
    # worth more per byte here (longcontext.cache_first), so it comes first and one layer fewer is kept
    cached = plan(QWEN25_7B, batch=16, seq=4096, lean_activations=False, attention_cache=True)
    assert cached.keep == [True] * 5 + [False] * 23 and cached.attention_cached == 23 and cached.fits_device
    assert plan(QWEN25_7B, batch=16, seq=4096, lean_activations=True).keep == [True] * 12 + [False] * 16  # lean: more kept


def test_grad_clip_serialises_the_optimizer():
    df = plan(QWEN25_3B, batch=1, seq=4096, grad_clip=True).simulate()
    assert df[df.lane == "host-adam"].start_ms.min() >= df[df.lane == "host-unpack"].end_ms.max()
    assert plan(QWEN25_3B, batch=1, seq=4096, grad_clip=True).step_ms > plan(QWEN25_3B, batch=1, seq=4096).step_ms


def test_summary_and_table():
    p = plan(QWEN25_05B, batch=1, seq=1024, hardware=CPU_LAPTOP)
    assert p.fits_device and p.fits_host
    assert p.summary()["tokens"] == 1024 and p.summary()["bottleneck"] == p.bottleneck
    table = p.to_dataframe()
    assert list(table.columns) == ["section", "quantity", "value", "unit"]
    assert set(table.section) == {"host", "device", "layer", "busy", "step"}


def test_does_not_fit_warns():
    tiny = dataclasses.replace(H200, device_mem_bytes=1 << 30, host_mem_bytes=1 << 30)
    with pytest.warns(UserWarning) as record:
        p = plan(QWEN25_7B, batch=1, seq=4096, hardware=tiny)
    assert not p.fits_device and not p.fits_host
    assert [str(w.message)[:27] for w in record] == ["plan does not fit the devic", "plan does not fit host RAM:"]


@pytest.mark.parametrize("kwargs, name", [
    (dict(batch=0, seq=4096), "batch"), (dict(batch=1, seq=-1), "seq"),
    (dict(batch=1, seq=8, weight_slots=1), "weight_slots"), (dict(batch=1, seq=8, checkpoint_every=-1),
                                                             "checkpoint_every"),
])
def test_plan_errors_name_the_argument(kwargs, name):
    with pytest.raises(ValueError, match=f"^{name} must be"):
        plan(QWEN25_3B, **kwargs)


def test_config_errors_name_the_field():
    cfg = {k: v for k, v in QWEN25_3B.items() if k != "hidden_size"}
    with pytest.raises(ValueError, match="'hidden_size'"):
        plan(cfg, batch=1, seq=8)


def test_hardware_validates():
    with pytest.raises(ValueError, match="h2d_GBps"):
        dataclasses.replace(H200, h2d_GBps=0.0)
    with pytest.raises(ValueError, match="duplex_GBps"):
        Hardware(name="x", h2d_GBps=10, d2h_GBps=10, duplex_GBps=5, pageable_GBps=1, bf16_tflops=1,
                 host_adam_params_per_s=1, host_cast_elems_per_s=1, device_mem_bytes=1, host_mem_bytes=1)
    with pytest.raises(ValueError, match="h2d_beside_d2h_GBps"):
        dataclasses.replace(H200, h2d_beside_d2h_GBps=0.0)


def test_copies_beside_each_other_run_at_the_in_step_rates(monkeypatch):
    """bench/copy_rates.py on the 2026-12-01 stream traces: state in at 40 GB/s beside state out at 52 (55 each alone).
    With two state slots, as in those traces: the loads then chain behind the write-backs, so slower copies
    mean a longer step (with a slot per layer the list schedule may reorder, and need not be monotonic)."""
    from megatrain_nb.machine import placement as placing

    monkeypatch.setattr(placing, "STATE_SLOT_SHARE", 0.0)
    one = {u: "device" for u in range(20)}
    fast = plan(QWEN25_3B, batch=1, seq=4096, cast_on_device=True, weight_slots=36, placement=one,
                hardware=dataclasses.replace(H200, h2d_beside_d2h_GBps=None, d2h_beside_h2d_GBps=None))
    measured = plan(QWEN25_3B, batch=1, seq=4096, cast_on_device=True, weight_slots=36, placement=one)
    P = measured.shape["params_per_layer"]
    state_in = [s for s in measured.spans if s[1] == "state-in"]  # D alone where weights are held: Note [Split master]
    assert state_in and all(abs((s[5] - s[4]) - 10 * P / 40.2e6) < 1e-3 for s in state_in)  # spans: 0.1 us
    assert measured.steady_step_ms > fast.steady_step_ms
    fp32 = plan(QWEN25_3B, batch=1, seq=4096, cast_on_device=True, weight_slots=36, placement=one, split_master=False)
    assert all(abs((s[5] - s[4]) - 12 * P / 40.2e6) < 1e-3 for s in fp32.spans if s[1] == "state-in")
    assert fp32.device_bytes["state_slots"] * 4 == measured.device_bytes["state_slots"] * 3  # 12 bytes a row, not 16


def test_cast_on_device_moves_fp32_and_casts_nothing_on_the_host():
    plain, pin, cast = (plan(QWEN25_3B, batch=1, seq=4096, grad_ring=False, **kw)  # slabs: unpacked grads
                        for kw in ({}, dict(pin_store=True), dict(cast_on_device=True)))
    assert plan(QWEN25_3B, batch=1, seq=4096).layer_ms["unpack"] == 0.0  # the ring: one DMA (Note: [Gradient ring])
    P, n, V, h = 77_076_992, 3_085_938_688, 151936, 2048
    # PCIe: fp32 weights, twice the bytes of the bf16 copy; grads still come back in bf16
    assert cast.layer_ms["h2d"] == pytest.approx(P * 4 / 55.1e6) == pytest.approx(2 * pin.layer_ms["h2d"])
    assert cast.layer_ms["h2d_bwd"] == pytest.approx(2 * pin.layer_ms["h2d_bwd"])
    assert cast.layer_ms["d2h"] == pin.layer_ms["d2h"] == plain.layer_ms["d2h"]
    # no host cast: no packing or unpacking of layers, and no refresh in the optimizer (pin_store's cost)
    assert plain.layer_ms["pack"] == plain.layer_ms["unpack"] == pytest.approx(P / 12e6)
    assert cast.layer_ms["pack"] == cast.layer_ms["unpack"] == 0.0
    assert cast.layer_ms["adam"] == plain.layer_ms["adam"] == pytest.approx(pin.layer_ms["adam"] - P / 12e6)
    # host: the plain store, 2 bytes/param under pin_store's
    pool = lambda p: {k: v for k, v in p.host_bytes.items() if k != "pinned_pool"}  # noqa: E731  (2 GiB vs 512 MiB)
    assert pool(cast) == pool(plain) and "pinned_copy" not in cast.host_bytes
    assert pin.host_bytes["pinned_copy"] == 2 * n
    assert pin.host_bytes_per_param - cast.host_bytes_per_param == pytest.approx(2.0)
    # the simulation: each layer load is one fp32 DMA; the host packs only the embedding rows and unpacks
    # only the tied head's embedding gradient (into the fp32 embedding grads)
    df = cast.simulate()
    layers = df[(df.layer >= 0) & (df.layer < 36)]
    assert set(layers[layers.lane == "h2d"].bytes) == {P * 4}
    assert set(df[df.lane == "h2d"].query("layer == 36").bytes) == {(V * h + h) * 4}
    assert df[df.lane == "host-pack"].layer.tolist() == [-1]
    unpack = df[df.lane == "host-unpack"]
    assert unpack[["op", "layer"]].values.tolist() == [["unpack", 36], ["embed_grad", -1]]
    assert unpack.dur_ms.iloc[0] == pytest.approx(V * h / 12e6, rel=1e-4)
    plain_df = plain.simulate()
    packed, loaded = (len(plain_df.query(f"lane == '{lane}' and layer >= 0")) for lane in ("host-pack", "h2d"))
    assert packed == loaded == 36 + 34 + 1  # forward, backward reloads, head: every load packed
    assert cast.busy_ms["host-pack"] < plain.busy_ms["host-pack"] / 50


def test_cast_on_device_untied_head_lands_without_unpacking():
    df = plan(QWEN25_7B, batch=1, seq=4096, cast_on_device=True).simulate()
    assert df[df.lane == "host-unpack"].op.tolist() == ["embed_grad"]
    assert set(df[df.lane == "d2h"].query("layer == -1").bytes) == {4096 * 3584 * 2}  # dE comes back bf16, as the
    # engine's pinned buffer holds it (embedding.backward; the H200's 14B x 8 trace: 335544320 bytes, 2 an element)


def test_cast_stage_is_two_fp32_chunks():
    p = plan(QWEN25_3B, batch=1, seq=4096, cast_on_device=True, transfer_chunk_bytes=64 << 20)
    assert p.device_bytes["cast_stage"] == 2 * (32 << 20) * 4  # 64 MiB of bf16 per chunk lands as 128 MiB of fp32
    assert sum(p.device_bytes.values()) - sum(plan(QWEN25_3B, batch=1, seq=4096).device_bytes.values()) == 256 << 20
    assert "cast_stage" not in plan(QWEN25_3B, batch=1, seq=4096, pin_store=True).device_bytes


@pytest.mark.parametrize("family", ["llama", "llama_tied", "qwen2"])
@pytest.mark.parametrize("pinning", ["cast_on_device", "pin_store"])
def test_bytes_agree_with_preflight(family, pinning, monkeypatch):
    """Where both count the same thing, plan's bytes equal preflight.estimate's (which tests in
    test_preflight.py hold equal to what HostStore and the engine allocate). Every tensor here is a
    multiple of 64 elements: HostStore's alignment padding, which the planner does not count, is nil."""
    import torch

    from conftest import make_config
    from megatrain_nb.machine import preflight
    from megatrain_nb.config import EngineConfig

    config, batch, seq = make_config(family, hidden_size=64, intermediate_size=128, num_key_value_heads=4), 2, 12
    cfg = EngineConfig(dtype=torch.bfloat16, transfer_chunk_bytes=1 << 20, pinned_budget_bytes=8 << 20,
                       cast_on_device=False, pin_store=False)
    cfg.device, cfg.pin_store, cfg.cast_on_device = "cuda", pinning == "pin_store", pinning == "cast_on_device"
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (1 << 40, 1 << 40))  # no CUDA here: say "cuda"
    est = preflight.estimate(config, cfg, batch=batch, seq=seq)
    p = plan(config, batch=batch, seq=seq, transfer_chunk_bytes=1 << 20, pinned_budget_bytes=8 << 20,
             pin_store=pinning == "pin_store", cast_on_device=pinning == "cast_on_device")
    assert p.shape["n_params"] == est["store"]["params"]
    store = ("master_fp32", "adam_moments", "grads", "pinned_copy")
    assert sum(v for k, v in p.host_bytes.items() if k in store) == est["store"]["total"]
    assert p.host_bytes_per_param == pytest.approx(est["store"]["bytes_per_param"])
    for k in ("weight_slots", "grad_slots", "head_slots", "embedding_rows", "logits"):
        assert p.device_bytes[k] == est["device"][k], k
    assert p.device_bytes.get("cast_stage", 0) == est["device"]["cast_stage"]
    assert (est["device"]["cast_stage"] > 0) == (pinning == "cast_on_device")


def test_pin_store_and_cast_on_device_exclude_each_other():
    with pytest.raises(ValueError, match="pin_store=True and cast_on_device=True"):
        plan(QWEN25_3B, batch=1, seq=8, pin_store=True, cast_on_device=True)


def test_fp32_adam_rate_defaults_to_the_main_rate():
    one = dataclasses.replace(H200, host_adam_params_per_s=2e9, host_adam_fp32_params_per_s=None)
    p = plan(QWEN25_3B, batch=1, seq=4096, hardware=one)
    assert p.simulate().query("lane == 'host-adam' and layer == -1").dur_ms.iloc[0] == pytest.approx(
        151936 * 2048 / 2e6, abs=1e-3)
    assert plan(QWEN25_3B, batch=1, seq=4096, dtype_bytes=4).layer_ms["adam"] == pytest.approx(77_076_992 / 3.90e6)
    with pytest.raises(ValueError, match="host_adam_fp32_params_per_s"):
        dataclasses.replace(H200, host_adam_fp32_params_per_s=0.0)


# ---- steady state: steps back to back (Note: [Steady state] in planner.py) ----------------------------


def _previous_updates(df) -> dict:
    """unit -> end of the previous step's update of it, for those that end within the steady step (a
    step's own update of a unit starts only after the compute that made its gradients: bwd, loss, embed_bwd);
    "rows": the end of the embedding's early rows (Note: [Early rows]), else of its whole update."""
    made = df[(df.lane == "compute") & df.op.isin(["bwd", "loss", "embed_bwd"])]
    made = dict(zip(made.layer, made.end_ms))
    adam = df[df.lane == "host-adam"]
    prev = adam[adam.start_ms < adam.layer.map(made)]
    whole, rows = prev[prev.op == "adam"], prev[prev.op == "adam-rows"]
    assert whole.layer.is_unique and len(rows) <= 1
    out = dict(zip(whole.layer, whole.end_ms))
    if len(rows) or -1 in out:
        out["rows"] = rows.end_ms.iloc[0] if len(rows) else out[-1]
    return out


def _units_of_load(layer: int, p) -> tuple:
    """Units whose update a load of `layer` waits for: a tied head's slot also holds the embedding; the
    embedding's rows wait for its early rows (or its whole update)."""
    L = p.shape["layers"]
    return (L, -1) if layer == L and p.shape["tied"] else ("rows",) if layer == -1 else (layer,)


@pytest.mark.parametrize("config, batch", [(QWEN25_3B, 1), (QWEN25_3B, 4), (QWEN25_7B, 2)])
def test_steady_step_is_shorter_than_cold_when_adamw_bounds(config, batch):
    # Cold, AdamW idles through the whole forward; back to back, the previous step's updates fill it.
    p = plan(config, batch=batch, seq=4096, cast_on_device=True)
    assert p.bottleneck == "host-adam"
    assert p.busy_ms["host-adam"] <= p.steady_step_ms < 0.95 * p.step_ms  # each period holds a step's updates


def test_steady_loads_start_after_their_units_previous_update():
    p = plan(QWEN25_3B, batch=1, seq=4096, cast_on_device=True)
    df = p.simulate_steady()
    prev = _previous_updates(df)
    assert {-1, 0, 1} <= set(prev)  # the last step's tail: the embedding first, then layers in forward order
    held = 0
    for r in df[(df.lane == "h2d") & df.phase.isin(["fwd", "loss"])].itertuples():
        for u in _units_of_load(r.layer, p):
            if u in prev:
                assert r.start_ms >= prev[u] - 1e-3, (r.layer, r.start_ms, prev[u])
                held += abs(r.start_ms - prev[u]) < 1e-3  # a pinned DMA starts right as its update ends
    assert held >= 20  # most forward loads are held by AdamW on this row


def test_steady_wait_update_spans_are_exactly_where_the_loader_waited():
    p = plan(QWEN25_3B, batch=1, seq=4096, cast_on_device=True)
    df = p.simulate_steady()
    prev, L = _previous_updates(df), p.shape["layers"]
    pack = df[df.lane == "host-pack"]
    expected, at = [], 0.0  # the loader is one FIFO thread: it reaches a load once the earlier ones are through
    for layer in [-1, *range(L), L]:
        for u in _units_of_load(layer, p):
            if prev.get(u, float("-inf")) > at:
                expected.append((layer, round(at, 3), round(prev[u], 3)))
                at = prev[u]
        at = max([at, *pack[pack.layer == layer].end_ms])  # its own packing (the embedding rows)
    waits = df[df.op == "wait-update"]
    got = [(r.layer, round(r.start_ms, 3), round(r.end_ms, 3)) for r in waits.itertuples()]
    assert len(expected) >= 20 and got == expected
    assert (waits.lane == "host-pack").all() and set(waits.phase) <= {"fwd", "loss"}
    # trace.find_stalls blames the optimizer through them, as on recordings; the cold step never waits on it
    blamed = find_stalls(df).groupby("waited_on").dur_ms.sum()
    assert blamed["optimizer"] > 0.4 * p.steady_step_ms and blamed.idxmax() == "optimizer"
    assert "optimizer" not in set(find_stalls(p.simulate()).waited_on)


def test_steady_updates_go_in_forward_order_once_every_unit_landed():
    p = plan(QWEN25_3B, batch=1, seq=4096, cast_on_device=True)
    adam = p.simulate_steady().query("lane == 'host-adam'").sort_values("start_ms")
    order = list(zip(adam.op, adam.layer))
    i = order.index(("adam-rows", -1))  # Note: [Early rows]: the next forward's rows first, the whole table last
    before, m = [u for _, u in order[:i]], min(u for _, u in order[:i])  # the last step's, in landing order (..., m)
    assert before == sorted(before, reverse=True) and order[i + 1:i + 2 + m] == [("adam", u) for u in [*range(m), -1]]
    own = [u for _, u in order[i + 2 + m:]]  # this step's, in landing order: head first
    assert own == list(range(36, 36 - len(own), -1)) and len(own) > 5
    # gated (grad_clip): no update before the last landing, then all in forward order, during the next step
    clip = plan(QWEN25_3B, batch=1, seq=4096, cast_on_device=True, grad_clip=True).simulate_steady()
    assert clip.query("lane == 'host-adam'").sort_values("start_ms").layer.tolist() == list(range(-1, 37))


@pytest.mark.parametrize("pinning", [{}, dict(cast_on_device=True)])
def test_steady_and_cold_agree_when_the_optimizer_is_fast(pinning):
    fast = dataclasses.replace(H200, name="H200, instant AdamW", host_adam_params_per_s=1e15,
                               host_adam_fp32_params_per_s=1e15)
    p = plan(QWEN25_3B, batch=1, seq=4096, hardware=fast, **pinning)
    assert p.steady_step_ms == pytest.approx(p.step_ms, rel=1e-5)
    steady, cold = p.simulate_steady(), p.simulate()
    assert steady.query("op == 'wait-update'").dur_ms.sum() < 0.01  # the embedding's update: ~0.3 µs
    assert (steady.start_ms >= -0.01).all()  # nothing of the last step is left to run into this one
    work = steady[~steady.op.isin(["wait-update", "adam-rows"])]  # early rows: for a next step, which cold has not
    assert work.groupby(["lane", "op"]).size().to_dict() == cold.groupby(["lane", "op"]).size().to_dict()
    a, b = (x[x.lane != "host-adam"].sort_values(["lane", "start_ms"], kind="stable") for x in (work, cold))
    assert a[["lane", "op", "layer"]].values.tolist() == b[["lane", "op", "layer"]].values.tolist()
    assert (a.start_ms.values - b.start_ms.values).max() < 0.01  # the same timeline, not merely the same length


def test_steady_state_repeats_and_reads_like_a_recording():
    p = plan(QWEN25_3B, batch=1, seq=4096, cast_on_device=True)
    df = p.simulate_steady()
    assert list(df.columns) == list(Trace(step=0).to_dataframe().columns)
    assert df.end_ms.max() == pytest.approx(p.steady_step_ms, abs=1e-3) == summarize(df)["step_ms"]
    assert df[df.lane == "host-adam"].start_ms.min() < 0  # the last step's update that was running at the start
    assert (df[df.lane != "host-adam"].start_ms >= 0).all()
    comp = df[df.lane == "compute"].op.value_counts().to_dict()
    assert comp == {"fwd": 36, "bwd": 36, "loss": 1, "embed_bwd": 1}  # one step's compute, whole
    for n in (4, 7):  # periodic: more steps give the same step
        more = p.simulate_steady(steps=n)
        assert set(more.step) == {n - 1}
        assert more[["lane", "op", "layer"]].values.tolist() == df[["lane", "op", "layer"]].values.tolist()
        assert abs(more[["start_ms", "end_ms"]].values - df[["start_ms", "end_ms"]].values).max() < 1e-3
    first = p.simulate_steady(steps=1)  # from cold, ending when its driver returns
    assert first.start_ms.min() >= 0 and "wait-update" not in set(first.op)
    assert first.end_ms.max() < p.step_ms - 50  # the cold step also waits for its last updates


def test_steady_errors_name_the_problem():
    p = plan(QWEN25_05B, batch=1, seq=256)
    for bad in (0, -1, 2.0):
        with pytest.raises(ValueError, match="^steps must be an int >= 1"):
            p.simulate_steady(steps=bad)
    with pytest.raises(ValueError, match="not made by plan"):
        dataclasses.replace(p, _sim=()).simulate_steady()


def test_plan_is_part_of_the_package_api():
    """The contract says `megatrain_nb.plan(...)`."""
    import megatrain_nb

    assert megatrain_nb.plan is plan and megatrain_nb.H200 is H200 and megatrain_nb.Hardware is Hardware
    p = megatrain_nb.plan(dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                               vocab_size=100), batch=1, seq=16)
    assert p.step_ms > 0 and p.steady_step_ms > 0


def test_auto_placement_chooses_as_the_engine_search_does():
    """7B at 2 x 4096 (H200): activations first keeps every layer and leaves room for half the units;
    residency first recomputes layers to make nearly all resident, and is faster: 'auto' takes it
    (measured in one run: 0.990 s a step, 28 layers resident; bench/planner_placement.py; before lean
    activations, so planned with lean_activations=False)."""
    a = plan(QWEN25_7B, batch=2, seq=4096, cast_on_device=True, placement="auto", lean_activations=False)
    first = plan(QWEN25_7B, batch=2, seq=4096, cast_on_device=True, placement="auto", _search=False,
                 lean_activations=False)  # no search
    n = lambda p: sum(v == "resident" for v in p.placement.values())  # noqa: E731
    assert n(a) > n(first) and a.recomputed_layers > first.recomputed_layers == 0
    assert a.steady_step_ms < 0.97 * first.steady_step_ms and a.settings["placement"] == "auto"
    small = plan(QWEN25_3B, batch=1, seq=4096, cast_on_device=True, placement="auto")
    assert n(small) == 38 and small.recomputed_layers == 0  # everything fits: nothing to search


def test_a_streamed_plan_writes_state_back_on_its_own_lane_and_no_step_waits_for_it():
    """Note: [State write-backs]: "device" units' state goes out on lane d2h-state, not behind (or ahead of) the
    gradients on d2h; Note: [Late write-backs]: the last ones run into the next step (before its origin)."""
    p = plan(QWEN25_3B, batch=1, seq=4096, cast_on_device=True, weight_slots=36, placement=dict.fromkeys(range(10), "device"))
    df = p.simulate()
    state = df[df.lane == "d2h-state"]
    assert sorted(state.layer) == list(range(10)) and set(state.op) == {"state-out"}
    assert set(df[df.lane == "d2h"].op) == {"d2h"}  # gradients only
    rows = df[(df.lane == "d2h") & (df.layer == -1)]  # the embedding rows' gradients: not queued behind the state
    assert rows.start_ms.min() < state.end_ms.max()
    steady = p.simulate_steady()
    late = steady[(steady.lane == "d2h-state") & (steady.start_ms < 0)]
    assert len(late) and set(late.layer) <= set(range(10))  # the last layers' write-backs, begun in the step before


def test_the_simulated_loader_starts_state_loads_while_it_waits_for_a_host_update():
    """Note: [Early state]: in a steady `stream` step whose first host-placed layer's update is late, the
    simulated loader starts the backward's first state loads (slots free, units landed) while it waits, as the
    engine's packer does; without that the h2d lane would idle, so the step is no longer than without it."""
    slow = dataclasses.replace(H200, host_adam_params_per_s=1.2e9)
    p = plan(QWEN25_3B, batch=1, seq=4096, hardware=slow, cast_on_device=True, weight_slots=36,
             placement=dict.fromkeys(range(20), "device"))
    df = p.simulate_steady()
    h2d = df[(df.lane == "h2d") & (df.start_ms >= 0)].sort_values("start_ms")
    first_weights = h2d[h2d.op == "h2d"].start_ms.min()
    early = h2d[(h2d.op == "state-in") & (h2d.start_ms < first_weights)]
    assert len(early) >= 1 and set(early.layer) <= set(range(12, 20))  # the backward's first "device" layers
    waits = df[(df.op == "wait-update") & (df.start_ms >= 0)]
    assert early.start_ms.min() >= waits.start_ms.min()  # started during the loader's wait


# ---- optimizer_state: compact Adam moments -----------------------------------------------------------------
TINY_QWEN2 = dict(model_type="qwen2", hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, vocab_size=1000, tie_word_embeddings=False)


@pytest.mark.parametrize("state", ["fp32", "int8", "int4"])
def test_optimizer_state_host_bytes_agree_with_preflight(state, monkeypatch):
    """Every tensor of TINY_QWEN2 is a multiple of 64 values: no alignment padding, so plan's moments equal
    preflight's, unit by unit as compact_state lays them out."""
    import torch
    from transformers import Qwen2Config

    from megatrain_nb.machine import preflight
    from megatrain_nb.config import EngineConfig

    config = Qwen2Config(**{k: v for k, v in TINY_QWEN2.items() if k != "model_type"})
    cfg = EngineConfig(dtype=torch.bfloat16, transfer_chunk_bytes=1 << 20, pinned_budget_bytes=8 << 20)
    cfg.device, cfg.cast_on_device, cfg.pin_store = "cuda", True, False
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (1 << 40, 1 << 40))
    est = preflight.estimate(config, cfg, batch=1, seq=16, optimizer_state=state)  # the embedding's rows: 16 tokens'
    p = plan(TINY_QWEN2, batch=1, seq=16, cast_on_device=True, transfer_chunk_bytes=1 << 20,
             pinned_budget_bytes=8 << 20, optimizer_state=state)
    assert p.host_bytes["adam_moments"] == est["store"]["exp_avg"] + est["store"]["exp_avg_sq"]
    assert p.host_bytes_per_param == pytest.approx(est["store"]["bytes_per_param"])
    assert p.summary()["optimizer_state"] == state and p.summary()["host_bytes_per_param"] == p.host_bytes_per_param
    rows = p.to_dataframe().query("section == 'step'").set_index("quantity").value
    assert rows["optimizer_state"] == state


def test_optimizer_state_host_bytes_qwen25_7b():
    from megatrain_nb.host.compact_state import bytes_per_param

    n, e = 7_615_616_512, 152064 * 3584
    b = {k: plan(QWEN25_7B, batch=1, seq=4096, optimizer_state=k, grad_ring=False) for k in ("fp32", "int8", "int4")}
    assert b["fp32"].host_bytes["adam_moments"] == 8 * n and round(b["fp32"].host_bytes_per_param, 2) == 14.14
    for k in ("int8", "int4"):  # the embedding keeps fp32 moments; the rest: ~bytes_per_param, plus norms and k/v biases
        rest = (b[k].host_bytes["adam_moments"] - 8 * e) / (n - e)
        assert bytes_per_param(k) < rest < bytes_per_param(k) + 0.01, (k, rest)
        assert b[k].host_bytes["master_fp32"] == 4 * n and b[k].host_bytes["grads"] == b["fp32"].host_bytes["grads"]
    assert round(b["int8"].host_bytes_per_param, 2) == 8.60 and round(b["int4"].host_bytes_per_param, 2) == 7.70
    with pytest.raises(ValueError, match="optimizer_state='int2'"):
        plan(QWEN25_7B, batch=1, seq=4096, optimizer_state="int2")


def test_optimizer_state_changes_the_streamed_state_bytes():
    """A "device" unit's state over PCIe: master 4 bytes + its compact moments; the split master is off."""
    from megatrain_nb.machine.planner import moment_bytes

    p = {k: plan(QWEN25_7B, batch=1, seq=4096, cast_on_device=True, placement="stream", weight_slots=28,
                 optimizer_state=k) for k in ("fp32", "int8", "int4")}
    s, P = p["fp32"].shape, 233_057_792
    assert p["fp32"].layer_ms["state_bytes"] == 10 * P  # split master, weights held: D alone
    assert p["fp32"].device_bytes["state_slots"] % (16 * P) == 0
    for k in ("int8", "int4"):
        want = 4 * P + moment_bytes(s, k)[0]
        assert 4 + 2 * {"int8": 1, "int4": 0.5}[k] < want / P < 4 + 2 * {"int8": 1.04, "int4": 0.54}[k]
        t = p[k].layer_ms
        assert t["state_bytes"] == want and t["state_out"] == pytest.approx(want / 52.1e6)
        assert t["head_state_bytes"] == 4 * (s["head_params"]) + moment_bytes(s, k)[s["layers"]]  # untied lm_head
        assert p[k].device_bytes["state_slots"] % want == 0 and p[k].device_bytes["head_state"] == t["head_state_bytes"]
        df = p[k].simulate()
        layers = df[(df.op == "state-in") & (df.layer >= 0) & (df.layer < 28)]
        assert len(layers) and set(layers.bytes) == {want}
    streamed = {k: sum(v == "device" for v in q.placement.values()) for k, q in p.items()}
    assert streamed["fp32"] < streamed["int8"] <= streamed["int4"]  # less state a unit: more units on the device
    # fp32 unchanged by the new keyword: 12 bytes a parameter without the split
    q = plan(QWEN25_7B, batch=1, seq=4096, cast_on_device=True, placement="stream", weight_slots=28, split_master=False)
    assert q.layer_ms["state_bytes"] == 12 * P and q.layer_ms["head_state_bytes"] == 12 * s["head_params"]


def test_host_short_plan_advises_the_optimizer_state():
    from megatrain_nb.machine.shape import QWEN25

    with pytest.warns(UserWarning, match="does not fit host RAM"):
        p = plan(QWEN25["14B"], batch=1, seq=4096, cast_on_device=True)
    assert not p.fits_host and "Fits with optimizer_state='int8' or optimizer_state='int4'." in p.advice
    assert plan(QWEN25["14B"], batch=1, seq=4096, cast_on_device=True, optimizer_state="int8").fits_host


# ---- MoE: compute counts the active parameters, bytes count all of them ------------------------------
def test_model_shape_counts_moe_tiny_configs_by_hand():
    """Tiny gpt-oss and Qwen3-MoE (every layer MoE): hidden 32, 4 heads of 8, 2 KV heads, 4 experts, top 2."""
    import sys
    sys.path.insert(0, str(__import__("pathlib").Path(__file__).parent))
    from conftest import make_config
    from megatrain_nb.model.hf import load_architecture

    h, heads, kv, hd, E, k, vocab = 32, 4, 2, 8, 4, 2, 96
    # gpt-oss: sinks, q k v o with biases; router with bias; gate_up (E, h, 2I) + bias, down (E, I, h) + bias
    attn = heads + (h * heads * hd + heads * hd) + 2 * (h * kv * hd + kv * hd) + (heads * hd * h + h)
    expert = h * 2 * 32 + 2 * 32 + 32 * h + h
    s = model_shape(make_config("gpt_oss"))
    assert s["params_per_layer"] == attn + (E * h + E) + E * expert + 2 * h
    assert s["active_params_per_layer"] == attn + (E * h + E) + k * expert + 2 * h
    assert s["active_params"] == 2 * s["active_params_per_layer"] + 2 * vocab * h + h == 25584
    assert s["active_params"] == load_architecture(make_config("gpt_oss")).active_params()
    # Qwen3-MoE: q k v o, q / k norms; router; experts of moe_intermediate_size 32
    cfg = make_config("qwen3_moe", mlp_only_layers=[])
    attn = h * heads * hd + 2 * h * kv * hd + heads * hd * h + 2 * hd
    s = model_shape(cfg)
    assert s["active_params_per_layer"] == attn + E * h + k * 3 * h * 32 + 2 * h
    assert s["n_params"] == 2 * (attn + E * h + E * 3 * h * 32 + 2 * h) + 2 * vocab * h + h
    arch = load_architecture(cfg)
    assert (s["n_params"], s["active_params"]) == (sum(p.numel() for p in arch.model.parameters()), arch.active_params())


def test_plan_of_an_moe_computes_active_params_and_moves_all():
    """Routing more experts a token costs compute only: the same weights cross PCIe and live on the host."""
    moe = dict(model_type="gpt_oss", hidden_size=2048, intermediate_size=2048, num_hidden_layers=4,
               num_attention_heads=16, num_key_value_heads=4, head_dim=64, num_local_experts=16,
               vocab_size=32000, tie_word_embeddings=False, attention_bias=True)
    few = plan(dict(moe, num_experts_per_tok=2), batch=8, seq=4096, _advise=False)
    many = plan(dict(moe, num_experts_per_tok=16), batch=8, seq=4096, _advise=False)
    assert few.host_bytes == many.host_bytes and few.layer_ms["h2d"] == many.layer_ms["h2d"]
    assert many.layer_ms["fwd"] > 2 * few.layer_ms["fwd"]
    assert few.shape["active_params"] < few.shape["n_params"] == many.shape["n_params"] == many.shape["active_params"]


def test_gpt_oss_20b_shape_counts_as_the_released_model():
    import sys
    sys.path.insert(0, str(__import__("pathlib").Path(__file__).parents[2] / "bench"))
    from shapes import GPT_OSS_20B, gpt_oss_config
    from megatrain_nb.model.hf import load_architecture

    s = model_shape(GPT_OSS_20B)
    arch = load_architecture(gpt_oss_config())  # a skeleton on the meta device: nothing allocated
    assert s["n_params"] == sum(p.numel() for p in arch.model.parameters()) == 20_914_757_184
    assert s["active_params"] == arch.active_params() == 4_187_440_704


def test_an_moe_layers_experts_run_at_their_measured_rate():
    """Note: [Experts rate]: with ``experts_tflops`` the gpt-oss-20b layer's forward and backward are the engine's
    (38.7 and 132.1 ms on an H100, 2026-12-07), where the dense model said 18.7 and 37.4 ms; a dense model's layer
    is unchanged, a smaller card's rates are scaled down, and bad rates are refused."""
    import sys
    sys.path.insert(0, str(__import__("pathlib").Path(__file__).parents[2] / "bench"))
    from shapes import GPT_OSS_20B

    from megatrain_nb.machine.cards import card

    moe = plan(GPT_OSS_20B, batch=8, seq=4096, optimizer_state="int4", placement="auto")
    dense_rate = plan(GPT_OSS_20B, batch=8, seq=4096, optimizer_state="int4", placement="auto",
                      hardware=dataclasses.replace(H200, experts_tflops=None))
    assert moe.layer_ms["fwd"] == pytest.approx(38.7, rel=0.02) and moe.layer_ms["bwd"] == pytest.approx(132.1, rel=0.02)
    assert dense_rate.layer_ms["bwd"] < 40 < moe.layer_ms["bwd"]
    assert (dense_rate.bottleneck, moe.bottleneck) == ("host-adam", "compute")  # what bounds the step, as measured
    for shape in (QWEN25_7B,):  # no experts: the rate does not apply
        a = plan(shape, batch=8, seq=4096, _advise=False)
        b = plan(shape, batch=8, seq=4096, _advise=False, hardware=dataclasses.replace(H200, experts_tflops=None))
        assert a.layer_ms == b.layer_ms
    rtx = card("RTX 4090")
    assert all(0 < r < h for r, h in zip(rtx.experts_tflops, H200.experts_tflops))
    with pytest.raises(ValueError, match="experts_tflops"):
        dataclasses.replace(H200, experts_tflops=(196.0, 0.0))


def test_the_next_forwards_rows_wait_for_the_early_rows_not_the_whole_embedding():
    """Note: [Early rows]: the worker updates the rows the next forward gathers, then every other unit, then the
    whole table; the forward's rows load waits for the first. Gated (grad_clip) it waits for the whole update."""
    p = plan(QWEN25_7B, batch=8, seq=4096, cast_on_device=True)
    df = p.simulate_steady()
    rows = df[df.op == "adam-rows"]
    whole = df[(df.op == "adam") & (df.layer == -1)]
    load = df[(df.lane == "h2d") & (df.layer == -1) & (df.phase == "fwd")]
    assert len(rows) == len(load) == 1 and len(whole) >= 1
    assert rows.end_ms.iloc[0] <= load.start_ms.iloc[0] + 1e-3 < whole.end_ms.max()  # the rows, not the table
    assert rows.dur_ms.iloc[0] < whole.dur_ms.max()  # ~30K of 152064 rows
    clip = plan(QWEN25_7B, batch=8, seq=4096, cast_on_device=True, grad_clip=True)
    assert "embed_rows_adam" not in clip.layer_ms and "adam-rows" not in set(clip.simulate_steady().op)


def test_an_untied_embeddings_gradient_as_rows_costs_the_rows_not_the_table():
    """Note: [Embedding rows]: with the ring, the host adds the step's rows into touched rows, no table-sized slab."""
    dur = {}
    for ring in (True, False):
        df = plan(QWEN25_7B, batch=8, seq=4096, cast_on_device=True, grad_ring=ring).simulate()
        dur[ring] = df[(df.op == "embed_grad") & (df.layer == -1)].dur_ms.sum()
    assert 0 < dur[True] < 0.5 * dur[False]
