package ctlserver

import (
	"context"
	"errors"
	"os"
	"sync/atomic"
	"testing"

	"github.com/gdsfs/gdsfs/ctl"
	"github.com/gdsfs/gdsfs/cufile"
)

// vecEngine is the host engine with a ReadVec (as the posix engine has):
// it counts calls and segments, and can fail.
type vecEngine struct {
	cufile.Engine
	calls, segs atomic.Int64
	fail        bool
}

func (v *vecEngine) ReadVec(ctx context.Context, f *os.File, segs []cufile.Segment) ([]int64, error) {
	v.calls.Add(1)
	v.segs.Add(int64(len(segs)))
	if v.fail {
		return nil, errors.New("test: vectored read failed")
	}
	out := make([]int64, len(segs))
	for i, s := range segs {
		n, err := v.Engine.ReadAt(ctx, f, s.Dst, s.DstOff, s.FileOff, s.N)
		if err != nil {
			return nil, err
		}
		out[i] = n
	}
	return out, nil
}

// A READ of many ranges goes to an engine's ReadVec, in groups of about
// vecGroupBytes, and gives the same leases and bytes as range by range; a
// failed vectored read fails the READ and leaves no lease behind.
func TestReadVec(t *testing.T) {
	const size = 150 << 10
	var ranges []ctl.Range
	for i := range 40 { // 40 samples of 150 KiB with tar-like gaps: 6 MB, two groups
		ranges = append(ranges, ctl.Range{Offset: uint64(i) * (size + 1664), Length: size})
	}
	ranges = append(ranges, ctl.Range{Offset: 3, Length: 0}, ctl.Range{Offset: 40*(size+1664) - 100, Length: 4096}) // empty; past the end
	cases := []struct {
		name   string
		ranges []ctl.Range
		calls  int64
	}{
		{"many ranges", ranges, 2},
		{"one range", ranges[:1], 0},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			e := newEnv(t, envOptions{slabBytes: 16 << 20, budgetBytes: 64 << 20, noIndexes: true})
			ve := &vecEngine{Engine: cufile.NewHostEngine(cufile.Options{})}
			e.srv.opts.Engines = fixedEngine{ve}
			cl := e.client(1000, ctl.Token{})
			f, data := e.file("a.bin", 40*(size+1664), os.O_RDONLY)
			ls, err := cl.Read(context.Background(), f, ctl.HostDevice, c.ranges)
			if err != nil {
				t.Fatal(err)
			}
			checkLeases(t, cl, c.ranges, ls, data)
			if got := ve.calls.Load(); got != c.calls {
				t.Errorf("%d ReadVec calls, want %d", got, c.calls)
			}
			if c.calls > 0 && ve.segs.Load() != int64(len(c.ranges)-1) {
				t.Errorf("ReadVec got %d segments, want %d (the empty range reads nothing)", ve.segs.Load(), len(c.ranges)-1)
			}
		})
	}
	t.Run("failure", func(t *testing.T) {
		e := newEnv(t, envOptions{slabBytes: 16 << 20, budgetBytes: 64 << 20, noIndexes: true})
		e.srv.opts.Engines = fixedEngine{&vecEngine{Engine: cufile.NewHostEngine(cufile.Options{}), fail: true}}
		cl := e.client(1000, ctl.Token{})
		f, _ := e.file("a.bin", 40*(size+1664), os.O_RDONLY)
		if _, err := cl.Read(context.Background(), f, ctl.HostDevice, ranges); err == nil {
			t.Fatal("READ succeeded despite a failed vectored read")
		}
		if n, b := e.leased(); n != 0 || b != 0 {
			t.Errorf("pool holds %d leases (%d bytes) after a failed READ", n, b)
		}
	})
}
