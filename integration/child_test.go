package integration

import (
	"bytes"
	"fmt"
	"os"
	"os/exec"
	"syscall"
	"testing"
	"time"
)

// childTest is the entry point a child process of family runs: the test
// binary re-executed with GDSFS_<family>_CHILD set to a mode (the family's
// other variables are GDSFS_<family>_<KEY>); "" for no such family.
func childTest(family string) string {
	switch family {
	case "CTL":
		return "TestControlChild"
	case "HOSTILE":
		return "TestHostileChild"
	case "SLABFD":
		return "TestSlabFDChild"
	case "POOL":
		return "TestPoolChild"
	case "LOAD":
		return "TestLoadChild"
	case "CONF":
		return "TestConformanceChild"
	case "AUDIT":
		return "TestAuditChild"
	case "FDCAP":
		return "TestFDCapChild"
	case "TIERSEE":
		return "TestTierseeChild"
	case "HUNG":
		return "TestHungChild"
	}
	return ""
}

// child is a client process: the test binary re-executed to run one mode
// of a family's TestXChild entry point (another uid, a forked worker, an
// attacker, a process to kill).
type child struct {
	// bin is the binary; "" is this one (copied where every uid can run
	// it when uid is set). Tests that start several children of other
	// uids at once copy it first (worldExecutable): a copy being written
	// while another goroutine forks makes exec fail with ETXTBSY.
	bin    string
	family string            // "CTL", "HOSTILE", ... (childTest)
	mode   string            // GDSFS_<family>_CHILD ("" sets none)
	env    map[string]string // GDSFS_<family>_<KEY>=value
	uid    uint32            // run as uid and gid uid, in /; 0: as this process
}

// childMode is the child side: the mode a process of family was started in
// and its variables; it skips the test when this process is no such child.
func childMode(t *testing.T, family string) (mode string, env func(key string) string) {
	mode = os.Getenv("GDSFS_" + family + "_CHILD")
	if mode == "" {
		t.Skipf("helper process (GDSFS_%s_CHILD) for the integration tests", family)
	}
	return mode, func(k string) string { return os.Getenv("GDSFS_" + family + "_" + k) }
}

// childExit ends a child process: status 0, or 1 with err on stderr.
func childExit(err error) {
	if err != nil {
		fmt.Fprintln(os.Stderr, "child:", err)
		os.Exit(1)
	}
	os.Exit(0)
}

// cmd prepares the child; the caller starts it.
func (c child) cmd(t testing.TB) *exec.Cmd {
	t.Helper()
	test := childTest(c.family)
	if test == "" {
		t.Fatalf("no child family %q", c.family)
	}
	bin := c.bin
	if bin == "" {
		bin = os.Args[0]
		if c.uid != 0 {
			bin = worldExecutable(t, bin)
		}
	}
	cmd := exec.Command(bin, "-test.run=^"+test+"$", "-test.count=1")
	cmd.Env = os.Environ()
	if c.mode != "" {
		cmd.Env = append(cmd.Env, "GDSFS_"+c.family+"_CHILD="+c.mode)
	}
	for k, v := range c.env {
		cmd.Env = append(cmd.Env, "GDSFS_"+c.family+"_"+k+"="+v)
	}
	cmd.Dir = "/"
	if c.uid != 0 {
		cmd.SysProcAttr = &syscall.SysProcAttr{Credential: &syscall.Credential{Uid: c.uid, Gid: c.uid}}
	}
	return cmd
}

func (c child) String() string { return fmt.Sprintf("child %s %s as uid %d", c.family, c.mode, c.uid) }

// run runs the child to completion, killing it after timeout, and returns
// its output (stdout and stderr) and how it ended.
func (c child) run(t testing.TB, timeout time.Duration) (string, error) {
	t.Helper()
	cmd := c.cmd(t)
	var out bytes.Buffer
	cmd.Stdout, cmd.Stderr = &out, &out
	if err := cmd.Start(); err != nil {
		return "", err
	}
	done := make(chan error, 1)
	go func() { done <- cmd.Wait() }()
	select {
	case err := <-done:
		return out.String(), err
	case <-time.After(timeout):
		cmd.Process.Kill()
		<-done
		return out.String(), fmt.Errorf("still running after %s: killed", timeout)
	}
}

// mustRun runs the child as run does and fails the test if it fails or
// hangs.
func (c child) mustRun(t testing.TB, timeout time.Duration) string {
	t.Helper()
	out, err := c.run(t, timeout)
	if err != nil {
		t.Fatalf("%v: %v\n%s", c, err, out)
	}
	return out
}
