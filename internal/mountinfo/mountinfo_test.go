package mountinfo

import (
	"errors"
	"strings"
	"testing"
)

func TestParseMountinfo(t *testing.T) {
	in := `22 1 8:1 / / rw,relatime shared:1 - ext4 /dev/sda1 rw
36 35 98:0 /mnt1 /mnt/with\040space rw,noatime master:1 shared:2 - ext3 /dev/root rw,errors=continue
40 22 0:50 / /tmp/x rw,nosuid,nodev,relatime - fuse.gdsfs /data/src rw,user_id=0,group_id=0
41 22 0:51 / /tmp/y rw - tmpfs tmp\134fs rw
`
	got, err := Parse(strings.NewReader(in))
	if err != nil {
		t.Fatal(err)
	}
	want := []Entry{
		{ID: 22, MountPoint: "/", FSType: "ext4", Source: "/dev/sda1", Major: 8, Minor: 1, SuperOptions: "rw"},
		{ID: 36, MountPoint: "/mnt/with space", FSType: "ext3", Source: "/dev/root", Major: 98, SuperOptions: "rw,errors=continue"},
		{ID: 40, MountPoint: "/tmp/x", FSType: "fuse.gdsfs", Source: "/data/src", Minor: 50, SuperOptions: "rw,user_id=0,group_id=0"},
		{ID: 41, MountPoint: "/tmp/y", FSType: "tmpfs", Source: `tmp\fs`, Minor: 51, SuperOptions: "rw"},
	}
	if len(got) != len(want) {
		t.Fatalf("got %d entries, want %d: %+v", len(got), len(want), got)
	}
	for i := range want {
		if got[i] != want[i] {
			t.Errorf("entry %d: got %+v, want %+v", i, got[i], want[i])
		}
	}
	for _, bad := range []string{"1 2 3\n", "1 2 3 4 5 6 7 8 9\n", "1 2 0:1 / /x rw - ext4\n",
		"1 2 01 / /x rw - ext4 src rw\n", "1 2 0:x / /x rw - ext4 src rw\n", "1 2 :1 / /x rw - ext4 src rw\n",
		"1 2 0:4294967296 / /x rw - ext4 src rw\n",
		"x 2 0:1 / /x rw - ext4 src rw\n", "-1 2 0:1 / /x rw - ext4 src rw\n"} {
		if _, err := Parse(strings.NewReader(bad)); !errors.Is(err, ErrMalformed) {
			t.Errorf("Parse(%q): %v, want ErrMalformed", bad, err)
		}
	}
}

func FuzzParseMountinfo(f *testing.F) {
	f.Add("22 1 8:1 / / rw,relatime shared:1 - ext4 /dev/sda1 rw\n")
	f.Add("36 35 98:0 /mnt1 /mnt/a\\040b rw master:1 - ext3 /dev/root rw\n")
	f.Add("1 2 3 4 5 6 - \n")
	f.Add("\\")
	f.Fuzz(func(t *testing.T, s string) {
		ms, err := Parse(strings.NewReader(s))
		if err != nil && ms != nil {
			t.Fatal("entries returned with an error")
		}
		for _, m := range ms {
			if m.FSType == "" {
				t.Fatalf("empty fstype in %+v", m)
			}
		}
	})
}

func TestUnescapeMountinfo(t *testing.T) {
	for in, want := range map[string]string{
		`a\040b`:   "a b",
		`a\011b`:   "a\tb",
		`a\134`:    `a\`,
		`trail\`:   `trail\`,
		`\04`:      `\04`,
		`\999x`:    `\999x`,
		`plain`:    "plain",
		`\040\040`: "  ",
	} {
		if got := unescape(in); got != want {
			t.Errorf("unescape(%q) = %q, want %q", in, got, want)
		}
	}
}

// TestMountConnection: a FUSE mount's connection number (its directory
// under /sys/fs/fuse/connections) and owner come from its mountinfo line
// alone: the kernel's dev_t of the superblock, and user_id=.
func TestMountConnection(t *testing.T) {
	cases := []struct {
		line    string
		conn    uint64
		uid     int
		hasUID  bool
		fstype  string
		options string
	}{
		{"49 27 0:46 / /tmp/m rw,nosuid,nodev,relatime - fuse.gdsfs /src rw,user_id=0,group_id=0,default_permissions,allow_other,max_read=1048576\n",
			46, 0, true, "fuse.gdsfs", "rw,user_id=0,group_id=0,default_permissions,allow_other,max_read=1048576"},
		{"50 27 0:1234 / /home/u/m rw - fuse.gdsfs /home/u/src rw,user_id=10001,group_id=10001\n",
			1234, 10001, true, "fuse.gdsfs", "rw,user_id=10001,group_id=10001"},
		// fuseblk: a real block device's major is part of the number.
		{"51 27 8:17 / /mnt/usb rw - fuseblk /dev/sdb1 rw,user_id=0,group_id=0,allow_other,blksize=4096\n",
			8<<20 | 17, 0, true, "fuseblk", "rw,user_id=0,group_id=0,allow_other,blksize=4096"},
		{"52 27 0:30 / /tmp rw - tmpfs tmpfs rw,size=100k\n", 30, 0, false, "tmpfs", "rw,size=100k"},
		// user_id= that is no number, or a lookalike option, is no owner.
		{"53 27 0:31 / /x rw - fuse.x src rw,user_id=abc,xuser_id=5\n", 31, 0, false, "fuse.x", "rw,user_id=abc,xuser_id=5"},
		// No super options at all.
		{"54 27 0:32 / /y rw - fuse.y src\n", 32, 0, false, "fuse.y", ""},
	}
	for _, c := range cases {
		ms, err := Parse(strings.NewReader(c.line))
		if err != nil || len(ms) != 1 {
			t.Fatalf("Parse(%q): %v, %d entries", c.line, err, len(ms))
		}
		m := ms[0]
		if got := m.ConnID(); got != c.conn {
			t.Errorf("%q: connection %d, want %d", c.line, got, c.conn)
		}
		if uid, ok := m.UserID(); uid != c.uid || ok != c.hasUID {
			t.Errorf("%q: user %d, %v; want %d, %v", c.line, uid, ok, c.uid, c.hasUID)
		}
		if m.FSType != c.fstype || m.SuperOptions != c.options {
			t.Errorf("%q: type %q options %q", c.line, m.FSType, m.SuperOptions)
		}
	}
}
