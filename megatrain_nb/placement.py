"""Where each unit's optimizer update and trainable state live: on the host, or resident on the device.

Owns: the public ``placement=`` setting (its modes and the expert dict), the device bytes a resident
unit costs, the order in which units earn residency, and the choice itself with a reason per unit.
Pure Python: no torch, no devices, no clocks. The engine measures the free device memory and applies
what this module decides; ``optim.DeviceAdamW`` holds and updates the resident state.

Placements of one unit (-1 embedding, 0..L-1 decoder layers, L head):
  "host":     today's path: weights stream in from the host master, gradients stream out, AdamW runs
              on the host cores (overlapped with the backward).
  "resident": fp32 master, both moments and the compute-dtype weights stay in device memory across
              steps; no load, no gradient over PCIe; AdamW (torch's fused kernel, fp32) runs on the
              device at the end of the step. The host copy is written back only when someone reads
              it (checkpoint, save_pretrained, close, a placement change).
Modes:
  "auto":   on CUDA, after the first step of a batch size has measured what the activations use,
            the units the next forward needs first become resident while they fit; the rest stay "host".
  "host":   nothing resident (the behaviour before placements existed).
  "stream": nothing kept on the device between steps (reserved for streamed device updates; today
            it places like "host" and says so in each unit's reason).
  {unit: placement}: experts; units not named stay "host".

Note: [Tied head group] a tied model's embedding is also its lm_head, so units -1 and L share one
placement: the head slot holds them together (``Engine.head_layout``), resident or streamed.
"""
from __future__ import annotations

import dataclasses

PLACEMENTS = ("host", "resident")
MODES = ("auto", "host", "stream")
RESERVE_BYTES = 2 << 30  # left free for allocator slack and workspaces when choosing residents


@dataclasses.dataclass(frozen=True)
class Choice:
    """One unit's placement and why it was chosen."""

    placement: str
    reason: str


def validate(placement, num_layers: int, tied: bool):
    """Check a ``placement=`` value; returns it (a dict is copied with int keys).

    Raises:
        ValueError: an unknown mode, a unit index outside [-1, L], an unknown placement, or a tied
            model whose embedding and head are placed apart (Note: [Tied head group]).
    """
    if isinstance(placement, str):
        if placement not in MODES:
            raise ValueError(f"placement={placement!r}: use one of {MODES} or a dict {{unit: one of {PLACEMENTS}}}")
        return placement
    if not isinstance(placement, dict):
        raise ValueError(f"placement={placement!r}: use one of {MODES} or a dict {{unit: one of {PLACEMENTS}}}")
    out = {}
    for k, v in placement.items():
        if isinstance(k, str) and k.lstrip("-").isdigit():
            k = int(k)  # a dict read back from JSON (checkpoint settings)
        if not isinstance(k, int) or not -1 <= k <= num_layers:
            raise ValueError(f"placement key {k!r}: units are -1 (embedding), 0..{num_layers - 1} (layers) "
                             f"and {num_layers} (head)")
        if v not in PLACEMENTS:
            raise ValueError(f"placement[{k}]={v!r}: use one of {PLACEMENTS}")
        out[k] = v
    if tied and out.get(-1, "host") != out.get(num_layers, "host"):
        raise ValueError(f"placement: this model ties its embedding to its lm_head, so units -1 and {num_layers} "
                         f"must be placed alike (got {out.get(-1, 'host')!r} and {out.get(num_layers, 'host')!r}); "
                         f"set both")
    return out


def groups(num_layers: int, tied: bool) -> list[tuple[int, ...]]:
    """Units that are placed together, in the order the next forward needs them (residency goes first to these)."""
    if tied:
        return [(num_layers, -1), *[(i,) for i in range(num_layers)]]  # the head slot's order: head, then embedding
    return [(-1,), *[(i,) for i in range(num_layers)], (num_layers,)]


def resident_bytes(unit: int, numel: int, dtype_bytes: int, tied: bool) -> int:
    """Device bytes of one resident unit: fp32 master and moments, compute-dtype weights and gradients;
    the embedding's gradients are fp32 (as on the host), plus a compute-dtype copy when it is the head."""
    if unit == -1:
        return numel * (12 + dtype_bytes + 4 + (dtype_bytes if tied else 0))
    return numel * (12 + 2 * dtype_bytes)


def choose(numel: dict[int, int], *, mode, free_bytes: int | None, dtype_bytes: int, tied: bool,
           cuda: bool) -> dict[int, Choice]:
    """Each unit's placement.

    Args:
        numel: unit -> elements of its flat slab (units -1..L).
        mode: a validated ``placement=`` value (see ``validate``).
        free_bytes: device memory the activation policy leaves (None: not measured yet).
        dtype_bytes: bytes of the compute dtype.
        tied: the embedding is the lm_head (Note: [Tied head group]).
        cuda: the device is a GPU (on "cpu" residency would hold a second copy in the same RAM).
    Returns:
        unit -> Choice, for every unit in ``numel``.

    Example:
        >>> c = choose({-1: 100, 0: 50, 1: 50, 2: 10}, mode="auto", free_bytes=2_960 + (2 << 30),
        ...            dtype_bytes=2, tied=True, cuda=True)
        >>> [c[u].placement for u in (-1, 0, 1, 2)]
        ['resident', 'resident', 'host', 'resident']
    """
    L = max(numel)
    if isinstance(mode, dict):
        return {u: Choice(mode.get(u, "host"), "set by the placement dict" if u in mode
                          else "not named in the placement dict") for u in numel}
    if mode == "host":
        return {u: Choice("host", "placement='host'") for u in numel}
    if mode == "stream":
        return {u: Choice("host", "placement='stream' keeps nothing on the device between steps; "
                                  "streamed device updates are not built yet, so AdamW runs on the host")
                for u in numel}
    if not cuda:
        return {u: Choice("host", "device 'cpu': host and device memory are the same RAM") for u in numel}
    if free_bytes is None:
        return {u: Choice("host", "first step of this batch size: measuring what the activations use") for u in numel}
    left = free_bytes - RESERVE_BYTES
    out = {}
    for g in groups(L, tied):
        need = sum(resident_bytes(u, numel[u], dtype_bytes, tied) for u in g)
        if need <= left:
            left -= need
            why = f"fits: {need / 2**30:.2f} GiB of the device memory the activations leave free"
            out.update({u: Choice("resident", why) for u in g})
        else:
            why = (f"needs {need / 2**30:.2f} GiB on the device, {max(left, 0) / 2**30:.2f} GiB left after "
                   "activations and the units before it")
            out.update({u: Choice("host", why) for u in g})
    return out
