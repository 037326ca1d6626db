"""The dashboard of a real run as a static figure: a Qwen2.5-shaped session trains a few steps, then the
dashboard's final figure (what a notebook keeps after `train` ends) is written as plotly JSON and HTML.

Run on the GPU machine, e.g.:
    python bench/dashboard_snapshot.py --shape 3b --batch 4 --steps 4 --out out/dashboard_h200_3b
writes out/dashboard_h200_3b.json (the figure), .html (plotly.js from its CDN) and a JSON row of the steps
to --rows. `--png` also renders a PNG where kaleido is installed; elsewhere, open the HTML with plotly.js
inlined (`--inline-js`) in a browser and take a screenshot (tests/test_browser.py shows how).
"""
from __future__ import annotations

import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))
from rows import emit, rss_bytes  # noqa: E402
from shapes import qwen_config  # noqa: E402

from megatrain_nb import Session  # noqa: E402
from megatrain_nb.view.dashboard import Dashboard  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", default="3b", help="a bench/shapes.py shape (default 3b)")
    ap.add_argument("--batch", type=int, default=4, help="sequences a step (default 4)")
    ap.add_argument("--seq", type=int, default=4096, help="tokens a sequence (default 4096)")
    ap.add_argument("--steps", type=int, default=4, help="steps to train before the snapshot (default 4)")
    ap.add_argument("--placement", default="auto", help="EngineConfig.placement (default auto)")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--layers", type=int, default=None, help="fewer layers than the shape's (a quick CPU try)")
    ap.add_argument("--out", required=True, help="path stem: writes STEM.json and STEM.html")
    ap.add_argument("--inline-js", action="store_true", help="inline plotly.js in the HTML (views offline; ~4 MB)")
    ap.add_argument("--png", action="store_true", help="also STEM.png through kaleido, where installed")
    ap.add_argument("--rows", default=None, help="append the steps' JSON row here (bench/rows.py schema)")
    a = ap.parse_args()

    cfg = qwen_config(a.shape, layers=a.layers, seq=a.seq)
    s = Session.from_config(cfg, seed=0, device=a.device, placement=a.placement)
    g = torch.Generator().manual_seed(0)
    for _ in range(a.steps):
        r = s.step({"input_ids": torch.randint(0, cfg.vocab_size, (a.batch, a.seq), generator=g)})
        print(f"step {r.step}: loss {r.loss:.4f}, {r.seconds:.3f} s, {r.tflops:.1f} model TFLOPS", flush=True)
    final = Dashboard(s).static()  # what `train` leaves in a notebook's output
    os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
    with open(a.out + ".json", "w") as f:
        f.write(final.figure.to_json())
    final.figure.write_html(a.out + ".html", include_plotlyjs=True if a.inline_js else "cdn", full_html=True)
    if a.png:
        final.figure.write_image(a.out + ".png", width=1100)
    steps = [dict(step=h.step, loss=h.loss, seconds=h.seconds, tflops=h.tflops) for h in s.history]
    print(json.dumps({"title": final.figure.layout.title.text, "steps": steps}))
    if a.rows:
        emit(dict(subject="dashboard", shape=a.shape, batch=a.batch, seq=a.seq, placement=a.placement, steps=steps,
                  peak_reserved=torch.cuda.max_memory_reserved() if a.device == "cuda" else None, rss=rss_bytes()),
             a.rows)
    s.close()


if __name__ == "__main__":
    main()
