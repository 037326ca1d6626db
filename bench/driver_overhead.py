"""The driver's host time per layer op: a model so small that its compute is next to nothing, on "cpu".

At 3B x 1 x 4096 on the H200 the engine is all-resident and its step looks bound by the driver thread's
host work per layer op. Here the layers are tiny (hidden 64), so a step's wall time is almost
all host work: the driver's own (views, binding, hooks, recorder, counters, handoffs) and PyTorch's
dispatch of the layer's ops, which the plain HF model pays too (printed beside it as the floor).

    PYTHONPATH=$PWD python bench/driver_overhead.py --layers 36 --steps 20 --placement resident --out out/driver.jsonl
    PYTHONPATH=$PWD python bench/driver_overhead.py --profile 30  # cProfile of the timed steps, top 30 by tottime

Timed: ``Engine._forward`` (per layer), ``Engine._loss`` (once) and ``Engine._backward`` (per layer: its
recompute and backward ops, and the embedding's), median over ``--steps`` after ``--warmup`` steps.
Prints a table and one JSON line (appended to ``--out``).
"""
from __future__ import annotations

import argparse
import cProfile
import io
import os
import pstats
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(__file__))
from rows import emit  # noqa: E402

from megatrain_nb import Session  # noqa: E402


def tiny_qwen(layers: int, hidden: int, heads: int, vocab: int):
    """A Qwen2 config small enough that its layers' compute is next to nothing."""
    from transformers import Qwen2Config

    cfg = Qwen2Config(hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
                      num_attention_heads=heads, num_key_value_heads=1, vocab_size=vocab,
                      max_position_embeddings=4096, tie_word_embeddings=True)
    cfg._attn_implementation = "sdpa"
    return cfg


def timed(obj, name: str, into: list) -> None:
    """Wrap ``obj.name`` so each call's wall time is appended to ``into``."""
    fn = getattr(obj, name)

    def wrapper(*a, **k):
        t0 = time.perf_counter()
        try:
            return fn(*a, **k)
        finally:
            into.append(time.perf_counter() - t0)

    setattr(obj, name, wrapper)


def breakdown(engine) -> dict:
    """Wrap the driver's calls of each layer op with timers; returns name -> seconds of each call."""
    import megatrain_nb.step.engine as eng
    from megatrain_nb.model import binding

    out: dict[str, list] = {}
    for obj, name in ((engine, "_use"), (engine, "_done"), (engine, "_count_memory"), (engine, "_reduced"),
                      (engine.io, "grads"), (engine.io, "delay"), (engine.device_updates, "landed"),
                      (engine.rec, "cuda_begin"), (engine.rec, "cuda_end"), (engine.refs, "hooks"),
                      (eng, "call"), (eng, "grads_into")):
        timed(obj, name, out.setdefault(name.lstrip("_"), []))
    for cls, name in ((binding.Layout, "views"),):
        fn, into = getattr(cls, name), out.setdefault(name, [])

        def wrapper(self, *a, fn=fn, into=into, **k):
            t0 = time.perf_counter()
            try:
                return fn(self, *a, **k)
            finally:
                into.append(time.perf_counter() - t0)

        setattr(cls, name, wrapper)
    return out


def profiled(obj, name: str, prof: cProfile.Profile, on: list) -> None:
    """Wrap ``obj.name`` so that, while ``on[0]``, its calls are profiled in the thread that makes them
    (``Session.step`` runs the engine's step in a driver thread: a profiler of the main thread sees a wait)."""
    fn = getattr(obj, name)

    def wrapper(*a, **k):
        if not on[0]:
            return fn(*a, **k)
        prof.enable()
        try:
            return fn(*a, **k)
        finally:
            prof.disable()

    setattr(obj, name, wrapper)


def plain_floor(cfg, batches: list[dict], warmup: int) -> tuple[float, float]:
    """Median seconds of the plain HF model's forward and backward (the same tiny model, no engine)."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    fwd, bwd = [], []
    for k, b in enumerate(batches):
        t0 = time.perf_counter()
        loss = model(input_ids=b["input_ids"], labels=b["input_ids"]).loss
        t1 = time.perf_counter()
        loss.backward()
        t2 = time.perf_counter()
        model.zero_grad(set_to_none=True)
        if k >= warmup:
            fwd.append(t1 - t0), bwd.append(t2 - t1)
    return statistics.median(fwd), statistics.median(bwd)


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=36)
    ap.add_argument("--hidden", type=int, default=64)
    ap.add_argument("--heads", type=int, default=2)
    ap.add_argument("--vocab", type=int, default=512)
    ap.add_argument("--seq", type=int, default=16)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--steps", type=int, default=20, help="timed steps after the warm-up")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--placement", default="resident", choices=["resident", "host"],
                    help="resident: every unit's state and AdamW on the 'device' (the H200 3B x 1 case); host")
    ap.add_argument("--checkpoint-every", type=int, default=0, help="0: keep every layer; 1: recompute every layer")
    ap.add_argument("--trace", action=argparse.BooleanOptionalAction, default=True, help="the recorder on / off")
    ap.add_argument("--profile", type=int, default=0, help="cProfile the timed steps; print the top N by tottime")
    ap.add_argument("--breakdown", action="store_true",
                    help="time the driver's calls of each layer op (views, call, hooks, counters, landed, ...)")
    ap.add_argument("--label", default="", help="a tag for the JSON row (e.g. before / after)")
    ap.add_argument("--out", default=None, help="append the JSON line here")
    a = ap.parse_args(argv)
    torch.set_num_threads(1)  # tiny tensors: threads only add noise

    cfg = tiny_qwen(a.layers, a.hidden, a.heads, a.vocab)
    L = a.layers
    placement = {u: "resident" for u in range(-1, L + 1)} if a.placement == "resident" else "host"
    s = Session.from_config(cfg, seed=0, device="cpu", placement=placement, checkpoint_every=a.checkpoint_every,
                            trace=a.trace)
    g = torch.Generator().manual_seed(0)
    batches = [{"input_ids": torch.randint(0, a.vocab, (a.batch, a.seq), generator=g)}
               for _ in range(a.warmup + a.steps)]
    t = {"forward": [], "loss": [], "backward": []}
    for name in t:
        timed(s.engine, "_" + name, t[name])
    parts = breakdown(s.engine) if a.breakdown else {}
    steps, prof, on = [], cProfile.Profile(), [False]
    if a.profile:
        profiled(s.engine, "step", prof, on)
    for k, b in enumerate(batches):
        on[0] = k >= a.warmup
        if k == a.warmup:
            for v in parts.values():
                v.clear()  # the timed steps' calls only
        r = s.step(b)
        if a.trace:
            s.trace  # resolved as a notebook would read it (part of the step's host cost, outside the driver)
        steps.append(r.seconds)
    recomputed = s.history[-1].recomputed_layers
    s.close()
    med = {k: statistics.median(v[a.warmup:]) for k, v in t.items()}
    step_s = statistics.median(steps[a.warmup:])
    hf_fwd, hf_bwd = plain_floor(cfg, batches, a.warmup)
    us = lambda x: round(x * 1e6, 1)  # noqa: E731
    row = dict(bench="driver_overhead", label=a.label, layers=L, hidden=a.hidden, seq=a.seq, batch=a.batch,
               placement=a.placement, checkpoint_every=a.checkpoint_every, recomputed_layers=recomputed,
               trace=a.trace, steps=a.steps, step_ms=round(step_s * 1e3, 3),
               fwd_us_per_layer=us(med["forward"] / L), loss_us=us(med["loss"]),
               bwd_us_per_layer=us(med["backward"] / L),
               hf_fwd_us_per_layer=us(hf_fwd / L), hf_bwd_us_per_layer=us(hf_bwd / L),
               torch=torch.__version__)
    print(f"{'per layer (us, median of ' + str(a.steps) + ' steps)':<36}{'engine':>10}{'plain HF':>10}{'driver':>10}")
    for what, e, h in (("forward", row["fwd_us_per_layer"], row["hf_fwd_us_per_layer"]),
                       ("backward" + (" (recompute + bwd)" if recomputed else ""), row["bwd_us_per_layer"],
                        row["hf_bwd_us_per_layer"])):
        print(f"{what:<36}{e:>10.1f}{h:>10.1f}{e - h:>10.1f}")
    print(f"{'loss (once per step)':<36}{row['loss_us']:>10.1f}")
    print(f"{'step (ms)':<36}{row['step_ms']:>10.3f}")
    if parts:
        print(f"{'driver call':<24}{'calls/step':>12}{'us/call':>10}{'us/layer':>10}")
        for name, v in sorted(parts.items(), key=lambda kv: -sum(kv[1])):
            if v:
                print(f"{name:<24}{len(v) / a.steps:>12.1f}{1e6 * statistics.mean(v):>10.1f}"
                      f"{1e6 * sum(v) / a.steps / L:>10.1f}")
        row["breakdown_us_per_layer"] = {n: round(1e6 * sum(v) / a.steps / L, 1) for n, v in parts.items() if v}
    if a.profile:
        out = io.StringIO()
        pstats.Stats(prof, stream=out).sort_stats("tottime").print_stats(a.profile)
        print(out.getvalue())
    emit(row, a.out)
    return row


if __name__ == "__main__":
    main()
