package daemon

import (
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
	"time"

	"golang.org/x/sys/unix"

	"github.com/gdsfs/gdsfs/internal/mountinfo"
	"github.com/gdsfs/gdsfs/internal/usage"
)

// UnmountPath unmounts the gdsfs mount at path, as gdsfs unmount does: it
// fails (usage.Error) when path is no gdsfs mount, uses fusermount3 where
// a non-root user may not unmount, and without force returns once the
// daemon that served the mount has exited (at most 10 s), so the backing
// filesystem can be unmounted right after. force detaches lazily.
func UnmountPath(path string, force bool) error {
	mp, err := filepath.Abs(path)
	if err != nil {
		return usage.Errorf("mountpoint %q: %v", path, err)
	}
	m, mounted, err := mountinfo.At(mp)
	if err != nil {
		return err
	}
	if !mounted {
		return usage.Errorf("%s is not a mount point; nothing to unmount", mp)
	}
	if m.FSType != mountinfo.GDSFSType {
		return usage.Errorf("%s is a %s mount, not gdsfs; use umount(8)", mp, m.FSType)
	}
	flags := 0
	if force {
		flags = syscall.MNT_DETACH
	}
	// Hold the daemon by a pidfd from before the unmount, so that the wait
	// below is for this mount's daemon even if its pid is reused.
	pidfd := daemonPidfd(mp)
	if pidfd >= 0 {
		defer unix.Close(pidfd)
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
	if !force && pidfd >= 0 {
		// The daemon holds the backing directory open until it exits:
		// return once it has, so the backing filesystem can be unmounted
		// right after (a lazy unmount may still serve open files: no wait).
		waitExit(pidfd, daemonExitWait)
	}
	return nil
}

// daemonExitWait bounds how long unmount waits for the daemon to exit.
const daemonExitWait = 10 * time.Second

// daemonPidfd returns a pidfd of the daemon serving mountpoint mp (from
// the user.gdsfs.stats of its root), or -1 when that cannot be known.
func daemonPidfd(mp string) int {
	buf := make([]byte, 64<<10)
	n, err := unix.Getxattr(mp, "user.gdsfs.stats", buf)
	if err != nil {
		return -1
	}
	var st struct {
		DaemonPID int `json:"daemon_pid"`
	}
	if json.Unmarshal(buf[:n], &st) != nil || st.DaemonPID <= 0 || st.DaemonPID == os.Getpid() {
		return -1 // unknown, or served by this very process (nothing to wait for)
	}
	fd, err := unix.PidfdOpen(st.DaemonPID, 0)
	if err != nil {
		return -1
	}
	return fd
}

// waitExit waits until the process of pidfd exits, at most d.
func waitExit(pidfd int, d time.Duration) {
	deadline := time.Now().Add(d)
	for {
		left := time.Until(deadline)
		if left <= 0 {
			return
		}
		fds := []unix.PollFd{{Fd: int32(pidfd), Events: unix.POLLIN}}
		n, err := unix.Poll(fds, int(left.Milliseconds())+1)
		if err == unix.EINTR {
			continue
		}
		if err != nil || n > 0 {
			return
		}
	}
}
