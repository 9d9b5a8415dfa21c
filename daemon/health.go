package daemon

import (
	"bufio"
	"context"
	"errors"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"time"

	"golang.org/x/sys/unix"

	"github.com/gdsfs/gdsfs/internal/errname"
	"github.com/gdsfs/gdsfs/internal/fuseconn"
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

func (s MountState) String() string {
	switch s {
	case Answers:
		return "answers"
	case Dead:
		return "dead"
	case Hung:
		return "hung"
	}
	return "unknown"
}

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
	cmd := exec.Command(exe, ProbeCommand, m.MountPoint)
	// Its own process group, in / (not on the mount): nothing of it
	// holds the mount busy.
	cmd.Dir = "/"
	cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true}
	stdout, err := cmd.StdoutPipe()
	if err != nil {
		h.State, h.Why = Unknown, fmt.Sprintf("start the probe: %v", err)
		return h
	}
	if err := cmd.Start(); err != nil {
		h.State, h.Why = Unknown, fmt.Sprintf("start the probe: %v", err)
		return h
	}
	lines := make(chan string, 2)
	go func() {
		sc := bufio.NewScanner(stdout)
		for sc.Scan() {
			select {
			case lines <- sc.Text():
			default: // nobody reads any more
			}
		}
		close(lines)
		// Reaped once it exits; a child stuck on the mount is left to
		// end with the connection.
		cmd.Wait()
	}()
	// The timeout runs from the child's "probing": starting a process
	// on a loaded host is no sign of a hung daemon.
	res, state := probeResult(ctx, lines, m.ID, startWait, timeout)
	if state == Hung || state == Unknown {
		cmd.Process.Kill()
	}
	h.State, h.Why = state, res
	return h
}

// startWait bounds how long a probe child may take to start.
const startWait = 30 * time.Second

// probeResult reads the probe child's lines: "probing MNTID" within
// start, then its one-word result within timeout. A child that found
// another mount than mount id want at the path (replaced, overmounted, or
// reached through a link since the mount table was read) probed nothing
// of it: Unknown.
func probeResult(ctx context.Context, lines <-chan string, want int, start, timeout time.Duration) (string, MountState) {
	wait := time.NewTimer(start)
	defer wait.Stop()
	started := false
	for {
		select {
		case l, ok := <-lines:
			switch {
			case !ok:
				return "the probe exited without a result", Unknown
			case strings.HasPrefix(l, probeStarted+" ") && !started:
				if id := strings.TrimPrefix(l, probeStarted+" "); id != strconv.Itoa(want) {
					return fmt.Sprintf("the path now leads to mount %s, not mount %d: run the command again", id, want), Unknown
				}
				started = true
				wait.Reset(timeout)
			case !started:
				return fmt.Sprintf("probe: %q before it started", l), Unknown
			case l == "ok":
				return "", Answers
			case l == "ENOTCONN" || l == "ECONNABORTED":
				return l, Dead
			case strings.HasPrefix(l, "E"):
				return l, Answers // the daemon answered, with an error of its own
			default:
				return fmt.Sprintf("probe: %q", l), Unknown
			}
		case <-wait.C:
			if !started {
				return "the probe did not start within " + start.String(), Unknown
			}
			return "no answer within " + timeout.String(), Hung
		case <-ctx.Done():
			return ctx.Err().Error(), Unknown
		}
	}
}

// probeStarted is the probe child's first line, just before its statfs.
const probeStarted = "probing"

// RunProbe is the child side of ProbeMount: it opens mountpoint's root
// without following links (O_PATH: no request to the daemon), writes
// "probing MNTID" (the mount it opened) to w, then the one-word result of
// an fstatfs of it: the mount probed is the one named, whatever the path
// leads to meanwhile.
func RunProbe(w io.Writer, mountpoint string) error {
	fd, err := unix.Openat2(unix.AT_FDCWD, mountpoint, &unix.OpenHow{
		Flags:   unix.O_PATH | unix.O_CLOEXEC,
		Resolve: unix.RESOLVE_NO_SYMLINKS,
	})
	if err != nil {
		_, werr := fmt.Fprintln(w, errnoName(err))
		return werr
	}
	defer unix.Close(fd)
	id, err := fuseconn.MountID(fd)
	if err != nil {
		return err
	}
	if _, err := fmt.Fprintln(w, probeStarted, id); err != nil {
		return err
	}
	var st unix.Statfs_t
	res := "ok"
	if err := unix.Fstatfs(fd, &st); err != nil {
		res = errnoName(err)
	}
	_, err = fmt.Fprintln(w, res)
	return err
}

// errnoName is err's errno name, EIO for an error that is none.
func errnoName(err error) string {
	var en syscall.Errno
	if errors.As(err, &en) {
		return errname.Of(en)
	}
	return "EIO"
}

// maxLinks bounds the symbolic links gdsfsMountOf follows (the kernel's
// own limit).
const maxLinks = 40

// gdsfsMountOf returns the gdsfs mount path is on, following symbolic
// links in path as a stat of it would (a dataset directory is often a
// link into the mount), but never looking a name up on a gdsfs mount: a
// lookup there would hang on a hung daemon (resolveSafely).
func gdsfsMountOf(path string) (mountinfo.Entry, bool) {
	_, m, ok := resolveSafely(path)
	return m, ok
}

// resolveSafely resolves the symbolic links in path, component by
// component, as far as the first name on a gdsfs mount: it reads the
// mount table and lstats only names outside gdsfs mounts. It returns the
// path so resolved (the rest, from the gdsfs mount on, appended as it
// is) and the gdsfs mount it reached, if any.
func resolveSafely(path string) (string, mountinfo.Entry, bool) {
	abs := path // not filepath.Abs: its lexical ".." is wrong after a link
	if !filepath.IsAbs(path) {
		wd, err := os.Getwd()
		if err != nil {
			return path, mountinfo.Entry{}, false
		}
		abs = wd + "/" + path
	}
	cur, rest := "/", strings.Split(abs, "/")
	joined := func() string { return filepath.Join(append([]string{cur}, rest...)...) }
	for links := 0; ; {
		if m, ok := mountinfo.Containing(cur); ok && m.FSType == mountinfo.GDSFSType {
			return joined(), m, true
		}
		if len(rest) == 0 {
			return cur, mountinfo.Entry{}, false
		}
		c := rest[0]
		switch c {
		case "", ".":
			rest = rest[1:]
			continue
		case "..":
			rest = rest[1:]
			cur = filepath.Dir(cur)
			continue
		}
		next := filepath.Join(cur, c)
		if m, ok := mountinfo.Containing(next); ok && m.FSType == mountinfo.GDSFSType {
			return joined(), m, true // next is a gdsfs mount point: not to be looked up
		}
		st, err := os.Lstat(next)
		if err != nil {
			return joined(), mountinfo.Entry{}, false
		}
		rest = rest[1:]
		if st.Mode()&os.ModeSymlink == 0 {
			cur = next
			continue
		}
		if links++; links > maxLinks {
			return joined(), mountinfo.Entry{}, false
		}
		target, err := os.Readlink(next)
		if err != nil {
			return joined(), mountinfo.Entry{}, false
		}
		if filepath.IsAbs(target) {
			cur = "/"
		}
		rest = append(strings.Split(target, "/"), rest...)
	}
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
	m, ok := gdsfsMountOf(path)
	if !ok {
		return nil
	}
	if h := ProbeMount(ctx, m, ProbeTimeout); h.State == Hung {
		return usage.Errorf("%s", h.Hint())
	}
	return nil
}
