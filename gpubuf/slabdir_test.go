package gpubuf

import (
	"bufio"
	"context"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"slices"
	"strconv"
	"syscall"
	"testing"
)

// crash leaves b's directory behind as a killed daemon would: the lock is
// dropped (the kernel does that when a process dies) and nothing removed.
func crash(t *testing.T, b *HostBackend) {
	t.Helper()
	b.mu.Lock()
	defer b.mu.Unlock()
	if err := b.lock.Close(); err != nil {
		t.Fatal(err)
	}
	b.lock = nil
}

func exists(p string) bool {
	_, err := os.Lstat(p)
	return err == nil
}

func TestRemoveStaleDirs(t *testing.T) {
	parent := t.TempDir()
	newBackend := func(name string) *HostBackend {
		b, err := NewHostBackend(HostBackendOptions{Dir: filepath.Join(parent, name)})
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { b.Close() })
		return b
	}
	live := newBackend("gdsfs-1-live")
	// A slab in the dead directory, as a killed daemon leaves them.
	dead := newBackend("gdsfs-1-dead")
	if _, err := dead.Alloc(context.Background(), 0, Align, uint32(os.Getuid())); err != nil {
		t.Fatal(err)
	}
	crash(t, dead)
	deadBench := newBackend("gdsfs-bench-7")
	crash(t, deadBench)

	mkdir := func(name string, files ...string) string {
		d := filepath.Join(parent, name)
		if err := os.Mkdir(d, 0o700); err != nil {
			t.Fatal(err)
		}
		for _, f := range files {
			if err := os.WriteFile(filepath.Join(d, f), nil, 0o600); err != nil {
				t.Fatal(err)
			}
		}
		return d
	}
	// The pid alone decides nothing: directories named the old way (no
	// lock file) are not slab directories of this version.
	legacy := mkdir("gdsfs-99999999", "slab-1")
	// A backend between mkdir and renaming its locked lock file into place.
	settingUp := mkdir("gdsfs-2-settingup", slabDirLock+".new")
	notOurs := mkdir("other-1", slabDirLock)
	// A symlink named like a slab directory, to a directory with a free lock.
	target := mkdir("target", slabDirLock)
	link := filepath.Join(parent, "gdsfs-3-link")
	if err := os.Symlink(target, link); err != nil {
		t.Fatal(err)
	}

	removed := removeStaleDirs(parent)
	slices.Sort(removed)
	want := []string{dead.Dir(), deadBench.Dir()}
	slices.Sort(want)
	if !slices.Equal(removed, want) {
		t.Errorf("removed %v, want %v", removed, want)
	}
	for _, d := range want {
		if exists(d) {
			t.Errorf("stale %s kept", d)
		}
	}
	for _, d := range []string{live.Dir(), legacy, settingUp, notOurs, link, filepath.Join(target, slabDirLock)} {
		if !exists(d) {
			t.Errorf("%s removed", d)
		}
	}
	// The live backend still works, and a second sweep changes nothing.
	if _, err := live.Alloc(context.Background(), 0, Align, uint32(os.Getuid())); err != nil {
		t.Errorf("live backend after the sweep: %v", err)
	}
	if again := removeStaleDirs(parent); len(again) != 0 {
		t.Errorf("second sweep removed %v", again)
	}
	if err := live.Close(); err != nil {
		t.Fatal(err)
	}
	if exists(live.Dir()) {
		t.Error("Close left the directory")
	}
}

// The lock is what tells: a directory of another process is kept while that
// process runs and removed once it is killed with SIGKILL (no cleanup ran).
// The two processes may as well have the same pid in different containers:
// nothing here looks at pids.
func TestRemoveStaleDirsOtherProcess(t *testing.T) {
	if dir := os.Getenv("GPUBUF_HOLD_SLAB_DIR"); dir != "" {
		holdSlabDir(dir)
		return
	}
	parent := t.TempDir()
	dir := filepath.Join(parent, "gdsfs-1-other")
	cmd := exec.Command(os.Args[0], "-test.run=^TestRemoveStaleDirsOtherProcess$")
	cmd.Env = append(os.Environ(), "GPUBUF_HOLD_SLAB_DIR="+dir)
	cmd.Stderr = os.Stderr
	stdin, err := cmd.StdinPipe()
	if err != nil {
		t.Fatal(err)
	}
	stdout, err := cmd.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		stdin.Close()
		cmd.Process.Kill()
		cmd.Wait()
	})
	line, err := bufio.NewReader(stdout).ReadString('\n')
	if err != nil || line != "ready\n" {
		t.Fatalf("helper: %q, %v", line, err)
	}
	if removed := removeStaleDirs(parent); len(removed) != 0 {
		t.Fatalf("removed the directory of a running process: %v", removed)
	}
	if err := cmd.Process.Signal(syscall.SIGKILL); err != nil {
		t.Fatal(err)
	}
	_ = cmd.Wait()
	if m, _ := filepath.Glob(filepath.Join(dir, "u-*", "slab-1")); len(m) != 1 {
		t.Fatal("the killed helper's slab is not there to be swept")
	}
	if removed := removeStaleDirs(parent); !slices.Equal(removed, []string{dir}) {
		t.Errorf("after the kill removed %v, want [%s]", removed, dir)
	}
}

// holdSlabDir is the helper process: a backend with one slab, alive until
// killed (or its stdin closes).
func holdSlabDir(dir string) {
	b, err := NewHostBackend(HostBackendOptions{Dir: dir})
	if err != nil {
		os.Stderr.WriteString(err.Error() + "\n")
		os.Exit(1)
	}
	if _, err := b.Alloc(context.Background(), 0, Align, uint32(os.Getuid())); err != nil {
		os.Stderr.WriteString(err.Error() + "\n")
		os.Exit(1)
	}
	os.Stdout.WriteString("ready\n")
	_, _ = bufio.NewReader(os.Stdin).ReadString('\n')
	b.Close()
	os.Exit(0)
}

// Default directories are unique per backend, even in one process (one
// pid), and each start's sweep leaves the others alone.
func TestHostBackendDefaultDir(t *testing.T) {
	if fi, err := os.Stat(shmParent); err != nil || !fi.IsDir() {
		t.Skipf("no %s: %v", shmParent, err)
	}
	name := regexp.MustCompile(`^gdsfs-` + strconv.Itoa(os.Getpid()) + `-[0-9a-f]{12}$`)
	var dirs []string
	for range 2 {
		b, err := NewHostBackend(HostBackendOptions{})
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { b.Close() })
		if !name.MatchString(filepath.Base(b.Dir())) || filepath.Dir(b.Dir()) != shmParent {
			t.Errorf("default directory %s, want %s/gdsfs-<pid>-<12 hex>", b.Dir(), shmParent)
		}
		dirs = append(dirs, b.Dir())
	}
	if dirs[0] == dirs[1] {
		t.Fatalf("two backends share %s", dirs[0])
	}
	for _, d := range dirs {
		if !exists(filepath.Join(d, slabDirLock)) {
			t.Errorf("%s was swept by a later start", d)
		}
	}
}
