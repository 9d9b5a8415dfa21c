package integration

import (
	"bufio"
	"context"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"
)

// unitScript returns the shell script of the systemd unit's key (an
// `ExecXxx=/bin/sh -c '...'` line) as the shell receives it.
func unitScript(t *testing.T, key string) string {
	t.Helper()
	f, err := os.Open("../scripts/gdsfs.service")
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		rest, ok := strings.CutPrefix(sc.Text(), key+"=")
		if !ok {
			continue
		}
		body, ok := strings.CutPrefix(rest, "/bin/sh -c '")
		if !ok || !strings.HasSuffix(body, "'") {
			t.Fatalf("%s is not /bin/sh -c '...': %s", key, rest)
		}
		// systemd turns $$ into $ before the shell sees the script.
		return strings.ReplaceAll(strings.TrimSuffix(body, "'"), "$$", "$")
	}
	t.Fatalf("scripts/gdsfs.service has no %s", key)
	return ""
}

// runUnitScript runs a unit script for mountpoint as systemd would (the
// unit's environment), bounded to a minute, and returns its exit code.
func runUnitScript(t *testing.T, script, mountpoint string) (int, string) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	cmd := exec.CommandContext(ctx, "/bin/sh", "-c", script)
	cmd.Env = append(os.Environ(), "GDSFS_MOUNTPOINT="+mountpoint)
	out, err := cmd.CombinedOutput()
	if ee, ok := err.(*exec.ExitError); ok {
		return ee.ExitCode(), string(out)
	}
	if err != nil {
		t.Fatal(err)
	}
	return 0, string(out)
}

// TestFaultUnitRestart checks what the systemd unit does around a crash:
// its readiness check passes once the mount is up, and after kill -9 its
// ExecStopPost detaches the dead mount, but never a mount that is not
// gdsfs's.
func TestFaultUnitRestart(t *testing.T) {
	requireRoot(t)
	for _, tool := range []string{"findmnt", "umount"} {
		if _, err := exec.LookPath(tool); err != nil {
			t.Skipf("%s not installed (util-linux)", tool)
		}
	}
	startPost, stopPost := unitScript(t, "ExecStartPost"), unitScript(t, "ExecStopPost")
	// The unit's binary is this build's (without one there, the script
	// falls back to umount -l: TestFaultUnitStopPostWithoutBinary).
	stopPost = strings.ReplaceAll(stopPost, "/usr/local/bin/gdsfs", gdsfsBin(t))
	dir := t.TempDir()
	backing, mnt := mountDirs(t, dir)
	d := startBinDaemon(t, backing, mnt, "--engine", "host", "--host-pool", "16MiB", "--slab-size", "4MiB")
	if code, out := runUnitScript(t, startPost, mnt); code != 0 {
		t.Fatalf("ExecStartPost with the mount up: exit %d: %s", code, out)
	}

	if err := d.cmd.Process.Signal(syscall.SIGKILL); err != nil {
		t.Fatal(err)
	}
	<-d.exited
	if typ := mountType(t, mnt); typ != "fuse.gdsfs" {
		t.Fatalf("after kill -9 the mount table shows %q on %s, want the dead fuse.gdsfs mount", typ, mnt)
	}
	if code, out := runUnitScript(t, stopPost, mnt); code != 0 {
		t.Fatalf("ExecStopPost after a crash: exit %d: %s", code, out)
	}
	if typ := mountType(t, mnt); typ != "" {
		t.Errorf("ExecStopPost left %q mounted on %s", typ, mnt)
	}
	if _, err := os.ReadDir(mnt); err != nil {
		t.Errorf("%s after ExecStopPost: %v", mnt, err)
	}
	// Nothing to clean: exits 0 and touches nothing.
	if code, out := runUnitScript(t, stopPost, mnt); code != 0 {
		t.Errorf("ExecStopPost with nothing mounted: exit %d: %s", code, out)
	}

	// An overmounted directory that is itself a mount point must stay.
	other := t.TempDir()
	if err := syscall.Mount("gdsfs-unit-test", other, "tmpfs", 0, "size=1m"); err != nil {
		t.Fatalf("mount tmpfs: %v", err)
	}
	t.Cleanup(func() {
		if err := syscall.Unmount(other, syscall.MNT_DETACH); err != nil {
			t.Errorf("unmount tmpfs: %v", err)
		}
	})
	if code, out := runUnitScript(t, stopPost, other); code != 0 {
		t.Errorf("ExecStopPost on a tmpfs: exit %d: %s", code, out)
	}
	if typ := mountType(t, other); typ != "tmpfs" {
		t.Errorf("ExecStopPost unmounted a tmpfs that is not gdsfs's (now %q)", typ)
	}
}

// TestFaultUnitStopPostWithoutBinary: where the unit's gdsfs binary is
// missing, ExecStopPost still detaches a dead mount (umount -l).
func TestFaultUnitStopPostWithoutBinary(t *testing.T) {
	requireRoot(t)
	for _, tool := range []string{"findmnt", "umount"} {
		if _, err := exec.LookPath(tool); err != nil {
			t.Skipf("%s not installed (util-linux)", tool)
		}
	}
	stopPost := strings.ReplaceAll(unitScript(t, "ExecStopPost"), "/usr/local/bin/gdsfs", filepath.Join(t.TempDir(), "no-gdsfs"))
	backing, mnt := mountDirs(t, t.TempDir())
	d := startBinDaemon(t, backing, mnt, "--engine", "host", "--host-pool", "16MiB", "--slab-size", "4MiB")
	if err := d.cmd.Process.Signal(syscall.SIGKILL); err != nil {
		t.Fatal(err)
	}
	<-d.exited
	if code, out := runUnitScript(t, stopPost, mnt); code != 0 {
		t.Fatalf("ExecStopPost after a crash: exit %d: %s", code, out)
	}
	if typ := mountType(t, mnt); typ != "" {
		t.Errorf("ExecStopPost left %q mounted on %s", typ, mnt)
	}
}
