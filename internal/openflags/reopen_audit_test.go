package openflags

import (
	"bytes"
	"errors"
	"os"
	"path/filepath"
	"syscall"
	"testing"

	"golang.org/x/sys/unix"
)

// TestReopenIsTheOpenFile: a reopen acts on the file the descriptor
// opened, never on what its path names now: after a rename over the path,
// an unlink, a rename away with another file put at the path, or a symlink
// planted at the path (the backing file system is the oracle).
func TestReopenIsTheOpenFile(t *testing.T) {
	for _, tc := range []struct {
		name   string
		change func(t *testing.T, p string)
	}{
		{"renamed over", func(t *testing.T, p string) {
			if err := os.WriteFile(p+".new", []byte("other"), 0o600); err != nil {
				t.Fatal(err)
			}
			if err := os.Rename(p+".new", p); err != nil {
				t.Fatal(err)
			}
		}},
		{"unlinked", func(t *testing.T, p string) {
			if err := os.Remove(p); err != nil {
				t.Fatal(err)
			}
		}},
		{"renamed away, another file at the path", func(t *testing.T, p string) {
			if err := os.Rename(p, p+".away"); err != nil {
				t.Fatal(err)
			}
			if err := os.WriteFile(p, []byte("other"), 0o600); err != nil {
				t.Fatal(err)
			}
		}},
		{"a symlink at the path", func(t *testing.T, p string) {
			if err := os.WriteFile(p+".target", []byte("other"), 0o600); err != nil {
				t.Fatal(err)
			}
			if err := os.Remove(p); err != nil {
				t.Fatal(err)
			}
			if err := os.Symlink(p+".target", p); err != nil {
				t.Fatal(err)
			}
		}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			dir := t.TempDir()
			p := filepath.Join(dir, "f")
			if err := os.WriteFile(p, []byte("original"), 0o600); err != nil {
				t.Fatal(err)
			}
			f, err := os.OpenFile(p, os.O_RDWR, 0)
			if err != nil {
				t.Fatal(err)
			}
			defer f.Close()
			var want unix.Stat_t
			if err := unix.Fstat(int(f.Fd()), &want); err != nil {
				t.Fatal(err)
			}
			tc.change(t, p)
			r, err := Reopen(f, os.O_RDWR)
			if err != nil {
				t.Fatalf("Reopen: %v", err)
			}
			defer r.Close()
			var got unix.Stat_t
			if err := unix.Fstat(int(r.Fd()), &got); err != nil {
				t.Fatal(err)
			}
			if got.Dev != want.Dev || got.Ino != want.Ino {
				t.Fatalf("the reopen is inode %d, the descriptor's %d", got.Ino, want.Ino)
			}
			if _, err := r.WriteAt([]byte("REOPENED"), 0); err != nil {
				t.Fatal(err)
			}
			b := make([]byte, 8)
			if _, err := f.ReadAt(b, 0); err != nil || string(b) != "REOPENED" {
				t.Errorf("the descriptor's file reads %q, %v after a write through the reopen", b, err)
			}
			for _, q := range []string{p, p + ".target"} {
				if b, err := os.ReadFile(q); err == nil && bytes.Contains(b, []byte("REOPENED")) {
					t.Errorf("the write through the reopen reached %s", q)
				}
			}
		})
	}
}

// TestReopenNeverWidens: whatever its caller asks, Reopen (root, through
// /proc/self/fd, where the kernel checks no permission the descriptor did
// not) grants no access the descriptor lacks: no write through a
// read-only one, no read through a write-only one, no positional write
// through an appending one, nothing through an O_PATH one.
func TestReopenNeverWidens(t *testing.T) {
	p := filepath.Join(t.TempDir(), "f")
	if err := os.WriteFile(p, []byte("x"), 0o600); err != nil {
		t.Fatal(err)
	}
	for _, tc := range []struct {
		name      string
		open, ask int
		ok        bool
	}{
		{"read-only as read-only", os.O_RDONLY, os.O_RDONLY, true},
		{"read-write as read-only", os.O_RDWR, os.O_RDONLY, true},
		{"read-write as write-only", os.O_RDWR, os.O_WRONLY, true},
		{"read-only as read-write", os.O_RDONLY, os.O_RDWR, false},
		{"read-only as write-only", os.O_RDONLY, os.O_WRONLY, false},
		{"write-only as read-only", os.O_WRONLY, os.O_RDONLY, false},
		{"write-only as read-write", os.O_WRONLY, os.O_RDWR, false},
		{"appending as positional", os.O_WRONLY | os.O_APPEND, os.O_WRONLY, false},
		{"appending as appending", os.O_WRONLY | os.O_APPEND, os.O_WRONLY | os.O_APPEND, true},
		{"O_PATH as read-only", unix.O_PATH, os.O_RDONLY, false},
		{"read-only with O_TRUNC", os.O_RDWR, os.O_RDWR | os.O_TRUNC, false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			f, err := os.OpenFile(p, tc.open, 0)
			if err != nil {
				t.Fatal(err)
			}
			defer f.Close()
			r, err := Reopen(f, tc.ask)
			if err == nil {
				r.Close()
			}
			if tc.ok && err != nil {
				t.Errorf("Reopen(open %#x, %#x): %v", tc.open, tc.ask, err)
			}
			if !tc.ok && !errors.Is(err, syscall.EACCES) {
				t.Errorf("Reopen(open %#x, %#x) = %v, want EACCES (no wider than the descriptor)", tc.open, tc.ask, err)
			}
		})
	}
	if b, err := os.ReadFile(p); err != nil || string(b) != "x" {
		t.Errorf("the file reads %q, %v: a refused reopen changed it", b, err)
	}
}
