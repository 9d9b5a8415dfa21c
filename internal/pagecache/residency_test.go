package pagecache

import (
	"fmt"
	"os"
	"path/filepath"
	"testing"

	"golang.org/x/sys/unix"
)

// writeFile writes size bytes to a new file and returns it open for reading.
func writeFile(t testing.TB, size int) *os.File {
	t.Helper()
	p := filepath.Join(t.TempDir(), "data")
	b := make([]byte, size)
	for i := range b {
		b[i] = byte(i*7 + 1)
	}
	if err := os.WriteFile(p, b, 0o600); err != nil {
		t.Fatal(err)
	}
	f, err := os.Open(p)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { f.Close() })
	return f
}

// needCachestat skips on kernels without cachestat(2) (before 6.5).
func needCachestat(t *testing.T, f *os.File) {
	t.Helper()
	if _, ok := Cached(f, 0, 1); !ok {
		t.Skip("kernel without cachestat(2)")
	}
}

// drop evicts [off, off+n) of f (n 0: to the end), skipping the test on a
// filesystem that keeps the pages (tmpfs).
func drop(t *testing.T, f *os.File, off, n int64) {
	t.Helper()
	if err := f.Sync(); err != nil {
		t.Fatal(err)
	}
	if err := unix.Fadvise(int(f.Fd()), off, n, unix.FADV_DONTNEED); err != nil {
		t.Fatal(err)
	}
	page := int64(os.Getpagesize())
	if c, _ := Cached(f, off, max(n, page)); c >= max(n, page) {
		t.Skip("this filesystem keeps pages cached despite FADV_DONTNEED (tmpfs?)")
	}
}

func TestCachedBytes(t *testing.T) {
	const size = 16 * 4096
	f := writeFile(t, size)
	n, ok := Cached(f, 0, size)
	if !ok {
		t.Skip("kernel without cachestat(2)")
	}
	// Just written: in the page cache (t.TempDir is not O_DIRECT-only).
	if n <= 0 || n > size {
		t.Errorf("Cached = %d for a freshly written 64 KiB file", n)
	}
}

// Uncached bisects with cachestat; its answer must be mincore's, page for
// page, whatever pattern of pages is cached. Each case evicts the whole
// file, then reads its cached pages back one by one without readahead.
func TestUncachedAgreesWithMincore(t *testing.T) {
	page := int64(os.Getpagesize())
	const pages = 300
	every := func(step int64) (r [][2]int64) {
		for p := int64(0); p < pages; p += step {
			r = append(r, [2]int64{p, p + 1})
		}
		return r
	}
	for _, tc := range []struct {
		name   string
		tail   int64      // bytes past the last whole page
		cached [][2]int64 // page ranges [from, to) read back; nil: all
	}{
		{"all cached", 0, nil},
		{"none cached", 123, [][2]int64{}},
		{"first half", 123, [][2]int64{{0, pages / 2}}},
		{"first page and last", 1, [][2]int64{{0, 1}, {pages, pages + 1}}},
		{"holes", 0, [][2]int64{{0, 3}, {4, 10}, {50, 51}, {52, 200}, {299, 300}}},
		{"every other page", 17, every(2)},
		{"every fifth page", 0, every(5)},
	} {
		t.Run(tc.name, func(t *testing.T) {
			size := pages*page + tc.tail
			f := writeFile(t, int(size))
			needCachestat(t, f)
			if tc.cached != nil {
				drop(t, f, 0, 0)
				if err := unix.Fadvise(int(f.Fd()), 0, 0, unix.FADV_RANDOM); err != nil {
					t.Fatal(err)
				}
				buf := make([]byte, page)
				for _, r := range tc.cached {
					for p := r[0]; p < r[1]; p++ {
						if _, err := f.ReadAt(buf, p*page); err != nil && p*page+page <= size {
							t.Fatal(err)
						}
					}
				}
			}
			gotR, gotN, ok := Uncached(f, size)
			if !ok {
				t.Fatal("Uncached cannot measure a plain file")
			}
			wantR, wantN, ok := uncachedMincore(f, size)
			if !ok {
				t.Fatal("mincore cannot measure a plain file")
			}
			if fmt.Sprint(gotR) != fmt.Sprint(wantR) || gotN != wantN {
				t.Errorf("Uncached = %v, %d resident; mincore says %v, %d", gotR, gotN, wantR, wantN)
			}
			t.Logf("%d missing ranges, %d of %d bytes resident", len(gotR), gotN, size)
			var missing int64
			for _, r := range gotR {
				missing += r.Len
			}
			if missing+gotN != size {
				t.Errorf("%d missing + %d resident bytes, want the file's %d", missing, gotN, size)
			}
			if r, ok := Resident(f, size); !ok || r != wantN {
				t.Errorf("Resident = %d, %v; want %d", r, ok, wantN)
			}
		})
	}
}

func TestUncachedEmptyFile(t *testing.T) {
	f := writeFile(t, 0)
	if r, n, ok := Uncached(f, 0); len(r) != 0 || n != 0 || !ok {
		t.Errorf("Uncached of an empty file = %v, %d, %v", r, n, ok)
	}
	if n, ok := Resident(f, 0); n != 0 || !ok {
		t.Errorf("Resident of an empty file = %d, %v", n, ok)
	}
}
