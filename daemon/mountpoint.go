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

	"github.com/rs/zerolog"
	"golang.org/x/sys/unix"

	"github.com/gdsfs/gdsfs/internal/mountinfo"
	"github.com/gdsfs/gdsfs/internal/usage"
	"github.com/gdsfs/gdsfs/internal/xattr"
)

// PrepareMountpoint checks gdsfs mount's mountpoint and --source before
// Start: both existing directories, distinct, the mountpoint not a gdsfs or
// other FUSE mount (nor any mount with --source), and FUSE usable by this
// user (allowOther: --allow-other). A stale FUSE mount whose daemon died is
// detached first. It returns both made absolute; the errors the arguments
// caused are usage.Error, their messages naming gdsfs mount's flags.
func PrepareMountpoint(mountpoint, source string, allowOther bool, log zerolog.Logger) (mp, src string, err error) {
	if mp, err = filepath.Abs(mountpoint); err != nil {
		return mountpoint, source, usage.Errorf("mountpoint %q: %v", mountpoint, err)
	}
	if err := cleanStale(mp, log); err != nil {
		return mp, source, err
	}
	if err := checkDir("mountpoint", mp); err != nil {
		return mp, source, err
	}
	if source != "" {
		if src, err = filepath.Abs(source); err != nil {
			return mp, source, usage.Errorf("--source %q: %v", source, err)
		}
		if err := checkDir("--source", src); err != nil {
			return mp, src, err
		}
		if src == mp {
			return mp, src, usage.Errorf("--source %q is the mountpoint; leave --source out to overmount it", src)
		}
	}
	m, mounted, err := mountinfo.At(mp)
	if err != nil {
		return mp, src, err
	}
	switch {
	case mounted && m.FSType == mountinfo.GDSFSType:
		return mp, src, usage.Errorf("%s is already mounted by gdsfs; unmount it first: gdsfs unmount %s", mp, mp)
	case mounted && strings.HasPrefix(m.FSType, "fuse"):
		return mp, src, usage.Errorf("%s is a %s mount; gdsfs cannot stack on another FUSE filesystem, unmount it first", mp, m.FSType)
	case mounted && src != "":
		return mp, src, usage.Errorf("%s is already a mount point (%s from %s) and --source would hide it; unmount it, or leave --source out to overmount its contents", mp, m.FSType, m.Source)
	}
	return mp, src, checkFuseAccess(allowOther)
}

func checkDir(what, p string) error {
	st, err := os.Stat(p)
	switch {
	case errors.Is(err, os.ErrNotExist):
		return usage.Errorf("%s %s does not exist; create it with mkdir -p %s", what, p, p)
	case err != nil:
		return usage.Errorf("%s %s: %v", what, p, err)
	case !st.IsDir():
		return usage.Errorf("%s %s is not a directory; name a directory", what, p)
	}
	return nil
}

// cleanStale detaches a FUSE mount on mp whose daemon died. Such a mount
// answers ENOTCONN to every request; statfs is never served from the
// kernel's caches, so it asks (a stat may still be answered from cached
// attributes).
func cleanStale(mp string, log zerolog.Logger) error {
	m, mounted, err := mountinfo.At(mp)
	if err != nil || !mounted || !strings.HasPrefix(m.FSType, "fuse") {
		return err
	}
	var st unix.Statfs_t
	if err := unix.Statfs(mp, &st); !errors.Is(err, syscall.ENOTCONN) {
		return nil
	}
	if err := syscall.Unmount(mp, syscall.MNT_DETACH); err != nil {
		if out, ferr := exec.Command("fusermount3", "-uz", mp).CombinedOutput(); ferr != nil {
			return fmt.Errorf("clean up stale mount %s: %v; fusermount3: %s", mp, err, strings.TrimSpace(string(out)))
		}
	}
	log.Warn().Str("mountpoint", mp).Str("fstype", m.FSType).Msg("cleaned up a stale mount left by a daemon that died")
	return nil
}

// checkFuseAccess reports, before trying, why mounting cannot work here.
func checkFuseAccess(allowOther bool) error {
	if _, err := os.Stat("/dev/fuse"); err != nil {
		return usage.Errorf("/dev/fuse is missing: install fuse3 (apt-get install fuse3) and load the module (modprobe fuse)")
	}
	if os.Geteuid() == 0 {
		return nil
	}
	if err := unix.Access("/dev/fuse", unix.R_OK|unix.W_OK); err != nil {
		// fusermount3 is setuid root and opens /dev/fuse itself, but only
		// where setuid works; a device closed to the user usually means
		// user mounts are not set up.
		if _, serr := exec.LookPath("fusermount3"); serr != nil {
			return usage.Errorf("/dev/fuse is not accessible to uid %d and fusermount3 is missing: run gdsfs as root, or install fuse3", os.Geteuid())
		}
	}
	if _, err := exec.LookPath("fusermount3"); err != nil {
		return usage.Errorf("mounting as a non-root user needs fusermount3: install fuse3, or run gdsfs as root")
	}
	if allowOther {
		b, _ := os.ReadFile("/etc/fuse.conf")
		if !hasConfLine(string(b), "user_allow_other") {
			return usage.Errorf("--allow-other as a non-root user needs 'user_allow_other' in /etc/fuse.conf, or run gdsfs as root")
		}
	}
	return nil
}

func hasConfLine(conf, word string) bool {
	for _, l := range strings.Split(conf, "\n") {
		if strings.TrimSpace(l) == word {
			return true
		}
	}
	return false
}

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
		if _, serr := os.Lstat(mp); errors.Is(serr, os.ErrNotExist) {
			return usage.Errorf("%s does not exist; nothing to unmount (check the path)", mp)
		}
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
	doc, err := xattr.Get(mp, "user.gdsfs.stats")
	if err != nil {
		return -1
	}
	var st struct {
		DaemonPID int `json:"daemon_pid"`
	}
	if json.Unmarshal(doc, &st) != nil || st.DaemonPID <= 0 || st.DaemonPID == os.Getpid() {
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
