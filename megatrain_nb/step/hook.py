"""The loss hook: a user's ``fn(logp, batch, ctx)`` in place of cross-entropy, differentiated through the head's chunks.

Owns: the batch fields a hook's loss reads (validated and sliced per micro-batch: ``loss_fields``; whole pairs
and groups per micro-batch: ``group_size_of``, ``micro_batch_for``), the step's ``LossContext`` (its global
counts, summed over data-parallel ranks), the two passes over a micro-batch's head chunks, and the metrics
the loss logs, summed over micro-batches and ranks.
Does not own: the head's slot, its gradients' destinations or the loss's all-reduce (``head.py`` calls
``LossHook.micro_batch`` at one named point, Note: [Loss hook]), the losses (``post/losses.py``) or the
chunk math (``post/logprobs.py``).

Note: [Loss hook] a loss over per-token log-probs couples positions (per-row sums, per-pair margins), but
the head runs in chunks of positions, each with its backward at once, so that one chunk's logits live at a
time. So a micro-batch takes two passes over its chunks: (a) without grad, ``logp`` (and the entropy) of
every position, ``(b, T)`` fp32; then ``fn`` on a leaf copy of them, whose backward gives ``dL/dlogp`` (and
``dL/dH``); (b) with grad, each chunk's logits again and ``backward`` of its log-probs with their slice of
``dL/dlogp``: the head's parameter gradients accumulate and the hidden states' gradients come out exactly
as the cross-entropy path's do. The head's matmul runs three times instead of two. The loss of the step is
the sum of what ``fn`` returns over micro-batches (and ranks): each loss divides by ``ctx``'s global counts.
"""
from __future__ import annotations

import torch

from ..post.logprobs import from_hf, to_hf, token_logprobs
from ..post.losses import LossContext, needs_entropy
from .transfers import chunks

KNOWN = ("input_ids", "labels", "attention_mask", "position_ids")


def loss_fields(batch: dict, B: int, T: int) -> dict:
    """The batch's extra fields, checked: tensors of 1+ dims are per row ``(B,)`` or per token ``(B, T, ...)``.

    Raises ValueError naming the field, its shape and the expected one; other values are kept as they are.
    """
    out = {}
    for k, v in batch.items():
        if k in KNOWN:
            continue
        if isinstance(v, torch.Tensor) and v.dim() >= 1:
            if v.shape[0] != B or (v.dim() >= 2 and v.shape[1] != T):
                raise ValueError(f"batch[{k!r}] has shape {tuple(v.shape)}; a loss's field is per row ({B},) or "
                                 f"per token ({B}, {T}), matching input_ids {(B, T)}")
        out[k] = v
    return out


def group_size_of(batch: dict, group_size: int | None, B: int) -> int:
    """Rows that must share a micro-batch: ``group_size``, else 2 with ``pair``, else the run length of ``group``."""
    if group_size is None:
        if "pair" in batch:
            group_size = 2  # a DPO pair: chosen at row 2k, rejected at 2k + 1
        elif "group" in batch:
            g = torch.as_tensor(batch["group"]).cpu()
            runs = torch.unique_consecutive(g, return_counts=True)[1]
            if len(set(runs.tolist())) != 1:
                raise ValueError(f"batch['group'] = {g.tolist()} has groups of sizes {runs.tolist()}: keep each "
                                 "group on consecutive rows, every group the same size, or pass group_size=")
            group_size = int(runs[0])
        else:
            group_size = 1
    if not isinstance(group_size, int) or isinstance(group_size, bool) or group_size < 1 or B % group_size:
        raise ValueError(f"group_size={group_size!r}: must be an int >= 1 that divides the batch's {B} rows "
                         "(a DPO pair: 2; a GRPO group: the completions per prompt)")
    return group_size


def micro_batch_for(mb: int, B: int, group_size: int, setting) -> int:
    """Rows per micro-batch that keep every group whole: an explicit setting must be a multiple of the group."""
    if mb >= B or mb % group_size == 0:
        return min(mb, B)
    if isinstance(setting, int):
        fix = group_size * max(1, setting // group_size)
        raise ValueError(f"micro_batch_size={setting} would split a group of group_size={group_size} rows (a DPO "
                         f"pair or a GRPO group) across micro-batches; set micro_batch_size to a multiple of "
                         f"{group_size}, e.g. micro_batch_size={fix}")
    return group_size * max(1, mb // group_size)  # "auto"'s choice: rounded down to whole groups


class LossHook:
    """One step's loss hook: ``fn``, its ``LossContext`` and the micro-batches' loss batches on the device.

    Args:
        fn: ``fn(logp, batch, ctx) -> 0-d tensor`` (``entropy=`` too when ``needs_entropy(fn)``).
        batches: per micro-batch, the dict ``fn`` sees (``labels`` ``(b, T)`` and the extra fields), on the host.
        temperature: the logits are divided by it before the log-probs.
    """

    def __init__(self, fn, batches: list[dict], *, temperature: float = 1.0):
        self.fn, self.host, self.temperature = fn, batches, temperature
        self.entropy = needs_entropy(fn)
        self.ctx: LossContext | None = None
        self.dev_batches: list[dict] = []

    def begin(self, dp, device) -> None:
        """Driver, at the step's start on the compute stream: the global counts, the loss batches' copies in.

        Under data parallel the counts are summed over ranks (a host sync: every rank waits for the others).
        """
        self.ctx = LossContext.from_batches(self.host, world=None if dp is None else dp.sum_ints,
                                            max_completion_length=self.host[0].get("max_completion_length"))
        up = lambda v: v.to(device, non_blocking=True) if isinstance(v, torch.Tensor) else v  # noqa: E731
        self.dev_batches = [{k: up(v) for k, v in b.items()} for b in self.host]

    def micro_batch(self, m: int, arch, params: dict, h: torch.Tensor, labels: torch.Tensor,
                    positions: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Compute stream: micro-batch ``m``'s loss and its backward through the head (Note: [Loss hook]).

        Args:
            params: the head unit's views, autograd leaves whose ``.grad`` is the head's grad slot.
            h: ``(b, T, H)`` compute dtype: the last layer's output.
            labels: ``(b, T)`` long on the device: the engine's shifted labels (position t predicts t + 1).
            positions: positions per chunk (``shape.loss_positions``).
        Returns:
            (``dL/dh`` ``(b, T, H)``, the loss ``fn`` returned, detached 0-d fp32).
        """
        T, need_H = h.shape[1], self.entropy
        lp = torch.zeros(labels.shape, dtype=torch.float32, device=h.device)  # (b, T) engine's alignment
        Hs = torch.zeros_like(lp) if need_H else None
        with torch.no_grad():  # pass (a): every position's log-prob, one chunk's logits at a time
            for a, b in chunks(T, positions):
                lp[:, a:b], H = token_logprobs(arch.logits(params, h[:, a:b]), labels[:, a:b], self.temperature,
                                               entropy=need_H)
                if need_H:
                    Hs[:, a:b] = H
        logp = to_hf(lp).requires_grad_()
        kw = {}
        if need_H:
            kw["entropy"] = ent = to_hf(Hs).requires_grad_()
        with torch.enable_grad():
            loss = self.fn(logp, self.dev_batches[m], self.ctx, **kw)
            if not isinstance(loss, torch.Tensor) or loss.dim() != 0:
                raise TypeError(f"the loss hook returned {type(loss).__name__} "
                                f"{tuple(loss.shape) if isinstance(loss, torch.Tensor) else ''}; it must return a "
                                "0-d tensor computed from logp")
            loss.backward()
        g_lp = from_hf(_grad(logp))  # (b, T) dL/dlogp at the engine's positions
        g_H = from_hf(_grad(ent)) if need_H else None
        g = torch.empty_like(h)
        for a, b in chunks(T, positions):  # pass (b): the chunks again, with their backward
            with torch.enable_grad():
                x = h[:, a:b].detach().requires_grad_()
                lp_c, H_c = token_logprobs(arch.logits(params, x), labels[:, a:b], self.temperature, entropy=need_H)
                outs, grads = [lp_c], [g_lp[:, a:b]]
                if need_H:
                    outs.append(H_c), grads.append(g_H[:, a:b])
                torch.autograd.backward(outs, grads)
            g[:, a:b] = x.grad
        return g, loss.detach().float()

    def reduce(self, dp) -> None:
        """Compute stream, after the last micro-batch: the metrics summed over ranks (one all-reduce, names sorted)."""
        if dp is None or not self.ctx.metrics:
            return
        names = sorted(self.ctx.metrics)
        t = torch.stack([self.ctx.metrics[n].float().reshape(()) for n in names])
        dp.sum_(t, "the loss hook's metrics all-reduce")
        self.ctx.metrics = dict(zip(names, t.unbind()))

    def metrics(self) -> dict[str, float]:
        """name -> the step's value of each metric the loss logged (Note: [Metrics are sums] in losses.py)."""
        if not self.ctx.metrics:
            return {}
        names = sorted(self.ctx.metrics)
        vals = torch.stack([self.ctx.metrics[n].float().reshape(()) for n in names]).tolist()  # host sync: step's end
        return dict(zip(names, vals))


def _grad(t: torch.Tensor) -> torch.Tensor:
    """``t.grad``, or zeros where the loss did not use ``t``."""
    return torch.zeros_like(t) if t.grad is None else t.grad
