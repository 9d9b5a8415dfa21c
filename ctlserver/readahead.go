package ctlserver

import (
	"context"
	"os"
	"sync"
	"sync/atomic"

	"github.com/gdsfs/gdsfs/cufile"
	"github.com/gdsfs/gdsfs/internal/pagecache"
	"github.com/gdsfs/gdsfs/internal/readahead"
)

// readaheadJobs bounds the readahead jobs in flight. A job reads one open
// file's windows in turn (at most about two of the policy's largest window
// ahead of its READs), so jobs are streams being read ahead: a window of a
// stream whose job runs joins that job; a new stream's window past the
// bound is dropped, readahead being a hint, and asked for again by its
// next READ.
const readaheadJobs = 16

// readaheadJobsPerUID bounds one uid's readahead jobs in flight, so that
// one user's many streams of a slow disk leave the others readahead jobs.
const readaheadJobsPerUID = readaheadJobs / 2

// probeBytes is how much of each end of a readahead range is measured: a
// range whose two ends are cached is taken as cached (warm data costs two
// cachestat calls of a few pages, not a walk of the whole window).
const probeBytes = 256 << 10

// readaheads is the control path's readahead (package internal/readahead):
// READs of small ranges are buffered preads, which get no kernel
// readahead worth the name (the next READ comes after the client has
// worked through the batch), so a sequential run of READs on one open
// file reads its next window into the page cache while the client works.
type readaheads struct {
	t      *readahead.Tracker[*os.File]
	fills  pagecache.Fills
	fill   func(ctx context.Context, f *os.File, off, n int64) (int64, error) // fills.Fill; tests block it
	jobs   chan struct{}
	mu     sync.Mutex
	perUID map[uint32]int // GUARDED_BY(mu): jobs in flight per uid
	// running is each open file's job in flight: a stream has at most
	// one, which reads the windows its later READs ask for after the one
	// it reads (one sequential reader of the file, never a job dropped
	// because the stream's previous window is still being read).
	running map[*os.File]*fillJob // GUARDED_BY(mu)
	// refused is the uids a window of which was dropped because every
	// job was in flight (not for their own share): a job of a uid holding
	// more jobs than one of them ends at its window's end and leaves the
	// job to it, so that two uids' long runs do not keep every job for
	// as long as they read.
	refused map[uint32]struct{} // GUARDED_BY(mu)
	// figures are each uid's own counts (what a uid's STATUS shows):
	// windows its sequential runs asked for, whether or not they needed
	// reading, so that they never depend on the page cache's residency of
	// the files read (see count).
	figures map[uint32]*uidReadahead // GUARDED_BY(mu)
	wg      sync.WaitGroup           // jobs in flight (tests wait on it)
	ctx     context.Context
	cancel  context.CancelFunc // stop: the Server closes

	started, dropped, failed atomic.Int64 // jobs
	bytes                    atomic.Int64 // asked to read ahead
}

// fillJob is the job in flight of one open file: the windows asked for
// since it started, read in turn after the one it reads.
type fillJob struct {
	uid     uint32
	pending []readahead.Range // GUARDED_BY(readaheads.mu)
}

// uidReadahead is one uid's readahead figures.
type uidReadahead struct {
	windows, bytes, dropped uint64
}

// readaheadUIDs bounds the uids whose own figures are kept; the figures of
// further uids count in the totals only (their STATUS shows zeros).
const readaheadUIDs = 4096

func newReadaheads(c readahead.Config) *readaheads {
	ctx, cancel := context.WithCancel(context.Background())
	ra := &readaheads{t: readahead.NewTracker[*os.File](c), jobs: make(chan struct{}, readaheadJobs), perUID: map[uint32]int{}, running: map[*os.File]*fillJob{}, refused: map[uint32]struct{}{}, figures: map[uint32]*uidReadahead{}, ctx: ctx, cancel: cancel}
	ra.fill = ra.fills.Fill
	return ra
}

// FileClosed implements fs.FileCloser: the open f was released, so its
// stream is forgotten (kept, a stream closed mid-file would count as
// reading ahead, and share its uid's --readahead, until a full table
// evicted it).
func (s *Server) FileClosed(f *os.File) {
	if s.ra != nil {
		s.ra.t.Forget(f)
	}
}

// stop ends the jobs in flight (each after at most one more read) and
// waits for them; later READs start none.
func (ra *readaheads) stop() {
	if ra == nil {
		return
	}
	ra.cancel()
	ra.wg.Wait()
}

// afterRead records a READ of plan of f (size bytes), served by eng, and
// starts reading the window after it into the page cache when the READ
// continues a sequential run. Only f is read ahead: the caller's own open
// of the file, which the READ was checked to be allowed to read. Keyed by
// f, so one open's run never reads ahead another's file. fromTier: the
// memory tier served the READ, for a caller not told so (eng is the engine
// it was told): its run and figures go on as eng's would, and the window,
// which the tier holds, is not read (as one already cached).
func (ra *readaheads) afterRead(uid uint32, f *os.File, eng cufile.Engine, plan []span, size int64, fromTier bool) {
	if ra == nil || ra.t.Config().Off() {
		return
	}
	lo, hi, longest := extent(plan)
	if lo < 0 {
		return
	}
	br, ok := cufile.BufferedReaderOf(eng)
	if !ok || !br.ReadsBuffered(longest, size) {
		// Direct reads (or a tier hit) do not use the page cache: a
		// window read into it would be read twice.
		ra.t.Forget(f)
		return
	}
	r := ra.t.ReadAs(f, uid, lo, min(hi, size), size)
	if r.Len() == 0 || ra.ctx.Err() != nil {
		return
	}
	// Counted for uid before residency is measured: a uid's own figures
	// must not say what is cached of a file the kernel would not tell it.
	ra.note(uid, func(u *uidReadahead) { u.windows++; u.bytes += uint64(r.Len()) })
	if fromTier || cached(f, r) {
		return
	}
	if ra.queue(f, r) {
		return // after the window this open's job reads now
	}
	if !ra.take(uid) {
		// Enough in flight: a hint, dropped, and given back to the
		// stream, whose next READ asks for it again (a window dropped
		// for good would leave its READs to meet the cold disk).
		ra.t.Unread(f, r)
		ra.dropped.Add(1)
		ra.note(uid, func(u *uidReadahead) { u.dropped++ })
		return
	}
	job := &fillJob{uid: uid}
	ra.mu.Lock()
	ra.running[f] = job
	ra.mu.Unlock()
	ra.started.Add(1)
	ra.bytes.Add(r.Len())
	ra.wg.Add(1)
	go func() {
		defer ra.wg.Done()
		defer ra.give(uid)
		for ok := true; ok; r, ok = ra.next(f, job) {
			// An error is a file closed since (its opener went away)
			// or one that fails to read: nothing to do but count it
			// (its READs will say what is wrong) and end the job.
			if _, err := ra.fill(ra.ctx, f, r.Off, r.Len()); err != nil {
				if ra.ctx.Err() == nil {
					ra.failed.Add(1)
				}
				ra.end(f, job)
				return
			}
		}
	}()
}

// queue adds window r of f to the job in flight of f, if any (true).
func (ra *readaheads) queue(f *os.File, r readahead.Range) bool {
	ra.mu.Lock()
	defer ra.mu.Unlock()
	j := ra.running[f]
	if j == nil {
		return false
	}
	if n := len(j.pending); n > 0 && j.pending[n-1].End == r.Off {
		j.pending[n-1].End = r.End
	} else {
		j.pending = append(j.pending, r)
	}
	ra.started.Add(1)
	ra.bytes.Add(r.Len())
	return true
}

// next is the window job of f reads next, skipping those its READs have
// cached meanwhile (the READs overtook the job); false: none is left, or
// another uid holding fewer jobs was refused one (the job's last window
// not read is given back to its stream, whose next READ asks again), and
// the job is ended (a later window starts a new one).
func (ra *readaheads) next(f *os.File, job *fillJob) (readahead.Range, bool) {
	for {
		ra.mu.Lock()
		if len(job.pending) > 0 && ra.yieldLocked(job.uid) {
			last := job.pending[len(job.pending)-1]
			job.pending = nil
			if ra.running[f] == job {
				delete(ra.running, f)
			}
			ra.mu.Unlock()
			ra.t.Unread(f, last)
			return readahead.Range{}, false
		}
		if len(job.pending) == 0 || ra.ctx.Err() != nil {
			job.pending = nil
			if ra.running[f] == job {
				delete(ra.running, f)
			}
			ra.mu.Unlock()
			return readahead.Range{}, false
		}
		r := job.pending[0]
		job.pending = job.pending[1:]
		ra.mu.Unlock()
		if !cached(f, r) {
			return r, true
		}
	}
}

// end forgets job of f and its windows not read.
func (ra *readaheads) end(f *os.File, job *fillJob) {
	ra.mu.Lock()
	defer ra.mu.Unlock()
	job.pending = nil
	if ra.running[f] == job {
		delete(ra.running, f)
	}
}

// yieldLocked reports whether a job of uid ends at its window's end for a
// uid refused a job that holds fewer than uid (which is then no longer
// waiting: one job ends per refusal). ra.mu is held.
func (ra *readaheads) yieldLocked(uid uint32) bool {
	for v := range ra.refused {
		if v != uid && ra.perUID[v] < ra.perUID[uid] {
			delete(ra.refused, v)
			return true
		}
	}
	return false
}

// take reserves a job for uid: false when readaheadJobs are in flight, or
// readaheadJobsPerUID of uid's.
func (ra *readaheads) take(uid uint32) bool {
	ra.mu.Lock()
	defer ra.mu.Unlock()
	if ra.perUID[uid] >= readaheadJobsPerUID {
		return false
	}
	select {
	case ra.jobs <- struct{}{}:
	default:
		if len(ra.refused) < readaheadUIDs {
			ra.refused[uid] = struct{}{}
		}
		return false
	}
	delete(ra.refused, uid)
	ra.perUID[uid]++
	return true
}

// give ends a job of uid.
func (ra *readaheads) give(uid uint32) {
	ra.mu.Lock()
	defer ra.mu.Unlock()
	<-ra.jobs
	if ra.perUID[uid]--; ra.perUID[uid] <= 0 {
		delete(ra.perUID, uid)
	}
}

// note updates uid's own figures with add.
func (ra *readaheads) note(uid uint32, add func(*uidReadahead)) {
	ra.mu.Lock()
	defer ra.mu.Unlock()
	u := ra.figures[uid]
	if u == nil {
		if len(ra.figures) >= readaheadUIDs {
			return
		}
		u = &uidReadahead{}
		ra.figures[uid] = u
	}
	add(u)
}

// count adds the readahead figures uid may see to c: root sees the jobs
// started (windows that were not cached), their bytes and those dropped,
// for every uid; any other uid sees its own windows (cached or not), their
// bytes and its windows dropped. The totals move only when a window was
// not cached, which would tell any uid, of any file it READs, what the
// kernel tells only the file's owner and writers.
func (ra *readaheads) count(c *CounterStats, uid uint32) {
	if ra == nil {
		return
	}
	if uid == 0 {
		c.Readaheads, c.ReadaheadBytes, c.ReadaheadDropped = uint64(ra.started.Load()), uint64(ra.bytes.Load()), uint64(ra.dropped.Load())
		return
	}
	ra.mu.Lock()
	defer ra.mu.Unlock()
	if u := ra.figures[uid]; u != nil {
		c.Readaheads, c.ReadaheadBytes, c.ReadaheadDropped = u.windows, u.bytes, u.dropped
	}
}

// cached reports whether both ends of r are in the page cache.
func cached(f *os.File, r readahead.Range) bool {
	for _, p := range []readahead.Range{{Off: r.Off, End: min(r.End, r.Off+probeBytes)}, {Off: max(r.Off, r.End-probeBytes), End: r.End}} {
		c, ok := pagecache.Cached(f, p.Off, p.Len())
		if !ok || c < p.Len() {
			return false
		}
	}
	return true
}
