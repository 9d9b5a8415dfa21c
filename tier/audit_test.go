package tier

import (
	"context"
	"errors"
	"os"
	"syscall"
	"testing"
	"time"
)

// TestUnpinSparesAnotherUsersPinInFlight: a uid that may read a file (and
// so may UNPIN it) cannot kill another uid's pin of it while that pin is
// still reading: when it pinned nothing of the file, UNPIN is refused;
// when it holds the file's other extents, UNPIN drops those (its own
// pins) and nothing else. The other uid's pin completes.
func TestUnpinSparesAnotherUsersPinInFlight(t *testing.T) {
	const ext = 64 * kib
	for _, tc := range []struct {
		name      string
		heldByB   bool // uid 2 pinned extent 0 before uid 1 pins extent 1
		wantUnpin error
	}{
		{"nothing held yet", false, ErrNotOwner},
		// Before every uid's pin was charged for what it asked for, this
		// was ErrNotOwner too: a file's extents went all at once.
		{"the unpinner holds the rest", true, nil},
	} {
		t.Run(tc.name, func(t *testing.T) {
			tr, a := newTier(t, 1<<20, 0)
			_, f := writeFile(t, t.TempDir(), "x", 2*ext, 8)
			id := ident(t, f)
			ctx := context.Background()
			off := int64(0)
			if tc.heldByB {
				if _, err := tr.Pin(ctx, f, f.Name(), 2, 0, ext); err != nil {
					t.Fatal(err)
				}
				off = ext
			}
			entered, release := make(chan struct{}), make(chan struct{})
			a.before = func(int64) { close(entered); <-release }
			done := make(chan error, 1)
			go func() {
				_, err := tr.Pin(ctx, f, f.Name(), 1, off, ext)
				done <- err
			}()
			<-entered // uid 1's extent is reserved and being filled
			_, uerr := tr.Unpin(id, 2)
			a.before = nil
			close(release)
			if err := <-done; err != nil {
				t.Errorf("uid 1's pin, with uid 2's unpin during it: %v", err)
			}
			if !errors.Is(uerr, tc.wantUnpin) {
				t.Errorf("uid 2's unpin during uid 1's pin: %v, want %v", uerr, tc.wantUnpin)
			}
			if c, b := tr.Cached(id), tr.PinnedBy(id, 2); c != ext || b != 0 {
				t.Errorf("after both: %d bytes cached, %d of them uid 2's; want uid 1's extent alone", c, b)
			}
		})
	}
}

// TestEvictionSparesSmallerHolders: a pin evicts another uid's extents only
// while that uid holds more than the pinning uid would, also when a file's
// extents are charged to several uids: an entry that also holds extents of
// a uid holding less is not evicted for it (package doc, "Fairness").
func TestEvictionSparesSmallerHolders(t *testing.T) {
	const ext = 64 * kib
	dir := t.TempDir()
	tr, _ := newTier(t, 7*ext, 0)
	ctx := context.Background()
	_, shared := writeFile(t, dir, "shared", 2*ext, 1)
	_, g := writeFile(t, dir, "g", 2*ext, 2)
	_, x := writeFile(t, dir, "x", 2*ext, 3)
	_, h := writeFile(t, dir, "h", 2*ext, 4)
	for _, p := range []struct {
		uid    uint32
		f      *os.File
		off, n int64
	}{
		{1, shared, 0, ext},   // uid 1: extent 0 of the shared file
		{3, shared, ext, ext}, // uid 3: extent 1 of it (holds 1 extent)
		{1, g, 0, -1},         // uid 1 holds 3 extents
		{4, x, 0, -1},         // uid 4 holds 2
	} {
		if _, err := tr.Pin(ctx, p.f, p.f.Name(), p.uid, p.off, p.n); err != nil {
			t.Fatal(err)
		}
	}
	// uid 2 pins 2 extents: one must go, and only uid 1 holds more than 2.
	if _, err := tr.Pin(ctx, h, h.Name(), 2, 0, -1); err != nil {
		t.Fatalf("uid 2's pin: %v", err)
	}
	held := map[uint32]int64{}
	for _, u := range tr.Stats().UIDs {
		held[u.UID] = u.Bytes
	}
	if held[3] != ext || held[2] != 2*ext || held[4] != 2*ext {
		t.Errorf("after uid 2's pin: %v; uid 3 (1 extent, less than uid 2's 2) must keep its extent", held)
	}
}

// TestDeviceTierShares: the device tier (--gpu-cache) is shared fairly: a
// READ that finds a GPU's budget full evicts another uid's copies only
// while that uid holds more there than the reader would, else the
// reader's own. Before, one uid reading its own pinned files onto a GPU
// evicted every other uid's copies there (plain LRU).
func TestDeviceTierShares(t *testing.T) {
	const ext = 64 * kib
	g := &fakeGPU{}
	tr, err := New(Config{BudgetBytes: 4 << 20, UIDShareBytes: 2 << 20, ChunkBytes: ext, SettleTime: -1, DeviceBytes: 4 * ext, DeviceAlloc: g})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { tr.Close() })
	dir := t.TempDir()
	ctx := context.Background()
	read := func(uid uint32, f *os.File) *fakeCopier {
		t.Helper()
		if _, err := tr.Pin(ctx, f, f.Name(), uid, 0, -1); err != nil {
			t.Fatal(err)
		}
		id := ident(t, f)
		v, ok := tr.Lookup(id, [][2]int64{{0, id.Size}})
		if !ok {
			t.Fatal("miss")
		}
		defer v.Release()
		c := &fakeCopier{g: g}
		s := &fakeSlab{b: make([]byte, id.Size)}
		if n, err := (Engine{View: v, Copier: c, UID: uid}).ReadAt(ctx, f, s, 0, 0, id.Size); err != nil || n != id.Size {
			t.Fatalf("ReadAt: %d, %v", n, err)
		}
		return c
	}
	_, a := writeFile(t, dir, "a", 2*ext, 1)
	_, b1 := writeFile(t, dir, "b1", 2*ext, 2)
	_, b2 := writeFile(t, dir, "b2", 2*ext, 3)
	_, b3 := writeFile(t, dir, "b3", ext, 4)
	if c := read(1, a); c.h2d != 2 {
		t.Fatalf("uid 1's first read: %d host-to-device copies, want its copy made", c.h2d)
	}
	read(2, b1) // the device budget is full now: 2 extents each
	read(2, b2) // uid 2 at its share: its own b1 goes
	if c := read(2, b3); c.h2d != 1 {
		t.Fatalf("uid 2's third file: %d host-to-device copies, want its copy made", c.h2d)
	}
	if c := read(1, a); c.h2d != 0 || c.d2s != 2 {
		t.Errorf("uid 1's copy was evicted by uid 2's reads (%d host-to-device copies to make it again, %d device-to-device)", c.h2d, c.d2s)
	}
	for _, d := range tr.Stats().Devices {
		if d.Bytes > 4*ext {
			t.Errorf("device %d holds %d bytes of a %d budget", d.Device, d.Bytes, 4*ext)
		}
	}
}

// TestPinOfAMappedFileNeverStale: a writer storing into a shared writable
// mapping of a file changes no timestamp when the page it stores into is
// already dirty, so a pin reading between two such stores could keep bytes
// the file no longer has, with the file's identity unchanged: hits would
// then serve them for good. A pin writes the range back first, which
// write-protects mapped pages: the next store faults and updates the
// file's times, so the entry no longer matches (a miss, never old bytes).
func TestPinOfAMappedFileNeverStale(t *testing.T) {
	a := &countingAlloc{}
	tr, err := New(Config{BudgetBytes: 1 << 20, ChunkBytes: 64 * kib, Alloc: a, SettleTime: 20 * time.Millisecond, Workers: 1})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { tr.Close() })
	_, f := writeFile(t, t.TempDir(), "m", 64*kib, 9)
	w, err := os.OpenFile(f.Name(), os.O_RDWR, 0)
	if err != nil {
		t.Fatal(err)
	}
	defer w.Close()
	m, err := syscall.Mmap(int(w.Fd()), 0, 64*kib, syscall.PROT_READ|syscall.PROT_WRITE, syscall.MAP_SHARED)
	if err != nil {
		t.Fatal(err)
	}
	defer syscall.Munmap(m)
	m[0] = 1 // the page is dirty now, its times set
	if _, err := tr.Pin(context.Background(), f, f.Name(), 1, 0, -1); err != nil {
		t.Fatal(err)
	}
	m[0] = 2 // a store after the pin
	now := make([]byte, 1)
	if _, err := f.ReadAt(now, 0); err != nil || now[0] != 2 {
		t.Fatalf("the file reads %d, %v after the store", now[0], err)
	}
	id := ident(t, f)
	if v, ok := tr.Lookup(id, [][2]int64{{0, 4096}}); ok {
		got := viewBytes(t, v, 0, 1)
		v.Release()
		if got[0] != now[0] {
			t.Errorf("a hit serves byte %d, the file holds %d (the store changed no timestamp)", got[0], now[0])
		}
	}
}
