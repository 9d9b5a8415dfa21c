package fs

import (
	"context"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/rs/zerolog"
	"golang.org/x/sys/unix"
)

// TestUnlinkedLockedFileFreesSpace: a file removed through the mount while
// processes hold POSIX locks and a flock on it, and one waits for a lock,
// gives its space back once they have closed it or been killed (one of
// them taking its first lock after the removal): the
// daemon's lock descriptors of the file do not outlive its opens. The
// backing directory is a small tmpfs, whose free blocks are the oracle.
func TestUnlinkedLockedFileFreesSpace(t *testing.T) {
	if os.Geteuid() != 0 {
		t.Skip("mounting in tests needs root (CI runs as root)")
	}
	dir := t.TempDir()
	for d := dir; d != "/" && d != os.TempDir(); d = filepath.Dir(d) {
		if err := os.Chmod(d, 0o755); err != nil {
			t.Fatal(err)
		}
	}
	backing, mnt := filepath.Join(dir, "backing"), filepath.Join(dir, "mnt")
	for _, d := range []string{backing, mnt} {
		if err := os.Mkdir(d, 0o755); err != nil {
			t.Fatal(err)
		}
	}
	if err := unix.Mount("tmpfs", backing, "tmpfs", 0, "size=64m,mode=0777"); err != nil {
		t.Skipf("mount tmpfs: %v", err)
	}
	t.Cleanup(func() { unix.Unmount(backing, unix.MNT_DETACH) })
	srv, err := Mount(context.Background(), Options{Source: backing, Mountpoint: mnt, AllowOther: true, Logger: zerolog.Nop()})
	if err != nil {
		t.Fatalf("Mount: %v", err)
	}
	t.Cleanup(func() {
		if err := srv.Unmount(); err != nil {
			t.Errorf("unmount: %v", err)
			srv.UnmountLazy()
		}
		srv.Wait()
	})
	free := func() uint64 {
		var st unix.Statfs_t
		if err := unix.Statfs(backing, &st); err != nil {
			t.Fatal(err)
		}
		return st.Bfree * uint64(st.Bsize)
	}
	empty := free()
	const size = 32 << 20
	f := filepath.Join(backing, "f")
	if err := os.WriteFile(f, make([]byte, size), 0o666); err != nil {
		t.Fatal(err)
	}
	if err := os.Chmod(f, 0o666); err != nil {
		t.Fatal(err)
	}
	if free() > empty-size/2 {
		t.Fatalf("tmpfs free %d after writing %d bytes (was %d)", free(), size, empty)
	}
	steps := []lkStep{
		lkOpen("A", "a", "f", "rw"),
		lkSet("A", "a", wr, 0, 100),
		lkOpen("A", "r", "f", "r"),
		lkSet("A", "r", rd, 200, 100),
		lkFlock("A", "r", unix.LOCK_SH),
		lkOpen("C", "c", "f", "r"),
		lkOpen("B", "b", "f", "rw"),
		lkAsync(lk("B", "b", cmdSetlkw, wr, 0, 0, 10)),
		lkBlocked("B"),
		{who: "C", do: []any{"unlink", "f"}},
		lkSet("C", "c", rd, 400, 10), // a new owner's descriptor of the removed file
		lkClose("C", "c"),
		lkKill("A"),
		lkAwait("B"),
		lkKill("B"),
	}
	got := runLockScenario(t, mnt, steps, func(pid int) bool { return srv.m.lockWaits.waiting(uint32(pid)) })
	for _, g := range got {
		if !strings.HasSuffix(g, `-> "ok"`) && !strings.HasSuffix(g, `-> killed`) && !strings.HasSuffix(g, `-> blocked`) {
			t.Errorf("step %s", g)
		}
	}
	deadline := time.Now().Add(lockAgentPatience)
	for free() < empty-size/2 {
		if time.Now().After(deadline) {
			t.Fatalf("tmpfs free %d of %d after every process closed or died: the removed file's blocks are held (%d lock owners left)", free(), empty, srv.m.lockOwners.Load())
		}
		time.Sleep(5 * time.Millisecond)
	}
	if n := srv.m.lockOwners.Load(); n != 0 {
		t.Errorf("%d lock owners left", n)
	}
}
