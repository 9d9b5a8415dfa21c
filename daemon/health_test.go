package daemon

import (
	"context"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/gdsfs/gdsfs/internal/mountinfo"
)

// TestHealthHint: every unhealthy state is one line that names the mount,
// the daemon's pid where it is known, and the command that fixes it; a
// daemon that answers has none.
func TestHealthHint(t *testing.T) {
	m := mountinfo.Entry{MountPoint: "/data", FSType: mountinfo.GDSFSType}
	cases := []struct {
		name  string
		h     Health
		wants []string // "" Hint when empty
	}{
		{"answers", Health{Mount: m, State: Answers, PID: 7, Proc: ProcRunning}, nil},
		{"unknown", Health{Mount: m, State: Unknown}, nil},
		{"dead", Health{Mount: m, State: Dead}, []string{"/data", "daemon exited", "gdsfs mount /data", "gdsfs unmount --force /data"}},
		{"stopped", Health{Mount: m, State: Hung, PID: 42, Proc: ProcStopped}, []string{"daemon pid 42", "stopped", "kill -CONT 42", "gdsfs unmount --force /data aborts"}},
		{"zombie", Health{Mount: m, State: Hung, PID: 42, Proc: ProcZombie}, []string{"daemon pid 42", "killed", "gdsfs unmount --force /data aborts", "gdsfs mount /data"}},
		{"gone", Health{Mount: m, State: Hung, PID: 42, Proc: ProcGone}, []string{"pid 42", "gone", "gdsfs unmount --force /data aborts"}},
		{"deadlocked", Health{Mount: m, State: Hung, PID: 42, Proc: ProcRunning}, []string{"daemon pid 42", "does not answer", ProbeTimeout.String(), "gdsfs unmount --force /data aborts"}},
		{"not recorded", Health{Mount: m, State: Hung}, []string{"the daemon of /data", "does not answer", "gdsfs unmount --force /data aborts"}},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			got := c.h.Hint()
			if len(c.wants) == 0 {
				if got != "" {
					t.Errorf("Hint() = %q, want none", got)
				}
				return
			}
			if strings.Contains(got, "\n") {
				t.Errorf("Hint() = %q: not one line", got)
			}
			for _, w := range c.wants {
				if !strings.Contains(got, w) {
					t.Errorf("Hint() = %q, does not say %q", got, w)
				}
			}
		})
	}
}

// TestSigPending: SIGKILL pending on a process or its thread group shows
// in /proc/PID/status's masks (bit 8); other signals and other lines do
// not count.
func TestSigPending(t *testing.T) {
	cases := []struct {
		name, status string
		want         bool
	}{
		{"none", "Name:\tgdsfs\nSigPnd:\t0000000000000000\nShdPnd:\t0000000000000000\n", false},
		{"shared", "SigPnd:\t0000000000000000\nShdPnd:\t0000000000000100\n", true},
		{"thread", "SigPnd:\t0000000000000100\nShdPnd:\t0000000000000000\n", true},
		{"with others", "ShdPnd:\t0000000000004103\n", true},
		{"SIGTERM only", "ShdPnd:\t0000000000004000\n", false},
		{"blocked is not pending", "SigBlk:\t0000000000000100\n", false},
		{"garbage", "ShdPnd:\tzz\nSigPnd\n", false},
		{"empty", "", false},
	}
	for _, c := range cases {
		if got := sigPending(c.status, syscall.SIGKILL); got != c.want {
			t.Errorf("%s: sigPending(%q) = %v, want %v", c.name, c.status, got, c.want)
		}
	}
}

func FuzzSigPending(f *testing.F) {
	f.Add("SigPnd:\t0000000000000100\nShdPnd:\t0\n")
	f.Add("ShdPnd:\tffffffffffffffff\n")
	f.Add(":\n::")
	f.Fuzz(func(t *testing.T, s string) {
		all := sigPending(s, syscall.SIGKILL)
		if all && !strings.Contains(s, "Pnd") {
			t.Fatalf("SIGKILL pending in %q, which has no pending mask", s)
		}
	})
}

// TestMountRecord: a recorded daemon is named with what it is doing
// (running, stopped, dying), and is gone once it exited or when the
// record names another mount or a reused pid; the remover removes only
// its own record.
func TestMountRecord(t *testing.T) {
	dir := t.TempDir()
	m := mountinfo.Entry{MountPoint: "/data", FSType: mountinfo.GDSFSType, Minor: 77}
	if pid, st := recordedDaemonIn(dir, m); pid != 0 || st != ProcGone {
		t.Errorf("no record: %d %s", pid, st)
	}
	remove, err := writeRecord(dir, m, os.Getpid())
	if err != nil {
		t.Fatal(err)
	}
	if pid, st := recordedDaemonIn(dir, m); pid != os.Getpid() || st != ProcRunning {
		t.Errorf("this process recorded: %d %s, want %d running", pid, st, os.Getpid())
	}
	other := m
	other.MountPoint = "/elsewhere"
	if pid, _ := recordedDaemonIn(dir, other); pid != 0 {
		t.Errorf("a record of connection %d at another mountpoint names pid %d", m.ConnID(), pid)
	}

	// A child stopped, then killed: stopped, then gone once reaped.
	cmd := exec.Command("sleep", "60")
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { cmd.Process.Kill(); cmd.Wait() })
	if _, err := writeRecord(dir, m, cmd.Process.Pid); err != nil {
		t.Fatal(err)
	}
	remove() // no longer this process's record: it stays
	if pid, _ := recordedDaemonIn(dir, m); pid != cmd.Process.Pid {
		t.Fatalf("the earlier record's remover removed the child's record (pid %d)", pid)
	}
	if err := syscall.Kill(cmd.Process.Pid, syscall.SIGSTOP); err != nil {
		t.Fatal(err)
	}
	waitState(t, cmd.Process.Pid, ProcStopped)
	cmd.Process.Kill()
	cmd.Wait()
	if pid, st := recordedDaemonIn(dir, m); pid != cmd.Process.Pid || st != ProcGone {
		t.Errorf("reaped child: %d %s, want %d gone", pid, st, cmd.Process.Pid)
	}
	// A record whose start time is not the process's: the pid was reused.
	if err := os.WriteFile(recordPath(dir, m), []byte(fmt.Sprintf(`{"pid":%d,"start_time":1,"mountpoint":"/data"}`, os.Getpid())), 0o644); err != nil {
		t.Fatal(err)
	}
	if _, st := recordedDaemonIn(dir, m); st != ProcGone {
		t.Errorf("a reused pid: %s, want gone", st)
	}
}

// waitState waits until pid's procState is want (polling /proc).
func waitState(t *testing.T, pid int, want ProcState) {
	t.Helper()
	deadline := time.Now().Add(20 * time.Second)
	for procState(pid) != want {
		if time.Now().After(deadline) {
			t.Fatalf("pid %d: %s, want %s", pid, procState(pid), want)
		}
		time.Sleep(time.Millisecond) // polling /proc: no event to wait on
	}
}

// TestSweepRecords: the records of connections no longer mounted go, those
// of mounted ones and other files stay.
func TestSweepRecords(t *testing.T) {
	dir := t.TempDir()
	live := mountinfo.Entry{MountPoint: "/live", FSType: mountinfo.GDSFSType, Minor: 40}
	gone := mountinfo.Entry{MountPoint: "/gone", FSType: mountinfo.GDSFSType, Minor: 41}
	for _, m := range []mountinfo.Entry{live, gone} {
		if _, err := writeRecord(dir, m, os.Getpid()); err != nil {
			t.Fatal(err)
		}
	}
	// A crashed writer's temporary file goes; a live writer's stays.
	crashed := recordPath(dir, gone) + ".tmp999999999"
	writing := recordPath(dir, gone) + ".tmp" + fmt.Sprint(os.Getpid())
	for _, p := range []string{crashed, writing} {
		if err := os.WriteFile(p, nil, 0o644); err != nil {
			t.Fatal(err)
		}
	}
	defer func() {
		if _, err := os.Stat(crashed); !os.IsNotExist(err) {
			t.Errorf("a crashed writer's temporary file stayed: %v", err)
		}
		if _, err := os.Stat(writing); err != nil {
			t.Errorf("a live writer's temporary file went: %v", err)
		}
	}()
	other := dir + "/notes.txt"
	if err := os.WriteFile(other, nil, 0o644); err != nil {
		t.Fatal(err)
	}
	sweepRecords(dir, []mountinfo.Entry{live, {MountPoint: "/", FSType: "ext4", Major: 8, Minor: 1}})
	if pid, _ := recordedDaemonIn(dir, live); pid != os.Getpid() {
		t.Errorf("the mounted connection's record went (pid %d)", pid)
	}
	if _, err := os.Stat(recordPath(dir, gone)); !os.IsNotExist(err) {
		t.Errorf("the unmounted connection's record stayed: %v", err)
	}
	if _, err := os.Stat(other); err != nil {
		t.Errorf("a file that is no record went: %v", err)
	}
}

// TestProbeResult: the probe child's lines make the verdict; its timeout
// runs only from "probing", so a slow start is no hang.
func TestProbeResult(t *testing.T) {
	ctx := context.Background()
	cases := []struct {
		name   string
		lines  []string
		closed bool
		want   MountState
	}{
		{"answers", []string{"probing 7", "ok"}, true, Answers},
		{"daemon error", []string{"probing 7", "EIO"}, true, Answers},
		{"exited daemon", []string{"probing 7", "ENOTCONN"}, true, Dead},
		{"aborted", []string{"probing 7", "ECONNABORTED"}, true, Dead},
		{"no answer", []string{"probing 7"}, false, Hung},
		{"never started", nil, false, Unknown},
		{"died", []string{"probing 7"}, true, Unknown},
		{"garbage first", []string{"ok"}, true, Unknown},
		{"garbage result", []string{"probing 7", "what"}, true, Unknown},
		// The path led elsewhere (a link, a new mount): not this mount's
		// verdict, even if that one hangs.
		{"another mount", []string{"probing 8"}, false, Unknown},
		{"another mount answers", []string{"probing 8", "ok"}, true, Unknown},
		{"no mount id", []string{"probing"}, false, Unknown},
		{"open failed", []string{"ELOOP"}, true, Unknown},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			ch := make(chan string, len(c.lines))
			for _, l := range c.lines {
				ch <- l
			}
			if c.closed {
				close(ch)
			}
			why, got := probeResult(ctx, ch, 7, 50*time.Millisecond, 50*time.Millisecond)
			if got != c.want {
				t.Errorf("lines %q: %v (%s), want %v", c.lines, got, why, c.want)
			}
		})
	}
	// A cancelled caller is no verdict on the daemon.
	cctx, cancel := context.WithCancel(ctx)
	cancel()
	if _, got := probeResult(cctx, make(chan string), 7, time.Hour, time.Hour); got != Unknown {
		t.Errorf("cancelled: %v, want Unknown", got)
	}
}

// TestMountRecordTrust: a record is believed only where no one but root
// (or the reader itself) could have written it: root's gdsfs unmount
// --force takes a mount whose record names a stopped process for hung and
// aborts it, so a record a user planted would let them abort a healthy
// mount. And root never writes a record through a link someone planted.
func TestMountRecordTrust(t *testing.T) {
	m := mountinfo.Entry{MountPoint: "/data", FSType: mountinfo.GDSFSType, Minor: 78}
	forged := fmt.Sprintf(`{"pid":%d,"start_time":%d,"mountpoint":"/data"}`, os.Getpid(), mustStart(t))
	cases := []struct {
		name  string
		setup func(t *testing.T, dir string)
	}{
		{"directory writable by others", func(t *testing.T, dir string) {
			os.Chmod(dir, 0o777)
			os.WriteFile(recordPath(dir, m), []byte(forged), 0o644)
		}},
		{"record writable by others", func(t *testing.T, dir string) {
			os.WriteFile(recordPath(dir, m), []byte(forged), 0o644)
			os.Chmod(recordPath(dir, m), 0o666)
		}},
		{"record is a link", func(t *testing.T, dir string) {
			elsewhere := filepath.Join(t.TempDir(), "r")
			os.WriteFile(elsewhere, []byte(forged), 0o644)
			os.Symlink(elsewhere, recordPath(dir, m))
		}},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			dir := t.TempDir()
			c.setup(t, dir)
			if pid, st := recordedDaemonIn(dir, m); pid != 0 || st != ProcGone {
				t.Errorf("untrusted record believed: pid %d %s", pid, st)
			}
		})
	}
	// Writing: never into a directory others may write, never through a
	// planted link.
	open := t.TempDir()
	os.Chmod(open, 0o777)
	if _, err := writeRecord(open, m, os.Getpid()); err == nil || !strings.Contains(err.Error(), "chmod 755") {
		t.Errorf("writeRecord into a directory others may write: %v", err)
	}
	dir := t.TempDir()
	victim := filepath.Join(t.TempDir(), "victim")
	os.WriteFile(victim, []byte("keep"), 0o644)
	os.Symlink(victim, recordPath(dir, m)+".tmp"+fmt.Sprint(os.Getpid()))
	if _, err := writeRecord(dir, m, os.Getpid()); err != nil {
		t.Fatalf("writeRecord: %v", err)
	}
	if b, _ := os.ReadFile(victim); string(b) != "keep" {
		t.Errorf("writeRecord wrote through a planted link: the target now holds %q", b)
	}
	if pid, _ := recordedDaemonIn(dir, m); pid != os.Getpid() {
		t.Errorf("the record written: pid %d, want %d", pid, os.Getpid())
	}
}

// mustStart is this process's start time.
func mustStart(t *testing.T) uint64 {
	t.Helper()
	st, err := startTime(os.Getpid())
	if err != nil {
		t.Fatal(err)
	}
	return st
}
