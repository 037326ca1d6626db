"""Saves under data parallel (collective_save.py, Note: [One writer]): every rank, or rank 0 alone.

CPU, gloo, fp32, 2 ranks started with ``torch.multiprocessing`` (spawn) on a FileStore, a process
group timeout of 20 s. One spawn runs three Sessions in turn: the default (one host store shared by
the ranks), private stores (``share_host_store=False``), and a shared store whose layers are placed
"device" (their step counts live on each owner's GPU state). Each rank records its weights at every
save; the tests load what was written (``AutoModelForCausalLM.from_pretrained``,
``Session.from_pretrained``, ``Session.resume``) and compare. A write made slow on purpose (4 s
against a 1.5 s wait limit) shows that the waiting ranks follow rank 0's heartbeat, not a timeout.
"""
from __future__ import annotations

import datetime
import time
import warnings
from pathlib import Path

import pytest
import torch

from conftest import VOCAB, make_batches, rel, rel_scalar, spawn_ranks

WORLD, ROWS, STEPS = 2, 2, 6
BASE = dict(device="cpu", dtype=torch.float32, lr=2e-3, betas=(0.9, 0.95), eps=1e-7)
RUNS = {  # name -> settings
    "shared": dict(placement="host"),
    "private": dict(placement="host", share_host_store=False),
    "device": dict(placement={0: "device", 1: "device"}),
}
SLOW_S, WAIT_S = 4.0, 1.5  # rank 0's slowed write (the "shared" run); the waiting ranks' limit without a heartbeat


def _batches() -> list[dict]:
    return make_batches(VOCAB, STEPS, batch=ROWS * WORLD, pad_id=0)


def _shard(b: dict, rank: int) -> dict:
    n = b["input_ids"].shape[0] // WORLD
    return {k: v[rank * n:(rank + 1) * n] for k, v in b.items()}


def _masters(s) -> dict:
    s.engine.drain()
    return {u: s.store.units[u].master.clone() for u in s.store.order}


def _slowly(s):
    """Rank 0's HF writes take SLOW_S seconds longer (the store's method, so any writer inside is covered)."""
    write = s.store.save_pretrained

    def slow(*a, **kw):
        time.sleep(SLOW_S)
        return write(*a, **kw)

    s.store.save_pretrained = slow


def _run(s, name: str, rank: int, out: Path) -> dict:
    """Steps with saves between them, every way; returns what this rank saw."""
    from megatrain_nb.host.collective_save import device_counts_elsewhere

    b, rec = _batches(), {"losses": []}
    step = lambda k: rec["losses"].append(s.step(_shard(b[k], rank)).loss)  # noqa: E731
    assert s.engine.dp.saves.timeout_s == 20  # the process group's timeout
    step(0)
    rec["m1"] = _masters(s)
    if rank == 0:
        rec["eval1"] = s.evaluate([b[0]])  # every row: what the HF model loaded from disk must report
    for _ in range(2):  # every rank, one directory, twice: each time one writer
        rec["returned"] = str(s.save_pretrained(out / "all_pre"))
    s.save_checkpoint(out / "all_ckpt")
    step(1)
    rec["m2"] = _masters(s)
    if rank == 0:  # the habit of HF scripts: the main process saves
        if name == "device":
            rec["why"] = device_counts_elsewhere(s)
            try:
                s.save_checkpoint(out / "r0_ckpt")
                rec["refused"] = None
            except RuntimeError as e:
                rec["refused"] = str(e)
        else:
            s.save_checkpoint(out / "r0_ckpt")
        s.save_pretrained(out / "r0_pre")
    step(2)  # training goes on
    if rank == 1:  # a non-zero rank alone: nothing written, a warning
        with warnings.catch_warnings(record=True) as w:
            warnings.simplefilter("always")
            s.save_pretrained(out / "r1_pre")
        rec["warned"] = [str(x.message) for x in w]
    step(3)
    s.save_checkpoint(out / "all_ckpt4")  # every rank again (after the "device" run's refusal too)
    rec["m4"] = _masters(s)
    if name == "shared":
        s.engine.dp.saves.timeout_s = WAIT_S
        if rank == 0:
            _slowly(s)
        s.save_pretrained(out / "slow_all")  # every rank: rank 1 waits for the slow write
        if rank == 0:
            s.save_pretrained(out / "slow_r0")  # rank 0 alone: rank 1 waits at the next step's start
    step(4)
    step(5)
    rec["m6"] = _masters(s)
    return rec


def _saves_rank(rank: int, world: int, tmp: Path, d: Path) -> None:
    import torch.distributed as dist

    from megatrain_nb import Session
    from megatrain_nb.host import collective_save

    collective_save.BEAT_S = 0.2  # beats well inside WAIT_S on a loaded machine
    dist.init_process_group("gloo", init_method=f"file://{tmp / 'store'}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=20))
    out = {}
    for name, settings in RUNS.items():
        s = Session.from_pretrained(d, **BASE, **settings)
        out[name] = _run(s, name, rank, tmp / name)
        out[name]["shared"] = s.store.shared is not None
        if rank == 0:  # a script's end: rank 0 writes the model while the others close their Sessions
            s.save_pretrained(tmp / name / "end_r0")
        s.close()
    torch.save(out, tmp / f"rank{rank}.pt")


@pytest.fixture(scope="module")
def ran(hf_dir, tmp_path_factory):
    """The three runs on 2 ranks, once: (tmp dir, model dir, [rank 0's records, rank 1's])."""
    tmp = tmp_path_factory.mktemp("dpsave")
    d = hf_dir("llama")
    codes = spawn_ranks(_saves_rank, WORLD, tmp, d, timeout_s=100)
    assert codes == [0] * WORLD, f"ranks exited with {codes}"
    return tmp, d, [torch.load(tmp / f"rank{r}.pt") for r in range(WORLD)]


def _equal(got: dict, want: dict, what: str) -> None:
    for u, w in want.items():
        assert torch.equal(got[u], w), f"{what}: unit {u} differs by {rel(got[u], w):.2e}"


def _loaded(d: Path) -> dict:
    from megatrain_nb import Session

    s = Session.from_pretrained(d, **BASE)
    try:
        return _masters(s)
    finally:
        s.close()


def _resumed(d: Path) -> tuple[dict, int, list]:
    from megatrain_nb import Session

    s = Session.resume(d)
    try:
        return _masters(s), s.engine.steps_done, [s.optim.steps_done(u) for u in s.store.order]
    finally:
        s.close()


@pytest.mark.parametrize("name", list(RUNS))
def test_every_rank_saving_writes_once_and_loads_equal(ran, name):
    from transformers import AutoModelForCausalLM

    tmp, _, ranks = ran
    out = tmp / name
    assert ranks[0][name]["shared"] == (name != "private")
    assert ranks[1][name]["returned"] == str(out / "all_pre")  # the waiting rank returns the directory too
    _equal(_loaded(out / "all_pre"), ranks[0][name]["m1"], f"{name}: save_pretrained by every rank")
    assert not list(out.glob("all_pre/*partial*")) and not list(out.glob("*.tmp-*")), "a writer's leftovers"
    hf = AutoModelForCausalLM.from_pretrained(str(out / "all_pre"), dtype=torch.float32)
    b = _batches()[0]
    with torch.no_grad():
        loss = hf(**b).loss.item()
    assert rel_scalar(loss, ranks[0][name]["eval1"]) <= 1e-5, (loss, ranks[0][name]["eval1"])
    for ckpt, steps, m in (("all_ckpt", 1, "m1"), ("all_ckpt4", 4, "m4")):
        masters, done, unit_steps = _resumed(out / ckpt)
        _equal(masters, ranks[0][name][m], f"{name}: {ckpt} by every rank")
        assert done == steps and unit_steps == [steps] * len(unit_steps), (done, unit_steps)  # owners' counts too


@pytest.mark.parametrize("name", list(RUNS))
def test_rank_0_alone_saves_and_training_goes_on_equal_on_every_rank(ran, name):
    tmp, d, ranks = ran
    out = tmp / name
    _equal(_loaded(out / "r0_pre"), ranks[0][name]["m2"], f"{name}: save_pretrained by rank 0 alone")
    if name == "device":  # a layer's step count is on rank 1's state: refused at once, nothing written
        assert ranks[0][name]["why"] is not None, "no unit of rank 1 was placed \"device\": the case is not tested"
        msg = ranks[0][name]["refused"]
        assert msg is not None and "rank 0 alone" in msg and "every rank" in msg, msg
        assert not (out / "r0_ckpt").exists()
    else:
        masters, done, _ = _resumed(out / "r0_ckpt")
        _equal(masters, ranks[0][name]["m2"], f"{name}: save_checkpoint by rank 0 alone")
        assert done == 2
    assert ranks[0][name]["losses"] == ranks[1][name]["losses"]  # every step after the saves ran on both
    assert len(ranks[0][name]["losses"]) == STEPS
    _equal(ranks[1][name]["m6"], ranks[0][name]["m6"], f"{name}: the ranks after the saves")
    _equal(_loaded(out / "end_r0"), ranks[0][name]["m6"], f"{name}: rank 0 alone while rank 1 closed")
    want = _single(d, RUNS[name])  # one process with every row, no saves
    assert all(rel_scalar(a, b) <= 1e-6 for a, b in zip(ranks[0][name]["losses"], want["losses"]))
    for u, w in want["m6"].items():
        assert rel(ranks[0][name]["m6"][u], w) <= 1e-6, f"{name}: unit {u}"


def _single(d: Path, settings: dict) -> dict:
    from megatrain_nb import Session

    settings = {k: v for k, v in settings.items() if k != "share_host_store"}
    s = Session.from_pretrained(d, **BASE, **settings)
    try:
        return {"losses": [s.step(b).loss for b in _batches()], "m6": _masters(s)}
    finally:
        s.close()


def test_a_non_zero_rank_alone_writes_nothing_and_warns(ran):
    tmp, _, ranks = ran
    for name in RUNS:
        assert not (tmp / name / "r1_pre").exists() or not any((tmp / name / "r1_pre").iterdir())
        warned = ranks[1][name]["warned"]
        assert len(warned) == 1 and "rank 1 called" in warned[0] and "nothing was written" in warned[0], warned


def test_waiting_ranks_follow_rank_0s_heartbeat_through_a_slow_write(ran):
    """Rank 0's writes took SLOW_S s > WAIT_S: rank 1 waited (in the save, then at the step's start) and went on."""
    tmp, _, ranks = ran
    _equal(_loaded(tmp / "shared" / "slow_all"), ranks[0]["shared"]["m4"], "slow save by every rank")
    _equal(_loaded(tmp / "shared" / "slow_r0"), ranks[0]["shared"]["m4"], "slow save by rank 0 alone")
    assert SLOW_S > 2 * WAIT_S  # without the heartbeat rank 1 would have raised, and the spawn failed


# ---- one process: the hand-shake on a store, ranks as threads -------------------------------------
def test_turns_without_a_process_group_decide_by_what_each_rank_marked(tmp_path):
    """Two ``Turns`` on one FileStore: rank 1 arriving late still waits for rank 0's write; rank 1 alone
    sees rank 0 start the next step and writes nothing; rank 0 dying mid-write ends rank 1's wait."""
    import threading

    import torch.distributed as dist

    from megatrain_nb.host.collective_save import Turns

    store = dist.FileStore(str(tmp_path / "store"), 2)
    t0, t1 = Turns(0, 2, store, timeout_s=2), Turns(1, 2, store, timeout_s=2)
    t1.tag = t0.tag  # the same Session on both "ranks"
    got = {}

    def rank1(what: str):
        try:
            with t1.turn("pretrained", tmp_path / "a") as write:
                got[what] = write
        except RuntimeError as e:
            got[what] = str(e)

    with t0.turn("pretrained", tmp_path / "a") as write:  # rank 0 first: rank 1 comes during the write
        th = threading.Thread(target=rank1, args=("late",))
        th.start()
        time.sleep(0.2)
        assert write and "late" not in got  # rank 1 waits for the write to finish
    th.join(5)
    assert got["late"] is False
    t0.at_step(), t1.at_step()  # both start step 1 (rank 0 first: rank 1's gate passes at once)
    th = threading.Thread(target=rank1, args=("alone",))
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        th.start()
        time.sleep(0.2)
        t0.at_step()  # rank 0 goes on to step 2 without this save
        th.join(5)
    assert got["alone"] is False and any("nothing was written" in str(x.message) for x in w)
    t1.at_step()
    th = threading.Thread(target=rank1, args=("died",))
    th.start()
    store.set(f"{t0.tag}/{t0.steps}/pretrained/0/claim", str(tmp_path / "a"))  # rank 0 claims, then "dies"
    th.join(10)  # no heartbeat, no result: rank 1 raises after its 2 s
    assert "waited 2 s" in got["died"] and "another rank stopped, died or did not answer" in got["died"], got["died"]
