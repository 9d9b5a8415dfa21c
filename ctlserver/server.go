package ctlserver

import (
	"context"
	"crypto/rand"
	"encoding/binary"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	"github.com/gdsfs/gdsfs/cache"
	"github.com/gdsfs/gdsfs/ctl"
	"github.com/gdsfs/gdsfs/cufile"
	"github.com/gdsfs/gdsfs/fs"
	"github.com/gdsfs/gdsfs/gpubuf"
	"github.com/rs/zerolog"
)

// EngineChooser picks the engine that moves [off, off+n) of one backing
// file (n < 0: to end of file) and says why (*cufile.Engines satisfies it;
// metrics/instrument wraps it). ctl always passes a descriptor of the file
// (the caller's, or for xattrs one fs opened without following symlinks or
// blocking); path is for reports. ctl asks once per READ about the span of
// its widened ranges, and once per WRITE and per user.gdsfs.info about the
// whole file, with no lock held and without caching the answer: the
// chooser bounds its own cost. Called concurrently.
type EngineChooser interface {
	Choose(f *os.File, path string, off, n int64) (e cufile.Engine, reason string)
}

// Indexer returns parsed shard indexes (*cache.Indexes satisfies it). Get
// fails with an error wrapping cache.ErrNoIndex for files of no known
// format, cache.ErrBusy when it could not parse in time, and EBADF for a
// descriptor not open for reading. It reads only through f (never nil), the
// file at path; it never opens path.
type Indexer interface {
	Get(ctx context.Context, path string, f *os.File) (*cache.Index, error)
	// Invalidate forgets what is cached about path.
	Invalidate(path string)
}

// Options configures a Server.
type Options struct {
	// Pool supplies slab memory and leases. Required.
	Pool *gpubuf.Pool
	// Engines picks the engine per file. Required.
	Engines EngineChooser
	// Indexes serves shard indexes; nil disables INDEX, READ_NAMES and
	// user.gdsfs.index (ENODATA).
	Indexes Indexer
	// Engine is the default engine's name, reported by HELLO and stats.
	Engine string
	// ReadOnly refuses WRITE and ALLOC with EROFS (a read-only mount).
	ReadOnly bool
	// Version is the daemon version reported by HELLO.
	Version string
	// LogFile is where the daemon logs (absolute; empty: stderr), reported
	// in STATUS so `gdsfs status` can name it.
	LogFile string
	// EngineWhy says why Engine is the default engine, for STATUS.
	EngineWhy string
	// Refusals, if set, reports the files an engine was refused for, per
	// cause and filesystem, for STATUS.
	Refusals func() []EngineRefusal
	// Log receives refusals at debug level and failures at error level.
	Log zerolog.Logger
	// BackingPath maps a backing path as the daemon opens it to the path
	// user.gdsfs.backing and user.gdsfs.info report (an overmount serves
	// the mountpoint's own contents through /proc/self/fd/N). Nil: as is.
	BackingPath func(daemonPath string) string
	// SlabSocket is the address of the slab socket (package handoff) that
	// serves this Server's SlabFD, announced in HELLO with CapSlabFD.
	// Empty: none (CUDA slabs of kind SlabCUDAFD cannot be mapped then).
	SlabSocket string
}

// Validate reports every problem of o at once.
func (o Options) Validate() error {
	var errs []error
	if o.Pool == nil {
		errs = append(errs, errors.New("ctl: Options.Pool is nil"))
	}
	if o.Engines == nil {
		errs = append(errs, errors.New("ctl: Options.Engines is nil"))
	}
	if len(o.SlabSocket) >= ctl.SlabSocketBytes {
		errs = append(errs, fmt.Errorf("ctl: Options.SlabSocket %q is %d bytes, HELLO has room for %d", o.SlabSocket, len(o.SlabSocket), ctl.SlabSocketBytes-1))
	}
	return errors.Join(errs...)
}

// sessionShards is the number of independently locked session tables.
const sessionShards = 16

// xattrMax is the largest value a FUSE getxattr can return.
const xattrMax = 64 << 10

// indexTimeout bounds the work of one index lookup (INDEX, READ_NAMES'
// names, user.gdsfs.info and user.gdsfs.index): waiting for a parse slot
// and the parse. A lookup that runs out answers EAGAIN; the parse itself
// goes on, bounded by the parsers' limits, and its answer is cached.
const indexTimeout = 10 * time.Second

// Server is the daemon's control path; it implements fs.Control. All
// methods are safe for concurrent use (lock order: see the package doc).
type Server struct {
	opts     Options
	host     bool  // the pool's backend is host memory (wire device -1)
	devices  int   // the pool backend's device count
	maxLease int64 // the largest lease the pool can grant one uid (its per-uid share)
	pid      uint32

	nextSession atomic.Uint64
	shards      [sessionShards]sessionShard
	counters    counters
	mount       atomic.Pointer[fs.Server]
}

type sessionShard struct {
	mu       sync.Mutex
	sessions map[uint64]*session // GUARDED_BY(mu)
}

var _ fs.Control = (*Server)(nil)

// NewServer returns a Server over the pool, engines and indexes of opts.
func NewServer(opts Options) (*Server, error) {
	if err := opts.Validate(); err != nil {
		return nil, err
	}
	s := &Server{
		opts:    opts,
		host:    opts.Pool.Backend().Name() == "host",
		devices: opts.Pool.Backend().Devices(),
		pid:     uint32(os.Getpid()),
	}
	s.maxLease = opts.Pool.MaxLeaseBytes()
	for i := range s.shards {
		s.shards[i].sessions = make(map[uint64]*session)
	}
	return s, nil
}

func (s *Server) shard(id uint64) *sessionShard { return &s.shards[id%sessionShards] }

// OpenSession implements fs.Control: one open of <mount>/.gdsfs.
func (s *Server) OpenSession(ctx context.Context, c fs.Caller) (fs.Session, syscall.Errno) {
	var b [8]byte
	if _, err := rand.Read(b[:]); err != nil {
		s.opts.Log.Error().Err(err).Msg("ctl: session secret")
		return nil, syscall.EIO
	}
	ss := &session{
		srv:    s,
		id:     s.nextSession.Add(1),
		secret: binary.LittleEndian.Uint64(b[:]),
		uid:    c.UID,
		leases: make(map[uint64]leaseInfo),
	}
	sh := s.shard(ss.id)
	sh.mu.Lock()
	sh.sessions[ss.id] = ss
	sh.mu.Unlock()
	s.opts.Log.Debug().Uint64("session", ss.id).Uint32("uid", c.UID).Uint32("pid", c.PID).Msg("ctl: session opened")
	return ss, 0
}

// session returns the live session of token t if caller may use it (S1).
func (s *Server) session(t ctl.Token, c fs.Caller) (*session, syscall.Errno) {
	sh := s.shard(t.Session)
	sh.mu.Lock()
	ss := sh.sessions[t.Session]
	sh.mu.Unlock()
	if ss == nil || ss.secret != t.Secret || ss.uid != c.UID {
		return nil, syscall.EPERM
	}
	return ss, 0
}

// device maps a wire device number to the pool's.
func (s *Server) device(d int32) (int, syscall.Errno) {
	switch {
	case s.host && d == ctl.HostDevice:
		return 0, 0
	case !s.host && d >= 0 && int(d) < s.devices:
		return int(d), 0
	}
	return 0, syscall.ENODEV
}

// wireDevice maps a pool device number to the wire's.
func (s *Server) wireDevice(d int) int32 {
	if s.host {
		return ctl.HostDevice
	}
	return int32(d)
}

// FileIoctl implements fs.Control: READ, READ_NAMES, WRITE and INDEX on a
// data file. Everything else is ENOTTY.
func (s *Server) FileIoctl(ctx context.Context, c fs.Caller, f *os.File, path string, cmd uint32, in, out []byte) (int32, syscall.Errno) {
	var errno syscall.Errno
	switch cmd {
	case ctl.CmdRead:
		errno = s.read(ctx, c, f, path, in, out, false)
	case ctl.CmdReadNames:
		errno = s.read(ctx, c, f, path, in, out, true)
	case ctl.CmdWrite:
		errno = s.write(ctx, c, f, path, in, out)
	case ctl.CmdIndex:
		errno = s.index(ctx, c, f, path, in, out)
	default:
		if !ctl.OurCmd(cmd) {
			// Not a control-path command at all (Python's open() asks
			// isatty with TCGETS): not a refusal worth counting.
			s.counters.foreign.Add(1)
			return 0, syscall.ENOTTY
		}
		errno = syscall.ENOTTY
	}
	s.counters.result(errno)
	if errno != 0 {
		s.opts.Log.Debug().Str("op", "ioctl").Hex("cmd", u32bytes(cmd)).Str("path", path).Uint32("uid", c.UID).
			Str("errno", errnoName(errno)).Msg("ctl: refused")
	}
	return 0, errno
}

func u32bytes(v uint32) []byte { return []byte{byte(v >> 24), byte(v >> 16), byte(v >> 8), byte(v)} }

// read serves READ and READ_NAMES.
func (s *Server) read(ctx context.Context, c fs.Caller, f *os.File, path string, in, out []byte, byName bool) syscall.Errno {
	if len(in) != ctl.SizeRead || len(out) != ctl.SizeRead {
		return syscall.EINVAL
	}
	size, errno := statFile(f)
	if errno != 0 {
		return errno
	}
	// Only the access the caller's descriptor grants: the kernel checked
	// that at open, and the daemon (root) must not read past it.
	if !readable(f) {
		return syscall.EBADF
	}
	var (
		tok    ctl.Token
		dev    int32
		ranges []ctl.Range
	)
	if byName {
		req, err := ctl.DecodeReadNamesRequest(in)
		if err != nil {
			return errnoOf(err)
		}
		tok, dev = req.Token, req.Device
		// Check the caller before touching the index: a stranger learns
		// nothing about the file from the errno.
		if _, errno := s.session(tok, c); errno != 0 {
			return errno
		}
		if ranges, errno = s.resolve(ctx, c, f, path, req.Names); errno != 0 {
			return errno
		}
	} else {
		req, err := ctl.DecodeReadRequest(in)
		if err != nil {
			return errnoOf(err)
		}
		tok, dev, ranges = req.Token, req.Device, req.Ranges
	}
	ss, errno := s.session(tok, c)
	if errno != 0 {
		return errno
	}
	if !ss.enter() {
		return syscall.EPERM
	}
	defer ss.leave()
	pdev, errno := s.device(dev)
	if errno != 0 {
		return errno
	}
	plan, errno := s.plan(ranges, size)
	if errno != 0 {
		return errno
	}
	eng, errno := s.readEngine(f, path, plan)
	if errno != 0 {
		return errno
	}
	leases, errno := ss.readRanges(ctx, f, eng, ctl.EngineCodeOf(eng.Name()), pdev, plan)
	if errno != 0 {
		return errno
	}
	(&ctl.ReadReply{Leases: leases}).Encode(out)
	return 0
}

// engine returns the engine for [off, off+n) of f; a chooser that has
// none is a bug, logged and answered with EIO rather than a crash.
func (s *Server) engine(f *os.File, path string, off, n int64) (cufile.Engine, syscall.Errno) {
	eng, why := s.opts.Engines.Choose(f, path, off, n)
	if eng == nil {
		s.opts.Log.Error().Str("path", path).Str("why", why).Msg("BUG: ctl: no engine for file")
		return nil, syscall.EIO
	}
	return eng, 0
}

// readEngine returns the engine for a READ of plan: the chooser is asked
// about the span of the READ's widened ranges.
func (s *Server) readEngine(f *os.File, path string, plan []span) (cufile.Engine, syscall.Errno) {
	lo, hi := int64(-1), int64(0)
	for _, sp := range plan {
		if sp.valid == 0 {
			continue
		}
		if lo < 0 || sp.start < lo {
			lo = sp.start
		}
		hi = max(hi, sp.end)
	}
	if lo < 0 {
		lo = 0 // nothing to read: any answer serves
	}
	return s.engine(f, path, lo, hi-lo)
}

// span is one validated range: the requested bytes and the 4 KiB-widened
// bytes the engine reads.
type span struct {
	off, length, valid int64 // requested offset and length, bytes present
	start, end         int64 // widened [start, end), empty when valid == 0
}

// plan validates ranges against a file of size bytes (S4) and widens them.
func (s *Server) plan(ranges []ctl.Range, size int64) ([]span, syscall.Errno) {
	plan := make([]span, len(ranges))
	var total int64
	for i, r := range ranges {
		if ctl.AddOverflows(r.Offset, r.Length) {
			return nil, syscall.ERANGE
		}
		off, n := int64(r.Offset), int64(r.Length)
		if off > size {
			return nil, syscall.EINVAL
		}
		valid := min(n, size-off)
		if valid > s.maxLease {
			return nil, syscall.E2BIG
		}
		sp := span{off: off, length: n, valid: valid}
		if valid > 0 {
			sp.start = off &^ (ctl.AlignBytes - 1)
			sp.end = alignUp(off + valid)
			total += sp.end - sp.start
		}
		plan[i] = sp
	}
	if total > s.maxLease {
		return nil, syscall.E2BIG
	}
	return plan, 0
}

func alignUp(n int64) int64 { return (n + ctl.AlignBytes - 1) &^ (ctl.AlignBytes - 1) }

// resolve maps index names of f to ranges.
func (s *Server) resolve(ctx context.Context, c fs.Caller, f *os.File, path string, names []string) ([]ctl.Range, syscall.Errno) {
	x, errno := s.lookup(ctx, c, path, f)
	if errno != 0 {
		return nil, errno
	}
	ranges := make([]ctl.Range, len(names))
	for i, name := range names {
		off, n, err := x.Resolve(name)
		switch {
		case errors.Is(err, cache.ErrNotFound):
			return nil, syscall.ENOENT
		case errors.Is(err, cache.ErrNotAddressable):
			return nil, syscall.EOPNOTSUPP
		case err != nil:
			return nil, s.indexErrno(err, path)
		case off < 0 || n < 0:
			s.opts.Log.Error().Str("path", path).Str("name", name).Msg("BUG: ctl: index resolved to a negative range")
			return nil, syscall.EIO
		}
		ranges[i] = ctl.Range{Offset: uint64(off), Length: uint64(n)}
	}
	return ranges, 0
}

// lookup returns the index of f (at path) for c, waiting at most
// indexTimeout; a parse it needs counts against c's share of the parse
// slots.
func (s *Server) lookup(ctx context.Context, c fs.Caller, path string, f *os.File) (*cache.Index, syscall.Errno) {
	x, err := s.lookupErr(ctx, c, path, f)
	if err != nil {
		return nil, s.indexErrno(err, path)
	}
	return x, 0
}

func (s *Server) lookupErr(ctx context.Context, c fs.Caller, path string, f *os.File) (*cache.Index, error) {
	if s.opts.Indexes == nil {
		return nil, cache.ErrNoIndex
	}
	ctx, cancel := context.WithTimeout(cache.WithRequester(ctx, c.UID), indexTimeout)
	defer cancel()
	return s.opts.Indexes.Get(ctx, path, f)
}

// indexErrno maps an index lookup failure.
func (s *Server) indexErrno(err error, path string) syscall.Errno {
	switch {
	case errors.Is(err, cache.ErrNoIndex), errors.Is(err, cache.ErrInvalid):
		return syscall.ENODATA
	case errors.Is(err, context.Canceled):
		return syscall.EINTR
	case errors.Is(err, cache.ErrBusy):
		return syscall.EAGAIN // logged by cache
	case errors.Is(err, context.DeadlineExceeded):
		s.opts.Log.Warn().Err(err).Str("path", path).Dur("timeout", indexTimeout).Msg("ctl: index lookup ran out of time; answered EAGAIN")
		return syscall.EAGAIN
	}
	var errno syscall.Errno
	if errors.As(err, &errno) {
		return errno
	}
	s.opts.Log.Error().Err(err).Str("path", path).Msg("ctl: index")
	return syscall.EIO
}

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
		return errnoOf(err)
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
	// The lease stays allocated until the write is done (RELEASE waits).
	ss.pin.RLock()
	defer ss.pin.RUnlock()
	if ctl.AddOverflows(req.FileOffset, req.Length) || ctl.AddOverflows(req.LeaseOffset, req.Length) {
		return syscall.ERANGE
	}
	if req.Length == 0 {
		return syscall.EINVAL
	}
	if !writable(f) {
		return syscall.EBADF
	}
	li, l, errno := ss.lease(req.Lease)
	if errno != 0 {
		return errno
	}
	if req.LeaseOffset+req.Length > uint64(li.valid) {
		return syscall.EINVAL
	}
	eng, errno := s.engine(f, path, 0, -1) // about the whole file, as WRITE always asked
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

// statFile returns the size of the regular file f; anything else is ENOTTY
// (a data-file command on something that is not a data file).
func statFile(f *os.File) (int64, syscall.Errno) {
	if f == nil {
		return 0, syscall.ENOTTY
	}
	st, err := f.Stat()
	if err != nil {
		return 0, errnoOf(err)
	}
	if !st.Mode().IsRegular() {
		return 0, syscall.ENOTTY
	}
	return st.Size(), 0
}

// writable reports whether f was opened for writing.
func writable(f *os.File) bool {
	fl, err := fcntlGetfl(f)
	return err == nil && fl&syscall.O_ACCMODE != syscall.O_RDONLY
}

// readable reports whether f was opened for reading.
func readable(f *os.File) bool {
	fl, err := fcntlGetfl(f)
	return err == nil && fl&syscall.O_ACCMODE != syscall.O_WRONLY
}

// ioErrno maps an engine or backing-file failure, logging it once.
func (s *Server) ioErrno(err error, op, path string) syscall.Errno {
	if errors.Is(err, context.Canceled) || errors.Is(err, context.DeadlineExceeded) {
		return syscall.EINTR
	}
	var errno syscall.Errno
	if errors.As(err, &errno) {
		switch errno {
		case syscall.ENOSPC, syscall.EDQUOT, syscall.EFBIG, syscall.EBADF, syscall.EINTR:
			return errno
		}
	}
	s.opts.Log.Error().Err(err).Str("op", op).Str("path", path).Msg("ctl: engine failed")
	return syscall.EIO
}

// index serves INDEX.
func (s *Server) index(ctx context.Context, c fs.Caller, f *os.File, path string, in, out []byte) syscall.Errno {
	if len(in) != ctl.SizePage || len(out) != ctl.SizePage {
		return syscall.EINVAL
	}
	if _, errno := statFile(f); errno != 0 {
		return errno
	}
	if !readable(f) {
		return syscall.EBADF // an index is the file's contents
	}
	req, err := ctl.DecodePageRequest(in)
	if err != nil {
		return errnoOf(err)
	}
	x, errno := s.lookup(ctx, c, path, f)
	if errno != 0 {
		return errno
	}
	doc, err := x.JSON()
	if err != nil {
		return s.indexErrno(err, path)
	}
	return errnoOf(ctl.EncodePage(out, doc, req.Offset))
}

// Changed implements fs.Control.
func (s *Server) Changed(path string) {
	if s.opts.Indexes != nil {
		s.opts.Indexes.Invalidate(path)
	}
}

// caps is the HELLO capability set.
func (s *Server) caps() uint64 {
	var c uint64
	if s.host {
		c |= ctl.CapHostSlabs
	} else {
		c |= ctl.CapCUDASlabs
	}
	if s.opts.Indexes != nil {
		c |= ctl.CapReadNames | ctl.CapIndex
	}
	if !s.opts.ReadOnly {
		c |= ctl.CapWrite
	}
	if s.opts.SlabSocket != "" {
		c |= ctl.CapSlabFD
	}
	return c
}

// errnoOf extracts the errno of a wire or syscall error (EIO otherwise).
func errnoOf(err error) syscall.Errno {
	if err == nil {
		return 0
	}
	var errno syscall.Errno
	if errors.As(err, &errno) {
		return errno
	}
	return syscall.EIO
}

// Stats is the document of user.gdsfs.stats and STATUS.
type Stats struct {
	DaemonPID uint32       `json:"daemon_pid"`
	Version   string       `json:"version"`
	Engine    string       `json:"engine"`
	Sessions  int          `json:"sessions"`
	Leases    int          `json:"leases"`
	Pool      gpubuf.Stats `json:"pool"`
	Counters  CounterStats `json:"counters"`
	// Index is the shard-index cache's figures; absent when the mount
	// serves no indexes (or its Indexer keeps none).
	Index *cache.IndexStats `json:"index,omitempty"`
	// LogFile is the daemon's log file; absent when it logs to stderr.
	LogFile string `json:"log_file,omitempty"`
	// EngineWhy says why Engine serves by default.
	EngineWhy string `json:"engine_why,omitempty"`
	// Refusals counts files an engine refused, per cause and filesystem.
	Refusals []EngineRefusal `json:"engine_refusals,omitempty"`
	// Passthrough is the mount's kernel passthrough state; absent before
	// the mount is up.
	Passthrough *PassthroughState `json:"passthrough,omitempty"`
}

// EngineRefusal counts the files an engine was refused for, for one cause
// on one filesystem (cuFile refuses all files of a filesystem alike).
type EngineRefusal struct {
	Filesystem string `json:"filesystem"`
	Cause      string `json:"cause"`
	Files      int64  `json:"files"`
}

// PassthroughState says whether the kernel reads and writes backing files
// itself, and why (or why not).
type PassthroughState struct {
	Enabled bool   `json:"enabled"`
	Why     string `json:"why"`
}

// Mounted gives the server the running mount, whose passthrough state
// STATUS reports; the CLI calls it once the mount is ready.
func (s *Server) Mounted(m *fs.Server) { s.mount.Store(m) }

// indexStatser is the optional part of an Indexer that reports its cache
// figures (*cache.Indexes has it).
type indexStatser interface{ Stats() cache.IndexStats }

// StatsFor returns the snapshot uid may see: root sees everything; any
// other uid sees its own sessions and per-uid figures, and only totals of
// everyone else's (who uses the node, and how much, is not its business).
func (s *Server) StatsFor(uid uint32) Stats {
	st := s.Stats()
	if uid == 0 {
		return st
	}
	own := st.Pool.Sessions[:0:0]
	for _, ss := range st.Pool.Sessions {
		if ss.UID == uid {
			own = append(own, ss)
		}
	}
	st.Pool.Sessions = own
	uids := st.Pool.UIDs[:0:0]
	for _, u := range st.Pool.UIDs {
		if u.UID == uid {
			uids = append(uids, u)
		}
	}
	st.Pool.UIDs = uids
	return st
}

// Stats returns a snapshot of the control path's figures, every uid's
// included (see StatsFor).
func (s *Server) Stats() Stats {
	st := Stats{DaemonPID: s.pid, Version: s.opts.Version, LogFile: s.opts.LogFile, Engine: s.opts.Engine, EngineWhy: s.opts.EngineWhy,
		Pool: s.opts.Pool.Stats(), Counters: s.counters.snapshot()}
	if s.opts.Refusals != nil {
		st.Refusals = s.opts.Refusals()
	}
	if m := s.mount.Load(); m != nil {
		on, why := m.Passthrough()
		st.Passthrough = &PassthroughState{Enabled: on, Why: why}
	}
	for i := range s.shards {
		sh := &s.shards[i]
		sh.mu.Lock()
		st.Sessions += len(sh.sessions)
		sh.mu.Unlock()
	}
	for _, d := range st.Pool.Devices {
		st.Leases += d.Leases
	}
	if x, ok := s.opts.Indexes.(indexStatser); ok {
		is := x.Stats()
		st.Index = &is
	}
	return st
}

func (s *Server) statsJSON(uid uint32) ([]byte, syscall.Errno) {
	b, err := json.Marshal(s.StatsFor(uid))
	if err != nil {
		s.opts.Log.Error().Err(err).Msg("BUG: ctl: encode stats")
		return nil, syscall.EIO
	}
	return b, 0
}

// fileInfo is the document of user.gdsfs.info.
type fileInfo struct {
	Path    string `json:"path"`
	Type    string `json:"type"`
	Size    int64  `json:"size"`
	Dev     uint64 `json:"dev"`
	Ino     uint64 `json:"ino"`
	MtimeNs int64  `json:"mtime_ns"`
	Align   int    `json:"align"`
	Engine  string `json:"engine"`
	Reason  string `json:"reason"`
	Format  string `json:"format"`
	// IndexError says why a file of a recognised format has no index (it
	// is corrupt: cache.ErrInvalid); user.gdsfs.index and INDEX answer
	// ENODATA for it, as for a file of no format.
	IndexError string `json:"index_error,omitempty"`
}

// Xattr implements fs.Control: the user.gdsfs.* names (docs/protocol.md
// section 6). The kernel checked that the caller may read the node (user.*
// attributes need read permission); the backing file is reached only
// through t.Open, never by path.
func (s *Server) Xattr(ctx context.Context, c fs.Caller, t fs.XattrTarget, name string) ([]byte, syscall.Errno) {
	switch name {
	case "user.gdsfs.backing":
		return []byte(s.backingPath(t.Path)), 0
	case "user.gdsfs.stats":
		if !t.IsRoot {
			return nil, syscall.ENODATA
		}
		return s.statsJSON(c.UID)
	case "user.gdsfs.info":
		return s.info(ctx, c, t)
	case "user.gdsfs.index":
		if s.opts.Indexes == nil {
			return nil, syscall.ENODATA
		}
		f, errno := openTarget(t)
		if errno != 0 {
			return nil, errno
		}
		defer f.Close()
		x, errno := s.lookup(ctx, c, t.Path, f)
		if errno != 0 {
			return nil, errno
		}
		doc, err := x.JSON()
		if err != nil {
			return nil, s.indexErrno(err, t.Path)
		}
		if len(doc) > xattrMax {
			return nil, syscall.E2BIG
		}
		return doc, 0
	}
	return nil, syscall.ENODATA
}

// openTarget opens an xattr's node through fs's opener.
func openTarget(t fs.XattrTarget) (*os.File, syscall.Errno) {
	if t.Open == nil {
		return nil, syscall.ENODATA
	}
	f, err := t.Open()
	if err != nil {
		return nil, errnoOf(err)
	}
	return f, 0
}

// info builds user.gdsfs.info for the node t.
func (s *Server) info(ctx context.Context, c fs.Caller, t fs.XattrTarget) ([]byte, syscall.Errno) {
	f, errno := openTarget(t)
	if errno != 0 {
		return nil, errno
	}
	defer f.Close()
	var st syscall.Stat_t
	if err := fstat(f, &st); err != nil {
		return nil, errnoOf(err)
	}
	path := t.Path
	fi := fileInfo{Path: s.backingPath(path), Size: st.Size, Dev: st.Dev, Ino: st.Ino, MtimeNs: st.Mtim.Nano(), Align: ctl.AlignBytes}
	switch st.Mode & syscall.S_IFMT {
	case syscall.S_IFREG:
		fi.Type = "file"
		var eng cufile.Engine
		if eng, fi.Reason = s.opts.Engines.Choose(f, path, 0, -1); eng != nil {
			fi.Engine = eng.Name()
		}
		if s.opts.Indexes != nil {
			switch x, err := s.lookupErr(ctx, c, path, f); {
			case err == nil:
				fi.Format = string(x.Format)
			case errors.Is(err, cache.ErrInvalid):
				// Corrupt, or beyond the parsers' limits: say why.
				fi.IndexError = err.Error()
			case errors.Is(err, cache.ErrBusy), errors.Is(err, context.DeadlineExceeded):
				fi.IndexError = "index not ready: the daemon is busy parsing other files; ask again"
			}
		}
	case syscall.S_IFDIR:
		fi.Type = "dir"
		fi.Reason = "directories have no data for the control path"
	case syscall.S_IFLNK:
		fi.Type = "symlink"
		fi.Reason = "the control path serves the file a symlink points to"
	default:
		fi.Type = "other"
		fi.Reason = "only regular files are served by the control path"
	}
	b, err := json.Marshal(fi)
	if err != nil {
		return nil, syscall.EIO
	}
	return b, 0
}

// fstat stats f.
func fstat(f *os.File, st *syscall.Stat_t) error {
	rc, err := f.SyscallConn()
	if err != nil {
		return err
	}
	var serr error
	if err := rc.Control(func(fd uintptr) { serr = syscall.Fstat(int(fd), st) }); err != nil {
		return err
	}
	return serr
}

// backingPath is the path clients are told for the daemon's path p.
func (s *Server) backingPath(p string) string {
	if s.opts.BackingPath == nil {
		return p
	}
	return s.opts.BackingPath(p)
}

// Close ends every session (unmount).
func (s *Server) Close() error {
	var all []*session
	for i := range s.shards {
		sh := &s.shards[i]
		sh.mu.Lock()
		for _, ss := range sh.sessions {
			all = append(all, ss)
		}
		sh.mu.Unlock()
	}
	for _, ss := range all {
		ss.Close()
	}
	return nil
}
