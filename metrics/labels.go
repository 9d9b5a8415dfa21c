package metrics

import (
	"strconv"
	"syscall"

	"github.com/gdsfs/gdsfs/ctl"
	"github.com/gdsfs/gdsfs/gpubuf"
	"github.com/gdsfs/gdsfs/internal/errname"
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

// controlCommands are the control-path commands of docs/protocol.md
// (ctl.Commands) plus the virtual xattrs, recorded as themselves.
var controlCommands = func() map[string]bool {
	m := setOf("xattr:info", "xattr:backing", "xattr:index", "xattr:stats")
	for _, c := range ctl.Commands() {
		m[c.Name] = true
	}
	return m
}()

// engines are the engine names of docs/protocol.md section 5, plus "fuse"
// for bytes the daemon serves through ordinary FUSE reads and writes (files
// without kernel passthrough).
var engines = setOf(append(ctl.EngineNames(), "fuse")...)

var directions = setOf("read", "write")

// errnoLabels are the errnos a filesystem or the control path returns,
// recorded by name (internal/errname); others are recorded as "other".
var errnoLabels = func() map[syscall.Errno]bool {
	m := map[syscall.Errno]bool{}
	for _, e := range []syscall.Errno{
		syscall.EPERM, syscall.ENOENT, syscall.EINTR, syscall.EIO, syscall.ENXIO, syscall.E2BIG,
		syscall.EBADF, syscall.EAGAIN, syscall.ENOMEM, syscall.EACCES, syscall.EFAULT, syscall.EBUSY,
		syscall.EEXIST, syscall.EXDEV, syscall.ENODEV, syscall.ENOTDIR, syscall.EISDIR,
		syscall.EINVAL, syscall.ENFILE, syscall.EMFILE, syscall.ENOTTY, syscall.EFBIG, syscall.ENOSPC,
		syscall.ESPIPE, syscall.EROFS, syscall.EMLINK, syscall.ERANGE, syscall.ENAMETOOLONG,
		syscall.ENOSYS, syscall.ENOTEMPTY, syscall.ELOOP, syscall.ENODATA, syscall.EPROTO,
		syscall.EOVERFLOW, syscall.EOPNOTSUPP, syscall.EDQUOT, syscall.ESTALE, syscall.ENOTCONN,
		syscall.ETIMEDOUT, syscall.ECANCELED,
	} {
		m[e] = true
	}
	return m
}()

// ErrnoName returns the errno's name as errno(3) spells it ("EIO"), or
// "other" for an errno outside the table. It is the label value metrics use.
func ErrnoName(e syscall.Errno) string {
	if errnoLabels[e] {
		return errname.Of(e)
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

// deviceLabel names a device of a pool whose memory is backend's: "host"
// for shared host memory (the host backend's one device), the CUDA
// ordinal otherwise.
func deviceLabel(backend string, d int) string {
	if backend == gpubuf.HostBackendName {
		return "host"
	}
	return strconv.Itoa(d)
}
