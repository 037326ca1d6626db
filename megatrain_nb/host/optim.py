"""Host AdamW over the store's slabs, one unit at a time, as its gradients land.

Owns: one ``torch.optim.AdamW`` (fused CPU kernel) per unit whose single parameter is the unit's
flat fp32 master slab and whose state *is* the store's moment slabs; the LR schedule; the global
gradient-norm clip factor. The arithmetic is torch's own, so the semantics are exactly
``torch.optim.AdamW``'s (decoupled weight decay, bias correction). A unit with compact moments
(``optimizer_state`` "int8" / "int4") is updated by ``compact_host`` (the C kernel) instead, with the same
hyper-parameters and step count.
``DeviceAdamW`` does the same for units resident on the device (placement.py).
Does not own: when an update runs (the engine and its worker decide), or streams.
"""
from __future__ import annotations

import dataclasses
import math

import torch
from torch.optim.adamw import adamw as _adamw

from . import compact_host, compact_state
from ..config import OptimConfig
from .host_store import HostStore


def grad_norm(t: torch.Tensor) -> torch.Tensor:
    """L2 norm of a flat tensor, as a 0-dim tensor on its device (no sync).

    Note: [Host norms] on the CPU, ``torch.linalg.vector_norm`` of a long fp32 tensor is a serial
    fp32 sum: 5% low at 311M elements (the 3B embedding's grad slab) and single-threaded. Rows of
    4096 reduce in parallel with small sums; their norms are combined in fp64. On CUDA the
    reduction is a tree already.
    """
    if t.device.type != "cpu" or t.numel() <= _ROW:
        return torch.linalg.vector_norm(t, dtype=torch.float32)
    k = t.numel() // _ROW * _ROW
    parts = torch.linalg.vector_norm(t[:k].view(-1, _ROW), dim=1, dtype=torch.float32).double()
    if k < t.numel():
        parts = torch.cat([parts, torch.linalg.vector_norm(t[k:], dtype=torch.float32).double().view(1)])
    return torch.linalg.vector_norm(parts)


_ROW = 4096


def _fused(group: dict, lr: float, p, g, m, v, step: torch.Tensor) -> None:
    """torch's fused AdamW on one fp32 piece of a host slab (and its moments) with ``group``'s betas, eps
    and weight decay; ``step`` (0-dim) is advanced by one first, as ``torch.optim.AdamW.step`` does."""
    _adamw([p], [g], [m], [v], [], [step], fused=True, amsgrad=False, beta1=group["betas"][0],
           beta2=group["betas"][1], lr=lr, weight_decay=group["weight_decay"], eps=group["eps"], maximize=False)


class HostAdamW:
    """AdamW over every unit of a HostStore."""

    chunk_numel = 1 << 24
    """Elements upcast and updated at a time when grads are not fp32 (64 MiB of fp32 scratch). A
    multiple of 64, so that chunks fall on the kernel's vector lanes as a whole slab does (bitwise equal)."""

    rows_numel = 1 << 22
    """Elements of each of ``updated_rows``' copies of the moments and gradients at a time (16 MiB of fp32
    each, kept)."""

    def __init__(self, store: HostStore, cfg: OptimConfig):
        self.store, self.cfg = store, cfg
        self.opts: dict[int, torch.optim.AdamW] = {}
        self._scratch: torch.Tensor | None = None  # (chunk_numel,) fp32: low-precision grads upcast here
        self._rows_bufs: list[torch.Tensor] | None = None  # updated_rows' copies, rows_numel elements each
        self._rows_out: torch.Tensor | None = None  # updated_rows' result, kept: the largest asked for so far
        self._step = torch.zeros(())  # a chunk's step counter (see _update_in_chunks)
        for u, unit in store.units.items():
            p = unit.master
            opt = torch.optim.AdamW([p], lr=cfg.lr, betas=cfg.betas, eps=cfg.eps,
                                    weight_decay=cfg.weight_decay, fused=True)
            opt.state[p] = {"step": store.step_count(u), "exp_avg": unit.exp_avg, "exp_avg_sq": unit.exp_avg_sq}
            self.opts[u] = opt

    def steps_done(self, u: int) -> int:
        return int(self.opts[u].state[self.store.units[u].master]["step"].item())  # host tensor: no sync

    def set_steps_done(self, u: int, n: int) -> None:
        self.opts[u].state[self.store.units[u].master]["step"].fill_(n)

    def update(self, u: int, lr: float, grad_scale: float = 1.0) -> None:
        """One AdamW step on unit ``u`` with its grad slab times ``grad_scale`` (the clip factor)."""
        unit = self.store.units[u]
        opt = self.opts[u]
        opt.param_groups[0]["lr"] = lr
        if u == -1 and self.store.rows is not None:  # the touched rows (Note: [Embedding rows] in embed_grad.py)
            return self._update_in_chunks(unit, None, opt, lr, grad_scale)
        grad = self.store.grad_of(u)  # its slab or its ring buffer (Note: [Gradient ring] in grad_ring.py)
        if unit.compact is not None:
            step = opt.state[unit.master]["step"]
            compact_host.update_host(unit.compact, unit.master, grad, unit.exp_avg, unit.exp_avg_sq, lr=lr,
                                      betas=self.cfg.betas, eps=self.cfg.eps, weight_decay=self.cfg.weight_decay,
                                      step=step + 1, grad_scale=grad_scale)
            step.add_(1)
            return None
        if grad.dtype != torch.float32 or grad_scale != 1.0:
            return self._update_in_chunks(unit, grad, opt, lr, grad_scale)
        unit.master.grad = grad
        try:
            opt.step()
        finally:
            unit.master.grad = None

    def _update_in_chunks(self, unit, g: torch.Tensor | None, opt: torch.optim.AdamW, lr: float,
                          grad_scale: float) -> None:
        """Note: [Chunked upcast] the fused kernel wants fp32 grads. Upcasting a whole bf16 slab
        writes and re-reads 4 bytes/param through DRAM; a chunk of ``chunk_numel`` is still in cache
        when the kernel reads it. Same kernel, same arguments, per chunk: the same numbers. ``g`` None: the
        embedding's touched rows, each chunk made dense (Note: [Embedding rows] in embed_grad.py)."""
        p = unit.master
        state, group = opt.state[p], opt.param_groups[0]
        rows = self.store.rows if g is None else None
        n, c = p.numel(), self.chunk_numel
        pad = 0 if rows is None else 2 * rows.width  # a chunk's rows, from the first it touches to the last
        if self._scratch is None or self._scratch.numel() < min(n, c) + pad:
            self._scratch = torch.empty(min(max(x.master.numel() for x in self.store.units.values()), c) + pad)
        step = state["step"]
        for a in range(0, n, c):
            b = min(n, a + c)
            gs = rows.dense(a, b, self._scratch) if rows is not None else self._scratch[:b - a].copy_(g[a:b])
            if grad_scale != 1.0:
                gs.mul_(grad_scale)
            self._step.copy_(step)  # adamw() adds 1 to each chunk's step: every chunk sees step + 1
            _fused(group, lr, p[a:b], gs, state["exp_avg"][a:b], state["exp_avg_sq"][a:b], self._step)
        step.add_(1)

    def updated_rows(self, u: int, rows: torch.Tensor, width: int, lr: float, grad_scale: float = 1.0) -> torch.Tensor:
        """Rows ``rows`` of unit ``u``'s master (``width`` elements each), fp32 (len(rows), width), as its next
        ``update`` with these arguments will leave them; computed on gathered copies, the slabs untouched
        (Note: [Early rows] in early_rows.py: bitwise the slab's values when ``width`` is a multiple of 64).
        The copies go ``rows_numel`` elements at a time through kept buffers: 30K rows of a 14B table are
        2.5 GB of copies at once, allocated afresh every step. The result is a view of a kept buffer too, which
        the next call overwrites: 0.4-0.6 GB of fresh pages a step were faulted in (zeroed by the kernel) and
        unmapped again, and the rows of one step are never read once the next step's are asked for."""
        unit = self.store.units[u]
        if unit.compact is not None:
            raise ValueError(f"unit {u} has compact moments: its rows cannot be updated apart (the engine serves "
                             "early rows only for an embedding with fp32 moments)")
        held = self.store.rows if u == -1 else None  # Note: [Embedding rows] in embed_grad.py
        if held is not None and width != held.width:
            raise ValueError(f"rows of width {width}: the embedding's are {held.width} wide")
        opt = self.opts[u]
        state, group = opt.state[unit.master], opt.param_groups[0]
        per = max(1, self.rows_numel // width)
        if self._rows_bufs is None or self._rows_bufs[0].numel() < per * width:
            self._rows_bufs = [torch.empty(per * width) for _ in range(3)]  # the moments and gradients
        n = rows.numel() * width
        if self._rows_out is None or self._rows_out.numel() < n:
            self._rows_out = None  # the smaller one goes before the larger one comes
            self._rows_out = torch.empty(n)
        out = self._rows_out[:n].view(-1, width)  # the master's rows: updated in place, piece by piece
        for a in range(0, rows.numel(), per):
            r, p = rows[a:a + per], out[a:a + per]
            m, v, g = (b[:r.numel() * width].view(-1, width) for b in self._rows_bufs)
            for dst, src in ((p, unit.master), (m, unit.exp_avg), (v, unit.exp_avg_sq)):
                torch.index_select(src.view(-1, width), 0, r, out=dst)
            if held is not None:
                held.take(r, out=g)
            else:
                g.copy_(self.store.grad_of(u).view(-1, width).index_select(0, r))
            if grad_scale != 1.0:
                g.mul_(grad_scale)
            _fused(group, lr, p.view(-1), g.view(-1), m.view(-1), v.view(-1), state["step"].clone())  # adamw() adds 1
        return out  # to the copy, as the update will

    def clip_factor(self, norms: dict[int, float]) -> tuple[float, float]:
        """(total norm, factor) from per-unit L2 norms, as ``torch.nn.utils.clip_grad_norm_`` computes them."""
        total = math.sqrt(sum(n * n for n in norms.values()))
        if self.cfg.grad_clip is None:
            return total, 1.0
        return total, min(1.0, self.cfg.grad_clip / (total + 1e-6))


def state_slices(store: HostStore, units: tuple[int, ...], state: torch.Tensor) -> list[tuple]:
    """(unit, master, exp_avg, exp_avg_sq) views of a streamed-in state buffer: each kind's slabs of ``units``
    back to back, masters first (``DeviceUpdates.state_segments`` lays it out the same way)."""
    offs, off = {}, 0
    for attr in ("master", "exp_avg", "exp_avg_sq"):
        for u in units:
            n = getattr(store.units[u], attr).numel()
            offs[u, attr] = state[off:off + n]
            off += n
    return [(u, offs[u, "master"], offs[u, "exp_avg"], offs[u, "exp_avg_sq"]) for u in units]


@dataclasses.dataclass(kw_only=True)
class Resident:
    """One placement group's state in device memory (Note: [Tied head group] in placement.py)."""

    units: tuple[int, ...]
    segs: list[tuple[int, int, int]]  # (unit, start, end) in the group's flat buffers
    w: torch.Tensor  # (numel,) compute dtype: what the layers read
    grad: torch.Tensor | None  # (numel,) compute dtype; None for an untied embedding (rows land in egrad)
    master: torch.Tensor  # (numel,) fp32
    exp_avg: torch.Tensor  # (numel,) fp32
    exp_avg_sq: torch.Tensor  # (numel,) fp32
    egrad: torch.Tensor | None  # (embedding numel,) fp32: the embedding's gradient, as the host keeps it
    steps: dict[int, torch.Tensor]  # unit -> 0-dim fp32 step count on the device (the fused kernel's)

    def seg(self, unit: int) -> tuple[int, int]:
        return next((a, b) for u, a, b in self.segs if u == unit)


def _nbytes(r: Resident) -> int:
    return sum(t.numel() * t.element_size() for t in (r.w, r.grad, r.master, r.exp_avg, r.exp_avg_sq, r.egrad)
               if t is not None)


def _count(n: int, device) -> torch.Tensor:
    """A 0-dim fp32 step count on ``device``, filled there: ``torch.tensor(n, device=...)`` copies from pageable
    memory and waits for the stream, which held each arriving group's uploads behind the last (Note: [Arrivals])."""
    return torch.full((), float(n), device=device)


class DeviceAdamW:
    """AdamW on the device for the units placed "resident": their state stays there between steps.

    Owns each resident group's device buffers (``Resident``), moving them in from the host store and
    back (``add``, ``write_back``, ``remove``), and their update. Same arithmetic as ``HostAdamW``:
    torch's fused AdamW kernel with the same hyper-parameters and per-unit step counts, gradients
    upcast to fp32 and multiplied by the clip factor first, so on the CPU the numbers are equal.
    Does not own: when updates run or what is resident (the engine applies ``placement.choose``).
    """

    poison: float | None = None
    """Test hook: a value each new group buffer is filled with instead of being left unset (NaN proves that
    nothing reads a buffer before it is written, whatever the allocator hands out)."""

    def __init__(self, store: HostStore, host: HostAdamW, cfg: OptimConfig, device: torch.device, dtype: torch.dtype):
        self.store, self.host, self.cfg, self.device, self.dtype = store, host, cfg, device, dtype
        self.groups: dict[tuple[int, ...], Resident] = {}
        self.of: dict[int, Resident] = {}  # unit -> its group
        self.streamed: dict[int, torch.Tensor] = {}  # unit placed "device" -> its step count on the device
        self.nbytes = 0  # device bytes of every resident group's buffers (kept as groups come and go)

    def add(self, units: tuple[int, ...], upload=None, moments: bool = True) -> Resident:
        """Move a group's state from the host store to the device (the host's last update must be applied).
        ``upload(dst, src)``: how a host tensor goes in (``Transfers.upload``; default a plain copy).
        ``moments=False``: its moment buffers are left unfilled for ``load_moments`` (Note: [Late moments]
        in late_moments.py); nothing may read them before that."""
        put = upload or (lambda dst, src: dst.copy_(src))
        segs, off = [], 0
        for u in units:
            n = self.store.units[u].layout.numel
            segs.append((u, off, off + n))
            off += n
        mk = lambda dt: self._buffer(off, dt)  # noqa: E731
        emb = -1 in units
        r = Resident(units=units, segs=segs, w=mk(self.dtype), grad=None if units == (-1,) else mk(self.dtype),
                     master=mk(torch.float32), exp_avg=mk(torch.float32), exp_avg_sq=mk(torch.float32),
                     egrad=self._buffer(self.store.units[-1].layout.numel, torch.float32) if emb else None,
                     steps={})
        for u, a, b in segs:
            put(r.master[a:b], self.store.units[u].master)
            r.steps[u] = _count(self.host.steps_done(u), self.device)
        if moments:
            self.load_moments(r, put)
        r.w.copy_(r.master)  # fp32 -> compute dtype, as the host's loads cast
        self.groups[units] = r
        self.of.update(dict.fromkeys(units, r))
        self.nbytes += _nbytes(r)
        return r

    def _buffer(self, n: int, dtype: torch.dtype) -> torch.Tensor:
        """A new group buffer of ``n`` elements, unset (``poison``: filled with it)."""
        if self.poison is None:
            return torch.empty(n, dtype=dtype, device=self.device)
        return torch.full((n,), self.poison, dtype=dtype, device=self.device)

    def load_moments(self, r: Resident, put) -> None:
        """A resident group's moments from the host store into its device buffers, on the current stream;
        ``put(dst, src)`` as ``add``'s ``upload``."""
        for u, a, b in r.segs:
            unit = self.store.units[u]
            if unit.compact is None:
                put(r.exp_avg[a:b], unit.exp_avg)
                put(r.exp_avg_sq[a:b], unit.exp_avg_sq)
            else:  # Note: [Resident compact] fp32 moments on the device, as the host's compact ones read
                for k, (slab, out) in enumerate(((unit.exp_avg, r.exp_avg), (unit.exp_avg_sq, r.exp_avg_sq))):
                    words = torch.empty_like(slab, device=self.device)
                    put(words, slab)
                    compact_state.dequantize(words, unit.compact, k, out=out[a:b])  # all of it: Note: [Alignment tail]

    def stream_add(self, u: int) -> None:
        """Unit ``u`` is placed "device": its state streams through, its step count lives here."""
        self.streamed[u] = _count(self.host.steps_done(u), self.device)

    def stream_remove(self, u: int) -> None:
        n = int(self.streamed.pop(u).item())  # .item(): host sync (placement change)
        if self.store.owns(u):  # a shared store's other ranks skip u's updates: their count is stale
            self.host.set_steps_done(u, n)

    def update_streamed(self, units: tuple[int, ...], state: torch.Tensor, grads: list[torch.Tensor], lr: float,
                        found_inf: torch.Tensor | None) -> None:
        """AdamW of "device" units (a layer, or the head group) on the current stream, in place in their
        streamed-in state: one fused call.

        Args:
            state: fp32 on the device: master, exp_avg, exp_avg_sq, each the units' slabs back to back, as the
                host holds them (``state_slices``; a compact moment's slab is its words, Note: [Compact slab]).
            grads: each unit's gradients, compute dtype or fp32 (upcast here).
        """
        segs = state_slices(self.store, units, state)
        flat = [(u, p, m, v, g) for (u, p, m, v), g in zip(segs, grads) if self.store.units[u].compact is None]
        if flat:
            _adamw([x[1] for x in flat], [g if g.dtype == torch.float32 else g.float() for *_, g in flat],
                   [x[2] for x in flat], [x[3] for x in flat], [], [self.streamed[x[0]] for x in flat], fused=True,
                   amsgrad=False, maximize=False, lr=lr, beta1=self.cfg.betas[0], beta2=self.cfg.betas[1],
                   eps=self.cfg.eps, weight_decay=self.cfg.weight_decay, found_inf=found_inf)
        for (u, p, m, v), g in zip(segs, grads):
            lay = self.store.units[u].compact
            if lay is not None:  # its moments came in compact (Note: [Compact slab]); the step advances unless skipped
                step = self.streamed[u]
                step.add_(1 if found_inf is None else 1 - found_inf)
                update = compact_state.update_torch
                if p.is_cuda:
                    from . import compact_cuda  # Triton is imported on the device's first compact update only

                    if compact_cuda.available():  # one kernel instead of ~30 passes a chunk
                        update = compact_cuda.update
                update(lay, p, g, m, v, lr=lr, betas=self.cfg.betas, eps=self.cfg.eps,
                       weight_decay=self.cfg.weight_decay, step=step, found_inf=found_inf)

    def write_back(self, units: tuple[int, ...] | None = None) -> None:
        """Copy master, moments and step counts of resident groups (``None``: all) into the host store.

        The caller makes sure the device's updates are done (a synchronize on CUDA): these copies
        read the buffers on the current stream.
        """
        if units is None:
            for u, step in self.streamed.items():  # "device" units: their state is on the host already
                if self.store.owns(u):  # only the owner updated it (Note: [Shared host store])
                    self.host.set_steps_done(u, int(step.item()))
        for key in list(self.groups) if units is None else [units]:
            r = self.groups[key]
            for u, a, b in r.segs:
                unit = self.store.units[u]
                unit.master.copy_(r.master[a:b])
                if unit.compact is None:
                    unit.exp_avg.copy_(r.exp_avg[a:b])
                    unit.exp_avg_sq.copy_(r.exp_avg_sq[a:b])
                else:
                    self._write_compact(unit, r.exp_avg[a:b], r.exp_avg_sq[a:b])
                self.host.set_steps_done(u, int(r.steps[u].item()))  # .item(): host sync (write-back only)
                self.store.refresh_shadow(u)

    def _write_compact(self, unit, m: torch.Tensor, v: torch.Tensor) -> None:
        """Note: [Resident compact] a resident unit whose host moments are compact keeps fp32 moments on the
        device (its bytes are counted as fp32's); a write-back quantizes them into the host slabs and sets the
        device's to what those hold, so that a run resumed from the write-back continues bit-exactly as this one."""
        for k, (slab, dev) in enumerate(((unit.exp_avg, m), (unit.exp_avg_sq, v))):
            packed = torch.zeros(slab.numel(), dtype=torch.float32, device=self.device)
            compact_state.quantize_into(packed, unit.compact, k, dev)
            compact_state.dequantize(packed, unit.compact, k, out=dev)
            slab.copy_(packed)

    def remove(self, units: tuple[int, ...]) -> None:
        """Write a group back to the host and free its device memory."""
        self.write_back(units)
        r = self.groups.pop(units)
        self.nbytes -= _nbytes(r)
        for u in r.units:
            del self.of[u]

    def update(self, lr: float, grad_scale: float = 1.0, *, groups=None, found_inf: torch.Tensor | None = None) -> None:
        """One AdamW step on resident groups (``None``: all), on the current stream (enqueued: no host wait).

        Args:
            found_inf: 0-dim fp32 on the device; 1.0 skips the update (the fused kernel's own flag: the
                step count is not advanced either), so a non-finite gradient needs no host decision.
        """
        group = dict(lr=lr, beta1=self.cfg.betas[0], beta2=self.cfg.betas[1], eps=self.cfg.eps,
                     weight_decay=self.cfg.weight_decay, found_inf=found_inf)
        for r in (self.groups.values() if groups is None else [self.groups[g] for g in groups]):
            for u, a, b in r.segs:
                g = r.egrad if u == -1 else r.grad[a:b].float()  # fp32 grads: a copy when low precision
                if grad_scale != 1.0:
                    g.mul_(grad_scale)  # in place: the grads are rebuilt from zero every step
                _adamw([r.master[a:b]], [g], [r.exp_avg[a:b]], [r.exp_avg_sq[a:b]], [], [r.steps[u]],
                       fused=True, amsgrad=False, maximize=False, **group)
            r.w.copy_(r.master)
