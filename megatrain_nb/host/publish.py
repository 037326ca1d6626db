"""Publishing a directory whole: every save (a training checkpoint, an HF export) is written beside its
destination and swapped in once complete, so that the destination always holds a complete copy.

Owns: the temporary directory's name (``<path>.tmp-<pid>``), removing those of dead processes, the swap,
the fsyncs that make it durable, and turning a failed write into one ``OSError`` that names the path and
the bytes the save needs.
Does not own: what goes into the directory (checkpoint.py, host_store.py, shard_writer.py).

Note: [Atomic save] a save writes everything into ``<path>.tmp-<pid>``, fsyncs its files and the directory,
then swaps it with ``<path>`` in one ``renameat2(RENAME_EXCHANGE)`` (Linux >= 3.15, glibc >= 2.28, a local
filesystem): at every instant ``<path>`` is the old copy or the new one, never absent nor mixed. The old
copy, now at the temporary name, is then deleted. Where the exchange is unavailable (another OS, an older
glibc, a filesystem that refuses it, e.g. some network ones) the swap falls back to two renames:
``<path>`` -> ``<path>.old``, ``<path>.tmp-<pid>`` -> ``<path>``; between them ``<path>`` is absent and
the previous copy is at ``<path>.old``, which ``checkpoint.resume`` loads (with a warning) and the next
save of ``<path>`` removes. A process killed mid-save leaves its ``<path>.tmp-<pid>``; the next save of
``<path>`` removes every such directory whose process is gone (``os.kill(pid, 0)``) and keeps a live one's.
The pid says nothing across machines: two hosts saving the same path on a shared filesystem must not.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import errno
import os
import re
import shutil
from pathlib import Path

hook = None  # tests: called with the name of each point of a save ("written", "swapped", ...), e.g. to kill it
_AT_FDCWD = -100
_RENAME_EXCHANGE = 2


def _at(point: str) -> None:
    if hook is not None:
        hook(point)


def temp_dir(path: Path) -> Path:
    """A new empty ``<path>.tmp-<pid>`` beside ``path`` (parents made), after removing dead processes' ones."""
    path.parent.mkdir(parents=True, exist_ok=True)
    remove_stale(path)
    tmp = path.with_name(f"{path.name}.tmp-{os.getpid()}")
    if tmp.exists():
        shutil.rmtree(tmp)  # our own leftover from an earlier failed save
    tmp.mkdir()
    return tmp


def remove_stale(path: Path) -> list[Path]:
    """Remove the ``<path>.tmp-<pid>`` directories of processes that are gone; returns those removed."""
    pattern = re.compile(re.escape(path.name) + r"\.tmp-(\d+)")
    gone = []
    if not path.parent.is_dir():
        return gone
    for p in path.parent.iterdir():
        m = pattern.fullmatch(p.name)
        if m and p.is_dir() and not p.is_symlink() and int(m.group(1)) != os.getpid() and not alive(int(m.group(1))):
            shutil.rmtree(p, ignore_errors=True)
            gone.append(p)
    return gone


def alive(pid: int) -> bool:
    """Whether process ``pid`` exists on this machine (another user's counts)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    except OverflowError:
        return False
    return True


def publish(tmp: Path, path: Path) -> None:
    """Make the complete directory ``tmp`` the new ``path`` (Note: [Atomic save]) and delete the old copy."""
    for f in tmp.rglob("*"):
        if f.is_file():
            fsync(f)
    fsync(tmp)
    _at("written")
    old = path.with_name(path.name + ".old")
    if path.is_dir() and not path.is_symlink() and exchange(tmp, path):
        fsync(path.parent)
        _at("swapped")
        shutil.rmtree(tmp)  # the old copy, now under the temporary name
    elif path.exists():
        if old.exists():
            shutil.rmtree(old)  # a leftover of a fallback swap that completed: path is complete
        os.rename(path, old)
        _at("renamed-old")
        os.rename(tmp, path)
        fsync(path.parent)
        _at("swapped")
        shutil.rmtree(old)
    else:  # no path: an existing .old is the only complete copy until this rename
        os.rename(tmp, path)
        fsync(path.parent)
        _at("swapped")
        if old.exists():
            shutil.rmtree(old)
    _at("done")


def _renameat2():
    """glibc's renameat2, or None where this libc has none."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True)
        fn = libc.renameat2
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    fn.restype = ctypes.c_int
    return fn


_RENAMEAT2 = _renameat2()


def exchange(a: Path, b: Path) -> bool:
    """Swap two directory entries in one step; False where this system or filesystem cannot (nothing moved).

    Raises:
        OSError: the exchange failed for another reason (permissions, a missing entry).
    """
    if _RENAMEAT2 is None:
        return False
    if _RENAMEAT2(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE) == 0:
        return True
    e = ctypes.get_errno()
    if e in (errno.EINVAL, errno.ENOSYS, errno.ENOTSUP, errno.EOPNOTSUPP):
        return False
    raise OSError(e, f"swapping {str(a)!r} and {str(b)!r}: {os.strerror(e)}")


def fsync(p: Path) -> None:
    """Flush a file, or a directory's entries, to disk (a no-op where a directory cannot be opened)."""
    try:
        fd = os.open(p, os.O_RDONLY)
    except OSError:
        if p.is_dir():
            return
        raise
    try:
        os.fsync(fd)
    except OSError as e:
        if not p.is_dir() or e.errno not in (errno.EINVAL, errno.EBADF):
            raise
    finally:
        os.close(fd)


def save_error(e: OSError, path: Path, needed: int, what: str) -> OSError:
    """One ``OSError`` (same errno) naming ``path``, the bytes the save needs, what is free, and that the older
    copy is intact."""
    try:
        free = f"{shutil.disk_usage(path.parent).free / 2**20:,.1f} MiB free there"
    except OSError:
        free = "free space unknown"
    where = f" ({e.filename})" if getattr(e, "filename", None) else ""
    err = OSError(e.errno, f"saving {what} to {str(path)!r} failed: {e.strerror or e}{where}; it needs "
                           f"{needed / 2**20:,.1f} MiB ({free}). {str(path)!r} still holds the previous save (if "
                           "any); free space or save elsewhere")
    return err


def carry(old: Path, new: Path, skip) -> None:
    """Hard-link into ``new`` every entry of ``old`` (files; folders recursively) that ``new`` lacks and
    ``skip(name)`` refuses, so a swap keeps what else lived there (a tokenizer, a checkpoint folder)."""
    if not old.is_dir() or old.is_symlink():
        return
    for p in old.iterdir():
        dst = new / p.name
        if dst.exists() or dst.is_symlink() or skip(p.name):
            continue
        if p.is_symlink():
            os.symlink(os.readlink(p), dst)
        elif p.is_dir():
            dst.mkdir()
            carry(p, dst, lambda name: False)
        else:
            try:
                os.link(p, dst)
            except OSError:  # a filesystem without hard links: a copy
                shutil.copy2(p, dst)
