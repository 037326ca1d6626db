"""Data parallel over ``torch.distributed``: every rank streams the whole model, reduces its gradients.

Owns: joining a process group from torchrun's environment (``init``), the device of each rank
(``local_device``), and the collectives of a data-parallel step (``DataParallel``): the global count
of supervised tokens, the all-reduce of each unit's gradients as its backward ends (before anything
crosses to the host), the loss sum, the gather of the embedding's row gradients, and the agreement
of placement measurements, so that every rank takes the same decisions. Its errors say which rank
failed and that the last checkpoint is intact.
Does not own: the step (engine.py calls ``DataParallel`` at the points named in its Note: [Data
parallel]), launching processes (torchrun, or ``torch.multiprocessing``), sharding the data (each
caller passes its own rows; ``strided`` is the helper), nor the host store: the ranks of a machine
share one and split its updates (shared_store.py); machines apply the same update to their own.

Note: [Data parallel] the loss of a step divides by the *global* count of supervised tokens, so
the sum over ranks of each rank's gradient is the gradient of the global loss: one all-reduce
(sum) per unit, no rescaling. Gloo and NCCL give every rank the same bits for a sum, so ranks
apply bit-identical updates and stay in lockstep without broadcasting weights. The embedding's
gradient is rows of the tokens each rank saw: the rows and their token ids are gathered (far
fewer bytes than the V x H table) and every rank scatters all of them, in rank order, as one
process with every rank's rows would. Every collective is issued by the driver thread, in the
step's fixed op order, so every rank issues the same sequence.
"""
from __future__ import annotations

import contextlib
import datetime
import os

import torch
import torch.distributed as dist

from ..host.optim import grad_norm
from ..host.collective_save import Turns

TIMEOUT_S = float(os.environ.get("MEGATRAIN_DP_TIMEOUT_S", 300))
"""Seconds a collective may wait for the other ranks before this rank raises (``init``'s default)."""


def init(*, backend: str | None = None, timeout_s: float | None = None) -> bool:
    """Join the process group that torchrun's environment describes (WORLD_SIZE > 1); else do nothing.

    Args:
        backend: "nccl" or "gloo"; default: nccl when CUDA is available, else gloo.
        timeout_s: how long a collective waits for a stopped rank before raising; default ``TIMEOUT_S``
            (env ``MEGATRAIN_DP_TIMEOUT_S``, 300 s).
    Returns:
        True when this process is one rank of several (a Session made now trains data-parallel).
    Example:
        >>> # torchrun --nproc-per-node 2 train.py, where train.py does:
        >>> distributed.init(); s = Session.from_pretrained("m", device=distributed.local_device("cuda"))  # doctest: +SKIP
    """
    if dist.is_available() and dist.is_initialized():
        return dist.get_world_size() > 1
    if int(os.environ.get("WORLD_SIZE", "1")) <= 1:
        return False
    if backend is None:
        backend = "nccl" if torch.cuda.is_available() else "gloo"
    if backend == "nccl":
        os.environ.setdefault("NCCL_NVLS_ENABLE", "0")  # NVLink multicast off (docs/distributed.md)
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group(backend, timeout=datetime.timedelta(seconds=timeout_s or TIMEOUT_S))
    return True


def world() -> tuple[int, int]:
    """(rank, world size) of the default process group; (0, 1) without one."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def local_device(device: str) -> str:
    """``"cuda"`` is this rank's GPU (``cuda:LOCAL_RANK``) under data parallel; any other device as given."""
    if device == "cuda" and world()[1] > 1:
        return f"cuda:{int(os.environ.get('LOCAL_RANK', dist.get_rank() % max(1, torch.cuda.device_count())))}"
    return device


class strided:
    """This rank's share of an iterator of batches: of each ``size`` consecutive items, the rank-th.

    Every rank reads the same iterator (same data, same seed) and advances it ``size`` items per
    step, so its ``state_dict()`` is the same on every rank (rank 0's checkpoint holds it) and
    counts global batches: a resume on another number of ranks goes on from the same place.

    Args:
        batches: an iterator of batches (``sft_batches``, ``synthetic_batches``, any iterable).
        rank, size: default: this process's rank and world size.
    Example:
        >>> it = strided(sft_batches("d.jsonl", "m", batch=8, seq=512))   # doctest: +SKIP
    """

    def __init__(self, batches, rank: int | None = None, size: int | None = None):
        r, n = world()
        self.it, self.rank, self.size = iter(batches), (r if rank is None else rank), (n if size is None else size)
        self.source = batches

    def __iter__(self):
        return self

    def __next__(self):
        got = [next(self.it) for _ in range(self.size)]  # StopIteration ends every rank at the same step
        return got[self.rank]

    def state_dict(self) -> dict:
        return self.source.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.source.load_state_dict(state)

    def __getattr__(self, name):  # the source's other attributes (enc, examples, format, ...)
        if name == "source":
            raise AttributeError(name)
        return getattr(self.source, name)


def destroy() -> None:
    """Leave the process group (at the end of a torchrun script); no-op without one."""
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def barrier(what: str) -> None:
    """All ranks reach this point (no-op without a group); a stopped rank raises the clear error."""
    if world()[1] > 1:
        with failing(what):
            dist.barrier()


def attach(dev) -> "DataParallel | None":
    """A ``DataParallel`` over the default group when it has several ranks, else None (one process)."""
    return DataParallel(dev) if world()[1] > 1 else None


_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor  # torch >= 2.13 renames it


@contextlib.contextmanager
def failing(what: str):
    """A collective's failure as an error naming ``what`` and the rank (the context of every collective here)."""
    try:
        yield
    except (RuntimeError, ValueError, ConnectionError) as e:
        r, n = world()
        raise RuntimeError(f"data parallel: rank {r} of {n}: {what} failed: another rank stopped, died or did not "
                           f"answer within the process group's timeout ({type(e).__name__}: {str(e)[:300]}). No "
                           "update of this step was applied; the last checkpoint is intact: resume from it") from e


class DataParallel:
    """The collectives of one data-parallel step (see Note: [Data parallel]).

    Args:
        dev: the engine's ``transfers.Streams``. On CUDA the gradient all-reduces run on a side
            stream, so the compute stream goes on to the next layer's backward meanwhile.
    """

    def __init__(self, dev):
        self.dev = dev
        self.rank, self.size = world()
        self.stream = torch.cuda.Stream(dev.device) if dev.cuda else None  # gradient all-reduces
        self.tokens: list[int] = []  # this step: tokens of each rank, in rank order
        self.ids: torch.Tensor | None = None  # (sum(tokens),) long, host: every rank's token ids, in rank order
        self.saves = Turns(self.rank, self.size)  # who writes a save (Note: [One writer] in collective_save.py)

    def begin(self, mbs: list[dict], n_valid: int) -> int:
        """Driver, before the step: returns the global supervised-token count; keeps every rank's ids.

        Blocks the CPU until every rank has arrived (one small gather: counts and token ids). First the
        save gate: a rank waits for rank 0 while it writes a save alone (Note: [One writer]).
        """
        self.saves.at_step()
        ids = torch.cat([mb["input_ids"].flatten() for mb in mbs])
        got: list = [None] * self.size
        with failing("the step's start (token counts)"):
            dist.all_gather_object(got, (int(n_valid), ids))
        self.tokens = [int(t.numel()) for _, t in got]
        self.ids = torch.cat([t for _, t in got])
        return sum(n for n, _ in got)

    def sum_(self, t: torch.Tensor, what: str) -> None:
        """Current stream: ``t`` becomes the sum over ranks (in place)."""
        with failing(what):
            dist.all_reduce(t)

    def sum_ints(self, xs: list[int]) -> list[int]:
        """Driver: the sums over ranks of a few host ints (a loss hook's global counts, ``LossContext``).

        Blocks the CPU until every rank has sent its counts (the loss needs them before it runs).
        """
        t = torch.tensor(xs, dtype=torch.int64, device=self.dev.device)
        self.sum_(t, "the loss hook's counts")
        return t.tolist()  # host sync

    def grads(self, g: torch.Tensor, norm: torch.Tensor, n: int, done):
        """Sum ``g`` over ranks and write the L2 norm of its first ``n`` elements into ``norm``.

        Args:
            g: (numel,) compute dtype, on the device: a unit's gradient, complete at ``done``.
            norm: 0-dim fp32 on the device (the engine's per-unit norm slot).
            done: event after the backward wrote ``g`` (None on "cpu").
        Returns:
            The event after which ``g`` is the global gradient and ``norm`` its norm (None on "cpu").
            On CUDA this is on the side stream: the compute stream does not wait for it.
        """
        dev = self.dev
        with dev.on(self.stream):
            if dev.cuda:
                dev.wait(self.stream, done)
                g.record_stream(self.stream)  # the slot outlives this read: its next use waits on the copy-out
            self.sum_(g, "a gradient all-reduce")
            norm.copy_(grad_norm(g[:n]))
            return dev.record(self.stream)

    def rows(self, dE: torch.Tensor) -> torch.Tensor:
        """Current stream: every rank's embedding-row gradients, in rank order.

        Args:
            dE: (tokens * H,) on the device (compute dtype; fp32 where the device updates the embedding):
                this rank's rows.
        Returns:
            (sum(tokens) * H,) of that dtype: the rows of ``self.ids``' tokens.
        """
        H = dE.numel() // self.tokens[self.rank]
        most = max(self.tokens) * H
        pad = torch.zeros(most, dtype=dE.dtype, device=dE.device)
        pad[:dE.numel()] = dE
        out = torch.empty(self.size * most, dtype=dE.dtype, device=dE.device)
        with failing("the embedding-row gather"):
            _all_gather(out, pad)
        parts = [out[r * most:r * most + t * H] for r, t in enumerate(self.tokens)]
        return torch.cat(parts)

    def agree(self, value: float, op: str) -> float:
        """The ``op`` ("min" or "max") of ``value`` over ranks, so that every rank decides the same
        (placement, activation policy). Host sync on CUDA; between steps or at a step's end only."""
        t = torch.tensor([float(value)], dtype=torch.float64, device=self.dev.device)
        with failing("a placement agreement"):
            dist.all_reduce(t, op=dist.ReduceOp.MIN if op == "min" else dist.ReduceOp.MAX)
        return float(t.item())  # .item(): host sync
