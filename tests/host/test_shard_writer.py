"""shard_writer: safetensors files written tensor by tensor equal what safetensors reads back, cast and sharded."""
import json

import pytest
import torch
from safetensors.torch import load_file

from megatrain_nb.host import shard_writer


def _units():
    g = torch.Generator().manual_seed(0)
    return [{"a.weight": torch.randn(100, 7, generator=g), "a.ids": torch.arange(5)},
            {"b.weight": torch.randn(333, generator=g)[::3], "c.weight": torch.randn(2, 3, 4, generator=g)}]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("shard", [1 << 30, 1000])
def test_shards_read_back_equal(tmp_path, monkeypatch, dtype, shard):
    monkeypatch.setattr(shard_writer, "CHUNK_BYTES", 64)  # many pieces a tensor
    units = _units()
    names = shard_writer.write(tmp_path, lambda: iter(units), dtype=dtype, max_shard_bytes=shard,
                               single="model.safetensors", index="index.json")
    got = {}
    for n in names:
        got.update(load_file(str(tmp_path / n)))
    want = {k: (v.to(dtype) if v.is_floating_point() else v) for u in units for k, v in u.items()}
    assert got.keys() == want.keys()
    for k in want:
        assert got[k].dtype == want[k].dtype and torch.equal(got[k], want[k]), k
    if shard == 1000:
        assert len(names) > 1 and not list(tmp_path.glob("model-partial-*"))
        assert set(json.loads((tmp_path / "index.json").read_text())["weight_map"]) == set(want)
    else:
        assert names == ["model.safetensors"]


def test_a_unit_that_changes_between_plan_and_write_raises(tmp_path):
    calls = []

    def units():
        calls.append(1)
        return iter([{"x": torch.zeros(len(calls) + 2)}])
    with pytest.raises(RuntimeError, match="changed between the plan and the write"):
        shard_writer.write(tmp_path, units, dtype=torch.float32, max_shard_bytes=1 << 20, single="m.safetensors",
                           index="i.json")
    assert not list(tmp_path.glob("*.safetensors"))
