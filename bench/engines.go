package bench

import (
	"context"
	"errors"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	"github.com/dustin/go-humanize"
	"golang.org/x/sys/unix"

	"github.com/gdsfs/gdsfs/cufile"
	"github.com/gdsfs/gdsfs/gpubuf"
	"github.com/gdsfs/gdsfs/internal/usage"
)

// EnginesConfig is the configuration of the engines suite (`gdsfs bench
// engines`); each field is the flag its comment names.
type EnginesConfig struct {
	File    string  // --file: file to read (created with Size if missing; "": a temporary file)
	Size    string  // --size: file size, such as 1GiB
	Threads int     // --threads: threads of the parallel baselines
	Runs    int     // --runs: warm runs per measurement (the best counts)
	NoCold  bool    // --no-cold: skip the cold (dropped page cache) measurements
	Keep    bool    // --keep: keep the generated file
	MinWarm float64 // --min-warm-ratio: fail if an engine's warm ratio is below this
	MinCold float64 // --min-cold-ratio: fail if an engine's cold ratio is below this
	// Engine returns the engines' configuration (the --engine, --chunk-size,
	// --io-workers and --direct-io flags), read when the suite runs.
	Engine func() (cufile.Config, error)
}

// Engines is the engines suite: read throughput of each transfer engine
// into slab memory against plain pread and copy baselines.
func Engines(c *EnginesConfig) Suite {
	return Suite{
		Name:        "engines",
		Description: "Read throughput of each transfer engine against plain pread and copy baselines",
		Run: func(ctx context.Context, out io.Writer) ([]Result, error) {
			n, err := humanize.ParseBytes(c.Size)
			if err != nil || n < 1<<20 || n > 1<<40 {
				return nil, usage.Errorf("--size %q: give a size from 1MiB to 1TiB, such as 4GiB", c.Size)
			}
			if c.Threads < 1 || c.Threads > 256 {
				return nil, usage.Errorf("--threads %d: give 1 to 256", c.Threads)
			}
			if c.Runs < 1 || c.Runs > 100 {
				return nil, usage.Errorf("--runs %d: give 1 to 100", c.Runs)
			}
			b := &enginesBench{EnginesConfig: *c, sizeBytes: int64(n) &^ (gpubuf.Align - 1)}
			return b.run(ctx, out)
		},
	}
}

// enginesBench is one run of the engines suite.
type enginesBench struct {
	EnginesConfig
	sizeBytes int64
}

// engineRow is one line of the table.
type engineRow struct {
	name, mode string
	gbps       float64
	note       string
}

func (b *enginesBench) run(ctx context.Context, out io.Writer) ([]Result, error) {
	if ctx == nil {
		ctx = context.Background()
	}
	cfg := cufile.Config{}
	if b.Engine != nil {
		var err error
		if cfg, err = b.Engine(); err != nil {
			return nil, err
		}
	}
	eng, err := cufile.Open(cfg)
	if err != nil {
		return nil, err
	}
	defer eng.Close()
	path, cleanup, err := b.prepareFile()
	if err != nil {
		return nil, err
	}
	defer cleanup()
	f, err := os.Open(path)
	if err != nil {
		return nil, fmt.Errorf("open bench file: %w", err)
	}
	defer f.Close()
	rep := eng.Probe()
	fmt.Fprintf(out, "file %s (%s), engine %s: %s\n", path, humanize.IBytes(uint64(b.sizeBytes)), rep.Engine, rep.Why)

	env := &benchEnv{b: b, f: f, drv: eng.Driver(), chunk: cfg.ChunkBytes}
	if env.chunk == 0 {
		env.chunk = cufile.DefaultChunkBytes
	}
	defer env.close()
	if err := env.setup(ctx, eng); err != nil {
		return nil, err
	}
	var rows []engineRow
	add := func(name, mode string, bytes int64, d time.Duration, note string, err error) {
		r := engineRow{name: name, mode: mode, note: note}
		if err != nil {
			r.note = "failed: " + err.Error()
		} else if d > 0 {
			r.gbps = float64(bytes) / d.Seconds() / 1e9
		}
		rows = append(rows, r)
	}
	// Engines to measure, in order of preference.
	type engCase struct {
		name string
		e    cufile.Engine
		mem  gpubuf.Memory
	}
	var engines []engCase
	for _, name := range []string{cufile.EngineGDS, cufile.EnginePosix} {
		if e, ok := eng.Engine(name); ok && env.dev != nil {
			engines = append(engines, engCase{name, e, env.dev})
		}
	}
	engines = append(engines, engCase{cufile.EngineHost, cufile.NewHostEngine(cufile.Options{ChunkBytes: cfg.ChunkBytes, Workers: cfg.Workers, Direct: cfg.Direct, ColdTaskBytes: cfg.ColdChunkBytes, ColdReadAheadBytes: cfg.ColdReadAheadBytes, ColdCrowd: cfg.ColdCrowd}), env.host})

	measure := func(cold bool) {
		mode := "warm"
		runs := b.Runs
		if cold {
			mode, runs = "cold", 1
		}
		best := func(fn func() (int64, error)) (int64, time.Duration, error) {
			var bestD time.Duration
			var n int64
			for range runs {
				if cold {
					if err := dropFileCache(f); err != nil {
						return 0, 0, err
					}
				}
				t0 := time.Now()
				m, err := fn()
				d := time.Since(t0)
				if err != nil {
					return 0, 0, err
				}
				if bestD == 0 || d < bestD {
					bestD, n = d, m
				}
			}
			return n, bestD, nil
		}
		if !cold {
			n, d, err := best(func() (int64, error) { return env.preadParallel(ctx, false) })
			add(fmt.Sprintf("pread%d-%s", b.Threads, env.hostKind()), mode, n, d, "baseline", err)
			n, d, err = best(func() (int64, error) { return env.preadInto(ctx, env.host.(gpubuf.HostMemory).HostBytes()) })
			add(fmt.Sprintf("pread%d-slab", b.Threads), mode, n, d, "baseline: into the host slab", err)
			if env.drv != nil {
				n, d, err := best(env.h2d)
				add("h2d-pinned", mode, n, d, "baseline", err)
			}
		} else {
			n, d, err := best(func() (int64, error) { return env.preadParallel(ctx, true) })
			add(fmt.Sprintf("odirect%d", b.Threads), mode, n, d, "baseline: disk parallel rate", err)
		}
		if env.drv != nil {
			n, d, err := best(env.pread1Copy)
			add("pread1+copy", mode, n, d, "baseline", err)
		}
		for _, ec := range engines {
			n, d, err := best(func() (int64, error) {
				m, err := ec.e.ReadAt(ctx, f, ec.mem, 0, 0, b.sizeBytes)
				if err == nil && m != b.sizeBytes {
					err = fmt.Errorf("read %d of %d bytes", m, b.sizeBytes)
				}
				return m, err
			})
			add(ec.name, mode, n, d, "engine", err)
		}
	}
	// Warm-up: the file may be partly cached (just written) or not at all.
	if _, err := env.preadParallel(ctx, false); err != nil {
		return nil, err
	}
	measure(false)
	coldNote := ""
	if !b.NoCold {
		if err := dropFileCache(f); err != nil {
			coldNote = fmt.Sprintf("cold runs skipped: %v", err)
		} else {
			measure(true)
		}
	}
	j := judgeEngines(rows, env.drv != nil, b.MinWarm, b.MinCold)
	failed := printEngineTable(out, rows, j)
	if coldNote != "" {
		fmt.Fprintln(out, coldNote)
	}
	results := engineResults(rows, j)
	if coldNote != "" {
		results = append(results, Result{Suite: "engines", Measurement: "cold runs", Note: coldNote})
	}
	if failed != "" {
		return results, errors.New(failed)
	}
	return results, nil
}

// engineJudge tells what an engine row is judged against.
type engineJudge func(r engineRow) engineBound

// engineBound is the baseline an engine row is judged against.
type engineBound struct {
	gbps    float64 // 0: no bound (a baseline row, a failed run, no baseline measured)
	against string  // "vs pread", "vs h2d", "vs pread-slab", "vs odirect"
	min     float64 // the ratio the command must reach (0: none)
	// goal: this engine is the one the minimums bind: the engine that serves
	// by default where it runs (posix with a GPU, gds compat being there for
	// comparison; host without).
	goal bool
}

// ratio is the row's GB/s over its bound, 0 without one.
func (b engineBound) ratio(r engineRow) float64 {
	if b.gbps <= 0 {
		return 0
	}
	return r.gbps / b.gbps
}

// judgeEngines finds each engine row's bound among the baseline rows:
// warm, the slower of pread and h2d (the host engine: pread into the slab);
// cold, odirect.
func judgeEngines(rows []engineRow, gpu bool, minWarm, minCold float64) engineJudge {
	get := func(prefix, mode string) float64 {
		for _, r := range rows {
			if r.mode == mode && len(r.name) >= len(prefix) && r.name[:len(prefix)] == prefix {
				return r.gbps
			}
		}
		return 0
	}
	warmBound := get("pread", "warm")
	boundName := "pread"
	if gpu {
		if h := get("h2d-pinned", "warm"); h > 0 && (warmBound == 0 || h < warmBound) {
			warmBound, boundName = h, "h2d"
		}
	}
	coldBound := get("odirect", "cold")
	slabBound := 0.0
	for _, r := range rows {
		if r.mode == "warm" && len(r.name) > 5 && r.name[len(r.name)-5:] == "-slab" {
			slabBound = r.gbps
		}
	}
	return func(r engineRow) engineBound {
		if r.note != "engine" || r.gbps <= 0 {
			return engineBound{}
		}
		b := engineBound{gbps: warmBound, min: minWarm, against: "vs " + boundName}
		if r.name == cufile.EngineHost && slabBound > 0 {
			b.gbps, b.against = slabBound, "vs pread-slab"
		}
		if r.mode == "cold" {
			b.gbps, b.min, b.against = coldBound, minCold, "vs odirect"
		}
		b.goal = (gpu && r.name == cufile.EnginePosix) || (!gpu && r.name == cufile.EngineHost)
		return b
	}
}

// printEngineTable prints rows with each engine's ratio to its bound and
// returns a failure message for ratios under the minimums.
func printEngineTable(out io.Writer, rows []engineRow, judge engineJudge) string {
	var failed string
	table := [][]string{{"read", "mode", "GB/s", "ratio", "", "note"}}
	for _, r := range rows {
		ratio, against := "", ""
		if b := judge(r); b.against != "" {
			against = b.against
			if q := b.ratio(r); q > 0 {
				ratio = fmt.Sprintf("%.2f", q)
				if b.min > 0 && q < b.min && b.goal {
					failed += fmt.Sprintf("%s %s ratio %.2f < %.2f; ", r.name, r.mode, q, b.min)
				}
			}
		}
		gb := "-"
		if r.gbps > 0 {
			gb = fmt.Sprintf("%.2f", r.gbps)
		}
		table = append(table, []string{r.name, r.mode, gb, ratio, against, r.note})
	}
	printTable(out, true, table)
	return failed
}

// engineResults are the engine rows for the combined table of `gdsfs
// bench`, each with its bound as the baseline; the baseline rows appear
// only through them.
func engineResults(rows []engineRow, judge engineJudge) []Result {
	var out []Result
	for _, r := range rows {
		if r.note != "engine" && r.gbps > 0 {
			continue
		}
		res := Result{Suite: "engines", Measurement: r.name + " engine, " + r.mode, GDSFS: r.gbps, Unit: "GB/s", Note: r.note}
		if r.note != "engine" {
			res.Measurement = r.name + ", " + r.mode // a baseline that failed
		}
		if b := judge(r); b.against != "" {
			res.Baseline = b.gbps
			res.Note = b.against
			if b.gbps <= 0 {
				res.Note += " (not measured)"
			}
			if b.goal {
				res.Note += ", serves by default"
				if q := b.ratio(r); b.min > 0 && q > 0 {
					res.Note += fmt.Sprintf("; goal %.2f %s", b.min, goalWord(q >= b.min))
				}
			}
		}
		out = append(out, res)
	}
	return out
}

// benchEnv holds the bench's memory: device memory for the GPU engines,
// shared host memory for the host engine, pinned buffers for baselines.
type benchEnv struct {
	b      *enginesBench
	f      *os.File
	drv    *cufile.Driver
	chunk  int64
	dev    gpubuf.Memory
	host   gpubuf.Memory
	hostBE *gpubuf.HostBackend
	bufs   [][]byte // per-thread staging (pinned with a GPU), chunk+Align bytes
	free   []func()
}

func (e *benchEnv) hostKind() string {
	if e.drv != nil {
		return "pinned"
	}
	return "memory"
}

func (e *benchEnv) setup(ctx context.Context, eng *cufile.Engines) error {
	size := e.b.sizeBytes
	if e.drv != nil {
		m, err := eng.Backend().Alloc(ctx, 0, size, uint32(os.Getuid()))
		if err != nil {
			return fmt.Errorf("allocate %s of GPU memory: %w", humanize.IBytes(uint64(size)), err)
		}
		e.dev = m
		e.free = append(e.free, func() { m.Close() })
	}
	hb, err := gpubuf.NewHostBackend(gpubuf.HostBackendOptions{Dir: filepath.Join("/dev/shm", fmt.Sprintf("gdsfs-bench-%d", os.Getpid()))})
	if err != nil {
		return err
	}
	e.hostBE = hb
	hm, err := hb.Alloc(ctx, 0, size, uint32(os.Getuid()))
	if err != nil {
		return fmt.Errorf("allocate %s of shared memory (is /dev/shm large enough?): %w", humanize.IBytes(uint64(size)), err)
	}
	e.host = hm
	e.free = append(e.free, func() { hm.Close() })
	for range e.b.Threads {
		b, free, err := e.alloc(e.chunk + gpubuf.Align)
		if err != nil {
			return err
		}
		e.bufs = append(e.bufs, b)
		e.free = append(e.free, free)
	}
	return nil
}

// alloc returns page-aligned memory: pinned with a GPU, anonymous mmap without.
func (e *benchEnv) alloc(n int64) ([]byte, func(), error) {
	if e.drv != nil {
		b, err := e.drv.HostAlloc(0, n)
		if err != nil {
			return nil, nil, err
		}
		return b, func() { e.drv.HostFree(0, b) }, nil
	}
	b, err := unix.Mmap(-1, 0, int(n), unix.PROT_READ|unix.PROT_WRITE, unix.MAP_PRIVATE|unix.MAP_ANONYMOUS)
	if err != nil {
		return nil, nil, err
	}
	return b, func() { unix.Munmap(b) }, nil
}

func (e *benchEnv) close() {
	for i := len(e.free) - 1; i >= 0; i-- {
		e.free[i]()
	}
	if e.hostBE != nil {
		e.hostBE.Close()
	}
}

// preadParallel reads the whole file with e.b.Threads threads in chunks into
// per-thread buffers (the rate of the reads alone); direct uses O_DIRECT.
func (e *benchEnv) preadParallel(ctx context.Context, direct bool) (int64, error) {
	f := e.f
	if direct {
		d, err := os.OpenFile(e.f.Name(), os.O_RDONLY|syscall.O_DIRECT, 0)
		if err != nil {
			return 0, fmt.Errorf("O_DIRECT open: %w", err)
		}
		defer d.Close()
		f = d
	}
	return e.parallel(ctx, len(e.bufs), func(i int, off int64) (int, error) {
		return f.ReadAt(e.bufs[i][:e.chunk], off)
	})
}

// preadInto reads the whole file with e.b.Threads threads straight into dst
// (one file-sized buffer): what the host engine does, without the engine.
func (e *benchEnv) preadInto(ctx context.Context, dst []byte) (int64, error) {
	return e.parallel(ctx, e.b.Threads, func(_ int, off int64) (int, error) {
		return e.f.ReadAt(dst[off:min(off+e.chunk, e.b.sizeBytes)], off)
	})
}

// parallel runs read over the file's chunks (offsets e.chunk apart, up to
// the bench size) on threads goroutines, each taking the next chunk until
// none is left, and returns the bytes read: the baselines' common loop.
// read gets its goroutine's index (for per-thread buffers); io.EOF is not
// an error, any other stops that goroutine.
func (e *benchEnv) parallel(ctx context.Context, threads int, read func(i int, off int64) (int, error)) (int64, error) {
	var next, total atomic.Int64
	var wg sync.WaitGroup
	errs := make([]error, threads)
	for i := range threads {
		wg.Go(func() {
			for ctx.Err() == nil {
				off := next.Add(e.chunk) - e.chunk
				if off >= e.b.sizeBytes {
					return
				}
				n, err := read(i, off)
				total.Add(int64(n))
				if err != nil && !errors.Is(err, io.EOF) {
					errs[i] = err
					return
				}
			}
		})
	}
	wg.Wait()
	if err := errors.Join(append(errs, ctx.Err())...); err != nil {
		return 0, err
	}
	return total.Load(), nil
}

// h2d copies one pinned buffer over the whole device memory.
func (e *benchEnv) h2d() (int64, error) {
	dm := e.dev.(gpubuf.DeviceMemory)
	src := e.bufs[0][:e.chunk]
	var n int64
	for off := int64(0); off < e.b.sizeBytes; off += e.chunk {
		m := min(e.chunk, e.b.sizeBytes-off)
		if err := e.drv.CopyHtoD(0, dm.DevicePtr()+uintptr(off), src[:m]); err != nil {
			return 0, err
		}
		n += m
	}
	return n, nil
}

// pread1Copy is the naive loader: one thread, pread then a synchronous copy.
func (e *benchEnv) pread1Copy() (int64, error) {
	dm := e.dev.(gpubuf.DeviceMemory)
	b := e.bufs[0][:e.chunk]
	var n int64
	for off := int64(0); off < e.b.sizeBytes; off += e.chunk {
		m, err := e.f.ReadAt(b, off)
		if err != nil && !errors.Is(err, io.EOF) {
			return 0, err
		}
		if err := e.drv.CopyHtoD(0, dm.DevicePtr()+uintptr(off), b[:m]); err != nil {
			return 0, err
		}
		n += int64(m)
	}
	return n, nil
}

// dropFileCache empties the page cache (root only) so the next read is cold.
func dropFileCache(f *os.File) error {
	unix.Sync()
	if err := os.WriteFile("/proc/sys/vm/drop_caches", []byte("3\n"), 0); err != nil {
		return fmt.Errorf("drop page cache: %w (run as root, or pass --no-cold)", err)
	}
	// Belt and braces for filesystems that keep pages drop_caches misses.
	_ = unix.Fadvise(int(f.Fd()), 0, 0, unix.FADV_DONTNEED)
	return nil
}

// prepareFile returns the bench file, creating it with pseudo-random
// content (not zeroes: some storage compresses or skips them).
func (b *enginesBench) prepareFile() (string, func(), error) {
	path := b.File
	temp := path == ""
	if temp {
		path = filepath.Join(os.TempDir(), fmt.Sprintf("gdsfs-bench-engines-%d.dat", os.Getpid()))
	}
	cleanup := func() {
		if temp && !b.Keep {
			os.Remove(path)
		}
	}
	if st, err := os.Stat(path); err == nil && st.Size() == b.sizeBytes {
		return path, cleanup, nil
	}
	f, err := os.OpenFile(path, os.O_RDWR|os.O_CREATE|os.O_TRUNC, 0o644)
	if err != nil {
		return "", nil, usage.Errorf("--file %q: %v", path, err)
	}
	defer f.Close()
	const block = 8 << 20
	var wg sync.WaitGroup
	var next atomic.Int64
	errs := make([]error, 8)
	for w := range 8 {
		wg.Go(func() {
			buf := make([]byte, block)
			x := uint64(w)*0x9E3779B97F4A7C15 + 1
			for {
				off := next.Add(block) - block
				if off >= b.sizeBytes {
					return
				}
				for i := 0; i+8 <= len(buf); i += 8 {
					x ^= x << 13
					x ^= x >> 7
					x ^= x << 17
					buf[i], buf[i+1], buf[i+2], buf[i+3] = byte(x), byte(x>>8), byte(x>>16), byte(x>>24)
					buf[i+4], buf[i+5], buf[i+6], buf[i+7] = byte(x>>32), byte(x>>40), byte(x>>48), byte(x>>56)
				}
				if _, err := f.WriteAt(buf[:min(block, b.sizeBytes-off)], off); err != nil {
					errs[w] = err
					return
				}
			}
		})
	}
	wg.Wait()
	if err := errors.Join(errs...); err != nil {
		cleanup()
		return "", nil, fmt.Errorf("write bench file %s: %w", path, err)
	}
	if err := f.Sync(); err != nil {
		cleanup()
		return "", nil, fmt.Errorf("sync bench file %s: %w", path, err)
	}
	return path, cleanup, nil
}
