"""Where each unit's optimizer update and trainable state live: on the host, or resident on the device.

Owns: the public ``placement=`` setting (its modes and the expert dict), the device bytes a resident
unit costs, the order in which units earn residency, and the choice itself with a reason per unit.
Pure Python: no torch, no devices, no clocks. About 550 lines: the placement notes ([Streamed
updates], [Held weights], [Auto search]) live here, beside the rules they explain. The engine measures the free device memory and applies
what this module decides; ``optim.DeviceAdamW`` holds and updates the resident state.

Placements of one unit (-1 embedding, 0..L-1 decoder layers, L head):
  "host":     today's path: weights stream in from the host master, gradients stream out, AdamW runs
              on the host cores (overlapped with the backward).
  "device":   (decoder layers, the head group) weights stream in as for "host", but no gradient goes
              out: the unit's fp32 master and moments come in while its backward runs, the device's
              AdamW updates them as soon as its gradients are complete, and they go back to the host;
              nothing of it stays on the device between steps but the weights its slot holds
              (Note: [Streamed updates], [Streamed head]).
  "resident": fp32 master, both moments and the compute-dtype weights stay in device memory across
              steps; no load, no gradient over PCIe; AdamW (torch's fused kernel, fp32) runs on the
              device at the end of the step. The host copy is written back only when someone reads
              it (checkpoint, save_pretrained, close, a placement change).
Modes:
  "auto":   on CUDA, after the first step of a batch size has measured what the activations use,
            the units the next forward needs first become resident while they fit; the rest stay "host".
            How much the activations give up for residents, the planner predicts (Note: [Auto search]).
  "host":   nothing resident (the behaviour before placements existed).
  "stream": nothing kept on the device between steps: the head group and the first layers (the next
            forward needs them first) are placed "device", the share that balances PCIe against the
            host's AdamW (``stream_share``), the rest "host". What a model far larger than the GPU gets.
  {unit: placement}: experts; units not named stay "host".

Note: [Streamed updates] a "device" unit moves 12 more bytes per parameter in (master and moments)
and 10 more out than a "host" one (12 out instead of 2 bytes of gradients), and takes its update off
the host cores. With host AdamW at A params/s and PCIe at B bytes/s each way, a share f of the
parameters on the device balances the two when (w + 12 f) / B = (1 - f) / A (w = 8: the weights, in
twice, as fp32 for the device cast). When every layer has a weight slot, which "stream" arranges where
they take under a tenth of device memory (measured on the H200 at 3B x 1 before: the h2d lane busy 931
ms of a 1097 ms step, 502 of them weights), the backward reuses the forward's weights and a "device"
unit's weights do not cross at all (Note: [Held weights]): 4 (1 - f) + 12 f bytes in per parameter.

Note: [Held weights] a "device" unit's update has its new fp32 master on the device; where the unit's
weight slot keeps it past the step (``schedule.plan_loads``'s slots after the backward), the update
casts the master into that slot, as a load would, and the next forward computes from it without a
load: no reload of what the device has just written, and no wait for the state's write-back before
the next step's first layers (which "stream" places "device"). The engine tracks which slots hold
their layer's current weights (``Engine.slot_current``): a load makes a slot current, the end of a
step leaves current only the slots refilled this way, a failed step none. The host store stays the
authority: the state still goes back, and any other load reads it.
A is the rate measured in the first step (the host's AdamW beside the gradients' DMA), B the in-step
rate of a copy in beside copies out (``PCIE_IN_STEP_BYTES_PER_S``): with the isolated 55 GB/s the H200's
run of 2026-12-01 streamed 20 of 36 layers at 3B, where the planner's best is 16 (x 1) and 10 (x 4); this rule
streams 17 (the planner's simulation). With a gate (grad_clip, overlap off, nonfinite="raise") a
"device" unit is updated on the host like a "host" one: its update would have to wait for every
gradient, after its state had come and gone.

Note: [Tied head group] a tied model's embedding is also its lm_head, so units -1 and L share one
placement: the head slot holds them together (``Engine.head_layout``), resident or streamed.

Note: [Streamed head] the head group placed "device" (what "stream" does): its state (12 bytes a
parameter) loads where its weights would, after the forward's loads; its gradients stay on the device
(a tied embedding's rows are added to the lm_head's there, in fp32, as the host adds them); its AdamW
runs once they are complete, casts the new master into the head slot and sends the state back. The
next step computes from that slot without a load, and a tied embedding's rows are gathered from it on
the device. On the H200 (2026-12-02, 3B under "stream" with the head group on the host) every step began
with the host's update of the embedding: compute idled 59 ms (x 1) and 160 ms (x 4) before layer 0,
its early rows (Note: [Early rows]) included; and the host scattered the rows' gradients (45-74 ms).
It costs PCIe 12 bytes a parameter each way, against 4 in (the head's fp32 load) and 2 out: a share
of the layers goes back to the host for it (``stream_extras``). An untied embedding stays "host": the
next forward gathers its rows from the host master, which the write-back would have to reach first.
"""
from __future__ import annotations

import dataclasses

PLACEMENTS = ("host", "device", "resident")
MODES = ("auto", "host", "stream")
RESERVE_BYTES = 2 << 30  # left free for allocator slack and workspaces when choosing residents
PCIE_BYTES_PER_S = 55e9  # each way, pinned: PCIe Gen5 x16 as measured on the H200 (shared/LIMITS.md)
# inside a stream step, state in runs beside state and gradients out: 40.2 GB/s (bench/copy_rates.py on the
# H200's stream traces of 2026-12-01; planner.H200.h2d_beside_d2h_GBps). What stream_share balances host AdamW against.
PCIE_IN_STEP_BYTES_PER_S = 40.2e9


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
        if v == "device" and k == -1 and not tied:
            raise ValueError(f"placement[-1]='device': an untied embedding does not stream its optimizer state (the "
                             f"next forward gathers its rows on the host); place it 'host' or 'resident'")
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


def stream_share(host_adam_params_per_s: float, pcie_bytes_per_s: float, cached: bool = False, *,
                 host_extra: float = 0.0, in_extra: float = 0.0, window: float = 1.0, split: bool = False,
                 state_bytes: float = 12.0) -> float:
    """The share of the layers' parameters placed "device" that balances PCIe against host AdamW
    (Note: [Streamed updates], [Host window]).

    ``cached``: every layer has its own weight slot (``weight_slots``): the weights come in once a step
    (4 bytes per parameter, fp32 for the device cast), not twice, and a "device" unit's not at all
    (its update refills its slot, Note: [Held weights]): per parameter 4 (1 - f) + 12 f bytes in,
    else 8 + 12 f. ``host_extra``: parameters the host updates whatever the share (the embedding and
    head), and ``in_extra``: bytes in a step whatever the share (the head's load), both per parameter
    of the layers. PCIe's time is then (in_extra + ...) / B. The host's side is its updates, (host_extra
    + 1 - f) / A, and the forward's loads of the host layers, 4 (1 - f) / B, which wait for those
    updates (Note: [Host window]); together they must fit in ``window`` of the step. ``split``:
    "device" layers' masters are held as [R | D] (Note: [Split master] in split_master.py): 10 bytes in,
    not 12, where the weights are held; else both planes and two 2-byte weight loads (16, not 20).
    ``state_bytes``: a "device" parameter's state in bytes, master and moments (12 with fp32 moments;
    4 + ~2.03 with ``optimizer_state="int8"``, ``compact_state.bytes_per_param``, where the split is off).

    Example:
        >>> round(stream_share(3.5e9, 55e9), 2), round(stream_share(3.5e9, 55e9, cached=True), 2)
        (0.37, 0.57)
        >>> extras = dict(host_extra=0.0, in_extra=1.345, window=HOST_WINDOW)  # 3B, its tied head group streamed
        >>> round(36 * stream_share(2.0e9, 40.2e9, cached=True, split=True, **extras))  # fp32 moments: layers streamed
        25
        >>> round(36 * stream_share(3.5e9, 40.2e9, cached=True, state_bytes=6.03, **extras))  # int8
        24
    """
    a, b = 1 / host_adam_params_per_s, 1 / pcie_bytes_per_s
    w = 4 if cached else 8  # weights in per "host" parameter
    device_in = state_bytes + (0 if cached else 8)  # all bytes in per "device" one
    device_in -= 2 if cached and split else 4 if split else 0
    # g = 1 - f, the host layers: a (host_extra + g) + 4 b g = window b (in_extra + device_in - g (device_in - w))
    g = (window * b * (in_extra + device_in) - a * host_extra) / (a + 4 * b + window * b * (device_in - w))
    return min(1.0, max(0.0, 1 - g))


def stream_extras(numel: dict[int, int], tied: bool, head_streamed: bool = True,
                  head_state_bytes: float | None = None) -> dict[str, float]:
    """``stream_share``'s fixed terms for a model (unit -> elements, units -1..L), both per parameter of the
    layers: what the host updates whatever the share (an untied embedding; the head group when it is not
    streamed), and the bytes in each step whatever the share: the head group's state (``head_state_bytes``,
    by default 12 bytes a parameter, fp32 moments; Note: [Streamed head]), or its fp32 weights when the host
    updates it (a tied head holds the embedding).

    Example:
        >>> {k: round(v, 3) for k, v in stream_extras({-1: 311e6, 0: 1387.5e6, 1: 1387.5e6, 2: 2048}, True).items()}
        {'host_extra': 0.0, 'in_extra': 1.345}
        >>> {k: round(v, 3) for k, v in stream_extras({-1: 311e6, 0: 1387.5e6, 1: 1387.5e6, 2: 2048}, True, False).items()}
        {'host_extra': 0.112, 'in_extra': 0.448}
    """
    L = max(numel)
    layers = sum(numel[i] for i in range(L))
    head = numel[L] + (numel[-1] if tied else 0)
    if head_streamed:
        state = 12 * head if head_state_bytes is None else head_state_bytes
        return {"host_extra": (0 if tied else numel[-1]) / layers, "in_extra": state / layers}
    return {"host_extra": (numel[-1] + numel[L]) / layers, "in_extra": 4 * head / layers}


STREAM_RATE_STEPS = 3  # "stream" sets its share from the host's AdamW rate this many times (Note: [Stream rate])
# Note: [Host window] a host layer's update can start only once its gradients land, early in the backward
# (the host layers are the last ones), and must end before the next forward loads it; the forward's loads
# of the host layers wait for those updates, so the host's AdamW and those loads follow one another while
# the host idles through the forward of the host layers and the loss. The rule balances the two together
# against 3/4 of PCIe's time. Traced on the H200 (2026-12-03, 3B x 1, ``bench/throughput.py --host-window``,
# logs/h200-2026-12-03-stream-share-steps.log), int8 moments: 10 host layers ran a 397 ms step bound by
# PCIe in, 16 a 488 ms step where the host sat idle 122 ms from its last update to the first gradient;
# the rule that counted the updates alone left 20 on the host (543 ms). Counting the loads it left 11
# (int8, 387 ms) and 10 with fp32 moments (655 ms, bound by PCIe in), where the fp32 sweep was flat between
# 9 and 12 host layers (the planner's simulation: fastest at 14).
HOST_WINDOW = 0.75
STREAM_CACHE_SHARE = 0.10  # "stream": every layer gets a weight slot when they all take at most this share
STATE_SLOT_SHARE = 0.05  # "device" units' state slots: as many as this share of device memory holds (>= 2)


def weight_slots(setting, mode, num_layers: int, layer_bytes: int, device_bytes: int | None) -> int:
    """``EngineConfig.weight_slots``, resolved: an int as given; None: 2, or one slot per layer under
    placement "stream" on a device where they take at most ``STREAM_CACHE_SHARE`` of its memory, so
    that the backward reuses the forward's weights and PCIe carries each layer's weights once a step
    (Note: [Streamed updates]; the slot plan, ``schedule.plan_loads``, keeps what a slot holds).

    Example:
        >>> weight_slots(None, "stream", 36, 154 << 20, 140 << 30), weight_slots(None, "auto", 36, 154 << 20, 140 << 30)
        (36, 2)
    """
    if setting is not None:
        return setting
    if mode == "stream" and device_bytes and num_layers * layer_bytes <= STREAM_CACHE_SHARE * device_bytes:
        return max(2, num_layers)
    return 2


def state_slots(streamed: int, slot_bytes: int, device_bytes: int | None) -> int:
    """Device buffers for the fp32 state (master and moments) of ``streamed`` "device" units on its way
    through (Note: [Streamed updates]): one per unit where they take at most ``STATE_SLOT_SHARE`` of
    device memory, else as many as that share holds, never fewer than 2 (one updating while the next
    loads); 0 with nothing streamed. With two, each state load waits for the write-back two units back,
    and the loads chain behind the updates; with more they run ahead while the host layers' backward
    computes (the planner's 3B x 1 / x 4 stream steps with 15 units streamed: 775 / 995 ms with 2 slots,
    730 / 949 with 4, 712 / 926 from 8, the planner's simulation; not yet measured).

    Example:
        >>> state_slots(15, 924 << 20, 140 << 30), state_slots(20, 2800 << 20, 140 << 30), state_slots(0, 1, 1)
        (7, 2, 0)
    """
    if not streamed:
        return 0
    room = int(STATE_SLOT_SHARE * device_bytes // slot_bytes) if device_bytes else 2
    return max(2, min(streamed, room))


def choose(numel: dict[int, int], *, mode, free_bytes: int | None, dtype_bytes: int, tied: bool,
           cuda: bool, share: float = 0.0) -> dict[int, Choice]:
    """Each unit's placement.

    Args:
        numel: unit -> elements of its flat slab (units -1..L).
        mode: a validated ``placement=`` value (see ``validate``).
        free_bytes: device memory the activation policy leaves (None: not measured yet).
        dtype_bytes: bytes of the compute dtype.
        tied: the embedding is the lm_head (Note: [Tied head group]).
        cuda: the device is a GPU (on "cpu" residency would hold a second copy in the same RAM).
        share: under "stream", the share of the layers placed "device" (``stream_share``).
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
    if not cuda:
        return {u: Choice("host", "device 'cpu': host and device memory are the same RAM") for u in numel}
    if mode == "stream":
        k = round(share * L)
        why = f"placement='stream': the first {k} of {L} layers update on the device (a share of {share:.2f} balances PCIe "
        head = (L, -1) if tied else (L,)  # Note: [Streamed head]
        return {u: Choice("device", why + "against the host's AdamW)") if 0 <= u < k else
                Choice("device", why + "against the host's AdamW); the head group streams its state "
                       "(Note: [Streamed head])") if u in head else
                Choice("host", why + "against the host's AdamW); " +
                       ("an untied embedding updates on the host" if u == -1 else "this one on the host"))
                for u in numel}
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


def head_groups(numel: dict[int, int], resident, *, dtype_bytes: int, tied: bool,
                adam_params_per_s: float) -> list[tuple[int, float]]:
    """(device bytes resident, host AdamW seconds) of each group not in ``resident``, in the order the
    forward needs them: what candidate C may make resident (``head_budgets``, Note: [Auto search])."""
    L = max(numel)
    return [(sum(resident_bytes(u, numel[u], dtype_bytes, tied) for u in g), sum(numel[u] for u in g) / adam_params_per_s)
            for g in groups(L, tied) if not set(g) & set(resident)]


def head_budgets(free_a: int, free_b: int, head: list, wait: float, step: float) -> list[int]:
    """Candidate C's device bytes for residents to predict (Note: [Auto search]), fewest first; [] when C is
    not worth predicting.

    Args:
        free_a, free_b: candidate A's and B's bytes for residents.
        head: (device bytes, host AdamW seconds) of each group that A leaves on the host, in the order
            the forward needs them.
        wait, step: A's step and how long its forward waits for host updates (seconds; the planner's).
    Returns:
        ``free_a`` (at least the reserve) plus the bytes of the first one, two, ... groups of ``head``,
        up to the first groups whose host AdamW adds up to ``wait``, each under B's budget;
        [] when the wait is under 3% of the step.

    Example:
        >>> GiB = 2**30
        >>> [b // GiB for b in head_budgets(5 * GiB, 99 * GiB, [(10 * GiB, 0.1), (4 * GiB, 0.05), (4 * GiB, 0.05)],
        ...                                 wait=0.12, step=1.0)]
        [15, 19]
    """
    if wait < 0.03 * step:
        return []
    out, need, covered = [], max(free_a, RESERVE_BYTES), 0.0  # A may have overshot its budget: C's residents displace activations
    for nbytes, adam_s in head:
        if covered >= wait or need + nbytes >= free_b:
            break
        need, covered = need + nbytes, covered + adam_s
        out.append(need)
    return out


def best_budget(budgets: list[int], predict) -> tuple[int, tuple[float, float]] | None:
    """The budget of ``budgets`` whose prediction (``predict(bytes)`` -> (step s, wait s)) has the shortest
    step, the fewest bytes among equals, with that prediction; None for no budgets.

    Example:
        >>> best_budget([1, 2, 3, 4], lambda b: ({1: 3.4, 2: 3.3, 3: 3.3, 4: 3.5}[b], 0.0))
        (2, (3.3, 0.0))
    """
    if not budgets:
        return None
    tried = [(b, predict(b)) for b in budgets]
    return min(tried, key=lambda t: t[1][0])


HOST_HIDES = 5  # a measuring step this many times the host AdamW of every unit hides it (Note: [Auto search])


def host_bound(step_s: float, adam_s: float) -> bool:
    """Whether the host's AdamW could hold a step of this batch size back, so that the "auto" search's
    trials are worth their steps: the measuring step (nothing resident, first-step costs included) took
    under ``HOST_HIDES`` times the host AdamW of every unit. Long context hides the host: 7B at 128K
    tokens steps ~40 s against ~3 s of AdamW. The bound was 3 until the H200's runs of 2026-12-02: 3B x 16's measuring step took
    5.07 s against 1.38 s of AdamW, so no trial ran, and A's forward then waited 149 ms a step for host
    AdamW at 304.2 TFLOPS, where the trial winner of 2026-12-01 ran 330.2.

    Example:
        >>> host_bound(5.07, 1.38), host_bound(40.0, 3.0)
        (True, False)
    """
    return step_s < HOST_HIDES * adam_s


MARGIN = 0.02  # the planner's best must beat a candidate that holds fewer residents by this much (Note: [Auto search]; 0.05 until 2026-12-06)


@dataclasses.dataclass
class Search:
    """The "auto" mode's choice between ways to share the device, made by the planner's predictions.

    Note: [Auto search] candidate A, activations first: the layers the activation policy keeps stay
    kept, and residency takes what they leave. Candidate C, the forward's head resident: A, plus
    just enough residency for the units the next forward needs first that the forward no longer
    waits for their host AdamW (the last gradients to land are the first weights the next step
    reads); those bytes come from the activations, so the policy keeps a layer or two fewer. Candidate
    B, residency first: the kept activations give their memory back (less one layer's working set and
    a checkpoint per layer), units become resident in that, and the activation policy keeps what is
    still free. A is right when the host's AdamW hides behind a long step; C when only its tail shows;
    B when the host's AdamW is what the step waits for.
    The engine runs one measuring step (nothing resident): it measures what the activations leave
    free, the policy's kept layers and the host's AdamW rate. The planner (``autoplan.py``), given
    those, predicts each candidate's steady step: A's from A's budget, B's from B's, and C's from each
    of C's budgets (``head_budgets``: A's plus the forward's first one, two, ... groups, up to those
    whose host AdamW covers the wait for host updates the planner predicts in A's step); C is the best
    of them. Covering the whole wait overshoots: each resident also takes activations (recompute) and
    adds device AdamW at the step's end, so the planner's step is least short of the cover. (H200,
    7B x 8 fp32, 2026-12-06: the cover made 11 units resident, 3.427 s measured, 3.489 predicted; the
    planner's own best there is 3 to 4 residents, 3.29 s, and rows with 2 to 6 residents had measured
    3.23 to 3.27 s.) The predicted best wins, except that a candidate holding fewer residents (A before C before B) wins
    when predicted within ``MARGIN`` of it: it moves less state and needs no trial step. Nothing is
    timed against anything. Timing cannot fit the budget of three steps to settle with no step after
    the first over 1.5 times the steady one: a trial's first step is gated (below), so the next one
    carries its whole host AdamW (7B x 8: C timed in the step after its gated one took 4.15 s, 3.23
    where nothing was gated before it) and only the step after that is as every later step will be.
    Timing C and B took ten steps to settle at 7B x 8, with steps of up to 10 s against 3.25. The
    planner predicted the measured step within 10% on 24 of 25 benchmark rows, and its errors run the
    same way for every candidate of a step: the margin leaves ties to the cheaper candidate. It was 5%
    until an H100 lease of 2026-12-06 (3B x 8): C was predicted 4.4% faster than A, A won, and in the
    same lease C measured 324.0 model TFLOPS against A's 300.2 (7.9% faster); at 2% C wins there and at
    14B int8 (predicted 2.7% faster), while 3B x 1's 1.9% stays A's. The winner's first settled steps are still timed (``observed``)
    and reported beside the predictions, so a wrong pick shows in ``Session.placement``.
    When A already makes every unit resident, nothing is kept, or the measuring step lasted over
    ``HOST_HIDES`` times the host AdamW of every unit (long context: the host hides; ``host_bound``),
    nothing is predicted: A at once. Where the planner cannot predict (a shape it cannot read), A.
    C's or B's first step (C1, B1) is a trial and is gated: no update starts before its backward has
    run, so an out-of-memory error anywhere in it leaves nothing applied and the engine runs the batch
    again as A (``abandon``). Its later steps overlap as every later one will; they peak where the first
    did, bar the device AdamW's fp32 copy of one unit's gradients beside the backward. (3B x 16: C1 ran
    out in its backward after the loss had started the updates, and the error ended the run.) Holding
    every gradient until the backward ends costs host RAM where the gradient ring replaced the slabs
    (2 bytes a parameter, once): where the host has not that much free, C and B are not entered and A
    wins, saying why (``planned``'s ``no_trial``): a slower placement rather than a host out of memory.
    Phases: measure -> done (A), or measure -> C1 / B1 -> done. Settled from the third step at most.
    """

    phase: str = "measure"
    free: dict = dataclasses.field(default_factory=dict)  # candidate -> device bytes for residents
    keep: dict = dataclasses.field(default_factory=dict)  # candidate -> activation policy (list of bool)
    predicted: dict = dataclasses.field(default_factory=dict)  # candidate -> the planner's steady step (s)
    waited: dict = dataclasses.field(default_factory=dict)  # candidate -> predicted forward's wait for host updates (s)
    seconds: dict = dataclasses.field(default_factory=dict)  # candidate -> measured step (s); inf: ran out of memory
    observed: list = dataclasses.field(default_factory=list)  # the winner's first settled steps (s)
    head: list = dataclasses.field(default_factory=list)  # [(device bytes, host AdamW s)] per group A leaves host
    adam_rate: float | None = None  # the host's AdamW (params/s) the measuring step measured; None: not measured
    c_groups: tuple | None = None  # (head groups C makes resident, budgets predicted for it); None: C not predicted
    winner: str | None = None
    why: str = ""  # why the winner won, for ``summary``

    NAMES = {"A": "activations first", "C": "the forward's head resident", "B": "residency first"}
    ORDER = ("A", "C", "B")  # fewer residents first: the cheaper candidate wins ties
    OBSERVE = 3  # settled steps of the winner timed for ``summary``

    @classmethod
    def done_with(cls, free: int) -> "Search":
        """A finished search that places from ``free`` bytes (a resumed run: its checkpoint says so)."""
        return cls(phase="done", free={"A": free}, winner="A", why="restored from a checkpoint")

    @property
    def candidate(self) -> str | None:
        """What the next step runs: None (measuring: nothing resident), "A", "C" or "B"."""
        if self.phase == "measure":
            return None
        if self.phase == "plan":
            return "A"  # measured, not yet predicted: what A would run
        return self.winner if self.phase == "done" else self.phase[0]

    @property
    def trial(self) -> bool:
        """This step is C's or B's first: an out-of-memory error in it is the trial's, not the run's."""
        return self.phase in ("C1", "B1")

    def measured(self, *, free: int, keep: list, layer_bytes: int, checkpoint_bytes: int, everything_fits: bool,
                 host_bound: bool = True, head: list | None = None, adam_rate: float | None = None) -> None:
        """After the measuring step: A's and B's budgets (see the Note). ``host_bound``: the host's AdamW
        could hold the step back (else, a long step that hides it, nothing else is worth predicting).
        ``head``: (device bytes, host AdamW seconds) of each group that A leaves on the host, in the
        order the forward needs them (what C makes resident, as far as A's forward waits). ``adam_rate``:
        the host's AdamW rate the step measured (params/s), kept for ``inputs``. Leaves the phase "plan"
        (``planned`` decides) or "done" (A)."""
        kept = sum(keep)
        self.adam_rate = adam_rate
        self.free["A"], self.keep["A"] = free, list(keep)
        self.free["B"] = free + kept * (layer_bytes - checkpoint_bytes) - layer_bytes
        self.head = list(head or [])
        why = ("every unit fits beside the activations" if everything_fits else
               "the activation policy keeps no layer" if kept == 0 else
               "" if host_bound else f"the measuring step hides the host's AdamW (over {HOST_HIDES}x it)")
        if why:
            self.phase, self.winner, self.why = "done", "A", why
        else:
            self.phase = "plan"

    def planned(self, predict, no_trial: str | None = None) -> None:
        """Decide from the planner (see the Note); ``predict(free_bytes)`` -> (steady step s, the forward's
        wait for host updates s) of the candidate with that many bytes for residents, or None where the
        planner cannot say (then A). ``no_trial``: why a gated trial step cannot run here (the host cannot
        hold its gradients at once: Note [Gradient ring] in ``host/grad_ring.py``), or None; where set, A
        wins, since C and B are entered only through a trial."""
        if predict is None:
            self.phase, self.winner, self.why = "done", "A", "the planner cannot predict this model"
            return
        self.predicted["A"], self.waited["A"] = predict(self.free["A"])
        budgets = head_budgets(self.free["A"], self.free["B"], self.head, self.waited["A"], self.predicted["A"])
        best = best_budget(budgets, predict)
        if best is not None:
            self.free["C"], (self.predicted["C"], self.waited["C"]) = best
            self.c_groups = (budgets.index(best[0]) + 1, len(budgets))
        self.predicted["B"], self.waited["B"] = predict(self.free["B"])
        self.winner, self.why = pick(self.predicted)
        if self.winner != "A" and no_trial is not None:
            self.why = f"{self.NAMES[self.winner]} was {self.why}, but its trial step cannot run: {no_trial}"
            self.winner = "A"
        self.phase = "done" if self.winner == "A" else self.winner + "1"

    def stepped(self, seconds: float, keep: list, waited: float = 0.0) -> None:
        """After a step of the search's choice: a trial's first step ends the search (its activation policy,
        decided in its forward around the residents, stays); later ones are timed for ``summary``."""
        if self.trial:
            self.keep[self.phase[0]] = list(keep)
            self.phase = "done"
        elif self.phase == "done" and len(self.observed) < self.OBSERVE:
            self.observed.append(seconds)
            self.seconds[self.winner] = seconds  # the last observed: as every later step will be

    @property
    def observing(self) -> bool:
        """Settled, and the winner's first steps are still being timed (``stepped``)."""
        return self.phase == "done" and self.winner is not None and len(self.observed) < self.OBSERVE

    def abandon(self) -> None:
        """The trial (C or B) ran out of device memory: it is out of the running, and A, which holds fewer
        residents and whose policy the measuring step ran, wins."""
        c = self.phase[0]
        self.seconds[c] = float("inf")
        self.phase, self.winner, self.why = "done", "A", f"{self.NAMES[c]} ran out of device memory"

    def inputs(self) -> dict:
        """What the measuring step handed the choice, for a benchmark's row: each candidate's GiB for residents,
        the layers the measuring step's activation policy kept, and the host's AdamW rate (G params/s) it
        measured; {} before the measuring step. Two runs that chose differently differ here, or in the
        planner (``autoplan.candidate_step``), which these inputs reproduce.

        Example:
            >>> s = Search()
            >>> s.measured(free=3 << 30, keep=[True, False], layer_bytes=1 << 30, checkpoint_bytes=0,
            ...            everything_fits=False, adam_rate=2.5e9)
            >>> s.inputs()
            {'free_gib': {'A': 3.0, 'B': 3.0}, 'kept_layers': 1, 'host_adam_G_params_per_s': 2.5}
        """
        if "A" not in self.keep:
            return {}
        return {"free_gib": {c: round(b / 2**30, 2) for c, b in self.free.items()}, "kept_layers": sum(self.keep["A"]),
                "host_adam_G_params_per_s": None if self.adam_rate is None else round(self.adam_rate / 1e9, 3)}

    def _groups(self, c: str) -> str:
        """For C, how many of the forward's first groups it makes resident, of the budgets predicted."""
        if c != "C" or self.c_groups is None:
            return ""
        k, n = self.c_groups
        return f" with its first {k} group{'s' * (k > 1)} resident, the best of {n}"

    def summary(self) -> str:
        """One line for Session.placement: the planner's prediction per candidate, what won and why, and
        the winner's measured step."""
        if self.winner is None:
            return ""
        out = "auto chose " + self.NAMES[self.winner]
        if self.predicted:
            out += " (planner: " + ", ".join(f"{self.NAMES[c]} {self.predicted[c]:.3f} s" + self._groups(c)
                                             for c in self.ORDER if c in self.predicted) + " a step)"
        out += f": {self.why}" if self.why else ""
        for c, s in self.seconds.items():
            out += (f"; {self.NAMES[c]} ran out of device memory" if s == float("inf") else
                    f"; measured {s:.3f} s a step")
        return out


def pick(predicted: dict[str, float], margin: float | None = None) -> tuple[str, str]:
    """The winner among predicted steady steps (candidate -> seconds) and why: the fastest, unless a
    candidate holding fewer residents (``Search.ORDER``) is predicted within ``margin`` of it (None:
    ``MARGIN`` as it stands when called, so a benchmark may set it).

    Example:
        >>> pick({"A": 3.41, "C": 3.21, "B": 3.50})[0], pick({"A": 3.26, "C": 3.21, "B": 3.50})[0]
        ('C', 'A')
    """
    margin = MARGIN if margin is None else margin
    best = min(predicted, key=predicted.get)
    for c in Search.ORDER:
        if c in predicted and predicted[c] <= predicted[best] * (1 + margin):
            if c == best:
                return c, "predicted fastest"
            return c, (f"predicted within {margin:.0%} of {Search.NAMES[best]}, with fewer residents")
    return best, "predicted fastest"
