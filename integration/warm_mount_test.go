package integration

import (
	"crypto/rand"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"unsafe"

	"golang.org/x/sys/unix"
)

// backingResident is the oracle: the fraction of the backing file's pages
// in the page cache, by mincore(2) on a mapping of the backing file itself.
func backingResident(t *testing.T, p string) float64 {
	t.Helper()
	f, err := os.Open(p)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	st, err := f.Stat()
	if err != nil {
		t.Fatal(err)
	}
	m, err := unix.Mmap(int(f.Fd()), 0, int(st.Size()), unix.PROT_READ, unix.MAP_SHARED)
	if err != nil {
		t.Fatal(err)
	}
	defer unix.Munmap(m)
	page := int64(os.Getpagesize())
	vec := make([]byte, (st.Size()+page-1)/page)
	if _, _, e := unix.Syscall(unix.SYS_MINCORE, uintptr(unsafe.Pointer(&m[0])), uintptr(len(m)), uintptr(unsafe.Pointer(&vec[0]))); e != 0 {
		t.Fatalf("mincore %s: %v", p, e)
	}
	n := 0
	for _, v := range vec {
		n += int(v & 1)
	}
	return float64(n) / float64(len(vec))
}

// dropCache writes nothing and evicts p's clean pages (p was synced).
func dropCache(t *testing.T, p string) {
	t.Helper()
	f, err := os.Open(p)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	if err := f.Sync(); err != nil {
		t.Fatal(err)
	}
	if err := unix.Fadvise(int(f.Fd()), 0, 0, unix.FADV_DONTNEED); err != nil {
		t.Fatal(err)
	}
}

// TestWarmOnMountSaysCached: `gdsfs warm` of a file on a gdsfs mount, as
// root and as other uids, with and without kernel passthrough (where reads
// go straight to the backing file and the FUSE inode caches nothing),
// leaves the file cached (the backing file's own mincore is the oracle)
// and says so truthfully. Where it may measure (root, the file's owner) it
// reports 100% and a second warm reads nothing. Where the kernel will not
// tell (a reader who neither owns the file nor may write it: cachestat
// says EPERM and mincore pretends every page is cached; or the backing
// file is out of the user's reach) it reads the whole file and says it
// cannot tell. Before the fix warm measured the FUSE file's (empty) page
// cache as root ("0 B cached now", "did not stay cached", every warm read
// it all again), and as a mere reader took mincore's pretence for the
// truth ("already cached": it read nothing at all).
func TestWarmOnMountSaysCached(t *testing.T) {
	if gdsfsBin(t) == "" {
		t.Skip("GDSFS_BIN not set (make build)")
	}
	const owner, reader = 10001, 10002
	cases := []struct {
		name      string
		noPass    bool
		uid       uint32 // who warms (0: root)
		fileOwner uint32 // who owns the file
		closedDir bool   // the backing directory is closed to others (0700 root)
		measured  bool   // warm can tell what is cached
	}{
		{"passthrough root", false, 0, 0, false, true},
		{"passthrough owner", false, owner, owner, false, true},
		{"passthrough reader", false, reader, 0, false, false},
		{"passthrough owner, backing closed to it", false, owner, owner, true, false},
		{"daemon reads root", true, 0, 0, false, true},
		{"daemon reads owner", true, owner, owner, false, true},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			m := startMount(t, mountOpts{Daemon: true, OtherUIDs: true, NoPassthrough: c.noPass})
			data := make([]byte, 3<<20+123)
			if _, err := rand.Read(data); err != nil {
				t.Fatal(err)
			}
			bp := filepath.Join(m.backing, "w.bin")
			writeFile(t, bp, data)
			if err := os.Chmod(bp, 0o644); err != nil {
				t.Fatal(err)
			}
			if err := os.Chown(bp, int(c.fileOwner), int(c.fileOwner)); err != nil {
				t.Fatal(err)
			}
			if c.closedDir {
				if err := os.Chmod(m.backing, 0o700); err != nil {
					t.Fatal(err)
				}
			}
			dropCache(t, bp)
			if r := backingResident(t, bp); r > 0.5 {
				t.Skipf("could not evict the backing file's pages (%.0f%% still cached)", 100*r)
			}
			warm := func() string {
				args := []string{"warm", "--progress", "never", filepath.Join(m.mnt, "w.bin")}
				var out string
				var code int
				if c.uid == 0 {
					out, code = runGdsfs(t, args...)
				} else {
					out, code = runAsUID(t, c.uid, gdsfsBin(t), args...)
				}
				if code != 0 {
					t.Fatalf("gdsfs warm: exit %d: %s", code, out)
				}
				return out
			}
			out := warm()
			if r := backingResident(t, bp); r < 1 {
				t.Fatalf("after warm the backing file is %.0f%% cached (oracle); warm said: %s", 100*r, out)
			}
			if strings.Contains(out, "did not stay cached") || !strings.Contains(out, "read 3.0 MiB") {
				t.Errorf("first warm (nothing cached, then all of it: oracle) said: %s", out)
			}
			if c.measured {
				if !strings.Contains(out, "cached now (100.0%)") {
					t.Errorf("warm of a file now cached (oracle: 100%%) said: %s", out)
				}
				if out := warm(); !strings.Contains(out, "read 0 B") || !strings.Contains(out, "(3.0 MiB were already cached)") {
					t.Errorf("a second warm read again what is cached: %s", out)
				}
				return
			}
			if !strings.Contains(out, "cannot tell") || strings.Contains(out, "cached now (") {
				t.Errorf("warm that cannot measure the page cache said: %s", out)
			}
		})
	}
}
