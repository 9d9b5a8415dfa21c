"""CUDA IPC through ctypes on libcuda.so.1 (no cupy, no cuda-python).

PyTorch has no public call to open a raw cudaIpcMemHandle, so gdsfs opens
the daemon's slab handles with the driver API and wraps the pointer as a
tensor through __cuda_array_interface__. Call only after torch initialised
CUDA in this process: the handle is opened in the device's primary context,
the one PyTorch's runtime uses.
"""

from __future__ import annotations

import ctypes
import threading
from typing import Any, Optional

__all__ = ["open_ipc_handle", "CudaArray"]

CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS = 1


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
        self.lock = threading.Lock()
        self.ctx: dict[int, ctypes.c_void_p] = {}
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
        return ctx


_driver: list[Optional[_Driver]] = [None]
_driver_lock = threading.Lock()


def _get_driver() -> _Driver:
    with _driver_lock:
        if _driver[0] is None:
            _driver[0] = _Driver()
        return _driver[0]


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
