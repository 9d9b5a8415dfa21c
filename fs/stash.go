package fs

import (
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	"golang.org/x/sys/unix"
)

// lookupStashSize bounds the O_PATH descriptors kept for files renamed
// over;
// lookupStashTTL bounds how long one is kept (a stashed descriptor of a
// file deleted meanwhile holds its blocks until it is closed).
const (
	lookupStashSize = 256
	lookupStashTTL  = 2 * time.Second
)

// lookupStash keeps an O_PATH descriptor of each file or symlink that is
// about to be renamed over through the mount, taken just before the
// rename, so that an OPEN (or READLINK) the kernel resolved to it before
// the rename (a rename over it in a tight loop, or a descriptor held
// open O_PATH and reopened through /proc) reaches that very inode instead
// of ESTALE or ENOENT: a local filesystem opens the inode its path walk
// found, and so does gdsfs. Only files replaced through the mount are
// served from the stash; one replaced behind the mount's back gets ESTALE,
// and the kernel looks it up again. Opening the stashed inode is safe: it
// is the inode whose attributes the kernel checked the caller's permission
// against. At most lookupStashSize descriptors are held, each for at most
// lookupStashTTL and no longer than the kernel keeps the inode (OnForget:
// the descriptor of a file renamed over holds its blocks, which the next
// checkpoint save needs); the oldest stash is closed to make room. (Until 2026-12
// every LOOKUP stashed its file, which cost each lookup an open and a
// close and a shared lock for the rare rename.)
type lookupStash struct {
	mu   sync.Mutex
	ring [lookupStashSize]stashEntry // GUARDED_BY(mu)
	next int                         // GUARDED_BY(mu)
	// size is how much of ring is used: fewer descriptors than
	// lookupStashSize for a daemon with a small descriptor limit.
	size int

	stop chan struct{} // closed by close: ends the sweeper
	once sync.Once
}

type stashEntry struct {
	n  *node
	at time.Time
}

// start runs the sweeper that closes stashes older than lookupStashTTL;
// the stash holds at most size descriptors (within [8, lookupStashSize]).
func (s *lookupStash) start(size int) {
	s.size = min(max(size, 8), lookupStashSize)
	s.stop = make(chan struct{})
	go func() {
		t := time.NewTicker(lookupStashTTL / 2)
		defer t.Stop()
		for {
			select {
			case <-s.stop:
				return
			case now := <-t.C:
				s.sweep(now.Add(-lookupStashTTL))
			}
		}
	}()
}

// sweep closes the stashes made before cutoff.
func (s *lookupStash) sweep(cutoff time.Time) {
	s.mu.Lock()
	defer s.mu.Unlock()
	for i, e := range s.ring {
		if e.n != nil && e.at.Before(cutoff) {
			e.n.dropStash()
			s.ring[i] = stashEntry{}
		}
	}
}

// stashedFd holds a node's stashed descriptor plus one (0: none).
type stashedFd struct{ v atomic.Int64 }

func (s *stashedFd) swap(fd int) int { return int(s.v.Swap(int64(fd)+1)) - 1 }

// stashForRename stashes n's file before a rename over it through the
// mount (files and symlinks only: the kernel does not reopen a directory
// it resolved). A failure to open n leaves it without a stash: an OPEN
// resolved before the rename then gets ESTALE or ENOENT, as before.
func (n *node) stashForRename() {
	if t := n.StableAttr().Mode & syscall.S_IFMT; t != syscall.S_IFREG && t != syscall.S_IFLNK {
		return
	}
	fd, errno := n.open(unix.O_PATH)
	if errno != 0 {
		return
	}
	n.m.stash.put(n, fd)
}

// put makes fd (owned by the stash from now on) n's stashed descriptor.
func (s *lookupStash) put(n *node, fd int) {
	n.stashMu.Lock()
	if old := n.stashed.swap(fd); old >= 0 {
		unix.Close(old)
	}
	n.stashMu.Unlock()
	s.mu.Lock()
	victim := s.ring[s.next].n
	s.ring[s.next] = stashEntry{n: n, at: time.Now()}
	s.next = (s.next + 1) % max(s.size, 1)
	s.mu.Unlock()
	if victim != nil && victim != n {
		victim.dropStash()
	}
}

// close stops the sweeper and closes every stashed descriptor (at
// unmount: they hold the backing filesystem).
func (s *lookupStash) close() {
	s.once.Do(func() {
		if s.stop != nil {
			close(s.stop)
		}
	})
	s.sweep(time.Now().Add(time.Hour))
}

// dropStash closes n's stashed descriptor, if any.
func (n *node) dropStash() {
	n.stashMu.Lock()
	defer n.stashMu.Unlock()
	if old := n.stashed.swap(-1); old >= 0 {
		unix.Close(old)
	}
}

// openStashed opens n's stashed inode (from its last lookup) with flags;
// ok is false when there is none or it is not n's file any more. The stash
// stays for later requests on the same lookup (the kernel reads a symlink
// once per walk through it) until it expires or is evicted.
func (n *node) openStashed(flags int) (int, bool) {
	if !n.replaced.Load() {
		return -1, false
	}
	n.stashMu.Lock()
	defer n.stashMu.Unlock()
	s := int(n.stashed.v.Load()) - 1
	if s < 0 {
		return -1, false
	}
	var fd int
	var err error
	if flags&unix.O_PATH != 0 {
		// READLINK and xattrs want an O_PATH descriptor (a symlink's
		// cannot be reopened through /proc).
		fd, err = unix.FcntlInt(uintptr(s), unix.F_DUPFD_CLOEXEC, 0)
	} else {
		fd, err = unix.Open(procPath(s), (flags|unix.O_CLOEXEC)&^unix.O_NOFOLLOW, 0)
	}
	if err != nil {
		return -1, false
	}
	if n.verify(fd) != 0 {
		unix.Close(fd)
		return -1, false
	}
	return fd, true
}

// OnForget implements gofs.NodeOnForgetter: the kernel has forgotten the
// inode, so no OPEN it resolved to it can come any more, and a stash kept
// for one (a file renamed over) would only hold the file's blocks.
func (n *node) OnForget() { n.dropStash() }
