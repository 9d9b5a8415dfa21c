package readahead

import (
	"math/rand"
	"testing"
)

// checkCounts compares t's per-owner counts with a recount of its streams:
// owners[o] must be the number of o's streams and live[o] the number of
// them reading ahead (Stream.live), with no zero entries left behind.
func checkCounts(tb testing.TB, t *Tracker[int], step int) {
	tb.Helper()
	owners, live := map[uint32]int{}, map[uint32]int{}
	for _, e := range t.streams {
		owners[e.owner]++
		if e.live() {
			live[e.owner]++
		}
	}
	for _, c := range []struct {
		name      string
		got, want map[uint32]int
	}{{"owners", t.owners, owners}, {"live", t.live, live}} {
		if len(c.got) != len(c.want) {
			tb.Fatalf("step %d: %s = %v, recount %v", step, c.name, c.got, c.want)
		}
		for o, n := range c.want {
			if c.got[o] != n {
				tb.Fatalf("step %d: %s = %v, recount %v", step, c.name, c.got, c.want)
			}
		}
	}
}

// TestTrackerCountsModel drives a Tracker with random READs (in order, out
// of order, past a shrunk or grown size), Unreads of the last window or
// another, Forgets, evictions of a full table and READs of one owner's
// stream by another, and checks after each step that the per-owner counts
// equal a recount of the streams.
func TestTrackerCountsModel(t *testing.T) {
	for _, tc := range []struct {
		name    string
		streams int
		keys    int
		owners  int
	}{
		{"roomy", 64, 8, 3},
		{"full table", 4, 12, 3},
		{"one slot", 1, 5, 2},
	} {
		t.Run(tc.name, func(t *testing.T) {
			c := Config{MinBytes: 4 << 10, MaxBytes: 64 << 10, GapBytes: 1 << 10, Streams: tc.streams}
			for seed := int64(1); seed <= 20; seed++ {
				rng := rand.New(rand.NewSource(seed))
				tr := NewTracker[int](c)
				next := map[int]int64{}
				last := map[int]Range{}
				for step := 0; step < 2000; step++ {
					key := rng.Intn(tc.keys)
					owner := uint32(rng.Intn(tc.owners))
					size := int64(256<<10) + int64(rng.Intn(3)-1)*int64(rng.Intn(128<<10))
					switch op := rng.Intn(10); {
					case op < 6: // sequential READ (mostly), of up to 16 KiB
						lo := next[key]
						if rng.Intn(8) == 0 {
							lo = rng.Int63n(size + 1)
						}
						hi := lo + 1 + rng.Int63n(16<<10)
						if rng.Intn(20) == 0 {
							lo, hi = hi, lo // out of order
						}
						if hi > size && rng.Intn(2) == 0 {
							hi = size
						}
						last[key] = tr.ReadAs(key, owner, lo, hi, size)
						next[key] = hi
						if next[key] >= size {
							next[key] = 0
						}
					case op < 8:
						r := last[key]
						if rng.Intn(3) == 0 {
							r = Range{Off: rng.Int63n(size), End: rng.Int63n(size + 1)}
						}
						tr.Unread(key, r)
					default:
						tr.Forget(key)
						delete(next, key)
					}
					checkCounts(t, tr, step)
					if tr.Len() > tc.streams {
						t.Fatalf("step %d: %d streams, table of %d", step, tr.Len(), tc.streams)
					}
				}
			}
		})
	}
}

// TestTrackerOwnersIsolated: with room for every stream, the windows of
// one owner's streams are those it gets alone, whatever another owner's
// streams do at the same time (one uid never shrinks another's windows).
func TestTrackerOwnersIsolated(t *testing.T) {
	c := Config{MinBytes: 4 << 10, MaxBytes: 256 << 10, GapBytes: 1 << 10, Streams: 64}
	for seed := int64(1); seed <= 20; seed++ {
		rng := rand.New(rand.NewSource(seed))
		both := NewTracker[int](c)
		alone := map[uint32]*Tracker[int]{0: NewTracker[int](c), 1: NewTracker[int](c)}
		next := map[int]int64{}
		const size = 1 << 20
		for step := 0; step < 3000; step++ {
			key := rng.Intn(10)
			owner := uint32(key % 2) // each owner's own opens
			switch op := rng.Intn(10); {
			case op < 8:
				lo := next[key]
				if rng.Intn(10) == 0 {
					lo = rng.Int63n(size)
				}
				hi := min(size, lo+1+rng.Int63n(32<<10))
				got := both.ReadAs(key, owner, lo, hi, size)
				want := alone[owner].ReadAs(key, owner, lo, hi, size)
				if got != want {
					t.Fatalf("seed %d step %d: owner %d key %d READ [%d,%d): window %+v with the other owner reading, %+v alone",
						seed, step, owner, key, lo, hi, got, want)
				}
				if rng.Intn(4) == 0 {
					both.Unread(key, got)
					alone[owner].Unread(key, want)
				}
				next[key] = hi % size
			default:
				both.Forget(key)
				alone[owner].Forget(key)
				delete(next, key)
			}
		}
	}
}
