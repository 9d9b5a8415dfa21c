"""CUDA devices named by UUID between the daemon and its clients (gdsfs._devmap).

A root daemon sees the node's GPUs; a trainer often sees only its own (CUDA_VISIBLE_DEVICES=1, or
a container's view), so its cuda:0 is the daemon's device 1. ``device="cuda:0"`` must mean the GPU
torch calls cuda:0 in the trainer: READ/ALLOC name the daemon's ordinal of that GPU, and slabs the
daemon hands over on its ordinal D are imported on the trainer's ordinal of D's GPU.

CI has no GPU. The daemon is the test mount's real host-mode daemon, dressed up as one with GPUs
by FakeGPUs, which sits where every ioctl of the client goes (gdsfs._core._ioctl): its HELLO says
CUDA devices (and, when it publishes them, DEVICE_UUIDS), its STATUS names their UUIDs, and the
device a READ/READ_NAMES/ALLOC names is written down (and refused, ENODEV, when the daemon has no
such device) before the request goes on to host memory, where the bytes really land. This
process's own CUDA devices come from a fake UUID source (gdsfs._devmap.local_uuids).
"""

from __future__ import annotations

import errno
import json
import os
import pickle
import struct
import sys
import types
from contextlib import contextmanager
from typing import Any, Iterator, Optional, Sequence

import numpy as np
import pytest
import torch
import torch.utils.data

import gdsfs
import gdsfs.safetensors as gst
import gdsfs.torch as gt
from gdsfs import _core, _devmap, _tensors
from gdsfs import _protocol as proto

A = "GPU-aaaaaaaa-0000-1111-2222-333333333333"
B = "GPU-bbbbbbbb-0000-1111-2222-333333333333"
C = "GPU-cccccccc-0000-1111-2222-333333333333"


class FakeGPUs:
    """The test mount's host daemon as a daemon with GPUs ``uuids`` (publishing them unless
    ``publish`` is False: an older daemon), seen from a process whose CUDA devices are ``local``
    (None: a process that cannot tell). Every READ/READ_NAMES/ALLOC device and every call of the
    local UUID source is appended to ``log`` (a file: DataLoader workers write there too)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, log: str, uuids: Sequence[str], local: Optional[Sequence[str]], *,
                 publish: bool = True) -> None:
        self.uuids, self.local, self.publish, self.log = list(uuids), local, publish, log
        self.real = _core._ioctl
        monkeypatch.setattr(_core, "_ioctl", self.ioctl)
        monkeypatch.setattr(_devmap, "local_uuids", self.local_uuids)
        monkeypatch.setattr(_devmap, "_cache", _devmap._Cache())  # this daemon's UUIDs, not an earlier test's
        # Slab descriptors cached by earlier tests of the same (real) daemon run name host memory;
        # this daemon hands its slabs over on CUDA devices: ask it again.
        _core._slabs.reset()

    def _note(self, line: str) -> None:
        with open(self.log, "a") as f:
            f.write(f"{line} {os.getpid()}\n")

    def lines(self, kind: str) -> list[list[str]]:
        if not os.path.exists(self.log):
            return []
        with open(self.log) as f:
            return [ln.split() for ln in f if ln.startswith(kind + " ")]

    def wire(self) -> list[tuple[str, int]]:
        """(op, device) of every READ, READ_NAMES and ALLOC the client sent."""
        return [(w[1], int(w[2])) for w in self.lines("WIRE")]

    def local_uuids(self) -> Optional[list[str]]:
        self._note("LOCAL")
        return None if self.local is None else [_devmap.normalize(u) for u in self.local]

    def ioctl(self, fd: int, cmd: int, buf: bytearray) -> None:
        if cmd == proto.HELLO:
            self.real(fd, cmd, buf)
            caps = struct.unpack_from("<Q", buf, 40)[0] & ~proto.CAP_HOST_SLABS | proto.CAP_CUDA_SLABS
            if self.publish:
                caps |= proto.CAP_DEVICE_UUIDS
            struct.pack_into("<Q", buf, 40, caps)
            struct.pack_into("<I", buf, 76, len(self.uuids))
            return
        if cmd == proto.STATUS and self.publish:
            doc = json.dumps({"pool": {"devices": [{"device": i, "uuid": u} for i, u in enumerate(self.uuids)]}}).encode()
            off = struct.unpack_from("<Q", buf, 32)[0]
            part = doc[off : off + 16256]
            struct.pack_into("<QQI", buf, 32, len(doc), 7, len(part))
            buf[64 : 64 + len(part)] = part
            return
        op = {proto.READ: "READ", proto.READ_NAMES: "READ_NAMES", proto.ALLOC: "ALLOC"}.get(cmd)
        if op is not None:
            dev = struct.unpack_from("<i", buf, 32)[0]
            self._note(f"WIRE {op} {dev}")
            if not 0 <= dev < len(self.uuids):
                raise OSError(errno.ENODEV, os.strerror(errno.ENODEV))
            struct.pack_into("<i", buf, 32, proto.DEVICE_HOST)
            self.real(fd, cmd, buf)
            n = struct.unpack_from("<I", buf, 32)[0] if op != "ALLOC" else 1
            base = 64 if op != "ALLOC" else 32
            for i in range(n):
                slab = struct.unpack_from("<Q", buf, base + 48 * i + 8)[0]
                if slab:
                    self._note(f"SLABDEV {slab} {dev}")
            return
        self.real(fd, cmd, buf)
        if cmd == proto.SLAB:
            slab = struct.unpack_from("<Q", buf, 32)[0]
            for w in self.lines("SLABDEV"):
                if int(w[1]) == slab:
                    struct.pack_into("<i", buf, 60, int(w[2]))


@pytest.fixture(autouse=True)
def _fresh_warnings() -> None:
    gdsfs._errors._reset_fallback_warning()  # each test sees its own one-time fallback warnings


@pytest.fixture
def data(gdsfs_mount) -> Iterator[tuple[str, bytes]]:
    p = gdsfs_mount.path("devuuid.bin")
    payload = os.urandom(3 * 4096 + 123)
    with open(p, "wb") as f:
        f.write(payload)
    yield p, payload
    os.unlink(p)


def _read(s: gdsfs.Session, path: str, n: int, **kw: Any) -> gdsfs.Ref:
    with open(path, "rb") as f:
        [ref] = s.read(f, [(0, n)], **kw)
    return ref


# -- translation -------------------------------------------------------------------------------


def test_the_same_view_is_the_identity(gdsfs_mount, data, monkeypatch, tmp_path) -> None:
    path, payload = data
    fake = FakeGPUs(monkeypatch, str(tmp_path / "log"), [A, B], [A, B])
    with gdsfs.Session(gdsfs_mount.mnt) as s:
        r0 = _read(s, path, len(payload))
        r1 = _read(s, path, len(payload), device=1)
        a = s.alloc(4096, device=1)
        assert (r0.device, r1.device, a.device) == (0, 1, 1)
        assert bytes(s.host_buffer(r1)) == payload
        assert s.slab_info(r1.slab).device == 1 and s._local_device(1) == 1
        s.release([r0, r1, a])
    assert fake.wire() == [("READ", 0), ("READ", 1), ("ALLOC", 1)]
    assert gdsfs.capabilities(path).device_uuids == [A, B]


def test_a_client_that_sees_only_the_daemons_gpu1_as_its_cuda0(gdsfs_mount, data, monkeypatch, tmp_path) -> None:
    """CUDA_VISIBLE_DEVICES=1 on the client: its cuda:0 is the daemon's device 1."""
    path, payload = data
    fake = FakeGPUs(monkeypatch, str(tmp_path / "log"), [A, B], [B])
    with gdsfs.Session(gdsfs_mount.mnt, device=0) as s:
        assert s.device == 0
        r = _read(s, path, len(payload))
        a = s.alloc(8192)
        assert r.device == 0 and a.device == 0, "Refs name the device as this process numbers it"
        assert bytes(s.host_buffer(r)) == payload
        # The daemon hands the slab over on its own ordinal: mapped on ours.
        assert s.slab_info(r.slab).device == 1
        assert s._local_device(1) == 0
        s.release([r, a])
    assert fake.wire() == [("READ", 1), ("ALLOC", 1)]


@contextmanager
def _fake_cuda_import(monkeypatch: pytest.MonkeyPatch, session: gdsfs.Session, daemon_device: int, kind: int) -> Iterator[list[tuple[str, int]]]:
    """_tensors._slab_tensor's CUDA import of a slab the daemon says lies on daemon_device,
    with the driver and torch.cuda calls it makes faked: yields (call, device) of each."""
    calls: list[tuple[str, int]] = []
    desc = proto.SlabDesc(slab=1 << 40, size=4096, map_offset=0, kind=kind, device=daemon_device, handle=b"\0" * 64 if kind == proto.SLAB_KIND_CUDA else b"")
    monkeypatch.setattr(session, "slab_info", lambda slab: desc)
    monkeypatch.setattr(session, "slab_fd", lambda slab: (os.open(os.devnull, os.O_RDONLY), 4096))
    fake_cuda = types.SimpleNamespace(
        import_fd=lambda fd, n, dev: calls.append(("import_fd", dev)) or types.SimpleNamespace(ptr=1 << 20),
        open_ipc_handle=lambda h, dev: calls.append(("open_ipc_handle", dev)) or (1 << 20),
        CudaArray=lambda ptr, n, owner=None: object(),
    )
    monkeypatch.setitem(sys.modules, "gdsfs._cuda", fake_cuda)
    monkeypatch.setattr(gdsfs, "_cuda", fake_cuda, raising=False)

    @contextmanager
    def device(d: int) -> Iterator[None]:
        calls.append(("torch.cuda.device", d))
        yield

    monkeypatch.setattr(torch.cuda, "init", lambda: None)
    monkeypatch.setattr(torch.cuda, "device", device)
    monkeypatch.setattr(torch, "as_tensor", lambda arr, device=None: calls.append(("as_tensor", device.index)) or torch.zeros(4096, dtype=torch.uint8))
    monkeypatch.setattr(_core, "_slabs", _core._ProcessSlabs())
    yield calls


@pytest.mark.parametrize("kind", [proto.SLAB_KIND_CUDA_FD, proto.SLAB_KIND_CUDA])
@pytest.mark.parametrize("daemon, local, on_daemon, want", [
    ([A, B], [B], 1, 0),  # the client's cuda:0 is the daemon's device 1
    ([A, B], [A, B], 1, 1),  # the same view: as before
    ([A, B], [B, A], 0, 1),  # another order
])
def test_slabs_are_imported_on_this_processs_ordinal_of_their_gpu(gdsfs_mount, monkeypatch, tmp_path, kind, daemon, local, on_daemon, want) -> None:
    FakeGPUs(monkeypatch, str(tmp_path / "log"), daemon, local)
    with gdsfs.Session(gdsfs_mount.mnt) as s:
        with _fake_cuda_import(monkeypatch, s, on_daemon, kind) as calls:
            _tensors._slab_tensor(s, 1 << 40)
    assert calls and {d for _, d in calls} == {want}, calls


def test_an_old_daemon_keeps_ordinals_as_they_are(gdsfs_mount, data, monkeypatch, tmp_path) -> None:
    """A daemon that does not publish UUIDs: today's behaviour, and no CUDA asked for them."""
    path, payload = data
    fake = FakeGPUs(monkeypatch, str(tmp_path / "log"), [A, B], [B], publish=False)
    with gdsfs.Session(gdsfs_mount.mnt, device=0) as s:
        r = _read(s, path, len(payload))
        assert r.device == 0 and bytes(s.host_buffer(r)) == payload
        assert s._local_device(1) == 1
        s.release([r])
        with _fake_cuda_import(monkeypatch, s, 1, proto.SLAB_KIND_CUDA_FD) as calls:
            _tensors._slab_tensor(s, 1 << 40)
        assert {d for _, d in calls} == {1}
    assert fake.wire() == [("READ", 0)]
    assert fake.lines("LOCAL") == [], "asked this process's CUDA for UUIDs no daemon publishes"
    assert gdsfs.capabilities(path).device_uuids == []


def test_a_process_that_cannot_tell_its_uuids_keeps_ordinals(gdsfs_mount, data, monkeypatch, tmp_path) -> None:
    path, payload = data
    fake = FakeGPUs(monkeypatch, str(tmp_path / "log"), [A, B], None)
    with gdsfs.Session(gdsfs_mount.mnt, device=1) as s:
        s.release([_read(s, path, len(payload))])
    assert fake.wire() == [("READ", 1)]


# -- a GPU the daemon does not serve -------------------------------------------------------------


WRONG_GPU = (r"^gdsfs: cuda:0 \(GPU-cccccccc-0000-1111-2222-333333333333\) is not one of the gdsfs daemon's GPUs at .+ "
             r"\(GPU-aaaaaaaa-0000-1111-2222-333333333333, GPU-bbbbbbbb-0000-1111-2222-333333333333\): "
             r"start the daemon with that GPU visible, or pass device='cpu'$")


def test_a_gpu_the_daemon_does_not_serve_is_named_in_one_line(gdsfs_mount, data, datasets, monkeypatch, tmp_path) -> None:
    path, payload = data
    fake = FakeGPUs(monkeypatch, str(tmp_path / "log"), [A, B], [C])
    with pytest.raises(gdsfs.GDSUnavailableError, match=WRONG_GPU) as ei:
        gdsfs.Session(gdsfs_mount.mnt, device=0)
    assert ei.value.errno == errno.ENODEV
    # As for a device the daemon has no slabs on: Session.open falls back (strict raises).
    with pytest.warns(gdsfs.GDSFallbackWarning, match="is not one of the gdsfs daemon's GPUs"):
        assert gdsfs.Session.open(path, device=0) is None
    with pytest.raises(gdsfs.GDSUnavailableError, match="is not one of the gdsfs daemon's GPUs"):
        gdsfs.Session.open(path, device=0, strict=True)
    # The default device is this process's cuda:0 too: a read refuses before asking the daemon.
    with gdsfs.Session(gdsfs_mount.mnt) as s:
        with pytest.raises(gdsfs.GDSUnavailableError, match=WRONG_GPU):
            _read(s, path, len(payload))
    # The dataset refuses at construction, as for a device the daemon lacks.
    with pytest.raises(RuntimeError, match=WRONG_GPU):
        gt.GDSShardDataset(datasets.wds_shards()[:1], gpu_keys=["x.npy"], device="cuda:0")
    assert fake.wire() == [], "a request reached the daemon for a GPU it does not serve"


def test_a_load_onto_a_gpu_the_daemon_does_not_serve_reads_with_plain_reads(gdsfs_mount, monkeypatch, tmp_path) -> None:
    """safetensors and checkpoint loads go through one transfer: where the daemon cannot serve
    (here: this process's GPU is not the daemon's) it warns once, naming why, and reads plainly."""
    p = gdsfs_mount.path("devuuid.safetensors")
    want = {"w": torch.arange(5000, dtype=torch.float32)}
    gst.save_file(want, p)
    try:
        FakeGPUs(monkeypatch, str(tmp_path / "log"), [A, B], [C])
        with pytest.warns(gdsfs.GDSFallbackWarning, match="is not one of the gdsfs daemon's GPUs"):
            got = gst.load_file(p, device="cpu")
        assert torch.equal(got["w"], want["w"])
        with pytest.raises(gdsfs.GDSUnavailableError, match="is not one of the gdsfs daemon's GPUs"):
            gst.load_file(p, device="cpu", strict=True)
    finally:
        os.unlink(p)


# -- DataLoader workers and pickles ----------------------------------------------------------------


def _as_list(batch: list) -> list:
    return batch


def test_dataloader_workers_read_with_the_translation_their_dataset_carries(datasets, monkeypatch, tmp_path) -> None:
    """The workers never ask CUDA (and never could): the dataset resolved the translation where
    it was made, and its session carries it to them."""
    fake = FakeGPUs(monkeypatch, str(tmp_path / "log"), [A, B], [B])
    ds = gt.GDSShardDataset(datasets.wds_shards()[:2], gpu_keys=["x.npy"])
    try:
        dl = torch.utils.data.DataLoader(ds, batch_size=4, num_workers=2, collate_fn=_as_list)
        seen = 0
        for batch in dl:
            for sample in batch:
                tr = sample["x.npy"]
                assert tr.ref.device == 0, "a worker's Ref names the daemon's ordinal"
                raw = bytes(ds.session.host_buffer(tr.ref))[tr.start : tr.start + tr.nbytes]
                got = np.frombuffer(raw, dtype=np.float32).reshape(tr.shape)
                np.testing.assert_array_equal(got, datasets.wds[sample["__key__"]]["x.npy"])
                ds.session.release([tr.ref])
                seen += 1
        assert seen == 26
    finally:
        ds.close()
    me = str(os.getpid())
    reads = [w for w in fake.lines("WIRE") if w[1] in ("READ", "READ_NAMES")]
    assert reads and all(w[2] == "1" for w in reads), reads
    assert any(w[3] != me for w in reads), "no worker read"
    assert {w[1] for w in fake.lines("LOCAL")} == {me}, "a DataLoader worker asked CUDA for UUIDs"


def test_a_pickled_session_carries_the_translation(gdsfs_mount, data, monkeypatch, tmp_path) -> None:
    path, payload = data
    fake = FakeGPUs(monkeypatch, str(tmp_path / "log"), [A, B], [B])
    with gdsfs.Session(gdsfs_mount.mnt) as s:
        copy = pickle.loads(pickle.dumps(s))  # a spawned worker's copy: not the opener
        assert fake.lines("LOCAL"), "pickling did not resolve the translation where CUDA is"
        calls = len(fake.lines("LOCAL"))
        r = _read(copy, path, len(payload))
        assert r.device == 0 and bytes(s.host_buffer(r)) == payload
        s.release([r])
        # A copy that was handed no translation (made before it was resolved) keeps ordinals.
        state = s.__getstate__()
        del state["devmap"]
        bare = gdsfs.Session.__new__(gdsfs.Session)
        bare.__setstate__(state)
        s.release([_read(bare, path, len(payload))])
        assert len(fake.lines("LOCAL")) == calls, "a copy that is not the opener asked CUDA"
    assert fake.wire() == [("READ", 1), ("READ", 0)]


# -- the pieces ------------------------------------------------------------------------------------


@pytest.mark.parametrize("spelling", [
    "GPU-4a8c2a6e-0123-4567-89ab-cdeffedcba98", "gpu-4A8C2A6E-0123-4567-89AB-CDEFFEDCBA98",
    "4a8c2a6e-0123-4567-89ab-cdeffedcba98", "MIG-4a8c2a6e-0123-4567-89ab-cdeffedcba98",
    bytes.fromhex("4a8c2a6e0123456789abcdeffedcba98"),
])
def test_uuid_spellings_are_one_uuid(spelling) -> None:
    assert _devmap.normalize(spelling) == "4a8c2a6e0123456789abcdeffedcba98"
    assert _devmap.spell(_devmap.normalize(spelling)) == "GPU-4a8c2a6e-0123-4567-89ab-cdeffedcba98"


@pytest.mark.parametrize("bad", ["", "GPU-", "GPU-4a8c2a6e-0123-4567-89ab-cdeffedcba9", "GPU-4a8c2a6e-0123-4567-89ab-cdeffedcba9g", b"\0" * 15, 7])
def test_what_is_not_a_uuid(bad) -> None:
    assert _devmap.normalize(bad) is None


@pytest.mark.parametrize("doc, devices, want", [
    ({"pool": {"devices": [{"device": 1, "uuid": B}, {"device": 0, "uuid": A}]}}, 2, (A, B)),
    ({"pool": {"devices": [{"device": 0}, {"device": 1}]}}, 2, None),  # an older daemon
    ({"pool": {"devices": [{"device": 0, "uuid": A}]}}, 2, None),  # one missing
    ({"pool": {"devices": [{"device": 0, "uuid": A}, {"device": 1, "uuid": A}]}}, 2, None),  # the same GPU twice
    ({"pool": {"devices": [{"device": 0, "uuid": A}, {"device": 0, "uuid": B}]}}, 2, None),
    ({"pool": {"devices": [{"device": True, "uuid": A}]}}, 1, None),
    ({"pool": {"devices": [{"device": 0, "uuid": "GPU-x"}]}}, 1, None),
    ({"pool": {"devices": {}}}, 1, None),
    ({"pool": None}, 1, None),
    ([], 1, None),
])
def test_the_daemons_uuids_from_its_status(doc, devices, want) -> None:
    got = _devmap.uuids_from_status(doc, devices)
    assert got == (None if want is None else tuple(_devmap.normalize(u) for u in want))


class _Props:
    def __init__(self, uuid: Any) -> None:
        if uuid is not None:
            self.uuid = uuid


def _fake_torch_cuda(monkeypatch: pytest.MonkeyPatch, uuids: Sequence[Any]) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: len(uuids))
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda i: _Props(uuids[i]))


def test_this_processs_uuids_come_from_torch_or_the_driver(monkeypatch) -> None:
    _fake_torch_cuda(monkeypatch, ["bbbbbbbb-0000-1111-2222-333333333333"])  # torch spells no prefix
    assert _devmap.local_uuids() == ["bbbbbbbb000011112222333333333333"]
    # A torch without the uuid property (before 2.0): the driver says.
    _fake_torch_cuda(monkeypatch, [None])
    monkeypatch.setattr(_devmap, "_driver_uuids", lambda: ["cccccccc000011112222333333333333"])
    assert _devmap.local_uuids() == ["cccccccc000011112222333333333333"]
    monkeypatch.setenv(_devmap.ENV, "0")
    assert _devmap.local_uuids() is None


def test_workers_and_bad_forks_never_ask_cuda(monkeypatch) -> None:
    def boom(*a: Any) -> Any:
        raise AssertionError("asked CUDA")

    monkeypatch.setattr(torch.cuda, "is_available", boom)
    monkeypatch.setattr(_devmap, "_driver_uuids", boom)
    monkeypatch.setattr(torch.utils.data, "get_worker_info", lambda: object())
    assert _devmap.local_uuids() is None
    monkeypatch.setattr(torch.utils.data, "get_worker_info", lambda: None)
    monkeypatch.setattr(torch.cuda, "_is_in_bad_fork", lambda: True)
    assert _devmap.local_uuids() is None


def test_no_cuda_is_no_translation() -> None:
    if torch.cuda.is_available():
        pytest.skip("needs a machine without CUDA")
    assert not _devmap.local_uuids()
    assert _devmap.resolve("/m", lambda: ("a" * 32,)) is None


def test_no_status_document_breaks_the_uuid_parser() -> None:
    """Whatever a daemon's STATUS holds (another version, a bug), the parser answers a tuple of
    distinct UUIDs, one per device, or None: it never raises."""
    hypothesis = pytest.importorskip("hypothesis")
    st = hypothesis.strategies
    leaf = st.one_of(st.none(), st.booleans(), st.integers(-2, 4), st.sampled_from([A, B, C, "GPU-x", ""]),
                     st.lists(st.sampled_from("GPU-0af9x"), max_size=40).map("".join))
    keys = st.sampled_from(["pool", "devices", "device", "uuid", "x"])
    doc = st.recursive(leaf, lambda kids: st.one_of(st.lists(kids, max_size=4), st.dictionaries(keys, kids, max_size=4)), max_leaves=20)

    @hypothesis.settings(max_examples=300, deadline=None, derandomize=True, database=None)
    @hypothesis.given(doc, st.integers(-1, 3))
    def check(d: Any, devices: int) -> None:
        got = _devmap.uuids_from_status(d, devices)
        assert got is None or (len(got) == devices and len(set(got)) == devices and all(_devmap.normalize(u) == u for u in got))

    check()


def test_a_daemon_restarted_under_the_same_pid_is_asked_for_its_uuids_again(monkeypatch) -> None:
    # A DaemonSet pod restarted with another GPU view, in a fresh pid namespace, often has its
    # old pid: the UUIDs of its first run must not translate devices for the second.
    monkeypatch.setattr(_devmap, "_cache", _devmap._Cache())

    def doc(u: str) -> Any:
        return lambda: {"pool": {"devices": [{"device": 0, "uuid": u}]}}

    assert _devmap.daemon_uuids("/data", 7, 1, doc(A), run="@gdsfs-slabs-7-1") == (_devmap.normalize(A),)
    assert _devmap.daemon_uuids("/data", 7, 1, doc(B), run="@gdsfs-slabs-7-1") == (_devmap.normalize(A),)  # asked once per run
    assert _devmap.daemon_uuids("/data", 7, 1, doc(B), run="@gdsfs-slabs-7-2") == (_devmap.normalize(B),)
