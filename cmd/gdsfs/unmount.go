package main

import (
	"github.com/spf13/cobra"

	"github.com/gdsfs/gdsfs/daemon"
)

func newUnmountCmd() *cobra.Command {
	var force, abort bool
	cmd := &cobra.Command{
		Use:   "unmount [--force | --abort] MOUNTPOINT",
		Short: "Unmount a gdsfs mount (the daemon then exits 0)",
		Long: `Unmount the gdsfs filesystem at MOUNTPOINT. The daemon serving it exits
cleanly, and unmount returns once it has (at most 10 s), so the backing
filesystem can be unmounted right after. While files on the mount are open
the unmount fails with "busy".

--force detaches the mount at once. If its daemon answers, the detach is
lazy: open files are still served, and the daemon exits when the last is
closed. If the daemon does not answer within 2 s (stopped, deadlocked, or
killed but stuck as a zombie) or is gone, --force first aborts the mount's
FUSE connection (/sys/fs/fuse/connections/N/abort): every process blocked
on the mount gets an error (ECONNABORTED, then ENOTCONN) instead of hanging.
--abort aborts the connection even when the daemon answers: for a daemon
stuck on some requests only, whose blocked processes --force leaves blocked.
Only root may force off a mount it did not make itself.`,
		Example: `  gdsfs unmount /data
  gdsfs unmount --force /data    # files still open, or the daemon hangs: detach now
  gdsfs unmount --abort /data    # processes stay blocked on a daemon that answers others`,
		Args: cobra.ExactArgs(1),
		RunE: func(cmd *cobra.Command, args []string) error {
			mode := daemon.UnmountClean
			switch {
			case abort:
				mode = daemon.UnmountAbort
			case force:
				mode = daemon.UnmountForce
			}
			return daemon.UnmountPath(args[0], mode)
		},
	}
	cmd.Flags().BoolVar(&force, "force", false, "detach even while files are open; abort the connection of a daemon that does not answer")
	cmd.Flags().BoolVar(&abort, "abort", false, "abort the connection, then detach, even if the daemon answers: every request in flight and open file fails")
	return cmd
}

// newProbeMountCmd is the child daemon.ProbeMount runs: one statfs of the
// mount, in a process of its own, so that a hung daemon can hang only it.
func newProbeMountCmd() *cobra.Command {
	return &cobra.Command{
		Use:    daemon.ProbeCommand + " MOUNTPOINT",
		Short:  "Probe a mount's daemon (used by gdsfs itself)",
		Hidden: true,
		Args:   cobra.ExactArgs(1),
		RunE: func(cmd *cobra.Command, args []string) error {
			return daemon.RunProbe(cmd.OutOrStdout(), args[0])
		},
	}
}
