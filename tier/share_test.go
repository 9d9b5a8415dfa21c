package tier

import (
	"context"
	"fmt"
	"testing"
)

// shareSeen is what uid 2 is told of its own pins: each pin's error (its
// text) and PinResult's Mine, and afterwards what its pins hold of each
// file and in all, and its charge.
type shareSeen struct {
	Pins             []string
	F, G, Held, Mine int64
}

// TestShareIgnoresOtherPins: a pin is charged to the share of its uid for
// every extent it asks for, whoever's pin read it. So what uid 2 is told
// of its pin of file f (refused or not, which of its own older pins it
// evicted, what it holds and is charged) is the same whether uid 1 pinned
// f (all of it, or its first extent) before or nobody did. Before, a pin
// of extents another uid held charged nothing: uid 2's pin of f fit its
// share, or did without evicting its own g, exactly when uid 1 had pinned
// f.
func TestShareIgnoresOtherPins(t *testing.T) {
	const ext = 64 * kib
	ctx := context.Background()
	for _, tc := range []struct {
		name         string
		share        int64
		g            int   // extents of uid 2's own older file g (0: none)
		byOther      int64 // bytes of f uid 1 pins first
		want         shareSeen
		wantFCharged bool // uid 2's pin of f fits
	}{
		{"f fits only once g goes", 3 * ext, 1, 3 * ext,
			shareSeen{F: 3 * ext, G: 0, Held: 3 * ext, Mine: 3 * ext}, true},
		{"f fits only once g goes, partly pinned", 3 * ext, 1, ext,
			shareSeen{F: 3 * ext, G: 0, Held: 3 * ext, Mine: 3 * ext}, true},
		{"f above the share", 2 * ext, 0, 2 * ext,
			shareSeen{}, false},
		{"f above what g leaves, g in use", 3 * ext, 2, 2 * ext,
			shareSeen{G: 2 * ext, Held: 2 * ext, Mine: 2 * ext}, false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			run := func(t *testing.T, other bool) shareSeen {
				tr, _ := newTier(t, 1<<20, tc.share)
				dir := t.TempDir()
				_, f := writeFile(t, dir, "f", 3*ext, 1)
				var s shareSeen
				var gid Identity
				if tc.g > 0 {
					_, g := writeFile(t, dir, "g", tc.g*ext, 2)
					if _, err := tr.Pin(ctx, g, g.Name(), 2, 0, -1); err != nil {
						t.Fatal(err)
					}
					if tc.name == "f above what g leaves, g in use" {
						v, ok := tr.Lookup(ident(t, g), [][2]int64{{0, 4096}})
						if !ok {
							t.Fatal("g: miss")
						}
						defer v.Release() // a READ copying out of g: not evictable
					}
					gid = ident(t, g)
				}
				if other {
					if _, err := tr.Pin(ctx, f, f.Name(), 1, 0, tc.byOther); err != nil {
						t.Fatal(err)
					}
				}
				r, err := tr.Pin(ctx, f, f.Name(), 2, 0, -1)
				s.Pins = append(s.Pins, fmt.Sprint(err), fmt.Sprint(r.Mine, r.MineFilled))
				s.F, s.G, s.Held = tr.PinnedBy(ident(t, f), 2), tr.PinnedBy(gid, 2), tr.HeldFor(2)
				for _, u := range tr.Stats().UIDs {
					if u.UID == 2 {
						s.Mine = u.Bytes
					}
				}
				return s
			}
			alone, after := run(t, false), run(t, true)
			if fmt.Sprint(alone) != fmt.Sprint(after) {
				t.Errorf("uid 2 is told of uid 1's pin of f:\nafter uid 1's pin: %+v\nalone:             %+v", after, alone)
			}
			got := alone
			got.Pins = nil
			if fmt.Sprint(got) != fmt.Sprint(tc.want) {
				t.Errorf("uid 2 alone: %+v, want %+v", alone, tc.want)
			}
			if (alone.Pins[0] == "<nil>") != tc.wantFCharged {
				t.Errorf("uid 2's pin of f: %s", alone.Pins[0])
			}
		})
	}
}

// TestUnpinLeavesTheCoPinnerCharged: uid 1 pins f, uid 2 pins f too (its
// pin reads nothing), uid 1 unpins f. Uid 1 is charged nothing any more:
// its STATUS figure is 0 and it may pin its whole share again without
// evicting f; uid 2 is charged for f, which it holds: its share check
// counts it (a pin of its share's rest evicts f). Before, f stayed
// charged to uid 1 and uid 2 held it for free.
func TestUnpinLeavesTheCoPinnerCharged(t *testing.T) {
	const ext = 64 * kib
	ctx := context.Background()
	for _, unpin := range []string{"Unpin", "UnpinOwn"} {
		t.Run(unpin, func(t *testing.T) {
			tr, _ := newTier(t, 1<<20, 3*ext)
			dir := t.TempDir()
			_, f := writeFile(t, dir, "f", 2*ext, 1)
			id := ident(t, f)
			for _, u := range []uint32{1, 2} {
				if _, err := tr.Pin(ctx, f, f.Name(), u, 0, -1); err != nil {
					t.Fatal(err)
				}
			}
			do := tr.Unpin
			if unpin == "UnpinOwn" {
				do = tr.UnpinOwn
			}
			if n, err := do(id, 1); err != nil || n != 2*ext {
				t.Fatalf("uid 1's %s: %d, %v", unpin, n, err)
			}
			charged := func() map[uint32]int64 {
				m := map[uint32]int64{}
				for _, u := range tr.Stats().UIDs {
					m[u.UID] = u.Bytes
				}
				return m
			}
			if c := charged(); c[1] != 0 || c[2] != 2*ext || tr.HeldFor(1) != 0 || tr.HeldFor(2) != 2*ext {
				t.Errorf("after uid 1's unpin: charges %v, held for uid 1 %d, uid 2 %d; want uid 2 charged for f alone", c, tr.HeldFor(1), tr.HeldFor(2))
			}
			if c := tr.Cached(id); c != 2*ext {
				t.Errorf("uid 2's pin of f lost: %d cached", c)
			}
			_, h := writeFile(t, dir, "h", 3*ext, 2)
			if _, err := tr.Pin(ctx, h, h.Name(), 1, 0, -1); err != nil {
				t.Errorf("uid 1's pin of its whole share after the unpin: %v", err)
			}
			_, k := writeFile(t, dir, "k", 2*ext, 3)
			if _, err := tr.Pin(ctx, k, k.Name(), 2, 0, -1); err != nil {
				t.Fatalf("uid 2's pin of k: %v", err)
			}
			if c := tr.PinnedBy(id, 2); c != 0 {
				t.Errorf("uid 2 holds f (%d bytes) and k beyond its %d share", c, 3*ext)
			}
			if st := tr.Stats(); st.Evictions != 1 || charged()[2] != 2*ext || charged()[1] != 3*ext {
				t.Errorf("after both pins: %d evictions, charges %v", st.Evictions, charged())
			}
		})
	}
}

// TestUnpinFreesUnderAHitLater: an extent that the unpin leaves asked for
// by no pin is freed, but only once the hit copying out of it is released
// (T3); the co-pinner's extent stays.
func TestUnpinFreesUnderAHitLater(t *testing.T) {
	const ext = 64 * kib
	tr, a := newTier(t, 1<<20, 0)
	data, f := writeFile(t, t.TempDir(), "f", 2*ext, 4)
	id := ident(t, f)
	ctx := context.Background()
	if _, err := tr.Pin(ctx, f, f.Name(), 1, 0, -1); err != nil {
		t.Fatal(err)
	}
	if _, err := tr.Pin(ctx, f, f.Name(), 2, 0, ext); err != nil {
		t.Fatal(err)
	}
	v, ok := tr.Lookup(id, [][2]int64{{0, 2 * ext}})
	if !ok {
		t.Fatal("miss")
	}
	if _, err := tr.UnpinOwn(id, 1); err != nil {
		t.Fatal(err)
	}
	if got := viewBytes(t, v, 0, 2*ext); string(got) != string(data) || a.live.Load() != 2 {
		t.Fatalf("under the hit: equal %v, %d extents live", string(got) == string(data), a.live.Load())
	}
	if c := tr.Cached(id); c != ext {
		t.Errorf("after uid 1's unpin: %d cached, want uid 2's extent", c)
	}
	v.Release()
	if n := a.live.Load(); n != 1 {
		t.Errorf("after the hit: %d extents live, want uid 2's", n)
	}
	if st := tr.Stats(); st.UsedBytes != ext {
		t.Errorf("used %d after the hit, want %d", st.UsedBytes, ext)
	}
}
