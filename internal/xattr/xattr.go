// Package xattr reads extended attributes whole, the way gdsfs's virtual
// attributes (user.gdsfs.info, user.gdsfs.index, user.gdsfs.backing) are
// read by its command line.
package xattr

import (
	"errors"
	"syscall"

	"golang.org/x/sys/unix"
)

// maxBytes bounds the buffer Get grows to (the kernel's own limit on an
// attribute value is 64 KiB; E2BIG beyond it).
const maxBytes = 1 << 20

// maxInterrupts bounds how often Get asks again after EINTR.
const maxInterrupts = 100

// Get reads the whole value of the extended attribute name of path
// (following symlinks), growing its buffer while the kernel answers ERANGE.
// Errors are the syscall's errno (ENODATA: no such attribute; ENOTSUP: the
// filesystem has none), unwrapped so callers can errors.Is them.
//
// EINTR is asked again: a signal to the calling thread (the Go runtime
// sends them) interrupts the FUSE request, and gdsfs answers an
// interrupted index request with EINTR while its parse goes on and is
// cached, so asking again gets the answer.
func Get(path, name string) ([]byte, error) {
	buf := make([]byte, 4096)
	for interrupts := 0; ; {
		n, err := unix.Getxattr(path, name, buf)
		if errors.Is(err, syscall.ERANGE) && len(buf) < maxBytes {
			buf = make([]byte, 2*len(buf))
			continue
		}
		if errors.Is(err, syscall.EINTR) && interrupts < maxInterrupts {
			interrupts++
			continue
		}
		if err != nil {
			return nil, err
		}
		return buf[:n], nil
	}
}
