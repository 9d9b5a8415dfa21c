package cufile

import (
	"errors"
	"runtime"
	"strings"
	"sync"
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
// with a READ, but at most poolThreads(workers) of them ever happen. A
// transfer hands out up to workers tickets to free pool threads (each
// takes chunks from the transfer until none are left, as runChunks's
// goroutines do) and waits for the ones taken. A thread makes a device's
// context current only when its ticket's device differs from the one it
// made current last. GDSFS_CUFILE_POOL=0 in the daemon's environment,
// read when the engine is built, restores the per-transfer workers (the
// A/B of GPU-RUN.txt).

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

// threadPool is a fixed set of goroutines, each locked to its OS thread
// for the pool's life, moving transfers' chunks.
type threadPool struct {
	size    int
	bind    func(device int) error // makes device's context current on the calling thread
	tickets chan *poolTask         // unbuffered: a send is a thread taking the ticket
	quit    chan struct{}          // closed by close

	startOnce sync.Once
	closeOnce sync.Once
	threads   sync.WaitGroup
}

// newThreadPool returns a pool of size threads that make a device current
// with bind. Its threads start with its first transfer.
func newThreadPool(size int, bind func(device int) error) *threadPool {
	return &threadPool{size: max(1, size), bind: bind, tickets: make(chan *poolTask), quit: make(chan struct{})}
}

// poolTask is one transfer on the pool.
type poolTask struct {
	run    *chunkRun
	device int
	move   func(c chunk) (int64, error)

	taken     sync.WaitGroup // tickets a thread took and has not finished
	drained   chan struct{}  // closed when a thread leaves the run: no more tickets are needed
	drainOnce sync.Once
}

// leave ends a thread's ticket of t.
func (t *poolTask) leave() {
	t.drainOnce.Do(func() { close(t.drained) })
	t.taken.Done()
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
					t.leave()
					continue
				}
				current = t.device
			}
			t.run.work(funcWorker{doFn: t.move})
			t.leave()
		}
	}
}

// run moves r's chunks on device with move, on up to workers pool threads,
// and returns what runChunks returns: r's complete prefix, or its first
// error (ctx.Err() once r's context ends: its chunks not handed out yet are
// not moved; errEngineClosed once the pool is closed).
func (p *threadPool) run(r *chunkRun, device int, workers int, move func(c chunk) (int64, error)) (int64, error) {
	if r.n == 0 {
		return 0, r.ctx.Err()
	}
	p.start(nil)
	t := &poolTask{run: r, device: device, move: move, drained: make(chan struct{})}
	ctx := r.ctx
send:
	for range r.workers(workers) {
		if err := ctx.Err(); err != nil {
			r.fail(err)
			break
		}
		t.taken.Add(1)
		select {
		case p.tickets <- t:
			continue
		case <-t.drained:
		case <-ctx.Done():
			r.fail(ctx.Err())
		case <-p.quit:
			r.fail(errEngineClosed)
		}
		t.taken.Done()
		break send
	}
	t.taken.Wait()
	return r.result()
}

// closed reports whether close was called.
func (p *threadPool) closed() bool {
	select {
	case <-p.quit:
		return true
	default:
		return false
	}
}

// close stops the pool and waits for its threads: a ticket taken before
// runs to its end. Transfers waiting for a thread answer errEngineClosed.
func (p *threadPool) close() {
	p.startOnce.Do(func() {}) // a pool never started stays so
	p.closeOnce.Do(func() { close(p.quit) })
	p.threads.Wait()
}
