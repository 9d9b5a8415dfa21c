package ctlserver

import (
	"context"
	"encoding/json"
	"errors"
	"os"
	"syscall"

	"github.com/gdsfs/gdsfs/cache"
	"github.com/gdsfs/gdsfs/ctl"
	"github.com/gdsfs/gdsfs/cufile"
	"github.com/gdsfs/gdsfs/fs"
)

// xattrMax is the largest value a FUSE getxattr can return.
const xattrMax = 64 << 10

// fileInfo is the document of user.gdsfs.info.
type fileInfo struct {
	Path    string `json:"path"`
	Type    string `json:"type"`
	Size    int64  `json:"size"`
	Dev     uint64 `json:"dev"`
	Ino     uint64 `json:"ino"`
	MtimeNs int64  `json:"mtime_ns"`
	Align   int    `json:"align"`
	Engine  string `json:"engine"`
	Reason  string `json:"reason"`
	Format  string `json:"format"`
	// IndexError says why a file of a recognised format has no index (it
	// is corrupt: cache.ErrInvalid); user.gdsfs.index and INDEX answer
	// ENODATA for it, as for a file of no format.
	IndexError string `json:"index_error,omitempty"`
	// Cached is the bytes of the file in the memory tier; absent when the
	// mount has no tier, and for a caller the file's residency is not told
	// to (Server.tierTold).
	Cached *int64 `json:"cached,omitempty"`
}

// Xattr implements fs.Control: the user.gdsfs.* names (docs/protocol.md
// section 6). The kernel checked that the caller may read the node (user.*
// attributes need read permission); the backing file is reached only
// through t.Open, never by path.
func (s *Server) Xattr(ctx context.Context, c fs.Caller, t fs.XattrTarget, name string) ([]byte, syscall.Errno) {
	switch name {
	case "user.gdsfs.backing":
		return []byte(s.backingPath(t.Path)), 0
	case "user.gdsfs.stats":
		if !t.IsRoot {
			return nil, syscall.ENODATA
		}
		return s.statsJSON(c.UID)
	case "user.gdsfs.info":
		return s.info(ctx, c, t)
	case "user.gdsfs.index":
		if s.opts.Indexes == nil {
			return nil, syscall.ENODATA
		}
		f, errno := openTarget(t)
		if errno != 0 {
			return nil, errno
		}
		defer f.Close()
		x, errno := s.lookup(ctx, c, t.Path, f)
		if errno != 0 {
			return nil, errno
		}
		doc, err := x.JSON()
		if err != nil {
			return nil, s.indexErrno(failIndex, err, t.Path)
		}
		if len(doc) > xattrMax {
			return nil, syscall.E2BIG
		}
		return doc, 0
	}
	return nil, syscall.ENODATA
}

// openTarget opens an xattr's node through fs's opener.
func openTarget(t fs.XattrTarget) (*os.File, syscall.Errno) {
	if t.Open == nil {
		return nil, syscall.ENODATA
	}
	f, err := t.Open()
	if err != nil {
		return nil, plainErrno(err)
	}
	return f, 0
}

// info builds user.gdsfs.info for the node t.
func (s *Server) info(ctx context.Context, c fs.Caller, t fs.XattrTarget) ([]byte, syscall.Errno) {
	f, errno := openTarget(t)
	if errno != 0 {
		return nil, errno
	}
	defer f.Close()
	var st syscall.Stat_t
	if err := fstat(f, &st); err != nil {
		return nil, plainErrno(err)
	}
	path := t.Path
	fi := fileInfo{Path: s.backingPath(path), Size: st.Size, Dev: st.Dev, Ino: st.Ino, MtimeNs: st.Mtim.Nano(), Align: ctl.AlignBytes}
	switch st.Mode & syscall.S_IFMT {
	case syscall.S_IFREG:
		fi.Type = "file"
		if s.tierTold(c, f, false) {
			fi.Cached = s.tierCached(&st)
		}
		var eng cufile.Engine
		if eng, fi.Reason = s.choose(c, f, path, 0, -1, false); eng != nil {
			fi.Engine = eng.Name()
		}
		if s.opts.Indexes != nil {
			switch x, err := s.lookupErr(ctx, c, path, f); {
			case err == nil:
				fi.Format = string(x.Format)
			case errors.Is(err, cache.ErrInvalid):
				// Corrupt, or beyond the parsers' limits: say why.
				fi.IndexError = err.Error()
			case errors.Is(err, cache.ErrBusy), errors.Is(err, context.DeadlineExceeded):
				fi.IndexError = "index not ready: the daemon is busy parsing other files; ask again"
			}
		}
	case syscall.S_IFDIR:
		fi.Type = "dir"
		fi.Reason = "directories have no data for the control path"
	case syscall.S_IFLNK:
		fi.Type = "symlink"
		fi.Reason = "the control path serves the file a symlink points to"
	default:
		fi.Type = "other"
		fi.Reason = "only regular files are served by the control path"
	}
	b, err := json.Marshal(fi)
	if err != nil {
		return nil, syscall.EIO
	}
	return b, 0
}

// fstat stats f.
func fstat(f *os.File, st *syscall.Stat_t) error {
	rc, err := f.SyscallConn()
	if err != nil {
		return err
	}
	var serr error
	if err := rc.Control(func(fd uintptr) { serr = syscall.Fstat(int(fd), st) }); err != nil {
		return err
	}
	return serr
}

// backingPath is the path clients are told for the daemon's path p.
func (s *Server) backingPath(p string) string {
	if s.opts.BackingPath == nil {
		return p
	}
	return s.opts.BackingPath(p)
}
