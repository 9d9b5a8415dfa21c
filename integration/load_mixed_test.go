package integration

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"flag"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"sort"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"
)

// soak runs the load test longer than CI does: go test ./integration
// -run TestLoadMixed -soak 30m (GDSFS_SOAK=30m works too).
var soak = flag.Duration("soak", 0, "run TestLoadMixed for this long instead of the CI duration")

const (
	loadClients     = 64
	loadCIDuration  = 75 * time.Second
	loadRSSBoundMiB = 1024
	loadFDBound     = 2048
)

func loadDuration(t *testing.T) time.Duration {
	if *soak > 0 {
		return *soak
	}
	if v := os.Getenv("GDSFS_SOAK"); v != "" {
		d, err := time.ParseDuration(v)
		if err != nil {
			t.Fatalf("GDSFS_SOAK=%q: %v", v, err)
		}
		return d
	}
	if testing.Short() {
		return 10 * time.Second
	}
	return loadCIDuration
}

// loadChild starts one client process in mode, running until until.
func loadChild(t testing.TB, mode, mnt string, id int, until time.Time) (*exec.Cmd, *bytes.Buffer) {
	t.Helper()
	cmd := child{family: "LOAD", mode: mode, env: map[string]string{
		"MNT": mnt, "ID": strconv.Itoa(id), "UNTIL": strconv.FormatInt(until.UnixNano(), 10)}}.cmd(t)
	var out bytes.Buffer
	cmd.Stdout, cmd.Stderr = &out, &out
	if err := cmd.Start(); err != nil {
		t.Fatalf("start client %d: %v", id, err)
	}
	return cmd, &out
}

// parseLoadResult finds the result line in a client's output.
func parseLoadResult(out string) (loadResult, bool) {
	sc := bufio.NewScanner(strings.NewReader(out))
	for sc.Scan() {
		if l, ok := strings.CutPrefix(sc.Text(), resultPrefix); ok {
			var r loadResult
			if json.Unmarshal([]byte(l), &r) == nil {
				return r, true
			}
		}
	}
	return loadResult{}, false
}

// TestLoadMixed: 64 client processes do mixed work through one daemon for
// a bounded time (75s in CI; -soak for longer): reads through the mount,
// control-path reads and writes, xattr/index lookups and reads by name,
// creates/renames/unlinks. Zero errors, every byte verified; afterwards
// the pool is idle, descriptors and goroutines are back to their idle
// count and resident memory stayed bounded.
func TestLoadMixed(t *testing.T) {
	requireRoot(t)
	runLoadMixed(t, loadDuration(t), true)
}

// TestLoadMixedNoPassthrough is the same load with the daemon serving
// every read and write itself (--no-passthrough: what kernels older than
// 6.9 and non-root mounts get), for a shorter time.
func TestLoadMixedNoPassthrough(t *testing.T) {
	requireRoot(t)
	dur := loadDuration(t) / 3
	runLoadMixed(t, dur, false)
}

func runLoadMixed(t *testing.T, dur time.Duration, passthrough bool) {
	dir := t.TempDir()
	backing, mnt := filepath.Join(dir, "backing"), filepath.Join(dir, "mnt")
	for _, d := range []string{backing, mnt} {
		if err := os.Mkdir(d, 0o755); err != nil {
			t.Fatal(err)
		}
	}
	writeLoadDataset(t, backing)
	args := []string{"--engine", "host", "--host-pool", "512MiB", "--slab-size", "16MiB"}
	ptState := "on"
	if !passthrough {
		args = append(args, "--no-passthrough")
		ptState = "off"
	}
	d := startBinDaemon(t, backing, mnt, args...)

	// Warm-up: one short client touches every kind of operation, so the
	// idle figures include what the daemon keeps after first use (index
	// cache, go-fuse readers, slabs it keeps allocated).
	cmd, out := loadChild(t, "mixed", mnt, 999, time.Now().Add(2*time.Second))
	if err := cmd.Wait(); err != nil {
		t.Fatalf("warm-up client: %v\n%s", err, out)
	}
	base, err := d.waitIdle(idleFigures{fds: 1 << 20, goroutines: 1 << 20})
	if err != nil {
		t.Fatalf("daemon not idle after the warm-up: %v", err)
	}

	start := time.Now()
	until := start.Add(dur)
	var peak struct {
		sync.Mutex
		rss, goroutines, fds, poolBytes float64
	}
	ctx, stopSampling := context.WithCancel(context.Background())
	var sampler sync.WaitGroup
	sampler.Add(1)
	go func() {
		defer sampler.Done()
		tick := time.NewTicker(time.Second)
		defer tick.Stop()
		for {
			select {
			case <-ctx.Done():
				return
			case <-tick.C:
			}
			s, err := d.scrape()
			if err != nil {
				continue // counted below by the final checks
			}
			rss, _ := s.Get("process_resident_memory_bytes")
			g, _ := s.Get("go_goroutines")
			fds, _ := s.Get("process_open_fds")
			peak.Lock()
			peak.rss = max(peak.rss, rss)
			peak.goroutines = max(peak.goroutines, g)
			peak.fds = max(peak.fds, fds)
			peak.poolBytes = max(peak.poolBytes, s.Sum("gdsfs_pool_in_use_bytes"))
			peak.Unlock()
		}
	}()

	cmds := make([]*exec.Cmd, loadClients)
	outs := make([]*bytes.Buffer, loadClients)
	for i := range cmds {
		cmds[i], outs[i] = loadChild(t, "mixed", mnt, i, until)
	}
	results := make([]loadResult, loadClients)
	var failed []string
	for i, cmd := range cmds {
		done := make(chan error, 1)
		go func() { done <- cmd.Wait() }()
		var err error
		select {
		case err = <-done:
		case <-time.After(time.Until(until) + time.Minute):
			cmd.Process.Kill()
			err = fmt.Errorf("still running a minute past the deadline (hung): %v", <-done)
		}
		r, ok := parseLoadResult(outs[i].String())
		if err != nil || !ok {
			failed = append(failed, fmt.Sprintf("client %d: %v\n%s", i, err, tail(outs[i].Bytes(), 2048)))
		}
		results[i] = r
	}
	elapsed := time.Since(start)
	stopSampling()
	sampler.Wait()
	for _, f := range failed {
		t.Error(f)
	}

	ops := map[string]int{}
	var totalOps, errs, eagain int
	var verified int64
	for _, r := range results {
		for k, v := range r.Ops {
			ops[k] += v
			totalOps += v
		}
		verified += r.Bytes
		eagain += r.Eagain
		errs += r.ErrorCount
		for _, e := range r.Errors {
			t.Errorf("client %d: %s", r.ID, e)
		}
	}
	if errs != 0 {
		t.Errorf("%d operations failed (first ones above), want 0", errs)
	}
	for _, k := range []string{"mount-read", "control-read", "xattr-index", "create-rename-unlink", "control-write"} {
		if ops[k] == 0 {
			t.Errorf("no %s operation ran", k)
		}
	}

	after, err := d.waitIdle(base)
	if err != nil {
		t.Error(err)
	}
	// gdsfs status shows the same figures as the metrics.
	status, code := runGdsfs(t, "status", "--metrics", d.metricsURL, mnt)
	for _, want := range []string{"sessions: 1 open", "pool host: 0 B leased", "passthrough: " + ptState, "fuse:", "index:", "bytes:    host read"} {
		if code != 0 || !strings.Contains(status, want) {
			t.Errorf("gdsfs status --metrics after the load (exit %d) lacks %q:\n%s", code, want, status)
		}
	}
	peak.Lock()
	defer peak.Unlock()
	// Every client holds a handful of files open at a time; descriptors
	// beyond that are releases the kernel has not delivered yet, and
	// they must not pile up (they did with the kernel's default
	// max_background of 12, until EMFILE).
	if peak.fds > loadFDBound {
		t.Errorf("daemon descriptors peaked at %.0f, bound %d: releases pile up", peak.fds, loadFDBound)
	}
	if peak.rss > loadRSSBoundMiB<<20 {
		t.Errorf("daemon resident memory peaked at %.0f MiB, bound %d MiB", peak.rss/(1<<20), loadRSSBoundMiB)
	}
	var eintr, controlReqs, fuseOps float64
	if s, err := d.scrape(); err == nil {
		// EINTR is not a failure: Go clients' threads get SIGURG (the
		// runtime's preemption signal) during an ioctl, the kernel sends
		// FUSE_INTERRUPT, the daemon abandons the request and the client
		// retries it. Everything else counts.
		eintr = s.Sum("gdsfs_control_errors_total", "errno", "EINTR")
		if e := s.Sum("gdsfs_control_errors_total") - eintr; e != 0 {
			var series []string
			for k, v := range s {
				if strings.HasPrefix(k, "gdsfs_control_errors_total{") {
					series = append(series, fmt.Sprintf("%s %v", k, v))
				}
			}
			t.Errorf("daemon counted %v control-path errors besides EINTR, want 0: %s", e, strings.Join(series, ", "))
		}
		controlReqs = s.Sum("gdsfs_control_requests_total")
		for _, op := range []string{"Lookup", "Create", "Rename", "Unlink", "Ioctl", "GetXAttr", "Fsync"} {
			if v, _ := s.Get("gdsfs_fuse_ops_total", "op", op); v == 0 {
				t.Errorf("gdsfs_fuse_ops_total{op=%q} = 0 after the load", op)
			}
		}
		fuseOps = s.Sum("gdsfs_fuse_ops_total")
	}
	names := make([]string, 0, len(ops))
	for k := range ops {
		names = append(names, k)
	}
	sort.Strings(names)
	var opList []string
	for _, k := range names {
		opList = append(opList, fmt.Sprintf("%s %d", k, ops[k]))
	}
	t.Logf("load (passthrough %s): %d clients for %s: %d operations (%.0f/s; %s), %d errors, %.1f MiB verified, %d EAGAIN retries",
		ptState, loadClients, elapsed.Round(time.Second), totalOps, float64(totalOps)/elapsed.Seconds(), strings.Join(opList, ", "),
		errs, float64(verified)/(1<<20), eagain)
	t.Logf("daemon: %.0f FUSE operations served by the daemon, %.0f control-path requests, %.0f of them interrupted by the client (EINTR, retried)", fuseOps, controlReqs, eintr)
	t.Logf("daemon: idle before %d fds (+%d slab, %d pipe), %d goroutines, RSS %.0f MiB; peak %.0f fds, %.0f goroutines, RSS %.0f MiB, pool %.0f MiB leased; idle after %d fds (+%d slab, %d pipe), %d goroutines, RSS %.0f MiB, pool %.0f B leased, %.0f sessions",
		base.fds, base.slabFDs, base.pipeFDs, base.goroutines, base.rssBytes/(1<<20), peak.fds, peak.goroutines, peak.rss/(1<<20), peak.poolBytes/(1<<20),
		after.fds, after.slabFDs, after.pipeFDs, after.goroutines, after.rssBytes/(1<<20), after.poolBytes, after.sessions)
}
