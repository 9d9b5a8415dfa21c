package logfile

import (
	"bytes"
	"os"
	"path/filepath"
	"testing"
)

func TestDefaultLogPath(t *testing.T) {
	t.Setenv("XDG_STATE_HOME", "/state")
	for _, c := range []struct {
		mp   string
		euid int
		want string
	}{
		{"/data", 0, "/var/log/gdsfs/data.log"},
		{"/mnt/data/", 0, "/var/log/gdsfs/mnt-data.log"},
		{"/mnt/my data", 1000, "/state/gdsfs/mnt-my_20data.log"},
		{"/mnt/a-b", 0, "/var/log/gdsfs/mnt-a_2db.log"}, // not the same name as /mnt/a/b
		{"/mnt/a/b", 0, "/var/log/gdsfs/mnt-a-b.log"},
		{"/.hidden", 0, "/var/log/gdsfs/_2ehidden.log"},
		{"/", 0, "/var/log/gdsfs/root.log"},
	} {
		got, err := DefaultPath(c.mp, c.euid)
		if err != nil || got != c.want {
			t.Errorf("DefaultPath(%q, %d) = %q, %v; want %q", c.mp, c.euid, got, err, c.want)
		}
	}
}

// TestRotatingFile: writes past the limit move the log to .1 and start a
// new file; no line is split or lost.
func TestRotatingFile(t *testing.T) {
	p := filepath.Join(t.TempDir(), "sub", "gdsfs.log")
	r, err := Open(p, 100, 0o600)
	if err != nil {
		t.Fatal(err)
	}
	line := bytes.Repeat([]byte("x"), 39)
	line = append(line, '\n')
	for i := 0; i < 5; i++ {
		if _, err := r.Write(line); err != nil {
			t.Fatal(err)
		}
	}
	if err := r.Close(); err != nil {
		t.Fatal(err)
	}
	cur, _ := os.ReadFile(p)
	old, _ := os.ReadFile(p + ".1")
	// 5 lines of 40 bytes, limit 100: [40 40] [40 40] rotated away to .1 twice, [40] current.
	if len(cur) != 40 || len(old) != 80 {
		t.Errorf("after 5 writes of 40 bytes with a 100-byte limit: current %d bytes, .1 %d bytes; want 40 and 80", len(cur), len(old))
	}
	if st, err := os.Stat(p); err != nil || st.Mode().Perm() != 0o600 {
		t.Errorf("log mode: %v, %v; want 0600", st.Mode().Perm(), err)
	}
}
