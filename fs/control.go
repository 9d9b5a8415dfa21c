package fs

import (
	"context"
	"os"
	"syscall"
)

// Caller identifies the process behind a FUSE request, as the kernel
// reported it.
type Caller struct {
	UID, GID, PID uint32
}

// Control is the daemon's control path (implemented by ctl.Server). The FUSE
// layer decodes a request, calls one Control method and encodes the reply;
// Control never sees FUSE types. All methods may be called concurrently.
type Control interface {
	// OpenSession is called on each open of <mount>/.gdsfs. The session
	// ends when the returned Session is closed, which fs does on the FUSE
	// release of that open file (the last close of its descriptor in every
	// process that shares it).
	OpenSession(ctx context.Context, c Caller) (Session, syscall.Errno)

	// FileIoctl serves a control-path ioctl issued on a data file opened
	// through the mount. f is the mount's own open of the backing file, with
	// the client's open flags (so a write ioctl on a read-only open fails
	// with EBADF); path is the backing path. out has the size encoded in cmd
	// and is returned to the caller as-is.
	FileIoctl(ctx context.Context, c Caller, f *os.File, path string, cmd uint32, in, out []byte) (int32, syscall.Errno)

	// Xattr returns the value of the virtual extended attribute name
	// (user.gdsfs.*) of the backing path (isRoot is true at the mount root).
	// It returns ENODATA for names it does not serve; fs then falls back to
	// the backing file's real attributes.
	Xattr(ctx context.Context, c Caller, path string, isRoot bool, name string) ([]byte, syscall.Errno)

	// Changed reports that the backing file at path was written, truncated,
	// renamed, unlinked or replaced through the mount, so cached state about
	// it (indexes, handles) must not be served again.
	Changed(path string)
}

// Session is one open of the control file.
type Session interface {
	// Ioctl serves a control-file ioctl (hello, slab handles, release,
	// status, ...). out has the size encoded in cmd.
	Ioctl(ctx context.Context, c Caller, cmd uint32, in, out []byte) (int32, syscall.Errno)
	// Close ends the session and returns every lease it holds to the pool.
	Close() error
}

// controlName is the control file's name at the mount root. It is virtual:
// not in the backing directory and not listed by readdir.
const controlName = ".gdsfs"
