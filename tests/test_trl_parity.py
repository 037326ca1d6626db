"""post.losses against TRL's own loss code on the same log-probs: values, gradients and metrics.

TRL's losses live inside trainer methods (``GRPOTrainer._compute_loss``, ``DPOTrainer._compute_loss``,
``KTOTrainer._compute_loss``). Each is called unbound on a stub holding the attributes the method
reads, set from TRL's own config dataclass as the trainer's ``__init__`` sets them, with the model
replaced by a callable returning the given per-token log-probs. Nothing of TRL's formulas is copied
here. The differences each loss's docstring states (micro-batch normalizations, KTO's reference
point, DPO's label smoothing) are asserted as differences, so a docstring that goes stale fails.

Needs ``trl`` (the dev extra pins 1.16.0, the version the docstrings name) with ``accelerate`` and ``datasets``; skips
without them.
"""
import inspect
import types
import warnings
from collections import defaultdict

import pytest
import torch

trl = pytest.importorskip("trl", minversion="1.16")
grpo_trainer = pytest.importorskip("trl.trainer.grpo_trainer")  # imports accelerate and datasets
dpo_trainer = pytest.importorskip("trl.trainer.dpo_trainer")
kto_trainer = pytest.importorskip("trl.trainer.kto_trainer")
from trl.trainer.utils import nanstd  # noqa: E402  (after the skips)

from megatrain_nb.post import losses  # noqa: E402
from megatrain_nb.post.losses import LossContext  # noqa: E402

TOL = 2e-6  # fp32 throughout; the two sides sum in different orders


class _Accelerator:
    """One process: every gather and reduce is the identity."""
    num_processes = 1
    device = torch.device("cpu")

    def gather(self, x):
        return x

    gather_for_metrics = gather

    def reduce(self, x, reduction="sum"):
        return x


def _config(cls, **overrides):
    """TRL's own config with its defaults; nothing is written (no trainer is built)."""
    with warnings.catch_warnings():  # transformers' deprecation notes on TrainingArguments
        warnings.simplefilter("ignore", FutureWarning)
        return cls(output_dir="unused-trl-output", report_to="none", use_cpu=True, **overrides)


def _model_returning(log_probs):
    """A stand-in for TRL's model call with ``fused_lm_head=True``: its per-token log-probs, (B, T-1)."""
    def model(**kwargs):
        lp = log_probs
        zeros = torch.zeros_like(lp.detach())
        return types.SimpleNamespace(log_probs=lp, entropy=zeros, mean_logits=zeros, is_top1=zeros.bool(),
                                     aux_loss=None)
    return model


def _close(got, want):
    torch.testing.assert_close(torch.as_tensor(got, dtype=torch.float64),
                               torch.as_tensor(want, dtype=torch.float64), atol=TOL, rtol=0)


# ---- GRPO ------------------------------------------------------------------------------------
P, C = 3, 6  # prompt and completion lengths


def _grpo_data(B, seed):
    g = torch.Generator().manual_seed(seed)
    cmask = (torch.rand(B, C, generator=g) < 0.75).long()
    cmask[:, 0] = 1  # every completion at least one token
    lp = -torch.rand(B, C, generator=g) * 3
    return {"cmask": cmask, "lp": lp, "old": lp + 0.3 * torch.randn(B, C, generator=g),
            "ref": lp - 0.4 * torch.randn(B, C, generator=g), "adv": torch.randn(B, generator=g),
            "ids": torch.randint(1, 50, (B, P + C), generator=g)}


def _grpo_stub(per_token_logps, *, n_micro=1, **config):
    args = _config(grpo_trainer.GRPOConfig, steps_per_generation=n_micro, **config)
    return types.SimpleNamespace(
        args=args, beta=args.beta, loss_type=args.loss_type, epsilon_low=args.epsilon,
        epsilon_high=args.epsilon if args.epsilon_high is None else args.epsilon_high,
        importance_sampling_level=args.importance_sampling_level, top_entropy_quantile=args.top_entropy_quantile,
        off_policy_mask_threshold=args.off_policy_mask_threshold, max_completion_length=args.max_completion_length,
        use_vllm=False, vllm_importance_sampling_correction=args.vllm_importance_sampling_correction,
        _entropy_bonus_enabled=False, aux_loss_enabled=False, model=types.SimpleNamespace(training=True),
        current_gradient_accumulation_steps=n_micro, accelerator=_Accelerator(),
        _metrics=defaultdict(lambda: defaultdict(list)),
        _get_per_token_logps_and_entropies=lambda *a, **k: (per_token_logps, torch.zeros_like(per_token_logps), None))


def _trl_grpo(x, d, rows, *, off_policy, n_micro=1, total_tokens=None, **config):
    """TRL's GRPO loss of micro-batch ``rows`` with completion log-probs ``x[rows]``; (loss, stub)."""
    s = _grpo_stub(x[rows], n_micro=n_micro, **config)
    cm = d["cmask"][rows]
    inputs = {"prompt_ids": d["ids"][rows, :P], "prompt_mask": torch.ones_like(d["ids"][rows, :P]),
              "completion_ids": d["ids"][rows, P:], "completion_mask": cm, "advantages": d["adv"][rows],
              "ref_per_token_logps": d["ref"][rows],
              "num_items_in_batch": torch.tensor(float(total_tokens if total_tokens is not None else cm.sum()))}
    if off_policy:
        inputs["old_per_token_logps"] = d["old"][rows]
    return grpo_trainer.GRPOTrainer._compute_loss(s, None, inputs), s


def _ours_batch(d, rows, off_policy):
    """Our layout of the same rows: the prompt's P positions first (label -100), then the completion."""
    cm = d["cmask"][rows].bool()
    n = cm.shape[0]
    labels = torch.cat([torch.full((n, P), -100), d["ids"][rows, P:].masked_fill(~cm, -100)], 1)
    pad = torch.zeros(n, P)
    out = {"labels": labels, "advantages": d["adv"][rows], "ref_logp": torch.cat([pad, d["ref"][rows]], 1)}
    if off_policy:
        out["old_logp"] = torch.cat([pad, d["old"][rows]], 1)
    return out


def _ours_logp(x, rows):
    return torch.cat([torch.zeros(x[rows].shape[0], P), x[rows]], 1)


GRPO_CASES = [(lt, beta, w, off) for lt in losses.LOSS_TYPES for beta in (0.0, 0.04)
              for w in ((True, False) if beta else (True,)) for off in (False, True)]


GRPO_IDS = [f"{lt}-beta{b}-{'w' if w else 'unw'}-{'old' if o else 'on'}" for lt, b, w, o in GRPO_CASES]


@pytest.mark.parametrize("loss_type, beta, weighted, off_policy", GRPO_CASES, ids=GRPO_IDS)
def test_grpo_equals_trl_on_one_micro_batch(loss_type, beta, weighted, off_policy):
    B = 6
    d = _grpo_data(B, seed=1)
    eps_high = 0.28 if off_policy else None
    rows = slice(None)
    x_trl, x_ours = d["lp"].clone().requires_grad_(True), d["lp"].clone().requires_grad_(True)
    want, stub = _trl_grpo(x_trl, d, rows, off_policy=off_policy, beta=beta, loss_type=loss_type,
                           epsilon_high=eps_high, use_bias_correction_kl=weighted, max_completion_length=C)
    batch = _ours_batch(d, rows, off_policy)
    ctx = LossContext.from_batches([batch], max_completion_length=C)
    got = losses.grpo(_ours_logp(x_ours, rows), batch, ctx, beta=beta, loss_type=loss_type, epsilon_high=eps_high,
                      kl_ratio_weighted=weighted)
    _close(got, want)
    want.backward()
    got.backward()
    assert x_trl.grad.abs().max() > 1e-3
    _close(x_ours.grad, x_trl.grad)
    trl_metrics = stub._metrics["train"]
    names = ["clip_ratio/low_mean", "clip_ratio/high_mean", "clip_ratio/region_mean"] + (["kl"] if beta else [])
    for name in names:
        _close(ctx.metrics[name], trl_metrics[name][0])
    if off_policy:
        assert float(ctx.metrics["clip_ratio/region_mean"]) > 0  # the clipping paths are exercised


def test_trl_weights_the_kl_by_default_and_so_do_we():
    assert grpo_trainer.GRPOConfig.__dataclass_fields__["use_bias_correction_kl"].default is True
    d = _grpo_data(4, seed=2)
    x = [d["lp"].clone().requires_grad_(True) for _ in range(3)]
    batch = _ours_batch(d, slice(None), False)
    ctx = LossContext.from_batches([batch])
    want, _ = _trl_grpo(x[0], d, slice(None), off_policy=False, beta=0.1, loss_type="grpo")  # TRL's default
    ours_default = losses.grpo(_ours_logp(x[1], slice(None)), batch, ctx, beta=0.1)
    unweighted = losses.grpo(_ours_logp(x[2], slice(None)), batch, ctx, beta=0.1, kl_ratio_weighted=False)
    for t in (want, ours_default, unweighted):
        t.backward()
    _close(x[1].grad, x[0].grad)
    assert (x[2].grad - x[0].grad).abs().max() > 1e-3  # on-policy, the weight changes the gradient only


MICRO = (slice(0, 4), slice(4, 8))  # two micro-batches of 4 rows, with different token counts


@pytest.mark.parametrize("loss_type", ["grpo", "dr_grpo", "dapo"])
def test_grpo_over_micro_batches_of_equal_rows_equals_trl_accumulated(loss_type):
    d = _grpo_data(8, seed=3)
    assert int(d["cmask"][MICRO[0]].sum()) != int(d["cmask"][MICRO[1]].sum())
    total = int(d["cmask"].sum())
    x_trl, x_ours = d["lp"].clone().requires_grad_(True), d["lp"].clone().requires_grad_(True)
    ctx = LossContext.from_batches([_ours_batch(d, r, True) for r in MICRO], max_completion_length=C)
    want = sum(_trl_grpo(x_trl, d, r, off_policy=True, n_micro=2, total_tokens=total, beta=0.04,
                         loss_type=loss_type, epsilon_high=0.28, max_completion_length=C)[0] for r in MICRO)
    got = sum(losses.grpo(_ours_logp(x_ours, r), _ours_batch(d, r, True), ctx, beta=0.04, loss_type=loss_type,
                          epsilon_high=0.28) for r in MICRO)
    _close(got, want)
    want.backward()
    got.backward()
    _close(x_ours.grad, x_trl.grad)


def test_our_bnpo_is_trls_dapo_and_not_its_bnpo_when_micro_batches_differ_in_tokens():
    d = _grpo_data(8, seed=3)
    total = int(d["cmask"].sum())
    ctx = LossContext.from_batches([_ours_batch(d, r, True) for r in MICRO])

    def trl(loss_type):
        return sum(_trl_grpo(d["lp"], d, r, off_policy=True, n_micro=2, total_tokens=total,
                             loss_type=loss_type)[0] for r in MICRO)
    ours = sum(losses.grpo(_ours_logp(d["lp"], r), _ours_batch(d, r, True), ctx, loss_type="bnpo") for r in MICRO)
    _close(ours, trl("dapo"))
    assert abs(float(ours) - float(trl("bnpo"))) > 1e-4


@pytest.mark.parametrize("group_size", [2, 4])
def test_group_advantages_use_trls_std(group_size):
    r = torch.randn(16, generator=torch.Generator().manual_seed(4))
    std = nanstd(r.view(-1, group_size), dim=1).repeat_interleave(group_size)  # TRL's unbiased std
    mean = r.view(-1, group_size).mean(1).repeat_interleave(group_size)
    _close(losses.group_advantages(r, group_size), (r - mean) / (std + 1e-4))


# ---- DPO -------------------------------------------------------------------------------------
T = 8


def _dpo_data(pairs, seed):
    g = torch.Generator().manual_seed(seed)
    B = 2 * pairs
    cmask = torch.zeros(B, T, dtype=torch.long)
    for b in range(B):
        start = int(torch.randint(1, 4, (1,), generator=g))
        end = int(torch.randint(start + 1, T + 1, (1,), generator=g))
        cmask[b, start:end] = 1
    return {"cmask": cmask, "ids": torch.randint(1, 50, (B, T), generator=g),
            "lp": -torch.rand(B, T - 1, generator=g) * 3, "ref": -torch.rand(B, generator=g) * 3 - 2}


def _trl_dpo(x, d, **config):
    """TRL's DPO loss; TRL's rows: the chosen half, then the rejected half."""
    args = _config(dpo_trainer.DPOConfig, precompute_ref_log_probs=True, **config)
    s = types.SimpleNamespace(
        args=args, beta=args.beta, precompute_ref_logps=args.precompute_ref_log_probs, loss_types=args.loss_type,
        loss_weights=args.loss_weights or [1.0] * len(args.loss_type), ld_alpha=args.ld_alpha,
        f_divergence_type=args.f_divergence_type, f_alpha_divergence_coef=args.f_alpha_divergence_coef,
        label_smoothing=args.label_smoothing, use_weighting=args.use_weighting, aux_loss_enabled=False,
        model=types.SimpleNamespace(training=True), accelerator=_Accelerator(), _tp_size=1, _total_train_tokens=0,
        _metrics=defaultdict(lambda: defaultdict(list)))
    shift = d["cmask"][:, 1:].float()
    n = d["cmask"].shape[0] // 2
    inputs = {"input_ids": d["ids"], "attention_mask": torch.ones_like(d["ids"]), "completion_mask": d["cmask"],
              "ref_chosen_logps": d["ref"][:n], "ref_rejected_logps": d["ref"][n:]}
    loss = dpo_trainer.DPOTrainer._compute_loss(s, _model_returning(x * shift), inputs, False)
    return loss, s._metrics["train"]


def _ours_dpo_batch(x, d):
    """Our layout: pair k's chosen row at 2k, its rejected at 2k + 1; logp (B, T) with column 0 empty."""
    B = d["cmask"].shape[0]
    order = torch.stack([torch.arange(B // 2), torch.arange(B // 2) + B // 2], 1).view(-1)
    on = d["cmask"][order].bool()
    on[:, 0] = False
    logp = torch.cat([torch.zeros(B, 1), x[order]], 1)
    return logp, {"labels": d["ids"][order].masked_fill(~on, -100), "ref_logps": d["ref"][order],
                  "pair": torch.arange(B) // 2}


def test_dpo_equals_trl_sigmoid():
    d = _dpo_data(pairs=4, seed=5)
    x_trl, x_ours = d["lp"].clone().requires_grad_(True), d["lp"].clone().requires_grad_(True)
    want, metrics = _trl_dpo(x_trl, d, beta=0.3)
    logp, batch = _ours_dpo_batch(x_ours, d)
    ctx = LossContext.from_batches([batch])
    got = losses.dpo(logp, batch, ctx, beta=0.3)
    _close(got, want)
    want.backward()
    got.backward()
    assert x_trl.grad.abs().max() > 1e-3
    _close(x_ours.grad, x_trl.grad)
    for name in ("rewards/chosen", "rewards/rejected", "rewards/margins", "rewards/accuracies", "logps/chosen",
                 "logps/rejected"):
        _close(ctx.metrics[name], metrics[name][0])


def test_trl_sigmoid_ignores_label_smoothing_and_ours_is_conservative_dpo():
    d = _dpo_data(pairs=4, seed=6)
    trl_smoothed, _ = _trl_dpo(d["lp"], d, beta=0.3, label_smoothing=0.2)
    logp, batch = _ours_dpo_batch(d["lp"], d)
    ctx = LossContext.from_batches([batch])
    _close(losses.dpo(logp, batch, ctx, beta=0.3), trl_smoothed)  # TRL 1.16: the smoothing has no effect
    ours_smoothed = losses.dpo(logp, batch, ctx, beta=0.3, label_smoothing=0.2)
    assert abs(float(ours_smoothed) - float(trl_smoothed)) > 1e-3


def test_dpo_defaults_are_trls():
    f = dpo_trainer.DPOConfig.__dataclass_fields__
    assert f["beta"].default == 0.1 and f["label_smoothing"].default == 0.0
    assert f["loss_type"].default_factory() == ["sigmoid"]
    sig = inspect.signature(losses.dpo).parameters
    assert sig["beta"].default == f["beta"].default and sig["label_smoothing"].default == f["label_smoothing"].default


# ---- KTO -------------------------------------------------------------------------------------
def _trl_kto(x, d, rows, kl_logps, **config):
    args = _config(kto_trainer.KTOConfig, precompute_ref_log_probs=True, **config)
    s = types.SimpleNamespace(
        args=args, beta=args.beta, loss_type=args.loss_type, desirable_weight=args.desirable_weight,
        undesirable_weight=args.undesirable_weight, precompute_ref_logps=True, calculate_KL=True,
        aux_loss_enabled=False, model=types.SimpleNamespace(training=True), accelerator=_Accelerator(), _tp_size=1,
        _total_train_tokens=0, _metrics=defaultdict(lambda: defaultdict(list)),
        _compute_kl_logps=lambda model, batch: kl_logps[rows])
    shift = d["cmask"][rows, 1:].float()
    inputs = {"input_ids": d["ids"][rows], "attention_mask": torch.ones_like(d["ids"][rows]),
              "completion_mask": d["cmask"][rows], "label": d["good"][rows], "ref_logps": d["ref"][rows],
              "ref_KL_logps": d["ref_kl"][rows]}
    loss = kto_trainer.KTOTrainer._compute_loss(s, _model_returning(x[rows] * shift), inputs, False)
    return loss, s._metrics["train"]


def _kto_data(B, seed):
    d = _dpo_data(B // 2, seed)
    g = torch.Generator().manual_seed(seed + 100)
    d["good"] = torch.tensor([True, False] * (B // 2))[torch.randperm(B, generator=g)]
    d["kl_logps"] = -torch.rand(B, generator=g) * 3
    d["ref_kl"] = d["kl_logps"] - 0.5 * torch.rand(B, generator=g)  # a positive KL estimate
    return d


def _ours_kto(x, d, rows, kl, ctx):
    on = d["cmask"][rows].bool()
    on[:, 0] = False
    logp = torch.cat([torch.zeros(on.shape[0], 1), x[rows]], 1)
    batch = {"labels": d["ids"][rows].masked_fill(~on, -100), "ref_logps": d["ref"][rows],
             "desirable": d["good"][rows], "kl": kl}
    return losses.kto(logp, batch, ctx, beta=0.4, desirable_weight=1.0, undesirable_weight=1.3)


def _labels_of(d, rows):
    return {"labels": d["ids"][rows].masked_fill(~d["cmask"][rows].bool(), -100)}


def test_kto_equals_trl_on_one_micro_batch():
    d = _kto_data(8, seed=7)
    rows = slice(None)
    x_trl, x_ours = d["lp"].clone().requires_grad_(True), d["lp"].clone().requires_grad_(True)
    want, metrics = _trl_kto(x_trl, d, rows, d["kl_logps"], beta=0.4, undesirable_weight=1.3)
    ctx = LossContext.from_batches([_labels_of(d, rows)])
    got = _ours_kto(x_ours, d, rows, (d["kl_logps"] - d["ref_kl"]).mean(), ctx)  # TRL's estimate, our field
    _close(got, want)
    want.backward()
    got.backward()
    assert x_trl.grad.abs().max() > 1e-3
    _close(x_ours.grad, x_trl.grad)
    _close(ctx.metrics["kl"], metrics["kl"][0])
    _close(ctx.metrics["rewards/chosen_sum"] / ctx.metrics["count/chosen"], metrics["rewards/chosen"][0])
    _close(ctx.metrics["rewards/rejected_sum"] / ctx.metrics["count/rejected"], metrics["rewards/rejected"][0])


def test_kto_reference_point_is_the_steps_where_trls_is_each_micro_batchs():
    d = _kto_data(8, seed=8)
    micro = (slice(0, 4), slice(4, 8))
    per_micro = [float((d["kl_logps"][r] - d["ref_kl"][r]).mean()) for r in micro]
    assert abs(per_micro[0] - per_micro[1]) > 1e-2
    ctx = LossContext.from_batches([_labels_of(d, r) for r in micro])
    trl_accumulated = sum(_trl_kto(d["lp"], d, r, d["kl_logps"], beta=0.4, undesirable_weight=1.3)[0]
                          for r in micro) / 2  # HF Trainer's mean over the accumulated micro-batches
    with_trls_points = sum(_ours_kto(d["lp"], d, r, z, ctx) for r, z in zip(micro, per_micro))
    with_the_steps = sum(_ours_kto(d["lp"], d, r, sum(per_micro) / 2, ctx) for r in micro)
    _close(with_trls_points, trl_accumulated)  # each micro-batch given TRL's own point: the same loss
    assert abs(float(with_the_steps) - float(trl_accumulated)) > 1e-5  # ours, one point per step: not


# ---- defaults ------------------------------------------------------------------------------
def test_grpo_and_kto_defaults_against_trls():
    g, k = grpo_trainer.GRPOConfig.__dataclass_fields__, kto_trainer.KTOConfig.__dataclass_fields__
    ours = inspect.signature(losses.grpo).parameters
    assert ours["beta"].default == g["beta"].default == 0.0
    assert ours["epsilon"].default == g["epsilon"].default == 0.2
    assert ours["epsilon_high"].default is g["epsilon_high"].default is None
    assert ours["kl_ratio_weighted"].default is g["use_bias_correction_kl"].default is True
    assert (ours["loss_type"].default, g["loss_type"].default) == ("grpo", "dapo")  # a stated difference
    assert inspect.signature(losses.group_advantages).parameters["scale"].default is True
    assert g["scale_rewards"].default == "group"
    ko = inspect.signature(losses.kto).parameters
    for name in ("beta", "desirable_weight", "undesirable_weight"):
        assert ko[name].default == k[name].default
