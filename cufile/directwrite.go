package cufile

import (
	"errors"
	"os"
	"syscall"
	"unsafe"

	"golang.org/x/sys/unix"

	"github.com/gdsfs/gdsfs/gpubuf"
	"github.com/gdsfs/gdsfs/internal/openflags"
)

// Writes of slab data (the WRITE ioctl: checkpoint saves) go around the
// page cache where they can: the 4 KiB-aligned body of a range is written
// through an O_DIRECT twin of the file, its unaligned head and tail through
// the file itself (buffered). A buffered write lands in the page cache and
// reaches the disk at writeback and fsync, at one file's writeback rate
// (GPU run of 2026-12-01: 1.16 GB/s buffered to 1 file vs 1.91 O_DIRECT);
// the slab data is already in memory the daemon owns, so the cache adds a
// copy and a second pass. The kernel keeps O_DIRECT coherent with the page
// cache (it writes back and invalidates the pages of the range around a
// direct write), so readers through the mount see the new bytes. O_DIRECT
// does not make the write durable: the file's metadata (its size, its
// allocated extents) still needs the caller's fsync, as before.
//
// ext4 runs direct writes of one file in parallel only where they overwrite
// allocated (or preallocated) blocks inside the file's size; writes into
// holes or past the end take the inode lock one at a time. A client that
// knows the file's final size may preallocate it first (BenchmarkWriteAtFsync:
// one file gains); gdsfs.dcp no longer does, it writes a large snapshot as
// several files instead: there, fallocate of one file while the others'
// direct writes run stalled up to 80 ms and lengthened the fsyncs, for no
// faster save (docs/benchmarks.md, "Staged save vs the disk"). The daemon
// does not fallocate per WRITE: ext4's fallocate waits for every direct
// write in flight on the file, which would serialize them again.

// writeDirectMin is the smallest aligned body that Direct "auto" writes
// with O_DIRECT: below it, a synchronous direct write costs more latency
// than the page cache's copy saves.
const writeDirectMin = 1 << 20

// DirectWriteMinBytes is the smallest 4 KiB-aligned write body the posix
// and host engines write with O_DIRECT under the Direct policy direct
// (Options.Direct); 0 when they write every body buffered.
func DirectWriteMinBytes(direct string) int64 {
	switch direct {
	case "always":
		return gpubuf.Align
	case "never":
		return 0
	}
	return writeDirectMin
}

// directWrite reports whether a write whose aligned body is body bytes
// goes through O_DIRECT under opts.Direct.
func (opts Options) directWrite(body int64) bool {
	switch opts.Direct {
	case "always":
		return body > 0
	case "never":
		return false
	}
	return body >= writeDirectMin
}

// alignedSplit splits a write of n bytes at file offset off into an
// unaligned head, a 4 KiB-aligned body (starting at an aligned offset, a
// multiple of 4 KiB long) and an unaligned tail, head+body+tail == n.
// body is 0 when the range holds no whole aligned page.
func alignedSplit(off, n int64) (head, body, tail int64) {
	head = min(n, (gpubuf.Align-off%gpubuf.Align)%gpubuf.Align)
	body = (n - head) &^ (gpubuf.Align - 1)
	return head, body, n - head - body
}

// openDirectWrite reopens f with O_DIRECT for writing, keeping f's access
// mode and its O_SYNC/O_DSYNC (a caller's synchronous writes stay
// synchronous); nil when f is not open for writing, appends (a positional
// write to an O_APPEND descriptor is refused, and the twin must not allow
// it), or the filesystem refuses O_DIRECT.
func openDirectWrite(f *os.File) *os.File {
	fl, err := openflags.Of(f)
	if err != nil || fl&unix.O_ACCMODE == unix.O_RDONLY || fl&unix.O_APPEND != 0 {
		return nil
	}
	keep := fl & (unix.O_ACCMODE | unix.O_SYNC | unix.O_DSYNC)
	d, err := openflags.Reopen(f, keep|syscall.O_DIRECT)
	if err != nil {
		return nil
	}
	return d
}

// isAligned reports whether b starts at a 4 KiB-aligned address and holds
// a multiple of 4 KiB, as O_DIRECT needs.
func isAligned(b []byte) bool {
	return len(b) > 0 && len(b)%gpubuf.Align == 0 && uintptr(unsafe.Pointer(&b[0]))%gpubuf.Align == 0
}

// writePiece writes all of b at off: through direct when it is not nil,
// and through f when it is nil or the filesystem refuses this direct write
// (EINVAL: memory, offset or length not aligned as it needs, or no O_DIRECT
// for this file). A direct write refused with EINVAL is refused before it
// moves a byte, and rewriting the same bytes buffered is idempotent anyway.
func writePiece(f, direct *os.File, b []byte, off int64) error {
	if direct != nil {
		err := pwriteFull(direct, b, off)
		if err == nil || !errors.Is(err, syscall.EINVAL) {
			return err
		}
	}
	return pwriteFull(f, b, off)
}

// writeParts writes the n bytes of a WRITE at fileOff in up to three
// parts: the 4 KiB-aligned body through an O_DIRECT reopen of f when
// useDirect(head, body) allows it and f can be reopened so, the unaligned
// head and tail (or the whole range) through f. write writes the part
// [off, off+n) of the request through direct (nil: through f).
func writeParts(f *os.File, fileOff, n int64, useDirect func(head, body int64) bool, write func(direct *os.File, off, n int64) error) error {
	head, body, tail := alignedSplit(fileOff, n)
	var direct *os.File
	if useDirect(head, body) {
		direct = openDirectWrite(f)
	}
	if direct == nil {
		head, body, tail = n, 0, 0
	} else {
		defer direct.Close()
	}
	for _, p := range []struct {
		off, n int64
		direct *os.File
	}{{0, head, nil}, {head, body, direct}, {head + body, tail, nil}} {
		if p.n == 0 {
			continue
		}
		if err := write(p.direct, p.off, p.n); err != nil {
			return err
		}
	}
	return nil
}
