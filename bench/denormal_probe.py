"""Do the OpenMP threads behind a flushed thread flush too, and what do subnormal moments cost the host's AdamW?

Run anywhere (the GPU machine's host is the one that matters):
    python bench/denormal_probe.py --numel 16777216 --threads 1 16 --out out/denormal_probe.jsonl
Rows "pool": each case in a fresh process (pools are made once per calling thread), the share of a parallel
op's elements, and of a fused AdamW step's exp_avg, that came out flushed: 1.0 where every thread of the
pool flushed (Note: [Subnormals] in megatrain_nb/host/denormals.py). Rows "rate": G params/s of torch's fused
AdamW in a worker thread (median of reps), normal moments vs subnormal exp_avg vs both subnormal (zero
grads), in a plain thread and in one that called flush_denormals first.
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import threading
import time

import torch

from rows import emit  # bench/ is on sys.path when this runs as a script

from megatrain_nb.host.denormals import flush_denormals, subnormals

CASES = {
    "main, flushed after its pool was made": "op(); flush(); out = share()",
    "main, flushed before its first op": "flush(); out = share()",
    "thread, flushed at its start": "out = in_thread(lambda: (flush(), share())[1])",
    "thread, flushed after its first op": "out = in_thread(lambda: (op(), flush(), share())[2])",
    "thread started by a flushed main": "op(); flush(); out = in_thread(share)",
    "thread, flushed at its start, pool grown": "out = in_thread(lambda: (flush(), torch.set_num_threads(1), op(), "
                                                "torch.set_num_threads(NT), share())[-1])",
}


def fused_step(p, g, m, v) -> None:
    """torch's fused CPU AdamW on one flat fp32 tensor (as optim.HostAdamW runs it), in place."""
    torch._fused_adamw_([p], [g], [m], [v], [], [torch.zeros(())], lr=1e-5, beta1=0.9, beta2=0.999,
                        weight_decay=0.01, eps=1e-8, amsgrad=False, maximize=False)


def share_flushed(n: int) -> dict:
    """Shares of zeros: a parallel ``x * 0.1`` over subnormal x, and exp_avg after a fused step from subnormal
    moments."""
    x = subnormals(n).mul(0.1)  # 1e-40 unless flushed
    p, g, m, v = torch.zeros(n), torch.zeros(n), subnormals(n), subnormals(n)
    fused_step(p, g, m, v)  # exp_avg = 0.9e-39: subnormal unless flushed
    zero = lambda t: (t.view(torch.int32) == 0).double().mean().item()  # noqa: E731 - host tensor: no sync
    return dict(op=zero(x), adam_exp_avg=zero(m), threads_seen=torch.get_num_threads())


def in_thread(fn):
    out = []
    t = threading.Thread(target=lambda: out.append(fn()))
    t.start()
    t.join()
    return out[0]


def pool_case(code: str, n: int, nt: int) -> dict:
    """Run one case in a fresh interpreter (no pool made yet) and return its shares."""
    script = (f"import torch, json\nfrom denormal_probe import *\nNT = {nt}\ntorch.set_num_threads(NT)\n"
              f"op = lambda: subnormals({n}).mul(0.1)\nflush = flush_denormals\nshare = lambda: share_flushed({n})\n"
              f"{code}\nprint(json.dumps(out))")
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, cwd=sys.path[0], check=True)
    return json.loads(r.stdout.strip().splitlines()[-1])


def rate(kind: str, n: int, reps: int) -> float:
    """G params/s of one fused step; ``kind``: normal, exp_avg (subnormal) or both (subnormal, zero grads)."""
    p, g = torch.randn(n) * 0.02, torch.randn(n) * 1e-3
    m, v = torch.randn(n) * 1e-4, torch.rand(n) * 1e-8
    times = []
    for _ in range(reps + 1):  # the first warms the pool and the pages
        if kind != "normal":
            m.copy_(subnormals(n))  # every rep starts subnormal (a flushed step leaves zeros)
        if kind == "both":
            v.copy_(subnormals(n))
            g.zero_()
        t0 = time.perf_counter()
        fused_step(p, g, m, v)
        times.append(time.perf_counter() - t0)
    return n / statistics.median(times[1:]) / 1e9


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--numel", type=int, default=1 << 24)
    ap.add_argument("--threads", type=int, nargs="+", default=[1, torch.get_num_threads()])
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--out")
    a = ap.parse_args()
    cpu = next((ln.split(":", 1)[1].strip() for ln in open("/proc/cpuinfo") if ln.startswith("model name")), "?")
    for nt in a.threads:
        for case, code in CASES.items():
            emit(dict(probe="pool", cpu=cpu, threads=nt, case=case, **pool_case(code, 1 << 20, nt)), a.out)
    for nt in a.threads:
        for flush in (False, True):
            def job():
                if flush:
                    flush_denormals()
                torch.set_num_threads(nt)
                return {k: round(rate(k, a.numel, a.reps), 3) for k in ("normal", "exp_avg", "both")}
            r = in_thread(job)
            emit(dict(probe="rate", cpu=cpu, threads=nt, flush=flush, numel=a.numel, gparams_s=r,
                      slowdown={k: round(r["normal"] / r[k], 2) for k in ("exp_avg", "both")}), a.out)


if __name__ == "__main__":
    main()
