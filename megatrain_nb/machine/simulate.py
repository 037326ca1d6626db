"""The list-scheduling simulation behind `planner.plan`: one step from cold, or steps back to back.

Owns `_Sim`, a scheduler over the engine's lanes (compute, h2d, d2h, host-pack, host-unpack,
host-adam) that runs the engine's own op order and slot assignment (`schedule.py`) with per-op times
from the planner, and the steady-state loop (Note: [Steady state]). Does not own any rate, byte count
or setting: `planner.plan` computes those and passes them in. Touches no device.
"""

from __future__ import annotations

import math
import warnings

from ..step.schedule import Op, backward_ops, forward_ops, make_blocks, plan_loads

GRAD_SLOTS = 2  # the engine alternates two device grad slots


def simulate(L, w_bytes, g_bytes, t, units, loss_ms, keep, block, S, budget, chunk,
             overlap, tied=False, resident=frozenset(), dev_adam_ms=None, streamed=frozenset(),
             cached=frozenset(), state_slots=2) -> tuple[list[tuple], dict]:
    """List-schedules one step from cold. Returns (Trace.spans rows, lane -> work ms)."""
    sim = _Sim(L, w_bytes, g_bytes, t, units, loss_ms, keep, block, S, budget, chunk, overlap, tied, resident,
               dev_adam_ms, streamed, cached, state_slots)
    sim.step()
    return sim.spans, sim.work


def simulate_steady(sim_args: tuple, steps: int | None) -> tuple[list[tuple], float, int]:
    """Runs consecutive steps (see Note: [Steady state]); returns the last step's spans (times from its
    start, assigned to it as the recorder would), its step time and its index."""
    sim = _Sim(*sim_args, steady=True)
    starts, returns = [], []
    for n in range(steps or _STEADY_MAX_STEPS):
        sim.n, sim.t0 = n, returns[-1] if returns else 0.0
        starts.append(sim.t0)
        returns.append(sim.step())
        periods = [b - a for a, b in zip(starts, returns)]
        if steps is None and n >= 2 and abs(periods[-1] - periods[-2]) <= 1e-6 * periods[-1]:
            break
    else:
        if steps is None:
            warnings.warn(f"the steady-state simulation did not repeat within {_STEADY_MAX_STEPS} steps (last "
                          f"periods {periods[-2]:.2f}, {periods[-1]:.2f} ms); reporting the last one.", stacklevel=3)
    last, t0, ends = len(returns) - 1, starts[-1], [round(r, 4) for r in returns]  # spans hold rounded times
    spans = []
    for n, (lane, op, layer, phase, a, b, nbytes) in zip(sim.owner, sim.spans):
        while n < last and b > ends[n]:  # the recorder files a span under the step open when it ends
            n += 1
        if n == last and b <= ends[last]:
            spans.append((lane, op, layer, phase, round(a - t0, 4) + 0.0, round(b - t0, 4) + 0.0, nbytes))  # no -0.0
    return spans, returns[-1] - t0, last


# Note: [Steady state]
# `Plan.simulate()` is one step from cold: nothing precedes it, and it ends with its last AdamW
# update. The engine runs step after step (engine.py, transfers.py, workers.py), and `simulate_steady`
# follows it:
#   - a step starts when the previous one's driver returned: once the embedding's gradients landed in
#     host memory (`Engine._step`'s `last.get()`); the Adam worker may still be busy then;
#   - the loader (`Transfers.load`, one FIFO thread) holds each load until the previous step's update
#     of its unit (both units for a tied head) was processed, recording a `wait-update` span on the
#     host-pack lane from when it reached the load to when the update ended;
#   - the Adam worker takes units as they land, and once every unit of the step has landed the rest go
#     in forward order, embedding first (Note: [Update order]); gated (grad_clip, no overlap), it
#     starts after the last landing and goes in forward order; a step's updates wait for the previous
#     step's;
#   - lanes, weight slots, grad slots, the head slot and the pinned ring carry over between steps.
# Host time between a driver's return and the next step (Session.step's own work) is not modelled.
# The steady step is the last simulated one, shown as a recording shows a step: spans ending within
# it, the previous step's updates included, with times from its start (negative before it).
_STEADY_MAX_STEPS = 32


class _Sim:
    """List scheduler over the engine's lanes, each running its ops in issue order, for one step or
    several in a row. A load with no pack time (pack_ms == 0) is one DMA from a pinned slab, a grad copy
    with no unpack time lands in one. Without `steady`, AdamW runs inline as units land (the cold step).
    Units in `resident` (placement.py) are never loaded nor copied out; their AdamW (`dev_adam_ms`:
    unit -> ms) runs on the device-adam lane: each group as its gradients are complete, beside the
    compute, when `overlap`; else all after the embedding's backward (Note: [Device updates] in device_updates.py).
    The next step's compute waits for the last one. Layers in `streamed` (placement "device") load
    their fp32 state (t["state_in"]) after their backward's weights, are updated on the device-adam
    lane (t["dev_adam"]) once both are there, and land after their state went back (t["state_out"]):
    no step waits for that, the unit's next load does (Note: [Late write-backs] in device_updates.py).
    A streamed head group (``L`` in `streamed`, Note: [Streamed head] in placement.py) loads its state
    (t["head_state_in"]) where its weights would load, is updated once its gradients are complete (after
    the loss, or after the embedding's backward when tied) and writes it back; from the second step its
    weights are held in the head slot, and a tied embedding's rows come from there."""

    def __init__(self, L, w_bytes, g_bytes, t, units, loss_ms, keep, block, S, budget, chunk, overlap,
                 tied=False, resident=frozenset(), dev_adam_ms=None, streamed=frozenset(), cached=frozenset(),
                 state_slots=2, steady=False):
        self.resident, self.dev_adam_ms = frozenset(resident), dev_adam_ms or {}
        self.cached = frozenset(cached)  # recomputed in t["recompute_cached"]: attention output kept (attncache.py)
        self.streamed = frozenset(streamed) if overlap else frozenset()  # gated: on the host (placement.py)
        self.sslot_free = [0.0] * max(1, state_slots)  # end of each state slot's last write-back
        self.hstate_free = 0.0  # end of the head group's last write-back
        self.early: list[tuple[int, int]] = []  # (unit, state slot) of this step's early state loads not yet started
        self.early_done: dict[int, float] = {}  # unit -> end of its early state load
        self.L, self.w_bytes, self.g_bytes, self.t, self.units, self.loss_ms = L, w_bytes, g_bytes, t, units, loss_ms
        self.budget, self.chunk, self.overlap, self.tied, self.steady = budget, chunk, overlap, tied, steady
        self.free: dict[str, float] = {}  # lane -> end of its latest op
        self.work: dict[str, float] = {}
        self.spans: list[tuple] = []
        self.owner: list[int] = []  # step of each span
        self.n, self.t0 = 0, 0.0  # current step and its start
        self.loads: list[tuple] = []  # (h2d end, bytes) per load in packer order: the pinned ring
        self.landed: list[tuple] = []  # (unit, unpack end, adam ms) in landing order, this step
        self.updated: dict = {}  # unit -> end of its latest update (steady: the next load waits); "rows": the
        # embedding's rows the next forward gathers (Note: [Early rows] in step/early_rows.py)
        self.gslot_free = [0.0] * GRAD_SLOTS
        self.slot_end = [0.0] * S  # compute end of each weight slot's latest user
        self.have = [0.0] * S  # h2d end of each slot's current weights
        self.head_free = self.head_copied = 0.0  # last loss compute end; last head grad copy end
        self.fops, self.bops = forward_ops(L), backward_ops(make_blocks(L, keep, block))
        mask = lambda ops: [Op("resident", o.layer, o.phase) if o.layer in self.resident else o for o in ops]  # noqa: E731
        f_loads, held, f_slot = plan_loads(mask(self.fops), S, [None] * S)  # as Engine._plan does
        b_loads, after, b_slot = plan_loads(mask(self.bops), S, held)
        self.cold = self.warm = (f_loads, f_slot, b_loads, b_slot, after)
        kept = [x if x in self.streamed else None for x in after]  # Note: [Held weights] in placement.py
        if steady and any(x is not None for x in kept):  # the steps after the first start from these slots
            f_loads, held, f_slot = plan_loads(mask(self.fops), S, kept)
            b_loads, after, b_slot = plan_loads(mask(self.bops), S, held)
            self.warm = (f_loads, f_slot, b_loads, b_slot, after)

    def put(self, lane, op, layer, phase, a, b, nbytes=0, busy=None):
        self.free[lane] = b
        self.work[lane] = self.work.get(lane, 0.0) + (b - a if busy is None else busy)
        self.spans.append((lane, op, layer, phase, round(a, 4), round(b, 4), int(nbytes)))
        self.owner.append(self.n)
        return b

    def hold(self, layer, phase, units) -> float:
        """The loader's wait for the last update of `units` (a wait-update span); returns when it goes on."""
        a = max(self.free.get("host-pack", 0.0), self.t0)
        for u in units:
            if self.updated.get(u, 0.0) > a:
                self.fill(a, self.updated[u])
                a = self.put("host-pack", "wait-update", layer, phase, a, self.updated[u], busy=0.0)
        return max([self.t0, *(self.updated.get(u, 0.0) for u in units)])

    def fill(self, a: float, until: float) -> None:
        """The loader waits from `a` to `until`: the step's early state loads start meanwhile, one copy at a
        time, each once its slot's last write-back and its unit's last update are done (Note: [Early state])."""
        c = a
        while self.early and c < until:
            go = [(u, j) for u, j in self.early if self.sslot_free[j] <= c and self.updated.get(u, 0.0) <= c]
            if not go:
                nxt = [max(self.sslot_free[j], self.updated.get(u, 0.0)) for u, j in self.early]
                c = min(nxt)
                continue
            u, j = go[0]
            self.early.remove((u, j))
            h0 = max(self.free.get("h2d", 0.0), c)
            c = self.early_done[u] = self.put("h2d", "state-in", u, "bwd", h0, h0 + self.t["state_in"],
                                              self.t["state_bytes"])

    def load(self, unit, phase, nbytes, pack_ms, h2d_ms, slot_free=0.0, waits=(), op="h2d"):
        go = self.hold(unit, phase, waits)
        free, put = self.free, self.put
        if pack_ms == 0:  # pinned source: no staging, no packing
            h0 = max(free.get("h2d", 0.0), slot_free, go)
            return put("h2d", op, unit, phase, h0, h0 + h2d_ms, nbytes)
        ring, acc = 0.0, nbytes
        for end, b in reversed(self.loads):  # pinned chunks still waiting for their copy
            acc += b
            if acc > self.budget:
                ring = end
                break
        c = max(1, math.ceil(nbytes / self.chunk))  # chunks: a copy starts once its chunk is packed
        p0 = max(free.get("host-pack", 0.0), ring, go)
        put("host-pack", "pack", unit, phase, p0, p0 + pack_ms, nbytes)
        h0 = max(free.get("h2d", 0.0), slot_free, p0 + pack_ms / c)
        self.loads.append((put("h2d", "h2d", unit, phase, h0, max(h0 + h2d_ms, p0 + pack_ms + h2d_ms / c), nbytes,
                               h2d_ms), nbytes))
        return self.loads[-1][0]

    def grads(self, unit, phase, ready, nbytes, d2h_ms, unpack_ms, adam_ms, op="unpack"):
        free, put = self.free, self.put
        c = max(1, math.ceil(nbytes / self.chunk))
        a = max(ready, free.get("host-unpack", 0.0), free.get("d2h", 0.0))  # the unpacker finishes one unit before
        b = put("d2h", "d2h", unit, phase, a, a + d2h_ms, nbytes)  # the next, and copies out leave in turn
        u0 = a + d2h_ms / c
        if unpack_ms == 0:  # pinned grad slab: the unpacker only waits for the copy
            u = free["host-unpack"] = b
        else:
            u = put("host-unpack", op, unit, phase, u0, max(u0 + unpack_ms, b + unpack_ms / c), nbytes, unpack_ms)
        self.landed.append((unit, u, adam_ms))
        if self.overlap and not self.steady:
            a = max(u, free.get("host-adam", 0.0))
            put("host-adam", "adam", unit, "optim", a, a + adam_ms, 0)
        return u

    def compute(self, op, layer, phase, dur, *after):
        a = max([self.free.get("compute", 0.0), *after])
        return self.put("compute", op, layer, phase, a, a + dur)

    def use(self, k, op, lds, slot_of, h2d_ms, end):
        """Issues op k's load if it has one (its slot is released by op `after`); returns its slot
        (None for a resident layer: its weights are always there)."""
        if op.layer in self.resident:
            return None
        ld = lds.get(k)
        if ld is not None:
            rel = self.slot_end[ld.slot] if ld.after is None else end[ld.after]
            self.have[ld.slot] = self.load(op.layer, op.phase, self.w_bytes, self.t["pack"], h2d_ms, rel,
                                           waits=(op.layer,))
        return slot_of[k]

    def step(self) -> float:
        """Simulates one step from `t0`; returns when its driver returns (the embedding's grads landed)."""
        L, t, units, compute, slot_end, res = self.L, self.t, self.units, self.compute, self.slot_end, self.resident
        f_loads, f_slot, b_loads, b_slot, after = self.warm if self.n else self.cold
        self.landed = []
        layers = sorted((u for u in self.streamed if 0 <= u < L), reverse=True)  # Note: [Early state]
        self.early = [(u, k % len(self.sslot_free)) for k, u in enumerate(layers[:len(self.sslot_free)])]
        self.early_done: dict[int, float] = {}
        hs, warm = L in self.streamed, self.steady and self.n > 0  # Note: [Streamed head]: held from the 2nd step
        group = (L, -1) if self.tied else (L,)
        head = None
        if hs and not warm and self.tied:  # its slot loads first: the rows are gathered from it
            head = self.load(L, "fwd", *units[L][:3], self.head_free, waits=group)
        if hs and self.tied:
            rows = self.t0 if head is None else head
        else:
            rows = self.t0 if -1 in res else self.load(-1, "fwd", *units[-1][:3], waits=("rows",))  # host-gathered rows
            # once they are updated: early (Note: [Early rows]), else with the whole embedding
        have = lambda s: 0.0 if s is None else self.have[s]  # noqa: E731  (a resident layer: always there)
        end: dict[int, float] = {}
        at = {ld.before: ld for ld in f_loads}
        for k, op in enumerate(self.fops[:-1]):
            s = self.use(k, op, at, f_slot, t["h2d"], end)
            end[k] = compute("fwd", op.layer, "fwd", t["fwd"], have(s), rows)
            if s is not None:
                slot_end[s] = end[k]
        # the packer takes the head after every forward load; a tied head's slot holds the embedding too
        got = 0.0
        if hs:  # its state comes in where its weights would (held from the second step)
            if head is None:
                head = self.t0 if warm else self.load(L, "loss", *units[L][:3], self.head_free, waits=group)
            got = self.load(L, "loss", t["head_state_bytes"], 0.0, t["head_state_in"], self.hstate_free, waits=group,
                            op="state-in")
        else:
            head = self.t0 if L in res else self.load(L, "loss", *units[L][:3], self.head_free, waits=group)
        self.head_free = compute("loss", L, "loss", self.loss_ms, head, self.head_copied)
        self.device_update((L,) if not self.tied else (), self.head_free)
        if hs:
            if self.tied:
                self.landed.append((L, self.head_free, 0.0))  # its norm only
            else:
                self.head_copied = self.stream_head(self.head_free, got)  # its gradient slot is free after the update
        elif L not in res:
            self.grads(L, "loss", self.head_free, *units[L][3:])
            self.head_copied = self.free["d2h"]
        end, at, gi = {}, {ld.before: ld for ld in b_loads}, 0
        for k, op in enumerate(self.bops[:-1]):
            s = self.use(k, op, at, b_slot, t["h2d_bwd"], end)
            if op.kind == "recompute":
                dur = t["recompute_cached"] if op.layer in self.cached else t["fwd"]
                end[k] = compute("recompute", op.layer, "recompute", dur, have(s))
            elif s is None:
                end[k] = compute("bwd", op.layer, "bwd", t["bwd"])
            elif op.layer in self.streamed:
                j = sum(1 for o in self.bops[:k] if o.kind == "bwd" and o.layer in self.streamed) % len(self.sslot_free)
                got = self.early_done.pop(op.layer, None)  # started early (Note: [Early state])
                if got is None:
                    if (op.layer, j) in self.early:
                        self.early.remove((op.layer, j))
                    got = self.load(op.layer, "bwd", t["state_bytes"], 0.0, t["state_in"], self.sslot_free[j],
                                    waits=(op.layer,), op="state-in")
                end[k] = compute("bwd", op.layer, "bwd", t["bwd"], have(s), self.gslot_free[gi])
                a = max(end[k], got, self.free.get("device-adam", 0.0))
                upd = self.put("device-adam", "adam", op.layer, "bwd", a, a + t["dev_adam"])
                self.gslot_free[gi] = upd
                gi ^= 1
                o0 = max(upd, self.free.get("d2h-state", 0.0))  # its own stream and thread (Note: [State write-backs])
                self.sslot_free[j] = self.put("d2h-state", "state-out", op.layer, "bwd", o0, o0 + t["state_out"])
                self.landed.append((op.layer, self.sslot_free[j], 0.0))  # the host's update is a no-op
                if s is not None and after[s] == op.layer:  # refilled from the new master (Note: [Held weights])
                    self.have[s] = end[k] = upd  # its next use waits for the cast, and so does the slot's next load
            else:
                end[k] = compute("bwd", op.layer, "bwd", t["bwd"], have(s), self.gslot_free[gi])
                self.gslot_free[gi] = self.grads(op.layer, "bwd", end[k], self.g_bytes, t["d2h"], t["unpack"],
                                                 t["adam"])  # slot reusable
                gi ^= 1
            if s is not None:
                slot_end[s] = end[k]
            if op.kind == "bwd":
                self.device_update((op.layer,), end[k])
        e = compute("embed_bwd", -1, "bwd", 0.0)
        if hs and self.tied:  # the driver waits for no state write-back (Note: [Late write-backs])
            back = e
            self.stream_head(e, got)
        else:
            back = e if -1 in res else self.grads(-1, "bwd", e, *units[-1][3:], op="embed_grad")
        self.device_update((L, -1) if self.tied else (-1,), e)
        if res and not self.overlap:  # gated: the driver enqueues every update once every gradient landed
            self.device_update(tuple(sorted(res)), max(back, self.free["compute"]), gated=True)
        if "device-adam" in self.free:  # the next step's compute follows this step's device updates
            self.free["compute"] = max(self.free["compute"], self.free["device-adam"])
        if self.steady:
            self.optimizer()
        elif not self.overlap and self.landed:  # clipping / no overlap: AdamW after every unit's grads landed
            a = max(u for _, u, _ in self.landed)
            for unit, _, ms in self.landed:
                a = self.put("host-adam", "adam", unit, "optim", a, a + ms)
        return back

    def stream_head(self, ready: float, got: float) -> float:
        """The streamed head group's update once its gradients (`ready`) and state (`got`) are there, then its
        write-back; returns when its last unit lands."""
        a = max(ready, got, self.free.get("device-adam", 0.0))
        upd = self.put("device-adam", "adam", self.L, "bwd", a, a + self.t["head_dev_adam"])
        unit = -1 if self.tied else self.L
        o0 = max(upd, self.free.get("d2h-state", 0.0))
        self.hstate_free = self.put("d2h-state", "state-out", unit, "bwd", o0, o0 + self.t["head_state_out"])
        self.landed.append((unit, self.hstate_free, 0.0))  # the host's update is a no-op
        return upd if not self.tied else self.hstate_free

    def device_update(self, units: tuple, ready: float, gated: bool = False) -> None:
        """A resident group's AdamW on the device-adam lane once its gradients are complete at `ready`."""
        if not units or units[0] not in self.resident or (not self.overlap and not gated):
            return
        a = max(ready, self.free.get("device-adam", 0.0))
        self.put("device-adam", "adam", units[0], "optim", a, a + sum(self.dev_adam_ms[u] for u in units))

    def optimizer(self) -> None:
        """The Adam worker over this step's landings (Note: [Update order]): in landing order while grads
        still land, the rest in forward order; gated (no overlap), all in forward order after the last."""
        rank = {u: k for k, u in enumerate([-1, *range(self.L), self.L])}
        if not self.landed:  # every unit resident: nothing for the host
            return
        todo, last = list(self.landed), max(u for _, u, _ in self.landed)
        a = self.free.get("host-adam", 0.0) if self.overlap else max(self.free.get("host-adam", 0.0), last)
        early = self.t.get("embed_rows_adam", 0.0) if self.overlap else 0.0  # Note: [Early rows]: gated, the
        rows_out = False  # worker reaches the embedding before the next step asks
        while todo:
            quick = [x for x in todo if x[2] == 0.0 and x[1] <= a]  # the device's units count at once (Note: [Early state])
            a = a if quick else max(a, todo[0][1])  # with every landed unit done, the worker waits for the next arrival
            pick = quick[0] if quick else min(todo, key=lambda x: rank[x[0]]) if a >= last else todo[0]
            unit, _, ms = pick
            if unit == -1 and early and not rows_out and a >= last and ms:  # its rows first, its whole update last
                self.updated["rows"] = a = self.put("host-adam", "adam-rows", -1, "optim", a, a + early)
                rows_out = True
                if len(todo) > 1:
                    rank[-1] = len(rank)
                    continue
            todo.remove(pick)
            self.updated[unit] = a = self.put("host-adam", "adam", unit, "optim", a, a + ms)
            if unit == -1 and not rows_out:
                self.updated["rows"] = a
