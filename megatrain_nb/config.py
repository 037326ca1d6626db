"""Settings of a training session: small kw_only dataclasses that validate themselves."""
from __future__ import annotations

import dataclasses
import math
import numbers

import torch

from .machine.budget import parse_bytes
from .machine.longcontext import keep_share

MOMENT_STAGING_BYTES = 64 << 20  # each of the two pinned buffers that resident groups' moments come in
# through during a step, on CUDA (Note: [Late moments] in step/late_moments.py)

SCHEDULES = ("constant", "linear", "cosine")
OPTIMIZER_STATES = ("fp32", "int8", "int4")
PINNED_BUDGET_BYTES = 2 << 30  # the staging pool when the store's slabs are pageable: every load is packed through it
PINNED_BUDGET_PINNED_STORE = 512 << 20  # when they are pinned: only the embedding's rows and fp32 gradients pass


def pinned_budget(setting: int | None, store_pinned: bool) -> int:
    """``EngineConfig.pinned_budget_bytes`` resolved: an int as given; None: 2 GiB, or 512 MiB where the
    store's slabs are pinned themselves (``cast_on_device`` or ``pin_store``: weights, gradients and
    streamed state then cross in one DMA each, and only the gathered embedding rows and the embedding's
    fp32 gradients pass through staging). Pinned memory is host RAM: the 1.5 GiB saved count in RSS.

    Example:
        >>> pinned_budget(None, False) >> 20, pinned_budget(None, True) >> 20, pinned_budget(0, True)
        (2048, 512, 0)
    """
    if setting is not None:
        return setting
    return PINNED_BUDGET_PINNED_STORE if store_pinned else PINNED_BUDGET_BYTES


def _number(name: str, value, what: str, none: bool = False) -> None:
    """ValueError naming the field unless ``value`` is a finite real number (not a bool), or None where allowed."""
    if none and value is None:
        return
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value):
        raise ValueError(f"{name}={value!r}: must be a finite number ({what})")


def _integer(name: str, value, least: int, what: str, none: bool = False) -> None:
    """ValueError naming the field unless ``value`` is an int >= ``least`` (not a bool), or None where allowed."""
    if none and value is None:
        return
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < least:
        raise ValueError(f"{name}={value!r}: must be an int >= {least} ({what})")


def _flag(name: str, value, none: bool) -> None:
    """ValueError naming the field unless ``value`` is True or False (or None, the automatic choice, where allowed)."""
    if not (value is True or value is False or (none and value is None)):
        raise ValueError(f"{name}={value!r}: use True or False" + (" or None (auto)" if none else ""))


@dataclasses.dataclass(kw_only=True)
class OptimConfig:
    lr: float = 1e-3
    """Peak learning rate of AdamW."""
    betas: tuple[float, float] = (0.9, 0.999)
    """AdamW's (beta1, beta2)."""
    eps: float = 1e-8
    """AdamW's epsilon."""
    weight_decay: float = 0.0
    """Decoupled weight decay, applied to every parameter as ``torch.optim.AdamW(model.parameters())`` does."""
    grad_clip: float | None = None
    """Clip the global gradient norm to this value, as ``clip_grad_norm_``. Costs overlap: every
    gradient must reach the host before any update."""
    lr_schedule: str = "constant"
    """"constant", "linear" (to 0 at total_steps) or "cosine" (to 0 at total_steps), after warmup."""
    warmup_steps: int = 0
    """Steps of linear warmup from 0 (as transformers' schedules: the first step uses lr 0 when > 0)."""
    total_steps: int | None = None
    """Length of the decay for "linear" and "cosine"."""
    optimizer_state: str = "fp32"
    """How the Adam moments are held (``compact_state.py``): "fp32" (exact ``torch.optim.AdamW``, 8 bytes a
    parameter), "int8" (block-wise 8-bit, blocks of 256 with one fp32 scale each: ~2 bytes) or "int4" (blocks
    of 128: ~1 byte). The fp32 master stays exact and the update's arithmetic is fp32; tensors under 4096
    values and the input embedding keep fp32 moments (``compact_keep_fp32``)."""
    compact_keep_fp32: tuple[str, ...] | None = None
    """With a compact ``optimizer_state``: name patterns (``fnmatch``, against checkpoint names such as
    "model.layers.3.mlp.up_proj.weight") of tensors whose moments stay fp32, besides those under 4096 values.
    None: the input embedding's (as HF Trainer does for 8-bit Adam). ``()``: none but the small ones."""

    def __post_init__(self):
        if isinstance(self.lr, bool) or not (isinstance(self.lr, numbers.Real) and math.isfinite(self.lr)
                                             and self.lr >= 0):
            raise ValueError(f"lr={self.lr!r}: must be a finite number >= 0")
        betas = tuple(self.betas) if isinstance(self.betas, (tuple, list)) else ()
        if len(betas) != 2 or not all(isinstance(b, numbers.Real) and not isinstance(b, bool) and 0 <= b < 1
                                      for b in betas):
            raise ValueError(f"betas={self.betas!r}: must be two numbers (beta1, beta2), each in [0, 1), "
                             "e.g. (0.9, 0.999)")
        self.betas = tuple(float(b) for b in betas)
        _number("eps", self.eps, "> 0, e.g. 1e-8")
        if not self.eps > 0:
            raise ValueError(f"eps={self.eps!r}: must be > 0")
        _number("weight_decay", self.weight_decay, ">= 0, e.g. 0.0 or 0.1")
        if self.weight_decay < 0:
            raise ValueError(f"weight_decay={self.weight_decay!r}: must be >= 0")
        _number("grad_clip", self.grad_clip, "> 0, or None for no clipping", none=True)
        if self.grad_clip is not None and not self.grad_clip > 0:
            raise ValueError(f"grad_clip={self.grad_clip!r}: must be > 0, or None for no clipping")
        if self.optimizer_state not in OPTIMIZER_STATES:
            raise ValueError(f"optimizer_state={self.optimizer_state!r}: choose one of {OPTIMIZER_STATES} "
                             "('fp32' exact, 'int8' ~2 bytes a parameter of moments, 'int4' ~1)")
        if self.compact_keep_fp32 is not None:
            if not isinstance(self.compact_keep_fp32, (tuple, list)) or not all(isinstance(x, str)
                                                                               for x in self.compact_keep_fp32):
                raise ValueError(f"compact_keep_fp32={self.compact_keep_fp32!r}: a tuple of name patterns, e.g. "
                                 "('*embed_tokens*',), () or None")
            self.compact_keep_fp32 = tuple(self.compact_keep_fp32)
        if self.lr_schedule not in SCHEDULES:
            raise ValueError(f"lr_schedule={self.lr_schedule!r}: choose one of {SCHEDULES}")
        _integer("warmup_steps", self.warmup_steps, 0, "steps of linear warmup")
        _integer("total_steps", self.total_steps, 1, "the schedule's length, or None", none=True)
        if self.lr_schedule != "constant" and (self.total_steps is None or self.total_steps <= self.warmup_steps):
            raise ValueError(f"lr_schedule={self.lr_schedule!r} needs total_steps > warmup_steps "
                             f"(got total_steps={self.total_steps!r}, warmup_steps={self.warmup_steps})")

    def lr_at(self, step: int) -> float:
        """Learning rate of 0-based update ``step``; the formulas of transformers' get_*_schedule_with_warmup."""
        if step < self.warmup_steps:
            return self.lr * step / max(1, self.warmup_steps)
        if self.lr_schedule == "constant":
            return self.lr
        progress = (step - self.warmup_steps) / max(1, self.total_steps - self.warmup_steps)
        if self.lr_schedule == "linear":
            return self.lr * max(0.0, 1.0 - progress)
        return self.lr * max(0.0, 0.5 * (1.0 + math.cos(math.pi * progress)))


@dataclasses.dataclass(kw_only=True)
class EngineConfig:
    device: str = "cpu"
    """"cpu" or "cuda[:i]". On "cpu" the same code path runs with copies for transfers."""
    dtype: torch.dtype | None = None
    """Compute dtype of streamed weights and activations; None: bf16 on CUDA, fp32 on CPU.
    Master weights and Adam moments are always fp32 on the host."""
    checkpoint_every: int | None = None
    """Recompute blocks of this many layers from a saved layer input. None: keep every layer's
    activations that fit in device memory (``activation_budget``) and recompute the rest one layer
    at a time. 0: keep all, recompute nothing."""
    micro_batch_size: int | None = None
    """Split the batch into micro-batches of this many sequences inside each layer (its weights are
    loaded once for all of them). None: the whole batch at once."""
    pass_batch_size: int | None = None
    """Run a larger batch as passes of this many sequences, one after another, each a whole forward and
    backward: only one pass's activations wait for the backward, and the gradients add up over the passes
    before the batch's one update (gradient accumulation; Note: [Passes] in step/passes.py). None: the
    whole batch in one pass; under placement="auto" on CUDA the planner's choice where it predicts more
    tokens a second (``Session.placement`` says which). Not with placement="stream" or data parallel."""
    loss_chunk_tokens: int | None = None
    """Sequence positions per chunk of final norm + lm_head + cross-entropy: the full logits never exist.
    None: 1024 tokens a chunk across the micro-batch's rows (1024 positions at batch 1, 128 at batch 8), so
    that the chunk's logits do not grow with the batch (``shape.loss_positions``)."""
    weight_slots: int | None = None
    """Device buffers for streamed layer weights (>= 2: one computes while the next loads). None: 2, or
    one per layer under placement="stream" where they take at most a tenth of device memory (the
    backward then reuses the forward's weights: ``placement.weight_slots``)."""
    pinned_budget_bytes: int | None = None
    """Host pinned staging for transfers (CUDA only), split into ``transfer_chunk_bytes`` buffers. None: 2 GiB,
    or 512 MiB where the store's slabs are pinned (``cast_on_device``, ``pin_store``: see ``pinned_budget``)."""
    transfer_chunk_bytes: int = 64 << 20
    """Size of one staging buffer; >= 16 MB reaches full PCIe bandwidth."""
    pin_store: bool | None = None
    """Keep a pinned compute-dtype copy of the weights (refreshed by the optimizer) and pinned grad
    slabs, so transfers skip host packing: +2 bytes/param of host RAM. None: on when CUDA is used,
    cast_on_device is off and the store plus copy fit in 90% of host RAM."""
    cast_on_device: bool | None = None
    """Pin the fp32 master slabs themselves (no extra host bytes) and let the device cast them to the
    compute dtype: twice the PCIe bytes of a bf16 copy, but no host cast at all, neither when packing
    nor after the update. CUDA only; excludes pin_store. None: on when CUDA is used, pin_store is not
    set and the store, as allocated (the gradient ring's buffers, not slabs, by default), fits in 90% of host RAM
    (faster than pin_store on the H200 at every batch)."""
    split_master: bool | None = None
    """Hold a "device" layer's fp32 master in host memory as its bf16 weights plus 16 more bits, exactly, so
    that its state comes in as 10 bytes a parameter instead of 12 (Note: [Split master] in split_master.py).
    None: wherever it applies (bf16 compute, no ``pin_store`` copy, one process's own store). False: never
    (fp32 masters throughout). True: as None, but an error where it cannot apply."""
    offload_checkpoints: bool | None = None
    """Where the inputs of recompute blocks wait for the backward. True: all in host memory (pinned on
    CUDA), fetched back one block ahead: GPU memory then no longer grows with depth, for B*T*H*dtype
    bytes per block each way over PCIe. False: all on the device. None: on CUDA, as many on the device
    as ``activation_budget`` leaves room for beside the backward's working set, the earliest blocks in
    host memory (``planner.place_checkpoints``, decided with the keep policy and again when tokens
    grow); on "cpu" all stay (host RAM either way). Under every setting but ``checkpoint_every`` fixed, the
    kept layers leave the inputs room where they wait (``longcontext.keep_cap``)."""
    tile_tokens: int | None = None
    """Rows (tokens) per tile of a layer's norms and dense MLP (``tiling.py``): their whole-sequence
    intermediates then exist one tile at a time, for one more MLP forward per layer in the backward.
    0: never tile. None: tile in 16384-row tiles once one untiled layer's activations would exceed 1/8
    of device memory (the 7B shape: above ~81K tokens per micro-batch; ~147K with lean_activations=True)."""
    attention_backend: str | None = None
    """SDPA kernel of the layers' attention: "flash", "cudnn", "efficient" (tried first, the other fused
    ones after it) or "math". None: at long context (T x T scores above 1 GiB) the fused kernels in
    torch's order, never math; at short context torch's own choice. The chosen one is named in
    ``Session.engine.tiler.backend``."""
    experts_implementation: str | None = None
    """How MoE experts compute (``model/kernels.py``, Note: [Experts kernel]): "grouped_mm" (one grouped GEMM
    per projection over the tokens sorted by expert), "megatrain_grouped_mm" (the same GEMMs, the work around
    them cheaper: ``model/experts.py``), "eager" (transformers' loop over the experts that got tokens) or
    "batched_mm" (each token gathers its experts' weights: memory for inference only). None:
    grouped_mm where torch runs it (CUDA from compute capability 8.0 in bf16 / fp16; the CPU), else eager.
    Ignored for dense models; ``Session.kernels`` names the choice and why."""
    attention_cache: bool | None = None
    """Keep each recomputed layer's attention output (and its log-sum-exp) from the forward, so that its
    recompute skips the attention forward (``attncache.py``, Note: [Attention cache]): B*T*heads*
    (head_dim*dtype_bytes + 4) bytes per layer, ~0.8 s of ~5.4 s per layer saved at 256K tokens of the 7B
    shape. None: on CUDA where the attention is at least a quarter of a layer's forward (the 7B shape from
    ~22K tokens per sequence), for as many recomputed layers as device memory holds beside their
    checkpoints, the last ones (``longcontext.place_cache``, Note: [Attention cache placement]; before
    kept layers where that saves more per byte, ``longcontext.cache_first``; up to the 0.95 share where
    0.85 falls short, ``longcontext.place_long``); nothing on the CPU. True: at any length, on CUDA wherever memory allows,
    on the CPU every recomputed layer. False: never (the attention forward runs again in the recompute)."""
    lean_activations: bool | None = None
    """None (auto): on CUDA, lean for a batch size where it keeps enough layers from recompute to pay
    for itself (``lean.auto``, Note: [Lean auto]); off where sequence tiling takes long-context layers,
    and on the CPU (activations live in host RAM). True: always.
    Keep fewer activations per layer (``lean.py``): each RMSNorm keeps only its input (not HF's fp32
    copy and cast) and a dense gated MLP keeps gate and up (not also act(gate) and the product), saving
    8*hidden + 2*dtype_bytes*intermediate bytes per token and layer (Qwen2.5-7B shape in bf16: 225 -> 121
    KB, docs/design_log.md). Costs one elementwise recompute of the norms and of act(gate)*up in
    each layer's backward; no matmul. Where sequence tiling runs (``tile_tokens``) tiling wins; MoE
    experts and attention stay as they are. False: Hugging Face's own forward, exactly as before."""
    activation_budget: float | None = None
    """With checkpoint_every=None on CUDA: fraction of device memory activations may fill. None: 0.85
    for kept activations and resident units; recompute-block inputs at long context (with the backward's
    working set) may reach 0.95 where they fit nowhere at 0.85 (``longcontext``, Note: [Device share]).
    A float fixes one share for both."""
    overlap_optimizer: bool = True
    """Run host AdamW in a worker as each layer's gradients land (False: after the whole backward)."""
    nonfinite: str = "skip"
    """A NaN/inf loss or gradient: "skip" the step's update (counted in Session.skipped_steps, warned)
    or "raise" FloatingPointError. "raise" waits for every gradient before any update (no overlap
    with the backward), so nothing is applied; see docs/engine.md [Non-finite gradients] for "skip"."""
    grad_ring: bool = True
    """Where nothing needs gradients at rest (no ``grad_clip``, one pass, ``overlap_optimizer``, nonfinite
    "skip", no shared host store), the layers' and head's gradients wait in a few host buffers of the
    largest unit from their copy out until their AdamW has read them, not in a slab per unit (2 bytes a
    parameter less; Note: [Gradient ring] in host/grad_ring.py). ``Session.memory_report()["gradients"]``
    says which and why. False: slabs always."""
    grad_ring_overflow: bool = True
    """With the ring: a copy out that finds every ring buffer held takes a plain host buffer while the host has
    room (within ``host_memory`` where set, else within 90% of the machine's RAM; 4 GiB left free) rather than
    stall the backward until the host's AdamW frees one; as many as that AdamW is behind, kept for the next step
    (Note: [Ring overflow] in host/grad_ring.py). False: the copy out waits (a fixed host footprint; the backward
    runs at the host's pace)."""
    trace: bool = True
    """Record spans and counters of each step (``Session.trace``)."""
    placement: str | dict = "auto"
    """Where each unit's AdamW and state live (placement.py): "auto" (on CUDA, units resident on the
    device while the memory the activations leave holds them), "host" (every update on the host,
    nothing kept on the device), "stream" (a share of the layers stream their fp32 state through the
    device for their update; nothing kept), or a dict {unit: "host" | "device" | "resident"} (-1
    embedding, 0..L-1 layers, L head). ``Session.placement`` shows the choice and why."""
    share_host_store: bool | None = None
    """Under data parallel, the ranks of a machine share one host store (masters, moments, gradients) and
    split its AdamW (shared_store.py). False: each rank holds its own copy. None: env
    ``MEGATRAIN_SHARE_HOST_STORE`` ("0" off), else on when a machine runs more than one rank."""
    device_memory: int | str | None = None
    """The most device memory the CUDA caching allocator may reserve: an int of bytes or a string such as
    "24GiB" or "20GB" (held as bytes after validation). Everything that sizes itself from the device reads
    the budget in place of the card's memory where it is smaller (preflight, placement, the activation
    policy, the planner's choices, generation) and the allocator is capped at it
    (``set_per_process_memory_fraction``; Note: [Budgets] in machine/budget.py). The CUDA context (~0.5 GiB)
    is outside it. None: the whole card."""
    host_memory: int | str | None = None
    """The most host RAM the process may hold resident (RSS: the host store, pinned staging, parked
    activations and torch's runtime): an int of bytes or a string such as "64GB" or "1.5TiB". Preflight
    refuses a model whose store does not fit in it before allocating anything, naming the
    ``optimizer_state`` that would; pinning and parking read it in place of the machine's RAM where smaller.
    None: what the machine has."""

    def __post_init__(self):
        self._check_budgets()  # device_memory, host_memory: a block of their own
        try:
            dev = torch.device(self.device)
        except (RuntimeError, TypeError) as e:
            raise ValueError(f"device={self.device!r} is not a device torch knows; use 'cpu' or 'cuda'") from e
        if dev.type not in ("cpu", "cuda"):
            raise ValueError(f"device={self.device!r}: use 'cpu' or 'cuda'")
        if dev.type == "cuda" and not torch.cuda.is_available():
            raise ValueError(f"device={self.device!r} but torch.cuda.is_available() is False; use device='cpu'")
        if self.dtype is None:
            self.dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
        if self.dtype not in (torch.float32, torch.bfloat16, torch.float16):
            raise ValueError(f"dtype={self.dtype!r}: use torch.float32, torch.bfloat16 or torch.float16")
        if self.checkpoint_every is not None and (not isinstance(self.checkpoint_every, int) or self.checkpoint_every < 0
                                                  or isinstance(self.checkpoint_every, bool)):
            raise ValueError(f"checkpoint_every={self.checkpoint_every!r}: an int >= 1, 0 (keep all) or None (auto)")
        _integer("micro_batch_size", self.micro_batch_size, 1, "sequences a micro-batch, or None", none=True)
        if self.pass_batch_size is not None and (not isinstance(self.pass_batch_size, int)
                                                 or isinstance(self.pass_batch_size, bool) or self.pass_batch_size < 1):
            raise ValueError(f"pass_batch_size={self.pass_batch_size!r}: an int >= 1 (sequences a pass) or None")
        _integer("loss_chunk_tokens", self.loss_chunk_tokens, 1, "positions, or None (auto)", none=True)
        if self.weight_slots is not None and (not isinstance(self.weight_slots, int) or self.weight_slots < 2
                                              or isinstance(self.weight_slots, bool)):
            raise ValueError(f"weight_slots={self.weight_slots!r}: need at least 2 (one computing, one loading)")
        _integer("transfer_chunk_bytes", self.transfer_chunk_bytes, 1 << 20, "bytes: use at least 1 MiB")
        _integer("pinned_budget_bytes", self.pinned_budget_bytes, 0, "bytes, or None (auto)", none=True)
        for name in ("pin_store", "cast_on_device", "offload_checkpoints", "share_host_store"):
            _flag(name, getattr(self, name), none=True)
        _flag("overlap_optimizer", self.overlap_optimizer, none=False)
        _flag("trace", self.trace, none=False)
        if self.pinned_budget_bytes is not None and self.pinned_budget_bytes < 2 * self.transfer_chunk_bytes:
            raise ValueError(f"pinned_budget_bytes={self.pinned_budget_bytes!r}: must hold at least two "
                             f"transfer chunks of {self.transfer_chunk_bytes} bytes")
        if self.cast_on_device and dev.type != "cuda":
            raise ValueError("cast_on_device=True needs device='cuda' (it pins host memory); use cast_on_device=None")
        if self.cast_on_device and self.pin_store:
            raise ValueError("cast_on_device=True and pin_store=True both pin the store; choose one")
        if self.split_master not in (None, True, False):
            raise ValueError(f"split_master={self.split_master!r}: use None (where it applies), True or False")
        if self.split_master and (self.dtype != torch.bfloat16 or self.pin_store):
            raise ValueError(f"split_master=True needs dtype=torch.bfloat16 (got {self.dtype}) and no pin_store "
                             "(its bf16 copy already is the weights); use split_master=None")
        if not isinstance(self.grad_ring_overflow, bool):
            raise ValueError(f"grad_ring_overflow={self.grad_ring_overflow!r}: use True (plain host buffers where the "
                             "ring is full and the host has room) or False (wait for a ring buffer)")
        if not isinstance(self.grad_ring, bool):
            raise ValueError(f"grad_ring={self.grad_ring!r}: use True (a ring where nothing needs gradients at rest) "
                             "or False (a gradient slab per unit)")
        if self.nonfinite not in ("skip", "raise"):
            raise ValueError(f"nonfinite={self.nonfinite!r}: use 'skip' or 'raise'")
        if self.tile_tokens is not None and (not isinstance(self.tile_tokens, int) or self.tile_tokens < 0
                                             or isinstance(self.tile_tokens, bool)):
            raise ValueError(f"tile_tokens={self.tile_tokens!r}: an int >= 1 (rows per tile), 0 (never tile) or None (auto)")
        if self.attention_backend not in (None, "flash", "cudnn", "efficient", "math"):
            raise ValueError(f"attention_backend={self.attention_backend!r}: use 'flash', 'cudnn', 'efficient', 'math' "
                             "or None (the fused kernels in torch's order)")
        if self.experts_implementation not in (None, "eager", "grouped_mm", "megatrain_grouped_mm", "batched_mm"):
            raise ValueError(f"experts_implementation={self.experts_implementation!r}: use 'megatrain_grouped_mm', "
                             "'grouped_mm', 'eager', 'batched_mm' or None (auto)")
        if not (isinstance(self.placement, dict) or self.placement in ("auto", "host", "stream")):
            raise ValueError(f"placement={self.placement!r}: use 'auto', 'host', 'stream' or a dict "
                             "{unit: 'host' | 'device' | 'resident'}")
        if self.lean_activations is not None and not isinstance(self.lean_activations, bool):
            raise ValueError(f"lean_activations={self.lean_activations!r}: use None (auto), True (keep fewer "
                             "activations, recompute the norms and the MLP's activation in the backward) or False "
                             "(HF's own forward)")
        if self.attention_cache is not None and not isinstance(self.attention_cache, bool):
            raise ValueError(f"attention_cache={self.attention_cache!r}: use None (auto), True or False")
        _number("activation_budget", self.activation_budget, "a fraction in (0, 1], or None (auto)", none=True)
        if self.activation_budget is not None and not 0 < self.activation_budget <= 1:
            raise ValueError(f"activation_budget={self.activation_budget!r}: a fraction in (0, 1], or None (auto)")

    def _check_budgets(self) -> None:
        """device_memory and host_memory as bytes (``budget.parse_bytes``: ValueError naming the field)."""
        self.device_memory = parse_bytes(self.device_memory, "device_memory")
        self.host_memory = parse_bytes(self.host_memory, "host_memory")

    @property
    def keep_share(self) -> float:
        """The device share kept activations and resident units may fill (``activation_budget`` resolved)."""
        return keep_share(self.activation_budget)
