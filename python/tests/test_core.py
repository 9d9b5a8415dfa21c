"""The torch-free core: protocol encoding, mount detection, fallbacks,
layouts, epoch plans; and, against a live host-mode mount, sessions, reads,
slabs, tokens and releases."""

from __future__ import annotations

import errno
import io
import json
import os
import pickle
import re
import struct
import subprocess
import sys
import tarfile
import time
import warnings

import pytest

import gdsfs
from gdsfs import _errors, _layout, _plan
from gdsfs import _protocol as proto

HERE = os.path.dirname(os.path.abspath(__file__))
PYDIR = os.path.dirname(HERE)


def test_import_does_not_import_torch() -> None:
    code = "import sys, gdsfs; gdsfs.find_mount('/'); assert 'torch' not in sys.modules, sorted(m for m in sys.modules if 'torch' in m)"
    r = subprocess.run([sys.executable, "-c", code], cwd=PYDIR, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr


@pytest.mark.parametrize(
    "name,want",
    [
        ("HELLO", 0xC1004701),
        ("SLAB", 0xC2804702),
        ("ALLOC", 0xC0804703),
        ("RELEASE", 0xC8404704),
        ("STATUS", 0xFFC04705),
        ("READ", 0xF0404710),
        ("READ_NAMES", 0xF0404711),
        ("WRITE", 0xC0804712),
        ("INDEX", 0xFFC04713),
    ],
)
def test_command_numbers_match_protocol_table(name: str, want: int) -> None:
    assert getattr(proto, name) == want


def test_read_request_layout() -> None:
    buf = proto.encode_read(proto.Token(7, 0xDEADBEEF), -1, [(4096, 100), (1 << 40, 3)])
    assert len(buf) == proto.READ_SIZE
    assert struct.unpack_from("<IHHQQQ", buf, 0) == (0x53464447, 1, 0, 7, 0xDEADBEEF, 0)
    assert struct.unpack_from("<iII", buf, 32) == (-1, 0, 2)
    assert buf[44:64] == bytes(20)
    assert struct.unpack_from("<4Q", buf, 64) == (4096, 100, 1 << 40, 3)
    assert buf[96:] == bytes(len(buf) - 96)


def test_read_names_and_release_layout() -> None:
    buf = proto.encode_read_names(proto.Token(1, 2), 0, ["a/b.npy", "data"])
    assert struct.unpack_from("<iIII", buf, 32) == (0, 0, 2, len(b"a/b.npy\0data\0"))
    assert bytes(buf[64:77]) == b"a/b.npy\0data\0"
    rel = proto.encode_release(None, [5, 9])
    assert struct.unpack_from("<IHHQQ", rel, 0)[3:] == (0, 0)
    assert struct.unpack_from("<I", rel, 32) == (2,)
    assert struct.unpack_from("<2Q", rel, 64) == (5, 9)
    with pytest.raises(ValueError):
        proto.encode_release(None, [])
    with pytest.raises(ValueError):
        proto.encode_read(proto.Token(1, 1), -1, [(0, 1)] * 257)


def test_decode_hello_and_lease() -> None:
    buf = bytearray(proto.HELLO_SIZE)
    struct.pack_into("<IIQQQIIII", buf, 32, 1, 1000, 0b11101, 42, 99, 256, 12288, 4096, 0)
    struct.pack_into("<QQI", buf, 80, 1 << 26, 16256, 1234)
    buf[104:108] = b"host"
    buf[136:141] = b"0.1.0"
    h = proto.decode_hello(bytes(buf))
    got = (h.uid, h.caps, h.token, h.max_ranges, h.max_lease, h.page, h.daemon_pid, h.engine, h.daemon_version)
    assert got == (1000, 0b11101, (42, 99), 256, 1 << 26, 16256, 1234, "host", "0.1.0")
    lb = bytearray(proto.READ_SIZE)
    struct.pack_into("<QQQQQII", lb, 64 + 48, 3, 4, 4196, 100, 60, 1, 0)
    assert proto.decode_read(bytes(lb), 2)[1] == proto.LeaseDesc(3, 4, 4196, 100, 60, 1)


def test_not_a_mount_warns_once_and_strict_raises(tmp_path) -> None:
    p = tmp_path / "f.bin"
    p.write_bytes(b"x")
    assert gdsfs.find_mount(p) is None
    assert not gdsfs.is_gdsfs_path(p)
    _errors._reset_fallback_warning()
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        assert gdsfs.Session.open(p) is None
        assert gdsfs.Session.open(p) is None
    got = [x for x in w if issubclass(x.category, gdsfs.GDSFallbackWarning)]
    assert len(got) == 1, [str(x.message) for x in w]
    assert "not on a gdsfs mount" in str(got[0].message)
    with pytest.raises(gdsfs.GDSUnavailableError, match="not on a gdsfs mount"):
        gdsfs.Session.open(p, strict=True)
    with pytest.raises(gdsfs.GDSUnavailableError):
        gdsfs.capabilities(p)
    assert issubclass(gdsfs.GDSUnavailableError, RuntimeError)
    assert issubclass(gdsfs.GDSFallbackWarning, UserWarning)


@pytest.mark.parametrize("name", ["arr_f4.npy", "arr_i8_fortran.npy", "arr_u1.npy"])
def test_npy_header_matches_numpy(name: str) -> None:
    import numpy as np

    path = os.path.join(HERE, "npy_fixtures", name)
    raw = open(path, "rb").read()
    h = _layout.parse_npy_header(raw)
    a = np.load(path)
    assert h.shape == a.shape
    assert np.dtype(h.dtype) == a.dtype
    assert h.fortran_order == (a.flags.f_contiguous and not a.flags.c_contiguous)
    assert len(raw) - h.data_offset == a.nbytes


@pytest.mark.parametrize("bad", [b"", b"\x93NUMPY", b"PK\x03\x04" + bytes(20), b"\x93NUMPY\x01\x00\xff\xff{"])
def test_npy_header_rejects_garbage(bad: bytes) -> None:
    with pytest.raises(ValueError):
        _layout.parse_npy_header(bad)


def test_tar_index_groups_members_like_webdataset(tmp_path) -> None:
    path = tmp_path / "a.tar"
    members = [("x/000.jpg", b"J" * 700), ("x/000.seg.png", b"P" * 10), ("x/001.jpg", b"K" * 3), ("__meta__", b"m"), ("README", b"r")]
    with tarfile.open(path, "w") as tf:
        for name, data in members:
            ti = tarfile.TarInfo(name)
            ti.size = len(data)
            tf.addfile(ti, io.BytesIO(data))
    idx = _layout.local_index(str(path))
    assert [s["key"] for s in idx["samples"]] == ["x/000", "x/001"]
    assert list(idx["samples"][0]["fields"]) == ["jpg", "seg.png"]
    raw = path.read_bytes()
    for s, (name, data) in zip([f for smp in idx["samples"] for f in smp["fields"].values()], members[:3]):
        assert s["name"] == name
        assert raw[s["offset"] : s["offset"] + s["length"]] == data
    assert sorted(m["name"] for m in idx["other"]) == ["README", "__meta__"]


def test_brace_expansion() -> None:
    assert _plan.expand_braces("a-{008..011}.tar") == ["a-008.tar", "a-009.tar", "a-010.tar", "a-011.tar"]
    assert _plan.expand_braces("{x,y}/{0..1}") == ["x/0", "x/1", "y/0", "y/1"]
    assert _plan.expand_braces("plain.tar") == ["plain.tar"]
    with pytest.raises(ValueError):
        _plan.expand_braces("a-{1..")


@pytest.mark.parametrize("shuffle", [False, True])
@pytest.mark.parametrize("slots", [1, 2, 3, 8, 40])
def test_epoch_plan_covers_every_sample_once(shuffle: bool, slots: int) -> None:
    counts = [5, 0, 13, 1, 7]
    plan = _plan.EpochPlan(counts, seed=3, epoch=1, shuffle=shuffle, slots=slots)
    got = [(sh, i) for s in range(slots) for _, sh, i in plan.positions(s)]
    assert sorted(got) == sorted((sh, i) for sh, n in enumerate(counts) for i in range(n))
    sizes = [plan.block(s)[1] - plan.block(s)[0] for s in range(slots)]
    assert max(sizes) - min(sizes) <= 1
    again = _plan.EpochPlan(counts, seed=3, epoch=1, shuffle=shuffle, slots=slots)
    assert got == [(sh, i) for s in range(slots) for _, sh, i in again.positions(s)]
    # Skipping k samples of a slot yields exactly the rest.
    full = list(plan.positions(0))
    assert list(plan.positions(0, skip=2)) == full[2:]


def test_epoch_plan_shuffles_per_epoch_and_seed() -> None:
    counts = [50, 50]
    order = lambda seed, epoch: [x[1:] for x in _plan.EpochPlan(counts, seed=seed, epoch=epoch, shuffle=True, slots=1).positions(0)]  # noqa: E731
    assert order(1, 0) == order(1, 0)
    assert order(1, 0) != order(1, 1)
    assert order(1, 0) != order(2, 0)
    assert order(1, 0) != [(s, i) for s in range(2) for i in range(50)]


# ----------------------------------------------------------------------------
# Live: a host-mode mount.


def _write(m, name: str, data: bytes) -> str:
    with open(os.path.join(m.src, name), "wb") as f:
        f.write(data)
    return m.path(name)


def test_capabilities_host_mode(gdsfs_mount) -> None:
    p = _write(gdsfs_mount, "caps.bin", b"c" * 10)
    c = gdsfs.capabilities(p)
    assert c.mount == os.path.realpath(gdsfs_mount.mnt)
    assert c.engine == "host" and not c.gds and c.devices == [] and c.host_slabs
    assert c.io_alignment == 4096 and c.max_lease > 0
    assert gdsfs.find_mount(p) == c.mount


def test_one_version_for_package_and_daemon(gdsfs_mount) -> None:
    """gdsfs.__version__ is the package's only version (pyproject.toml reads it) and equals the
    version the daemon built from this tree reports (daemon.Version)."""
    p = _write(gdsfs_mount, "version.bin", b"v")
    assert gdsfs.capabilities(p).daemon_version == gdsfs.__version__
    with open(os.path.join(os.path.dirname(gdsfs.__file__), "..", "pyproject.toml")) as f:
        project = f.read()
    assert 'dynamic = ["version"]' in project and 'version = { attr = "gdsfs.__version__" }' in project
    assert not re.search(r'^version = "', project, re.M), "pyproject.toml names a version of its own"


def test_session_reads_exact_bytes(gdsfs_mount) -> None:
    data = os.urandom(300_000)
    p = _write(gdsfs_mount, "r.bin", data)
    ranges = [(0, 1), (1, 4095), (4095, 2), (12345, 100_000), (299_990, 50), (300_000, 10), (7, 0)]
    before = gdsfs_mount.stats()["leases"]
    with gdsfs.Session(gdsfs_mount.mnt) as s, open(p, "rb") as f:
        assert s.host_mode and s.device == -1
        refs = s.read(f, ranges)
        assert len(refs) == len(ranges)
        for r, (off, n) in zip(refs, ranges):
            want = data[off : off + n]
            assert r.valid == len(want) and r.length == n
            assert bytes(s.host_buffer(r)) == want
            assert r.engine == ("host" if want else "none")
            assert (r.lease == 0) == (len(want) == 0)
        assert gdsfs_mount.stats()["leases"] == before + sum(1 for r in refs if r.lease)
        s.release(refs)
        s.release(refs)  # a second release is ignored
        assert gdsfs_mount.stats()["leases"] == before


def test_many_ranges_split_into_several_reads(gdsfs_mount) -> None:
    data = os.urandom(600 * 64)
    p = _write(gdsfs_mount, "many.bin", data)
    ranges = [(i * 64, 64) for i in range(600)]
    with gdsfs.Session(gdsfs_mount.mnt) as s, open(p, "rb") as f:
        refs = s.read(f, ranges)
        assert b"".join(bytes(s.host_buffer(r)) for r in refs) == data
    assert gdsfs_mount.wait_leases(0) == 0


def test_device_the_daemon_lacks_is_refused(gdsfs_mount) -> None:
    before = gdsfs_mount.stats()["sessions"]
    with pytest.raises(gdsfs.GDSUnavailableError, match="no slabs on CUDA device 0"):
        gdsfs.Session(gdsfs_mount.mnt, device=0)
    deadline = time.monotonic() + 10
    while gdsfs_mount.stats()["sessions"] != before and time.monotonic() < deadline:
        time.sleep(0.02)
    assert gdsfs_mount.stats()["sessions"] == before  # the control descriptor was closed


def test_close_returns_every_lease(gdsfs_mount) -> None:
    p = _write(gdsfs_mount, "c.bin", os.urandom(50_000))
    s = gdsfs.Session(gdsfs_mount.mnt)
    with open(p, "rb") as f:
        s.read(f, [(0, 10_000), (20_000, 10_000)])
    assert gdsfs_mount.stats()["leases"] >= 2
    s.close()
    s.close()
    assert gdsfs_mount.wait_leases(0) == 0


def test_token_crosses_processes(gdsfs_mount) -> None:
    """A spawned process reads into the parent's session with the pickled
    token; the parent maps the slab and releases the lease."""
    data = os.urandom(20_000)
    p = _write(gdsfs_mount, "tok.bin", data)
    with gdsfs.Session(gdsfs_mount.mnt) as s:
        code = (
            "import pickle, sys; sys.path.insert(0, sys.argv[1]); import gdsfs\n"
            "s = pickle.loads(bytes.fromhex(sys.argv[2]))\n"
            "f = open(sys.argv[3], 'rb')\n"
            "sys.stdout.write(pickle.dumps(s.read(f, [(100, 5000)])).hex())\n"
        )
        r = subprocess.run([sys.executable, "-c", code, PYDIR, pickle.dumps(s).hex(), p], capture_output=True, text=True, timeout=60)
        assert r.returncode == 0, r.stderr
        [ref] = pickle.loads(bytes.fromhex(r.stdout))
        assert ref.session == s.token.session
        assert bytes(s.host_buffer(ref)) == data[100:5100]
        assert gdsfs_mount.stats()["leases"] >= 1
        s.release([ref])
    assert gdsfs_mount.wait_leases(0) == 0


def test_bad_token_is_refused(gdsfs_mount) -> None:
    p = _write(gdsfs_mount, "bad.bin", b"b" * 100)
    with gdsfs.Session(gdsfs_mount.mnt) as s:
        forged = pickle.loads(pickle.dumps(s))
        forged.token = proto.Token(s.token.session, s.token.secret ^ 1)
        with open(p, "rb") as f, pytest.raises(gdsfs.GDSUnavailableError, match="EPERM") as ei:
            forged.read(f, [(0, 10)])
        assert ei.value.errno == errno.EPERM


def test_read_past_end_is_einval(gdsfs_mount) -> None:
    p = _write(gdsfs_mount, "short.bin", b"s" * 100)
    with gdsfs.Session(gdsfs_mount.mnt) as s, open(p, "rb") as f:
        with pytest.raises(gdsfs.GDSUnavailableError, match="EINVAL") as ei:
            s.read(f, [(101, 1)])
        assert ei.value.errno == errno.EINVAL


def test_layout_matches_python_index(gdsfs_mount) -> None:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tf:
        for name, data in [("k/0.cls", b"1"), ("k/0.x.npy", b"N" * 1000), ("k/1.cls", b"2")]:
            ti = tarfile.TarInfo(name)
            ti.size = len(data)
            tf.addfile(ti, io.BytesIO(data))
    p = _write(gdsfs_mount, "lay.tar", buf.getvalue())
    got = gdsfs.layout(p)
    want = _layout.local_index(os.path.join(gdsfs_mount.src, "lay.tar"))
    assert got["format"] == "tar"
    simplify = lambda x: [(s["key"], {k: (v["name"], v["offset"], v["length"]) for k, v in s["fields"].items()}) for s in x["samples"]]  # noqa: E731
    assert simplify(got) == simplify(want)
    with pytest.raises(gdsfs.GDSUnavailableError) as ei:
        gdsfs.layout(_write(gdsfs_mount, "plain.bin", b"no format"))
    assert ei.value.errno == errno.ENODATA


def test_write_through_lease(gdsfs_mount) -> None:
    p = gdsfs_mount.path("w.bin")
    with gdsfs.Session(gdsfs_mount.mnt) as s:
        if not s.hello.caps & proto.CAP_WRITE:
            pytest.fail("host-mode mount does not serve WRITE")
        ref = s.alloc(10_000)
        payload = os.urandom(10_000)
        s.host_buffer(ref)[:] = payload
        with open(p, "wb") as f:
            assert s.write(f, ref, 4096, sync=True) == 10_000
        s.release([ref])
    with open(os.path.join(gdsfs_mount.src, "w.bin"), "rb") as f:
        got = f.read()
    assert got[:4096] == bytes(4096) and got[4096:] == payload


def test_write_retried_after_interrupt(gdsfs_mount, monkeypatch) -> None:
    """A signal interrupting WRITE (the daemon answers EINTR) is retried, not surfaced."""
    import gdsfs._core as core

    real = core.fcntl.ioctl
    interrupted = []

    def flaky(fd, cmd, buf, mutate=True):
        if cmd == proto.WRITE and not interrupted:
            interrupted.append(cmd)
            raise InterruptedError(errno.EINTR, "Interrupted system call")
        return real(fd, cmd, buf, mutate)

    p = gdsfs_mount.path("wi.bin")
    with gdsfs.Session(gdsfs_mount.mnt) as s:
        ref = s.alloc(8192)
        payload = os.urandom(8192)
        s.host_buffer(ref)[:] = payload
        monkeypatch.setattr(core.fcntl, "ioctl", flaky)
        with open(p, "wb") as f:
            assert s.write(f, ref, 0, sync=True) == 8192
        monkeypatch.setattr(core.fcntl, "ioctl", real)
        s.release([ref])
    assert interrupted == [proto.WRITE]
    with open(os.path.join(gdsfs_mount.src, "wi.bin"), "rb") as f:
        assert f.read() == payload


def test_status_document(gdsfs_mount) -> None:
    st = gdsfs.status(gdsfs_mount.mnt)
    assert {"sessions", "leases"} <= set(st)
    assert st == json.loads(os.getxattr(gdsfs_mount.mnt, "user.gdsfs.stats")) or st["leases"] >= 0


def test_pip_installs_the_package(tmp_path) -> None:
    import importlib.util
    import shutil

    for mod in ("pip", "setuptools"):
        if importlib.util.find_spec(mod) is None:
            pytest.skip(f"{mod} is not installed for this interpreter")

    src = tmp_path / "src"
    shutil.copytree(PYDIR, src, ignore=shutil.ignore_patterns("tests", "__pycache__", "build", "*.egg-info"))
    target = tmp_path / "site"
    r = subprocess.run(
        [sys.executable, "-m", "pip", "install", "--quiet", "--no-build-isolation", "--no-deps", "--no-index", "--target", str(target), str(src)],
        capture_output=True, text=True, timeout=300,
    )
    assert r.returncode == 0, r.stdout + r.stderr
    code = "import sys, gdsfs; assert gdsfs.__file__.startswith(sys.argv[1]), gdsfs.__file__; assert 'torch' not in sys.modules; import gdsfs.torch"
    r = subprocess.run([sys.executable, "-c", code, str(target)], cwd=str(tmp_path), env=dict(os.environ, PYTHONPATH=str(target)), capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr


def test_read_names_by_index_entry(gdsfs_mount) -> None:
    import numpy as np

    buf = io.BytesIO()
    members = {"k/0.x.npy": os.urandom(5000), "k/0.cls": b"7"}
    with tarfile.open(fileobj=buf, mode="w") as tf:
        for name, data in members.items():
            ti = tarfile.TarInfo(name)
            ti.size = len(data)
            tf.addfile(ti, io.BytesIO(data))
    tar = _write(gdsfs_mount, "names.tar", buf.getvalue())
    arr = np.arange(100, dtype=np.float32)
    npy = io.BytesIO()
    np.save(npy, arr)
    npyp = _write(gdsfs_mount, "names.npy", npy.getvalue())
    with gdsfs.Session(gdsfs_mount.mnt) as s:
        with open(tar, "rb") as f:
            refs = s.read_names(f, ["k/0.cls", "k/0.x.npy", "sample/0/cls"])
            assert [bytes(s.host_buffer(r)) for r in refs] == [b"7", members["k/0.x.npy"], b"7"]
            with pytest.raises(gdsfs.GDSUnavailableError) as ei:
                s.read_names(f, ["k/9.nope"])
            assert ei.value.errno == errno.ENOENT
        with open(npyp, "rb") as f:
            [r] = s.read_names(f, ["data"])
            assert bytes(s.host_buffer(r)) == arr.tobytes()
    assert gdsfs_mount.wait_leases(0) == 0


def test_full_pool_waits_for_release_then_gives_up(gdsfs_bin, tmp_path) -> None:
    """A read into a full pool waits (EAGAIN, retried) until leases come
    back, and fails with a message naming the cause when none do."""
    import threading

    from conftest import mount as mount_fs
    from conftest import unmount

    src, mnt = tmp_path / "src", tmp_path / "mnt"
    src.mkdir()
    mnt.mkdir()
    (src / "f.bin").write_bytes(os.urandom(3 << 20))
    m = mount_fs(gdsfs_bin, str(src), str(mnt), str(tmp_path / "log"), "--host-pool", "4MiB", "--slab-size", "4MiB")
    try:
        with gdsfs.Session(m.mnt) as s, open(m.path("f.bin"), "rb") as f:
            [big] = s.read(f, [(0, 3 << 20)])
            with pytest.raises(gdsfs.GDSUnavailableError, match="EAGAIN") as ei:
                s.read(f, [(0, 2 << 20)], timeout=0.3)
            assert ei.value.errno == errno.EAGAIN
            threading.Timer(0.3, s.release, args=([big],)).start()
            [r] = s.read(f, [(0, 2 << 20)], timeout=30)
            assert bytes(s.host_buffer(r)) == (src / "f.bin").read_bytes()[: 2 << 20]
    finally:
        unmount(gdsfs_bin, m.mnt)


def test_a_daemon_that_cannot_serve_is_named_once_in_the_warning(gdsfs_mount) -> None:
    # The host daemon has no CUDA slabs: Session.open(device=0) falls back with one warning
    # whose text says "gdsfs:" once, not once per layer it passed through.
    p = gdsfs_mount.path("warn-once.bin")
    with open(os.path.join(gdsfs_mount.src, "warn-once.bin"), "wb") as f:
        f.write(b"x")
    _errors._reset_fallback_warning()
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        assert gdsfs.Session.open(p, device=0) is None
    got = [str(x.message) for x in w if issubclass(x.category, gdsfs.GDSFallbackWarning)]
    assert len(got) == 1, got
    assert got[0].count("gdsfs:") == 1, got[0]
    assert "no slabs on CUDA device 0" in got[0]
