package cufile

import (
	"context"
	"fmt"
	"os"

	"github.com/gdsfs/gdsfs/gpubuf"
)

// hostEngine serves hosts without a GPU: slabs are shared host memory and
// reads are parallel preads straight into them (no staging, no copies).
type hostEngine struct {
	chunkBytes int64
	workers    int
}

// NewHostEngine returns the host engine. chunkBytes and workers of 0 take the
// defaults.
func NewHostEngine(chunkBytes int64, workers int) Engine {
	if chunkBytes <= 0 {
		chunkBytes = DefaultChunkBytes
	}
	if workers <= 0 {
		workers = DefaultWorkers()
	}
	return &hostEngine{chunkBytes: chunkBytes, workers: workers}
}

func (e *hostEngine) Name() string { return "host" }

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
	w := funcWorker{doFn: func(c chunk) (int64, error) {
		return preadFull(f, b[dstOff+c.off:dstOff+c.off+c.n], fileOff+c.off)
	}}
	got, err := runChunks(ctx, n, e.chunkBytes, e.workers, func(context.Context) (worker, error) { return w, nil })
	if err != nil {
		return 0, fmt.Errorf("host read %q: %w", f.Name(), err)
	}
	return got, nil
}

func (e *hostEngine) WriteAt(ctx context.Context, f *os.File, src gpubuf.Memory, srcOff, fileOff, n int64) (int64, error) {
	if err := checkRange(src, srcOff, fileOff, n); err != nil {
		return 0, err
	}
	b, err := hostBytes(src)
	if err != nil {
		return 0, err
	}
	w := funcWorker{doFn: func(c chunk) (int64, error) {
		return c.n, pwriteFull(f, b[srcOff+c.off:srcOff+c.off+c.n], fileOff+c.off)
	}}
	got, err := runChunks(ctx, n, e.chunkBytes, e.workers, func(context.Context) (worker, error) { return w, nil })
	if err != nil {
		return 0, fmt.Errorf("host write %q: %w", f.Name(), err)
	}
	return got, nil
}
