package cufile

import (
	"errors"
	"fmt"
	"sync"
	"unsafe"

	"golang.org/x/sys/unix"
)

// Pinned tier memory by registration: the tier's extents are anonymous
// memory (mmap, transparent huge pages where the kernel gives them) that
// the pin reads the file into first and registers with the driver after
// (cuMemHostRegister), instead of cuMemHostAlloc'ed memory read into.
//
// Why: cuMemHostAlloc allocates, zeroes and pins the pages inside the
// driver, one call at a time (GPU run 1: `gdsfs warm --pin` of 8 GiB at
// 1.7 GB/s with 16 parallel pins, where the same file reads from the page
// cache at 50 GB/s). Registered after the read, the pages were allocated
// and filled by the pin's parallel preads (the kernel zeroes nothing it
// then overwrites twice), and the driver only pins them. Hits are the same
// DMA copies either way. TestGPUTierRegister measures both.

// hostRegFuncs are the driver's host registration calls; zero where the
// driver lacks them (then the tier uses cuMemHostAlloc).
type hostRegFuncs struct {
	cuMemHostRegister, cuMemHostUnregister uintptr

	probe  sync.Once
	works  bool  // a test registration succeeded (CanRegister)
	reason error // why not, when it did not

	mu         sync.Mutex
	registered map[uintptr]bool // GUARDED_BY(mu): base addresses HostRegister registered
}

func (d *Driver) bindHostRegister() {
	f := &d.reg
	fns := map[string]*uintptr{
		"cuMemHostRegister_v2|cuMemHostRegister": &f.cuMemHostRegister,
		"cuMemHostUnregister":                    &f.cuMemHostUnregister,
	}
	optional := map[string]bool{}
	for n := range fns {
		optional[n] = true
	}
	_ = d.lib.bind(fns, optional) // all optional: cannot fail
}

// cudaErrorHostMemoryNotRegistered is CUDA_ERROR_HOST_MEMORY_NOT_REGISTERED.
const cudaErrorHostMemoryNotRegistered = 713

// CanRegister reports whether the driver registers host memory here: it
// has the calls, and a registration of 2 MiB of anonymous memory (tried
// once, on the first call) succeeded. Where it does not, tier memory is
// cuMemHostAlloc'ed as before.
func (d *Driver) CanRegister() bool {
	if d.reg.cuMemHostRegister == 0 || d.reg.cuMemHostUnregister == 0 {
		return false
	}
	d.reg.probe.Do(func() {
		b, err := mapAnon(2 << 20)
		if err == nil {
			if err = d.register(b); err == nil {
				_, err = d.unregister(b)
			}
			_ = unix.Munmap(b)
		}
		d.reg.works, d.reg.reason = err == nil, err
	})
	return d.reg.works
}

// HostRegister pins b (page-aligned, not Go memory) for DMA from every
// device's context (CU_MEMHOSTREGISTER_PORTABLE).
func (d *Driver) HostRegister(b []byte) error {
	if len(b) == 0 {
		return nil
	}
	if !d.CanRegister() {
		return fmt.Errorf("cufile: the driver cannot register host memory: %v", d.reg.reason)
	}
	if err := d.register(b); err != nil {
		return err
	}
	d.reg.mu.Lock()
	if d.reg.registered == nil {
		d.reg.registered = map[uintptr]bool{}
	}
	d.reg.registered[uintptr(unsafe.Pointer(&b[0]))] = true
	d.reg.mu.Unlock()
	return nil
}

func (d *Driver) register(b []byte) error {
	const portable = 0x01
	return d.Do(0, func() error {
		return d.check("cuMemHostRegister", cuCall(d.reg.cuMemHostRegister, uintptr(unsafe.Pointer(&b[0])), uintptr(len(b)), portable))
	})
}

// HostUnregister undoes HostRegister; memory HostRegister did not
// register is no error (reports false, and the driver is not asked).
func (d *Driver) HostUnregister(b []byte) (bool, error) {
	if len(b) == 0 || !d.CanRegister() {
		return false, nil
	}
	p := uintptr(unsafe.Pointer(&b[0]))
	d.reg.mu.Lock()
	was := d.reg.registered[p]
	d.reg.mu.Unlock()
	if !was {
		return false, nil
	}
	ok, err := d.unregister(b)
	if err == nil {
		d.reg.mu.Lock()
		delete(d.reg.registered, p)
		d.reg.mu.Unlock()
	}
	return ok, err
}

func (d *Driver) unregister(b []byte) (bool, error) {
	err := d.Do(0, func() error {
		return d.check("cuMemHostUnregister", cuCall(d.reg.cuMemHostUnregister, uintptr(unsafe.Pointer(&b[0]))))
	})
	var ce *CUDAError
	if errors.As(err, &ce) && ce.Code == cudaErrorHostMemoryNotRegistered {
		return false, nil
	}
	return err == nil, err
}

// mapAnon maps n bytes of anonymous memory, asking for huge pages.
func mapAnon(n int64) ([]byte, error) {
	b, err := unix.Mmap(-1, 0, int(n), unix.PROT_READ|unix.PROT_WRITE, unix.MAP_PRIVATE|unix.MAP_ANONYMOUS)
	if err != nil {
		return nil, fmt.Errorf("cufile: mmap %d bytes of tier memory: %w", n, err)
	}
	_ = unix.Madvise(b, unix.MADV_HUGEPAGE) // best effort: fewer faults, fewer pages to pin
	_ = unix.Madvise(b, unix.MADV_DONTFORK) // as the driver's own pinned memory: a fork must not share DMA pages
	return b, nil
}

// TierSealed reports whether tier memory from TierAlloc is plain memory
// the tier must TierSeal once filled (registration), rather than memory
// pinned from the start.
func (e *Engines) TierSealed() bool {
	return e.TierPinned() && e.drv.CanRegister()
}

// TierSeal pins tier memory from TierAlloc once the tier filled it (see
// TierSealed); a no-op for memory pinned at allocation.
func (e *Engines) TierSeal(b []byte) error {
	if !e.TierSealed() {
		return nil
	}
	if err := e.drv.HostRegister(b); err != nil {
		return fmt.Errorf("cufile: pin %d bytes of tier memory: %w", len(b), err)
	}
	return nil
}
