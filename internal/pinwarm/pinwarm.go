// Package pinwarm is the client side of `gdsfs warm --pin` and --unpin:
// it walks the paths, asks the memory tier of the gdsfs daemon serving each
// file what it holds of it (PIN of length 0, docs/protocol.md 3.9), and has
// the daemon read the rest into the tier, one extent-sized PIN per task
// from a pool of workers, skipping what the tier holds, so that an
// interrupted run resumes where it stopped.
//
// It links only ctl and internal/usage: no server package. Every error it
// returns names the file and what to do in one line; a refusal the user can
// fix by how the command is called or where the file lives (not on a
// mount, a mount without a tier) is a usage.Error.
package pinwarm

import (
	"context"
	"errors"
	"fmt"
	"os"
	"sync"
	"sync/atomic"
	"syscall"

	"github.com/dustin/go-humanize"

	"github.com/gdsfs/gdsfs/ctl"
	"github.com/gdsfs/gdsfs/internal/usage"
	"github.com/gdsfs/gdsfs/internal/walk"
)

// File is one regular file to pin and what the tier held of it when planned.
type File struct {
	Path         string
	Size, Cached int64
}

// Plan is the files under the paths and the tier's figures.
type Plan struct {
	Files   []File
	Total   int64 // every file's size
	Cached  int64 // in the tier when planned
	Chunk   int64 // the tier's extent size: the length of one PIN
	Skipped []error
	// Last is the tier's latest reply (its budget, use, the caller's bytes
	// and share), updated by Fill and Unpin.
	Last ctl.PinReply
}

// Err says what a PIN errno means for path, in one line; reply carries the
// tier's figures for the messages that quote them.
func Err(path string, err error, reply ctl.PinReply) error {
	var errno syscall.Errno
	if !errors.As(err, &errno) {
		return fmt.Errorf("%s: %w", path, err)
	}
	switch errno {
	case syscall.ENOTTY:
		return usage.Errorf("%s is not on a gdsfs mount: --pin fills the memory tier of the gdsfs daemon serving it", path)
	case syscall.EOPNOTSUPP:
		return usage.Errorf("%s: its gdsfs mount has no memory tier: mount it with --tier-budget SIZE (docs/operations.md, \"Sizing the memory tier\")", path)
	case syscall.E2BIG:
		return fmt.Errorf("%s: the tier cannot take it: one user may hold %s of its %s (you hold %s); unpin files (gdsfs warm --unpin PATH) or ask for a larger --tier-budget",
			path, humanize.IBytes(reply.Share), humanize.IBytes(reply.Budget), humanize.IBytes(reply.Yours))
	case syscall.ENOSPC:
		// Used is the node's for root, the caller's own for others.
		return fmt.Errorf("%s: the tier is full (its %s budget) with pins of users holding no more than you would (you hold %s); try again when they unpin, or ask for a larger --tier-budget",
			path, humanize.IBytes(reply.Budget), humanize.IBytes(reply.Yours))
	case syscall.ESTALE:
		return fmt.Errorf("%s changed while it was being pinned: run the command again once it is written", path)
	case syscall.EPERM:
		return fmt.Errorf("%s: its extents in the tier were pinned by another user; only they (or root) can unpin it", path)
	case syscall.EACCES, syscall.EBADF:
		return fmt.Errorf("%s: permission denied: you can pin only files you may read", path)
	}
	return fmt.Errorf("%s: pin: %w", path, err)
}

// query asks the tier about one file (PIN of length 0).
func query(ctx context.Context, path string) (ctl.PinReply, error) {
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
		return r, Err(path, err, r)
	}
	return r, nil
}

// NewPlan walks paths (files or trees; a file reached twice counts once)
// and asks the tier what it holds of each regular file. A file the tier
// cannot serve at all (not on a mount with a tier) fails the plan with a
// usage.Error; other unreadable files are listed in Skipped.
func NewPlan(ctx context.Context, paths []string) (*Plan, error) {
	plan := &Plan{}
	skipped, err := walk.Files(ctx, paths, func(p string) error {
		r, err := query(ctx, p)
		if usage.Is(err) {
			return err
		}
		if err != nil {
			plan.Skipped = append(plan.Skipped, err)
			return nil
		}
		plan.Last = r
		plan.Files = append(plan.Files, File{Path: p, Size: int64(r.Size), Cached: int64(r.Cached)})
		plan.Total += int64(r.Size)
		plan.Cached += int64(r.Cached)
		plan.Chunk = int64(r.Chunk)
		return nil
	})
	plan.Skipped = append(skipped, plan.Skipped...)
	if err != nil && ctx.Err() == nil {
		return nil, err
	}
	return plan, nil
}

// Memory is the tier memory the plan's files still need (whole 4 KiB
// pages; what the tier holds already, whoever pinned it, needs none).
func (p *Plan) Memory() int64 {
	var n int64
	for _, f := range p.Files {
		n += (f.Size - f.Cached + 4095) &^ 4095
	}
	return n
}

// CheckFits refuses at once a plan that cannot fit the caller's share of
// the tier, rather than pin a part and evict it again.
func (p *Plan) CheckFits() error {
	need := p.Memory()
	if need <= int64(p.Last.Share) {
		return nil
	}
	what := "these files need"
	if len(p.Files) == 1 {
		what = p.Files[0].Path + " needs"
	}
	return fmt.Errorf("the tier cannot take it: %s %s, one user may hold %s of its %s (you hold %s); pin fewer files, unpin others (gdsfs warm --unpin PATH) or ask for a larger --tier-budget",
		what, humanize.IBytes(uint64(need)), humanize.IBytes(p.Last.Share), humanize.IBytes(p.Last.Budget), humanize.IBytes(p.Last.Yours))
}

// task is one extent-sized PIN.
type task struct {
	path     string
	off, len int64
}

// Fill has the daemon read every file's extents into the tier, with
// workers PINs in flight, stopping at the first refusal (the rest would be
// refused too) or when ctx is done. progress (may be nil) gets the bytes
// each PIN read, from any worker at once. It returns the bytes read and the
// first refusal; a cancelled Fill returns no error: check ctx.
func (p *Plan) Fill(ctx context.Context, workers int, progress func(n int64)) (int64, error) {
	if workers < 1 {
		return 0, fmt.Errorf("pinwarm: fill with %d workers: give at least 1", workers)
	}
	if p.Chunk <= 0 && p.Total > p.Cached {
		return 0, fmt.Errorf("pinwarm: the tier reported an extent size of %d: is the daemon older than this gdsfs?", p.Chunk)
	}
	var (
		filled atomic.Int64
		mu     sync.Mutex
		first  error
		wg     sync.WaitGroup
	)
	fctx, cancel := context.WithCancel(ctx)
	defer cancel()
	tasks := make(chan task)
	for range workers {
		wg.Go(func() {
			for t := range tasks {
				r, err := pin(fctx, t)
				filled.Add(int64(r.Filled))
				if progress != nil {
					progress(int64(r.Filled))
				}
				mu.Lock()
				if err != nil && first == nil && fctx.Err() == nil {
					first = err
					cancel()
				}
				if err == nil {
					p.Last = r
				}
				mu.Unlock()
			}
		})
	}
feed:
	for _, f := range p.Files {
		if f.Cached == f.Size {
			continue
		}
		for off := int64(0); off < f.Size; off += p.Chunk {
			select {
			case tasks <- task{path: f.Path, off: off, len: min(p.Chunk, f.Size-off)}:
			case <-fctx.Done():
				break feed
			}
		}
	}
	close(tasks)
	wg.Wait()
	if first == nil && ctx.Err() == nil && len(p.Files) > 0 {
		// The workers' replies came in any order, each with the tier's
		// figures of its moment: the closing figures are asked for once
		// every PIN is done (a report reads nothing).
		if r, err := pin(ctx, task{path: p.Files[len(p.Files)-1].Path}); err == nil {
			p.Last = r
		}
	}
	return filled.Load(), first
}

// pin issues one PIN.
func pin(ctx context.Context, t task) (ctl.PinReply, error) {
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
		return r, Err(t.path, err, q)
	}
	return r, nil
}

// Unpin drops the plan's files from the tier and returns the bytes freed
// (what the tier held of them when planned).
func (p *Plan) Unpin(ctx context.Context) (int64, error) {
	var freed int64
	for _, pf := range p.Files {
		f, err := os.Open(pf.Path)
		if err != nil {
			return freed, err
		}
		r, err := ctl.Pin(ctx, f, ctl.PinRequest{Flags: ctl.PinUnpin})
		f.Close()
		if err != nil {
			return freed, Err(pf.Path, err, r)
		}
		freed += pf.Cached
		p.Last = r
	}
	return freed, nil
}
