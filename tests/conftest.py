"""Shared fixtures: tiny configs of every supported family, saved HF checkpoints, batches and a plain
reference trainer (the HF model + ``torch.optim.AdamW``) that the streamed Session must match.

Nothing here touches the network: every model is built from a config with a fixed seed and saved
to a temporary directory.
"""
from __future__ import annotations

import faulthandler
from pathlib import Path

import pytest
import torch

FAMILIES = ("llama", "llama_tied", "qwen2", "qwen3", "mistral", "gemma2", "mixtral", "qwen3_moe", "gpt_oss")
VOCAB, HIDDEN, LAYERS, SEQ, BATCH = 96, 32, 2, 12, 2
EAGER_ONLY = ("gemma2", "gpt_oss")  # transformers refuses sdpa for these


def attn_of(family: str) -> str:
    """The attention kernel of configs built here, which the session and the reference then share.

    Note: [Attention kernel] config.json does not carry it, so Session.from_pretrained gets
    transformers' default (sdpa, or eager where sdpa is refused); tests load the reference with
    ``attn_implementation=session.arch.model.config._attn_implementation``.
    """
    return "eager" if family in EAGER_ONLY else "sdpa"


_COMMON = dict(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=64, num_hidden_layers=LAYERS,
               num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)


def _family_kwargs(family: str) -> tuple[str, dict]:
    """(transformers config class name, kwargs) of a tiny model of ``family``."""
    if family in ("llama", "llama_tied"):
        return "LlamaConfig", dict(tie_word_embeddings=family == "llama_tied")
    if family == "qwen2":  # q/k/v biases
        return "Qwen2Config", dict(tie_word_embeddings=False)
    if family == "qwen3":  # q/k norms, explicit head_dim
        return "Qwen3Config", dict(head_dim=8, tie_word_embeddings=False)
    if family == "mistral":  # sliding window shorter than the sequence
        return "MistralConfig", dict(sliding_window=4)
    if family == "gemma2":  # softcaps, query_pre_attn_scalar, alternating sliding/full, scaled embedding
        return "Gemma2Config", dict(head_dim=8, query_pre_attn_scalar=8, sliding_window=4,
                                    final_logit_softcapping=30.0, attn_logit_softcapping=50.0)
    if family == "mixtral":
        return "MixtralConfig", dict(num_local_experts=4, num_experts_per_tok=2, sliding_window=None)
    if family == "qwen3_moe":  # layer 0 dense (mlp_only_layers), layer 1 MoE
        return "Qwen3MoeConfig", dict(head_dim=8, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                                      decoder_sparse_step=1, mlp_only_layers=[0], norm_topk_prob=True)
    if family == "gpt_oss":  # attention sinks and biases, expert biases, alternating sliding/full
        rope = dict(rope_type="yarn", factor=4.0, beta_fast=32.0, beta_slow=1.0, truncate=False,
                    original_max_position_embeddings=16, rope_theta=150000.0)  # 16 * 4 = max_position_embeddings
        return "GptOssConfig", dict(head_dim=8, num_local_experts=4, num_experts_per_tok=2, sliding_window=4,
                                    intermediate_size=32, rope_parameters=rope)
    raise KeyError(f"unknown family {family!r}; known: {FAMILIES}")


def make_config(family: str, **overrides):
    """A tiny transformers config of ``family`` (hidden 32, 2 layers, vocab 96), attention ``attn_of(family)``."""
    import transformers

    cls_name, kw = _family_kwargs(family)
    cls = getattr(transformers, cls_name, None)
    if cls is None:
        pytest.skip(f"transformers {transformers.__version__} has no {cls_name}")
    cfg = cls(**{**_COMMON, **kw, **overrides})
    cfg._attn_implementation = attn_of(family)
    return cfg


def make_batches(vocab: int, n: int, *, batch: int = BATCH, seq: int = SEQ, seed: int = 1,
                 pad_id: int | None = None) -> list[dict]:
    """``n`` random batches; with ``pad_id`` row 0 is left-padded (mask 0, labels -100, id ``pad_id``)."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for k in range(n):
        ids = torch.randint(0, vocab, (batch, seq), generator=g)
        labels = ids.clone()
        b = {"input_ids": ids, "labels": labels}
        if pad_id is not None:
            mask = torch.ones(batch, seq, dtype=torch.long)
            npad = 3 + k % 2  # varies per step
            mask[0, :npad] = 0
            ids[0, :npad] = pad_id
            labels[0, :npad] = -100
            b["attention_mask"] = mask
        out.append(b)
    return out


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    """||a - b|| / ||b|| in float64 (0 when both are zero)."""
    a, b = a.double(), b.double()
    nb = b.norm().item()
    d = (a - b).norm().item()
    return d if nb == 0 else d / nb


def rel_scalar(a: float, b: float) -> float:
    return abs(a - b) / max(abs(b), 1e-30)


def load_reference(path: Path, attn: str, experts: str | None = None):
    """The HF model of ``path`` in fp32 with attention ``attn`` and, for MoE models, experts ``experts``
    (None: transformers' default)."""
    from transformers import AutoModelForCausalLM

    kw = {} if experts is None else {"experts_implementation": experts}
    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32, attn_implementation=attn, **kw)
    model.train()  # dropout is 0 in every tiny config; train() only matches the session's mode
    return model


def train_reference(model, batches: list[dict], *, lr: float, betas: tuple, eps: float, weight_decay: float,
                    grad_clip: float | None = None, schedule=None) -> tuple[list[float], list[float], list[float]]:
    """The plain loop: forward with labels, backward, clip_grad_norm_, torch.optim.AdamW, scheduler.

    Args:
        schedule: None (constant lr) or a function optimizer -> transformers LR scheduler.
    Returns:
        (losses, pre-clip gradient norms (only with grad_clip), lr each step used).
    """
    from transformers import get_constant_schedule

    opt = torch.optim.AdamW(model.parameters(), lr=lr, betas=betas, eps=eps, weight_decay=weight_decay)
    sched = schedule(opt) if schedule is not None else get_constant_schedule(opt)
    losses, norms, lrs = [], [], []
    for b in batches:
        out = model(**b)
        out.loss.backward()
        if grad_clip is not None:
            norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip)))
        lrs.append(opt.param_groups[0]["lr"])
        opt.step()
        opt.zero_grad(set_to_none=True)
        sched.step()
        losses.append(out.loss.item())
    return losses, norms, lrs


def weight_diffs(session_dir: Path, reference) -> dict[str, float]:
    """Per-tensor rel diff of the session's saved weights, loaded by transformers, vs the reference's."""
    from transformers import AutoModelForCausalLM

    saved = AutoModelForCausalLM.from_pretrained(str(session_dir), dtype=torch.float32)
    ref_sd = reference.state_dict()
    sd = saved.state_dict()
    assert set(sd) == set(ref_sd), f"saved keys differ: {sorted(set(sd) ^ set(ref_sd))[:6]}"
    return {k: rel(sd[k], ref_sd[k]) for k in ref_sd}


# ---- the largest differences seen per family, printed at the end of the run -----------------
_SUMMARY: dict[str, dict[str, float]] = {}


def record(family: str, loss_diff: float, weight_diff: float, noise_gap: float = 0.0) -> None:
    """Keep the largest loss / weight rel diffs (and abs gap of noise-only tensors) seen for ``family``."""
    row = _SUMMARY.setdefault(family, {"loss": 0.0, "weight": 0.0, "noise": 0.0, "runs": 0})
    row["loss"] = max(row["loss"], loss_diff)
    row["weight"] = max(row["weight"], weight_diff)
    row["noise"] = max(row["noise"], noise_gap)
    row["runs"] += 1


def pytest_terminal_summary(terminalreporter):
    if not _SUMMARY:
        return
    tr = terminalreporter
    tr.section("streamed vs plain HF + AdamW: largest rel diffs")
    tr.write_line(f"{'family':<12} {'runs':>4} {'max loss rel':>14} {'max weight rel':>15} {'k_proj.bias abs':>16}")
    for fam in FAMILIES:
        if fam in _SUMMARY:
            r = _SUMMARY[fam]
            noise = f"{r['noise']:>16.2e}" if r["noise"] else f"{'-':>16}"
            tr.write_line(f"{fam:<12} {r['runs']:>4} {r['loss']:>14.2e} {r['weight']:>15.2e} {noise}")


# ---- parametrization ----------------------------------------------------------------------------
def families(*names: str) -> list:
    """pytest params for ``names`` (default: every family); known failures get their xfail marks here."""
    marks: dict[str, list] = {}
    return [pytest.param(f, marks=marks.get(f, []), id=f) for f in (names or FAMILIES)]


def train_session(session, batches: list[dict]) -> list[float]:
    """``session.step`` each batch, back to back (no drain: the next step must wait for the previous
    step's updates by itself); returns the losses."""
    return [session.step(b).loss for b in batches]


@pytest.fixture(autouse=True)
def _watchdog():
    """A deadlocked step must not hang the suite: dump every thread's stack and exit after 120 s."""
    faulthandler.dump_traceback_later(120, exit=True)
    yield
    faulthandler.cancel_dump_traceback_later()


# ---- fixtures ---------------------------------------------------------------------------------
@pytest.fixture(params=families())
def family(request) -> str:
    """Every family in turn; override with ``@pytest.mark.parametrize("family", [...])``."""
    return request.param


@pytest.fixture
def tiny_config():
    """``tiny_config(family, **overrides)`` -> transformers config (see ``make_config``)."""
    return make_config


@pytest.fixture(scope="session")
def hf_dir(tmp_path_factory):
    """``hf_dir(family, seed=0, max_shard_size=None, **overrides)`` -> directory of a saved HF model.

    The model is built from ``make_config`` under ``torch.manual_seed(seed)`` and written with
    ``save_pretrained`` (safetensors). Directories are cached for the session: treat them as read-only.
    """
    from transformers import AutoModelForCausalLM

    cache: dict = {}

    def build(family: str, seed: int = 0, max_shard_size: str | None = None, **overrides) -> Path:
        key = (family, seed, max_shard_size, repr(sorted(overrides.items())))
        if key not in cache:
            cfg = make_config(family, **overrides)
            torch.manual_seed(seed)
            model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
            d = tmp_path_factory.mktemp(f"{family}-s{seed}")
            kw = {} if max_shard_size is None else {"max_shard_size": max_shard_size}
            model.save_pretrained(str(d), **kw)
            cache[key] = d
        return cache[key]

    return build


def _rank_main(fn, *args) -> None:
    """A spawned rank: ``fn(*args)``, then its process group left, so that gloo's threads end before the
    interpreter does (a rank that exited with the group alive once aborted: "terminate called without an
    active exception")."""
    try:
        fn(*args)
    finally:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            dist.destroy_process_group()


def spawn_ranks(fn, world: int, tmp, *args, timeout_s: float = 300) -> list[int]:
    """Start ``world`` processes of fn(rank, world, tmp, *args) (spawn: a fresh interpreter each); join
    them by a shared deadline, ending any still alive after it; returns their exit codes."""
    import multiprocessing as mp
    import time

    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=_rank_main, args=(fn, r, world, tmp, *args)) for r in range(world)]
    for p in procs:
        p.start()
    deadline = time.monotonic() + timeout_s
    for p in procs:
        p.join(max(1, deadline - time.monotonic()))
    codes = []
    for p in procs:
        if p.is_alive():
            p.terminate()  # our own child, by its handle
            p.join()
        codes.append(p.exitcode)
    return codes


@pytest.fixture
def sigint_raises():
    """SIGINT raises KeyboardInterrupt in the main thread during the test, as in Jupyter and a terminal.

    A launcher that starts Python in the background (``cmd &`` in a non-interactive shell) leaves
    SIGINT ignored, and Python then installs no handler: interrupts would never arrive."""
    import signal

    old = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, old)
