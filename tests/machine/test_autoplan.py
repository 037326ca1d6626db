"""autoplan.py: the planner's predictions behind placement "auto" (the search's pick, the micro-batch).

The CUDA path of ``DeviceUpdates`` (the measuring step's ``after_step``, ``micro_batch``) runs here on fakes:
a device that says it is CUDA, with the H200's memory and an allocator peak taken from the planner's own
plan of candidate A, so the numbers the planner is given are those the engine would measure there.
"""
from __future__ import annotations

import time
from types import SimpleNamespace

import pytest
import torch

from megatrain_nb.machine import autoplan, planner
from megatrain_nb.machine import placement as placing
from megatrain_nb.config import EngineConfig, OptimConfig
from megatrain_nb.machine.shape import QWEN25
from megatrain_nb.host.grad_ring import ring_units, spill_bytes
from megatrain_nb.step import device_updates
from megatrain_nb.step.device_updates import SPILL_HOST_MARGIN, DeviceUpdates

SHAPES = {name.lower(): shape for name, shape in QWEN25.items()}  # the Qwen2.5 shapes, as the planner takes them
SEQ = 4096


# ---- the micro-batch (pure) -------------------------------------------------------------------------
def test_choose_micro_batch_takes_the_most_tokens_a_second_ties_to_the_larger():
    calls = []

    def predict(m):
        calls.append(m)
        return {16: 3.6, 8: 3.1, 4: 3.1, 2: 3.3, 1: 4.0}[m]
    assert autoplan.choose_micro_batch(16, SEQ, predict) == 8  # 8 and 4 tie: the larger
    assert sorted(calls) == [1, 2, 4, 8, 16], "every divisor, and nothing else"
    assert autoplan.choose_micro_batch(12, SEQ, lambda m: 1.0 + (m == 3) * -0.1) == 3
    assert autoplan.choose_micro_batch(7, SEQ, lambda m: 1.0) == 7  # a prime: itself or 1
    assert autoplan.choose_micro_batch(1, SEQ, lambda m: 1.0) == 1


@pytest.mark.parametrize("shape,batch", [("3b", 8), ("3b", 16), ("7b", 8), ("14b", 8)])
def test_micro_batch_step_never_beats_the_whole_batch_at_h200_shapes(shape, batch):
    """Note: [Micro-batch choice]: every micro-batch's activations stay, so splitting only adds launches."""
    m, why = autoplan.micro_batch(SHAPES[shape], batch=batch, seq=SEQ, hardware=planner.H200, dtype_bytes=2,
                                  settings=dict(cast_on_device=True))
    assert m == batch, why
    whole = autoplan.micro_batch_step(SHAPES[shape], batch=batch, seq=SEQ, micro=batch, hardware=planner.H200,
                                      dtype_bytes=2, settings={})
    one = autoplan.micro_batch_step(SHAPES[shape], batch=batch, seq=SEQ, micro=1, hardware=planner.H200,
                                    dtype_bytes=2, settings={})
    assert one >= whole > 0


# ---- DeviceUpdates' CUDA path on fakes ----------------------------------------------------------------
def _fake_updates(monkeypatch, cfg: dict, *, batch: int, adam_rate: float = 1.8e9, host_free: int | None = None,
                  **ecfg):
    """A DeviceUpdates of ``cfg`` on a pretend H200 (no tensors of the model), and what its measuring step
    of ``batch`` x SEQ would measure there: (updates, keep, layer bytes, micro-batches). ``host_free``: bytes
    the host has free, with the gradient ring (None: slabs, no ring)."""
    s = planner.model_shape(cfg)
    L = s["layers"]
    numel = {-1: s["embed_params"], **dict.fromkeys(range(L), s["params_per_layer"]), L: s["head_params"]}
    du = DeviceUpdates.__new__(DeviceUpdates)  # only what after_step and micro_batch read
    du.store = SimpleNamespace(units={u: SimpleNamespace(layout=SimpleNamespace(numel=n)) for u, n in numel.items()},
                               shared=None, num_params=lambda: sum(numel.values()),
                               ring=None if host_free is None else SimpleNamespace(numel=ring_units(numel)))
    monkeypatch.setattr(device_updates, "host_available", lambda budget: host_free)
    du.arch = SimpleNamespace(tied=s["tied"], config=cfg, embed=SimpleNamespace(weight=torch.empty(0, s["hidden"])),
                              num_layers=L)
    du.dev, du.mode, du.dp, du.gate, du.share = SimpleNamespace(cuda=True, device="cuda:0"), "auto", None, False, 0.0
    du.ecfg, du.ocfg, du.dtype = EngineConfig(device="cpu", **ecfg), OptimConfig(), torch.bfloat16
    du.ecfg.cast_on_device = True  # as the engine resolves it on CUDA (preflight.resolve_pinning)
    du.search, du.micro, du.micro_reason, du.passes, du.pass_reason = placing.Search(), {}, "", {}, ""
    du.adam_rate = (sum(numel.values()), sum(numel.values()) / adam_rate)
    du.io = SimpleNamespace(take_update_wait=lambda: 0.0)
    # what the measuring step (nothing resident) would measure: the planner's own plan of A
    a = autoplan._plan(cfg, batch=batch, seq=SEQ, hardware=planner.H200, dtype_bytes=2, placement="host",
                       cast_on_device=True)
    peak = sum(a.device_bytes.values()) - a.device_bytes["reserve"]
    total = planner.H200.device_mem_bytes
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda d: SimpleNamespace(total_memory=total))
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda d: peak)
    act = a.device_bytes["activations_kept"] // max(1, sum(a.keep))
    du.t_start = time.perf_counter() - a.steady_step_ms / 1e3 * 1.3  # a measuring step: first-step costs too
    return du, a.keep, act, [{"input_ids": torch.zeros(batch, SEQ, dtype=torch.long)}]


@pytest.mark.parametrize("shape", ["3b", "7b", "14b"])
def test_the_measuring_step_settles_on_the_planners_best(monkeypatch, shape):
    du, keep, act, mbs = _fake_updates(monkeypatch, SHAPES[shape], batch=8)
    t0 = time.perf_counter()
    du.after_step(keep=keep, act_bytes=act, mbs=mbs)
    took = time.perf_counter() - t0
    s = du.search
    msg = f"{shape} x 8: {s.summary()} | free {({c: round(v / 2**30, 1) for c, v in s.free.items()})} GiB | " \
          f"kept {sum(keep)} of {len(keep)} | predicted {s.predicted}"
    assert s.phase in ("done", "C1", "B1") and s.winner is not None, msg
    if s.predicted:
        assert s.predicted[s.winner] <= min(s.predicted.values()) * (1 + placing.MARGIN), msg
        assert all(1.0 < v < 30.0 for v in s.predicted.values()), msg  # seconds a step at 8 x 4096: sane
        assert set(s.predicted) >= {"A", "B"}, msg
    assert took < 5.0, f"the planner took {took:.1f} s between steps"
    assert s.summary().startswith("auto chose "), msg
    steps = 1 + (s.phase != "done")  # the measuring step, and a trial's gated first step
    while s.phase != "done":
        du.after_step(keep=keep, act_bytes=act, mbs=mbs)
    assert steps <= 2 and s.phase == "done", msg  # settled from the third step at the latest
    print(msg)


def test_7b_x8_takes_the_forwards_head_resident_at_the_measured_host_rate(monkeypatch):
    """7B x 8 on the H200 with the host AdamW rate measured there (2.98 s a step: 2.55 G params/s) timed C
    3.23 s, A 3.71, B 3.76: the planner must rank C first, as measured."""
    du, keep, act, mbs = _fake_updates(monkeypatch, SHAPES["7b"], batch=8, adam_rate=2.55e9)
    du.after_step(keep=keep, act_bytes=act, mbs=mbs)
    s = du.search
    line = ", ".join(f"{placing.Search.NAMES[c]} {v:.3f} s" for c, v in s.predicted.items())
    assert s.predicted and all(f"{v:.3f} s" in s.summary() for v in s.predicted.values()), line
    assert s.winner == "C" and s.phase == "C1" and s.trial, (s.winner, line)
    assert 3.0 < s.predicted["C"] < 3.7 and s.predicted["A"] > 3.5, line
    inputs = s.inputs()  # what a benchmark row records of the measuring step
    assert inputs["host_adam_G_params_per_s"] == 2.55 and inputs["kept_layers"] == sum(keep), inputs
    assert inputs["free_gib"] == {c: round(b / 2**30, 2) for c, b in s.free.items()} and set(inputs["free_gib"]) >= {"A", "B", "C"}


def test_a_trial_that_the_host_cannot_hold_is_not_entered(monkeypatch):
    """With the gradient ring, C's trial step holds 7B's every gradient at once (13.2 GiB of bf16, 11.3 beyond what
    the ring's buffers hold): entered where the host has that and the margin free, else A, saying why (a slower
    step, not a host out of memory)."""
    s7 = planner.model_shape(SHAPES["7b"])
    every = (s7["n_params"] - s7["embed_params"]) * 2
    need = spill_bytes({**dict.fromkeys(range(s7["layers"]), s7["params_per_layer"]), s7["layers"]: s7["head_params"]}, 2)
    assert every - need == (2 * s7["params_per_layer"] + s7["head_params"]) * 2  # the head's region, two layers' buffers
    du, keep, act, mbs = _fake_updates(monkeypatch, SHAPES["7b"], batch=8, adam_rate=2.55e9,
                                       host_free=need + SPILL_HOST_MARGIN)
    du.after_step(keep=keep, act_bytes=act, mbs=mbs)
    assert du.search.phase == "C1" and du.search.trial, du.search.summary()
    du, keep, act, mbs = _fake_updates(monkeypatch, SHAPES["7b"], batch=8, adam_rate=2.55e9,
                                       host_free=need + SPILL_HOST_MARGIN - 1, host_memory="64GiB")
    du.after_step(keep=keep, act_bytes=act, mbs=mbs)
    s = du.search
    assert (s.phase, s.winner, s.trial) == ("done", "A", False), s.summary()
    assert (f"but its trial step cannot run: every unit's gradients at once take {need / 2**30:.1f} GiB beyond the "
            "gradient ring") in s.summary()
    assert f"under host_memory={64 << 30}" in s.summary(), s.summary()


def test_passes_are_chosen_only_where_the_host_holds_every_gradient(monkeypatch):
    """3B x 16 runs as two passes of 8 (Note: [Pass choice]); with the ring, passes hold every gradient until the
    last, so where the host cannot hold them the batch runs as one pass, and the reason says so."""
    du, *_ = _fake_updates(monkeypatch, SHAPES["3b"], batch=16)  # slabs
    assert du.pass_rows(16, SEQ) == 8 and du.pass_reason.startswith("2 passes of 8 rows"), du.pass_reason
    du, *_ = _fake_updates(monkeypatch, SHAPES["3b"], batch=16, host_free=1 << 40)
    assert du.pass_rows(16, SEQ) == 8, du.pass_reason
    du, *_ = _fake_updates(monkeypatch, SHAPES["3b"], batch=16, host_free=4 << 30)
    assert du.pass_rows(16, SEQ) == 16 and du.pass_rows(16, SEQ) == 16, du.pass_reason
    assert du.pass_reason.startswith("one pass of 16 rows: the planner's choice was 2 passes of 8 rows, but passes "
                                     "hold every gradient until the last: every unit's gradients at once take"), \
        du.pass_reason
    assert du.passes[(16, SEQ)] == (16, du.pass_reason)  # decided once for the shape


def test_micro_batch_under_auto_is_the_planners_and_a_setting_wins(monkeypatch):
    du, *_ = _fake_updates(monkeypatch, SHAPES["3b"], batch=16)
    assert du.micro_batch(16, SEQ) == 16 and "micro-batch 16 of 16" in du.micro_reason
    assert (16, SEQ) in du.micro  # once per shape
    du, *_ = _fake_updates(monkeypatch, SHAPES["3b"], batch=16, micro_batch_size=4)
    assert du.micro_batch(16, SEQ) == 4 and du.micro_reason == "" and not du.micro
    du.mode = "host"
    du.ecfg.micro_batch_size = None
    assert du.micro_batch(16, SEQ) is None  # the whole batch: not "auto"


def test_a_model_the_planner_cannot_read_settles_on_a(monkeypatch):
    du, keep, act, mbs = _fake_updates(monkeypatch, SHAPES["3b"], batch=8)
    du.arch.config = {"hidden_size": 2048}  # no layers, no vocabulary
    du.after_step(keep=keep, act_bytes=act, mbs=mbs)
    assert (du.search.phase, du.search.winner) == ("done", "A")
