"""megatrain_nb.model.hf: templates per distinct layer structure, the meta skeleton, the prelude against the
real HF model, and the checkpoint-name map of transformers' weight conversions."""
from __future__ import annotations

import pytest
import torch
from safetensors import safe_open
from transformers import AutoModelForCausalLM

from conftest import VOCAB, families, make_batches
from megatrain_nb.model.binding import Layout
from megatrain_nb.model.hf import checkpoint_map, load_architecture, params_on_meta


# ---- templates ---------------------------------------------------------------------------------
@pytest.mark.parametrize("family, overrides, template_of", [
    ("llama", dict(num_hidden_layers=4), [0, 0, 0, 0]),
    ("mistral", dict(num_hidden_layers=3), [0, 0, 0]),  # every layer slides: one structure
    ("gemma2", dict(num_hidden_layers=4), [0, 1, 0, 1]),  # sliding, full, sliding, full
    ("gpt_oss", dict(num_hidden_layers=4), [0, 1, 0, 1]),
    ("qwen3_moe", dict(num_hidden_layers=3, mlp_only_layers=[0]), [0, 1, 1]),  # dense, then MoE
    ("qwen3_moe", dict(num_hidden_layers=4, mlp_only_layers=[], decoder_sparse_step=2), [0, 1, 0, 1]),
])
def test_one_template_per_distinct_structure(tiny_config, family, overrides, template_of):
    arch = load_architecture(tiny_config(family, **overrides))
    assert arch.template_of == template_of
    assert len(arch.templates) == max(template_of) + 1
    for t, i in enumerate([template_of.index(t) for t in range(len(arch.templates))]):
        assert arch.templates[t] is arch.layers[i]  # the first layer of each structure is its template
    for i, t in enumerate(template_of):  # every layer has its template's parameter names and shapes
        assert arch.layer_params(i) == arch.layer_params(template_of.index(t))


def test_gemma2_templates_differ_in_attention_type(tiny_config):
    arch = load_architecture(tiny_config("gemma2", num_hidden_layers=2))
    kinds = [getattr(t.self_attn, "sliding_window", None) for t in arch.templates]
    assert kinds == [4, None]


# ---- the meta skeleton ---------------------------------------------------------------------------
@pytest.mark.parametrize("family", families("llama", "gemma2", "gpt_oss"))
def test_params_on_meta_keeps_buffers_real(tiny_config, family):
    cfg = tiny_config(family)
    with params_on_meta():
        meta = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    real = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    assert all(p.device.type == "meta" for p in meta.parameters())
    buffers = dict(meta.named_buffers())
    assert any(n.endswith("inv_freq") for n in buffers), sorted(buffers)
    for n, b in real.named_buffers():
        assert buffers[n].device.type == "cpu", n
        assert torch.equal(buffers[n], b), n
    # the patch is undone: modules made afterwards get real parameters
    assert all(p.device.type == "cpu" for p in torch.nn.Linear(2, 2).parameters())


def test_params_on_meta_is_undone_on_error():
    before = torch.nn.Module.register_parameter
    with pytest.raises(RuntimeError), params_on_meta():
        raise RuntimeError("boom")
    assert torch.nn.Module.register_parameter is before


def test_architecture_locates_parts(tiny_config):
    arch = load_architecture(tiny_config("llama_tied"))
    assert arch.tied and arch.head_params() == [("model.norm.weight", torch.Size([32]))]
    arch = load_architecture(tiny_config("llama"))
    assert not arch.tied and arch.head_params()[-1] == ("lm_head.weight", torch.Size([VOCAB, 32]))
    assert arch.num_layers == 2 and arch.embed.weight.shape == (VOCAB, 32)
    arch = load_architecture(tiny_config("gemma2"))
    assert arch.softcap == 30.0


# ---- the prelude ---------------------------------------------------------------------------------
@pytest.mark.parametrize("padded", [False, True])
@pytest.mark.parametrize("family", families("llama", "gemma2", "mistral", "gpt_oss", "qwen3_moe"))
def test_prelude_matches_hf(tiny_config, family, padded):
    """h0 and every argument HF passes to each layer, from the engine's path (rows gathered on the
    host, the embedding's own forward over them, the prelude) vs the real model's forward."""
    cfg = tiny_config(family)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    b = make_batches(VOCAB, 1, pad_id=(cfg.pad_token_id or 0) if padded else None)[0]
    ids, mask = b["input_ids"], b.get("attention_mask")
    seen = []
    hooks = [layer.register_forward_pre_hook(lambda m, a, k: seen.append((a, k)), with_kwargs=True)
             for layer in model.model.layers]
    with torch.no_grad():
        model(input_ids=ids, attention_mask=mask, use_cache=False)  # as in training
    for h in hooks:
        h.remove()

    arch = load_architecture(cfg)
    W = model.model.embed_tokens.weight.detach()
    rows = W.index_select(0, ids.flatten())  # what the engine gathers from the host master
    with torch.no_grad():
        emb = arch.embed_rows(rows, tuple(ids.shape))
        h0, calls = arch.prelude(emb, mask)
        want_emb = model.model.embed_tokens(ids)
    assert torch.equal(emb, want_emb)
    if family == "gemma2":  # Gemma's normalizer: sqrt(hidden), in the weight dtype
        assert torch.equal(h0, W[ids] * torch.tensor(cfg.hidden_size ** 0.5, dtype=W.dtype))
    else:
        assert torch.equal(h0, W[ids])
    assert torch.equal(h0, seen[0][0][0] if seen[0][0] else seen[0][1]["hidden_states"])
    assert len(calls) == len(seen) == cfg.num_hidden_layers
    for i, ((args, kwargs), (hf_args, hf_kwargs)) in enumerate(zip(calls, seen)):
        assert len(args) == len(hf_args) - 1  # HF's first positional is the hidden states
        # the causal-LM wrapper adds output_router_logits (False: only asks for an extra output)
        extra = set(hf_kwargs) - set(kwargs)
        assert extra <= {"output_router_logits"} and not any(hf_kwargs[k] for k in extra), (i, extra)
        assert set(kwargs) <= set(hf_kwargs), (i, set(kwargs) - set(hf_kwargs))
        for k in kwargs:
            _assert_same(kwargs[k], hf_kwargs[k], f"layer {i} {k}")


def test_prelude_skips_hfs_packed_check_only_on_its_own_positions(tiny_config, monkeypatch):
    """Note: [Prelude sync]: given no position ids the prelude never runs HF's packed-sequence check (a host
    sync), whose answer for HF's own 0, 1, ... is None; given packed position ids it does, and the
    check is HF's own again afterwards."""
    import threading

    from transformers import masking_utils as mu

    calls, original = [], mu.find_packed_sequence_indices

    def counted(position_ids):
        calls.append(threading.current_thread().name)
        return original(position_ids)

    monkeypatch.setattr(mu, "find_packed_sequence_indices", counted)
    arch = load_architecture(tiny_config("llama"))
    emb = arch.embed_rows(torch.randn(12, 32), (1, 12))
    with torch.no_grad():
        arch.prelude(emb, None)
        assert calls == [] and mu.find_packed_sequence_indices is counted
        packed = torch.tensor([[0, 1, 2, 3, 4, 0, 1, 2, 3, 4, 5, 6]])
        arch.prelude(emb, None, position_ids=packed)
    assert calls == [threading.current_thread().name]


def _assert_same(a, b, what):
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.shape == b.shape and torch.equal(a, b), what
    elif isinstance(a, (tuple, list)):
        assert len(a) == len(b), what
        for x, y in zip(a, b):
            _assert_same(x, y, what)
    elif isinstance(a, dict):
        assert set(a) == set(b), what
        for k in a:
            _assert_same(a[k], b[k], f"{what}.{k}")
    else:
        assert a == b or (a is None and b is None), what


def test_embed_rows_carries_gradients_to_rows(tiny_config):
    """The engine's embedding leaf is the gathered rows: their gradient is HF's, scaled for Gemma."""
    cfg = tiny_config("gemma2")
    arch = load_architecture(cfg)
    rows = torch.randn(6, cfg.hidden_size, requires_grad=True)
    arch.embed_rows(rows, (2, 3)).sum().backward()
    assert torch.allclose(rows.grad, torch.full_like(rows, cfg.hidden_size ** 0.5))


# ---- checkpoint names ----------------------------------------------------------------------------
@pytest.mark.parametrize("family", families("mixtral", "qwen3_moe", "gpt_oss", "llama"))
def test_checkpoint_map_covers_every_position_once(tiny_config, hf_dir, family):
    arch = load_architecture(tiny_config(family))
    i = arch.num_layers - 1  # an MoE layer in every family here
    prefix = f"{arch.layer_prefix}{i}."
    layout = Layout.build(arch.layer_params(i))
    params = {prefix + n: (o, s) for n, s, o in layout.items()}
    mapping = checkpoint_map(arch, params)

    positions, index_tensors = [], 0
    for name, where in mapping.items():
        if isinstance(where, torch.Tensor):
            assert where.dtype == torch.long
            positions.append(where.flatten())
            index_tensors += 1
        else:
            off, shape = where
            positions.append(torch.arange(off, off + torch.Size(shape).numel()))
    flat = torch.cat(positions).sort().values
    want = torch.cat([torch.arange(o, o + s.numel()) for _, s, o in layout.items()])
    assert torch.equal(flat, want), "each parameter element is filled exactly once, padding never"
    if family == "mixtral":
        assert index_tensors > 0, "Mixtral's per-expert checkpoint tensors map through index tensors"
    if family == "llama":
        assert index_tensors == 0 and mapping == params

    # the names and shapes are what transformers itself writes to disk
    with safe_open(str(hf_dir(family) / "model.safetensors"), framework="pt") as fh:
        on_disk = {k: tuple(fh.get_slice(k).get_shape()) for k in fh.keys() if k.startswith(prefix)}
    mapped = {k: tuple(v.shape) if isinstance(v, torch.Tensor) else tuple(v[1]) for k, v in mapping.items()}
    assert mapped == on_disk
