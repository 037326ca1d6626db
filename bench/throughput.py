"""Throughput of the streaming engine on Qwen2.5- and gpt-oss-shaped random models: one JSON line per (shape, batch).

Run on the GPU machine, e.g.:
    python bench/throughput.py --shape 3b --batch 1 4 8 --seq 4096 --steps 4 --out out/bench.jsonl
    python bench/throughput.py --shape gpt-oss-20b --batch 8 --optimizer-state int4 --data stdlib --out out/moe.jsonl
The batches are random token ids (``--data random``) or windows of Python's own standard library source
(``--data stdlib``, megatrain_nb.data.stdlib_text: real text, nothing downloaded; the row then carries every
step's loss, so a reader sees it fall).
Reports model TFLOPS = 6 * N * tokens / step time (N = all parameters, MegaTrain's formula; an MoE's
active ones: its experts at top_k / experts), tokens/s,
compute-stream busy share, compute time waiting per cause (from the step trace), peak GPU memory,
host RSS and host bytes/param.
"""
from __future__ import annotations

import argparse
import contextlib
import itertools
import os
import resource
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(__file__))
import memory_snapshot  # noqa: E402
from rows import busy_shares, emit, host_adam_rate, rss_bytes  # noqa: E402
from shapes import GPT_OSS, SHAPES, bench_config  # noqa: E402

from megatrain_nb import Session  # noqa: E402
from megatrain_nb.data.stdlib_text import batches as text_batches, stdlib_data  # noqa: E402
from megatrain_nb.machine import placement as placing  # noqa: E402
from megatrain_nb.host.optim import HostAdamW  # noqa: E402
from megatrain_nb.step import transfers as _transfers  # noqa: E402
from megatrain_nb.view.trace import find_stalls, summarize  # noqa: E402


def _sync_debug(path: str, batch: int) -> None:
    """From now on, count each synchronizing CUDA call by its thread and stack; the counts go to ``path`` at exit."""
    import atexit
    import collections
    import threading
    import traceback
    import warnings

    seen = collections.Counter()
    show = warnings.showwarning

    def record(message, category, *args, **kw):
        if "synchroniz" not in str(message):
            return show(message, category, *args, **kw)
        seen[(threading.current_thread().name, str(message)[:200], "".join(traceback.format_stack(limit=14)[:-2]))] += 1

    def dump():
        with open(path, "a") as f:
            f.write(f"# batch {batch}: {sum(seen.values())} synchronizing calls\n")
            for (thread, msg, stack), n in seen.most_common():
                f.write(f"## {n} x in {thread}: {msg}\n{stack}\n")

    warnings.simplefilter("always")
    warnings.showwarning = record
    torch.cuda.set_sync_debug_mode("warn")
    atexit.register(dump)


STDLIB_VOCAB = 4096  # --data stdlib's tokenizer: a few thousand tokens, clamped under the model's vocabulary


def _stdlib_rows(cfg, a, ap) -> tuple[torch.Tensor, int]:
    """--data stdlib: ((n, seq) long windows of the stdlib's text, the tokenizer's vocabulary); errors name the fix."""
    d = stdlib_data(vocab_size=min(STDLIB_VOCAB, cfg.vocab_size), seq=a.seq)
    rows = d["train"]  # (n, seq) long, ids under the tokenizer's vocabulary, itself <= the model's
    if len(rows) < max(a.batch):
        ap.error(f"--data stdlib: the text holds {len(rows)} windows of --seq {a.seq} tokens, fewer than --batch "
                 f"{max(a.batch)}; give a smaller --seq or --batch, or more modules "
                 f"(megatrain_nb.data.stdlib_text.TRAIN_MODULES, stdlib_data(train=...))")
    return rows, d["tokenizer"].get_vocab_size()


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", default="3b", choices=[*SHAPES, *GPT_OSS],
                    help="bench/shapes.py: Qwen2.5 shapes, or gpt-oss's (an MoE; gpt-oss-tiny for CPU tests) "
                         "(default: %(default)s)")
    ap.add_argument("--layers", type=int, default=None, help="override the depth, of either family (GPU memory vs "
                                                             "depth check; gpt-oss keeps alternating sliding and full)")
    ap.add_argument("--data", choices=("random", "stdlib"), default="random",
                    help=f"random: uniform token ids (the default); stdlib: windows of --seq tokens of Python's "
                         f"standard library source (megatrain_nb.data.stdlib_text), tokenized by a byte-level BPE of "
                         f"{STDLIB_VOCAB} tokens trained on it (fewer where the model's vocabulary is smaller), "
                         f"batches in a seeded order, labels = input_ids; the row gets loss_steps")
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 4])
    ap.add_argument("--seq", type=int, default=4096)
    ap.add_argument("--steps", type=int, default=4, help="timed steps per batch, after the warm-up steps")
    ap.add_argument("--warmup", type=int, default=6, help="untimed steps per batch, at least (placement='auto' "
                                                          "also waits for its search and its winner's first step)")
    ap.add_argument("--placement", default="auto", help="'auto', 'host', 'stream' (EngineConfig.placement)")
    ap.add_argument("--optimizer-state", default="fp32", choices=("fp32", "int8", "int4"),
                    help="OptimConfig.optimizer_state: the Adam moments' form (default: %(default)s)")
    ap.add_argument("--lr", type=float, default=1e-5, help="the learning rate (default: %(default)s)")
    ap.add_argument("--experts", default=None, help="EngineConfig.experts_implementation (default: auto)")
    ap.add_argument("--checkpoint-every", type=int, default=None)
    ap.add_argument("--micro-batch", type=int, default=None)
    ap.add_argument("--pass-batch", type=int, default=None, help="pass_batch_size (default: one pass, or auto's choice)")
    ap.add_argument("--slots", type=int, default=None, help="weight_slots (default: the engine's choice)")
    ap.add_argument("--pinned-gb", type=float, default=None, help="staging pool, GiB (default: the engine's, config.pinned_budget)")
    ap.add_argument("--no-overlap", action="store_true")
    ap.add_argument("--no-trace", action="store_true")
    ap.add_argument("--pinning", choices=["auto", "cast", "shadow", "none"], default="auto",
                    help="cast: pin the fp32 master, the GPU casts (auto's choice when RAM allows); shadow: a pinned "
                         "bf16 copy; none: pack from pageable memory")
    ap.add_argument("--no-pin-store", action="store_true", help="same as --pinning none")
    ap.add_argument("--offload-checkpoints", nargs="?", const="on", choices=("auto", "on", "off"), default="auto",
                    help="EngineConfig.offload_checkpoints: auto (the default, None: the engine places recompute-block "
                         "inputs), on (park them all in host memory; the flag alone), off (keep them all on the device)")
    ap.add_argument("--lean", choices=("auto", "on", "off"), default="auto",
                    help="lean_activations None (auto, the default) / True / False (Hugging Face's own forwards)")
    ap.add_argument("--no-lean", action="store_true", help="same as --lean off")
    ap.add_argument("--cast-on-device", action="store_true", help="same as --pinning cast")
    ap.add_argument("--save-trace", default=None, help="directory: save the last step's trace per batch")
    ap.add_argument("--trace-steps", action="store_true",
                    help="with --save-trace: also save every step's trace (untimed ones too), and print each step's "
                         "placement moves (the driver's arrive spans); reading a trace waits for the GPU")
    ap.add_argument("--profile-step", type=int, nargs="+", default=None,
                    help="debug: run these steps (0-based, warm-up ones count) of each batch under torch.profiler; print "
                         "the ops that took the most host time, on CUDA also those that took the most device time, and, "
                         "with --save-trace, save its Chrome trace there")
    ap.add_argument("--device-memory", default=None, help="EngineConfig.device_memory, e.g. 24GiB (a smaller card, emulated)")
    ap.add_argument("--host-memory", default=None, help="EngineConfig.host_memory, e.g. 64GiB (a smaller host, emulated)")
    ap.add_argument("--grad-ring", choices=("on", "off"), default="on", help="EngineConfig.grad_ring (default on)")
    ap.add_argument("--ring-overflow", choices=("on", "off"), default="on",
                    help="EngineConfig.grad_ring_overflow (default on; off: the ring's back-pressure alone)")
    ap.add_argument("--oom-snapshot", default=None, metavar="FILE",
                    help="record the device allocations' stacks (slower steps) and write to FILE what held the memory: "
                         "at the first failed allocation, else the recorded peak at the end (bench/memory_snapshot.py)")
    ap.add_argument("--out", default=None, help="append JSON lines here")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--stacks-every", type=float, default=0, help="debug: dump all threads' stacks every N s (faulthandler; a 14B run "
                    "with N=0.3 ended in a segmentation fault after its init: use seconds, not fractions)")
    ap.add_argument("--state-chunk-mb", type=int, default=None, help="transfers.STATE_OUT_CHUNK_BYTES in MiB "
                    "(0: one copy per slab, the default)")
    ap.add_argument("--placement-margin", type=float, default=None,
                    help="placement.MARGIN: what the planner's best must gain over a candidate with fewer residents "
                         "(Note [Auto search]; default: placement.MARGIN, 0.02; 0: the predicted fastest wins)")
    ap.add_argument("--sync-debug", default=None, help="debug: a file for the stacks of every synchronizing CUDA call "
                    "in the timed steps (torch.cuda.set_sync_debug_mode), counted by stack")
    ap.add_argument("--switch-ms", type=float, nargs="+", default=None,
                    help="the interpreter's switch interval(s) in ms (sys.setswitchinterval; Python's default 5): each "
                         "value is a run of every batch in the same session")
    ap.add_argument("--host-threads", type=int, nargs="+", default=None,
                    help="intra-op threads of the host's AdamW worker (default: torch's, every core): each value is a "
                         "run of every batch in the same session, after each --switch-ms")
    ap.add_argument("--host-window", type=float, nargs="+", default=None,
                    help="placement.HOST_WINDOW values (Note [Host window]; default 0.75): each a run of every batch in the "
                         "same session, its share set again from the host rate over the warm-up steps")
    ap.add_argument("--split-master", nargs="+", choices=["on", "off"], default=None,
                    help="Note [Split master]: 'device' layers' masters held as [R | D] (on, the default where it "
                         "applies) or fp32 (off); each value a run of every batch in the same session, its share set "
                         "again from the host rate over the warm-up steps")
    ap.add_argument("--mapped-reads", nargs="+", choices=["on", "off"], default=None,
                    help="Note [Mapped reads]: grad-norm and loss scalars read through mapped host memory (on, the "
                         "default on CUDA) or by a copy on the d2h stream (off); each value a run of every batch in "
                         "the same session, after each --split-master")
    ap.add_argument("--adam-chunk", type=int, default=None,
                    help="HostAdamW.chunk_numel: elements of bf16 gradients upcast at a time (a multiple of 64; "
                         "the same numbers at any size, Note [Chunked upcast])")
    a = ap.parse_args(argv)
    if a.adam_chunk is not None:
        if a.adam_chunk <= 0 or a.adam_chunk % 64:
            ap.error(f"--adam-chunk {a.adam_chunk}: give a positive multiple of 64, e.g. {1 << 20}")
        HostAdamW.chunk_numel = a.adam_chunk
    if a.state_chunk_mb is not None:
        _transfers.STATE_OUT_CHUNK_BYTES = a.state_chunk_mb << 20
    if a.placement_margin is not None:
        placing.MARGIN = a.placement_margin

    if a.stacks_every:
        import faulthandler
        faulthandler.dump_traceback_later(a.stacks_every, repeat=True)
    pinning = "none" if a.no_pin_store else "cast" if a.cast_on_device else a.pinning
    pin_store, cast = {"auto": (None, None), "cast": (None, True), "shadow": (True, False), "none": (False, False)}[pinning]
    try:
        cfg = bench_config(a.shape, layers=a.layers, seq=a.seq)
    except ValueError as e:
        ap.error(f"--shape {a.shape} --layers {a.layers} --seq {a.seq}: {e}")
    text_rows, text_vocab = _stdlib_rows(cfg, a, ap) if a.data == "stdlib" else (None, None)
    if a.oom_snapshot:
        if not a.device.startswith("cuda"):
            ap.error(f"--oom-snapshot {a.oom_snapshot}: records the CUDA allocator; use it with --device cuda")
        memory_snapshot.on_oom(a.oom_snapshot)
    t0 = time.perf_counter()
    s = Session.from_config(cfg, seed=0, device=a.device, lr=a.lr, checkpoint_every=a.checkpoint_every,
                            micro_batch_size=a.micro_batch, pass_batch_size=a.pass_batch, weight_slots=a.slots,
                            pinned_budget_bytes=None if a.pinned_gb is None else int(a.pinned_gb * (1 << 30)), overlap_optimizer=not a.no_overlap,
                            trace=not a.no_trace, pin_store=pin_store, cast_on_device=cast,
                            offload_checkpoints={"auto": None, "on": True, "off": False}[a.offload_checkpoints],
                            placement=a.placement,
                            optimizer_state=a.optimizer_state, device_memory=a.device_memory,
                            experts_implementation=a.experts, host_memory=a.host_memory, grad_ring=a.grad_ring == "on",
                            grad_ring_overflow=a.ring_overflow == "on",
                            lean_activations=False if a.no_lean else {"auto": None, "on": True, "off": False}[a.lean])
    init_s = time.perf_counter() - t0
    peak_gib = lambda: round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20, 1)  # noqa: E731
    init_peak = peak_gib()  # what loading reached: the steps' own peaks are told apart from it
    rep = s.memory_report()
    print(f"{a.shape}{'' if a.layers is None else f'x{a.layers}L'}: {rep['params'] / 1e9:.3f}B params, "
          f"host {rep['total'] / 2**30:.1f} GiB ({rep['bytes_per_param']:.2f} B/param), init {init_s:.0f}s", flush=True)
    g = torch.Generator().manual_seed(0)
    variants = list(itertools.product(a.switch_ms or [None], a.host_threads or [None], a.host_window or [None],
                                      a.split_master or [None], a.mapped_reads or [None]))
    du, io = s.engine.device_updates, s.engine.io
    maps = io.norm_mapped, io.loss_mapped  # Note: [Mapped reads]: None where the probe failed (and on the CPU)
    if a.mapped_reads and "on" in a.mapped_reads and maps[0] is None:
        ap.error("--mapped-reads on: mapped host memory does not work here (the probe failed, or no CUDA)")
    if a.split_master and "on" in a.split_master and not du.split:
        ap.error("--split-master on: it does not apply here (bf16 compute, no pin_store, one process's store)")
    for sw, th, win, split, mapped in variants:  # same session, same weights: only rows of one call compare (docs/benchmarks.md)
        if sw is not None:
            sys.setswitchinterval(sw / 1e3)
        s.engine.adam.threads = th
        if win is not None:
            placing.HOST_WINDOW = win
        if split is not None:  # place() joins or splits the "device" layers' masters before the next step
            du.split = split == "on"
        if mapped is not None:
            io.norm_mapped, io.loss_mapped = maps if mapped == "on" else (None, None)
        if (win, split, mapped) != (None, None, None):  # "stream" sets its share again from the next steps'
            du.rated, du.adam_rate = 0, (0, 0.0)  # host rate (Note: [Stream rate])
        suffix = "" if len(variants) == 1 else f"_sw{sw}_t{th}" + ("" if win is None else f"_w{win}") \
            + ("" if split is None else f"_split{split}") + ("" if mapped is None else f"_mapped{mapped}")
        for B in a.batch:
            s.engine.keep = None  # re-derive the activation policy for this batch size
            cuda = a.device.startswith("cuda")
            if cuda:
                torch.cuda.reset_peak_memory_stats()
            times, losses, summaries, waits, raws, every, peaks, rss = [], [], [], [], [], [], [], []
            k = done_steps = 0
            most = a.steps + a.warmup + 10
            text = None if text_rows is None else text_batches(text_rows, batch=B, steps=most, seed=0)
            while len(times) < a.steps and k < most:
                if text is None:
                    inputs = {"input_ids": torch.randint(0, cfg.vocab_size, (B, a.seq), generator=g)}
                else:
                    inputs = text[k]  # {"input_ids", "labels"}: (B, seq) long each, labels = input_ids
                done_steps = done_steps + 1 if s.engine.device_updates.settled else 0  # "auto": its measuring step and a trial step
                with _profiled(a.profile_step and k in a.profile_step, a.save_trace, f"{a.shape}_b{B}{suffix}_step{k}"):
                    try:
                        r = s.step(inputs)
                    except torch.OutOfMemoryError:
                        e, c = s.engine, s.engine.ckpts  # the activation policy the failed step ran under
                        print(f"  out of memory in step {k}: kept {None if e.keep is None else sum(e.keep)} layers, "
                              f"block {c.block}, parked {c.park}, cap {c.cap}, cached {len(c.cached)}, tile rows "
                              f"{e.tiler.rows}, lean {e.lean}", file=sys.stderr, flush=True)
                        raise
                losses.append(r.loss)
                every.append(r.seconds)
                peaks.append(peak_gib())  # the process's peak RSS so far: the step where it rose is the one that raised it
                rss.append(round(rss_bytes() / 2**30, 1))
                du = s.engine.device_updates
                print(f"  batch {B} step {k}: {r.seconds:.3f}s loss {r.loss:.4f} recomputed {r.recomputed_layers} "
                      f"search {du.search.phase} resident {len(du.opt.groups)}", file=sys.stderr, flush=True)
                if a.trace_steps and a.save_trace and s.trace is not None:
                    _save_step_trace(s.trace, a.save_trace, f"trace_{a.shape}_b{B}{suffix}_step{k}.json.gz")
                k += 1
                if a.sync_debug and k == a.warmup and cuda:
                    _sync_debug(a.sync_debug, B)
                if k <= a.warmup or done_steps < 2:  # untimed: warm-up, the search, the winner's first step
                    continue
                times.append(r.seconds)
                raw = s.engine.step_records()  # resolved after the timed steps (reading s.trace waits for the GPU)
                if raw is not None:
                    raws.append(raw)
            if s.trace is not None and len(s.trace.spans):  # the last step's, read after the timed steps: reading
                df = s.trace.to_dataframe()  # resolves it, Python work that would compete for the GIL with AdamW
                summaries.append(summarize(df))
                summaries[-1]["host_adam_G_params_per_s"] = host_adam_rate(df)
                st = find_stalls(df)
                waits.append(st.groupby("waited_on")["dur_ms"].sum().to_dict() if len(st) else {})
            busy = busy_shares(s.engine.rec, raws, summaries[-1]) if summaries else []  # the saved trace: the last's
            t = statistics.median(times)
            tokens = B * a.seq
            N, active = rep["params"], s.arch.active_params()  # active: MoE experts at top_k / experts (= N if dense)
            row = dict(shape=a.shape, data=a.data, layers=cfg.num_hidden_layers, params=N, active_params=active,
                       batch=B, seq=a.seq, tokens=tokens,
                       step_s=round(t, 4), step_s_all=[round(x, 4) for x in times],
                       steps_s=[round(x, 4) for x in every],  # every step of this batch, the untimed first
                       worst_after_first_x=round(max(every[1:]) / t, 3),  # what "auto" must hold under 1.5
                       first3_over_steady_s=round(sum(every[:3]) - 3 * t, 3),  # the time settling costs
                       model_tflops=round(6 * active * tokens / t / 1e12, 1), tokens_per_s=round(tokens / t),
                       recomputed_layers=r.recomputed_layers,
                       peak_gpu_gib=round(torch.cuda.max_memory_allocated() / 2**30, 2) if cuda else None,
                       peak_reserved_gib=round(torch.cuda.max_memory_reserved() / 2**30, 2) if cuda else None,
                       device_memory=a.device_memory, host_memory=a.host_memory, grad_ring=a.grad_ring,
                       ring_overflow=a.ring_overflow, ring_overflow_peak_gib=None if s.store.ring is None else
                       round(s.store.ring.overflow_peak / 2**30, 2), ring_overflowed=None if s.store.ring is None
                       else s.store.ring.overflowed, ring_waits=None if s.store.ring is None else s.store.ring.waits,
                       host_rss_gib=round(rss_bytes() / 2**30, 1), host_bytes_per_param=round(rep["bytes_per_param"], 2),
                       host_rss_peak_gib=peak_gib(), host_rss_peak_init_gib=init_peak,
                       host_rss_peak_steps_gib=peaks, host_rss_steps_gib=rss,  # after each step, the untimed first
                       optimizer_state=a.optimizer_state, lr=a.lr, experts=s.kernels["experts"],
                       loss_first=round(losses[0], 4), loss_last=round(losses[-1], 4),
                       checkpoint_every=a.checkpoint_every, slots=len(s.engine.slots), pin_store=s.store.shadow_dtype is not None, cast_on_device=s.engine.cfg.cast_on_device,
                       offload_checkpoints=a.offload_checkpoints, overlap=not a.no_overlap, placement=a.placement,
                       lean_activations=s.engine.lean, lean_reason=s.engine.lean_reason,
                       resident_units=int((s.placement.placement == "resident").sum()),
                       resident_gib=round(float(s.placement.device_GiB.sum()), 2),
                       streamed_units=int((s.placement.placement == "device").sum()),
                       streamed_head=bool(s.engine.device_updates.head_streamed),  # Note: [Streamed head]
                       state_chunk_mb=_transfers.STATE_OUT_CHUNK_BYTES >> 20, placement_margin=placing.MARGIN, sync_debug=bool(a.sync_debug),
                       switch_ms=round(sys.getswitchinterval() * 1e3, 3), host_threads=th or torch.get_num_threads(),
                       adam_chunk=HostAdamW.chunk_numel, host_window=placing.HOST_WINDOW,
                       split_master=bool(s.store.split),  # Note: [Split master]
                       mapped_reads=s.engine.io.norm_mapped is not None,  # Note: [Mapped reads]
                       state_slots=len(s.engine.device_updates.sslots), placement_search=s.engine.device_updates.search.summary(),
                       placement_inputs=s.engine.device_updates.search.inputs(),
                       pass_rows=a.pass_batch or du.passes.get((B, a.seq), (B,))[0],  # Note: [Pass choice]
                       pass_reason=du.pass_reason, micro_reason=du.micro_reason,
                       memory_history=bool(a.oom_snapshot),  # stacks recorded: steps slower than without
                       expandable_segments=memory_snapshot.expandable() if cuda else None,  # Note: [Allocator]
                       gpu=torch.cuda.get_device_name(0) if cuda else "cpu", torch=torch.__version__)
            if text is not None:
                row["loss_steps"] = [round(x, 4) for x in losses]  # every step's, the untimed first: the loss falls
                row["data_vocab"] = text_vocab  # the tokenizer's size: every id is under it
            if summaries:
                sm = summaries[-1]
                row["compute_busy_share"] = round(sm.get("compute_busy_share", float("nan")), 3)
                row["compute_busy_all"] = [round(b, 3) for b in busy]  # the timed steps', in order
                row["compute_busy_median"] = round(statistics.median(busy), 3)
                row["trace_step_ms"] = round(sm.get("step_ms", float("nan")), 1)
                row["waits_ms"] = {k: round(v, 1) for k, v in waits[-1].items()}
                row["h2d_GBps"] = round(sm.get("h2d_GBps", float("nan")), 1)
                rate = sm.get("host_adam_G_params_per_s")  # the host's AdamW inside the step: what the planner needs for it
                row["host_adam_G_params_per_s"] = None if rate is None else round(rate, 2)
            emit(row, a.out)
            if a.save_trace and s.trace is not None:
                os.makedirs(a.save_trace, exist_ok=True)
                s.trace.meta.update(dict(shape=a.shape, batch=B, seq=a.seq, step_s=t, gpu=row["gpu"]))
                s.trace.save(os.path.join(a.save_trace, f"trace_{a.shape}_b{B}{suffix}.json.gz"))
    if a.oom_snapshot:
        memory_snapshot.write_peak(a.oom_snapshot)
    s.close()


@contextlib.contextmanager
def _profiled(on: bool, folder: str | None, name: str):
    """torch.profiler around one step (``on``): where the driver's time went, op by op, the host's and the device's."""
    if not on:
        yield
        return
    from torch.profiler import ProfilerActivity, profile

    from torch._C._profiler import _ExperimentalConfig

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    try:
        every = _ExperimentalConfig(profile_all_threads=True)  # the step runs on the driver and its workers' threads
    except TypeError:  # an older torch: the calling thread's ops only
        every = None
    with profile(activities=acts, record_shapes=True, experimental_config=every) as prof:
        yield
    print(f"    profile of {name}, by host time:\n" + prof.key_averages().table(sort_by="cpu_time_total", row_limit=25),
          file=sys.stderr, flush=True)
    if torch.cuda.is_available():  # the kernels the step's compute spent its time in (an MoE layer's backward, say)
        print(f"    profile of {name}, by device time:\n"
              + prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=30), file=sys.stderr, flush=True)
    if folder:
        os.makedirs(folder, exist_ok=True)
        prof.export_chrome_trace(os.path.join(folder, f"profile_{name}.json"))


def _save_step_trace(trace, folder: str, name: str) -> None:
    """Save one step's trace and print what its placement moves took: before the step (Note: [Arrivals] in
    device_updates.py), and the moments during it (Note: [Late moments] in late_moments.py)."""
    os.makedirs(folder, exist_ok=True)
    trace.save(os.path.join(folder, name))
    df = trace.to_dataframe()
    moves = df[(df.lane == "driver") & df.op.str.startswith("arrive")]
    if len(moves):
        g = moves.groupby("op").agg(n=("dur_ms", "count"), ms=("dur_ms", "sum"), gb=("bytes", "sum"))
        span = moves.end_ms.max() - moves.start_ms.min()
        print(f"    moves: {span:.0f} ms from the first to the last, " + ", ".join(
            f"{op} {r.n} x {r.ms:.0f} ms" + (f" {r.gb / 1e9:.1f} GB" if r.gb else "") for op, r in g.iterrows()),
            file=sys.stderr, flush=True)
    late = df[(df.lane == "host-moments") & (df.op == "moments-in")]  # Note: [Late moments]
    if len(late):
        print(f"    moments in the step: {late.start_ms.min():.0f} to {late.end_ms.max():.0f} ms, {len(late)} groups, "
              f"{late.bytes.sum() / 1e9:.1f} GB", file=sys.stderr, flush=True)


if __name__ == "__main__":
    main()
