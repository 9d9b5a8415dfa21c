package pagecache

import (
	"bytes"
	"errors"
	"os"
	"syscall"

	"golang.org/x/sys/unix"
)

// fuseSuperMagic is statfs(2)'s f_type of FUSE file systems.
const fuseSuperMagic = 0x65735546

// backingXattr names, on a gdsfs mount, the absolute path of a file's
// backing file (served by the daemon; package ctlserver).
const backingXattr = "user.gdsfs.backing"

// prober finds, for a file being warmed, the file whose page cache holds
// its bytes: the file itself, or, on a gdsfs mount, its backing file. With
// kernel passthrough a gdsfs mount's reads go straight to the backing file
// and the FUSE inode caches nothing; without it the daemon reads the
// backing file (and the FUSE inode's own cache is dropped at every open).
// Either way the backing file is where the data stays cached, and the
// FUSE file's cachestat(2) reports 0. It remembers per device whether it
// is a FUSE file system (one statfs per device, not per file).
type prober struct {
	fuse map[uint64]bool
}

// source is the file to measure f's residency on, and a func closing it
// (a no-op when it is f). ok is false when the kernel cannot tell this
// process: a file on a gdsfs mount whose backing file it cannot open (a
// backing directory closed to it), or that is not the same file any more.
func (p *prober) source(f *os.File, st os.FileInfo) (m *os.File, done func(), ok bool) {
	same := func() {}
	sys, isSys := st.Sys().(*syscall.Stat_t)
	if !isSys {
		return f, same, true
	}
	if p.fuse == nil {
		p.fuse = map[uint64]bool{}
	}
	fuse, seen := p.fuse[sys.Dev]
	if !seen {
		var fs unix.Statfs_t
		fuse = unix.Fstatfs(int(f.Fd()), &fs) == nil && fs.Type == fuseSuperMagic
		p.fuse[sys.Dev] = fuse
	}
	if !fuse {
		return f, same, true
	}
	buf := make([]byte, 4096)
	n, err := unix.Fgetxattr(int(f.Fd()), backingXattr, buf)
	if err != nil {
		return f, same, true // FUSE, not gdsfs: its own page cache is the one
	}
	path := string(bytes.TrimRight(buf[:n], "\x00"))
	// The user's own open (the kernel checks its permissions), never
	// following a symlink, never blocking (a FIFO swapped in), and only if
	// it is the file the mount shows (gdsfs reports the backing inode).
	b, err := os.OpenFile(path, os.O_RDONLY|unix.O_NOFOLLOW|unix.O_NONBLOCK|unix.O_NOCTTY, 0)
	if err != nil {
		return nil, same, false
	}
	bst, err := b.Stat()
	bsys, bok := bst.Sys().(*syscall.Stat_t)
	if err != nil || !bok || !bst.Mode().IsRegular() || bsys.Ino != sys.Ino || bst.Size() != st.Size() {
		b.Close()
		return nil, same, false
	}
	return b, func() { b.Close() }, true
}

// mincoreTells reports whether mincore(2) on a mapping of f tells this
// process the truth. For a file the caller neither owns nor may write, the
// kernel pretends every page is resident (mm/mincore.c, can_do_mincore:
// against page-cache side channels), as cachestat(2) answers it EPERM.
func mincoreTells(f *os.File) bool {
	st, err := f.Stat()
	if err != nil {
		return false
	}
	sys, ok := st.Sys().(*syscall.Stat_t)
	if !ok {
		return false
	}
	euid := uint32(os.Geteuid())
	if euid == 0 || sys.Uid == euid {
		return true
	}
	return unix.Faccessat(unix.AT_FDCWD, f.Name(), unix.W_OK, unix.AT_EACCESS) == nil
}

// errRefused reports a cachestat(2) refused on permission: the kernel will
// not tell this process (mincore would pretend all is cached).
func errRefused(err error) bool { return errors.Is(err, unix.EPERM) || errors.Is(err, unix.EACCES) }
