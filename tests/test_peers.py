"""bench/peers.py and bench/plot_peers.py on CPU: the job plan, one process per system with a row per
batch (failures included), the ratios against megatrain_nb, and the figures' structure.

The runs use the tiny shape on device "cpu": their timings mean nothing and nothing asserts on them;
what is checked is that each system trains the same model on the same data (same parameter count,
first loss near ln(vocab)) and that every batch of every system leaves exactly one row that says
what happened.
"""
from __future__ import annotations

import json
import math
import statistics
import sys
from pathlib import Path

import pytest
import torch

BENCH = Path(__file__).resolve().parents[1] / "bench"
sys.path.insert(0, str(BENCH))

import peer_systems  # noqa: E402
import peers  # noqa: E402
import plot_peers  # noqa: E402
from shapes import SHAPES, count_params, qwen_config, widened  # noqa: E402


def _run(tmp_path, *args, env=None, monkeypatch=None) -> list[dict]:
    out = tmp_path / "peers.jsonl"
    if env:
        for k, v in env.items():
            monkeypatch.setenv(k, v)
    rows = peers.main(["--device", "cpu", "--tiny", "--steps", "1", "--out", str(out), "--log",
                       str(tmp_path / "peers.log"), *args])
    on_disk = [json.loads(ln) for ln in out.read_text().splitlines()]
    assert on_disk == rows  # each row was appended as it came
    return rows


def test_widened_shapes_keep_head_size_and_grouping():
    for w, (d, h, kv, f) in {1.5: (3072, 24, 3, 16512), 2.0: (4096, 32, 4, 22016)}.items():
        kw = widened(SHAPES["3b"], w)
        assert (kw["hidden_size"], kw["num_attention_heads"], kw["num_key_value_heads"], kw["intermediate_size"]) \
            == (d, h, kv, f)
        assert kw["hidden_size"] // kw["num_attention_heads"] == 128
    kw = widened(SHAPES["0.5b"], 1.5)  # 21 heads, 3 KV heads; and 14 * 1.25 = 17.5 -> 18 heads, 2 KV heads
    assert (kw["num_attention_heads"], kw["num_key_value_heads"]) == (21, 3)
    kw = widened(SHAPES["0.5b"], 1.25)
    assert kw["num_attention_heads"] % kw["num_key_value_heads"] == 0


@pytest.mark.parametrize("shape,layers,width", [("tiny", None, 1.0), ("tiny", 3, 2.0), ("3b", 2, 1.0)])
def test_count_params_matches_the_hf_model(shape, layers, width):
    from transformers import AutoModelForCausalLM

    cfg = qwen_config(shape, layers=layers, seq=64, width=width)
    if shape == "3b":
        cfg.vocab_size = 1024  # the 3B layer shapes (bias, GQA) without a 311M embedding
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(cfg)
    assert count_params(cfg) == sum(p.numel() for p in model.parameters())


def test_published_3b_and_7b_sizes():
    assert count_params(qwen_config("3b")) == 3_085_938_688  # the 3.086B in docs/benchmarks.md
    assert round(count_params(qwen_config("7b")) / 1e9, 3) == 7.616


def test_plan_jobs_core_7b_and_sweeps():
    a = peers.parse(["--sweep", "core", "7b", "depth", "width", "--systems", "native", "zero3", "--sweep-systems",
                     "megatrain-all"])
    jobs = peers.plan_jobs(a)
    core = [j for j in jobs if j.sweep == "core"]
    assert [j.system for j in core] == ["native", "zero3-offload", "zero3-twinflow"]
    assert all(j.batches == [1, 4, 8, 16] and j.shape == "3b" for j in core)
    assert {tuple(j.batches) for j in jobs if j.sweep == "7b"} == {(2, 8)}
    depth = [(j.layers, j.system) for j in jobs if j.sweep == "depth"]
    assert sorted({d for d, _ in depth}) == [36, 72, 108] and len(depth) == 9
    width = [j for j in jobs if j.sweep == "width"]
    assert sorted({j.width for j in width}) == [1.0, 1.5, 2.0] and {j.layers for j in width} == {18}
    assert all(j.batches == [8] for j in jobs if j.sweep in ("depth", "width"))


def test_default_core_is_every_system_and_unknown_names_are_refused():
    assert [j.system for j in peers.plan_jobs(peers.parse([]))] == list(peers.SYSTEMS)
    with pytest.raises(SystemExit, match="unknown system 'deepspeed'"):
        peers.plan_jobs(peers.parse(["--systems", "deepspeed"]))


def test_host_estimate_skips_what_cannot_fit():
    fsdp_7b = peers.Job("fsdp2-offload", "7b", "7b", [2])
    fsdp_3b = peers.Job("fsdp2-offload", "core", "3b", [1])
    assert peers.host_estimate_gib(fsdp_7b) > 126 > peers.host_estimate_gib(fsdp_3b)
    assert peers.host_estimate_gib(peers.Job("megatrain-auto", "7b", "7b", [2])) is None  # its preflight decides
    est = peers.host_estimate_gib(peers.Job("zero3-offload", "core", "3b", [1]))
    assert est == pytest.approx(73.5, rel=0.01)  # the measured RSS it was derived from (LIMITS.md)


def test_zero3_config_offloads_params_and_optimizer():
    c = peer_systems.zero3_config(4, ratio=None, sub_group_size=10**8)
    z = c["zero_optimization"]
    assert z["stage"] == 3 and z["offload_param"]["device"] == "cpu" and z["offload_optimizer"]["device"] == "cpu"
    assert "ratio" not in z["offload_optimizer"] and c["bf16"]["enabled"] and c["optimizer"]["type"] == "AdamW"
    assert peer_systems.zero3_config(4, ratio=0.3, sub_group_size=10**8)["zero_optimization"][
        "offload_optimizer"]["ratio"] == 0.3


def test_same_tokens_for_every_system():
    a, b = peer_systems.token_ids(1, 2, 16, 512), peer_systems.token_ids(1, 2, 16, 512)
    assert torch.equal(a, b) and not torch.equal(a, peer_systems.token_ids(2, 2, 16, 512))


def test_cpu_run_one_process_per_system_failures_included(tmp_path, monkeypatch):
    """native, FSDP2 offload and megatrain_nb train the tiny model on CPU; native runs out of memory at
    batch 2 (pure bf16 follows there) and zero3-offload crashes before its first batch (test hooks):
    every batch of every system leaves one row, and the run goes on."""
    rows = _run(tmp_path, "--systems", "native", "fsdp2-offload", "zero3-offload", "megatrain",
                env={"PEERS_FAULT": "native:oom@2,zero3-offload:crash"}, monkeypatch=monkeypatch)
    got = [(r["system"], r["batch"], r["status"]) for r in rows]
    assert got == [("native", 1, "ok"), ("native", 2, "oom"), ("native-bf16", 2, "ok"),
                   ("fsdp2-offload", 1, "ok"), ("fsdp2-offload", 2, "ok"),
                   ("zero3-offload", 1, "crashed"), ("zero3-offload", 2, "not-run"),
                   ("megatrain", 1, "ok"), ("megatrain", 2, "ok")], got
    by = {(r["system"], r["batch"]): r for r in rows}
    assert "exit code 7" in by["zero3-offload", 1]["error"]
    assert "PEERS_FAULT" in by["native", 2]["error"] and by["native-bf16", 2]["settings"]["params_dtype"] == "bf16"
    n = count_params(qwen_config("tiny"))
    for r in rows:
        assert set(peer_systems.ROW_KEYS) <= set(r) and r["layers"] == 2 and r["hidden"] == 64
        assert r["params"] == n and r["tokens"] == r["batch"] * 64
        if r["status"] != "ok":
            continue
        assert abs(r["loss_first"] - math.log(512)) < 0.3  # same model family at random init, same data
        rounding = 5e-4 + 5e-5 / r["step_s"]  # model_tflops keeps 4 digits, step_s 4 decimals (CPU: ~0.03 s)
        assert r["model_tflops"] == pytest.approx(6 * n * r["tokens"] / r["step_s"] / 1e12, rel=rounding)
        assert r["host_rss_peak_gib"] > 0 and r["peak_gpu_gib"] is None
        assert r["optimizer_s"] is not None and r["optimizer_share"] is not None
    assert by["fsdp2-offload", 1]["settings"]["master"] == "fp32 on the host"
    assert "waits_ms" in by["megatrain", 1] and by["megatrain", 1]["settings"]["placement"] is None
    for b in (1, 2):  # one busy share per timed step (its trace resolved after them), the median of them
        r = by["megatrain", b]
        assert len(r["compute_busy_all"]) == len(r["step_s_all"]) and 0 < min(r["compute_busy_all"]) <= 1
        assert r["compute_busy_median"] == pytest.approx(statistics.median(r["compute_busy_all"]), abs=1e-3)
        assert r["compute_busy_all"][-1] == r["compute_busy_share"]  # the last step's is the saved trace's
        assert r["host_adam_G_params_per_s"] > 0  # CPU: every unit updates on the host
    md = plot_peers.summary_markdown(rows)
    assert "| native | " in md and "megatrain / peer" in md and "- zero3-offload batch 1: crashed" in md


def test_a_hung_child_is_killed_with_its_group(tmp_path, monkeypatch):
    import psutil

    rows = _run(tmp_path, "--systems", "zero3-twinflow", "--job-timeout", "8",
                env={"PEERS_FAULT": "zero3-twinflow:hang"}, monkeypatch=monkeypatch)
    assert [(r["batch"], r["status"]) for r in rows] == [(1, "timeout"), (2, "not-run")]
    cmds = [" ".join(p.info["cmdline"] or []) for p in psutil.process_iter(["cmdline"])]
    alive = [c for c in cmds if "--child" in c and "zero3-twinflow" in c]
    assert not alive


def test_per_process_batch_splits_jobs(capsys):
    peers.main(["--tiny", "--systems", "native", "megatrain", "--per-process", "batch", "--dry-run"])
    jobs = [json.loads(ln) for ln in capsys.readouterr().out.splitlines()]
    assert [(j["system"], j["batches"]) for j in jobs] == [("native", [1]), ("native", [2]), ("megatrain", [1]),
                                                           ("megatrain", [2])]


def test_budget_leaves_not_run_rows(tmp_path):
    rows = _run(tmp_path, "--systems", "native", "megatrain", "--budget-s", "0")
    assert [(r["system"], r["status"]) for r in rows] == [("native", "not-run")] * 2 + [("megatrain", "not-run")] * 2


def _synthetic() -> list[dict]:
    """Rows shaped like a GPU run's (made-up numbers: structure only, never shown as results)."""
    rows = []
    tf = {"megatrain-auto": [100, 300, 330, 340], "native": [80, 260, 300, None], "fsdp2-offload": [20, 100, 150, 200],
          "zero3-offload": [10, 80, 120, 200], "zero3-twinflow": [15, 90, 130, 210]}
    for s, vals in tf.items():
        for b, v in zip((1, 4, 8, 16), vals):
            rows.append(dict(system=s, sweep="core", shape="3b", layers=36, hidden=2048, width=1.0, batch=b, seq=4096,
                             status="ok" if v else "oom", error=None if v else "CUDA out of memory", model_tflops=v,
                             step_s=1.0, tokens_per_s=1.0, optimizer_share=0.1, peak_gpu_gib=10.0,
                             host_rss_peak_gib=50.0, params=3_085_938_688))
    for L, v in ((36, 330), (72, 325), (108, 320)):
        rows.append(dict(system="megatrain-auto", sweep="depth", shape="3b", layers=L, hidden=2048, width=1.0, batch=8,
                         seq=4096, status="ok", model_tflops=v, peak_gpu_gib=60.0, compute_busy_share=0.95,
                         waits_ms={"h2d": 3.0}, params=L * 10**8))
    for w, d, v in ((1.0, 2048, 330), (1.5, 3072, 350), (2.0, 4096, None)):
        rows.append(dict(system="megatrain-auto", sweep="width", shape="3b", layers=18, hidden=d, width=w, batch=8,
                         seq=4096, status="ok" if v else "host-oom", model_tflops=v, peak_gpu_gib=70.0,
                         compute_busy_share=0.7, waits_ms={"optimizer": 200.0, "h2d": 50.0}, params=d * 10**6,
                         error=None if v else "killed: host RAM available fell below 3 GiB"))
    return rows


def test_ratios_and_targets_on_synthetic_rows():
    df = plot_peers.frame(_synthetic())
    rt = plot_peers.ratios(df)
    assert set(rt.reference) == {"megatrain-auto"}
    r = rt.set_index(["system", "batch"]).ratio
    assert r["native", 4] == pytest.approx(300 / 260) and r["zero3-offload", 1] == pytest.approx(10.0)
    assert math.isnan(r["native", 16])  # the peer ran out of memory: no ratio
    tg = plot_peers.targets(df).set_index(["batch", "peer"])
    assert tg.loc[(1, "native"), "met"] and tg.loc[(1, "fsdp2-offload"), "met"]  # 1.25 >= 1.0, 5.0 >= 4.0
    assert tg.loc[(4, "native"), "met"] == False  # noqa: E712 - 300 / 260 = 1.15 < 1.2 (None would mean no data)
    assert tg.loc[(16, "zero3-offload"), "ratio"] == pytest.approx(1.7) and tg.loc[(16, "zero3-offload"), "met"]
    assert tg.loc[(16, "zero3-twinflow"), "met"] and len(tg) == len(plot_peers.TARGETS)


def test_bound_names_what_limits_a_point():
    assert plot_peers.bound({"compute_busy_share": 0.95, "waits_ms": {"h2d": 3.0}}) == "compute"
    assert plot_peers.bound({"compute_busy_share": 0.7, "waits_ms": {"optimizer": 200.0, "h2d": 50.0}}) \
        == "optimizer (200 ms idle)"


def test_summary_markdown_tables():
    md = plot_peers.summary_markdown(_synthetic())
    assert "| megatrain-auto | 100.0 | 300.0 | 330.0 | 340.0 |" in md
    assert "| native | 80.0 | 260.0 | 300.0 | OOM |" in md
    assert "| 3b 36L | native | 1.25 | 1.15 | 1.1 |  |" in md  # the ratio table: the OOM point has none
    width = md.split("### width sweep")[1]
    assert "| host-oom |" in width and "host RAM available fell" in width and "optimizer (200 ms idle)" in width
    depth = md.split("### depth sweep")[1].split("###")[0]
    assert "| megatrain-auto | 108 | 10.8 | 8 | ok | 320.0 | 0.97 | 60.0 | 1.0 |" in depth and "| compute |" in depth


def test_figures_structure():
    figs = plot_peers.figures(plot_peers.frame(_synthetic()))
    assert set(figs) == {"batch", "depth", "width"}
    batch = figs["batch"]
    names = [t.name for t in batch.data]
    assert names == ["megatrain-auto", "native", "fsdp2-offload", "zero3-offload", "zero3-twinflow"]
    native = batch.data[1]
    assert list(native.x) == [1, 4, 8] and list(native.y) == [80, 260, 300]  # the OOM point is left out
    assert "model TFLOPS" in batch.layout.yaxis.title.text and batch.layout.xaxis.type == "log"
    assert list(batch.layout.xaxis.tickvals) == [1, 4, 8, 16]
    depth = figs["depth"]
    assert [t.name for t in depth.data] == ["megatrain-auto TFLOPS", "megatrain-auto peak GPU GiB"]
    assert list(depth.data[0].x) == [36, 72, 108] and depth.data[1].yaxis == "y2"
    assert list(figs["width"].data[0].x) == [2048, 3072]  # the host-OOM point is not drawn
    assert figs["width"].layout.xaxis.title.text == "hidden size"


def test_plot_main_writes_html(tmp_path):
    rows = tmp_path / "rows.jsonl"
    rows.write_text("\n".join(json.dumps(r) for r in _synthetic()))
    figs = plot_peers.figures(plot_peers.frame(plot_peers.load_rows([rows])))
    written = plot_peers.write(figs, str(tmp_path), "t", png=False)  # PNG: kaleido drives a Chrome, seconds each
    assert {Path(p).name for p in written} == {"t_batch.html", "t_depth.html", "t_width.html"}
    assert "plotly" in (tmp_path / "t_batch.html").read_text()[:5000].lower()


def test_megatrain_recompute_recomputes_every_layer_with_auto_placement():
    """The depth sweep's fixed setting: placement "auto" with checkpoint_every=1, said in the row's settings."""
    cfg = qwen_config("tiny", seq=64)
    sys_ = peer_systems._build({"system": "megatrain-recompute", "batches": [1]}, cfg, torch.device("cpu"))
    try:
        assert sys_.settings == {"placement": "auto", "default_settings": False, "checkpoint_every": 1}
        ids = torch.randint(0, cfg.vocab_size, (1, 64))
        loss, _ = sys_.step(ids)
        assert math.isfinite(loss)
        assert sys_.session.engine.cfg.checkpoint_every == 1 and not any(sys_.session.engine.keep)
    finally:
        sys_.session.close()
    assert peers.expand(["megatrain-recompute", "megatrain-host-recompute"]) == ["megatrain-recompute",
                                                                               "megatrain-host-recompute"]
    host = peer_systems._build({"system": "megatrain-host-recompute", "batches": [1]}, cfg, torch.device("cpu"))
    try:
        assert host.settings == {"placement": "host", "default_settings": False, "checkpoint_every": 1,
                                 "offload_checkpoints": True}
        assert host.session.engine.cfg.offload_checkpoints is True
    finally:
        host.session.close()


def test_batch_figure_keeps_one_colour_and_one_legend_entry_per_system_across_panels():
    """A system seen first in the second panel still gets a legend entry, and a system's colour is the same
    in both panels (s6's 3B panel drew ZeRO-3 and Twin-Flow without a name, megatrain in another colour)."""
    rows = [dict(r, system=s, shape=shape, layers=L) for shape, L, systems in
            (("7b", 28, ("megatrain-auto", "native")), ("3b", 36, ("megatrain-auto", "zero3-offload")))
            for s in systems for r in _synthetic()[:1]]
    fig = plot_peers.figures(plot_peers.frame(rows))["batch"]
    legend = [t.name for t in fig.data if t.showlegend]
    assert legend == ["megatrain-auto", "native", "zero3-offload"]
    colours = {}
    for t in fig.data:
        colours.setdefault(t.name, set()).add(t.line.color)
    assert all(len(c) == 1 for c in colours.values()) and len({c.pop() for c in colours.values()}) == 3


def test_sweep_figure_draws_a_systems_tflops_and_memory_in_one_colour_and_systems_apart():
    """Depth: each system's TFLOPS (solid) and peak GPU memory (dotted, right axis) share its colour; two systems
    differ (the s7 depth figure drew four colours for two systems' pairs, so a reader could not pair them)."""
    depth = [r for r in _synthetic() if r["sweep"] == "depth"]
    rows = depth + [dict(r, system="megatrain-host-recompute", peak_gpu_gib=19.0) for r in depth]
    fig = plot_peers.figures(plot_peers.frame(rows))["depth"]
    by = {t.name: t for t in fig.data}
    for s, gib in (("megatrain-auto", 60.0), ("megatrain-host-recompute", 19.0)):
        tf, mem = by[f"{s} TFLOPS"], by[f"{s} peak GPU GiB"]
        assert tf.line.color == mem.line.color and tf.line.dash is None and mem.line.dash == "dot"
        assert mem.yaxis == "y2" and list(mem.y) == [gib] * 3
    assert by["megatrain-auto TFLOPS"].line.color != by["megatrain-host-recompute TFLOPS"].line.color
