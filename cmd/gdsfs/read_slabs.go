package main

import (
	"context"
	"errors"
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
	ipc, ok := any(drv).(ipcOpener)
	if !ok {
		return nil, errors.New("copying GPU slabs back needs CUDA IPC (cufile.Driver.IPCOpen), which this build lacks; use --discard to measure, or a host-engine mount")
	}
	return &cudaSlabs{cl: cl, drv: drv, ipc: ipc, device: int(device), base: map[uint64]uintptr{}}, nil
}

type hostSlabs struct{ cl *ctl.Client }

func (h hostSlabs) bytes(ctx context.Context, l ctl.Lease, _ *[]byte) ([]byte, error) {
	return h.cl.Bytes(ctx, l)
}

func (hostSlabs) close() {}

// ipcOpener is the CUDA IPC ability of a CUDA driver binding: open a
// 64-byte IPC handle of another process's allocation on device (returning
// its device address here) and close it again.
type ipcOpener interface {
	IPCOpen(device int, handle []byte) (uintptr, error)
	IPCClose(device int, p uintptr) error
}

// cudaSlabs copies leases out of CUDA slabs mapped by IPC, once per slab.
type cudaSlabs struct {
	cl     *ctl.Client
	drv    *cufile.Driver
	ipc    ipcOpener
	device int
	base   map[uint64]uintptr // slab id -> address of slab byte 0 here
	opened []uintptr          // what IPCOpen returned, to close
}

func (c *cudaSlabs) bytes(ctx context.Context, l ctl.Lease, buf *[]byte) ([]byte, error) {
	if l.Valid == 0 {
		return nil, nil
	}
	base, ok := c.base[l.Slab]
	if !ok {
		r, err := c.cl.Slab(ctx, l.Slab)
		if err != nil {
			return nil, err
		}
		if r.Kind != ctl.SlabCUDA || int(r.Device) != c.device {
			return nil, fmt.Errorf("slab %d is kind %d on device %d, want CUDA memory on device %d", l.Slab, r.Kind, r.Device, c.device)
		}
		p, err := c.ipc.IPCOpen(c.device, r.Handle)
		if err != nil {
			return nil, fmt.Errorf("open IPC handle of slab %d: %w", l.Slab, err)
		}
		c.opened = append(c.opened, p)
		base = p + uintptr(r.MapOffset)
		c.base[l.Slab] = base
	}
	if uint64(cap(*buf)) < l.Valid {
		*buf = make([]byte, l.Valid)
	}
	out := (*buf)[:l.Valid]
	if err := c.drv.CopyDtoH(c.device, out, base+uintptr(l.Offset)); err != nil {
		return nil, fmt.Errorf("copy lease %d from the GPU: %w", l.ID, err)
	}
	return out, nil
}

func (c *cudaSlabs) close() {
	for _, p := range c.opened {
		_ = c.ipc.IPCClose(c.device, p)
	}
}
