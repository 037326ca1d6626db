"""cards.py: datasheet profiles of consumer and workstation cards (predictions, labelled so), the largest model
a host RAM holds, and our prediction beside the MegaTrain paper's measured figures."""
from __future__ import annotations

import pytest

from megatrain_nb.machine import cards, planner
from megatrain_nb.machine.preflight import host_table
from megatrain_nb.machine.shape import QWEN25

GiB = 1 << 30


@pytest.mark.parametrize("name, mem_gib, gen, tflops", [
    ("RTX 4090", 24, 4, 165.2), ("RTX 3090", 24, 4, 71.0), ("RTX A6000", 48, 4, 154.8), ("L40S", 48, 4, 362.05),
    ("H100 PCIe", 80, 5, 756.0),
])
def test_presets_follow_the_datasheet_and_say_predicted(name, mem_gib, gen, tflops):
    hw = cards.card(name, host_memory="64GB")
    assert "predicted from the datasheet, not measured" in hw.name and hw.name.startswith(name)
    assert hw.device_mem_bytes == mem_gib * GiB and hw.host_mem_bytes == 64 * 10**9
    assert hw.h2d_GBps == pytest.approx(planner.H200.h2d_GBps * (0.5 if gen == 4 else 1.0))  # Gen4 x16: half Gen5's
    assert hw.bf16_tflops / planner.H200.bf16_tflops == pytest.approx(tflops / 989.0)  # the H200's layer efficiency
    preset = {"RTX 4090": cards.RTX_4090, "RTX 3090": cards.RTX_3090, "RTX A6000": cards.RTX_A6000,
              "L40S": cards.L40S, "H100 PCIe": cards.H100_PCIE}[name]
    assert preset.device_mem_bytes == hw.device_mem_bytes and preset.host_mem_bytes == 128 * GiB


def test_card_errors_and_host_rate():
    with pytest.raises(ValueError, match="RTX 4090"):
        cards.card("RTX 5090")
    with pytest.raises(ValueError, match="host_memory"):
        cards.card("RTX 4090", host_memory="lots")
    hw = cards.card("RTX 4090", host_adam_params_per_s=1.74e9)
    assert hw.host_adam_params_per_s == 1.74e9 and hw.host_adam_fp32_params_per_s == pytest.approx(1.95e9, rel=0.01)


def test_what_would_my_card_do():
    """A 7B on an RTX 4090 with 128 GiB of RAM: the layers stream through 24 GiB; 64 GB of RAM cannot hold its store."""
    hw = cards.card("RTX 4090", host_memory="128GiB")
    p = planner.plan(QWEN25["7B"], batch=4, seq=1024, hardware=hw, placement="auto", cast_on_device=True)
    assert p.fits_device and p.fits_host and p.steady_step_ms > 0
    with pytest.warns(UserWarning, match="host RAM"):
        small = planner.plan(QWEN25["7B"], batch=4, seq=1024, hardware=cards.card("RTX 4090", host_memory="64GB"),
                             placement="auto", cast_on_device=True)
    assert not small.fits_host
    faster = planner.plan(QWEN25["7B"], batch=4, seq=1024, hardware=cards.H100_PCIE, placement="auto", cast_on_device=True)
    assert faster.steady_step_ms < p.steady_step_ms  # 4.6x the tensor rate, twice the PCIe


def test_largest_models_follow_the_host_table():
    df = cards.largest_models("251GB")
    assert list(df.columns) == ["like", "host_GiB", "fp32", "int8", "int4"] and list(df["like"]) == list(QWEN25)
    assert (df["fp32"] < df["int8"]).all() and (df["int8"] < df["int4"]).all()  # fewer moment bytes, more parameters
    row = df.set_index("like").loc["14B"]
    assert row["fp32"] > 14.7  # the paper trained Qwen2.5-14B (14.77B) in 251 GB with fp32 moments
    usable = 251 * 10**9 - planner.H200.host_runtime_bytes - (4 << 30)
    t = host_table(host_bytes=usable).set_index(["model", "optimizer_state"])
    assert row["int8"] == t.loc[("14B", "int8"), "max_params"] / 1e9  # one count, preflight's
    assert (cards.largest_models(cards.RTX_4090)["fp32"] < df["fp32"]).all()  # 128 GiB holds less than 251 GB


def test_paper_comparison_puts_our_prediction_beside_its_measurement():
    df = cards.paper_comparison()
    assert list(df["card"]) == ["RTX 3090", "RTX A6000"]
    assert list(df["paper_measured_TFLOPS"]) == [30.19, 56.82]
    assert (df["predicted_model_TFLOPS"] > 0).all() and df["fits_host"].all()
    assert df["predicted_over_paper"].tolist() == (df["predicted_model_TFLOPS"] / df["paper_measured_TFLOPS"]).round(2).tolist()
    a6000, rtx3090 = df.set_index("card")["predicted_model_TFLOPS"][["RTX A6000", "RTX 3090"]]
    assert a6000 > rtx3090  # as the paper measured: the A6000's tensor rate is twice the 3090's in bf16


def test_table_predicts_every_card_and_agrees_with_its_parts():
    t = cards.table(("7B",), host_memory="128GiB")
    assert list(t["card"]) == list(cards.CARDS) and (t["predicted_step_s"] > 0).all() and t["fits_host"].all()
    row = t.set_index("card").loc["RTX 3090"]
    p = planner.plan(QWEN25["7B"], batch=4, seq=1024, hardware=cards.RTX_3090, placement="auto", cast_on_device=True)
    assert row["predicted_step_s"] == round(p.steady_step_ms / 1e3, 2)
    assert row["largest_fp32_B"] == round(cards.largest_models("128GiB").set_index("like").loc["7B", "fp32"], 1)
