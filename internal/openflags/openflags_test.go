package openflags

import (
	"os"
	"path/filepath"
	"testing"

	"golang.org/x/sys/unix"
)

// TestAccess: each access mode of open(2) reads back as itself, and a
// closed file is neither readable nor writable.
func TestAccess(t *testing.T) {
	p := filepath.Join(t.TempDir(), "f")
	if err := os.WriteFile(p, []byte("x"), 0o600); err != nil {
		t.Fatal(err)
	}
	for _, tc := range []struct {
		flag               int
		readable, writable bool
	}{
		{os.O_RDONLY, true, false},
		{os.O_WRONLY, false, true},
		{os.O_RDWR, true, true},
	} {
		f, err := os.OpenFile(p, tc.flag|os.O_APPEND, 0)
		if err != nil {
			t.Fatal(err)
		}
		m, err := AccessMode(f)
		if err != nil || m != tc.flag {
			t.Errorf("AccessMode of open(%#x) = %#x, %v", tc.flag, m, err)
		}
		if fl, err := Of(f); err != nil || fl&unix.O_APPEND == 0 {
			t.Errorf("Of(open(%#x|O_APPEND)) = %#x, %v: no O_APPEND", tc.flag, fl, err)
		}
		if Readable(f) != tc.readable || Writable(f) != tc.writable {
			t.Errorf("open(%#x): readable %v, writable %v; want %v, %v", tc.flag, Readable(f), Writable(f), tc.readable, tc.writable)
		}
		f.Close()
		if Readable(f) || Writable(f) {
			t.Errorf("open(%#x), closed: still readable or writable", tc.flag)
		}
		if _, err := Of(f); err == nil {
			t.Errorf("Of of a closed file: no error")
		}
	}
}

// TestReopen: a reopen is the same file with the flags asked for (and
// close-on-exec), independent of the original's offset; a closed file
// cannot be reopened.
func TestReopen(t *testing.T) {
	p := filepath.Join(t.TempDir(), "f")
	if err := os.WriteFile(p, []byte("hello"), 0o600); err != nil {
		t.Fatal(err)
	}
	f, err := os.Open(p)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := f.Seek(3, 0); err != nil {
		t.Fatal(err)
	}
	r, err := Reopen(f, os.O_RDONLY)
	if err != nil {
		t.Fatalf("Reopen: %v", err)
	}
	defer r.Close()
	b := make([]byte, 5)
	if n, err := r.Read(b); err != nil || string(b[:n]) != "hello" {
		t.Errorf("reopened file reads %q, %v; want the whole file from its start", b[:n], err)
	}
	if fl, err := Of(r); err != nil || fl&unix.O_ACCMODE != unix.O_RDONLY {
		t.Errorf("reopened flags %#x, %v; want O_RDONLY", fl, err)
	}
	if fd, err := unix.FcntlInt(r.Fd(), unix.F_GETFD, 0); err != nil || fd&unix.FD_CLOEXEC == 0 {
		t.Errorf("reopened descriptor flags %#x, %v; want FD_CLOEXEC", fd, err)
	}
	f.Close()
	if r2, err := Reopen(f, os.O_RDONLY); err == nil {
		r2.Close()
		t.Error("Reopen of a closed file succeeded")
	}
}
