"""megatrain_nb.losses against hand-written loops: values and autograd gradients, micro-batch and rank
additivity over the step's global counts, metrics, group advantages against numpy, and errors."""
import functools
import math

import numpy as np
import pytest
import torch

from megatrain_nb.post import losses
from megatrain_nb.post.losses import LossContext

B, T, TOL = 8, 7, 1e-6
SPLITS = ((0, 2), (2, 6), (6, 8))  # micro-batches of 2, 4 and 2 rows: pairs and groups of 2 kept whole


def _data(seed: int = 0) -> dict:
    """A batch honouring the engine's contract: logp 0 where no label and at t = 0, every row supervised."""
    g = torch.Generator().manual_seed(seed)
    labels = torch.randint(1, 50, (B, T), generator=g)
    labels[torch.rand(B, T, generator=g) < 0.3] = -100
    labels[:, 0] = -100 if seed % 2 else 7  # a label at t = 0 has no log-prob and must not count
    labels[:, -1] = 3  # at least one supervised token per row
    on = labels != -100
    on[:, 0] = False
    logp = torch.where(on, -torch.rand(B, T, generator=g) * 3, 0.0)
    return {"logp": logp, "labels": labels, "on": on,
            "ref_logp": torch.where(on, logp - 0.3 * torch.randn(B, T, generator=g), 0.0),
            "old_logp": torch.where(on, logp + 0.25 * torch.randn(B, T, generator=g), 0.0),
            "advantages": torch.randn(B, generator=g), "desirable": torch.rand(B, generator=g) < 0.5,
            "pair": torch.arange(B) // 2}


def _grad(loss_fn, logp):
    x = logp.clone().requires_grad_(True)
    loss = loss_fn(x)
    return loss.detach(), torch.autograd.grad(loss, x)[0]


def _assert_close(got, want):
    (gv, gg), (wv, wg) = got, want
    torch.testing.assert_close(gv.double(), wv.double(), atol=TOL, rtol=0)
    torch.testing.assert_close(gg.double(), wg.double(), atol=TOL, rtol=0)


def _tokens(d, b):
    return [t for t in range(T) if d["on"][b, t]]


# ---- references: plain loops in float64 ------------------------------------------------------
def ref_sft(lp, d):
    terms = [lp[b, t] for b in range(B) for t in _tokens(d, b)]
    return -sum(terms) / len(terms)


def ref_dpo(lp, d, beta, ls, per_token_ref):
    out = 0
    for k in range(B // 2):
        c, r = 2 * k, 2 * k + 1
        pc, pr = (sum(lp[b, t] for t in _tokens(d, b)) for b in (c, r))
        if per_token_ref:
            rc, rr = (sum(float(d["ref_logp"][b, t]) for t in _tokens(d, b)) for b in (c, r))
        else:
            rc, rr = float(d["ref_logps"][c]), float(d["ref_logps"][r])
        h = beta * ((pc - rc) - (pr - rr))
        sig = 1 / (1 + torch.exp(-h))
        out = out - (1 - ls) * torch.log(sig) - ls * torch.log(1 - sig)
    return out / (B // 2)


def ref_grpo(lp, d, eps, eps_high, beta, loss_type, weighted=True, max_len=10):
    rows, n, old = [], 0, d.get("old_logp")
    for b in range(B):
        a, terms = float(d["advantages"][b]), []
        for t in _tokens(d, b):
            o = lp[b, t].detach() if old is None else float(old[b, t])
            ratio = torch.exp(lp[b, t] - o)
            clipped = torch.clamp(ratio, 1 - eps, 1 + (eps if eps_high is None else eps_high))
            term = -torch.minimum(ratio * a, clipped * a)
            if beta:
                x = float(d["ref_logp"][b, t]) - lp[b, t]
                term = term + beta * (torch.exp(x) - x - 1) * (ratio if weighted else 1.0)
            terms.append(term)
        rows.append(terms)
        n += len(terms)
    if loss_type == "grpo":
        return sum(sum(r) / len(r) for r in rows) / B
    total = sum(sum(r) for r in rows)
    return total / (B * max_len) if loss_type == "dr_grpo" else total / n


def ref_kto(lp, d, beta, wd, wu):
    z, out = max(float(d["kl"]), 0.0), 0
    for b in range(B):
        r = sum(lp[b, t] for t in _tokens(d, b)) - float(d["ref_logps"][b])
        if d["desirable"][b]:
            out = out + wd * (1 - torch.sigmoid(beta * (r - z)))
        else:
            out = out + wu * (1 - torch.sigmoid(beta * (z - r)))
    return out / B


# ---- the cases: (name, loss fn, reference, extra batch fields) -------------------------------
def _cases():
    yield "sft", losses.sft, lambda lp, d: ref_sft(lp, d)
    for ls in (0.0, 0.1):
        for per_token in (False, True):
            yield (f"dpo-ls{ls}-{'ref_logp' if per_token else 'ref_logps'}",
                   functools.partial(losses.dpo, beta=0.2, label_smoothing=ls),
                   functools.partial(ref_dpo, beta=0.2, ls=ls, per_token_ref=per_token))
    for lt in losses.LOSS_TYPES:
        for beta, weighted in ((0.0, True), (0.04, True), (0.04, False)):
            for off_policy in (False, True):
                eps_high = 0.28 if off_policy else None
                yield (f"grpo-{lt}-beta{beta}{'' if weighted else '-unweighted'}-{'old' if off_policy else 'onpolicy'}",
                       functools.partial(losses.grpo, epsilon=0.2, epsilon_high=eps_high, beta=beta, loss_type=lt,
                                         kl_ratio_weighted=weighted),
                       functools.partial(ref_grpo, eps=0.2, eps_high=eps_high, beta=beta, loss_type=lt,
                                         weighted=weighted))
    for kl in (0.3, -0.2):  # a negative estimate is clamped to 0
        yield f"kto-kl{kl}", functools.partial(losses.kto, beta=0.5, desirable_weight=1.0, undesirable_weight=1.3), \
            functools.partial(ref_kto, beta=0.5, wd=1.0, wu=1.3)


CASES = list(_cases())


def _batch(d, name, rows=slice(None)):
    """The fields the loss reads, for ``rows``."""
    out = {"labels": d["labels"][rows], "pair": d["pair"][rows], "advantages": d["advantages"][rows],
           "desirable": d["desirable"][rows], "ref_logp": d["ref_logp"][rows]}
    if not name.endswith("-ref_logp"):  # dpo-...-ref_logp: the per-token field only
        out["ref_logps"] = (d["ref_logp"] * d["on"]).sum(-1)[rows] + 0.1
    if "-old" in name:
        out["old_logp"] = d["old_logp"][rows]
    if name.startswith("kto"):
        out["kl"] = float(name.split("kl")[1])
    return out


def _reference(name, ref, d, lp):
    dd = {**d, **_batch(d, name)}
    if "old_logp" not in _batch(d, name):
        del dd["old_logp"]
    return ref(lp, dd)


@pytest.mark.parametrize("name, fn, ref", CASES, ids=[c[0] for c in CASES])
@pytest.mark.parametrize("seed", [0, 1])
def test_loss_matches_its_formula_and_gradient(name, fn, ref, seed):
    d = _data(seed)
    ctx = LossContext.from_batches([{"labels": d["labels"]}], max_completion_length=10)
    assert ctx.tokens == int(d["on"].sum())
    got = _grad(lambda x: fn(x, _batch(d, name), ctx), d["logp"])
    want = _grad(lambda x: _reference(name, ref, d, x.double()), d["logp"])
    _assert_close(got, want)
    assert got[1].abs().sum() > 0 and (got[1][~d["on"]] == 0).all()  # gradient on supervised tokens only


@pytest.mark.parametrize("name, fn, ref", CASES, ids=[c[0] for c in CASES])
def test_micro_batches_and_ranks_add_up_to_the_whole_batch(name, fn, ref):
    d = _data(3)
    whole_ctx = LossContext.from_batches([{"labels": d["labels"]}], max_completion_length=10)
    whole = _grad(lambda x: fn(x, _batch(d, name), whole_ctx), d["logp"])
    mbs = [slice(a, b) for a, b in SPLITS]
    ctx = LossContext.from_batches([{"labels": d["labels"][s]} for s in mbs], max_completion_length=10)
    assert (ctx.tokens, ctx.sequences) == (whole_ctx.tokens, whole_ctx.sequences)
    _assert_close(_grad(lambda x: sum(fn(x[s], _batch(d, name, s), ctx) for s in mbs), d["logp"]), whole)
    # two data-parallel ranks: rank 0 holds the first micro-batch, rank 1 the others; world sums their counts
    ranks = [mbs[:1], mbs[1:]]
    counts = [[int(d["on"][s].sum()) for s in r] for r in ranks]
    per_rank = [[sum(c), sum(s.stop - s.start for s in r)] for c, r in zip(counts, ranks)]
    world = lambda xs: [sum(col) for col in zip(*per_rank)]  # noqa: E731  (an all-reduce, simulated)
    ctxs = [LossContext.from_batches([{"labels": d["labels"][s]} for s in r], world=world, max_completion_length=10)
            for r in ranks]
    assert all((c.tokens, c.sequences) == (whole_ctx.tokens, whole_ctx.sequences) for c in ctxs)
    summed = lambda x: sum(fn(x[s], _batch(d, name, s), c) for r, c in zip(ranks, ctxs) for s in r)  # noqa: E731
    _assert_close(_grad(summed, d["logp"]), whole)


def test_metrics_add_up_and_say_what_dpo_saw():
    d = _data(0)
    batch = {"labels": d["labels"], "ref_logps": torch.zeros(B), "pair": d["pair"]}
    logp = d["logp"].clone()
    logp[0::2] *= 0.1  # chosen rows far likelier than rejected ones: every pair is right
    whole = LossContext.from_batches([batch])
    losses.dpo(logp, batch, whole)
    ctx = LossContext.from_batches([batch])
    for a, b in SPLITS:
        losses.dpo(logp[a:b], {k: v[a:b] for k, v in batch.items()}, ctx)
    assert set(ctx.metrics) == set(whole.metrics) == {"rewards/chosen", "rewards/rejected", "rewards/margins",
                                                       "rewards/accuracies", "logps/chosen", "logps/rejected"}
    for k in whole.metrics:
        torch.testing.assert_close(ctx.metrics[k], whole.metrics[k], atol=TOL, rtol=0)
    assert float(whole.metrics["rewards/accuracies"]) == 1.0
    seq = (logp * d["on"]).sum(-1)
    torch.testing.assert_close(whole.metrics["rewards/chosen"], 0.1 * seq[0::2].mean())
    torch.testing.assert_close(whole.metrics["rewards/margins"],
                               whole.metrics["rewards/chosen"] - whole.metrics["rewards/rejected"])


def test_grpo_metrics_count_clipped_tokens():
    d = _data(0)
    batch = {"labels": d["labels"], "advantages": torch.ones(B), "old_logp": d["logp"] - 1.0,
             "ref_logp": d["ref_logp"]}  # ratio e > 1.2 everywhere with A > 0: every token clipped high
    ctx = LossContext.from_batches([batch])
    losses.grpo(d["logp"], batch, ctx, beta=0.1)
    assert float(ctx.metrics["clip_ratio/high_mean"]) == pytest.approx(1.0)
    assert float(ctx.metrics["clip_ratio/low_mean"]) == 0.0
    assert float(ctx.metrics["kl"]) > 0


def test_kto_metrics_are_sums_and_counts():
    d = _data(0)
    batch = {"labels": d["labels"], "ref_logps": torch.zeros(B), "desirable": d["desirable"], "kl": 0.25}
    ctx = LossContext.from_batches([batch])
    for a, b in SPLITS:
        losses.kto(d["logp"][a:b], {k: v if k == "kl" else v[a:b] for k, v in batch.items()}, ctx)
    assert int(ctx.metrics["count/chosen"]) == int(d["desirable"].sum())
    assert int(ctx.metrics["count/rejected"]) == B - int(d["desirable"].sum())
    torch.testing.assert_close(float(ctx.metrics["kl"]), 0.25)


@pytest.mark.parametrize("group_size", [2, 4])
@pytest.mark.parametrize("scale", [True, False])
def test_group_advantages_match_numpy(group_size, scale):
    r = np.random.default_rng(0).normal(size=16).astype(np.float32)
    g = r.reshape(-1, group_size)
    want = g - g.mean(1, keepdims=True)
    if scale:
        want = want / (g.std(1, ddof=1, keepdims=True) + 1e-4)
    got = losses.group_advantages(torch.from_numpy(r), group_size, scale=scale)
    np.testing.assert_allclose(got.numpy(), want.reshape(-1), atol=1e-5)


def test_group_advantages_of_equal_rewards_are_zero():
    assert losses.group_advantages(torch.full((4,), 3.0), 4).abs().max() == 0


def test_on_policy_grpo_loss_is_minus_the_mean_advantage_and_its_gradient_is_the_policy_gradient():
    d = _data(0)
    batch = {"labels": d["labels"], "advantages": d["advantages"]}
    ctx = LossContext.from_batches([batch])
    loss, grad = _grad(lambda x: losses.grpo(x, batch, ctx, loss_type="dapo"), d["logp"])
    n = d["on"].sum(-1)
    assert math.isclose(float(loss), -float((d["advantages"] * n).sum()) / ctx.tokens, abs_tol=TOL)
    torch.testing.assert_close(grad, -d["advantages"][:, None].expand(B, T) * d["on"] / ctx.tokens)


def test_kl_ratio_weighting_on_policy_keeps_the_value_and_adds_k3_times_grad_logp():
    d = _data(0)
    batch = {"labels": d["labels"], "advantages": d["advantages"], "ref_logp": d["ref_logp"]}
    ctx = LossContext.from_batches([batch])
    beta, on = 0.3, d["on"]
    (v1, g1), (v0, g0) = (_grad(lambda x: losses.grpo(x, batch, ctx, beta=beta, loss_type="dapo",
                                                      kl_ratio_weighted=w), d["logp"]) for w in (True, False))
    x = torch.where(on, d["ref_logp"] - d["logp"], 0.0)
    k3 = torch.exp(x) - x - 1  # on-policy ratio = 1: d(ratio * k3)/dlogp = dk3/dlogp + k3
    assert float(k3.max()) > 1e-3
    torch.testing.assert_close(v1, v0, atol=TOL, rtol=0)
    torch.testing.assert_close(g1 - g0, beta * k3 * on / ctx.tokens, atol=TOL, rtol=0)


def test_kl_metric_is_the_term_that_enters_the_loss():
    d = _data(1)
    batch = {"labels": d["labels"], "advantages": d["advantages"], "ref_logp": d["ref_logp"], "old_logp": d["old_logp"]}
    on = d["on"]
    x = torch.where(on, d["ref_logp"] - d["logp"], 0.0)
    k3, ratio = torch.exp(x) - x - 1, torch.exp(torch.where(on, d["logp"] - d["old_logp"], 0.0))
    for weighted, want in ((True, (k3 * ratio)[on].sum()), (False, k3[on].sum())):
        ctx = LossContext.from_batches([batch])
        losses.grpo(d["logp"], batch, ctx, beta=0.1, kl_ratio_weighted=weighted)
        torch.testing.assert_close(float(ctx.metrics["kl"]), float(want) / ctx.tokens, atol=TOL, rtol=0)


def test_needs_entropy():
    assert not losses.needs_entropy(losses.sft)
    assert not losses.needs_entropy(functools.partial(losses.grpo, loss_type="dapo"))
    assert losses.needs_entropy(lambda logp, batch, ctx, entropy: (logp * entropy).sum())
    assert not losses.needs_entropy(print)


def test_padding_values_never_reach_the_loss():
    d = _data(0)
    off = ~d["on"]
    batch = {"labels": d["labels"], "advantages": d["advantages"], "ref_logp": d["ref_logp"].masked_fill(off, -1e30),
             "old_logp": d["old_logp"].masked_fill(off, float("-inf"))}
    ctx = LossContext.from_batches([batch])
    loss, grad = _grad(lambda x: losses.grpo(x, batch, ctx, beta=0.1), d["logp"])
    assert torch.isfinite(loss) and torch.isfinite(grad).all()


@pytest.mark.parametrize("call, exc, words", [
    (lambda d, c: losses.dpo(d["logp"][:3], {"labels": d["labels"][:3], "ref_logps": torch.zeros(3)}, c),
     ValueError, ["3 rows", "even"]),
    (lambda d, c: losses.dpo(d["logp"], {"labels": d["labels"], "ref_logps": torch.zeros(B),
                                         "pair": torch.arange(B)}, c), ValueError, ["adjacent rows"]),
    (lambda d, c: losses.dpo(d["logp"], {"labels": d["labels"]}, c), KeyError, ["ref_logps", "ref_logp"]),
    (lambda d, c: losses.dpo(d["logp"], {"labels": d["labels"], "ref_logps": torch.zeros(3)}, c),
     ValueError, ["ref_logps", "(8,)"]),
    (lambda d, c: losses.grpo(d["logp"], {"labels": d["labels"], "advantages": d["advantages"]}, c,
                              loss_type="ppo"), ValueError, ["loss_type='ppo'", "dapo"]),
    (lambda d, c: losses.grpo(d["logp"], {"labels": d["labels"], "advantages": d["advantages"]}, c,
                              loss_type="dr_grpo"), ValueError, ["max_completion_length"]),
    (lambda d, c: losses.grpo(d["logp"], {"labels": d["labels"], "advantages": d["advantages"]}, c, beta=0.1),
     KeyError, ["ref_logp", "beta=0.0"]),
    (lambda d, c: losses.grpo(d["logp"], {"labels": d["labels"]}, c), KeyError, ["advantages", "group_advantages"]),
    (lambda d, c: losses.sft(d["logp"], {}, c) + losses.kto(d["logp"], {}, c), KeyError, ["labels"]),
    (lambda d, c: losses.kto(d["logp"], {"labels": d["labels"], "ref_logps": torch.zeros(B)}, c),
     KeyError, ["desirable"]),
    (lambda d, c: LossContext(tokens=0, sequences=2), ValueError, ["tokens=0", "from_batches"]),
    (lambda d, c: LossContext.from_batches([{"labels": torch.full((2, 3), -100)}]), ValueError, ["-100"]),
    (lambda d, c: losses.group_advantages(torch.zeros(5), 2), ValueError, ["group_size=2", "5 rewards"]),
])
def test_errors_name_the_value_and_the_fix(call, exc, words):
    d = _data(0)
    with pytest.raises(exc) as e:
        call(d, LossContext.from_batches([{"labels": d["labels"]}]))
    for w in words:
        assert w in str(e.value), str(e.value)
