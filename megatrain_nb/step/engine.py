"""Runs one training step through the device: the driver of compute and of every dependency.

Owns: the device buffers (weight slots, grad slots, head slot), the order of a step's phases, the compute (prelude, forward with kept or checkpointed activations,
recompute and backward) and the recovery of a failed step. It calls, each at a named point:
``head.py`` (the head slot's load; the chunked loss between the forward and the backward),
``embedding.py`` (the rows a step gathers first; the embedding's backward, its last op),
``memory.py`` (the activation policy from free memory; the memory counters after each layer op),
``slot_plan.py`` (a plan's loads into the weight slots, each op's wait for its slot and its release),
``between_steps.py`` (forward-only passes through the same loads: ``stream_layers``, ``weights_copy``) and
``recovery.py`` (what a failed step leaves, put back).
Weights in and gradients out are ``transfers.py``'s (its streams, threads and staging); together
these modules hold every stream, event and wait. Over 400 lines because each cross-stream wait of
the compute side reads best next to the work it orders.

Three streams (CUDA; on "cpu" they are the calling thread and copies are synchronous):
  compute  — prelude, layer forward / recompute / backward, loss chunks;
  h2d      — weights in: a host *packer* thread casts fp32 master slabs into pinned chunks and
             enqueues their copies into a device weight slot;
  d2h      — gradients out: a host *unpacker* thread enqueues the copy of a grad slot into pinned
             chunks and moves them into the host grad slab, then tells the Adam worker.
Placement adds two (device_updates.py): optim (AdamW on the device) and d2h_state (a "device" unit's
state back to the host, with a *writer* thread of its own: Note: [State write-backs] in transfers.py).
Every dependency is an event: the compute stream waits for a slot's "loaded" event; a load waits
(on the h2d stream) for the "released" event of the slot's previous layer; a grad slot is reused
only after its "copied out" event. The CPU waits only in worker threads, and in the driver at the
named points: ``_ready`` (a load's copies were enqueued), the grad-slot reuse in ``_backward`` (a
grad copy was enqueued) and the end of the step (the loss and the trace are read).
"""
from __future__ import annotations

import atexit
import contextlib
import functools
import gc
import math
import threading
import time
import weakref

import torch

from .attncache import AttentionCache
from ..model.binding import Layout, SlotRefs, call, grads_into
from ..config import EngineConfig, OptimConfig
from ..host.host_store import HostStore
from ..model.hf import Architecture
from ..host.hostmem import HostRss
from .device_updates import DeviceUpdates
from .early_rows import EarlyRows
from ..host.optim import HostAdamW, grad_norm
from ..host import state_check
from . import distributed
from ..machine import placement as placing
from ..machine.budget import host_spare
from .schedule import Op, backward_ops, forward_ops, make_blocks
from ..machine.longcontext import Checkpoints
from .tiling import SequenceTiling
from ..view.trace import add_occupancy
from . import between_steps, embedding, head, lean, memory, passes, recovery, slot_plan, warmup
from .transfers import Offload, Streams, Transfers
from .workers import AdamWorker, Box


_LIVE: "weakref.WeakSet[Engine]" = weakref.WeakSet()


@atexit.register
def _close_all() -> None:
    """At interpreter exit, finish pending updates and stop workers (a script may never call close)."""
    for engine in list(_LIVE):
        engine.close()


class Engine:
    """Streams a model's layers through the device for forward, loss and backward; host Adam overlaps."""

    def __init__(self, arch: Architecture, store: HostStore, optim: HostAdamW, ecfg: EngineConfig,
                 ocfg: OptimConfig, recorder):
        self.arch, self.store, self.optim, self.cfg, self.ocfg, self.rec = arch, store, optim, ecfg, ocfg, recorder
        self.dev = dev = Streams(torch.device(ecfg.device))
        self.dtype = ecfg.dtype
        L = self.L = arch.num_layers
        self.abort = threading.Event()
        n_layer = max(store.units[i].layout.numel for i in range(L))
        head_params = arch.head_params() + ([(arch.embed_name, arch.embed.weight.shape)] if arch.tied else [])
        self.head_layout = Layout.build(head_params)  # the head unit, then the tied embedding
        mk = lambda n: torch.empty(n, dtype=self.dtype, device=dev.device)  # noqa: E731
        self.slots = [mk(n_layer) for _ in range(ecfg.weight_slots)]
        self.gslots = [mk(n_layer) for _ in range(2)]
        self.head_slot, self.head_gslot = mk(self.head_layout.numel), mk(self.head_layout.numel)
        self.slot_layer: list[int | None] = [None] * len(self.slots)  # driver's view of what each slot holds
        self.slot_current = [False] * len(self.slots)  # it holds its layer's current weights (Note: [Held weights])
        self.head_current = False  # the head slot holds the streamed head group's current weights (placement.py)
        self.refs = SlotRefs(self.slots, self)
        self.norm_dev = torch.zeros(L + 2, dtype=torch.float32, device=dev.device)  # per-unit grad norms
        self.slot_box = [Box(ready=True) for _ in self.slots]  # event of each slot's latest use
        self.head_box, self.head_gbox = Box(ready=True), Box(ready=True)  # head slot / head grad slot free
        self.gslot_box = [Box(ready=True) for _ in self.gslots]
        self.adam = AdamWorker(store.order, self._update, self.abort, shared=store.shared)  # shared_store.py
        self.early = EarlyRows(arch.embed.weight.shape[1], self.adam)  # the next forward's rows first (Note: [Early rows])
        self.adam.early = functools.partial(embedding.early_rows, self)  # embedding.py
        self.adam.noop = lambda u: u in self.dev_opt.of or u in self.dev_opt.streamed  # _update skips them
        self.adam.guard = self._state_ok  # Note: [Non-finite state] in state_check.py
        self.checked = state_check.Checked()  # Note: [Checked state]: units read again only once written
        if store.ring is not None:  # Note: [Gradient ring] in grad_ring.py: a buffer is free once its update read it
            self.adam.consumed = store.ring.release
        self.io = Transfers(dev, store, ecfg, recorder, self.adam, self.norm_dev, self.abort)
        self.dp = distributed.attach(dev)  # several ranks: Note: [Data parallel] in distributed.py; else None
        self.device_updates = DeviceUpdates(arch=arch, store=store, host_optim=optim, ocfg=ocfg, ecfg=ecfg, dev=dev,
                                            io=self.io, rec=recorder, norm_dev=self.norm_dev, adam=self.adam,
                                            dtype=self.dtype, dp=self.dp)  # placement: state on the device, its updates
        self.dev_opt = self.device_updates.opt  # resident units' buffers, read by the compute below
        self.offload = Offload(dev, recorder)  # holds nothing until a block input is parked
        self.lean = bool(ecfg.lean_activations)  # None (auto): decided per batch size (_place_checkpoints)
        self.lean_reason = "lean_activations=" + repr(ecfg.lean_activations)
        lean.prepare(arch, self.lean)  # the templates' norms and MLP keep less (lean.py), then tiling wraps
        self.tiler = SequenceTiling(arch, tile_tokens=ecfg.tile_tokens, attention_backend=ecfg.attention_backend,
                                    device=dev.device, dtype_bytes=self.dtype.itemsize,
                                    lean=ecfg.lean_activations is True,  # auto: tiling's threshold without lean
                                    device_memory=ecfg.device_memory)
        self.ckpts = Checkpoints(L, checkpoint_every=ecfg.checkpoint_every,  # block length, parked inputs, cached
                                 offload_checkpoints=ecfg.offload_checkpoints, activation_budget=ecfg.activation_budget,
                                 attention_cache=ecfg.attention_cache)
        self.attn_cache = AttentionCache()  # recomputed layers' attention outputs, forward to backward
        self._dE_need = 0  # host bytes of the pinned embedding-grad buffer this batch needs
        self.steps_done = 0
        self._gated = False  # this step's updates wait for every gradient (see _step)
        self.pass_ = passes.ONE  # the pass running (Note: [Passes] in passes.py)
        self.carry = passes.Carry()  # what waits on the device from one pass to the next
        self.keep: list[bool] | None = None  # activation policy, chosen at the first step (again if tokens grow)
        self._keep_tokens = 0  # micro-batch tokens the policy was chosen for
        self.closed = False
        self._dE_host: torch.Tensor | None = None  # (tokens*H,) compute dtype, pinned on CUDA: embedding-row grads
        self._rss = HostRss()  # this process's resident host bytes, read cheaply (memory counters)
        self._pending: tuple | None = None  # last step's raw records and slot uses, until `trace` is read
        self._trace = None
        self._embed_rows: torch.Tensor | None = None  # token ids whose rows the untied embed grad holds
        _LIVE.add(self)

    @property
    def delays(self) -> dict:
        """lane -> deliberate delay (test hook; see Transfers.delay)."""
        return self.io.delays

    @delays.setter
    def delays(self, value: dict) -> None:
        self.io.delays = value

    # ---- SlotRefs' view of residency (driver thread) -------------------------------------
    def layer_in(self, slot: int) -> int:
        return self.slot_layer[slot]

    def slot_of(self, layer: int) -> int:
        return self.slot_layer.index(layer)

    # ---- host side: optimizer ------------------------------------------------------------
    def _update(self, unit: int, lr: float, grad_scale: float) -> None:
        if unit in self.dev_opt.of or unit in self.dev_opt.streamed:
            return  # the device updated it (device_updates.py); streamed units need a pinned master: no shadow
        if not self.store.owns(unit):
            return  # another rank of this machine updates the shared store (Note: [Shared host store])
        self.io.delay("host-adam")
        t0 = time.perf_counter()
        with self.rec.span("host-adam", "adam", unit, "optim", self.store.units[unit].layout.numel * 16):
            self.optim.update(unit, lr, grad_scale)
            self.store.refresh_shadow(unit)  # the next load reads these bytes straight to the device
        self.device_updates.host_updated(unit, time.perf_counter() - t0)  # what "stream" balances PCIe against

    def _host_checked(self, unit: int) -> bool:
        """Whether ``unit``'s state is checked on this rank's host before its update: this rank's host AdamW
        updates it (not the device, another rank of a shared store, nor the device half of a split master)."""
        return not self.adam.noop(unit) and self.store.owns(unit) and unit not in self.store.split

    def _state_ok(self, unit: int) -> bool:
        """Unpacker, as ``unit`` lands: its host state can take its update, on every rank (Note: [State verdicts])."""
        if self.adam.noop(unit):
            return True  # the device updates it: checked there
        ok = not self._host_checked(unit) or self.checked.ok(unit, self.store.units[unit])
        return ok if self.dp is None else self.dp.all_ok(ok, f"unit {unit}'s state verdict")

    def _ready(self, box: Box) -> None:
        """Make the compute stream wait for a load (host waits only until its copies are enqueued)."""
        self.dev.wait(self.dev.compute, box.get())

    def _master(self, unit: int):
        """Source of a unit's weights, read when its copy starts (``HostStore.weights_source``)."""
        return lambda: self.store.weights_source(unit)

    # ---- one step --------------------------------------------------------------------------
    def step(self, mbs: list[dict], n_valid: int, hook=None) -> dict:
        """Forward, loss and backward of one batch (already split into micro-batches).

        Args:
            mbs: micro-batches, each {"input_ids": (b, T) long, "attention_mask": (b, T) or None,
                 "shift_labels": (b, T) long with -100 where unsupervised}; all on the host.
            n_valid: supervised tokens in the whole batch (the loss divides by it).
            hook: a ``hook.LossHook`` (the user's loss over per-token log-probs), or None: cross-entropy.
        Returns:
            {"loss": float, "kept_layers": int, "recomputed_layers": int, "metrics": the hook's, or None, ...}
        """
        self._committed = False  # set once this step's updates may start (see _step)
        try:
            return self._step(mbs, n_valid, hook)
        except torch.OutOfMemoryError:
            self._recover()
            search = self.device_updates.search
            if not search.trial or self._committed:
                raise
            # Note: [Auto search] a trial (C or B) that does not fit: nothing of it was applied (no update
            # starts before the loss is known), so the same batch runs again with the search's best so far,
            # under that candidate's activation policy (a trial that failed in its forward left none, and
            # no policy would start the search over).
            search.abandon()
            self.keep = list(search.keep.get(search.winner) or search.keep["A"])
        except BaseException:
            self._recover()
            raise
        # out of the except clause: the failed trial's traceback is gone; its frames held the activations,
        # and autograd graphs with Python objects in them (custom functions, hooks) wait for a collection
        gc.collect()
        torch.cuda.empty_cache()  # between steps: the failed trial's cached blocks go back
        return self.step(mbs, n_valid, hook)

    def _recover(self) -> None:
        """After a failed step: recovery.py puts back what it left (Note: [Failed steps] in docs/engine.md)."""
        recovery.recover(self)

    def _step(self, mbs: list[dict], n_valid: int, hook) -> dict:
        L, dev, rec, du = self.L, self.dev, self.rec, self.device_updates
        if dev.cuda:
            torch.cuda.set_device(dev.device)  # the driver may be a fresh thread (Session.step)
        if self.dp is not None:
            n_valid = self.dp.begin(mbs, n_valid)  # CPU waits for every rank: the loss divides by the global count
        self.tiler.prepare(mbs)  # refuses a T x T mask before anything is touched; rows per tile; attention kernel
        groups = passes.split(mbs)  # Note: [Passes] in passes.py
        tokens = max(mb["input_ids"].numel() for mb in mbs)  # per micro-batch: what activations scale with
        if self.keep is not None and not self._keep_tokens:
            self._keep_tokens = tokens  # a policy restored by resume: it stands for this batch size
        if self.keep is not None and self.cfg.checkpoint_every is None and tokens > self._keep_tokens:
            self.keep = None  # more tokens than the policy was chosen for: choose again from free memory
        if self.keep is None:
            self._keep_tokens = tokens
            self._place_checkpoints(groups[0])  # Note: [Long-context memory] (longcontext.py)
            du.search = placing.Search()  # the activation policy is chosen again: so is the placement
        self.keep = du.place(self.steps_done, self.keep)  # Note: [Placement] in device_updates.py
        checks = {u: x for u, x in self.store.units.items() if self._host_checked(u)}
        if self.checked.unmarked(checks):  # Note: [Checked ahead] in state_check.py: after a load, a resume, a
            with rec.span("driver", "state-check", -1, "optim"):  # write by hand; traced before the step's origin
                self.checked.ahead(checks)
        if len(groups) > 1:
            passes.check(du, self.dp, self.store.shared is not None)  # before any update of this step begins
        loss_box = Box(self.abort)
        # grad_clip, overlap off or nonfinite="raise": every update waits for every gradient; so does a trial's
        # first step (Note: [Auto search]): until its backward has run, an out-of-memory error in it leaves
        # nothing applied, and the batch runs again as the best candidate so far
        gate = du.gate or du.search.phase in ("C1", "B1")
        self._gated = gate
        if self.store.ring is not None:  # Note: [Gradient ring]: gated steps and passes hold every gradient at once
            self.store.ring.spill = gate or len(groups) > 1
            if self.cfg.grad_ring_overflow:  # Note: [Ring overflow]: room for what the host's AdamW falls behind
                self.store.ring.room(host_spare(self.cfg.host_memory))
        adam_step = self.adam.begin(step=self.steps_done, lr=self.ocfg.lr_at(self.steps_done), gate=gate,
                        clip=self.optim.clip_factor, loss=loss_box)
        du.begin(gate)
        if not gate:
            du.early_state(self.steps_done, self.abort)  # Note: [Early state]: before any load of this step
        self._occ = []  # (kind, index, layer, span key, state at its start, state at its end)
        self.carry = passes.Carry()
        with dev.on(dev.compute), self.tiler.attention():
            rec.begin_step(self.steps_done)
            memory.count(self)
            offset = 0
            for p, pmbs in enumerate(groups):  # Note: [Passes] in passes.py: one update after the last
                self.pass_ = passes.Pass(p, len(groups), offset)
                last = self._pass(pmbs, n_valid, hook, loss_box)
                offset += len(pmbs)
            self.pass_ = passes.ONE
        last.get()  # driver waits: the embedding's gradients landed, so every unit's have that the unpacker took
        du.wait_writes(every=self._gated)  # Note: [Late write-backs]: a gated step's worker needs every landing
        loss = float(loss_box.get())
        with self.adam.cond:  # every unit that goes through the unpacker has landed: its grad norm is known
            norms, bad_state = dict(adam_step["landed"]), sorted(adam_step["bad_state"])
        for u, n in du.streamed_norms().items():  # "device" units (the head group's too) land with their
            norms.setdefault(u, n)  # write-backs, later
        bad = [u for u, n in norms.items() if not math.isfinite(n)]
        if bad:  # Note: [Non-finite state]: which of them are the device's bad state, not gradients
            bad_state = sorted(set(bad_state) | set(du.bad_state(bad)))
        if self.dev_opt.groups and gate and math.isfinite(loss) and not bad:
            du.gated_update(norms, self.ocfg.lr_at(self.steps_done))  # the host's clip factor and verdict
        measured = du.measuring
        du.after_step(keep=self.keep, act_bytes=self._act_bytes, mbs=groups[0])  # the "auto" search's measurements
        if measured:
            du.ahead(self.steps_done + 1, self.keep)  # Note: [Moves ahead] in device_updates.py
        self._pending, self._trace = (rec.take_step(), self._occ), None  # resolved when first read: no GPU wait here
        self.steps_done += 1
        return {"loss": loss, "kept_layers": sum(self.keep), "recomputed_layers": L - sum(self.keep),
                "nonfinite": not math.isfinite(loss) or bool(bad), "nonfinite_units": sorted(bad),
                "nonfinite_state_units": bad_state,
                "grad_norm": math.sqrt(sum(n * n for n in norms.values())),
                "metrics": None if hook is None else hook.metrics()}  # host sync, beside the loss's

    def _pass(self, mbs: list[dict], n_valid: int, hook, loss_box: Box) -> Box:
        """Compute stream: one pass's forward, loss and backward (``self.pass_``, Note: [Passes]); the Box of
        its embedding's landing (ready at once in a pass that is not the last)."""
        L, dev, rec, du, ps = self.L, self.dev, self.rec, self.device_updates, self.pass_
        with rec.span("driver", "prepare", -1, "fwd"):  # the driver's own time before the first layer
            small = self._small_inputs(mbs)  # before any load of this pass is queued
            if hook is not None and ps.first:
                hook.begin(self.dp, dev.device)  # hook.py: global counts (a host sync under data parallel)
            head_box = None  # Note: [Streamed head] in placement.py: its slot is loaded first, or already current
            if du.head_streamed:
                head_box = Box(ready=True) if self.head_current else self._load_head()
            embedding.request_rows(self, mbs, head_box)  # embedding.py: one request for every micro-batch's rows
            embeds = [self._gather(mb, head_box, sm["ids"]) for mb, sm in zip(mbs, small)]
            fops = forward_ops(L)
            fboxes = self._plan(fops, [l if c else None for l, c in zip(self.slot_layer, self.slot_current)])
            if head_box is None:  # after a pass, the slot still holds the head's weights: no update came between
                head_box = self._load_head() if ps.first else Box(ready=True)
            else:
                du.head_state_in(self.steps_done, self.abort)  # its state comes in where its weights would
        state = self._forward(embeds, fops, fboxes, small)
        hL_grads = self._loss(state.pop("hL"), n_valid, head_box, loss_box, small, hook)
        blocks = make_blocks(L, self.keep, self.ckpts.block)
        bops = backward_ops(blocks)
        bboxes = self._plan(bops, list(self.slot_layer))
        last = self._backward(mbs, bops, bboxes, state, hL_grads)
        if not ps.final:  # nothing was updated: every slot still holds its layer's current weights
            self.slot_current = [l is not None for l in self.slot_layer]
            memory.count(self)
            return last
        self.slot_current = [s in bboxes["cast"] for s in range(len(self.slots))]  # the rest: updated since loaded
        self.head_current = du.head_streamed  # its update refilled the head slot
        self._committed = True  # gated: no update starts before every gradient has landed, after this
        du.end_backward()  # the next step's compute follows this step's device updates
        memory.count(self)
        return last

    def _reduced(self, unit: int, g: torch.Tensor, n: int, done):
        """Compute stream: ``unit``'s gradient ``g`` is written (``done``); its first ``n`` elements' norm
        goes to ``norm_dev``. Under data parallel ``g`` is summed over ranks first, on a side stream on CUDA.
        Returns the event after which ``g`` and its norm are final: what copies and updates wait for."""
        if self.dp is not None:
            self.device_updates.check_before_sum(unit, g[:n])  # Note: [State verdicts] in distributed.py
            return self.dp.grads(g, self.norm_dev[unit + 1], n, self.dev.record(self.dev.compute))  # after it
        self.norm_dev[unit + 1].copy_(grad_norm(g[:n]))
        self.device_updates.check_state(unit)  # Note: [Non-finite state]: a resident unit's, before ``done``
        return self.dev.record(self.dev.compute)

    def placement_frame(self):
        """One row per unit: unit, name, placement, params, device_GiB (resident state), reason."""
        return self.device_updates.frame()

    def activation_policy(self) -> dict:
        """What the last step did with its activations (``Session.activations``); empty before a step."""
        return memory.policy(self)

    def step_records(self):
        """The last step's raw trace records while its Trace is unread (else None): ``rec.resolve`` turns
        them into a Trace later, so a caller can keep several steps' without a GPU wait between them."""
        return None if self._pending is None else self._pending[0]

    @property
    def trace(self):
        """The last step's Trace, resolved from its CUDA events on first read (None before a step)."""
        if self._pending is not None:
            raw, occ = self._pending
            self._pending = None
            self._trace = self.rec.resolve(raw)
            if self.rec.enabled:
                add_occupancy(self._trace, occ)  # trace.py: the slots' states at GPU times
        return self._trace

    def _gather(self, mb: dict, head_box: Box | None = None, ids_dev=None) -> tuple[torch.Tensor, Box]:
        return embedding.gather(self, mb, head_box, ids_dev)  # embedding.py: the rows of the forward

    def _plan(self, ops: list[Op], resident: list) -> dict:
        return slot_plan.submit(self, ops, resident)  # slot_plan.py: every load of ``ops``, in order of use

    def _use(self, plan: dict, k: int, op: Op) -> torch.Tensor:
        return slot_plan.use(self, plan, k, op)  # slot_plan.py: the compute stream waits for op k's load

    def _done(self, plan: dict, k: int) -> None:
        slot_plan.done(self, plan, k)  # slot_plan.py: op k's slot is free once the compute stream passes here

    def _load_head(self, dst: torch.Tensor | None = None, after: Box | None = None) -> Box:
        return head.load(self, dst, after)  # head.py

    # ---- forward-only passes (between_steps.py): a step's loads, no gradients ------------------
    def stream_layers(self, *, head: bool):
        """Driver: yield (unit, its weights on the device) for layers 0..L-1, then the head (unit L) if ``head``
        (``between_steps.stream_layers``)."""
        return between_steps.stream_layers(self, head=head)

    def weights_copy(self, unit: int) -> dict:
        """Driver: a device copy of unit ``unit``'s current weights outside the slots (``between_steps.weights_copy``)."""
        return between_steps.weights_copy(self, unit)

    # ---- compute (driver thread, compute stream) -------------------------------------------
    def _template(self, i: int):
        return self.arch.templates[self.arch.template_of[i]]

    def _keep_now(self, i: int) -> bool:
        return memory.keep_now(self, i)  # memory.py: the activation policy

    def _place_checkpoints(self, mbs) -> None:
        memory.place_checkpoints(self, mbs)  # memory.py; Note: [Long-context memory] (longcontext.py)

    def _small_inputs(self, mbs) -> list[dict]:
        """Compute stream: each micro-batch's mask, position kwargs and labels on the device.

        Enqueued at the step's start, before its weight and state loads: a small copy from the host
        that the compute stream reaches later queues behind every copy in on the way then (traced at
        3B x 4 under "stream": the loss took 206 ms where it takes 74, beside 133 ms of state loads).
        The token ids come too where the embedding's rows are gathered on the device (Note: [Streamed
        head] in placement.py).
        """
        dev = self.dev.device
        up = lambda t: t.to(dev, non_blocking=True)  # noqa: E731
        rows_here = self.device_updates.head_streamed and self.arch.tied
        return [{"mask": None if mb["attention_mask"] is None else up(mb["attention_mask"]),
                 "pos": self.arch.position_kwargs(mb.get("position_ids"), dev),  # packed rows: packing.py
                 "labels": up(mb["shift_labels"]), "ids": up(mb["input_ids"]) if rows_here else None} for mb in mbs]

    def _forward(self, embeds, fops, plan, small) -> dict:
        arch, rec, dev = self.arch, self.rec, self.dev
        st = {"E": [], "h0": [], "calls": [], "ckpt": {}, "kept": {}, "ids": []}
        hs = []
        for (E, box), inputs in zip(embeds, small):
            self._ready(box)
            mask, pos = inputs["mask"], inputs["pos"]
            E.requires_grad_()  # (b, T, H): the leaf the embedding's grads land on (Note: [Unique rows])
            with torch.enable_grad(), rec.span("driver", "prelude", -1, "fwd"):
                h0, calls = arch.prelude(arch.embed_rows(E.view(-1, E.shape[-1]), tuple(E.shape[:2])), mask, **pos)
            st["E"].append(E), st["h0"].append(h0), st["calls"].append(calls), st["ids"].append(inputs["ids"])
            hs.append(h0.detach())
        deciding = self.keep is None
        keep = []
        self._act_bytes = 0
        for k, op in enumerate(fops[:-1]):
            i = op.layer
            slot = self._use(plan, k, op)
            layout = self.store.units[i].layout
            before = torch.cuda.memory_allocated(dev.device) if dev.cuda else 0
            kept = self._keep_now(i)
            keep.append(kept)
            x0 = hs[0]  # the op's input, for the warm-up below
            self.io.delay("compute")
            tok = rec.cuda_begin("compute", "fwd", i, "fwd", 0, dev.compute)
            if kept:
                params = layout.views(slot, requires_grad=True)
                xs, outs = [], []
                with self.refs.hooks(slot), torch.enable_grad():
                    for m, calls in enumerate(st["calls"]):
                        x = hs[m].detach().requires_grad_()
                        out = call(self._template(i), params, x, *calls[i][0], **calls[i][1])
                        xs.append(x), outs.append(out)
                        hs[m] = out.detach()
                st["kept"][i] = (params, xs, outs)
                self._act_bytes = (torch.cuda.memory_allocated(dev.device) - before) if dev.cuda else 0
            else:
                run_start = i == 0 or keep[i - 1] or (i - max([j for j in st["ckpt"]] + [-self.ckpts.block])) >= self.ckpts.block
                if run_start:  # Note: block inputs are the only activations a recompute block keeps
                    if memory.parked(self, i, hs):
                        self.offload.park(i, hs)  # to host memory: the device keeps none
                        st["ckpt"][i] = None
                    else:
                        st["ckpt"][i] = list(hs)
                params = layout.views(slot)
                cached = i in self.ckpts.cached  # Note: [Attention cache] in attncache.py
                with torch.no_grad():
                    for m, calls in enumerate(st["calls"]):
                        with self.attn_cache.capture(i, m) if cached else contextlib.nullcontext():
                            hs[m] = call(self._template(i), params, hs[m], *calls[i][0], **calls[i][1])
            rec.cuda_end(tok, dev.compute)
            if warmup.due(self, k, kept):  # Note: [Warm recompute] in warmup.py
                warmup.recompute(self, i, layout.views(slot), x0, st["calls"][0][i])
            self._done(plan, k)
            memory.count(self)
        if deciding:
            self.keep = keep
        st["hL"] = hs
        return st

    def _loss(self, hs, n_valid: int, head_box: Box, loss_box: Box, small, hook=None) -> list[torch.Tensor]:
        return head.loss(self, hs, n_valid, head_box, loss_box, small, hook)  # head.py: the chunked loss, the head's backward

    def _backward(self, mbs, bops, plan, st, gs) -> Box:
        dev, rec, kept, gi = self.dev, self.rec, st["kept"], 0
        pre = {}  # host unit -> event of its earlier passes' gradients copied into its grad slot (Note: [Passes])

        def host_bwd(k: int) -> bool:
            return k < len(bops) and bops[k].kind == "bwd" and bops[k].layer not in self.dev_opt.of

        def grads_in(k: int, slot: int) -> None:  # a host unit's backward at op k: its grad slot gets the earlier
            if self.pass_.first or not host_bwd(k):  # passes' sum on the h2d stream, while op k - 1 computes
                return
            j = bops[k].layer
            pre[j] = passes.preload(self, j, self.gslots[slot][:self.store.units[j].layout.numel],
                                    self.gslot_box[slot].get())

        grads_in(0, gi)
        for k, op in enumerate(bops):
            i = op.layer
            grads_in(k + 1, gi ^ host_bwd(k))  # the slot op k + 1 takes: the other one after a host unit's backward
            if op.kind == "recompute":
                slot = self._use(plan, k, op)
                if i not in st["ckpt"]:
                    hs = [o.detach() for o in kept[i - 1][2]]
                else:
                    hs = st["ckpt"].pop(i)
                    if hs is None:  # parked in host memory
                        hs = self.offload.take(i)
                    ahead = max(st["ckpt"], default=None)  # the next block the backward reaches
                    if ahead is not None and st["ckpt"][ahead] is None:
                        self.offload.fetch(ahead)
                params = self.store.units[i].layout.views(slot, requires_grad=True)
                tok = rec.cuda_begin("compute", "recompute", i, "recompute", 0, dev.compute)
                xs, outs = [], []
                with self.refs.hooks(slot), torch.enable_grad():
                    for m, calls in enumerate(st["calls"]):
                        x = hs[m].detach().requires_grad_()
                        with self.attn_cache.replay(i, m):  # a cached layer: its attention output from the forward
                            outs.append(call(self._template(i), params, x, *calls[i][0], **calls[i][1]))
                        xs.append(x)
                kept[i] = (params, xs, outs)
                rec.cuda_end(tok, dev.compute)
                self._done(plan, k)
            elif op.kind == "bwd":
                self._use(plan, k, op)
                res = self.dev_opt.of.get(i)
                params, xs, outs = kept.pop(i)
                layout = self.store.units[i].layout
                if res is None:
                    self._occ.append(("grad", gi, i, ("compute", "bwd", i, "bwd"), "computing", "ready"))
                    self._occ.append(("grad", gi, i, ("d2h", "d2h", i, "bwd"), "loading", "free"))
                    gbuf = self.gslots[gi]
                    g = gbuf[:layout.numel]
                    dev.wait(dev.compute, self.gslot_box[gi].get())  # driver waits until that slot's copy-out is enqueued
                else:
                    g = gbuf = res.grad  # resident: gradients stay on the device for its AdamW
                self.io.delay("compute")
                tok = rec.cuda_begin("compute", "bwd", i, "bwd", 0, dev.compute)
                if i in pre:  # Note: [Passes]: the earlier passes' sum, in from the host grad slab
                    dev.wait(dev.compute, pre.pop(i))
                elif res is None or self.pass_.first:
                    g.zero_()  # a resident unit's gradients add up in its buffer over the passes
                grads_into(params, gbuf, layout)  # the buffer itself: its views are made once (binding.py)
                for m in range(len(outs)):
                    torch.autograd.backward(outs[m], gs[m])
                    gs[m] = xs[m].grad
                rec.cuda_end(tok, dev.compute)
                if res is not None and not self.pass_.final:  # they wait in its buffer for the final pass
                    memory.count(self)
                    self._done(plan, k)
                    del params, xs, outs
                    continue
                if self.pass_.final:
                    done = self._reduced(i, g, g.numel(), dev.record(dev.compute))  # summed over ranks, its norm
                    self.device_updates.landed(i, self.ocfg.lr_at(self.steps_done), done)
                else:  # Note: [Passes]: an earlier pass's copy-out lands nothing, so it needs no norm
                    done = dev.record(dev.compute)
                memory.count(self)
                held = None  # the weight slot a "device" unit's update refills (Note: [Held weights])
                if res is not None:
                    self.io.grads(i, g, [], done, "bwd")  # only its norm goes to the host (clip, report)
                elif k in plan["state"]:
                    s = plan["slot"][k]
                    held = self.slots[s] if plan["after"][s] == i else None  # it keeps layer i past this plan
                    self.gslot_box[gi] = self.device_updates.stream_update(
                        i, g, done, self.ocfg.lr_at(self.steps_done), *plan["state"][k], step=self.steps_done,
                        weights=held)
                    if held is not None:
                        plan["rel"][k].put(self.gslot_box[gi].get())  # the slot's next load waits for the cast too
                        plan["cast"].add(s)
                    gi ^= 1
                else:
                    segs = self.store.copies_out(i, [(0, layout.numel, self.store.grad_dst(i))])  # shared: the owner's
                    self.gslot_box[gi], landed = self.io.grads(i, g, segs, done, "bwd", land=self.pass_.final)
                    if not self.pass_.final:  # Note: [Passes]: the next pass takes it back in (passes.preload)
                        self.carry.out[i] = (self.gslot_box[gi], landed)
                    gi ^= 1
                if held is None:
                    self._done(plan, k)
                del params, xs, outs
            else:
                return embedding.backward(self, mbs, st, gs)  # embedding.py: its rows' gradients, the last op
        raise AssertionError("backward_ops always ends with embed_bwd")

    # ---- lifecycle ---------------------------------------------------------------------------
    def set_steps_done(self, n: int) -> None:
        """Resume: the store already holds the state after ``n`` steps (call before any step)."""
        self.steps_done = n
        self.adam.set_version(n)

    def settle(self) -> None:
        """Block until every update of every finished step is applied, on the host and on the device."""
        self.device_updates.wait_writes()  # first: a failed write-back raises here, its unit would never land
        self.adam.wait_all(self.steps_done)
        self.device_updates.settle()

    def drain(self) -> None:
        """Block until every update of every finished step is applied to the host masters.

        Resident units' state is written back to the host store (it stays on the device too).
        """
        self.settle()
        self.device_updates.write_back()

    def close(self) -> None:
        """Finish pending updates, then stop the worker threads. Idempotent."""
        if self.closed:
            return
        self.closed = True
        try:
            self.drain()
        finally:
            if self.dp is not None:
                self.dp.saves.leave()  # after the drain: a rank 0 saving alone need not wait for this rank
            self.abort.set()
            self.io.close(), self.adam.close(), self.device_updates.late.close()

