package metrics

import (
	"strconv"
	"syscall"
)

// other is the label value for anything outside a bounded table.
const other = "other"

// fuseOps are the FUSE operation names recorded as themselves, spelled as
// go-fuse's RawFileSystem methods spell them. Anything else is "other".
var fuseOps = setOf(
	"Lookup", "Forget", "GetAttr", "SetAttr", "Mknod", "Mkdir", "Unlink", "Rmdir",
	"Rename", "Link", "Symlink", "Readlink", "Access", "Create", "Open", "Read",
	"Write", "Flush", "Fsync", "Release", "OpenDir", "ReadDir", "ReadDirPlus",
	"ReleaseDir", "FsyncDir", "GetXAttr", "ListXAttr", "SetXAttr", "RemoveXAttr",
	"Ioctl", "Fallocate", "Lseek", "CopyFileRange", "StatFs", "GetLk", "SetLk",
	"SetLkw", "Statx",
)

// controlCommands are the control-path commands of docs/protocol.md plus
// the virtual xattrs, recorded as themselves.
var controlCommands = setOf(
	"HELLO", "SLAB", "ALLOC", "RELEASE", "STATUS", "INDEX", "READ", "READ_NAMES", "WRITE",
	"xattr:info", "xattr:backing", "xattr:index", "xattr:stats",
)

// engines are the engine names of docs/protocol.md section 5, plus "fuse"
// for bytes the daemon serves through ordinary FUSE reads and writes (files
// without kernel passthrough).
var engines = setOf("none", "host", "posix", "gds", "gds-compat", "fuse")

var directions = setOf("read", "write")

// errnoNames are the errnos a filesystem or the control path returns;
// others are recorded as "other".
var errnoNames = map[syscall.Errno]string{
	syscall.EPERM: "EPERM", syscall.ENOENT: "ENOENT", syscall.EINTR: "EINTR",
	syscall.EIO: "EIO", syscall.ENXIO: "ENXIO", syscall.E2BIG: "E2BIG",
	syscall.EBADF: "EBADF", syscall.EAGAIN: "EAGAIN", syscall.ENOMEM: "ENOMEM",
	syscall.EACCES: "EACCES", syscall.EFAULT: "EFAULT", syscall.EBUSY: "EBUSY",
	syscall.EEXIST: "EEXIST", syscall.EXDEV: "EXDEV", syscall.ENODEV: "ENODEV",
	syscall.ENOTDIR: "ENOTDIR", syscall.EISDIR: "EISDIR", syscall.EINVAL: "EINVAL",
	syscall.ENFILE: "ENFILE", syscall.EMFILE: "EMFILE", syscall.ENOTTY: "ENOTTY",
	syscall.EFBIG: "EFBIG", syscall.ENOSPC: "ENOSPC", syscall.ESPIPE: "ESPIPE",
	syscall.EROFS: "EROFS", syscall.EMLINK: "EMLINK", syscall.ERANGE: "ERANGE",
	syscall.ENAMETOOLONG: "ENAMETOOLONG", syscall.ENOSYS: "ENOSYS",
	syscall.ENOTEMPTY: "ENOTEMPTY", syscall.ELOOP: "ELOOP", syscall.ENODATA: "ENODATA",
	syscall.EPROTO: "EPROTO", syscall.EOVERFLOW: "EOVERFLOW",
	syscall.EOPNOTSUPP: "EOPNOTSUPP", syscall.EDQUOT: "EDQUOT", syscall.ESTALE: "ESTALE",
	syscall.ENOTCONN: "ENOTCONN", syscall.ETIMEDOUT: "ETIMEDOUT",
	syscall.ECANCELED: "ECANCELED",
}

// ErrnoName returns the errno's name as errno(3) spells it ("EIO"), or
// "other" for an errno outside the table. It is the label value metrics use.
func ErrnoName(e syscall.Errno) string {
	if n, ok := errnoNames[e]; ok {
		return n
	}
	return other
}

func setOf(names ...string) map[string]bool {
	m := make(map[string]bool, len(names))
	for _, n := range names {
		m[n] = true
	}
	return m
}

// bounded returns v if the table holds it, "other" otherwise.
func bounded(table map[string]bool, v string) string {
	if table[v] {
		return v
	}
	return other
}

// deviceLabel names a device: "host" for shared host memory (-1), the CUDA
// ordinal otherwise.
func deviceLabel(d int) string {
	if d < 0 {
		return "host"
	}
	return strconv.Itoa(d)
}
