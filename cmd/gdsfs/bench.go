package main

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
	"text/tabwriter"
	"time"

	"github.com/dustin/go-humanize"
	"github.com/rs/zerolog"
	"github.com/spf13/cobra"
	"golang.org/x/sys/unix"

	"github.com/gdsfs/gdsfs/fs"
)

// newBenchCmd is `gdsfs bench`: one subcommand per suite. Other packages
// add their suite as a newBenchXxxCmd() in their own file and list it
// here; `gdsfs bench` with no suite runs every suite with its defaults.
func newBenchCmd() *cobra.Command {
	cmd := &cobra.Command{
		Use:   "bench [SUITE]",
		Short: "Measure gdsfs against direct access (all suites, or one)",
		Args:  cobra.NoArgs,
	}
	cmd.AddCommand(
		newBenchMountCmd(),
		newBenchEnginesCmd(),
	)
	addBenchProgress(cmd) // spinner while a suite runs (bench_progress.go)
	cmd.RunE = func(cmd *cobra.Command, _ []string) error {
		for _, s := range cmd.Commands() {
			if s.RunE == nil {
				continue
			}
			fmt.Fprintf(cmd.OutOrStdout(), "== bench %s\n", s.Name())
			s.SetOut(cmd.OutOrStdout())
			s.SetContext(cmd.Context())
			if err := s.RunE(s, nil); err != nil {
				return fmt.Errorf("bench %s: %w", s.Name(), err)
			}
		}
		return nil
	}
	return cmd
}

// mountBench is the configuration of `gdsfs bench mount`.
type mountBench struct {
	dir       string
	size      string
	sizeBytes int64
	files     int
	randReads int
	runs      int
	minRatio  float64
	keep      bool
	noPass    bool
}

func newBenchMountCmd() *cobra.Command {
	b := &mountBench{}
	cmd := &cobra.Command{
		Use:   "mount",
		Short: "Sequential, random and stat throughput through a gdsfs mount vs the backing directory",
		Long: `Creates a data file and many small files in a temporary backing directory,
mounts it with gdsfs (no control path) and measures, through the mount and
directly: sequential read of the data file (warm page cache, and cold after
dropping caches when running as root), random 4 KiB reads, and stat of every
small file. Prints one table with mount/direct ratios.`,
		Example: `  gdsfs bench mount
  gdsfs bench mount --size 4GiB --dir /nvme/tmp --min-ratio 0.9`,
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			n, err := humanize.ParseBytes(b.size)
			if err != nil || n < 1<<20 {
				return usagef("--size %q: give a size of at least 1MiB, such as 1GiB", b.size)
			}
			b.sizeBytes = int64(n)
			if b.files < 1 || b.randReads < 1 || b.runs < 1 {
				return usagef("--files, --random-reads and --runs must be at least 1")
			}
			return b.run(cmd.Context(), cmd.OutOrStdout())
		},
	}
	f := cmd.Flags()
	f.StringVar(&b.dir, "dir", os.TempDir(), "directory for the temporary backing files (its filesystem is what is measured)")
	f.StringVar(&b.size, "size", "1GiB", "size of the sequential-read file")
	f.IntVar(&b.files, "files", 10000, "number of small files to stat")
	f.IntVar(&b.randReads, "random-reads", 20000, "number of random 4 KiB reads")
	f.IntVar(&b.runs, "runs", 5, "runs per measurement (the median is reported)")
	f.Float64Var(&b.minRatio, "min-ratio", 0, "fail unless warm sequential mount/direct throughput is at least this (e.g. 0.9)")
	f.BoolVar(&b.keep, "keep", false, "keep the temporary directory")
	f.BoolVar(&b.noPass, "no-passthrough", false, "mount with the daemon serving all I/O (to see what passthrough gains)")
	return cmd
}

// benchRow is one line of the result table: a rate per second for the
// direct path and for the mount (higher is better).
type benchRow struct {
	name           string
	unit           string
	direct, viaFS  float64
	skippedBecause string
}

func (b *mountBench) run(ctx context.Context, out io.Writer) error {
	if ctx == nil {
		ctx = context.Background()
	}
	work, err := os.MkdirTemp(b.dir, "gdsfs-bench-")
	if err != nil {
		return usagef("--dir %s: %v", b.dir, err)
	}
	if !b.keep {
		defer os.RemoveAll(work)
	}
	backing := filepath.Join(work, "backing")
	mnt := filepath.Join(work, "mnt")
	for _, d := range []string{backing, mnt, filepath.Join(backing, "stat")} {
		if err := os.Mkdir(d, 0o755); err != nil {
			return fmt.Errorf("bench setup: %w", err)
		}
	}
	fmt.Fprintf(out, "preparing %s file and %d small files in %s\n", humanize.IBytes(uint64(b.sizeBytes)), b.files, work)
	if err := writeBenchFile(filepath.Join(backing, "data"), b.sizeBytes); err != nil {
		return err
	}
	for i := range b.files {
		p := filepath.Join(backing, "stat", fmt.Sprintf("f%06d", i))
		if err := os.WriteFile(p, []byte{byte(i)}, 0o644); err != nil {
			return fmt.Errorf("bench setup: %w", err)
		}
	}

	srv, err := fs.Mount(ctx, fs.Options{Source: backing, Mountpoint: mnt, NoPassthrough: b.noPass, Logger: zerolog.Nop()})
	if err != nil {
		return fmt.Errorf("bench mount: %w", err)
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
		return err
	}
	if row.direct, row.viaFS, err = alternate(b.runs, direct, viaFS, func(p string) (float64, error) { return seq(p, false) }); err != nil {
		return err
	}
	warm := row
	rows = append(rows, row)
	// The same reads per second of CPU time of the reading thread: on a
	// busy machine wall-clock throughput measures the neighbours, while
	// this measures the cost of the read path itself.
	row = benchRow{name: "sequential read, warm, per CPU-second", unit: "MB/cpu-s"}
	if row.direct, row.viaFS, err = alternate(b.runs, direct, viaFS, seqReadCPU); err != nil {
		return err
	}
	rows = append(rows, row)

	// Cold reads alternate too: VM disks are cached on the host, and
	// their speed drifts.
	row = benchRow{name: "sequential read, cold", unit: "MB/s"}
	if err := dropCaches(); err != nil {
		row.skippedBecause = err.Error()
	} else {
		if row.direct, row.viaFS, err = alternate(b.runs, direct, viaFS, func(p string) (float64, error) { return seq(p, true) }); err != nil {
			return err
		}
	}
	rows = append(rows, row)

	row = benchRow{name: "random 4 KiB reads, warm", unit: "reads/s"}
	if row.direct, err = medianOf(b.runs, func() (float64, error) { return randRead(direct, b.sizeBytes, b.randReads) }); err != nil {
		return err
	}
	if row.viaFS, err = medianOf(b.runs, func() (float64, error) { return randRead(viaFS, b.sizeBytes, b.randReads) }); err != nil {
		return err
	}
	rows = append(rows, row)

	// The first stat pass through the mount looks every name up; the
	// second is served from the kernel's caches (within the timeouts).
	row = benchRow{name: fmt.Sprintf("stat %d files, first", b.files), unit: "stats/s"}
	if row.direct, err = statAll(filepath.Join(backing, "stat"), b.files); err != nil {
		return err
	}
	if row.viaFS, err = statAll(filepath.Join(mnt, "stat"), b.files); err != nil {
		return err
	}
	rows = append(rows, row)
	row = benchRow{name: fmt.Sprintf("stat %d files, cached", b.files), unit: "stats/s"}
	if row.direct, err = statAll(filepath.Join(backing, "stat"), b.files); err != nil {
		return err
	}
	if row.viaFS, err = statAll(filepath.Join(mnt, "stat"), b.files); err != nil {
		return err
	}
	rows = append(rows, row)

	fmt.Fprintf(out, "passthrough: %v (%s)\n", pt, why)
	tw := tabwriter.NewWriter(out, 0, 0, 2, ' ', tabwriter.AlignRight)
	fmt.Fprintln(tw, "measurement\tunit\tdirect\tgdsfs\tratio\t")
	for _, r := range rows {
		if r.skippedBecause != "" {
			fmt.Fprintf(tw, "%s\t%s\t-\t-\tskipped: %s\t\n", r.name, r.unit, r.skippedBecause)
			continue
		}
		fmt.Fprintf(tw, "%s\t%s\t%.0f\t%.0f\t%.2f\t\n", r.name, r.unit, r.direct, r.viaFS, r.viaFS/r.direct)
	}
	tw.Flush()
	if ratio := warm.viaFS / warm.direct; b.minRatio > 0 && ratio < b.minRatio {
		return fmt.Errorf("warm sequential read through the mount is %.2fx direct, below --min-ratio %.2f", ratio, b.minRatio)
	}
	return nil
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

// seqReadCPU reads p like seqRead on one locked OS thread and returns MB
// per second of that thread's CPU time (user + system).
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
	for {
		k, err := unix.Read(int(f.Fd()), buf) // no poller: stay on this thread
		if err != nil {
			return 0, fmt.Errorf("read %s: %w", p, err)
		}
		if k == 0 {
			break
		}
		n += int64(k)
	}
	if err := unix.Getrusage(unix.RUSAGE_THREAD, &after); err != nil {
		return 0, fmt.Errorf("getrusage: %w", err)
	}
	cpu := time.Duration(after.Utime.Nano() - before.Utime.Nano() + after.Stime.Nano() - before.Stime.Nano())
	if cpu <= 0 {
		return 0, fmt.Errorf("read %s: no CPU time measured", p)
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
