"""Long-context memory arithmetic: what a layer keeps per token (tiled or not), the working set of a
step's backward, and where recompute-block inputs wait — device first, host for the rest, or longer
blocks — from both budgets. Pure Python: no torch, no device.

Owns the one rule for placing long-context activations — ``place_checkpoints`` (block inputs),
``place_cache`` / ``place_long`` (which layers keep their attention output, walked by ``backward_peak``):
``planner.plan`` calls it with a ``Hardware`` profile's capacities to predict, ``Engine`` (through
``Checkpoints``, which holds the engine's choice) with measured free memory (device allocator,
``psutil``) to decide, at the first step and again when the tokens per micro-batch grow.
Does not own the tiling itself (``tiling.py``), the parking and fetching (``transfers.Offload``),
the cache's capture and replay (``attncache.py``), or time (``planner.py``).
Over 400 lines because the per-layer bytes, their notes and the placement built on them are one rule
that the planner and the engine must share exactly; half of it in another module would be read apart.

Note: [Long-context memory] per token of one layer, d = compute dtype bytes, q = heads*head_dim,
kv = kv_heads*head_dim, h = hidden, I = intermediate, n = heads; measured on the H200 for the 7B shape
at 32K-512K tokens under cuDNN, flash and efficient attention (bench/layer_memory.py, 2026-12-01):
  saved, untiled: shape.py's Note [Activation estimate] (norms' fp32 copies, q/k/v/output, 4*d*I of MLP)
  saved, tiled:   d*(3h + 3q + 2kv) + 4n — the attention's normed input and the mid-layer residual
                  (2h), q after rotary, the attention output and o_proj's input (3q), k and v (2kv),
                  the log-sum-exp (fp32, 4n), and the layer's output (h: the next layer's input, or the
                  block's output the backward starts from); the MLP keeps only its input and recomputes
                  its norm per tile (tiling.py, Note [Tiled recompute]). 45,168 B/token counted,
                  45,165 measured at 512K (the forward's allocation, output included).
  backward working set beyond what is saved: the larger of two phases, plus the next parked block
  fetched ahead (d*h):
    attention phase: the gradients at the layer's output and input (2*d*h), the attention output's
      gradient and dq (2*d*q), the fp32 dq accumulator (4*q), dk and dv (2*d*kv), the softmax row
      statistics (4n) — 45,168 B/token counted, 45,100 measured at 256K and 512K;
    MLP phase: the two gradients (2*d*h) and one MLP tile's gate, up, activation, product and their
      gradients (8*d*I per row of the tile) — 5.06 / 6.38 GiB counted at 32K / 128K, 4.99 / 6.27 measured.
  The phases do not overlap (the MLP tile's buffers are gone before the attention backward starts):
  below ~110K tokens of the 7B shape the MLP phase is the larger, above it the attention phase.
  Untiled layers (short context) keep the earlier, unmeasured count: the attention backward with K and V
  expanded to every query head and an fp32 dq (4*d*q + 4*q), the two gradients and the fetched input (3*d*h).
A recompute block of K layers holds K layers' saved sets at once during its backward; it needs one
checkpoint instead of K. Held against whole-step peaks in bench/long_context.py's rows.

Note: [Device share] ``activation_budget=None`` (the default) lets kept activations and resident units
fill ``KEEP_SHARE`` of device memory (what short contexts were tuned with: room for the allocator's
slack and the streams' buffers), and lets recompute-block inputs with the backward's working set reach
``LONG_SHARE`` where they fit nowhere at ``KEEP_SHARE``: at 512K tokens of the 7B shape one input is
3.5 GiB, the host has ~12 GiB to spare beside the 7B state, and the 10% between the two shares holds
four more inputs. A float fixes one share for both. ``Checkpoints`` and ``planner.plan`` take the
first share at which the inputs fit (``choose_share``); cached attention outputs may then reach
``LONG_SHARE`` too where not every recomputed layer's fits (``place_long``: at 512K six layers' instead of
one, 24 s of the step).

Note: [Attention cache placement] The cached layers are the last recomputed ones. The backward reaches
them first, so at its first block, the worst point of the step, every cache is alive either way; but
there the block's own layers recompute without a second attention output (``lean``), and the caches go
as the backward proceeds. With the first layers cached instead, the first block recomputes full saved
sets beside every cache: at 512K tokens of the 7B shape, blocks of 2, 7.1 GiB more at the peak, two
cached layers fewer. ``backward_peak`` walks the blocks and takes the worst.

Parked inputs live in page-locked 64 MiB chunks that a longer context reuses (``transfers.HostChunks``,
Note: [Parked chunks]); the embedding-row gradient buffer is page-locked at its size
(``transfers.pinned_exact``): torch's pinned allocator rounds a 3.5 GiB request up to 4 GiB and keeps
a freed block cached.
"""
from __future__ import annotations

import math

_GIB = 1 << 30
MAX_BLOCK = 4  # longest recompute block place_checkpoints tries
HOST_MARGIN = 4 * _GIB  # host RAM left to the OS, the process's libraries and the allocator
DEVICE_RESERVE = 2 * _GIB  # device memory left to the CUDA context, cuBLAS / attention workspaces, allocator slack
KEEP_SHARE = 0.85  # activation_budget=None: device share for kept activations and residents (Note: [Device share])
LONG_SHARE = 0.95  # activation_budget=None: device share recompute-block inputs may reach where nothing else fits
PAGE = 4096
PARK_CHUNK = 64 << 20  # bytes per chunk of parked-input host memory (transfers.HostChunks)
CACHE_SHARE = 0.25  # attention_cache=None: cache where attention is this share of a forward (7B: seq >= ~22K)


def shares(activation_budget: float | None) -> tuple:
    """Device shares to try for recompute-block inputs, in order (Note: [Device share])."""
    return (activation_budget,) if activation_budget is not None else (KEEP_SHARE, LONG_SHARE)


def keep_share(activation_budget: float | None) -> float:
    """Device share kept activations and resident units may fill."""
    return KEEP_SHARE if activation_budget is None else activation_budget


def choose_share(activation_budget: float | None, *, total: float, used: float, layers: int, ckpt_bytes: int,
                 reserve, host_free: float, block: int | None = None) -> float:
    """The first of ``shares(activation_budget)`` at which the inputs of ``layers`` recomputed layers fit
    (``place_checkpoints`` with ``share * total - DEVICE_RESERVE - used`` device bytes); the last when none
    does (the placement there raises the error that says what is short). Note: [Device share]."""
    def fits(share: float) -> bool:
        try:
            place_checkpoints(layers=layers, ckpt_bytes=ckpt_bytes, device_free=share * total - DEVICE_RESERVE - used,
                              reserve=reserve, host_free=host_free, host_each=parked_bytes(ckpt_bytes), block=block)
            return True
        except PlacementError:
            return False
    tried = shares(activation_budget)
    return next((x for x in tried if fits(x)), tried[-1])


class PlacementError(MemoryError, ValueError):
    """The recompute-block inputs fit neither on the device nor in host RAM; the message says what would."""


def tiled_bytes_per_token(s: dict, d: int) -> int:
    """Bytes one tiled layer keeps per token for its backward (Note: [Long-context memory])."""
    q, kv = s["heads"] * s["head_dim"], s["kv_heads"] * s["head_dim"]
    return d * (3 * s["hidden"] + 3 * q + 2 * kv) + 4 * s["heads"]


def backward_transient_bytes(s: dict, tokens: int, d: int, rows: int) -> int:
    """Working set of one layer's backward beyond its saved set, for ``tokens`` tokens per micro-batch:
    the larger of its attention and MLP phases, plus the next parked block fetched ahead (Note:
    [Long-context memory]).

    Args:
        s: ``planner.model_shape`` of the model.
        rows: rows per MLP tile (0: untiled; the MLP's intermediates are then in the saved set).
    Example:
        >>> s = dict(heads=28, head_dim=128, kv_heads=4, hidden=3584, intermediate=18944, experts_per_tok=0)
        >>> round(backward_transient_bytes(s, 524288, 2, 16384) / 2**30, 2)  # 7B at 512K: 22.05 + 3.5 fetched
        25.55
    """
    q, kv, h, n = s["heads"] * s["head_dim"], s["kv_heads"] * s["head_dim"], s["hidden"], s["heads"]
    inter = s["intermediate"] * (s["experts_per_tok"] or 1)
    if not rows:  # untiled (short context): not measured apart; the attention backward's buffers with K and V
        return tokens * (4 * d * q + 4 * q) + 3 * tokens * h * d  # expanded, beside the gradients and the fetch
    grads = 2 * d * h * tokens  # at the layer's output and input
    attention = grads + tokens * (2 * d * q + 4 * q + 2 * d * kv + 4 * n)
    mlp = grads + 8 * rows * inter * d
    return max(attention, mlp) + tokens * h * d


def pinned_bytes(n: int) -> int:
    """Host bytes a buffer of ``n`` bytes takes page-locked at its exact size (``transfers.pinned_exact``):
    whole pages."""
    return -(-int(n) // PAGE) * PAGE


def parked_bytes(n: int) -> int:
    """Host bytes one parked input of ``n`` bytes holds: whole ``PARK_CHUNK`` chunks (``transfers.HostChunks``)."""
    return -(-int(n) // PARK_CHUNK) * PARK_CHUNK


def place_checkpoints(*, layers: int, ckpt_bytes: int, device_free: float, reserve, host_free: float,
                      host_each: int, block: int | None = None) -> tuple[int, int]:
    """Where the inputs of the recompute blocks of ``layers`` recomputed layers wait for the backward.

    Device first: as many blocks as fit beside the backward's working set stay on the device, the
    earliest of the others are parked in host memory. A block of K layers needs one input instead of K
    but holds K layers' saved sets during its backward (``reserve(K)``), at no extra forward. Returns
    the shortest block with nothing on the host; else the block that parks the fewest bytes.

    Args:
        layers: recomputed layers (the last ``layers`` of the model).
        ckpt_bytes: one block input on the device (B*T*H*dtype bytes).
        device_free: device bytes for checkpoints and the backward's working set together.
        reserve: K -> bytes of the backward's working set with blocks of K layers.
        host_free: host bytes free for parked inputs.
        host_each: host bytes of one parked input (pinned: a power of two on CUDA).
        block: a fixed block length (``EngineConfig.checkpoint_every``); None tries 1..MAX_BLOCK.
    Returns:
        (block, parked): blocks of ``block`` layers; the first ``parked`` of them wait in host memory.
    Raises:
        PlacementError: no block length fits; names the bytes short on each side and what would fit.
    Example:
        >>> place_checkpoints(layers=28, ckpt_bytes=1, device_free=30, reserve=lambda k: 10 * k,
        ...                   host_free=5, host_each=1)  # blocks of 1 would park 8; blocks of 2 park 4
        (2, 4)
    """
    best, tried = None, []
    for K in ([block] if block else range(1, MAX_BLOCK + 1)):
        n = math.ceil(layers / K)
        room = device_free - reserve(K)
        on_device = max(0, min(n, int(room // ckpt_bytes))) if room > 0 else 0
        parked = n - on_device
        tried.append((K, n, parked, room))
        if room < 0 or (parked and parked * host_each > host_free):  # nothing parked needs no host RAM
            continue
        if best is None or parked * host_each < best[1] * host_each:
            best = (K, parked)
        if parked == 0:
            break
    if best is not None:
        return best
    lines = [f"blocks of {K}: {n} inputs of {ckpt_bytes / _GIB:.2f} GiB, "
             + (f"the backward alone needs {-room / _GIB:.1f} GiB more device memory" if room < 0 else
                f"{n - parked} fit on the device, {parked} parked need {parked * host_each / _GIB:.1f} GiB of host RAM")
             for K, n, parked, room in tried]
    raise PlacementError(
        f"the recompute-block inputs fit nowhere: {host_free / _GIB:.1f} GiB of host RAM free for them, "
        f"{device_free / _GIB:.1f} GiB of device memory for them and the backward ({'; '.join(lines)}). "
        "Raise activation_budget (device share), lower pinned_budget_bytes (host), set tile_tokens (smaller "
        "layers), or train on a shorter seq; planner.plan(...).advice names the setting that fits")


def backward_peak(*, layers: int, block: int, parked: int, cached: int, act: float, lean: float, transient: float,
                  ckpt_bytes: int, cache_bytes: int) -> dict:
    """Device bytes at the worst block of the backward of ``layers`` recomputed layers (Note: [Attention
    cache placement]): blocks of ``block`` layers from the first, the first ``parked`` inputs in host
    memory, the last ``cached`` layers' attention outputs kept from the forward.

    At each block's backward the device holds its input and the on-device inputs of the blocks still to
    come (a parked block's own input comes back for it), the cached outputs of the layers not yet reached,
    the block's recomputed saved sets (``act`` a layer, ``lean`` a cached one) and one layer's backward
    working set (``transient``).

    Returns:
        ``{"checkpoints", "attention_cache", "recompute_workspace", "backward_transient"}`` at the block
        where their sum is largest.
    Example:
        >>> p = backward_peak(layers=4, block=2, parked=0, cached=2, act=10, lean=8, transient=5, ckpt_bytes=1,
        ...                   cache_bytes=3)  # last block: 2 inputs, 2 caches, 2 lean sets; the first: 1, 0, 2 full
        >>> p, sum(p.values())
        ({'checkpoints': 2, 'attention_cache': 6, 'recompute_workspace': 16, 'backward_transient': 5}, 29)
    """
    first_cached, worst = layers - cached, None
    for j, start in enumerate(range(0, layers, block)):
        end = min(start + block, layers)
        m = max(0, end - max(start, first_cached))  # cached layers in this block
        part = {"checkpoints": max(j - parked + 1, 1) * ckpt_bytes,
                "attention_cache": max(0, end - first_cached) * cache_bytes,
                "recompute_workspace": (end - start - m) * act + m * lean, "backward_transient": transient}
        if worst is None or sum(part.values()) > sum(worst.values()):
            worst = part
    return worst


def place_cache(*, layers: int, cache_bytes: int, ckpt_bytes: int, device_free: float, act: float, lean: float,
                transient: float, host_free: float, host_each: int, block: int | None = None) -> tuple[int, int, int]:
    """How many of ``layers`` recomputed layers keep their attention output on the device (Note:
    [Attention cache] in attncache.py), and where their block inputs wait then: the most that leave the
    inputs a place at the backward's worst block (``backward_peak`` within ``device_free``). The cached
    ones are the last (Note: [Attention cache placement]). For each block length the fewest inputs are
    parked; the shortest block with nothing parked wins, else the block that parks the fewest bytes.

    Args:
        act, lean: a recomputed layer's saved set, uncached and cached (``act`` less ``attn_out``).
        transient: one layer's backward working set.
        Others: as ``place_checkpoints``.
    Returns:
        (cached, block, parked): the last ``cached`` recomputed layers keep theirs; blocks of ``block``
        layers, the first ``parked`` inputs in host memory.
    Raises:
        PlacementError: the inputs fit nowhere even with nothing cached (``place_checkpoints``' message).
    Example:
        >>> place_cache(layers=28, cache_bytes=1, ckpt_bytes=1, device_free=40, act=10, lean=10, transient=0,
        ...             host_free=5, host_each=1)  # blocks of 2: 9 inputs and 11 caches, 5 parked
        (11, 2, 5)
    """
    def peak(n: int, K: int, p: int) -> float:
        return sum(backward_peak(layers=layers, block=K, parked=p, cached=n, act=act, lean=lean, transient=transient,
                                 ckpt_bytes=ckpt_bytes, cache_bytes=cache_bytes).values())

    def fewest_parked(n: int, K: int) -> int | None:
        blocks = math.ceil(layers / K)
        lo, hi = 0, min(blocks, max(0, int(host_free // host_each)))  # nothing parked needs no host RAM
        if peak(n, K, hi) > device_free:
            return None
        while lo < hi:  # fewer parked never needs less device memory
            mid = (lo + hi) // 2
            lo, hi = (mid + 1, hi) if peak(n, K, mid) > device_free else (lo, mid)
        return lo

    for n in range(layers, -1, -1) if cache_bytes else (0,):
        best = None
        for K in [block] if block else range(1, MAX_BLOCK + 1):
            p = fewest_parked(n, K)
            if p is None:
                continue
            if best is None or p < best[1]:  # every input parks the same bytes
                best = (K, p)
            if p == 0:
                break
        if best is not None:
            return (n, *best)
    place_checkpoints(layers=layers, ckpt_bytes=ckpt_bytes, device_free=device_free, reserve=lambda k: k * act + transient,
                      host_free=host_free, host_each=host_each, block=block)  # raises, saying what is short
    raise PlacementError(f"the recompute-block inputs of {layers} layers fit nowhere in {device_free / _GIB:.1f} GiB "
                         f"of device memory and {host_free / _GIB:.1f} GiB of host RAM")


def place_long(*, share: float, activation_budget: float | None, total: float, used: float, layers: int,
               cache_bytes: int, ckpt_bytes: int, act: float, lean: float, transient: float, host_free: float,
               host_each: int, block: int | None = None) -> tuple[float, int, int, int]:
    """``place_cache`` in ``share * total - DEVICE_RESERVE - used`` device bytes; where that leaves some of
    the ``layers`` recomputed layers uncached and the share is automatic, the cache may reach
    ``LONG_SHARE`` as block inputs may (Note: [Device share]): only a context that fills the device with
    nothing kept gets there (7B: 512K), and each cached layer saves its attention forward.

    Returns:
        (share, cached, block, parked): the share placed in, then as ``place_cache``.
    Raises:
        PlacementError: as ``place_cache``, at ``share``.
    Example:
        >>> G = 1 << 30  # at half of 100 GiB three of four fit their 10 GiB cache, at LONG_SHARE all four
        >>> place_long(share=0.5, activation_budget=None, total=100 * G, used=0, layers=4, cache_bytes=10 * G,
        ...            ckpt_bytes=G, act=10 * G, lean=10 * G, transient=0, host_free=0, host_each=G)
        (0.95, 4, 1, 0)
    """
    def at(x: float) -> tuple:
        return place_cache(layers=layers, cache_bytes=cache_bytes, ckpt_bytes=ckpt_bytes,
                           device_free=x * total - DEVICE_RESERVE - used, act=act, lean=lean, transient=transient,
                           host_free=host_free, host_each=host_each, block=block)
    got = at(share)
    if cache_bytes and got[0] < layers and activation_budget is None and share < LONG_SHARE:
        try:
            more = at(LONG_SHARE)
            if more[0] > got[0]:
                return (LONG_SHARE, *more)
        except PlacementError:
            pass
    return (share, *got)


def layer_bytes(s: dict, tokens: int, d: int, rows: int, per_token_untiled: int, seq: int | None = None) -> dict:
    """Device bytes of one layer at ``tokens`` tokens: ``act`` (saved for its backward, tiled when
    ``rows``), ``boundary`` (its input: a recompute block's checkpoint), ``transient`` (the backward's
    working set beyond the saved set), ``cache`` (its kept attention output, Note: [Attention cache]
    in attncache.py), ``attn_out`` (the attention output a cached layer's recompute does not make
    again: ``act`` less this is its saved set then) and ``attn_share`` (the attention's share of the
    layer's forward FLOPs at ``seq`` tokens per sequence, default ``tokens``). ``per_token_untiled``:
    shape.py's Note [Activation estimate]."""
    per_token = tiled_bytes_per_token(s, d) if rows else per_token_untiled
    attn = (seq or tokens) * s["heads"] * s["head_dim"]  # causal attention FLOPs per token / 2, beside params
    return {"act": tokens * per_token, "boundary": tokens * s["hidden"] * d,
            "transient": backward_transient_bytes(s, tokens, d, rows),
            "cache": tokens * s["heads"] * (s["head_dim"] * d + 4),  # attncache.entry_bytes
            "attn_out": tokens * s["heads"] * (s["head_dim"] * d + 4) if rows else 0,  # the tiled saved set's q and LSE
            "attn_share": attn / (attn + s["active_params_per_layer"])}


def cache_bytes(lb: dict | None, setting: bool | None) -> int:
    """Device bytes one recomputed layer's cached attention output takes under ``EngineConfig.attention_cache``
    = ``setting``, 0 where none is cached: None caches where the attention is at least ``CACHE_SHARE`` of
    the layer's forward (long context; short sequences keep today's policy exactly), True everywhere."""
    if not lb or setting is False or (setting is None and lb.get("attn_share", 0) < CACHE_SHARE):
        return 0
    return lb.get("cache", 0)


def cache_first(lb: dict) -> float:
    """Device bytes each recomputed layer's cache claims before any layer is kept (``keep_cap``'s ``extra``):
    its ``cache`` where that saves more forward time per byte than keeping a layer (the attention's share
    of a forward per cache byte against a whole forward per kept byte beyond the input), else 0: at 4096
    tokens per sequence the attention is ~6% of a 7B layer's forward and keeping wins; at 32K and beyond
    the cache does."""
    cache = lb.get("cache", 0)
    return cache if cache and lb.get("attn_share", 0) * (lb["act"] - lb["boundary"]) > cache else 0


def keep_cap(*, layers: int, act: float, boundary: int, used: float, budget: float, reserve, host_free: float,
             host_each: int, block: int | None = None, extra: float = 0, inputs: bool | None = None) -> int:
    """Most leading layers the forward may keep so that the others' checkpoints still have a place.

    The keep rule is greedy (a layer is kept while its activations fit); at any length where the
    device is small beside a layer (long context, or a ``device_memory`` budget) that would leave no
    room for the later layers' checkpoints. Returns ``layers`` when nothing binds. ``extra``: device
    bytes each recomputed layer holds beside its block input (its kept attention output): those come
    first, a kept layer only where all of them still fit. ``inputs``: ``EngineConfig.offload_checkpoints``;
    where it fixes the inputs' place (blocks of one layer), False leaves them all on the device (no host
    room) and True parks them all (no host limit here: preflight counts their host bytes).

    Example:
        >>> cap = lambda inputs: keep_cap(layers=10, act=10, boundary=1, used=0, budget=60, reserve=lambda k: 10 * k,
        ...                               host_free=100, host_each=1, inputs=inputs)
        >>> cap(None), cap(False), cap(True)  # False: the 10 - k inputs stay beside the k kept layers
        (5, 4, 5)
    """
    if inputs is not None:
        host_free, block = (math.inf if inputs else 0), 1
    for k in range(layers, -1, -1):
        if k == layers:
            if used + layers * act <= budget:
                return layers
            continue
        try:
            place_checkpoints(layers=layers - k, ckpt_bytes=boundary,
                              device_free=budget - used - k * act - (layers - k) * extra,
                              reserve=reserve, host_free=host_free, host_each=host_each, block=block)
            return k
        except PlacementError:
            continue
    return 0


def host_free_bytes(to_come: int = 0, reusable: int = 0, host_memory: int | None = None) -> float:
    """Host bytes free for parked block inputs: the available RAM within ``host_memory``
    (``budget.host_available``, Note: [Budgets]) plus ``reusable`` (page-locked chunks no input holds,
    ``transfers.HostChunks``) less ``HOST_MARGIN`` and ``to_come`` (host buffers the step will still
    allocate, e.g. the pinned embedding-grad rows)."""
    from .budget import host_available

    return host_available(host_memory) + reusable - HOST_MARGIN - to_come


class Checkpoints:
    """The engine's checkpoint placement for one activation policy: the layer's predicted bytes, how
    many leading layers may keep their activations (``cap``), the recompute-block length (``block``)
    and which block inputs wait in host memory (``park``). Chosen again whenever the engine chooses its
    keep policy again (more tokens); ``Engine`` passes measured memory, ``planner.plan`` does the same
    arithmetic from a ``Hardware`` profile.

    Args:
        layers: decoder layers of the model.
        checkpoint_every: ``EngineConfig.checkpoint_every`` (k >= 1 fixes the block length).
        offload_checkpoints: ``EngineConfig.offload_checkpoints`` (True / False fix where inputs wait).
        activation_budget: ``EngineConfig.activation_budget`` (None: the shares of Note: [Device share]).
        attention_cache: ``EngineConfig.attention_cache`` (None: where attention is ``CACHE_SHARE`` of a
            forward, as many recomputed layers as fit on CUDA, none off it; True: at any length, as many
            as fit, all off CUDA; False: none). ``cached`` holds the choice.

    Example:
        >>> c = Checkpoints(4, checkpoint_every=1, offload_checkpoints=True)
        >>> c.parked(0, 10, None), c.park, c.block
        (True, {0: True, 1: True, 2: True, 3: True}, 1)
    """

    def __init__(self, layers: int, *, checkpoint_every: int | None, offload_checkpoints: bool | None,
                 activation_budget: float | None = None, attention_cache: bool | None = None):
        self.L, self.fixed, self.setting = layers, checkpoint_every or None, offload_checkpoints
        self.budget_setting, self.cache_setting = activation_budget, attention_cache
        self.cache_bytes = 0  # one cached layer's attention output (Note: [Attention cache] in attncache.py)
        self.attn_out = 0  # what a cached layer's recompute does not save again (layer_bytes' "attn_out")
        self.cached: frozenset = frozenset()  # recomputed layers whose attention output stays from the forward
        self.block = checkpoint_every or 1
        self.park: dict | None = None  # recompute-block start -> its input waits in host memory
        self.act, self.transient, self.cap = 0, 0, layers
        self.share = keep_share(activation_budget)  # the device share the inputs were placed in

    def _fit(self, *, layers: int, ckpt_bytes: int, used: float, total: float, host_free: float) -> float:
        act, transient = self.act, self.transient
        return choose_share(self.budget_setting, total=total, used=used, layers=layers, ckpt_bytes=ckpt_bytes,
                            reserve=lambda k: k * act + transient, host_free=host_free, block=self.fixed)

    def reset(self, lb: dict | None, memory=None) -> None:
        """A new keep policy: ``lb`` is ``layer_bytes`` at its tokens (None: unknown shape, nothing
        predicted); ``memory`` (None off CUDA) returns (device bytes in use, device bytes in all, host
        bytes free for parked inputs). The cap applies wherever ``checkpoint_every`` is automatic; a fixed
        ``offload_checkpoints`` fixes where the inputs wait, and the cap leaves them room there."""
        self.park, self.cap, self.share = None, self.L, keep_share(self.budget_setting)
        self.act, self.transient = (lb["act"], lb["transient"]) if lb else (0, 0)
        self.cache_bytes = cache_bytes(lb, self.cache_setting)
        self.attn_out = lb.get("attn_out", 0) if self.cache_bytes else 0
        self.cached = frozenset()
        if lb is None or memory is None or self.fixed is not None:
            return
        used, total, host_free = memory()
        used += 2 * lb["boundary"]  # + the embedding rows
        if self.setting is None:  # where the inputs wait is ours to choose: so is the share
            self.share = self._fit(layers=self.L, ckpt_bytes=lb["boundary"], used=used, total=total,
                                   host_free=host_free)
        self.cap = keep_cap(layers=self.L, act=lb["act"], boundary=lb["boundary"], used=used,
                            budget=self.share * total - DEVICE_RESERVE,
                            reserve=lambda k: k * lb["act"] + lb["transient"],
                            host_free=host_free, host_each=parked_bytes(lb["boundary"]),
                            extra=cache_first(lb) if self.cache_bytes and self.setting is None else 0,
                            inputs=self.setting)

    def parked(self, i: int, nbytes: int, memory=None) -> bool:
        """Whether the input (``nbytes`` on the device) of the recompute block starting at layer ``i``
        waits in host memory; placed for layers i..L-1 at the first block of the step. Raises
        PlacementError where nothing fits."""
        if self.park is None:
            self.park = self._place(i, nbytes, memory)
        return self.park.get(i, False)

    def _place(self, i0: int, nbytes: int, memory) -> dict:
        n = self.L - i0
        if self.setting is not None or memory is None:
            self.block = self.fixed or 1
            park = dict.fromkeys(range(i0, self.L, self.block), bool(self.setting))
            if memory is None:  # off CUDA: host memory holds them all, when asked for
                self.cached = frozenset(range(i0, self.L)) if self.cache_setting else frozenset()
            elif self.cache_bytes:
                used, total, _ = memory()
                free = self.share * total - DEVICE_RESERVE - used - self.block * self.act - self.transient \
                    - (0 if self.setting else (len(park) - 1) * nbytes)
                k = max(0, min(n, int(free // self.cache_bytes)))
                self.cached = frozenset(range(self.L - k, self.L))
            return park
        used, total, host_free = memory()
        used -= nbytes  # the input is one of them
        act, transient = self.act, self.transient
        self.share = self._fit(layers=n, ckpt_bytes=nbytes, used=used, total=total, host_free=host_free)
        lean = act - self.attn_out  # a cached layer's saved set in its recompute
        self.share, cached, self.block, parked = place_long(
            share=self.share, activation_budget=self.budget_setting, total=total, used=used, layers=n,
            cache_bytes=self.cache_bytes, ckpt_bytes=nbytes, act=act, lean=lean, transient=transient,
            host_free=host_free, host_each=parked_bytes(nbytes), block=self.fixed)
        self.cached = frozenset(range(self.L - cached, self.L))  # the last ones (Note: [Attention cache placement])
        return {s: k < parked for k, s in enumerate(range(i0, self.L, self.block))}
