package pagecache

import (
	"context"
	"errors"
	"fmt"
	"io"
	"os"
	"sync"

	"github.com/gdsfs/gdsfs/internal/openflags"
	"golang.org/x/sys/unix"
)

// fillBufBytes is the size of one read of Fill: large enough that the
// kernel reads ahead at the device's largest request size, small enough
// to keep the scratch memory of many fills small.
const fillBufBytes = 2 << 20

// Fills reads file ranges into the page cache, discarding the bytes: what
// the control path's readahead does (package internal/readahead). The
// zero value is ready; safe for concurrent use.
type Fills struct {
	bufs sync.Pool // *[]byte of fillBufBytes
}

// Fill reads [off, off+n) of f and drops the bytes, so that the range is
// in the page cache when it is read next. It reads through a new open of
// f's file (/proc/self/fd, read-only, so never more than f grants), whose
// own readahead state sees one sequential stream: the kernel reads it
// ahead at its own pace and in large folios. (posix_fadvise(WILLNEED)
// would queue all of it at once, but as single pages, which every later
// read copies at about half the speed.) It blocks until the bytes are
// read (or ctx is done, checked between reads); short at end of file. f
// closed before is an error; f's offset is not moved.
func (fl *Fills) Fill(ctx context.Context, f *os.File, off, n int64) (int64, error) {
	if n <= 0 {
		return 0, nil
	}
	r, err := reopen(f)
	if err != nil {
		return 0, fmt.Errorf("pagecache: fill %q: %w", f.Name(), err)
	}
	defer r.Close()
	// The kernel doubles the stream's readahead window for a file
	// declared sequential; an error only leaves it at its default.
	_ = unix.Fadvise(int(r.Fd()), off, n, unix.FADV_SEQUENTIAL)
	bp, _ := fl.bufs.Get().(*[]byte)
	if bp == nil {
		b := make([]byte, fillBufBytes)
		bp = &b
	}
	defer fl.bufs.Put(bp)
	var got int64
	for got < n {
		if err := ctx.Err(); err != nil {
			return got, err
		}
		k, err := r.ReadAt((*bp)[:min(int64(len(*bp)), n-got)], off+got)
		got += int64(k)
		if errors.Is(err, io.EOF) {
			break
		}
		if err != nil {
			return got, fmt.Errorf("pagecache: fill %q: %w", f.Name(), err)
		}
	}
	return got, nil
}

// reopen opens f's file again for reading (never more than f grants),
// without updating its access time where the daemon may skip that.
func reopen(f *os.File) (*os.File, error) {
	r, err := openflags.Reopen(f, os.O_RDONLY|unix.O_NOATIME)
	if errors.Is(err, unix.EPERM) { // O_NOATIME on a file the daemon does not own
		r, err = openflags.Reopen(f, os.O_RDONLY)
	}
	return r, err
}
