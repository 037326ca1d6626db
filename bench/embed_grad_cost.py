"""What the embedding's gradient costs the host a step, held as a dense fp32 slab or as the rows the step touched
(Note [Embedding rows] in megatrain_nb/host/embed_grad.py): the scatter of the step's rows, the AdamW update of the
whole table, and the bytes each holds. Host only (no GPU), one JSON row per form.

Run from the repository root, e.g. (the 7B shape's embedding, a step of 8 x 4096 tokens):
    python bench/embed_grad_cost.py --vocab 152064 --hidden 3584 --tokens 32768 --repeats 3 \
        --rows bench/results/cpu-DATE-embed-grad.jsonl
``--add index_add scatter_add`` times the rows form with each op that adds a step's rows (``embed_grad.ADD``).
It allocates the table's master and moments (12 bytes a value) and, for the slab, 4 more: 8.2 GiB and 10.2 GiB at
the 7B shape. The token ids are uniform over the vocabulary (more distinct rows than text touches: the rows' upper
side). Both forms' results are compared bit for bit before any time is reported.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from types import SimpleNamespace

import torch

sys.path.insert(0, os.path.dirname(__file__))
from rows import emit  # noqa: E402

from megatrain_nb.config import OptimConfig  # noqa: E402
from megatrain_nb.host import embed_grad  # noqa: E402
from megatrain_nb.host.embed_grad import RowGrad  # noqa: E402
from megatrain_nb.host.optim import HostAdamW, grad_norm  # noqa: E402


def _store(master, m, v, grad, rows):
    unit = SimpleNamespace(master=master, grad=grad, exp_avg=m, exp_avg_sq=v, compact=None)
    return SimpleNamespace(units={-1: unit}, step_count=lambda u: torch.zeros(()), rows=rows,
                           grad_of=lambda u: unit.grad)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--vocab", type=int, default=152064, help="rows of the table (default: %(default)s, Qwen2.5-7B)")
    ap.add_argument("--hidden", type=int, default=3584, help="width of a row (default: %(default)s)")
    ap.add_argument("--tokens", type=int, default=32768, help="a step's tokens (default: %(default)s, 8 x 4096)")
    ap.add_argument("--repeats", type=int, default=3, help="timed steps per form, after one untimed (default: 3)")
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    ap.add_argument("--add", nargs="+", choices=("index_add", "scatter_add"), default=[embed_grad.ADD],
                    help="the rows form's op adding a step's rows (embed_grad.ADD; default: %(default)s); several: "
                         "a rows row for each")
    ap.add_argument("--rows", default=None, help="append each form's JSON row here (bench/rows.py)")
    a = ap.parse_args(argv)
    for name in ("vocab", "hidden", "tokens", "repeats"):
        if getattr(a, name) < 1:
            ap.error(f"--{name} {getattr(a, name)}: give 1 or more")
    if a.threads:
        torch.set_num_threads(a.threads)
    V, H, T = a.vocab, a.hidden, a.tokens
    g = torch.Generator().manual_seed(0)
    cfg = OptimConfig(lr=1e-5, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    master0 = torch.randn(V * H, generator=g) * 0.02
    out, rows_out = {}, []
    for form, add in [("slab", None)] + [("rows", x) for x in a.add]:
        embed_grad.ADD = add or embed_grad.ADD
        master, m, v = master0.clone(), torch.zeros(V * H), torch.zeros(V * H)
        slab = torch.zeros(V, H) if form == "slab" else None
        held = RowGrad(V, H) if form == "rows" else None
        opt = HostAdamW(_store(master, m, v, None if slab is None else slab.view(-1), held), cfg)
        g = torch.Generator().manual_seed(1)
        scatter_s, update_s, early_s, last = [], [], [], None
        g_next = torch.Generator().manual_seed(2)  # the next batch's ids: the steps' own draws stay the slab's
        for k in range(a.repeats + 1):
            ids = torch.randint(0, V, (T,), generator=g)
            dE = (torch.randn(T, H, generator=g) * 1e-3).to(torch.bfloat16)  # the rows as they land from the device
            t0 = time.perf_counter()
            if slab is not None:  # as step/embedding.py's scatter_grads fills the slab
                if last is not None:
                    slab.index_fill_(0, last, 0)
                for i in range(0, T, 1 << 16):
                    slab.index_add_(0, ids[i:i + (1 << 16)], dE[i:i + (1 << 16)].float())
                last = torch.unique(ids)
                norm = grad_norm(slab.index_select(0, last).flatten())
            else:
                norm = grad_norm(held.scatter(ids, dE))
            t1 = time.perf_counter()
            if held is not None:  # the next batch's distinct rows, updated first (Note [Early rows])
                opt.updated_rows(-1, torch.unique(torch.randint(0, V, (T,), generator=g_next)), H, lr=1e-5)
            t2 = time.perf_counter()
            opt.update(-1, lr=1e-5)
            t3 = time.perf_counter()
            if k:
                scatter_s.append(t1 - t0)
                early_s.append(t2 - t1)
                update_s.append(t3 - t2)
        out[form if add is None else add] = master, float(norm)
        nbytes = slab.numel() * 4 if slab is not None else held.nbytes
        row = dict(subject="embed-grad", form=form, add=add, vocab=V, hidden=H, tokens=T,
                   touched_rows=int(last.numel()) if slab is not None else int(held.ids.numel()), grad_bytes=nbytes,
                   scatter_s=round(statistics.median(scatter_s), 4), update_s=round(statistics.median(update_s), 4),
                   early_rows_s=round(statistics.median(early_s), 4) if held is not None else None,
                   update_s_all=[round(x, 4) for x in update_s], threads=torch.get_num_threads(),
                   torch=torch.__version__)
        print(f"{form}{'' if add is None else ' (' + add + ')'}: {nbytes / 2**30:.2f} GiB held, scatter "
              f"{row['scatter_s']:.3f} s, update {row['update_s']:.3f} s"
              + ("" if held is None else f", the next batch's rows first {row['early_rows_s']:.3f} s"), flush=True)
        rows_out.append(row)
        del m, v, slab, held, opt  # the next form's state in their place; the master stays for the comparison
    for add in a.add:
        if not (torch.equal(out["slab"][0], out[add][0]) and out["slab"][1] == out[add][1]):
            raise SystemExit(f"the rows' update or norm ({add}) differs from the slab's: no time is reported for a "
                             "wrong result")
    for row in rows_out:
        emit(row, a.rows)


if __name__ == "__main__":
    main()
