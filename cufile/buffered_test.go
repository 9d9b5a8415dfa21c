package cufile

import "testing"

// wrapped wraps an engine as metrics/instrument does.
type wrapped struct{ Engine }

func (w wrapped) Unwrap() Engine { return w.Engine }

// hidden wraps an engine without Unwrap: its abilities are hidden.
type hidden struct{ Engine }

func TestBufferedReaderOf(t *testing.T) {
	auto := NewHostEngine(Options{ChunkBytes: 1 << 20})
	cases := []struct {
		name     string
		e        Engine
		n        int64
		found    bool
		buffered bool
	}{
		{"host auto, small range", auto, 1 << 20, true, true},
		{"host auto, range of four chunks (O_DIRECT when cold)", auto, 4 << 20, true, false},
		{"host never", NewHostEngine(Options{Direct: "never"}), 1 << 30, true, true},
		{"host always", NewHostEngine(Options{Direct: "always"}), 4096, true, false},
		{"posix auto", newPosixEngine(nil, Options{ChunkBytes: 1 << 20}), 1 << 20, true, true},
		{"through a wrapper", wrapped{wrapped{auto}}, 1 << 20, true, true},
		{"behind a wrapper without Unwrap", hidden{auto}, 1 << 20, false, false},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			br, ok := BufferedReaderOf(c.e)
			if ok != c.found {
				t.Fatalf("found %v, want %v", ok, c.found)
			}
			if ok && br.ReadsBuffered(c.n) != c.buffered {
				t.Errorf("ReadsBuffered(%d) = %v, want %v", c.n, !c.buffered, c.buffered)
			}
		})
	}
}
