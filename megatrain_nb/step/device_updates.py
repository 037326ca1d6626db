"""The device side of placement: state that lives on or passes through the device, and its updates.

Owns: applying ``placement.choose`` between steps (moving resident groups in and out, the state slots
of "device" units), the "auto" search's measurements, each device update's timing — a resident group
as soon as its gradients are complete, beside the backward (Note: [Device updates]), a "device"
unit's update in its streamed-in state (Note: [Streamed updates] in placement.py; the head group's,
Note: [Streamed head]), or every resident unit after the backward when gated — the state slots' loads
(Note: [Early state]) and write-backs (Note: [Late write-backs]), and the per-unit placement table.
Does not own: the order of a step (engine.py calls in at named points: ``place``, ``begin``,
``early_state``, ``loss_known``, ``landed``, ``stream_update``, ``stream_head``, ``end_backward``,
``wait_writes``, ``gated_update``, ``after_step``, ``ahead``), the choice itself (placement.py, pure), the AdamW
arithmetic (``optim.DeviceAdamW``), the copies (transfers.py), arriving groups' moments (late_moments.py).
About 690 lines because resident groups and streamed units share one device AdamW, the step's
non-finite flag, its hooks and its failure path (``recover``); apart, each half would hold a copy. The
planner's choices for "auto" (micro-batch, rows a pass) are autoplan.py's; here only their cached calls. The
split masters' codec is split_master.py's; here only where their planes load, join, split and go back.
"""
from __future__ import annotations

import time

import torch

from ..machine import placement as placing
from ..host import grad_ring, split_master, state_check
from ..host.optim import DeviceAdamW, grad_norm, state_slices
from .late_moments import LateMoments
from ..machine.budget import device_total, host_available, memory_total
from .transfers import PendingLoad
from .workers import Box

SPILL_HOST_MARGIN = 2 << 30
"""Host bytes a step's spill buffers leave free (Note: [Gradient ring]): room for the runtime's own growth."""


class DeviceUpdates:
    """Placement in force for one engine, and every update that runs on the device."""

    def __init__(self, *, arch, store, host_optim, ocfg, ecfg, dev, io, rec, norm_dev, adam, dtype, dp=None):
        self.arch, self.store, self.host_optim, self.ocfg, self.ecfg = arch, store, host_optim, ocfg, ecfg
        self.dev, self.io, self.rec, self.norm_dev, self.adam, self.dtype = dev, io, rec, norm_dev, adam, dtype
        self.L = arch.num_layers
        self.dp = dp  # data parallel (distributed.py): every rank must measure, search and place alike
        self.opt = DeviceAdamW(store, host_optim, ocfg, dev.device, dtype)  # resident / streamed units' state
        self.late = LateMoments(dev, rec, self.opt, io.abort)  # Note: [Late moments]: arriving groups' moments
        self.mode = placing.validate(ecfg.placement, self.L, arch.tied)
        self.gate = ocfg.grad_clip is not None or not ecfg.overlap_optimizer or ecfg.nonfinite == "raise"
        self.choice: dict[int, placing.Choice] | None = None  # unit -> placement in force
        self.search = placing.Search()  # "auto": a measuring step, then the planner's pick (Note: [Auto search])
        self.micro: dict[tuple[int, int], tuple[int, str]] = {}  # "auto": (rows, seq) -> (micro-batch, why)
        self.micro_reason = ""  # the last micro-batch choice's (Note: [Micro-batch choice] in autoplan.py)
        self.passes: dict[tuple[int, int], tuple[int, str]] = {}  # "auto": (rows, seq) -> (rows a pass, why)
        self.pass_reason = ""  # the last pass choice's (Note: [Pass choice] in autoplan.py)
        self.share = 0.0  # "stream": share of the layers placed "device", from the host's AdamW rate (stream_rate)
        self.rated = 0  # "stream": times the share was set from a host AdamW rate (Note: [Stream rate])
        self.adam_rate = (0, 0.0)  # host AdamW since the share was last set: (params, seconds)
        self.sslots: list[torch.Tensor] = []  # "device" units' state (master, moments) on its way through
        self.sslot_box: list[Box] = []  # each state slot's last write-back (copied out)
        self.bad: torch.Tensor | None = None  # 0-dim bool on the device: a non-finite loss or norm so far this step
        self.state_ok: dict[int, torch.Tensor] = {}  # this step's check_state verdicts (Note: [Non-finite state])
        self.verdicts = state_check.Verdicts()  # Note: [Checked state]: computed again only once the state is written
        self.state_bad: torch.Tensor | None = None  # 0-dim bool, optimizer stream only: a streamed unit's state failed
        self.seen: set[int] = set()  # units whose gradients are complete this step
        self.updated = None  # event after this step's last overlapped device update
        self.writes: list[Box] = []  # state write-backs' landings that no step has waited for (Note: [Late write-backs])
        self.norms: dict[int, Box] = {}  # this step's "device" units' grad norms, read apart from their write-backs
        self._early: dict[int, tuple] = {}  # unit -> (state slot, PendingLoad, write-back box) (Note: [Early state])
        self.head_units = (self.L, -1) if arch.tied else (self.L,)  # the head slot's units, in its order
        self.hstate: torch.Tensor | None = None  # the head group's state on its way through (Note: [Streamed head])
        self.hgrad: torch.Tensor | None = None  # a streamed tied embedding's fp32 gradient
        self.hstate_box = Box(ready=True)  # the head group's last write-back (copied out)
        self.hload: Box | None = None  # this step's load of the head group's state
        self.head_written: Box | None = None  # its last write-back's landing (in ``writes`` too until it lands)
        self.t_start = 0.0
        self.split = split_master.enabled(ecfg.split_master, dtype == torch.bfloat16, store.shadow_dtype is not None,
                                          store.shared is not None, store.optimizer_state != "fp32")  # "device" layers' masters as [R | D]
        self.state_rows = 4 if self.split else 3  # a state slot's rows of the largest layer: master, moments, [R | D]
        self.held = ecfg.weight_slots is not None and ecfg.weight_slots >= self.L  # every layer keeps its weight
        # slot: a split layer's R is there when its state comes in, and D alone crosses (Note: [Held weights])

    def agree(self, value: float, op: str) -> float:
        """Under data parallel the min / max over ranks, so that every rank places alike; else ``value``."""
        return value if self.dp is None else self.dp.agree(value, op)

    @property
    def measuring(self) -> bool:
        """This step measures what the activations leave free (Note: [Placement], ``place``)."""
        return self.dev.cuda and self.mode == "auto" and self.search.phase == "measure"

    @property
    def settled(self) -> bool:
        """The placement is final for this batch size: no "auto" search step (measuring or a trial) is left."""
        return not (self.dev.cuda and self.mode == "auto") or self.search.phase == "done"

    @property
    def head_streamed(self) -> bool:
        """The head group (the head, and a tied embedding) is placed "device" (Note: [Streamed head])."""
        return self.L in self.opt.streamed

    def recover(self) -> None:
        """After a failed step (whose write-backs have landed, ``wait_writes``): no state slot waits for a
        write-back that will not come."""
        self.sslot_box = [Box(ready=True) for _ in self.sslots]
        self.hstate_box, self.hload, self.head_written = Box(ready=True), None, None
        self.writes, self.norms, self._early = [], {}, {}
        self.io.clear_early()
        self.late.recover()  # Note: [Late moments]: what did not come in, comes in now

    def wait_writes(self, every: bool = True) -> None:
        """Driver: wait for the state write-backs no step has waited for (the head group's too); raises
        what one raised. ``every=False``: only collect those already landed (their errors surface here).

        Note: [Late write-backs] a "device" unit's master and moments go back to the host after its update
        (lane "d2h-state", 12 bytes a parameter), and the unit lands (the Adam worker hears of it) after
        that. No step waits for it. Traced on the H200 (2026-12-02, 3B x 4 under "stream"), the compute sat idle
        for the last 75-97 ms of each step behind the last three layers' write-backs. What needs the state
        waits instead: the unit's next load from the host (its version, ``Transfers.load``), the state
        slot's next load (the copy's event), ``settle`` (checkpoints, ``close``, a generation), a failed
        step's recovery, and a gated step, whose worker decides on every norm. The step's report and
        non-finite verdict read the units' norms apart, on the unpacker, right after their backward
        (``streamed_norms``); the write-back hands the worker that value. A failed write-back raises at
        the next step's end, or at ``settle``. The head group's write-back was the first to go this way
        (Note: [Streamed head] in placement.py)."""
        for box in self.writes:
            if every or box.done:
                box.get()
        self.writes = [b for b in self.writes if not b.done]

    def streamed_norms(self) -> dict[int, float]:
        """Driver, at the step's end: this step's "device" units' grad norms (for the report and the verdict),
        which their write-backs, later, hand the Adam worker (Note: [Late write-backs])."""
        return {u: box.get() for u, box in self.norms.items()}

    def host_updated(self, unit: int, seconds: float) -> None:
        """The host's AdamW of ``unit`` took ``seconds`` (what "stream" balances PCIe against)."""
        p, s = self.adam_rate
        self.adam_rate = (p + self.store.units[unit].layout.numel, s + seconds)

    # ---- between steps (driver thread) -------------------------------------------------------
    def choose(self, free: int | None) -> dict:
        """``placement.choose`` for this engine; a gated session updates "device" units on the host."""
        numel = {u: unit.layout.numel for u, unit in self.store.units.items()}
        want = placing.choose(numel, mode=self.mode, free_bytes=free, tied=self.arch.tied,
                              dtype_bytes=torch.tensor([], dtype=self.dtype).element_size(), cuda=self.dev.cuda,
                              share=self.share)
        if self.store.shared is not None:  # Note: [Streamed head] other ranks would keep a stale head slot
            want = {u: placing.Choice("host", c.reason + "; a shared host store: the head group updates on the host")
                    if c.placement == "device" and u in self.head_units else c
                    for u, c in want.items()}
        if self.gate:  # Note: [Streamed updates] a gated update waits for every gradient: on the host
            want = {u: placing.Choice("host", c.reason + "; gated (grad_clip, overlap_optimizer=False or nonfinite="
                                      "'raise'): updated on the host") if c.placement == "device" else c
                    for u, c in want.items()}
        return want

    def place(self, steps_done: int, keep):
        """Move state to or from the device where this step's placement differs; returns the activation
        policy the step must use (the search's candidate's, None to decide in the forward, or ``keep``).

        Note: [Placement] under "auto" a step with nothing resident measures the device memory its
        activations leave free (its allocator peak); the next steps make resident, in the order the
        forward needs them, the groups that fit there. When the activation policy is chosen again
        (more tokens), the placement is too: everything goes back to the host for one measuring step.
        Only that step resets the allocator's peak statistics. Then two ways to share the device are
        timed (Note: [Auto search] in placement.py). A checkpoint keeps the winner's bytes, so a resumed
        run places as the first did from its first step (bit-identical results).
        """
        if self.mode == "stream" and self.rated < placing.STREAM_RATE_STEPS and (self.rated == 0 or self.opt.streamed):
            self.stream_rate()
        cand = self.search.candidate
        want = self.choose(None if cand is None else self.search.free[cand])
        if self.search.phase in ("B1", "C1"):
            keep = None  # residency first / the head resident: the activation policy is decided around the residents
        elif cand is not None and self.search.keep.get(cand) is not None:
            keep = list(self.search.keep[cand])
        opt = self.opt
        moving = [g for g in placing.groups(self.L, self.arch.tied)
                  if (want[g[0]].placement == "resident") != (g in opt.groups)]
        streaming = {u for u, c in want.items() if c.placement == "device"}
        split = self.splittable(streaming)
        arriving = not (streaming != set(opt.streamed) or split != self.store.split or any(g in opt.groups for g in moving))
        if moving or streaming != set(opt.streamed) or split != self.store.split:
            self.quiesce(steps_done, host=not arriving)  # device updates and write-backs done before state moves
        self.store.join_units(self.store.split - split)  # Note: [Split master]: a layer leaving "device" is fp32
        if moving or streaming != set(opt.streamed):  # again before its host update or its move reads it
            arrived = []
            try:
                with self.dev.on(self.dev.compute):
                    for g in moving:
                        if g in opt.groups:
                            opt.remove(g)
                    for u in set(opt.streamed) - streaming:
                        opt.stream_remove(u)
                    if self.dev.cuda and (not arriving or self.search.trial):  # Note: [Arrivals]: nothing left the
                        torch.cuda.synchronize(self.dev.device)  # device outside a trial; named sync: what left is
                        torch.cuda.empty_cache()  # copied out; its blocks go back: fewer fragments for the next layout
                    for g in moving:  # Note: [Arrivals]: in forward order, each as soon as its host update is applied
                        if g in opt.groups:
                            continue
                        with self.rec.span("driver", "arrive-wait", g[0], "io"):  # traced before the step's origin
                            for u in g:
                                self.adam.wait_version(u, steps_done)  # host wait: the rest of the host's AdamW runs on
                        nbytes = sum(self._state_bytes(u, moments=False) for u in g)
                        with self.rec.span("driver", "arrive", g[0], "io", nbytes):
                            opt.add(g, upload=self.io.upload, moments=False)  # Note: [Late moments]: in the step
                        arrived.append(g)
                    for u in streaming - set(opt.streamed):
                        opt.stream_add(u)
                    n = max(self.store.units[i].layout.numel for i in range(self.L))
                    layers = streaming - set(self.head_units)
                    k = placing.state_slots(len(layers), 12 * n, memory_total(self.dev.device, self.ecfg.device_memory,
                                                                                       self.ecfg.host_memory))  # as fp32 masters
                    n *= self.state_rows  # get: the [R | D] rows come on top
                    self.sslots = [torch.empty(n, device=self.dev.device) for _ in range(k)]
                    self.sslot_box = [Box(ready=True) for _ in self.sslots]
                    self.hstate = self.hgrad = None  # Note: [Streamed head] its state and gradient buffers
                    if self.L in streaming:
                        nh = sum(self.store.units[u].layout.numel for u in self.head_units)
                        self.hstate = torch.empty(3 * nh, device=self.dev.device)
                        if self.arch.tied:
                            self.hgrad = torch.empty(self.store.units[-1].layout.numel, device=self.dev.device)
                    self.hstate_box, self.hload = Box(ready=True), None
                if self.dev.cuda:
                    with self.rec.span("driver", "arrive-sync", -1, "io"):
                        self.dev.compute.synchronize()  # named sync: the masters are in, and the step's other streams
                        # may write the buffers made here
            finally:  # after the masters (their copies do not share PCIe with the moments'), or where an
                self.late.start(arrived)  # arrival failed: a group in without its moments still gets them
        self.store.split_units(split)  # after a drain, or newly "device" (quiesced above)
        self.choice = want
        return keep

    def ahead(self, steps_done: int, keep) -> None:
        """Driver, at the end of the measuring step, once the search has chosen: ``place`` for the next step
        (``steps_done``: the steps done after this one). The step itself is applied by then, so an error
        here (out of memory, a failed copy) is not its: that step's own ``place`` moves what is still to
        move, and raises there, before anything of it has run (a trial that does not fit falls back to A).

        Note: [Moves ahead] the groups the search makes resident move in at the end of the step that
        measured, not at the start of the next one. Their masters need that step's host AdamW of them
        applied first (Note: [Arrivals]), and under "auto" the measuring step is the one with nothing
        resident: every unit's update runs on the host, and the groups the next forward needs first are
        updated last (the backward lands them last). Traced on the H200 (2026-12-03, 14B x 2 with int4
        moments), the trial step began with 0.90 s of moves: 0.51 s waiting for those updates and 0.37 s
        of masters. That wait is the measuring step's own work, so its step now ends when it is done and
        the masters are in: the next step starts with its placement in force, and runs what every step
        after it runs, its moments coming in during it (Note: [Late moments]). The time to settle is
        unchanged; it is spent in the step that caused it. Measured before and after in one call (H200,
        2026-12-03, docs/benchmarks.md): the worst step after the first 1.83x -> 1.28x the steady one at
        14B x 2 int4, 1.28x -> 1.11-1.13x at 3B x 8; the first three steps 10.52 s -> 10.37 s at 14B.
        """
        try:
            self.place(steps_done, keep)
        except Exception:
            if self.dev.cuda:
                torch.cuda.empty_cache()  # the next step's ``place`` starts from the groups that did arrive

    def _state_bytes(self, u: int, moments: bool = True) -> int:
        """Bytes of unit ``u``'s host state that a move to the device reads: master and (``moments``) moments."""
        unit = self.store.units[u]
        tensors = (unit.master,) + ((unit.exp_avg, unit.exp_avg_sq) if moments else ())
        return sum(t.numel() * t.element_size() for t in tensors)

    def splittable(self, streaming) -> set[int]:
        """The "device" layers whose masters the host holds split (Note: [Split master]); not the head group."""
        if not self.split:
            return set()
        return {u for u in streaming if 0 <= u < self.L and split_master.applies(self.dtype, self.store.units[u].layout.numel)}

    def quiesce(self, steps_done: int, host: bool = True) -> None:
        """Driver, between steps: no write-back, host update (``host``) or device update of a finished step in
        flight.

        Note: [Arrivals] where a placement only makes groups resident, the host's AdamW of the last step goes
        on while they move: ``place`` waits for each group's own update, in the forward's order (the order the
        worker updates in once every gradient has landed), and copies its master in while the next groups
        update; their moments come during the step (Note: [Late moments] in late_moments.py). (Before that,
        the moments, not pinned under "auto", came here too, through the weight staging.)
        On the H200 (2026-12-03, 3B x 8), the step after the measuring step took 3.59 s against 1.60 steady,
        waiting for every update and then copying 25 units' moments from pageable memory (~7 GB/s).
        Where groups only arrive (outside a trial, whose layout is the tightest), the allocator keeps its
        cached blocks: emptied, the first step's activations came back through fresh device allocations
        (traced at 3B x 8: ~100 ms emptying, its embedding's backward 138 ms against 4, its loss 201 against 165).
        """
        self.wait_writes()
        self.late.finish()  # Note: [Late moments]: a group may leave, or its state be read
        if host:
            self.adam.wait_all(steps_done)  # host wait: every host update of finished steps is applied
        if self.dev.cuda:
            torch.cuda.synchronize(self.dev.device)  # named sync: the device's updates and copies are done

    def stream_rate(self) -> None:
        """Placement "stream": the share placed "device", from the host's AdamW rate since it was last set.

        Note: [Stream rate] set after the first step (nothing streamed yet), then after each of the next
        steps that streamed, ``placement.STREAM_RATE_STEPS`` times in all: inside a streamed step the host's
        AdamW runs beside the state's copies, slower. On the H200 (2026-12-02), 3B steps ran it at 1.8-2.0 G
        params/s where the first step's rate had put 20 of 36 layers on the device; from that rate the
        share is 24. A later run set it twice and ended at 21: the first streamed step's rate (2.3 G params/s,
        implied) still counted the first step's own updates, which ran on into it without state copies
        beside them; its trace's rate was 1.79. Hence a third time. The head group's state streams whatever
        the share (Note: [Streamed head]; with a shared host store the group updates on the host instead):
        ``stream_share``'s extras.
        """
        params, seconds = self.adam_rate
        if not self.agree(seconds > 0, "min"):
            return  # no host update has finished yet
        numel = {u: unit.layout.numel for u, unit in self.store.units.items()}
        extras = placing.stream_extras(numel, self.arch.tied, self.store.shared is None,  # the state as the store
                                       sum(self._state_bytes(u) for u in self.head_units))  # holds it: compact, fewer
        big = max(range(self.L), key=numel.__getitem__)
        self.share = self.agree(placing.stream_share(params / seconds, placing.PCIE_IN_STEP_BYTES_PER_S, cached=self.held,
                                                     window=placing.HOST_WINDOW, split=self.split,
                                                     state_bytes=self._state_bytes(big) / numel[big], **extras),
                                "min")
        self.rated += 1
        self.adam_rate = (0, 0.0)

    def after_step(self, *, keep, act_bytes: int, mbs) -> None:
        """Feed the "auto" search: after the measuring step its budgets and the planner's predictions
        (Note: [Auto search]); after a trial's first step, its end; then the winner's first step times."""
        if self.measuring:
            total = device_total(self.dev.device, self.ecfg.device_memory)  # within the budget (Note: [Budgets])
            free = int(self.agree(self.ecfg.keep_share * total - torch.cuda.max_memory_allocated(self.dev.device),
                                  "min"))
            size = torch.tensor([], dtype=self.dtype).element_size()
            all_in = all(c.placement == "resident" for c in self.choose(free).values())
            params, seconds = self.adam_rate
            rate = self.agree(params / seconds if seconds else 3e9, "min")  # 3e9: a guess until measured
            adam_s = self.store.num_params() / rate
            tokens = sum(mb["input_ids"].numel() for mb in mbs)
            elapsed = self.agree(time.perf_counter() - self.t_start, "max")
            numel = {u: unit.layout.numel for u, unit in self.store.units.items()}
            head = placing.head_groups(numel, {u for u, c in self.choose(free).items() if c.placement == "resident"},
                                       dtype_bytes=size, tied=self.arch.tied, adam_params_per_s=rate)
            self.search.measured(free=free, keep=keep, layer_bytes=act_bytes, everything_fits=all_in,
                                 host_bound=placing.host_bound(elapsed, adam_s), head=head,
                                 checkpoint_bytes=tokens * self.arch.embed.weight.shape[1] * size,
                                 adam_rate=rate if seconds else None)
            if self.search.phase == "plan":  # the one point where the planner decides (autoplan.py)
                self.search.planned(self._predictor(mbs, total, rate if seconds else None), self._no_room_for_spill())
            self.io.take_update_wait()
        elif self.search.phase != "done" or self.search.observing:
            self.search.stepped(self.agree(time.perf_counter() - self.t_start, "max"), keep,
                                waited=self.agree(self.io.take_update_wait(), "max"))

    def _no_room_for_spill(self) -> str | None:
        """Why the host cannot hold every unit's gradients at once, or None. With the gradient ring a step that
        needs them all (a gated trial, "auto"'s passes) takes spill buffers (Note: [Gradient ring] in
        ``host/grad_ring.py``); they must fit what the host has free, under ``host_memory`` where set, with
        ``SPILL_HOST_MARGIN`` to spare. Without the ring the slabs hold them already: None."""
        ring = self.store.ring
        if ring is None:
            return None
        need = grad_ring.spill_bytes(ring.numel, torch.tensor([], dtype=self.dtype).element_size())
        room = int(self.agree(host_available(self.ecfg.host_memory), "min"))
        if need + SPILL_HOST_MARGIN <= room:
            return None
        under = f" under host_memory={self.ecfg.host_memory}" if self.ecfg.host_memory is not None else ""
        return (f"every unit's gradients at once take {need / 2**30:.1f} GiB beyond the gradient ring, and the host has "
                f"{room / 2**30:.1f} GiB free{under}")

    def _predictor(self, mbs, device_bytes: int, adam_rate: float | None):
        """``Search.planned``'s predict for this batch (Note: [Auto search]): the planner on a profile
        calibrated with the measured device memory and host AdamW rate, its seconds agreed over ranks; None
        where the planner cannot read the model."""
        from ..machine import autoplan, planner

        try:
            planner.model_shape(self.arch.config)
        except (ValueError, KeyError, TypeError):
            return None
        predict = autoplan.predictor(
            self.arch.config, batch=sum(mb["input_ids"].shape[0] for mb in mbs), seq=mbs[0]["input_ids"].shape[-1],
            hardware=autoplan.calibrated(device_bytes=device_bytes, adam_params_per_s=adam_rate),
            numel={u: unit.layout.numel for u, unit in self.store.units.items()}, tied=self.arch.tied,
            dtype_bytes=torch.tensor([], dtype=self.dtype).element_size(),
            settings=autoplan.plan_settings(self.ecfg, self.ocfg.grad_clip))
        return lambda free: tuple(self.agree(x, "max") for x in predict(free))

    def micro_batch(self, batch: int, seq: int) -> int | None:
        """Rows per micro-batch for a batch of ``batch`` x ``seq``: ``micro_batch_size`` where set; under
        "auto" on CUDA the planner's choice, made once per shape, before its measuring step (Note:
        [Micro-batch choice] in autoplan.py; ``micro_reason`` says why); else None (the whole batch)."""
        if self.ecfg.micro_batch_size is not None or not (self.dev.cuda and self.mode == "auto"):
            return self.ecfg.micro_batch_size
        m, self.micro_reason = self._planned(self.micro, "micro_batch", batch, seq)
        return m

    def pass_rows(self, batch: int, seq: int) -> int | None:
        """Rows per pass for a batch of ``batch`` x ``seq`` under "auto" on CUDA, where neither
        ``pass_batch_size`` nor ``micro_batch_size`` is set: the planner's choice, made once per shape
        (Note: [Pass choice] in autoplan.py; ``pass_reason`` says why); else None (the setting, or one pass)."""
        if (self.ecfg.pass_batch_size is not None or self.ecfg.micro_batch_size is not None
                or not (self.dev.cuda and self.mode == "auto") or self.dp is not None):
            return None
        r, self.pass_reason = self._planned(self.passes, "pass_rows", batch, seq)
        if r < batch:  # passes hold every unit's gradients until the last pass (Note: [Gradient ring])
            no = self._no_room_for_spill()
            if no is not None:
                planned = self.pass_reason.split(",")[0]
                r, self.pass_reason = batch, (f"one pass of {batch} rows: the planner's choice was {planned}, "
                                              f"but passes hold every gradient until the last: {no}")
                self.passes[(batch, seq)] = (r, self.pass_reason)
        return r

    def _planned(self, cache: dict, choice: str, batch: int, seq: int) -> tuple[int, str]:
        """``autoplan``'s ``choice`` ("micro_batch" or "pass_rows") for this shape on this device, made once."""
        if (batch, seq) not in cache:
            from ..machine import autoplan

            total = device_total(self.dev.device, self.ecfg.device_memory)  # within the budget (Note: [Budgets])
            cache[(batch, seq)] = getattr(autoplan, choice)(
                self.arch.config, batch=batch, seq=seq, hardware=autoplan.calibrated(device_bytes=total),
                dtype_bytes=torch.tensor([], dtype=self.dtype).element_size(),
                settings=autoplan.plan_settings(self.ecfg, self.ocfg.grad_clip))
        return cache[(batch, seq)]

    # ---- within a step (driver thread, compute stream) --------------------------------------------
    def begin(self, gate: bool) -> None:
        """A step begins (after ``place``): overlapped updates need the device's non-finite flag."""
        if self.measuring:  # Note: [Placement] this step's allocator peak says what the activations leave free
            torch.cuda.reset_peak_memory_stats(self.dev.device)  # allocator bookkeeping: no sync
        self.t_start = time.perf_counter()
        overlap = bool(self.opt.groups or self.opt.streamed) and not gate  # Note: [Device updates]
        self.bad = torch.zeros((), dtype=torch.bool, device=self.dev.device) if overlap else None
        if overlap and self.opt.streamed:  # Note: [Streamed state check]: made once, never freed, zeroed in order
            if self.state_bad is None:
                self.state_bad = torch.zeros((), dtype=torch.bool, device=self.dev.device)
            with self.dev.on(self.dev.optim):
                self.state_bad.zero_()  # after the last step's streamed updates read it, on their stream
        self.seen, self.updated, self.norms = set(), None, {}
        self.state_ok = {}  # unit -> 0-dim bool on the device: its resident state passed check_state this step

    def loss_known(self, total: torch.Tensor) -> None:
        """Compute stream: the step's loss (0-dim, device); a non-finite one skips every device update."""
        if self.bad is not None:
            torch.logical_or(self.bad, ~torch.isfinite(total), out=self.bad)

    def landed(self, unit: int, lr: float, final=None) -> None:
        """Compute stream: ``unit``'s gradient and norm are complete. A resident group whose units all
        are gets its AdamW now, on the optimizer stream, while the backward goes on.

        Note: [Device updates] without a gate (grad_clip, overlap off, nonfinite="raise") each resident
        group updates as soon as its gradients are complete, on its own stream: it overlaps the rest of
        the backward, and the next step's compute waits for the last one. A non-finite loss, or a
        non-finite norm of any unit whose gradients were complete before, skips it through the fused
        kernel's ``found_inf`` (the host's [Non-finite gradients] rule, decided on the device). With a
        gate the driver updates every resident unit after the backward with the host's clip factor.
        """
        if self.bad is None:
            return
        if self.dp is not None:
            self.dev.wait(self.dev.compute, final)  # the reduced norm (``final``): the verdict and the update follow it
        torch.logical_or(self.bad, ~torch.isfinite(self.norm_dev[unit + 1]), out=self.bad)
        self.seen.add(unit)
        r = self.opt.of.get(unit)
        if r is None or not set(r.units) <= self.seen:
            return
        dev = self.dev
        found = self.bad.float()  # a snapshot: what lands later cannot change this group's verdict
        ready = dev.record(dev.compute)
        with dev.on(dev.optim):
            dev.wait(dev.optim, ready)
            if dev.cuda:
                found.record_stream(dev.optim)  # made on compute, read on optim: keep its memory until then
            self.late.wait(r.units, dev.optim)  # Note: [Late moments]
            if self.opt.streamed and self.dp is None:  # Note: [Streamed state check]: one found before it
                found = torch.maximum(found, self.state_bad.float())
            tok = self.rec.cuda_begin("device-adam", "adam", r.units[0], "optim", r.master.numel() * 16, dev.optim)
            self.opt.update(lr, groups=[r.units], found_inf=found)
            self.rec.cuda_end(tok, dev.optim)
            self.updated = dev.record(dev.optim)

    def stream_update(self, i: int, g: torch.Tensor, done, lr: float, j: int, loaded: Box, written: Box, *,
                      step: int, weights: torch.Tensor | None = None) -> Box:
        """Driver: a "device" unit's AdamW in its streamed-in state, then the state back to the host.

        The optimizer stream waits for the backward (``done``) and the state's copy in; the d2h stream
        copies master and moments back once the update is done, and the unit lands (its norm) for step
        ``step`` after that, so that a later load of it reads the updated master; the step does not wait
        for that (Note: [Late write-backs]). ``weights``: the weight slot that
        keeps this unit into the next step, refilled here from the new master in the compute dtype
        (Note: [Held weights] in placement.py). Returns the grad slot's box: free once the update has
        read the gradients, its value the event after the update (and the refill).
        """
        state = self.sslots[j][:(4 if i in self.store.split else 3) * g.numel()]  # [R | D] last: Note: [Split master]
        checked, updated = self._update_in_state((i,), state, [g], done, loaded, lr, weights)
        self.norms[i] = norm = self.io.read_norm(i, checked)  # for the step's report; the write-back lands with it
        _, landed = self.io.grads(i, state, self._write_segments((i,)), updated, "bwd", op="state-out",
                                  enqueued=written, step=step, host_fn=norm.get)  # fills ``written``: the
        self.writes.append(landed)  # state slot's next load waits for it, as the unit's next load for ``landed``
        return Box(ready=True, value=updated)

    def _update_in_state(self, units: tuple[int, ...], state: torch.Tensor, grads: list, done, loaded: Box, lr: float,
                         weights: torch.Tensor | None):
        """Driver: ``units``' AdamW on the optimizer stream, in their streamed-in ``state``, once the gradients
        (``done``) and the state's load (``loaded``) are there; casts the new master into ``weights`` (a slot
        that keeps them into the next step, Note: [Held weights]), if given. Returns (the event after their
        state check, which wrote its verdict into the last unit's norm; the event after the update)."""
        dev, n = self.dev, sum(self.store.units[u].layout.numel for u in units)
        found = self.bad.float()  # made on compute, read on optim (see landed)
        verdict = dev.record(dev.compute)  # after ``found``: ``done`` was recorded before landed() wrote the verdict
        ev = loaded.get()  # driver waits until the state's copy is enqueued
        with dev.on(dev.optim):
            dev.wait(dev.optim, done)
            dev.wait(dev.optim, verdict)  # the stream waits for the verdict's snapshot (it read stale memory before)
            dev.wait(dev.optim, ev)
            if dev.cuda:
                found.record_stream(dev.optim)
            tok = self.rec.cuda_begin("device-adam", "adam", units[0], "bwd", n * 16, dev.optim)
            split = units[0] in self.store.split  # a layer (never the head group)
            if split:
                self._join_state(units[0], state, weights)
            found = self._check_streamed(units, state, found)  # Note: [Streamed state check]
            checked = dev.record(dev.optim)
            self.opt.update_streamed(units, state, grads, lr, found)
            if weights is not None:
                weights[:n].copy_(state[:n])  # the cast a load would do: the next step loads nothing of them
            if split:  # the new master as [R | D] for its write-back (Note: [Split master])
                split_master.split_into(state[:n], *split_master.planes(state[3 * n:4 * n]), state[2 * n:3 * n])
            self.rec.cuda_end(tok, dev.optim)
            self.updated = updated = dev.record(dev.optim)
        return checked, updated

    def _check_streamed(self, units: tuple[int, ...], state: torch.Tensor, found: torch.Tensor) -> torch.Tensor:
        """Optimizer stream, ``units``' state just in (joined): the update's ``found_inf`` (0-dim fp32) with their
        verdict and every earlier streamed unit's this step; a bad state's NaN goes into the last unit's norm.

        Note: [Streamed state check] a "device" unit's state comes in during the step (Note: [Streamed updates]
        in placement.py), after its gradient's norm has gone into the compute stream's verdict (``bad``), so
        it is checked where it arrives: on the optimizer stream, after its copy (and a split master's join),
        before its update. A failed check skips that update through the kernel's ``found_inf`` (the compact
        kernel's ``ok`` path), and those of the streamed units after it through ``state_bad``, a flag the
        optimizer stream alone reads and writes (and, in one process, the resident groups' updates that
        follow on that stream); the compute stream never waits for a state copy. The unit's norm becomes NaN
        there, and the step's report reads it after the check (``read_norm`` waits for it): the step is
        skipped and the unit named as for a resident unit. Host units that land before the streamed unit's
        write-back keep their updates (Note: [Non-finite gradients]'s overlapped rule). Under data parallel
        the verdict is this rank's own (its norm was summed over ranks before the state came in): the rank
        skips its streamed updates, and reports the unit; the resident groups do not read it, so that ranks
        keep identical resident copies. The head group's verdict is reported under its last unit."""
        segs = state_slices(self.store, units, state)
        ok = None
        for u, p, m, v in segs:
            one = state_check.slabs_ok(self.store.units[u].compact, p, m, v)
            ok = one if ok is None else ok & one
        torch.logical_or(self.state_bad, ~ok, out=self.state_bad)
        norm = self.norm_dev[units[-1] + 1]  # the compute stream read it before ``verdict``: ordered after that
        norm.copy_(torch.where(ok, norm, float("nan")))
        self.state_ok[units[-1]] = ok  # made on this stream; read only after the norm's read-back (bad_state)
        return torch.maximum(found, self.state_bad.float())

    def _join_state(self, i: int, state: torch.Tensor, weights: torch.Tensor | None) -> None:
        """Optimizer stream: a split layer's fp32 master into ``state[:n]`` from the [R | D] planes at
        ``state[3n:4n]``, R the held weights' when only D came in (Note: [Split master])."""
        n = self.store.units[i].layout.numel
        r, d = split_master.planes(state[3 * n:4 * n])
        if self.held:
            if weights is None:
                raise RuntimeError(f"layer {i}: its split master's D came in without its weights held in a slot "
                                   f"(weight_slots={self.ecfg.weight_slots} for {self.L} layers); an engine bug")
            r = weights[:n].view(torch.int16)
        split_master.join_into(state[:n], r, d, state[2 * n:3 * n])

    def state_segments(self, units: tuple[int, ...]) -> list[tuple[int, str, int, int]]:
        """(unit, slab, offset, elements) of a streamed-in state buffer: master, exp_avg, exp_avg_sq, each
        with ``units``' slabs back to back (a layer, or the head group in the head slot's order)."""
        out, off = [], 0
        for attr in ("master", "exp_avg", "exp_avg_sq"):
            for u in units:
                n = getattr(self.store.units[u], attr).numel()  # a compact moment: its words (Note: [Compact slab])
                out.append((u, attr, off, n))
                off += n
        return out

    def _load_segments(self, units) -> list:
        """``Transfers.load``'s segments of the state of ``units``; a split layer's master comes in as D alone
        where its weights are held, else as both planes, behind the moments (Note: [Split master])."""
        out = []
        for u, attr, off, n in self.state_segments(units):
            if attr == "master" and u in self.store.split:
                d_only = self.held
                out.append((u, lambda u=u, d=d_only: self._split_source(u, d), 3 * n + (n // 2 if d_only else 0)))
            else:
                out.append((u, lambda u=u, a=attr: getattr(self.store.units[u], a), off))
        return out

    def _split_source(self, u: int, d_only: bool) -> torch.Tensor:
        """A split master's bytes to load: (n/2,) fp32 view of its D plane, or (n,) both planes."""
        master = self.store.units[u].master
        return split_master.planes(master)[1].view(torch.float32) if d_only else master

    def _write_segments(self, units) -> list:
        """``Transfers.grads``' segments of the state of ``units``, back into the host slabs (a split
        layer's master from its [R | D] planes)."""
        return [(3 * n if attr == "master" and u in self.store.split else off, n, getattr(self.store.units[u], attr))
                for u, attr, off, n in self.state_segments(units)]

    def state_loads(self, ops, steps_done: int, abort) -> list:
        """(op index, submit) for each "device" unit's backward: its state's load into a free state slot.

        ``submit()`` enqueues the load on the packer and returns (state slot, load box, write-back box);
        the engine calls it in packer order, right after that op's weight load.
        """
        out = []
        for k, op in enumerate(ops):
            if op.kind != "bwd" or op.layer not in self.opt.streamed or not self.store.owns(op.layer):
                continue  # a shared store's other rank updates (and writes back) what it owns

            def submit(i=op.layer):
                j = self._next_slot()
                early = self._early.pop(i, None)  # registered at the step's start (Note: [Early state])
                assert early is None or early[0] == j, (i, early, j)  # the same slot in the same turn
                load, written = early[1:] if early else self._state_load(i, j, steps_done, abort)
                return j, self.io.queue(load), written

            out.append((k, submit))
        self._slot_turn = 0
        return out

    def _state_load(self, i: int, j: int, steps_done: int, abort) -> tuple:
        """Unit ``i``'s state load into state slot ``j`` after the slot's last write-back, and the box of
        its own write-back (stream_update fills it), which the slot's next load waits for."""
        load = PendingLoad(i, self.sslots[j], self._load_segments((i,)), self.sslot_box[j], "bwd", steps_done,
                           "state-in")
        self.sslot_box[j] = written = Box(abort)
        return load, written

    def early_state(self, steps_done: int, abort) -> None:
        """Driver, at a step's start: the backward's first state loads, one per state slot, registered as
        early loads (Note: [Early state]); ``state_loads`` queues each in its place as ever.

        Note: [Early state] at small batches the step is bound by PCIe in, and with no step waiting for the
        write-backs (Note: [Late write-backs]) the next one starts before the host has updated the first
        layer its forward loads: traced on the H200 (2026-12-02, two runs at 3B x 1 under "stream") the h2d stream
        sat idle for the first 32-46 ms while the packer waited for that update, with the backward's state
        loads queued behind it. The packer now starts those state loads while it waits, one copy at a
        time, so that a load in order that becomes ready waits behind one copy at most; each needs no wait
        of its own (its slot's last write-back copied out, its unit's last landing). Slots and boxes are
        those ``state_loads`` would give, in the backward's order of "device" layers. Not measured yet."""
        self._early = {}
        if not self.sslots:
            return
        units = sorted((u for u in self.opt.streamed if 0 <= u < self.L and self.store.owns(u)), reverse=True)
        for j, i in enumerate(units[:len(self.sslots)]):  # turn j: state slot j
            load, written = self._state_load(i, j, steps_done, abort)
            self.io.allow_early(load)
            self._early[i] = (j, load, written)

    def head_state_in(self, steps_done: int, abort) -> None:
        """Driver: queue the head group's state load (master, moments; Note: [Streamed head]) on the packer,
        where a "host" head's weights would load: after the forward's, before the backward's."""
        self.hload = self.io.load(self.L, self.hstate, self._load_segments(self.head_units), self.hstate_box, "loss",
                                  steps_done, op="state-in")
        self.hstate_box = Box(abort)  # filled by this step's write-back (stream_head)

    def stream_head(self, g: torch.Tensor, done, lr: float, weights: torch.Tensor, step: int) -> Box:
        """Driver: the head group's AdamW in its streamed-in state once its gradients are complete (``done``):
        the head's in ``g`` (its head grad slot, compute dtype), a tied embedding's in ``hgrad`` (fp32).
        The new master is cast into the head slot (``weights``), which keeps it into the next step; then
        master and moments go back to the host, and the group's last unit lands for step ``step``: the
        step does not wait for that (Note: [Streamed head]); the next one's state load, any load of
        the group from the host and ``settle`` do. Returns the head grad slot's box: free once the
        update has read it."""
        units = self.head_units
        n_head = self.store.units[self.L].layout.numel
        grads = [g[:n_head]] + ([self.hgrad] if self.arch.tied else [])  # the head's share; the embedding's, fp32
        checked, updated = self._update_in_state(units, self.hstate, grads, done, self.hload, lr, weights)
        self.norms[units[-1]] = norm = self.io.read_norm(units[-1], checked)  # for the step's report, as a layer's
        _, self.head_written = self.io.grads(units[-1], self.hstate, self._write_segments(units), updated, "bwd",
                                             op="state-out", enqueued=self.hstate_box, step=step,
                                             host_fn=norm.get)  # the next state load waits for it
        self.writes.append(self.head_written)
        return Box(ready=True, value=updated)

    def _next_slot(self) -> int:
        j = self._slot_turn % len(self.sslots)
        self._slot_turn += 1
        return j

    def embed_rows(self, ids: torch.Tensor, head_slot: torch.Tensor | None = None) -> torch.Tensor:
        """Compute stream: the rows of a resident embedding for ``ids`` (B, T) -> (B, T, H), compute dtype;
        or, given the head slot, of a streamed tied one, which the slot holds (Note: [Streamed head])."""
        H = self.arch.embed.weight.shape[1]
        if head_slot is not None:
            w, a = head_slot, self.store.units[self.L].layout.numel
            b = a + self.store.units[-1].layout.numel
        else:
            r = self.opt.of[-1]
            w, (a, b) = r.w, r.seg(-1)
        rows = w[a:b].view(-1, H).index_select(0, ids.flatten().to(self.dev.device, non_blocking=True))
        return rows.view(*ids.shape, H)

    def embed_grads(self, ids: torch.Tensor, dE: torch.Tensor, head_grad: torch.Tensor | None = None) -> None:
        """Compute stream: the embedding's fp32 gradient from its rows (and the head's, when tied), for a
        resident embedding; or, given ``head_grad`` (the head grad slot), for a streamed tied one (``hgrad``)."""
        H = self.arch.embed.weight.shape[1]
        if head_grad is not None:
            egrad = self.hgrad
            egrad.copy_(head_grad[self.store.units[self.L].layout.numel:])  # the lm_head's share, upcast
        else:
            r = self.opt.of[-1]
            egrad = r.egrad
            if self.arch.tied:
                a, b = r.seg(-1)
                egrad.copy_(r.grad[a:b])  # the lm_head's gradient of the shared weight, upcast as the host does
            else:
                egrad.zero_()
        ids = ids.to(self.dev.device, non_blocking=True)
        rows = dE.view(-1, H)
        pad = self.arch.embed.padding_idx
        if pad is not None:
            rows = rows.masked_fill((ids == pad).unsqueeze(1), 0)  # nn.Embedding gives padding_idx no gradient
        egrad.view(-1, H).index_put_((ids,), rows, accumulate=True)  # sorted, not atomic: deterministic on CUDA
        self.norm_dev[0].copy_(grad_norm(egrad))
        self.check_state(-1)

    def check_state(self, unit: int) -> None:
        """Compute stream, right after ``unit``'s norm is written: a resident unit whose state would write
        non-finite weights gets a NaN norm, so the step skips it as a non-finite gradient, on the device and
        in the report alike (Note: [Non-finite state] in state_check.py). No host sync."""
        ok = self._resident_ok(unit)
        if ok is None:
            return
        norm = self.norm_dev[unit + 1]
        norm.copy_(torch.where(ok, norm, float("nan")))
        self.state_ok[unit] = ok

    def check_before_sum(self, unit: int, g: torch.Tensor) -> None:
        """Compute stream, data parallel, before ``unit``'s gradient ``g`` (compute dtype, on the device) is summed
        over ranks: a resident unit whose state fails the check poisons its first element with NaN, so that the
        sum, its norm and every rank's verdict are non-finite (Note: [State verdicts] in distributed.py). No
        host sync; this rank reports the unit, the others a non-finite gradient."""
        ok = self._resident_ok(unit)
        if ok is not None:
            g[:1].copy_(torch.where(ok, g[:1], float("nan")))
            self.state_ok[unit] = ok

    def _resident_ok(self, unit: int) -> torch.Tensor | None:
        """Compute stream: 0-dim bool, resident ``unit``'s state passes the check; None where it is not resident."""
        r = self.opt.of.get(unit)
        if r is None:
            return None
        a, b = r.seg(unit)
        if r.units in self.late.pending:  # Note: [Late moments]: the compute stream never waits for them; an
            return state_check.finite(r.master[a:b])  # arriving group's moments are checked from its next step on
        return self.verdicts.get(unit, r, lambda: state_check.state_ok(r.master[a:b], r.exp_avg[a:b], r.exp_avg_sq[a:b]))

    def bad_state(self, units) -> list[int]:
        """Driver, for a skipped step's report only: which of ``units`` failed ``check_state`` this step (reads
        each verdict: a host sync, on that rare path alone)."""
        return [u for u in units if u in self.state_ok and not bool(self.state_ok[u])]  # .item(): host sync

    def end_backward(self) -> None:
        """Compute stream: the next step's compute follows this step's overlapped device updates."""
        self.dev.wait(self.dev.compute, self.updated)

    def gated_update(self, norms: dict, lr: float) -> None:
        """Driver, after the backward, gated: every resident unit's AdamW with the host's clip factor."""
        scale = self.host_optim.clip_factor(norms)[1]  # the same for every unit
        n = sum(r.master.numel() for r in self.opt.groups.values())
        with self.dev.on(self.dev.compute):
            self.late.finish(self.dev.compute)  # Note: [Late moments]
            tok = self.rec.cuda_begin("device-adam", "adam", -1, "optim", n * 16, self.dev.compute)
            self.opt.update(lr, scale)
            self.rec.cuda_end(tok, self.dev.compute)

    # ---- reading the state ------------------------------------------------------------------------
    def settle(self) -> None:
        """Block until the device's updates are done (named sync) and every state write-back is back."""
        self.wait_writes()  # raises what a write-back raised
        self.late.finish()  # Note: [Late moments]
        if (self.opt.groups or self.opt.streamed) and self.dev.cuda:
            torch.cuda.synchronize(self.dev.device)  # named sync: the device's updates are done

    def write_back(self) -> None:
        """Resident state and streamed step counts into the host store (after ``settle``)."""
        if self.opt.groups or self.opt.streamed:
            self.opt.write_back()
        self.store.join_units()  # readers of the store see fp32 masters; the next step splits them again

    def frame(self):
        """One row per unit: unit, name, placement, params, device_GiB (resident state), moments (how the host
        holds them: ``optimizer_state``), reason."""
        import pandas as pd

        cand = self.search.candidate
        choice = self.choice or self.choose(None if cand is None else self.search.free[cand])
        tried = "; ".join(x for x in (self.search.summary(), self.pass_reason, self.micro_reason) if x)
        size = torch.tensor([], dtype=self.dtype).element_size()
        rows = []
        for u in self.store.order:
            c, n = choice[u], self.store.units[u].layout.numel
            name = "embedding" if u == -1 else "head" if u == self.L else f"layer {u}"
            dev_bytes = placing.resident_bytes(u, n, size, self.arch.tied) if c.placement == "resident" else 0
            rows.append((u, name, c.placement, n, dev_bytes / 2**30, self.store.moments_of(u),
                         c.reason + (f"; {tried}" if tried else "")))
        return pd.DataFrame(rows, columns=["unit", "name", "placement", "params", "device_GiB", "moments", "reason"])
