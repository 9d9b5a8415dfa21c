package fs

import (
	"context"
	"slices"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	gofs "github.com/hanwen/go-fuse/v2/fs"
	"github.com/hanwen/go-fuse/v2/fuse"
	"golang.org/x/sys/unix"
)

// POSIX record locks (fcntl F_SETLK/F_SETLKW/F_GETLK, lockf) through the
// mount belong to the kernel's lock owner, one per process (its file
// table), as on a local filesystem: a process never conflicts with itself
// across its descriptors of a file, and its close of any of them releases
// all its locks on the file. go-fuse's loopback took each as an OFD lock of
// the handle's own descriptor, per open instead of per process.
//
// The daemon keeps, per inode, one backing descriptor for each lock owner
// that holds locks on it, and takes the owner's locks on the backing file
// as OFD locks of that descriptor. The backing filesystem so decides every
// conflict (with other owners through the mount, with processes using the
// backing directory directly, and with other NFS clients), and splits and
// merges one owner's ranges exactly as it does one process's. The daemon
// mirrors each owner's ranges only to name the holder (its pid) in F_GETLK.
//
// The kernel sends the owner with each lock request and with FLUSH, which
// it sends at every close (so read-only opens must not answer
// FOPEN_NOFLUSH): FLUSH releases the owner's locks on the file. An OFD lock
// taken through the mount (F_OFD_SETLK) reaches the daemon the same way,
// with the open file as its owner, which no FLUSH names: it is released
// with the handle it was taken through, at RELEASE.

// maxLockEnd is the last offset a lock can cover (OFFSET_MAX): the end of
// a range that runs to the end of the file, however it grows.
const maxLockEnd = 1<<63 - 1

// How often a blocked F_SETLKW tries again when no lock of the file was
// released through the mount meanwhile (a release by a process on the
// backing directory, or another NFS client, is seen by trying): from
// lockRetryMin, doubling to lockRetryMax.
const (
	lockRetryMin = time.Millisecond
	lockRetryMax = 128 * time.Millisecond
)

// lockSpan is one range [start, end] an owner holds with type typ
// (F_RDLCK or F_WRLCK).
type lockSpan struct {
	start, end uint64
	typ        uint32
}

// setSpans returns spans (sorted, disjoint, adjacent spans of one type
// merged) with [start, end] set to typ, F_UNLCK removing it: the change a
// lock request makes to one owner's locks. start <= end <= maxLockEnd.
func setSpans(spans []lockSpan, start, end uint64, typ uint32) []lockSpan {
	out := make([]lockSpan, 0, len(spans)+2)
	for _, s := range spans {
		if s.end < start || s.start > end {
			out = append(out, s)
			continue
		}
		if s.start < start {
			out = append(out, lockSpan{s.start, start - 1, s.typ})
		}
		if s.end > end {
			out = append(out, lockSpan{end + 1, s.end, s.typ})
		}
	}
	if typ != syscall.F_UNLCK {
		out = append(out, lockSpan{start, end, typ})
	}
	slices.SortFunc(out, func(a, b lockSpan) int {
		switch {
		case a.start < b.start:
			return -1
		case a.start > b.start:
			return 1
		}
		return 0
	})
	merged := out[:0]
	for _, s := range out {
		if k := len(merged) - 1; k >= 0 && merged[k].typ == s.typ && merged[k].end+1 == s.start {
			merged[k].end = s.end
			continue
		}
		merged = append(merged, s)
	}
	return merged
}

// overlaps reports whether any of spans meets [start, end].
func overlaps(spans []lockSpan, start, end uint64) bool {
	for _, s := range spans {
		if s.start <= end && s.end >= start {
			return true
		}
	}
	return false
}

// lockOwner is one lock owner's POSIX locks on one inode.
type lockOwner struct {
	fd    int // backing descriptor holding the owner's locks as OFD locks
	acc   int // fd's access mode
	uid   uint32
	pid   uint32 // the process that last took a lock (F_GETLK's l_pid)
	spans []lockSpan
	// handles are the opens the owner took locks through: the release
	// of one releases the owner's locks (an OFD lock's owner is the
	// open file; a process's are released by its FLUSH before that).
	handles []*fileHandle
}

// inodeLocks is the lock owners of one inode. Its lock is taken only by
// lock requests, FLUSH and RELEASE (never by READ or WRITE), alone or
// after a handle's flk; the backing calls made under it never block.
type inodeLocks struct {
	mu     sync.Mutex
	owners map[uint64]*lockOwner
	// n is len(owners), read without mu by FLUSH and RELEASE of files
	// with no locks.
	n atomic.Int32
	// released is closed (and cleared) when a lock of the inode is
	// released through the mount: blocked F_SETLKW requests try again.
	released chan struct{}
}

// lockFlock converts fuse's lock to a backing OFD lock, or EINVAL for a
// range or type no kernel sends.
func lockFlock(lk *fuse.FileLock, getlk bool) (unix.Flock_t, syscall.Errno) {
	switch lk.Typ {
	case syscall.F_RDLCK, syscall.F_WRLCK:
	case syscall.F_UNLCK:
		if getlk {
			return unix.Flock_t{}, syscall.EINVAL
		}
	default:
		return unix.Flock_t{}, syscall.EINVAL
	}
	if lk.Start > lk.End || lk.End > maxLockEnd {
		return unix.Flock_t{}, syscall.EINVAL
	}
	fl := unix.Flock_t{Type: int16(lk.Typ), Whence: 0, Start: int64(lk.Start)}
	if lk.End != maxLockEnd {
		fl.Len = int64(lk.End - lk.Start + 1)
	}
	return fl, 0
}

// signal wakes blocked F_SETLKW requests. l.mu is held.
func (l *inodeLocks) signal() {
	if l.released != nil {
		close(l.released)
		l.released = nil
	}
}

// releasedBy wakes blocked F_SETLKW requests after owner key released
// locks of the inode, and forgets the waits recorded against key's locks
// of the inode: what they waited for may be free now, so they are no
// longer part of a cycle (they record their wait again when they retry).
// l.mu is held.
func (l *inodeLocks) releasedBy(m *mountState, key uint64) {
	l.signal()
	m.lockWaits.released(l, key)
}

// drop releases o's locks (closing its descriptor releases its OFD locks)
// and forgets it. l.mu is held.
func (l *inodeLocks) drop(m *mountState, key uint64, o *lockOwner) {
	unix.Close(o.fd)
	m.opens.release(o.uid, 1)
	delete(l.owners, key)
	l.n.Store(int32(len(l.owners)))
	m.lockOwners.Add(-1)
	l.releasedBy(m, key)
}

// newOwner opens the backing descriptor for a new owner locking through
// h: for reading and writing where h may write (a process may lock
// through its other descriptors too), else as h was opened (a write open
// of the backing file would tell watchers it was written). It is charged
// to h's opener. l.mu is held.
func (l *inodeLocks) newOwner(h *fileHandle, key uint64) (*lockOwner, syscall.Errno) {
	if h.fd < 0 {
		return nil, syscall.EBADF
	}
	if errno := h.m.opens.acquire(h.uid, 1); errno != 0 {
		// The opener's share of the daemon's descriptors is spent.
		return nil, syscall.ENOLCK
	}
	acc := h.acc
	fd := -1
	var err error
	if acc != syscall.O_RDONLY {
		fd, err = h.reopen(syscall.O_RDWR)
		if err == nil {
			acc = syscall.O_RDWR
		}
	}
	if fd < 0 {
		fd, err = h.reopen(acc)
	}
	if err != nil {
		h.m.opens.release(h.uid, 1)
		return nil, gofs.ToErrno(err)
	}
	o := &lockOwner{fd: fd, acc: acc, uid: h.uid}
	if l.owners == nil {
		l.owners = map[uint64]*lockOwner{}
	}
	l.owners[key] = o
	l.n.Store(int32(len(l.owners)))
	h.m.lockOwners.Add(1)
	return o, 0
}

// allows reports whether a descriptor opened acc may hold locks of typ.
func allows(acc int, typ uint32) bool {
	if typ == syscall.F_RDLCK {
		return acc != syscall.O_WRONLY
	}
	return acc != syscall.O_RDONLY
}

// widen moves o's locks to a new descriptor open for reading and writing,
// for a lock type its descriptor cannot hold (a process that read-locked
// through a read-only open now write-locks through a write open). Only a
// read-only descriptor is widened: its read locks never conflict with the
// same ranges' read locks of the new one. l.mu is held.
func (o *lockOwner) widen(h *fileHandle) syscall.Errno {
	if o.acc != syscall.O_RDONLY {
		return syscall.ENOLCK
	}
	fd, err := h.reopen(syscall.O_RDWR)
	if err != nil {
		return gofs.ToErrno(err)
	}
	for _, s := range o.spans {
		fl := unix.Flock_t{Type: int16(s.typ), Start: int64(s.start)}
		if s.end != maxLockEnd {
			fl.Len = int64(s.end - s.start + 1)
		}
		if err := unix.FcntlFlock(uintptr(fd), unix.F_OFD_SETLK, &fl); err != nil {
			unix.Close(fd)
			return gofs.ToErrno(err)
		}
	}
	unix.Close(o.fd)
	o.fd, o.acc = fd, syscall.O_RDWR
	return 0
}

// lockConflict is what a blocked lock request waits for: a channel closed
// when a lock of the inode is released through the mount, and the owner
// holding the conflicting lock, if it is one of the mount's.
type lockConflict struct {
	released <-chan struct{}
	inode    *inodeLocks
	holder   uint64
	known    bool
}

// set applies one lock request of owner key through h without blocking.
// With keep, a request that conflicts (EAGAIN) keeps the owner's
// descriptor open for its retries (tidy drops it) and says what it waits
// for.
func (l *inodeLocks) set(h *fileHandle, key uint64, lk *fuse.FileLock, keep bool) (lockConflict, syscall.Errno) {
	var none lockConflict
	fl, errno := lockFlock(lk, false)
	if errno != 0 {
		return none, errno
	}
	l.mu.Lock()
	defer l.mu.Unlock()
	o := l.owners[key]
	if lk.Typ == syscall.F_UNLCK {
		if o == nil {
			return none, 0
		}
		if err := unix.FcntlFlock(uintptr(o.fd), unix.F_OFD_SETLK, &fl); err != nil {
			return none, gofs.ToErrno(err)
		}
		o.spans = setSpans(o.spans, lk.Start, lk.End, syscall.F_UNLCK)
		if len(o.spans) == 0 {
			l.drop(h.m, key, o)
		} else {
			l.releasedBy(h.m, key)
		}
		return none, 0
	}
	if o == nil {
		if o, errno = l.newOwner(h, key); errno != 0 {
			return none, errno
		}
	}
	if !allows(o.acc, lk.Typ) {
		if errno := o.widen(h); errno != 0 {
			l.tidyLocked(h.m, key, o)
			return none, errno
		}
	}
	if !slices.Contains(o.handles, h) {
		o.handles = append(o.handles, h)
	}
	if err := unix.FcntlFlock(uintptr(o.fd), unix.F_OFD_SETLK, &fl); err != nil {
		errno := gofs.ToErrno(err)
		if errno == syscall.EAGAIN && keep {
			if l.released == nil {
				l.released = make(chan struct{})
			}
			c := lockConflict{released: l.released, inode: l}
			c.holder, c.known = l.holder(o.fd, key, fl)
			return c, errno
		}
		l.tidyLocked(h.m, key, o)
		return none, errno
	}
	freed := overlaps(o.spans, lk.Start, lk.End)
	o.spans = setSpans(o.spans, lk.Start, lk.End, lk.Typ)
	o.pid = lk.Pid
	if freed {
		// A downgrade, or a range of one type replaced by another:
		// what it held before may now be free for others.
		l.releasedBy(h.m, key)
	}
	return none, 0
}

// holder finds the owner of the mount holding the first lock that
// conflicts with fl for owner key (whose descriptor is fd). l.mu is held.
func (l *inodeLocks) holder(fd int, key uint64, fl unix.Flock_t) (uint64, bool) {
	if err := unix.FcntlFlock(uintptr(fd), unix.F_OFD_GETLK, &fl); err != nil || fl.Type == syscall.F_UNLCK || fl.Pid > 0 {
		return 0, false
	}
	k, _, ok := l.ownerOf(key, fl)
	return k, ok
}

// ownerOf finds the owner other than key whose range holds the conflict
// fl the backing filesystem reported. l.mu is held.
func (l *inodeLocks) ownerOf(key uint64, fl unix.Flock_t) (uint64, *lockOwner, bool) {
	start, end := uint64(fl.Start), uint64(maxLockEnd)
	if fl.Len > 0 {
		end = uint64(fl.Start + fl.Len - 1)
	}
	for k, o := range l.owners {
		if k == key {
			continue
		}
		for _, s := range o.spans {
			if s.typ == uint32(fl.Type) && s.start <= start && s.end >= end {
				return k, o, true
			}
		}
	}
	return 0, nil, false
}

// tidy drops owner key's descriptor if it holds no locks.
func (l *inodeLocks) tidy(m *mountState, key uint64) {
	l.mu.Lock()
	defer l.mu.Unlock()
	if o := l.owners[key]; o != nil {
		l.tidyLocked(m, key, o)
	}
}

func (l *inodeLocks) tidyLocked(m *mountState, key uint64, o *lockOwner) {
	if len(o.spans) == 0 {
		l.drop(m, key, o)
	}
}

// get answers F_GETLK for owner key through h: the first lock of another
// owner that conflicts with lk, as the backing filesystem finds it, with
// the pid of the process holding it where that is an owner of the mount.
func (l *inodeLocks) get(h *fileHandle, key uint64, lk *fuse.FileLock, out *fuse.FileLock) syscall.Errno {
	fl, errno := lockFlock(lk, true)
	if errno != 0 {
		return errno
	}
	l.mu.Lock()
	defer l.mu.Unlock()
	// The owner's own descriptor, so its own locks are no conflict; an
	// owner without locks asks through the handle's descriptor, which
	// holds none (flock locks are apart).
	fd := h.fd
	if o := l.owners[key]; o != nil {
		fd = o.fd
	}
	if fd < 0 {
		return syscall.EBADF
	}
	if err := unix.FcntlFlock(uintptr(fd), unix.F_OFD_GETLK, &fl); err != nil {
		return gofs.ToErrno(err)
	}
	*out = fuse.FileLock{Typ: uint32(fl.Type)}
	if fl.Type == syscall.F_UNLCK {
		return 0
	}
	out.Start = uint64(fl.Start)
	out.End = maxLockEnd
	if fl.Len > 0 {
		out.End = uint64(fl.Start + fl.Len - 1)
	}
	if fl.Pid > 0 {
		// A process's POSIX lock on the backing file itself.
		out.Pid = uint32(fl.Pid)
		return 0
	}
	// An OFD lock: the owner through the mount whose range it is, if any
	// (else an OFD lock taken on the backing file directly, whose pid no
	// one knows: 0).
	if _, o, ok := l.ownerOf(key, fl); ok {
		out.Pid = o.pid
	}
	return 0
}

// flush releases owner key's locks: the kernel's FLUSH at a close by the
// process that owns them.
func (l *inodeLocks) flush(m *mountState, key uint64) {
	if l.n.Load() == 0 {
		return
	}
	l.mu.Lock()
	defer l.mu.Unlock()
	if o := l.owners[key]; o != nil {
		l.drop(m, key, o)
	}
}

// release releases the locks of every owner that locked through h, which
// is being released: an OFD lock's owner is h's open file, and a process
// that locked through h has closed it (its FLUSH came first).
func (l *inodeLocks) release(h *fileHandle) {
	if l.n.Load() == 0 {
		return
	}
	l.mu.Lock()
	defer l.mu.Unlock()
	for k, o := range l.owners {
		if slices.Contains(o.handles, h) {
			l.drop(h.m, k, o)
		}
	}
}

// Getlk serves F_GETLK (flock has no test through FUSE).
func (h *fileHandle) Getlk(ctx context.Context, owner uint64, lk *fuse.FileLock, flags uint32, out *fuse.FileLock) syscall.Errno {
	if flags&fuse.FUSE_LK_FLOCK != 0 {
		return syscall.EINVAL
	}
	return h.n.locks.get(h, owner, lk, out)
}

// Setlk serves F_SETLK, and flock(LOCK_NB).
func (h *fileHandle) Setlk(ctx context.Context, owner uint64, lk *fuse.FileLock, flags uint32) syscall.Errno {
	if flags&fuse.FUSE_LK_FLOCK != 0 {
		return h.flock(lk, false)
	}
	_, errno := h.n.locks.set(h, owner, lk, false)
	return errno
}

// flock takes, converts or releases the open's flock lock, on a
// descriptor of its own: not the handle's, which passthrough may share
// with the kernel's registration of the backing file, so that its close
// at RELEASE would not release the lock while other opens of the file
// remain (go-fuse's loopback locked the handle's descriptor: a flock then
// outlived its open).
func (h *fileHandle) flock(lk *fuse.FileLock, blocking bool) syscall.Errno {
	var op int
	switch lk.Typ {
	case syscall.F_RDLCK:
		op = syscall.LOCK_SH
	case syscall.F_WRLCK:
		op = syscall.LOCK_EX
	case syscall.F_UNLCK:
		op = syscall.LOCK_UN
	default:
		return syscall.EINVAL
	}
	if !blocking {
		op |= syscall.LOCK_NB
	}
	h.flk.Lock()
	defer h.flk.Unlock()
	if !h.flk.ok {
		if op&syscall.LOCK_UN != 0 {
			return 0
		}
		if h.fd < 0 {
			return syscall.EBADF
		}
		if errno := h.m.opens.acquire(h.uid, 1); errno != 0 {
			return syscall.ENOLCK
		}
		fd, err := h.reopen(h.acc)
		if err != nil {
			h.m.opens.release(h.uid, 1)
			return gofs.ToErrno(err)
		}
		h.flk.fd, h.flk.ok = fd, true
	}
	err := syscall.Flock(h.flk.fd, op)
	if err == nil && op&^syscall.LOCK_NB != syscall.LOCK_EX {
		h.n.locks.wake()
	}
	return gofs.ToErrno(err)
}

// closeFlock closes the open's flock descriptor, releasing its lock.
func (h *fileHandle) closeFlock() {
	h.flk.Lock()
	defer h.flk.Unlock()
	if h.flk.ok {
		unix.Close(h.flk.fd)
		h.m.opens.release(h.uid, 1)
		h.flk.ok = false
		h.n.locks.wake()
	}
}

// wake wakes blocked lock requests of the inode.
func (l *inodeLocks) wake() {
	l.mu.Lock()
	l.signal()
	l.mu.Unlock()
}

// wakeup returns a channel closed at the next release of a lock of the
// inode through the mount.
func (l *inodeLocks) wakeup() <-chan struct{} {
	l.mu.Lock()
	defer l.mu.Unlock()
	if l.released == nil {
		l.released = make(chan struct{})
	}
	return l.released
}

// flockWait serves a blocking flock like Setlkw: tried again at each
// release through the mount and at least every lockRetryMax, until it is
// granted or the caller is interrupted.
func (h *fileHandle) flockWait(ctx context.Context, lk *fuse.FileLock) syscall.Errno {
	wait := lockRetryMin
	timer := time.NewTimer(wait)
	defer timer.Stop()
	waiting := false
	defer func() {
		if waiting {
			h.m.lockWaits.flock(-1)
		}
	}()
	for {
		released := h.n.locks.wakeup()
		errno := h.flock(lk, false)
		if errno != syscall.EWOULDBLOCK {
			return errno
		}
		if !waiting {
			waiting = true
			h.m.lockWaits.flock(1)
		}
		timer.Reset(wait)
		select {
		case <-released:
		case <-timer.C:
			wait = min(2*wait, lockRetryMax)
		case <-ctx.Done():
			return syscall.EINTR
		}
	}
}

// Setlkw serves F_SETLKW: it tries again whenever a lock of the file is
// released through the mount, and at least every lockRetryMax, until the
// lock is granted or the caller is interrupted (a signal, or kill -9: the
// process can then die). It holds no thread while it waits. A wait that
// would close a cycle of owners of the mount each waiting for the next
// fails with EDEADLK, as the kernel's deadlock check does.
func (h *fileHandle) Setlkw(ctx context.Context, owner uint64, lk *fuse.FileLock, flags uint32) syscall.Errno {
	if flags&fuse.FUSE_LK_FLOCK != 0 {
		return h.flockWait(ctx, lk)
	}
	l, w := &h.n.locks, &h.m.lockWaits
	wait := lockRetryMin
	var timer *time.Timer
	waiting := false
	defer func() {
		if timer != nil {
			timer.Stop()
		}
		if waiting {
			w.done(owner, lk.Pid)
		}
	}()
	for {
		c, errno := l.set(h, owner, lk, true)
		if errno != syscall.EAGAIN {
			if errno != 0 {
				l.tidy(h.m, owner)
			}
			return errno
		}
		if !w.wait(owner, lk.Pid, c, waiting) {
			l.tidy(h.m, owner)
			return syscall.EDEADLK
		}
		waiting = true
		if timer == nil {
			timer = time.NewTimer(wait)
		} else {
			timer.Reset(wait)
		}
		select {
		case <-c.released:
		case <-timer.C:
			wait = min(2*wait, lockRetryMax)
		case <-ctx.Done():
			l.tidy(h.m, owner)
			return syscall.EINTR
		}
	}
}

// maxDeadlockSteps bounds the walk along owners waiting for each other, as
// the kernel's MAX_DEADLK_ITERATIONS does.
const maxDeadlockSteps = 10

// lockWaits is what each blocked F_SETLKW of the mount waits for, across
// inodes (a lock owner is a process, whatever file it locks). Its lock is
// taken alone, or under an inodeLocks' mu when an owner releases locks;
// never the other way round.
type lockWaits struct {
	mu sync.Mutex
	// on maps a waiting owner to the owner holding what it waits for,
	// and the inode of that lock.
	on map[uint64]lockEdge
	// pids counts the waiting requests of each process; flocks counts
	// the blocking flock requests waiting.
	pids   map[uint32]int
	flocks int
}

// lockEdge is the owner holding the lock a blocked owner waits for, and
// the inode of that lock.
type lockEdge struct {
	holder uint64
	inode  *inodeLocks
}

// wait records that owner (process pid) waits for c's holder, unless the
// holder waits, through others, for owner: then it returns false. again
// says owner was already recorded as waiting. A conflict whose inode had
// a lock released since it was found is not recorded: it may be over (the
// request tries again at once, released being closed).
func (w *lockWaits) wait(owner uint64, pid uint32, c lockConflict, again bool) bool {
	w.mu.Lock()
	defer w.mu.Unlock()
	if w.on == nil {
		w.on, w.pids = map[uint64]lockEdge{}, map[uint32]int{}
	}
	stale := false
	select {
	case <-c.released:
		stale = true
	default:
	}
	if c.known && !stale {
		next := c.holder
		for range maxDeadlockSteps {
			if next == owner {
				return false
			}
			e, ok := w.on[next]
			if !ok {
				break
			}
			next = e.holder
		}
		w.on[owner] = lockEdge{c.holder, c.inode}
	} else {
		delete(w.on, owner)
	}
	if !again {
		w.pids[pid]++
	}
	return true
}

// released forgets the waits for owner's locks of inode l, which owner
// released some of.
func (w *lockWaits) released(l *inodeLocks, owner uint64) {
	w.mu.Lock()
	defer w.mu.Unlock()
	for k, e := range w.on {
		if e.holder == owner && e.inode == l {
			delete(w.on, k)
		}
	}
}

// done forgets owner's wait.
func (w *lockWaits) done(owner uint64, pid uint32) {
	w.mu.Lock()
	defer w.mu.Unlock()
	delete(w.on, owner)
	if w.pids[pid]--; w.pids[pid] <= 0 {
		delete(w.pids, pid)
	}
}

// flock counts a blocking flock waiting (d 1) or done waiting (d -1).
func (w *lockWaits) flock(d int) {
	w.mu.Lock()
	w.flocks += d
	w.mu.Unlock()
}

// count returns how many F_SETLKW and blocking flock requests wait.
func (w *lockWaits) count() (setlkw, flocks int) {
	w.mu.Lock()
	defer w.mu.Unlock()
	for _, n := range w.pids {
		setlkw += n
	}
	return setlkw, w.flocks
}

// waiting reports whether process pid has an F_SETLKW waiting (tests).
func (w *lockWaits) waiting(pid uint32) bool {
	w.mu.Lock()
	defer w.mu.Unlock()
	return w.pids[pid] > 0
}

// Flush releases the caller's POSIX locks on the file (the kernel sends
// FLUSH, with the closing process's lock owner, at every close), and
// writes back what the loopback's flush does for a write open.
func (h *fileHandle) Flush(ctx context.Context) syscall.Errno {
	if c, ok := ctx.(*fuse.Context); ok && h.m.lockOwners.Load() > 0 {
		if v, ok := h.m.flushOwners.Load(c.Cancel); ok {
			h.n.locks.flush(h.m, v.(uint64))
		}
	}
	if !h.writable {
		// Nothing to write back: the loopback's flush of a read-only
		// open (a dup and close of its descriptor) would only cost.
		return 0
	}
	return h.LoopbackFile.Flush(ctx)
}

// lockOwnerFS hands FLUSH's lock owner, which go-fuse's bridge does not
// pass on, to fileHandle.Flush: by the request's cancel channel, unique
// among requests in flight and the one the bridge puts in Flush's context.
type lockOwnerFS struct {
	fuse.RawFileSystem
	m *mountState
}

func (f *lockOwnerFS) Flush(c <-chan struct{}, in *fuse.FlushIn) fuse.Status {
	if f.m.lockOwners.Load() > 0 {
		f.m.flushOwners.Store(c, in.LockOwner)
		defer f.m.flushOwners.Delete(c)
	}
	return f.RawFileSystem.Flush(c, in)
}

// reopen opens the open's backing file again with access mode acc, for a
// descriptor of its own that holds locks (the open's descriptor is shared
// with passthrough and the control path).
func (h *fileHandle) reopen(acc int) (int, error) {
	return unix.Open(procPath(h.fd), acc|syscall.O_CLOEXEC|syscall.O_NOCTTY, 0)
}
