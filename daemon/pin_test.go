package daemon

import (
	"errors"
	"os"
	"path/filepath"
	"strings"
	"syscall"
	"testing"

	"github.com/gdsfs/gdsfs/internal/fuseconn"
	"github.com/gdsfs/gdsfs/internal/mountinfo"
)

// mountTmpfs mounts a tmpfs at dir (this test's own) and returns its entry;
// it is detached when the test ends if it is still there.
func mountTmpfs(t *testing.T, dir string) mountinfo.Entry {
	t.Helper()
	if err := syscall.Mount("review3", dir, "tmpfs", 0, "size=64k"); err != nil {
		t.Fatalf("mount tmpfs at %s: %v", dir, err)
	}
	m, ok, err := mountinfo.At(dir)
	if err != nil || !ok || m.FSType != "tmpfs" {
		syscall.Unmount(dir, syscall.MNT_DETACH)
		t.Fatalf("tmpfs at %s not in the mount table: %+v %v %v", dir, m, ok, err)
	}
	t.Cleanup(func() {
		for {
			cur, ok, _ := mountinfo.At(dir)
			if !ok || cur.ID != m.ID {
				return
			}
			if syscall.Unmount(dir, syscall.MNT_DETACH) != nil {
				return
			}
		}
	})
	return m
}

// asGone is m as a FUSE mount whose connection does not exist (no real
// device has major 4000), so that the code under test can abort nothing.
func asGone(m mountinfo.Entry) mountinfo.Entry {
	m.FSType, m.Major = mountinfo.GDSFSType, 4000
	return m
}

// TestAbortAndDetachActsOnTheCheckedMountOnly: the mount gdsfs unmount
// --force read from the mount table (then probed, for up to 2 s) may be
// gone by the time it aborts and detaches: unmounted and replaced by
// another mount at the same path, or its path now leading elsewhere
// through a symbolic link a user put in a directory of theirs. The
// mount now there is left alone, with an error naming the mount point.
func TestAbortAndDetachActsOnTheCheckedMountOnly(t *testing.T) {
	if os.Geteuid() != 0 {
		t.Skip("needs root: mounts tmpfs")
	}
	cases := []struct {
		name string
		// stale returns the entry read before the change, with the
		// mount now at its path.
		stale func(t *testing.T, dir string) (old mountinfo.Entry, now string)
	}{
		{"replaced at the same path", func(t *testing.T, dir string) (mountinfo.Entry, string) {
			mp := filepath.Join(dir, "m")
			os.Mkdir(mp, 0o755)
			old := mountTmpfs(t, mp)
			if err := syscall.Unmount(mp, 0); err != nil {
				t.Fatal(err)
			}
			mountTmpfs(t, mp)
			return asGone(old), mp
		}},
		{"path now through a symlink", func(t *testing.T, dir string) (mountinfo.Entry, string) {
			real := filepath.Join(dir, "real", "m")
			os.MkdirAll(real, 0o755)
			m := mountTmpfs(t, real)
			if err := os.Symlink(filepath.Join(dir, "real"), filepath.Join(dir, "link")); err != nil {
				t.Fatal(err)
			}
			m.MountPoint = filepath.Join(dir, "link", "m") // as the table said before a rename
			return asGone(m), real
		}},
		{"overmounted", func(t *testing.T, dir string) (mountinfo.Entry, string) {
			mp := filepath.Join(dir, "m")
			os.Mkdir(mp, 0o755)
			under := mountTmpfs(t, mp)
			mountTmpfs(t, mp)
			return asGone(under), mp
		}},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			dir := t.TempDir()
			old, now := c.stale(t, dir)
			before, _, _ := mountinfo.At(now)
			err := abortAndDetach(old)
			if !errors.Is(err, fuseconn.ErrChanged) || !strings.Contains(err.Error(), old.MountPoint) {
				t.Errorf("abortAndDetach of a mount that is gone: %v, want an error naming %s that it changed", err, old.MountPoint)
			}
			if after, ok, _ := mountinfo.At(now); !ok || after.ID != before.ID {
				t.Errorf("the mount now at %s was detached: before %+v, after %+v (%v)", now, before, after, ok)
			}
		})
	}
}

// TestPinnedDetach: a pinned mount is detached through its pin's path,
// and a pin of the current entry succeeds.
func TestPinnedDetach(t *testing.T) {
	if os.Geteuid() != 0 {
		t.Skip("needs root: mounts tmpfs")
	}
	mp := filepath.Join(t.TempDir(), "with space")
	os.Mkdir(mp, 0o755)
	m := mountTmpfs(t, mp)
	pin, err := fuseconn.Pin(m)
	if err != nil {
		t.Fatalf("Pin(%+v): %v", m, err)
	}
	defer pin.Close()
	if err := syscall.Unmount(pin.Path(), syscall.MNT_DETACH); err != nil {
		t.Fatalf("detach through %s: %v", pin.Path(), err)
	}
	if cur, ok, _ := mountinfo.At(mp); ok && cur.ID == m.ID {
		t.Errorf("%s still mounted after the detach", mp)
	}
}
