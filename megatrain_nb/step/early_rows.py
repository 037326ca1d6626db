"""The next forward's embedding rows, updated before the rest of the embedding.

Owns: the driver's request for the rows a new step gathers, their values as the embedding's pending
host update will leave them (computed by the Adam worker on copies), and the packer's wait for them.
Does not own: the AdamW arithmetic (``optim.HostAdamW.updated_rows``), when the worker updates a
unit (``workers.AdamWorker``), or the copy to the device (``transfers.Transfers.load``).

Note: [Early rows] the embedding's gradients land last in a backward (its rows' gradients come from
the last op, the head's, when tied, from the first), and its host AdamW is the largest of any unit
(311M parameters at the 3B shape: 67-77 ms on the H200's 16 cores). Yet the next forward reads it
first: traced at 3B under placement "stream", each step's compute idled 92 ms (x 1) and 141 ms (x 4)
before layer 0 while the host finished that update (``bench/trace_ops.py --stalls``, H200, 2026-12-01). The
forward needs only the rows its tokens gather (at most one per token: 4096 of 151936 at 1 x 4096).
So when the driver asks for them before the worker reaches the embedding, the worker first runs
the same fused AdamW on copies of those rows (master, moments, gradients gathered), hands the
updated master rows to the gather, updates every other unit that has landed, and only then the
whole embedding slab, as before: the slabs see exactly the update they always did. The copies are
bitwise what the slab's update writes when each row is a whole number of the kernel's 64-element
lanes (hidden % 64 == 0, as in every Qwen, Llama and Mistral shape); other widths skip this. A
tied head still waits for the whole update (``Engine._load_head``), at the end of the forward, and
so do its gradients; an untied embedding's gradients of the new step wait for it before they are
written into the slab that update reads (``embedding.scatter_grads``). With a gate (grad_clip, say) the
worker reaches the embedding the moment the last gradient lands, most often before the next step
has asked: its rows then wait for the whole update, as before. Where the host keeps up, the worker is idle
when the embedding's gradients land, and reaches it a few ms before the next step asks (the driver returns at
that landing, then prepares the batch): on the H200 at 14B x 8 it started the whole update 4 ms before the step
did, and layer 0 waited 0.29 s. So when the embedding is the last unit left, the worker waits for the next
step's request up to ``WAIT_S`` (``serve``'s ``wait``): served, or refused (too many rows), it goes on at once;
with no next step (the end of a run), the update is ``WAIT_S`` late, nothing else.
"""
from __future__ import annotations

import torch

WAIT_S = 0.1  # how long an otherwise idle worker waits for the next step to ask for its rows (see the Note)
LANES = 64  # rows of a multiple of this many fp32 elements fall on the fused kernel's vector lanes as in the slab
MAX_BYTES = 1 << 30  # host bytes of the rows served (fp32: 4 per element) at most; their copies go a piece at a time
# (``HostAdamW.updated_rows``). 14B x 8 x 4096 random tokens gather ~30K of 152064 rows of 5120: 0.6 GiB (its 2.5 GB of
# copies at once were refused until 2026-12-06, and each such step began ~0.2 s late on the H200); long context asks
# more, and its step hides the update


class EarlyRows:
    """Rows of the embedding's master (``width`` elements each) requested ahead of its host update.

    Args:
        width: elements per row (the hidden size); rows that are not a multiple of ``LANES`` are never served.
        worker: the ``workers.AdamWorker`` that updates the embedding: its ``cond`` guards requests and served
            rows as it does its ``version`` counts, and its ``wait_until`` is every wait here.
    Example:
        >>> import threading
        >>> from megatrain_nb.step.workers import AdamWorker
        >>> w = AdamWorker([-1], lambda *a: None, threading.Event())
        >>> e = EarlyRows(64, w)
        >>> e.request(1, torch.tensor([[5, 3, 5]]))
        True
        >>> e.serve(1, lambda rows: torch.stack([rows.float()] * 64, 1))  # the worker's side
        True
        >>> e.take(torch.tensor([[5, 3, 5]]), 1, master=None)[:, 0].tolist()
        [5.0, 3.0, 5.0]
        >>> w.close()
    """

    def __init__(self, width: int, worker):
        self.width, self.worker, self.cond = width, worker, worker.cond
        self.on = width % LANES == 0
        self.wanted: tuple[int, torch.Tensor] | None = None  # (version, sorted unique row ids) asked for
        self.served: tuple[int, torch.Tensor, torch.Tensor] | None = None  # (version, ids, fp32 rows)
        self.asked = 0  # the latest version a step asked rows for, served or refused
        self.count = 0  # requests served (tests, traces)

    def _updated(self, version: int) -> bool:
        """Under ``cond``: the embedding's whole update to ``version`` is applied (or skipped)."""
        return self.worker.version[-1] >= version

    def _served(self, version: int) -> tuple | None:
        """Under ``cond``: (ids, rows) served for ``version``, or None."""
        return self.served[1:] if self.served is not None and self.served[0] == version else None

    def request(self, version: int, ids: torch.Tensor) -> bool:
        """Driver: the forward of the step that needs ``version`` updates gathers ``ids``. Returns whether
        the rows may come early (False: the unit is updated already, or rows of this width never do). A request
        replaces the last one, unless the last one (or the rows served for it) covers it: a pass of several
        micro-batches asks for the union of their ids first, then each micro-batch for its own."""
        if not self.on:
            return False
        with self.cond:
            if self._updated(version):
                return False
            self.asked = max(self.asked, version)
            self.cond.notify_all()  # a worker waiting for this request goes on, served or not
            want = torch.unique(ids.flatten())
            if self._covers(version, want):
                return True  # a micro-batch of a pass that asked for all its rows at once (``embedding.request_rows``)
            if len(want) * self.width * 4 > MAX_BYTES:
                return False
            self.wanted = (version, want)
            if self._served(version) is not None:
                self.served = None  # served for a step that failed: this batch may gather other rows
            self.cond.notify_all()
        return True

    def _covers(self, version: int, want: torch.Tensor) -> bool:
        """Under ``cond``: every id of ``want`` is asked for at ``version`` already, or was served for it."""
        for got in (self.wanted, self.served):
            if got is not None and got[0] == version and bool(torch.isin(want, got[1]).all()):
                return True
        return False

    def serve(self, version: int, compute, wait: bool = False) -> bool:
        """Worker, before the unit's update that brings it to ``version``: ``compute(ids)`` -> the rows as
        that update leaves them, for the ids asked for. Returns False when nothing was asked for it,
        after waiting up to ``WAIT_S`` for a request where ``wait`` (see the Note). ``compute`` may write
        where the rows served for an earlier version are (``HostAdamW.updated_rows`` keeps its result's
        buffer): nothing reads those once a later version is asked for."""
        if wait and self.on:
            self.worker.wait_until(lambda: self.asked >= version, timeout=WAIT_S)
        with self.cond:
            want = self.wanted
        if want is None or want[0] != version:
            return False
        rows = compute(want[1])
        with self.cond:
            old, self.served, self.wanted = self.served, (version, want[1], rows), None
            self.count += 1
            self.cond.notify_all()
        del old  # the last step's rows, where they were a tensor of their own, are freed with the packer awake
        return True

    def ready(self, version: int) -> bool:
        """Whether ``take`` at ``version`` would return at once."""
        with self.cond:
            return self._served(version) is not None or self._updated(version)

    def wait(self, version: int) -> None:
        """Packer: block until the rows at ``version`` are served or the whole update is applied."""
        self.worker.wait_until(lambda: self._served(version) is not None or self._updated(version))

    def take(self, ids: torch.Tensor, version: int, master: torch.Tensor | None) -> torch.Tensor:
        """Packer: the rows of ``ids`` (flattened) at ``version``, fp32 (n, width): early ones once served,
        else from ``master`` once the whole update is applied. Raises as ``AdamWorker.wait_until``."""
        self.wait(version)
        with self.cond:
            got = self._served(version)
        flat = ids.flatten()
        if got is not None:
            have, rows = got
            if torch.equal(have, flat):  # the rows asked for, in their order (the gather's unique ids): as served
                return rows
            at = torch.searchsorted(have, flat).clamp_(max=len(have) - 1)
            if torch.equal(have[at], flat):
                return rows.index_select(0, at)
            self.worker.wait_until(lambda: self._updated(version))  # not the rows asked for: the whole update
        return master.view(-1, self.width).index_select(0, flat)
