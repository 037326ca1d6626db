"""Whether a unit's optimizer state can take an AdamW step: a finite master and moments, ``exp_avg_sq >= 0``.

Owns: ``state_ok``, ``slabs_ok`` (fp32 or compact slabs) and ``finite`` (tensors on any device; a 0-dim bool, no
host sync), ``unit_ok`` (a host store unit, fp32 or compact moments; a Python bool), and ``Checked`` and
``Verdicts`` (which host units passed, which resident units' verdicts hold, and were written since by their own
updates alone, Note: [Checked state]).
Does not own: when the check runs (the Adam worker's ``guard`` at each host unit's landing, workers.py; a
resident unit's on the device, ``DeviceUpdates.check_state``), nor what a failed check does (the step is
skipped as for a non-finite gradient).

Note: [Non-finite state] with finite gradients, AdamW writes non-finite weights only from a state that is
already bad: a negative ``exp_avg_sq`` (``sqrt`` gives NaN), or a NaN / inf in the master or either moment
(a corrupt checkpoint, a slab written by hand, an earlier overflow). The update cannot be undone once
written, so each host unit is checked before it is updated: when its gradients land (the unpacker thread,
beside the Adam worker's updates of earlier units; its previous update is done, as the forward waited for
it), and a bad unit lands with a NaN norm: the step is skipped and reported exactly like a non-finite
gradient (Note: [Non-finite gradients] in docs/engine.md). The check reads the unit's state once (12 bytes
a parameter for fp32 moments; the master and the block scales for compact ones, whose codes always decode
to finite values): measured on the 2-core test host at about half of one fused AdamW update's time
(16M parameters: 7.3 ms against 13.9 ms), off the Adam worker's thread. A sum is finite exactly when
every term is, barring an overflow of the sum itself, which a second, exact test then settles.
A resident unit's state is checked on the compute stream right after its norm is written, and a bad one
writes NaN into that norm before its copy to the host (no sync); a group whose moments are still coming in
(Note: [Late moments]) has only its master checked in that step. A "device" unit's state (placement
"stream") is checked where it arrives, on the optimizer stream, before its update (Note: [Streamed state
check] in device_updates.py; gated steps update those units on the host, checked at landing).

Note: [Checked state] a host unit's state that passed the check and has since been written only by its own
AdamW updates is good still: from a good state, an update with a finite gradient norm writes finite values
(the norm is an fp32 sum of squares, so it is finite only where every gradient's square is: the second
moment cannot overflow; the step the master moves is a few ``lr`` at most, where the master is finite).
So a unit is read again only where something else wrote its state since it passed: ``Checked`` keeps, per
unit, a weak reference to each slab (a slab freed and another made at its address do not match) and torch's
in-place version counter (``Tensor._version``: every in-place op through torch, views' included, advances it;
torch's fused AdamW and our C kernel do not, so that an update leaves the mark as it was). A checkpoint load, a write-back from the device, a split or join of the
master and a slab written by hand (``unit.master[3] = x``) each advance it: the next landing checks again.
Writes torch cannot see (through ``.numpy()`` or raw pointers) are not seen here either; a bad value
written that way shows as a non-finite loss. A resident unit's verdict, computed on the device each step
before, is kept with its group's mark the same way (``Verdicts``; a group whose moments are still coming in is
checked by its master alone, and that verdict is not kept). Measured on the H200 (2026-12-05, 3B x 4, defaults), the
check at every landing read 12 bytes a parameter beside the host AdamW's own traffic: the host's AdamW
ran at 1.72-1.82 G params/s against 2.39 before the check existed, and compute waited 99-129 ms a step
for gradient copies the unpacker, checking, enqueued late.
"""
from __future__ import annotations

import weakref

import torch

from . import compact_state

_INF_BITS = 0x7F800000  # fp32 +inf as int32: every finite non-negative float's bits are below it


def finite(x: torch.Tensor) -> torch.Tensor:
    """0-dim bool: every value of fp32 ``x`` is finite, in one pass. On the device an fp64 sum, which no fp32
    values overflow; on the host an fp32 sum (fp64 ran ~10x slower there), then the exact test where it did."""
    if x.device.type != "cpu":
        return torch.isfinite(x.sum(dtype=torch.float64))  # stays on the device: no sync
    s = torch.isfinite(x.sum())
    if not bool(s):  # host tensor: no sync; rare (a bad value, or a sum past 3.4e38)
        return torch.isfinite(x).all()
    return s


def _nonnegfinite(x: torch.Tensor) -> torch.Tensor:
    """0-dim bool: every value of fp32 ``x`` is in [0, inf): by its bits, one pass (-0.0 counts as negative,
    which AdamW never writes)."""
    if x.numel() == 0:
        return torch.ones((), dtype=torch.bool, device=x.device)
    lo, hi = torch.aminmax(x.view(torch.int32))
    return (lo >= 0) & (hi < _INF_BITS)


def state_ok(master: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor) -> torch.Tensor:
    """Whether fp32 state can take an AdamW step without writing a non-finite value (Note: [Non-finite state]).

    Args:
        master, exp_avg, exp_avg_sq: (n,) fp32 each, any device.
    Returns:
        0-dim bool on their device (computed there: no host sync on CUDA).
    """
    return finite(master) & finite(exp_avg) & _nonnegfinite(exp_avg_sq)


def compact_ok(lay: compact_state.Layout, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor) -> torch.Tensor:
    """Whether compact moments (their slabs, Note: [Compact slab]) decode to finite values, the second >= 0:
    only the block scales and kept fp32 positions can hold a bad value; any code decodes to a map entry."""
    _, ms, m32 = compact_state.parts(exp_avg, lay)
    _, vs, v32 = compact_state.parts(exp_avg_sq, lay)
    return finite(ms) & finite(m32) & _nonnegfinite(vs) & _nonnegfinite(v32)


def slabs_ok(lay: compact_state.Layout | None, master: torch.Tensor, exp_avg: torch.Tensor,
             exp_avg_sq: torch.Tensor) -> torch.Tensor:
    """Whether one unit's state as the host store lays it out can take an AdamW step (Note: [Non-finite state]).

    Args:
        lay: the unit's compact layout (``Unit.compact``), or None for fp32 moments.
        master: (n,) fp32. exp_avg, exp_avg_sq: (n,) fp32, or a compact moment's slab (its words, Note:
            [Compact slab]); any device: the host store's or a streamed-in copy of them.
    Returns:
        0-dim bool on their device (no host sync on CUDA).
    """
    if lay is None:
        return state_ok(master, exp_avg, exp_avg_sq)
    return finite(master) & compact_ok(lay, exp_avg, exp_avg_sq)


def unit_ok(unit) -> bool:
    """Whether a host store unit (``host_store.Unit``) can take an AdamW step (Note: [Non-finite state])."""
    return bool(slabs_ok(unit.compact, unit.master, unit.exp_avg, unit.exp_avg_sq))  # host tensors: no sync


def _slabs(holder) -> tuple:
    return holder.master, holder.exp_avg, holder.exp_avg_sq


def mark(holder) -> tuple | None:
    """Which tensors ``holder`` (a host store unit, or a resident group's device buffers) holds as master and moments,
    and their in-place versions (Note: [Checked state]); None where one has no version counter (an inference-mode
    tensor). Weak references: a tensor freed and another made at its address do not match."""
    try:
        return tuple((weakref.ref(t), t._version) for t in _slabs(holder))
    except (RuntimeError, TypeError):
        return None


def holds(m: tuple | None, holder) -> bool:
    """Whether ``holder`` still holds the very tensors of mark ``m``, none written since but by its own updates."""
    return m is not None and all(ref() is t and v == t._version for (ref, v), t in zip(m, _slabs(holder)))


class Checked:
    """Host units whose state passed ``unit_ok`` and has not been written since but by their own updates
    (Note: [Checked state]); ``ok`` checks only the others."""

    def __init__(self):
        self.marks: dict[int, tuple] = {}  # unit -> its slabs' mark when it last passed
        self.reads = 0  # units read by ``ok`` (what the marks saved shows in tests)

    def ahead(self, units: dict) -> list[int]:
        """Note: [Checked ahead] ``ok`` for each of ``units`` (index -> host store unit) that has no mark, before a
        step begins; returns those that failed (they are read again at their landing, where a failure skips the
        step). Units that passed land with their mark held: nothing is read beside the step's host AdamW.
        After a load, a resume or a slab written by hand, the step's first landings read every such unit
        (12 bytes a parameter for fp32 moments) beside the Adam worker's updates of the earlier ones: on the
        H100 (2026-12-06, 3B x 1 / 4 / 8) the measuring step of ``auto`` then read the host AdamW at 2.41-2.57 G
        params/s where later steps ran 2.75-3.4; the planner, given the slower rate, predicted a longer wait
        for host updates and made more units resident than the host needed (Note: [Auto search] in
        placement.py). Read here, on the driver before the step's clock starts, nothing else runs on the host:
        the same measuring steps then read 2.68-3.36 G params/s (two more leases that day, docs/benchmarks.md)."""
        return [u for u in self.unmarked(units) if not self.ok(u, units[u])]

    def unmarked(self, units: dict) -> list[int]:
        """Those of ``units`` (index -> host store unit) that ``ok`` would read: written since they last passed."""
        return [u for u, unit in units.items() if not holds(self.marks.get(u), unit)]

    def ok(self, u: int, unit) -> bool:
        """Whether host store unit ``unit`` (index ``u``) can take an AdamW step: ``unit_ok``, read only where
        its slabs were written by something other than its own updates since it last passed."""
        if holds(self.marks.get(u), unit):
            return True
        self.reads += 1
        m = mark(unit)  # before the read: a write during it shows at the next landing
        good = unit_ok(unit)
        if good and m is not None:
            self.marks[u] = m
        else:
            self.marks.pop(u, None)
        return good


class Verdicts:
    """Note: [Checked state] on the device: each resident unit's verdict (a 0-dim bool there, which the host never
    reads on the way) kept with its group's mark, and used again while the mark holds. A bad verdict stays: its
    step is skipped, so nothing writes the state, until something else does."""

    def __init__(self):
        self.kept: dict[int, tuple] = {}  # unit -> (its group's mark, its verdict)
        self.reads = 0  # verdicts computed (tests)

    def get(self, unit: int, group, compute) -> torch.Tensor:
        """``unit``'s verdict: ``compute()``'s, made again only where ``group``'s buffers were written since
        by something other than their own updates."""
        hit = self.kept.get(unit)
        if hit is not None and holds(hit[0], group):
            return hit[1]
        self.reads += 1
        m = mark(group)
        ok = compute()
        if m is not None:
            self.kept[unit] = (m, ok)
        return ok
