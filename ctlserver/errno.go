package ctlserver

import (
	"context"
	"errors"
	"syscall"
)

// ioErrno maps an engine or backing-file failure, logging it once.
func (s *Server) ioErrno(err error, op, path string) syscall.Errno {
	if errors.Is(err, context.Canceled) || errors.Is(err, context.DeadlineExceeded) {
		return syscall.EINTR
	}
	var errno syscall.Errno
	if errors.As(err, &errno) {
		switch errno {
		case syscall.ENOSPC, syscall.EDQUOT, syscall.EFBIG, syscall.EBADF, syscall.EINTR:
			return errno
		}
	}
	s.opts.Log.Error().Err(err).Str("op", op).Str("path", path).Msg("ctl: engine failed")
	return syscall.EIO
}

// errnoOf extracts the errno of a wire or syscall error (EIO otherwise).
func errnoOf(err error) syscall.Errno {
	if err == nil {
		return 0
	}
	var errno syscall.Errno
	if errors.As(err, &errno) {
		return errno
	}
	return syscall.EIO
}
