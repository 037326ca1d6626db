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
update is applied or skipped. Where one unit is larger than all others (an untied head: 545M elements
beside 7B's 233M a layer, 779M beside 14B's 275M), ``BUFFERS`` buffers of its size would idle most of
the step: the ring is then ``BUFFERS - 1`` buffers of the next largest unit's size and one region of the
largest's, which that unit takes whole and the others use as ``region // width`` buffers of their size
while it is free (``layout``); the others take the plain buffers first. The head is the first unit out
in a backward, when every slot is free (the forward waited for each unit's last update, and a slot is
released before its update counts as done); after it, any ``BUFFERS`` units fit at once as with equal
buffers: no copy waits that would not have waited before, for 1.9 GiB instead of 3.0 at 7B (2.5 instead
of 4.3 at 14B). Were the largest unit a layer, its copy could wait for the region to empty: a wait, never
a deadlock (whoever holds a slot has landed). Ownership: from ``take`` to ``release`` a buffer is its unit's; nothing
else writes it, and the unit's next copy out comes only after its update (the next step's forward waited
for that update). Back-pressure: if the host AdamW falls behind, the unpacker waits for a buffer
(a ``wait-ring`` span on lane "host-unpack"), so the grad slot is not freed, so the backward waits for the
slot: the device never runs more than the ring ahead of the host. No deadlock: every buffer taken
belongs to a unit that has landed (the unpacker takes one at a time, after the last one's landing), and
an ungated worker updates every landed unit without waiting for any other.
Note: [Ring overflow] back-pressure is right where the host has no room; where it has, it stalls the backward
for nothing. On an H100 (2026-12-06, 3B x 4) the host's AdamW fell behind the backward and the copies out waited
42-56 ms a step for the ring's three buffers (318 ms at the unpacker), 1-3% below the slabs that the ring
replaced; with 12 units resident instead of 14-15 the backward waited 428 ms a step (224.1 model TFLOPS against
314.7). So a copy out that finds every buffer held takes an overflow buffer instead (plain host memory, as
a spill buffer: its copy goes through the pinned staging) while ``overflow`` bytes allow, and waits only
beyond that. The engine sets ``overflow`` before each step from what the host can spare (``host_spare``:
within ``host_memory`` where set, else within 90% of the machine's RAM, Note: [Spare host] in
``machine/budget.py``), less ``OVERFLOW_HOST_MARGIN`` (``room``); released overflow buffers stay for
the next step (pooled: no page faults each step) as far as the allowance keeps them. The host holds only
as many as its AdamW is behind: at most the slabs' bytes, and none where it keeps up.
``EngineConfig.grad_ring_overflow=False`` keeps pure back-pressure (a fixed host footprint).
A step that needs every gradient at once (an "auto" placement's trial step is gated; "auto"'s passes
keep each unit's gradients over passes) takes ``spill`` buffers beyond the ring (plain host memory, kept
while the steps after it spill too, dropped by the first that does not) for the units that find every buffer
held: the ring and its spill together peak as slabs would, and ``spilled`` counts them.
"auto" enters a trial only where the host has room for the spill (``spill_bytes``, which leaves out what the
ring's own buffers hold, within ``host_available``,
the ``host_memory`` budget included); elsewhere its search keeps "activations first" and says why
(``Session.placement``): a host that holds the store without slabs may not hold them for one step.
The embedding's gradient is not in the ring: an untied one's is the rows a step touched (Note: [Embedding rows] in
``embed_grad.py``), a tied one's its fp32 slab (the head's gradient lands in it whole).
"""
from __future__ import annotations

import threading
import time

import torch

BUFFERS = 3
"""Buffers in the ring: one being read by AdamW, one landing, one for the next copy out."""
OVERFLOW_HOST_MARGIN = 4 << 30
"""Host bytes the ring's overflow leaves free (Note: [Ring overflow])."""


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


def layout(numel: dict[int, int], buffers: int = BUFFERS) -> tuple[int, int | None, int]:
    """(width, big, region) of a ring for these units' numel (the embedding's, -1, left out), in elements
    rounded up to 64: ``buffers`` buffers of ``width`` where no unit is larger than every other (``big``
    None, ``region`` 0); else ``buffers - 1`` of ``width`` (the next largest) and one ``region`` that unit
    ``big`` takes whole (Note: [Gradient ring]).

    Example:
        >>> layout({-1: 9999, 0: 100, 1: 100, 2: 300})  # an untied head (unit 2) three layers wide
        (128, 2, 320)
        >>> layout({0: 100, 1: 100, 2: 10})
        (128, None, 0)
    """
    units = ring_units(numel)
    big = max(units, key=lambda u: (units[u], u))
    rest = [n for u, n in units.items() if u != big]
    width, region = _round(max(rest, default=units[big])), _round(units[big])
    if region <= width or buffers < 2:
        return region, None, 0
    return width, big, region


def ring_bytes(numel: dict[int, int], dtype_bytes: int, buffers: int = BUFFERS) -> int:
    """Host bytes of the ring for these units' numel (``layout``'s buffers and region)."""
    width, big, region = layout(numel, buffers)
    return ((buffers if big is None else buffers - 1) * width + region) * dtype_bytes


def spill_bytes(numel: dict[int, int], dtype_bytes: int, buffers: int = BUFFERS) -> int:
    """Host bytes a step that holds every ring unit's gradients at once takes beyond the ring (at most): the
    units that find no free slot when they land. Such a step starts with every slot free (the forward waited
    for each unit's last update) and releases none before its end; its units land in the backward's order,
    the head first, then the layers from the last (``GradRing.take`` in that order), so the largest unit (an
    untied head) takes the region and the next ``buffers - 1`` the plain buffers. Fewer bytes where a unit
    does not land on the host at all (one the device updates).

    Example:
        >>> spill_bytes({-1: 9999, 0: 100, 1: 100, 2: 100, 3: 300}, 1)  # the head 3 the region, 2 and 1 the buffers
        100
        >>> spill_bytes({0: 100, 1: 100, 2: 100, 3: 100, 4: 100}, 1)  # tied: 4, 3 and 2 take the three buffers
        200
    """
    units = ring_units(numel)
    width, big, region = layout(units, buffers)
    plain = buffers if big is None else buffers - 1
    pieces = tuple(range(plain, plain + (0 if big is None else region // width)))
    free, spilled = list(range(plain + len(pieces))), 0
    for u in sorted(units, reverse=True):
        got = wanted(u, big, pieces, free)
        if got is None:
            spilled += units[u]
        else:
            free = [k for k in free if k not in got]
    return spilled * dtype_bytes


def wanted(unit: int, big: int | None, region: tuple[int, ...], free: list[int]) -> tuple[int, ...] | None:
    """The free slots ``unit`` takes now: the region's whole for the big unit, else the lowest free slot; None
    where they are not free (``GradRing.take`` waits, ``spill_bytes`` counts a spill)."""
    if unit == big:
        return region if set(region) <= set(free) else None
    return (free[0],) if free else None


def _round(n: int) -> int:
    return -(-n // 64) * 64


class RingDst:
    """A copy-out destination that is unit ``unit``'s ring buffer, taken when the copy starts."""

    __slots__ = ("unit",)

    def __init__(self, unit: int):
        self.unit = unit


class GradRing:
    """Host buffers lent to one unit at a time (``layout``: equal buffers, or equal ones and a region that the
    largest unit takes whole and the others share out while it is free)."""

    def __init__(self, numel: dict[int, int], dtype: torch.dtype, *, buffers: int = BUFFERS, pin: bool = False):
        """
        Args:
            numel: unit -> numel of every unit whose gradients go through the ring.
            dtype: the gradients' dtype (the compute dtype).
            buffers: units whose gradients the ring holds at once (>= 1).
            pin: page-locked (CUDA): the copy out is one DMA into the buffer.
        """
        if buffers < 1:
            raise ValueError(f"buffers={buffers}: a ring needs at least one buffer")
        self.numel, self.dtype = dict(numel), dtype
        width, self.big, region = layout(self.numel, buffers)
        plain = buffers if self.big is None else buffers - 1
        self.bufs = [torch.zeros(width, dtype=dtype, pin_memory=pin) for _ in range(plain)]  # the storage
        if self.big is not None:
            self.bufs.append(torch.zeros(region, dtype=dtype, pin_memory=pin))
        # slots, each ``width`` wide: the plain buffers first (a unit takes the lowest free one, so the region
        # stays free for the big unit where it can), then the region's pieces
        self.slots = self.bufs[:plain] + ([] if self.big is None else list(self.bufs[-1][:region // width * width].split(width)))
        self.region = tuple(range(plain, len(self.slots)))  # the slots the big unit takes at once
        self.free = list(range(len(self.slots)))  # indices of free slots, ascending
        self.held: dict[int, torch.Tensor] = {}  # unit -> its buffer's view (numel,)
        self._index: dict[int, tuple[int, ...] | None] = {}  # unit -> the slots it holds (None: a spill buffer)
        self.cond = threading.Condition()
        self._spill = False
        self._spare: dict[int, torch.Tensor] = {}  # unit -> its spill buffer, kept while spill steps follow
        self.waits = 0  # copies out that waited for a free buffer (back-pressure), since construction
        self.wait_s = 0.0
        self.spilled = 0  # spill buffers taken, since construction
        self.spilled_numel = 0  # their elements
        self.overflow = 0  # bytes of overflow buffers the ring may hold at once (Note: [Ring overflow]; ``room``)
        self._over: dict[int, torch.Tensor] = {}  # unit -> the overflow buffer it holds (a pooled tensor)
        self._pool: list[torch.Tensor] = []  # overflow buffers released, kept for the next take
        self.overflowed = 0  # copies out that took an overflow buffer instead of waiting, since construction
        self.overflow_peak = 0  # most bytes of overflow buffers held at once, since construction

    @property
    def nbytes(self) -> int:
        """Host bytes of the ring's buffers, and of spill buffers kept for the next spill step (not the
        overflow's: ``overflow_bytes``)."""
        with self.cond:
            spare = sum(b.numel() * b.element_size() for b in self._spare.values())
        return sum(b.numel() * b.element_size() for b in self.bufs) + spare

    @property
    def overflow_bytes(self) -> int:
        """Host bytes of overflow buffers allocated now, held or pooled (Note: [Ring overflow])."""
        with self.cond:
            return self._allocated() * self.dtype.itemsize

    def room(self, free: int) -> int:
        """Set ``overflow`` from ``free`` host bytes this process may still take for speed (``host_spare``,
        within ``host_memory``): the overflow buffers allocated now plus ``free`` less ``OVERFLOW_HOST_MARGIN``, no
        more than every ring unit's gradients at once. Pooled buffers beyond it are dropped. Returns it."""
        with self.cond:
            size = self.dtype.itemsize
            most = sum(self.numel.values()) * size
            self.overflow = max(0, min(most, self._allocated() * size + free - OVERFLOW_HOST_MARGIN))
            while self._pool and self._allocated() * size > self.overflow:
                self._pool.pop()
            return self.overflow

    def _allocated(self) -> int:
        """Elements of overflow buffers allocated, held or pooled (held under ``cond``)."""
        return sum(b.numel() for b in [*self._over.values(), *self._pool])

    def _overflow_buffer(self, n: int, take: bool = True) -> torch.Tensor | bool | None:
        """A pooled overflow buffer of at least ``n`` elements, else a new one where the allocated ones and it
        stay within ``overflow``; None where neither (held under ``cond``). ``take=False``: only whether one
        would be given."""
        fits = [k for k, b in enumerate(self._pool) if b.numel() >= n]
        if fits:
            return self._pool.pop(min(fits, key=lambda k: self._pool[k].numel())) if take else True
        if (self._allocated() + n) * self.dtype.itemsize > self.overflow:
            return None
        return torch.empty(n, dtype=self.dtype) if take else True

    def describe(self) -> str:
        """The ring's buffers in words, e.g. "2 buffers of 233,057,792 elements and unit 28's 545,001,472"."""
        plain = len(self.bufs) - (self.big is not None)
        words = f"{plain} buffer{'s' * (plain != 1)} of {self.slots[0].numel():,} elements"
        if self.big is None:
            return words
        return f"{words} and unit {self.big}'s {self.bufs[-1].numel():,} (its {len(self.region)} slots while it is free)"

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
            return (unit not in self.held and not self._spill and wanted(unit, self.big, self.region, self.free) is None
                    and not (self.overflow and self._overflow_buffer(self.numel[unit], take=False)))

    def take(self, unit: int, abort: threading.Event | None = None) -> torch.Tensor:
        """The buffer unit ``unit``'s gradients go into: the one it holds already (an earlier pass's), free slots
        (where there are none, an overflow buffer while ``overflow`` allows, Note: [Ring overflow], else waiting
        for them: back-pressure), or with ``spill`` set a new plain one.
        Raises ``workers.Aborted``-like RuntimeError where ``abort`` is set while it waits."""
        n = self.numel[unit]
        with self.cond:
            if unit in self.held:
                return self.held[unit]
            t0 = over = None
            while (got := wanted(unit, self.big, self.region, self.free)) is None and not self._spill:
                if self.overflow and (over := self._overflow_buffer(n)) is not None:
                    break  # Note: [Ring overflow]: the host has room, the backward need not wait
                if abort is not None and abort.is_set():
                    raise RingAborted("step abandoned while waiting for a gradient buffer")
                t0 = t0 or time.perf_counter()
                self.cond.wait(0.05)
            if t0 is not None:
                self.waits += 1
                self.wait_s += time.perf_counter() - t0
            if got is not None:
                self.free = [k for k in self.free if k not in got]
                view = (self.bufs[-1] if unit == self.big else self.slots[got[0]])[:n]
            elif over is not None:
                self._over[unit] = over
                self.overflowed += 1
                self.overflow_peak = max(self.overflow_peak, sum(b.numel() for b in self._over.values()) * self.dtype.itemsize)
                view = over[:n]
            else:
                view = self._spare.pop(unit, None)
                if view is None:
                    view = torch.empty(n, dtype=self.dtype)
                self.spilled += 1
                self.spilled_numel += n
            self.held[unit], self._index[unit] = view, got
            return view

    def get(self, unit: int) -> torch.Tensor:
        """The buffer unit ``unit`` holds (its landed gradients)."""
        with self.cond:
            if unit not in self.held:
                raise RuntimeError(f"unit {unit} holds no gradient buffer: its gradients have not landed, or its "
                                   "update already read them (Note: [Gradient ring])")
            return self.held[unit]

    def release(self, unit: int) -> None:
        """Unit ``unit``'s update read its gradients (or was skipped): its slots may be refilled. No-op where it
        holds none (a unit the device updated)."""
        with self.cond:
            if unit not in self.held:
                return
            view = self.held.pop(unit)
            got = self._index.pop(unit)
            if got is not None:
                self.free = sorted(self.free + list(got))
            elif unit in self._over:
                self._pool.append(self._over.pop(unit))
            elif self._spill:
                self._spare[unit] = view
            self.cond.notify_all()

    def reset(self) -> None:
        """After a failed step, once no copy into a buffer is in flight: every slot is free."""
        with self.cond:
            self._pool += self._over.values()
            self.held.clear(), self._index.clear(), self._spare.clear(), self._over.clear()
            self.free = list(range(len(self.slots)))
            self.cond.notify_all()


class RingAborted(RuntimeError):
    """A step was abandoned while its copy out waited for a ring buffer."""
