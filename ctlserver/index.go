package ctlserver

import (
	"context"
	"errors"
	"os"
	"syscall"
	"time"

	"github.com/gdsfs/gdsfs/cache"
	"github.com/gdsfs/gdsfs/ctl"
	"github.com/gdsfs/gdsfs/fs"
)

// indexTimeout bounds the work of one index lookup (INDEX, READ_NAMES'
// names, user.gdsfs.info and user.gdsfs.index): waiting for a parse slot
// and the parse. A lookup that runs out answers EAGAIN; the parse itself
// goes on, bounded by the parsers' limits, and its answer is cached.
const indexTimeout = 10 * time.Second

// lookup returns the index of f (at path) for c, waiting at most
// indexTimeout; a parse it needs counts against c's share of the parse
// slots.
func (s *Server) lookup(ctx context.Context, c fs.Caller, path string, f *os.File) (*cache.Index, syscall.Errno) {
	x, err := s.lookupErr(ctx, c, path, f)
	if err != nil {
		return nil, s.indexErrno(failIndex, err, path)
	}
	return x, 0
}

func (s *Server) lookupErr(ctx context.Context, c fs.Caller, path string, f *os.File) (*cache.Index, error) {
	if s.opts.Indexes == nil {
		return nil, cache.ErrNoIndex
	}
	ctx, cancel := context.WithTimeout(cache.WithRequester(ctx, c.UID), indexTimeout)
	defer cancel()
	return s.opts.Indexes.Get(ctx, path, f)
}

// index serves INDEX.
func (s *Server) index(ctx context.Context, c fs.Caller, f *os.File, path string, in, out []byte) syscall.Errno {
	if len(in) != ctl.SizePage || len(out) != ctl.SizePage {
		return syscall.EINVAL
	}
	if _, errno := statFile(f); errno != 0 {
		return errno
	}
	if !readable(f) {
		return syscall.EBADF // an index is the file's contents
	}
	req, err := ctl.DecodePageRequest(in)
	if err != nil {
		return plainErrno(err)
	}
	if req.Flags&^ctl.IndexFlagColumns != 0 {
		return syscall.EINVAL
	}
	// The version before the lookup: an index parsed from a later version
	// (the file changed in between) is then refused at READ, never read
	// with offsets of another version.
	version, errno := fileVersion(f)
	if errno != 0 {
		return errno
	}
	x, errno := s.lookup(ctx, c, path, f)
	if errno != 0 {
		return errno
	}
	if req.Flags&ctl.IndexFlagColumns != 0 {
		// The columns form where the format has one (tar), else the JSON.
		doc, gen, err := x.ColumnsHash()
		if err == nil {
			return plainErrno(ctl.EncodeIndexPageForm(out, doc, req.Offset, gen, version, ctl.IndexFormTarColumns))
		}
		if !errors.Is(err, cache.ErrNoColumns) {
			return s.indexErrno(failIndex, err, path)
		}
	}
	doc, gen, err := x.JSONHash()
	if err != nil {
		return s.indexErrno(failIndex, err, path)
	}
	return plainErrno(ctl.EncodeIndexPage(out, doc, req.Offset, gen, version))
}

// Changed implements fs.Control.
func (s *Server) Changed(path string) {
	if s.opts.Indexes != nil {
		s.opts.Indexes.Invalidate(path)
	}
	s.tierChanged(path)
}
