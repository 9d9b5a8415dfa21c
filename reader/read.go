package reader

import (
	"context"
	"errors"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	"github.com/dustin/go-humanize"

	"github.com/gdsfs/gdsfs/ctl"
	"github.com/gdsfs/gdsfs/gpubuf"
	"github.com/gdsfs/gdsfs/internal/mountinfo"
	"github.com/gdsfs/gdsfs/internal/usage"
)

// readChunkBytes is the size of one range Read asks for, and readBatch
// how many ranges go in one READ.
const (
	readChunkBytes = 8 << 20
	readBatch      = 4
)

// FindMount returns the root of the gdsfs mount that holds path: the
// nearest directory above it with a control file.
func FindMount(path string) (string, error) {
	abs, err := filepath.Abs(path)
	if err != nil {
		return "", usage.Errorf("%s: %v", path, err)
	}
	dir := filepath.Dir(abs)
	for {
		st, err := os.Stat(filepath.Join(dir, ctl.ControlName))
		if err == nil && st.Mode().IsRegular() {
			return dir, nil
		}
		if why := mountinfo.Unreachable(dir, err); why != "" {
			return "", usage.Errorf("%s", why)
		}
		parent := filepath.Dir(dir)
		if parent == dir {
			return "", usage.Errorf("%s is not on a gdsfs mount (no %s above it); mount its directory with gdsfs mount", path, ctl.ControlName)
		}
		dir = parent
	}
}

// DaemonDevice asks Read for the slabs the daemon serves by default: host
// memory where it offers host slabs, else GPU 0.
const DaemonDevice = -2

// Options say what Read reads and how (`gdsfs read`'s flags, which the
// command checks with messages naming them). Read refuses Offset < 0,
// Length < -1, Parallel or Passes < 1, and Parallel > 1 or EngineOnly
// without Discard.
type Options struct {
	Offset int64 // first byte
	Length int64 // bytes to read; -1: to the end of the file
	// Device is the slab device: ctl.HostDevice (-1) for shared host
	// memory, N for CUDA device N, DaemonDevice for the daemon's kind.
	Device int32
	// Discard reads into the slabs only and reports the throughput on
	// stderr instead of writing the bytes.
	Discard bool
	// EngineOnly (with Discard) serves the same requests with the engine
	// in this process on the backing file: the control path's baseline.
	EngineOnly bool
	Parallel   int // with Discard: requests in flight at once
	Passes     int // with Discard: timed passes, after one untimed warm-up pass
}

// Read reads a byte range of path (a file on a gdsfs mount) through the
// control path: the daemon reads it into its slabs, and Read copies it from
// the slabs to w, in order, equal to a plain read of the range (one that
// runs past the end of the file stops there). With o.Discard it measures
// instead (see Options). Errors the user can act on are usage errors
// (internal/usage) that say what to do.
func Read(ctx context.Context, w, stderr io.Writer, path string, o Options) error {
	if ctx == nil {
		ctx = context.Background()
	}
	if err := o.check(); err != nil {
		return err
	}
	mp, err := FindMount(path)
	if err != nil {
		return err
	}
	f, err := os.Open(path)
	if err != nil {
		return usage.Errorf("%v", err) // "open PATH: why"
	}
	defer f.Close()
	st, err := f.Stat()
	if err != nil {
		return fmt.Errorf("stat %s: %w", path, err)
	}
	if !st.Mode().IsRegular() {
		return usage.Errorf("%s is not a regular file; gdsfs read reads files", path)
	}
	if o.Offset > st.Size() {
		return usage.Errorf("--offset %d is past the end of %s (%d bytes)", o.Offset, path, st.Size())
	}
	end := st.Size()
	if o.Length >= 0 && o.Length < end-o.Offset {
		end = o.Offset + o.Length
	}
	cl, err := ctl.OpenSession(mp)
	if err != nil {
		return err
	}
	defer cl.Close()
	h := cl.Hello()
	if o.Device == DaemonDevice {
		o.Device = ctl.HostDevice
		if h.Caps&ctl.CapHostSlabs == 0 {
			o.Device = 0
		}
	}
	switch {
	case o.Device == ctl.HostDevice && h.Caps&ctl.CapHostSlabs == 0:
		return usage.Errorf("--device -1: the daemon serves GPU slabs only (%d devices); give --device 0..%d", h.Devices, int(h.Devices)-1)
	case o.Device >= 0 && uint32(o.Device) >= h.Devices:
		if h.Devices == 0 {
			return usage.Errorf("--device %d: the daemon serves host memory only (no GPU); leave --device out", o.Device)
		}
		return usage.Errorf("--device %d: the daemon serves devices 0..%d", o.Device, int(h.Devices)-1)
	}
	chunk := int64(readChunkBytes)
	if h.MaxLease > 0 {
		chunk = min(chunk, int64(h.MaxLease)/int64(readBatch*o.Parallel))
	}
	chunk = max(chunk, ctl.AlignBytes)
	r := &reader{cl: cl, f: f, path: path, device: o.Device, chunk: chunk}
	if o.EngineOnly {
		return engineOnly(ctx, stderr, path, o, chunk, end)
	}
	if o.Discard {
		return r.discard(ctx, stderr, o, end)
	}
	sink, err := newSlabReader(ctx, cl, o.Device)
	if err != nil {
		return err
	}
	defer sink.close()
	return r.stream(ctx, w, sink, o.Offset, end)
}

// check reports the first option Read cannot run with.
func (o Options) check() error {
	switch {
	case o.Offset < 0 || o.Length < -1:
		return fmt.Errorf("reader: range at %d of length %d: give an offset >= 0 and a length >= -1", o.Offset, o.Length)
	case o.Parallel < 1 || o.Passes < 1:
		return fmt.Errorf("reader: %d requests in flight, %d passes: give at least 1 of each", o.Parallel, o.Passes)
	case (o.Parallel > 1 || o.EngineOnly) && !o.Discard:
		return errors.New("reader: Parallel > 1 and EngineOnly measure: they need Discard")
	}
	return nil
}

// reader reads a file range through the control path in batches.
type reader struct {
	cl     *ctl.Client
	f      *os.File
	path   string
	device int32
	chunk  int64
}

// batch reads up to readBatch chunks from off, not past end.
func (r *reader) batch(ctx context.Context, off, end int64) ([]ctl.Lease, int64, error) {
	var ranges []ctl.Range
	for len(ranges) < readBatch && off < end {
		n := min(r.chunk, end-off)
		ranges = append(ranges, ctl.Range{Offset: uint64(off), Length: uint64(n)})
		off += n
	}
	ls, err := r.cl.Read(ctx, r.f, r.device, ranges)
	if err != nil {
		return nil, off, readError(r.path, err)
	}
	return ls, off, nil
}

func (r *reader) release(ctx context.Context, ls []ctl.Lease) error {
	ids := make([]uint64, 0, len(ls))
	for _, l := range ls {
		if l.ID != 0 {
			ids = append(ids, l.ID)
		}
	}
	if err := r.cl.Release(ctx, ids...); err != nil {
		return readError(r.path, err)
	}
	return nil
}

// stream writes [off, end) to w in order, reading one batch ahead.
func (r *reader) stream(ctx context.Context, w io.Writer, sink slabReader, off, end int64) error {
	type result struct {
		leases []ctl.Lease
		err    error
	}
	ahead := make(chan result, 1)
	stop := make(chan struct{})
	defer close(stop)
	go func() {
		defer close(ahead)
		for off < end {
			var res result
			res.leases, off, res.err = r.batch(ctx, off, end)
			select {
			case ahead <- res:
			case <-stop:
				if res.err == nil {
					r.release(ctx, res.leases)
				}
				return
			}
			if res.err != nil {
				return
			}
		}
	}()
	var buf []byte
	for res := range ahead {
		if res.err != nil {
			return res.err
		}
		short := false
		for _, l := range res.leases {
			data, err := sink.bytes(ctx, l, &buf)
			if err != nil {
				r.release(ctx, res.leases)
				return readError(r.path, err)
			}
			if _, err := w.Write(data); err != nil {
				r.release(ctx, res.leases)
				return fmt.Errorf("write output: %w", err)
			}
			short = short || l.Valid < l.Length
		}
		if err := r.release(ctx, res.leases); err != nil {
			return err
		}
		if short {
			// The file shrank while it was read: stop at its new end,
			// as a plain read would.
			return nil
		}
	}
	return nil
}

// discard reads [o.Offset, end) through the control path with o.Parallel
// requests in flight and reports the throughput on stderr.
func (r *reader) discard(ctx context.Context, stderr io.Writer, o Options, end int64) error {
	batch := func(ctx context.Context, from, to int64) (int64, error) {
		ls, _, err := r.batch(ctx, from, to)
		if err != nil {
			return 0, err
		}
		var n int64
		for _, l := range ls {
			n += int64(l.Valid)
		}
		return n, r.release(ctx, ls)
	}
	m, err := measure(ctx, o, r.chunk, end, batch)
	if err != nil {
		return err
	}
	fmt.Fprintf(stderr, "control-path read: %d bytes in %.3fs: %.2f GB/s (device %d, %d requests of %d x %s in flight, %d passes, %d EAGAIN retries)\n",
		m.bytes, m.d.Seconds(), float64(m.bytes)/m.d.Seconds()/1e9, r.device, o.Parallel, readBatch, humanize.IBytes(uint64(r.chunk)), o.Passes, m.retries)
	return nil
}

// measurement is the outcome of measure.
type measurement struct {
	bytes   int64
	d       time.Duration
	retries int64
}

// batchFunc reads the chunks of [from, to) as one request and returns the
// bytes read.
type batchFunc func(ctx context.Context, from, to int64) (int64, error)

// measure runs batch over [o.Offset, end) in spans of readBatch chunks with
// o.Parallel spans in flight: once untimed (slabs get allocated, the page
// cache warm), then o.Passes times, timed. The control path and the engine
// alone go through here, so they do the same work. A full pool is retried
// after a pause and counted (the pool never waits, the benchmark does).
func measure(ctx context.Context, o Options, chunk, end int64, batch batchFunc) (measurement, error) {
	var (
		next    atomic.Int64
		bytes   atomic.Int64
		retries atomic.Int64
		errMu   sync.Mutex
		first   error
	)
	span := chunk * readBatch
	spans := (end - o.Offset + span - 1) / span
	pass := func(passes int64) {
		next.Store(0)
		var wg sync.WaitGroup
		for range o.Parallel {
			wg.Go(func() {
				for {
					i := next.Add(1) - 1
					if i >= spans*passes {
						return
					}
					from := o.Offset + i%spans*span
					n, err := retryFull(ctx, &retries, func() (int64, error) { return batch(ctx, from, min(end, from+span)) })
					if err != nil {
						errMu.Lock()
						if first == nil {
							first = err
						}
						errMu.Unlock()
						next.Store(1 << 62)
						return
					}
					bytes.Add(n)
				}
			})
		}
		wg.Wait()
	}
	pass(1)
	if first != nil {
		return measurement{}, first
	}
	bytes.Store(0)
	retries.Store(0)
	start := time.Now()
	pass(int64(o.Passes))
	if first != nil {
		return measurement{}, first
	}
	return measurement{bytes: bytes.Load(), d: time.Since(start), retries: retries.Load()}, nil
}

// retryFull calls fn until it succeeds or fails with anything but a full
// pool (EAGAIN from the daemon, gpubuf.ErrExhausted in process), pausing
// between tries, for up to a minute.
func retryFull(ctx context.Context, retries *atomic.Int64, fn func() (int64, error)) (int64, error) {
	const pause, patience = 200 * time.Microsecond, time.Minute
	var waited time.Duration
	for {
		n, err := fn()
		if err == nil || !(errors.Is(err, syscall.EAGAIN) || errors.Is(err, gpubuf.ErrExhausted)) || waited >= patience {
			return n, err
		}
		retries.Add(1)
		select {
		case <-time.After(pause):
			waited += pause
		case <-ctx.Done():
			return 0, ctx.Err()
		}
	}
}

// readError explains the errnos a user can act on.
func readError(path string, err error) error {
	switch {
	case errors.Is(err, syscall.EAGAIN):
		return fmt.Errorf("%w (the daemon's buffer pool is full: retry later, or mount with a larger --host-pool/--gpu-pool)", err)
	case errors.Is(err, syscall.ENODEV):
		return usage.Errorf("%w (the daemon has no slabs on that --device; gdsfs status shows what it serves)", err)
	}
	return fmt.Errorf("read %s: %w", path, err)
}
