package reader

import (
	"context"
	"fmt"
	"os"

	"github.com/gdsfs/gdsfs/ctl"
	"github.com/gdsfs/gdsfs/cufile"
	"github.com/gdsfs/gdsfs/handoff"
	"github.com/gdsfs/gdsfs/internal/usage"
)

// slabReader gives Read the bytes of a lease.
type slabReader interface {
	// bytes returns l's valid bytes; buf is scratch space it may grow.
	bytes(ctx context.Context, l ctl.Lease, buf *[]byte) ([]byte, error)
	close()
}

// newSlabReader returns the reader for device's slabs: host slabs are
// mapped, CUDA slabs are imported (VMM descriptors from the slab socket)
// or opened by legacy IPC, and copied to host memory.
func newSlabReader(ctx context.Context, cl *ctl.Client, device int32) (slabReader, error) {
	if device == ctl.HostDevice {
		return hostSlabs{cl}, nil
	}
	drv, err := cufile.LoadDriver()
	if err != nil {
		return nil, fmt.Errorf("--device %d: copying GPU slabs back needs CUDA here: %w", device, err)
	}
	if int(device) >= drv.Devices() {
		return nil, usage.Errorf("--device %d: this process sees %d CUDA devices (is CUDA_VISIBLE_DEVICES the daemon's?)", device, drv.Devices())
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

// slabFDSource fetches a slab's descriptor from the slab socket
// (ctl.Client.SlabFD), for slabs of kind ctl.SlabCUDAFD.
type slabFDSource interface {
	SlabFD(ctx context.Context, id uint64) (*os.File, handoff.Reply, error)
}

// vmmImporter maps CUDA virtual memory exported as a POSIX descriptor
// (cufile.Driver.VMMImport) and unmaps it.
type vmmImporter interface {
	VMMImport(device, fd int, bytes int64) (uintptr, error)
	VMMUnmap(device int, p uintptr, bytes int64) error
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

// cudaSlab is one slab opened by IPC or imported from a descriptor.
type cudaSlab struct {
	opened   uintptr // what IPCOpen or VMMImport returned, to close
	base     uintptr // address of slab byte 0
	size     uint64
	vmmBytes int64 // bytes VMMImport mapped (0: opened by IPCOpen)
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
	if (r.Kind != ctl.SlabCUDA && r.Kind != ctl.SlabCUDAFD) || int(r.Device) != c.device {
		return cudaSlab{}, fmt.Errorf("slab %d is kind %d on device %d, want CUDA memory (kind %d or %d) on device %d", id, r.Kind, r.Device, ctl.SlabCUDA, ctl.SlabCUDAFD, c.device)
	}
	if r.Kind == ctl.SlabCUDAFD {
		return c.importSlab(ctx, id, r)
	}
	p, err := c.ipc.IPCOpen(c.device, r.Handle)
	if err != nil {
		return cudaSlab{}, fmt.Errorf("open the CUDA IPC handle of slab %d: %w", id, err)
	}
	m := cudaSlab{opened: p, base: p + uintptr(r.MapOffset), size: r.Size}
	c.mapped[id] = m
	return m, nil
}

// importSlab maps a VMM slab from the descriptor the slab socket hands
// this process (only a process of the session's uid gets it).
func (c *cudaSlabs) importSlab(ctx context.Context, id uint64, r ctl.SlabReply) (cudaSlab, error) {
	src, ok1 := c.slabs.(slabFDSource)
	imp, ok2 := c.ipc.(vmmImporter)
	if !ok1 || !ok2 {
		return cudaSlab{}, fmt.Errorf("slab %d is CUDA virtual memory, and this reader cannot import it", id)
	}
	f, rep, err := src.SlabFD(ctx, id)
	if err != nil {
		return cudaSlab{}, err
	}
	defer f.Close() // the mapping keeps the memory
	n := int64(rep.Bytes)
	if n <= 0 || uint64(n) < r.MapOffset+r.Size {
		return cudaSlab{}, fmt.Errorf("slab %d: descriptor of %d bytes for a %d-byte slab at offset %d", id, n, r.Size, r.MapOffset)
	}
	p, err := imp.VMMImport(c.device, int(f.Fd()), n)
	if err != nil {
		return cudaSlab{}, fmt.Errorf("import the CUDA memory of slab %d: %w", id, err)
	}
	m := cudaSlab{opened: p, base: p + uintptr(r.MapOffset), size: r.Size, vmmBytes: n}
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
		if imp, ok := c.ipc.(vmmImporter); ok && m.vmmBytes > 0 {
			_ = imp.VMMUnmap(c.device, m.opened, m.vmmBytes)
		} else {
			_ = c.ipc.IPCClose(c.device, m.opened)
		}
		delete(c.mapped, id)
	}
}
