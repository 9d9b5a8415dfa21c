package tier

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"os"
	"path/filepath"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/gdsfs/gdsfs/gpubuf"
)

const kib = 1 << 10

// countingAlloc is HostAllocator that counts live extents and can run a
// hook before each allocation (to cancel a pin or change its file).
type countingAlloc struct {
	live   atomic.Int64
	before func(n int64)
}

func (a *countingAlloc) Name() string { return "test" }

func (a *countingAlloc) Alloc(n int64) (Memory, error) {
	if a.before != nil {
		a.before(n)
	}
	m, err := HostAllocator{}.Alloc(n)
	if err != nil {
		return nil, err
	}
	a.live.Add(1)
	return countedMemory{Memory: m, a: a}, nil
}

type countedMemory struct {
	Memory
	a *countingAlloc
}

func (m countedMemory) Close() error { m.a.live.Add(-1); return m.Memory.Close() }

// newTier returns a tier of 64 KiB extents, no settle wait, one worker
// (deterministic fill order), checked for T4 and leaks at the end.
func newTier(t *testing.T, budget, share int64) (*Tier, *countingAlloc) {
	t.Helper()
	a := &countingAlloc{}
	tr, err := New(Config{BudgetBytes: budget, UIDShareBytes: share, ChunkBytes: 64 * kib, Alloc: a, SettleTime: -1, Workers: 1})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		checkInvariants(t, tr)
		tr.Close()
		if n := a.live.Load(); n != 0 {
			t.Errorf("%d extents not freed after Close", n)
		}
	})
	return tr, a
}

// checkInvariants checks T4 and the accounting, with no pin in flight.
func checkInvariants(t *testing.T, tr *Tier) {
	t.Helper()
	tr.mu.Lock()
	defer tr.mu.Unlock()
	var used int64
	uids := map[uint32]int64{}
	count := func(e *entry) {
		for i, x := range e.ext {
			if e.filling[i] {
				t.Errorf("%s: extent %d still filling", e.path, i)
			}
			if x == nil && !e.filling[i] && len(e.pinners[i]) > 0 {
				t.Errorf("%s: extent %d is not held but marked as pinned by %v", e.path, i, e.pinners[i])
			}
			if x != nil && len(e.pinners[i]) == 0 {
				t.Errorf("%s: extent %d is held for no pin (charged to nobody)", e.path, i)
			}
			if x != nil {
				used += x.n
				for _, u := range e.pinners[i] {
					uids[u] += x.n // every pinner is charged for it
				}
			}
		}
		for _, x := range e.orphans {
			used += x.n
		}
	}
	for _, e := range tr.mu.entries {
		count(e)
	}
	for e := range tr.mu.gone {
		count(e)
	}
	if used != tr.mu.used || used > tr.cfg.BudgetBytes {
		t.Errorf("used %d, extents %d, budget %d", tr.mu.used, used, tr.cfg.BudgetBytes)
	}
	for u, n := range uids {
		if tr.mu.uids[u] != n || n > tr.share {
			t.Errorf("uid %d: charged %d, extents %d, share %d", u, tr.mu.uids[u], n, tr.share)
		}
	}
	if len(uids) != len(tr.mu.uids) {
		t.Errorf("charges %v, extents %v", tr.mu.uids, uids)
	}
}

// writeFile writes n random bytes to dir/name and returns them with the
// file open for reading.
func writeFile(t *testing.T, dir, name string, n int, seed uint64) ([]byte, *os.File) {
	t.Helper()
	b := make([]byte, n)
	r := rand.New(rand.NewPCG(seed, 1))
	for i := range b {
		b[i] = byte(r.Uint32())
	}
	p := filepath.Join(dir, name)
	if err := os.WriteFile(p, b, 0o644); err != nil {
		t.Fatal(err)
	}
	f, err := os.Open(p)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { f.Close() })
	return b, f
}

func ident(t *testing.T, f *os.File) Identity {
	t.Helper()
	id, err := Stat(f)
	if err != nil {
		t.Fatal(err)
	}
	return id
}

// viewBytes reads [off, off+n) through a view.
func viewBytes(t *testing.T, v *View, off, n int64) []byte {
	t.Helper()
	var out []byte
	if _, err := v.Each(off, n, func(pos int64, b []byte) error {
		if pos != int64(len(out)) {
			return fmt.Errorf("piece at %d after %d bytes", pos, len(out))
		}
		out = append(out, b...)
		return nil
	}); err != nil {
		t.Fatal(err)
	}
	return out
}

// TestPinLookup: what is pinned hits with the file's bytes, what is not
// (another range, another version, another file) misses.
func TestPinLookup(t *testing.T) {
	dir := t.TempDir()
	tr, _ := newTier(t, 1<<20, 0)
	data, f := writeFile(t, dir, "a", 200*kib+5, 1)
	id := ident(t, f)
	ctx := context.Background()
	// The first two extents only.
	res, err := tr.Pin(ctx, f, f.Name(), 1000, 0, 128*kib)
	if err != nil || res.Filled != 128*kib || res.Cached != 128*kib || res.Size != int64(len(data)) {
		t.Fatalf("pin of 128 KiB: %+v, %v", res, err)
	}
	for _, tc := range []struct {
		name  string
		spans [][2]int64
		hit   bool
	}{
		{"first extent", [][2]int64{{0, 4096}}, true},
		{"both pinned", [][2]int64{{0, 64 * kib}, {64 * kib, 128 * kib}}, true},
		{"into the third", [][2]int64{{120 * kib, 132 * kib}}, false},
		{"one of two missing", [][2]int64{{0, 4096}, {196 * kib, 204 * kib}}, false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			v, ok := tr.Lookup(id, tc.spans)
			if ok != tc.hit {
				t.Fatalf("hit %v, want %v", ok, tc.hit)
			}
			if ok {
				v.Release()
			}
		})
	}
	// The rest of it; a second pin reads nothing.
	if res, err = tr.Pin(ctx, f, f.Name(), 1000, 0, -1); err != nil || res.Filled != int64(len(data))-128*kib || res.Cached != int64(len(data)) {
		t.Fatalf("pin of the rest: %+v, %v", res, err)
	}
	if res, err = tr.Pin(ctx, f, f.Name(), 1000, 0, -1); err != nil || res.Filled != 0 {
		t.Fatalf("pin again: %+v, %v", res, err)
	}
	v, ok := tr.Lookup(id, [][2]int64{{0, 204 * kib}})
	if !ok {
		t.Fatal("whole file: miss")
	}
	if got := viewBytes(t, v, 0, 300*kib); !bytes.Equal(got, data) {
		t.Fatalf("view of the whole file: %d bytes, equal %v (want %d)", len(got), bytes.Equal(got, data), len(data))
	}
	if got := viewBytes(t, v, 70*kib+3, 10); !bytes.Equal(got, data[70*kib+3:70*kib+13]) {
		t.Fatal("view of 10 bytes in the second extent differ")
	}
	v.Release()
	other := id
	other.MtimeNs++
	if _, ok := tr.Lookup(other, [][2]int64{{0, 4096}}); ok {
		t.Fatal("another mtime hit")
	}
	if got := tr.Cached(other); got != 0 {
		t.Fatalf("Cached of another version: %d", got)
	}
	st := tr.Stats()
	if st.Hits != 3 || st.Misses != 3 || st.Files != 1 || st.CachedBytes != int64(len(data)) {
		t.Fatalf("stats %+v", st)
	}
}

// TestEvictionLRU: a pin that does not fit the budget evicts the uid's
// least recently used file; a hit counts as a use.
func TestEvictionLRU(t *testing.T) {
	dir := t.TempDir()
	tr, _ := newTier(t, 192*kib, 0)
	ctx := context.Background()
	var ids []Identity
	var files []*os.File
	for i := range 4 {
		_, f := writeFile(t, dir, fmt.Sprint("f", i), 64*kib, uint64(i))
		files, ids = append(files, f), append(ids, ident(t, f))
	}
	for i := range 3 {
		if _, err := tr.Pin(ctx, files[i], files[i].Name(), 7, 0, -1); err != nil {
			t.Fatal(err)
		}
	}
	v, ok := tr.Lookup(ids[0], [][2]int64{{0, 4096}}) // f0 is now the most recent
	if !ok {
		t.Fatal("f0 miss")
	}
	v.Release()
	if _, err := tr.Pin(ctx, files[3], files[3].Name(), 7, 0, -1); err != nil {
		t.Fatal(err)
	}
	want := []int64{64 * kib, 0, 64 * kib, 64 * kib} // f1 was the least recent
	for i, id := range ids {
		if got := tr.Cached(id); got != want[i] {
			t.Errorf("f%d: %d cached, want %d", i, got, want[i])
		}
	}
	if st := tr.Stats(); st.Evictions != 1 || st.UsedBytes != 192*kib {
		t.Errorf("stats %+v", st)
	}
}

// TestFairness: pins of one uid evict another's only while that one holds
// more than the pinner would; a pin that cannot fit evicts nothing.
func TestFairness(t *testing.T) {
	const ext = 64 * kib
	for _, tc := range []struct {
		name          string
		share         int64
		a, b          int // extents uid A pins first, then uid B
		wantA, wantB  int64
		wantErr       error
		wantEvictions uint64
	}{
		{"b takes down to equal shares", 0, 4, 2, 2 * ext, 2 * ext, nil, 2},
		{"b may not go past equal", 0, 4, 3, 4 * ext, 0, ErrFull, 0},
		{"room left: nobody evicted", 0, 2, 2, 2 * ext, 2 * ext, nil, 0},
		{"share caps a: its own oldest goes", 2 * ext, 3, 0, 2 * ext, 0, nil, 1},
		{"share caps b, a untouched", 2 * ext, 2, 3, 2 * ext, 0, ErrTooLarge, 0},
	} {
		t.Run(tc.name, func(t *testing.T) {
			dir := t.TempDir()
			tr, _ := newTier(t, 4*ext, tc.share)
			ctx := context.Background()
			pin := func(uid uint32, name string, n int) error {
				_, f := writeFile(t, dir, name, n*ext, uint64(uid))
				_, err := tr.Pin(ctx, f, f.Name(), uid, 0, -1)
				return err
			}
			var errA, errB error
			for i := range tc.a {
				if err := pin(1, fmt.Sprint("a", i), 1); err != nil {
					errA = err
				}
			}
			if tc.b > 0 {
				errB = pin(2, "b", tc.b)
			}
			err := errors.Join(errA, errB)
			if tc.wantErr == nil && err != nil || tc.wantErr != nil && !errors.Is(err, tc.wantErr) {
				t.Fatalf("pins: %v, want %v", err, tc.wantErr)
			}
			held := map[uint32]int64{}
			for _, u := range tr.Stats().UIDs {
				held[u.UID] = u.Bytes
			}
			if held[1] != tc.wantA || held[2] != tc.wantB {
				t.Errorf("uid 1 holds %d, uid 2 %d; want %d, %d", held[1], held[2], tc.wantA, tc.wantB)
			}
			if st := tr.Stats(); st.Evictions != tc.wantEvictions {
				t.Errorf("%d evictions, want %d", st.Evictions, tc.wantEvictions)
			}
		})
	}
}

// TestRefusalMessage: the refusal says how much the pin needs and what the
// uid may hold.
func TestRefusalMessage(t *testing.T) {
	tr, _ := newTier(t, 128*kib, 64*kib)
	_, f := writeFile(t, t.TempDir(), "big", 100*kib, 3)
	_, err := tr.Pin(context.Background(), f, f.Name(), 5, 0, -1)
	if !errors.Is(err, ErrTooLarge) || !strings.Contains(err.Error(), "needs 100 KiB") || !strings.Contains(err.Error(), "64 KiB") {
		t.Fatalf("pin beyond the share: %v", err)
	}
	if st := tr.Stats(); st.Files != 0 || st.Refused != 1 {
		t.Fatalf("after a refusal: %+v", st)
	}
}

// TestInvalidation: a change of the file (another identity), Invalidate
// and InvalidatePath each end hits at once.
func TestInvalidation(t *testing.T) {
	for _, tc := range []struct {
		name   string
		change func(tr *Tier, f *os.File, id Identity) Identity
	}{
		{"rewritten behind the tier", func(_ *Tier, f *os.File, id Identity) Identity {
			// Same size, new bytes; the mtime moves (set explicitly:
			// the test must not depend on the clock's granularity).
			if err := os.WriteFile(f.Name(), make([]byte, id.Size), 0o644); err != nil {
				panic(err)
			}
			tm := time.Unix(0, id.MtimeNs).Add(time.Second)
			if err := os.Chtimes(f.Name(), tm, tm); err != nil {
				panic(err)
			}
			now, err := Stat(f)
			if err != nil {
				panic(err)
			}
			return now
		}},
		{"Invalidate", func(tr *Tier, _ *os.File, id Identity) Identity { tr.Invalidate(id.Key); return id }},
		{"InvalidatePath", func(tr *Tier, f *os.File, id Identity) Identity { tr.InvalidatePath(f.Name()); return id }},
	} {
		t.Run(tc.name, func(t *testing.T) {
			tr, a := newTier(t, 1<<20, 0)
			_, f := writeFile(t, t.TempDir(), "x", 100*kib, 9)
			id := ident(t, f)
			if _, err := tr.Pin(context.Background(), f, f.Name(), 3, 0, -1); err != nil {
				t.Fatal(err)
			}
			now := tc.change(tr, f, id)
			if v, ok := tr.Lookup(now, [][2]int64{{0, 4096}}); ok {
				v.Release()
				t.Fatal("hit after the change")
			}
			if tc.name != "rewritten behind the tier" {
				if n := a.live.Load(); n != 0 {
					t.Errorf("%d extents still allocated after the invalidation", n)
				}
			}
		})
	}
}

// TestViewOutlivesInvalidation: memory under a hit is freed only when the
// hit is released (T3).
func TestViewOutlivesInvalidation(t *testing.T) {
	tr, a := newTier(t, 1<<20, 0)
	data, f := writeFile(t, t.TempDir(), "x", 64*kib, 2)
	id := ident(t, f)
	if _, err := tr.Pin(context.Background(), f, f.Name(), 3, 0, -1); err != nil {
		t.Fatal(err)
	}
	v, ok := tr.Lookup(id, [][2]int64{{0, 64 * kib}})
	if !ok {
		t.Fatal("miss")
	}
	tr.Invalidate(id.Key)
	if a.live.Load() != 1 || !bytes.Equal(viewBytes(t, v, 0, 64*kib), data) {
		t.Fatal("extent freed or changed under a view")
	}
	if tr.Cached(id) != 0 {
		t.Fatal("invalidated file still cached")
	}
	v.Release()
	v.Release()
	if a.live.Load() != 0 {
		t.Fatal("extent not freed at release")
	}
}

// TestCancelledPinKeepsWhatItFilled: a pin cancelled mid-way (its client
// killed) keeps the extents it filled, gives back the reservation of the
// rest, and a second pin completes it.
func TestCancelledPinKeepsWhatItFilled(t *testing.T) {
	tr, a := newTier(t, 1<<20, 0)
	data, f := writeFile(t, t.TempDir(), "x", 4*64*kib, 4)
	ctx, cancel := context.WithCancel(context.Background())
	calls := 0
	a.before = func(int64) {
		if calls++; calls == 2 {
			cancel() // during the second extent
		}
	}
	res, err := tr.Pin(ctx, f, f.Name(), 3, 0, -1)
	if !errors.Is(err, context.Canceled) || res.Cached != 64*kib {
		t.Fatalf("cancelled pin: %+v, %v", res, err)
	}
	checkInvariants(t, tr)
	a.before = nil
	if res, err = tr.Pin(context.Background(), f, f.Name(), 3, 0, -1); err != nil || res.Filled != 3*64*kib || res.Cached != int64(len(data)) {
		t.Fatalf("resumed pin: %+v, %v", res, err)
	}
}

// TestChangedWhilePinning: an extent read while the file changes is not
// kept (T2).
func TestChangedWhilePinning(t *testing.T) {
	tr, a := newTier(t, 1<<20, 0)
	_, f := writeFile(t, t.TempDir(), "x", 2*64*kib, 5)
	a.before = func(int64) {
		if err := os.WriteFile(f.Name(), []byte("shorter"), 0o644); err != nil {
			panic(err)
		}
	}
	_, err := tr.Pin(context.Background(), f, f.Name(), 3, 0, -1)
	if !errors.Is(err, ErrChanged) {
		t.Fatalf("pin of a file changing: %v", err)
	}
	a.before = nil
	if st := tr.Stats(); st.CachedBytes != 0 {
		t.Fatalf("kept %d bytes of a changed file", st.CachedBytes)
	}
}

// TestSettle: a file changed less than SettleTime ago is read only after
// the wait (a cancelled wait reads nothing).
func TestSettle(t *testing.T) {
	a := &countingAlloc{}
	_, f := writeFile(t, t.TempDir(), "x", 4096, 6)
	id := ident(t, f)
	tr, err := New(Config{BudgetBytes: 1 << 20, ChunkBytes: 64 * kib, Alloc: a, SettleTime: time.Hour,
		Now: func() time.Time { return time.Unix(0, id.CtimeNs) }})
	if err != nil {
		t.Fatal(err)
	}
	defer tr.Close()
	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	if _, err := tr.Pin(ctx, f, f.Name(), 1, 0, -1); !errors.Is(err, context.Canceled) || a.live.Load() != 0 {
		t.Fatalf("pin of a file changed just now: %v, %d extents", err, a.live.Load())
	}
}

// TestUnpin: a uid drops its own files; another uid's need root.
func TestUnpin(t *testing.T) {
	tr, _ := newTier(t, 1<<20, 0)
	_, f := writeFile(t, t.TempDir(), "x", 4096, 7)
	id := ident(t, f)
	if _, err := tr.Pin(context.Background(), f, f.Name(), 10001, 0, -1); err != nil {
		t.Fatal(err)
	}
	if _, err := tr.Unpin(id, 10002); !errors.Is(err, ErrNotOwner) {
		t.Fatalf("unpin by another uid: %v", err)
	}
	if n, err := tr.Unpin(id, 10001); err != nil || n != 4096 || tr.Cached(id) != 0 {
		t.Fatalf("unpin by its uid: %d, %v", n, err)
	}
}

// TestDisabled: a tier of no budget refuses pins and never hits.
func TestDisabled(t *testing.T) {
	tr, err := New(Config{})
	if err != nil {
		t.Fatal(err)
	}
	_, f := writeFile(t, t.TempDir(), "x", 4096, 8)
	if _, err := tr.Pin(context.Background(), f, f.Name(), 1, 0, -1); !errors.Is(err, ErrDisabled) {
		t.Fatalf("pin: %v", err)
	}
	if _, ok := tr.Lookup(ident(t, f), [][2]int64{{0, 4096}}); ok {
		t.Fatal("hit")
	}
	var nilTier *Tier
	if nilTier.Enabled() {
		t.Fatal("nil tier enabled")
	}
}

// hostSlab is host slab memory for Engine tests.
type hostSlab []byte

func (m hostSlab) Size() int64             { return int64(len(m)) }
func (m hostSlab) Export() ([]byte, error) { return nil, nil }
func (m hostSlab) Close() error            { return nil }
func (m hostSlab) HostBytes() []byte       { return m }

var (
	_ gpubuf.Memory     = hostSlab(nil)
	_ gpubuf.HostMemory = hostSlab(nil)
)

// TestEngineReadAt: the engine copies the view's bytes into a slab like
// any engine: short only at end of file, never past the slab.
func TestEngineReadAt(t *testing.T) {
	tr, _ := newTier(t, 1<<20, 0)
	data, f := writeFile(t, t.TempDir(), "x", 100*kib+7, 11)
	if _, err := tr.Pin(context.Background(), f, f.Name(), 3, 0, -1); err != nil {
		t.Fatal(err)
	}
	v, ok := tr.Lookup(ident(t, f), [][2]int64{{0, 104 * kib}})
	if !ok {
		t.Fatal("miss")
	}
	defer v.Release()
	e := Engine{View: v, Copier: HostCopier{}}
	slab := make(hostSlab, 256*kib)
	n, err := e.ReadAt(context.Background(), f, slab, 8*kib, 60*kib, 44*kib)
	if err != nil || n != int64(len(data))-60*kib || !bytes.Equal(slab[8*kib:8*kib+n], data[60*kib:]) {
		t.Fatalf("ReadAt across an extent boundary to EOF: %d, %v", n, err)
	}
	if _, err := e.ReadAt(context.Background(), f, slab, 250*kib, 0, 8*kib); err == nil {
		t.Fatal("ReadAt past the slab's end succeeded")
	}
	if _, err := e.WriteAt(context.Background(), f, slab, 0, 0, 1); !errors.Is(err, ErrReadOnly) {
		t.Fatalf("WriteAt: %v", err)
	}
}

// TestConcurrent: pins (whole and partial), hits, invalidations and
// unpins (root's, and each uid's own of co-pinned files) of a few files by
// a few uids at once keep the accounting (run with -race).
func TestConcurrent(t *testing.T) {
	tr, _ := newTier(t, 6*64*kib, 3*64*kib)
	dir := t.TempDir()
	var files []*os.File
	var ids []Identity
	var datas [][]byte
	for i := range 4 {
		d, f := writeFile(t, dir, fmt.Sprint("f", i), 2*64*kib, uint64(20+i))
		files, ids, datas = append(files, f), append(ids, ident(t, f)), append(datas, d)
	}
	ctx := context.Background()
	done := make(chan struct{})
	for w := range 4 {
		go func() {
			defer func() { done <- struct{}{} }()
			r := rand.New(rand.NewPCG(uint64(w), 2))
			for range 200 {
				i := r.IntN(len(files))
				switch r.IntN(6) {
				case 0:
					_, _ = tr.Pin(ctx, files[i], files[i].Name(), uint32(1+w%2), 0, -1)
				case 1:
					tr.Invalidate(ids[i].Key)
				case 2:
					_, _ = tr.Unpin(ids[i], 0)
				case 3:
					// One uid's pins of a file others pinned too.
					_, _ = tr.UnpinOwn(ids[i], uint32(1+w%2))
				case 4:
					_, _ = tr.Pin(ctx, files[i], files[i].Name(), uint32(1+w%2), 64*kib*int64(r.IntN(2)), 64*kib)
				default:
					if v, ok := tr.Lookup(ids[i], [][2]int64{{0, 128 * kib}}); ok {
						if got := viewBytes(t, v, 0, 128*kib); !bytes.Equal(got, datas[i]) {
							t.Errorf("f%d: a hit returned other bytes", i)
						}
						v.Release()
					}
				}
			}
		}()
	}
	for range 4 {
		<-done
	}
}

// TestPinOfHeldRangesChargesThePinner: a second user pinning what a first
// user already holds reads nothing and allocates nothing (the budget
// counts the memory once), but is charged for it, as if its pin had read
// it (its share and STATUS figure do not depend on the other user's pin).
// Before, it was charged nothing and appeared in no per-user charge.
func TestPinOfHeldRangesChargesThePinner(t *testing.T) {
	dir := t.TempDir()
	tr, _ := newTier(t, 1<<20, 512*kib)
	_, f := writeFile(t, dir, "a", 128*kib, 3)
	ctx := context.Background()
	if _, err := tr.Pin(ctx, f, f.Name(), 1, 0, -1); err != nil {
		t.Fatal(err)
	}
	res, err := tr.Pin(ctx, f, f.Name(), 2, 0, -1)
	if err != nil || res.Filled != 0 || res.Cached != 128*kib || res.Mine != 128*kib || res.MineFilled != 128*kib {
		t.Fatalf("second user's pin: %+v, %v", res, err)
	}
	st := tr.Stats()
	if st.UsedBytes != 128*kib || fmt.Sprint(st.UIDs) != fmt.Sprint([]UIDStats{{1, 128 * kib}, {2, 128 * kib}}) {
		t.Errorf("after both pins: %d bytes used, charges %v; want the memory once, both charged", st.UsedBytes, st.UIDs)
	}
}
