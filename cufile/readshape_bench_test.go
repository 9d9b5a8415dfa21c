package cufile

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"sync"
	"sync/atomic"
	"testing"

	"golang.org/x/sys/unix"
)

// dropPages evicts f's pages from the page cache (its own pages only: the
// machine's other tenants keep theirs).
func dropPages(tb testing.TB, f *os.File) {
	tb.Helper()
	if err := unix.Fadvise(int(f.Fd()), 0, 0, unix.FADV_DONTNEED); err != nil {
		tb.Fatal(err)
	}
}

// BenchmarkHostReadShape reads a 128 MiB file as a stream of ranges through
// the host engine (default options), two ranges in flight (readRanges'
// concurrency on a 2-CPU daemon), cold (pages dropped before each pass)
// and warm, with cold ranges split into DefaultColdTaskBytes tasks (on)
// or not (off: one task per ChunkBytes, the engines before the split);
// "disk" is one stream of 8 MiB preads of the same cold file, the rate to
// match.
func BenchmarkHostReadShape(b *testing.B) {
	const size = 128 << 20
	f := benchFile(b, size)
	dst := &hostMem{mmapBytes(size)}
	b.Run("disk", func(b *testing.B) {
		buf := mmapBytes(8 << 20)
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
	for _, temp := range []string{"cold", "warm"} {
		for _, rng := range []int64{256 << 10, 4 << 20, 16 << 20} {
			for _, split := range []string{"off", "on"} {
				opts := Options{}
				if split == "off" {
					opts.ColdTaskBytes = DefaultChunkBytes // the engines before the split
				}
				e := NewHostEngine(opts)
				b.Run(fmt.Sprintf("%s/range=%dKiB/split=%s", temp, rng>>10, split), func(b *testing.B) {
					b.SetBytes(size)
					for b.Loop() {
						if temp == "cold" {
							b.StopTimer()
							dropPages(b, f)
							b.StartTimer()
						}
						readStream(b, size, rng, 2, func(off, n int64) error {
							_, err := e.ReadAt(context.Background(), f, dst, off, off, n)
							return err
						})
					}
				})
			}
		}
	}
}

// readStream reads [0, size) as ranges of rng bytes, inflight at a time,
// with read (one engine call per range).
func readStream(b *testing.B, size, rng int64, inflight int, read func(off, n int64) error) {
	var next atomic.Int64
	var wg sync.WaitGroup
	for range inflight {
		wg.Go(func() {
			for {
				off := (next.Add(1) - 1) * rng
				if off >= size {
					return
				}
				if err := read(off, min(rng, size-off)); err != nil {
					b.Error(err)
					return
				}
			}
		})
	}
	wg.Wait()
}

// BenchmarkReadTaskBytes is the residency probe's cost per read of a
// cached range (what a warm READ pays for the split).
func BenchmarkReadTaskBytes(b *testing.B) {
	p := filepath.Join(b.TempDir(), "data")
	if err := os.WriteFile(p, make([]byte, 64<<20), 0o600); err != nil {
		b.Fatal(err)
	}
	f, err := os.Open(p)
	if err != nil {
		b.Fatal(err)
	}
	defer f.Close()
	opts := Options{}.withDefaults()
	for _, n := range []int64{4 << 20, 16 << 20} {
		b.Run(fmt.Sprintf("%dMiB", n>>20), func(b *testing.B) {
			for b.Loop() {
				if opts.readTaskBytes(f, 8<<20, n, false) != opts.ChunkBytes {
					b.Fatal("a cached range got cold tasks")
				}
			}
		})
	}
}

// BenchmarkColdAdvice reads a 512 MiB file (under $TMPDIR) in one host
// engine ReadAt, cold (its pages dropped first), with the cold advice off
// (the default) and at auto (--cold-readahead auto), and the warm read
// right after such a cold read: WILLNEED fills the page cache with small
// pages, which the warm read then copies more slowly (on the CI machine
// 0.40x; docs/reliability.md, the session 7 review). The "disk" rate to match is
// BenchmarkHostReadShape/disk.
func BenchmarkColdAdvice(b *testing.B) {
	const size = 512 << 20
	f := benchFile(b, size)
	dst := &hostMem{mmapBytes(size)}
	read := func(e Engine) {
		if _, err := e.ReadAt(context.Background(), f, dst, 0, 0, size); err != nil {
			b.Fatal(err)
		}
	}
	for _, adv := range []struct {
		name  string
		ahead int64
	}{{"off", 0}, {"auto", -1}} {
		e := NewHostEngine(Options{ColdReadAheadBytes: adv.ahead})
		b.Run("cold/advice="+adv.name, func(b *testing.B) {
			b.SetBytes(size)
			for b.Loop() {
				b.StopTimer()
				dropPages(b, f)
				b.StartTimer()
				read(e)
			}
		})
		b.Run("warm-after-cold/advice="+adv.name, func(b *testing.B) {
			b.SetBytes(size)
			for b.Loop() {
				b.StopTimer()
				dropPages(b, f)
				read(e)
				b.StartTimer()
				read(e)
			}
		})
	}
}

// benchFile writes a synced file of size patterned bytes under b's temp
// directory and opens it for reading, closed when b ends.
func benchFile(b *testing.B, size int) *os.File {
	b.Helper()
	return streamFile(b, filepath.Join(b.TempDir(), "data"), size)
}
