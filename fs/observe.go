package fs

import (
	"syscall"
	"time"

	"github.com/hanwen/go-fuse/v2/fuse"
)

// Observer receives every FUSE operation the daemon serves, for metrics
// (*metrics.Metrics satisfies it). Operations the kernel serves itself
// (passthrough reads and writes, cached attributes) never reach it. Its
// methods are called concurrently from every FUSE worker goroutine and
// must not block.
type Observer interface {
	// ObserveFUSE records one operation: its name as go-fuse's
	// RawFileSystem spells it ("Lookup", "Read", ...), the time the daemon
	// took, and its errno (0 on success; ENOENT from Lookup and ENODATA
	// from GetXAttr are ordinary answers, not failures).
	ObserveFUSE(op string, d time.Duration, errno syscall.Errno)
	// AddBytes records bytes the daemon itself served for a FUSE Read or
	// Write (engine "fuse"; files without passthrough). For a read the
	// count is the size of the reply the daemon prepared: at end of file
	// the kernel may deliver fewer.
	AddBytes(engine, direction string, n int64)
}

// observedFS times every operation of the wrapped raw filesystem. It
// changes no result.
type observedFS struct {
	fuse.RawFileSystem
	obs Observer
}

func (o *observedFS) done(op string, start time.Time, st fuse.Status) {
	var errno syscall.Errno
	if st != fuse.OK {
		errno = syscall.Errno(st)
	}
	o.obs.ObserveFUSE(op, time.Since(start), errno)
}

func (o *observedFS) Lookup(c <-chan struct{}, h *fuse.InHeader, name string, out *fuse.EntryOut) fuse.Status {
	t := time.Now()
	st := o.RawFileSystem.Lookup(c, h, name, out)
	o.done("Lookup", t, st)
	return st
}

func (o *observedFS) GetAttr(c <-chan struct{}, in *fuse.GetAttrIn, out *fuse.AttrOut) fuse.Status {
	t := time.Now()
	st := o.RawFileSystem.GetAttr(c, in, out)
	o.done("GetAttr", t, st)
	return st
}

func (o *observedFS) SetAttr(c <-chan struct{}, in *fuse.SetAttrIn, out *fuse.AttrOut) fuse.Status {
	t := time.Now()
	st := o.RawFileSystem.SetAttr(c, in, out)
	o.done("SetAttr", t, st)
	return st
}

func (o *observedFS) Mknod(c <-chan struct{}, in *fuse.MknodIn, name string, out *fuse.EntryOut) fuse.Status {
	t := time.Now()
	st := o.RawFileSystem.Mknod(c, in, name, out)
	o.done("Mknod", t, st)
	return st
}

func (o *observedFS) Mkdir(c <-chan struct{}, in *fuse.MkdirIn, name string, out *fuse.EntryOut) fuse.Status {
	t := time.Now()
	st := o.RawFileSystem.Mkdir(c, in, name, out)
	o.done("Mkdir", t, st)
	return st
}

func (o *observedFS) Unlink(c <-chan struct{}, h *fuse.InHeader, name string) fuse.Status {
	t := time.Now()
	st := o.RawFileSystem.Unlink(c, h, name)
	o.done("Unlink", t, st)
	return st
}

func (o *observedFS) Rmdir(c <-chan struct{}, h *fuse.InHeader, name string) fuse.Status {
	t := time.Now()
	st := o.RawFileSystem.Rmdir(c, h, name)
	o.done("Rmdir", t, st)
	return st
}

func (o *observedFS) Rename(c <-chan struct{}, in *fuse.RenameIn, oldName, newName string) fuse.Status {
	t := time.Now()
	st := o.RawFileSystem.Rename(c, in, oldName, newName)
	o.done("Rename", t, st)
	return st
}

func (o *observedFS) Link(c <-chan struct{}, in *fuse.LinkIn, name string, out *fuse.EntryOut) fuse.Status {
	t := time.Now()
	st := o.RawFileSystem.Link(c, in, name, out)
	o.done("Link", t, st)
	return st
}

func (o *observedFS) Symlink(c <-chan struct{}, h *fuse.InHeader, target, name string, out *fuse.EntryOut) fuse.Status {
	t := time.Now()
	st := o.RawFileSystem.Symlink(c, h, target, name, out)
	o.done("Symlink", t, st)
	return st
}

func (o *observedFS) Readlink(c <-chan struct{}, h *fuse.InHeader) ([]byte, fuse.Status) {
	t := time.Now()
	b, st := o.RawFileSystem.Readlink(c, h)
	o.done("Readlink", t, st)
	return b, st
}

func (o *observedFS) Access(c <-chan struct{}, in *fuse.AccessIn) fuse.Status {
	t := time.Now()
	st := o.RawFileSystem.Access(c, in)
	o.done("Access", t, st)
	return st
}

func (o *observedFS) GetXAttr(c <-chan struct{}, h *fuse.InHeader, attr string, dest []byte) (uint32, fuse.Status) {
	t := time.Now()
	n, st := o.RawFileSystem.GetXAttr(c, h, attr, dest)
	o.done("GetXAttr", t, st)
	return n, st
}

func (o *observedFS) ListXAttr(c <-chan struct{}, h *fuse.InHeader, dest []byte) (uint32, fuse.Status) {
	t := time.Now()
	n, st := o.RawFileSystem.ListXAttr(c, h, dest)
	o.done("ListXAttr", t, st)
	return n, st
}

func (o *observedFS) SetXAttr(c <-chan struct{}, in *fuse.SetXAttrIn, attr string, data []byte) fuse.Status {
	t := time.Now()
	st := o.RawFileSystem.SetXAttr(c, in, attr, data)
	o.done("SetXAttr", t, st)
	return st
}

func (o *observedFS) RemoveXAttr(c <-chan struct{}, h *fuse.InHeader, attr string) fuse.Status {
	t := time.Now()
	st := o.RawFileSystem.RemoveXAttr(c, h, attr)
	o.done("RemoveXAttr", t, st)
	return st
}

func (o *observedFS) Create(c <-chan struct{}, in *fuse.CreateIn, name string, out *fuse.CreateOut) fuse.Status {
	t := time.Now()
	st := o.RawFileSystem.Create(c, in, name, out)
	o.done("Create", t, st)
	return st
}

func (o *observedFS) Open(c <-chan struct{}, in *fuse.OpenIn, out *fuse.OpenOut) fuse.Status {
	t := time.Now()
	st := o.RawFileSystem.Open(c, in, out)
	o.done("Open", t, st)
	return st
}

func (o *observedFS) Read(c <-chan struct{}, in *fuse.ReadIn, buf []byte) (fuse.ReadResult, fuse.Status) {
	t := time.Now()
	r, st := o.RawFileSystem.Read(c, in, buf)
	o.done("Read", t, st)
	if st == fuse.OK && r != nil {
		o.obs.AddBytes("fuse", "read", int64(r.Size()))
	}
	return r, st
}

func (o *observedFS) Lseek(c <-chan struct{}, in *fuse.LseekIn, out *fuse.LseekOut) fuse.Status {
	t := time.Now()
	st := o.RawFileSystem.Lseek(c, in, out)
	o.done("Lseek", t, st)
	return st
}

func (o *observedFS) GetLk(c <-chan struct{}, in *fuse.LkIn, out *fuse.LkOut) fuse.Status {
	t := time.Now()
	st := o.RawFileSystem.GetLk(c, in, out)
	o.done("GetLk", t, st)
	return st
}

func (o *observedFS) SetLk(c <-chan struct{}, in *fuse.LkIn) fuse.Status {
	t := time.Now()
	st := o.RawFileSystem.SetLk(c, in)
	o.done("SetLk", t, st)
	return st
}

// SetLkw blocks until the lock is granted; its duration is the wait.
func (o *observedFS) SetLkw(c <-chan struct{}, in *fuse.LkIn) fuse.Status {
	t := time.Now()
	st := o.RawFileSystem.SetLkw(c, in)
	o.done("SetLkw", t, st)
	return st
}

func (o *observedFS) Release(c <-chan struct{}, in *fuse.ReleaseIn) {
	t := time.Now()
	o.RawFileSystem.Release(c, in)
	o.done("Release", t, fuse.OK)
}

func (o *observedFS) Write(c <-chan struct{}, in *fuse.WriteIn, data []byte) (uint32, fuse.Status) {
	t := time.Now()
	n, st := o.RawFileSystem.Write(c, in, data)
	o.done("Write", t, st)
	if st == fuse.OK {
		o.obs.AddBytes("fuse", "write", int64(n))
	}
	return n, st
}

func (o *observedFS) CopyFileRange(c <-chan struct{}, in *fuse.CopyFileRangeIn) (uint32, fuse.Status) {
	t := time.Now()
	n, st := o.RawFileSystem.CopyFileRange(c, in)
	o.done("CopyFileRange", t, st)
	return n, st
}

func (o *observedFS) Ioctl(c <-chan struct{}, in *fuse.IoctlIn, inbuf []byte, out *fuse.IoctlOut, outbuf []byte) fuse.Status {
	t := time.Now()
	st := o.RawFileSystem.Ioctl(c, in, inbuf, out, outbuf)
	o.done("Ioctl", t, st)
	return st
}

func (o *observedFS) Flush(c <-chan struct{}, in *fuse.FlushIn) fuse.Status {
	t := time.Now()
	st := o.RawFileSystem.Flush(c, in)
	o.done("Flush", t, st)
	return st
}

func (o *observedFS) Fsync(c <-chan struct{}, in *fuse.FsyncIn) fuse.Status {
	t := time.Now()
	st := o.RawFileSystem.Fsync(c, in)
	o.done("Fsync", t, st)
	return st
}

func (o *observedFS) Fallocate(c <-chan struct{}, in *fuse.FallocateIn) fuse.Status {
	t := time.Now()
	st := o.RawFileSystem.Fallocate(c, in)
	o.done("Fallocate", t, st)
	return st
}

func (o *observedFS) OpenDir(c <-chan struct{}, in *fuse.OpenIn, out *fuse.OpenOut) fuse.Status {
	t := time.Now()
	st := o.RawFileSystem.OpenDir(c, in, out)
	o.done("OpenDir", t, st)
	return st
}

func (o *observedFS) ReadDir(c <-chan struct{}, in *fuse.ReadIn, out *fuse.DirEntryList) fuse.Status {
	t := time.Now()
	st := o.RawFileSystem.ReadDir(c, in, out)
	o.done("ReadDir", t, st)
	return st
}

func (o *observedFS) ReadDirPlus(c <-chan struct{}, in *fuse.ReadIn, out *fuse.DirEntryList) fuse.Status {
	t := time.Now()
	st := o.RawFileSystem.ReadDirPlus(c, in, out)
	o.done("ReadDirPlus", t, st)
	return st
}

func (o *observedFS) ReleaseDir(in *fuse.ReleaseIn) {
	t := time.Now()
	o.RawFileSystem.ReleaseDir(in)
	o.done("ReleaseDir", t, fuse.OK)
}

func (o *observedFS) FsyncDir(c <-chan struct{}, in *fuse.FsyncIn) fuse.Status {
	t := time.Now()
	st := o.RawFileSystem.FsyncDir(c, in)
	o.done("FsyncDir", t, st)
	return st
}

func (o *observedFS) StatFs(c <-chan struct{}, h *fuse.InHeader, out *fuse.StatfsOut) fuse.Status {
	t := time.Now()
	st := o.RawFileSystem.StatFs(c, h, out)
	o.done("StatFs", t, st)
	return st
}

func (o *observedFS) Statx(c <-chan struct{}, in *fuse.StatxIn, out *fuse.StatxOut) fuse.Status {
	t := time.Now()
	st := o.RawFileSystem.Statx(c, in, out)
	o.done("Statx", t, st)
	return st
}
