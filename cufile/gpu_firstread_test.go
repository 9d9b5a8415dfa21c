package cufile

import (
	"bytes"
	"context"
	"os"
	"testing"
	"time"

	"github.com/gdsfs/gdsfs/gpubuf"
)

// TestGPUFirstReadsOfCachedFiles reads cached files into slabs with every
// engine, in the order a daemon meets them (a fresh slab, the same slab
// again, another fresh slab, a second file), checking every byte and
// logging each read's rate. The GPU run of 2026-12-01 20:51 loaded a
// cached 8 GiB DCP checkpoint at 3.6 GB/s once and at 31.5 GB/s after:
// these figures tell a once-per-process cost from a once-per-slab or
// once-per-file one.
func TestGPUFirstReadsOfCachedFiles(t *testing.T) {
	e := gpuEngines(t)
	const size = 512 << 20
	f1, d1 := gpuTestFile(t, size)
	f2, d2 := gpuTestFile(t, size+gpubuf.Align)
	ctx := context.Background()
	// Through the page cache: both files cached, as after a buffered load.
	for _, f := range []*os.File{f1, f2} {
		st, err := f.Stat()
		if err != nil {
			t.Fatal(err)
		}
		if _, err := f.ReadAt(make([]byte, st.Size()), 0); err != nil {
			t.Fatal(err)
		}
	}
	engines := []Engine{newPosixEngine(cudaStager{d: e.drv}, Options{Direct: "never"})}
	if e.gds != nil {
		engines = append([]Engine{e.gds}, engines...)
	}
	for _, eng := range engines {
		t.Run(eng.Name(), func(t *testing.T) {
			alloc := func() gpubuf.Memory {
				m, err := e.Backend().Alloc(ctx, 0, size+gpubuf.Align, 0)
				if err != nil {
					t.Fatal(err)
				}
				t.Cleanup(func() { m.Close() })
				return m
			}
			a, b, c := alloc(), alloc(), alloc()
			for _, step := range []struct {
				what string
				mem  gpubuf.Memory
				f    *os.File
				data []byte
			}{
				{"file 1, fresh slab A", a, f1, d1},
				{"file 1, slab A again", a, f1, d1},
				{"file 1, fresh slab B", b, f1, d1},
				{"file 2 (new), slab A", a, f2, d2},
				{"file 2, slab A again", a, f2, d2},
				// Per allocation or per byte: 4 KiB into a fresh slab, then all of it.
				{"file 1, fresh slab C, 4 KiB", c, f1, d1[:gpubuf.Align]},
				{"file 1, slab C, all", c, f1, d1},
			} {
				t0 := time.Now()
				got, err := eng.ReadAt(ctx, step.f, step.mem, 0, 0, int64(len(step.data)))
				secs := time.Since(t0).Seconds()
				if err != nil || got != int64(len(step.data)) {
					t.Fatalf("%s: ReadAt = %d, %v; want %d", step.what, got, err, len(step.data))
				}
				back := make([]byte, len(step.data))
				if err := e.drv.CopyDtoH(0, back, step.mem.(gpubuf.DeviceMemory).DevicePtr()); err != nil {
					t.Fatal(err)
				}
				if !bytes.Equal(back, step.data) {
					t.Fatalf("%s: bytes differ from the file", step.what)
				}
				t.Logf("%-10s %-24s %7.2f GB/s (%.1f ms)", eng.Name(), step.what, float64(got)/secs/1e9, secs*1e3)
			}
		})
	}
}
