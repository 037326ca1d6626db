"""One writer per save under data parallel: every rank may call a save, or rank 0 alone; none races or hangs.

Owns: the hand-shake of a save between the ranks (``Turns``, one per data-parallel Session, over the
process group's c10d store, never a collective), the decorator that runs a save function on one rank
(``one_writer``: ``checkpoint.save_checkpoint`` and ``Session.save_pretrained`` wear it), the gate at
the start of every step that keeps the other ranks out of the step's first collective while rank 0
writes (``Turns.at_step``, called by ``DataParallel.begin``), and rank 0's heartbeat while it writes.
Does not own: what a save writes or how (checkpoint.py, host_store.py), the step's collectives
(distributed.py), nor launching ranks.

Note: [One writer] every rank holds the same state (Note: [Data parallel]), so one rank, rank 0,
writes each save. Ranks agree without a collective (a timed-out gloo collective poisons the group):
each save is named in the store by the count of steps begun, its kind and its order among saves of
that kind since that step, all equal on every rank that calls it.
- Rank 0 claims the save, writes it, and publishes "ok" or its error; while it writes, a thread adds
  1 to a heartbeat counter every ``BEAT_S``.
- Another rank that calls the same save marks its arrival, waits for rank 0's claim, then for its
  result, and returns once the save is complete (or raises rank 0's error). Given another directory
  than rank 0's, it writes its own (the directories differ: no race).
- A rank that moved on instead (rank 0 saved alone) marks the start of its next step and waits
  there, before the step's first collective, until rank 0 starts that step too.
- Every wait for rank 0 lasts while rank 0 shows a sign of life (a claim, a result, a heartbeat) at
  least once per process-group timeout; a rank 0 that died mid-write stops beating and the waiting
  ranks raise after that timeout. A minutes-long write never times them out.
- A rank whose Session closes marks the next step's start as if it began it (``Turns.leave``): a
  script's ``if rank == 0: s.save_pretrained(out)`` after the last step, while the others close.
- A non-zero rank that calls a save alone learns that rank 0 began the next step without it: it
  writes nothing, warns, and returns (rank 0 was already waiting for it in that step's collective).
- With a shared host store (shared_store.py) rank 0 first waits until every other rank has either
  arrived (and so drained its own pending updates and write-backs into the shared segment) or moved
  on (quiet at the gate). A checkpoint alone is refused, at once, where a "device" unit's step count
  is held by another rank's GPU (its owner writes it back only when it drains).
Ranks in lockstep arrive at a save within the time between the end of a step's last collective and
the save call on each (milliseconds, unless a rank does extra work between steps); none of the
decisions above depends on that time, only on what each rank marked in the store.
"""
from __future__ import annotations

import contextlib
import functools
import itertools
import os
import threading
import time
import warnings
from pathlib import Path

BEAT_S = 1.0
"""Seconds between two of rank 0's heartbeats while it writes a save."""

_made = itertools.count()  # one tag per data-parallel Session; every rank makes its Sessions in the same order


class Turns:
    """The save hand-shake of one data-parallel Session (Note: [One writer]).

    Args:
        rank, size: this process's rank and the world size.
        store: a c10d ``Store`` every rank reaches; default: the default process group's.
        timeout_s: how long a rank waits without a sign of life; default: the store's timeout (the
            process group's).
    """

    def __init__(self, rank: int, size: int, store=None, timeout_s: float | None = None):
        import torch.distributed as dist

        self.rank, self.size = rank, size
        self.store = store if store is not None else dist.distributed_c10d._get_default_store()
        self.timeout_s = timeout_s if timeout_s is not None else self.store.timeout.total_seconds()
        self.tag = f"megatrain/save/{next(_made)}"
        self.steps = 0  # steps begun (``at_step`` calls): every rank's count is the same between steps
        self.seq: dict[tuple[int, str], int] = {}  # (steps, kind) -> saves of that kind begun since

    def at_step(self) -> None:
        """Start of a step, before its first collective: a rank other than 0 waits here while rank 0 saves.

        Blocks the CPU until rank 0 has started this step too (one store read, microseconds, when it has).
        """
        self.steps += 1
        n, key = self.steps, self._at(self.steps, self.rank)
        self.store.set(key, "1")
        if n > 2:  # every rank has passed step n - 1's first collective: none reads these any more
            self.store.delete_key(self._at(n - 2, self.rank))
        self.seq = {k: v for k, v in self.seq.items() if k[0] == n}
        if self.rank != 0:
            self._await(lambda: self._has(self._at(n, 0)), f"the start of step {n} (rank 0 saving?)")

    def leave(self) -> None:
        """This rank's Session closes (after its drain): rank 0 saving alone, or a lone rank, stops waiting for it."""
        self.store.set(self._at(self.steps + 1, self.rank), "left")

    @contextlib.contextmanager
    def turn(self, kind: str, path, *, settle: bool = False, alone: str | None = None):
        """Whether this rank writes this save (``with turns.turn(...) as write: if write: ...``).

        Args:
            kind: the kind of save ("checkpoint", "pretrained").
            path: its directory.
            settle: rank 0 first waits until every other rank arrived or moved on (a shared host store).
            alone: why rank 0 may not write it while a rank moved on (None: it may).
        Yields:
            True on the rank that writes; False on the others, once the write is complete.
        Raises:
            RuntimeError: rank 0 alone where ``alone`` says why not; rank 0's write failed (on the
                others); rank 0 showed no sign of life for the timeout.
        """
        n = self.steps
        k = self.seq.get((n, kind), 0)
        self.seq[(n, kind)] = k + 1
        name, where = f"{self.tag}/{n}/{kind}/{k}", os.path.normpath(os.fspath(path))
        if self.rank == 0:
            self.store.set(f"{name}/claim", where)
            if settle:
                moved = [r for r in range(1, self.size) if self._settled(name, n, r) == "moved"]
                if moved and alone is not None:
                    self.store.set(f"{name}/done", f"refused: rank 0 alone ({alone})")
                    raise RuntimeError(f"data parallel: {kind} {where!r} on rank 0 alone: {alone}. Call it on every "
                                       f"rank (ranks {moved} went on to the next step without it); training can "
                                       "go on: no rank waited for this call")
            with _beating(self.store, self._beat):
                try:
                    yield True
                except BaseException as e:
                    self.store.set(f"{name}/done", f"failed: {type(e).__name__}: {str(e)[:500]}")
                    raise
            self.store.set(f"{name}/done", "ok")
            return
        self.store.set(f"{name}/arrived/{self.rank}", where)
        got = self._await(lambda: "claim" if self._has(f"{name}/claim") else
                          "moved" if self._has(self._at(n + 1, 0)) else None, f"rank 0's {kind} {where!r}")
        if got == "moved":
            warnings.warn(f"data parallel: rank {self.rank} called {kind} {where!r} alone; rank 0 writes every save "
                          "(every rank holds the same state), so nothing was written: call it on rank 0 (alone or "
                          "with the others)", stacklevel=4)
            yield False
            return
        if self.store.get(f"{name}/claim").decode() != where:
            yield True  # another directory than rank 0's: this rank writes its own (no race)
            return
        done = self._await(lambda: self.store.get(f"{name}/done").decode() if self._has(f"{name}/done") else None,
                           f"rank 0's writing of {kind} {where!r}")
        if done != "ok":
            raise RuntimeError(f"data parallel: rank {self.rank} of {self.size}: rank 0 did not write {kind} "
                               f"{where!r}: {done}")
        yield False

    # ---- the store ----------------------------------------------------------------------------------
    def _at(self, n: int, rank: int) -> str:
        return f"{self.tag}/at/{n}/{rank}"

    @property
    def _beat(self) -> str:
        return f"{self.tag}/beat"

    def _has(self, key: str) -> bool:
        return self.store.check([key])  # non-blocking: a timed-out store wait can leave a TCPStore client out of step

    def _settled(self, name: str, n: int, r: int) -> str:
        """Rank 0: "arrived" once rank r marked this save (after its drain), "moved" once it began step n + 1."""
        return self._await(lambda: "arrived" if self._has(f"{name}/arrived/{r}") else
                           "moved" if self._has(self._at(n + 1, r)) else None, f"rank {r}'s arrival at this save",
                           beats=False)

    def _await(self, ready, what: str, *, beats: bool = True):
        """Poll ``ready()`` until it returns a value; raise after ``timeout_s`` without rank 0's heartbeat."""
        beat, seen, delay, last = None, time.monotonic(), 0.0005, 0.0
        while True:
            got = ready()
            if got is not None:
                return got
            now = time.monotonic()
            if beats and now - last > 0.25:
                last, b = now, self.store.add(self._beat, 0)
                if b != beat:
                    beat, seen = b, now
            if now - seen > self.timeout_s:
                raise RuntimeError(f"data parallel: rank {self.rank} of {self.size}: waited {self.timeout_s:.0f} s "
                                   f"(the process group's timeout) for {what}: another rank stopped, died or did "
                                   "not answer. No update of the next step was applied; the last checkpoint is "
                                   "intact: resume from it")
            time.sleep(delay)
            delay = min(2 * delay, 0.02)


@contextlib.contextmanager
def _beating(store, key: str):
    """A daemon thread adds 1 to ``key`` every ``BEAT_S`` while the block runs."""
    stop = threading.Event()

    def beat():
        while not stop.wait(BEAT_S):
            store.add(key, 1)

    store.add(key, 1)
    t = threading.Thread(target=beat, name="megatrain-save-heartbeat", daemon=True)
    t.start()
    try:
        yield
    finally:
        stop.set()
        t.join()


def device_counts_elsewhere(session) -> str | None:
    """Why rank 0 alone cannot checkpoint ``session``: units placed "device" whose AdamW step counts another
    rank's GPU holds (a shared host store); None where it can."""
    store = session.store
    if getattr(store, "shared", None) is None:
        return None
    streamed = getattr(getattr(session.engine.device_updates, "opt", None), "streamed", {})
    units = sorted(u for u in streamed if not store.owns(u))
    if not units:
        return None
    return (f"units {units} are placed \"device\" and updated on other ranks' GPUs, which hold their step counts "
            "(shared host store)")


def one_writer(kind: str, *, alone=None):
    """Decorator: a save ``fn(session, path, ...)`` that every rank, or rank 0 alone, may call (Note: [One writer]).

    Without data parallel it calls ``fn``. Under data parallel every rank first drains its pending
    updates; rank 0 runs ``fn``; the other ranks that call it return when rank 0's write is complete.

    Args:
        kind: names the save in the store ("checkpoint", "pretrained").
        alone: ``alone(session) -> str | None``: why rank 0 may not write it while another rank moved on.
    Returns:
        The decorated function: it returns ``fn``'s value on the rank that wrote, ``Path(path)`` on the others.
    Raises:
        RuntimeError: (from the decorated function) rank 0 alone where ``alone`` refuses; rank 0's write
            failed (on the others); rank 0 showed no sign of life for the process group's timeout.
    Example:
        >>> @one_writer("pretrained")                                   # doctest: +SKIP
        ... def save_pretrained(session, path): ...
    """
    def wrap(fn):
        @functools.wraps(fn)
        def save(session, path, *args, **kwargs):
            turns = getattr(getattr(getattr(session, "engine", None), "dp", None), "saves", None)
            if turns is None:
                return fn(session, path, *args, **kwargs)
            session.engine.drain()  # host wait: this rank's updates and write-backs are in the store
            settle = getattr(session.store, "shared", None) is not None
            with turns.turn(kind, path, settle=settle, alone=alone(session) if alone and settle else None) as write:
                if write:
                    return fn(session, path, *args, **kwargs)
            return Path(path)
        return save
    return wrap

