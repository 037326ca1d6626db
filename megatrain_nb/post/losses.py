"""Post-training losses over per-token log-probs: SFT, DPO, GRPO (grpo / bnpo / dr_grpo / dapo) and KTO,
each a plain function ``fn(logp, batch, ctx) -> loss``.

Owns: the formulas, their published defaults, normalizations under which micro-batches add up
exactly, and the metrics each logs. Does not own: the model, the forward pass that makes ``logp``,
the reference model, rollouts and rewards, or the all-reduce (the caller passes a ``world`` hook).

The contract the engine keeps:

- ``logp``: ``(B, T)`` fp32 with ``logp[b, t] = log p(labels[b, t] | input_ids[b, :t])`` where
  ``labels[b, t] != -100`` and 0 elsewhere and at ``t = 0`` (HF's alignment: labels are the input
  ids; position t's label is predicted from the tokens before t). A loss reads its token mask from
  ``batch["labels"]`` (``labels != -100``, column 0 off), so ``ctx.tokens`` counts the same tokens.
- ``batch``: the micro-batch's tensors: ``labels`` ``(B, T)`` always, plus what each loss names
  (``ref_logps`` / ``ref_logp``, ``old_logp``, ``advantages``, ``desirable``, ``kl``, ``pair``).
- ``ctx``: a ``LossContext`` with the GLOBAL counts of the step: supervised tokens and rows over all
  micro-batches and data-parallel ranks (``LossContext.from_batches``). Every loss is a sum of
  per-token or per-row terms divided by a global count, so the step's loss is the SUM of what ``fn``
  returns over its micro-batches (and ranks: an engine that averages gradients across ranks instead
  of summing them multiplies by the world size). A DPO pair or GRPO group is never split across
  micro-batches; GRPO's per-row token mean needs only its row whole.

Note: [Metrics are sums] ``ctx.log(name, value)`` adds a detached 0-d tensor into ``ctx.metrics``
without a host sync; each loss logs its micro-batch's share of the global mean (a sum over its rows
or tokens divided by the global count), so after the last micro-batch (and a SUM across ranks) each
entry is the step's value. The engine reads them once per step (``.item()`` there is the host sync)
and starts the next step with a fresh context.

Note: [Entropy] a loss that wants the per-token entropy of the policy names a parameter ``entropy``:
``needs_entropy(fn)`` says so, and the engine then calls ``fn(logp, batch, ctx, entropy=H)`` with
``H`` ``(B, T)`` fp32, ``H[b, t]`` the entropy of the distribution that predicted ``labels[b, t]``
(0 where logp is 0). Computing it costs a pass over the vocabulary, so it is only done when asked.
"""
from __future__ import annotations

import inspect
from dataclasses import dataclass, field
from typing import Callable

import torch
import torch.nn.functional as F

from ..data.sft import IGNORE

LOSS_TYPES = ("grpo", "bnpo", "dr_grpo", "dapo")


@dataclass(kw_only=True)
class LossContext:
    """The global counts of one optimizer step, and the metrics its losses log.

    Example:
        >>> ctx = LossContext(tokens=10, sequences=4)
        >>> ctx.log("x", torch.tensor(1.5)); ctx.log("x", torch.tensor(0.5)); float(ctx.metrics["x"])
        2.0
    """

    tokens: int
    """Supervised tokens (``labels != -100`` after column 0) over every micro-batch and rank."""
    sequences: int
    """Rows over every micro-batch and rank (DPO: twice the pairs; GRPO: completions)."""
    max_completion_length: int | None = None
    """GRPO's ``loss_type="dr_grpo"`` divides by ``sequences * max_completion_length``: the
    generation limit, not the longest completion seen."""
    metrics: dict = field(default_factory=dict)
    """name -> 0-d tensor, summed over micro-batches (Note: [Metrics are sums])."""

    def __post_init__(self):
        for name in ("tokens", "sequences", "max_completion_length"):
            v = getattr(self, name)
            if (v is not None or name != "max_completion_length") and (type(v) is not int or v < 1):
                raise ValueError(f"LossContext.{name}={v!r}: must be an int >= 1 (a global count of the step; "
                                 "build the context with LossContext.from_batches)")

    @classmethod
    def from_batches(cls, batches: list[dict], *, world: Callable[[list[int]], list[int]] | None = None,
                     max_completion_length: int | None = None) -> "LossContext":
        """The context of a step of ``batches`` (this rank's micro-batches), counted over all ranks.

        Args:
            batches: dicts with ``labels`` ``(b, T)`` long (-100 = no loss).
            world: sums a list of ints across data-parallel ranks in one all-reduce; None for one
                process. With torch.distributed: ``def world(xs): t = torch.tensor(xs, device=dev);
                dist.all_reduce(t); return t.tolist()`` (a host sync, once per step).
            max_completion_length: for GRPO's ``dr_grpo``.
        Returns:
            LossContext: ``tokens`` = supervised tokens after column 0, ``sequences`` = rows.
        Raises:
            KeyError: a batch has no ``labels``.
            ValueError: no supervised token or no row in the whole step.
        Example:
            >>> lab = torch.tensor([[-100, 3, 4], [-100, -100, 5]])
            >>> LossContext.from_batches([{"labels": lab}, {"labels": lab[:1]}])
            LossContext(tokens=5, sequences=3, max_completion_length=None, metrics={})
        """
        tokens = sum(int((b["labels"][:, 1:] != IGNORE).sum()) for b in batches)  # host ints: labels live on the host
        rows = sum(int(b["labels"].shape[0]) for b in batches)
        if world is not None:
            tokens, rows = (int(x) for x in world([tokens, rows]))
        if tokens < 1 or rows < 1:
            raise ValueError(f"the step has {tokens} supervised token(s) in {rows} row(s): every label after "
                             "column 0 is -100, so no loss is defined; check the labels (-100 marks no loss)")
        return cls(tokens=tokens, sequences=rows, max_completion_length=max_completion_length)

    def log(self, name: str, value: torch.Tensor) -> None:
        """Add ``value`` (detached) into ``metrics[name]``; no host sync (Note: [Metrics are sums])."""
        value = value.detach()
        self.metrics[name] = self.metrics[name] + value if name in self.metrics else value


def needs_entropy(fn: Callable) -> bool:
    """Whether ``fn`` asks for the per-token entropy (Note: [Entropy] in this module's docstring).

    Args:
        fn: a loss function (a ``functools.partial`` too).
    Returns:
        bool: ``fn`` has a parameter named ``entropy``.
    Example:
        >>> needs_entropy(sft), needs_entropy(lambda logp, batch, ctx, entropy: logp.sum())
        (False, True)
    """
    try:
        return "entropy" in inspect.signature(fn).parameters
    except (TypeError, ValueError):  # a builtin without a signature
        return False


# ---- helpers ------------------------------------------------------------------------------
def _mask(logp: torch.Tensor, batch: dict) -> torch.Tensor:
    """(B, T) bool: where ``logp`` is defined (labels != -100, column 0 off)."""
    labels = batch.get("labels")
    if labels is None:
        raise KeyError("batch has no 'labels': the losses read their token mask from labels (-100 = no loss)")
    if labels.shape != logp.shape:
        raise ValueError(f"labels has shape {tuple(labels.shape)} but logp has {tuple(logp.shape)}; they must match")
    mask = labels != IGNORE
    mask[:, 0] = False  # nothing predicts the first token
    return mask


def _row_sums(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """(B,) sums of ``x`` over the masked tokens of each row."""
    return torch.where(mask, x, 0.0).sum(-1)


def _ref_sums(batch: dict, mask: torch.Tensor, where: str) -> torch.Tensor:
    """(B,) reference log-probs per row from ``ref_logps`` (B,) or per token ``ref_logp`` (B, T)."""
    for key, shape in (("ref_logps", mask.shape[:1]), ("ref_logp", mask.shape)):
        if key in batch:
            ref = batch[key].to(torch.float32)
            if ref.shape != shape:
                raise ValueError(f"{where}: batch[{key!r}] has shape {tuple(ref.shape)}; expected {tuple(shape)}")
            return ref if key == "ref_logps" else _row_sums(ref, mask)
    raise KeyError(f"{where}: batch needs the reference log-probs: 'ref_logps' (B,) per row or 'ref_logp' (B, T) "
                   "per token, computed by the frozen reference model on the same rows")


# ---- losses -------------------------------------------------------------------------------
def sft(logp: torch.Tensor, batch: dict, ctx: LossContext) -> torch.Tensor:
    """Token-mean cross-entropy: ``-sum(logp over supervised tokens) / ctx.tokens``.

    Summed over the step's micro-batches: the mean cross-entropy of ``Session.step`` today.

    Args:
        logp: ``(B, T)`` fp32, 0 where no label (the module's contract).
        batch: ``labels`` ``(B, T)``: the sum covers the tokens ``ctx.tokens`` counts.
        ctx: ``tokens`` = the step's supervised tokens.
    Returns:
        Tensor: 0-d, this micro-batch's share of the loss.
    Example:
        >>> logp = torch.tensor([[0.0, -1.0, -2.0]])
        >>> float(sft(logp, {"labels": torch.tensor([[-100, 5, 6]])}, LossContext(tokens=2, sequences=1)))
        1.5
    """
    return -_row_sums(logp, _mask(logp, batch)).sum() / ctx.tokens


def dpo(logp: torch.Tensor, batch: dict, ctx: LossContext, *, beta: float = 0.1,
        label_smoothing: float = 0.0) -> torch.Tensor:
    """Sigmoid DPO (Rafailov et al. 2023, "Direct Preference Optimization", eq. 7; TRL's
    ``DPOTrainer`` ``loss_type="sigmoid"``), with conservative DPO's ``label_smoothing``
    (Mitchell 2023, "A note on DPO with noisy preferences").

    Rows come in pairs: row ``2k`` is pair k's chosen completion, row ``2k + 1`` its rejected one
    (what ``preference_batches`` yields; ``batch["pair"]``, when present, names the pair of each
    row). With ``pc, pr`` the policy's and ``rc, rr`` the reference's summed completion log-probs
    and ``h = (pc - rc) - (pr - rr)``::

        loss = mean over pairs of  -(1 - ls) * logsigmoid(beta * h) - ls * logsigmoid(-beta * h)

    over the step's ``ctx.sequences / 2`` pairs. Logs (Note: [Metrics are sums]), named as TRL does:
    ``rewards/chosen`` (mean ``beta * (pc - rc)``), ``rewards/rejected``, ``rewards/margins``,
    ``rewards/accuracies`` (share of pairs ranked right), ``logps/chosen``, ``logps/rejected``.

    Where TRL differs: with ``label_smoothing=0`` (the default here and TRL's) this is TRL 1.16's
    ``"sigmoid"``. With ``label_smoothing > 0`` it is conservative DPO, which TRL's ``"sigmoid"``
    computed up to TRL 0.28; from 0.29 TRL's ``"sigmoid"`` ignores ``label_smoothing`` (only its
    ``"robust"``, ``"exo_pair"``, ``"aot"`` and ``"aot_unpaired"`` read it; ``"robust"`` is another
    formula). TRL averages pairs per micro-batch and then micro-batches; ours divides by the step's
    pairs: equal when every micro-batch has as many pairs. TRL's other loss types, ``ld_alpha``,
    WPO weighting and f-divergences are not here.

    Args:
        logp: ``(B, T)`` fp32, B even.
        batch: ``labels`` ``(B, T)``; ``ref_logps`` ``(B,)`` or ``ref_logp`` ``(B, T)``; optional
            ``pair`` ``(B,)``, checked (on the host only) to hold equal ids on rows 2k and 2k + 1.
        ctx: ``sequences`` = the step's rows (twice its pairs).
        beta: the KL strength (TRL's default 0.1).
        label_smoothing: the assumed chance a preference label is flipped, in [0, 0.5): 0 is
            DPO; above, conservative DPO (TRL <= 0.28's ``"sigmoid"``, not TRL 1.16's).
    Returns:
        Tensor: 0-d, this micro-batch's share of the loss.
    Raises:
        KeyError: no ``labels`` or no reference log-probs.
        ValueError: an odd number of rows, a ``pair`` id that differs within a pair, bad shapes.
    Example:
        >>> logp = torch.tensor([[0.0, -1.0], [0.0, -3.0]])  # one pair: chosen, rejected
        >>> batch = {"labels": torch.tensor([[-100, 1], [-100, 2]]), "ref_logps": torch.tensor([-2.0, -2.0])}
        >>> round(float(dpo(logp, batch, LossContext(tokens=2, sequences=2), beta=0.5)), 4)  # -logsigmoid(1)
        0.3133
    """
    B = logp.shape[0]
    if B % 2:
        raise ValueError(f"dpo: the micro-batch has {B} rows; rows come as (chosen, rejected) pairs, so it must be "
                         "even: split batches at pair boundaries (an even micro-batch size)")
    if ctx.sequences % 2 or not 0.0 <= label_smoothing < 0.5:
        raise ValueError(f"dpo: ctx.sequences={ctx.sequences} (rows: twice the pairs) must be even and "
                         f"label_smoothing={label_smoothing} in [0, 0.5)")
    mask, pair = _mask(logp, batch), batch.get("pair")
    on_host = pair is not None and pair.device.type == "cpu"  # on a device, checking would make the CPU wait
    if on_host and not torch.equal(pair[0::2], pair[1::2]):
        raise ValueError(f"dpo: batch['pair'] = {pair.tolist()} does not hold each pair on adjacent rows "
                         "(chosen at 2k, rejected at 2k + 1); build batches with preference_batches")
    policy, ref = _row_sums(logp, mask), _ref_sums(batch, mask, "dpo")  # (B,) each
    chosen, rejected = beta * (policy[0::2] - ref[0::2]), beta * (policy[1::2] - ref[1::2])  # (B/2,) implicit rewards
    h = chosen - rejected
    losses = -(1 - label_smoothing) * F.logsigmoid(h) - label_smoothing * F.logsigmoid(-h)
    pairs = ctx.sequences // 2
    for name, v in (("rewards/chosen", chosen), ("rewards/rejected", rejected), ("rewards/margins", h),
                    ("rewards/accuracies", h > 0), ("logps/chosen", policy[0::2]), ("logps/rejected", policy[1::2])):
        ctx.log(name, v.sum() / pairs)
    return losses.sum() / pairs


def group_advantages(rewards: torch.Tensor, group_size: int, scale: bool = True) -> torch.Tensor:
    """GRPO's group-relative advantages (Shao et al. 2024, "DeepSeekMath", sec. 4.1.2; TRL's
    ``GRPOTrainer``): ``A = (r - mean_group(r)) / (std_group(r) + 1e-4)``, the std unbiased
    (Bessel) as ``torch.std``; ``scale=False`` keeps ``r - mean`` (Dr. GRPO's advice).

    Args:
        rewards: ``(N,)`` float, ``group_size`` consecutive completions of each prompt.
        group_size: completions per prompt (TRL's ``num_generations``), >= 2 when scaling.
        scale: divide by the group's std.
    Returns:
        Tensor: ``(N,)`` advantages, ``batch["advantages"]`` for ``grpo``.
    Raises:
        ValueError: ``N`` not a multiple of ``group_size``, or ``group_size < 2`` with ``scale``.
    Example:
        >>> group_advantages(torch.tensor([1.0, 0.0, 2.0, 2.0]), 2)
        tensor([ 0.7070, -0.7070,  0.0000,  0.0000])
    """
    n = rewards.shape[0]
    if not isinstance(group_size, int) or group_size < 1 or n % group_size:
        raise ValueError(f"group_advantages: {n} rewards do not split into groups of group_size={group_size}; "
                         "pass group_size = completions per prompt, with every group whole")
    if scale and group_size < 2:
        raise ValueError("group_advantages: group_size=1 has no spread to scale by; pass scale=False or more "
                         "completions per prompt")
    r = rewards.to(torch.float32).view(-1, group_size)
    a = r - r.mean(1, keepdim=True)
    if scale:
        a = a / (r.std(1, keepdim=True) + 1e-4)
    return a.view(-1)


def grpo(logp: torch.Tensor, batch: dict, ctx: LossContext, *, epsilon: float = 0.2,
         epsilon_high: float | None = None, beta: float = 0.0, loss_type: str = "grpo",
         kl_ratio_weighted: bool = True) -> torch.Tensor:
    """GRPO's clipped surrogate with an optional k3 KL (Shao et al. 2024, "DeepSeekMath", eq. 3),
    its normalizations as TRL's ``GRPOTrainer._compute_loss`` defines them, over the global counts.

    Per completion token, with ``ratio = exp(logp - old_logp)`` and ``A`` the row's advantage::

        l = -min(ratio * A, clamp(ratio, 1 - epsilon, 1 + epsilon_high) * A)
            + beta * w * (exp(ref - logp) - (ref - logp) - 1)             # k3 KL (Schulman)

    with ``w = ratio`` when ``kl_ratio_weighted`` (the default), else 1, reduced by ``loss_type``:

    - ``"grpo"``: each row's token mean (its token count at least 1), then the mean over
      ``ctx.sequences`` rows (the paper's; biased toward short completions, Liu et al. 2025);
    - ``"bnpo"``: ``sum(l) / ctx.tokens``, the same as ``"dapo"`` here (see "Where TRL differs");
    - ``"dr_grpo"``: ``sum(l) / (ctx.sequences * ctx.max_completion_length)`` (Liu et al. 2025);
    - ``"dapo"``: ``sum(l) / ctx.tokens``, the active tokens of the whole global batch (Yu et al.
      2025, "DAPO"; TRL's ``num_items_in_batch``), usually with ``epsilon_high=0.28``.

    The KL weight ``w``: the ratio carries gradient, so weighting changes the KL's gradient even
    on-policy, where its value is 1: there ``grad(ratio * k3) = grad(k3) + k3 * grad(logp)``. Over
    tokens sampled from the old policy, ``grad(ratio * k3)`` is an unbiased estimate of the reverse
    KL's gradient ``grad KL(policy || ref)``; ``grad(k3)`` alone is not (DeepSeek-AI 2025,
    "DeepSeek-V3.2", arXiv 2512.02556). TRL 1.16 weights it by default
    (``GRPOConfig.use_bias_correction_kl=True``), and so do we, for that reason; ``False`` is the
    DeepSeekMath paper's unweighted k3 (and TRL's before that option existed).

    Logs (Note: [Metrics are sums]), token means: ``clip_ratio/low_mean`` (ratio below 1 - eps with
    A < 0), ``clip_ratio/high_mean`` (above 1 + eps_high with A > 0), ``clip_ratio/region_mean``
    (either), and ``kl`` when ``beta != 0``: the KL term as it enters the loss (``w * k3``), as TRL
    logs it.

    Where TRL differs (``GRPOTrainer._compute_loss``, TRL 1.16): its ``"bnpo"`` divides each
    micro-batch by that micro-batch's tokens and averages micro-batches, so it equals ours only when
    every micro-batch has as many tokens; ours divides by the step's tokens, which is TRL's
    ``"dapo"``. Its ``"grpo"`` and ``"dr_grpo"`` average micro-batches where ours divide by the
    step's rows: equal when every micro-batch has as many rows. Its default ``loss_type`` is
    ``"dapo"``, ours ``"grpo"``. Not here: its other loss types (cispo, sapo, luspo, vespo),
    sequence-level ratios, ``delta``, entropy masking and bonus, vLLM importance sampling.

    Args:
        logp: ``(B, T)`` fp32, requiring grad.
        batch: ``labels`` ``(B, T)`` (-100 on prompts and padding); ``advantages`` ``(B,)`` (or
            ``(B, T)``), e.g. ``group_advantages``; ``old_logp`` ``(B, T)`` from the policy that
            sampled (default ``logp.detach()``: on-policy, one update per batch); ``ref_logp``
            ``(B, T)`` of the reference model, needed when ``beta != 0``.
        ctx: ``tokens``, ``sequences``, and ``max_completion_length`` for ``dr_grpo``.
        epsilon, epsilon_high: the clip range ``(1 - epsilon, 1 + epsilon_high)``; ``epsilon_high``
            defaults to ``epsilon``.
        beta: the KL coefficient (TRL's default 0.0: no reference model needed).
        loss_type: ``"grpo"``, ``"bnpo"``, ``"dr_grpo"`` or ``"dapo"``.
        kl_ratio_weighted: weight the k3 KL by the probability ratio (TRL's
            ``use_bias_correction_kl``, default True there and here); no effect when ``beta == 0``.
    Returns:
        Tensor: 0-d, this micro-batch's share of the loss.
    Raises:
        KeyError: no ``labels`` / ``advantages``, or no ``ref_logp`` with ``beta != 0``.
        ValueError: an unknown ``loss_type``, ``dr_grpo`` without ``max_completion_length``, shapes.
    Example:
        >>> logp = torch.tensor([[0.0, -1.0, -1.0]])
        >>> batch = {"labels": torch.tensor([[-100, 4, 5]]), "advantages": torch.tensor([0.5])}
        >>> float(grpo(logp, batch, LossContext(tokens=2, sequences=1)))  # on-policy: -A
        -0.5
    """
    if loss_type not in LOSS_TYPES:
        raise ValueError(f"grpo: loss_type={loss_type!r}: one of {', '.join(map(repr, LOSS_TYPES))}")
    if loss_type == "dr_grpo" and ctx.max_completion_length is None:
        raise ValueError("grpo: loss_type='dr_grpo' divides by the generation limit: set "
                         "LossContext.max_completion_length (from_batches(..., max_completion_length=...))")
    eps_high, mask = epsilon if epsilon_high is None else epsilon_high, _mask(logp, batch)
    if "advantages" not in batch:
        raise KeyError("grpo: batch has no 'advantages' (B,): one per completion, e.g. group_advantages(rewards, G)")
    adv = batch["advantages"].to(torch.float32)
    if adv.shape not in (logp.shape[:1], logp.shape):
        raise ValueError(f"grpo: batch['advantages'] has shape {tuple(adv.shape)}; expected ({logp.shape[0]},) "
                         f"or {tuple(logp.shape)}")
    adv, old = adv.unsqueeze(1) if adv.dim() == 1 else adv, batch.get("old_logp")
    old = logp.detach() if old is None else old.to(torch.float32)
    ratio = torch.exp(torch.where(mask, logp - old, 0.0))  # where first: padding's old / ref may be -inf
    per_token = -torch.min(ratio * adv, torch.clamp(ratio, 1 - epsilon, 1 + eps_high) * adv)
    if beta != 0.0:
        if "ref_logp" not in batch:
            raise KeyError(f"grpo: beta={beta} needs batch['ref_logp'] (B, T) from the reference model, or beta=0.0")
        d = torch.where(mask, batch["ref_logp"].to(torch.float32) - logp, 0.0)
        kl = torch.exp(d) - d - 1
        if kl_ratio_weighted:
            kl = kl * ratio  # ratio is 1 on-policy but not its gradient (docstring)
        per_token = per_token + beta * kl
        ctx.log("kl", _row_sums(kl, mask).sum() / ctx.tokens)
    low, high = (ratio < 1 - epsilon) & (adv < 0) & mask, (ratio > 1 + eps_high) & (adv > 0) & mask
    for name, v in (("low_mean", low), ("high_mean", high), ("region_mean", low | high)):
        ctx.log(f"clip_ratio/{name}", v.sum() / ctx.tokens)
    rows = _row_sums(per_token, mask)  # (B,)
    if loss_type == "grpo":
        return (rows / mask.sum(-1).clamp(min=1)).sum() / ctx.sequences
    if loss_type == "dr_grpo":
        return rows.sum() / (ctx.sequences * ctx.max_completion_length)
    return rows.sum() / ctx.tokens  # bnpo, dapo


def kto(logp: torch.Tensor, batch: dict, ctx: LossContext, *, beta: float = 0.1, desirable_weight: float = 1.0,
        undesirable_weight: float = 1.0) -> torch.Tensor:
    """KTO (Ethayarajh et al. 2024, "KTO: Model Alignment as Prospect Theoretic Optimization", eq. 8;
    TRL's ``KTOTrainer.kto_loss``) on unpaired completions labelled desirable or not.

    With ``r = logp_policy(y|x) - logp_ref(y|x)`` per row (summed over the completion) and ``z`` the
    reference point, ``z = max(0, batch["kl"])`` detached::

        desirable:    desirable_weight   * (1 - sigmoid(beta * (r - z)))
        undesirable:  undesirable_weight * (1 - sigmoid(beta * (z - r)))

    averaged over the step's ``ctx.sequences`` rows. ``batch["kl"]`` is the batch's KL estimate, as
    TRL forms it: the mean over the step (all ranks) of ``logp_policy - logp_ref`` on MISMATCHED
    pairs (each prompt with another row's completion), computed without gradient before the step;
    pass the same value with every micro-batch. Logs sums and counts (Note: [Metrics are sums]):
    ``rewards/chosen_sum``, ``rewards/rejected_sum`` (``beta * r``), ``count/chosen``, ``count/rejected``,
    ``kl`` (the clamped ``z``).

    Where TRL differs (``KTOTrainer._compute_loss``, TRL 1.16): TRL forms ``z`` per micro-batch, the
    mean of its own mismatched rows' ``logp_policy - logp_ref`` (averaged over ranks) clamped at 0,
    so each micro-batch of a step has its own reference point; ours is the one ``batch["kl"]`` the
    caller passes, meant as the step's mean, so the same for every micro-batch. The two agree when
    the step is one micro-batch (and ranks hold as many rows). TRL builds the mismatched pairs by
    shifting completions one row within the dataset; here the caller builds them. TRL averages rows
    per micro-batch and then micro-batches; ours divides by the step's rows: equal when every
    micro-batch has as many rows. TRL's ``"apo_zero_unpaired"`` is not here.

    Args:
        logp: ``(B, T)`` fp32.
        batch: ``labels`` ``(B, T)``; ``desirable`` ``(B,)`` bool; ``ref_logps`` ``(B,)`` or
            ``ref_logp`` ``(B, T)``; ``kl``: a float or 0-d tensor.
        ctx: ``sequences`` = the step's rows.
        beta: TRL's default 0.1.
        desirable_weight, undesirable_weight: TRL's 1.0; the paper keeps
            ``desirable_weight * n_desirable / (undesirable_weight * n_undesirable)`` in [1, 4/3].
    Returns:
        Tensor: 0-d, this micro-batch's share of the loss.
    Raises:
        KeyError / ValueError: a missing field (``labels``, ``desirable``, ``kl``, reference), a shape.
    Example:
        >>> logp = torch.tensor([[0.0, -1.0], [0.0, -1.0]])
        >>> batch = {"labels": torch.tensor([[-100, 1], [-100, 2]]), "ref_logps": torch.tensor([-1.0, -1.0]),
        ...          "desirable": torch.tensor([True, False]), "kl": 0.0}
        >>> float(kto(logp, batch, LossContext(tokens=2, sequences=2)))  # r = z = 0: 1 - sigmoid(0)
        0.5
    """
    mask = _mask(logp, batch)
    if "desirable" not in batch or "kl" not in batch:
        raise KeyError(f"kto: batch has keys {sorted(batch)}; it needs 'desirable' (B,) bool, one label per row, "
                       "and 'kl', the step's KL estimate from mismatched pairs (a float)")
    good = batch["desirable"].to(torch.bool)
    if good.shape != logp.shape[:1]:
        raise ValueError(f"kto: batch['desirable'] has shape {tuple(good.shape)}; expected ({logp.shape[0]},)")
    z = torch.as_tensor(batch["kl"], dtype=torch.float32, device=logp.device).detach().clamp(min=0)
    r = _row_sums(logp, mask) - _ref_sums(batch, mask, "kto")  # (B,)
    losses = torch.where(good, desirable_weight * (1 - torch.sigmoid(beta * (r - z))),
                         undesirable_weight * (1 - torch.sigmoid(beta * (z - r))))
    reward = beta * r.detach()
    for name, v in (("rewards/chosen_sum", torch.where(good, reward, 0.0).sum()), ("count/chosen", good.sum()),
                    ("rewards/rejected_sum", torch.where(good, 0.0, reward).sum()), ("count/rejected", (~good).sum()),
                    ("kl", z * logp.shape[0] / ctx.sequences)):
        ctx.log(name, v)
    return losses.sum() / ctx.sequences
