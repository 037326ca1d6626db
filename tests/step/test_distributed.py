"""Data parallel (distributed.py): N ranks with b rows each train as one process with N*b rows.

CPU, gloo, fp32, 2 ranks started with ``torch.multiprocessing`` (spawn) on a FileStore; on this one
machine they share one host store (shared_store.py; tests/host/test_shared_store.py), except the
scenario with ``share_host_store=False``. One spawn
runs every scenario (dense and MoE, the placements, a checkpoint and its resume) and saves what
each rank saw; the tests compare it with single-process Sessions. Tolerance 1e-6 relative (the
batch is split across ranks, so the matmuls group their sums differently); a resume on the same
ranks is bit-exact.
"""
from __future__ import annotations

import datetime
import os
import time
from pathlib import Path

import pytest
import torch

from conftest import VOCAB, make_batches, rel_scalar, spawn_ranks
from dp_helpers import (BASE, ROWS, SAVE_AT, SCENARIOS, STEPS, TOL, WORLD, assert_close, join_group, masters, shard,
                        train_shards, train_single)

def _batches(world: int = 1) -> list[dict]:
    return make_batches(VOCAB, STEPS, batch=ROWS * WORLD, pad_id=0)  # row 0 padded: ranks differ in n_valid


def _scenario_rank(rank: int, world: int, tmp: Path, dirs: dict) -> None:
    """One rank: every scenario, then a resume of the first one's checkpoint; results to rank<r>.pt."""
    from megatrain_nb import Session
    from megatrain_nb import Session as _Session
    resume = _Session.resume

    join_group(rank, world, tmp)
    out = {}
    for name, (fam, settings) in SCENARIOS.items():
        s = Session.from_pretrained(dirs[fam], **BASE, **settings)
        assert s.engine.dp is not None and s.engine.dp.size == world
        out[name] = train_shards(s, _batches(), rank, world, save=tmp / "ckpt" if name == "llama_host" else None)
        out[name]["placement"] = list(s.placement.placement)
        out[name]["shared"] = s.store.shared is not None  # one host store per machine (shared_store.py)
        s.close()
    s = resume(tmp / "ckpt")
    out["resumed"] = train_shards(s, _batches()[SAVE_AT:], rank, world)
    s.close()
    torch.save(out, tmp / f"rank{rank}.pt")


def _spawn(fn, tmp: Path, *args, timeout_s: float = 240) -> list[int]:
    """Start WORLD processes of fn(rank, WORLD, tmp, *args); join them; returns their exit codes."""
    return spawn_ranks(fn, WORLD, tmp, *args, timeout_s=timeout_s)


@pytest.fixture(scope="module")
def ran(hf_dir, tmp_path_factory):
    """Every scenario on 2 ranks, once: (tmp dir, [rank 0's results, rank 1's])."""
    tmp = tmp_path_factory.mktemp("dp")
    dirs = {fam: hf_dir(fam) for fam, _ in SCENARIOS.values()}
    codes = _spawn(_scenario_rank, tmp, dirs)
    assert codes == [0] * WORLD, f"ranks exited with {codes}"
    return tmp, dirs, [torch.load(tmp / f"rank{r}.pt") for r in range(WORLD)]


@pytest.mark.parametrize("name", list(SCENARIOS))
def test_two_ranks_equal_one_process_with_all_rows(ran, name):
    tmp, dirs, ranks = ran
    fam, settings = SCENARIOS[name]
    want = train_single(dirs[fam], settings, _batches())
    for r, got in enumerate(ranks):
        assert_close(got[name], want, f"{name}, rank {r}")
    assert ranks[0][name]["losses"] == ranks[1][name]["losses"], "ranks report different losses"
    for u, w in ranks[0][name]["masters"].items():
        assert torch.equal(w, ranks[1][name]["masters"][u]), f"unit {u}: the ranks' weights drifted apart"
    if settings.get("grad_clip"):  # the norms are those of the reduced gradients: what one process sees
        assert all(rel_scalar(a, b) <= TOL for a, b in zip(ranks[0][name]["norms"], want["norms"]))
        assert max(want["norms"]) > settings["grad_clip"], "the clip never acted: the test would not see it"
    if isinstance(settings["placement"], dict):
        assert "resident" in ranks[0][name]["placement"]
    assert ranks[0][name]["shared"] == settings.get("share_host_store", True)  # on by default: one machine


def test_checkpoint_resumes_bit_exactly_on_same_ranks_and_to_tolerance_on_one(ran):
    from megatrain_nb import Session as _Session
    resume = _Session.resume

    tmp, dirs, ranks = ran
    for r in range(WORLD):  # same N: the uninterrupted run's last steps, bit for bit
        got, want = ranks[r]["resumed"], ranks[r]["llama_host"]
        assert got["losses"] == want["losses"][SAVE_AT:]
        assert all(torch.equal(got["masters"][u], w) for u, w in want["masters"].items())
    s = resume(tmp / "ckpt")  # M = 1 process, all rows
    try:
        assert s.engine.dp is None and s.engine.steps_done == SAVE_AT
        got = train_shards(s, _batches()[SAVE_AT:])
    finally:
        s.close()
    want = dict(ranks[0]["llama_host"], losses=ranks[0]["llama_host"]["losses"][SAVE_AT:])
    assert_close(got, want, "resumed on 1 process")


def _failing_rank(rank: int, world: int, tmp: Path, d: Path) -> None:
    """Step 1 and a checkpoint on both ranks; then rank 1 raises and stays alive (no collective comes)."""
    from megatrain_nb import Session
    from megatrain_nb.host.checkpoint import save_checkpoint

    join_group(rank, world, tmp, timeout_s=5)
    s = Session.from_pretrained(d, **BASE)
    b = _batches()
    s.step(shard(b[0], rank, world))
    save_checkpoint(s, tmp / "ckpt")
    if rank == 1:
        try:
            s.step({"input_ids": torch.full((1, 4), VOCAB)})  # a token outside the vocabulary
        except ValueError:
            t0 = time.monotonic()  # alive, never answering: only the timeout can end rank 0's wait
            while not (tmp / "rank0.txt").exists() and time.monotonic() - t0 < 60:
                time.sleep(0.2)
        return
    t0 = time.monotonic()
    try:
        s.step(shard(b[1], rank, world))
        msg = "no error"
    except RuntimeError as e:
        msg = str(e)
    (tmp / "rank0.txt").write_text(f"{time.monotonic() - t0:.1f}\n{msg}")


def test_a_failing_rank_ends_the_others_with_a_clear_error_and_the_checkpoint_stays(hf_dir, tmp_path):
    from megatrain_nb import Session as _Session
    resume = _Session.resume

    codes = _spawn(_failing_rank, tmp_path, hf_dir("llama"), timeout_s=90)
    assert codes[0] == 0, f"rank 0 exited with {codes[0]}"
    seconds, msg = (tmp_path / "rank0.txt").read_text().split("\n", 1)
    assert "rank 0 of 2" in msg and "another rank stopped" in msg and "checkpoint is intact" in msg, msg
    assert float(seconds) < 60, f"rank 0 waited {seconds} s"  # bounded by the 5 s timeout, not by rank 1
    s = resume(tmp_path / "ckpt")
    try:
        assert s.engine.steps_done == 1
    finally:
        s.close()


# ---- one process: the helpers -----------------------------------------------------------------
def test_helpers_without_a_process_group():
    from megatrain_nb.step import distributed

    assert distributed.world() == (0, 1)
    assert distributed.attach(None) is None
    assert distributed.local_device("cuda") == "cuda" and distributed.local_device("cpu") == "cpu"
    assert list(distributed.strided(range(7), 1, 3)) == [1, 4]
    assert list(distributed.strided(range(3))) == [0, 1, 2]
    assert distributed.init() is False  # no WORLD_SIZE: one process, nothing joined


def test_torchrun_trains_each_rank_on_its_own_rows_as_one_process_on_all(tmp_path):
    """``torchrun --nproc-per-node 2 -m megatrain_nb train --batch 1`` = one process with ``--batch 2``."""
    import json
    import subprocess
    import sys

    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=300, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=False)
    LlamaForCausalLM(cfg).save_pretrained(str(tmp_path / "tiny"))
    rows = [{"prompt": "the cat sat on", "response": "the mat"}, {"prompt": "2+2=", "response": "4"}] * 6
    (tmp_path / "d.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    args = ["-m", "megatrain_nb", "train", "--model", str(tmp_path / "tiny"), "--data", str(tmp_path / "d.jsonl"),
            "--steps", "3", "--seq", "32", "--lr", "1e-3", "--device", "cpu"]
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).parents[2]), "MEGATRAIN_DP_TIMEOUT_S": "60"}
    two = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                          *args, "--batch", "1", "--out", str(tmp_path / "two"),
                          "--save-every", "2"], capture_output=True, text=True, env=env, timeout=240)
    assert two.returncode == 0, two.stderr[-3000:]
    assert "2 ranks (data parallel)" in two.stdout and two.stdout.count("saved to") == 1  # rank 0 speaks and writes
    one = subprocess.run([sys.executable, *args, "--batch", "2", "--out", str(tmp_path / "one")],
                         capture_output=True, text=True, env=env, timeout=240)
    assert one.returncode == 0, one.stderr[-3000:]
    a, b = (json.loads((tmp_path / d / "megatrain_state.json").read_text()) for d in ("two", "one"))
    assert all(rel_scalar(x, y) <= TOL for x, y in zip(a["losses"], b["losses"])), (a["losses"], b["losses"])
    assert a["data"] == b["data"]  # every rank advanced the data by both ranks' batches
    assert (tmp_path / "two" / "checkpoint" / "state.json").exists()


# ---- CUDA: NCCL, one GPU per rank (needs 2 GPUs; skipped elsewhere) ------------------------------
GPU_SCENARIOS = ("llama_host", "tied_resident", "mixtral_auto_clip")


def _gpu_rank(rank: int, world: int, tmp: Path, dirs: dict) -> None:
    import torch.distributed as dist

    from megatrain_nb import Session

    os.environ["NCCL_NVLS_ENABLE"] = "0"  # NVLink multicast off
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method=f"file://{tmp / 'store'}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=120))
    out = {}
    for name in GPU_SCENARIOS:
        fam, settings = SCENARIOS[name]
        s = Session.from_pretrained(dirs[fam], **{**BASE, "device": "cuda"}, **settings)
        assert str(s.engine.dev.device) == f"cuda:{rank}"
        out[name] = train_shards(s, _batches(), rank, world)
        s.close()
    torch.save(out, tmp / f"rank{rank}.pt")
    dist.destroy_process_group()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_two_gpus_equal_one_gpu_with_all_rows(hf_dir, tmp_path):
    """fp32 on CUDA: NCCL ranks (gradient all-reduce on a side stream) as one GPU with all the rows, 1e-5."""
    from megatrain_nb import Session

    dirs = {SCENARIOS[n][0]: hf_dir(SCENARIOS[n][0]) for n in GPU_SCENARIOS}
    assert _spawn(_gpu_rank, tmp_path, dirs) == [0] * WORLD
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in range(WORLD)]
    for name in GPU_SCENARIOS:
        fam, settings = SCENARIOS[name]
        s = Session.from_pretrained(dirs[fam], **{**BASE, "device": "cuda:0"}, **settings)
        try:
            want = train_shards(s, _batches())
        finally:
            s.close()
        for r in range(WORLD):
            got = dict(ranks[r][name], masters={u: w.cpu() for u, w in ranks[r][name]["masters"].items()})
            assert_close(got, dict(want, masters={u: w.cpu() for u, w in want["masters"].items()}),
                          f"{name}, GPU rank {r}", tol=1e-5)
        assert ranks[0][name]["losses"] == ranks[1][name]["losses"]


# ---- a bad optimizer state on one rank: every rank skips (Note: [State verdicts] in distributed.py) ----------
VERDICTS = {  # name -> (settings, unit, where): the state rank 1 alone corrupts before the second step
    "shared_host": (dict(placement="host"), 2, "host"),  # the head: its owner alone checks it
    "private_host": (dict(placement="host", share_host_store=False), 2, "host"),  # rank 0's copy is good
    "resident": (dict(placement={0: "resident", 1: "resident"}), 1, "resident"),  # rank 0's copy is good
}


def _verdict_rank(rank: int, world: int, tmp: Path, d: Path) -> None:
    """Each scenario: a step, rank 1 corrupts a unit's exp_avg_sq, a step (both must skip), repaired, a step."""
    import warnings

    import torch.distributed as dist

    from megatrain_nb import Session

    join_group(rank, world, tmp, timeout_s=30)
    out = {}
    b = _batches()
    for name, (settings, unit, where) in VERDICTS.items():
        s = Session.from_pretrained(d, **BASE, **settings)
        s.step(shard(b[0], rank, world))
        s.engine.drain()
        if where == "host":
            slab, at = s.store.units[unit].exp_avg_sq, 7
        else:
            r = s.engine.dev_opt.of[unit]
            slab, at = r.exp_avg_sq, r.seg(unit)[0] + 5
        keep = float(slab[at])
        dist.barrier()  # every rank has drained: rank 1's write is the only change
        if rank == 1:
            slab[at] = -1.0
        dist.barrier()
        before = masters(s)[unit]
        with warnings.catch_warnings(record=True) as got:
            warnings.simplefilter("always")
            skipped = s.step(shard(b[1], rank, world)).skipped
        same = torch.equal(masters(s)[unit], before)
        dist.barrier()
        if rank == 1:
            slab[at] = keep
        dist.barrier()
        again = s.step(shard(b[2], rank, world)).skipped
        out[name] = dict(skipped=skipped, same=same, again=again, warned=" ".join(str(w.message) for w in got),
                         masters=masters(s))
        s.close()
    torch.save(out, tmp / f"rank{rank}.pt")


def test_a_bad_state_on_one_rank_skips_the_step_on_every_rank(hf_dir, tmp_path):
    codes = _spawn(_verdict_rank, tmp_path, hf_dir("llama"), timeout_s=150)
    assert codes == [0] * WORLD, f"ranks exited with {codes}"
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in range(WORLD)]
    for name, (_, unit, where) in VERDICTS.items():
        for r, got in enumerate(ranks):
            x = got[name]
            assert x["skipped"] and x["same"] and not x["again"], (name, r, x["warned"])
            named = f"optimizer state of units [{unit}]" in x["warned"]
            assert named or (where == "resident" and r == 0), (name, r, x["warned"])  # resident: rank 1 names it
        for u, m in ranks[0][name]["masters"].items():  # the ranks still apply the same updates
            assert torch.equal(m, ranks[1][name]["masters"][u]), (name, u)
