"""Safetensors shards written tensor by tensor, cast a chunk at a time: a checkpoint of the host store in
another dtype costs host memory of one chunk, not of a shard.

Owns: the plan of the shards (names, shapes, offsets, from a first walk over the units), each file's header
and its data streamed in order, each file's checksum computed as its bytes are written (``write_file``), the
temporary names until every shard is whole, and the index.
Does not own: which tensors a unit has or their checkpoint names (``HostStore.save_pretrained`` walks the
units through ``convert_to_checkpoint``), the config.

Why our own writer: ``safetensors.torch.save_file`` takes a dict of whole tensors, so a shard of another
dtype (the bf16 snapshot of an fp32 store: ``Session.freeze_reference``) exists in host memory first. On the
H200 at the 7B shape that was 1 GiB a shard beside a store already at the host's bound (Note: [Reference
reads] in post/reference.py). The format is simple and public: an 8-byte little-endian header length, a
JSON header (padded with spaces to 8 bytes) of ``{name: {dtype, shape, data_offsets}}``, then the data in
offset order; the files are read back with ``safetensors`` itself in the tests.

Note: [Checksum while writing] every file's CRC-32 (``zlib.crc32``, always there) is folded chunk by chunk
from the very buffers handed to the file, on a second thread that may trail the writes by a few chunks and
catches up while the file's fsync waits for the disk (zlib and the writes release the GIL): no second pass
over the file, and the checksum's CPU time hides behind the disk's. On the 2-core CPU box zlib's CRC-32 ran
~1.2-2 GB/s, a write with fsync ~0.5-1.2 GB/s; bench/save_speed.py measures a save with and without it.
"""
from __future__ import annotations

import concurrent.futures
import json
import math
import os
import struct
import zlib
from pathlib import Path
from typing import Callable, Iterable

import torch

CHUNK_BYTES = 64 << 20  # cast and written a piece at a time
checksum = zlib.crc32  # (bytes, running value) -> value; bench/save_speed.py swaps in a no-op to time it
DTYPES = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16", torch.float64: "F64",
          torch.int64: "I64", torch.int32: "I32", torch.int8: "I8", torch.uint8: "U8", torch.bool: "BOOL"}


def write(out: Path, units: Callable[[], Iterable[dict[str, torch.Tensor]]], *, dtype: torch.dtype,
          max_shard_bytes: int, single: str, index: str) -> list[str]:
    """Write ``units()``' tensors (each yield: one unit's checkpoint-named tensors) into ``out`` as safetensors
    shards of at most ``max_shard_bytes`` (a tensor larger than that alone), every floating tensor cast to
    ``dtype``. One file is named ``single``; several are ``model-0000k-of-0000n.safetensors`` with an index
    ``index``. ``units`` is called twice: to plan, then to write. Returns the file names, in order.
    """
    plan: list[list[tuple[str, torch.dtype, tuple]]] = [[]]  # shards of (name, dtype, shape)
    size = 0
    for tensors in units():
        for name, t in tensors.items():
            dt = dtype if t.is_floating_point() else t.dtype
            nbytes = t.numel() * dt.itemsize
            if plan[-1] and size + nbytes > max_shard_bytes:
                plan.append([])
                size = 0
            plan[-1].append((name, dt, tuple(t.shape)))
            size += nbytes
    names = [single] if len(plan) == 1 else [f"model-{k + 1:05d}-of-{len(plan):05d}.safetensors"
                                              for k in range(len(plan))]
    temps = [out / f"model-partial-{k:05d}.safetensors" for k in range(len(plan))]
    walk = ((name, t) for tensors in units() for name, t in tensors.items())
    try:
        for shard, tmp in zip(plan, temps):
            with _Sink(tmp, fold=False) as f:  # an export: no checksum to record
                f.write(_header(shard))
                for want, dt, shape in shard:
                    name, t = next(walk)
                    if name != want or tuple(t.shape) != shape:
                        raise RuntimeError(f"the units changed between the plan and the write: {name} "
                                           f"{tuple(t.shape)} where {want} {shape} was planned")
                    _write_tensor(f, t, dt)
    except BaseException:
        for tmp in temps:
            tmp.unlink(missing_ok=True)  # nothing half-written stays
        raise
    for tmp, name in zip(temps, names):
        tmp.rename(out / name)  # only once every shard is whole: a failed write leaves no loadable half
    if len(names) > 1:
        weight_map = {n: names[k] for k, shard in enumerate(plan) for n, _, _ in shard}
        total = sum(_nbytes(dt, shape) for shard in plan for _, dt, shape in shard)
        (out / index).write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2))
    return names


def planned_bytes(units: Callable[[], Iterable[dict[str, torch.Tensor]]], dtype: torch.dtype) -> int:
    """Bytes of data ``write`` writes for ``units()`` (headers aside): what a save needs on disk."""
    return sum(t.numel() * (dtype if t.is_floating_point() else t.dtype).itemsize
               for tensors in units() for t in tensors.values())


def write_file(f: Path, tensors: list[tuple[str, torch.Tensor]]) -> tuple[int, int]:
    """Write ``tensors`` (name, flat or shaped tensor, in their own dtype) as one safetensors file, fsynced.

    Returns:
        (bytes on disk, CRC-32 of every byte of the file), the checksum folded as the bytes were written.
    Raises:
        OSError: the write failed (a full disk: ENOSPC); the half-written file is removed.
    """
    plan = [(name, t.dtype, tuple(t.shape)) for name, t in tensors]
    try:
        with _Sink(f) as out:
            out.write(_header(plan))
            for _, t in tensors:
                _write_tensor(out, t, t.dtype)
    except BaseException:
        f.unlink(missing_ok=True)
        raise
    return out.size, out.crc


class _Sink:
    """A file opened for writing whose bytes are checksummed on a second thread as they are written, then
    fsynced on close; the checksum catches up during the fsync (Note: [Checksum while writing])."""

    LAG = 8  # chunks the checksum may trail the writes by (views of the slabs: no copies)

    def __init__(self, path: Path, fold: bool = True):
        self.f = open(path, "wb")
        self.crc, self.size = 0, 0
        self.pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="megatrain-checksum") if fold else None
        self.pending: list = []

    def _fold(self, buf) -> None:
        self.crc = checksum(buf, self.crc)

    def write(self, buf) -> None:
        if self.pool is not None:
            self.pending.append(self.pool.submit(self._fold, buf))  # in order: one worker; holds buf till done
            if len(self.pending) > self.LAG:
                self.pending.pop(0).result()
        self.f.write(buf)
        self.size += len(buf) if isinstance(buf, bytes) else buf.nbytes

    def __enter__(self):
        return self

    def __exit__(self, kind, value, tb) -> None:
        try:
            if kind is None:
                self.f.flush()
                os.fsync(self.f.fileno())  # the disk's wait: the checksum thread catches up meanwhile
        finally:
            try:
                self.f.close()  # may raise what the buffered bytes' write hits (a full disk)
            finally:
                if self.pool is not None:
                    self.pool.shutdown(wait=True)
                    for p in self.pending:
                        p.result()


def _nbytes(dt: torch.dtype, shape: tuple) -> int:
    return math.prod(shape) * dt.itemsize


def _header(shard: list) -> bytes:
    """The 8-byte length and the JSON header of one shard, padded with spaces to a multiple of 8."""
    meta, off = {"__metadata__": {"format": "pt"}}, 0
    for name, dt, shape in shard:
        if dt not in DTYPES:
            raise TypeError(f"{name}: dtype {dt} has no safetensors name here; cast it to one of {list(DTYPES)}")
        n = _nbytes(dt, shape)
        meta[name] = {"dtype": DTYPES[dt], "shape": list(shape), "data_offsets": [off, off + n]}
        off += n
    text = json.dumps(meta, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    return struct.pack("<Q", len(text)) + text


def _write_tensor(f, t: torch.Tensor, dt: torch.dtype) -> None:
    """``t`` cast to ``dt`` into ``f``, a chunk of ``CHUNK_BYTES`` at a time (host memory: one chunk)."""
    flat = t.detach().reshape(-1)  # a view where t is contiguous
    step = max(1, CHUNK_BYTES // max(dt.itemsize, t.element_size()))
    for a in range(0, flat.numel(), step):
        piece = flat[a:a + step].to(dt).contiguous()
        f.write(memoryview(piece.view(torch.uint8).numpy()))
