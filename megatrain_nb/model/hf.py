"""Find the pieces of a Hugging Face decoder-only model and make weightless templates of them.

Owns: building the model skeleton with parameters on the meta device (buffers such as rotary
``inv_freq`` stay real and small), locating embed / layers / final norm / lm_head, grouping layers
into distinct structures (one template each), the *prelude* (everything the HF model computes
between the embedding and the first layer: masks, position ids, rotary tables, Gemma's embedding
scale) and the checkpoint-name mapping of transformers' own weight conversions.
Does not own: any weight values, devices, streams or the training loop.
"""
from __future__ import annotations

import contextlib
import dataclasses
import threading
from typing import Any

import torch
from torch import nn

SUPPORTED = ("llama", "mistral", "qwen2", "qwen3", "gemma2", "mixtral", "qwen3_moe", "gpt_oss")


class UnsupportedModelError(ValueError):
    """The model's architecture lacks something the streaming engine needs."""


@contextlib.contextmanager
def params_on_meta():
    """Create every nn.Parameter on the meta device while buffers stay real (rotary tables)."""
    original = nn.Module.register_parameter

    def register(module, name, param):
        original(module, name, param)
        if param is not None and param.device.type != "meta":
            module._parameters[name] = nn.Parameter(param.to("meta"), requires_grad=param.requires_grad)

    nn.Module.register_parameter = register
    try:
        yield
    finally:
        nn.Module.register_parameter = original


class _StopPrelude(Exception):
    pass


class _Recorder(nn.Module):
    """Stands in for decoder layer i: records the arguments HF passes it, returns its input."""

    def __init__(self, layer: nn.Module, index: int, sink: list, last: bool):
        super().__init__()
        object.__setattr__(self, "_layer", layer)  # not a submodule: its params stay out of the shell
        self.index, self.sink, self.last = index, sink, last

    def __getattr__(self, name):  # HF reads e.g. `decoder_layer.attention_type` (Gemma2)
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(object.__getattribute__(self, "_layer"), name)

    def forward(self, hidden_states, *args, **kwargs):
        self.sink.append((hidden_states, args, kwargs))
        if self.last:
            raise _StopPrelude
        return hidden_states


@dataclasses.dataclass(kw_only=True)
class Architecture:
    """The located parts of one HF causal LM, all weightless."""

    config: Any
    model: nn.Module  # the whole skeleton (params on meta)
    base: nn.Module  # model.model: the decoder stack
    embed: nn.Embedding
    layers: list  # the original layer modules, on meta
    norm: nn.Module
    head: nn.Module  # lm_head (nn.Linear); its weight is the embedding's when tied
    tied: bool
    embed_name: str  # "model.embed_tokens.weight"
    norm_prefix: str  # "model.norm."
    head_name: str  # "lm_head.weight"
    layer_prefix: str  # "model.layers."
    template_of: list  # layer index -> template index
    templates: list  # one weightless module per distinct layer structure
    softcap: float | None  # Gemma2's final_logit_softcapping

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    def layer_params(self, i: int) -> list[tuple[str, torch.Size]]:
        """(name, shape) of layer i's parameters, in the template's order."""
        return [(n, p.shape) for n, p in self.layers[i].named_parameters()]

    def active_params(self) -> int:
        """Parameters one token computes with: every parameter, but each MoE experts module's at
        ``num_experts_per_tok / num_experts`` (router, attention, embedding, norms and lm_head in full;
        a tied embedding once). Equals the parameter count of a dense model.

        Example:
            >>> load_architecture(make_config("gpt_oss")).active_params()  # doctest: +SKIP
            25584
        """
        from .kernels import experts_modules

        top_k = getattr(self.config, "num_experts_per_tok", None)
        total = sum(p.numel() for p in self.model.parameters())  # .parameters() yields a tied weight once
        for layer in self.layers:
            for _, m in experts_modules(layer):
                n = sum(p.numel() for p in m.parameters())
                total -= n - n * top_k // m.num_experts
        return total

    def head_params(self) -> list[tuple[str, torch.Size]]:
        """(name relative to the model, shape) of the head unit: final norm, then lm_head unless tied."""
        out = [(self.norm_prefix + n, p.shape) for n, p in self.norm.named_parameters()]
        if not self.tied:
            out.append((self.head_name, self.head.weight.shape))
        return out

    def embed_rows(self, rows: torch.Tensor, shape: tuple[int, int]) -> torch.Tensor:
        """The embedding module's own forward over rows already gathered for each token.

        Args:
            rows: (B*T, H) compute dtype: row k is the table row of token k (may require grad).
        Returns:
            (B, T, H): what ``embed_tokens(input_ids)`` returns — scaled where the family scales
            (Gemma2's ``Gemma2TextScaledWordEmbedding``), so its code, not a copy of it, runs.
        """
        local = torch.arange(rows.shape[0], device=rows.device).view(shape)
        plain = self._plain_embed()
        return torch.func.functional_call(plain, {"weight": rows}, (local,))

    def _plain_embed(self):
        """A shallow copy of the embedding without padding_idx (its rows are re-indexed per token)."""
        if getattr(self, "_plain", None) is None:
            import copy
            self._plain = copy.copy(self.embed)
            self._plain.padding_idx = None
        return self._plain

    def position_kwargs(self, position_ids: torch.Tensor | None, device: torch.device) -> dict:
        """The prelude's kwargs for a micro-batch's position_ids (None: HF counts 0, 1, ...).

        Args:
            position_ids: (B, T) long on the host, restarting at 0 where a packed example starts.
        Returns:
            {} for None; else {"position_ids"} on ``device``, plus the varlen kwargs when the session
            installed varlen attention (Note: [Document masking] in packing.py).
        """
        if position_ids is None:
            return {}
        from ..data.packing import VARLEN, varlen_kwargs

        out = {"position_ids": position_ids.to(device, non_blocking=True)}
        if self.config._attn_implementation == VARLEN:
            out.update(varlen_kwargs(position_ids, device))
        return out

    def prelude(self, inputs_embeds: torch.Tensor, attention_mask: torch.Tensor | None, **extra):
        """Run HF's own code from the embedding output to layer 0's input.

        Args:
            inputs_embeds: (B, T, H) compute dtype, the embedding module's output (may require grad).
            attention_mask: (B, T) 0/1 or None.
            **extra: more arguments of the HF model's forward (``position_kwargs``; a KV cache and
                ``use_cache=True`` for generation), recorded into every layer's call.
        Returns:
            (h0, calls): h0 is layer 0's input (B, T, H) — e.g. Gemma scales the embedding — and
            calls[i] = (args, kwargs) that HF passes to layer i besides the hidden states.
        """
        sink: list = []
        n = self.num_layers
        recorders = nn.ModuleList(_Recorder(layer, i, sink, i == n - 1) for i, layer in enumerate(self.layers))
        saved = self.base.layers
        self.base.layers = recorders
        try:
            with _unpacked() if "position_ids" not in extra else contextlib.nullcontext():
                self.base(inputs_embeds=inputs_embeds, attention_mask=attention_mask, **{"use_cache": False, **extra})
        except _StopPrelude:
            pass
        finally:
            self.base.layers = saved
        if len(sink) != n:
            raise UnsupportedModelError(
                f"{type(self.base).__name__}.forward called {len(sink)} of its {n} layers; the engine "
                "needs every layer called once, in order")
        return sink[0][0], [(a, k) for _, a, k in sink]

    def logits(self, params: dict[str, torch.Tensor], h: torch.Tensor) -> torch.Tensor:
        """Final norm, lm_head and softcap of hidden states ``h`` (..., H) with the head unit's ``params``."""
        import torch.nn.functional as F
        from .binding import call

        norm_p = {n[len(self.norm_prefix):]: p for n, p in params.items() if n.startswith(self.norm_prefix)}
        logits = F.linear(call(self.norm, norm_p, h), params[self.embed_name if self.tied else self.head_name])
        return torch.tanh(logits / self.softcap) * self.softcap if self.softcap else logits


@contextlib.contextmanager
def _unpacked():
    """HF's check for packed rows answers None, in this thread, while the prelude runs on its own positions.

    Note: [Prelude sync] without an attention mask, HF's mask code looks for packed sequences in the
    position ids (``masking_utils.find_packed_sequence_indices``) by reading a device value back: a
    host sync, whose copy out queues behind any copy out already on its way. Traced on the H200 (2026-12-02,
    3B under "stream"), each step's prelude waited 62-65 ms for the previous step's head group write-back
    (Note: [Streamed head] in placement.py). Given no position ids, HF counts 0, 1, ... itself: nothing
    is packed, and the check would answer None. Packed rows (``position_kwargs``) keep HF's check.
    """
    try:
        from transformers import masking_utils as mu
    except ImportError:  # an older transformers: no such check
        yield
        return
    check = getattr(mu, "find_packed_sequence_indices", None)
    if check is None:
        yield
        return
    me = threading.get_ident()
    mu.find_packed_sequence_indices = lambda position_ids: None if threading.get_ident() == me else check(position_ids)
    try:
        yield
    finally:
        mu.find_packed_sequence_indices = check


def _simple_attrs(module: nn.Module) -> tuple:
    """Plain attributes of a module tree that change behaviour (sliding window, layer type, ...)."""
    out = []
    for name, m in module.named_modules():
        for k, v in sorted(vars(m).items()):
            if k.startswith("_") or k in ("layer_idx", "training"):
                continue
            if isinstance(v, (int, float, str, bool, type(None))):
                out.append((name, k, v))
    return tuple(out)


def load_architecture(config) -> Architecture:
    """Build a weightless skeleton of ``config``'s causal LM and locate its parts.

    Args:
        config: a transformers ``PretrainedConfig`` of a decoder-only causal LM.
    Returns:
        Architecture with one template per distinct layer structure.
    Raises:
        UnsupportedModelError: names the class and the missing part.
    """
    from transformers import AutoModelForCausalLM

    if getattr(config, "is_encoder_decoder", False):
        raise UnsupportedModelError(f"{type(config).__name__} is encoder-decoder; only decoder-only causal LMs stream")
    for attr in ("logits_scaling", "logit_scale"):
        if getattr(config, attr, None) not in (None, 1, 1.0):
            raise UnsupportedModelError(f"{type(config).__name__} scales logits by {attr}; not supported yet")
    try:
        with params_on_meta():
            model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    except ValueError as e:
        raise UnsupportedModelError(f"transformers has no causal-LM class for {type(config).__name__}: {e}") from e
    cls = type(model).__name__
    base = getattr(model, "model", None)
    missing = [n for n, ok in (("model.model", base is not None),
                               ("model.layers", base is not None and isinstance(getattr(base, "layers", None), nn.ModuleList)),
                               ("model.embed_tokens", base is not None and isinstance(getattr(base, "embed_tokens", None), nn.Embedding)),
                               ("model.norm", base is not None and hasattr(base, "norm")),
                               ("lm_head", isinstance(getattr(model, "lm_head", None), nn.Linear))) if not ok]
    if missing:
        raise UnsupportedModelError(f"{cls} has no {', '.join(missing)}; supported families: {', '.join(SUPPORTED)}")
    embed = base.embed_tokens
    if model.lm_head.bias is not None:
        raise UnsupportedModelError(f"{cls}'s lm_head has a bias; not supported yet")
    tied = model.lm_head.weight is embed.weight
    known = {id(p) for p in base.layers.parameters()} | {id(embed.weight), id(model.lm_head.weight)}
    known |= {id(p) for p in base.norm.parameters()}
    stray = [n for n, p in model.named_parameters() if id(p) not in known]
    if stray:
        raise UnsupportedModelError(f"{cls} has parameters outside embed/layers/norm/lm_head: {stray[:4]}")

    layers = list(base.layers)
    keys, templates, template_of = {}, [], []
    for layer in layers:
        sig = (type(layer).__name__, tuple((n, tuple(p.shape)) for n, p in layer.named_parameters()),
               _simple_attrs(layer))
        if sig not in keys:
            keys[sig] = len(templates)
            templates.append(layer)
        template_of.append(keys[sig])
    return Architecture(
        config=config, model=model, base=base, embed=embed, layers=layers, norm=base.norm,
        head=model.lm_head, tied=tied, embed_name="model.embed_tokens.weight", norm_prefix="model.norm.",
        head_name="lm_head.weight", layer_prefix="model.layers.", template_of=template_of,
        templates=templates, softcap=getattr(config, "final_logit_softcapping", None))


def checkpoint_map(arch: Architecture, params: dict[str, tuple[int, torch.Size]]) -> dict[str, Any]:
    """Where each checkpoint tensor of these parameters lands in their unit's flat slab.

    transformers stores some families differently on disk than in memory (Mixtral's per-expert
    w1/w3 become one fused ``gate_up_proj``). Rather than re-implementing those conversions, run
    transformers' own reverse conversion on index tensors: each checkpoint tensor then says, element
    by element, which flat position it fills.

    Args:
        params: model parameter name -> (offset in the flat slab, shape).
    Returns:
        checkpoint name -> (offset, shape) for a tensor stored as-is, or a LongTensor of flat
        positions, shaped like the checkpoint tensor.
    """
    from transformers.core_model_loading import revert_weight_conversion

    probe = revert_weight_conversion(arch.model, {n: torch.empty(s, device="meta") for n, (_, s) in params.items()})
    if set(probe) == set(params):
        return dict(params)
    index = {n: torch.arange(o, o + s.numel()).view(s) for n, (o, s) in params.items()}
    return revert_weight_conversion(arch.model, index)


def convert_to_checkpoint(arch: Architecture, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Model-named tensors -> checkpoint-named tensors, as transformers' ``save_pretrained`` writes them."""
    from transformers.core_model_loading import revert_weight_conversion

    return revert_weight_conversion(arch.model, dict(tensors))
