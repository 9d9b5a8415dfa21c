package integration

import (
	"context"
	"os"
	"path/filepath"
	"slices"
	"sync/atomic"
	"testing"
	"time"

	"github.com/gdsfs/gdsfs/ctl"
)

// Benchmarks of the control path with the host engine. Single runs are
// noisy on shared machines: scripts/bench-control.sh alternates the pairs
// and prints medians. By hand:
//
//	go test -run '^$' -bench 'Control|Pread' -benchtime 3s ./integration/
//
// Throughput pairs (same concurrency, warm page cache):
//   - BenchmarkControlRead8MiB: READ ioctls of 8 MiB ranges into host slabs
//     (plus RELEASE), GOMAXPROCS clients in parallel.
//   - BenchmarkPread8MiB: pread(2) of the same ranges of the backing file
//     into private buffers, the same number of goroutines.
//
// Latency pair (one client, p50/p99 reported as metrics):
//   - BenchmarkControlRead4KiB: one READ of 4 KiB.
//   - BenchmarkMountPread4KiB: one pread(2) of 4 KiB through the mount.

const benchFileBytes = 256 << 20

func benchMount(b *testing.B) (*testMount, string) {
	b.Helper()
	m := startMount(b, mountOpts{Daemon: true, OtherUIDs: true, SlabBytes: 64 << 20, BudgetBytes: 1 << 30})
	name := "bench.bin"
	m.addFile(b, name, benchFileBytes, 77)
	// Warm the page cache: both sides of each pair read cached data.
	if _, err := os.ReadFile(filepath.Join(m.backing, name)); err != nil {
		b.Fatal(err)
	}
	return m, name
}

func BenchmarkControlRead8MiB(b *testing.B) {
	m, name := benchMount(b)
	const chunk = 8 << 20
	var next atomic.Int64
	b.SetBytes(chunk)
	b.ResetTimer()
	b.RunParallel(func(pb *testing.PB) {
		ctx := context.Background()
		cl, err := ctl.OpenSession(m.mnt)
		if err != nil {
			b.Error(err)
			return
		}
		defer cl.Close()
		f, err := os.Open(filepath.Join(m.mnt, name))
		if err != nil {
			b.Error(err)
			return
		}
		defer f.Close()
		for pb.Next() {
			off := uint64(next.Add(1)%(benchFileBytes/chunk)) * chunk
			ls, err := cl.Read(ctx, f, ctl.HostDevice, []ctl.Range{{Offset: off, Length: chunk}})
			if err != nil {
				b.Error(err)
				return
			}
			if err := cl.Release(ctx, ls[0].ID); err != nil {
				b.Error(err)
				return
			}
		}
	})
}

func BenchmarkPread8MiB(b *testing.B) {
	m, name := benchMount(b)
	const chunk = 8 << 20
	var next atomic.Int64
	b.SetBytes(chunk)
	b.ResetTimer()
	b.RunParallel(func(pb *testing.PB) {
		f, err := os.Open(filepath.Join(m.backing, name))
		if err != nil {
			b.Error(err)
			return
		}
		defer f.Close()
		buf := make([]byte, chunk)
		for pb.Next() {
			off := (next.Add(1) % (benchFileBytes / chunk)) * chunk
			if _, err := f.ReadAt(buf, off); err != nil {
				b.Error(err)
				return
			}
		}
	})
}

// reportLatency adds p50 and p99 of ds (nanoseconds) as benchmark metrics.
func reportLatency(b *testing.B, ds []time.Duration) {
	if len(ds) == 0 {
		return
	}
	slices.Sort(ds)
	b.ReportMetric(float64(ds[len(ds)/2].Nanoseconds())/1e3, "p50-µs")
	b.ReportMetric(float64(ds[len(ds)*99/100].Nanoseconds())/1e3, "p99-µs")
}

func BenchmarkControlRead4KiB(b *testing.B) {
	m, name := benchMount(b)
	ctx := context.Background()
	cl, err := ctl.OpenSession(m.mnt)
	if err != nil {
		b.Fatal(err)
	}
	defer cl.Close()
	f, err := os.Open(filepath.Join(m.mnt, name))
	if err != nil {
		b.Fatal(err)
	}
	defer f.Close()
	ds := make([]time.Duration, 0, b.N)
	var held []uint64
	b.ResetTimer()
	for i := range b.N {
		off := uint64(i%(benchFileBytes/4096)) * 4096
		start := time.Now()
		ls, err := cl.Read(ctx, f, ctl.HostDevice, []ctl.Range{{Offset: off, Length: 4096}})
		ds = append(ds, time.Since(start))
		if err != nil {
			b.Fatal(err)
		}
		held = append(held, ls[0].ID)
		if len(held) == ctl.MaxReleaseIDs {
			if err := cl.Release(ctx, held...); err != nil {
				b.Fatal(err)
			}
			held = held[:0]
		}
	}
	b.StopTimer()
	reportLatency(b, ds)
}

func BenchmarkMountPread4KiB(b *testing.B) {
	m, name := benchMount(b)
	f, err := os.Open(filepath.Join(m.mnt, name))
	if err != nil {
		b.Fatal(err)
	}
	defer f.Close()
	buf := make([]byte, 4096)
	ds := make([]time.Duration, 0, b.N)
	b.ResetTimer()
	for i := range b.N {
		off := int64(i%(benchFileBytes/4096)) * 4096
		start := time.Now()
		if _, err := f.ReadAt(buf, off); err != nil {
			b.Fatal(err)
		}
		ds = append(ds, time.Since(start))
	}
	b.StopTimer()
	reportLatency(b, ds)
}
