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

Note: [Atomic save] everything is written into ``<path>.tmp-<pid>`` and fsynced; then an existing
``<path>`` is renamed to ``<path>.old``, the temporary directory is renamed to ``<path>``, and
``<path>.old`` is deleted. A crash at any point leaves a complete checkpoint at ``<path>`` (old or
new) or, between the two renames only, the previous one at ``<path>.old``, which ``resume`` then
loads (with a warning) and the next ``save_checkpoint`` cleans up.
"""
from __future__ import annotations

import base64
import dataclasses
import json
import os
import random
import shutil
import warnings
from pathlib import Path

import torch

from .collective_save import device_counts_elsewhere, one_writer
from . import compact_state

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
    next step would read. Atomic (see Note: [Atomic save]): ``path`` holds the previous checkpoint
    until the new one is complete. Under data parallel every rank, or rank 0 alone, may call it: rank 0
    writes, the others return once it is complete (Note: [One writer] in host/collective_save.py).

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
        OSError: the disk refused a write; ``path`` is then untouched.
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
    tmp = path.with_name(f"{path.name}.tmp-{os.getpid()}")
    if tmp.exists():
        shutil.rmtree(tmp)  # our own leftover from an earlier failed save
    tmp.mkdir(parents=True)
    try:
        state["files"], state["tensors"] = _write_slabs(session.store, tmp, max_shard_bytes)
        _write_json(tmp / STATE, state)
        _fsync_dir(tmp)
        _publish(tmp, path)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
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
    config = _config(state)
    settings = {**_settings(state["optim_cfg"]), **_settings(state["engine_cfg"]), **overrides}
    session = make(config, _init=lambda store: _load_slabs(store, path, state), **settings)
    for u in session.store.order:
        session.optim.set_steps_done(u, state["unit_steps"][str(u)])
    _set_engine_steps(session.engine, state["steps_done"])
    if state.get("keep") is not None and not set(overrides) & {f.name for f in dataclasses.fields(session.engine_cfg)}:
        session.engine.keep = list(state["keep"])  # the same activation policy, so the same kernels run
        if state.get("placement_free_bytes") is not None:  # and the same placement (Note: [Placement])
            from ..machine.placement import Search

            session.engine.device_updates.search = Search.done_with(state["placement_free_bytes"])
    _set_rng(state["rng"])
    session.history = _history(state["history"])
    if hasattr(session, "skipped_steps"):
        session.skipped_steps = state.get("skipped_steps", 0)
    session.data_state = state.get("data_state")
    session.store.refresh_shadow()
    return session


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
    return torch.frombuffer(bytearray(base64.b64decode(s)), dtype=torch.uint8)


def _get_rng() -> dict:
    v, internal, gauss = random.getstate()
    cuda = None
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        cuda = [_b64(s) for s in torch.cuda.get_rng_state_all()]
    return {"torch": _b64(torch.get_rng_state()), "cuda": cuda, "python": [v, list(internal), gauss]}


def _set_rng(rng: dict) -> None:
    torch.set_rng_state(_unb64(rng["torch"]))
    v, internal, gauss = rng["python"]
    random.setstate((v, tuple(internal), gauss))
    if rng.get("cuda") and torch.cuda.is_available():
        states, n = [_unb64(s) for s in rng["cuda"]], torch.cuda.device_count()
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
def _write_slabs(store, out: Path, max_bytes: int) -> tuple[dict, dict]:
    """Write every unit's slabs as flat fp32 pieces into files of <= max_bytes.

    Returns (files: name -> bytes on disk, tensors: "unit.<u>.<kind>" -> [[file, key, start, numel]]).
    """
    from safetensors.torch import save_file

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
                files[-1][key] = flat[a:b]  # a view: no copy; safetensors writes from its memory
                size += b - a
                index[name].append([len(files) - 1, key, a, b - a])
    names = [f"slabs-{k + 1:05d}.safetensors" for k in range(len(files))]
    sizes = {}
    for name, tensors in zip(names, files):
        f = out / name
        save_file(tensors, str(f), metadata={"format": "pt"})
        _fsync(f)
        sizes[name] = f.stat().st_size
    for pieces in index.values():
        for p in pieces:
            p[0] = names[p[0]]
    return sizes, index


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
        fp32 = t if saved[u] is None else compact_state.dequantize(t, saved[u], k)
        if unit.compact is None:
            getattr(unit, kind).copy_(fp32)
        else:
            compact_state.quantize_into(getattr(unit, kind), unit.compact, k, fp32)


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
    for name, size in state["files"].items():
        p = path / name
        if not p.is_file():
            raise ValueError(f"{p} is missing; the checkpoint is incomplete")
        if p.stat().st_size != size:
            raise ValueError(f"{p} has {p.stat().st_size} bytes, {STATE} recorded {size}: the file is corrupt "
                             "or truncated")
    return state


# ---- files -----------------------------------------------------------------------------------
def _write_json(f: Path, obj) -> None:
    f.write_text(json.dumps(obj, indent=1))
    _fsync(f)


def _fsync(f: Path) -> None:
    fd = os.open(f, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_dir(d: Path) -> None:
    """Make renames and new entries in ``d`` durable (a no-op where directories cannot be opened)."""
    try:
        fd = os.open(d, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _publish(tmp: Path, path: Path) -> None:
    """Replace ``path`` by ``tmp``; see Note: [Atomic save]."""
    old = path.with_name(path.name + ".old")
    if path.exists():
        if old.exists():
            shutil.rmtree(old)  # a leftover of a save that completed its renames: path is complete
        os.rename(path, old)
    # else: an existing .old is the only complete checkpoint until the next rename; keep it till then
    os.rename(tmp, path)
    _fsync_dir(path.parent)
    if old.exists():
        shutil.rmtree(old)
