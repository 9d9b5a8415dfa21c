package integration

import (
	"bufio"
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	gofs "github.com/hanwen/go-fuse/v2/fs"
	"github.com/hanwen/go-fuse/v2/fuse"

	"github.com/gdsfs/gdsfs/daemon"
	"github.com/gdsfs/gdsfs/internal/fuseconn"
	"github.com/gdsfs/gdsfs/internal/mountinfo"
)

// hungWait bounds every wait in these tests: a hang fails in seconds.
const hungWait = 20 * time.Second

// runBounded runs gdsfs with args, as uid (0: this process's), killed after
// hungWait: a CLI that hangs on a hung mount fails the test instead of
// hanging it. It returns the combined output, the exit code (-1: killed)
// and how long it ran.
func runBounded(t *testing.T, uid uint32, args ...string) (string, int, time.Duration) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), hungWait)
	defer cancel()
	cmd := exec.CommandContext(ctx, gdsfsBin(t), args...)
	cmd.Dir = "/"
	if uid != 0 {
		cmd.SysProcAttr = &syscall.SysProcAttr{Credential: &syscall.Credential{Uid: uid, Gid: uid}}
	}
	// Do not wait for descriptors a stuck grandchild may hold.
	cmd.WaitDelay = time.Second
	var out lockedBuffer
	cmd.Stdout, cmd.Stderr = &out, &out
	start := time.Now()
	err := cmd.Run()
	took := time.Since(start)
	if ctx.Err() != nil {
		return out.String(), -1, took
	}
	var ee *exec.ExitError
	switch {
	case err == nil:
		return out.String(), 0, took
	case errors.As(err, &ee):
		return out.String(), ee.ExitCode(), took
	}
	t.Fatalf("run gdsfs %v: %v", args, err)
	return "", -1, took
}

// mountEntry is the mount table's entry of mnt (a gdsfs mount).
func mountEntry(t *testing.T, mnt string) mountinfo.Entry {
	t.Helper()
	m, ok, err := mountinfo.At(mnt)
	if err != nil || !ok {
		t.Fatalf("%s is not in the mount table: %v", mnt, err)
	}
	return m
}

// abortOnCleanup makes sure the test leaves nothing mounted and nothing
// blocked on m, whatever its daemon does: the connection is aborted and the
// mount detached, if it is still there, when the test ends. It acts on
// this test's connection and mount only: the abort file is opened now,
// while m is mounted (the kernel binds it to m's connection, whose number
// another mount on this machine takes once m's is gone), and the detach
// goes through a pin of m (fuseconn.Pin), never through m's path alone.
func abortOnCleanup(t *testing.T, m mountinfo.Entry) {
	t.Helper()
	h, err := fuseconn.Open(m)
	if err != nil {
		t.Fatalf("open the abort file of %s: %v", m.MountPoint, err)
	}
	t.Cleanup(func() {
		defer h.Close()
		if err := h.Abort(); err != nil {
			t.Errorf("cleanup: abort %s: %v", m.MountPoint, err)
		}
		if pin, err := fuseconn.Pin(m); err == nil {
			if err := syscall.Unmount(pin.Path(), syscall.MNT_DETACH); err != nil {
				t.Errorf("cleanup: detach %s: %v", m.MountPoint, err)
			}
			pin.Close()
		}
	})
}

// connWatch reads whether mount m's FUSE connection still exists, through
// its fusectl "waiting" file opened while m is mounted: once the
// connection is gone the file reads empty, even if another mount has
// taken its number (a stat of the directory would see that one).
func connWatch(t *testing.T, m mountinfo.Entry) (gone func() bool) {
	t.Helper()
	f, err := os.Open(filepath.Join(fuseconn.Dir(m.ConnID()), "waiting"))
	if err != nil {
		t.Fatalf("open the fusectl waiting file of %s: %v", m.MountPoint, err)
	}
	t.Cleanup(func() { f.Close() })
	return func() bool {
		var b [32]byte
		n, _ := f.ReadAt(b[:], 0)
		return n == 0
	}
}

// waitRecorded waits until the daemon pid has recorded that it serves m
// (daemon.RecordDir): the last step of its start, after the mount shows.
func waitRecorded(t *testing.T, m mountinfo.Entry, pid int) {
	t.Helper()
	p := daemon.RecordPath(m)
	want := fmt.Sprintf(`"pid":%d,`, pid)
	deadline := time.Now().Add(hungWait)
	for {
		if b, err := os.ReadFile(p); err == nil && strings.Contains(string(b), want) {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("daemon pid %d did not record its mount in %s within %s", pid, p, hungWait)
		}
		time.Sleep(5 * time.Millisecond) // polling the record: no event to wait on
	}
}

// stopProcess SIGSTOPs pid (a process this test started), and resumes it
// when the test ends (before its own cleanup kills it: cleanups run last
// registered first).
func stopProcess(t *testing.T, pid int) {
	t.Helper()
	if err := syscall.Kill(pid, syscall.SIGSTOP); err != nil {
		t.Fatal(err)
	}
	waitProcState(t, pid, "T")
	t.Cleanup(func() { syscall.Kill(pid, syscall.SIGCONT) })
}

// procField is /proc/PID/stat's state letter ("" once gone).
func procField(pid int) string {
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", pid))
	if err != nil {
		return ""
	}
	if f := strings.Fields(string(b[bytes.LastIndexByte(b, ')')+1:])); len(f) > 0 {
		return f[0]
	}
	return ""
}

// waitProcState waits until process pid is in one of the given states.
func waitProcState(t *testing.T, pid int, states ...string) {
	t.Helper()
	deadline := time.Now().Add(hungWait)
	for {
		s := procField(pid)
		for _, w := range states {
			if s == w {
				return
			}
		}
		if time.Now().After(deadline) {
			t.Fatalf("pid %d in state %q after %s, want %v", pid, s, hungWait, states)
		}
		time.Sleep(5 * time.Millisecond) // polling /proc: no event to wait on
	}
}

// blockedProc is a process (of another uid) blocked on a hung mount.
type blockedProc struct {
	cmd  *exec.Cmd
	out  *lockedBuffer
	done chan struct{} // closed once it exited
}

// blockOn starts argv as uid and waits until it is blocked in a FUSE
// request (its wchan is the FUSE client's wait for an answer). It is
// killed when the test ends.
func blockOn(t *testing.T, uid uint32, argv ...string) *blockedProc {
	t.Helper()
	p := &blockedProc{cmd: exec.Command(argv[0], argv[1:]...), out: &lockedBuffer{}, done: make(chan struct{})}
	p.cmd.Dir = "/"
	p.cmd.SysProcAttr = &syscall.SysProcAttr{Credential: &syscall.Credential{Uid: uid, Gid: uid}}
	p.cmd.Stdout, p.cmd.Stderr = p.out, p.out
	if err := p.cmd.Start(); err != nil {
		t.Fatal(err)
	}
	go func() { p.cmd.Wait(); close(p.done) }()
	t.Cleanup(func() {
		p.cmd.Process.Kill()
		select {
		case <-p.done:
		case <-time.After(hungWait):
			t.Errorf("%v (pid %d) did not exit after SIGKILL: still blocked on the mount", argv, p.cmd.Process.Pid)
		}
	})
	deadline := time.Now().Add(hungWait)
	for {
		w, _ := os.ReadFile(fmt.Sprintf("/proc/%d/wchan", p.cmd.Process.Pid))
		if strings.Contains(string(w), "request_wait_answer") {
			return p
		}
		select {
		case <-p.done:
			t.Fatalf("%v exited instead of blocking on the mount: %s", argv, p.out.String())
		default:
		}
		if time.Now().After(deadline) {
			t.Fatalf("%v not blocked in a FUSE request after %s (wchan %q)", argv, hungWait, w)
		}
		time.Sleep(5 * time.Millisecond) // polling /proc: no event to wait on
	}
}

// blocked reports whether the process still waits.
func (p *blockedProc) blocked() bool {
	select {
	case <-p.done:
		return false
	default:
		return true
	}
}

// waitFailed waits until the process exits and checks it failed with a
// dead connection's error.
func (p *blockedProc) waitFailed(t *testing.T, since time.Time) time.Duration {
	t.Helper()
	select {
	case <-p.done:
	case <-time.After(hungWait):
		t.Fatalf("%v still blocked %s after the connection was aborted", p.cmd.Args, hungWait)
	}
	took := time.Since(since)
	out := p.out.String()
	if p.cmd.ProcessState.ExitCode() == 0 {
		t.Errorf("%v succeeded on an aborted mount: %s", p.cmd.Args, out)
	}
	if !strings.Contains(out, "connection abort") && !strings.Contains(out, "not connected") && !strings.Contains(out, "Input/output error") {
		t.Errorf("%v: %q, want ECONNABORTED, ENOTCONN or EIO", p.cmd.Args, out)
	}
	return took
}

// oneLine checks out is one line holding every one of wants.
func oneLine(t *testing.T, what, out string, wants ...string) {
	t.Helper()
	if strings.Count(strings.TrimSpace(out), "\n") != 0 {
		t.Errorf("%s: %q is not one line", what, out)
	}
	for _, w := range wants {
		if !strings.Contains(out, w) {
			t.Errorf("%s: %q does not say %q", what, out, w)
		}
	}
}

// TestHungDaemonForceUnmount: a daemon that stops answering (SIGSTOP)
// leaves a uid 10001 process blocked in a stat of its mount. status,
// doctor and a new mount of the path say so in one line naming the
// daemon's pid and gdsfs unmount --force, within seconds; a plain unmount
// is "busy"; uid 10001's --force is refused and changes nothing; root's
// --force returns within seconds, the mount is gone and the blocked
// process gets an error instead of hanging.
func TestHungDaemonForceUnmount(t *testing.T) {
	requireRoot(t)
	dir := t.TempDir()
	backing, mnt := mountDirs(t, dir)
	openToOtherUIDs(t, dir)
	writeFile(t, filepath.Join(backing, "f"), []byte("data"))
	d := startBinDaemon(t, backing, mnt, "--allow-other", "--engine", "host", "--host-pool", "16MiB", "--slab-size", "4MiB")
	m := mountEntry(t, mnt)
	abortOnCleanup(t, m)
	waitRecorded(t, m, d.pid())
	stopProcess(t, d.pid())
	reader := blockOn(t, 10001, "stat", filepath.Join(mnt, "never-looked-up"))
	pid := fmt.Sprintf("daemon pid %d", d.pid())
	fix := "gdsfs unmount --force " + mnt

	out, code, took := runBounded(t, 0, "status", mnt)
	if code != 2 {
		t.Errorf("status of a hung mount: exit %d after %s, want 2: %q", code, took, out)
	}
	oneLine(t, "status", out, pid, "stopped", fix)
	out, code, _ = runBounded(t, 0, "doctor", mnt)
	if code != 2 {
		t.Errorf("doctor of a hung mount: exit %d, want 2: %q", code, out)
	}
	oneLine(t, "doctor", out, pid, fix)
	// A dataset directory is often a link into the mount: status and
	// doctor follow it as a stat would, so its hung daemon is named, not
	// hung on; unmount names the link's target.
	link := filepath.Join(dir, "link")
	if err := os.Symlink(mnt, link); err != nil {
		t.Fatal(err)
	}
	for _, p := range []string{link, filepath.Join(link, "sub", "..", "f")} {
		out, code, took = runBounded(t, 0, "status", p)
		if code != 2 {
			t.Errorf("status %s, a link into a hung mount: exit %d after %s, want 2: %q", p, code, took, out)
		}
		oneLine(t, "status through a link", out, pid, fix)
	}
	out, code, _ = runBounded(t, 0, "doctor", link)
	if code != 2 {
		t.Errorf("doctor through a link to a hung mount: exit %d, want 2: %q", code, out)
	}
	oneLine(t, "doctor through a link", out, pid, fix)
	out, code, _ = runBounded(t, 0, "unmount", "--force", link)
	if code != 2 {
		t.Errorf("unmount --force of a link to a mount: exit %d, want 2: %q", code, out)
	}
	oneLine(t, "unmount --force of a link", out, "symbolic link", "gdsfs unmount "+mnt)
	// gdsfs mount of the link goes where the link leads, as mount(2)
	// would: onto the hung mount, which it names instead of hanging in a
	// stat of it. (Should it hang, the daemon resumes after hungWait.)
	resume := time.AfterFunc(hungWait, func() { syscall.Kill(d.pid(), syscall.SIGCONT) })
	out, code, took = runBounded(t, 0, "mount", "--source", backing, link)
	if !resume.Stop() {
		t.Errorf("mount of a link to a hung mount hung: resumed the daemon after %s", hungWait)
	}
	if code != 2 {
		t.Errorf("mount of a link to a hung mount: exit %d after %s, want 2: %q", code, took, out)
	}
	oneLine(t, "mount of a link", out, pid, fix)
	// A new daemon does not take a live (if stopped) daemon's mount away.
	out, code, _ = runBounded(t, 0, "mount", "--source", backing, mnt)
	if code != 2 {
		t.Errorf("mount over a hung mount: exit %d, want 2: %q", code, out)
	}
	oneLine(t, "mount", out, pid, fix)
	if got := mountEntry(t, mnt); got.ConnID() != m.ConnID() {
		t.Fatalf("mount over a hung mount mounted connection %d over %d", got.ConnID(), m.ConnID())
	}

	out, code, _ = runBounded(t, 10001, "unmount", "--force", mnt)
	if code != 2 {
		t.Errorf("uid 10001's unmount --force of root's mount: exit %d, want 2: %q", code, out)
	}
	oneLine(t, "uid 10001's unmount --force", out, "only root")
	out, code, _ = runBounded(t, 0, "unmount", mnt)
	if code != 1 {
		t.Errorf("unmount without --force of a mount a process is blocked on: exit %d, want 1: %q", code, out)
	}
	oneLine(t, "unmount without --force", out, "busy")
	if mountType(t, mnt) != "fuse.gdsfs" || !reader.blocked() {
		t.Fatalf("after the refused unmounts: %s is %q, reader blocked %v", mnt, mountType(t, mnt), reader.blocked())
	}

	start := time.Now()
	out, code, took = runBounded(t, 0, "unmount", "--force", mnt)
	if code != 0 {
		t.Fatalf("unmount --force of a hung mount: exit %d after %s: %q", code, took, out)
	}
	if typ := mountType(t, mnt); typ != "" {
		t.Errorf("after unmount --force %s is still a %s mount", mnt, typ)
	}
	readerTook := reader.waitFailed(t, start)
	t.Logf("hung daemon: unmount --force returned after %s; the blocked reader failed %s after it started: %s",
		took.Round(time.Millisecond), readerTook.Round(time.Millisecond), strings.TrimSpace(reader.out.String()))
	// The daemon, resumed, finds its connection gone and exits.
	syscall.Kill(d.pid(), syscall.SIGCONT)
	select {
	case <-d.exited:
	case <-time.After(hungWait):
		t.Errorf("the daemon did not exit %s after its connection was aborted and it was resumed", hungWait)
	}
}

// TestMountOverZombieDaemon: a daemon killed while one of its threads
// waits for its own mount's answer (go-fuse's WaitMount does such a
// request) cannot exit: a zombie that keeps the connection open. Here a
// gdsfs-type mount whose server blocks on a lookup its own process makes,
// then SIGKILLed, is that zombie, deterministically. gdsfs status names
// it; gdsfs mount of the path aborts and detaches it and mounts, and the
// zombie then exits.
func TestMountOverZombieDaemon(t *testing.T) {
	requireRoot(t)
	dir := t.TempDir()
	backing, mnt := mountDirs(t, dir)
	writeFile(t, filepath.Join(backing, "f"), []byte("data"))
	z := startZombie(t, backing, mnt)
	m := mountEntry(t, mnt)
	abortOnCleanup(t, m)
	if err := z.cmd.Process.Signal(syscall.SIGKILL); err != nil {
		t.Fatal(err)
	}
	// Dying, it stays: the leader a zombie, or the stuck thread itself.
	waitKilled(t, z.cmd.Process.Pid)
	select {
	case <-z.done:
		t.Fatal("the killed server exited: it was no zombie")
	default:
	}

	out, code, _ := runBounded(t, 0, "status", mnt)
	if code != 2 {
		t.Errorf("status of a zombie's mount: exit %d, want 2: %q", code, out)
	}
	t.Logf("killed server: state %s; status: %s", procField(z.cmd.Process.Pid), strings.TrimSpace(out))
	oneLine(t, "status", out, fmt.Sprintf("daemon pid %d", z.cmd.Process.Pid), "gdsfs unmount --force "+mnt)

	start := time.Now()
	d := startBinDaemon(t, backing, mnt, "--engine", "host", "--host-pool", "16MiB", "--slab-size", "4MiB")
	t.Logf("mount over the zombie's mount: mounted after %s", time.Since(start).Round(time.Millisecond))
	if got, err := os.ReadFile(filepath.Join(mnt, "f")); string(got) != "data" || err != nil {
		t.Errorf("read through the new mount: %q, %v", got, err)
	}
	select {
	case <-z.done:
	case <-time.After(hungWait):
		t.Errorf("the zombie server did not exit %s after its connection was aborted", hungWait)
	}
	log, _ := os.ReadFile(d.logPath)
	if !bytes.Contains(log, []byte("aborted and detached")) {
		t.Errorf("the new daemon's log does not say it cleaned up the zombie's mount:\n%s", tail(log, 4096))
	}
}

// waitKilled waits until process pid is dying: a zombie leader, or a
// SIGKILL pending on it (its stuck thread never returns to take it).
func waitKilled(t *testing.T, pid int) {
	t.Helper()
	deadline := time.Now().Add(hungWait)
	for {
		if procField(pid) == "Z" {
			return
		}
		if b, err := os.ReadFile(fmt.Sprintf("/proc/%d/status", pid)); err == nil && killPendingIn(string(b)) {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("pid %d not dying %s after SIGKILL (state %q)", pid, hungWait, procField(pid))
		}
		time.Sleep(5 * time.Millisecond) // polling /proc: no event to wait on
	}
}

// killPendingIn reports whether /proc/PID/status text st has SIGKILL
// pending (SigPnd or ShdPnd).
func killPendingIn(st string) bool {
	for _, l := range strings.Split(st, "\n") {
		k, v, _ := strings.Cut(l, ":")
		if k == "SigPnd" || k == "ShdPnd" {
			if mask, err := strconv.ParseUint(strings.TrimSpace(v), 16, 64); err == nil && mask&(1<<(9-1)) != 0 {
				return true
			}
		}
	}
	return false
}

// zombieServer is the HUNG family's "zombie" child: a FUSE server mounted
// as gdsfs that has one of its own threads stuck on its own mount.
type zombieServer struct {
	cmd  *exec.Cmd
	done chan struct{}
}

// startZombie starts the child and waits until its own lookup of its own
// mount is in its handler (the request read from the kernel, unanswered).
func startZombie(t *testing.T, backing, mnt string) *zombieServer {
	t.Helper()
	return startHungServer(t, "zombie", "blocked", backing, mnt)
}

// startHungServer starts the HUNG family's child in mode and waits for its
// line want.
func startHungServer(t *testing.T, mode, want, backing, mnt string) *zombieServer {
	t.Helper()
	c := child{family: "HUNG", mode: mode, env: map[string]string{"MNT": mnt, "SRC": backing}}
	z := &zombieServer{cmd: c.cmd(t), done: make(chan struct{})}
	stdout, err := z.cmd.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	var stderr lockedBuffer
	z.cmd.Stderr = &stderr
	if err := z.cmd.Start(); err != nil {
		t.Fatal(err)
	}
	lines := make(chan string, 4)
	go func() {
		sc := bufio.NewScanner(stdout)
		for sc.Scan() {
			lines <- sc.Text()
		}
		close(lines)
		io.Copy(io.Discard, stdout)
	}()
	var once sync.Once
	wait := func() { once.Do(func() { z.cmd.Wait(); close(z.done) }) }
	t.Cleanup(func() {
		z.cmd.Process.Kill()
		go wait()
		select {
		case <-z.done:
		case <-time.After(hungWait):
			t.Errorf("the zombie server (pid %d) never exited", z.cmd.Process.Pid)
		}
	})
	select {
	case l, ok := <-lines:
		if !ok || l != want {
			t.Fatalf("%s server: %q, want %q; stderr: %s", mode, l, want, stderr.String())
		}
	case <-time.After(hungWait):
		t.Fatalf("%s server did not say %q after %s; stderr: %s", mode, want, hungWait, stderr.String())
	}
	go wait()
	return z
}

// TestHungChild is the entry point of the HUNG family's children.
func TestHungChild(t *testing.T) {
	mode, env := childMode(t, "HUNG")
	switch mode {
	case "zombie":
		childExit(childZombie(env("MNT"), env("SRC"), true))
	case "stuck":
		childExit(childZombie(env("MNT"), env("SRC"), false))
	}
	childExit(fmt.Errorf("unknown mode %q", mode))
}

// selfBlockNode is the zombie server's root: a lookup of "selfblock"
// never returns.
type selfBlockNode struct {
	gofs.Inode
	entered chan struct{}
}

var _ gofs.NodeLookuper = (*selfBlockNode)(nil)

func (n *selfBlockNode) Lookup(ctx context.Context, name string, out *fuse.EntryOut) (*gofs.Inode, syscall.Errno) {
	if name != "selfblock" {
		return nil, syscall.ENOENT
	}
	select {
	case n.entered <- struct{}{}:
	default:
	}
	select {} // the daemon's bug: it never answers
}

// childZombie mounts at mnt as a gdsfs daemon would (type fuse.gdsfs,
// recorded in daemon.RecordDir, --allow-other) with a handler that never
// answers a lookup of "selfblock". With self, it looks that name up
// itself and says "blocked" once its handler has the request (the test
// then SIGKILLs it: a zombie); without, it says "mounted" and serves
// everything else (a daemon stuck on some requests only).
func childZombie(mnt, src string, self bool) error {
	root := &selfBlockNode{entered: make(chan struct{}, 1)}
	srv, err := gofs.Mount(mnt, root, &gofs.Options{MountOptions: fuse.MountOptions{
		Name: "gdsfs", FsName: src, DirectMount: true, AllowOther: true,
	}})
	if err != nil {
		return err
	}
	if _, err := daemon.WriteMountRecord(mnt); err != nil {
		srv.Unmount()
		return err
	}
	if !self {
		fmt.Println("mounted")
		srv.Wait()
		return nil
	}
	go os.Stat(filepath.Join(mnt, "selfblock"))
	<-root.entered
	fmt.Println("blocked")
	select {}
}

// TestAbortPartlyStuckDaemon: a daemon that answers everything but one
// request (its handler deadlocked) passes the probe, so --force would only
// detach it, leaving the uid 10001 process stuck in that request; gdsfs
// unmount --abort aborts the connection whatever the daemon answers: the
// process gets an error and the mount is gone. uid 10001 may not.
func TestAbortPartlyStuckDaemon(t *testing.T) {
	requireRoot(t)
	dir := t.TempDir()
	backing, mnt := mountDirs(t, dir)
	openToOtherUIDs(t, dir)
	startHungServer(t, "stuck", "mounted", backing, mnt)
	m := mountEntry(t, mnt)
	abortOnCleanup(t, m)
	stuck := blockOn(t, 10001, "stat", filepath.Join(mnt, "selfblock"))
	if _, err := os.Stat(filepath.Join(mnt, "other")); !errors.Is(err, os.ErrNotExist) {
		t.Fatalf("the stuck server no longer answers other lookups: %v", err)
	}
	out, code, _ := runBounded(t, 10001, "unmount", "--abort", mnt)
	if code != 2 || !stuck.blocked() || mountType(t, mnt) != "fuse.gdsfs" {
		t.Fatalf("uid 10001's --abort of root's mount: exit %d %q; want 2, nothing changed", code, out)
	}
	oneLine(t, "uid 10001's --abort", out, "only root")
	start := time.Now()
	out, code, took := runBounded(t, 0, "unmount", "--abort", mnt)
	if code != 0 {
		t.Fatalf("unmount --abort: exit %d after %s: %q", code, took, out)
	}
	if typ := mountType(t, mnt); typ != "" {
		t.Errorf("after unmount --abort %s is still a %s mount", mnt, typ)
	}
	stuckTook := stuck.waitFailed(t, start)
	t.Logf("partly stuck daemon: unmount --abort returned after %s; the stuck stat failed after %s",
		took.Round(time.Millisecond), stuckTook.Round(time.Millisecond))
}

// TestSignalTwiceAbortsStuckRequest: SIGTERM of a daemon while a request
// is stuck in it (a flock waiting for a lock this test holds) detaches
// the mount at once and, as with any open file, serves on; a second
// SIGTERM aborts the connection: the stuck request fails, the daemon exits
// 0 and nothing stays mounted.
func TestSignalTwiceAbortsStuckRequest(t *testing.T) {
	requireRoot(t)
	dir := t.TempDir()
	backing, mnt := mountDirs(t, dir)
	writeFile(t, filepath.Join(backing, "f"), []byte("data"))
	cmd := startForeground(t, "--source", backing, mnt)
	m := mountEntry(t, mnt)
	cleanupMount(t, mnt)
	abortOnCleanup(t, m)
	connGone := connWatch(t, m)
	holder, err := os.Open(filepath.Join(mnt, "f"))
	if err != nil {
		t.Fatal(err)
	}
	defer holder.Close()
	if err := syscall.Flock(int(holder.Fd()), syscall.LOCK_EX); err != nil {
		t.Fatal(err)
	}
	waiter := blockOn(t, 0, "flock", filepath.Join(mnt, "f"), "true")

	if err := cmd.Process.Signal(syscall.SIGTERM); err != nil {
		t.Fatal(err)
	}
	waitMounted(t, mnt, false)
	if !waiter.blocked() || cmd.ProcessState != nil {
		t.Fatalf("after one SIGTERM: waiter blocked %v, daemon exited %v", waiter.blocked(), cmd.ProcessState != nil)
	}
	start := time.Now()
	if err := cmd.Process.Signal(syscall.SIGTERM); err != nil {
		t.Fatal(err)
	}
	took := waiter.waitFailed(t, start)
	if code := waitExit(t, cmd); code != 0 {
		t.Errorf("daemon exit code %d after the second SIGTERM, want 0", code)
	}
	// The connection ends with the last file open on the detached mount
	// (one opened with passthrough even reads on: the kernel serves it).
	holder.Close()
	deadline := time.Now().Add(hungWait)
	for {
		if connGone() {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("connection %d still open %s after the daemon exited and the last file closed", m.ConnID(), hungWait)
		}
		time.Sleep(5 * time.Millisecond) // polling fusectl: no event to wait on
	}
	t.Logf("second SIGTERM: the stuck flock failed after %s: %s", took.Round(time.Millisecond), strings.TrimSpace(waiter.out.String()))
}

// TestUserForceUnmountOwnHungMount: a user's own mount (fusermount3's,
// user_id= that user) whose daemon hangs: the user's gdsfs unmount --force
// aborts the connection (fusectl's files are the mount owner's) and
// detaches it, and the user's process blocked on it gets an error.
func TestUserForceUnmountOwnHungMount(t *testing.T) {
	requireRoot(t)
	const uid = 10001
	if typ := mountType(t, fuseconn.ControlDir); typ != "fusectl" {
		if out, err := exec.Command("mount", "-t", "fusectl", "none", fuseconn.ControlDir).CombinedOutput(); err != nil {
			t.Skipf("cannot mount fusectl: %v: %s", err, out)
		}
	}
	dir := t.TempDir()
	backing, mnt := mountDirs(t, dir)
	openToOtherUIDs(t, dir)
	for _, d := range []string{backing, mnt} {
		if err := os.Chown(d, uid, uid); err != nil {
			t.Fatal(err)
		}
	}
	cleanupMount(t, mnt)
	out, code, _ := runBounded(t, uid, "mount", "--background", "--log-file", filepath.Join(backing, "log"),
		"--engine", "host", "--host-pool", "16MiB", "--slab-size", "4MiB", "--source", backing, mnt)
	if code != 0 {
		t.Skipf("no user mounts here: exit %d: %s", code, out)
	}
	var pid int
	if i := strings.Index(out, "daemon pid "); i < 0 {
		t.Fatalf("mount --background does not name its daemon: %q", out)
	} else if _, err := fmt.Sscanf(out[i:], "daemon pid %d", &pid); err != nil {
		t.Fatalf("%q: %v", out, err)
	}
	m := mountEntry(t, mnt)
	abortOnCleanup(t, m)
	t.Cleanup(func() { syscall.Kill(pid, syscall.SIGKILL) }) // the daemon this test started
	if owner, ok := m.UserID(); !ok || owner != uid {
		t.Fatalf("user mount's owner %d (%v), want %d", owner, ok, uid)
	}
	stopProcess(t, pid)
	reader := blockOn(t, uid, "stat", filepath.Join(mnt, "never-looked-up"))
	out, code, took := runBounded(t, uid, "unmount", "--force", mnt)
	if code != 0 {
		t.Fatalf("the owner's unmount --force of its hung mount: exit %d after %s: %q", code, took, out)
	}
	if typ := mountType(t, mnt); typ != "" {
		t.Errorf("after unmount --force %s is still a %s mount", mnt, typ)
	}
	readerTook := reader.waitFailed(t, time.Now().Add(-took))
	t.Logf("user's hung mount: unmount --force returned after %s; the blocked reader failed %s after it started",
		took.Round(time.Millisecond), readerTook.Round(time.Millisecond))
}

// TestProbeChildNamesItsMount: the probe child says which mount it
// probed (its mount id, as the mount table numbers it), so that a path
// that leads elsewhere since the table was read (a link a user put in a
// directory of theirs, a new mount) gives no verdict on the mount gdsfs
// unmount --force is about to abort; through a link it probes nothing.
func TestProbeChildNamesItsMount(t *testing.T) {
	requireRoot(t)
	dir := t.TempDir()
	backing, mnt := mountDirs(t, dir)
	startBinDaemon(t, backing, mnt, "--engine", "host", "--host-pool", "16MiB", "--slab-size", "4MiB")
	m := mountEntry(t, mnt)
	out, code, _ := runBounded(t, 0, daemon.ProbeCommand, mnt)
	if want := fmt.Sprintf("probing %d\nok\n", m.ID); code != 0 || out != want {
		t.Errorf("probe of %s: exit %d, %q; want %q", mnt, code, out, want)
	}
	link := filepath.Join(dir, "link")
	if err := os.Symlink(mnt, link); err != nil {
		t.Fatal(err)
	}
	if out, code, _ := runBounded(t, 0, daemon.ProbeCommand, link); code != 0 || out != "ELOOP\n" {
		t.Errorf("probe through a link: exit %d, %q; want ELOOP and no probe", code, out)
	}
	// gdsfs mount of the link would stack on the mount it leads to: refused.
	cleanupMount(t, mnt)
	other := filepath.Join(dir, "other")
	if err := os.Mkdir(other, 0o755); err != nil {
		t.Fatal(err)
	}
	out, code, _ = runBounded(t, 0, "mount", "--background", "--engine", "host", "--host-pool", "16MiB", "--slab-size", "4MiB", "--source", other, link)
	if code != 2 {
		t.Errorf("mount of a link to a gdsfs mount: exit %d, want 2: %q", code, out)
	}
	oneLine(t, "mount of a link to a gdsfs mount", out, "already mounted by gdsfs", mnt)
	if got := mountEntry(t, mnt); got.ID != m.ID {
		t.Errorf("mount of a link stacked mount %d on %d", got.ID, m.ID)
	}
}

// TestStatusWatchCtrlCOnHungDaemon: gdsfs status --watch whose daemon
// stops answering mid-watch (here: SIGSTOPped while the watch's request
// waits on it) ends at Ctrl-C, with the one line naming the stopped
// daemon and the fix; it neither ignores the signal (the thread stuck in
// the request took it) nor stays stuck exiting (the close of the control
// file waited for the daemon's FLUSH answer).
func TestStatusWatchCtrlCOnHungDaemon(t *testing.T) {
	requireRoot(t)
	dir := t.TempDir()
	backing, mnt := mountDirs(t, dir)
	d := startBinDaemon(t, backing, mnt, "--engine", "host", "--host-pool", "16MiB", "--slab-size", "4MiB")
	m := mountEntry(t, mnt)
	abortOnCleanup(t, m)
	waitRecorded(t, m, d.pid())

	var out lockedBuffer
	watch := exec.Command(gdsfsBin(t), "status", "--watch", "--interval", "100ms", mnt)
	watch.Dir = "/"
	watch.Stdout, watch.Stderr = &out, &out
	if err := watch.Start(); err != nil {
		t.Fatal(err)
	}
	exited := make(chan struct{})
	var waitErr error // set before exited is closed
	go func() { waitErr = watch.Wait(); close(exited) }()
	// Runs after stopProcess's SIGCONT (cleanups run last first).
	t.Cleanup(func() {
		watch.Process.Kill()
		select {
		case <-exited:
		case <-time.After(hungWait):
			t.Errorf("the watch did not exit %s after SIGKILL", hungWait)
		}
	})
	deadline := time.Now().Add(hungWait)
	for !strings.Contains(out.String(), "Ctrl-C to stop") {
		if time.Now().After(deadline) {
			t.Fatalf("no first frame of the watch within %s: %q", hungWait, out.String())
		}
		time.Sleep(5 * time.Millisecond) // polling the output: no event to wait on
	}
	stopProcess(t, d.pid())
	// The watch's next request now waits on the stopped daemon.
	for {
		if n, ok := fuseconn.Waiting(m); ok && n > 0 {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("no request of the watch waits on the stopped daemon within %s", hungWait)
		}
		time.Sleep(5 * time.Millisecond) // polling fusectl: no event to wait on
	}
	if err := watch.Process.Signal(syscall.SIGINT); err != nil {
		t.Fatal(err)
	}
	select {
	case <-exited:
		var ee *exec.ExitError
		if !errors.As(waitErr, &ee) || ee.ExitCode() != 2 {
			t.Errorf("watch after Ctrl-C on a stopped daemon: %v, want exit 2", waitErr)
		}
		got := out.String()
		oneLine(t, "status --watch after Ctrl-C", got[strings.LastIndex(strings.TrimRight(got, "\n"), "\n")+1:],
			fmt.Sprintf("daemon pid %d", d.pid()), "stopped", "gdsfs unmount --force "+mnt)
	case <-time.After(hungWait):
		t.Fatalf("status --watch still running %s after Ctrl-C on a stopped daemon: %q", hungWait, out.String())
	}
}
