package main

import (
	"fmt"
	"io"

	"github.com/dustin/go-humanize"
	"github.com/spf13/cobra"

	"github.com/gdsfs/gdsfs/tier"
)

// tierBudgetUsage is --tier-budget's help: what it is and how to size it
// (docs/operations.md, "Sizing the memory tier").
const tierBudgetUsage = "memory for the daemon's file tier (gdsfs warm --pin): pinned host memory on a GPU machine; " +
	"0 = off. Rule of thumb: the files loaded again and again (model weights served by several processes), " +
	"at most a third of the node's RAM, since the page cache and the processes need the rest; " +
	"--uid-share caps each user's part of it"

// addTierFlag registers --tier-budget on the mount command.
func addTierFlag(cmd *cobra.Command, v *string) {
	cmd.Flags().StringVar(v, "tier-budget", "0", tierBudgetUsage)
}

// parseTierBudget parses --tier-budget ("0": no tier).
func parseTierBudget(v string) (int64, error) {
	if v == "0" || v == "" {
		return 0, nil
	}
	return parseSize("tier-budget", v)
}

// printTierStatus is gdsfs status's tier line (nothing without a tier).
func printTierStatus(w io.Writer, t *tier.Stats) {
	if t == nil {
		return
	}
	fmt.Fprintf(w, "tier:     %s cached (%s) in %s of %s %s memory, %s per uid; %d hits (%s), %d misses, %d evictions, %d invalidations, %d pins refused\n",
		humanize.IBytes(uint64(t.CachedBytes)), plural(t.Files, "file"), humanize.IBytes(uint64(t.UsedBytes)), humanize.IBytes(uint64(t.BudgetBytes)),
		t.Memory, humanize.IBytes(uint64(t.UIDShareBytes)), t.Hits, humanize.IBytes(t.HitBytes), t.Misses, t.Evictions, t.Invalidations, t.Refused)
}

func plural(n int, what string) string {
	if n == 1 {
		return "1 " + what
	}
	return fmt.Sprintf("%d %ss", n, what)
}
