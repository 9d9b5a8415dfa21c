package main

import (
	"context"
	"io"
	"os"

	"github.com/rs/zerolog"
	"github.com/spf13/cobra"

	"github.com/gdsfs/gdsfs/bench"
	"github.com/gdsfs/gdsfs/cufile"
	"github.com/gdsfs/gdsfs/fs"
)

// newBenchCmd is `gdsfs bench`: one subcommand per suite of package bench;
// with no suite it runs every suite with its defaults and prints one table.
// Its commands only register flags into the suites' configurations.
func newBenchCmd() *cobra.Command {
	mount, mountCmd := newBenchMountCmd()
	engines, enginesCmd := newBenchEnginesCmd()
	suites := []bench.Suite{mount, engines}
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
			return bench.RunAll(cmd.Context(), cmd.OutOrStdout(), cmd.ErrOrStderr(), suites)
		},
	}
	for i, c := range []*cobra.Command{mountCmd, enginesCmd} {
		s := suites[i]
		c.Use, c.Short, c.Args = s.Name, s.Description, cobra.NoArgs
		c.RunE = func(c *cobra.Command, _ []string) error {
			return bench.RunOne(c.Context(), c.OutOrStdout(), c.ErrOrStderr(), s)
		}
		cmd.AddCommand(c)
	}
	return cmd
}

func newBenchMountCmd() (bench.Suite, *cobra.Command) {
	c := &bench.MountConfig{}
	cmd := &cobra.Command{
		Long: `Creates a data file and many small files in a temporary backing directory,
mounts it with gdsfs (no control path) and measures, through the mount and
directly: sequential read of the data file (warm page cache, and cold after
dropping caches when running as root), random 4 KiB reads, and of sets of small
files never looked up before: stat of each, open+fstat+read+close of each (a
data loader's sample), and a listing followed by a stat of each. Prints one
table with mount/direct ratios.`,
		Example: `  gdsfs bench mount
  gdsfs bench mount --size 4GiB --dir /nvme/tmp --min-ratio 0.9`,
	}
	f := cmd.Flags()
	f.StringVar(&c.Dir, "dir", os.TempDir(), "directory for the temporary backing files (its filesystem is what is measured)")
	f.StringVar(&c.Size, "size", "1GiB", "size of the sequential-read file")
	f.IntVar(&c.Files, "files", 10000, "number of small files in each of the stat, open and list sets")
	f.IntVar(&c.RandomReads, "random-reads", 20000, "number of random 4 KiB reads")
	f.IntVar(&c.Runs, "runs", 5, "runs per measurement (the median is reported)")
	f.Float64Var(&c.MinRatio, "min-ratio", 0, "fail unless warm sequential mount/direct throughput is at least this (e.g. 0.9)")
	f.BoolVar(&c.Keep, "keep", false, "keep the temporary directory")
	f.BoolVar(&c.NoPassthrough, "no-passthrough", false, "mount with the daemon serving all I/O (to see what passthrough gains)")
	f.BoolVar(&c.NoCold, "no-cold", false, "skip the cold read (which drops the whole page cache as root)")
	f.DurationVar(&c.EntryTimeout, "entry-timeout", fs.DefaultEntryTimeout, "how long the kernel caches names, as gdsfs mount's flag (0 disables)")
	f.DurationVar(&c.AttrTimeout, "attr-timeout", fs.DefaultAttrTimeout, "how long the kernel caches file attributes, as gdsfs mount's flag (0 disables)")
	s := bench.Mount(c)
	// The flags take durations as gdsfs mount's do; fs.Options as
	// MountConfig passes them on.
	s.Run = func(ctx context.Context, out io.Writer) ([]bench.Result, error) {
		if c.EntryTimeout < 0 || c.AttrTimeout < 0 {
			return nil, usagef("--entry-timeout and --attr-timeout: give durations >= 0 such as 1s (0 disables the cache)")
		}
		cfg := *c
		cfg.EntryTimeout, cfg.AttrTimeout = flagTimeout(c.EntryTimeout), flagTimeout(c.AttrTimeout)
		return bench.Mount(&cfg).Run(ctx, out)
	}
	return s, cmd
}

func newBenchEnginesCmd() (bench.Suite, *cobra.Command) {
	c := &bench.EnginesConfig{}
	cmd := &cobra.Command{
		Long: `Reads one large file into slab memory with every engine that can run here
(gds, posix, host), warm (page cache) and cold (after dropping caches, as
root), and measures the baselines the engines must be judged against:

  pread16-pinned   16 threads of page-cache pread into pinned host memory (warm)
  h2d-pinned       pinned host to GPU copy (cuMemcpyHtoD)
  pread1+copy      1 thread: pread into pinned memory, then copy to the GPU
  odirect16        16 threads of O_DIRECT pread: the disk's parallel rate (cold)

Without a GPU the baselines read into ordinary memory. The table gives each
engine's GB/s (best of --runs warm, one run cold) and its ratio to the bound
that applies: warm, the slower of pread16 and h2d; cold, odirect16.
--min-warm-ratio / --min-cold-ratio make the command fail below a ratio.`,
		Example: `  gdsfs bench engines
  gdsfs bench engines --size 4GiB --file /nvme/bench.dat --io-workers 16
  gdsfs bench engines --engine gds --min-warm-ratio 0.8 --min-cold-ratio 0.9`,
	}
	f := cmd.Flags()
	f.StringVar(&c.File, "file", "", "file to read (created with that size if missing; default: a temporary file under $TMPDIR)")
	f.StringVar(&c.Size, "size", "1GiB", "file size")
	f.IntVar(&c.Threads, "threads", 16, "threads of the parallel baselines")
	f.IntVar(&c.Runs, "runs", 3, "warm runs per measurement (the best counts)")
	f.BoolVar(&c.NoCold, "no-cold", false, "skip the cold (dropped page cache) measurements")
	f.BoolVar(&c.Keep, "keep", false, "keep the generated file")
	f.Float64Var(&c.MinWarm, "min-warm-ratio", 0, "fail if an engine's warm ratio is below this")
	f.Float64Var(&c.MinCold, "min-cold-ratio", 0, "fail if an engine's cold ratio is below this")
	ef := addEngineFlags(f)
	c.Engine = func() (cufile.Config, error) {
		s, err := ef.parse(zerolog.Nop())
		return s.cfg, err
	}
	return bench.Engines(c), cmd
}
