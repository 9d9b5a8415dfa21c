package pagecache

import (
	"context"
	"errors"
	"fmt"
	"io"
	"os"
	"sync"
	"sync/atomic"

	"github.com/gdsfs/gdsfs/internal/walk"
)

// ChunkBytes is one read task of Warm: large enough for sequential disk
// throughput, small enough that a cancelled Warm stops within a moment.
const ChunkBytes = 8 << 20

// File is one file to warm and the ranges of it not yet cached.
type File struct {
	Path   string
	Size   int64
	Ranges []Range // not resident, page-aligned, clipped to Size
	// Unmeasured: the kernel would not tell what of it is cached (Ranges
	// is then the whole file).
	Unmeasured bool
}

// Plan is the work of one Warm: every regular file under the paths it was
// made from, and what of them is not cached.
type Plan struct {
	Files         []File
	TotalBytes    int64 // every file's size
	ResidentBytes int64 // already cached when planned
	ToReadBytes   int64 // the ranges to read
	// UnmeasuredBytes is the size of the files whose residency the kernel
	// would not tell (read whole): see Uncached.
	UnmeasuredBytes int64
	// Skipped holds the paths that could not be walked or opened: the
	// caller names them; the plan leaves them out.
	Skipped []error

	probe prober
}

// NewPlan walks paths (files or directory trees; a file reached twice
// counts once) and finds, per regular file, the pages not cached. It stops
// early, without an error, when ctx is done.
func NewPlan(ctx context.Context, paths []string) (*Plan, error) {
	plan := &Plan{}
	skipped, err := walk.Files(ctx, paths, func(p string) error {
		wf, resident, err := plan.probe.planFile(p)
		if err != nil {
			plan.Skipped = append(plan.Skipped, err)
			return nil
		}
		plan.Files = append(plan.Files, wf)
		plan.TotalBytes += wf.Size
		plan.ResidentBytes += resident
		if wf.Unmeasured {
			plan.UnmeasuredBytes += wf.Size
		}
		for _, r := range wf.Ranges {
			plan.ToReadBytes += r.Len
		}
		return nil
	})
	plan.Skipped = append(skipped, plan.Skipped...)
	if err != nil && ctx.Err() == nil {
		return nil, fmt.Errorf("walk %v: %w", paths, err)
	}
	return plan, nil
}

// planFile returns the file's non-resident ranges and its resident bytes,
// measured where its data is cached (prober.source: on a gdsfs mount, the
// backing file).
func (p *prober) planFile(path string) (File, int64, error) {
	f, err := os.Open(path)
	if err != nil {
		return File{}, 0, err
	}
	defer f.Close()
	st, err := f.Stat()
	if err != nil {
		return File{}, 0, err
	}
	wf := File{Path: path, Size: st.Size()}
	if wf.Size == 0 {
		return wf, 0, nil
	}
	m, done, ok := p.source(f, st)
	var missing []Range
	var resident int64
	if ok {
		missing, resident, ok = Uncached(m, wf.Size)
		done()
	}
	if !ok {
		// No residency information: read it all.
		wf.Ranges = []Range{{0, wf.Size}}
		wf.Unmeasured = true
		return wf, 0, nil
	}
	wf.Ranges = missing
	return wf, resident, nil
}

// Resident sums the cached bytes of the plan's measured files now (0 for
// one gone since); files planned as unmeasured are not counted (compare
// with TotalBytes - UnmeasuredBytes).
func (plan *Plan) Resident() int64 {
	var total int64
	for _, wf := range plan.Files {
		if wf.Size == 0 || wf.Unmeasured {
			continue
		}
		f, err := os.Open(wf.Path)
		if err != nil {
			continue // removed or renamed since: nothing to count
		}
		if st, err := f.Stat(); err == nil {
			if m, done, ok := plan.probe.source(f, st); ok {
				if n, ok := Resident(m, wf.Size); ok {
					total += n
				}
				done()
			}
		}
		f.Close()
	}
	return total
}

// handle is one open file shared by its chunks' tasks; the task that
// finishes the last chunk closes it, so descriptors stay few however many
// files are warmed.
type handle struct {
	f       *os.File
	pending atomic.Int64
}

func (h *handle) done(n int64) {
	if h.pending.Add(-n) == 0 {
		h.f.Close()
	}
}

// task is one chunk of one file.
type task struct {
	h        *handle
	off, len int64
}

// Warm reads every planned range with workers goroutines, in chunks of
// ChunkBytes, stopping as soon as ctx is done. progress (may be nil) gets
// the bytes of each read as it completes, from any of the workers at once.
// It returns the bytes read and the first read error (the other reads go
// on); a cancelled Warm returns no error: check ctx.
func (plan *Plan) Warm(ctx context.Context, workers int, progress func(n int64)) (int64, error) {
	if workers < 1 {
		return 0, fmt.Errorf("pagecache: warm with %d workers: give at least 1", workers)
	}
	var read atomic.Int64
	tasks := make(chan task, workers*2)
	var wg sync.WaitGroup
	var firstErr error
	var errOnce sync.Once
	fail := func(err error) { errOnce.Do(func() { firstErr = err }) }
	for range workers {
		wg.Go(func() {
			buf := make([]byte, ChunkBytes)
			for t := range tasks {
				if ctx.Err() == nil {
					n, err := t.h.f.ReadAt(buf[:t.len], t.off)
					read.Add(int64(n))
					if progress != nil {
						progress(int64(n))
					}
					if err != nil && !errors.Is(err, io.EOF) {
						fail(fmt.Errorf("read %s at %d: %w", t.h.f.Name(), t.off, err))
					}
				}
				t.h.done(1)
			}
		})
	}
feed:
	for _, wf := range plan.Files {
		if len(wf.Ranges) == 0 {
			continue
		}
		f, err := os.Open(wf.Path)
		if err != nil {
			fail(err)
			continue
		}
		var chunks []task
		h := &handle{f: f}
		for _, r := range wf.Ranges {
			for off := r.Off; off < r.Off+r.Len; off += ChunkBytes {
				chunks = append(chunks, task{h: h, off: off, len: min(ChunkBytes, r.Off+r.Len-off)})
			}
		}
		h.pending.Store(int64(len(chunks)))
		for i, t := range chunks {
			select {
			case tasks <- t:
			case <-ctx.Done():
				h.done(int64(len(chunks) - i))
				break feed
			}
		}
	}
	close(tasks)
	wg.Wait()
	return read.Load(), firstErr
}
