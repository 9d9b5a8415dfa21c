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
		// The fallback for kernels without openat2 agrees (it takes
		// paths of any length).
		rel := c.rel
		if rel == "" {
			rel = "."
		}
		fd, err = openWalk(rfd, rel, unix.O_PATH|unix.O_DIRECTORY)
		if err == nil {
			unix.Close(fd)
		}
		if !errors.Is(err, c.want) && (err != nil || c.want != nil) {
			t.Errorf("openWalk(%.30q... %d bytes): %v, want %v", c.rel, len(c.rel), err, c.want)
		}
	}
}

// TestCreators: inodes made on the creator threads belong to the caller
// (the directory's group in a setgid directory), have exactly the mode
// given (no umask), and the process's own umask and credentials are left
// alone.
func TestCreators(t *testing.T) {
	if os.Geteuid() != 0 {
		t.Skip("switching filesystem credentials needs root")
	}
	before := syscall.Umask(0o027)
	syscall.Umask(before)
	c, err := newCreators()
	if err != nil {
		t.Fatal(err)
	}
	if !c.asCaller {
		t.Fatal("root could not switch credentials (SECBIT_NO_SETUID_FIXUP)")
	}
	dir := t.TempDir()
	if err := os.Chmod(dir, 0o755); err != nil { // writable by root only: caps must be kept
		t.Fatal(err)
	}
	sg := filepath.Join(dir, "sg")
	if err := os.Mkdir(sg, 0o755); err != nil {
		t.Fatal(err)
	}
	if err := os.Chown(sg, 0, 4321); err != nil {
		t.Fatal(err)
	}
	if err := syscall.Chmod(sg, 0o2755); err != nil {
		t.Fatal(err)
	}
	caller := Caller{UID: 10001, GID: 10001}
	for _, x := range []struct {
		path     string
		mode     uint32
		wantMode uint32
		wantGID  uint32
	}{
		{filepath.Join(dir, "f"), 0o4777, 0o4777, 10001},
		{filepath.Join(dir, "z"), 0, 0, 10001},
		{filepath.Join(sg, "f"), 0o666, 0o666, 4321},
	} {
		if _, err := c.do(caller, func() error {
			fd, err := unix.Open(x.path, unix.O_CREAT|unix.O_EXCL|unix.O_WRONLY|unix.O_CLOEXEC, x.mode)
			if err == nil {
				unix.Close(fd)
			}
			return err
		}); err != nil {
			t.Fatalf("create %s: %v", x.path, err)
		}
		var st syscall.Stat_t
		if err := syscall.Stat(x.path, &st); err != nil {
			t.Fatal(err)
		}
		if st.Uid != caller.UID || st.Gid != x.wantGID || st.Mode&0o7777 != x.wantMode {
			t.Errorf("%s: uid %d gid %d mode %o; want uid %d gid %d mode %o", x.path, st.Uid, st.Gid, st.Mode&0o7777, caller.UID, x.wantGID, x.wantMode)
		}
	}
	// The test process (other threads) keeps its umask and identity.
	after := syscall.Umask(0o027)
	syscall.Umask(after)
	if after != before || os.Geteuid() != 0 {
		t.Errorf("process umask %o (was %o), euid %d after creations: the creator threads leaked their state", after, before, os.Geteuid())
	}
	c.close()
	if _, err := c.do(caller, func() error { return nil }); !errors.Is(err, syscall.EIO) {
		t.Errorf("do after close: %v, want EIO", err)
	}
}
