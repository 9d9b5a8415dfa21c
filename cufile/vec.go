package cufile

import (
	"context"
	"errors"
	"fmt"
	"os"

	"github.com/gdsfs/gdsfs/gpubuf"
)

// Segment is one piece of a vectored read: N bytes of the file at FileOff
// into Dst at DstOff.
type Segment struct {
	Dst                gpubuf.Memory
	DstOff, FileOff, N int64
}

// VecReader is implemented by engines that read many small ranges of one
// file faster together than with one ReadAt each. A READ of a batch of
// small samples (issue 15) is 16 to 256 ranges of 16-256 KiB: the posix
// engine then spends a goroutine, a staging lane, a context bind and a
// stream sync per range; ReadVec packs the ranges into one lane's staging
// buffers and syncs once per buffer filled.
type VecReader interface {
	// ReadVec reads every segment and returns the bytes read of each,
	// fewer than N only when the file ends first. When it returns
	// without error, the bytes are in place. All segments' memory is on
	// one device.
	ReadVec(ctx context.Context, f *os.File, segs []Segment) ([]int64, error)
}

// ReadVec implements VecReader: segments of at most one chunk go through
// one lane in order, packed into its staging buffers (a buffer's copies
// run while the next buffer fills; a buffer is reused only after its
// stream is synced); larger ones, and cold ones larger than a cold task
// (readTaskBytes), through ReadAt, which parallelises within them. Buffered reads only: small ranges are never O_DIRECT (see
// useDirect).
func (e *posixEngine) ReadVec(ctx context.Context, f *os.File, segs []Segment) ([]int64, error) {
	got := make([]int64, len(segs))
	if len(segs) == 0 {
		return got, nil
	}
	device := deviceOf(segs[0].Dst)
	var small []int
	packed := make([]bool, len(segs))
	for i, s := range segs {
		if err := checkRange(s.Dst, s.DstOff, s.FileOff, s.N); err != nil {
			return nil, err
		}
		if d := deviceOf(s.Dst); d != device {
			return nil, fmt.Errorf("cufile: vectored read into devices %d and %d: one device per call", device, d)
		}
		// A cold segment larger than a cold task goes through ReadAt,
		// in parallel cold tasks (readTaskBytes), not one pread.
		if s.N <= e.opts.ChunkBytes && e.opts.Direct != "always" && e.opts.readTaskBytes(f, s.FileOff, s.N, false) == e.opts.ChunkBytes {
			small = append(small, i)
			packed[i] = true
		}
	}
	if len(small) > 0 {
		if err := e.readPacked(ctx, f, segs, small, got, device); err != nil {
			return nil, fmt.Errorf("posix read %q: %w", f.Name(), err)
		}
	}
	for i, s := range segs {
		if !packed[i] {
			n, err := e.ReadAt(ctx, f, s.Dst, s.DstOff, s.FileOff, s.N)
			if err != nil {
				return nil, err
			}
			got[i] = n
		}
	}
	return got, nil
}

// readPacked reads segs[idx...] (each at most one chunk) through one lane.
func (e *posixEngine) readPacked(ctx context.Context, f *os.File, segs []Segment, idx []int, got []int64, device int) (err error) {
	w, err := e.startWorker(ctx, device, nil)
	if err != nil {
		return err
	}
	pw := w.(*pipeWorker)
	defer func() {
		// Every queued copy finishes before the staging goes back (or
		// the lane is dropped, when its stream failed).
		err = errors.Join(err, pw.finish())
	}()
	l := pw.l
	slot, used := 0, int64(0)
	for _, i := range idx {
		if err := ctx.Err(); err != nil {
			return err
		}
		s := segs[i]
		n, _, err := clampToEOF(f, s.FileOff, s.N)
		if err != nil {
			return err
		}
		if n == 0 {
			continue
		}
		b := l.buf(slot)
		if used+n > int64(len(b)) {
			// This buffer is full: go on in the next one, once the
			// copies out of it are done.
			slot, used = (slot+1)%len(pw.pending), 0
			if pw.pending[slot] {
				pw.pending[slot] = false
				if err := l.sync(slot); err != nil {
					return err
				}
			}
			b = l.buf(slot)
		}
		src, m, err := readChunk(f, nil, b[used:], s.FileOff, n)
		if err != nil {
			return err
		}
		if err := l.h2d(slot, s.Dst, s.DstOff, src); err != nil {
			return err
		}
		pw.pending[slot] = true
		got[i] = m
		used = gpubuf.AlignUp(used + n)
	}
	return nil
}
