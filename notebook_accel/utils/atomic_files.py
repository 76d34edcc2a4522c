"""Write files atomically and durably: a temporary file beside the target, fsync, rename.

Every writer of a file that a crash must never leave half-written (checkpoints, offloaded weights,
config files, tracker logs) goes through :func:`atomic_write`. The module is a leaf (standard library
only) so that low-level writers such as the offload weights map do not pay for importing the
process state through ``utils.other``.
"""

from __future__ import annotations

import errno
import os
import resource
import shutil
import tempfile
from collections.abc import Callable

__all__ = ["NoSpaceError", "atomic_write", "fsync_path", "fsync_tree"]


class NoSpaceError(OSError):
    """A file could not be written in full: the disk (or the process's file-size limit) ran out."""


def atomic_write(
    path: str, write: Callable[[str], object], durable: bool = True, needs: int | None = None
) -> None:
    """Return nothing; write ``path`` through ``write(tmp)`` into a hidden temporary file, then rename it.

    Temporary files that a killed writer left beside ``path`` (their pid is gone) are removed first.
    ``durable=False`` skips the two fsyncs (the rename stays atomic): for caches whose loss after a
    power cut is detected on reading (offloaded ``.dat`` files are checked against their exact size).
    A write that runs out of room (a full disk, a file-size limit) raises :class:`NoSpaceError` naming
    ``path``, the free space and, given ``needs`` (bytes the file takes, about), how much it needed.
    """
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    base = os.path.basename(path)
    _remove_dead_temporaries(directory)
    fd, tmp = tempfile.mkstemp(prefix=f".{base}.{os.getpid()}.", suffix=".tmp", dir=directory)
    os.close(fd)
    try:
        write(tmp)
        if durable:
            fsync_path(tmp)
        os.replace(tmp, path)
    except BaseException as exc:
        if os.path.exists(tmp):
            os.unlink(tmp)
        full = _out_of_room(exc, path, directory, needs)
        if full is not None:
            raise full from exc
        raise
    if durable:
        fsync_path(directory)


# What writers deep in C++ or Rust say when a write stops short: torch's zip writer ("unexpected pos",
# "failed writing file") and safetensors ("No space left on device (os error 28)") carry no errno.
_SHORT_WRITE_TEXT = (
    "unexpected pos",
    "failed writing",
    "os error 28",
    "os error 27",
    "No space left",
    "File too large",
)


def _out_of_room(exc: BaseException, path: str, directory: str, needs: int | None) -> NoSpaceError | None:
    """Return a NoSpaceError naming ``path`` when ``exc`` is a write that ran out of room, else None."""
    if isinstance(exc, NoSpaceError):
        return None
    code = getattr(exc, "errno", None)
    if code not in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG) and not (
        isinstance(exc, Exception) and any(t in str(exc) for t in _SHORT_WRITE_TEXT)
    ):
        return None
    try:
        free = shutil.disk_usage(directory).free
    except OSError:
        free = None
    limit = resource.getrlimit(resource.RLIMIT_FSIZE)[0]
    need = f", about {_mb(needs)} for this file" if needs else ""
    limited = code == errno.EFBIG or "File too large" in str(exc) or "os error 27" in str(exc)
    if limited or (limit != resource.RLIM_INFINITY and (free is None or free > limit)):
        cause = f"it exceeds this process's file-size limit (ulimit -f: {_mb(limit)}{need})"
        code, advice = errno.EFBIG, "Raise the limit (ulimit -f) or write smaller files"
    else:
        room = f"{_mb(free)} free" if free is not None else "free space unknown"
        cause = f"the disk is full ({room} on {directory!r}{need})"
        code, advice = errno.ENOSPC, "Free some space (or save elsewhere) and save again"
    return NoSpaceError(
        code, f"could not write {path!r}: {cause}. {advice}; nothing was left half-written "
        f"({type(exc).__name__}: {str(exc).strip()[:200]}).", path
    )  # fmt: skip


def _mb(size: int | None) -> str:
    if size is None or size == resource.RLIM_INFINITY:
        return "unlimited"
    return f"{size / 1e6:.1f} MB" if size >= 100_000 else f"{size} bytes"


_CLEANED_DIRECTORIES: set[str] = set()


def _remove_dead_temporaries(directory: str) -> None:
    # Once per folder and process: a writer killed mid-write is another process, and listing the
    # folder at every write would cost O(files) per file (offloading thousands of weights).
    if directory in _CLEANED_DIRECTORIES:
        return
    _CLEANED_DIRECTORIES.add(directory)
    for name in os.listdir(directory):
        if not (name.startswith(".") and name.endswith(".tmp")):
            continue
        pid = name[1:].rsplit(".", 3)[-3] if name.count(".") >= 4 else ""
        if pid.isdigit() and not _pid_alive(int(pid)):
            try:
                os.unlink(os.path.join(directory, name))
            except FileNotFoundError:
                pass


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def fsync_path(path: str) -> None:
    """Return nothing; fsync one file or folder (a folder: its entries, so a rename inside it is durable)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    except OSError:  # some filesystems refuse fsync on a folder; the data itself was synced
        pass
    finally:
        os.close(fd)


def fsync_tree(root: str | os.PathLike, files: bool = True) -> None:
    """Return nothing; fsync every file under ``root`` (unless ``files`` is False) and every folder."""
    root = os.fspath(root)
    for folder, _, names in os.walk(root):
        if files:
            for name in names:
                fsync_path(os.path.join(folder, name))
        fsync_path(folder)
