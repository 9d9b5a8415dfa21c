package cufile

import (
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"

	"golang.org/x/sys/unix"

	"github.com/gdsfs/gdsfs/gpubuf"
)

// CrowdColdReads is the Options.ColdCrowd that BenchmarkHostColdStreams
// measures (off by default: here it gave larger requests, not a faster
// read; docs/reliability-coldfix.md): how many cold split reads in flight on
// one engine (this one included) keep the disk's queue full with their workers' preads alone: a
// read that finds that many gets tasks of the device's largest request, and
// no read advises the kernel while that many are in flight
// (coldReads.shape, coldReads.crowded). A cold epoch of 4 MiB samples, 8 DataLoader
// workers READing 64 MiB each at once (the GPU run of 12-02 13:45): with 1
// MiB tasks and WILLNEED ahead of each, the disk kept 66-99 reads of 1.4
// MiB in flight and read 0.80x as fast as the bare files read the same way
// (6-22 reads of 2.6-3.7 MiB in flight). A read alone, or one of two or
// three (BenchmarkHostReadShape: 4 MiB ranges two at a time read 1.9x as
// fast in 1 MiB tasks as in one), keeps the small tasks and the advice
// that keep its queue deep.
const CrowdColdReads = 4

// coldReads is what one engine's cold split reads share: how many are in
// flight, and each backing device's largest request.
type coldReads struct {
	inflight atomic.Int64
	ioBytes  func(dev uint64) int64 // the device's largest request (0: unknown); sysfsMaxIO
	mu       sync.Mutex
	devs     map[uint64]int64 // GUARDED_BY(mu): ioBytes' answers
}

func newColdReads() *coldReads {
	return &coldReads{ioBytes: sysfsMaxIO, devs: map[uint64]int64{}}
}

// shape returns the task size of a read of n bytes of f that
// readTaskBytes gave task, and done, to call when the read ends. A range
// read in whole chunks (cached, short, O_DIRECT) is not a cold split read:
// it keeps task and is not counted. A cold split read is counted in flight
// until done; one that finds opts.ColdCrowd or more of them (itself
// included) is cut into tasks of the device's largest request instead
// (queue/max_sectors_kb, when larger than task; the range split evenly, at
// most ChunkBytes): a pread of that size is submitted as requests of that
// size, and the others' preads keep the queue full.
func (c *coldReads) shape(opts Options, f *os.File, n, task int64) (int64, func()) {
	if c == nil || task >= opts.ChunkBytes || opts.ColdCrowd <= 0 {
		return task, func() {}
	}
	k := c.inflight.Add(1)
	done := func() { c.inflight.Add(-1) }
	if k < int64(opts.ColdCrowd) {
		return task, done
	}
	big := c.deviceIO(f)
	if big <= task {
		return task, done
	}
	count := max(1, n/big)
	return min(opts.ChunkBytes, gpubuf.AlignUp((n+count-1)/count)), done
}

// crowded reports whether opts.ColdCrowd or more cold split reads are in
// flight: the cold advice asks the kernel for nothing then (coldAdvice,
// checked before each task it would advise, so a read that started alone
// stops advising once others join it). WILLNEED of task-sized pieces
// submits requests of at most 2 MiB (the kernel's force readahead
// chunks), and ahead of every one of 8 concurrent reads it kept 66-99 of
// 1.4 MiB in flight where the bare disk served larger ones faster.
func (c *coldReads) crowded(opts Options) bool {
	return c != nil && opts.ColdCrowd > 0 && c.inflight.Load() >= int64(opts.ColdCrowd)
}

// deviceIO is the largest request of f's device, asked once per device.
func (c *coldReads) deviceIO(f *os.File) int64 {
	var st unix.Stat_t
	if err := unix.Fstat(int(f.Fd()), &st); err != nil {
		return 0
	}
	c.mu.Lock()
	defer c.mu.Unlock()
	v, ok := c.devs[st.Dev]
	if !ok {
		v = c.ioBytes(st.Dev)
		c.devs[st.Dev] = v
	}
	return v
}

// sysfsMaxIO reads the largest request the block device dev takes
// (/sys/dev/block/MAJ:MIN/queue/max_sectors_kb; a partition's is its
// disk's), 0 where there is none to read (no block device: tmpfs, overlay,
// a network filesystem).
func sysfsMaxIO(dev uint64) int64 {
	if unix.Major(dev) == 0 {
		return 0
	}
	base := fmt.Sprintf("/sys/dev/block/%d:%d", unix.Major(dev), unix.Minor(dev))
	for _, p := range []string{filepath.Join(base, "queue", "max_sectors_kb"), filepath.Join(base, "..", "queue", "max_sectors_kb")} {
		raw, err := os.ReadFile(p)
		if err != nil {
			continue
		}
		kb, err := strconv.ParseInt(strings.TrimSpace(string(raw)), 10, 64)
		if err != nil || kb <= 0 {
			return 0
		}
		return kb << 10
	}
	return 0
}
