"""Issue 15, a cold epoch's start: while torch starts a gdsfs.torch.DataLoader's workers, a thread
of the main process asks the kernel for the bytes each worker reads first (gdsfs._starthint), so
that the disk reads them during worker start-up (docs/benchmarks.md, "Cold start"). Asserted on
what was asked for against what the workers then delivered (the tar's own member offsets, read
with tarfile, are the oracle), never on time."""

from __future__ import annotations

import itertools
import os
import subprocess
import sys
import tarfile
import tempfile
import threading
from typing import Any

import pytest

import gdsfs._starthint as sh
import gdsfs.torch as gt

HERE = os.path.dirname(os.path.abspath(__file__))
PAGE = 4096
FLOATS = 4096  # 16 KiB of float32 per sample, plus its .npy header


def _shards(mount: Any, n: int, per_shard: int) -> tuple[list[str], list[str]]:
    """(mount paths, backing paths) of n tars of per_shard samples (x.npy, cls)."""
    import numpy as np

    from _wds_helpers import fresh_dir, npy, write_tar

    src, mnt = fresh_dir(mount, "starthint")
    rng = np.random.default_rng(1515)
    paths, backing = [], []
    for s in range(n):
        samples = [(f"s{s}_{i:04d}", {"cls": str(i).encode(), "x.npy": npy(rng.standard_normal(FLOATS).astype(np.float32))}) for i in range(per_shard)]
        write_tar(os.path.join(src, f"shard-{s}.tar"), samples)
        paths.append(os.path.join(mnt, f"shard-{s}.tar"))
        backing.append(os.path.join(src, f"shard-{s}.tar"))
    return paths, backing


def _drop(paths: list[str]) -> None:
    """These files' pages out of the page cache (this test's own files only)."""
    for p in paths:
        fd = os.open(p, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def _members(backing: list[str], mount_paths: list[str]) -> dict[str, list[tuple[str, int, int]]]:
    """key -> its members' (real mount path, offset, end), from the tar itself."""
    out: dict[str, list[tuple[str, int, int]]] = {}
    for b, m in zip(backing, mount_paths):
        with tarfile.open(b) as tf:
            for ti in tf:
                key = ti.name.split(".", 1)[0]
                out.setdefault(key, []).append((os.path.realpath(m), ti.offset_data, ti.offset_data + ti.size))
    return out


def _pages(ranges: list[tuple[str, int, int]]) -> set[tuple[str, int]]:
    return {(os.path.realpath(p), pg) for p, o, e in ranges for pg in range(o // PAGE, (e - 1) // PAGE + 1) if e > o}


def _delivered(dl: Any) -> dict[int, list[str]]:
    """Each slot's keys in the order its worker delivered them (one slot per batch)."""
    per: dict[int, list[str]] = {}
    seen: set[str] = set()
    for b in dl:
        (slot,) = b.progress.keys()
        for k in b["__key__"]:
            assert k not in seen, f"{k} delivered twice"
            seen.add(k)
        per.setdefault(slot, []).extend(b["__key__"])
    return per


def _hints(dl: Any) -> sh.StartHints:
    h = dl._start_hints
    assert h is not None, "no start hint ran"
    h.thread.join(timeout=60)
    assert not h.thread.is_alive(), "the start hint did not finish"
    return h


SAMPLE = 16384 + 128 + 1  # the fields' bytes of one sample: x.npy (header + data), cls


def _wait_for_hint(fd: int, _worker_id: int) -> None:
    """worker_init_fn: wait until the test says the start hint is done (a byte on fd), so that
    no worker's READ caches its first bytes before the hint looked at them (it would skip them:
    already cached)."""
    os.read(fd, 1)


class _AfterHint:
    """Lets the loader's workers go (one byte each on a pipe) once its start hint finished."""

    def __init__(self, workers: int) -> None:
        self.r, self.w = os.pipe()
        self.workers = workers
        self.thread: threading.Thread | None = None

    def init_fn(self) -> Any:
        import functools

        return functools.partial(_wait_for_hint, self.r)

    def watch(self, dl: Any) -> None:
        def go() -> None:
            while not hasattr(dl, "_start_hints"):
                threading.Event().wait(0.01)  # set by dl.__iter__ before torch starts the workers
            h = dl._start_hints
            if h is not None:
                h.thread.join()
            os.write(self.w, b"x" * self.workers)

        self.thread = threading.Thread(target=go, daemon=True)
        self.thread.start()

    def close(self) -> None:
        os.close(self.r)
        os.close(self.w)


@pytest.mark.parametrize("shuffle,resume", [(False, False), (True, False), (True, True), (False, True)])
@pytest.mark.parametrize("k,n,read_ahead_bytes", [
    (1, 6, 64 << 20),  # READs of one chunk of 4 samples (read_ahead=4): 6 samples hinted, the second READ cut
    (3, 14, 64 << 20),  # items of 3 batches of 4, read whole: READs of 12 samples
    (3, 7, 6 * FLOATS * 4),  # an item read in READs of 6 samples (read_ahead_bytes): the first fits
])
def test_hinted_bytes_are_each_workers_first_samples(gdsfs_mount, monkeypatch, shuffle: bool, resume: bool, k: int, n: int,
                                                     read_ahead_bytes: int) -> None:
    """Each worker's hinted pages are the pages of its first samples as it delivers them (the
    tar's own offsets): its first n samples and 100 bytes of the next one's members, the share
    of the hint a worker gets, which holds its first READ whole (a share that cuts the first READ
    asks for nothing): one batch per item, k batches per item (read whole, from the resume point
    on), and an item read in READs of read_ahead_bytes."""
    paths, backing = _shards(gdsfs_mount, 4, 24)
    members = _members(backing, paths)
    per_worker = n * SAMPLE + 100
    monkeypatch.setenv(sh.START_HINT_ENV, str(2 * per_worker))
    kw = dict(gpu_keys=["x.npy"], shuffle=shuffle, seed=7, strict=True, read_ahead=4, read_ahead_bytes=read_ahead_bytes)
    state = None
    if resume:
        ds0 = gt.GDSShardDataset(paths, **kw)
        dl0 = gt.DataLoader(ds0, batch_size=4, num_workers=2, batches_per_item=k)
        it = iter(dl0)
        for _ in range(5):  # 3 batches of one worker, 2 of the other (k=3: mid-item)
            next(it)
        state = dl0.state_dict()
        del it, dl0
        ds0.close()
    ds = gt.GDSShardDataset(paths, **kw)
    if state is not None:
        ds.load_state_dict(state)
    gate = _AfterHint(2)
    dl = gt.DataLoader(ds, batch_size=4, num_workers=2, batches_per_item=k, worker_init_fn=gate.init_fn())
    try:
        _drop(backing + paths)
        gate.watch(dl)
        per = _delivered(dl)
        h = _hints(dl)
    finally:
        ds.close()
        gate.close()
    assert sum(len(v) for v in per.values()) == 96 - (20 if resume else 0)
    assert len(h.ranges) == 2
    for w, got in enumerate(h.ranges):
        keys = per[w]
        assert {os.path.realpath(p) for p, _o, _e in got} <= {os.path.realpath(p) for p in paths}
        first = [r for key in keys[:n] for r in members[key]]
        left, part = 100, []  # the next sample's first 100 bytes of its members, in file order
        for p, o, e in sorted(members[keys[n]], key=lambda r: r[1]):
            part.append((p, o, o + min(left, e - o)))
            left -= min(left, e - o)
        want = _pages(first + part)
        assert _pages(got) == want, f"worker {w}: hinted pages are not its first samples' ({keys[:n + 1]})"


@pytest.mark.parametrize("share,k", [(4 * SAMPLE - 100, None), (4 * SAMPLE, None), (14 * SAMPLE, 3), (15 * SAMPLE - 1, 3)])
def test_a_first_chunk_larger_than_its_share_asks_for_nothing(gdsfs_mount, monkeypatch, share: int, k) -> None:
    """Large samples: a worker's first READ (its first chunk, none of which it yields before the
    whole chunk is read) is more than its share of the hint. Hinting a part of it only reorders
    the workers' first READs against the order the loop takes them (the GPU run of 12-02 05:48:
    4 MiB samples' first batch came 70-240 ms later): nothing is asked for, whether the share ends
    inside a sample or at a sample's end short of the chunk's. With k=3 batches of 5 per item the
    first READ is the item whole (15 samples), also where read_ahead=5 samples would fit."""
    paths, backing = _shards(gdsfs_mount, 4, 24)
    monkeypatch.setenv(sh.START_HINT_ENV, str(2 * share))
    # Nor is a shard opened for it (the GPU run of 12-02 07:35: with every worker's first chunk
    # over its share the first batch still came 50-150 ms later with the hint on, from its opens
    # on the cold disk while torch forked the workers).
    opened: list[str] = []
    real = sh._fds.open

    def counted(path: str, flags: int) -> int:
        opened.append(path)
        return real(path, flags)

    monkeypatch.setattr(sh._fds, "open", counted)
    ds = gt.GDSShardDataset(paths, gpu_keys=["x.npy"], strict=True, read_ahead=5)
    gate = _AfterHint(2)
    dl = gt.DataLoader(ds, batch_size=5, num_workers=2, batches_per_item=k, worker_init_fn=gate.init_fn())
    try:
        _drop(backing)
        gate.watch(dl)
        per = _delivered(dl)
        h = dl._start_hints  # None: told from the main process's indexes, no thread started
        if h is not None:
            h.thread.join(timeout=60)
    finally:
        ds.close()
        gate.close()
    assert sum(len(v) for v in per.values()) == 96
    assert h is None or h.ranges == [[], []], "a part of a worker's first chunk was hinted"
    assert opened == [], f"the hint opened {opened} for workers it gives no hint"


def test_a_hint_that_gives_nothing_costs_nothing(gdsfs_mount, monkeypatch) -> None:
    """More shards than the main process keeps open (8: its _open cache after construction
    holds the last ones), each worker's first chunk over its share: the hint gives no worker
    anything, so it must open no shard, ask the daemon for no INDEX and read no stats (the GPU
    run of 12-02 13:45, 4 MiB samples in 16 shards: workers 0-3 start on shards the main process
    had closed, the hint opened and indexed them while torch forked, the first batch came
    ~100 ms later with the hint on than off)."""
    paths, backing = _shards(gdsfs_mount, 16, 4)  # workers start on shards 0, 4, 8, 12
    monkeypatch.setenv(sh.START_HINT_ENV, str(4 * (4 * SAMPLE - 100)))
    calls: list[str] = []
    real_open, real_room, real_index = sh._fds.open, sh._budget_leaves_room, sh._core._paged_index

    def opened(path: str, flags: int) -> int:
        calls.append(f"open {os.path.basename(path)}")
        return real_open(path, flags)

    def room(mount: str) -> bool:
        calls.append("stats")
        return real_room(mount)

    def index(fd: int, **kw: Any) -> Any:
        if threading.current_thread().name == "gdsfs-start-hint":
            calls.append("INDEX")
        return real_index(fd, **kw)

    monkeypatch.setattr(sh._fds, "open", opened)
    monkeypatch.setattr(sh, "_budget_leaves_room", room)
    monkeypatch.setattr(sh._core, "_paged_index", index)
    ds = gt.GDSShardDataset(paths, gpu_keys=["x.npy"], strict=True, read_ahead=4)
    assert not {4, 8} & set(ds._open), "the main process keeps the shards the workers start on open"
    dl = gt.DataLoader(ds, batch_size=4, num_workers=4)
    try:
        _drop(backing)
        per = _delivered(dl)
        h = dl._start_hints
        if h is not None:
            h.thread.join(timeout=60)
    finally:
        ds.close()
    assert sum(len(v) for v in per.values()) == 64
    assert h is None or h.ranges == [[]] * 4, "a part of a worker's first chunk was hinted"
    assert calls == [], f"the hint gave no worker anything, yet made {calls}"


def test_warm_start_asks_for_nothing(gdsfs_mount, monkeypatch) -> None:
    monkeypatch.delenv(sh.START_HINT_ENV, raising=False)
    paths, _backing = _shards(gdsfs_mount, 2, 16)
    ds = gt.GDSShardDataset(paths, gpu_keys=["x.npy"], strict=True)
    dl = gt.DataLoader(ds, batch_size=4, num_workers=2)
    try:
        for path in paths:  # cached (as the mount serves them: passthrough's backing pages or its own)
            with open(path, "rb") as f:
                while f.read(1 << 20):
                    pass
        assert sum(len(v) for v in _delivered(dl).values()) == 32
        h = _hints(dl)
    finally:
        ds.close()
    assert h.ranges == [[], []]


def test_off_and_persistent_workers(gdsfs_mount, monkeypatch) -> None:
    paths, _backing = _shards(gdsfs_mount, 2, 8)
    monkeypatch.setenv(sh.START_HINT_ENV, "0")
    ds = gt.GDSShardDataset(paths, gpu_keys=["x.npy"], strict=True)
    try:
        dl = gt.DataLoader(ds, batch_size=4, num_workers=2)
        assert sum(len(v) for v in _delivered(dl).values()) == 16
        assert dl._start_hints is None
        monkeypatch.delenv(sh.START_HINT_ENV)
        dl = gt.DataLoader(ds, batch_size=4, num_workers=2, persistent_workers=True)
        _delivered(dl)
        first = _hints(dl)
        _delivered(dl)  # the workers are running: no start to overlap
        assert dl._start_hints is first or dl._start_hints is None
    finally:
        ds.close()


def test_a_stuck_hint_never_holds_the_loop(gdsfs_mount, monkeypatch) -> None:
    # The hint thread stuck where a slow daemon would hold it (its open of a shard): the loop
    # still gets every sample, and the next iteration starts no second hint.
    paths, backing = _shards(gdsfs_mount, 2, 16)
    release, entered = threading.Event(), threading.Event()
    real = sh._fds.open

    def stuck(path: str, flags: int) -> int:
        entered.set()
        release.wait()
        return real(path, flags)

    monkeypatch.setattr(sh._fds, "open", stuck)
    monkeypatch.delenv(sh.START_HINT_ENV, raising=False)
    ds = gt.GDSShardDataset(paths, gpu_keys=["x.npy"], strict=True)
    dl = gt.DataLoader(ds, batch_size=4, num_workers=2)
    h = None
    try:
        _drop(backing + paths)
        assert sum(len(v) for v in _delivered(dl).values()) == 32
        h = dl._start_hints
        assert h is not None
        assert entered.wait(60) and h.thread.is_alive()
        assert sum(len(v) for v in _delivered(dl).values()) == 32
        # The first one still runs: none was started beside it.
        assert dl._start_hints is h
        assert sum(t.name == "gdsfs-start-hint" for t in threading.enumerate()) == 1
    finally:
        release.set()
        if h is not None:
            h.thread.join(timeout=60)
        ds.close()
    assert h is not None and not h.thread.is_alive()


def _fds() -> set[str]:
    return set(os.listdir("/proc/self/fd"))


def test_fifo_in_place_of_a_shard(gdsfs_mount, monkeypatch) -> None:
    # Shard 1 replaced by a FIFO after the dataset was built: the hint of worker 1 (whose
    # first shard it is) opens it without blocking, advises nothing, and keeps no descriptor.
    paths, backing = _shards(gdsfs_mount, 2, 16)
    monkeypatch.delenv(sh.START_HINT_ENV, raising=False)
    ds = gt.GDSShardDataset(paths, gpu_keys=["x.npy"], strict=True)
    try:
        _drop(backing + paths)
        fifo = backing[1] + ".fifo"
        os.mkfifo(fifo)
        os.rename(fifo, backing[1])
        before = _fds()
        ds._main_iteration_starting(4)
        h = sh.start(ds, 2, None)
        assert h is not None
        h.thread.join(timeout=60)
        assert not h.thread.is_alive(), "the hint blocked on a FIFO"
        assert _fds() == before
    finally:
        ds.close()
    assert [p for p, _o, _e in h.ranges[0]] and all(os.path.realpath(p) == os.path.realpath(paths[0]) for p, _o, _e in h.ranges[0])
    assert h.ranges[1] == []


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to run as another uid")
def test_a_shard_the_user_cannot_open(gdsfs_bin) -> None:
    # uid 10001's own shards, one made unreadable after the dataset was built: nothing of it
    # is asked for, and the hint keeps no descriptor.
    from conftest import mount, unmount

    base = tempfile.mkdtemp(prefix="gdsfs-starthint-", dir="/tmp")
    src, mnt = os.path.join(base, "src"), os.path.join(base, "mnt")
    os.chmod(base, 0o755)
    os.mkdir(src, 0o755)
    os.mkdir(mnt)
    os.mkdir(os.path.join(src, "u"), 0o755)
    os.chown(os.path.join(src, "u"), 10001, 10001)
    m = mount(gdsfs_bin, src, mnt, os.path.join(base, "daemon.log"), "--allow-other")
    try:
        code = f"""
import io, os, tarfile
import numpy as np
import gdsfs._starthint as sh, gdsfs.torch as gt
d = {os.path.join(mnt, 'u')!r}
paths = []
for s in range(2):
    p = os.path.join(d, f"shard-{{s}}.tar")
    with tarfile.open(p, "w") as tf:
        for i in range(16):
            b = io.BytesIO(); np.save(b, np.ones(4096, np.float32))
            for ext, data in (("cls", b"1"), ("x.npy", b.getvalue())):
                ti = tarfile.TarInfo(f"s{{s}}_{{i:03d}}.{{ext}}"); ti.size = len(data); tf.addfile(ti, io.BytesIO(data))
    paths.append(p)
ds = gt.GDSShardDataset(paths, gpu_keys=["x.npy"], strict=True)
for p in paths:
    fd = os.open(p, os.O_RDONLY); os.fsync(fd); os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED); os.close(fd)
    fd = os.open(p.replace({mnt!r}, {src!r}, 1), os.O_RDONLY); os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED); os.close(fd)
os.chmod(paths[1], 0)
before = set(os.listdir("/proc/self/fd"))
ds._main_iteration_starting(4)
h = sh.start(ds, 2, None)
h.thread.join(60)
assert not h.thread.is_alive()
assert set(os.listdir("/proc/self/fd")) == before, "descriptor kept"
assert h.ranges[0] and {{p for p, _o, _e in h.ranges[0]}} == {{paths[0]}}, h.ranges
assert h.ranges[1] == [], h.ranges
ds.close()
print("ok")
"""
        env = dict(os.environ, PYTHONPATH=os.path.dirname(HERE), PYTHONWARNINGS="ignore")
        env.pop(sh.START_HINT_ENV, None)
        r = subprocess.run(["setpriv", "--reuid=10001", "--regid=10001", "--clear-groups", sys.executable, "-c", code],
                           capture_output=True, text=True, timeout=120, env=env)
        assert r.returncode == 0 and r.stdout.strip() == "ok", r.stdout + r.stderr
    finally:
        unmount(gdsfs_bin, m.mnt)
        subprocess.run(["rm", "-rf", base], check=False)


def test_start_hint_env_values(monkeypatch) -> None:
    for value, want in ((None, sh.START_HINT), ("", sh.START_HINT), ("4M", sh.START_HINT), ("-1", 0), ("0", 0), ("65536", 65536)):
        if value is None:
            monkeypatch.delenv(sh.START_HINT_ENV, raising=False)
        else:
            monkeypatch.setenv(sh.START_HINT_ENV, value)
        assert sh.start_hint_bytes() == want


@pytest.mark.parametrize("batched,want", [
    (4, [0, 0, 1, 1, 2, 2]),  # 12 samples a worker: 3 chunks of 4 (read_ahead)
    (12, [0, 0]),  # items of 12 samples (3 batches of 4), read whole: one READ a worker
    (6, [0, 0, 1, 1]),  # items of 6 (read_ahead 4: a chunk is one item)
])
def test_chunks_go_out_in_the_order_the_loop_takes_them(gdsfs_mount, monkeypatch, batched: int, want: list[int]) -> None:
    # torch takes the workers' items in turn and a worker yields nothing of a chunk (whole items,
    # one READ) before it is read: worker 0's chunk 0, worker 1's, then their chunk 1...
    paths, backing = _shards(gdsfs_mount, 2, 16)
    monkeypatch.setenv(sh.START_HINT_ENV, str(2 * (12 * SAMPLE + 2)))  # 12 samples a worker (the .cls of 10 and 11: 2 bytes)
    ds = gt.GDSShardDataset(paths, gpu_keys=["x.npy"], read_ahead=4, strict=True)
    calls: list[tuple[str, int]] = []
    real = sh.StartHints._advise

    def advise(self: Any, rs: list[Any]) -> None:
        calls.append((os.path.basename(ds.shards[rs[0][0]]), rs[0][3]))
        real(self, rs)

    monkeypatch.setattr(sh.StartHints, "_advise", advise)
    try:
        _drop(backing + paths)
        ds._main_iteration_starting(4)
        h = sh.start(ds, 2, None, batched)
        assert h is not None
        h.thread.join(timeout=60)
    finally:
        ds.close()
    assert calls == [(f"shard-{w}.tar", c) for c, w in zip(want, itertools.cycle((0, 1)))]


def test_fork_warning_is_hidden_only_while_the_hint_runs(gdsfs_mount, monkeypatch) -> None:
    # Python 3.12 warns (DeprecationWarning) at a fork while other threads run; a program that
    # turns warnings into errors must still start its workers while the hint's thread runs.
    import warnings

    msg = "This process (pid=1234) is multi-threaded, use of fork() may lead to deadlocks in the child."
    paths, _backing = _shards(gdsfs_mount, 2, 8)
    release = threading.Event()
    real = sh.StartHints._state

    def stuck(self: Any, shard: int) -> Any:
        release.wait()
        return real(self, shard)

    monkeypatch.setattr(sh.StartHints, "_state", stuck)
    monkeypatch.delenv(sh.START_HINT_ENV, raising=False)
    ds = gt.GDSShardDataset(paths, gpu_keys=["x.npy"], strict=True)
    try:
        ds._main_iteration_starting(4)
        h = sh.start(ds, 2, None)
        assert h is not None and h.thread.is_alive()
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            with sh.forking(h):
                warnings.warn(msg, DeprecationWarning)  # hidden: the hint runs
            release.set()
            h.thread.join(timeout=60)
            with pytest.raises(DeprecationWarning):
                with sh.forking(h):
                    warnings.warn(msg, DeprecationWarning)  # shown: it is done
            with pytest.raises(DeprecationWarning):
                with sh.forking(None):
                    warnings.warn(msg, DeprecationWarning)
    finally:
        release.set()
        ds.close()


def test_a_fork_right_after_the_hints_open_leaves_the_child_no_descriptor(gdsfs_mount, monkeypatch) -> None:
    # torch forks a worker just as the hint thread's open of a shard returned, before the
    # thread registered the descriptor for the at-fork hook to close: the worker must not get
    # it (it would hold the shard, and two of the daemon's descriptors, for its whole life).
    paths, backing = _shards(gdsfs_mount, 2, 16)
    monkeypatch.delenv(sh.START_HINT_ENV, raising=False)
    real_open = os.open
    opened, forked = threading.Event(), threading.Event()
    got: list[int] = []
    forker: list[int] = []

    def in_before_fork() -> bool:
        frame = sys._current_frames().get(forker[0]) if forker else None
        while frame is not None:
            if frame.f_code.co_name == "before_fork" and frame.f_code.co_filename == sh.__file__:
                return True
            frame = frame.f_back
        return False

    def hint_open(path: Any, flags: int, *a: Any, **kw: Any) -> int:
        fd = real_open(path, flags, *a, **kw)
        if threading.current_thread().name == "gdsfs-start-hint" and not got:
            got.append(fd)
            opened.set()
            # The fork comes now: the open returned, the thread has not gone on yet.
            pause = threading.Event()
            for _ in range(6000):
                if forked.is_set() or in_before_fork():
                    break
                pause.wait(0.01)
        return fd

    child_saw: list[int] = []

    def fork() -> None:
        forker.append(threading.get_ident())
        pid = os.fork()
        if pid == 0:
            try:
                os.fstat(got[0])
                os._exit(1)  # the hint's descriptor is open in the child
            except OSError:
                os._exit(0)
        forked.set()
        child_saw.append(os.waitpid(pid, 0)[1])

    monkeypatch.setattr(os, "open", hint_open)
    ds = gt.GDSShardDataset(paths, gpu_keys=["x.npy"], strict=True)
    try:
        _drop(backing + paths)
        ds._main_iteration_starting(4)
        h = sh.start(ds, 2, None)
        assert h is not None
        assert opened.wait(60)
        t = threading.Thread(target=fork)
        t.start()
        t.join(timeout=60)
        h.thread.join(timeout=60)
        assert not t.is_alive() and not h.thread.is_alive()
    finally:
        monkeypatch.setattr(os, "open", real_open)
        ds.close()
    assert child_saw == [0], "the forked child kept the start hint's descriptor of a shard"


@pytest.fixture()
def budget_mount(gdsfs_bin, tmp_path):
    """A mount whose per-uid budget of the daemon's descriptors is 40 (--max-open-per-user)."""
    import conftest

    src, mnt = tmp_path / "src", tmp_path / "mnt"
    src.mkdir()
    mnt.mkdir()
    m = conftest.mount(gdsfs_bin, str(src), str(mnt), str(tmp_path / "daemon.log"), "--max-open-per-user", "40")
    try:
        yield m
    finally:
        conftest.unmount(gdsfs_bin, m.mnt)


def _my_opens(mount: Any) -> tuple[int, int]:
    of = mount.stats()["open_files"]
    return sum(u["open"] for u in of.get("uids") or () if u["uid"] == os.getuid()), of["per_uid"]


def test_near_the_open_files_budget_the_hint_takes_no_descriptor_the_workers_need(budget_mount, monkeypatch) -> None:
    # This uid holds all but 2 of its 40 descriptors; the hint thread is held (a slow daemon, a
    # loaded machine) while the loader's workers open their shards: the two opens that fit must
    # succeed, so the hint holds none of them.
    paths, backing = _shards(budget_mount, 2, 16)
    monkeypatch.delenv(sh.START_HINT_ENV, raising=False)
    release, advising = threading.Event(), threading.Event()
    real = sh.StartHints._advise

    def held(self: Any, rs: Any) -> None:
        advising.set()
        release.wait(60)
        real(self, rs)

    monkeypatch.setattr(sh.StartHints, "_advise", held)
    ds = gt.GDSShardDataset(paths, gpu_keys=["x.npy"], strict=True)
    fillers: list[int] = []
    h = None
    try:
        _drop(backing + paths)
        mine, per = _my_opens(budget_mount)
        while mine < per - 2:
            fillers.append(os.open(paths[len(fillers) % 2], os.O_RDONLY))
            mine += 1
        assert _my_opens(budget_mount)[0] == per - 2
        ds._main_iteration_starting(4)
        h = sh.start(ds, 2, None)
        assert h is not None
        for _ in range(6000):  # the hint is advising (holding its descriptors) or done
            if advising.is_set() or not h.thread.is_alive():
                break
            threading.Event().wait(0.01)
        worker_fds = [os.open(p, os.O_RDONLY) for p in paths]  # what a worker opens: EMFILE if the hint took them
        for fd in worker_fds:
            os.close(fd)
    finally:
        release.set()
        if h is not None:
            h.thread.join(timeout=60)
        for fd in fillers:
            os.close(fd)
        ds.close()


def test_a_fork_waits_for_the_hints_open_again_once_a_stuck_one_returned() -> None:
    # A hint's open or close held the lock past FORK_WAIT (a slow daemon): that fork went on
    # without it, and later forks do not wait while it is stuck; once it returned, they wait for
    # the lock again (it protects the next open's window).
    fds = sh._HintFds()
    r, w = os.pipe()
    inside, go = threading.Event(), threading.Event()
    real_close = os.close

    def slow_close() -> None:
        fds.fds.add(r)
        os.close = lambda fd: (inside.set(), go.wait(60), real_close(fd))[-1]  # type: ignore[assignment]
        try:
            fds.close(r)
        finally:
            os.close = real_close  # type: ignore[assignment]

    t = threading.Thread(target=slow_close)
    t.start()
    try:
        assert inside.wait(60)
        fds.before_fork()
        assert fds.held == {threading.get_ident(): False} and fds.stuck
        fds.after_fork_in_parent()
    finally:
        go.set()
        t.join(timeout=60)
        real_close(w)
    assert not fds.stuck and r not in fds.fds
    fds.before_fork()
    try:
        assert fds.held == {threading.get_ident(): True}, "a fork after the stuck close returned no longer waits for the lock"
    finally:
        fds.after_fork_in_parent()
    assert not fds.lock.locked()


def test_a_hint_stuck_inside_its_open_never_holds_the_workers_fork(gdsfs_mount, monkeypatch) -> None:
    # The hint thread inside a shard's open (a slow daemon), holding the lock forks take: torch
    # still forks the workers (each fork waits at most FORK_WAIT, then none waits while it is
    # stuck) and the loop gets every sample, twice.
    paths, backing = _shards(gdsfs_mount, 2, 16)
    monkeypatch.delenv(sh.START_HINT_ENV, raising=False)
    real_open = os.open
    release, entered = threading.Event(), threading.Event()

    def stuck_open(path: Any, flags: int, *a: Any, **kw: Any) -> int:
        if threading.current_thread().name == "gdsfs-start-hint":
            entered.set()
            release.wait(120)
        return real_open(path, flags, *a, **kw)

    real_forking = sh.forking

    def forking_once_stuck(hints: Any) -> Any:
        assert entered.wait(60), "the hint never reached its open"
        return real_forking(hints)

    ds = gt.GDSShardDataset(paths, gpu_keys=["x.npy"], strict=True)
    dl = gt.DataLoader(ds, batch_size=4, num_workers=2, timeout=60)
    monkeypatch.setattr(os, "open", stuck_open)
    monkeypatch.setattr(sh, "forking", forking_once_stuck)
    h = None
    try:
        _drop(backing + paths)
        it = iter(dl)
        first = next(it)  # torch forked both workers
        h = dl._start_hints
        assert h is not None and h.thread.is_alive()
        assert len(first["__key__"]) + sum(len(b["__key__"]) for b in it) == 32
        assert sum(len(b["__key__"]) for b in dl) == 32
    finally:
        release.set()
        monkeypatch.setattr(sh, "forking", real_forking)
        monkeypatch.setattr(os, "open", real_open)
        if h is not None:
            h.thread.join(timeout=60)
        ds.close()


@pytest.mark.parametrize("of,room", [
    ({}, True),  # a daemon that does not say
    ({"limit": 20000, "reserve": 2500, "per_uid": 40, "open": 9, "uids": [{"uid": 7, "open": 9}]}, True),
    ({"limit": 20000, "reserve": 2500, "per_uid": 40, "open": 19, "uids": [{"uid": 7, "open": 19}]}, False),  # this uid near its budget
    ({"limit": 20000, "reserve": 2500, "per_uid": 40, "open": 19, "uids": [{"uid": 8, "open": 19}]}, True),  # another uid's opens
    ({"limit": 20000, "reserve": 2500, "per_uid": 4375, "open": 8749, "uids": []}, False),  # every user together near ENFILE
    ({"limit": 20000, "reserve": 2500, "per_uid": 4375, "open": 8748, "uids": []}, True),
])
def test_the_hint_opens_only_with_room_in_both_budgets(of: dict[str, Any], room: bool) -> None:
    assert sh._room(of, 7) is room
