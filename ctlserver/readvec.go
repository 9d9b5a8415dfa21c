package ctlserver

import (
	"context"
	"os"
	"runtime"
	"sync"

	"github.com/gdsfs/gdsfs/cufile"
	"github.com/gdsfs/gdsfs/gpubuf"
)

// vecGroupBytes is about how many bytes one goroutine reads of a READ
// served by a cufile.VecReader: a READ of many small ranges is cut into
// groups of consecutive ranges of about this size, read concurrently (at
// most 8 at a time, as readRanges reads ranges).
const vecGroupBytes = 4 << 20

// readVec reads plan[i] into held[i] for i in todo through vr, setting
// got[i] and errs[i] as readRanges' per-range reads do.
func readVec(ctx context.Context, vr cufile.VecReader, f *os.File, plan []span, held []*gpubuf.Lease, todo []int, got []int64, errs []error) {
	var groups [][]int
	var cur []int
	var bytes int64
	for _, i := range todo {
		cur = append(cur, i)
		bytes += plan[i].end - plan[i].start
		if bytes >= vecGroupBytes {
			groups, cur, bytes = append(groups, cur), nil, 0
		}
	}
	if len(cur) > 0 {
		groups = append(groups, cur)
	}
	read := func(g []int) {
		segs := make([]cufile.Segment, len(g))
		for k, i := range g {
			sp, l := plan[i], held[i]
			segs[k] = cufile.Segment{Dst: l.Slab.Memory, DstOff: l.Offset, FileOff: sp.start, N: sp.end - sp.start}
		}
		n, err := vr.ReadVec(ctx, f, segs)
		for k, i := range g {
			if err != nil {
				errs[i] = err
				continue
			}
			got[i] = n[k]
		}
	}
	sem := make(chan struct{}, max(1, min(runtime.GOMAXPROCS(0), 8)-1))
	var wg sync.WaitGroup
	for _, g := range groups[1:] {
		sem <- struct{}{}
		wg.Go(func() {
			defer func() { <-sem }()
			read(g)
		})
	}
	read(groups[0])
	wg.Wait()
}
