// Package status is what gdsfs status --watch adds to a mount's STATUS
// document: refreshes, the rates between them, and the figures only the
// daemon's metrics have (FUSE operations, passthrough, bytes per engine).
// The STATUS document itself is printed by the caller (PrintFunc).
package status

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"os"
	"sort"
	"strings"
	"time"

	"github.com/dustin/go-humanize"
	"github.com/mattn/go-isatty"

	"github.com/gdsfs/gdsfs/cache"
	"github.com/gdsfs/gdsfs/ctl"
	"github.com/gdsfs/gdsfs/ctlserver"
	"github.com/gdsfs/gdsfs/internal/engname"
	"github.com/gdsfs/gdsfs/internal/usage"
	"github.com/gdsfs/gdsfs/metrics"
)

// Options is what gdsfs status was asked to show.
type Options struct {
	// Watch refreshes every Every until the context ends; else once.
	Watch bool
	Every time.Duration
	// Metrics is the daemon's --metrics-addr as the user gave it
	// (HOST:PORT or a URL); empty: no metrics figures.
	Metrics string
}

// PrintFunc renders one STATUS document of mountpoint mp (gdsfs status's
// own printing).
type PrintFunc func(w io.Writer, mp string, doc []byte, h ctl.HelloReply) error

// MetricsURL is the /metrics URL of a --metrics value: HOST:PORT or a URL.
func MetricsURL(addr string) string {
	url := addr
	if !strings.Contains(url, "://") {
		url = "http://" + url
	}
	if !strings.HasSuffix(url, "/metrics") {
		url = strings.TrimSuffix(url, "/") + "/metrics"
	}
	return url
}

// View is one refresh's figures, kept to compute rates.
type View struct {
	At       time.Time
	Counters ctlserver.CounterStats
	Index    *cache.IndexStats
	Scrape   metrics.Snapshot // nil without --metrics
}

// Watch shows the status of mp through cl (once, or every o.Every with
// o.Watch), with rates computed from the counters, until ctx ends (nil) or
// the daemon stops answering (an error).
func Watch(ctx context.Context, w io.Writer, cl *ctl.Client, mp string, o Options, show PrintFunc) error {
	url := ""
	if o.Metrics != "" {
		url = MetricsURL(o.Metrics)
	}
	clear := ""
	if f, ok := w.(*os.File); ok && isatty.IsTerminal(f.Fd()) && o.Watch {
		clear = "\x1b[H\x1b[2J" // home, erase screen
	}
	var prev *View
	tick := time.NewTicker(max(o.Every, 100*time.Millisecond))
	defer tick.Stop()
	for {
		doc, err := cl.Status(ctx)
		if ctx.Err() != nil {
			return nil
		}
		if err != nil {
			return fmt.Errorf("status of %s: %w", mp, err)
		}
		var st ctlserver.Stats
		if err := json.Unmarshal(doc, &st); err != nil {
			return fmt.Errorf("status of %s is not the expected JSON: %w", mp, err)
		}
		cur := &View{At: time.Now(), Counters: st.Counters, Index: st.Index}
		if url != "" {
			if cur.Scrape, err = Scrape(ctx, url); err != nil {
				return usage.Errorf("--metrics %s: %v; give the daemon's --metrics-addr", o.Metrics, err)
			}
		}
		var b bytes.Buffer
		b.WriteString(clear)
		if o.Watch {
			fmt.Fprintf(&b, "%s  (every %s, Ctrl-C to stop)\n", cur.At.Format(time.TimeOnly), o.Every)
		}
		if err := show(&b, mp, doc, cl.Hello()); err != nil {
			return err
		}
		PrintRates(&b, prev, cur)
		PrintScrape(&b, prev, cur)
		if !o.Watch {
			_, err := w.Write(b.Bytes())
			return err
		}
		if clear == "" {
			b.WriteString("\n")
		}
		if _, err := w.Write(b.Bytes()); err != nil {
			return err
		}
		prev = cur
		select {
		case <-ctx.Done():
			return nil
		case <-tick.C:
		}
	}
}

// Scrape reads the daemon's metrics at url (its --metrics-addr's
// /metrics).
func Scrape(ctx context.Context, url string) (metrics.Snapshot, error) {
	ctx, cancel := context.WithTimeout(ctx, 5*time.Second)
	defer cancel()
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, url, nil)
	if err != nil {
		return nil, err
	}
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		return nil, err
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		return nil, fmt.Errorf("GET %s: %s", url, resp.Status)
	}
	return metrics.ParseText(resp.Body)
}

// PrintRates prints read and write rates since the previous view (none
// without one).
func PrintRates(w io.Writer, prev, cur *View) {
	if prev == nil {
		return
	}
	p, c, dt := prev.Counters, cur.Counters, cur.At.Sub(prev.At).Seconds()
	fmt.Fprintf(w, "rates:    %.0f reads/s %s/s, %.0f writes/s %s/s\n",
		float64(c.Reads-p.Reads)/dt, humanize.IBytes(uint64(float64(c.ReadBytes-p.ReadBytes)/dt)),
		float64(c.Writes-p.Writes)/dt, humanize.IBytes(uint64(float64(c.WriteBytes-p.WriteBytes)/dt)))
	if pi, ci := prev.Index, cur.Index; pi != nil && ci != nil {
		fmt.Fprintf(w, "index/s:  %.0f hits/s, %.0f misses/s, %.0f evictions/s\n",
			float64(ci.Hits-pi.Hits)/dt, float64(ci.Misses-pi.Misses)/dt, float64(ci.Evictions-pi.Evictions)/dt)
	}
}

// PrintScrape prints the figures only the metrics have: FUSE operations,
// passthrough, bytes per engine (the index cache is in STATUS itself).
func PrintScrape(w io.Writer, prev, cur *View) {
	s := cur.Scrape
	if s == nil {
		return
	}
	on, _ := s.Get("gdsfs_fuse_passthrough_enabled")
	pt, _ := s.Get("gdsfs_fuse_opens_total", "mode", "passthrough")
	dm, _ := s.Get("gdsfs_fuse_opens_total", "mode", "daemon")
	ref, _ := s.Get("gdsfs_fuse_passthrough_refused_total")
	fmt.Fprintf(w, "passthrough: %s (%.0f opens passthrough, %.0f served by the daemon, %.0f refused by the kernel)\n",
		map[bool]string{true: "on", false: "off"}[on == 1], pt, dm, ref)
	ops := s.Sum("gdsfs_fuse_ops_total")
	errs := s.Sum("gdsfs_fuse_errors_total")
	line := fmt.Sprintf("fuse:     %.0f ops served by the daemon, %.0f answered with an errno", ops, errs)
	if prev != nil && prev.Scrape != nil {
		dt := cur.At.Sub(prev.At).Seconds()
		line += fmt.Sprintf("; %.0f ops/s", (ops-prev.Scrape.Sum("gdsfs_fuse_ops_total"))/dt)
	}
	fmt.Fprintln(w, line+topOps(s))
	var bytesLine []string
	for _, eng := range []string{engname.GDS, engname.GDSCompat, engname.Posix, engname.Host, "fuse", "other"} {
		for _, dir := range []string{"read", "write"} {
			if v, _ := s.Get("gdsfs_bytes_total", "engine", eng, "direction", dir); v > 0 {
				bytesLine = append(bytesLine, fmt.Sprintf("%s %s %s", eng, dir, humanize.IBytes(uint64(v))))
			}
		}
	}
	if len(bytesLine) > 0 {
		fmt.Fprintf(w, "bytes:    %s\n", strings.Join(bytesLine, ", "))
	}
}

// topOps names the three most frequent FUSE operations.
func topOps(s metrics.Snapshot) string {
	type op struct {
		name string
		n    float64
	}
	var l []op
	for k, v := range s {
		if rest, ok := strings.CutPrefix(k, `gdsfs_fuse_ops_total{op="`); ok {
			l = append(l, op{strings.TrimSuffix(rest, `"}`), v})
		}
	}
	if len(l) == 0 {
		return ""
	}
	sort.Slice(l, func(i, j int) bool { return l[i].n > l[j].n || l[i].n == l[j].n && l[i].name < l[j].name })
	var parts []string
	for _, o := range l[:min(3, len(l))] {
		parts = append(parts, fmt.Sprintf("%s %.0f", o.name, o.n))
	}
	return " (" + strings.Join(parts, ", ") + ")"
}
