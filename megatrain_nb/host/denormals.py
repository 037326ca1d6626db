"""Flush-to-zero on the threads that run the host's AdamW, so subnormal moments cost no more than normal ones.

Owns: ``flush_denormals`` (flush-to-zero and denormals-are-zero on the calling thread; the first call in
every thread that runs host updates), ``pool_flushes`` (whether the calling thread's intra-op threads flush
too: a check for tests and probes) and ``subnormals`` (a tensor of subnormal fp32 values, made bitwise).
Does not own: which threads run updates (workers.py starts them and calls ``flush_denormals``), the
AdamW arithmetic (optim.py, compact_state.py: its C kernel sets the same bits on its own OpenMP threads).

Note: [Subnormals] a moment becomes subnormal in ordinary fine-tuning: an embedding row whose token
stops appearing keeps an ``exp_avg`` that decays 0.9 a step and passes 1.2e-38 within ~800 steps. On
the GPU machines' Intel Xeon hosts, torch's fused CPU AdamW then ran 8-13x slower (4.26 G params/s;
0.55 with a subnormal ``exp_avg``, 0.33 with both moments subnormal; 4.08 with flushing:
shared/LIMITS.md). Flushing (MXCSR's FTZ and DAZ bits) makes such values 0, which changes an update
only by amounts below 1.2e-38; an fp32 master cannot tell them apart.
MXCSR is per thread. ``torch.set_flush_denormal(True)`` sets it on the calling thread only, and the
OpenMP threads that run that thread's parallel regions (its *pool*) are created at its first parallel
torch op, inheriting its MXCSR then (a new pthread copies its creator's floating-point environment);
setting it later reaches the calling thread's own share of the work and none of the pool's. So each
update thread calls ``flush_denormals`` first, before any torch op; a pool grown later by
``torch.set_num_threads`` is created by the flushed thread and flushes too. A probe in the design log
shows both cases (on a pool made before the flush, half the elements of a 2-thread op stay
subnormal) and measures the rates. The driver thread is left as it is: it runs no host AdamW, and
on a "cpu" device its forward and backward must match the plain reference bit for bit.
"""
from __future__ import annotations

import torch

_SUBNORMAL_BITS = 0x000AE398  # fp32 1e-39 (0x000AE398 * 2**-149): below the least normal, 1.18e-38


def flush_denormals() -> bool:
    """Flush subnormals to zero on the calling thread (Note: [Subnormals]); call it first thing in the thread.

    Returns:
        Whether the CPU supports it (x86 with SSE3; elsewhere torch does nothing and returns False).
    Example:
        >>> import threading
        >>> threading.Thread(target=lambda: (flush_denormals(), ...)).start()  # doctest: +SKIP
    """
    return torch.set_flush_denormal(True)


def subnormals(n: int) -> torch.Tensor:
    """(n,) fp32 of 1e-39 each, made from its bits: converting the Python float would itself be flushed
    on a flushed thread."""
    return torch.full((n,), _SUBNORMAL_BITS, dtype=torch.int32).view(torch.float32)


def pool_flushes() -> bool:
    """Whether every intra-op thread serving the calling thread flushes: an elementwise op spread over
    all of them turns subnormal inputs into zeros (a subnormal kept anywhere means one thread did not)."""
    n = (1 << 16) * torch.get_num_threads()  # two of torch's 32K-element grains a thread: every thread gets some
    out = subnormals(n).mul(0.1)  # 1e-40: kept unless the thread flushes (FTZ) or reads its inputs as 0 (DAZ)
    return bool((out.view(torch.int32) == 0).all())  # bits, not a float compare (DAZ would read 1e-40 as 0); no sync
