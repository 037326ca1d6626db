"""What the planner predicts for gpt-oss-20b (an MoE: 20.91B parameters, 4.19B active a token) on the H200.

Run (CPU is enough: a prediction, nothing allocated):
    python bench/moe_plan.py                              # int4 moments, seq 4096, batch 4 8 16
    python bench/moe_plan.py --state int8 --host-gib 256  # what-if: another state, a larger host
The planner counts compute with the active parameters (the experts at 4 of 32: ``model_shape``'s
``active_params_per_layer``) and host bytes, transfers and the host's AdamW with all of them. Each row:
placement, predicted steady step, model TFLOPS (6 x active x tokens / step), the bottleneck, recomputed
layers, host GiB (store + pinned pool + runtime) and device GiB; "fits" against the H200's host RAM and a
what-if host of ``--host-gib``. Attention is rated as SDPA's; gpt-oss runs flex attention on CUDA, and its
sliding layers (128 keys) do less than the full-attention FLOPs counted here.
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import warnings

sys.path.insert(0, os.path.dirname(__file__))
from shapes import GPT_OSS_20B  # noqa: E402

from megatrain_nb.machine.planner import H200, model_shape, plan  # noqa: E402


def rows(*, state: str, seq: int, batches: list[int], host_gib: int) -> list[dict]:
    """One row per (host, batch, placement) of the plan's prediction."""
    out = []
    for hw, host in ((H200, "H200"), (dataclasses.replace(H200, host_mem_bytes=host_gib << 30), f"{host_gib} GiB")):
        for batch in batches:
            for placement in ("host", "auto", "stream"):
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")  # a plan that does not fit warns; the row says so
                    p = plan(GPT_OSS_20B, batch=batch, seq=seq, hardware=hw, optimizer_state=state,
                             placement=placement, cast_on_device=placement == "stream")
                out.append(dict(host=host, batch=batch, placement=placement, step_s=round(p.steady_step_ms / 1e3, 2),
                                model_tflops=round(p.model_tflops), bottleneck=p.bottleneck,
                                recomputed=p.recomputed_layers, host_GiB=round(sum(p.host_bytes.values()) / 2**30, 1),
                                device_GiB=round(sum(p.device_bytes.values()) / 2**30, 1),
                                fits=p.fits_host and p.fits_device))
    return out


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--state", default="int4", choices=["fp32", "int8", "int4"])
    ap.add_argument("--seq", type=int, default=4096)
    ap.add_argument("--batch", nargs="+", type=int, default=[4, 8, 16])
    ap.add_argument("--host-gib", type=int, default=192)
    a = ap.parse_args(argv)
    s = model_shape(GPT_OSS_20B)
    print(f"gpt-oss-20b: {s['n_params'] / 1e9:.2f}B parameters, {s['active_params'] / 1e9:.2f}B active a token; "
          f"{a.state} moments, seq {a.seq}, H200 profile (predicted)")
    print("| host | batch | placement | step s | model TFLOPS | bottleneck | recomputed | host GiB | device GiB | fits |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in rows(state=a.state, seq=a.seq, batches=a.batch, host_gib=a.host_gib):
        print("| " + " | ".join(str(v) for v in r.values()) + " |")


if __name__ == "__main__":
    main()
