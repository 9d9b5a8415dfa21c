package fs

import (
	"cmp"
	"fmt"
	"slices"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	"github.com/rs/zerolog"
	"golang.org/x/sys/unix"
)

// The daemon is root and shared by every user of the node, and every open
// of a file on the mount holds a descriptor of the daemon's until the
// kernel's RELEASE. Each user's processes live under their own
// RLIMIT_NOFILE, so one user with many processes can hold more files open
// through the mount than the daemon's one limit allows: every user's opens
// would then fail, and the control path with them. openBudget gives each
// uid a budget of the daemon's descriptors instead, and keeps a reserve no
// user's opens can take.
//
// What one open costs (measured, docs/operations.md "Open files"): a data
// file 1 descriptor (passthrough or not: the kernel holds its own
// reference to a registered backing file, the daemon still keeps its
// descriptor until RELEASE), plus 1 once the control path serves an ioctl
// on it (its duplicate, fileHandle.osFile); a directory 2 (the stream and
// the descriptor fstat uses); a control session 1 (it holds no descriptor
// but an entry in the session table, which this bounds per uid too).

const (
	// minOpenReserve and maxOpenReserve bound the descriptors kept for
	// the daemon's own needs: the /dev/fuse connection, its logs, the
	// slab socket and its connections (per-uid capped by handoffserver),
	// the metrics listener, cuFile's registered handles (at most 1024),
	// the lookup stash, and the descriptors a request holds while it is
	// served (lookups, xattrs, engine reopens, readahead fills).
	minOpenReserve = 64
	maxOpenReserve = 8192
	// defaultUIDShares is how many uids can hold their whole default
	// budget at once: each gets 1/defaultUIDShares of what the reserve
	// leaves.
	defaultUIDShares = 4
	// openRefusalLogEvery rate-limits the log line of a uid's refusals.
	openRefusalLogEvery = time.Minute
)

// OpenStats is the daemon's accounting of open files on the mount
// (Server.OpenStats), in descriptors of the daemon's (see openBudget).
type OpenStats struct {
	// Limit is the daemon's RLIMIT_NOFILE (soft) when it mounted.
	Limit int64 `json:"limit"`
	// Reserve is what no user's opens can take.
	Reserve int64 `json:"reserve"`
	// PerUID is each uid's budget (gdsfs mount --max-open-per-user).
	PerUID int64 `json:"per_uid"`
	// Open is what every uid's opens hold now.
	Open int64 `json:"open"`
	// Refused counts opens refused with EMFILE (a uid at its budget) or
	// ENFILE (every user together at Limit - Reserve).
	Refused uint64 `json:"refused"`
	// UIDs holds every uid that holds opens or was refused one.
	UIDs []UIDOpenStats `json:"uids,omitempty"`
}

// UIDOpenStats is one uid's share of OpenStats.
type UIDOpenStats struct {
	UID     uint32 `json:"uid"`
	Open    int64  `json:"open"`
	Refused uint64 `json:"refused"`
}

// openBudget counts the daemon's descriptors held for each uid's opens.
// Charging is two atomic operations and a lock-free map read: it is on the
// path of every open.
type openBudget struct {
	limit, reserve int64
	total          int64 // limit - reserve: every uid together
	perUID         int64
	log            zerolog.Logger

	open    atomic.Int64
	refused atomic.Uint64
	lastLog atomic.Int64 // unix nanoseconds of the last daemon-wide refusal logged
	// uids maps a uid to its *uidOpens. Entries are never removed: one
	// per uid that ever opened a file (a user cannot make up uids).
	uids sync.Map
}

type uidOpens struct {
	open    atomic.Int64
	refused atomic.Uint64
	lastLog atomic.Int64
}

// openLimit is the soft RLIMIT_NOFILE of this process (Go raised it to the
// hard limit at start), capped to what fits the arithmetic.
func openLimit() (int64, error) {
	var rl unix.Rlimit
	if err := unix.Getrlimit(unix.RLIMIT_NOFILE, &rl); err != nil {
		return 0, fmt.Errorf("fs: getrlimit(RLIMIT_NOFILE): %w", err)
	}
	return int64(min(rl.Cur, 1<<40)), nil
}

// newOpenBudget sizes the budget for a daemon of descriptor limit limit:
// the reserve is an eighth of it, within [minOpenReserve, maxOpenReserve];
// each uid may hold perUID of the rest (0: a quarter of it).
func newOpenBudget(limit, perUID int64, log zerolog.Logger) *openBudget {
	reserve := min(max(limit/8, minOpenReserve), maxOpenReserve)
	b := &openBudget{limit: limit, reserve: reserve, total: max(limit-reserve, 1), log: log}
	b.perUID = perUID
	if perUID <= 0 {
		b.perUID = max(b.total/defaultUIDShares, 1)
	}
	return b
}

func (b *openBudget) of(uid uint32) *uidOpens {
	if v, ok := b.uids.Load(uid); ok {
		return v.(*uidOpens)
	}
	v, _ := b.uids.LoadOrStore(uid, new(uidOpens))
	return v.(*uidOpens)
}

// acquire charges n descriptors to uid: EMFILE when that passes uid's
// budget (what a process gets at its own limit), ENFILE when it passes
// what every user together may hold.
func (b *openBudget) acquire(uid uint32, n int64) syscall.Errno {
	u := b.of(uid)
	for {
		cur := u.open.Load()
		if cur+n > b.perUID {
			b.refuse(uid, u, cur, syscall.EMFILE)
			return syscall.EMFILE
		}
		if u.open.CompareAndSwap(cur, cur+n) {
			break
		}
	}
	if b.open.Add(n) > b.total {
		b.open.Add(-n)
		cur := u.open.Add(-n)
		b.refuse(uid, u, cur, syscall.ENFILE)
		return syscall.ENFILE
	}
	return 0
}

// release returns n descriptors acquire charged to uid.
func (b *openBudget) release(uid uint32, n int64) {
	if n == 0 {
		return
	}
	b.of(uid).open.Add(-n)
	b.open.Add(-n)
}

// refuse counts a refusal and logs it, at most once per uid (and once for
// the daemon-wide budget) per openRefusalLogEvery.
func (b *openBudget) refuse(uid uint32, u *uidOpens, held int64, errno syscall.Errno) {
	u.refused.Add(1)
	b.refused.Add(1)
	last := &u.lastLog
	if errno == syscall.ENFILE {
		last = &b.lastLog
	}
	now := time.Now().UnixNano()
	prev := last.Load()
	if prev != 0 && now-prev < int64(openRefusalLogEvery) || !last.CompareAndSwap(prev, now) {
		return
	}
	if errno == syscall.EMFILE {
		b.log.Warn().Uint32("uid", uid).Int64("held", held).Int64("budget", b.perUID).
			Msg("open budget: this uid holds its share of the daemon's descriptors; its opens fail with EMFILE until it closes files (gdsfs mount --max-open-per-user; logged once a minute)")
		return
	}
	b.log.Warn().Uint32("uid", uid).Int64("held", b.open.Load()).Int64("limit", b.limit).Int64("reserve", b.reserve).
		Msg("open budget: every user's opens together hold all the daemon's descriptors but its reserve; opens fail with ENFILE (raise the daemon's LimitNOFILE; logged once a minute)")
}

// stats is the budget's snapshot, uids in order.
func (b *openBudget) stats() OpenStats {
	st := OpenStats{Limit: b.limit, Reserve: b.reserve, PerUID: b.perUID, Open: b.open.Load(), Refused: b.refused.Load()}
	b.uids.Range(func(k, v any) bool {
		u := v.(*uidOpens)
		if o, r := u.open.Load(), u.refused.Load(); o != 0 || r != 0 {
			st.UIDs = append(st.UIDs, UIDOpenStats{UID: k.(uint32), Open: o, Refused: r})
		}
		return true
	})
	slices.SortFunc(st.UIDs, func(a, c UIDOpenStats) int { return cmp.Compare(a.UID, c.UID) })
	return st
}
