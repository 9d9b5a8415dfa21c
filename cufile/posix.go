package cufile

import (
	"context"
	"errors"
	"fmt"
	"os"
	"runtime"
	"sync"
	"syscall"

	"golang.org/x/sys/unix"

	"github.com/gdsfs/gdsfs/gpubuf"
	"github.com/gdsfs/gdsfs/internal/openflags"
	"github.com/gdsfs/gdsfs/internal/pagecache"
)

// stager is the CUDA side of the posix pipeline, behind an interface so the
// chunking, ordering and error handling can be tested without a GPU.
type stager interface {
	// bind makes device current on the calling goroutine's OS thread,
	// which the caller has locked.
	bind(device int) error
	// newLane allocates a worker's staging: slots pinned buffers of
	// bufBytes each, with one stream per slot.
	newLane(device, slots int, bufBytes int64) (lane, error)
}

// lane is one worker's staging. Copies are asynchronous: a slot's buffer may
// be reused only after sync(slot). Only its owning worker uses a lane.
type lane interface {
	buf(slot int) []byte
	h2d(slot int, dst gpubuf.Memory, dstOff int64, src []byte) error
	d2h(slot int, dst []byte, src gpubuf.Memory, srcOff int64) error
	sync(slot int) error
	close() error
}

// Options tunes the posix and host engines. The zero value is usable.
type Options struct {
	// ChunkBytes is the size of one pread / copy task. Default DefaultChunkBytes.
	ChunkBytes int64
	// Workers is the number of OS-thread workers per transfer, each with
	// its own staging buffers and streams. Default DefaultWorkers().
	Workers int
	// Slots is the number of staging buffers per worker (posix engine), so
	// a worker reads the next chunk while the previous one is copied.
	// Default 2.
	Slots int
	// Direct chooses O_DIRECT reads: "auto" (default: when less than half of
	// a range of at least 4 chunks is in the page cache and the file is
	// larger than DirectReadMinFile), "always" or "never".
	Direct string
	// DirectReadMinFile is the smallest file whose cold ranges "auto" reads
	// with O_DIRECT. A smaller file is read through the page cache even
	// when cold, so that reading it again is served from memory, as any
	// program's second read of a local file is (a checkpoint loaded by an
	// eval job after training, a restart); a larger one would push out more
	// of the cache than a second read gains. Default: a quarter of the
	// machine's memory (DefaultDirectReadMinFile); negative: any size.
	DirectReadMinFile int64
	// ColdTaskBytes is the task size of a buffered read of a range that
	// is mostly not in the page cache (see readTaskBytes). Default
	// DefaultColdTaskBytes; ChunkBytes or more turns the split off.
	ColdTaskBytes int64
	// ColdReadAheadBytes is how far ahead of its workers a buffered read of
	// a cold range, read in ColdTaskBytes tasks, asks the kernel to read
	// (coldAdvisor). Default (0): no advice: here WILLNEED halved both the
	// cold read and the warm re-read after it (docs/reliability-review.md);
	// negative: Workers x ChunkBytes, an O_DIRECT read's bytes in flight.
	ColdReadAheadBytes int64
	// ColdCrowd is how many cold split reads in flight on the engine (the
	// read itself included) make a cold read take tasks of its device's
	// largest request and stop every read's advice (coldReads.shape,
	// coldReads.crowded). 0 or less (the default): never.
	ColdCrowd int

	// cold is what the engine's cold split reads share (coldReads.shape):
	// made by withDefaults, shared by the copies of the options it returns.
	cold *coldReads
}

// posixEngine reads with parallel chunked preads into pinned host staging and
// copies to the GPU asynchronously on several streams, overlapping reads and
// copies; writes go the reverse way.
type posixEngine struct {
	st   stager
	opts Options

	mu    sync.Mutex
	lanes map[int]*lanePool // by device
}

// lanePool bounds the pinned memory of a device: at most Workers lanes exist,
// shared by all concurrent transfers.
type lanePool struct {
	// free holds idle lanes and nil tokens: a nil is room for one lane
	// whose predecessor broke (or whose allocation failed), so a transfer
	// waiting for a lane wakes on a failure as well as on a release.
	free    chan lane
	mu      sync.Mutex
	created int
	max     int
}

// withDefaults fills in the zero fields.
func (opts Options) withDefaults() Options {
	if opts.ChunkBytes <= 0 {
		opts.ChunkBytes = DefaultChunkBytes
	}
	opts.ChunkBytes = (opts.ChunkBytes + gpubuf.Align - 1) &^ (gpubuf.Align - 1)
	if opts.Workers <= 0 {
		opts.Workers = DefaultWorkers()
	}
	if opts.Slots <= 0 {
		opts.Slots = 2
	}
	if opts.Direct == "" {
		opts.Direct = "auto"
	}
	if opts.ColdTaskBytes <= 0 {
		opts.ColdTaskBytes = DefaultColdTaskBytes
	}
	opts.ColdTaskBytes = min(opts.ChunkBytes, gpubuf.AlignUp(opts.ColdTaskBytes))
	if opts.DirectReadMinFile == 0 {
		opts.DirectReadMinFile = DefaultDirectReadMinFile()
	}
	if opts.cold == nil {
		opts.cold = newColdReads()
	}
	return opts
}

// DefaultDirectReadMinFile is Options.DirectReadMinFile's default: a
// quarter of the machine's memory (1 GiB where sysinfo fails).
func DefaultDirectReadMinFile() int64 {
	var si unix.Sysinfo_t
	if err := unix.Sysinfo(&si); err != nil || si.Totalram == 0 {
		return 1 << 30
	}
	return int64(si.Totalram) * int64(max(si.Unit, 1)) / 4
}

func newPosixEngine(st stager, opts Options) *posixEngine {
	opts = opts.withDefaults()
	return &posixEngine{st: st, opts: opts, lanes: map[int]*lanePool{}}
}

func (e *posixEngine) Name() string { return EnginePosix }

// bufBytes leaves room to widen a chunk to 4 KiB alignment at both ends for
// O_DIRECT.
func (e *posixEngine) bufBytes() int64 { return e.opts.ChunkBytes + 2*gpubuf.Align }

func (e *posixEngine) pool(device int) *lanePool {
	e.mu.Lock()
	defer e.mu.Unlock()
	p := e.lanes[device]
	if p == nil {
		p = &lanePool{free: make(chan lane, e.opts.Workers), max: e.opts.Workers}
		e.lanes[device] = p
	}
	return p
}

// acquire returns an idle lane of device, creating one while under the
// limit, else waiting for one (bounded by ctx).
func (e *posixEngine) acquire(ctx context.Context, device int) (lane, error) {
	p := e.pool(device)
	select {
	case l := <-p.free:
		return e.lane(p, device, l)
	default:
	}
	p.mu.Lock()
	if p.created < p.max {
		p.created++
		p.mu.Unlock()
		return e.lane(p, device, nil)
	}
	p.mu.Unlock()
	select {
	case l := <-p.free:
		return e.lane(p, device, l)
	case <-ctx.Done():
		return nil, ctx.Err()
	}
}

// lane returns l, or a new lane of device when l is nil (room for one in
// p). A failed allocation puts the room back as a token, never blocking:
// free holds at most one entry per lane counted in p.created.
func (e *posixEngine) lane(p *lanePool, device int, l lane) (lane, error) {
	if l != nil {
		return l, nil
	}
	l, err := e.st.newLane(device, e.opts.Slots, e.bufBytes())
	if err != nil {
		p.free <- nil
		return nil, fmt.Errorf("allocate pinned staging: %w", err)
	}
	return l, nil
}

func (e *posixEngine) release(device int, l lane) { e.pool(device).free <- l }

// Close frees every idle lane's pinned memory. Transfers must have ended.
func (e *posixEngine) Close() error {
	e.mu.Lock()
	defer e.mu.Unlock()
	var errs []error
	for _, p := range e.lanes {
		for {
			select {
			case l := <-p.free:
				if l != nil {
					errs = append(errs, l.close())
				}
				continue
			default:
			}
			break
		}
	}
	e.lanes = map[int]*lanePool{}
	return errors.Join(errs...)
}

func deviceOf(m gpubuf.Memory) int {
	if dm, ok := m.(gpubuf.DeviceMemory); ok {
		return dm.Device()
	}
	return 0
}

// useDirect decides whether a read of [off, off+n) of f, a file of size
// bytes, goes around the page cache: cold data of a file too large to keep
// cached reads faster with O_DIRECT (no copy through the cache, no
// readahead limits), cached data faster buffered, and a file the cache can
// hold is read through it so that its next read is warm
// (Options.DirectReadMinFile). readsBuffered is the rule for what is never
// read direct; the rest is read direct when mostly not cached.
func (opts Options) useDirect(f *os.File, off, n, size int64) bool {
	if opts.Direct == "always" {
		return true
	}
	if opts.readsBuffered(n, size) {
		return false
	}
	cached, ok := pagecache.Cached(f, off, n)
	return ok && cached < n/2
}

// openDirect reopens f with O_DIRECT for reading; nil when f is not open
// for reading or the filesystem refuses. The reopen keeps f's own access
// mode (O_RDONLY or O_RDWR): the daemon, root, must never hold a file with
// more rights than the caller's descriptor grants, and a write-only
// descriptor gets no readable twin.
func openDirect(f *os.File) *os.File {
	mode, err := accessMode(f)
	if err != nil || mode == unix.O_WRONLY {
		return nil
	}
	d, err := openflags.Reopen(f, mode|syscall.O_DIRECT)
	if err != nil {
		return nil
	}
	return d
}

// accessMode returns f's O_ACCMODE bits (O_RDONLY, O_WRONLY or O_RDWR).
func accessMode(f *os.File) (int, error) { return openflags.AccessMode(f) }

func (e *posixEngine) ReadAt(ctx context.Context, f *os.File, dst gpubuf.Memory, dstOff, fileOff, n int64) (int64, error) {
	if err := checkRange(dst, dstOff, fileOff, n); err != nil {
		return 0, err
	}
	n, size, err := clampToEOF(f, fileOff, n)
	if err != nil || n == 0 {
		return 0, err
	}
	var direct *os.File
	if e.opts.useDirect(f, fileOff, n, size) {
		direct = openDirect(f)
	}
	if direct != nil {
		defer direct.Close()
	}
	device := deviceOf(dst)
	task, done := e.opts.cold.shape(e.opts, f, n, e.opts.readTaskBytes(f, fileOff, n, direct != nil))
	defer done()
	adv := e.opts.coldAdvice(f, direct != nil, fileOff, n, task)
	defer adv.stop()
	got, err := runChunks(ctx, n, task, e.opts.Workers, func(ctx context.Context) (worker, error) {
		return e.startWorker(ctx, device, func(l lane, slot int, c chunk) (int64, error) {
			b := l.buf(slot)
			src, m, err := readChunk(f, direct, b, fileOff+c.off, c.n)
			adv.taskDone()
			if err != nil {
				return m, err
			}
			return m, l.h2d(slot, dst, dstOff+c.off, src)
		})
	})
	if err != nil {
		return 0, fmt.Errorf("posix read %q: %w", f.Name(), err)
	}
	return got, nil
}

// readChunk reads n bytes at off into b and returns the slice of b holding
// them (shorter at end of file). With direct, it reads the 4 KiB-aligned
// superset through O_DIRECT and returns the requested part of it; a
// filesystem refusing O_DIRECT for this I/O gets a buffered read instead.
func readChunk(f, direct *os.File, b []byte, off, n int64) ([]byte, int64, error) {
	if direct != nil {
		start := off &^ (gpubuf.Align - 1)
		skip := off - start
		span := (skip + n + gpubuf.Align - 1) &^ (gpubuf.Align - 1)
		m, err := preadFull(direct, b[:span], start)
		if err == nil {
			got := max(0, min(m-skip, n))
			return b[skip : skip+got], got, nil
		}
		if !errors.Is(err, syscall.EINVAL) {
			return nil, 0, err
		}
	}
	m, err := preadFull(f, b[:n], off)
	return b[:m], m, err
}

// WriteAt writes the 4 KiB-aligned body of the range through an O_DIRECT
// twin of f when Options.Direct allows (directwrite.go), its unaligned head
// and tail buffered; each worker copies its next chunk to the host while it
// writes the previous one.
func (e *posixEngine) WriteAt(ctx context.Context, f *os.File, src gpubuf.Memory, srcOff, fileOff, n int64) (int64, error) {
	if err := checkRange(src, srcOff, fileOff, n); err != nil {
		return 0, err
	}
	err := writeParts(f, fileOff, n, func(_, body int64) bool { return e.opts.directWrite(body) },
		func(direct *os.File, off, n int64) error {
			return e.writeChunks(ctx, f, direct, src, srcOff+off, fileOff+off, n)
		})
	if err != nil {
		return 0, fmt.Errorf("posix write %q: %w", f.Name(), err)
	}
	return n, nil
}

// writeChunks writes n bytes of src at srcOff to fileOff in chunks, through
// direct when it is not nil (then fileOff and n are 4 KiB-aligned). With two
// or more slots a worker queues the copy of chunk k to the host before it
// writes chunk k-1, so the copy runs during the write.
func (e *posixEngine) writeChunks(ctx context.Context, f, direct *os.File, src gpubuf.Memory, srcOff, fileOff, n int64) error {
	type queued struct {
		slot int
		c    chunk
	}
	device := deviceOf(src)
	pipelined := e.opts.Slots > 1
	_, err := runChunks(ctx, n, e.opts.ChunkBytes, e.opts.Workers, func(ctx context.Context) (worker, error) {
		var prev *queued // the chunk whose copy is queued, not yet written (this worker's)
		write := func(l lane, q *queued) error {
			if err := l.sync(q.slot); err != nil {
				return err
			}
			return writePiece(f, direct, l.buf(q.slot)[:q.c.n], fileOff+q.c.off)
		}
		flush := func(l lane) error {
			q := prev
			prev = nil
			if q == nil {
				return nil
			}
			return write(l, q)
		}
		w, err := e.startWorker(ctx, device, func(l lane, slot int, c chunk) (int64, error) {
			if err := l.d2h(slot, l.buf(slot)[:c.n], src, srcOff+c.off); err != nil {
				return 0, err
			}
			if !pipelined {
				return c.n, write(l, &queued{slot, c})
			}
			// The slot's previous chunk was written before this one was
			// queued: slots alternate, and each chunk is written by the
			// next call or by finish.
			if err := flush(l); err != nil {
				return 0, err
			}
			prev = &queued{slot, c}
			return c.n, nil
		})
		if err != nil {
			return nil, err
		}
		w.(*pipeWorker).flush = flush
		return w, nil
	})
	return err
}

// pipeWorker runs on a locked OS thread with the device current, cycling its
// lane's slots so reading chunk k+1 overlaps the copy of chunk k.
type pipeWorker struct {
	e       *posixEngine
	device  int
	l       lane
	step    func(l lane, slot int, c chunk) (int64, error)
	k       int
	pending []bool
	// flush, when set, completes work step left queued (a write's last
	// chunk); finish calls it first.
	flush func(l lane) error
}

func (e *posixEngine) startWorker(ctx context.Context, device int, step func(l lane, slot int, c chunk) (int64, error)) (worker, error) {
	runtime.LockOSThread()
	if err := e.st.bind(device); err != nil {
		runtime.UnlockOSThread()
		return nil, err
	}
	l, err := e.acquire(ctx, device)
	if err != nil {
		runtime.UnlockOSThread()
		return nil, err
	}
	return &pipeWorker{e: e, device: device, l: l, step: step, pending: make([]bool, e.opts.Slots)}, nil
}

func (w *pipeWorker) do(c chunk) (int64, error) {
	slot := w.k % len(w.pending)
	w.k++
	if w.pending[slot] {
		w.pending[slot] = false
		if err := w.l.sync(slot); err != nil {
			return 0, err
		}
	}
	w.pending[slot] = true
	return w.step(w.l, slot, c)
}

func (w *pipeWorker) finish() error {
	defer runtime.UnlockOSThread()
	var flushErr error
	if w.flush != nil {
		flushErr = w.flush(w.l)
	}
	var errs []error
	for slot, p := range w.pending {
		if p {
			errs = append(errs, w.l.sync(slot))
		}
	}
	err := errors.Join(errs...)
	if err != nil {
		// A lane whose stream failed is not trusted again. Its room goes
		// back as a token, which also wakes a transfer waiting in acquire
		// (lowering p.created instead left it waiting for a release that
		// would never come once every lane had failed).
		errs = append(errs, w.l.close(), flushErr)
		w.e.pool(w.device).free <- nil
		return errors.Join(errs...)
	}
	w.e.release(w.device, w.l)
	return flushErr
}
