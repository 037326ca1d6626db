"""Tests for megatrain_nb.view.trace: recorder, Trace round trip, stall analysis, Chrome export."""

from __future__ import annotations

import gzip
import json
import threading
import time
from pathlib import Path

import pandas as pd
import pytest
import torch

from megatrain_nb.view.trace import (LANES, Recorder, Trace, export_chrome_trace, find_stalls, lane_order,
                                slot_segments, summarize)
from view_helpers import check_chrome

SPAN_COLS = ["step", "lane", "op", "layer", "phase", "start_ms", "end_ms", "dur_ms", "bytes"]
DATA = Path(__file__).parents[1] / "fixtures"


def hand_trace(*extra) -> Trace:
    """compute [0,2] and [3,5] with the weights of layer 1 crossing PCIe over [1,3]."""
    return Trace(step=7, spans=[("compute", "fwd", 0, "fwd", 0.0, 2.0, 0),
                                ("h2d", "h2d", 1, "io", 1.0, 3.0, 2_000_000),
                                ("compute", "fwd", 1, "fwd", 3.0, 5.0, 0), *extra])


def test_recorder_on_cpu_collects_spans_from_two_threads():
    rec = Recorder(device="cpu")
    rec.begin_step(3)

    def work(lane):
        for i in range(5):
            with rec.span(lane, "pack", i, "io", nbytes=10):
                pass

    threads = [threading.Thread(target=work, args=(ln,)) for ln in ("host-pack", "host-adam")]
    for t in threads:
        t.start()
    tok = rec.cuda_begin("compute", "fwd", 0, "fwd")  # cpu device: host clock
    rec.cuda_end(tok)
    for t in threads:
        t.join()
    rec.counter("host_rss_bytes", 123.0)
    rec.slot("weight", 1, 4, "loading")
    tr = rec.end_step()

    df = tr.to_dataframe()
    assert list(df.columns) == SPAN_COLS
    assert tr.step == 3 and (df.step == 3).all()
    assert df.lane.value_counts().to_dict() == {"host-pack": 5, "host-adam": 5, "compute": 1}
    assert df.bytes.sum() == 100
    assert (df.start_ms >= 0).all() and (df.dur_ms >= 0).all()
    assert df.start_ms.is_monotonic_increasing
    assert list(tr.counters_dataframe().columns) == ["name", "t_ms", "value"]
    assert tr.counters_dataframe().value.tolist() == [123.0]
    slots = tr.slots_dataframe()
    assert list(slots.columns) == ["kind", "index", "layer", "state", "t_ms"]
    assert slots[["kind", "index", "layer", "state"]].values.tolist() == [["weight", 1, 4, "loading"]]
    assert tr.meta["device"] == "cpu"


def test_begin_step_drops_an_unfinished_step():
    rec = Recorder()
    rec.begin_step(0)
    with rec.span("host-adam", "adam", 0, "optim"):
        pass
    rec.begin_step(1)
    assert rec.end_step().spans == []


def test_spans_after_end_step_go_to_the_next_step_before_zero():
    rec = Recorder()
    rec.begin_step(0)
    first = rec.end_step()
    with rec.span("host-adam", "adam", 0, "optim"):  # the overlapped AdamW tail of step 0
        pass
    rec.begin_step(1)
    with rec.span("host-pack", "pack", 0, "fwd"):
        pass
    df = rec.end_step().to_dataframe()
    assert first.spans == [] and df.lane.tolist() == ["host-adam", "host-pack"]
    assert df.end_ms[0] <= 0.0 <= df.start_ms[1]


def test_disabled_recorder_records_nothing():
    rec = Recorder(enabled=False)
    rec.begin_step(5)
    with rec.span("compute", "fwd", 0, "fwd"):
        pass
    assert rec.cuda_begin("h2d", "h2d", 0, "io") is None
    rec.cuda_end(None)
    rec.counter("host_rss_bytes", 1.0)
    rec.slot("weight", 0, 0, "ready")
    tr = rec.end_step()
    assert (tr.spans, tr.counters, tr.slots) == ([], [], [])
    assert list(tr.to_dataframe().columns) == SPAN_COLS and len(tr.to_dataframe()) == 0


def test_find_stalls_names_the_transfer_compute_waited_on():
    stalls = find_stalls(hand_trace().to_dataframe())
    assert stalls[["start_ms", "end_ms", "dur_ms", "layer", "phase", "waited_on", "setting"]].values.tolist() == [
        [2.0, 3.0, 1.0, 1, "fwd", "h2d", "tokens per step (batch or seq)"]]
    assert stalls.diagnosis[0].startswith("Compute idled 1 ms before fwd of layer 1")


def test_find_stalls_blames_packing_when_the_copy_waits_for_its_chunks():
    spans = hand_trace(("host-pack", "pack", 1, "fwd", 0.9, 2.95, 0)).to_dataframe()  # still packing layer 1
    assert find_stalls(spans)[["waited_on", "setting"]].values.tolist() == [["packing", "pin_store=True (or cast_on_device=True); pinned_budget_bytes"]]
    other_layer = hand_trace(("host-pack", "pack", 2, "fwd", 0.9, 2.95, 0)).to_dataframe()
    assert find_stalls(other_layer).waited_on.tolist() == ["h2d"]


@pytest.mark.parametrize("extra, waited_on, setting", [
    ([("host-pack", "pack", 1, "io", 0.5, 2.5, 0)], "packing", "pin_store=True (or cast_on_device=True); pinned_budget_bytes"),
    ([], "h2d", "weight_slots"),
    ([("host-adam", "adam", 1, "optim", 1.0, 3.0, 0)], "optimizer",
     "placement='auto' (the units the forward needs first update on the device; see Session.placement); "
     "tokens per step; keep overlap_optimizer=True, grad_clip=None"),
    ([("d2h", "d2h", 2, "io", 1.5, 2.9, 0)], "d2h", "tokens per step (batch or seq)"),
    ([("host-unpack", "unpack", 2, "bwd", 1.5, 2.9, 0)], "unpacking", "pin_store=True (gradients land in pinned slabs: no unpacking)"),
])
def test_find_stalls_causes(extra, waited_on, setting):
    late_h2d = ("h2d", "h2d", 1, "io", 2.5, 3.0, 0)  # starts inside the gap [2, 3)
    spans = [("compute", "fwd", 0, "fwd", 0.0, 2.0, 0), ("compute", "fwd", 1, "fwd", 3.0, 5.0, 0), *extra]
    if waited_on in ("packing", "h2d"):
        spans.append(late_h2d)
    stalls = find_stalls(Trace(step=0, spans=spans).to_dataframe())
    assert stalls[["waited_on", "setting"]].values.tolist() == [[waited_on, setting]]


def test_find_stalls_names_the_update_a_queued_load_waited_behind():
    """A 3B x 1 stream trace's start (H200, 2026-12-01): the embedding's host AdamW held its own load, and layer 0's load
    queued behind it; the stall names the embedding, not layer 0."""
    spans = [("host-adam", "adam", -1, "optim", 2.4, 69.4, 0), ("host-pack", "wait-update", -1, "io", 1.9, 69.8, 0),
             ("h2d", "h2d", -1, "io", 78.4, 82.2, 0), ("h2d", "h2d", 0, "io", 84.2, 90.8, 0),
             ("compute", "fwd", 0, "fwd", 92.3, 94.0, 0)]
    stall = find_stalls(Trace(step=0, spans=spans).to_dataframe()).iloc[0]
    assert (stall.waited_on, stall.layer) == ("optimizer", 0)
    assert stall.diagnosis.endswith("the CPU AdamW had not finished the embedding, whose load this layer's queued behind.")
    own = [*spans[:1], ("host-pack", "wait-update", 0, "io", 1.9, 69.8, 0), *spans[3:]]  # layer 0's own update
    assert find_stalls(Trace(step=0, spans=own).to_dataframe()).diagnosis[0].endswith("had not finished that layer.")


def test_find_stalls_step_start_launch_gaps_and_threshold():
    spans = [("h2d", "h2d", 0, "io", 0.0, 1.0, 0), ("compute", "fwd", 0, "fwd", 1.0, 2.0, 0),
             ("compute", "fwd", 1, "fwd", 2.04, 3.0, 0), ("compute", "fwd", 2, "fwd", 3.5, 4.0, 0)]
    stalls = find_stalls(Trace(step=0, spans=spans).to_dataframe())
    assert stalls[["start_ms", "end_ms", "layer", "waited_on"]].values.tolist() == [
        [0.0, 1.0, 0, "h2d"], [3.0, 3.5, 2, "host/launch"]]
    assert len(find_stalls(Trace(step=0, spans=spans).to_dataframe(), min_ms=0.6)) == 1


def test_find_stalls_per_step_and_empty():
    a, b = hand_trace().to_dataframe(), Trace(step=8, spans=hand_trace().spans).to_dataframe()
    stalls = find_stalls(pd.concat([a, b], ignore_index=True))
    assert stalls.step.tolist() == [7, 8]
    empty = find_stalls(Trace(step=0).to_dataframe())
    assert list(empty.columns) == ["start_ms", "end_ms", "dur_ms", "layer", "phase", "waited_on", "diagnosis",
                                   "setting"] and len(empty) == 0


def test_summarize_exact_numbers():
    out = summarize(hand_trace(("d2h", "d2h", 0, "io", 2.0, 2.5, 1_000_000)).to_dataframe())
    assert out == {"step_ms": 5.0, "compute_busy_ms": 4.0, "compute_busy_share": 0.8, "stall_ms": 1.0,
                   "wait_ms_by_cause": {"h2d": 1.0}, "bytes_h2d": 2_000_000, "h2d_GBps": 1.0,
                   "bytes_d2h": 1_000_000, "d2h_GBps": 2.0}


def test_slot_segments():
    tr = Trace(step=0, slots=[("weight", 0, 3, "loading", 0.0), ("weight", 0, 3, "ready", 1.5),
                              ("weight", 1, None, "free", 0.0), ("weight", 0, None, "free", 4.0)])
    seg = slot_segments(tr.slots_dataframe(), end_ms=6.0)
    assert seg[["index", "state", "start_ms", "end_ms"]].values.tolist() == [
        [0, "loading", 0.0, 1.5], [0, "ready", 1.5, 4.0], [0, "free", 4.0, 6.0], [1, "free", 0.0, 6.0]]


def test_lane_order_puts_known_lanes_first():
    assert lane_order(["x", "host-adam", "compute", "x", "y"]) == ["compute", "host-adam", "x", "y"]
    assert LANES[0] == "compute"


@pytest.mark.parametrize("name", ["t.json", "t.json.gz"])
def test_save_load_round_trip(tmp_path, name):
    tr = hand_trace()
    tr.counters = [("host_rss_bytes", 0.5, 1e9)]
    tr.slots = [("weight", 0, 1, "ready", 3.0), ("grad", 1, None, "free", 4.0)]
    tr.meta = {"device_name": "NVIDIA H200", "tokens": 16384}
    tr.save(tmp_path / name)
    back = Trace.load(tmp_path / name)
    assert back == tr
    assert back.to_dataframe().equals(tr.to_dataframe())
    if name.endswith(".gz"):
        assert json.loads(gzip.open(tmp_path / name).read())["format"] == "megatrain_nb.trace"


def test_load_rejects_other_json(tmp_path):
    (tmp_path / "x.json").write_text('{"traceEvents": []}')
    with pytest.raises(ValueError, match="not a megatrain_nb.trace"):
        Trace.load(tmp_path / "x.json")


def test_chrome_export_one_trace(tmp_path):
    tr = hand_trace()
    tr.counters = [("pinned_in_use_bytes", 1.0, 5.0)]
    export_chrome_trace(tr, tmp_path / "t.json")
    doc = json.loads((tmp_path / "t.json").read_text())
    ev = doc["traceEvents"]
    check_chrome(ev, {"compute", "h2d"})
    flows = [e for e in ev if e["ph"] in "sf"]
    assert [(e["ph"], e["ts"]) for e in flows] == [("s", 1000.0), ("f", 3000.0)]  # h2d L1 -> fwd L1
    assert [e["args"] for e in ev if e["ph"] == "C"] == [{"value": 5.0}]
    tid = {e["args"]["name"]: e["tid"] for e in ev if e["name"] == "thread_name"}
    assert {e["tid"] for e in ev if e["ph"] == "X"} == {tid["compute"], tid["h2d"]}


def test_chrome_export_several_steps_gz(tmp_path):
    trs = [hand_trace(), Trace(step=8, spans=hand_trace().spans)]
    export_chrome_trace(trs, tmp_path / "t.json.gz")
    ev = json.loads(gzip.open(tmp_path / "t.json.gz").read())["traceEvents"]
    check_chrome(ev, {"compute", "h2d"})
    x = sorted(e["ts"] for e in ev if e["ph"] == "X" and e["args"]["op"] == "fwd")
    assert x == [0.0, 3000.0, 5000.0, 8000.0]  # second step laid after the first (5 ms long)
    assert len([e for e in ev if e["ph"] == "s"]) == 2


def test_chrome_export_of_synthetic_fixture(tmp_path):
    tr = Trace.load(DATA / "synthetic_step.trace.json")
    export_chrome_trace(tr, tmp_path / "s.json")
    ev = json.loads((tmp_path / "s.json").read_text())["traceEvents"]
    check_chrome(ev, set(tr.to_dataframe().lane))
    n_h2d = sum(1 for s in tr.spans if s[1] == "h2d")  # every load feeds a later compute of its unit
    assert len([e for e in ev if e["ph"] == "s"]) == n_h2d


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_recorder_puts_cuda_spans_on_the_host_axis():
    rec = Recorder(device="cuda")
    copy, compute = torch.cuda.Stream(), torch.cuda.Stream()
    torch.cuda.synchronize()
    rec.begin_step(4)

    def loader():  # the engine begins h2d spans from its packer thread
        tok = rec.cuda_begin("h2d", "h2d", 0, "fwd", 1 << 20, copy)
        with torch.cuda.stream(copy):
            torch.cuda._sleep(4_000_000)  # ~2 ms of GPU time on the copy stream
        rec.cuda_end(tok, copy)

    t = threading.Thread(target=loader)
    t.start()
    t.join()
    loaded = torch.cuda.Event()
    loaded.record(copy)
    compute.wait_event(loaded)
    tok = rec.cuda_begin("compute", "fwd", 0, "fwd", 0, compute)
    with torch.cuda.stream(compute):
        torch.cuda._sleep(2_000_000)
    rec.cuda_end(tok, compute)
    with rec.span("host-pack", "pack", 1, "fwd"):  # runs while the GPU sleeps
        time.sleep(0.001)
    df = rec.end_step().to_dataframe().set_index("lane")
    h2d, comp, pack = df.loc["h2d"], df.loc["compute"], df.loc["host-pack"]
    assert h2d.dur_ms > 0.5 and comp.dur_ms > 0.25
    assert comp.start_ms >= h2d.end_ms - 0.01  # the wait_event order survives on the axis
    assert 0.0 <= h2d.start_ms < pack.start_ms < h2d.end_ms  # GPU and host clocks line up
    assert find_stalls(df.reset_index()).waited_on.tolist() == ["h2d"]


def test_chrome_export_places_steps_of_one_run_where_they_ran(tmp_path):
    """A span filed under step 2 that began 3 ms before it (an update carried over) is exported inside
    step 1's time, where it really ran, when the traces carry their start on the recorder's clock."""
    one = Trace(step=1, spans=[("compute", "fwd", 0, "fwd", 0.0, 12.0, 0)], meta={"origin_s": 100.000})
    two = Trace(step=2, spans=[("host-adam", "adam", 0, "optim", -3.0, 1.0, 0), ("compute", "fwd", 0, "fwd", 0.5, 4.0, 0)],
                meta={"origin_s": 100.012})
    export_chrome_trace([one, two], tmp_path / "t.json")
    ev = [e for e in json.loads((tmp_path / "t.json").read_text())["traceEvents"] if e["ph"] == "X"]
    ts = {(e["args"]["step"], e["args"]["op"]): e["ts"] for e in ev}
    assert ts[(1, "fwd")] == 0.0 and ts[(2, "fwd")] == pytest.approx(12500.0)
    assert ts[(2, "adam")] == pytest.approx(9000.0)  # 12 ms - 3 ms: during step 1, not after it


def test_recorded_traces_carry_their_origin():
    rec = Recorder(enabled=True, device="cpu")
    rec.begin_step(0)
    with rec.span("host-adam", "adam", 0, "optim"):
        pass
    assert isinstance(rec.end_step().meta["origin_s"], float)
