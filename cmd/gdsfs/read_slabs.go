package main

import (
	"context"
	"fmt"

	"github.com/gdsfs/gdsfs/ctl"
	"github.com/gdsfs/gdsfs/cufile"
)

// slabReader gives gdsfs read the bytes of a lease.
type slabReader interface {
	// bytes returns l's valid bytes; buf is scratch space it may grow.
	bytes(ctx context.Context, l ctl.Lease, buf *[]byte) ([]byte, error)
	close()
}

// newSlabReader returns the reader for device's slabs: host slabs are
// mapped, CUDA slabs are opened by IPC and copied to host memory.
func newSlabReader(ctx context.Context, cl *ctl.Client, device int32) (slabReader, error) {
	if device == ctl.HostDevice {
		return hostSlabs{cl}, nil
	}
	drv, err := cufile.LoadDriver()
	if err != nil {
		return nil, fmt.Errorf("--device %d: copying GPU slabs back needs CUDA here: %w", device, err)
	}
	if int(device) >= drv.Devices() {
		return nil, usagef("--device %d: this process sees %d CUDA devices (is CUDA_VISIBLE_DEVICES the daemon's?)", device, drv.Devices())
	}
	return newCUDASlabs(cl, drv, drv, int(device)), nil
}

type hostSlabs struct{ cl *ctl.Client }

func (h hostSlabs) bytes(ctx context.Context, l ctl.Lease, _ *[]byte) ([]byte, error) {
	return h.cl.Bytes(ctx, l)
}

func (hostSlabs) close() {}

// slabSource says how to map a slab (ctl.Client.Slab: the SLAB command).
type slabSource interface {
	Slab(ctx context.Context, id uint64) (ctl.SlabReply, error)
}

// ipcOpener is the CUDA IPC ability of a CUDA driver binding
// (cufile.Driver): open a 64-byte IPC handle of another process's
// allocation on device, returning its device address here, and close it.
// CUDA refuses to open one handle twice in a process: callers cache.
type ipcOpener interface {
	IPCOpen(device int, handle []byte) (uintptr, error)
	IPCClose(device int, p uintptr) error
}

// deviceCopier copies device memory to host memory and waits
// (cufile.Driver.CopyDtoH).
type deviceCopier interface {
	CopyDtoH(device int, dst []byte, src uintptr) error
}

// cudaSlabs copies leases out of CUDA slabs mapped by IPC, once per slab.
// It is used by one goroutine.
type cudaSlabs struct {
	slabs  slabSource
	ipc    ipcOpener
	copier deviceCopier
	device int
	mapped map[uint64]cudaSlab // slab id -> its mapping here
}

// cudaSlab is one slab opened by IPC.
type cudaSlab struct {
	opened uintptr // what IPCOpen returned, to close
	base   uintptr // address of slab byte 0
	size   uint64
}

func newCUDASlabs(slabs slabSource, ipc ipcOpener, copier deviceCopier, device int) *cudaSlabs {
	return &cudaSlabs{slabs: slabs, ipc: ipc, copier: copier, device: device, mapped: map[uint64]cudaSlab{}}
}

// slab returns the mapping of slab id, opening it on first use.
func (c *cudaSlabs) slab(ctx context.Context, id uint64) (cudaSlab, error) {
	if m, ok := c.mapped[id]; ok {
		return m, nil
	}
	r, err := c.slabs.Slab(ctx, id)
	if err != nil {
		return cudaSlab{}, err
	}
	if r.Kind != ctl.SlabCUDA || int(r.Device) != c.device {
		return cudaSlab{}, fmt.Errorf("slab %d is kind %d on device %d, want CUDA memory (kind %d) on device %d", id, r.Kind, r.Device, ctl.SlabCUDA, c.device)
	}
	p, err := c.ipc.IPCOpen(c.device, r.Handle)
	if err != nil {
		return cudaSlab{}, fmt.Errorf("open the CUDA IPC handle of slab %d: %w", id, err)
	}
	m := cudaSlab{opened: p, base: p + uintptr(r.MapOffset), size: r.Size}
	c.mapped[id] = m
	return m, nil
}

func (c *cudaSlabs) bytes(ctx context.Context, l ctl.Lease, buf *[]byte) ([]byte, error) {
	if l.Valid == 0 {
		return nil, nil
	}
	m, err := c.slab(ctx, l.Slab)
	if err != nil {
		return nil, err
	}
	if l.Offset > m.size || l.Valid > m.size-l.Offset {
		return nil, fmt.Errorf("lease %d (%d bytes at %d) lies outside its %d-byte slab %d", l.ID, l.Valid, l.Offset, m.size, l.Slab)
	}
	if uint64(cap(*buf)) < l.Valid {
		*buf = make([]byte, l.Valid)
	}
	out := (*buf)[:l.Valid]
	if err := c.copier.CopyDtoH(c.device, out, m.base+uintptr(l.Offset)); err != nil {
		return nil, fmt.Errorf("copy lease %d from the GPU: %w", l.ID, err)
	}
	return out, nil
}

// close unmaps every slab (before the session ends, so no mapping outlives
// the leases that made it valid).
func (c *cudaSlabs) close() {
	for id, m := range c.mapped {
		_ = c.ipc.IPCClose(c.device, m.opened)
		delete(c.mapped, id)
	}
}
