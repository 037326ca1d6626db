"""The embedding's gradient as the rows a step touched, instead of a slab the size of the table.

Owns: the touched rows' ids and fp32 gradients of one step (``RowGrad``), adding a step's rows into them, their
norm, and handing the update a dense piece of the gradient, or the rows early rows need. Does not own: when rows
come in (``step/embedding.py``'s ``scatter_grads``, on the unpacker thread), the update (``optim.HostAdamW``),
or the choice to use it (``HostStore``: Note [Embedding rows]).

Note: [Embedding rows] an untied input embedding's gradient is non-zero only in the rows of the step's token ids
(at most min(tokens, vocabulary) of them), yet a dense fp32 slab of the whole table stayed in host RAM: 2.03 GiB at
the 7B shape, 2.90 at 14B, 2.16 at gpt-oss-20b. Where the gradient ring holds the other units' gradients (no
``grad_clip``, one pass: nothing reads the embedding's gradient but its own AdamW and the early rows), the store
keeps only the touched rows: ids sorted and unique, their fp32 sums in that order (``RowGrad.scatter``: the same
``index_add_`` of the same rows in the same order as into the slab, so the same bits). The update still runs over
the whole table (AdamW decays the moments of an untouched row and applies weight decay to it): it takes the
gradient a piece at a time, zeros with the touched rows copied in (``RowGrad.dense``), as the chunked update takes
a bf16 slab's (Note: [Chunked upcast] in ``optim.py``). A tied embedding keeps its slab (the head's gradient lands
in it whole), as do compact moments for the embedding (their kernel reads the whole slab) and a shared store.
The rows' buffer grows to the most rows a step has touched and stays: its bytes are ``bytes_report``'s
``grad_rows``.
"""
from __future__ import annotations

import torch


CAST_NUMEL = 1 << 22  # elements of rows cast to fp32 at a time in ``scatter`` (16 MiB, kept)
ADD = "index_add"  # how ``scatter`` adds a piece: "index_add" (``index_add_``) or "scatter_add" (``scatter_add_``
# over the ids expanded along the row): the same adds in the same order per element, so the same bits (tested).
# `bench/embed_grad_cost.py --add index_add scatter_add`, a step of 8 x 4096: 0.042 s against 0.044 on the H200's host
# (the 14B table), 0.093 against 0.102 on the CPU box (the 7B table; docs/benchmarks.md, "The rows' op"): index_add stays


def rows_bytes(rows: int, width: int) -> int:
    """Host bytes ``RowGrad`` holds for ``rows`` touched rows of ``width``: their fp32 sums, a zero row after them
    (``take``'s) and their ids."""
    return (rows + 1) * 4 * width + 8 * rows if rows else 0


class RowGrad:
    """One step's gradient of a (rows, width) embedding: the touched rows' ids and fp32 sums."""

    def __init__(self, rows: int, width: int):
        self.rows, self.width = rows, width
        self.ids = torch.zeros(0, dtype=torch.long)  # (k,) sorted, unique
        self._vals = torch.zeros(0)  # (capacity * width,) fp32: the first k rows hold this step's sums
        self._cast = torch.zeros(0)  # scatter's fp32 copy of a piece of low-precision rows (CAST_NUMEL at most)

    @property
    def vals(self) -> torch.Tensor:
        """(k, width) fp32: the gradient of row ``ids[i]`` in row i."""
        k = self.ids.numel()
        return self._vals[:k * self.width].view(k, self.width)

    @property
    def nbytes(self) -> int:
        """Host bytes held: the rows' buffer (the most rows a step has touched, and a zero row) and the ids."""
        return self._vals.numel() * 4 + self.ids.numel() * 8  # ``rows_bytes`` of the most rows a step touched

    def scatter(self, ids: torch.Tensor, rows: torch.Tensor, *, piece: int | None = None) -> torch.Tensor:
        """This step's gradient from ``rows`` (n, width), row i the gradient of token ``ids[i]`` (n,); returns
        its L2 norm's input, the touched rows flat (fp32, sorted by id).

        Rows are added in order, ``piece`` at a time (None: ``CAST_NUMEL`` elements' worth), cast to fp32 as
        they go through a kept buffer: as ``index_add_`` into a zeroed slab would, so every row's sum has the
        same bits. (A fresh fp32 copy of every row, 0.67 GB at 14B x 8 x 4096, cost more in page faults than
        the adds.)
        """
        if rows.shape != (ids.numel(), self.width):
            raise ValueError(f"rows of shape {tuple(rows.shape)} for {ids.numel()} ids of width {self.width}")
        uniq, inv = torch.unique(ids.flatten(), sorted=True, return_inverse=True)
        k = uniq.numel()
        if self._vals.numel() < (k + 1) * self.width:  # and a row of zeros after them for ``take``
            self._vals = torch.empty((k + 1) * self.width)  # the most rows yet: kept for the steps after
        self.ids = uniq
        vals = self.vals.zero_()
        piece = piece or max(1, CAST_NUMEL // self.width)
        if rows.dtype != torch.float32 and self._cast.numel() < min(piece, rows.shape[0]) * self.width:
            self._cast = torch.empty(min(piece, rows.shape[0]) * self.width)
        for a in range(0, rows.shape[0], piece):
            b = min(rows.shape[0], a + piece)
            src = rows[a:b]
            if src.dtype != torch.float32:
                src = self._cast[:(b - a) * self.width].view(b - a, -1).copy_(src)
            if ADD == "scatter_add":
                vals.scatter_add_(0, inv[a:b].view(-1, 1).expand(-1, self.width), src)
            else:
                vals.index_add_(0, inv[a:b], src)
        return vals.flatten()

    def dense(self, a: int, b: int, scratch: torch.Tensor) -> torch.Tensor:
        """Elements [a, b) of the flat dense gradient (zeros but in touched rows), fp32, written into
        ``scratch`` (at least ``b - a + 2 * width`` elements)."""
        w = self.width
        r0, r1 = a // w, -(-b // w)
        block = scratch[:(r1 - r0) * w].view(r1 - r0, w).zero_()
        lo, hi = torch.searchsorted(self.ids, torch.tensor([r0, r1])).tolist()
        if hi > lo:
            block.index_copy_(0, self.ids[lo:hi] - r0, self.vals[lo:hi])
        return block.view(-1)[a - r0 * w:b - r0 * w]

    def take(self, rows: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """(len(rows), width) fp32: the gradient of each of ``rows`` (zeros where the step did not touch it),
        written into ``out`` where given. One ``index_select`` from the touched rows and a zero row after them
        (untouched rows point there), where zeroing ``out`` and assigning the touched ones by mask took two passes."""
        out = torch.empty(rows.numel(), self.width) if out is None else out
        k = self.ids.numel()
        if not k:
            return out.zero_()
        table = self._vals[:(k + 1) * self.width].view(k + 1, self.width)
        table[k].zero_()
        pos = torch.searchsorted(self.ids, rows).clamp_(max=k - 1)
        return torch.index_select(table, 0, torch.where(self.ids[pos] == rows, pos, k), out=out)

    def clear(self) -> None:
        """No rows touched (the buffer stays)."""
        self.ids = self.ids[:0]
