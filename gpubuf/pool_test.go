package gpubuf

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"math/rand/v2"
	"os"
	"path/filepath"
	"runtime"
	"runtime/debug"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"
	"unsafe"

	"github.com/rs/zerolog"
)

// fakeBackend is an in-process Backend whose memory is plain byte slices.
// It records the uid each memory was allocated for so tests can check
// isolation (I1).
type fakeBackend struct {
	devices int
	mu      sync.Mutex
	live    map[*fakeMemory]bool
	failAt  int // fail the Nth Alloc (1-based); 0 never
	allocs  int
	// gate, when set, makes Alloc send on entered and wait for gate to be
	// closed: tests hold allocations in flight.
	gate, entered chan struct{}
}

func newFakeBackend(devices int) *fakeBackend {
	return &fakeBackend{devices: devices, live: map[*fakeMemory]bool{}}
}

func (b *fakeBackend) Name() string { return "fake" }
func (b *fakeBackend) Devices() int { return b.devices }
func (b *fakeBackend) Alloc(_ context.Context, device int, size int64, uid uint32) (Memory, error) {
	if b.gate != nil {
		b.entered <- struct{}{}
		<-b.gate
	}
	b.mu.Lock()
	defer b.mu.Unlock()
	b.allocs++
	if b.allocs == b.failAt {
		return nil, errors.New("fake: out of device memory")
	}
	m := &fakeMemory{b: b, data: make([]byte, size), uid: uid}
	b.live[m] = true
	return m, nil
}

func (b *fakeBackend) liveCount() int {
	b.mu.Lock()
	defer b.mu.Unlock()
	return len(b.live)
}

type fakeMemory struct {
	b      *fakeBackend
	data   []byte
	uid    uint32 // the uid it was allocated for; never changes
	mu     sync.Mutex
	closed bool
}

func (m *fakeMemory) Size() int64             { return int64(len(m.data)) }
func (m *fakeMemory) HostBytes() []byte       { return m.data }
func (m *fakeMemory) Export() ([]byte, error) { return []byte(fmt.Sprintf("fake-%p", m)), nil }
func (m *fakeMemory) Close() error {
	m.mu.Lock()
	defer m.mu.Unlock()
	if m.closed {
		return errors.New("fake: double close")
	}
	m.closed = true
	m.b.mu.Lock()
	delete(m.b.live, m)
	m.b.mu.Unlock()
	return nil
}

const testSlab = 64 * Align

// newTestPool returns a pool of two devices with a budget of budgetSlabs
// slabs each, every uid allowed the whole budget.
func newTestPool(t *testing.T, budgetSlabs int64) (*Pool, *fakeBackend) {
	t.Helper()
	return newSharePool(t, Config{BudgetBytes: budgetSlabs * testSlab, UIDShareBytes: budgetSlabs * testSlab})
}

// newSharePool returns a pool of two devices configured by cfg (Backend
// and SlabBytes filled in), checked and closed at the end of the test.
func newSharePool(t *testing.T, cfg Config) (*Pool, *fakeBackend) {
	t.Helper()
	b := newFakeBackend(2)
	cfg.Backend, cfg.SlabBytes = b, testSlab
	p, err := NewPool(cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		if err := p.checkInvariants(); err != nil {
			t.Errorf("invariants at end: %v", err)
		}
		if err := p.Close(); err != nil {
			t.Errorf("close: %v", err)
		}
		if n := b.liveCount(); n != 0 {
			t.Errorf("%d slabs leaked after Close", n)
		}
	})
	return p, b
}

func mustAlloc(t *testing.T, p *Pool, o Owner, dev int, n int64) *Lease {
	t.Helper()
	l, err := p.Alloc(context.Background(), o, dev, n)
	if err != nil {
		t.Fatalf("Alloc(%+v, %d, %d): %v", o, dev, n, err)
	}
	return l
}

func TestAllocAlignment(t *testing.T) {
	p, _ := newTestPool(t, 4)
	o := Owner{Session: 1, UID: 1000}
	for _, tc := range []struct {
		name    string
		n, want int64
	}{
		{"one byte", 1, Align},
		{"one page", Align, Align},
		{"page plus one", Align + 1, 2 * Align},
		{"odd", 3*Align + 17, 4 * Align},
		{"whole slab", testSlab, testSlab},
	} {
		t.Run(tc.name, func(t *testing.T) {
			l := mustAlloc(t, p, o, 0, tc.n)
			if l.Length != tc.want || l.Offset%Align != 0 || l.Offset+l.Length > l.Slab.Size {
				t.Errorf("lease %+v: want length %d at an aligned offset inside the slab", *l, tc.want)
			}
			if l.Owner != o || l.Slab.Device != 0 {
				t.Errorf("lease owner %+v device %d", l.Owner, l.Slab.Device)
			}
		})
	}
	if err := p.checkInvariants(); err != nil {
		t.Fatal(err)
	}
}

func TestAllocRejectsBadRequests(t *testing.T) {
	p, _ := newTestPool(t, 2)
	o := Owner{Session: 1, UID: 1}
	for _, tc := range []struct {
		name   string
		dev    int
		n      int64
		wantEx bool
	}{
		{"zero", 0, 0, false},
		{"negative", 0, -5, false},
		{"no such device", 7, 10, false},
		{"negative device", -1, 10, false},
		{"over budget", 0, 3 * testSlab, true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			_, err := p.Alloc(context.Background(), o, tc.dev, tc.n)
			if err == nil {
				t.Fatal("Alloc succeeded")
			}
			if got := errors.Is(err, ErrExhausted); got != tc.wantEx {
				t.Errorf("errors.Is(%v, ErrExhausted) = %v, want %v", err, got, tc.wantEx)
			}
		})
	}
}

func TestBestFitAndCoalescing(t *testing.T) {
	p, b := newTestPool(t, 1)
	o := Owner{Session: 1, UID: 1}
	a := mustAlloc(t, p, o, 0, 8*Align)
	small := mustAlloc(t, p, o, 0, 2*Align)
	c := mustAlloc(t, p, o, 0, 8*Align)
	rest := mustAlloc(t, p, o, 0, testSlab-18*Align)
	if a.Slab != rest.Slab {
		t.Fatal("leases of one uid should share the slab")
	}
	// Free a 2-page hole and an 8-page hole; a 2-page request must take the
	// small hole (best fit), keeping the large one whole.
	if err := p.Release(o, small.ID); err != nil {
		t.Fatal(err)
	}
	if err := p.Release(o, a.ID); err != nil {
		t.Fatal(err)
	}
	// a and small were adjacent: they coalesced into one 10-page extent.
	if got := len(a.Slab.free); got != 1 {
		t.Fatalf("free extents after adjacent releases: %d, want 1 (%v)", got, a.Slab.free)
	}
	x := mustAlloc(t, p, o, 0, 10*Align)
	if x.Offset != 0 {
		t.Errorf("coalesced extent not reused: offset %d", x.Offset)
	}
	if _, err := p.Alloc(context.Background(), o, 0, Align); !errors.Is(err, ErrExhausted) {
		t.Fatalf("full pool: got %v, want ErrExhausted", err)
	}
	for _, l := range []*Lease{x, c, rest} {
		if err := p.Release(o, l.ID); err != nil {
			t.Fatal(err)
		}
	}
	if len(x.Slab.free) != 1 || x.Slab.free[0] != (extent{0, testSlab}) {
		t.Errorf("empty slab free list %v, want one whole extent", x.Slab.free)
	}
	if b.liveCount() != 1 {
		t.Errorf("regular slabs are kept when empty: live %d, want 1", b.liveCount())
	}
}

func TestExhaustionIsImmediateAndRecoverable(t *testing.T) {
	p, _ := newTestPool(t, 2)
	o := Owner{Session: 9, UID: 5}
	var held []*Lease
	for range 2 * 64 {
		held = append(held, mustAlloc(t, p, o, 0, Align))
	}
	_, err := p.Alloc(context.Background(), o, 0, Align)
	if !errors.Is(err, ErrExhausted) {
		t.Fatalf("got %v, want ErrExhausted", err)
	}
	// Device 1 has its own budget.
	mustAlloc(t, p, o, 1, Align)
	if err := p.Release(o, held[10].ID); err != nil {
		t.Fatal(err)
	}
	l := mustAlloc(t, p, o, 0, Align)
	if l.Slab != held[10].Slab || l.Offset != held[10].Offset {
		t.Errorf("freed page not reused: got slab %d off %d", l.Slab.ID, l.Offset)
	}
}

// TestUIDIsolation (I1): memory one uid could ever map is never handed to
// another. An idle slab of alice is freed (closed) to make room for bob,
// who gets new memory allocated for him; alice's memory is never reused.
func TestUIDIsolation(t *testing.T) {
	p, b := newTestPool(t, 1)
	alice := Owner{Session: 1, UID: 1001}
	bob := Owner{Session: 2, UID: 1002}
	la := mustAlloc(t, p, alice, 0, Align)
	mem := la.Slab.Memory.(*fakeMemory)
	copy(mem.data[la.Offset:], "alice's secret")
	// The only slab serves alice: bob cannot get any of it while she holds a lease.
	if _, err := p.Alloc(context.Background(), bob, 0, Align); !errors.Is(err, ErrExhausted) {
		t.Fatalf("bob got memory from alice's slab: %v", err)
	}
	if err := p.Release(alice, la.ID); err != nil {
		t.Fatal(err)
	}
	// Same uid: the idle slab is reused as is.
	again := mustAlloc(t, p, alice, 0, Align)
	if again.Slab != la.Slab {
		t.Errorf("alice's idle slab was not reused for alice")
	}
	if err := p.Release(alice, again.ID); err != nil {
		t.Fatal(err)
	}
	lb := mustAlloc(t, p, bob, 0, testSlab)
	if lb.Slab == la.Slab || lb.Slab.Memory == la.Slab.Memory {
		t.Fatal("alice's slab was handed to bob")
	}
	if !mem.closed {
		t.Error("alice's idle slab was not freed to make room for bob")
	}
	bm := lb.Slab.Memory.(*fakeMemory)
	if bm.uid != bob.UID || lb.Slab.UID() != bob.UID {
		t.Errorf("bob's slab: memory for uid %d, slab uid %d; want %d", bm.uid, lb.Slab.UID(), bob.UID)
	}
	if bytes.Contains(bm.data, []byte("alice")) {
		t.Error("alice's bytes in bob's memory")
	}
	if _, err := p.Slab(la.Slab.ID); !errors.Is(err, ErrNotFound) {
		t.Errorf("freed slab %d still known: %v", la.Slab.ID, err)
	}
	if _, err := p.Export(alice, lb.Slab.ID); !errors.Is(err, ErrNotFound) {
		t.Errorf("alice exported bob's slab: %v", err)
	}
	if _, err := p.Export(Owner{Session: bob.Session, UID: alice.UID}, lb.Slab.ID); !errors.Is(err, ErrNotFound) {
		t.Errorf("bob's session with alice's uid exported bob's slab: %v", err)
	}
	st := p.Stats()
	if st.Devices[0].FreedSlabs != 1 {
		t.Errorf("freed slabs %d, want 1", st.Devices[0].FreedSlabs)
	}
	if b.liveCount() != 1 {
		t.Errorf("live memories %d, want bob's 1", b.liveCount())
	}
}

// TestUIDShare (issue 12, item 9): a uid holding its whole share is
// refused more (ErrExhausted) and leaves the rest of the pool to others.
func TestUIDShare(t *testing.T) {
	for _, tc := range []struct {
		name               string
		budget, share, got int64 // in slabs; share 0: the default
	}{
		{"default half", 4, 0, 2},
		{"default rounds up to a slab", 3, 0, 2},
		{"one slab pool", 1, 0, 1},
		{"explicit", 4, 1, 1},
		{"explicit rounds up", 4, 1, 1},
		{"whole pool", 4, 4, 4},
		{"capped at the budget", 4, 9, 4},
	} {
		t.Run(tc.name, func(t *testing.T) {
			share := tc.share * testSlab
			if tc.name == "explicit rounds up" {
				share = testSlab/2 + Align
			}
			p, _ := newSharePool(t, Config{BudgetBytes: tc.budget * testSlab, UIDShareBytes: share})
			if got := p.MaxLeaseBytes(); got != tc.got*testSlab {
				t.Errorf("MaxLeaseBytes %d, want %d slabs", got, tc.got)
			}
			alice := Owner{Session: 1, UID: 1}
			for range tc.got {
				mustAlloc(t, p, alice, 0, testSlab)
			}
			_, err := p.Alloc(context.Background(), alice, 0, Align)
			if !errors.Is(err, ErrExhausted) {
				t.Fatalf("alloc beyond the share: %v, want ErrExhausted", err)
			}
			if tc.got < tc.budget && !strings.Contains(err.Error(), "share") {
				t.Errorf("refusal %q does not name the share", err)
			}
			if tc.got < tc.budget {
				bob := Owner{Session: 2, UID: 2}
				mustAlloc(t, p, bob, 0, testSlab)
			}
			st := p.Stats()
			if st.Devices[0].UIDShareBytes != tc.got*testSlab {
				t.Errorf("stats share %d, want %d", st.Devices[0].UIDShareBytes, tc.got*testSlab)
			}
			if st.UIDs[0].UID != 1 || st.UIDs[0].Refused != 1 || st.UIDs[0].AllocatedBytes != tc.got*testSlab {
				t.Errorf("alice's stats %+v, want 1 refusal and %d slabs", st.UIDs[0], tc.got)
			}
		})
	}
}

// TestShareCountsIdleAndDedicatedSlabs: the share bounds a uid's slabs, idle
// or not, regular or dedicated; its own idle slabs are freed to fit a
// dedicated one within it.
func TestShareCountsIdleAndDedicatedSlabs(t *testing.T) {
	p, b := newSharePool(t, Config{BudgetBytes: 4 * testSlab, UIDShareBytes: 2 * testSlab})
	alice := Owner{Session: 1, UID: 1}
	l1 := mustAlloc(t, p, alice, 0, testSlab)
	l2 := mustAlloc(t, p, alice, 0, testSlab)
	for _, l := range []*Lease{l1, l2} {
		if err := p.Release(alice, l.ID); err != nil {
			t.Fatal(err)
		}
	}
	// Two idle slabs of alice; a 1.5-slab lease fits her share once both go.
	big := mustAlloc(t, p, alice, 0, testSlab+testSlab/2)
	if !big.Slab.Dedicated || b.liveCount() != 1 {
		t.Fatalf("dedicated %v, live %d: want alice's idle slabs freed for it", big.Slab.Dedicated, b.liveCount())
	}
	if _, err := p.Alloc(context.Background(), alice, 0, testSlab); !errors.Is(err, ErrExhausted) {
		t.Fatalf("alice beyond her share with a dedicated slab: %v", err)
	}
	if _, err := p.Alloc(context.Background(), alice, 0, 2*testSlab+Align); !errors.Is(err, ErrExhausted) || !strings.Contains(err.Error(), "exceeds") {
		t.Errorf("a lease larger than the share: %v, want ErrExhausted naming it", err)
	}
}

// TestReclaimFromTheLargestHolder (item 9): with the budget spent, a uid
// within its share gets memory by freeing an idle slab of the uid holding
// the most, never a leased one.
func TestReclaimFromTheLargestHolder(t *testing.T) {
	p, _ := newSharePool(t, Config{BudgetBytes: 4 * testSlab, UIDShareBytes: 3 * testSlab})
	small := Owner{Session: 1, UID: 1}
	large := Owner{Session: 2, UID: 2}
	late := Owner{Session: 3, UID: 3}
	ls := mustAlloc(t, p, small, 0, testSlab)
	var ll []*Lease
	for range 3 {
		ll = append(ll, mustAlloc(t, p, large, 0, testSlab))
	}
	// Everything leased: nothing to free.
	if _, err := p.Alloc(context.Background(), late, 0, Align); !errors.Is(err, ErrExhausted) {
		t.Fatalf("full pool: %v", err)
	}
	for _, l := range []*Lease{ls, ll[0]} {
		owner := small
		if l != ls {
			owner = large
		}
		if err := p.Release(owner, l.ID); err != nil {
			t.Fatal(err)
		}
	}
	got := mustAlloc(t, p, late, 0, Align)
	if _, err := p.Slab(ll[0].Slab.ID); !errors.Is(err, ErrNotFound) {
		t.Errorf("the largest holder's idle slab was kept")
	}
	if _, err := p.Slab(ls.Slab.ID); err != nil {
		t.Errorf("the small holder's idle slab was freed first: %v", err)
	}
	if got.Slab.UID() != late.UID {
		t.Errorf("new slab serves uid %d", got.Slab.UID())
	}
	var freed uint64
	for _, u := range p.Stats().UIDs {
		if u.UID == large.UID {
			freed = u.FreedSlabs
		}
	}
	if freed != 1 {
		t.Errorf("large holder's freed slabs %d, want 1", freed)
	}
}

// TestExhaustionLogIsRateLimited (item 10): a client retrying a refused
// Alloc in a loop makes one warning per period, and the next one counts
// those suppressed.
func TestExhaustionLogIsRateLimited(t *testing.T) {
	var logBuf bytes.Buffer
	now := time.Unix(1000, 0)
	p, _ := newSharePool(t, Config{BudgetBytes: testSlab, UIDShareBytes: testSlab,
		Log: zerolog.New(&logBuf), LogEvery: time.Minute, Now: func() time.Time { return now }})
	o := Owner{Session: 1, UID: 1}
	mustAlloc(t, p, o, 0, testSlab)
	refuse := func(n int) {
		for range n {
			if _, err := p.Alloc(context.Background(), o, 0, Align); !errors.Is(err, ErrExhausted) {
				t.Fatalf("got %v, want ErrExhausted", err)
			}
		}
	}
	refuse(1000)
	if n := strings.Count(logBuf.String(), "\n"); n != 1 {
		t.Fatalf("%d log lines for 1000 refusals in one period, want 1:\n%s", n, logBuf.String())
	}
	now = now.Add(time.Minute)
	refuse(1)
	lines := strings.Split(strings.TrimSpace(logBuf.String()), "\n")
	if len(lines) != 2 || !strings.Contains(lines[1], `"similar_suppressed":999`) || !strings.Contains(lines[1], `"uid_refusals":1001`) {
		t.Errorf("second line %q, want 999 suppressed and 1001 refusals", lines[len(lines)-1])
	}
	// Another uid's refusals are their own line.
	if _, err := p.Alloc(context.Background(), Owner{Session: 2, UID: 2}, 0, Align); !errors.Is(err, ErrExhausted) {
		t.Fatal(err)
	}
	if n := strings.Count(logBuf.String(), "\n"); n != 3 {
		t.Errorf("%d lines after another uid's refusal, want 3", n)
	}
}

func TestLeasesBelongToTheirSession(t *testing.T) {
	p, _ := newTestPool(t, 2)
	s1 := Owner{Session: 1, UID: 7}
	s2 := Owner{Session: 2, UID: 7}
	l := mustAlloc(t, p, s1, 0, Align)
	for _, tc := range []struct {
		name  string
		owner Owner
	}{
		{"other session same uid", s2},
		{"same session other uid", Owner{Session: 1, UID: 8}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			if _, err := p.Lookup(tc.owner, l.ID); !errors.Is(err, ErrNotFound) {
				t.Errorf("Lookup: %v, want ErrNotFound", err)
			}
			if err := p.Release(tc.owner, l.ID); !errors.Is(err, ErrNotFound) {
				t.Errorf("Release: %v, want ErrNotFound", err)
			}
			if _, err := p.Export(tc.owner, l.Slab.ID); !errors.Is(err, ErrNotFound) {
				t.Errorf("Export: %v, want ErrNotFound", err)
			}
		})
	}
	got, err := p.Lookup(s1, l.ID)
	if err != nil || got != l {
		t.Fatalf("Lookup by owner: %v %v", got, err)
	}
	if tok, err := p.Export(s1, l.Slab.ID); err != nil || len(tok) == 0 {
		t.Fatalf("Export by owner: %q %v", tok, err)
	}
	if err := p.Release(s1, l.ID); err != nil {
		t.Fatal(err)
	}
	if err := p.Release(s1, l.ID); !errors.Is(err, ErrNotFound) {
		t.Errorf("double release: %v, want ErrNotFound", err)
	}
	if s, err := p.Slab(l.Slab.ID); err != nil || s != l.Slab {
		t.Errorf("Slab(%d) = %v, %v", l.Slab.ID, s, err)
	}
	if _, err := p.Slab(999); !errors.Is(err, ErrNotFound) {
		t.Errorf("Slab(999): %v", err)
	}
}

func TestReleaseSession(t *testing.T) {
	p, _ := newTestPool(t, 4)
	a := Owner{Session: 10, UID: 1}
	b := Owner{Session: 26, UID: 1} // same shard as 10
	for range 5 {
		mustAlloc(t, p, a, 0, 3*Align)
	}
	keep := mustAlloc(t, p, b, 0, Align)
	if n := p.ReleaseSession(a.Session); n != 5 {
		t.Errorf("ReleaseSession released %d, want 5", n)
	}
	if n := p.ReleaseSession(a.Session); n != 0 {
		t.Errorf("second ReleaseSession released %d, want 0", n)
	}
	if _, err := p.Lookup(b, keep.ID); err != nil {
		t.Errorf("other session's lease lost: %v", err)
	}
	st := p.Stats()
	if len(st.Sessions) != 1 || st.Sessions[0].Session != b.Session || st.Devices[0].LeasedBytes != Align {
		t.Errorf("stats after ReleaseSession: %+v", st)
	}
}

func TestDedicatedSlabs(t *testing.T) {
	p, b := newTestPool(t, 4)
	o := Owner{Session: 1, UID: 1}
	small := mustAlloc(t, p, o, 0, Align)
	if err := p.Release(o, small.ID); err != nil {
		t.Fatal(err)
	}
	// 3.5 slabs: needs the idle regular slab evicted to fit the budget of 4
	// only if more than 3 are in use; here 1 idle + 3.5 > 4, so it is evicted.
	big := mustAlloc(t, p, o, 0, 3*testSlab+testSlab/2)
	if !big.Slab.Dedicated || big.Offset != 0 || big.Length != 3*testSlab+testSlab/2 {
		t.Fatalf("big lease %+v, dedicated %v", *big, big.Slab.Dedicated)
	}
	if _, err := p.Slab(small.Slab.ID); !errors.Is(err, ErrNotFound) {
		t.Error("idle slab was not evicted to make room")
	}
	if _, err := p.Alloc(context.Background(), o, 0, testSlab); !errors.Is(err, ErrExhausted) {
		t.Fatalf("got %v, want ErrExhausted", err)
	}
	if err := p.Release(o, big.ID); err != nil {
		t.Fatal(err)
	}
	if b.liveCount() != 0 {
		t.Errorf("dedicated slab not freed on release: %d live", b.liveCount())
	}
	if st := p.Stats(); st.Devices[0].AllocatedBytes != 0 {
		t.Errorf("allocated bytes %d after freeing everything", st.Devices[0].AllocatedBytes)
	}
}

func TestBackendFailureRestoresBudget(t *testing.T) {
	p, b := newTestPool(t, 1)
	b.failAt = 1
	o := Owner{Session: 1, UID: 1}
	if _, err := p.Alloc(context.Background(), o, 0, Align); err == nil || errors.Is(err, ErrExhausted) {
		t.Fatalf("got %v, want the backend's error", err)
	}
	mustAlloc(t, p, o, 0, Align) // the budget was given back
}

func TestStats(t *testing.T) {
	p, _ := newTestPool(t, 4)
	mustAlloc(t, p, Owner{Session: 1, UID: 10}, 0, Align)
	mustAlloc(t, p, Owner{Session: 1, UID: 10}, 0, 2*Align)
	mustAlloc(t, p, Owner{Session: 2, UID: 10}, 1, Align)
	mustAlloc(t, p, Owner{Session: 3, UID: 20}, 0, 5*Align)
	st := p.Stats()
	want := Stats{
		Backend: "fake", SlabBytes: testSlab,
		Devices: []DeviceStats{
			{Device: 0, BudgetBytes: 4 * testSlab, AllocatedBytes: 2 * testSlab, LeasedBytes: 8 * Align, Slabs: 2, SlabsInUse: 2, Leases: 3, UIDShareBytes: 4 * testSlab},
			{Device: 1, BudgetBytes: 4 * testSlab, AllocatedBytes: testSlab, LeasedBytes: Align, Slabs: 1, SlabsInUse: 1, Leases: 1, UIDShareBytes: 4 * testSlab},
		},
		Sessions: []SessionStats{{1, 10, 2, 3 * Align}, {2, 10, 1, Align}, {3, 20, 1, 5 * Align}},
		UIDs: []UIDStats{{UID: 10, Sessions: 2, LeasedBytes: 4 * Align, AllocatedBytes: 2 * testSlab},
			{UID: 20, Sessions: 1, LeasedBytes: 5 * Align, AllocatedBytes: testSlab}},
	}
	if fmt.Sprint(st) != fmt.Sprint(want) {
		t.Errorf("Stats:\n got %+v\nwant %+v", st, want)
	}
}

// TestStatsListsAreNeverNull: clients iterate over the JSON's lists (the
// GPU check crashed on "sessions": null once every lease was released).
func TestStatsListsAreNeverNull(t *testing.T) {
	p, _ := newTestPool(t, 1)
	b, err := json.Marshal(p.Stats())
	if err != nil {
		t.Fatal(err)
	}
	if !strings.Contains(string(b), `"uids":[]`) {
		t.Errorf("empty pool's stats JSON %s lacks \"uids\":[]", b)
	}
	l := mustAlloc(t, p, Owner{Session: 1, UID: 1}, 0, Align)
	if err := p.Release(Owner{Session: 1, UID: 1}, l.ID); err != nil {
		t.Fatal(err)
	}
	b, err = json.Marshal(p.Stats())
	if err != nil {
		t.Fatal(err)
	}
	for _, want := range []string{`"sessions":[]`, `"uids":[`} {
		if !strings.Contains(string(b), want) {
			t.Errorf("stats JSON %s lacks %s", b, want)
		}
	}
}

// TestConcurrentFirstAllocsShareASlab is the regression test of a pool with
// budget for one slab that refused requests while its first slab was being
// allocated: every concurrent request reserved a slab of its own, so all but
// the first found the budget spent ("0 of N bytes leased, 0 slabs").
func TestConcurrentFirstAllocsShareASlab(t *testing.T) {
	p, b := newTestPool(t, 1)
	b.gate, b.entered = make(chan struct{}), make(chan struct{}, 16)
	const n = 8
	o := Owner{Session: 1, UID: 7}
	errs := make(chan error, n)
	var wg sync.WaitGroup
	alloc := func() {
		_, err := p.Alloc(context.Background(), o, 0, testSlab/n)
		errs <- err
	}
	wg.Go(alloc)
	<-b.entered // the first request's slab is being allocated
	for range n - 1 {
		wg.Go(alloc)
	}
	// Wait until the others count on that slab rather than failing.
	dev := p.devices[0]
	for {
		dev.mu.Lock()
		promised := int64(0)
		if len(dev.pending) == 1 {
			promised = dev.pending[0].promised
		}
		dev.mu.Unlock()
		if promised == testSlab {
			break
		}
		select {
		case err := <-errs:
			t.Fatalf("a request returned while the first slab was being allocated: %v", err)
		default:
			runtime.Gosched()
		}
	}
	close(b.gate)
	wg.Wait()
	close(errs)
	for err := range errs {
		if err != nil {
			t.Error(err)
		}
	}
	if b.allocs != 1 {
		t.Errorf("%d slabs allocated, want 1", b.allocs)
	}
	// A ninth request finds the budget really spent.
	if _, err := p.Alloc(context.Background(), o, 0, Align); !errors.Is(err, ErrExhausted) {
		t.Errorf("Alloc on a full pool: %v, want ErrExhausted", err)
	}
	p.ReleaseSession(o.Session)
}

// TestPendingSlabFailureWakesWaiters: requests waiting for a slab whose
// allocation fails are not stuck; they try again themselves.
func TestPendingSlabFailureWakesWaiters(t *testing.T) {
	p, b := newTestPool(t, 1)
	b.gate, b.entered = make(chan struct{}), make(chan struct{}, 16)
	b.failAt = 1
	o := Owner{Session: 1, UID: 7}
	first := make(chan error, 1)
	go func() {
		_, err := p.Alloc(context.Background(), o, 0, Align)
		first <- err
	}()
	<-b.entered
	second := make(chan error, 1)
	go func() {
		_, err := p.Alloc(context.Background(), o, 0, Align)
		second <- err
	}()
	for {
		dev := p.devices[0]
		dev.mu.Lock()
		joined := len(dev.pending) == 1 && dev.pending[0].promised == 2*Align
		dev.mu.Unlock()
		if joined {
			break
		}
		runtime.Gosched()
	}
	b.gate <- struct{}{} // the first allocation fails
	if err := <-first; err == nil {
		t.Fatal("first Alloc succeeded, want the backend's error")
	}
	<-b.entered // the waiter allocates a slab itself
	close(b.gate)
	if err := <-second; err != nil {
		t.Fatalf("waiting Alloc: %v", err)
	}
	p.ReleaseSession(o.Session)
}

// TestPendingSlabWaitHonoursContext: a request waiting for a slab in flight
// returns when its context ends.
func TestPendingSlabWaitHonoursContext(t *testing.T) {
	p, b := newTestPool(t, 1)
	b.gate, b.entered = make(chan struct{}), make(chan struct{}, 16)
	o := Owner{Session: 1, UID: 7}
	first := make(chan error, 1)
	go func() {
		_, err := p.Alloc(context.Background(), o, 0, Align)
		first <- err
	}()
	<-b.entered
	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	if _, err := p.Alloc(ctx, o, 0, Align); !errors.Is(err, context.Canceled) {
		t.Errorf("Alloc with a cancelled context while a slab is in flight: %v, want context.Canceled", err)
	}
	close(b.gate)
	if err := <-first; err != nil {
		t.Fatal(err)
	}
	p.ReleaseSession(o.Session)
}

func TestConfigValidate(t *testing.T) {
	b := newFakeBackend(1)
	for _, tc := range []struct {
		name string
		cfg  Config
		ok   bool
	}{
		{"defaults", Config{Backend: b}, true},
		{"no backend", Config{}, false},
		{"unaligned slab", Config{Backend: b, SlabBytes: 1000}, false},
		{"negative budget", Config{Backend: b, BudgetBytes: -Align}, false},
		{"budget below slab", Config{Backend: b, SlabBytes: 2 * Align, BudgetBytes: Align}, false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			if err := tc.cfg.Validate(); (err == nil) != tc.ok {
				t.Errorf("Validate() = %v, want ok=%v", err, tc.ok)
			}
		})
	}
}

func TestClosedPool(t *testing.T) {
	p, _ := newTestPool(t, 1)
	mustAlloc(t, p, Owner{Session: 1, UID: 1}, 0, Align)
	if err := p.Close(); err != nil {
		t.Fatal(err)
	}
	if _, err := p.Alloc(context.Background(), Owner{Session: 1, UID: 1}, 0, Align); !errors.Is(err, ErrClosed) {
		t.Errorf("Alloc after Close: %v", err)
	}
}

// TestConcurrentUse hammers the pool from many sessions of a few uids (run it
// with -race) and checks the invariants, uid isolation and that everything
// returns to the pool.
func TestConcurrentUse(t *testing.T) {
	for _, tc := range []struct {
		name        string
		shareSlabs  int64
		budgetSlabs int64
	}{
		{"whole pool per uid", 6, 6},
		{"a third per uid", 2, 6},
		{"shares oversubscribed", 3, 6},
	} {
		t.Run(tc.name, func(t *testing.T) {
			p, _ := newSharePool(t, Config{BudgetBytes: tc.budgetSlabs * testSlab, UIDShareBytes: tc.shareSlabs * testSlab})
			hammer(t, p)
		})
	}
}

// hammer runs 16 sessions of 3 uids allocating and releasing at random on
// both devices and checks isolation, the invariants and that everything
// comes back.
func hammer(t *testing.T, p *Pool) {
	var wg sync.WaitGroup
	errs := make(chan error, 64)
	for g := range 16 {
		wg.Go(func() {
			r := rand.New(rand.NewPCG(uint64(g), 1))
			o := Owner{Session: uint64(g + 1), UID: uint32(g % 3)}
			var held []*Lease
			for range 400 {
				if len(held) > 0 && r.IntN(2) == 0 {
					i := r.IntN(len(held))
					if err := p.Release(o, held[i].ID); err != nil {
						errs <- err
						return
					}
					held = append(held[:i], held[i+1:]...)
					continue
				}
				n := int64(r.IntN(8*Align)) + 1
				if r.IntN(50) == 0 {
					n = testSlab + int64(r.IntN(testSlab)) // dedicated
				}
				l, err := p.Alloc(context.Background(), o, r.IntN(2), n)
				if errors.Is(err, ErrExhausted) {
					continue
				}
				if err != nil {
					errs <- err
					return
				}
				if l.Slab.UID() != o.UID {
					errs <- fmt.Errorf("lease of uid %d in slab of uid %d", o.UID, l.Slab.UID())
				}
				held = append(held, l)
			}
			p.ReleaseSession(o.Session)
		})
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		t.Error(err)
	}
	if err := p.checkInvariants(); err != nil {
		t.Fatal(err)
	}
	for _, d := range p.Stats().Devices {
		if d.Leases != 0 || d.LeasedBytes != 0 {
			t.Errorf("device %d still holds %d leases", d.Device, d.Leases)
		}
	}
}

func TestHostBackend(t *testing.T) {
	dir := filepath.Join(t.TempDir(), "slabs")
	b, err := NewHostBackend(HostBackendOptions{Dir: dir})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		if err := b.Close(); err != nil {
			t.Error(err)
		}
		if _, err := os.Stat(dir); !os.IsNotExist(err) {
			t.Errorf("slab directory left behind: %v", err)
		}
	})
	p, err := NewPool(Config{Backend: b, SlabBytes: 16 * Align, BudgetBytes: 16 * Align})
	if err != nil {
		t.Fatal(err)
	}
	defer p.Close()
	uid := uint32(os.Getuid())
	o := Owner{Session: 1, UID: uid}
	l := mustAlloc(t, p, o, 0, 100)
	hm, ok := l.Slab.Memory.(HostMemory)
	if !ok {
		t.Fatal("host slab does not implement HostMemory")
	}
	copy(hm.HostBytes()[l.Offset:], "hello slab")
	tok, err := p.Export(o, l.Slab.ID)
	if err != nil {
		t.Fatal(err)
	}
	// A client maps the slab through the exported path and sees the bytes.
	fi, err := os.Stat(string(tok))
	if err != nil {
		t.Fatal(err)
	}
	if fi.Mode().Perm() != 0o600 || fi.Size() != 16*Align {
		t.Errorf("slab file mode %v size %d", fi.Mode().Perm(), fi.Size())
	}
	if st := fi.Sys().(*syscall.Stat_t); st.Uid != uid {
		t.Errorf("slab file owner %d, want %d", st.Uid, uid)
	}
	got, err := os.ReadFile(string(tok))
	if err != nil {
		t.Fatal(err)
	}
	if !bytes.HasPrefix(got[l.Offset:], []byte("hello slab")) {
		t.Errorf("client view of the slab: %q", got[:16])
	}
	dfi, err := os.Stat(dir)
	if err != nil || dfi.Mode().Perm() != 0o711 {
		t.Errorf("slab directory mode: %v %v", dfi.Mode().Perm(), err)
	}
	// The file lies in a directory of the uid that only it can search.
	ufi, err := os.Stat(filepath.Dir(string(tok)))
	wantMode := os.FileMode(0o500)
	if os.Getuid() != 0 {
		wantMode = 0o700
	}
	if err != nil || ufi.Mode().Perm() != wantMode || ufi.Sys().(*syscall.Stat_t).Uid != uid || filepath.Dir(filepath.Dir(string(tok))) != dir {
		t.Errorf("uid directory of %s: %v, want mode %v owned by %d under %s (%v)", tok, ufi.Mode().Perm(), wantMode, uid, dir, err)
	}
	// A client's mapping, kept after its lease is released and the slab
	// is freed (here: for another uid), faults instead of showing or
	// holding memory; the other uid gets a new file.
	cf, err := os.OpenFile(string(tok), os.O_RDWR, 0)
	if err != nil {
		t.Fatal(err)
	}
	defer cf.Close()
	kept, err := syscall.Mmap(int(cf.Fd()), 0, 16*Align, syscall.PROT_READ|syscall.PROT_WRITE, syscall.MAP_SHARED)
	if err != nil {
		t.Fatal(err)
	}
	defer syscall.Munmap(kept)
	if err := p.Release(o, l.ID); err != nil {
		t.Fatal(err)
	}
	other := Owner{Session: 2, UID: uid + 1}
	if os.Getuid() != 0 {
		other.UID = uid // only root can give files away: the same uid, a dedicated slab
	}
	l2 := mustAlloc(t, p, other, 0, 16*Align)
	tok2, err := p.Export(other, l2.Slab.ID)
	if err != nil {
		t.Fatal(err)
	}
	if string(tok2) == string(tok) || l2.Slab == l.Slab {
		t.Fatalf("the freed slab's file %s was reused", tok)
	}
	if _, err := os.Stat(string(tok)); !os.IsNotExist(err) {
		t.Errorf("freed slab file still present: %v", err)
	}
	fi2, err := os.Stat(string(tok2))
	if err != nil {
		t.Fatal(err)
	}
	if st := fi2.Sys().(*syscall.Stat_t); st.Uid != other.UID || fi2.Mode().Perm() != 0o600 {
		t.Errorf("new slab file owner %d mode %v, want %d and 0600", st.Uid, fi2.Mode().Perm(), other.UID)
	}
	if st, err := cf.Stat(); err != nil || st.Size() != 0 {
		t.Errorf("freed slab file through a kept descriptor: %v bytes (%v), want 0", st.Size(), err)
	}
	if !faults(kept) {
		t.Error("a mapping kept after the slab was freed still reads")
	}
	if _, err := b.Alloc(context.Background(), 1, Align, uid); err == nil {
		t.Error("host backend accepted device 1")
	}
	if _, err := b.Alloc(context.Background(), 0, 100, uid); err == nil {
		t.Error("host backend accepted an unaligned size")
	}
}

// faults reports whether reading the first byte of b faults (SIGBUS on a
// mapping of a truncated file).
func faults(b []byte) (faulted bool) {
	defer debug.SetPanicOnFault(debug.SetPanicOnFault(true))
	defer func() {
		if recover() != nil {
			faulted = true
		}
	}()
	// An atomic load: a plain read whose value is unused may be dropped.
	atomic.LoadUint32((*uint32)(unsafe.Pointer(&b[0])))
	return false
}
