"""Decoding: token-by-token generation from the weights being trained, with a KV cache, one prompt or many.

Owns: the one decoding loop (``decode``: prefill, then a token per row at a time through one KV cache,
each row stopping at its own EOS), choosing the next token (``picker``: greedy, or sampled with
transformers' warpers), the stopping ids (``eos_ids``), batching prompts (``prompt_rows``, left padding
with ``pad_id``), whether the layers' weights stay on the device for a generation (``weights_fit``), and
the two entry points: ``generate_one`` (a prompt -> its continuation) and ``generate_batch`` (prompts ->
``post.rollout.Rollouts``). ``Session.generate`` reaches both through ``inference.generate``; GRPO's
rollouts through ``Session.generate``. Weights come from the engine (``Engine.weights_copy``,
``Engine.stream_layers``); the pass runs between steps (``between_steps.run_pass``).
Does not own: evaluation or log-probs of a given batch (``inference.py``), what a batch of rollouts
trains on (``post/rollout.py``: ``Rollouts``, Note: [Rollout alignment]), the tokenizer (``data/sft.py``).
"""
from __future__ import annotations

import inspect

import torch

from ..data.sft import load_tokenizer, prompt_ids
from ..machine.budget import device_free
from ..model.binding import call
from ..post.rollout import Rollouts, position_ids
from .between_steps import run_pass


def _check_lengths(max_new_tokens, num_return_sequences: int = 1) -> None:
    """Raise ValueError for a bad ``max_new_tokens`` or ``num_return_sequences``."""
    if not isinstance(max_new_tokens, int) or isinstance(max_new_tokens, bool) or max_new_tokens < 1:
        raise ValueError(f"max_new_tokens={max_new_tokens!r}: must be an int >= 1")
    if not isinstance(num_return_sequences, int) or isinstance(num_return_sequences, bool) or num_return_sequences < 1:
        raise ValueError(f"num_return_sequences={num_return_sequences!r}: must be an int >= 1")


def generate_one(session, prompt, *, max_new_tokens: int, do_sample: bool = False, temperature: float = 1.0,
                 top_p: float = 1.0, tokenizer=None, cache_weights: bool | None = None, seed: int = 0):
    """Continue one prompt from the session's current weights (``Session.generate``'s single-prompt path).

    Args:
        session: a ``Session``.
        prompt: a string or a chat (a list of {"role", "content"} dicts; both need ``tokenizer``), or token
            ids as a LongTensor (T,) or (1, T).
        max_new_tokens: at most this many new tokens (>= 1); fewer when EOS comes.
        do_sample, temperature, top_p, seed: sample with transformers' warpers instead of greedy.
        tokenizer: a model directory or a loaded HF tokenizer.
        cache_weights: keep every layer's weights on the device for the generation; None: when they fit.
    Returns:
        The completion's text for a text prompt; else the prompt's ids followed by the new ones, shaped as
        the prompt.
    Raises:
        ValueError: a bad length, sampling setting or prompt (ids outside the vocabulary, text without a
            tokenizer).
    Example:
        >>> generate_one(s, torch.tensor([1, 2, 3]), max_new_tokens=4)  # doctest: +SKIP
    """
    _check_lengths(max_new_tokens)
    if do_sample and not (temperature > 0 and 0 < top_p <= 1):
        raise ValueError(f"temperature={temperature!r}, top_p={top_p!r}: need temperature > 0 and 0 < top_p <= 1")
    tok = load_tokenizer(tokenizer) if tokenizer is not None else None
    text_in = not isinstance(prompt, torch.Tensor)
    if text_in:
        if tok is None:
            raise ValueError("a text or chat prompt needs tokenizer= (a model directory or a loaded HF tokenizer); "
                             "or pass token ids as a LongTensor")
        ids = torch.tensor([prompt_ids(tok, prompt)])
    else:
        ids = prompt if prompt.dim() == 2 else prompt.view(1, -1)
        if ids.shape[0] != 1 or ids.dtype != torch.long or ids.numel() == 0:
            raise ValueError(f"prompt ids of shape {tuple(prompt.shape)}, dtype {prompt.dtype}: pass one non-empty "
                             "prompt as a LongTensor of shape (T,) or (1, T)")
        ids = ids.cpu()
    V = session.arch.embed.weight.shape[0]
    if int(ids.min()) < 0 or int(ids.max()) >= V:
        raise ValueError(f"prompt holds token ids outside the vocabulary [0, {V}); check the tokenizer")
    eos = eos_ids(session.config, tok)
    pick = picker(do_sample, temperature, top_p, seed)
    if cache_weights is None:
        cache_weights = weights_fit(session.engine)
    engine = session.engine
    new, _ = run_pass(engine, session._driver, lambda: decode(engine, ids, max_new=max_new_tokens, pick=pick, eos=eos,
                                                              cache_weights=cache_weights))
    new = new[0].tolist()
    if text_in:
        return tok.decode(new, skip_special_tokens=True)
    out = torch.cat([ids, torch.tensor([new], dtype=torch.long)], dim=1)
    return out if prompt.dim() == 2 else out.view(-1)


def generate_batch(session, prompts, *, max_new_tokens: int, do_sample: bool = False, temperature: float = 1.0,
                   top_p: float = 1.0, num_return_sequences: int = 1, return_logprobs: bool = False,
                   tokenizer=None, cache_weights: bool | None = None, seed: int = 0) -> Rollouts:
    """Sample ``num_return_sequences`` completions of each prompt in one batch (``Session.generate``'s batched path).

    Args:
        session: a ``Session``.
        prompts: a list of strings, chats or LongTensors of ids (all text or all ids), or one prompt.
        max_new_tokens: at most this many new tokens per row (>= 1).
        num_return_sequences: rows per prompt (consecutive in the batch).
        return_logprobs: also return each generated token's log-prob at ``temperature``.
        do_sample, temperature, top_p, seed, tokenizer, cache_weights: as ``generate_one``'s.
    Returns:
        ``Rollouts`` (Note: [Rollout alignment] in ``post/rollout.py``).
    Raises:
        ValueError: a bad length, sampling setting or prompt.
    Example:
        >>> r = generate_batch(s, ["1+2=", "3+4="], max_new_tokens=3, num_return_sequences=2)  # doctest: +SKIP
    """
    _check_lengths(max_new_tokens, num_return_sequences)
    if not (temperature > 0 and 0 < top_p <= 1):
        raise ValueError(f"temperature={temperature!r}, top_p={top_p!r}: need temperature > 0 and 0 < top_p <= 1")
    tok = load_tokenizer(tokenizer) if tokenizer is not None else None
    rows = prompt_rows(prompts, tok, session.arch.embed.weight.shape[0])
    index = torch.arange(len(rows)).repeat_interleave(num_return_sequences)
    rows = [rows[i] for i in index.tolist()]
    pad = pad_id(session.config, tok)
    P = max(map(len, rows))
    ids = torch.full((len(rows), P), pad, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for b, r in enumerate(rows):  # left padding: every row's next token is in the last column
        ids[b, P - len(r):], mask[b, P - len(r):] = torch.tensor(r), 1
    eos = eos_ids(session.config, tok)
    pick = picker(do_sample, temperature, top_p, seed)
    if cache_weights is None:
        cache_weights = weights_fit(session.engine)
    engine = session.engine
    new, lps = run_pass(engine, session._driver, lambda: decode(
        engine, ids, mask=mask, max_new=max_new_tokens, pick=pick, eos=eos, pad=pad, cache_weights=cache_weights,
        temperature=temperature if return_logprobs else None))
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


# ---- the pieces ------------------------------------------------------------------------------
def is_batch(prompt) -> bool:
    """Whether ``prompt`` is several prompts: a list of strings, chats or id tensors (a chat is one prompt)."""
    return isinstance(prompt, (list, tuple)) and not (len(prompt) and all(isinstance(m, dict) for m in prompt))


def prompt_rows(prompts, tok, V: int) -> list[list[int]]:
    """Each prompt's ids (strings and chats through ``tok``); raises ValueError on a mix, an empty list or ids
    outside [0, V)."""
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
    return rows


def eos_ids(config, tok) -> set[int]:
    """Token ids that end a generation: the model config's eos (as generate uses) and the tokenizer's."""
    eos = getattr(config, "eos_token_id", None)
    out = set(eos if isinstance(eos, (list, tuple)) else [] if eos is None else [eos])
    if tok is not None and tok.eos_token_id is not None:
        out.add(tok.eos_token_id)
    return out


def pad_id(config, tok) -> int:
    """The padding id: the config's, the tokenizer's, else its eos, else 0 (padding is masked: any id works)."""
    for v in (getattr(config, "pad_token_id", None), getattr(tok, "pad_token_id", None),
              getattr(config, "eos_token_id", None)):
        v = v[0] if isinstance(v, (list, tuple)) and v else v
        if isinstance(v, int) and v >= 0:
            return v
    return 0


def picker(do_sample: bool, temperature: float, top_p: float, seed: int):
    """logits (N, V) fp32 -> (N,) next token ids on the host; greedy, or sampled with transformers' own warpers
    and drawn on the logits' device (seeded per device: CPU and CUDA draw different samples for one seed)."""
    if not do_sample:
        return lambda logits: logits.argmax(-1).cpu()  # host sync: the next input depends on it
    from transformers.generation.logits_process import TemperatureLogitsWarper, TopPLogitsWarper

    warpers = (([TemperatureLogitsWarper(temperature)] if temperature != 1.0 else [])  # 1.0: HF skips it too
               + ([TopPLogitsWarper(top_p)] if top_p < 1 else []))
    gens: dict = {}  # one seeded generator per device: the draw happens where the logits are

    def pick(logits):
        for w in warpers:
            logits = w(None, logits)
        g = gens.get(logits.device)
        if g is None:
            g = gens[logits.device] = torch.Generator(device=logits.device).manual_seed(seed)
        # on the device: moving (N, V) probabilities to the host and drawing there cost more than the layers
        return torch.multinomial(torch.softmax(logits, -1), 1, generator=g).view(-1).cpu()
    return pick


def weights_fit(engine) -> bool:
    """Whether every layer's weights fit on the device beside what it holds (CUDA: in half its free memory)."""
    if not engine.dev.cuda:
        return False  # on "cpu" a copy of every layer only doubles host memory: stream them
    need = sum(engine.store.units[i].layout.numel for i in range(engine.L)) * engine.dtype.itemsize
    free = device_free(engine.dev.device, engine.cfg.device_memory)  # a device query between steps; within the budget
    return need < free // 2


def layer_cache(config):
    """A transformers DynamicCache that files each layer's keys and values under the layer being run.

    The engine calls one template per distinct layer structure, whose ``layer_idx`` is its first
    layer's; ``layer`` (set before each call) says which layer's cache the call extends.
    """
    from transformers import DynamicCache

    class LayerCache(DynamicCache):
        layer = 0

        def update(self, key_states, value_states, layer_idx, *args, **kwargs):
            return super().update(key_states, value_states, self.layer, *args, **kwargs)

    return LayerCache(config=config)


def decode(engine, ids: torch.Tensor, *, max_new: int, pick, eos: set[int], cache_weights: bool,
           mask: torch.Tensor | None = None, pad: int = 0, temperature: float | None = None):
    """Driver: prefill ``ids`` (N, P) long, then one token per row at a time through one KV cache.

    ``mask`` (N, P) marks a left-padded batch's real tokens (positions then count from each row's first);
    None: every row is whole (no mask, HF's default positions). A row that ended at EOS gets ``pad`` after it.
    Returns (new ids (N, G) long; their log-probs (N, G) fp32 at ``temperature``, 0 after EOS, or None when it
    is None). Stops when every row has ended or after ``max_new``. Runs inside ``run_pass``.
    """
    arch, dev = engine.arch, engine.dev.device
    H = arch.embed.weight.shape[1]
    cache = layer_cache(arch.config)
    cache_arg = "cache" if "cache" in inspect.signature(arch.base.forward).parameters else "past_key_values"
    head = engine.weights_copy(engine.L)
    layers = [engine.weights_copy(i) for i in range(engine.L)] if cache_weights else None  # dropped on return
    eos_t = torch.tensor(sorted(eos), dtype=torch.long)
    N = ids.shape[0]
    x, am = ids, mask
    pos = None if mask is None else position_ids(mask)
    done = torch.zeros(N, dtype=torch.bool)
    new, lps = [], []
    for _ in range(max_new):
        E, box = engine._gather({"input_ids": x})
        engine._ready(box)
        where = {} if am is None else {"position_ids": pos.to(dev)}
        h, calls = arch.prelude(arch.embed_rows(E.view(-1, H), tuple(x.shape)), None if am is None else am.to(dev),
                                **where, **{cache_arg: cache, "use_cache": True})
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
        x = token.view(-1, 1)
        if am is not None:
            pos = pos[:, -1:] + 1
            am = torch.cat([am, torch.ones(N, 1, dtype=am.dtype)], 1)
    return torch.stack(new, 1), (torch.stack(lps, 1) if temperature is not None else None)
