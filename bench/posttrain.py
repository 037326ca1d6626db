"""Post-training speed: the loss hook's step against cross-entropy's, log-prob and reference passes, generation.

Run on the GPU machine, e.g.:
    python bench/posttrain.py --shape 7b --out bench/results/MACHINE-DATE-post-training.jsonl
One run, one JSON line per mode, then a summary line. Modes, on a Qwen2.5-shaped random model (no
download), B rows x T tokens of random ids (--batch, --seq), the first --prompt labels of each row -100:
  hf_generate  transformers' ``model.generate`` (sampling, KV cache) of --gen-prompts prompts of
               --gen-prompt-len ids, --gen-new new tokens each, the model built on the device in the compute
               dtype; measured first, in a child process that ends before the Session is built, so the two
               never share the GPU and this process's RSS is the Session's alone;
  ce           ``Session.step(batch)``: HF's cross-entropy;
  hook         the same tokens through the loss hook with GRPO (``losses.grpo``, beta 0: no reference),
               group-normalised random advantages (--group completions per prompt) and ``old_logp`` from
               one ``Session.logprobs`` pass before the timed steps;
  logprobs     ``Session.logprobs(batch)``: forward only, the per-token log-probs;
  reference    ``Session.freeze_reference()`` (its bf16 snapshot written to disk: ``snapshot_s``,
               ``snapshot_bytes``), then ``Session.logprobs(batch, ref=True)``, which reads the snapshot
               through the page cache (from the disk where the page cache cannot hold it: the row keeps
               /proc/meminfo from before the passes);
  generate     ``Session.generate`` of the same prompts, batched, the layers copied to the device
               (``cache_weights=True``; streamed, and the row's ``cache_weights`` false, where they do not fit).
Both generators make exactly --gen-new tokens a row: the config has no EOS (``eos_token_id=None``, so
neither ``decode.eos_ids`` nor HF's stopping criteria find one) and HF gets ``min_new_tokens``; the tool
raises if a row came out shorter. Steps are timed by ``StepResult.seconds`` (median of --steps after at least
--warmup steps, and under ``placement="auto"`` after its search has settled); passes and generation by
``time.perf_counter`` (their results are host tensors: the call has waited for the device).
Summary: hook_vs_ce = hook step / ce step (target <= 1.05), logprobs_vs_train = logprobs tokens/s / ce tokens/s
(>= 2.5), reference_vs_train (>= 1.5), generate_vs_hf = ours tokens/s / HF's (>= 0.7), and the peak host RSS
(VmHWM) of this process, the Session's, against 14.2 bytes a parameter + 4 GiB (for the tiny shape the bound
means nothing); every row says the host memory so far, so where it grew shows.
"""
from __future__ import annotations

import argparse
import copy
import functools
import gc
import math
import multiprocessing
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(__file__))
from rows import emit  # noqa: E402
from shapes import count_params, qwen_config  # noqa: E402

from megatrain_nb import Session  # noqa: E402
from megatrain_nb.post import losses  # noqa: E402

MODES = ("hf_generate", "ce", "hook", "logprobs", "reference", "generate")
TARGETS = {"hook_vs_ce": ("<=", 1.05), "logprobs_vs_train": (">=", 2.5), "reference_vs_train": (">=", 1.5),
           "generate_vs_hf": (">=", 0.7)}
HOST_BYTES_PER_PARAM, HOST_SLACK = 14.2, 4 * 2**30  # the host store's bytes a parameter (fp32 state), + 4 GiB


def log(msg: str) -> None:
    print(f"[posttrain {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def meminfo() -> dict:
    """/proc/meminfo's MemTotal, MemFree, MemAvailable, Cached and Dirty, GiB."""
    out = {}
    with open("/proc/meminfo") as f:
        for line in f:
            key, value = line.split(":", 1)
            if key in ("MemTotal", "MemFree", "MemAvailable", "Cached", "Dirty"):
                out[key] = round(int(value.split()[0]) / 2**20, 2)  # kB -> GiB
    return out


def host_memory() -> dict:
    """This process's host memory now, GiB: VmRSS, VmHWM (the peak so far), RssAnon and RssFile (mapped files)."""
    want = {"VmRSS": "rss_gib", "VmHWM": "peak_rss_gib", "RssAnon": "rss_anon_gib", "RssFile": "rss_file_gib"}
    out = {}
    with open("/proc/self/status") as f:
        for line in f:
            key = line.split(":", 1)[0]
            if key in want:
                out[want[key]] = round(int(line.split()[1]) / 2**20, 2)  # kB -> GiB
    return out


def dir_bytes(path) -> int:
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, files in os.walk(path) for f in files)


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()  # host sync: the timer reads after the device's work


def time_steps(s: Session, batch: dict, steps: int, warmup: int, name: str, **kw) -> list[float]:
    """StepResult.seconds of ``steps`` steps, after ``warmup`` untimed ones and, under placement "auto", after
    its search (a measuring step and trials) and the winner's first step (as bench/throughput.py)."""
    du = s.engine.device_updates
    times, k, done = [], 0, 0
    while len(times) < steps and k < steps + warmup + 10:
        done = done + 1 if du.settled else 0
        r = s.step(batch, **kw)
        k += 1
        log(f"{name} step {k}: {r.seconds:.3f}s loss {r.loss:.4f} settled {du.settled}")
        if k > warmup and done >= 2:
            times.append(r.seconds)
    if not times:
        raise RuntimeError(f"{name}: no step was timed in {k} steps (the placement search never settled); "
                           "raise --warmup or pass --placement host")
    return times


def time_calls(fn, steps: int, device: str) -> tuple[float, list[float]]:
    """(the warm-up call's seconds, the timed calls' seconds) of ``fn()``, each between device syncs."""
    out = []
    for _ in range(steps + 1):
        sync(device)
        t0 = time.perf_counter()
        fn()
        sync(device)
        out.append(time.perf_counter() - t0)
    return out[0], out[1:]


def check_new(new_tokens: torch.Tensor, N: int, who: str) -> None:
    """Raise unless every row of ``new_tokens`` (rows, N') holds exactly N generated tokens."""
    if new_tokens.shape[1] != N:
        raise RuntimeError(f"{who}: generated {new_tokens.shape[1]} tokens a row, not --gen-new {N}: an EOS stopped "
                           "it, so the tokens/s would not compare; check the config's eos_token_id")


def hf_generate(cfg, prompts: torch.Tensor, N: int, device: str, dtype: torch.dtype) -> dict:
    """transformers' generate of ``prompts`` (n, P) long, N new tokens each, sampled; the model then deleted."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)  # HF samples from the global generator
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(copy.deepcopy(cfg), dtype=dtype).eval()  # from_config sets cfg.dtype
    try:
        ids = prompts.to(device)
        mask = torch.ones_like(ids)
        kw = dict(do_sample=True, temperature=1.0, top_p=1.0, top_k=0, pad_token_id=0)  # top_k 0: no top-k, as ours
        with torch.no_grad():
            model.generate(ids, attention_mask=mask, max_new_tokens=min(4, N), **kw)  # warm-up
            sync(device)
            t0 = time.perf_counter()
            out = model.generate(ids, attention_mask=mask, max_new_tokens=N, min_new_tokens=N, **kw)
            sync(device)
            dt = time.perf_counter() - t0
        check_new(out[:, ids.shape[1]:], N, "hf_generate")
        peak = torch.cuda.max_memory_allocated() / 2**30 if device.startswith("cuda") else None
    finally:
        del model
        gc.collect()
        if device.startswith("cuda"):
            torch.cuda.empty_cache()
    return {"seconds": dt, "peak_gpu_gib": None if peak is None else round(peak, 2)}


def main(argv=None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", default="7b")
    ap.add_argument("--layers", type=int, default=None)
    ap.add_argument("--batch", type=int, default=8, help="rows of the training batch (B)")
    ap.add_argument("--seq", type=int, default=1024, help="tokens a row (T)")
    ap.add_argument("--prompt", type=int, default=128, help="the first labels of each row set to -100")
    ap.add_argument("--group", type=int, default=8, help="GRPO's completions per prompt (group_size)")
    ap.add_argument("--steps", type=int, default=3, help="timed steps or passes per mode")
    ap.add_argument("--warmup", type=int, default=3, help="untimed steps per step mode, at least")
    ap.add_argument("--gen-prompts", type=int, default=64)
    ap.add_argument("--gen-prompt-len", type=int, default=64)
    ap.add_argument("--gen-new", type=int, default=256, help="new tokens a row, exactly")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--placement", default="auto", help="EngineConfig.placement")
    ap.add_argument("--optimizer-state", default="fp32", choices=("fp32", "int8", "int4"),
                    help="OptimConfig.optimizer_state: the Adam moments' form")
    ap.add_argument("--skip", nargs="*", default=[], choices=MODES, help="modes not to run")
    ap.add_argument("--out", default=None, help="append JSON lines here")
    a = ap.parse_args(argv)
    if a.batch % a.group:
        ap.error(f"--batch {a.batch} is not a multiple of --group {a.group}: GRPO's groups must be whole")
    if not 0 < a.prompt < a.seq:
        ap.error(f"--prompt {a.prompt}: must leave labels in a row of --seq {a.seq} tokens")
    run = [m for m in MODES if m not in a.skip]

    cfg = qwen_config(a.shape, layers=a.layers, seq=max(a.seq, a.gen_prompt_len + a.gen_new))
    cfg.eos_token_id = None  # random weights emit any id: with no EOS both generators make exactly --gen-new tokens
    cuda = a.device.startswith("cuda")
    dtype = torch.bfloat16 if cuda else torch.float32  # the Session's compute dtype (EngineConfig.dtype's default)
    params = count_params(cfg)
    B, T, N = a.batch, a.seq, a.gen_new
    base = dict(bench="posttrain", shape=a.shape, layers=cfg.num_hidden_layers, params=params, seq=T, batch=B,
                device=a.device, placement=a.placement, optimizer_state=a.optimizer_state, torch=torch.__version__,
                gpu=torch.cuda.get_device_name() if cuda else None)
    rows, res = [], {}

    def out(mode: str, **numbers) -> None:  # each row says the host memory so far: where it grew
        rows.append(emit({**base, "mode": mode, **numbers, **host_memory()}, a.out))

    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, cfg.vocab_size, (B, T), generator=g)
    labels = ids.clone()
    labels[:, :a.prompt] = -100  # the prompt: no loss
    batch = {"input_ids": ids, "labels": labels}
    tokens = B * T
    prompts = torch.randint(0, cfg.vocab_size, (a.gen_prompts, a.gen_prompt_len), generator=g)  # (n, P)
    gen = dict(prompts=a.gen_prompts, prompt_len=a.gen_prompt_len, new_tokens=N)

    if "hf_generate" in run:  # before the Session, in a child process: the two never hold the GPU at once
        log(f"hf_generate: {a.gen_prompts} prompts x {N} new tokens")
        with multiprocessing.get_context("spawn").Pool(1) as pool:  # its own process: this one's RSS is the Session's
            hf = pool.apply(hf_generate, (cfg, prompts, N, a.device, dtype))
        res["hf_generate"] = a.gen_prompts * N / hf["seconds"]
        out("hf_generate", **gen, seconds=round(hf["seconds"], 3), tokens_per_s=round(res["hf_generate"], 1),
            peak_gpu_gib=hf["peak_gpu_gib"], dtype=str(dtype).replace("torch.", ""))

    log(f"Session.from_config: {a.shape}, {params / 1e9:.2f}B params")
    t0 = time.perf_counter()
    s = Session.from_config(cfg, device=a.device, lr=1e-6, trace=False, placement=a.placement,
                            optimizer_state=a.optimizer_state)
    log(f"built in {time.perf_counter() - t0:.0f}s")
    try:
        if "ce" in run:
            times = time_steps(s, batch, a.steps, a.warmup, "ce")
            res["ce"] = statistics.median(times)
            out("ce", step_s=round(res["ce"], 4), step_s_all=[round(x, 4) for x in times],
                tokens_per_s=round(tokens / res["ce"]), recomputed_layers=s.history[-1].recomputed_layers)

        if "hook" in run:
            rewards = torch.rand(B, generator=g)
            batch_h = {**batch, "advantages": losses.group_advantages(rewards, a.group),  # (B,) fp32
                       "old_logp": s.logprobs(batch)}  # (B, T) fp32, once: the policy that "sampled" the rows
            grpo = functools.partial(losses.grpo, beta=0.0)
            times = time_steps(s, batch_h, a.steps, a.warmup, "hook", loss=grpo, group_size=a.group)
            res["hook"] = statistics.median(times)
            out("hook", loss_fn="grpo", group=a.group, step_s=round(res["hook"], 4),
                step_s_all=[round(x, 4) for x in times], tokens_per_s=round(tokens / res["hook"]),
                recomputed_layers=s.history[-1].recomputed_layers)

        if "logprobs" in run:
            log("logprobs")
            first, times = time_calls(lambda: s.logprobs(batch), a.steps, a.device)
            res["logprobs"] = statistics.median(times)
            out("logprobs", seconds=round(res["logprobs"], 4), seconds_all=[round(x, 4) for x in times],
                warmup_s=round(first, 4), tokens_per_s=round(tokens / res["logprobs"]))

        if "reference" in run:
            log("freeze_reference")
            t0 = time.perf_counter()
            ref = s.freeze_reference()  # a temporary directory, deleted with the reference
            snap = time.perf_counter() - t0
            mem = meminfo()  # before the passes: a snapshot larger than the page cache can keep is read from disk
            log(f"reference passes (snapshot {dir_bytes(ref.path) / 2**30:.1f} GiB, {snap:.0f}s; meminfo {mem})")
            first, times = time_calls(lambda: s.logprobs(batch, ref=True), a.steps, a.device)
            res["reference"] = statistics.median(times)
            nbytes = dir_bytes(ref.path)
            out("reference", snapshot_s=round(snap, 2), snapshot_bytes=nbytes, seconds=round(res["reference"], 4),
                seconds_all=[round(x, 4) for x in times], warmup_s=round(first, 4),
                tokens_per_s=round(tokens / res["reference"]), meminfo_gib_before=mem,
                snapshot_over_available=nbytes > mem.get("MemAvailable", 0) * 2**30,
                note="the snapshot is read through the page cache; where MemAvailable is short of it, passes read "
                     "the disk (compare warmup_s, the first pass, with the timed ones)")

        if "generate" in run:
            log(f"generate: {a.gen_prompts} prompts x {N} new tokens")
            plist = list(prompts)  # (P,) long each: the batched path
            cache = True  # every layer copied to the device beside what placement "auto" keeps resident there
            try:
                s.generate(plist, max_new_tokens=min(4, N), do_sample=True, cache_weights=cache, seed=1)  # warm-up
            except torch.OutOfMemoryError as e:
                cache = False  # the layers stream through the weight slots instead; the row says so
                log(f"generate: the layers' copies did not fit ({str(e).splitlines()[0]}); streaming them instead")
                gc.collect()
                torch.cuda.empty_cache()
                s.generate(plist, max_new_tokens=min(4, N), do_sample=True, cache_weights=cache, seed=1)
            t0 = time.perf_counter()
            r = s.generate(plist, max_new_tokens=N, do_sample=True, cache_weights=cache, seed=0)
            dt = time.perf_counter() - t0  # Rollouts hold host tensors: the call has waited for the device
            check_new(r.sequences[:, r.prompt_width:], N, "generate")
            if not bool((r.completion_lengths == N).all()):
                raise RuntimeError(f"generate: completion lengths {r.completion_lengths.tolist()}, not all {N}")
            res["generate"] = a.gen_prompts * N / dt
            out("generate", **gen, seconds=round(dt, 3), tokens_per_s=round(res["generate"], 1), cache_weights=cache)
    finally:
        s.close()

    def ratio(x, y):
        return None if x is None or y is None else x / y

    per_s = {k: tokens / v for k, v in res.items() if k in ("ce", "logprobs", "reference")}
    got = {"hook_vs_ce": ratio(res.get("hook"), res.get("ce")),
           "logprobs_vs_train": ratio(per_s.get("logprobs"), per_s.get("ce")),
           "reference_vs_train": ratio(per_s.get("reference"), per_s.get("ce")),
           "generate_vs_hf": ratio(res.get("generate"), res.get("hf_generate"))}
    meets = {k: None if v is None else (v <= TARGETS[k][1] if TARGETS[k][0] == "<=" else v >= TARGETS[k][1])
             for k, v in got.items()}
    peak, bound = host_memory()["peak_rss_gib"] * 2**30, HOST_BYTES_PER_PARAM * params + HOST_SLACK
    out("summary", **{k: None if v is None or not math.isfinite(v) else round(v, 3) for k, v in got.items()},
        targets={k: f"{op} {x}" for k, (op, x) in TARGETS.items()}, meets=meets, skipped=list(a.skip),
        peak_rss_gib=round(peak / 2**30, 2), rss_bound_gib=round(bound / 2**30, 2), rss_within_bound=peak <= bound,
        rss_note="peak host RSS (VmHWM) of this process (the HF peer ran in a child) against 14.2 B/param + 4 GiB; "
                 "the tiny shape makes the bound meaningless")
    return rows


if __name__ == "__main__":
    main()
