"""Moments of groups made resident, brought in during the step rather than before it.

Owns: a host thread, a CUDA stream and two staging buffers of its own that copy (and, compact,
dequantize) the moments of groups ``place`` has just made resident, and the waits for them: a
group's first device update (``wait``), and every reader of the state between steps (``finish``).
Does not own: which groups arrive (device_updates.py), their buffers or arithmetic (``optim.DeviceAdamW``),
the staged copy itself (``transfers.Staging``).

Note: [Late moments] a group made resident needs its weights in the step's forward and its moments
only at its first update, in the backward (a gated step's, after it). Traced on the H200 (2026-12-03,
14B x 2 with int4 moments), the trial step after the measuring step waited 1.74 s before its first layer
while 40 GB came in: 27 GB of masters (pinned, one DMA each) and 13 GB of moments (not pinned under
"auto": the embedding's fp32 ones, 6.2 GB, and the layers' int4 words), through the weight staging at
about 25 GB/s. Now ``place`` brings the masters in and casts the weights, and this thread brings the
moments during the forward, in the order the backward updates them (the last group first), on its
own stream, through its own staging, so that the packer's weights and these never wait for one
another's buffers. A group's update waits for its moments' event; where the thread is late, the
driver waits for it there (``wait``). Checkpoints, write-backs, a placement change and a failed step
wait for all (``finish``); a failed step's uploads that did not run are done again on the spot, from the
host store, which no update of those groups has touched. Measured at that shape (same day): the
moves before the trial step 0.90 s (the masters 0.37 s, the rest waiting for the host's updates of those
groups), the moments in during it in 1.63 s, before its backward had ended; the trial 4.86 -> 3.85 s.
Bringing the masters in during the step too was tried and did not pay (docs/design_log.md, Placement).
"""
from __future__ import annotations

import threading
import time

import torch

from ..config import MOMENT_STAGING_BYTES
from .transfers import Staging, Streams
from .workers import Box, Worker


class LateMoments:
    """Moment uploads of resident groups in flight: (group's units) -> box of the event after them."""

    delay = 0.0  # test hook: seconds each upload sleeps first (proves the waits)

    def __init__(self, dev: Streams, rec, opt, abort: threading.Event):
        self.dev, self.rec, self.opt, self.abort = dev, rec, opt, abort
        self.pending: dict[tuple[int, ...], Box] = {}
        self.worker: Worker | None = None  # made at the first use, with its stream and staging
        self.stream = None
        self.staging: Staging | None = None

    def start(self, groups: list[tuple[int, ...]]) -> None:
        """Driver, after ``place`` made ``groups`` resident with ``moments=False``: their moments come in
        on the thread, the backward's order first (the last group's first)."""
        if not groups:
            return
        if self.worker is None:
            self.worker = Worker("host-moments", self.abort)
            if self.dev.cuda:  # on the CPU a copy is a copy
                self.stream = torch.cuda.Stream(self.dev.device)
                self.staging = Staging(self.dev, 2, MOMENT_STAGING_BYTES, torch.uint8)
        for g in reversed(groups):
            self.pending[g] = self.worker.submit(lambda g=g: self._upload(g))

    def _upload(self, g: tuple[int, ...]):
        """Thread: group ``g``'s moments in on the thread's stream; the event after them."""
        if self.delay:
            time.sleep(self.delay)
        r = self.opt.groups[g]
        nbytes = sum(self.opt.store.units[u].exp_avg.nbytes + self.opt.store.units[u].exp_avg_sq.nbytes for u in g)
        with self.rec.span("host-moments", "moments-in", g[0], "io", nbytes), self.dev.on(self.stream):
            tok = self.rec.cuda_begin("h2d-moments", "moments-in", g[0], "io", nbytes, self.stream)
            self.opt.load_moments(r, self._put(self.stream))
            self.rec.cuda_end(tok, self.stream)
            return self.dev.record(self.stream)

    def wait(self, g: tuple[int, ...], stream) -> None:
        """Driver, before group ``g``'s update on ``stream``: that stream waits for its moments (the driver
        waits until they are enqueued); raises what their upload raised."""
        box = self.pending.get(g)
        if box is None:
            return
        self.dev.wait(stream, box.get())
        del self.pending[g]

    def finish(self, stream=None) -> None:
        """Driver: ``stream`` (default: the current one) waits for every pending upload; raises the first error."""
        stream = stream if stream is not None or not self.dev.cuda else torch.cuda.current_stream(self.dev.device)
        for g in list(self.pending):
            self.wait(g, stream)

    def recover(self) -> None:
        """Driver, after a failed step (abort cleared): every upload that did not run, or failed, runs again
        here on the current stream, from the host store (no update of these groups has run)."""
        stream = torch.cuda.current_stream(self.dev.device) if self.dev.cuda else None
        done = {}
        for g, box in self.pending.items():  # first every job to its end: the thread is idle after
            try:
                done[g] = (box.get(),)
            except Exception:
                done[g] = None
        left = {}
        for g, ev in done.items():
            if ev is not None:
                self.dev.wait(stream, ev[0])
                continue
            try:
                self.opt.load_moments(self.opt.groups[g], self._put(stream))
            except Exception as e:  # e.g. out of memory again: the group's next reader raises it, not the recovery
                left[g] = box = Box()
                box.fail(e)
        self.pending = left

    def _put(self, stream):
        """``load_moments``' copy: through the thread's staging on ``stream`` (CUDA), a plain copy (CPU)."""
        if self.staging is None:
            return lambda dst, src: dst.copy_(src)
        return lambda dst, src: self.staging.upload(dst, src, stream)

    def close(self) -> None:
        if self.worker is not None:
            self.worker.close()
