package cufile

import (
	"encoding/binary"
	"fmt"
	"runtime"
	"unsafe"

	"github.com/ebitengine/purego"
)

// Driver is the loaded CUDA driver API (libcuda.so.1) with the primary
// context of every device retained. All methods are safe for concurrent use:
// each call that needs a context runs on a locked OS thread with the device's
// context made current (CUDA contexts are per OS thread, and Go moves
// goroutines between threads).
type Driver struct {
	lib  *library
	fn   driverFuncs
	vmm  vmmFuncs     // virtual memory management (vmm.go); zero where the driver lacks it
	reg  hostRegFuncs // host memory registration (hostreg.go); zero where the driver lacks it
	ctxs []uintptr    // primary context per device ordinal
	devs []int32      // CUdevice per ordinal
	// uuids is each ordinal's UUID; nil where the driver lacks
	// cuDeviceGetUuid (before CUDA 9.2) or it failed for a device.
	uuids []UUID
}

type driverFuncs struct {
	cuInit, cuDriverGetVersion, cuGetErrorName                       uintptr
	cuDeviceGetCount, cuDeviceGet, cuDeviceGetName                   uintptr
	cuDevicePrimaryCtxRetain, cuCtxSetCurrent, cuCtxSynchronize      uintptr
	cuMemGetInfo, cuMemAlloc, cuMemFree, cuMemsetD8                  uintptr
	cuIpcGetMemHandle, cuMemHostAlloc, cuMemFreeHost                 uintptr
	cuIpcOpenMemHandle, cuIpcCloseMemHandle                          uintptr
	cuMemcpyHtoD, cuMemcpyDtoH, cuMemcpyHtoDAsync, cuMemcpyDtoHAsync uintptr
	cuStreamCreate, cuStreamSynchronize, cuStreamDestroy             uintptr
	cuMemcpyDtoDAsync                                                uintptr // the device tier (tier.go)
	cuDeviceGetUUID                                                  uintptr // optional: 0 on drivers before CUDA 9.2
}

// LoadDriver dlopens libcuda.so.1, initialises the driver and retains the
// primary context of every device. Without the NVIDIA driver it returns a
// *LibraryError; with no device, ErrNoDevice.
func LoadDriver() (*Driver, error) {
	lib, err := openLibrary("libcuda.so.1", "no NVIDIA driver on this host")
	if err != nil {
		return nil, err
	}
	d := &Driver{lib: lib}
	f := &d.fn
	if err := lib.bind(map[string]*uintptr{
		"cuInit": &f.cuInit, "cuDriverGetVersion": &f.cuDriverGetVersion, "cuGetErrorName": &f.cuGetErrorName,
		"cuDeviceGetCount": &f.cuDeviceGetCount, "cuDeviceGet": &f.cuDeviceGet, "cuDeviceGetName": &f.cuDeviceGetName,
		"cuDevicePrimaryCtxRetain": &f.cuDevicePrimaryCtxRetain, "cuCtxSetCurrent": &f.cuCtxSetCurrent,
		"cuCtxSynchronize": &f.cuCtxSynchronize, "cuMemGetInfo_v2": &f.cuMemGetInfo,
		"cuMemAlloc_v2": &f.cuMemAlloc, "cuMemFree_v2": &f.cuMemFree, "cuMemsetD8_v2": &f.cuMemsetD8,
		"cuIpcGetMemHandle":                        &f.cuIpcGetMemHandle,
		"cuIpcOpenMemHandle_v2|cuIpcOpenMemHandle": &f.cuIpcOpenMemHandle, "cuIpcCloseMemHandle": &f.cuIpcCloseMemHandle, "cuMemHostAlloc": &f.cuMemHostAlloc, "cuMemFreeHost": &f.cuMemFreeHost,
		"cuMemcpyHtoD_v2": &f.cuMemcpyHtoD, "cuMemcpyDtoH_v2": &f.cuMemcpyDtoH,
		"cuMemcpyHtoDAsync_v2": &f.cuMemcpyHtoDAsync, "cuMemcpyDtoHAsync_v2": &f.cuMemcpyDtoHAsync,
		"cuStreamCreate": &f.cuStreamCreate, "cuStreamSynchronize": &f.cuStreamSynchronize,
		"cuStreamDestroy_v2|cuStreamDestroy": &f.cuStreamDestroy,
		"cuMemcpyDtoDAsync_v2":               &f.cuMemcpyDtoDAsync,
	}, nil); err != nil {
		return nil, err
	}
	// The _v2 entry point names a MIG instance by its own UUID (the one
	// CUDA_VISIBLE_DEVICES=MIG-... and the runtime's cudaDeviceProp.uuid
	// use); the legacy one is what drivers before CUDA 11.4 have.
	_ = lib.bind(map[string]*uintptr{"cuDeviceGetUuid_v2|cuDeviceGetUuid": &f.cuDeviceGetUUID},
		map[string]bool{"cuDeviceGetUuid_v2|cuDeviceGetUuid": true}) // optional: cannot fail
	d.bindVMM()
	d.bindHostRegister()
	if err := d.check("cuInit", cuCall(f.cuInit, 0)); err != nil {
		return nil, err
	}
	var n int32
	if err := d.check("cuDeviceGetCount", cuCall(f.cuDeviceGetCount, uintptr(unsafe.Pointer(&n)))); err != nil {
		return nil, err
	}
	if n == 0 {
		return nil, ErrNoDevice
	}
	for i := range n {
		var dev int32
		if err := d.check("cuDeviceGet", cuCall(f.cuDeviceGet, uintptr(unsafe.Pointer(&dev)), uintptr(i))); err != nil {
			return nil, err
		}
		var ctx uintptr
		if err := d.check("cuDevicePrimaryCtxRetain", cuCall(f.cuDevicePrimaryCtxRetain, uintptr(unsafe.Pointer(&ctx)), uintptr(dev))); err != nil {
			return nil, err
		}
		d.devs = append(d.devs, dev)
		d.ctxs = append(d.ctxs, ctx)
	}
	d.uuids = d.deviceUUIDs()
	return d, nil
}

// deviceUUIDs asks the driver for every device's UUID; nil when it cannot
// tell them all (then clients keep using ordinals as they are).
func (d *Driver) deviceUUIDs() []UUID {
	if d.fn.cuDeviceGetUUID == 0 {
		return nil
	}
	out := make([]UUID, len(d.devs))
	for i, dev := range d.devs {
		if cuCall(d.fn.cuDeviceGetUUID, uintptr(unsafe.Pointer(&out[i])), uintptr(dev)) != 0 {
			return nil
		}
	}
	return out
}

// UUIDs is every device's UUID by ordinal, or nil when the driver cannot
// tell them (too old). The caller must not modify the slice.
func (d *Driver) UUIDs() []UUID { return d.uuids }

// cuCall invokes a CUresult-returning C function. Like purego.SyscallN it is
// marked uintptrescapes: a Go pointer converted to uintptr in the call
// expression stays valid (and unmoved) for the duration of the call.
//
//go:uintptrescapes
func cuCall(fn uintptr, args ...uintptr) int32 {
	r, _, _ := purego.SyscallN(fn, args...)
	return int32(r)
}

// check turns a failed CUresult into *CUDAError.
func (d *Driver) check(op string, r int32) error {
	if r == 0 {
		return nil
	}
	return d.cudaError(op, int(r))
}

func (d *Driver) cudaError(op string, code int) error {
	e := &CUDAError{Op: op, Code: code}
	if d.fn.cuGetErrorName != 0 {
		var p uintptr
		if r, _, _ := purego.SyscallN(d.fn.cuGetErrorName, uintptr(code), uintptr(unsafe.Pointer(&p))); r == 0 && p != 0 {
			e.Name = goString(p, 64)
		}
	}
	return e
}

// cPointer converts an address of C memory (never Go memory: the garbage
// collector does not track it) to a pointer. The indirection keeps vet's
// uintptr-to-pointer check, which is about Go memory, quiet.
func cPointer(p uintptr) unsafe.Pointer { return *(*unsafe.Pointer)(unsafe.Pointer(&p)) }

// goString copies a NUL-terminated C string of at most max bytes.
func goString(p uintptr, max int) string {
	b := unsafe.Slice((*byte)(cPointer(p)), max)
	for i, c := range b {
		if c == 0 {
			return string(b[:i])
		}
	}
	return string(b)
}

// Devices is the number of CUDA devices.
func (d *Driver) Devices() int { return len(d.ctxs) }

// Do runs fn on a locked OS thread with device's primary context current.
func (d *Driver) Do(device int, fn func() error) error {
	if device < 0 || device >= len(d.ctxs) {
		return fmt.Errorf("cufile: CUDA device %d does not exist (%d present)", device, len(d.ctxs))
	}
	runtime.LockOSThread()
	defer runtime.UnlockOSThread()
	if err := d.check("cuCtxSetCurrent", cuCall(d.fn.cuCtxSetCurrent, d.ctxs[device])); err != nil {
		return err
	}
	return fn()
}

// Version is the driver's CUDA version (1000*major + 10*minor).
func (d *Driver) Version() (int, error) {
	var v int32
	err := d.check("cuDriverGetVersion", cuCall(d.fn.cuDriverGetVersion, uintptr(unsafe.Pointer(&v))))
	return int(v), err
}

// DeviceName is device's marketing name.
func (d *Driver) DeviceName(device int) (string, error) {
	if device < 0 || device >= len(d.devs) {
		return "", fmt.Errorf("cufile: CUDA device %d does not exist", device)
	}
	buf := make([]byte, 256)
	if err := d.check("cuDeviceGetName", cuCall(d.fn.cuDeviceGetName, uintptr(unsafe.Pointer(&buf[0])), uintptr(len(buf)), uintptr(d.devs[device]))); err != nil {
		return "", err
	}
	return goString(uintptr(unsafe.Pointer(&buf[0])), len(buf)), nil
}

// MemInfo returns device's free and total memory in bytes.
func (d *Driver) MemInfo(device int) (free, total int64, err error) {
	err = d.Do(device, func() error {
		var f, t uint64
		if err := d.check("cuMemGetInfo_v2", cuCall(d.fn.cuMemGetInfo, uintptr(unsafe.Pointer(&f)), uintptr(unsafe.Pointer(&t)))); err != nil {
			return err
		}
		free, total = int64(f), int64(t)
		return nil
	})
	return free, total, err
}

// MemAlloc allocates size bytes of device memory (cuMemAlloc: exportable by
// CUDA IPC, registrable with cuFile).
func (d *Driver) MemAlloc(device int, size int64) (uintptr, error) {
	var p uint64
	err := d.Do(device, func() error {
		return d.check("cuMemAlloc_v2", cuCall(d.fn.cuMemAlloc, uintptr(unsafe.Pointer(&p)), uintptr(size)))
	})
	return uintptr(p), err
}

// MemFree frees device memory from MemAlloc.
func (d *Driver) MemFree(device int, p uintptr) error {
	return d.Do(device, func() error { return d.check("cuMemFree_v2", cuCall(d.fn.cuMemFree, p)) })
}

// Memset sets n bytes at p to v and waits until they are set.
func (d *Driver) Memset(device int, p uintptr, v byte, n int64) error {
	return d.Do(device, func() error {
		if err := d.check("cuMemsetD8_v2", cuCall(d.fn.cuMemsetD8, p, uintptr(v), uintptr(n))); err != nil {
			return err
		}
		return d.check("cuCtxSynchronize", cuCall(d.fn.cuCtxSynchronize))
	})
}

// IPCHandle returns the 64-byte legacy CUDA IPC handle of the allocation at
// p. The handle is a bearer capability: any process that learns its bytes
// can open it; gdsfs uses it only where VMM is unavailable (memory.go).
func (d *Driver) IPCHandle(device int, p uintptr) ([]byte, error) {
	h := make([]byte, 64)
	err := d.Do(device, func() error {
		return d.check("cuIpcGetMemHandle", cuCall(d.fn.cuIpcGetMemHandle, uintptr(unsafe.Pointer(&h[0])), p))
	})
	return h, err
}

// IPCOpen maps the allocation behind a 64-byte CUDA IPC handle exported by
// another process into this one (CUDA refuses handles of this process) and
// returns its device address here. Close it with IPCClose.
func (d *Driver) IPCOpen(device int, handle []byte) (uintptr, error) {
	if len(handle) != 64 {
		return 0, fmt.Errorf("cufile: CUDA IPC handle is %d bytes, want 64", len(handle))
	}
	// cuIpcOpenMemHandle takes the 64-byte CUipcMemHandle by value. The
	// x86-64 System V ABI passes a struct that large in memory, on the stack
	// after the register arguments, and it takes no integer register: so
	// pdptr and Flags fill the first two registers, four unused registers
	// follow, and the handle's eight words go where stack arguments go.
	var w [8]uintptr
	for i := range w {
		w[i] = uintptr(binary.LittleEndian.Uint64(handle[8*i:]))
	}
	const lazyEnablePeerAccess = 0x1 // CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS
	var p uintptr
	err := d.Do(device, func() error {
		return d.check("cuIpcOpenMemHandle", cuCall(d.fn.cuIpcOpenMemHandle,
			uintptr(unsafe.Pointer(&p)), lazyEnablePeerAccess, 0, 0, 0, 0,
			w[0], w[1], w[2], w[3], w[4], w[5], w[6], w[7]))
	})
	return p, err
}

// IPCClose unmaps an address IPCOpen returned.
func (d *Driver) IPCClose(device int, p uintptr) error {
	return d.Do(device, func() error {
		return d.check("cuIpcCloseMemHandle", cuCall(d.fn.cuIpcCloseMemHandle, p))
	})
}

// HostAlloc allocates size bytes of pinned, portable host memory.
func (d *Driver) HostAlloc(device int, size int64) ([]byte, error) {
	var p uintptr
	const portable = 0x01 // CU_MEMHOSTALLOC_PORTABLE: pinned for every context
	err := d.Do(device, func() error {
		return d.check("cuMemHostAlloc", cuCall(d.fn.cuMemHostAlloc, uintptr(unsafe.Pointer(&p)), uintptr(size), portable))
	})
	if err != nil {
		return nil, err
	}
	return unsafe.Slice((*byte)(cPointer(p)), size), nil
}

// HostFree frees memory from HostAlloc.
func (d *Driver) HostFree(device int, b []byte) error {
	if len(b) == 0 {
		return nil
	}
	return d.Do(device, func() error {
		return d.check("cuMemFreeHost", cuCall(d.fn.cuMemFreeHost, uintptr(unsafe.Pointer(&b[0]))))
	})
}

// CopyHtoD copies src to device memory dst and waits.
func (d *Driver) CopyHtoD(device int, dst uintptr, src []byte) error {
	if len(src) == 0 {
		return nil
	}
	return d.Do(device, func() error {
		return d.check("cuMemcpyHtoD_v2", cuCall(d.fn.cuMemcpyHtoD, dst, uintptr(unsafe.Pointer(&src[0])), uintptr(len(src))))
	})
}

// CopyDtoH copies device memory src to dst and waits.
func (d *Driver) CopyDtoH(device int, dst []byte, src uintptr) error {
	if len(dst) == 0 {
		return nil
	}
	return d.Do(device, func() error {
		return d.check("cuMemcpyDtoH_v2", cuCall(d.fn.cuMemcpyDtoH, uintptr(unsafe.Pointer(&dst[0])), src, uintptr(len(dst))))
	})
}

// The calls below run on the caller's thread, which must have called
// SetCurrent (the posix engine's locked workers do).

// SetCurrent makes device's primary context current on the calling OS thread,
// which the caller must have locked.
func (d *Driver) SetCurrent(device int) error {
	if device < 0 || device >= len(d.ctxs) {
		return fmt.Errorf("cufile: CUDA device %d does not exist", device)
	}
	return d.check("cuCtxSetCurrent", cuCall(d.fn.cuCtxSetCurrent, d.ctxs[device]))
}

// StreamCreate creates a non-blocking stream in the current context.
func (d *Driver) StreamCreate() (uintptr, error) {
	var s uintptr
	const nonBlocking = 0x1
	err := d.check("cuStreamCreate", cuCall(d.fn.cuStreamCreate, uintptr(unsafe.Pointer(&s)), nonBlocking))
	return s, err
}

// StreamSync waits for stream's work.
func (d *Driver) StreamSync(s uintptr) error {
	return d.check("cuStreamSynchronize", cuCall(d.fn.cuStreamSynchronize, s))
}

// StreamDestroy destroys stream.
func (d *Driver) StreamDestroy(s uintptr) error {
	return d.check("cuStreamDestroy", cuCall(d.fn.cuStreamDestroy, s))
}

// CopyHtoDAsync enqueues a copy of src (pinned) to dst on stream.
func (d *Driver) CopyHtoDAsync(dst uintptr, src []byte, s uintptr) error {
	if len(src) == 0 {
		return nil
	}
	return d.check("cuMemcpyHtoDAsync_v2", cuCall(d.fn.cuMemcpyHtoDAsync, dst, uintptr(unsafe.Pointer(&src[0])), uintptr(len(src)), s))
}

// CopyDtoHAsync enqueues a copy of device memory src to dst (pinned) on stream.
func (d *Driver) CopyDtoHAsync(dst []byte, src uintptr, s uintptr) error {
	if len(dst) == 0 {
		return nil
	}
	return d.check("cuMemcpyDtoHAsync_v2", cuCall(d.fn.cuMemcpyDtoHAsync, uintptr(unsafe.Pointer(&dst[0])), src, uintptr(len(dst)), s))
}
