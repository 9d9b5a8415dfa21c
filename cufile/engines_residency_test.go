package cufile

import (
	"os"
	"path/filepath"
	"testing"

	"golang.org/x/sys/unix"

	"github.com/gdsfs/gdsfs/internal/pagecache"
)

func TestResidencySample(t *testing.T) {
	const mib = 1 << 20
	for _, tc := range []struct {
		name   string
		off, n int64
	}{
		{"empty", 5, 0},
		{"small", 4096, 3 * mib},
		{"exactly the cap", 0, residencyWindows * residencyWindow},
		{"just over", 7, residencyWindows*residencyWindow + 1},
		{"huge", 1 << 30, 1 << 40},
	} {
		t.Run(tc.name, func(t *testing.T) {
			w := residencySample(tc.off, tc.n)
			var total int64
			for i, win := range w {
				total += win[1]
				if win[0] < tc.off || win[0]+win[1] > tc.off+tc.n || win[1] <= 0 {
					t.Errorf("window %d %v outside [%d, %d)", i, win, tc.off, tc.off+tc.n)
				}
				if i > 0 && win[0] < w[i-1][0]+w[i-1][1] {
					t.Errorf("window %d %v overlaps the previous %v", i, win, w[i-1])
				}
			}
			switch {
			case tc.n == 0 && len(w) != 0:
				t.Errorf("empty range sampled: %v", w)
			case tc.n > 0 && tc.n <= residencyWindows*residencyWindow && (len(w) != 1 || w[0] != [2]int64{tc.off, tc.n}):
				t.Errorf("small range sampled as %v, want itself", w)
			case tc.n > residencyWindows*residencyWindow:
				if total != residencyWindows*residencyWindow || w[0][0] != tc.off || w[len(w)-1][0]+w[len(w)-1][1] < tc.off+tc.n-residencyWindow {
					t.Errorf("large range sampled as %v (%d bytes): want %d windows from its start to its end", w, total, residencyWindows)
				}
			}
		})
	}
}

// The auto chooser's residency is that of the range read, not the file's:
// half a file dropped from the page cache reads as uncached there and cached
// in the other half.
func TestRangeMostlyCached(t *testing.T) {
	const half = 12 << 20 // over the sample cap: each half is sampled
	p := filepath.Join(t.TempDir(), "data")
	if err := os.WriteFile(p, make([]byte, 2*half), 0o600); err != nil {
		t.Fatal(err)
	}
	f, err := os.Open(p)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	if _, ok := pagecache.Cached(f, 0, 1); !ok {
		t.Skip("kernel without cachestat(2)")
	}
	if err := f.Sync(); err != nil {
		t.Fatal(err)
	}
	if err := unix.Fadvise(int(f.Fd()), 0, half, unix.FADV_DONTNEED); err != nil {
		t.Fatal(err)
	}
	if c, _ := pagecache.Cached(f, 0, half); c > half/4 {
		t.Skipf("the page cache kept %d of %d dropped bytes (filesystem ignores FADV_DONTNEED)", c, half)
	}
	for _, tc := range []struct {
		off, n int64
		want   bool
	}{
		{0, half, false},
		{half, half, true},
		{half, -1, true},
		{2 * half, 10, false}, // at EOF: nothing to measure
		{4096, 1 << 20, false},
		{half + 4096, 1 << 20, true},
	} {
		if got := rangeMostlyCached(f, tc.off, tc.n); got != tc.want {
			t.Errorf("rangeMostlyCached(%d, %d) = %v, want %v", tc.off, tc.n, got, tc.want)
		}
	}
}

// BenchmarkResidency compares the whole-range cachestat the chooser did
// before with the bounded sample, on a cached 256 MiB file: the cost of
// Engines.Choose in auto mode without nvidia-fs, which ctl does not cache.
func BenchmarkResidency(b *testing.B) {
	const size = 256 << 20
	p := filepath.Join(b.TempDir(), "data")
	if err := os.WriteFile(p, make([]byte, size), 0o600); err != nil {
		b.Fatal(err)
	}
	f, err := os.Open(p)
	if err != nil {
		b.Fatal(err)
	}
	defer f.Close()
	b.Run("whole", func(b *testing.B) {
		for b.Loop() {
			pagecache.Cached(f, 0, size)
		}
	})
	b.Run("sampled", func(b *testing.B) {
		for b.Loop() {
			rangeMostlyCached(f, 0, -1)
		}
	})
	b.Run("sampled-8MiB", func(b *testing.B) { // a READ's span: one window
		for b.Loop() {
			rangeMostlyCached(f, 64<<20, 8<<20)
		}
	})
}

// autoCompatEngines is the auto chooser of a GPU host without nvidia-fs
// (compat mode for cached ranges, posix otherwise) with f's file already
// registered with cuFile: the chooser's own code, no GPU needed (posix is
// a placeholder engine here; nothing is read).
func autoCompatEngines(t *testing.T, f *os.File) *Engines {
	t.Helper()
	e := &Engines{compatWarm: true, report: Report{Engine: EnginePosix}, files: map[fileKey]choice{}, posix: &posixEngine{}}
	k, err := keyOf(f)
	if err != nil {
		t.Fatal(err)
	}
	e.files[k] = choice{&fallbackEngine{e: e, key: k, path: f.Name()}, "gds-compat: registered"}
	return e
}

// TestChooseAsHidesResidency: for a caller the kernel would not tell the
// file's residency, the auto chooser's answer (engine and reason) is the
// same for a cached and a dropped file and it measures nothing; for one it
// would tell, the answer follows residency.
func TestChooseAsHidesResidency(t *testing.T) {
	const size = 4 << 20
	p := filepath.Join(t.TempDir(), "data")
	if err := os.WriteFile(p, make([]byte, size), 0o644); err != nil {
		t.Fatal(err)
	}
	f, err := os.Open(p)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	if _, ok := pagecache.Cached(f, 0, 1); !ok {
		t.Skip("kernel without cachestat(2)")
	}
	if err := f.Sync(); err != nil {
		t.Fatal(err)
	}
	e := autoCompatEngines(t, f)
	type answer struct {
		gds bool
		why string
	}
	ask := func(mayKnow func() bool) answer {
		eng, why := e.ChooseAs(f, p, 0, size, mayKnow)
		_, gds := eng.(*fallbackEngine)
		return answer{gds, why}
	}
	state := func(cached bool) {
		if cached {
			if _, err := f.ReadAt(make([]byte, size), 0); err != nil {
				t.Fatal(err)
			}
			return
		}
		if err := unix.Fadvise(int(f.Fd()), 0, 0, unix.FADV_DONTNEED); err != nil {
			t.Fatal(err)
		}
		if c, _ := pagecache.Cached(f, 0, size); c > size/4 {
			t.Skipf("the page cache kept %d of %d dropped bytes", c, size)
		}
	}
	asked := 0
	no := func() bool { asked++; return false }
	state(true)
	warmOwner, warmOther := ask(nil), ask(no)
	state(false)
	coldOwner, coldOther := ask(func() bool { return true }), ask(no)
	if warmOwner == coldOwner || !warmOwner.gds || coldOwner.gds {
		t.Errorf("a caller who may know: cached %+v, dropped %+v: want compat mode cached and posix dropped", warmOwner, coldOwner)
	}
	if warmOther != coldOther || warmOther.gds || warmOther.why != ReasonNoResidency {
		t.Errorf("a caller who may not know: cached %+v, dropped %+v: want the same posix answer (%q)", warmOther, coldOther, ReasonNoResidency)
	}
	if asked != 2 {
		t.Errorf("mayKnow asked %d times for 2 choices", asked)
	}
}

// TestCompatModeReadsBuffered: cuFile in compat mode (no nvidia-fs) reads
// through the page cache, so the control path's readahead must keep a
// sequential run going across READs that the chooser gives to it (a cold
// run of small samples alternates posix and compat READs as the kernel's
// own readahead caches the next batch); with nvidia-fs it reads around
// the page cache and reading ahead would read twice.
func TestCompatModeReadsBuffered(t *testing.T) {
	p := filepath.Join(t.TempDir(), "data")
	if err := os.WriteFile(p, make([]byte, 4096), 0o644); err != nil {
		t.Fatal(err)
	}
	f, err := os.Open(p)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	for _, tc := range []struct {
		nvfs bool
		want bool
	}{{nvfs: false, want: true}, {nvfs: true, want: false}} {
		e := autoCompatEngines(t, f)
		e.nvfs = tc.nvfs
		k, _ := keyOf(f)
		eng := e.files[k].engine
		br, ok := BufferedReaderOf(eng)
		got := ok && br.ReadsBuffered(1<<20, 4096)
		if got != tc.want {
			t.Errorf("nvidia-fs %v: the gds engine reads buffered = %v, want %v", tc.nvfs, got, tc.want)
		}
	}
}
