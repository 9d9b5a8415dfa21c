package gpubuf

import (
	"context"
	"errors"
)

// Align is the alignment, in bytes, of every lease's offset within its slab
// and of every lease's length: the granularity at which GPUDirect Storage and
// O_DIRECT transfers are fast.
const Align = 4096

// ErrExhausted reports that the pool cannot satisfy an allocation without
// waiting: the device's budget is spent and no slab of the caller's uid has a
// fitting free range. The control path answers EAGAIN.
var ErrExhausted = errors.New("gpubuf: pool exhausted")

// ErrNotFound reports a lease or slab that does not exist for the caller.
var ErrNotFound = errors.New("gpubuf: no such lease")

// ErrClosed reports a call on a closed pool.
var ErrClosed = errors.New("gpubuf: pool closed")

// Backend supplies slab memory for a Pool. Implementations must be safe for
// concurrent use.
type Backend interface {
	// Name is a short identifier ("host", "cuda") reported in stats.
	Name() string
	// Devices is the number of devices memory can be allocated on; device
	// numbers passed to Alloc are 0..Devices()-1. The host backend has one.
	Devices() int
	// Alloc returns size bytes of zeroed memory on device, accessible to uid
	// (for file-backed memory: owned by uid, mode 0600). size is a multiple
	// of Align.
	Alloc(ctx context.Context, device int, size int64, uid uint32) (Memory, error)
}

// Memory is one slab's memory. Methods may be called concurrently, except
// Close, which the Pool calls once when nothing else uses the memory.
type Memory interface {
	// Size is the memory's length in bytes.
	Size() int64
	// Scrub zeroes the whole memory and returns when the zeroes are in
	// place (visible to every later reader, including other processes).
	Scrub(ctx context.Context) error
	// Export returns what a client needs to map the memory in its own
	// process: for host memory the path of the shared-memory file, for CUDA
	// memory the 64-byte IPC handle.
	Export() ([]byte, error)
	// Close frees the memory. Clients' existing mappings may stay valid
	// until they unmap (host) or must be closed first (CUDA IPC).
	Close() error
}

// HostMemory is implemented by Memory the daemon can address directly.
type HostMemory interface {
	Memory
	// HostBytes is the whole memory as a byte slice, valid until Close.
	HostBytes() []byte
}

// DeviceMemory is implemented by CUDA memory.
type DeviceMemory interface {
	Memory
	// DevicePtr is the CUdeviceptr of the first byte.
	DevicePtr() uintptr
	// Device is the CUDA device ordinal.
	Device() int
}

// Chowner is implemented by Memory whose access control follows the uid the
// slab serves (shared-memory files). The Pool calls Chown after Scrub when a
// slab changes uid.
type Chowner interface {
	Chown(uid uint32) error
}
