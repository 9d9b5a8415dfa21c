package integration

import (
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"testing"
)

// TestUnlinkFreesSpaceAtOnce: a file deleted through the mount gives its
// blocks back to the backing filesystem at once, also when the kernel
// looked the file up again before deleting it (the benchmark pattern of
// the 2026-12-01 18:30 GPU run: save a checkpoint, load it a few times,
// delete it, save the next one straight away). The lookup stash's O_PATH
// descriptor of such a re-lookup used to land on a node go-fuse then
// dropped for the one it knew, so Unlink's release missed it and the
// deleted file kept its blocks until the stash's sweeper ran (2-3 s):
// the next save on a nearly full disk got ENOSPC. --entry-timeout 0 makes
// every stat a LOOKUP of the already-known node, with no waiting.
func TestUnlinkFreesSpaceAtOnce(t *testing.T) {
	requireRoot(t)
	dir := t.TempDir()
	backing, mnt := mountDirs(t, dir)
	if err := syscall.Mount("gdsfs-unlinkspace", backing, "tmpfs", 0, "size=8m"); err != nil {
		t.Fatalf("mount tmpfs: %v", err)
	}
	t.Cleanup(func() {
		if err := syscall.Unmount(backing, syscall.MNT_DETACH); err != nil {
			t.Errorf("unmount tmpfs: %v", err)
		}
	})
	d := startBinDaemon(t, backing, mnt, "--engine", "host", "--host-pool", "64MiB", "--slab-size", "16MiB",
		"--entry-timeout", "0")
	const size = 5 << 20 // two of them do not fit in 8 MiB
	for i, how := range []string{"created through the mount", "created, then looked up again"} {
		p := filepath.Join(mnt, "ckpt")
		if err := os.WriteFile(p, genBytes(uint64(i+1), 0, size), 0o644); err != nil {
			t.Fatalf("%s: write: %v", how, err)
		}
		if i == 1 {
			for k := 0; k < 3; k++ { // the loads: each open and stat looks the name up again
				if _, err := os.ReadFile(p); err != nil {
					t.Fatalf("%s: read: %v", how, err)
				}
			}
		}
		if err := os.Remove(p); err != nil {
			t.Fatalf("%s: remove: %v", how, err)
		}
		if held := deletedHeld(d.pid(), backing); len(held) > 0 {
			t.Errorf("%s: after its removal through the mount the daemon still holds %v", how, held)
		}
		next := filepath.Join(mnt, "next")
		if err := os.WriteFile(next, genBytes(9, 0, size), 0o644); err != nil {
			t.Fatalf("%s: the next save, right after the removal: %v (the removed file's blocks were not freed)", how, err)
		}
		if err := os.Remove(next); err != nil {
			t.Fatal(err)
		}
	}
}

// deletedHeld lists the daemon's descriptors of deleted files under backing.
func deletedHeld(pid int, backing string) []string {
	fdDir := filepath.Join("/proc", strconv.Itoa(pid), "fd")
	names, _ := os.ReadDir(fdDir)
	var out []string
	for _, e := range names {
		l, err := os.Readlink(filepath.Join(fdDir, e.Name()))
		if err == nil && strings.HasPrefix(l, backing+"/") && strings.HasSuffix(l, " (deleted)") {
			out = append(out, e.Name()+" -> "+l)
		}
	}
	return out
}
