"""The frozen reference model of preference and RL post-training, read from safetensors on disk.

Owns: streaming a model directory's ORIGINAL weights, unit by unit, into one device buffer per
kind of unit (the embedding table, a layer, the head) in the compute dtype, in the form of a
forward pass's weights source (Note: [Weights source] in inference.py); and the bf16 snapshot that gives a
Session built from a config a directory to read (``snapshot``).
Does not own: the forward pass (the caller runs the templates on what ``stream`` yields, as it
does for the policy), the policy's weights, the losses.

Note: [Reference without a copy] a second model in host RAM would cost 2-4 bytes per parameter
beside the 16 of the policy's state. Instead ``stream`` opens the safetensors memory-mapped
(``safe_open``) and copies one tensor at a time into a unit buffer: host memory grows by one
tensor's read plus, on "cpu", the unit buffers themselves (on CUDA those live on the device). The
pages the map touches are the kernel's page cache, reclaimable, not this process's memory.
Cost against a policy pass: the policy's forward streams its weights from pinned host slabs with
copies that overlap compute; a reference pass reads every weight from the page cache (from disk
when evicted: model bytes in the file's dtype per pass), casts on the host and copies without
overlap. It runs once per batch of rollouts, forward only, so it is a fraction of a step.
"""
from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
import weakref
from pathlib import Path

import torch

from ..host.host_store import HostStore, put


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
        self.layouts = {u: store.units[u].layout for u in range(self.L)}
        self._bufs: dict = {}  # (device, dtype, "layer" | "head") -> flat buffer, reused pass after pass
        if owned is not None:
            weakref.finalize(self, shutil.rmtree, owned, True)

    @contextlib.contextmanager
    def _open(self):
        from safetensors import safe_open

        with contextlib.ExitStack() as stack:
            yield [stack.enter_context(safe_open(str(f), framework="pt")) for f in self.files]

    def _buffer(self, kind: str, numel: int, dtype: torch.dtype, device) -> torch.Tensor:
        key = (str(device), dtype, kind)
        if key not in self._bufs or self._bufs[key].numel() < numel:
            self._bufs[key] = torch.zeros(numel, dtype=dtype, device=device)  # padding stays 0
        return self._bufs[key][:numel]

    def _fill(self, handles, unit: int, flat: torch.Tensor, shift: int = 0) -> None:
        """Copy unit ``unit``'s tensors into ``flat`` (each read from the map, cast, copied; one at a time)."""
        for k, name, where in self.by_unit[unit]:
            if shift:  # the tied embedding, placed after the head's norm in the head buffer
                where = where + shift if isinstance(where, torch.Tensor) else (where[0] + shift, where[1])
            put(flat, where, handles[k].get_tensor(name), f"{self.files[k].name}:{name}")

    def stream(self, engine, head: bool = True):
        """Driver: yield the reference's weights on the device, as a weights source of a forward-only pass
        (Note: [Weights source] in inference.py): ``(-1, {embedding name: table (V, H)})``, then
        ``(unit, params)`` for layers 0..L-1 as ``Engine.stream_layers`` yields them, then the head
        (unit L: final norm, lm_head or the tied embedding, ``Engine.head_layout``) if ``head``.

        Each layer is copied into one buffer of the engine's device and compute dtype, in order, on
        the current stream: the copy of layer i+1 is ordered after the compute the caller enqueued on
        layer i's views before resuming the generator. The embedding table is dropped once the caller
        resumes past it (it has gathered its rows). Run it on the compute stream, under no_grad.

        Args:
            engine: the policy's ``Engine`` (its device, compute dtype, head layout).
            head: also yield the head.
        Yields:
            (unit, {parameter name: tensor on the device}).
        """
        dev, dtype = engine.dev.device, engine.dtype
        name = self.arch.embed_name
        with self._open() as handles:
            (k, key, where), = self.by_unit[-1]
            table = torch.empty(self.arch.embed.weight.shape, dtype=dtype, device=dev)
            put(table.view(-1), where, handles[k].get_tensor(key), f"{self.files[k].name}:{key}")
            yield -1, {name: table}
            del table  # the rows are gathered: one unit's staging at a time
            n = max(lay.numel for lay in self.layouts.values())
            for u in range(self.L):
                lay = self.layouts[u]
                flat = self._buffer("layer", n, dtype, dev)[:lay.numel]
                self._fill(handles, u, flat)
                yield u, lay.views(flat)
            if head:
                lay = engine.head_layout
                flat = self._buffer("head", lay.numel, dtype, dev)
                self._fill(handles, self.L, flat)
                if self.arch.tied:
                    self._fill(handles, -1, flat, shift=lay.offsets[lay.names.index(name)])
                yield self.L, lay.views(flat)

    def host_bytes(self) -> int:
        """Bytes of the buffers this object keeps between passes (on "cpu", host memory): one layer and the head."""
        return sum(b.numel() * b.element_size() for b in self._bufs.values())

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
    session.save_pretrained(path, dtype=torch.bfloat16)  # waits for pending updates
    return Reference(path, session.store, owned=owned)
