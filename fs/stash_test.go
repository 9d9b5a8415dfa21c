package fs

import (
	"fmt"
	"os"
	"path/filepath"
	"testing"
	"time"

	"golang.org/x/sys/unix"
)

// TestReopenRenamedOver: a file the kernel resolved before another file
// was renamed over it through the mount still opens as itself, as on a
// local filesystem. An O_PATH descriptor holds the inode without an OPEN;
// reopening it through /proc sends the OPEN after the rename, for a name
// that now holds the other file (the kernel cannot look anything up again
// for it: ESTALE would reach the caller).
func TestReopenRenamedOver(t *testing.T) {
	mnt, _, _ := testMountWith(t, Options{EntryTimeout: time.Hour, AttrTimeout: time.Hour})
	for _, tc := range []struct {
		name  string
		flags int
	}{
		{"read", unix.O_RDONLY},
		{"write", unix.O_WRONLY},
	} {
		t.Run(tc.name, func(t *testing.T) {
			old, repl := filepath.Join(mnt, tc.name), filepath.Join(mnt, tc.name+".new")
			if err := os.WriteFile(old, []byte("old"), 0o644); err != nil {
				t.Fatal(err)
			}
			if err := os.WriteFile(repl, []byte("replacement"), 0o644); err != nil {
				t.Fatal(err)
			}
			held, err := unix.Open(old, unix.O_PATH|unix.O_CLOEXEC, 0)
			if err != nil {
				t.Fatal(err)
			}
			defer unix.Close(held)
			if err := os.Rename(repl, old); err != nil {
				t.Fatal(err)
			}
			fd, err := unix.Open(fmt.Sprintf("/proc/self/fd/%d", held), tc.flags|unix.O_CLOEXEC, 0)
			if err != nil {
				t.Fatalf("reopen the renamed-over file: %v", err)
			}
			defer unix.Close(fd)
			var st unix.Stat_t
			if err := unix.Fstat(fd, &st); err != nil || st.Size != int64(len("old")) {
				t.Errorf("reopened file: size %d (%v), want %d (the renamed-over file, not its replacement)", st.Size, err, len("old"))
			}
			if tc.flags == unix.O_RDONLY {
				buf := make([]byte, 32)
				n, err := unix.Read(fd, buf)
				if err != nil || string(buf[:n]) != "old" {
					t.Errorf("read the reopened file: %q, %v; want %q", buf[:n], err, "old")
				}
			}
		})
	}
}
