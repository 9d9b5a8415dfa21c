package fs

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/rs/zerolog"
	"golang.org/x/sys/unix"
)

// cpuTime is the CPU time (user and system) this process used so far:
// the client's and the daemon's, both in the benchmark's process.
func cpuTime(b *testing.B) time.Duration {
	var ru unix.Rusage
	if err := unix.Getrusage(unix.RUSAGE_SELF, &ru); err != nil {
		b.Fatal(err)
	}
	return time.Duration(ru.Utime.Nano() + ru.Stime.Nano())
}

// reportCPU reports the CPU time per operation since start: on a shared
// machine the wall-clock time per operation mostly measures the
// neighbours (how soon the daemon's and the client's threads run again),
// the CPU time what the path itself costs.
func reportCPU(b *testing.B, start time.Duration) {
	b.ReportMetric(float64(cpuTime(b)-start)/float64(b.N), "cpu-ns/op")
}

// lookupBenchFiles is how many files the lookup benchmarks cycle over.
const lookupBenchFiles = 2000

// mountForLookupBench mounts a backing directory of lookupBenchFiles small
// files in d/ with o's timeouts and returns the mounted d/.
func mountForLookupBench(b *testing.B, o Options) string {
	b.Helper()
	if os.Geteuid() != 0 {
		b.Skip("mounting FUSE needs root")
	}
	dir := b.TempDir()
	backing, mnt := filepath.Join(dir, "backing"), filepath.Join(dir, "mnt")
	for _, d := range []string{backing, mnt, filepath.Join(backing, "d")} {
		if err := os.Mkdir(d, 0o755); err != nil {
			b.Fatal(err)
		}
	}
	for i := range lookupBenchFiles {
		if err := os.WriteFile(filepath.Join(backing, "d", fmt.Sprintf("f%05d", i)), []byte("x"), 0o644); err != nil {
			b.Fatal(err)
		}
	}
	o.Source, o.Mountpoint, o.Logger = backing, mnt, zerolog.Nop()
	srv, err := Mount(context.Background(), o)
	if err != nil {
		b.Fatal(err)
	}
	b.Cleanup(func() {
		if err := srv.Unmount(); err != nil {
			srv.UnmountLazy()
		}
		srv.Wait()
	})
	return filepath.Join(mnt, "d")
}

// BenchmarkLookup lstats files on the mount with the kernel's name cache
// off (entry timeout 0), so every stat reaches the daemon as a LOOKUP of a
// known inode: what each file of a dataset costs every epoch once the
// kernel's entries expired. Open adds the OPEN and RELEASE (and, before
// read-only opens answered FOPEN_NOFLUSH, the FLUSH) a sample read makes,
// and a read through passthrough. Besides ns/op each reports cpu-ns/op,
// the process's CPU time per operation (client and daemon).
func BenchmarkLookup(b *testing.B) {
	names := make([]string, lookupBenchFiles)
	for i := range names {
		names[i] = fmt.Sprintf("f%05d", i)
	}
	b.Run("stat", func(b *testing.B) {
		d := mountForLookupBench(b, Options{EntryTimeout: -1})
		var st syscall.Stat_t
		b.ResetTimer()
		cpu := cpuTime(b)
		for i := range b.N {
			if err := syscall.Lstat(d+"/"+names[i%len(names)], &st); err != nil {
				b.Fatal(err)
			}
		}
		reportCPU(b, cpu)
	})
	b.Run("open", func(b *testing.B) {
		d := mountForLookupBench(b, Options{EntryTimeout: -1})
		buf := make([]byte, 16)
		b.ResetTimer()
		cpu := cpuTime(b)
		for i := range b.N {
			fd, err := syscall.Open(d+"/"+names[i%len(names)], syscall.O_RDONLY|syscall.O_CLOEXEC, 0)
			if err != nil {
				b.Fatal(err)
			}
			if _, err := syscall.Read(fd, buf); err != nil {
				b.Fatal(err)
			}
			syscall.Close(fd)
		}
		reportCPU(b, cpu)
	})
	// Loader workers open different files at once: with passthrough each
	// open registers its backing file with the kernel under one lock of
	// go-fuse's (backingMu), which this shows with -cpu 1,4,16.
	b.Run("open-parallel", func(b *testing.B) {
		d := mountForLookupBench(b, Options{EntryTimeout: -1})
		var next atomic.Int64
		b.ResetTimer()
		b.RunParallel(func(pb *testing.PB) {
			buf := make([]byte, 16)
			for pb.Next() {
				fd, err := syscall.Open(d+"/"+names[next.Add(1)%int64(len(names))], syscall.O_RDONLY|syscall.O_CLOEXEC, 0)
				if err != nil {
					b.Error(err)
					return
				}
				if _, err := syscall.Read(fd, buf); err != nil {
					b.Error(err)
				}
				syscall.Close(fd)
			}
		})
	})
}
