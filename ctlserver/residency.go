package ctlserver

import (
	"bufio"
	"bytes"
	"fmt"
	"os"
	"strconv"
	"syscall"

	"github.com/gdsfs/gdsfs/cufile"
	"github.com/gdsfs/gdsfs/fs"
	"github.com/gdsfs/gdsfs/internal/pagecache"
)

// ResidencyChooser is an EngineChooser whose answer may depend on the page
// cache's residency of the range (*cufile.Engines in auto mode without
// nvidia-fs). The daemon measures residency as root, which the kernel
// would tell a caller only for a file the caller owns or may write
// (pagecache.MayTell): ctl asks such a chooser through ChooseAs with that
// rule for the caller, so that a READ reply's engine and user.gdsfs.info's
// engine and reason never tell a caller what is cached of a file the
// kernel would not. A chooser whose answer can depend on residency must
// implement it; ChooseAs asks mayKnow only where residency would decide.
type ResidencyChooser interface {
	ChooseAs(f *os.File, path string, off, n int64, mayKnow func() bool) (e cufile.Engine, reason string)
}

var _ ResidencyChooser = (*cufile.Engines)(nil)

// choose asks the chooser about [off, off+n) of f for caller c. byCaller:
// f is c's own open of the file (a READ's or WRITE's), whose write access
// counts as the kernel counts it; else f is the daemon's (an xattr's).
func (s *Server) choose(c fs.Caller, f *os.File, path string, off, n int64, byCaller bool) (cufile.Engine, string) {
	rc, ok := s.opts.Engines.(ResidencyChooser)
	if !ok {
		return s.opts.Engines.Choose(f, path, off, n)
	}
	if s.opts.ResidencyToReaders {
		return rc.ChooseAs(f, path, off, n, func() bool { return true })
	}
	return rc.ChooseAs(f, path, off, n, func() bool { return mayTell(c, f, byCaller && writable(f)) })
}

// tierTold reports whether c may be told what the memory tier holds of
// f's file: the tier is residency too (docs/security.md, "The memory tier is residency too"), told by
// the kernel's rule for the page cache unless --residency readers. byCaller
// as for choose. A caller not told gets answers that do not depend on what
// other uids pinned: a READ served from the tier names the engine it would
// have got without it, user.gdsfs.info has no cached, and PIN reports what
// its own pins hold (tier.PinResult.Mine).
func (s *Server) tierTold(c fs.Caller, f *os.File, byCaller bool) bool {
	return s.opts.ResidencyToReaders || mayTell(c, f, byCaller && writable(f))
}

// mayTell reports whether the kernel would tell c the page-cache residency
// of f's file; false when f cannot be stat'ed.
func mayTell(c fs.Caller, f *os.File, writable bool) bool {
	var st syscall.Stat_t
	if err := fstat(f, &st); err != nil {
		return false
	}
	return pagecache.MayTell(&st, pagecache.Asker{UID: c.UID, InGroup: func(gid uint32) bool { return inGroup(c, gid) }}, writable)
}

// inGroup reports whether c is in group gid: its primary group, or a
// supplementary group of its process (read from /proc only then, and only
// while that process still runs as c's uid; a process gone or unreadable
// counts as in no further group, which tells it less, never more).
func inGroup(c fs.Caller, gid uint32) bool {
	if gid == c.GID {
		return true
	}
	if c.PID == 0 {
		return false
	}
	groups, err := procGroups(c.PID, c.UID)
	if err != nil {
		return false
	}
	for _, g := range groups {
		if g == gid {
			return true
		}
	}
	return false
}

// procGroups returns the supplementary groups of process pid if its
// filesystem uid (the one FUSE reports) is uid.
func procGroups(pid, uid uint32) ([]uint32, error) {
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/status", pid))
	if err != nil {
		return nil, err
	}
	var groups []uint32
	uidOK := false
	sc := bufio.NewScanner(bytes.NewReader(b))
	for sc.Scan() {
		k, v, ok := bytes.Cut(sc.Bytes(), []byte(":"))
		if !ok {
			continue
		}
		fields := bytes.Fields(v)
		switch string(k) {
		case "Uid": // real, effective, saved, filesystem
			uidOK = len(fields) == 4 && string(fields[3]) == strconv.FormatUint(uint64(uid), 10)
		case "Groups":
			for _, fl := range fields {
				g, err := strconv.ParseUint(string(fl), 10, 32)
				if err != nil {
					return nil, fmt.Errorf("/proc/%d/status: group %q: %w", pid, fl, err)
				}
				groups = append(groups, uint32(g))
			}
		}
	}
	if !uidOK {
		return nil, fmt.Errorf("/proc/%d/status: process no longer runs as uid %d", pid, uid)
	}
	return groups, nil
}
