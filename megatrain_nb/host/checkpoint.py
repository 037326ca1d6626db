"""Training checkpoints: save a Session's full state to a directory and resume it bit for bit.

Owns: the checkpoint directory format (fp32 master slabs and Adam moments of every unit as flat
safetensors pieces, plus ``state.json`` with the config, the settings, step counts, RNG states, the
data position, the step history and the skipped-step count), writing it atomically, and validating
it on load.
Does not own: the slabs themselves (host_store), the optimizer's arithmetic (optim), how a Session is
wired (session), nor gradients — every step overwrites the gradient slabs before reading them, so
they are not saved.

Layout of a checkpoint directory::

    state.json                 format version, config, settings, counters, RNG, history, file index
    slabs-00001.safetensors    flat fp32 tensors "unit.<u>.<kind>" (kind: master, exp_avg, exp_avg_sq; a compact
                               moment as its slab's fp32 words, Note: [Compact slab] in compact_state.py)
    slabs-00002.safetensors    ... each file <= max_shard_bytes; a larger slab is split into pieces
                               "unit.<u>.<kind>@<start>" that state.json's index reassembles

Saving is atomic (Note: [Atomic save] in publish.py): ``path`` holds the old checkpoint or the new one at
every instant (or, where the system cannot exchange two directories, the old one at ``<path>.old`` in the
window between two renames, which ``resume`` then loads with a warning). Every file's CRC-32, folded as it
is written (Note: [Checksum while writing] in shard_writer.py), is in ``state.json``; ``resume`` verifies it
before allocating anything, and refuses non-finite weights or moments and a negative second moment.
"""
from __future__ import annotations

import base64
import binascii
import dataclasses
import gc
import json
import os
import random
import shutil
import traceback
import warnings
import zlib
from pathlib import Path

import torch

from . import compact_state, publish, shard_writer
from .collective_save import device_counts_elsewhere, one_writer

FORMAT = "megatrain_nb.checkpoint"
VERSION = 1
STATE = "state.json"
KINDS = ("master", "exp_avg", "exp_avg_sq")
MAX_SHARD_BYTES = 2 << 30


@one_writer("checkpoint", alone=device_counts_elsewhere)  # data parallel: rank 0 writes (Note: [One writer])
def save_checkpoint(session, path: str | os.PathLike, *, data_state: dict | None = None,
                    max_shard_bytes: int = MAX_SHARD_BYTES) -> Path:
    """Write everything needed to continue training ``session`` exactly where it is.

    Waits for pending host Adam updates first (``engine.drain``), so the saved masters are those the
    next step would read. Atomic (Note: [Atomic save] in publish.py): the files go into
    ``<path>.tmp-<pid>``, are fsynced, and replace ``path`` in one exchange once complete; a killed or
    failed save leaves the previous checkpoint whole, and the next save removes the dead process's
    temporary directory. Each file's CRC-32 is recorded in ``state.json`` for ``resume`` to verify.
    Under data parallel every rank, or rank 0 alone, may call it: rank 0 writes, the others return
    once it is complete (Note: [One writer] in host/collective_save.py).

    Args:
        session: a ``Session`` between steps.
        path: checkpoint directory; replaced if it exists.
        data_state: JSON-able position of the data iterator (e.g. ``JsonlBatches.state_dict()``);
            default: ``session.data_state`` when the session has that attribute.
        max_shard_bytes: largest safetensors file; bigger slabs are split into pieces.
    Returns:
        The checkpoint directory as a Path.
    Raises:
        ValueError: ``max_shard_bytes`` < 1 MiB, or ``data_state`` is not JSON-able.
        OSError: the disk refused a write (full: ENOSPC) or another I/O error; the message names ``path``
            and the bytes the checkpoint needs. ``path`` and the session are untouched (the next step and
            the next save work) and the temporary directory is removed.
        RuntimeError: data parallel only: rank 0 alone where another rank's GPU holds some state, or
            rank 0's write failed (on the other ranks); docs/distributed.md, "Saving".
    Example:
        >>> save_checkpoint(s, "ckpt/run1")            # doctest: +SKIP
        >>> s = Session.resume("ckpt/run1")              # doctest: +SKIP
    """
    if max_shard_bytes < (1 << 20):
        raise ValueError(f"max_shard_bytes={max_shard_bytes}: use at least 1 MiB")
    path = Path(path)
    session.engine.drain()  # host wait: every finished step's updates are in the masters
    if data_state is None:
        data_state = getattr(session, "data_state", None)
    state = _state(session, data_state)  # before any file: a non-JSON-able field fails here
    tmp = None
    try:
        tmp = publish.temp_dir(path)
        state["files"], state["tensors"], state["crc32"] = _write_slabs(session.store, tmp, max_shard_bytes)
        _write_json(tmp / STATE, state)
        publish.publish(tmp, path)
    except OSError as e:
        if tmp is not None and tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)  # first, so that the message says what is free without it
        raise publish.save_error(e, path, _needed(session.store), "the checkpoint") from e
    finally:
        if tmp is not None and tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)  # a failed save's files (or the old copy, if its delete failed)
    return path


def resume(path: str | os.PathLike, *, make, **overrides):
    """Rebuild a Session from a checkpoint so that its next steps equal an uninterrupted run's.

    Restores the masters and Adam moments, each unit's AdamW step count, the engine's step count
    (and so the LR schedule's position), the torch / CUDA / ``random`` RNG states, ``history``,
    ``skipped_steps`` and ``data_state``.

    Args:
        path: a directory written by ``save_checkpoint``.
        make: the Session class (``Session.resume`` passes itself: this module imports no session).
        **overrides: any Session setting (OptimConfig or EngineConfig field) to change, e.g.
            ``device="cpu"``, ``micro_batch_size=1``, ``lr=1e-4``. Any field may be overridden; an
            optimizer override (lr, schedule, betas, ...) changes the run from here on, so the resumed
            run no longer equals the uninterrupted one. The activation policy of the first run is
            reused only when no engine setting is overridden.
    Returns:
        Session, with ``data_state`` set (None when none was saved).
    Raises:
        FileNotFoundError: ``path`` does not exist (nor ``<path>.old``).
        ValueError: not a checkpoint, a different format version, or a missing / corrupt / short
            file (the message names it).
        TypeError: an unknown setting in ``overrides``.
    """
    path = _locate(Path(path))
    state = _read_state(path)
    _verify(path, state)  # every byte, before anything is allocated
    with _field(path, "config"):
        config = _config(state)
    with _field(path, "optim_cfg / engine_cfg"):
        settings = {**_settings(state["optim_cfg"]), **_settings(state["engine_cfg"]), **overrides}
    with _field(path, "rng"):
        rng = _check_rng(state["rng"])
    with _field(path, "history"):
        history = _history(state["history"])
    session = make(config, _init=lambda store: _load_slabs(store, path, state), **settings)
    try:  # a failure from here closes the half-built session: its threads, its store
        with _field(path, "unit_steps / steps_done / keep"):
            for u in session.store.order:
                session.optim.set_steps_done(u, int(state["unit_steps"][str(u)]))
            _set_engine_steps(session.engine, int(state["steps_done"]))
            engine_fields = {f.name for f in dataclasses.fields(session.engine_cfg)}
            if state.get("keep") is not None and not set(overrides) & engine_fields:
                session.engine.keep = list(state["keep"])  # the same activation policy, so the same kernels run
                if state.get("placement_free_bytes") is not None:  # and the same placement (Note: [Placement])
                    from ..machine.placement import Search

                    session.engine.device_updates.search = Search.done_with(int(state["placement_free_bytes"]))
        session.history = history
        if hasattr(session, "skipped_steps"):
            session.skipped_steps = int(state.get("skipped_steps", 0))
        session.data_state = state.get("data_state")
        session.store.refresh_shadow()
        _set_rng(rng)  # last: a failed resume leaves this process's RNG as it was
    except BaseException as e:
        session.close()
        _drop_frames(e)
        del session  # this frame stays in the traceback: let it not hold the session
        gc.collect()  # the engine and its threads hold the session in cycles: free its store now
        raise
    return session


def _drop_frames(e: BaseException) -> None:
    """Clear the locals of the finished frames in ``e``'s tracebacks (and its causes'), which would keep a closed
    session's store alive as long as the exception is (a notebook keeps the last one)."""
    seen = set()
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        traceback.clear_frames(e.__traceback__)  # the running frames (this one, the caller's) are left as they are
        e = e.__cause__ or e.__context__


class _field:
    """Context: a malformed state.json field raises ValueError naming the file and the field."""

    def __init__(self, path: Path, name: str):
        self.path, self.name = path, name

    def __enter__(self):
        return self

    def __exit__(self, kind, value, tb):
        if kind is not None and issubclass(kind, (KeyError, TypeError, ValueError, AttributeError, IndexError,
                                                  RuntimeError, binascii.Error, OverflowError)):
            raise ValueError(f"{self.path / STATE}: field {self.name} is malformed ({kind.__name__}: {value}); the "
                             "file is corrupt: resume an earlier checkpoint") from value
        return False


# ---- state.json ----------------------------------------------------------------------------
def _state(session, data_state) -> dict:
    """Everything but the slabs, as JSON-able values."""
    config = session.config
    state = {
        "format": FORMAT, "version": VERSION,
        "config": config.to_dict(),
        "attn_implementation": getattr(config, "_attn_implementation", None),  # config.to_dict() drops it
        "optim_cfg": _jsonable_cfg(session.optim_cfg), "engine_cfg": _jsonable_cfg(session.engine_cfg),
        "steps_done": session.engine.steps_done,
        "skipped_steps": getattr(session, "skipped_steps", 0),
        "unit_steps": {str(u): session.optim.steps_done(u) for u in session.store.order},
        "numel": {str(u): session.store.units[u].layout.numel for u in session.store.order},
        "keep": getattr(session.engine, "keep", None),
        "placement_free_bytes": _placed_free(session.engine),  # what placement="auto" settled on
        "rng": _get_rng(),
        "history": [dataclasses.asdict(r) for r in getattr(session, "history", [])],
        "data_state": data_state,
    }
    try:
        json.dumps(state)
    except (TypeError, ValueError) as e:
        raise ValueError(f"checkpoint state is not JSON-serialisable ({e}); data_state must be a dict of "
                         f"plain values (got {type(data_state).__name__})") from e
    return state


def _placed_free(engine) -> int | None:
    """Device bytes the finished "auto" search places residents in (None: not finished)."""
    search = getattr(getattr(engine, "device_updates", None), "search", None)
    return search.free.get(search.winner) if search is not None and search.phase == "done" else None


def _jsonable_cfg(cfg) -> dict:
    out = {}
    for f in dataclasses.fields(cfg):
        v = getattr(cfg, f.name)
        out[f.name] = str(v).removeprefix("torch.") if isinstance(v, torch.dtype) else v
    return out


def _settings(d: dict) -> dict:
    """Settings from state.json back to Python values (dtype strings, betas tuple)."""
    out = dict(d)
    if isinstance(out.get("dtype"), str):
        out["dtype"] = getattr(torch, out["dtype"])
    if isinstance(out.get("betas"), list):
        out["betas"] = tuple(out["betas"])
    return out


def _config(state: dict):
    from transformers import CONFIG_MAPPING

    d = dict(state["config"])
    config = CONFIG_MAPPING[d["model_type"]].from_dict(d)
    if state.get("attn_implementation"):
        config._attn_implementation = state["attn_implementation"]
    return config


def _history(rows: list[dict]) -> list:
    from ..view.results import StepResult

    names = [f.name for f in dataclasses.fields(StepResult)]
    return [StepResult(**{n: r.get(n) for n in names}) for r in rows]


def _b64(t: torch.Tensor) -> str:
    return base64.b64encode(t.numpy().tobytes()).decode("ascii")


def _unb64(s: str) -> torch.Tensor:
    return torch.frombuffer(bytearray(base64.b64decode(s, validate=True)), dtype=torch.uint8)


def _get_rng() -> dict:
    v, internal, gauss = random.getstate()
    cuda = None
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        cuda = [_b64(s) for s in torch.cuda.get_rng_state_all()]
    return {"torch": _b64(torch.get_rng_state()), "cuda": cuda, "python": [v, list(internal), gauss]}


def _check_rng(rng: dict) -> dict:
    """The RNG states decoded and tried on throwaway generators (raises what a malformed one raises)."""
    out = {"torch": _unb64(rng["torch"]), "python": rng["python"],
           "cuda": [_unb64(s) for s in rng["cuda"]] if rng.get("cuda") else None}
    torch.Generator().set_state(out["torch"])
    v, internal, gauss = out["python"]
    out["python"] = (v, tuple(internal), gauss)
    random.Random().setstate(out["python"])
    return out


def _set_rng(rng: dict) -> None:
    """Restore states checked by ``_check_rng``."""
    torch.set_rng_state(rng["torch"])
    random.setstate(rng["python"])
    if rng.get("cuda") and torch.cuda.is_available():
        states, n = rng["cuda"], torch.cuda.device_count()
        if len(states) != n:
            warnings.warn(f"checkpoint holds CUDA RNG states of {len(states)} devices, this machine has {n}; "
                          f"restoring the first {min(len(states), n)}")
        for i, s in enumerate(states[:n]):
            torch.cuda.set_rng_state(s, i)


def _set_engine_steps(engine, n: int) -> None:
    """The engine's finished-step count; the Adam worker must agree (loads wait for version == steps)."""
    if hasattr(engine, "set_steps_done"):
        engine.set_steps_done(n)
        return
    engine.steps_done = n  # Note: until Engine.set_steps_done exists; the worker is idle before a first step
    with engine.adam.cond:
        engine.adam.version = {u: n for u in engine.adam.order}


# ---- slabs -----------------------------------------------------------------------------------
def _write_slabs(store, out: Path, max_bytes: int) -> tuple[dict, dict, dict]:
    """Write every unit's slabs as flat fp32 pieces into files of <= max_bytes.

    Returns (files: name -> bytes on disk, tensors: "unit.<u>.<kind>" -> [[file, key, start, numel]],
    crc32: name -> CRC-32 of the file's bytes, folded as they were written).
    """
    per = max_bytes // 4  # fp32 elements per file
    files: list[dict] = [{}]
    size = 0
    index: dict[str, list] = {}
    for u in store.order:
        unit = store.units[u]
        for kind in KINDS:
            flat = getattr(unit, kind)  # (numel,) fp32
            name = f"unit.{u}.{kind}"
            index[name] = []
            for a in range(0, max(flat.numel(), 1), per):
                b = min(flat.numel(), a + per)
                if size + (b - a) > per:
                    files.append({})
                    size = 0
                key = name if (a, b) == (0, flat.numel()) else f"{name}@{a}"
                files[-1][key] = flat[a:b]  # a view: no copy; the writer writes from its memory
                size += b - a
                index[name].append([len(files) - 1, key, a, b - a])
    names = [f"slabs-{k + 1:05d}.safetensors" for k in range(len(files))]
    sizes, crcs = {}, {}
    for name, tensors in zip(names, files):
        sizes[name], crcs[name] = shard_writer.write_file(out / name, list(tensors.items()))
    for pieces in index.values():
        for p in pieces:
            p[0] = names[p[0]]
    return sizes, index, crcs


def _needed(store) -> int:
    """Bytes of a checkpoint's slab files (headers and state.json aside)."""
    return sum(getattr(store.units[u], k).numel() * 4 for u in store.order for k in KINDS)


def _load_slabs(store, path: Path, state: dict) -> None:
    """Session's ``_init``: fill masters and moments from the checkpoint; every element exactly once. Moments
    saved in another ``optimizer_state`` (or with other fp32-kept tensors) are converted, with a warning."""
    from safetensors import SafetensorError, safe_open

    for u in store.order:
        want, got = store.units[u].layout.numel, state["numel"].get(str(u))
        if got != want:
            raise ValueError(f"{path / STATE}: unit {u} has {got} elements, this model's has {want}; the "
                             "checkpoint belongs to another config")
    saved = _saved_layouts(store, state)
    convert = {u for u in store.order if saved[u] != store.units[u].compact}
    if convert:
        warnings.warn(f"{path}: Adam moments saved with optimizer_state={state['optim_cfg'].get('optimizer_state', 'fp32')!r}"
                      f" are converted to optimizer_state={store.optimizer_state!r} for {len(convert)} of "
                      f"{len(store.order)} units; the resumed run is not bit-equal to one that kept the setting",
                      stacklevel=4)
    staged = {(u, k): torch.zeros(compact_state.moment_words(saved[u].kind, saved[u].n, saved[u].kept)
                                  if saved[u] is not None else store.units[u].layout.numel)
              for u in convert for k in KINDS[1:]}  # the saved form, converted below (one unit's at a time is
    by_file: dict[str, list] = {}  # enough memory-wise, but the files are read in one pass)
    for name, pieces in state["tensors"].items():
        _, u, kind = name.split(".")
        dst = staged.get((int(u), kind), getattr(store.units[int(u)], kind))
        for f, key, start, n in pieces:
            by_file.setdefault(f, []).append((dst, key, start, n))
    filled = {name: 0 for name in state["tensors"]}
    for f, items in sorted(by_file.items()):
        try:
            with safe_open(str(path / f), framework="pt") as fh:
                for dst, key, start, n in items:
                    t = fh.get_tensor(key)
                    if t.dtype != torch.float32 or t.shape != (n,):
                        raise ValueError(f"{path / f}:{key} is {t.dtype} {tuple(t.shape)}, expected float32 ({n},)")
                    dst[start:start + n].copy_(t)
                    filled[key.split("@")[0]] += n
        except SafetensorError as e:
            raise ValueError(f"{path / f} is corrupt ({e}); use an earlier checkpoint") from e
    for u in store.order:
        for kind in KINDS:
            name = f"unit.{u}.{kind}"
            want = (staged[u, kind] if (u, kind) in staged else getattr(store.units[u], kind)).numel()
            if filled.get(name) != want:
                raise ValueError(f"{path}: {name} has {filled.get(name)} of {want} elements; the checkpoint is "
                                 "incomplete")
    for (u, kind), t in staged.items():
        unit, k = store.units[u], KINDS.index(kind) - 1
        fp32 = t if saved[u] is None else compact_state.dequantize(  # the whole slab: Note: [Alignment tail]
            t, saved[u], k, out=torch.empty(unit.layout.numel))
        if unit.compact is None:
            getattr(unit, kind).copy_(fp32)
        else:
            compact_state.quantize_into(getattr(unit, kind), unit.compact, k, fp32)
    for u in store.order:
        _check_values(store.units[u], path)


CHECK_CHUNK = 1 << 24  # elements a check reads at a time (its temporaries: a few bytes each)


def _check_values(unit, path: Path) -> None:
    """Refuse NaN / inf in a unit's master or moments and a negative second moment, naming the tensor. A compact
    moment (Note: [Compact slab]) is checked where its fp32 words are numbers: the block scales (finite, >= 0:
    absolute maxima) and the kept fp32 positions; its codes are indices into a map, any byte valid."""
    parts = {"master": (unit.master, 0)}
    for k, kind in enumerate(KINDS[1:]):
        slab = getattr(unit, kind)
        if unit.compact is None:
            parts[kind] = (slab, 0)
        else:
            _, scales, kept = compact_state.parts(slab, unit.compact)
            parts[f"{kind} (block scales)"] = (scales, None)
            parts[f"{kind} (kept fp32 positions)"] = (kept, None)
    for label, (t, base) in parts.items():
        negative_bad = label.startswith("exp_avg_sq") or "scales" in label
        for a in range(0, t.numel(), CHECK_CHUNK):
            x = t[a:a + CHECK_CHUNK]
            bad = ~torch.isfinite(x)
            if negative_bad:
                bad |= x < 0
            if bad.any():
                i = a + int(bad.nonzero()[0])  # the first bad element
                what = "negative" if torch.isfinite(t[i]) else str(float(t[i]))
                where = f" in {_tensor_at(unit, i)}" if base is not None else ""
                raise ValueError(f"{path}: unit {unit.layer}'s {label} holds {what} values (first at element {i}"
                                 f"{where}); the run had diverged when it was saved, or the file was damaged: resume "
                                 "an earlier checkpoint")


def _tensor_at(unit, i: int) -> str:
    """The checkpoint name of the tensor at flat position ``i`` of a unit's slab."""
    for name, off, n in unit.tensors():
        if off <= i < off + n:
            return name
    return f"position {i}"


def _saved_layouts(store, state: dict) -> dict:
    """unit -> the compact layout its moments were saved in (None: fp32), from the saved optimizer settings."""
    ocfg = state["optim_cfg"]
    kind, keep = ocfg.get("optimizer_state", "fp32"), ocfg.get("compact_keep_fp32")
    return {u: compact_state.layout_for(kind, store.units[u].tensors(), None if keep is None else tuple(keep))
            for u in store.order}


# ---- validation ------------------------------------------------------------------------------
def _locate(path: Path) -> Path:
    if path.is_dir():
        return path
    old = path.with_name(path.name + ".old")
    if (old / STATE).is_file():
        warnings.warn(f"{path} is missing but {old} holds the previous checkpoint (a save was interrupted "
                      "between its renames); resuming from it")
        return old
    raise FileNotFoundError(f"checkpoint directory {str(path)!r} does not exist")


def _read_state(path: Path) -> dict:
    f = path / STATE
    if not f.is_file():
        raise ValueError(f"{path} has no {STATE}: not a checkpoint written by save_checkpoint, or an incomplete one")
    try:
        state = json.loads(f.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{f} is corrupt ({e})") from e
    if not isinstance(state, dict) or state.get("format") != FORMAT:
        raise ValueError(f"{f} is not a {FORMAT} state file")
    if state.get("version") != VERSION:
        raise ValueError(f"{f} has format version {state.get('version')!r}; this megatrain_nb reads version "
                         f"{VERSION}")
    missing = [k for k in ("config", "optim_cfg", "engine_cfg", "steps_done", "unit_steps", "numel", "rng",
                           "history", "files", "tensors") if k not in state]
    if missing:
        raise ValueError(f"{f} lacks {missing}; the file is corrupt")
    if not isinstance(state["files"], dict) or not isinstance(state.get("crc32", {}), dict):
        raise ValueError(f"{f}: field files / crc32 is malformed; the file is corrupt: resume an earlier checkpoint")
    for name, size in state["files"].items():
        p = path / name
        if not p.is_file():
            raise ValueError(f"{p} is missing; the checkpoint is incomplete")
        if p.stat().st_size != size:
            raise ValueError(f"{p} has {p.stat().st_size} bytes, {STATE} recorded {size}: the file is corrupt "
                             "or truncated")
    return state


def _verify(path: Path, state: dict, chunk: int = 16 << 20) -> None:
    """Each file's CRC-32 against the one state.json recorded (checkpoints written before checksums: none)."""
    crcs = state.get("crc32") or {}
    buf = bytearray(chunk)
    for name in state["files"]:
        if name not in crcs:
            continue
        crc, view = 0, memoryview(buf)
        with open(path / name, "rb") as fh:
            while n := fh.readinto(buf):
                crc = zlib.crc32(view[:n], crc)
        if crc != crcs[name]:
            raise ValueError(f"{path / name} is corrupt: its CRC-32 is {crc:#010x}, {STATE} recorded {crcs[name]:#010x} "
                             "(bytes changed on disk or in a copy); resume an earlier checkpoint, or save again from "
                             "a live session")


# ---- files -----------------------------------------------------------------------------------
def _write_json(f: Path, obj) -> None:
    f.write_text(json.dumps(obj, indent=1))  # fsynced with the directory by publish.publish
