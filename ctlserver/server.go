package ctlserver

import (
	"context"
	"crypto/rand"
	"encoding/binary"
	"errors"
	"fmt"
	"os"
	"sync"
	"sync/atomic"
	"syscall"

	"github.com/gdsfs/gdsfs/cache"
	"github.com/gdsfs/gdsfs/ctl"
	"github.com/gdsfs/gdsfs/cufile"
	"github.com/gdsfs/gdsfs/fs"
	"github.com/gdsfs/gdsfs/gpubuf"
	"github.com/gdsfs/gdsfs/internal/errname"
	"github.com/gdsfs/gdsfs/internal/openflags"
	"github.com/gdsfs/gdsfs/internal/readahead"
	"github.com/gdsfs/gdsfs/tier"
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
	// DirectWriteMinBytes is the smallest aligned WRITE body the posix
	// and host engines write with O_DIRECT (cufile.DirectWriteMinBytes;
	// 0: none), reported in STATUS so clients skip flushing what the
	// daemon writes around the page cache.
	DirectWriteMinBytes int64
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
	// Tier is the daemon's memory tier (PIN, READ hits); nil: none.
	Tier *tier.Tier
	// TierCopier copies tier bytes into slabs; nil disables hits.
	TierCopier tier.Copier
	// Readahead is the policy of the readahead after sequential READs
	// (readahead.go); the zero value is the default, MaxBytes < 0 off.
	Readahead readahead.Config
	// DeviceUUIDs is the UUID of each CUDA device of the pool, by ordinal
	// (cufile.Engines.DeviceUUIDs), published in STATUS (pool.devices[].uuid)
	// and announced by CapDeviceUUIDs, so clients that see the node's GPUs
	// under other ordinals can name the daemon's. Nil: unknown (clients
	// then use ordinals as they are). Ignored with host memory.
	DeviceUUIDs []string
	// ResidencyToReaders lets every caller who may read a file learn its
	// page-cache residency through the engine a READ or user.gdsfs.info
	// names (gdsfs mount --residency readers), as kernels before 5.2 let
	// mincore tell anyone. False: only its owners and writers, as the
	// kernel's cachestat and mincore do now; others get the engine that
	// does not depend on residency (residency.go).
	ResidencyToReaders bool
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
	if o.Pool != nil && o.DeviceUUIDs != nil && o.Pool.Backend().Name() != gpubuf.HostBackendName && len(o.DeviceUUIDs) != o.Pool.Backend().Devices() {
		errs = append(errs, fmt.Errorf("ctl: Options.DeviceUUIDs has %d UUIDs, the pool has %d devices", len(o.DeviceUUIDs), o.Pool.Backend().Devices()))
	}
	if len(o.SlabSocket) >= ctl.SlabSocketBytes {
		errs = append(errs, fmt.Errorf("ctl: Options.SlabSocket %q is %d bytes, HELLO has room for %d", o.SlabSocket, len(o.SlabSocket), ctl.SlabSocketBytes-1))
	}
	return errors.Join(errs...)
}

// sessionShards is the number of independently locked session tables.
const sessionShards = 16

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
	ra          *readaheads
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
		host:    opts.Pool.Backend().Name() == gpubuf.HostBackendName,
		devices: opts.Pool.Backend().Devices(),
		pid:     uint32(os.Getpid()),
		ra:      newReadaheads(opts.Readahead),
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
	h := fileCommand(cmd)
	if h == nil && !ctl.OurCmd(cmd) {
		// Not a control-path command at all (Python's open() asks
		// isatty with TCGETS): not a refusal worth counting.
		s.counters.foreign.Add(1)
		return 0, syscall.ENOTTY
	}
	errno := syscall.ENOTTY
	if h != nil {
		errno = h(s, ctx, c, f, path, in, out)
	}
	s.counters.result(errno)
	if errno != 0 {
		s.opts.Log.Debug().Str("op", "ioctl").Hex("cmd", u32bytes(cmd)).Str("path", path).Uint32("uid", c.UID).
			Str("errno", errname.Of(errno)).Msg("ctl: refused")
	}
	return 0, errno
}

func u32bytes(v uint32) []byte { return []byte{byte(v >> 24), byte(v >> 16), byte(v >> 8), byte(v)} }

// statFile returns the size of the regular file f; anything else is ENOTTY
// (a data-file command on something that is not a data file).
func statFile(f *os.File) (int64, syscall.Errno) {
	if f == nil {
		return 0, syscall.ENOTTY
	}
	st, err := f.Stat()
	if err != nil {
		return 0, plainErrno(err)
	}
	if !st.Mode().IsRegular() {
		return 0, syscall.ENOTTY
	}
	return st.Size(), 0
}

// writable reports whether f was opened for writing.
func writable(f *os.File) bool { return openflags.Writable(f) }

// readable reports whether f was opened for reading.
func readable(f *os.File) bool { return openflags.Readable(f) }

// caps is the HELLO capability set.
func (s *Server) caps() uint64 {
	var c uint64
	if s.host {
		c |= ctl.CapHostSlabs
	} else {
		c |= ctl.CapCUDASlabs
	}
	if s.opts.Indexes != nil {
		c |= ctl.CapReadNames | ctl.CapIndex | ctl.CapReadVersion | ctl.CapIndexColumns
	}
	if !s.opts.ReadOnly {
		c |= ctl.CapWrite
	}
	if s.opts.SlabSocket != "" {
		c |= ctl.CapSlabFD
	}
	if s.uuids() != nil {
		c |= ctl.CapDeviceUUIDs
	}
	return c
}

// uuids is the UUID of each CUDA device of the pool, nil when unknown or
// when slabs are host memory (whose wire device -1 has none).
func (s *Server) uuids() []string {
	if s.host || len(s.opts.DeviceUUIDs) != s.devices {
		return nil
	}
	return s.opts.DeviceUUIDs
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
	s.ra.stop()
	return nil
}
