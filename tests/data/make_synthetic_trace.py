"""Writes tests/data/synthetic_step.trace.json: a SYNTHETIC step (no GPU involved) for plot tests.

The spans are `planner.plan(...).simulate()` for the Qwen2.5-3B shape at 4 x 4096 tokens on the
H200 figures; weight-slot states follow `schedule.plan_loads` as the planner does, and pinned
buffers, grad slots and memory counters are derived from the spans by the rules below.
`meta["synthetic"]` is True so nobody mistakes it for a recorded trace (those go next to it).

Run from the repository root:  PYTHONPATH=. python tests/data/make_synthetic_trace.py
"""

from __future__ import annotations

from pathlib import Path

from megatrain_nb.machine.planner import plan
from megatrain_nb.step.schedule import backward_ops, forward_ops, make_blocks, plan_loads
from megatrain_nb.view.trace import Trace

QWEN25_3B = dict(model_type="qwen2", hidden_size=2048, intermediate_size=11008, num_hidden_layers=36,
                 num_attention_heads=16, num_key_value_heads=2, vocab_size=151936, tie_word_embeddings=True)
PATH = Path(__file__).with_name("synthetic_step.trace.json")


def synthetic_trace() -> Trace:
    """Builds the synthetic Trace (deterministic)."""
    p = plan(QWEN25_3B, batch=4, seq=4096)
    L, S, G, layer_bytes = p.shape["layers"], p.settings["weight_slots"], 2, p.shape["params_per_layer"] * 2
    nb = p.settings["pinned_budget_bytes"] // layer_bytes  # pinned shown as layer-sized buffers
    fops, bops = forward_ops(L), backward_ops(make_blocks(L, p.keep, p.settings["checkpoint_every"] or 1))
    f_loads, resident, f_slot = plan_loads(fops, S, [None] * S)
    b_loads, _, b_slot = plan_loads(bops, S, resident)
    load_slots = [ld.slot for ld in f_loads + b_loads]  # in the order of the layers' h2d spans
    use_slots = [f_slot[k] for k in range(L)] + [b_slot[k] for k, op in enumerate(bops) if op.layer >= 0]

    slots = [(k, i, None, "free", 0.0) for k, n in (("weight", S), ("grad", G), ("pinned", nb)) for i in range(n)]
    counters: list[tuple] = [("device_mem.activations", 0.0, 0), ("host_rss_bytes", 0.0, sum(p.host_bytes.values()))]
    counters += [(f"device_mem.{k}", 0.0, p.device_bytes[k])
                 for k in ("weight_slots", "grad_slots", "head_slots", "embedding_rows", "reserve")]
    packed: dict[int, list[int]] = {}  # layer -> pinned buffers packed, not yet copied
    loads = uses = packs = grads = live_act = in_pinned = 0
    act = p.device_bytes["activations_kept"] // max(p.kept_layers, 1)
    for lane, op, layer, phase, a, b, nbytes in sorted(p.spans, key=lambda s: (s[4], s[5])):
        if op == "loss":  # one loss chunk's logits live while the loss runs
            counters += [("device_mem.logits", a, p.device_bytes["logits"]), ("device_mem.logits", b, 0)]
        if not 0 <= layer < L:
            continue
        if op == "pack":
            i, packs, in_pinned = packs % nb, packs + 1, in_pinned + nbytes
            packed.setdefault(layer, []).append(i)
            slots += [("pinned", i, layer, "loading", a), ("pinned", i, layer, "ready", b)]
            counters.append(("pinned_in_use_bytes", a, in_pinned))
        elif op == "h2d":
            s, loads = load_slots[loads], loads + 1
            slots += [("weight", s, layer, "loading", a), ("weight", s, layer, "ready", b)]
            in_pinned -= nbytes
            slots.append(("pinned", packed[layer].pop(0), None, "free", b))
            counters.append(("pinned_in_use_bytes", b, in_pinned))
        elif lane == "compute":
            s, uses = use_slots[uses], uses + 1
            slots += [("weight", s, layer, "computing", a), ("weight", s, layer, "ready", b)]
            if p.keep[layer] and op in ("fwd", "bwd"):  # a kept layer's activations live from fwd to bwd
                live_act += act if op == "fwd" else -act
            if op == "bwd":
                slots += [("grad", grads % G, layer, "computing", a), ("grad", grads % G, layer, "ready", b)]
                grads += 1
            counters.append(("device_mem.activations", b, live_act))
        elif op == "d2h":
            i = next(s[1] for s in reversed(slots) if s[0] == "grad" and s[2] == layer)
            slots += [("grad", i, layer, "loading", a), ("grad", i, None, "free", b)]
    meta = {"synthetic": True, "source": "planner.plan(QWEN25_3B, batch=4, seq=4096).simulate()",
            "device_name": p.hardware.name, "tokens": p.settings["tokens"], "step_ms": p.step_ms}
    return Trace(step=0, spans=list(p.spans), meta=meta,
                 counters=[(n, round(t, 4), float(v)) for n, t, v in counters],
                 slots=[(k, i, ly, s, round(t, 4)) for k, i, ly, s, t in slots])


if __name__ == "__main__":
    synthetic_trace().save(PATH)
    print(f"wrote {PATH}")
