package pagecache

import (
	"fmt"
	"os"
	"strconv"
	"strings"
	"sync"

	"golang.org/x/sys/unix"
)

// WillNeed starts reading [off, off+n) of f into the page cache and
// returns without waiting for the disk (posix_fadvise(POSIX_FADV_WILLNEED)):
// a hint, the kernel may drop it. The kernel reads at most its readahead
// limit per call (the larger of the device's read_ahead_kb and
// max_sectors_kb), so WillNeed asks in pieces of pieceBytes. It holds f's
// descriptor for the calls, so a concurrent Close cannot hand the number
// to another file meanwhile; f closed before is an error.
func WillNeed(f *os.File, off, n, pieceBytes int64) error {
	if n <= 0 {
		return nil
	}
	pieceBytes = max(pieceBytes, int64(os.Getpagesize()))
	rc, err := f.SyscallConn()
	if err != nil {
		return fmt.Errorf("pagecache: readahead %q: %w", f.Name(), err)
	}
	var serr error
	err = rc.Control(func(fd uintptr) {
		for p := off; p < off+n && serr == nil; p += pieceBytes {
			serr = unix.Fadvise(int(fd), p, min(pieceBytes, off+n-p), unix.FADV_WILLNEED)
		}
	})
	if err == nil {
		err = serr
	}
	if err != nil {
		return fmt.Errorf("pagecache: readahead %q: %w", f.Name(), err)
	}
	return nil
}

// DefaultPieceBytes is the piece WillNeed asks for where the device's
// limits are unknown: the kernel's default read_ahead_kb.
const DefaultPieceBytes = 128 << 10

// maxPieceBytes caps the piece: the kernel reads a WILLNEED range in
// 2 MiB steps anyway.
const maxPieceBytes = 2 << 20

// Pieces finds, per filesystem device, the most one WILLNEED call of a
// file on it reads (see WillNeed). The zero value is ready; safe for
// concurrent use.
type Pieces struct {
	mu    sync.Mutex
	bytes map[uint64]int64 // GUARDED_BY(mu), by st_dev
}

// Of returns the piece size for files on f's device: the larger of its
// queue's read_ahead_kb and max_sectors_kb (what the kernel's
// force_page_cache_ra allows per call), DefaultPieceBytes when sysfs does
// not say (a network or FUSE filesystem, a partition without a queue).
func (p *Pieces) Of(f *os.File) int64 {
	var st unix.Stat_t
	if err := unix.Fstat(int(f.Fd()), &st); err != nil {
		return DefaultPieceBytes
	}
	p.mu.Lock()
	b, ok := p.bytes[st.Dev]
	p.mu.Unlock()
	if ok {
		return b
	}
	b = devicePiece(unix.Major(st.Dev), unix.Minor(st.Dev))
	p.mu.Lock()
	if p.bytes == nil {
		p.bytes = map[uint64]int64{}
	}
	p.bytes[st.Dev] = b
	p.mu.Unlock()
	return b
}

// devicePiece reads the queue limits of block device major:minor (or of
// the disk a partition is on).
func devicePiece(major, minor uint32) int64 {
	dir := fmt.Sprintf("/sys/dev/block/%d:%d", major, minor)
	for _, q := range []string{dir + "/queue", dir + "/../queue"} {
		ra, okRA := sysfsKiB(q + "/read_ahead_kb")
		ms, okMS := sysfsKiB(q + "/max_sectors_kb")
		if okRA || okMS {
			return min(maxPieceBytes, max(DefaultPieceBytes, ra, ms))
		}
	}
	return DefaultPieceBytes
}

// sysfsKiB reads a sysfs file holding a number of KiB, in bytes.
func sysfsKiB(path string) (int64, bool) {
	b, err := os.ReadFile(path)
	if err != nil {
		return 0, false
	}
	v, err := strconv.ParseInt(strings.TrimSpace(string(b)), 10, 64)
	if err != nil || v < 0 {
		return 0, false
	}
	return v << 10, true
}
