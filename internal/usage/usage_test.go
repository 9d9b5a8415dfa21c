package usage

import (
	"errors"
	"fmt"
	"io/fs"
	"testing"
)

func TestUsage(t *testing.T) {
	for _, tc := range []struct {
		name  string
		err   error
		usage bool
		msg   string
	}{
		{"nil", nil, false, ""},
		{"plain", errors.New("disk on fire"), false, "disk on fire"},
		{"Errorf", Errorf("--size %q: give a size", "x"), true, `--size "x": give a size`},
		{"wrapped further", fmt.Errorf("bench mount: %w", Errorf("--dir %s: no", "/x")), true, "bench mount: --dir /x: no"},
		{"Wrap", Wrap(fs.ErrNotExist), true, "file does not exist"},
		{"Wrap nil", Wrap(nil), false, ""},
	} {
		t.Run(tc.name, func(t *testing.T) {
			if got := Is(tc.err); got != tc.usage {
				t.Errorf("Is(%v) = %v, want %v", tc.err, got, tc.usage)
			}
			if tc.err != nil && tc.err.Error() != tc.msg {
				t.Errorf("message %q, want %q", tc.err.Error(), tc.msg)
			}
		})
	}
	if err := Wrap(fs.ErrNotExist); !errors.Is(err, fs.ErrNotExist) {
		t.Errorf("Wrap hides the error it wraps: %v", err)
	}
}
