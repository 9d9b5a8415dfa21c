"""Errors and the one-time fallback warning of the gdsfs client."""

from __future__ import annotations

import threading
import warnings

__all__ = ["GDSFallbackWarning", "GDSLeaseError", "GDSPoolError", "GDSPoolWarning", "GDSShardError", "GDSShardWarning", "GDSUnavailableError",
           "warn_fallback"]


class GDSUnavailableError(RuntimeError):
    """The gdsfs control path cannot serve a request.

    Raised when a path is not on a gdsfs mount, the daemon refuses or fails a
    request, or a caller asked for ``strict=True`` and gdsfs would otherwise
    fall back to plain reads. ``errno`` is set when the daemon answered with an
    errno.
    """

    def __init__(self, message: str, *, errno: int | None = None) -> None:
        super().__init__(message)
        self.errno = errno


class GDSPoolError(GDSUnavailableError):
    """What a DataLoader needs of the daemon's pool at once cannot fit this uid's share of it
    (``max_lease`` of HELLO: ``--uid-share`` of ``--gpu-pool``/``--host-pool``): one batch is
    larger than the share, or the workers' batches in flight can fill it while the batch the
    loop waits for still needs room (a hang until a READ gives up after 120 s). Raised by
    ``gdsfs.torch.DataLoader`` when an iteration starts, before any worker is started; the
    message names the numbers and what to change. ``errno`` is EAGAIN, what the workers' READs
    would have waited on."""


class GDSLeaseError(RuntimeError):
    """The memory a TensorRef (or a zero-copy view) names is no longer this
    session's: its lease was released (materialized twice, or released
    explicitly), or its session ended (closed by another process, or the
    daemon restarted). gdsfs never returns bytes it cannot prove were the
    lease's: re-read the sample.

    Attributes:
        lease: the lease id.
        field: the sample field ("" when unknown).
        key: the sample key ("" when unknown).
        path: the shard or file the bytes were read from ("" when unknown).
        reason: what happened to the lease.

    The message ends with what to do: read the sample again, or, when the daemon exited, mount
    again and start a new pass (``hint``).
    """

    def __init__(self, lease: int, reason: str, *, field: str = "", key: str = "", path: str = "", hint: str = "") -> None:
        what = f" of field {field!r}" if field else ""
        what += f" of sample {key!r}" if key else ""
        what += f" from {path!r}" if path else ""
        hint = hint or "read the sample again (materialize each TensorRef once, before its session ends)"
        super().__init__(f"gdsfs: lease {lease}{what} is not held any more: {reason}; {hint}")
        self.lease, self.field, self.key, self.path, self.reason = lease, field, key, path, reason


class GDSFallbackWarning(UserWarning):
    """gdsfs fell back to plain POSIX I/O (issued once per process and cause)."""


class GDSShardError(ValueError):
    """A shard (or one sample of it) cannot be read: corrupt, truncated, or a field that does not
    decode. ``path`` is the shard, ``key`` the sample key (None for the whole shard), ``reason``
    what is wrong with it."""

    def __init__(self, message: str, *, path: str = "", key: str | None = None, reason: str = "") -> None:
        # path has a default so that torch's DataLoader, which re-raises a worker's exception as
        # ``type(e)(message)``, keeps it a GDSShardError (not a RuntimeError) in the main process.
        super().__init__(message)
        self.path = path
        self.key = key
        self.reason = reason


class GDSShardChangedError(GDSShardError):
    """A shard was rewritten in place (same path and inode, other contents) while a dataset read
    it: the samples it planned from the old contents cannot be read from the new ones. Restart
    the epoch (or resume from a state_dict); write shards under a new name and rename them into
    place. Its one-argument form is what a DataLoader worker's error is re-raised as."""

    def __init__(self, message: str, *, path: str = "", key: str | None = None, reason: str = "") -> None:
        super().__init__(message, path=path, key=key, reason=reason)


class GDSPoolWarning(UserWarning):
    """A DataLoader's batches in flight are more than this uid's share of the daemon's pool,
    though the batch the loop waits for always finds room: its workers wait for the loop to
    return pool space, and run slower than they could (issued once per loader)."""


class GDSShardWarning(UserWarning):
    """A bad shard or sample was skipped (GDSShardDataset(handler="warn_and_skip"))."""


_warned_lock = threading.Lock()
# The causes already reported by warn_fallback in this process. A set of strings the tests reset;
# the only process-wide state of the client, as a warnings registry is.
_warned: set[str] = set()


def warn_fallback(message: str, *, strict: bool = False, stacklevel: int = 3, cause: str | None = None,
                  doing: str = "using plain reads", fix: str = "") -> None:
    """Raise GDSUnavailableError when strict, else warn once per process and cause.

    Args:
        message: what is unavailable and what the user can do about it (a leading "gdsfs: " is
            not repeated).
        strict: raise instead of warning.
        stacklevel: passed to warnings.warn.
        cause: what makes two fallbacks the same, reported once (e.g. "off-mount checkpoint",
            or the daemon's mount); default: the message itself.
        doing: what gdsfs does instead, ending the warning ("using plain reads", "using plain
            writes").
        fix: what the user can do about it, named in the strict error (e.g. "mount its directory
            with `gdsfs mount`").
    """
    if message.startswith("gdsfs: "):
        message = message[len("gdsfs: "):]
    if strict:
        todo = f": {fix}, or" if fix else "; to accept that,"
        raise GDSUnavailableError(f"gdsfs: {message}{todo} drop strict=True to go on {doing}")
    key = cause if cause is not None else message
    with _warned_lock:
        if key in _warned:
            return
        _warned.add(key)
    warnings.warn(f"gdsfs: {message}; {doing}", GDSFallbackWarning, stacklevel=stacklevel)


def _reset_fallback_warning() -> None:
    """Let the next fallback of every cause warn again (for tests)."""
    with _warned_lock:
        _warned.clear()
