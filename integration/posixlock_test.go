package integration

import (
	"os"
	"syscall"
	"testing"
)

// fcntlLocksArePerProcess replaces go-fuse's posixtest FcntlFlockLocksFile,
// which expects one process's read lock through a second descriptor to
// conflict with its write lock through the first: OFD semantics, what
// go-fuse's loopback gives. POSIX locks belong to the process, and ext4
// grants that lock (converting the process's lock to a read lock); this
// runs the same sequence with ext4's answers. fs's TestPOSIXLocksAsBacking
// checks the rest against ext4.
func fcntlLocksArePerProcess(t *testing.T, mnt string) {
	filename := mnt + "/test"
	f1, err := os.Create(filename)
	if err != nil {
		t.Fatalf("Open failed: %v", err)
	}
	defer f1.Close()
	wlk := syscall.Flock_t{Type: syscall.F_WRLCK}
	if err := syscall.FcntlFlock(f1.Fd(), syscall.F_SETLK, &wlk); err != nil {
		t.Fatalf("FcntlFlock failed: %v", err)
	}
	f2, err := os.OpenFile(filename, os.O_RDWR, 0o766)
	if err != nil {
		t.Fatalf("Open failed: %v", err)
	}
	defer f2.Close()
	rlk := syscall.Flock_t{Type: syscall.F_RDLCK}
	if err := syscall.FcntlFlock(f2.Fd(), syscall.F_SETLK, &rlk); err != nil {
		t.Errorf("read lock through the process's second descriptor: %v, want granted (the lock is the process's)", err)
	}
	// The process's lock is now a read lock: F_GETLK of a write lock
	// through either descriptor sees no conflict (its own lock).
	glk := syscall.Flock_t{Type: syscall.F_WRLCK}
	if err := syscall.FcntlFlock(f1.Fd(), syscall.F_GETLK, &glk); err != nil || glk.Type != syscall.F_UNLCK {
		t.Errorf("F_GETLK: %+v %v, want no conflict with the process's own lock", glk, err)
	}
}
