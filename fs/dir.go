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
	n  *node
	fd int
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

// OpendirHandle opens the backing directory for a directory stream.
func (n *node) OpendirHandle(ctx context.Context, flags uint32) (gofs.FileHandle, uint32, syscall.Errno) {
	fd, err := unix.Open(n.backingPath(), unix.O_DIRECTORY|unix.O_RDONLY|unix.O_CLOEXEC, 0)
	if err != nil {
		return nil, 0, gofs.ToErrno(err)
	}
	keep, err := dupCloexec(fd)
	if err != nil {
		unix.Close(fd)
		return nil, 0, gofs.ToErrno(err)
	}
	ds, errno := gofs.NewLoopbackDirStreamFd(fd)
	if errno != 0 {
		unix.Close(fd)
		unix.Close(keep)
		return nil, 0, errno
	}
	ld, ok := ds.(loopbackDir)
	if !ok {
		panic("BUG: go-fuse's loopback directory stream lost a method gdsfs relies on")
	}
	n.dirs.Lock()
	n.dirs.fds = append(n.dirs.fds, keep)
	n.dirs.Unlock()
	return &dirHandle{loopbackDir: ld, n: n, fd: keep, hideControl: n.ctl != nil}, 0, 0
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

// Getattr stats by path like the loopback, and falls back to an open
// descriptor of the node when the path is gone (removed or replaced
// directory still open somewhere).
func (n *node) Getattr(ctx context.Context, f gofs.FileHandle, out *fuse.AttrOut) syscall.Errno {
	errno := n.LoopbackNode.Getattr(ctx, f, out)
	if errno != syscall.ENOENT || f != nil {
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
