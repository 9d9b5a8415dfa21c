package main

import (
	"bytes"
	"errors"
	"path/filepath"
	"strings"
	"testing"
)

// TestIndexLocal prints the index of each format through gdsfs index
// --local (the same printer reads the daemon's JSON) and checks the table
// and the JSON carry the file's names and ranges.
func TestIndexLocal(t *testing.T) {
	td := filepath.Join("..", "..", "cache", "testdata")
	for _, tc := range []struct {
		file string
		want []string
	}{
		{"dtypes.safetensors", []string{"safetensors, 958 bytes: 10 tensors, data at 712", "t_bfloat16  BF16   [2, 3, 4]  828     48", `metadata note = "gdsfs fixture"`}},
		{"model_align4096.pt", []string{`torch.save zip "model_align4096"`, "model_align4096/data/0                  20480   12288   yes"}},
		{"arr_i8_fortran.npy", []string{"fortran_order  true", `offset 128, length 192 (name "data")`}},
		{"sparse.tar", []string{"000000.cls     5632    2       0        cls", "skipped  sparse"}},
	} {
		t.Run(tc.file, func(t *testing.T) {
			var out bytes.Buffer
			root := newRootCmd()
			root.SetOut(&out)
			root.SetArgs([]string{"index", "--local", filepath.Join(td, tc.file)})
			if err := root.Execute(); err != nil {
				t.Fatal(err)
			}
			for _, w := range tc.want {
				if !strings.Contains(out.String(), w) {
					t.Errorf("output lacks %q:\n%s", w, out.String())
				}
			}
			out.Reset()
			root = newRootCmd()
			root.SetOut(&out)
			root.SetArgs([]string{"index", "--local", "--json", filepath.Join(td, tc.file)})
			if err := root.Execute(); err != nil {
				t.Fatal(err)
			}
			if !strings.HasPrefix(out.String(), `{"format":`) {
				t.Errorf("--json output = %.80q", out.String())
			}
		})
	}
}

func TestIndexErrors(t *testing.T) {
	dir := t.TempDir()
	for _, tc := range []struct {
		args []string
		want string
	}{
		{[]string{"index", "--local", "../../go.mod"}, "has no index"},
		{[]string{"index", "--local", filepath.Join(dir, "missing")}, "open"},
		{[]string{"index", "--local", dir}, "not a regular file"},
		{[]string{"index", filepath.Join(dir, "x.tar")}, "not on a gdsfs mount"},
		{[]string{"index"}, "accepts 1 arg"},
	} {
		var stderr bytes.Buffer
		root := newRootCmd()
		root.SetErr(&stderr)
		root.SetArgs(tc.args)
		err := root.Execute()
		var ue usageError
		if err == nil || !strings.Contains(err.Error(), tc.want) || (!errors.As(err, &ue) && !isCobraUsageError(err)) {
			t.Errorf("%v: error %v, want a usage error with %q", tc.args, err, tc.want)
		}
	}
}
