"""The pure order of a step (megatrain_nb.step.schedule): blocks, backward order, and the slot plan's
ordering rules, checked by simulating the plan rather than by trusting it."""
from __future__ import annotations

import collections
import itertools
import random

import pytest

from megatrain_nb.step.schedule import Block, Load, Op, backward_ops, forward_ops, make_blocks, plan_loads

SLOT_KINDS = ("fwd", "recompute", "bwd")


# ---- make_blocks ---------------------------------------------------------------------------------
@pytest.mark.parametrize("keep, K, want", [
    ([True] * 4, 1, [(0, 1, False), (1, 2, False), (2, 3, False), (3, 4, False)]),
    ([False] * 4, 1, [(0, 1, True), (1, 2, True), (2, 3, True), (3, 4, True)]),
    ([False] * 5, 2, [(0, 2, True), (2, 4, True), (4, 5, True)]),
    ([False] * 4, 4, [(0, 4, True)]),
    ([False] * 3, 8, [(0, 3, True)]),
    ([True, False, False, False, True, False], 2,
     [(0, 1, False), (1, 3, True), (3, 4, True), (4, 5, False), (5, 6, True)]),
    ([False, True, False], 3, [(0, 1, True), (1, 2, False), (2, 3, True)]),
])
def test_make_blocks_examples(keep, K, want):
    assert make_blocks(len(keep), keep, K) == [Block(*b) for b in want]


def _keep_patterns(L):
    yield [True] * L
    yield [False] * L
    rng = random.Random(L)
    for _ in range(4):
        yield [rng.random() < 0.4 for _ in range(L)]


@pytest.mark.parametrize("L", [1, 2, 5, 8])
@pytest.mark.parametrize("K", [1, 2, 3, 8])
def test_make_blocks_partition(L, K):
    for keep in _keep_patterns(L):
        blocks = make_blocks(L, keep, K)
        assert blocks[0].start == 0 and blocks[-1].end == L
        assert all(a.end == b.start for a, b in zip(blocks, blocks[1:]))  # contiguous, in order
        for b in blocks:
            assert b.start < b.end
            if b.recompute:
                assert b.end - b.start <= K and not any(keep[b.start:b.end])
            else:
                assert b.end - b.start == 1 and keep[b.start]
        # a recompute run is cut only where it reaches K layers
        runs = [b for b in blocks if b.recompute]
        for a, b in zip(runs, runs[1:]):
            if a.end == b.start:
                assert a.end - a.start == K


def test_make_blocks_errors():
    with pytest.raises(ValueError, match="keep has 3 entries for 4 layers"):
        make_blocks(4, [True] * 3, 1)
    with pytest.raises(ValueError, match="checkpoint_every=0"):
        make_blocks(2, [False] * 2, 0)


# ---- op order ------------------------------------------------------------------------------------
def test_forward_ops():
    assert forward_ops(3) == [Op("fwd", 0, "fwd"), Op("fwd", 1, "fwd"), Op("fwd", 2, "fwd"), Op("loss", 3, "loss")]


def test_backward_ops_example():
    blocks = make_blocks(5, [True, False, False, False, True], 2)  # [0] [1,2]r [3]r [4]
    got = [(o.kind, o.layer) for o in backward_ops(blocks)]
    assert got == [("bwd", 4),
                   ("recompute", 3), ("bwd", 3),
                   ("recompute", 1), ("recompute", 2), ("bwd", 2), ("bwd", 1),
                   ("bwd", 0), ("embed_bwd", -1)]


@pytest.mark.parametrize("L, K", [(1, 1), (4, 1), (4, 2), (6, 3), (7, 4)])
def test_backward_ops_rules(L, K):
    for keep in _keep_patterns(L):
        ops = backward_ops(make_blocks(L, keep, K))
        assert ops[-1] == Op("embed_bwd", -1, "bwd")
        bwd = [o.layer for o in ops if o.kind == "bwd"]
        assert bwd == list(reversed(range(L)))  # every layer once, last to first
        rec = collections.Counter(o.layer for o in ops if o.kind == "recompute")
        assert set(rec) == {i for i in range(L) if not keep[i]} and set(rec.values()) <= {1}
        for k, o in enumerate(ops):
            if o.kind == "recompute":  # a layer is recomputed before its backward ...
                assert ops.index(Op("bwd", o.layer, "bwd")) > k
                if o.layer > 0 and not keep[o.layer - 1] and Op("recompute", o.layer - 1, "recompute") in ops:
                    below = ops.index(Op("recompute", o.layer - 1, "recompute"))  # ... in forward order
                    assert below < k or below > ops.index(Op("bwd", o.layer, "bwd"))  # or in a later block
            if o.kind == "bwd" and o.layer + 1 < L:  # gradients flow down: layer i+1's backward is done
                assert ops.index(Op("bwd", o.layer + 1, "bwd")) < k


# ---- plan_loads: simulate the plan -----------------------------------------------------------------
def simulate(ops, num_slots, resident):
    """Check every rule of a plan; returns (loads, resident_after, slot_of_op)."""
    loads, after, slot_of_op = plan_loads(ops, num_slots, resident)
    uses = [k for k, o in enumerate(ops) if o.kind in SLOT_KINDS]
    assert sorted(slot_of_op) == uses, "every op on a layer reads exactly one slot; no other op does"
    assert [ld.before for ld in loads] == sorted(ld.before for ld in loads), "loads issue in order of use"
    assert len({ld.before for ld in loads}) == len(loads), "one load per op at most"
    state = list(resident) + [None] * (num_slots - len(resident))
    by_before = {ld.before: ld for ld in loads}
    for k in uses:
        op, s = ops[k], slot_of_op[k]
        if k in by_before:
            ld = by_before[k]
            assert ld.slot == s and ld.layer == op.layer
            # the slot's previous user in this plan, if any, is exactly ld.after ...
            prev = [j for j in uses if j < k and slot_of_op[j] == s]
            assert ld.after == (prev[-1] if prev else None), (k, ld)
            if ld.after is not None:
                assert ld.after < ld.before
            # ... so no op between them reads the slot while the load may be overwriting it
            lo = -1 if ld.after is None else ld.after
            assert all(slot_of_op[j] != s for j in uses if lo < j < k)
            state[s] = ld.layer
        assert state[s] == op.layer, f"op {k} {op} reads slot {s} holding layer {state[s]}"
    assert list(after) == state
    # a load never evicts what the op it serves (or any op between after and before) reads
    for ld in loads:
        assert ld.after is None or slot_of_op[ld.after] == ld.slot
    return loads, after, slot_of_op


def step_plans(L, keep, K, num_slots, resident=None):
    """The engine's two plans of a step: forward from ``resident``, backward from what the forward left."""
    resident = resident or [None] * num_slots
    f_loads, after_f, _ = simulate(forward_ops(L), num_slots, resident)
    b_loads, after_b, _ = simulate(backward_ops(make_blocks(L, keep, K)), num_slots, after_f)
    return f_loads, b_loads, after_f, after_b


@pytest.mark.parametrize("num_slots", [2, 3, 5])
@pytest.mark.parametrize("L, K", [(1, 1), (2, 1), (4, 2), (5, 2), (6, 3), (8, 4)])
def test_plan_rules_hold(L, K, num_slots):
    rng = random.Random(L * 31 + K)
    for keep in _keep_patterns(L):
        step_plans(L, keep, K, num_slots)
        # the backward plan from any residency, including stale layers and holes
        resident = [rng.choice([None, *range(L)]) for _ in range(num_slots)]
        resident = [r if r is None or resident.index(r) == s else None for s, r in enumerate(resident)]
        simulate(backward_ops(make_blocks(L, keep, K)), num_slots, resident)


@pytest.mark.parametrize("K", [1, 2, 3])
@pytest.mark.parametrize("L", [2, 5, 8])
def test_with_k_plus_one_slots_no_load_waits_for_the_op_just_before(L, K):
    """Overlap: each load's slot was last used two or more slot-ops earlier, so it can run while the
    previous op computes (with fewer slots than K+1 this cannot always hold)."""
    for keep in _keep_patterns(L):
        for ops, res in ((forward_ops(L), [None] * (K + 1)), (backward_ops(make_blocks(L, keep, K)), None)):
            if res is None:
                res = plan_loads(forward_ops(L), K + 1, [None] * (K + 1))[1]
            loads, _, slot_of_op = plan_loads(ops, K + 1, res)
            uses = sorted(slot_of_op)
            for ld in loads:
                i = uses.index(ld.before)
                assert i == 0 or ld.after != uses[i - 1], (keep, ld)


def test_each_layer_loads_once_per_pass_with_two_slots_all_recomputed():
    L = 6
    f, b, after_f, _ = step_plans(L, [False] * L, 1, 2)
    assert collections.Counter(ld.layer for ld in f) == {i: 1 for i in range(L)}
    counts = collections.Counter(ld.layer for ld in b)
    assert set(counts.values()) == {1}
    assert set(counts) == set(range(L)) - set(after_f), "only layers the forward left resident skip the load"


@pytest.mark.parametrize("K", [1, 2, 3, 4])
@pytest.mark.parametrize("extra", [1, 2])
@pytest.mark.parametrize("L", [1, 3, 4, 7, 9])
def test_with_k_plus_one_slots_each_layer_crosses_at_most_twice(L, K, extra):
    for keep in _keep_patterns(L):
        f, b, _, _ = step_plans(L, keep, K, K + extra)
        crossings = collections.Counter(ld.layer for ld in itertools.chain(f, b))
        assert max(crossings.values()) <= 2, (keep, crossings)
        assert collections.Counter(ld.layer for ld in f) == {i: 1 for i in range(L)}  # forward: each once


def test_too_few_slots_for_a_block_reload_within_the_block():
    """The bound above is tight: 2 slots for a block of 3 reload a layer between recompute and backward."""
    f, b, _, _ = step_plans(3, [False] * 3, 3, 2)
    crossings = collections.Counter(ld.layer for ld in itertools.chain(f, b))
    assert max(crossings.values()) == 3


def test_one_slot_is_refused():
    with pytest.raises(ValueError, match="weight_slots=1"):
        plan_loads(forward_ops(2), 1, [None])


def test_resident_layer_is_not_reloaded():
    loads, _, slot_of_op = plan_loads(forward_ops(3), 2, [None, 0])
    assert slot_of_op[0] == 1 and [ld.layer for ld in loads] == [1, 2]
    assert isinstance(loads[0], Load)
