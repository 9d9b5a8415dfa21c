// Package openflags reads a descriptor's open flags (fcntl F_GETFL): the
// access the kernel checked and granted at open(2), which the daemon (root)
// must never exceed on a client's behalf.
package openflags

import (
	"fmt"
	"os"

	"golang.org/x/sys/unix"
)

// Of returns f's open flags. It reads them through f's raw descriptor
// without changing f's blocking mode (as f.Fd() would).
func Of(f *os.File) (int, error) {
	rc, err := f.SyscallConn()
	if err != nil {
		return 0, fmt.Errorf("fcntl %q: %w", f.Name(), err)
	}
	var fl int
	var ferr error
	if err := rc.Control(func(fd uintptr) { fl, ferr = unix.FcntlInt(fd, unix.F_GETFL, 0) }); err != nil {
		return 0, fmt.Errorf("fcntl %q: %w", f.Name(), err)
	}
	if ferr != nil {
		return 0, fmt.Errorf("fcntl %q: %w", f.Name(), ferr)
	}
	return fl, nil
}

// AccessMode returns f's O_ACCMODE bits: O_RDONLY, O_WRONLY or O_RDWR.
func AccessMode(f *os.File) (int, error) {
	fl, err := Of(f)
	return fl & unix.O_ACCMODE, err
}

// Readable reports whether f was opened for reading (O_RDONLY or O_RDWR).
func Readable(f *os.File) bool {
	m, err := AccessMode(f)
	return err == nil && m != unix.O_WRONLY
}

// Writable reports whether f was opened for writing (O_WRONLY or O_RDWR).
func Writable(f *os.File) bool {
	m, err := AccessMode(f)
	return err == nil && m != unix.O_RDONLY
}

// Reopen opens f's file again, through f's descriptor (/proc/self/fd/N),
// with flags (plus O_CLOEXEC). f's descriptor is held for the call, so a
// concurrent Close cannot hand its number to another file meanwhile. The
// caller chooses flags no wider than f's own (Of): the daemon, root, must
// never hold a file with more rights than the client's descriptor grants.
func Reopen(f *os.File, flags int) (*os.File, error) {
	rc, err := f.SyscallConn()
	if err != nil {
		return nil, fmt.Errorf("reopen %q: %w", f.Name(), err)
	}
	var (
		r    *os.File
		oerr error
	)
	if err := rc.Control(func(fd uintptr) {
		r, oerr = os.OpenFile(fmt.Sprintf("/proc/self/fd/%d", fd), flags|unix.O_CLOEXEC, 0)
	}); err != nil {
		return nil, fmt.Errorf("reopen %q: %w", f.Name(), err)
	}
	return r, oerr
}
