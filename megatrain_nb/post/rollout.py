"""Rollouts for RL post-training: batched sampling from the weights being trained, and the GRPO loop.

Owns: turning many prompts into one left-padded batch (attention mask, position ids), sampling each
``num_return_sequences`` times with a KV cache per batch and a per-row stop at EOS, the sampling
log-probs aligned as the training side's ``logp`` (``Rollouts``), and ``train_grpo``: rollouts ->
rewards -> group advantages -> (reference log-probs) -> one ``Session.step`` with ``losses.grpo``.
Bound as ``Session.generate`` (a list of prompts, ``num_return_sequences`` or ``return_logprobs``)
and ``Session.train_grpo``.
Does not own: the single-prompt generation (``inference.generate``), the forward / loss / update
(``Session.step``, ``Session.logprobs``), the loss formulas (``losses.py``), the reference model
(``reference.py``), rewards (the caller's ``reward_fn``).

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
import time
import inspect

import torch

from ..model.binding import call


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


def is_batch(prompt) -> bool:
    """Whether ``prompt`` is several prompts: a list of strings, chats or id tensors (a chat is one prompt)."""
    return isinstance(prompt, (list, tuple)) and not (len(prompt) and all(isinstance(m, dict) for m in prompt))


def _prompt_rows(prompts, tok, V: int) -> tuple[list[list[int]], bool]:
    """Each prompt's ids, and whether they were text (strings or chats)."""
    from ..data.sft import prompt_ids

    if isinstance(prompts, torch.Tensor):
        prompts = [prompts] if prompts.dim() == 1 else list(prompts)
    elif not is_batch(prompts):
        prompts = [prompts]
    if not len(prompts):
        raise ValueError("prompts is empty: pass a list of strings, chats or LongTensors of ids")
    rows, text = [], None
    for k, p in enumerate(prompts):
        this = not isinstance(p, torch.Tensor)
        if text is not None and this != text:
            raise ValueError(f"prompt {k} is {type(p).__name__} but prompt 0 is not: pass all text/chats or all ids")
        text = this
        if this:
            if tok is None:
                raise ValueError("text or chat prompts need tokenizer= (a model directory or a loaded HF tokenizer); "
                                 "or pass token ids as LongTensors")
            ids = prompt_ids(tok, p)
        else:
            if p.dtype != torch.long or p.numel() == 0 or p.dim() > 2 or (p.dim() == 2 and p.shape[0] != 1):
                raise ValueError(f"prompt {k}: ids of shape {tuple(p.shape)}, dtype {p.dtype}; pass a non-empty "
                                 "LongTensor (T,) or (1, T) per prompt")
            ids = p.view(-1).tolist()
        if min(ids) < 0 or max(ids) >= V:
            raise ValueError(f"prompt {k} holds token ids outside the vocabulary [0, {V}); check the tokenizer")
        rows.append(ids)
    return rows, text


def generate_batch(session, prompts, *, max_new_tokens: int, do_sample: bool = False, temperature: float = 1.0,
                   top_p: float = 1.0, num_return_sequences: int = 1, return_logprobs: bool = False,
                   tokenizer=None, cache_weights: bool | None = None, seed: int = 0) -> Rollouts:
    """Sample ``num_return_sequences`` completions of each prompt in one batch (see ``Session.generate``)."""
    from ..data.sft import load_tokenizer
    from ..inference import _eos_ids, _fits, _picker, _run

    if not isinstance(max_new_tokens, int) or isinstance(max_new_tokens, bool) or max_new_tokens < 1:
        raise ValueError(f"max_new_tokens={max_new_tokens!r}: must be an int >= 1")
    if not isinstance(num_return_sequences, int) or isinstance(num_return_sequences, bool) or num_return_sequences < 1:
        raise ValueError(f"num_return_sequences={num_return_sequences!r}: must be an int >= 1")
    if not (temperature > 0 and 0 < top_p <= 1):
        raise ValueError(f"temperature={temperature!r}, top_p={top_p!r}: need temperature > 0 and 0 < top_p <= 1")
    tok = load_tokenizer(tokenizer) if tokenizer is not None else None
    rows, _ = _prompt_rows(prompts, tok, session.arch.embed.weight.shape[0])
    index = torch.arange(len(rows)).repeat_interleave(num_return_sequences)
    rows = [rows[i] for i in index.tolist()]
    pad = _pad_id(session.config, tok)
    P = max(map(len, rows))
    ids = torch.full((len(rows), P), pad, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for b, r in enumerate(rows):  # left padding: every row's next token is in the last column
        ids[b, P - len(r):], mask[b, P - len(r):] = torch.tensor(r), 1
    eos = _eos_ids(session.config, tok)
    pick = _picker(do_sample, temperature, top_p, seed)
    if cache_weights is None:
        cache_weights = _fits(session.engine)
    new, lps = _run(session, lambda: _decode_batch(session.engine, ids, mask, max_new_tokens, pick, eos, pad,
                                                   cache_weights, temperature if return_logprobs else None))
    G = new.shape[1]
    gen = torch.zeros(len(rows), G, dtype=torch.bool)  # through EOS, none after it
    ended = torch.zeros(len(rows), dtype=torch.bool)
    for t in range(G):
        gen[:, t] = ~ended
        ended |= torch.isin(new[:, t], torch.tensor(sorted(eos), dtype=torch.long))
    completion = torch.cat([torch.zeros_like(mask, dtype=torch.bool), gen], 1)
    out = Rollouts(sequences=torch.cat([ids, new], 1), attention_mask=torch.cat([mask, gen.long()], 1),
                   prompt_lengths=mask.sum(1), completion_mask=completion, prompt_index=index, prompt_width=P,
                   logprobs=None if lps is None else torch.cat([torch.zeros(len(rows), P), lps * gen], 1))
    if tok is not None:
        out.texts = [tok.decode(c, skip_special_tokens=True) for c in out.completions()]
    return out


def _pad_id(config, tok) -> int:
    """The padding id: the config's, the tokenizer's, else its eos, else 0 (padding is masked: any id works)."""
    for v in (getattr(config, "pad_token_id", None), getattr(tok, "pad_token_id", None),
              getattr(config, "eos_token_id", None)):
        v = v[0] if isinstance(v, (list, tuple)) and v else v
        if isinstance(v, int) and v >= 0:
            return v
    return 0


def _decode_batch(engine, ids: torch.Tensor, mask: torch.Tensor, max_new: int, pick, eos: set[int], pad: int,
                  cache_weights: bool, temperature: float | None):
    """Driver: prefill ``ids`` (N, P) left-padded, then one token per row at a time with one KV cache.

    Returns (new ids (N, G) long, with ``pad`` after a row's EOS; their log-probs (N, G) fp32 at
    ``temperature``, or None when it is None). Stops when every row has ended or after ``max_new``.
    """
    from ..inference import _layer_cache

    arch, dev = engine.arch, engine.dev.device
    H = arch.embed.weight.shape[1]
    cache = _layer_cache(arch.config)
    cache_arg = "cache" if "cache" in inspect.signature(arch.base.forward).parameters else "past_key_values"
    head = engine.weights_copy(engine.L)
    layers = [engine.weights_copy(i) for i in range(engine.L)] if cache_weights else None  # dropped on return
    eos_t = torch.tensor(sorted(eos), dtype=torch.long)
    N = ids.shape[0]
    x, pos, am = ids, position_ids(mask), mask
    done = torch.zeros(N, dtype=torch.bool)
    new, lps = [], []
    for _ in range(max_new):
        E, box = engine._gather({"input_ids": x})
        engine._ready(box)
        h, calls = arch.prelude(arch.embed_rows(E.view(-1, H), tuple(x.shape)), am.to(dev),
                                position_ids=pos.to(dev), **{cache_arg: cache, "use_cache": True})
        for unit, params in (enumerate(layers) if cache_weights else engine.stream_layers(head=False)):
            cache.layer = unit
            h = call(engine._template(unit), params, h, *calls[unit][0], **calls[unit][1])
        logits = arch.logits(head, h[:, -1:]).float()[:, -1]  # (N, V)
        token = torch.where(done, pad, pick(logits))  # (N,) on the host: a sync, the next input depends on it
        if temperature is not None:
            lp = torch.log_softmax(logits / temperature, -1).gather(1, token.to(dev).view(-1, 1)).view(-1)
            lps.append(torch.where(done, 0.0, lp.cpu()))
        new.append(token)
        done |= torch.isin(token, eos_t)
        if bool(done.all()):
            break
        x, pos = token.view(-1, 1), pos[:, -1:] + 1
        am = torch.cat([am, torch.ones(N, 1, dtype=am.dtype)], 1)
    return torch.stack(new, 1), (torch.stack(lps, 1) if temperature is not None else None)


# ---- GRPO -------------------------------------------------------------------------------------
def train_grpo(session, prompts: list, reward_fn, *, steps: int, group_size: int = 4, prompts_per_step: int = 2,
               max_new_tokens: int = 16, temperature: float = 1.0, top_p: float = 1.0, epsilon: float = 0.2,
               epsilon_high: float | None = None, beta: float = 0.0, loss_type: str = "grpo", scale_rewards: bool = True,
               tokenizer=None, cache_weights: bool | None = None, seed: int = 0, progress: bool = True,
               dashboard: bool | None = None, refresh_s: float = 1.0, kl_ratio_weighted: bool = True):
    """GRPO, on-policy: per step, roll out, score, and take one ``losses.grpo`` step (see ``Session.train_grpo``).

    Each step's reward mean goes into its ``StepResult.metrics["reward_mean"]`` (so into
    ``Session.history_dataframe`` and the dashboard's history figure, next to the hook's kl and
    clip_ratio); the bar shows reward, KL and clip fraction; the dashboard opens and refreshes as
    ``training.train``'s does.
    """
    import pandas as pd
    from tqdm.auto import tqdm

    from ..training import draw_dashboard, open_dashboard
    from . import losses

    if not isinstance(steps, int) or isinstance(steps, bool) or steps < 1:
        raise ValueError(f"steps={steps!r}: must be an int >= 1")
    if not isinstance(prompts, (list, tuple)) or not prompts:
        raise ValueError("prompts must be a non-empty list of prompts (strings, chats or LongTensors of ids)")
    if not isinstance(prompts_per_step, int) or not 1 <= prompts_per_step <= len(prompts):
        raise ValueError(f"prompts_per_step={prompts_per_step!r}: an int in [1, {len(prompts)}] (the prompts given)")
    if not refresh_s >= 0:
        raise ValueError(f"refresh_s={refresh_s!r}: must be >= 0 seconds")
    if beta != 0 and session.reference is None:
        raise ValueError(f"beta={beta} needs a reference model: Session.from_pretrained has one; after from_config "
                         "call s.freeze_reference() first, or pass beta=0.0")
    loss = functools.partial(losses.grpo, epsilon=epsilon, epsilon_high=epsilon_high, beta=beta, loss_type=loss_type,
                             kl_ratio_weighted=kl_ratio_weighted)
    g = torch.Generator().manual_seed(seed)
    order: list[int] = []
    rows = []
    dash = open_dashboard(session, dashboard)
    last_draw = time.monotonic()
    bar = tqdm(total=steps, desc="grpo", unit="step", dynamic_ncols=True, disable=not progress)
    try:
        for k in range(steps):
            if len(order) < prompts_per_step:  # a fresh permutation of the prompts each epoch
                order += torch.randperm(len(prompts), generator=g).tolist()
            picked = [prompts[i] for i in order[:prompts_per_step]]
            del order[:prompts_per_step]
            r = generate_batch(session, picked, max_new_tokens=max_new_tokens, do_sample=True, temperature=temperature,
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
            if dash is not None and time.monotonic() - last_draw >= refresh_s:
                dash = draw_dashboard(dash)
                last_draw = time.monotonic()
    finally:
        bar.close()
        if dash is not None:
            draw_dashboard(dash)
    return pd.DataFrame(rows)
