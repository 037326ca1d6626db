"""The plan of a step's loads into the weight slots: what each op computes from, and when each slot is free.

Owns: submitting every load a list of ops needs to the packer in order of use (``submit``: the slot each
op uses by Belady's rule, ``schedule.plan_loads``; a "device" unit's state load after its weights), the
compute stream's wait for an op's slot (``use``) and the slot's release once the op's compute is enqueued
(``done``), and the slots' state after a failed step (``reset``). Called by ``Engine._plan`` / ``_use`` /
``_done`` (the forward, the backward, and forward-only passes). Does not own: the copies (``transfers.py``), which units are resident (``device_updates.py``), the
order of ops (``schedule.py``).
"""
from __future__ import annotations

import torch

from .schedule import Op, plan_loads
from .workers import Box


def submit(engine, ops: list[Op], resident: list) -> dict:
    """Submit every load ``ops`` need to the packer, in order of use.

    Returns {"loads": op index -> (Load, box), "rel": op index -> Box of that op's slot release,
    "slot": op index -> slot, "state": bwd op index -> (state slot, its load's box, its write-back's
    box), "after": the layer each slot holds once ``ops`` are done, "cast": slots that a "device"
    unit's update refilled from its new master (``Engine._backward``)}. A load waits for the release of its
    slot's previous use: in this plan (``Load.after``) or in an earlier one (``engine.slot_box``). The
    backward of a "device" unit also needs its optimizer state: loaded right after its weights, into
    the state slot whose last write-back has been copied out (Note: [Streamed updates] in placement.py).
    """
    slot_ops = [Op("resident", op.layer, op.phase) if op.layer in engine.dev_opt.of else op for op in ops]
    loads, after, slot_of_op = plan_loads(slot_ops, len(engine.slots), resident)  # resident layers take no slot
    rel = {k: Box(engine.abort) for k in slot_of_op}
    jobs = [(ld.before, 0, ld) for ld in loads]
    jobs += [(k, 1, submit) for k, submit in engine.device_updates.state_loads(ops, engine.steps_done, engine.abort)]
    boxes, state = {}, {}
    for k, kind, what in sorted(jobs, key=lambda j: j[:2]):
        if kind == 1:
            state[k] = what()  # a "device" unit's state: after its backward's weights, in packer order
            continue
        ld = what
        freed = engine.slot_box[ld.slot] if ld.after is None else rel[ld.after]
        box = engine.io.load(ld.layer, engine.slots[ld.slot], [(ld.layer, engine._master(ld.layer), 0)], freed,
                           ops[ld.before].phase, engine.steps_done)
        boxes[ld.before] = (ld, box)
    for k, s in sorted(slot_of_op.items()):
        engine.slot_box[s] = rel[k]  # ends as each slot's last use in this plan
    return {"loads": boxes, "rel": rel, "slot": slot_of_op, "state": state, "after": after, "cast": set()}

def use(engine, plan: dict, k: int, op: Op) -> torch.Tensor:
    """Driver: the weight slot op k computes from; the compute stream waits for its load."""
    if k not in plan["slot"]:
        return engine.dev_opt.of[op.layer].w  # resident: always current, never loaded
    s = plan["slot"][k]
    if k in plan["loads"]:
        ld, box = plan["loads"][k]
        engine._ready(box)
        engine.slot_layer[ld.slot] = ld.layer
        engine.slot_current[ld.slot] = True  # a load waits for its unit's last update: current until the next
        engine._occ.append(("weight", s, op.layer, ("h2d", "h2d", op.layer, op.phase), "loading", "ready"))
    engine._occ.append(("weight", s, op.layer, ("compute", op.kind, op.layer, op.phase), "computing", "ready"))
    return engine.slots[s]

def done(engine, plan: dict, k: int) -> None:
    """Driver: op k no longer needs its slot once the compute stream passes this point."""
    if k in plan["rel"]:
        plan["rel"][k].put(engine.dev.record(engine.dev.compute))


def reset(engine) -> None:
    """After a failed step (``Engine._recover``): every weight, grad and head slot free, none holding current weights."""
    engine.slot_box = [Box(ready=True) for _ in engine.slots]
    engine.gslot_box = [Box(ready=True) for _ in engine.gslots]
    engine.head_box, engine.head_gbox = Box(ready=True), Box(ready=True)
    engine.slot_layer = [None] * len(engine.slots)
    engine.slot_current = [False] * len(engine.slots)
    engine.head_current = False
