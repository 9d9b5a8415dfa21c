package fs

import (
	"context"
	"os"
	"slices"
	"sync"
	"syscall"

	gofs "github.com/hanwen/go-fuse/v2/fs"
	"golang.org/x/sys/unix"

	"github.com/gdsfs/gdsfs/ctl"
)

// fileHandle is one open of a data file: go-fuse's loopback file (which
// does the I/O when the daemon serves it) plus what gdsfs adds.
type fileHandle struct {
	*gofs.LoopbackFile
	m        *mountState
	n        *node
	fd       int    // the loopback file's descriptor, registered on n
	path     string // backing path
	writable bool   // opened for writing or with O_TRUNC
	acc      int    // the open's access mode (O_RDONLY, O_WRONLY, O_RDWR)
	uid      uint32 // the opener, charged for the handle's descriptors

	// flk is the descriptor holding the open's flock locks, opened on
	// its first flock (posixlock.go); ok says it is open.
	flk struct {
		sync.Mutex
		fd int
		ok bool
	}

	// os is a duplicate of the loopback file's descriptor as an *os.File,
	// made on the first control-path ioctl (most opens never need one).
	// It shares the open file description, so it has the client's open
	// flags and offset.
	os struct {
		sync.Mutex
		f *os.File
		// charged is what the handle holds of its uid's budget: 1,
		// and 1 more with f.
		charged int64
	}
}

var (
	_ = (gofs.FilePassthroughFder)((*fileHandle)(nil))
	_ = (gofs.FileIoctler)((*fileHandle)(nil))
	_ = (gofs.FileReleaser)((*fileHandle)(nil))
	_ = (gofs.FileWriter)((*fileHandle)(nil))
	_ = (gofs.FileAllocater)((*fileHandle)(nil))
	_ = (gofs.FileGetlker)((*fileHandle)(nil))
	_ = (gofs.FileSetlker)((*fileHandle)(nil))
	_ = (gofs.FileSetlkwer)((*fileHandle)(nil))
	_ = (gofs.FileFlusher)((*fileHandle)(nil))
)

// PassthroughFd offers the descriptor to go-fuse only if the kernel accepts
// it (see passthrough.vet), so a refusal never turns passthrough off for
// the whole mount.
func (h *fileHandle) PassthroughFd() (int, bool) {
	fd, ok := h.LoopbackFile.PassthroughFd()
	if !ok {
		return 0, false
	}
	return fd, h.m.pt.vet(fd, h.path)
}

// Ioctl serves control-path ioctls; without a Control every ioctl fails
// with ENOTTY.
func (h *fileHandle) Ioctl(ctx context.Context, cmd uint32, arg uint64, in, out []byte) (int32, syscall.Errno) {
	if h.m.ctl == nil {
		return 0, syscall.ENOTTY
	}
	if !ctl.OurCmd(cmd) {
		// Not a control-path command (Python's open() asks isatty with
		// TCGETS): no descriptor for it, Control only counts it.
		return h.m.ctl.FileIoctl(ctx, callerOf(ctx), nil, h.path, cmd, in, out)
	}
	f, errno := h.osFile()
	if errno != 0 {
		return 0, errno
	}
	return h.m.ctl.FileIoctl(ctx, callerOf(ctx), f, h.path, cmd, in, out)
}

func (h *fileHandle) osFile() (*os.File, syscall.Errno) {
	h.os.Lock()
	defer h.os.Unlock()
	if h.os.f != nil {
		return h.os.f, 0
	}
	fd, ok := h.LoopbackFile.PassthroughFd()
	if !ok {
		return nil, syscall.EBADF
	}
	// The loopback file owns fd and closes it on Release; a duplicate
	// gives Control an *os.File with its own lifetime. It is the
	// opener's descriptor too.
	if errno := h.m.opens.acquire(h.uid, 1); errno != 0 {
		return nil, errno
	}
	dup, err := dupCloexec(fd)
	if err != nil {
		h.m.opens.release(h.uid, 1)
		return nil, gofs.ToErrno(err)
	}
	h.os.charged++
	h.os.f = os.NewFile(uintptr(dup), h.path)
	return h.os.f, 0
}

// Write serves a daemon-side write (no passthrough) and reports it.
func (h *fileHandle) Write(ctx context.Context, data []byte, off int64) (uint32, syscall.Errno) {
	n, errno := h.LoopbackFile.Write(ctx, data, off)
	h.m.changed(h.path)
	return n, errno
}

// Allocate serves fallocate and reports it.
func (h *fileHandle) Allocate(ctx context.Context, off, size uint64, mode uint32) syscall.Errno {
	errno := h.LoopbackFile.Allocate(ctx, off, size, mode)
	h.m.changed(h.path)
	return errno
}

// Release closes the backing file (and the control path's duplicate), and
// reports the end of a write open.
func (h *fileHandle) Release(ctx context.Context) syscall.Errno {
	h.os.Lock()
	if h.os.f != nil {
		if fc, ok := h.m.ctl.(FileCloser); ok {
			fc.FileClosed(h.os.f)
		}
		h.os.f.Close()
		h.os.f = nil
	}
	h.m.opens.release(h.uid, h.os.charged)
	h.os.charged = 0
	h.os.Unlock()
	h.n.files.Lock()
	h.n.files.fds = slices.DeleteFunc(h.n.files.fds, func(fd int) bool { return fd == h.fd })
	h.n.files.Unlock()
	h.n.locks.release(h)
	h.closeFlock()
	errno := h.LoopbackFile.Release(ctx)
	if h.writable {
		h.m.changed(h.path)
	}
	return errno
}

func dupCloexec(fd int) (int, error) {
	return unix.FcntlInt(uintptr(fd), unix.F_DUPFD_CLOEXEC, 0)
}

var _ = (gofs.NodeCopyFileRanger)((*node)(nil))

// CopyFileRange lets the backing filesystem copy (or reflink) between two
// files of the mount. go-fuse's loopback only accepts its own handle type,
// so both handles are unwrapped; the destination is reported as changed.
func (n *node) CopyFileRange(ctx context.Context, fhIn gofs.FileHandle, offIn uint64, out *gofs.Inode, fhOut gofs.FileHandle, offOut, size, flags uint64) (uint32, syscall.Errno) {
	in, ok1 := fhIn.(*fileHandle)
	dst, ok2 := fhOut.(*fileHandle)
	if !ok1 || !ok2 {
		return 0, syscall.EOPNOTSUPP // the kernel falls back to a plain copy
	}
	count, errno := n.LoopbackNode.CopyFileRange(ctx, in.LoopbackFile, offIn, out, dst.LoopbackFile, offOut, size, flags)
	n.m.changed(dst.path)
	return count, errno
}
