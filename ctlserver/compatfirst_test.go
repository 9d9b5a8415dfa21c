package ctlserver

import (
	"bytes"
	"context"
	"os"
	"sync"
	"testing"

	"github.com/gdsfs/gdsfs/ctl"
	"github.com/gdsfs/gdsfs/cufile"
	"github.com/gdsfs/gdsfs/gpubuf"
)

// namedEngine is an engine under another name, counting its reads.
type namedEngine struct {
	cufile.Engine
	name  string
	mu    sync.Mutex
	reads int // GUARDED_BY(mu)
}

func (e *namedEngine) Name() string { return e.name }

func (e *namedEngine) ReadAt(ctx context.Context, f *os.File, dst gpubuf.Memory, dstOff, fileOff, n int64) (int64, error) {
	e.mu.Lock()
	e.reads++
	e.mu.Unlock()
	return e.Engine.ReadAt(ctx, f, dst, dstOff, fileOff, n)
}

func (e *namedEngine) count() int {
	e.mu.Lock()
	defer e.mu.Unlock()
	return e.reads
}

// firstTouchCompat is cuFile compat mode as the H200 measured it: its
// first read into memory it was not prepared for pays a first touch
// (counted), and it routes reads into such memory to posix, preparing
// the memory for the next READ (cufile.MemoryRouter).
type firstTouchCompat struct {
	namedEngine
	posix *namedEngine

	pmu       sync.Mutex
	prepared  map[gpubuf.Memory]bool // GUARDED_BY(pmu)
	touches   int                    // GUARDED_BY(pmu): reads into unprepared memory
	dedicated int                    // GUARDED_BY(pmu): dedicated slabs routed
}

func (e *firstTouchCompat) ReadAt(ctx context.Context, f *os.File, dst gpubuf.Memory, dstOff, fileOff, n int64) (int64, error) {
	e.pmu.Lock()
	if !e.prepared[dst] {
		e.touches++
		e.prepared[dst] = true
	}
	e.pmu.Unlock()
	return e.namedEngine.ReadAt(ctx, f, dst, dstOff, fileOff, n)
}

func (e *firstTouchCompat) RouteFor(slabs []*gpubuf.Slab) cufile.Engine {
	e.pmu.Lock()
	defer e.pmu.Unlock()
	route := false
	for _, s := range slabs {
		if s.Dedicated {
			e.dedicated++
			route = true
		} else if !e.prepared[s.Memory] {
			e.prepared[s.Memory], route = true, true
		}
	}
	if route {
		return e.posix
	}
	return nil
}

// TestCompatFirstTouchOfNewSlabs: a READ the chooser gives to cuFile
// compat mode whose leases land in a slab compat was not prepared for is
// read by the engine the router names, and the reply names that engine;
// the next READ into the now prepared slab is compat's; the router is
// told which slabs are dedicated. No READ pays compat's first touch.
func TestCompatFirstTouchOfNewSlabs(t *testing.T) {
	e := newEnv(t, envOptions{slabBytes: 1 << 20, budgetBytes: 16 << 20})
	host := cufile.NewHostEngine(cufile.Options{ChunkBytes: 64 << 10, Workers: 2})
	posix := &namedEngine{Engine: host, name: cufile.EnginePosix}
	compat := &firstTouchCompat{namedEngine: namedEngine{Engine: host, name: cufile.EngineGDSCompat}, posix: posix, prepared: map[gpubuf.Memory]bool{}}
	e.srv.opts.Engines = &recordingChooser{e: compat}
	cl := e.client(1000, ctl.Token{})
	f, data := e.file("a.bin", 2<<20, os.O_RDONLY)
	ctx := context.Background()
	for i, want := range []struct {
		ranges []ctl.Range
		engine string
		posix  int
		compat int
	}{
		{[]ctl.Range{{Offset: 0, Length: 100000}}, cufile.EnginePosix, 1, 0},                                     // fresh slab
		{[]ctl.Range{{Offset: 100000, Length: 100000}}, cufile.EngineGDSCompat, 1, 1},                            // the same slab
		{[]ctl.Range{{Offset: 200000, Length: 50000}, {Offset: 4096, Length: 10}}, cufile.EngineGDSCompat, 1, 3}, // two ranges, the same slab
		{[]ctl.Range{{Offset: 0, Length: 3 << 19}}, cufile.EnginePosix, 2, 3},                                    // larger than a slab: dedicated
	} {
		ls, err := cl.Read(ctx, f, ctl.HostDevice, want.ranges)
		if err != nil {
			t.Fatal(err)
		}
		for j, l := range ls {
			if l.Engine != ctl.EngineCodeOf(want.engine) {
				t.Errorf("READ %d: lease names engine %v, want %s", i, l.Engine, want.engine)
			}
			got, err := cl.Bytes(ctx, l)
			if err != nil {
				t.Fatal(err)
			}
			r := want.ranges[j]
			if !bytes.Equal(got, data[r.Offset:r.Offset+r.Length]) {
				t.Errorf("READ %d range %d: bytes differ from the file", i, j)
			}
		}
		if posix.count() != want.posix || compat.count() != want.compat {
			t.Errorf("READ %d: posix read %d ranges, compat %d; want %d and %d", i, posix.count(), compat.count(), want.posix, want.compat)
		}
	}
	compat.pmu.Lock()
	touches, dedicated := compat.touches, compat.dedicated
	compat.pmu.Unlock()
	if dedicated != 1 {
		t.Errorf("the router was told of %d dedicated slabs, want 1 (the READ larger than a slab)", dedicated)
	}
	if touches != 0 {
		t.Errorf("compat mode paid its first touch of a slab %d times, want none", touches)
	}
}

// TestRouteByMemory: the engine and the reply's code after routing, for
// an engine that does not route, one that keeps a READ, one that routes
// it, and a code that named another engine than the one reading (a tier
// hit told as the caller's engine), which routing leaves as it was.
func TestRouteByMemory(t *testing.T) {
	host := cufile.NewHostEngine(cufile.Options{})
	posix := &namedEngine{Engine: host, name: cufile.EnginePosix}
	fresh, used := &gpubuf.Slab{ID: 1}, &gpubuf.Slab{ID: 2}
	router := &firstTouchCompat{namedEngine: namedEngine{Engine: host, name: cufile.EngineGDSCompat}, posix: posix,
		prepared: map[gpubuf.Memory]bool{}}
	fresh.Memory, used.Memory = &namedMemory{"fresh"}, &namedMemory{"used"}
	router.prepared[used.Memory] = true
	compatCode, posixCode := ctl.EngineCodeOf(cufile.EngineGDSCompat), ctl.EngineCodeOf(cufile.EnginePosix)
	for _, tc := range []struct {
		name     string
		eng      cufile.Engine
		code     ctl.EngineCode
		held     []*gpubuf.Lease
		wantEng  cufile.Engine
		wantCode ctl.EngineCode
	}{
		{"no router", host, ctl.EngineHost, []*gpubuf.Lease{{Slab: fresh}}, host, ctl.EngineHost},
		{"kept", router, compatCode, []*gpubuf.Lease{{Slab: used}, nil}, router, compatCode},
		{"routed", router, compatCode, []*gpubuf.Lease{nil, {Slab: used}, {Slab: fresh}}, posix, posixCode},
		{"told another engine", router, ctl.EngineTier, []*gpubuf.Lease{{Slab: &gpubuf.Slab{Memory: &namedMemory{"new"}}}}, posix, ctl.EngineTier},
	} {
		eng, code := routeByMemory(tc.eng, tc.code, tc.held)
		if eng != tc.wantEng || code != tc.wantCode {
			t.Errorf("%s: %s with code %v, want %s with %v", tc.name, eng.Name(), code, tc.wantEng.Name(), tc.wantCode)
		}
	}
}

// namedMemory is memory that is only a key.
type namedMemory struct{ name string }

func (m *namedMemory) Size() int64             { return 0 }
func (m *namedMemory) Export() ([]byte, error) { return nil, nil }
func (m *namedMemory) Close() error            { return nil }
