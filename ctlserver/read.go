package ctlserver

import (
	"context"
	"os"
	"syscall"

	"github.com/gdsfs/gdsfs/ctl"
	"github.com/gdsfs/gdsfs/cufile"
	"github.com/gdsfs/gdsfs/fs"
	"github.com/gdsfs/gdsfs/gpubuf"
	"github.com/gdsfs/gdsfs/internal/fileid"
)

// read serves READ and READ_NAMES.
func (s *Server) read(ctx context.Context, c fs.Caller, f *os.File, path string, in, out []byte, byName bool) syscall.Errno {
	if len(in) != ctl.SizeRead || len(out) != ctl.SizeRead {
		return syscall.EINVAL
	}
	size, errno := statFile(f)
	if errno != 0 {
		return errno
	}
	// Only the access the caller's descriptor grants: the kernel checked
	// that at open, and the daemon (root) must not read past it.
	if !readable(f) {
		return syscall.EBADF
	}
	var (
		tok     ctl.Token
		dev     int32
		version uint64
		ranges  []ctl.Range
	)
	if byName {
		req, err := ctl.DecodeReadNamesRequest(in)
		if err != nil {
			return plainErrno(err)
		}
		tok, dev = req.Token, req.Device
		// Check the caller before touching the index: a stranger learns
		// nothing about the file from the errno.
		if _, errno := s.session(tok, c); errno != 0 {
			return errno
		}
		if ranges, errno = s.resolve(ctx, c, f, path, req.Names); errno != 0 {
			return errno
		}
	} else {
		req, err := ctl.DecodeReadRequest(in)
		if err != nil {
			return plainErrno(err)
		}
		tok, dev, version, ranges = req.Token, req.Device, req.Version, req.Ranges
	}
	ss, errno := s.session(tok, c)
	if errno != 0 {
		return errno
	}
	if !ss.enter() {
		return syscall.EPERM
	}
	defer ss.leave()
	pdev, errno := s.device(dev)
	if errno != 0 {
		return errno
	}
	if version != 0 {
		// Before the ranges are checked against the size: a file cut
		// short since its index is ESTALE, not EINVAL.
		if errno = sameVersion(f, version); errno != 0 {
			return errno
		}
		if size, errno = statFile(f); errno != 0 {
			return errno
		}
	}
	plan, errno := s.plan(ranges, size)
	if errno != 0 {
		return errno
	}
	eng, view := s.tierEngine(c.UID, f, plan) // a hit of the memory tier (pin.go)
	if view != nil {
		defer view.Release()
	} else if eng, errno = s.readEngine(c, f, path, plan); errno != 0 {
		return errno
	}
	told, hidden := eng, false // the engine the leases name, and readahead's
	if view != nil && !s.tierTold(c, f, true) {
		// Served from the tier, named as the caller's READ would be
		// without it: what others pinned is not the caller's to learn.
		if told, errno = s.readEngine(c, f, path, plan); errno != 0 {
			return errno
		}
		hidden = true
	}
	leases, errno := ss.readRanges(ctx, f, eng, ctl.EngineCodeOf(told.Name()), pdev, plan)
	if errno != 0 {
		return errno
	}
	if version != 0 {
		// Changed while it was read: the bytes may be of either version
		// or a mix; none is handed out (all or nothing).
		if errno = sameVersion(f, version); errno != 0 {
			ss.dropLeases(leases)
			return errno
		}
	}
	s.ra.afterRead(c.UID, f, told, plan, size, hidden)
	(&ctl.ReadReply{Leases: leases}).Encode(out)
	return 0
}

// fileVersion is the version of f's contents that INDEX names and READ
// checks (ctl.CapReadVersion): fileid.ID.Version of its fstat.
func fileVersion(f *os.File) (uint64, syscall.Errno) {
	id, err := fileid.OfFile(f)
	if err != nil {
		return 0, plainErrno(err)
	}
	return id.Version(), 0
}

// sameVersion is ESTALE unless f is at version now.
func sameVersion(f *os.File, version uint64) syscall.Errno {
	v, errno := fileVersion(f)
	if errno != 0 {
		return errno
	}
	if v != version {
		return syscall.ESTALE
	}
	return 0
}

// engine returns the engine for [off, off+n) of f, c's own open of the
// file; a chooser that has none is a bug, logged and answered with EIO
// rather than a crash.
func (s *Server) engine(c fs.Caller, f *os.File, path string, off, n int64) (cufile.Engine, syscall.Errno) {
	eng, why := s.choose(c, f, path, off, n, true)
	if eng == nil {
		s.opts.Log.Error().Str("path", path).Str("why", why).Msg("BUG: ctl: no engine for file")
		return nil, syscall.EIO
	}
	return eng, 0
}

// extent returns the lowest start, the highest end and the longest of
// plan's widened ranges that read anything; lo is -1 when none does.
func extent(plan []span) (lo, hi, longest int64) {
	lo = -1
	for _, sp := range plan {
		if sp.valid == 0 {
			continue
		}
		if lo < 0 || sp.start < lo {
			lo = sp.start
		}
		hi = max(hi, sp.end)
		longest = max(longest, sp.end-sp.start)
	}
	return lo, hi, longest
}

// readEngine returns the engine for a READ of plan: the chooser is asked
// about the span of the READ's widened ranges.
func (s *Server) readEngine(c fs.Caller, f *os.File, path string, plan []span) (cufile.Engine, syscall.Errno) {
	lo, hi, _ := extent(plan)
	if lo < 0 {
		lo = 0 // nothing to read: any answer serves
	}
	return s.engine(c, f, path, lo, hi-lo)
}

// span is one validated range: the requested bytes and the 4 KiB-widened
// bytes the engine reads.
type span struct {
	off, length, valid int64 // requested offset and length, bytes present
	start, end         int64 // widened [start, end), empty when valid == 0
}

// plan validates ranges against a file of size bytes (S4) and widens them.
func (s *Server) plan(ranges []ctl.Range, size int64) ([]span, syscall.Errno) {
	plan := make([]span, len(ranges))
	var total int64
	for i, r := range ranges {
		if ctl.AddOverflows(r.Offset, r.Length) {
			return nil, syscall.ERANGE
		}
		off, n := int64(r.Offset), int64(r.Length)
		if off > size {
			return nil, syscall.EINVAL
		}
		valid := min(n, size-off)
		if valid > s.maxLease {
			return nil, syscall.E2BIG
		}
		sp := span{off: off, length: n, valid: valid}
		if valid > 0 {
			sp.start = off &^ (ctl.AlignBytes - 1)
			sp.end = gpubuf.AlignUp(off + valid)
			total += sp.end - sp.start
		}
		plan[i] = sp
	}
	if total > s.maxLease {
		return nil, syscall.E2BIG
	}
	return plan, 0
}

// The wire's alignment is the pool's (a compile error otherwise).
const _ = uint(ctl.AlignBytes-gpubuf.Align) + uint(gpubuf.Align-ctl.AlignBytes)

// resolve maps index names of f to ranges.
func (s *Server) resolve(ctx context.Context, c fs.Caller, f *os.File, path string, names []string) ([]ctl.Range, syscall.Errno) {
	x, errno := s.lookup(ctx, c, path, f)
	if errno != 0 {
		return nil, errno
	}
	ranges := make([]ctl.Range, len(names))
	for i, name := range names {
		off, n, err := x.Resolve(name)
		switch {
		case err != nil:
			return nil, s.indexErrno(failResolve, err, path)
		case off < 0 || n < 0:
			s.opts.Log.Error().Str("path", path).Str("name", name).Msg("BUG: ctl: index resolved to a negative range")
			return nil, syscall.EIO
		}
		ranges[i] = ctl.Range{Offset: uint64(off), Length: uint64(n)}
	}
	return ranges, 0
}
