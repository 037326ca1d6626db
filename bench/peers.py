"""megatrain_nb against the trainers people already use, one system per process, all in one run.

Each (system, model) runs in its own Python process (the batches in ascending order; a fresh process
for the rest after a failure, or one per batch with --per-process batch), so one peer's allocator,
pinned memory or crash never touches another's numbers. Every batch gives one JSON row, appended to
--out as it finishes; a peer that runs out of device or host memory, crashes, times out or is missing
gives a row that says so, and the run goes on. The same token ids (seeded per step) feed every system.

Sweeps (--sweep, any of):
  core   Qwen2.5-3B shape, batch 1 4 8 16 x 4096, every system          (~8 min on the H200)
  7b     Qwen2.5-7B shape, batch 2 8 x 4096, every system that fits host RAM
  depth  3B width at 36 / 72 / 108 layers, batch 8, megatrain_nb only     (--sweep-systems)
  width  hidden x1 / x1.5 / x2 at 18 layers, batch 8, megatrain_nb only
Systems: native (fp32 master + bf16 autocast; native-bf16 follows on its out-of-memory batches),
fsdp2-offload, zero3-offload, zero3-twinflow, megatrain-auto / -host / -stream (the placement= keyword;
plain "megatrain", default settings, follows if the installed Session refuses it), megatrain-recompute (every
layer recomputed, as in the paper's depth curve) and megatrain-host-recompute (also every update on the host:
device memory flat in depth); for --sweep-systems.

On the H200 (DeepSpeed travels as wheels in .whl/, see docs/benchmarks.md):
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
        .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD
    python3 bench/peers.py --sweep core --budget-s 540 --out $OUT/peers.jsonl --log $OUT/peers.log
On a laptop (CPU, tiny model; the rows' schema and the process handling, no meaningful figures):
    python bench/peers.py --device cpu --tiny --systems native megatrain --out out/peers_cpu.jsonl
"""
from __future__ import annotations

import argparse
import collections
import dataclasses
import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [HERE, os.path.dirname(HERE)]  # bench/ helpers; this checkout's megatrain_nb before an installed one
from peer_systems import ROW_KEYS, ROW_MARK, child_main  # noqa: E402
from rows import emit  # noqa: E402
from shapes import count_params, qwen_config  # noqa: E402

SYSTEMS = ("megatrain-auto", "native", "fsdp2-offload", "zero3-offload", "zero3-twinflow", "megatrain-host",
           "megatrain-stream")
EXTRA_SYSTEMS = ("native-bf16", "megatrain",  # fallbacks the run adds itself; may also be asked for
                 "megatrain-recompute",  # every layer recomputed (checkpoint_every=1): the depth sweep's fixed settings,
                 "megatrain-host-recompute")  # and with placement "host" (device memory flat in depth)
ALIASES = {"peers": ("native", "fsdp2-offload", "zero3-offload", "zero3-twinflow"),
           "zero3": ("zero3-offload", "zero3-twinflow"),
           "megatrain-all": ("megatrain-auto", "megatrain-host", "megatrain-stream")}
# Host bytes per parameter measured on the H200 at the 3B shape (LIMITS.md: RSS 58.5 and 73.5 GiB; Twin-Flow's
# 42.4 GiB, 2026-12-02): a peer whose estimate exceeds --host-gib is not started (a host OOM can take the machine down).
HOST_BYTES_PER_PARAM = {"fsdp2-offload": 20.4, "zero3-offload": 25.6, "zero3-twinflow": 14.8}


@dataclasses.dataclass
class Job:
    system: str
    sweep: str
    shape: str
    batches: list[int]
    layers: int | None = None
    width: float = 1.0


# ---- the parent: jobs, processes, rows -------------------------------------------------------------
def expand(names) -> list[str]:
    """System names with aliases expanded, in order, each once; unknown names raise."""
    out = []
    for n in names:
        for s in ALIASES.get(n, (n,)):
            if s not in SYSTEMS + EXTRA_SYSTEMS:
                raise SystemExit(f"unknown system {s!r}; choose from {', '.join(SYSTEMS + EXTRA_SYSTEMS)} "
                                 f"or an alias ({', '.join(ALIASES)})")
            if s not in out:
                out.append(s)
    return out


def plan_jobs(a) -> list[Job]:
    """The run's jobs, in order: each sweep's systems x models, batches ascending."""
    jobs = []
    peers = expand(a.systems)
    sweepers = expand(a.sweep_systems)
    for sweep in a.sweep:
        if sweep == "core":
            jobs += [Job(s, "core", a.shape, sorted(a.batch)) for s in peers]
        elif sweep == "7b":
            jobs += [Job(s, "7b", a.shape_7b, sorted(a.batch_7b)) for s in peers]
        elif sweep == "depth":
            jobs += [Job(s, "depth", a.shape, [a.sweep_batch], layers=d) for d in a.depths for s in sweepers]
        elif sweep == "width":
            jobs += [Job(s, "width", a.shape, [a.sweep_batch], layers=a.width_layers, width=w)
                     for w in a.widths for s in sweepers]
    return jobs


def host_estimate_gib(job: Job) -> float | None:
    """Host GiB the peer would need (measured bytes/param x params), or None where no estimate is kept."""
    per = HOST_BYTES_PER_PARAM.get(job.system)
    if per is None:
        return None
    cfg = qwen_config(job.shape, layers=job.layers, width=job.width)
    return per * count_params(cfg) / 2**30


def _key(r: dict) -> tuple:
    return (r["system"], r["shape"], r.get("layers"), float(r.get("width") or 1.0), r["batch"], r.get("seq"))


class Runner:
    """Runs jobs one child process at a time and writes one row per (job, batch)."""

    def __init__(self, a):
        self.a = a
        self.t_start = time.monotonic()
        self.rows: list[dict] = []
        self.done = set()
        for path in a.skip_done or []:
            with open(path) as f:
                self.done |= {_key(r) for r in map(json.loads, filter(str.strip, f)) if r.get("status") == "ok"}
        self.log = open(a.log, "a") if a.log else sys.stderr
        self.child: subprocess.Popen | None = None

    def _stop(self, signum, frame) -> None:
        """Killed from outside (a time limit, Ctrl-C): take the running child with us, then exit."""
        if self.child is not None and self.child.poll() is None:
            os.killpg(self.child.pid, signal.SIGKILL)
        sys.exit(128 + signum)

    def emit(self, row: dict) -> None:
        self.rows.append(emit(dict({k: None for k in ROW_KEYS}, **row), self.a.out))

    def placeholder(self, job: Job, batch: int, status: str, error: str, **kw) -> None:
        """The row of a batch that did not run or did not finish: what the run knows, and why."""
        cfg = qwen_config(job.shape, layers=job.layers, seq=self.a.seq, width=job.width)
        self.emit(dict(system=job.system, sweep=job.sweep, shape=job.shape, layers=cfg.num_hidden_layers,
                       hidden=cfg.hidden_size, width=job.width, params=count_params(cfg), batch=batch,
                       seq=self.a.seq, tokens=batch * self.a.seq, status=status, error=error,
                       device=self.a.device, date=time.strftime("%Y-%m-%d"), **kw))

    def left_s(self) -> float:
        return float("inf") if self.a.budget_s is None else self.a.budget_s - (time.monotonic() - self.t_start)

    def run(self, jobs: list[Job]) -> list[dict]:
        """Runs `jobs` in order (and the fallbacks they call for); returns every row written."""
        before = {sig: signal.signal(sig, self._stop) for sig in (signal.SIGTERM, signal.SIGINT)}
        try:
            return self._run(jobs)
        finally:
            for sig, handler in before.items():
                signal.signal(sig, handler)

    def _run(self, jobs: list[Job]) -> list[dict]:
        todo = collections.deque(jobs)
        fell_back = set()
        while todo:
            job = todo.popleft()
            job.batches = [b for b in job.batches
                           if (job.system, job.shape, job.layers, float(job.width), b, self.a.seq) not in self.done]
            if not job.batches:
                continue
            est = host_estimate_gib(job) if self.a.host_check else None
            if est is not None and est > self.a.host_gib:
                for b in job.batches:
                    self.placeholder(job, b, "skipped", f"host RAM: needs ~{est:.0f} GiB "
                                     f"({HOST_BYTES_PER_PARAM[job.system]} B/param as measured at 3B) of "
                                     f"{self.a.host_gib:.0f} GiB; --no-host-check tries anyway")
                continue
            if self.left_s() < self.a.min_job_s:
                for b in job.batches:
                    self.placeholder(job, b, "not-run", f"--budget-s {self.a.budget_s} spent")
                continue
            first = len(self.rows)
            if job.system.startswith("zero3"):
                _clear_extension_locks(self.log)
            got = self.spawn(job)
            left = [b for b in job.batches if b not in {r["batch"] for r in got}]
            last = got[-1] if got else None
            if last is not None and last["status"] == "oom":
                for b in left:  # batches run ascending: a larger one needs more memory still
                    self.placeholder(job, b, "oom", f"not tried: batch {last['batch']} already ran out of memory")
            elif left and len(got) > 1 and last["status"] in ("crashed", "error"):
                todo.appendleft(dataclasses.replace(job, batches=left))  # a fresh process for the rest
            else:  # failed at its first batch, ran out of time or host RAM: the rest would go the same way
                for b in left:
                    self.placeholder(job, b, "not-run", f"not tried: the process for batch {last['batch']} "
                                     f"ended '{last['status']}' (see that row)")
            oom = [r["batch"] for r in self.rows[first:] if r["status"] == "oom"]
            if job.system == "native" and oom:
                todo.appendleft(dataclasses.replace(job, system="native-bf16", batches=oom))
            if (job.system.startswith("megatrain-") and last is not None and last["status"] == "unsupported"
                    and (job.sweep, job.shape, job.layers, job.width) not in fell_back):
                fell_back.add((job.sweep, job.shape, job.layers, job.width))
                todo.appendleft(dataclasses.replace(job, system="megatrain"))
        return self.rows

    def spawn(self, job: Job) -> list[dict]:
        """One child for `job`; its rows as they come; a row for the batch it died on, if it did."""
        a = self.a
        spec = dict(dataclasses.asdict(job), seq=a.seq, steps=a.steps, warmup=a.warmup, device=a.device,
                    twinflow_ratio=a.twinflow_ratio, sub_group_size=int(a.sub_group_size))
        self.log.write(f"\n===== {time.strftime('%H:%M:%S')} {json.dumps(spec)}\n")
        self.log.flush()
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        # Note: [Child group] its own process group (so one killpg ends it and its compilers), but not its own
        # session: whatever ends this run's session (a device call's time limit) ends the child too.
        proc = subprocess.Popen([sys.executable, os.path.abspath(__file__), "--child", json.dumps(spec)],
                                stdout=subprocess.PIPE, stderr=self.log, text=True, env=env, process_group=0)
        self.child = proc
        lines: queue.Queue = queue.Queue()
        threading.Thread(target=lambda: [lines.put(ln) for ln in proc.stdout] + [lines.put(None)], daemon=True).start()
        deadline = time.monotonic() + min(a.job_timeout, max(self.left_s(), 1.0))
        got, why, peak_rss, eof = [], None, 0, False
        while not eof:
            try:
                ln = lines.get(timeout=0.5)
            except queue.Empty:
                ln = ""
            if ln is None:
                eof = True
            elif ln.startswith(ROW_MARK):
                row = json.loads(ln[len(ROW_MARK):])
                got.append(row)
                self.emit(row)
            elif ln:
                self.log.write(ln)
            peak_rss = max(peak_rss, _tree_rss(proc.pid))
            if why is None and time.monotonic() > deadline:
                why = ("timeout", f"killed at --job-timeout {a.job_timeout} s or the end of --budget-s {a.budget_s}")
            elif why is None and a.host_reserve_gib and _host_available_gib() < a.host_reserve_gib:
                why = ("host-oom", f"killed: host RAM available fell below {a.host_reserve_gib} GiB "
                                   f"(the child held {peak_rss / 2**30:.1f} GiB)")
            if why is not None and proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)  # the child's group: it and what it started (Note: [Child group])
        rc = proc.wait()
        self.child = None
        left = [b for b in job.batches if b not in {r["batch"] for r in got}]
        if left and (why is not None or rc != 0 or not got):
            self.log.flush()
            sigkill = " (SIGKILL, not from this run: most likely the kernel's OOM killer, host RAM)" if rc == -9 else ""
            status, err = why or ("crashed", f"exit code {rc}{sigkill}: {_tail(a.log)}")
            self.placeholder(job, left[0], status, err, host_rss_peak_gib=round(peak_rss / 2**30, 1))
            got.append(self.rows[-1])
        return got


def _tree_rss(pid: int) -> int:
    try:
        import psutil

        p = psutil.Process(pid)
        return sum(q.memory_info().rss for q in [p] + p.children(recursive=True))
    except Exception:  # noqa: BLE001 - gone between the poll and the read
        return 0


def _host_available_gib() -> float:
    try:
        import psutil

        return psutil.virtual_memory().available / 2**30
    except ImportError:
        return float("inf")


def _clear_extension_locks(log) -> None:
    """Removes torch-extension build locks left by a killed compile (one child at a time: none is live)."""
    import glob

    root = os.environ.get("TORCH_EXTENSIONS_DIR") or os.path.expanduser("~/.cache/torch_extensions")
    for lock in glob.glob(os.path.join(root, "*", "*", "lock")):
        os.remove(lock)
        log.write(f"removed a stale build lock {lock}\n")


def _tail(path: str | None, n: int = 800) -> str:
    if not path:
        return "(see stderr)"
    with open(path, "rb") as f:
        f.seek(max(0, os.path.getsize(path) - n))
        return f.read().decode(errors="replace").replace("\n", " | ")


def parse(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    ap.add_argument("--sweep", nargs="+", default=["core"], choices=["core", "7b", "depth", "width"])
    ap.add_argument("--systems", nargs="+", default=list(SYSTEMS), help="for core and 7b; aliases: " +
                    ", ".join(f"{k}={'/'.join(v)}" for k, v in ALIASES.items()))
    ap.add_argument("--sweep-systems", nargs="+", default=["megatrain-auto"], help="for depth and width")
    ap.add_argument("--shape", default="3b", help="core's model, and the depth/width sweeps' base")
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 4, 8, 16], help="core's batches (x --seq)")
    ap.add_argument("--batch-7b", type=int, nargs="+", default=[2, 8])
    ap.add_argument("--shape-7b", default="7b", help=argparse.SUPPRESS)  # --tiny swaps it for the tiny shape
    ap.add_argument("--depths", type=int, nargs="+", default=[36, 72, 108])
    ap.add_argument("--widths", type=float, nargs="+", default=[1.0, 1.5, 2.0])
    ap.add_argument("--width-layers", type=int, default=18, help="fixed depth of the width sweep (x2 at 36 "
                    "layers is 11.7B params: past 126 GiB of host RAM)")
    ap.add_argument("--sweep-batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=4096)
    ap.add_argument("--steps", type=int, default=3, help="timed steps per batch (median), after --warmup")
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--twinflow-ratio", type=float, default=0.3, help="share of optimizer states on the host")
    ap.add_argument("--sub-group-size", type=float, default=1e8, help="DeepSpeed's optimizer sub-group, elements")
    ap.add_argument("--per-process", choices=["model", "batch"], default="model",
                    help="model: one process per (system, model) over its batches; batch: one per batch")
    ap.add_argument("--budget-s", type=float, default=None, help="start no job after this many seconds, and "
                    "kill the one running then; the rest get 'not-run' rows")
    ap.add_argument("--min-job-s", type=float, default=30)
    ap.add_argument("--job-timeout", type=float, default=420, help="seconds per child process")
    ap.add_argument("--host-gib", type=float, default=126, help="host RAM to plan peers against")
    ap.add_argument("--no-host-check", dest="host_check", action="store_false")
    ap.add_argument("--host-reserve-gib", type=float, default=0, help="kill a child when less host RAM is "
                    "available (0: off; on a VM whose memory grows on demand 'available' can read low early)")
    ap.add_argument("--skip-done", nargs="*", help="JSONL files whose ok rows need not run again")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--tiny", action="store_true", help="the tiny shape, seq 64, batch 1 2: CPU tests")
    ap.add_argument("--out", default=None, help="append JSON rows here")
    ap.add_argument("--log", default=None, help="the children's output (default: stderr)")
    ap.add_argument("--dry-run", action="store_true", help="print the jobs and exit")
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    if "--tiny" in (sys.argv[1:] if argv is None else argv):  # its defaults; flags given still win
        ap.set_defaults(shape="tiny", shape_7b="tiny", seq=64, batch=[1, 2], batch_7b=[1, 2], sweep_batch=2,
                        depths=[2, 4], width_layers=2)
    return ap.parse_args(argv)


def main(argv=None) -> list[dict] | None:
    a = parse(argv)
    if a.child:
        sys.exit(child_main(json.loads(a.child)))
    jobs = plan_jobs(a)
    if a.per_process == "batch":
        jobs = [dataclasses.replace(j, batches=[b]) for j in jobs for b in j.batches]
    if a.dry_run:
        for j in jobs:
            est = host_estimate_gib(j)
            print(json.dumps(dict(dataclasses.asdict(j), host_estimate_gib=None if est is None else round(est, 1))))
        return None
    if a.out:
        os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
    rows = Runner(a).run(jobs)
    from plot_peers import summary_markdown

    print(summary_markdown(rows), flush=True)
    return rows


if __name__ == "__main__":
    main()
