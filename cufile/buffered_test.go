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
		n, size  int64
		found    bool
		buffered bool
	}{
		{"host auto, small range", auto, 1 << 20, 1 << 40, true, true},
		{"host auto, range of four chunks of a huge file (O_DIRECT when cold)", auto, 4 << 20, 1 << 40, true, false},
		{"host auto, range of four chunks of a file memory holds", auto, 4 << 20, 64 << 20, true, true},
		{"host never", NewHostEngine(Options{Direct: "never"}), 1 << 30, 1 << 40, true, true},
		{"host always", NewHostEngine(Options{Direct: "always"}), 4096, 4096, true, false},
		{"posix auto", newPosixEngine(nil, Options{ChunkBytes: 1 << 20}), 1 << 20, 1 << 40, true, true},
		{"through a wrapper", wrapped{wrapped{auto}}, 1 << 20, 1 << 40, true, true},
		{"behind a wrapper without Unwrap", hidden{auto}, 1 << 20, 1 << 40, false, false},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			br, ok := BufferedReaderOf(c.e)
			if ok != c.found {
				t.Fatalf("found %v, want %v", ok, c.found)
			}
			if ok && br.ReadsBuffered(c.n, c.size) != c.buffered {
				t.Errorf("ReadsBuffered(%d, %d) = %v, want %v", c.n, c.size, !c.buffered, c.buffered)
			}
		})
	}
}
