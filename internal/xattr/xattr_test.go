package xattr

import (
	"bytes"
	"errors"
	"os"
	"path/filepath"
	"syscall"
	"testing"

	"golang.org/x/sys/unix"
)

func TestGet(t *testing.T) {
	p := filepath.Join(t.TempDir(), "f")
	if err := os.WriteFile(p, nil, 0o600); err != nil {
		t.Fatal(err)
	}
	if err := unix.Setxattr(p, "user.probe", []byte("x"), 0); err != nil {
		t.Skipf("user xattrs on %s: %v", p, err)
	}
	grown := false
	for _, n := range []int{0, 1, 3000, 4096, 4097, 60000} { // around the first buffer's size
		v := bytes.Repeat([]byte{'v'}, n)
		if err := unix.Setxattr(p, "user.gdsfs.test", v, 0); err != nil {
			// ext4 keeps values within one block: larger ones need
			// ea_inode. What was set is still checked.
			if errors.Is(err, syscall.ENOSPC) || errors.Is(err, syscall.E2BIG) {
				t.Logf("%s holds no %d-byte attribute: %v", p, n, err)
				continue
			}
			t.Fatalf("set %d bytes: %v", n, err)
		}
		grown = grown || n > 4096
		got, err := Get(p, "user.gdsfs.test")
		if err != nil || !bytes.Equal(got, v) {
			t.Errorf("Get of a %d-byte value = %d bytes, %v", n, len(got), err)
		}
	}
	if !grown {
		t.Logf("no value over 4 KiB could be set here: the buffer's growth went unchecked")
	}
	if _, err := Get(p, "user.none"); !errors.Is(err, syscall.ENODATA) {
		t.Errorf("Get of a missing attribute: %v, want ENODATA", err)
	}
	if _, err := Get(filepath.Join(p, "nope"), "user.gdsfs.test"); !errors.Is(err, syscall.ENOTDIR) && !errors.Is(err, syscall.ENOENT) {
		t.Errorf("Get under a file: %v, want ENOTDIR or ENOENT", err)
	}
}
