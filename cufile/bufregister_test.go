package cufile

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"os"
	"sync"
	"testing"

	"github.com/rs/zerolog"
	"golang.org/x/sys/unix"

	"github.com/gdsfs/gdsfs/gpubuf"
	"github.com/gdsfs/gdsfs/internal/pagecache"
)

// fakeCuFile is libcufile's cuFileRead/cuFileWrite and the CUDA calls of a
// gds transfer for the CPU tests: it reads and writes the descriptor of
// the handle (from fakeHandleLib) into and out of the fake slab at base,
// as compat mode does with POSIX I/O, and counts the calls.
type fakeCuFile struct {
	handles *fakeHandleLib
	mu      sync.Mutex
	slabs   map[uintptr]*fakeCuSlab // GUARDED_BY(mu): by device pointer
	reads   int                     // GUARDED_BY(mu)
	writes  int                     // GUARDED_BY(mu)
}

func newFakeCuFile(t testing.TB) *fakeCuFile {
	return &fakeCuFile{handles: newFakeHandleLib(t), slabs: map[uintptr]*fakeCuSlab{}}
}

// fakeCuSlab is a CUDA slab (the real registration bookkeeping of
// cudaMemory) whose bytes are host memory and whose cuFileBufRegister is
// counted instead of called.
type fakeCuSlab struct {
	cudaMemory
	data []byte

	mu           sync.Mutex
	bufRegisters int // GUARDED_BY(mu): cuFileBufRegister calls
}

// register implements bufRegistrar with cudaMemory's once-per-slab rule.
func (m *fakeCuSlab) register(lib *Lib) error {
	return m.registerWith(lib, func() error {
		m.mu.Lock()
		defer m.mu.Unlock()
		m.bufRegisters++
		return nil
	})
}

func (m *fakeCuSlab) registers() int {
	m.mu.Lock()
	defer m.mu.Unlock()
	return m.bufRegisters
}

// slab returns a fresh slab of n bytes at its own device pointer.
func (c *fakeCuFile) slab(n int64) *fakeCuSlab {
	c.mu.Lock()
	defer c.mu.Unlock()
	p := uintptr(len(c.slabs)+1) << 32
	m := &fakeCuSlab{cudaMemory: cudaMemory{ptr: p, size: n}, data: make([]byte, n)}
	c.slabs[p] = m
	return m
}

func (c *fakeCuFile) at(base uintptr, off, n int64) ([]byte, error) {
	c.mu.Lock()
	defer c.mu.Unlock()
	m := c.slabs[base]
	if m == nil || off < 0 || off+n > int64(len(m.data)) {
		return nil, fmt.Errorf("fake cuFile: no slab at %#x holds [%d, %d)", base, off, off+n)
	}
	return m.data[off : off+n], nil
}

func (c *fakeCuFile) fd(h uintptr) int {
	c.handles.mu.Lock()
	defer c.handles.mu.Unlock()
	return c.handles.live[h]
}

func (c *fakeCuFile) Read(h, base uintptr, size, fileOff, bufOff int64) (int64, error) {
	c.mu.Lock()
	c.reads++
	c.mu.Unlock()
	b, err := c.at(base, bufOff, size)
	if err != nil {
		return 0, err
	}
	n, err := unix.Pread(c.fd(h), b, fileOff)
	return int64(n), err
}

func (c *fakeCuFile) Write(h, base uintptr, size, fileOff, bufOff int64) (int64, error) {
	c.mu.Lock()
	c.writes++
	c.mu.Unlock()
	b, err := c.at(base, bufOff, size)
	if err != nil {
		return 0, err
	}
	n, err := unix.Pwrite(c.fd(h), b, fileOff)
	return int64(n), err
}

func (c *fakeCuFile) SetCurrent(int) error { return nil }

func (c *fakeCuFile) Memset(_ int, p uintptr, v byte, n int64) error {
	c.mu.Lock()
	defer c.mu.Unlock()
	for base, m := range c.slabs {
		if p >= base && int64(p-base)+n <= int64(len(m.data)) {
			b := m.data[p-base:][:n]
			for i := range b {
				b[i] = v
			}
			return nil
		}
	}
	return fmt.Errorf("fake cuFile: memset of [%#x, +%d) outside every slab", p, n)
}

func (c *fakeCuFile) calls() (reads, writes int) {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.reads, c.writes
}

// cuFileConfig is one way the daemon builds its engines on a GPU host
// with libcufile (Engines.choose), with cuFile's calls faked.
type cuFileConfig struct {
	name string
	nvfs bool   // /dev/nvidia-fs* present
	auto string // report.Engine: posix for auto without nvidia-fs, else gds
}

var cuFileConfigs = []cuFileConfig{
	{"auto without nvidia-fs", false, EnginePosix},
	{"--engine gds without nvidia-fs", false, EngineGDS},
	{"nvidia-fs", true, EngineGDS},
}

// engines returns Engines as choose builds them for c, with the gds
// engine from newGDSEngine on fake cuFile calls.
func (c cuFileConfig) engines(cf *fakeCuFile) *Engines {
	g := newGDSEngine(nil, nil, 64<<10, 4, !c.nvfs)
	g.d, g.io, g.reg, g.lib = cf, cf, cf.handles, &Lib{} // a Lib only to register slabs with (faked)
	return &Engines{files: map[fileKey]choice{}, refused: newRefusals(zerolog.Nop()), gds: g, nvfs: c.nvfs,
		compatWarm: !c.nvfs && c.auto == EnginePosix, posix: &posixEngine{},
		report: Report{Engine: c.auto, Why: c.name}}
}

// wantName is the engine name a READ's reply gives under c.
func (c cuFileConfig) wantName() string {
	if c.nvfs {
		return EngineGDS
	}
	return EngineGDSCompat
}

// randomCachedFile writes size random bytes and reads them back once, so
// the file is in the page cache (where the auto chooser gives it to
// compat mode); it is opened read-write.
func randomCachedFile(t testing.TB, size int) (*os.File, []byte) {
	t.Helper()
	f, data := writeRandomFile(t, size)
	if _, ok := pagecache.Cached(f, 0, 1); !ok {
		t.Skip("kernel without cachestat(2)")
	}
	if _, err := f.ReadAt(make([]byte, size), 0); err != nil {
		t.Fatal(err)
	}
	return f, data
}

// TestCuFileRegistersSlabsOnlyWithNVFS: in cuFile compat mode (no
// nvidia-fs; --engine auto on a cached range, and --engine gds) a READ
// into a fresh slab is served by cuFile (the engine named gds-compat),
// lands the file's bytes and never calls cuFileBufRegister, nor does a
// second READ into it, a READ into another slab or a WRITE from one;
// with nvidia-fs each slab is registered once, on its first transfer.
func TestCuFileRegistersSlabsOnlyWithNVFS(t *testing.T) {
	const size = 1 << 20
	for _, c := range cuFileConfigs {
		t.Run(c.name, func(t *testing.T) {
			f, data := randomCachedFile(t, size)
			cf := newFakeCuFile(t)
			e := c.engines(cf)
			eng, why := e.ChooseAs(f, f.Name(), 0, size, nil)
			if _, ok := eng.(*fallbackEngine); !ok || eng.Name() != c.wantName() {
				t.Fatalf("the cached file is chosen as %s (%q), want cuFile as %s", eng.Name(), why, c.wantName())
			}
			ctx := context.Background()
			a, b := cf.slab(size), cf.slab(size)
			for i, step := range []struct {
				mem       *fakeCuSlab
				off, n    int64
				wantA     int // cuFileBufRegister calls on a after the step, with nvidia-fs
				wantB     int
				writeBack bool
			}{
				{a, 0, 4096, 1, 0, false},           // a fresh slab: the engine's first READ
				{a, 4096, size - 4096, 1, 0, false}, // the same slab again
				{b, 0, size, 1, 1, false},           // another fresh slab
				{b, 0, size, 1, 1, true},            // a WRITE from it
			} {
				var got int64
				var err error
				if step.writeBack {
					got, err = eng.WriteAt(ctx, f, step.mem, step.off, step.off, step.n)
				} else {
					got, err = eng.ReadAt(ctx, f, step.mem, step.off, step.off, step.n)
				}
				if err != nil || got != step.n {
					t.Fatalf("step %d: transfer = %d, %v; want %d", i, got, err, step.n)
				}
				if !bytes.Equal(step.mem.data[step.off:step.off+step.n], data[step.off:step.off+step.n]) {
					t.Fatalf("step %d: the slab's bytes differ from the file's", i)
				}
				wantA, wantB := step.wantA, step.wantB
				if !c.nvfs {
					wantA, wantB = 0, 0
				}
				if a.registers() != wantA || b.registers() != wantB {
					t.Errorf("step %d: cuFileBufRegister called %d times on slab a, %d on slab b; want %d and %d",
						i, a.registers(), b.registers(), wantA, wantB)
				}
			}
			if reads, writes := cf.calls(); reads == 0 || writes == 0 {
				t.Errorf("cuFileRead called %d times, cuFileWrite %d: the transfers did not go through cuFile", reads, writes)
			}
			if r := e.Refusals(); len(r) != 0 {
				t.Errorf("cuFile was refused or failed: %+v", r)
			}
		})
	}
}

// TestSlabRegistrationLeavesExportsFree: a slab's registration (inside
// the first gds transfer into it, with nvidia-fs) holds the lock Close
// takes (the memory is never freed under it) but not the one its export
// takes (the slab socket handing another client the slab's descriptor);
// a closed slab is not registered, a refused one not retried.
func TestSlabRegistrationLeavesExportsFree(t *testing.T) {
	m := &cudaMemory{size: gpubuf.Align}
	lib := &Lib{}
	inCall, release := make(chan struct{}), make(chan struct{})
	done := make(chan error, 1)
	go func() {
		done <- m.registerWith(lib, func() error { close(inCall); <-release; return nil })
	}()
	<-inCall
	if !m.mu.TryLock() {
		t.Error("a registration in flight holds the lock exports take")
	} else {
		m.mu.Unlock()
	}
	if m.regMu.TryLock() {
		m.regMu.Unlock()
		t.Error("a registration in flight does not hold the lock Close takes")
	}
	close(release)
	if err := <-done; err != nil {
		t.Fatal(err)
	}
	if err := m.registerWith(lib, func() error { t.Error("registered twice"); return nil }); err != nil {
		t.Errorf("second registration: %v", err)
	}
	c := &cudaMemory{size: gpubuf.Align, closed: true}
	if err := c.registerWith(lib, func() error { t.Error("closed memory registered"); return nil }); !errors.Is(err, errMemoryClosed) {
		t.Errorf("registering closed memory: %v, want errMemoryClosed", err)
	}
	failing := &cudaMemory{size: gpubuf.Align}
	bar1 := &FileError{Op: "cuFileBufRegister", Code: 5016}
	for range 2 {
		if err := failing.registerWith(lib, func() error { return bar1 }); !errors.Is(err, bar1) {
			t.Errorf("a refused registration answered %v, want %v (and not retried)", err, bar1)
		}
	}
	already := &cudaMemory{size: gpubuf.Align}
	if err := already.registerWith(lib, func() error { return &FileError{Code: fileMemoryAlreadyReg} }); err != nil || already.registered != lib {
		t.Errorf("memory cuFile had registered already: %v, registered %v", err, already.registered != nil)
	}
}

// refusingSlab is a fake slab whose cuFileBufRegister fails as when the
// GPU's BAR1 space is exhausted (5016), counted.
type refusingSlab struct {
	*fakeCuSlab
}

func (m refusingSlab) register(lib *Lib) error {
	return m.registerWith(lib, func() error {
		m.mu.Lock()
		defer m.mu.Unlock()
		m.bufRegisters++
		return &FileError{Op: "cuFileBufRegister", Code: 5016}
	})
}

// TestCuFileRegistrationRefusedIsNotFatal: with nvidia-fs, a slab that
// cuFile refuses to register is still read into by cuFile (bounced through
// its own buffers), the READ lands the file's bytes, the file is neither
// refused nor demoted to posix, and the registration is tried once, not on
// every READ; without nvidia-fs it is never tried.
func TestCuFileRegistrationRefusedIsNotFatal(t *testing.T) {
	const size = 1 << 20
	for _, c := range cuFileConfigs {
		t.Run(c.name, func(t *testing.T) {
			f, data := randomCachedFile(t, size)
			cf := newFakeCuFile(t)
			e := c.engines(cf)
			m := refusingSlab{cf.slab(size)}
			for i := range 3 {
				eng, why := e.ChooseAs(f, f.Name(), 0, size, nil)
				if _, ok := eng.(*fallbackEngine); !ok || eng.Name() != c.wantName() {
					t.Fatalf("READ %d: the file is chosen as %s (%q), want cuFile as %s", i, eng.Name(), why, c.wantName())
				}
				clear(m.data)
				got, err := eng.ReadAt(context.Background(), f, m, 0, 0, size)
				if err != nil || got != size || !bytes.Equal(m.data, data) {
					t.Fatalf("READ %d into a slab cuFile would not register = %d, %v (bytes equal %v)", i, got, err, bytes.Equal(m.data, data))
				}
			}
			want := 0
			if c.nvfs {
				want = 1
			}
			if n := m.registers(); n != want {
				t.Errorf("cuFileBufRegister tried %d times over 3 READs, want %d", n, want)
			}
			if r := e.Refusals(); len(r) != 0 {
				t.Errorf("a refused slab registration was taken for cuFile failing on the file: %+v", r)
			}
		})
	}
}
