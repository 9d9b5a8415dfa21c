package integration

import (
	"bytes"
	"context"
	"fmt"
	"os"
	"path/filepath"
	"syscall"
	"testing"
	"time"

	"github.com/gdsfs/gdsfs/ctl"
)

// TestReadThenDeleteFreesSpaceAtOnce: a checkpoint file loaded through the
// control path (READ ioctls, as gdsfs's DCP reader and torch loaders do)
// and then deleted through the mount, renamed over through the mount, or
// deleted in the backing directory gives its blocks back to the backing
// filesystem at once: the daemon holds no descriptor of it ("(deleted)" in
// /proc/<pid>/fd) and the backing filesystem's free space is what it was
// before the file was written. On the GPU machine (2026-12-01) cuFile's
// cached registrations kept a deleted 8 GiB and a 2 GiB checkpoint for as
// long as the daemon ran; this test runs the host engine (no cuFile here),
// so it guards every other descriptor the control path takes (the READ's,
// readahead's, the index cache's, the lookup stash); cufile's
// TestHandleFreedWhenFileGoes and TestGPUHandleFreedOnUnlink test the
// registrations.
func TestReadThenDeleteFreesSpaceAtOnce(t *testing.T) {
	requireRoot(t)
	dir := t.TempDir()
	backing, mnt := mountDirs(t, dir)
	if err := syscall.Mount("gdsfs-fdleak", backing, "tmpfs", 0, "size=8m"); err != nil {
		t.Fatalf("mount tmpfs: %v", err)
	}
	t.Cleanup(func() {
		if err := syscall.Unmount(backing, syscall.MNT_DETACH); err != nil {
			t.Errorf("unmount tmpfs: %v", err)
		}
	})
	// --no-passthrough: the kernel's passthrough reference to a backing
	// file (its backing id) is dropped after the daemon closes the file's
	// descriptor, where nothing can see it; without it the daemon's
	// descriptors are all there is (releasedBy waits for the user's).
	d := startBinDaemon(t, backing, mnt, "--engine", "host", "--host-pool", "64MiB", "--slab-size", "16MiB", "--no-passthrough")
	free := func() int64 {
		var st syscall.Statfs_t
		if err := syscall.Statfs(backing, &st); err != nil {
			t.Fatal(err)
		}
		return int64(st.Bfree) * st.Bsize
	}
	cl := openSession(t, mnt)
	const size = 5 << 20 // two do not fit in 8 MiB
	cases := []struct {
		name string
		gone func(t *testing.T, p string)
		// forgotten: freed when the kernel forgets the inode (FORGET
		// comes asynchronously, normally within milliseconds), not before
		// the request returns: the lookup stash (fs/stash.go) keeps an
		// O_PATH descriptor of a file renamed over until then, at most
		// lookupStashTTL, for an OPEN the kernel resolved before the
		// rename.
		forgotten bool
	}{
		{"deleted through the mount", func(t *testing.T, p string) {
			if err := os.Remove(filepath.Join(mnt, p)); err != nil {
				t.Fatal(err)
			}
		}, false},
		{"renamed over through the mount", func(t *testing.T, p string) {
			next := p + ".tmp"
			if err := os.WriteFile(filepath.Join(mnt, next), []byte("next"), 0o644); err != nil {
				t.Fatal(err)
			}
			releasedBy(t, d.pid(), filepath.Join(backing, next))
			if err := os.Rename(filepath.Join(mnt, next), filepath.Join(mnt, p)); err != nil {
				t.Fatal(err)
			}
		}, true},
		{"deleted in the backing directory", func(t *testing.T, p string) {
			if err := os.Remove(filepath.Join(backing, p)); err != nil {
				t.Fatal(err)
			}
		}, false},
	}
	ctx := context.Background()
	for i, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			name := fmt.Sprintf("ckpt%d", i)
			t.Cleanup(func() { os.Remove(filepath.Join(backing, name)) }) // the renamed-over case's new file
			before := free()
			data := genBytes(uint64(i+1), 0, size)
			if err := os.WriteFile(filepath.Join(mnt, name), data, 0o644); err != nil {
				t.Fatal(err)
			}
			for load := 0; load < 3; load++ { // loaded 3 times, as the GPU run did
				f, err := os.Open(filepath.Join(mnt, name))
				if err != nil {
					t.Fatal(err)
				}
				ranges := []ctl.Range{{Offset: 0, Length: size}}
				ls, err := cl.Read(ctx, f, ctl.HostDevice, ranges)
				if err != nil {
					t.Fatalf("load %d: READ: %v", load, err)
				}
				b, err := cl.Bytes(ctx, ls[0])
				if err != nil || !bytes.Equal(b[:size], data) {
					t.Fatalf("load %d: lease bytes differ from the file's (%v)", load, err)
				}
				if err := cl.Release(ctx, ls[0].ID); err != nil {
					t.Fatal(err)
				}
				f.Close()
			}
			releasedBy(t, d.pid(), filepath.Join(backing, name))
			c.gone(t, name)
			// Only the renamed-over case leaves a file (4 bytes: one page).
			want := before
			if c.forgotten {
				want -= int64(os.Getpagesize())
				waitFreed(d.pid(), backing, func() bool { return free() == want })
			}
			if held := deletedHeld(d.pid(), backing); len(held) > 0 {
				t.Errorf("the daemon still holds the file: %v", held)
			}
			if now := free(); now != want {
				t.Errorf("backing filesystem: %d bytes free, want %d: the file's blocks were not freed", now, want)
			}
		})
	}
}

// releasedBy waits until process pid holds no descriptor of the file at
// path. The kernel sends FUSE's RELEASE of a closed file after close()
// returns, so the daemon closes the user's opens (which hold the file, as
// a local filesystem's open would) a moment later; what the daemon keeps
// beyond them is what the test is about. There is no event to wait on:
// /proc is polled, for at most 10 s.
func releasedBy(t *testing.T, pid int, path string) {
	t.Helper()
	fdDir := fmt.Sprintf("/proc/%d/fd", pid)
	for deadline := time.Now().Add(10 * time.Second); ; {
		var held []string
		names, _ := os.ReadDir(fdDir)
		for _, e := range names {
			if l, err := os.Readlink(filepath.Join(fdDir, e.Name())); err == nil && l == path {
				held = append(held, e.Name())
			}
		}
		if len(held) == 0 {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("10 s after the user closed %s, the daemon still has it open (descriptors %v)", path, held)
		}
		time.Sleep(5 * time.Millisecond)
	}
}

// waitFreed waits, for at most 10 s, until process pid holds no
// descriptor of a deleted file under backing and freed says the space is
// back: the kernel's FORGET of a renamed-over inode, which ends the lookup
// stash's hold, has no event to wait on. The caller then checks both.
func waitFreed(pid int, backing string, freed func() bool) {
	for deadline := time.Now().Add(10 * time.Second); time.Now().Before(deadline); {
		if len(deletedHeld(pid, backing)) == 0 && freed() {
			return
		}
		time.Sleep(5 * time.Millisecond)
	}
}
