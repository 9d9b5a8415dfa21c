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

// reopenFlags are the flags a Reopen may ask for besides the access mode:
// none of them widens access or changes the file (no O_TRUNC, O_CREAT).
const reopenFlags = unix.O_APPEND | unix.O_DIRECT | unix.O_NOATIME | unix.O_SYNC | unix.O_DSYNC |
	unix.O_NONBLOCK | unix.O_CLOEXEC | unix.O_LARGEFILE

// Reopen opens f's file again, through f's descriptor (/proc/self/fd/N),
// with flags (plus O_CLOEXEC). f's descriptor is held for the call, so a
// concurrent Close cannot hand its number to another file meanwhile. The
// open through /proc is not checked against the file's permissions (the
// daemon is root), so Reopen itself refuses (EACCES) flags wider than f's
// own (Of): reading through a descriptor not open for reading, writing
// through one not open for writing, positional writes through an
// appending one, anything through an O_PATH one, and flags that change
// the file (O_TRUNC, O_CREAT).
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
		fl, ferr := unix.FcntlInt(fd, unix.F_GETFL, 0)
		if ferr != nil {
			oerr = ferr
			return
		}
		if why := wider(fl, flags); why != "" {
			oerr = fmt.Errorf("%s: %w", why, unix.EACCES)
			return
		}
		r, oerr = os.OpenFile(fmt.Sprintf("/proc/self/fd/%d", fd), flags|unix.O_CLOEXEC, 0)
	}); err != nil {
		return nil, fmt.Errorf("reopen %q: %w", f.Name(), err)
	}
	if oerr != nil {
		return nil, fmt.Errorf("reopen %q: %w", f.Name(), oerr)
	}
	return r, nil
}

// wider says how flags would grant more than a descriptor opened with
// have ("" when they do not).
func wider(have, flags int) string {
	want := flags & unix.O_ACCMODE
	switch {
	case have&unix.O_PATH != 0:
		return "an O_PATH descriptor grants no I/O"
	case flags&^(unix.O_ACCMODE|reopenFlags) != 0:
		return fmt.Sprintf("flags %#x change the file", flags&^(unix.O_ACCMODE|reopenFlags))
	case want == unix.O_ACCMODE:
		return "no such access mode"
	case want != unix.O_WRONLY && have&unix.O_ACCMODE == unix.O_WRONLY:
		return "reading through a write-only descriptor"
	case want != unix.O_RDONLY && have&unix.O_ACCMODE == unix.O_RDONLY:
		return "writing through a read-only descriptor"
	case want != unix.O_RDONLY && have&unix.O_APPEND != 0 && flags&unix.O_APPEND == 0:
		return "writing at offsets through an appending descriptor"
	}
	return ""
}
