"""A step's memory: the activation policy chosen from free memory, and the memory counters of its trace.

Owns: which layers keep their activations (``keep_now``, Note: [Long-context memory] in longcontext.py),
lean activations or not where ``lean_activations=None`` (Note: [Lean auto] in lean.py), where a recompute
block's input waits (``parked``), the free device and host memory those choices read (``free``: allocator
bookkeeping and ``psutil``, never a sync), what the last step chose (``policy``), and the device-memory and
host-RSS counters sampled after each layer op (``count``).
Does not own: the memory rules themselves (``longcontext.Checkpoints``, ``lean.auto``: the planner
shares them), parking and fetching (``transfers.Offload``), or the buffers (``Engine.__init__``). The engine
calls ``place_checkpoints`` when a step needs a new policy (``Engine._place_checkpoints``), ``keep_now`` and
``parked`` per layer in its forward, and ``count`` after each layer op.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from ..machine.budget import device_total
from ..machine.longcontext import host_free_bytes, layer_bytes, pinned_bytes
from . import lean

if TYPE_CHECKING:
    from .engine import Engine


def keep_now(eng: Engine, i: int) -> bool:
    """Activation policy for layer i (see EngineConfig.checkpoint_every)."""
    if eng.keep is not None:
        return eng.keep[i]
    if eng.cfg.checkpoint_every is not None:
        return eng.cfg.checkpoint_every == 0
    if not eng.dev.cuda:
        return True  # host memory holds activations on "cpu": keep all
    total = device_total(eng.dev.device, eng.cfg.device_memory)  # the card's, or the budget (Note: [Budgets])
    used = torch.cuda.memory_allocated(eng.dev.device)  # allocator bookkeeping: no sync
    act = eng._act_bytes or eng.ckpts.act  # measured once a layer was kept, else predicted
    return i < eng.ckpts.cap and used + 2 * act + (4 << 30) < eng.cfg.keep_share * total


def place_checkpoints(eng: Engine, mbs) -> None:
    """A new keep policy: ``longcontext.Checkpoints`` predicts this batch's layer bytes and the keep cap;
    where block inputs wait is decided at the forward's first recompute block (``parked``)."""
    from ..machine.shape import act_bytes_per_token, model_shape

    n, d = sum(mb["input_ids"].numel() for mb in mbs), eng.dtype.itemsize
    try:
        s = model_shape(eng.arch.config)
    except (ValueError, KeyError, TypeError):
        s = None  # a shape the planner cannot read: nothing predicted, no cap
    if eng.cfg.lean_activations is None and s:
        choose_lean(eng, s, n, d)
    seq = max(mb["input_ids"].shape[-1] for mb in mbs)
    lb = s and layer_bytes(s, n, d, eng.tiler.rows, act_bytes_per_token(s, d, lean=eng.lean), seq=seq)
    eng._dE_need = pinned_bytes(lb["boundary"]) if lb else 0  # the pinned dE buffer to come (compute dtype)
    eng.offload.release()  # the last placement's parked buffers: their host RAM is free for this one
    if eng._dE_host is not None and eng._dE_host.numel() * eng._dE_host.element_size() < eng._dE_need:
        eng._dE_host = None  # too small for these tokens: a new one comes at the first backward
    # "auto": the residents of the last batch size leave for this one's measuring step (Note: [Placement]);
    # counted as in use, they cut the keep cap (H200, 2026-12-02: 7B x 8 after x 2 kept 6 layers where alone it keeps 24)
    leaving = eng.dev_opt.nbytes if eng.device_updates.mode == "auto" else 0
    eng.ckpts.reset(lb, (lambda: free(eng, leaving)) if eng.dev.cuda else None)


def choose_lean(eng: Engine, s: dict, n: int, d: int) -> None:
    """lean_activations=None: lean for this batch size or not (Note: [Lean auto] in lean.py)."""
    room = None
    if eng.dev.cuda:
        total = device_total(eng.dev.device, eng.cfg.device_memory)  # the card's, or the budget
        used = torch.cuda.memory_allocated(eng.dev.device)  # allocator bookkeeping: no sync
        if eng.device_updates.mode == "auto":
            used -= eng.dev_opt.nbytes  # residents leave for the measuring step of a new batch size
        room = (eng.cfg.keep_share * total - used, total)
    on, why = lean.auto(s, tokens=n, dtype_bytes=d, room=room, tiled=bool(eng.tiler.rows))
    if on != eng.lean:
        lean.prepare(eng.arch, on)
    eng.lean, eng.lean_reason = on, "lean_activations=None (auto): " + ("on: " if on else "off: ") + why


def free(eng: Engine, leaving: int = 0) -> tuple[float, float, float]:
    """(device bytes in use, device bytes in all, host bytes free for parked inputs); ``leaving``: bytes
    in use now that go before the step runs (residents, for a measuring step)."""
    total = device_total(eng.dev.device, eng.cfg.device_memory)  # the card's, or the budget
    have = 0 if eng._dE_host is None else eng._dE_host.numel() * eng._dE_host.element_size()
    return (torch.cuda.memory_allocated(eng.dev.device) - leaving,  # allocator bookkeeping: no sync
            total, host_free_bytes(max(0, eng._dE_need - have), reusable=eng.offload.pool.idle_bytes,
                                   host_memory=eng.cfg.host_memory))


def parked(eng: Engine, i: int, hs: list) -> bool:
    """Whether the input of the recompute block starting at layer i waits in host memory."""
    nbytes = sum(h.numel() * h.element_size() for h in hs)
    return eng.ckpts.parked(i, nbytes, (lambda: free(eng)) if eng.dev.cuda else None)


def policy(eng: Engine) -> dict:
    """What the last step did with its activations (``Session.activations``); empty before a step."""
    if eng.keep is None:
        return {}
    c = eng.ckpts
    parked = sorted(i for i, p in (c.park or {}).items() if p)
    return dict(tokens=eng._keep_tokens, kept_layers=sum(eng.keep), recomputed_layers=eng.L - sum(eng.keep),
                block=c.block, parked_inputs=parked, attention_cached=len(c.cached), device_share=c.share,
                tile_rows=eng.tiler.rows,
                attention=eng.tiler.backend, lean=eng.lean, lean_reason=eng.lean_reason)


def count(eng: Engine) -> None:
    """Counters: device memory by category and host RSS (allocator bookkeeping: no sync)."""
    rec = eng.rec
    if not rec.enabled:
        return
    rec.counter("host_rss_bytes", eng._rss())  # sampled after every layer op
    if not eng.dev.cuda:
        return  # on "cpu" every buffer lives in host RAM: RSS is the whole story
    size = lambda ts: sum(t.numel() * t.element_size() for t in ts)  # noqa: E731
    weights = size(eng.slots + [eng.head_slot])
    grads = size(eng.gslots + [eng.head_gslot])
    resident = eng.dev_opt.nbytes
    rec.counter("device_mem.weights", weights)
    rec.counter("device_mem.grads", grads)
    rec.counter("device_mem.resident", resident)
    rec.counter("device_mem.activations", torch.cuda.memory_allocated(eng.dev.device) - weights - grads - resident)
    late = eng.device_updates.late.staging  # Note: [Late moments]: made at the first group made resident
    rec.counter("pinned_in_use_bytes", size(eng.io.staging.bufs + eng.io.gstaging + (late.bufs if late else [])))
