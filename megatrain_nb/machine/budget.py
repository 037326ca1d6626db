"""Memory budgets: what the device and the host may give this process, as the machine says and as the
user allows (``EngineConfig.device_memory``, ``EngineConfig.host_memory``).

Owns: parsing a budget ("24GiB", "64GB", an int of bytes), and the one place every sizing decision asks
for memory — ``device_total`` / ``device_free`` for the GPU, ``host_total`` / ``host_available`` for host
RAM — each the smaller of what the machine reports and what the budget leaves; ``host_spare``, the host
bytes that memory taken only for speed may use; ``cap_device``, the allocator's hard cap. Without a budget
each answers exactly what the machine says (today's behaviour), except ``host_spare`` (Note: [Spare host]).
Does not own: what the bytes are spent on (preflight, the planner, the activation policy, placement).

Note: [Budgets] ``device_memory`` bounds what the CUDA caching allocator reserves
(``torch.cuda.memory_reserved``): the CUDA context and the libraries' own allocations (~0.5 GiB, outside the
allocator) are not in it. Free device memory under a budget is

    min(mem_get_info free + (memory_reserved - memory_allocated),  device_memory - memory_allocated)

The first term is the machine: the driver's free bytes plus the allocator's cached blocks this process may
reuse. The second is the budget: what we may still allocate if every reserved block were reused. Where
they differ the smaller wins; fragmentation can make the allocator reserve more than it holds, so
``cap_device`` also sets ``torch.cuda.set_per_process_memory_fraction(device_memory / total)``: the
allocator then frees its cache and retries before it reserves past the budget, and raises
``OutOfMemoryError`` rather than exceed it (the fraction is per process and per device: the last Session
made on a device sets it). The share-based policies (``activation_budget``'s 0.85 of the device, the
planner's ``Hardware.device_mem_bytes``) take ``device_total``: the budget in place of the card's memory.
``host_memory`` bounds the process's resident set (RSS): the host store, pinned staging and pools, parked
activations and torch's runtime alike, which is what ``top`` shows and what an OOM killer counts. Host
bytes available under it are ``min(psutil available, host_memory - RSS now)``; preflight runs before the
store exists, so RSS then is the runtime alone.
"""
from __future__ import annotations

import re

import torch

_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "tib": 1 << 40}
_FORMS = ("an int of bytes (e.g. 25769803776) or a string of a number and a unit: '24GiB', '64GB', '1.5TiB', "
          "'512MiB' (KiB/MiB/GiB/TiB powers of 1024, KB/MB/GB/TB powers of 1000), or None for no budget")


def parse_bytes(value, field: str) -> int | None:
    """A budget as bytes.

    Args:
        value: None (no budget), an int of bytes > 0, or a string "<number><unit>" with unit B, KB, MB, GB,
            TB (powers of 1000) or KiB, MiB, GiB, TiB (powers of 1024), case and spaces ignored.
        field: the setting's name, for the message.
    Returns:
        Bytes (int), or None.
    Raises:
        ValueError: anything else (a float, a bool, "24G", a value <= 0), naming ``field`` and the forms accepted.
    Example:
        >>> parse_bytes("24GiB", "device_memory"), parse_bytes("64 GB", "host_memory"), parse_bytes(1 << 20, "x")
        (25769803776, 64000000000, 1048576)
    """
    if value is None:
        return None
    if isinstance(value, int) and not isinstance(value, bool):
        n = value
    elif isinstance(value, str):
        m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*", value)
        if not m or m.group(2).lower() not in _UNITS:
            raise ValueError(f"{field}={value!r}: not a size; use {_FORMS}")
        n = int(float(m.group(1)) * _UNITS[m.group(2).lower()])
    else:
        raise ValueError(f"{field}={value!r}: use {_FORMS}")
    if n <= 0:
        raise ValueError(f"{field}={value!r}: must be more than 0 bytes; use {_FORMS}")
    return n


def device_total(device, budget: int | None = None) -> int:
    """Bytes of ``device``'s memory the process may fill: the card's ``total_memory``, or ``budget`` where smaller.

    Example:
        >>> device_total("cuda", 24 << 30) >> 30  # doctest: +SKIP
        24
    """
    total = torch.cuda.get_device_properties(torch.device(device)).total_memory
    return total if budget is None else min(total, budget)


def device_free(device, budget: int | None = None) -> int:
    """Device bytes this process may still allocate (Note: [Budgets]); without a budget ``mem_get_info``'s
    free bytes, as before. Creates the CUDA context.

    Example:
        >>> device_free("cuda", 8 << 30) <= 8 << 30  # doctest: +SKIP
        True
    """
    device = torch.device(device)
    free = int(torch.cuda.mem_get_info(device)[0])  # a device query; free bytes now
    if budget is None:
        return free
    allocated = torch.cuda.memory_allocated(device)  # allocator bookkeeping: no sync
    reusable = torch.cuda.memory_reserved(device) - allocated
    return max(0, min(free + reusable, budget - allocated))


def host_rss() -> int:
    """Resident bytes of this process now."""
    import psutil

    return int(psutil.Process().memory_info().rss)


def host_total(budget: int | None = None) -> int:
    """Bytes of host RAM: ``psutil``'s total, or ``budget`` where smaller."""
    import psutil

    total = int(psutil.virtual_memory().total)
    return total if budget is None else min(total, budget)


def host_available(budget: int | None = None) -> int:
    """Host bytes this process may still take (Note: [Budgets]): ``psutil``'s available RAM, and under a
    budget at most ``budget`` less what the process holds resident now (0 where it holds more)."""
    import psutil

    available = int(psutil.virtual_memory().available)
    return available if budget is None else max(0, min(available, budget - host_rss()))


HOST_SHARE = 0.9
"""The share of the machine's RAM this process plans to hold with no ``host_memory`` set: what the store may take
where it pins (``preflight.resolve_pinning``), and the most that memory taken only for speed lets it reach
(``host_spare``)."""


def host_spare(budget: int | None = None) -> int:
    """Host bytes this process may take for what only speeds it up (the gradient ring's overflow: Note: [Ring
    overflow] in ``host/grad_ring.py``): ``host_available``, and with no budget no more than keeps the process
    within ``HOST_SHARE`` of the machine's RAM. A budget is the user's own bound and stands as it is.

    Note: [Spare host] the ring's overflow first took what psutil called available, less a margin: on an H100
    host of 126 GiB (2026-12-07) gpt-oss-20b with int4 moments held 117.3 GiB in its steps, and the measuring
    step's one overflow buffer (a layer's gradients, 1.53 GiB) lifted the peak to 118.7 GiB, where the same row
    peaked at 117.7 before the overflow existed. The store and the runtime are what the process needs; the
    overflow only spares the backward a wait, and the room it takes beyond the share is the rest of the
    machine's (a notebook server, a second kernel, the page cache).

    Example:
        >>> host_spare() <= host_available()
        True
    """
    free = host_available(budget)
    if budget is None:
        free = min(free, max(0, int(HOST_SHARE * host_total()) - host_rss()))
    return free


def memory_total(device, device_budget: int | None = None, host_budget: int | None = None) -> int:
    """Bytes of memory on ``device`` within the budgets: the GPU's (``device_total``), or host RAM on "cpu"
    (where "device" buffers live: ``host_total``)."""
    device = torch.device(device)
    return device_total(device, device_budget) if device.type == "cuda" else host_total(host_budget)


def cap_device(device, budget: int | None) -> float | None:
    """With a budget on CUDA, cap the caching allocator at it (``set_per_process_memory_fraction``: Note:
    [Budgets]); returns the fraction set, or None where nothing was capped (no budget, not CUDA, or a
    budget at least the card's memory)."""
    device = torch.device(device)
    if budget is None or device.type != "cuda":
        return None
    if device.index is None:  # "cuda": the current device (set_per_process_memory_fraction wants an index)
        device = torch.device("cuda", torch.cuda.current_device())
    total = torch.cuda.get_device_properties(device).total_memory
    if budget >= total:
        return None
    fraction = budget / total
    torch.cuda.set_per_process_memory_fraction(fraction, device)
    return fraction


def hardware_within(hardware, device_memory: int | None = None, host_memory: int | None = None):
    """A planner ``Hardware`` whose device and host memory are at most the budgets (the same profile
    without them)."""
    import dataclasses

    kw = {}
    if device_memory is not None and device_memory < hardware.device_mem_bytes:
        kw["device_mem_bytes"] = int(device_memory)
    if host_memory is not None and host_memory < hardware.host_mem_bytes:
        kw["host_mem_bytes"] = int(host_memory)
    if not kw:
        return hardware
    return dataclasses.replace(hardware, name=hardware.name + "; within budgets " + ", ".join(
        f"{k.removesuffix('_bytes')}={v / (1 << 30):.1f} GiB" for k, v in kw.items()), **kw)
