"""The frozen reference model of preference and RL post-training, read from safetensors on disk.

Owns: streaming a model directory's ORIGINAL weights, unit by unit, into one device buffer per
kind of unit (the embedding table, a layer, the head) in the compute dtype, in the form of a
forward pass's weights source (Note: [Weights source] in inference.py); and the bf16 snapshot that gives a
Session built from a config a directory to read (``snapshot``).
Does not own: the forward pass (the caller runs the templates on what ``stream`` yields, as it
does for the policy), the policy's weights, the losses.

Note: [Reference without a copy] a second model in host RAM would cost 2-4 bytes per parameter
beside the 16 of the policy's state. Instead ``stream`` reads the files unit by unit into device
buffers: host memory grows by a ring of staging chunks (on "cpu", plus the unit buffers themselves;
on CUDA those live on the device). The files' pages stay the kernel's page cache, reclaimable, and
are never mapped into this process (Note: [Reference reads]).

Note: [Reference reads] ``safe_open`` maps a file: every page it touches counts in this process's
RSS and faults in again each time the file is opened, and its tensors then copy to the device from
pageable memory, which cannot overlap compute (at 7B on the H200 such a pass took 2.0 s, 0.47x a
training step's tokens/s: docs/benchmarks.md, post-training). So the tensors
whose file dtype is the compute dtype and whose place is a contiguous span (every tensor of a
checkpoint in the compute dtype: ``Session.freeze_reference``'s snapshot, a bf16 HF checkpoint) are
read with ``os.preadv`` straight from the file into a ring of staging chunks, by a pool of reader
threads (the read releases the GIL), and copied to the device on the engine's h2d stream while the
compute stream runs the unit before: the reads of unit u+1 and its copies overlap unit u's compute.
Ordering: a chunk's slot is read into only after the h2d copy out of its last use is done (the reader
thread waits on that copy's event); a unit's device buffer (two for the layers, used in turn) is
written only after the compute stream is done with the unit that used it before (the h2d stream waits
on an event recorded when the caller resumed the generator); the caller's compute waits on the unit's
last copy. Other tensors (another dtype, or a place that is not a span) go through ``put`` from the
map, on the h2d stream after the unit's buffer is free. The header of each file (8 bytes of length,
then JSON: name -> dtype, shape, data offsets) is parsed once, here, since ``safe_open`` does not give
the offsets.
"""
from __future__ import annotations

import contextlib
import json
import os
import shutil
import tempfile
import weakref
from pathlib import Path

import torch

from ..host.host_store import HostStore, put


DTYPES = {"BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32, "F64": torch.float64,
          "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
          "BOOL": torch.bool}
CHUNK = 32 << 20  # bytes of one staging slot: large enough for full-speed reads and copies
SLOTS = {True: 16, False: 2}  # staging slots on CUDA (reads in flight: 512 MiB) and on "cpu" (copies are synchronous)


def header(path: Path) -> tuple[int, dict]:
    """(byte offset of the data, {name: (dtype, shape, begin, end)}) of a safetensors file (Note: [Reference reads])."""
    with open(path, "rb") as f:
        n = int.from_bytes(f.read(8), "little")
        meta = json.loads(f.read(n))
    return 8 + n, {k: (DTYPES.get(v["dtype"]), tuple(v["shape"]), *v["data_offsets"])
                   for k, v in meta.items() if k != "__metadata__"}


def read_into(fd: int, dst: torch.Tensor, offset: int) -> None:
    """Fill ``dst`` (uint8, contiguous, host) with the file's bytes from ``offset``; raises on a short file."""
    view, done = memoryview(dst.numpy()).cast("B"), 0
    while done < len(view):
        got = os.preadv(fd, [view[done:]], offset + done)  # releases the GIL; at most ~2 GiB a call
        if got <= 0:
            raise OSError(f"the reference file ended {len(view) - done} bytes early: it was rewritten or cut after the "
                          "reference was made; call s.freeze_reference() again or reload")
        done += got


class Reference:
    """A model directory's weights streamed as the engine streams the policy's.

    Args:
        path: an HF directory (config.json + model.safetensors or a sharded index) of the same
            architecture as ``store``'s.
        store: the policy's ``HostStore``: its name -> (unit, place) mapping is the one used here.
        owned: a directory to delete when this object is collected (``snapshot``'s temporary one).
    Raises:
        FileNotFoundError: no safetensors in ``path``.
        ValueError: ``path`` holds a tensor the architecture does not have, or lacks one.
    Example:
        >>> for unit, params in s.reference.stream(s.engine, head=True):   # doctest: +SKIP
        ...     ...  # -1: the embedding table; 0..L-1: a layer's named views; L: the head's
    """

    def __init__(self, path: str | os.PathLike, store: HostStore, *, owned: str | None = None):
        self.path = Path(path)
        self.files = HostStore._files(self.path)
        self.arch, self.L = store.arch, store.num_layers
        self.by_unit: dict[int, list] = {u: [] for u in store.order}  # unit -> [(file index, name, place)]
        index = {f: k for k, f in enumerate(self.files)}
        for f, _, name, (u, where) in store.checkpoint_tensors(self.path):  # host_store's own mapping and checks
            self.by_unit[u].append((index[f], name, where))
        self.headers = [header(f) for f in self.files]
        self.layouts = {u: store.units[u].layout for u in range(self.L)}
        self._bufs: dict = {}  # (device, dtype, kind) -> flat buffer, reused pass after pass
        self._fds = [os.open(f, os.O_RDONLY) for f in self.files]  # open for the object's life: no re-opening
        self._pool = None  # reader threads, made at the first pass
        self._free: list = []  # staging slot -> event of the h2d copy out of it, kept across passes (``_ring``)
        self._head_used = None  # event: the compute stream is done with the head buffer (the next pass rewrites it)
        self._finalize = weakref.finalize(self, Reference._release, self._fds, owned)

    @staticmethod
    def _release(fds: list[int], owned: str | None) -> None:
        for fd in fds:
            with contextlib.suppress(OSError):
                os.close(fd)
        if owned is not None:
            shutil.rmtree(owned, True)

    @contextlib.contextmanager
    def _open(self):
        from safetensors import SafetensorError, safe_open

        with contextlib.ExitStack() as stack:
            handles = []
            for f in self.files:
                try:
                    handles.append(stack.enter_context(safe_open(str(f), framework="pt")))
                except SafetensorError as e:
                    raise OSError(f"the reference file {f} can no longer be read ({e}): it was rewritten or cut after "
                                  "the reference was made; call s.freeze_reference() again or reload") from e
            yield handles

    def _buffer(self, kind: str, numel: int, dtype: torch.dtype, device) -> torch.Tensor:
        key = (str(device), dtype, kind)
        if key not in self._bufs or self._bufs[key].numel() < numel:
            self._bufs[key] = torch.zeros(numel, dtype=dtype, device=device)  # padding stays 0
        return self._bufs[key][:numel]

    def _pieces(self, unit: int, dtype: torch.dtype, shift: int = 0):
        """(reads, others) of unit ``unit`` in a buffer of ``dtype``: reads are (file index, file offset, bytes,
        byte offset in the buffer) cut to at most CHUNK bytes; others are (file index, name, place) for ``put``."""
        reads, others = [], []
        size = dtype.itemsize
        for k, name, where in self.by_unit[unit]:
            if shift:  # the tied embedding, placed after the head's norm in the head buffer
                where = where + shift if isinstance(where, torch.Tensor) else (where[0] + shift, where[1])
            base, table = self.headers[k]
            fdtype, shape, a, b = table[name]
            if fdtype != dtype or isinstance(where, torch.Tensor) or tuple(where[1]) != shape:
                others.append((k, name, where))  # cast, scattered, or a wrong shape (put names it)
                continue
            for x in range(0, b - a, CHUNK):
                reads.append((k, base + a + x, min(CHUNK, b - a - x), where[0] * size + x))
        return reads, others

    def _fill(self, flat: torch.Tensor, parts: list, dev, ring: list, free: list, handles) -> None:
        """Driver: enqueue on ``dev``'s h2d stream the copies of ``parts`` (``_pieces``' (reads, others) of one or
        more units) into ``flat`` (the caller has ordered the stream after the buffer's last use); reads go
        through the ring's slots, read by the pool (Note: [Reference reads]); a read that fails raises here."""
        out = flat.view(torch.uint8)
        reads = [r for rs, _ in parts for r in rs]
        slots, n = len(ring), len(reads)

        def read(i):
            k, off, nbytes, _ = reads[i]
            s = i % slots
            if free[s] is not None:
                free[s].synchronize()  # the CPU waits: the h2d copy out of this slot's last use is done
            read_into(self._fds[k], ring[s][:nbytes], off)

        futures = [self._pool.submit(read, i) for i in range(min(slots, n))]
        for i in range(n):
            futures[i].result()
            _, _, nbytes, at = reads[i]
            s = i % slots
            with dev.on(dev.h2d):
                out[at:at + nbytes].copy_(ring[s][:nbytes], non_blocking=True)  # pinned: an async DMA on CUDA
                free[s] = dev.record(dev.h2d)
            if i + slots < n:
                futures.append(self._pool.submit(read, i + slots))
        others = [o for _, os_ in parts for o in os_]
        if others:
            with dev.on(dev.h2d):
                for k, name, where in others:
                    put(flat, where, handles()[k].get_tensor(name), f"{self.files[k].name}:{name}")

    def stream(self, engine, head: bool = True):
        """Driver: yield the reference's weights on the device, as a weights source of a forward-only pass
        (Note: [Weights source] in inference.py): ``(-1, {embedding name: table (V, H)})``, then
        ``(unit, params)`` for layers 0..L-1 as ``Engine.stream_layers`` yields them, then the head
        (unit L: final norm, lm_head or the tied embedding, ``Engine.head_layout``) if ``head``.

        Each unit is read and copied on the engine's h2d stream (Note: [Reference reads]): unit u+1's
        while the caller's compute of unit u runs; the compute stream waits for a unit's copies before
        the unit is yielded, and the buffer a unit used is rewritten only after the compute stream is
        done with it. The embedding table is dropped once the caller resumes past it. Run it on the
        compute stream, under no_grad.

        Args:
            engine: the policy's ``Engine`` (its device, compute dtype, head layout).
            head: also yield the head.
        Yields:
            (unit, {parameter name: tensor on the device}).
        """
        from concurrent.futures import ThreadPoolExecutor

        dev, dtype = engine.dev, engine.dtype
        if self._pool is None:
            self._pool = ThreadPoolExecutor(max_workers=min(SLOTS[dev.cuda], os.cpu_count() or 1),
                                            thread_name_prefix="reference-read")  # a read a core at most
            weakref.finalize(self, self._pool.shutdown, wait=False)
        ring = self._ring(dev)
        with contextlib.ExitStack() as stack:
            opened = []

            def handles():  # the map, only for tensors that are not plain reads
                if not opened:
                    opened.append(stack.enter_context(self._open()))
                return opened[0]

            def load(flat, units, after):
                """Copies of ``units`` ([(unit, shift)]) into ``flat`` after event ``after``; the compute stream
                waits for them."""
                dev.wait(dev.h2d, after)  # the stream waits for the buffer's last reader, not the CPU
                self._fill(flat, [self._pieces(u, dtype, sh) for u, sh in units], dev, ring, self._free, handles)
                dev.wait(torch.cuda.current_stream(dev.device) if dev.cuda else None, dev.record(dev.h2d))

            name = self.arch.embed_name
            table = torch.empty(self.arch.embed.weight.shape, dtype=dtype, device=dev.device)
            load(table.view(-1), [(-1, 0)], None)
            yield -1, {name: table}
            del table  # the rows are gathered: the compute stream's later allocations come after the gather
            n = max(lay.numel for lay in self.layouts.values())
            used = [None, None]  # layer buffer -> event: the compute stream is done with its last unit
            for u in range(self.L):
                lay = self.layouts[u]
                flat = self._buffer(f"layer{u % 2 if dev.cuda else 0}", n, dtype, dev.device)[:lay.numel]
                load(flat, [(u, 0)], used[u % 2])
                yield u, lay.views(flat)
                used[u % 2] = dev.record(torch.cuda.current_stream(dev.device)) if dev.cuda else None
            if head:
                lay = engine.head_layout
                flat = self._buffer("head", lay.numel, dtype, dev.device)
                units = [(self.L, 0)] + ([(-1, lay.offsets[lay.names.index(name)])] if self.arch.tied else [])
                load(flat, units, self._head_used)
                yield self.L, lay.views(flat)
                self._head_used = dev.record(torch.cuda.current_stream(dev.device)) if dev.cuda else None

    def _ring(self, dev) -> list[torch.Tensor]:
        """The staging slots (uint8 host tensors; pinned on CUDA), made once and kept."""
        key = ("ring", dev.cuda)
        if key not in self._bufs:
            biggest = max(b - a for _, table in self.headers for *_, a, b in table.values())
            size = min(CHUNK, max(biggest, 1))
            self._bufs[key] = torch.empty(SLOTS[dev.cuda], size, dtype=torch.uint8, pin_memory=dev.cuda)
            self._free = [None] * SLOTS[dev.cuda]
        return list(self._bufs[key])

    def host_bytes(self) -> int:
        """Bytes of the buffers this object keeps between passes in host memory: the staging ring and, on
        "cpu", the layer and head buffers."""
        return sum(b.numel() * b.element_size() for b in self._bufs.values() if b.device.type == "cpu")

    def __repr__(self) -> str:
        return f"Reference({str(self.path)!r}, {len(self.files)} file(s))"


def snapshot(session, path: str | os.PathLike | None = None) -> Reference:
    """Write the session's current weights as a bf16 HF directory and return a ``Reference`` reading it.

    Args:
        session: the policy's ``Session``.
        path: the directory to write; None: a temporary one, deleted with the returned object.
    Returns:
        Reference over the written directory.
    """
    owned = None
    if path is None:
        path = owned = tempfile.mkdtemp(prefix="megatrain-reference-")
    session.save_pretrained(path, dtype=torch.bfloat16, max_shard_bytes=1 << 30)  # waits for pending updates;
    # shards of 1 GiB: what host memory holds while writing
    return Reference(path, session.store, owned=owned)
