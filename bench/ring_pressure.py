"""The gradient ring's back-pressure, shown: the same steps with the host's AdamW as fast as it runs, then held
back by a deliberate delay before each unit's update, each traced; one JSON row per setting and the timeline of
the held-back step.

Run from the repository root, e.g. (on the CPU box, 6 layers of the 0.5B's width):
    python bench/ring_pressure.py --shape 0.5b --layers 6 --batch 1 --seq 256 --device cpu --adam-delay 0.5 \
        --out out/ring_pressure --rows bench/results/cpu-DATE-ring.jsonl
writes out/ring_pressure.html (the held-back step's timeline, plotly.js inlined: opens offline) and, with --png,
out/ring_pressure.png (Chromium's screenshot of that page, where /usr/bin/chromium and playwright are).
With --trace FILE it runs nothing and draws a step saved elsewhere instead (``bench/throughput.py --save-trace`` on
a GPU, where the host falls behind with no delay at all), e.g.
    python bench/ring_pressure.py --trace bench/traces/auto/FILE.json.gz --out docs/img/NAME --png

What a row holds: the step time (median of the timed steps), the ring's layout and bytes, the time the
unpacker waited for a ring buffer (``wait-ring`` spans on lane "host-unpack"), the time compute waited per cause
(``Session.stalls()``), and the host's AdamW time. The delay is the engine's test hook (``Engine.delays``,
lane "host-adam": seconds before each unit's update), not a model of any machine: it makes the host fall behind
on purpose so the ring's wait, and the backward's wait behind it, are visible. Note [Gradient ring] in
``host/grad_ring.py`` says why the device never runs more than the ring ahead of the host.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, os.path.dirname(__file__))
from rows import emit  # noqa: E402
from shapes import GPT_OSS, SHAPES, bench_config  # noqa: E402

from megatrain_nb import Session  # noqa: E402


def run(cfg, a, delay: float) -> tuple[dict, Session]:
    """(row, session) of ``a.warmup`` + ``a.steps`` steps with ``delay`` seconds before each host update."""
    s = Session.from_config(cfg, seed=0, device=a.device, lr=1e-5, optimizer_state=a.optimizer_state,
                            grad_ring_overflow=a.ring_overflow == "on")
    if s.store.ring is None:
        raise SystemExit(f"the gradient ring is off here ({s.memory_report()['gradients']}): nothing to show")
    s.engine.delays = {"host-adam": delay} if delay else {}
    g = torch.Generator().manual_seed(0)
    times = []
    for k in range(a.warmup + a.steps):
        r = s.step({"input_ids": torch.randint(0, cfg.vocab_size, (a.batch, a.seq), generator=g)})
        if k >= a.warmup:
            times.append(r.seconds)
    spans = s.trace.to_dataframe()
    ring = spans[spans.op == "wait-ring"]
    adam = spans[(spans.lane == "host-adam") & (spans.op == "adam")]
    stalls = s.stalls()
    waits = {} if not len(stalls) else stalls.groupby("waited_on").dur_ms.sum().round(1).to_dict()
    row = dict(subject="ring", shape=a.shape, layers=cfg.num_hidden_layers, batch=a.batch, seq=a.seq,
               device=a.device, optimizer_state=a.optimizer_state, adam_delay_s=delay, grad_ring_overflow=a.ring_overflow,
               step_s=round(statistics.median(times), 4), step_s_all=[round(x, 4) for x in times],
               ring=s.store.ring.describe(), ring_bytes=s.store.ring.nbytes,
               wait_ring_ms=round(float(ring.dur_ms.sum()), 1), wait_ring_spans=int(len(ring)),
               host_adam_ms=round(float(adam.dur_ms.sum()), 1),  # the delays are outside these spans
               compute_waits_ms=waits, step_traced=s.engine.steps_done,
               gpu=torch.cuda.get_device_name(0) if a.device.startswith("cuda") else "cpu", torch=torch.__version__)
    return row, s


def draw_saved(path: str, out: str, *, png: bool) -> None:
    """STEM.html (and STEM.png) of a saved step's timeline, its compute stalls banded, with the unpacker's wait for
    ring buffers summed in the title."""
    from megatrain_nb.view.trace import Trace, find_stalls
    from megatrain_nb.view.viz import timeline

    try:
        tr = Trace.load(path)
    except (OSError, ValueError) as e:
        raise SystemExit(f"--trace {path}: {e}")
    df = tr.to_dataframe()
    ring = df[df.op == "wait-ring"]
    m = tr.meta
    fig = timeline(df, stalls=find_stalls(df), title=(
        f"{m.get('shape', '?')} x {m.get('batch', '?')} x {m.get('seq', '?')}, {m.get('gpu', m.get('device', '?'))}: "
        f"step {m.get('step_s', float('nan')):.3f} s; the unpacker waited {ring.dur_ms.sum():.0f} ms for ring buffers "
        f"({len(ring)} times)"))
    html, shot = Path(out + ".html"), Path(out + ".png")
    html.parent.mkdir(parents=True, exist_ok=True)
    fig.write_html(html, include_plotlyjs=True, full_html=True)
    if png:
        screenshot(html, shot)
    print(f"wrote {html}" + (f" and {shot}" if png else ""))


def screenshot(html: Path, png: Path) -> None:
    """Chromium's screenshot of ``html`` (headless, through playwright), as tests/test_browser.py drives it."""
    from playwright.sync_api import sync_playwright

    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=os.environ.get("MEGATRAIN_CHROMIUM", "/usr/bin/chromium"),
                                     headless=True, args=["--no-sandbox"])
        page = browser.new_page(viewport={"width": 1200, "height": 700})
        page.goto(html.resolve().as_uri())
        page.wait_for_selector(".main-svg")
        page.locator(".js-plotly-plot").first.screenshot(path=str(png))  # the figure alone
        browser.close()


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", default="3b", choices=[*SHAPES, *GPT_OSS], help="bench/shapes.py (default: %(default)s)")
    ap.add_argument("--layers", type=int, default=None, help="fewer layers than the shape's (a quick CPU run)")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--seq", type=int, default=4096)
    ap.add_argument("--steps", type=int, default=2, help="timed steps, after the warm-up (default: %(default)s)")
    ap.add_argument("--warmup", type=int, default=2, help="untimed steps first (default: %(default)s)")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--optimizer-state", default="fp32", choices=("fp32", "int8", "int4"))
    ap.add_argument("--ring-overflow", choices=("on", "off"), default="off",
                    help="EngineConfig.grad_ring_overflow: off (default here) shows the ring's back-pressure; on, the "
                         "default elsewhere, takes plain host buffers instead while the host has room (Note: [Ring overflow])")
    ap.add_argument("--adam-delay", type=float, default=0.5,
                    help="seconds the host waits before each unit's update in the held-back run (default: %(default)s)")
    ap.add_argument("--out", default=None, help="path stem: STEM.html, the held-back step's timeline")
    ap.add_argument("--png", action="store_true", help="also STEM.png, Chromium's screenshot of STEM.html")
    ap.add_argument("--rows", default=None, help="append each setting's JSON row here (bench/rows.py)")
    ap.add_argument("--trace", default=None, metavar="FILE",
                    help="draw this saved step (Trace.save, e.g. bench/throughput.py --save-trace) instead of running")
    a = ap.parse_args(argv)
    if a.trace:
        if not a.out:
            ap.error("--trace needs --out: the stem of the page it draws")
        return draw_saved(a.trace, a.out, png=a.png)
    if a.adam_delay <= 0:
        ap.error(f"--adam-delay {a.adam_delay}: give a positive number of seconds (the held-back run's delay)")
    if a.png and not a.out:
        ap.error("--png needs --out: the screenshot is of STEM.html")
    try:
        cfg = bench_config(a.shape, layers=a.layers, seq=a.seq)
    except ValueError as e:
        ap.error(f"--shape {a.shape} --layers {a.layers} --seq {a.seq}: {e}")
    s = None
    for delay in (0.0, a.adam_delay):
        s = None  # the last run's store goes before the next is built: one model's host RAM at a time
        row, s = run(cfg, a, delay)
        print(f"delay {delay:g} s: step {row['step_s']:.3f} s, ring {row['ring']}, waited for a buffer "
              f"{row['wait_ring_ms']:.0f} ms ({row['wait_ring_spans']} times), compute waited {row['compute_waits_ms']}",
              flush=True)
        emit(row, a.rows)
    if a.out:
        html, png = Path(a.out + ".html"), Path(a.out + ".png")  # not with_suffix: a stem may hold a dot ("0.5b")
        html.parent.mkdir(parents=True, exist_ok=True)
        fig = s.plot_timeline()
        fig.update_layout(title=f"{a.shape} x {cfg.num_hidden_layers} layers, batch {a.batch} x {a.seq}, {a.device}: "
                                f"the host's AdamW held back {a.adam_delay:g} s a unit; wait-ring on host-unpack")
        fig.write_html(html, include_plotlyjs=True, full_html=True)
        if a.png:
            screenshot(html, png)
        print(f"wrote {html}" + (f" and {png}" if a.png else ""))


if __name__ == "__main__":
    main()
