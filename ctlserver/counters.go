package ctlserver

import (
	"sync/atomic"
	"syscall"

	"github.com/gdsfs/gdsfs/internal/errname"
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
	// Readaheads counts the readahead requests after sequential READs
	// (readahead.go) and ReadaheadBytes their bytes; ReadaheadDropped
	// those not made because enough were in flight. Root's STATUS counts
	// the jobs started (windows not already cached) for every uid; any
	// other uid's counts its own windows, cached or not (readaheads.count).
	Readaheads       uint64 `json:"readaheads"`
	ReadaheadBytes   uint64 `json:"readahead_bytes"`
	ReadaheadDropped uint64 `json:"readahead_dropped"`
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
			s.Errors[errname.Of(syscall.Errno(i))] = n
		}
	}
	return s
}
