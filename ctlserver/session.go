package ctlserver

import (
	"context"
	"os"
	"runtime"
	"sync"
	"sync/atomic"
	"syscall"

	"github.com/gdsfs/gdsfs/ctl"
	"github.com/gdsfs/gdsfs/cufile"
	"github.com/gdsfs/gdsfs/fs"
	"github.com/gdsfs/gdsfs/gpubuf"
	"github.com/gdsfs/gdsfs/internal/errname"
	"github.com/rs/zerolog"
	"golang.org/x/sys/unix"
)

// session is one open of <mount>/.gdsfs: it owns leases until they are
// released or the session closes. It implements fs.Session.
type session struct {
	srv    *Server
	id     uint64
	secret uint64
	uid    uint32

	// active counts operations in flight on the session (S5): Close waits
	// for them before the session's leases go back to the pool, so an
	// engine never moves bytes into or out of memory that has been
	// released (and perhaps handed to another session or uid).
	active sync.WaitGroup

	mu sync.Mutex
	// GUARDED_BY(mu)
	closed bool
	leases map[uint64]leaseInfo // what the client was told about each lease
	// writing counts the WRITEs reading each lease's memory; RELEASE of a
	// lease waits (on unpinned) until its count is 0, so a lease is never
	// released under a write, and waits for nothing else: the session's
	// other leases are written and released meanwhile. GUARDED_BY(mu)
	writing  map[uint64]int
	unpinned *sync.Cond // on mu: a lease's writing count fell to 0
	status   []byte     // STATUS snapshot taken at offset 0
}

// enter registers an operation in flight; it fails once the session is
// closing. Every successful enter is paired with leave.
func (ss *session) enter() bool {
	ss.mu.Lock()
	defer ss.mu.Unlock()
	if ss.closed {
		return false
	}
	ss.active.Add(1)
	return true
}

func (ss *session) leave() { ss.active.Done() }

// leaseInfo is what the session told the client about a lease: where its
// first byte is in the slab and how many bytes the client may use.
type leaseInfo struct {
	slabOff int64
	valid   int64
}

var _ fs.Session = (*session)(nil)

func (ss *session) owner() gpubuf.Owner { return gpubuf.Owner{Session: ss.id, UID: ss.uid} }

// Ioctl implements fs.Session: the control-file commands.
func (ss *session) Ioctl(ctx context.Context, c fs.Caller, cmd uint32, in, out []byte) (int32, syscall.Errno) {
	if !ctl.OurCmd(cmd) {
		ss.srv.counters.foreign.Add(1) // a tty ioctl, not a refusal
		return 0, syscall.ENOTTY
	}
	errno := ss.ioctl(ctx, c, cmd, in, out)
	ss.srv.counters.result(errno)
	if errno != 0 {
		ss.srv.opts.Log.Debug().Str("op", "ctl-ioctl").Hex("cmd", u32bytes(cmd)).Uint64("session", ss.id).
			Uint32("uid", c.UID).Str("errno", errname.Of(errno)).Msg("ctl: refused")
	}
	return 0, errno
}

func (ss *session) ioctl(ctx context.Context, c fs.Caller, cmd uint32, in, out []byte) syscall.Errno {
	size := ctl.CmdSize(cmd)
	if len(in) != size || len(out) != size {
		return syscall.ENOTTY
	}
	// The descriptor may have been passed to another uid (SCM_RIGHTS,
	// setuid after fork): the session still serves only its owner (S1).
	if c.UID != ss.uid {
		return syscall.EPERM
	}
	h := controlCommand(cmd)
	if h == nil {
		return syscall.ENOTTY
	}
	return h(ss, ctx, c, in, out)
}

// target is the session a control-file command acts on: the token's when
// one is given, this one otherwise.
func (ss *session) target(t ctl.Token, c fs.Caller) (*session, syscall.Errno) {
	if t.IsZero() {
		return ss, 0
	}
	return ss.srv.session(t, c)
}

// within runs fn on the target session t as an operation in flight (S5).
func (ss *session) within(t ctl.Token, c fs.Caller, fn func(*session) syscall.Errno) syscall.Errno {
	ts, errno := ss.target(t, c)
	if errno != 0 {
		return errno
	}
	if !ts.enter() {
		return syscall.EPERM
	}
	defer ts.leave()
	return fn(ts)
}

func (ss *session) hello(out []byte) {
	s := ss.srv
	r := ctl.HelloReply{
		Version:       uint32(ctl.Version),
		UID:           ss.uid,
		Caps:          s.caps(),
		Token:         ctl.Token{Session: ss.id, Secret: ss.secret},
		MaxRanges:     ctl.MaxRanges,
		MaxNamesBytes: ctl.NamesBytes,
		Align:         ctl.AlignBytes,
		MaxLease:      uint64(s.maxLease),
		Page:          ctl.PageBytes,
		DaemonPID:     s.pid,
		Engine:        s.opts.Engine,
		DaemonVersion: s.opts.Version,
		SlabSocket:    s.opts.SlabSocket,
	}
	if !s.host {
		r.Devices = uint32(s.devices)
	}
	r.Encode(out)
}

// slab serves SLAB for this session.
func (ss *session) slab(id uint64, out []byte) syscall.Errno {
	sl, h, errno := ss.export(id)
	if errno != 0 {
		return errno
	}
	if len(h) > ctl.HandleBytes {
		ss.srv.opts.Log.Error().Int("bytes", len(h)).Uint64("slab", id).Msg("ctl: slab handle does not fit the SLAB reply")
		return syscall.EIO
	}
	r := ctl.SlabReply{Slab: id, Size: uint64(sl.Size), Kind: ctl.SlabHost, Device: ss.srv.wireDevice(sl.Device), Handle: h}
	r.Kind = slabKind(sl.Memory)
	r.Encode(out)
	return 0
}

// export returns slab id and its handle bytes if the session holds a
// lease in it (the pool's Export is that check): SLAB and the slab
// socket's descriptors both go through it.
func (ss *session) export(id uint64) (*gpubuf.Slab, []byte, syscall.Errno) {
	p := ss.srv.opts.Pool
	if id == 0 || id > 1<<32-1 {
		return nil, nil, syscall.ENOENT
	}
	sl, err := p.Slab(uint32(id))
	if err != nil {
		errno, _ := errnoOf(failSlab, err)
		return nil, nil, errno
	}
	h, err := p.Export(ss.owner(), uint32(id))
	if err != nil {
		return nil, nil, ss.srv.failed(failExport, err, "ctl: export slab", func(e *zerolog.Event) *zerolog.Event { return e.Uint64("slab", id) })
	}
	return sl, h, 0
}

// alloc serves ALLOC for this session.
func (ss *session) alloc(ctx context.Context, req ctl.AllocRequest, out []byte) syscall.Errno {
	s := ss.srv
	if s.opts.ReadOnly {
		return syscall.EROFS
	}
	dev, errno := s.device(req.Device)
	if errno != 0 {
		return errno
	}
	switch {
	case req.Length == 0:
		return syscall.EINVAL
	case req.Length > uint64(s.maxLease):
		return syscall.E2BIG
	}
	n := int64(req.Length)
	l, errno := ss.allocLease(ctx, dev, n)
	if errno != 0 {
		return errno
	}
	ss.record(l, leaseInfo{valid: n})
	ctl.EncodeAllocReply(out, ctl.Lease{ID: l.ID, Slab: uint64(l.Slab.ID), Offset: uint64(l.Offset), Length: req.Length, Valid: req.Length})
	return 0
}

// allocLease leases n bytes on dev for the session. The caller is an
// operation in flight (S5) and records the lease once it may be released
// by the client.
func (ss *session) allocLease(ctx context.Context, dev int, n int64) (*gpubuf.Lease, syscall.Errno) {
	l, err := ss.srv.opts.Pool.Alloc(ctx, ss.owner(), dev, n)
	if err != nil {
		return nil, ss.srv.failed(failAlloc, err, "ctl: allocate lease", func(e *zerolog.Event) *zerolog.Event { return e.Uint64("session", ss.id) })
	}
	return l, 0
}

// record makes lease l known to the client side of the session (S2):
// releasable and writable. li.slabOff is relative to the lease's start.
func (ss *session) record(l *gpubuf.Lease, li leaseInfo) {
	li.slabOff += l.Offset
	ss.mu.Lock()
	ss.leases[l.ID] = li
	ss.mu.Unlock()
}

// release serves RELEASE for this session.
func (ss *session) release(ids []uint64, out []byte) {
	r := ctl.ReleaseReply{Status: make([]syscall.Errno, len(ids))}
	for i, id := range ids {
		if ss.forget(id) {
			if err := ss.srv.opts.Pool.Release(ss.owner(), id); err == nil {
				r.Released++
				continue
			}
		}
		r.Status[i] = syscall.ENOENT
	}
	r.Encode(out)
}

// forget removes lease id from the session's table, once no WRITE reads
// its memory, and reports whether it was there. From then on no WRITE can
// pin it (lease answers ENOENT).
func (ss *session) forget(id uint64) bool {
	ss.mu.Lock()
	defer ss.mu.Unlock()
	for ss.writing[id] > 0 {
		ss.unpinned.Wait()
	}
	_, ok := ss.leases[id]
	delete(ss.leases, id)
	return ok
}

// pinLease returns what the session knows about lease id and the pool's
// lease, pinned against RELEASE until unpin is called (WRITE reads its
// memory meanwhile).
func (ss *session) pinLease(id uint64) (leaseInfo, *gpubuf.Lease, func(), syscall.Errno) {
	ss.mu.Lock()
	li, ok := ss.leases[id]
	if ok {
		if ss.writing == nil {
			ss.writing = make(map[uint64]int)
			ss.unpinned = sync.NewCond(&ss.mu)
		}
		ss.writing[id]++
	}
	ss.mu.Unlock()
	if !ok {
		return leaseInfo{}, nil, nil, syscall.ENOENT
	}
	unpin := func() {
		ss.mu.Lock()
		if ss.writing[id]--; ss.writing[id] == 0 {
			delete(ss.writing, id)
			ss.unpinned.Broadcast()
		}
		ss.mu.Unlock()
	}
	l, err := ss.srv.opts.Pool.Lookup(ss.owner(), id)
	if err != nil {
		unpin()
		return leaseInfo{}, nil, nil, syscall.ENOENT
	}
	return li, l, unpin, 0
}

// statusPage serves STATUS: a snapshot at offset 0, pages from it after.
func (ss *session) statusPage(off uint64, out []byte) syscall.Errno {
	ss.mu.Lock()
	doc := ss.status
	ss.mu.Unlock()
	if off == 0 || doc == nil {
		var errno syscall.Errno
		if doc, errno = ss.srv.statsJSON(ss.uid); errno != 0 {
			return errno
		}
		ss.mu.Lock()
		ss.status = doc
		ss.mu.Unlock()
	}
	return plainErrno(ctl.EncodePage(out, doc, off))
}

// readRanges leases memory for every span and reads it with eng. All or
// nothing (S3): on error every lease of the request is released. The
// leases become visible to the client (RELEASE, WRITE) only once their
// bytes are in place. The caller is an operation in flight (S5).
func (ss *session) readRanges(ctx context.Context, f *os.File, eng cufile.Engine, code ctl.EngineCode, dev int, plan []span) ([]ctl.Lease, syscall.Errno) {
	p := ss.srv.opts.Pool
	out := make([]ctl.Lease, len(plan))
	held := make([]*gpubuf.Lease, len(plan))
	fail := func(errno syscall.Errno) ([]ctl.Lease, syscall.Errno) {
		for _, l := range held {
			if l != nil {
				_ = p.Release(ss.owner(), l.ID)
			}
		}
		return nil, errno
	}
	for i, sp := range plan {
		out[i] = ctl.Lease{Length: uint64(sp.length)}
		if sp.valid == 0 {
			continue
		}
		l, errno := ss.allocLease(ctx, dev, sp.end-sp.start)
		if errno != 0 {
			return fail(errno)
		}
		held[i] = l
	}
	// Ranges are independent: read them concurrently, a few at a time
	// (engines parallelise within a range too). This goroutine is one of
	// the readers: a request of one range costs no goroutine hand-off.
	errs := make([]error, len(plan))
	got := make([]int64, len(plan))
	var todo []int
	for i := range plan {
		if held[i] != nil {
			todo = append(todo, i)
		}
	}
	if vr, ok := eng.(cufile.VecReader); ok && len(todo) > 1 {
		// Many ranges: the engine reads them together (issue 15).
		readVec(ctx, vr, f, plan, held, todo, got, errs)
		todo = nil
	}
	var next atomic.Int64
	readSome := func() {
		for {
			k := int(next.Add(1) - 1)
			if k >= len(todo) {
				return
			}
			i := todo[k]
			sp, l := plan[i], held[i]
			got[i], errs[i] = eng.ReadAt(ctx, f, l.Slab.Memory, l.Offset, sp.start, sp.end-sp.start)
		}
	}
	var wg sync.WaitGroup
	for range min(len(todo), runtime.GOMAXPROCS(0), 8) - 1 {
		wg.Go(readSome)
	}
	readSome()
	wg.Wait()
	for i := range plan {
		if held[i] != nil && errs[i] != nil {
			return fail(ss.srv.ioErrno(errs[i], "read", f.Name()))
		}
	}
	var bytes uint64
	for i, sp := range plan {
		l := held[i]
		if l == nil {
			continue
		}
		// The file may have shrunk since it was measured: report what
		// the engine found (short only at end of file).
		valid := min(sp.valid, max(0, got[i]-(sp.off-sp.start)))
		ss.record(l, leaseInfo{slabOff: sp.off - sp.start, valid: valid})
		out[i] = ctl.Lease{ID: l.ID, Slab: uint64(l.Slab.ID), Offset: uint64(l.Offset + sp.off - sp.start),
			Length: uint64(sp.length), Valid: uint64(valid), Engine: code}
		bytes += uint64(valid)
	}
	ss.srv.counters.reads.Add(1)
	ss.srv.counters.readRanges.Add(uint64(len(plan)))
	ss.srv.counters.readBytes.Add(bytes)
	return out, 0
}

// Close implements fs.Session: it ends the session and releases every lease
// it holds (S2). It is idempotent.
func (ss *session) Close() error {
	ss.mu.Lock()
	if ss.closed {
		ss.mu.Unlock()
		return nil
	}
	ss.closed = true
	ss.mu.Unlock()
	// No new operation can start; wait for those in flight (S5).
	ss.active.Wait()
	ss.mu.Lock()
	ss.leases = nil
	ss.mu.Unlock()
	sh := ss.srv.shard(ss.id)
	sh.mu.Lock()
	delete(sh.sessions, ss.id)
	sh.mu.Unlock()
	n := ss.srv.opts.Pool.ReleaseSession(ss.id)
	ss.srv.opts.Log.Debug().Uint64("session", ss.id).Int("leases", n).Msg("ctl: session closed")
	return nil
}

// fdatasync flushes f's data to stable storage.
func fdatasync(f *os.File) error {
	rc, err := f.SyscallConn()
	if err != nil {
		return err
	}
	var serr error
	if err := rc.Control(func(fd uintptr) { serr = unix.Fdatasync(int(fd)) }); err != nil {
		return err
	}
	return serr
}

// dropLeases releases leases of a READ that is refused after its bytes
// were read (ESTALE): the reply is never written, so the client never
// learns their ids.
func (ss *session) dropLeases(ls []ctl.Lease) {
	for _, l := range ls {
		if l.ID != 0 && ss.forget(l.ID) {
			_ = ss.srv.opts.Pool.Release(ss.owner(), l.ID)
		}
	}
}
