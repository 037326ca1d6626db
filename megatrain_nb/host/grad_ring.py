"""A few host buffers that hold each unit's gradients from its copy out until its AdamW has read them.

Owns: the ring's buffers (pinned on CUDA), which unit holds which, the wait for a free one, the spill
buffers of a step whose gradients must all wait at once, and the choice between ring and slabs
(``slab_reason``). Does not own: the copies (``transfers.Transfers.grads`` takes a buffer at one named
point, ``take``), the update (``optim.HostAdamW`` reads ``HostStore.grad_of``), or when a buffer is
released (the Adam worker's ``consumed`` hook, after the unit's update is applied or skipped).

Note: [Gradient ring] without ``grad_clip`` and with one pass a step, each unit's gradients are read by
its AdamW once, soon after they land: no unit needs a gradient slab at rest (2 bytes a parameter in the
compute dtype, bf16 on CUDA). The layers' and head's gradients then go out into ``BUFFERS`` buffers of
the largest such unit's size instead: the copy out of unit ``u`` takes a free buffer (the unpacker thread
holds the copy back until one is free), the Adam worker reads it there and hands it back once ``u``'s
update is applied or skipped. Ownership: from ``take`` to ``release`` a buffer is its unit's; nothing
else writes it, and the unit's next copy out comes only after its update (the next step's forward waited
for that update). Back-pressure: if the host AdamW falls behind, the unpacker waits for a buffer
(a ``wait-ring`` span on lane "host-unpack"), so the grad slot is not freed, so the backward waits for the
slot: the device never runs more than the ring ahead of the host. No deadlock: every buffer taken
belongs to a unit that has landed (the unpacker takes one at a time, after the last one's landing), and
an ungated worker updates every landed unit without waiting for any other.
A step that needs every gradient at once (an "auto" placement's trial step is gated; "auto"'s passes
keep each unit's gradients over passes) takes ``spill`` buffers beyond the ring (plain host memory, kept
while the steps after it spill too, dropped by the first that does not): that step's host RAM peaks as slabs
would, and ``spilled`` counts them.
"auto" enters a trial only where the host has room for that (``spill_bytes`` within ``host_available``,
the ``host_memory`` budget included); elsewhere its search keeps "activations first" and says why
(``Session.placement``): a host that holds the store without slabs may not hold them for one step.
The embedding's gradient keeps its fp32 slab: rows' gradients are scattered into it (``embedding.py``).
"""
from __future__ import annotations

import threading
import time

import torch

BUFFERS = 3
"""Buffers in the ring: one being read by AdamW, one landing, one for the next copy out."""


def slab_reason(*, enabled: bool, grad_clip, overlap_optimizer: bool, nonfinite: str, pass_batch_size,
                shared: bool) -> str | None:
    """Why gradients must wait in per-unit slabs, or None where the ring suffices (Note: [Gradient ring]).

    Example:
        >>> slab_reason(enabled=True, grad_clip=None, overlap_optimizer=True, nonfinite="skip",
        ...             pass_batch_size=None, shared=False) is None
        True
    """
    if not enabled:
        return "grad_ring=False"
    if grad_clip is not None:
        return "grad_clip needs every unit's gradient before any update"
    if not overlap_optimizer:
        return "overlap_optimizer=False updates after the whole backward"
    if nonfinite == "raise":
        return "nonfinite='raise' checks every gradient before any update"
    if pass_batch_size is not None:
        return "pass_batch_size: gradients add up over passes in the slabs"
    if shared:
        return "a shared host store: the owner rank reads each unit's gradient from the machine's segment"
    return None


def ring_units(numel: dict[int, int]) -> dict[int, int]:
    """Of unit -> numel, the units whose gradients go through the ring: every one but the embedding (-1)."""
    return {u: n for u, n in numel.items() if u != -1}


def ring_bytes(numel: dict[int, int], dtype_bytes: int, buffers: int = BUFFERS) -> int:
    """Host bytes of the ring for these units' numel (the largest, rounded up to 64 elements, ``buffers`` times)."""
    return buffers * _width(ring_units(numel)) * dtype_bytes


def spill_bytes(numel: dict[int, int], dtype_bytes: int) -> int:
    """Host bytes a step that holds every ring unit's gradients at once takes beyond the ring (at most)."""
    return sum(ring_units(numel).values()) * dtype_bytes


def _width(numel: dict[int, int]) -> int:
    return -(-max(numel.values()) // 64) * 64


class RingDst:
    """A copy-out destination that is unit ``unit``'s ring buffer, taken when the copy starts."""

    __slots__ = ("unit",)

    def __init__(self, unit: int):
        self.unit = unit


class GradRing:
    """``buffers`` host buffers of the largest ring unit's numel, lent to one unit at a time."""

    def __init__(self, numel: dict[int, int], dtype: torch.dtype, *, buffers: int = BUFFERS, pin: bool = False):
        """
        Args:
            numel: unit -> numel of every unit whose gradients go through the ring.
            dtype: the gradients' dtype (the compute dtype).
            buffers: buffers in the ring (>= 1).
            pin: page-locked (CUDA): the copy out is one DMA into the buffer.
        """
        if buffers < 1:
            raise ValueError(f"buffers={buffers}: a ring needs at least one buffer")
        self.numel, self.dtype = dict(numel), dtype
        width = _width(self.numel)
        self.bufs = [torch.zeros(width, dtype=dtype, pin_memory=pin) for _ in range(buffers)]
        self.free = list(range(buffers))  # indices of free buffers
        self.held: dict[int, torch.Tensor] = {}  # unit -> its buffer's view (numel,)
        self._index: dict[int, int | None] = {}  # unit -> ring index (None: a spill buffer)
        self.cond = threading.Condition()
        self._spill = False
        self._spare: dict[int, torch.Tensor] = {}  # unit -> its spill buffer, kept while spill steps follow
        self.waits = 0  # copies out that waited for a free buffer (back-pressure), since construction
        self.wait_s = 0.0
        self.spilled = 0  # spill buffers taken, since construction

    @property
    def nbytes(self) -> int:
        """Host bytes of the ring's buffers, and of spill buffers kept for the next spill step."""
        with self.cond:
            spare = sum(b.numel() * b.element_size() for b in self._spare.values())
        return sum(b.numel() * b.element_size() for b in self.bufs) + spare

    @property
    def spill(self) -> bool:
        """This step's gradients must all wait at once: ``take`` never waits for the ring (set per step).
        Spill buffers released are kept for the next step while it spills too ("auto"'s passes: every step,
        allocated once, not faulted in afresh each step), and dropped by the first step that does not."""
        return self._spill

    @spill.setter
    def spill(self, on: bool) -> None:
        with self.cond:
            self._spill = bool(on)
            if not on:
                self._spare.clear()

    def would_wait(self, unit: int) -> bool:
        """Whether ``take(unit)`` would wait now (for the caller's trace span)."""
        with self.cond:
            return unit not in self.held and not self.free and not self._spill

    def take(self, unit: int, abort: threading.Event | None = None) -> torch.Tensor:
        """The buffer unit ``unit``'s gradients go into: the one it holds already (an earlier pass's), a free one
        (waiting for one if none is: back-pressure), or with ``spill`` set a new plain one.
        Raises ``workers.Aborted``-like RuntimeError where ``abort`` is set while it waits."""
        n = self.numel[unit]
        with self.cond:
            if unit in self.held:
                return self.held[unit]
            t0 = None
            while not self.free and not self._spill:
                if abort is not None and abort.is_set():
                    raise RingAborted("step abandoned while waiting for a gradient buffer")
                t0 = t0 or time.perf_counter()
                self.cond.wait(0.05)
            if t0 is not None:
                self.waits += 1
                self.wait_s += time.perf_counter() - t0
            if self.free:
                k = self.free.pop(0)
                view = self.bufs[k][:n]
            else:
                k, view = None, self._spare.pop(unit, None)
                if view is None:
                    view = torch.empty(n, dtype=self.dtype)
                self.spilled += 1
            self.held[unit], self._index[unit] = view, k
            return view

    def get(self, unit: int) -> torch.Tensor:
        """The buffer unit ``unit`` holds (its landed gradients)."""
        with self.cond:
            if unit not in self.held:
                raise RuntimeError(f"unit {unit} holds no gradient buffer: its gradients have not landed, or its "
                                   "update already read them (Note: [Gradient ring])")
            return self.held[unit]

    def release(self, unit: int) -> None:
        """Unit ``unit``'s update read its gradients (or was skipped): its buffer may be refilled. No-op where it
        holds none (a unit the device updated)."""
        with self.cond:
            if unit not in self.held:
                return
            view = self.held.pop(unit)
            k = self._index.pop(unit)
            if k is not None:
                self.free.append(k)
            elif self._spill:
                self._spare[unit] = view
            self.cond.notify_all()

    def reset(self) -> None:
        """After a failed step, once no copy into a buffer is in flight: every buffer is free."""
        with self.cond:
            self.held.clear(), self._index.clear(), self._spare.clear()
            self.free = list(range(len(self.bufs)))
            self.cond.notify_all()


class RingAborted(RuntimeError):
    """A step was abandoned while its copy out waited for a ring buffer."""
