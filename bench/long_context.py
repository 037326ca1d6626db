"""Long context on one GPU: Qwen2.5-7B shape, batch 1, one JSON row per context, the planner's prediction beside.

Rows (default mode), e.g. on the H200, each row appended to --out as soon as its context is done:
    python bench/long_context.py --seq 32k 128k 256k --steps 3 2 1 \
        --out bench/results/MACHINE-DATE-long-context.jsonl
A 512K step (~9 min) runs detached, with the defaults (recompute-block inputs then reach 0.95 of device
memory, Note: [Device share] in longcontext.py):
    setsid nohup python bench/long_context.py --seq 256k 512k --steps 1 --out bench/results/MACHINE-DATE-long-context.jsonl \
        > long_512k.log 2>&1 < /dev/null &
Each row: step_s, paper_tflops = (6*N*T + 12*L*d*T^2) / step (MegaTrain's count), model_tflops = 6*N*T / step,
peak_gpu_gib, host_rss_gib, what the engine chose (tile rows, attention kernel, block length, parked inputs,
kept layers, resident units: main's placement, "auto" by default) and plan_* — planner.plan's step time, device and host GiB for the same settings.

    --mode compare   one 7B step at --seq (32K) tiled and two untiled from the same weights and batch (lr 0, so
                     the weights do not move between them): loss and gradient differences of tiled against
                     untiled, beside the two untiled steps' own (the noise floor).
    --mode attention SDPA fwd+bwd time of each fused kernel at the 7B head layout (choose attention_backend).
    --mode plan      the planner's rows only (no GPU needed).
CPU check (a tiny Qwen2, tiled, every layer recomputed):
    python bench/long_context.py --shape tiny --device cpu --seq 2k --steps 1 --tile-tokens 512 --checkpoint-every 1
"""
from __future__ import annotations

import argparse
import os
import sys
import time
import warnings

import torch

sys.path.insert(0, os.path.dirname(__file__))
from rows import emit, rss_bytes  # noqa: E402
from shapes import SHAPES, qwen_config  # noqa: E402

from megatrain_nb import Session  # noqa: E402
from megatrain_nb.machine.planner import CPU_LAPTOP, H200, plan  # noqa: E402

TINY = dict(hidden_size=64, intermediate_size=176, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            vocab_size=512, tie_word_embeddings=False)


def tokens(s: str) -> int:
    s = s.lower()
    return int(s[:-1]) * 1024 if s.endswith("k") else int(s)


def config_of(a):
    if a.shape == "tiny":
        from transformers import Qwen2Config

        cfg = Qwen2Config(max_position_embeddings=max(a.seq), rope_theta=1e6, **TINY)
        cfg._attn_implementation = "sdpa"
        return cfg
    return qwen_config(a.shape, seq=max(a.seq))


def settings_of(a) -> dict:
    return dict(device=a.device, lr=a.lr, tile_tokens=a.tile_tokens, attention_backend=a.attention,
                activation_budget=a.activation_budget, pinned_budget_bytes=None if a.pinned_gb is None else int(a.pinned_gb * (1 << 30)),
                offload_checkpoints={"auto": None, "all": True, "none": False}[a.offload],
                checkpoint_every=a.checkpoint_every, placement=a.placement, trace=bool(a.save_trace),
                attention_cache={"auto": None, "on": True, "off": False}[a.attention_cache])


def predicted(cfg, a, seq: int) -> dict:
    hw = H200 if a.device.startswith("cuda") or a.mode == "plan" else CPU_LAPTOP
    st = settings_of(a)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        p = plan(cfg, batch=1, seq=seq, hardware=hw, cast_on_device=a.device.startswith("cuda") or a.mode == "plan",
                 tile_tokens=st["tile_tokens"], offload_checkpoints=st["offload_checkpoints"],
                 activation_budget=a.activation_budget, pinned_budget_bytes=st["pinned_budget_bytes"],
                 checkpoint_every=a.checkpoint_every, placement=a.placement if hw is H200 else "host",
                 attention_cache=st["attention_cache"])
    return dict(plan_step_s=round(p.step_ms / 1e3, 2), plan_paper_tflops=round(p.paper_tflops, 1),
                plan_device_gib=round(sum(p.device_bytes.values()) / 2**30, 1),
                plan_host_gib=round(sum(p.host_bytes.values()) / 2**30, 1), plan_fits=p.fits_device and p.fits_host,
                plan_tile_rows=p.tile_rows, plan_block=p.block, plan_parked=p.parked, plan_kept=p.kept_layers,
                plan_attention_cached=p.attention_cached,
                plan_resident=sum(v == "resident" for v in p.placement.values()),
                plan_advice=" ".join(p.advice) or None, plan_hardware=hw.name.split(" (")[0])


def run_rows(a, cfg) -> None:
    s = Session.from_config(cfg, seed=0, **settings_of(a))
    N, L, d = s.store.num_params(), cfg.num_hidden_layers, cfg.hidden_size
    cuda = a.device.startswith("cuda")
    g = torch.Generator().manual_seed(0)
    steps = a.steps + a.steps[-1:] * (len(a.seq) - len(a.steps))  # one count per context, the last repeated
    for T, n_steps in zip(a.seq, steps):
        if cuda:
            torch.cuda.reset_peak_memory_stats()
        times = []
        for k in range(n_steps):
            r = s.step({"input_ids": torch.randint(0, cfg.vocab_size, (1, T), generator=g)})
            times.append(r.seconds)
            print(f"  seq {T} step {k}: {r.seconds:.2f}s loss {r.loss:.4f}", file=sys.stderr, flush=True)
        t = min(times)
        e, act = s.engine, s.activations
        if a.save_trace and s.trace is not None:  # the context's last step: where its time went
            os.makedirs(a.save_trace, exist_ok=True)
            s.trace.meta.update(shape=a.shape, batch=1, seq=T, step_s=times[-1], gpu=torch.cuda.get_device_name(0)
                                if cuda else "cpu")
            s.trace.save(os.path.join(a.save_trace, f"trace_{a.shape}_{T // 1024}k.json.gz"))
        row = dict(shape=a.shape, seq=T, batch=1, params=N, layers=L, steps=n_steps, step_s=round(t, 3),
                   step_s_all=[round(x, 3) for x in times],
                   paper_tflops=round((6 * N * T + 12 * L * d * T * T) / t / 1e12, 1),
                   model_tflops=round(6 * N * T / t / 1e12, 1), loss=round(r.loss, 4),
                   peak_gpu_gib=round(torch.cuda.max_memory_allocated() / 2**30, 2) if cuda else None,
                   host_rss_gib=round(rss_bytes() / 2**30, 1), tile_rows=act["tile_rows"], attention=act["attention"],
                   block=act["block"], parked=len(act["parked_inputs"]), kept_layers=act["kept_layers"],
                   attention_cached=act["attention_cached"],
                   device_share=act["device_share"],
                   resident=sum(c.placement == "resident" for c in (e.device_updates.choice or {}).values()),
                   gpu=torch.cuda.get_device_name(0) if cuda else "cpu", torch=torch.__version__,
                   settings={k: v for k, v in settings_of(a).items() if k not in ("device", "trace")},
                   **predicted(cfg, a, T))
        emit(row, a.out)
    s.close()


def run_compare(a, cfg) -> None:
    """Same weights, same batch, lr 0: one step with the mechanism (--compare tiling: tiled; cache: attention
    outputs cached), two without; loss and gradient differences of the first against the second beside
    those of the two without (the noise floor: the fused attention backward and the GEMMs' split-K
    reductions do not add in a fixed order)."""
    T = a.seq[0]
    s = Session.from_config(cfg, seed=0, **{**settings_of(a), "lr": 0.0, "tile_tokens": a.tile_tokens or 16384})
    batch = {"input_ids": torch.randint(0, cfg.vocab_size, (1, T), generator=torch.Generator().manual_seed(0))}
    sample = [-1, 0, cfg.num_hidden_layers // 2, cfg.num_hidden_layers - 1, cfg.num_hidden_layers]
    got = {}
    on, off = (a.tile_tokens or 16384, 0) if a.compare == "tiling" else (True, False)
    for name, v in (("with", on), ("without", off), ("without again", off)):
        if a.compare == "tiling":
            s.engine.tiler.tile_tokens, s.engine.tiler._tokens = v, None
        else:
            s.engine.ckpts.cache_setting = v
        s.engine.keep = None  # re-decide the policy
        r = s.step(batch)
        s.engine.drain()
        norms = {u: float(s.store.units[u].grad.float().norm()) for u in s.store.order}
        grads = {u: s.store.units[u].grad.clone() for u in sample}
        got[name] = (r.loss, norms, grads, r.seconds, s.engine.tiler.rows, s.activations["attention_cached"])
        print(f"  {name}: loss {r.loss:.6f} {r.seconds:.2f}s rows {s.engine.tiler.rows} cached "
              f"{got[name][-1]}", file=sys.stderr, flush=True)
    (la, na, ga, ta, ra, ca), (lb, nb, gb, tb, rb, cb), (lc, nc, gc, *_) = got["with"], got["without"], got["without again"]

    def rel(x, y):
        return {u: float((x[u].float() - y[u].float()).norm() / max(y[u].float().norm(), 1e-30)) for u in sample}
    emit(dict(mode="compare", compare=a.compare, shape=a.shape, seq=T, tile_rows=ra, untiled_rows=rb,
              attention_cached=ca, attention_cached_without=cb, loss_with=la, loss_without=lb,
              loss_rel_diff=abs(la - lb) / abs(lb), grad_rel_diff=rel(ga, gb),
              noise_loss_rel_diff=abs(lc - lb) / abs(lb), noise_grad_rel_diff=rel(gc, gb),
              grad_norm_rel_diff_max=max(abs(na[u] - nb[u]) / max(nb[u], 1e-30) for u in na),
              step_s_with=round(ta, 3), step_s_without=round(tb, 3), bf16_eps=2 ** -8,
              gpu=torch.cuda.get_device_name(0) if a.device.startswith("cuda") else "cpu"), a.out)
    s.close()


def run_attention(a, cfg) -> None:
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    heads, kv = cfg.num_attention_heads, cfg.num_key_value_heads
    hd = cfg.hidden_size // heads
    dt = torch.bfloat16 if a.device.startswith("cuda") else torch.float32
    for T in a.seq:
        for name, b in (("flash", SDPBackend.FLASH_ATTENTION), ("cudnn", SDPBackend.CUDNN_ATTENTION),
                        ("efficient", SDPBackend.EFFICIENT_ATTENTION)):
            q = torch.randn(1, heads, T, hd, device=a.device, dtype=dt, requires_grad=True)
            k = torch.randn(1, kv, T, hd, device=a.device, dtype=dt, requires_grad=True)
            v = torch.randn(1, kv, T, hd, device=a.device, dtype=dt, requires_grad=True)
            row = dict(mode="attention", seq=T, backend=name, heads=heads, kv_heads=kv, head_dim=hd)
            try:
                with sdpa_kernel([b]):
                    for k_ in range(3):  # the last of 3 is timed
                        if a.device.startswith("cuda"):
                            torch.cuda.synchronize()
                            torch.cuda.reset_peak_memory_stats()
                        t0 = time.perf_counter()
                        o = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=kv != heads)
                        o.backward(torch.ones_like(o))
                        if a.device.startswith("cuda"):
                            torch.cuda.synchronize()  # timing only
                        dt_s = time.perf_counter() - t0
                flops = 3.5 * 2 * heads * hd * T * T  # causal fwd (2 T^2 q_dim) + bwd (2.5x)
                row.update(fwd_bwd_ms=round(dt_s * 1e3, 2), causal_tflops=round(flops / dt_s / 1e12, 1),
                           peak_gib=round(torch.cuda.max_memory_allocated() / 2**30, 2) if a.device.startswith("cuda")
                           else None)
            except RuntimeError as e:
                row["error"] = str(e).splitlines()[0][:200]
            emit(row, a.out)
            del q, k, v


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mode", choices=["rows", "compare", "attention", "plan"], default="rows")
    ap.add_argument("--shape", choices=[*SHAPES, "tiny"], default="7b")
    ap.add_argument("--seq", type=tokens, nargs="+", default=[tokens("32k")], help="contexts: 32k 128k 256k 512k")
    ap.add_argument("--steps", type=int, nargs="+", default=[1],
                    help="steps per context (one count, or one per --seq, the last repeated); the row reports the fastest")
    ap.add_argument("--tile-tokens", type=int, default=None, help="EngineConfig.tile_tokens (None: auto, 0: off)")
    ap.add_argument("--attention", default=None, help="EngineConfig.attention_backend: flash, cudnn, efficient")
    ap.add_argument("--offload", choices=["auto", "all", "none"], default="auto", help="EngineConfig.offload_checkpoints")
    ap.add_argument("--checkpoint-every", type=int, default=None)
    ap.add_argument("--attention-cache", choices=["auto", "on", "off"], default="auto",
                    help="EngineConfig.attention_cache (auto: None)")
    ap.add_argument("--compare", choices=["tiling", "cache"], default="tiling",
                    help="--mode compare: the mechanism compared with its absence")
    ap.add_argument("--placement", choices=["auto", "host"], default="auto",
                    help="EngineConfig.placement (auto: resident units where the activations leave room)")
    ap.add_argument("--activation-budget", type=float, default=None,
                    help="EngineConfig.activation_budget (None: 0.85, up to 0.95 for recompute-block inputs)")
    ap.add_argument("--pinned-gb", type=float, default=None, help="staging pool, GiB (default: the engine's, config.pinned_budget)")
    ap.add_argument("--lr", type=float, default=1e-5)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--out", default=None, help="append each JSON row here as soon as it is made")
    ap.add_argument("--save-trace", default=None,
                    help="directory: record each context's steps (trace=True) and save its last step's trace")
    a = ap.parse_args(argv)
    cfg = config_of(a)
    if a.mode == "plan":
        for T in a.seq:
            emit(dict(mode="plan", shape=a.shape, seq=T, **predicted(cfg, a, T)), a.out)
        return
    {"rows": run_rows, "compare": run_compare, "attention": run_attention}[a.mode](a, cfg)


if __name__ == "__main__":
    main()
