"""CUDA devices named by UUID between this process and the gdsfs daemon (torch-free).

The daemon numbers its GPUs as its own CUDA_VISIBLE_DEVICES view does; a trainer's view is often
another one (a root daemon sees the node's 8 GPUs, a pod sees its GPU 5 as cuda:0). CUDA ordinals
are positions in a view; a GPU's UUID is the same in every process. So a client that can tell
both sides' UUIDs translates:

- ``cuda:N`` of this process (torch's numbering) -> the daemon's ordinal with cuda:N's UUID, the
  device READ, READ_NAMES and ALLOC name on the wire;
- a slab the daemon hands over on its ordinal D -> this process's ordinal of D's UUID, where
  it is imported.

The daemon publishes its UUIDs in STATUS (``pool.devices[].uuid``, announced by the HELLO
capability ``DEVICE_UUIDS``); this process's come from torch
(``torch.cuda.get_device_properties(N).uuid``) or the driver (``cuDeviceGetUuid`` through
gdsfs._cuda). Where either side cannot tell (an older daemon, the host engine, a process
without CUDA, a DataLoader worker, which never initialises CUDA: it uses the translation its
dataset carries), ordinals are used as they are, as before. ``GDSFS_DEVICE_UUIDS=0`` turns the
translation off.
"""

from __future__ import annotations

import os
import sys
import threading
from dataclasses import dataclass
from typing import Any, Callable, Optional, Sequence

from ._errors import GDSUnavailableError

__all__ = ["DeviceMap", "UNRESOLVED", "daemon_uuids", "local_uuids", "normalize", "normalized", "resolve", "spell", "uuids_from_status"]

ENV = "GDSFS_DEVICE_UUIDS"

# A Session's map before anyone asked for it (None is "resolved: ordinals as they are").
UNRESOLVED: Any = "unresolved"

_HEX = frozenset("0123456789abcdef")


def normalize(uuid: Any) -> Optional[str]:
    """The 32 lowercase hex digits of a device UUID in any of its spellings ("GPU-4a8c2a6e-...",
    "MIG-...", torch's "4a8c2a6e-0123-...", 16 raw bytes); None when it is not one."""
    if isinstance(uuid, (bytes, bytearray)):
        return bytes(uuid).hex() if len(uuid) == 16 else None
    s = str(uuid).strip().lower()
    for prefix in ("gpu-", "mig-"):
        if s.startswith(prefix):
            s = s[len(prefix):]
            break
    h = s.replace("-", "")
    return h if len(h) == 32 and set(h) <= _HEX else None


def normalized(uuids: Sequence[Any]) -> Optional[tuple[str, ...]]:
    """Every UUID of uuids normalized, or None when one is not a UUID."""
    out = tuple(normalize(u) for u in uuids)
    return None if any(h is None for h in out) else out  # type: ignore[return-value]


def spell(h: str) -> str:
    """A normalized UUID as nvidia-smi and CUDA_VISIBLE_DEVICES spell it."""
    return f"GPU-{h[0:8]}-{h[8:12]}-{h[12:16]}-{h[16:20]}-{h[20:32]}"


@dataclass(frozen=True)
class DeviceMap:
    """This process's CUDA devices matched with the daemon's, by UUID. Small and picklable: a
    Session carries it to DataLoader workers, which cannot ask CUDA themselves.

    Attributes:
        mount: the daemon's mount (for messages).
        local: the UUID (normalize) of each of this process's CUDA ordinals.
        daemon: the UUID of each of the daemon's ordinals.
    """

    mount: str
    local: tuple[str, ...]
    daemon: tuple[str, ...]

    @property
    def identity(self) -> bool:
        """True when every ordinal of this process is the daemon's own."""
        return all(i < len(self.daemon) and self.daemon[i] == u for i, u in enumerate(self.local))

    def to_daemon(self, n: int) -> int:
        """The daemon's ordinal of this process's cuda:n (-1, host memory, stays -1).

        Raises:
            GDSUnavailableError (errno ENODEV): the daemon does not serve that GPU, or this
                process has no cuda:n.
        """
        if n < 0:
            return n
        if n >= len(self.local):
            raise GDSUnavailableError(f"gdsfs: cuda:{n} is not a CUDA device of this process (it sees {len(self.local)}): "
                                      f"pass an existing 'cuda:N', or device='cpu'", errno=19)
        try:
            return self.daemon.index(self.local[n])
        except ValueError:
            theirs = ", ".join(spell(u) for u in self.daemon) or "none"
            raise GDSUnavailableError(f"gdsfs: cuda:{n} ({spell(self.local[n])}) is not one of the gdsfs daemon's GPUs at {self.mount} "
                                      f"({theirs}): start the daemon with that GPU visible, or pass device='cpu'", errno=19) from None

    def to_local(self, d: int) -> int:
        """This process's ordinal of the daemon's device d (-1 stays -1).

        Raises:
            GDSUnavailableError (errno ENODEV): this process does not see that GPU.
        """
        if d < 0:
            return d
        if d >= len(self.daemon):
            raise GDSUnavailableError(f"gdsfs: the gdsfs daemon at {self.mount} names its device {d}, but publishes {len(self.daemon)} GPUs: "
                                      "upgrade the daemon or the client", errno=19)
        try:
            return self.local.index(self.daemon[d])
        except ValueError:
            mine = ", ".join(spell(u) for u in self.local) or "none"
            raise GDSUnavailableError(f"gdsfs: daemon memory at {self.mount} lies on {spell(self.daemon[d])}, which this process does not see "
                                      f"(its CUDA devices: {mine}): make that GPU visible here (CUDA_VISIBLE_DEVICES), or read into one it sees",
                                      errno=19) from None


def _enabled() -> bool:
    return os.environ.get(ENV, "") not in ("0", "off", "no", "false")


def _cuda_forbidden() -> bool:
    """True in a DataLoader worker (which never initialises CUDA) and in a fork of a process
    that had (CUDA is unusable there)."""
    data = sys.modules.get("torch.utils.data")
    if data is not None and getattr(data, "get_worker_info", lambda: None)() is not None:
        return True
    bad_fork = getattr(getattr(sys.modules.get("torch"), "cuda", None), "_is_in_bad_fork", None)
    return bool(bad_fork is not None and bad_fork())


def _torch_uuids(torch: Any) -> Optional[list[str]]:
    """This process's device UUIDs as torch tells them; None when this torch does not say."""
    cuda = torch.cuda
    if not cuda.is_available():
        return []
    out = []
    for i in range(cuda.device_count()):
        u = getattr(cuda.get_device_properties(i), "uuid", None)
        h = normalize(u) if u is not None else None
        if h is None:
            return None  # a torch without the uuid property: ask the driver
        out.append(h)
    return out


def _driver_uuids() -> Optional[list[str]]:
    from . import _cuda

    out = []
    for u in _cuda.device_uuids():
        h = normalize(u)
        if h is None:
            return None
        out.append(h)
    return out


def local_uuids() -> Optional[list[str]]:
    """The UUID of each of this process's CUDA devices, by ordinal (torch's numbering), or None
    when this process cannot tell (no CUDA, a DataLoader worker, GDSFS_DEVICE_UUIDS=0)."""
    if not _enabled() or _cuda_forbidden():
        return None
    try:
        torch = sys.modules.get("torch")
        got = _torch_uuids(torch) if torch is not None else None
        return got if got is not None else _driver_uuids()
    except Exception:  # noqa: BLE001 - no driver, no device, a failed call: ordinals as they are
        return None


def uuids_from_status(doc: Any, devices: int) -> Optional[tuple[str, ...]]:
    """The daemon's device UUIDs by ordinal from its STATUS document (``pool.devices[].uuid``),
    or None unless every one of its ``devices`` is named exactly once with a valid UUID."""
    try:
        entries = doc["pool"]["devices"]
    except (KeyError, TypeError):
        return None
    if not isinstance(entries, list):
        return None
    by_dev: dict[int, str] = {}
    for e in entries:
        if not isinstance(e, dict):
            return None
        d, u = e.get("device"), e.get("uuid")
        h = normalize(u) if isinstance(u, str) else None
        if not isinstance(d, int) or isinstance(d, bool) or h is None or d in by_dev:
            return None
        by_dev[d] = h
    if devices <= 0 or sorted(by_dev) != list(range(devices)) or len(set(by_dev.values())) != devices:
        return None
    return tuple(by_dev[i] for i in range(devices))


class _Cache:
    """The daemons' UUIDs, per (mount, daemon pid, run): one STATUS per daemon run and process."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.daemons: dict[tuple[str, int, str], Optional[tuple[str, ...]]] = {}


_cache = _Cache()


def daemon_uuids(mount: str, daemon_pid: int, devices: int, status: Callable[[], Any], *,
                 run: str = "") -> Optional[tuple[str, ...]]:
    """The daemon's device UUIDs (uuids_from_status of status()), asked once per daemon run:
    ``run`` is the run's slab socket name (HELLO), since a restarted daemon may have its old pid
    (a fresh container's pid namespace) and another view of the GPUs."""
    key = (mount, daemon_pid, run)
    with _cache.lock:
        if key in _cache.daemons:
            return _cache.daemons[key]
    try:
        doc = status()
    except (OSError, ValueError, GDSUnavailableError):
        return None  # not cached: the next session asks again
    got = uuids_from_status(doc, devices)
    with _cache.lock:
        _cache.daemons[key] = got
    return got


def resolve(mount: str, daemon: Callable[[], Optional[Sequence[str]]]) -> Optional[DeviceMap]:
    """The DeviceMap of this process against a daemon whose UUIDs daemon() tells (asked only
    when this process can tell its own), or None: ordinals as they are."""
    mine = local_uuids()
    if not mine:
        return None
    theirs = daemon()
    if not theirs:
        return None
    return DeviceMap(mount, tuple(mine), tuple(theirs))
