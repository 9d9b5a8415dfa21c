package cufile

import (
	"context"
	"errors"
	"fmt"
	"os"
	"syscall"
	"unsafe"

	"github.com/gdsfs/gdsfs/gpubuf"
)

// hostEngine serves hosts without a GPU: slabs are shared host memory and
// reads are parallel preads straight into them (no staging, no copies),
// through O_DIRECT for cold ranges whose pieces are 4 KiB-aligned in file
// and memory (slab memory is page-aligned, and callers widen ranges), in
// smaller tasks for other cold ranges (readTaskBytes).
type hostEngine struct {
	opts Options
}

// NewHostEngine returns the host engine (opts.Slots is unused).
func NewHostEngine(opts Options) Engine {
	return &hostEngine{opts: opts.withDefaults()}
}

func (e *hostEngine) Name() string { return EngineHost }

func hostBytes(m gpubuf.Memory) ([]byte, error) {
	hm, ok := m.(gpubuf.HostMemory)
	if !ok {
		return nil, fmt.Errorf("cufile: host engine needs host memory, got %T", m)
	}
	return hm.HostBytes(), nil
}

func (e *hostEngine) ReadAt(ctx context.Context, f *os.File, dst gpubuf.Memory, dstOff, fileOff, n int64) (int64, error) {
	if err := checkRange(dst, dstOff, fileOff, n); err != nil {
		return 0, err
	}
	b, err := hostBytes(dst)
	if err != nil {
		return 0, err
	}
	var size int64
	if n, size, err = clampToEOF(f, fileOff, n); err != nil || n == 0 {
		return 0, err
	}
	var direct *os.File
	if e.opts.useDirect(f, fileOff, n, size) && (fileOff-dstOff)%gpubuf.Align == 0 {
		direct = openDirect(f)
	}
	if direct != nil {
		defer direct.Close()
	}
	task, done := e.opts.cold.shape(e.opts, f, n, e.opts.readTaskBytes(f, fileOff, n, direct != nil))
	defer done()
	adv := e.opts.coldAdvice(f, direct != nil, fileOff, n, task)
	defer adv.stop()
	w := funcWorker{doFn: func(c chunk) (int64, error) {
		defer adv.taskDone()
		return readHostChunk(f, direct, b[dstOff+c.off:dstOff+c.off+c.n], fileOff+c.off)
	}}
	got, err := runChunks(ctx, n, task, e.opts.Workers, func(context.Context) (worker, error) { return w, nil })
	if err != nil {
		return 0, fmt.Errorf("host read %q: %w", f.Name(), err)
	}
	return got, nil
}

// WriteAt writes straight from the slab: the 4 KiB-aligned body through an
// O_DIRECT twin of f when Options.Direct allows and the memory lines up
// with the file (slab memory is page-aligned, so a lease written at an
// aligned file offset does), the unaligned head and tail buffered.
func (e *hostEngine) WriteAt(ctx context.Context, f *os.File, src gpubuf.Memory, srcOff, fileOff, n int64) (int64, error) {
	if err := checkRange(src, srcOff, fileOff, n); err != nil {
		return 0, err
	}
	b, err := hostBytes(src)
	if err != nil {
		return 0, err
	}
	err = writeParts(f, fileOff, n, func(head, body int64) bool {
		return e.opts.directWrite(body) && isAligned(b[srcOff+head:srcOff+head+body])
	}, func(direct *os.File, off, n int64) error {
		from, to := b[srcOff+off:srcOff+off+n], fileOff+off
		w := funcWorker{doFn: func(c chunk) (int64, error) {
			return c.n, writePiece(f, direct, from[c.off:c.off+c.n], to+c.off)
		}}
		_, err := runChunks(ctx, n, e.opts.ChunkBytes, e.opts.Workers, func(context.Context) (worker, error) { return w, nil })
		return err
	})
	if err != nil {
		return 0, fmt.Errorf("host write %q: %w", f.Name(), err)
	}
	return n, nil
}

// readHostChunk reads len(b) bytes at off into b: the 4 KiB-aligned middle
// through direct (when not nil and the memory is aligned), the unaligned
// edges buffered. A filesystem refusing O_DIRECT gets buffered reads.
func readHostChunk(f, direct *os.File, b []byte, off int64) (int64, error) {
	if direct == nil || len(b) == 0 || uintptr(unsafe.Pointer(&b[0]))%gpubuf.Align != 0 || off%gpubuf.Align != 0 {
		return preadFull(f, b, off)
	}
	body := int64(len(b)) &^ (gpubuf.Align - 1)
	m, err := preadFull(direct, b[:body], off)
	if errors.Is(err, syscall.EINVAL) {
		return preadFull(f, b, off)
	}
	if err != nil || m < body {
		return m, err
	}
	t, err := preadFull(f, b[body:], off+body)
	return m + t, err
}
