package daemon

import (
	"context"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"strings"
	"syscall"
	"time"

	"golang.org/x/sys/unix"

	"github.com/gdsfs/gdsfs/internal/errname"
	"github.com/gdsfs/gdsfs/internal/mountinfo"
	"github.com/gdsfs/gdsfs/internal/usage"
)

// ProbeCommand is the hidden gdsfs subcommand ProbeMount runs in a child:
// `gdsfs probe-mount MOUNTPOINT` statfs's MOUNTPOINT and prints "ok" or
// the errno's name.
const ProbeCommand = "probe-mount"

// ProbeTimeout is how long a daemon has to answer a probe before it
// counts as hung. A healthy daemon answers a statfs in microseconds; a
// loaded node's in milliseconds.
const ProbeTimeout = 2 * time.Second

// MountState is what a probe of a FUSE mount found.
type MountState int

// The states ProbeMount tells apart.
const (
	// Answers: the daemon answered (with the filesystem's figures or an
	// error of its own).
	Answers MountState = iota
	// Dead: the connection is gone (ENOTCONN, ECONNABORTED): the daemon
	// exited or the connection was aborted.
	Dead
	// Hung: no answer within the timeout: the daemon is stopped,
	// deadlocked, swapped out, or a zombie waiting for itself.
	Hung
	// Unknown: the probe itself could not run.
	Unknown
)

// Health is a bounded probe's view of one FUSE mount.
type Health struct {
	Mount mountinfo.Entry
	State MountState
	// PID is the daemon recorded as serving the mount (0: none
	// recorded), and Proc what that process is doing.
	PID  int
	Proc ProcState
	// Why is the probe's failure (Unknown) or the daemon's errno
	// (Answers, Dead).
	Why string
}

// ProbeMount asks mount m's daemon for a statfs (never served from the
// kernel's caches) in a child process, and waits at most timeout: a
// request to a hung daemon can leave the asking thread in uninterruptible
// sleep, and a process with such a thread cannot exit, so the probe never
// runs in this process. A probe child stuck on the mount is killed and
// left behind (it ends when the connection does). It must run in the gdsfs
// binary (it re-executes itself with ProbeCommand).
func ProbeMount(ctx context.Context, m mountinfo.Entry, timeout time.Duration) Health {
	h := Health{Mount: m}
	h.PID, h.Proc = recordedDaemon(m)
	if h.PID > 0 && (h.Proc == ProcStopped || h.Proc == ProcZombie) {
		// It cannot answer: no need to wait out the timeout. (A recorded
		// daemon that is gone says nothing for sure: connection numbers
		// are reused, by daemons that may not record.)
		h.State, h.Why = Hung, "daemon pid "+fmt.Sprint(h.PID)+" is "+h.Proc.String()
		return h
	}
	exe, err := os.Executable()
	if err != nil {
		h.State, h.Why = Unknown, fmt.Sprintf("find gdsfs executable: %v", err)
		return h
	}
	if strings.HasSuffix(exe, ".test") {
		// A test binary would run its tests, not the probe.
		h.State, h.Why = Unknown, exe+" is no gdsfs binary"
		return h
	}
	ctx, cancel := context.WithTimeout(ctx, timeout)
	defer cancel()
	cmd := exec.Command(exe, ProbeCommand, m.MountPoint)
	var out strings.Builder
	cmd.Stdout = &out
	// Its own process group, in / (not on the mount): nothing of it
	// holds the mount busy.
	cmd.Dir = "/"
	cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true}
	if err := cmd.Start(); err != nil {
		h.State, h.Why = Unknown, fmt.Sprintf("start the probe: %v", err)
		return h
	}
	done := make(chan error, 1)
	go func() { done <- cmd.Wait() }()
	select {
	case err := <-done:
		res := strings.TrimSpace(out.String())
		switch {
		case res == "ok":
			h.State = Answers
		case res == "ENOTCONN" || res == "ECONNABORTED":
			h.State, h.Why = Dead, res
		case strings.HasPrefix(res, "E"):
			h.State, h.Why = Answers, res
		default:
			h.State, h.Why = Unknown, fmt.Sprintf("probe: %v, output %q", err, res)
		}
	case <-ctx.Done():
		cmd.Process.Kill()
		h.State = Hung
	}
	return h
}

// RunProbe is the child side of ProbeMount: the statfs of mountpoint and
// its one-word result.
func RunProbe(mountpoint string) string {
	var st unix.Statfs_t
	err := unix.Statfs(mountpoint, &st)
	if err == nil {
		return "ok"
	}
	var en syscall.Errno
	if errors.As(err, &en) {
		return errname.Of(en)
	}
	return "EIO"
}

// Hint is one line for a user about a mount that is not healthy, naming
// the daemon and the fix; "" for a mount whose daemon answers.
func (h Health) Hint() string {
	mp := h.Mount.MountPoint
	force := fmt.Sprintf("gdsfs unmount --force %s aborts its connection (processes blocked on it get an error)", mp)
	switch h.State {
	case Dead:
		return fmt.Sprintf("%s is a gdsfs mount whose daemon exited; run gdsfs mount %s again (it cleans up the dead mount), or gdsfs unmount --force %s", mp, mp, mp)
	case Hung:
	default:
		return ""
	}
	switch {
	case h.PID > 0 && h.Proc == ProcStopped:
		return fmt.Sprintf("daemon pid %d of %s is stopped and does not answer; kill -CONT %d resumes it, or %s", h.PID, mp, h.PID, force)
	case h.PID > 0 && h.Proc == ProcZombie:
		return fmt.Sprintf("daemon pid %d of %s was killed but is stuck waiting for its own mount; %s, and gdsfs mount %s again cleans it up", h.PID, mp, force, mp)
	case h.PID > 0 && h.Proc == ProcGone:
		return fmt.Sprintf("%s does not answer and the daemon recorded for it (pid %d) is gone; %s", mp, h.PID, force)
	case h.PID > 0:
		return fmt.Sprintf("daemon pid %d of %s does not answer (no reply within %s); %s", h.PID, mp, ProbeTimeout, force)
	}
	return fmt.Sprintf("the daemon of %s does not answer (no reply within %s); %s", mp, ProbeTimeout, force)
}

// CheckAnswers returns a usage error naming the daemon and the fix (Hint)
// when path is on a gdsfs mount whose daemon does not answer within
// ProbeTimeout, and nil otherwise (a dead mount is for the caller's own
// error handling: mountinfo.Unreachable). Commands call it before they
// touch a mount, since a stat of a hung mount would hang them.
func CheckAnswers(ctx context.Context, path string) error {
	if ctx == nil {
		ctx = context.Background()
	}
	m, ok := mountinfo.Containing(path)
	if !ok || m.FSType != mountinfo.GDSFSType {
		return nil
	}
	if h := ProbeMount(ctx, m, ProbeTimeout); h.State == Hung {
		return usage.Errorf("%s", h.Hint())
	}
	return nil
}
