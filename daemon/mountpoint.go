package daemon

import (
	"context"
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

	"github.com/gdsfs/gdsfs/internal/fuseconn"
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
	// Through links as the mount itself would go, but never stat'ing a
	// name on a gdsfs mount first: on a hung one that hangs.
	resolved, onGDSFS, ok := resolveSafely(mp)
	if ok && onGDSFS.MountPoint != resolved {
		if h := ProbeMount(context.Background(), onGDSFS, ProbeTimeout); h.State == Hung {
			return mp, source, usage.Errorf("%s", h.Hint())
		}
	}
	mp = resolved
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

// cleanStale cleans up a FUSE mount on mp whose gdsfs daemon is gone: it
// exited (the mount answers ENOTCONN), or it was killed and is a zombie
// stuck waiting for its own answer. It aborts the connection (where it is
// still open, so that nothing stays blocked on it) and detaches the mount.
// A mount whose daemon still runs but does not answer (stopped,
// deadlocked) is not taken away: the error names it and gdsfs unmount
// --force. The probe is bounded (ProbeMount): a statfs here would hang.
func cleanStale(mp string, log zerolog.Logger) error {
	m, mounted, err := mountinfo.At(mp)
	if err != nil || !mounted || !strings.HasPrefix(m.FSType, "fuse") {
		return err
	}
	h := ProbeMount(context.Background(), m, ProbeTimeout)
	switch h.State {
	case Answers, Unknown:
		return nil // PrepareMountpoint says what is mounted there
	case Hung:
		if m.FSType != mountinfo.GDSFSType {
			return usage.Errorf("%s is a %s mount whose daemon does not answer; unmount it with umount -f %s", mp, m.FSType, mp)
		}
		if h.PID == 0 || h.Proc != ProcZombie {
			return usage.Errorf("%s", h.Hint())
		}
		if err := abortAndDetach(m); err != nil {
			return fmt.Errorf("clean up the mount of %s left by daemon pid %d (%s): %w", mp, h.PID, h.Proc, err)
		}
		log.Warn().Str("mountpoint", mp).Int("daemon_pid", h.PID).Str("daemon", h.Proc.String()).
			Msg("aborted and detached the mount of a daemon that was killed but never exited")
		return nil
	}
	if os.Geteuid() == 0 {
		// Aborting a dead connection changes nothing, but makes sure.
		err = abortAndDetach(m)
	} else {
		err = syscall.Unmount(mp, syscall.MNT_DETACH)
	}
	if err != nil {
		if out, ferr := exec.Command("fusermount3", "-uz", mp).CombinedOutput(); ferr != nil {
			return fmt.Errorf("clean up stale mount %s: %v; fusermount3: %s", mp, err, strings.TrimSpace(string(out)))
		}
	}
	log.Warn().Str("mountpoint", mp).Str("fstype", m.FSType).Msg("cleaned up a stale mount left by a daemon that died")
	return nil
}

// abortAndDetach aborts mount m's FUSE connection (fusectl, else a forced
// unmount, which aborts a FUSE connection too), so every request waiting
// on it fails at once, then detaches the mount and removes its record.
// Root only. It acts on m only: the mount is pinned first (fuseconn.Pin),
// so a mount point whose mount went away since m was read (its connection
// number reused by another mount, its path relinked or overmounted) is
// left alone, with an error.
func abortAndDetach(m mountinfo.Entry) error {
	pin, err := fuseconn.Pin(m)
	if err != nil {
		return fmt.Errorf("abort %s: %w; nothing was aborted: check the mount table (findmnt %s) and run the command again", m.MountPoint, err, m.MountPoint)
	}
	defer pin.Close()
	// While pinned, m's device number names m's connection.
	if aerr := fuseconn.Abort(m); aerr != nil && !errors.Is(aerr, os.ErrNotExist) {
		// FUSE aborts the connection on MNT_FORCE (umount_begin) before
		// the unmount, which fails with EBUSY while files are open (the
		// pin is one).
		err := syscall.Unmount(pin.Path(), syscall.MNT_FORCE)
		if err != nil && !errors.Is(err, syscall.EBUSY) {
			return fmt.Errorf("abort %s: %v; forced unmount: %w", m.MountPoint, aerr, err)
		}
	}
	if err := syscall.Unmount(pin.Path(), syscall.MNT_DETACH); err != nil && !errors.Is(err, syscall.EINVAL) {
		return fmt.Errorf("detach %s: %w", m.MountPoint, err)
	}
	removeRecordOf(RecordDir, m)
	return nil
}

// detachPinned detaches mount m lazily, and only m (fuseconn.Pin).
func detachPinned(m mountinfo.Entry) error {
	pin, err := fuseconn.Pin(m)
	if err != nil {
		return fmt.Errorf("unmount %s: %w; nothing was unmounted: check the mount table (findmnt %s) and run the command again", m.MountPoint, err, m.MountPoint)
	}
	defer pin.Close()
	if err := syscall.Unmount(pin.Path(), syscall.MNT_DETACH); err != nil {
		return fmt.Errorf("unmount %s: %w", m.MountPoint, err)
	}
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

// UnmountMode is how gdsfs unmount goes about it.
type UnmountMode int

// The ways UnmountPath unmounts.
const (
	// UnmountClean unmounts, failing while files are open ("busy").
	UnmountClean UnmountMode = iota
	// UnmountForce (--force) detaches at once: lazily when the daemon
	// answers, aborting its connection first when it does not.
	UnmountForce
	// UnmountAbort (--abort) aborts the connection whatever the daemon
	// answers, then detaches: for a daemon stuck on some requests only.
	UnmountAbort
)

// UnmountPath unmounts the gdsfs mount at path, as gdsfs unmount does: it
// fails (usage.Error) when path is no gdsfs mount, uses fusermount3 where
// a non-root user may not unmount, and (UnmountClean) returns once the
// daemon that served the mount has exited (at most 10 s), so the backing
// filesystem can be unmounted right after. UnmountForce detaches lazily
// a mount whose daemon answers (open files are served until closed), and
// aborts the connection of one whose daemon does not (hung, stopped, a
// zombie) or is gone, then detaches it: every process blocked on it gets
// an error at once. UnmountAbort always aborts. It never stats the mount.
func UnmountPath(path string, mode UnmountMode) error {
	mp, err := filepath.Abs(path)
	if err != nil {
		return usage.Errorf("mountpoint %q: %v", path, err)
	}
	m, mounted, err := mountinfo.At(mp)
	if err != nil {
		return err
	}
	if !mounted {
		st, serr := os.Lstat(mp)
		if errors.Is(serr, os.ErrNotExist) {
			return usage.Errorf("%s does not exist; nothing to unmount (check the path)", mp)
		}
		if serr == nil && st.Mode()&os.ModeSymlink != 0 {
			// Not followed: a lookup through it into a hung mount hangs.
			target, _ := os.Readlink(mp)
			if target != "" && !filepath.IsAbs(target) {
				target = filepath.Join(filepath.Dir(mp), target)
			}
			return usage.Errorf("%s is a symbolic link to %s, not a mount point; name the mount point itself: gdsfs unmount %s", mp, target, target)
		}
		return usage.Errorf("%s is not a mount point; nothing to unmount", mp)
	}
	if m.FSType != mountinfo.GDSFSType {
		return usage.Errorf("%s is a %s mount, not gdsfs; use umount(8)", mp, m.FSType)
	}
	if mode != UnmountClean {
		return forceUnmount(m, mode == UnmountAbort)
	}
	// Hold the daemon by a pidfd from before the unmount, so that the wait
	// below is for this mount's daemon even if its pid is reused.
	pidfd := daemonPidfd(m)
	if pidfd >= 0 {
		defer unix.Close(pidfd)
	}
	err = syscall.Unmount(mp, 0)
	if errors.Is(err, syscall.EPERM) && os.Geteuid() != 0 {
		out, ferr := exec.Command("fusermount3", "-u", mp).CombinedOutput()
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
	if pidfd >= 0 {
		// The daemon holds the backing directory open until it exits:
		// return once it has, so the backing filesystem can be unmounted
		// right after.
		waitExit(pidfd, daemonExitWait)
	}
	return nil
}

// forceUnmount is gdsfs unmount --force (abort: --abort) of gdsfs mount m.
func forceUnmount(m mountinfo.Entry, abort bool) error {
	mp := m.MountPoint
	owner, hasOwner := m.UserID()
	if euid := os.Geteuid(); euid != 0 {
		if !hasOwner || owner != euid {
			return usage.Errorf("%s was mounted by uid %d: only root may force it off (sudo gdsfs unmount --force %s)", mp, owner, mp)
		}
		// A user's own mount (fusermount3's): its fusectl files are the
		// user's, where fusectl is mounted.
		if abort || unanswered(m) {
			if pin, err := fuseconn.Pin(m); err == nil {
				fuseconn.Abort(m) // best effort: fusectl may not be mounted
				pin.Close()
			}
		}
		if out, err := exec.Command("fusermount3", "-uz", mp).CombinedOutput(); err != nil {
			return fmt.Errorf("unmount %s: fusermount3: %s", mp, strings.TrimSpace(string(out)))
		}
		return nil
	}
	if abort || unanswered(m) {
		return abortAndDetach(m)
	}
	return detachPinned(m)
}

// unanswered reports whether a bounded probe found mount m's daemon hung
// or gone (a probe that could not run says nothing: false).
func unanswered(m mountinfo.Entry) bool {
	st := ProbeMount(context.Background(), m, ProbeTimeout).State
	return st == Hung || st == Dead
}

// daemonExitWait bounds how long unmount waits for the daemon to exit.
const daemonExitWait = 10 * time.Second

// daemonPidfd returns a pidfd of the daemon serving mount m, or -1 when
// that cannot be known: the one recorded for it, else the one its root's
// user.gdsfs.stats names, asked only once a bounded probe showed the
// daemon answers (a getxattr of a hung mount would hang).
func daemonPidfd(m mountinfo.Entry) int {
	pid, state := recordedDaemon(m)
	if pid <= 0 || state == ProcGone {
		pid = 0
		if h := ProbeMount(context.Background(), m, ProbeTimeout); h.State == Answers {
			pid = statsPID(m.MountPoint)
		}
	}
	if pid <= 0 || pid == os.Getpid() {
		return -1 // unknown, or served by this very process (nothing to wait for)
	}
	fd, err := unix.PidfdOpen(pid, 0)
	if err != nil {
		return -1
	}
	return fd
}

// statsPID is the daemon pid the user.gdsfs.stats of mountpoint mp names
// (0: none).
func statsPID(mp string) int {
	doc, err := xattr.Get(mp, "user.gdsfs.stats")
	if err != nil {
		return 0
	}
	var st struct {
		DaemonPID int `json:"daemon_pid"`
	}
	if json.Unmarshal(doc, &st) != nil {
		return 0
	}
	return st.DaemonPID
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
