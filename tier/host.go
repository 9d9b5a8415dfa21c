package tier

import (
	"fmt"

	"golang.org/x/sys/unix"
)

// HostAllocator supplies anonymous private memory (mmap), the tier's
// memory with the host engine. Freshly mapped memory is zeroed.
type HostAllocator struct{}

// Name implements Allocator.
func (HostAllocator) Name() string { return "host" }

// Alloc implements Allocator.
func (HostAllocator) Alloc(n int64) (Memory, error) {
	b, err := unix.Mmap(-1, 0, int(n), unix.PROT_READ|unix.PROT_WRITE, unix.MAP_PRIVATE|unix.MAP_ANONYMOUS)
	if err != nil {
		return nil, fmt.Errorf("tier: mmap %d bytes: %w", n, err)
	}
	return hostMemory(b), nil
}

type hostMemory []byte

func (m hostMemory) Bytes() []byte { return m }
func (m hostMemory) Close() error  { return unix.Munmap(m) }

// FuncAllocator is an Allocator over functions (the daemon's pinned
// memory: cufile's Engines.TierAlloc, TierSeal and TierFree).
type FuncAllocator struct {
	Kind string                        // Name's answer
	New  func(n int64) ([]byte, error) // n bytes
	Free func(b []byte) error          // frees what New returned, sealed or not
	// Seal, when set, is called on the memory once filled (Sealer).
	Seal func(b []byte) error
}

// Name implements Allocator.
func (a FuncAllocator) Name() string { return a.Kind }

// Alloc implements Allocator.
func (a FuncAllocator) Alloc(n int64) (Memory, error) {
	b, err := a.New(n)
	if err != nil {
		return nil, err
	}
	if a.Seal != nil {
		return sealedMemory{funcMemory{b: b, free: a.Free}, a.Seal}, nil
	}
	return funcMemory{b: b, free: a.Free}, nil
}

type funcMemory struct {
	b    []byte
	free func([]byte) error
}

func (m funcMemory) Bytes() []byte { return m.b }
func (m funcMemory) Close() error  { return m.free(m.b) }

type sealedMemory struct {
	funcMemory
	seal func([]byte) error
}

func (m sealedMemory) Seal() error { return m.seal(m.b) }
