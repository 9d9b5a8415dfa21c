package main

import (
	"github.com/spf13/cobra"

	"github.com/gdsfs/gdsfs/daemon"
)

func newUnmountCmd() *cobra.Command {
	var force bool
	cmd := &cobra.Command{
		Use:   "unmount [--force] MOUNTPOINT",
		Short: "Unmount a gdsfs mount (the daemon then exits 0)",
		Long: `Unmount the gdsfs filesystem at MOUNTPOINT. The daemon serving it exits
cleanly, and unmount returns once it has (at most 10 s), so the backing
filesystem can be unmounted right after. While files on the mount are open
the unmount fails with "busy";
--force detaches the mount at once (lazy unmount), and it goes away when the
last file is closed.`,
		Example: `  gdsfs unmount /data
  gdsfs unmount --force /data    # files still open: detach now`,
		Args: cobra.ExactArgs(1),
		RunE: func(cmd *cobra.Command, args []string) error {
			return daemon.UnmountPath(args[0], force)
		},
	}
	cmd.Flags().BoolVar(&force, "force", false, "lazy unmount: detach even while files are open")
	return cmd
}
