package main

import (
	"context"
	"errors"
	"fmt"
	iofs "io/fs"
	"os"
	"path/filepath"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	"github.com/dustin/go-humanize"
	"github.com/spf13/cobra"

	"github.com/gdsfs/gdsfs/ctl"
)

// pinFile is one file of `gdsfs warm --pin` and what the tier holds of it.
type pinFile struct {
	path         string
	size, cached int64
}

// pinPlan is the files under the paths and the tier's figures.
type pinPlan struct {
	files   []pinFile
	total   int64 // every file's size
	cached  int64 // in the tier when planned
	chunk   int64
	skipped []error
}

// pinErr says what a PIN errno means for path, in one line.
func pinErr(path string, err error, r ctl.PinReply) error {
	var errno syscall.Errno
	if !errors.As(err, &errno) {
		return fmt.Errorf("%s: %w", path, err)
	}
	switch errno {
	case syscall.ENOTTY:
		return usagef("%s is not on a gdsfs mount: --pin fills the memory tier of the gdsfs daemon serving it", path)
	case syscall.EOPNOTSUPP:
		return usagef("%s: its gdsfs mount has no memory tier: mount it with --tier-budget SIZE (docs/operations.md, \"Sizing the memory tier\")", path)
	case syscall.E2BIG:
		return fmt.Errorf("%s: the tier cannot take it: one user may hold %s of its %s (you hold %s); unpin files (gdsfs warm --unpin PATH) or ask for a larger --tier-budget",
			path, humanize.IBytes(r.Share), humanize.IBytes(r.Budget), humanize.IBytes(r.Yours))
	case syscall.ENOSPC:
		return fmt.Errorf("%s: the tier is full (%s of %s in use) with pins of users holding no more than you would; try again when they unpin, or ask for a larger --tier-budget",
			path, humanize.IBytes(r.Used), humanize.IBytes(r.Budget))
	case syscall.ESTALE:
		return fmt.Errorf("%s changed while it was being pinned: run the command again once it is written", path)
	case syscall.EPERM:
		return fmt.Errorf("%s: its extents in the tier were pinned by another user; only they (or root) can unpin it", path)
	case syscall.EACCES, syscall.EBADF:
		return fmt.Errorf("%s: permission denied: you can pin only files you may read", path)
	}
	return fmt.Errorf("%s: pin: %w", path, err)
}

// pinQuery asks the tier about one file (PIN of length 0).
func pinQuery(ctx context.Context, path string) (ctl.PinReply, error) {
	f, err := os.Open(path)
	if err != nil {
		if errors.Is(err, os.ErrPermission) {
			return ctl.PinReply{}, fmt.Errorf("%s: permission denied: you can pin only files you may read", path)
		}
		return ctl.PinReply{}, err
	}
	defer f.Close()
	r, err := ctl.Pin(ctx, f, ctl.PinRequest{})
	if err != nil {
		return r, pinErr(path, err, r)
	}
	return r, nil
}

// newPinPlan walks paths (files or trees; a file reached twice counts once)
// and asks the tier what it holds of each regular file. A file the tier
// cannot serve at all (not on a mount with a tier) fails the plan.
func newPinPlan(ctx context.Context, paths []string) (*pinPlan, ctl.PinReply, error) {
	plan := &pinPlan{}
	seen := map[string]bool{}
	var last ctl.PinReply
	for _, root := range paths {
		err := filepath.WalkDir(root, func(p string, d iofs.DirEntry, err error) error {
			if ctx.Err() != nil {
				return ctx.Err()
			}
			if err != nil {
				plan.skipped = append(plan.skipped, err)
				if d != nil && d.IsDir() {
					return filepath.SkipDir
				}
				return nil
			}
			if !d.Type().IsRegular() || seen[p] {
				return nil
			}
			seen[p] = true
			r, err := pinQuery(ctx, p)
			var ue usageError
			if errors.As(err, &ue) {
				return err
			}
			if err != nil {
				plan.skipped = append(plan.skipped, err)
				return nil
			}
			last = r
			plan.files = append(plan.files, pinFile{path: p, size: int64(r.Size), cached: int64(r.Cached)})
			plan.total += int64(r.Size)
			plan.cached += int64(r.Cached)
			plan.chunk = int64(r.Chunk)
			return nil
		})
		if err != nil && ctx.Err() == nil {
			return nil, last, err
		}
	}
	return plan, last, nil
}

// memory is the tier memory the plan's files still need (whole 4 KiB
// pages; what the tier holds already, whoever pinned it, needs none).
func (p *pinPlan) memory() int64 {
	var n int64
	for _, f := range p.files {
		n += (f.size - f.cached + 4095) &^ 4095
	}
	return n
}

// pinTask is one extent-sized PIN.
type pinTask struct {
	path     string
	off, len int64
}

// runWarmPin is `gdsfs warm --pin` (and --unpin): the daemon reads the
// files into its memory tier, extent by extent, skipping what it holds, so
// an interrupted run resumes where it stopped.
func runWarmPin(ctx context.Context, cmd *cobra.Command, c *warmConfig, show bool) error {
	errOut, out := cmd.ErrOrStderr(), cmd.OutOrStdout()
	plan, last, err := newPinPlan(ctx, c.paths)
	if err != nil {
		return err
	}
	for _, e := range plan.skipped {
		fmt.Fprintf(errOut, "gdsfs: warm: skipped %v\n", e)
	}
	if c.unpin {
		return runUnpin(ctx, cmd, plan, last)
	}
	if len(plan.files) == 0 {
		if len(plan.skipped) > 0 {
			return errors.New("warm --pin: no file could be pinned")
		}
		fmt.Fprintln(out, "no files to pin")
		return nil
	}
	// What one user may hold is known: refuse at once what cannot fit,
	// rather than pin a part and evict it again.
	if need := plan.memory(); need > int64(last.Share) {
		what := "these files need"
		if len(plan.files) == 1 {
			what = plan.files[0].path + " needs"
		}
		return fmt.Errorf("the tier cannot take it: %s %s, one user may hold %s of its %s (you hold %s); pin fewer files, unpin others (gdsfs warm --unpin PATH) or ask for a larger --tier-budget",
			what, humanize.IBytes(uint64(need)), humanize.IBytes(last.Share), humanize.IBytes(last.Budget), humanize.IBytes(last.Yours))
	}
	bar := newWarmBar(plan.total-plan.cached, errOut, show)
	bar.Describe("pin")
	start := time.Now()
	var filled atomic.Int64
	tasks := make(chan pinTask)
	var (
		mu    sync.Mutex
		first error
	)
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	var wg sync.WaitGroup
	for range c.workers {
		wg.Go(func() {
			for t := range tasks {
				r, err := pinRange(ctx, t)
				filled.Add(int64(r.Filled))
				_ = bar.Add64(int64(r.Filled))
				mu.Lock()
				if err != nil && first == nil && ctx.Err() == nil {
					first = err
					cancel() // a refusal stops the run: the rest would be refused too
				}
				if err == nil {
					last = r
				}
				mu.Unlock()
			}
		})
	}
feed:
	for _, f := range plan.files {
		if f.cached == f.size {
			continue
		}
		for off := int64(0); off < f.size; off += plan.chunk {
			select {
			case tasks <- pinTask{path: f.path, off: off, len: min(plan.chunk, f.size-off)}:
			case <-ctx.Done():
				break feed
			}
		}
	}
	close(tasks)
	wg.Wait()
	interrupted := first == nil && ctx.Err() != nil
	if interrupted || first != nil {
		_ = bar.Exit()
	} else {
		_ = bar.Finish()
	}
	elapsed := time.Since(start)
	read := filled.Load()
	rate := ""
	if elapsed > 0 && read > 0 {
		rate = fmt.Sprintf(" at %s/s", humanize.IBytes(uint64(float64(read)/elapsed.Seconds())))
	}
	if first != nil {
		fmt.Fprintf(out, "stopped: read %s of %s into the tier%s; what was pinned stays\n",
			humanize.IBytes(uint64(read)), humanize.IBytes(uint64(plan.total-plan.cached)), rate)
		return first
	}
	if interrupted {
		fmt.Fprintf(out, "interrupted: read %s of %s into the tier%s in %s; run the same command again to resume (extents already in the tier are skipped)\n",
			humanize.IBytes(uint64(read)), humanize.IBytes(uint64(plan.total-plan.cached)), rate, elapsed.Round(time.Millisecond))
		return errors.New("warm interrupted")
	}
	fmt.Fprintf(out, "pinned %d files, %s: read %s into the tier%s in %s (%s were already in it); the tier holds %s of %s (yours: %s)\n",
		len(plan.files), humanize.IBytes(uint64(plan.total)), humanize.IBytes(uint64(read)), rate, elapsed.Round(time.Millisecond),
		humanize.IBytes(uint64(plan.cached)), humanize.IBytes(last.Used), humanize.IBytes(last.Budget), humanize.IBytes(last.Yours))
	return nil
}

// pinRange issues one PIN.
func pinRange(ctx context.Context, t pinTask) (ctl.PinReply, error) {
	f, err := os.Open(t.path)
	if err != nil {
		return ctl.PinReply{}, fmt.Errorf("%s: %w", t.path, err)
	}
	defer f.Close()
	r, err := ctl.Pin(ctx, f, ctl.PinRequest{Offset: uint64(t.off), Length: uint64(t.len)})
	if err != nil {
		if ctx.Err() != nil {
			return r, ctx.Err()
		}
		// The reply carries no figures on an error: ask for them.
		q, _ := ctl.Pin(ctx, f, ctl.PinRequest{})
		return r, pinErr(t.path, err, q)
	}
	return r, nil
}

// runUnpin drops the plan's files from the tier.
func runUnpin(ctx context.Context, cmd *cobra.Command, plan *pinPlan, last ctl.PinReply) error {
	var freed int64
	for _, pf := range plan.files {
		f, err := os.Open(pf.path)
		if err != nil {
			return err
		}
		r, err := ctl.Pin(ctx, f, ctl.PinRequest{Flags: ctl.PinUnpin})
		f.Close()
		if err != nil {
			return pinErr(pf.path, err, r)
		}
		freed += pf.cached
		last = r
	}
	fmt.Fprintf(cmd.OutOrStdout(), "unpinned %d files, %s; the tier holds %s of %s (yours: %s)\n", len(plan.files),
		humanize.IBytes(uint64(freed)), humanize.IBytes(last.Used), humanize.IBytes(last.Budget), humanize.IBytes(last.Yours))
	return nil
}
