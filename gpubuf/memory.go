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
	// Alloc returns size bytes of new, zeroed memory on device for uid
	// alone: no other uid can map it, ever (for file-backed memory: a new
	// file owned by uid, mode 0600). size is a multiple of Align. The
	// Pool never hands memory from one uid to another: it Closes one
	// uid's idle memory and Allocs new memory for the other.
	Alloc(ctx context.Context, device int, size int64, uid uint32) (Memory, error)
}

// Memory is one slab's memory, allocated for one uid and never used for
// another. Methods may be called concurrently, except Close, which the Pool
// calls once when nothing else uses the memory.
type Memory interface {
	// Size is the memory's length in bytes.
	Size() int64
	// Export returns what a client of the slab's uid needs to map the
	// memory in its own process: for host memory the path of the
	// shared-memory file (mode 0600, owned by the uid), for CUDA memory
	// the handle the CUDA backend documents. It must be useless to any
	// other uid (docs/protocol.md, "Slab handles").
	Export() ([]byte, error)
	// Close frees the memory. The Pool calls it when the slab holds no
	// lease, either to make room (for this uid or another) or at Close.
	// A client may still hold a mapping: Close must leave it unable to
	// see any memory that will ever serve anything else, and should make
	// it hold no memory (host memory truncates the file to zero bytes, so
	// a retained mapping faults with SIGBUS instead of keeping pages).
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
