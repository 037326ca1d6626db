"""This process's resident host memory, read cheaply enough to sample after every layer op.

Owns: reading the resident set size (the ``host_rss_bytes`` counter of a step's trace). On Linux it
reads ``/proc/self/statm`` through a descriptor kept open (``os.pread``: ~3 us on a 2-core box, where
``psutil.Process().memory_info()`` opens and parses the file each time: ~30 us, per layer op, on the
driver thread). Elsewhere it asks psutil. Same number either way: psutil's Linux ``rss`` is statm's
second field times the page size.
Does not own: when the counter is sampled nor the recorder (``step/memory.py``'s ``count``, ``trace.py``).
"""
from __future__ import annotations

import os


class HostRss:
    """Callable: this process's resident set size in bytes.

    The descriptor is opened again in a forked child (``/proc/self`` named the parent when opened).

    Example:
        >>> rss = HostRss()
        >>> rss() > 0
        True
    """

    def __init__(self):
        self._fd, self._pid, self._proc = None, None, None
        self._page = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096

    def __call__(self) -> int:
        pid = os.getpid()
        if self._pid != pid:
            self._open(pid)
        if self._fd is None:
            return self._proc.memory_info().rss
        return int(os.pread(self._fd, 128, 0).split()[1]) * self._page  # statm: size resident shared ... (pages)

    def _open(self, pid: int) -> None:
        self._pid, self._fd = pid, None  # the parent's descriptor (if forked) stays the parent's to close
        try:
            self._fd = os.open("/proc/self/statm", os.O_RDONLY)
        except OSError:  # no procfs (macOS, Windows)
            import psutil

            self._proc = psutil.Process()

    def __del__(self):
        if self._fd is not None and self._pid == os.getpid():
            try:
                os.close(self._fd)
            except OSError:
                pass
