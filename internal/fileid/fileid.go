// Package fileid names files of the host independently of the paths and
// descriptors that reach them: the one file-identity type of gdsfs.
package fileid

import (
	"encoding/binary"
	"fmt"
	"os"
	"syscall"
)

// Inode is a file of the host: its device and inode number, the same for
// every path and descriptor that reaches it.
type Inode struct {
	Dev, Ino uint64
}

// ID is a file at one version of its contents: a change through any path
// (write, truncate, replace) changes at least one field, within the
// filesystem's timestamp granularity.
type ID struct {
	Inode
	Size    int64
	MtimeNs int64
	CtimeNs int64
}

// Of returns the identity of an os.FileInfo that came from stat or fstat
// on Linux.
func Of(fi os.FileInfo) (ID, error) {
	st, ok := fi.Sys().(*syscall.Stat_t)
	if !ok {
		return ID{}, fmt.Errorf("fileid: no stat data for %q", fi.Name())
	}
	return FromStat(st), nil
}

// FromStat returns the identity stat(2) reported in st.
func FromStat(st *syscall.Stat_t) ID {
	return ID{
		Inode:   Inode{Dev: uint64(st.Dev), Ino: st.Ino},
		Size:    st.Size,
		MtimeNs: st.Mtim.Nano(),
		CtimeNs: st.Ctim.Nano(),
	}
}

// OfFile returns the identity of the file f names (fstat).
func OfFile(f *os.File) (ID, error) {
	var st syscall.Stat_t
	if err := syscall.Fstat(int(f.Fd()), &st); err != nil {
		return ID{}, fmt.Errorf("stat %q: %w", f.Name(), err)
	}
	return FromStat(&st), nil
}

// Key is the identity as a compact map or cache key.
func (id ID) Key() string {
	var b [40]byte
	binary.LittleEndian.PutUint64(b[0:], id.Dev)
	binary.LittleEndian.PutUint64(b[8:], id.Ino)
	binary.LittleEndian.PutUint64(b[16:], uint64(id.Size))
	binary.LittleEndian.PutUint64(b[24:], uint64(id.MtimeNs))
	binary.LittleEndian.PutUint64(b[32:], uint64(id.CtimeNs))
	return string(b[:])
}

// String formats the identity for logs and xattrs.
func (id ID) String() string {
	return fmt.Sprintf("dev=%d ino=%d size=%d mtime=%d ctime=%d", id.Dev, id.Ino, id.Size, id.MtimeNs, id.CtimeNs)
}
