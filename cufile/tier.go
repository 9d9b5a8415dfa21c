package cufile

import (
	"context"
	"fmt"

	"golang.org/x/sys/unix"

	"github.com/gdsfs/gdsfs/gpubuf"
)

// The daemon's memory tier (package tier) keeps file extents in memory
// this file allocates, and has hits copied into slabs by CopyIn: on a GPU
// machine the extents are pinned host memory (cuMemHostAlloc, portable to
// every device's context; registered after the fill where the driver
// can, hostreg.go) and a hit is one DMA host-to-device copy per
// extent, no CPU copy; with the host backend the extents are plain memory
// (the tier's own) and a hit is a memcpy. Tier memory is not
// cuFileBufRegister'ed: no cuFile call reads or writes it (pins fill it with
// pread from the page cache, hits drain it with cuMemcpyHtoD), and a
// registration would only pin it a second time.

// TierPinned reports whether the tier's memory should be pinned host
// memory from TierAlloc: the slab backend is CUDA.
func (e *Engines) TierPinned() bool {
	return e.drv != nil && e.backend != nil && e.backend.Name() == "cuda"
}

// TierAlloc allocates n bytes of host memory for the tier: anonymous
// memory to TierSeal once filled where the driver registers host memory
// (TierSealed, hostreg.go), else pinned memory (cuMemHostAlloc).
func (e *Engines) TierAlloc(n int64) ([]byte, error) {
	if e.drv == nil {
		return nil, fmt.Errorf("cufile: pinned tier memory needs a GPU")
	}
	if e.TierSealed() {
		return mapAnon(n)
	}
	return e.drv.HostAlloc(0, n)
}

// TierFree frees memory from TierAlloc, sealed or not. Memory the driver
// fails to unregister is left mapped (its pages may still be pinned for
// DMA): a leak, never a reuse of pinned addresses.
func (e *Engines) TierFree(b []byte) error {
	if e.drv == nil {
		return fmt.Errorf("cufile: pinned tier memory needs a GPU")
	}
	if !e.TierSealed() {
		return e.drv.HostFree(0, b)
	}
	if _, err := e.drv.HostUnregister(b); err != nil {
		return fmt.Errorf("cufile: unpin %d bytes of tier memory (left mapped): %w", len(b), err)
	}
	if err := unix.Munmap(b); err != nil {
		return fmt.Errorf("cufile: munmap tier memory: %w", err)
	}
	return nil
}

// CopyIn copies src (host memory; pinned for a DMA) into slab memory dst
// at dstOff: cuMemcpyHtoDAsync on a pooled stream, waited for, into CUDA
// slabs (tierstreams.go), memcpy into host slabs. It implements the tier's
// Copier; concurrent calls overlap.
func (e *Engines) CopyIn(ctx context.Context, dst gpubuf.Memory, dstOff int64, src []byte) error {
	if dstOff < 0 || dstOff+int64(len(src)) > dst.Size() {
		return fmt.Errorf("cufile: copy of %d bytes at %d into a %d-byte slab: %w", len(src), dstOff, dst.Size(), ErrRange)
	}
	if err := ctx.Err(); err != nil {
		return err
	}
	if hm, ok := dst.(gpubuf.HostMemory); ok {
		copy(hm.HostBytes()[dstOff:], src)
		return nil
	}
	dm, ok := dst.(gpubuf.DeviceMemory)
	if !ok || e.drv == nil {
		return fmt.Errorf("cufile: tier copy into %T: neither host nor CUDA memory", dst)
	}
	if err := e.copyHtoDStream(dm.Device(), dm.DevicePtr()+uintptr(dstOff), src); err != nil {
		return fmt.Errorf("cufile: tier copy to device %d: %w", dm.Device(), err)
	}
	return nil
}

// The device tier (gdsfs mount --gpu-cache): copies of pinned files in
// each GPU's own memory, served device to device.

// deviceExtent is device-tier memory: one cuMemAlloc on one device.
type deviceExtent struct {
	d      *Driver
	device int
	ptr    uintptr
}

func (m deviceExtent) Ptr() uintptr { return m.ptr }
func (m deviceExtent) Close() error { return m.d.MemFree(m.device, m.ptr) }

// AllocDevice allocates n bytes on device for the device tier; the result
// has Ptr() and Close() (the tier's DeviceMemory).
func (e *Engines) AllocDevice(device int, n int64) (interface {
	Ptr() uintptr
	Close() error
}, error) {
	if e.drv == nil {
		return nil, fmt.Errorf("cufile: the device tier needs a GPU")
	}
	p, err := e.drv.MemAlloc(device, n)
	if err != nil {
		return nil, err
	}
	return deviceExtent{d: e.drv, device: device, ptr: p}, nil
}

// HostToDevice copies src (pinned host memory) to device memory dst, on a
// pooled stream of device (tierstreams.go), and waits.
func (e *Engines) HostToDevice(ctx context.Context, device int, dst uintptr, src []byte) error {
	if e.drv == nil {
		return fmt.Errorf("cufile: the device tier needs a GPU")
	}
	if err := ctx.Err(); err != nil {
		return err
	}
	if err := e.copyHtoDStream(device, dst, src); err != nil {
		return fmt.Errorf("cufile: device tier fill on device %d: %w", device, err)
	}
	return nil
}

// DeviceToSlab copies n bytes of device memory src into the CUDA slab dst
// at dstOff, on dst's device, on a pooled stream of it (tierstreams.go: the
// copies of concurrent reads overlap), and waits.
func (e *Engines) DeviceToSlab(ctx context.Context, dst gpubuf.Memory, dstOff int64, src uintptr, n int64) error {
	dm, ok := dst.(gpubuf.DeviceMemory)
	if !ok || e.drv == nil {
		return fmt.Errorf("cufile: device copy into %T: not CUDA memory", dst)
	}
	if dstOff < 0 || n < 0 || dstOff+n > dst.Size() {
		return fmt.Errorf("cufile: device copy of %d bytes at %d into a %d-byte slab: %w", n, dstOff, dst.Size(), ErrRange)
	}
	if err := ctx.Err(); err != nil {
		return err
	}
	if err := e.copyDtoDStream(dm.Device(), dm.DevicePtr()+uintptr(dstOff), src, n); err != nil {
		return fmt.Errorf("cufile: device tier copy on device %d: %w", dm.Device(), err)
	}
	return nil
}

// CopyDtoDAsync enqueues a copy of n bytes of device memory src to dst on
// stream s (the calling thread's context current: Driver.Do).
func (d *Driver) CopyDtoDAsync(dst, src uintptr, n int64, s uintptr) error {
	if n == 0 {
		return nil
	}
	return d.check("cuMemcpyDtoDAsync_v2", cuCall(d.fn.cuMemcpyDtoDAsync, dst, src, uintptr(n), s))
}
