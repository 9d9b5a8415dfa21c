package cache

import (
	"encoding/binary"
	"fmt"
	"os"
	"syscall"
)

// Identity is what makes a cached entry valid for a file: a change through
// any path (write, truncate, replace) changes at least one field, within the
// filesystem's timestamp granularity (see Indexes.Invalidate).
type Identity struct {
	Dev, Ino uint64
	Size     int64
	MtimeNs  int64
	CtimeNs  int64
}

// IdentityOf returns the identity of an os.FileInfo that came from stat or
// fstat on Linux.
func IdentityOf(fi os.FileInfo) (Identity, error) {
	st, ok := fi.Sys().(*syscall.Stat_t)
	if !ok {
		return Identity{}, fmt.Errorf("cache: no stat data for %q", fi.Name())
	}
	return Identity{
		Dev:     uint64(st.Dev),
		Ino:     st.Ino,
		Size:    st.Size,
		MtimeNs: st.Mtim.Nano(),
		CtimeNs: st.Ctim.Nano(),
	}, nil
}

// key is the identity as a compact cache key.
func (id Identity) key() string {
	var b [40]byte
	binary.LittleEndian.PutUint64(b[0:], id.Dev)
	binary.LittleEndian.PutUint64(b[8:], id.Ino)
	binary.LittleEndian.PutUint64(b[16:], uint64(id.Size))
	binary.LittleEndian.PutUint64(b[24:], uint64(id.MtimeNs))
	binary.LittleEndian.PutUint64(b[32:], uint64(id.CtimeNs))
	return string(b[:])
}

// String formats the identity for logs and xattrs.
func (id Identity) String() string {
	return fmt.Sprintf("dev=%d ino=%d size=%d mtime=%d ctime=%d", id.Dev, id.Ino, id.Size, id.MtimeNs, id.CtimeNs)
}
