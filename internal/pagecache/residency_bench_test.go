package pagecache

import (
	"os"
	"testing"

	"golang.org/x/sys/unix"
)

// BenchmarkUncached compares the bisection (cachestat) with one mincore
// over a 64 MiB file, fully cached and with every other page dropped (the
// bisection's worst case: every part is mixed down to single pages).
func BenchmarkUncached(b *testing.B) {
	const size = 64 << 20
	page := int64(os.Getpagesize())
	for _, holes := range []bool{false, true} {
		name := "cached"
		if holes {
			name = "every-other-page"
		}
		b.Run(name, func(b *testing.B) {
			f := writeFile(b, size)
			if _, ok := Cached(f, 0, 1); !ok {
				b.Skip("kernel without cachestat(2)")
			}
			if holes {
				if err := f.Sync(); err != nil {
					b.Fatal(err)
				}
				if err := unix.Fadvise(int(f.Fd()), 0, 0, unix.FADV_DONTNEED); err != nil {
					b.Fatal(err)
				}
				if err := unix.Fadvise(int(f.Fd()), 0, 0, unix.FADV_RANDOM); err != nil {
					b.Fatal(err)
				}
				buf := make([]byte, page)
				for off := int64(0); off < size; off += 2 * page {
					if _, err := f.ReadAt(buf, off); err != nil {
						b.Fatal(err)
					}
				}
			}
			b.Run("bisect", func(b *testing.B) {
				for b.Loop() {
					Uncached(f, size)
				}
			})
			b.Run("mincore", func(b *testing.B) {
				for b.Loop() {
					uncachedMincore(f, size)
				}
			})
		})
	}
}
