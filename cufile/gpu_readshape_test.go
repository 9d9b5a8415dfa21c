package cufile

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"testing"
)

// BenchmarkGPUPosixReadShape is BenchmarkHostReadShape for the posix
// engine on a GPU: a 1 GiB file (under GDSFS_GPU_TEST_DIR, the disk under
// test) read into device memory as 4 MiB and 16 MiB ranges, 8 in flight
// (readRanges' concurrency on a 16-CPU daemon), through ReadAt ("at") and
// through ReadVec with one segment per call ("vec": what the daemon's
// vectored READ does with a batch run's range), cold and warm, cold ranges
// split into DefaultColdTaskBytes tasks (on) or not (off). "disk" is one
// stream of 8 MiB preads of the same cold file. Skips without a GPU.
func BenchmarkGPUPosixReadShape(b *testing.B) {
	d, err := LoadDriver()
	if err != nil {
		b.Skipf("no GPU: %v", err)
	}
	const size = 1 << 30
	dir := os.Getenv("GDSFS_GPU_TEST_DIR")
	if dir == "" {
		dir = b.TempDir()
	}
	p := filepath.Join(dir, "gpu-readshape.dat")
	data := make([]byte, size)
	for i := range data {
		data[i] = byte(i * 7)
	}
	if err := os.WriteFile(p, data, 0o600); err != nil {
		b.Fatal(err)
	}
	b.Cleanup(func() { os.Remove(p) })
	f, err := os.Open(p)
	if err != nil {
		b.Fatal(err)
	}
	defer f.Close()
	if err := f.Sync(); err != nil {
		b.Fatal(err)
	}
	be, _ := newCUDABackend(d)
	mem, err := be.Alloc(context.Background(), 0, size, 0)
	if err != nil {
		b.Fatal(err)
	}
	defer mem.Close()
	b.Run("disk", func(b *testing.B) {
		buf := make([]byte, 8<<20)
		b.SetBytes(size)
		for b.Loop() {
			b.StopTimer()
			dropPages(b, f)
			b.StartTimer()
			for off := int64(0); off < size; off += int64(len(buf)) {
				if _, err := preadFull(f, buf, off); err != nil {
					b.Fatal(err)
				}
			}
		}
	})
	engines := map[string]*posixEngine{
		"off": newPosixEngine(cudaStager{d: d}, Options{ColdTaskBytes: DefaultChunkBytes}),
		"on":  newPosixEngine(cudaStager{d: d}, Options{}),
	}
	for _, e := range engines {
		defer e.Close()
	}
	for _, temp := range []string{"cold", "warm"} {
		for _, rng := range []int64{4 << 20, 16 << 20} {
			for _, call := range []string{"at", "vec"} {
				for _, split := range []string{"off", "on"} {
					e := engines[split]
					b.Run(fmt.Sprintf("%s/range=%dMiB/%s/split=%s", temp, rng>>20, call, split), func(b *testing.B) {
						b.SetBytes(size)
						for b.Loop() {
							if temp == "cold" {
								b.StopTimer()
								dropPages(b, f)
								b.StartTimer()
							}
							readStream(b, size, rng, 8, func(off, n int64) error {
								if call == "vec" {
									_, err := e.ReadVec(context.Background(), f, []Segment{{Dst: mem, DstOff: off, FileOff: off, N: n}})
									return err
								}
								_, err := e.ReadAt(context.Background(), f, mem, off, off, n)
								return err
							})
						}
					})
				}
			}
		}
	}
}
