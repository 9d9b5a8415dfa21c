// Package errname names errnos as errno(3) spells them, for logs and for
// the control path's counters (STATUS's counters.errors keys).
package errname

import (
	"strconv"
	"syscall"

	"golang.org/x/sys/unix"
)

// Of returns e's C name ("EAGAIN"), or "errno<n>" for a number the system
// does not name. Where two names share a number it is the one gdsfs has
// always reported (EOPNOTSUPP, not unix.ErrnoName's ENOTSUP).
func Of(e syscall.Errno) string {
	if e == syscall.EOPNOTSUPP {
		return "EOPNOTSUPP"
	}
	if n := unix.ErrnoName(e); n != "" {
		return n
	}
	return "errno" + strconv.Itoa(int(e))
}
