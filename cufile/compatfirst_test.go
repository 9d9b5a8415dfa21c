package cufile

import (
	"bytes"
	"errors"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"

	"github.com/rs/zerolog"

	"github.com/gdsfs/gdsfs/gpubuf"
	"github.com/gdsfs/gdsfs/internal/pagecache"
)

// fakeSlab is device memory whose compat-mode preparation is tracked, as
// a CUDA slab's is.
type fakeSlab struct {
	fakeDevMem
	prep slabPrep
}

func (m *fakeSlab) compatPrep() *slabPrep { return &m.prep }

// slabsOf is mems as the pool's regular slabs.
func slabsOf(mems ...gpubuf.Memory) []*gpubuf.Slab {
	out := make([]*gpubuf.Slab, len(mems))
	for i, m := range mems {
		out[i] = &gpubuf.Slab{Memory: m, Size: m.Size()}
	}
	return out
}

func newFakeSlab() *fakeSlab {
	return &fakeSlab{fakeDevMem: fakeDevMem{data: make([]byte, gpubuf.Align)}}
}

// fakeRegistrar is cuFileBufRegister: each registration waits for its
// slab's release (a channel the test closes) and answers its error.
type fakeRegistrar struct {
	mu      sync.Mutex
	calls   map[gpubuf.Memory]int           // GUARDED_BY(mu)
	release map[gpubuf.Memory]chan struct{} // GUARDED_BY(mu)
	started map[gpubuf.Memory]chan struct{} // GUARDED_BY(mu): closed when its registration began
	fail    map[gpubuf.Memory]error         // set before the slab is first routed
	began   chan gpubuf.Memory              // each registration as it begins
}

func newFakeRegistrar() *fakeRegistrar {
	return &fakeRegistrar{calls: map[gpubuf.Memory]int{}, release: map[gpubuf.Memory]chan struct{}{},
		fail: map[gpubuf.Memory]error{}, started: map[gpubuf.Memory]chan struct{}{}, began: make(chan gpubuf.Memory, 16)}
}

// gate returns m's release and started channels, creating them.
func (r *fakeRegistrar) gate(m gpubuf.Memory) (release, started chan struct{}) {
	r.mu.Lock()
	defer r.mu.Unlock()
	if r.release[m] == nil {
		r.release[m], r.started[m] = make(chan struct{}), make(chan struct{})
	}
	return r.release[m], r.started[m]
}

func (r *fakeRegistrar) register(m gpubuf.Memory) error {
	release, started := r.gate(m)
	r.mu.Lock()
	r.calls[m]++
	err := r.fail[m]
	r.mu.Unlock()
	close(started)
	r.began <- m
	<-release
	return err
}

func (r *fakeRegistrar) count(m gpubuf.Memory) int {
	r.mu.Lock()
	defer r.mu.Unlock()
	return r.calls[m]
}

// compatFirstEngines is the auto chooser of a GPU host without nvidia-fs
// with f registered (autoCompatEngines) and the slab preparer on fake
// registrations; log gets the preparer's messages.
func compatFirstEngines(t *testing.T, f *os.File, reg *fakeRegistrar, log *bytes.Buffer) *Engines {
	t.Helper()
	e := autoCompatEngines(t, f)
	e.compatPrep = newCompatPreparer(reg.register, zerolog.New(log))
	t.Cleanup(e.compatPrep.wait)
	return e
}

func cachedFile(t *testing.T, size int) *os.File {
	t.Helper()
	p := filepath.Join(t.TempDir(), "data")
	if err := os.WriteFile(p, make([]byte, size), 0o644); err != nil {
		t.Fatal(err)
	}
	f, err := os.Open(p)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { f.Close() })
	if _, ok := pagecache.Cached(f, 0, 1); !ok {
		t.Skip("kernel without cachestat(2)")
	}
	if _, err := f.ReadAt(make([]byte, size), 0); err != nil {
		t.Fatal(err)
	}
	return f
}

// TestCompatFirstTouchGoesToPosix: in auto mode without nvidia-fs, a
// cached range the chooser gives to cuFile compat mode is read by the
// posix engine while its destination slab is not registered with cuFile
// (compat's ~30 ms first touch), registration runs off the READ, once
// per slab, and compat takes the slab once it is registered; a READ into
// several slabs goes to posix while any of them is new.
func TestCompatFirstTouchGoesToPosix(t *testing.T) {
	const size = 1 << 20
	f := cachedFile(t, size)
	reg := newFakeRegistrar()
	var log bytes.Buffer
	e := compatFirstEngines(t, f, reg, &log)
	eng, why := e.ChooseAs(f, f.Name(), 0, size, nil)
	if _, gds := eng.(*fallbackEngine); !gds {
		t.Fatalf("cached range chosen as %s (%q), want cuFile compat mode", eng.Name(), why)
	}
	a, b := newFakeSlab(), newFakeSlab()
	route := func(mems ...gpubuf.Memory) Engine { return RouteFor(eng, slabsOf(mems...)) }

	if got := route(a); got != Engine(e.posix) {
		t.Fatalf("a READ into a fresh slab goes to %s, want posix", got.Name())
	}
	relA, startedA := reg.gate(a)
	<-startedA // registration runs without the READ waiting for it
	if got := route(a); got != Engine(e.posix) {
		t.Errorf("a READ while the slab registers goes to %s, want posix", got.Name())
	}
	close(relA)
	e.compatPrep.wait()
	if got := route(a); got != eng {
		t.Errorf("a READ into a registered slab goes to %s, want cuFile compat mode", got.Name())
	}
	if got := route(a, b, a); got != Engine(e.posix) {
		t.Errorf("a READ into a registered and a fresh slab goes to %s, want posix", got.Name())
	}
	relB, _ := reg.gate(b)
	close(relB)
	e.compatPrep.wait()
	if got := route(a, b); got != eng {
		t.Errorf("a READ into two registered slabs goes to %s, want cuFile compat mode", got.Name())
	}
	if reg.count(a) != 1 || reg.count(b) != 1 {
		t.Errorf("registrations: slab a %d, slab b %d; want one each", reg.count(a), reg.count(b))
	}
	// A dedicated slab (one lease larger than a regular slab, freed at
	// its release) goes to posix and is not registered.
	big := newFakeSlab()
	dedicated := []*gpubuf.Slab{{Memory: big, Size: big.Size(), Dedicated: true}}
	for range 2 {
		if got := RouteFor(eng, dedicated); got != Engine(e.posix) {
			t.Errorf("a READ into a dedicated slab goes to %s, want posix", got.Name())
		}
		if got := RouteFor(eng, append(slabsOf(a), dedicated...)); got != Engine(e.posix) {
			t.Errorf("a READ into a registered and a dedicated slab goes to %s, want posix", got.Name())
		}
	}
	e.compatPrep.wait()
	if n, st := reg.count(big), big.prep.state.Load(); n != 0 || st != prepNone {
		t.Errorf("a dedicated slab was registered (%d calls, state %d)", n, st)
	}
	if log.Len() != 0 {
		t.Errorf("successful registrations logged: %s", log.String())
	}
}

// TestCompatFirstTouchRegistrationFails: a slab cuFileBufRegister refuses
// stays with the posix engine (no retry, no compat read paying the first
// touch), the first failure is logged at warn and later ones at debug; a
// slab freed before its registration is not reported.
func TestCompatFirstTouchRegistrationFails(t *testing.T) {
	f := cachedFile(t, 1<<20)
	reg := newFakeRegistrar()
	var log bytes.Buffer
	e := compatFirstEngines(t, f, reg, &log)
	eng, _ := e.ChooseAs(f, f.Name(), 0, -1, nil)
	bad1, bad2, closed := newFakeSlab(), newFakeSlab(), newFakeSlab()
	reg.fail[bad1] = &FileError{Op: "cuFileBufRegister", Code: 5016}
	reg.fail[bad2] = &FileError{Op: "cuFileBufRegister", Code: 5016}
	reg.fail[closed] = errMemoryClosed
	for _, m := range []gpubuf.Memory{bad1, bad2, closed} {
		rel, _ := reg.gate(m)
		close(rel)
		for range 3 {
			if got := RouteFor(eng, slabsOf(m)); got != Engine(e.posix) {
				t.Fatalf("a READ into a slab registration refused goes to %s, want posix", got.Name())
			}
			e.compatPrep.wait()
		}
		if n := reg.count(m); n != 1 {
			t.Errorf("refused slab registered %d times, want once", n)
		}
	}
	lines := strings.Split(strings.TrimSpace(log.String()), "\n")
	if len(lines) != 2 || !strings.Contains(lines[0], `"level":"warn"`) || !strings.Contains(lines[1], `"level":"debug"`) ||
		!strings.Contains(lines[0], "5016") {
		t.Errorf("log %q: want one warn and one debug line naming the error, none for the closed slab", lines)
	}
}

// TestCompatFirstTouchOnlyWhereItApplies: everything else routes nowhere
// and registers nothing: the posix and host engines, the gds engine with
// nvidia-fs or with --engine gds (no preparer), and memory whose
// preparation is not tracked.
func TestCompatFirstTouchOnlyWhereItApplies(t *testing.T) {
	f := cachedFile(t, 1<<20)
	reg := newFakeRegistrar()
	var log bytes.Buffer
	auto := compatFirstEngines(t, f, reg, &log)
	gdsEng, _ := auto.ChooseAs(f, f.Name(), 0, -1, nil)
	noPrep := autoCompatEngines(t, f) // nvidia-fs, or --engine gds: compatPrep nil
	k, _ := keyOf(f)
	plain := &fakeDevMem{data: make([]byte, gpubuf.Align)}
	slab := newFakeSlab()
	for _, tc := range []struct {
		name string
		eng  Engine
		mem  gpubuf.Memory
	}{
		{"posix", auto.posix, slab},
		{"host", NewHostEngine(Options{}), slab},
		{"gds without a preparer", noPrep.files[k].engine, slab},
		{"untracked memory", gdsEng, plain},
	} {
		if got := RouteFor(tc.eng, slabsOf(tc.mem)); got != tc.eng {
			t.Errorf("%s: routed to %s", tc.name, got.Name())
		}
	}
	big := []*gpubuf.Slab{{Memory: slab, Size: slab.Size(), Dedicated: true}}
	for _, eng := range []Engine{auto.posix, noPrep.files[k].engine} {
		if got := RouteFor(eng, big); got != eng {
			t.Errorf("%s: a dedicated slab routed to %s", eng.Name(), got.Name())
		}
	}
	auto.compatPrep.wait()
	if reg.count(slab) != 0 || slab.prep.state.Load() != prepNone {
		t.Errorf("a slab no compat READ met was registered (%d calls, state %d)", reg.count(slab), slab.prep.state.Load())
	}
}

// TestEnginesCloseWaitsForRegistrations: Close returns only after the
// registrations in flight finished (none outlives the engines).
func TestEnginesCloseWaitsForRegistrations(t *testing.T) {
	f := cachedFile(t, 1<<20)
	reg := newFakeRegistrar()
	var log bytes.Buffer
	e := compatFirstEngines(t, f, reg, &log)
	eng, _ := e.ChooseAs(f, f.Name(), 0, -1, nil)
	m := newFakeSlab()
	RouteFor(eng, slabsOf(m))
	rel, started := reg.gate(m)
	<-started
	closed := make(chan error, 1)
	go func() { closed <- e.Close() }()
	select {
	case <-closed:
		t.Fatal("Close returned while a registration was in flight")
	default:
	}
	close(rel)
	if err := <-closed; err != nil {
		t.Fatal(err)
	}
	if st := m.prep.state.Load(); st != prepReady {
		t.Errorf("after Close the registration's state is %d, want ready (%d): Close returned before it finished", st, prepReady)
	}
}

// TestCompatFirstTouchRegistrationsBounded: a fresh daemon's first load
// meets many new slabs at once; at most compatPrepParallel registrations
// run together, and the others start as those end.
func TestCompatFirstTouchRegistrationsBounded(t *testing.T) {
	f := cachedFile(t, 1<<20)
	reg := newFakeRegistrar()
	var log bytes.Buffer
	e := compatFirstEngines(t, f, reg, &log)
	eng, _ := e.ChooseAs(f, f.Name(), 0, -1, nil)
	slabs := make([]gpubuf.Memory, compatPrepParallel+2)
	for i := range slabs {
		slabs[i] = newFakeSlab()
	}
	if got := RouteFor(eng, slabsOf(slabs...)); got != Engine(e.posix) {
		t.Fatalf("a READ into new slabs goes to %s, want posix", got.Name())
	}
	var running []gpubuf.Memory
	for range compatPrepParallel {
		running = append(running, <-reg.began)
	}
	select {
	case m := <-reg.began:
		t.Fatalf("registration %d began while %d ran (%p)", compatPrepParallel+1, compatPrepParallel, m)
	default:
	}
	for done := 0; done < len(slabs); done++ {
		m := running[0]
		running = running[1:]
		rel, _ := reg.gate(m)
		close(rel)
		if done+compatPrepParallel < len(slabs) {
			running = append(running, <-reg.began)
		}
	}
	e.compatPrep.wait()
	if got := RouteFor(eng, slabsOf(slabs...)); got != eng {
		t.Errorf("after every registration a READ into the slabs goes to %s, want cuFile compat mode", got.Name())
	}
	for i, m := range slabs {
		if n := reg.count(m); n != 1 {
			t.Errorf("slab %d registered %d times, want once", i, n)
		}
	}
}

// TestSlabRegistrationLeavesExportsFree: a slab's registration in the
// background holds the lock Close takes (the memory is never freed under
// it) but not the one its export takes (the slab socket handing a client
// the slab's descriptor right after the READ that met it); a closed slab
// is not registered.
func TestSlabRegistrationLeavesExportsFree(t *testing.T) {
	m := &cudaMemory{size: gpubuf.Align}
	lib := &Lib{}
	inCall, release := make(chan struct{}), make(chan struct{})
	done := make(chan error, 1)
	go func() {
		done <- m.registerWith(lib, func() error { close(inCall); <-release; return nil })
	}()
	<-inCall
	if !m.mu.TryLock() {
		t.Error("a registration in flight holds the lock exports take")
	} else {
		m.mu.Unlock()
	}
	if m.regMu.TryLock() {
		m.regMu.Unlock()
		t.Error("a registration in flight does not hold the lock Close takes")
	}
	close(release)
	if err := <-done; err != nil {
		t.Fatal(err)
	}
	if err := m.registerWith(lib, func() error { t.Error("registered twice"); return nil }); err != nil {
		t.Errorf("second registration: %v", err)
	}
	c := &cudaMemory{size: gpubuf.Align, closed: true}
	if err := c.registerWith(lib, func() error { t.Error("closed memory registered"); return nil }); !errors.Is(err, errMemoryClosed) {
		t.Errorf("registering closed memory: %v, want errMemoryClosed", err)
	}
	failing := &cudaMemory{size: gpubuf.Align}
	bar1 := &FileError{Op: "cuFileBufRegister", Code: 5016}
	for range 2 {
		if err := failing.registerWith(lib, func() error { return bar1 }); !errors.Is(err, bar1) {
			t.Errorf("a refused registration answered %v, want %v (and not retried)", err, bar1)
		}
	}
	already := &cudaMemory{size: gpubuf.Align}
	if err := already.registerWith(lib, func() error { return &FileError{Code: fileMemoryAlreadyReg} }); err != nil || already.registered != lib {
		t.Errorf("memory cuFile had registered already: %v, registered %v", err, already.registered != nil)
	}
}

// TestBufRegisterNeedsCUDAMemory: the production registration refuses
// memory that is not a CUDA slab with an error (the slab then stays with
// posix) rather than panicking.
func TestBufRegisterNeedsCUDAMemory(t *testing.T) {
	if err := bufRegister(&Lib{})(&fakeDevMem{data: make([]byte, gpubuf.Align)}); err == nil {
		t.Error("registering memory that is not a CUDA slab succeeded")
	}
}
