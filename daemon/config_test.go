package daemon

import (
	"strings"
	"testing"

	"github.com/gdsfs/gdsfs/cufile"
)

// TestBackingPaths: an overmount reports the daemon's /proc/self/fd/N
// backing paths as the mountpoint's paths; with a source, no mapping.
func TestBackingPaths(t *testing.T) {
	for _, tc := range []struct {
		name       string
		source, mp string
		in         string
		want       string // "" when no mapping is expected
	}{
		{"overmount file", "", "/data", "/proc/self/fd/9/a/b.tar", "/data/a/b.tar"},
		{"overmount root", "", "/data", "/proc/self/fd/12", "/data"},
		{"overmount other path", "", "/data", "/srv/x", "/srv/x"},
		{"source given", "/srv", "/mnt", "", ""},
	} {
		t.Run(tc.name, func(t *testing.T) {
			got := backingPaths(tc.source, tc.mp)
			if tc.want == "" {
				if got != nil {
					t.Errorf("mapping for source %q, want none", tc.source)
				}
				return
			}
			if got == nil {
				t.Fatalf("no mapping for an overmount of %s", tc.mp)
			}
			if p := got(tc.in); p != tc.want {
				t.Errorf("%s -> %s, want %s", tc.in, p, tc.want)
			}
		})
	}
}

func TestUIDShare(t *testing.T) {
	for _, tc := range []struct {
		name string
		c    Config
		want int64
	}{
		{"default: gpubuf's", Config{}, 0},
		{"fraction", Config{UIDShareFraction: 0.25}, 2 << 30},
		{"everything", Config{UIDShareFraction: 1}, 8 << 30},
		{"bytes win", Config{UIDShareBytes: 1 << 30, UIDShareFraction: 0.5}, 1 << 30},
		{"tiny fraction is at least a byte", Config{UIDShareFraction: 1e-12}, 1},
	} {
		if got := tc.c.UIDShare(8 << 30); got != tc.want {
			t.Errorf("%s: UIDShare(8GiB) = %d, want %d", tc.name, got, tc.want)
		}
	}
}

func TestConfigValidate(t *testing.T) {
	for _, tc := range []struct {
		name string
		c    Config
		want []string // substrings of the error; none: valid
	}{
		{"minimal", Config{Mountpoint: "/m"}, nil},
		{"everything", Config{Mountpoint: "/m", Source: "/s", SlabBytes: 1 << 20, HostPoolBytes: 8 << 20, UIDShareFraction: 0.5,
			Engine: cufile.Config{Engine: cufile.EngineHost}}, nil},
		{"no mountpoint", Config{}, []string{"Mountpoint"}},
		{"relative paths", Config{Mountpoint: "m", Source: "s"}, []string{"Mountpoint \"m\"", "Source \"s\""}},
		{"every problem at once", Config{Mountpoint: "/m", SlabBytes: 1000, GPUPoolBytes: -1, UIDShareFraction: 2,
			Engine: cufile.Config{Engine: "fast"}},
			[]string{"SlabBytes (1000)", "GPUPoolBytes (-1)", "UIDShareFraction (2)", "Engine \"fast\""}},
	} {
		err := tc.c.Validate()
		if len(tc.want) == 0 {
			if err != nil {
				t.Errorf("%s: %v, want valid", tc.name, err)
			}
			continue
		}
		if err == nil {
			t.Errorf("%s: valid, want errors naming %v", tc.name, tc.want)
			continue
		}
		for _, w := range tc.want {
			if !strings.Contains(err.Error(), w) {
				t.Errorf("%s: %q does not name %q", tc.name, err, w)
			}
		}
	}
}
