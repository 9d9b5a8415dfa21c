package main

import (
	"context"
	"errors"
	"fmt"
	"os"
	"time"

	"github.com/dustin/go-humanize"
	"github.com/spf13/cobra"

	"github.com/gdsfs/gdsfs/ctl"
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
		fmt.Fprintf(out, "unpinned %d files, %s; %s\n", len(plan.Files), humanize.IBytes(uint64(freed)), tierHolds(plan.Last))
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
	fmt.Fprintf(out, "pinned %d files, %s: read %s into the tier%s in %s (%s were already in it); %s\n",
		len(plan.Files), humanize.IBytes(uint64(plan.Total)), humanize.IBytes(uint64(read)), rate, elapsed.Round(time.Millisecond),
		humanize.IBytes(uint64(plan.Cached)), tierHolds(plan.Last))
	return skippedError(plan.Skipped)
}

// tierHolds is warm's closing figure of the tier: root is told the tier's
// use; any other uid only its own pins' (PIN's used is then its own, the
// node's being root's: docs/protocol.md 3.9).
func tierHolds(r ctl.PinReply) string {
	if os.Geteuid() == 0 {
		return fmt.Sprintf("the tier holds %s of %s (yours: %s)", humanize.IBytes(r.Used), humanize.IBytes(r.Budget), humanize.IBytes(r.Yours))
	}
	return fmt.Sprintf("in the tier (yours: %s of its %s)", humanize.IBytes(r.Yours), humanize.IBytes(r.Budget))
}
