package ctlserver

import (
	"context"
	"os"
	"runtime"
	"sync"
	"sync/atomic"
	"testing"

	"github.com/gdsfs/gdsfs/ctl"
	"github.com/gdsfs/gdsfs/gpubuf"
)

// BenchmarkServerRead4KiB is the daemon's own work per READ of one 4 KiB
// range plus its RELEASE (no FUSE, no kernel): session lookup, validation,
// lease allocation, the engine call, the reply, the release. The FUSE round
// trips come on top (integration's BenchmarkControlRead4KiB).
//
//	go test -run '^$' -bench ServerRead -benchmem ./ctl
func BenchmarkServerRead4KiB(b *testing.B) {
	e := newEnv(b, envOptions{slabBytes: 1 << 20, budgetBytes: 64 << 20, noIndexes: true})
	cl := e.client(1000, ctl.Token{})
	f, _ := e.file("a.bin", 1<<20, os.O_RDONLY)
	ctx := context.Background()
	b.ReportAllocs()
	for i := 0; b.Loop(); i++ {
		off := uint64(i%256) * 4096
		ls, err := cl.Read(ctx, f, ctl.HostDevice, []ctl.Range{{Offset: off, Length: 4096}})
		if err != nil {
			b.Fatal(err)
		}
		if err := cl.Release(ctx, ls[0].ID); err != nil {
			b.Fatal(err)
		}
	}
}

// BenchmarkServerRead4x8MiB is one READ of four 8 MiB ranges plus RELEASE,
// the request gdsfs read --discard makes: compare with the engine's own
// time for 32 MiB (BenchmarkEngine4x8MiB) for the daemon's overhead.
func BenchmarkServerRead4x8MiB(b *testing.B) {
	e := newEnv(b, envOptions{slabBytes: 64 << 20, budgetBytes: 256 << 20, noIndexes: true})
	cl := e.client(1000, ctl.Token{})
	f, _ := e.file("a.bin", 32<<20, os.O_RDONLY)
	ctx := context.Background()
	ranges := []ctl.Range{{Offset: 0, Length: 8 << 20}, {Offset: 8 << 20, Length: 8 << 20}, {Offset: 16 << 20, Length: 8 << 20}, {Offset: 24 << 20, Length: 8 << 20}}
	b.SetBytes(32 << 20)
	b.ReportAllocs()
	for b.Loop() {
		ls, err := cl.Read(ctx, f, ctl.HostDevice, ranges)
		if err != nil {
			b.Fatal(err)
		}
		if err := cl.Release(ctx, ls[0].ID, ls[1].ID, ls[2].ID, ls[3].ID); err != nil {
			b.Fatal(err)
		}
	}
}

// BenchmarkEngine4x8MiB is the engine's share of BenchmarkServerRead4x8MiB:
// the same four 8 MiB ranges into leases of the same pool, read as
// readRanges reads them, without the request around it.
func BenchmarkEngine4x8MiB(b *testing.B) {
	e := newEnv(b, envOptions{slabBytes: 64 << 20, budgetBytes: 256 << 20, noIndexes: true})
	f, _ := e.file("a.bin", 32<<20, os.O_RDONLY)
	eng, _ := e.srv.opts.Engines.Choose(f, f.Name(), 0, -1)
	ctx := context.Background()
	owner := gpubuf.Owner{Session: 99, UID: 1000}
	b.SetBytes(32 << 20)
	b.ReportAllocs()
	for b.Loop() {
		var wg sync.WaitGroup
		var next atomic.Int64
		ls := make([]*gpubuf.Lease, 4)
		for i := range ls {
			l, err := e.pool.Alloc(ctx, owner, 0, 8<<20)
			if err != nil {
				b.Fatal(err)
			}
			ls[i] = l
		}
		read := func() {
			for {
				i := int(next.Add(1) - 1)
				if i >= len(ls) {
					return
				}
				if _, err := eng.ReadAt(ctx, f, ls[i].Slab.Memory, ls[i].Offset, int64(i)<<23, 8<<20); err != nil {
					b.Error(err)
				}
			}
		}
		for range min(len(ls), runtime.GOMAXPROCS(0), 8) - 1 {
			wg.Go(read)
		}
		read()
		wg.Wait()
		for _, l := range ls {
			_ = e.pool.Release(owner, l.ID)
		}
	}
}
