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
)

// runGdsfsAs runs the binary as uid:uid (no supplementary groups) and
// returns its combined output and exit code.
func runGdsfsAs(t *testing.T, uid uint32, args ...string) (string, int) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	cmd := exec.CommandContext(ctx, gdsfsBin(t), args...)
	cmd.SysProcAttr = &syscall.SysProcAttr{Credential: &syscall.Credential{Uid: uid, Gid: uid}}
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
	t.Fatalf("run gdsfs %v as uid %d: %v", args, uid, err)
	return "", -1
}

// TestCLIUnusableMounts: a gdsfs mount the caller cannot use (mounted
// without --allow-other for another user, or left by a killed daemon) and
// a file the caller may not read are one line naming what is wrong and
// what to do, exit 2 — not "not a gdsfs mount" or a doubled "open: open".
func TestCLIUnusableMounts(t *testing.T) {
	requireRoot(t)
	dir := t.TempDir()
	for _, d := range []string{filepath.Dir(dir), dir} { // let uid 10001 reach the mounts
		if err := os.Chmod(d, 0o755); err != nil {
			t.Fatal(err)
		}
	}
	mk := func(name string) string {
		p := filepath.Join(dir, name)
		if err := os.Mkdir(p, 0o755); err != nil {
			t.Fatal(err)
		}
		return p
	}
	privSrc, priv := mk("privsrc"), mk("priv") // no --allow-other
	writeFile(t, filepath.Join(privSrc, "f"), []byte("data"))
	startBinDaemon(t, privSrc, priv, "--engine", "host", "--host-pool", "16MiB", "--slab-size", "4MiB")
	openSrc, open := mk("opensrc"), mk("open")
	writeFile(t, filepath.Join(openSrc, "secret"), []byte("root only"))
	if err := os.Chmod(filepath.Join(openSrc, "secret"), 0o600); err != nil {
		t.Fatal(err)
	}
	startBinDaemon(t, openSrc, open, "--allow-other", "--engine", "host", "--host-pool", "16MiB", "--slab-size", "4MiB")
	deadSrc, dead := mk("deadsrc"), mk("dead")
	writeFile(t, filepath.Join(deadSrc, "f"), []byte("data"))
	d := startBinDaemon(t, deadSrc, dead, "--engine", "host", "--host-pool", "16MiB", "--slab-size", "4MiB")
	if err := syscall.Kill(d.pid(), syscall.SIGKILL); err != nil {
		t.Fatal(err)
	}
	waitExited(t, d.pid())
	t.Cleanup(func() { runGdsfs(t, "unmount", "--force", dead) })

	noOther := fmt.Sprintf("%s is a gdsfs mount uid 10001 may not use: it was mounted without --allow-other; mount it with gdsfs mount --allow-other to let other users in", priv)
	exited := fmt.Sprintf("%s is a gdsfs mount whose daemon exited; run gdsfs mount %s again (it cleans up the dead mount), or gdsfs unmount --force %s", dead, dead, dead)
	secret := filepath.Join(open, "secret")
	tests := []struct {
		name string
		uid  uint32
		args []string
		want string // after "gdsfs: "
	}{
		{"status without allow-other", 10001, []string{"status", priv}, noOther},
		{"status --watch without allow-other", 10001, []string{"status", "--watch", priv}, noOther},
		{"read without allow-other", 10001, []string{"read", filepath.Join(priv, "f")}, noOther},
		{"stat without allow-other", 10001, []string{"stat", filepath.Join(priv, "f")}, noOther},
		{"status of a dead mount", 0, []string{"status", dead}, exited},
		{"read of a dead mount", 0, []string{"read", filepath.Join(dead, "f")}, exited},
		{"stat of a dead mount", 0, []string{"stat", filepath.Join(dead, "f")}, exited},
		{"warm of a dead mount", 0, []string{"warm", dead}, exited},
		{"warm --pin in a dead mount", 0, []string{"warm", "--pin", filepath.Join(dead, "f")}, exited},
		{"warm without allow-other", 10001, []string{"warm", priv}, noOther},
		{"stat of an unreadable file", 10001, []string{"stat", secret}, secret + ": permission denied; this user may not read it"},
		{"index of an unreadable file", 10001, []string{"index", secret}, secret + ": permission denied; this user may not read it"},
		{"read of an unreadable file", 10001, []string{"read", secret}, "open " + secret + ": permission denied"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			out, code := runGdsfsAs(t, tt.uid, tt.args...)
			if code != 2 {
				t.Errorf("gdsfs %s (uid %d): exit %d, want 2\n%s", strings.Join(tt.args, " "), tt.uid, code, out)
			}
			if got := strings.TrimSpace(out); got != "gdsfs: "+tt.want {
				t.Errorf("gdsfs %s (uid %d):\n got: %s\nwant: gdsfs: %s", strings.Join(tt.args, " "), tt.uid, got, tt.want)
			}
		})
	}
	// doctor of a path on the dead mount: refused at its stat (exit 2) or, while the kernel
	// still has the mount point's attributes cached, by the mount probe (exit 1); either way
	// the line says what happened and what to do.
	if out, code := runGdsfs(t, "doctor", dead); code == 0 || !strings.Contains(out, "gdsfs: ") || !strings.Contains(out, exited) {
		t.Errorf("gdsfs doctor %s: exit %d, want non-zero with %q\n%s", dead, code, exited, out)
	}
	// The force unmount the message names detaches the dead mount.
	if out, code := runGdsfs(t, "unmount", "--force", dead); code != 0 {
		t.Fatalf("gdsfs unmount --force of a dead mount: exit %d: %s", code, out)
	}
	if typ := mountType(t, dead); typ != "" {
		t.Errorf("%s is still a %s mount after gdsfs unmount --force", dead, typ)
	}
}

// TestWarmOfUnreadableFilesFails: gdsfs warm warms what the user may read
// and skips the rest with one line each, but does not exit 0 when it
// skipped something: a job that warms a dataset before training must see
// that part of it was not warmed (as cat, du or vmtouch would).
func TestWarmOfUnreadableFilesFails(t *testing.T) {
	requireRoot(t)
	dir := t.TempDir()
	for _, d := range []string{filepath.Dir(dir), dir} {
		if err := os.Chmod(d, 0o755); err != nil {
			t.Fatal(err)
		}
	}
	src, mnt := filepath.Join(dir, "src"), filepath.Join(dir, "mnt")
	for _, d := range []string{src, mnt} {
		if err := os.Mkdir(d, 0o755); err != nil {
			t.Fatal(err)
		}
	}
	writeFile(t, filepath.Join(src, "open.bin"), bytes.Repeat([]byte("o"), 8192))
	writeFile(t, filepath.Join(src, "secret.bin"), []byte("root only"))
	if err := os.Chmod(filepath.Join(src, "secret.bin"), 0o600); err != nil {
		t.Fatal(err)
	}
	startBinDaemon(t, src, mnt, "--allow-other", "--engine", "host", "--host-pool", "16MiB", "--slab-size", "4MiB")
	secret := filepath.Join(mnt, "secret.bin")
	for _, tc := range []struct {
		name string
		args []string
		code int
		want []string
	}{
		{"a readable file", []string{"warm", filepath.Join(mnt, "open.bin")}, 0, []string{"warmed 1 files"}},
		{"a tree with an unreadable file", []string{"warm", mnt}, 2, []string{"warmed 1 files",
			"gdsfs: warm: skipped open " + secret + ": permission denied",
			"gdsfs: warm: 1 path could not be read (listed above); the rest was warmed"}},
		{"an unreadable file", []string{"warm", secret}, 2, []string{"gdsfs: warm: skipped open " + secret + ": permission denied",
			"gdsfs: warm: 1 path could not be read (listed above); the rest was warmed"}},
		{"--pin of an unreadable file", []string{"warm", "--pin", secret}, 2, []string{"gdsfs: warm: skipped " + secret + ": permission denied",
			"gdsfs: warm --pin: no file could be pinned (listed above)"}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			out, code := runGdsfsAs(t, 10001, tc.args...)
			if code != tc.code {
				t.Errorf("gdsfs %s (uid 10001): exit %d, want %d\n%s", strings.Join(tc.args, " "), code, tc.code, out)
			}
			for _, w := range tc.want {
				if !strings.Contains(out, w) {
					t.Errorf("gdsfs %s (uid 10001): output lacks %q:\n%s", strings.Join(tc.args, " "), w, out)
				}
			}
		})
	}
}

// TestMountOverNonEmptyDirSaysSo: gdsfs mount --source S DIR over a DIR
// with files of its own hides them while mounted, as mount(8) does; the
// user is told once, on the terminal, and the mount still succeeds.
func TestMountOverNonEmptyDirSaysSo(t *testing.T) {
	requireRoot(t)
	dir := t.TempDir()
	src, mnt := filepath.Join(dir, "src"), filepath.Join(dir, "mnt")
	for _, d := range []string{src, mnt} {
		if err := os.Mkdir(d, 0o755); err != nil {
			t.Fatal(err)
		}
	}
	writeFile(t, filepath.Join(mnt, "mine.txt"), []byte("hidden while mounted"))
	writeFile(t, filepath.Join(src, "served.txt"), []byte("served"))
	out, code := runGdsfs(t, "mount", "--background", "--engine", "host", "--host-pool", "16MiB", "--slab-size", "4MiB",
		"--log-file", filepath.Join(dir, "log"), "--source", src, mnt)
	if code != 0 {
		t.Fatalf("gdsfs mount: exit %d\n%s", code, out)
	}
	t.Cleanup(func() { runGdsfs(t, "unmount", "--force", mnt) })
	want := fmt.Sprintf("gdsfs: note: %s is not empty: its 1 entries are hidden while it is mounted (leave --source out to serve them instead)", mnt)
	if !strings.Contains(out, want) {
		t.Errorf("gdsfs mount over a non-empty directory said:\n%s\nwant a line %q", out, want)
	}
	if b, err := os.ReadFile(filepath.Join(mnt, "served.txt")); err != nil || string(b) != "served" {
		t.Errorf("the mount does not serve --source: %q, %v", b, err)
	}
	// An empty mountpoint says nothing of the kind.
	empty := filepath.Join(dir, "empty")
	if err := os.Mkdir(empty, 0o755); err != nil {
		t.Fatal(err)
	}
	out, code = runGdsfs(t, "mount", "--background", "--engine", "host", "--host-pool", "16MiB", "--slab-size", "4MiB",
		"--log-file", filepath.Join(dir, "log2"), "--source", src, empty)
	if code != 0 {
		t.Fatalf("gdsfs mount: exit %d\n%s", code, out)
	}
	t.Cleanup(func() { runGdsfs(t, "unmount", "--force", empty) })
	if strings.Contains(out, "note:") {
		t.Errorf("gdsfs mount over an empty directory said %q", out)
	}
}
