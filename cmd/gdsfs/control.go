package main

import (
	"github.com/rs/zerolog"
	"github.com/spf13/cobra"

	"github.com/gdsfs/gdsfs/daemon"
)

// controlFlags are the mount command's control-path flags: the engine and
// pool flags, the index cache size, the slab socket and --metrics-addr.
type controlFlags struct {
	engine      *engineFlags
	indexCache  string
	slabSocket  string
	metricsAddr string
	tierBudget  string // tierflags.go
	gpuCache    string // tierflags.go
	readahead   string
	residency   string
}

// addControlFlags registers the control path's flags on the mount command.
func addControlFlags(cmd *cobra.Command) *controlFlags {
	cf := &controlFlags{engine: addEngineFlags(cmd.Flags())}
	cmd.Flags().StringVar(&cf.indexCache, "meta-cache", "256MiB", "memory for parsed shard indexes (tar, MDS, safetensors, torch zip, npy)")
	// The flag's first name; it sets the same value, hidden from help.
	cmd.Flags().StringVar(&cf.indexCache, "index-cache", "256MiB", "old name of --meta-cache")
	_ = cmd.Flags().MarkDeprecated("index-cache", "use --meta-cache") // cannot fail: registered above
	cmd.Flags().StringVar(&cf.slabSocket, "slab-socket", "", "where clients fetch slab memory descriptors: a path (created mode 0666; put it where clients in other containers see it) or @name in the abstract namespace (default: @gdsfs-slabs-<pid>-<random>, reachable in the daemon's network namespace)")
	cmd.Flags().StringVar(&cf.metricsAddr, "metrics-addr", "", "serve Prometheus metrics at http://HOST:PORT/metrics, e.g. 127.0.0.1:9477 (default: off)")
	cmd.Flags().StringVar(&cf.readahead, "readahead", "32MiB", "most the daemon reads ahead of a run of sequential control-path READs of small ranges (a dataset worker's batches), shared by one uid's runs at once (each at least its READ), e.g. 64MiB; 0 turns it off")
	cmd.Flags().StringVar(&cf.residency, "residency", "owners", "who may learn whether a file is in the page cache from the engine a READ or user.gdsfs.info names: owners (its owner, root and users who may write it, as the kernel's mincore and cachestat) or readers (anyone who may read it: faster warm reads of another user's files with --engine auto)")
	addTierFlags(cmd, &cf.tierBudget, &cf.gpuCache)
	return cf
}

// config validates the control path's flags and returns the daemon's
// configuration for the mount c (validated by prepareMount: mountpoint and
// source absolute; logFile absolute or empty).
func (cf *controlFlags) config(cmd *cobra.Command, c *mountConfig, log zerolog.Logger) (daemon.Config, error) {
	cfg := daemon.Config{
		Mountpoint:     c.mountpoint,
		Source:         c.source,
		ReadOnly:       c.readOnly,
		AllowOther:     c.allowOther,
		Debug:          c.debug,
		NoPassthrough:  c.noPass,
		AttrTimeout:    flagTimeout(c.attrTimeout),
		EntryTimeout:   flagTimeout(c.entryTimeout),
		MaxOpenPerUser: c.maxOpenPerUser,
		MetricsAddr:    cf.metricsAddr,
		SlabSocket:     cf.slabSocket,
		LogFile:        c.logFile,
		Log:            log,
	}
	sizeFlag, err := metaCacheFlag(cmd)
	if err != nil {
		return cfg, err
	}
	if cfg.MetaCacheBytes, err = parseSize(sizeFlag, cf.indexCache); err != nil {
		return cfg, err
	}
	if cfg.TierBytes, err = parseTierBudget(cf.tierBudget); err != nil {
		return cfg, err
	}
	if cfg.GPUCacheBytes, err = parseZeroOrSize("gpu-cache", cf.gpuCache); err != nil {
		return cfg, err
	}
	if cfg.ReadaheadBytes, err = parseZeroOrSize("readahead", cf.readahead); err != nil {
		return cfg, err
	}
	if cfg.ReadaheadBytes == 0 {
		cfg.ReadaheadBytes = -1 // --readahead 0: off
	}
	switch cf.residency {
	case "owners":
	case "readers":
		cfg.ResidencyToReaders = true
	default:
		return cfg, usagef("--residency %q: give owners or readers", cf.residency)
	}
	s, err := cf.engine.parse(log)
	if err != nil {
		return cfg, err
	}
	s.apply(&cfg)
	return cfg, nil
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
