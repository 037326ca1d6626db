"""Command line: ``python -m megatrain_nb demo`` and ``python -m megatrain_nb train``.

Owns: parsing arguments, the two training loops (a progress bar and a summary around
``Session.step``), and turning a user's mistake into one line ``error: ...`` with exit code 2.
Does not own: anything a step does (``Session``), tokenization or batching (``data``).

Exit codes: 0 done (demo: and the loss fell); 1 the demo's loss did not fall; 2 bad arguments,
files or settings; 130 interrupted.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
import warnings
from importlib import resources
from pathlib import Path

USER_ERRORS = (ValueError, FileNotFoundError, TypeError, OSError)  # one line, no traceback (see main)


class _UsageError(Exception):
    pass


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # argparse would print the usage block and exit; main prints one line
        raise _UsageError(f"{message} (see: python -m {self.prog} --help)")


def _int_at_least(lo: int):
    def parse(text: str) -> int:
        try:
            v = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
        if v < lo:
            raise argparse.ArgumentTypeError(f"{v} is too small: must be >= {lo}")
        return v
    return parse


def _positive_float(text: str) -> float:
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not v > 0 or v == float("inf"):
        raise argparse.ArgumentTypeError(f"{v} must be a finite number > 0")
    return v


def _size(field: str):
    """An argparse type: a memory budget as bytes (``budget.parse_bytes``), its error in argparse's words."""
    def parse(text: str) -> int:
        from .machine.budget import parse_bytes

        try:
            return parse_bytes(int(text) if text.strip().isdigit() else text, field)
        except ValueError as e:
            raise argparse.ArgumentTypeError(str(e)) from None
    return parse


def build_parser() -> argparse.ArgumentParser:
    """The ``megatrain_nb`` argument parser (subcommands ``demo`` and ``train``)."""
    p = _Parser(prog="megatrain_nb", description="Full-parameter LLM training with weights in host RAM and "
                "layers streamed through the device one at a time.")
    sub = p.add_subparsers(dest="command", required=True, metavar="{demo,train}", parser_class=_Parser)

    common = _Parser(add_help=False)
    common.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"),
                        help="auto: cuda if available, else cpu (default: %(default)s). The compute dtype follows: "
                             "bf16 on cuda, fp32 on cpu")
    common.add_argument("--seed", type=int, default=0, help="seed of the data order / init (default: %(default)s)")
    common.add_argument("--optimizer-state", default="fp32", choices=("fp32", "int8", "int4"),
                        help="Adam moments: fp32 (exact AdamW, 8 bytes a parameter), int8 (~2) or int4 (~1), "
                             "block-wise quantized; the fp32 master stays exact (default: %(default)s)")
    common.add_argument("--device-memory", type=_size("device_memory"), default=None, metavar="SIZE",
                        help="the most GPU memory to use, e.g. 20GiB or 24GB (default: the whole card)")
    common.add_argument("--host-memory", type=_size("host_memory"), default=None, metavar="SIZE",
                        help="the most host RAM the process may hold, e.g. 64GB (default: what the machine has); "
                             "a model that does not fit is refused before anything is allocated")

    d = sub.add_parser("demo", parents=[common], help="train a tiny Llama (16M params) on a synthetic task",
                       description="Train the package's tiny Llama from random init on a synthetic task and check "
                                   "that the loss falls. Exit code 0 if it fell, 1 if not.")
    d.add_argument("--steps", type=_int_at_least(2), default=40, help="training steps (default: %(default)s)")
    d.add_argument("--batch", type=_int_at_least(1), default=8, help="sequences per step (default: %(default)s)")
    d.add_argument("--seq", type=_int_at_least(2), default=128, help="tokens per sequence (default: %(default)s)")
    d.add_argument("--lr", type=_positive_float, default=1e-3, help="AdamW learning rate (default: %(default)s)")
    d.add_argument("--task", default="successor", choices=("successor", "copy"),
                   help="synthetic task, see megatrain_nb.data.synthetic_batches (default: %(default)s)")

    t = sub.add_parser("train", parents=[common], help="fine-tune a local HF model directory on a data file",
                       description="Fine-tune every parameter of a local Hugging Face causal-LM directory on a "
                                   "JSONL / JSON / Parquet file of chat {\"messages\"}, alpaca {\"instruction\", "
                                   "\"output\"}, {\"prompt\", \"response\"} or {\"text\"} records (the format is "
                                   "detected), then save it.")
    t.add_argument("--model", required=True, metavar="DIR", help="HF model directory (config.json + safetensors; "
                   "its tokenizer if present, else UTF-8 bytes)")
    t.add_argument("--data", required=True, metavar="FILE", help="training records (.jsonl, .json or .parquet)")
    t.add_argument("--eval-data", metavar="FILE", default=None, help="held-out records: their mean loss per "
                   "supervised token is printed every --eval-every steps and at the end")
    t.add_argument("--eval-every", type=_int_at_least(1), default=None, metavar="N",
                   help="evaluate every N steps (default: at the end only; needs --eval-data)")
    t.add_argument("--pack", action=argparse.BooleanOptionalAction, default=True,
                   help="several examples per row, each attending only to itself (default), or one per row")
    t.add_argument("--save-every", type=_int_at_least(1), default=None, metavar="N",
                   help="write a resumable checkpoint to OUT/checkpoint every N steps (Session.resume)")
    t.add_argument("--lr-schedule", default="constant", choices=("constant", "linear", "cosine"),
                   help="learning-rate decay to 0 at --steps, after warmup (default: %(default)s)")
    t.add_argument("--warmup-steps", type=_int_at_least(0), default=0, metavar="N",
                   help="linear warmup from 0 over the first N steps (default: %(default)s)")
    t.add_argument("--steps", type=_int_at_least(1), default=100, help="training steps (default: %(default)s)")
    t.add_argument("--batch", type=_int_at_least(1), default=8, help="sequences per step (default: %(default)s)")
    t.add_argument("--seq", type=_int_at_least(2), default=512, help="tokens per row; a longer example is an error "
                   "(default: %(default)s)")
    t.add_argument("--pass-batch", type=_int_at_least(1), default=None, metavar="N",
                   help="gradient accumulation: run each batch as passes of N sequences, one update (default: one "
                        "pass, or on a GPU the planner's choice)")
    t.add_argument("--lr", type=_positive_float, default=2e-5, help="AdamW learning rate (default: %(default)s)")
    t.add_argument("--out", metavar="DIR", default=None, help="output directory (default: out/<model dir name>)")
    t.add_argument("--checkpoint-every", type=_int_at_least(0), default=None, metavar="K",
                   help="activation checkpointing: recompute blocks of K layers in the backward; 0 keeps every "
                        "layer's activations (default: keep what fits in device memory, recompute the rest)")
    return p


def main(argv: list[str] | None = None) -> int:
    """Run the command line; returns the exit code (``python -m megatrain_nb`` exits with it).

    Set ``MEGATRAIN_TRACEBACK=1`` to see the traceback behind an ``error: ...`` line.
    """
    fmt, warnings.formatwarning = warnings.formatwarning, _one_line_warning
    try:
        args = build_parser().parse_args(argv)
        return _demo(args) if args.command == "demo" else _train(args)
    except _UsageError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except USER_ERRORS as e:
        if os.environ.get("MEGATRAIN_TRACEBACK"):
            raise
        msg = str(e) if not isinstance(e, KeyError) else repr(e)
        print(f"error: {msg.splitlines()[0] if msg else type(e).__name__}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted; nothing saved", file=sys.stderr)
        return 130
    finally:
        warnings.formatwarning = fmt


def _one_line_warning(message, category, filename, lineno, line=None) -> str:
    return f"warning: {message}\n"


def tiny_config():
    """The demo model: a 16M-parameter LlamaConfig from ``megatrain_nb/data/files/tiny_llama.json``."""
    from transformers import AutoConfig

    d = json.loads(resources.files("megatrain_nb").joinpath("data", "files", "tiny_llama.json").read_text())
    return AutoConfig.for_model(**d)


def _device(name: str) -> str:
    """--device: "auto" is cuda when available; asking for cuda without it is an error, now."""
    import torch

    if name == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda, but torch.cuda.is_available() is False: use --device cpu (or auto)")
    return ("cuda" if torch.cuda.is_available() else "cpu") if name == "auto" else name


def _demo(args) -> int:
    from .data import synthetic_batches
    from .session import Session

    device = _device(args.device)
    cfg = tiny_config()
    batches = synthetic_batches(cfg.vocab_size, args.batch, args.seq, seed=args.seed, kind=args.task)
    t0 = time.perf_counter()
    s = Session.from_config(cfg, seed=args.seed, device=device, lr=args.lr, optimizer_state=args.optimizer_state,
                            device_memory=args.device_memory, host_memory=args.host_memory)
    try:
        print(f"{s}; task {args.task!r}, batch {args.batch} x seq {args.seq}, {args.steps} steps")
        losses = _loop(s, batches, args.steps, "demo")
    finally:
        s.close()  # drains pending updates and stops the worker threads
    k = max(1, min(5, args.steps // 4))
    tail = sum(losses[-k:]) / k
    fell = tail < losses[0]
    print(f"loss: first {losses[0]:.4f}, last {losses[-1]:.4f} (mean of last {k}: {tail:.4f}) -> "
          f"{'fell' if fell else 'DID NOT FALL'}")
    print(_bytes_line(s.store.bytes_report()))
    print(f"wall time {time.perf_counter() - t0:.1f} s")
    return 0 if fell else 1


def _train(args) -> int:
    from .step import distributed
    from .data import sft_batches
    from .session import Session

    device = _device(args.device)
    if distributed.init():  # under torchrun: data parallel, each rank its own rows (docs/distributed.md)
        try:
            return _train_ranks(args, device)
        finally:
            distributed.destroy()
    return _train_ranks(args, device)


def _train_ranks(args, device: str) -> int:
    """``train`` on this process; under data parallel it reads its rank's batches and rank 0 writes."""
    from .step import distributed
    from .data import sft_batches
    from .session import Session

    rank, size = distributed.world()
    model = Path(args.model)
    if not (model / "config.json").is_file():  # before the data, so a wrong path is the one error shown
        raise FileNotFoundError(f"model directory {str(model)!r} does not exist" if not model.is_dir()
                                else f"{str(model)!r} has no config.json; pass an HF model directory")
    if args.eval_every is not None and args.eval_data is None:
        raise ValueError("--eval-every needs --eval-data FILE")
    out = Path(args.out) if args.out else Path("out") / model.resolve().name
    data = sft_batches(args.data, model, batch=args.batch, seq=args.seq, pack=args.pack, seed=args.seed)
    data = distributed.strided(data) if size > 1 else data  # --batch rows per rank: batch x ranks per step
    held_out = (sft_batches(args.eval_data, data.enc.tok or model, batch=args.batch, seq=args.seq, pack=args.pack)
                if args.eval_data else None)
    schedule = {} if args.lr_schedule == "constant" else {"total_steps": args.steps}
    s = Session.from_pretrained(model, device=device, lr=args.lr, checkpoint_every=args.checkpoint_every,
                                pass_batch_size=args.pass_batch,
                                lr_schedule=args.lr_schedule, warmup_steps=args.warmup_steps,
                                optimizer_state=args.optimizer_state, device_memory=args.device_memory,
                                host_memory=args.host_memory, **schedule)
    try:
        ranks = f", {size} ranks (data parallel)" if size > 1 else ""
        _say(rank, f"{s}; data {args.data} ({len(data.examples)} {data.format} examples, "
             f"{'packed' if args.pack else 'one per row'}), batch {args.batch} x seq {args.seq}{ranks}")
        losses = _loop(s, data, args.steps, "train", held_out=held_out, eval_every=args.eval_every,
                       save_every=args.save_every, out=out, quiet=rank > 0)
        if rank > 0:  # every rank holds the same weights: rank 0 writes them
            return 0
        s.save_pretrained(out)  # waits for the last updates
        sample = _sample(s, data) if data.enc.tok is not None else None
    finally:
        s.close()
    _save_tokenizer(model, out)
    evals = [(e["step"], e["eval_loss"]) for e in s.eval_history]
    state = {"steps": len(losses), "data": data.state_dict(), "losses": losses, "lr": args.lr, "eval": evals}
    (out / "megatrain_state.json").write_text(json.dumps(state, indent=1))
    print(f"loss: first {losses[0]:.4f}, last {losses[-1]:.4f}")
    if evals:
        print(f"eval loss: {', '.join(f'step {k} {v:.4f}' for k, v in evals)}")
    if sample is not None:
        print(f"sample: {sample[0]!r} -> {sample[1]!r}")
    print(_bytes_line(s.store.bytes_report()))
    print(f"saved to {out}")
    return 0


def _sample(s, data, new_tokens: int = 32) -> tuple:
    """(prompt, greedy completion) from the data's first record: a chat's turns before its last reply,
    an alpaca instruction or a prompt; the first words of a text."""
    rec, fmt = data.first_record, data.format
    if fmt == "chat":
        ms = rec["messages"]
        last = max(k for k, m in enumerate(ms) if m["role"] == "assistant")
        prompt = ms[:last]
        shown = prompt[-1]["content"] if prompt else ""
    elif fmt == "alpaca":
        prompt = shown = rec["instruction"] + (f"\n\n{rec['input']}" if rec.get("input") else "") + "\n\n"
    elif fmt == "prompt/response":
        prompt = shown = rec["prompt"]
    else:
        prompt = shown = " ".join(rec["text"].split()[:8])
    return shown, s.generate(prompt, max_new_tokens=new_tokens, tokenizer=data.enc.tok)


def _say(rank: int, text: str) -> None:
    if rank == 0:  # data parallel: one rank speaks for all (they report the same loss)
        print(text)


def _loop(s, batches, steps: int, desc: str, *, held_out=None, eval_every: int | None = None,
          save_every: int | None = None, out: Path | None = None, quiet: bool = False) -> list[float]:
    from tqdm import tqdm

    losses = []
    with tqdm(total=steps, desc=desc, unit="step", file=sys.stderr, dynamic_ncols=True, disable=quiet) as bar:
        for k in range(1, steps + 1):
            r = s.step(next(batches))
            losses.append(r.loss)
            post = {"loss": f"{r.loss:.3f}", "tok_s": f"{r.tokens / r.seconds:.0f}"}
            if held_out is not None and ((eval_every and k % eval_every == 0) or k == steps):
                post["eval"] = f"{s.evaluate(held_out):.3f}"
            if save_every and k % save_every == 0:
                s.save_checkpoint(out / "checkpoint", data_state=batches.state_dict())
            bar.set_postfix(post, refresh=False)
            bar.update()
    return losses


def _bytes_line(rep: dict) -> str:
    n = rep["params"]
    cats = [k for k in rep if k not in ("total", "params", "bytes_per_param") and rep[k]]  # master, grad, ...
    parts = ", ".join(f"{k} {rep[k] / n:.1f}" for k in cats)
    return f"host memory: {rep['total'] / 2**20:.1f} MiB for {n / 1e6:.1f}M params = {rep['bytes_per_param']:.1f} " \
           f"bytes/param ({parts})"


def _save_tokenizer(model: Path, out: Path) -> None:
    """Copy the model's tokenizer next to the trained weights, when it has one."""
    from .data import TOKENIZER_FILES

    if any((model / f).exists() for f in TOKENIZER_FILES):
        from transformers import AutoTokenizer

        AutoTokenizer.from_pretrained(str(model)).save_pretrained(str(out))
