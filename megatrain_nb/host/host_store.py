"""Per-unit contiguous slabs in host RAM: fp32 master weights, gradients and Adam moments (fp32, or compact).

Owns: allocating the slabs, filling them from safetensors (tensor by tensor, never the whole model
twice) or a seeded random init, writing them back as a Hugging Face directory (atomically: publish.py),
and the byte report.
Does not own: devices, streams or the optimizer's arithmetic. Knows nothing of CUDA except that it
may pin its memory.

Units: -1 embedding, 0..L-1 decoder layers, L head (final norm, then lm_head unless tied).
"""
from __future__ import annotations

import dataclasses
import json
import os
import shutil
from pathlib import Path

import torch

from . import compact_state, embed_grad, grad_ring, split_master
from ..model import binding
from ..model.binding import Layout
from ..model.hf import Architecture, checkpoint_map, convert_to_checkpoint

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"


@dataclasses.dataclass(kw_only=True)
class Unit:
    """One unit's slabs; every tensor is flat with ``layout.numel`` elements."""

    layer: int
    layout: Layout
    master: torch.Tensor  # (numel,) fp32
    grad: torch.Tensor | None  # (numel,) grad dtype: fp32 for the embedding, else the compute dtype; None: in
    # the ring (Note: [Gradient ring] in grad_ring.py; ``HostStore.grad_of``)
    exp_avg: torch.Tensor  # (numel,) fp32, or (compact.words,) fp32 words of a compact moment
    exp_avg_sq: torch.Tensor  # likewise
    prefix: str  # checkpoint-name prefix of layout names ("model.layers.3." or "")
    shadow: torch.Tensor | None = None  # (numel,) compute dtype, pinned: the weights as the device reads them
    compact: compact_state.Layout | None = None  # its moments' layout when compact (Note: [Compact slab])

    def tensors(self) -> list[tuple[str, int, int]]:
        """(checkpoint name, offset, numel) of each tensor of the flat slab."""
        lay = self.layout
        return [(self.prefix + n, o, s.numel()) for n, s, o in zip(lay.names, lay.shapes, lay.offsets)]


@dataclasses.dataclass
class _Named:  # what Unit.tensors reads, before the unit exists
    layout: Layout
    prefix: str


def unit_layouts(arch: Architecture) -> dict[int, tuple[Layout, str]]:
    """unit -> (flat layout, checkpoint-name prefix): -1 embedding, 0..L-1 layers, L head."""
    out = {-1: (Layout.build([(arch.embed_name, arch.embed.weight.shape)]), "")}
    for i in range(arch.num_layers):
        out[i] = (Layout.build(arch.layer_params(i)), f"{arch.layer_prefix}{i}.")
    out[arch.num_layers] = (Layout.build(arch.head_params()), "")
    return out


def carve(want: dict, alloc, align: int = 4096) -> dict:
    """Zeroed flat tensors for ``want`` (key -> (numel, dtype)), carved from a few uint8 blocks.

    Note: [Pinned arena] torch's pinned allocator rounds every request up to a power of two: slab by
    slab, a 3B model's pinned master and grads took 29.0 GiB for 16.7 GiB of data (308 MB layer
    masters in 512 MB blocks). Here each block is a power of two, filled first-fit with the
    slabs, largest first, each at an ``align``-byte offset; only the last block's tail is left over.

    Args:
        want: key -> (numel, dtype).
        alloc: nbytes -> zeroed uint8 tensor (pinned on CUDA).
    Returns:
        key -> flat tensor of that numel and dtype, a view into one block.
    """
    size = {k: -(-n * torch.tensor([], dtype=dt).element_size() // align) * align for k, (n, dt) in want.items()}
    todo = sorted(want, key=lambda k: -size[k])
    out = {}
    while todo:
        rest = sum(size[k] for k in todo)
        block = max(1 << (rest.bit_length() - 1), 1 << (size[todo[0]] - 1).bit_length())
        buf, used = alloc(block), 0
        for k in list(todo):
            if used + size[k] <= block:
                n, dt = want[k]
                out[k] = buf[used:used + n * torch.tensor([], dtype=dt).element_size()].view(dt)
                used += size[k]
                todo.remove(k)
    return out


def put(flat: torch.Tensor, where, tensor: torch.Tensor, name: str) -> None:
    """Copy checkpoint tensor ``name`` into ``flat`` at ``where`` (``HostStore._targets``' form), cast.

    Raises:
        ValueError: the tensor's shape is not the one config.json implies.
    """
    want = tuple(where.shape) if isinstance(where, torch.Tensor) else tuple(where[1])
    if tuple(tensor.shape) != want:
        raise ValueError(f"{name} has shape {tuple(tensor.shape)}, config.json implies {want}")
    if isinstance(where, torch.Tensor):
        flat[where.flatten().to(flat.device)] = tensor.flatten().to(flat.device, flat.dtype)
    else:
        off, shape = where
        flat[off:off + shape.numel()].view(shape).copy_(tensor)


class HostStore:
    """All trainable state of a model, in host memory, packed per unit."""

    def __init__(self, arch: Architecture, *, grad_dtype: torch.dtype = torch.float32,
                 shadow_dtype: torch.dtype | None = None, pin_master: bool = False, pin_moments: bool = False,
                 shared=None, optimizer_state: str = "fp32", keep_fp32=None, slabs: str | None = "grad_ring=False",
                 pin_ring: bool = False):
        """
        Args:
            grad_dtype: dtype of the layer and head gradient slabs (the compute dtype).
            shadow_dtype: when set, each unit also keeps a pinned copy of its weights in this dtype,
                refreshed after every update, and its gradient slab is pinned: transfers then go
                straight between these slabs and the device (+2 bytes/param for bf16).
            pin_master: pin the fp32 master and gradient slabs instead (the device casts; no extra bytes).
            pin_moments: pin the Adam moments too, so that units placed "device" (placement.py) move
                their whole optimizer state over PCIe by DMA (no extra bytes).
            shared: a ``shared_store.SharedHost``: every slab but the embedding's gradient lives in the
                machine's one shared segment (pinned as a whole on CUDA); None: this process's own memory.
            optimizer_state: "fp32", "int8" or "int4": the moments' form (compact_state.py); ``keep_fp32``
                the name patterns of tensors whose moments stay fp32 (None: the input embedding's).
            slabs: why every unit keeps a gradient slab (``grad_ring.slab_reason``); None: the layers' and head's
                gradients go through a ``grad_ring.GradRing`` instead (Note: [Gradient ring]); ``pin_ring``
                page-locks its buffers (CUDA).
        """
        self.arch = arch
        self.num_layers = arch.num_layers
        self.shadow_dtype = shadow_dtype
        layouts = unit_layouts(arch)
        self.optimizer_state = optimizer_state
        compact = {u: compact_state.layout_for(optimizer_state, Unit.tensors(_Named(layout, prefix)), keep_fp32)
                   for u, (layout, prefix) in layouts.items()}
        pin = shadow_dtype is not None or pin_master
        want = {}  # (unit, slab) -> (numel, dtype, pinned)
        ringed = {} if slabs is not None else grad_ring.ring_units({u: lay.numel for u, (lay, _) in layouts.items()})
        self.ring = None if not ringed else grad_ring.GradRing(ringed, grad_dtype, pin=pin_ring)
        keep = self._embedding_slab(arch, ringed, shared, compact[-1])
        self.rows = None if keep is not None else embed_grad.RowGrad(*arch.embed.weight.shape)  # Note: [Embedding rows]
        self.gradients = f"slabs: {slabs}" if self.ring is None else (
            f"ring: {self.ring.describe()}, {self.ring.nbytes / 2**20:.1f} MiB; no grad_clip, one pass; "
            + ("the embedding's touched rows (fp32)" if keep is None else f"the embedding's fp32 slab stays ({keep})"))
        for u, (layout, _) in layouts.items():
            want[u, "master"] = (layout.numel, torch.float32, pin_master)
            if u not in ringed and not (u == -1 and self.rows is not None):
                want[u, "grad"] = (layout.numel, torch.float32 if u == -1 else grad_dtype, pin and u != -1)
            if shadow_dtype is not None:
                want[u, "shadow"] = (layout.numel, shadow_dtype, True)
            words = layout.numel if compact[u] is None else compact[u].words
            want[u, "exp_avg"] = want[u, "exp_avg_sq"] = (words, torch.float32, pin_moments)
        self.shared = shared
        if shared is None:
            slabs = self._alloc_all(want)
            self.steps = torch.zeros(len(self.order))  # (units,) fp32: each unit's AdamW step count
        else:  # one store per machine (Note: [Shared host store]); each rank scatters its own embedding rows
            mine = {k: v for k, v in want.items() if k == (-1, "grad")}
            slabs = {**self._alloc_all(mine), **shared.alloc({k: (n, dt) for k, (n, dt, _) in want.items()
                                                             if k not in mine}, self.order)}
            self.steps = shared.steps
        self.units: dict[int, Unit] = {}
        for u, (layout, prefix) in layouts.items():
            self.units[u] = Unit(layer=u, layout=layout, prefix=prefix, master=slabs[u, "master"],
                                 grad=slabs.get((u, "grad")), exp_avg=slabs[u, "exp_avg"], exp_avg_sq=slabs[u, "exp_avg_sq"],
                                 shadow=slabs.get((u, "shadow")), compact=compact[u])
        self.split: set[int] = set()  # units whose master slab holds [R | D] planes (Note: [Split master])

    @staticmethod
    def _embedding_slab(arch: Architecture, ringed: dict, shared, compact) -> str | None:
        """Why the embedding's gradient keeps a dense fp32 slab, or None where its touched rows suffice (Note:
        [Embedding rows] in embed_grad.py; "" where the ring is off: the slabs' reason says why)."""
        if not ringed:
            return ""
        if arch.tied:
            return "tied: the head's gradient lands in it whole"
        if shared is not None:
            return "a shared host store"
        if compact is not None:
            return "compact embedding moments read a whole slab"
        return None

    @classmethod
    def _alloc_all(cls, want: dict) -> dict:
        """Zeroed slabs; the pinned ones carved from a few power-of-two pinned blocks (Note: [Pinned arena])."""
        out = {k: cls._alloc(n, dt, pin=False) for k, (n, dt, pinned) in want.items() if not pinned}
        pinned = {k: (n, dt) for k, (n, dt, p) in want.items() if p}
        if pinned:
            try:
                out.update(carve(pinned, cls._pinned_block))
            except RuntimeError as e:  # e.g. a driver refusing one large pinned block: pin slab by slab
                import warnings
                warnings.warn(f"pinning the store in large blocks failed ({e}); pinning each slab on its own, "
                              "which torch rounds up to a power of two (more host memory)", stacklevel=3)
                out.update({k: cls._alloc(n, dt, pin=True) for k, (n, dt) in pinned.items()})
        return out

    @staticmethod
    def _pinned_block(nbytes: int) -> torch.Tensor:
        return torch.zeros(nbytes, dtype=torch.uint8, pin_memory=True)

    @staticmethod
    def _alloc(n: int, dtype: torch.dtype, pin: bool) -> torch.Tensor:
        if pin:
            return torch.zeros(n, dtype=dtype, pin_memory=True)
        return torch.zeros(n, dtype=dtype)

    def refresh_shadow(self, u: int | None = None) -> None:
        """Cast the fp32 master into the pinned shadow (after an update; ``None``: every unit)."""
        for k in self.order if u is None else [u]:
            unit = self.units[k]
            if unit.shadow is not None:
                unit.shadow.copy_(unit.master)

    def split_units(self, units) -> None:
        """Hold these units' masters as [R | D] (Note: [Split master] in split_master.py); the caller makes
        sure no update or copy of them is in flight."""
        for u in sorted(set(units) - self.split):
            split_master.split_(self.units[u].master, self.units[u].exp_avg_sq)
            self.split.add(u)

    def join_units(self, units=None) -> None:
        """Hold these units' masters (None: every split one) as fp32 again, for readers of the store."""
        for u in sorted(self.split if units is None else set(units) & self.split):
            split_master.join_(self.units[u].master, self.units[u].exp_avg_sq)
            self.split.discard(u)

    def weights_source(self, u: int) -> torch.Tensor:
        """What a load of unit ``u``'s weights copies: its pinned shadow, the R plane of a split master (the
        compute-dtype weights themselves), else the fp32 master (cast on the way)."""
        unit = self.units[u]
        if unit.shadow is not None:
            return unit.shadow
        return split_master.weights(unit.master) if u in self.split else unit.master

    def grad_of(self, u: int) -> torch.Tensor:
        """Unit ``u``'s landed gradients, (numel,): its slab, or the ring buffer it holds until its update
        (Note: [Gradient ring] in grad_ring.py)."""
        g = self.units[u].grad
        if g is None and u == -1:
            raise ValueError("the embedding's gradient is held as rows (Note: [Embedding rows] in embed_grad.py): "
                             "read HostStore.rows")
        return self.ring.get(u) if g is None else g

    def grad_dst(self, u: int):
        """Where a copy out of unit ``u``'s gradients goes: its slab, or a ``grad_ring.RingDst`` (a ring buffer,
        taken when the copy starts: ``Transfers.grads``)."""
        g = self.units[u].grad
        return grad_ring.RingDst(u) if g is None else g

    def owns(self, u: int) -> bool:
        """Whether this process applies unit ``u``'s host updates (always, unless a shared store's other rank does)."""
        return self.shared is None or self.shared.owns(u)

    def copies_out(self, u: int, segments: list) -> list:
        """Of gradient copy-out ``segments`` [(offset, numel, host slab)] of unit ``u``, those this process
        writes: all, unless another local rank owns ``u``; then only those into its own (private) slabs."""
        if self.owns(u):
            return segments
        return [s for s in segments if not self.shared.holds(s[2])]

    def step_count(self, u: int) -> torch.Tensor:
        """0-dim fp32: unit ``u``'s AdamW step count (a view of ``steps``; shared with a shared store)."""
        return self.steps[self.order.index(u)]

    @property
    def order(self) -> list[int]:
        return [-1, *range(self.num_layers), self.num_layers]

    def num_params(self) -> int:
        """Trainable parameters, as ``sum(p.numel() for p in model.parameters())`` counts them."""
        return sum(s.numel() for u in self.units.values() for s in u.layout.shapes)

    def bytes_report(self) -> dict[str, float]:
        """Bytes by category (master, grad, exp_avg, exp_avg_sq, shadow, grad_ring: the ring's buffers, Note:
        [Gradient ring]; grad_ring_overflow: plain buffers it took while the host's AdamW was behind, held or
        kept for the next step, Note: [Ring overflow]; grad_rows: the embedding's touched rows, Note: [Embedding rows]; total) and bytes per parameter. ``gradients`` says in words which holds them."""
        rep = {k: sum(getattr(u, k).numel() * getattr(u, k).element_size() for u in self.units.values()
                      if getattr(u, k) is not None)
               for k in ("master", "grad", "exp_avg", "exp_avg_sq", "shadow")}
        rep["grad_ring"] = 0 if self.ring is None else self.ring.nbytes
        rep["grad_ring_overflow"] = 0 if self.ring is None else self.ring.overflow_bytes  # Note: [Ring overflow]
        rep["grad_rows"] = 0 if self.rows is None else self.rows.nbytes  # the embedding's touched rows
        rep["total"] = sum(rep.values())
        rep["params"] = self.num_params()
        rep["bytes_per_param"] = rep["total"] / rep["params"]
        return rep

    def fp32_moment_params(self) -> int:
        """Parameters whose Adam moments are fp32 (all of them with optimizer_state="fp32")."""
        return sum(u.layout.numel if u.compact is None else u.compact.kept for u in self.units.values())

    def moments_of(self, u: int) -> str:
        """How unit ``u``'s Adam moments are held, in words (``Session.placement``'s "moments" column)."""
        unit, kind = self.units[u], self.optimizer_state
        if kind == "fp32":
            return "fp32"
        if unit.compact is None:
            return "fp32 (kept: the embedding, a tensor named in compact_keep_fp32, or all under 4096 values)"
        kept = unit.compact.kept
        return f"{kind}" + (f", {kept:,} of {unit.compact.n:,} fp32 (small or named tensors)" if kept else "")

    def views(self, u: int) -> dict[str, torch.Tensor]:
        """Model-named views of unit ``u``'s master weights (names as in ``model.named_parameters``)."""
        if u in self.split:
            raise RuntimeError(f"unit {u}'s master is held as two planes while it trains placed 'device' (Note: "
                               f"[Split master]); read it after Session.engine.drain(), which joins it")
        unit = self.units[u]
        return {unit.prefix + n: v for n, v in unit.layout.views(unit.master).items()}

    # ---- loading -------------------------------------------------------------------------
    def load_safetensors(self, path: str | os.PathLike) -> None:
        """Fill the master slabs from an HF directory (single file or sharded), tensor by tensor.

        Raises:
            FileNotFoundError: no safetensors in ``path`` or a shard the index names is missing.
            ValueError: a corrupt file, a shape mismatch, or missing weights (names them).
        """
        path = Path(path)
        for f, fh, key, target in self.checkpoint_tensors(path):
            self._put(target, fh.get_tensor(key), key, f)

    def checkpoint_tensors(self, path: Path):
        """(file, open safetensors handle, checkpoint name, (unit, place)) of every tensor of the HF directory
        ``path`` that this model has, file by file, the handle open while its names are yielded.

        Raises:
            FileNotFoundError: no safetensors in ``path`` or a shard the index names is missing.
            ValueError: a corrupt file, a tensor this model does not have, or missing weights (names them).
        """
        from safetensors import SafetensorError, safe_open

        files = self._files(path)
        targets = self._targets()
        done: set[str] = set()
        for f in files:
            try:
                with safe_open(str(f), framework="pt") as fh:
                    for key in fh.keys():
                        if key not in targets:
                            if key == self.arch.head_name and self.arch.tied:
                                continue  # some tied checkpoints store lm_head too
                            raise ValueError(f"{f.name} holds {key!r}, which {type(self.arch.model).__name__} "
                                             "does not have: is this directory's config.json the right one?")
                        yield f, fh, key, targets[key]
                        done.add(key)
            except SafetensorError as e:
                raise ValueError(f"{f} is not a readable safetensors file ({e}); re-save or re-download it") from e
        missing = sorted(set(targets) - done)
        if missing:
            raise ValueError(f"{path} lacks {len(missing)} weights, e.g. {missing[:3]}; the checkpoint does not "
                             "match config.json")

    @staticmethod
    def _files(path: Path) -> list[Path]:
        if not path.is_dir():
            raise FileNotFoundError(f"model directory {str(path)!r} does not exist")
        if (path / INDEX).exists():
            weight_map = json.loads((path / INDEX).read_text())["weight_map"]
            files = [path / f for f in sorted(set(weight_map.values()))]
            missing = [f.name for f in files if not f.exists()]
            if missing:
                raise FileNotFoundError(f"{path / INDEX} names shards that are missing: {missing}")
            return files
        if (path / SINGLE).exists():
            return [path / SINGLE]
        raise FileNotFoundError(f"{str(path)!r} has no {SINGLE} or {INDEX} (found: "
                                f"{sorted(p.name for p in path.iterdir())[:8]})")

    def _targets(self) -> dict[str, tuple[int, object]]:
        """checkpoint name -> (unit, (offset, shape) or LongTensor of flat positions)."""
        out, cache = {}, {}
        for u, unit in self.units.items():
            key = ("layer", self.arch.template_of[u]) if 0 <= u < self.num_layers else ("unit", u)
            if key not in cache:  # one conversion probe per distinct structure, renamed per layer
                params = {unit.prefix + n: (o, s) for n, s, o in unit.layout.items()}
                cache[key] = (unit.prefix, checkpoint_map(self.arch, params))
            prefix, mapping = cache[key]
            for name, where in mapping.items():
                out[unit.prefix + name[len(prefix):] if prefix else name] = (u, where)
        return out

    def _put(self, target, tensor: torch.Tensor, key: str, f: Path) -> None:
        u, where = target
        put(self.units[u].master, where, tensor, f"{f.name}:{key}")

    def init_random(self, seed: int) -> None:
        """Initialise like the HF model's own ``_init_weights``, one unit at a time (no full model in RAM).

        Each unit draws from its own seed (seed, unit), so the result does not depend on order. The init
        writes straight into the unit's fp32 master (the templates' parameters are fp32 too, so the draws are
        the same): no copy of a unit in between, which at gpt-oss-20b's width was 3.1 GiB of host memory at
        the load's peak (``binding.bound``).
        """
        arch, L = self.arch, self.num_layers
        for u in self.order:
            torch.manual_seed(seed * 1_000_003 + u + 1)
            views = self.views(u)
            if 0 <= u < L:
                mods = [(arch.layers[u], {n: views[self.units[u].prefix + n] for n, _ in arch.layers[u].named_parameters()})]
            elif u == -1:
                mods = [(arch.embed, {"weight": views[arch.embed_name]})]
            else:
                mods = [(arch.norm, {n: views[arch.norm_prefix + n] for n, _ in arch.norm.named_parameters()})]
                if not arch.tied:
                    mods.append((arch.head, {"weight": views[arch.head_name]}))
            with torch.no_grad():
                for template, params in mods:
                    binding.bound(template, params).apply(arch.model._init_weights)

    # ---- saving --------------------------------------------------------------------------
    def save_pretrained(self, out_dir: str | os.PathLike, *, dtype: torch.dtype = torch.float32,
                        max_shard_bytes: int = 5 << 30) -> None:
        """Write config.json + safetensors (sharded above ``max_shard_bytes``) that transformers loads.

        Tensor by tensor, cast a chunk at a time (``shard_writer.py``): host memory holds one chunk in
        ``dtype`` (and what a unit's checkpoint conversion copies), never a shard or the whole model.
        Atomic (Note: [Atomic save] in publish.py): written into ``<out_dir>.tmp-<pid>`` and exchanged with
        ``out_dir`` once complete; the other entries of an existing ``out_dir`` (a tokenizer, a checkpoint
        folder) are hard-linked into the new copy, its old weights and index are not.

        Raises:
            OSError: a full disk or another I/O error, naming ``out_dir`` and the bytes needed; ``out_dir``
                keeps its previous contents and the temporary directory is removed.
        """
        from . import publish, shard_writer

        out = Path(os.path.abspath(out_dir))
        if out.is_symlink():
            out = out.resolve()  # replace what the link points to, not the link
        units = lambda: (convert_to_checkpoint(self.arch, self.views(u)) for u in self.order)  # noqa: E731
        tmp = None
        try:
            tmp = publish.temp_dir(out)
            shard_writer.write(tmp, units, dtype=dtype, max_shard_bytes=max_shard_bytes, single=SINGLE, index=INDEX)
            cfg = self.arch.config
            cfg.dtype = dtype
            cfg.save_pretrained(str(tmp))
            publish.carry(out, tmp, lambda name: name == INDEX or (name.startswith("model") and
                                                                   name.endswith(".safetensors")))
            publish.publish(tmp, out)
        except OSError as e:
            if tmp is not None and tmp.exists():
                shutil.rmtree(tmp, ignore_errors=True)  # first, so that the message says what is free without it
            raise publish.save_error(e, out, shard_writer.planned_bytes(units, dtype), "the model") from e
        finally:
            if tmp is not None and tmp.exists():
                shutil.rmtree(tmp, ignore_errors=True)  # a failed save's files
