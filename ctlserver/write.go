package ctlserver

import (
	"context"
	"os"
	"syscall"

	"github.com/gdsfs/gdsfs/ctl"
	"github.com/gdsfs/gdsfs/fs"
)

// write serves WRITE.
func (s *Server) write(ctx context.Context, c fs.Caller, f *os.File, path string, in, out []byte) syscall.Errno {
	if len(in) != ctl.SizeWrite || len(out) != ctl.SizeWrite {
		return syscall.EINVAL
	}
	_, errno := statFile(f)
	if errno != 0 {
		return errno
	}
	req, err := ctl.DecodeWriteRequest(in)
	if err != nil {
		return plainErrno(err)
	}
	if s.opts.ReadOnly {
		return syscall.EROFS
	}
	ss, errno := s.session(req.Token, c)
	if errno != 0 {
		return errno
	}
	if !ss.enter() {
		return syscall.EPERM
	}
	defer ss.leave()
	if ctl.AddOverflows(req.FileOffset, req.Length) || ctl.AddOverflows(req.LeaseOffset, req.Length) {
		return syscall.ERANGE
	}
	if req.Length == 0 {
		return syscall.EINVAL
	}
	if !writable(f) {
		return syscall.EBADF
	}
	// The lease stays allocated until the write is done (its RELEASE waits).
	li, l, unpin, errno := ss.pinLease(req.Lease)
	if errno != 0 {
		return errno
	}
	defer unpin()
	if req.LeaseOffset+req.Length > uint64(li.valid) {
		return syscall.EINVAL
	}
	eng, errno := s.engine(c, f, path, 0, -1) // about the whole file, as WRITE always asked
	if errno != 0 {
		return errno
	}
	// The daemon writes as root (CAP_FSETID): clear setuid/setgid as
	// the kernel does before a write by the caller.
	if err := fs.ClearSetID(f, c); err != nil {
		return s.ioErrno(err, "write", path)
	}
	srcOff := li.slabOff + int64(req.LeaseOffset)
	n, err := eng.WriteAt(ctx, f, l.Slab.Memory, srcOff, int64(req.FileOffset), int64(req.Length))
	s.Changed(path)
	if err != nil {
		return s.ioErrno(err, "write", path)
	}
	if n != int64(req.Length) {
		s.opts.Log.Error().Str("path", path).Int64("wrote", n).Uint64("want", req.Length).Msg("BUG: ctl: engine wrote short without an error")
		return syscall.EIO
	}
	if req.Flags&ctl.WriteSync != 0 {
		if err := fdatasync(f); err != nil {
			return s.ioErrno(err, "fdatasync", path)
		}
	}
	s.counters.writes.Add(1)
	s.counters.writeBytes.Add(req.Length)
	(&ctl.WriteReply{Written: req.Length, Engine: ctl.EngineCodeOf(eng.Name())}).Encode(out)
	return 0
}
