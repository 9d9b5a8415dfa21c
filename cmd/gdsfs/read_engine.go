package main

import (
	"context"
	"fmt"
	"io"
	"os"
	"sync"
	"sync/atomic"
	"time"

	"github.com/dustin/go-humanize"
	"github.com/rs/zerolog"

	"github.com/gdsfs/gdsfs/ctl"
	"github.com/gdsfs/gdsfs/cufile"
	"github.com/gdsfs/gdsfs/gpubuf"
)

// engineOnly is gdsfs read --discard --engine-only: the requests the
// control path would make (batches of readBatch chunks, parallel in
// flight), served by the engine in this process on the backing file, with
// leases from a pool of its own. It is the baseline the control path's
// throughput is judged against.
func engineOnly(ctx context.Context, stderr io.Writer, path string, o readOpts, chunk, off, end int64) error {
	backing, err := getxattr(path, "user.gdsfs.backing")
	if err != nil {
		return fmt.Errorf("read user.gdsfs.backing of %s: %w", path, err)
	}
	f, err := os.Open(string(backing))
	if err != nil {
		return usagef("open the backing file %s: %v (is the mount an overmount? it shadows its own backing path)", backing, err)
	}
	defer f.Close()
	engines, err := cufile.Open(cufile.Config{Log: zerolog.Nop()})
	if err != nil {
		return err
	}
	defer engines.Close()
	// Twice what the requests in flight hold, in whole slabs: concurrent
	// first allocations each reserve a slab (the pool never waits).
	const slab = 64 << 20
	need := alignUp(2 * chunk * readBatch * int64(o.parallel))
	pool, err := gpubuf.NewPool(gpubuf.Config{Backend: engines.Backend(), SlabBytes: slab,
		BudgetBytes: max(4*slab, (need+slab-1)/slab*slab)})
	if err != nil {
		return err
	}
	defer pool.Close()
	dev := int(o.device)
	if engines.Backend().Name() == "host" {
		if o.device != ctl.HostDevice {
			return usagef("--device %d: no GPU here; leave --device out", o.device)
		}
		dev = 0
	}
	eng, why := engines.For(f, string(backing))
	owner := gpubuf.Owner{Session: 1, UID: uint32(os.Getuid())}
	var (
		next  atomic.Int64
		bytes atomic.Int64
		wg    sync.WaitGroup
		errMu sync.Mutex
		first error
	)
	fail := func(err error) {
		errMu.Lock()
		if first == nil {
			first = err
		}
		errMu.Unlock()
		next.Store(1 << 62)
	}
	span := chunk * readBatch
	pass := func() {
		next.Store(0)
		for range o.parallel {
			wg.Go(func() {
				for {
					from := off + (next.Add(1)-1)*span
					if from >= end {
						return
					}
					// One batch: its chunks concurrently, as the server
					// reads the ranges of one request.
					var bw sync.WaitGroup
					for c := from; c < min(end, from+span); c += chunk {
						n := min(chunk, end-c)
						bw.Go(func() {
							l, err := pool.Alloc(ctx, owner, dev, n)
							if err != nil {
								fail(err)
								return
							}
							got, err := eng.ReadAt(ctx, f, l.Slab.Memory, l.Offset, c, n)
							_ = pool.Release(owner, l.ID)
							if err != nil {
								fail(err)
								return
							}
							bytes.Add(got)
						})
					}
					bw.Wait()
				}
			})
		}
		wg.Wait()
	}
	// A first pass allocates and touches the slabs (the daemon's are warm
	// after its first requests); the second is measured.
	pass()
	if first != nil {
		return first
	}
	bytes.Store(0)
	start := time.Now()
	pass()
	if first != nil {
		return first
	}
	d := time.Since(start)
	n := bytes.Load()
	fmt.Fprintf(stderr, "engine-only read: %d bytes in %.3fs: %.2f GB/s (engine %s: %s; %d requests of %d x %s in flight)\n",
		n, d.Seconds(), float64(n)/d.Seconds()/1e9, eng.Name(), why, o.parallel, readBatch, humanize.IBytes(uint64(chunk)))
	return nil
}

func alignUp(n int64) int64 { return (n + gpubuf.Align - 1) &^ (gpubuf.Align - 1) }
