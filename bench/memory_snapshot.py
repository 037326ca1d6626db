"""What held the device's memory when an allocation failed: the live blocks of the CUDA caching allocator,
summed by the code that made them (the innermost megatrain_nb frame of each block's stack).

Imported by bench/throughput.py (``--oom-snapshot FILE``). Uses torch's own memory history
(``torch.cuda.memory._record_memory_history`` and its out-of-memory observer, the pattern of torch's
"Understanding CUDA Memory Usage" guide); what is ours is only the summary a person reads without the
memory-viz page: a table of bytes by allocation site, largest first.
"""
from __future__ import annotations

import collections
import pickle

import torch

_OURS = "megatrain_nb"


def site(frames: list[dict]) -> str:
    """The allocation site a person looks for: the innermost frame in megatrain_nb (else the innermost
    Python frame), as ``file:line function``.

    Example:
        >>> site([{"filename": "/x/torch/nn/functional.py", "line": 5, "name": "linear"},
        ...       {"filename": "/r/megatrain_nb/step/engine.py", "line": 40, "name": "_forward"}])
        'megatrain_nb/step/engine.py:40 _forward'
    """
    py = [f for f in frames if f.get("filename", "").endswith(".py")]
    ours = [f for f in py if _OURS in f["filename"]]
    f = (ours or py or [{"filename": "?", "line": 0, "name": "?"}])[0]
    name = f["filename"]
    name = name[name.rindex(_OURS):] if _OURS in name else name.rsplit("/", 2)[-2] + "/" + name.rsplit("/", 1)[-1] \
        if name.count("/") >= 2 else name
    return f"{name}:{f['line']} {f['name']}"


def summarize(snapshot: dict, top: int = 30) -> str:
    """A table of live (allocated) bytes by allocation site, largest first, from ``torch.cuda.memory._snapshot()``.

    Example:
        >>> snap = {"segments": [{"total_size": 3 << 30, "blocks": [
        ...     {"size": 2 << 30, "state": "active_allocated", "frames": [{"filename": "a/megatrain_nb/x.py",
        ...      "line": 1, "name": "f"}]},
        ...     {"size": 1 << 30, "state": "inactive", "frames": []}]}]}
        >>> print(summarize(snap).splitlines()[0])
        allocated 2.00 GiB in 1 blocks; reserved 3.00 GiB in 1 segments (1.00 GiB cached, not in use)
    """
    by, count = collections.Counter(), collections.Counter()
    allocated = reserved = blocks = 0
    for seg in snapshot.get("segments", []):
        reserved += seg.get("total_size", 0)
        for b in seg.get("blocks", []):
            if b.get("state") != "active_allocated":
                continue
            key = site(b.get("frames") or [])
            by[key] += b["size"]
            count[key] += 1
            allocated += b["size"]
            blocks += 1
    gib = 1 << 30
    lines = [f"allocated {allocated / gib:.2f} GiB in {blocks} blocks; reserved {reserved / gib:.2f} GiB in "
             f"{len(snapshot.get('segments', []))} segments ({(reserved - allocated) / gib:.2f} GiB cached, not in use)",
             f"{'GiB':>8} {'blocks':>6}  site"]
    lines += [f"{n / gib:8.3f} {count[k]:6d}  {k}" for k, n in by.most_common(top)]
    return "\n".join(lines)


def on_oom(path: str, *, pickle_path: str | None = None) -> None:
    """From now on record every allocation's Python stack; at the first failed allocation write the live
    blocks' summary to ``path`` (and torch's whole snapshot to ``pickle_path``, for
    https://pytorch.org/memory_viz) before the error reaches the caller. CUDA only. Sets the allocator as a
    Session would (``preflight.cuda_allocator``) first: recording starts CUDA, after which the setting
    can only be switched at run time."""
    from megatrain_nb.machine.preflight import cuda_allocator

    cuda_allocator()
    torch.cuda.memory._record_memory_history(max_entries=2_000_000, stacks="python")
    done = []

    def observer(device, alloc, device_alloc, device_free):
        if done:
            return
        done.append(True)
        snap = torch.cuda.memory._snapshot()
        with open(path, "w") as f:
            f.write(f"out of memory on device {device}: a request of {alloc / 2**20:.0f} MiB with "
                    f"{device_alloc / 2**30:.2f} GiB allocated and {device_free / 2**30:.2f} GiB free\n")
            f.write(summarize(snap) + "\n")
        best, by = peak(snap)
        with open(path, "a") as f:
            f.write(f"peak of the recorded history before it: {best / 2**30:.2f} GiB\n" + "".join(
                f"{n / 2**30:8.3f}  {k}\n" for k, n in by.most_common(30)))
        if pickle_path:
            with open(pickle_path, "wb") as f:
                pickle.dump(snap, f)

    torch._C._cuda_attach_out_of_memory_observer(observer)


def expandable() -> bool | None:
    """Whether the caching allocator's segments are expandable (``expandable_segments``, Note: [Allocator]
    in preflight.py): None before any segment exists."""
    segs = torch.cuda.memory._snapshot().get("segments", [])
    return any(bool(s.get("is_expandable")) for s in segs) if segs else None


def peak(snapshot: dict) -> tuple[int, collections.Counter]:
    """The most bytes allocated at once in the recorded history (``device_traces``: alloc and free events),
    and what was live then, by ``site``. Blocks allocated before the history began are not in it: record
    from the start of the run (``on_oom`` before the Session is made).

    Example:
        >>> f = [{"filename": "a/megatrain_nb/x.py", "line": 1, "name": "f"}]
        >>> ev = [dict(action="alloc", addr=1, size=5, frames=f), dict(action="alloc", addr=2, size=7, frames=[]),
        ...       dict(action="free_completed", addr=1, size=5, frames=f)]
        >>> peak({"device_traces": [ev]})[0]
        12
    """
    events = [e for trace in snapshot.get("device_traces", []) for e in trace]

    def replay(upto: int):
        live, now, best, at = {}, 0, 0, -1
        for k, e in enumerate(events[:upto]):
            if e["action"] == "alloc":
                live[e["addr"]] = (e["size"], site(e.get("frames") or []))
                now += e["size"]
            elif e["action"] == "free_completed" and e["addr"] in live:
                now -= live.pop(e["addr"])[0]
            if now > best:
                best, at = now, k
        return best, at, live

    best, at, _ = replay(len(events))
    _, _, live = replay(at + 1)
    by = collections.Counter()
    for size, key in live.values():
        by[key] += size
    return best, by


def write_peak(path: str, top: int = 30) -> None:
    """Append to ``path`` the recorded peak and what held it, by site (with ``on_oom``'s history on), beside
    the allocator's own peaks."""
    best, by = peak(torch.cuda.memory._snapshot())
    gib = 1 << 30
    with open(path, "a") as f:
        f.write(f"peak of the recorded history: {best / gib:.2f} GiB allocated (the allocator's peaks: allocated "
                f"{torch.cuda.max_memory_allocated() / gib:.2f}, reserved {torch.cuda.max_memory_reserved() / gib:.2f})\n"
                f"{'GiB':>8}  site\n" + "".join(f"{n / gib:8.3f}  {k}\n" for k, n in by.most_common(top)))
