package fs

import (
	"context"
	"slices"
	"syscall"

	gofs "github.com/hanwen/go-fuse/v2/fs"
	"github.com/hanwen/go-fuse/v2/fuse"
	"golang.org/x/sys/unix"
)

// loopbackDir is what go-fuse's loopback directory stream implements.
type loopbackDir interface {
	gofs.FileReaddirenter
	gofs.FileSeekdirer
	gofs.FileReleasedirer
	gofs.FileFsyncdirer
}

// dirHandle is one open of a directory. Besides the loopback stream it
// keeps its own descriptor of the directory, registered on the node, so
// that fstat of an open directory keeps working after the directory was
// removed or renamed over (the loopback otherwise stats by path and gets
// ENOENT).
type dirHandle struct {
	loopbackDir
	n   *node
	fd  int
	uid uint32 // the opener, charged dirCharge descriptors
	// hideControl drops a backing entry named like the control file from
	// the root's listing: the virtual file shadows it, and it is not
	// listed either.
	hideControl bool
}

var (
	_ = (gofs.NodeOpendirHandler)((*node)(nil))
	_ = (gofs.NodeGetattrer)((*node)(nil))
	_ = (gofs.FileReleasedirer)((*dirHandle)(nil))
	_ = (gofs.FileGetattrer)((*dirHandle)(nil))
)

// dirCharge is what an open directory holds of its opener's budget: the
// stream's descriptor and the kept one.
const dirCharge = 2

// OpendirHandle opens the backing directory (checked to be the node's)
// for a directory stream.
func (n *node) OpendirHandle(ctx context.Context, flags uint32) (gofs.FileHandle, uint32, syscall.Errno) {
	uid := callerOf(ctx).UID
	if errno := n.m.opens.acquire(uid, dirCharge); errno != 0 {
		return nil, 0, errno
	}
	fd, errno := n.open(unix.O_DIRECTORY | unix.O_RDONLY)
	if errno != 0 {
		n.m.opens.release(uid, dirCharge)
		return nil, 0, errno
	}
	keep, err := dupCloexec(fd)
	if err != nil {
		unix.Close(fd)
		n.m.opens.release(uid, dirCharge)
		return nil, 0, gofs.ToErrno(err)
	}
	ds, errno := gofs.NewLoopbackDirStreamFd(fd)
	if errno != 0 {
		unix.Close(fd)
		unix.Close(keep)
		n.m.opens.release(uid, dirCharge)
		return nil, 0, errno
	}
	ld, ok := ds.(loopbackDir)
	if !ok {
		panic("BUG: go-fuse's loopback directory stream lost a method gdsfs relies on")
	}
	n.dirs.Lock()
	n.dirs.fds = append(n.dirs.fds, keep)
	n.dirs.Unlock()
	return &dirHandle{loopbackDir: ld, n: n, fd: keep, uid: uid, hideControl: n.ctl != nil}, 0, 0
}

// Readdirent returns the next entry, skipping the control file's name at
// the root.
func (d *dirHandle) Readdirent(ctx context.Context) (*fuse.DirEntry, syscall.Errno) {
	for {
		de, errno := d.loopbackDir.Readdirent(ctx)
		if errno != 0 || de == nil || !d.hideControl || de.Name != controlName {
			return de, errno
		}
	}
}

// Releasedir closes the stream and the kept descriptor.
func (d *dirHandle) Releasedir(ctx context.Context, flags uint32) {
	d.n.dirs.Lock()
	d.n.dirs.fds = slices.DeleteFunc(d.n.dirs.fds, func(fd int) bool { return fd == d.fd })
	d.n.dirs.Unlock()
	unix.Close(d.fd)
	d.loopbackDir.Releasedir(ctx, flags)
	d.n.m.opens.release(d.uid, dirCharge)
}

// Getattr stats the open directory.
func (d *dirHandle) Getattr(ctx context.Context, out *fuse.AttrOut) syscall.Errno {
	var st syscall.Stat_t
	if err := syscall.Fstat(d.fd, &st); err != nil {
		return gofs.ToErrno(err)
	}
	out.FromStat(&st)
	return 0
}

// Readdir lists the backing directory (go-fuse uses OpendirHandle; this
// serves any caller of the plain interface the same way).
func (n *node) Readdir(ctx context.Context) (gofs.DirStream, syscall.Errno) {
	fd, errno := n.open(unix.O_DIRECTORY | unix.O_RDONLY)
	if errno != 0 {
		return nil, errno
	}
	return gofs.NewLoopbackDirStreamFd(fd)
}

// Getattr stats through the client's handle when the kernel gives one,
// else by name in the parent's descriptor (checked to be the node), and
// falls back to an open descriptor of the node when the name is gone
// (removed or replaced directory still open somewhere).
func (n *node) Getattr(ctx context.Context, f gofs.FileHandle, out *fuse.AttrOut) syscall.Errno {
	if fga, ok := f.(gofs.FileGetattrer); ok && fga != nil {
		return fga.Getattr(ctx, out)
	}
	errno := n.statByName(out)
	if errno != syscall.ENOENT && errno != syscall.ESTALE {
		return errno
	}
	n.dirs.Lock()
	defer n.dirs.Unlock()
	if len(n.dirs.fds) == 0 {
		return errno
	}
	var st syscall.Stat_t
	if err := syscall.Fstat(n.dirs.fds[0], &st); err != nil {
		return gofs.ToErrno(err)
	}
	out.FromStat(&st)
	return 0
}

func (n *node) statByName(out *fuse.AttrOut) syscall.Errno {
	dir, name, owned, errno := n.statTarget()
	if errno != 0 {
		return errno
	}
	if owned {
		defer unix.Close(dir)
	}
	fl := 0
	if name == "" {
		fl = unix.AT_EMPTY_PATH
	}
	st, gen, err := statAt(dir, name, fl)
	if err != nil {
		return gofs.ToErrno(err)
	}
	if errno := n.verifyStat(&st, gen); errno != 0 {
		return errno
	}
	out.FromStat(&st)
	return 0
}
