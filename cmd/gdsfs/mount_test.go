package main

import (
	"testing"
	"time"

	"github.com/spf13/cobra"
)

// TestMountFlags parses flags without mounting.
func TestMountFlags(t *testing.T) {
	cases := []struct {
		name string
		args []string
		want mountConfig
	}{
		{"defaults", []string{"/data"}, mountConfig{mountpoint: "/data", attrTimeout: time.Second, entryTimeout: time.Second, logLevel: "info"}},
		{"everything", []string{"--source", "/src", "--read-only", "--allow-other", "--debug", "--no-passthrough", "--background",
			"--attr-timeout", "5s", "--entry-timeout", "0", "--log-level", "debug", "--log-file", "/l", "--max-open-per-user", "500", "/m"},
			mountConfig{mountpoint: "/m", source: "/src", readOnly: true, allowOther: true, debug: true, noPass: true, background: true,
				attrTimeout: 5 * time.Second, logLevel: "debug", logFile: "/l", maxOpenPerUser: 500}},
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
		{[]string{"mount", "--max-open-per-user", "-1", "/nonexistent-gdsfs-test"}, exitUsage},
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
