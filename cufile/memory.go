package cufile

import (
	"context"
	"errors"
	"fmt"
	"sync"

	"github.com/gdsfs/gdsfs/gpubuf"
)

// cudaBackend allocates slabs with cuMemAlloc: exportable by CUDA IPC and
// registrable with cuFile.
type cudaBackend struct {
	d   *Driver
	lib *Lib // non-nil when slabs are registered with cuFile on first use
}

var _ gpubuf.Backend = (*cudaBackend)(nil)

func (b *cudaBackend) Name() string { return "cuda" }
func (b *cudaBackend) Devices() int { return b.d.Devices() }

func (b *cudaBackend) Alloc(ctx context.Context, device int, size int64, _ uint32) (gpubuf.Memory, error) {
	if err := ctx.Err(); err != nil {
		return nil, err
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

// cudaMemory is one cuMemAlloc allocation. Isolation between uids is by
// scrubbing and by leases: a CUDA IPC handle grants the whole allocation.
type cudaMemory struct {
	d      *Driver
	device int
	ptr    uintptr
	size   int64

	mu         sync.Mutex
	registered *Lib  // cuFile library the memory is registered with, or nil
	regErr     error // why registration failed; not retried
	closed     bool
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

// register registers the memory with cuFile once (cuFileBufRegister is
// expensive and uses BAR1 space: once per slab, never per I/O).
func (m *cudaMemory) register(lib *Lib) error {
	m.mu.Lock()
	defer m.mu.Unlock()
	if m.closed {
		return errors.New("cufile: memory closed")
	}
	if m.registered != nil || m.regErr != nil {
		return m.regErr
	}
	err := m.d.Do(m.device, func() error { return lib.BufRegister(m.ptr, m.size) })
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
