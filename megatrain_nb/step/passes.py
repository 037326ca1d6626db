"""Gradient accumulation over passes: a batch runs as several forward/backward passes, one update.

Owns: the passes of a step (``split``: consecutive rows, whole micro-batches, whole groups under a loss
hook), the record each op of a step reads (``Pass``: first, final, the hook's micro-batch offset), what
may run with passes (``check``), and what waits on the device from one pass to the next: the embedding
rows' gradients and the loss (``Carry``). Where each unit's gradients wait is Note: [Passes].
Does not own: the step (``engine.py`` runs ``Pass`` after ``Pass`` at one named point, ``Engine._step``),
the copies (``transfers.Transfers.grads``, whose ``land`` an earlier pass turns off), the choice of the pass
size under "auto"
(``machine/autoplan.py``, Note: [Pass choice]).

Note: [Passes] ``micro_batch_size`` splits a batch inside each layer, so every micro-batch's
activations wait for the backward together: it saves no activation memory. ``pass_batch_size``
runs the batch as passes of that many rows, each a whole forward and backward, so the activations
are one pass's; the gradients add up over the passes and the step's one update follows the last.
The sum is the one ``micro_batch_size`` makes, in the same dtype; with one micro-batch a pass, in the
same order too (on the CPU in fp32, bit for bit: ``tests/test_passes.py``), and with several, each pass's
micro-batches summed first:
  - a resident unit's gradients stay in its device buffer, which only the first pass zeroes;
  - the head group's stay in the head's grad slot (the layers do not share it), zeroed by the first pass
    and copied out by the last;
  - a "host" layer's go out every pass into the host's grad slab (the layers share two grad slots), and
    the next pass's backward of the layer starts from them instead of a zeroed slot (``preload``: on the
    h2d stream while the op before computes, 2 bytes a parameter in); only the final pass's copy-out lands
    for the Adam worker, its norm the device's, as in one pass. The H200's first run of passes added into
    the slab on the host instead: the copy-outs then went through the staging and the host's adds, and
    the compute waited 238 ms a step for grad slots (3B x 16, two passes of 8: 0.935 x the tokens/s of x 8);
  - the embedding rows' gradients (tokens x hidden, compute dtype) and their ids wait on the device
    (``Carry.rows``); the final pass's embedding backward takes them all at once, as one pass takes all
    its micro-batches';
  - each pass's loss is summed on the device (``Carry.loss``); the final pass's is the step's.
No update, norm or verdict runs before the final pass, and the Adam worker hears of no unit before
it: an out-of-memory error in any pass leaves nothing applied. Between passes the weight slots keep
what they hold (nothing was updated), so a pass's forward reuses the last backward's layers.
Not with a "device" unit ("stream", the streamed head: their updates run inside the backward), data
parallel or a shared host store (``check`` says so).
"""
from __future__ import annotations

import dataclasses

import torch


@dataclasses.dataclass(frozen=True)
class Pass:
    """One pass of a step: which, and where its micro-batches start in the step's list (the hook's index)."""

    index: int
    count: int  # passes in the step
    offset: int = 0  # micro-batches of the earlier passes

    @property
    def first(self) -> bool:
        return self.index == 0

    @property
    def final(self) -> bool:
        return self.index == self.count - 1


ONE = Pass(0, 1)  # a step of one pass: every op as before passes existed


def split(mbs: list[dict]) -> list[list[dict]]:
    """The step's micro-batches grouped by their ``"pass"`` (``batch.prepare`` sets it; absent: one pass).

    Example:
        >>> [len(p) for p in split([{"pass": 0}, {"pass": 0}, {"pass": 1}, {"pass": 1}])]
        [2, 2]
    """
    out: list[list[dict]] = []
    for mb in mbs:
        p = mb.get("pass", 0)
        if p == len(out):
            out.append([])
        elif p != len(out) - 1:
            raise ValueError(f"micro-batch of pass {p} after pass {len(out) - 1}: passes must be consecutive")
        out[-1].append(mb)
    return out


def rows_per_pass(setting: int | None, choice: int | None, B: int, group_size: int = 1) -> int:
    """Rows of one pass for a batch of ``B`` rows: ``setting`` (the user's ``pass_batch_size``) or "auto"'s
    ``choice``, else the whole batch; whole groups (a DPO pair, a GRPO group) in every pass.

    Raises:
        ValueError: a setting that splits a group, naming a setting that does not.

    Example:
        >>> rows_per_pass(None, 8, 16), rows_per_pass(4, 8, 16), rows_per_pass(None, None, 16), rows_per_pass(None, 3, 16, 2)
        (8, 4, 16, 2)
    """
    rows = setting if setting is not None else choice
    if rows is None or rows >= B:
        return B
    if rows % group_size:
        if setting is not None:
            fix = group_size * max(1, setting // group_size)
            raise ValueError(f"pass_batch_size={setting} would split a group of group_size={group_size} rows (a DPO "
                             f"pair or a GRPO group) across passes; set pass_batch_size to a multiple of "
                             f"{group_size}, e.g. pass_batch_size={fix}")
        rows = group_size * max(1, rows // group_size)  # "auto"'s choice: whole groups
    return rows


def check(du, dp, shared: bool) -> None:
    """Raise before a step of several passes where a unit's gradients could not wait (Note: [Passes])."""
    if du.opt.streamed or du.head_streamed:
        raise ValueError(f"pass_batch_size: units {sorted(du.opt.streamed)} are placed \"device\" (placement "
                         "\"stream\"), whose updates run inside the backward, so their gradients cannot wait for "
                         "a later pass; use placement=\"auto\" or \"host\" with passes, or micro_batch_size")
    if dp is not None or shared:
        raise ValueError("pass_batch_size: passes do not run under data parallel yet; give each rank a batch "
                         "of pass_batch_size rows, or use micro_batch_size")


def preload(eng, unit: int, dst: torch.Tensor, after):
    """h2d stream: ``unit``'s gradients summed by the earlier passes, from its host grad slab into ``dst`` (its
    grad slot), after event ``after`` (the slot's last copy-out) and the last pass's copy-out of the unit.
    Returns the event the backward's compute waits for instead of zeroing the slot (Note: [Passes])."""
    enqueued, landed = eng.carry.out.pop(unit)
    copied = enqueued.get()  # host wait: the copy out is enqueued, so its ring buffer is taken (Note: [Gradient ring])
    slab = eng.store.grad_of(unit)[:dst.numel()]  # its slab, or the ring's (or a spill) buffer it holds
    dev = eng.dev
    if not (slab.is_pinned() and slab.dtype == dst.dtype):
        landed.get()  # host wait: a copy through the staging reaches the slab on the unpacker (the CPU's too)
    with dev.on(dev.h2d):
        dev.wait(dev.h2d, after)
        dev.wait(dev.h2d, copied)  # a DMA into the pinned slab: ordered on the device
        tok = eng.rec.cuda_begin("h2d", "grad-in", unit, "bwd", slab.numel() * slab.element_size(), dev.h2d)
        dst.copy_(slab, non_blocking=True)
        eng.rec.cuda_end(tok, dev.h2d)
        return dev.record(dev.h2d)


class Carry:
    """What waits on the device from one pass to the next (Note: [Passes]): the loss and the embedding rows."""

    def __init__(self):
        self.loss: torch.Tensor | None = None  # 0-d fp32: the earlier passes' loss
        self.rows: list[torch.Tensor] = []  # each earlier pass's embedding-row gradients (tokens * hidden,)
        self.ids: list[torch.Tensor] = []  # and their token ids (host), in micro-batch order
        self.out: dict = {}  # host unit -> (enqueued, landed) boxes of the last pass's copy-out of its gradients

    def start_loss(self, device) -> torch.Tensor:
        """Compute stream: the loss accumulator a pass adds its micro-batches' into."""
        if self.loss is None:
            return torch.zeros((), dtype=torch.float32, device=device)
        return self.loss

    def keep_rows(self, dE: torch.Tensor, ids: torch.Tensor) -> None:
        """A pass that is not the last: its rows' gradients and ids wait for the final pass."""
        self.rows.append(dE)
        self.ids.append(ids)

    def all_rows(self, dE: torch.Tensor, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The final pass: every pass's rows and ids, in order (one tensor each), and nothing kept."""
        rows, idss = self.rows + [dE], self.ids + [ids]
        self.rows, self.ids = [], []
        if len(rows) == 1:
            return dE, ids
        return torch.cat(rows), torch.cat(idss)
