"""Shared pytest fixtures: a gdsfs mount in host mode, torn down at exit.

The binary is $GDSFS_BIN (set by the Makefile) or ../../bin/gdsfs. Tests that
need a live daemon take the `gdsfs_mount` fixture; everything else runs
without one. The mount is made once per test session over a temp backing
directory and unmounted at teardown, also when tests fail.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from typing import Any, Iterator

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))  # the gdsfs package under python/


def _bin() -> str:
    return os.environ.get("GDSFS_BIN") or os.path.abspath(os.path.join(HERE, "..", "..", "bin", "gdsfs"))


@dataclass
class Mount:
    """A live gdsfs mount: files written under src appear under mnt."""

    bin: str
    src: str
    mnt: str
    log: str

    def path(self, *rel: str) -> str:
        return os.path.join(self.mnt, *rel)

    def stats(self) -> dict[str, Any]:
        """The daemon's status (root xattr user.gdsfs.stats)."""
        return json.loads(os.getxattr(self.mnt, "user.gdsfs.stats"))

    def wait_leases(self, want: int = 0, timeout_s: float = 10.0) -> int:
        """Poll until the daemon holds `want` leases (sessions end when the
        kernel's FUSE RELEASE arrives, shortly after the last close)."""
        deadline = time.monotonic() + timeout_s
        while True:
            n = int(self.stats()["leases"])
            if n == want or time.monotonic() > deadline:
                return n
            time.sleep(0.05)


def _engine_flag(binary: str) -> list[str]:
    out = subprocess.run([binary, "mount", "--help"], capture_output=True, text=True, timeout=30).stdout
    return ["--engine", "host"] if "--engine" in out else []


def _mounted(mnt: str) -> bool:
    """Whether mnt is a mount point in this mount namespace. /proc/self/mountinfo, not
    os.path.ismount: a mount whose daemon died answers lstat with ENOTCONN, which ismount
    takes for "not a mount", and the dead mount would be left behind."""
    target = os.path.realpath(mnt)
    try:
        with open("/proc/self/mountinfo") as f:
            # Field 5 is the mount point, with spaces and the like written as octal escapes.
            return any(line.split()[4].encode().decode("unicode_escape") == target for line in f)
    except OSError:
        return os.path.ismount(mnt)


def unmount(binary: str, mnt: str) -> None:
    """Unmount, falling back to fusermount3 -u and umount -l (also a mount whose daemon died)."""
    for cmd in ([binary, "unmount", mnt], ["fusermount3", "-u", mnt], ["umount", "-l", mnt]):
        if not _mounted(mnt):
            return
        try:
            subprocess.run(cmd, capture_output=True, timeout=30)
        except (OSError, subprocess.TimeoutExpired):
            continue


def mount(binary: str, src: str, mnt: str, log: str, *extra: str) -> Mount:
    """Mount src at mnt in host mode in the background; raise with the log on failure."""
    cmd = [binary, "mount", "--source", src, *_engine_flag(binary), "--background", "--log-file", log, *extra, mnt]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    if r.returncode != 0 or not os.path.ismount(mnt):
        unmount(binary, mnt)
        logtext = open(log).read()[-4000:] if os.path.exists(log) else ""
        raise RuntimeError(f"gdsfs mount failed (rc {r.returncode}): {r.stderr.strip()}\n{logtext}")
    return Mount(binary, src, mnt, log)


_DAEMON_FIXTURES = {"gdsfs_bin", "gdsfs_mount", "datasets"}


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "daemon: needs the gdsfs binary and a live mount (deselect with -m 'not daemon')")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    # Tests that use a live mount are marked, so that the daemon-free checks
    # run on their own with: pytest -m "not daemon" python/tests
    for item in items:
        if _DAEMON_FIXTURES & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.daemon)


@pytest.fixture(scope="session")
def gdsfs_bin() -> str:
    b = _bin()
    if not os.access(b, os.X_OK):
        pytest.skip(f"no gdsfs binary at {b}: run `make build` (or set GDSFS_BIN)")
    # Root mounts through /dev/fuse itself; other users need the setuid
    # fusermount3 (the GPU machine has /dev/fuse but no fuse3 package).
    if not os.path.exists("/dev/fuse") or (os.geteuid() != 0 and shutil.which("fusermount3") is None):
        pytest.skip("no /dev/fuse (or, not as root, no fusermount3) on this machine")
    return b


@pytest.fixture(scope="session")
def gdsfs_mount(tmp_path_factory: pytest.TempPathFactory, gdsfs_bin: str) -> Iterator[Mount]:
    """A host-mode gdsfs mount over an empty temp backing directory."""
    base = tmp_path_factory.mktemp("gdsfs")
    src, mnt = base / "src", base / "mnt"
    src.mkdir()
    mnt.mkdir()
    m = mount(gdsfs_bin, str(src), str(mnt), str(base / "daemon.log"))
    try:
        try:
            os.getxattr(m.mnt, "user.gdsfs.stats")
        except OSError as e:
            raise RuntimeError(f"the gdsfs mount at {m.mnt} serves no control path ({e}); daemon log:\n{open(m.log).read()[-4000:]}") from e
        yield m
    finally:
        unmount(gdsfs_bin, m.mnt)


# ----------------------------------------------------------------------------
# Test datasets written with the standard library and numpy, and their ground
# truth (what a plain reader must see), independent of gdsfs's own parsers.


def _npy_bytes(arr: Any) -> bytes:
    import io

    import numpy as np

    b = io.BytesIO()
    np.save(b, arr)
    return b.getvalue()


def write_wds(d: str, nshards: int, per_shard: int, seed: int = 0, *, x_shape: tuple[int, ...] = (3, 8)) -> dict[str, dict[str, Any]]:
    """WebDataset tars train-NNN.tar: image bytes (.jpg), float32 .npy
    (x.npy), Fortran-order int64 .npy (y.npy), label (.cls)."""
    import io
    import tarfile

    import numpy as np

    rng = np.random.default_rng(seed)
    truth: dict[str, dict[str, Any]] = {}
    os.makedirs(d, exist_ok=True)
    for s in range(nshards):
        with tarfile.open(os.path.join(d, f"train-{s:03d}.tar"), "w") as tf:
            for i in range(per_shard):
                key = f"s{s:03d}/{i:05d}"
                img = rng.bytes(int(rng.integers(200, 5000)))
                x = rng.standard_normal(x_shape).astype(np.float32)
                y = np.asfortranarray(rng.integers(-1000, 1000, (2, 3)).astype(np.int64))
                label = int(rng.integers(0, 10))
                fields = {"cls": str(label).encode(), "jpg": img, "x.npy": _npy_bytes(x), "y.npy": _npy_bytes(y)}
                for ext in sorted(fields):
                    ti = tarfile.TarInfo(f"{key}.{ext}")
                    ti.size = len(fields[ext])
                    ti.mode = 0o444
                    tf.addfile(ti, io.BytesIO(fields[ext]))
                truth[key] = {"cls": label, "jpg": img, "x.npy": x, "y.npy": y}
    return truth


MDS_COLUMNS = {"label": "int64", "raw": "bytes", "v": "ndarray:int16", "x": "ndarray:float32:4,4"}


def write_mds(d: str, nshards: int, per_shard: int, seed: int = 1) -> dict[str, dict[str, Any]]:
    """MDS dataset (index.json + shard.NNNNN.mds), uncompressed, columns
    MDS_COLUMNS, encoded as mosaicml-streaming's MDSWriter does."""
    import numpy as np

    rng = np.random.default_rng(seed)
    names = sorted(MDS_COLUMNS)
    encs = [MDS_COLUMNS[n] for n in names]
    sizes: list[Any] = [8 if e == "int64" else 64 if e == "ndarray:float32:4,4" else None for e in encs]
    os.makedirs(d, exist_ok=True)
    truth: dict[str, dict[str, Any]] = {}
    shards = []
    for s in range(nshards):
        cfg = {"column_encodings": encs, "column_names": names, "column_sizes": sizes, "compression": None, "format": "mds", "hashes": [], "size_limit": 1 << 26, "version": 2}
        blobs = []
        for i in range(per_shard):
            label = int(rng.integers(-(1 << 40), 1 << 40))
            raw = rng.bytes(int(rng.integers(1, 300)))
            v = rng.integers(-30000, 30000, (int(rng.integers(1, 6)), 3)).astype(np.int16)
            x = rng.standard_normal((4, 4)).astype(np.float32)
            enc_v = bytes([(v.ndim << 2) | 0]) + np.array(v.shape, np.uint8).tobytes() + v.tobytes()
            vals = {"label": np.int64(label).tobytes(), "raw": raw, "v": enc_v, "x": x.tobytes()}
            prefix = b"".join(np.uint32(len(vals[n])).tobytes() for n, sz in zip(names, sizes) if sz is None)
            blobs.append(prefix + b"".join(vals[n] for n in names))
            truth[f"shard.{s:05d}.mds/{i}"] = {"label": label, "raw": raw, "v": v, "x": x}
        cfg_bytes = json.dumps(cfg, sort_keys=True).encode()
        n = len(blobs)
        start = 4 + 4 * (n + 1) + len(cfg_bytes)
        offs = [start]
        for b in blobs:
            offs.append(offs[-1] + len(b))
        data = np.uint32(n).tobytes() + np.array(offs, np.uint32).tobytes() + cfg_bytes + b"".join(blobs)
        base = f"shard.{s:05d}.mds"
        with open(os.path.join(d, base), "wb") as f:
            f.write(data)
        shards.append(dict(cfg, raw_data={"basename": base, "bytes": len(data), "hashes": {}}, samples=n, zip_data=None))
    with open(os.path.join(d, "index.json"), "w") as f:
        json.dump({"shards": shards, "version": 2}, f, sort_keys=True)
    return truth


def write_npy_files(d: str, n: int, seed: int = 2) -> dict[str, dict[str, Any]]:
    """Plain .npy files, one sample each (key = file stem)."""
    import numpy as np

    rng = np.random.default_rng(seed)
    os.makedirs(d, exist_ok=True)
    truth = {}
    for i in range(n):
        a = rng.standard_normal((5, 7)).astype(np.float32)
        np.save(os.path.join(d, f"t{i:03d}.npy"), a)
        truth[f"t{i:03d}"] = {"npy": a}
    return truth


@dataclass
class Datasets:
    """The test datasets, under a gdsfs mount and in the backing directory."""

    mount: Mount
    wds: dict[str, dict[str, Any]]
    mds: dict[str, dict[str, Any]]
    npy: dict[str, dict[str, Any]]

    def wds_shards(self, on_mount: bool = True) -> list[str]:
        root = self.mount.mnt if on_mount else self.mount.src
        return [os.path.join(root, "wds", f) for f in sorted(os.listdir(os.path.join(self.mount.src, "wds")))]

    def dir(self, name: str, on_mount: bool = True) -> str:
        return os.path.join(self.mount.mnt if on_mount else self.mount.src, name)


@pytest.fixture(scope="session")
def datasets(gdsfs_mount: Mount) -> Datasets:
    src = gdsfs_mount.src
    return Datasets(
        gdsfs_mount,
        wds=write_wds(os.path.join(src, "wds"), 4, 13),
        mds=write_mds(os.path.join(src, "mds"), 3, 11),
        npy=write_npy_files(os.path.join(src, "npy"), 6),
    )
