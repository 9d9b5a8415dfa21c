package ctlserver

import (
	"context"
	"errors"
	"syscall"

	"github.com/gdsfs/gdsfs/cache"
	"github.com/gdsfs/gdsfs/gpubuf"
	"github.com/rs/zerolog"
)

// failure is what the server was doing when an error came back: the errno
// a client gets depends on it (EAGAIN means "retry", so only failures a
// retry can cure map to it; an engine's EACCES is the daemon's problem,
// not the client's).
type failure int

const (
	// failPlain: decoding a request, encoding a reply, or a syscall
	// whose errno the client gets as is (anything but an errno is EIO).
	failPlain failure = iota
	// failIndex: looking up a file's shard index (cache.Indexes.Get) or
	// its JSON.
	failIndex
	// failResolve: resolving a name in an index (cache.Index.Resolve).
	failResolve
	// failIO: an engine's read or write, or fdatasync of a backing file.
	failIO
	// failAlloc: leasing pool memory (gpubuf.Pool.Alloc).
	failAlloc
	// failSlab: finding a slab by id (gpubuf.Pool.Slab).
	failSlab
	// failExport: exporting a slab to a session (gpubuf.Pool.Export).
	failExport
)

// errnoOf is the server's one mapping from an error to the errno a client
// sees (TestErrnoOf is its table). level says how the daemon logs it:
// zerolog.Disabled for what the client caused or a retry cures,
// zerolog.WarnLevel for an index lookup out of time, zerolog.ErrorLevel
// for anything unexpected (always EIO).
func errnoOf(f failure, err error) (errno syscall.Errno, level zerolog.Level) {
	if err == nil {
		return 0, zerolog.Disabled
	}
	isErrno := errors.As(err, &errno)
	canceled := errors.Is(err, context.Canceled)
	late := errors.Is(err, context.DeadlineExceeded)
	switch f {
	case failPlain:
		if isErrno {
			return errno, zerolog.Disabled
		}
		return syscall.EIO, zerolog.Disabled
	case failIndex, failResolve:
		switch {
		case f != failResolve:
		case errors.Is(err, cache.ErrNotFound):
			return syscall.ENOENT, zerolog.Disabled
		case errors.Is(err, cache.ErrNotAddressable):
			return syscall.EOPNOTSUPP, zerolog.Disabled
		}
		switch {
		case errors.Is(err, cache.ErrNoIndex), errors.Is(err, cache.ErrInvalid):
			return syscall.ENODATA, zerolog.Disabled
		case canceled:
			return syscall.EINTR, zerolog.Disabled
		case errors.Is(err, cache.ErrBusy):
			return syscall.EAGAIN, zerolog.Disabled // logged by cache
		case late:
			return syscall.EAGAIN, zerolog.WarnLevel
		case isErrno:
			return errno, zerolog.Disabled
		}
	case failIO:
		if canceled || late {
			return syscall.EINTR, zerolog.Disabled
		}
		switch {
		case !isErrno:
		case errno == syscall.ENOSPC, errno == syscall.EDQUOT, errno == syscall.EFBIG, errno == syscall.EBADF, errno == syscall.EINTR:
			return errno, zerolog.Disabled
		}
	case failAlloc:
		switch {
		case errors.Is(err, gpubuf.ErrExhausted):
			return syscall.EAGAIN, zerolog.Disabled
		case canceled, late:
			return syscall.EINTR, zerolog.Disabled
		}
	case failSlab:
		return syscall.ENOENT, zerolog.Disabled
	case failExport:
		if errors.Is(err, gpubuf.ErrNotFound) {
			return syscall.EPERM, zerolog.Disabled
		}
	}
	return syscall.EIO, zerolog.ErrorLevel
}

// plainErrno is errnoOf(failPlain, err), which the daemon never logs.
func plainErrno(err error) syscall.Errno {
	errno, _ := errnoOf(failPlain, err)
	return errno
}

// indexErrno maps a failure f (failIndex or failResolve) of the index of
// the file at path (errnoOf).
func (s *Server) indexErrno(f failure, err error, path string) syscall.Errno {
	return s.failed(f, err, "ctl: index lookup", func(e *zerolog.Event) *zerolog.Event {
		return e.Str("path", path).Dur("timeout", indexTimeout)
	})
}

// ioErrno maps an engine or backing-file failure of op on path (errnoOf),
// logging it once.
func (s *Server) ioErrno(err error, op, path string) syscall.Errno {
	return s.failed(failIO, err, "ctl: engine failed", func(e *zerolog.Event) *zerolog.Event {
		return e.Str("op", op).Str("path", path)
	})
}

// failed maps err (errnoOf) and logs it at the level errnoOf says, as msg
// with the fields add attaches (nil: none).
func (s *Server) failed(f failure, err error, msg string, add func(*zerolog.Event) *zerolog.Event) syscall.Errno {
	errno, level := errnoOf(f, err)
	if level != zerolog.Disabled {
		ev := s.opts.Log.WithLevel(level).Err(err)
		if add != nil {
			ev = add(ev)
		}
		ev.Msg(msg)
	}
	return errno
}
