package reader

import (
	"cmp"
	"context"
	"fmt"
	"io"
	"os"
	"runtime"
	"sync"
	"sync/atomic"

	"github.com/dustin/go-humanize"
	"github.com/rs/zerolog"

	"github.com/gdsfs/gdsfs/ctl"
	"github.com/gdsfs/gdsfs/cufile"
	"github.com/gdsfs/gdsfs/gpubuf"
	"github.com/gdsfs/gdsfs/internal/usage"
	"github.com/gdsfs/gdsfs/internal/xattr"
)

// engineOnly is Read with Discard and EngineOnly: the requests the
// control path would make (batches of readBatch chunks, parallel in
// flight), served by the engine in this process on the backing file, with
// leases from a pool of its own. It is the baseline the control path's
// throughput is judged against.
func engineOnly(ctx context.Context, stderr io.Writer, path string, o Options, chunk, end int64) error {
	backing, err := xattr.Get(path, "user.gdsfs.backing")
	if err != nil {
		return fmt.Errorf("read user.gdsfs.backing of %s: %w", path, err)
	}
	f, err := os.Open(string(backing))
	if err != nil {
		return usage.Errorf("open the backing file %s: %v (is the mount an overmount? it shadows its own backing path)", backing, err)
	}
	defer f.Close()
	engines, err := cufile.Open(cufile.Config{Log: zerolog.Nop()})
	if err != nil {
		return err
	}
	defer engines.Close()
	// The requests in flight hold parallel x readBatch chunks; whole slabs
	// of it, plus one (a chunk that does not divide the slab size leaves
	// slab tails unused).
	const slab = 64 << 20
	need := int64(o.Parallel) * readBatch * gpubuf.AlignUp(chunk)
	// One process, one uid: it may use its whole pool.
	budget := ((need+slab-1)/slab + 1) * slab
	pool, err := gpubuf.NewPool(gpubuf.Config{Backend: engines.Backend(), SlabBytes: slab,
		BudgetBytes: budget, UIDShareBytes: budget})
	if err != nil {
		return err
	}
	defer pool.Close()
	dev := int(o.Device)
	if engines.Backend().Name() == gpubuf.HostBackendName {
		if o.Device != ctl.HostDevice {
			return usage.Errorf("--device %d: no GPU here; leave --device out", o.Device)
		}
		dev = 0
	}
	eng, why := engines.Choose(f, string(backing), 0, -1)
	owner := gpubuf.Owner{Session: 1, UID: uint32(os.Getuid())}
	// One batch as the daemon serves one READ (ctl's readRanges): lease
	// every chunk, read them with up to min(chunks, GOMAXPROCS, 8)
	// goroutines, this one included, then release them (RELEASE).
	batch := func(ctx context.Context, from, to int64) (int64, error) {
		var leases []*gpubuf.Lease
		defer func() {
			for _, l := range leases {
				_ = pool.Release(owner, l.ID)
			}
		}()
		type job struct {
			l      *gpubuf.Lease
			off, n int64
		}
		var jobs []job
		for c := from; c < to; c += chunk {
			n := min(chunk, to-c)
			l, err := pool.Alloc(ctx, owner, dev, gpubuf.AlignUp(n))
			if err != nil {
				return 0, err
			}
			leases = append(leases, l)
			jobs = append(jobs, job{l, c, n})
		}
		var (
			k     atomic.Int64
			got   atomic.Int64
			errMu sync.Mutex
			first error
		)
		work := func() {
			for {
				i := int(k.Add(1) - 1)
				if i >= len(jobs) {
					return
				}
				j := jobs[i]
				n, err := eng.ReadAt(ctx, f, j.l.Slab.Memory, j.l.Offset, j.off, j.n)
				if err != nil {
					errMu.Lock()
					first = cmp.Or(first, err)
					errMu.Unlock()
					return
				}
				got.Add(n)
			}
		}
		var wg sync.WaitGroup
		for range min(len(jobs), runtime.GOMAXPROCS(0), 8) - 1 {
			wg.Go(work)
		}
		work()
		wg.Wait()
		return got.Load(), first
	}
	m, err := measure(ctx, o, chunk, end, batch)
	if err != nil {
		return err
	}
	fmt.Fprintf(stderr, "engine-only read: %d bytes in %.3fs: %.2f GB/s (engine %s: %s; %d requests of %d x %s in flight, %d passes, %d EAGAIN retries)\n",
		m.bytes, m.d.Seconds(), float64(m.bytes)/m.d.Seconds()/1e9, eng.Name(), why, o.Parallel, readBatch, humanize.IBytes(uint64(chunk)), o.Passes, m.retries)
	return nil
}
