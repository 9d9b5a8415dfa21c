package handoffserver

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"net"
	"os"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	"github.com/gdsfs/gdsfs/handoff"
	"github.com/gdsfs/gdsfs/internal/errname"
	"github.com/rs/zerolog"
	"golang.org/x/sys/unix"
)

// Handle is what a Source hands out for one request.
type Handle struct {
	// File is a new descriptor of the slab's memory. The server sends it
	// and then closes it, whether or not the send succeeded.
	File *os.File
	// Bytes is the size of the memory behind File (what a client maps).
	Bytes uint64
}

// Source decides who gets which descriptor. SlabFD is called concurrently,
// once per request, with the peer of the request's connection. It returns
// a Handle with a new descriptor when peer may map req.Slab, and otherwise
// an errno and no descriptor: EPERM when the token is not a live session
// of peer's uid or the session holds no lease in the slab, ENOENT for an
// unknown slab, EOPNOTSUPP when the slab's memory has no descriptor.
type Source interface {
	SlabFD(ctx context.Context, peer handoff.Peer, req handoff.Request) (Handle, syscall.Errno)
}

// Options configures Listen. The zero value is usable.
type Options struct {
	// Addr is the socket's address: "@name" for a name in the abstract
	// namespace (no file, gone with the process), otherwise a path, created
	// mode 0666 (anyone may connect; the server decides by the peer's
	// credentials) and removed by Close. Default: "@gdsfs-slabs-<pid>-<random>".
	Addr string
	// MaxConns bounds the connections served at once (default 1024).
	MaxConns int
	// MaxConnsPerUID bounds one uid's connections served at once
	// (default 32), so no user can take every slot.
	MaxConnsPerUID int
	// IdleTimeout closes a connection that sends no request for this long,
	// and bounds each reply's send (default 10s).
	IdleTimeout time.Duration
	// Log receives refusals at debug level and failures at warn level.
	Log zerolog.Logger
}

// Validate reports every problem of o at once.
func (o Options) Validate() error {
	var errs []error
	if o.MaxConns < 0 {
		errs = append(errs, fmt.Errorf("handoff: MaxConns (%d) must be >= 0", o.MaxConns))
	}
	if o.MaxConnsPerUID < 0 {
		errs = append(errs, fmt.Errorf("handoff: MaxConnsPerUID (%d) must be >= 0", o.MaxConnsPerUID))
	}
	if o.IdleTimeout < 0 {
		errs = append(errs, fmt.Errorf("handoff: IdleTimeout (%v) must be >= 0", o.IdleTimeout))
	}
	if len(strings.TrimPrefix(o.Addr, "@")) > 100 {
		errs = append(errs, fmt.Errorf("handoff: Addr %q is longer than a unix socket address allows", o.Addr))
	}
	return errors.Join(errs...)
}

// Stats are the server's counters since Listen.
type Stats struct {
	Conns    int    // connections open now
	Accepted uint64 // connections accepted and served
	Rejected uint64 // connections closed at once: over a limit, or no credentials
	Served   uint64 // descriptors sent
	Refused  uint64 // requests answered with an errno (malformed ones included)
}

// Server serves descriptors on a unix socket. Its methods are safe for
// concurrent use.
type Server struct {
	opts Options
	ln   *net.UnixListener

	ctx    context.Context // cancelled by Close
	cancel context.CancelFunc
	wg     sync.WaitGroup // the accept loop and every connection

	accepted, rejected, served, refused atomic.Uint64

	mu sync.Mutex
	// GUARDED_BY(mu)
	started bool
	closed  bool
	conns   map[*net.UnixConn]struct{}
	perUID  map[uint32]int

	// connDone, if set (tests), is called after a connection is gone.
	connDone func()
}

// Listen binds the socket. Nothing is served until Serve.
func Listen(opts Options) (*Server, error) {
	if err := opts.Validate(); err != nil {
		return nil, err
	}
	if opts.MaxConns == 0 {
		opts.MaxConns = 1024
	}
	if opts.MaxConnsPerUID == 0 {
		opts.MaxConnsPerUID = 32
	}
	if opts.IdleTimeout == 0 {
		opts.IdleTimeout = 10 * time.Second
	}
	if opts.Addr == "" {
		var b [8]byte
		if _, err := rand.Read(b[:]); err != nil {
			return nil, fmt.Errorf("handoff: socket name: %w", err)
		}
		opts.Addr = fmt.Sprintf("@gdsfs-slabs-%d-%s", os.Getpid(), hex.EncodeToString(b[:]))
	}
	ln, err := net.ListenUnix("unixpacket", &net.UnixAddr{Name: opts.Addr, Net: "unixpacket"})
	if err != nil && errors.Is(err, syscall.EADDRINUSE) && !strings.HasPrefix(opts.Addr, "@") && removeStale(opts.Addr) {
		ln, err = net.ListenUnix("unixpacket", &net.UnixAddr{Name: opts.Addr, Net: "unixpacket"})
	}
	if err != nil {
		return nil, fmt.Errorf("handoff: listen on %s: %w", opts.Addr, err)
	}
	if !strings.HasPrefix(opts.Addr, "@") {
		if err := os.Chmod(opts.Addr, 0o666); err != nil {
			ln.Close()
			return nil, fmt.Errorf("handoff: let every uid connect to %s: %w", opts.Addr, err)
		}
	}
	ctx, cancel := context.WithCancel(context.Background())
	return &Server{opts: opts, ln: ln, ctx: ctx, cancel: cancel,
		conns: make(map[*net.UnixConn]struct{}), perUID: make(map[uint32]int)}, nil
}

// removeStale removes the socket file at p if nothing listens on it (a
// daemon that was killed leaves it behind) and says whether it did. A live
// server's socket, or anything that is not a socket, is left alone.
func removeStale(p string) bool {
	fi, err := os.Lstat(p)
	if err != nil || fi.Mode()&os.ModeSocket == 0 {
		return false
	}
	c, err := net.Dial("unixpacket", p)
	if err == nil {
		c.Close()
		return false // in use
	}
	if !errors.Is(err, syscall.ECONNREFUSED) {
		return false
	}
	return os.Remove(p) == nil
}

// Addr is the socket's address as clients give it ("@name" or a path).
func (s *Server) Addr() string { return s.opts.Addr }

// Serve starts serving requests from src in the background; it returns at
// once. It may be called once; Close stops it.
func (s *Server) Serve(src Source) error {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.closed {
		return errors.New("handoff: server closed")
	}
	if s.started {
		return errors.New("handoff: Serve called twice")
	}
	s.started = true
	s.wg.Add(1)
	go s.accept(src)
	return nil
}

func (s *Server) accept(src Source) {
	defer s.wg.Done()
	for {
		c, err := s.ln.AcceptUnix()
		if err != nil {
			if s.ctx.Err() != nil {
				return
			}
			var ne net.Error
			if errors.As(err, &ne) && ne.Timeout() {
				continue
			}
			// EMFILE and the like: back off a little instead of spinning.
			s.opts.Log.Warn().Err(err).Str("addr", s.opts.Addr).Msg("handoff: accept")
			select {
			case <-s.ctx.Done():
				return
			case <-time.After(50 * time.Millisecond):
			}
			continue
		}
		peer, err := handoff.PeerOf(c)
		if err != nil {
			s.opts.Log.Warn().Err(err).Msg("handoff: peer credentials")
			s.rejected.Add(1)
			c.Close()
			continue
		}
		if !s.admit(c, peer.UID) {
			s.opts.Log.Debug().Uint32("uid", peer.UID).Int32("pid", peer.PID).Msg("handoff: too many connections, closed")
			s.rejected.Add(1)
			c.Close()
			continue
		}
		s.accepted.Add(1)
		go s.serveConn(c, peer, src)
	}
}

// admit registers c (of uid) if the limits allow and the server is open.
func (s *Server) admit(c *net.UnixConn, uid uint32) bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.closed || len(s.conns) >= s.opts.MaxConns || s.perUID[uid] >= s.opts.MaxConnsPerUID {
		return false
	}
	s.conns[c] = struct{}{}
	s.perUID[uid]++
	s.wg.Add(1)
	return true
}

func (s *Server) drop(c *net.UnixConn, uid uint32) {
	c.Close()
	s.mu.Lock()
	delete(s.conns, c)
	if s.perUID[uid]--; s.perUID[uid] <= 0 {
		delete(s.perUID, uid)
	}
	done := s.connDone
	s.mu.Unlock()
	s.wg.Done()
	if done != nil {
		done()
	}
}

// serveConn answers c's requests until it closes, idles or misbehaves.
func (s *Server) serveConn(c *net.UnixConn, peer handoff.Peer, src Source) {
	defer s.drop(c, peer.UID)
	// One byte more than a request: a longer message reads as too long
	// instead of as a request (SOCK_SEQPACKET truncates it).
	buf := make([]byte, handoff.RequestBytes+1)
	for {
		if err := c.SetReadDeadline(time.Now().Add(s.opts.IdleTimeout)); err != nil {
			return
		}
		// No buffer for ancillary data: descriptors a client sends us are
		// closed by the kernel (MSG_CTRUNC), never installed here.
		n, _, _, _, err := c.ReadMsgUnix(buf, nil)
		if err != nil {
			return // EOF (the client closed or died), idle, or Close
		}
		req, err := handoff.DecodeRequest(buf[:n])
		if err != nil {
			s.refused.Add(1)
			s.opts.Log.Debug().Err(err).Uint32("uid", peer.UID).Int32("pid", peer.PID).Msg("handoff: refused")
			s.send(c, handoff.Reply{Errno: syscall.EINVAL}, nil)
			return
		}
		h, errno := src.SlabFD(s.ctx, peer, req)
		if errno != 0 && h.File != nil {
			h.File.Close()
			h.File = nil
		}
		if errno == 0 && h.File == nil {
			errno = syscall.EIO // a source bug; never send a reply that promises a descriptor it lacks
			s.opts.Log.Error().Uint64("slab", req.Slab).Msg("BUG: handoff: source returned no descriptor and no errno")
		}
		rep := handoff.Reply{Errno: errno, Slab: req.Slab}
		if errno != 0 {
			s.refused.Add(1)
			s.opts.Log.Debug().Uint32("uid", peer.UID).Int32("pid", peer.PID).Uint64("session", req.Session).
				Uint64("slab", req.Slab).Str("errno", errname.Of(errno)).Msg("handoff: refused")
			if !s.send(c, rep, nil) {
				return
			}
			continue
		}
		rep.Bytes = h.Bytes
		ok := s.send(c, rep, h.File)
		h.File.Close()
		if !ok {
			return
		}
		s.served.Add(1)
	}
}

// send writes one reply, with f's descriptor when f is not nil.
func (s *Server) send(c *net.UnixConn, r handoff.Reply, f *os.File) bool {
	if err := c.SetWriteDeadline(time.Now().Add(s.opts.IdleTimeout)); err != nil {
		return false
	}
	var oob []byte
	if f != nil {
		oob = unix.UnixRights(int(f.Fd()))
	}
	_, _, err := c.WriteMsgUnix(handoff.EncodeReply(r), oob, nil)
	return err == nil
}

// Stats returns the server's counters.
func (s *Server) Stats() Stats {
	s.mu.Lock()
	n := len(s.conns)
	s.mu.Unlock()
	return Stats{Conns: n, Accepted: s.accepted.Load(), Rejected: s.rejected.Load(),
		Served: s.served.Load(), Refused: s.refused.Load()}
}

// Close stops accepting, closes every connection and waits for the
// server's goroutines. Descriptors already sent stay with their receivers.
func (s *Server) Close() error {
	s.mu.Lock()
	if s.closed {
		s.mu.Unlock()
		return nil
	}
	s.closed = true
	s.cancel()
	err := s.ln.Close()
	for c := range s.conns {
		c.Close()
	}
	s.mu.Unlock()
	s.wg.Wait()
	if err != nil {
		return fmt.Errorf("handoff: close %s: %w", s.opts.Addr, err)
	}
	return nil
}
