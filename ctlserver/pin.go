package ctlserver

import (
	"context"
	"errors"
	"os"
	"syscall"

	"github.com/gdsfs/gdsfs/ctl"
	"github.com/gdsfs/gdsfs/cufile"
	"github.com/gdsfs/gdsfs/fs"
	"github.com/gdsfs/gdsfs/tier"
)

// The memory tier's part of the control path: PIN (docs/protocol.md 3.9),
// READ hits (tierEngine), invalidation (tierChanged), user.gdsfs.info's
// cached and STATUS's tier.

// pin serves PIN: the caller's descriptor, open for reading, is the
// access check (S6): the kernel checked at open that the caller may read
// the file.
func (s *Server) pin(ctx context.Context, c fs.Caller, f *os.File, path string, in, out []byte) syscall.Errno {
	if len(in) != ctl.SizePin || len(out) != ctl.SizePin {
		return syscall.EINVAL
	}
	if _, errno := statFile(f); errno != 0 {
		return errno
	}
	req, err := ctl.DecodePinRequest(in)
	if err != nil {
		return plainErrno(err)
	}
	t := s.opts.Tier
	if !t.Enabled() {
		return syscall.EOPNOTSUPP
	}
	if !readable(f) {
		return syscall.EBADF
	}
	if ctl.AddOverflows(req.Offset, 0) {
		return syscall.ERANGE
	}
	// A caller the file's residency is not told to learns nothing of
	// other uids' pins of it: PIN reports what its own pins hold and
	// added, and an unpin of a file none of its pins asked for is no
	// error (Server.tierTold). Any unpin drops only the caller's pins.
	told := s.tierTold(c, f, true)
	var res tier.PinResult
	if req.Flags&ctl.PinUnpin != 0 {
		id, err := tier.Stat(f)
		if err != nil {
			return s.ioErrno(err, "unpin", path)
		}
		unpin := t.Unpin
		if !told {
			unpin = t.UnpinOwn
		}
		if _, err := unpin(id, c.UID); err != nil {
			return s.pinErrno(err, path)
		}
		res.Size = id.Size
	} else {
		n := int64(-1)
		if req.Length <= uint64(1<<63-1) {
			n = int64(req.Length)
		}
		res, err = t.Pin(ctx, f, path, c.UID, int64(req.Offset), n)
		if err != nil {
			return s.pinErrno(err, path)
		}
		if !told {
			res.Cached, res.Filled = res.Mine, res.MineFilled
		}
	}
	st := s.tierStats(c.UID)
	r := ctl.PinReply{Size: uint64(res.Size), Cached: uint64(res.Cached), Filled: uint64(res.Filled), Chunk: uint64(st.ChunkBytes),
		Budget: uint64(st.BudgetBytes), Used: uint64(st.UsedBytes), Share: uint64(st.UIDShareBytes), Yours: uint64(tierYours(c.UID, st))}
	r.Encode(out)
	return 0
}

// tierYours is the caller's bytes of the tier in st (tierStats' for it),
// as PIN and STATUS tell them: its charges, the memory of the extents its
// pins asked for, whoever's pin read them (package tier, "Fairness").
func tierYours(uid uint32, st *tier.Stats) int64 {
	for _, u := range st.UIDs {
		if u.UID == uid {
			return u.Bytes
		}
	}
	return 0
}

// pinErrno maps a tier error (docs/protocol.md 3.9), logging what the
// client did not cause.
func (s *Server) pinErrno(err error, path string) syscall.Errno {
	var errno syscall.Errno
	switch {
	case errors.Is(err, tier.ErrTooLarge):
		errno = syscall.E2BIG
	case errors.Is(err, tier.ErrFull):
		errno = syscall.ENOSPC
	case errors.Is(err, tier.ErrChanged):
		errno = syscall.ESTALE
	case errors.Is(err, tier.ErrNotOwner):
		errno = syscall.EPERM
	case errors.Is(err, tier.ErrDisabled):
		errno = syscall.EOPNOTSUPP
	case errors.Is(err, syscall.EINVAL):
		errno = syscall.EINVAL
	default:
		return s.ioErrno(err, "pin", path)
	}
	s.opts.Log.Debug().Err(err).Str("path", path).Msg("ctl: pin refused")
	return errno
}

// tierEngine returns an engine serving plan from the tier for uid and the
// view to release after the copies, or (nil, nil) on a miss (T1: the
// caller's descriptor's identity is checked against the entry's).
func (s *Server) tierEngine(uid uint32, f *os.File, plan []span) (cufile.Engine, *tier.View) {
	t := s.opts.Tier
	if !t.Enabled() || s.opts.TierCopier == nil {
		return nil, nil
	}
	id, err := tier.Stat(f)
	if err != nil {
		return nil, nil
	}
	spans := make([][2]int64, 0, len(plan))
	for _, sp := range plan {
		if sp.valid > 0 {
			spans = append(spans, [2]int64{sp.start, sp.end})
		}
	}
	if len(spans) == 0 {
		return nil, nil
	}
	v, ok := t.Lookup(id, spans)
	if !ok {
		return nil, nil
	}
	return tier.Engine{View: v, Copier: s.opts.TierCopier, UID: uid}, v
}

// tierChanged drops what the tier holds of the file at path: by the path
// it was pinned through, and by the identity the path names now (a hard
// link, or a pin through another name).
func (s *Server) tierChanged(path string) {
	t := s.opts.Tier
	if t.Empty() {
		return // nothing to drop: no lstat per write
	}
	t.InvalidatePath(path)
	var st syscall.Stat_t
	if err := syscall.Lstat(path, &st); err == nil && st.Mode&syscall.S_IFMT == syscall.S_IFREG {
		t.Invalidate(tier.Key{Dev: st.Dev, Ino: st.Ino})
	}
}

// tierCached is user.gdsfs.info's cached: the bytes of the file st in the
// tier, or nil without a tier.
func (s *Server) tierCached(st *syscall.Stat_t) *int64 {
	if !s.opts.Tier.Enabled() {
		return nil
	}
	n := s.opts.Tier.Cached(tier.IdentityOf(st))
	return &n
}

// tierStats is STATUS's and PIN's tier for uid: root sees the node's
// figures and every uid's charges; any other uid the tier's configuration
// and the figures of its own pins only (tier.StatsFor: its used, cached
// and files are its pins', no counters), which do not move when other
// uids pin, unpin or READ (docs/security.md, "The memory tier"). The
// metrics endpoint is the operator's and has the node's.
func (s *Server) tierStats(uid uint32) *tier.Stats {
	if !s.opts.Tier.Enabled() {
		return nil
	}
	var st tier.Stats
	if uid == 0 {
		st = s.opts.Tier.Stats()
	} else {
		st = s.opts.Tier.StatsFor(uid)
	}
	return &st
}
