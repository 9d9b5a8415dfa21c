package cufile

import (
	"bytes"
	"context"
	"testing"
	"time"

	"github.com/gdsfs/gdsfs/gpubuf"
)

// TestGPUCompatFirstTouch measures cuFile compat mode's first touch of a
// new device allocation (about 30 ms on the H200 of 2026-12-01, whatever
// the size) piece by piece, and the first warm load of a fresh daemon
// with and without the router of compatfirst.go, on a cached file into
// slabs of the daemon's size, checking every byte. It says which part
// costs: cuFileBufRegister alone, the first cuFileRead after it, or the
// first cuFileRead of memory never registered; and what a load through
// new slabs reads at: compat as before, posix, the router (posix while a
// slab registers in the background), and the router again once every
// slab is registered; last, a compat load of registered slabs while 8
// others register in the background (whether registrations stall such
// READs). Auto mode without nvidia-fs only (where the router applies).
func TestGPUCompatFirstTouch(t *testing.T) {
	e := gpuEngines(t)
	switch {
	case e.gds == nil:
		t.Skip("no libcufile: cuFile compat mode is not used here")
	case e.nvfs || e.compatPrep == nil:
		t.Skip("nvidia-fs present: cuFile reads by DMA, compat mode's first touch does not apply")
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
	fb, why := e.ChooseAs(f, f.Name(), 0, size, nil)
	if _, ok := fb.(*fallbackEngine); !ok {
		t.Fatalf("the cached file is chosen as %s (%q), want cuFile compat mode", fb.Name(), why)
	}
	alloc := func() gpubuf.Memory {
		m, err := e.Backend().Alloc(ctx, 0, slab, 0)
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { m.Close() })
		return m
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
	logf := func(what string, n int64, d time.Duration) {
		t.Logf("compatfirst: %-52s %8.2f ms %8.2f GB/s", what, d.Seconds()*1e3, float64(n)/d.Seconds()/1e9)
	}
	posix := e.posix
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
	// rawRead is cuFileRead into m without cuFileBufRegister.
	rawRead := func(what string, m gpubuf.Memory) {
		fh, done, err := e.gds.acquire(f)
		if err != nil {
			t.Fatal(err)
		}
		defer done()
		p := m.(gpubuf.DeviceMemory).DevicePtr()
		t0 := time.Now()
		var got int64
		err = e.drv.Do(0, func() (err error) { got, err = e.lib.Read(fh.h, p, small, 0, 0); return err })
		d := time.Since(t0)
		if err != nil || got != small {
			t.Fatalf("%s: cuFileRead = %d, %v", what, got, err)
		}
		logf(what, small, d)
		check(what, m, data[:small])
	}

	// The process's first reads of each engine pay one-time costs (lanes,
	// libcufile's bounce buffers): paid here, not in the steps below.
	readInto("warm-up: compat, process's first read", e.gds, alloc(), small)
	readInto("warm-up: posix, process's first read", posix, alloc(), small)

	readInto("compat, fresh slab, 4 KiB (registers inside: before)", e.gds, alloc(), small)
	reg := alloc()
	t0 := time.Now()
	if err := reg.(interface{ register(*Lib) error }).register(e.lib); err != nil {
		t.Logf("compatfirst: cuFileBufRegister failed: %v", err)
	}
	logf("cuFileBufRegister alone, fresh slab", slab, time.Since(t0))
	readInto("compat, 4 KiB into that registered slab", e.gds, reg, small)
	unreg := alloc()
	rawRead("cuFileRead, fresh slab never registered, 4 KiB", unreg)
	rawRead("cuFileRead, the same unregistered slab again", unreg)
	readInto("posix, fresh slab, 4 KiB", posix, alloc(), small)
	routed := alloc()
	if to := RouteFor(fb, slabsOf(routed)); to != Engine(posix) {
		t.Errorf("a fresh slab is routed to %s, want posix", to.Name())
	}
	t0 = time.Now()
	e.compatPrep.wait()
	logf("background registration of a fresh slab (waited for)", slab, time.Since(t0))
	if to := RouteFor(fb, slabsOf(routed)); to != fb {
		t.Errorf("a registered slab is routed to %s, want compat", to.Name())
	}
	readInto("compat, 4 KiB into the background-registered slab", fb, routed, small)

	// A fresh daemon's first warm load: size bytes in READs of read bytes
	// into new slabs of slab bytes.
	load := func(what string, slabs []gpubuf.Memory, pick func(m gpubuf.Memory) Engine) {
		served := map[string]int{}
		t0 := time.Now()
		for off := int64(0); off < size; off += read {
			m := slabs[off/slab]
			eng := pick(m)
			served[eng.Name()]++
			got, err := eng.ReadAt(ctx, f, m, off%slab, off, read)
			if err != nil || got != read {
				t.Fatalf("%s: ReadAt at %d = %d, %v", what, off, got, err)
			}
		}
		d := time.Since(t0)
		logf(what, size, d)
		t.Logf("compatfirst: %-52s READs served: %v", what, served)
		for i, m := range slabs {
			check(what, m, data[int64(i)*slab:][:slab])
		}
	}
	fresh := func() []gpubuf.Memory {
		s := make([]gpubuf.Memory, size/slab)
		for i := range s {
			s[i] = alloc()
		}
		return s
	}
	load("load, 8 fresh slabs, compat (before)", fresh(), func(gpubuf.Memory) Engine { return e.gds })
	load("load, 8 fresh slabs, posix", fresh(), func(gpubuf.Memory) Engine { return posix })
	slabs := fresh()
	load("load, 8 fresh slabs, router (after)", slabs, func(m gpubuf.Memory) Engine { return RouteFor(fb, slabsOf(m)) })
	t0 = time.Now()
	e.compatPrep.wait()
	logf("the router's background registrations, rest of", int64(len(slabs))*slab, time.Since(t0))
	load("load again, the same slabs, router", slabs, func(m gpubuf.Memory) Engine { return RouteFor(fb, slabsOf(m)) })
	load("load again, the same slabs, compat", slabs, func(gpubuf.Memory) Engine { return e.gds })
	// Registrations in the background beside compat READs of registered
	// slabs: does libcufile make those READs wait for them?
	others := fresh()
	RouteFor(fb, slabsOf(others...))
	load("load, registered slabs, compat, 8 registering beside", slabs, func(gpubuf.Memory) Engine { return e.gds })
	e.compatPrep.wait()
}
