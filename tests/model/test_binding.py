"""megatrain_nb.model.binding and hostmem: the view cache (made once per buffer, made again when the buffer's
memory moves, gone with the buffer), the template binding (equal to ``functional_call``, restored after,
also on error), the hooks skipped for weights outside the slots, and the memory counters a step records."""
from __future__ import annotations

import gc

import psutil
import pytest
import torch
from torch import nn

from conftest import make_batches
from megatrain_nb import Session
from megatrain_nb.model.binding import Layout, SlotRefs, bound, call, grads_into
from megatrain_nb.model.hf import load_architecture
from megatrain_nb.host.hostmem import HostRss


def _layout():
    return Layout.build([("a.weight", (3, 4)), ("a.bias", (3,)), ("b", (5,))])


# ---- views ---------------------------------------------------------------------------------------
def test_views_are_made_once_per_buffer_and_share_its_memory():
    lay, flat = _layout(), torch.arange(200.0)
    v1, v2 = lay.views(flat), lay.views(flat)
    assert v1 is not v2 and all(v1[n] is v2[n] for n in lay.names)  # the caller's dict, the cached views
    assert torch.equal(v1["a.bias"], flat[64:67]) and v1["b"].data_ptr() == flat[128:].data_ptr()
    other = torch.zeros(200)
    assert lay.views(other)["b"].data_ptr() == other[128:].data_ptr()  # another buffer: its own views


def test_views_are_made_again_when_the_buffer_moves():
    lay, flat = _layout(), torch.zeros(200)
    old = lay.views(flat)["a.weight"]
    flat.set_(torch.ones(200))  # the same tensor object over new memory
    new = lay.views(flat)["a.weight"]
    assert new is not old and torch.equal(new, torch.ones(3, 4)) and new.data_ptr() == flat.data_ptr()
    flat.data = torch.full((200,), 2.0, dtype=torch.float64)
    assert lay.views(flat)["b"].dtype == torch.float64 and float(lay.views(flat)["b"][0]) == 2.0


def test_view_cache_entry_goes_with_its_buffer():
    lay = _layout()
    flat = torch.zeros(200)
    views = lay.views(flat)
    assert len(lay._cache) == 1
    ref = views["b"].untyped_storage()
    del flat, views
    gc.collect()
    assert len(lay._cache) == 0  # no views left to keep the storage alive
    assert ref.nbytes() == 800  # (our own storage handle only)


def test_requires_grad_views_are_fresh_leaves_on_the_cached_views():
    lay, flat = _layout(), torch.randn(200)
    p1, p2 = lay.views(flat, requires_grad=True), lay.views(flat, requires_grad=True)
    for n in lay.names:
        assert p1[n].is_leaf and p1[n].requires_grad and p1[n] is not p2[n]
        assert p1[n].data_ptr() == p2[n].data_ptr()
    assert not any(v.requires_grad for v in lay.views(flat).values())  # the cached views stay plain


def test_grads_into_accumulates_into_the_flat_buffer_through_cached_views():
    lay, flat, g = _layout(), torch.randn(200), torch.zeros(200)
    for k in range(2):  # the second time reuses the cached grad views and adds to them
        p = lay.views(flat, requires_grad=True)
        grads_into(p, g, lay)
        (p["a.weight"].sum() * 2 + p["b"].sum()).backward()
        assert float(g[:12].sum()) == 24.0 * (k + 1) and float(g[128:133].sum()) == 5.0 * (k + 1)
        assert float(g[64:67].abs().sum()) == 0.0  # a.bias took no part
    assert float(g[12:64].abs().sum()) == 0.0  # the padding stays zero


# ---- call ----------------------------------------------------------------------------------------
def _layer_and_inputs(tiny_config):
    from transformers import AutoModelForCausalLM

    cfg = tiny_config("llama")
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    arch = load_architecture(cfg)
    lay = Layout.build(arch.layer_params(0))
    flat = torch.zeros(lay.numel)
    real = dict(model.model.layers[0].named_parameters())
    for n, v in lay.views(flat).items():
        v.copy_(real[n].detach())
    ids = make_batches(cfg.vocab_size, 1)[0]["input_ids"]
    h0, calls = arch.prelude(model.model.embed_tokens(ids), None)
    return arch.templates[arch.template_of[0]], lay, flat, h0.detach(), calls[0]


def test_call_equals_functional_call_and_restores_the_template(tiny_config):
    tpl, lay, flat, h, (args, kwargs) = _layer_and_inputs(tiny_config)
    before = {n: p for n, p in tpl.named_parameters()}
    outs, grads = [], []
    plain = lambda t, p, *a, **k: torch.func.functional_call(t, p, a, k, tie_weights=False)  # noqa: E731
    for fn in (call, plain):
        p, x = lay.views(flat, requires_grad=True), h.clone().requires_grad_()
        out = fn(tpl, p, x, *args, **kwargs)
        out = out[0] if isinstance(out, tuple) else out
        out.sum().backward()
        outs.append(out), grads.append([x.grad] + [p[n].grad for n in lay.names])
    assert torch.equal(outs[0], outs[1]) and all(torch.equal(a, b) for a, b in zip(*grads))
    after = dict(tpl.named_parameters())
    assert before.keys() == after.keys() and all(before[n] is after[n] and after[n].is_meta for n in after)


def test_call_restores_the_template_when_its_forward_raises(tiny_config):
    tpl, lay, flat, h, (args, kwargs) = _layer_and_inputs(tiny_config)
    with pytest.raises(RuntimeError):
        call(tpl, lay.views(flat), h[..., :3], *args, **kwargs)  # the wrong width
    assert all(p.is_meta for p in tpl.parameters())


def test_call_binds_buffers_as_functional_call_does():
    m = nn.BatchNorm1d(2)  # running_mean / running_var are buffers: not a parameter place
    m.eval()
    x = torch.randn(3, 2)
    params = {"weight": torch.ones(2), "bias": torch.zeros(2), "running_mean": torch.full((2,), 1.0),
              "running_var": torch.ones(2)}
    assert torch.allclose(call(m, params, x), (x - 1.0) / (1 + m.eps) ** 0.5)
    assert float(m.running_mean.abs().sum()) == 0.0  # its own buffer is back


# ---- hooks ---------------------------------------------------------------------------------------
class _Where:
    def layer_in(self, slot):
        return 7

    def slot_of(self, layer):
        return 0


def test_hooks_pack_slot_views_and_skip_buffers_outside_the_slots():
    slot, resident = torch.randn(8), torch.randn(8)
    refs = SlotRefs([slot], _Where())
    x = torch.randn(8, requires_grad=True)
    packed = []
    refs.pack, pack = (lambda t: packed.append(t) or SlotRefs.pack(refs, t)), refs.pack
    for flat, n in ((slot, 1), (resident, 0), (None, 1)):  # None: the hooks, whatever the weights
        packed.clear()
        w = (flat if flat is not None else slot).detach().requires_grad_()
        with refs.hooks(flat):
            (x * w).sum().backward()
        assert len(packed) == 2 * n  # x and w saved by the product, each packed once under hooks
        assert torch.equal(w.grad, x.detach())
    refs.pack = pack


# ---- memory counters -----------------------------------------------------------------------------
def test_host_rss_reads_what_psutil_reads():
    rss = HostRss()
    a, b = rss(), psutil.Process().memory_info().rss
    assert abs(a - b) <= (1 << 20)  # the same statm field, a MiB of allocations apart at most
    rss._pid = -1  # as after a fork: /proc/self is opened again
    assert abs(rss() - psutil.Process().memory_info().rss) <= (1 << 20)


def test_a_step_records_host_rss_after_every_layer_op(tiny_config):
    cfg = tiny_config("llama", num_hidden_layers=3)
    s = Session.from_config(cfg, device="cpu", lr=1e-3)
    try:
        s.step(make_batches(cfg.vocab_size, 1)[0])
        c = s.trace.counters_dataframe()
    finally:
        s.close()
    rss = c[c.name == "host_rss_bytes"]
    assert len(rss) == 2 + 2 * 3  # the step's start and end, each layer's forward and backward
    assert rss.value.min() > 0 and rss.value.max() <= psutil.Process().memory_info().rss * 2


def test_a_bound_copy_writes_into_the_tensors_and_leaves_the_template_weightless():
    """``bound``: the copy's parameters are the given tensors (an init through it lands in them); the template keeps
    its meta parameters; a tensor of another shape is refused naming the parameter."""
    template = nn.Sequential(nn.Linear(4, 3, device="meta"), nn.LayerNorm(3, device="meta"))
    w, b = torch.zeros(3, 4), torch.zeros(3)
    mod = bound(template, {"0.weight": w, "0.bias": b})
    with torch.no_grad():
        mod[0].weight.fill_(2.0), mod[0].bias.fill_(-1.0)
    assert w.eq(2.0).all() and b.eq(-1.0).all() and mod[0].weight.data_ptr() == w.data_ptr()
    assert template[0].weight.is_meta and mod[1].weight.is_meta  # the template untouched; unnamed ones stay meta
    with pytest.raises(ValueError, match=r"0\.weight: the tensor given is \(4, 3\), the template's parameter \(3, 4\)"):
        bound(template, {"0.weight": torch.zeros(4, 3)})
