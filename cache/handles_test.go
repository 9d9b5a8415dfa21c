package cache

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
)

func fdOpen(f *os.File) bool {
	var st syscall.Stat_t
	return syscall.Fstat(int(f.Fd()), &st) != syscall.EBADF
}

func TestHandlesShareAndEvict(t *testing.T) {
	dir := t.TempDir()
	var evicted sync.Map // path -> count
	var opened atomic.Int64
	hs, err := NewHandles(HandlesOptions{
		MaxOpen: 4,
		OnOpen:  func(h *Handle) (any, error) { opened.Add(1); return "reg:" + h.Path, nil },
		OnEvict: func(h *Handle) {
			if !fdOpen(h.File) {
				t.Errorf("OnEvict(%s) after its descriptor was closed", h.Path)
			}
			n, _ := evicted.LoadOrStore(h.Path, new(atomic.Int64))
			n.(*atomic.Int64).Add(1)
		},
	})
	if err != nil {
		t.Fatal(err)
	}
	ctx := context.Background()
	paths := make([]string, 40)
	for i := range paths {
		paths[i] = filepath.Join(dir, fmt.Sprintf("f%02d", i))
		writeFile(t, paths[i], []byte(paths[i]))
	}
	// Two acquires of one file share the descriptor.
	a, err := hs.Acquire(ctx, paths[0], os.O_RDONLY)
	if err != nil {
		t.Fatal(err)
	}
	hs.Wait()
	b, err := hs.Acquire(ctx, paths[0], os.O_RDONLY)
	if err != nil {
		t.Fatal(err)
	}
	if a != b || a.Data != "reg:"+paths[0] {
		t.Errorf("second Acquire got a different handle (%p, %p) or data %v", a, b, a.Data)
	}
	b.Release()
	// Fill the cache far past MaxOpen; a stays in use throughout.
	for _, p := range paths[1:] {
		h, err := hs.Acquire(ctx, p, os.O_RDONLY)
		if err != nil {
			t.Fatal(err)
		}
		buf := make([]byte, len(p))
		if _, err := h.File.ReadAt(buf, 0); err != nil || string(buf) != p {
			t.Errorf("read %s through its handle: %q, %v", p, buf, err)
		}
		h.Release()
		hs.Wait()
	}
	if !fdOpen(a.File) {
		t.Fatal("a handle in use was closed by eviction")
	}
	a.Release()
	hs.Close()
	st := hs.Stats()
	if st.Closed != uint64(opened.Load()) {
		t.Errorf("closed %d of %d opened handles after Close", st.Closed, opened.Load())
	}
	evicted.Range(func(k, v any) bool {
		if n := v.(*atomic.Int64).Load(); n != 1 {
			t.Errorf("OnEvict ran %d times for %s", n, k)
		}
		return true
	})
	if st.Evictions == 0 {
		t.Errorf("no evictions with 40 files in 4 slots: %+v", st)
	}
}

func TestHandlesInvalidate(t *testing.T) {
	hs, err := NewHandles(HandlesOptions{})
	if err != nil {
		t.Fatal(err)
	}
	defer hs.Close()
	ctx := context.Background()
	p := filepath.Join(t.TempDir(), "f")
	writeFile(t, p, []byte("old"))
	h, err := hs.Acquire(ctx, p, os.O_RDONLY)
	if err != nil {
		t.Fatal(err)
	}
	h.Release()
	hs.Wait()
	// Replaced behind our back: a new inode, so a new handle.
	writeFile(t, p+".new", []byte("new"))
	if err := os.Rename(p+".new", p); err != nil {
		t.Fatal(err)
	}
	h2, err := hs.Acquire(ctx, p, os.O_RDONLY)
	if err != nil {
		t.Fatal(err)
	}
	buf := make([]byte, 3)
	h2.File.ReadAt(buf, 0)
	if string(buf) != "new" {
		t.Errorf("read %q after replacement, want new", buf)
	}
	h2.Release()
	hs.Wait()
	hs.Invalidate(p)
	hs.Wait()
	if fdOpen(h2.File) {
		t.Error("Invalidate left the idle handle open")
	}
	if _, err := hs.Acquire(ctx, filepath.Join(t.TempDir(), "missing"), os.O_RDONLY); err == nil {
		t.Error("Acquire of a missing file succeeded")
	}
}

// TestHandlesConcurrent races acquires, releases, invalidations and
// evictions (run with -race): every handle closes exactly once.
func TestHandlesConcurrent(t *testing.T) {
	var evictions atomic.Int64
	hs, err := NewHandles(HandlesOptions{MaxOpen: 3, OnEvict: func(*Handle) { evictions.Add(1) }})
	if err != nil {
		t.Fatal(err)
	}
	dir := t.TempDir()
	for i := range 8 {
		writeFile(t, filepath.Join(dir, fmt.Sprint(i)), []byte("x"))
	}
	ctx := context.Background()
	var wg sync.WaitGroup
	for g := range 16 {
		wg.Go(func() {
			for i := range 200 {
				p := filepath.Join(dir, fmt.Sprint((g+i)%8))
				if i%17 == 0 {
					hs.Invalidate(p)
					continue
				}
				h, err := hs.Acquire(ctx, p, os.O_RDONLY)
				if err != nil {
					t.Error(err)
					return
				}
				var b [1]byte
				if _, err := h.File.ReadAt(b[:], 0); err != nil {
					t.Errorf("read through a live handle: %v", err)
				}
				h.Release()
			}
		})
	}
	wg.Wait()
	hs.Close()
	st := hs.Stats()
	if int64(st.Closed) != evictions.Load() || st.Closed != st.Misses {
		t.Errorf("closed %d, OnEvict %d, opened %d: every opened handle must close once", st.Closed, evictions.Load(), st.Misses)
	}
}
