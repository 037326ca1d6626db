"""Saving and resuming lose nothing: a save killed or failing at any instant leaves a loadable older copy, a
full disk raises one OSError and leaves the session usable, dead processes' temporary directories go, and
resume refuses damaged or diverged checkpoints with an error naming the file or tensor (publish.py,
checkpoint.py, shard_writer.py, HostStore.save_pretrained)."""
from __future__ import annotations

import base64
import errno
import json
import os
import signal
import struct
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from conftest import make_batches, make_config
from megatrain_nb import Session
from megatrain_nb.cli import main
from megatrain_nb.host import publish

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(autouse=True)
def _no_checksum_thread_outlives_a_save():
    yield
    left = [t.name for t in threading.enumerate() if t.name.startswith("megatrain-checksum")]
    assert not left, f"a save left its checksum thread running: {left}"


def _trained(steps: int = 1, **settings) -> Session:
    cfg = make_config("llama")
    s = Session.from_config(cfg, seed=0, **settings)
    for b in make_batches(cfg.vocab_size, steps):
        s.step(b)
    s.engine.drain()
    return s


def _slabs(s) -> dict:
    s.engine.drain()
    return {(u, k): getattr(s.store.units[u], k).clone() for u in s.store.order
            for k in ("master", "exp_avg", "exp_avg_sq")}


def _same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def _constant(d: Path) -> float:
    """Load ``d`` with transformers; every weight holds one value (which save wrote it): return it."""
    from transformers import AutoModelForCausalLM

    m = AutoModelForCausalLM.from_pretrained(str(d))
    values = {float(v) for p in m.state_dict().values() for v in p.unique()}
    assert len(values) == 1, f"{d} mixes weights of several saves: {sorted(values)[:5]}"
    return values.pop()


def _siblings(d: Path) -> list[str]:
    return sorted(p.name for p in d.parent.iterdir() if p.name.startswith(d.name))


# ---- save_pretrained killed at any instant -----------------------------------------------------------
CHILD = """
import os, signal, sys
from megatrain_nb import Session
from megatrain_nb.host import publish
out, point = sys.argv[1], sys.argv[2]
s = Session.from_pretrained(out, device="cpu")
k = 0
def hook(name):
    if name == point and k >= 2:
        os.kill(os.getpid(), signal.SIGKILL)
publish.hook = hook
print("ready", flush=True)
while True:
    k += 1
    for u in s.store.order:
        s.store.units[u].master.fill_(float(k))
    s.save_pretrained(out)
"""


@pytest.fixture
def export(tmp_path) -> Path:
    """An HF export (~8 MB fp32: a save takes tens of ms) whose every weight is 0."""
    cfg = make_config("llama", vocab_size=32000)
    s = Session.from_config(cfg, seed=0)
    for u in s.store.order:
        s.store.units[u].master.zero_()
    out = tmp_path / "model"
    s.save_pretrained(out, max_shard_bytes=3 << 20)  # several shards and an index
    s.close()
    return out


@pytest.mark.parametrize("kill", ["written", "swapped", 0.0, 0.03, 0.1, 0.3])
def test_kill_during_save_pretrained_leaves_old_or_new(export, kill):
    """A process saving over ``export`` again and again is SIGKILLed at a named point of its second save, or
    after a delay anywhere in its loop; what is left always loads and is one whole save."""
    child = subprocess.Popen([sys.executable, "-c", CHILD, str(export), str(kill)], stdout=subprocess.PIPE,
                             text=True, env={**os.environ, "PYTHONPATH": str(ROOT)}, cwd=str(ROOT))
    try:
        assert child.stdout.readline().strip() == "ready"
        if isinstance(kill, float):
            time.sleep(kill)
            child.send_signal(signal.SIGKILL)
        child.wait(timeout=120)
    finally:
        child.kill()
        child.wait()  # reaped: its pid is gone
    assert child.returncode == -signal.SIGKILL
    k = _constant(export)
    if kill == "written":  # the new copy was complete but not swapped in: the first save's
        assert k == 1.0 and f"model.tmp-{child.pid}" in _siblings(export)
    elif kill == "swapped":  # swapped, the old copy not yet deleted
        assert k == 2.0 and f"model.tmp-{child.pid}" in _siblings(export)
    else:
        assert k == int(k) >= 0
    s = Session.from_pretrained(export)  # the next save of that path removes the dead process's directory
    s.save_pretrained(export)
    s.close()
    assert _siblings(export) == ["model"]
    assert _constant(export) == k


@pytest.mark.parametrize("point", ["written", "swapped", "done"])
@pytest.mark.parametrize("mode", ["exchange", "two renames"])
def test_failure_at_each_point_leaves_a_loadable_model(tmp_path, monkeypatch, point, mode):
    """An exception at each point of save_pretrained: the directory loads, with the old weights or the new."""
    if mode == "two renames":
        monkeypatch.setattr(publish, "exchange", lambda a, b: False)  # as where renameat2 is missing
    s = Session.from_config(make_config("llama"), seed=0)
    out = tmp_path / "m"
    for u in s.store.order:
        s.store.units[u].master.fill_(1.0)
    s.save_pretrained(out)
    for u in s.store.order:
        s.store.units[u].master.fill_(2.0)

    def fail(name):
        if name == point:
            raise KeyboardInterrupt

    monkeypatch.setattr(publish, "hook", fail)
    with pytest.raises(KeyboardInterrupt):
        s.save_pretrained(out)
    assert _constant(out) == (1.0 if point == "written" else 2.0)
    left = ["m", "m.old"] if (mode, point) == ("two renames", "swapped") else ["m"]  # the next save removes .old
    assert _siblings(out) == left  # an interrupted save cleans up after itself
    s.close()


def test_save_pretrained_keeps_the_other_files_and_drops_stale_shards(tmp_path):
    s = _trained(1)
    out = tmp_path / "m"
    s.save_pretrained(out, max_shard_bytes=20_000)
    assert (out / "model.safetensors.index.json").is_file()
    (out / "tokenizer.json").write_text("{}")
    s.save_checkpoint(out / "checkpoint")
    s.step(make_batches(s.config.vocab_size, 1, seed=5)[0])
    s.save_pretrained(out)  # one file now: the old shards and index must go
    names = sorted(p.name for p in out.iterdir())
    assert names == ["checkpoint", "config.json", "model.safetensors", "tokenizer.json"], names
    r = Session.resume(out / "checkpoint")  # the checkpoint folder survived the swap whole
    assert r.engine.steps_done == 1
    r.close(), s.close()


# ---- temporary directories of dead processes ---------------------------------------------------------
@pytest.mark.parametrize("save", ["checkpoint", "pretrained"])
def test_stale_temporary_directories_of_dead_processes_are_removed(tmp_path, save):
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()  # exited and reaped
    live = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    try:
        path = tmp_path / "out"
        for pid in (dead.pid, live.pid):
            d = path.with_name(f"out.tmp-{pid}")
            d.mkdir()
            (d / "half.safetensors").write_bytes(b"x" * 100)
        s = _trained(1)
        s.save_checkpoint(path) if save == "checkpoint" else s.save_pretrained(path)
        assert _siblings(path) == ["out", f"out.tmp-{live.pid}"]  # the live one's is never touched
        assert (path.with_name(f"out.tmp-{live.pid}") / "half.safetensors").is_file()
        s.close()
    finally:
        live.kill()
        live.wait()


# ---- full disk and I/O errors ------------------------------------------------------------------------
@pytest.fixture
def small_disk(tmp_path):
    """``small_disk(nbytes)`` -> a directory on a tmpfs of that size (root only; skips otherwise)."""
    mounted = []

    def mount(nbytes: int) -> Path:
        if os.geteuid() != 0:
            pytest.skip("a small tmpfs needs root to mount; the full-disk path is covered by the injected errors")
        d = tmp_path / f"disk{len(mounted)}"
        d.mkdir()
        r = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={nbytes}", "tmpfs", str(d)], capture_output=True,
                           text=True)
        if r.returncode:
            pytest.skip(f"mount -t tmpfs failed here ({r.stderr.strip()}); needs CAP_SYS_ADMIN")
        mounted.append(d)
        return d

    yield mount
    for d in mounted:
        subprocess.run(["umount", str(d)], check=False)


def _size(d: Path) -> int:
    return sum(f.stat().st_size for f in d.rglob("*") if f.is_file())


def test_full_disk_during_save_checkpoint(tmp_path, small_disk):
    s = _trained(1)
    s.save_checkpoint(tmp_path / "probe")
    disk = small_disk(int(_size(tmp_path / "probe") * 1.5))  # one checkpoint fits, not the old and the new
    path = disk / "ck"
    s.save_checkpoint(path)
    first = _slabs(s)
    s.step(make_batches(s.config.vocab_size, 1, seed=7)[0])
    with pytest.raises(OSError) as e:
        s.save_checkpoint(path)
    assert e.value.errno == errno.ENOSPC and str(path) in str(e.value) and "MiB" in str(e.value)
    assert sorted(p.name for p in disk.iterdir()) == ["ck"]  # the temporary directory is gone
    r = Session.resume(path)
    assert r.engine.steps_done == 1 and _same(_slabs(r), first)
    r.close()
    s.step(make_batches(s.config.vocab_size, 1, seed=8)[0])  # the session goes on
    s.save_checkpoint(tmp_path / "elsewhere")
    r = Session.resume(tmp_path / "elsewhere")
    assert r.engine.steps_done == 3 and _same(_slabs(r), _slabs(s))
    r.close(), s.close()


def test_full_disk_during_save_pretrained(tmp_path, small_disk):
    s = Session.from_config(make_config("llama"), seed=0)
    for u in s.store.order:
        s.store.units[u].master.fill_(1.0)
    s.save_pretrained(tmp_path / "probe")
    disk = small_disk(int(_size(tmp_path / "probe") * 1.5))
    out = disk / "m"
    s.save_pretrained(out)
    for u in s.store.order:
        s.store.units[u].master.fill_(2.0)
    with pytest.raises(OSError) as e:
        s.save_pretrained(out)
    assert e.value.errno == errno.ENOSPC and str(out) in str(e.value) and "MiB" in str(e.value)
    assert sorted(p.name for p in disk.iterdir()) == ["m"]
    assert _constant(out) == 1.0
    s.step(make_batches(s.config.vocab_size, 1)[0])
    s.save_pretrained(tmp_path / "elsewhere")
    assert torch.equal(_constant_weights(tmp_path / "elsewhere"), s.store.units[0].master[:5])
    s.close()


def _constant_weights(d: Path) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    m = AutoModelForCausalLM.from_pretrained(str(d))
    return torch.cat([p.flatten() for p in m.model.layers[0].parameters()])[:5]


@pytest.mark.parametrize("save", ["checkpoint", "pretrained"])
def test_an_io_error_is_one_oserror_and_the_session_goes_on(tmp_path, monkeypatch, save):
    s = _trained(1)
    path = tmp_path / "out"
    do = (lambda: s.save_checkpoint(path)) if save == "checkpoint" else (lambda: s.save_pretrained(path))
    do()
    before = sorted((p.name, p.stat().st_size) for p in path.iterdir())

    def fail(name):
        if name == "written":
            raise OSError(errno.EIO, "Input/output error")

    monkeypatch.setattr(publish, "hook", fail)
    with pytest.raises(OSError, match=f"Input/output error.*needs .* MiB") as e:
        do()
    assert e.value.errno == errno.EIO and str(path) in str(e.value)
    assert sorted((p.name, p.stat().st_size) for p in path.iterdir()) == before and _siblings(path) == ["out"]
    monkeypatch.setattr(publish, "hook", None)
    s.step(make_batches(s.config.vocab_size, 1, seed=3)[0])
    do()
    s.close()


def test_cli_turns_a_failed_save_into_one_line(tmp_path, monkeypatch, capsys):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=300, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
                      num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=False)
    LlamaForCausalLM(cfg).save_pretrained(str(tmp_path / "tiny"))
    data = tmp_path / "d.jsonl"
    data.write_text("".join(json.dumps({"prompt": "2+2=", "response": "4"}) + "\n" for _ in range(4)))

    def full(name):
        if name == "written":
            raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(publish, "hook", full)
    with pytest.warns(UserWarning):
        rc = main(["train", "--model", str(tmp_path / "tiny"), "--data", str(data), "--steps", "2", "--batch", "2",
                   "--seq", "16", "--out", str(tmp_path / "out"), "--device", "cpu", "--save-every", "1"])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2
    assert err[-1].startswith("error: ") and "No space left on device" in err[-1] and "checkpoint" in err[-1]
    assert "Traceback" not in "\n".join(err)


# ---- resume refuses what it must not continue from ---------------------------------------------------
def _data_offset(f: Path, key: str) -> int:
    """Byte offset in safetensors file ``f`` of tensor ``key``'s first element."""
    raw = f.read_bytes()
    n = struct.unpack("<Q", raw[:8])[0]
    return 8 + n + json.loads(raw[8:8 + n])[key]["data_offsets"][0]


@pytest.mark.parametrize("kind", ["master", "exp_avg_sq"])
def test_flipped_bytes_are_caught_by_the_checksum(tmp_path, kind):
    s = _trained(1)
    path = s.save_checkpoint(tmp_path / "ck")
    s.close()
    f = path / "slabs-00001.safetensors"
    at = _data_offset(f, f"unit.0.{kind}") + 17
    with open(f, "r+b") as fh:
        fh.seek(at)
        b = fh.read(1)
        fh.seek(at)
        fh.write(bytes([b[0] ^ 0x10]))  # one bit: a value still finite, only the checksum can tell
    with pytest.raises(ValueError, match=r"slabs-00001.safetensors is corrupt: its CRC-32.*earlier checkpoint"):
        Session.resume(path)


@pytest.mark.parametrize("what", ["nan master", "inf exp_avg", "negative exp_avg_sq"])
def test_diverged_values_are_refused_naming_the_tensor(tmp_path, what):
    s = _trained(1)
    unit = s.store.units[1]
    name, off, n = unit.tensors()[2]
    if what == "nan master":
        unit.master[off + 3] = float("nan")
    elif what == "inf exp_avg":
        unit.exp_avg[off + 3] = float("inf")
    else:
        unit.exp_avg_sq[off + 3] = -1e-3
    path = s.save_checkpoint(tmp_path / "ck")
    s.close()
    kind = what.split()[1]
    with pytest.raises(ValueError, match=rf"unit 1's {kind} holds .* at element {off + 3} in {name}\)"):
        Session.resume(path)


def test_compact_moments_resume_and_a_bad_scale_is_refused(tmp_path):
    s = _trained(2, optimizer_state="int8")
    unit = next(s.store.units[u] for u in s.store.order if s.store.units[u].compact is not None)
    path = s.save_checkpoint(tmp_path / "ck")
    r = Session.resume(path)  # the codes, read as fp32 words, may be NaN patterns: not refused
    assert _same(_slabs(r), _slabs(s))
    r.close()
    from megatrain_nb.host import compact_state

    _, scales, _ = compact_state.parts(unit.exp_avg_sq, unit.compact)
    scales[0] = -1.0
    path = s.save_checkpoint(tmp_path / "ck2")
    s.close()
    with pytest.raises(ValueError, match=rf"unit {unit.layer}'s exp_avg_sq \(block scales\) holds negative"):
        Session.resume(path)


@pytest.mark.parametrize("field,value", [
    ("rng.torch", base64.b64encode(b"short").decode()), ("rng.torch", "not base64 !"),
    ("rng.python", [3, [1, 2], None]), ("history", [1, 2]), ("unit_steps", {}), ("steps_done", "three"),
])
def test_a_malformed_state_field_names_state_json(tmp_path, field, value):
    s = _trained(1)
    path = s.save_checkpoint(tmp_path / "ck")
    s.close()
    state = json.loads((path / "state.json").read_text())
    top, _, sub = field.partition(".")
    if sub:
        state[top][sub] = value
    else:
        state[top] = value
    (path / "state.json").write_text(json.dumps(state))
    rng = torch.get_rng_state()
    with pytest.raises(ValueError, match=rf"state.json: field .*{top}.* is malformed"):
        Session.resume(path)
    assert torch.equal(torch.get_rng_state(), rng)  # a failed resume leaves the RNG as it was


def _rss() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


@pytest.mark.parametrize("failure", ["nan (while loading)", "bad unit_steps (after building)"])
def test_a_failed_resume_releases_its_threads_and_memory(tmp_path, failure):
    cfg = make_config("llama", vocab_size=40_000)  # a store of ~40 MB: a leak per resume would show
    s = Session.from_config(cfg, seed=0)
    s.step(make_batches(cfg.vocab_size, 1)[0])
    if failure.startswith("nan"):
        s.engine.drain()
        s.store.units[0].master[0] = float("nan")
    store_bytes = s.store.bytes_report()["total"]
    path = s.save_checkpoint(tmp_path / "ck")
    s.close()
    if failure.startswith("bad"):
        state = json.loads((path / "state.json").read_text())
        del state["unit_steps"]["0"]
        (path / "state.json").write_text(json.dumps(state))
    with pytest.raises(ValueError):
        Session.resume(path)  # the first one may warm caches
    threads = set(threading.enumerate())
    rss = _rss()
    for _ in range(5):
        with pytest.raises(ValueError, match="master holds nan" if failure.startswith("nan") else "unit_steps"):
            Session.resume(path)
    for _ in range(100):  # closed threads end soon after close(); wait for them, not a timing bound
        if not set(threading.enumerate()) - threads:
            break
        time.sleep(0.05)
    assert not set(threading.enumerate()) - threads, [t.name for t in set(threading.enumerate()) - threads]
    assert _rss() - rss < 2 * store_bytes, f"RSS grew {(_rss() - rss) / 2**20:.0f} MiB over 5 failed resumes"
