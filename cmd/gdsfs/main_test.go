package main

import (
	"errors"
	"testing"
)

// TestFlagValueErrors: a flag value its type cannot parse is one line
// naming the flag, the value and what to give, not strconv's words.
func TestFlagValueErrors(t *testing.T) {
	cases := []struct {
		args []string
		want string
	}{
		{[]string{"mount", "--max-open-per-user", "abc", "/m"}, `--max-open-per-user "abc": give a whole number (see gdsfs mount --help)`},
		{[]string{"mount", "--io-workers", "1.5", "/m"}, `--io-workers "1.5": give a whole number (see gdsfs mount --help)`},
		{[]string{"mount", "--attr-timeout", "soon", "/m"}, `--attr-timeout "soon": give a duration such as 1s, 500ms or 2m (see gdsfs mount --help)`},
		{[]string{"mount", "--read-only=maybe", "/m"}, `--read-only "maybe": give true or false (see gdsfs mount --help)`},
		{[]string{"warm", "--workers", "x", "/m"}, `--workers "x": give a whole number (see gdsfs warm --help)`},
		{[]string{"mount", "--bogus", "/m"}, `unknown flag: --bogus (see gdsfs mount --help)`},
	}
	for _, c := range cases {
		t.Run(c.want, func(t *testing.T) {
			root := newRootCmd()
			root.SetArgs(c.args)
			_, err := root.ExecuteC()
			var ue usageError
			if err == nil || !errors.As(err, &ue) {
				t.Fatalf("gdsfs %v: error %v, want a usage error", c.args, err)
			}
			if err.Error() != c.want {
				t.Errorf("gdsfs %v:\n got: %s\nwant: %s", c.args, err, c.want)
			}
		})
	}
}
