package main

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/dustin/go-humanize"
	"github.com/spf13/cobra"

	"github.com/gdsfs/gdsfs/internal/pinwarm"
)

// runWarmPin is `gdsfs warm --pin` (and --unpin): the daemon reads the
// files into its memory tier, extent by extent, skipping what it holds, so
// an interrupted run resumes where it stopped (internal/pinwarm).
func runWarmPin(ctx context.Context, cmd *cobra.Command, c *warmConfig, show bool) error {
	errOut, out := cmd.ErrOrStderr(), cmd.OutOrStdout()
	plan, err := pinwarm.NewPlan(ctx, c.paths)
	if err != nil {
		return err
	}
	if err := unusableMount(plan.Skipped); err != nil {
		return err
	}
	for _, e := range plan.Skipped {
		fmt.Fprintf(errOut, "gdsfs: warm: skipped %v\n", e)
	}
	if c.unpin {
		freed, err := plan.Unpin(ctx)
		if err != nil {
			return err
		}
		fmt.Fprintf(out, "unpinned %d files, %s; the tier holds %s of %s (yours: %s)\n", len(plan.Files),
			humanize.IBytes(uint64(freed)), humanize.IBytes(plan.Last.Used), humanize.IBytes(plan.Last.Budget), humanize.IBytes(plan.Last.Yours))
		return nil
	}
	if len(plan.Files) == 0 {
		if len(plan.Skipped) > 0 {
			return usagef("warm --pin: no file could be pinned (listed above)")
		}
		fmt.Fprintln(out, "no files to pin")
		return nil
	}
	if err := plan.CheckFits(); err != nil {
		return err
	}
	want := plan.Total - plan.Cached
	bar := newWarmBar(want, errOut, show)
	bar.Describe("pin")
	start := time.Now()
	read, first := plan.Fill(ctx, c.workers, func(n int64) { _ = bar.Add64(n) })
	interrupted := first == nil && ctx.Err() != nil
	if interrupted || first != nil {
		_ = bar.Exit()
	} else {
		_ = bar.Finish()
	}
	elapsed := time.Since(start)
	rate := rateSuffix(read, elapsed)
	if first != nil {
		fmt.Fprintf(out, "stopped: read %s of %s into the tier%s; what was pinned stays\n",
			humanize.IBytes(uint64(read)), humanize.IBytes(uint64(want)), rate)
		return first
	}
	if interrupted {
		fmt.Fprintf(out, "interrupted: read %s of %s into the tier%s in %s; run the same command again to resume (extents already in the tier are skipped)\n",
			humanize.IBytes(uint64(read)), humanize.IBytes(uint64(want)), rate, elapsed.Round(time.Millisecond))
		return errors.New("warm interrupted")
	}
	fmt.Fprintf(out, "pinned %d files, %s: read %s into the tier%s in %s (%s were already in it); the tier holds %s of %s (yours: %s)\n",
		len(plan.Files), humanize.IBytes(uint64(plan.Total)), humanize.IBytes(uint64(read)), rate, elapsed.Round(time.Millisecond),
		humanize.IBytes(uint64(plan.Cached)), humanize.IBytes(plan.Last.Used), humanize.IBytes(plan.Last.Budget), humanize.IBytes(plan.Last.Yours))
	return skippedError(plan.Skipped)
}
