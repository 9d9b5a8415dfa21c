package main

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"os"
	"os/signal"
	"path/filepath"
	"sort"
	"strings"
	"syscall"
	"time"

	"github.com/dustin/go-humanize"
	"github.com/mattn/go-isatty"
	"github.com/spf13/cobra"

	"github.com/gdsfs/gdsfs/cache"
	"github.com/gdsfs/gdsfs/ctl"
	"github.com/gdsfs/gdsfs/ctlserver"
	"github.com/gdsfs/gdsfs/metrics"
)

// watchFlags are `gdsfs status --watch`, its interval, and --metrics.
type watchFlags struct {
	on      bool
	every   time.Duration
	metrics string // HOST:PORT or URL of the daemon's --metrics-addr
}

func addWatchFlags(cmd *cobra.Command, w *watchFlags) {
	cmd.Flags().BoolVarP(&w.on, "watch", "w", false, "refresh until interrupted, with rates since the previous refresh")
	cmd.Flags().DurationVar(&w.every, "interval", 2*time.Second, "refresh interval of --watch")
	cmd.Flags().StringVar(&w.metrics, "metrics", "", "also show FUSE, passthrough and per-engine byte figures from the daemon's --metrics-addr (HOST:PORT)")
}

// statusView is one refresh's figures, kept to compute rates.
type statusView struct {
	at       time.Time
	counters ctlserver.CounterStats
	index    *cache.IndexStats
	scrape   metrics.Snapshot // nil without --metrics
}

// runStatusWatch shows the status (once, or every interval with --watch),
// with rates computed from the counters, until SIGINT/SIGTERM (exit 0) or
// until the daemon stops answering (an error).
func runStatusWatch(ctx context.Context, w io.Writer, mp string, wf watchFlags) error {
	if wf.on && wf.every < 100*time.Millisecond {
		return usagef("--interval %s: give at least 100ms, such as 2s", wf.every)
	}
	url := ""
	if wf.metrics != "" {
		url = wf.metrics
		if !strings.Contains(url, "://") {
			url = "http://" + url
		}
		if !strings.HasSuffix(url, "/metrics") {
			url = strings.TrimSuffix(url, "/") + "/metrics"
		}
	}
	if st, err := os.Stat(filepath.Join(mp, ctl.ControlName)); err != nil || !st.Mode().IsRegular() {
		return usagef("%s is not a gdsfs mountpoint (no %s in it); give the directory gdsfs mount was given", mp, ctl.ControlName)
	}
	if ctx == nil {
		ctx = context.Background()
	}
	ctx, stop := signal.NotifyContext(ctx, syscall.SIGINT, syscall.SIGTERM)
	defer stop()
	cl, err := ctl.OpenSession(mp)
	if err != nil {
		return err
	}
	defer cl.Close()
	clear := ""
	if f, ok := w.(*os.File); ok && isatty.IsTerminal(f.Fd()) && wf.on {
		clear = "\x1b[H\x1b[2J" // home, erase screen
	}
	var prev *statusView
	tick := time.NewTicker(max(wf.every, 100*time.Millisecond))
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
		cur := &statusView{at: time.Now(), counters: st.Counters, index: st.Index}
		if url != "" {
			if cur.scrape, err = scrapeMetrics(ctx, url); err != nil {
				return usagef("--metrics %s: %v; give the daemon's --metrics-addr", wf.metrics, err)
			}
		}
		var b bytes.Buffer
		b.WriteString(clear)
		if wf.on {
			fmt.Fprintf(&b, "%s  (every %s, Ctrl-C to stop)\n", cur.at.Format(time.TimeOnly), wf.every)
		}
		if err := printStatus(&b, mp, doc, cl.Hello(), false); err != nil {
			return err
		}
		printRates(&b, prev, cur)
		printScrape(&b, prev, cur)
		if !wf.on {
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

func scrapeMetrics(ctx context.Context, url string) (metrics.Snapshot, error) {
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

// printRates prints read and write rates since the previous view.
func printRates(w io.Writer, prev, cur *statusView) {
	if prev == nil {
		return
	}
	p, c, dt := prev.counters, cur.counters, cur.at.Sub(prev.at).Seconds()
	fmt.Fprintf(w, "rates:    %.0f reads/s %s/s, %.0f writes/s %s/s\n",
		float64(c.Reads-p.Reads)/dt, humanize.IBytes(uint64(float64(c.ReadBytes-p.ReadBytes)/dt)),
		float64(c.Writes-p.Writes)/dt, humanize.IBytes(uint64(float64(c.WriteBytes-p.WriteBytes)/dt)))
	if pi, ci := prev.index, cur.index; pi != nil && ci != nil {
		fmt.Fprintf(w, "index/s:  %.0f hits/s, %.0f misses/s, %.0f evictions/s\n",
			float64(ci.Hits-pi.Hits)/dt, float64(ci.Misses-pi.Misses)/dt, float64(ci.Evictions-pi.Evictions)/dt)
	}
}

// printScrape prints the figures only the metrics have: FUSE operations,
// passthrough, bytes per engine (the index cache is in STATUS itself).
func printScrape(w io.Writer, prev, cur *statusView) {
	s := cur.scrape
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
	if prev != nil && prev.scrape != nil {
		dt := cur.at.Sub(prev.at).Seconds()
		line += fmt.Sprintf("; %.0f ops/s", (ops-prev.scrape.Sum("gdsfs_fuse_ops_total"))/dt)
	}
	fmt.Fprintln(w, line+topOps(s))
	var bytesLine []string
	for _, eng := range []string{"gds", "gds-compat", "posix", "host", "fuse", "other"} {
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
