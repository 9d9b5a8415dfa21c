package daemon

import (
	"context"
	"errors"
	"fmt"
	"net"
	"os"
	"path/filepath"
	"strings"
	"sync"

	"github.com/dustin/go-humanize"
	"golang.org/x/sys/unix"

	"github.com/gdsfs/gdsfs/cache"
	"github.com/gdsfs/gdsfs/ctlserver"
	"github.com/gdsfs/gdsfs/cufile"
	"github.com/gdsfs/gdsfs/fs"
	"github.com/gdsfs/gdsfs/gpubuf"
	"github.com/gdsfs/gdsfs/handoffserver"
	"github.com/gdsfs/gdsfs/internal/fuseconn"
	"github.com/gdsfs/gdsfs/internal/mountinfo"
	"github.com/gdsfs/gdsfs/internal/readahead"
	"github.com/gdsfs/gdsfs/metrics"
	"github.com/gdsfs/gdsfs/metrics/instrument"
	"github.com/gdsfs/gdsfs/tier"
)

// Daemon is one running gdsfs mount with its control path. Its methods are
// safe for concurrent use.
type Daemon struct {
	cfg Config

	metricsLn   net.Listener     // bound, not yet served; nil without Config.MetricsAddr
	metrics     *metrics.Metrics // nil without Config.MetricsAddr
	metricsAddr string
	engines     *cufile.Engines
	pool        *gpubuf.Pool
	indexes     *cache.Indexes
	tier        *tier.Tier // nil without Config.TierBytes
	slabs       *handoffserver.Server
	ctl         *ctlserver.Server
	mount       *fs.Server
	served      chan struct{} // closed once the mount stops serving
	// conn is the mount's entry in the mount table as mounted: its FUSE
	// connection, which Abort can still name once the mount is detached.
	conn mountinfo.Entry
	// abort is conn's fusectl abort file, opened at mount (nil: abortErr
	// says why it could not be).
	abort    *fuseconn.Handle
	abortErr error

	// undo holds what Start built, in build order; Close runs it
	// backwards, once.
	undo      []step
	closeOnce sync.Once
	closeErr  error
}

// step is the undoing of one thing Start built.
type step struct {
	what string // "close engines": what failed, for Close's error
	undo func() error
}

// Start builds a daemon and mounts it: transfer engines, buffer pool, shard
// indexes, slab socket and control server, metrics, then the FUSE mount,
// each on what the previous built. It returns once the mount serves. On
// failure it undoes what it built, in reverse, and returns why: a
// *ConfigError when cfg asks for what cannot be done. ctx bounds the start
// only; the daemon then runs until unmounted (Wait) and Close.
func Start(ctx context.Context, cfg Config) (*Daemon, error) {
	if err := cfg.Validate(); err != nil {
		return nil, &ConfigError{err}
	}
	if cfg.Version == "" {
		cfg.Version = Version
	}
	d := &Daemon{cfg: cfg}
	for _, build := range []func(context.Context) error{
		d.listenMetrics, // first: a bad or busy address fails before anything is probed
		d.openEngines,
		d.openPool,
		d.openIndexes,
		d.openTier,     // tier.go
		d.startControl, // the control server and its slab socket
		d.serveMetrics,
		d.mountFS,
	} {
		if err := build(ctx); err != nil {
			if cerr := d.Close(); cerr != nil {
				err = fmt.Errorf("%w (undoing the start: %v)", err, cerr)
			}
			return nil, err
		}
	}
	return d, nil
}

func (d *Daemon) push(what string, undo func() error) {
	d.undo = append(d.undo, step{what, undo})
}

// listenMetrics binds Config.MetricsAddr; serveMetrics serves it.
func (d *Daemon) listenMetrics(context.Context) error {
	addr := d.cfg.MetricsAddr
	if addr == "" {
		return nil
	}
	l, err := metrics.Listen(addr)
	if err != nil {
		return configErrorf("--metrics-addr %q: %v; give a free HOST:PORT such as 127.0.0.1:9477", addr, errors.Unwrap(err))
	}
	d.metricsLn, d.metrics, d.metricsAddr = l, metrics.New(), l.Addr().String()
	d.push("close metrics listener", func() error {
		if d.metricsLn == nil {
			return nil // Serve owns it
		}
		return d.metricsLn.Close()
	})
	return nil
}

// openEngines probes the host once for the transfer engines and the slab
// memory backend.
func (d *Daemon) openEngines(context.Context) error {
	ec := d.cfg.Engine
	ec.Log = d.cfg.Log
	eng, err := cufile.Open(ec)
	if err != nil {
		return fmt.Errorf("%w; run gdsfs doctor to see why", err)
	}
	d.engines = eng
	d.push("close engines", eng.Close)
	return nil
}

// openPool builds the buffer pool on the engines' backend.
func (d *Daemon) openPool(context.Context) error {
	slab := d.cfg.slabBytes()
	budget, err := d.budget(slab)
	if err != nil {
		return err
	}
	pool, err := gpubuf.NewPool(gpubuf.Config{Backend: d.engines.Backend(), SlabBytes: slab, BudgetBytes: budget,
		UIDShareBytes: d.cfg.UIDShare(budget), Log: d.cfg.Log})
	if err != nil {
		return err
	}
	d.pool = pool
	d.push("free buffer pool", pool.Close)
	d.cfg.Log.Info().Str("backend", d.engines.Backend().Name()).Str("budget", humanize.IBytes(uint64(budget))).
		Str("slab", humanize.IBytes(uint64(slab))).Str("uid_share", humanize.IBytes(uint64(pool.MaxLeaseBytes()))).
		Msg("buffer pool")
	return nil
}

// budget is the per-device pool budget: the configured one, or
// min(gpubuf.DefaultBudgetBytes, a quarter of the free memory) in whole
// slabs, at least one.
func (d *Daemon) budget(slab int64) (int64, error) {
	be := d.engines.Backend().Name()
	var free int64
	if be == gpubuf.HostBackendName {
		if d.cfg.HostPoolBytes != 0 {
			return d.cfg.HostPoolBytes, nil
		}
		var st unix.Statfs_t
		if err := unix.Statfs("/dev/shm", &st); err != nil {
			return 0, fmt.Errorf("statfs /dev/shm: %w; give --host-pool", err)
		}
		free = int64(st.Bavail) * int64(st.Bsize)
	} else {
		if d.cfg.GPUPoolBytes != 0 {
			return d.cfg.GPUPoolBytes, nil
		}
		f, _, err := d.engines.Driver().MemInfo(0)
		if err != nil {
			return 0, fmt.Errorf("read free GPU memory: %w; give --gpu-pool", err)
		}
		free = f
	}
	b := min(int64(gpubuf.DefaultBudgetBytes), free/4)
	b -= b % slab
	if b < slab {
		if free < slab {
			return 0, fmt.Errorf("only %s of %s memory is free, less than one %s slab; free memory or lower --slab-size",
				humanize.IBytes(uint64(free)), be, humanize.IBytes(uint64(slab)))
		}
		b = slab
	}
	return b, nil
}

// openIndexes builds the shard-index cache.
func (d *Daemon) openIndexes(context.Context) error {
	n := d.cfg.MetaCacheBytes
	if n == 0 {
		n = DefaultMetaCacheBytes
	}
	ix, err := cache.NewIndexes(n, d.cfg.Log)
	if err != nil {
		return err
	}
	d.indexes = ix
	d.push("close shard indexes", func() error { ix.Close(); return nil })
	return nil
}

// startControl builds the control server and serves its slab socket. The
// socket is bound first so that HELLO can name it; Close closes it before
// ending the sessions.
func (d *Daemon) startControl(context.Context) error {
	slabs, err := handoffserver.Listen(handoffserver.Options{Addr: d.cfg.SlabSocket, Log: d.cfg.Log})
	if err != nil {
		if d.cfg.SlabSocket != "" {
			return configErrorf("--slab-socket %s: %v (create its directory, or leave the flag out for an abstract socket)", d.cfg.SlabSocket, err)
		}
		return err
	}
	var chooser ctlserver.EngineChooser = d.engines
	if d.cfg.WrapEngines != nil {
		chooser = d.cfg.WrapEngines(chooser)
	}
	if d.metrics != nil {
		chooser = instrument.Engines(chooser, d.metrics)
	}
	probe := d.engines.Probe()
	srv, err := ctlserver.NewServer(ctlserver.Options{
		SlabSocket:          slabs.Addr(),
		BackingPath:         backingPaths(d.cfg.Source, d.cfg.Mountpoint),
		Pool:                d.pool,
		Engines:             chooser,
		Indexes:             d.indexes,
		Engine:              probe.Engine,
		ReadOnly:            d.cfg.ReadOnly,
		Version:             d.cfg.Version,
		LogFile:             d.cfg.LogFile,
		EngineWhy:           probe.Why,
		DirectWriteMinBytes: cufile.DirectWriteMinBytes(d.cfg.Engine.Direct),
		Refusals:            d.refusals,
		Log:                 d.cfg.Log,
		Tier:                d.tier,
		TierCopier:          d.engines,
		Readahead:           readahead.Config{MaxBytes: d.cfg.ReadaheadBytes},
		DeviceUUIDs:         d.engines.DeviceUUIDs(),
		ResidencyToReaders:  d.cfg.ResidencyToReaders,
	})
	if err != nil {
		slabs.Close()
		return err
	}
	d.ctl = srv
	d.push("close sessions", srv.Close)
	if err := slabs.Serve(srv); err != nil {
		slabs.Close()
		return err
	}
	d.slabs = slabs
	d.push("close slab socket", slabs.Close)
	d.cfg.Log.Info().Str("engine", probe.Engine).Str("why", probe.Why).Bool("read_only", d.cfg.ReadOnly).
		Str("slab_socket", slabs.Addr()).Str("slab_handles", d.engines.SlabHandles()).
		Strs("device_uuids", d.engines.DeviceUUIDs()).Msg("control path ready")
	return nil
}

// refusals reports the files cuFile refused, for STATUS.
func (d *Daemon) refusals() []ctlserver.EngineRefusal {
	var out []ctlserver.EngineRefusal
	for _, r := range d.engines.Refusals() {
		out = append(out, ctlserver.EngineRefusal(r))
	}
	return out
}

// serveMetrics serves /metrics on the listener listenMetrics bound, with
// the pool and index figures read at scrape time (the passthrough figures
// once mounted, see mountFS).
func (d *Daemon) serveMetrics(context.Context) error {
	if d.metrics == nil {
		return nil
	}
	m := d.metrics
	m.SetPool(d.pool.Stats)
	m.SetIndex(d.indexes.Stats)
	d.tierMetrics(m)
	l := d.metricsLn
	d.metricsLn = nil // Serve closes it
	ctx, stop := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- m.Serve(ctx, l) }()
	d.push("stop metrics server", func() error {
		stop()
		return <-done
	})
	d.cfg.Log.Info().Str("addr", l.Addr().String()).Msg("metrics served at /metrics")
	return nil
}

// mountFS mounts the filesystem with the control path, recording FUSE
// operations and control requests in the metrics when there are any.
func (d *Daemon) mountFS(ctx context.Context) error {
	if err := ctx.Err(); err != nil {
		return fmt.Errorf("mount %s: %w", d.cfg.Mountpoint, err)
	}
	c := d.cfg
	o := fs.Options{
		Source:         c.Source,
		Mountpoint:     c.Mountpoint,
		ReadOnly:       c.ReadOnly,
		AllowOther:     c.AllowOther,
		Debug:          c.Debug,
		NoPassthrough:  c.NoPassthrough,
		AttrTimeout:    c.AttrTimeout,
		EntryTimeout:   c.EntryTimeout,
		Control:        d.ctl,
		Logger:         c.Log,
		MaxOpenPerUser: c.MaxOpenPerUser,
		// A file deleted or renamed over through the mount takes its
		// cuFile registrations with it (cufile/handles.go).
		Removed: d.engines.Forget,
	}
	if d.metrics != nil {
		o.Control = instrument.Control(d.ctl, d.metrics)
		o.Observer = d.metrics
	}
	srv, err := fs.Mount(ctx, o)
	if err != nil {
		if os.Geteuid() != 0 {
			return configErrorf("mount %s as uid %d: %v; run gdsfs as root, or make user mounts work (fuse3's setuid fusermount3 and /dev/fuse open to users)",
				c.Mountpoint, os.Geteuid(), strings.TrimSpace(err.Error()))
		}
		return fmt.Errorf("mount %s: %w", c.Mountpoint, err)
	}
	d.mount = srv
	d.served = make(chan struct{})
	go func() {
		srv.Wait()
		close(d.served)
	}()
	if m, ok, err := mountinfo.At(c.Mountpoint); err == nil && ok {
		d.conn = m
		// Opened now, the abort file is bound to this connection: Abort
		// (a second signal, once the mount is detached) can never reach
		// the connection of another mount that took its number.
		if h, err := fuseconn.Open(m); err == nil {
			d.abort = h
			d.push("close the connection's abort file", h.Close)
		} else {
			d.abortErr = err
		}
	}
	// Who serves the mount, for gdsfs unmount/mount/status to name the
	// daemon even once it no longer answers (mountrecord.go); removed
	// after the unmount.
	if remove, err := WriteMountRecord(c.Mountpoint); err != nil {
		c.Log.Warn().Err(err).Msg("cannot record this daemon's mount: gdsfs unmount --force and status will not name its pid if it hangs")
	} else {
		d.push("remove mount record", func() error { remove(); return nil })
	}
	d.push("unmount", d.unmount)
	// The components that report on the running mount get it now.
	d.ctl.Mounted(srv)
	if d.metrics != nil {
		d.metrics.SetPassthrough(func() metrics.Passthrough {
			on, _ := srv.Passthrough()
			return metrics.Passthrough{Enabled: on, PassthroughStats: srv.Stats()}
		})
		d.metrics.SetOpenFiles(srv.OpenStats)
	}
	return nil
}

// unmount is Close's first step: unmount unless the mount is gone already
// (lazily when files are still open), and wait until it stops serving.
func (d *Daemon) unmount() error {
	select {
	case <-d.served:
		return nil
	default:
	}
	var err error
	if uerr := d.mount.Unmount(); uerr != nil {
		d.cfg.Log.Warn().Err(uerr).Msg("unmount failed, detaching lazily")
		err = d.mount.UnmountLazy()
	}
	<-d.served
	return err
}

// Wait blocks until the filesystem is unmounted (by Unmount, by `gdsfs
// unmount` or fusermount3 -u, or by the kernel). The daemon still holds its
// memory and engines then: Close releases them.
func (d *Daemon) Wait() { <-d.served }

// Unmount unmounts the filesystem. It fails (EBUSY) while files on the
// mount are in use; see UnmountLazy.
func (d *Daemon) Unmount() error { return d.mount.Unmount() }

// UnmountLazy detaches the mount even while files on it are in use; it
// stops serving once they are closed.
func (d *Daemon) UnmountLazy() error { return d.mount.UnmountLazy() }

// Abort aborts the mount's FUSE connection (fusectl; root only): every
// request in flight fails with ECONNABORTED, files still open on the mount
// fail from then on, and the mount stops serving (Wait returns). It is how
// a daemon whose mount was detached ends although requests are stuck or
// files stay open: gdsfs mount's second SIGINT/SIGTERM.
func (d *Daemon) Abort() error {
	switch {
	case d.abort != nil:
		return d.abort.Abort()
	case d.abortErr != nil:
		return fmt.Errorf("abort the FUSE connection of %s: its abort file could not be opened at mount: %w", d.cfg.Mountpoint, d.abortErr)
	}
	return fmt.Errorf("abort the FUSE connection of %s: it was not in the mount table when mounted", d.cfg.Mountpoint)
}

// Close undoes Start in reverse: it unmounts if still mounted (lazily when
// files are in use, then waits until they are closed), closes the slab
// socket, ends every session, frees the index cache, the pool and the
// engines, and stops the metrics server. Only the first call does it; every
// call returns its error, which names each step that failed.
func (d *Daemon) Close() error {
	d.closeOnce.Do(func() {
		var errs []error
		for i := len(d.undo) - 1; i >= 0; i-- {
			if err := d.undo[i].undo(); err != nil {
				errs = append(errs, fmt.Errorf("%s: %w", d.undo[i].what, err))
			}
		}
		d.undo = nil
		d.closeErr = errors.Join(errs...)
	})
	return d.closeErr
}

// Pool is the daemon's buffer pool (for its figures).
func (d *Daemon) Pool() *gpubuf.Pool { return d.pool }

// Metrics is what the daemon records; nil without Config.MetricsAddr.
func (d *Daemon) Metrics() *metrics.Metrics { return d.metrics }

// MetricsAddr is the address /metrics is served at (the port chosen, with
// port 0); empty without Config.MetricsAddr.
func (d *Daemon) MetricsAddr() string {
	if d.metrics == nil {
		return ""
	}
	return d.metricsAddr
}

// SlabSocket is the address of the slab socket clients fetch descriptors
// from (announced in HELLO).
func (d *Daemon) SlabSocket() string { return d.slabs.Addr() }

// backingPaths returns, for an overmount (no source), the mapping of the
// daemon's backing paths (/proc/self/fd/N/...: the mountpoint's own
// directory, opened before mounting over it) to the mountpoint's paths,
// which is what clients know; nil otherwise.
func backingPaths(source, mountpoint string) func(string) string {
	if source != "" {
		return nil
	}
	return func(p string) string {
		rest, ok := strings.CutPrefix(p, "/proc/self/fd/")
		if !ok {
			return p
		}
		i := strings.IndexByte(rest, '/')
		if i < 0 {
			return mountpoint
		}
		return filepath.Join(mountpoint, rest[i:])
	}
}
