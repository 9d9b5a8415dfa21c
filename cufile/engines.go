package cufile

import (
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"sync"

	"github.com/rs/zerolog"
	"golang.org/x/sys/unix"

	"github.com/gdsfs/gdsfs/gpubuf"
	"github.com/gdsfs/gdsfs/internal/engname"
	"github.com/gdsfs/gdsfs/internal/pagecache"
)

// Engine choices for Config.Engine.
const (
	EngineAuto = "auto"
	EngineGDS  = engname.GDS
	// EngineGDSCompat is the gds engine's name when cuFile runs in compat
	// mode (no nvidia-fs): POSIX reads inside libcufile, then a copy.
	EngineGDSCompat = engname.GDSCompat
	EnginePosix     = engname.Posix
	EngineHost      = engname.Host
)

// Config configures Open. The zero value is usable (auto).
type Config struct {
	// Engine is auto (default), gds, posix or host.
	Engine string
	// ChunkBytes is the transfer task size. Default DefaultChunkBytes.
	ChunkBytes int64
	// Workers is the number of parallel workers per transfer. Default
	// DefaultWorkers().
	Workers int
	// Direct is the posix and host engines' O_DIRECT policy (Options.Direct).
	Direct string
	// ColdChunkBytes is the posix and host engines' task size for cold
	// buffered reads (Options.ColdTaskBytes). Default DefaultColdTaskBytes.
	ColdChunkBytes int64
	// ColdReadAheadBytes is the posix and host engines' advice ahead of a
	// cold buffered read (Options.ColdReadAheadBytes): 0 (default) none,
	// < 0 Workers x ChunkBytes.
	ColdReadAheadBytes int64
	// ColdCrowd is the posix and host engines' Options.ColdCrowd: cold reads
	// in flight from which one takes tasks of the device's largest request
	// and no advice. 0 (default): never.
	ColdCrowd int
	// HostDir holds host-backend slab files. Default /dev/shm/gdsfs-<pid>-<random>, new per start (gpubuf).
	HostDir string
	// Log receives the probe result and per-file fallbacks. Default silent.
	Log zerolog.Logger
}

// Validate reports every problem of c at once.
func (c Config) Validate() error {
	var errs []error
	switch c.Engine {
	case "", EngineAuto, EngineGDS, EnginePosix, EngineHost:
	default:
		errs = append(errs, fmt.Errorf("cufile: Engine %q must be auto, gds, posix or host", c.Engine))
	}
	if c.ChunkBytes < 0 || c.ChunkBytes%gpubuf.Align != 0 {
		errs = append(errs, fmt.Errorf("cufile: ChunkBytes (%d) must be a positive multiple of %d", c.ChunkBytes, gpubuf.Align))
	}
	if c.ColdChunkBytes < 0 || c.ColdChunkBytes%gpubuf.Align != 0 {
		errs = append(errs, fmt.Errorf("cufile: ColdChunkBytes (%d) must be a positive multiple of %d", c.ColdChunkBytes, gpubuf.Align))
	}
	if c.Workers < 0 {
		errs = append(errs, fmt.Errorf("cufile: Workers (%d) must be positive", c.Workers))
	}
	switch c.Direct {
	case "", "auto", "always", "never":
	default:
		errs = append(errs, fmt.Errorf("cufile: Direct %q must be auto, always or never", c.Direct))
	}
	return errors.Join(errs...)
}

// Probe is one check of the host's GPU and GDS stack.
type Probe struct {
	Name   string `json:"name"`
	OK     bool   `json:"ok"`
	Detail string `json:"detail"`
}

// Report is the result of probing: every check and the engine chosen.
type Report struct {
	Probes  []Probe `json:"probes"`
	Engine  string  `json:"engine"`  // the engine files get unless a per-file check says otherwise
	Backend string  `json:"backend"` // "cuda" or "host"
	Why     string  `json:"why"`
}

// Engines is the set of engines usable on this host and the per-file chooser.
type Engines struct {
	cfg Config
	log zerolog.Logger

	drv  *Driver
	lib  *Lib // non-nil when cuFileDriverOpen succeeded
	nvfs bool // /dev/nvidia-fs* present: GDS can be true P2P
	// compatWarm: auto without nvidia-fs serves files in the page cache with
	// cuFile compat mode and the others with posix (see Choose).
	compatWarm bool
	report     Report
	host       Engine
	posix      *posixEngine
	gds        *gdsEngine
	backend    gpubuf.Backend
	hostBE     *gpubuf.HostBackend // owned, closed by Close

	mu    sync.Mutex
	files map[fileKey]choice // GUARDED_BY(mu): per-file decisions

	refused *refusals // files cuFile refused or failed on, per cause and filesystem

	tierStreams streamPool // the memory tier's copy streams (tierstreams.go)

	// stopSweeper ends the cuFile handle sweeper (handles.go); nil
	// without cuFile.
	stopSweeper func()
}

type choice struct {
	engine Engine
	why    string
}

// Open probes the host once and prepares the engines cfg.Engine allows. It
// fails only when the engine asked for explicitly cannot run here (for
// example --engine gds without libcufile); auto always succeeds.
func Open(cfg Config) (*Engines, error) {
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	if cfg.Engine == "" {
		cfg.Engine = EngineAuto
	}
	e := &Engines{cfg: cfg, log: cfg.Log, files: map[fileKey]choice{}, refused: newRefusals(cfg.Log)}
	e.host = NewHostEngine(Options{ChunkBytes: cfg.ChunkBytes, Workers: cfg.Workers, Direct: cfg.Direct, ColdTaskBytes: cfg.ColdChunkBytes, ColdReadAheadBytes: cfg.ColdReadAheadBytes, ColdCrowd: cfg.ColdCrowd})
	add := func(name string, ok bool, format string, args ...any) {
		e.report.Probes = append(e.report.Probes, Probe{Name: name, OK: ok, Detail: fmt.Sprintf(format, args...)})
	}
	var gpuErr error
	if cfg.Engine != EngineHost {
		e.drv, gpuErr = LoadDriver()
		switch {
		case gpuErr == nil:
			v, _ := e.drv.Version()
			add("libcuda", true, "libcuda.so.1 loaded, CUDA driver API %d.%d", v/1000, v%1000/10)
			var names []string
			for i := range e.drv.Devices() {
				n, _ := e.drv.DeviceName(i)
				free, total, _ := e.drv.MemInfo(i)
				id := ""
				if u := e.drv.UUIDs(); u != nil {
					id = " " + u[i].String()
				}
				names = append(names, fmt.Sprintf("%d: %s%s (%d of %d MiB free)", i, n, id, free>>20, total>>20))
			}
			add("cuda devices", true, "%d: %v", e.drv.Devices(), names)
		case errors.Is(gpuErr, ErrNoDevice):
			add("libcuda", true, "libcuda.so.1 loaded")
			add("cuda devices", false, "no CUDA device visible (check nvidia-smi and CUDA_VISIBLE_DEVICES)")
		default:
			add("libcuda", false, "%v", gpuErr)
		}
	}
	if e.drv != nil && cfg.Engine != EnginePosix {
		e.probeCuFile(add)
	}
	if err := e.choose(gpuErr); err != nil {
		e.Close()
		return nil, err
	}
	e.log.Info().Str("engine", e.report.Engine).Str("backend", e.report.Backend).Str("why", e.report.Why).Msg("cufile: transfer engine")
	return e, nil
}

func (e *Engines) probeCuFile(add func(string, bool, string, ...any)) {
	lib, err := LoadLib()
	if err != nil {
		add("libcufile", false, "%v", err)
		return
	}
	add("libcufile", true, "libcufile.so.0 loaded, version %d.%d", lib.Version()/1000, lib.Version()%1000/10)
	nodes, _ := filepath.Glob("/dev/nvidia-fs*")
	e.nvfs = len(nodes) > 0
	if e.nvfs {
		add("nvidia-fs", true, "%d device nodes (%s...)", len(nodes), nodes[0])
	} else {
		add("nvidia-fs", false, "no /dev/nvidia-fs*: no peer-to-peer DMA; cuFile can only run in compat mode (load nvidia-fs.ko for true GDS)")
		if _, err := os.Stat("/proc/driver/nvidia-fs/devcount"); err == nil {
			// libcufile's error path closes fd 0 in this half-configured
			// state (fastsafetensors #102): do not open the driver.
			add("cuFileDriverOpen", false, "skipped: nvidia-fs is loaded but its /dev nodes are missing (create them with nvidia-fs's mknod script)")
			return
		}
	}
	if err := e.drv.Do(0, lib.DriverOpen); err != nil {
		add("cuFileDriverOpen", false, "%v", err)
		return
	}
	add("cuFileDriverOpen", true, "driver open")
	e.lib = lib
	if p, err := lib.DriverProps(); err == nil {
		add("cuFile properties", true, "compat mode allowed=%v, GDS filesystems flags=%#x, max direct IO %d KiB, batch %d",
			p.CompatAllowed(), p.StatusFlags, p.MaxDirectIOSizeKiB, p.MaxBatchIOSize)
	}
	if err := unix.Access("/run/udev", unix.R_OK|unix.X_OK); err != nil {
		add("udev", false, "/run/udev not readable: cuFile cannot classify block devices (error 5027 per file)")
	} else {
		add("udev", true, "/run/udev readable")
	}
}

// choose sets the default engine and the pool backend.
func (e *Engines) choose(gpuErr error) error {
	r := &e.report
	gpu := e.drv != nil
	if gpu {
		be, why := newCUDABackend(e.drv)
		e.backend = be
		r.Probes = append(r.Probes, Probe{Name: "cuda slab handles", OK: be.vmm, Detail: why})
		e.posix = newPosixEngine(cudaStager{d: e.drv}, Options{ChunkBytes: e.cfg.ChunkBytes, Workers: e.cfg.Workers, Direct: e.cfg.Direct, ColdTaskBytes: e.cfg.ColdChunkBytes, ColdReadAheadBytes: e.cfg.ColdReadAheadBytes, ColdCrowd: e.cfg.ColdCrowd})
		r.Backend = "cuda"
	}
	if e.lib != nil {
		e.gds = newGDSEngine(e.drv, e.lib, e.cfg.ChunkBytes, e.cfg.Workers, !e.nvfs)
		if gpu {
			e.gds.prime(e.drv.Devices()) // threadpool.go
		}
		e.startSweeper()
	}
	switch e.cfg.Engine {
	case EngineHost:
		r.Engine, r.Why = EngineHost, "--engine host"
	case EnginePosix:
		if !gpu {
			return fmt.Errorf("cufile: --engine posix needs a GPU: %w (use --engine host or auto)", gpuErr)
		}
		r.Engine, r.Why = EnginePosix, "--engine posix"
	case EngineGDS:
		if e.gds == nil {
			if !gpu {
				return fmt.Errorf("cufile: --engine gds needs a GPU: %w (use --engine auto)", gpuErr)
			}
			return errors.New("cufile: --engine gds needs libcufile and cuFileDriverOpen, which failed (see gdsfs doctor; use --engine auto)")
		}
		r.Engine, r.Why = EngineGDS, "--engine gds"
		if !e.nvfs {
			r.Why += " (cuFile compat mode: no nvidia-fs)"
		}
	default:
		switch {
		case !gpu:
			r.Engine, r.Why = EngineHost, fmt.Sprintf("no GPU (%v): slabs are shared host memory", gpuErr)
		case e.gds != nil && e.nvfs:
			r.Engine, r.Why = EngineGDS, "cuFile with nvidia-fs (peer-to-peer DMA), per file when cuFileHandleRegister accepts it"
		case e.gds != nil:
			// Measured on an H200 host (gdsfs bench engines, 4 GiB file):
			// compat mode 50 GB/s warm vs posix 37-47, but 1.55 GB/s cold
			// vs posix 1.84-2.03 (O_DIRECT). So: each where it is faster.
			e.compatWarm = true
			r.Engine, r.Why = EnginePosix, "no nvidia-fs: posix pipeline for files not in the page cache, cuFile compat mode for files in it (where it measured faster)"
		default:
			r.Engine, r.Why = EnginePosix, "GPUDirect Storage unavailable (see probes): parallel pread, pinned staging, async copies"
		}
	}
	if r.Engine == EngineHost {
		hb, err := gpubuf.NewHostBackend(gpubuf.HostBackendOptions{Dir: e.cfg.HostDir})
		if err != nil {
			return err
		}
		e.hostBE, e.backend, r.Backend = hb, hb, gpubuf.HostBackendName
	}
	return nil
}

// Backend is the memory the pool must allocate slabs from: CUDA device
// memory with a GPU engine, shared host memory with the host engine.
func (e *Engines) Backend() gpubuf.Backend { return e.backend }

// Probe returns the host probe (for gdsfs doctor and user.gdsfs.info).
func (e *Engines) Probe() Report { return e.report }

// DeviceUUIDs is the UUID of each device the pool allocates slabs on, by
// ordinal, in UUID.String's spelling; nil when slabs are host memory or
// the driver cannot tell UUIDs.
func (e *Engines) DeviceUUIDs() []string {
	if _, ok := e.backend.(*cudaBackend); !ok || e.drv == nil || e.drv.UUIDs() == nil {
		return nil
	}
	out := make([]string, 0, len(e.drv.UUIDs()))
	for _, u := range e.drv.UUIDs() {
		out = append(out, u.String())
	}
	return out
}

// Driver is the loaded CUDA driver, nil without a GPU (benchmarks use it).
func (e *Engines) Driver() *Driver { return e.drv }

// Engine returns the engine of the given name if it can run here.
func (e *Engines) Engine(name string) (Engine, bool) {
	switch name {
	case EngineHost:
		return e.host, e.report.Backend == gpubuf.HostBackendName
	case EnginePosix:
		return e.posix, e.posix != nil
	case EngineGDS, EngineGDSCompat:
		return e.gds, e.gds != nil
	}
	return nil, false
}

// Choose returns the engine that serves [off, off+n) of backing file f (at
// path; n < 0: to end of file) and why. It is the one engine chooser: ctl
// asks it per READ about the READ's span, per WRITE and per
// user.gdsfs.info about the whole file, and gdsfs read and doctor ask it
// too. f may be nil when only the path is known: Choose then opens path
// itself.
//
// With GDS it registers the file with cuFile once; a file cuFile refuses is
// served by the posix engine, and that is logged once per file. The
// returned engine also falls back to posix, for that file, if cuFile fails
// mid-transfer: clients never see a cuFile error. In auto mode without
// nvidia-fs the answer depends on the range: cuFile compat mode while most
// of it is in the page cache, posix otherwise, measured over a bounded
// sample of the range only (residencySample: at most 8 MiB walked, about
// 60 us on a cached file on a 2-core test machine, BenchmarkResidency), so
// a call costs the same for any size and needs no cache of its
// answers. Any other configuration answers without a system call, or (gds
// with nvidia-fs) with one fstat and a map lookup. Safe for concurrent use.
func (e *Engines) Choose(f *os.File, path string, off, n int64) (Engine, string) {
	return e.ChooseAs(f, path, off, n, nil)
}

// ReasonNoResidency is the reason ChooseAs gives when residency would
// have decided but the caller may not be told it.
const ReasonNoResidency = "posix: chosen without the page cache's residency, which the kernel tells only the file's owner and writers (a file you own or may write gets cuFile compat mode where its range is cached)"

// ChooseAs is Choose on behalf of a caller that may be told the file's
// page-cache residency only if mayKnow (nil: always) answers true: the
// kernel's rule (pagecache.MayTell). Where the answer would depend on
// residency (auto without nvidia-fs) and mayKnow says no, it answers the
// posix engine without measuring anything, the same whatever is cached,
// with ReasonNoResidency; mayKnow is asked only then. Every other answer is
// Choose's.
func (e *Engines) ChooseAs(f *os.File, path string, off, n int64, mayKnow func() bool) (Engine, string) {
	r := e.report
	if r.Engine != EngineGDS && !e.compatWarm {
		if r.Engine == EngineHost {
			return e.host, r.Why
		}
		return e.posix, r.Why
	}
	if f == nil {
		own, err := os.Open(path)
		if err != nil {
			return e.posix, fmt.Sprintf("posix: open %q: %v", path, err)
		}
		defer own.Close()
		f = own
	}
	k, err := keyOf(f)
	if err != nil {
		return e.posix, fmt.Sprintf("posix: %v", err)
	}
	e.mu.Lock()
	c, ok := e.files[k]
	e.mu.Unlock()
	if !ok {
		c = e.register(f, k, path)
	}
	if _, gds := c.engine.(*fallbackEngine); gds && e.compatWarm {
		if mayKnow != nil && !mayKnow() {
			return e.posix, ReasonNoResidency
		}
		if !rangeMostlyCached(f, off, n) {
			return e.posix, "posix: range not in the page cache, where the posix pipeline reads faster than cuFile compat mode"
		}
		return c.engine, "gds-compat: range in the page cache, where cuFile compat mode reads faster than the posix pipeline"
	}
	return c.engine, c.why
}

// Residency sampling: at most residencyWindows windows of residencyWindow
// bytes, spread evenly over the range, are measured (cachestat costs time
// in proportion to the pages it walks: 8 MiB is about 0.2 ms cached).
const (
	residencyWindows = 8
	residencyWindow  = 1 << 20
)

// residencySample returns the windows [off, off+len) measured for the range
// [off, off+n): the range itself when it is small, else residencyWindows
// windows of residencyWindow bytes spread evenly from its start to its end.
func residencySample(off, n int64) [][2]int64 {
	if n <= 0 {
		return nil
	}
	if n <= residencyWindows*residencyWindow {
		return [][2]int64{{off, n}}
	}
	w := make([][2]int64, residencyWindows)
	stride := (n - residencyWindow) / (residencyWindows - 1)
	for i := range w {
		w[i] = [2]int64{off + int64(i)*stride, residencyWindow}
	}
	return w
}

// rangeMostlyCached reports whether at least half of a bounded sample of
// [off, off+n) of f (n < 0: to end of file; clipped to the file) is in the
// page cache.
func rangeMostlyCached(f *os.File, off, n int64) bool {
	st, err := f.Stat()
	if err != nil || off < 0 || off >= st.Size() {
		return false
	}
	if n < 0 || n > st.Size()-off {
		n = st.Size() - off
	}
	var measured, cached int64
	for _, w := range residencySample(off, n) {
		c, ok := pagecache.Cached(f, w[0], w[1])
		if !ok {
			return false
		}
		measured += w[1]
		cached += min(c, w[1]) // cachestat counts whole pages
	}
	return measured > 0 && cached >= measured/2
}

// Refusals counts the files cuFile refused (or failed on) and the posix
// engine served instead, per cause and filesystem, most files first.
func (e *Engines) Refusals() []Refusal { return e.refused.list() }

// register decides, once per file, whether cuFile serves it.
func (e *Engines) register(f *os.File, k fileKey, path string) choice {
	var c choice
	if err := e.gds.probe(f); err != nil {
		c = choice{e.posix, fmt.Sprintf("posix: cuFileHandleRegister refused the file: %v", err)}
		e.refused.note(f, path, err, "cufile: cuFile refused file; serving it with the posix engine", refusalHint(err))
	} else {
		why := "gds: cuFile P2P"
		if !e.nvfs {
			why = "gds-compat: cuFile compat mode (no nvidia-fs)"
		}
		c = choice{&fallbackEngine{e: e, key: k, path: path}, why}
	}
	e.mu.Lock()
	if len(e.files) >= 4*handleCacheMax {
		clear(e.files)
	}
	e.files[k] = c
	e.mu.Unlock()
	return c
}

// fallbackEngine is gds for one file, switching that file to posix for good
// on the first cuFile failure.
type fallbackEngine struct {
	e    *Engines
	key  fileKey
	path string
}

func (f *fallbackEngine) Name() string { return f.e.gds.Name() }

// ReadsBuffered implements BufferedReader: without nvidia-fs cuFile runs in
// compat mode, reading with POSIX preads of the buffered descriptor it was
// registered with, so the file's page cache (and the readahead that fills
// it) serves it as it serves the posix engine. With nvidia-fs it reads by
// DMA around the page cache.
func (f *fallbackEngine) ReadsBuffered(_, _ int64) bool { return !f.e.nvfs }

func (f *fallbackEngine) demote(file *os.File, err error) {
	f.e.refused.note(file, f.path, err, "cufile: cuFile failed on file; serving it with the posix engine from now on", refusalHint(err))
	f.e.mu.Lock()
	f.e.files[f.key] = choice{f.e.posix, fmt.Sprintf("posix: cuFile failed on this file: %v", err)}
	f.e.mu.Unlock()
}

func (f *fallbackEngine) ReadAt(ctx context.Context, file *os.File, dst gpubuf.Memory, dstOff, fileOff, n int64) (int64, error) {
	got, err := f.e.gds.ReadAt(ctx, file, dst, dstOff, fileOff, n)
	if err == nil || ctx.Err() != nil || errors.Is(err, ErrRange) || errors.Is(err, errEngineClosed) {
		return got, err
	}
	f.demote(file, err)
	return f.e.posix.ReadAt(ctx, file, dst, dstOff, fileOff, n)
}

func (f *fallbackEngine) WriteAt(ctx context.Context, file *os.File, src gpubuf.Memory, srcOff, fileOff, n int64) (int64, error) {
	got, err := f.e.gds.WriteAt(ctx, file, src, srcOff, fileOff, n)
	if err == nil || ctx.Err() != nil || errors.Is(err, ErrRange) || errors.Is(err, errEngineClosed) || !isWritable(file) {
		return got, err
	}
	f.demote(file, err)
	return f.e.posix.WriteAt(ctx, file, src, srcOff, fileOff, n)
}

// Close releases cuFile handles, staging memory and the host backend's
// directory. The pool built on Backend must be closed first. The cuFile
// driver stays open and libcufile stays loaded (unloading it crashes).
func (e *Engines) Close() error {
	var errs []error
	if e.stopSweeper != nil {
		e.stopSweeper()
		e.stopSweeper = nil
	}
	if e.gds != nil {
		e.gds.Close()
	}
	if e.posix != nil {
		errs = append(errs, e.posix.Close())
	}
	if e.hostBE != nil {
		errs = append(errs, e.hostBE.Close())
	}
	if e.drv != nil {
		errs = append(errs, e.tierStreams.close(e.drv))
	}
	return errors.Join(errs...)
}

// ProbeFile reports whether cuFile accepts the file at path
// (cuFileHandleRegister), whatever engine the file would get. It returns a
// failed probe without a GPU or libcufile.
func (e *Engines) ProbeFile(path string) Probe {
	p := Probe{Name: "cuFileHandleRegister"}
	if e.gds == nil {
		p.Detail = "not tried: cuFile is not usable on this host (see above)"
		return p
	}
	f, err := os.Open(path)
	if err != nil {
		p.Detail = err.Error()
		return p
	}
	defer f.Close()
	if err := e.gds.probe(f); err != nil {
		p.Detail = err.Error()
		var fe *FileError
		if errors.As(err, &fe) && fe.Code == fileHandleNotRegistered {
			p.Detail += " (cuFile cannot classify the file's block device: is there a udev record for it in /run/udev/data?)"
		}
		return p
	}
	p.OK = true
	p.Detail = "registered"
	return p
}
