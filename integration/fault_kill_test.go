package integration

import (
	"bytes"
	"errors"
	"os"
	"os/exec"
	"path/filepath"
	"syscall"
	"testing"
	"time"
)

// faultPromptness bounds how long a client may take to see a dead daemon.
const faultPromptness = 5 * time.Second

// TestFaultKillDaemonUnderLoad: kill -9 of the daemon while 16 clients
// work. Every client gets ENOTCONN, ECONNABORTED or EIO within a few
// seconds (none hangs); the next `gdsfs mount` of the same path cleans up
// the dead mount and serves again, byte-exact.
func TestFaultKillDaemonUnderLoad(t *testing.T) {
	requireRoot(t)
	dir := t.TempDir()
	backing, mnt := mountDirs(t, dir)
	writeLoadDataset(t, backing)
	d := startBinDaemon(t, backing, mnt, "--engine", "host", "--host-pool", "256MiB", "--slab-size", "16MiB")
	oldShm := d.shmDir()
	t.Cleanup(func() { os.RemoveAll(oldShm) })

	const clients = 16
	until := time.Now().Add(2 * time.Minute)
	cmds := make([]*exec.Cmd, clients)
	outs := make([]*bytes.Buffer, clients)
	for i := range cmds {
		cmds[i], outs[i] = loadChild(t, "untilfail", mnt, i, until)
	}
	t.Cleanup(func() {
		for _, c := range cmds {
			if c.ProcessState == nil {
				c.Process.Kill()
				c.Wait()
			}
		}
	})
	// Under load: wait until the clients have done real work.
	deadline := time.Now().Add(30 * time.Second)
	for {
		s := d.mustScrape()
		if s.Sum("gdsfs_control_requests_total") >= 500 && s.Sum("gdsfs_fuse_opens_total") >= 100 {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("clients did not get going within 30s: %v control requests", s.Sum("gdsfs_control_requests_total"))
		}
		time.Sleep(50 * time.Millisecond) // polling the daemon's counters
	}

	killed := time.Now()
	if err := d.cmd.Process.Signal(syscall.SIGKILL); err != nil {
		t.Fatal(err)
	}
	var slowest time.Duration
	errnos := map[string]int{}
	for i, c := range cmds {
		done := make(chan error, 1)
		go func() { done <- c.Wait() }()
		select {
		case err := <-done:
			if err != nil {
				t.Errorf("client %d: %v\n%s", i, err, tail(outs[i].Bytes(), 2048))
				continue
			}
		case <-time.After(time.Until(killed.Add(faultPromptness + 5*time.Second))):
			c.Process.Kill()
			t.Errorf("client %d still running %s after the daemon died: hung", i, time.Since(killed).Round(time.Millisecond))
			continue
		}
		r, ok := parseLoadResult(outs[i].String())
		if !ok {
			t.Errorf("client %d: no result\n%s", i, outs[i].String())
			continue
		}
		if r.FailedAt == 0 {
			t.Errorf("client %d ran to its deadline without noticing the dead daemon", i)
			continue
		}
		if r.ErrorCount != 1 || r.FailedAt < killed.UnixNano() {
			t.Errorf("client %d failed before the kill: %v", i, r.Errors)
		}
		lat := time.Duration(r.FailedAt - killed.UnixNano())
		slowest = max(slowest, lat)
		errnos[r.LastErrno]++
		switch r.LastErrno {
		case "ENOTCONN", "ECONNABORTED", "EIO":
		default:
			t.Errorf("client %d saw %s after the kill (%v), want ENOTCONN, ECONNABORTED or EIO", i, r.LastErrno, r.Errors)
		}
	}
	if slowest > faultPromptness {
		t.Errorf("slowest client noticed the dead daemon after %s, want within %s", slowest, faultPromptness)
	}
	// A name the kernel has not cached must be looked up, and fails.
	if _, err := os.Stat(filepath.Join(mnt, "never-looked-up")); !errors.Is(err, syscall.ENOTCONN) {
		t.Errorf("lookup on the dead mount: %v, want ENOTCONN", err)
	}
	t.Logf("kill -9 under load: %d clients saw %v; slowest noticed after %s", clients, errnos, slowest.Round(time.Millisecond))
	ents, err := os.ReadDir(oldShm)
	if err != nil {
		t.Fatalf("the killed daemon's slab directory: %v", err)
	}
	t.Logf("the killed daemon left %d slab files in %s", len(ents), oldShm)

	// Restart on the same path: the stale mount is cleaned up.
	restarted := time.Now()
	d2 := startBinDaemon(t, backing, mnt, "--engine", "host", "--host-pool", "256MiB", "--slab-size", "16MiB")
	t.Logf("restart: mounted again after %s", time.Since(restarted).Round(time.Millisecond))
	// The new daemon reclaims the dead one's shared memory.
	if _, err := os.Stat(oldShm); !errors.Is(err, os.ErrNotExist) {
		t.Errorf("the killed daemon's slab directory %s survived the restart (%v): its memory leaks", oldShm, err)
	}
	for i := 0; i < loadDataFiles; i++ {
		got, err := os.ReadFile(filepath.Join(mnt, loadDataName(i)))
		if err != nil {
			t.Fatal(err)
		}
		if !bytes.Equal(got, genBytes(loadDataSeed(i), 0, int(loadDataSize(i)))) {
			t.Errorf("%s differs after the restart", loadDataName(i))
		}
	}
	cmd, out := loadChild(t, "mixed", mnt, 100, time.Now().Add(2*time.Second))
	if err := cmd.Wait(); err != nil {
		t.Fatalf("client after restart: %v\n%s", err, out)
	}
	if r, ok := parseLoadResult(out.String()); !ok || r.ErrorCount != 0 {
		t.Errorf("client after restart: %+v", r)
	}
	if _, err := d2.waitIdle(idleFigures{fds: 1 << 20, goroutines: 1 << 20, pipeFDs: 1 << 20}); err != nil {
		t.Error(err)
	}
}
