"""Memory and step-time model of a layer-streaming configuration, and its simulated timeline.

This module owns `Hardware` (measured or illustrative rates), `model_shape` (parameter counts from a
transformers config), `moment_bytes` (the Adam moments of each unit under an `optimizer_state`) and `plan`
(host/device bytes, activation checkpointing, per-layer times, a simulated step); `host_table` (host RAM of
each optimizer_state, and the deepest model it holds) is preflight's, exported here beside `plan`. It touches no device: a plan is arithmetic plus a small list-scheduling
simulation of the engine's own operation order and slot assignment (`schedule.py`, pure Python),
whose spans have the columns of `Trace.to_dataframe`, so `viz.timeline` and `trace.find_stalls`
work on a plan exactly as on a recorded step. The same simulation runs one step from cold
(`Plan.simulate`, `Plan.step_ms`) or steps back to back with the engine's cross-step waits
(`Plan.simulate_steady`, `Plan.steady_step_ms`; Note: [Steady state]). It models the engine's
three ways of moving weights (packing from the fp32 master, `pin_store`, `cast_on_device`) but does
not choose between them: that rule (`preflight.resolve_pinning`) needs the device type and the
machine's RAM, which a `Hardware` profile does not say. The scheduler itself lives in `simulate.py`.
It also predicts what the engine decides for itself: placement (`placement.choose`, and the "auto"
search between activations first, the forward's head resident and residency first) and long-context checkpoint placement
(`longcontext.py`), with `Plan.advice` for what does not fit. Over 400 lines because `plan` must
follow every one of the engine's memory and time decisions in one place to stay comparable with a
recorded step; the pure rules it shares with the engine live in placement.py and longcontext.py.
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass, field

import pandas as pd

from ..host import compact_state
from ..host.split_master import enabled as split_enabled
from ..host.embed_grad import rows_bytes
from ..host.grad_ring import ring_bytes
from . import placement as placing
from ..config import OPTIMIZER_STATES, pinned_budget
from .budget import hardware_within, parse_bytes
from .longcontext import (DEVICE_RESERVE, HOST_MARGIN, PlacementError, backward_peak, cache_bytes, cache_first, choose_share, keep_cap, keep_share, layer_bytes,
                          parked_bytes, pinned_bytes, place_long)
from ..step import early_rows
from ..step.schedule import make_blocks
from .simulate import GRAD_SLOTS, simulate, simulate_steady
from ..view.trace import Trace

_GIB = 1 << 30
EARLY_ROWS_COST = 2.0  # a gathered embedding row's host AdamW (its state and gradient copied in, then updated) against
# a slab element's (Note: [Early rows]): on an H100 host at 7B x 8, 1.1 G elements/s against the table's 2.2 (2026-12-06)
_KEEP_HEADROOM = 4 * _GIB  # the engine keeps a layer only with this much (plus 2 layers) to spare


@dataclass(kw_only=True)
class Hardware:
    """Rates and capacities of one machine (GB = 1e9 bytes, TFLOP = 1e12 FLOP)."""

    name: str
    """What the figures describe and where they come from."""
    h2d_GBps: float
    """Host-to-device copy rate from pinned memory."""
    d2h_GBps: float
    """Device-to-host copy rate into pinned memory."""
    duplex_GBps: float
    """Total rate when h2d and d2h run at once (each direction gets half, unless measured below)."""
    h2d_beside_d2h_GBps: float | None = None
    """An h2d copy's rate inside a step while d2h copies run (the host's AdamW loads host memory too);
    None: half of `duplex_GBps`."""
    d2h_beside_h2d_GBps: float | None = None
    """A d2h copy's rate inside a step while h2d copies run; None: half of `duplex_GBps`."""
    pageable_GBps: float
    """Copy rate from/to pageable (unpinned) host memory."""
    bf16_tflops: float
    """Effective decoder-layer fwd+bwd rate on its FLOPs: 6 * layer params * tokens plus causal
    attention, 6 * batch * seq * min(seq, attn_rate_seq) * heads * head_dim (all of seq when `attn_tflops`
    is None; the rest is `attn_tflops`'; see `elementwise_s_per_token_dim` for the memory-bound work)."""
    host_adam_params_per_s: float
    """Host AdamW (`optim.HostAdamW`: torch's fused CPU kernel) over the layers' and head's gradients in a
    2-byte compute dtype, which it upcasts to fp32 in chunks first."""
    host_cast_elems_per_s: float
    """Host fp32 -> bf16 cast into pinned buffers (also used for copying grads out)."""
    device_mem_bytes: int
    """Usable device memory."""
    host_mem_bytes: int
    """Host RAM available to the training process (what the OS leaves at idle)."""
    gemm_tflops: float | None = None
    """Plain bf16 GEMM rate, used for the lm_head; None means `bf16_tflops`."""
    host_runtime_bytes: int = 0
    """Host RSS of the process beyond the buffers `plan` counts: CUDA context, torch and its libraries."""
    host_adam_fp32_params_per_s: float | None = None
    """Host AdamW with fp32 gradients (no upcast): the embedding's, or every unit's when dtype_bytes=4;
    None means `host_adam_params_per_s`."""
    device_adam_params_per_s: float | None = None
    """Device AdamW of resident units (`optim.DeviceAdamW`: torch's fused kernel, grads upcast first);
    None means 25 x `host_adam_params_per_s` (a guess: the device's memory is that much faster)."""
    elementwise_s_per_token_dim: float = 0.0
    """A layer's memory-bound work (norms, activation, rotary, residuals; fwd+bwd) per token and per
    element of hidden + intermediate size, added to its FLOPs at `bf16_tflops`. 0: FLOPs alone."""
    layer_launch_ms: tuple[float, float] = (0.0, 0.0)
    """The host's time to launch one layer's (forward, backward): the driver's Python, autograd's
    engine. A layer never computes faster than its kernels are launched (small batches)."""
    loss_s_per_logit: float = 0.0
    """Cross-entropy's memory-bound work (fp32 softmax and its gradient) per logit, beside the lm_head GEMM."""
    attn_tflops: float | None = None
    """Causal attention rate beyond `attn_rate_seq` tokens: of a sequence's causal attention FLOPs
    (fwd 2 * seq^2 * heads * head_dim, bwd 2.5x that: the fused kernels recompute the scores), the part
    over keys beyond `attn_rate_seq` runs at this rate; the part within it is in `bf16_tflops`, at
    that rate. None: all of it in `bf16_tflops` (main's model: fwd:bwd = 1:2)."""
    attn_rate_seq: int = 4096
    """Sequence length up to which `bf16_tflops` rates attention (where it was measured)."""
    experts_tflops: tuple[float, float] | None = None
    """An MoE layer's experts as they run in the engine (grouped GEMMs, with the routing's sorts and gathers, the
    per-row expert biases and the gate): effective rates on their forward FLOPs (2 * routed expert parameters *
    tokens) and on their backward FLOPs (twice that), gating's memory-bound work included. None: the experts
    at `bf16_tflops` with `elementwise_s_per_token_dim` on their routed width, as a dense MLP (Note: [Experts
    rate])."""

    def __post_init__(self):
        for name in ("h2d_GBps", "d2h_GBps", "duplex_GBps", "pageable_GBps", "bf16_tflops",
                     "host_adam_params_per_s", "host_cast_elems_per_s", "device_mem_bytes", "host_mem_bytes"):
            if not getattr(self, name) > 0:
                raise ValueError(f"Hardware.{name} must be > 0, got {getattr(self, name)!r}.")
        for name in ("gemm_tflops", "host_adam_fp32_params_per_s", "device_adam_params_per_s", "attn_tflops",
                     "h2d_beside_d2h_GBps", "d2h_beside_h2d_GBps"):
            if getattr(self, name) is not None and not getattr(self, name) > 0:
                raise ValueError(f"Hardware.{name} must be > 0 or None, got {getattr(self, name)!r}.")
        if self.experts_tflops is not None and not (len(self.experts_tflops) == 2 and min(self.experts_tflops) > 0):
            raise ValueError(f"Hardware.experts_tflops must be (forward, backward) rates > 0 or None, got "
                             f"{self.experts_tflops!r}.")
        if self.duplex_GBps < max(self.h2d_GBps, self.d2h_GBps):
            raise ValueError(f"Hardware.duplex_GBps ({self.duplex_GBps}) must be at least max(h2d_GBps, "
                             f"d2h_GBps) = {max(self.h2d_GBps, self.d2h_GBps)}.")


# Attention beyond 4096 tokens (`attn_tflops`): fitted to the two long-context rows measured before
# tiling (LIMITS.md, 7B x 1, default settings: 32K 5.06 s, 128K 42.7 s), to be re-fitted from
# bench/long_context.py rows.
_H200_ATTN_TFLOPS = 530.0
# Copies, GEMM, cast: tools/gpu_limits.py (LIMITS.md). Layer rate and elementwise term: fitted to the
# Qwen2.5-7B layer at 16 x 4096 (LIMITS.md: 191 ms) and the 3B layer at 8 x 4096 in the engine (36.6 ms,
# a trace beside bench/results/h200-2026-12-01-placement.jsonl); they give the 7B layer at 1 and 4 x 4096 within 4%.
# Launch floor, loss and device AdamW: the 3B x 1 and x 8 traces of that file. Host AdamW: bench/host_adam.py on the
# same host, one 77M-parameter 3B layer in isolation, 16 threads (bench/results/h200-2026-11-29-host-path.jsonl):
# 3.90 G params/s with fp32 grads, 3.48 with bf16 grads upcast in 16M-element chunks. Inside a training
# step the same updates run slower (DMA and the unpacker share the host's memory bandwidth):
# bench/planner_vs_measured.py reports both.
# An MoE layer's experts (Note: [Experts rate]): gpt-oss-20b x 8 x 4096 in the engine on an H100 80GB HBM3 (code
# 2bd039d, 2026-12-07, bench/traces/moe/h100-2026-12-07-gpt-oss-20b-b8.json.gz: a layer's forward 38.7 ms and backward
# 132.1 on average over its 24 layers), less what this profile gives the rest of the layer (5.3 and 10.7 ms), on the
# experts' 6.52 TFLOP forward: 196 and 107 effective TFLOPS. An H100's, the H200 not measured: the same SMs; its
# faster memory would speed the memory-bound part.
_EXPERTS_TFLOPS = (196.0, 107.0)
H200 = Hardware(
    name="NVIDIA H200 (measured: pinned copies, Qwen2.5-7B layer fwd+bwd at 1-16 x 4096 tokens, "
         "HostAdamW of one layer in isolation)",
    h2d_GBps=55.1, d2h_GBps=55.3, duplex_GBps=99.2, pageable_GBps=6.9,
    h2d_beside_d2h_GBps=40.2, d2h_beside_h2d_GBps=52.1,  # in a step: bench/copy_rates.py on the H200's stream traces of 2026-12-01
    bf16_tflops=609.0, gemm_tflops=774.0, elementwise_s_per_token_dim=2.1e-11, layer_launch_ms=(2.1, 4.1),  # bwd: 4.13-4.19 ms a layer at 3B x 1, auto (3 traces)
    loss_s_per_logit=1.45e-11, attn_tflops=_H200_ATTN_TFLOPS, experts_tflops=_EXPERTS_TFLOPS,
    host_adam_params_per_s=3.48e9, host_adam_fp32_params_per_s=3.90e9, host_cast_elems_per_s=12e9,
    device_adam_params_per_s=8.2e10,
    # host: 124.1 GiB available at idle of 125.8 (bench/logs/h200-2026-12-01-512k-memory-idle-host.log); RSS beyond the
    # counted buffers 2.1 GiB at 32K, 128K and 512K, 3.0 at 256K (docs/design_log.md, host runtime)
    device_mem_bytes=143771 << 20, host_mem_bytes=124 * _GIB, host_runtime_bytes=2 * _GIB,
)
CPU_LAPTOP = Hardware(
    name="Illustrative CPU laptop (guessed figures, not measured; 'device' is a share of the same RAM)",
    h2d_GBps=10.0, d2h_GBps=10.0, duplex_GBps=12.0, pageable_GBps=5.0,
    bf16_tflops=0.5, gemm_tflops=1.0,
    host_adam_params_per_s=0.5e9, host_cast_elems_per_s=3e9,
    device_mem_bytes=8 * _GIB, host_mem_bytes=16 * _GIB,
)

# model_shape and the per-token activation estimate live in shape.py (a leaf: tiling, lean and the
# engine read them without importing the planner); re-exported here, where callers found them first.
from .shape import act_bytes_per_token, loss_positions, model_shape  # noqa: E402,F401
from .preflight import host_table  # noqa: E402,F401  (host RAM of each optimizer_state; beside plan, as asked for)


def moment_bytes(shape: dict, optimizer_state: str = "fp32") -> dict[int, int]:
    """Host bytes of both Adam moments of each unit (-1 embedding, 0..L-1 layers, L head), from `model_shape`.

    With a compact `optimizer_state` ("int8", "int4") a unit's moments are `compact_state.moment_words` of
    its values, the input embedding and each tensor under `compact_state.MIN_QUANTIZED` values kept fp32 (the
    default `OptimConfig.compact_keep_fp32`); alignment padding is not counted (`preflight.estimate` counts
    it: a few hundred values a unit).

    Example:
        >>> s = model_shape(dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        ...     num_attention_heads=4, vocab_size=100))
        >>> m = moment_bytes(s, "int8")  # a layer: 41088 values in 161 blocks of 256, its two norms' 128 fp32
        >>> m[0] == 2 * 4 * (161 * 256 // 4 + 161 + 128), m[-1] == 8 * s["embed_params"], m[0] / 41088
        (True, True, 2.0625)
    """
    L, E, P = shape["layers"], shape["embed_params"], shape["params_per_layer"]
    if optimizer_state == "fp32":
        return {-1: 8 * E, **dict.fromkeys(range(L), 8 * P), L: 8 * shape["head_params"]}

    def both(n: int, kept: int) -> int:  # two moments of n values, kept of them fp32
        return 8 * (n if kept == n else compact_state.moment_words(optimizer_state, n, kept))

    small = lambda sizes: sum(k for k in sizes if k < compact_state.MIN_QUANTIZED)  # noqa: E731
    head = [shape["hidden"]] + ([] if shape["tied"] else [shape["head_params"] - shape["hidden"]])  # final norm, lm_head
    layer = both(P, small(shape["layer_tensors"]))
    return {-1: 8 * E, **dict.fromkeys(range(L), layer), L: both(sum(head), small(head))}


@dataclass(kw_only=True)
class Plan:
    """Predicted memory and step time of one configuration; times in ms, sizes in bytes."""

    shape: dict
    """`model_shape` of the model."""
    hardware: Hardware
    """Rates used."""
    settings: dict
    """batch, seq, tokens and every plan() keyword as used."""
    host_bytes: dict
    """master_fp32, adam_moments (both moments, as `optimizer_state` holds them), grads (fp32 for the
    embedding, compute dtype for the rest; with the gradient ring the embedding's and the ring's), pinned_pool,
    and pinned_copy with pin_store."""
    host_bytes_per_param: float
    """Host bytes per parameter excluding the pinned pool: 4 (master) + the moments' (8 with fp32 moments,
    ~2.03 / ~1.06 with "int8" / "int4" beside the fp32 embedding's) + dtype_bytes, + dtype_bytes with
    pin_store, plus (4 - dtype_bytes) * embedding / all parameters for the fp32 embedding grads (14.2 for
    Qwen2.5-3B with fp32 moments); with the gradient ring (the default without grad_clip) the layers' and head's
    dtype_bytes become the ring's few buffers."""
    device_bytes: dict
    """weight_slots, grad_slots, head_slots, cast_stage (cast_on_device only), embedding_rows,
    activations_kept, checkpoints, recompute_workspace, logits, reserve."""
    keep: list[bool]
    """keep[i]: layer i's activations stay from the forward (else it is recomputed)."""
    layer_ms: dict
    """Per decoder layer: pack, h2d, h2d_bwd (while d2h runs), fwd, bwd, d2h, unpack, adam (incl. the
    pin_store refresh)."""
    step_ms: float
    """Simulated step from its start to the last AdamW update (the next step's first load waits for it).
    One step from cold; `steady_step_ms` is the step time of a run of steps."""
    busy_ms: dict
    """Work of each simulated lane (a copy waiting for its chunks to be packed counts only its transfer)."""
    model_tflops: float
    """6 * (layer params + lm_head matmul params) * tokens / step time (recompute not counted)."""
    bottleneck: str
    """Resource with the most work: "compute", "pcie", "host-pack", "host-unpack" or "host-adam"."""
    fits_device: bool
    """Every device category together fits `hardware.device_mem_bytes`."""
    fits_host: bool
    """Host bytes, pinned pool included, fit `hardware.host_mem_bytes` less `longcontext.HOST_MARGIN`."""
    tile_rows: int = 0
    """Rows per tile of the layers' norms and dense MLP (0: untiled); see `tiling.py`."""
    block: int = 1
    """Layers per recompute block (`longcontext.place_checkpoints`' choice, or `checkpoint_every`)."""
    parked: int = 0
    """Recompute-block inputs parked in host memory (the earliest blocks); the others stay on the device."""
    attention_cached: int = 0
    """Recomputed layers whose attention output stays from the forward (Note: [Attention cache])."""
    advice: list = field(default_factory=list)
    """When something does not fit: what, and each single setting that makes the plan fit."""
    placement: dict = field(default_factory=dict)
    """unit -> "host" or "resident" (placement.py), as the engine would choose with these settings."""
    spans: list[tuple] = field(repr=False, default_factory=list)
    """Simulated spans (Trace.spans layout)."""
    _sim: tuple = field(repr=False, compare=False, default=())
    """What `plan` simulated with, kept so `simulate_steady` can run more steps (empty: nothing to run)."""
    _steady: dict = field(repr=False, compare=False, init=False, default_factory=dict)
    """steps -> (spans, step ms, step index) of `simulate_steady`, computed once each."""

    h2d_ms = property(lambda self: self.layer_ms["h2d"], doc="Per-layer weight copy in forward (ms).")
    fwd_ms = property(lambda self: self.layer_ms["fwd"], doc="Per-layer forward (ms).")
    bwd_ms = property(lambda self: self.layer_ms["bwd"], doc="Per-layer backward, recompute excluded (ms).")
    d2h_ms = property(lambda self: self.layer_ms["d2h"], doc="Per-layer grad copy out (ms).")
    adam_ms = property(lambda self: self.layer_ms["adam"], doc="Per-layer CPU AdamW (ms).")

    @property
    def paper_tflops(self) -> float:
        """MegaTrain's long-context count, (6 * N * tokens + 12 * L * hidden * seq^2 * batch) / step time."""
        s, st = self.shape, self.settings
        flops = 6 * s["n_params"] * st["tokens"] + 12 * s["layers"] * s["hidden"] * st["seq"] ** 2 * st["batch"]
        return flops / self.step_ms / 1e9

    @property
    def kept_layers(self) -> int:
        return sum(self.keep)

    @property
    def recomputed_layers(self) -> int:
        return len(self.keep) - sum(self.keep)

    def simulate(self) -> pd.DataFrame:
        """Returns the simulated step as a span DataFrame with the columns of `Trace.to_dataframe`."""
        return Trace(step=0, spans=self.spans).to_dataframe()

    def simulate_steady(self, steps: int | None = None) -> pd.DataFrame:
        """Simulates steps back to back, as the engine runs them, and returns the last one.

        Unlike `simulate` (one step from cold, AdamW idle until the first gradients land), each step
        starts when the previous one's driver returned (the embedding's gradients landed), its loads
        wait for the previous step's updates of their units (recorded as ``wait-update`` spans on the
        host-pack lane, as the engine's loader records them, so `trace.find_stalls` blames the
        optimizer alike), and the Adam worker finishes the previous step's updates in forward order
        while the next forward runs. See Note: [Steady state] in this module.

        Args:
            steps: consecutive steps to simulate (>= 1), the last one returned; None runs until two
                consecutive steps take the same time (within 1e-6), at most 32 (warns if they never do).

        Returns:
            The last step's spans with the columns of `Trace.to_dataframe` (step = its index from 0):
            those ending within it, as a recording files them, so the previous step's updates that end
            in it appear too; times are ms from its start (negative before it). Its last end is the
            step time, `steady_step_ms` for steps=None.

        Raises:
            ValueError: steps < 1, or the Plan was not made by `plan` (no simulation inputs).

        Example:
            >>> p = plan(dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            ...     num_attention_heads=4, vocab_size=100), batch=1, seq=16, cast_on_device=True)
            >>> df = p.simulate_steady()
            >>> bool(abs(df.end_ms.max() - p.steady_step_ms) < 1e-3), "wait-update" in set(df.op)  # spans: 0.1 us
            (True, True)
        """
        if steps is not None and (not isinstance(steps, int) or steps < 1):
            raise ValueError(f"steps must be an int >= 1 or None, got {steps!r}.")
        if not self._sim:
            raise ValueError("this Plan holds no simulation inputs (it was not made by plan()); "
                             "call plan(...) and use its result.")
        if steps not in self._steady:
            self._steady[steps] = simulate_steady(self._sim, steps)
        spans, _, index = self._steady[steps]
        return Trace(step=index, spans=spans).to_dataframe()

    @property
    def steady_step_ms(self) -> float:
        """Steady-state step time (ms): from a step's start to its driver's return (the next step's
        start), once consecutive steps take the same time; see `simulate_steady`."""
        self.simulate_steady()
        return self._steady[None][1]

    def summary(self) -> dict:
        """Returns the headline numbers as a flat dict."""
        s = self.settings
        return {"batch": s["batch"], "seq": s["seq"], "tokens": s["tokens"], "optimizer_state": s["optimizer_state"],
                "host_bytes_per_param": self.host_bytes_per_param, "step_ms": self.step_ms,
                "tokens_per_s": s["tokens"] / self.step_ms * 1e3, "model_tflops": self.model_tflops,
                "paper_tflops": self.paper_tflops, "tile_rows": self.tile_rows, "block": self.block,
                "parked": self.parked, "attention_cached": self.attention_cached,
                "bottleneck": self.bottleneck, "kept_layers": self.kept_layers,
                "recomputed_layers": self.recomputed_layers, "compute_ms": self.busy_ms.get("compute", 0.0),
                "host_GiB": sum(self.host_bytes.values()) / _GIB,
                "device_GiB": sum(self.device_bytes.values()) / _GIB,
                "fits_device": self.fits_device, "fits_host": self.fits_host}

    def to_dataframe(self) -> pd.DataFrame:
        """Returns every number of the plan as rows: section, quantity, value, unit."""
        rows = [("host", k, v / _GIB, "GiB") for k, v in self.host_bytes.items()]
        rows += [("device", k, v / _GIB, "GiB") for k, v in self.device_bytes.items()]
        rows += [("layer", k, v, "ms") for k, v in self.layer_ms.items()]
        rows += [("busy", k, v, "ms") for k, v in self.busy_ms.items()]
        rows += [("step", k, v, "") for k, v in self.summary().items()]
        return pd.DataFrame(rows, columns=["section", "quantity", "value", "unit"])


def plan(config, *, batch: int, seq: int, hardware: Hardware = H200, dtype_bytes: int = 2,
         checkpoint_every: int | None = None, weight_slots: int | None = None, pinned_budget_bytes: int | None = None,
         transfer_chunk_bytes: int = 64 << 20, loss_chunk_tokens: int | None = None, activation_budget: float | None = None,
         overlap_optimizer: bool = True, grad_clip: bool = False, pin_store: bool = False,
         cast_on_device: bool = False, placement="host", tile_tokens: int | None = None,
         offload_checkpoints: bool | None = None, lean_activations: bool | None = None,
         attention_cache: bool | None = None, split_master: bool | None = None, optimizer_state: str = "fp32",
         device_memory: int | str | None = None, host_memory: int | str | None = None, grad_ring: bool = True,
         _advise: bool = True, _search: bool = True) -> Plan:
    """Predicts memory and step time of streaming `config` at `batch` x `seq` tokens per step.

    Follows the engine: the host keeps fp32 master + Adam moments + grads (fp32 for the embedding,
    compute dtype for the rest); a packer thread casts each load into pinned chunks whose copies
    overlap the packing (or, with `pin_store` / `cast_on_device`, one pinned DMA per load); weight slots are
    assigned by `schedule.plan_loads` over `forward_ops` / `backward_ops`; embedding rows are
    gathered on the host; the head slot holds final norm + lm_head (the embedding when tied); an
    unpacker thread copies each unit's grads out chunk by chunk, then CPU AdamW updates that unit
    (after the whole backward with `grad_clip` or without `overlap_optimizer`). Lanes run
    concurrently, each in issue order; host lanes are taken not to slow each other. `Plan.step_ms`
    is that one step from cold; `Plan.steady_step_ms` runs steps back to back as the engine does.

    Args:
        config: transformers config or dict (see `model_shape`).
        batch: sequences per step.
        seq: tokens per sequence.
        hardware: rates and capacities.
        dtype_bytes: compute dtype size (2 for bf16).
        checkpoint_every: as `EngineConfig.checkpoint_every`: k >= 1 recomputes every layer in blocks
            of k, 0 keeps all, None keeps layers from the first while `activation_budget` allows.
        weight_slots: device weight slots (>= 2); None as `EngineConfig.weight_slots` (`placement.weight_slots`).
        pinned_budget_bytes: pinned staging pool (None: as `EngineConfig`, `config.pinned_budget`); below two
            chunks means pageable copies of everything, pin_store / cast_on_device included (what-if: the
            engine always pins at least 4 chunks).
        transfer_chunk_bytes: size of one staging chunk.
        loss_chunk_tokens: sequence positions per lm_head + cross-entropy chunk; None as `EngineConfig`
            (1024 tokens across the batch's rows: `shape.loss_positions`).
        activation_budget: with checkpoint_every=None, fraction of device memory allocations may fill; None:
            0.85, and up to 0.95 for recompute-block inputs that fit nowhere else (as `EngineConfig`).
        overlap_optimizer: run AdamW on each unit as its grads land.
        grad_clip: clip by global norm (AdamW then waits for every grad).
        grad_ring: as ``EngineConfig.grad_ring``: without grad_clip (and with overlap_optimizer) the layers' and
            head's grads wait in a few pinned buffers of the largest unit, not in slabs, and go out by DMA
            (Note: [Gradient ring] in host/grad_ring.py).
        pin_store: as `EngineConfig.pin_store`: loads read a pinned compute-dtype copy (no packing),
            grads land in pinned slabs (no unpacking), and each update also refreshes the copy (a
            cast of the unit in the Adam worker); +dtype_bytes per parameter of host memory.
        split_master: as `EngineConfig.split_master` (None: with a 2-byte dtype and no pin_store): a "device"
            layer's state comes in as 10 bytes a parameter where every layer has a weight slot, else 12
            (Note: [Split master] in split_master.py); its state slots hold 16. Off with a compact
            `optimizer_state` (the split marks ties in the fp32 exp_avg_sq's sign bit).
        optimizer_state: as `OptimConfig.optimizer_state`: "fp32", "int8" or "int4". The host's moments
            and a "device" unit's state over PCIe (its master's 4 bytes a parameter and the moments as
            `compact_state.moment_words` lays them out, from `model_shape`'s tensors, without alignment
            padding; the input embedding and tensors under 4096 values keep fp32 moments, the default
            `compact_keep_fp32`) and in its state slots. Not modelled: the compact update's own rates on
            the host and the device (`Hardware`'s AdamW rates are fp32's), and resident units' state
            (`placement.resident_bytes`: fp32 moments).
        cast_on_device: as `EngineConfig.cast_on_device`: the fp32 master and the grad slabs are
            pinned; loads copy fp32 (4 bytes/param over PCIe) into two fp32 landing buffers on the
            device (`cast_stage`) and the device casts (its cast is not timed: ~0.1 ms per 3B layer);
            no host packing or unpacking of layers, no refresh, no extra host bytes. The engine turns
            it on by itself on CUDA when the store fits in 90% of RAM (`preflight.resolve_pinning`);
            here it stays off unless asked, since a `Hardware` profile does not say CUDA and the
            default plan (packing) is what notebooks and the synthetic trace were made with.
            In every mode the embedding rows are gathered and packed on the host, and a tied head's
            embedding gradient is unpacked (cast) into the fp32 embedding grads.
        placement: as `EngineConfig.placement` ("host", "stream", "auto" or a dict): "stream" places
            "device" the share of the layers that balances PCIe against the host AdamW
            (`placement.stream_share` of `host_adam_params_per_s` and `h2d_GBps`); "auto" makes
            resident, in the forward's order, the units that fit in what the activations leave of
            `activation_budget` (as the engine does on CUDA after its measuring step); resident units
            take no loads and no grad copies, and their AdamW runs on the device after the backward.
            Default "host" (what a CPU-only `Hardware` does); the engine's default on CUDA is "auto".
        tile_tokens: as `EngineConfig.tile_tokens`: rows per tile of the norms and dense MLP (0: never,
            None: `tiling.auto_tiles` against `hardware.device_mem_bytes`). Tiled layers keep
            `longcontext.tiled_bytes_per_token` per token and run one more MLP forward in the backward.
        offload_checkpoints: as `EngineConfig.offload_checkpoints`: True parks every recompute-block input
            in host memory, False none, None lets `longcontext.place_checkpoints` choose the block length
            and how many to park from both budgets, as the engine does (Note: [Long-context memory]).
        lean_activations: as `EngineConfig.lean_activations`: untiled layers keep the lean per-token bytes
            of Note: [Activation estimate]; None (auto) decides as the engine does (Note: [Lean auto]).
        attention_cache: as `EngineConfig.attention_cache`: None or True keep the attention output of as
            many recomputed layers as fit beside their block inputs (`longcontext.place_cache`), whose
            recompute then skips the attention forward; False: none (Note: [Attention cache]).
        device_memory, host_memory: as `EngineConfig`'s budgets (bytes or "24GiB"): `hardware`'s device and
            host memory are at most these (`budget.hardware_within`, Note: [Budgets]); None: `hardware`'s.

    Returns:
        Plan.

    Raises:
        ValueError: an argument is out of range, pin_store and cast_on_device are both set, or the
            config lacks a field (the message names it). A plan that does not fit is returned, with
            `fits_device` / `fits_host` False, a warning and `advice`.

    Example:
        >>> p = plan(dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        ...     num_attention_heads=4, vocab_size=100), batch=1, seq=16, cast_on_device=True)
        >>> round(p.host_bytes_per_param, 3), p.layer_ms["pack"], list(p.simulate().columns)[:3]
        (14.641, 0.0, ['step', 'lane', 'op'])
    """
    device_memory, host_memory = parse_bytes(device_memory, "device_memory"), parse_bytes(host_memory, "host_memory")
    hardware = hardware_within(hardware, device_memory, host_memory)  # the user's budgets, where smaller
    if weight_slots is None:
        shape0 = model_shape(config)
        weight_slots = placing.weight_slots(None, placement, shape0["layers"], shape0["params_per_layer"] * dtype_bytes,
                                            hardware.device_mem_bytes)
    pinned_budget_bytes = pinned_budget(pinned_budget_bytes, bool(pin_store or cast_on_device))  # as the engine
    for name, value, low in (("batch", batch, 1), ("seq", seq, 1), ("dtype_bytes", dtype_bytes, 1),
                             ("weight_slots", weight_slots, 2), ("pinned_budget_bytes", pinned_budget_bytes, 0),
                             ("checkpoint_every", 0 if checkpoint_every is None else checkpoint_every, 0),
                             ("transfer_chunk_bytes", transfer_chunk_bytes, 1),
                             ("loss_chunk_tokens", 1 if loss_chunk_tokens is None else loss_chunk_tokens, 1)):
        if not isinstance(value, int) or value < low:
            raise ValueError(f"{name} must be an int >= {low}, got {value!r}.")
    if activation_budget is not None and not 0 < activation_budget <= 1:
        raise ValueError(f"activation_budget must be a fraction in (0, 1] or None (auto), got {activation_budget!r}.")
    keep_frac = keep_share(activation_budget)  # kept activations and residents; inputs: Note: [Device share]
    if lean_activations is not None and not isinstance(lean_activations, bool):
        raise ValueError(f"lean_activations must be None (auto), True or False, got {lean_activations!r}.")
    if pin_store and cast_on_device:
        raise ValueError("pin_store=True and cast_on_device=True both pin the store (as in EngineConfig); "
                         "set one of them to False.")
    if optimizer_state not in OPTIMIZER_STATES:
        raise ValueError(f"optimizer_state={optimizer_state!r}: choose one of {OPTIMIZER_STATES}.")
    s, hw = model_shape(config), hardware
    L, d, T, h, V, P, N = (s["layers"], dtype_bytes, batch * seq, s["hidden"], s["vocab"],
                           s["params_per_layer"], s["n_params"])
    if lean_activations is None:  # auto: the engine's rule (lean.auto, Note: [Lean auto]) on the buffers it holds then
        from ..step import lean

        held = (weight_slots + GRAD_SLOTS) * P * d + 2 * (V * h + h) * d
        lean_activations = lean.auto(s, tokens=T, dtype_bytes=d, tiled=bool(tile_tokens and T > tile_tokens),
                                      room=(keep_frac * hardware.device_mem_bytes - held,
                                            hardware.device_mem_bytes))[0]
    settings = dict(batch=batch, seq=seq, tokens=T, dtype_bytes=d, checkpoint_every=checkpoint_every,
                    weight_slots=weight_slots, pinned_budget_bytes=pinned_budget_bytes,
                    transfer_chunk_bytes=transfer_chunk_bytes, loss_chunk_tokens=loss_chunk_tokens,
                    activation_budget=activation_budget, overlap_optimizer=overlap_optimizer, grad_clip=grad_clip,
                    pin_store=pin_store, cast_on_device=cast_on_device, placement=placement, tile_tokens=tile_tokens,
                    offload_checkpoints=offload_checkpoints, lean_activations=lean_activations,
                    attention_cache=attention_cache, split_master=split_master, optimizer_state=optimizer_state,
                    device_memory=device_memory, host_memory=host_memory, grad_ring=grad_ring)
    ring = grad_ring and overlap_optimizer and not grad_clip  # Note: [Gradient ring]: no slab for layers and head
    split = split_enabled(split_master, d == 2, pin_store, False) and optimizer_state == "fp32"  # as DeviceUpdates.split
    E, head_n = s["embed_params"], V * h + h  # embedding unit; head slot elements (final norm + lm_head or embedding)
    moments = moment_bytes(s, optimizer_state)  # unit -> both moments' host bytes
    layer_state = 4 * P + moments[0]  # a "device" layer's state over PCIe: fp32 master and moments (12 P with fp32)
    head_state = 4 * head_n + moments[L] + (moments[-1] if s["tied"] else 0)  # the head group's (Note: [Streamed head])
    host = {"master_fp32": 4 * N, "adam_moments": sum(moments.values()),  # embedding grads: fp32
            "grads": (ring_bytes({**dict.fromkeys(range(L), P), L: s["head_params"]}, d) if ring else d * (N - E))
            + (rows_bytes(min(V, T), h) if ring and not s["tied"] else 4 * E),  # the embedding's touched rows, or its
            # fp32 slab (Note: [Embedding rows] in host/embed_grad.py)
            "pinned_pool": pinned_budget_bytes}
    if pin_store:
        host["pinned_copy"] = d * N
    store = sum(v for k, v in host.items() if k != "pinned_pool")
    host["embedding_grad_rows"] = pinned_bytes(T * h * d)  # the engine's pinned dE buffer (compute dtype)
    if hw.host_runtime_bytes:
        host["runtime"] = hw.host_runtime_bytes  # CUDA context, torch, libraries

    # device memory; keep[] mirrors Engine._keep_now, the checkpoints' placement longcontext.Checkpoints
    from ..step.tiling import AUTO_ROWS, auto_tiles

    rows = (tile_tokens if T > tile_tokens else 0) if tile_tokens is not None else \
        (AUTO_ROWS if auto_tiles(s, T, hw.device_mem_bytes, d, lean=lean_activations) else 0)
    lb = layer_bytes(s, T, d, rows, act_bytes_per_token(s, d, lean=lean_activations), seq=seq)
    act, boundary, transient = lb["act"], lb["boundary"], lb["transient"]
    cache_b = cache_bytes(lb, attention_cache)  # one cached layer's attention output
    out_b = lb["attn_out"] if cache_b else 0  # what a cached layer's recompute does not save again
    device = {"weight_slots": weight_slots * P * d, "grad_slots": GRAD_SLOTS * P * d, "head_slots": 2 * head_n * d}
    if cast_on_device:  # two fp32 landing buffers of one staging chunk, no larger than the largest unit
        largest = max(P, E, s["head_params"])
        device["cast_stage"] = 2 * 4 * min(transfer_chunk_bytes // d, -(-largest // 64) * 64)
    device["embedding_rows"] = 2 * T * h * d
    host_free = hw.host_mem_bytes - sum(host.values()) - HOST_MARGIN
    reserve = lambda k: k * act + transient  # noqa: E731
    numel = {-1: s["embed_params"], **dict.fromkeys(range(L), P), L: s["head_params"]}
    mode = placing.validate(placement, L, s["tied"])
    placed = sum(placing.resident_bytes(u, numel[u], d, s["tied"]) for u, v in mode.items()
                 if v == "resident") if isinstance(mode, dict) else 0  # residents set ahead: their memory goes first
    share = keep_frac if checkpoint_every is not None or offload_checkpoints is not None else choose_share(
        activation_budget, total=hw.device_mem_bytes, used=sum(device.values()) + placed, layers=L, ckpt_bytes=boundary,
        reserve=reserve, host_free=host_free)  # as longcontext.Checkpoints.reset on measured memory
    budget = share * hw.device_mem_bytes - DEVICE_RESERVE
    if checkpoint_every is None:
        cap = keep_cap(  # as longcontext.Checkpoints.reset
            layers=L, act=act, boundary=boundary, used=sum(device.values()) + placed, budget=budget, reserve=reserve,
            host_free=host_free, host_each=parked_bytes(boundary),
            extra=cache_first(lb) if cache_b and offload_checkpoints is None else 0, inputs=offload_checkpoints)
        keep, used = [], sum(device.values()) + placed
        for i in range(L):
            keep.append(i < cap and used + 2 * act + _KEEP_HEADROOM < keep_frac * hw.device_mem_bytes)
            used += act if keep[-1] else boundary
    else:
        keep = [checkpoint_every == 0] * L
    block, parked, recomputed, ckpt_error, cached = checkpoint_every or 1, 0, L - sum(keep), None, 0
    if recomputed and offload_checkpoints is None:  # as longcontext.Checkpoints._place
        try:
            share, cached, block, parked = place_long(
                share=share, activation_budget=activation_budget, total=hw.device_mem_bytes,
                used=sum(device.values()) + placed + sum(keep) * act, layers=recomputed, cache_bytes=cache_b,
                ckpt_bytes=boundary, act=act, lean=act - out_b, transient=transient, host_free=host_free,
                host_each=parked_bytes(boundary), block=checkpoint_every or None)
        except PlacementError as e:
            ckpt_error = str(e)
    blocks = [b for b in make_blocks(L, keep, block) if b.recompute]
    parked = len(blocks) if offload_checkpoints else parked
    if recomputed and offload_checkpoints is not None and cache_b:  # fixed inputs: the cache takes what is left
        left = budget - sum(device.values()) - placed - sum(keep) * act - reserve(block) \
            - (0 if offload_checkpoints else (len(blocks) - 1) * boundary)
        cached = max(0, min(recomputed, int(left // cache_b)))
    if parked:
        host["parked_checkpoints"] = parked * parked_bytes(boundary)
    if recomputed and offload_checkpoints is None:  # the backward's worst block, as place_cache counts it
        parts = backward_peak(layers=recomputed, block=block, parked=parked, cached=cached, act=act, lean=act - out_b,
                              transient=transient, ckpt_bytes=boundary, cache_bytes=cache_b)
        del parts["backward_transient"]  # counted below, less the loss's logits
    else:
        parts = dict(checkpoints=(len(blocks) - parked) * boundary, attention_cache=cached * cache_b,
                     recompute_workspace=max((b.end - b.start for b in blocks), default=0) * act)
    device.update(activations_kept=sum(keep) * act, **parts,
                  logits=batch * min(seq, loss_positions(loss_chunk_tokens, batch)) * V * (d + 8), reserve=DEVICE_RESERVE)
    device["backward_transient"] = max(0, transient - device["logits"])  # the loss's logits are gone by then
    free = keep_frac * hw.device_mem_bytes - (sum(device.values()) - DEVICE_RESERVE)  # step/memory.py free
    extras = placing.stream_extras(numel, s["tied"], head_state_bytes=head_state)  # compact: fewer bytes in
    share = placing.stream_share(hw.host_adam_params_per_s, (hw.h2d_beside_d2h_GBps or hw.h2d_GBps) * 1e9,
                                 cached=weight_slots >= L, window=placing.HOST_WINDOW, split=split,
                                 state_bytes=layer_state / P, **extras)  # as the engine
    choice = placing.choose(numel, mode=mode, free_bytes=int(free), dtype_bytes=d, tied=s["tied"], cuda=True,
                            share=share)
    streamed = {u for u, c in choice.items() if c.placement == "device"}
    resident = {u for u, c in choice.items() if c.placement == "resident"}
    device["resident_state"] = sum(placing.resident_bytes(u, numel[u], d, s["tied"]) for u in resident)
    sslots = placing.state_slots(len(streamed - {L, -1}), layer_state, hw.device_mem_bytes)  # as DeviceUpdates.place
    device["state_slots"] = sslots * (16 * P if split else layer_state)
    if L in streamed:  # Note: [Streamed head]: its state on the way through, a tied embedding's fp32 gradient
        device["head_state"] = head_state + (4 * E if s["tied"] else 0)
    dev_adam = hw.device_adam_params_per_s or 25 * hw.host_adam_params_per_s
    dev_adam_ms = {u: numel[u] / dev_adam * 1e3 for u in resident}

    # rates (ms); copies in both directions at once share the duplex rate
    pinned = pinned_budget_bytes >= 2 * transfer_chunk_bytes
    up, down = (hw.h2d_GBps, hw.d2h_GBps) if pinned else (hw.pageable_GBps, hw.pageable_GBps)
    both_up = min(up, hw.h2d_beside_d2h_GBps or hw.duplex_GBps / 2) if pinned else up
    both_down = min(down, hw.d2h_beside_h2d_GBps or hw.duplex_GBps / 2) if pinned else down
    cast, rate = hw.host_cast_elems_per_s / 1e3, hw.bf16_tflops * 1e9
    adam32 = (hw.host_adam_fp32_params_per_s or hw.host_adam_params_per_s) / 1e3  # the embedding's grads are fp32
    adam = hw.host_adam_params_per_s / 1e3 if d < 4 else adam32
    wb = 4 if cast_on_device else d  # weight bytes per element over PCIe: fp32 when the device casts
    # Note: [Attention time] causal attention's fwd FLOPs are 2 * batch * seq^2 * heads * head_dim; the part
    # over the first `attn_rate_seq` keys of each query is in the layer's FLOPs at `bf16_tflops` (fwd:bwd
    # 1:2, as measured at 4096), the rest at `attn_tflops` (fwd:bwd 1:2.5: flash's backward recomputes
    # the scores). Each FLOP is counted once. A tiled MLP runs its forward again in the backward.
    q_dim, inter = s["heads"] * s["head_dim"], s["intermediate"] * (s["experts_per_tok"] or 1)
    near = seq if hw.attn_tflops is None else min(seq, hw.attn_rate_seq)
    flops = 2 * s["active_params_per_layer"] * T + 2 * batch * seq * near * q_dim  # fwd
    far = 2 * batch * seq * (seq - near) * q_dim / (hw.attn_tflops * 1e9) if hw.attn_tflops else 0.0  # fwd ms
    mlp = 2 * 3 * h * inter * T / rate if rows else 0.0
    # Note: [Experts rate] an MoE layer's experts ran far below a dense MLP's rate in the engine (gpt-oss-20b on an
    # H100, 2026-12-07: a layer's forward 38.7 ms and backward 132.1, 3.4x, where the dense model predicted 18.7
    # and 37.4): with `experts_tflops` their FLOPs leave the layer's and run at those rates, gating included
    expert_flops = 2 * 3 * h * inter * T if s["experts"] and hw.experts_tflops else 0  # the routed experts' fwd
    elementwise = T * (h + (0 if expert_flops else inter)) * hw.elementwise_s_per_token_dim * 1e3
    fe, be = ((expert_flops / (hw.experts_tflops[0] * 1e9), 2 * expert_flops / (hw.experts_tflops[1] * 1e9))
              if expert_flops else (0.0, 0.0))
    fwd = (flops - expert_flops) / rate + fe + far + elementwise / 3
    bwd = 2 * (flops - expert_flops) / rate + be + 2.5 * far + mlp + 2 * elementwise / 3
    if lean_activations and not rows:  # lean.py's elementwise recompute in the backward (Note: [Lean auto])
        from ..step.lean import LEAN_COST

        bwd += LEAN_COST * (fwd + bwd)
    attn_fwd = 2 * batch * seq * near * q_dim / rate + far  # what a cached layer's recompute skips
    fwd, bwd = max(fwd, hw.layer_launch_ms[0]), max(bwd, hw.layer_launch_ms[1])
    t = dict(pack=P / cast, h2d=P * wb / up / 1e6, h2d_bwd=P * wb / both_up / 1e6, fwd=fwd, bwd=bwd,
             recompute_cached=max(fwd - attn_fwd, hw.layer_launch_ms[0]),
             d2h=P * d / both_down / 1e6, unpack=P / cast, adam=P / adam)
    state_in = 10 * P if split and weight_slots >= L else layer_state  # Note: [Split master]: D alone where R is held
    t.update(state_bytes=state_in, state_in=state_in / both_up / 1e6, state_out=layer_state / both_down / 1e6,
             dev_adam=P / dev_adam * 1e3,  # a "device" layer's fp32 master and moments, in and out
             head_state_bytes=head_state, head_state_in=head_state / both_up / 1e6,
             head_state_out=head_state / both_down / 1e6, head_dev_adam=head_n / dev_adam * 1e3)  # the head group's
    if pin_store:  # the cast moves from the load path into the optimizer worker
        t.update(pack=0.0, unpack=0.0, adam=P / adam + P / cast)
    if cast_on_device:  # pinned fp32 master in, pinned grad slabs out: no host cast anywhere
        t.update(pack=0.0, unpack=0.0)
    if ring:  # grads out by DMA into the ring's pinned buffers: no unpacking
        t.update(unpack=0.0)
    pinned_store = pin_store or cast_on_device
    refresh = (lambda n: n / cast) if pin_store else (lambda n: 0.0)
    tied_grads = V * h if s["tied"] else 0  # a tied head's embedding grads go through staging into fp32
    touched = V * -math.expm1(T * math.log1p(-1 / V))  # rows T uniform tokens touch: real text touches fewer
    rows_path = ring and not s["tied"]  # the gradient as touched rows: zeroed, added and normed, not a table
    if overlap_optimizer and not grad_clip and h % early_rows.LANES == 0 and touched * h * 4 <= early_rows.MAX_BYTES:
        t["embed_rows_adam"] = EARLY_ROWS_COST * touched * h / adam32  # Note: [Early rows]
    units = {  # unit -> (bytes loaded, pack ms, h2d ms, grad bytes, d2h ms, unpack ms, adam ms)
        -1: (touched * h * d, touched * h / cast, touched * h * d / up / 1e6,  # its distinct rows in (Note: [Unique
             T * h * d, T * h * d / both_down / 1e6,  # rows] in step/embedding.py); dE out: every token's, compute dtype
             (T * h + (2 * touched * h if rows_path else V * h * (1 if s["tied"] else 2))) / cast,
             E / adam32 + refresh(E)),
        L: (head_n * wb, 0.0 if pinned_store else head_n / cast, head_n * wb / up / 1e6, head_n * d,
            head_n * d / both_down / 1e6, (tied_grads if pinned_store or ring else head_n) / cast,
            s["head_params"] / adam + refresh(s["head_params"])),
    }
    loss_ms = 6 * V * h * T / ((hw.gemm_tflops or hw.bf16_tflops) * 1e9) + V * T * hw.loss_s_per_logit * 1e3
    sim = (L, P * wb, P * d, t, units, loss_ms, keep, block, weight_slots,
           pinned_budget_bytes if pinned else 0, transfer_chunk_bytes, overlap_optimizer and not grad_clip)
    cached_layers = frozenset(range(L - cached, L))  # the last recomputed ones, as Checkpoints._place
    spans, busy = simulate(*sim, s["tied"], frozenset(resident), dev_adam_ms, frozenset(streamed), cached_layers, sslots)
    step_ms = max(b for *_, b, _ in spans)
    work = {"compute": busy.get("compute", 0.0),
            "pcie": max(busy.get("h2d", 0.0), busy.get("d2h", 0.0) + busy.get("d2h-state", 0.0)),
            "host-pack": busy.get("host-pack", 0.0), "host-unpack": busy.get("host-unpack", 0.0),
            "host-adam": busy.get("host-adam", 0.0)}
    matmul_params = L * s["active_params_per_layer"] + V * h
    p = Plan(shape=s, hardware=hw, settings=settings, host_bytes=host, host_bytes_per_param=store / N,
             device_bytes=device, keep=keep, layer_ms=t, step_ms=step_ms, busy_ms=busy,
             model_tflops=6 * matmul_params * T / step_ms / 1e9, bottleneck=max(work, key=work.get),
             fits_device=sum(device.values()) <= hw.device_mem_bytes and ckpt_error is None,
             fits_host=sum(host.values()) + HOST_MARGIN <= hw.host_mem_bytes, placement={u: choice[u].placement for u in numel},
             spans=spans, _sim=(*sim, s["tied"], frozenset(resident), dev_adam_ms, frozenset(streamed), cached_layers,
                                sslots),
             tile_rows=rows, block=block, parked=parked, attention_cached=cached)
    if _advise and not (p.fits_device and p.fits_host):
        p.advice = _advice(p, ckpt_error, dict(config=config, hardware=hardware, **{
            k: v for k, v in settings.items() if k not in ("tokens", "dtype_bytes")}, dtype_bytes=d))
        if not p.fits_device:
            warnings.warn(f"plan does not fit the device: {sum(device.values()) / _GIB:.1f} GiB of "
                          f"{hw.device_mem_bytes / _GIB:.1f}. " + " ".join(p.advice), stacklevel=2)
        if not p.fits_host:
            warnings.warn(f"plan does not fit host RAM: {sum(host.values()) / _GIB:.1f} GiB of "
                          f"{hw.host_mem_bytes / _GIB:.1f} ({p.host_bytes_per_param:g} B/param + pinned pool"
                          + (f" + {parked} parked checkpoints" if parked else "") + "). " + " ".join(p.advice),
                          stacklevel=2)
    if mode == "auto" and _search and _advise and checkpoint_every is None and sum(keep) and len(resident) < len(numel) \
            and p.steady_step_ms < 3e3 * N / hw.host_adam_params_per_s:  # placement.Search, Note: [Auto search]
        free_b = free + sum(keep) * (act - boundary) - act
        kwargs = {k: v for k, v in settings.items() if k not in ("tokens", "dtype_bytes", "placement")}

        def trial(free_bytes):
            units = {u for u, c in placing.choose(numel, mode="auto", free_bytes=int(free_bytes), dtype_bytes=d,
                                                  tied=s["tied"], cuda=True).items() if c.placement == "resident"}
            return plan(config, hardware=hardware, dtype_bytes=d, placement=dict.fromkeys(units, "resident"),
                        _advise=False, _search=False, **kwargs)

        tried = [trial(free_b)]  # B, residency first
        df = p.simulate_steady()
        wait_s = float(df.loc[df.op == "wait-update", "dur_ms"].sum()) / 1e3
        head = placing.head_groups(numel, resident, dtype_bytes=d, tied=s["tied"],
                                   adam_params_per_s=hw.host_adam_params_per_s)
        budgets = placing.head_budgets(int(free), int(free_b), head, wait_s, p.steady_step_ms / 1e3)
        if budgets:
            tried.append(min((trial(b) for b in budgets), key=lambda x: x.steady_step_ms))  # C, the forward's head resident
        q = min(tried, key=lambda x: x.steady_step_ms)
        if q.steady_step_ms * (1 + placing.MARGIN) < p.steady_step_ms:  # as placement.pick: A within the margin wins
            q.settings["placement"] = "auto"
            return q
    return p


def _advice(p: Plan, ckpt_error: str | None, kwargs: dict) -> list[str]:
    """What does not fit, and each single setting that makes the plan fit (re-planned without advice)."""
    dev, host, hw = sum(p.device_bytes.values()), sum(p.host_bytes.values()), p.hardware
    out = []
    if not p.fits_device:
        top = sorted(p.device_bytes.items(), key=lambda kv: -kv[1])[:3]
        out.append(f"Device: needs {dev / _GIB:.1f} GiB of {hw.device_mem_bytes / _GIB:.1f} ("
                   + ", ".join(f"{k} {v / _GIB:.1f}" for k, v in top) + ")."
                   + (f" Checkpoints: {ckpt_error}." if ckpt_error else ""))
    if not p.fits_host:
        out.append(f"Host: needs {(host + HOST_MARGIN) / _GIB:.1f} GiB of {hw.host_mem_bytes / _GIB:.1f} "
                   f"(store {(host - p.host_bytes['pinned_pool'] - p.host_bytes.get('parked_checkpoints', 0) - p.host_bytes['embedding_grad_rows']) / _GIB:.1f}, "
                   f"parked checkpoints {p.host_bytes.get('parked_checkpoints', 0) / _GIB:.1f}, "
                   f"margin {HOST_MARGIN / _GIB:.0f}).")
    tries = []
    if not p.fits_host:  # fewer bytes of moments, from the fewest saved up
        tries += [("optimizer_state", k) for k in ("int8", "int4")
                  if compact_state.bytes_per_param(k) < compact_state.bytes_per_param(kwargs["optimizer_state"])]
    if kwargs["offload_checkpoints"] is not None:
        tries.append(("offload_checkpoints", None))
    if kwargs["tile_tokens"] != 16384 and kwargs["batch"] * kwargs["seq"] > 16384:
        tries.append(("tile_tokens", 16384))
    if not kwargs["lean_activations"]:
        tries.append(("lean_activations", True))
    if kwargs["activation_budget"] is not None and kwargs["activation_budget"] < 0.95:
        tries.append(("activation_budget", 0.95))
    if kwargs["pinned_budget_bytes"] > (512 << 20):
        tries.append(("pinned_budget_bytes", 512 << 20))
    if kwargs["checkpoint_every"] is not None:
        tries.append(("checkpoint_every", None))
    fixes = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for name, value in tries:
            q = plan(**{**kwargs, name: value, "_advise": False})
            if q.fits_device and q.fits_host:
                fixes.append(f"{name}={value!r}")
        if not fixes:
            seq = kwargs["seq"]
            while seq > 1024 and not fixes:
                seq //= 2
                q = plan(**{**kwargs, "seq": seq, "_advise": False})
                if q.fits_device and q.fits_host:
                    fixes.append(f"seq={seq} (or shorter)")
    out.append("Fits with " + " or ".join(fixes) + "." if fixes else
               "No single setting fits; a smaller batch, seq or model is needed.")
    return out
