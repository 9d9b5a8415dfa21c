package tier

import (
	"context"
	"fmt"
	"math/rand/v2"
	"os"
	"testing"
)

// TestAccountingRandomized drives the tier through random sequences of
// pins (whole files and single extents, some cancelled while they read)
// by three uids, unpins (own, root),
// invalidations and hits held across other operations, and checks after
// every step that the memory allocated is the extents held once each, that
// every uid is charged exactly the extents its pins asked for (never
// negative, never above its share), that the budget holds, that a uid's
// own figures (HeldFor, StatsFor) agree with its charge, and that once
// every hit is released and every file unpinned nothing is allocated or
// charged any more.
func TestAccountingRandomized(t *testing.T) {
	const ext = 64 * kib
	for seed := range uint64(8) {
		t.Run(fmt.Sprint("seed", seed), func(t *testing.T) {
			tr, a := newTier(t, 6*ext, 3*ext)
			dir := t.TempDir()
			var files []*os.File
			var ids []Identity
			for i, n := range []int{ext, 2*ext + 100, 3 * ext, 4*ext - 7} {
				_, f := writeFile(t, dir, fmt.Sprint("f", i), n, seed*10+uint64(i))
				files, ids = append(files, f), append(ids, ident(t, f))
			}
			ctx := context.Background()
			r := rand.New(rand.NewPCG(seed, 7))
			var views []*View
			for step := range 300 {
				i := r.IntN(len(files))
				uid := uint32(1 + r.IntN(3))
				var op string
				switch r.IntN(9) {
				case 8:
					op = "pin cancelled while it reads"
					cctx, cancel := context.WithCancel(ctx)
					a.before = func(int64) { cancel() }
					_, _ = tr.Pin(cctx, files[i], files[i].Name(), uid, 0, -1)
					a.before = nil
					cancel()
				case 0, 1:
					op = "pin"
					_, _ = tr.Pin(ctx, files[i], files[i].Name(), uid, 0, -1)
				case 2:
					op = "pin one extent"
					k := int64(r.IntN(int(tr.chunks(ids[i].Size))))
					_, _ = tr.Pin(ctx, files[i], files[i].Name(), uid, k*ext, ext)
				case 3:
					op = "unpin"
					_, _ = tr.Unpin(ids[i], uid)
				case 4:
					op = "unpin own"
					_, _ = tr.UnpinOwn(ids[i], uid)
				case 5:
					op = "root unpin or invalidate"
					switch r.IntN(3) {
					case 0:
						_, _ = tr.Unpin(ids[i], 0)
					case 1:
						tr.Invalidate(ids[i].Key)
					default:
						tr.InvalidatePath(files[i].Name())
					}
				case 6:
					op = "hit"
					if v, ok := tr.Lookup(ids[i], [][2]int64{{0, ids[i].Size}}); ok {
						views = append(views, v)
					}
				default:
					op = "release"
					if len(views) > 0 {
						j := r.IntN(len(views))
						views[j].Release()
						views = append(views[:j], views[j+1:]...)
					}
				}
				checkInvariants(t, tr)
				checkOwnFigures(t, tr)
				if t.Failed() {
					for _, v := range views {
						v.Release()
					}
					t.Fatalf("step %d: %s of f%d by uid %d broke the accounting", step, op, i, uid)
				}
			}
			for _, v := range views {
				v.Release()
			}
			for _, id := range ids {
				if _, err := tr.Unpin(id, 0); err != nil {
					t.Fatal(err)
				}
			}
			checkInvariants(t, tr)
			tr.mu.Lock()
			used, charged, gone := tr.mu.used, len(tr.mu.uids), len(tr.mu.gone)
			tr.mu.Unlock()
			if used != 0 || charged != 0 || gone != 0 || !tr.Empty() || a.live.Load() != 0 {
				t.Errorf("after every unpin: used %d, uids charged %d, dead entries %d, empty %v, live extents %d; want all zero",
					used, charged, gone, tr.Empty(), a.live.Load())
			}
		})
	}
}

// checkOwnFigures checks that what each uid is told of its own pins
// (HeldFor, StatsFor) is its charge, with no pin in flight, but for the
// extents of files unpinned or invalidated under a hit: those stay charged
// until the hit is released (T3), and are no longer the uid's pins.
func checkOwnFigures(t *testing.T, tr *Tier) {
	t.Helper()
	tr.mu.Lock()
	charges := map[uint32]int64{}
	for u, n := range tr.mu.uids {
		charges[u] = n
	}
	for e := range tr.mu.gone {
		for i, x := range e.ext {
			for _, u := range e.pinners[i] {
				if x != nil {
					charges[u] -= x.n
				}
			}
		}
	}
	tr.mu.Unlock()
	for u := uint32(1); u <= 3; u++ {
		want := charges[u]
		if want < 0 {
			t.Errorf("uid %d: charged %d", u, want)
		}
		if got := tr.HeldFor(u); got != want {
			t.Errorf("uid %d: HeldFor %d, charged %d", u, got, want)
		}
		if s := tr.StatsFor(u); s.UsedBytes != want {
			t.Errorf("uid %d: StatsFor used %d, charged %d", u, s.UsedBytes, want)
		}
	}
}
