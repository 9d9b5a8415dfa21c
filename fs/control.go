package fs

import (
	"context"
	"fmt"
	"os"
	"syscall"

	"github.com/gdsfs/gdsfs/ctl"
	"golang.org/x/sys/unix"
)

// Caller identifies the process behind a FUSE request, as the kernel
// reported it.
type Caller struct {
	UID, GID, PID uint32
}

// Control is the daemon's control path (implemented by ctlserver.Server). The FUSE
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
	// with EBADF); path is the backing path. f is nil for a command that is
	// not the control path's (ctl.OurCmd is false: a tty probe), which
	// Control only counts and answers ENOTTY. out has the size encoded in cmd
	// and is returned to the caller as-is.
	FileIoctl(ctx context.Context, c Caller, f *os.File, path string, cmd uint32, in, out []byte) (int32, syscall.Errno)

	// Xattr returns the value of the virtual extended attribute name
	// (user.gdsfs.*) of the node t. The kernel has checked that c may
	// read the node. Control reaches the backing file only through
	// t.Open, never by t.Path. It returns ENODATA for names it does not
	// serve; fs then falls back to the backing file's real attributes.
	Xattr(ctx context.Context, c Caller, t XattrTarget, name string) ([]byte, syscall.Errno)

	// Changed reports that the backing file at path was written, truncated,
	// renamed, unlinked or replaced through the mount, so cached state about
	// it (indexes, handles) must not be served again.
	Changed(path string)
}

// FileCloser is implemented by a Control that keeps state per open file
// (the f of FileIoctl, its readahead stream): fs calls FileClosed(f) on the
// FUSE release of that open, before f is closed.
type FileCloser interface {
	FileClosed(f *os.File)
}

// XattrTarget is the node a virtual extended attribute is asked of.
type XattrTarget struct {
	// Path is the node's backing path as the daemon names it: reported to
	// clients (user.gdsfs.backing) and the key of cached state, never
	// opened by Control.
	Path string
	// IsRoot is true at the mount root.
	IsRoot bool
	// Open opens the node's backing file as the kernel knows it: never
	// following a symlink at its name, never blocking (FIFOs, devices and
	// sockets are not opened for I/O: their descriptor only stats), and
	// failing with ESTALE when the name now holds another file than the
	// node's inode. Regular files and directories are opened read-only
	// (the kernel checked read permission for user.* attributes). The
	// caller closes the file.
	Open func() (*os.File, error)
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
// not in the backing directory and not listed by readdir. The name is the
// protocol's (ctl, the client and wire package, which imports nothing of
// the daemon).
const controlName = ctl.ControlName

// xattrTarget describes node n for Control.Xattr.
func (n *node) xattrTarget() XattrTarget {
	return XattrTarget{Path: n.backingPath(), IsRoot: n.IsRoot(), Open: n.openForXattr}
}

// openForXattr opens n's backing file for a virtual xattr (see XattrTarget
// Open). The node is reached from the root's descriptor without following
// symlinks and opened O_PATH (no I/O, no side effects on devices, no
// blocking on FIFOs), checked to be the inode the kernel resolved (n.open),
// and only a regular file or directory is then reopened read-only
// (O_NONBLOCK: a lease on the file cannot stall the daemon) through its own
// descriptor, so nothing swapped in meanwhile is opened.
func (n *node) openForXattr() (*os.File, error) {
	fd, errno := n.open(unix.O_PATH)
	if errno != 0 {
		return nil, fmt.Errorf("fs: open backing file of %q: %w", n.backingPath(), errno)
	}
	pf := os.NewFile(uintptr(fd), n.backingPath())
	var st unix.Stat_t
	if err := unix.Fstat(fd, &st); err != nil {
		pf.Close()
		return nil, fmt.Errorf("fs: stat backing file of %q: %w", n.backingPath(), err)
	}
	switch st.Mode & unix.S_IFMT {
	case unix.S_IFREG, unix.S_IFDIR:
	default:
		return pf, nil // stat only
	}
	defer pf.Close()
	rfd, err := unix.Open(procPath(fd), unix.O_RDONLY|unix.O_NONBLOCK|unix.O_CLOEXEC, 0)
	if err != nil {
		return nil, fmt.Errorf("fs: reopen %q: %w", n.backingPath(), err)
	}
	return os.NewFile(uintptr(rfd), n.backingPath()), nil
}
