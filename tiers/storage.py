"""Where a tier keeps files: a directory private to its owner, the probe that it can be written, the
room left on its filesystem, and byte counts as people read them.

A stored block carries its token ids, which decode back to prompt text, so a store is as private as
the prompts: its directory is 0700 and its files 0600 whatever the umask, and a store found with
looser modes is tightened when its owner opens it (bits are only ever removed, never added).

Cheap to import (no torch, no LMDB): config validation uses it.
"""
from __future__ import annotations

import os
import shutil
import stat
import tempfile

PRIVATE_DIR_MODE = 0o700
PRIVATE_FILE_MODE = 0o600


def format_bytes(nbytes: int | float) -> str:
    """A rounded, human-readable byte count for messages: 25006202880 -> "23.3 GiB"."""
    value = float(nbytes)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(value) < 1024 or unit == "TiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")


def check_no_file_at(path: str | os.PathLike) -> None:
    """ValueError, one line naming the path, if something other than a directory is there (nothing is touched)."""
    if os.path.exists(path) and not os.path.isdir(path):
        raise ValueError(f"{os.fspath(path)!r} exists and is not a directory")


def prepare_private_dir(path: str | os.PathLike) -> None:
    """Create the directory `path` (and its parents) if missing, private to its owner, and check that
    a file can be written in it. Raises ValueError, one line naming the path, if it cannot be used."""
    path = os.fspath(path)
    check_no_file_at(path)
    try:
        if os.path.isdir(path):
            make_private(path)
        else:
            os.makedirs(path, mode=PRIVATE_DIR_MODE)
            os.chmod(path, PRIVATE_DIR_MODE)  # exactly 0700, whatever the umask took away
        with tempfile.NamedTemporaryFile(dir=path, prefix=".kvstrata-write-probe-"):
            pass
    except OSError as e:
        raise ValueError(f"cannot write to {path!r}: {e.strerror or e}") from None


def make_private(path: str | os.PathLike) -> None:
    """Remove the group and other permission bits of `path` if this process owns it and any are set.

    Quietly does nothing where that is not possible (another owner, a read-only filesystem): the
    caller finds out soon enough if it cannot use the file.
    """
    try:
        st = os.stat(path)
        if st.st_uid == os.geteuid() and st.st_mode & 0o077:
            os.chmod(path, stat.S_IMODE(st.st_mode) & ~0o077)
    except OSError:
        pass


def room_bytes(path: str | os.PathLike) -> int:
    """Bytes a store at the directory `path` may occupy: the free space of its filesystem plus what
    the files already there take (an old store is reused, not added to)."""
    occupied = 0
    for entry in os.scandir(path):
        try:
            if entry.is_file(follow_symlinks=False):
                occupied += entry.stat(follow_symlinks=False).st_blocks * 512
        except FileNotFoundError:  # gone since listed (another process's write probe): it takes nothing
            pass
    return shutil.disk_usage(path).free + occupied


def check_room(path: str | os.PathLike, nbytes: int, spelled: str | None = None) -> None:
    """Raise ValueError (one line) if `nbytes` (shown as `spelled`) do not fit at the directory `path`."""
    room = room_bytes(path)
    if nbytes > room:
        raise ValueError(f"{spelled or format_bytes(nbytes)} is more than the free space at "
                         f"{os.fspath(path)!r} ({format_bytes(room)})")
