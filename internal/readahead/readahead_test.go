package readahead

import (
	"testing"
)

const (
	KiB = int64(1) << 10
	MiB = int64(1) << 20
)

// read is one READ of a table case and the range it should read ahead.
type read struct {
	lo, hi int64
	want   Range
}

func TestStreamRead(t *testing.T) {
	c := Config{}.WithDefaults() // 1 MiB first window at least, 32 MiB at most, 1 MiB gap
	const size = 1 << 30
	cases := []struct {
		name  string
		size  int64
		reads []read
	}{
		{"start of file: a window at once, doubling, then half a window ahead", size, []read{
			{0, 1 * MiB, Range{1 * MiB, 2 * MiB}},
			{1 * MiB, 2 * MiB, Range{2 * MiB, 4 * MiB}},
			{2 * MiB, 3 * MiB, Range{4 * MiB, 7 * MiB}},
			{3 * MiB, 4 * MiB, Range{7 * MiB, 12 * MiB}},
			{4 * MiB, 5 * MiB, Range{12 * MiB, 21 * MiB}},
			{5 * MiB, 6 * MiB, Range{21 * MiB, 38 * MiB}},
			{6 * MiB, 7 * MiB, Range{}},  // 31 MiB ahead: more than half of 32
			{7 * MiB, 22 * MiB, Range{}}, // 16 MiB ahead: half
			{22 * MiB, 23 * MiB, Range{38 * MiB, 55 * MiB}},
		}},
		{"a window is at least the READ", size, []read{
			{0, 16 * MiB, Range{16 * MiB, 32 * MiB}},
			{16 * MiB, 32 * MiB, Range{32 * MiB, 64 * MiB}},
			{32 * MiB, 48 * MiB, Range{}},
			{48 * MiB, 64 * MiB, Range{64 * MiB, 96 * MiB}},
		}},
		{"small gaps and overlaps continue the run (tar headers between batches)", size, []read{
			{4 * KiB, 1 * MiB, Range{1 * MiB, 2 * MiB}},
			{1*MiB + 8*KiB, 2 * MiB, Range{2 * MiB, 4 * MiB}},
			{2*MiB - 4*KiB, 3 * MiB, Range{4 * MiB, 7 * MiB}},
		}},
		{"mid-file: the second sequential READ starts the run", size, []read{
			{100 * MiB, 101 * MiB, Range{}},
			{101 * MiB, 102 * MiB, Range{102 * MiB, 103 * MiB}},
			{102 * MiB, 103 * MiB, Range{103 * MiB, 105 * MiB}},
		}},
		{"random READs read nothing ahead", size, []read{
			{500 * MiB, 501 * MiB, Range{}},
			{3 * MiB, 4 * MiB, Range{}},
			{200 * MiB, 201 * MiB, Range{}},
			{10 * MiB, 11 * MiB, Range{}},
		}},
		{"a jump ends the run; the next READ after it starts a new one", size, []read{
			{0, 1 * MiB, Range{1 * MiB, 2 * MiB}},
			{1 * MiB, 2 * MiB, Range{2 * MiB, 4 * MiB}},
			{300 * MiB, 301 * MiB, Range{}},
			{301 * MiB, 302 * MiB, Range{302 * MiB, 303 * MiB}},
			{2 * MiB, 3 * MiB, Range{}}, // back where the old run was: a jump too
		}},
		{"never past the end of the file", 5 * MiB, []read{
			{0, 1 * MiB, Range{1 * MiB, 2 * MiB}},
			{1 * MiB, 2 * MiB, Range{2 * MiB, 4 * MiB}},
			{2 * MiB, 3 * MiB, Range{4 * MiB, 5 * MiB}},
			{3 * MiB, 4 * MiB, Range{}},
			{4 * MiB, 5 * MiB, Range{}},
		}},
		{"a READ of a tiny file", 10 * KiB, []read{
			{0, 10 * KiB, Range{}},
		}},
		{"input out of order reads nothing ahead and ends the run", size, []read{
			{0, 1 * MiB, Range{1 * MiB, 2 * MiB}},
			{4 * MiB, 4 * MiB, Range{}},
			{4 * MiB, 5 * MiB, Range{5 * MiB, 6 * MiB}}, // a new run, as after any jump
			{-4 * KiB, 4 * KiB, Range{}},
			{size - 4*KiB, size + 4*KiB, Range{}},
		}},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			var s Stream
			for i, r := range tc.reads {
				if got := s.Read(c, r.lo, r.hi, tc.size); got != r.want {
					t.Errorf("READ %d [%d, %d): read ahead [%d, %d), want [%d, %d)", i, r.lo, r.hi, got.Off, got.End, r.want.Off, r.want.End)
				}
			}
		})
	}
}

// TestStreamUnread: a window given back (the caller dropped it) is asked
// for again by the next READ; only the stream's last window can be given
// back.
func TestStreamUnread(t *testing.T) {
	c := Config{MinBytes: 8 * MiB}.WithDefaults()
	const size = 1 << 30
	cases := []struct {
		name   string
		unread func(first Range) Range // what is given back after the first READ
		want   Range                   // the second READ's window
	}{
		{"the last window", func(r Range) Range { return r }, Range{2 * MiB, 18 * MiB}},
		{"nothing given back", func(Range) Range { return Range{} }, Range{9 * MiB, 18 * MiB}},
		{"not the last window", func(r Range) Range { return Range{r.Off, r.End - MiB} }, Range{9 * MiB, 18 * MiB}},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			var s Stream
			first := s.Read(c, 0, 1*MiB, size)
			if first != (Range{1 * MiB, 9 * MiB}) {
				t.Fatalf("first window %v", first)
			}
			s.Unread(tc.unread(first))
			if got := s.Read(c, 1*MiB, 2*MiB, size); got != tc.want {
				t.Errorf("second READ's window %v, want %v", got, tc.want)
			}
		})
	}
	var s Stream // a stream not in a run has nothing to give back
	s.Read(c, 100*MiB, 101*MiB, size)
	s.Unread(Range{101 * MiB, 109 * MiB})
	if got := s.Read(c, 300*MiB, 301*MiB, size); got.Len() != 0 {
		t.Errorf("a random READ after a give-back read ahead %v", got)
	}
}

func TestConfig(t *testing.T) {
	cases := []struct {
		name string
		in   Config
		want Config
		off  bool
	}{
		{"zero: defaults", Config{}, Config{DefaultMinBytes, DefaultMaxBytes, DefaultGapBytes, DefaultStreams}, false},
		{"a minimum above the maximum is the maximum", Config{MinBytes: 8 * MiB, MaxBytes: 4 * MiB}, Config{4 * MiB, 4 * MiB, DefaultGapBytes, DefaultStreams}, false},
		{"negative maximum: off", Config{MaxBytes: -1}, Config{DefaultMinBytes, -1, DefaultGapBytes, DefaultStreams}, true},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			got := tc.in.WithDefaults()
			if got != tc.want || got.Off() != tc.off {
				t.Errorf("WithDefaults() = %+v (off %v), want %+v (off %v)", got, got.Off(), tc.want, tc.off)
			}
			var s Stream
			if r := s.Read(got, 0, MiB, 1<<30); (r.Len() == 0) != tc.off {
				t.Errorf("first READ read ahead %+v with off %v", r, tc.off)
			}
		})
	}
}

// The Tracker keeps one Stream per key, forgets the least recently read
// one when full, and Forget drops one.
func TestTracker(t *testing.T) {
	tr := NewTracker[int](Config{Streams: 2})
	if r := tr.Read(1, 0, MiB, 1<<30); r != (Range{MiB, 2 * MiB}) {
		t.Fatalf("key 1 first READ: %+v", r)
	}
	if r := tr.Read(2, 0, MiB, 1<<30); r != (Range{MiB, 2 * MiB}) {
		t.Fatalf("key 2 first READ: %+v (streams must not be shared)", r)
	}
	if r := tr.Read(1, MiB, 2*MiB, 1<<30); r != (Range{2 * MiB, 4 * MiB}) {
		t.Fatalf("key 1 second READ: %+v", r)
	}
	tr.Read(3, 50*MiB, 51*MiB, 1<<30) // full: forgets key 2, the least recently read
	if tr.Len() != 2 {
		t.Fatalf("%d streams, want 2", tr.Len())
	}
	if r := tr.Read(1, 2*MiB, 3*MiB, 1<<30); r != (Range{4 * MiB, 7 * MiB}) {
		t.Errorf("key 1 kept its run: %+v", r)
	}
	if r := tr.Read(2, 5*MiB, 6*MiB, 1<<30); r.Len() != 0 {
		t.Errorf("key 2 was forgotten, its READ mid-file starts no run: %+v", r)
	}
	tr.Forget(1)
	tr.Forget(2)
	tr.Forget(3)
	if tr.Len() != 0 {
		t.Errorf("%d streams after Forget, want 0", tr.Len())
	}
	off := NewTracker[int](Config{MaxBytes: -1})
	if r := off.Read(1, 0, MiB, 1<<30); r.Len() != 0 || off.Len() != 0 {
		t.Errorf("readahead off: read ahead %+v, %d streams", r, off.Len())
	}
}

// FuzzStreamRead: whatever READs come (the control path passes validated
// ranges, but the policy must not trust that), a read-ahead range lies
// past the READ and within the file, never overflows, and is at most the
// largest window.
func FuzzStreamRead(f *testing.F) {
	f.Add(int64(0), int64(MiB), int64(MiB), int64(2*MiB), int64(1<<30), int64(0))
	f.Add(int64(1<<62), int64(1<<62+1), int64(1<<62+1), int64(1<<63-1), int64(1<<63-1), int64(64*MiB))
	f.Add(int64(-1), int64(0), int64(5), int64(3), int64(10), int64(-1))
	f.Fuzz(func(t *testing.T, lo1, hi1, lo2, hi2, size, maxBytes int64) {
		c := Config{MaxBytes: maxBytes}.WithDefaults()
		var s Stream
		for _, r := range [][2]int64{{lo1, hi1}, {lo2, hi2}, {hi2, hi2 + 1}} {
			got := s.Read(c, r[0], r[1], size)
			if got.Len() == 0 {
				continue
			}
			if c.Off() || got.Off < r[1] || got.End > size || got.Off >= got.End || got.Len() > c.MaxBytes {
				t.Fatalf("READ [%d, %d) of a %d-byte file (max %d): read ahead [%d, %d)", r[0], r[1], size, c.MaxBytes, got.Off, got.End)
			}
			if maxBytes%2 == 0 {
				s.Unread(got) // dropped: the invariants hold for the READs after it too
			}
		}
	})
}
