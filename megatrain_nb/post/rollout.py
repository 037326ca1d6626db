"""Rollouts for RL post-training: what a batch of sampled completions trains on, and the GRPO loop.

Owns: ``Rollouts`` (a batch of sampled completions, left-padded, and the training rows it gives) and
``train_grpo``: rollouts (``Session.generate``) -> rewards -> group advantages -> (reference log-probs)
-> one ``Session.step`` with ``losses.grpo``, per step; each step's row goes to the caller's ``on_step``.
Bound as ``Session.train_grpo`` (through ``training.train_grpo``, which draws the dashboard).
Does not own: the sampling (``step/decode.py``, which returns ``Rollouts``), the forward / loss / update
(``Session.step``, ``Session.logprobs``), the loss formulas (``losses.py``), the reference model
(``reference.py``), rewards (the caller's ``reward_fn``), the progress bar's dashboard (``training.py``).
Imports nothing above ``post/``: it reaches the session through the object it is given.

Note: [Rollout alignment] a batch of rollouts is ``sequences`` (N, P + G): each prompt left-padded
to the longest, P columns, then G generated columns; a row that ended at EOS holds padding after
it. ``Rollouts.batch()`` gives the training rows: ``labels`` = the sequences with the prompt and
the padding after EOS masked to -100, ``position_ids`` counting from each row's first real token
(as ``model.generate`` does for left padding: padding positions hold 1), and ``old_logp`` (N, T)
with ``old_logp[b, t] = log p(sequences[b, t] | sequences[b, :t])`` at the sampling temperature,
0 where the label is -100: the module contract of ``losses.py``.
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Callable

import torch


@dataclasses.dataclass(kw_only=True)
class Rollouts:
    """A batch of sampled completions (Note: [Rollout alignment]).

    Example:
        >>> r = s.generate(prompts, max_new_tokens=8, do_sample=True, num_return_sequences=4,  # doctest: +SKIP
        ...                return_logprobs=True)
        >>> s.step(r.batch(advantages=adv), loss=grpo, group_size=4)                           # doctest: +SKIP
    """

    sequences: torch.Tensor
    """(N, P + G) long: left-padded prompt, then the completion (padding after EOS)."""
    attention_mask: torch.Tensor
    """(N, P + G) long: 1 on the prompt's tokens and the completion's (through its EOS)."""
    prompt_lengths: torch.Tensor
    """(N,) long: real prompt tokens per row (P - its left padding)."""
    completion_mask: torch.Tensor
    """(N, P + G) bool: the generated tokens, through EOS; False on the prompt and after EOS."""
    prompt_index: torch.Tensor
    """(N,) long: which prompt each row continues; rows of one prompt are consecutive."""
    logprobs: torch.Tensor | None = None
    """(N, P + G) fp32: log-prob of each generated token at the sampling temperature, 0 elsewhere."""
    texts: list[str] | None = None
    """The decoded completions (special tokens skipped), when a tokenizer was given."""

    prompt_width: int
    """P: the columns of the padded prompt block; the completion starts at column P."""

    @property
    def completion_lengths(self) -> torch.Tensor:
        """(N,) long: generated tokens per row, EOS included."""
        return self.completion_mask.sum(1)

    def completions(self) -> list[list[int]]:
        """The generated ids of each row (through EOS)."""
        return [row[m].tolist() for row, m in zip(self.sequences, self.completion_mask)]

    def position_ids(self) -> torch.Tensor:
        """(N, P + G) long: positions from each row's first real token; 1 on padding (``model.generate``'s rule)."""
        return position_ids(self.attention_mask)

    def batch(self, **extra) -> dict:
        """The training rows of these rollouts (Note: [Rollout alignment]).

        Args:
            **extra: more fields to carry (``advantages`` (N,), ``ref_logp`` (N, T), ...).
        Returns:
            {"input_ids", "attention_mask", "position_ids", "labels"} (N, T), "old_logp" (N, T) fp32
            when the log-probs were returned, and ``extra``.
        """
        out = {"input_ids": self.sequences, "attention_mask": self.attention_mask, "position_ids": self.position_ids(),
               "labels": self.sequences.masked_fill(~self.completion_mask, -100)}
        if self.logprobs is not None:
            out["old_logp"] = self.logprobs
        return {**out, **extra}


def position_ids(mask: torch.Tensor) -> torch.Tensor:
    """(N, T) long positions of a left-padded batch: 0 at each row's first real token, 1 on padding."""
    return (mask.cumsum(1) - 1).masked_fill(mask == 0, 1)


# ---- GRPO -------------------------------------------------------------------------------------
def train_grpo(session, prompts: list, reward_fn, *, steps: int, group_size: int = 4, prompts_per_step: int = 2,
               max_new_tokens: int = 16, temperature: float = 1.0, top_p: float = 1.0, epsilon: float = 0.2,
               epsilon_high: float | None = None, beta: float = 0.0, loss_type: str = "grpo", scale_rewards: bool = True,
               tokenizer=None, cache_weights: bool | None = None, seed: int = 0, progress=True,
               on_step: Callable[[dict], None] | None = None, kl_ratio_weighted: bool = True):
    """GRPO, on-policy: per step, roll out, score, and take one ``losses.grpo`` step (see ``Session.train_grpo``).

    Each step's reward mean goes into its ``StepResult.metrics["reward_mean"]`` (so into
    ``Session.history_dataframe`` and the dashboard's history figure, next to the hook's kl and
    clip_ratio); the bar shows reward, KL and clip fraction. ``on_step(row)``, when given, is called
    after each step with that step's row of the returned DataFrame (``training.train_grpo`` draws the
    dashboard there). ``progress``: True / False for a tqdm bar or none, or a tqdm-like bar to update
    (``training.train_grpo`` passes the one under the dashboard's header); it is closed at the end.
    """
    import pandas as pd
    from tqdm.auto import tqdm

    from . import losses

    if not isinstance(steps, int) or isinstance(steps, bool) or steps < 1:
        raise ValueError(f"steps={steps!r}: must be an int >= 1")
    if not isinstance(prompts, (list, tuple)) or not prompts:
        raise ValueError("prompts must be a non-empty list of prompts (strings, chats or LongTensors of ids)")
    if not isinstance(prompts_per_step, int) or not 1 <= prompts_per_step <= len(prompts):
        raise ValueError(f"prompts_per_step={prompts_per_step!r}: an int in [1, {len(prompts)}] (the prompts given)")
    if beta != 0 and session.reference is None:
        raise ValueError(f"beta={beta} needs a reference model: Session.from_pretrained has one; after from_config "
                         "call s.freeze_reference() first, or pass beta=0.0")
    loss = functools.partial(losses.grpo, epsilon=epsilon, epsilon_high=epsilon_high, beta=beta, loss_type=loss_type,
                             kl_ratio_weighted=kl_ratio_weighted)
    g = torch.Generator().manual_seed(seed)
    order: list[int] = []
    rows = []
    bar = progress if not isinstance(progress, bool) else tqdm(total=steps, desc="grpo", unit="step",
                                                                dynamic_ncols=True, disable=not progress)
    try:
        for k in range(steps):
            if len(order) < prompts_per_step:  # a fresh permutation of the prompts each epoch
                order += torch.randperm(len(prompts), generator=g).tolist()
            picked = [prompts[i] for i in order[:prompts_per_step]]
            del order[:prompts_per_step]
            r = session.generate(picked, max_new_tokens=max_new_tokens, do_sample=True, temperature=temperature,
                                 top_p=top_p, num_return_sequences=group_size, return_logprobs=temperature == 1.0,
                                 tokenizer=tokenizer, cache_weights=cache_weights, seed=seed * 1_000_003 + k)
            completions = r.texts if r.texts is not None else r.completions()
            rewards = torch.tensor([float(x) for x in reward_fn([picked[i] for i in r.prompt_index.tolist()],
                                                                completions)], dtype=torch.float32)
            if rewards.shape != (len(completions),):
                raise ValueError(f"reward_fn returned {rewards.numel()} rewards for {len(completions)} completions")
            batch = r.batch(advantages=losses.group_advantages(rewards, group_size, scale=scale_rewards),
                            max_completion_length=max_new_tokens)  # dr_grpo's constant normaliser (ctx)
            if beta != 0:
                batch["ref_logp"] = session.logprobs(batch, ref=True)
            res = session.step(batch, loss=loss, group_size=group_size)
            m = {name: float(v) for name, v in (getattr(res, "metrics", None) or {}).items()}
            # res is the row session.history holds: its metrics are the history's metric columns
            res.metrics = {"reward_mean": float(rewards.mean()), **(res.metrics or {})}
            rows.append({"step": res.step, "reward_mean": float(rewards.mean()), "reward_std": float(rewards.std()),
                         "loss": res.loss, "kl": m.get("kl", float("nan") if beta else 0.0),
                         "clip_ratio": m.get("clip_ratio/region_mean", float("nan")),
                         "completion_len": float(r.completion_lengths.float().mean()), "seconds": res.seconds})
            bar.update(1)
            bar.set_postfix(reward=f"{rows[-1]['reward_mean']:.3f}", kl=f"{rows[-1]['kl']:.4f}",
                            clip=f"{rows[-1]['clip_ratio']:.3f}")
            if on_step is not None:
                on_step(rows[-1])
    finally:
        bar.close()
    return pd.DataFrame(rows)
