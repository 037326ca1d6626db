"""One benchmark result: printed as a JSON line and, with ``out``, appended to that JSONL file."""
from __future__ import annotations

import json


def emit(row: dict, out: str | None) -> None:
    print(json.dumps(row), flush=True)
    if out:
        with open(out, "a") as f:
            f.write(json.dumps(row) + "\n")


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
