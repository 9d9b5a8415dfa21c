package integration

import (
	"bufio"
	"bytes"
	"encoding/json"
	"fmt"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/gdsfs/gdsfs/metrics"
)

// binDaemon is the gdsfs binary serving a mount in the foreground, with
// metrics on a free loopback port and its log in a file (kept in the test
// log on failure). The reliability tests drive it from outside, as an
// operator's node would.
type binDaemon struct {
	t            testing.TB
	cmd          *exec.Cmd
	mnt, backing string
	logPath      string
	metricsURL   string
	exited       chan struct{} // closed when the process has exited
	waitErr      error         // valid once exited is closed
}

// startBinDaemon runs `gdsfs mount --source backing ... mnt` and waits until
// the mount is up and metrics answer. The daemon is stopped (SIGTERM, then
// SIGKILL) and the mount cleaned when the test ends.
func startBinDaemon(t testing.TB, backing, mnt string, extra ...string) *binDaemon {
	t.Helper()
	requireRoot(t)
	d := &binDaemon{t: t, mnt: mnt, backing: backing, exited: make(chan struct{})}
	d.logPath = filepath.Join(t.TempDir(), "daemon.log")
	args := append([]string{"mount", "--source", backing, "--metrics-addr", "127.0.0.1:0",
		"--log-file", d.logPath}, extra...)
	args = append(args, mnt)
	d.cmd = exec.Command(gdsfsBin(t), args...)
	var out bytes.Buffer
	d.cmd.Stdout, d.cmd.Stderr = &out, &out
	if err := d.cmd.Start(); err != nil {
		t.Fatal(err)
	}
	go func() {
		d.waitErr = d.cmd.Wait()
		close(d.exited)
	}()
	cleanupMount(t, mnt)
	t.Cleanup(func() {
		d.stop()
		if t.Failed() {
			log, _ := os.ReadFile(d.logPath)
			t.Logf("daemon output:\n%s\ndaemon log (last 8 KiB):\n%s", out.String(), tail(log, 8<<10))
		}
	})
	deadline := time.Now().Add(20 * time.Second)
	for d.metricsURL == "" || mountType(t, mnt) != "fuse.gdsfs" {
		select {
		case <-d.exited:
			t.Fatalf("daemon exited before the mount was ready: %v\n%s", d.waitErr, out.String())
		default:
		}
		if time.Now().After(deadline) {
			t.Fatalf("mount not ready after 20s (metrics %q)", d.metricsURL)
		}
		if d.metricsURL == "" {
			d.metricsURL = metricsAddrFromLog(d.logPath)
		}
		time.Sleep(20 * time.Millisecond) // polling the mount table and the log: no event to wait on
	}
	return d
}

// metricsAddrFromLog finds the address the daemon logged for /metrics.
func metricsAddrFromLog(p string) string {
	f, err := os.Open(p)
	if err != nil {
		return ""
	}
	defer f.Close()
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		var l struct {
			Message string `json:"message"`
			Addr    string `json:"addr"`
		}
		if json.Unmarshal(sc.Bytes(), &l) == nil && strings.HasPrefix(l.Message, "metrics served") && l.Addr != "" {
			return "http://" + l.Addr + "/metrics"
		}
	}
	return ""
}

func tail(b []byte, n int) []byte {
	if len(b) > n {
		return b[len(b)-n:]
	}
	return b
}

// pid is the daemon's process id.
func (d *binDaemon) pid() int { return d.cmd.Process.Pid }

// running reports whether the daemon process is still alive.
func (d *binDaemon) running() bool {
	select {
	case <-d.exited:
		return false
	default:
		return true
	}
}

// stop ends the daemon: SIGTERM (it unmounts), SIGKILL after 15s.
func (d *binDaemon) stop() {
	if !d.running() {
		return
	}
	d.cmd.Process.Signal(syscall.SIGTERM)
	select {
	case <-d.exited:
	case <-time.After(15 * time.Second):
		d.t.Errorf("daemon did not exit 15s after SIGTERM; killing it")
		d.cmd.Process.Kill()
		<-d.exited
	}
}

// scrape reads the daemon's metrics.
func (d *binDaemon) scrape() (metrics.Snapshot, error) {
	// No keep-alive: scrapes must leave no connection (and goroutine)
	// behind in the daemon, or the idle counts would drift.
	client := &http.Client{Timeout: 5 * time.Second, Transport: &http.Transport{DisableKeepAlives: true}}
	resp, err := client.Get(d.metricsURL)
	if err != nil {
		return nil, err
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		return nil, fmt.Errorf("GET %s: %s", d.metricsURL, resp.Status)
	}
	return metrics.ParseText(resp.Body)
}

// mustScrape is scrape or fail the test.
func (d *binDaemon) mustScrape() metrics.Snapshot {
	d.t.Helper()
	s, err := d.scrape()
	if err != nil {
		d.t.Fatalf("scrape metrics: %v", err)
	}
	return s
}

// fdKinds counts the daemon's descriptors: slab files, pipes, others.
func (d *binDaemon) fdKinds() (other, slabs, pipes int) {
	dir := fmt.Sprintf("/proc/%d/fd", d.pid())
	ents, err := os.ReadDir(dir)
	if err != nil {
		d.t.Fatalf("daemon descriptors: %v", err)
	}
	for _, e := range ents {
		target, _ := os.Readlink(filepath.Join(dir, e.Name()))
		switch {
		case strings.HasPrefix(target, "/dev/shm/gdsfs-") && strings.HasPrefix(filepath.Base(target), "slab-"):
			slabs++ // not the directory's lock file, held open for the daemon's life
		case strings.HasPrefix(target, "pipe:"):
			pipes++
		default:
			other++
		}
	}
	return other, slabs, pipes
}

// fdList describes the daemon's descriptors, for failure messages.
func (d *binDaemon) fdList() string {
	dir := fmt.Sprintf("/proc/%d/fd", d.pid())
	ents, _ := os.ReadDir(dir)
	var l []string
	for _, e := range ents {
		target, _ := os.Readlink(filepath.Join(dir, e.Name()))
		l = append(l, e.Name()+"->"+target)
	}
	return strings.Join(l, " ")
}

// idleFigures are what must come back after load: the daemon's state
// with no client.
type idleFigures struct {
	// fds counts descriptors other than slab files and pipes: backing
	// files, sockets, /dev/fuse. slabFDs are the pool's slab files (one
	// per slab it keeps, bounded by its budget); pipeFDs are go-fuse's
	// splice pipes (a pool as large as the most concurrent daemon-served
	// reads so far).
	fds, slabFDs, pipeFDs int
	goroutines            int
	poolBytes, sessions   float64
	rssBytes, allocBytes  float64
	slabs                 float64
}

// idlePipeSlack bounds the splice pipes go-fuse may keep beyond those at
// idle: its pool grows to the most daemon-served reads in flight at once
// (64 clients and their readahead) and keeps them for reuse.
const idlePipeSlack = 256

func (d *binDaemon) figures() idleFigures {
	d.t.Helper()
	s := d.mustScrape()
	g, _ := s.Get("go_goroutines")
	sess, _ := s.Get("gdsfs_control_sessions")
	rss, _ := s.Get("process_resident_memory_bytes")
	other, slabs, pipes := d.fdKinds()
	return idleFigures{
		fds:        other,
		slabFDs:    slabs,
		pipeFDs:    pipes,
		slabs:      s.Sum("gdsfs_pool_slabs"),
		goroutines: int(g),
		poolBytes:  s.Sum("gdsfs_pool_in_use_bytes"),
		sessions:   sess,
		rssBytes:   rss,
		allocBytes: s.Sum("gdsfs_pool_allocated_bytes"),
	}
}

// waitIdle waits (up to 15s: sessions end when the kernel releases the
// control file after the client process is gone, and go-fuse retires idle
// reader goroutines on its own schedule) until the pool holds nothing, no
// session is open, and descriptors and goroutines are back to base. It
// returns the figures reached.
func (d *binDaemon) waitIdle(base idleFigures) (idleFigures, error) {
	deadline := time.Now().Add(15 * time.Second)
	for {
		f := d.figures()
		if f.poolBytes == 0 && f.sessions == 0 && f.fds <= base.fds && f.goroutines <= base.goroutines &&
			float64(f.slabFDs) == f.slabs && f.pipeFDs <= base.pipeFDs+idlePipeSlack {
			return f, nil
		}
		if time.Now().After(deadline) {
			return f, fmt.Errorf("not idle 15s after the load: pool %v B leased (want 0), %v sessions (want 0), %d fds (idle %d), %d goroutines (idle %d), %d slab fds for %v slabs, %d pipe fds (idle %d + %d); descriptors: %s",
				f.poolBytes, f.sessions, f.fds, base.fds, f.goroutines, base.goroutines, f.slabFDs, f.slabs, f.pipeFDs, base.pipeFDs, idlePipeSlack, d.fdList())
		}
		time.Sleep(100 * time.Millisecond) // polling the daemon: no event to wait on
	}
}

// shmDir is the daemon's host-slab directory (gpubuf's default,
// /dev/shm/gdsfs-<pid>-<random>).
func (d *binDaemon) shmDir() string {
	d.t.Helper()
	dirs, _ := filepath.Glob("/dev/shm/gdsfs-" + strconv.Itoa(d.pid()) + "-*")
	if len(dirs) != 1 {
		d.t.Fatalf("host-slab directories of daemon pid %d: %v, want one", d.pid(), dirs)
	}
	return dirs[0]
}
