"""megatrain_nb.cli: the demo trains, train saves a loadable model, mistakes give one line and exit 2."""
import json
import re
import subprocess
import sys

import pytest
import torch

from megatrain_nb.cli import main


def _losses(out: str) -> tuple[float, float]:
    m = re.search(r"loss: first ([\d.]+), last ([\d.]+)", out)
    assert m, out
    return float(m[1]), float(m[2])


def test_demo_loss_falls(capsys):
    rc = main(["demo", "--steps", "6", "--batch", "2", "--seq", "32", "--device", "cpu"])
    out = capsys.readouterr().out
    first, last = _losses(out)
    assert rc == 0, out
    assert last < first
    m = re.search(r"= ([\d.]+) bytes/param \(([^)]*)\)", out)
    assert m, out
    parts = {k: float(v) for k, v in (p.split(" ") for p in m[2].split(", "))}
    # fp32 master and moments; gradients: no slab, the ring's buffers and the embedding's touched rows (fp32 on CPU)
    assert parts.keys() == {"master", "exp_avg", "exp_avg_sq", "grad_ring", "grad_rows"}, out
    assert float(m[1]) == pytest.approx(sum(parts.values()), abs=0.15)


@pytest.fixture()
def tiny_model(tmp_path):
    """A 2-layer Llama saved as an HF directory (no tokenizer: the byte fallback applies)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                      tie_word_embeddings=False)
    d = tmp_path / "tiny"
    LlamaForCausalLM(cfg).save_pretrained(str(d))
    return d


@pytest.fixture()
def jsonl(tmp_path):
    f = tmp_path / "train.jsonl"
    rows = [{"prompt": "the cat sat on", "response": "the mat"}, {"prompt": "2+2=", "response": "4"},
            {"prompt": "say hi", "response": "hi there"}] * 4  # one record format per file
    f.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return f


def test_train_saves_a_model_transformers_loads(tiny_model, jsonl, tmp_path, capsys):
    from transformers import AutoModelForCausalLM

    out = tmp_path / "out"
    with pytest.warns(UserWarning, match="UTF-8 bytes"):
        rc = main(["train", "--model", str(tiny_model), "--data", str(jsonl), "--steps", "3", "--batch", "2",
                   "--seq", "32", "--lr", "1e-3", "--out", str(out), "--device", "cpu"])
    assert rc == 0, capsys.readouterr().err
    assert f"saved to {out}" in capsys.readouterr().out
    before = AutoModelForCausalLM.from_pretrained(str(tiny_model))
    after = AutoModelForCausalLM.from_pretrained(str(out))
    w0, w1 = before.state_dict(), after.state_dict()
    assert w0.keys() == w1.keys()
    assert all(w1[k].dtype == torch.float32 for k in w1)
    assert not torch.equal(w0["model.layers.0.mlp.up_proj.weight"], w1["model.layers.0.mlp.up_proj.weight"])
    state = json.loads((out / "megatrain_state.json").read_text())
    assert state["steps"] == 3 and len(state["losses"]) == 3
    assert set(state["data"]) == {"epoch", "index", "seed", "num_examples"}


def test_train_copies_the_tokenizer(tiny_model, jsonl, tmp_path):
    from transformers import AutoTokenizer

    from sft_helpers import word_tokenizer

    word_tokenizer(tiny_model)
    out = tmp_path / "out"
    assert main(["train", "--model", str(tiny_model), "--data", str(jsonl), "--steps", "1", "--batch", "2",
                 "--seq", "16", "--out", str(out), "--device", "cpu", "--checkpoint-every", "1"]) == 0
    assert AutoTokenizer.from_pretrained(str(out)).eos_token == "</s>"


def _error(capsys) -> str:
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and "\n" not in err and "Traceback" not in err, err
    return err


@pytest.mark.parametrize("argv, words", [
    ([], ["required", "demo,train"]),
    (["fly"], ["invalid choice", "fly"]),
    (["demo", "--steps", "1"], ["--steps", ">= 2"]),
    (["demo", "--batch", "two"], ["--batch", "'two'"]),
    (["demo", "--device", "tpu"], ["--device", "tpu"]),
    (["demo", "--lr", "-1"], ["--lr", "> 0"]),
    (["train", "--data", "x.jsonl"], ["--model"]),
    (["demo", "--task", "copy", "--seq", "16"], ["period", "seq=16"]),  # a ValueError from data
])
def test_bad_arguments_exit_2_with_one_line(argv, words, capsys):
    assert main(argv) == 2
    err = _error(capsys)
    for w in words:
        assert w in err, err


def test_train_errors_name_the_problem(tiny_model, jsonl, tmp_path, capsys):
    base = ["train", "--steps", "1", "--device", "cpu", "--out", str(tmp_path / "o")]
    assert main(base + ["--model", str(tmp_path / "nope"), "--data", str(jsonl)]) == 2
    assert "nope" in _error(capsys)
    with pytest.warns(UserWarning, match="no tokenizer files"):  # the tiny model has none: bytes, said once
        assert main(base + ["--model", str(tiny_model), "--data", str(tmp_path / "missing.jsonl")]) == 2
    assert "missing.jsonl" in _error(capsys)
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "fine"}\n{"text": "fine"}\n{"prompt": "no response"}\n')
    with pytest.warns(UserWarning):
        assert main(base + ["--model", str(tiny_model), "--data", str(bad)]) == 2
    assert "bad.jsonl:3:" in _error(capsys)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message shown without CUDA")
def test_cuda_without_cuda_is_one_line(capsys):
    assert main(["demo", "--steps", "2", "--device", "cuda"]) == 2
    assert "cuda" in _error(capsys)


def test_module_entry_point_exits_2_without_traceback():
    p = subprocess.run([sys.executable, "-m", "megatrain_nb", "demo", "--steps", "zero"],
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 2
    assert p.stderr.strip().startswith("error: argument --steps") and "Traceback" not in p.stderr


def test_train_chat_with_eval_schedule_checkpoints_and_a_sample(tmp_path, capsys):
    from sft_helpers import chats, make_model_dir, make_tokenizer, write_jsonl

    from megatrain_nb import Session

    model = make_model_dir(tmp_path / "chat-model", make_tokenizer())
    train, val = write_jsonl(tmp_path / "train.jsonl", chats(8)), write_jsonl(tmp_path / "val.jsonl", chats(3))
    out = tmp_path / "out"
    rc = main(["train", "--model", str(model), "--data", str(train), "--eval-data", str(val), "--eval-every", "2",
               "--no-pack", "--save-every", "2", "--lr-schedule", "cosine", "--warmup-steps", "1", "--steps", "3",
               "--batch", "2", "--seq", "128", "--lr", "1e-3", "--out", str(out), "--device", "cpu"])
    text = capsys.readouterr().out
    assert rc == 0, text
    assert "8 chat examples, one per row" in text
    assert re.search(r"eval loss: step 2 [\d.]+, step 3 [\d.]+", text), text
    assert re.search(r"sample: 'What is 0 plus two\?' -> '.*'", text), text  # the first chat's turns before its reply
    state = json.loads((out / "megatrain_state.json").read_text())
    assert [k for k, _ in state["eval"]] == [2, 3]
    resumed = Session.resume(out / "checkpoint")  # saved after step 2
    try:
        assert resumed.engine.steps_done == 2 and resumed.optim_cfg.lr_schedule == "cosine"
        assert resumed.optim_cfg.total_steps == 3 and resumed.optim_cfg.warmup_steps == 1
    finally:
        resumed.close()


def test_eval_every_needs_eval_data(tiny_model, jsonl, tmp_path, capsys):
    assert main(["train", "--model", str(tiny_model), "--data", str(jsonl), "--eval-every", "2",
                 "--out", str(tmp_path / "o"), "--device", "cpu"]) == 2
    assert "--eval-data" in _error(capsys)


def test_train_pass_batch_accumulates_to_the_same_losses(tiny_model, jsonl, tmp_path, capsys, monkeypatch):
    """--pass-batch 1 runs each batch of 2 as two passes, one update: the losses are one pass's, within fp32 noise."""
    from megatrain_nb.step import passes

    seen, split = [], passes.split
    monkeypatch.setattr(passes, "split", lambda mbs: seen.append(len(split(mbs))) or split(mbs))
    losses = {}
    for name, extra in (("one", []), ("passes", ["--pass-batch", "1"])):
        seen.clear()
        out = tmp_path / name
        with pytest.warns(UserWarning, match="UTF-8 bytes"):
            rc = main(["train", "--model", str(tiny_model), "--data", str(jsonl), "--steps", "3", "--batch", "2",
                       "--seq", "32", "--lr", "1e-3", "--out", str(out), "--device", "cpu", *extra])
        assert rc == 0, capsys.readouterr().err
        losses[name] = json.loads((out / "megatrain_state.json").read_text())["losses"]
        assert set(seen) == {1 if name == "one" else 2}, seen  # passes a step
    assert losses["passes"] == pytest.approx(losses["one"], rel=1e-5)
