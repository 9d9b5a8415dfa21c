package status

import (
	"bytes"
	"strings"
	"testing"
	"time"

	"github.com/gdsfs/gdsfs/ctlserver"
	"github.com/gdsfs/gdsfs/metrics"
)

func TestMetricsURL(t *testing.T) {
	for in, want := range map[string]string{
		"127.0.0.1:9477":      "http://127.0.0.1:9477/metrics",
		"http://h:1/":         "http://h:1/metrics",
		"https://h:1/metrics": "https://h:1/metrics",
		"[::1]:9477":          "http://[::1]:9477/metrics",
		"http://h:1/prefix":   "http://h:1/prefix/metrics",
	} {
		if got := MetricsURL(in); got != want {
			t.Errorf("MetricsURL(%q) = %q, want %q", in, got, want)
		}
	}
}

// TestPrintScrape: the metrics-only lines (passthrough, FUSE operations
// with the three most frequent and a rate, bytes per engine) come from the
// scrape; without one nothing is printed.
func TestPrintScrape(t *testing.T) {
	text := `gdsfs_fuse_passthrough_enabled 1
gdsfs_fuse_opens_total{mode="passthrough"} 5
gdsfs_fuse_opens_total{mode="daemon"} 2
gdsfs_fuse_passthrough_refused_total 1
gdsfs_fuse_ops_total{op="Lookup"} 30
gdsfs_fuse_ops_total{op="GetAttr"} 20
gdsfs_fuse_ops_total{op="Read"} 20
gdsfs_fuse_ops_total{op="Open"} 10
gdsfs_fuse_errors_total{op="Lookup",errno="ENOENT"} 4
gdsfs_bytes_total{engine="host",direction="read"} 4096
gdsfs_bytes_total{engine="posix",direction="write"} 2048
`
	s, err := metrics.ParseText(strings.NewReader(text))
	if err != nil {
		t.Fatal(err)
	}
	now := time.Now()
	prev := &View{At: now, Scrape: metrics.Snapshot{`gdsfs_fuse_ops_total{op="Lookup"}`: 40}}
	cur := &View{At: now.Add(2 * time.Second), Scrape: s, Counters: ctlserver.CounterStats{}}
	var out bytes.Buffer
	PrintScrape(&out, prev, cur)
	for _, want := range []string{
		"passthrough: on (5 opens passthrough, 2 served by the daemon, 1 refused by the kernel)",
		"fuse:     80 ops served by the daemon, 4 answered with an errno; 20 ops/s (Lookup 30, GetAttr 20, Read 20)",
		"bytes:    posix write 2.0 KiB, host read 4.0 KiB",
	} {
		if !strings.Contains(out.String(), want) {
			t.Errorf("lacks %q:\n%s", want, out.String())
		}
	}
	out.Reset()
	PrintScrape(&out, prev, &View{At: now})
	PrintRates(&out, nil, cur)
	if out.Len() != 0 {
		t.Errorf("printed without a scrape or a previous view:\n%s", out.String())
	}
}
