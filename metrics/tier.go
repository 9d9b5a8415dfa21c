package metrics

import (
	"sync"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/gdsfs/gdsfs/tier"
)

// SetTier makes every scrape read the memory tier through f (nil: no tier
// metrics). The gdsfs_tier_* families are registered on the first call.
func (m *Metrics) SetTier(f func() tier.Stats) {
	if m == nil {
		return
	}
	m.tierOnce.Do(func() {
		m.tier = newTierCollector()
		m.reg.MustRegister(m.tier)
	})
	m.tier.mu.Lock()
	m.tier.src = f
	m.tier.mu.Unlock()
}

type tierCollector struct {
	mu  sync.Mutex
	src func() tier.Stats // guarded by mu

	budget, used, cached, files     *prometheus.Desc
	hits, misses, hitBytes, filled  *prometheus.Desc
	evictions, invalidations, refus *prometheus.Desc
	devUsed, devHits                *prometheus.Desc
}

func newTierCollector() *tierCollector {
	d := func(name, help string) *prometheus.Desc {
		return prometheus.NewDesc(prometheus.BuildFQName(namespace, "tier", name), help, nil, nil)
	}
	return &tierCollector{
		budget:        d("budget_bytes", "Most memory the tier may hold (--tier-budget)."),
		used:          d("used_bytes", "Memory the tier holds now (extents allocated)."),
		cached:        d("cached_bytes", "File bytes held in the tier."),
		files:         d("files", "Files with extents in the tier."),
		hits:          d("hits_total", "READs served from the tier."),
		misses:        d("misses_total", "READs the tier could not serve (not pinned, partly pinned, or changed)."),
		hitBytes:      d("hit_bytes_total", "Bytes copied from the tier into slabs."),
		filled:        d("filled_bytes_total", "Bytes read into the tier by pins."),
		evictions:     d("evictions_total", "Files evicted from the tier to make room for pins."),
		invalidations: d("invalidations_total", "Files dropped from the tier because they changed."),
		refus:         d("refused_total", "Pins refused for lack of room (budget or per-uid share)."),
		devUsed:       d("device_used_bytes", "GPU memory holding copies of pinned files (--gpu-cache), over every GPU."),
		devHits:       d("device_hits_total", "READs served device to device from a copy on the slab's GPU."),
	}
}

func (c *tierCollector) Describe(ch chan<- *prometheus.Desc) {
	for _, d := range []*prometheus.Desc{c.budget, c.used, c.cached, c.files, c.hits, c.misses, c.hitBytes, c.filled,
		c.evictions, c.invalidations, c.refus, c.devUsed, c.devHits} {
		ch <- d
	}
}

func (c *tierCollector) Collect(ch chan<- prometheus.Metric) {
	c.mu.Lock()
	src := c.src
	c.mu.Unlock()
	if src == nil {
		return
	}
	s := src()
	gauge := func(d *prometheus.Desc, v float64) {
		ch <- prometheus.MustNewConstMetric(d, prometheus.GaugeValue, v)
	}
	counter := func(d *prometheus.Desc, v uint64) {
		ch <- prometheus.MustNewConstMetric(d, prometheus.CounterValue, float64(v))
	}
	gauge(c.budget, float64(s.BudgetBytes))
	gauge(c.used, float64(s.UsedBytes))
	gauge(c.cached, float64(s.CachedBytes))
	gauge(c.files, float64(s.Files))
	counter(c.hits, s.Hits)
	counter(c.misses, s.Misses)
	counter(c.hitBytes, s.HitBytes)
	counter(c.filled, s.FilledBytes)
	counter(c.evictions, s.Evictions)
	counter(c.invalidations, s.Invalidations)
	counter(c.refus, s.Refused)
	var dev int64
	for _, d := range s.Devices {
		dev += d.Bytes
	}
	gauge(c.devUsed, float64(dev))
	counter(c.devHits, s.DeviceHits)
}
