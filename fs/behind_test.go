package fs

import (
	"errors"
	"os"
	"path/filepath"
	"syscall"
	"testing"
	"time"
)

// TestChangesBehindMountWithLongTimeouts: what docs/operations.md promises
// about changes made directly in the backing directory while the kernel
// caches names and attributes for an hour: a new file is seen at once (no
// negative entries are cached), a removed file cannot be opened, and a
// replaced file opens as the new one (the daemon answers ESTALE for the
// old node and the kernel looks the name up again). Only a stat without
// an open may show a removed or replaced file's old attributes, until the
// timeouts.
func TestChangesBehindMountWithLongTimeouts(t *testing.T) {
	mnt, backing, _ := testMountWith(t, Options{EntryTimeout: time.Hour, AttrTimeout: time.Hour})
	for _, name := range []string{"removed", "replaced"} {
		if err := os.WriteFile(filepath.Join(backing, name), []byte("old"), 0o644); err != nil {
			t.Fatal(err)
		}
		if got, err := os.ReadFile(filepath.Join(mnt, name)); err != nil || string(got) != "old" {
			t.Fatalf("read %s: %q, %v", name, got, err)
		}
	}
	var st syscall.Stat_t
	if err := syscall.Lstat(filepath.Join(mnt, "new"), &st); !errors.Is(err, syscall.ENOENT) {
		t.Fatalf("lstat of a missing name: %v, want ENOENT", err)
	}

	if err := os.WriteFile(filepath.Join(backing, "new"), []byte("new"), 0o644); err != nil {
		t.Fatal(err)
	}
	if err := os.Remove(filepath.Join(backing, "removed")); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(backing, "replaced.tmp"), []byte("replacement"), 0o644); err != nil {
		t.Fatal(err)
	}
	if err := os.Rename(filepath.Join(backing, "replaced.tmp"), filepath.Join(backing, "replaced")); err != nil {
		t.Fatal(err)
	}

	if got, err := os.ReadFile(filepath.Join(mnt, "new")); err != nil || string(got) != "new" {
		t.Errorf("read a file created behind the mount: %q, %v; want %q at once", got, err, "new")
	}
	if f, err := os.Open(filepath.Join(mnt, "removed")); !errors.Is(err, syscall.ENOENT) {
		if f != nil {
			f.Close()
		}
		t.Errorf("open a file removed behind the mount: %v, want ENOENT at once", err)
	}
	if got, err := os.ReadFile(filepath.Join(mnt, "replaced")); err != nil || string(got) != "replacement" {
		t.Errorf("read a file replaced behind the mount: %q, %v; want %q at once", got, err, "replacement")
	}
}
