package integration

import (
	"os"
	"path/filepath"
	"syscall"
	"testing"
	"time"
)

// TestRenameOverFreesSpaceAtOnce: a file renamed over through the mount
// gives its blocks back to the backing filesystem as the backing
// filesystem's own rename does, so that the save-to-a-temporary-name and
// rename pattern of checkpoint writers (torch.save to ckpt.tmp, then
// os.replace onto ckpt) can save the next checkpoint at once on a disk
// that holds two of them but not three. The stash of the file renamed over
// (stash.go) held its blocks until it expired, 2 s later: every save but
// the first got ENOSPC. It now goes when the kernel forgets the inode.
func TestRenameOverFreesSpaceAtOnce(t *testing.T) {
	requireRoot(t)
	dir := t.TempDir()
	backing, mnt := mountDirs(t, dir)
	if err := syscall.Mount("gdsfs-renamespace", backing, "tmpfs", 0, "size=8m"); err != nil {
		t.Fatalf("mount tmpfs: %v", err)
	}
	t.Cleanup(func() {
		if err := syscall.Unmount(backing, syscall.MNT_DETACH); err != nil {
			t.Errorf("unmount tmpfs: %v", err)
		}
	})
	startBinDaemon(t, backing, mnt, "--engine", "host", "--host-pool", "64MiB", "--slab-size", "16MiB")
	const size = 3 << 20 // two fit in 8 MiB, three do not
	ckpt, tmp := filepath.Join(mnt, "ckpt"), filepath.Join(mnt, "ckpt.tmp")
	if err := os.WriteFile(ckpt, genBytes(1, 0, size), 0o644); err != nil {
		t.Fatal(err)
	}
	for i := 2; i < 10; i++ {
		if _, err := os.ReadFile(ckpt); err != nil { // a load of the last one
			t.Fatalf("save %d: load: %v", i, err)
		}
		// The kernel tells the daemon it forgot the inode renamed over
		// (FORGET) asynchronously, so its blocks come back a moment
		// after the rename, not within it: wait for the backing
		// filesystem to have room, for at most half the stash's 2 s
		// lifetime (before the fix, the blocks came back only then).
		waitFree(t, backing, size, time.Second)
		if err := os.WriteFile(tmp, genBytes(uint64(i), 0, size), 0o644); err != nil {
			t.Fatalf("save %d: write %s: %v (the checkpoint renamed over before was not freed)", i, tmp, err)
		}
		if err := os.Rename(tmp, ckpt); err != nil {
			t.Fatalf("save %d: rename: %v", i, err)
		}
	}
}

// waitFree waits until the filesystem at dir has n bytes free, or for at
// most limit; the write that follows reports ENOSPC if it never has.
func waitFree(t *testing.T, dir string, n int64, limit time.Duration) {
	t.Helper()
	deadline := time.Now().Add(limit)
	for {
		var st syscall.Statfs_t
		if err := syscall.Statfs(dir, &st); err != nil {
			t.Fatalf("statfs %s: %v", dir, err)
		}
		if int64(st.Bavail)*st.Bsize >= n || time.Now().After(deadline) {
			return
		}
		time.Sleep(time.Millisecond)
	}
}
