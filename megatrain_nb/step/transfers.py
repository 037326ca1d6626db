"""Host <-> device movement of one step: weights in, gradients out, on their own streams and threads.

Owns: the CUDA streams and the event helpers (``Streams``), the staging pools (pinned on CUDA,
plain on the CPU, where the same code runs and copies complete at once), the packer thread (casts
fp32 masters into staging and enqueues H2D copies, or one DMA from a pinned copy), the unpacker
thread (enqueues D2H copies of a grad slot, moves them into the host grad slab, then tells the Adam
worker) and the writer thread (a "device" unit's state back, Note: [State write-backs]). Every host
wait here happens in a worker thread, but ``upload``'s: between steps the driver brings the masters of
groups made resident in through the idle weight staging (Note: [Arrivals] in device_updates.py; their
moments come during the step, through a ``Staging`` of their own, late_moments.py); otherwise the
driver only waits on the boxes these methods return.
About 590 lines: the three workers share the staging pools (``Staging``), the chunking and the delay hooks, the
packer's early loads (Note: [Early state] in device_updates.py) are its own waits filled, and the
scalar reads share the unpacker (Note: [Mapped reads]).
Does not own: what to load when (schedule.py, engine.py), compute, or the optimizer's arithmetic.
"""
from __future__ import annotations

import contextlib
import dataclasses
import threading
import time
import weakref
from typing import Callable

import torch

from ..config import EngineConfig, pinned_budget
from ..machine.longcontext import PARK_CHUNK
from ..host.grad_ring import RingDst
from ..host.host_store import HostStore
from .workers import AdamWorker, Box, Worker


class Streams:
    """The compute, h2d, d2h (and optim, d2h_state) streams and event helpers; every method is a no-op or
    a plain call on the CPU."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        if self.cuda and device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        self.device = device
        self.compute = torch.cuda.Stream(device) if self.cuda else None
        self.h2d = torch.cuda.Stream(device) if self.cuda else None
        self.d2h = torch.cuda.Stream(device) if self.cuda else None
        self.optim = torch.cuda.Stream(device) if self.cuda else None  # resident units' AdamW beside the backward
        self.d2h_state = torch.cuda.Stream(device) if self.cuda else None  # Note: [State write-backs]

    def on(self, stream):
        return torch.cuda.stream(stream) if self.cuda else contextlib.nullcontext()

    def record(self, stream):
        if not self.cuda:
            return None
        ev = torch.cuda.Event()
        ev.record(stream)
        return ev

    @staticmethod
    def wait(stream, event) -> None:  # the stream waits; the CPU does not
        if event is not None:
            stream.wait_event(event)

    def host_buffer(self, n: int, dtype: torch.dtype) -> torch.Tensor:
        return torch.empty(n, dtype=dtype, pin_memory=self.cuda)

    def exact_buffer(self, shape, dtype: torch.dtype) -> torch.Tensor:
        """A host buffer page-locked at its exact size on CUDA (``pinned_exact``), plain on the CPU."""
        return pinned_exact(shape, dtype) if self.cuda else torch.empty(shape, dtype=dtype)


def _unregister(ptr: int) -> None:
    try:
        torch.cuda.cudart().cudaHostUnregister(ptr)
    except Exception:  # interpreter shutdown: the CUDA context may be gone, and the memory with it
        pass


def pinned_exact(shape, dtype: torch.dtype) -> torch.Tensor:
    """Host memory page-locked at its exact size (``cudaHostRegister``), unregistered when the tensor is
    collected. torch's pinned allocator rounds a request up to a power of two (a 3.5 GiB parked input
    takes 4 GiB) and keeps a freed block cached, so a longer context would still find a shorter one's
    buffers in host RAM (longcontext.py, Note: [Device share]). Falls back to that allocator where
    registration fails. Callers free such a buffer only when no copy of it is in flight."""
    t = torch.empty(shape, dtype=dtype)
    nbytes = t.numel() * t.element_size()
    if nbytes == 0:
        return t
    err = torch.cuda.cudart().cudaHostRegister(t.data_ptr(), nbytes, 0)
    if int(getattr(err, "value", err)) != 0:
        torch.cuda.cudart().cudaGetLastError()  # clear it: the next CUDA call must not report it
        return torch.empty(shape, dtype=dtype, pin_memory=True)
    weakref.finalize(t, _unregister, t.data_ptr())
    return t


class _Interface:
    """An object torch.as_tensor reads as CUDA memory (``__cuda_array_interface__``)."""

    def __init__(self, t: torch.Tensor):
        self.__cuda_array_interface__ = {"shape": tuple(t.shape), "typestr": "<f4", "data": (t.data_ptr(), False),
                                         "strides": None, "version": 2}


def mapped(host: torch.Tensor, device) -> torch.Tensor | None:
    """A CUDA tensor over pinned fp32 ``host`` memory (the same addresses: unified addressing), or None
    where that does not work here (checked once: a kernel writes it, the host reads the value back).

    Note: [Mapped reads] the step reads each "device" unit's grad norm (a 4-byte copy out after its
    backward) and, at its end, the last of them; a copy out goes through the copy engine that the state
    write-backs (~0.9 GB each, on another stream) keep busy, and waits behind every one queued before
    it (64 MiB pieces did not let a small read pass). On the H200 (2026-12-02, 3B x 4 under "stream")
    the step so ended 6 ms before the last write-back, 89 ms after its compute. A kernel writing the
    value into mapped host memory does not queue there.
    """
    try:
        with torch.cuda.device(device):
            alias = torch.as_tensor(_Interface(host), device=device)
            if alias.data_ptr() != host.data_ptr():
                return None
            torch.mul(torch.full(host.shape, 1.5, device=device), 1, out=alias)
            torch.cuda.synchronize(device)  # named sync, once at start-up: the probe's write is visible
        ok = bool((host == 1.5).all())
        host.zero_()
        return alias if ok else None
    except (RuntimeError, TypeError, ValueError):
        return None


def chunks(n: int, size: int):
    """(start, end) of consecutive pieces of at most ``size`` elements."""
    for a in range(0, n, size):
        yield a, min(n, a + size)


class Staging:
    """Host buffers (pinned on CUDA) that copies in use in turn, each refilled once its last copy is done."""

    def __init__(self, dev: Streams, n: int, numel: int, dtype: torch.dtype):
        self.dev = dev
        self.bufs = [dev.host_buffer(numel, dtype) for _ in range(n)]
        self.free = [None] * n  # event after which each buffer may be refilled
        self.next = 0

    def take(self) -> tuple[int, torch.Tensor]:
        """The next buffer, once its last copy is done (a host wait), and its index: the caller hands its own
        copy's event to ``release``. One thread at a time (the packer; the driver between steps)."""
        k = self.next
        self.next = (k + 1) % len(self.bufs)
        if self.free[k] is not None:
            self.free[k].synchronize()  # host wait
        return k, self.bufs[k]

    def release(self, k: int, event) -> None:
        self.free[k] = event

    def upload(self, dst: torch.Tensor, src: torch.Tensor, stream) -> None:
        """``src`` (host) into ``dst`` (device, same dtype) on ``stream``. An unpinned ``src`` goes a buffer at
        a time, its bytes copied by the CPU while the last buffer's DMA runs: a pageable copy runs ~7 GB/s on
        the H200 against 43 GB/s for the CPU's copy into pinned memory and 55 for the DMA
        (``../shared/LIMITS.md``)."""
        with self.dev.on(stream):
            if not self.dev.cuda or src.is_pinned():
                dst.copy_(src, non_blocking=True)
                return
            out, inp = dst.view(-1).view(torch.uint8), src.reshape(-1).view(torch.uint8)
            for a, b in chunks(inp.numel(), self.bufs[0].numel() * self.bufs[0].element_size()):
                k, buf = self.take()
                buf = buf.view(torch.uint8)[:b - a]
                buf.copy_(inp[a:b])
                out[a:b].copy_(buf, non_blocking=True)
                self.release(k, self.dev.record(stream))


@dataclasses.dataclass(eq=False)
class PendingLoad:
    """A load for the packer (``Transfers.queue``); one registered with ``allow_early`` may start ahead of its
    place in the packer's order (Note: [Early state] in device_updates.py)."""

    layer: int
    dst: torch.Tensor
    segments: list
    after: Box
    phase: str
    version: int
    op: str
    then: Callable[[], None] | None = None  # on the h2d stream after the copies, before the event (``load``)
    started: bool = False
    event: tuple | None = None  # (the copy's event,) once enqueued


STATE_OUT_CHUNK_BYTES = 0  # a state write-back goes out in copies of at most this many bytes (0: one per slab)


class Transfers:
    """The packer and unpacker threads with their staging buffers."""

    def __init__(self, dev: Streams, store: HostStore, ecfg: EngineConfig, rec, adam: AdamWorker,
                 norm_dev: torch.Tensor, abort: threading.Event):
        self.dev, self.rec, self.adam, self.norm_dev, self.abort = dev, rec, adam, norm_dev, abort
        self.ring = store.ring  # Note: [Gradient ring] in grad_ring.py (None: every unit has a grad slab)
        self.dtype = dtype = ecfg.dtype
        self.delays: dict = {}  # lane -> deliberate delay, for tests that prove ordering (see delay)
        chunk = ecfg.transfer_chunk_bytes // torch.tensor([], dtype=dtype).element_size()
        # Note: [Staging] a fixed pool of transfer_chunk_bytes buffers (pinned on CUDA; plain on the CPU,
        # where the same code runs and copies complete at once): 3/4 for weights in, 1/4 for grads out.
        budget = pinned_budget(ecfg.pinned_budget_bytes, bool(ecfg.cast_on_device or ecfg.pin_store))
        n_chunks = max(4, budget // ecfg.transfer_chunk_bytes)
        n_out = max(2, n_chunks // 4)
        largest = max(u.layout.numel for u in store.units.values())
        self.chunk = min(chunk, -(-largest // 64) * 64)  # no buffer larger than the largest unit
        self.staging = Staging(dev, n_chunks - n_out, self.chunk, dtype)  # weights in (and ``upload``'s)
        self.gstaging = [dev.host_buffer(self.chunk, dtype) for _ in range(n_out)]
        self._gnext = 0
        self.dev_stage = ([torch.empty(self.chunk, dtype=torch.float32, device=dev.device) for _ in range(2)]
                          if ecfg.cast_on_device else [])  # fp32 landing buffers when the device casts
        self.norm_host = dev.host_buffer(norm_dev.numel(), torch.float32)
        self.norm_mapped = mapped(self.norm_host, dev.device) if dev.cuda else None  # Note: [Mapped reads]
        self.update_wait_s = 0.0  # the packer's waits for host updates since the last take_update_wait
        self.loss_host = dev.host_buffer(1, torch.float32)
        self.loss_mapped = mapped(self.loss_host, dev.device) if dev.cuda else None
        self.packer = Worker("host-pack", abort)
        self.unpacker = Worker("host-unpack", abort)
        self.writer = Worker("host-writeback", abort)  # Note: [State write-backs]
        self.early: list[PendingLoad] = []  # loads the packer may run while it waits for a host update (Note: [Early state])
        self._early_lock = threading.Lock()  # the driver adds to ``early``, the packer takes from it
        self._early_ev = None  # the last early copy's event: one at a time ahead of the loads in order
        self.early_runs = 0  # early copies enqueued so far

    def take_update_wait(self) -> float:
        """Seconds loads waited for host AdamW since the last call (Note: [Auto search] in placement.py)."""
        w, self.update_wait_s = self.update_wait_s, 0.0
        return w

    # ---- weights in (packer thread) --------------------------------------------------------
    def load(self, layer: int, dst: torch.Tensor, segments, after: Box, phase: str, version: int,
             op: str = "h2d", then: Callable[[], None] | None = None) -> Box:
        """Copy ``segments`` into ``dst`` once each unit has ``version`` updates and ``after`` is released.

        segments: [(unit, src_fn, dst_offset)]; src_fn() -> the host flat tensor to send. ``then()`` is enqueued
        on the h2d stream after the copies (the embedding's unique rows spread to their tokens: Note: [Unique
        rows] in embedding.py). Returns the box of the "loaded" event on the h2d stream (put once every copy is
        enqueued).
        """
        return self.queue(PendingLoad(layer, dst, segments, after, phase, version, op, then))

    def queue(self, p: PendingLoad) -> Box:
        """Packer, in order: wait for ``p``'s units' updates and its ``after``, then its copy; the box of its
        event. A load that started early (``allow_early``) is not copied again: its event is the box's."""
        def job():
            if not p.started:
                p.started = True  # from here on no wait of this job starts it early
                self._wait_versions(p.layer, p.phase, p.segments, p.version)
                self._start(p)
            return p.event[0]

        return self.packer.submit(job)

    def _start(self, p: PendingLoad) -> None:
        """Packer: ``p``'s copy, once its units and its ``after`` are ready (the slot's release)."""
        p.event = (self._copy_in(p.layer, p.dst, p.segments, p.after.get(), p.phase, p.op, p.then),)

    def _wait_versions(self, layer: int, phase: str, segments, version: int) -> None:
        """Packer: host waits until each unit of ``segments`` has ``version`` updates."""
        for unit, _, _ in segments:
            if self.adam.version[unit] < version:  # host wait: the unit's last update
                self.wait_update(layer, phase, lambda u=unit: self.adam.wait_version(u, version),
                                 ready=lambda u=unit: self.adam.version[u] >= version)

    def _copy_in(self, layer: int, dst: torch.Tensor, segments, prev, phase: str, op: str, then=None):
        """Packer: ``segments`` into ``dst`` on the h2d stream after event ``prev``, then ``then()`` there;
        returns the event after."""
        self.delay("host-pack")
        srcs = [(src_fn(), off) for _, src_fn, off in segments]
        nbytes = sum(src.numel() * (src.element_size() if src.is_pinned() else dst.element_size())
                     for src, _ in srcs)  # bytes over PCIe: a pinned source goes as it is, fp32 for the device cast
        with self.dev.on(self.dev.h2d):
            self.dev.wait(self.dev.h2d, prev)
            self.delay("h2d")
            tok = self.rec.cuda_begin("h2d", op, layer, phase, nbytes, self.dev.h2d)
            for src, off in srcs:
                if src.dtype == dst.dtype and (src.is_pinned() or src.dtype != self.dtype):  # pinned: one DMA,
                    # no packing; unpinned fp32 state of a lower compute dtype (the CPU): never through its staging
                    dst[off:off + src.numel()].copy_(src, non_blocking=True)
                    continue
                if self.dev_stage and src.is_pinned():  # pinned fp32 master: DMA, then cast on the device
                    for n_chunk, (a, b) in enumerate(chunks(src.numel(), self.chunk)):
                        stage = self.dev_stage[n_chunk % 2][:b - a]  # reuse ordered by the h2d stream itself
                        stage.copy_(src[a:b], non_blocking=True)
                        dst[off + a:off + b].copy_(stage)
                    continue
                for a, b in chunks(src.numel(), self.chunk):
                    k, buf = self.staging.take()
                    buf = buf[:b - a]
                    with self.rec.span("host-pack", "pack", layer, phase, (b - a) * 4):
                        buf.copy_(src[a:b])  # fp32 -> compute dtype while packing
                    dst[off + a:off + b].copy_(buf, non_blocking=True)
                    self.staging.release(k, self.dev.record(self.dev.h2d))
            if then is not None:
                then()
            self.rec.cuda_end(tok, self.dev.h2d)
            return self.dev.record(self.dev.h2d)

    def upload(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        """Driver, between steps (the packer idle): ``src`` (host) into ``dst`` (device) on the current stream,
        an unpinned ``src`` through the weight staging (``Staging.upload``): what a unit made resident brings
        in before the step, its master (Note: [Arrivals] in device_updates.py); no host memory more."""
        self.staging.upload(dst, src, torch.cuda.current_stream(self.dev.device) if self.dev.cuda else None)

    def allow_early(self, p: PendingLoad) -> None:
        """Driver: the packer may start ``p`` while it waits for a host update (Note: [Early state]);
        ``queue(p)`` still gives it its place in order."""
        with self._early_lock:
            self.early.append(p)

    def clear_early(self) -> None:
        """Driver, after a failed step: no early load of it starts any more (those in order are abandoned)."""
        with self._early_lock:
            self.early, self._early_ev = [], None

    def _fill(self) -> bool:
        """Packer, while it waits for a host update: start the first early load that needs no wait, if the last
        early copy is done (one at a time: a load in order that becomes ready waits behind one copy at most).
        Returns whether one started."""
        if self._early_ev is not None and not self._early_ev.query():
            return False
        with self._early_lock:
            self.early = todo = [p for p in self.early if not p.started]
        for p in todo:
            if p.after.done and all(self.adam.version[u] >= p.version for u, _, _ in p.segments):
                p.started = True
                self._start(p)
                self._early_ev = p.event[0]
                self.early_runs += 1
                return True
        return False

    def wait_update(self, layer: int, phase: str, wait, ready=None) -> None:
        """Packer: ``wait()`` for a host update that a load needs, traced as a ``wait-update`` span and
        counted in ``update_wait_s`` (what placement "auto" measures, ``placement.Search``). Given
        ``ready()`` (the update is there), early loads fill the wait (Note: [Early state])."""
        t0 = time.perf_counter()
        with self.rec.span("host-pack", "wait-update", layer, phase):
            while ready is not None and self.early and not ready():
                if not self._fill():
                    self.adam.wait_until(ready, timeout=0.002)
            wait()
        self.update_wait_s += time.perf_counter() - t0

    def delay(self, lane: str) -> None:
        """Test hook: a deliberate delay on one stream (GPU cycles) or host worker (seconds)."""
        d = self.delays.get(lane)
        if not d:
            return
        if lane in ("h2d", "d2h", "compute"):
            if self.dev.cuda:
                torch.cuda._sleep(int(d))  # enqueued on the current stream: delays it, not the CPU
        else:
            import time
            time.sleep(d)

    # ---- grads out (unpacker thread) -----------------------------------------------------
    def grads(self, unit: int, src: torch.Tensor, segments, done_event, phase: str,
              host_fn=None, op: str = "d2h", enqueued: Box | None = None, step: int | None = None,
              land: bool = True) -> tuple[Box, Box]:
        """segments: [(src_offset, numel, host dst flat tensor)]; then the Adam worker hears of ``unit``.

        Returns (enqueued, landed): boxes of the copy-out event (the grad slot may be reused after it)
        and of the unit's arrival in host memory, for step ``step`` (None: the newest).
        ``land``: tell the Adam worker (False: an earlier pass's, Note: [Passes] in passes.py).

        Note: [State write-backs] a "device" unit's master and moments (``op="state-out"``, 12 bytes a
        parameter into pinned slabs) go out on a stream and a host thread of their own, lane "d2h-state":
        on the shared d2h stream and unpacker they queued the gradients behind them, and each waits for
        its unit's device update, which waits for its state's copy in. Traced on the H200 (2026-12-02, 3B
        under "stream"), the embedding's row gradients left 110 ms after the backward's last layer at
        batch 4, behind six write-backs, and only then were scattered on the host; the step ends when
        they have landed. No step waits for a write-back; each lands for its own step (``step``; Note:
        [Late write-backs] in device_updates.py).
        ``STATE_OUT_CHUNK_BYTES`` splits each slab's copy: a small copy out on another stream queued behind
        a whole 1.24 GB one (the head group's), and 64 MiB pieces did not let it pass (H200, 2026-12-02: the
        prelude's read-back waited 62-65 ms either way; 3B x 1 / x 4 at 100.4 / 308.9 TFLOPS in pieces,
        98.6 / 315.3 whole). Whole copies stay the default; Note: [Prelude sync] in hf.py removed that read.
        """
        enqueued = Box(self.abort) if enqueued is None else enqueued  # a caller's box: filled here
        state = op == "state-out"
        lane, stream = ("d2h-state", self.dev.d2h_state) if state else ("d2h", self.dev.d2h)

        def job():
            try:
                return copy_out()
            except BaseException as e:
                enqueued.fail(e)
                raise

        def copy_out():
            self.delay("host-unpack")
            segs = [(off, n, self._ring_take(unit, phase) if isinstance(host, RingDst) else host)
                    for off, n, host in segments]  # a ring buffer: waits for a free one (Note: [Gradient ring])
            with self.dev.on(stream):
                self.dev.wait(stream, done_event)
                self.delay("d2h")
                nbytes = sum(n for _, n, _ in segs) * src.element_size()
                tok = self.rec.cuda_begin(lane, op, unit, phase, nbytes, stream)
                pending: list = []
                for off, n, host in segs:
                    if state or (host.dtype == src.dtype and host.is_pinned()):  # DMA, no unpacking: a pinned grad
                        piece = STATE_OUT_CHUNK_BYTES // src.element_size() if state and STATE_OUT_CHUNK_BYTES else n
                        for a, b in chunks(n, max(1, piece)):  # slab; fp32 state (pinned on CUDA), whole or in pieces
                            host[a:b].copy_(src[off + a:off + b], non_blocking=True)
                        continue
                    for a, b in chunks(n, self.chunk):
                        if len(pending) == len(self.gstaging):
                            self._flush(pending.pop(0), unit, phase)
                        buf = self.gstaging[self._gnext][:b - a]
                        self._gnext = (self._gnext + 1) % len(self.gstaging)
                        buf.copy_(src[off + a:off + b], non_blocking=True)
                        pending.append((self.dev.record(self.dev.d2h), buf, host[a:b]))
                if host_fn is None:
                    self.norm_host[unit + 1:unit + 2].copy_(self.norm_dev[unit + 1:unit + 2], non_blocking=True)
                self.rec.cuda_end(tok, stream)
                done = self.dev.record(stream)
            enqueued.put(done)
            for p in pending:
                self._flush(p, unit, phase)
            if done is not None:
                done.synchronize()  # host wait (unpacker): this unit's gradients are in host memory
            if not land:
                return done
            norm = host_fn() if host_fn is not None else float(self.norm_host[unit + 1])
            self.adam.land(unit, norm, step)
            return done

        return enqueued, (self.writer if state else self.unpacker).submit(job)

    def _ring_take(self, unit: int, phase: str):
        """Unpacker: unit ``unit``'s ring buffer; where none is free, the wait is a ``wait-ring`` span (the host
        AdamW is behind: back-pressure, Note: [Gradient ring] in grad_ring.py)."""
        if not self.ring.would_wait(unit):
            return self.ring.take(unit, self.abort)
        with self.rec.span("host-unpack", "wait-ring", unit, phase):
            return self.ring.take(unit, self.abort)

    def _flush(self, item, unit, phase) -> None:
        ev, buf, host = item
        if ev is not None:
            ev.synchronize()  # host wait (unpacker): the chunk arrived in pinned memory
        with self.rec.span("host-unpack", "unpack", unit, phase, buf.numel() * buf.element_size()):
            host.copy_(buf)

    def read_norm(self, unit: int, done) -> Box:
        """Unpacker: ``unit``'s grad norm to the host once ``done`` passed (after every earlier copy-out's landing)."""
        k = slice(unit + 1, unit + 2)
        return self.unpacker.submit(lambda: self._read(self.norm_dev[k], self.norm_host[k], done,
                                                       None if self.norm_mapped is None else self.norm_mapped[k]))

    def read_loss(self, total: torch.Tensor, done, box: Box) -> Box:
        """Unpacker: the loss scalar to the host once ``done`` passed; put into ``box``."""
        return self.unpacker.submit(lambda: box.put(self._read(total.view(1), self.loss_host, done, self.loss_mapped)))

    def _read(self, src: torch.Tensor, host: torch.Tensor, done, alias: torch.Tensor | None = None) -> float:
        """Unpacker: the one-element ``src`` into ``host`` on the d2h stream after ``done``; its value. Given
        ``alias`` (``host`` as the device sees it, Note: [Mapped reads]) a kernel writes it, not a copy."""
        with self.dev.on(self.dev.d2h):
            self.dev.wait(self.dev.d2h, done)
            if alias is not None:
                torch.mul(src, 1, out=alias)  # SMs write host memory: x * 1 keeps every value, -0.0 and NaN too
            else:
                host.copy_(src, non_blocking=True)
            ev = self.dev.record(self.dev.d2h)
        if ev is not None:
            ev.synchronize()  # host wait (unpacker): the value
        return float(host[0])

    def drain_quietly(self) -> None:
        self.packer.drain_quietly(), self.unpacker.drain_quietly(), self.writer.drain_quietly()

    def close(self) -> None:
        self.packer.close(), self.unpacker.close(), self.writer.close()


class HostChunks:
    """Page-locked host memory for parked recompute-block inputs, in ``PARK_CHUNK`` chunks kept for reuse.

    Note: [Parked chunks] a parked input is split across whole chunks (a 3.5 GiB input at 512K takes 56,
    torch's pinned allocator would take 4 GiB). Chunks are made once (``Streams.exact_buffer``) and
    handed back, not freed, when the placement is chosen again: a longer context reuses the shorter
    one's chunks, and the host RAM they hold counts as free for it (``idle_bytes``), whether or not
    the OS would have got a freed page-locked buffer back in time (on the H200, 512K after 256K found
    the 256K buffers still counted in use).
    """

    def __init__(self, dev: Streams, chunk_bytes: int = PARK_CHUNK):  # >= 16 MB: full PCIe bandwidth per copy
        self.dev, self.chunk_bytes = dev, chunk_bytes
        self.idle: list = []  # chunks no parked input holds
        self.made = 0

    @property
    def idle_bytes(self) -> int:
        return len(self.idle) * self.chunk_bytes

    def take(self, nbytes: int) -> list:
        n = -(-nbytes // self.chunk_bytes)
        got, self.idle = self.idle[:n], self.idle[n:]
        while len(got) < n:
            got.append(self.dev.exact_buffer(self.chunk_bytes, torch.uint8))
            self.made += 1
        return got

    def give(self, chunks: list) -> None:
        self.idle.extend(chunks)


class Offload:
    """Recompute-block inputs parked in host memory (pinned on CUDA) between the forward and the backward.

    With ``EngineConfig.offload_checkpoints`` the device keeps no block inputs: GPU memory stops
    growing with depth (each is B*T*H*dtype bytes). The driver enqueues both directions itself, so
    every device tensor outlives the copy that reads it or writes it:
      park:  d2h waits for compute (the input exists), copies it out; ``record_stream`` keeps its memory
             from reuse until that copy is done, so the driver may drop it at once;
      fetch: h2d waits for compute (the fresh buffer's previous users are done) and for the park, copies
             it back; ``take`` makes compute wait for that copy. The backward fetches one block ahead.
    Each input lands in whole host chunks (``HostChunks``, Note: [Parked chunks]). A (layer, micro-batch)
    keeps its chunks across steps; a step's fetches finish before it ends, so the next park may reuse them.
    """

    def __init__(self, dev: Streams, rec):
        self.dev, self.rec = dev, rec
        self.pool = HostChunks(dev)
        self.host: dict = {}  # (layer, micro-batch) -> (chunks, shape, dtype) of its parked input
        self.parked: dict = {}  # layer -> (d2h event after its copies, number of micro-batches)
        self.fetched: dict = {}  # layer -> (device tensors, h2d event)

    def _chunks(self, layer: int, m: int, like: torch.Tensor) -> list:
        nbytes = like.numel() * like.element_size()
        have = self.host.get((layer, m), ([], None, None))[0]
        if len(have) * self.pool.chunk_bytes < nbytes:
            have = have + self.pool.take(nbytes - len(have) * self.pool.chunk_bytes)
        self.host[(layer, m)] = (have, like.shape, like.dtype)
        return have

    def park(self, layer: int, hs: list) -> None:
        """Driver: copy layer ``layer``'s input (one tensor per micro-batch) to the host, asynchronously."""
        dev = self.dev
        ready = dev.record(dev.compute)
        with dev.on(dev.d2h):
            dev.wait(dev.d2h, ready)
            tok = self.rec.cuda_begin("d2h", "park", layer, "fwd", sum(h.numel() * h.element_size() for h in hs), dev.d2h)
            for m, h in enumerate(hs):
                h = h.contiguous()
                flat = h.view(-1).view(torch.uint8)
                for chunk, (a, b) in zip(self._chunks(layer, m, h), chunks(flat.numel(), self.pool.chunk_bytes)):
                    chunk[:b - a].copy_(flat[a:b], non_blocking=True)
                if dev.cuda:
                    h.record_stream(dev.d2h)  # its memory is not reused before this copy ends
            self.rec.cuda_end(tok, dev.d2h)
            self.parked[layer] = (dev.record(dev.d2h), len(hs))

    def fetch(self, layer: int) -> None:
        """Driver: start copying layer ``layer``'s parked input back to fresh device tensors."""
        dev = self.dev
        if layer in self.fetched:
            return
        parked, n = self.parked.pop(layer)
        held = [self.host[(layer, m)] for m in range(n)]
        with dev.on(dev.compute):
            dsts = [torch.empty(shape, dtype=dtype, device=dev.device) for _, shape, dtype in held]
            free = dev.record(dev.compute)  # the memory's previous users on compute are done after this
        with dev.on(dev.h2d):
            dev.wait(dev.h2d, free)
            dev.wait(dev.h2d, parked)
            tok = self.rec.cuda_begin("h2d", "unpark", layer, "recompute", sum(d.numel() * d.element_size() for d in dsts),
                                      dev.h2d)
            for d, (chunks_, _, _) in zip(dsts, held):
                flat = d.view(-1).view(torch.uint8)
                for chunk, (a, b) in zip(chunks_, chunks(flat.numel(), self.pool.chunk_bytes)):
                    flat[a:b].copy_(chunk[:b - a], non_blocking=True)
            self.rec.cuda_end(tok, dev.h2d)
            self.fetched[layer] = (dsts, dev.record(dev.h2d))

    def take(self, layer: int) -> list:
        """Driver: the input of layer ``layer`` on the device; the compute stream waits for its copy."""
        self.fetch(layer)
        dsts, ev = self.fetched.pop(layer)
        self.dev.wait(self.dev.compute, ev)
        return dsts

    def reset(self) -> None:
        """After a failed step: forget what it parked or fetched (host buffers stay for reuse)."""
        self.parked.clear(), self.fetched.clear()

    def release(self) -> None:
        """Between steps, when the checkpoints are placed again (more tokens): every parked input's chunks
        go back to the pool, where the new placement counts them as free host RAM (``pool.idle_bytes``)."""
        self.reset()
        for chunks_, _, _ in self.host.values():
            self.pool.give(chunks_)
        self.host.clear()
