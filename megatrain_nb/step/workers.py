"""Host worker threads and the one-shot handoffs between them and the step's driver.

Owns: ``Box`` (a value handed from one thread to another exactly once), ``Worker`` (a thread that
runs jobs in submission order), and ``AdamWorker`` (runs per-unit updates as gradients land, in the
order that lets the next step start soonest, subnormals flushed: Note: [Subnormals] in denormals.py).
Torch CPU ops release the GIL, so threads overlap.
Does not own: CUDA streams or events (the engine passes them in), nor any tensor arithmetic.
"""
from __future__ import annotations

import concurrent.futures
import math
import queue
import threading
import time
from typing import Any, Callable

from ..host.denormals import flush_denormals


class Aborted(RuntimeError):
    """A step was abandoned; workers drop what they were waiting for."""


class Box:
    """A value put once and read many times; ``get`` blocks the calling thread (never a stream)."""

    __slots__ = ("_event", "_value", "_error", "_abort")

    def __init__(self, abort: threading.Event | None = None, value: Any = None, ready: bool = False):
        self._event, self._value, self._error, self._abort = threading.Event(), value, None, abort
        if ready:
            self._event.set()

    def put(self, value: Any) -> None:
        self._value = value
        self._event.set()

    def fail(self, error: BaseException) -> None:
        self._error = error
        self._event.set()

    @property
    def done(self) -> bool:
        """Put or failed: ``get`` returns (or raises) at once."""
        return self._event.is_set()

    def get(self) -> Any:
        while not self._event.wait(0.05):  # poll so an aborted step never leaves a thread hanging
            if self._abort is not None and self._abort.is_set():
                raise Aborted("step abandoned")
        if self._error is not None:
            raise self._error
        return self._value


class Worker:
    """One daemon thread running submitted jobs in order; a job's result or error lands in its Box."""

    def __init__(self, name: str, abort: threading.Event):
        self.name, self.abort = name, abort
        self.jobs: queue.Queue = queue.Queue()
        self.thread = threading.Thread(target=self._run, name=f"megatrain-{name}", daemon=True)
        self.thread.start()

    def submit(self, fn: Callable[[], Any]) -> Box:
        box = Box(self.abort)
        self.jobs.put((fn, box))
        return box

    def _run(self) -> None:
        while True:
            fn, box = self.jobs.get()
            if fn is None:
                return
            if self.abort.is_set():
                box.fail(Aborted("step abandoned"))
                continue
            try:
                box.put(fn())
            except BaseException as e:  # handed to whoever waits on the box
                box.fail(e)

    def drain(self) -> None:
        """Block until every job submitted so far has run."""
        self.submit(lambda: None).get()

    def drain_quietly(self) -> None:
        """Like drain, while a step is being abandoned (abort set): queued jobs fail fast."""
        box = Box(None)
        self.jobs.put((lambda: None, box))
        try:
            box.get()
        except Exception:  # an aborted marker job is fine: the queue is empty either way
            pass

    def close(self) -> None:
        self.jobs.put((None, None))
        self.thread.join(timeout=5)


class AdamWorker:
    """Runs one optimizer update per unit per step, as each unit's gradients land.

    Note: [Update order] while the backward still produces gradients, units update in the order
    they land (head, L-1, ..., 0); once every unit has landed, the rest go in forward order
    (embedding, 0, 1, ...), so the next step's forward of layer 0 waits for one update, not all.
    Where the next step has asked for its embedding rows (``early``, Note: [Early rows]), those go
    first and the embedding's whole update goes last, after every other unit that has landed. A unit
    the device updated (``noop``; the host's update of it does nothing) counts as soon as it has
    landed with a finite norm, ahead of host updates (Note: [Early state] in device_updates.py).
    The update order never changes which units are skipped: that follows the order they landed in
    (Note: [Non-finite gradients] in docs/engine.md), whether the worker keeps up or not.
    When ``gate`` is set (gradient clipping, or overlap off) no unit updates before all have landed:
    the global norm needs every gradient.
    """

    def __init__(self, order: list[int], update: Callable[[int, float, float], None], abort: threading.Event,
                 shared=None):
        self.order = order  # forward order of units
        self.update = update  # update(unit, lr, grad_scale)
        self.abort = abort
        self.cond = threading.Condition()
        self.version = {u: 0 for u in order}  # updates processed (applied or skipped) per unit
        self.steps: list[dict] = []  # open steps, oldest first; each: landed (unit -> grad norm), arrivals
        self.landed: dict[int, float] = {}  # of the step being updated
        self.arrivals: list[int] = []
        self.error: BaseException | None = None
        self.stats: dict = {}
        self.closed = False
        self.shared = shared  # shared_store.SharedHost: another local rank updates the units it owns
        self.target: dict[int, int] = {}  # unit owned elsewhere -> updates processed here (its owner's to come)
        self.early: Callable[[int, int, float, float, bool], bool] | None = None  # Note: [Early rows] (the engine's;
        # its last argument: no other unit is left to update, so it may wait for the next step's request)
        self.threads: int | None = None  # intra-op threads of the updates (None: torch's default); set per step
        self.noop: Callable[[int], bool] | None = None  # units the device updates: the host's update is a no-op
        self.guard: Callable[[int], bool] | None = None  # whether a landing unit's state can take its update
        self.consumed: Callable[[int], None] | None = None  # a unit's gradients are read or skipped (Note: [Gradient ring])
        self.follower = None
        if shared is not None:
            from ..host.shared_store import Follower

            self.follower = Follower(shared, self)  # version[u] of those units: what their owners published
        self.thread = threading.Thread(target=self._run, name="megatrain-host-adam", daemon=True)
        self.thread.start()

    def begin(self, *, step: int, lr: float, gate: bool, clip: Callable[[dict], tuple[float, float]], loss: Box) -> dict:
        """Open step ``step``'s updates: ``loss`` yields the step's loss (a non-finite one skips the step)."""
        with self.cond:  # Note: the previous step's updates may still be running: its state stays its own
            st = dict(step=step, lr=lr, gate=gate, clip=clip, loss=loss, landed={}, arrivals=[], bad_state=[])
            self.steps.append(st)
            self.cond.notify_all()
        return st

    def land(self, unit: int, norm: float, step: int | None = None) -> None:
        """Unit's gradients for step ``step`` are in host memory; None: the newest step (a step begins after
        the last one landed, but for a "device" unit's write-back: Note: [Late write-backs] in device_updates.py).
        A unit whose state fails ``guard`` lands with a NaN norm (Note: [Non-finite state] in state_check.py)."""
        bad = self.guard is not None and math.isfinite(norm) and not self.guard(unit)  # the caller's thread, unlocked
        with self.cond:
            st = self.steps[-1] if step is None else next(s for s in self.steps if s["step"] == step)
            if bad:
                norm = math.nan  # skipped and reported as a non-finite gradient is (Note: [Non-finite gradients])
                st["bad_state"].append(unit)
            st["landed"][unit] = norm
            st["arrivals"].append(unit)
            self.cond.notify_all()

    def wait_version(self, unit: int, version: int) -> None:
        """Block until ``unit`` has processed ``version`` updates (the next forward may read it)."""
        self.wait_until(lambda: self.version[unit] >= version)

    def wait_until(self, done: Callable[[], bool], timeout: float | None = None) -> bool:
        """Block until ``done()``, read under ``cond``, holds (the worker notifies at each update), or for at
        most ``timeout`` seconds; returns ``done()``. Raises the worker's error, or Aborted when the step is
        abandoned."""
        end = None if timeout is None else time.monotonic() + timeout
        with self.cond:
            while not done():
                if self.error is not None:
                    raise self.error
                if self.abort.is_set():
                    raise Aborted("step abandoned")
                left = 0.05 if end is None else min(0.05, end - time.monotonic())
                if left <= 0:
                    return False
                self.cond.wait(left)
            return True

    def wait_all(self, version: int) -> None:
        for u in self.order:
            self.wait_version(u, version)

    def set_version(self, version: int) -> None:
        """Resume: every unit has processed ``version`` updates (before any step); a shared store's owners publish it."""
        with self.cond:
            self.version = dict.fromkeys(self.order, version)
            self.target = {}
            for u in self.order:
                if self.shared is not None and self.shared.owns(u):
                    self.shared.publish(u, version)

    def _processed(self, u: int) -> None:
        """Under ``cond``: unit ``u``'s update of the oldest open step is applied or skipped here."""
        if self.shared is None or self.shared.owns(u):
            self.version[u] += 1
            if self.shared is not None:
                self.shared.publish(u, self.version[u])  # after the update's writes (Note: [Shared host store])
        else:
            self.target[u] = self.target.get(u, self.version[u]) + 1  # the follower raises version[u] to it
        self.cond.notify_all()

    def close(self) -> None:
        with self.cond:
            self.closed = True
            self.cond.notify_all()
        self.thread.join(timeout=5)
        if self.follower is not None:
            self.follower.close()

    def _next(self, done: set, deferred: set) -> int | None:
        todo = [u for u in self.arrivals if u not in done]
        if not todo:
            return None
        if self.noop is not None:  # Note: [Early state]: a unit the device updated counts at once, not behind host
            quick = [u for u in todo if self.noop(u) and math.isfinite(self.landed[u])]  # updates (a finite one
            if quick:  # changes no verdict; verdicts follow the landing order, whatever the update order)
                return quick[0]
        if len(self.landed) == len(self.order):
            return min(todo, key=lambda u: (u in deferred, self.order.index(u)))
        return todo[0]

    def _run(self) -> None:
        flush_denormals()  # before this thread's first torch op, so its OpenMP pool flushes too (Note: [Subnormals])
        while True:
            with self.cond:
                while not self.steps and not self.closed:
                    self.cond.wait()
                if self.closed:
                    return
                cfg = self.steps[0]
                self.landed, self.arrivals = cfg["landed"], cfg["arrivals"]
            if self.threads:
                import torch

                torch.set_num_threads(self.threads)  # this thread's team only (the driver keeps its own)
            try:
                self._one_step(cfg)
            except Aborted:
                pass
            except BaseException as e:  # surfaced by wait_version in the driver
                with self.cond:
                    self.error = e
                    self.cond.notify_all()
            with self.cond:
                if self.steps and self.steps[0] is cfg:
                    self.steps.pop(0)

    def _one_step(self, cfg: dict) -> None:
        loss = cfg["loss"].get()  # lands with the head's gradients, before any other unit
        every = not math.isfinite(loss)  # every unit of the step is skipped
        scale, total = 1.0, float("nan")
        done: set = set()
        deferred: set = set()  # units whose early part went first: their whole update waits for the others
        applied = 0
        if cfg["gate"]:
            with self.cond:
                while len(self.landed) < len(self.order):
                    if self.abort.is_set():
                        raise Aborted("step abandoned")
                    self.cond.wait(0.05)
            total, scale = cfg["clip"](dict(self.landed))
            every = every or not math.isfinite(total)
        skip = every
        while len(done) < len(self.order):
            with self.cond:
                u = self._next(done, deferred)
                while u is None:
                    if self.abort.is_set():
                        raise Aborted("step abandoned")
                    self.cond.wait(0.05)
                    u = self._next(done, deferred)
                landed = self.arrivals[:self.arrivals.index(u) + 1]  # u and every unit that landed before it
                off = every or not all(math.isfinite(self.landed[x]) for x in landed)
            skip = skip or off  # Note: [Non-finite gradients] see docs/engine.md: u is skipped when it, or a unit
            # that landed before it, has a non-finite norm, whichever the worker reaches first
            if (not off and u not in deferred and self.early is not None and len(self.landed) == len(self.order)
                    and self.early(u, cfg["step"], cfg["lr"], scale, len(done) + 1 == len(self.order))):
                deferred.add(u)  # Note: [Early rows] the rows the next forward gathers are out; the rest waits
                continue
            if not off:  # a deferred unit's rows went out with this same verdict: its update runs
                self.update(u, cfg["lr"], scale)
                applied += 1
            done.add(u)
            if self.consumed is not None:
                self.consumed(u)  # its gradient buffer may be refilled (Note: [Gradient ring] in grad_ring.py)
            with self.cond:
                self._processed(u)
        if not cfg["gate"]:
            total = math.sqrt(sum(n * n for n in self.landed.values()))
        with self.cond:
            self.stats = dict(step=cfg["step"], skipped=skip, applied=applied, grad_norm=total)


def run_uninterrupted(fn, driver):
    """Run one step on the session's driver thread; a KeyboardInterrupt (Jupyter's Stop) waits for it.

    Note: [Interrupts] a step is applied to all layers or to none: an interrupt never lands inside
    one. The caller re-raises it once the step is done. Returns (result, interrupted). The step starts
    only once this thread is inside its interrupt-catching wait (``go``): an interrupt that came while
    the job was being submitted would escape at once, the step running on unwatched. An interrupt
    before the step starts cancels it and is raised as it came.
    Note: [Driver thread] one long-lived thread per session, not one per step: every new thread
    that touches torch leaves per-thread state behind (OpenMP pools, CUDA contexts' thread state);
    a thread per step grew host RSS by ~2 MB/step on the H200 (docs/design_log.md).
    """
    import warnings

    go, cancelled = threading.Event(), threading.Event()

    def job():
        go.wait()
        return None if cancelled.is_set() else fn()

    future, interrupted = None, False
    while True:
        try:
            if future is None:
                future = driver.submit(job)
            go.set()
            if concurrent.futures.wait([future], timeout=0.1).done:
                break
        except KeyboardInterrupt:
            if not go.is_set():  # the step has not started: submitted or not, none of it runs
                cancelled.set()
                go.set()
                raise
            if not interrupted:
                warnings.warn("interrupt received: finishing the current step first so that no layer is "
                              "left without its update", stacklevel=3)
            interrupted = True
    return future.result(), interrupted  # re-raises the step's own error here, in the caller's thread
