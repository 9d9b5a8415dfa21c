package fs

import (
	"os"
	"path/filepath"
	"slices"
	"sync"
	"syscall"
	"testing"

	"golang.org/x/sys/unix"
)

// TestRemovedReported: Options.Removed is told, before the request
// returns, the identity of each regular file whose name the daemon removed
// (what cuFile's handle cache needs to free a deleted checkpoint at once),
// and of nothing else.
func TestRemovedReported(t *testing.T) {
	type ident [2]uint64
	var mu sync.Mutex
	var got []ident
	mnt, backing, _ := testMountWith(t, Options{Removed: func(dev, ino uint64) {
		mu.Lock()
		defer mu.Unlock()
		got = append(got, ident{dev, ino})
	}})
	b := func(n string) string { return filepath.Join(backing, n) }
	m := func(n string) string { return filepath.Join(mnt, n) }
	idOf := func(n string) ident {
		var st syscall.Stat_t
		if err := syscall.Lstat(b(n), &st); err != nil {
			t.Fatal(err)
		}
		return ident{uint64(st.Dev), st.Ino}
	}
	for _, n := range []string{"a", "b", "c", "d", "x1", "x2"} {
		if err := os.WriteFile(b(n), []byte(n), 0o644); err != nil {
			t.Fatal(err)
		}
	}
	if err := os.Mkdir(b("dir"), 0o755); err != nil {
		t.Fatal(err)
	}
	if err := os.Symlink("a", b("sym")); err != nil {
		t.Fatal(err)
	}
	tests := []struct {
		name   string
		victim string // the name whose file must be reported, "" for none
		op     func() error
	}{
		{"unlink", "a", func() error { return os.Remove(m("a")) }},
		{"rename over", "c", func() error { return os.Rename(m("b"), m("c")) }},
		{"rename to a new name", "", func() error { return os.Rename(m("c"), m("e")) }},
		{"exchange", "", func() error {
			return unix.Renameat2(unix.AT_FDCWD, m("x1"), unix.AT_FDCWD, m("x2"), unix.RENAME_EXCHANGE)
		}},
		{"rmdir", "", func() error { return os.Remove(m("dir")) }},
		{"unlink a symlink", "", func() error { return os.Remove(m("sym")) }},
		{"failed unlink", "", func() error {
			if err := os.Remove(m("missing")); err == nil {
				t.Error("removing a missing name succeeded")
			}
			return nil
		}},
	}
	for _, tc := range tests {
		var want []ident
		if tc.victim != "" {
			want = []ident{idOf(tc.victim)}
		}
		mu.Lock()
		got = nil
		mu.Unlock()
		if err := tc.op(); err != nil {
			t.Fatalf("%s: %v", tc.name, err)
		}
		mu.Lock()
		if !slices.Equal(got, want) {
			t.Errorf("%s: Removed told %v, want %v", tc.name, got, want)
		}
		mu.Unlock()
	}
}
