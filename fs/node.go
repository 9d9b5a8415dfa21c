package fs

import (
	"context"
	"strings"
	"sync"
	"syscall"

	gofs "github.com/hanwen/go-fuse/v2/fs"
	"github.com/hanwen/go-fuse/v2/fuse"
)

// virtualXattrPrefix is the namespace of the control path's extended
// attributes. They exist only through the mount.
const virtualXattrPrefix = "user.gdsfs."

// node is a loopback node of the backing tree. It embeds go-fuse's
// LoopbackNode (by pointer, so go-fuse's own type checks, such as Rename's
// "same loopback", still see a loopback node) and overrides what gdsfs
// changes: opens (file handles with vetted passthrough and control-path
// ioctls), virtual xattrs, change notification, and the root's control file.
type node struct {
	*gofs.LoopbackNode
	m *mountState

	// ctl is the control file's inode; set on the root only, once, by
	// addControl before the first request.
	ctl *gofs.Inode

	// dirs holds descriptors of this directory's open handles (see
	// dirHandle); its lock is only ever taken alone.
	dirs struct {
		sync.Mutex
		fds []int
	}
}

var (
	_ = (gofs.NodeWrapChilder)((*node)(nil))
	_ = (gofs.NodeLookuper)((*node)(nil))
	_ = (gofs.NodeOpener)((*node)(nil))
	_ = (gofs.NodeCreater)((*node)(nil))
	_ = (gofs.NodeGetxattrer)((*node)(nil))
	_ = (gofs.NodeSetxattrer)((*node)(nil))
	_ = (gofs.NodeRemovexattrer)((*node)(nil))
	_ = (gofs.NodeSetattrer)((*node)(nil))
	_ = (gofs.NodeUnlinker)((*node)(nil))
	_ = (gofs.NodeRmdirer)((*node)(nil))
	_ = (gofs.NodeRenamer)((*node)(nil))
	_ = (gofs.NodeLinker)((*node)(nil))
	_ = (gofs.NodeMkdirer)((*node)(nil))
	_ = (gofs.NodeMknoder)((*node)(nil))
	_ = (gofs.NodeSymlinker)((*node)(nil))
	_ = (gofs.NodeTmpfiler)((*node)(nil))
	_ = (gofs.NodeIoctler)((*node)(nil))
)

// WrapChild makes every child go-fuse's loopback creates a *node.
func (n *node) WrapChild(ctx context.Context, ops gofs.InodeEmbedder) gofs.InodeEmbedder {
	lb, ok := ops.(*gofs.LoopbackNode)
	if !ok {
		return ops
	}
	return &node{LoopbackNode: lb, m: n.m}
}

// backingPath is the node's path in the backing directory.
func (n *node) backingPath() string {
	return n.m.backingPath(n.Path(nil))
}

func (n *node) childPath(name string) string {
	return n.m.backingPath(n.Path(nil) + "/" + name)
}

// isControlName reports whether name at this node is the control file's.
func (n *node) isControlName(name string) bool {
	return n.ctl != nil && name == controlName
}

// Lookup serves the control file at the root, and the backing tree
// everywhere else.
func (n *node) Lookup(ctx context.Context, name string, out *fuse.EntryOut) (*gofs.Inode, syscall.Errno) {
	if n.isControlName(name) {
		controlAttr(&out.Attr)
		return n.ctl, 0
	}
	return n.LoopbackNode.Lookup(ctx, name, out)
}

// Open opens the backing file with the client's flags and wraps go-fuse's
// loopback file in a fileHandle.
func (n *node) Open(ctx context.Context, flags uint32) (gofs.FileHandle, uint32, syscall.Errno) {
	fh, fuseFlags, errno := n.LoopbackNode.Open(ctx, flags)
	if errno != 0 {
		return nil, 0, errno
	}
	return n.wrapFile(fh, flags, n.backingPath()), fuseFlags, 0
}

// Create creates the backing file and wraps its handle like Open.
func (n *node) Create(ctx context.Context, name string, flags, mode uint32, out *fuse.EntryOut) (*gofs.Inode, gofs.FileHandle, uint32, syscall.Errno) {
	if n.isControlName(name) {
		return nil, nil, 0, syscall.EEXIST
	}
	ch, fh, fuseFlags, errno := n.LoopbackNode.Create(ctx, name, flags, mode, out)
	if errno != 0 {
		return nil, nil, 0, errno
	}
	p := n.childPath(name)
	// A new file is a change even when opened read-only (it replaced
	// nothing, but negative lookups cached by Control are now wrong).
	n.m.changed(p)
	return ch, n.wrapFile(fh, flags|syscall.O_CREAT, p), fuseFlags, 0
}

// Tmpfile wraps O_TMPFILE handles like Open's.
func (n *node) Tmpfile(ctx context.Context, flags, mode uint32, out *fuse.EntryOut) (*gofs.Inode, gofs.FileHandle, uint32, syscall.Errno) {
	ch, fh, fuseFlags, errno := n.LoopbackNode.Tmpfile(ctx, flags, mode, out)
	if errno != 0 {
		return nil, nil, 0, errno
	}
	return ch, n.wrapFile(fh, flags, n.backingPath()), fuseFlags, 0
}

// Ioctl sends ioctls on data files to the control path. Nothing is ever
// forwarded to a backing descriptor: the daemon runs as root, and go-fuse's
// loopback file and directory handles would issue any ioctl a client names
// with the daemon's privileges. Directories answer ENOTTY.
func (n *node) Ioctl(ctx context.Context, f gofs.FileHandle, cmd uint32, arg uint64, in, out []byte) (int32, syscall.Errno) {
	h, ok := f.(*fileHandle)
	if !ok {
		return 0, syscall.ENOTTY
	}
	rc, errno := h.Ioctl(ctx, cmd, arg, in, out)
	if errno == 0 && h.writable {
		// A control-path WRITE changed the backing file behind the
		// kernel's back: drop the inode's cached size and pages, or a
		// read through the mount (without passthrough) stops at the old
		// size and stat shows it until the attribute timeout.
		n.NotifyContent(0, 0)
	}
	return rc, errno
}

func (n *node) wrapFile(fh gofs.FileHandle, flags uint32, p string) gofs.FileHandle {
	lf, ok := fh.(*gofs.LoopbackFile)
	if !ok {
		return fh
	}
	h := &fileHandle{LoopbackFile: lf, m: n.m, path: p, writable: isWriteOpen(flags)}
	if h.writable {
		n.m.changed(p)
	}
	return h
}

func isWriteOpen(flags uint32) bool {
	return flags&syscall.O_ACCMODE != syscall.O_RDONLY || flags&syscall.O_TRUNC != 0
}

// Getxattr asks the control path about user.gdsfs.* names first.
func (n *node) Getxattr(ctx context.Context, attr string, dest []byte) (uint32, syscall.Errno) {
	if n.m.ctl != nil && strings.HasPrefix(attr, virtualXattrPrefix) {
		val, errno := n.m.ctl.Xattr(ctx, callerOf(ctx), n.xattrTarget(), attr)
		switch {
		case errno == 0:
			if len(dest) == 0 {
				return uint32(len(val)), 0
			}
			if len(dest) < len(val) {
				return uint32(len(val)), syscall.ERANGE
			}
			return uint32(copy(dest, val)), 0
		case errno != syscall.ENODATA:
			return 0, errno
		}
	}
	return n.LoopbackNode.Getxattr(ctx, attr, dest)
}

// Setxattr refuses the virtual namespace, which the backing file must never
// hold.
func (n *node) Setxattr(ctx context.Context, attr string, data []byte, flags uint32) syscall.Errno {
	if n.m.ctl != nil && strings.HasPrefix(attr, virtualXattrPrefix) {
		return syscall.EPERM
	}
	return n.LoopbackNode.Setxattr(ctx, attr, data, flags)
}

// Removexattr refuses the virtual namespace, like Setxattr.
func (n *node) Removexattr(ctx context.Context, attr string) syscall.Errno {
	if n.m.ctl != nil && strings.HasPrefix(attr, virtualXattrPrefix) {
		return syscall.EPERM
	}
	return n.LoopbackNode.Removexattr(ctx, attr)
}

// Setattr reports size changes (truncate) to the control path.
func (n *node) Setattr(ctx context.Context, f gofs.FileHandle, in *fuse.SetAttrIn, out *fuse.AttrOut) syscall.Errno {
	errno := n.LoopbackNode.Setattr(ctx, f, in, out)
	if _, ok := in.GetSize(); ok {
		n.m.changed(n.backingPath())
	}
	return errno
}

// Unlink reports the removed path.
func (n *node) Unlink(ctx context.Context, name string) syscall.Errno {
	if n.isControlName(name) {
		return syscall.EPERM
	}
	errno := n.LoopbackNode.Unlink(ctx, name)
	if errno == 0 {
		n.m.changed(n.childPath(name))
	}
	return errno
}

// Rmdir refuses the control file's name and reports the removed path.
func (n *node) Rmdir(ctx context.Context, name string) syscall.Errno {
	if n.isControlName(name) {
		return syscall.ENOTDIR
	}
	errno := n.LoopbackNode.Rmdir(ctx, name)
	if errno == 0 {
		n.m.changed(n.childPath(name))
	}
	return errno
}

// Rename reports both paths. The control file can be neither source nor
// target.
func (n *node) Rename(ctx context.Context, name string, newParent gofs.InodeEmbedder, newName string, flags uint32) syscall.Errno {
	np, ok := newParent.(*node)
	if !ok {
		return syscall.EXDEV
	}
	if n.isControlName(name) || np.isControlName(newName) {
		return syscall.EPERM
	}
	errno := n.LoopbackNode.Rename(ctx, name, np.LoopbackNode, newName, flags)
	if errno == 0 {
		n.m.changed(n.childPath(name))
		n.m.changed(np.childPath(newName))
	}
	return errno
}

// Link reports the new name (its contents are the target's, so the target
// is reported too: both names now reach one file).
func (n *node) Link(ctx context.Context, target gofs.InodeEmbedder, name string, out *fuse.EntryOut) (*gofs.Inode, syscall.Errno) {
	if n.isControlName(name) {
		return nil, syscall.EEXIST
	}
	t, ok := target.(*node)
	if !ok {
		return nil, syscall.EXDEV
	}
	ch, errno := n.LoopbackNode.Link(ctx, t.LoopbackNode, name, out)
	if errno == 0 {
		n.m.changed(n.childPath(name))
		n.m.changed(t.backingPath())
	}
	return ch, errno
}

// Mkdir refuses the control file's name.
func (n *node) Mkdir(ctx context.Context, name string, mode uint32, out *fuse.EntryOut) (*gofs.Inode, syscall.Errno) {
	if n.isControlName(name) {
		return nil, syscall.EEXIST
	}
	return n.LoopbackNode.Mkdir(ctx, name, mode, out)
}

// Mknod refuses the control file's name.
func (n *node) Mknod(ctx context.Context, name string, mode, rdev uint32, out *fuse.EntryOut) (*gofs.Inode, syscall.Errno) {
	if n.isControlName(name) {
		return nil, syscall.EEXIST
	}
	return n.LoopbackNode.Mknod(ctx, name, mode, rdev, out)
}

// Symlink refuses the control file's name.
func (n *node) Symlink(ctx context.Context, target, name string, out *fuse.EntryOut) (*gofs.Inode, syscall.Errno) {
	if n.isControlName(name) {
		return nil, syscall.EEXIST
	}
	return n.LoopbackNode.Symlink(ctx, target, name, out)
}

// callerOf returns the identity the kernel gave for the request in ctx.
func callerOf(ctx context.Context) Caller {
	c, ok := fuse.FromContext(ctx)
	if !ok {
		return Caller{}
	}
	return Caller{UID: c.Uid, GID: c.Gid, PID: c.Pid}
}
