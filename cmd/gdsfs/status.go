package main

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"sort"

	"github.com/dustin/go-humanize"
	"github.com/spf13/cobra"

	"github.com/gdsfs/gdsfs/ctl"
	"github.com/gdsfs/gdsfs/ctlserver"
	"github.com/gdsfs/gdsfs/daemon"
	"github.com/gdsfs/gdsfs/fs"
	"github.com/gdsfs/gdsfs/internal/mountinfo"
)

func newStatusCmd() *cobra.Command {
	var asJSON bool
	var watch watchFlags
	cmd := &cobra.Command{
		Use:   "status [--json] MOUNTPOINT",
		Short: "Show a mount's buffer pool, sessions and control-path counters",
		Long: `Ask the daemon serving MOUNTPOINT for its figures: the engine, the buffer
pool per device (budget, allocated, leased, the per-uid share of --uid-share),
what each uid holds (leased, allocated, allocations refused), open sessions,
the daemon's descriptors each uid's open files hold and their budget
(--max-open-per-user),
counters of reads, writes and refusals by errno, and the shard-index
cache (hits, misses, evictions, parses).`,
		Example: `  gdsfs status /data
  gdsfs status --watch /data                 # refresh every 2s with rates, until Ctrl-C
  gdsfs status -w --metrics 127.0.0.1:9477 /data   # plus FUSE, passthrough and per-engine figures
  gdsfs status --json /data | jq .pool.devices`,
		Args: cobra.ExactArgs(1),
		RunE: func(cmd *cobra.Command, args []string) error {
			if watch.on || watch.metrics != "" {
				return runStatusWatch(cmd.Context(), cmd.OutOrStdout(), args[0], watch)
			}
			return runStatus(cmd.Context(), cmd.OutOrStdout(), args[0], asJSON)
		},
	}
	cmd.Flags().BoolVar(&asJSON, "json", false, "print the status JSON as it is")
	addWatchFlags(cmd, &watch) // cmd/gdsfs/status_watch.go
	return cmd
}

func runStatus(ctx context.Context, w io.Writer, mp string, asJSON bool) error {
	if ctx == nil {
		ctx = context.Background()
	}
	// A hung daemon would hang the stat below: probe it, bounded, first.
	if err := daemon.CheckAnswers(ctx, mp); err != nil {
		return err
	}
	if st, err := os.Stat(filepath.Join(mp, ctl.ControlName)); err != nil || !st.Mode().IsRegular() {
		if why := mountinfo.Unreachable(mp, err); why != "" {
			return usagef("%s", why)
		}
		return usagef("%s is not a gdsfs mountpoint (no %s in it); give the directory gdsfs mount was given", mp, ctl.ControlName)
	}
	cl, err := ctl.OpenSession(mp)
	if err != nil {
		return err
	}
	defer cl.Close()
	doc, err := cl.Status(ctx)
	if err != nil {
		return err
	}
	return printStatus(w, mp, doc, cl.Hello(), asJSON)
}

// printStatus renders one STATUS document (also used by --watch).
func printStatus(w io.Writer, mp string, doc []byte, h ctl.HelloReply, asJSON bool) error {
	if asJSON {
		_, err := fmt.Fprintf(w, "%s\n", doc)
		return err
	}
	var st ctlserver.Stats
	if err := json.Unmarshal(doc, &st); err != nil {
		return fmt.Errorf("status of %s is not the expected JSON: %w", mp, err)
	}
	// This command's own session is one of the sessions counted.
	fmt.Fprintf(w, "mount:    %s (daemon pid %d, version %s)\n", mp, st.DaemonPID, st.Version)
	if st.LogFile != "" {
		fmt.Fprintf(w, "log:      %s\n", st.LogFile)
	}
	fmt.Fprintf(w, "engine:   %s (%s slabs)", st.Engine, st.Pool.Backend)
	if st.EngineWhy != "" {
		fmt.Fprintf(w, ": %s", st.EngineWhy)
	}
	fmt.Fprintln(w)
	for _, r := range st.Refusals {
		fmt.Fprintf(w, "          %d files on %s refused: %s\n", r.Files, r.Filesystem, r.Cause)
	}
	if pt := st.Passthrough; pt != nil {
		state := "off"
		if pt.Enabled {
			state = "on"
		}
		fmt.Fprintf(w, "passthrough: %s (%s)\n", state, pt.Why)
	}
	fmt.Fprintf(w, "protocol: v%d, up to %d ranges per read, largest lease %s\n", h.Version, h.MaxRanges, humanize.IBytes(h.MaxLease))
	fmt.Fprintf(w, "sessions: %d open (this one included), %d leases\n", st.Sessions, st.Leases)
	for _, d := range st.Pool.Devices {
		name := fmt.Sprintf("device %d", d.Device)
		if st.Pool.Backend == "host" {
			name = "host"
		}
		if d.UUID != "" {
			name += " (" + d.UUID + ")"
		}
		fmt.Fprintf(w, "pool %s: %s leased, %s allocated of %s budget, %d slabs (%d in use), %d leases; %s per uid, %d idle slabs freed for other uids\n",
			name, humanize.IBytes(uint64(d.LeasedBytes)), humanize.IBytes(uint64(d.AllocatedBytes)),
			humanize.IBytes(uint64(d.BudgetBytes)), d.Slabs, d.SlabsInUse, d.Leases,
			humanize.IBytes(uint64(d.UIDShareBytes)), d.FreedSlabs)
	}
	for _, u := range st.Pool.UIDs {
		fmt.Fprintf(w, "uid %d: %d sessions, %s leased, %s allocated, %d allocations refused, %d idle slabs freed for others\n",
			u.UID, u.Sessions, humanize.IBytes(uint64(u.LeasedBytes)), humanize.IBytes(uint64(u.AllocatedBytes)), u.Refused, u.FreedSlabs)
	}
	printOpenFiles(w, st.OpenFiles)
	c := st.Counters
	fmt.Fprintf(w, "reads:    %d requests, %d ranges, %s\n", c.Reads, c.ReadRanges, humanize.IBytes(c.ReadBytes))
	fmt.Fprintf(w, "writes:   %d requests, %s\n", c.Writes, humanize.IBytes(c.WriteBytes))
	if x := st.Index; x != nil {
		fmt.Fprintf(w, "index:    %d hits, %d misses, %d evictions, %d parses (%d failed), %s cached of %s\n",
			x.Hits, x.Misses, x.Evictions, x.Parses, x.ParseErrors, humanize.IBytes(uint64(x.UsedBytes)), humanize.IBytes(uint64(x.BudgetBytes)))
	}
	printTierStatus(w, st.Tier) // tierflags.go
	if c.Foreign > 0 {
		fmt.Fprintf(w, "other:    %d ioctls of other types answered ENOTTY (isatty checks), not refusals\n", c.Foreign)
	}
	if len(c.Errors) > 0 {
		names := make([]string, 0, len(c.Errors))
		for n := range c.Errors {
			names = append(names, n)
		}
		sort.Strings(names)
		fmt.Fprint(w, "refused: ")
		for _, n := range names {
			fmt.Fprintf(w, " %s=%d", n, c.Errors[n])
		}
		fmt.Fprintln(w)
	}
	return nil
}

// printOpenFiles renders the daemon's descriptors held by open files on the
// mount: the total and budget, then each uid's share (root sees every uid,
// another uid its own).
func printOpenFiles(w io.Writer, of *fs.OpenStats) {
	if of == nil {
		return
	}
	fmt.Fprintf(w, "open files: %d daemon descriptors held, %d per uid at most (--max-open-per-user), %d of the daemon's limit %d kept for itself, %d opens refused\n",
		of.Open, of.PerUID, of.Reserve, of.Limit, of.Refused)
	for _, u := range of.UIDs {
		fmt.Fprintf(w, "uid %d: %d open files (descriptors) of %d, %d opens refused\n", u.UID, u.Open, of.PerUID, u.Refused)
	}
}
