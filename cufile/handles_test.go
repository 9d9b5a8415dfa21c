package cufile

import (
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"sync"
	"syscall"
	"testing"

	"github.com/rs/zerolog"
	"golang.org/x/sys/unix"

	"github.com/gdsfs/gdsfs/internal/fileid"
)

// fakeHandleLib is libcufile's cuFileHandleRegister/Deregister for the
// CPU tests of the handle cache: it records the descriptor of each live
// handle and fails the test when a handle is deregistered twice, or after
// its descriptor was closed (libcufile needs it open until then).
type fakeHandleLib struct {
	t    testing.TB
	mu   sync.Mutex
	next uintptr
	live map[uintptr]int // handle -> descriptor
}

func newFakeHandleLib(t testing.TB) *fakeHandleLib {
	return &fakeHandleLib{t: t, live: map[uintptr]int{}}
}

func (l *fakeHandleLib) HandleRegister(fd int) (uintptr, error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	l.next++
	l.live[l.next] = fd
	return l.next, nil
}

func (l *fakeHandleLib) HandleDeregister(h uintptr) {
	l.mu.Lock()
	defer l.mu.Unlock()
	fd, ok := l.live[h]
	if !ok {
		l.t.Errorf("cuFileHandleDeregister(%d): not a live handle", h)
		return
	}
	if _, err := unix.FcntlInt(uintptr(fd), unix.F_GETFD, 0); err != nil {
		l.t.Errorf("cuFileHandleDeregister(%d): its descriptor %d was closed first: %v", h, fd, err)
	}
	delete(l.live, h)
}

func (l *fakeHandleLib) registered() int {
	l.mu.Lock()
	defer l.mu.Unlock()
	return len(l.live)
}

// fakeGDSEngines is Engines with cuFile (with nvidia-fs) whose handle
// calls are l's: Choose registers files as on a GPU host.
func fakeGDSEngines(l handleLib) *Engines {
	g := &gdsEngine{name: EngineGDS, reg: l, handles: map[fileKey]*fileHandle{}}
	return &Engines{files: map[fileKey]choice{}, refused: newRefusals(zerolog.Nop()), gds: g, nvfs: true,
		report: Report{Engine: EngineGDS, Why: "test"}}
}

// deletedHeld lists this process's descriptors of deleted files under dir.
func deletedHeld(t testing.TB, dir string) []string {
	t.Helper()
	names, err := os.ReadDir("/proc/self/fd")
	if err != nil {
		t.Fatal(err)
	}
	var out []string
	for _, e := range names {
		l, err := os.Readlink(filepath.Join("/proc/self/fd", e.Name()))
		if err == nil && filepath.Dir(l) == dir && len(l) > len(" (deleted)") && l[len(l)-len(" (deleted)"):] == " (deleted)" {
			out = append(out, e.Name()+" -> "+l)
		}
	}
	return out
}

// smallFS returns a fresh 8 MiB tmpfs (as root), whose free space tells
// when a deleted file's blocks are back; a plain temporary directory
// otherwise (only the descriptors are checked then).
func smallFS(t *testing.T) (dir string, free func() int64) {
	dir = t.TempDir()
	if os.Geteuid() != 0 {
		return dir, nil
	}
	if err := unix.Mount("gdsfs-cufile-handles", dir, "tmpfs", 0, "size=8m"); err != nil {
		t.Fatalf("mount tmpfs: %v", err)
	}
	t.Cleanup(func() {
		if err := unix.Unmount(dir, unix.MNT_DETACH); err != nil {
			t.Errorf("unmount tmpfs: %v", err)
		}
	})
	return dir, func() int64 {
		var st unix.Statfs_t
		if err := unix.Statfs(dir, &st); err != nil {
			t.Fatal(err)
		}
		return int64(st.Bfree) * st.Bsize
	}
}

func inodeOf(t testing.TB, p string) fileid.Inode {
	t.Helper()
	var st syscall.Stat_t
	if err := syscall.Stat(p, &st); err != nil {
		t.Fatal(err)
	}
	return fileid.Inode{Dev: uint64(st.Dev), Ino: st.Ino}
}

// TestHandleFreedWhenFileGoes: a file read through cuFile (registered by
// the chooser, as a READ of the control path does) and then deleted, renamed
// over, or deleted behind the mount's back gives its blocks back: the
// cached registration's descriptor is closed (after its deregistration)
// when the fs layer reports the removed name, or at the sweeper's next
// pass for a deletion it was not told of. Until 2026-12-01 the handle was
// kept until 1024 others had been registered: a deleted checkpoint's
// blocks stayed allocated for as long as the daemon ran.
func TestHandleFreedWhenFileGoes(t *testing.T) {
	const size = 5 << 20 // two do not fit in smallFS
	cases := []struct {
		name string
		// gone removes the file's last name and tells e as the daemon would.
		gone func(t *testing.T, e *Engines, p string, id fileid.Inode)
	}{
		{"unlinked through the mount", func(t *testing.T, e *Engines, p string, id fileid.Inode) {
			if err := os.Remove(p); err != nil {
				t.Fatal(err)
			}
			e.Forget(id.Dev, id.Ino)
		}},
		{"renamed over through the mount", func(t *testing.T, e *Engines, p string, id fileid.Inode) {
			tmp := p + ".tmp"
			if err := os.WriteFile(tmp, []byte("next"), 0o644); err != nil {
				t.Fatal(err)
			}
			if err := os.Rename(tmp, p); err != nil {
				t.Fatal(err)
			}
			e.Forget(id.Dev, id.Ino)
		}},
		{"deleted in the backing directory", func(t *testing.T, e *Engines, p string, _ fileid.Inode) {
			if err := os.Remove(p); err != nil {
				t.Fatal(err)
			}
			e.sweepHandles() // the sweeper's next pass
		}},
	}
	dir, free := smallFS(t)
	for i, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			lib := newFakeHandleLib(t)
			e := fakeGDSEngines(lib)
			defer e.Close()
			p := filepath.Join(dir, "ckpt"+strconv.Itoa(i))
			var before int64
			if free != nil {
				before = free()
			}
			if err := os.WriteFile(p, make([]byte, size), 0o644); err != nil {
				t.Fatal(err)
			}
			f, err := os.Open(p)
			if err != nil {
				t.Fatal(err)
			}
			if eng, why := e.Choose(f, p, 0, -1); eng.Name() != EngineGDS {
				t.Fatalf("Choose = %s (%s), want gds", eng.Name(), why)
			}
			f.Close() // the caller's open ends with its READ
			if lib.registered() != 1 {
				t.Fatalf("%d handles registered by Choose, want 1", lib.registered())
			}
			id := inodeOf(t, p)
			c.gone(t, e, p, id)
			if held := deletedHeld(t, dir); len(held) > 0 {
				t.Errorf("the file's last name is gone, and its cuFile registration still holds it: %v", held)
			}
			if n := lib.registered(); n != 0 {
				t.Errorf("%d handles still registered, want 0", n)
			}
			if free != nil {
				os.Remove(p) // the renamed-over case's new file
				if now := free(); now != before {
					t.Errorf("backing filesystem has %d bytes free, %d before the file was written: its blocks were not freed", now, before)
				}
			}
		})
	}
}

// TestHandleKeptWhileLinkedOrInUse: the rule frees only what no name and no
// transfer needs: a registration of a file with another hard link stays
// cached (the next READ reuses it), and one in use by a transfer when its
// file goes stays valid until the transfer releases it, then closes.
func TestHandleKeptWhileLinkedOrInUse(t *testing.T) {
	dir := t.TempDir()
	lib := newFakeHandleLib(t)
	e := fakeGDSEngines(lib)
	defer e.Close()
	p := filepath.Join(dir, "a")
	if err := os.WriteFile(p, []byte("data"), 0o644); err != nil {
		t.Fatal(err)
	}
	f, err := os.Open(p)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	id := inodeOf(t, p)

	// Another name: removing one keeps the registration.
	if err := os.Link(p, p+".link"); err != nil {
		t.Fatal(err)
	}
	e.Choose(f, p, 0, -1)
	if err := os.Remove(p); err != nil {
		t.Fatal(err)
	}
	e.Forget(id.Dev, id.Ino)
	e.sweepHandles()
	if n := lib.registered(); n != 1 {
		t.Fatalf("file still linked as %s: %d handles registered, want 1 (kept)", p+".link", n)
	}
	if got := len(e.gds.handles); got != 1 {
		t.Fatalf("%d handles cached, want 1", got)
	}

	// In use when its last name goes: valid until released.
	fh, done, err := e.gds.acquire(f)
	if err != nil {
		t.Fatal(err)
	}
	if err := os.Remove(p + ".link"); err != nil {
		t.Fatal(err)
	}
	e.Forget(id.Dev, id.Ino)
	e.sweepHandles()
	if n := lib.registered(); n != 1 {
		t.Fatalf("handle in use: %d registered, want 1 until it is released", n)
	}
	if _, err := unix.FcntlInt(fh.f.Fd(), unix.F_GETFD, 0); err != nil {
		t.Fatalf("handle in use: its descriptor was closed: %v", err)
	}
	// A new READ of the still-open deleted file registers afresh.
	fh2, done2, err := e.gds.acquire(f)
	if err != nil {
		t.Fatal(err)
	}
	if fh2 == fh {
		t.Error("a handle taken out of the cache was handed out again")
	}
	done2()
	done()
	e.sweepHandles() // fh2, cached, is of a deleted file too
	if n := lib.registered(); n != 0 {
		t.Errorf("after release: %d handles registered, want 0", n)
	}
	if held := deletedHeld(t, dir); len(held) != 1 { // f, the test's own
		t.Errorf("descriptors of the deleted file: %v, want only the test's own", held)
	}
}

// BenchmarkAcquireCached is the per-READ cost of the handle cache for a
// registered file (keyOf's fstat, a map lookup, unref): what the lifetime
// rule must not make dearer.
func BenchmarkAcquireCached(b *testing.B) {
	p := filepath.Join(b.TempDir(), "f")
	if err := os.WriteFile(p, []byte("x"), 0o644); err != nil {
		b.Fatal(err)
	}
	f, err := os.Open(p)
	if err != nil {
		b.Fatal(err)
	}
	defer f.Close()
	e := fakeGDSEngines(newFakeHandleLib(b))
	defer e.Close()
	registerEmpty(b, e, filepath.Dir(p), 1000) // a cache with others in it
	b.ResetTimer()
	for range b.N {
		_, done, err := e.gds.acquire(f)
		if err != nil {
			b.Fatal(err)
		}
		done()
	}
}

// BenchmarkSweepHandles is one sweeper pass over a full cache of linked
// files (nothing to free): its cost every handleSweepEvery.
func BenchmarkSweepHandles(b *testing.B) {
	dir := b.TempDir()
	e := fakeGDSEngines(newFakeHandleLib(b))
	defer e.Close()
	registerEmpty(b, e, dir, handleCacheMax)
	b.ResetTimer()
	for range b.N {
		e.sweepHandles()
	}
}

// registerEmpty registers n new empty files of dir with e's cuFile
// engine, closing the caller's descriptors (the handles keep their own).
func registerEmpty(b *testing.B, e *Engines, dir string, n int) {
	b.Helper()
	for i := range n {
		q := filepath.Join(dir, fmt.Sprint(i))
		if err := os.WriteFile(q, nil, 0o644); err != nil {
			b.Fatal(err)
		}
		g, err := os.Open(q)
		if err != nil {
			b.Fatal(err)
		}
		if err := e.gds.probe(g); err != nil {
			b.Fatal(err)
		}
		g.Close()
	}
}
