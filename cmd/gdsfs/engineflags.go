package main

import (
	"strconv"
	"strings"

	"github.com/dustin/go-humanize"
	"github.com/rs/zerolog"
	"github.com/spf13/pflag"

	"github.com/gdsfs/gdsfs/cufile"
	"github.com/gdsfs/gdsfs/daemon"
	"github.com/gdsfs/gdsfs/gpubuf"
)

// engineFlags are the transfer engine and buffer pool flags shared by
// `gdsfs mount` (into its daemon.Config) and `gdsfs bench engines`.
type engineFlags struct {
	engine    string
	gpuPool   string
	hostPool  string
	slabSize  string
	uidShare  string
	chunk     string
	coldTask  string
	coldAhead string
	coldCrowd int
	workers   int
	direct    string
}

// addEngineFlags registers the engine and pool flags on fs.
func addEngineFlags(fs *pflag.FlagSet) *engineFlags {
	f := &engineFlags{}
	fs.StringVar(&f.engine, "engine", cufile.EngineAuto, "transfer engine: auto, gds (cuFile), posix (parallel pread + pinned copies) or host (no GPU)")
	fs.StringVar(&f.gpuPool, "gpu-pool", "", "GPU memory per device for slabs, e.g. 8GiB (default: 2GiB or a quarter of free memory, whichever is less)")
	fs.StringVar(&f.hostPool, "host-pool", "", "shared host memory for slabs with the host engine, e.g. 4GiB (default: 2GiB or a quarter of /dev/shm, whichever is less)")
	fs.StringVar(&f.slabSize, "slab-size", "64MiB", "size of one slab (leases larger than this get a slab of their own)")
	fs.StringVar(&f.uidShare, "uid-share", "50%", "most of each device's pool one uid may hold, as a percentage or fraction of the pool (50%, 0.25) or a size (1GiB); rounded up to whole slabs; 100% lets one uid take everything")
	fs.StringVar(&f.chunk, "chunk-size", "8MiB", "size of one parallel transfer task")
	fs.StringVar(&f.coldTask, "cold-chunk-size", "1MiB", "size of one parallel task of a buffered read of a range not in the page cache (ranges of at least twice this are split); --chunk-size or more: no split")
	fs.StringVar(&f.coldAhead, "cold-readahead", "auto", "how far ahead of its workers a buffered read of a range not in the page cache asks the kernel to read (posix_fadvise WILLNEED), e.g. 64MiB; auto: io-workers x chunk-size; 0: no advice (docs/operations.md, \"Cold reads\": what it gains and costs)")
	fs.IntVar(&f.coldCrowd, "cold-crowd", 0, "cold buffered reads in flight from which each is read in tasks of its disk's largest request (queue/max_sectors_kb) and none asks for --cold-readahead advice, e.g. 4: the others' reads keep the disk's queue full (docs/operations.md, \"Cold reads\"); 0: never")
	fs.IntVar(&f.workers, "io-workers", 0, "parallel transfer workers per request (default: CPU count, 4 to 16)")
	fs.StringVar(&f.direct, "direct-io", "auto", "O_DIRECT for the posix and host engines: auto (reads of cold ranges of files larger than a quarter of memory, writes of at least 1 MiB), always or never")
	return f
}

// parseSize parses a size flag such as "2GiB" that must be a positive
// multiple of 4 KiB.
func parseSize(flag, v string) (int64, error) {
	n, err := humanize.ParseBytes(v)
	if err != nil || n == 0 || n > 1<<50 {
		return 0, usagef("--%s %q: give a size such as 64MiB or 2GiB", flag, v)
	}
	if n%gpubuf.Align != 0 {
		return 0, usagef("--%s %q: must be a multiple of 4KiB", flag, v)
	}
	return int64(n), nil
}

// engineSettings is the parsed form of engineFlags.
type engineSettings struct {
	cfg               cufile.Config
	slabBytes         int64
	gpuPool, hostPool int64 // 0: default
	// The per-uid share: shareBytes when not 0, else shareFrac of the
	// budget.
	shareBytes int64
	shareFrac  float64
}

// parseShare parses --uid-share: a percentage ("50%"), a fraction of the
// pool in (0, 1] ("0.25"), or a size ("1GiB").
func parseShare(v string) (frac float64, bytes int64, err error) {
	bad := usagef("--uid-share %q: give a percentage (50%%), a fraction of the pool (0.25) or a size (1GiB)", v)
	if pct, ok := strings.CutSuffix(v, "%"); ok {
		f, err := strconv.ParseFloat(pct, 64)
		if err != nil || !(f > 0 && f <= 100) {
			return 0, 0, bad
		}
		return f / 100, 0, nil
	}
	if f, err := strconv.ParseFloat(v, 64); err == nil {
		if !(f > 0 && f <= 1) {
			return 0, 0, usagef("--uid-share %q: a fraction must be above 0 and at most 1 (give a size with its unit, such as 1GiB)", v)
		}
		return f, 0, nil
	}
	n, err := parseSize("uid-share", v)
	if err != nil {
		return 0, 0, bad
	}
	return 0, n, nil
}

func (f *engineFlags) parse(log zerolog.Logger) (engineSettings, error) {
	var s engineSettings
	switch f.engine {
	case cufile.EngineAuto, cufile.EngineGDS, cufile.EnginePosix, cufile.EngineHost:
	default:
		return s, usagef("--engine %q: use auto, gds, posix or host", f.engine)
	}
	switch f.direct {
	case "auto", "always", "never":
	default:
		return s, usagef("--direct-io %q: use auto, always or never", f.direct)
	}
	if f.workers < 0 || f.workers > 256 {
		return s, usagef("--io-workers %d: give 1 to 256, or 0 for the default", f.workers)
	}
	var err error
	if s.slabBytes, err = parseSize("slab-size", f.slabSize); err != nil {
		return s, err
	}
	if s.shareFrac, s.shareBytes, err = parseShare(f.uidShare); err != nil {
		return s, err
	}
	chunk, err := parseSize("chunk-size", f.chunk)
	if err != nil {
		return s, err
	}
	coldTask, err := parseSize("cold-chunk-size", f.coldTask)
	if err != nil {
		return s, err
	}
	var coldAhead int64 // no advice
	switch f.coldAhead {
	case "0", "off":
	case "auto", "":
		coldAhead = -1
	default:
		if coldAhead, err = parseSize("cold-readahead", f.coldAhead); err != nil {
			return s, err
		}
	}
	if f.coldCrowd < 0 {
		return s, usagef("--cold-crowd %d is negative; give the cold reads in flight from which they take large tasks, or 0 for never", f.coldCrowd)
	}
	if f.gpuPool != "" {
		if s.gpuPool, err = parseSize("gpu-pool", f.gpuPool); err != nil {
			return s, err
		}
	}
	if f.hostPool != "" {
		if s.hostPool, err = parseSize("host-pool", f.hostPool); err != nil {
			return s, err
		}
	}
	for _, p := range []struct {
		name string
		v    int64
	}{{"gpu-pool", s.gpuPool}, {"host-pool", s.hostPool}} {
		if p.v != 0 && p.v < s.slabBytes {
			return s, usagef("--%s %s is smaller than --slab-size %s; give at least one slab", p.name, humanize.IBytes(uint64(p.v)), f.slabSize)
		}
	}
	s.cfg = cufile.Config{Engine: f.engine, ChunkBytes: chunk, ColdChunkBytes: coldTask, ColdReadAheadBytes: coldAhead, ColdCrowd: f.coldCrowd, Workers: f.workers, Direct: f.direct, Log: log}
	return s, nil
}

// apply sets the engine and pool fields of the daemon's configuration.
func (s engineSettings) apply(c *daemon.Config) {
	c.Engine = s.cfg
	c.SlabBytes = s.slabBytes
	c.GPUPoolBytes, c.HostPoolBytes = s.gpuPool, s.hostPool
	c.UIDShareBytes, c.UIDShareFraction = s.shareBytes, s.shareFrac
}
