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
		{"/", "ext4", "/dev/sda1"},
		{"/mnt/with space", "ext3", "/dev/root"},
		{"/tmp/x", "fuse.gdsfs", "/data/src"},
		{"/tmp/y", "tmpfs", `tmp\fs`},
	}
	if len(got) != len(want) {
		t.Fatalf("got %d entries, want %d: %+v", len(got), len(want), got)
	}
	for i := range want {
		if got[i] != want[i] {
			t.Errorf("entry %d: got %+v, want %+v", i, got[i], want[i])
		}
	}
	for _, bad := range []string{"1 2 3\n", "1 2 3 4 5 6 7 8 9\n", "1 2 0:1 / /x rw - ext4\n"} {
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
