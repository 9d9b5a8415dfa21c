package main

import (
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
