"""Data-parallel scaling: one JSON row per world size (tokens/s of all ranks, speedup over one rank).

Run (the GPU machine: one process per GPU through torchrun, NCCL with NVLink multicast off):
    python bench/data_parallel.py --worlds 1 2 4 8 --shape 7b --seq 4096 --batch 8 \
        --out bench/results/MACHINE-DATE-data-parallel.jsonl --trace-dir bench/traces/dp
On the CPU (gloo; label the rows CPU):
    python bench/data_parallel.py --device cpu --worlds 1 2 --shape tiny --seq 128 --batch 4 --steps 4
Without ``--worlds`` under torchrun it is one rank of one run. With ``--worlds`` it starts
``torchrun --standalone --nproc-per-node N`` for each N and prints each run's row (rank 0 writes it).
``batch`` is rows per rank: N ranks train N * batch rows per step. Host bytes: ``host_pss_gib_machine``
sums the ranks' PSS (a page shared by n ranks counts 1/n in each: the machine's bytes, which RSS
overcounts), ``host_pss_added_gib_machine`` what the Sessions added to it; ``--private-store`` gives
each rank its own host store (``share_host_store=False``) for comparison. The last step's trace of every
rank is merged into one Chrome trace, one process per rank (``--trace-dir``/dp_<N>.json.gz).
"""
from __future__ import annotations

import argparse
import gzip
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(__file__))
from rows import emit, pss_bytes, rss_bytes  # noqa: E402
from shapes import qwen_config  # noqa: E402


def merge_chrome_traces(paths: list[str], out: str) -> None:
    """Chrome traces of each rank (``export_chrome_trace``) into one file, one process ("rank r") per rank."""
    events = []
    for r, p in enumerate(paths):
        with (gzip.open if p.endswith(".gz") else open)(p, "rt") as f:
            evs = json.load(f)["traceEvents"]
        for e in evs:
            e["pid"] = r + 1
            if e.get("name") == "process_name":
                e["args"] = {"name": f"rank {r}"}
            if e.get("cat") == "flow":
                e["id"] = e["id"] * 64 + r  # flow ids stay unique across ranks
        events += evs
        events.append({"name": "process_sort_index", "ph": "M", "pid": r + 1, "tid": 0, "args": {"sort_index": r}})
    with (gzip.open if out.endswith(".gz") else open)(out, "wt") as f:
        json.dump({"traceEvents": events, "displayTimeUnit": "ms"}, f, separators=(",", ":"))


def one_rank(a) -> None:
    """This process: one rank (or the only process) of a run of ``WORLD_SIZE`` ranks."""
    import torch.distributed as dist

    from megatrain_nb import Session
    from megatrain_nb.step import distributed
    from megatrain_nb.view.trace import export_chrome_trace

    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")  # NVLink multicast off on the lent machines
    distributed.init(backend="nccl" if a.device == "cuda" else "gloo")
    rank, size = distributed.world()
    if a.device == "cpu":
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // size))  # the ranks share the cores
    cfg = qwen_config(a.shape, seq=a.seq, layers=a.layers)
    pss0 = pss_bytes()  # before the Session: what the store and the step add is the difference
    s = Session.from_config(cfg, seed=0, device=a.device, lr=1e-5, placement=a.placement,
                            checkpoint_every=a.checkpoint_every, share_host_store=not a.private_store)
    g = torch.Generator().manual_seed(1000 + rank)  # each rank its own rows
    times, losses = [], []
    for k in range(a.warmup + a.steps):
        ids = torch.randint(0, cfg.vocab_size, (a.batch, a.seq), generator=g)
        r = s.step({"input_ids": ids})
        losses.append(r.loss)
        if k >= a.warmup:
            times.append(r.seconds)
        if rank == 0:
            print(f"  world {size} step {k}: {r.seconds:.3f}s loss {r.loss:.4f}", file=sys.stderr, flush=True)
    t = statistics.median(times)
    t = max(distributed.DataParallel(s.engine.dev).agree(t, "max"), t) if size > 1 else t  # the slowest rank's
    s.engine.drain()
    mine = pss_bytes()
    rss, pss = [rss_bytes()], [(mine, mine - pss0)]
    if size > 1:
        rss, pss = [None] * size, [None] * size
        dist.all_gather_object(rss, rss_bytes())
        dist.all_gather_object(pss, (mine, mine - pss0))
    if a.trace_dir and s.trace is not None and len(s.trace.spans):
        os.makedirs(a.trace_dir, exist_ok=True)
        part = os.path.join(a.trace_dir, f"dp_{size}_rank{rank}.json.gz")
        export_chrome_trace(s.trace, part)
        distributed.barrier("the trace merge")
        if rank == 0:
            merge_chrome_traces([os.path.join(a.trace_dir, f"dp_{size}_rank{r}.json.gz") for r in range(size)],
                                os.path.join(a.trace_dir, f"dp_{size}.json.gz"))
    rep = s.memory_report()
    s_store, s_shared = s.store.bytes_report()["total"], s.store.shared is not None
    s.close()
    if rank == 0:
        tokens = size * a.batch * a.seq
        cuda = a.device == "cuda"
        emit(dict(world=size, shape=a.shape, params=rep["params"], batch_per_rank=a.batch, seq=a.seq,
                  tokens_per_step=tokens, step_s=round(t, 4), step_s_all=[round(x, 4) for x in times],
                  tokens_per_s=round(tokens / t), loss_first=round(losses[0], 4), loss_last=round(losses[-1], 4),
                  host_rss_gib_per_rank=[round(x / 2**30, 2) for x in rss],
                  host_rss_gib_machine=round(sum(rss) / 2**30, 2),
                  host_pss_gib_machine=round(sum(p for p, _ in pss) / 2**30, 3),  # shared pages once
                  host_pss_added_gib_machine=round(sum(d for _, d in pss) / 2**30, 3),  # by the Sessions
                  store_gib=round(s_store / 2**30, 3), shared_store=s_shared, placement=a.placement,
                  device=torch.cuda.get_device_name(0) if cuda else f"cpu ({os.cpu_count()} cores)",
                  backend="nccl" if cuda else "gloo", torch=torch.__version__), a.out)
    distributed.destroy()


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--worlds", type=int, nargs="+", default=None, help="launch one torchrun run per world size")
    ap.add_argument("--shape", default="7b")
    ap.add_argument("--layers", type=int, default=None, help="fewer layers than the shape has (CPU rows)")
    ap.add_argument("--seq", type=int, default=4096)
    ap.add_argument("--batch", type=int, default=8, help="rows per rank")
    ap.add_argument("--steps", type=int, default=4, help="timed steps")
    ap.add_argument("--warmup", type=int, default=3, help="untimed steps first")
    ap.add_argument("--placement", default="auto")
    ap.add_argument("--checkpoint-every", type=int, default=None)
    ap.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    ap.add_argument("--private-store", action="store_true", help="share_host_store=False: a host store per rank")
    ap.add_argument("--trace-dir", default=None, help="merged Chrome trace of each run: <dir>/dp_<N>.json.gz")
    ap.add_argument("--out", default=None, help="append JSON rows here")
    a = ap.parse_args(argv)
    if a.worlds is None:
        return one_rank(a)
    rest = _without(sys.argv[1:] if argv is None else list(argv), {"--worlds": None, "--out": 1})
    base = None
    for n in a.worlds:
        out = tempfile.mktemp(suffix=".jsonl")  # the ranks' row; the parent adds the speedup and writes --out
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(n),
               os.path.abspath(__file__), *rest, "--out", out]
        t0 = time.perf_counter()
        p = subprocess.run(cmd, env={**os.environ, "NCCL_NVLS_ENABLE": "0"})
        if p.returncode != 0 or not os.path.exists(out):
            print(f"world {n}: torchrun exited with {p.returncode}", file=sys.stderr)
            continue
        with open(out) as f:
            row = json.loads(f.read().splitlines()[-1])
        os.unlink(out)
        base = row["tokens_per_s"] if n == 1 else base
        row["speedup_vs_1"] = round(row["tokens_per_s"] / base, 3) if base else None
        row["wall_s"] = round(time.perf_counter() - t0, 1)
        emit(row, a.out)


def _without(args: list[str], drop: dict) -> list[str]:
    """``args`` less each flag in ``drop`` and its values (None: every value up to the next flag; n: n values)."""
    out, k = [], 0
    while k < len(args):
        if args[k] in drop:
            n = drop[args[k]]
            k += 1
            while k < len(args) and not args[k].startswith("--") and (n is None or n > 0):
                k, n = k + 1, None if n is None else n - 1
            continue
        out.append(args[k])
        k += 1
    return out


if __name__ == "__main__":
    main()
