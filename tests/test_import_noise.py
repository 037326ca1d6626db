"""Tests for the import-noise filter in megatrain_nb/__init__.py: the known third-party lines are dropped,
nothing else is (our own warnings and other messages of the same loggers pass)."""
from __future__ import annotations

import logging
import os
import subprocess
import sys
from pathlib import Path

import megatrain_nb  # noqa: F401  (installs the filter)

ROOT = Path(__file__).resolve().parent.parent


def _passes(logger: str, msg: str, *args) -> bool:
    record = logging.LogRecord(logger, logging.WARNING, __file__, 1, msg, args, None)
    return logging.getLogger(logger).filter(record)


def test_the_known_lines_are_dropped_and_nothing_else():
    assert not _passes("torchao", "Failed to load /x/site-packages/torchao/_C_mxfp8.cpython-310-x86_64-linux-gnu.so: "
                                  "Could not load this library")
    assert not _passes("torch.utils._pytree", "%s is an Enum subclass and is now natively supported by torch.compile "
                       "as an opaque value type. Calling register_constant() on Enum subclasses is deprecated and "
                       "will be an error in a future release.", "<enum 'KernelPreference'>")
    assert _passes("torchao", "Failed to quantize layer 3")  # the same logger's other news
    assert _passes("torch.utils._pytree", "something else is deprecated")
    assert _passes("megatrain_nb", "Failed to load /x/torchao/_C_mxfp8.so")  # only those loggers are filtered


def test_a_session_on_the_cpu_prints_no_import_noise_but_our_warnings():
    code = ("import sys, warnings; sys.path.insert(0, 'tests'); from conftest import make_config; "
            "from megatrain_nb import Session; s = Session.from_config(make_config('llama'), device='cpu'); "
            "warnings.warn('ours'); s.close()")
    out = subprocess.run([sys.executable, "-W", "default", "-c", code], capture_output=True, text=True, cwd=ROOT,
                         timeout=120, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert out.returncode == 0, out.stderr
    assert "Failed to load" not in out.stderr and "register_constant" not in out.stderr, out.stderr
    assert "UserWarning: ours" in out.stderr
