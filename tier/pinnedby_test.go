package tier

import (
	"context"
	"testing"
)

// mineOf is what the tier tells uid b of a file through its own pins:
// PinResult's Mine and MineFilled of each of b's pins (half, whole, whole
// again), HeldFor, and PinnedBy after UnpinOwn.
type mineOf struct {
	half, whole, again [2]int64
	held, afterUnpin   int64
}

// TestPinnedByIgnoresOtherPins: what uid 2's pins are told they hold and
// added (Mine, MineFilled, HeldFor, UnpinOwn) is the same whether uid 1
// pinned the file first or nobody did, though uid 2's pins read nothing in
// the first case; uid 1's pin stays through uid 2's UnpinOwn.
func TestPinnedByIgnoresOtherPins(t *testing.T) {
	const size = 200*kib + 5 // 4 extents, the last short
	ctx := context.Background()
	run := func(t *testing.T, firstPinner uint32) (mineOf, PinResult) {
		tr, _ := newTier(t, 4<<20, 2<<20)
		_, f := writeFile(t, t.TempDir(), "f", size, 3)
		var first PinResult
		if firstPinner != 0 {
			var err error
			if first, err = tr.Pin(ctx, f, f.Name(), firstPinner, 0, -1); err != nil {
				t.Fatal(err)
			}
		}
		var m mineOf
		for _, p := range []struct {
			out *[2]int64
			n   int64
		}{{&m.half, 100 * kib}, {&m.whole, -1}, {&m.again, -1}} {
			r, err := tr.Pin(ctx, f, f.Name(), 2, 0, p.n)
			if err != nil {
				t.Fatal(err)
			}
			*p.out = [2]int64{r.Mine, r.MineFilled}
		}
		m.held = tr.HeldFor(2)
		if _, err := tr.UnpinOwn(ident(t, f), 2); err != nil {
			t.Fatal(err)
		}
		m.afterUnpin = tr.PinnedBy(ident(t, f), 2)
		if firstPinner != 0 {
			if c, mine := tr.Cached(ident(t, f)), tr.PinnedBy(ident(t, f), firstPinner); c != size || mine != size {
				t.Errorf("after uid 2's UnpinOwn: %d bytes cached, %d uid %d's, want the whole file for uid %d's pin", c, mine, firstPinner, firstPinner)
			}
		}
		return m, first
	}
	none, _ := run(t, 0)
	other, first := run(t, 1)
	want := mineOf{half: [2]int64{128 * kib, 128 * kib}, whole: [2]int64{size, size - 128*kib}, again: [2]int64{size, 0}, held: 204 * kib}
	if none != want {
		t.Errorf("uid 2 alone: %+v, want %+v", none, want)
	}
	if other != none {
		t.Errorf("uid 2 after uid 1's pin: %+v; alone: %+v", other, none)
	}
	if first.Mine != size || first.MineFilled != size || first.Filled != size {
		t.Errorf("uid 1's pin: %+v", first)
	}
}
