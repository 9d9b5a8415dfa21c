package ctlserver

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"runtime"
	"sync"
	"testing"

	"github.com/gdsfs/gdsfs/cufile"
	"github.com/gdsfs/gdsfs/internal/readahead"
)

// fakeFills records the ranges readahead jobs read and blocks them until
// released (a slow disk), counting the jobs reading at once.
type fakeFills struct {
	mu       sync.Mutex
	ranges   map[*os.File][]readahead.Range
	now, top int
	release  chan struct{}
}

func newFakeFills(ra *readaheads) *fakeFills {
	ff := &fakeFills{ranges: map[*os.File][]readahead.Range{}, release: make(chan struct{})}
	ra.fill = func(ctx context.Context, f *os.File, off, n int64) (int64, error) {
		ff.mu.Lock()
		ff.ranges[f] = append(ff.ranges[f], readahead.Range{Off: off, End: off + n})
		ff.now++
		ff.top = max(ff.top, ff.now)
		ff.mu.Unlock()
		<-ff.release
		ff.mu.Lock()
		ff.now--
		ff.mu.Unlock()
		return n, nil
	}
	return ff
}

// smallWindowReadaheads gives a server's readaheads 8 MiB first windows
// and fake fills that wait for ff.release.
func smallWindowReadaheads(t *testing.T) (*readaheads, *fakeFills) {
	e := newEnv(t, envOptions{slabBytes: 1 << 20, budgetBytes: 8 << 20, noIndexes: true})
	e.srv.ra.stop()
	ra := newReadaheads(readahead.Config{MinBytes: 8 << 20})
	e.srv.ra = ra
	return ra, newFakeFills(ra)
}

// inFlight is the number of fills reading now.
func (ff *fakeFills) inFlight() int {
	ff.mu.Lock()
	defer ff.mu.Unlock()
	return ff.now
}

// covered reports whether the ranges read of f cover [off, end).
func (ff *fakeFills) covered(f *os.File, off, end int64) bool {
	ff.mu.Lock()
	defer ff.mu.Unlock()
	for progress := true; progress && off < end; {
		progress = false
		for _, r := range ff.ranges[f] {
			if r.Off <= off && off < r.End {
				off, progress = r.End, true
			}
		}
	}
	return off >= end
}

// sparseFile is a cold file of n bytes (a hole is never cached).
func sparseFile(t *testing.T, name string, n int64) *os.File {
	t.Helper()
	f, err := os.Create(filepath.Join(t.TempDir(), name))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { f.Close() })
	if err := f.Truncate(n); err != nil {
		t.Fatal(err)
	}
	return f
}

// readSpan is the plan of one READ of [off, off+n).
func readSpan(off, n int64) []span {
	return []span{{off: off, length: n, valid: n, start: off, end: off + n}}
}

// TestReadaheadOneJobPerStream: a sequential run of READs of one cold file
// on a slow disk (its first window still being read when the next READs
// ask for theirs) has one readahead job, which reads every window asked for
// in turn: none is dropped and the file is never read by two jobs at once.
func TestReadaheadOneJobPerStream(t *testing.T) {
	e := newEnv(t, envOptions{slabBytes: 1 << 20, budgetBytes: 8 << 20, noIndexes: true})
	ra := e.srv.ra
	ff := newFakeFills(ra)
	buffered := cufile.NewHostEngine(cufile.Options{})
	const size = 256 << 20
	f := sparseFile(t, "a", size)
	var hi int64
	for i := range 24 { // 4 MiB READs: windows of 4, 8, 16, 32 MiB, asked while the first is read
		ra.afterRead(10001, f, buffered, readSpan(int64(i)<<22, 4<<20), size, false)
		hi = int64(i+1) << 22
	}
	close(ff.release)
	ra.wg.Wait()
	if n := ra.dropped.Load(); n != 0 {
		t.Errorf("%d windows dropped, want none (one stream)", n)
	}
	if ff.top != 1 {
		t.Errorf("%d readahead jobs read the file at once, want 1", ff.top)
	}
	if !ff.covered(f, 4<<20, hi+16<<20) {
		t.Errorf("read ahead %v, want [4 MiB, %d MiB) covered", ff.ranges[f], (hi+16<<20)>>20)
	}
	if got := ra.started.Load(); got < 4 {
		t.Errorf("%d windows counted, want one per window asked (>= 4)", got)
	}
}

// TestReadaheadDroppedWindowAskedAgain: a window dropped because one uid
// has its readahead jobs in flight is asked for again by the stream's next
// READ, so the READs after it do not meet the cold disk.
func TestReadaheadDroppedWindowAskedAgain(t *testing.T) {
	ra, ff := smallWindowReadaheads(t)
	buffered := cufile.NewHostEngine(cufile.Options{})
	const size = 64 << 20
	for i := range readaheadJobsPerUID { // the uid's jobs, all in flight
		ra.afterRead(10001, sparseFile(t, fmt.Sprint("b", i), size), buffered, readSpan(0, 1<<20), size, false)
	}
	a := sparseFile(t, "a", size)
	ra.afterRead(10001, a, buffered, readSpan(0, 1<<20), size, false) // window [1, 9) MiB: dropped
	if ra.dropped.Load() != 1 {
		t.Fatalf("%d windows dropped, want 1 (the uid's %d jobs in flight)", ra.dropped.Load(), readaheadJobsPerUID)
	}
	close(ff.release)
	ra.wg.Wait()
	ra.afterRead(10001, a, buffered, readSpan(1<<20, 1<<20), size, false)
	ra.wg.Wait()
	if !ff.covered(a, 2<<20, 9<<20) {
		t.Errorf("after the drop, read ahead %v of the file; want [2 MiB, 9 MiB) (the dropped window past the READ)", ff.ranges[a])
	}
	ra.stop()
}

// TestReadaheadJobsTurnOverForAnotherUID: two uids whose sequential runs
// of a slow disk hold every readahead job (each within its per-uid share,
// each job with windows queued behind the one it reads) leave a third uid
// a job once one of theirs finishes a window: a job that found another uid
// refused ends at its window's end (its queued windows given back to its
// stream) instead of reading on for as long as its stream runs.
func TestReadaheadJobsTurnOverForAnotherUID(t *testing.T) {
	ra, ff := smallWindowReadaheads(t)
	buffered := cufile.NewHostEngine(cufile.Options{})
	const size = 256 << 20
	for _, uid := range []uint32{10001, 10002} {
		for i := range readaheadJobsPerUID {
			f := sparseFile(t, fmt.Sprint("u", uid, "-", i), size)
			ra.afterRead(uid, f, buffered, readSpan(0, 1<<20), size, false)     // job: [1, 9) MiB
			ra.afterRead(uid, f, buffered, readSpan(1<<20, 4<<20), size, false) // queued: [9, 21) MiB
		}
	}
	if got := len(ra.jobs); got != readaheadJobs {
		t.Fatalf("%d jobs in flight, want %d", got, readaheadJobs)
	}
	c := sparseFile(t, "c", size)
	ra.afterRead(10003, c, buffered, readSpan(0, 1<<20), size, false)
	if ra.dropped.Load() != 1 {
		t.Fatalf("%d windows dropped, want the third uid's one", ra.dropped.Load())
	}
	// One job's window is read; wait until that job has either gone on to
	// its queued window (a further fill started) or ended.
	fills := func() int {
		ff.mu.Lock()
		defer ff.mu.Unlock()
		n := 0
		for _, rs := range ff.ranges {
			n += len(rs)
		}
		return n
	}
	// Every job must be in its fill first: a job not yet started would
	// make the count below look like one that went on.
	for ff.inFlight() < readaheadJobs {
		runtime.Gosched()
	}
	ff.release <- struct{}{}
	for fills() == readaheadJobs && len(ra.jobs) == readaheadJobs {
		runtime.Gosched()
	}
	ra.afterRead(10003, c, buffered, readSpan(1<<20, 1<<20), size, false)
	if got := ra.dropped.Load(); got != 1 {
		t.Errorf("%d windows dropped: the third uid's window is dropped again while the other uids' jobs read on", got)
	}
	close(ff.release)
	ra.wg.Wait()
	if !ff.covered(c, 2<<20, 9<<20) {
		t.Errorf("the third uid's file read ahead %v, want [2, 9) MiB", ff.ranges[c])
	}
	ra.stop()
}
