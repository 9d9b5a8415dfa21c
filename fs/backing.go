package fs

import (
	"fmt"
	"os"
	"strings"
	"syscall"

	gofs "github.com/hanwen/go-fuse/v2/fs"
	"golang.org/x/sys/unix"
)

// Backing paths are never handed to the kernel as absolute paths. The
// mount keeps a descriptor of the backing root (mountState.rootFd), and
// every operation resolves the node's path relative to it with openat2
// (RESOLVE_BENEATH|RESOLVE_NO_SYMLINKS|RESOLVE_NO_MAGICLINKS), then acts on
// the last component with an *at call that does not follow it. A symlink
// planted anywhere in the backing tree therefore fails the resolution
// (ELOOP) instead of leading the daemon, which runs as root, elsewhere;
// the kernel follows the mount's own symlinks itself (READLINK), so the
// daemon never needs to. It also drops the backing root's length from
// every path: a path within PATH_MAX through the mount stays within it.
//
// What the kernel names by node is checked to still be that node: an
// object reached by path whose inode number or type differs from the
// node's (the entry was replaced directly in the backing directory) is
// answered with ESTALE, on which the kernel looks the name up again and
// retries once.

const resolveFlags = unix.RESOLVE_BENEATH | unix.RESOLVE_NO_SYMLINKS | unix.RESOLVE_NO_MAGICLINKS

// maxResolve bounds the path given to one openat2 (PATH_MAX is 4096 with
// the NUL); longer relative paths (deep trees reached by relative paths
// through the mount) are resolved in several steps.
const maxResolve = 4000

// openRel opens rel, a path relative to the backing root ("" for the root
// itself), with flags (O_CLOEXEC is added). Intermediate steps of long
// paths are opened O_PATH.
func (m *mountState) openRel(rel string, flags int) (int, error) {
	if rel == "" {
		return openat2(m.rootFd, ".", flags)
	}
	dir, owned := m.rootFd, false
	for {
		part, rest := rel, ""
		if len(rel) > maxResolve {
			i := strings.LastIndexByte(rel[:maxResolve], '/')
			if i <= 0 {
				if owned {
					unix.Close(dir)
				}
				return -1, syscall.ENAMETOOLONG
			}
			part, rest = rel[:i], rel[i+1:]
		}
		fl := flags
		if rest != "" {
			fl = unix.O_PATH | unix.O_DIRECTORY
		}
		fd, err := openat2(dir, part, fl)
		if owned {
			unix.Close(dir)
		}
		if err != nil || rest == "" {
			return fd, err
		}
		dir, owned, rel = fd, true, rest
	}
}

func openat2(dir int, p string, flags int) (int, error) {
	how := unix.OpenHow{Flags: uint64(flags | unix.O_CLOEXEC), Resolve: resolveFlags}
	for range 16 {
		fd, err := unix.Openat2(dir, p, &how)
		if err == unix.ENOSYS {
			// Linux < 5.6, or a seccomp filter that does not know
			// openat2.
			return openWalk(dir, p, flags)
		}
		// EAGAIN: a concurrent rename during a RESOLVE_BENEATH walk.
		if err != unix.EAGAIN && err != unix.EINTR {
			return fd, err
		}
	}
	return -1, syscall.EAGAIN
}

// openWalk resolves p below dir one component at a time with O_NOFOLLOW,
// as openat2 with resolveFlags does in one call: no symlink is followed
// (ELOOP), and ".." and absolute paths are refused (EXDEV) since they could
// leave dir (names from the kernel never contain them).
func openWalk(dir int, p string, flags int) (int, error) {
	if strings.HasPrefix(p, "/") {
		return -1, syscall.EXDEV
	}
	comps := strings.Split(p, "/")
	cur, owned := dir, false
	for i, c := range comps {
		if c == ".." {
			if owned {
				unix.Close(cur)
			}
			return -1, syscall.EXDEV
		}
		fl := unix.O_PATH | unix.O_DIRECTORY
		if i == len(comps)-1 {
			fl = flags
		}
		fd, err := unix.Openat(cur, c, fl|unix.O_NOFOLLOW|unix.O_CLOEXEC, 0)
		if err == unix.ENOTDIR {
			// O_DIRECTORY|O_NOFOLLOW on a symlink: openat2 says ELOOP.
			var st unix.Stat_t
			if unix.Fstatat(cur, c, &st, unix.AT_SYMLINK_NOFOLLOW) == nil && st.Mode&unix.S_IFMT == unix.S_IFLNK {
				err = syscall.ELOOP
			}
		}
		if owned {
			unix.Close(cur)
		}
		if err != nil {
			return -1, err
		}
		cur, owned = fd, true
	}
	return cur, nil
}

// ino is the inode number gdsfs gives a backing file (as go-fuse's
// loopback does: the backing inode number, with the device mixed in for
// files on other filesystems than the root's).
func (m *mountState) ino(st *syscall.Stat_t) uint64 {
	swapped := (uint64(st.Dev) << 32) | (uint64(st.Dev) >> 32)
	swappedRoot := (m.dev << 32) | (m.dev >> 32)
	return (swapped ^ swappedRoot) ^ st.Ino
}

// dirFd opens the node, a directory, O_PATH, and checks that it is still
// the node's directory.
func (n *node) dirFd() (int, syscall.Errno) {
	if fd := n.keptDirFd(); fd >= 0 {
		return fd, 0
	}
	fd, err := n.m.openRel(n.Path(nil), unix.O_PATH|unix.O_DIRECTORY)
	if err != nil {
		return -1, staleErrno(err)
	}
	if errno := n.verify(fd); errno != 0 {
		unix.Close(fd)
		return -1, errno
	}
	return fd, 0
}

// keptDirFd returns a duplicate of a descriptor of one of the node's open
// directory handles (see dirHandle), or -1 if it has none. Such a
// descriptor is the node's directory by construction (checked when it was
// opened, and it follows the directory wherever it is renamed), and
// duplicating it is much cheaper than resolving the path again (a listing
// looks up every entry in the open directory).
func (n *node) keptDirFd() int {
	n.dirs.Lock()
	defer n.dirs.Unlock()
	if len(n.dirs.fds) == 0 {
		return -1
	}
	fd, err := dupCloexec(n.dirs.fds[0])
	if err != nil {
		return -1
	}
	return fd
}

// parentFd opens the directory holding the node's name, O_PATH, and
// returns it with the name. A node without a name (removed, or created
// with O_TMPFILE) has no path: ENOENT.
func (n *node) parentFd() (int, string, syscall.Errno) {
	name, parent := n.Parent()
	if parent == nil {
		return -1, "", syscall.ENOENT
	}
	if pn, ok := parent.Operations().(*node); ok {
		if fd := pn.keptDirFd(); fd >= 0 {
			return fd, name, 0
		}
	}
	fd, err := n.m.openRel(parent.Path(nil), unix.O_PATH|unix.O_DIRECTORY)
	if err != nil {
		return -1, "", staleErrno(err)
	}
	return fd, name, 0
}

// open opens the node itself, without following it, and checks that what
// it opened is the node's file.
func (n *node) open(flags int) (int, syscall.Errno) {
	if n.IsRoot() {
		fd, err := openat2(n.m.rootFd, ".", flags)
		return fd, gofs.ToErrno(err)
	}
	pfd, name, errno := n.parentFd()
	if errno != 0 {
		if errno == syscall.ENOENT {
			// No name left: renamed over through the mount (the
			// kernel still holds the inode it resolved before).
			if fd, ok := n.openStashed(flags); ok {
				return fd, 0
			}
		}
		return -1, errno
	}
	defer unix.Close(pfd)
	fd, err := unix.Openat(pfd, name, flags|unix.O_NOFOLLOW|unix.O_CLOEXEC, 0)
	if err != nil {
		errno := staleErrno(err)
		if errno == syscall.ESTALE {
			if fd, ok := n.openStashed(flags); ok {
				return fd, 0
			}
		}
		return -1, errno
	}
	if errno := n.verify(fd); errno != 0 {
		unix.Close(fd)
		if errno == syscall.ESTALE {
			// Replaced since the kernel looked it up: open the inode
			// that lookup found, if it was renamed over through the
			// mount and is still stashed.
			if fd, ok := n.openStashed(flags); ok {
				return fd, 0
			}
		}
		return -1, errno
	}
	return fd, 0
}

// staleErrno maps the failure to reach a node by its path. ELOOP (a
// symlink where the kernel knows a directory or the node itself) and
// ENOTDIR (a non-directory where it knows a directory) mean the backing
// tree was changed behind the mount's back: ESTALE makes the kernel look
// the path up again and retry once.
func staleErrno(err error) syscall.Errno {
	errno := gofs.ToErrno(err)
	if errno == syscall.ELOOP || errno == syscall.ENOTDIR {
		return syscall.ESTALE
	}
	return errno
}

// verify checks that fd is the node's backing file.
func (n *node) verify(fd int) syscall.Errno {
	st, gen, err := statAt(fd, "", unix.AT_EMPTY_PATH)
	if err != nil {
		return gofs.ToErrno(err)
	}
	return n.verifyStat(&st, gen)
}

// verifyStat checks that st (with generation gen, from its birth time) is
// the node's backing file: same inode number, type and generation. The
// generation tells apart a new file that reuses a removed file's inode
// number (and that another user may have moved under the old name).
func (n *node) verifyStat(st *syscall.Stat_t, gen uint64) syscall.Errno {
	if n.IsRoot() {
		return 0
	}
	sa := n.StableAttr()
	if n.m.ino(st) != sa.Ino || st.Mode&syscall.S_IFMT != sa.Mode&syscall.S_IFMT || gen != sa.Gen {
		return syscall.ESTALE
	}
	return 0
}

// statAt stats name in dir without following it, with the birth time go-fuse
// uses as the generation number.
func statAt(dir int, name string, flags int) (syscall.Stat_t, uint64, error) {
	var x unix.Statx_t
	if err := unix.Statx(dir, name, flags|unix.AT_SYMLINK_NOFOLLOW, unix.STATX_BASIC_STATS|unix.STATX_BTIME, &x); err != nil {
		return syscall.Stat_t{}, 0, err
	}
	var st syscall.Stat_t
	setNum(&st.Dev, int64(unix.Mkdev(x.Dev_major, x.Dev_minor)))
	setNum(&st.Ino, int64(x.Ino))
	setNum(&st.Nlink, int64(x.Nlink))
	setNum(&st.Mode, int64(x.Mode))
	setNum(&st.Uid, int64(x.Uid))
	setNum(&st.Gid, int64(x.Gid))
	setNum(&st.Rdev, int64(unix.Mkdev(x.Rdev_major, x.Rdev_minor)))
	setNum(&st.Size, int64(x.Size))
	setNum(&st.Blksize, int64(x.Blksize))
	setNum(&st.Blocks, int64(x.Blocks))
	st.Atim = syscall.NsecToTimespec(x.Atime.Sec*1e9 + int64(x.Atime.Nsec))
	st.Mtim = syscall.NsecToTimespec(x.Mtime.Sec*1e9 + int64(x.Mtime.Nsec))
	st.Ctim = syscall.NsecToTimespec(x.Ctime.Sec*1e9 + int64(x.Ctime.Nsec))
	return st, genOf(&x), nil
}

// genOf is go-fuse's generation number for a file: its birth time, or 1
// where the filesystem has none.
func genOf(x *unix.Statx_t) uint64 {
	if x.Mask&unix.STATX_BTIME != 0 && (x.Btime.Sec != 0 || x.Btime.Nsec != 0) {
		return uint64(x.Btime.Sec)*1e9 + uint64(x.Btime.Nsec)
	}
	return 1
}

// setNum assigns v to *dst whatever the field's width on this
// architecture.
func setNum[T ~int16 | ~int32 | ~int64 | ~uint16 | ~uint32 | ~uint64](dst *T, v int64) {
	*dst = T(v)
}

// procPath names an open descriptor as a path (for calls that have no
// descriptor form for O_PATH descriptors: xattrs, truncate).
func procPath(fd int) string { return fmt.Sprintf("/proc/self/fd/%d", fd) }

// ClearSetID clears the setuid bit of f, and its setgid bit when it is
// group-executable, as the kernel does when a caller without CAP_FSETID
// writes to a file (should_remove_suid). The daemon writes as root, which
// holds CAP_FSETID, so writes it does for a caller (the control path's
// WRITE) must do this themselves. Callers of uid 0 are taken to hold
// CAP_FSETID, and nothing is cleared for them.
func ClearSetID(f *os.File, c Caller) error {
	if c.UID == 0 {
		return nil
	}
	var st syscall.Stat_t
	if err := syscall.Fstat(int(f.Fd()), &st); err != nil {
		return fmt.Errorf("clear setuid/setgid of %s: %w", f.Name(), err)
	}
	if st.Mode&syscall.S_IFMT != syscall.S_IFREG {
		return nil
	}
	mode := st.Mode & 0o7777
	kill := uint32(0)
	if mode&syscall.S_ISUID != 0 {
		kill |= syscall.S_ISUID
	}
	if mode&(syscall.S_ISGID|syscall.S_IXGRP) == syscall.S_ISGID|syscall.S_IXGRP {
		kill |= syscall.S_ISGID
	}
	if kill == 0 {
		return nil
	}
	if err := syscall.Fchmod(int(f.Fd()), mode&^kill); err != nil {
		return fmt.Errorf("clear setuid/setgid of %s: %w", f.Name(), err)
	}
	return nil
}
