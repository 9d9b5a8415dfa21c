package cufile

import (
	"context"
	"errors"
	"fmt"
	"io"
	"os"
	"runtime"
	"sync"
	"sync/atomic"

	"github.com/gdsfs/gdsfs/gpubuf"
	"github.com/gdsfs/gdsfs/internal/pagecache"
)

// Engine moves bytes between a backing file and slab memory. Implementations
// are safe for concurrent use; each call splits its range into chunks and
// moves them in parallel. Callers pass ranges widened to gpubuf.Align (the
// engines accept any range, but aligned ones are the fast ones).
type Engine interface {
	// Name is "host", "posix", "gds" or "gds-compat" (docs/protocol.md engine names).
	Name() string
	// ReadAt reads n bytes of f at fileOff into dst at dstOff and returns
	// the bytes read, which is less than n only when the file ends first.
	// When it returns, the bytes are in place in dst.
	ReadAt(ctx context.Context, f *os.File, dst gpubuf.Memory, dstOff, fileOff, n int64) (int64, error)
	// WriteAt writes n bytes of src at srcOff to f at fileOff. f must be
	// open for writing. Durability is the caller's fsync.
	WriteAt(ctx context.Context, f *os.File, src gpubuf.Memory, srcOff, fileOff, n int64) (int64, error)
}

// DefaultChunkBytes is the transfer task size when none is configured.
const DefaultChunkBytes = 8 << 20

// DefaultColdTaskBytes is the task size of a buffered read of a range not
// in the page cache. A cold buffered pread waits for all of its bytes with
// no readahead running ahead of it, so one large pread per task leaves the
// disk idle between tasks: measured on this project's test machine
// (BenchmarkHostReadShape, docs/benchmarks.md "Cold: one READ's range in
// 1 MiB tasks"), cold 4 MiB ranges read at 1.6 GB/s in one task and 3.1
// GB/s in four of 1 MiB, against 2.9 GB/s for the disk's sequential read.
const DefaultColdTaskBytes = 1 << 20

// DefaultWorkers is the number of parallel workers per transfer when none is
// configured: one per CPU, at least 4 (I/O waits leave CPUs idle) and at most
// 16 (more only adds contention on the measured machines).
func DefaultWorkers() int { return min(16, max(4, runtime.NumCPU())) }

// ErrRange reports a transfer range outside its memory or file.
var ErrRange = errors.New("cufile: range out of bounds")

// checkRange validates a transfer of n bytes at memOff in mem and fileOff in
// the file: shared by every engine so they agree on what is legal.
func checkRange(mem gpubuf.Memory, memOff, fileOff, n int64) error {
	if mem == nil {
		return fmt.Errorf("%w: no memory", ErrRange)
	}
	if memOff < 0 || fileOff < 0 || n < 0 || memOff > mem.Size() || n > mem.Size()-memOff {
		return fmt.Errorf("%w: %d bytes at memory offset %d (memory is %d bytes), file offset %d", ErrRange, n, memOff, mem.Size(), fileOff)
	}
	if fileOff > (1<<63-1)-n {
		return fmt.Errorf("%w: file offset %d + %d overflows", ErrRange, fileOff, n)
	}
	return nil
}

// Residency probe of readTaskBytes: at most coldProbes windows of
// coldProbeBytes, at the range's two ends, so the probe costs about a
// microsecond whatever the range's size (BenchmarkReadTaskBytes: 0.9 us,
// 0.5% of a warm 4 MiB read here).
const (
	coldProbes     = 2
	coldProbeBytes = 16 << 10
)

// readTaskBytes returns the task size of a read of [off, off+n) of f:
// about opts.ColdTaskBytes (n split evenly into n/ColdTaskBytes tasks, so
// no task is a sliver) when the range holds at least two cold tasks, is
// read buffered (direct false) and is mostly not in the page cache, else
// opts.ChunkBytes. opts has its defaults. A range in the page cache keeps
// large tasks (each task costs a worker hand-off, measurable on warm
// reads of 16 MiB); an O_DIRECT read has no readahead to lose; a kernel
// that cannot tell residency gets the large tasks, as before the split.
func (opts Options) readTaskBytes(f *os.File, off, n int64, direct bool) int64 {
	cold := opts.ColdTaskBytes
	if direct || n < 2*cold || cold >= opts.ChunkBytes {
		return opts.ChunkBytes
	}
	if cached, ok := sampleCached(f, off, n); cached || !ok {
		return opts.ChunkBytes
	}
	count := n / cold
	return min(opts.ChunkBytes, gpubuf.AlignUp((n+count-1)/count))
}

// sampleCached reports whether at least half of a sample of [off, off+n)
// of f is in the page cache; ok is false when the kernel cannot tell.
func sampleCached(f *os.File, off, n int64) (cached, ok bool) {
	w := min(n, coldProbeBytes)
	count := int64(coldProbes)
	if n <= count*w {
		count = (n + w - 1) / w
	}
	var measured, resident int64
	for i := range count {
		at := off
		if count > 1 {
			at = off + i*((n-w)/(count-1))
		}
		m := min(w, off+n-at)
		c, ok := pagecache.Cached(f, at, m)
		if !ok {
			return false, false
		}
		measured += m
		resident += min(c, m) // cachestat counts whole pages
	}
	return resident >= measured/2, true
}

// chunk is one piece of a transfer: n bytes at off from the start of the
// transfer (the same offset into the file range and the memory range).
type chunk struct {
	index  int
	off, n int64
}

// worker moves chunks; it reports the bytes moved, short only at end of file.
type worker interface {
	do(c chunk) (int64, error)
	// finish waits for the worker's outstanding work (asynchronous copies)
	// and releases what start acquired.
	finish() error
}

// runChunks splits n bytes into chunkBytes pieces and moves them with up to
// workers goroutines, each built by start on its own goroutine (so start may
// lock the OS thread). It returns the length of the prefix of the range that
// was moved completely: chunks after the first short one (end of file) do not
// count. The first error stops the remaining chunks.
func runChunks(ctx context.Context, n, chunkBytes int64, workers int, start func(ctx context.Context) (worker, error)) (int64, error) {
	if n == 0 {
		return 0, ctx.Err()
	}
	r := newChunkRun(ctx, n, chunkBytes)
	var wg sync.WaitGroup
	for range r.workers(workers) {
		wg.Go(func() {
			w, err := start(ctx)
			if err != nil {
				r.fail(err)
				return
			}
			r.work(w)
		})
	}
	wg.Wait()
	return r.result()
}

// chunkRun is one transfer's chunks, handed out to its workers in order:
// runChunks's goroutines or the gds engine's pool threads (threadpool.go)
// call work, then result once every work call has returned.
type chunkRun struct {
	ctx        context.Context
	n          int64
	chunkBytes int64
	count      int
	got        []int64 // by chunk index; written by the worker that moved it
	next       atomic.Int64
	stop       atomic.Bool
	errOnce    sync.Once
	firstErr   error // set once, read by result after the workers
}

// newChunkRun splits n > 0 bytes into chunkBytes pieces (DefaultChunkBytes
// when chunkBytes <= 0).
func newChunkRun(ctx context.Context, n, chunkBytes int64) *chunkRun {
	if chunkBytes <= 0 {
		chunkBytes = DefaultChunkBytes
	}
	count := int((n + chunkBytes - 1) / chunkBytes)
	return &chunkRun{ctx: ctx, n: n, chunkBytes: chunkBytes, count: count, got: make([]int64, count)}
}

// workers returns how many workers the run uses of at most limit: no more
// than one per chunk, at least one.
func (r *chunkRun) workers(limit int) int { return max(1, min(limit, r.count)) }

// fail records err as the run's error unless one was, and stops the
// chunks not yet handed out.
func (r *chunkRun) fail(err error) {
	r.errOnce.Do(func() { r.firstErr = err })
	r.stop.Store(true)
}

// work moves chunks with w until none are left, the run failed or its
// context ended, then finishes w.
func (r *chunkRun) work(w worker) {
	for r.next1(w) {
	}
	if err := w.finish(); err != nil {
		r.fail(err)
	}
}

// step moves at most one chunk with w (the gds pool's ticket), then
// finishes w.
func (r *chunkRun) step(w worker) {
	r.next1(w)
	if err := w.finish(); err != nil {
		r.fail(err)
	}
}

// pending reports whether chunks are left to hand out: the run has not
// failed and not every chunk was taken.
func (r *chunkRun) pending() bool { return !r.stop.Load() && r.next.Load() < int64(r.count) }

// next1 moves the next chunk with w unless none is left, the run failed or
// its context ended, and reports whether it moved one without error.
func (r *chunkRun) next1(w worker) bool {
	if r.stop.Load() {
		return false
	}
	if err := r.ctx.Err(); err != nil {
		r.fail(err)
		return false
	}
	i := int(r.next.Add(1) - 1)
	if i >= r.count {
		return false
	}
	c := chunk{index: i, off: int64(i) * r.chunkBytes}
	c.n = min(r.chunkBytes, r.n-c.off)
	m, err := w.do(c)
	r.got[i] = m
	if err != nil {
		r.fail(fmt.Errorf("chunk at +%d: %w", c.off, err))
		return false
	}
	return true
}

// result is the run's first error, else the length of its complete prefix.
func (r *chunkRun) result() (int64, error) {
	if r.firstErr != nil {
		return 0, r.firstErr
	}
	var total int64
	for i, m := range r.got {
		total += m
		if m < min(r.chunkBytes, r.n-int64(i)*r.chunkBytes) {
			break
		}
	}
	return total, nil
}

// clampToEOF shortens a read of n bytes at off to what the file holds now,
// so no engine asks for bytes past end of file: cuFile (compat mode) fills
// the destination up to the size asked for even when the file ends first,
// with bytes that are not the file's. It also returns the file's size (0
// for what is not a regular file), which useDirect weighs.
func clampToEOF(f *os.File, off, n int64) (int64, int64, error) {
	st, err := f.Stat()
	if err != nil {
		return 0, 0, fmt.Errorf("stat %q: %w", f.Name(), err)
	}
	if !st.Mode().IsRegular() {
		return n, 0, nil
	}
	return max(0, min(n, st.Size()-off)), st.Size(), nil
}

// preadFull reads len(b) bytes at off, stopping early only at end of file.
func preadFull(f *os.File, b []byte, off int64) (int64, error) {
	var done int64
	for done < int64(len(b)) {
		m, err := f.ReadAt(b[done:], off+done)
		done += int64(m)
		if err == io.EOF {
			return done, nil
		}
		if err != nil {
			return done, err
		}
	}
	return done, nil
}

// pwriteFull writes all of b at off.
func pwriteFull(f *os.File, b []byte, off int64) error {
	_, err := f.WriteAt(b, off)
	return err
}

// funcWorker adapts plain functions to worker.
type funcWorker struct {
	doFn     func(c chunk) (int64, error)
	finishFn func() error
}

func (w funcWorker) do(c chunk) (int64, error) { return w.doFn(c) }
func (w funcWorker) finish() error {
	if w.finishFn == nil {
		return nil
	}
	return w.finishFn()
}
