package ctlserver

import (
	"context"
	"errors"
	"fmt"
	"syscall"
	"testing"

	"github.com/gdsfs/gdsfs/cache"
	"github.com/gdsfs/gdsfs/gpubuf"
	"github.com/rs/zerolog"
)

// TestErrnoOf is the table of the server's one error-to-errno mapping:
// what each kind of failure answers, and which the daemon logs.
func TestErrnoOf(t *testing.T) {
	wrap := func(err error) error { return fmt.Errorf("context: %w", err) }
	odd := errors.New("something unexpected")
	const (
		quiet = zerolog.Disabled
		warn  = zerolog.WarnLevel
		loud  = zerolog.ErrorLevel
	)
	tests := []struct {
		f     failure
		err   error
		errno syscall.Errno
		level zerolog.Level
	}{
		{failPlain, nil, 0, quiet},
		{failPlain, syscall.EINVAL, syscall.EINVAL, quiet},
		{failPlain, wrap(syscall.EPROTO), syscall.EPROTO, quiet},
		{failPlain, odd, syscall.EIO, quiet},
		{failPlain, context.Canceled, syscall.EIO, quiet},

		{failIndex, nil, 0, quiet},
		{failIndex, wrap(cache.ErrNoIndex), syscall.ENODATA, quiet},
		{failIndex, wrap(cache.ErrInvalid), syscall.ENODATA, quiet},
		{failIndex, context.Canceled, syscall.EINTR, quiet},
		{failIndex, wrap(cache.ErrBusy), syscall.EAGAIN, quiet},
		{failIndex, wrap(context.DeadlineExceeded), syscall.EAGAIN, warn},
		{failIndex, wrap(syscall.EACCES), syscall.EACCES, quiet},
		{failIndex, cache.ErrNotFound, syscall.EIO, loud},
		{failIndex, odd, syscall.EIO, loud},

		{failResolve, wrap(cache.ErrNotFound), syscall.ENOENT, quiet},
		{failResolve, wrap(cache.ErrNotAddressable), syscall.EOPNOTSUPP, quiet},
		{failResolve, cache.ErrInvalid, syscall.ENODATA, quiet},
		{failResolve, odd, syscall.EIO, loud},

		{failIO, nil, 0, quiet},
		{failIO, context.Canceled, syscall.EINTR, quiet},
		{failIO, wrap(context.DeadlineExceeded), syscall.EINTR, quiet},
		{failIO, wrap(syscall.ENOSPC), syscall.ENOSPC, quiet},
		{failIO, syscall.EDQUOT, syscall.EDQUOT, quiet},
		{failIO, syscall.EFBIG, syscall.EFBIG, quiet},
		{failIO, syscall.EBADF, syscall.EBADF, quiet},
		{failIO, syscall.EINTR, syscall.EINTR, quiet},
		{failIO, wrap(syscall.EACCES), syscall.EIO, loud}, // the daemon's problem, not the client's
		{failIO, wrap(syscall.EAGAIN), syscall.EIO, loud}, // a retry would not cure it
		{failIO, odd, syscall.EIO, loud},

		{failAlloc, wrap(gpubuf.ErrExhausted), syscall.EAGAIN, quiet},
		{failAlloc, context.Canceled, syscall.EINTR, quiet},
		{failAlloc, context.DeadlineExceeded, syscall.EINTR, quiet},
		{failAlloc, wrap(gpubuf.ErrClosed), syscall.EIO, loud},
		{failAlloc, syscall.ENOMEM, syscall.EIO, loud},

		{failSlab, wrap(gpubuf.ErrNotFound), syscall.ENOENT, quiet},
		{failSlab, odd, syscall.ENOENT, quiet},

		{failExport, wrap(gpubuf.ErrNotFound), syscall.EPERM, quiet},
		{failExport, odd, syscall.EIO, loud},
	}
	for _, tc := range tests {
		errno, level := errnoOf(tc.f, tc.err)
		if errno != tc.errno || level != tc.level {
			t.Errorf("errnoOf(%d, %v) = %v, %v; want %v, %v", tc.f, tc.err, errno, level, tc.errno, tc.level)
		}
	}
}
