package fs

import (
	"fmt"
	"sync"
	"sync/atomic"
	"syscall"

	"github.com/hanwen/go-fuse/v2/fuse"
	"github.com/rs/zerolog"
	"golang.org/x/sys/unix"
)

// passthrough tracks whether kernel FUSE passthrough is usable and vets
// each backing descriptor before go-fuse registers it.
//
// go-fuse registers a file's descriptor with the kernel on its first open
// and, on the first refusal, silently stops using passthrough for the whole
// mount. vet registers the descriptor itself first (and unregisters it at
// once): a refusal is logged with its errno, and only that file is served
// by the daemon.
type passthrough struct {
	log zerolog.Logger
	srv atomic.Pointer[fuse.Server]

	// kernelOK is set once by start: the kernel offered passthrough and a
	// probe registration succeeded.
	kernelOK atomic.Bool

	opens, daemon, refused atomic.Uint64

	mu struct {
		sync.Mutex
		why string // current explanation, for Passthrough()
		// firstRefusal is the first per-file refusal, kept for the report.
		firstRefusal string
	}
}

func newPassthrough(log zerolog.Logger) *passthrough {
	p := &passthrough{log: log}
	p.mu.why = "not mounted yet"
	return p
}

// start inspects the kernel's INIT flags and probes a registration with a
// memfd, which stands for any regular file on an unstacked filesystem.
func (p *passthrough) start(srv *fuse.Server, disabled bool) {
	why := "disabled (--no-passthrough): the daemon serves all I/O"
	if !disabled {
		why = p.probe(srv)
	}
	p.mu.Lock()
	p.mu.why = why
	p.mu.Unlock()
	if p.kernelOK.Load() {
		p.srv.Store(srv)
	}
}

func (p *passthrough) probe(srv *fuse.Server) string {
	if srv.KernelSettings().Flags64()&fuse.CAP_PASSTHROUGH == 0 {
		return "the kernel does not offer FUSE passthrough (needs Linux >= 6.9 built with CONFIG_FUSE_PASSTHROUGH); the daemon serves all I/O"
	}
	fd, err := unix.MemfdCreate("gdsfs-passthrough-probe", unix.MFD_CLOEXEC)
	if err != nil {
		return fmt.Sprintf("cannot probe passthrough (memfd_create: %v); the daemon serves all I/O", err)
	}
	defer unix.Close(fd)
	id, errno := srv.RegisterBackingFd(&fuse.BackingMap{Fd: int32(fd)})
	if errno != 0 {
		if errno == syscall.EPERM {
			return "the kernel refused to register backing files (EPERM: needs CAP_SYS_ADMIN, run gdsfs as root); the daemon serves all I/O"
		}
		return fmt.Sprintf("the kernel refused to register a backing file (%v); the daemon serves all I/O", errno)
	}
	if errno := srv.UnregisterBackingFd(id); errno != 0 {
		p.log.Warn().Str("errno", errno.Error()).Msg("passthrough probe: unregister backing file")
	}
	p.kernelOK.Store(true)
	return "kernel FUSE passthrough active: the kernel reads and writes backing files directly"
}

// vet reports whether fd may be handed to go-fuse for passthrough.
func (p *passthrough) vet(fd int, path string) bool {
	srv := p.srv.Load()
	if srv == nil {
		p.daemon.Add(1)
		return false
	}
	id, errno := srv.RegisterBackingFd(&fuse.BackingMap{Fd: int32(fd)})
	if errno != 0 {
		p.refused.Add(1)
		p.daemon.Add(1)
		p.mu.Lock()
		first := p.mu.firstRefusal == ""
		if first {
			p.mu.firstRefusal = fmt.Sprintf("%s: %v", path, errno)
		}
		p.mu.Unlock()
		// Log the first refusal loudly, later ones at debug level: a
		// whole subtree on an unsupported filesystem would flood the log.
		ev := p.log.Debug()
		if first {
			ev = p.log.Warn()
		}
		ev.Str("path", path).Str("errno", errno.Error()).
			Msg("kernel refused passthrough for this file; the daemon serves its I/O")
		return false
	}
	if errno := srv.UnregisterBackingFd(id); errno != 0 {
		p.log.Warn().Str("errno", errno.Error()).Msg("passthrough vet: unregister backing file")
	}
	p.opens.Add(1)
	return true
}

// state returns whether passthrough is in use and why.
func (p *passthrough) state() (bool, string) {
	p.mu.Lock()
	defer p.mu.Unlock()
	why := p.mu.why
	if n := p.refused.Load(); n > 0 {
		why = fmt.Sprintf("%s; refused for %d open(s), first %s", why, n, p.mu.firstRefusal)
	}
	return p.kernelOK.Load(), why
}

func (p *passthrough) stats() PassthroughStats {
	return PassthroughStats{
		Passthrough: p.opens.Load(),
		Daemon:      p.daemon.Load(),
		Refused:     p.refused.Load(),
	}
}
