"""Evaluation and log-probs from the weights being trained, through the engine's own loads; generation's entry.

Owns: the forward-only pass over held-out batches (mean loss per supervised token), the per-token
log-probs and entropies of a batch from a pluggable weights source, and ``generate``, which sends one
prompt to ``step/decode.py``'s ``generate_one`` and several (or samples, or their log-probs) to its
``generate_batch``; bound as ``Session.evaluate``, ``Session.logprobs`` and ``Session.generate``.
Weights come from the engine (``Engine.stream_layers``): the same weight source, loads and slot
ordering as a step's forward. Each pass runs between steps (``step/between_steps.run_pass``, Note:
[Eval between steps] there): it drops no update and the next step runs as it would have without it.
Does not own: the decoding loop, sampling and stopping (``step/decode.py``), the training step, the
optimizer (never touched here), the data's tokenization.

Note: [Weights source] a forward-only pass reads its weights from ``layers(head: bool)``, a factory
of an iterator of ``(unit, params)``: first ``(-1, embedding)``, where embedding is None for the
engine's own rows (gathered as a step does) or a dict holding the embedding table (V, H) on the
device (under the model's embedding name, e.g. "model.embed_tokens.weight"); then ``(i, params)``
for layers i = 0..L-1, params the dict of layer i's tensors on the device by their names in the
layer (``Layout.views``, as ``Engine.stream_layers`` yields them); then, when ``head``, ``(L, the
head unit's params)`` (final norm and lm_head, plus the embedding where tied:
``Engine.head_layout``). The iterator may reuse a buffer once the pass has resumed it: each unit's
compute is enqueued before the next item is asked for. ``own_layers`` is the engine's current
weights; ``Session.logprobs(ref=True)`` takes ``session.reference.stream(engine, head)``.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from .model.binding import call
from .machine.shape import loss_positions
from .step.between_steps import run_pass
from .step.transfers import chunks


# ---- evaluation ----------------------------------------------------------------------------
def evaluate(session, batches, *, steps: int | None = None) -> float:
    """Mean cross-entropy per supervised token over ``batches`` (see ``Session.evaluate``)."""
    if steps is not None and (not isinstance(steps, int) or isinstance(steps, bool) or steps < 1):
        raise ValueError(f"steps={steps!r}: an int >= 1, or None for one pass over the data")
    total, count = 0.0, 0
    for batch in _eval_batches(batches, steps):
        mbs, n_valid, _ = session._prepare(batch)  # raises on a bad batch before anything runs
        total += _run(session, lambda: _loss_sum(session.engine, mbs))
        count += n_valid
    if count == 0:
        raise ValueError("evaluate got no batches: pass a non-empty list, sft_batches(...) or steps >= 1")
    return total / count


def _eval_batches(batches, steps: int | None):
    """One pass of an endless batch source (``one_pass()``), else the iterable itself; at most ``steps``."""
    if hasattr(batches, "one_pass"):
        it = batches.one_pass()
    elif steps is None and iter(batches) is batches:
        raise TypeError(f"evaluate(steps=None) got {type(batches).__name__}, an iterator that may never end: pass "
                        "steps=, a list of batches, or sft_batches(...) (one pass over its examples)")
    else:
        it = iter(batches)
    for k, batch in enumerate(it):
        if steps is not None and k == steps:
            return
        yield batch


def _loss_sum(engine, mbs: list[dict]) -> float:
    """Driver: the summed (not averaged) token losses of one batch's micro-batches, forward only."""
    total = torch.zeros((), dtype=torch.float32, device=engine.dev.device)

    def at_head(m, mb, h, params):
        nonlocal total
        labels = mb["shift_labels"].to(engine.dev.device, non_blocking=True)
        for a, b in chunks(h.shape[1], loss_positions(engine.cfg.loss_chunk_tokens, h.shape[0])):
            logits = engine.arch.logits(params, h[:, a:b])
            total += F.cross_entropy(logits.float().flatten(0, 1), labels[:, a:b].flatten(), ignore_index=-100,
                                     reduction="sum")

    _forward(engine, mbs, lambda head: own_layers(engine, head), at_head)
    return float(total)  # host sync: the end of the pass


def own_layers(engine, head: bool):
    """The engine's current weights as a weights source (Note: [Weights source]): the embedding's rows from its
    own gather, then ``Engine.stream_layers``."""
    yield -1, None
    yield from engine.stream_layers(head=head)


def _forward(engine, mbs: list[dict], layers, at_head) -> None:
    """Driver: run the micro-batches through ``layers(True)`` (Note: [Weights source]); at the head, call
    ``at_head(m, mb, h, head_params)`` for each micro-batch m with its last hidden states h (b, T, H)."""
    arch, dev = engine.arch, engine.dev
    H = arch.embed.weight.shape[1]
    it = layers(True)
    unit, embed = next(it)
    if unit != -1:
        raise ValueError(f"the weights source yielded unit {unit} first; it must yield (-1, the embedding's params, "
                         "or None for the engine's own) before the layers (Note: [Weights source] in inference.py)")
    hs, calls = [], []
    for mb in mbs:
        ids = mb["input_ids"]
        if embed is None:  # the engine's own rows, gathered as a step's forward does
            E, box = engine._gather(mb)
            engine._ready(box)
            rows = E.view(-1, H)
        else:
            table = embed[arch.embed_name] if arch.embed_name in embed else next(iter(embed.values()))  # (V, H)
            rows = table.index_select(0, ids.flatten().to(table.device, non_blocking=True))
        mask = mb["attention_mask"]
        mask = None if mask is None else mask.to(dev.device, non_blocking=True)
        h0, c = arch.prelude(arch.embed_rows(rows, tuple(ids.shape)), mask,
                             **arch.position_kwargs(mb.get("position_ids"), dev.device))
        hs.append(h0), calls.append(c)
    for unit, params in it:
        if unit < engine.L:
            for m, c in enumerate(calls):
                hs[m] = call(engine._template(unit), params, hs[m], *c[unit][0], **c[unit][1])
            continue
        for m, (mb, h) in enumerate(zip(mbs, hs)):
            at_head(m, mb, h, params)


# ---- per-token log-probs -------------------------------------------------------------------
def logprobs(session, batch: dict, *, ref: bool = False, entropy: bool = False, temperature: float = 1.0):
    """Per-token log-probs (and entropies) of ``batch`` from the current or the reference weights (see
    ``Session.logprobs``)."""
    if not (isinstance(temperature, (int, float)) and temperature > 0):
        raise ValueError(f"temperature={temperature!r}: must be a number > 0 (the logits are divided by it)")
    engine = session.engine
    if ref:
        reference = getattr(session, "reference", None)
        if reference is None:
            raise NotImplementedError(
                "ref=True needs the reference weights: set session.reference to an object whose "
                "stream(engine, head) yields (-1, embedding params), then (unit, params) of layers 0..L-1 and, "
                "with head, (L, head params), as Engine.stream_layers does (Note: [Weights source] in inference.py)")
        layers = lambda head: reference.stream(engine, head)  # noqa: E731
    else:
        layers = lambda head: own_layers(engine, head)  # noqa: E731
    mbs, _, _ = session._prepare(batch, need_labels=False)  # raises on a bad batch before anything runs
    lp, H = _run(session, lambda: _logprobs(engine, mbs, layers, entropy, float(temperature)))
    return (lp, H) if entropy else lp


def _logprobs(engine, mbs: list[dict], layers, entropy: bool, temperature: float):
    """Driver: ([B, T], [B, T] or None) fp32 on the host, HF's alignment, from the head's chunks."""
    from .post.logprobs import to_hf, token_logprobs

    lps, Hs = [], []

    def at_head(m, mb, h, params):
        labels = mb["shift_labels"].to(engine.dev.device, non_blocking=True)
        lp = torch.zeros(labels.shape, dtype=torch.float32, device=h.device)  # (b, T), position t predicts t + 1
        ent = torch.zeros_like(lp) if entropy else None
        for a, b in chunks(h.shape[1], loss_positions(engine.cfg.loss_chunk_tokens, h.shape[0])):
            lp[:, a:b], e = token_logprobs(engine.arch.logits(params, h[:, a:b]), labels[:, a:b], temperature,
                                           entropy=entropy)
            if entropy:
                ent[:, a:b] = e
        lps.append(to_hf(lp)), Hs.append(None if ent is None else to_hf(ent))

    _forward(engine, mbs, layers, at_head)
    lp = torch.cat(lps).cpu()  # host sync: the end of the pass
    return lp, (torch.cat(Hs).cpu() if entropy else None)


# ---- generation ----------------------------------------------------------------------------
def generate(session, prompt, *, max_new_tokens: int, do_sample: bool = False, temperature: float = 1.0,
             top_p: float = 1.0, tokenizer=None, cache_weights: bool | None = None, seed: int = 0,
             num_return_sequences: int = 1, return_logprobs: bool = False):
    """Continue ``prompt`` from the session's current weights (see ``Session.generate``): one prompt by
    ``decode.generate_one``; several prompts, several samples or their log-probs by ``decode.generate_batch``."""
    from .step import decode

    if decode.is_batch(prompt) or num_return_sequences != 1 or return_logprobs:
        return decode.generate_batch(session, prompt, max_new_tokens=max_new_tokens, do_sample=do_sample,
                                     temperature=temperature, top_p=top_p, num_return_sequences=num_return_sequences,
                                     return_logprobs=return_logprobs, tokenizer=tokenizer, cache_weights=cache_weights,
                                     seed=seed)
    return decode.generate_one(session, prompt, max_new_tokens=max_new_tokens, do_sample=do_sample,
                               temperature=temperature, top_p=top_p, tokenizer=tokenizer, cache_weights=cache_weights,
                               seed=seed)


def _run(session, fn):
    """Run ``fn`` as a pass between steps on the session's driver thread (``between_steps.run_pass``)."""
    return run_pass(session.engine, session._driver, fn)
