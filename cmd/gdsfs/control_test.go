package main

import (
	"bytes"
	"errors"
	"strings"
	"testing"

	"github.com/spf13/cobra"
)

func TestOvermountPaths(t *testing.T) {
	for _, tc := range []struct {
		name string
		args []string
		in   string
		want string // "" when no mapping is expected
	}{
		{"overmount file", []string{"/data"}, "/proc/self/fd/9/a/b.tar", "/data/a/b.tar"},
		{"overmount root", []string{"/data"}, "/proc/self/fd/12", "/data"},
		{"overmount other path", []string{"/data"}, "/srv/x", "/srv/x"},
		{"source given", []string{"--source", "/srv", "/mnt"}, "", ""},
	} {
		t.Run(tc.name, func(t *testing.T) {
			var got func(string) string
			cmd := &cobra.Command{Use: "mount", Args: cobra.ExactArgs(1), RunE: func(cmd *cobra.Command, _ []string) error {
				var err error
				got, err = overmountPaths(cmd)
				return err
			}}
			cmd.Flags().String("source", "", "")
			cmd.SetArgs(tc.args)
			if err := cmd.Execute(); err != nil {
				t.Fatal(err)
			}
			if tc.want == "" {
				if got != nil {
					t.Errorf("mapping for %v, want none", tc.args)
				}
				return
			}
			if got == nil {
				t.Fatalf("no mapping for %v", tc.args)
			}
			if p := got(tc.in); p != tc.want {
				t.Errorf("%s -> %s, want %s", tc.in, p, tc.want)
			}
		})
	}
}

// --meta-cache is the index cache's size flag; --index-cache still works,
// hidden and deprecated; both at once is a usage error.
func TestMetaCacheFlag(t *testing.T) {
	for _, tc := range []struct {
		args     []string
		value    string
		flag     string
		usageErr bool
	}{
		{nil, "256MiB", "meta-cache", false},
		{[]string{"--meta-cache", "1GiB"}, "1GiB", "meta-cache", false},
		{[]string{"--index-cache", "64MiB"}, "64MiB", "index-cache", false},
		{[]string{"--index-cache", "64MiB", "--meta-cache", "1GiB"}, "", "", true},
	} {
		var cf *controlFlags
		var flag string
		var ferr error
		cmd := &cobra.Command{Use: "mount", RunE: func(cmd *cobra.Command, _ []string) error {
			flag, ferr = metaCacheFlag(cmd)
			return nil
		}}
		cf = addControlFlags(cmd)
		var stderr bytes.Buffer
		cmd.SetErr(&stderr)
		cmd.SetArgs(tc.args)
		if err := cmd.Execute(); err != nil {
			t.Fatalf("%v: %v", tc.args, err)
		}
		var ue usageError
		switch {
		case tc.usageErr:
			if !errors.As(ferr, &ue) {
				t.Errorf("%v: %v, want a usage error", tc.args, ferr)
			}
		case ferr != nil || flag != tc.flag || cf.indexCache != tc.value:
			t.Errorf("%v: flag %q value %q err %v; want %q %q", tc.args, flag, cf.indexCache, ferr, tc.flag, tc.value)
		}
	}
	cmd := &cobra.Command{Use: "mount"}
	addControlFlags(cmd)
	usage := cmd.UsageString()
	if !strings.Contains(usage, "--meta-cache") || strings.Contains(usage, "--index-cache") {
		t.Errorf("mount usage should show --meta-cache and hide --index-cache:\n%s", usage)
	}
}
