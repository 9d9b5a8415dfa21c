package cufile

import (
	"bytes"
	"context"
	"math/rand/v2"
	"sync"
	"testing"
	"time"

	"github.com/gdsfs/gdsfs/gpubuf"
)

// TestGPUTierRegister: tier memory registered after it was filled (the
// pin's path where the driver can register, hostreg.go) serves byte-exact
// DMA copies into a CUDA slab, and frees whether it was sealed or not. It
// logs what one 8 GiB-like fill costs either way: 32 extents of 64 MiB
// allocated pinned (cuMemHostAlloc) vs mapped, written and registered, with
// 1 and 8 goroutines (GPU run 1: pins filled the tier at 1.7 GB/s).
func TestGPUTierRegister(t *testing.T) {
	e := gpuEngines(t)
	if !e.TierPinned() {
		t.Skipf("slabs are %s memory: no pinned tier", e.Backend().Name())
	}
	if !e.TierSealed() {
		t.Skip("the driver has no cuMemHostRegister: the tier allocates pinned memory")
	}
	const n = 64 << 20
	src, err := e.TierAlloc(n)
	if err != nil {
		t.Fatal(err)
	}
	r := rand.NewChaCha8([32]byte{15})
	_, _ = r.Read(src)
	if err := e.TierSeal(src); err != nil {
		t.Fatal(err)
	}
	m, err := e.Backend().Alloc(context.Background(), 0, n+2*gpubuf.Align, 0)
	if err != nil {
		t.Fatal(err)
	}
	defer m.Close()
	dm := m.(gpubuf.DeviceMemory)
	t0 := time.Now()
	if err := e.CopyIn(context.Background(), m, gpubuf.Align, src); err != nil {
		t.Fatal(err)
	}
	copyTime := time.Since(t0)
	back := make([]byte, n)
	if err := e.drv.CopyDtoH(dm.Device(), back, dm.DevicePtr()+gpubuf.Align); err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(back, src) {
		t.Fatal("copy out of registered tier memory: device bytes differ")
	}
	t.Logf("registered tier memory -> CUDA slab: 64 MiB byte-exact in %v (%.1f GB/s)", copyTime, float64(n)/copyTime.Seconds()/1e9)
	if err := e.TierFree(src); err != nil {
		t.Fatalf("free of sealed memory: %v", err)
	}
	unsealed, err := e.TierAlloc(4096)
	if err != nil {
		t.Fatal(err)
	}
	if err := e.TierFree(unsealed); err != nil {
		t.Fatalf("free of memory never sealed (a failed fill): %v", err)
	}

	// What a fill costs: allocate (and pin) 32 extents, write each once.
	const extents = 32
	fill := func(workers int, alloc func() ([]byte, error), seal, free func([]byte) error) time.Duration {
		var wg sync.WaitGroup
		var mu sync.Mutex
		var held [][]byte
		next := make(chan struct{}, extents)
		for range extents {
			next <- struct{}{}
		}
		close(next)
		t0 := time.Now()
		for range workers {
			wg.Go(func() {
				for range next {
					b, err := alloc()
					if err != nil {
						t.Error(err)
						return
					}
					for i := 0; i < len(b); i += 4096 {
						b[i] = byte(i) // the pread's page faults and stores
					}
					if err := seal(b); err != nil {
						t.Error(err)
					}
					mu.Lock()
					held = append(held, b)
					mu.Unlock()
				}
			})
		}
		wg.Wait()
		d := time.Since(t0)
		for _, b := range held {
			if err := free(b); err != nil {
				t.Error(err)
			}
		}
		return d
	}
	hostAlloc := func() ([]byte, error) { return e.drv.HostAlloc(0, n) }
	hostFree := func(b []byte) error { return e.drv.HostFree(0, b) }
	none := func([]byte) error { return nil }
	mapped := func() ([]byte, error) { return e.TierAlloc(n) }
	for _, workers := range []int{1, 8} {
		a := fill(workers, hostAlloc, none, hostFree)
		b := fill(workers, mapped, e.TierSeal, e.TierFree)
		gb := float64(extents*n) / 1e9
		t.Logf("tier fill of %d x 64 MiB, %d goroutines: cuMemHostAlloc %.1f GB/s, mmap+write+cuMemHostRegister %.1f GB/s",
			extents, workers, gb/a.Seconds(), gb/b.Seconds())
	}
}

// TestGPUTierConcurrentCopyIn: hits copy on pooled streams (tierstreams.go):
// 8 goroutines copying 8 MiB pieces of one pinned extent into one slab at
// once land every byte where it belongs; it logs the rate with 1 and 8
// goroutines (the copies of a READ's ranges, and of several READs, overlap).
func TestGPUTierConcurrentCopyIn(t *testing.T) {
	e := gpuEngines(t)
	if !e.TierPinned() {
		t.Skipf("slabs are %s memory: no pinned tier", e.Backend().Name())
	}
	const n, piece = 256 << 20, 8 << 20
	src, err := e.TierAlloc(n)
	if err != nil {
		t.Fatal(err)
	}
	defer func() {
		if err := e.TierFree(src); err != nil {
			t.Error(err)
		}
	}()
	r := rand.NewChaCha8([32]byte{16})
	_, _ = r.Read(src)
	if err := e.TierSeal(src); err != nil {
		t.Fatal(err)
	}
	m, err := e.Backend().Alloc(context.Background(), 0, n, 0)
	if err != nil {
		t.Fatal(err)
	}
	defer m.Close()
	dm := m.(gpubuf.DeviceMemory)
	ctx := context.Background()
	copyAll := func(workers int) time.Duration {
		next := make(chan int, n/piece)
		for off := 0; off < n; off += piece {
			next <- off
		}
		close(next)
		var wg sync.WaitGroup
		t0 := time.Now()
		for range workers {
			wg.Go(func() {
				for off := range next {
					if err := e.CopyIn(ctx, m, int64(off), src[off:off+piece]); err != nil {
						t.Error(err)
					}
				}
			})
		}
		wg.Wait()
		return time.Since(t0)
	}
	for _, workers := range []int{1, 8} {
		if err := e.drv.Memset(0, dm.DevicePtr(), 0, n); err != nil {
			t.Fatal(err)
		}
		best := time.Duration(1 << 62)
		for range 3 {
			best = min(best, copyAll(workers))
		}
		back := make([]byte, n)
		if err := e.drv.CopyDtoH(dm.Device(), back, dm.DevicePtr()); err != nil {
			t.Fatal(err)
		}
		if !bytes.Equal(back, src) {
			t.Fatalf("%d goroutines copying 8 MiB pieces: the slab's bytes differ from the source", workers)
		}
		t.Logf("tier copies byte-exact, 32 x 8 MiB, %d goroutines: %.1f GB/s", workers, float64(n)/best.Seconds()/1e9)
	}
}
