"""Evaluation and generation from the weights being trained, through the engine's own loads.

Owns: the forward-only pass over held-out batches (mean loss per supervised token), the per-token
log-probs and entropies of a batch from a pluggable weights source, and token-by-token generation
with a KV cache, greedy or sampled; bound as ``Session.evaluate``, ``Session.logprobs`` and
``Session.generate``. Weights come from the engine (``Engine.stream_layers``,
``Engine.weights_copy``): the same weight source, loads and slot ordering as a step's forward.
Does not own: the training step, the optimizer (never touched here), the data's tokenization.

Note: [Eval between steps] a pass first waits for every pending update (``Engine.settle``), so
that it reads the weights after the last step, and so that a failure inside it (which resets the
engine's handoffs) drops no update. It keeps no graph and touches neither gradients, optimizer
state, the step count nor the activation policy; its loads record no trace (the recorder is set
aside for the pass). The next step therefore runs exactly as it would have without it.

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

import contextlib
import inspect

import torch
import torch.nn.functional as F

from .model.binding import call
from .machine.budget import device_free
from .machine.shape import loss_positions
from .step.transfers import chunks
from .view.trace import Recorder


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
    """Continue ``prompt`` from the session's current weights (see ``Session.generate``); several prompts,
    several samples or their log-probs: the batched path (``post/rollout.py``)."""
    from .data.sft import load_tokenizer, prompt_ids
    from .post.rollout import generate_batch, is_batch

    if is_batch(prompt) or num_return_sequences != 1 or return_logprobs:
        return generate_batch(session, prompt, max_new_tokens=max_new_tokens, do_sample=do_sample,
                              temperature=temperature, top_p=top_p, num_return_sequences=num_return_sequences,
                              return_logprobs=return_logprobs, tokenizer=tokenizer, cache_weights=cache_weights,
                              seed=seed)

    if not isinstance(max_new_tokens, int) or isinstance(max_new_tokens, bool) or max_new_tokens < 1:
        raise ValueError(f"max_new_tokens={max_new_tokens!r}: must be an int >= 1")
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
    eos = _eos_ids(session.config, tok)
    pick = _picker(do_sample, temperature, top_p, seed)
    if cache_weights is None:
        cache_weights = _fits(session.engine)
    new = _run(session, lambda: _decode(session.engine, ids, max_new_tokens, pick, eos, cache_weights))
    if text_in:
        return tok.decode(new, skip_special_tokens=True)
    out = torch.cat([ids, torch.tensor([new], dtype=torch.long)], dim=1)
    return out if prompt.dim() == 2 else out.view(-1)


def _eos_ids(config, tok) -> set[int]:
    """Token ids that end a generation: the model config's eos (as generate uses) and the tokenizer's."""
    eos = getattr(config, "eos_token_id", None)
    out = set(eos if isinstance(eos, (list, tuple)) else [] if eos is None else [eos])
    if tok is not None and tok.eos_token_id is not None:
        out.add(tok.eos_token_id)
    return out


def _picker(do_sample: bool, temperature: float, top_p: float, seed: int):
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


def _fits(engine) -> bool:
    """Whether every layer's weights fit on the device beside what it holds (CUDA: in half its free memory)."""
    if not engine.dev.cuda:
        return False  # on "cpu" a copy of every layer only doubles host memory: stream them
    need = sum(engine.store.units[i].layout.numel for i in range(engine.L)) * engine.dtype.itemsize
    free = device_free(engine.dev.device, engine.cfg.device_memory)  # a device query between steps; within the budget
    return need < free // 2


def _decode(engine, ids: torch.Tensor, max_new: int, pick, eos: set[int], cache_weights: bool) -> list[int]:
    """Driver: prefill ``ids`` (1, T), then one token at a time with a KV cache; returns the new ids."""
    arch = engine.arch
    H = arch.embed.weight.shape[1]
    cache = _layer_cache(arch.config)
    cache_arg = "cache" if "cache" in inspect.signature(arch.base.forward).parameters else "past_key_values"
    head = engine.weights_copy(engine.L)
    layers = [engine.weights_copy(i) for i in range(engine.L)] if cache_weights else None
    x, new = ids, []
    for _ in range(max_new):
        E, box = engine._gather({"input_ids": x})
        engine._ready(box)
        h, calls = arch.prelude(arch.embed_rows(E.view(-1, H), tuple(x.shape)), None,
                                **{cache_arg: cache, "use_cache": True})
        for unit, params in (enumerate(layers) if cache_weights else engine.stream_layers(head=False)):
            cache.layer = unit
            h = call(engine._template(unit), params, h, *calls[unit][0], **calls[unit][1])
        token = int(pick(arch.logits(head, h[:, -1:]).float()[:, -1])[0])
        new.append(token)
        if token in eos:
            break
        x = torch.tensor([[token]])
    return new


def _layer_cache(config):
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


# ---- running a pass on the session's driver thread -----------------------------------------------
def _run(session, fn):
    """Run ``fn`` as a pass between steps (Note: [Eval between steps]) on the session's driver thread."""
    from .step.workers import run_uninterrupted as _run_uninterrupted

    engine = session.engine
    if engine.closed:
        raise RuntimeError("this Session is closed; make a new one, or Session.resume(path) a checkpoint")

    def job():
        if engine.dev.cuda:
            torch.cuda.set_device(engine.dev.device)
        engine.settle()  # resident units are read where they live: no write-back to the host
        with _pass(engine):
            return fn()

    out, interrupted = _run_uninterrupted(job, session._driver)
    if interrupted:
        raise KeyboardInterrupt("interrupted after the pass in flight finished; training state is unchanged")
    return out


@contextlib.contextmanager
def _pass(engine):
    """No grad, the compute stream, eval mode and no trace for one pass; the engine's handoffs reset on failure."""
    saved = engine.rec, engine.io.rec
    training = engine.arch.model.training
    engine.rec = engine.io.rec = Recorder(enabled=False, device=engine.dev.device)
    engine.arch.model.train(False)
    try:
        with torch.no_grad(), engine.dev.on(engine.dev.compute):
            yield
    except BaseException:
        engine._recover()  # nothing was pending (drained): no update is dropped
        raise
    finally:
        engine.rec, engine.io.rec = saved
        engine.arch.model.train(training)
