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

// addTierFlags registers --tier-budget and --gpu-cache on the mount command.
func addTierFlags(cmd *cobra.Command, budget, gpuCache *string) {
	cmd.Flags().StringVar(budget, "tier-budget", "0", tierBudgetUsage)
	cmd.Flags().StringVar(gpuCache, "gpu-cache", "0", "memory of each GPU for copies of pinned files (needs --tier-budget): "+
		"files loaded again and again onto the same GPU are then copied device to device; 0 = off")
}

// parseTierBudget parses --tier-budget ("0": no tier).
func parseTierBudget(v string) (int64, error) { return parseZeroOrSize("tier-budget", v) }

// parseZeroOrSize parses a size flag where 0 means off.
func parseZeroOrSize(flag, v string) (int64, error) {
	if v == "0" || v == "" {
		return 0, nil
	}
	return parseSize(flag, v)
}

// printTierStatus is gdsfs status's tier line (nothing without a tier).
func printTierStatus(w io.Writer, t *tier.Stats) {
	if t == nil {
		return
	}
	if t.Scope == tier.ScopeUID {
		printOwnTierStatus(w, t)
		return
	}
	fmt.Fprintf(w, "tier:     %s cached (%s) in %s of %s %s memory, %s per uid; %d hits (%s), %d misses, %d evictions, %d invalidations, %d pins refused\n",
		humanize.IBytes(uint64(t.CachedBytes)), plural(t.Files, "file"), humanize.IBytes(uint64(t.UsedBytes)), humanize.IBytes(uint64(t.BudgetBytes)),
		t.Memory, humanize.IBytes(uint64(t.UIDShareBytes)), t.Hits, humanize.IBytes(t.HitBytes), t.Misses, t.Evictions, t.Invalidations, t.Refused)
	if t.DeviceBudgetBytes > 0 {
		fmt.Fprintf(w, "gpu cache: %s per GPU;", humanize.IBytes(uint64(t.DeviceBudgetBytes)))
		for _, d := range t.Devices {
			fmt.Fprintf(w, " device %d: %s (%s),", d.Device, humanize.IBytes(uint64(d.Bytes)), plural(d.Files, "file"))
		}
		fmt.Fprintf(w, " %d hits served device to device, %d copies made, %d evicted\n", t.DeviceHits, t.DeviceAdmits, t.DeviceEvictions)
	}
}

// printOwnTierStatus is the tier line of a uid other than root, who is
// told its own pins' figures and the tier's configuration only.
func printOwnTierStatus(w io.Writer, t *tier.Stats) {
	fmt.Fprintf(w, "tier:     yours: %s cached (%s) in %s of your %s share of the %s %s memory (the node's figures are root's)\n",
		humanize.IBytes(uint64(t.CachedBytes)), plural(t.Files, "file"), humanize.IBytes(uint64(t.UsedBytes)),
		humanize.IBytes(uint64(t.UIDShareBytes)), humanize.IBytes(uint64(t.BudgetBytes)), t.Memory)
	if t.DeviceBudgetBytes > 0 {
		fmt.Fprintf(w, "gpu cache: %s per GPU; yours:", humanize.IBytes(uint64(t.DeviceBudgetBytes)))
		if len(t.Devices) == 0 {
			fmt.Fprint(w, " none")
		}
		for i, d := range t.Devices {
			if i > 0 {
				fmt.Fprint(w, ",")
			}
			fmt.Fprintf(w, " device %d: %s (%s)", d.Device, humanize.IBytes(uint64(d.Bytes)), plural(d.Files, "file"))
		}
		fmt.Fprintln(w)
	}
}

func plural(n int, what string) string {
	if n == 1 {
		return "1 " + what
	}
	return fmt.Sprintf("%d %ss", n, what)
}
