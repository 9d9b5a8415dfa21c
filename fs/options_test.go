package fs

import (
	"context"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"
)

func TestOptionsValidate(t *testing.T) {
	cases := []struct {
		name string
		o    Options
		want []string // substrings of the error; none means valid
	}{
		{"ok source", Options{Source: "/a", Mountpoint: "/b"}, nil},
		{"ok overmount", Options{Mountpoint: "/b"}, nil},
		{"no mountpoint", Options{Source: "/a"}, []string{"Mountpoint is empty"}},
		{"source is mountpoint", Options{Source: "/b/", Mountpoint: "/b"}, []string{"equals Mountpoint"}},
	}
	for _, c := range cases {
		err := c.o.Validate()
		if (err == nil) != (c.want == nil) {
			t.Errorf("%s: Validate() = %v, want errors %q", c.name, err, c.want)
			continue
		}
		for _, w := range c.want {
			if !strings.Contains(err.Error(), w) {
				t.Errorf("%s: Validate() = %v, want it to mention %q", c.name, err, w)
			}
		}
	}
}

func TestTimeoutDefaults(t *testing.T) {
	for _, c := range []struct{ in, want time.Duration }{
		{0, DefaultAttrTimeout},
		{-1, 0},
		{3 * time.Second, 3 * time.Second},
	} {
		if got := timeout(c.in, DefaultAttrTimeout); got != c.want {
			t.Errorf("timeout(%v) = %v, want %v", c.in, got, c.want)
		}
	}
}

func TestMountErrors(t *testing.T) {
	dir := t.TempDir()
	file := filepath.Join(dir, "file")
	if err := os.WriteFile(file, nil, 0o644); err != nil {
		t.Fatal(err)
	}
	cases := []struct {
		name string
		o    Options
		want string
	}{
		{"missing source", Options{Source: filepath.Join(dir, "nope"), Mountpoint: dir}, "open backing directory"},
		{"missing overmount dir", Options{Mountpoint: filepath.Join(dir, "nope")}, "to overmount it"},
		{"overmount a file", Options{Mountpoint: file}, "not a directory"},
	}
	for _, c := range cases {
		srv, err := Mount(context.Background(), c.o)
		if err == nil {
			srv.Unmount()
			srv.Wait()
			t.Errorf("%s: Mount succeeded", c.name)
			continue
		}
		if !strings.Contains(err.Error(), c.want) {
			t.Errorf("%s: Mount error %q, want it to mention %q", c.name, err, c.want)
		}
	}
}
