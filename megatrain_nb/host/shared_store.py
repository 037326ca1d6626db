"""One host store per machine: the ranks of a machine share one copy of the masters, moments and gradients.

Owns: finding this process's machine-mates (``attach``), the shared segment (made by the machine's
first rank in /dev/shm, mapped by the others, unlinked as soon as every one has mapped it, pinned by
each rank with ``cudaHostRegister`` on CUDA), which local rank updates each unit (``SharedHost.owner``),
and the per-unit version counters and AdamW step counts in that segment: an owner publishes each of
its units' updates; the other ranks' Adam workers follow (``workers.AdamWorker``), with a bounded wait
that names the unit and its owner (``SharedHost.check``).
Does not own: the slabs' layout (``host_store`` asks ``alloc`` for them), the AdamW arithmetic (optim),
when updates run (workers), nor a step's collectives (distributed.py).

Note: [Shared host store] under data parallel every rank reduces the same gradients, so one update
per machine is enough. Unit u is updated by one local rank, its owner; the others skip its host
AdamW and do not copy its gradients out. Owners are a balanced split by parameter count (largest
first, ties in forward order; ``assign``): an embedding or head the size of several layers does not
pile onto one rank, and equal layers alternate ranks, so the units that land one after another in
the backward update on different ranks at once. After applying (or skipping) its step-k update of
unit u, the owner writes k into ``versions[u]``; a rank's next load of u waits until it reads k (its
Adam worker's follower thread polls, so ``AdamWorker.version`` keeps its meaning: the update is in the
store). Units placed "device" are updated on the owner's GPU and written back by it alone; "resident"
units update on every rank's GPU (each needs them there) and every rank writes back the same bits,
before its own next read of them, so no rank waits for another. The embedding's fp32 gradient stays
per rank (every rank scatters all rows into it to take its norm): 4 B per embedding parameter per
rank, a fixed cost per GPU. The counters are plain int64 stores; the writer's updates are ordered
before them by x86's total store order (the H200 hosts): an ARM host would need a fence here.
"""
from __future__ import annotations

import os
import socket
import threading
import time
import uuid
import weakref

import torch

SHM_DIR = "/dev/shm"
PREFIX = "megatrain-"  # every segment's file name starts with this (tests look for leftovers)
_ALIGN = 4096


def _setting(want: bool | None) -> bool | None:
    if want is not None:
        return want
    env = os.environ.get("MEGATRAIN_SHARE_HOST_STORE")
    return None if env is None else env not in ("0", "false", "False", "")


def attach(share: bool | None, cuda: bool) -> "SharedHost | None":
    """This rank's share of one host store per machine, or None (one process, or sharing is off).

    Collective under data parallel: every rank of the default group calls it (``Session`` does).

    Args:
        share: ``EngineConfig.share_host_store``: True / False; None: env ``MEGATRAIN_SHARE_HOST_STORE``
            ("0" off), else on when some machine runs more than one rank.
        cuda: the store will be read by a GPU (each rank pins the segment with cudaHostRegister).
    Returns:
        A ``SharedHost`` whose ``alloc`` the store calls, or None: each rank keeps its own store.
    Example:
        >>> shared = attach(None, cuda=False)   # doctest: +SKIP
    """
    from ..step.distributed import world

    rank, size = world()
    share = _setting(share)
    if size == 1 or share is False:
        return None
    import torch.distributed as dist

    key = f"{socket.gethostname()}/{_boot_id()}"
    keys: list = [None] * size
    dist.all_gather_object(keys, (key, os.getpid()))
    hosts = list(dict.fromkeys(k for k, _ in keys))
    local = [r for r in range(size) if keys[r][0] == key]
    if share is None and max(sum(k == h for k, _ in keys) for h in hosts) == 1:
        return None  # one rank per machine: nothing to share
    tag = [uuid.uuid4().hex[:12] if rank == 0 else None]
    dist.broadcast_object_list(tag, src=0)
    return SharedHost(rank=rank, local=local, node=hosts.index(key), tag=tag[0], cuda=cuda,
                      pids=[keys[r][1] for r in local])


def _boot_id() -> str:
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read().strip()
    except OSError:
        return ""


def _timeout_s() -> float:
    """The default process group's timeout: how long a rank waits for another before it raises."""
    from ..step.distributed import TIMEOUT_S

    try:
        import torch.distributed as dist

        pg = dist.group.WORLD
        return pg._get_backend(torch.device("cpu")).options._timeout.total_seconds()
    except (AttributeError, RuntimeError):
        return TIMEOUT_S


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")  # a zombie has died
    except (OSError, IndexError):
        return False


class SharedHost:
    """One machine's shared host store, as one of its ranks sees it (made by ``attach``).

    Args:
        rank: this process's global rank; local: the global ranks of this machine, ascending;
        node: this machine's index; tag: the run's segment name (the same on every rank);
        cuda: pin the mapping for DMA; pids: the local ranks' process ids (dead-owner detection).
    """

    def __init__(self, *, rank: int, local: list[int], node: int, tag: str, cuda: bool, pids: list[int]):
        self.rank, self.local, self.node, self.tag, self.cuda = rank, local, node, tag, cuda
        self.local_rank, self.local_world = local.index(rank), len(local)
        self.pids = pids
        self.owner: dict[int, int] = {}  # unit -> local rank that updates it
        self.versions: torch.Tensor | None = None  # (units,) int64, shared: updates applied per unit
        self.steps: torch.Tensor | None = None  # (units,) fp32, shared: each unit's AdamW step count
        self.nbytes = 0
        self.timeout_s = _timeout_s()
        self.path = os.path.join(SHM_DIR, f"{PREFIX}{tag}-n{node}")
        self._base: torch.Tensor | None = None  # (nbytes,) uint8: the whole mapping
        self._order: list[int] = []

    @property
    def leader(self) -> bool:
        """This rank fills the store (local rank 0)."""
        return self.local_rank == 0

    def owns(self, unit: int) -> bool:
        """Whether this rank applies ``unit``'s host updates (and writes its state)."""
        return self.owner[unit] == self.local_rank

    def assign(self, numel: dict[int, int]) -> dict[int, int]:
        """Owners: largest unit first to the local rank with the fewest parameters so far (Note: [Shared host store])."""
        load = [0] * self.local_world
        order = list(numel)
        for u in sorted(order, key=lambda u: (-numel[u], order.index(u))):
            r = min(range(self.local_world), key=lambda r: (load[r], r))
            self.owner[u] = r
            load[r] += numel[u]
        return self.owner

    # ---- the segment (collective) ---------------------------------------------------------------
    def alloc(self, want: dict, order: list[int]) -> dict:
        """The shared slabs: one segment per machine, made by its leader, mapped by every local rank.

        Collective: every rank of the default group calls it with the same ``want``.

        Args:
            want: key -> (numel, dtype) of each shared slab; keys (unit, kind).
            order: the units, forward order (the counters' index is the position in it).
        Returns:
            key -> flat zeroed tensor of that numel and dtype, a view into the segment.
        Raises:
            RuntimeError: /dev/shm cannot hold the segment (names the bytes and the fix), or another rank failed.
        """
        self._order = list(order)
        self.assign({u: max((n for (k, _), (n, _) in want.items() if k == u), default=0) for u in order})
        n_units = len(order)
        offs, off = {}, -(-(n_units * 12) // _ALIGN) * _ALIGN  # header: versions (int64), step counts (fp32)
        for k, (n, dt) in want.items():
            offs[k] = off
            off += -(-n * dt.itemsize // _ALIGN) * _ALIGN
        self.nbytes = off
        try:
            err = self._create() if self.leader else None
            self._agree(err, "making the shared host store")
            err = None if self.leader else self._map()
            self._agree(err, "mapping the shared host store")
        finally:
            if self.leader and os.path.exists(self.path):
                os.unlink(self.path)  # every rank has it mapped: the memory lives until the last one unmaps
        base = self._base
        self.versions = base[:n_units * 8].view(torch.int64)
        self.steps = base[n_units * 8:n_units * 12].view(torch.float32)
        if self.cuda:
            self._register()
        return {k: base[offs[k]:offs[k] + n * dt.itemsize].view(dt) for k, (n, dt) in want.items()}

    def _create(self) -> str | None:
        st = os.statvfs(SHM_DIR)
        if st.f_bavail * st.f_frsize < self.nbytes:
            return (f"{SHM_DIR} has {st.f_bavail * st.f_frsize / 2**30:.1f} GiB free, the shared host store needs "
                    f"{self.nbytes / 2**30:.1f} GiB: enlarge it (docker: --shm-size) or set share_host_store=False "
                    "(each rank then holds its own store)")
        try:
            fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
            try:
                os.posix_fallocate(fd, 0, self.nbytes)  # reserve now: ENOSPC here, never SIGBUS on a later write
            finally:
                os.close(fd)
            return self._map()
        except OSError as e:
            if os.path.exists(self.path):
                os.unlink(self.path)
            return f"could not make {self.path} ({self.nbytes / 2**30:.1f} GiB): {e}"

    def _map(self) -> str | None:
        try:
            self._base = torch.from_file(self.path, shared=True, size=self.nbytes, dtype=torch.uint8)
        except RuntimeError as e:
            return f"could not map {self.path}: {e}"
        return None

    def _agree(self, err: str | None, what: str) -> None:
        import torch.distributed as dist

        from ..step.distributed import failing

        if not dist.is_initialized():  # one process (tests): nothing to agree with
            got = [err]
        else:
            got = [None] * dist.get_world_size()
            with failing(what):
                dist.all_gather_object(got, err)
        bad = [(r, e) for r, e in enumerate(got) if e]
        if bad:
            raise RuntimeError(f"data parallel: {what} failed on rank {bad[0][0]}: {bad[0][1]}")

    def _register(self) -> None:
        """Pin this rank's mapping for DMA (each process registers the same pages once)."""
        cudart = torch.cuda.cudart()
        ptr = self._base.data_ptr()
        err = cudart.cudaHostRegister(ptr, self.nbytes, 0)
        if int(err) != 0:
            raise RuntimeError(f"cudaHostRegister of the shared host store ({self.nbytes / 2**30:.1f} GiB) failed "
                               f"with CUDA error {int(err)}: raise the locked-memory limit (ulimit -l) or set "
                               "share_host_store=False")
        weakref.finalize(self, cudart.cudaHostUnregister, ptr)  # before the mapping goes: pages stay valid unpinned

    def holds(self, t: torch.Tensor) -> bool:
        """Whether ``t``'s memory lies in the shared segment."""
        a = self._base.data_ptr()
        return a <= t.data_ptr() < a + self.nbytes

    # ---- versions ------------------------------------------------------------------------------------
    def published(self, unit: int) -> int:
        """Updates of ``unit`` its owner has applied (or skipped): a read of shared memory."""
        return int(self.versions[self._order.index(unit)])

    def publish(self, unit: int, version: int) -> None:
        """Owner: ``unit``'s update ``version`` is in the store (after its master, moments and shadow)."""
        self.versions[self._order.index(unit)] = version

    def check(self, unit: int, version: int, since: float) -> None:
        """A follower's bounded wait: raise when ``unit``'s owner died or has not published ``version`` in time."""
        r = self.owner[unit]
        owner, pid = self.local[r], self.pids[r]
        waited = time.monotonic() - since
        dead = not _alive(pid)
        if dead or waited > self.timeout_s:
            why = (f"rank {owner} (pid {pid}) died" if dead else
                   f"rank {owner} did not publish it within the process group's timeout ({self.timeout_s:.0f} s)")
            raise RuntimeError(
                f"data parallel: rank {self.rank}: the shared host store's update {version} of unit {unit} "
                f"(owned by local rank {r}) never came: {why}. No later update was applied; the last "
                "checkpoint is intact: resume from it")


class Follower:
    """A thread that raises an ``AdamWorker``'s versions of units other ranks own as their owners publish.

    Args:
        shared: the ``SharedHost``; worker: the ``AdamWorker`` whose ``version`` / ``target`` it follows.
    """

    poll_s = 2e-4

    def __init__(self, shared: SharedHost, worker):
        self.shared, self.worker = shared, worker
        self.since: dict[int, float] = {}  # unit -> when its wait began
        self.thread = threading.Thread(target=self._run, name="megatrain-follower", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        w, s = self.worker, self.shared
        last_check = 0.0
        while True:
            with w.cond:
                while not w.closed and not any(w.version[u] < t for u, t in w.target.items()):
                    w.cond.wait(0.05)
                if w.closed:
                    return
                waiting = {u: t for u, t in w.target.items() if w.version[u] < t}
            moved = {u: min(t, s.published(u)) for u, t in waiting.items()}
            moved = {u: v for u, v in moved.items() if v > w.version[u]}
            now = time.monotonic()
            with w.cond:
                for u, v in moved.items():
                    w.version[u] = v
                    self.since.pop(u, None)
                if moved:
                    w.cond.notify_all()
            still = [u for u in waiting if u not in moved or moved[u] < waiting[u]]
            for u in still:
                self.since.setdefault(u, now)
            if still and now - last_check > 0.5:  # /proc reads: twice a second
                last_check = now
                try:
                    for u in still:
                        s.check(u, waiting[u], self.since[u])
                except RuntimeError as e:
                    with w.cond:
                        w.error = e
                        w.target = {}
                        w.cond.notify_all()
                    self.since.clear()
                    continue
            if not moved:
                time.sleep(self.poll_s)

    def close(self) -> None:
        self.thread.join(timeout=5)


def fill(store, init) -> None:
    """Run ``init(store)`` and the shadow's refresh once per machine (its leader), then let every rank go on.

    Collective under a shared store: every rank calls it; an error on the leader is raised on every rank.
    """
    shared = store.shared
    if shared is None:
        init(store)
        store.refresh_shadow()
        return
    err = None
    if shared.leader:
        try:
            init(store)
            store.refresh_shadow()
        except Exception as e:
            err = e
    try:
        shared._agree(None if err is None else f"{type(err).__name__}: {err}", "filling the shared host store")
    except RuntimeError:
        if err is not None:
            raise err from None  # the leader raises what went wrong itself (a corrupt file, a missing weight)
        raise
