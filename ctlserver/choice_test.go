package ctlserver

import (
	"context"
	"os"
	"sync"
	"testing"

	"github.com/gdsfs/gdsfs/ctl"
	"github.com/gdsfs/gdsfs/cufile"
)

// recordingChooser answers with one engine and records the ranges it is
// asked about.
type recordingChooser struct {
	e      cufile.Engine
	mu     sync.Mutex
	ranges [][2]int64 // GUARDED_BY(mu)
}

func (c *recordingChooser) Choose(_ *os.File, _ string, off, n int64) (cufile.Engine, string) {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.ranges = append(c.ranges, [2]int64{off, n})
	return c.e, "test: range"
}

func (c *recordingChooser) asked() [][2]int64 {
	c.mu.Lock()
	defer c.mu.Unlock()
	out := c.ranges
	c.ranges = nil
	return out
}

// TestEngineChoiceByRange: the chooser is asked per READ about the span of
// its widened ranges (not the whole file, and not from a cache) and per
// WRITE about the whole file; the chosen engine moves the right bytes.
func TestEngineChoiceByRange(t *testing.T) {
	e := newEnv(t, envOptions{slabBytes: 1 << 20, budgetBytes: 16 << 20})
	rc := &recordingChooser{e: cufile.NewHostEngine(cufile.Options{ChunkBytes: 64 << 10, Workers: 2})}
	e.srv.opts.Engines = rc
	cl := e.client(1000, ctl.Token{})
	f, data := e.file("a.bin", 100000, os.O_RDONLY)
	ctx := context.Background()
	ranges := []ctl.Range{{Offset: 30000, Length: 10}, {Offset: 5000, Length: 100}, {Offset: 99990, Length: 100}}
	for range 2 {
		ls, err := cl.Read(ctx, f, ctl.HostDevice, ranges)
		if err != nil {
			t.Fatal(err)
		}
		checkLeases(t, cl, ranges, ls, data)
	}
	want := [2]int64{4096, 102400 - 4096} // widened: [4096, 102400)
	if got := rc.asked(); len(got) != 2 || got[0] != want || got[1] != want {
		t.Errorf("READs asked about %v, want %v twice (once per READ)", got, want)
	}

	w, _ := e.file("out.bin", 0, os.O_RDWR)
	l, err := cl.Alloc(ctx, ctl.HostDevice, 8192)
	if err != nil {
		t.Fatal(err)
	}
	if err := cl.Write(ctx, w, l, 0, 4096, 8192, false); err != nil {
		t.Fatal(err)
	}
	if got := rc.asked(); len(got) != 1 || got[0] != [2]int64{0, -1} {
		t.Errorf("WRITE asked about %v, want the whole file [0 -1] once", got)
	}
	if err := cl.Release(ctx, l.ID); err != nil {
		t.Fatal(err)
	}
}
