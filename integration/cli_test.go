package integration

import (
	"bytes"
	"errors"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"
)

// TestMountBadInput: every user error exits 2 with a one-line message that
// names the problem, and leaves nothing mounted.
func TestMountBadInput(t *testing.T) {
	requireRoot(t)
	dir := t.TempDir()
	mp := filepath.Join(dir, "mp")
	file := filepath.Join(dir, "file")
	tmpfs := tmpfsDir(t)
	gdsfsMnt, _ := startMount(t, mountOpts{}).dirs()
	for _, d := range []string{mp} {
		if err := os.Mkdir(d, 0o755); err != nil {
			t.Fatal(err)
		}
	}
	writeFile(t, file, []byte("x"))

	cases := []struct {
		name string
		args []string
		want string // in the message
	}{
		{"no mountpoint", []string{"mount"}, "accepts 1 arg"},
		{"two mountpoints", []string{"mount", mp, mp}, "accepts 1 arg"},
		{"missing mountpoint", []string{"mount", filepath.Join(dir, "nope")}, "does not exist"},
		{"mountpoint is a file", []string{"mount", file}, "not a directory"},
		{"missing source", []string{"mount", "--source", filepath.Join(dir, "nope"), mp}, "does not exist"},
		{"source is a file", []string{"mount", "--source", file, mp}, "not a directory"},
		{"source is the mountpoint", []string{"mount", "--source", mp, mp}, "leave --source out"},
		{"unknown flag", []string{"mount", "--bogus", mp}, "unknown flag"},
		{"bad log level", []string{"mount", "--log-level", "loud", mp}, "--log-level"},
		{"already gdsfs", []string{"mount", gdsfsMnt}, "already mounted by gdsfs"},
		{"source hides a mount", []string{"mount", "--source", dir, tmpfs}, "already a mount point"},
		{"background, missing mountpoint", []string{"mount", "--background", filepath.Join(dir, "nope")}, "does not exist"},
		{"unmount a plain dir", []string{"unmount", mp}, "not a mount point"},
		{"unmount tmpfs", []string{"unmount", tmpfs}, "not gdsfs"},
		{"unmount, no args", []string{"unmount"}, "accepts 1 arg"},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			out, code := runGdsfs(t, c.args...)
			if code != 2 {
				t.Errorf("gdsfs %v: exit %d, want 2; output %q", c.args, code, out)
			}
			if !strings.Contains(out, c.want) || strings.Count(strings.TrimSpace(out), "\n") != 0 {
				t.Errorf("gdsfs %v: output %q, want one line containing %q", c.args, out, c.want)
			}
			if typ := mountType(t, mp); typ != "" {
				t.Errorf("%s left mounted (%s)", mp, typ)
			}
		})
	}
	if typ := mountType(t, tmpfs); typ != "tmpfs" {
		t.Errorf("tmpfs mount changed to %q", typ)
	}
}

// TestBackgroundLifecycle: --background returns once the mount is ready,
// writes reach the backing dir, `gdsfs unmount` ends it (busy first while a
// file is open, --force then).
func TestBackgroundLifecycle(t *testing.T) {
	requireRoot(t)
	dir := t.TempDir()
	src, mp := filepath.Join(dir, "src"), filepath.Join(dir, "mp")
	for _, d := range []string{src, mp} {
		if err := os.Mkdir(d, 0o755); err != nil {
			t.Fatal(err)
		}
	}
	cleanupMount(t, mp)
	logFile := filepath.Join(dir, "log")
	if out, code := runGdsfs(t, "mount", "--background", "--debug", "--log-file", logFile, "--source", src, mp); code != 0 {
		t.Fatalf("mount --background: exit %d: %s", code, out)
	}
	// No waiting: --background returns only once the mount is ready.
	if typ := mountType(t, mp); typ != "fuse.gdsfs" {
		t.Fatalf("after mount --background returned: %s is %q, want fuse.gdsfs", mp, typ)
	}
	writeFile(t, filepath.Join(mp, "f"), []byte("through the mount"))
	if got, err := os.ReadFile(filepath.Join(src, "f")); string(got) != "through the mount" || err != nil {
		t.Errorf("backing file: %q, %v", got, err)
	}
	log, err := os.ReadFile(logFile)
	if err != nil || !bytes.Contains(log, []byte(`"passthrough":`)) {
		t.Errorf("daemon log %q (%v) does not say whether passthrough is used", log, err)
	}
	if !bytes.Contains(log, []byte("LOOKUP")) {
		t.Errorf("--debug log has no FUSE operation trace:\n%s", log)
	}

	f, err := os.Open(filepath.Join(mp, "f"))
	if err != nil {
		t.Fatal(err)
	}
	out, code := runGdsfs(t, "unmount", mp)
	if code != 1 || !strings.Contains(out, "busy") {
		t.Errorf("unmount with an open file: exit %d %q, want 1 and 'busy'", code, out)
	}
	f.Close()
	// The release of f reaches the daemon asynchronously; --force does not
	// depend on it.
	if out, code := runGdsfs(t, "unmount", "--force", mp); code != 0 {
		t.Fatalf("unmount --force: exit %d: %s", code, out)
	}
	waitMounted(t, mp, false)
}

// startForeground runs `gdsfs mount` in the foreground and waits for the
// mount.
func startForeground(t *testing.T, args ...string) *exec.Cmd {
	t.Helper()
	cmd := exec.Command(gdsfsBin(t), append([]string{"mount"}, args...)...)
	out := &lockedBuffer{}
	cmd.Stdout, cmd.Stderr = out, out
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		if cmd.ProcessState == nil {
			cmd.Process.Kill()
			// Bounded: a waitExit that timed out may still be in Wait, and
			// a daemon stuck in the kernel never exits (see below).
			done := make(chan struct{})
			go func() { cmd.Wait(); close(done) }()
			select {
			case <-done:
			case <-time.After(10 * time.Second):
				t.Errorf("the daemon (pid %d) did not exit 10 s after SIGKILL", cmd.Process.Pid)
			}
		}
		if t.Failed() {
			t.Logf("daemon output:\n%s", out.String())
		}
	})
	waitMounted(t, args[len(args)-1], true)
	// The mount shows in /proc/mounts before the daemon has finished
	// starting: go-fuse's WaitMount opens a file through the new mount
	// (its epoll workaround), and a daemon killed while that request is
	// in flight waits for its own answer forever (a zombie holding the
	// mount, until the connection is aborted). The daemon logs "mounted"
	// after WaitMount.
	deadline := time.Now().Add(20 * time.Second)
	for !strings.Contains(out.String(), "mounted") {
		if time.Now().After(deadline) {
			t.Fatalf("the daemon never logged \"mounted\":\n%s", out.String())
		}
		time.Sleep(10 * time.Millisecond)
	}
	return cmd
}

// lockedBuffer is a bytes.Buffer safe for a process's output and a test
// reading it at once.
type lockedBuffer struct {
	mu sync.Mutex
	b  bytes.Buffer
}

func (l *lockedBuffer) Write(p []byte) (int, error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.b.Write(p)
}

func (l *lockedBuffer) String() string {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.b.String()
}

// waitExit waits (bounded) for cmd and returns its exit code.
func waitExit(t *testing.T, cmd *exec.Cmd) int {
	t.Helper()
	done := make(chan error, 1)
	go func() { done <- cmd.Wait() }()
	select {
	case err := <-done:
		var ee *exec.ExitError
		if errors.As(err, &ee) {
			return ee.ExitCode()
		}
		if err != nil {
			t.Fatal(err)
		}
		return 0
	case <-time.After(30 * time.Second):
		cmd.Process.Kill()
		t.Fatal("daemon did not exit within 30s")
		return -1
	}
}

// TestSignalsUnmount: SIGINT and SIGTERM unmount cleanly and exit 0, even
// with a file open; so does `gdsfs unmount` from outside.
func TestSignalsUnmount(t *testing.T) {
	requireRoot(t)
	for _, sig := range []syscall.Signal{syscall.SIGINT, syscall.SIGTERM, 0} {
		name := "unmount"
		if sig != 0 {
			name = sig.String()
		}
		t.Run(name, func(t *testing.T) {
			dir := t.TempDir()
			mp := filepath.Join(dir, "mp")
			if err := os.Mkdir(mp, 0o755); err != nil {
				t.Fatal(err)
			}
			cleanupMount(t, mp)
			cmd := startForeground(t, "--source", dir, mp)
			if sig == 0 {
				if out, code := runGdsfs(t, "unmount", mp); code != 0 {
					t.Fatalf("gdsfs unmount: exit %d: %s", code, out)
				}
			} else {
				if err := cmd.Process.Signal(sig); err != nil {
					t.Fatal(err)
				}
			}
			if code := waitExit(t, cmd); code != 0 {
				t.Errorf("daemon exit code %d, want 0", code)
			}
			if typ := mountType(t, mp); typ != "" {
				t.Errorf("still mounted after the daemon exited: %s", typ)
			}
		})
	}
}

// TestSignalWithOpenFile: SIGTERM while a process has a file open on the
// mount detaches the mount at once (new opens no longer reach it), keeps
// serving the open file, and exits 0 after the last close.
func TestSignalWithOpenFile(t *testing.T) {
	requireRoot(t)
	dir := t.TempDir()
	mp := filepath.Join(dir, "mp")
	if err := os.Mkdir(mp, 0o755); err != nil {
		t.Fatal(err)
	}
	writeFile(t, filepath.Join(dir, "f"), []byte("open during shutdown"))
	cleanupMount(t, mp)
	cmd := startForeground(t, "--source", dir, mp)
	f, err := os.Open(filepath.Join(mp, "f"))
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	if err := cmd.Process.Signal(syscall.SIGTERM); err != nil {
		t.Fatal(err)
	}
	waitMounted(t, mp, false)
	buf := make([]byte, 64)
	if n, err := f.ReadAt(buf, 0); string(buf[:n]) != "open during shutdown" {
		t.Errorf("read of a file open across SIGTERM: %q, %v", buf[:n], err)
	}
	f.Close()
	if code := waitExit(t, cmd); code != 0 {
		t.Errorf("daemon exit code %d after the last close, want 0", code)
	}
}

// TestStaleMountCleanup: a daemon killed with SIGKILL leaves a dead mount
// (ENOTCONN); the next `gdsfs mount` of the path cleans it up and mounts.
func TestStaleMountCleanup(t *testing.T) {
	requireRoot(t)
	dir := t.TempDir()
	src, mp := filepath.Join(dir, "src"), filepath.Join(dir, "mp")
	for _, d := range []string{src, mp} {
		if err := os.Mkdir(d, 0o755); err != nil {
			t.Fatal(err)
		}
	}
	writeFile(t, filepath.Join(src, "f"), []byte("data"))
	cleanupMount(t, mp)
	cmd := startForeground(t, "--source", src, mp)
	if err := cmd.Process.Kill(); err != nil {
		t.Fatal(err)
	}
	waitExit(t, cmd)
	var st syscall.Statfs_t
	if err := syscall.Statfs(mp, &st); !errors.Is(err, syscall.ENOTCONN) {
		t.Fatalf("statfs of a killed daemon's mount: %v, want ENOTCONN", err)
	}
	out, code := runGdsfs(t, "mount", "--background", "--source", src, mp)
	if code != 0 {
		t.Fatalf("mount over a stale mount: exit %d: %s", code, out)
	}
	if got, err := os.ReadFile(filepath.Join(mp, "f")); string(got) != "data" || err != nil {
		t.Errorf("read after stale cleanup: %q, %v", got, err)
	}
	if out, code := runGdsfs(t, "unmount", mp); code != 0 {
		t.Fatalf("unmount: exit %d: %s", code, out)
	}
	waitMounted(t, mp, false)
	// Only the stale mount was there: nothing is stacked below.
	if typ := mountType(t, mp); typ != "" {
		t.Errorf("after unmount %s is still a %s mount", mp, typ)
	}
}

// TestOvermount: without --source gdsfs serves the directory it mounts on;
// after unmount the directory holds every write made through the mount.
func TestOvermount(t *testing.T) {
	requireRoot(t)
	dir := filepath.Join(t.TempDir(), "data")
	writeFile(t, filepath.Join(dir, "shard-0.tar"), []byte("original"))
	writeFile(t, filepath.Join(dir, "sub/keep"), []byte("keep"))
	cleanupMount(t, dir)
	if out, code := runGdsfs(t, "mount", "--background", dir); code != 0 {
		t.Fatalf("overmount: exit %d: %s", code, out)
	}
	if got, err := os.ReadFile(filepath.Join(dir, "shard-0.tar")); string(got) != "original" || err != nil {
		t.Fatalf("read through the overmount: %q, %v", got, err)
	}
	writeFile(t, filepath.Join(dir, "shard-0.tar.tmp"), []byte("rewritten"))
	if err := os.Rename(filepath.Join(dir, "shard-0.tar.tmp"), filepath.Join(dir, "shard-0.tar")); err != nil {
		t.Fatal(err)
	}
	writeFile(t, filepath.Join(dir, "new/file"), []byte("new"))
	if err := os.Remove(filepath.Join(dir, "sub/keep")); err != nil {
		t.Fatal(err)
	}
	if out, code := runGdsfs(t, "unmount", dir); code != 0 {
		t.Fatalf("unmount: exit %d: %s", code, out)
	}
	waitMounted(t, dir, false)
	for p, want := range map[string]string{"shard-0.tar": "rewritten", "new/file": "new"} {
		if got, err := os.ReadFile(filepath.Join(dir, p)); string(got) != want || err != nil {
			t.Errorf("after unmount %s: %q, %v; want %q", p, got, err, want)
		}
	}
	if _, err := os.Stat(filepath.Join(dir, "sub/keep")); !errors.Is(err, os.ErrNotExist) {
		t.Errorf("file removed through the mount is back after unmount: %v", err)
	}
}

// TestMountAsUser: an unprivileged user either gets a working user mount
// (fusermount3 usable here), whose log explains why passthrough is off, or
// exit code 2 with a message saying how to fix it; never a half mount.
func TestMountAsUser(t *testing.T) {
	requireRoot(t)
	const nobody = 65534
	dir := t.TempDir()
	if err := os.Chmod(dir, 0o755); err != nil {
		t.Fatal(err)
	}
	if err := os.Chmod(filepath.Dir(dir), 0o755); err != nil {
		t.Fatal(err)
	}
	src, mp := filepath.Join(dir, "src"), filepath.Join(dir, "mp")
	for _, d := range []string{src, mp} {
		if err := os.Mkdir(d, 0o755); err != nil {
			t.Fatal(err)
		}
		if err := os.Chown(d, nobody, nobody); err != nil {
			t.Fatal(err)
		}
	}
	cleanupMount(t, mp)
	logFile := filepath.Join(src, "log") // writable by nobody
	asNobody := func(args ...string) (string, int) {
		cmd := exec.Command(gdsfsBin(t), args...)
		cmd.SysProcAttr = &syscall.SysProcAttr{Credential: &syscall.Credential{Uid: nobody, Gid: nobody}}
		out, err := cmd.CombinedOutput()
		var ee *exec.ExitError
		if errors.As(err, &ee) {
			return string(out), ee.ExitCode()
		}
		if err != nil {
			t.Fatal(err)
		}
		return string(out), 0
	}
	out, code := asNobody("mount", "--background", "--log-file", logFile, "--source", src, mp)
	switch code {
	case 0:
		log, _ := os.ReadFile(logFile)
		if !bytes.Contains(log, []byte(`"passthrough":false`)) || !bytes.Contains(log, []byte("root")) {
			t.Errorf("user mount log does not explain why passthrough is off:\n%s", log)
		}
		if out, code := asNobody("unmount", mp); code != 0 {
			t.Errorf("user unmount: exit %d: %s", code, out)
		}
		waitMounted(t, mp, false)
	case 2:
		if !strings.Contains(out, "run gdsfs as root") {
			t.Errorf("user mount failure %q does not say how to fix it", out)
		}
		if typ := mountType(t, mp); typ != "" {
			t.Errorf("failed user mount left a %s mount", typ)
		}
	default:
		t.Errorf("mount as uid %d: exit %d, want 0 or 2: %s", nobody, code, out)
	}
}

// TestBackgroundDefaultLog: `mount --background` without --log-file still
// logs somewhere (/var/log/gdsfs/<mountpoint>.log as root), says where in its
// one line of output, and `gdsfs status` names the same file.
func TestBackgroundDefaultLog(t *testing.T) {
	requireRoot(t)
	dir := t.TempDir()
	src, mp := filepath.Join(dir, "src"), filepath.Join(dir, "mp")
	for _, d := range []string{src, mp} {
		if err := os.Mkdir(d, 0o755); err != nil {
			t.Fatal(err)
		}
	}
	cleanupMount(t, mp)
	want := "/var/log/gdsfs/" + strings.ReplaceAll(strings.Trim(mp, "/"), "/", "-") + ".log"
	t.Cleanup(func() { os.Remove(want); os.Remove(want + ".1") })
	out, code := runGdsfs(t, "mount", "--background", "--source", src, mp)
	if code != 0 {
		t.Fatalf("mount --background: exit %d: %s", code, out)
	}
	if lines := strings.Split(strings.TrimSpace(out), "\n"); len(lines) != 1 || !strings.Contains(out, "log: "+want) {
		t.Errorf("mount --background printed %q, want one line naming the log %s", out, want)
	}
	if log, err := os.ReadFile(want); err != nil || !bytes.Contains(log, []byte(`"message":"mounted"`)) {
		t.Errorf("default log %s: %v, %q: want the daemon's mounted line", want, err, log)
	}
	if st, err := os.Stat(want); err == nil && st.Mode().Perm() != 0o600 {
		t.Errorf("default log mode %o, want 0600 (it names users' files)", st.Mode().Perm())
	}
	status, code := runGdsfs(t, "status", mp)
	if code != 0 || !strings.Contains(status, "log:      "+want) {
		t.Errorf("gdsfs status (exit %d) does not name the log %s:\n%s", code, want, status)
	}
	if out, code := runGdsfs(t, "unmount", mp); code != 0 {
		t.Fatalf("unmount: exit %d: %s", code, out)
	}
}

// TestMountSaysHowItServes: after a background mount with no log flags,
// `gdsfs status` and `gdsfs doctor FILE-ON-THE-MOUNT` say whether kernel
// passthrough is on and why, and which engine serves and why.
func TestMountSaysHowItServes(t *testing.T) {
	requireRoot(t)
	for _, c := range []struct {
		name  string
		extra []string
		want  string // status line
		probe string // doctor row
	}{
		{"no-passthrough", []string{"--no-passthrough"}, "passthrough: off (", "mount passthrough   no"},
		{"default", nil, "passthrough: ", "mount passthrough"},
	} {
		t.Run(c.name, func(t *testing.T) {
			dir := t.TempDir()
			src, mp := filepath.Join(dir, "src"), filepath.Join(dir, "mp")
			for _, d := range []string{src, mp} {
				if err := os.Mkdir(d, 0o755); err != nil {
					t.Fatal(err)
				}
			}
			writeFile(t, filepath.Join(src, "f"), []byte("data"))
			cleanupMount(t, mp)
			logFile := filepath.Join(dir, "log")
			args := append([]string{"mount", "--background", "--log-file", logFile, "--source", src}, c.extra...)
			if out, code := runGdsfs(t, append(args, mp)...); code != 0 {
				t.Fatalf("mount: exit %d: %s", code, out)
			}
			defer runGdsfs(t, "unmount", mp)
			status, code := runGdsfs(t, "status", mp)
			if code != 0 || !strings.Contains(status, c.want) || !strings.Contains(status, "engine:   host (host slabs): ") {
				t.Errorf("gdsfs status (exit %d) does not say how the mount serves (want %q and the engine's why):\n%s", code, c.want, status)
			}
			log, _ := os.ReadFile(logFile)
			on := bytes.Contains(log, []byte(`"passthrough":true`))
			if strings.Contains(status, "passthrough: on") != on {
				t.Errorf("status says %q, the mount's log says passthrough=%v", status, on)
			}
			doc, code := runGdsfs(t, "doctor", filepath.Join(mp, "f"))
			if code != 0 || !strings.Contains(doc, c.probe) || !strings.Contains(doc, "gdsfs mount         ok      "+mp) {
				t.Errorf("gdsfs doctor FILE (exit %d) does not check the mount (want %q):\n%s", code, c.probe, doc)
			}
		})
	}
}

// TestUnmountReleasesBacking: once `gdsfs unmount` returns, the daemon has
// let go of the backing directory, so the disk under it can be unmounted at
// once (the daemon holds the backing root open while it runs).
func TestUnmountReleasesBacking(t *testing.T) {
	requireRoot(t)
	for i := 0; i < 5; i++ {
		disk := t.TempDir()
		if err := syscall.Mount("gdsfs-test", disk, "tmpfs", 0, "size=8m"); err != nil {
			t.Fatalf("mount tmpfs: %v", err)
		}
		mp := t.TempDir()
		cleanupMount(t, mp)
		writeFile(t, filepath.Join(disk, "f"), []byte("data"))
		if out, code := runGdsfs(t, "mount", "--background", "--log-file", filepath.Join(t.TempDir(), "log"), "--source", disk, mp); code != 0 {
			syscall.Unmount(disk, syscall.MNT_DETACH)
			t.Fatalf("mount: exit %d: %s", code, out)
		}
		if got, err := os.ReadFile(filepath.Join(mp, "f")); string(got) != "data" || err != nil {
			t.Errorf("read through the mount: %q, %v", got, err)
		}
		if out, code := runGdsfs(t, "unmount", mp); code != 0 {
			t.Fatalf("unmount: exit %d: %s", code, out)
		}
		if err := syscall.Unmount(disk, 0); err != nil {
			syscall.Unmount(disk, syscall.MNT_DETACH)
			t.Fatalf("run %d: umount of the backing disk right after gdsfs unmount: %v", i, err)
		}
	}
}
