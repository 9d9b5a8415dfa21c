package fs

import (
	"context"
	"errors"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"

	gofs "github.com/hanwen/go-fuse/v2/fs"
	"github.com/hanwen/go-fuse/v2/fuse"
	"golang.org/x/sys/unix"
)

// virtualXattrPrefix is the namespace of the control path's extended
// attributes. They exist only through the mount.
const virtualXattrPrefix = "user.gdsfs."

// node is a node of the backing tree. It embeds go-fuse's LoopbackNode for
// its Inode, but overrides every operation that touches the backing tree:
// go-fuse's loopback works on absolute paths and follows symlinks in them,
// gdsfs resolves every path from the root's descriptor without following
// any (see backing.go), and adds file handles with vetted passthrough and
// control-path ioctls, virtual xattrs, change notification and the root's
// control file.
type node struct {
	*gofs.LoopbackNode
	m *mountState

	// stashed is the O_PATH descriptor of this node taken before a
	// rename over it (lookupStash); stashMu keeps it open while it is
	// used. It is taken alone or after lookupStash.mu, never before it.
	stashed stashedFd
	stashMu sync.Mutex
	// replaced is set when another file was renamed over this one through
	// the mount: only then is its stash used (a file replaced behind the
	// mount's back is looked up again instead: ESTALE).
	replaced atomic.Bool

	// ctl is the control file's inode; set on the root only, once, by
	// addControl before the first request.
	ctl *gofs.Inode

	// dirs holds descriptors of this directory's open handles (see
	// dirHandle); its lock is only ever taken alone.
	dirs struct {
		sync.Mutex
		fds []int
	}

	// files holds the backing descriptors of this file's open handles,
	// so that a file in no directory (O_TMPFILE) can still be linked;
	// its lock is only ever taken alone.
	files struct {
		sync.Mutex
		fds []int
	}

	// locks is the POSIX lock owners of this file (posixlock.go).
	locks inodeLocks
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
	_ = (gofs.NodeListxattrer)((*node)(nil))
	_ = (gofs.NodeStatxer)((*node)(nil))
	_ = (gofs.NodeStatfser)((*node)(nil))
	_ = (gofs.NodeReadlinker)((*node)(nil))
	_ = (gofs.NodeReaddirer)((*node)(nil))
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

// newChild makes the inode for a backing entry named in this directory.
func (n *node) newChild(ctx context.Context, st *syscall.Stat_t, gen uint64) *gofs.Inode {
	ch := &node{LoopbackNode: &gofs.LoopbackNode{RootData: n.RootData}, m: n.m}
	return n.NewInode(ctx, ch, gofs.StableAttr{Mode: st.Mode & syscall.S_IFMT, Gen: gen, Ino: n.m.ino(st)})
}

// nodeOf returns the *node of an inode of this mount (def if it is not
// one, which never happens for inodes newChild made).
func nodeOf(ch *gofs.Inode, def *node) *node {
	if cn, ok := ch.Operations().(*node); ok {
		return cn
	}
	return def
}

// lookupAt stats name in dir (not following it) and returns its inode.
func (n *node) lookupAt(ctx context.Context, dir int, name string, out *fuse.EntryOut) (*gofs.Inode, syscall.Errno) {
	st, gen, err := statAt(dir, name, 0)
	if err != nil {
		return nil, gofs.ToErrno(err)
	}
	out.Attr.FromStat(&st)
	// A name the kernel looks up again (its entry timed out, a walk
	// revalidates it) is usually an inode go-fuse already knows: reuse
	// its node rather than make one go-fuse would drop for it.
	if ch := n.GetChild(name); ch != nil && ch.StableAttr() == (gofs.StableAttr{Mode: st.Mode & syscall.S_IFMT, Gen: gen, Ino: n.m.ino(&st)}) {
		return ch, 0
	}
	return n.newChild(ctx, &st, gen), 0
}

// Lookup serves the control file at the root, and the backing tree
// everywhere else.
func (n *node) Lookup(ctx context.Context, name string, out *fuse.EntryOut) (*gofs.Inode, syscall.Errno) {
	if n.isControlName(name) {
		controlAttr(&out.Attr)
		return n.ctl, 0
	}
	dir, errno := n.dirFd()
	if errno != 0 {
		return nil, errno
	}
	defer unix.Close(dir)
	return n.lookupAt(ctx, dir, name, out)
}

// Open opens the backing file with the client's flags and wraps it in a
// fileHandle. O_NONBLOCK guards the open against a FIFO planted under the
// name (it is dropped afterwards unless the client asked for it).
func (n *node) Open(ctx context.Context, flags uint32) (gofs.FileHandle, uint32, syscall.Errno) {
	uid := callerOf(ctx).UID
	if errno := n.m.opens.acquire(uid, 1); errno != 0 {
		return nil, 0, errno
	}
	fd, errno := n.openFile(flags)
	if errno != 0 {
		n.m.opens.release(uid, 1)
		return nil, 0, errno
	}
	// No FOPEN_NOFLUSH, even for read-only opens: the FLUSH of a close is
	// what releases the closing process's POSIX locks (posixlock.go).
	return n.wrapFile(gofs.NewLoopbackFile(fd), flags, n.backingPath(), uid), 0, 0
}

// openFile opens the backing file for Open.
func (n *node) openFile(flags uint32) (int, syscall.Errno) {
	fl := int(flags) &^ (syscall.O_APPEND | fuse.FMODE_EXEC | syscall.O_CREAT | syscall.O_EXCL | syscall.O_TRUNC | syscall.O_NOCTTY)
	fd, errno := n.open(fl | syscall.O_NONBLOCK)
	if errno != 0 {
		return -1, errno
	}
	if flags&syscall.O_NONBLOCK == 0 {
		if _, err := unix.FcntlInt(uintptr(fd), unix.F_SETFL, fl&^syscall.O_ACCMODE); err != nil {
			unix.Close(fd)
			return -1, gofs.ToErrno(err)
		}
	}
	if flags&syscall.O_TRUNC != 0 {
		// The kernel truncates with SETATTR (no atomic O_TRUNC was
		// negotiated); honour it anyway if it ever comes.
		if err := syscall.Ftruncate(fd, 0); err != nil {
			unix.Close(fd)
			return -1, gofs.ToErrno(err)
		}
	}
	return fd, 0
}

// Create creates the backing file as the caller (see creators) and wraps
// its handle like Open.
func (n *node) Create(ctx context.Context, name string, flags, mode uint32, out *fuse.EntryOut) (*gofs.Inode, gofs.FileHandle, uint32, syscall.Errno) {
	if n.isControlName(name) {
		return nil, nil, 0, syscall.EEXIST
	}
	dir, errno := n.dirFd()
	if errno != 0 {
		return nil, nil, 0, errno
	}
	defer unix.Close(dir)
	c := callerOf(ctx)
	if errno := n.m.opens.acquire(c.UID, 1); errno != 0 {
		return nil, nil, 0, errno
	}
	charged := true
	defer func() {
		if charged {
			n.m.opens.release(c.UID, 1)
		}
	}()
	// Always O_EXCL: the kernel sends CREATE for a name it found absent;
	// one that appeared since (maybe planted) is opened by a fresh lookup
	// and the permission checks that come with it, on ESTALE.
	fl := int(flags)&^syscall.O_APPEND | syscall.O_CREAT | syscall.O_EXCL | syscall.O_NOFOLLOW | syscall.O_CLOEXEC
	fd := -1
	fix, err := n.m.mk.do(c, func() error {
		var err error
		fd, err = unix.Openat(dir, name, fl, mode&0o7777)
		return err
	})
	if err != nil {
		if errors.Is(err, syscall.EEXIST) && flags&syscall.O_EXCL == 0 {
			return nil, nil, 0, syscall.ESTALE
		}
		return nil, nil, 0, gofs.ToErrno(err)
	}
	ch, errno := n.newFileChild(ctx, fd, dir, c, fix, out)
	if errno != 0 {
		return nil, nil, 0, errno
	}
	p := n.childPath(name)
	// A new file is a change even when opened read-only (it replaced
	// nothing, but negative lookups cached by Control are now wrong).
	n.m.changed(p)
	charged = false // the handle's now
	return ch, nodeOf(ch, n).wrapFile(gofs.NewLoopbackFile(fd), flags|syscall.O_CREAT, p, c.UID), 0, 0
}

// newFileChild makes the inode of a file just created as fd in dir (fixing
// its owner first when the creator could not create it as c); it closes fd
// on failure.
func (n *node) newFileChild(ctx context.Context, fd, dir int, c Caller, fix bool, out *fuse.EntryOut) (*gofs.Inode, syscall.Errno) {
	if fix {
		if errno := fixOwnerFd(fd, dir, c); errno != 0 {
			unix.Close(fd)
			return nil, errno
		}
	}
	st, gen, err := statAt(fd, "", unix.AT_EMPTY_PATH)
	if err != nil {
		unix.Close(fd)
		return nil, gofs.ToErrno(err)
	}
	out.Attr.FromStat(&st)
	return n.newChild(ctx, &st, gen), 0
}

// fixOwnerFd is fixOwner for an open new file.
func fixOwnerFd(fd, dir int, c Caller) syscall.Errno {
	var st syscall.Stat_t
	if err := syscall.Fstat(dir, &st); err != nil {
		return gofs.ToErrno(err)
	}
	gid := int(c.GID)
	if st.Mode&syscall.S_ISGID != 0 {
		gid = -1
	}
	return gofs.ToErrno(syscall.Fchown(fd, int(c.UID), gid))
}

// Tmpfile creates an unnamed file in this directory as the caller and
// wraps its handle like Open.
func (n *node) Tmpfile(ctx context.Context, flags, mode uint32, out *fuse.EntryOut) (*gofs.Inode, gofs.FileHandle, uint32, syscall.Errno) {
	dir, errno := n.dirFd()
	if errno != 0 {
		return nil, nil, 0, errno
	}
	defer unix.Close(dir)
	c := callerOf(ctx)
	if errno := n.m.opens.acquire(c.UID, 1); errno != 0 {
		return nil, nil, 0, errno
	}
	charged := true
	defer func() {
		if charged {
			n.m.opens.release(c.UID, 1)
		}
	}()
	fd := -1
	fix, err := n.m.mk.do(c, func() error {
		var err error
		fd, err = unix.Openat(dir, ".", int(flags)&^syscall.O_APPEND|unix.O_TMPFILE|syscall.O_CLOEXEC, mode&0o7777)
		return err
	})
	if err != nil {
		return nil, nil, 0, gofs.ToErrno(err)
	}
	ch, errno := n.newFileChild(ctx, fd, dir, c, fix, out)
	if errno != 0 {
		return nil, nil, 0, errno
	}
	charged = false // the handle's now
	return ch, nodeOf(ch, n).wrapFile(gofs.NewLoopbackFile(fd), flags, n.backingPath(), c.UID), 0, 0
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

// wrapFile wraps the loopback file of an open by uid, which was charged
// one descriptor for it (the handle returns it on Release).
func (n *node) wrapFile(fh gofs.FileHandle, flags uint32, p string, uid uint32) gofs.FileHandle {
	lf, ok := fh.(*gofs.LoopbackFile)
	if !ok {
		// Never: NewLoopbackFile makes a *LoopbackFile. Such a handle
		// would never return the charge.
		n.m.opens.release(uid, 1)
		return fh
	}
	h := &fileHandle{LoopbackFile: lf, m: n.m, n: n, fd: -1, path: p, writable: isWriteOpen(flags), acc: int(flags & syscall.O_ACCMODE), uid: uid}
	h.os.charged = 1
	if fd, ok := lf.PassthroughFd(); ok {
		h.fd = fd
		n.files.Lock()
		n.files.fds = append(n.files.fds, fd)
		n.files.Unlock()
	}
	if h.writable {
		n.m.changed(p)
	}
	return h
}

func isWriteOpen(flags uint32) bool {
	return flags&syscall.O_ACCMODE != syscall.O_RDONLY || flags&syscall.O_TRUNC != 0
}

// withXattrPath runs f with a path naming the node's backing file for the
// xattr calls, which have no form for O_PATH descriptors: the descriptor's
// /proc/self/fd link (followed: it leads to exactly the opened file) for
// regular files and directories, and the name in the parent's link (not
// followed) for other types, whose descriptor link would be followed past
// a symlink.
func (n *node) withXattrPath(f func(p string, follow bool) error) syscall.Errno {
	fd, errno := n.open(unix.O_PATH)
	if errno != 0 {
		return errno
	}
	defer unix.Close(fd)
	typ := n.StableAttr().Mode & syscall.S_IFMT
	if n.IsRoot() || typ == syscall.S_IFREG || typ == syscall.S_IFDIR {
		return gofs.ToErrno(f(procPath(fd), true))
	}
	pfd, name, errno := n.parentFd()
	if errno != 0 {
		return errno
	}
	defer unix.Close(pfd)
	return gofs.ToErrno(f(procPath(pfd)+"/"+name, false))
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
	var sz int
	errno := n.withXattrPath(func(p string, follow bool) error {
		var err error
		if follow {
			sz, err = unix.Getxattr(p, attr, dest)
		} else {
			sz, err = unix.Lgetxattr(p, attr, dest)
		}
		return err
	})
	return uint32(max(sz, 0)), errno
}

// Listxattr lists the backing file's attributes.
func (n *node) Listxattr(ctx context.Context, dest []byte) (uint32, syscall.Errno) {
	var sz int
	errno := n.withXattrPath(func(p string, follow bool) error {
		var err error
		if follow {
			sz, err = unix.Listxattr(p, dest)
		} else {
			sz, err = unix.Llistxattr(p, dest)
		}
		return err
	})
	return uint32(max(sz, 0)), errno
}

// Setxattr refuses the virtual namespace, which the backing file must never
// hold.
func (n *node) Setxattr(ctx context.Context, attr string, data []byte, flags uint32) syscall.Errno {
	if n.m.ctl != nil && strings.HasPrefix(attr, virtualXattrPrefix) {
		return syscall.EPERM
	}
	return n.withXattrPath(func(p string, follow bool) error {
		if follow {
			return unix.Setxattr(p, attr, data, int(flags))
		}
		return unix.Lsetxattr(p, attr, data, int(flags))
	})
}

// Removexattr refuses the virtual namespace, like Setxattr.
func (n *node) Removexattr(ctx context.Context, attr string) syscall.Errno {
	if n.m.ctl != nil && strings.HasPrefix(attr, virtualXattrPrefix) {
		return syscall.EPERM
	}
	return n.withXattrPath(func(p string, follow bool) error {
		if follow {
			return unix.Removexattr(p, attr)
		}
		return unix.Lremovexattr(p, attr)
	})
}

// Setattr changes the backing file through the client's handle when the
// kernel gives one, else through a descriptor of the node, and reports
// size changes (truncate) to the control path.
func (n *node) Setattr(ctx context.Context, f gofs.FileHandle, in *fuse.SetAttrIn, out *fuse.AttrOut) syscall.Errno {
	errno := n.setattr(ctx, f, in, out)
	if _, ok := in.GetSize(); ok {
		n.m.changed(n.backingPath())
	}
	return errno
}

func (n *node) setattr(ctx context.Context, f gofs.FileHandle, in *fuse.SetAttrIn, out *fuse.AttrOut) syscall.Errno {
	if fsa, ok := f.(gofs.FileSetattrer); ok && fsa != nil {
		return fsa.Setattr(ctx, in, out)
	}
	fd, errno := n.open(unix.O_PATH)
	if errno != 0 {
		return errno
	}
	defer unix.Close(fd)
	if m, ok := in.GetMode(); ok {
		err := unix.Fchmodat(fd, "", m&0o7777, unix.AT_EMPTY_PATH)
		if err == unix.EOPNOTSUPP && n.StableAttr().Mode&syscall.S_IFMT != syscall.S_IFLNK {
			// No fchmodat2 (Linux < 6.6): the descriptor's link leads
			// to exactly the opened file.
			err = syscall.Chmod(procPath(fd), m&0o7777)
		}
		if err != nil {
			return gofs.ToErrno(err)
		}
	}
	uid, uok := in.GetUID()
	gid, gok := in.GetGID()
	if uok || gok {
		su, sg := -1, -1
		if uok {
			su = int(uid)
		}
		if gok {
			sg = int(gid)
		}
		if err := unix.Fchownat(fd, "", su, sg, unix.AT_EMPTY_PATH|unix.AT_SYMLINK_NOFOLLOW); err != nil {
			return gofs.ToErrno(err)
		}
	}
	// Truncate before setting times, so an explicit mtime is not
	// clobbered by the truncate.
	if sz, ok := in.GetSize(); ok {
		if n.StableAttr().Mode&syscall.S_IFMT != syscall.S_IFREG {
			return syscall.EINVAL
		}
		if err := syscall.Truncate(procPath(fd), int64(sz)); err != nil {
			return gofs.ToErrno(err)
		}
	}
	mtime, mok := in.GetMTime()
	atime, aok := in.GetATime()
	if mok || aok {
		ts := []unix.Timespec{{Nsec: unix.UTIME_OMIT}, {Nsec: unix.UTIME_OMIT}}
		var err error
		if aok {
			if ts[0], err = unix.TimeToTimespec(atime); err != nil {
				return gofs.ToErrno(err)
			}
		}
		if mok {
			if ts[1], err = unix.TimeToTimespec(mtime); err != nil {
				return gofs.ToErrno(err)
			}
		}
		if err := unix.UtimesNanoAt(fd, "", ts, unix.AT_EMPTY_PATH|unix.AT_SYMLINK_NOFOLLOW); err != nil {
			return gofs.ToErrno(err)
		}
	}
	var st syscall.Stat_t
	if err := syscall.Fstat(fd, &st); err != nil {
		return gofs.ToErrno(err)
	}
	out.FromStat(&st)
	return 0
}

// Statx stats through the client's handle when the kernel gives one, else
// by name in the parent (checked to be the node).
func (n *node) Statx(ctx context.Context, f gofs.FileHandle, flags, mask uint32, out *fuse.StatxOut) syscall.Errno {
	if fsx, ok := f.(gofs.FileStatxer); ok && fsx != nil {
		return fsx.Statx(ctx, flags, mask, out)
	}
	dir, name, owned, errno := n.statTarget()
	if errno != 0 {
		return errno
	}
	if owned {
		defer unix.Close(dir)
	}
	fl := int(flags)&(unix.AT_STATX_FORCE_SYNC|unix.AT_STATX_DONT_SYNC) | unix.AT_SYMLINK_NOFOLLOW
	if name == "" {
		fl |= unix.AT_EMPTY_PATH
	}
	var x unix.Statx_t
	if err := unix.Statx(dir, name, fl, int(mask)|unix.STATX_TYPE|unix.STATX_INO|unix.STATX_BTIME, &x); err != nil {
		return gofs.ToErrno(err)
	}
	st := syscall.Stat_t{Ino: x.Ino, Dev: unix.Mkdev(x.Dev_major, x.Dev_minor), Mode: uint32(x.Mode)}
	if errno := n.verifyStat(&st, genOf(&x)); errno != 0 {
		return errno
	}
	out.FromStatx(&x)
	return 0
}

// statTarget returns a directory descriptor and name to stat the node by:
// the root's descriptor and "" at the root (not to be closed), else the
// parent's and the node's name.
func (n *node) statTarget() (dir int, name string, owned bool, errno syscall.Errno) {
	if n.IsRoot() {
		return n.m.rootFd, "", false, 0
	}
	pfd, name, errno := n.parentFd()
	return pfd, name, true, errno
}

// Statfs reports the backing filesystem holding the node.
func (n *node) Statfs(ctx context.Context, out *fuse.StatfsOut) syscall.Errno {
	fd, errno := n.open(unix.O_PATH)
	if errno != 0 {
		return errno
	}
	defer unix.Close(fd)
	var s syscall.Statfs_t
	if err := syscall.Fstatfs(fd, &s); err != nil {
		return gofs.ToErrno(err)
	}
	out.FromStatfsT(&s)
	return 0
}

// Readlink reads the symlink through a descriptor of it.
func (n *node) Readlink(ctx context.Context) ([]byte, syscall.Errno) {
	fd, errno := n.open(unix.O_PATH)
	if errno != 0 {
		return nil, errno
	}
	defer unix.Close(fd)
	for l := 256; ; l *= 2 {
		buf := make([]byte, l)
		sz, err := unix.Readlinkat(fd, "", buf)
		if err != nil {
			return nil, gofs.ToErrno(err)
		}
		if sz < len(buf) {
			return buf[:sz], 0
		}
	}
}

// Unlink removes name and reports the removed path.
func (n *node) Unlink(ctx context.Context, name string) syscall.Errno {
	if n.isControlName(name) {
		return syscall.EPERM
	}
	errno := n.removeAt(name, 0)
	if errno == 0 {
		n.m.changed(n.childPath(name))
		// A stash of the removed file would hold its blocks.
		if ch := n.GetChild(name); ch != nil {
			if cn := nodeOf(ch, nil); cn != nil {
				cn.dropStash()
			}
		}
	}
	return errno
}

// Rmdir refuses the control file's name and reports the removed path.
func (n *node) Rmdir(ctx context.Context, name string) syscall.Errno {
	if n.isControlName(name) {
		return syscall.ENOTDIR
	}
	errno := n.removeAt(name, unix.AT_REMOVEDIR)
	if errno == 0 {
		n.m.changed(n.childPath(name))
	}
	return errno
}

func (n *node) removeAt(name string, flags int) syscall.Errno {
	dir, errno := n.dirFd()
	if errno != 0 {
		return errno
	}
	defer unix.Close(dir)
	gone, ok := n.m.removing(dir, name, flags&unix.AT_REMOVEDIR == 0)
	if err := unix.Unlinkat(dir, name, flags); err != nil {
		return gofs.ToErrno(err)
	}
	n.m.removed(gone, ok)
	return 0
}

// Rename renames between the two directories' descriptors and reports
// both paths. The control file can be neither source nor target.
func (n *node) Rename(ctx context.Context, name string, newParent gofs.InodeEmbedder, newName string, flags uint32) syscall.Errno {
	np, ok := newParent.(*node)
	if !ok || np.m != n.m {
		return syscall.EXDEV
	}
	if n.isControlName(name) || np.isControlName(newName) {
		return syscall.EPERM
	}
	from, errno := n.dirFd()
	if errno != 0 {
		return errno
	}
	defer unix.Close(from)
	to, errno := np.dirFd()
	if errno != 0 {
		return errno
	}
	defer unix.Close(to)
	// The file renamed over, if the kernel knows it: an OPEN the kernel
	// resolved to it before the rename may still come (stash.go).
	var victim *node
	if ch := np.GetChild(newName); ch != nil && flags&unix.RENAME_EXCHANGE == 0 {
		if victim = nodeOf(ch, nil); victim != nil {
			victim.stashForRename()
		}
	}
	gone, goneOK := n.m.removing(to, newName, flags&unix.RENAME_EXCHANGE == 0)
	if err := unix.Renameat2(from, name, to, newName, uint(flags)); err != nil {
		if victim != nil {
			victim.dropStash()
		}
		return gofs.ToErrno(err)
	}
	n.m.removed(gone, goneOK)
	if victim != nil {
		victim.replaced.Store(true)
	}
	n.m.changed(n.childPath(name))
	n.m.changed(np.childPath(newName))
	return 0
}

// Link links the target's descriptor (checked to be the target) under
// name, and reports the new name (its contents are the target's, so the
// target is reported too: both names now reach one file).
func (n *node) Link(ctx context.Context, target gofs.InodeEmbedder, name string, out *fuse.EntryOut) (*gofs.Inode, syscall.Errno) {
	if n.isControlName(name) {
		return nil, syscall.EEXIST
	}
	t, ok := target.(*node)
	if !ok || t.m != n.m {
		return nil, syscall.EXDEV
	}
	dir, errno := n.dirFd()
	if errno != 0 {
		return nil, errno
	}
	defer unix.Close(dir)
	if errno := t.linkInto(dir, name); errno != 0 {
		return nil, errno
	}
	ch, errno := n.lookupAt(ctx, dir, name, out)
	if errno == 0 {
		n.m.changed(n.childPath(name))
		n.m.changed(t.backingPath())
	}
	return ch, errno
}

// linkInto links the node's backing file as name in dir: through a
// descriptor of it by its path, or, for a file in no directory (created
// with O_TMPFILE; LINK does not carry a handle), through the descriptor
// of one of its open handles.
func (n *node) linkInto(dir int, name string) syscall.Errno {
	if _, parent := n.Parent(); parent == nil {
		n.files.Lock()
		defer n.files.Unlock()
		if len(n.files.fds) == 0 {
			return syscall.ENOENT
		}
		return gofs.ToErrno(unix.Linkat(n.files.fds[0], "", dir, name, unix.AT_EMPTY_PATH))
	}
	fd, errno := n.open(unix.O_PATH)
	if errno != 0 {
		return errno
	}
	defer unix.Close(fd)
	return gofs.ToErrno(unix.Linkat(fd, "", dir, name, unix.AT_EMPTY_PATH))
}

// mknodAt creates an inode under name with mk as the caller (see
// creators) and returns it.
func (n *node) mknodAt(ctx context.Context, name string, out *fuse.EntryOut, mk func(dir int) error) (*gofs.Inode, syscall.Errno) {
	if n.isControlName(name) {
		return nil, syscall.EEXIST
	}
	dir, errno := n.dirFd()
	if errno != 0 {
		return nil, errno
	}
	defer unix.Close(dir)
	c := callerOf(ctx)
	fix, err := n.m.mk.do(c, func() error { return mk(dir) })
	if err != nil {
		return nil, gofs.ToErrno(err)
	}
	if fix {
		if err := fixOwner(dir, name, c); err != nil {
			return nil, gofs.ToErrno(err)
		}
	}
	return n.lookupAt(ctx, dir, name, out)
}

// Mkdir creates a directory as the caller.
func (n *node) Mkdir(ctx context.Context, name string, mode uint32, out *fuse.EntryOut) (*gofs.Inode, syscall.Errno) {
	return n.mknodAt(ctx, name, out, func(dir int) error { return unix.Mkdirat(dir, name, mode&0o7777) })
}

// Mknod creates a special file as the caller.
func (n *node) Mknod(ctx context.Context, name string, mode, rdev uint32, out *fuse.EntryOut) (*gofs.Inode, syscall.Errno) {
	return n.mknodAt(ctx, name, out, func(dir int) error { return unix.Mknodat(dir, name, mode, int(rdev)) })
}

// Symlink creates a symlink as the caller.
func (n *node) Symlink(ctx context.Context, target, name string, out *fuse.EntryOut) (*gofs.Inode, syscall.Errno) {
	return n.mknodAt(ctx, name, out, func(dir int) error { return unix.Symlinkat(target, dir, name) })
}

// callerOf returns the identity the kernel gave for the request in ctx.
func callerOf(ctx context.Context) Caller {
	c, ok := fuse.FromContext(ctx)
	if !ok {
		return Caller{}
	}
	return Caller{UID: c.Uid, GID: c.Gid, PID: c.Pid}
}
