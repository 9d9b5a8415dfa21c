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

// benchSuite is one suite of `gdsfs bench`: its subcommand (flags, help)
// and its measurement. Other packages add their suite as a
// newBenchXxxSuite() in their own file and list it in newBenchCmd.
type benchSuite struct {
	cmd *cobra.Command
	// measure checks the suite's flags, measures, writes the suite's own
	// report and table to out and returns its rows for the combined table
	// (also those measured before a failure, with the error).
	measure func(ctx context.Context, out io.Writer) ([]benchResult, error)
}

// benchResult is one row of the combined table of `gdsfs bench`: a figure
// of gdsfs and the figure of the baseline it is judged against, in the
// same unit (higher is better). A zero figure was not measured.
type benchResult struct {
	Suite       string
	Measurement string
	GDSFS       float64
	Baseline    float64
	Unit        string
	// Note names the baseline and says whether a goal was met, or why
	// nothing was measured.
	Note string
}

// Ratio is GDSFS/Baseline, or 0 when either is missing.
func (r benchResult) Ratio() float64 {
	if r.GDSFS <= 0 || r.Baseline <= 0 {
		return 0
	}
	return r.GDSFS / r.Baseline
}

// newBenchCmd is `gdsfs bench`: one subcommand per suite; with no suite it
// runs every suite with its defaults and prints one table.
func newBenchCmd() *cobra.Command {
	suites := []benchSuite{
		newBenchMountSuite(),
		newBenchEnginesSuite(),
	}
	cmd := &cobra.Command{
		Use:   "bench [SUITE]",
		Short: "Measure gdsfs against direct access (all suites, or one)",
		Long: `With a suite, runs that suite and prints its own report and table.

Without one, runs every suite with its defaults, one after the other. Their
own reports go to stderr (under a spinner with the suite's name and elapsed
time, on a terminal), and stdout gets one table at the end: each gdsfs
figure next to the baseline it is judged against, and their ratio.`,
		Example: `  gdsfs bench
  gdsfs bench mount --size 4GiB`,
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			return runBenchSuites(cmd.Context(), cmd.OutOrStdout(), cmd.ErrOrStderr(), suites)
		},
	}
	for _, s := range suites {
		s.cmd.RunE = func(c *cobra.Command, _ []string) error {
			return withBenchProgress(c.ErrOrStderr(), c.Name(), c.OutOrStdout(), func(out io.Writer) error {
				_, err := s.measure(c.Context(), out)
				return err
			})
		}
		cmd.AddCommand(s.cmd)
	}
	return cmd
}

// runBenchSuites runs every suite, their reports to errw, and prints the
// combined table to out. A suite that fails does not stop the others: its
// failure is a row of the table, and the error is returned after it.
func runBenchSuites(ctx context.Context, out, errw io.Writer, suites []benchSuite) error {
	if ctx == nil {
		ctx = context.Background()
	}
	var all []benchResult
	var errs []error
	for _, s := range suites {
		name := s.cmd.Name()
		fmt.Fprintf(errw, "== bench %s\n", name)
		var rows []benchResult
		err := withBenchProgress(errw, name, errw, func(w io.Writer) error {
			var err error
			rows, err = s.measure(ctx, w)
			return err
		})
		all = append(all, rows...)
		if err != nil {
			all = append(all, benchResult{Suite: name, Measurement: "-", Note: "failed: " + err.Error()})
			errs = append(errs, fmt.Errorf("bench %s: %w", name, err))
		}
		if ctx.Err() != nil {
			break // interrupted: show what was measured
		}
	}
	printBenchResults(out, all)
	return errors.Join(errs...)
}

// printBenchResults prints the combined table.
func printBenchResults(out io.Writer, rows []benchResult) {
	figure := func(v float64) string {
		switch {
		case v <= 0:
			return "-"
		case v >= 100:
			return fmt.Sprintf("%.0f", v)
		default:
			return fmt.Sprintf("%.2f", v)
		}
	}
	tw := tabwriter.NewWriter(out, 0, 4, 2, ' ', 0)
	fmt.Fprintln(tw, "suite\tmeasurement\tgdsfs\tbaseline\tunit\tratio\tnote")
	for _, r := range rows {
		ratio := "-"
		if q := r.Ratio(); q > 0 {
			ratio = fmt.Sprintf("%.2f", q)
		}
		fmt.Fprintf(tw, "%s\t%s\t%s\t%s\t%s\t%s\t%s\n", r.Suite, r.Measurement, figure(r.GDSFS), figure(r.Baseline), orDash(r.Unit), ratio, orDash(r.Note))
	}
	tw.Flush()
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

func newBenchMountSuite() benchSuite {
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
	measure := func(ctx context.Context, out io.Writer) ([]benchResult, error) {
		n, err := humanize.ParseBytes(b.size)
		if err != nil || n < 1<<20 {
			return nil, usagef("--size %q: give a size of at least 1MiB, such as 1GiB", b.size)
		}
		b.sizeBytes = int64(n)
		if b.files < 1 || b.randReads < 1 || b.runs < 1 {
			return nil, usagef("--files, --random-reads and --runs must be at least 1")
		}
		return b.run(ctx, out)
	}
	return benchSuite{cmd: cmd, measure: measure}
}

// benchRow is one line of the result table: a rate per second for the
// direct path and for the mount (higher is better).
type benchRow struct {
	name           string
	unit           string
	direct, viaFS  float64
	skippedBecause string
}

func (b *mountBench) run(ctx context.Context, out io.Writer) ([]benchResult, error) {
	if ctx == nil {
		ctx = context.Background()
	}
	work, err := os.MkdirTemp(b.dir, "gdsfs-bench-")
	if err != nil {
		return nil, usagef("--dir %s: %v", b.dir, err)
	}
	if !b.keep {
		defer os.RemoveAll(work)
	}
	backing := filepath.Join(work, "backing")
	mnt := filepath.Join(work, "mnt")
	for _, d := range []string{backing, mnt, filepath.Join(backing, "stat")} {
		if err := os.Mkdir(d, 0o755); err != nil {
			return nil, fmt.Errorf("bench setup: %w", err)
		}
	}
	fmt.Fprintf(out, "preparing %s file and %d small files in %s\n", humanize.IBytes(uint64(b.sizeBytes)), b.files, work)
	if err := writeBenchFile(filepath.Join(backing, "data"), b.sizeBytes); err != nil {
		return nil, err
	}
	for i := range b.files {
		p := filepath.Join(backing, "stat", fmt.Sprintf("f%06d", i))
		if err := os.WriteFile(p, []byte{byte(i)}, 0o644); err != nil {
			return nil, fmt.Errorf("bench setup: %w", err)
		}
	}

	srv, err := fs.Mount(ctx, fs.Options{Source: backing, Mountpoint: mnt, NoPassthrough: b.noPass, Logger: zerolog.Nop()})
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
	if row.direct, row.viaFS, err = alternate(b.runs, direct, viaFS, func(p string) (float64, error) { return seq(p, false) }); err != nil {
		return nil, err
	}
	warm := row
	rows = append(rows, row)
	// The same reads per second of CPU time of the reading thread: on a
	// busy machine wall-clock throughput measures the neighbours, while
	// this measures the cost of the read path itself.
	row = benchRow{name: "sequential read, warm, per CPU-second", unit: "MB/cpu-s"}
	if row.direct, row.viaFS, err = alternate(b.runs, direct, viaFS, seqReadCPU); err != nil {
		return nil, err
	}
	rows = append(rows, row)

	// Cold reads alternate too: VM disks are cached on the host, and
	// their speed drifts.
	row = benchRow{name: "sequential read, cold", unit: "MB/s"}
	if err := dropCaches(); err != nil {
		row.skippedBecause = err.Error()
	} else {
		if row.direct, row.viaFS, err = alternate(b.runs, direct, viaFS, func(p string) (float64, error) { return seq(p, true) }); err != nil {
			return nil, err
		}
	}
	rows = append(rows, row)

	row = benchRow{name: "random 4 KiB reads, warm", unit: "reads/s"}
	if row.direct, err = medianOf(b.runs, func() (float64, error) { return randRead(direct, b.sizeBytes, b.randReads) }); err != nil {
		return nil, err
	}
	if row.viaFS, err = medianOf(b.runs, func() (float64, error) { return randRead(viaFS, b.sizeBytes, b.randReads) }); err != nil {
		return nil, err
	}
	rows = append(rows, row)

	// The first stat pass through the mount looks every name up; the
	// second is served from the kernel's caches (within the timeouts).
	row = benchRow{name: fmt.Sprintf("stat %d files, first", b.files), unit: "stats/s"}
	if row.direct, err = statAll(filepath.Join(backing, "stat"), b.files); err != nil {
		return nil, err
	}
	if row.viaFS, err = statAll(filepath.Join(mnt, "stat"), b.files); err != nil {
		return nil, err
	}
	rows = append(rows, row)
	row = benchRow{name: fmt.Sprintf("stat %d files, cached", b.files), unit: "stats/s"}
	if row.direct, err = statAll(filepath.Join(backing, "stat"), b.files); err != nil {
		return nil, err
	}
	if row.viaFS, err = statAll(filepath.Join(mnt, "stat"), b.files); err != nil {
		return nil, err
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

	results := make([]benchResult, 0, len(rows))
	for _, r := range rows {
		res := benchResult{Suite: "mount", Measurement: r.name, GDSFS: r.viaFS, Baseline: r.direct, Unit: r.unit, Note: "vs direct"}
		if !pt {
			res.Note += ", no passthrough"
		}
		if r.skippedBecause != "" {
			res.GDSFS, res.Baseline, res.Note = 0, 0, "skipped: "+r.skippedBecause
		}
		if r.name == warm.name && b.minRatio > 0 {
			res.Note += fmt.Sprintf("; goal %.2f %s", b.minRatio, goalWord(res.Ratio() >= b.minRatio))
		}
		results = append(results, res)
	}
	if ratio := warm.viaFS / warm.direct; b.minRatio > 0 && ratio < b.minRatio {
		return results, fmt.Errorf("warm sequential read through the mount is %.2fx direct, below --min-ratio %.2f", ratio, b.minRatio)
	}
	return results, nil
}

// goalWord says whether a goal was met, for the notes of the combined table.
func goalWord(met bool) string {
	if met {
		return "met"
	}
	return "NOT met"
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
