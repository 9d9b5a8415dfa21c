package cufile

import (
	"context"
	"errors"
	"fmt"
	"os"
	"sync"

	"github.com/gdsfs/gdsfs/gpubuf"
)

// cudaBackend allocates slabs as CUDA virtual-memory allocations
// (cuMemCreate, POSIX file descriptor handles) where the driver and device
// support them, and with cuMemAlloc (legacy IPC handles) otherwise. Both
// are registrable with cuFile and addressable by cuMemcpy*.
type cudaBackend struct {
	d *Driver
	// vmm: slabs are VMM allocations (exported as descriptors on the slab
	// socket). rdma: they are created GPUDirect-RDMA capable.
	vmm, rdma bool
}

// newCUDABackend picks the slab memory kind for every device: VMM when
// each device supports it, legacy cuMemAlloc otherwise. why says which and
// why, for the probe report.
func newCUDABackend(d *Driver) (b *cudaBackend, why string) {
	b = &cudaBackend{d: d, vmm: true, rdma: true}
	for dev := range d.Devices() {
		rdma, err := d.VMMSupport(dev)
		if err == nil {
			err = probeVMM(d, dev, rdma)
		}
		if err != nil {
			b.vmm, b.rdma = false, false
			return b, fmt.Sprintf("legacy CUDA IPC handles (cuMemAlloc): %v; a legacy handle is a bearer capability: any process that learns its 64 bytes can map the slab", err)
		}
		b.rdma = b.rdma && rdma
	}
	return b, fmt.Sprintf("CUDA virtual memory (cuMemCreate, POSIX fd handles handed out on the slab socket to the session's uid only; GPUDirect-RDMA capable: %v)", b.rdma)
}

// probeVMM allocates, exports and frees one granule: attributes can claim
// support that a container's driver setup denies.
func probeVMM(d *Driver, dev int, rdma bool) error {
	g, err := d.VMMGranularity(dev)
	if err != nil {
		return err
	}
	a, err := d.VMMAlloc(dev, g, rdma)
	if err != nil {
		return err
	}
	fd, err := d.VMMExportFD(dev, a.Handle)
	if err == nil {
		os.NewFile(uintptr(fd), "probe").Close()
	}
	return errors.Join(err, d.VMMFree(dev, a))
}

// SlabHandles says how clients map GPU slabs: "vmm", "legacy-ipc", or
// "host" when slabs are host memory.
func (e *Engines) SlabHandles() string {
	b, ok := e.backend.(*cudaBackend)
	switch {
	case !ok:
		return "host"
	case b.vmm:
		return "vmm"
	}
	return "legacy-ipc"
}

var _ gpubuf.Backend = (*cudaBackend)(nil)

func (b *cudaBackend) Name() string { return "cuda" }
func (b *cudaBackend) Devices() int { return b.d.Devices() }

func (b *cudaBackend) Alloc(ctx context.Context, device int, size int64, _ uint32) (gpubuf.Memory, error) {
	if err := ctx.Err(); err != nil {
		return nil, err
	}
	if b.vmm {
		return b.allocVMM(ctx, device, size)
	}
	p, err := b.d.MemAlloc(device, size)
	if err != nil {
		return nil, err
	}
	m := &cudaMemory{d: b.d, device: device, ptr: p, size: size}
	// cuMemAlloc does not zero; the pool's contract is zeroed memory.
	if err := m.Scrub(ctx); err != nil {
		_ = b.d.MemFree(device, p)
		return nil, err
	}
	return m, nil
}

func (b *cudaBackend) allocVMM(ctx context.Context, device int, size int64) (gpubuf.Memory, error) {
	a, err := b.d.VMMAlloc(device, size, b.rdma)
	if err != nil {
		return nil, fmt.Errorf("cufile: allocate %d bytes of CUDA virtual memory on device %d: %w", size, device, err)
	}
	m := &vmmMemory{cudaMemory: cudaMemory{d: b.d, device: device, ptr: a.Ptr, size: size}, alloc: a}
	// cuMemCreate does not zero either, and a client maps every byte of
	// the allocation (its size rounded up to the granularity): zero them all.
	if err := m.Scrub(ctx); err != nil {
		_ = b.d.VMMFree(device, a)
		return nil, err
	}
	return m, nil
}

// cudaMemory is one cuMemAlloc allocation, exported as a legacy CUDA IPC
// handle: a bearer capability (any process that learns the 64 bytes can
// open it, and its mapping dies with the allocation), used only where the
// driver has no VMM. Isolation between uids then rests on gpubuf keeping
// memory per uid for its life and on the handle's bytes staying secret.
type cudaMemory struct {
	d      *Driver
	device int
	ptr    uintptr
	size   int64

	// regMu is held through a cuFileBufRegister and by Close, so the
	// memory is never freed under a registration; mu is not, so that an
	// export (the slab socket handing a client its descriptor) never
	// waits for a registration (~30 ms, inside the first gds READ into
	// the slab, with nvidia-fs only: bufregister.go).
	// Lock order: regMu, then mu.
	regMu      sync.Mutex
	registered *Lib  // GUARDED_BY(regMu): cuFile library the memory is registered with, or nil
	regErr     error // GUARDED_BY(regMu): why registration failed; not retried

	mu     sync.Mutex
	closed bool // GUARDED_BY(mu); set with regMu held too
}

var _ gpubuf.DeviceMemory = (*cudaMemory)(nil)

func (m *cudaMemory) Size() int64        { return m.size }
func (m *cudaMemory) DevicePtr() uintptr { return m.ptr }
func (m *cudaMemory) Device() int        { return m.device }

func (m *cudaMemory) Scrub(ctx context.Context) error {
	if err := ctx.Err(); err != nil {
		return err
	}
	if err := m.d.Memset(m.device, m.ptr, 0, m.size); err != nil {
		return fmt.Errorf("scrub device memory: %w", err)
	}
	return nil
}

func (m *cudaMemory) Export() ([]byte, error) {
	h, err := m.d.IPCHandle(m.device, m.ptr)
	if err != nil {
		return nil, fmt.Errorf("export device memory: %w", err)
	}
	return h, nil
}

// errMemoryClosed is registration's answer for memory closed first.
var errMemoryClosed = errors.New("cufile: memory closed")

// register registers the memory with cuFile once (cuFileBufRegister is
// expensive and uses BAR1 space: once per slab, never per I/O).
func (m *cudaMemory) register(lib *Lib) error {
	return m.registerWith(lib, func() error {
		return m.d.Do(m.device, func() error { return lib.BufRegister(m.ptr, m.size) })
	})
}

// registerWith is register with call as its cuFileBufRegister.
func (m *cudaMemory) registerWith(lib *Lib, call func() error) error {
	m.regMu.Lock()
	defer m.regMu.Unlock()
	m.mu.Lock()
	closed := m.closed
	m.mu.Unlock()
	if closed {
		return errMemoryClosed
	}
	if m.registered != nil || m.regErr != nil {
		return m.regErr
	}
	err := call()
	var fe *FileError
	if errors.As(err, &fe) && fe.Code == fileMemoryAlreadyReg {
		err = nil
	}
	if err != nil {
		m.regErr = err
		return err
	}
	m.registered = lib
	return nil
}

func (m *cudaMemory) Close() error {
	m.regMu.Lock()
	defer m.regMu.Unlock()
	m.mu.Lock()
	defer m.mu.Unlock()
	if m.closed {
		return nil
	}
	m.closed = true
	var errs []error
	if m.registered != nil {
		errs = append(errs, m.d.Do(m.device, func() error { return m.registered.BufDeregister(m.ptr) }))
	}
	errs = append(errs, m.d.MemFree(m.device, m.ptr))
	return errors.Join(errs...)
}

// vmmMemory is one CUDA virtual-memory allocation, mapped in the daemon at
// ptr. Clients get it as a POSIX file descriptor (ExportFD, handed out by
// the slab socket to the session's uid only) and map it themselves; the
// physical memory lives until the last of them unmaps it, so their
// mappings never outlive their memory and never show another allocation.
type vmmMemory struct {
	cudaMemory // ptr, size (the slab's), registration, closed, locks
	alloc      VMMAllocation
}

var _ gpubuf.DeviceMemory = (*vmmMemory)(nil)

// Scrub zeroes the whole allocation, granularity padding included.
func (m *vmmMemory) Scrub(ctx context.Context) error {
	if err := ctx.Err(); err != nil {
		return err
	}
	if err := m.d.Memset(m.device, m.ptr, 0, m.alloc.Bytes); err != nil {
		return fmt.Errorf("scrub device memory: %w", err)
	}
	return nil
}

// Export returns no bytes: a VMM slab has no handle that travels as bytes;
// clients fetch a descriptor from the slab socket (ExportFD).
func (m *vmmMemory) Export() ([]byte, error) { return nil, nil }

// ExportFD returns a new POSIX file descriptor of the allocation and the
// bytes to map through it (ctl.FDExporter).
func (m *vmmMemory) ExportFD() (*os.File, int64, error) {
	m.mu.Lock()
	defer m.mu.Unlock()
	if m.closed {
		return nil, 0, errors.New("cufile: memory closed")
	}
	fd, err := m.d.VMMExportFD(m.device, m.alloc.Handle)
	if err != nil {
		return nil, 0, fmt.Errorf("export device memory: %w", err)
	}
	return os.NewFile(uintptr(fd), "cuda-vmm"), m.alloc.Bytes, nil
}

// Close deregisters the memory from cuFile, unmaps it and releases the
// daemon's handle. Clients' imports keep the physical memory until they
// unmap it (counted in docs/security.md, "CUDA slab memory").
func (m *vmmMemory) Close() error {
	m.regMu.Lock()
	defer m.regMu.Unlock()
	m.mu.Lock()
	defer m.mu.Unlock()
	if m.closed {
		return nil
	}
	m.closed = true
	var errs []error
	if m.registered != nil {
		errs = append(errs, m.d.Do(m.device, func() error { return m.registered.BufDeregister(m.ptr) }))
	}
	errs = append(errs, m.d.VMMFree(m.device, m.alloc))
	return errors.Join(errs...)
}

// cudaStager is the real stager: pinned host buffers and streams.
type cudaStager struct{ d *Driver }

func (s cudaStager) bind(device int) error { return s.d.SetCurrent(device) }

func (s cudaStager) newLane(device, slots int, bufBytes int64) (lane, error) {
	l := &cudaLane{d: s.d, device: device}
	for range slots {
		b, err := s.d.HostAlloc(device, bufBytes)
		if err != nil {
			_ = l.close()
			return nil, err
		}
		l.bufs = append(l.bufs, b)
		var st uintptr
		err = s.d.Do(device, func() (err error) { st, err = s.d.StreamCreate(); return err })
		if err != nil {
			_ = l.close()
			return nil, err
		}
		l.streams = append(l.streams, st)
	}
	return l, nil
}

type cudaLane struct {
	d       *Driver
	device  int
	bufs    [][]byte
	streams []uintptr
}

func devicePtr(m gpubuf.Memory) (uintptr, error) {
	dm, ok := m.(gpubuf.DeviceMemory)
	if !ok {
		return 0, fmt.Errorf("cufile: posix engine needs device memory, got %T", m)
	}
	return dm.DevicePtr(), nil
}

func (l *cudaLane) buf(slot int) []byte { return l.bufs[slot] }

func (l *cudaLane) h2d(slot int, dst gpubuf.Memory, dstOff int64, src []byte) error {
	p, err := devicePtr(dst)
	if err != nil {
		return err
	}
	return l.d.CopyHtoDAsync(p+uintptr(dstOff), src, l.streams[slot])
}

func (l *cudaLane) d2h(slot int, dst []byte, src gpubuf.Memory, srcOff int64) error {
	p, err := devicePtr(src)
	if err != nil {
		return err
	}
	return l.d.CopyDtoHAsync(dst, p+uintptr(srcOff), l.streams[slot])
}

func (l *cudaLane) sync(slot int) error { return l.d.StreamSync(l.streams[slot]) }

func (l *cudaLane) close() error {
	var errs []error
	for _, st := range l.streams {
		errs = append(errs, l.d.Do(l.device, func() error { return l.d.StreamDestroy(st) }))
	}
	for _, b := range l.bufs {
		errs = append(errs, l.d.HostFree(l.device, b))
	}
	l.streams, l.bufs = nil, nil
	return errors.Join(errs...)
}
