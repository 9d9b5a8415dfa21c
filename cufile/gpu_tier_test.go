package cufile

import (
	"bytes"
	"context"
	"math/rand/v2"
	"testing"
	"time"

	"github.com/gdsfs/gdsfs/gpubuf"
)

// TestGPUTierCopyIn: tier memory is pinned host memory, and CopyIn moves it
// byte-exact into a CUDA slab at an offset (the memory tier's hit path);
// it logs the copy rate of one 256 MiB extent-sized copy.
func TestGPUTierCopyIn(t *testing.T) {
	e := gpuEngines(t)
	if !e.TierPinned() {
		t.Skipf("slabs are %s memory: no pinned tier", e.Backend().Name())
	}
	const n = 256 << 20
	src, err := e.TierAlloc(n)
	if err != nil {
		t.Fatal(err)
	}
	defer func() {
		if err := e.TierFree(src); err != nil {
			t.Error(err)
		}
	}()
	r := rand.NewChaCha8([32]byte{14})
	_, _ = r.Read(src)
	if err := e.TierSeal(src); err != nil { // as the tier does once an extent is filled
		t.Fatal(err)
	}
	m, err := e.Backend().Alloc(context.Background(), 0, n+2*gpubuf.Align, 0)
	if err != nil {
		t.Fatal(err)
	}
	defer m.Close()
	dm, ok := m.(gpubuf.DeviceMemory)
	if !ok {
		t.Fatalf("CUDA slab %T has no device pointer", m)
	}
	ctx := context.Background()
	best := time.Duration(1 << 62)
	for range 3 {
		t0 := time.Now()
		if err := e.CopyIn(ctx, m, gpubuf.Align, src); err != nil {
			t.Fatal(err)
		}
		best = min(best, time.Since(t0))
	}
	back := make([]byte, n)
	if err := e.drv.CopyDtoH(dm.Device(), back, dm.DevicePtr()+gpubuf.Align); err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(back, src) {
		t.Fatal("tier copy: device bytes differ from the pinned source")
	}
	t.Logf("tier copy byte-exact: pinned host -> CUDA slab, 256 MiB in %v (%.1f GB/s)", best, float64(n)/best.Seconds()/1e9)
	if err := e.CopyIn(ctx, m, 4*gpubuf.Align, src); err == nil {
		t.Fatal("CopyIn past the slab's end succeeded")
	}
	// The device tier: a copy on the GPU, then device to slab.
	dev, err := e.AllocDevice(0, n)
	if err != nil {
		t.Fatal(err)
	}
	defer dev.Close()
	if err := e.HostToDevice(ctx, 0, dev.Ptr(), src); err != nil {
		t.Fatal(err)
	}
	if err := e.drv.Memset(0, dm.DevicePtr(), 0, m.Size()); err != nil {
		t.Fatal(err)
	}
	best = time.Duration(1 << 62)
	for range 3 {
		t0 := time.Now()
		if err := e.DeviceToSlab(ctx, m, gpubuf.Align, dev.Ptr(), n); err != nil {
			t.Fatal(err)
		}
		best = min(best, time.Since(t0))
	}
	clear(back)
	if err := e.drv.CopyDtoH(dm.Device(), back, dm.DevicePtr()+gpubuf.Align); err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(back, src) {
		t.Fatal("device tier copy: slab bytes differ from the source")
	}
	t.Logf("device tier copy byte-exact: GPU copy -> CUDA slab, 256 MiB in %v (%.1f GB/s)", best, float64(n)/best.Seconds()/1e9)

	// Concurrent device-tier copies (as the ranges of concurrent READs), each on a pooled stream:
	// 8 pieces in reverse order into the slab, byte-exact.
	if err := e.drv.Memset(0, dm.DevicePtr(), 0, m.Size()); err != nil {
		t.Fatal(err)
	}
	const pieces = 8
	errs := make(chan error, pieces)
	for i := range pieces {
		go func(i int) {
			off := int64(pieces-1-i) * (n / pieces)
			errs <- e.DeviceToSlab(ctx, m, gpubuf.Align+off, dev.Ptr()+uintptr(off), n/pieces)
		}(i)
	}
	for range pieces {
		if err := <-errs; err != nil {
			t.Fatal(err)
		}
	}
	clear(back)
	if err := e.drv.CopyDtoH(dm.Device(), back, dm.DevicePtr()+gpubuf.Align); err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(back, src) {
		t.Fatal("concurrent device tier copies: slab bytes differ from the source")
	}
	if err := e.DeviceToSlab(ctx, m, m.Size()-gpubuf.Align, dev.Ptr(), 2*gpubuf.Align); err == nil {
		t.Fatal("DeviceToSlab past the slab's end succeeded")
	}
}
