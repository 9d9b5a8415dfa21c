package bench

import (
	"context"
	"errors"
	"fmt"
	"io"
	"math/rand/v2"
	"os"
	"path/filepath"
	"runtime"
	"sort"
	"syscall"
	"time"

	"github.com/dustin/go-humanize"
	"github.com/rs/zerolog"
	"golang.org/x/sys/unix"

	"github.com/gdsfs/gdsfs/fs"
	"github.com/gdsfs/gdsfs/internal/usage"
)

// MountConfig is the configuration of the mount suite (`gdsfs bench
// mount`); each field is the flag its comment names.
type MountConfig struct {
	Dir           string  // --dir: directory for the temporary backing files
	Size          string  // --size: size of the sequential-read file, such as 1GiB
	Files         int     // --files: small files in each set (stat, open, list)
	RandomReads   int     // --random-reads: random 4 KiB reads
	Runs          int     // --runs: runs per measurement (the median counts)
	MinRatio      float64 // --min-ratio: fail below this warm mount/direct ratio (0: no goal)
	Keep          bool    // --keep: keep the temporary directory
	NoPassthrough bool    // --no-passthrough: the daemon serves all I/O
	NoCold        bool    // --no-cold: skip the cold reads (no dropping of the page cache)
	// --entry-timeout, --attr-timeout: the mount's kernel cache timeouts,
	// as fs.Options takes them (0: the defaults; negative: no caching).
	EntryTimeout, AttrTimeout time.Duration
}

// Mount is the mount suite: sequential, random and stat throughput through
// a gdsfs mount (no control path) against the backing directory.
func Mount(c *MountConfig) Suite {
	return Suite{
		Name:        "mount",
		Description: "Sequential, random and stat throughput through a gdsfs mount vs the backing directory",
		Run: func(ctx context.Context, out io.Writer) ([]Result, error) {
			n, err := humanize.ParseBytes(c.Size)
			if err != nil || n < 1<<20 {
				return nil, usage.Errorf("--size %q: give a size of at least 1MiB, such as 1GiB", c.Size)
			}
			if c.Files < 1 || c.RandomReads < 1 || c.Runs < 1 {
				return nil, usage.Errorf("--files, --random-reads and --runs must be at least 1")
			}
			b := &mountBench{MountConfig: *c, sizeBytes: int64(n)}
			return b.run(ctx, out)
		},
	}
}

// mountBench is one run of the mount suite.
type mountBench struct {
	MountConfig
	sizeBytes int64
}

// benchRow is one line of the result table: a rate per second for the
// direct path and for the mount (higher is better).
type benchRow struct {
	name           string
	unit           string
	direct, viaFS  float64
	skippedBecause string
}

func (b *mountBench) run(ctx context.Context, out io.Writer) ([]Result, error) {
	if ctx == nil {
		ctx = context.Background()
	}
	work, err := os.MkdirTemp(b.Dir, "gdsfs-bench-")
	if err != nil {
		return nil, usage.Errorf("--dir %s: %v", b.Dir, err)
	}
	if !b.Keep {
		defer os.RemoveAll(work)
	}
	backing := filepath.Join(work, "backing")
	mnt := filepath.Join(work, "mnt")
	for _, d := range []string{backing, mnt, filepath.Join(backing, "stat"), filepath.Join(backing, "open"), filepath.Join(backing, "list")} {
		if err := os.Mkdir(d, 0o755); err != nil {
			return nil, fmt.Errorf("bench setup: %w", err)
		}
	}
	fmt.Fprintf(out, "preparing %s file and %d small files in %s\n", humanize.IBytes(uint64(b.sizeBytes)), b.Files, work)
	if err := writeBenchFile(filepath.Join(backing, "data"), b.sizeBytes); err != nil {
		return nil, err
	}
	// One set of small files per first-access measurement, so that each
	// measures names the mount has never looked up.
	for _, sub := range []string{"stat", "open", "list"} {
		for i := range b.Files {
			p := filepath.Join(backing, sub, fmt.Sprintf("f%06d", i))
			if err := os.WriteFile(p, []byte{byte(i)}, 0o644); err != nil {
				return nil, fmt.Errorf("bench setup: %w", err)
			}
		}
	}

	srv, err := fs.Mount(ctx, fs.Options{Source: backing, Mountpoint: mnt, NoPassthrough: b.NoPassthrough, Logger: zerolog.Nop(),
		EntryTimeout: b.EntryTimeout, AttrTimeout: b.AttrTimeout})
	if err != nil {
		return nil, fmt.Errorf("bench mount: %w", err)
	}
	defer func() {
		if err := srv.Unmount(); err != nil {
			srv.UnmountLazy()
		}
		srv.Wait()
	}()
	pt, why := srv.Passthrough()

	direct, viaFS := filepath.Join(backing, "data"), filepath.Join(mnt, "data")
	var rows []benchRow
	// seq is one sequential read of p, cold after emptying the page cache.
	seq := func(p string, cold bool) (float64, error) {
		if cold {
			if err := dropCaches(); err != nil {
				return 0, err
			}
		}
		return seqRead(p)
	}
	// Warm reads: one read fills the page cache, which direct and
	// passthrough reads share; measured runs then alternate direct and
	// mount so that load from other processes hits both alike.
	row := benchRow{name: "sequential read, warm", unit: "MB/s"}
	if _, err := seqRead(direct); err != nil {
		return nil, err
	}
	if row.direct, row.viaFS, err = alternate(b.Runs, direct, viaFS, func(p string) (float64, error) { return seq(p, false) }); err != nil {
		return nil, err
	}
	warm := row
	rows = append(rows, row)
	// The same reads per second of CPU time of the reading thread: on a
	// busy machine wall-clock throughput measures the neighbours, while
	// this measures the cost of the read path itself.
	row = benchRow{name: "sequential read, warm, per CPU-second", unit: "MB/cpu-s"}
	if row.direct, row.viaFS, err = alternate(b.Runs, direct, viaFS, seqReadCPU); err != nil {
		return nil, err
	}
	rows = append(rows, row)

	// Cold reads alternate too: VM disks are cached on the host, and
	// their speed drifts.
	row = benchRow{name: "sequential read, cold", unit: "MB/s"}
	if b.NoCold {
		row.skippedBecause = "--no-cold"
	} else if err := dropCaches(); err != nil {
		row.skippedBecause = err.Error()
	} else {
		if row.direct, row.viaFS, err = alternate(b.Runs, direct, viaFS, func(p string) (float64, error) { return seq(p, true) }); err != nil {
			return nil, err
		}
	}
	rows = append(rows, row)

	row = benchRow{name: "random 4 KiB reads, warm", unit: "reads/s"}
	if row.direct, err = medianOf(b.Runs, func() (float64, error) { return randRead(direct, b.sizeBytes, b.RandomReads) }); err != nil {
		return nil, err
	}
	if row.viaFS, err = medianOf(b.Runs, func() (float64, error) { return randRead(viaFS, b.sizeBytes, b.RandomReads) }); err != nil {
		return nil, err
	}
	rows = append(rows, row)

	// The first stat pass through the mount looks every name up; the
	// second is served from the kernel's caches (within the timeouts).
	row = benchRow{name: fmt.Sprintf("stat %d files, first", b.Files), unit: "stats/s"}
	if row.direct, err = statAll(filepath.Join(backing, "stat"), b.Files); err != nil {
		return nil, err
	}
	if row.viaFS, err = statAll(filepath.Join(mnt, "stat"), b.Files); err != nil {
		return nil, err
	}
	rows = append(rows, row)
	row = benchRow{name: fmt.Sprintf("stat %d files, cached", b.Files), unit: "stats/s"}
	if row.direct, err = statAll(filepath.Join(backing, "stat"), b.Files); err != nil {
		return nil, err
	}
	if row.viaFS, err = statAll(filepath.Join(mnt, "stat"), b.Files); err != nil {
		return nil, err
	}
	rows = append(rows, row)
	// Once the kernel's entries and attributes expired (a data loader's
	// next epoch), every stat is a LOOKUP again, of a name the daemon
	// knows.
	row = benchRow{name: fmt.Sprintf("stat %d files, caches expired", b.Files), unit: "stats/s"}
	if wait := max(kernelTimeout(b.EntryTimeout, fs.DefaultEntryTimeout), kernelTimeout(b.AttrTimeout, fs.DefaultAttrTimeout)); wait > maxExpiryWait {
		row.skippedBecause = fmt.Sprintf("the kernel caches for %v, longer than the %v this waits", wait, maxExpiryWait)
	} else {
		select {
		case <-time.After(wait + 50*time.Millisecond):
		case <-ctx.Done():
			return nil, ctx.Err()
		}
		if row.direct, err = statAll(filepath.Join(backing, "stat"), b.Files); err != nil {
			return nil, err
		}
		if row.viaFS, err = statAll(filepath.Join(mnt, "stat"), b.Files); err != nil {
			return nil, err
		}
	}
	rows = append(rows, row)
	// What a data loader does per sample: open, fstat, read, close a file
	// it has not opened before (LOOKUP, OPEN, FLUSH and RELEASE reach the
	// daemon, the read goes through passthrough).
	row = benchRow{name: fmt.Sprintf("open+read %d files, first", b.Files), unit: "files/s"}
	if row.direct, err = openAll(filepath.Join(backing, "open"), b.Files); err != nil {
		return nil, err
	}
	if row.viaFS, err = openAll(filepath.Join(mnt, "open"), b.Files); err != nil {
		return nil, err
	}
	rows = append(rows, row)
	// A listing (READDIRPLUS) primes the kernel's caches: the stats that
	// follow it need no LOOKUP.
	row = benchRow{name: fmt.Sprintf("list+stat %d files, first", b.Files), unit: "files/s"}
	if row.direct, err = listStatAll(filepath.Join(backing, "list")); err != nil {
		return nil, err
	}
	if row.viaFS, err = listStatAll(filepath.Join(mnt, "list")); err != nil {
		return nil, err
	}
	rows = append(rows, row)

	fmt.Fprintf(out, "passthrough: %v (%s)\n", pt, why)
	table := [][]string{{"measurement", "unit", "direct", "gdsfs", "ratio"}}
	for _, r := range rows {
		if r.skippedBecause != "" {
			table = append(table, []string{r.name, r.unit, "-", "-", "skipped: " + r.skippedBecause})
			continue
		}
		table = append(table, []string{r.name, r.unit, fmt.Sprintf("%.0f", r.direct), fmt.Sprintf("%.0f", r.viaFS), fmt.Sprintf("%.2f", r.viaFS/r.direct)})
	}
	printTable(out, true, table)

	results := make([]Result, 0, len(rows))
	for _, r := range rows {
		res := Result{Suite: "mount", Measurement: r.name, GDSFS: r.viaFS, Baseline: r.direct, Unit: r.unit, Note: "vs direct"}
		if !pt {
			res.Note += ", no passthrough"
		}
		if r.skippedBecause != "" {
			res.GDSFS, res.Baseline, res.Note = 0, 0, "skipped: "+r.skippedBecause
		}
		if r.name == warm.name && b.MinRatio > 0 {
			res.Note += fmt.Sprintf("; goal %.2f %s", b.MinRatio, goalWord(res.Ratio() >= b.MinRatio))
		}
		results = append(results, res)
	}
	if ratio := warm.viaFS / warm.direct; b.MinRatio > 0 && ratio < b.MinRatio {
		return results, fmt.Errorf("warm sequential read through the mount is %.2fx direct, below --min-ratio %.2f", ratio, b.MinRatio)
	}
	return results, nil
}

// writeBenchFile writes size bytes of incompressible data and syncs them.
func writeBenchFile(p string, size int64) error {
	f, err := os.Create(p)
	if err != nil {
		return fmt.Errorf("bench setup: %w", err)
	}
	defer f.Close()
	buf := make([]byte, 4<<20)
	rng := rand.New(rand.NewPCG(1, 2))
	for i := 0; i+8 <= len(buf); i += 8 {
		v := rng.Uint64()
		for j := range 8 {
			buf[i+j] = byte(v >> (8 * j))
		}
	}
	for off := int64(0); off < size; off += int64(len(buf)) {
		chunk := buf[:min(int64(len(buf)), size-off)]
		chunk[0] = byte(off >> 22) // no two chunks alike
		if _, err := f.Write(chunk); err != nil {
			return fmt.Errorf("bench setup: write %s: %w", p, err)
		}
	}
	if err := f.Sync(); err != nil {
		return fmt.Errorf("bench setup: fsync %s: %w", p, err)
	}
	return f.Close()
}

// seqRead reads p start to end with 1 MiB reads; it returns MB/s.
func seqRead(p string) (float64, error) {
	f, err := os.Open(p)
	if err != nil {
		return 0, err
	}
	defer f.Close()
	buf := make([]byte, 1<<20)
	start := time.Now()
	var n int64
	for {
		k, err := f.Read(buf)
		n += int64(k)
		if errors.Is(err, io.EOF) {
			break
		}
		if err != nil {
			return 0, fmt.Errorf("read %s: %w", p, err)
		}
	}
	return float64(n) / 1e6 / time.Since(start).Seconds(), nil
}

// minCPUTime is the least CPU time seqReadCPU measures: the kernel
// accounts a thread's time in ticks on some configurations, and one pass
// over a small file may not reach one.
const minCPUTime = 50 * time.Millisecond

// seqReadCPU reads p like seqRead on one locked OS thread and returns MB
// per second of that thread's CPU time (user + system). A small file is
// read again until minCPUTime is spent.
func seqReadCPU(p string) (float64, error) {
	runtime.LockOSThread()
	defer runtime.UnlockOSThread()
	f, err := os.Open(p)
	if err != nil {
		return 0, err
	}
	defer f.Close()
	buf := make([]byte, 1<<20)
	var before, after unix.Rusage
	if err := unix.Getrusage(unix.RUSAGE_THREAD, &before); err != nil {
		return 0, fmt.Errorf("getrusage: %w", err)
	}
	var n int64
	var cpu time.Duration
	for pass := 0; cpu < minCPUTime; pass++ {
		for off := int64(0); ; {
			k, err := unix.Pread(int(f.Fd()), buf, off) // no poller: stay on this thread
			if err != nil {
				return 0, fmt.Errorf("read %s: %w", p, err)
			}
			if k == 0 {
				break
			}
			n += int64(k)
			off += int64(k)
		}
		if err := unix.Getrusage(unix.RUSAGE_THREAD, &after); err != nil {
			return 0, fmt.Errorf("getrusage: %w", err)
		}
		cpu = time.Duration(after.Utime.Nano() - before.Utime.Nano() + after.Stime.Nano() - before.Stime.Nano())
		if n == 0 || pass > 1e6 {
			return 0, fmt.Errorf("read %s: no CPU time measured after %d bytes", p, n)
		}
	}
	return float64(n) / 1e6 / cpu.Seconds(), nil
}

// randRead does n 4 KiB preads at random aligned offsets; it returns
// reads/s.
func randRead(p string, size int64, n int) (float64, error) {
	f, err := os.Open(p)
	if err != nil {
		return 0, err
	}
	defer f.Close()
	rng := rand.New(rand.NewPCG(3, 4))
	buf := make([]byte, 4096)
	blocks := size / 4096
	start := time.Now()
	for range n {
		if _, err := f.ReadAt(buf, rng.Int64N(blocks)*4096); err != nil {
			return 0, fmt.Errorf("read %s: %w", p, err)
		}
	}
	return float64(n) / time.Since(start).Seconds(), nil
}

// statAll lstats dir/f000000.. ; it returns stats/s.
func statAll(dir string, n int) (float64, error) {
	var st syscall.Stat_t
	start := time.Now()
	for i := range n {
		p := filepath.Join(dir, fmt.Sprintf("f%06d", i))
		if err := syscall.Lstat(p, &st); err != nil {
			return 0, fmt.Errorf("stat %s: %w", p, err)
		}
	}
	return float64(n) / time.Since(start).Seconds(), nil
}

// maxExpiryWait bounds how long the suite waits for the kernel's caches
// to expire.
const maxExpiryWait = 10 * time.Second

// kernelTimeout is how long the kernel caches with timeout d as fs.Options
// takes it (0: def; negative: not at all).
func kernelTimeout(d, def time.Duration) time.Duration {
	switch {
	case d == 0:
		return def
	case d < 0:
		return 0
	}
	return d
}

// openAll opens, fstats, reads and closes dir/f000000.. ; it returns
// files/s.
func openAll(dir string, n int) (float64, error) {
	var st unix.Stat_t
	buf := make([]byte, 4096)
	start := time.Now()
	for i := range n {
		p := filepath.Join(dir, fmt.Sprintf("f%06d", i))
		fd, err := unix.Open(p, unix.O_RDONLY|unix.O_CLOEXEC, 0)
		if err != nil {
			return 0, fmt.Errorf("open %s: %w", p, err)
		}
		err = unix.Fstat(fd, &st)
		if err == nil {
			_, err = unix.Read(fd, buf)
		}
		if cerr := unix.Close(fd); err == nil {
			err = cerr
		}
		if err != nil {
			return 0, fmt.Errorf("read %s: %w", p, err)
		}
	}
	return float64(n) / time.Since(start).Seconds(), nil
}

// listStatAll lists dir and lstats every entry (os.scandir and os.stat);
// it returns files/s.
func listStatAll(dir string) (float64, error) {
	start := time.Now()
	es, err := os.ReadDir(dir)
	if err != nil {
		return 0, fmt.Errorf("list %s: %w", dir, err)
	}
	var st syscall.Stat_t
	for _, e := range es {
		p := filepath.Join(dir, e.Name())
		if err := syscall.Lstat(p, &st); err != nil {
			return 0, fmt.Errorf("stat %s: %w", p, err)
		}
	}
	return float64(len(es)) / time.Since(start).Seconds(), nil
}

// dropCaches empties the page cache (root only), for cold reads.
func dropCaches() error {
	syscall.Sync()
	if err := os.WriteFile("/proc/sys/vm/drop_caches", []byte("3\n"), 0); err != nil {
		return errors.New("cannot drop caches (needs root)")
	}
	return nil
}

func medianOf(runs int, f func() (float64, error)) (float64, error) {
	v := make([]float64, 0, runs)
	for range runs {
		x, err := f()
		if err != nil {
			return 0, err
		}
		v = append(v, x)
	}
	return median(v), nil
}

// alternate measures f on a and b in turn, runs times each, and returns
// the medians.
func alternate(runs int, a, b string, f func(string) (float64, error)) (float64, float64, error) {
	var va, vb []float64
	for range runs {
		x, err := f(a)
		if err != nil {
			return 0, 0, err
		}
		y, err := f(b)
		if err != nil {
			return 0, 0, err
		}
		va, vb = append(va, x), append(vb, y)
	}
	return median(va), median(vb), nil
}

func median(v []float64) float64 {
	sort.Float64s(v)
	return v[len(v)/2]
}
