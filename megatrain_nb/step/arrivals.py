"""Groups made resident come in during the step they are first resident in, not before it.

Owns: a host thread, a CUDA stream and two staging buffers of its own that bring in the state of the
groups ``place`` has just made resident — each group's master once the host has applied its last
update (then its step counts and its weights, cast), in the forward's order; then their moments, in
the backward's — and the waits for it: a read of a group's weights (``weights``), its first device
update (``state``), and every reader of the state between steps (``finish``); which units the host
still updates (``coming``).
Does not own: which groups arrive (device_updates.py), their buffers or arithmetic (``optim.DeviceAdamW``),
the staged copy itself (``transfers.Staging``).

Note: [Arrivals] a group made resident is read first by the forward (its weights) and then by its
first update (master and moments), in the backward, or after it in a gated step. Traced on the H200
(2026-12-03, 14B x 2 with int4 moments, the trial step after the measuring step), the step waited
1.74 s before its first layer while ``place`` brought 40 GB in (27 GB of masters, 13 GB of moments
not pinned under "auto"), each group once the host had applied its last update; with the moments
moved into the step, 0.70-0.90 s (27 GB), of which 0.28-0.51 s waiting for the host's updates of the
measuring step; then the forward waited on for the streamed layers those updates held back. Now
``place`` only allocates (the buffers, on the compute stream) and hands the groups here: the step
starts at once, and the forward reads each resident group's weights as soon as they are in, as it
reads a streamed layer's as soon as its load is in. Until a group's master is in, the host's AdamW
of its units still runs (``coming``: the measuring step's updates of them), and the thread waits for
it before copying. The moments follow, the last group's first, on the same stream, each group's first
update waiting for them. A checkpoint, a write-back, a placement change or a failed step waits for
all (``finish``); a failed step's copies that did not run are done again on the spot (``recover``),
from the host store, which no update of those groups has touched since.
"""
from __future__ import annotations

import threading
import time

import torch

from ..config import ARRIVAL_STAGING_BYTES
from .transfers import Staging, Streams
from .workers import Box, Worker


class Arrivals:
    """Groups made resident whose state is on its way in: (group's units) -> box of the event after each part."""

    delay = 0.0  # test hook: seconds each copy sleeps first (proves the waits)

    def __init__(self, dev: Streams, rec, opt, adam, abort: threading.Event):
        self.dev, self.rec, self.opt, self.adam, self.abort = dev, rec, opt, adam, abort
        self.masters: dict[tuple[int, ...], Box] = {}  # weights, step counts and master in
        self.moments: dict[tuple[int, ...], Box] = {}
        self.coming: set[int] = set()  # units whose host update of the last step may still be due
        self.version = 0  # the host updates the units of the groups in flight have before they come in
        self.worker: Worker | None = None  # made at the first use, with its stream and staging
        self.stream = None
        self.staging: Staging | None = None

    def expect(self, g: tuple[int, ...]) -> None:
        """Driver, before ``place`` makes ``g`` resident: the host's AdamW still applies its units' due updates."""
        self.coming.update(g)

    def start(self, groups: list[tuple[int, ...]], version: int) -> None:
        """Driver, after ``place`` allocated ``groups`` (``DeviceAdamW.add(..., fill=False)``), before the step:
        their masters come in on the thread once each unit has ``version`` host updates, in this order; then
        their moments, in the reverse order (the backward's)."""
        if not groups:
            return
        if self.worker is None:
            self.worker = Worker("host-arrive", self.abort)
            if self.dev.cuda:  # on the CPU a copy is a copy
                self.stream = torch.cuda.Stream(self.dev.device)
                self.staging = Staging(self.dev, 2, ARRIVAL_STAGING_BYTES, torch.uint8)
        self.version = version
        made = self.dev.record(self.dev.compute)  # the buffers' allocation: the thread's stream writes after it
        for g in groups:
            self.masters[g] = self.worker.submit(lambda g=g: self._master(g, version, made))
        for g in reversed(groups):
            self.moments[g] = self.worker.submit(lambda g=g: self._moments(g))

    def _master(self, g: tuple[int, ...], version: int, made):
        """Thread: group ``g``'s master once the host has updated it, then its counts and weights; the event after."""
        with self.rec.span("host-arrive", "arrive-wait", g[0], "io"):
            for u in g:
                self.adam.wait_version(u, version)  # host wait: the host's last update of it
        self._sleep()
        r = self.opt.groups[g]
        nbytes = sum(self.opt.store.units[u].master.nbytes for u in g)
        with self.rec.span("host-arrive", "arrive", g[0], "io", nbytes), self.dev.on(self.stream):
            self.dev.wait(self.stream, made)
            tok = self.rec.cuda_begin("h2d-arrive", "arrive", g[0], "io", nbytes, self.stream)
            self.opt.load_master(r, self._put(self.stream))
            self.rec.cuda_end(tok, self.stream)
            ev = self.dev.record(self.stream)
        self.coming.difference_update(g)
        return ev

    def _moments(self, g: tuple[int, ...]):
        """Thread: group ``g``'s moments in; the event after them."""
        self._sleep()
        r = self.opt.groups[g]
        nbytes = sum(self.opt.store.units[u].exp_avg.nbytes + self.opt.store.units[u].exp_avg_sq.nbytes for u in g)
        with self.rec.span("host-arrive", "moments-in", g[0], "io", nbytes), self.dev.on(self.stream):
            tok = self.rec.cuda_begin("h2d-arrive", "moments-in", g[0], "io", nbytes, self.stream)
            self.opt.load_moments(r, self._put(self.stream))
            self.rec.cuda_end(tok, self.stream)
            return self.dev.record(self.stream)

    def _sleep(self) -> None:
        if self.delay:
            time.sleep(self.delay)

    def weights(self, unit: int, stream) -> None:
        """Driver, before a read of resident ``unit``'s weights on ``stream``: that stream waits for them (the
        driver waits until their copy is enqueued); raises what the copy raised."""
        r = self.opt.of.get(unit)
        if r is not None and r.units in self.masters:
            self.dev.wait(stream, self.masters[r.units].get())  # a failed copy stays for ``recover``
            del self.masters[r.units]

    def state(self, g: tuple[int, ...], stream) -> None:
        """Driver, before group ``g``'s update on ``stream``: that stream waits for its master and moments."""
        for parts in (self.masters, self.moments):
            if g in parts:
                self.dev.wait(stream, parts[g].get())  # a failed copy stays for ``recover``
                del parts[g]

    def finish(self, stream=None) -> None:
        """Driver: ``stream`` (default: the current one) waits for everything on its way in; raises the first error."""
        stream = stream if stream is not None or not self.dev.cuda else torch.cuda.current_stream(self.dev.device)
        for g in list(self.masters) + list(self.moments):
            self.state(g, stream)

    def recover(self) -> None:
        """Driver, after a failed step (abort cleared): every copy that did not run, or failed, runs again here on
        the current stream, from the host store, after the host's last update of its units."""
        stream = torch.cuda.current_stream(self.dev.device) if self.dev.cuda else None
        ends = {}
        for key, box in [(("master", g), b) for g, b in self.masters.items()] + \
                        [(("moments", g), b) for g, b in self.moments.items()]:
            try:  # first every job to its end: the thread is idle after
                ends[key] = (box.get(),)
            except Exception:
                ends[key] = None
        left = {"master": {}, "moments": {}}
        for (part, g), ev in ends.items():  # masters first, as the thread runs them
            if ev is not None:
                self.dev.wait(stream, ev[0])
                continue
            try:
                if part == "master":
                    for u in g:
                        self.adam.wait_version(u, self.version)
                    self.opt.load_master(self.opt.groups[g], self._put(stream))
                    self.coming.difference_update(g)
                else:
                    self.opt.load_moments(self.opt.groups[g], self._put(stream))
            except Exception as e:  # e.g. the host's AdamW failed: its next reader raises it, not the recovery
                left[part][g] = box = Box()
                box.fail(e)
        self.masters, self.moments = left["master"], left["moments"]

    def _put(self, stream):
        """``DeviceAdamW``'s copy: through the thread's staging on ``stream`` (CUDA), a plain copy (CPU)."""
        if self.staging is None:
            return lambda dst, src: dst.copy_(src)
        return lambda dst, src: self.staging.upload(dst, src, stream)

    def close(self) -> None:
        if self.worker is not None:
            self.worker.close()
