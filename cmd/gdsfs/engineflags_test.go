package main

import (
	"errors"
	"testing"

	"github.com/rs/zerolog"
	"github.com/spf13/pflag"

	"github.com/gdsfs/gdsfs/daemon"
)

func TestEngineFlags(t *testing.T) {
	for _, tc := range []struct {
		name  string
		args  []string
		ok    bool
		check func(t *testing.T, s engineSettings)
	}{
		{"defaults", nil, true, func(t *testing.T, s engineSettings) {
			if s.cfg.Engine != "auto" || s.slabBytes != 64<<20 || s.cfg.ChunkBytes != 8<<20 || s.cfg.ColdChunkBytes != 1<<20 || s.gpuPool != 0 {
				t.Errorf("settings %+v", s)
			}
		}},
		{"sizes", []string{"--engine", "posix", "--gpu-pool", "8GiB", "--host-pool", "1GiB", "--slab-size", "32MiB", "--chunk-size", "16MiB", "--cold-chunk-size", "2MiB", "--io-workers", "16"}, true,
			func(t *testing.T, s engineSettings) {
				if s.gpuPool != 8<<30 || s.hostPool != 1<<30 || s.slabBytes != 32<<20 || s.cfg.ChunkBytes != 16<<20 || s.cfg.ColdChunkBytes != 2<<20 || s.cfg.Workers != 16 {
					t.Errorf("settings %+v", s)
				}
			}},
		{"cold readahead auto by default", nil, true, func(t *testing.T, s engineSettings) {
			if s.cfg.ColdReadAheadBytes >= 0 {
				t.Errorf("ColdReadAheadBytes %d, want < 0 (auto: io-workers x chunk-size)", s.cfg.ColdReadAheadBytes)
			}
		}},
		{"cold readahead auto", []string{"--cold-readahead", "auto"}, true, func(t *testing.T, s engineSettings) {
			if s.cfg.ColdReadAheadBytes >= 0 {
				t.Errorf("ColdReadAheadBytes %d, want < 0 (io-workers x chunk-size)", s.cfg.ColdReadAheadBytes)
			}
		}},
		{"cold readahead off", []string{"--cold-readahead", "0"}, true, func(t *testing.T, s engineSettings) {
			if s.cfg.ColdReadAheadBytes != 0 {
				t.Errorf("ColdReadAheadBytes %d, want 0 (no advice)", s.cfg.ColdReadAheadBytes)
			}
		}},
		{"cold readahead size", []string{"--cold-readahead", "64MiB"}, true, func(t *testing.T, s engineSettings) {
			if s.cfg.ColdReadAheadBytes != 64<<20 {
				t.Errorf("ColdReadAheadBytes %d, want 64 MiB", s.cfg.ColdReadAheadBytes)
			}
		}},
		{"cold readahead junk", []string{"--cold-readahead", "lots"}, false, nil},
		{"cold crowd off by default", nil, true, func(t *testing.T, s engineSettings) {
			if s.cfg.ColdCrowd != 0 {
				t.Errorf("ColdCrowd %d, want 0 (never)", s.cfg.ColdCrowd)
			}
		}},
		{"cold crowd", []string{"--cold-crowd", "4"}, true, func(t *testing.T, s engineSettings) {
			if s.cfg.ColdCrowd != 4 {
				t.Errorf("ColdCrowd %d, want 4", s.cfg.ColdCrowd)
			}
		}},
		{"cold crowd negative", []string{"--cold-crowd", "-1"}, false, nil},
		{"uid share default", nil, true, func(t *testing.T, s engineSettings) {
			if s.shareFrac != 0.5 || s.shareBytes != 0 || shareOf(s, 8<<30) != 4<<30 {
				t.Errorf("share %v %d -> %d", s.shareFrac, s.shareBytes, shareOf(s, 8<<30))
			}
		}},
		{"uid share percent", []string{"--uid-share", "25%"}, true, func(t *testing.T, s engineSettings) {
			if shareOf(s, 8<<30) != 2<<30 {
				t.Errorf("share %d", shareOf(s, 8<<30))
			}
		}},
		{"uid share fraction", []string{"--uid-share", "1"}, true, func(t *testing.T, s engineSettings) {
			if shareOf(s, 8<<30) != 8<<30 {
				t.Errorf("share %d", shareOf(s, 8<<30))
			}
		}},
		{"uid share size", []string{"--uid-share", "1GiB"}, true, func(t *testing.T, s engineSettings) {
			if shareOf(s, 8<<30) != 1<<30 {
				t.Errorf("share %d", shareOf(s, 8<<30))
			}
		}},
		{"uid share zero", []string{"--uid-share", "0"}, false, nil},
		{"uid share above the pool", []string{"--uid-share", "150%"}, false, nil},
		{"uid share fraction above one", []string{"--uid-share", "2"}, false, nil},
		{"uid share garbage", []string{"--uid-share", "half"}, false, nil},
		{"bad engine", []string{"--engine", "fast"}, false, nil},
		{"bad size", []string{"--gpu-pool", "lots"}, false, nil},
		{"unaligned size", []string{"--slab-size", "1000"}, false, nil},
		{"pool below slab", []string{"--gpu-pool", "16MiB"}, false, nil},
		{"bad direct", []string{"--direct-io", "maybe"}, false, nil},
		{"unaligned cold chunk", []string{"--cold-chunk-size", "1000"}, false, nil},
		{"too many workers", []string{"--io-workers", "1000"}, false, nil},
	} {
		t.Run(tc.name, func(t *testing.T) {
			fs := pflag.NewFlagSet("t", pflag.ContinueOnError)
			f := addEngineFlags(fs)
			if err := fs.Parse(tc.args); err != nil {
				t.Fatal(err)
			}
			s, err := f.parse(zerolog.Nop())
			if tc.ok != (err == nil) {
				t.Fatalf("parse = %v, want ok=%v", err, tc.ok)
			}
			var ue usageError
			if err != nil && !errors.As(err, &ue) {
				t.Errorf("error %v is not a usage error", err)
			}
			if tc.check != nil {
				tc.check(t, s)
			}
		})
	}
}

// shareOf is the per-uid share the daemon grants for s's flags in a pool
// of budget bytes.
func shareOf(s engineSettings, budget int64) int64 {
	var c daemon.Config
	s.apply(&c)
	return c.UIDShare(budget)
}
