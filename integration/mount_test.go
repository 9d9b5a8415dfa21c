// Package integration mounts real gdsfs filesystems and drives them with
// real clients: go-fuse's posixtest, a differential test against a plain
// directory, shell tools, python, and the gdsfs binary itself.
//
// Tests need root and /dev/fuse (CI has both) and skip with the reason
// otherwise. CLI tests run the binary named by $GDSFS_BIN (the Makefile
// exports it); when unset, TestMain builds one into a temporary directory.
//
// Helpers for other packages' integration tests:
//
//   - startMount(t, mountOpts{...}) mounts a fresh backing directory
//     in-process, package fs alone or (Daemon) a whole daemon as gdsfs
//     mount starts it, and unmounts it when the test ends.
//   - child{...}.cmd/run/mustRun re-execute the test binary as a client
//     process of another uid (child_test.go).
//   - gdsfsBin(t) is the path of the binary to run.
//   - runGdsfs(t, args...) runs it and returns output and exit code.
//   - waitMounted(t, dir, want) waits until dir is (or is no longer) a
//     gdsfs mount.
package integration

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/rs/zerolog"

	"github.com/gdsfs/gdsfs/cufile"
	"github.com/gdsfs/gdsfs/daemon"
	"github.com/gdsfs/gdsfs/fs"
	"github.com/gdsfs/gdsfs/gpubuf"
)

func TestMain(m *testing.M) {
	os.Exit(runTests(m))
}

func runTests(m *testing.M) int {
	if os.Getenv("GDSFS_BIN") == "" {
		dir, err := os.MkdirTemp("", "gdsfs-bin-")
		if err != nil {
			fmt.Fprintln(os.Stderr, err)
			return 1
		}
		defer os.RemoveAll(dir)
		// MkdirTemp makes the directory 0700: open it to the other uids the
		// tests run the binary as (TestMountAsUser, the two-uid tests).
		if err := os.Chmod(dir, 0o755); err != nil {
			fmt.Fprintln(os.Stderr, err)
			return 1
		}
		bin := filepath.Join(dir, "gdsfs")
		out, err := exec.Command("go", "build", "-o", bin, "github.com/gdsfs/gdsfs/cmd/gdsfs").CombinedOutput()
		if err != nil {
			fmt.Fprintf(os.Stderr, "build gdsfs: %v\n%s", err, out)
			return 1
		}
		os.Setenv("GDSFS_BIN", bin)
	}
	return m.Run()
}

// requireRoot skips tests that mount when they cannot.
func requireRoot(t testing.TB) {
	t.Helper()
	if os.Geteuid() != 0 {
		t.Skip("mounting in integration tests needs root (CI runs as root)")
	}
	if _, err := os.Stat("/dev/fuse"); err != nil {
		t.Skip("no /dev/fuse: install fuse3")
	}
}

// mountOpts configures startMount; the zero value is a read-write mount
// of package fs alone (no control path) with default timeouts.
type mountOpts struct {
	ReadOnly      bool
	AllowOther    bool
	NoPassthrough bool
	// AttrTimeout and EntryTimeout are the kernel's attribute and name
	// cache timeouts (0: the defaults).
	AttrTimeout  time.Duration
	EntryTimeout time.Duration
	// Backing, when set, is served instead of a fresh empty directory.
	Backing string
	// OtherUIDs lets other uids' processes use the mount: allow_other, and
	// the directories above the mountpoint opened to them (t.TempDir
	// makes 0700 ones).
	OtherUIDs bool

	// Daemon starts a whole in-process daemon (daemon.Start, as gdsfs
	// mount does) with the control path: the host engine, its slabs under
	// /dev/shm (readable by other uids' clients), a 64 MiB index cache.
	Daemon bool
	// SlabBytes and BudgetBytes size the daemon's pool (0: gpubuf's
	// defaults).
	SlabBytes, BudgetBytes int64
	// Config, if set, adjusts the daemon's configuration last.
	Config func(*daemon.Config)
}

// testMount is a mount a test started (startMount): at mnt, serving
// backing, through d (with mountOpts.Daemon) or srv (package fs alone).
type testMount struct {
	mnt, backing string
	d            *daemon.Daemon
	srv          *fs.Server
}

// dirs returns the mountpoint and the backing directory.
func (m *testMount) dirs() (mnt, backing string) { return m.mnt, m.backing }

// mountDirs makes dir/backing and dir/mnt (0755), the backing directory and
// the mountpoint of a test's mount, and returns their paths.
func mountDirs(t testing.TB, dir string) (backing, mnt string) {
	t.Helper()
	backing, mnt = filepath.Join(dir, "backing"), filepath.Join(dir, "mnt")
	for _, p := range []string{backing, mnt} {
		if err := os.Mkdir(p, 0o755); err != nil {
			t.Fatal(err)
		}
	}
	return backing, mnt
}

// openToOtherUIDs makes dir and the directories above it, up to the
// temporary directory, 0755, so that other uids reach what is below.
func openToOtherUIDs(t testing.TB, dir string) {
	t.Helper()
	for d := dir; d != os.TempDir() && d != "/"; d = filepath.Dir(d) {
		if err := os.Chmod(d, 0o755); err != nil {
			t.Fatal(err)
		}
	}
}

// testLog is the log of a test's daemon: the test log under -v, else none.
func testLog(t testing.TB) zerolog.Logger {
	if testing.Verbose() {
		return zerolog.New(zerolog.NewTestWriter(t)).Level(zerolog.InfoLevel)
	}
	return zerolog.Nop()
}

// startMount mounts a backing directory (a fresh empty one unless
// o.Backing) at a fresh mountpoint, in this process, and unmounts it when
// the test ends (also on failure), failing the test if files were left
// open.
func startMount(t testing.TB, o mountOpts) *testMount {
	t.Helper()
	requireRoot(t)
	dir := t.TempDir()
	m := &testMount{}
	m.backing, m.mnt = mountDirs(t, dir)
	if o.Backing != "" {
		m.backing = o.Backing
	}
	if o.OtherUIDs {
		o.AllowOther = true
		openToOtherUIDs(t, filepath.Dir(m.mnt))
	}
	if o.Daemon {
		m.d = startDaemon(t, m, o)
		return m
	}
	srv, err := fs.Mount(context.Background(), fs.Options{
		Source:        m.backing,
		Mountpoint:    m.mnt,
		ReadOnly:      o.ReadOnly,
		AllowOther:    o.AllowOther,
		NoPassthrough: o.NoPassthrough,
		AttrTimeout:   o.AttrTimeout,
		EntryTimeout:  o.EntryTimeout,
		Logger:        testLog(t),
	})
	if err != nil {
		t.Fatalf("mount %s on %s: %v", m.backing, m.mnt, err)
	}
	if on, why := srv.Passthrough(); testing.Verbose() {
		t.Logf("passthrough %v: %s", on, why)
	}
	m.srv = srv
	t.Cleanup(func() {
		if err := srv.Unmount(); err != nil {
			t.Errorf("unmount %s (files left open?): %v", m.mnt, err)
			if err := srv.UnmountLazy(); err != nil {
				t.Errorf("lazy unmount: %v", err)
			}
		}
		srv.Wait()
	})
	return m
}

// startDaemon is startMount's daemon: daemon.Start over m's directories
// with o's settings; closed when the test ends.
func startDaemon(t testing.TB, m *testMount, o mountOpts) *daemon.Daemon {
	t.Helper()
	c := daemon.Config{
		Mountpoint: m.mnt,
		Source:     m.backing,
		Engine: cufile.Config{Engine: cufile.EngineHost,
			HostDir: filepath.Join("/dev/shm", fmt.Sprintf("gdsfs-itest-%d-%s", os.Getpid(), randHex(4)))},
		SlabBytes:      gpubuf.DefaultSlabBytes,
		HostPoolBytes:  gpubuf.DefaultBudgetBytes,
		MetaCacheBytes: 64 << 20,
		Version:        "itest",
		ReadOnly:       o.ReadOnly,
		AllowOther:     o.AllowOther,
		NoPassthrough:  o.NoPassthrough,
		AttrTimeout:    o.AttrTimeout,
		EntryTimeout:   o.EntryTimeout,
		Log:            testLog(t),
	}
	if o.SlabBytes != 0 {
		c.SlabBytes = o.SlabBytes
	}
	if o.BudgetBytes != 0 {
		c.HostPoolBytes = o.BudgetBytes
	}
	if o.Config != nil {
		o.Config(&c)
	}
	d, err := daemon.Start(context.Background(), c)
	if err != nil {
		t.Fatalf("start a daemon serving %s on %s: %v", m.backing, m.mnt, err)
	}
	t.Cleanup(func() {
		if err := d.Unmount(); err != nil {
			t.Errorf("unmount %s (files left open?): %v", m.mnt, err)
		}
		if err := d.Close(); err != nil {
			t.Errorf("close the daemon: %v", err)
		}
	})
	return d
}

// gdsfsBin returns the gdsfs binary under test.
func gdsfsBin(t testing.TB) string {
	t.Helper()
	return os.Getenv("GDSFS_BIN")
}

// runGdsfs runs the binary with args (bounded to a minute) and returns its
// combined output and exit code.
func runGdsfs(t testing.TB, args ...string) (string, int) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	cmd := exec.CommandContext(ctx, gdsfsBin(t), args...)
	var out bytes.Buffer
	cmd.Stdout, cmd.Stderr = &out, &out
	err := cmd.Run()
	var ee *exec.ExitError
	switch {
	case err == nil:
		return out.String(), 0
	case errors.As(err, &ee):
		return out.String(), ee.ExitCode()
	}
	t.Fatalf("run gdsfs %v: %v", args, err)
	return "", -1
}

// mountType returns the filesystem type mounted on dir ("" if none).
func mountType(t testing.TB, dir string) string {
	t.Helper()
	b, err := os.ReadFile("/proc/self/mountinfo")
	if err != nil {
		t.Fatal(err)
	}
	typ := ""
	for _, l := range strings.Split(string(b), "\n") {
		f := strings.Fields(l)
		if len(f) < 10 || f[4] != dir {
			continue
		}
		for i := 6; i+1 < len(f); i++ {
			if f[i] == "-" {
				typ = f[i+1]
				break
			}
		}
	}
	return typ
}

// waitExited waits (up to 20s) until process pid (0: none) has exited: it
// is gone or a zombie (its descriptors are closed then).
func waitExited(t testing.TB, pid int) {
	t.Helper()
	if pid <= 0 {
		return
	}
	deadline := time.Now().Add(20 * time.Second)
	for {
		b, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", pid))
		if err != nil {
			return
		}
		// pid (comm) STATE ...: comm may hold spaces and parentheses.
		if f := strings.Fields(string(b[bytes.LastIndexByte(b, ')')+1:])); len(f) > 0 && (f[0] == "Z" || f[0] == "X") {
			return
		}
		if time.Now().After(deadline) {
			t.Errorf("daemon pid %d still runs 20s after its unmount", pid)
			return
		}
		time.Sleep(10 * time.Millisecond) // polling /proc; the daemon is not our child
	}
}

// waitMounted waits (up to 20s) until dir is a gdsfs mount (want) or is
// not one (!want).
func waitMounted(t testing.TB, dir string, want bool) {
	t.Helper()
	deadline := time.Now().Add(20 * time.Second)
	for {
		if (mountType(t, dir) == "fuse.gdsfs") == want {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("%s: mounted=%v after 20s, want %v", dir, !want, want)
		}
		time.Sleep(20 * time.Millisecond) // polling the mount table; no event to wait on
	}
}

// cleanupMount makes sure nothing stays mounted on dir after the test.
func cleanupMount(t testing.TB, dir string) {
	t.Cleanup(func() {
		for mountType(t, dir) != "" {
			if err := syscall.Unmount(dir, syscall.MNT_DETACH); err != nil {
				t.Errorf("cleanup unmount %s: %v", dir, err)
				return
			}
		}
	})
}

// writeFile writes data to p or fails the test.
func writeFile(t testing.TB, p string, data []byte) {
	t.Helper()
	if err := os.MkdirAll(filepath.Dir(p), 0o755); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(p, data, 0o644); err != nil {
		t.Fatal(err)
	}
}

// run runs a command (bounded to 5 minutes) in dir and fails the test on
// error.
func run(t testing.TB, dir, name string, args ...string) string {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
	defer cancel()
	cmd := exec.CommandContext(ctx, name, args...)
	cmd.Dir = dir
	out, err := cmd.CombinedOutput()
	if err != nil {
		t.Fatalf("%s %v: %v\n%s", name, args, err, out)
	}
	return string(out)
}

// tmpfsDir mounts a small tmpfs on a fresh directory for the test.
func tmpfsDir(t testing.TB) string {
	t.Helper()
	requireRoot(t)
	dir := t.TempDir()
	if err := syscall.Mount("gdsfs-test", dir, "tmpfs", 0, "size=64m"); err != nil {
		t.Fatalf("mount tmpfs: %v", err)
	}
	t.Cleanup(func() {
		if err := syscall.Unmount(dir, 0); err != nil {
			t.Errorf("unmount tmpfs %s: %v", dir, err)
		}
	})
	return dir
}

// mountCLI mounts backing (a fresh directory if empty) with
// `gdsfs mount --background` and default flags, and unmounts it when the
// test ends.
func mountCLI(t testing.TB, backing string, extra ...string) string {
	t.Helper()
	requireRoot(t)
	dir := t.TempDir()
	fresh, mnt := mountDirs(t, dir)
	if backing == "" {
		backing = fresh
	}
	logFile := filepath.Join(dir, "gdsfs.log")
	args := append([]string{"mount", "--background", "--log-file", logFile, "--source", backing}, extra...)
	out, code := runGdsfs(t, append(args, mnt)...)
	if code != 0 {
		t.Fatalf("gdsfs %v: exit %d: %s", args, code, out)
	}
	pid := 0
	if i := strings.Index(out, "(daemon pid "); i >= 0 {
		fmt.Sscanf(out[i:], "(daemon pid %d)", &pid)
	}
	t.Cleanup(func() {
		if out, code := runGdsfs(t, "unmount", mnt); code != 0 {
			t.Errorf("gdsfs unmount %s: exit %d: %s", mnt, code, out)
			runGdsfs(t, "unmount", "--force", mnt)
		}
		waitMounted(t, mnt, false)
		// The daemon holds the backing directory until it exits, shortly
		// after the unmount: a test that unmounts the backing filesystem
		// next (tmpfsDir) must not race it.
		waitExited(t, pid)
		if t.Failed() {
			if b, err := os.ReadFile(logFile); err == nil {
				t.Logf("daemon log:\n%s", b)
			}
		}
	})
	return mnt
}
