package integration

import (
	"bytes"
	mrand "math/rand/v2"
	"os/exec"
	"testing"
	"time"
)

// TestFaultClientKilledMidRequest: client processes issuing back-to-back
// whole-file control-path reads are killed (SIGKILL) at random moments,
// many of them inside a READ. Nothing leaks: afterwards the pool holds no
// lease, no session is open, and the daemon's descriptors and goroutines
// are back to idle.
func TestFaultClientKilledMidRequest(t *testing.T) {
	requireRoot(t)
	dir := t.TempDir()
	backing, mnt := mountDirs(t, dir)
	writeLoadDataset(t, backing)
	d := startBinDaemon(t, backing, mnt, "--engine", "host", "--host-pool", "512MiB", "--slab-size", "16MiB")
	cmd, out := loadChild(t, "bigread", mnt, 999, time.Now().Add(time.Second))
	if err := cmd.Wait(); err != nil {
		t.Fatalf("warm-up client: %v\n%s", err, out)
	}
	base, err := d.waitIdle(idleFigures{fds: 1 << 20, goroutines: 1 << 20, pipeFDs: 1 << 20})
	if err != nil {
		t.Fatal(err)
	}

	const rounds, perRound = 6, 8
	rng := mrand.New(mrand.NewPCG(3, 4))
	killed := 0
	for round := range rounds {
		cmds := make([]*exec.Cmd, perRound)
		outs := make([]*bytes.Buffer, perRound)
		for i := range cmds {
			cmds[i], outs[i] = loadChild(t, "bigread", mnt, round*perRound+i, time.Now().Add(time.Minute))
		}
		// Wait until reads are in flight, then kill each client after a
		// random delay so the kills land at different points of a READ.
		deadline := time.Now().Add(20 * time.Second)
		for d.mustScrape().Sum("gdsfs_pool_in_use_bytes") == 0 {
			if time.Now().After(deadline) {
				t.Fatal("no read in flight 20s after starting the clients")
			}
			time.Sleep(5 * time.Millisecond) // polling the daemon's pool
		}
		for i, c := range cmds {
			time.Sleep(time.Duration(rng.IntN(40)) * time.Millisecond) // spread the kills over READs
			if c.ProcessState != nil {
				t.Fatalf("client %d exited before it was killed:\n%s", i, outs[i].String())
			}
			if err := c.Process.Kill(); err != nil {
				t.Fatal(err)
			}
			c.Wait()
			killed++
		}
	}
	after, err := d.waitIdle(base)
	if err != nil {
		t.Fatal(err)
	}
	s := d.mustScrape()
	reads, _ := s.Get("gdsfs_control_requests_total", "command", "READ")
	intr := s.Sum("gdsfs_control_errors_total", "command", "READ", "errno", "EINTR")
	t.Logf("client kill: %d clients killed during %v whole-file READs (%v interrupted in the daemon); after: pool %v B leased, %v sessions, %d fds (idle %d), %d goroutines (idle %d)",
		killed, reads, intr, after.poolBytes, after.sessions, after.fds, base.fds, after.goroutines, base.goroutines)
}
