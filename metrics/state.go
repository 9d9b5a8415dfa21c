package metrics

import (
	"sort"
	"strconv"
	"sync"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/gdsfs/gdsfs/cache"
	"github.com/gdsfs/gdsfs/fs"
	"github.com/gdsfs/gdsfs/gpubuf"
)

// MaxUIDLabels bounds the uid label: pool figures of more uids than this
// are summed into uid="other".
const MaxUIDLabels = 32

// Passthrough is the mount's kernel-passthrough state: whether the kernel
// does reads and writes of opened files itself, and the mount's counts of
// opens by how their I/O is served.
type Passthrough struct {
	Enabled bool
	fs.PassthroughStats
}

// SetPool makes every scrape read the pool through f (nil removes it).
func (m *Metrics) SetPool(f func() gpubuf.Stats) {
	if m != nil {
		m.state.set(func(s *sources) { s.pool = f })
	}
}

// SetIndex makes every scrape read the index cache counters through f.
func (m *Metrics) SetIndex(f func() cache.IndexStats) {
	if m != nil {
		m.state.set(func(s *sources) { s.index = f })
	}
}

// SetPassthrough makes every scrape read the passthrough state through f.
func (m *Metrics) SetPassthrough(f func() Passthrough) {
	if m != nil {
		m.state.set(func(s *sources) { s.passthrough = f })
	}
}

// SetOpenFiles makes every scrape read the daemon's descriptors held by
// each uid's opens on the mount, and their budget, through f.
func (m *Metrics) SetOpenFiles(f func() fs.OpenStats) {
	if m != nil {
		m.state.set(func(s *sources) { s.openFiles = f })
	}
}

type sources struct {
	pool        func() gpubuf.Stats
	index       func() cache.IndexStats
	passthrough func() Passthrough
	openFiles   func() fs.OpenStats
}

// stateCollector turns the callbacks into metrics at scrape time, so the
// figures are never stale and the producers keep no metric state.
type stateCollector struct {
	mu  sync.Mutex
	src sources // guarded by mu

	poolBudget, poolAllocated, poolLeased, poolFree *prometheus.Desc
	poolSlabs, poolLeases                           *prometheus.Desc
	poolShare, poolFreed                            *prometheus.Desc
	uidLeased, uidSessions                          *prometheus.Desc
	uidAllocated, uidRefused, uidFreed              *prometheus.Desc
	idxHits, idxMisses, idxEvictions                *prometheus.Desc
	idxParses, idxParseErrors                       *prometheus.Desc
	idxBudget, idxUsed                              *prometheus.Desc
	ptEnabled, ptOpens, ptRefused                   *prometheus.Desc
	ofLimit, ofReserve, ofBudget, ofOpen, ofRefused *prometheus.Desc
}

func newStateCollector() *stateCollector {
	d := func(sub, name, help string, labels ...string) *prometheus.Desc {
		return prometheus.NewDesc(prometheus.BuildFQName(namespace, sub, name), help, labels, nil)
	}
	return &stateCollector{
		poolBudget:     d("pool", "budget_bytes", "Most slab memory the pool may hold on the device.", "device"),
		poolAllocated:  d("pool", "allocated_bytes", "Slab memory allocated on the device.", "device"),
		poolLeased:     d("pool", "in_use_bytes", "Slab memory held by leases on the device.", "device"),
		poolFree:       d("pool", "free_bytes", "Budget not held by leases on the device (allocated or not).", "device"),
		poolSlabs:      d("pool", "slabs", "Slabs allocated on the device.", "device"),
		poolLeases:     d("pool", "leases", "Leases alive on the device.", "device"),
		uidLeased:      d("pool", "uid_in_use_bytes", "Slab memory held by the leases of one uid's sessions (at most 32 uids, the rest as uid=\"other\").", "uid"),
		uidSessions:    d("pool", "uid_sessions", "Sessions of one uid holding leases.", "uid"),
		poolShare:      d("pool", "uid_share_bytes", "Most slab memory one uid may hold on the device (--uid-share).", "device"),
		poolFreed:      d("pool", "freed_slabs_total", "Idle slabs of one uid freed on the device to make room for another uid.", "device"),
		uidAllocated:   d("pool", "uid_allocated_bytes", "Slab memory of one uid, leased or idle, over all devices: what counts against its share.", "uid"),
		uidRefused:     d("pool", "uid_refused_total", "Allocations of one uid refused for lack of memory (its share held or the budget spent).", "uid"),
		uidFreed:       d("pool", "uid_freed_slabs_total", "Idle slabs of one uid freed to make room for other uids.", "uid"),
		idxHits:        d("index_cache", "hits_total", "Shard index lookups served from the cache."),
		idxMisses:      d("index_cache", "misses_total", "Shard index lookups that had to parse."),
		idxEvictions:   d("index_cache", "evictions_total", "Shard indexes evicted from the cache."),
		idxParses:      d("index_cache", "parses_total", "Shard index parses."),
		idxParseErrors: d("index_cache", "parse_errors_total", "Shard index parses that failed."),
		idxBudget:      d("index_cache", "budget_bytes", "Most memory the index cache may hold."),
		idxUsed:        d("index_cache", "used_bytes", "Memory the index cache holds."),
		ptEnabled:      d("fuse", "passthrough_enabled", "1 while the kernel serves reads and writes of open files itself (FUSE passthrough), 0 otherwise."),
		ptOpens:        d("fuse", "opens_total", "Opens of data files by how their I/O is served (mode=passthrough|daemon).", "mode"),
		ptRefused:      d("fuse", "passthrough_refused_total", "Backing files the kernel refused for passthrough."),
		ofLimit:        d("fuse", "nofile_limit", "The daemon's RLIMIT_NOFILE when it mounted."),
		ofReserve:      d("fuse", "open_files_reserve", "Descriptors of the daemon's no user's opens can take."),
		ofBudget:       d("fuse", "open_files_uid_budget", "Most of the daemon's descriptors one uid's opens may hold (--max-open-per-user)."),
		ofOpen:         d("fuse", "open_files", "The daemon's descriptors held by one uid's open files, directories and control sessions (at most 32 uids, the rest as uid=\"other\").", "uid"),
		ofRefused:      d("fuse", "open_files_refused_total", "Opens of one uid refused with EMFILE (its budget held) or ENFILE (every user's together).", "uid"),
	}
}

func (c *stateCollector) set(f func(*sources)) {
	c.mu.Lock()
	f(&c.src)
	c.mu.Unlock()
}

func (c *stateCollector) Describe(ch chan<- *prometheus.Desc) {
	for _, d := range []*prometheus.Desc{
		c.poolBudget, c.poolAllocated, c.poolLeased, c.poolFree, c.poolSlabs, c.poolLeases,
		c.uidLeased, c.uidSessions, c.poolShare, c.poolFreed, c.uidAllocated, c.uidRefused, c.uidFreed,
		c.idxHits, c.idxMisses, c.idxEvictions, c.idxParses, c.idxParseErrors, c.idxBudget, c.idxUsed,
		c.ptEnabled, c.ptOpens, c.ptRefused,
		c.ofLimit, c.ofReserve, c.ofBudget, c.ofOpen, c.ofRefused,
	} {
		ch <- d
	}
}

func (c *stateCollector) Collect(ch chan<- prometheus.Metric) {
	c.mu.Lock()
	src := c.src
	c.mu.Unlock()
	gauge := func(d *prometheus.Desc, v float64, labels ...string) {
		ch <- prometheus.MustNewConstMetric(d, prometheus.GaugeValue, v, labels...)
	}
	counter := func(d *prometheus.Desc, v uint64, labels ...string) {
		ch <- prometheus.MustNewConstMetric(d, prometheus.CounterValue, float64(v), labels...)
	}
	if src.pool != nil {
		ps := src.pool()
		for _, dv := range ps.Devices {
			l := deviceLabel(ps.Backend, dv.Device)
			gauge(c.poolBudget, float64(dv.BudgetBytes), l)
			gauge(c.poolAllocated, float64(dv.AllocatedBytes), l)
			gauge(c.poolLeased, float64(dv.LeasedBytes), l)
			gauge(c.poolFree, float64(max(dv.BudgetBytes-dv.LeasedBytes, 0)), l)
			gauge(c.poolSlabs, float64(dv.Slabs), l)
			gauge(c.poolLeases, float64(dv.Leases), l)
			gauge(c.poolShare, float64(dv.UIDShareBytes), l)
			counter(c.poolFreed, dv.FreedSlabs, l)
		}
		for _, u := range boundUIDs(ps.UIDs) {
			gauge(c.uidLeased, float64(u.stats.LeasedBytes), u.label)
			gauge(c.uidSessions, float64(u.stats.Sessions), u.label)
			gauge(c.uidAllocated, float64(u.stats.AllocatedBytes), u.label)
			counter(c.uidRefused, u.stats.Refused, u.label)
			counter(c.uidFreed, u.stats.FreedSlabs, u.label)
		}
	}
	if src.index != nil {
		is := src.index()
		counter(c.idxHits, is.Hits)
		counter(c.idxMisses, is.Misses)
		counter(c.idxEvictions, is.Evictions)
		counter(c.idxParses, is.Parses)
		counter(c.idxParseErrors, is.ParseErrors)
		gauge(c.idxBudget, float64(is.BudgetBytes))
		gauge(c.idxUsed, float64(is.UsedBytes))
	}
	if src.passthrough != nil {
		pt := src.passthrough()
		on := 0.0
		if pt.Enabled {
			on = 1
		}
		gauge(c.ptEnabled, on)
		counter(c.ptOpens, pt.Passthrough, "passthrough")
		counter(c.ptOpens, pt.Daemon, "daemon")
		counter(c.ptRefused, pt.Refused)
	}
	if src.openFiles != nil {
		of := src.openFiles()
		gauge(c.ofLimit, float64(of.Limit))
		gauge(c.ofReserve, float64(of.Reserve))
		gauge(c.ofBudget, float64(of.PerUID))
		for _, u := range boundOpenUIDs(of.UIDs) {
			gauge(c.ofOpen, float64(u.stats.Open), u.label)
			counter(c.ofRefused, u.stats.Refused, u.label)
		}
	}
}

// labelled is one uid's figures and the label its metrics carry: the uid,
// or "other" for the sum of the uids past MaxUIDLabels.
type labelled[T any] struct {
	stats T
	label string
}

// boundByUID keeps the MaxUIDLabels entries that weigh the most (ties: the
// lower uid first) and sums the rest into one "other" entry with add, so a
// node with many users keeps a bounded number of series.
func boundByUID[T any](items []T, uid func(T) uint32, weight func(T) int64, add func(sum *T, x T)) []labelled[T] {
	sorted := append([]T(nil), items...)
	sort.Slice(sorted, func(i, j int) bool {
		if wi, wj := weight(sorted[i]), weight(sorted[j]); wi != wj {
			return wi > wj
		}
		return uid(sorted[i]) < uid(sorted[j])
	})
	var out []labelled[T]
	var rest T
	for i, x := range sorted {
		if i < MaxUIDLabels {
			out = append(out, labelled[T]{x, strconv.FormatUint(uint64(uid(x)), 10)})
			continue
		}
		add(&rest, x)
	}
	if len(sorted) > MaxUIDLabels {
		out = append(out, labelled[T]{rest, other})
	}
	return out
}

// boundOpenUIDs keeps the uids holding the most descriptors.
func boundOpenUIDs(uids []fs.UIDOpenStats) []labelled[fs.UIDOpenStats] {
	return boundByUID(uids, func(u fs.UIDOpenStats) uint32 { return u.UID }, func(u fs.UIDOpenStats) int64 { return u.Open },
		func(sum *fs.UIDOpenStats, u fs.UIDOpenStats) {
			sum.Open += u.Open
			sum.Refused += u.Refused
		})
}

// boundUIDs keeps the uids holding the most leased bytes.
func boundUIDs(uids []gpubuf.UIDStats) []labelled[gpubuf.UIDStats] {
	return boundByUID(uids, func(u gpubuf.UIDStats) uint32 { return u.UID }, func(u gpubuf.UIDStats) int64 { return u.LeasedBytes },
		func(sum *gpubuf.UIDStats, u gpubuf.UIDStats) {
			sum.Sessions += u.Sessions
			sum.LeasedBytes += u.LeasedBytes
			sum.AllocatedBytes += u.AllocatedBytes
			sum.Refused += u.Refused
			sum.FreedSlabs += u.FreedSlabs
		})
}
