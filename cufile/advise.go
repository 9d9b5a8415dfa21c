package cufile

import (
	"os"
	"sync"
	"sync/atomic"

	"golang.org/x/sys/unix"
)

// coldAdvisor keeps the disk's queue full under a buffered read of a cold
// range. Each worker's pread of a cold task waits for that task's bytes
// alone (the kernel's readahead submits at most the request, capped by the
// device's largest I/O), so a buffered cold read keeps Workers tasks of
// ColdTaskBytes in flight where an O_DIRECT one keeps Workers chunks of
// ChunkBytes. The advisor asks the kernel for the tasks ahead of the
// workers (posix_fadvise WILLNEED submits the reads and returns), at most
// ahead bytes beyond the tasks finished, so the read still fills the page
// cache (a second read is warm) at the queue depth of an O_DIRECT read.
type coldAdvisor struct {
	finished atomic.Int64  // tasks the workers finished
	wake     chan struct{} // a task finished (capacity 1)
	done     chan struct{}
	wg       sync.WaitGroup
}

// adviseAhead starts calling advise for the tasks of task bytes of
// [off, off+n) in order, at most ahead bytes (rounded down to whole tasks,
// at least one) past the tasks reported finished, skipping the tasks the
// workers finished before it reached them (the workers take tasks in
// order, so the count finished is where they are). The caller reports each
// finished task with taskDone and calls stop before the file may be closed.
func adviseAhead(off, n, task, ahead int64, advise func(off, n int64)) *coldAdvisor {
	count := (n + task - 1) / task
	window := max(1, ahead/task)
	a := &coldAdvisor{wake: make(chan struct{}, 1), done: make(chan struct{})}
	a.wg.Go(func() {
		for k := int64(0); ; k++ {
			if k = max(k, a.finished.Load()); k >= count {
				return
			}
			for k >= a.finished.Load()+window {
				select {
				case <-a.wake:
				case <-a.done:
					return
				}
			}
			select {
			case <-a.done:
				return
			default:
			}
			at := off + k*task
			advise(at, min(task, off+n-at))
		}
	})
	return a
}

// taskDone reports one task finished, making room for one more advised
// task. Safe on a nil advisor.
func (a *coldAdvisor) taskDone() {
	if a == nil {
		return
	}
	a.finished.Add(1)
	select {
	case a.wake <- struct{}{}:
	default: // a wake-up is already pending
	}
}

// stop ends the advice and waits for the advising goroutine. Safe on nil.
func (a *coldAdvisor) stop() {
	if a == nil {
		return
	}
	close(a.done)
	a.wg.Wait()
}

// coldAdvice returns the advisor for a read of [off, off+n) of f in tasks
// of task bytes, or nil when there is nothing to advise: an O_DIRECT read,
// a range read in whole chunks (cached, or too short to split), or advice
// not asked for (ColdReadAheadBytes 0, the default).
func (opts Options) coldAdvice(f *os.File, direct bool, off, n, task int64) *coldAdvisor {
	if direct || opts.ColdReadAheadBytes == 0 || task >= opts.ChunkBytes || n <= task {
		return nil
	}
	ahead := opts.ColdReadAheadBytes
	if ahead < 0 {
		ahead = int64(opts.Workers) * opts.ChunkBytes
	}
	fd := int(f.Fd())
	return adviseAhead(off, n, task, ahead, func(off, n int64) {
		if opts.cold.crowded(opts) {
			return // the reads in flight keep the queue full (coldReads.crowded)
		}
		// Advice only: a refusal leaves the workers' own preads to read it.
		_ = unix.Fadvise(fd, off, n, unix.FADV_WILLNEED)
	})
}
