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
