package fs

import (
	"errors"
	"os"
	"path/filepath"
	"strings"
	"syscall"
	"testing"

	"golang.org/x/sys/unix"
)

func TestClearSetID(t *testing.T) {
	if os.Geteuid() != 0 {
		t.Skip("setting setuid bits on files of other owners needs root")
	}
	for _, c := range []struct {
		mode, want uint32
		uid        uint32
	}{
		{0o4777, 0o0777, 1000},
		{0o4755, 0o0755, 1000},
		{0o2775, 0o0775, 1000},
		{0o2765, 0o2765, 1000}, // setgid without group execute: a locking mark, kept
		{0o6777, 0o0777, 1000},
		{0o6777, 0o6777, 0}, // root holds CAP_FSETID
		{0o0644, 0o0644, 1000},
	} {
		p := filepath.Join(t.TempDir(), "f")
		if err := os.WriteFile(p, nil, 0o600); err != nil {
			t.Fatal(err)
		}
		if err := syscall.Chmod(p, c.mode); err != nil {
			t.Fatal(err)
		}
		f, err := os.OpenFile(p, os.O_WRONLY, 0)
		if err != nil {
			t.Fatal(err)
		}
		if err := ClearSetID(f, Caller{UID: c.uid, GID: c.uid}); err != nil {
			t.Errorf("mode %o uid %d: %v", c.mode, c.uid, err)
		}
		f.Close()
		var st syscall.Stat_t
		if err := syscall.Stat(p, &st); err != nil {
			t.Fatal(err)
		}
		if st.Mode&0o7777 != c.want {
			t.Errorf("mode %o written by uid %d: %o, want %o", c.mode, c.uid, st.Mode&0o7777, c.want)
		}
	}
}

// TestOpenRel: paths relative to the root resolve however long they are
// (in steps), never through a symlink, and never outside the root.
func TestOpenRel(t *testing.T) {
	root := t.TempDir()
	rfd, err := unix.Open(root, unix.O_PATH|unix.O_DIRECTORY|unix.O_CLOEXEC, 0)
	if err != nil {
		t.Fatal(err)
	}
	defer unix.Close(rfd)
	m := &mountState{rootFd: rfd}
	// A chain of 30 directories of 200 bytes: 6030 bytes, beyond PATH_MAX.
	var comps []string
	dfd, err := unix.Open(root, unix.O_PATH|unix.O_DIRECTORY|unix.O_CLOEXEC, 0)
	if err != nil {
		t.Fatal(err)
	}
	for i := range 30 {
		c := strings.Repeat(string(rune('a'+i%26)), 200)
		comps = append(comps, c)
		if err := unix.Mkdirat(dfd, c, 0o755); err != nil {
			t.Fatal(err)
		}
		nfd, err := unix.Openat(dfd, c, unix.O_PATH|unix.O_DIRECTORY|unix.O_CLOEXEC, 0)
		unix.Close(dfd)
		if err != nil {
			t.Fatal(err)
		}
		dfd = nfd
	}
	if err := unix.Symlinkat("/", dfd, "up"); err != nil {
		t.Fatal(err)
	}
	unix.Close(dfd)
	if err := os.Symlink(".", filepath.Join(root, "dot")); err != nil {
		t.Fatal(err)
	}
	deep := strings.Join(comps, "/")
	for _, c := range []struct {
		rel  string
		want error
	}{
		{"", nil},
		{comps[0], nil},
		{deep, nil},
		{deep + "/up", syscall.ELOOP},
		{deep + "/up/etc", syscall.ELOOP},
		{"dot/" + comps[0], syscall.ELOOP},
		{comps[0] + "/../..", syscall.EXDEV},
		{deep + "/missing", syscall.ENOENT},
	} {
		fd, err := m.openRel(c.rel, unix.O_PATH|unix.O_DIRECTORY)
		if err == nil {
			unix.Close(fd)
		}
		if !errors.Is(err, c.want) && (err != nil || c.want != nil) {
			t.Errorf("openRel(%.30q... %d bytes): %v, want %v", c.rel, len(c.rel), err, c.want)
		}
	}
}
