"""Moves ahead (Note: [Moves ahead] in device_updates.py): under "auto" the measuring step ends with the
groups the search made resident already on the device, so the next step starts with its placement in force.

On the CPU "auto" neither measures nor places, so these tests play the search's choice as CUDA would: the
first step measures, the search then settles on activations first ("done") or runs a residency-first trial
("B1"), and its candidate makes the embedding and layer 0 resident. Training equals HF + AdamW throughout
(test_equivalence's tolerances), with the moments of arriving groups held NaN until their upload writes
them (test_late_moments' fixture), so a group that came in without its moments shows in the numbers.
"""
from __future__ import annotations

import pytest
import torch

from helpers import compare
from megatrain_nb.host.optim import DeviceAdamW
from megatrain_nb.machine import placement as placing
from megatrain_nb.step.device_updates import DeviceUpdates
from megatrain_nb.step.engine import Engine
from step_helpers import slow_nan

RESIDENT = {-1, 0}  # the groups the search's candidate makes resident: what the next forward needs first


def _play_auto(monkeypatch, phase: str) -> list:
    """Make "auto" measure and place on the CPU as on CUDA, settling on ``phase`` after the measuring step.
    Returns the log of (step call, group) for every group that arrived, the step calls counted from 1."""
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", lambda *a, **k: None)  # the measuring step's
    monkeypatch.setattr(DeviceUpdates, "measuring", property(lambda du: du.mode == "auto" and du.search.phase == "measure"))
    after, choose = DeviceUpdates.after_step, DeviceUpdates.choose

    def after_step(du, *, keep, act_bytes, mbs):
        if du.search.phase != "measure":
            return after(du, keep=keep, act_bytes=act_bytes, mbs=mbs)
        du.search = placing.Search(phase=phase, free={"A": 0, "B": 0}, keep={"A": list(keep)},
                                   winner="A" if phase == "done" else phase[0])

    def choose_played(du, free):
        want = choose(du, free)
        if du.search.candidate is None:
            return want
        return {u: placing.Choice("resident", "played") if u in RESIDENT else c for u, c in want.items()}

    monkeypatch.setattr(DeviceUpdates, "after_step", after_step)
    monkeypatch.setattr(DeviceUpdates, "choose", choose_played)
    calls, log = [0], []
    step, add = Engine._step, DeviceAdamW.add

    def counted_step(eng, *a, **k):
        calls[0] += 1
        return step(eng, *a, **k)

    def logged_add(opt, units, upload=None, moments=True):
        r = add(opt, units, upload, moments)
        log.append((calls[0], units))
        return r

    monkeypatch.setattr(Engine, "_step", counted_step)
    monkeypatch.setattr(DeviceAdamW, "add", logged_add)
    return log


@pytest.mark.parametrize("phase", ["done", "B1"])
def test_the_measuring_step_ends_with_the_chosen_groups_resident(hf_dir, tmp_path, monkeypatch, phase):
    slow_nan(monkeypatch)  # before _play_auto's spy: the log sees the NaN-filled groups
    log = _play_auto(monkeypatch, phase)
    compare(hf_dir("llama"), "llama", tmp_path, steps=3, placement="auto")
    assert sorted(g for _, g in log) == [(-1,), (0,)], log
    assert {c for c, _ in log} == {1}, f"groups arrived in step calls {log}: the measuring step is call 1"


@pytest.mark.parametrize("error", [torch.OutOfMemoryError("CUDA out of memory (simulated)"),
                                   RuntimeError("copy failed (simulated)")])
def test_a_group_that_fails_to_arrive_at_the_measuring_steps_end_comes_in_the_next_step(hf_dir, tmp_path,
                                                                                         monkeypatch, error):
    """An error in the moves ahead is not the measuring step's (its updates are applied): the step returns,
    the groups that came in keep their moments coming, and the next step's ``place`` moves the rest."""
    slow_nan(monkeypatch)
    log = _play_auto(monkeypatch, "done")
    add, failed = DeviceAdamW.add, []

    def fail_once(opt, units, upload=None, moments=True):
        if units == (0,) and not failed:
            failed.append(units)
            raise error
        return add(opt, units, upload, moments)

    monkeypatch.setattr(DeviceAdamW, "add", fail_once)
    compare(hf_dir("llama"), "llama", tmp_path, steps=3, placement="auto")
    assert failed == [(0,)] and log == [(1, (-1,)), (2, (0,))], log
