package fuseconn

import (
	"strings"
	"testing"

	"github.com/gdsfs/gdsfs/internal/mountinfo"
)

// TestDir: a connection's fusectl directory is named after the kernel's
// dev_t of the mount, as mountinfo gives it.
func TestDir(t *testing.T) {
	cases := []struct {
		line string
		want string
	}{
		{"49 27 0:46 / /m rw - fuse.gdsfs /s rw,user_id=0\n", "/sys/fs/fuse/connections/46"},
		{"49 27 0:1048575 / /m rw - fuse.gdsfs /s rw\n", "/sys/fs/fuse/connections/1048575"},
		{"51 27 8:17 / /u rw - fuseblk /dev/sdb1 rw\n", "/sys/fs/fuse/connections/8388625"},
	}
	for _, c := range cases {
		ms, err := mountinfo.Parse(strings.NewReader(c.line))
		if err != nil || len(ms) != 1 {
			t.Fatalf("Parse(%q): %v", c.line, err)
		}
		if got := Dir(ms[0].ConnID()); got != c.want {
			t.Errorf("%q: %s, want %s", c.line, got, c.want)
		}
	}
}

// TestAbortRefusesOtherFilesystems: only FUSE mounts have a connection.
func TestAbortRefusesOtherFilesystems(t *testing.T) {
	err := Abort(mountinfo.Entry{MountPoint: "/tmp", FSType: "tmpfs", Minor: 30})
	if err == nil || !strings.Contains(err.Error(), "no FUSE connection") {
		t.Errorf("Abort of tmpfs: %v", err)
	}
}
