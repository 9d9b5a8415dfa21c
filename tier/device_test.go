package tier

import (
	"bytes"
	"context"
	"fmt"
	"os"
	"sync"
	"testing"

	"github.com/gdsfs/gdsfs/gpubuf"
)

// fakeGPU stands in for GPU memory: allocations are host byte slices at
// made-up addresses, and its copier moves bytes between them.
type fakeGPU struct {
	mu    sync.Mutex
	next  uintptr
	alloc map[uintptr][]byte // base -> bytes
}

type fakeDevMem struct {
	g    *fakeGPU
	base uintptr
}

func (m fakeDevMem) Ptr() uintptr { return m.base }
func (m fakeDevMem) Close() error {
	m.g.mu.Lock()
	defer m.g.mu.Unlock()
	if _, ok := m.g.alloc[m.base]; !ok {
		return fmt.Errorf("double free of %#x", m.base)
	}
	delete(m.g.alloc, m.base)
	return nil
}

func (g *fakeGPU) AllocDevice(device int, n int64) (DeviceMemory, error) {
	g.mu.Lock()
	defer g.mu.Unlock()
	if g.alloc == nil {
		g.alloc, g.next = map[uintptr][]byte{}, 1<<32
	}
	base := g.next
	g.next += uintptr(n) + 1<<20
	g.alloc[base] = make([]byte, n)
	return fakeDevMem{g: g, base: base}, nil
}

func (g *fakeGPU) live() int {
	g.mu.Lock()
	defer g.mu.Unlock()
	return len(g.alloc)
}

// at returns the n bytes at address p.
func (g *fakeGPU) at(p uintptr, n int64) []byte {
	g.mu.Lock()
	defer g.mu.Unlock()
	for base, b := range g.alloc {
		if p >= base && p+uintptr(n) <= base+uintptr(len(b)) {
			return b[p-base : p-base+uintptr(n)]
		}
	}
	panic(fmt.Sprintf("fake GPU: no allocation holds [%#x, +%d)", p, n))
}

type fakeCopier struct {
	g              *fakeGPU
	h2d, d2s, host int
}

func (c *fakeCopier) CopyIn(ctx context.Context, dst gpubuf.Memory, dstOff int64, src []byte) error {
	c.host++
	copy(dst.(*fakeSlab).b[dstOff:], src)
	return nil
}

func (c *fakeCopier) HostToDevice(ctx context.Context, device int, dst uintptr, src []byte) error {
	c.h2d++
	copy(c.g.at(dst, int64(len(src))), src)
	return nil
}

func (c *fakeCopier) DeviceToSlab(ctx context.Context, dst gpubuf.Memory, dstOff int64, src uintptr, n int64) error {
	c.d2s++
	copy(dst.(*fakeSlab).b[dstOff:], c.g.at(src, n))
	return nil
}

// fakeSlab is a CUDA slab of the fake GPU.
type fakeSlab struct {
	b      []byte
	device int
}

func (s *fakeSlab) Size() int64             { return int64(len(s.b)) }
func (s *fakeSlab) Export() ([]byte, error) { return nil, nil }
func (s *fakeSlab) Close() error            { return nil }
func (s *fakeSlab) DevicePtr() uintptr      { return 0 }
func (s *fakeSlab) Device() int             { return s.device }

var _ gpubuf.DeviceMemory = (*fakeSlab)(nil)

func newDeviceTier(t *testing.T, deviceBytes int64) (*Tier, *fakeGPU) {
	t.Helper()
	g := &fakeGPU{}
	tr, err := New(Config{BudgetBytes: 4 << 20, ChunkBytes: 64 * kib, SettleTime: -1, DeviceBytes: deviceBytes, DeviceAlloc: g})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		tr.Close()
		if n := g.live(); n != 0 {
			t.Errorf("%d device extents not freed after Close", n)
		}
	})
	return tr, g
}

// readVia reads the whole file f through the tier into a slab of device.
func readVia(t *testing.T, tr *Tier, c *fakeCopier, f *os.File, size int64, device int) []byte {
	t.Helper()
	v, ok := tr.Lookup(ident(t, f), [][2]int64{{0, size}})
	if !ok {
		t.Fatal("miss")
	}
	defer v.Release()
	s := &fakeSlab{b: make([]byte, size+8192), device: device}
	n, err := Engine{View: v, Copier: c}.ReadAt(context.Background(), f, s, 4096, 0, size)
	if err != nil || n != size {
		t.Fatalf("ReadAt: %d, %v", n, err)
	}
	return s.b[4096 : 4096+n]
}

// TestDeviceTier: the first hit on a GPU makes the file's copy there, and
// later hits there are device-to-device; each GPU has its own copy; a copy
// is made only of a file held whole and within the budget, evicted least
// recently used first, and freed with its file.
func TestDeviceTier(t *testing.T) {
	tr, g := newDeviceTier(t, 256*kib)
	dir := t.TempDir()
	data, f := writeFile(t, dir, "a", 3*64*kib+5, 1)
	size := int64(len(data))
	if _, err := tr.Pin(context.Background(), f, f.Name(), 1, 0, -1); err != nil {
		t.Fatal(err)
	}
	c := &fakeCopier{g: g}
	if got := readVia(t, tr, c, f, size, 0); !bytes.Equal(got, data) || c.h2d != 4 || c.d2s != 4 || c.host != 0 {
		t.Fatalf("first read on GPU 0: equal %v, %d H2D, %d D2D, %d host copies", bytes.Equal(got, data), c.h2d, c.d2s, c.host)
	}
	*c = fakeCopier{g: g}
	if got := readVia(t, tr, c, f, size, 0); !bytes.Equal(got, data) || c.h2d != 0 || c.d2s != 4 {
		t.Fatalf("second read on GPU 0: equal %v, %d H2D, %d D2D", bytes.Equal(got, data), c.h2d, c.d2s)
	}
	st := tr.Stats()
	if st.DeviceAdmits != 1 || st.DeviceHits != 1 || len(st.Devices) != 1 || st.Devices[0].Bytes != 3*64*kib+4096 {
		t.Fatalf("device stats: %+v", st)
	}
	// GPU 1 gets its own copy.
	if got := readVia(t, tr, c, f, size, 1); !bytes.Equal(got, data) || tr.Stats().DeviceAdmits != 2 {
		t.Fatalf("GPU 1: equal %v, stats %+v", bytes.Equal(got, data), tr.Stats())
	}
	// A second file on GPU 0 evicts the first's copy (the budget holds one).
	data2, f2 := writeFile(t, dir, "b", 64*kib, 2)
	if _, err := tr.Pin(context.Background(), f2, f2.Name(), 1, 0, -1); err != nil {
		t.Fatal(err)
	}
	if got := readVia(t, tr, c, f2, int64(len(data2)), 0); !bytes.Equal(got, data2) {
		t.Fatal("second file on GPU 0: bytes differ")
	}
	if st := tr.Stats(); st.DeviceEvictions != 1 || st.DeviceAdmits != 3 {
		t.Fatalf("after the second file: %+v", st)
	}
	// Invalidating a file frees its copies.
	before := g.live()
	tr.Invalidate(ident(t, f).Key) // its copy on GPU 1: 4 extents
	if g.live() != before-4 {
		t.Fatalf("device extents %d -> %d after invalidating a file with a copy of 4", before, g.live())
	}
}

// TestDeviceTierNoRoom: a file larger than the device budget, or not held
// whole, is served from host memory.
func TestDeviceTierNoRoom(t *testing.T) {
	tr, g := newDeviceTier(t, 64*kib)
	data, f := writeFile(t, t.TempDir(), "a", 2*64*kib, 3)
	if _, err := tr.Pin(context.Background(), f, f.Name(), 1, 0, 64*kib); err != nil {
		t.Fatal(err)
	}
	c := &fakeCopier{g: g}
	v, ok := tr.Lookup(ident(t, f), [][2]int64{{0, 4096}})
	if !ok {
		t.Fatal("miss")
	}
	s := &fakeSlab{b: make([]byte, 8192)}
	if n, err := (Engine{View: v, Copier: c}).ReadAt(context.Background(), f, s, 0, 0, 4096); err != nil || n != 4096 || c.host != 1 || !bytes.Equal(s.b[:4096], data[:4096]) {
		t.Fatalf("partly pinned file: %d, %v, %d host copies", n, err, c.host)
	}
	v.Release()
	if _, err := tr.Pin(context.Background(), f, f.Name(), 1, 0, -1); err != nil {
		t.Fatal(err)
	}
	*c = fakeCopier{g: g}
	if got := readVia(t, tr, c, f, int64(len(data)), 0); !bytes.Equal(got, data) || c.h2d != 0 || c.host != 2 {
		t.Fatalf("file beyond the device budget: equal %v, %d H2D, %d host copies", bytes.Equal(got, data), c.h2d, c.host)
	}
	if g.live() != 0 {
		t.Fatalf("%d device extents allocated", g.live())
	}
}
