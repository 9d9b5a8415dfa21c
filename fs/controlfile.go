package fs

import (
	"context"
	"syscall"

	gofs "github.com/hanwen/go-fuse/v2/fs"
	"github.com/hanwen/go-fuse/v2/fuse"
)

// controlIno is the control file's inode number. Loopback inode numbers are
// the backing filesystem's (XORed with a device number for other
// filesystems), which never reach this value in practice.
const controlIno = ^uint64(0) - 1

// controlNode is <mount>/.gdsfs: a virtual, empty, world-read-writable
// regular file owned by root whose opens are control-path sessions.
type controlNode struct {
	gofs.Inode
	m *mountState
}

var (
	_ = (gofs.NodeOpener)((*controlNode)(nil))
	_ = (gofs.NodeGetattrer)((*controlNode)(nil))
	_ = (gofs.NodeSetattrer)((*controlNode)(nil))
	_ = (gofs.NodeGetxattrer)((*controlNode)(nil))
	_ = (gofs.NodeListxattrer)((*controlNode)(nil))
)

// addControl creates the control file's inode on the root. It is called
// once, from go-fuse's OnAdd, before the kernel can send requests.
func (n *node) addControl(ctx context.Context) {
	cn := &controlNode{m: n.m}
	n.ctl = n.NewPersistentInode(ctx, cn, gofs.StableAttr{Mode: syscall.S_IFREG, Ino: controlIno})
}

func controlAttr(a *fuse.Attr) {
	*a = fuse.Attr{Mode: syscall.S_IFREG | 0o666, Nlink: 1, Ino: controlIno}
}

// Getattr describes an empty regular file, mode 0666, owned by root.
func (c *controlNode) Getattr(ctx context.Context, f gofs.FileHandle, out *fuse.AttrOut) syscall.Errno {
	controlAttr(&out.Attr)
	return 0
}

// Setattr refuses every change (chmod, chown, truncate, utimes).
func (c *controlNode) Setattr(ctx context.Context, f gofs.FileHandle, in *fuse.SetAttrIn, out *fuse.AttrOut) syscall.Errno {
	return syscall.EPERM
}

// Getxattr: the control file has no attributes.
func (c *controlNode) Getxattr(ctx context.Context, attr string, dest []byte) (uint32, syscall.Errno) {
	return 0, syscall.ENODATA
}

// Listxattr: the control file has no attributes.
func (c *controlNode) Listxattr(ctx context.Context, dest []byte) (uint32, syscall.Errno) {
	return 0, 0
}

// Open starts a session for the caller. A session counts as one of the
// caller's open files (openbudget.go): it holds no descriptor, but an
// entry in the control path's session table, which a uid must not grow
// without bound either.
func (c *controlNode) Open(ctx context.Context, flags uint32) (gofs.FileHandle, uint32, syscall.Errno) {
	caller := callerOf(ctx)
	if errno := c.m.opens.acquire(caller.UID, 1); errno != 0 {
		return nil, 0, errno
	}
	s, errno := c.m.ctl.OpenSession(ctx, caller)
	if errno == 0 && s == nil {
		errno = syscall.EIO
	}
	if errno != 0 {
		c.m.opens.release(caller.UID, 1)
		return nil, 0, errno
	}
	// Direct I/O: the kernel must not cache the (empty) contents, and
	// the handle has no backing descriptor, so it is never passed through.
	// No flush: Flush does nothing and the file takes no locks, and a
	// close that waited for a FLUSH answer would keep a process that
	// exits (gdsfs status --watch stopped by Ctrl-C, a killed client)
	// stuck for as long as the daemon is hung or stopped.
	return &controlHandle{s: s, m: c.m, uid: caller.UID}, fuse.FOPEN_DIRECT_IO | fuse.FOPEN_NOFLUSH, 0
}

// controlHandle is one open of the control file: one Session.
type controlHandle struct {
	s   Session
	m   *mountState
	uid uint32 // the opener, charged one open
}

var (
	_ = (gofs.FileReader)((*controlHandle)(nil))
	_ = (gofs.FileWriter)((*controlHandle)(nil))
	_ = (gofs.FileIoctler)((*controlHandle)(nil))
	_ = (gofs.FileReleaser)((*controlHandle)(nil))
	_ = (gofs.FileFlusher)((*controlHandle)(nil))
	_ = (gofs.FileFsyncer)((*controlHandle)(nil))
)

// Read returns no data: the control file is only a handle for ioctls.
func (h *controlHandle) Read(ctx context.Context, dest []byte, off int64) (fuse.ReadResult, syscall.Errno) {
	return fuse.ReadResultData(nil), 0
}

// Write fails: requests go through ioctls.
func (h *controlHandle) Write(ctx context.Context, data []byte, off int64) (uint32, syscall.Errno) {
	return 0, syscall.EINVAL
}

// Ioctl serves a session ioctl.
func (h *controlHandle) Ioctl(ctx context.Context, cmd uint32, arg uint64, in, out []byte) (int32, syscall.Errno) {
	return h.s.Ioctl(ctx, callerOf(ctx), cmd, in, out)
}

// Flush does nothing: a close of one of several descriptors must not end
// the session; Release (the last close) does.
func (h *controlHandle) Flush(ctx context.Context) syscall.Errno { return 0 }

// Fsync does nothing: there is no data.
func (h *controlHandle) Fsync(ctx context.Context, flags uint32) syscall.Errno { return 0 }

// Release ends the session.
func (h *controlHandle) Release(ctx context.Context) syscall.Errno {
	if err := h.s.Close(); err != nil {
		h.m.log.Warn().Err(err).Msg("close control session")
	}
	h.m.opens.release(h.uid, 1)
	return 0
}
