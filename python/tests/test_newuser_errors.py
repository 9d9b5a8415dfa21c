"""A new user's common mistakes, each one line naming what is wrong and what to do.

docs/first-hour.md lists them: a mount whose daemon was killed, a truncated safetensors or
torch.save file, a corrupt tar member (also through DataLoader workers), strict=True off a
mount, a lambda collate_fn under spawn, a save into a directory the user cannot write, and a save
onto a full disk.
"""

from __future__ import annotations

import io
import os
import re
import shutil
import signal
import subprocess
import sys
import tarfile
import tempfile
import time
import warnings

import numpy as np
import pytest
import torch

import gdsfs
import gdsfs.checkpoint
import gdsfs.safetensors
import gdsfs.torch as gt
from conftest import mount, unmount

HERE = os.path.dirname(os.path.abspath(__file__))


def one_line(e: BaseException) -> str:
    msg = str(e)
    assert "\n" not in msg and msg.startswith(("gdsfs: ", "[Errno")), msg
    return msg


def npy(a: np.ndarray) -> bytes:
    b = io.BytesIO()
    np.save(b, a)
    return b.getvalue()


def write_tar(path: str, members: dict[str, bytes]) -> None:
    with tarfile.open(path, "w") as tf:
        for name, data in members.items():
            ti = tarfile.TarInfo(name)
            ti.size = len(data)
            tf.addfile(ti, io.BytesIO(data))


def test_strict_off_mount_says_what_to_do(tmp_path) -> None:
    p = tmp_path / "a.tar"
    write_tar(str(p), {"0.x.npy": npy(np.ones(4, np.float32))})
    with pytest.raises(gdsfs.GDSUnavailableError) as ei:
        gt.GDSShardDataset(str(p), gpu_keys=["x.npy"], strict=True)
    msg = one_line(ei.value)
    assert "is not on a gdsfs mount" in msg and "gdsfs mount" in msg.split("mount:")[-1] and "strict=True" in msg, msg


@pytest.mark.parametrize("cut", [4, 20, -3])
def test_truncated_safetensors_names_the_file(gdsfs_mount, cut) -> None:
    good = gdsfs_mount.path("nu-good.safetensors")
    gdsfs.safetensors.save_file({"w": torch.arange(64, dtype=torch.float32)}, good)
    data = open(good, "rb").read()
    bad = gdsfs_mount.path("nu-trunc.safetensors")
    with open(bad, "wb") as f:
        f.write(data[:cut])
    for load in (lambda: gdsfs.safetensors.load_file(bad),
                 lambda: gdsfs.safetensors.safe_open(bad, framework="pt").get_tensor("w")):
        with pytest.raises(ValueError) as ei:
            load()
        msg = one_line(ei.value)
        assert repr(bad) in msg and "truncated or corrupt" in msg and "save it again" in msg, msg


def test_truncated_checkpoint_names_the_file(gdsfs_mount) -> None:
    good = gdsfs_mount.path("nu-good.pt")
    gdsfs.checkpoint.save({"w": torch.arange(4096, dtype=torch.float32)}, good)
    data = open(good, "rb").read()
    bad = gdsfs_mount.path("nu-trunc.pt")
    with open(bad, "wb") as f:
        f.write(data[: len(data) // 2])
    with pytest.raises(ValueError) as ei:
        gdsfs.checkpoint.load(bad)
    msg = one_line(ei.value)
    assert repr(bad) in msg and "truncated or corrupt" in msg, msg


def _corrupt_npy_shard(d: str) -> str:
    os.makedirs(d, exist_ok=True)
    members = {}
    for i in range(4):
        members[f"{i:03d}.cls"] = b"1"
        members[f"{i:03d}.x.npy"] = b"\x93NUMPY\x01\x00garbage" if i == 2 else npy(np.ones(4, np.float32))
    p = os.path.join(d, "b.tar")
    write_tar(p, members)
    return p


def test_corrupt_member_is_one_line_also_through_workers(gdsfs_mount) -> None:
    p = _corrupt_npy_shard(gdsfs_mount.path("nu-corrupt"))
    with pytest.raises(gt.GDSShardError) as ei:
        list(gt.GDSShardDataset(p, gpu_keys=["x.npy"], keys=["x.npy"]))
    msg = one_line(ei.value)
    assert "gdsfs: gdsfs:" not in msg and "'002'" in msg and repr(p) in msg and "handler='warn_and_skip'" in msg, msg
    # torch re-raises a worker's exception as type(e)(text): it stays a GDSShardError.
    dl = gt.DataLoader(gt.GDSShardDataset(p, gpu_keys=["x.npy"], keys=["x.npy"]), batch_size=2, num_workers=1)
    with pytest.raises(gt.GDSShardError, match="handler='warn_and_skip'"):
        list(dl)


def test_lambda_collate_under_spawn_says_what_to_do(gdsfs_mount, datasets) -> None:
    ds = gt.GDSShardDataset(datasets.wds_shards(), gpu_keys=["x.npy"])
    try:
        dl = gt.DataLoader(ds, batch_size=4, num_workers=1, collate_fn=lambda b: gt.collate(b), multiprocessing_context="spawn")
        with pytest.raises(TypeError) as ei:
            next(iter(dl))
        msg = one_line(ei.value)
        assert "'spawn'" in msg and "collate_fn=" in msg and "<lambda>" in msg and "def at module level" in msg, msg
    finally:
        ds.close()
    assert gdsfs_mount.wait_leases(0) == 0


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to run as another uid")
def test_save_into_a_directory_the_user_cannot_write(tmp_path) -> None:
    d = tempfile.mkdtemp(prefix="gdsfs-nu-perm-", dir="/tmp")
    try:
        os.chmod(d, 0o755)
        code = ("import sys, torch, gdsfs.checkpoint\n"
                "try:\n"
                f"    gdsfs.checkpoint.save({{'w': torch.ones(3)}}, {d!r} + '/c.pt')\n"
                "except PermissionError as e:\n"
                "    print(e)\n")
        env = dict(os.environ, PYTHONPATH=os.path.dirname(HERE), PYTHONWARNINGS="ignore")
        r = subprocess.run(["setpriv", "--reuid=10001", "--regid=10001", "--clear-groups", sys.executable, "-c", code],
                           capture_output=True, text=True, timeout=120, env=env)
        out = r.stdout.strip()
        assert r.returncode == 0 and out, r.stdout + r.stderr
        assert "\n" not in out and f"cannot save '{d}/c.pt'" in out and "no permission to create files in" in out, out
        assert "gdsfs-tmp" not in out, out
    finally:
        shutil.rmtree(d)


@pytest.fixture
def full_disk(tmp_path, gdsfs_bin):
    """A gdsfs mount over an 8 MiB tmpfs."""
    src, mnt = tmp_path / "small-src", tmp_path / "small-mnt"
    src.mkdir()
    mnt.mkdir()
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=8m", "gdsfs-nu-tiny", str(src)], capture_output=True, text=True)
    if r.returncode != 0:
        pytest.skip(f"cannot mount a small tmpfs here: {r.stderr.strip()}")
    try:
        m = mount(gdsfs_bin, str(src), str(mnt), str(tmp_path / "daemon.log"))
        try:
            yield m
        finally:
            unmount(gdsfs_bin, m.mnt)
    finally:
        subprocess.run(["umount", "-l", str(src)], capture_output=True)


@pytest.mark.parametrize("save", ["checkpoint", "safetensors"])
def test_save_onto_a_full_disk(full_disk, save) -> None:
    sd = {"a": torch.ones(4 << 20, dtype=torch.uint8), "b": torch.ones(8 << 20, dtype=torch.uint8)}
    dest = full_disk.path("c.bin")
    fn = gdsfs.checkpoint.save if save == "checkpoint" else gdsfs.safetensors.save_file
    with pytest.raises(OSError) as ei:
        fn(sd, dest)
    msg = one_line(ei.value)
    assert ei.value.errno == 28 and f"cannot save {dest!r}" in msg and "is full" in msg and "free space or save elsewhere" in msg, msg
    assert os.listdir(full_disk.mnt) == []
    assert full_disk.wait_leases(0) == 0


def test_mount_whose_daemon_was_killed(tmp_path, gdsfs_bin) -> None:
    src, mnt = tmp_path / "src", tmp_path / "mnt"
    src.mkdir()
    mnt.mkdir()
    write_tar(str(src / "a.tar"), {"0.x.npy": npy(np.ones(4, np.float32))})
    gdsfs.safetensors.save_file({"w": torch.ones(3)}, str(src / "m.safetensors"))
    r = subprocess.run([gdsfs_bin, "mount", "--source", str(src), "--background", "--log-file", str(tmp_path / "log"), str(mnt)],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    pid = int(re.search(r"daemon pid (\d+)", r.stdout + r.stderr)[1])
    try:
        os.kill(pid, signal.SIGKILL)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            try:
                os.stat(mnt)
            except OSError:
                break
            time.sleep(0.02)
        calls = {
            "dataset": lambda: gt.GDSShardDataset(str(mnt / "a.tar"), gpu_keys=["x.npy"]),
            "dataset of a directory": lambda: gt.GDSShardDataset(str(mnt), gpu_keys=["x.npy"]),
            "load_file": lambda: gdsfs.safetensors.load_file(str(mnt / "m.safetensors")),
            "Session": lambda: gdsfs.Session(str(mnt)),
        }
        for what, call in calls.items():
            with warnings.catch_warnings():
                warnings.simplefilter("error")  # no "not on a gdsfs mount; using plain reads" on the way
                with pytest.raises(gdsfs.GDSUnavailableError) as ei:
                    call()
            msg = one_line(ei.value)
            assert f"the mount at {str(mnt)!r} is not connected" in msg and "gdsfs mount" in msg, (what, msg)
            assert ei.value.errno == 107, (what, ei.value.errno)
    finally:
        # conftest's unmount() sees no mount where stat fails: detach the dead one by name.
        r = subprocess.run([gdsfs_bin, "unmount", "--force", str(mnt)], capture_output=True, text=True, timeout=60)
        if r.returncode != 0:
            subprocess.run(["umount", "-l", str(mnt)], capture_output=True, timeout=60)
    assert str(mnt) not in _mount_points(), "the dead mount is still there"


def _mount_points() -> set[str]:
    with open("/proc/self/mountinfo") as f:
        return {line.split()[4] for line in f}


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to run as another uid")
def test_mount_without_allow_other_as_another_uid(gdsfs_bin) -> None:
    base = tempfile.mkdtemp(prefix="gdsfs-nu-noother-", dir="/tmp")
    src, mnt = os.path.join(base, "src"), os.path.join(base, "mnt")
    os.chmod(base, 0o755)
    os.mkdir(src)
    os.mkdir(mnt)
    write_tar(os.path.join(src, "a.tar"), {"0.x.npy": npy(np.ones(4, np.float32))})
    m = mount(gdsfs_bin, src, mnt, os.path.join(base, "daemon.log"))  # no --allow-other
    try:
        code = ("import gdsfs, gdsfs.torch as gt, gdsfs.safetensors as st\n"
                f"for call in (lambda: gt.GDSShardDataset({mnt!r} + '/a.tar', gpu_keys=['x.npy']),\n"
                f"             lambda: gdsfs.Session({mnt!r}), lambda: st.load_file({mnt!r} + '/m.safetensors')):\n"
                "    try:\n"
                "        call()\n"
                "        print('no error')\n"
                "    except gdsfs.GDSUnavailableError as e:\n"
                "        print(e.errno, e)\n")
        env = dict(os.environ, PYTHONPATH=os.path.dirname(HERE), PYTHONWARNINGS="error")
        r = subprocess.run(["setpriv", "--reuid=10001", "--regid=10001", "--clear-groups", sys.executable, "-c", code],
                           capture_output=True, text=True, timeout=120, env=env)
        lines = r.stdout.splitlines()
        assert r.returncode == 0 and len(lines) == 3, r.stdout + r.stderr
        want = f"13 gdsfs: the gdsfs mount at {mnt!r} refuses uid 10001: it was mounted without --allow-other; "
        assert all(line.startswith(want) and "gdsfs mount --allow-other" in line for line in lines), r.stdout
    finally:
        unmount(gdsfs_bin, m.mnt)
        shutil.rmtree(base, ignore_errors=True)


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to run as another uid")
def test_shards_in_a_directory_the_uid_may_not_open(gdsfs_bin) -> None:
    base = tempfile.mkdtemp(prefix="gdsfs-nu-closed-", dir="/tmp")
    src, mnt = os.path.join(base, "src"), os.path.join(base, "mnt")
    os.chmod(base, 0o755)
    os.mkdir(src, 0o755)
    os.mkdir(mnt)
    os.mkdir(os.path.join(src, "closed"), 0o700)
    write_tar(os.path.join(src, "closed", "a.tar"), {"0.x.npy": npy(np.ones(4, np.float32))})
    m = mount(gdsfs_bin, src, mnt, os.path.join(base, "daemon.log"), "--allow-other")
    try:
        d = os.path.join(mnt, "closed")
        code = ("import gdsfs.torch as gt\n"
                f"for p, bits in (({d!r}, 'r and x'), ({d!r} + '/*.tar', 'r and x'), ({d!r} + '/a.tar', 'x')):\n"
                "    try:\n"
                "        gt.GDSShardDataset(p, gpu_keys=['x.npy'])\n"
                "        print('no error')\n"
                "    except PermissionError as e:\n"
                "        print(bits, '|', e)\n")
        env = dict(os.environ, PYTHONPATH=os.path.dirname(HERE), PYTHONWARNINGS="ignore")
        r = subprocess.run(["setpriv", "--reuid=10001", "--regid=10001", "--clear-groups", sys.executable, "-c", code],
                           capture_output=True, text=True, timeout=120, env=env)
        lines = r.stdout.splitlines()
        assert r.returncode == 0 and len(lines) == 3, r.stdout + r.stderr
        for line in lines:
            bits, msg = line.split(" | ", 1)
            assert f"directory {d!r} is not open to uid 10001 (it needs {bits})" in msg and "does not exist" not in msg, line
    finally:
        unmount(gdsfs_bin, m.mnt)
        shutil.rmtree(base, ignore_errors=True)


@pytest.mark.parametrize("kw", ["gpu_keys", "keys"])
def test_a_string_for_a_list_of_fields(datasets, kw) -> None:
    with pytest.raises(TypeError) as ei:
        gt.GDSShardDataset(datasets.wds_shards(), **{kw: "x.npy"})
    msg = one_line(ei.value)
    assert msg == f"gdsfs: {kw}='x.npy' is a string, not a list of field names: pass {kw}=['x.npy']", msg


def test_save_onto_a_read_only_mount(tmp_path, gdsfs_bin) -> None:
    src, mnt = tmp_path / "ro-src", tmp_path / "ro-mnt"
    src.mkdir()
    mnt.mkdir()
    m = mount(gdsfs_bin, str(src), str(mnt), str(tmp_path / "daemon.log"), "--read-only")
    try:
        for save in (gdsfs.checkpoint.save, gdsfs.safetensors.save_file):
            dest = os.path.join(m.mnt, "c.bin")
            with pytest.raises(OSError) as ei:
                save({"a": torch.ones(3)}, dest)
            msg = one_line(ei.value)
            assert ei.value.errno == 30 and f"cannot save {dest!r}" in msg and "read-only" in msg and "save elsewhere" in msg, msg
    finally:
        unmount(gdsfs_bin, m.mnt)


@pytest.mark.parametrize("device", ["meta", torch.device("meta")])
def test_dataset_device_that_is_neither_cpu_nor_cuda(datasets, device) -> None:
    with pytest.raises(ValueError) as ei:
        gt.GDSShardDataset(datasets.wds_shards(), gpu_keys=["x.npy"], device=device)
    msg = one_line(ei.value)
    assert "CPU or CUDA memory only" in msg and "device='cpu'" in msg, msg


def test_checkpoint_load_of_a_safetensors_file(gdsfs_mount) -> None:
    p = gdsfs_mount.path("nu-model.safetensors")
    gdsfs.safetensors.save_file({"w": torch.ones(8)}, p)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no "needs torch.load ... using plain reads" first
        with pytest.raises(ValueError) as ei:
            gdsfs.checkpoint.load(p)
    msg = one_line(ei.value)
    assert msg == f"gdsfs: {p!r} is a safetensors file, not a torch.save archive: load it with gdsfs.safetensors.load_file", msg
