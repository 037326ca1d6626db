"""The trainers that bench/peers.py compares, one class each, built inside the process that measures it.

Every system trains the same HF Qwen2 model (a random init from the same config) on the same token ids
with AdamW (lr 1e-5, no weight decay) and exposes one call, ``step(ids) -> (loss, optimizer_s)``:
forward, backward and the update of all parameters, with the optimizer's own wall time where it runs
apart from the backward (None where it overlaps it). ``child_main`` is what one process of peers.py
runs: build one system, time its batches, print one row each. Jobs, processes and the run's file are
peers.py's; this module knows nothing of them. (~430 lines: four systems and the loop that times them,
all that one measuring process runs; keeping them together keeps each system's setup next to its step.)

- ``Native``: the whole model on the device, fp32 master weights + bf16 autocast (or pure bf16
  parameters), every layer recomputed in the backward, torch's fused AdamW on the device.
- ``FSDP2Offload``: ``fully_shard`` per decoder layer and at the root with ``CPUOffloadPolicy`` at world
  size 1, bf16 compute (``MixedPrecisionPolicy``), every layer recomputed, torch AdamW on the host.
- ``ZeRO3Offload``: DeepSpeed ZeRO-3 with parameters and optimizer offloaded to the host
  (``DeepSpeedCPUAdam``); with ``ratio`` < 1 only that share of the optimizer states is on the host and
  the rest is updated on the device (ZeRO-Offload++ "Twin-Flow").
- ``Megatrain``: ``megatrain_nb.Session`` with default settings, plus ``placement`` when given;
  "megatrain-recompute" recomputes every layer (``checkpoint_every=1``, placement "auto"): the paper's
  regime, whose TFLOPS do not fall with depth; "megatrain-host-recompute" also keeps every update on the
  host (``placement="host"``) and every recompute block's input in host memory (``offload_checkpoints=True``):
  nothing but weight slots and one layer's working set on the device, whose memory is then flat in depth
  (the depth sweep's fixed settings; B*T*H*2 bytes of pinned host RAM per layer, 128 MiB at 3B x 8).
"""
from __future__ import annotations

import json
import os
import resource
import socket
import statistics
import sys
import time
import traceback

import torch

from rows import busy_shares, host_adam_rate  # bench/ is on the path: the parent's and each child's

LR = 1e-5
ROW_KEYS = ("system", "sweep", "status", "error", "shape", "layers", "hidden", "width", "params", "batch", "seq",
            "tokens", "step_s", "step_s_all", "model_tflops", "tokens_per_s", "optimizer_s", "optimizer_share",
            "peak_gpu_gib", "host_rss_gib", "host_rss_peak_gib", "loss_first", "loss_last", "init_s",
            "settings", "device", "gpu", "torch", "date")
ROW_MARK = "@@peers-row "  # child stdout lines that carry a row; everything else goes to the log


class Unsupported(RuntimeError):
    """This system cannot run here (a missing package or keyword); the row says so instead of crashing."""


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()  # host waits for the device: every timing boundary needs it


def hf_model(config, device: torch.device, dtype: torch.dtype):
    """The HF causal LM of `config`, randomly initialised on `device` (seed 0), set up for training."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    config.use_cache = False
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    model.train()
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})  # every layer
    return model


def _timed(fn, device: torch.device) -> float:
    sync(device)
    t0 = time.perf_counter()
    fn()
    sync(device)
    return time.perf_counter() - t0


def _init_process_group(backend: str) -> None:
    """World size 1 in this process, on a free local port."""
    import torch.distributed as dist

    if dist.is_initialized():
        return
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0", LOCAL_RANK="0", WORLD_SIZE="1")
    dist.init_process_group(backend, rank=0, world_size=1)


class Native:
    """Plain PyTorch, all state on the device: the ceiling when the model fits on the card.

    Args:
        config: a transformers config.
        device: where everything lives.
        bf16_params: pure bf16 parameters, gradients and AdamW states (no fp32 master), for when the
            fp32 master runs out of device memory.
    """

    def __init__(self, config, device: torch.device, *, bf16_params: bool = False):
        self.device, self.bf16_params = device, bf16_params
        self.model = hf_model(config, device, torch.bfloat16 if bf16_params else torch.float32)
        self.num_params = lambda: sum(p.numel() for p in self.model.parameters())
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=LR, weight_decay=0.0, fused=True)
        self.settings = dict(params_dtype="bf16" if bf16_params else "fp32", autocast=not bf16_params,
                             recompute="every layer", optimizer="torch.optim.AdamW(fused=True) on the device")

    def step(self, ids: torch.Tensor) -> tuple[float, float]:  # ids: (B, T) int64 on the device
        with torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=not self.bf16_params):
            loss = self.model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt_s = _timed(self._update, self.device)
        return loss.item(), opt_s  # .item() is a host sync (after the update's own)

    def _update(self) -> None:
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)


class FSDP2Offload:
    """FSDP2 at world size 1 with every parameter, gradient and AdamW state in host memory.

    Args:
        config: a transformers config.
        device: the compute device ("cuda": NCCL and pinned host memory; "cpu": gloo, for tests).
        fused: torch's fused AdamW on the host (falls back to foreach if the kernel refuses DTensors).
    """

    def __init__(self, config, device: torch.device, *, fused: bool = True):
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard

        self.device = device
        cuda = device.type == "cuda"
        _init_process_group("nccl" if cuda else "gloo")
        if cuda:
            torch.cuda.set_device(device)
        model = hf_model(config, device, torch.float32)  # fully_shard moves each shard to the host as it goes
        mesh = init_device_mesh(device.type, (1,))
        kw = dict(mesh=mesh, mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32),
                  offload_policy=CPUOffloadPolicy(pin_memory=cuda))
        for layer in model.model.layers:
            fully_shard(layer, **kw)
        fully_shard(model, **kw)
        self.model = model
        self.num_params = lambda: sum(p.numel() for p in model.parameters())  # DTensors: the global numel
        self.opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.0, fused=fused or None)
        self.settings = dict(compute_dtype="bf16 (MixedPrecisionPolicy)", master="fp32 on the host",
                             recompute="every layer", optimizer=f"torch.optim.AdamW(fused={fused}) on the host",
                             pin_memory=cuda)

    def step(self, ids: torch.Tensor) -> tuple[float, float]:
        loss = self.model(input_ids=ids, labels=ids).loss
        loss.backward()
        try:
            opt_s = _timed(self._update, self.device)
        except RuntimeError as e:  # fused AdamW may refuse DTensor shards on some torch versions
            if "fused" not in str(e).lower() or self.opt.defaults.get("fused") is None:
                raise
            self.opt = torch.optim.AdamW(self.model.parameters(), lr=LR, weight_decay=0.0)
            self.settings["optimizer"] = "torch.optim.AdamW(foreach) on the host (fused refused DTensors)"
            opt_s = _timed(self._update, self.device)
        return loss.item(), opt_s

    def _update(self) -> None:
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)


def zero3_config(batch: int, *, ratio: float | None, sub_group_size: int) -> dict:
    """DeepSpeed's config: ZeRO-3, parameters and optimizer on the host, bf16, AdamW.

    >>> c = zero3_config(4, ratio=0.3, sub_group_size=100_000_000)["zero_optimization"]
    >>> c["offload_param"]["device"], c["offload_optimizer"]["ratio"]
    ('cpu', 0.3)
    """
    offload_opt = {"device": "cpu", "pin_memory": True}
    if ratio is not None:
        offload_opt["ratio"] = ratio  # share of the optimizer states on the host; the rest is updated on the GPU
    return {
        "train_micro_batch_size_per_gpu": batch,
        "gradient_accumulation_steps": 1,
        "bf16": {"enabled": True},
        "optimizer": {"type": "AdamW", "params": {"lr": LR, "betas": [0.9, 0.999], "eps": 1e-8, "weight_decay": 0.0}},
        "zero_optimization": {"stage": 3, "offload_param": {"device": "cpu", "pin_memory": True},
                              "offload_optimizer": offload_opt, "sub_group_size": sub_group_size},
        "steps_per_print": 1 << 30,
        "wall_clock_breakdown": False,
    }


class ZeRO3Offload:
    """DeepSpeed ZeRO-3 at world size 1, parameters and optimizer offloaded to the host.

    Args:
        config: a transformers config.
        device: the compute device.
        batch: sequences per step (DeepSpeed's micro-batch size; bookkeeping only).
        ratio: None for the whole optimizer on the host; else the share of it there (Twin-Flow).
        sub_group_size: elements per optimizer sub-group: the unit that Twin-Flow places on host or GPU.

    Raises:
        Unsupported: deepspeed is not importable here.
    """

    def __init__(self, config, device: torch.device, *, batch: int, ratio: float | None = None,
                 sub_group_size: int = 100_000_000):
        try:
            import deepspeed
        except ImportError as e:
            raise Unsupported(f"deepspeed is not installed here ({e}); install the wheels in .whl/ "
                              "(see bench/peers.py's docstring)") from e
        self.device = device
        cuda = device.type == "cuda"
        _init_process_group("nccl" if cuda else "gloo")
        if cuda:
            torch.cuda.set_device(device)
        model = hf_model(config, device, torch.float32)  # initialize() partitions it and moves the shards out
        cfg = zero3_config(batch, ratio=ratio, sub_group_size=sub_group_size)
        self.engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=cfg)
        self.num_params = lambda: sum(getattr(p, "ds_numel", p.numel()) for p in model.parameters())  # partitioned
        zero = self.engine.optimizer
        inner = getattr(zero, "optimizer", zero)
        self.settings = dict(zero_stage=3, offload_param="cpu", offload_optimizer="cpu", ratio=ratio,
                             host_share_of_optimizer=_host_share(zero),
                             sub_group_size=sub_group_size, recompute="every layer", bf16=True,
                             optimizer=type(inner).__name__, deepspeed=deepspeed.__version__)

    def step(self, ids: torch.Tensor) -> tuple[float, float]:
        loss = self.engine(input_ids=ids, labels=ids).loss
        self.engine.backward(loss)
        opt_s = _timed(self.engine.step, self.device)
        return loss.item(), opt_s


def _host_share(zero) -> float | None:
    """Share of the optimizer's elements that DeepSpeed placed on the host (Twin-Flow splits by sub-group)."""
    where = getattr(zero, "subgroup_to_device", None)
    numel = getattr(zero, "fp16_partitioned_groups_flat_numel", None)
    if not where or not numel:
        return None
    return round(sum(n for i, n in enumerate(numel) if where.get(i) == "cpu") / sum(numel), 3)


def _search_done(session) -> bool:
    """placement "auto" has chosen (always true for other placements and older sessions)."""
    du = getattr(session.engine, "device_updates", None)
    return getattr(du, "settled", True)


class Megatrain:
    """megatrain_nb's Session with default settings, and `placement` when given.

    Raises:
        Unsupported: the installed Session does not take ``placement`` (or not this value).
    """

    def __init__(self, config, device: torch.device, *, placement: str | None = None, **settings):
        from megatrain_nb import Session

        kw = dict(settings, **({} if placement is None else {"placement": placement}))
        try:
            self.session = Session.from_config(config, seed=0, device=str(device), lr=LR, **kw)
        except TypeError as e:
            if "placement" in str(e):
                raise Unsupported(f"this megatrain_nb's Session does not accept placement=: {e}") from e
            raise
        self.num_params = self.session.store.num_params
        self.settings = dict(placement=placement, default_settings=not settings, **settings)
        self._done_steps = 0  # steps begun with the placement search done (``settled``)
        self._raws = []  # the timed steps' raw trace records, resolved in ``extras``

    def before_batch(self) -> None:
        self.session.engine.keep = None  # re-derive the activation policy for this batch size
        self._done_steps, self._raws = 0, []

    def timed(self) -> None:
        """``measure`` timed the last step: keep its raw trace records (reading ``session.trace`` would resolve
        them, a GPU wait, and the engine keeps only the last step's)."""
        raw = self.session.engine.step_records()
        if raw is not None:
            self._raws.append(raw)

    def step(self, ids: torch.Tensor) -> tuple[float, None]:
        self._done_steps = self._done_steps + 1 if _search_done(self.session) else 0
        r = self.session.step({"input_ids": ids})
        return r.loss, None  # the update overlaps the backward: its share comes from the trace

    def settled(self) -> bool:
        """The last step ran the "auto" search's winner, and not as the first step after it moved state."""
        return self._done_steps >= 2

    def extras(self, step_s: float) -> dict:
        """The last step's trace: optimizer time (host + device AdamW), its exposed part (compute waiting on
        the host AdamW, plus device AdamW, which runs on the compute stream), compute busy share, waits."""
        from megatrain_nb.view.trace import summarize

        tr = self.session.trace
        if tr is None or not len(tr.spans):
            return {}
        df = tr.to_dataframe()  # resolving the trace here, after the timed steps, keeps it out of them
        sm = summarize(df)
        busy = busy_shares(self.session.engine.rec, self._raws, sm)  # every timed step's; the last: the trace just read
        host_s = float(df[df.lane == "host-adam"].dur_ms.sum()) / 1e3  # overlaps the backward
        rate = host_adam_rate(df)
        dev_s = float(df[df.lane == "device-adam"].dur_ms.sum()) / 1e3  # resident units: on the compute stream
        exposed_s = sm["wait_ms_by_cause"].get("optimizer", 0.0) / 1e3 + dev_s
        extra = {}
        try:  # the placement= era: which units the step kept resident on the device
            pl = self.session.placement
            extra = dict(resident_units=int((pl.placement == "resident").sum()), units=len(pl),
                         device_resident_gib=round(float(pl.device_GiB.sum()), 2))
        except AttributeError:
            pass
        return dict(extra, optimizer_s=round(host_s + dev_s, 4), optimizer_share=round((host_s + dev_s) / step_s, 3),
                    optimizer_exposed_s=round(exposed_s, 4), host_adam_s=round(host_s, 4),
                    device_adam_s=round(dev_s, 4), compute_busy_share=round(sm["compute_busy_share"], 3),
                    compute_busy_all=[round(b, 3) for b in busy], compute_busy_median=round(statistics.median(busy), 3),
                    waits_ms={k: round(v, 1) for k, v in sm["wait_ms_by_cause"].items()},
                    host_adam_G_params_per_s=None if rate is None else round(rate, 2),
                    recomputed_layers=self.session.history[-1].recomputed_layers)

    def close(self) -> None:
        self.session.close()


# ---- one process: build one system, measure its batches, print a row each ---------------------------
def token_ids(step: int, batch: int, seq: int, vocab: int):
    """The token ids of step `step`: identical for every system at the same batch and sequence length."""
    g = torch.Generator().manual_seed(1000 + step)
    return torch.randint(0, vocab, (batch, seq), generator=g)


def _rss(peak: bool = False) -> int:
    if peak:
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux; the process's peak so far
    with open("/proc/self/status") as f:
        return next(int(ln.split()[1]) * 1024 for ln in f if ln.startswith("VmRSS:"))


def _build(spec: dict, config, device):
    name, batch = spec["system"], spec["batches"][0]
    if name in ("native", "native-bf16"):
        return Native(config, device, bf16_params=name == "native-bf16")
    if name == "fsdp2-offload":
        return FSDP2Offload(config, device)
    if name in ("zero3-offload", "zero3-twinflow"):
        ratio = spec["twinflow_ratio"] if name == "zero3-twinflow" else None
        return ZeRO3Offload(config, device, batch=batch, ratio=ratio, sub_group_size=spec["sub_group_size"])
    if name == "megatrain-recompute":  # the depth sweep's fixed settings
        return Megatrain(config, device, placement="auto", checkpoint_every=1)
    if name == "megatrain-host-recompute":  # ... with device memory flat in depth: block inputs wait on the host
        return Megatrain(config, device, placement="host", checkpoint_every=1, offload_checkpoints=True)
    if name.startswith("megatrain"):
        return Megatrain(config, device, placement=name.split("-", 1)[1] if "-" in name else None)
    raise ValueError(f"unknown system {name!r}")


def _failure(e: BaseException) -> tuple[str, str]:
    msg = f"{type(e).__name__}: {e}"
    if isinstance(e, Unsupported):
        return "unsupported", msg[:600]
    if type(e).__name__ == "PreflightError":  # megatrain_nb refused before allocating: says what does not fit
        return "refused", msg[:600]
    if isinstance(e, MemoryError):
        return "host-oom", msg[:600]
    if "out of memory" in msg.lower():
        return "oom", msg[:600]
    return "error", (msg + " | " + " / ".join(traceback.format_exc().strip().splitlines()[-4:]))[:1200]


def _fault(spec: dict, where: str, batch: int = 0) -> None:
    """Test hook: PEERS_FAULT="system:crash,system:hang,system:oom@B" fails that system's child on purpose
    (crash and hang before it builds; oom at batches >= B), so tests can check the rows a failure leaves."""
    for item in filter(None, os.environ.get("PEERS_FAULT", "").split(",")):
        name, kind = item.split(":")
        if name != spec["system"]:
            continue
        if where == "build" and kind == "crash":
            os._exit(7)
        if where == "build" and kind == "hang":
            time.sleep(3600)
        if where == "step" and kind.startswith("oom@") and batch >= int(kind[4:]):
            raise torch.OutOfMemoryError("CUDA out of memory (PEERS_FAULT test hook)")


def child_main(spec: dict) -> int:
    """Builds one system and measures each batch of `spec`; stops after the first batch that fails."""
    from shapes import count_params, qwen_config

    device = torch.device(spec["device"])
    if device.type == "cuda" and device.index is None:  # torch.cuda.set_device and FSDP2's mesh want an index
        device = torch.device("cuda", torch.cuda.current_device())
    cfg = qwen_config(spec["shape"], layers=spec["layers"], seq=spec["seq"], width=spec["width"])
    base = dict(system=spec["system"], sweep=spec["sweep"], shape=spec["shape"], layers=cfg.num_hidden_layers,
                hidden=cfg.hidden_size, params=count_params(cfg), width=spec["width"], seq=spec["seq"],
                device=str(device),
                gpu=torch.cuda.get_device_name(0) if device.type == "cuda" else "cpu", torch=torch.__version__,
                date=time.strftime("%Y-%m-%d"))

    def out(row: dict) -> None:
        print(ROW_MARK + json.dumps(dict({k: None for k in ROW_KEYS}, **row)), flush=True)

    t0 = time.perf_counter()
    _fault(spec, "build")
    try:
        system = _build(spec, cfg, device)
    except Exception as e:  # noqa: BLE001 - any failure becomes this job's row
        status, err = _failure(e)
        out(dict(base, batch=spec["batches"][0], status=status, error=err, phase="init",
                 host_rss_peak_gib=round(_rss(True) / 2**30, 1)))
        return 0
    init_s = time.perf_counter() - t0
    params = system.num_params()  # what the system holds; equals count_params(cfg) (tests/test_peers.py)
    for b in spec["batches"]:
        row = dict(base, batch=b, tokens=b * spec["seq"], params=params, init_s=round(init_s, 1),
                   settings=system.settings)
        try:
            _fault(spec, "step", b)
            row.update(measure(system, b, spec, cfg.vocab_size, device, params))
        except Exception as e:  # noqa: BLE001
            status, err = _failure(e)
            row.update(status=status, error=err, phase="step", host_rss_peak_gib=round(_rss(True) / 2**30, 1))
        out(row)
        if row["status"] != "ok":
            return 0  # the parent decides about the batches left (a fresh process, or rows saying why not)
    if hasattr(system, "close"):
        system.close()
    return 0


def measure(system, batch: int, spec: dict, vocab: int, device, params: int) -> dict:
    """Warm-up and timed steps of one batch size; the row's measured fields."""
    if hasattr(system, "before_batch"):
        system.before_batch()
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    times, opts, losses = [], [], []
    # placement "auto" (megatrain_nb's default) settles by its third step: a measuring step, then, where the planner
    # picks a candidate with more residents, its gated first step (placement.Search): timed steps begin after that
    # (``settled``); "stream" sizes its streamed share from its first step's host AdamW
    warmup = spec["warmup"] + {"megatrain-stream": 1}.get(spec["system"], 0)
    settled = getattr(system, "settled", lambda: True)
    k = 0
    while len(times) < spec["steps"] and k < warmup + spec["steps"] + 10:
        ids = token_ids(k, batch, spec["seq"], vocab).to(device)
        sync(device)
        t0 = time.perf_counter()
        loss, opt_s = system.step(ids)
        sync(device)
        dt = time.perf_counter() - t0
        losses.append(loss)
        print(f"{spec['system']} batch {batch} step {k}: {dt:.3f}s loss {loss:.4f}", file=sys.stderr, flush=True)
        if k >= warmup and settled():
            times.append(dt)
            opts.append(opt_s)
            getattr(system, "timed", lambda: None)()
        k += 1
    warmup = k - len(times)
    t = statistics.median(times)
    tokens = batch * spec["seq"]
    row = dict(status="ok", warmup=warmup, step_s=round(t, 4), step_s_all=[round(x, 4) for x in times],
               model_tflops=float(f"{6 * params * tokens / t / 1e12:.4g}"), tokens_per_s=round(tokens / t, 1),
               loss_first=round(losses[0], 4), loss_last=round(losses[-1], 4),
               peak_gpu_gib=round(torch.cuda.max_memory_allocated() / 2**30, 2) if cuda else None,
               peak_gpu_reserved_gib=round(torch.cuda.max_memory_reserved() / 2**30, 2) if cuda else None,
               host_rss_gib=round(_rss() / 2**30, 1), host_rss_peak_gib=round(_rss(True) / 2**30, 1))
    if all(o is not None for o in opts):
        o = statistics.median(opts)
        row.update(optimizer_s=round(o, 4), optimizer_share=round(o / t, 3), optimizer_exposed_s=round(o, 4))
    if hasattr(system, "extras"):
        row.update(system.extras(t))
    return row
