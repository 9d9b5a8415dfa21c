#!/usr/bin/env python3
"""Second-process check of a gdsfs slab export (CUDA IPC).

Usage: gpu_ipc_check.py HANDLE_HEX OFFSET LENGTH SHA256_HEX

Opens the 64-byte CUDA IPC handle with cuIpcOpenMemHandle_v2 through ctypes
(the handle passed by value as a 64-byte c_ubyte struct), copies LENGTH bytes
at OFFSET of the allocation to the host and compares their SHA-256. Exits 0
when they match. Needs only libcuda.so.1 (no torch).
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
    raw = bytes.fromhex(handle_hex)
    if len(raw) != 64:
        sys.exit(f"gpu_ipc_check: handle is {len(raw)} bytes, want 64")
    cu = ctypes.CDLL("libcuda.so.1")
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


if __name__ == "__main__":
    main()
