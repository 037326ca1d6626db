"""A training batch checked and cut into the engine's micro-batches, before anything of a step runs.

Owns: the batch's validation (ids, labels, attention mask and packed positions: dtypes, shapes, the vocabulary;
each error names the field, the value and the fix), HF's label shift, the count of supervised tokens, and the
micro-batches (``micro_batch_size``, or "auto"'s choice; whole pairs and groups with a loss hook, whose per-row and
per-token fields each micro-batch carries). Does not own: the step, devices, or the hook's arithmetic (hook.py).
"""
from __future__ import annotations

from typing import Callable

import torch

from . import passes


def prepare(batch: dict, *, vocab: int, micro_batch: Callable[[int, int], int | None], fields: bool = False,
            group_size: int | None = None, micro_batch_size: int | None = None,
            need_labels: bool = True, pass_rows: Callable[[int, int], int | None] | None = None,
            pass_batch_size: int | None = None) -> tuple[list[dict], int, int]:
    """(micro-batches, supervised tokens, tokens) of ``batch``; raises before anything is touched.

    Args:
        batch: {"input_ids" (B, T), "labels"?, "attention_mask"?, "position_ids"?, ...}.
        vocab: the model's vocabulary size.
        micro_batch: (B, T) -> rows per micro-batch, or None for the whole batch (the engine's setting or choice).
        fields: a loss hook's step: each micro-batch also gets ``"batch"`` (what the hook's loss reads), in
            micro-batches of whole groups (``group_size``, ``micro_batch_size`` the user's setting).
        need_labels: refuse a batch without a supervised token.
        pass_rows: (B, T) -> "auto"'s rows per pass, or None; ``pass_batch_size`` (the user's) wins. Each
            micro-batch carries its pass's index as ``"pass"`` (Note: [Passes] in passes.py); micro-batches
            split each pass, never span two.
    Raises:
        TypeError / ValueError: a malformed batch, naming the field and the fix.
    """
    if not isinstance(batch, dict) or "input_ids" not in batch:
        raise TypeError("batch must be a dict with 'input_ids' (and optionally 'labels', 'attention_mask')")
    ids = _as_long(batch["input_ids"], "input_ids")
    labels = ids if batch.get("labels") is None else _as_long(batch["labels"], "labels")  # None: as if absent
    if ids.dim() != 2:
        raise ValueError(f"input_ids has shape {tuple(ids.shape)}; expected [batch, seq]")
    if ids.numel() == 0:
        raise ValueError(f"input_ids has shape {tuple(ids.shape)}: the batch is empty")
    if labels.shape != ids.shape:
        raise ValueError(f"labels has shape {tuple(labels.shape)} but input_ids has {tuple(ids.shape)}; "
                         "they must match (use -100 where no loss applies)")
    V = vocab  # the ids and labels must index it
    if ids.min() < 0 or ids.max() >= V:
        bad = ids[(ids < 0) | (ids >= V)][0].item()
        raise ValueError(f"input_ids holds token id {bad}, outside the vocabulary [0, {V}); check the tokenizer")
    lab_ok = (labels == -100) | ((labels >= 0) & (labels < V))
    if not bool(lab_ok.all()):
        bad = labels[~lab_ok][0].item()
        raise ValueError(f"labels holds {bad}: each label must be in [0, {V}) or -100 (ignored)")
    mask = batch.get("attention_mask")
    if mask is not None:
        mask = _as_tensor(mask, "attention_mask")
        if mask.shape != ids.shape:
            raise ValueError(f"attention_mask has shape {tuple(mask.shape)} but input_ids has {tuple(ids.shape)}")
        bad = mask[(mask != 0) & (mask != 1)]
        if bad.numel():
            raise ValueError(f"attention_mask holds {bad[0].item()}; it must hold only 0 (padding) and 1")
        mask = mask.to(torch.long)
    pos = batch.get("position_ids")
    if pos is not None:  # packed rows: positions restart at each example (packing.py)
        pos = _as_long(pos, "position_ids")
        if pos.shape != ids.shape or pos.min() < 0:
            raise ValueError(f"position_ids has shape {tuple(pos.shape)}, min {int(pos.min())}; it must match "
                             f"input_ids {tuple(ids.shape)} and be >= 0 (0 where an example starts)")
    shift = torch.full_like(labels, -100)
    shift[:, :-1] = labels[:, 1:]  # HF shifts inside: position t predicts token t+1
    n_valid = int((shift != -100).sum())
    if n_valid == 0 and need_labels:
        raise ValueError("no supervised tokens: every label after shifting is -100, so the loss is undefined")
    B, T = ids.shape
    group = 1
    if fields:
        from . import hook

        extra = hook.loss_fields(batch, B, T)
        group = hook.group_size_of(batch, group_size, B)
    rows = passes.rows_per_pass(pass_batch_size, None if pass_rows is None else pass_rows(B, T), B, group)
    mb = min(micro_batch(rows, T) or rows, rows)  # set, or "auto"'s (Note: [Micro-batch choice])
    if fields:
        mb = hook.micro_batch_for(mb, rows, group, micro_batch_size)
    cuts = [(p, a, min(a + mb, s + rows)) for p, s in enumerate(range(0, B, rows)) for a in range(s, min(s + rows, B), mb)]
    mbs = [{"input_ids": ids[a:b], "shift_labels": shift[a:b], "pass": p,
            "attention_mask": None if mask is None else mask[a:b],
            "position_ids": None if pos is None else pos[a:b]} for p, a, b in cuts]
    if fields:  # what the hook's loss reads: per-row and per-token tensors sliced, the rest as it is
        full = {"input_ids": ids, "labels": labels, **({} if mask is None else {"attention_mask": mask}),
                **({} if pos is None else {"position_ids": pos}), **extra}
        for (_, a, b), m in zip(cuts, mbs):
            m["batch"] = {k: v[a:b] if isinstance(v, torch.Tensor) and v.dim() else v for k, v in full.items()}
    return mbs, n_valid, ids.numel()


def _as_tensor(x, name: str) -> torch.Tensor:
    """``x`` (a tensor, array or nested list of numbers) as a CPU tensor; TypeError naming the field otherwise."""
    if x is None or isinstance(x, (str, bytes)):
        raise TypeError(f"{name} is {repr(x)[:60]}: it must be a tensor of shape [batch, seq] (a torch.Tensor, a numpy "
                        "array or a list of lists of integers)")
    if isinstance(x, torch.Tensor) and x.is_meta:
        raise TypeError(f"{name} is a meta tensor (shape {tuple(x.shape)}, no data); pass a tensor with values "
                        "(on the CPU or a GPU)")
    try:
        t = torch.as_tensor(x)
    except (TypeError, ValueError, RuntimeError) as e:
        raise TypeError(f"{name} of type {type(x).__name__} cannot be read as a tensor ({e}); pass a torch.Tensor, "
                        "a numpy array or a list of equal-length lists of integers") from e
    return t.cpu()


def _as_long(x, name: str) -> torch.Tensor:
    t = _as_tensor(x, name)
    if t.dtype.is_floating_point or t.dtype.is_complex or t.dtype == torch.bool:
        raise TypeError(f"{name} has dtype {t.dtype}; token ids must be integers (torch.long)")
    return t.to(device="cpu", dtype=torch.long)  # the host gathers embedding rows and checks ids

