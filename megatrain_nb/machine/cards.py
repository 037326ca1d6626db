"""Consumer and workstation cards as planner ``Hardware``: predictions from datasheets, labelled so.

Owns: each card's datasheet figures (memory, PCIe generation, dense bf16 tensor rate with fp32 accumulate,
memory bandwidth), ``card`` (a ``Hardware`` profile predicted from them, host RAM a parameter), the presets
``RTX_4090``, ``RTX_3090``, ``RTX_A6000``, ``L40S`` and ``H100_PCIE``, ``largest_models`` (the largest model
a host RAM holds under each ``optimizer_state``), ``table`` (every card's predicted step for a few models: the
docs' table) and ``paper_comparison`` (our prediction beside the MegaTrain paper's measured figures where it
measured a card).
Does not own: the step model itself (planner.py) or the host store's byte count (preflight.host_table).

Note: [Predicted cards] none of these cards was measured here. A profile scales the H200's measured
figures (``planner.H200``) by the card's datasheet: layer, GEMM and attention rates by its dense bf16
tensor rate (the H200 reaches 609 of its 989 dense TFLOPS on a layer, 0.62; 774 on a GEMM, 0.78); pinned
copies by its PCIe generation (the H200 measured 55.1 of Gen5 x16's 64 GB/s each way, 0.86; both
directions at once 1.8x one); memory-bound work (norms, loss, device AdamW) by its memory bandwidth. Host
rates (AdamW, casts, launches) are the H200 host's unless given: they are the host CPU's, not the card's.
GeForce cards accumulate bf16 products in fp32 at half the rate of fp16 accumulation; their datasheet
bf16 figure is that half rate. Expect errors of tens of percent.
"""
from __future__ import annotations

import dataclasses

from .budget import parse_bytes
from .planner import H200, Hardware

_GIB = 1 << 30
_PCIE_GBPS = {4: 32.0, 5: 64.0}  # x16, each way, GB/s
_H200_DENSE_TFLOPS, _H200_BW_TBPS, _H200_PCIE = 989.0, 4.8, 5

CARDS = {
    # name: (memory bytes, PCIe generation, dense bf16 TFLOPS with fp32 accumulate, memory TB/s, source)
    "RTX 4090": (24 * _GIB, 4, 165.2, 1.008, "NVIDIA Ada GPU architecture whitepaper (AD102, RTX 4090)"),
    "RTX 3090": (24 * _GIB, 4, 71.0, 0.936, "NVIDIA Ampere GA102 GPU architecture whitepaper (RTX 3090)"),
    "RTX A6000": (48 * _GIB, 4, 154.8, 0.768, "NVIDIA RTX A6000 datasheet"),
    "L40S": (48 * _GIB, 4, 362.05, 0.864, "NVIDIA L40S datasheet"),
    "H100 PCIe": (80 * _GIB, 5, 756.0, 2.0, "NVIDIA H100 Tensor Core GPU datasheet (PCIe)"),
}


def card(name: str, *, host_memory: int | str = "128GiB", host_adam_params_per_s: float | None = None) -> Hardware:
    """A planner ``Hardware`` profile of a card, predicted from its datasheet (Note: [Predicted cards]).

    Args:
        name: one of ``CARDS``: "RTX 4090", "RTX 3090", "RTX A6000", "L40S", "H100 PCIe".
        host_memory: host RAM of the machine (bytes or "251GB"); the planner checks the host store against it.
        host_adam_params_per_s: the host's AdamW rate with bf16 gradients (``bench/host_adam.py``); None:
            the H200 host's 3.48e9 (16 threads).
    Returns:
        Hardware whose name says "predicted from the datasheet".
    Raises:
        ValueError: an unknown card (the message lists them) or a bad ``host_memory``.
    Example:
        >>> hw = card("RTX 3090", host_memory="251GB")
        >>> hw.device_mem_bytes >> 30, round(hw.bf16_tflops, 1), hw.name.split(":")[0]
        (24, 43.7, 'RTX 3090 (predicted from the datasheet, not measured)')
    """
    if name not in CARDS:
        raise ValueError(f"card {name!r}: choose one of {sorted(CARDS)}")
    mem, gen, tflops, bw, source = CARDS[name]
    host = parse_bytes(host_memory, "host_memory")
    compute, pcie = tflops / _H200_DENSE_TFLOPS, _PCIE_GBPS[gen] / _PCIE_GBPS[_H200_PCIE]
    slower = _H200_BW_TBPS / bw  # memory-bound work takes this much longer than on the H200
    h2d = H200.h2d_GBps * pcie
    kw = dict(h2d_GBps=h2d, d2h_GBps=H200.d2h_GBps * pcie, duplex_GBps=H200.duplex_GBps * pcie,
              h2d_beside_d2h_GBps=H200.h2d_beside_d2h_GBps * pcie, d2h_beside_h2d_GBps=H200.d2h_beside_h2d_GBps * pcie,
              bf16_tflops=H200.bf16_tflops * compute, gemm_tflops=H200.gemm_tflops * compute,
              attn_tflops=H200.attn_tflops * compute,
              experts_tflops=H200.experts_tflops and tuple(r * min(compute, 1 / slower) for r in H200.experts_tflops),
              elementwise_s_per_token_dim=H200.elementwise_s_per_token_dim * slower,
              loss_s_per_logit=H200.loss_s_per_logit * slower,
              device_adam_params_per_s=H200.device_adam_params_per_s / slower,
              device_mem_bytes=mem, host_mem_bytes=host)
    if host_adam_params_per_s:
        scale = host_adam_params_per_s / H200.host_adam_params_per_s
        kw.update(host_adam_params_per_s=host_adam_params_per_s,
                  host_adam_fp32_params_per_s=H200.host_adam_fp32_params_per_s * scale)
    hosts = "host AdamW as given" if host_adam_params_per_s else "host rates the H200 host's"
    return dataclasses.replace(H200, name=f"{name} (predicted from the datasheet, not measured): {source}; PCIe "
                                          f"Gen{gen} x16, {tflops:g} dense bf16 TFLOPS, {bw:g} TB/s; {hosts}", **kw)


RTX_4090 = card("RTX 4090")
RTX_3090 = card("RTX 3090")
RTX_A6000 = card("RTX A6000")
L40S = card("L40S")
H100_PCIE = card("H100 PCIe")


def largest_models(host_memory: int | str | Hardware, configs=None):
    """The largest model each ``optimizer_state`` fits in a host RAM, at each of a few model widths.

    Counts the host store and staging exactly as preflight does (``preflight.host_table``), in what the RAM
    leaves after the process's runtime (``Hardware.host_runtime_bytes``, 2 GiB) and ``longcontext.HOST_MARGIN``;
    a width keeps its embedding and layer shape and grows or shrinks in depth.

    Args:
        host_memory: bytes, a string such as "251GB", or a ``Hardware`` (its ``host_mem_bytes``).
        configs: as ``host_table``'s (None: Qwen2.5 3B, 7B, 14B, 32B).
    Returns:
        pandas DataFrame, one row per model width: ``like`` (the model whose width it is), ``host_GiB``, then
        for each optimizer_state the largest parameter count in billions (0: not even the embedding and head).
    Raises:
        ValueError: a bad ``host_memory``.
    Example:
        >>> largest_models("251GB").set_index("like").loc["14B"].round(1).to_dict()  # doctest: +SKIP
        {'host_GiB': 233.8, 'fp32': 15.9, 'int8': 27.4, 'int4': 31.0}
    """
    from .longcontext import HOST_MARGIN
    from .preflight import host_table

    ram = host_memory.host_mem_bytes if isinstance(host_memory, Hardware) else parse_bytes(host_memory, "host_memory")
    usable = max(0, ram - H200.host_runtime_bytes - HOST_MARGIN)
    t = host_table(configs, host_bytes=usable)
    out = t.pivot(index="model", columns="optimizer_state", values="max_params") / 1e9
    out = out[[c for c in ("fp32", "int8", "int4") if c in out.columns]].reindex(t["model"].unique())
    out.columns.name = None
    return out.rename_axis("like").reset_index().assign(host_GiB=ram / _GIB)[["like", "host_GiB", *out.columns]]


def table(models=("7B", "14B"), batch: int = 4, seq: int = 1024, host_memory: int | str = "128GiB",
          optimizer_state: str = "fp32"):
    """Every card's predicted steady step for Qwen2.5 models under the defaults (placement "auto", the master
    pinned and cast on the device), labelled as predictions (Note: [Predicted cards]).

    Args:
        models: keys of ``shape.QWEN25``.
        batch, seq: the step's shape.
        host_memory: each machine's host RAM.
        optimizer_state: "fp32", "int8" or "int4": the moments the plans' host stores hold.
    Returns:
        pandas DataFrame, one row per card and model: card, device_GiB, pcie_gen, dense_bf16_TFLOPS (datasheet),
        model, optimizer_state, batch, seq, predicted_step_s, predicted_model_TFLOPS, resident_units, fits_host, largest_fp32_B /
        largest_int8_B (the largest model of that width the host RAM holds: ``largest_models``).
    Example:
        >>> table(("7B",))[["card", "predicted_model_TFLOPS"]]  # doctest: +SKIP
    """
    import warnings

    import pandas as pd

    from .planner import plan
    from .shape import QWEN25, model_shape

    big = largest_models(host_memory).set_index("like")
    rows = []
    for name, (mem, gen, tflops, _, _) in CARDS.items():
        hw = card(name, host_memory=host_memory)
        for m in models:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # a plan that does not fit still predicts; fits_host says so
                p = plan(QWEN25[m], batch=batch, seq=seq, hardware=hw, placement="auto", cast_on_device=True,
                         optimizer_state=optimizer_state)
            step_s = p.steady_step_ms / 1e3
            rows.append(dict(card=name, device_GiB=mem / _GIB, pcie_gen=gen, dense_bf16_TFLOPS=tflops, model=m,
                             optimizer_state=optimizer_state, batch=batch, seq=seq, predicted_step_s=round(step_s, 2),
                             predicted_model_TFLOPS=round(6 * model_shape(QWEN25[m])["n_params"] * batch * seq / step_s
                                                          / 1e12, 1),
                             resident_units=sum(c == "resident" for c in p.placement.values()), fits_host=p.fits_host,
                             largest_fp32_B=round(big.loc[m, "fp32"], 1), largest_int8_B=round(big.loc[m, "int8"], 1)))
    return pd.DataFrame(rows)


# The MegaTrain paper's measurements on cards, as it reports them (14B, 251 GB of host RAM).
PAPER = {"RTX 3090": 30.19, "RTX A6000": 56.82}


def paper_comparison(batch: int = 8, seq: int = 1024, host_memory: int | str = "251GB"):
    """Our predicted model TFLOPS for Qwen2.5-14B beside the MegaTrain paper's measured figure on each card it
    measured (Note: [Predicted cards]: a prediction, not a measurement, and not fitted to the paper).

    Args:
        batch, seq: the step's shape (the paper's own is not encoded here: an assumption, printed in the table).
        host_memory: the paper's machines' host RAM.
    Returns:
        pandas DataFrame, one row per card: card, batch, seq, predicted_model_TFLOPS (our planner, placement
        "auto", steady state), paper_measured_TFLOPS, predicted_over_paper, fits_host.
    Example:
        >>> paper_comparison()[["card", "predicted_model_TFLOPS", "paper_measured_TFLOPS"]]  # doctest: +SKIP
    """
    import warnings

    import pandas as pd

    from .planner import plan
    from .shape import QWEN25, model_shape

    config = QWEN25["14B"]
    N = model_shape(config)["n_params"]
    rows = []
    for name, measured in PAPER.items():
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # a plan that does not fit still predicts; fits_host says so
            p = plan(config, batch=batch, seq=seq, hardware=card(name, host_memory=host_memory), placement="auto",
                     cast_on_device=True)
        tflops = 6 * N * batch * seq / (p.steady_step_ms / 1e3) / 1e12
        rows.append(dict(card=name, batch=batch, seq=seq, predicted_model_TFLOPS=round(tflops, 2),
                         paper_measured_TFLOPS=measured, predicted_over_paper=round(tflops / measured, 2),
                         fits_host=p.fits_host))
    return pd.DataFrame(rows)
