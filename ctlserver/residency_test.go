package ctlserver

import (
	"bytes"
	"context"
	"os"
	"testing"

	"golang.org/x/sys/unix"

	"github.com/gdsfs/gdsfs/ctl"
	"github.com/gdsfs/gdsfs/cufile"
	"github.com/gdsfs/gdsfs/fs"
	"github.com/gdsfs/gdsfs/internal/pagecache"
)

// named is an engine reported under another name.
type named struct {
	cufile.Engine
	name string
}

func (n named) Name() string { return n.name }

// residencyFake chooses as cufile.Engines does in auto mode without
// nvidia-fs (no GPU here): "compat mode" while the range is in the page
// cache, measured as the daemon (root), posix otherwise; for a caller
// mayKnow refuses, one answer whatever is cached.
type residencyFake struct{ compat, posix cufile.Engine }

func (r residencyFake) Choose(f *os.File, path string, off, n int64) (cufile.Engine, string) {
	return r.ChooseAs(f, path, off, n, nil)
}

func (r residencyFake) ChooseAs(f *os.File, _ string, off, n int64, mayKnow func() bool) (cufile.Engine, string) {
	if mayKnow != nil && !mayKnow() {
		return r.posix, "test: chosen without residency"
	}
	if n < 0 {
		st, _ := f.Stat()
		n = st.Size() - off
	}
	if c, ok := pagecache.Cached(f, off, n); ok && c >= n {
		return r.compat, "test: range in the page cache"
	}
	return r.posix, "test: range not in the page cache"
}

// sharedFile is a world-readable (0644) file of n bytes owned by uid 10001,
// written back so that it can be dropped from the page cache.
func (e *testEnv) sharedFile(name string, n int) (*os.File, []byte) {
	e.t.Helper()
	f, data := e.file(name, n, os.O_RDONLY)
	if err := os.Chown(f.Name(), 10001, 10001); err != nil {
		e.t.Fatal(err)
	}
	if err := unix.Fdatasync(int(f.Fd())); err != nil {
		e.t.Fatal(err)
	}
	if _, ok := pagecache.Cached(f, 0, int64(n)); !ok {
		e.t.Skip("no cachestat(2) on this kernel: residency cannot be set up")
	}
	return f, data
}

// setCached reads f whole into the page cache, or drops it (its own pages
// only, POSIX_FADV_DONTNEED).
func setCached(t *testing.T, f *os.File, n int, cached bool) {
	t.Helper()
	if cached {
		// Clean pages first (written back), then read: what is cached is
		// then plain cached pages, whatever the kernel counts dirty ones as.
		if err := f.Sync(); err != nil {
			t.Fatal(err)
		}
		if _, err := f.ReadAt(make([]byte, n), 0); err != nil {
			t.Fatal(err)
		}
		if c, ok := pagecache.Cached(f, 0, int64(n)); !ok || c < int64(n) {
			t.Skipf("%d of %d bytes cached (measured: %v) right after reading them: this machine evicts or cannot tell", c, n, ok)
		}
		return
	}
	if err := unix.Fadvise(int(f.Fd()), 0, 0, unix.FADV_DONTNEED); err != nil {
		t.Fatal(err)
	}
	if c, _ := pagecache.Cached(f, 0, int64(n)); c > int64(n)/4 {
		t.Skipf("%d of %d bytes still cached after POSIX_FADV_DONTNEED", c, n)
	}
}

// TestResidencyNotToldToOtherUsers: uid 10002 reads uid 10001's
// world-readable file through the control path. The kernel would not tell
// 10002 the file's page-cache residency (cachestat EPERM, mincore all
// resident), so its READ replies (the lease's engine) and user.gdsfs.info
// must be the same for the file cached and dropped; the owner's follow
// residency (the chooser does vary, so this test can fail).
func TestResidencyNotToldToOtherUsers(t *testing.T) {
	const n = 1 << 20
	e := newEnv(t, envOptions{slabBytes: 4 << 20, budgetBytes: 16 << 20, noIndexes: true})
	host := cufile.NewHostEngine(cufile.Options{ChunkBytes: 64 << 10, Workers: 2})
	e.srv.opts.Engines = residencyFake{compat: named{host, cufile.EngineGDSCompat}, posix: named{host, cufile.EnginePosix}}
	e.srv.opts.Readahead.MaxBytes = -1
	f, data := e.sharedFile("shared.bin", n)
	type answer struct {
		engine ctl.EngineCode
		info   string
	}
	ask := func(uid uint32, cached bool) answer {
		t.Helper()
		c := fs.Caller{UID: uid, GID: uid, PID: 1}
		setCached(t, f, n, cached)
		info, errno := e.srv.Xattr(context.Background(), c, fs.XattrTarget{Path: f.Name(), Open: func() (*os.File, error) { return os.Open(f.Name()) }}, "user.gdsfs.info")
		if errno != 0 {
			t.Fatalf("uid %d: user.gdsfs.info: %v", uid, errno)
		}
		setCached(t, f, n, cached)
		cl := e.client(uid, ctl.Token{})
		rs := []ctl.Range{{Offset: 4096, Length: 64 << 10}}
		ls, err := cl.Read(context.Background(), f, ctl.HostDevice, rs)
		if err != nil {
			t.Fatalf("uid %d: READ: %v", uid, err)
		}
		got, err := cl.Bytes(context.Background(), ls[0])
		if err != nil || !bytes.Equal(got, data[4096:4096+64<<10]) {
			t.Errorf("uid %d: READ's bytes differ from the file's (%v)", uid, err)
		}
		releaseAll(t, cl, ls)
		return answer{ls[0].Engine, string(info)}
	}
	for _, tc := range []struct {
		who     string
		uid     uint32
		readers bool // --residency readers
		told    bool
	}{
		{"owner", 10001, false, true},
		{"other user", 10002, false, false},
		{"root", 0, false, true},
		{"other user, --residency readers", 10002, true, true},
	} {
		e.srv.opts.ResidencyToReaders = tc.readers
		warm, cold := ask(tc.uid, true), ask(tc.uid, false)
		switch {
		case tc.told && (warm.engine == cold.engine || warm.info == cold.info):
			t.Errorf("%s: cached %+v, dropped %+v: want answers that follow residency", tc.who, warm, cold)
		case !tc.told && warm != cold:
			t.Errorf("%s (uid %d, neither owner nor writer): its answers tell residency: cached\n%+v\ndropped\n%+v", tc.who, tc.uid, warm, cold)
		}
	}
}

// TestReadaheadFiguresHideResidency: the readahead figures of uid 10002's
// STATUS are the same after the same sequential READs of uid 10001's
// world-readable file cached or dropped (root's count jobs, which differ),
// and uid 10001's READs do not move them.
func TestReadaheadFiguresHideResidency(t *testing.T) {
	const (
		fileBytes = 16 << 20
		sample    = 60 << 10
		k         = 16
		step      = k * (sample + 512)
	)
	type figures struct{ n, bytes, dropped uint64 }
	of := func(c CounterStats) figures { return figures{c.Readaheads, c.ReadaheadBytes, c.ReadaheadDropped} }
	run := func(cached bool) (user, root figures) {
		e := newEnv(t, envOptions{slabBytes: 16 << 20, budgetBytes: 64 << 20, noIndexes: true})
		e.srv.opts.Engines = fixedEngine{cufile.NewHostEngine(cufile.Options{})}
		f, data := e.sharedFile("shared.bin", fileBytes)
		setCached(t, f, fileBytes, cached)
		own, ownData := e.sharedFile("own.bin", fileBytes) // uid 10001 reads its own file
		setCached(t, own, fileBytes, false)
		for _, fd := range []*os.File{f, own} {
			if err := unix.Fadvise(int(fd.Fd()), 0, 0, unix.FADV_RANDOM); err != nil {
				t.Fatal(err)
			}
		}
		reads := func(cl *ctl.Client, fd *os.File, data []byte) {
			for j := range 4 {
				rs := batch(uint64(j)*step, k, sample)
				ls, err := cl.Read(context.Background(), fd, ctl.HostDevice, rs)
				if err != nil {
					t.Fatal(err)
				}
				checkLeases(t, cl, rs, ls, data)
				releaseAll(t, cl, ls)
				e.srv.ra.wg.Wait()
			}
		}
		reads(e.client(10002, ctl.Token{}), f, data)
		user, root = of(e.srv.StatsFor(10002).Counters), of(e.srv.StatsFor(0).Counters)
		reads(e.client(10001, ctl.Token{}), own, ownData) // starts jobs: dropped
		if of(e.srv.StatsFor(0).Counters) == root {
			t.Fatal("uid 10001's READs of a dropped file started no readahead")
		}
		if got := of(e.srv.StatsFor(10002).Counters); got != user {
			t.Errorf("uid 10001's READs show in uid 10002's STATUS: %+v, was %+v", got, user)
		}
		return user, root
	}
	warmUser, warmRoot := run(true)
	coldUser, coldRoot := run(false)
	if warmRoot == coldRoot {
		t.Errorf("root's readahead figures are %+v cached and dropped: want jobs only for the dropped file", warmRoot)
	}
	if warmUser != coldUser || warmUser.n == 0 {
		t.Errorf("uid 10002's readahead figures: cached %+v, dropped %+v: want the same windows, some", warmUser, coldUser)
	}
}

// BenchmarkMayTell is what a READ's engine choice adds where residency
// would decide (auto without nvidia-fs): the kernel's rule for the caller,
// for an owner (decided by the fstat) and for another user of a
// world-readable file (decided by the mode bits).
func BenchmarkMayTell(b *testing.B) {
	p := b.TempDir() + "/f"
	if err := os.WriteFile(p, []byte("x"), 0o644); err != nil {
		b.Fatal(err)
	}
	if err := os.Chown(p, 10001, 10001); err != nil {
		b.Fatal(err)
	}
	f, err := os.Open(p)
	if err != nil {
		b.Fatal(err)
	}
	defer f.Close()
	for _, c := range []struct {
		name string
		uid  uint32
		want bool
	}{{"owner", 10001, true}, {"other", 10002, false}} {
		b.Run(c.name, func(b *testing.B) {
			for b.Loop() {
				if mayTell(fs.Caller{UID: c.uid, GID: c.uid, PID: 1}, f, writable(f)) != c.want {
					b.Fatal("wrong answer")
				}
			}
		})
	}
}
