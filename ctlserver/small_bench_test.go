package ctlserver

import (
	"context"
	"fmt"
	"os"
	"testing"

	"github.com/gdsfs/gdsfs/ctl"
)

// BenchmarkServerReadSmallSamples is the daemon's work for one READ of a
// batch of small samples plus its RELEASE (no FUSE, no kernel), as
// GDSShardDataset asks for them (issue 15): 16 ranges of a tar's
// consecutive samples (the payload, then 1664 bytes of headers and a small
// field before the next), against the same bytes asked for as one range
// ("coalesced"). The difference is the daemon's per-range cost.
//
//	go test -run '^$' -bench ServerReadSmallSamples -benchmem ./ctlserver
func BenchmarkServerReadSmallSamples(b *testing.B) {
	const gap = 1664
	for _, size := range []uint64{16 << 10, 64 << 10, 256 << 10} {
		ranges := make([]ctl.Range, 16)
		for i := range ranges {
			ranges[i] = ctl.Range{Offset: uint64(i) * (size + gap), Length: size}
		}
		last := ranges[len(ranges)-1]
		one := []ctl.Range{{Offset: 0, Length: last.Offset + last.Length}}
		for _, c := range []struct {
			name   string
			ranges []ctl.Range
		}{{"16ranges", ranges}, {"coalesced", one}} {
			b.Run(fmt.Sprintf("%dKiB/%s", size>>10, c.name), func(b *testing.B) {
				e := newEnv(b, envOptions{slabBytes: 16 << 20, budgetBytes: 64 << 20, noIndexes: true})
				cl := e.client(1000, ctl.Token{})
				f, _ := e.file("a.bin", int(one[0].Length), os.O_RDONLY)
				ctx := context.Background()
				b.SetBytes(int64(16 * size))
				b.ReportAllocs()
				for b.Loop() {
					ls, err := cl.Read(ctx, f, ctl.HostDevice, c.ranges)
					if err != nil {
						b.Fatal(err)
					}
					ids := make([]uint64, len(ls))
					for i, l := range ls {
						ids[i] = l.ID
					}
					if err := cl.Release(ctx, ids...); err != nil {
						b.Fatal(err)
					}
				}
			})
		}
	}
}
