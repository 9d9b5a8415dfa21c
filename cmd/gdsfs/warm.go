package main

import (
	"context"
	"errors"
	"fmt"
	"io"
	iofs "io/fs"
	"os"
	"os/signal"
	"path/filepath"
	"runtime"
	"sync"
	"sync/atomic"
	"syscall"
	"time"
	"unsafe"

	"github.com/dustin/go-humanize"
	"github.com/mattn/go-isatty"
	"github.com/schollz/progressbar/v3"
	"github.com/spf13/cobra"
	"golang.org/x/sys/unix"
)

// warmChunkBytes is one read task: large enough for sequential disk
// throughput, small enough that an interrupt stops within a moment.
const warmChunkBytes = 8 << 20

// warmConfig is what `gdsfs warm` was asked to do.
type warmConfig struct {
	paths    []string
	workers  int
	progress string // auto, always, never
}

func newWarmCmd() *cobra.Command {
	c := &warmConfig{}
	cmd := &cobra.Command{
		Use:   "warm [flags] PATH...",
		Short: "Prefetch files (or whole directory trees) into the page cache",
		Long: `Read every regular file under each PATH into the page cache, so the first
epoch of a training run reads from memory. PATH may be on a gdsfs mount or
anywhere else (with passthrough, the cache filled is the backing file's).

Only pages not already cached are read (mincore tells), so an interrupted
warm (Ctrl-C) resumes where it stopped when run again, and a second warm
of a cached dataset returns at once. A progress bar shows bytes, rate and
ETA on a terminal. At the end warm checks how much stayed cached: a dataset
larger than free memory cannot all stay, and warm says so.

Warming into the daemon's GPU or host slab pool is not offered: the
control path frees a session's buffers when the session ends, so they
cannot outlive the warm command.`,
		Example: `  gdsfs warm /data/imagenet/train
  gdsfs warm --workers 16 /data/shards/shard-00*.tar
  gdsfs warm --progress never /data/ckpt/step-1000 && python train.py`,
		Args: cobra.MinimumNArgs(1),
		RunE: func(cmd *cobra.Command, args []string) error {
			c.paths = args
			return runWarm(cmd, c)
		},
	}
	f := cmd.Flags()
	f.IntVar(&c.workers, "workers", min(max(runtime.NumCPU(), 4), 16), "parallel reads")
	f.StringVar(&c.progress, "progress", "auto", "progress bar: auto (on a terminal), always or never")
	return cmd
}

// warmFile is one file to warm and the ranges of it not yet cached.
type warmFile struct {
	path   string
	size   int64
	ranges []byteRange // not resident, page-aligned, clipped to size
}

type byteRange struct{ off, len int64 }

// warmPlan is the work of one run.
type warmPlan struct {
	files          []warmFile
	totalBytes     int64 // every file's size
	residentBytes  int64 // already cached before the run
	toReadBytes    int64
	unreadableErrs []error // paths that could not be walked or opened: named, then skipped
}

// warmStats is what a run did.
type warmStats struct {
	readBytes atomic.Int64
	files     atomic.Int64
}

func runWarm(cmd *cobra.Command, c *warmConfig) error {
	if c.workers < 1 || c.workers > 256 {
		return usagef("--workers %d: give 1 to 256", c.workers)
	}
	switch c.progress {
	case "auto", "always", "never":
	default:
		return usagef("--progress %q: use auto, always or never", c.progress)
	}
	for _, p := range c.paths {
		if _, err := os.Stat(p); err != nil {
			if errors.Is(err, os.ErrNotExist) {
				return usagef("%s does not exist; name files or directories to warm", p)
			}
			return usagef("%s: %v", p, err)
		}
	}
	parent := cmd.Context()
	if parent == nil {
		parent = context.Background()
	}
	ctx, stop := signal.NotifyContext(parent, syscall.SIGINT, syscall.SIGTERM)
	defer stop()

	errOut := cmd.ErrOrStderr()
	out := cmd.OutOrStdout()
	plan, err := planWarm(ctx, c.paths)
	if err != nil {
		return err
	}
	for _, e := range plan.unreadableErrs {
		fmt.Fprintf(errOut, "gdsfs: warm: skipped %v\n", e)
	}
	show := c.progress == "always"
	if c.progress == "auto" {
		if f, ok := errOut.(*os.File); ok && isatty.IsTerminal(f.Fd()) {
			show = true
		}
	}
	bar := newWarmBar(plan.toReadBytes, errOut, show)
	start := time.Now()
	var st warmStats
	werr := warmRead(ctx, plan, c.workers, bar, &st)
	if ctx.Err() != nil {
		_ = bar.Exit() // leave the bar where it stopped
	} else {
		_ = bar.Finish()
	}
	elapsed := time.Since(start)

	read := st.readBytes.Load()
	rate := ""
	if elapsed > 0 && read > 0 {
		rate = fmt.Sprintf(" at %s/s", humanize.IBytes(uint64(float64(read)/elapsed.Seconds())))
	}
	if ctx.Err() != nil {
		fmt.Fprintf(out, "interrupted: read %s of %s%s in %s; run the same command again to resume (cached pages are skipped)\n",
			humanize.IBytes(uint64(read)), humanize.IBytes(uint64(plan.toReadBytes)), rate, elapsed.Round(time.Millisecond))
		return errors.New("warm interrupted")
	}
	if werr != nil {
		return werr
	}
	resident, err := residentBytes(plan.files)
	if err != nil {
		return err
	}
	fmt.Fprintf(out, "warmed %d files, %s: read %s%s in %s (%s were already cached); %s cached now (%.1f%%)\n",
		len(plan.files), humanize.IBytes(uint64(plan.totalBytes)), humanize.IBytes(uint64(read)), rate,
		elapsed.Round(time.Millisecond), humanize.IBytes(uint64(plan.residentBytes)),
		humanize.IBytes(uint64(resident)), percent(resident, plan.totalBytes))
	if resident < plan.totalBytes && plan.totalBytes > 0 && percent(resident, plan.totalBytes) < 99 {
		fmt.Fprintf(out, "note: %s did not stay cached: the data is larger than the memory the kernel could spare\n",
			humanize.IBytes(uint64(plan.totalBytes-resident)))
	}
	return nil
}

func percent(a, b int64) float64 {
	if b == 0 {
		return 100
	}
	return 100 * float64(a) / float64(b)
}

func newWarmBar(total int64, w io.Writer, visible bool) *progressbar.ProgressBar {
	return progressbar.NewOptions64(total,
		progressbar.OptionSetDescription("warm"),
		progressbar.OptionSetWriter(w),
		progressbar.OptionSetVisibility(visible),
		progressbar.OptionShowBytes(true),
		progressbar.OptionShowTotalBytes(true),
		progressbar.OptionUseIECUnits(true),
		progressbar.OptionSetPredictTime(true),
		progressbar.OptionSetWidth(30),
		progressbar.OptionThrottle(100*time.Millisecond),
		progressbar.OptionOnCompletion(func() {
			if visible {
				fmt.Fprintln(w)
			}
		}),
	)
}

// planWarm walks paths and finds, per regular file, the pages not cached.
func planWarm(ctx context.Context, paths []string) (*warmPlan, error) {
	plan := &warmPlan{}
	seen := map[string]bool{}
	for _, root := range paths {
		err := filepath.WalkDir(root, func(p string, d iofs.DirEntry, err error) error {
			if ctx.Err() != nil {
				return ctx.Err()
			}
			if err != nil {
				plan.unreadableErrs = append(plan.unreadableErrs, err)
				if d != nil && d.IsDir() {
					return filepath.SkipDir
				}
				return nil
			}
			if !d.Type().IsRegular() || seen[p] {
				return nil
			}
			seen[p] = true
			wf, resident, err := planFile(p)
			if err != nil {
				plan.unreadableErrs = append(plan.unreadableErrs, err)
				return nil
			}
			plan.files = append(plan.files, wf)
			plan.totalBytes += wf.size
			plan.residentBytes += resident
			for _, r := range wf.ranges {
				plan.toReadBytes += r.len
			}
			return nil
		})
		if err != nil && ctx.Err() == nil {
			return nil, fmt.Errorf("walk %s: %w", root, err)
		}
	}
	return plan, nil
}

// planFile returns the file's non-resident ranges and its resident bytes.
func planFile(p string) (warmFile, int64, error) {
	f, err := os.Open(p)
	if err != nil {
		return warmFile{}, 0, err
	}
	defer f.Close()
	st, err := f.Stat()
	if err != nil {
		return warmFile{}, 0, err
	}
	wf := warmFile{path: p, size: st.Size()}
	if wf.size == 0 {
		return wf, 0, nil
	}
	vec, err := mincore(f, wf.size)
	if err != nil {
		// No residency information (a filesystem without mmap): read it all.
		wf.ranges = []byteRange{{0, wf.size}}
		return wf, 0, nil
	}
	page := int64(os.Getpagesize())
	var resident int64
	for i := 0; i < len(vec); {
		if vec[i]&1 != 0 {
			resident += min(page, wf.size-int64(i)*page)
			i++
			continue
		}
		j := i
		for j < len(vec) && vec[j]&1 == 0 {
			j++
		}
		off := int64(i) * page
		end := min(int64(j)*page, wf.size)
		wf.ranges = append(wf.ranges, byteRange{off, end - off})
		i = j
	}
	return wf, resident, nil
}

// mincore reports, per page of f, whether it is in the page cache.
func mincore(f *os.File, size int64) ([]byte, error) {
	m, err := unix.Mmap(int(f.Fd()), 0, int(size), unix.PROT_READ, unix.MAP_SHARED)
	if err != nil {
		return nil, fmt.Errorf("mmap %s: %w", f.Name(), err)
	}
	defer unix.Munmap(m)
	page := int64(os.Getpagesize())
	vec := make([]byte, (size+page-1)/page)
	// x/sys has no Mincore wrapper; the call only reads the mapping's
	// address and writes vec, both Go memory that stays alive meanwhile.
	_, _, errno := unix.Syscall(unix.SYS_MINCORE, uintptr(unsafe.Pointer(&m[0])), uintptr(len(m)), uintptr(unsafe.Pointer(&vec[0])))
	if errno != 0 {
		return nil, fmt.Errorf("mincore %s: %w", f.Name(), errno)
	}
	return vec, nil
}

// residentBytes sums the cached bytes of files (0 for a file mincore
// cannot see).
func residentBytes(files []warmFile) (int64, error) {
	var total int64
	for _, wf := range files {
		if wf.size == 0 {
			continue
		}
		f, err := os.Open(wf.path)
		if err != nil {
			continue // removed or renamed since: nothing to count
		}
		vec, err := mincore(f, wf.size)
		f.Close()
		if err != nil {
			continue
		}
		page := int64(os.Getpagesize())
		for i, v := range vec {
			if v&1 != 0 {
				total += min(page, wf.size-int64(i)*page)
			}
		}
	}
	return total, nil
}

// warmHandle is one open file shared by its chunks' tasks; the task that
// finishes the last chunk closes it, so descriptors stay few however many
// files are warmed.
type warmHandle struct {
	f       *os.File
	pending atomic.Int64
}

func (h *warmHandle) done(n int64) {
	if h.pending.Add(-n) == 0 {
		h.f.Close()
	}
}

// warmTask is one chunk of one file.
type warmTask struct {
	h        *warmHandle
	off, len int64
}

// warmRead reads every planned range with workers goroutines, in chunks,
// stopping as soon as ctx is done.
func warmRead(ctx context.Context, plan *warmPlan, workers int, bar *progressbar.ProgressBar, st *warmStats) error {
	tasks := make(chan warmTask, workers*2)
	var wg sync.WaitGroup
	var firstErr error
	var errOnce sync.Once
	fail := func(err error) { errOnce.Do(func() { firstErr = err }) }
	for i := 0; i < workers; i++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			buf := make([]byte, warmChunkBytes)
			for t := range tasks {
				if ctx.Err() == nil {
					n, err := t.h.f.ReadAt(buf[:t.len], t.off)
					st.readBytes.Add(int64(n))
					_ = bar.Add64(int64(n))
					if err != nil && !errors.Is(err, io.EOF) {
						fail(fmt.Errorf("read %s at %d: %w", t.h.f.Name(), t.off, err))
					}
				}
				t.h.done(1)
			}
		}()
	}
feed:
	for _, wf := range plan.files {
		if len(wf.ranges) == 0 {
			continue
		}
		f, err := os.Open(wf.path)
		if err != nil {
			fail(err)
			continue
		}
		var chunks []warmTask
		h := &warmHandle{f: f}
		for _, r := range wf.ranges {
			for off := r.off; off < r.off+r.len; off += warmChunkBytes {
				chunks = append(chunks, warmTask{h: h, off: off, len: min(warmChunkBytes, r.off+r.len-off)})
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
		st.files.Add(1)
	}
	close(tasks)
	wg.Wait()
	return firstErr
}
