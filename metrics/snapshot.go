package metrics

import (
	"fmt"
	"io"
	"math"
	"sort"
	"strings"

	dto "github.com/prometheus/client_model/go"
	"github.com/prometheus/common/expfmt"
	"github.com/prometheus/common/model"
)

// Snapshot is every sample of one scrape, keyed by series:
// `name{label="value",...}` with labels in name order, or the bare name
// for a series without labels. Histograms contribute their _count and
// _sum series.
type Snapshot map[string]float64

// Series returns the key of the series name{labels}; labels alternate
// names and values ("op", "Read").
func Series(name string, labels ...string) string {
	if len(labels) == 0 {
		return name
	}
	type kv struct{ k, v string }
	var kvs []kv
	for i := 0; i+1 < len(labels); i += 2 {
		kvs = append(kvs, kv{labels[i], labels[i+1]})
	}
	sort.Slice(kvs, func(i, j int) bool { return kvs[i].k < kvs[j].k })
	var b strings.Builder
	b.WriteString(name)
	b.WriteByte('{')
	for i, p := range kvs {
		if i > 0 {
			b.WriteByte(',')
		}
		fmt.Fprintf(&b, "%s=%q", p.k, p.v)
	}
	b.WriteByte('}')
	return b.String()
}

// Get returns the value of series name{labels} and whether it exists.
func (s Snapshot) Get(name string, labels ...string) (float64, bool) {
	v, ok := s[Series(name, labels...)]
	return v, ok
}

// Sum adds every series of the family name whose labels include the
// given ones (all series of the family when none are given).
func (s Snapshot) Sum(name string, labels ...string) float64 {
	var want []string
	for i := 0; i+1 < len(labels); i += 2 {
		want = append(want, fmt.Sprintf("%s=%q", labels[i], labels[i+1]))
	}
	var sum float64
	for k, v := range s {
		base, rest, _ := strings.Cut(k, "{")
		if base != name {
			continue
		}
		ok := true
		for _, w := range want {
			if !containsLabel(rest, w) {
				ok = false
				break
			}
		}
		if ok {
			sum += v
		}
	}
	return sum
}

func containsLabel(labels, kv string) bool {
	labels = strings.TrimSuffix(labels, "}")
	for _, l := range strings.Split(labels, ",") {
		if l == kv {
			return true
		}
	}
	return false
}

// ParseText reads a scrape in the Prometheus text format (what GET
// /metrics returns), for `gdsfs status` and tests.
func ParseText(r io.Reader) (Snapshot, error) {
	p := expfmt.NewTextParser(model.UTF8Validation)
	mfs, err := p.TextToMetricFamilies(r)
	if err != nil {
		return nil, fmt.Errorf("metrics: parse scrape: %w", err)
	}
	list := make([]*dto.MetricFamily, 0, len(mfs))
	for _, mf := range mfs {
		list = append(list, mf)
	}
	return snapshotOf(list), nil
}

func snapshotOf(mfs []*dto.MetricFamily) Snapshot {
	s := Snapshot{}
	for _, mf := range mfs {
		name := mf.GetName()
		for _, m := range mf.GetMetric() {
			var labels []string
			for _, lp := range m.GetLabel() {
				labels = append(labels, lp.GetName(), lp.GetValue())
			}
			switch {
			case m.Counter != nil:
				s[Series(name, labels...)] = m.Counter.GetValue()
			case m.Gauge != nil:
				s[Series(name, labels...)] = m.Gauge.GetValue()
			case m.Untyped != nil:
				s[Series(name, labels...)] = m.Untyped.GetValue()
			case m.Histogram != nil:
				s[Series(name+"_count", labels...)] = float64(m.Histogram.GetSampleCount())
				s[Series(name+"_sum", labels...)] = m.Histogram.GetSampleSum()
			case m.Summary != nil:
				s[Series(name+"_count", labels...)] = float64(m.Summary.GetSampleCount())
				s[Series(name+"_sum", labels...)] = m.Summary.GetSampleSum()
			}
		}
	}
	return s
}

// Quantile estimates the q-quantile (0..1) of the histogram family name
// with the given labels from a registry gather, by linear interpolation
// within buckets. It returns NaN when the histogram is empty or missing.
func (m *Metrics) Quantile(name string, q float64, labels ...string) float64 {
	mfs, err := m.reg.Gather()
	if err != nil {
		return math.NaN()
	}
	key := Series("", labels...)
	for _, mf := range mfs {
		if mf.GetName() != name {
			continue
		}
		for _, mt := range mf.GetMetric() {
			var ls []string
			for _, lp := range mt.GetLabel() {
				ls = append(ls, lp.GetName(), lp.GetValue())
			}
			if Series("", ls...) == key && mt.Histogram != nil {
				return histogramQuantile(mt.Histogram, q)
			}
		}
	}
	return math.NaN()
}

func histogramQuantile(h *dto.Histogram, q float64) float64 {
	total := float64(h.GetSampleCount())
	if total == 0 {
		return math.NaN()
	}
	rank := q * total
	prevBound, prevCount := 0.0, 0.0
	for _, b := range h.GetBucket() {
		c := float64(b.GetCumulativeCount())
		if c >= rank {
			if c == prevCount {
				return b.GetUpperBound()
			}
			return prevBound + (b.GetUpperBound()-prevBound)*(rank-prevCount)/(c-prevCount)
		}
		prevBound, prevCount = b.GetUpperBound(), c
	}
	return prevBound // beyond the last finite bucket
}
