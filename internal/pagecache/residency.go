package pagecache

import (
	"fmt"
	"os"
	"unsafe"

	"golang.org/x/sys/unix"
)

// sysCachestat is cachestat(2)'s number (the same on every architecture,
// Linux 6.5+); x/sys has no wrapper.
const sysCachestat = 451

type cachestatRange struct{ off, len uint64 }

type cachestatResult struct {
	cache, dirty, writeback, evicted, recentlyEvicted uint64
}

// Cached reports the bytes of [off, off+n) of f in the page cache, counted
// in whole pages, or false when the kernel cannot tell (no cachestat(2), or
// a filesystem it does not measure). It never maps f. n must be > 0 (0
// means to the end of the file, as cachestat(2) does).
func Cached(f *os.File, off, n int64) (int64, bool) {
	c, err := cachestat(f, off, n)
	return c, err == nil
}

// cachestat is Cached with the kernel's errno: ENOSYS before Linux 6.5,
// EPERM for a file this process neither owns nor may write (6.14+).
func cachestat(f *os.File, off, n int64) (int64, error) {
	r := cachestatRange{uint64(off), uint64(n)}
	var cs cachestatResult
	_, _, errno := unix.Syscall6(sysCachestat, f.Fd(), uintptr(unsafe.Pointer(&r)), uintptr(unsafe.Pointer(&cs)), 0, 0, 0)
	if errno != 0 {
		return 0, errno
	}
	return int64(cs.cache) * int64(os.Getpagesize()), nil
}

// byMincore is the fallback where cachestat failed with err: mincore's
// answer, unless the kernel refused on permission or mincore would not
// tell the truth either (then: cannot measure).
func byMincore(f *os.File, size int64, err error) ([]Range, int64, bool) {
	if errRefused(err) || !mincoreTells(f) {
		return nil, 0, false
	}
	return uncachedMincore(f, size)
}

// Range is a byte range of a file.
type Range struct {
	Off, Len int64
}

// Uncached returns the ranges of f's first size bytes that are not in the
// page cache (page-aligned starts, in order, adjacent ones merged, the last
// clipped to size) and the bytes that are (a cached last page counts only
// its bytes in the file). ok is false when residency cannot be measured
// (no cachestat and no mmap, or the kernel will not tell this process: a
// file it neither owns nor may write): treat the file as not cached.
func Uncached(f *os.File, size int64) (missing []Range, resident int64, ok bool) {
	if size <= 0 {
		return nil, 0, true
	}
	page := int64(os.Getpagesize())
	if _, err := cachestat(f, 0, page); err != nil {
		return byMincore(f, size, err)
	}
	add := func(p, q int64, cached bool) {
		off, end := p*page, min(q*page, size)
		if cached {
			resident += end - off
			return
		}
		if k := len(missing) - 1; k >= 0 && missing[k].Off+missing[k].Len == off {
			missing[k].Len += end - off
			return
		}
		missing = append(missing, Range{off, end - off})
	}
	// walk bisects pages [p, q) until each part is all cached or none.
	var walk func(p, q int64) bool
	walk = func(p, q int64) bool {
		c, ok := Cached(f, p*page, (q-p)*page)
		if !ok {
			return false
		}
		switch c /= page; {
		case c == 0:
			add(p, q, false)
		case c >= q-p:
			add(p, q, true)
		default:
			m := p + (q-p)/2
			return walk(p, m) && walk(m, q)
		}
		return true
	}
	if !walk(0, (size+page-1)/page) {
		return byMincore(f, size, nil)
	}
	return missing, resident, true
}

// Resident is the bytes of f's first size bytes in the page cache (a cached
// last page counts only its bytes in the file), or false when residency
// cannot be measured.
func Resident(f *os.File, size int64) (int64, bool) {
	if size <= 0 {
		return 0, true
	}
	page := int64(os.Getpagesize())
	whole := size &^ (page - 1)
	var n int64
	if whole > 0 {
		c, err := cachestat(f, 0, whole)
		if err != nil {
			_, r, ok := byMincore(f, size, err)
			return r, ok
		}
		n = min(c, whole)
	}
	if tail := size - whole; tail > 0 {
		c, err := cachestat(f, whole, page)
		if err != nil {
			_, r, ok := byMincore(f, size, err)
			return r, ok
		}
		if c > 0 {
			n += tail
		}
	}
	return n, true
}

// uncachedMincore is Uncached measured with mincore(2) on a read-only
// mapping of f, for kernels without cachestat.
func uncachedMincore(f *os.File, size int64) ([]Range, int64, bool) {
	vec, err := mincore(f, size)
	if err != nil {
		return nil, 0, false
	}
	page := int64(os.Getpagesize())
	var missing []Range
	var resident int64
	for i := 0; i < len(vec); {
		if vec[i]&1 != 0 {
			resident += min(page, size-int64(i)*page)
			i++
			continue
		}
		j := i
		for j < len(vec) && vec[j]&1 == 0 {
			j++
		}
		off := int64(i) * page
		end := min(int64(j)*page, size)
		missing = append(missing, Range{off, end - off})
		i = j
	}
	return missing, resident, true
}

// mincore reports, per page of f's first size bytes, whether it is in the
// page cache (bit 0 of each byte).
func mincore(f *os.File, size int64) ([]byte, error) {
	m, err := unix.Mmap(int(f.Fd()), 0, int(size), unix.PROT_READ, unix.MAP_SHARED)
	if err != nil {
		return nil, fmt.Errorf("mmap %s: %w", f.Name(), err)
	}
	defer unix.Munmap(m)
	page := int64(os.Getpagesize())
	vec := make([]byte, (size+page-1)/page)
	// x/sys has no Mincore wrapper; the call only reads the mapping's
	// address and writes vec, both Go memory that stays alive meanwhile.
	_, _, errno := unix.Syscall(unix.SYS_MINCORE, uintptr(unsafe.Pointer(&m[0])), uintptr(len(m)), uintptr(unsafe.Pointer(&vec[0])))
	if errno != 0 {
		return nil, fmt.Errorf("mincore %s: %w", f.Name(), errno)
	}
	return vec, nil
}
