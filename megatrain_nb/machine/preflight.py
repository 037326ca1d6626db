"""Preflight: will this model and these settings fit in host RAM and device memory? Asked before a
single slab is allocated, answered with numbers and with the settings that would make it fit.

Owns: the byte count of a configuration as the code allocates it — the host store exactly as
``HostStore`` lays it out (aligned per-unit slabs), the engine's transfer staging and its device
buffers exactly as ``Engine.__init__`` sizes them, activations and logits by the planner's per-token
estimate — its comparison with the host RAM and device memory available within the budgets
(``budget.host_available``, ``budget.device_free``: Note: [Budgets]), and the advice text shared with ``oom_advice``. The Adam moments are
counted for each ``OptimConfig.optimizer_state`` ("fp32", "int8", "int4") unit by unit, as
``compact_state.layout_for`` lays them out; ``host_table`` puts the settings side by side for a few
model shapes and the largest depth this machine's host RAM holds at each.
Does not own: step-time modelling or what-if sweeps over hardware (planner), allocating anything,
the compact moments' format (compact_state.py).
Over 400 lines because it counts every allocation a Session makes before it makes one (store, staging,
device buffers, activations) and words the refusal: one count, so that the refusal, ``host_table`` and the
tests that hold it equal to HostStore and the engine read the same numbers.
"""
from __future__ import annotations

import math

import torch

from ..host import compact_state, grad_ring
from ..host.embed_grad import rows_bytes
from . import budget as budgets
from ..model.binding import Layout
from ..config import MOMENT_STAGING_BYTES, OPTIMIZER_STATES, EngineConfig, pinned_budget
from ..host.host_store import unit_layouts
from .shape import QWEN25, loss_positions

_GIB = 1 << 30
_CUDA_WORKSPACE = 512 << 20  # cuBLAS / attention workspaces and allocator slack; the CUDA context is
# already outside mem_get_info's free bytes


class PreflightError(MemoryError, ValueError):
    """The configuration does not fit; the message gives GiB needed vs available and what to change."""


def gib(n: float) -> str:
    """Bytes as GiB for messages: 2 decimals from 1 GiB up, else 3 significant digits."""
    x = n / _GIB
    return f"{x:.2f} GiB" if x >= 1 else f"{x:.3g} GiB"


def estimate(arch_or_config, engine_cfg: EngineConfig | None = None, *, batch: int | None = None,
             seq: int | None = None, optimizer_state: str | None = None,
             keep_fp32: tuple[str, ...] | None = None, grad_clip: float | None = None) -> dict:
    """Bytes a Session of this model and these settings allocates, next to what is available. Never raises
    for lack of memory (``check`` does).

    Args:
        arch_or_config: an ``hf.Architecture``, a transformers config (its skeleton is built on the
            meta device: no weights) or a ``Session`` (whose ``engine_cfg`` is the default).
        engine_cfg: the EngineConfig; None: the Session's, else ``EngineConfig()``.
        batch, seq: a step's shape; with both, activations, embedding rows and logits are counted.
        optimizer_state: as ``OptimConfig.optimizer_state``: "fp32", "int8" or "int4"; None: a Session's
            ``optim_cfg`` (with its ``compact_keep_fp32``), else "fp32".
        keep_fp32: as ``OptimConfig.compact_keep_fp32``: name patterns whose moments stay fp32 (None: the
            input embedding's, ``compact_state.DEFAULT_KEEP``); read only with a compact optimizer_state.
        grad_clip: as ``OptimConfig.grad_clip`` (a Session's own where one is given): with it every unit keeps a
            gradient slab, without it the gradient ring holds them (Note: [Gradient ring] in host/grad_ring.py).
    Returns:
        dict with
          ``store``: as ``HostStore.bytes_report()`` — master, grad, exp_avg, exp_avg_sq, shadow, grad_ring, grad_rows,
            total, params, bytes_per_param (exact; a compact moment is its slab of
            ``compact_state.moment_words`` fp32 words per unit);
          ``bytes_per_param``: master, grad, moments (both), shadow, store, staging, host (``host``'s
            needed) per parameter;
          ``host``: store, staging (transfer buffers, pinned on CUDA; with them, where groups may be made
            resident, those their moments come in through), device_buffers (on "cpu" the
            "device" is host RAM), needed, available;
          ``device``: weight_slots, grad_slots, head_slots, cast_stage (cast_on_device), embedding_rows,
            activations, logits, workspace, needed, available (None on "cpu": everything counts as host);
          ``fits_host``, ``fits_device``, ``fits`` (bools) and ``settings`` (what was assumed,
            optimizer_state and keep_fp32 included).
    Raises:
        ValueError: an invalid setting (e.g. pin_store=True without CUDA, an unknown optimizer_state), an
            unsupported model.
    Example:
        >>> est = estimate(config, EngineConfig(device="cpu"), batch=8, seq=1024)  # doctest: +SKIP
        >>> est["host"]["needed"] / 2**30, est["fits"]                            # doctest: +SKIP
    """
    oc = getattr(arch_or_config, "optim_cfg", None)  # a Session's
    if optimizer_state is None:
        optimizer_state, keep_fp32 = (oc.optimizer_state, oc.compact_keep_fp32) if oc is not None else ("fp32", keep_fp32)
    if oc is not None:
        grad_clip = oc.grad_clip
    _check_state(optimizer_state)
    arch, cfg = _resolve(arch_or_config, engine_cfg)
    if (batch is None) != (seq is None):
        raise ValueError(f"pass both batch and seq, or neither (got batch={batch!r}, seq={seq!r})")

    cuda = torch.device(cfg.device).type == "cuda"
    pin, cast = resolve_pinning(cfg, arch, optimizer_state=optimizer_state, keep_fp32=keep_fp32, grad_clip=grad_clip)
    d = torch.tensor([], dtype=cfg.dtype).element_size()
    layouts = unit_layouts(arch)
    units = {u: lay for u, (lay, _) in layouts.items()}

    # host store, as HostStore.__init__ allocates it
    numel = {u: lay.numel for u, lay in units.items()}
    ring = _ring(cfg, grad_clip)
    words = unit_moment_words(arch, optimizer_state, keep_fp32, layouts)
    store = _store(layouts, d, pin, words, ring, _embed_rows(arch, layouts, words, ring,
                                                               None if batch is None else batch * seq))

    # engine buffers, as Engine.__init__ allocates them (Note: [Staging])
    n_layer = max(numel[i] for i in range(arch.num_layers))
    chunk, budget, staging = _staging(cfg, d, max(numel.values()), pin or cast, cuda)
    head = Layout.build(arch.head_params() + ([(arch.embed_name, arch.embed.weight.shape)] if arch.tied else []))
    slots = resolve_weight_slots(cfg, arch)
    dev = {"weight_slots": slots * n_layer * d, "grad_slots": 2 * n_layer * d,
           "head_slots": 2 * head.numel * d,
           "cast_stage": 2 * chunk * 4 if cast else 0,  # fp32 landing buffers
           "embedding_rows": 0, "activations": 0, "logits": 0,
           "workspace": _CUDA_WORKSPACE if cuda else 0}
    if batch is not None:
        dev.update(_activations(arch, cfg, batch, seq, d))
    dev["needed"] = sum(dev.values())

    host = {"store": store["total"], "staging": staging, "device_buffers": 0 if cuda else dev["needed"]}
    host["needed"] = sum(host.values())
    per = {k: v / store["params"] for k, v in (("master", store["master"]), ("grad", store["grad"]),
                                                ("grad_ring", store["grad_ring"]), ("grad_rows", store["grad_rows"]),
                                                ("moments", store["exp_avg"] + store["exp_avg_sq"]),
                                                ("shadow", store["shadow"]), ("store", store["total"]),
                                                ("staging", staging), ("host", host["needed"]))}
    host["available"] = budgets.host_available(cfg.host_memory)
    dev["available"] = budgets.device_free(cfg.device, cfg.device_memory) if cuda else None
    fits_host = host["needed"] <= host["available"]
    fits_device = dev["available"] is None or dev["needed"] <= dev["available"]
    settings = dict(device=cfg.device, dtype=str(cfg.dtype).removeprefix("torch."), pin_store=pin, cast_on_device=cast,
                    weight_slots=slots, micro_batch_size=cfg.micro_batch_size,
                    checkpoint_every=cfg.checkpoint_every, pinned_budget_bytes=budget,
                    loss_chunk_tokens=cfg.loss_chunk_tokens, lean_activations=cfg.lean_activations, batch=batch, seq=seq,
                    optimizer_state=optimizer_state, keep_fp32=keep_fp32, grad_clip=grad_clip, grad_ring=ring,
                    device_memory=cfg.device_memory, host_memory=cfg.host_memory,
                    model=f"{type(arch.config).__name__.removesuffix('Config')} {_count(store['params'])}")
    return {"store": store, "bytes_per_param": per, "host": host, "device": dev, "fits_host": fits_host,
            "fits_device": fits_device, "fits": fits_host and fits_device, "settings": settings}


def host_table(configs=None, *, host_bytes: int | None = None, keep_fp32: tuple[str, ...] | None = None,
               engine_cfg: EngineConfig | None = None, grad_clip: float | None = None, tokens: int | None = None):
    """Host RAM of each ``optimizer_state`` for a few models, and the deepest model of each width it holds.

    The store is counted exactly as ``estimate`` counts it (per unit, from the model's skeleton on the meta
    device: nothing is allocated), plus the engine's transfer staging; with ``engine_cfg=None`` the engine's
    default on CUDA where the store fits in 90% of RAM: bf16 grads, ``cast_on_device`` (the fp32 master
    pinned, no copy) and a 512 MiB pinned staging pool. Activations and device buffers are not host bytes
    on CUDA; the CUDA context and libraries (~2 GiB, ``planner.H200.host_runtime_bytes``) are not counted.
    The largest model keeps the width and scales ``num_hidden_layers`` (layers are alike: each adds the
    same bytes).

    Args:
        configs: a transformers config or a dict of its fields (``model_type`` names the family), or
            {name: config or dict}; None: Qwen2.5 3B, 7B, 14B and 32B (``shape.QWEN25``).
        host_bytes: host RAM the store may take; None: what is available now (``budget.host_available``
            within ``engine_cfg.host_memory``).
        keep_fp32: as ``OptimConfig.compact_keep_fp32`` (None: the input embedding keeps fp32 moments).
        engine_cfg: an EngineConfig instead of the CUDA default (pinning then as ``resolve_pinning``).
        grad_clip: as ``OptimConfig.grad_clip``: with it every unit keeps a gradient slab; without it (and with
            ``engine_cfg.grad_ring``) the ring holds the layers' and head's (Note: [Gradient ring]).
        tokens: a step's tokens (batch x seq): with the ring, an untied embedding's gradient is the rows they
            touch, counted for that many (Note: [Embedding rows]); None: the whole table, the most a step can touch.
    Returns:
        pandas DataFrame, one row per model and optimizer_state: model, optimizer_state, layers, params,
        gradients ("ring" or "slabs"), master / grad (slabs and the embedding's rows) / moments / shadow / store (bytes a parameter), store_GiB, staging_GiB, host_GiB
        (store + staging), available_GiB, fits, max_layers and max_params (the deepest model of this
        width that fits: 0 where not even the embedding and head do).
    Raises:
        ValueError: a config the skeleton cannot be built from (the message names it).
    Example:
        >>> df = host_table(host_bytes=118 << 30)  # doctest: +SKIP
        >>> df.pivot(index="model", columns="optimizer_state", values="host_GiB")  # doctest: +SKIP
    """
    import pandas as pd
    from transformers import AutoConfig

    if configs is None:
        configs = QWEN25
    if not isinstance(configs, dict) or "hidden_size" in configs:
        configs = {None: configs}
    cfg = engine_cfg or EngineConfig(dtype=torch.bfloat16)
    host_bytes = budgets.host_available(cfg.host_memory) if host_bytes is None else int(host_bytes)
    cuda = engine_cfg is None or torch.device(cfg.device).type == "cuda"
    d = torch.tensor([], dtype=cfg.dtype).element_size()
    ring = _ring(cfg, grad_clip)
    rows = []
    for name, config in configs.items():
        if isinstance(config, dict):
            kw = dict(config)
            config = AutoConfig.for_model(kw.pop("model_type", "llama"), **kw)
        arch = _resolve(config, cfg)[0]
        layouts = unit_layouts(arch)
        L, numel = arch.num_layers, {u: lay.numel for u, (lay, _) in layouts.items()}
        layer_params = sum(s.numel() for i in range(L) for s in layouts[i][0].shapes) / L
        for state in OPTIMIZER_STATES:
            pin, cast = (resolve_pinning(cfg, arch, optimizer_state=state, keep_fp32=keep_fp32, grad_clip=grad_clip)
                         if engine_cfg else (False, True))
            words = unit_moment_words(arch, state, keep_fp32, layouts)
            store = _store(layouts, d, pin, words, ring, _embed_rows(arch, layouts, words, ring, tokens))
            staging = _staging(cfg, d, max(numel.values()), pin or cast, cuda)[2]
            need, P = store["total"] + staging, store["params"]
            grad = 0 if ring else d  # a layer more adds no ring buffer (alike layers: the largest stays)
            per_layer = sum((4 + grad + (d if pin else 0)) * numel[i] + 8 * words[i] for i in range(L)) / L
            deepest = max(0, L + math.floor((host_bytes - need) / per_layer))
            rows.append(dict(model=name or f"{type(config).__name__.removesuffix('Config')} {_count(P)}",
                             optimizer_state=state, gradients="ring" if ring else "slabs", layers=L, params=P,
                             master=store["master"] / P,
                             grad=(store["grad"] + store["grad_rows"]) / P, moments=(store["exp_avg"] + store["exp_avg_sq"]) / P,
                             shadow=store["shadow"] / P, store=store["bytes_per_param"], store_GiB=store["total"] / _GIB,
                             staging_GiB=staging / _GIB, host_GiB=need / _GIB, available_GiB=host_bytes / _GIB,
                             fits=need <= host_bytes, max_layers=deepest,
                             max_params=round(P + (deepest - L) * layer_params) if deepest else 0))
    return pd.DataFrame(rows)


def unit_moment_words(arch, optimizer_state: str = "fp32", keep_fp32: tuple[str, ...] | None = None,
                      layouts: dict | None = None) -> dict[int, int]:
    """fp32 words of one Adam moment's slab of each unit, as the host store allocates it.

    Args:
        arch: an ``hf.Architecture``.
        optimizer_state: "fp32" (a word a position), "int8" or "int4".
        keep_fp32: name patterns whose moments stay fp32 (``compact_state.layout_for``'s ``keep``).
        layouts: ``host_store.unit_layouts(arch)``, when at hand.
    Returns:
        unit -> words: the unit's padded numel where every position keeps fp32 moments (fp32, or a unit
        ``layout_for`` keeps whole), else ``moment_words`` of its compact layout over (checkpoint name,
        offset, numel) of each tensor (Note: [Compact slab] in compact_state.py).
    Example:
        >>> unit_moment_words(arch, "int8")  # doctest: +SKIP
        {-1: 544997376, 0: 1319424, ...}
    """
    out = {}
    for u, (lay, prefix) in (layouts or unit_layouts(arch)).items():
        c = compact_state.layout_for(optimizer_state, [(prefix + n, o, s.numel()) for n, s, o in lay.items()],
                                     keep_fp32)
        out[u] = lay.numel if c is None else compact_state.moment_words(optimizer_state, c.n, c.kept)
    return out


def _check_state(optimizer_state) -> None:
    if optimizer_state not in OPTIMIZER_STATES:
        raise ValueError(f"optimizer_state={optimizer_state!r}: choose one of {OPTIMIZER_STATES}")


def _ring(cfg: EngineConfig, grad_clip) -> bool:
    """Whether the gradient ring holds the layers' and head's gradients (no slabs) under these settings."""
    return grad_ring.slab_reason(enabled=cfg.grad_ring, grad_clip=grad_clip, overlap_optimizer=cfg.overlap_optimizer,
                                 nonfinite=cfg.nonfinite, pass_batch_size=cfg.pass_batch_size, shared=False) is None


def _embed_rows(arch, layouts: dict, words: dict[int, int], ring: bool, tokens: int | None) -> int | None:
    """Rows the embedding's touched-rows buffer holds at most (Note: [Embedding rows] in host/embed_grad.py): a
    step's ``tokens``, no more than the table (None: the whole table); None where it keeps a slab (as
    ``HostStore._embedding_slab``: the ring off, tied, or compact embedding moments)."""
    if not ring or arch.tied or words[-1] != layouts[-1][0].numel:
        return None
    V = arch.embed.weight.shape[0]
    return V if tokens is None else min(V, tokens)


def _store(layouts: dict, d: int, pin: bool, words: dict[int, int], ring: bool = False,
           embed_rows: int | None = None) -> dict:
    """HostStore.bytes_report() of these unit layouts: grads in ``d`` bytes (the embedding's fp32), a shadow
    of ``d`` bytes with ``pin``, moments of ``words`` fp32 words each; with ``ring`` no slab for the layers and
    head, only the ring's buffers (Note: [Gradient ring] in host/grad_ring.py), and with ``embed_rows`` no slab
    for the embedding either, that many touched rows (fp32, and their ids) instead."""
    numel = {u: lay.numel for u, (lay, _) in layouts.items()}
    N = sum(numel.values())
    width = layouts[-1][0].shapes[0][-1]
    store = {"master": 4 * N, "grad": (4 * numel[-1] if embed_rows is None else 0)  # the embedding's: fp32
             + (0 if ring else d * (N - numel[-1])),
             "exp_avg": 4 * sum(words.values()), "exp_avg_sq": 4 * sum(words.values()), "shadow": d * N if pin else 0,
             "grad_ring": grad_ring.ring_bytes(numel, d) if ring else 0,
             "grad_ring_overflow": 0,  # at rest: only while the host's AdamW is behind (Note: [Ring overflow])
             "grad_rows": 0 if embed_rows is None else rows_bytes(embed_rows, width)}
    store["total"] = sum(store.values())
    store["params"] = sum(s.numel() for lay, _ in layouts.values() for s in lay.shapes)
    store["bytes_per_param"] = store["total"] / store["params"]
    return store


def _staging(cfg: EngineConfig, d: int, largest: int, pinned: bool, cuda: bool) -> tuple[int, int, int]:
    """(chunk elements, pinned budget, staging bytes) as Engine.__init__ sizes them (Note: [Staging]); on CUDA,
    where groups may be made resident, with the two buffers their moments come in through (Note: [Late
    moments] in step/late_moments.py)."""
    chunk = min(cfg.transfer_chunk_bytes // d, -(-largest // 64) * 64)
    budget = pinned_budget(cfg.pinned_budget_bytes, pinned)
    late = 2 * MOMENT_STAGING_BYTES if cuda and cfg.placement not in ("host", "stream") else 0
    return chunk, budget, max(4, budget // cfg.transfer_chunk_bytes) * chunk * d + late


def check(arch_or_config, engine_cfg: EngineConfig | None = None, *, batch: int | None = None,
          seq: int | None = None, optimizer_state: str | None = None,
          keep_fp32: tuple[str, ...] | None = None, grad_clip: float | None = None) -> dict:
    """``estimate``, raising when host RAM or device memory is short.

    Args:
        As ``estimate``: a Session passes ``optimizer_state=optim_cfg.optimizer_state,
        keep_fp32=optim_cfg.compact_keep_fp32``.
    Returns:
        The estimate, when everything fits.
    Raises:
        PreflightError: (a MemoryError and a ValueError) naming GiB needed vs available, what needs
            them, and the settings to change; short of host RAM, the host RAM each other optimizer_state
            needs and which of them fit.
    Example:
        >>> check(config, EngineConfig(device="cuda"), batch=4, seq=4096, optimizer_state="int8")  # doctest: +SKIP
    """
    est = estimate(arch_or_config, engine_cfg, batch=batch, seq=seq, optimizer_state=optimizer_state,
                   keep_fp32=keep_fp32, grad_clip=grad_clip)
    if est["fits"]:
        return est
    parts = []
    if not est["fits_host"]:
        arch, cfg = _resolve(arch_or_config, engine_cfg)
        st = est["settings"]
        others = {k: estimate(arch, cfg, batch=batch, seq=seq, optimizer_state=k, keep_fp32=st["keep_fp32"],
                           grad_clip=st["grad_clip"])["host"]
                  for k in OPTIMIZER_STATES if k != st["optimizer_state"]}
        parts.append(_host_message(est, {k: h["needed"] for k, h in others.items()}))
    if not est["fits_device"]:
        parts.append(_device_message(est))
    raise PreflightError("\n".join(parts))


def oom_advice(exc: BaseException, engine_cfg: EngineConfig, batch_shape) -> str:
    """Advice for a ``torch.cuda.OutOfMemoryError`` raised during a step, in ``check``'s words.

    Args:
        exc: the out-of-memory error.
        engine_cfg: the session's EngineConfig.
        batch_shape: (batch, seq) of the step that failed.
    Returns:
        A message: the shape, the device's memory now, torch's first line, and the settings to change.
    """
    B, T = (int(x) for x in tuple(batch_shape)[:2])
    first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    lines = [f"Out of device memory during a step of batch {B} x seq {T} on {engine_cfg.device} ({first})."]
    if torch.device(engine_cfg.device).type == "cuda" and torch.cuda.is_available():
        free, total = torch.cuda.mem_get_info(engine_cfg.device)
        peak = torch.cuda.max_memory_allocated(engine_cfg.device)
        lines.append(f"Device memory: {gib(free)} free of {gib(total)}; this process's peak allocation {gib(peak)}.")
    lines.append("To fit, change one of: " + "; ".join(_device_advice(engine_cfg, B, T, None)) + ".")
    return "\n".join(lines)


# ---- pieces ------------------------------------------------------------------------------------
def _resolve(arch_or_config, engine_cfg):
    from ..model.hf import Architecture, load_architecture

    x = arch_or_config
    if hasattr(x, "arch") and hasattr(x, "engine_cfg"):  # a Session
        return x.arch, engine_cfg or x.engine_cfg
    arch = x if isinstance(x, Architecture) else load_architecture(x)
    return arch, engine_cfg or EngineConfig()


def _activations(arch, cfg: EngineConfig, batch: int, seq: int, d: int) -> dict:
    """Embedding rows, layer activations and loss logits of one step (planner's per-token estimate).

    checkpoint_every=None on CUDA keeps layers while ``activation_budget`` allows, so only its floor
    counts: every layer recomputed, one at a time.
    """
    from .shape import act_bytes_per_token, model_shape

    L, T = arch.num_layers, batch * seq
    H, V = arch.embed.weight.shape[1], arch.embed.weight.shape[0]
    boundary = T * H * d  # one layer's input, kept by a recompute block
    try:
        act = T * act_bytes_per_token(model_shape(arch.config), d, lean=cfg.lean_activations)
    except (ValueError, KeyError, TypeError):
        act = 8 * boundary  # config fields the planner does not know: a rough SwiGLU layer
    K = cfg.checkpoint_every
    if K == 0 or (K is None and torch.device(cfg.device).type == "cpu"):
        acts = L * act  # keep every layer
    else:
        K = K or 1
        acts = math.ceil(L / K) * boundary + K * act
    mb = min(batch, cfg.micro_batch_size or batch)
    return {"embedding_rows": 2 * boundary, "activations": acts,
            "logits": mb * min(seq, loss_positions(cfg.loss_chunk_tokens, mb)) * V * (d + 8)}  # compute + fp32 logits + grad


def _count(n: int) -> str:
    return f"{n / 1e9:.2f}B" if n >= 1e9 else f"{n / 1e6:.1f}M" if n >= 1e6 else f"{n:,}"


def _host_message(est: dict, others: dict[str, int] | None = None) -> str:
    """``others``: optimizer_state -> host bytes it needs, for the settings not used."""
    s, h, st = est["store"], est["host"], est["settings"]
    others = others or {}
    fit = {k: n for k, n in others.items() if n <= h["available"]}
    head = (f"Not enough host RAM: {st['model']} needs {gib(h['needed'])} with optimizer_state={st['optimizer_state']!r} "
            f"({s['bytes_per_param']:.1f} bytes a parameter), {gib(h['available'])} available{_within_host(st)}")
    if fit:
        head += "; " + ", ".join(f"optimizer_state={k!r} needs {gib(n)} (fits)" for k, n in fit.items())
    elif others:
        head += "; no optimizer_state fits: " + ", ".join(f"{k!r} needs {gib(n)}" for k, n in others.items())
    what = (f"host store {gib(s['total'])} ({_count(s['params'])} params x {s['bytes_per_param']:.1f} bytes: "
            f"master {gib(s['master'])}, grads {gib(s['grad'])}, Adam moments {gib(s['exp_avg'] + s['exp_avg_sq'])}"
            + (f", pinned shadow {gib(s['shadow'])}" if s["shadow"] else "")
            + (f", gradient ring {gib(s['grad_ring'])}" if s.get("grad_ring") else "")
            + (f", the embedding's gradient rows {gib(s['grad_rows'])}" if s.get("grad_rows") else "")
            + f"), transfer staging {gib(h['staging'])}"
            + (f", layer buffers and activations {gib(h['device_buffers'])} (device='cpu' keeps them in RAM)"
               if h["device_buffers"] else ""))
    advice = [f"optimizer_state={k!r} (needs {gib(n)}; moments of ~{compact_state.bytes_per_param(k):.2f} bytes "
              "a parameter, the input embedding's and small tensors' fp32)" for k, n in fit.items()]
    if s["shadow"]:
        advice.append(f"pin_store=False (saves {gib(s['shadow'])})")
    if h["staging"] > (64 << 20):
        advice.append(f"pinned_budget_bytes={max(128 << 20, st['pinned_budget_bytes'] // 4)} (staging now "
                      f"{gib(h['staging'])})")
    if h["device_buffers"]:
        if torch.cuda.is_available():
            advice.append(f"device='cuda' (moves the {gib(h['device_buffers'])} of layer buffers and activations "
                          "off RAM)")
        advice += _device_advice_settings(st)
    advice.append(f"a smaller model (the store alone needs {s['bytes_per_param']:.1f} bytes a parameter)")
    return f"{head} — {what}. To fit, change one of: {'; '.join(advice)}."


def _within_host(st: dict) -> str:
    """The host budget's part of the message: the budget and what the process already holds."""
    if not st.get("host_memory"):
        return ""
    return (f" within host_memory={st['host_memory']} ({gib(st['host_memory'])}; the process holds "
            f"{gib(budgets.host_rss())} resident already)")


def _device_message(est: dict) -> str:
    d, st = est["device"], est["settings"]
    names = ("weight_slots", "grad_slots", "head_slots", "cast_stage", "embedding_rows", "activations", "logits",
             "workspace")
    what = ", ".join(f"{n.replace('_', ' ')} {gib(d[n])}" for n in names if d[n])
    within = (f" within device_memory={st['device_memory']} ({gib(st['device_memory'])}, the caching allocator's "
              "cap)" if st.get("device_memory") else "")
    return (f"Not enough device memory on {st['device']}: needs {gib(d['needed'])}, {gib(d['available'])} free{within} — "
            f"{what}. To fit, change one of: {'; '.join(_device_advice(st, st['batch'], st['seq'], d))}.")


def _device_advice_settings(st: dict) -> list[str]:
    """The activation settings (shared by the host message on "cpu" and the device advice)."""
    out = []
    B, mbs = st["batch"], st["micro_batch_size"]
    if st.get("lean_activations") is False:
        out.append("lean_activations=True (norms and MLP keep about half: 8*hidden + 2*d*intermediate fewer "
                   "bytes per token and layer)")
    passes = st.get("pass_batch_size")
    if B is not None and (passes or B) > 1:
        out.append(f"pass_batch_size={max(1, (passes or B) // 2)} (now {passes}: gradient accumulation, one pass's "
                   "activations at a time)")
    if B is not None and (mbs or B) > 1:
        out.append(f"micro_batch_size={max(1, (mbs or B) // 2)} (now {mbs}: smaller logits and per-layer temporaries)")
    if st["checkpoint_every"] != 1:
        out.append(f"checkpoint_every=1 (now {st['checkpoint_every']}: recompute every layer, keep only its input)")
    rows = min(B, mbs or B) if B else 1  # a micro-batch's rows: what a loss chunk spans
    pos = st["seq"] and min(st["seq"], loss_positions(st["loss_chunk_tokens"], rows))
    if pos and pos > 128:
        out.append(f"loss_chunk_tokens={max(128, pos // 2)} (now {st['loss_chunk_tokens']}: {pos} positions a chunk)")
    if B is not None:
        out.append(f"a smaller batch or seq (now {B} x {st['seq']})")
    return out


def _device_advice(cfg, batch, seq, dev: dict | None) -> list[str]:
    """Settings that lower device memory, most effective first; ``cfg``: EngineConfig or est['settings']."""
    get = cfg.get if isinstance(cfg, dict) else lambda k: getattr(cfg, k)
    dtype = str(get("dtype")).removeprefix("torch.")
    st = dict(batch=batch, seq=seq, micro_batch_size=get("micro_batch_size"), pass_batch_size=get("pass_batch_size"),
              checkpoint_every=get("checkpoint_every"), loss_chunk_tokens=get("loss_chunk_tokens"),
              lean_activations=get("lean_activations"))
    out = _device_advice_settings(st)
    if (get("weight_slots") or 2) > 2:
        each = f"; each {gib(dev['weight_slots'] / get('weight_slots'))}" if dev else ""
        out.append(f"weight_slots=2 (now {get('weight_slots')}{each})")
    if dtype == "float32":
        out.append("dtype=torch.bfloat16 (halves every device buffer)")
    if torch.device(get("device")).type == "cuda":
        out.append("device='cpu' (host RAM instead, slowly)")
    out.append("a smaller model")
    return out


ALLOCATOR = "expandable_segments:True"


def cuda_allocator() -> str:
    """Let the CUDA caching allocator grow segments in place (``expandable_segments``), unless told otherwise.

    Note: [Allocator] placement "auto" moves tens of GiB of state between host and device while it
    times its candidates, and each batch size keeps a different set of activations: with fixed-size
    segments the freed blocks stay reserved but fragmented, and a trial step that fits on paper runs
    out of memory (measured on the H200, 3B x 8: "10.78 GiB reserved but unallocated" at the failure;
    with expandable segments the same search ran to the end, 382 model TFLOPS). Set before CUDA starts
    (``PYTORCH_CUDA_ALLOC_CONF``, read when the allocator starts), else switched at run time; a
    ``PYTORCH_CUDA_ALLOC_CONF`` of the user's own is left as it is.

    Returns:
        What was done: "user's setting", "set", "switched at run time" or "unavailable".
    """
    import os
    import warnings

    if "PYTORCH_CUDA_ALLOC_CONF" in os.environ or "PYTORCH_ALLOC_CONF" in os.environ:
        return "user's setting"
    if not torch.cuda.is_initialized():
        os.environ["PYTORCH_CUDA_ALLOC_CONF"] = ALLOCATOR
        return "set"
    for fn in (getattr(torch._C, "_accelerator_setAllocatorSettings", None),
               getattr(torch.cuda.memory, "_set_allocator_settings", None)):
        if fn is not None:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", FutureWarning)
                fn(ALLOCATOR)
            return "switched at run time"
    return "unavailable"


def resolve_weight_slots(cfg: EngineConfig, arch) -> int:
    """EngineConfig.weight_slots for this model and device (``placement.weight_slots``: None is 2, or
    one slot per layer under placement "stream" where they fit in a tenth of device memory)."""
    from .placement import weight_slots

    if cfg.weight_slots is not None or cfg.placement != "stream":
        return weight_slots(cfg.weight_slots, cfg.placement, arch.num_layers, 0, None)
    cuda = torch.device(cfg.device).type == "cuda" and torch.cuda.is_available()
    layer = max(lay.numel for u, (lay, _) in unit_layouts(arch).items() if 0 <= u < arch.num_layers)
    total = budgets.device_total(cfg.device, cfg.device_memory) if cuda else None
    return weight_slots(None, cfg.placement, arch.num_layers, layer * torch.tensor([], dtype=cfg.dtype).element_size(),
                        total)


def resolve_pinning(cfg: EngineConfig, arch, *, optimizer_state: str = "fp32", keep_fp32: tuple[str, ...] | None = None,
                    grad_clip: float | None = None) -> tuple[bool, bool]:
    """Resolve EngineConfig's (pin_store, cast_on_device); pinning needs CUDA.

    Auto (None) pins the fp32 master and casts on the device when CUDA is used and the store fits in
    90% of host RAM: measured faster than a pinned bf16 copy at every batch on the H200 (3B:
    227 vs 194 model TFLOPS at 4x4096, docs/benchmarks.md) and 2 bytes/param smaller. With
    cast_on_device=False, pin_store=None pins a bf16 copy when store + copy fit. The store is counted as
    ``HostStore`` allocates it under these settings (``_store``): the master, the moments of ``optimizer_state``
    (``keep_fp32``'s in fp32) and the gradients where they stay: the gradient ring's buffers and the
    embedding's touched rows (the whole table's, at most) by default, per-parameter slabs with ``grad_clip`` or
    passes (Note: [Gradient ring] in host/grad_ring.py). Counting slabs the ring does not allocate refused the
    device cast to gpt-oss-20b with int4 moments (7.06 bytes a parameter counted, 5.6 allocated): its
    loads were then packed by the host, beside the host's AdamW.
    """
    cuda = torch.device(cfg.device).type == "cuda"
    if cfg.pin_store and not cuda:
        raise ValueError("pin_store=True needs device='cuda' (pinned memory is a CUDA feature); use pin_store=None")
    if cfg.cast_on_device and not cuda:
        raise ValueError("cast_on_device=True needs device='cuda' (it pins host memory); use cast_on_device=None")
    if cfg.pin_store and cfg.cast_on_device:
        raise ValueError("cast_on_device=True and pin_store=True both pin the store; choose one")
    if not cuda:
        return False, False
    if cfg.cast_on_device or cfg.pin_store:
        return bool(cfg.pin_store), bool(cfg.cast_on_device)
    d = torch.tensor([], dtype=cfg.dtype).element_size()
    layouts = unit_layouts(arch)
    words = unit_moment_words(arch, optimizer_state, keep_fp32, layouts)
    ring = _ring(cfg, grad_clip)
    store = _store(layouts, d, False, words, ring, _embed_rows(arch, layouts, words, ring, None))
    ram = budgets.HOST_SHARE * budgets.host_total(cfg.host_memory)
    if cfg.cast_on_device is None and cfg.pin_store is None and store["total"] < ram:
        return False, True
    return cfg.pin_store is None and store["total"] + d * store["params"] < ram, False
