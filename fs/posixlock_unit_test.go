package fs

import (
	"os"
	"path/filepath"
	"slices"
	"syscall"
	"testing"

	"github.com/hanwen/go-fuse/v2/fuse"
	"github.com/rs/zerolog"
	"golang.org/x/sys/unix"
)

// modelSpans is setSpans' model: one type per offset of a file of n
// bytes (0 for none), turned into merged spans.
func modelSpans(m []uint32) []lockSpan {
	var out []lockSpan
	for i, typ := range m {
		if typ == 0 {
			continue
		}
		if k := len(out) - 1; k >= 0 && out[k].typ == typ && out[k].end+1 == uint64(i) {
			out[k].end = uint64(i)
			continue
		}
		out = append(out, lockSpan{uint64(i), uint64(i), typ})
	}
	return out
}

// applyModel sets [start, end] of m to typ (F_UNLCK clears), typ stored
// plus one so that F_RDLCK (0) is not none.
func applyModel(m []uint32, start, end uint64, typ uint32) {
	for i := start; i <= end && i < uint64(len(m)); i++ {
		if typ == syscall.F_UNLCK {
			m[i] = 0
		} else {
			m[i] = typ + 1
		}
	}
}

func plusOne(spans []lockSpan) []lockSpan {
	out := slices.Clone(spans)
	for i := range out {
		out[i].typ++
	}
	return out
}

func TestSetSpans(t *testing.T) {
	const r, w, u = syscall.F_RDLCK, syscall.F_WRLCK, syscall.F_UNLCK
	cases := []struct {
		name string
		ops  []lockSpan
		want []lockSpan
	}{
		{"split by an unlock", []lockSpan{{0, 99, w}, {40, 59, u}}, []lockSpan{{0, 39, w}, {60, 99, w}}},
		{"adjacent same type merge", []lockSpan{{0, 9, r}, {10, 19, r}}, []lockSpan{{0, 19, r}}},
		{"adjacent other type stay", []lockSpan{{0, 9, r}, {10, 19, w}}, []lockSpan{{0, 9, r}, {10, 19, w}}},
		{"upgrade in the middle", []lockSpan{{0, 99, r}, {10, 19, w}}, []lockSpan{{0, 9, r}, {10, 19, w}, {20, 99, r}}},
		{"downgrade back merges", []lockSpan{{0, 99, r}, {10, 19, w}, {10, 19, r}}, []lockSpan{{0, 99, r}}},
		{"to end of file", []lockSpan{{5, maxLockEnd, w}, {maxLockEnd, maxLockEnd, u}}, []lockSpan{{5, maxLockEnd - 1, w}}},
		{"whole file unlock", []lockSpan{{0, 9, r}, {20, 29, w}, {0, maxLockEnd, u}}, nil},
		{"overlap replaces", []lockSpan{{0, 9, w}, {5, 14, r}}, []lockSpan{{0, 4, w}, {5, 14, r}}},
		{"unlock of nothing", []lockSpan{{0, 9, u}}, nil},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			var got []lockSpan
			for _, op := range c.ops {
				got = setSpans(got, op.start, op.end, op.typ)
			}
			if len(got) == 0 && len(c.want) == 0 {
				return
			}
			if !slices.Equal(got, c.want) {
				t.Errorf("got %v, want %v", got, c.want)
			}
		})
	}
}

// FuzzSetSpans checks setSpans against a per-offset model on a 64-byte
// range, each 3 input bytes one request (start, length, type).
func FuzzSetSpans(f *testing.F) {
	f.Add([]byte{0, 10, 1, 4, 3, 2, 20, 5, 0, 25, 5, 0})
	f.Fuzz(func(t *testing.T, b []byte) {
		const n = 64
		m := make([]uint32, n)
		var spans []lockSpan
		for i := 0; i+2 < len(b); i += 3 {
			start := uint64(b[i] % n)
			end := min(start+uint64(b[i+1]%n), n-1)
			typ := uint32(b[i+2] % 3)
			spans = setSpans(spans, start, end, typ)
			applyModel(m, start, end, typ)
			if got, want := plusOne(spans), modelSpans(m); !slices.Equal(got, want) && len(got)+len(want) > 0 {
				t.Fatalf("after [%d,%d] type %d: got %v, want %v", start, end, typ, got, want)
			}
		}
	})
}

// lockTestHandle is a handle of a fresh file for calling the lock code
// without a mount.
func lockTestHandle(t testing.TB) (*fileHandle, *mountState) {
	fd, err := unix.Open(filepath.Join(t.TempDir(), "f"), unix.O_RDWR|unix.O_CREAT|unix.O_CLOEXEC, 0o644)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { unix.Close(fd) })
	m := &mountState{opens: newOpenBudget(1024, 0, zerolog.Nop())}
	return &fileHandle{m: m, n: &node{m: m}, fd: fd, acc: unix.O_RDWR, uid: 10001}, m
}

// FuzzLockRequests sends lock requests as the kernel never would (any
// type, start, end, owner) and checks the daemon answers each without
// panicking, keeps each owner's ranges sorted and merged, and holds no
// descriptor once every owner flushed.
func FuzzLockRequests(f *testing.F) {
	f.Add([]byte{1, 0, 0, 0, 0, 0, 0, 0, 0, 10, 0, 0, 0, 0, 0, 0, 0, 0, 1})
	f.Add([]byte{2, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0x7f, 0, 0, 0, 0, 0, 0, 0, 0x80, 3, 0})
	f.Fuzz(func(t *testing.T, b []byte) {
		h, m := lockTestHandle(t)
		le := func(p []byte) uint64 {
			var v uint64
			for i := len(p) - 1; i >= 0; i-- {
				v = v<<8 | uint64(p[i])
			}
			return v
		}
		owners := map[uint64]bool{}
		for ; len(b) >= 19; b = b[19:] {
			lk := fuse.FileLock{Typ: uint32(b[0] % 5), Start: le(b[1:9]), End: le(b[9:17]), Pid: 42}
			owner := uint64(b[17] % 4)
			owners[owner] = true
			switch b[18] % 3 {
			case 0:
				h.n.locks.set(h, owner, &lk, false)
			case 1:
				var out fuse.FileLock
				h.n.locks.get(h, owner, &lk, &out)
			case 2:
				h.n.locks.flush(m, owner)
			}
			for _, o := range h.n.locks.owners {
				for i, s := range o.spans {
					if s.start > s.end || s.end > maxLockEnd || (i > 0 && o.spans[i-1].end >= s.start) {
						t.Fatalf("spans not sorted and disjoint: %v", o.spans)
					}
				}
			}
		}
		for o := range owners {
			h.n.locks.flush(m, o)
		}
		if n := h.n.locks.n.Load(); n != 0 || m.lockOwners.Load() != 0 {
			t.Fatalf("%d owners (%d in the mount) left after every flush", n, m.lockOwners.Load())
		}
	})
}

// TestLockRequestRanges: ranges no kernel sends are refused with EINVAL,
// and a whole-file lock reaches the backing file as one.
func TestLockRequestRanges(t *testing.T) {
	h, m := lockTestHandle(t)
	cases := []struct {
		name string
		lk   fuse.FileLock
		want syscall.Errno
	}{
		{"start after end", fuse.FileLock{Typ: syscall.F_WRLCK, Start: 10, End: 9}, syscall.EINVAL},
		{"end past OFFSET_MAX", fuse.FileLock{Typ: syscall.F_WRLCK, Start: 0, End: 1 << 63}, syscall.EINVAL},
		{"start past OFFSET_MAX", fuse.FileLock{Typ: syscall.F_RDLCK, Start: 1<<64 - 1, End: 1<<64 - 1}, syscall.EINVAL},
		{"unknown type", fuse.FileLock{Typ: 7, Start: 0, End: 0}, syscall.EINVAL},
		{"last byte", fuse.FileLock{Typ: syscall.F_WRLCK, Start: maxLockEnd, End: maxLockEnd}, 0},
		{"whole file", fuse.FileLock{Typ: syscall.F_WRLCK, Start: 0, End: maxLockEnd}, 0},
		{"unlock by an owner with none", fuse.FileLock{Typ: syscall.F_UNLCK, Start: 0, End: maxLockEnd}, 0},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			if _, errno := h.n.locks.set(h, 99, &c.lk, false); errno != c.want {
				t.Errorf("set: %v, want %v", errno, c.want)
			}
		})
	}
	// Owner 1's whole-file write lock is one OFD lock on the backing file.
	lk := fuse.FileLock{Typ: syscall.F_WRLCK, Start: 0, End: maxLockEnd, Pid: 7}
	if _, errno := h.n.locks.set(h, 1, &lk, false); errno != 0 {
		t.Fatal(errno)
	}
	other, err := os.Open(procPath(h.fd))
	if err != nil {
		t.Fatal(err)
	}
	defer other.Close()
	fl := unix.Flock_t{Type: unix.F_RDLCK}
	if err := unix.FcntlFlock(other.Fd(), unix.F_OFD_GETLK, &fl); err != nil {
		t.Fatal(err)
	}
	if fl.Type != unix.F_WRLCK || fl.Start != 0 || fl.Len != 0 {
		t.Errorf("backing file's lock %+v, want a write lock of the whole file", fl)
	}
	var out fuse.FileLock
	if errno := h.n.locks.get(h, 2, &fuse.FileLock{Typ: syscall.F_RDLCK, End: 10}, &out); errno != 0 || out.Pid != 7 || out.End != maxLockEnd {
		t.Errorf("F_GETLK of another owner: %+v %v, want owner 1's lock with pid 7", out, errno)
	}
	h.n.locks.flush(m, 1)
	h.n.locks.flush(m, 99)
	if m.lockOwners.Load() != 0 {
		t.Errorf("%d owners left", m.lockOwners.Load())
	}
}

// TestDeadlockCheckForgetsReleasedWaits: a wait recorded against an owner
// that has since released what it waited for is no cycle. Owner A waits
// for B's lock on X; B unlocks X (A is woken but has not tried again yet)
// and then waits for A's lock on Y: the kernel answers B's wait by
// blocking (A is no longer blocked on B), never EDEADLK. While B still
// holds X, the same wait is a cycle.
func TestDeadlockCheckForgetsReleasedWaits(t *testing.T) {
	const a, b = 1, 2
	wr := func() *fuse.FileLock { return &fuse.FileLock{Typ: syscall.F_WRLCK, Start: 0, End: maxLockEnd} }
	for _, c := range []struct {
		name      string
		bReleases bool
		want      bool // B's wait allowed (no EDEADLK)
	}{
		{"B released X first", true, true},
		{"B still holds X", false, false},
	} {
		t.Run(c.name, func(t *testing.T) {
			hx, m := lockTestHandle(t)
			hy, _ := lockTestHandle(t)
			hy.m, hy.n.m = m, m
			if _, errno := hy.n.locks.set(hy, a, wr(), false); errno != 0 {
				t.Fatal(errno)
			}
			if _, errno := hx.n.locks.set(hx, b, wr(), false); errno != 0 {
				t.Fatal(errno)
			}
			cx, errno := hx.n.locks.set(hx, a, wr(), true)
			if errno != syscall.EAGAIN || !cx.known || cx.holder != b {
				t.Fatalf("A's lock of X: %v %+v, want EAGAIN held by B", errno, cx)
			}
			if !m.lockWaits.wait(a, 100, cx, false) {
				t.Fatal("A's wait for B refused")
			}
			if c.bReleases {
				if _, errno := hx.n.locks.set(hx, b, &fuse.FileLock{Typ: syscall.F_UNLCK, Start: 0, End: maxLockEnd}, false); errno != 0 {
					t.Fatal(errno)
				}
			}
			cy, errno := hy.n.locks.set(hy, b, wr(), true)
			if errno != syscall.EAGAIN || !cy.known || cy.holder != a {
				t.Fatalf("B's lock of Y: %v %+v, want EAGAIN held by A", errno, cy)
			}
			if got := m.lockWaits.wait(b, 200, cy, false); got != c.want {
				t.Errorf("B's wait for A allowed %v, want %v", got, c.want)
			}
			for _, h := range []*fileHandle{hx, hy} {
				h.n.locks.flush(m, a)
				h.n.locks.flush(m, b)
			}
		})
	}
}
