"""Mapping the daemon's CUDA slabs through ctypes on libcuda.so.1 (no cupy,
no cuda-python).

Two kinds of slab (docs/protocol.md, SLAB):

- CUDA virtual memory (kind 3, the default): the daemon hands this process,
  and only a process of the session's uid, a POSIX file descriptor of the
  allocation over its slab socket; import_fd imports and maps it
  (cuMemImportFromShareableHandle, cuMemAddressReserve, cuMemMap,
  cuMemSetAccess). The physical memory stays allocated, with its bytes,
  until this process unmaps it (VmmMapping.close, or when the last tensor
  over it is freed), even after the daemon freed the slab.
- Legacy CUDA IPC (kind 2, drivers without VMM only): a 64-byte handle,
  opened with cuIpcOpenMemHandle. Whoever knows its bytes can open it.

Either way the pointer is wrapped as a tensor through
__cuda_array_interface__. Call only after torch initialised CUDA in this
process: memory is mapped in the device's primary context, the one
PyTorch's runtime uses.
"""

from __future__ import annotations

import ctypes
import functools
import threading
from typing import Any

__all__ = ["open_ipc_handle", "import_fd", "device_uuids", "VmmMapping", "CudaArray"]

CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS = 1
CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR = 1
CU_MEM_LOCATION_TYPE_DEVICE = 1
CU_MEM_ACCESS_FLAGS_PROT_READWRITE = 3


class _MemAccessDesc(ctypes.Structure):
    # CUmemAccessDesc: CUmemLocation {type, id}, flags (12 bytes).
    _fields_ = [("loc_type", ctypes.c_int), ("loc_id", ctypes.c_int), ("flags", ctypes.c_int)]


class _IpcMemHandle(ctypes.Structure):
    # Passed by value: a 64-byte struct (a c_char array fails with
    # CUDA_ERROR_INVALID_VALUE).
    _fields_ = [("reserved", ctypes.c_ubyte * 64)]


class _Driver:
    def __init__(self) -> None:
        try:
            lib = ctypes.CDLL("libcuda.so.1")
        except OSError as e:
            raise RuntimeError(f"gdsfs: libcuda.so.1 is not loadable ({e}): install the NVIDIA driver or use a host-mode mount") from e
        self.lib = lib
        lib.cuInit.argtypes = [ctypes.c_uint]
        lib.cuGetErrorName.argtypes = [ctypes.c_int, ctypes.POINTER(ctypes.c_char_p)]
        lib.cuDeviceGet.argtypes = [ctypes.POINTER(ctypes.c_int), ctypes.c_int]
        lib.cuDevicePrimaryCtxRetain.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.c_int]
        lib.cuCtxPushCurrent_v2.argtypes = [ctypes.c_void_p]
        lib.cuCtxPopCurrent_v2.argtypes = [ctypes.POINTER(ctypes.c_void_p)]
        lib.cuIpcOpenMemHandle_v2.argtypes = [ctypes.POINTER(ctypes.c_uint64), _IpcMemHandle, ctypes.c_uint]
        lib.cuCtxSynchronize.argtypes = []
        # Virtual memory management (CUDA 10.2+); absent on older drivers,
        # whose daemons hand out legacy IPC handles instead.
        self.vmm = hasattr(lib, "cuMemImportFromShareableHandle")
        if self.vmm:
            lib.cuMemImportFromShareableHandle.argtypes = [ctypes.POINTER(ctypes.c_uint64), ctypes.c_void_p, ctypes.c_int]
            lib.cuMemAddressReserve.argtypes = [ctypes.POINTER(ctypes.c_uint64), ctypes.c_size_t, ctypes.c_size_t, ctypes.c_uint64, ctypes.c_ulonglong]
            lib.cuMemAddressFree.argtypes = [ctypes.c_uint64, ctypes.c_size_t]
            lib.cuMemMap.argtypes = [ctypes.c_uint64, ctypes.c_size_t, ctypes.c_size_t, ctypes.c_uint64, ctypes.c_ulonglong]
            lib.cuMemUnmap.argtypes = [ctypes.c_uint64, ctypes.c_size_t]
            lib.cuMemSetAccess.argtypes = [ctypes.c_uint64, ctypes.c_size_t, ctypes.POINTER(_MemAccessDesc), ctypes.c_size_t]
            lib.cuMemRelease.argtypes = [ctypes.c_uint64]
        self.lock = threading.Lock()
        self.ctx: dict[int, ctypes.c_void_p] = {}
        self.dev: dict[int, int] = {}
        # Idempotent; torch has normally called it already.
        self.check(lib.cuInit(0), "cuInit")

    def check(self, rc: int, what: str) -> None:
        if rc != 0:
            name = ctypes.c_char_p()
            self.lib.cuGetErrorName(rc, ctypes.byref(name))
            label = name.value.decode() if name.value else str(rc)
            raise RuntimeError(f"gdsfs: {what} failed: {label}")

    def primary_ctx(self, device: int) -> ctypes.c_void_p:
        ctx = self.ctx.get(device)
        if ctx is None:
            dev = ctypes.c_int()
            self.check(self.lib.cuDeviceGet(ctypes.byref(dev), device), f"cuDeviceGet({device})")
            ctx = ctypes.c_void_p()
            # Retained for the life of the process: PyTorch uses the same
            # primary context, so this costs nothing extra.
            self.check(self.lib.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), dev), f"cuDevicePrimaryCtxRetain({device})")
            self.ctx[device] = ctx
            self.dev[device] = dev.value
        return ctx

    def push(self, device: int) -> None:
        """Make device's primary context current (caller holds lock)."""
        self.check(self.lib.cuCtxPushCurrent_v2(self.primary_ctx(device)), "cuCtxPushCurrent")

    def pop(self) -> None:
        old = ctypes.c_void_p()
        self.lib.cuCtxPopCurrent_v2(ctypes.byref(old))


@functools.lru_cache(maxsize=None)
def _load_driver() -> _Driver:
    return _Driver()


_driver_lock = threading.Lock()


def _get_driver() -> _Driver:
    """The process's one _Driver (libcuda), loaded on first use; a failed load is retried next
    time. The lock makes two threads' first calls build one, not two."""
    with _driver_lock:
        return _load_driver()


def open_ipc_handle(handle: bytes, device: int) -> int:
    """Open a 64-byte CUDA IPC memory handle on device; return the pointer.

    The mapping is never closed: callers cache it per slab for the life of
    the process (CUDA forbids opening one handle twice in a process).
    """
    if len(handle) != 64:
        raise ValueError(f"gdsfs: CUDA IPC handle of {len(handle)} bytes (want 64)")
    d = _get_driver()
    h = _IpcMemHandle()
    ctypes.memmove(ctypes.addressof(h), handle, 64)
    with d.lock:
        ctx = d.primary_ctx(device)
        d.check(d.lib.cuCtxPushCurrent_v2(ctx), "cuCtxPushCurrent")
        try:
            ptr = ctypes.c_uint64()
            d.check(d.lib.cuIpcOpenMemHandle_v2(ctypes.byref(ptr), h, CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS), f"cuIpcOpenMemHandle on device {device}")
        finally:
            old = ctypes.c_void_p()
            d.lib.cuCtxPopCurrent_v2(ctypes.byref(old))
    return int(ptr.value)


def device_uuids() -> list[bytes]:
    """The 16-byte UUID of each CUDA device this process sees, by ordinal (cuDeviceGetUuid_v2,
    the spelling CUDA_VISIBLE_DEVICES and the gdsfs daemon use; cuDeviceGetUuid before CUDA
    11.4). For gdsfs._devmap, where torch does not tell them."""
    d = _get_driver()
    lib = d.lib
    fn = getattr(lib, "cuDeviceGetUuid_v2", None) or getattr(lib, "cuDeviceGetUuid", None)
    if fn is None:
        raise RuntimeError("gdsfs: this NVIDIA driver has no cuDeviceGetUuid: upgrade the driver")
    fn.argtypes = [ctypes.POINTER(ctypes.c_ubyte * 16), ctypes.c_int]
    lib.cuDeviceGetCount.argtypes = [ctypes.POINTER(ctypes.c_int)]
    n = ctypes.c_int()
    d.check(lib.cuDeviceGetCount(ctypes.byref(n)), "cuDeviceGetCount")
    out = []
    for i in range(n.value):
        dev = ctypes.c_int()
        d.check(lib.cuDeviceGet(ctypes.byref(dev), i), f"cuDeviceGet({i})")
        u = (ctypes.c_ubyte * 16)()
        d.check(fn(ctypes.byref(u), dev), f"cuDeviceGetUuid({i})")
        out.append(bytes(u))
    return out


class VmmMapping:
    """An imported CUDA virtual-memory allocation mapped at ptr (nbytes).

    close() (or garbage collection, once no tensor uses it) unmaps it; the
    physical memory is freed when the daemon and every importer let go.
    """

    def __init__(self, ptr: int, nbytes: int, device: int) -> None:
        self.ptr = ptr
        self.nbytes = nbytes
        self.device = device
        self._closed = False

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        d = _get_driver()
        with d.lock:
            d.push(self.device)
            try:
                # Work still reading or writing the mapping (a copy queued
                # on some stream) must finish before it goes.
                d.lib.cuCtxSynchronize()
                d.check(d.lib.cuMemUnmap(self.ptr, self.nbytes), "cuMemUnmap")
                d.check(d.lib.cuMemAddressFree(self.ptr, self.nbytes), "cuMemAddressFree")
            finally:
                d.pop()

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:  # interpreter shutdown, driver gone: nothing to do
            pass


def import_fd(fd: int, nbytes: int, device: int) -> VmmMapping:
    """Import the CUDA virtual-memory allocation behind fd (a POSIX file
    descriptor the daemon's slab socket handed us) and map nbytes of it
    read-write on device. fd may be closed afterwards."""
    d = _get_driver()
    if not d.vmm:
        raise RuntimeError("gdsfs: this NVIDIA driver lacks CUDA virtual memory management (cuMemImportFromShareableHandle): upgrade the driver")
    with d.lock:
        d.push(device)
        try:
            h = ctypes.c_uint64()
            # The descriptor travels by value in the void* osHandle argument.
            d.check(d.lib.cuMemImportFromShareableHandle(ctypes.byref(h), ctypes.c_void_p(fd), CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR), "cuMemImportFromShareableHandle")
            try:
                ptr = ctypes.c_uint64()
                d.check(d.lib.cuMemAddressReserve(ctypes.byref(ptr), nbytes, 0, 0, 0), "cuMemAddressReserve")
                try:
                    d.check(d.lib.cuMemMap(ptr.value, nbytes, 0, h.value, 0), "cuMemMap")
                    try:
                        acc = _MemAccessDesc(CU_MEM_LOCATION_TYPE_DEVICE, d.dev[device], CU_MEM_ACCESS_FLAGS_PROT_READWRITE)
                        d.check(d.lib.cuMemSetAccess(ptr.value, nbytes, ctypes.byref(acc), 1), f"cuMemSetAccess on device {device}")
                    except BaseException:
                        d.lib.cuMemUnmap(ptr.value, nbytes)
                        raise
                except BaseException:
                    d.lib.cuMemAddressFree(ptr.value, nbytes)
                    raise
            finally:
                # The mapping holds the memory; our handle is not needed.
                d.lib.cuMemRelease(h.value)
        finally:
            d.pop()
    return VmmMapping(int(ptr.value), nbytes, device)


class CudaArray:
    """A byte range of device memory exposed via __cuda_array_interface__,
    for torch.as_tensor(obj, device=...). Keeps owner alive."""

    def __init__(self, ptr: int, nbytes: int, owner: Any = None) -> None:
        self.__cuda_array_interface__ = {
            "shape": (nbytes,),
            "typestr": "|u1",
            "data": (ptr, False),
            "version": 2,
        }
        self.owner = owner
