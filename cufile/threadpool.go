package cufile

import (
	"errors"
	"runtime"
	"strings"
	"sync"
	"sync/atomic"
	"time"
)

// The gds engine's cuFile calls run on a fixed pool of OS threads.
//
// cuFileRead and cuFileWrite run on an OS thread with the slab's device
// context current. Before the pool, each transfer started its own workers
// (runChunks), each locking an OS thread and making the context current;
// a DCP load issues several READs at once, each of many ranges, so Go
// created a thread for each worker locked at the same time (104 threads
// for 32 concurrent transfers of 4 workers in TestGDSPoolThreads) and
// cuFile met new threads throughout a fresh daemon's first loads. A fresh
// daemon's first warm DCP load of 4 GiB ran 0.64 s slower than its later
// ones with no slab registration or allocation left in it (H200, compat
// mode, 2026-12-02 02:34 UTC); TestGPUCompatFirstTouch's per-thread step
// times what a thread's first cuCtxSetCurrent and cuFileRead cost.
//
// With the pool, the threads that ever call cuFileRead/cuFileWrite are
// poolThreads(workers) goroutines locked to their threads for the
// engine's life. The daemon starts them when it builds its engines
// (prime), each making every device's context current once, outside any
// READ; an engine nobody primed starts them on its first transfer. No
// file is read to prime them, so a thread's first cuFileRead still comes
// with a READ, but at most poolThreads(workers) of them ever happen while
// every transfer finds a thread within spillAfter. A transfer keeps up to
// workers tickets out at a time; a ticket is one chunk, so the thread
// that took it comes back for the next ticket of whichever transfer has
// waited longest (one user's huge READs hold no thread longer than a
// chunk, TestGDSPoolTakesTurns). A transfer that waits spillAfter for a
// thread (every pool thread in cuFileReads that do not return: a file on
// a hung filesystem, TestGDSPoolStuckCallerStarvesNoOne) moves the rest
// of its chunks on threads of its own, the per-transfer way, so no READ
// waits on another's stuck ones longer than that. A thread makes a
// device's context current only when its ticket's device differs from
// the one it made current last. GDSFS_CUFILE_POOL=0 in the daemon's environment,
// read when the engine is built, restores the per-transfer workers (the
// A/B of docs/gpu-pending.md).

// poolEnv names the environment variable that turns the pool off ("0").
const poolEnv = "GDSFS_CUFILE_POOL"

// poolEnabled reports whether v, the value of GDSFS_CUFILE_POOL, leaves
// the pool on: everything but 0, off, false and no (the default: on).
func poolEnabled(v string) bool {
	switch strings.ToLower(strings.TrimSpace(v)) {
	case "0", "off", "false", "no":
		return false
	}
	return true
}

// poolThreads is the pool's size for an engine of workers workers per
// transfer: twice that, so two transfers run at full width at once (a DCP
// load keeps several READs in flight, and one transfer's tail leaves
// threads for the next) while the thread count stays fixed. More threads
// than that only contend: DefaultWorkers already stops at 16 for that
// reason, so 32 threads on the largest hosts.
func poolThreads(workers int) int { return 2 * max(1, workers) }

// errEngineClosed answers a transfer on a closed gds engine.
var errEngineClosed = errors.New("cufile: the gds engine is closed (the daemon is shutting down)")

// spillAfter is how long a transfer waits for a pool thread before it
// moves the rest of its chunks on threads of its own, as every transfer
// did before the pool. Pool threads take chunks in turn, so a healthy pool
// hands a waiting transfer a thread within one chunk's time over the
// pool's width (an 8 MiB chunk takes a few ms); a pool whose every thread
// is held by cuFileReads that do not return (a file on a hung filesystem,
// a READ of another user's) must not hold up the READs of everyone else.
const spillAfter = 100 * time.Millisecond

// threadPool is a fixed set of goroutines, each locked to its OS thread
// for the pool's life, moving transfers' chunks.
type threadPool struct {
	size    int
	bind    func(device int) error // makes device's context current on the calling thread
	tickets chan *poolTask         // unbuffered: a send is a thread taking the ticket
	quit    chan struct{}          // closed by close
	// spillAfter: how long a ticket waits for a pool thread before the
	// transfer spills (the constant; tests change it).
	spillAfter time.Duration
	// queued counts the transfers waiting for a pool thread now (the
	// tests wait on it: a state, not a time).
	queued atomic.Int64

	startOnce sync.Once
	closeOnce sync.Once
	threads   sync.WaitGroup

	mu      sync.Mutex
	closing bool           // GUARDED_BY(mu): close was called; no transfer starts
	active  sync.WaitGroup // transfers in run (Add under mu while !closing); close waits for them
}

// newThreadPool returns a pool of size threads that make a device current
// with bind. Its threads start with its first transfer.
func newThreadPool(size int, bind func(device int) error) *threadPool {
	return &threadPool{size: max(1, size), bind: bind, tickets: make(chan *poolTask), quit: make(chan struct{}), spillAfter: spillAfter}
}

// poolTask is one transfer on the pool. A ticket is one chunk: the thread
// that takes it moves the next chunk of the run and gives the ticket back,
// so that transfers waiting for a thread (first come, first served: the
// order of a channel's blocked senders) get one at the next chunk that
// ends anywhere, not when a transfer holding threads has moved all of its
// chunks.
type poolTask struct {
	run    *chunkRun
	device int
	move   func(c chunk) (int64, error)
	back   chan struct{} // a ticket taken (or a spilled worker) ended; room for every one out
}

// start starts the pool's threads unless they run: each makes the
// contexts of devices prime current in turn, the first last, before
// serving tickets, and start returns once they have.
func (p *threadPool) start(prime []int) {
	p.startOnce.Do(func() {
		var primed sync.WaitGroup
		primed.Add(p.size)
		p.threads.Add(p.size)
		for range p.size {
			go p.thread(prime, &primed)
		}
		primed.Wait()
	})
}

// thread serves tickets until the pool closes. Its goroutine stays locked
// to its OS thread, so Go ends the thread with it.
func (p *threadPool) thread(prime []int, primed *sync.WaitGroup) {
	defer p.threads.Done()
	runtime.LockOSThread()
	current := -1 // the device made current on this thread; -1: none known
	for i := len(prime) - 1; i >= 0; i-- {
		current = prime[i]
		if p.bind(prime[i]) != nil { // a transfer on it tries again and reports
			current = -1
		}
	}
	primed.Done()
	for {
		select {
		case <-p.quit:
			return
		case t := <-p.tickets:
			if t.device != current {
				if err := p.bind(t.device); err != nil {
					current = -1
					t.run.fail(err)
					t.back <- struct{}{}
					continue
				}
				current = t.device
			}
			t.run.step(funcWorker{doFn: t.move})
			t.back <- struct{}{}
		}
	}
}

// spill starts a goroutine of t's own that locks an OS thread, makes t's
// device current and moves t's chunks until none are left (runChunks's
// way), then gives its ticket back.
func (p *threadPool) spill(t *poolTask) {
	go func() {
		runtime.LockOSThread()
		if err := p.bind(t.device); err != nil {
			t.run.fail(err)
		} else {
			t.run.work(funcWorker{doFn: t.move})
		}
		runtime.UnlockOSThread()
		t.back <- struct{}{}
	}()
}

// run moves r's chunks on device with move, on up to workers pool threads
// at a time, and returns what runChunks returns: r's complete prefix, or
// its first error (ctx.Err() once r's context ends: its chunks not handed
// out yet are not moved; errEngineClosed once the pool is closing: a
// transfer begun before close runs to its end). When no pool thread takes
// one of its tickets within spillAfter, the rest of its workers run on
// threads of their own.
func (p *threadPool) run(r *chunkRun, device int, workers int, move func(c chunk) (int64, error)) (int64, error) {
	if r.n == 0 {
		return 0, r.ctx.Err()
	}
	p.mu.Lock()
	if p.closing {
		p.mu.Unlock()
		return 0, errEngineClosed
	}
	p.active.Add(1)
	p.mu.Unlock()
	defer p.active.Done()
	p.start(nil)
	width := r.workers(workers)
	t := &poolTask{run: r, device: device, move: move, back: make(chan struct{}, width)}
	ctx := r.ctx
	out := 0 // tickets taken and spilled workers, not back yet
	wait := time.NewTimer(p.spillAfter)
	defer wait.Stop()
hand:
	for r.pending() {
		if out == width {
			<-t.back
			out--
			continue
		}
		// Each wait for a thread has its own spillAfter (Go 1.23's
		// timers: a Reset timer sends nothing from before).
		wait.Reset(p.spillAfter)
		p.queued.Add(1)
		select {
		case p.tickets <- t:
			p.queued.Add(-1)
			out++
			continue
		case <-t.back:
			p.queued.Add(-1)
			out--
			continue
		case <-wait.C:
			p.queued.Add(-1)
			for ; out < width; out++ {
				p.spill(t)
			}
		case <-ctx.Done():
			p.queued.Add(-1)
			r.fail(ctx.Err())
		}
		break hand
	}
	for ; out > 0; out-- {
		<-t.back
	}
	return r.result()
}

// closed reports whether close was called.
func (p *threadPool) closed() bool {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.closing
}

// close refuses new transfers (errEngineClosed), waits for those begun
// before to end (their spilled workers included), then stops the pool's
// threads and waits for them.
func (p *threadPool) close() {
	p.mu.Lock()
	p.closing = true
	p.mu.Unlock()
	p.active.Wait()
	p.startOnce.Do(func() {}) // a pool never started stays so
	p.closeOnce.Do(func() { close(p.quit) })
	p.threads.Wait()
}
