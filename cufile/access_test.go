package cufile

import (
	"os"
	"path/filepath"
	"testing"

	"golang.org/x/sys/unix"
)

// TestOpenDirectKeepsAccessMode: the O_DIRECT twin of a descriptor has the
// descriptor's own access mode, and a write-only descriptor gets none (the
// daemon runs as root: a read-only reopen of a write-only descriptor would
// read a file its caller cannot).
func TestOpenDirectKeepsAccessMode(t *testing.T) {
	p := filepath.Join(t.TempDir(), "f")
	if err := os.WriteFile(p, make([]byte, 1<<20), 0o600); err != nil {
		t.Fatal(err)
	}
	for _, tc := range []struct {
		name string
		flag int
		want int // access mode of the twin; -1: no twin
	}{
		{"read-only", os.O_RDONLY, unix.O_RDONLY},
		{"read-write", os.O_RDWR, unix.O_RDWR},
		{"write-only", os.O_WRONLY, -1},
	} {
		t.Run(tc.name, func(t *testing.T) {
			f, err := os.OpenFile(p, tc.flag, 0)
			if err != nil {
				t.Fatal(err)
			}
			defer f.Close()
			d := openDirect(f)
			if tc.want < 0 {
				if d != nil {
					d.Close()
					t.Fatal("a write-only descriptor got an O_DIRECT twin")
				}
				return
			}
			if d == nil {
				t.Skip("the filesystem of the test directory refuses O_DIRECT")
			}
			defer d.Close()
			mode, err := accessMode(d)
			if err != nil {
				t.Fatal(err)
			}
			if mode != tc.want {
				t.Errorf("twin access mode %#o, want %#o", mode, tc.want)
			}
		})
	}
}
