"""Errors and the one-time fallback warning of the gdsfs client."""

from __future__ import annotations

import threading
import warnings

__all__ = ["GDSFallbackWarning", "GDSLeaseError", "GDSUnavailableError", "warn_fallback"]


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
    """

    def __init__(self, lease: int, reason: str, *, field: str = "", key: str = "", path: str = "") -> None:
        what = f" of field {field!r}" if field else ""
        what += f" of sample {key!r}" if key else ""
        what += f" from {path!r}" if path else ""
        super().__init__(f"gdsfs: lease {lease}{what} is not held any more: {reason}; read the sample again (materialize each TensorRef once, before its session ends)")
        self.lease, self.field, self.key, self.path, self.reason = lease, field, key, path, reason


class GDSFallbackWarning(UserWarning):
    """gdsfs fell back to plain POSIX reads (issued once per process)."""


_warned_lock = threading.Lock()
_warned: list[bool] = [False]


def warn_fallback(message: str, *, strict: bool = False, stacklevel: int = 3) -> None:
    """Raise GDSUnavailableError when strict, else warn once per process.

    Args:
        message: what is unavailable and what the user can do about it.
        strict: raise instead of warning.
        stacklevel: passed to warnings.warn.
    """
    if strict:
        raise GDSUnavailableError(message)
    with _warned_lock:
        if _warned[0]:
            return
        _warned[0] = True
    warnings.warn(f"gdsfs: {message}; using plain reads", GDSFallbackWarning, stacklevel=stacklevel)


def _reset_fallback_warning() -> None:
    """Let the next fallback warn again (for tests)."""
    with _warned_lock:
        _warned[0] = False
