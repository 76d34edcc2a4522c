"""Write files atomically and durably: a temporary file beside the target, fsync, rename.

Every writer of a file that a crash must never leave half-written (checkpoints, offloaded weights,
config files, tracker logs) goes through :func:`atomic_write`. The module is a leaf (standard library
only) so that low-level writers such as the offload weights map do not pay for importing the
process state through ``utils.other``.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable

__all__ = ["atomic_write", "fsync_path", "fsync_tree"]


def atomic_write(path: str, write: Callable[[str], object], durable: bool = True) -> None:
    """Return nothing; write ``path`` through ``write(tmp)`` into a hidden temporary file, then rename it.

    Temporary files that a killed writer left beside ``path`` (their pid is gone) are removed first.
    ``durable=False`` skips the two fsyncs (the rename stays atomic): for caches whose loss after a
    power cut is detected on reading (offloaded ``.dat`` files are checked against their exact size).
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
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    if durable:
        fsync_path(directory)


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
