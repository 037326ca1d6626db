"""The embedding unit's part of a step: its rows in for the forward, their gradients out after the backward.

Owns: gathering each micro-batch's embedding rows (from the fp32 host master, never the whole table; from
the early rows the Adam worker serves ahead of the embedding's update, Note: [Early rows]; or on the device
where the embedding is resident, or streamed with a tied head), the embedding's backward (its rows'
gradients to the device's update, to the streamed head group, or through pinned memory to the host), and
the host's scatter of those rows into the fp32 grad slab (or the store's touched rows: host/embed_grad.py).
Does not own: the early rows' bookkeeping (``early_rows.py``), the device-side gather and update
(``device_updates.py``), the copies and their waits (``transfers.py``). The engine calls ``gather`` at the
start of a step (``Engine._gather``), ``backward`` at the last op of the backward, and hands
``early_rows`` to the Adam worker; ``scatter_grads`` runs on the unpacker thread.

Note: [Unique rows] a streamed embedding sends each distinct row of a micro-batch once, in id order, and the
h2d stream spreads them to their tokens on the device (``index_select``, ``Transfers.load``'s ``then``), where the
host used to gather a row for every token: fp32, 0.47 GB at 7B x 8 x 4096, 45 ms on the H100's host before
packing, on the path from the embedding's update to layer 0. The early rows (Note: [Early rows]) come as they were
served, with no copy at all. Random tokens are ~90% distinct at that batch (29.4K of 32K rows of 152K); text
repeats its common tokens, and sends a fraction. The values are the same rows cast as before: the same bits.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from ..host.optim import grad_norm
from .transfers import chunks
from .workers import Box

if TYPE_CHECKING:
    from .engine import Engine


def request_rows(eng: Engine, mbs: list[dict], head_box: Box | None = None) -> None:
    """Driver, before a pass's ``gather``s: ask for the rows of all its micro-batches at once (Note: [Early
    rows]), so that one set is served for them all; each ``gather`` then asks for its own, which that set covers.
    Asked one by one, each request would replace the last, and only the last micro-batch's rows would come
    early: the first forward would wait for the embedding's whole update."""
    on_device = -1 in eng.dev_opt.of or (head_box is not None and eng.arch.tied)  # as ``gather`` reads it
    if len(mbs) > 1 and not on_device:
        eng.early.request(eng.steps_done, torch.cat([mb["input_ids"].flatten() for mb in mbs]))


def gather(eng: Engine, mb: dict, head_box: Box | None = None, ids_dev=None) -> tuple[torch.Tensor, Box]:
    """Embedding rows for a micro-batch, gathered on the host from the fp32 master (no full table moves);
    on the device where the embedding is resident, or streamed and tied (from the head slot, once
    ``head_box`` is ready)."""
    ids = mb["input_ids"]
    H = eng.arch.embed.weight.shape[1]
    if -1 in eng.dev_opt.of:  # resident: gathered on the device from the current weights
        return eng.device_updates.embed_rows(ids), Box(ready=True)
    if head_box is not None and eng.arch.tied:  # Note: [Streamed head]: the head slot holds the embedding
        eng._ready(head_box)
        return eng.device_updates.embed_rows(ids if ids_dev is None else ids_dev, eng.head_slot), Box(ready=True)
    dst = torch.empty(ids.numel() * H, dtype=eng.dtype, device=eng.dev.device)
    master, v = eng.store.units[-1].master, eng.steps_done
    uniq, inv = torch.unique(ids.flatten(), sorted=True, return_inverse=True)  # Note: [Unique rows]
    k = uniq.numel()
    rows_dev = torch.empty(k * H, dtype=eng.dtype, device=eng.dev.device)
    inv_host = inv.pin_memory() if eng.dev.cuda else inv  # torch's caching host allocator: reused once its copy is done

    def spread():  # the h2d stream, after the rows' copy: each token's row (no wait on another stream)
        if eng.dev.cuda:
            rows_dev.record_stream(eng.dev.h2d)  # made on the driver's stream, last read here
        inv_dev = inv_host.to(eng.dev.device, non_blocking=True)
        torch.index_select(rows_dev.view(k, H), 0, inv_dev, out=dst.view(-1, H))

    early = eng.early.request(v, uniq)  # Note: [Early rows] its host update is pending: these rows come first

    def rows():
        if not early:
            return master.view(-1, H).index_select(0, uniq).flatten()
        if not eng.early.ready(v):
            eng.io.wait_update(-1, "fwd", lambda: eng.early.wait(v))  # traced as a load's wait
        return eng.early.take(uniq, v, master).flatten()

    box = eng.io.load(-1, rows_dev, [(-1, rows, 0)], Box(ready=True), "fwd", 0 if early else v, then=spread)
    return dst.view(*ids.shape, H), box


def backward(eng: Engine, mbs, st: dict, gs: list) -> Box:
    """Compute stream: the embedding's backward from the first layer's input gradients ``gs``; its rows'
    gradients go to the device's update, the streamed head group or the host grad slab. Returns the Box
    of the embedding's grad norm, which lands after every gradient the unpacker took."""
    dev, rec = eng.dev, eng.rec
    tok = rec.cuda_begin("compute", "embed_bwd", -1, "bwd", 0, dev.compute)
    dE = []
    for m, h0 in enumerate(st["h0"]):
        torch.autograd.backward(h0, gs[m])
        dE.append(st["E"][m].grad.flatten())
    dE = torch.cat(dE) if len(dE) > 1 else dE[0]  # compute dtype: the host casts rows as it adds them
    ids = torch.cat([mb["input_ids"].flatten() for mb in mbs])
    if not eng.pass_.final:  # Note: [Passes] in passes.py: they wait on the device for the final pass
        eng.carry.keep_rows(dE, ids)
        rec.cuda_end(tok, dev.compute)
        return Box(ready=True)
    dE, ids = eng.carry.all_rows(dE, ids)  # every pass's, in order, as one pass's micro-batches
    if eng.dp is not None:  # every rank's rows and ids, in rank order (Note: [Data parallel])
        eng.device_updates.check_before_sum(-1, dE)  # a resident embedding's state verdict: every rank's (Note:
        dE, ids = eng.dp.rows(dE), eng.dp.ids  # [State verdicts] in distributed.py)
    du = eng.device_updates
    if -1 in eng.dev_opt.of:
        dE = dE.float()
        du.embed_grads(ids, dE)
        rec.cuda_end(tok, dev.compute)
        done = dev.record(dev.compute)
        landed = eng.io.grads(-1, dE, [], done, "bwd")[1]  # norm only
        du.landed(-1, eng.ocfg.lr_at(eng.steps_done), done)
        return landed
    if du.head_streamed and eng.arch.tied:  # Note: [Streamed head]: the rows' gradients stay here
        if eng.dp is None:
            ids = torch.cat([x.flatten() for x in st["ids"]])  # on the device already (_small_inputs; one pass)
        du.embed_grads(ids, dE.float(), eng.head_gslot)
        rec.cuda_end(tok, dev.compute)
        done = dev.record(dev.compute)
        du.landed(-1, eng.ocfg.lr_at(eng.steps_done), done)  # its norm counts in the verdict
        eng.head_gbox = du.stream_head(eng.head_gslot, done, eng.ocfg.lr_at(eng.steps_done),
                                       eng.head_slot, eng.steps_done)
        return du.norms[-1]  # its norm, on the unpacker: after every gradient it took has landed
    rec.cuda_end(tok, dev.compute)
    done = dev.record(dev.compute)
    if eng._dE_host is None or eng._dE_host.numel() < dE.numel():
        eng._dE_host = None  # its host RAM goes back before the larger one is made
        eng._dE_host = dev.exact_buffer(dE.numel(), dE.dtype)  # pinned: one DMA
    host = eng._dE_host[:dE.numel()]  # free again: the last step's scatter finished before it ended
    return eng.io.grads(-1, dE, [(0, dE.numel(), host)], done, "bwd",
                        host_fn=lambda v=eng.steps_done: scatter_grads(eng, ids, host, dE, v))[1]


def scatter_grads(eng: Engine, ids: torch.Tensor, dE: torch.Tensor, keepalive, version: int) -> float:
    """Host: scatter the embedding rows' gradients into the fp32 grad slab, or the store's touched rows (Note:
    [Embedding rows] in host/embed_grad.py); returns its L2 norm."""
    unit = eng.store.units[-1]
    H = eng.arch.embed.weight.shape[1]
    # the last step's update of the embedding reads this slab: a forward on early rows did not wait for it
    # (Note: [Early rows]); a tied head's gradients come in after the head's load, which did
    eng.adam.wait_version(-1, version)
    with eng.rec.span("host-unpack", "embed_grad", -1, "bwd", dE.numel() * dE.element_size()):
        rows = dE.view(-1, H)
        pad = eng.arch.embed.padding_idx
        if pad is not None:
            rows[ids == pad] = 0  # nn.Embedding gives padding_idx no gradient
        if eng.store.rows is not None:
            return float(grad_norm(eng.store.rows.scatter(ids, rows)))
        grad = unit.grad.view(-1, H)
        if not eng.arch.tied and eng._embed_rows is not None:
            grad.index_fill_(0, eng._embed_rows, 0)  # only rows an earlier step touched are non-zero
        for a, b in chunks(rows.shape[0], 1 << 16):  # fp32 rows a slice at a time (512K x H would be 7 GiB)
            grad.index_add_(0, ids[a:b], rows[a:b].float())
        if eng.arch.tied:  # the head's gradient landed here, whole: every row counts
            return float(grad_norm(unit.grad))
        eng._embed_rows = touched = torch.unique(ids)
        return float(grad_norm(grad.index_select(0, touched).flatten()))  # the other rows are zero


def early_rows(eng: Engine, unit: int, step: int, lr: float, grad_scale: float, last: bool = False) -> bool:
    """Worker, before ``unit``'s update of step ``step``: serve the embedding rows the next forward
    asked for (Note: [Early rows]), waiting for the request where ``last`` (no other unit left to update);
    False where this process does not update it on the host."""
    if (unit != -1 or -1 in eng.dev_opt.of or -1 in eng.dev_opt.streamed or not eng.store.owns(-1)
            or eng.store.units[-1].compact is not None):  # compact moments: no row-wise update
        return False

    def rows(ids):
        with eng.rec.span("host-adam", "adam-rows", -1, "optim"):
            return eng.optim.updated_rows(-1, ids, eng.early.width, lr, grad_scale)
    return eng.early.serve(step + 1, rows, wait=last)
