"""torch.distributed.checkpoint storage through gdsfs: GDSFileSystemWriter and GDSFileSystemReader.

Both subclass the stock FileSystemWriter/FileSystemReader and keep their on-disk layout: the same
``.metadata`` pickle, the same ``__{rank}_{n}.distcp`` files, each tensor item a complete
torch.save archive and each byte item raw bytes, located by ``_StorageInfo(relative_path, offset,
length)``. So the stock FileSystemReader loads what GDSFileSystemWriter saves and
GDSFileSystemReader loads what the stock writer saves. What changes is how bytes move:

- **Writes.** Each tensor item is laid out at a 4096-byte boundary with its storage record
  4096-aligned too; the tensor bytes go from GPU (or host) memory to the file through the daemon
  in one batched call per file, with no trip through a CPU copy in this process. Each data file
  is written under a temporary name, fsynced as soon as its own writes end and renamed; one
  directory fsync after the last makes their names durable; ``finish`` commits ``.metadata`` the
  stock way (temp, fsync, rename) and then fsyncs the directory. A save the filesystem has no
  room for (statvfs) is refused before any file is created, with an OSError(ENOSPC) naming the
  directory and the bytes needed. A save that fails midway (the disk fills up after the check, a write
  fails) removes the data files it had already renamed into place before it raises. Saving over an existing
  checkpoint writes data files of new names (``__{rank}_{n}.{save id}.distcp``), so a crash leaves
  the old checkpoint intact; once the new ``.metadata`` is committed, the data files the old one
  named, and only those, are removed. A data file missing after the save is an error naming it.
- **Reads.** Every tensor item's pickle is decoded here (without allocating its storage); the
  storage bytes of all items of a call go through one read pipeline (tensorio.ReadPipeline):
  a file's READs start as soon as its headers are decoded, so the next file is decoded while
  they run and the READs of the files of a resharded load (2 -> 1 ranks) overlap instead of
  running one file after the other. Only the bytes each ReadItem covers are read: when they
  are one contiguous run of the saved chunk (the whole chunk, or a row-slab of it: Shard(0) ->
  Replicate, 2 -> 1 or 1 -> 2 ranks) they land straight in the planner's target; otherwise
  (another shard dim) the span from the first to the last needed element is read into a
  temporary and narrowed into the target on the device (for a split along the last dim, twice
  the bytes the rank needs: the rows' other halves lie between them).
- **Async staging.** ``stage`` (used by ``dcp.async_save``) copies the state dict into daemon
  slabs (leases) instead of CPU memory: plain tensors, the local tensor of each DTensor and the
  local shards of each ShardedTensor, by a device-to-device copy on the current stream that the
  training step does not wait for; ``write_data`` has the daemon write those leases to the files
  without another copy, and releases them. Per tensor, never for the whole dict, what the slabs
  cannot take is staged the stock way, in host memory (one GDSFallbackWarning per process says
  how many bytes, and how to size ``--gpu-pool`` and ``--slab-size``: docs/operations.md):
  tensors larger than one slab (``gdsfs mount --slab-size``) and tensors the full pool has no
  room for. Off gdsfs, or with ``staging="cpu"`` (needed with
  ``AsyncCheckpointerType.PROCESS``, whose snapshot must cross processes), the whole dict is.
  A staged snapshot of 512 MiB or more per rank goes to up to 4 data files of a rank (the
  layout ``thread_count=4`` gives), written in parallel: one file's writeback is slower than
  the disk; each file's writes start as soon as it is laid out when the filesystem has room
  for an upper bound of the save (else every file is laid out and checked first). The session of a finished snapshot stays open, holding no lease, for the next snapshot of the
  process (of any writer), so that its slabs need not be mapped again; ``close_staging()``
  closes it.

Off gdsfs, or when the daemon cannot serve, both fall back to the stock implementation after the
one-time GDSFallbackWarning (``strict=True`` raises instead). A DataLoader's state rides along as
any ``Stateful`` does (a BYTE_IO item).

Example:
    import torch.distributed.checkpoint as dcp
    from gdsfs.dcp import GDSFileSystemWriter, GDSFileSystemReader
    dcp.save({"model": model.state_dict(), "loader": loader},
             storage_writer=GDSFileSystemWriter("/mnt/gdsfs/ckpt/step_1000"))
    dcp.load(state, storage_reader=GDSFileSystemReader("/mnt/gdsfs/ckpt/step_1000"))
"""

from __future__ import annotations

import atexit
import contextlib
import errno
import io
import os
import re
import sys
import threading
import time
from typing import Any

import torch

try:
    from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
    from torch.distributed.checkpoint import filesystem as _fs
    from torch.distributed.checkpoint.planner import LoadItemType, WriteItemType
except ImportError as _e:  # torch 1.x: no (usable) torch.distributed.checkpoint
    raise ImportError(
        f"gdsfs.dcp needs torch >= 2.0 with torch.distributed.checkpoint; this is torch {torch.__version__} "
        f"({_e}): upgrade torch, or save with gdsfs.checkpoint / gdsfs.safetensors"
    ) from None
from torch.futures import Future

from gdsfs._ckpt import atomic, torchzip
from gdsfs._ckpt.tensorio import BUFFER as _BUFFER, byte_view, transfer, untyped_storage
from gdsfs._core import on_gdsfs
from gdsfs._errors import GDSUnavailableError, warn_fallback

__all__ = ["GDSFileSystemWriter", "GDSFileSystemReader", "close_staging"]

_OFF_MOUNT = "off-mount dcp"
_SUFFIX = getattr(_fs, "DEFAULT_SUFFIX", ".distcp")
_ALIGN = 4096
# A staged snapshot of a rank goes to up to _STAGED_FILES data files of at least
# _STAGED_FILE_BYTES each, written in parallel (see write_data).
_STAGED_FILES = 4
_STAGED_FILE_BYTES = 256 << 20
# A staged snapshot's writes start the file's writeback this often (FLUSH_BYTES is for writes
# that copy as they go): the leases are ready at once, so the disk should start at once too.
_STAGED_FLUSH_BYTES = 128 << 20
# Bytes a tensor item's archive takes beyond its tensor's at most (headers, data.pkl, small
# records, central directory, 4 KiB alignment of the record and of the item): an upper bound
# for _surely_fits (the archive of a 4-dim tensor takes about 10 KiB more than its bytes).
_ITEM_SLACK = 1 << 20
# Temporaries (of resharded reads) that one batch of a file's reads may hold before it is flushed.
_BATCH_TEMP = 1 << 30
# Data files this writer names over an existing checkpoint: __{rank}_{n}.{save id prefix}.distcp.
# Stock DCP never makes such names, so one that no .metadata names is left by a crashed save.
_OWN_NAME = re.compile(r"__\d+_\d+\.[0-9a-f]{1,8}" + re.escape(_SUFFIX))


class _KeepMetadataFS:
    """The writer's FileSystem, except that it never unlinks a ``.metadata`` file.

    Stock ``finish`` unlinks the old ``.metadata`` before renaming the new one over it, leaving a
    moment with no checkpoint at all; rename(2) replaces the old file atomically on its own.
    """

    def __init__(self, fs: Any) -> None:
        self._fs = fs

    def rm_file(self, path: Any) -> None:
        if os.path.basename(os.fspath(path)).endswith(".metadata"):
            return
        self._fs.rm_file(path)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._fs, name)


def _has_metadata(root: str) -> bool:
    try:
        return any(n == ".metadata" or (n.startswith("__") and n.endswith(".metadata")) for n in os.listdir(root))
    except FileNotFoundError:
        return False


def _files_named_by(metadata_path: str) -> set[str]:
    """The data files a committed ``.metadata`` names; empty when there is none or it cannot be
    read (then nothing is judged stale: only files a readable old checkpoint named are removed)."""
    import pickle

    try:
        with open(metadata_path, "rb") as f:
            md = pickle.load(f)
        return {r for r in (getattr(i, "relative_path", None) for i in (md.storage_data or {}).values())
                if isinstance(r, str) and r and os.path.basename(r) == r}
    except Exception:  # noqa: BLE001 - absent, torn by a crash, or from an unknown torch: keep all
        return set()


def _missing_error(root: str, name: str, when: str) -> FileNotFoundError:
    try:
        have = sorted(os.listdir(root))
    except OSError as e:
        have = [f"(cannot list: {e})"]
    return FileNotFoundError(errno.ENOENT, f"gdsfs.dcp: data file {name!r} is missing {when}; {root!r} holds {have}")


def _buckets(bins: int, items: list[Any]) -> list[list[Any]]:
    split = getattr(_fs, "_split_by_size_and_type", None)
    if split is not None:
        return split(bins, items)
    return [items]


def _align_up(n: int, a: int = _ALIGN) -> int:
    return -(-n // a) * a


class _CachedBytes:
    """A save planner whose byte items are resolved once (stock planners torch.save the object
    anew on every resolve_data); everything else passes through."""

    def __init__(self, planner: Any) -> None:
        self._planner = planner
        self._bytes: dict[Any, Any] = {}

    def resolve_data(self, wi: Any) -> Any:
        if wi.type != WriteItemType.BYTE_IO:
            return self._planner.resolve_data(wi)
        if wi.index not in self._bytes:
            self._bytes[wi.index] = self._planner.resolve_data(wi)
        return self._bytes[wi.index]

    def __getattr__(self, name: str) -> Any:
        return getattr(self._planner, name)


class _FileLayout:
    """One data file of a save, laid out (GDSFileSystemWriter._layout_file) before any is written."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.results: list[Any] = []  # the WriteResults of its items
        self.small: list[tuple[int, bytes]] = []  # (offset, bytes): byte items, archive headers
        self.data: list[tuple[int, torch.Tensor]] = []  # (offset, uint8 view) of tensor bytes
        self.copies: list[tuple[int, torch.Tensor, int]] = []  # (offset, tensor, archive size) to copy first
        self.direct: list[tuple[int, Any, Any, int]] = []  # (offset, session, ref, nbytes) of staged leases
        self.direct_keys: list[tuple[int, Any, Any, int]] = []  # (data_ptr, ...) of the same, for their release
        self.size = 0  # the file's final size


class GDSFileSystemWriter(FileSystemWriter):
    """A FileSystemWriter whose tensor bytes move through gdsfs (see the module doc).

    Takes every argument of the installed FileSystemWriter, plus:

    Args:
        strict: raise GDSUnavailableError instead of falling back to the stock writer.
        staging: "gdsfs" stages ``dcp.async_save`` snapshots into daemon slabs where possible;
            "cpu" always stages the stock way.
    """

    fs: Any  # the stock writer's FileSystem, wrapped in __init__
    # Whether a data file of staged leases is fallocate'd to its final size before the daemon
    # writes them (so that ext4 runs its O_DIRECT writes in parallel as overwrites). Off: measured
    # on ext4 through the mount, fallocate while the other files' writes run stalls (up to 80 ms)
    # and makes their fsyncs longer, for no faster writes (docs/benchmarks.md, "Staged save vs
    # the disk"); _check_space refuses a save that cannot fit instead (GPU run of 12-01 21:00:
    # fallocate 1.01x / 0.99x the save without it).
    _prealloc = False
    # The most data files a staged snapshot of a rank goes to (None: _STAGED_FILES), each of at
    # least _STAGED_FILE_BYTES * _STAGED_FILES / that many bytes. scripts/gpu/dcp_check.py sets
    # 8 per writer for its A/B of the layout: on ext4 a file's O_DIRECT writes past its end run
    # one at a time, so the files are the save's parallel streams.
    _files_max: int | None = None

    def __init__(self, path: str | os.PathLike, *args: Any, strict: bool = False, staging: str = "gdsfs",
                 **kwargs: Any) -> None:
        if staging not in ("gdsfs", "cpu"):
            raise ValueError(f"gdsfs: staging {staging!r} must be 'gdsfs' or 'cpu'")
        super().__init__(path, *args, **kwargs)
        self.fs = _KeepMetadataFS(self.fs)
        self._strict = strict
        self._staging = staging
        # data_ptr -> (session, Ref) of tensors staged into leases by stage().
        self._staged: dict[int, tuple[Any, Any]] = {}
        self._written: list[str] = []  # data files this process wrote in the current save
        self._stage_session: Any = None
        self._slab: int | None = None  # the daemon's slab size, learnt at the first stage()
        # The smallest staged lease the daemon writes around the page cache (None: it does not
        # say, or writes buffered), learnt with the slab size.
        self._direct_min: int | None = None
        self._copies: list[Any] = []  # CUDA events after the staging copies
        self._mover: Any = None  # the DaemonMover of the current snapshot's session
        self._staged_lock = threading.Lock()  # data files of a staged snapshot are written in parallel
        # Whether _write_file releases a file's leases as soon as they are written (a tensor of
        # the save needs pool room of its own), or write_data releases them all at its end.
        self._release_early = True
        self._stage_mount = ""  # the mount of that session
        # What the last stage() put into daemon slabs and what it staged the stock way.
        self.stage_stats: dict[str, int] = {}
        # Where the last save's time went, in seconds (see _timed); "t_*" are time.perf_counter()
        # readings, the others durations.
        self.save_times: dict[str, float] = {}
        self._times_lock = threading.Lock()

    def _timed(self, key: str, secs: float, *, most: bool = False) -> None:
        """Add ``secs`` to ``save_times[key]`` (``most``: keep the largest, for per-file phases
        that run in parallel)."""
        with self._times_lock:
            old = self.save_times.get(key, 0.0)
            self.save_times[key] = max(old, secs) if most else old + secs

    # -- writing -------------------------------------------------------------------------------

    def _stock_only(self) -> bool:
        fmt = getattr(self, "serialization_format", None)
        if fmt is not None and getattr(fmt, "value", "torch_save") != "torch_save":
            return True
        transforms = getattr(self, "transforms", None)
        return bool(getattr(transforms, "extensions", ()))

    def write_data(self, plan: Any, planner: Any) -> Future:
        """Write the plan's items as stock DCP does, tensor bytes through gdsfs."""
        self.save_times = {k: v for k, v in self.save_times.items() if k in ("stage_s", "t_staged")}
        self.save_times["t_write_data"] = time.perf_counter()
        root = os.fspath(self.path)
        if self._stock_only() or not on_gdsfs(root, strict=self._strict, cause=_OFF_MOUNT, doing="using plain writes"):
            try:
                return super().write_data(plan, planner)  # synchronous: done when it returns
            finally:
                self._release_staged()
        prefix = plan.storage_data.prefix
        # Stock names (__{rank}_{n}.distcp) for a new checkpoint. Over an existing one, the new
        # data files get names of their own, so the old .metadata keeps pointing at intact old
        # files until the new .metadata replaces it: a crash leaves the old checkpoint or the new.
        tag = f".{str(getattr(self, 'save_id', ''))[:8] or os.getpid()}" if _has_metadata(root) else ""
        files: list[tuple[str, list[Any]]] = []
        threads = max(1, int(getattr(self, "thread_count", 1)))
        nstaged = self._staged_files() if self.single_file_per_rank and threads == 1 else 1
        if nstaged > 1:
            # A staged snapshot: its bytes are ready at once, and one file's writeback is slower
            # than the disk (GPU run 1: 1.47 GB/s buffered to one file, 2.09 to four, 2.35 with
            # O_DIRECT), so it goes to several files (the layout of thread_count=N), in parallel.
            for bucket in self._split_staged(nstaged, plan.items, planner):
                files.append((f"{prefix}{len(files)}{tag}{_SUFFIX}", bucket))
        elif self.single_file_per_rank:
            for bucket in _buckets(threads, plan.items):
                files.append((f"{prefix}{len(files)}{tag}{_SUFFIX}", bucket))
        else:
            for item in plan.items:
                files.append((f"{prefix}{len(files)}{tag}{_SUFFIX}", [item]))
        results: list[Any] = []
        self._release_early = not self._all_staged(plan.items, planner)
        # Names this save may put in place; those there before it are not its to remove.
        there_before = {name for name, _ in files if os.path.lexists(os.path.join(root, name))}
        try:
            try:
                layouts: list[_FileLayout] = []
                if nstaged > 1:
                    planner = _CachedBytes(planner)  # _surely_fits and _layout_file both resolve byte items
                # Room for the save whatever its exact layout: each file's writes start as soon as
                # it is laid out, while the next one is (laying out every file first, for
                # _check_space, delayed the first write by ~10 ms of a ~550 ms save).
                streamed = nstaged > 1 and self._surely_fits(root, files, planner)
                if not streamed:
                    layouts = [self._layout_file(name, items, planner) for name, items in files]
                    self._check_space(root, layouts)
                if nstaged > 1:
                    from concurrent.futures import ThreadPoolExecutor

                    # Leaving the with block waits for every write: none renames after the cleanup.
                    with ThreadPoolExecutor(len(files), thread_name_prefix="gdsfs-dcp-write") as ex:
                        futs = []
                        for k, (name, items) in enumerate(files):
                            lay = self._layout_file(name, items, planner) if streamed else layouts[k]
                            futs.append(ex.submit(self._write_file, os.path.join(root, lay.name), lay))
                        for f in futs:
                            results += f.result()
                else:
                    for lay in layouts:
                        results += self._write_file(os.path.join(root, lay.name), lay)
            finally:
                self._release_staged()
            if self.sync_files:
                # Every data file was fsynced and renamed into place: one directory fsync makes
                # all their names durable before finish commits the .metadata that names them.
                t = time.perf_counter()
                atomic.fsync_dir(root)
                self.save_times["dirsync_s"] = time.perf_counter() - t
            for name, _ in files:
                if not os.path.exists(os.path.join(root, name)):
                    raise _missing_error(root, name, "right after it was written and renamed into place")
        except BaseException:
            # A data file written and renamed into place before another failed (the disk filled
            # up, a write failed), or whose name the directory fsync could not make durable, is
            # named by no .metadata: remove it, so that a failed save leaves the directory as it
            # found it, not a half-written checkpoint.
            for name, _ in files:
                if name not in there_before:
                    try:
                        os.unlink(os.path.join(root, name))
                    except OSError:  # not written, or the filesystem refuses (read-only after the
                        pass  # error): the save's own error is the one to raise
            raise
        self._written = [name for name, _ in files]
        self.save_times["t_written"] = time.perf_counter()
        fut: Future = Future()
        fut.set_result(results)
        return fut

    def _all_staged(self, items: list[Any], planner: Any) -> bool:
        """True when every tensor item with bytes sits in a lease staged by stage() (as
        _write_file decides), so that no write of this save needs room in the pool."""
        with self._staged_lock:
            if not self._staged:
                return False
            for wi in items:
                if wi.type == WriteItemType.BYTE_IO:
                    continue
                t = planner.resolve_data(wi).detach()
                n = t.numel() * t.element_size()
                if not n:
                    continue
                got = self._staged.get(t.data_ptr()) if t.device.type in ("cpu", "cuda") and t.is_contiguous() else None
                if got is None or int(got[1].valid) < n:
                    return False
        return True

    def _staged_files(self) -> int:
        """How many data files this rank's staged snapshot goes to (1: not staged, or small)."""
        with self._staged_lock:
            nbytes = sum(int(ref.valid) for _, ref in self._staged.values())
        most = max(1, self._files_max or _STAGED_FILES)
        return max(1, min(most, nbytes * most // (_STAGED_FILE_BYTES * _STAGED_FILES)))

    @staticmethod
    def _split_staged(n: int, items: list[Any], planner: Any) -> list[list[Any]]:
        """``items`` in ``n`` buckets of about equal tensor bytes (byte items in the first), each
        in the plan's order."""
        sized = []
        for k, wi in enumerate(items):
            if wi.type == WriteItemType.BYTE_IO:
                sized.append((0, k, wi))
                continue
            t = planner.resolve_data(wi)
            sized.append((t.numel() * t.element_size(), k, wi))
        buckets: list[list[tuple[int, Any]]] = [[] for _ in range(n)]
        load = [0] * n
        for size, k, wi in sorted(sized, key=lambda x: (-x[0], x[1])):
            b = 0 if wi.type == WriteItemType.BYTE_IO else min(range(n), key=lambda i: (load[i], i))
            buckets[b].append((k, wi))
            load[b] += size
        return [[wi for _, wi in sorted(b, key=lambda x: x[0])] for b in buckets if b]

    def _layout_file(self, name: str, items: list[Any], planner: Any) -> "_FileLayout":
        """Where each item of one data file goes, and the file's size, before anything is written.

        Tensors that must be copied first (not contiguous, a view of a larger storage, on another
        device) are laid out from a host placeholder of the same layout and copied only when
        their file is written (_write_file), so that laying out every file of the save up front
        holds no copy."""
        lay = _FileLayout(name)
        pos = 0
        for wi in items:  # raw bytes first, as the stock writer orders them
            if wi.type != WriteItemType.BYTE_IO:
                continue
            buf = planner.resolve_data(wi)
            b = bytes(buf.getbuffer()) if isinstance(buf, io.BytesIO) else bytes(buf)
            lay.small.append((pos, b))
            lay.results.append(_result(wi, name, pos, len(b)))
            pos += len(b)
        for wi in items:
            if wi.type == WriteItemType.BYTE_IO:
                continue
            t = planner.resolve_data(wi).detach()
            nbytes = t.numel() * t.element_size()
            on_host_or_gpu = t.device.type in ("cpu", "cuda")
            staged = self._staged.get(t.data_ptr()) if on_host_or_gpu and nbytes and t.is_contiguous() else None
            pos = _align_up(pos)
            if staged is not None and int(staged[1].valid) >= nbytes:
                # Staged by stage(): the bytes already sit in a lease; the archive only needs the
                # tensor's pickle, so plan it from an untouched host placeholder of the same layout.
                arc = torchzip.build(torch.empty(t.shape, dtype=t.dtype), "archive", alignment=_ALIGN, location="cpu")
                rec = arc.storages[0][0]
                lay.direct.append((pos + rec.data_offset, staged[0], staged[1], rec.size))
                lay.direct_keys.append((t.data_ptr(), staged[0], staged[1], rec.size))
                lay.small += arc.metadata_writes(pos)
            elif (not on_host_or_gpu or not t.is_contiguous() or t.storage_offset() != 0
                  or untyped_storage(t).nbytes() != nbytes):
                # An item holds exactly its tensor's bytes, as stock DCP's host copy does: copied
                # when the file is written; its size is that of a placeholder's archive.
                arc = torchzip.build(torch.empty(t.shape, dtype=t.dtype), "archive", alignment=_ALIGN, location="cpu")
                lay.copies.append((pos, t, arc.size))
            else:
                arc = torchzip.build(t, "archive", alignment=_ALIGN, location="cpu")
                lay.data += arc.data_items(pos)
                lay.small += arc.metadata_writes(pos)
            lay.results.append(_result(wi, name, pos, arc.size))
            pos += arc.size
        lay.size = pos
        return lay

    @staticmethod
    def _surely_fits(root: str, files: list[tuple[str, list[Any]]], planner: Any) -> bool:
        """True when the filesystem has room for the save by an upper bound of its size (each
        tensor item's bytes plus _ITEM_SLACK for its archive's records and alignment, each byte
        item's bytes), so that _check_space, which needs every file laid out first, could not
        refuse it. False: lay out everything and let _check_space decide."""
        need = 0
        for _name, items in files:
            for wi in items:
                data = planner.resolve_data(wi)
                if wi.type == WriteItemType.BYTE_IO:
                    need += data.getbuffer().nbytes if isinstance(data, io.BytesIO) else len(bytes(data))
                else:
                    need += data.numel() * data.element_size() + _ITEM_SLACK
        try:
            st = os.statvfs(root)
        except OSError:
            return False
        return bool(st.f_blocks) and need <= st.f_bavail * st.f_frsize

    def _check_space(self, root: str, layouts: list["_FileLayout"]) -> None:
        """Refuse, before any file is created, a save the filesystem has no room for: a save that
        ran out of space part way would have written (and then removed) up to its full size for
        nothing. One OSError(ENOSPC) line names the directory and the bytes needed and free."""
        need = sum(lay.size for lay in layouts)
        try:
            st = os.statvfs(root)
        except OSError:
            return  # a filesystem that cannot say: its writes report their own errors
        have = st.f_bavail * st.f_frsize
        if st.f_blocks and need > have:
            raise OSError(errno.ENOSPC, f"gdsfs.dcp: cannot save to {root!r}: the save needs {_mib(need)} for this "
                          f"rank's data files and the filesystem there has {_mib(have)} available; free space there "
                          f"or save to another directory")

    def _write_file(self, path: str, lay: "_FileLayout") -> list[Any]:
        """Write one laid-out data file under a temporary name, fsync it and rename it into place
        (the directory fsync that makes the name durable is write_data's, once for all files)."""
        small, data = list(lay.small), list(lay.data)
        for pos, t, size in lay.copies:
            if t.device.type not in ("cpu", "cuda"):
                t = t.cpu()
            n = t.numel() * t.element_size()
            if not t.is_contiguous() or t.storage_offset() != 0 or untyped_storage(t).nbytes() != n:
                t = t.clone(memory_format=torch.contiguous_format)
            arc = torchzip.build(t, "archive", alignment=_ALIGN, location="cpu")
            if arc.size != size:
                raise RuntimeError(f"gdsfs.dcp: the archive of an item of {lay.name!r} is {arc.size} bytes, "
                                   f"planned as {size}: a bug, please report it")
            data += arc.data_items(pos)
            small += arc.metadata_writes(pos)
        direct, direct_keys = lay.direct, lay.direct_keys
        last = [time.perf_counter()]

        def phase(name: str) -> None:
            now = time.perf_counter()
            self._timed(name, now - last[0], most=True)
            last[0] = now

        sync = bool(self.sync_files)
        with atomic.replace(path, sync=sync, sync_dir=False) as (tmp, fd):
            phase("create_s")
            if direct:
                if self._prealloc:
                    _preallocate(fd, lay.size)
                    phase("prealloc_s")
                self._wait_copies()  # the staging copies into the leases are done
                phase("copies_wait_s")
                with self._times_lock:  # when the save's first lease write began
                    self.save_times.setdefault("t_first_write", last[0])
                _write_leases(fd, direct, _STAGED_FLUSH_BYTES if sync else 0, self._direct_min)
                phase("lease_writes_s")
                if self._release_early:
                    # Tensors of this save not in leases are written through leases of their
                    # own: the written leases go back first so that those find room in the
                    # pool. Only then: a RELEASE waits for every WRITE of the session in flight
                    # (the other data files' too) and holds back new ones; otherwise
                    # write_data releases them all once every file is written.
                    self._release_leases([k for k, _, _, _ in direct_keys])
                    phase("release_s")
            if data:
                transfer(tmp, fd, data, write=True, strict=self._strict, sync=sync)
                phase("stock_writes_s")
            for off, b in small:
                torchzip.pwrite_all(fd, b, off)
            os.ftruncate(fd, lay.size)  # through the mount, last: sets the size the kernel caches
            phase("other_writes_s")
            self._timed("t_writes_done", last[0], most=True)  # when the last file's writes ended
        phase("commit_s")  # fsync, rename
        return lay.results

    def finish(self, metadata: Any, results: Any) -> None:
        """Commit ``.metadata`` the stock way, make the rename durable, then remove the data files
        the replaced ``.metadata`` named that the new one does not.

        Only files a readable old ``.metadata`` named, and files of this writer's own naming
        left by a crashed save, are ever removed, and never one the new results name: other
        files, and those of a ``.metadata`` this torch cannot read, stay.
        """
        t0 = time.perf_counter()
        root = os.fspath(self.path)
        collective = getattr(self, "use_collectives", True)
        old = _files_named_by(os.path.join(root, ".metadata")) if collective else set()
        super().finish(metadata, results)
        if self.sync_files:
            atomic.fsync_dir(root)
        self.save_times["finish_s"] = time.perf_counter() - t0
        new = {getattr(wr.storage_data, "relative_path", None) for rank in results for wr in rank}
        for name in self._written:
            if not os.path.exists(os.path.join(root, name)):
                raise _missing_error(root, name, "after .metadata was committed")
        self._written = []
        if not collective:
            return  # per-rank metadata: other ranks' files are not ours to judge
        orphans = {n for n in os.listdir(root) if _OWN_NAME.fullmatch(n)}
        for n in sorted((old | orphans) - new):
            try:
                os.unlink(os.path.join(root, n))
            except FileNotFoundError:
                pass

    # -- async staging -------------------------------------------------------------------------

    def stage(self, state_dict: Any) -> Any:
        """Snapshot ``state_dict`` for ``dcp.async_save``: tensors into daemon slabs, by a
        device-to-device (or host) copy, the stock way for what the slabs cannot take.

        Plain tensors, the local tensor of each DTensor and the local shards of each
        ShardedTensor are copied into leases of this writer's session (on the tensor's own
        GPU; host slabs for CPU tensors); the snapshot holds views of them, rewrapped as the
        same DTensor / ShardedTensor. The copies are queued on each GPU's current stream and
        not waited for here: kernels queued after them (the next training step) cannot change
        what they copy, and ``write_data`` waits for them before the daemon writes. Falls back
        per tensor, never for the whole dict: a tensor larger than one slab, one the pool has no
        room for (EAGAIN, never waited for), or of another kind is staged the stock way (host
        memory), with one GDSFallbackWarning per process saying how many bytes and how to size
        the pool (docs/operations.md). Off gdsfs, with ``staging="cpu"``, or for a storage
        format only the stock writer writes, the whole dict is staged the stock way.
        """

        t0 = time.perf_counter()
        try:
            return self._stage(state_dict)
        finally:
            t1 = time.perf_counter()
            self.save_times = {"stage_s": t1 - t0, "t_staged": t1}

    def _stage(self, state_dict: Any) -> Any:
        self.stage_stats = {"slab_tensors": 0, "slab_bytes": 0, "stock_tensors": 0, "stock_bytes": 0}
        if self._staging != "gdsfs" or self._stock_only():
            return super().stage(state_dict)
        root = os.fspath(self.path)
        from gdsfs._core import Session, find_mount

        probe = root if os.path.exists(root) else os.path.dirname(os.path.abspath(root))
        mount = find_mount(probe)
        if mount is None:
            return super().stage(state_dict)
        self._release_staged()
        for attempt in (0, 1):
            reasons: dict[str, int] = {}
            self.stage_stats = {"slab_tensors": 0, "slab_bytes": 0, "stock_tensors": 0, "stock_bytes": 0}
            try:
                idle = _IDLE.take(mount)
                sess = idle[0] if idle is not None else Session.open(probe, strict=self._strict)
                if sess is None:
                    return super().stage(state_dict)
                self._stage_session, self._stage_mount = sess, mount
                self._mover, self._slab, self._direct_min = idle[1:] if idle is not None else (None, None, None)
                out = self._stage_obj(sess, state_dict, reasons)
                break
            except (GDSUnavailableError, OSError) as e:
                self._discard_staged()
                if idle is not None and attempt == 0:
                    continue  # the kept session died with its daemon: once more, with a new one
                if self._strict:
                    raise
                warn_fallback(f"staging into daemon slabs failed ({e})", doing="staging the stock way, in host memory")
                return super().stage(state_dict)
        self._record_copies()
        st = self.stage_stats
        if st["stock_bytes"]:
            why = ", ".join(f"{n} {r}" for r, n in sorted(reasons.items()))
            if self._strict:
                self._discard_staged()
            warn_fallback(
                f"dcp.async_save staged {st['stock_tensors']} tensors ({_mib(st['stock_bytes'])}) the stock way, in host "
                f"memory, and {st['slab_tensors']} ({_mib(st['slab_bytes'])}) into daemon slabs ({why}); the training "
                f"step waits for the stock copies: mount with --gpu-pool (--host-pool for CPU tensors) of at least twice "
                f"the bytes each GPU saves (with the default --uid-share 50%) plus what loaders hold, and --slab-size of "
                f"at least the largest tensor shard (docs/operations.md, sizing the pool)",
                cause="dcp staging: stock staging of some tensors", doing="this save still completes",
                strict=self._strict)
        return out

    def _stage_obj(self, sess: Any, obj: Any, reasons: dict[str, int]) -> Any:
        if isinstance(obj, torch.Tensor):
            return self._stage_any_tensor(sess, obj, reasons)
        if isinstance(obj, dict):
            if type(obj) is dict:
                return {k: self._stage_obj(sess, v, reasons) for k, v in obj.items()}
            return type(obj)((k, self._stage_obj(sess, v, reasons)) for k, v in obj.items())
        if isinstance(obj, list):
            return [self._stage_obj(sess, v, reasons) for v in obj]
        if isinstance(obj, tuple) and not hasattr(obj, "_fields"):
            return tuple(self._stage_obj(sess, v, reasons) for v in obj)
        if _is_sharded_tensor(obj):
            return self._stage_sharded(sess, obj, reasons)
        return obj  # ints, strings, BytesIO, ...: as the stock stager, by reference

    def _stage_any_tensor(self, sess: Any, t: torch.Tensor, reasons: dict[str, int]) -> Any:
        if type(t) in (torch.Tensor, torch.nn.Parameter):
            staged = self._stage_tensor(sess, t, reasons)
            if staged is not None:
                return staged
            self._count_stock(t)
            return t.detach().to("cpu", copy=True) if t.device.type != "cpu" else t.detach().clone()
        if _is_dtensor(t):
            loc = t._local_tensor  # type: ignore[attr-defined]
            plain = type(loc) in (torch.Tensor, torch.nn.Parameter)
            staged = self._stage_tensor(sess, loc, reasons) if plain else None
            if staged is not None:
                return _rewrap_dtensor(t, staged)
            if not plain:
                reasons["tensors of another kind"] = reasons.get("tensors of another kind", 0) + 1
            self._count_stock(loc)
            return self._stock_one(t)
        if _is_sharded_tensor(t):
            return self._stage_sharded(sess, t, reasons)
        reasons["tensors of another kind"] = reasons.get("tensors of another kind", 0) + 1
        self._count_stock(t)
        return self._stock_one(t)

    def _stage_sharded(self, sess: Any, st: Any, reasons: dict[str, int]) -> Any:
        """A ShardedTensor: every local shard into a slab, or the whole tensor the stock way."""
        shards = list(st.local_shards())
        staged = []
        for sh in shards:
            plain = type(sh.tensor) in (torch.Tensor, torch.nn.Parameter)
            v = self._stage_tensor(sess, sh.tensor, reasons) if plain else None
            if v is None:
                break
            staged.append(v)
        if len(staged) == len(shards):
            return _rewrap_sharded(st, staged)
        # Give back the leases of the shards staged so far: this tensor is staged the stock way.
        done = {v.data_ptr() for v in staged}
        back = [self._staged.pop(p)[1] for p in done if p in self._staged]
        for v in staged:
            self.stage_stats["slab_tensors"] -= 1
            self.stage_stats["slab_bytes"] -= v.numel() * v.element_size()
        if back:
            self._stage_session.release(back)
        for sh in shards:
            self._count_stock(sh.tensor)
        return self._stock_one(st)

    def _count_stock(self, t: torch.Tensor) -> None:
        n = t.numel() * t.element_size()
        if n:
            self.stage_stats["stock_tensors"] += 1
            self.stage_stats["stock_bytes"] += n

    def _stock_one(self, v: Any) -> Any:
        """``v`` staged as the installed stock stager stages it (a DTensor or ShardedTensor with
        its local data copied to host memory)."""
        import importlib

        try:
            sdu = importlib.import_module("torch.distributed._state_dict_utils")
            _copy_state_dict, _create_cpu_state_dict = sdu._copy_state_dict, sdu._create_cpu_state_dict
        except (ImportError, AttributeError):
            return super().stage({"v": v})["v"]
        cpu = _create_cpu_state_dict({"v": v})
        if isinstance(cpu, tuple):  # some torch builds return (state dict, counts...)
            cpu = cpu[0]
        out = _copy_state_dict({"v": v}, cpu)
        return (out[0] if isinstance(out, tuple) else out)["v"]

    def _stage_tensor(self, sess: Any, t: torch.Tensor, reasons: dict[str, int]) -> torch.Tensor | None:
        """A lease-backed copy of ``t`` (same dtype, shape, device), or None (reason counted)."""
        from gdsfs._ckpt.tensorio import DaemonMover, direct_write_min, slab_bytes

        t = t.detach()
        n = t.numel() * t.element_size()
        if n == 0:
            return None  # nothing to copy: the stock way costs nothing
        if self._slab is None:
            self._slab = slab_bytes(sess)
            self._direct_min = direct_write_min(sess)
        why = None
        if t.device.type not in ("cpu", "cuda"):
            why = f"on {t.device.type}"
        elif n > self._slab:
            # A lease larger than one slab gets a slab allocated for it alone, which this process
            # would map anew (and keep mapped) at every save: stage such tensors the stock way.
            why = f"larger than a slab ({_mib(self._slab)}, --slab-size)"
        if why is None:
            mover = self._mover
            if mover is None:
                mover = self._mover = DaemonMover(sess)  # one per snapshot: it asks the daemon's status
            dev = mover.device_for(t)
            try:
                ref = sess.alloc(n, device=dev, timeout=0)  # never wait: a snapshot must be quick
            except GDSUnavailableError as e:
                if e.errno != errno.EAGAIN:
                    raise
                why = "the pool was full (EAGAIN)"
        if why is not None:
            reasons[why] = reasons.get(why, 0) + 1
            return None
        view = mover.lease_view(ref, n)
        src = t if t.is_contiguous() else t.contiguous()
        if view.device.type == "cuda" and src.device.type == "cuda":
            with torch.cuda.device(view.device):
                view.copy_(byte_view(src), non_blocking=True)  # on the current stream, not waited for
        else:
            view.copy_(byte_view(src))
        staged = view.view(t.dtype).view(t.shape) if t.dim() else view.view(t.dtype).reshape(())
        self._staged[staged.data_ptr()] = (sess, ref)
        self.stage_stats["slab_tensors"] += 1
        self.stage_stats["slab_bytes"] += n
        return staged

    def _record_copies(self) -> None:
        """An event after the staging copies on every GPU's current stream; write_data waits."""
        self._copies = []
        if not torch.cuda.is_available() or not torch.cuda.is_initialized():
            return
        devs = {int(ref.device) for _, ref in self._staged.values() if int(getattr(ref, "device", -1)) >= 0}
        for d in sorted(devs):
            ev = torch.cuda.Event()
            ev.record(torch.cuda.current_stream(d))
            self._copies.append(ev)

    def _wait_copies(self) -> None:
        for ev in getattr(self, "_copies", ()):
            ev.synchronize()
        self._copies = []

    def _release_leases(self, keys: list[int]) -> None:
        """Release the leases of the staged tensors at these data pointers (written already)."""
        with self._staged_lock:
            refs = [self._staged.pop(k)[1] for k in keys if k in self._staged]
        if refs and self._stage_session is not None:
            self._stage_session.release(refs)

    def _release_staged(self) -> None:
        # The snapshot has been written (or given up): release its leases explicitly, then close
        # the session. The staged views, if anyone still holds them, keep the session from ending
        # (gdsfs._leases.pin) but not their leases: a snapshot lives until the save writing it ends.
        self._wait_copies()  # no lease goes back while a copy into it may still run
        staged = [ref for _, ref in self._staged.values()]
        self._staged.clear()
        sess, self._stage_session = self._stage_session, None
        if sess is not None:
            if staged:
                sess.release(staged)
            # Kept for the next snapshot of this process (closing the session would drop the slab
            # mappings it used: the next snapshot would map them all again).
            if not _IDLE.keep(self._stage_mount, (sess, self._mover, self._slab, self._direct_min)):
                sess.close()
        self._mover = None

    def _discard_staged(self) -> None:
        """Drop a snapshot being staged whose session failed: close it, errors ignored."""
        self._copies = []
        self._staged.clear()
        sess, self._stage_session, self._mover = self._stage_session, None, None
        if sess is not None:
            try:
                sess.close()
            except (GDSUnavailableError, OSError):
                pass


class _IdleStaging:
    """The staging session of the last finished snapshot, per mount, kept for the next one.

    A snapshot maps the slabs its leases lie in; closing its session drops those mappings (so
    that memory the daemon frees does not stay mapped here), and the next snapshot, often of a
    new writer, would map every slab again: about 1 ms each, most of the time async_save blocks
    (GPU run 1: 47 ms for 1 GiB in 16 slabs). At most one session per mount is kept, holding no
    lease; :func:`close_staging` (and interpreter exit) closes them.
    """

    def __init__(self) -> None:
        import threading

        self._lock = threading.Lock()
        self._idle: dict[str, tuple[Any, Any, Any, Any]] = {}

    def take(self, mount: str) -> tuple[Any, Any, Any, Any] | None:
        with self._lock:
            got = self._idle.pop(mount, None)
        if got is not None and getattr(got[0], "closed", False):
            return None
        return got

    def keep(self, mount: str, entry: tuple[Any, Any, Any, Any]) -> bool:
        with self._lock:
            if not mount or mount in self._idle:
                return False
            self._idle[mount] = entry
            return True

    def after_fork(self) -> None:
        # A forked child (a DataLoader worker) neither reuses nor closes the parent's sessions,
        # and a lock another thread of the parent held must not stay held in it.
        import threading

        self._lock = threading.Lock()
        self._idle = {}

    def close(self) -> None:
        with self._lock:
            idle, self._idle = self._idle, {}
        for sess, *_ in idle.values():
            try:
                sess.close()
            except (GDSUnavailableError, OSError):
                pass


# The only process-wide state of gdsfs.dcp, like the client's slab mapping cache it serves.
_IDLE = _IdleStaging()
atexit.register(_IDLE.close)
if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_IDLE.after_fork)


def close_staging() -> None:
    """Close the staging sessions ``GDSFileSystemWriter.stage`` keeps between snapshots (one per
    mount, holding no lease), with their slab mappings in this process."""
    _IDLE.close()


def _write_leases(fd: int, direct: list[tuple[int, Any, Any, int]], flush_every: int,
                  direct_min: int | None = None) -> None:
    """The daemon writes each staged lease at its file offset, ``WRITE_THREADS`` at a time (the
    WRITE ioctl releases the GIL), starting the file's writeback every ``flush_every`` bytes of
    what it writes through the page cache: leases of ``direct_min`` bytes or more (at 4 KiB-aligned
    offsets, as staged leases are) it writes with O_DIRECT, which leaves nothing to start; the
    final fsync still makes the file durable."""
    import threading

    from gdsfs._ckpt.tensorio import WRITE_THREADS, _Flusher, written_direct

    cached = [n for off, _, _, n in direct if not written_direct(off, n, direct_min)]
    if sum(cached) < flush_every:
        flush_every = 0  # fewer bytes in the page cache than one flush's worth: the fsync will do
    flusher = _Flusher(fd, flush_every) if flush_every > 0 else None
    work = list(reversed(direct))
    lock = threading.Lock()
    errors: list[BaseException] = []

    def writer() -> None:
        try:
            while True:
                with lock:
                    if not work or errors:
                        return
                    off, sess, ref, n = work.pop()
                sess.write(fd, ref, off, n)
                if flusher is not None and not written_direct(off, n, direct_min):
                    flusher.wrote(n)
        except BaseException as e:  # handed to the caller below
            with lock:
                errors.append(e)

    try:
        threads = [threading.Thread(target=writer, daemon=True) for _ in range(min(WRITE_THREADS, len(direct)) - 1)]
        for th in threads:
            th.start()
        writer()
        for th in threads:
            th.join()
    finally:
        if flusher is not None:
            flusher.close()
    if errors:
        raise errors[0]
    if flusher is not None and flusher.error is not None:
        raise flusher.error


def _preallocate(fd: int, nbytes: int) -> None:
    """Allocate the data file's ``nbytes`` (its final size) before the daemon writes the leases
    (only where ``GDSFileSystemWriter._prealloc`` asks: see there). fallocate(2) itself, not
    posix_fallocate(3), whose fallback writes zeros; a refusal (EOPNOTSUPP, ENOSPC) is ignored:
    the writes report their own errors."""
    if nbytes <= 0 or not sys.platform.startswith("linux"):
        return
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        fallocate = libc.fallocate64 if hasattr(libc, "fallocate64") else libc.fallocate
        fallocate.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_int64, ctypes.c_int64]
        fallocate.restype = ctypes.c_int
        fallocate(fd, 0, 0, nbytes)
    except (OSError, AttributeError):
        pass


def _mib(n: int) -> str:
    return f"{n / (1 << 20):.1f} MiB"


def _is_dtensor(t: Any) -> bool:
    for mod in ("torch.distributed.tensor", "torch.distributed._tensor"):
        try:
            cls = getattr(__import__(mod, fromlist=["DTensor"]), "DTensor")
        except Exception:  # noqa: BLE001 - torch without (an importable) DTensor
            continue
        return isinstance(t, cls)
    return False


def _is_sharded_tensor(t: Any) -> bool:
    return type(t).__name__ == "ShardedTensor" and hasattr(t, "local_shards") and hasattr(t, "metadata")


def _rewrap_dtensor(d: Any, local: torch.Tensor) -> Any:
    """The DTensor ``d`` with ``local`` as its local tensor (same mesh, placements, shape)."""
    try:
        cls = type(d)
        return cls(local, d._spec, requires_grad=False)
    except TypeError:  # a DTensor whose constructor differs: the stock stager's way
        out = d.detach()
        out._local_tensor = local
        return out


def _rewrap_sharded(st: Any, tensors: list[torch.Tensor]) -> Any:
    """The ShardedTensor ``st`` with ``tensors`` as its local shards (same metadata)."""
    import copy

    from torch.distributed._shard.sharded_tensor import Shard, ShardedTensor

    shards = [Shard(tensor=t, metadata=copy.deepcopy(sh.metadata)) for t, sh in zip(tensors, st.local_shards())]
    return ShardedTensor._init_from_local_shards_and_global_metadata(
        shards, sharded_tensor_metadata=copy.deepcopy(st.metadata()), process_group=getattr(st, "_process_group", None))


def _result(wi: Any, name: str, offset: int, length: int) -> Any:
    from torch.distributed.checkpoint.storage import WriteResult

    return WriteResult(index=wi.index, size_in_bytes=length, storage_data=_fs._StorageInfo(name, offset, length))


class GDSFileSystemReader(FileSystemReader):
    """A FileSystemReader whose tensor bytes move through gdsfs (see the module doc).

    Takes every argument of the installed FileSystemReader, plus:

    Args:
        strict: raise GDSUnavailableError instead of falling back to the stock reader.
    """

    def __init__(self, path: str | os.PathLike, *args: Any, strict: bool = False, **kwargs: Any) -> None:
        super().__init__(path, *args, **kwargs)
        self._strict = strict
        # Where the last read_data's time went (seconds; scripts/gpu/dcp_check.py prints them):
        # plan_s decoding headers and planning reads (the READs of earlier files run meanwhile),
        # wait_s waiting for READs and copies to land, commit_s copying temporaries into
        # targets and committing; files, items.
        self.load_times: dict[str, float] = {}

    def read_data(self, plan: Any, planner: Any) -> Future:
        """Load the plan's items: pickles decoded here, tensor bytes read in flight across files."""
        root = os.fspath(self.path)
        infos = [self.storage_data[req.storage_index] for req in plan.items]
        if any(getattr(i, "transform_descriptors", None) for i in infos) or not on_gdsfs(root, strict=self._strict, cause=_OFF_MOUNT):
            return super().read_data(plan, planner)
        per_file: dict[str, list[Any]] = {}
        for req, info in zip(plan.items, infos):
            per_file.setdefault(info.relative_path, []).append(req)
        batch = _default_hooks(planner)
        reads = _Reads(self._strict, planner)  # one session for every file: its slab mappings are made once
        t0 = time.perf_counter()
        with contextlib.ExitStack() as files:  # open until the last read of the call has landed
            try:
                for rel, reqs in per_file.items():
                    reqs.sort(key=lambda r: self.storage_data[r.storage_index].offset)
                    path = os.path.join(root, rel)
                    fh = files.enter_context(open(path, "rb", buffering=_BUFFER))
                    self._read_file(path, fh, reqs, planner, batch, reads)
                reads.flush()
            finally:
                reads.close()  # before the files close: READs in flight name their descriptors
        total = time.perf_counter() - t0
        self.load_times = {"plan_s": total - reads.wait_s - reads.commit_s, "wait_s": reads.wait_s,
                           "commit_s": reads.commit_s, "files": len(per_file), "items": len(plan.items)}
        fut: Future = Future()
        fut.set_result(None)
        return fut

    def _read_file(self, path: str, fh: Any, reqs: list[Any], planner: Any, batch: bool, io_: "_Reads") -> None:
        """Plan one file's items and start their reads (``io_`` finishes them: its flush)."""
        fd = fh.fileno()
        items: list[tuple[int, torch.Tensor]] = []
        pending: list[tuple[Any, torch.Tensor, torch.Tensor | None]] = []
        temp = 0  # bytes of the temporaries of pending
        for req in reqs:
            info = self.storage_data[req.storage_index]
            if req.type == LoadItemType.BYTE_IO:
                planner.load_bytes(req, io.BytesIO(os.pread(fd, info.length, info.offset)))
                continue
            target = planner.resolve_tensor(req).detach()
            dev = target.device if target.device.type in ("cpu", "cuda") else torch.device("cpu")
            got = self._plan_read(fh, info, req, target, dev)
            if got is None:  # the archive needs torch.load: read it whole, then narrow
                fh.seek(info.offset)
                saved = torch.load(io.BytesIO(fh.read(info.length)), map_location="cpu", weights_only=True)
                target.copy_(_narrow(saved, req.storage_offsets, req.lengths))
                planner.commit_tensor(req, target)
                continue
            reads, src = got
            items.extend(reads)
            pending.append((req, target, src))
            if src is not None:
                temp += sum(t.numel() for _, t in reads)
            if not batch or io_.held + temp >= _BATCH_TEMP:
                io_.add(path, fd, items, pending, temp)  # flushes once the temporaries reach _BATCH_TEMP
                items, pending, temp = [], [], 0
                if not batch:  # the planner's hooks may need each commit before the next resolve
                    io_.flush()
        if items or pending:
            io_.add(path, fd, items, pending, temp)

    def _plan_read(self, fh: Any, info: Any, req: Any, target: torch.Tensor,
                   dev: torch.device) -> tuple[list[tuple[int, torch.Tensor]], torch.Tensor | None] | None:
        """The byte ranges to read for ``req`` and where they land.

        Returns ``(reads, src)``: ``reads`` are ``(file offset, uint8 destination)``; ``src`` is
        None when they land straight in ``target``, else the view (over a temporary the reads
        fill) to copy into ``target`` afterwards. Only the bytes of the saved chunk's storage
        that the request covers are read: for a request whose elements are one contiguous run
        of the storage (a row-slab of a row-major chunk, the chunk itself), that run straight
        into the target; otherwise the span from its first to its last element into a
        temporary, narrowed on the device. None: the archive must go through torch.load.
        """
        meta = torch.device("meta")
        try:
            dec = torchzip.decode(fh, info.offset, info.length, lambda _loc: meta, weights_only=True)
        except torchzip.NotAddressable:
            return None
        except Exception:  # noqa: BLE001 - a torch that cannot rebuild on meta: decode for real
            real = torchzip.decode(fh, info.offset, info.length, lambda _loc: dev, weights_only=True)
            if not isinstance(real.obj, torch.Tensor):
                raise ValueError(f"gdsfs: item {req.storage_index} of {fh.name!r} does not hold a tensor") from None
            return list(real.items), _narrow(real.obj, tuple(req.storage_offsets), tuple(req.lengths))
        saved = dec.obj
        if not isinstance(saved, torch.Tensor):
            raise ValueError(f"gdsfs: item {req.storage_index} of {fh.name!r} does not hold a tensor")
        offsets = tuple(req.storage_offsets) or (0,) * saved.dim()
        lengths = tuple(req.lengths) or tuple(saved.shape)
        if len(offsets) != saved.dim() or len(lengths) != saved.dim() or any(
                o < 0 or n < 0 or o + n > s for o, n, s in zip(offsets, lengths, saved.shape)):
            raise ValueError(f"gdsfs: {req.storage_index} asks for {lengths} at {offsets} of a saved chunk of size {tuple(saved.shape)}")
        if len(dec.items) != 1 or any(n == 0 for n in lengths):
            if len(dec.items) > 1:  # several storages: decode them for real, narrow afterwards
                real = torchzip.decode(fh, info.offset, info.length, lambda _loc: dev, weights_only=True)
                return list(real.items), _narrow(real.obj, offsets, lengths)
            # Nothing to read (an empty request or tensor): the target gets what narrowing gives.
            return [], torch.empty(lengths, dtype=saved.dtype, device=dev)
        base = dec.items[0][0]
        first, count, dense = span(saved.storage_offset(), saved.stride(), offsets, lengths)
        es = saved.element_size()
        if (
            dense
            and type(target) is torch.Tensor
            and target.device == dev
            and target.dtype == saved.dtype
            and target.is_contiguous()
            and tuple(target.shape) == lengths
            and not (target.is_conj() or target.is_neg() or saved.is_conj() or saved.is_neg())
        ):
            return [(base + first * es, byte_view(target))], None  # straight into the target
        temp = torch.empty((count,), dtype=saved.dtype, device=dev)
        src = temp.as_strided(lengths, saved.stride(), 0)
        if saved.is_conj():
            src = src.conj()
        if saved.is_neg():
            src = torch._neg_view(src)  # type: ignore[attr-defined]
        return [(base + first * es, byte_view(temp))], src


class _Reads:
    """Reads of one ``read_data`` call through one daemon session and one ReadPipeline: the READs
    of every file of the call in flight together, started as each file's items are planned (a
    session per file would map the slabs anew for every file of a resharded load: each session
    that closes drops the slab mappings no other open session of the process uses; a read_into
    per file would read the files one after the other, each from an empty pipeline).

    ``add`` starts the reads of some items of a file and keeps what to do once they land (copy a
    temporary into its target, commit); ``flush`` waits for them all and does it. Temporaries
    (of resharded reads that are not one run of the saved bytes) are flushed once they hold
    _BATCH_TEMP bytes. When the daemon cannot serve, what was added since the last flush and the
    rest of the call are read with plain I/O after the one-time GDSFallbackWarning
    (``strict=True`` raises instead); positional reads make the redo safe.
    """

    def __init__(self, strict: bool, planner: Any) -> None:
        self._strict = strict
        self._planner = planner
        self._mover: Any = None
        self._pipe: Any = None
        self._plain = False
        self._added: list[tuple[str, int, list[tuple[int, torch.Tensor]]]] = []  # since the last flush
        self._pending: list[tuple[Any, torch.Tensor, torch.Tensor | None]] = []
        self._held = 0  # bytes of temporaries the pending items hold
        self.wait_s = 0.0  # in flush, waiting for the reads to land
        self.commit_s = 0.0  # in flush, copying temporaries and committing

    @property
    def held(self) -> int:
        """Bytes of temporaries the items added since the last flush hold."""
        return self._held

    def add(self, path: str, fd: int, items: list[tuple[int, torch.Tensor]],
            pending: list[tuple[Any, torch.Tensor, torch.Tensor | None]], temp: int) -> None:
        """Start reading ``items`` of ``fd`` (``path``); ``pending`` (req, target, temporary's view
        or None) is done at the flush, ``temp`` is the bytes of their temporaries."""
        self._pending.extend(pending)
        self._held += temp
        if items:
            self._added.append((path, fd, items))
            self._daemon(lambda p: p.add(fd, items), path)
        if self._held >= _BATCH_TEMP:
            self.flush()

    def flush(self) -> None:
        """Finish every read added so far, then copy the temporaries and commit, in order."""
        t0 = time.perf_counter()
        if self._added:
            self._daemon(lambda p: p.drain(), self._added[-1][0])
        if self._plain:
            from gdsfs._ckpt.tensorio import PosixMover

            for _path, fd, items in self._added:
                PosixMover().read_into(fd, items)
        self._added = []
        t1 = time.perf_counter()
        pending, self._pending, self._held = self._pending, [], 0
        for req, target, src in pending:
            if src is not None:
                if src.size() != target.size():
                    raise ValueError(f"gdsfs: {req.storage_index} has size {tuple(src.size())}, the target {tuple(target.size())}")
                target.copy_(src)
            self._planner.commit_tensor(req, target)
        self.wait_s += t1 - t0
        self.commit_s += time.perf_counter() - t1

    def _daemon(self, step: Any, path: str) -> None:
        """Run ``step(pipeline)`` unless reads are plain; a daemon that cannot serve turns them plain
        (flush then reads with plain I/O everything added since the last flush)."""
        from gdsfs._ckpt.tensorio import DaemonMover, ReadPipeline, open_mover

        if self._plain:
            return
        if self._mover is None:
            self._mover = open_mover(path, strict=self._strict)
            if not isinstance(self._mover, DaemonMover):  # off gdsfs after all: plain reads
                self._plain = True
                return
            self._pipe = ReadPipeline(self._mover)
        try:
            step(self._pipe)
        except GDSUnavailableError as e:
            if self._strict:
                raise
            self.close()
            self._plain = True
            warn_fallback(f"the daemon could not serve {path!r} ({e})", cause=f"transfer errno {e.errno}")

    def close(self) -> None:
        from gdsfs._ckpt.tensorio import close_mover

        if self._pipe is not None:
            pipe, self._pipe = self._pipe, None
            pipe.close()
        if self._mover is not None:
            close_mover(self._mover)
            self._mover = None


def span(storage_offset: int, strides: tuple[int, ...] | Any, offsets: tuple[int, ...],
         lengths: tuple[int, ...]) -> tuple[int, int, bool]:
    """The elements of a storage a sub-box of a strided tensor covers.

    The box ``offsets``/``lengths`` of a tensor whose element ``i`` sits at storage element
    ``storage_offset + sum(i[d] * strides[d])`` (strides >= 0) touches storage elements from
    ``first`` to ``first + count - 1``. ``dense`` is True when those are exactly the box's
    elements in row-major order, so reading them is reading the box (a row-slab of a row-major
    tensor, or the tensor itself); then ``count`` is the box's element count.

    Returns:
        ``(first, count, dense)``; ``count`` is 0 for an empty box.
    """
    strides = tuple(int(x) for x in strides)
    if any(n == 0 for n in lengths):
        return storage_offset + sum(o * st for o, st in zip(offsets, strides)), 0, True
    first = storage_offset + sum(o * st for o, st in zip(offsets, strides))
    last = first + sum((n - 1) * st for n, st in zip(lengths, strides))
    count = last - first + 1
    numel = 1
    for n in lengths:
        numel *= n
    # Row-major: each dim of length > 1 steps by the product of the lengths after it.
    want = 1
    dense = True
    for n, st in zip(reversed(lengths), reversed(strides)):
        if n > 1 and st != want:
            dense = False
            break
        want *= n
    return first, count, dense and count == numel


def _narrow(t: torch.Tensor, offsets: Any, lengths: Any) -> torch.Tensor:
    """The chunk ``offsets``/``lengths`` of ``t`` (what DCP's narrow_tensor_by_index does)."""
    for dim, (off, n) in enumerate(zip(offsets, lengths)):
        if n < t.size(dim):
            t = t.narrow(dim, off, n)
    return t


def _default_hooks(planner: Any) -> bool:
    """True when resolve_tensor/commit_tensor are the default ones, so all targets may be resolved
    before any commit (as the stock parallel reader requires)."""
    try:
        from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
    except ImportError:
        return False
    return (
        type(planner).resolve_tensor is DefaultLoadPlanner.resolve_tensor
        and type(planner).commit_tensor is DefaultLoadPlanner.commit_tensor
    )
