package cufile

import (
	"errors"
	"sync"
	"sync/atomic"

	"github.com/rs/zerolog"

	"github.com/gdsfs/gdsfs/gpubuf"
)

// cuFile compat mode's first touch of each device allocation.
//
// Measured on an H200 without nvidia-fs (TestGPUFirstReadsOfCachedFiles,
// docs/benchmarks.md "Runs of 2026-12-01 21:55 and 22:05"): the first
// cuFile read into each new slab costs about 30 ms whatever its size (4
// KiB into a fresh slab: 32 ms with compat mode, 0.2 ms with the posix
// engine; the same slab again 21-36 GB/s), so the first warm load of a
// fresh daemon, whose READs land in new 64 MiB slabs, ran at 2.3 GB/s
// instead of 30. The gds engine registers a slab with cuFile
// (cuFileBufRegister) on its first read into it, inside that read.
//
// So in auto mode without nvidia-fs (compatWarm) the gds engine takes a
// READ only into slabs already prepared for it: registered with cuFile in
// the background, off any READ's path. A READ into a slab compat has not
// been prepared for goes to the posix engine (24-44 GB/s on cached
// ranges) and starts that slab's preparation; once it is done, compat
// takes the slab's later READs. Preparation writes nothing into the slab
// (registration only), so it is safe while the slab holds leases. A slab
// whose registration fails stays with posix. Slabs belong to one uid for
// life (gpubuf), and preparation starts on a READ the chooser gave to
// compat, which it does only for a caller told the range's residency: so
// a slab's state says nothing a caller was not already told.

// MemoryRouter is implemented by an engine that sends some reads to
// another engine depending on their destination memory (the gds engine
// in auto mode without nvidia-fs: slabs compat mode has not been prepared
// for go to posix). The control path asks it once per READ, after the
// READ's leases are allocated, and names the engine it answers in the
// reply.
type MemoryRouter interface {
	// RouteFor returns the engine that serves a read into every one of
	// slabs, or nil when the router serves it itself.
	RouteFor(slabs []*gpubuf.Slab) Engine
}

// Preparation states of one allocation (slabPrep.state).
const (
	prepNone    int32 = iota // compat mode has not been prepared for it
	prepRunning              // registration in flight
	prepReady                // registered: compat reads into it without the first-touch cost
	prepFailed               // registration failed: posix serves it
)

// slabPrep is one allocation's preparation for compat mode.
type slabPrep struct{ state atomic.Int32 }

// compatPrepared is device memory whose preparation is tracked
// (*cudaMemory and *vmmMemory).
type compatPrepared interface {
	compatPrep() *slabPrep
}

// compatPrep implements compatPrepared.
func (m *cudaMemory) compatPrep() *slabPrep { return &m.prep }

// errMemoryClosed is registration's answer for memory closed first.
var errMemoryClosed = errors.New("cufile: memory closed")

// compatPreparer registers slabs with cuFile in the background for
// compat mode. Safe for concurrent use.
type compatPreparer struct {
	// register registers m with cuFile; *cudaMemory.register in
	// production, a fake in the CPU tests.
	register func(m gpubuf.Memory) error
	log      zerolog.Logger

	slots  chan struct{} // one per registration running at once
	wg     sync.WaitGroup
	warned atomic.Bool // a failed registration was logged at warn level
}

// compatPrepParallel is the most registrations that run at once: a
// fresh daemon's first load allocates a slab every few milliseconds, and
// its READs (posix meanwhile) share the driver with them.
const compatPrepParallel = 2

// newCompatPreparer returns a preparer whose registrations call register.
func newCompatPreparer(register func(gpubuf.Memory) error, log zerolog.Logger) *compatPreparer {
	return &compatPreparer{register: register, log: log, slots: make(chan struct{}, compatPrepParallel)}
}

// bufRegister registers m with lib (*cudaMemory.register): the
// production registration of newCompatPreparer.
func bufRegister(lib *Lib) func(gpubuf.Memory) error {
	return func(m gpubuf.Memory) error {
		r, ok := m.(interface{ register(*Lib) error })
		if !ok {
			return errors.New("cufile: memory cannot be registered with cuFile")
		}
		return r.register(lib)
	}
}

// ready reports whether compat mode may read into m without paying its
// first touch, and starts m's preparation when it has not started.
// Memory whose preparation is not tracked (not CUDA slabs) is ready: no
// change from before.
func (p *compatPreparer) ready(m gpubuf.Memory) bool {
	cp, ok := m.(compatPrepared)
	if !ok {
		return true
	}
	s := cp.compatPrep()
	switch s.state.Load() {
	case prepReady:
		return true
	case prepNone:
		p.start(m, s)
	}
	return false
}

// start registers m in the background, once.
func (p *compatPreparer) start(m gpubuf.Memory, s *slabPrep) {
	if !s.state.CompareAndSwap(prepNone, prepRunning) {
		return
	}
	p.wg.Add(1)
	go func() {
		defer p.wg.Done()
		p.slots <- struct{}{}
		err := p.register(m)
		<-p.slots
		if err == nil {
			s.state.Store(prepReady)
			return
		}
		s.state.Store(prepFailed)
		if errors.Is(err, errMemoryClosed) {
			return // freed before its turn: nothing to report
		}
		ev := p.log.Debug()
		if p.warned.CompareAndSwap(false, true) {
			ev = p.log.Warn()
		}
		ev.Err(err).Int64("bytes", m.Size()).Msg("cufile: cuFileBufRegister failed on a slab: the posix engine serves it (cuFile compat mode would pay its first touch; logged once at warn)")
	}()
}

// wait waits for the registrations in flight.
func (p *compatPreparer) wait() { p.wg.Wait() }

// RouteFor implements MemoryRouter: in auto mode without nvidia-fs, a
// read into any slab compat mode has not been prepared for goes to the
// posix engine (see the top of this file), and so does a read into a
// dedicated slab (one lease larger than a regular slab, freed at its
// release: compat would pay its first touch for that one READ, and
// registering it would only delay the release); otherwise, and with any
// other configuration, nil (the gds engine serves it, as before).
func (f *fallbackEngine) RouteFor(slabs []*gpubuf.Slab) Engine {
	p := f.e.compatPrep
	if p == nil {
		return nil
	}
	route := false
	for _, s := range slabs {
		// Every one is asked, so that every new slab's preparation starts.
		if s.Dedicated || !p.ready(s.Memory) {
			route = true
		}
	}
	if route {
		return f.e.posix
	}
	return nil
}

var _ MemoryRouter = (*fallbackEngine)(nil)

// RouteFor returns the engine that serves a read by e into slabs: e's
// MemoryRouter answer, or e itself.
func RouteFor(e Engine, slabs []*gpubuf.Slab) Engine {
	if r, ok := e.(MemoryRouter); ok {
		if to := r.RouteFor(slabs); to != nil {
			return to
		}
	}
	return e
}
