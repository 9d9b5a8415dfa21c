package main

import (
	"context"
	"errors"
	"os"
	"path/filepath"
	"strings"
	"testing"
)

// TestWarmPinUsage: --pin's refusals off a gdsfs mount and of its flags
// are usage errors naming what to do.
func TestWarmPinUsage(t *testing.T) {
	p := filepath.Join(t.TempDir(), "f")
	if err := os.WriteFile(p, []byte("x"), 0o644); err != nil {
		t.Fatal(err)
	}
	for _, tc := range []struct {
		name string
		args []string
		want string
	}{
		{"not on a mount", []string{"--pin", p}, "is not on a gdsfs mount"},
		{"unpin not on a mount", []string{"--unpin", p}, "is not on a gdsfs mount"},
		{"both", []string{"--pin", "--unpin", p}, "--pin and --unpin: give one"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			_, err := runWarmCmd(context.Background(), t, tc.args...)
			var ue usageError
			if !errors.As(err, &ue) || !strings.Contains(err.Error(), tc.want) {
				t.Fatalf("warm %v: %v, want a usage error saying %q", tc.args, err, tc.want)
			}
		})
	}
}

// TestParseTierBudget: --tier-budget takes 0 (off) or a size.
func TestParseTierBudget(t *testing.T) {
	for _, tc := range []struct {
		in   string
		want int64
		bad  bool
	}{{"0", 0, false}, {"8GiB", 8 << 30, false}, {"lots", 0, true}, {"1000", 0, true}} {
		got, err := parseTierBudget(tc.in)
		var ue usageError
		if got != tc.want || (err != nil) != tc.bad || err != nil && !errors.As(err, &ue) {
			t.Errorf("parseTierBudget(%q) = %d, %v", tc.in, got, err)
		}
	}
}
