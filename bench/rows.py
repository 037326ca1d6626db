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


def busy_shares(rec, raws: list, last: dict) -> list[float]:
    """Each timed step's compute busy share, in order: the earlier steps' raw records (``Engine.step_records``,
    kept during the timed steps) resolved now, then the last step's from its summary ``last`` (``trace.summarize``)."""
    from megatrain_nb.trace import summarize

    busy = [summarize(rec.resolve(raw).to_dataframe()).get("compute_busy_share", float("nan")) for raw in raws[:-1]]
    return busy + [last.get("compute_busy_share", float("nan"))]


def host_adam_rate(spans) -> float | None:
    """The host's AdamW rate in a step's spans (``Trace.to_dataframe``), G params/s: its spans count 16 bytes a
    parameter (``Engine._update``); what the planner needs for the row. None where the host updated nothing."""
    adam = spans[(spans.lane == "host-adam") & (spans.op == "adam") & (spans.bytes > 0)]
    return float(adam.bytes.sum() / 16 / adam.dur_ms.sum() / 1e6) if len(adam) else None
