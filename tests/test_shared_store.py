"""One host store per machine (shared_store.py): ranks of one machine share the masters and moments.

CPU, gloo, fp32, ranks started with ``torch.multiprocessing`` (spawn) on this one machine, so they
share one store (the default under data parallel). tests/test_distributed.py's scenarios run with it
too (and one with ``share_host_store=False``); here: 3 ranks equal to one process, the store really
being one copy (one /dev/shm file, writes seen without a copy, host bytes), a checkpoint of 3 ranks
resumed on 3 bit for bit and on 2 and 1 to tolerance, a dying owner, and the follower's bounded wait.
"""
from __future__ import annotations

import os
import time
from pathlib import Path

import pytest
import torch

from conftest import VOCAB, make_batches, spawn_ranks
from test_distributed import BASE, SAVE_AT, SCENARIOS, _assert_close, _join, _shard, _train

THREE = ("llama_host", "mixtral_auto_clip", "llama_mixed")  # dense, MoE with clipping, resident + "device"


def _batches(world: int) -> list[dict]:
    return make_batches(VOCAB, 3, batch=2 * 3, pad_id=0)  # 6 rows: 2 per rank on 3 ranks, 3 on 2, 6 on 1


def _segments() -> list[str]:
    return sorted(p for p in os.listdir("/dev/shm") if p.startswith("megatrain-"))


def _segment_inode(s) -> str:
    """The (deleted) /dev/shm file this process maps at the store's first master: device and inode from /proc."""
    ptr = s.store.units[0].master.data_ptr()
    with open("/proc/self/maps") as f:
        for line in f:
            parts = line.split()
            lo, hi = (int(x, 16) for x in parts[0].split("-"))
            if lo <= ptr < hi:
                return f"{parts[3]}:{parts[4]} {' '.join(parts[5:])}"
    return "not mapped"


_spawn = spawn_ranks  # conftest: fn(rank, world, tmp, *args) in spawned processes, exit codes back


def _three_rank(rank: int, world: int, tmp: Path, dirs: dict) -> None:
    """THREE scenarios on shared stores, a checkpoint of the first, its resume; the sharing's evidence."""
    import torch.distributed as dist

    from megatrain_nb import Session
    from megatrain_nb import Session as _Session
    resume = _Session.resume

    torch.set_num_threads(1)
    _join(rank, world, tmp)
    out = {}
    for name in THREE:
        fam, settings = SCENARIOS[name]
        s = Session.from_pretrained(dirs[fam], **BASE, **settings)
        if rank == 0 and name == "llama_host":
            s.delays = {"host-adam": 0.05}  # a slow owner: the others' loads of its units must wait for it
        shared = s.store.shared
        assert shared is not None and shared.local_world == world
        out[name] = _train(s, _batches(world), rank, world, save=tmp / "ckpt" if name == "llama_host" else None)
        out[name]["owner"] = dict(shared.owner)
        out[name]["versions"] = shared.versions.clone()
        out[name]["inode"] = _segment_inode(s)
        dist.barrier()  # every owner has written back its "device" units' step counts (drain)
        out[name]["steps"] = {u: s.optim.steps_done(u) for u in s.store.order}
        if name == "llama_host":  # a write by rank 0 is read by the others with no copy in between
            dist.barrier()
            if rank == 0:
                s.store.units[1].exp_avg[:4] = torch.tensor([1.5, 2.5, 3.5, 4.5])
            dist.barrier()
            out[name]["seen"] = s.store.units[1].exp_avg[:4].clone()
            dist.barrier()
            out[name]["segments_while_open"] = _segments()
        s.close()
    s = resume(tmp / "ckpt")
    out["resumed"] = _train(s, _batches(world)[SAVE_AT:], rank, world)
    s.close()
    torch.save(out, tmp / f"rank{rank}.pt")


@pytest.fixture(scope="module")
def three(hf_dir, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("shm3")
    dirs = {SCENARIOS[n][0]: hf_dir(SCENARIOS[n][0]) for n in THREE}
    codes = _spawn(_three_rank, 3, tmp, dirs)
    assert codes == [0, 0, 0], f"ranks exited with {codes}"
    return tmp, dirs, [torch.load(tmp / f"rank{r}.pt") for r in range(3)]


def _single_rows(d: Path, settings: dict) -> dict:
    from megatrain_nb import Session

    s = Session.from_pretrained(d, **BASE, **settings)
    try:
        return _train(s, _batches(1))
    finally:
        s.close()


@pytest.mark.parametrize("name", THREE)
def test_three_ranks_sharing_one_store_equal_one_process_with_all_rows(three, name):
    tmp, dirs, ranks = three
    fam, settings = SCENARIOS[name]
    want = _single_rows(dirs[fam], settings)
    for r, got in enumerate(ranks):
        _assert_close(got[name], want, f"{name}, shared store, rank {r}")
    assert ranks[0][name]["losses"] == ranks[1][name]["losses"] == ranks[2][name]["losses"]
    owners = ranks[0][name]["owner"]
    assert sorted(set(owners.values())) == [0, 1, 2], f"every rank updates some units: {owners}"
    assert all(r[name]["owner"] == owners for r in ranks), "the ranks disagree on who updates what"
    assert all(int(v) == 3 for v in ranks[0][name]["versions"]), "every unit's 3 updates were published"
    for u, n in ranks[0][name]["steps"].items():  # the step counts are the owners', on every rank
        assert all(r[name]["steps"][u] == n for r in ranks)


def test_the_store_is_one_copy_in_one_deleted_dev_shm_file(three):
    _, _, ranks = three
    inode = ranks[0]["llama_host"]["inode"]
    assert "/dev/shm/megatrain-" in inode and "(deleted)" in inode, inode  # unlinked once every rank mapped it
    assert all(r["llama_host"]["inode"] == inode for r in ranks), [r["llama_host"]["inode"] for r in ranks]
    assert ranks[0]["llama_mixed"]["inode"] != inode  # each Session its own segment
    for r in ranks:
        assert torch.equal(r["llama_host"]["seen"], torch.tensor([1.5, 2.5, 3.5, 4.5]))
        assert r["llama_host"]["segments_while_open"] == []  # nothing in /dev/shm even while it lives
    assert _segments() == []


def test_a_shared_checkpoint_resumes_bitwise_on_three_and_to_tolerance_on_two_and_one(three):
    from megatrain_nb import Session as _Session
    resume = _Session.resume

    tmp, dirs, ranks = three
    for r in range(3):
        got, want = ranks[r]["resumed"], ranks[r]["llama_host"]
        assert got["losses"] == want["losses"][SAVE_AT:]
        assert all(torch.equal(got["masters"][u], w) for u, w in want["masters"].items())
    want = dict(ranks[0]["llama_host"], losses=ranks[0]["llama_host"]["losses"][SAVE_AT:])
    assert _spawn(_resume_rank, 2, tmp) == [0, 0]
    for r in range(2):
        _assert_close(torch.load(tmp / f"resumed2_rank{r}.pt"), want, f"resumed on 2 shared ranks, rank {r}")
    s = resume(tmp / "ckpt")
    try:
        assert s.store.shared is None
        got = _train(s, _batches(1)[SAVE_AT:])
    finally:
        s.close()
    _assert_close(got, want, "resumed on 1 process")


def _resume_rank(rank: int, world: int, tmp: Path) -> None:
    from megatrain_nb import Session as _Session
    resume = _Session.resume

    torch.set_num_threads(1)
    (tmp / "r2").mkdir(exist_ok=True)
    _join(rank, world, tmp / "r2")
    s = resume(tmp / "ckpt")
    assert s.store.shared is not None and s.store.shared.local_world == 2
    torch.save(_train(s, _batches(world)[SAVE_AT:], rank, world), tmp / f"resumed2_rank{rank}.pt")
    s.close()


# ---- a dying owner -------------------------------------------------------------------------------
def _dying_rank(rank: int, world: int, tmp: Path, d: Path, when: str) -> None:
    """Step 1 on both; at step 2 rank 1 dies in a host AdamW of a unit it owns: its first (mid-backward,
    collectives still to come) or the embedding's (the step's last: only the shared store's wait can tell)."""
    from megatrain_nb import Session

    _join(rank, world, tmp, timeout_s=20)
    s = Session.from_pretrained(d, **BASE, placement="host")
    b = _batches(world)
    s.step(_shard(b[0], rank, world))
    if rank == 1:
        assert s.store.owns(-1), "the embedding is rank 1's (largest-first split of the tiny Llama)"
        update = s.engine.optim.update
        def dying(u, *a):
            if when == "first" or u == -1:
                time.sleep(0 if when == "first" else 1)  # "embedding": after the step's last collective
                os._exit(3)
            update(u, *a)

        s.engine.optim.update = dying
    t0 = time.monotonic()
    try:
        s.step(_shard(b[1], rank, world))
        s.engine.drain()
        msg = "no error"
    except RuntimeError as e:
        msg = str(e)
    (tmp / "rank0.txt").write_text(f"{time.monotonic() - t0:.1f}\n{msg}")


@pytest.mark.parametrize("when", ["first", "embedding"])
def test_a_dying_owner_ends_the_others_in_bounded_time_and_leaves_no_segment(hf_dir, tmp_path, when):
    codes = _spawn(_dying_rank, 2, tmp_path, hf_dir("llama"), when, timeout_s=100)
    assert codes == [0, 3], codes
    seconds, msg = (tmp_path / "rank0.txt").read_text().split("\n", 1)
    assert "data parallel: rank 0" in msg, msg
    if when == "first":  # a collective of the step fails first
        assert "another rank stopped" in msg, msg
    else:  # every collective is done: the wait for the embedding's update sees its owner gone
        assert "update 2 of unit -1 (owned by local rank 1) never came: rank 1" in msg and "died" in msg, msg
    assert "checkpoint is intact" in msg, msg
    assert float(seconds) < 30, f"rank 0 waited {seconds} s"
    assert _segments() == []


# ---- the follower's bounded wait (one process) ---------------------------------------------------
@pytest.mark.parametrize("owner_alive", [True, False])
def test_a_follower_names_the_unit_and_its_owner_when_the_update_never_comes(owner_alive):
    import subprocess
    import sys
    import threading

    from megatrain_nb.host.shared_store import SharedHost
    from megatrain_nb.step.workers import AdamWorker

    other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        if not owner_alive:
            other.kill()
            other.wait()
        sh = SharedHost(rank=0, local=[0, 1], node=0, tag=f"test{os.getpid()}", cuda=False, pids=[os.getpid(), other.pid])
        sh.alloc({(u, "master"): (10, torch.float32) for u in (-1, 0, 1)}, [-1, 0, 1])
        sh.timeout_s = 1.0
        assert _segments() == []
        mine, theirs = [u for u in (-1, 0, 1) if sh.owns(u)], [u for u in (-1, 0, 1) if not sh.owns(u)]
        assert mine and theirs
        w = AdamWorker([-1, 0, 1], lambda *a: None, threading.Event(), shared=sh)
        try:
            with w.cond:
                for u in (-1, 0, 1):
                    w._processed(u)
            assert all(sh.published(u) == 1 for u in mine) and all(sh.published(u) == 0 for u in theirs)
            t0 = time.monotonic()
            with pytest.raises(RuntimeError) as e:
                w.wait_version(theirs[0], 1)
            assert time.monotonic() - t0 < 5
            msg = str(e.value)
            assert f"unit {theirs[0]}" in msg and "local rank 1" in msg and "checkpoint is intact" in msg, msg
            assert ("died" in msg) != owner_alive and ("timeout" in msg) == owner_alive, msg
            w.error = None
            sh.publish(theirs[0], 1)  # the owner's update lands: the follower lets the load go
            w.target = {theirs[0]: 1}
            w.wait_version(theirs[0], 1)
        finally:
            w.close()
    finally:
        other.kill()
        other.wait()


def test_share_host_store_false_keeps_a_store_per_rank_and_one_process_shares_nothing():
    from megatrain_nb.config import EngineConfig
    from megatrain_nb.host.shared_store import attach

    assert EngineConfig().share_host_store is None
    assert EngineConfig(share_host_store=False).share_host_store is False
    assert attach(None, cuda=False) is None and attach(True, cuda=False) is None  # no process group


# ---- host bytes ----------------------------------------------------------------------------------
BIG = dict(vocab_size=8192, hidden_size=768, intermediate_size=2048, num_hidden_layers=4)  # 41M params: 660 MB store


def _page_runs(ranges: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """The pages under address ranges [lo, hi), merged into runs [first, last + 1) of page numbers."""
    page, runs = os.sysconf("SC_PAGE_SIZE"), []
    for lo, hi in sorted((lo // page, -(-hi // page)) for lo, hi in ranges if hi > lo):
        if runs and lo <= runs[-1][1]:
            runs[-1][1] = max(runs[-1][1], hi)
        else:
            runs.append([lo, hi])
    return [tuple(r) for r in runs]


def _resident_private(ranges: list[tuple[int, int]]) -> int:
    """Bytes of the pages under ``ranges`` that are in RAM and this process's alone (/proc/self/pagemap:
    bit 63 present, bit 61 a file or shared page): what these ranges add to the machine for this process."""
    import numpy as np

    page, n = os.sysconf("SC_PAGE_SIZE"), 0
    with open("/proc/self/pagemap", "rb") as f:
        for lo, hi in _page_runs(ranges):
            f.seek(lo * 8)
            e = np.frombuffer(f.read((hi - lo) * 8), dtype=np.uint64)
            n += int((((e >> np.uint64(63)) & np.uint64(1)) & ~((e >> np.uint64(61)) & np.uint64(1))).sum())
    return n * page


def _mapping_pss(ptr: int) -> int:
    """PSS of the mapping holding address ``ptr`` (/proc/self/smaps): its resident pages, each split among
    the processes mapping it, so the ranks' values add up to the pages once."""
    with open("/proc/self/smaps") as f:
        inside = False
        for line in f:
            head = line.split()[0]
            if "-" in head and not head.endswith(":"):
                lo, hi = (int(x, 16) for x in head.split("-"))
                inside = lo <= ptr < hi
            elif inside and head == "Pss:":
                return int(line.split()[1]) * 1024
    raise AssertionError(f"no mapping holds {ptr:#x}")


def _store_host_bytes(store) -> int:
    """Host RAM this process's store holds, its share of the shared segment included: the resident private
    pages of its tensors (masters, grads, moments, shadows) outside the segment, plus the segment's PSS."""
    shared = store.shared
    ranges = []
    for u in store.units.values():
        for kind in ("master", "grad", "exp_avg", "exp_avg_sq", "shadow"):
            t = getattr(u, kind)
            if t is not None and not (shared is not None and shared.holds(t)):
                ranges.append((t.data_ptr(), t.data_ptr() + t.numel() * t.element_size()))
    first = store.units[store.order[0]].master
    assert shared is None or shared.holds(first)
    seg = 0 if shared is None else _mapping_pss(first.data_ptr())
    return _resident_private(ranges) + seg


def _bytes_rank(rank: int, world: int, tmp: Path, d: Path, share: bool) -> None:
    """The host bytes of this rank's store after two steps: its private pages and its PSS share of the segment."""
    import torch.distributed as dist

    from megatrain_nb import Session

    torch.set_num_threads(1)
    _join(rank, world, tmp)
    s = Session.from_pretrained(d, **BASE, placement="host", share_host_store=share, grad_ring=False,  # slabs in
                                pinned_budget_bytes=4 << 20, transfer_chunk_bytes=1 << 20)  # each case; staging: 4 MiB
    assert (s.store.shared is not None) == (share and world > 1)
    b = _batches(world)
    for k in range(2):
        s.step(_shard(b[k], rank, world))
    s.engine.drain()
    dist.barrier()  # every rank maps the segment while each reads its PSS share of it
    held = _store_host_bytes(s.store)
    dist.barrier()  # and none unmaps before all have read
    (tmp / f"bytes{rank}.txt").write_text(f"{held} {s.store.bytes_report()['total']}")
    s.close()


def _machine_bytes(world: int, tmp: Path, d: Path, share: bool) -> tuple[int, int]:
    tmp.mkdir()
    assert _spawn(_bytes_rank, world, tmp, d, share) == [0] * world
    got = [tuple(map(int, (tmp / f"bytes{r}.txt").read_text().split())) for r in range(world)]
    return sum(g[0] for g in got), got[0][1]


def test_store_host_bytes_count_private_pages_once_and_a_shared_mapping_once_over_its_mappers(tmp_path):
    x = torch.ones(1 << 20)  # 4 MiB, written: resident
    assert _resident_private([(x.data_ptr(), x.data_ptr() + (4 << 20))] * 2) >= (4 << 20) - 8192  # once
    assert _resident_private([(x.data_ptr(), x.data_ptr() + (2 << 20))]) < (3 << 20)
    path = tmp_path / "seg"
    path.write_bytes(b"\0" * (1 << 20))
    a = torch.from_file(str(path), shared=True, size=1 << 20, dtype=torch.uint8)
    b = torch.from_file(str(path), shared=True, size=1 << 20, dtype=torch.uint8)
    a.fill_(1)
    b.fill_(2)
    assert _resident_private([(a.data_ptr(), a.data_ptr() + (1 << 20))]) == 0  # file pages are not private
    assert _mapping_pss(a.data_ptr()) + _mapping_pss(b.data_ptr()) <= (1 << 20) + 8192  # two mappers: once


def test_two_ranks_sharing_take_about_one_stores_host_bytes_not_two(hf_dir, tmp_path):
    d = hf_dir("llama", **BIG)
    one, store = _machine_bytes(1, tmp_path / "one", d, True)
    two, _ = _machine_bytes(2, tmp_path / "two", d, True)
    assert one > 0.9 * store, (one, store)  # the store is in RAM, and this measures it
    assert two < 1.3 * one, f"2 ranks sharing hold {two / 2**20:.0f} MiB, one process {one / 2**20:.0f} MiB"
    private, _ = _machine_bytes(2, tmp_path / "private", d, False)
    assert private > 1.8 * one, f"share_host_store=False: {private / 2**20:.0f} MiB, one process {one / 2**20:.0f}"


# ---- CUDA: the segment pinned with cudaHostRegister (one GPU is enough) ----------------------------
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_the_segment_is_pinned_on_cuda_and_dmas_both_ways():
    from megatrain_nb.host.shared_store import SharedHost

    sh = SharedHost(rank=0, local=[0], node=0, tag=f"gpu{os.getpid()}", cuda=True, pids=[os.getpid()])
    slabs = sh.alloc({(0, "master"): (1 << 20, torch.float32), (0, "grad"): (1 << 20, torch.bfloat16)}, [0])
    m, g = slabs[0, "master"], slabs[0, "grad"]
    assert m.is_pinned() and g.is_pinned(), "cudaHostRegister'ed memory reads as pinned: transfers DMA from it"
    m.copy_(torch.arange(1 << 20, dtype=torch.float32))
    d = torch.empty(1 << 20, device="cuda")
    s = torch.cuda.Stream()
    with torch.cuda.stream(s):
        d.copy_(m, non_blocking=True)
        g.copy_((d * 2).bfloat16(), non_blocking=True)
    s.synchronize()
    assert torch.equal(d.cpu(), m) and torch.equal(g, (m * 2).bfloat16())
    assert _segments() == []
