"""One benchmark result: printed as a JSON line and, with ``out``, appended to that JSONL file.

Every row has one schema (bench/results/README.md): first where and how it was measured -- ``machine``,
``date`` (UTC, YYYY-MM-DD), ``code`` (the commit, "+" when the tree had changes; $MEGATRAIN_CODE where
there is no git) and ``command`` (what reproduces it) -- then the tool's own fields. ``load`` reads rows.
"""
from __future__ import annotations

import datetime
import functools
import json
import os
import subprocess
import sys

HEADER = ("machine", "date", "code", "command")


@functools.cache
def machine() -> str:
    """The GPUs (name x count) or "CPU", the host's cores and RAM: what a reader needs to compare rows. Asks
    nvidia-smi, not torch: a parent process (bench/peers.py) must not take a CUDA context from its children."""
    try:
        names = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True,
                               text=True, timeout=20).stdout.split("\n")
        names = [n.strip() for n in names if n.strip()]
    except (OSError, subprocess.SubprocessError):
        names = []
    dev = f"{names[0]} x{len(names)}" if names else "CPU"
    ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    return f"{dev}, {os.cpu_count()} cores, {ram:.0f} GiB"


@functools.cache
def code() -> str | None:
    """The commit this tree is at, "+" if it has uncommitted changes; $MEGATRAIN_CODE where git cannot say."""
    if os.environ.get("MEGATRAIN_CODE"):
        return os.environ["MEGATRAIN_CODE"]
    here = os.path.dirname(os.path.abspath(__file__))
    try:
        rev = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=here, capture_output=True, text=True,
                             timeout=10).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--", "megatrain_nb", "bench"], cwd=os.path.dirname(here),
                               capture_output=True, text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None
    return (rev + ("+" if dirty else "")) or None


def header() -> dict:
    """machine, date, code and command of a row measured now by this process."""
    return dict(machine=machine(), date=datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d"),
                code=code(), command="python " + " ".join(sys.argv))


def emit(row: dict, out: str | None) -> dict:
    """Print ``row`` as a JSON line, the header first (fields the row already has are kept); append to ``out``.
    Returns the row as written."""
    row = {**header(), **row}
    print(json.dumps(row), flush=True)
    if out:
        with open(out, "a") as f:
            f.write(json.dumps(row) + "\n")
    return row


def load(path: str) -> list[dict]:
    """The rows of a JSONL results file, in order."""
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def rss_bytes() -> int:
    """This process's resident host memory (Linux /proc)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


def pss_bytes() -> int:
    """This process's proportional set size (Linux /proc): shared pages count 1/n in each of their n
    mappers, so the sum over a machine's processes is the machine's bytes (RSS counts them n times)."""
    try:
        with open("/proc/self/smaps_rollup") as f:
            for line in f:
                if line.startswith("Pss:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def busy_shares(rec, raws: list, last: dict) -> list[float]:
    """Each timed step's compute busy share, in order: the earlier steps' raw records (``Engine.step_records``,
    kept during the timed steps) resolved now, then the last step's from its summary ``last`` (``trace.summarize``)."""
    from megatrain_nb.view.trace import summarize

    busy = [summarize(rec.resolve(raw).to_dataframe()).get("compute_busy_share", float("nan")) for raw in raws[:-1]]
    return busy + [last.get("compute_busy_share", float("nan"))]


def host_adam_rate(spans) -> float | None:
    """The host's AdamW rate in a step's spans (``Trace.to_dataframe``), G params/s: its spans count 16 bytes a
    parameter (``Engine._update``); what the planner needs for the row. None where the host updated nothing."""
    adam = spans[(spans.lane == "host-adam") & (spans.op == "adam") & (spans.bytes > 0)]
    return float(adam.bytes.sum() / 16 / adam.dur_ms.sum() / 1e6) if len(adam) else None
