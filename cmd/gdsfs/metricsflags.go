package main

import (
	"context"
	"errors"
	"io"

	"github.com/rs/zerolog"
	"github.com/spf13/cobra"

	"github.com/gdsfs/gdsfs/ctl"
	"github.com/gdsfs/gdsfs/fs"
	"github.com/gdsfs/gdsfs/gpubuf"
	"github.com/gdsfs/gdsfs/metrics"
	"github.com/gdsfs/gdsfs/metrics/instrument"
)

// metricsFlags is the mount command's --metrics-addr and the wiring of
// package metrics into the daemon: the control path and its engines are
// wrapped with recording decorators, the pool, index cache and
// passthrough state are read at scrape time.
type metricsFlags struct {
	addr string
	// m is set in the daemon process once the control path is built;
	// nil when --metrics-addr is not given.
	m *metrics.Metrics
}

// addMetricsFlags registers --metrics-addr on the mount command.
func addMetricsFlags(cmd *cobra.Command) *metricsFlags {
	mf := &metricsFlags{}
	cmd.Flags().StringVar(&mf.addr, "metrics-addr", "", "serve Prometheus metrics at http://HOST:PORT/metrics, e.g. 127.0.0.1:9477 (default: off)")
	return mf
}

// wrapEngines records the bytes each engine moves (a no-op without
// --metrics-addr). The control path calls it on its engine chooser.
func (mf *metricsFlags) wrapEngines(ch ctl.EngineChooser) ctl.EngineChooser {
	if mf.m == nil {
		return ch
	}
	return instrument.Engines(ch, mf.m)
}

// instrument wraps a controlFactory: with --metrics-addr it binds the
// address (a bad or busy address fails before mounting), builds the
// control path with recording decorators and serves /metrics until the
// returned closer is closed.
func (mf *metricsFlags) instrument(newCtl controlFactory) controlFactory {
	return func(cmd *cobra.Command, log zerolog.Logger) (fs.Control, io.Closer, error) {
		if mf.addr == "" {
			return newCtl(cmd, log)
		}
		l, err := metrics.Listen(mf.addr)
		if err != nil {
			return nil, nil, usagef("--metrics-addr %q: %v; give a free HOST:PORT such as 127.0.0.1:9477", mf.addr, errors.Unwrap(err))
		}
		mf.m = metrics.New()
		c, closer, err := newCtl(cmd, log)
		if err != nil {
			l.Close()
			return nil, nil, err
		}
		if s, ok := c.(interface{ Stats() ctl.Stats }); ok {
			mf.m.SetPool(func() metrics.PoolStats { return poolFigures(s.Stats().Pool) })
		}
		if cc, ok := closer.(controlCloser); ok && cc.indexes != nil {
			mf.m.SetIndex(func() metrics.IndexStats {
				x := cc.indexes.Stats()
				return metrics.IndexStats{Hits: x.Hits, Misses: x.Misses, Evictions: x.Evictions,
					Parses: x.Parses, ParseErrors: x.ParseErrors, BudgetBytes: x.BudgetBytes, UsedBytes: x.UsedBytes}
			})
		}
		ctx, cancel := context.WithCancel(context.Background())
		done := make(chan error, 1)
		go func() { done <- mf.m.Serve(ctx, l) }()
		log.Info().Str("addr", l.Addr().String()).Msg("metrics served at /metrics")
		return instrument.Control(c, mf.m), &metricsCloser{inner: closer, m: mf.m, stop: cancel, done: done}, nil
	}
}

// metricsCloser closes the control path, then stops the metrics server.
// Its Mounted method is the hook mountForeground calls with the running
// mount, for the passthrough figures.
type metricsCloser struct {
	inner io.Closer
	m     *metrics.Metrics
	stop  context.CancelFunc
	done  chan error
}

// Mounted makes scrapes report srv's passthrough state, and passes srv on
// to the wrapped closer when it wants it.
func (c *metricsCloser) Mounted(srv *fs.Server) {
	if h, ok := c.inner.(mountedHook); ok {
		h.Mounted(srv)
	}
	c.m.SetPassthrough(func() metrics.PassthroughStats {
		on, _ := srv.Passthrough()
		st := srv.Stats()
		return metrics.PassthroughStats{Enabled: on, Passthrough: st.Passthrough, Daemon: st.Daemon, Refused: st.Refused}
	})
}

func (c *metricsCloser) Close() error {
	var err error
	if c.inner != nil {
		err = c.inner.Close()
	}
	c.stop()
	return errors.Join(err, <-c.done)
}

// fuseObserver returns the metrics behind a control path built with
// --metrics-addr (nil otherwise), to record FUSE operations.
func fuseObserver(closer io.Closer) fs.Observer {
	if c, ok := closer.(*metricsCloser); ok {
		return c.m
	}
	return nil
}

// poolFigures converts the pool's accounting to the metrics' shape.
func poolFigures(st gpubuf.Stats) metrics.PoolStats {
	ps := metrics.PoolStats{Backend: st.Backend}
	for _, d := range st.Devices {
		dev := d.Device
		if st.Backend == "host" {
			dev = -1
		}
		ps.Devices = append(ps.Devices, metrics.DevicePool{Device: dev, BudgetBytes: d.BudgetBytes,
			AllocatedBytes: d.AllocatedBytes, LeasedBytes: d.LeasedBytes, Slabs: d.Slabs, Leases: d.Leases,
			UIDShareBytes: d.UIDShareBytes, FreedSlabs: d.FreedSlabs})
	}
	for _, u := range st.UIDs {
		ps.UIDs = append(ps.UIDs, metrics.UIDPool{UID: u.UID, Sessions: u.Sessions, LeasedBytes: u.LeasedBytes,
			AllocatedBytes: u.AllocatedBytes, Refused: u.Refused, FreedSlabs: u.FreedSlabs})
	}
	return ps
}
