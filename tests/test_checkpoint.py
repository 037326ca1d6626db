"""checkpoint.py: a run stopped, saved and resumed equals the uninterrupted run bit for bit; saves are
atomic; a damaged checkpoint fails with an error that names the file."""
from __future__ import annotations

import json
import os
import random

import pytest
import torch

from conftest import make_batches, make_config
from megatrain_nb import Session
from megatrain_nb.host import checkpoint as ckpt
from megatrain_nb import Session as _Session
resume = _Session.resume
from megatrain_nb.host.checkpoint import save_checkpoint

STEPS, CUT = 6, 3


def _state(s) -> dict:
    """Every saved slab of a session, after its pending updates."""
    s.engine.drain()
    return {(u, k): getattr(s.store.units[u], k).clone() for u in s.store.order for k in ckpt.KINDS}


def _assert_same(a: dict, b: dict) -> None:
    bad = [key for key in a if not torch.equal(a[key], b[key])]
    assert not bad, f"slabs differ after resume: {bad[:6]}"


CASES = {
    "plain": ("llama", {}),
    "grad_clip": ("llama", dict(grad_clip=0.5)),
    "cosine": ("llama", dict(lr_schedule="cosine", warmup_steps=2, total_steps=STEPS)),
    "micro_batch": ("llama", dict(micro_batch_size=1)),
    "tied": ("llama_tied", {}),
    "moe": ("mixtral", dict(weight_decay=0.1)),
    "moe_qwen3": ("qwen3_moe", dict(grad_clip=1.0)),
}


@pytest.mark.parametrize("case", list(CASES))
def test_resume_is_bitwise(case, tmp_path):
    family, settings = CASES[case]
    cfg = make_config(family)
    batches = make_batches(cfg.vocab_size, STEPS, batch=4 if "micro_batch_size" in settings else 2)

    straight = Session.from_config(cfg, seed=0, **settings)
    losses = [straight.step(b).loss for b in batches]
    want = _state(straight)
    straight.close()

    first = Session.from_config(cfg, seed=0, **settings)
    head = [first.step(b).loss for b in batches[:CUT]]  # no drain: save_checkpoint must wait itself
    save_checkpoint(first, tmp_path / "ck")
    first.close()
    s = resume(tmp_path / "ck")
    assert s.engine.steps_done == CUT and len(s.history) == CUT
    assert [r.loss for r in s.history] == head == losses[:CUT]
    assert s.optim_cfg == first.optim_cfg and s.engine_cfg == first.engine_cfg
    tail = [s.step(b).loss for b in batches[CUT:]]
    assert tail == losses[CUT:]  # bitwise: the same kernels on the same bytes
    _assert_same(_state(s), want)
    assert [s.optim.steps_done(u) for u in s.store.order] == [STEPS] * len(s.store.order)
    assert [r.step for r in s.history] == list(range(1, STEPS + 1))
    assert [r.lr for r in s.history] == [straight.optim_cfg.lr_at(k) for k in range(STEPS)]
    s.close()


def _trained(steps: int = CUT, vocab: int = 96, **settings):
    cfg = make_config("llama", vocab_size=vocab)
    s = Session.from_config(cfg, seed=0, **settings)
    for b in make_batches(cfg.vocab_size, steps):
        s.step(b)
    return s


def test_rng_data_state_and_config_roundtrip(tmp_path):
    s = _trained()
    s.data_state = {"epoch": 1, "index": 7, "seed": 0, "num_examples": 20}
    torch.manual_seed(123), random.seed(5)
    save_checkpoint(s, tmp_path / "ck")
    want_t, want_r = torch.rand(4), random.random()
    torch.manual_seed(999), random.seed(999)  # scramble: resume must put the saved states back
    r = resume(tmp_path / "ck")
    assert torch.equal(torch.rand(4), want_t) and random.random() == want_r
    assert r.data_state == s.data_state
    assert r.config.to_dict() == s.config.to_dict()
    assert r.config._attn_implementation == s.config._attn_implementation
    s.close(), r.close()


def test_history_with_a_skipped_step_roundtrips(tmp_path):
    import dataclasses
    import math

    s = _trained(2)
    s.history[-1] = dataclasses.replace(s.history[-1], loss=float("nan"), grad_norm=float("inf"), skipped=True)
    s.skipped_steps = 1
    save_checkpoint(s, tmp_path / "ck")
    r = resume(tmp_path / "ck")
    assert r.skipped_steps == 1 and r.history[0] == s.history[0]
    last = r.history[-1]
    assert math.isnan(last.loss) and last.grad_norm == float("inf") and last.skipped is True
    s.close(), r.close()


def test_explicit_data_state_wins_and_default_is_none(tmp_path):
    s = _trained(1)
    save_checkpoint(s, tmp_path / "a")
    r = resume(tmp_path / "a")
    assert r.data_state is None
    r.close()
    s.data_state = {"index": 1}
    save_checkpoint(s, tmp_path / "b", data_state={"index": 2})
    r = resume(tmp_path / "b")
    assert r.data_state == {"index": 2}
    r.close()
    with pytest.raises(ValueError, match="JSON"):
        save_checkpoint(s, tmp_path / "c", data_state={"x": object()})
    assert not (tmp_path / "c").exists()
    s.close()


def test_overrides_change_engine_settings(tmp_path):
    s = _trained()
    save_checkpoint(s, tmp_path / "ck")
    r = resume(tmp_path / "ck", micro_batch_size=1, lr=5e-4)
    assert r.engine_cfg.micro_batch_size == 1 and r.optim_cfg.lr == 5e-4
    assert r.engine.keep is None  # an engine override: the activation policy is decided afresh
    r.step(make_batches(r.config.vocab_size, 1)[0])
    with pytest.raises(TypeError, match="unknown setting"):
        resume(tmp_path / "ck", not_a_setting=1)
    s.close(), r.close()


def test_sharded_slabs_roundtrip(tmp_path):
    """Slabs larger than max_shard_bytes are split into pieces across files and reassembled."""
    cfg = make_config("llama", vocab_size=9000)  # embedding: 288,000 fp32 elements = 1.1 MiB per slab
    s = Session.from_config(cfg, seed=0)
    s.step(make_batches(cfg.vocab_size, 1)[0])
    save_checkpoint(s, tmp_path / "ck", max_shard_bytes=1 << 20)
    state = json.loads((tmp_path / "ck" / ckpt.STATE).read_text())
    assert len(state["files"]) > 3
    assert all(os.path.getsize(tmp_path / "ck" / f) <= (1 << 20) + 4096 for f in state["files"])  # + header
    assert len(state["tensors"]["unit.-1.master"]) == 2  # split in two pieces
    r = resume(tmp_path / "ck")
    _assert_same(_state(r), _state(s))
    s.close(), r.close()


def test_save_twice_into_the_same_path(tmp_path):
    cfg = make_config("llama")
    s = Session.from_config(cfg, seed=0)
    batches = make_batches(cfg.vocab_size, 5)
    for b in batches[:2]:
        s.step(b)
    save_checkpoint(s, tmp_path / "ck")
    for b in batches[2:]:
        s.step(b)
    save_checkpoint(s, tmp_path / "ck")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ck"]  # no .old, no .tmp-<pid>
    r = resume(tmp_path / "ck")
    assert r.engine.steps_done == 5 and len(r.history) == 5
    _assert_same(_state(r), _state(s))
    s.close(), r.close()


def test_failure_mid_write_keeps_previous_checkpoint(tmp_path, monkeypatch):
    s = _trained(2, vocab=9000)  # several files at max_shard_bytes=1 MiB: fail while writing the second
    save_checkpoint(s, tmp_path / "ck")
    saved = _state(s)
    s.step(make_batches(s.config.vocab_size, 1, seed=9)[0])

    from megatrain_nb.host import shard_writer

    real, calls = shard_writer.write_file, []

    def failing(f, tensors):
        calls.append(f)
        if len(calls) == 2:
            real(f, tensors)
            with open(f, "r+b") as fh:
                fh.truncate(100)  # half a file on disk, then the "crash"
            raise OSError(28, "No space left on device")
        return real(f, tensors)

    monkeypatch.setattr(shard_writer, "write_file", failing)
    with pytest.raises(OSError, match=r"No space.*MiB"):
        save_checkpoint(s, tmp_path / "ck", max_shard_bytes=1 << 20)
    assert len(calls) == 2
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ck"]  # the temporary directory is gone
    r = resume(tmp_path / "ck")
    assert r.engine.steps_done == 2
    _assert_same(_state(r), saved)
    s.close(), r.close()


def test_crash_between_renames_resumes_from_old(tmp_path, monkeypatch):
    """Where directories cannot be exchanged, the one window where ``path`` is absent: the previous
    checkpoint is at ``path.old``."""
    from megatrain_nb.host import publish

    monkeypatch.setattr(publish, "exchange", lambda a, b: False)  # as on a system without renameat2
    s = _trained(2)
    save_checkpoint(s, tmp_path / "ck")
    saved = _state(s)
    s.step(make_batches(s.config.vocab_size, 1, seed=9)[0])
    real, n = os.rename, []

    def crash_on_second(a, b):
        n.append(1)
        if len(n) == 2:
            raise KeyboardInterrupt  # the process dies after path -> path.old
        real(a, b)

    monkeypatch.setattr(publish.os, "rename", crash_on_second)
    with pytest.raises(KeyboardInterrupt):
        save_checkpoint(s, tmp_path / "ck")
    monkeypatch.setattr(publish.os, "rename", real)
    assert not (tmp_path / "ck").exists() and (tmp_path / "ck.old").is_dir()
    with pytest.warns(UserWarning, match="interrupted"):
        r = resume(tmp_path / "ck")
    _assert_same(_state(r), saved)
    save_checkpoint(s, tmp_path / "ck")  # the next save completes and cleans up
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ck"]
    r2 = resume(tmp_path / "ck")
    assert r2.engine.steps_done == 3
    s.close(), r.close(), r2.close()


# ---- damaged checkpoints -----------------------------------------------------------------------
@pytest.fixture
def saved(tmp_path):
    s = _trained(1)
    path = save_checkpoint(s, tmp_path / "ck", max_shard_bytes=1 << 20)
    s.close()
    return path


def test_missing_path_names_it(tmp_path):
    with pytest.raises(FileNotFoundError, match="nowhere"):
        resume(tmp_path / "nowhere")


def test_wrong_version(saved):
    f = saved / ckpt.STATE
    f.write_text(f.read_text().replace(f'"version": {ckpt.VERSION}', '"version": 99'))
    with pytest.raises(ValueError, match="version 99"):
        resume(saved)


def test_not_a_checkpoint(saved):
    (saved / ckpt.STATE).write_text('{"format": "something else"}')
    with pytest.raises(ValueError, match="state.json"):
        resume(saved)
    (saved / ckpt.STATE).write_text('{"format": "megatrain_nb.checkpoint", "vers')
    with pytest.raises(ValueError, match="corrupt"):
        resume(saved)
    (saved / ckpt.STATE).unlink()
    with pytest.raises(ValueError, match="no state.json"):
        resume(saved)


def test_missing_slab_file(saved):
    name = sorted(saved.glob("slabs-*.safetensors"))[-1].name
    (saved / name).unlink()
    with pytest.raises(ValueError, match=name):
        resume(saved)


def test_truncated_slab_file(saved):
    f = sorted(saved.glob("slabs-*.safetensors"))[0]
    f.write_bytes(f.read_bytes()[:1000])
    with pytest.raises(ValueError, match=f"{f.name}.*truncated"):
        resume(saved)


def test_garbage_slab_file_of_the_right_size(saved):
    f = sorted(saved.glob("slabs-*.safetensors"))[0]
    f.write_bytes(b"\xff" * f.stat().st_size)
    with pytest.raises(ValueError, match=f"{f.name}.*corrupt"):
        resume(saved)


def test_checkpoint_of_another_model(saved):
    f = saved / ckpt.STATE
    state = json.loads(f.read_text())
    state["config"]["intermediate_size"] = 48
    f.write_text(json.dumps(state))
    with pytest.raises(ValueError, match="another config"):
        resume(saved)


# ---- CUDA: bf16 compute, pinned store (master or shadow), the activation policy and the CUDA RNG ---
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("cast_on_device", [None, False], ids=["pinned-master", "pinned-shadow"])
def test_resume_is_bitwise_on_cuda(tmp_path, cast_on_device):
    cfg = make_config("llama", hidden_size=64, intermediate_size=128)
    cfg._attn_implementation = "eager"  # deterministic backward (SDPA's efficient kernel is not)
    settings = dict(device="cuda", grad_clip=1.0, lr_schedule="linear", total_steps=STEPS,
                    cast_on_device=cast_on_device)
    batches = make_batches(cfg.vocab_size, STEPS, batch=2, seq=16)
    straight = Session.from_config(cfg, seed=0, **settings)
    losses = [straight.step(b).loss for b in batches]
    want, keep = _state(straight), list(straight.engine.keep)
    straight.close()

    first = Session.from_config(cfg, seed=0, **settings)
    for b in batches[:CUT]:
        first.step(b)
    torch.cuda.manual_seed(7)
    save_checkpoint(first, tmp_path / "ck")
    rand = torch.rand(3, device="cuda")
    first.close()
    torch.cuda.manual_seed(99)
    s = resume(tmp_path / "ck")
    assert torch.equal(torch.rand(3, device="cuda"), rand)
    assert s.engine_cfg.dtype == torch.bfloat16 and s.engine.keep == keep
    for u in s.store.order:
        unit = s.store.units[u]
        if cast_on_device is None:  # auto: the master itself is pinned, the device casts
            assert unit.shadow is None and unit.master.is_pinned()
        else:
            assert unit.shadow is not None and torch.equal(unit.shadow, unit.master.to(unit.shadow.dtype))
    assert [s.step(b).loss for b in batches[CUT:]] == losses[CUT:]
    _assert_same(_state(s), want)
    s.close()
