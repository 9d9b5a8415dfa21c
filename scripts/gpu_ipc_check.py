#!/usr/bin/env python3
"""Second-process check of a gdsfs slab export.

Usage: gpu_ipc_check.py HANDLE OFFSET LENGTH SHA256_HEX

HANDLE is either fd:N:BYTES, a CUDA virtual-memory allocation's POSIX file
descriptor N inherited from the parent (imported with
cuMemImportFromShareableHandle and mapped, BYTES long), or the hex of a
64-byte legacy CUDA IPC handle (opened with cuIpcOpenMemHandle_v2, passed by
value as a 64-byte c_ubyte struct). Copies LENGTH bytes at OFFSET of the
allocation to the host and compares their SHA-256. Exits 0 when they match.
Needs only libcuda.so.1 (no torch).
"""
import ctypes
import hashlib
import sys


class IpcHandle(ctypes.Structure):
    _fields_ = [("reserved", ctypes.c_ubyte * 64)]


def check(cu, what, rc):
    if rc != 0:
        name = ctypes.c_char_p()
        cu.cuGetErrorName(rc, ctypes.byref(name))
        sys.exit(f"gpu_ipc_check: {what} failed: {name.value.decode() if name.value else rc}")


def main():
    if len(sys.argv) != 5:
        sys.exit(__doc__)
    handle_hex, offset, length, want = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
    cu = ctypes.CDLL("libcuda.so.1")
    if handle_hex.startswith("fd:"):
        return check_fd(cu, handle_hex, offset, length, want)
    raw = bytes.fromhex(handle_hex)
    if len(raw) != 64:
        sys.exit(f"gpu_ipc_check: handle is {len(raw)} bytes, want 64")
    cu.cuIpcOpenMemHandle_v2.argtypes = [ctypes.POINTER(ctypes.c_uint64), IpcHandle, ctypes.c_uint]
    cu.cuMemcpyDtoH_v2.argtypes = [ctypes.c_void_p, ctypes.c_uint64, ctypes.c_size_t]
    cu.cuIpcCloseMemHandle.argtypes = [ctypes.c_uint64]
    check(cu, "cuInit", cu.cuInit(0))
    dev = ctypes.c_int()
    check(cu, "cuDeviceGet", cu.cuDeviceGet(ctypes.byref(dev), 0))
    ctx = ctypes.c_void_p()
    check(cu, "cuDevicePrimaryCtxRetain", cu.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), dev))
    check(cu, "cuCtxSetCurrent", cu.cuCtxSetCurrent(ctx))
    h = IpcHandle()
    ctypes.memmove(h.reserved, raw, 64)
    ptr = ctypes.c_uint64()
    check(cu, "cuIpcOpenMemHandle_v2", cu.cuIpcOpenMemHandle_v2(ctypes.byref(ptr), h, 1))
    buf = (ctypes.c_ubyte * length)()
    check(cu, "cuMemcpyDtoH_v2", cu.cuMemcpyDtoH_v2(buf, ptr.value + offset, length))
    got = hashlib.sha256(bytes(buf)).hexdigest()
    check(cu, "cuIpcCloseMemHandle", cu.cuIpcCloseMemHandle(ptr.value))
    if got != want:
        sys.exit(f"gpu_ipc_check: sha256 {got} != {want}: the second process sees other bytes")
    print(f"gpu_ipc_check: pid-separate process opened the handle, {length} bytes at +{offset} match (sha256 {got[:16]}...)")


class AccessDesc(ctypes.Structure):
    _fields_ = [("loc_type", ctypes.c_int), ("loc_id", ctypes.c_int), ("flags", ctypes.c_int)]


def check_fd(cu, spec, offset, length, want):
    _, fd, nbytes = spec.split(":")
    fd, nbytes = int(fd), int(nbytes)
    u64, sz = ctypes.c_uint64, ctypes.c_size_t
    cu.cuMemImportFromShareableHandle.argtypes = [ctypes.POINTER(u64), ctypes.c_void_p, ctypes.c_int]
    cu.cuMemAddressReserve.argtypes = [ctypes.POINTER(u64), sz, sz, u64, ctypes.c_ulonglong]
    cu.cuMemMap.argtypes = [u64, sz, sz, u64, ctypes.c_ulonglong]
    cu.cuMemSetAccess.argtypes = [u64, sz, ctypes.POINTER(AccessDesc), sz]
    cu.cuMemUnmap.argtypes = [u64, sz]
    cu.cuMemAddressFree.argtypes = [u64, sz]
    cu.cuMemRelease.argtypes = [u64]
    cu.cuMemcpyDtoH_v2.argtypes = [ctypes.c_void_p, u64, sz]
    check(cu, "cuInit", cu.cuInit(0))
    dev = ctypes.c_int()
    check(cu, "cuDeviceGet", cu.cuDeviceGet(ctypes.byref(dev), 0))
    ctx = ctypes.c_void_p()
    check(cu, "cuDevicePrimaryCtxRetain", cu.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), dev))
    check(cu, "cuCtxSetCurrent", cu.cuCtxSetCurrent(ctx))
    h = u64()
    check(cu, "cuMemImportFromShareableHandle", cu.cuMemImportFromShareableHandle(ctypes.byref(h), ctypes.c_void_p(fd), 1))
    ptr = u64()
    check(cu, "cuMemAddressReserve", cu.cuMemAddressReserve(ctypes.byref(ptr), nbytes, 0, 0, 0))
    check(cu, "cuMemMap", cu.cuMemMap(ptr.value, nbytes, 0, h.value, 0))
    acc = AccessDesc(1, dev.value, 3)
    check(cu, "cuMemSetAccess", cu.cuMemSetAccess(ptr.value, nbytes, ctypes.byref(acc), 1))
    check(cu, "cuMemRelease", cu.cuMemRelease(h.value))
    buf = (ctypes.c_ubyte * length)()
    check(cu, "cuMemcpyDtoH_v2", cu.cuMemcpyDtoH_v2(buf, ptr.value + offset, length))
    got = hashlib.sha256(bytes(buf)).hexdigest()
    check(cu, "cuMemUnmap", cu.cuMemUnmap(ptr.value, nbytes))
    check(cu, "cuMemAddressFree", cu.cuMemAddressFree(ptr.value, nbytes))
    if got != want:
        sys.exit(f"gpu_ipc_check: sha256 {got} != {want}: the second process sees other bytes")
    print(f"gpu_ipc_check: pid-separate process imported the VMM descriptor, {length} bytes at +{offset} match (sha256 {got[:16]}...)")


if __name__ == "__main__":
    main()
