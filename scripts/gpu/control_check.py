#!/usr/bin/env python3
"""End-to-end check of the gdsfs control path with GPU slabs (docs/protocol.md).

Usage: control_check.py [--device N] MOUNT FILE...

The producer (this process, which never touches CUDA, like a DataLoader
worker) opens MOUNT/.gdsfs, reads random ranges of every FILE into GPU slabs
of device N (default 0) with READ ioctls, and hands the session token and
the lease descriptors to a consumer process (the same script with
--consume), which:

  * maps every slab once (SLAB on its own control file with the producer's
    token; CUDA virtual memory: the slab's descriptor from the daemon's slab
    socket, cuMemImportFromShareableHandle and cuMemMap through ctypes;
    legacy slabs: cuIpcOpenMemHandle_v2), views each lease
    as a torch tensor (zero copy, __cuda_array_interface__) and compares it
    on the GPU with the file's bytes;
  * writes a checkpoint: ALLOC on device 0, fills the lease on the GPU
    (device-to-device copy into the IPC view), WRITE with SYNC into a file on
    the mount, then compares the file's sha256 with the tensor's.

Then the producer checks the leases survived the consumer's exit, releases
them and checks the session holds none. Exits 0 when everything matches.
Needs torch with CUDA (consumer only) and libcuda.so.1. With --device -1 the
same steps run on shared host memory slabs (mmap, no torch): a check of this
script and of the protocol on a machine without a GPU.
"""
import ctypes
import fcntl
import hashlib
import json
import os
import random
import struct
import subprocess
import sys

MAGIC, VERSION = 0x53464447, 1
SIZE_HELLO, SIZE_SLAB, SIZE_ALLOC, SIZE_RELEASE, SIZE_PAGE, SIZE_READ, SIZE_WRITE = 256, 640, 128, 2112, 16320, 12352, 128


def iowr(nr, size):
    return (3 << 30) | (size << 16) | (ord("G") << 8) | nr


CMD_HELLO, CMD_SLAB, CMD_ALLOC = iowr(0x01, SIZE_HELLO), iowr(0x02, SIZE_SLAB), iowr(0x03, SIZE_ALLOC)
CMD_RELEASE, CMD_STATUS = iowr(0x04, SIZE_RELEASE), iowr(0x05, SIZE_PAGE)
CMD_READ, CMD_WRITE = iowr(0x10, SIZE_READ), iowr(0x12, SIZE_WRITE)
CAP_HOST_SLABS, CAP_CUDA_SLABS, SLAB_HOST, SLAB_CUDA, WRITE_SYNC = 1 << 0, 1 << 1, 1, 2, 1
SLAB_CUDA_FD = 3  # CUDA virtual memory: the descriptor comes from the slab socket
LEASE_FMT = "<QQQQQII"  # id, slab, offset, length, valid, engine, reserved


def header(size, token=(0, 0)):
    buf = bytearray(size)
    struct.pack_into("<IHHQQQ", buf, 0, MAGIC, VERSION, 0, token[0], token[1], 0)
    return buf


def ioctl(fd, cmd, buf):
    fcntl.ioctl(fd, cmd, buf, True)
    magic, version = struct.unpack_from("<IH", buf, 0)
    if magic != MAGIC or version != VERSION:
        raise RuntimeError(f"bad reply header {magic:#x} v{version}")
    return buf


def hello(cfd):
    b = ioctl(cfd, CMD_HELLO, header(SIZE_HELLO))
    version, uid, caps, session, secret, max_ranges = struct.unpack_from("<IIQQQI", b, 32)
    devices, max_lease = struct.unpack_from("<IQ", b, 76)
    engine = bytes(b[104:136]).rstrip(b"\0").decode()
    pid, = struct.unpack_from("<I", b, 96)
    sock = bytes(b[168:256]).split(b"\0", 1)[0].decode()
    return {"caps": caps, "token": (session, secret), "max_ranges": max_ranges, "devices": devices,
            "max_lease": max_lease, "engine": engine, "uid": uid, "pid": pid, "slab_socket": sock}


def slab_fd(h, token, slab_id):
    """The slab's descriptor from the slab socket (docs/protocol.md, "Slab
    descriptors"): (fd, bytes to map)."""
    import socket

    s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    addr = h["slab_socket"]
    s.connect("\0" + addr[1:] if addr.startswith("@") else addr)
    pid, _, _ = struct.unpack("3i", s.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, 12))
    if pid != h["pid"]:
        sys.exit(f"control_check: slab socket served by pid {pid}, not the daemon {h['pid']}")
    s.sendall(struct.pack("<IHHQQQQ", MAGIC, 1, 1, token[0], token[1], slab_id, 0))
    msg, fds, _, _ = socket.recv_fds(s, 33, 4)
    s.close()
    magic, _, _, err, _, _, nbytes = struct.unpack("<IHHIIQQ", msg)
    if err or len(fds) != 1:
        sys.exit(f"control_check: slab socket refused slab {slab_id}: errno {err}")
    return fds[0], nbytes


class AccessDesc(ctypes.Structure):
    _fields_ = [("loc_type", ctypes.c_int), ("loc_id", ctypes.c_int), ("flags", ctypes.c_int)]


def vmm_import(cu, fd, nbytes, dev):
    """Map a CUDA virtual-memory descriptor; returns the address."""
    u64, sz = ctypes.c_uint64, ctypes.c_size_t
    cu.cuMemImportFromShareableHandle.argtypes = [ctypes.POINTER(u64), ctypes.c_void_p, ctypes.c_int]
    cu.cuMemAddressReserve.argtypes = [ctypes.POINTER(u64), sz, sz, u64, ctypes.c_ulonglong]
    cu.cuMemMap.argtypes = [u64, sz, sz, u64, ctypes.c_ulonglong]
    cu.cuMemSetAccess.argtypes = [u64, sz, ctypes.POINTER(AccessDesc), sz]
    cu.cuMemRelease.argtypes = [u64]
    h, ptr = u64(), u64()
    for what, rc in (("cuMemImportFromShareableHandle", lambda: cu.cuMemImportFromShareableHandle(ctypes.byref(h), ctypes.c_void_p(fd), 1)),
                     ("cuMemAddressReserve", lambda: cu.cuMemAddressReserve(ctypes.byref(ptr), nbytes, 0, 0, 0)),
                     ("cuMemMap", lambda: cu.cuMemMap(ptr.value, nbytes, 0, h.value, 0)),
                     ("cuMemSetAccess", lambda: cu.cuMemSetAccess(ptr.value, nbytes, ctypes.byref(AccessDesc(1, dev, 3)), 1)),
                     ("cuMemRelease", lambda: cu.cuMemRelease(h.value))):
        r = rc()
        if r != 0:
            sys.exit(f"control_check: {what}: CUresult {r}")
    os.close(fd)
    return ptr.value


def read(fd, token, device, ranges):
    b = header(SIZE_READ, token)
    struct.pack_into("<iII", b, 32, device, 0, len(ranges))
    for i, (off, n) in enumerate(ranges):
        struct.pack_into("<QQ", b, 64 + 16 * i, off, n)
    ioctl(fd, CMD_READ, b)
    count, = struct.unpack_from("<I", b, 32)
    return [struct.unpack_from(LEASE_FMT, b, 64 + 48 * i)[:6] for i in range(count)]


def slab(cfd, token, slab_id):
    b = header(SIZE_SLAB, token)
    struct.pack_into("<Q", b, 32, slab_id)
    ioctl(cfd, CMD_SLAB, b)
    sid, size, map_off, kind, device, hlen = struct.unpack_from("<QQQIiI", b, 32)
    return {"size": size, "map_offset": map_off, "kind": kind, "device": device, "handle": bytes(b[128:128 + hlen])}


def alloc(cfd, token, device, n):
    b = header(SIZE_ALLOC, token)
    struct.pack_into("<iIQ", b, 32, device, 0, n)
    ioctl(cfd, CMD_ALLOC, b)
    return struct.unpack_from(LEASE_FMT, b, 32)[:6]


def write(fd, token, lease_id, lease_off, file_off, n, flags):
    b = header(SIZE_WRITE, token)
    struct.pack_into("<QQQQI", b, 32, lease_id, lease_off, file_off, n, flags)
    ioctl(fd, CMD_WRITE, b)
    written, = struct.unpack_from("<Q", b, 32)
    return written


def release(cfd, ids, token=(0, 0)):
    for i in range(0, len(ids), 256):
        part = ids[i:i + 256]
        b = header(SIZE_RELEASE, token)
        struct.pack_into("<I", b, 32, len(part))
        for j, x in enumerate(part):
            struct.pack_into("<Q", b, 64 + 8 * j, x)
        ioctl(cfd, CMD_RELEASE, b)
        released, = struct.unpack_from("<I", b, 32)
        if released != len(part):
            raise RuntimeError(f"released {released} of {len(part)} leases")


def status(cfd):
    doc, off = b"", 0
    while True:
        b = header(SIZE_PAGE)
        struct.pack_into("<Q", b, 32, off)
        ioctl(cfd, CMD_STATUS, b)
        total, _gen, n = struct.unpack_from("<QQI", b, 32)
        doc += bytes(b[64:64 + n])
        off += n
        if off >= total:
            return json.loads(doc)


def session_leases(st, session):
    """Leases the STATUS document says session holds (0 when not listed)."""
    for s in st["pool"].get("sessions") or []:  # null in daemons before the fix
        if s["session"] == session:
            return s["leases"]
    return 0


def producer(mount, files, device):
    cfd = os.open(os.path.join(mount, ".gdsfs"), os.O_RDONLY)
    h = hello(cfd)
    if device >= 0 and not h["caps"] & CAP_CUDA_SLABS:
        sys.exit(f"control_check: the daemon serves no GPU slabs (engine {h['engine']}); mount on a GPU machine")
    if device < 0 and not h["caps"] & CAP_HOST_SLABS:
        sys.exit("control_check: the daemon serves no host slabs (it has a GPU); give --device 0")
    rng = random.Random(1234)
    work = []
    for path in files:
        size = os.path.getsize(path)
        fd = os.open(path, os.O_RDONLY)
        ranges = [(0, size), (size, 10)]
        for _ in range(40):
            off = rng.randrange(size + 1)
            if rng.random() < 0.3:
                off &= ~4095
            ranges.append((off, rng.randrange(min(4 << 20, size - off + 5000) + 1)))
        leases = read(fd, h["token"], device, ranges)
        os.close(fd)
        for (off, n), (lid, sid, loff, length, valid, engine) in zip(ranges, leases):
            want_valid = max(0, min(n, size - off))
            if length != n or valid != want_valid:
                sys.exit(f"control_check: {path} range ({off},{n}): lease length {length} valid {valid}, want {n} {want_valid}")
            work.append({"file": path, "file_offset": off, "lease": lid, "slab": sid, "offset": loff, "valid": valid, "engine": engine})
    engines = sorted({w["engine"] for w in work if w["valid"]})
    where = "host slabs" if device < 0 else f"GPU {device} slabs"
    print(f"control_check: producer read {len(work)} ranges of {len(files)} files into {where} (engine codes {engines})")
    job = {"mount": mount, "token": list(h["token"]), "leases": work, "device": device}
    r = subprocess.run([sys.executable, __file__, "--consume"], input=json.dumps(job).encode(), timeout=600)
    if r.returncode != 0:
        sys.exit(f"control_check: consumer failed ({r.returncode})")
    # The consumer is gone; its checks ran on leases of this session, which
    # must all still be here.
    held = session_leases(status(cfd), h["token"][0])
    want = sum(1 for w in work if w["lease"])
    if held != want:
        sys.exit(f"control_check: session holds {held} leases after the consumer exited, want {want}")
    release(cfd, [w["lease"] for w in work if w["lease"]])
    left = session_leases(status(cfd), h["token"][0])
    if left:
        sys.exit(f"control_check: {left} leases left after release")
    os.close(cfd)
    print("control_check: PASS")


class IpcHandle(ctypes.Structure):
    _fields_ = [("reserved", ctypes.c_ubyte * 64)]


class CudaView:
    """A zero-copy uint8 view of device memory, for torch.as_tensor."""

    def __init__(self, ptr, n):
        self.__cuda_array_interface__ = {"shape": (n,), "typestr": "|u1", "data": (ptr, False), "version": 3}


def consumer():
    job = json.loads(sys.stdin.read())
    if job["device"] < 0:
        host_consumer(job)
    else:
        cuda_consumer(job)


def host_consumer(job):
    """The consumer's steps on host slabs: mmap each slab once."""
    import mmap

    token, mount = tuple(job["token"]), job["mount"]
    cfd = os.open(os.path.join(mount, ".gdsfs"), os.O_RDONLY)
    hello(cfd)
    maps = {}

    def slab_map(sid):
        if sid not in maps:
            s = slab(cfd, token, sid)
            if s["kind"] != SLAB_HOST:
                sys.exit(f"control_check: slab {sid} is kind {s['kind']}, want host memory")
            fd = os.open(s["handle"].decode(), os.O_RDWR)
            maps[sid] = (mmap.mmap(fd, s["size"] + s["map_offset"]), s["map_offset"])
            os.close(fd)
        return maps[sid]

    checked, cache = 0, {}
    for w in job["leases"]:
        if not w["valid"]:
            continue
        m, base = slab_map(w["slab"])
        if w["file"] not in cache:
            with open(w["file"], "rb") as f:
                cache[w["file"]] = f.read()
        want = cache[w["file"]][w["file_offset"]:w["file_offset"] + w["valid"]]
        if m[base + w["offset"]:base + w["offset"] + w["valid"]] != want:
            sys.exit(f"control_check: {w['file']} range at {w['file_offset']}: bytes differ in the host slab")
        checked += w["valid"]
    print(f"control_check: consumer compared {checked} bytes in host slabs ({len(maps)} slabs)")
    n = 9 * (1 << 20) + 123
    lid, sid, loff, length, valid, _ = alloc(cfd, token, -1, n)
    data = random.Random(7).randbytes(n)
    m, base = slab_map(sid)
    m[base + loff:base + loff + n] = data
    path = os.path.join(mount, "ckpt-host.bin")
    fd = os.open(path, os.O_CREAT | os.O_WRONLY | os.O_TRUNC, 0o644)
    split = n // 3
    write(fd, token, lid, split, split, n - split, 0)
    write(fd, token, lid, 0, 0, split, WRITE_SYNC)
    os.fsync(fd)
    os.close(fd)
    got = subprocess.run(["sha256sum", path], capture_output=True, check=True).stdout.split()[0].decode()
    if got != hashlib.sha256(data).hexdigest():
        sys.exit(f"control_check: checkpoint sha256 {got}, want {hashlib.sha256(data).hexdigest()}")
    release(cfd, [lid], token)
    print(f"control_check: consumer wrote a {n}-byte checkpoint from host memory through WRITE; sha256sum matches")
    for m, _ in maps.values():
        m.close()
    os.close(cfd)


def cuda_consumer(job):
    import torch

    cuda = f"cuda:{job['device']}"
    token = tuple(job["token"])
    mount = job["mount"]
    torch.cuda.init()
    torch.zeros(1, device=cuda)  # the primary context is current from here on
    cu = ctypes.CDLL("libcuda.so.1")
    cu.cuIpcOpenMemHandle_v2.argtypes = [ctypes.POINTER(ctypes.c_uint64), IpcHandle, ctypes.c_uint]
    cu.cuIpcCloseMemHandle.argtypes = [ctypes.c_uint64]
    cu.cuCtxGetCurrent.argtypes = [ctypes.POINTER(ctypes.c_void_p)]
    cur = ctypes.c_void_p()
    if cu.cuCtxGetCurrent(ctypes.byref(cur)) != 0 or not cur.value:
        dev, ctx = ctypes.c_int(), ctypes.c_void_p()
        cu.cuDeviceGet(ctypes.byref(dev), job["device"])
        cu.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), dev)
        cu.cuCtxSetCurrent(ctx)
    # The consumer's own control file: SLAB and ALLOC act on the producer's
    # session through its token.
    cfd = os.open(os.path.join(mount, ".gdsfs"), os.O_RDONLY)
    hi = hello(cfd)
    bases = {}
    opened = []
    imported = []

    def slab_base(sid):
        if sid not in bases:
            s = slab(cfd, token, sid)
            if s["kind"] == SLAB_CUDA_FD:
                fd, nbytes = slab_fd(hi, token, sid)
                ptr = vmm_import(cu, fd, nbytes, job["device"])
                imported.append((ptr, nbytes))
                bases[sid] = ptr + s["map_offset"]
                return bases[sid]
            if s["kind"] != SLAB_CUDA or len(s["handle"]) != 64:
                sys.exit(f"control_check: slab {sid} is kind {s['kind']} with a {len(s['handle'])}-byte handle")
            h = IpcHandle()
            ctypes.memmove(h.reserved, s["handle"], 64)
            ptr = ctypes.c_uint64()
            rc = cu.cuIpcOpenMemHandle_v2(ctypes.byref(ptr), h, 1)  # CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS
            if rc != 0:
                sys.exit(f"control_check: cuIpcOpenMemHandle_v2 of slab {sid}: CUresult {rc}")
            opened.append(ptr.value)
            bases[sid] = ptr.value + s["map_offset"]
        return bases[sid]

    checked = 0
    cache = {}
    for w in job["leases"]:
        if not w["valid"]:
            continue
        view = torch.as_tensor(CudaView(slab_base(w["slab"]) + w["offset"], w["valid"]), device=cuda)
        if w["file"] not in cache:
            with open(w["file"], "rb") as f:
                cache[w["file"]] = f.read()
        data = cache[w["file"]][w["file_offset"]:w["file_offset"] + w["valid"]]
        want = torch.frombuffer(bytearray(data), dtype=torch.uint8).to(cuda)
        if not torch.equal(view, want):
            bad = (view != want).nonzero()[0].item()
            sys.exit(f"control_check: {w['file']} range at {w['file_offset']}: byte {bad} differs on the GPU")
        checked += w["valid"]
    torch.cuda.synchronize()
    print(f"control_check: consumer compared {checked} bytes on the GPU through CUDA views ({len(imported)} slabs imported from descriptors, {len(opened)} by legacy IPC)")

    # Checkpoint write: fill a lease on the GPU, WRITE it, compare sha256.
    n = 9 * (1 << 20) + 123
    lid, sid, loff, length, valid, _ = alloc(cfd, token, job["device"], n)
    gen = torch.Generator(device=cuda).manual_seed(7)
    src = torch.randint(0, 256, (n,), dtype=torch.uint8, device=cuda, generator=gen)
    dst = torch.as_tensor(CudaView(slab_base(sid) + loff, n), device=cuda)
    dst.copy_(src)
    torch.cuda.synchronize()
    path = os.path.join(mount, "ckpt-gpu.bin")
    fd = os.open(path, os.O_CREAT | os.O_WRONLY | os.O_TRUNC, 0o644)
    split = n // 3
    write(fd, token, lid, split, split, n - split, 0)
    write(fd, token, lid, 0, 0, split, WRITE_SYNC)
    os.fsync(fd)
    os.close(fd)
    try:
        host = src.cpu().numpy().tobytes()
    except (ImportError, RuntimeError):  # torch built without numpy
        host = bytes(src.cpu().tolist())
    want = hashlib.sha256(host).hexdigest()
    got = subprocess.run(["sha256sum", path], capture_output=True, check=True).stdout.split()[0].decode()
    if got != want:
        sys.exit(f"control_check: checkpoint sha256 {got}, want {want}")
    release(cfd, [lid], token)
    print(f"control_check: consumer wrote a {n}-byte checkpoint from GPU memory through WRITE; sha256sum matches")
    for p in opened:
        cu.cuIpcCloseMemHandle(p)
    cu.cuMemUnmap.argtypes = [ctypes.c_uint64, ctypes.c_size_t]
    cu.cuMemAddressFree.argtypes = [ctypes.c_uint64, ctypes.c_size_t]
    torch.cuda.synchronize()
    for p, n in imported:
        cu.cuMemUnmap(p, n)
        cu.cuMemAddressFree(p, n)
    os.close(cfd)


if __name__ == "__main__":
    args = sys.argv[1:]
    if args == ["--consume"]:
        consumer()
        sys.exit(0)
    dev = 0
    if args[:1] == ["--device"] and len(args) >= 2:
        try:
            dev = int(args[1])
        except ValueError:
            sys.exit(f"control_check: --device {args[1]}: give -1 (host slabs) or a CUDA device number")
        args = args[2:]
    if len(args) < 2:
        sys.exit(__doc__)
    producer(args[0], args[1:], dev)
