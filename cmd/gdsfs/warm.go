package main

import (
	"context"
	"errors"
	"fmt"
	"io"
	"os"
	"os/signal"
	"runtime"
	"syscall"
	"time"

	"github.com/dustin/go-humanize"
	"github.com/mattn/go-isatty"
	"github.com/schollz/progressbar/v3"
	"github.com/spf13/cobra"

	"github.com/gdsfs/gdsfs/internal/mountinfo"
	"github.com/gdsfs/gdsfs/internal/pagecache"
)

// warmConfig is what `gdsfs warm` was asked to do.
type warmConfig struct {
	paths    []string
	workers  int
	progress string // auto, always, never
	pin      bool   // into the daemon's memory tier (warm_pin.go)
	unpin    bool   // out of it
}

func newWarmCmd() *cobra.Command {
	c := &warmConfig{}
	cmd := &cobra.Command{
		Use:   "warm [flags] PATH...",
		Short: "Prefetch files (or whole directory trees) into the page cache",
		Long: `Read every regular file under each PATH into the page cache, so the first
epoch of a training run reads from memory. PATH may be on a gdsfs mount or
anywhere else (on a mount, the cache filled and measured is the backing
file's).

Only pages not already cached are read (the kernel tells), so an interrupted
warm (Ctrl-C) resumes where it stopped when run again, and a second warm
of a cached dataset returns at once. The kernel tells only a file's owner
and those who may write it: files you only read are read whole each time. A progress bar shows bytes, rate and
ETA on a terminal. At the end warm checks how much stayed cached: a dataset
larger than free memory cannot all stay, and warm says so.

With --pin, the gdsfs daemon serving PATH reads the files into its memory
tier instead (pinned host memory on a GPU machine; the mount needs
--tier-budget), where they stay after warm exits, until evicted or changed:
READs of them are then served by one DMA copy from the tier. Only files you
may read can be pinned; each user may hold a share of the tier
(--uid-share). --unpin drops your files from it. As with the page cache,
what others pinned of files you only read is not told to you: warm --pin
counts your own pins only (as if you had read the files yourself).`,
		Example: `  gdsfs warm /data/imagenet/train
  gdsfs warm --workers 16 /data/shards/shard-00*.tar
  gdsfs warm --progress never /data/ckpt/step-1000 && python train.py
  gdsfs warm --pin /data/models/llama-70b/*.safetensors
  gdsfs warm --unpin /data/models/llama-70b`,
		Args: cobra.MinimumNArgs(1),
		RunE: func(cmd *cobra.Command, args []string) error {
			c.paths = args
			return runWarm(cmd, c)
		},
	}
	f := cmd.Flags()
	f.IntVar(&c.workers, "workers", min(max(runtime.NumCPU(), 4), 16), "parallel reads")
	f.StringVar(&c.progress, "progress", "auto", "progress bar: auto (on a terminal), always or never")
	f.BoolVar(&c.pin, "pin", false, "read the files into the gdsfs daemon's memory tier (mount --tier-budget) instead of the page cache")
	f.BoolVar(&c.unpin, "unpin", false, "drop the files from the gdsfs daemon's memory tier")
	return cmd
}

func runWarm(cmd *cobra.Command, c *warmConfig) error {
	if c.workers < 1 || c.workers > 256 {
		return usagef("--workers %d: give 1 to 256", c.workers)
	}
	switch c.progress {
	case "auto", "always", "never":
	default:
		return usagef("--progress %q: use auto, always or never", c.progress)
	}
	for _, p := range c.paths {
		if _, err := os.Stat(p); err != nil {
			if errors.Is(err, os.ErrNotExist) {
				return usagef("%s does not exist; name files or directories to warm", p)
			}
			if why := mountinfo.Unreachable(p, err); why != "" {
				return usagef("%s", why)
			}
			return usagef("%s: %v", p, err)
		}
	}
	parent := cmd.Context()
	if parent == nil {
		parent = context.Background()
	}
	ctx, stop := signal.NotifyContext(parent, syscall.SIGINT, syscall.SIGTERM)
	defer stop()

	errOut := cmd.ErrOrStderr()
	out := cmd.OutOrStdout()
	show := c.progress == "always"
	if c.progress == "auto" {
		if f, ok := errOut.(*os.File); ok && isatty.IsTerminal(f.Fd()) {
			show = true
		}
	}
	if c.pin || c.unpin {
		if c.pin && c.unpin {
			return usagef("--pin and --unpin: give one")
		}
		return runWarmPin(ctx, cmd, c, show)
	}
	plan, err := pagecache.NewPlan(ctx, c.paths)
	if err != nil {
		return err
	}
	if err := unusableMount(plan.Skipped); err != nil {
		return err
	}
	for _, e := range plan.Skipped {
		fmt.Fprintf(errOut, "gdsfs: warm: skipped %v\n", e)
	}
	bar := newWarmBar(plan.ToReadBytes, errOut, show)
	start := time.Now()
	read, werr := plan.Warm(ctx, c.workers, func(n int64) { _ = bar.Add64(n) })
	if ctx.Err() != nil {
		_ = bar.Exit() // leave the bar where it stopped
	} else {
		_ = bar.Finish()
	}
	elapsed := time.Since(start)

	rate := rateSuffix(read, elapsed)
	if ctx.Err() != nil {
		fmt.Fprintf(out, "interrupted: read %s of %s%s in %s; run the same command again to resume (cached pages are skipped)\n",
			humanize.IBytes(uint64(read)), humanize.IBytes(uint64(plan.ToReadBytes)), rate, elapsed.Round(time.Millisecond))
		return errors.New("warm interrupted")
	}
	if werr != nil {
		return werr
	}
	// Only what warm could measure counts: on a gdsfs mount that is the backing file's cache
	// (with passthrough the FUSE file caches nothing), and the kernel tells only a file's
	// owner and those who may write it.
	resident, measured := plan.Resident(), plan.TotalBytes-plan.UnmeasuredBytes
	fmt.Fprintln(out, warmSummary(plan, read, rate, elapsed, resident))
	if resident < measured && measured > 0 && percent(resident, measured) < 99 {
		fmt.Fprintf(out, "note: %s did not stay cached: the data is larger than the memory the kernel could spare\n",
			humanize.IBytes(uint64(measured-resident)))
	}
	return skippedError(plan.Skipped)
}

// skippedError is warm's exit status when it skipped paths it could not
// read (each already named on stderr): a job that warms a dataset before
// training must not take a partial warm for a whole one. Nil when none.
func skippedError(skipped []error) error {
	switch len(skipped) {
	case 0:
		return nil
	case 1:
		return usagef("warm: 1 path could not be read (listed above); the rest was warmed")
	}
	return usagef("warm: %d paths could not be read (listed above); the rest was warmed", len(skipped))
}

// unmeasuredWhy says why warm cannot tell what of some files is cached.
const unmeasuredWhy = "the kernel shows a file's page cache only to its owner and to those who may write it " +
	"(on a gdsfs mount: of its backing file, which must be open to you), so warm read them whole"

// warmSummary is warm's closing line: files, bytes read, and what is cached now (resident,
// plan.Resident) of what it could measure.
func warmSummary(plan *pagecache.Plan, read int64, rate string, elapsed time.Duration, resident int64) string {
	head := fmt.Sprintf("warmed %d files, %s: read %s%s in %s", len(plan.Files), humanize.IBytes(uint64(plan.TotalBytes)),
		humanize.IBytes(uint64(read)), rate, elapsed.Round(time.Millisecond))
	measured := plan.TotalBytes - plan.UnmeasuredBytes
	switch {
	case plan.UnmeasuredBytes == 0:
		return fmt.Sprintf("%s (%s were already cached); %s cached now (%.1f%%)", head,
			humanize.IBytes(uint64(plan.ResidentBytes)), humanize.IBytes(uint64(resident)), percent(resident, plan.TotalBytes))
	case measured == 0:
		return fmt.Sprintf("%s; cannot tell what is cached now: %s", head, unmeasuredWhy)
	default:
		return fmt.Sprintf("%s (%s were already cached); of the %s it could measure %s is cached now (%.1f%%); "+
			"cannot tell for %s: %s", head, humanize.IBytes(uint64(plan.ResidentBytes)), humanize.IBytes(uint64(measured)),
			humanize.IBytes(uint64(resident)), percent(resident, measured), humanize.IBytes(uint64(plan.UnmeasuredBytes)), unmeasuredWhy)
	}
}

func percent(a, b int64) float64 {
	if b == 0 {
		return 100
	}
	return 100 * float64(a) / float64(b)
}

func newWarmBar(total int64, w io.Writer, visible bool) *progressbar.ProgressBar {
	return progressbar.NewOptions64(total,
		progressbar.OptionSetDescription("warm"),
		progressbar.OptionSetWriter(w),
		progressbar.OptionSetVisibility(visible),
		progressbar.OptionShowBytes(true),
		progressbar.OptionShowTotalBytes(true),
		progressbar.OptionUseIECUnits(true),
		progressbar.OptionSetPredictTime(true),
		progressbar.OptionSetWidth(30),
		progressbar.OptionThrottle(100*time.Millisecond),
		progressbar.OptionOnCompletion(func() {
			if visible {
				fmt.Fprintln(w)
			}
		}),
	)
}

// rateSuffix is " at N/s" for a warm's progress line, or "" when nothing was read.
func rateSuffix(read int64, elapsed time.Duration) string {
	if elapsed <= 0 || read <= 0 {
		return ""
	}
	return fmt.Sprintf(" at %s/s", humanize.IBytes(uint64(float64(read)/elapsed.Seconds())))
}

// unusableMount is the usage error for a walk whose skipped entries lie on a
// gdsfs mount this user cannot use at all (its daemon exited, or it was
// mounted without --allow-other): nothing there can be warmed, so it is not
// a per-file skip (nil when no skip is of that kind).
func unusableMount(skipped []error) error {
	for _, e := range skipped {
		var pe *os.PathError
		if errors.As(e, &pe) {
			if why := mountinfo.Unreachable(pe.Path, e); why != "" {
				return usagef("%s", why)
			}
		}
	}
	return nil
}
