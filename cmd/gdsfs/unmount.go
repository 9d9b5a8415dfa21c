package main

import (
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"

	"github.com/spf13/cobra"
)

func newUnmountCmd() *cobra.Command {
	var force bool
	cmd := &cobra.Command{
		Use:   "unmount [--force] MOUNTPOINT",
		Short: "Unmount a gdsfs mount (the daemon then exits 0)",
		Long: `Unmount the gdsfs filesystem at MOUNTPOINT. The daemon serving it exits
cleanly. While files on the mount are open the unmount fails with "busy";
--force detaches the mount at once (lazy unmount), and it goes away when the
last file is closed.`,
		Example: `  gdsfs unmount /data
  gdsfs unmount --force /data    # files still open: detach now`,
		Args: cobra.ExactArgs(1),
		RunE: func(cmd *cobra.Command, args []string) error {
			return unmount(args[0], force)
		},
	}
	cmd.Flags().BoolVar(&force, "force", false, "lazy unmount: detach even while files are open")
	return cmd
}

func unmount(path string, force bool) error {
	mp, err := filepath.Abs(path)
	if err != nil {
		return usagef("mountpoint %q: %v", path, err)
	}
	m, mounted, err := mountAt(mp)
	if err != nil {
		return err
	}
	if !mounted {
		return usagef("%s is not a mount point; nothing to unmount", mp)
	}
	if m.FSType != gdsfsFSType {
		return usagef("%s is a %s mount, not gdsfs; use umount(8)", mp, m.FSType)
	}
	flags := 0
	if force {
		flags = syscall.MNT_DETACH
	}
	err = syscall.Unmount(mp, flags)
	if errors.Is(err, syscall.EPERM) && os.Geteuid() != 0 {
		args := []string{"-u", mp}
		if force {
			args = []string{"-uz", mp}
		}
		out, ferr := exec.Command("fusermount3", args...).CombinedOutput()
		if ferr != nil {
			return fmt.Errorf("unmount %s: fusermount3: %s", mp, strings.TrimSpace(string(out)))
		}
		return nil
	}
	if errors.Is(err, syscall.EBUSY) {
		return fmt.Errorf("unmount %s: busy (files on it are open); close them, or use --force to detach lazily", mp)
	}
	if err != nil {
		return fmt.Errorf("unmount %s: %w", mp, err)
	}
	return nil
}
