"""What the per-file CRC-32 costs a training checkpoint: ``save_checkpoint`` of one store timed with the checksum
folded while writing (Note: [Checksum while writing] in host/shard_writer.py) and with a no-op in its place.

    PYTHONPATH=$PWD python bench/save_speed.py --hidden 768 --layers 6 --repeats 3 --out bench/results/cpu-$(date -u +%F)-save.jsonl

One JSON row: params, checkpoint bytes, the median seconds of each way (saves alternate, so the page cache and
the disk treat both alike), GB/s, the checksum's share of a save (medians, and best against best) and the
load average: on a machine shared with other work the checksum's thread finds no idle core and the shares
measure the contention as much as the checksum. The directory is removed afterwards.
"""
from __future__ import annotations

import argparse
import datetime
import os
import shutil
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(__file__))
from rows import emit  # noqa: E402

from megatrain_nb import Session  # noqa: E402
from megatrain_nb.host import shard_writer  # noqa: E402


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hidden", type=int, default=768)
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--dir", default=None, help="where to write (default: a temporary directory)")
    ap.add_argument("--out", default=f"bench/results/cpu-{datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d}-save.jsonl")
    a = ap.parse_args(argv)
    from transformers import LlamaConfig

    cfg = LlamaConfig(hidden_size=a.hidden, intermediate_size=a.hidden * 8 // 3, num_hidden_layers=a.layers,
                      num_attention_heads=max(1, a.hidden // 64), num_key_value_heads=max(1, a.hidden // 256),
                      vocab_size=a.vocab, tie_word_embeddings=False)
    s = Session.from_config(cfg, seed=0, device="cpu")
    root = a.dir or tempfile.mkdtemp(prefix="save-speed-")
    path = os.path.join(root, "ck")
    real = shard_writer.checksum
    times = {"crc32": [], "none": []}
    try:
        s.save_checkpoint(path)  # a first save: the files exist, each timed save replaces them as in training
        for _ in range(a.repeats):
            for way in ("crc32", "none"):
                shard_writer.checksum = real if way == "crc32" else (lambda buf, crc: 0)
                t0 = time.perf_counter()
                s.save_checkpoint(path)
                times[way].append(time.perf_counter() - t0)
        nbytes = sum(os.path.getsize(os.path.join(path, f)) for f in os.listdir(path))
    finally:
        shard_writer.checksum = real
        s.close()
        shutil.rmtree(root if a.dir is None else path, ignore_errors=True)
    with_crc, without = statistics.median(times["crc32"]), statistics.median(times["none"])
    return emit(dict(tool="save_speed", params=s.store.num_params(), checkpoint_bytes=nbytes, repeats=a.repeats,
                     seconds_crc32=round(with_crc, 3), seconds_none=round(without, 3),
                     seconds_all={k: [round(t, 3) for t in v] for k, v in times.items()},
                     GBps_crc32=round(nbytes / with_crc / 1e9, 2), GBps_none=round(nbytes / without / 1e9, 2),
                     checksum_share=round(with_crc / without - 1, 4),
                     checksum_share_best=round(min(times["crc32"]) / min(times["none"]) - 1, 4),
                     loadavg=os.getloadavg()[0]), a.out)


if __name__ == "__main__":
    main()
