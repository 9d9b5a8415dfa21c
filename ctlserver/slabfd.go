package ctlserver

import (
	"context"
	"os"
	"syscall"

	"github.com/gdsfs/gdsfs/ctl"
	"github.com/gdsfs/gdsfs/fs"
	"github.com/gdsfs/gdsfs/gpubuf"
	"github.com/gdsfs/gdsfs/handoff"
	"github.com/gdsfs/gdsfs/handoffserver"
	"github.com/gdsfs/gdsfs/internal/errname"
)

// FDExporter is implemented by slab memory that can be handed to a client
// as a file descriptor on the slab socket: CUDA virtual-memory-management
// allocations (cufile; cuMemExportToShareableHandle) and shared-memory
// files (gpubuf's host backend). ExportFD returns a new descriptor, which
// the caller closes, and the bytes a client maps through it. It may be
// called concurrently, and fails once the memory is closed.
type FDExporter interface {
	ExportFD() (f *os.File, mapBytes int64, err error)
}

// slabKind is the SLAB reply's kind for memory m.
func slabKind(m gpubuf.Memory) uint32 {
	if _, ok := m.(gpubuf.DeviceMemory); ok {
		if _, ok := m.(FDExporter); ok {
			return ctl.SlabCUDAFD
		}
		return ctl.SlabCUDA
	}
	return ctl.SlabHost
}

var _ handoffserver.Source = (*Server)(nil)

// SlabFD implements handoffserver.Source: the descriptor of a slab's memory for
// a process of the session's uid whose session holds a lease in that slab
// (the checks of SLAB, with the uid the kernel reported for the socket's
// peer instead of the ioctl caller's). Memory is per uid for its life
// (gpubuf), so a descriptor, and any mapping made from it, only ever
// reaches memory of the uid it was handed to.
func (s *Server) SlabFD(ctx context.Context, peer handoff.Peer, req handoff.Request) (handoffserver.Handle, syscall.Errno) {
	h, errno := s.slabFD(ctx, peer, req)
	s.counters.result(errno)
	if errno != 0 {
		s.opts.Log.Debug().Str("op", "slab-fd").Uint64("session", req.Session).Uint64("slab", req.Slab).
			Uint32("uid", peer.UID).Int32("pid", peer.PID).Str("errno", errname.Of(errno)).Msg("ctl: refused")
	}
	return h, errno
}

func (s *Server) slabFD(ctx context.Context, peer handoff.Peer, req handoff.Request) (handoffserver.Handle, syscall.Errno) {
	if err := ctx.Err(); err != nil {
		return handoffserver.Handle{}, syscall.EINTR
	}
	tok := ctl.Token{Session: req.Session, Secret: req.Secret}
	if tok.IsZero() {
		return handoffserver.Handle{}, syscall.EPERM // the socket has no control file to name a session
	}
	ss, errno := s.session(tok, fs.Caller{UID: peer.UID, PID: uint32(peer.PID)})
	if errno != 0 {
		return handoffserver.Handle{}, errno
	}
	if !ss.enter() {
		return handoffserver.Handle{}, syscall.EPERM
	}
	defer ss.leave()
	// The handle's bytes (a path, or nothing) are not needed here: only
	// export's check that the session holds a lease in the slab.
	sl, _, errno := ss.export(req.Slab)
	if errno != 0 {
		return handoffserver.Handle{}, errno
	}
	fe, ok := sl.Memory.(FDExporter)
	if !ok {
		return handoffserver.Handle{}, syscall.EOPNOTSUPP
	}
	f, n, err := fe.ExportFD()
	if err != nil {
		s.opts.Log.Error().Err(err).Uint64("slab", req.Slab).Msg("ctl: export slab descriptor")
		return handoffserver.Handle{}, syscall.EIO
	}
	return handoffserver.Handle{File: f, Bytes: uint64(n)}, 0
}
