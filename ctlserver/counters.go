package ctlserver

import (
	"fmt"
	"sync/atomic"
	"syscall"
)

// counters are the control path's running totals (user.gdsfs.stats).
type counters struct {
	reads, readRanges, readBytes atomic.Uint64
	writes, writeBytes           atomic.Uint64
	foreign                      atomic.Uint64      // ioctls of other types (tty), not refusals
	errors                       [256]atomic.Uint64 // by errno; larger errnos count in the last slot
}

// CounterStats is a snapshot of the counters.
type CounterStats struct {
	Reads      uint64 `json:"reads"`
	ReadRanges uint64 `json:"read_ranges"`
	ReadBytes  uint64 `json:"read_bytes"`
	Writes     uint64 `json:"writes"`
	WriteBytes uint64 `json:"write_bytes"`
	// Foreign counts ioctls of types other than gdsfs's 'G' (a tty
	// TCGETS from Python's open()): answered ENOTTY, not in Errors.
	Foreign uint64            `json:"foreign_ioctls"`
	Errors  map[string]uint64 `json:"errors"`
}

// result counts a refused or failed request.
func (c *counters) result(errno syscall.Errno) {
	if errno == 0 {
		return
	}
	c.errors[min(int(errno), len(c.errors)-1)].Add(1)
}

func (c *counters) snapshot() CounterStats {
	s := CounterStats{
		Reads: c.reads.Load(), ReadRanges: c.readRanges.Load(), ReadBytes: c.readBytes.Load(),
		Writes: c.writes.Load(), WriteBytes: c.writeBytes.Load(), Foreign: c.foreign.Load(), Errors: map[string]uint64{},
	}
	for i := range c.errors {
		if n := c.errors[i].Load(); n > 0 {
			s.Errors[errnoName(syscall.Errno(i))] = n
		}
	}
	return s
}

// errnoName is the errno's C name, for logs and counters.
func errnoName(e syscall.Errno) string {
	switch e {
	case syscall.ENOTTY:
		return "ENOTTY"
	case syscall.EINVAL:
		return "EINVAL"
	case syscall.EPROTO:
		return "EPROTO"
	case syscall.EPERM:
		return "EPERM"
	case syscall.ERANGE:
		return "ERANGE"
	case syscall.E2BIG:
		return "E2BIG"
	case syscall.EAGAIN:
		return "EAGAIN"
	case syscall.ENODEV:
		return "ENODEV"
	case syscall.ENOENT:
		return "ENOENT"
	case syscall.ENODATA:
		return "ENODATA"
	case syscall.EBADF:
		return "EBADF"
	case syscall.EROFS:
		return "EROFS"
	case syscall.EINTR:
		return "EINTR"
	case syscall.EIO:
		return "EIO"
	case syscall.ENOSPC:
		return "ENOSPC"
	case syscall.EDQUOT:
		return "EDQUOT"
	case syscall.EFBIG:
		return "EFBIG"
	case syscall.EOPNOTSUPP:
		return "EOPNOTSUPP"
	}
	return fmt.Sprintf("errno%d", int(e))
}
