package main

import (
	"errors"
	"strings"
	"testing"
	"time"

	"github.com/spf13/cobra"
)

func TestParseMountinfo(t *testing.T) {
	in := `22 1 8:1 / / rw,relatime shared:1 - ext4 /dev/sda1 rw
36 35 98:0 /mnt1 /mnt/with\040space rw,noatime master:1 shared:2 - ext3 /dev/root rw,errors=continue
40 22 0:50 / /tmp/x rw,nosuid,nodev,relatime - fuse.gdsfs /data/src rw,user_id=0,group_id=0
41 22 0:51 / /tmp/y rw - tmpfs tmp\134fs rw
`
	got, err := parseMountinfo(strings.NewReader(in))
	if err != nil {
		t.Fatal(err)
	}
	want := []mountEntry{
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
		if _, err := parseMountinfo(strings.NewReader(bad)); !errors.Is(err, errMountinfo) {
			t.Errorf("parseMountinfo(%q): %v, want errMountinfo", bad, err)
		}
	}
}

func FuzzParseMountinfo(f *testing.F) {
	f.Add("22 1 8:1 / / rw,relatime shared:1 - ext4 /dev/sda1 rw\n")
	f.Add("36 35 98:0 /mnt1 /mnt/a\\040b rw master:1 - ext3 /dev/root rw\n")
	f.Add("1 2 3 4 5 6 - \n")
	f.Add("\\")
	f.Fuzz(func(t *testing.T, s string) {
		ms, err := parseMountinfo(strings.NewReader(s))
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
		if got := unescapeMountinfo(in); got != want {
			t.Errorf("unescapeMountinfo(%q) = %q, want %q", in, got, want)
		}
	}
}

// TestMountFlags parses flags without mounting.
func TestMountFlags(t *testing.T) {
	cases := []struct {
		name string
		args []string
		want mountConfig
	}{
		{"defaults", []string{"/data"}, mountConfig{mountpoint: "/data", attrTimeout: time.Second, entryTimeout: time.Second, logLevel: "info"}},
		{"everything", []string{"--source", "/src", "--read-only", "--allow-other", "--debug", "--no-passthrough", "--background",
			"--attr-timeout", "5s", "--entry-timeout", "0", "--log-level", "debug", "--log-file", "/l", "/m"},
			mountConfig{mountpoint: "/m", source: "/src", readOnly: true, allowOther: true, debug: true, noPass: true, background: true,
				attrTimeout: 5 * time.Second, logLevel: "debug", logFile: "/l"}},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			var got *mountConfig
			cmd := newMountCmdWith(func(_ *cobra.Command, mc *mountConfig) error {
				got = mc
				return nil
			})
			cmd.SetArgs(c.args)
			if err := cmd.Execute(); err != nil {
				t.Fatal(err)
			}
			if got == nil || *got != c.want {
				t.Errorf("config %+v, want %+v", got, c.want)
			}
		})
	}
}

func TestFlagTimeout(t *testing.T) {
	for in, want := range map[time.Duration]time.Duration{0: -1, -time.Second: -1, time.Second: time.Second} {
		if got := flagTimeout(in); got != want {
			t.Errorf("flagTimeout(%v) = %v, want %v", in, got, want)
		}
	}
}

func TestRunExitCodes(t *testing.T) {
	cases := []struct {
		args []string
		code int
	}{
		{[]string{"mount"}, exitUsage},
		{[]string{"mount", "--nope", "/x"}, exitUsage},
		{[]string{"mount", "--log-level", "loud", "/nonexistent-gdsfs-test"}, exitUsage},
		{[]string{"mount", "/nonexistent-gdsfs-test"}, exitUsage},
		{[]string{"unmount", "/nonexistent-gdsfs-test"}, exitUsage},
		{[]string{"bench", "mount", "--size", "1"}, exitUsage},
	}
	for _, c := range cases {
		if got := run(c.args); got != c.code {
			t.Errorf("gdsfs %v: exit %d, want %d", c.args, got, c.code)
		}
	}
}
