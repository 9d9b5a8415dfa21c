package main

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
	"github.com/spf13/cobra"

	"github.com/gdsfs/gdsfs/ctl"
	"github.com/gdsfs/gdsfs/gpubuf"
)

// readChunkBytes is the size of one range `gdsfs read` asks for, and
// readBatch how many ranges go in one READ.
const (
	readChunkBytes = 8 << 20
	readBatch      = 4
)

func newReadCmd() *cobra.Command {
	var (
		offset, length int64
		device         int
		discard        bool
		engineOnly     bool
		parallel       int
		passes         int
	)
	cmd := &cobra.Command{
		Use:   "read [--offset N] [--length N] [--device N] FILE",
		Short: "Copy a file range through the control path to stdout",
		Long: `Read a byte range of FILE (on a gdsfs mount) through the control path: the
daemon reads it into its slabs with the engine it picked for the file, and
gdsfs read copies it back from the slabs to stdout. The output equals a plain
read of the same range; a range that runs past the end of the file stops
there. Useful to check the control path end to end, and in scripts.

--device -1 (the default when the daemon serves host memory) uses shared
host memory slabs; --device N uses GPU N's slabs, copied back by CUDA IPC.
--discard reads into the slabs and throws the bytes away, printing the
throughput: the control path's own speed, file to slab. --engine-only
measures the same requests with the engine alone, in this process, on the
backing file: the difference is the cost of the ioctl hop. Both read the
range once untimed (slabs allocated, page cache warm), then --passes times
timed; a full pool (EAGAIN) is waited out and counted, not fatal.`,
		Example: `  gdsfs read /data/shard-000.tar | sha256sum
  gdsfs read --offset 4096 --length 1048576 /data/model.safetensors > head.bin
  gdsfs read --device 0 --discard --parallel 8 /data/big.bin   # file -> GPU throughput
  gdsfs read --device 0 --discard --parallel 8 --engine-only /data/big.bin   # the same, engine alone`,
		Args: cobra.ExactArgs(1),
		RunE: func(cmd *cobra.Command, args []string) error {
			if offset < 0 {
				return usagef("--offset %d: give a byte offset >= 0", offset)
			}
			if length < -1 {
				return usagef("--length %d: give a byte count >= 0 (or leave it out to read to the end)", length)
			}
			if device < -1 {
				return usagef("--device %d: give -1 (host memory) or a CUDA device number", device)
			}
			if parallel < 1 || parallel > 64 {
				return usagef("--parallel %d: give 1 to 64", parallel)
			}
			if parallel > 1 && !discard {
				return usagef("--parallel needs --discard (output is written in order by one reader)")
			}
			if engineOnly && !discard {
				return usagef("--engine-only needs --discard (it measures, it does not copy)")
			}
			if passes < 1 || passes > 1000 {
				return usagef("--passes %d: give 1 to 1000", passes)
			}
			if cmd.Flags().Changed("passes") && !discard {
				return usagef("--passes needs --discard (it repeats a measurement)")
			}
			dev := int32(device)
			if !cmd.Flags().Changed("device") {
				dev = -2 // the daemon's kind: decided after hello
			}
			o := readOpts{offset: offset, length: length, device: dev, discard: discard, engineOnly: engineOnly, parallel: parallel, passes: passes}
			return runRead(cmd.Context(), cmd.OutOrStdout(), cmd.ErrOrStderr(), args[0], o)
		},
	}
	cmd.Flags().Int64Var(&offset, "offset", 0, "first byte to read")
	cmd.Flags().Int64Var(&length, "length", -1, "bytes to read (default: to the end of the file)")
	cmd.Flags().IntVar(&device, "device", -1, "slab device: -1 for shared host memory, N for CUDA device N")
	cmd.Flags().BoolVar(&discard, "discard", false, "read into the slabs only, print the throughput (nothing on stdout)")
	cmd.Flags().IntVar(&parallel, "parallel", 1, "with --discard: requests in flight at once")
	cmd.Flags().IntVar(&passes, "passes", 1, "with --discard: timed passes over the range, after one untimed warm-up pass")
	cmd.Flags().BoolVar(&engineOnly, "engine-only", false, "with --discard: skip the mount, run the engine in this process on the backing file with the same requests (the baseline of the control path's overhead)")
	return cmd
}

// findMount returns the root of the gdsfs mount that holds path: the
// nearest directory above it with a control file.
func findMount(path string) (string, error) {
	abs, err := filepath.Abs(path)
	if err != nil {
		return "", usagef("%s: %v", path, err)
	}
	dir := filepath.Dir(abs)
	for {
		st, err := os.Stat(filepath.Join(dir, ctl.ControlName))
		if err == nil && st.Mode().IsRegular() {
			return dir, nil
		}
		parent := filepath.Dir(dir)
		if parent == dir {
			return "", usagef("%s is not on a gdsfs mount (no %s above it); mount its directory with gdsfs mount", path, ctl.ControlName)
		}
		dir = parent
	}
}

// readOpts are gdsfs read's parsed flags.
type readOpts struct {
	offset, length int64
	device         int32 // -2: the daemon's default kind
	discard        bool
	engineOnly     bool
	parallel       int
	passes         int
}

func runRead(ctx context.Context, w, stderr io.Writer, path string, o readOpts) error {
	if ctx == nil {
		ctx = context.Background()
	}
	mp, err := findMount(path)
	if err != nil {
		return err
	}
	f, err := os.Open(path)
	if err != nil {
		return usagef("open %s: %v", path, err)
	}
	defer f.Close()
	st, err := f.Stat()
	if err != nil {
		return fmt.Errorf("stat %s: %w", path, err)
	}
	if !st.Mode().IsRegular() {
		return usagef("%s is not a regular file; gdsfs read reads files", path)
	}
	if o.offset > st.Size() {
		return usagef("--offset %d is past the end of %s (%d bytes)", o.offset, path, st.Size())
	}
	end := st.Size()
	if o.length >= 0 && o.length < end-o.offset {
		end = o.offset + o.length
	}
	cl, err := ctl.OpenSession(mp)
	if err != nil {
		return err
	}
	defer cl.Close()
	h := cl.Hello()
	if o.device == -2 {
		o.device = ctl.HostDevice
		if h.Caps&ctl.CapHostSlabs == 0 {
			o.device = 0
		}
	}
	switch {
	case o.device == ctl.HostDevice && h.Caps&ctl.CapHostSlabs == 0:
		return usagef("--device -1: the daemon serves GPU slabs only (%d devices); give --device 0..%d", h.Devices, int(h.Devices)-1)
	case o.device >= 0 && uint32(o.device) >= h.Devices:
		if h.Devices == 0 {
			return usagef("--device %d: the daemon serves host memory only (no GPU); leave --device out", o.device)
		}
		return usagef("--device %d: the daemon serves devices 0..%d", o.device, int(h.Devices)-1)
	}
	chunk := int64(readChunkBytes)
	if h.MaxLease > 0 {
		chunk = min(chunk, int64(h.MaxLease)/int64(readBatch*o.parallel))
	}
	chunk = max(chunk, ctl.AlignBytes)
	r := &reader{cl: cl, f: f, path: path, device: o.device, chunk: chunk}
	if o.engineOnly {
		return engineOnly(ctx, stderr, path, o, chunk, end)
	}
	if o.discard {
		return r.discard(ctx, stderr, o, end)
	}
	sink, err := newSlabReader(ctx, cl, o.device)
	if err != nil {
		return err
	}
	defer sink.close()
	return r.stream(ctx, w, sink, o.offset, end)
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

// discard reads [o.offset, end) through the control path with o.parallel
// requests in flight and reports the throughput on stderr.
func (r *reader) discard(ctx context.Context, stderr io.Writer, o readOpts, end int64) error {
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
		m.bytes, m.d.Seconds(), float64(m.bytes)/m.d.Seconds()/1e9, r.device, o.parallel, readBatch, humanize.IBytes(uint64(r.chunk)), o.passes, m.retries)
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

// measure runs batch over [o.offset, end) in spans of readBatch chunks with
// o.parallel spans in flight: once untimed (slabs get allocated, the page
// cache warm), then o.passes times, timed. The control path and the engine
// alone go through here, so they do the same work. A full pool is retried
// after a pause and counted (the pool never waits, the benchmark does).
func measure(ctx context.Context, o readOpts, chunk, end int64, batch batchFunc) (measurement, error) {
	var (
		next    atomic.Int64
		bytes   atomic.Int64
		retries atomic.Int64
		errMu   sync.Mutex
		first   error
	)
	span := chunk * readBatch
	spans := (end - o.offset + span - 1) / span
	pass := func(passes int64) {
		next.Store(0)
		var wg sync.WaitGroup
		for range o.parallel {
			wg.Go(func() {
				for {
					i := next.Add(1) - 1
					if i >= spans*passes {
						return
					}
					from := o.offset + i%spans*span
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
	pass(int64(o.passes))
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
		return usagef("%w (the daemon has no slabs on that --device; gdsfs status shows what it serves)", err)
	}
	return fmt.Errorf("read %s: %w", path, err)
}
