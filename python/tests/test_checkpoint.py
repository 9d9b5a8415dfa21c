"""gdsfs.checkpoint: torch.save/torch.load compatibility through the control path.

References: the installed torch.save/torch.load (Debian 1.13 in CI) and fixtures written by
torch 2.11 (fixtures/*.pt, default 64-byte and 4096-byte record alignment).
"""

from __future__ import annotations

import inspect
import io
import os
import pickle
import shutil
import struct
import warnings
import zipfile

import pytest
import torch

from _ckpt_helpers import assert_same, counters, daemon_dir, FIXTURES, nested_state, storage_key
from gdsfs import GDSFallbackWarning, GDSUnavailableError
from gdsfs._ckpt import zipfmt
from gdsfs._errors import _reset_fallback_warning
import gdsfs.checkpoint as gck


@pytest.fixture
def mdir(gdsfs_mount, request):
    yield from daemon_dir(gdsfs_mount, request, "ckpt")


def payload(obj) -> int:
    seen, n = set(), 0

    def walk(o):
        nonlocal n
        if isinstance(o, torch.Tensor):
            k = storage_key(o)
            if k not in seen:
                seen.add(k)
                n += o.untyped_storage().nbytes() if hasattr(o, "untyped_storage") else o.storage().nbytes()
        elif isinstance(o, dict):
            for v in o.values():
                walk(v)
        elif isinstance(o, (list, tuple)):
            for v in o:
                walk(v)

    walk(obj)
    return n


def like_torch_weights_only(p, ours, same=assert_same, **kw):
    """``ours()``, a weights-only load of ``p``, must do what ``torch.load(p, weights_only=True)``
    does with the installed torch: give the same object, or refuse the file where torch refuses it
    (torch 1.13's weights-only unpickler refuses floats and sets, for one). Returns ours or None."""
    try:
        want = torch.load(p, weights_only=True, **kw)
    except Exception:  # torch's refusal: RuntimeError under 1.13, UnpicklingError under 2.x
        with pytest.raises(pickle.UnpicklingError, match="Weights only"):
            ours()
        return None
    got = ours()
    same(want, got)
    return got


def data_offsets(path: str) -> dict[str, int]:
    with open(path, "rb") as f:
        _, recs = zipfmt.locate(f)
    return {n: r.offset for n, r in recs.items() if n.startswith("data/")}


# --- loads of files written by torch ---------------------------------------------------------


@pytest.mark.parametrize("name", ["nested_default.pt", "model_align4096.pt", "dtypes_default.pt"])
@pytest.mark.parametrize("weights_only", [False, True])
def test_load_fixtures_written_by_torch_2_11(gdsfs_mount, mdir, name, weights_only):
    dst = os.path.join(mdir, name)
    shutil.copyfile(os.path.join(FIXTURES, name), dst)
    want = torch.load(os.path.join(FIXTURES, name))
    before = counters(gdsfs_mount)["read_bytes"]
    if weights_only:
        got = like_torch_weights_only(dst, lambda: gck.load(dst, weights_only=True))
        if got is None:
            return  # the installed torch refuses this file under weights_only; so did we
    else:
        got = gck.load(dst, weights_only=False)
    assert_same(want, got)
    assert counters(gdsfs_mount)["read_bytes"] - before >= payload(want)
    if name == "nested_default.pt":  # views keep sharing their storage
        assert storage_key(got["t"]) == storage_key(got["model"]["layer.weight"]) == storage_key(got["view"])


def test_load_what_torch_save_wrote(gdsfs_mount, mdir):
    sd = nested_state(1)
    p = os.path.join(mdir, "by_torch.pt")
    torch.save(sd, p)  # torch 1.13 writes through the mount (passthrough), 64-byte records
    like_torch_weights_only(p, lambda: gck.load(p, weights_only=True))
    got = gck.load(p, weights_only=False)
    assert_same(sd, got)
    assert storage_key(got["views"]["transposed"]) == storage_key(got["model"]["layer.weight"])


# --- saves read by torch ---------------------------------------------------------------------


def test_save_is_read_by_torch_load(gdsfs_mount, mdir):
    sd = nested_state(2)
    p = os.path.join(mdir, "ours.pt")
    before = counters(gdsfs_mount)["write_bytes"]
    gck.save(sd, p)
    assert counters(gdsfs_mount)["write_bytes"] - before >= payload(sd), "storages did not go through the daemon"
    got = torch.load(p)
    assert_same(sd, got)
    assert storage_key(got["views"]["strided"]) == storage_key(got["model"]["layer.weight"])
    offs = data_offsets(p)
    assert offs and all(o % 4096 == 0 for o in offs.values()), offs
    with zipfile.ZipFile(p) as z:  # a valid zip, CRCs included (host-resident storages)
        assert z.testzip() is None
        assert z.namelist()[0] == "ours/data.pkl"
        assert z.read("ours/version") == b"3\n" and z.read("ours/byteorder") == b"little"
    assert_same(sd, gck.load(p))


def test_round_trip_with_map_location_and_weights_only(gdsfs_mount, mdir):
    sd = nested_state(3)
    p = os.path.join(mdir, "rt.pt")
    gck.save(sd, p)
    for ml in (None, "cpu", torch.device("cpu"), {"cpu": "cpu"}):
        assert_same(sd, gck.load(p, map_location=ml, weights_only=False))
        like_torch_weights_only(p, lambda ml=ml: gck.load(p, map_location=ml, weights_only=True), map_location=ml)
    if not torch.cuda.is_available():
        with pytest.raises(RuntimeError, match="CUDA"):
            gck.load(p, map_location="cuda")
        with pytest.raises(RuntimeError, match="CUDA"):
            gck.load(p, map_location={"cpu": "cuda:0"})


class Custom:
    def __init__(self, x):
        self.x = x

    def __eq__(self, other):
        return type(other) is Custom and other.x == self.x


class Evil:
    def __reduce__(self):
        return (os.system, ("echo pwned",))


def test_weights_only_refuses_foreign_globals(gdsfs_mount, mdir):
    p = os.path.join(mdir, "custom.pt")
    gck.save({"c": Custom(torch.ones(2)), "t": torch.zeros(3)}, p)
    with pytest.raises(pickle.UnpicklingError, match="Weights only"):
        gck.load(p, weights_only=True)
    got = gck.load(p, weights_only=False)
    assert torch.equal(got["c"].x, torch.ones(2)) and torch.equal(got["t"], torch.zeros(3))
    torch.save({"e": Evil()}, os.path.join(mdir, "evil.pt"))
    with pytest.raises(pickle.UnpicklingError, match="os.system|posix.system"):
        gck.load(os.path.join(mdir, "evil.pt"), weights_only=True)


def test_save_is_atomic_replace(gdsfs_mount, mdir):
    p = os.path.join(mdir, "a.pt")
    gck.save({"v": torch.zeros(3)}, p)
    ino = os.stat(p).st_ino
    gck.save({"v": torch.ones(3)}, p)
    assert os.stat(p).st_ino != ino
    assert torch.equal(torch.load(p)["v"], torch.ones(3))
    with pytest.raises((pickle.PicklingError, AttributeError)):  # 3.11: AttributeError for local objects
        gck.save({"f": lambda: 1}, p)  # a failed save leaves the old file and no temp
    assert torch.equal(torch.load(p)["v"], torch.ones(3))
    assert os.listdir(mdir) == ["a.pt"]


def test_corrupt_archive_is_an_error_not_a_crash(gdsfs_mount, mdir):
    p = os.path.join(mdir, "c.pt")
    gck.save({"w": torch.randn(100)}, p)
    b = bytearray(open(p, "rb").read())
    off = data_offsets(p)["data/0"]
    # Claim a record larger than the file in the central directory.
    cd = b.rfind(b"PK\x01\x02", 0)
    while cd != -1:
        n = struct.unpack_from("<H", b, cd + 28)[0]
        if b[cd + 46 : cd + 46 + n].endswith(b"data/0"):
            struct.pack_into("<II", b, cd + 20, 1 << 30, 1 << 30)
        cd = b.rfind(b"PK\x01\x02", 0, cd)
    bad = os.path.join(mdir, "bad.pt")
    open(bad, "wb").write(b)
    with pytest.raises((zipfmt.ZipFormatError, pickle.UnpicklingError)):
        gck.load(bad)
    assert off % 4096 == 0


# --- pass-throughs and fallbacks -------------------------------------------------------------


def test_file_objects_go_to_torch(tmp_path):
    sd = nested_state(4)
    buf = io.BytesIO()
    gck.save(sd, buf)
    buf.seek(0)
    assert_same(sd, gck.load(buf))


def test_off_gdsfs_warns_once_and_matches_torch(tmp_path):
    _reset_fallback_warning()
    sd = nested_state(5)
    p = str(tmp_path / "off.pt")
    with pytest.warns(GDSFallbackWarning, match="not on a gdsfs mount"):
        gck.save(sd, p)
    assert_same(sd, torch.load(p))
    assert all(o % 4096 == 0 for o in data_offsets(p).values())
    with warnings.catch_warnings():
        warnings.simplefilter("error", GDSFallbackWarning)
        assert_same(sd, gck.load(p))
    with pytest.raises(GDSUnavailableError):
        gck.load(p, strict=True)


def test_decoder_without_daemon_matches_torch(tmp_path):
    """The pickle decoder on its own (plain reads), for every fixture and weights_only mode."""
    for name in ["nested_default.pt", "model_align4096.pt", "dtypes_default.pt"]:
        p = os.path.join(FIXTURES, name)
        want = torch.load(p)

        def ours(wo):
            return gck._load_path(p, gck._restorer("cpu"), wo, {"encoding": "utf-8"}, strict=False, via_daemon=False)

        assert_same(want, ours(False))
        like_torch_weights_only(p, lambda: ours(True))


def test_signatures_mirror_torch():
    ours_load = inspect.signature(gck.load).parameters
    for name, p in inspect.signature(torch.load).parameters.items():
        assert name in ours_load, f"load lacks {name}"
        assert ours_load[name].kind == p.kind, name
        if name not in ("weights_only", "mmap"):  # ours: None = the installed torch's default
            assert ours_load[name].default == p.default, name
    ours_save = list(inspect.signature(gck.save).parameters.values())
    theirs_save = list(inspect.signature(torch.save).parameters.values())
    for a, b in zip(ours_save, theirs_save):
        assert (a.name, a.kind, a.default) == (b.name, b.kind, b.default)


def test_zip64_records_and_offsets(tmp_path):
    """A record over 4 GiB and a header past 4 GiB use zip64 fields that zipfile (and miniz) read.

    The data is a sparse hole, so the test writes only headers and the central directory."""
    big = (5 << 30) + 123
    recs = [
        zipfmt.Record("data.pkl", 3, b"abc"),
        zipfmt.Record("data/0", big, None, align=4096),
        zipfmt.Record("data/1", 10, None, align=4096),
        zipfmt.Record("version", 2, b"3\n"),
    ]
    plan = zipfmt.plan("big", recs)
    p = tmp_path / "big.pt"
    with open(p, "wb") as f:
        for r in plan.records:
            f.seek(r.header_offset)
            f.write(plan.local_header(r) + (r.data or b""))
        f.seek(plan.central_offset)
        f.write(plan.central_directory())
    assert os.path.getsize(p) == plan.total_size()
    with zipfile.ZipFile(p) as z:
        info = {i.filename: i for i in z.infolist()}
        assert info["big/data/0"].file_size == big
        assert info["big/data/1"].header_offset > 0xFFFFFFFF
        assert z.read("big/version") == b"3\n"
    with open(p, "rb") as f:
        archive, located = zipfmt.locate(f)
    assert archive == "big"
    assert located["data/0"].offset == recs[1].data_offset and located["data/0"].size == big
    assert located["data/1"].offset == recs[2].data_offset and located["data/1"].offset % 4096 == 0


@pytest.mark.parametrize("save", ["checkpoint", "safetensors"])
def test_save_errors_name_the_problem(tmp_path, save):
    import gdsfs.safetensors as gst

    fn = (lambda p: gck.save({"a": torch.ones(2)}, p)) if save == "checkpoint" else (lambda p: gst.save_file({"a": torch.ones(2)}, p))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", GDSFallbackWarning)
        with pytest.raises(FileNotFoundError, match="does not exist; create it first"):
            fn(str(tmp_path / "missing" / "x"))
        with pytest.raises(IsADirectoryError, match="is a directory"):
            fn(str(tmp_path))
    assert os.listdir(tmp_path) == []


def test_mutated_archives_fail_cleanly():
    """Seeded random corruption of a real torch.save file: under weights_only, decoding raises only
    the format's own errors (never another exception), and allocates no more than the file holds."""
    import random

    from gdsfs._ckpt import torchzip

    with open(os.path.join(FIXTURES, "nested_default.pt"), "rb") as f:
        good = f.read()
    rng = random.Random(11)
    for _ in range(1500):
        b = bytearray(good)
        for _ in range(rng.randint(1, 6)):
            # Half the hits on the pickle and the central directory, where structure lives.
            j = rng.choice([rng.randrange(len(b)), rng.randrange(0, 700), rng.randrange(len(b) - 1200, len(b))])
            b[j] = rng.randrange(256)
        data = bytes(b)
        try:
            torchzip.decode(io.BytesIO(data), 0, len(data), lambda _loc: torch.device("cpu"), weights_only=True)
        except (zipfmt.ZipFormatError, pickle.UnpicklingError, EOFError, torchzip.NotAddressable):
            pass


# --- weights-only: the same files as torch.load(weights_only=True) ---------------------------
#
# The GPU run with torch 2.11 found a file that torch.load(weights_only=True) loads and our former
# private allowlist refused: torch 2.x pickles tensors of its newer dtypes (uint16/32/64,
# float8_*) with _rebuild_tensor_v3 over a storage whose type is the global
# torch.storage.UntypedStorage. torch 1.13 (CI) cannot write such a tensor, so these tests use a
# bare UntypedStorage (which 1.13's torch.save does pickle under that global) and hand-built
# pickle streams in the exact form torch 2.x writes; each checks gdsfs against the installed
# torch.load(weights_only=True).


def _zip_archive(path: str, pkl: bytes, records: dict[str, bytes]) -> None:
    """A torch.save-layout zip (stored records) with ``pkl`` as data.pkl."""
    with zipfile.ZipFile(path, "w", zipfile.ZIP_STORED) as z:
        z.writestr("archive/data.pkl", pkl)
        z.writestr("archive/byteorder", b"little")
        for k, b in records.items():
            z.writestr(f"archive/data/{k}", b)
        z.writestr("archive/version", b"3\n")


def _binunicode(s: str) -> bytes:
    b = s.encode()
    return b"X" + struct.pack("<I", len(b)) + b


def _glob(module: str, name: str) -> bytes:
    return b"c" + module.encode() + b"\n" + name.encode() + b"\n"


def _tensor_pickle(rebuild: str, dtype_name: str | None, nbytes: int, numel: int) -> bytes:
    """Protocol-2 pickle of {"t": rebuild(storage, 0, (numel,), (1,), False, OrderedDict()[, dtype])}
    whose storage's persistent id names torch.storage.UntypedStorage, as torch 2.x writes it."""
    pid = (b"(" + _binunicode("storage") + _glob("torch.storage", "UntypedStorage") + _binunicode("0")
           + _binunicode("cpu") + b"K" + bytes([nbytes]) + b"t" + b"Q")
    args = (pid + b"K\x00" + b"K" + bytes([numel]) + b"\x85" + b"K\x01\x85" + b"\x89"
            + _glob("collections", "OrderedDict") + b")R")
    if dtype_name is not None:
        args += _glob("torch", dtype_name)
    return (b"\x80\x02}" + _binunicode("t") + _glob("torch._utils", rebuild) + b"(" + args + b"tR" + b"s.")


def test_weights_only_accepts_untyped_storage_global(gdsfs_mount, mdir):
    """A bare UntypedStorage pickles as the global torch.storage.UntypedStorage (torch 1.13 too)."""
    p = os.path.join(mdir, "untyped.pt")
    st = torch.arange(6, dtype=torch.int16).storage()
    st = st._untyped_storage if hasattr(st, "_untyped_storage") else st._storage
    torch.save({"s": st, "t": torch.ones(3)}, p)

    def same(want, got):
        assert type(got["s"]) is type(want["s"])  # noqa: E721 - the exact storage class, not a subclass
        assert bytes(got["s"]) == bytes(want["s"]) == bytes(st)
        assert_same(want["t"], got["t"])

    got = like_torch_weights_only(p, lambda: gck.load(p, weights_only=True), same)
    assert got is not None, "torch.load(weights_only=True) refused a bare UntypedStorage"


def test_weights_only_tensor_over_untyped_storage(gdsfs_mount, mdir):
    """A tensor rebuilt over a storage typed torch.storage.UntypedStorage: _rebuild_tensor_v2
    (every torch accepts it) and _rebuild_tensor_v3 with a dtype global, torch 2.x's form for
    uint16 (torch 1.13 has neither, so there torch.load and gdsfs both refuse it)."""
    data = struct.pack("<3H", 1, 2, 65535)
    p2 = os.path.join(mdir, "v2.pt")
    _zip_archive(p2, _tensor_pickle("_rebuild_tensor_v2", None, 6, 6), {"0": data})
    got = like_torch_weights_only(p2, lambda: gck.load(p2, weights_only=True))
    assert got is not None and got["t"].dtype == torch.uint8 and bytes(got["t"].cpu().numpy()) == data
    p3 = os.path.join(mdir, "v3.pt")
    _zip_archive(p3, _tensor_pickle("_rebuild_tensor_v3", "uint16", 6, 3), {"0": data})
    got = like_torch_weights_only(p3, lambda: gck.load(p3, weights_only=True))
    if hasattr(torch, "uint16") and hasattr(torch._utils, "_rebuild_tensor_v3"):
        assert got is not None and got["t"].dtype == torch.uint16
        assert got["t"].view(torch.int16).tolist() == [1, 2, -1]
    else:
        assert got is None


def test_weights_only_honours_torch_safe_globals(gdsfs_mount, mdir):
    """Globals a user allowlisted with torch.serialization.add_safe_globals load here too."""
    add = getattr(torch.serialization, "add_safe_globals", None)
    if add is None:
        pytest.skip(f"torch {torch.__version__} has no torch.serialization.add_safe_globals")
    p = os.path.join(mdir, "custom.pt")
    gck.save({"c": Custom(torch.ones(2))}, p)
    with pytest.raises(pickle.UnpicklingError):
        gck.load(p, weights_only=True)
    add([Custom])
    try:
        assert torch.equal(gck.load(p, weights_only=True)["c"].x, torch.ones(2))
    finally:
        torch.serialization.clear_safe_globals()


def test_interrupted_ioctls_are_redone_not_fallbacks(mdir, monkeypatch):
    """A signal interrupting any control request of a save or a load (the daemon answers EINTR)
    is redone: no GDSFallbackWarning (mdir makes it an error), identical tensors."""
    import errno

    import gdsfs._core as core
    from gdsfs import _protocol as proto

    real = core._ioctl  # every request of the core goes through it (fcntl or ctypes below)
    cmds = {proto.HELLO, proto.ALLOC, proto.WRITE, proto.RELEASE, proto.READ, proto.STATUS}
    interrupted: list[int] = []

    def flaky(fd, cmd, buf):
        if cmd in cmds and cmd not in interrupted:  # the first of each kind, once
            interrupted.append(cmd)
            raise InterruptedError(errno.EINTR, "Interrupted system call")
        return real(fd, cmd, buf)

    sd = {"a": torch.arange(300_000, dtype=torch.float32), "b": torch.ones(7, dtype=torch.int64)}
    p = os.path.join(mdir, "eintr.pt")
    monkeypatch.setattr(core, "_ioctl", flaky)
    gck.save(sd, p)
    got = gck.load(p, map_location="cpu")
    monkeypatch.setattr(core, "_ioctl", real)
    assert_same(got, sd)
    assert set(interrupted) >= {proto.HELLO, proto.ALLOC, proto.WRITE, proto.RELEASE, proto.READ}


def test_large_reads_leave_other_threads_running(mdir):
    """A READ (a 12 KiB request buffer) goes through ctypes, which releases the GIL: another
    Python thread keeps running while the daemon fills a 256 MiB range (fcntl.ioctl would hold
    the GIL for the whole call, stalling it)."""
    import threading
    import time

    import gdsfs

    p = os.path.join(mdir, "big.bin")
    with open(p, "wb") as f:
        f.write(os.urandom(1 << 20) * 256)
    stamps: list[float] = []
    stop = threading.Event()

    def ticker():
        while not stop.is_set():
            stamps.append(time.monotonic())
            time.sleep(0.0005)

    with gdsfs.Session(p) as s, open(p, "rb", buffering=0) as f:
        s.release(s.read(f, [(0, 1 << 20)]))  # warm: session, slabs, page cache
        th = threading.Thread(target=ticker)
        th.start()
        try:
            time.sleep(0.02)
            t0 = time.monotonic()
            refs = s.read(f, [(0, 256 << 20)])
            t1 = time.monotonic()
            time.sleep(0.02)
        finally:
            stop.set()
            th.join()
        s.release(refs)
    if t1 - t0 < 0.05:
        pytest.skip(f"the 256 MiB READ took {1e3 * (t1 - t0):.0f} ms: too fast to tell a held GIL apart")
    inside = [b - a for a, b in zip(stamps, stamps[1:]) if b > t0 and a < t1]
    assert inside and max(inside) < 0.5 * (t1 - t0), (
        f"another thread stalled {1e3 * max(inside or [0]):.0f} ms of a {1e3 * (t1 - t0):.0f} ms READ")
