package cufile

// GPU test of the cuFile handle cache's lifetime rule (handles.go): it runs
// where libcuda.so.1 loads, a device is present and cuFileDriverOpen
// succeeds; elsewhere it skips (the CPU tests use a fake of the handle
// calls: TestHandleFreedWhenFileGoes).

import (
	"context"
	"os"
	"path/filepath"
	"testing"
	"time"

	"github.com/gdsfs/gdsfs/internal/fileid"
)

// TestGPUHandleFreedOnUnlink: a file registered with cuFile through the
// chooser (as a READ does) and read by the gds engine, then deleted, no
// longer has a descriptor in this process once Forget is told of it (an
// unlink or rename over it through the mount), or once the sweeper has run
// (a deletion outside the mount). Before the fix the registration kept the
// deleted file's blocks until 1024 other files had been registered.
func TestGPUHandleFreedOnUnlink(t *testing.T) {
	e := gpuEngines(t)
	if e.gds == nil {
		t.Skip("cuFile not usable here (see probes)")
	}
	base := os.Getenv("GDSFS_GPU_TEST_DIR")
	if base == "" {
		base = t.TempDir()
	}
	dir, err := os.MkdirTemp(base, "gdsfs-fdleak-")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.RemoveAll(dir) })
	ctx := context.Background()
	mem, err := e.Backend().Alloc(ctx, 0, 8<<20, 0)
	if err != nil {
		t.Fatal(err)
	}
	defer mem.Close()
	cases := []struct {
		name string
		gone func(t *testing.T, p string, id fileid.Inode)
	}{
		{"unlinked, Forget told", func(t *testing.T, p string, id fileid.Inode) {
			if err := os.Remove(p); err != nil {
				t.Fatal(err)
			}
			e.Forget(id.Dev, id.Ino)
		}},
		{"renamed over, Forget told", func(t *testing.T, p string, id fileid.Inode) {
			if err := os.WriteFile(p+".tmp", []byte("next"), 0o644); err != nil {
				t.Fatal(err)
			}
			if err := os.Rename(p+".tmp", p); err != nil {
				t.Fatal(err)
			}
			e.Forget(id.Dev, id.Ino)
		}},
		{"deleted outside the mount, the sweeper", func(t *testing.T, p string, _ fileid.Inode) {
			if err := os.Remove(p); err != nil {
				t.Fatal(err)
			}
			// The running sweeper's pass (every handleSweepEvery): no event
			// to wait on.
			for deadline := time.Now().Add(5 * handleSweepEvery); time.Now().Before(deadline) && len(deletedHeld(t, dir)) > 0; {
				time.Sleep(50 * time.Millisecond)
			}
		}},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			p := filepath.Join(dir, "ckpt")
			if err := os.WriteFile(p, make([]byte, 8<<20), 0o644); err != nil {
				t.Fatal(err)
			}
			f, err := os.Open(p)
			if err != nil {
				t.Fatal(err)
			}
			eng, why := e.Choose(f, p, 0, -1)
			t.Logf("Choose: %s (%s)", eng.Name(), why)
			k, err := keyOf(f)
			if err != nil {
				t.Fatal(err)
			}
			if got, err := e.gds.ReadAt(ctx, f, mem, 0, 0, 8<<20); err != nil || got != 8<<20 {
				f.Close()
				t.Skipf("cuFile does not read files in %s: %d, %v", dir, got, err)
			}
			f.Close()
			e.gds.mu.Lock()
			cached := e.gds.handles[k] != nil
			e.gds.mu.Unlock()
			if !cached {
				t.Fatal("the file read by cuFile has no cached registration: nothing to test")
			}
			if held := deletedHeld(t, dir); len(held) > 0 {
				t.Fatalf("before the deletion: %v", held)
			}
			c.gone(t, p, k.Inode)
			if held := deletedHeld(t, dir); len(held) > 0 {
				t.Errorf("the file's last name is gone, and its cuFile registration still holds it: %v", held)
			}
			e.gds.mu.Lock()
			cached = e.gds.handles[k] != nil
			e.gds.mu.Unlock()
			if cached {
				t.Error("the deleted file's registration is still cached")
			}
			os.Remove(p)
		})
	}
}
