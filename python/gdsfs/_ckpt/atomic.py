"""Atomic, durable replacement of a file or a directory entry.

A save writes a temporary name in the destination directory, fsyncs it, renames it over the
destination and fsyncs the directory. rename(2) within one directory is atomic, so after a crash
at any point the destination is either the old file or the complete new one; the directory fsync
makes the rename itself durable. Through a gdsfs mount every step reaches the backing directory
(design.md: fsync is honest).

Standard library only.
"""

from __future__ import annotations

import errno as _errno
import os
import secrets
from contextlib import contextmanager
from typing import Iterator

TMP_MARKER = ".gdsfs-tmp-"


def temp_name(dest: str) -> str:
    """A fresh hidden temporary path next to ``dest`` (same directory, so rename is atomic)."""
    d, base = os.path.split(dest)
    return os.path.join(d, f".{base}{TMP_MARKER}{secrets.token_hex(6)}")


def fsync_dir(path: str) -> None:
    """fsync the directory ``path`` so renames and creations in it are durable."""
    fd = os.open(path or ".", os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _save_error(dest: str, err: OSError) -> OSError:
    """The one-line error of a save the directory refuses: what is wrong and what to do (the
    temporary file it names is gdsfs's, not the user's); other errors are left as they are."""
    parent = os.path.dirname(dest)
    if err.errno in (_errno.EACCES, _errno.EPERM):
        why = f"no permission to create files in {parent!r} (uid {os.geteuid()}): save to a directory you can write, or change its permissions"
    elif err.errno == _errno.EROFS:
        why = f"{parent!r} is on a read-only filesystem (or a `gdsfs mount --read-only`): save elsewhere"
    elif err.errno in (_errno.ENOSPC, _errno.EDQUOT):
        try:
            st = os.statvfs(parent)
            free = f"{st.f_bavail * st.f_frsize / (1 << 20):.1f} MiB"
        except OSError:
            free = "the space"
        why = (f"the filesystem of {parent!r} is full ({os.strerror(err.errno)}: the save needs more than the {free} it has): "
               "free space or save elsewhere; nothing was replaced")
    else:
        return err
    return type(err)(err.errno, f"gdsfs: cannot save {dest!r}: {why}")


@contextmanager
def replace(dest: str | os.PathLike[str], *, sync: bool = True, sync_dir: bool = True) -> Iterator[tuple[str, int]]:
    """Create a temp file next to ``dest``; on success make it ``dest`` atomically.

    Yields ``(temp_path, fd)``: the caller writes through ``fd`` (or reopens ``temp_path``). On a
    normal exit the file is fsynced (when ``sync``), renamed over ``dest`` and the directory
    fsynced (when ``sync`` and ``sync_dir``: a caller renaming several files into one directory
    passes ``sync_dir=False`` and calls :func:`fsync_dir` once after the last, before anything
    that relies on the names being durable); on an exception the temp file is removed and
    ``dest`` is untouched.

    Example:
        with replace("/mnt/gdsfs/ckpt.pt") as (tmp, fd):
            os.pwrite(fd, b"...", 0)
    """
    dest = os.path.abspath(os.fspath(dest))
    parent = os.path.dirname(dest)
    if not os.path.isdir(parent):
        raise FileNotFoundError(_errno.ENOENT, f"gdsfs: cannot save {dest!r}: directory {parent!r} does not exist; create it first")
    if os.path.isdir(dest):
        raise IsADirectoryError(_errno.EISDIR, f"gdsfs: cannot save to {dest!r}: it is a directory")
    tmp = temp_name(dest)
    try:
        fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o666)
    except OSError as e:
        raise _save_error(dest, e) from None
    try:
        yield tmp, fd
        if sync:
            os.fsync(fd)
    except BaseException as e:
        os.close(fd)
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        if isinstance(e, OSError) and e.errno in (_errno.ENOSPC, _errno.EDQUOT):
            raise _save_error(dest, e) from None
        raise
    os.close(fd)
    try:
        os.rename(tmp, dest)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise
    if sync and sync_dir:
        fsync_dir(os.path.dirname(dest))
