"""Bad input fails early, with a message naming the value or setting, and leaves the session intact:
after a rejected batch the session trains on exactly as a twin that never saw it (bitwise)."""
from __future__ import annotations

import json
import math
import shutil
import threading

import pytest
import torch
from transformers import AutoModelForCausalLM, BertConfig, T5Config

from conftest import VOCAB, make_batches, make_config, train_session
from megatrain_nb import Session
from megatrain_nb.model.hf import UnsupportedModelError


@pytest.fixture(scope="module")
def llama_dir(hf_dir):
    return hf_dir("llama")


def _copy(src, dst, *, skip=()):
    dst.mkdir()
    for f in src.iterdir():
        if f.name not in skip:
            shutil.copy(f, dst / f.name)
    return dst


# ---- the model directory ---------------------------------------------------------------------
def test_missing_directory(tmp_path):
    with pytest.raises(FileNotFoundError, match="no-such-model"):
        Session.from_pretrained(tmp_path / "no-such-model")


def test_directory_without_config(llama_dir, tmp_path):
    d = _copy(llama_dir, tmp_path / "m", skip={"config.json"})
    with pytest.raises(FileNotFoundError, match="config.json"):
        Session.from_pretrained(d)


def test_directory_without_weights(llama_dir, tmp_path):
    d = _copy(llama_dir, tmp_path / "m", skip={"model.safetensors"})
    with pytest.raises(FileNotFoundError, match=r"model\.safetensors"):
        Session.from_pretrained(d)


@pytest.mark.parametrize("keep", [0.5, 100, 4])
def test_truncated_safetensors(llama_dir, tmp_path, keep):
    d = _copy(llama_dir, tmp_path / "m")
    f = d / "model.safetensors"
    data = f.read_bytes()
    f.write_bytes(data[:int(len(data) * keep) if isinstance(keep, float) else keep])
    with pytest.raises(ValueError, match=r"model\.safetensors is not a readable safetensors file"):
        Session.from_pretrained(d)


def test_shard_named_in_index_missing(hf_dir, tmp_path):
    d = _copy(hf_dir("llama", max_shard_size="20KB"), tmp_path / "m")
    shards = sorted(set(json.loads((d / "model.safetensors.index.json").read_text())["weight_map"].values()))
    (d / shards[1]).unlink()
    with pytest.raises(FileNotFoundError, match=shards[1].replace(".", r"\.")):
        Session.from_pretrained(d)


def test_weights_of_another_shape(hf_dir, llama_dir, tmp_path):
    d = _copy(llama_dir, tmp_path / "m", skip={"config.json"})
    shutil.copy(hf_dir("llama", intermediate_size=48) / "config.json", d / "config.json")
    with pytest.raises(ValueError, match=r"mlp\.\w+_proj\.weight has shape .* config\.json implies"):
        Session.from_pretrained(d)


def test_encoder_decoder_is_unsupported():
    cfg = T5Config(vocab_size=64, d_model=32, num_layers=1, num_heads=2, d_ff=32, d_kv=16)
    with pytest.raises(UnsupportedModelError, match="T5Config is encoder-decoder"):
        Session.from_config(cfg)


def test_bert_is_unsupported(tmp_path):
    cfg = BertConfig(vocab_size=64, hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                     intermediate_size=32, is_decoder=True)
    AutoModelForCausalLM.from_config(cfg).save_pretrained(str(tmp_path))
    with pytest.raises(UnsupportedModelError, match="BertLMHeadModel has no model.model"):
        Session.from_pretrained(tmp_path)


# ---- settings ------------------------------------------------------------------------------
BAD_SETTINGS = [
    (dict(lrr=1e-3), TypeError, r"unknown setting.*'lrr'"),
    (dict(lr=-1), ValueError, r"lr=-1\b"),
    (dict(lr=float("nan")), ValueError, r"lr=nan"),
    (dict(betas=(1.0, 0.999)), ValueError, r"betas=\(1\.0, 0\.999\)"),
    (dict(eps=0.0), ValueError, r"eps=0\.0"),
    (dict(weight_decay=-0.1), ValueError, r"weight_decay=-0\.1"),
    (dict(checkpoint_every=-1), ValueError, r"checkpoint_every=-1"),
    (dict(checkpoint_every=1.5), ValueError, r"checkpoint_every=1\.5"),
    (dict(micro_batch_size=0), ValueError, r"micro_batch_size=0"),
    (dict(weight_slots=1), ValueError, r"weight_slots=1"),
    (dict(grad_clip=0), ValueError, r"grad_clip=0"),
    (dict(lr_schedule="foo"), ValueError, r"lr_schedule='foo'"),
    (dict(lr_schedule="cosine"), ValueError, r"lr_schedule='cosine' needs total_steps"),
    (dict(lr_schedule="linear", warmup_steps=4, total_steps=4), ValueError, r"total_steps=4, warmup_steps=4"),
    (dict(warmup_steps=-1), ValueError, r"warmup_steps=-1"),
    (dict(device="mps"), ValueError, r"device='mps'"),
    (dict(device="tpu"), ValueError, r"device='tpu'"),  # not a torch device type at all
    (dict(dtype=torch.int8), ValueError, r"dtype=torch\.int8"),
    (dict(betas=(0.5,)), ValueError, r"betas=\(0\.5,\): must be two numbers"),
    (dict(betas=0.9), ValueError, r"betas=0\.9: must be two numbers"),
    (dict(betas=(0.9, "0.99")), ValueError, r"betas=\(0\.9, '0\.99'\)"),
    (dict(eps="1e-8"), ValueError, r"eps='1e-8': must be a finite number"),
    (dict(eps=float("inf")), ValueError, r"eps=inf"),
    (dict(weight_decay=float("nan")), ValueError, r"weight_decay=nan"),
    (dict(grad_clip="1.0"), ValueError, r"grad_clip='1\.0'"),
    (dict(lr=True), ValueError, r"lr=True"),
    (dict(warmup_steps=2.5), ValueError, r"warmup_steps=2\.5: must be an int"),
    (dict(total_steps="100"), ValueError, r"total_steps='100': must be an int"),
    (dict(compact_keep_fp32=3), ValueError, r"compact_keep_fp32=3"),
    (dict(micro_batch_size="2"), ValueError, r"micro_batch_size='2': must be an int"),
    (dict(transfer_chunk_bytes="64M"), ValueError, r"transfer_chunk_bytes='64M'"),
    (dict(pinned_budget_bytes=1.5), ValueError, r"pinned_budget_bytes=1\.5"),
    (dict(overlap_optimizer="no"), ValueError, r"overlap_optimizer='no': use True or False"),
    (dict(pin_store="yes"), ValueError, r"pin_store='yes'"),
    (dict(offload_checkpoints=1), ValueError, r"offload_checkpoints=1"),
    (dict(trace="off"), ValueError, r"trace='off'"),
    (dict(activation_budget="0.5"), ValueError, r"activation_budget='0\.5'"),
]


@pytest.mark.parametrize("settings, error, match", [
    p if isinstance(p, type(pytest.param(0))) else
    pytest.param(*p, id=",".join(f"{k}={v}" for k, v in p[0].items())) for p in BAD_SETTINGS])
def test_bad_settings(llama_dir, settings, error, match):
    with pytest.raises(error, match=match):
        Session.from_pretrained(llama_dir, **settings)
    with pytest.raises(error, match=match):
        Session.from_config(make_config("llama"), **settings)


def test_resume_with_bad_settings_names_the_field(llama_dir, tmp_path):
    s = Session.from_pretrained(llama_dir, lr=2e-3)
    try:
        train_session(s, make_batches(VOCAB, 1))
        s.save_checkpoint(tmp_path / "ck")
    finally:
        s.close()
    for settings, match in [(dict(betas=(0.5,)), r"betas=\(0\.5,\): must be two numbers"),
                            (dict(eps=-1.0), r"eps=-1\.0: must be > 0"),
                            (dict(overlap_optimizer=None), r"overlap_optimizer=None: use True or False")]:
        with pytest.raises(ValueError, match=match):
            Session.resume(tmp_path / "ck", **settings)


def test_labels_none_is_as_if_absent(llama_dir):
    """HF's convention: ``labels=None`` means the inputs are the labels."""
    b = make_batches(VOCAB, 1, seed=3)[0]
    losses = []
    for batch in ({"input_ids": b["input_ids"]}, {"input_ids": b["input_ids"], "labels": None}):
        s = Session.from_pretrained(llama_dir, lr=2e-3)
        try:
            losses.append(s.step(batch).loss)
        finally:
            s.close()
    assert losses[0] == losses[1]


# ---- batches: rejected before any state changes -------------------------------------------------
def _batch(**change):
    b = make_batches(VOCAB, 1, seed=99)[0]
    b["attention_mask"] = torch.ones_like(b["input_ids"])
    for k, v in change.items():
        if v is None:
            b.pop(k)
        else:
            b[k] = v(b) if callable(v) else v
    return b


def _set(t, idx, value):
    t = t.clone()
    t[idx] = value
    return t


BAD_BATCHES = {
    "id_at_vocab": (lambda: _batch(input_ids=lambda b: _set(b["input_ids"], (1, 3), VOCAB)),
                    ValueError, rf"token id {VOCAB}\b.*\[0, {VOCAB}\)"),
    "negative_id": (lambda: _batch(input_ids=lambda b: _set(b["input_ids"], (0, 0), -5)),
                    ValueError, r"token id -5\b"),
    "label_out_of_range": (lambda: _batch(labels=lambda b: _set(b["labels"], (0, 4), 1000)),
                           ValueError, r"labels holds 1000\b"),
    "label_negative": (lambda: _batch(labels=lambda b: _set(b["labels"], (0, 4), -1)),
                       ValueError, r"labels holds -1\b"),
    "labels_shape": (lambda: _batch(labels=lambda b: b["labels"][:, :-1]),
                     ValueError, r"labels has shape \(2, 11\) but input_ids has \(2, 12\)"),
    "empty_rows": (lambda: _batch(input_ids=torch.zeros(0, 8, dtype=torch.long), labels=None, attention_mask=None),
                   ValueError, r"\(0, 8\).*empty"),
    "empty_cols": (lambda: _batch(input_ids=torch.zeros(2, 0, dtype=torch.long), labels=None, attention_mask=None),
                   ValueError, r"\(2, 0\).*empty"),
    "one_dim_ids": (lambda: _batch(input_ids=lambda b: b["input_ids"][0], labels=None, attention_mask=None),
                    ValueError, r"input_ids has shape \(12,\)"),
    "float_ids": (lambda: _batch(input_ids=lambda b: b["input_ids"].float()),
                  TypeError, r"input_ids has dtype torch\.float32"),
    "bool_ids": (lambda: _batch(input_ids=lambda b: b["input_ids"] > 5),
                 TypeError, r"input_ids has dtype torch\.bool"),
    "float_labels": (lambda: _batch(labels=lambda b: b["labels"].double()),
                     TypeError, r"labels has dtype torch\.float64"),
    "mask_value_2": (lambda: _batch(attention_mask=lambda b: _set(b["attention_mask"], (0, 2), 2)),
                     ValueError, r"attention_mask"),
    "mask_shape": (lambda: _batch(attention_mask=lambda b: b["attention_mask"][:1]),
                   ValueError, r"attention_mask has shape \(1, 12\)"),
    "all_labels_ignored": (lambda: _batch(labels=lambda b: torch.full_like(b["labels"], -100)),
                           ValueError, r"no supervised tokens"),
    "only_first_label": (lambda: _batch(labels=lambda b: _set(torch.full_like(b["labels"], -100), (slice(None), 0), 7)),
                         ValueError, r"no supervised tokens.*after shifting"),  # position 0 is never a target
    "no_input_ids": (lambda: _batch(input_ids=None), TypeError, r"'input_ids'"),
    "not_a_dict": (lambda: [make_batches(VOCAB, 1)[0]["input_ids"]], TypeError, r"batch must be a dict"),
    "ids_none": (lambda: _batch(input_ids=lambda b: None), TypeError, r"input_ids is None: it must be a tensor"),
    "ids_meta": (lambda: _batch(input_ids=lambda b: b["input_ids"].to("meta")), TypeError,
                 r"input_ids is a meta tensor"),
    "ids_string": (lambda: _batch(input_ids="the cat sat"), TypeError, r"input_ids is 'the cat sat'"),
    "ids_ragged": (lambda: _batch(input_ids=[[1, 2, 3], [4]], labels=None, attention_mask=None), TypeError,
                   r"input_ids of type list cannot be read"),
    "labels_meta": (lambda: _batch(labels=lambda b: b["labels"].to("meta")), TypeError, r"labels is a meta tensor"),
    "mask_string": (lambda: _batch(attention_mask="all"), TypeError, r"attention_mask is 'all'"),
}


@pytest.fixture(scope="module")
def twin_losses(llama_dir):
    """Losses and final state of a session that only ever saw good batches."""
    s = Session.from_pretrained(llama_dir, lr=2e-3)
    try:
        losses = train_session(s, make_batches(VOCAB, 3))
    finally:
        s.close()  # applies the pending updates
    state = {u: (unit.master.clone(), unit.exp_avg.clone(), unit.exp_avg_sq.clone())
             for u, unit in s.store.units.items()}
    return losses, state


@pytest.mark.parametrize("case", list(BAD_BATCHES))
def test_bad_batch_is_rejected_and_harmless(llama_dir, twin_losses, case):
    make_bad, error, match = BAD_BATCHES[case]
    want, want_state = twin_losses
    good = make_batches(VOCAB, 3)
    s = Session.from_pretrained(llama_dir, lr=2e-3)
    try:
        with pytest.raises(error, match=match):  # before the first step: nothing decided yet
            s.step(make_bad())
        got = train_session(s, good[:1])
        with pytest.raises(error, match=match):  # between steps
            s.step(make_bad())
        got += train_session(s, good[1:])
    finally:
        s.close()  # applies the pending updates
    assert got == want, f"after a rejected {case} batch the losses drift: {got} vs {want}"
    assert len(s.history) == 3 and s.engine.steps_done == 3
    for u, unit in s.store.units.items():
        for a, b in zip((unit.master, unit.exp_avg, unit.exp_avg_sq), want_state[u]):
            assert torch.equal(a, b), f"unit {u} differs from the twin's"


# ---- a step that fails inside, or is interrupted (Stop in a notebook) -----------------------------
def _within(fn, seconds: float):
    """Run fn in a daemon thread; returns (finished, result or exception)."""
    out: dict = {}

    def target():
        try:
            out["value"] = fn()
        except BaseException as e:  # handed back to the test
            out["error"] = e

    t = threading.Thread(target=target, daemon=True)
    t.start()
    t.join(seconds)
    return not t.is_alive(), out.get("error", out.get("value"))


class LayerError(RuntimeError):
    pass


def _fail_call(monkeypatch, n: int):
    """Make the engine's n-th layer/norm call from now on raise LayerError."""
    import megatrain_nb.step.engine as engine_module

    real, count = engine_module.call, [0]

    def call(*args, **kwargs):
        count[0] += 1
        if count[0] == n:
            raise LayerError(f"simulated failure at engine call {n}")
        return real(*args, **kwargs)

    monkeypatch.setattr(engine_module, "call", call)
    return lambda: monkeypatch.setattr(engine_module, "call", real)


def _train_on(s, batches) -> tuple:
    """Train on after a failed step, within 5 s (a deadlock must fail the test, not hang it); then close.

    Returns (losses or the exception raised, whether close() returned in time).
    """
    finished, result = _within(lambda: train_session(s, batches), 5)
    closed = finished and _within(s.close, 5)[0]
    if not closed:
        s.engine.abort.set()  # release the stuck threads
    assert finished, "the session deadlocked on a step after the interrupted one"
    return result, closed


def test_step_failing_in_forward_leaves_session_as_if_never_called(llama_dir, twin_losses, monkeypatch):
    """A step that fails in the forward (an exception inside a layer), before any gradient exists:
    nothing may have changed, so the session goes on exactly as the twin that never saw the call.
    Regression: the abandoned step used to leave the Adam worker waiting on its loss forever, so the
    next step's update was silently lost and the one after deadlocked."""
    want, want_state = twin_losses
    good = make_batches(VOCAB, 3)
    s = Session.from_pretrained(llama_dir, lr=2e-3)
    got = train_session(s, good[:1])
    restore = _fail_call(monkeypatch, 2)  # the forward of layer 1
    with pytest.raises(LayerError):
        s.step(good[1])
    restore()
    result, closed = _train_on(s, good[1:])
    assert not isinstance(result, BaseException), result
    assert got + result == want
    assert len(s.history) == 3 and s.engine.steps_done == 3
    assert closed, "close() hung"
    for u, unit in s.store.units.items():
        for a, b in zip((unit.master, unit.exp_avg, unit.exp_avg_sq), want_state[u]):
            assert torch.equal(a, b), f"unit {u} differs from the twin's"


def test_step_failing_in_backward_never_hangs(llama_dir, monkeypatch):
    """A step that fails in the backward, after some units may have been updated: the next steps
    train (or raise an error that says why) and close() returns; nothing ever hangs."""
    good = make_batches(VOCAB, 3)
    s = Session.from_pretrained(llama_dir, lr=2e-3, checkpoint_every=1)
    train_session(s, good[:1])
    restore = _fail_call(monkeypatch, 4)  # fwd 0, fwd 1, final norm, then the recompute of layer 1
    with pytest.raises(LayerError):
        s.step(good[1])
    restore()
    result, closed = _train_on(s, good[1:])
    assert isinstance(result, Exception) and str(result) or all(map(math.isfinite, result)), result
    assert s.engine.steps_done == 3 and len(s.history) == 3  # the failed step is not counted
    assert closed, "close() hung"


def test_ctrl_c_during_a_step_finishes_it_then_raises(llama_dir, twin_losses, monkeypatch, sigint_raises):
    """Jupyter's Stop (KeyboardInterrupt in the calling thread) mid-step: the step completes, is
    recorded, and only then is the interrupt raised; training goes on exactly as the twin's."""
    import _thread

    want, want_state = twin_losses
    good = make_batches(VOCAB, 3)
    s = Session.from_pretrained(llama_dir, lr=2e-3)
    try:
        got = train_session(s, good[:1])
        import megatrain_nb.step.engine as engine_module

        real, fired = engine_module.call, []

        def call(*args, **kwargs):
            if not fired:
                fired.append(True)
                _thread.interrupt_main()  # the user presses Stop while layer 0 computes
            return real(*args, **kwargs)

        monkeypatch.setattr(engine_module, "call", call)
        with pytest.warns(UserWarning, match="finishing the current step"), pytest.raises(KeyboardInterrupt):
            s.step(good[1])
        monkeypatch.setattr(engine_module, "call", real)
        assert fired and len(s.history) == 2
        got.append(s.history[-1].loss)
        got += train_session(s, good[2:])
    finally:
        s.close()
    assert got == want
    for u, unit in s.store.units.items():
        assert torch.equal(unit.master, want_state[u][0]), u


def test_out_of_memory_in_a_step_gives_advice_and_the_session_goes_on(llama_dir, twin_losses, monkeypatch):
    """A CUDA OOM inside the forward (simulated: torch.OutOfMemoryError from a layer call) is re-raised
    with the memory advice of preflight.oom_advice, and training afterwards equals the twin's."""
    import megatrain_nb.step.engine as engine_module

    want, _ = twin_losses
    good = make_batches(VOCAB, 3)
    s = Session.from_pretrained(llama_dir, lr=2e-3)
    got = train_session(s, good[:1])
    real = engine_module.call

    def oom(*args, **kwargs):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB.")

    monkeypatch.setattr(engine_module, "call", oom)
    with pytest.raises(torch.OutOfMemoryError, match="micro_batch_size|checkpoint_every") as info:
        s.step(good[1])
    assert "Tried to allocate" in str(info.value.__cause__)
    monkeypatch.setattr(engine_module, "call", real)
    assert got + train_session(s, good[1:]) == want
    s.close()
