"""Spans, counters and slot states of a training step -> tidy DataFrames, stall analysis, Chrome trace.

Owns the `Recorder` the engine calls while a step runs, the `Trace` it returns, the analysis of a
span DataFrame (`find_stalls`, `summarize`, `slot_segments`, `add_occupancy`) and the Chrome Trace Event export.
It does not plot (`viz.py` does) and decides nothing for the engine: recording only appends, and
the one GPU wait is in `Recorder.resolve`, which the engine runs when a trace is first read, after
its step. Times are ms on the host clock from `begin_step` (t0).
Why ~500 lines: recorder, analysis and export share one span layout; if the analysis grows, it is
the part to move to a module of its own.
"""

from __future__ import annotations

import contextlib
import gzip
import json
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import pandas as pd
import torch

from .tables import Summary, Table

LANES = ("compute", "device-adam", "h2d", "h2d-moments", "d2h", "d2h-state", "host-pack", "host-unpack",
         "host-moments", "host-adam", "driver")  # known lanes; others allowed
PHASES = ("fwd", "loss", "recompute", "bwd", "optim", "io")
SPAN_COLUMNS = ("lane", "op", "layer", "phase", "start_ms", "end_ms", "bytes")
SPAN_FRAME_COLUMNS = ("step", "lane", "op", "layer", "phase", "start_ms", "end_ms", "dur_ms", "bytes")
COUNTER_COLUMNS = ("name", "t_ms", "value")
SLOT_COLUMNS = ("kind", "index", "layer", "state", "t_ms")
_FORMAT = "megatrain_nb.trace"
_NULL_SPAN = contextlib.nullcontext()  # reusable; what a disabled recorder hands out

# Note: [GPU clock]
# A CUDA event only knows GPU time. `begin_step` records a reference event on the current stream and
# notes how many host ms after t0 that happened; a GPU span then sits at
# ref.elapsed_time(ev) + that offset. The reference fires when the stream reaches it, so if the stream
# was still busy at begin_step, GPU spans are shifted right by that backlog (a few µs when idle).


class _Span:
    """Context manager for one host-clock span; appends on exit."""

    __slots__ = ("rec", "key", "t")

    def __init__(self, rec: Recorder, key: tuple):
        self.rec, self.key = rec, key

    def __enter__(self) -> _Span:
        self.t = time.perf_counter()
        return self

    def __exit__(self, *exc) -> None:
        self.rec._add("_host", (*self.key, self.t, time.perf_counter()))


class Recorder:
    """Collects spans, counters and slot states of one step at a time; cheap, thread-safe.

    Args:
        enabled: when False every method is a no-op and `end_step` returns an empty `Trace`.
        device: the device whose streams `cuda_begin`/`cuda_end` record on; on a cpu device they
            fall back to the host clock.

    Example:
        >>> rec = Recorder(device="cpu")
        >>> rec.begin_step(0)
        >>> with rec.span("host-adam", "adam", 3, "optim", nbytes=1024):
        ...     pass
        >>> rec.end_step().to_dataframe().lane.tolist()
        ['host-adam']
    """

    def __init__(self, *, enabled: bool = True, device: torch.device | str = "cpu"):
        self.enabled = enabled
        self.device = torch.device(device)
        self._cuda = self.device.type == "cuda"
        self._lock = threading.Lock()
        self._step, self._open = 0, False
        self._t0 = time.perf_counter()
        self._ref: torch.cuda.Event | None = None
        self._ref_ms = 0.0
        self._host: list[tuple] = []  # (lane, op, layer, phase, nbytes, t_start_s, t_end_s)
        self._events: list[tuple] = []  # (lane, op, layer, phase, nbytes, start_event, end_event)
        self._counters: list[tuple] = []  # (name, value, t_s)
        self._slots: list[tuple] = []  # (kind, index, layer, state, t_s)

    def begin_step(self, step: int) -> None:
        """Starts the clock (t0) of step `step`; never waits.

        Records of a step that was begun but never ended are dropped. Host spans that ended after
        the previous `end_step` (e.g. its overlapped AdamW) are kept: they show in this step's trace
        with times before 0, next to whatever waited for them.
        """
        if not self.enabled:
            return
        with self._lock:
            if self._open:
                self._host, self._events, self._counters, self._slots = [], [], [], []
            self._step, self._open = step, True
            self._t0 = time.perf_counter()
            if self._cuda:  # Note: [GPU clock]
                self._ref = torch.cuda.Event(enable_timing=True)
                self._ref.record(torch.cuda.current_stream(self.device))
                self._ref_ms = (time.perf_counter() - self._t0) * 1e3

    def span(self, lane: str, op: str, layer: int, phase: str, nbytes: int = 0):
        """Context manager timing a host-side span (any thread).

        Args:
            lane: track name, one of `LANES` or a new one.
            op: what ran ("pack", "adam", ...).
            layer: layer index; -1 the embedding, L the head/loss unit.
            phase: one of `PHASES`.
            nbytes: bytes moved or touched, for bandwidth figures.

        Returns:
            A context manager.
        """
        if not self.enabled:
            return _NULL_SPAN
        return _Span(self, (lane, op, layer, phase, nbytes))

    def cuda_begin(self, lane: str, op: str, layer: int, phase: str, nbytes: int = 0, stream=None):
        """Records a start event on `stream` (current stream when None); never waits.

        Returns:
            A token for `cuda_end` (None when disabled). On a cpu device it holds a host time.
        """
        if not self.enabled:
            return None
        if not self._cuda:
            return (lane, op, layer, phase, nbytes, time.perf_counter())
        ev = torch.cuda.Event(enable_timing=True)
        ev.record(stream)
        return (lane, op, layer, phase, nbytes, ev)

    def cuda_end(self, token, stream=None) -> None:
        """Records the end event of `token` on `stream`; never waits."""
        if token is None:
            return
        if not self._cuda:
            return self._add("_host", (*token, time.perf_counter()))
        ev = torch.cuda.Event(enable_timing=True)
        ev.record(stream)
        self._add("_events", (*token, ev))

    def counter(self, name: str, value: float) -> None:
        """Samples counter `name` (e.g. "host_rss_bytes", "device_mem.weights") at host time now."""
        if self.enabled:
            self._add("_counters", (name, value, time.perf_counter()))

    def slot(self, kind: str, index: int, layer: int | None, state: str) -> None:
        """Notes that buffer `kind`[`index`] ("weight", "grad", "pinned") now holds `layer` in `state`
        ("loading", "ready", "computing", "free")."""
        if self.enabled:
            self._add("_slots", (kind, index, layer, state, time.perf_counter()))

    def _add(self, records: str, row: tuple) -> None:
        with self._lock:  # looked up under the lock: end_step may be swapping the lists
            getattr(self, records).append(row)

    def end_step(self) -> Trace:
        """Resolves the step's CUDA events and returns its `Trace` (`resolve(take_step())`).

        Returns:
            The step's Trace, times in ms from t0 (empty when disabled).

        Raises:
            RuntimeError: CUDA spans were recorded but `begin_step` was never called.
        """
        return self.resolve(self.take_step())

    def take_step(self) -> tuple | None:
        """Closes the step and takes its raw records without waiting for the GPU; `resolve` turns
        them into a Trace later (the engine does so when the trace is first read, after the step).

        Returns:
            An opaque record of the step (None when disabled).
        """
        if not self.enabled:
            return None
        with self._lock:  # take the records; later ones go to the next step
            raw = (self._step, self._t0, self._ref, self._ref_ms, self._host, self._events, self._counters, self._slots)
            self._host, self._events, self._counters, self._slots = [], [], [], []
            self._open = False
        return raw

    def resolve(self, raw: tuple | None) -> Trace:
        """The Trace of records from `take_step`; waits for their CUDA events (the one GPU wait).

        Raises:
            RuntimeError: CUDA spans were recorded but `begin_step` was never called.
        """
        if raw is None:
            return Trace(step=self._step)
        step, t0, ref, ref_ms, host, events, counters, slots = raw

        def ms(t: float) -> float:
            return round((t - t0) * 1e3, 4)

        spans = [(ln, op, int(ly), ph, ms(a), ms(b), int(nb)) for ln, op, ly, ph, nb, a, b in host]
        if events:
            if ref is None:
                raise RuntimeError("CUDA spans recorded before Recorder.begin_step(step); call it first.")
            # The trace's one sync point: the CPU waits for the last recorded end event, which is
            # normally the last GPU work of the step. Events on other streams that might still be
            # pending are waited on too (cheap: almost always already complete).
            events[-1][-1].synchronize()
            for *_, end in events:
                if not end.query():
                    end.synchronize()
            for ln, op, ly, ph, nb, ev0, ev1 in events:
                a = ref.elapsed_time(ev0) + ref_ms  # Note: [GPU clock]
                b = ref.elapsed_time(ev1) + ref_ms
                spans.append((ln, op, int(ly), ph, round(a, 4), round(b, 4), int(nb)))
        meta = {"device": str(self.device), "origin_s": t0}  # host clock at the step's start: where it really ran
        if self._cuda:
            meta["device_name"] = torch.cuda.get_device_name(self.device)
        return Trace(step=step, spans=spans, meta=meta, counters=[(n, ms(t), float(v)) for n, v, t in counters],
                     slots=[(k, int(i), None if ly is None else int(ly), s, ms(t)) for k, i, ly, s, t in slots])


@dataclass(kw_only=True)
class Trace:
    """One step's records; times in ms from the step start.

    Example:
        >>> tr = Trace(step=0, spans=[("compute", "fwd", 0, "fwd", 0.0, 2.0, 0)])
        >>> tr.to_dataframe().dur_ms.tolist()
        [2.0]
    """

    step: int
    """Training step number."""
    spans: list[tuple] = field(default_factory=list)
    """(lane, op, layer, phase, start_ms, end_ms, bytes) per span."""
    counters: list[tuple] = field(default_factory=list)
    """(name, t_ms, value) per counter sample."""
    slots: list[tuple] = field(default_factory=list)
    """(kind, index, layer, state, t_ms) per slot state change."""
    meta: dict = field(default_factory=dict)
    """Free-form: device name, model shape, tokens per step, step time..."""

    def to_dataframe(self) -> pd.DataFrame:
        """Returns one row per span: step, lane, op, layer, phase, start_ms, end_ms, dur_ms, bytes,
        sorted by start_ms."""
        df = pd.DataFrame(self.spans, columns=list(SPAN_COLUMNS)).astype(
            {"lane": object, "op": object, "layer": "int64", "phase": object, "start_ms": "float64",
             "end_ms": "float64", "bytes": "int64"})
        df = df.assign(step=self.step, dur_ms=df.end_ms - df.start_ms)[list(SPAN_FRAME_COLUMNS)]
        return df.sort_values(["start_ms", "end_ms"], kind="stable").reset_index(drop=True)

    def counters_dataframe(self) -> pd.DataFrame:
        """Returns one row per counter sample: name, t_ms, value, sorted by t_ms."""
        df = pd.DataFrame(self.counters, columns=list(COUNTER_COLUMNS)).astype(
            {"name": object, "t_ms": "float64", "value": "float64"})
        return df.sort_values("t_ms", kind="stable").reset_index(drop=True)

    def slots_dataframe(self) -> pd.DataFrame:
        """Returns one row per slot state change: kind, index, layer, state, t_ms, sorted by t_ms.
        `layer` is a nullable Int64 (None for a free slot)."""
        df = pd.DataFrame(self.slots, columns=list(SLOT_COLUMNS)).astype(
            {"kind": object, "index": "int64", "layer": "Int64", "state": object, "t_ms": "float64"})
        return df.sort_values("t_ms", kind="stable").reset_index(drop=True)

    def save(self, path: str | Path) -> None:
        """Writes compact JSON (gzip when `path` ends with .gz); `meta` must be JSON-able (else str)."""
        doc = {"format": _FORMAT, "version": 1, "step": self.step, "meta": self.meta,
               "spans": self.spans, "counters": self.counters, "slots": self.slots}
        with _open(path, "wt") as f:
            json.dump(doc, f, separators=(",", ":"), default=str)

    @classmethod
    def load(cls, path: str | Path) -> Trace:
        """Reads a file written by `save`.

        Raises:
            ValueError: the file is not a megatrain_nb trace.
        """
        with _open(path, "rt") as f:
            doc = json.load(f)
        if not isinstance(doc, dict) or doc.get("format") != _FORMAT:
            raise ValueError(f"{path} is not a {_FORMAT} file (missing 'format': '{_FORMAT}').")
        return cls(step=doc["step"], meta=doc["meta"], spans=[tuple(r) for r in doc["spans"]],
                   counters=[tuple(r) for r in doc["counters"]], slots=[tuple(r) for r in doc["slots"]])


def _open(path, mode: str):
    """Opens text, through gzip when the name ends with .gz."""
    path = Path(path)
    return gzip.open(path, mode, encoding="utf-8") if path.suffix == ".gz" else open(path, mode, encoding="utf-8")


def _union_ms(df: pd.DataFrame) -> float:
    """Total length of the union of [start_ms, end_ms) intervals."""
    total, reach = 0.0, float("-inf")
    for a, b in sorted(zip(df.start_ms, df.end_ms)):
        total += max(0.0, b - max(a, reach))
        reach = max(reach, b)
    return total


_WHY = "Compute idled {dur:.3g} ms before {phase} of layer {layer}: "
_CAUSES = {  # key -> (waited_on, reason, setting to change)
    "h2d": ("h2d", "its weights were still crossing PCIe (transfer slower than compute).",
            "tokens per step (batch or seq)"),
    "h2d-late": ("h2d", "its weights only started crossing PCIe after the previous layer finished "
                 "(no free slot to prefetch into).", "weight_slots"),
    "host-pack": ("packing", "host threads were still packing its weights into pinned buffers.",
                  "pin_store=True (or cast_on_device=True); pinned_budget_bytes"),
    "host-adam": ("optimizer", "the CPU AdamW had not finished that layer.",
                  "placement='auto' (the units the forward needs first update on the device; see "
                  "Session.placement); tokens per step; keep overlap_optimizer=True, grad_clip=None"),
    "d2h": ("d2h", "gradients were still leaving a device grad slot.", "tokens per step (batch or seq)"),
    "device-adam": ("device optimizer", "the device's AdamW of resident units was running (after the backward when "
                    "gated, else beside it on its own stream).", "grad_clip=None and overlap_optimizer=True (device "
                    "updates then overlap the backward)"),
    "host-unpack": ("unpacking", "host threads were still copying gradients out of pinned buffers, so no grad "
                    "slot was free.", "pin_store=True (gradients land in pinned slabs: no unpacking)"),
    None: ("host/launch", "no transfer or host job was running (launch or Python overhead).",
           "tokens per step (fewer, larger launches)"),
}
STALL_COLUMNS = ("start_ms", "end_ms", "dur_ms", "layer", "phase", "waited_on", "diagnosis", "setting")


def find_stalls(spans: pd.DataFrame, *, min_ms: float = 0.05) -> pd.DataFrame:
    """Finds gaps on the compute lane and names what compute waited on.

    A gap is the time from the step start (0) to the first compute span, or between consecutive
    compute spans, of at least `min_ms`. Its cause is the span on another lane that was running
    during the gap and whose end is closest to the gap's end. When that is an h2d copy, the
    optimizer is blamed if the loader recorded a ``wait-update`` in the gap for that layer, or for
    any layer before the copy started (the loader is one FIFO thread: a held load holds the ones
    behind it; the diagnosis then names the unit whose update held it, e.g. the embedding); else packing if a host-pack span of the same layer was still running in the gap
    (chunked copies wait for their chunk), and a lack of free weight slots if the copy only
    started after the gap began. Compute never waits for the optimizer directly, only through a
    load: in traces that record ``wait-update`` spans (the engine's), host-adam spans are not
    candidates; in traces without them (older recordings, `Plan.simulate`) they are.

    Args:
        spans: `Trace.to_dataframe()` (or `Plan.simulate()`); several steps are handled per step.
        min_ms: shortest gap reported.

    Returns:
        A `tables.Table` (a DataFrame, rounded in a notebook), one row per stall: start_ms, end_ms, dur_ms, layer and phase (of the next compute span),
        waited_on ("h2d", "packing", "optimizer", "d2h", "unpacking", "host/launch" or a lane name),
        diagnosis (one sentence), setting (the knob to change); plus step when given.

    Example:
        >>> df = Trace(step=0, spans=[("compute", "fwd", 0, "fwd", 0.0, 2.0, 0),
        ...     ("h2d", "h2d", 1, "io", 1.0, 3.0, 0), ("compute", "fwd", 1, "fwd", 3.0, 5.0, 0)]).to_dataframe()
        >>> find_stalls(df)[["start_ms", "end_ms", "waited_on"]].values.tolist()
        [[2.0, 3.0, 'h2d']]
    """
    if "step" in spans.columns and spans.step.nunique() > 1:
        parts = [find_stalls(g, min_ms=min_ms).assign(step=s) for s, g in spans.groupby("step")]
        return Table(pd.concat(parts, ignore_index=True))
    comp = spans[spans.lane == "compute"].sort_values("start_ms", kind="stable")
    others = spans[spans.lane != "compute"]
    if (others.op == "wait-update").any():  # the engine's own record of holds: AdamW acts only through them
        others = others[others.lane != "host-adam"]
    rows, busy_until = [], 0.0
    for start, end, layer, phase in zip(comp.start_ms, comp.end_ms, comp.layer, comp.phase):
        if start - busy_until >= min_ms:
            rows.append(_explain(busy_until, start, int(layer), phase, others))
        busy_until = max(busy_until, end)
    return Table(pd.DataFrame(rows, columns=list(STALL_COLUMNS)).astype(
        {"start_ms": "float64", "end_ms": "float64", "dur_ms": "float64", "layer": "int64"}))


def _explain(a: float, b: float, layer: int, phase: str, others: pd.DataFrame) -> tuple:
    """One stall row for the compute gap [a, b)."""
    running = others[(others.start_ms < b) & (others.end_ms > a)]
    key, reason = None, None
    if len(running):
        hit = running.loc[(running.end_ms - b).abs().idxmin()]
        key = hit.lane
        if key == "h2d":  # was the copy itself held up by packing, or started late?
            packing = running[(running.lane == "host-pack") & (running.layer == hit.layer)]
            key = "host-pack" if len(packing) else "h2d-late" if hit.start_ms >= a else "h2d"
            waits = running[running.op == "wait-update"]
            held = waits[(waits.layer == hit.layer) | (waits.end_ms <= hit.start_ms)]
            if len(held):  # the load waited for an optimizer update (its own, or one queued before it)
                key = "host-adam"
                unit = int(held.loc[held.end_ms.idxmax()].layer)  # the update that held the loads longest
                if unit != layer:  # the loader is one FIFO thread: this layer's load queued behind that one
                    reason = (f"the CPU AdamW had not finished {'the embedding' if unit < 0 else f'layer {unit}'}, "
                              "whose load this layer's queued behind.")
    waited_on, default, setting = _CAUSES.get(key, (key, f"lane {key} was still running.", "-"))
    return (a, b, b - a, layer, phase, waited_on, _WHY.format(dur=b - a, phase=phase, layer=layer) + (reason or default),
            setting)


def summarize(spans: pd.DataFrame) -> dict:
    """Headline numbers of one step's spans.

    Args:
        spans: `Trace.to_dataframe()` or `Plan.simulate()` of one step.

    Returns:
        A `tables.Summary` (a dict, a table in a notebook) with step_ms (from 0, the step start, to the last end), compute_busy_ms (device updates included),
        compute_busy_share, stall_ms, wait_ms_by_cause (waited_on -> ms), bytes_h2d, bytes_d2h,
        h2d_GBps and d2h_GBps (bytes over the lane's busy time; 0.0 when idle).
    """
    step_ms = float(max(spans.end_ms.max(), 0.0)) if len(spans) else 0.0
    busy = _union_ms(spans[spans.lane.isin(("compute", "device-adam"))])  # both run on the compute stream
    stalls = find_stalls(spans)
    by_cause = {str(k): float(v) for k, v in stalls.groupby("waited_on", sort=True).dur_ms.sum().items()}
    out = {"step_ms": step_ms, "compute_busy_ms": busy,
           "compute_busy_share": busy / step_ms if step_ms else 0.0,
           "stall_ms": float(stalls.dur_ms.sum()), "wait_ms_by_cause": by_cause}
    for lane, lanes in (("h2d", ("h2d",)), ("d2h", ("d2h", "d2h-state"))):  # d2h: gradients and device units' state
        sel = spans[spans.lane.isin(lanes)]
        nbytes, ms = int(sel.bytes.sum()), _union_ms(sel)
        out[f"bytes_{lane}"] = nbytes
        out[f"{lane}_GBps"] = nbytes / ms / 1e6 if ms else 0.0
    return Summary(out)


def slot_segments(slots: pd.DataFrame, *, end_ms: float | None = None) -> pd.DataFrame:
    """Turns slot state changes into segments (each state lasts until the slot's next change).

    Args:
        slots: `Trace.slots_dataframe()`.
        end_ms: where each slot's last state ends; default the last change of any slot.

    Returns:
        kind, index, layer, state, start_ms, end_ms; one row per state change, by kind/index/time.
    """
    cols = ["kind", "index", "layer", "state", "start_ms", "end_ms"]
    if not len(slots):
        return pd.DataFrame(columns=cols)
    end = float(slots.t_ms.max()) if end_ms is None else float(end_ms)
    df = slots.sort_values(["kind", "index", "t_ms"], kind="stable").rename(columns={"t_ms": "start_ms"})
    df["end_ms"] = df.groupby(["kind", "index"]).start_ms.shift(-1).fillna(end)
    return df[cols].reset_index(drop=True)


def add_occupancy(trace: Trace, occ: list) -> None:
    """Slot occupancy at GPU times, into ``trace.slots``: each of the driver's slot uses, ``(kind, index, layer,
    span key, state at its start, state at its end)``, takes the times of the n-th span of its key (lane, op,
    layer, phase): each load / compute / copy-out span marks its slot's state."""
    if not len(trace.spans):
        return
    df = trace.to_dataframe()
    when = {}
    for r in df.itertuples():
        when.setdefault((r.lane, r.op, int(r.layer), r.phase), []).append((r.start_ms, r.end_ms))
    used = {}  # (slot kind, span key) -> spans of that key already matched: the n-th use takes the n-th span
    for kind, index, layer, key, s0, s1 in occ:
        spans = when.get(key, [])
        n = used.get((kind, key), 0)
        if n < len(spans):
            a, b = spans[n]
            trace.slots.append((kind, index, layer, s0, a))
            trace.slots.append((kind, index, layer, s1, b))
        used[(kind, key)] = n + 1
    trace.slots.sort(key=lambda r: r[-1])


def lane_order(lanes) -> list[str]:
    """Known `LANES` first in their order, then the others in order of appearance."""
    seen = list(dict.fromkeys(lanes))
    return [ln for ln in LANES if ln in seen] + [ln for ln in seen if ln not in LANES]


def export_chrome_trace(trace_or_traces: Trace | list[Trace], path: str | Path) -> None:
    """Writes Chrome Trace Event JSON for Perfetto / chrome://tracing (gzip when path ends with .gz).

    One track per lane (plus one per weight/grad/pinned slot), "X" events with args layer/phase/bytes,
    counters as "C" events, and flow arrows from each h2d span of layer k to the first compute span
    of layer k that starts after it. Several traces of one run (each with ``meta["origin_s"]``, the
    recorder's clock at its start) are placed at their real starts, so a span filed under a later
    step that began before it (an update carried over) is drawn where it ran; traces without it
    (older recordings) are laid end to end.

    Args:
        trace_or_traces: one Trace or a list of them (consecutive steps).
        path: output file, .json or .json.gz.
    """
    traces = [trace_or_traces] if isinstance(trace_or_traces, Trace) else list(trace_or_traces)
    frames = [(tr, tr.to_dataframe(), tr.counters_dataframe(), tr.slots_dataframe()) for tr in traces]
    lanes = lane_order([ln for _, df, _, _ in frames for ln in df.lane])
    slot_keys = sorted({(k, int(i)) for *_, sl in frames for k, i in zip(sl.kind, sl["index"])})
    tids = {ln: i + 1 for i, ln in enumerate(lanes)}
    tids.update({f"{k}[{i}]": len(lanes) + j + 1 for j, (k, i) in enumerate(slot_keys)})
    pid = 1
    ev: list[dict] = [{"name": "process_name", "ph": "M", "pid": pid, "tid": 0, "args": {"name": "megatrain"}}]
    for name, tid in tids.items():
        ev.append({"name": "thread_name", "ph": "M", "pid": pid, "tid": tid, "args": {"name": name}})
        ev.append({"name": "thread_sort_index", "ph": "M", "pid": pid, "tid": tid, "args": {"sort_index": tid}})
    offset, flow_id = 0.0, 0
    spans_of = [[0.0, *df.start_ms, *df.end_ms, *cn.t_ms, *sl.t_ms] for _, df, cn, sl in frames]
    origins = [tr.meta.get("origin_s") for tr in traces]
    if all(o is not None for o in origins):  # steps of one run: each at its real start, so a span that began
        base = [(o - origins[0]) * 1e3 for o in origins]  # before its step (negative times) sits where it ran
        first = min(b + min(t) for b, t in zip(base, spans_of))
    for n, (tr, df, cn, sl) in enumerate(frames):
        times = spans_of[n]
        lo, hi = min(times), max(times)
        if all(o is not None for o in origins):
            lo, offset = first - base[n], 0.0

        def us(t_ms: float, lo=lo, offset=offset) -> float:
            return round((t_ms - lo + offset) * 1e3, 3)

        for r in df.itertuples(index=False):
            ev.append({"name": f"{r.op} {r.layer}", "cat": r.phase, "ph": "X", "ts": us(r.start_ms),
                       "dur": round(r.dur_ms * 1e3, 3), "pid": pid, "tid": tids[r.lane],
                       "args": {"op": r.op, "layer": int(r.layer), "phase": r.phase,
                                "bytes": int(r.bytes), "step": tr.step}})
        comp = df[df.lane == "compute"]
        for r in df[(df.lane == "h2d") & (df.op == "h2d")].itertuples(index=False):
            nxt = comp[(comp.layer == r.layer) & (comp.start_ms >= r.end_ms - 1e-3)]  # 1 µs: event jitter
            if not len(nxt):
                continue
            flow_id += 1
            tgt = nxt.iloc[0]
            common = {"name": "weights", "cat": "flow", "id": flow_id, "pid": pid}
            ev.append({**common, "ph": "s", "ts": us(r.start_ms), "tid": tids["h2d"]})
            ev.append({**common, "ph": "f", "bp": "e", "ts": us(tgt.start_ms), "tid": tids["compute"]})
        for r in cn.itertuples(index=False):
            ev.append({"name": r.name, "ph": "C", "ts": us(r.t_ms), "pid": pid, "args": {"value": r.value}})
        for r in slot_segments(sl, end_ms=hi).itertuples(index=False):
            if r.state != "free":
                ev.append({"name": f"{r.state} {r.layer}", "cat": "slot", "ph": "X", "ts": us(r.start_ms),
                           "dur": round((r.end_ms - r.start_ms) * 1e3, 3), "pid": pid,
                           "tid": tids[f"{r.kind}[{r.index}]"], "args": {"layer": str(r.layer), "state": r.state}})
        offset += hi - lo
    with _open(path, "wt") as f:
        json.dump({"traceEvents": ev, "displayTimeUnit": "ms"}, f, separators=(",", ":"))
