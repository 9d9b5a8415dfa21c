package daemon

import (
	"errors"
	"fmt"
	"path/filepath"
	"time"

	"github.com/rs/zerolog"

	"github.com/gdsfs/gdsfs/ctlserver"
	"github.com/gdsfs/gdsfs/cufile"
	"github.com/gdsfs/gdsfs/gpubuf"
)

// Version is the daemon version HELLO and user.gdsfs.stats report when
// Config.Version is empty.
const Version = "0.1.0"

// DefaultMetaCacheBytes is Config.MetaCacheBytes' default.
const DefaultMetaCacheBytes = 256 << 20

// Config is everything one daemon is asked to do. The zero value of every
// field but Mountpoint is usable. cmd/gdsfs fills it from `gdsfs mount`'s
// flags; the daemon reads no flags or environment. Its error messages name
// those flags where a value the user gave is at fault.
type Config struct {
	// Mountpoint is the absolute path of the directory to mount on.
	Mountpoint string
	// Source is the absolute path of the backing directory. Empty
	// overmounts: Mountpoint's own contents are served through a
	// descriptor opened before mounting, and the control path reports
	// backing paths under Mountpoint.
	Source string
	// ReadOnly mounts read-only; the control path refuses WRITE and ALLOC
	// with EROFS.
	ReadOnly bool
	// AllowOther lets other users use the mount (the kernel still checks
	// the backing files' permissions).
	AllowOther bool
	// Debug logs every FUSE operation.
	Debug bool
	// NoPassthrough serves every read and write in the daemon, even where
	// the kernel offers FUSE passthrough.
	NoPassthrough bool
	// AttrTimeout and EntryTimeout are the kernel's attribute and name
	// cache timeouts: zero means fs.DefaultAttrTimeout and
	// fs.DefaultEntryTimeout, negative disables caching (fs.Options).
	AttrTimeout, EntryTimeout time.Duration
	// MaxOpenPerUser is each uid's budget of the daemon's descriptors
	// held by its opens on the mount (gdsfs mount --max-open-per-user;
	// fs.Options.MaxOpenPerUser). Zero: the default share.
	MaxOpenPerUser int64

	// Engine configures the transfer engines: auto, gds, posix or host,
	// chunk size, workers per transfer, O_DIRECT policy, host slab
	// directory. Its Log is replaced by Log.
	Engine cufile.Config
	// SlabBytes is the size of one slab, a multiple of gpubuf.Align.
	// Default gpubuf.DefaultSlabBytes.
	SlabBytes int64
	// GPUPoolBytes and HostPoolBytes are the pool's budget per device for
	// CUDA and host slabs. Zero: the smaller of gpubuf.DefaultBudgetBytes
	// and a quarter of the free memory, in whole slabs, at least one.
	GPUPoolBytes, HostPoolBytes int64
	// UIDShareBytes, if not zero, is the most of each device's pool one
	// uid may hold; else UIDShareFraction of the budget, if not zero; else
	// gpubuf.DefaultUIDShare of it (see UIDShare). gpubuf rounds it up to
	// whole slabs.
	UIDShareBytes    int64
	UIDShareFraction float64
	// MetaCacheBytes is the memory for parsed shard indexes. Default
	// DefaultMetaCacheBytes.
	MetaCacheBytes int64
	// TierBytes is the memory tier's budget (gdsfs mount --tier-budget):
	// pinned host memory on a GPU machine, anonymous memory with the host
	// backend. 0: no tier. Its per-uid share follows the pool's rule
	// (UIDShare of it; tier.go).
	TierBytes int64
	// TierChunkBytes is the tier's extent size (a multiple of 4096); 0:
	// tier.DefaultChunkBytes. Tests make it small.
	TierChunkBytes int64
	// GPUCacheBytes is the device tier's budget per GPU (gdsfs mount
	// --gpu-cache): copies of pinned files in each GPU's memory. 0: none.
	// Needs TierBytes and CUDA slabs.
	GPUCacheBytes int64
	// ReadaheadBytes is the most the control path reads ahead of a run of
	// sequential READs (gdsfs mount --readahead; ctlserver readahead.go):
	// 0: readahead.DefaultMaxBytes, negative: off.
	ReadaheadBytes int64
	// ResidencyToReaders tells every reader of a file its page-cache
	// residency through the engine chosen (gdsfs mount --residency
	// readers; ctlserver.Options.ResidencyToReaders). False: owners and
	// writers only, as the kernel does.
	ResidencyToReaders bool

	// MetricsAddr, if set, is the HOST:PORT where Prometheus metrics are
	// served at /metrics (port 0 picks a free one, see MetricsAddr).
	// Empty: no metrics, nothing recorded.
	MetricsAddr string
	// SlabSocket is where clients fetch slab memory descriptors: a path or
	// @name (package handoff). Empty: a new abstract name.
	SlabSocket string
	// LogFile is where Log writes (absolute; empty: stderr), reported in
	// STATUS so `gdsfs status` can name it. The daemon does not open it.
	LogFile string
	// Log receives every component's logs. The zero value discards them.
	Log zerolog.Logger
	// Version is reported by HELLO and STATUS. Default Version.
	Version string

	// WrapEngines, if set, decorates the engine chooser before metrics
	// record what it chooses: tests inject faulty engines with it.
	WrapEngines func(ctlserver.EngineChooser) ctlserver.EngineChooser
}

// Validate reports every problem of c at once, each naming the field, its
// value and the rule.
func (c Config) Validate() error {
	var errs []error
	if c.Mountpoint == "" || !filepath.IsAbs(c.Mountpoint) {
		errs = append(errs, fmt.Errorf("daemon: Mountpoint %q must be an absolute path", c.Mountpoint))
	}
	if c.Source != "" && !filepath.IsAbs(c.Source) {
		errs = append(errs, fmt.Errorf("daemon: Source %q must be an absolute path or empty", c.Source))
	}
	if err := c.Engine.Validate(); err != nil {
		errs = append(errs, err)
	}
	for _, f := range []struct {
		name string
		v    int64
	}{{"SlabBytes", c.SlabBytes}, {"GPUPoolBytes", c.GPUPoolBytes}, {"HostPoolBytes", c.HostPoolBytes},
		{"UIDShareBytes", c.UIDShareBytes}, {"MetaCacheBytes", c.MetaCacheBytes}, {"TierBytes", c.TierBytes}, {"GPUCacheBytes", c.GPUCacheBytes},
		{"MaxOpenPerUser", c.MaxOpenPerUser}} {
		if f.v < 0 {
			errs = append(errs, fmt.Errorf("daemon: %s (%d) must not be negative", f.name, f.v))
		}
	}
	if c.SlabBytes%gpubuf.Align != 0 {
		errs = append(errs, fmt.Errorf("daemon: SlabBytes (%d) must be a multiple of %d", c.SlabBytes, gpubuf.Align))
	}
	if !(c.UIDShareFraction >= 0 && c.UIDShareFraction <= 1) {
		errs = append(errs, fmt.Errorf("daemon: UIDShareFraction (%v) must be in [0, 1]", c.UIDShareFraction))
	}
	return errors.Join(errs...)
}

// UIDShare is the per-uid share in bytes of a pool of budget bytes per
// device: UIDShareBytes, else UIDShareFraction of the budget (at least one
// byte), else 0, which gpubuf reads as gpubuf.DefaultUIDShare of it.
func (c Config) UIDShare(budget int64) int64 {
	switch {
	case c.UIDShareBytes != 0:
		return c.UIDShareBytes
	case c.UIDShareFraction != 0:
		return max(int64(float64(budget)*c.UIDShareFraction), 1)
	}
	return 0
}

func (c Config) slabBytes() int64 {
	if c.SlabBytes == 0 {
		return gpubuf.DefaultSlabBytes
	}
	return c.SlabBytes
}

// ConfigError is an error the configuration (what the user asked for)
// caused, not the host: cmd/gdsfs exits with its usage code for it. Its
// message says what is wrong and what to do.
type ConfigError struct{ Err error }

func (e *ConfigError) Error() string { return e.Err.Error() }
func (e *ConfigError) Unwrap() error { return e.Err }

func configErrorf(format string, args ...any) error {
	return &ConfigError{fmt.Errorf(format, args...)}
}
