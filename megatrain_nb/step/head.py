"""The head group's part of a step: its slot's load, and the chunked loss with the head's backward.

Owns: loading the head slot (the head unit's weights, then the tied embedding's, from their host masters
or resident), and the loss: final norm + lm_head + cross-entropy over sequence chunks
(``shape.loss_positions`` sizes them), each chunk's backward at once so that one chunk's logits live at a
time, the global loss under data parallel, and where the head's gradients go (out to the host, or to
the device's update of a streamed head). A step with a loss hook hands each micro-batch to
``hook.LossHook.micro_batch`` instead of the cross-entropy (Note: [Loss hook] in hook.py). Its waits are
the loss's own: the head slot's load, and the last step's copy-out of the head's gradients, both on the
compute stream.
Does not own: the head slot's buffers and boxes (``Engine.__init__`` makes them), the updates
(``device_updates.py``, the Adam worker) or the copies (``transfers.py``). The engine calls ``load`` where
a step or a forward-only pass needs the head (``Engine._load_head``) and ``loss`` once per step, between
the forward and the backward (``Engine._loss``).
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from ..machine.shape import loss_positions
from ..model.binding import grads_into
from .transfers import chunks
from .workers import Box

if TYPE_CHECKING:
    from .engine import Engine


def load(eng: Engine, dst: torch.Tensor | None = None, after: Box | None = None) -> Box:
    """Queue the head slot's load (or ``dst``'s, after ``after``): the head unit, then the tied embedding."""
    L = eng.L
    if L in eng.dev_opt.of:
        return Box(ready=True)  # resident: the head group's buffer is the head slot
    segs = [(L, eng._master(L), 0)]
    if eng.arch.tied:
        segs.append((-1, eng._master(-1), eng.store.units[L].layout.numel))
    return eng.io.load(L, eng.head_slot if dst is None else dst, segs, eng.head_box if after is None else after,
                       "loss", eng.steps_done)


def loss(eng: Engine, hs, n_valid: int, head_box: Box, loss_box: Box, small, hook=None) -> list[torch.Tensor]:
    """Final norm + lm_head + cross-entropy in sequence chunks, each with its own backward; with ``hook``
    (a ``hook.LossHook``), the user's loss over per-token log-probs instead (Note: [Loss hook] in hook.py)."""
    arch, dev, L, lay = eng.arch, eng.dev, eng.L, eng.head_layout
    eng._ready(head_box)
    eng.dev.wait(dev.compute, eng.head_gbox.get())  # last step's head grads were copied out
    res = eng.dev_opt.of.get(L)
    w, gslot = (eng.head_slot, eng.head_gslot) if res is None else (res.w, res.grad)
    tok = eng.rec.cuda_begin("compute", "loss", L, "loss", 0, dev.compute)
    ps = eng.pass_  # Note: [Passes] in passes.py: the head's gradients and the loss add up until the final pass
    if ps.first:
        gslot.zero_()
    params = lay.views(w, requires_grad=True)
    grads_into(params, gslot, lay)
    total = eng.carry.start_loss(dev.device)
    grads = []
    for m, (inputs, h) in enumerate(zip(small, hs)):
        labels = inputs["labels"]
        if hook is not None:  # Note: [Loss hook]: two passes over the chunks, the loss the user's
            positions = loss_positions(eng.cfg.loss_chunk_tokens, h.shape[0])
            g, part = hook.micro_batch(ps.offset + m, arch, params, h, labels, positions)
            grads.append(g)
            total += part
            continue
        g = torch.empty_like(h)
        for a, b in chunks(h.shape[1], loss_positions(eng.cfg.loss_chunk_tokens, h.shape[0])):
            with torch.enable_grad():
                x = h[:, a:b].detach().requires_grad_()
                logits = arch.logits(params, x)
                loss = F.cross_entropy(logits.float().flatten(0, 1), labels[:, a:b].flatten(),
                                       ignore_index=-100, reduction="sum") / n_valid
                loss.backward()
            g[:, a:b] = x.grad
            total += loss.detach()
        grads.append(g)
    if not ps.final:
        eng.carry.loss = total
        eng.rec.cuda_end(tok, dev.compute)
        eng.head_box = Box(ready=True, value=dev.record(dev.compute))  # the next load of the slot follows this
        return grads
    if eng.dp is not None:
        eng.dp.sum_(total, "the loss all-reduce")  # every rank reports the global loss, and skips alike
    if hook is not None:
        hook.reduce(eng.dp)  # its metrics summed over ranks, in the same order on every rank
    n_head = eng.store.units[L].layout.numel
    eng.device_updates.loss_known(total)  # a non-finite loss skips every device update
    eng.rec.cuda_end(tok, dev.compute)
    done = dev.record(dev.compute)
    eng.head_box = Box(ready=True, value=done)  # the next step's head load may overwrite the slot after this
    eng.io.read_loss(total, done, loss_box)
    done = eng._reduced(L, gslot, n_head, done)
    eng._committed = not eng._gated  # ungated: the Adam worker may start updates once the loss arrives
    segs = [(0, n_head, eng.store.grad_dst(L))]  # a ring buffer where it has no slab (Note: [Gradient ring])
    if arch.tied:
        segs.append((n_head, eng.store.units[-1].layout.numel, eng.store.units[-1].grad))
    du = eng.device_updates
    streamed = du.head_streamed  # Note: [Streamed head] no gradient of it goes out
    segs = eng.store.copies_out(L, segs) if res is None and not streamed else []  # resident: norm only
    du.landed(L, eng.ocfg.lr_at(eng.steps_done), done)
    if streamed and not arch.tied:  # its gradients are complete: updated beside the backward, landed by its write-back
        eng.head_gbox = du.stream_head(gslot, done, eng.ocfg.lr_at(eng.steps_done), eng.head_slot,
                                       eng.steps_done)
    else:  # a tied streamed head: only its norm lands here (its update follows the embedding's backward)
        eng.head_gbox, _ = eng.io.grads(L, gslot, segs, done, "loss")
    return grads
