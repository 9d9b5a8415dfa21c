package fs

import (
	"fmt"
	"os"
	"runtime"
	"sync"

	"golang.org/x/sys/unix"
)

// creators run the operations that create an inode (create, mkdir, mknod,
// symlink, O_TMPFILE) on OS threads of their own, as the caller: the
// thread's filesystem uid and gid are the caller's for the call, so the
// backing filesystem gives the new inode the owner and group it would give
// the caller (the directory's group in a setgid directory), atomically,
// with no chown afterwards (a chown clears setuid/setgid bits and, done by
// path, can be raced onto another file). The threads keep root's
// capabilities across the switch (SECBIT_NO_SETUID_FIXUP), so the backing
// filesystem's permission checks, which the kernel already made for the
// caller (default_permissions, with the caller's supplementary groups the
// daemon does not know), do not refuse what the kernel allowed. Their
// umask is 0 (each has its own fs_struct): the kernel has already applied
// the caller's umask to the mode it sends, and the daemon's must not apply
// a second time.
//
// When a root daemon cannot switch credentials (no CAP_SETPCAP), inodes are
// created as root and chowned afterwards through the parent's descriptor
// (see fixOwner). An unprivileged daemon (a user mount, which only its
// user can use) creates its files as itself.
type creators struct {
	reqs chan creatorReq
	// quit is closed by close; reqs is never closed (a request may
	// still come from a FUSE handler when the mount ends).
	quit chan struct{}
	// asCaller is set when the threads switch credentials.
	asCaller bool
	euid     int
	egid     int
	wg       sync.WaitGroup
	once     sync.Once
}

type creatorReq struct {
	c    Caller
	f    func() error
	done chan error
}

// secbitNoSetuidFixup keeps capabilities when the thread's fsuid leaves 0
// (linux/securebits.h).
const secbitNoSetuidFixup = 1 << 2

// nCreators bounds the creations served at once.
const nCreators = 4

func newCreators() (*creators, error) {
	c := &creators{reqs: make(chan creatorReq), quit: make(chan struct{}), euid: os.Geteuid(), egid: os.Getegid()}
	ready := make(chan error, nCreators)
	asCaller := make(chan bool, nCreators)
	for range nCreators {
		c.wg.Add(1)
		go c.run(ready, asCaller)
	}
	ok := true
	for range nCreators {
		if err := <-ready; err != nil {
			c.close()
			return nil, err
		}
		ok = ok && <-asCaller
	}
	c.asCaller = ok
	return c, nil
}

// run serves requests on one locked thread; the thread exits with the
// goroutine (it is never unlocked), so nothing else ever runs with its
// umask or credentials.
func (c *creators) run(ready chan<- error, asCaller chan<- bool) {
	defer c.wg.Done()
	runtime.LockOSThread()
	if err := unix.Unshare(unix.CLONE_FS); err != nil {
		ready <- fmt.Errorf("fs: creator thread: unshare(CLONE_FS): %w", err)
		return
	}
	unix.Umask(0)
	can := c.euid == 0
	if can {
		bits, err := unix.PrctlRetInt(unix.PR_GET_SECUREBITS, 0, 0, 0, 0)
		if err == nil {
			err = unix.Prctl(unix.PR_SET_SECUREBITS, uintptr(bits|secbitNoSetuidFixup), 0, 0, 0)
		}
		can = err == nil
	}
	ready <- nil
	asCaller <- can
	for {
		select {
		case r := <-c.reqs:
			r.done <- c.serve(r, can)
		case <-c.quit:
			return
		}
	}
}

func (c *creators) serve(r creatorReq, can bool) error {
	if !can || !c.asCaller {
		return r.f()
	}
	unix.Setfsgid(int(r.c.GID))
	unix.Setfsuid(int(r.c.UID))
	defer func() {
		unix.Setfsuid(c.euid)
		unix.Setfsgid(c.egid)
	}()
	// setfsuid reports no errors: read the values back.
	if u, _ := unix.SetfsuidRetUid(-1); u != int(r.c.UID) {
		return fmt.Errorf("fs: setfsuid(%d) did not take: %w", r.c.UID, unix.EPERM)
	}
	if g, _ := unix.SetfsgidRetGid(-1); g != int(r.c.GID) {
		return fmt.Errorf("fs: setfsgid(%d) did not take: %w", r.c.GID, unix.EPERM)
	}
	return r.f()
}

// do runs f on a creator thread as c. It reports whether the new inode
// still needs fixOwner: f ran as the daemon, and the daemon is root (an
// unprivileged daemon's files are its own, as the loopback leaves them).
func (c *creators) do(caller Caller, f func() error) (bool, error) {
	fix := !c.asCaller && c.euid == 0
	r := creatorReq{c: caller, f: f, done: make(chan error, 1)}
	select {
	case c.reqs <- r:
		return fix, <-r.done
	case <-c.quit:
		return fix, fmt.Errorf("fs: create after the mount ended: %w", unix.EIO)
	}
}

// close ends the threads.
func (c *creators) close() {
	c.once.Do(func() {
		close(c.quit)
		c.wg.Wait()
	})
}

// fixOwner gives a new inode, created by the daemon itself, the caller's
// owner and group (the directory's group in a setgid directory), not
// following a symlink at name.
func fixOwner(dir int, name string, caller Caller) error {
	var st unix.Stat_t
	if err := unix.Fstat(dir, &st); err != nil {
		return err
	}
	gid := int(caller.GID)
	if st.Mode&unix.S_ISGID != 0 {
		gid = -1
	}
	return unix.Fchownat(dir, name, int(caller.UID), gid, unix.AT_SYMLINK_NOFOLLOW)
}
