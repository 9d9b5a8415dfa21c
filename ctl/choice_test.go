package ctl

import (
	"context"
	"os"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/gdsfs/gdsfs/cufile"
)

// countingChooser answers with one engine and counts the calls.
type countingChooser struct {
	e     Engine
	calls atomic.Int64
}

func (c *countingChooser) For(*os.File, string) (Engine, string) {
	c.calls.Add(1)
	return c.e, "test: counted"
}

// TestEngineChoiceCached: READs of one file ask the chooser once per TTL
// (the cufile chooser measures the page cache over the whole file per call,
// which cost more than an 8 MiB transfer), concurrent first READs included;
// another file gets its own answer.
func TestEngineChoiceCached(t *testing.T) {
	e := newEnv(t, envOptions{slabBytes: 1 << 20, budgetBytes: 16 << 20})
	cc := &countingChooser{e: cufile.NewHostEngine(cufile.Options{ChunkBytes: 64 << 10, Workers: 2})}
	e.srv.choices.chooser = cc
	var now atomic.Int64
	e.srv.choices.now = func() time.Time { return time.Unix(0, now.Load()) }
	cl := e.client(1000, Token{})
	f, data := e.file("a.bin", 100000, os.O_RDONLY)
	g, _ := e.file("b.bin", 50000, os.O_RDONLY)
	ctx := context.Background()
	read := func(f *os.File) {
		t.Helper()
		ls, err := cl.Read(ctx, f, HostDevice, []Range{{Offset: 0, Length: 4096}, {Offset: 8000, Length: 9000}})
		if err != nil {
			t.Fatal(err)
		}
		if err := cl.Release(ctx, ls[0].ID, ls[1].ID); err != nil {
			t.Fatal(err)
		}
	}
	var wg sync.WaitGroup
	for range 8 {
		wg.Go(func() { read(f) })
	}
	wg.Wait()
	if n := cc.calls.Load(); n != 1 {
		t.Fatalf("8 concurrent READs of one file asked the chooser %d times, want 1", n)
	}
	read(f)
	now.Store(int64(choiceTTL) - 1)
	read(f)
	if n := cc.calls.Load(); n != 1 {
		t.Errorf("READs within the TTL asked the chooser %d times, want 1", n)
	}
	read(g)
	if n := cc.calls.Load(); n != 2 {
		t.Errorf("a second file: %d chooser calls, want 2", n)
	}
	now.Store(int64(choiceTTL))
	read(f)
	if n := cc.calls.Load(); n != 3 {
		t.Errorf("after the TTL: %d chooser calls, want 3", n)
	}
	// The cached engine reads the right bytes.
	ls, err := cl.Read(ctx, f, HostDevice, []Range{{Offset: 100, Length: 5000}})
	if err != nil {
		t.Fatal(err)
	}
	checkLeases(t, cl, []Range{{Offset: 100, Length: 5000}}, ls, data)
}

// rangeChooser records the ranges it is asked about.
type rangeChooser struct {
	countingChooser
	mu     sync.Mutex
	ranges [][2]int64
}

func (c *rangeChooser) ForRange(_ *os.File, _ string, off, n int64) (Engine, string) {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.ranges = append(c.ranges, [2]int64{off, n})
	return c.e, "test: range"
}

// TestEngineChoiceByRange: a RangeChooser is asked per READ about the span
// of its widened ranges (not the whole file, not from the per-file cache).
func TestEngineChoiceByRange(t *testing.T) {
	e := newEnv(t, envOptions{slabBytes: 1 << 20, budgetBytes: 16 << 20})
	rc := &rangeChooser{countingChooser: countingChooser{e: cufile.NewHostEngine(cufile.Options{ChunkBytes: 64 << 10, Workers: 2})}}
	e.srv.opts.Engines = rc
	e.srv.choices.chooser = rc
	cl := e.client(1000, Token{})
	f, data := e.file("a.bin", 100000, os.O_RDONLY)
	ctx := context.Background()
	ranges := []Range{{Offset: 30000, Length: 10}, {Offset: 5000, Length: 100}, {Offset: 99990, Length: 100}}
	for range 2 {
		ls, err := cl.Read(ctx, f, HostDevice, ranges)
		if err != nil {
			t.Fatal(err)
		}
		checkLeases(t, cl, ranges, ls, data)
	}
	want := [2]int64{4096, 102400 - 4096} // widened: [4096, 102400)
	if len(rc.ranges) != 2 || rc.ranges[0] != want || rc.ranges[1] != want {
		t.Errorf("ForRange asked about %v, want %v twice (once per READ)", rc.ranges, want)
	}
	if n := rc.calls.Load(); n != 0 {
		t.Errorf("For called %d times on READ, want 0", n)
	}
}
