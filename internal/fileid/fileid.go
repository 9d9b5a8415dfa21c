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

// Version is the FNV-1a 64 hash of the identity's fields in Key's byte
// order, never 0: a version of the file's contents that any write,
// truncate or in-place rewrite changes (within the filesystem's timestamp
// granularity). The control path's INDEX names it and READ checks it.
func (id ID) Version() uint64 {
	// Over the fields' little-endian bytes as Key lays them out, without
	// Key's allocation (it is computed twice per READ).
	v := uint64(14695981039346656037)
	for _, x := range [5]uint64{id.Dev, id.Ino, uint64(id.Size), uint64(id.MtimeNs), uint64(id.CtimeNs)} {
		for range 8 {
			v = (v ^ (x & 0xff)) * 1099511628211
			x >>= 8
		}
	}
	if v == 0 {
		v = 1
	}
	return v
}

// String formats the identity for logs and xattrs.
func (id ID) String() string {
	return fmt.Sprintf("dev=%d ino=%d size=%d mtime=%d ctime=%d", id.Dev, id.Ino, id.Size, id.MtimeNs, id.CtimeNs)
}
