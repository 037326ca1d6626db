"""Per-token log-probs and entropies from one chunk of logits: the math the loss hook and ``Session.logprobs`` share.

Owns: ``token_logprobs`` (a chunk's logits -> the log-prob of each label and the entropy of each predictive
distribution, in fp32, 0 where no label) and the shift between the engine's alignment (position t predicts
the label at t + 1) and HF's (``logp[b, t]`` is the log-prob of ``labels[b, t]``, column 0 empty).
Does not own: making the logits (the head's chunks, ``step/head.py``, ``inference.py``), the losses
(``losses.py``).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

IGNORE = -100


def token_logprobs(logits: torch.Tensor, labels: torch.Tensor, temperature: float = 1.0, *,
                   entropy: bool = True) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-prob of each label and entropy of each predictive distribution, for one chunk of positions.

    Args:
        logits: ``(b, c, V)`` any float dtype: position ``t``'s scores for the next token.
        labels: ``(b, c)`` long: the token each position predicts (the shifted labels), -100 = none.
        temperature: the logits are divided by it first (> 0).
        entropy: compute the entropy too (a second pass over the vocabulary).
    Returns:
        ``(logp, H)``: ``(b, c)`` fp32 each, 0 where the label is -100; ``H`` None without ``entropy``.
        Differentiable: in a grad context both carry the graph back to ``logits``.
    Example:
        >>> lp, H = token_logprobs(torch.zeros(1, 2, 4), torch.tensor([[3, -100]]))
        >>> lp, H  # uniform over 4 words: log(1/4), entropy log(4)
        (tensor([[-1.3863,  0.0000]]), tensor([[1.3863, 0.0000]]))
    """
    z = logits.float()
    if temperature != 1.0:
        z = z / temperature
    lsm = torch.log_softmax(z, dim=-1)  # (b, c, V) fp32
    ok = labels != IGNORE
    logp = torch.where(ok, lsm.gather(-1, labels.clamp(min=0).unsqueeze(-1)).squeeze(-1), 0.0)
    H = torch.where(ok, -(lsm.exp() * lsm).sum(-1), 0.0) if entropy else None
    return logp, H


def to_hf(shifted: torch.Tensor) -> torch.Tensor:
    """(B, T) values at the engine's positions (t predicts t + 1) -> HF's columns (column t: label t; column 0: 0)."""
    return F.pad(shifted[:, :-1], (1, 0))


def from_hf(cols: torch.Tensor) -> torch.Tensor:
    """The inverse of ``to_hf`` for gradients: HF's column t + 1 -> engine position t (the last position: 0)."""
    return F.pad(cols[:, 1:], (0, 1))
