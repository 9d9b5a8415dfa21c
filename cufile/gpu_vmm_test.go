package cufile

import (
	"bytes"
	"context"
	"testing"

	"github.com/gdsfs/gdsfs/gpubuf"
)

// TestGPUVMMRetainedMapping checks the property VMM slabs are for, on real
// device memory: a mapping imported from a slab's descriptor keeps that
// slab's bytes after the daemon frees the slab, and memory allocated
// afterwards (for another uid) never shows through it. It also checks the
// padding to the allocation granularity is zeroed.
func TestGPUVMMRetainedMapping(t *testing.T) {
	e := gpuEngines(t)
	b, ok := e.Backend().(*cudaBackend)
	if !ok || !b.vmm {
		t.Skipf("slabs are not CUDA virtual memory here (%s): see the probe 'cuda slab handles'", e.SlabHandles())
	}
	ctx := context.Background()
	const size = 2<<20 + 4096 // not a multiple of the granularity
	mem, err := b.Alloc(ctx, 0, size, 1001)
	if err != nil {
		t.Fatal(err)
	}
	vm := mem.(*vmmMemory)
	t.Logf("slab of %d bytes: allocation of %d bytes (granularity rounding), GPUDirect-RDMA capable %v", size, vm.alloc.Bytes, vm.alloc.RDMA)
	pad := make([]byte, vm.alloc.Bytes)
	if err := e.drv.CopyDtoH(0, pad, vm.DevicePtr()); err != nil {
		t.Fatal(err)
	}
	if !isAllByte(pad, 0) {
		t.Fatal("a new VMM slab (granularity padding included) is not zeroed")
	}
	if e.lib != nil {
		// cuFile on VMM memory: registration is an optimisation (unregistered
		// memory is bounced through cuFile's own buffers), so report, not fail.
		t.Logf("cuFileBufRegister on a VMM slab: %v (nil: registered)", vm.register(e.lib))
	}
	if err := e.drv.Memset(0, vm.DevicePtr(), 0xA1, size); err != nil {
		t.Fatal(err)
	}
	f, n, err := vm.ExportFD()
	if err != nil {
		t.Fatal(err)
	}
	p, err := e.drv.VMMImport(0, int(f.Fd()), n)
	f.Close() // the mapping keeps the memory
	if err != nil {
		t.Fatalf("import the slab's descriptor: %v", err)
	}
	defer e.drv.VMMUnmap(0, p, n)
	read := func() []byte {
		t.Helper()
		got := make([]byte, size)
		if err := e.drv.CopyDtoH(0, got, p); err != nil {
			t.Fatal(err)
		}
		return got
	}
	want := bytes.Repeat([]byte{0xA1}, size)
	if !bytes.Equal(read(), want) {
		t.Fatal("the imported mapping does not show the slab's bytes")
	}
	if err := mem.Close(); err != nil { // the daemon frees the slab
		t.Fatal(err)
	}
	// Another uid's slabs, allocated after the free, filled with its bytes.
	var others []gpubuf.Memory
	for range 8 {
		m, err := b.Alloc(ctx, 0, size, 1002)
		if err != nil {
			t.Fatal(err)
		}
		others = append(others, m)
		dm := m.(gpubuf.DeviceMemory)
		if err := e.drv.Memset(0, dm.DevicePtr(), 0xB2, size); err != nil {
			t.Fatal(err)
		}
	}
	defer func() {
		for _, m := range others {
			m.Close()
		}
	}()
	if !bytes.Equal(read(), want) {
		t.Fatal("after the daemon freed the slab, the retained mapping shows other bytes (memory reused under it)")
	}
	t.Logf("retained mapping: the freed slab's bytes, unchanged, after 8 new slabs of another uid were written")
}
