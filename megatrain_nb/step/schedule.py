"""The order of one training step's operations, and which weight slot each layer lands in.

Owns: grouping layers into blocks (kept activations vs checkpoint-and-recompute), the ordered list
of compute operations of a step, and the assignment of layers to device weight slots with the
loads each operation needs (Belady's rule: evict the slot whose layer is needed furthest ahead).
Pure Python: no torch, no devices, no clocks. The engine runs what this module plans.

Unit numbering, used everywhere: -1 is the embedding, 0..L-1 the decoder layers, L the head
(final norm + lm_head).
"""
from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class Block:
    """Layers [start, end): either activations kept from the forward, or recomputed from a checkpoint."""

    start: int
    end: int
    recompute: bool


@dataclasses.dataclass(frozen=True)
class Op:
    """One compute operation. kind: "fwd", "loss", "recompute", "bwd" or "embed_bwd"."""

    kind: str
    layer: int
    phase: str


@dataclasses.dataclass(frozen=True)
class Load:
    """Bring ``layer``'s weights into ``slot`` before op ``before`` runs.

    ``after`` is the index of the op whose use of the slot's previous layer must finish first
    (None: the slot's previous user belongs to an earlier plan, tracked by the engine).
    """

    layer: int
    slot: int
    before: int
    after: int | None


def make_blocks(num_layers: int, keep: list[bool], checkpoint_every: int) -> list[Block]:
    """Kept layers become blocks of one; runs of the others are cut into recompute blocks.

    Args:
        keep: keep[i] True when layer i's activations stay from the forward (no recompute).
        checkpoint_every: the most layers one recompute block may hold (>= 1).
    """
    if len(keep) != num_layers:
        raise ValueError(f"keep has {len(keep)} entries for {num_layers} layers")
    if checkpoint_every < 1:
        raise ValueError(f"checkpoint_every={checkpoint_every}: must be >= 1")
    blocks, i = [], 0
    while i < num_layers:
        if keep[i]:
            blocks.append(Block(i, i + 1, False))
            i += 1
            continue
        j = i
        while j < num_layers and not keep[j] and j - i < checkpoint_every:
            j += 1
        blocks.append(Block(i, j, True))
        i = j
    return blocks


def forward_ops(num_layers: int) -> list[Op]:
    """Embedding gather happens in the prelude; then every layer, then loss (its own backward included)."""
    return [Op("fwd", i, "fwd") for i in range(num_layers)] + [Op("loss", num_layers, "loss")]


def backward_ops(blocks: list[Block]) -> list[Op]:
    """Blocks in reverse; a recompute block first re-runs its forward, then backprops layer by layer."""
    ops: list[Op] = []
    for b in reversed(blocks):
        if b.recompute:
            ops += [Op("recompute", i, "recompute") for i in range(b.start, b.end)]
        ops += [Op("bwd", i, "bwd") for i in reversed(range(b.start, b.end))]
    ops.append(Op("embed_bwd", -1, "bwd"))
    return ops


def plan_loads(ops: list[Op], num_slots: int, resident: list[int | None]
               ) -> tuple[list[Load], list[int | None], dict[int, int]]:
    """Assign the layers that ``ops`` use to weight slots.

    Args:
        ops: the operations in order; only those on layers 0..L-1 ("fwd", "recompute", "bwd") use slots.
        num_slots: device weight slots (>= 2 so that a load can overlap a compute).
        resident: resident[s] is the layer whose *current* weights slot s already holds, or None.
    Returns:
        (loads, resident_after, slot_of_op): loads in the order they must be issued (by
        ``before``), what each slot holds once ``ops`` are done, and op index -> slot it reads.
    Raises:
        ValueError: num_slots < 2.
    """
    if num_slots < 2:
        raise ValueError(f"weight_slots={num_slots}: need at least 2 (one computing, one loading)")
    resident = list(resident) + [None] * (num_slots - len(resident))
    last_use: list[int | None] = [None] * num_slots  # op index of each slot's latest use in this plan
    uses = [(k, op.layer) for k, op in enumerate(ops) if op.kind in ("fwd", "recompute", "bwd")]
    loads: list[Load] = []
    slot_of_op: dict[int, int] = {}
    for n, (k, layer) in enumerate(uses):
        if layer in resident:
            s = resident.index(layer)
        else:
            future = [l for _, l in uses[n + 1:]]

            def next_use(slot):  # Belady: the layer needed furthest ahead (or never) goes first;
                held = resident[slot]  # among equals, the slot freed earliest, so the load starts soonest
                freed = -1 if last_use[slot] is None else last_use[slot]
                if held is None or held not in future:
                    return (2, 0, -freed)
                return (1, future.index(held), -freed)

            s = max(range(num_slots), key=next_use)
            loads.append(Load(layer, s, k, last_use[s]))
            resident[s] = layer
        last_use[s] = k
        slot_of_op[k] = s
    return loads, resident, slot_of_op
