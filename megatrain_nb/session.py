"""Session: load a model into host slabs and train it step by step through the streaming engine.

Wires config -> hf -> host_store -> optim -> engine -> trace. Holds no phase logic: a step is
"validate the batch, split it (step/batch.py), hand it to the engine, record the result". About 530 lines, most
of them the public API's docstrings (Args / Returns / Raises / Example for each of ~30 members); every method's
work is one call into the module that owns it (inference.py, training.py, post/, host/checkpoint.py, view/).
"""
from __future__ import annotations

import concurrent.futures
import dataclasses
import math
import os
import time
from pathlib import Path

import torch

from .config import EngineConfig, OptimConfig
from .host import grad_ring, shared_store
from .host.collective_save import one_writer
from .step.distributed import local_device
from .step.engine import Engine
from .model.hf import load_architecture
from .host.host_store import HostStore
from .host.optim import HostAdamW
from .step.workers import run_uninterrupted
from .view.results import StepResult  # noqa: F401  (public here too: megatrain_nb.session.StepResult)
from .view.trace import Recorder

_OPTIM = {f.name for f in dataclasses.fields(OptimConfig)}
_ENGINE = {f.name for f in dataclasses.fields(EngineConfig)}


class Session:
    """A model held in host memory, trained one streamed step at a time.

    Example:
        >>> s = Session.from_pretrained("my-model", device="cpu", lr=1e-4)   # doctest: +SKIP
        >>> r = s.step({"input_ids": ids, "labels": ids})                    # doctest: +SKIP
        >>> s.save_pretrained("my-model-tuned")                              # doctest: +SKIP
    """

    def __init__(self, config, *, _init, **settings):
        unknown = set(settings) - _OPTIM - _ENGINE
        if unknown:
            raise TypeError(f"unknown setting(s) {sorted(unknown)}; optimizer settings: {sorted(_OPTIM)}, "
                            f"engine settings: {sorted(_ENGINE)}")
        self.optim_cfg = OptimConfig(**{k: v for k, v in settings.items() if k in _OPTIM})
        self.engine_cfg = EngineConfig(**{k: v for k, v in settings.items() if k in _ENGINE})
        self.config = config
        self.arch = load_architecture(config)
        from .machine.budget import cap_device
        from .machine.preflight import check, cuda_allocator, resolve_pinning, resolve_weight_slots

        if torch.device(self.engine_cfg.device).type == "cuda":
            cuda_allocator()  # Note: [Allocator] in preflight.py: fragmentation made the auto search's trials fail
        check(self.arch, self.engine_cfg, optimizer_state=self.optim_cfg.optimizer_state,
              keep_fp32=self.optim_cfg.compact_keep_fp32, grad_clip=self.optim_cfg.grad_clip)  # before allocating: refuse with the numbers and the setting to change
        pin, cast = resolve_pinning(self.engine_cfg, self.arch, optimizer_state=self.optim_cfg.optimizer_state,
                                    keep_fp32=self.optim_cfg.compact_keep_fp32, grad_clip=self.optim_cfg.grad_clip)
        resolved = dataclasses.replace(self.engine_cfg, pin_store=pin, cast_on_device=cast,  # engine_cfg keeps "auto"
                                       weight_slots=resolve_weight_slots(self.engine_cfg, self.arch),
                                       device=local_device(self.engine_cfg.device))  # data parallel: this rank's GPU
        if torch.device(resolved.device).type == "cuda" and not cast and _streams_state(resolved.placement):
            raise ValueError(f"placement={resolved.placement!r} streams fp32 masters and moments over PCIe, which needs "
                             f"them pinned (cast_on_device), but pin_store={resolved.pin_store} and cast_on_device="
                             f"{self.engine_cfg.cast_on_device} leave them unpinned; set pin_store=None and cast_on_device="
                             "None (it needs the store in 90% of host RAM), or use placement='auto' / 'host'")
        cap_device(resolved.device, resolved.device_memory)  # the allocator's hard cap (Note: [Budgets] in machine/budget.py)
        from .data.packing import install
        from .model import kernels

        self.kernels = kernels.install(self.arch, experts=resolved.experts_implementation, device=resolved.device,
                                       dtype=resolved.dtype)  # experts and sink attention kernels, and why
        self._active_params = self.arch.active_params()  # what model TFLOPS counts: MoE experts at top_k / experts
        install(self.arch.config, resolved.device, resolved.dtype)  # how packed examples are kept apart
        self.kernels["attention"] = self.arch.config._attn_implementation  # varlen where packing chose it
        shared = shared_store.attach(resolved.share_host_store, cuda=torch.device(resolved.device).type == "cuda")
        slabs = grad_ring.slab_reason(enabled=resolved.grad_ring, grad_clip=self.optim_cfg.grad_clip,
                                      overlap_optimizer=resolved.overlap_optimizer, nonfinite=resolved.nonfinite,
                                      pass_batch_size=resolved.pass_batch_size, shared=shared is not None)
        self.store = HostStore(self.arch, grad_dtype=resolved.dtype, shadow_dtype=resolved.dtype if pin else None,
                               slabs=slabs, pin_ring=torch.device(resolved.device).type == "cuda",  # Note: [Gradient ring]
                               pin_master=cast, pin_moments=cast and _streams_state(self.engine_cfg.placement),
                               shared=shared,  # data parallel: one store per machine (shared_store.py)
                               optimizer_state=self.optim_cfg.optimizer_state, keep_fp32=self.optim_cfg.compact_keep_fp32)
        shared_store.fill(self.store, _init)  # _init and the shadow's refresh, once per machine
        self.optim = HostAdamW(self.store, self.optim_cfg)
        self.recorder = Recorder(enabled=self.engine_cfg.trace, device=self.engine_cfg.device)
        self.engine = Engine(self.arch, self.store, self.optim, resolved, self.optim_cfg, self.recorder)
        self._driver = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="megatrain-driver")
        self.history: list[StepResult] = []
        self.skipped_steps = 0
        self.data_state: dict | None = None  # position of the data iterator (train() sets it; checkpoints keep it)
        self.eval_history: list[dict] = []  # {"step", "eval_loss", "seconds"} of each evaluate()
        self.reference = None  # logprobs(ref=True)'s weights (post/reference.py: from_pretrained's files, or
        # freeze_reference's snapshot); .stream(engine, head) (Note: [Weights source] in inference.py)

    # ---- construction ------------------------------------------------------------------
    @classmethod
    def from_pretrained(cls, path: str | os.PathLike, **settings) -> "Session":
        """Load an HF causal-LM directory (config.json + safetensors) into host slabs.

        Args:
            path: directory with config.json and model.safetensors or a sharded index.
            **settings: OptimConfig fields (lr, betas, eps, weight_decay, grad_clip, lr_schedule,
                warmup_steps, total_steps) and EngineConfig fields (device, dtype, checkpoint_every,
                micro_batch_size, weight_slots, ...; ``device_memory="20GiB"`` and ``host_memory="64GB"``
                train within those budgets: Note: [Budgets] in machine/budget.py).
        Raises:
            FileNotFoundError: the directory, config.json or the weights are missing.
            ValueError: corrupt weights, an unsupported architecture, a bad setting.
            PreflightError: (a MemoryError and a ValueError) the model does not fit host RAM or device memory
                (or their budgets); raised before anything is allocated, naming the settings that would fit.
        """
        from transformers import AutoConfig

        path = Path(path)
        if not path.is_dir():
            raise FileNotFoundError(f"model directory {str(path)!r} does not exist")
        if not (path / "config.json").exists():
            raise FileNotFoundError(f"{str(path)!r} has no config.json; pass an HF model directory")
        config = AutoConfig.from_pretrained(str(path))
        HostStore._files(path)  # fail on missing weights before allocating anything
        from .post.reference import Reference

        s = cls(config, _init=lambda store: store.load_safetensors(path), **settings)
        s.reference = Reference(path, s.store)  # the loaded weights, read again from these files, never copied
        return s

    @classmethod
    def from_config(cls, config, *, seed: int = 0, **settings) -> "Session":
        """Randomly initialise a model from a transformers config, one unit at a time (tests, teaching)."""
        return cls(config, _init=lambda store: store.init_random(seed), **settings)

    # ---- training ----------------------------------------------------------------------
    def step(self, batch: dict, loss=None, *, group_size: int | None = None, temperature: float = 1.0) -> StepResult:
        """Train on one batch: forward, loss, backward, AdamW on every parameter.

        With ``loss=fn`` the step's loss is ``fn(logp, batch, ctx)`` (``post.losses``: sft, dpo, grpo,
        kto, or your own) over the per-token log-probs, differentiated through the head and every
        layer (Note: [Loss hook] in step/hook.py); without it, HF's cross-entropy, as always.

        Args:
            batch: {"input_ids": LongTensor [B, T], "labels": LongTensor [B, T] (optional: defaults
                to input_ids; -100 = ignored), "attention_mask": [B, T] of 0/1 (optional),
                "position_ids": [B, T] (optional: packed rows)}; with ``loss``, any extra fields the
                loss reads: tensors per row [B] or per token [B, T] (sliced into each micro-batch),
                anything else (a float, a 0-d tensor) passed to every micro-batch as it is;
                "max_completion_length" (an int) also goes to ``ctx`` (GRPO's ``dr_grpo``).
            loss: ``fn(logp, batch, ctx) -> 0-d tensor``: ``logp`` [b, T] fp32 with gradient,
                ``logp[r, t] = log p(labels[r, t] | input_ids[r, :t])`` (0 where the label is -100
                and at t = 0); ``batch`` the micro-batch's fields on the device (``labels`` always);
                ``ctx`` a ``post.losses.LossContext`` with the step's global token and row counts
                (over micro-batches and data-parallel ranks); ``entropy=`` [b, T] too when ``fn``
                has that parameter. The step's loss is the sum of ``fn`` over micro-batches and ranks.
            group_size: rows that must share a micro-batch (a DPO pair: 2, a GRPO group: the
                completions per prompt); default: 2 when the batch has "pair", the run length of
                "group", else 1.
            temperature: with ``loss``, the logits are divided by it before the log-probs (as the
                sampling that made the rows saw them, e.g. GRPO's rollouts).
        Returns:
            StepResult; ``loss`` is HF's (labels shifted inside, mean over supervised tokens), or
            the hook's; ``metrics`` what the hook's loss logged (``ctx.log``), summed, or None.
        Raises:
            TypeError / ValueError: a malformed batch, a field of the wrong shape, or a
                ``micro_batch_size`` that splits a group, before any state changes.
        Example:
            >>> from megatrain_nb.post import losses                                  # doctest: +SKIP
            >>> r = s.step(pref_batch, loss=functools.partial(losses.dpo, beta=0.1))  # doctest: +SKIP
            >>> r.loss, r.metrics["rewards/accuracies"]                               # doctest: +SKIP
        """
        if self.engine.closed:
            raise RuntimeError("this Session is closed (close() released its buffers and threads); make a new one, "
                               "or Session.resume(path) from a checkpoint saved before closing")
        hook = None
        if loss is not None:
            if not callable(loss):
                raise TypeError(f"loss={loss!r}: pass a function fn(logp, batch, ctx), "
                                "e.g. megatrain_nb.post.losses.dpo")
            from .step.hook import LossHook

            mbs, n_valid, tokens = self._prepare(batch, fields=True, group_size=group_size, passes=True)
            if not (isinstance(temperature, (int, float)) and temperature > 0):
                raise ValueError(f"temperature={temperature!r}: must be a number > 0 (the logits are divided by it)")
            hook = LossHook(loss, [mb.pop("batch") for mb in mbs], temperature=float(temperature))
        else:
            mbs, n_valid, tokens = self._prepare(batch, passes=True)
        t0 = time.perf_counter()
        lr = self.optim_cfg.lr_at(self.engine.steps_done)
        try:
            out, interrupted = run_uninterrupted(lambda: self.engine.step(mbs, n_valid, hook), self._driver)
        except torch.OutOfMemoryError as e:
            from .machine.preflight import oom_advice

            cfg = dataclasses.replace(self.engine_cfg, weight_slots=self.engine.cfg.weight_slots)  # as resolved
            raise torch.OutOfMemoryError(oom_advice(e, cfg, tuple(mbs[0]["input_ids"].shape))) from e
        dt = time.perf_counter() - t0
        r = StepResult(step=self.engine.steps_done, loss=out["loss"], tokens=tokens, seconds=dt, lr=lr,
                       tflops=6 * self._active_params * tokens / dt / 1e12,
                       recomputed_layers=out["recomputed_layers"], grad_norm=out["grad_norm"],
                       skipped=out["nonfinite"], metrics=out["metrics"])
        self.history.append(r)
        if r.skipped:
            self.skipped_steps += 1
            what = "loss" if not math.isfinite(r.loss) else f"gradients of units {out['nonfinite_units']}"
            state = out.get("nonfinite_state_units")
            if math.isfinite(r.loss) and state:  # Note: [Non-finite state] in state_check.py
                grads = sorted(set(out["nonfinite_units"]) - set(state))
                what = (f"optimizer state of units {state} (a negative exp_avg_sq, or a NaN / inf master or "
                        "moment: restore a good checkpoint or re-initialize those moments)"
                        + (f" and gradients of units {grads}" if grads else ""))
            if self.engine_cfg.nonfinite == "raise":
                raise FloatingPointError(f"step {r.step}: non-finite {what}; no update was applied. "
                                         "Lower lr, check the data, or set nonfinite='skip'")
            import warnings
            warnings.warn(f"step {r.step}: non-finite {what}; its update was skipped "
                          f"({self.skipped_steps} skipped so far)", stacklevel=2)
        if interrupted:
            raise KeyboardInterrupt(f"interrupted: step {r.step} was finished first, so every layer has its update; "
                                    "the session is consistent and training can continue")
        return r

    def _prepare(self, batch: dict, *, fields: bool = False, group_size: int | None = None,
                 need_labels: bool = True, passes: bool = False) -> tuple[list[dict], int, int]:
        """``step.batch.prepare`` for this model and engine: validated micro-batches (of passes, for a step:
        ``passes``); raises before anything runs."""
        from .step.batch import prepare

        du = self.engine.device_updates
        return prepare(batch, vocab=self.arch.embed.weight.shape[0], micro_batch=du.micro_batch,
                       fields=fields, group_size=group_size, micro_batch_size=self.engine_cfg.micro_batch_size,
                       need_labels=need_labels, pass_rows=du.pass_rows if passes else None,
                       pass_batch_size=self.engine_cfg.pass_batch_size if passes else None)

    # ---- results -----------------------------------------------------------------------
    @property
    def trace(self):
        """The last step's Trace (spans, counters, slot occupancy)."""
        return getattr(self.engine, "trace", None)

    @property
    def tracing(self) -> bool:
        """Whether steps record a trace (spans, counters, slot occupancy); settable between steps."""
        return self.recorder.enabled

    @tracing.setter
    def tracing(self, on: bool) -> None:
        if not isinstance(on, bool):
            raise TypeError(f"tracing must be True or False, got {on!r}")
        self.recorder.enabled = self.engine_cfg.trace = on

    def _last_trace(self):
        if self.trace is None or not len(self.trace.spans):
            raise ValueError("no trace yet: run s.step(...) first (and keep trace=True, the default)")
        return self.trace

    def stalls(self):
        """Where compute waited in the last step and on what, with a diagnosis and the setting to change.

        Returns:
            DataFrame (see ``trace.find_stalls``): start_ms, end_ms, dur_ms, layer, phase, waited_on,
            diagnosis, setting.
        """
        from .view.trace import find_stalls

        return find_stalls(self._last_trace().to_dataframe())

    def plot_timeline(self):
        """Plotly figure of the last step: one row per stream / host worker, stalls highlighted."""
        from .view import viz

        df = self._last_trace().to_dataframe()
        return viz.timeline(df, stalls=self.stalls(), title=f"step {self.engine.steps_done}, lane by lane")

    def plot_buffers(self):
        """Plotly figure: occupancy of every device weight and gradient slot over the last step."""
        from .view import viz

        return viz.buffers(self._last_trace().slots_dataframe())

    def plot_memory(self):
        """Plotly figure: device memory by category over the last step and the host store's bytes by category."""
        from .view import viz

        store = {k: v for k, v in self.store.bytes_report().items() if k not in ("total", "params", "bytes_per_param")}
        return viz.memory(self._last_trace().counters_dataframe(), host_bytes=store)

    def history_dataframe(self):
        """One row per step of this session: step, loss, tokens, seconds, lr, tflops, tokens_per_s, and a column
        per metric a loss hook logged (``StepResult.metrics``)."""
        import pandas as pd

        rows = [dataclasses.asdict(r) for r in self.history]
        df = pd.DataFrame([{**{k: v for k, v in r.items() if k != "metrics"}, **(r["metrics"] or {})}
                           for r in rows])
        if len(df):
            df["tokens_per_s"] = df.tokens / df.seconds
        if self.eval_history:  # eval_loss at the step it followed (0: before training)
            ev = pd.DataFrame(self.eval_history)[["step", "eval_loss"]].drop_duplicates("step", keep="last")
            df = ev if not len(df) else df.merge(ev, on="step", how="outer").sort_values("step", ignore_index=True)
        return df

    def plot_history(self):
        """Plotly figure of the run so far: loss, tokens/s and TFLOPS per step, and a panel per group of metric
        columns (a loss hook's, train_grpo's reward_mean; ``viz.run_history``)."""
        from .view import viz

        return viz.run_history(self.history_dataframe())

    def export_trace(self, path: str | os.PathLike) -> None:
        """Write the last step's trace as Chrome Trace Event JSON (gzipped for .gz) for Perfetto."""
        from .view.trace import export_chrome_trace

        export_chrome_trace(self._last_trace(), path)

    def train(self, data, *, steps: int, loss=None, **kw):
        """Train ``steps`` steps from an iterable of batches with a progress bar (and a live dashboard in
        Jupyter); Jupyter's Stop ends it cleanly after the current step. ``loss``: each step's loss hook
        (see ``step``). See ``training.train``."""
        from .training import train

        return train(self, data, steps=steps, loss=loss, **kw)

    def evaluate(self, batches, *, steps: int | None = None) -> float:
        """Mean loss per supervised token over held-out batches, forward only, from the current weights.

        Streams the layers as a step's forward does, keeps no gradients and touches no optimizer
        state: the next step runs exactly as it would have (Note: [Eval between steps] in
        step/between_steps.py). Each result is kept in ``eval_history`` and drawn by ``plot_history``.

        Args:
            batches: ``sft_batches(...)`` (one pass over its examples, its training position
                untouched), a list of batch dicts, or any iterable of them with ``steps``.
            steps: at most this many batches; None: all of them (one pass of ``sft_batches``).
        Returns:
            sum of token losses / number of supervised tokens, over every batch.
        Raises:
            ValueError / TypeError: a malformed batch (before it runs), no batches, or an iterator
                without ``steps``.
        Example:
            >>> s.evaluate(sft_batches("val.jsonl", "my-model", batch=8, seq=1024))   # doctest: +SKIP
            2.3125
        """
        from .inference import evaluate

        t0 = time.perf_counter()
        loss = evaluate(self, batches, steps=steps)
        self.eval_history.append({"step": self.engine.steps_done, "eval_loss": loss,
                                  "seconds": time.perf_counter() - t0})
        return loss

    def logprobs(self, batch: dict, *, ref: bool = False, entropy: bool = False, temperature: float = 1.0):
        """Per-token log-probs of a batch's labels, forward only, without gradient; full logits never exist.

        Streams the layers between steps as ``evaluate`` does (Note: [Eval between steps] in
        step/between_steps.py) and computes the log-probs in the head's chunks of positions.

        Args:
            batch: as ``step`` takes it: "input_ids" [B, T], optional "labels" (default: input_ids;
                -100 = none), "attention_mask", "position_ids" (packed rows); other fields are ignored.
            ref: from the reference weights ``self.reference`` (an object whose ``stream(engine,
                head)`` yields ``(unit, params)``: Note: [Weights source] in inference.py) instead of
                the current weights.
            entropy: also return the entropy of each predictive distribution.
            temperature: the logits are divided by it first.
        Returns:
            ``logp`` [B, T] fp32 on the CPU, ``logp[b, t] = log p(labels[b, t] | input_ids[b, :t])``
            where ``labels[b, t] != -100``, 0 elsewhere and at t = 0 (HF's alignment; what a loss
            hook's ``logp`` is); with ``entropy``, ``(logp, H)``, H [B, T] fp32 at the same places.
        Raises:
            NotImplementedError: ``ref=True`` while ``self.reference`` is None.
            ValueError / TypeError: a malformed batch or a temperature <= 0, before anything runs.
        Example:
            >>> ref_logp = s.logprobs(batch, ref=True)              # doctest: +SKIP
            >>> s.step({**batch, "ref_logp": ref_logp}, loss=losses.dpo)  # doctest: +SKIP
        """
        from .inference import logprobs

        return logprobs(self, batch, ref=ref, entropy=entropy, temperature=temperature)

    def generate(self, prompt, *, max_new_tokens: int, do_sample: bool = False, temperature: float = 1.0,
                 top_p: float = 1.0, tokenizer=None, cache_weights: bool | None = None, seed: int = 0,
                 num_return_sequences: int = 1, return_logprobs: bool = False):
        """Continue a prompt (or a batch of prompts) from the current weights, one token at a time with a KV cache.

        Greedy decoding equals ``AutoModelForCausalLM.generate`` of ``save_pretrained``'s weights,
        token for token. Stops after ``max_new_tokens`` or at an end-of-sequence token (the
        config's ``eos_token_id``, and the tokenizer's), each row of a batch on its own.

        Args:
            prompt: a string (BOS + text, as prompt/response training sees it), a chat (a list of
                ``{"role", "content"}``, rendered with the chat template and its generation
                prompt), or token ids, a LongTensor (T,) or (1, T); or a LIST of such prompts
                (the batched path, below).
            max_new_tokens: the most tokens to add.
            do_sample: sample (with ``temperature`` and ``top_p``, transformers' warpers) instead of greedy.
            tokenizer: a model directory or a loaded HF tokenizer; needed for text and chat prompts.
            cache_weights: keep a copy of every layer on the device for the whole generation (True) or stream the
                layers through the weight slots for each token (False); None: resident on CUDA when
                the layers fit in half the free device memory. The copies are dropped on return.
            seed: the sampling generator's seed (the global RNG is left alone).
            num_return_sequences: completions per prompt (> 1: the batched path); a prompt's rows are consecutive.
            return_logprobs: the batched path, with each generated token's log-prob at ``temperature``.
        Returns:
            One prompt (and neither of the last two arguments): for a text or chat prompt, the new
            text (special tokens skipped); for ids, the prompt followed by the new ids, shaped like
            the prompt (as ``model.generate``). The batched path (a list of prompts,
            ``num_return_sequences > 1`` or ``return_logprobs``): a ``post.rollout.Rollouts`` (left-padded
            ``sequences``, ``attention_mask``, ``prompt_lengths``, ``completion_mask``, ``logprobs``
            aligned as a training step's ``logp`` of ``Rollouts.batch()``'s labels, ``texts`` with a tokenizer).
        Raises:
            ValueError: a bad prompt or setting, or a text prompt without a tokenizer.
        Example:
            >>> s.generate([{"role": "user", "content": "Hi!"}], max_new_tokens=20, tokenizer="my-model")  # doctest: +SKIP
            'Hello! How can I help?'
            >>> r = s.generate(["1+2=", "3+4="], max_new_tokens=3, do_sample=True, num_return_sequences=4,  # doctest: +SKIP
            ...                return_logprobs=True, tokenizer=tok)
            >>> r.sequences.shape, len(r.texts)                                                             # doctest: +SKIP
            (torch.Size([8, 8]), 8)
        """
        from .inference import generate

        return generate(self, prompt, max_new_tokens=max_new_tokens, do_sample=do_sample, temperature=temperature,
                        top_p=top_p, tokenizer=tokenizer, cache_weights=cache_weights, seed=seed,
                        num_return_sequences=num_return_sequences, return_logprobs=return_logprobs)

    def train_grpo(self, prompts: list, reward_fn, *, steps: int, group_size: int = 4, prompts_per_step: int = 2,
                   max_new_tokens: int = 16, temperature: float = 1.0, top_p: float = 1.0, epsilon: float = 0.2,
                   epsilon_high: float | None = None, beta: float = 0.0, loss_type: str = "grpo",
                   scale_rewards: bool = True, tokenizer=None, cache_weights: bool | None = None, seed: int = 0,
                   progress: bool = True, dashboard: bool | None = None, refresh_s: float = 1.0,
                   kl_ratio_weighted: bool = True):
        """GRPO on-policy (one update per batch of rollouts), with a progress bar. Each step samples
        ``prompts_per_step`` prompts (a seeded permutation per epoch), rolls out ``group_size`` completions
        of each, scores them with ``reward_fn``, forms ``losses.group_advantages``, adds the reference's
        log-probs when ``beta > 0`` and takes one ``step`` with ``losses.grpo``.

        Args:
            prompts: strings, chats or LongTensors of ids.
            reward_fn: ``reward_fn(prompts, completions) -> list[float]``, one per completion: prompts
                repeated per completion, completions as texts (with ``tokenizer``) or lists of ids.
            steps: optimizer steps.
            group_size: completions per prompt (TRL's ``num_generations``).
            prompts_per_step: prompts per step; the batch is ``prompts_per_step * group_size`` rows.
            max_new_tokens, temperature, top_p: sampling (``generate``).
            epsilon, epsilon_high, beta, loss_type: ``losses.grpo``'s. ``beta > 0`` needs ``reference``.
            scale_rewards: divide advantages by the group's std (False: Dr. GRPO).
            tokenizer, cache_weights, seed: as ``generate``; step k samples with seed ``seed * 1_000_003 + k``.
            progress: show a tqdm bar (its postfix: reward mean, KL, clip fraction).
            dashboard, refresh_s: as ``train``'s: the dashboard (None: in Jupyter only) draws the steps'
                reward_mean, kl and clip_ratio/* next to the loss.
            kl_ratio_weighted: ``losses.grpo``'s: weight the KL by the probability ratio (TRL's
                ``use_bias_correction_kl``; True in both).
        Returns:
            DataFrame, one row per step: step, reward_mean, reward_std, loss, kl, clip_ratio,
            completion_len, seconds. Each step's reward_mean is also in its ``StepResult.metrics``, so in
            ``history_dataframe()``. ``old_logp`` is the sampling log-prob at ``temperature == 1``;
            at another temperature it is left out, and the loss takes the policy's own (ratio 1).
        Raises:
            ValueError: bad arguments, ``beta > 0`` without a reference, a reward list of the wrong length.
        Example:
            >>> df = s.train_grpo(["2+3=", "4+1="], lambda p, c: [float(x == "5") for x in c], steps=20,  # doctest: +SKIP
            ...                   tokenizer=tok, max_new_tokens=2)
        """
        from .training import train_grpo

        return train_grpo(self, prompts, reward_fn, steps=steps, group_size=group_size,
                          prompts_per_step=prompts_per_step, max_new_tokens=max_new_tokens, temperature=temperature,
                          top_p=top_p, epsilon=epsilon, epsilon_high=epsilon_high, beta=beta, loss_type=loss_type,
                          scale_rewards=scale_rewards, tokenizer=tokenizer, cache_weights=cache_weights, seed=seed,
                          progress=progress, dashboard=dashboard, refresh_s=refresh_s,
                          kl_ratio_weighted=kl_ratio_weighted)

    def freeze_reference(self, path: str | os.PathLike | None = None):
        """Freeze the current weights as the reference model (``self.reference``) of DPO / GRPO's KL.

        Writes a bf16 snapshot (``save_pretrained(path, dtype=torch.bfloat16)``) and points
        ``reference`` at it; reference passes then stream it from disk (Note: [Reference without a
        copy] in post/reference.py). A Session from ``from_pretrained`` already has one: its files.

        Args:
            path: the directory to write; None: a temporary one, deleted with the reference.
        Returns:
            the new ``Reference``.
        Example:
            >>> s = Session.from_config(cfg); s.train(sft_data, steps=50); s.freeze_reference()  # doctest: +SKIP
        """
        from .post.reference import snapshot

        self.reference = snapshot(self, path)
        return self.reference

    def report(self, path: str | os.PathLike):
        """Write one standalone HTML page with this run's figures and numbers. See ``report.write_report``."""
        from .view.report import write_report

        return write_report(self, path)

    def save_checkpoint(self, path: str | os.PathLike, *, data_state: dict | None = None):
        """Atomically save the whole training state (weights, Adam moments, step, RNG, data position).

        ``path`` holds the previous checkpoint or the new one at every instant (Note: [Atomic save] in
        host/publish.py); each file's CRC-32 goes into its ``state.json``. See ``host.checkpoint.save_checkpoint``.

        Args:
            path: checkpoint directory; replaced once the new one is complete.
            data_state: JSON-able data position (default: ``self.data_state``).
        Returns:
            The checkpoint directory as a Path.
        Raises:
            ValueError: ``data_state`` is not JSON-able.
            OSError: a full disk or another I/O error, naming ``path`` and the bytes needed; the previous
                checkpoint and this session are untouched (the next step and save work).
        Example:
            >>> s.save_checkpoint("ckpt/run1"); s = Session.resume("ckpt/run1")   # doctest: +SKIP
        """
        from .host.checkpoint import save_checkpoint

        return save_checkpoint(self, path, data_state=data_state)

    @classmethod
    def resume(cls, path: str | os.PathLike, **overrides) -> "Session":
        """A Session continuing exactly where ``save_checkpoint(path)`` left off (bit-identical losses).

        Verifies every file's CRC-32 before allocating anything, and refuses NaN / inf weights or moments
        and a negative second moment; a failed resume closes what it built. See ``host.checkpoint.resume``.

        Args:
            path: a directory written by ``save_checkpoint``.
            **overrides: any Session setting to change (``device="cpu"``, ``lr=1e-4``, ...).
        Returns:
            The Session, with ``data_state`` set.
        Raises:
            FileNotFoundError: ``path`` does not exist (nor ``<path>.old``).
            ValueError: not a checkpoint, or a corrupt one: a file whose checksum or size differs, a malformed
                ``state.json`` field, non-finite values; the message names the file or tensor. Resume an
                earlier checkpoint.
            TypeError: an unknown setting in ``overrides``.
        Example:
            >>> s = Session.resume("ckpt/run1", device="cpu")   # doctest: +SKIP
        """
        from .host.checkpoint import resume

        return resume(path, make=cls, **overrides)

    @one_writer("pretrained")  # data parallel: rank 0 writes (Note: [One writer] in collective_save.py)
    def save_pretrained(self, out_dir: str | os.PathLike, *, dtype: torch.dtype = torch.float32,
                        max_shard_bytes: int = 5 << 30) -> Path:
        """Write an HF directory that ``AutoModelForCausalLM.from_pretrained`` loads (waits for pending updates).

        Shards of at most ``max_shard_bytes``, cast a chunk at a time. Atomic: written beside ``out_dir`` and
        exchanged with it once complete, so ``out_dir`` holds a loadable model (old or new) at every instant;
        its other files (a tokenizer, a checkpoint folder) stay. Under data parallel every rank, or rank 0
        alone, may call it (docs/distributed.md, "Saving").

        Args:
            out_dir: the directory; replaced if it exists.
            dtype: the weights' dtype on disk.
            max_shard_bytes: largest safetensors file.
        Returns:
            ``out_dir`` as a Path.
        Raises:
            OSError: a full disk or another I/O error, naming ``out_dir`` and the bytes needed; ``out_dir``
                keeps its previous contents and the session is usable.
        Example:
            >>> s.save_pretrained("my-model-tuned", dtype=torch.bfloat16)   # doctest: +SKIP
        """
        self.engine.drain()
        self.store.save_pretrained(out_dir, dtype=dtype, max_shard_bytes=max_shard_bytes)
        return Path(out_dir)

    def memory_report(self) -> dict:
        """Host bytes by category and bytes per parameter of the store; ``device_resident`` is the device
        bytes of the units placed there (see ``placement``); ``fp32_moment_params`` the parameters whose Adam
        moments stay fp32 under a compact ``optimizer_state`` (``placement``'s "moments" column says which);
        ``grad`` the gradient slabs' bytes and ``grad_ring`` the ring's, ``gradients`` which holds them and why,
        in words (Note: [Gradient ring] in host/grad_ring.py)."""
        from .view.tables import MemoryReport  # a dict; in a notebook, a table in MiB / GiB

        return MemoryReport({**self.store.bytes_report(),
                             "device_resident": float(self.placement.device_GiB.sum() * 2**30),
                             "fp32_moment_params": self.store.fp32_moment_params(),
                             "gradients": self.store.gradients})

    @property
    def activations(self) -> dict:
        """The last step's activation policy: ``tokens`` per micro-batch it was chosen for, ``kept_layers``
        and ``recomputed_layers``, the recompute ``block`` length, ``parked_inputs`` (blocks whose input
        waited in host RAM), ``device_share`` (of device memory the inputs and cached outputs were placed in:
        0.95 where the inputs fit nowhere at 0.85 or the cache falls short there,
        ``EngineConfig.activation_budget``), ``attention_cached`` (recomputed layers
        whose attention output stayed from the forward, ``EngineConfig.attention_cache``), ``tile_rows`` (0: untiled), ``attention``
        (the SDPA kernel at long context; None: torch's own choice), ``lean`` and why. Empty before a step.

        Example:
            >>> s.step(batch); s.activations["recomputed_layers"]  # doctest: +SKIP
        """
        return self.engine.activation_policy()

    @property
    def placement(self):
        """Where each unit's AdamW and state live, and why (see ``EngineConfig.placement``).

        Returns:
            DataFrame, one row per unit (embedding, layers, head): unit, name, placement ("host",
            "device" or "resident"), params, device_GiB, moments (fp32, or int8 / int4 and which parts stay
            fp32: ``optimizer_state``), reason.
        """
        return self.engine.placement_frame()

    def close(self) -> None:
        self.engine.close()
        self._driver.shutdown(wait=False)

    def __repr__(self) -> str:
        n = self.store.num_params()
        return (f"Session({type(self.arch.model).__name__}, {n / 1e6:.1f}M params, {self.arch.num_layers} layers, "
                f"device={self.engine_cfg.device}, dtype={str(self.engine_cfg.dtype).replace('torch.', '')}, "
                f"steps={self.engine.steps_done})")


def _streams_state(placement) -> bool:
    """Whether some unit may be placed "device" (its master and moments cross PCIe: pin them)."""
    return placement == "stream" or (isinstance(placement, dict) and "device" in placement.values())
