package cufile

import (
	"bytes"
	"context"
	"fmt"
	"os"
	"runtime"
	"slices"
	"testing"
	"time"

	"github.com/gdsfs/gdsfs/gpubuf"
)

// TestGPUCompatFirstTouch measures, on a GPU host without nvidia-fs
// (cuFile compat mode), what a fresh daemon's first warm load costs now
// that compat mode never registers slabs (bufregister.go), on a cached
// file into slabs of the daemon's size, checking every byte: the engine's
// first READ into a fresh slab (2026-12-02 02:20, registering inside it:
// 27.9 ms; unregistered cuFileRead: 0.20 ms), a 512 MiB load into 8 fresh
// slabs through the engine the daemon's chooser gives each READ, the same
// load again, posix into 8 fresh slabs, and for comparison
// cuFileBufRegister alone and a load into 8 slabs registered first (so the
// log tells whether unregistered large reads run as fast as registered
// ones: compat mode bounces through its own buffers either way). It also
// checks that no transfer registered a slab.
func TestGPUCompatFirstTouch(t *testing.T) {
	e := gpuEngines(t)
	switch {
	case e.gds == nil:
		t.Skip("no libcufile: cuFile compat mode is not used here")
	case e.nvfs:
		t.Skip("nvidia-fs present: cuFile reads by DMA into registered slabs, compat mode does not apply")
	}
	const (
		slab  = gpubuf.DefaultSlabBytes
		size  = 8 * slab
		read  = 8 << 20 // a READ's range
		small = gpubuf.Align
	)
	f, data := gpuTestFile(t, size)
	if _, err := f.ReadAt(make([]byte, size), 0); err != nil { // cached, as after a buffered load
		t.Fatal(err)
	}
	ctx := context.Background()
	// choose is the daemon's chooser for a READ of [off, off+n).
	choose := func(off, n int64) Engine {
		eng, why := e.ChooseAs(f, f.Name(), off, n, nil)
		if eng.Name() != EngineGDSCompat {
			t.Fatalf("a cached range is chosen as %s (%q), want %s", eng.Name(), why, EngineGDSCompat)
		}
		return eng
	}
	alloc := func() gpubuf.Memory {
		m, err := e.Backend().Alloc(ctx, 0, slab, 0)
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { m.Close() })
		return m
	}
	fresh := func() []gpubuf.Memory {
		s := make([]gpubuf.Memory, size/slab)
		for i := range s {
			s[i] = alloc()
		}
		return s
	}
	check := func(what string, m gpubuf.Memory, want []byte) {
		back := make([]byte, len(want))
		if err := e.drv.CopyDtoH(0, back, m.(gpubuf.DeviceMemory).DevicePtr()); err != nil {
			t.Fatal(err)
		}
		if !bytes.Equal(back, want) {
			t.Fatalf("%s: bytes differ from the file", what)
		}
	}
	registered := func(m gpubuf.Memory) bool {
		var c *cudaMemory
		switch m := m.(type) {
		case *cudaMemory:
			c = m
		case *vmmMemory:
			c = &m.cudaMemory
		default:
			return false
		}
		c.regMu.Lock()
		defer c.regMu.Unlock()
		return c.registered != nil
	}
	logf := func(what string, n int64, d time.Duration) {
		t.Logf("compatfirst: %-56s %8.2f ms %8.2f GB/s", what, d.Seconds()*1e3, float64(n)/d.Seconds()/1e9)
	}
	readInto := func(what string, eng Engine, m gpubuf.Memory, n int64) {
		t0 := time.Now()
		got, err := eng.ReadAt(ctx, f, m, 0, 0, n)
		d := time.Since(t0)
		if err != nil || got != n {
			t.Fatalf("%s: ReadAt = %d, %v; want %d", what, got, err, n)
		}
		logf(what, n, d)
		check(what, m, data[:n])
	}
	registerAll := func(what string, slabs []gpubuf.Memory) {
		t0 := time.Now()
		for _, m := range slabs {
			if err := m.(bufRegistrar).register(e.lib); err != nil {
				t.Fatalf("%s: cuFileBufRegister: %v", what, err)
			}
		}
		logf(what, int64(len(slabs))*slab, time.Since(t0))
	}
	// load reads size bytes in READs of read bytes into slabs, each READ
	// with the engine pick names for it.
	load := func(what string, slabs []gpubuf.Memory, pick func(off int64) Engine) {
		t0 := time.Now()
		for off := int64(0); off < size; off += read {
			got, err := pick(off).ReadAt(ctx, f, slabs[off/slab], off%slab, off, read)
			if err != nil || got != read {
				t.Fatalf("%s: ReadAt at %d = %d, %v", what, off, got, err)
			}
		}
		logf(what, size, time.Since(t0))
		for i, m := range slabs {
			check(what, m, data[int64(i)*slab:][:slab])
		}
	}
	daemon := func(off int64) Engine { return choose(off, read) }
	posix := func(int64) Engine { return e.posix }
	compat := func(int64) Engine { return e.gds }

	// The process's first reads of each engine pay one-time costs (lanes,
	// libcufile's bounce buffers): paid here, not in the steps below.
	readInto("warm-up: compat, process's first read", e.gds, alloc(), small)
	readInto("warm-up: posix, process's first read", e.posix, alloc(), small)

	first := alloc()
	readInto("engine's first READ, fresh slab, 4 KiB (was 27.9 ms)", choose(0, small), first, small)
	readInto("engine's second READ, the same slab, 4 KiB", choose(0, small), first, small)
	readInto("posix, fresh slab, 4 KiB", e.posix, alloc(), small)
	reg := alloc()
	registerAll("cuFileBufRegister alone, fresh slab", []gpubuf.Memory{reg})
	readInto("compat, 4 KiB into that registered slab", e.gds, reg, small)

	slabs := fresh()
	load("load, 8 fresh slabs, the daemon's engine", slabs, daemon)
	load("load again, the same slabs, the daemon's engine", slabs, daemon)
	load("load, 8 fresh slabs, posix", fresh(), posix)
	regSlabs := fresh()
	registerAll("cuFileBufRegister of 8 fresh slabs, one by one", regSlabs)
	load("load, 8 slabs registered first, compat", regSlabs, compat)
	load("load again, 8 unregistered slabs, compat", slabs, compat)
	load("load again, 8 registered slabs, compat", regSlabs, compat)
	perThread(t, e, f, alloc(), data[:small])
	for i, m := range append([]gpubuf.Memory{first}, slabs...) {
		if registered(m) {
			t.Errorf("slab %d was registered with cuFile by a compat-mode transfer", i)
		}
	}
}

// perThread times a 4 KiB cuFileRead into m on each of 16 OS threads, the
// way the gds engine's workers call it (thread locked, device context
// made current). With fresh, every goroutine exits locked, so Go ends its
// thread and the next one runs on a thread cuFile has not seen; without,
// they reuse threads that have read before. A fresh daemon's first warm
// DCP load ran 0.64 s slower than its later loads with no registration
// left (2026-12-02 02:34): if a thread's first cuFileRead (or first
// cuCtxSetCurrent) costs milliseconds, the per-transfer thread locking of
// runChunks is where it goes.
func perThread(t *testing.T, e *Engines, f *os.File, m gpubuf.Memory, want []byte) {
	t.Helper()
	fh, done, err := e.gds.acquire(f)
	if err != nil {
		t.Fatal(err)
	}
	defer done()
	dm := m.(gpubuf.DeviceMemory)
	for _, fresh := range []bool{true, false} {
		var setc, reads []time.Duration
		for i := 0; i < 16; i++ {
			type res struct {
				set, read time.Duration
				err       error
			}
			ch := make(chan res, 1)
			go func() {
				runtime.LockOSThread()
				if !fresh {
					defer runtime.UnlockOSThread()
				}
				t0 := time.Now()
				if err := e.gds.d.SetCurrent(dm.Device()); err != nil {
					ch <- res{err: err}
					return
				}
				t1 := time.Now()
				got, err := e.gds.io.Read(fh.h, dm.DevicePtr(), int64(len(want)), 0, 0)
				if err == nil && got != int64(len(want)) {
					err = fmt.Errorf("cuFileRead = %d bytes, want %d", got, len(want))
				}
				ch <- res{t1.Sub(t0), time.Since(t1), err}
			}()
			r := <-ch
			if r.err != nil {
				t.Fatal(r.err)
			}
			setc, reads = append(setc, r.set), append(reads, r.read)
		}
		slices.Sort(setc)
		slices.Sort(reads)
		what := "threads that read before"
		if fresh {
			what = "16 new OS threads, each's first"
		}
		t.Logf("compatfirst: per thread, %-34s cuCtxSetCurrent median %6.3f ms max %6.3f; 4 KiB cuFileRead median %6.3f ms max %6.3f",
			what, ms(setc[8]), ms(setc[15]), ms(reads[8]), ms(reads[15]))
	}
	back := make([]byte, len(want))
	if err := e.drv.CopyDtoH(0, back, dm.DevicePtr()); err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(back, want) {
		t.Fatal("per-thread reads: bytes differ from the file")
	}
}

func ms(d time.Duration) float64 { return d.Seconds() * 1e3 }
