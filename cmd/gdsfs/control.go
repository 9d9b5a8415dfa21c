package main

import (
	"errors"
	"fmt"
	"io"
	"path/filepath"
	"strings"

	"github.com/rs/zerolog"
	"github.com/spf13/cobra"

	"github.com/gdsfs/gdsfs/cache"
	"github.com/gdsfs/gdsfs/ctl"
	"github.com/gdsfs/gdsfs/cufile"
	"github.com/gdsfs/gdsfs/fs"
	"github.com/gdsfs/gdsfs/gpubuf"
	"github.com/gdsfs/gdsfs/handoff"
)

// daemonVersion is reported by HELLO and user.gdsfs.stats.
const daemonVersion = "0.1.0"

// controlFlags are the mount command's control-path flags: the engine and
// pool flags plus the index cache size.
type controlFlags struct {
	engine     *engineFlags
	indexCache string
	slabSocket string
	// wrapEngines, if set, decorates the engine chooser (metrics).
	wrapEngines func(ctl.EngineChooser) ctl.EngineChooser
}

// addControlFlags registers the control path's flags on the mount command.
func addControlFlags(cmd *cobra.Command) *controlFlags {
	cf := &controlFlags{engine: addEngineFlags(cmd.Flags())}
	cmd.Flags().StringVar(&cf.indexCache, "meta-cache", "256MiB", "memory for parsed shard indexes (tar, MDS, safetensors, torch zip, npy)")
	// The flag's first name; it sets the same value, hidden from help.
	cmd.Flags().StringVar(&cf.indexCache, "index-cache", "256MiB", "old name of --meta-cache")
	_ = cmd.Flags().MarkDeprecated("index-cache", "use --meta-cache") // cannot fail: registered above
	cmd.Flags().StringVar(&cf.slabSocket, "slab-socket", "", "where clients fetch slab memory descriptors: a path (created mode 0666; put it where clients in other containers see it) or @name in the abstract namespace (default: @gdsfs-slabs-<pid>-<random>, reachable in the daemon's network namespace)")
	return cf
}

// newControl builds the control path (the controlFactory of the mount
// command) from the flags: engines, buffer pool, index cache and server.
// The returned closer ends every session, then frees the pool, the
// engines and the cache, in that order.
func (cf *controlFlags) newControl(cmd *cobra.Command, log zerolog.Logger) (fs.Control, io.Closer, error) {
	readOnly, err := cmd.Flags().GetBool("read-only")
	if err != nil {
		return nil, nil, fmt.Errorf("BUG: mount has no --read-only flag: %w", err)
	}
	// mount sets --log-file to the file it opened (absolute, or the
	// --background default).
	logFile, _ := cmd.Flags().GetString("log-file")
	sizeFlag, err := metaCacheFlag(cmd)
	if err != nil {
		return nil, nil, err
	}
	indexBytes, err := parseSize(sizeFlag, cf.indexCache)
	if err != nil {
		return nil, nil, err
	}
	engines, pool, err := cf.engine.open(log)
	if err != nil {
		return nil, nil, err
	}
	indexes, err := cache.NewIndexes(indexBytes, log)
	if err != nil {
		pool.Close()
		engines.Close()
		return nil, nil, err
	}
	var chooser ctl.EngineChooser = engines
	if cf.wrapEngines != nil {
		chooser = cf.wrapEngines(chooser)
	}
	backingPath, err := overmountPaths(cmd)
	if err != nil {
		indexes.Close()
		pool.Close()
		engines.Close()
		return nil, nil, err
	}
	// The slab socket hands slab memory descriptors to the sessions' own
	// processes (CUDA VMM handles, host slab files): bound before the
	// server so HELLO can name it, served once the server exists.
	slabs, err := handoff.Listen(handoff.Options{Addr: cf.slabSocket, Log: log})
	if err != nil && cf.slabSocket != "" {
		err = usagef("--slab-socket %s: %v (create its directory, or leave the flag out for an abstract socket)", cf.slabSocket, err)
	}
	if err != nil {
		indexes.Close()
		pool.Close()
		engines.Close()
		return nil, nil, err
	}
	srv, err := ctl.NewServer(ctl.Options{
		SlabSocket:  slabs.Addr(),
		BackingPath: backingPath,
		Pool:        pool,
		Engines:     chooser,
		Indexes:     indexes,
		Engine:      engines.Probe().Engine,
		ReadOnly:    readOnly,
		Version:     daemonVersion,
		LogFile:     logFile,
		EngineWhy:   engines.Probe().Why,
		Refusals: func() []ctl.EngineRefusal {
			var out []ctl.EngineRefusal
			for _, r := range engines.Refusals() {
				out = append(out, ctl.EngineRefusal(r))
			}
			return out
		},
		Log: log,
	})
	if err == nil {
		err = slabs.Serve(srv)
	}
	if err != nil {
		slabs.Close()
		indexes.Close()
		pool.Close()
		engines.Close()
		return nil, nil, err
	}
	log.Info().Str("engine", engines.Probe().Engine).Str("why", engines.Probe().Why).Bool("read_only", readOnly).
		Str("slab_socket", slabs.Addr()).Str("slab_handles", slabHandles(engines)).Msg("control path ready")
	return srv, controlCloser{slabs: slabs, srv: srv, pool: pool, engines: engines, indexes: indexes}, nil
}

// metaCacheFlag names the flag that set the index cache's size, for its
// error messages: --meta-cache, or its deprecated alias --index-cache when
// only that was given. Both at once is a usage error.
func metaCacheFlag(cmd *cobra.Command) (string, error) {
	meta, old := cmd.Flags().Changed("meta-cache"), cmd.Flags().Changed("index-cache")
	switch {
	case meta && old:
		return "", usagef("--index-cache is the old name of --meta-cache; give only --meta-cache")
	case old:
		return "index-cache", nil
	}
	return "meta-cache", nil
}

// overmountPaths returns, for an overmount (no --source), the mapping of
// the daemon's backing paths (/proc/self/fd/N/...: the mountpoint's own
// directory, opened before mounting over it) to the mountpoint's paths,
// which is what clients know; nil otherwise.
func overmountPaths(cmd *cobra.Command) (func(string) string, error) {
	src, err := cmd.Flags().GetString("source")
	if err != nil {
		return nil, fmt.Errorf("BUG: mount has no --source flag: %w", err)
	}
	args := cmd.Flags().Args()
	if src != "" || len(args) != 1 {
		return nil, nil
	}
	mp, err := filepath.Abs(args[0])
	if err != nil {
		return nil, usagef("mountpoint %q: %v", args[0], err)
	}
	return func(p string) string {
		rest, ok := strings.CutPrefix(p, "/proc/self/fd/")
		if !ok {
			return p
		}
		i := strings.IndexByte(rest, '/')
		if i < 0 {
			return mp
		}
		return filepath.Join(mp, rest[i:])
	}, nil
}

// controlCloser tears the control path down after unmount.
type controlCloser struct {
	slabs   *handoff.Server
	srv     *ctl.Server
	pool    *gpubuf.Pool
	engines *cufile.Engines
	indexes *cache.Indexes
}

func (c controlCloser) Close() error {
	var errs []error
	if err := c.slabs.Close(); err != nil {
		errs = append(errs, fmt.Errorf("close slab socket: %w", err))
	}
	if err := c.srv.Close(); err != nil {
		errs = append(errs, fmt.Errorf("close sessions: %w", err))
	}
	if err := c.pool.Close(); err != nil {
		errs = append(errs, fmt.Errorf("free buffer pool: %w", err))
	}
	if err := c.engines.Close(); err != nil {
		errs = append(errs, fmt.Errorf("close engines: %w", err))
	}
	c.indexes.Close()
	return errors.Join(errs...)
}

// slabHandles says how clients map GPU slabs, for the log: "vmm" (CUDA
// virtual memory, POSIX fd handles from the slab socket), "legacy-ipc"
// (64-byte CUDA IPC handles: bearer capabilities, old drivers only) or
// "host" (no GPU slabs).
func slabHandles(e *cufile.Engines) string { return e.SlabHandles() }
