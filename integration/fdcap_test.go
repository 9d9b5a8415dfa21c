package integration

import (
	"bufio"
	"context"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/gdsfs/gdsfs/ctl"
)

// fdcapLimit is the RLIMIT_NOFILE the budget test starts its daemon with:
// low, so that one user reaches the daemon's limit in a few hundred opens.
const fdcapLimit = 256

// TestOpenBudgetPerUser is the descriptor-exhaustion attack on a shared
// root daemon: uid 10001 opens files through the mount from two processes
// (each far below its own RLIMIT_NOFILE) until it gets EMFILE. Then uid
// 10002 must still open and read files and use the control path (a READ
// into a lease); uid 10001's opens work again once its processes closed
// their files (one exits, one is killed), and the daemon lives through it
// all. Without a per-uid budget the first user's opens use up the daemon's
// descriptors and every user's open fails with EMFILE.
func TestOpenBudgetPerUser(t *testing.T) {
	mnt, backing, logFile := mountCLILimited(t, fdcapLimit, "--allow-other")
	data := make([]byte, 300<<10)
	for i := range data {
		data[i] = byte(i*7 + i>>9)
	}
	file := filepath.Join(backing, "data")
	writeFile(t, file, data)
	sum := sha256.Sum256(data)
	mfile := filepath.Join(mnt, "data")
	bin := worldExecutable(t, os.Args[0])
	hog := func() (*exec.Cmd, io.WriteCloser, int, int) {
		t.Helper()
		c := child{bin: bin, family: "FDCAP", mode: "hog", env: map[string]string{"FILE": mfile}, uid: 10001}
		cmd := c.cmd(t)
		cmd.Stderr = os.Stderr
		in, err := cmd.StdinPipe()
		if err != nil {
			t.Fatal(err)
		}
		out, err := cmd.StdoutPipe()
		if err != nil {
			t.Fatal(err)
		}
		if err := cmd.Start(); err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { // before the unmount, on failure too
			cmd.Process.Kill()
			cmd.Wait()
		})
		line, err := bufio.NewReader(out).ReadString('\n')
		var held, refused int
		if _, serr := fmt.Sscanf(line, "held %d refused %d", &held, &refused); serr != nil {
			in.Close()
			cmd.Wait()
			t.Fatalf("hog as uid 10001: %q (%v)", line, err)
		}
		return cmd, in, held, refused
	}
	use := func(uid uint32) {
		t.Helper()
		c := child{bin: bin, family: "FDCAP", mode: "use", uid: uid,
			env: map[string]string{"MNT": mnt, "FILE": mfile, "SUM": hex.EncodeToString(sum[:])}}
		c.mustRun(t, time.Minute)
	}

	// Two processes of uid 10001, each holding as many opens as it gets.
	cmd1, in1, held1, ref1 := hog()
	cmd2, in2, held2, ref2 := hog()
	t.Logf("uid 10001 holds %d + %d files open", held1, held2)
	if held1 == 0 {
		t.Fatalf("uid 10001's first process could open nothing")
	}
	if st := openStatus(t, mnt); st.uid(10001) != int64(held1+held2) {
		t.Errorf("status: uid 10001 holds %d opens, want %d (%+v)", st.uid(10001), held1+held2, st)
	}
	// The other user is not affected, and neither is the control path.
	use(10002)
	// A user's status shows its own opens, not another uid's.
	st := openStatusAs(t, mnt, 10002)
	if st.OpenFiles == nil || st.uid(10001) != 0 || st.uid(10002) != 1 {
		t.Errorf("uid 10002's status: %+v, want its own session's open and not uid 10001's", st.OpenFiles)
	}

	// One process exits (closing its files), the other is killed.
	in1.Close()
	if err := cmd1.Wait(); err != nil {
		t.Errorf("hog 1: %v", err)
	}
	cmd2.Process.Kill()
	cmd2.Wait()
	in2.Close()
	waitOpens(t, mnt, 10001, 0)
	use(10001)
	cmd3, in3, held3, _ := hog()
	in3.Close()
	if err := cmd3.Wait(); err != nil {
		t.Errorf("hog 3: %v", err)
	}
	if held3 < held1 {
		t.Errorf("after its files were closed, uid 10001 got %d opens, want at least %d", held3, held1)
	}

	// The refusals were logged, but not one line each.
	b, err := os.ReadFile(logFile)
	if err != nil {
		t.Fatal(err)
	}
	lines := 0
	for _, l := range strings.Split(string(b), "\n") {
		if strings.Contains(l, "open budget") && strings.Contains(l, `"uid":10001`) {
			lines++
		}
	}
	if lines == 0 || lines >= ref1+ref2 {
		t.Errorf("log: %d budget lines naming uid 10001 for %d refusals, want at least one and fewer than refusals\n%s", lines, ref1+ref2, b)
	}
}

// TestFDCapChild is not a test: TestOpenBudgetPerUser re-executes the
// test binary with GDSFS_FDCAP_CHILD set to run a client process.
func TestFDCapChild(t *testing.T) {
	mode, env := childMode(t, "FDCAP")
	var err error
	switch mode {
	case "hog":
		err = childHog(env("FILE"))
	case "use":
		err = childUse(env("MNT"), env("FILE"), env("SUM"))
	default:
		err = fmt.Errorf("unknown child mode %q", mode)
	}
	childExit(err)
}

// childHog opens file until an open fails with EMFILE (anything else is an
// error), tries 20 more (all must fail the same way), says how many it
// holds, and keeps them open until its stdin closes.
func childHog(file string) error {
	var held []*os.File
	for len(held) < 100000 {
		f, err := os.Open(file)
		if err == nil {
			held = append(held, f)
			continue
		}
		if !errors.Is(err, syscall.EMFILE) {
			return fmt.Errorf("open %d: %w, want EMFILE", len(held)+1, err)
		}
		break
	}
	if len(held) == 100000 {
		return fmt.Errorf("opened %s %d times without EMFILE", file, len(held))
	}
	refused := 1
	for range 20 {
		if f, err := os.Open(file); err == nil {
			f.Close()
			return errors.New("an open past the budget worked")
		} else if !errors.Is(err, syscall.EMFILE) {
			return fmt.Errorf("open past the budget: %w, want EMFILE", err)
		}
		refused++
	}
	fmt.Printf("held %d refused %d\n", len(held), refused)
	io.Copy(io.Discard, os.Stdin)
	return nil
}

// childUse opens and reads file (checking its sha256), opens a few more
// descriptors of it, and reads a range of it through the control path.
func childUse(mnt, file, sum string) error {
	var fs []*os.File
	defer func() {
		for _, f := range fs {
			f.Close()
		}
	}()
	for i := range 8 {
		f, err := os.Open(file)
		if err != nil {
			return fmt.Errorf("uid %d: open %d of %s: %w", os.Getuid(), i+1, file, err)
		}
		fs = append(fs, f)
	}
	b, err := io.ReadAll(fs[0])
	if err != nil {
		return fmt.Errorf("read %s: %w", file, err)
	}
	if got := sha256.Sum256(b); hex.EncodeToString(got[:]) != sum {
		return fmt.Errorf("read %s: wrong contents", file)
	}
	cl, err := ctl.OpenSession(mnt)
	if err != nil {
		return fmt.Errorf("uid %d: control session: %w", os.Getuid(), err)
	}
	defer cl.Close()
	ctx := context.Background()
	ranges := []ctl.Range{{Offset: 5, Length: 70000}}
	ls, err := cl.Read(ctx, fs[1], ctl.HostDevice, ranges)
	if err != nil {
		return fmt.Errorf("uid %d: control-path READ: %w", os.Getuid(), err)
	}
	return verifyLeases(ctx, cl, ranges, ls, b)
}

// fdcapStatus is the part of `gdsfs status --json` the budget test reads.
type fdcapStatus struct {
	OpenFiles *struct {
		PerUID int64 `json:"per_uid"`
		UIDs   []struct {
			UID  uint32 `json:"uid"`
			Open int64  `json:"open"`
		} `json:"uids"`
	} `json:"open_files"`
}

func (s fdcapStatus) uid(uid uint32) int64 {
	if s.OpenFiles == nil {
		return -1
	}
	for _, u := range s.OpenFiles.UIDs {
		if u.UID == uid {
			return u.Open
		}
	}
	return 0
}

func openStatus(t testing.TB, mnt string) fdcapStatus {
	t.Helper()
	out, code := runGdsfs(t, "status", "--json", mnt)
	if code != 0 {
		t.Fatalf("gdsfs status: exit %d: %s", code, out)
	}
	return parseOpenStatus(t, out)
}

// openStatusAs is openStatus as uid.
func openStatusAs(t testing.TB, mnt string, uid uint32) fdcapStatus {
	t.Helper()
	cmd := exec.Command(gdsfsBin(t), "status", "--json", mnt)
	cmd.Dir = "/"
	cmd.SysProcAttr = &syscall.SysProcAttr{Credential: &syscall.Credential{Uid: uid, Gid: uid}}
	out, err := cmd.CombinedOutput()
	if err != nil {
		t.Fatalf("gdsfs status as uid %d: %v: %s", uid, err, out)
	}
	return parseOpenStatus(t, string(out))
}

func parseOpenStatus(t testing.TB, out string) fdcapStatus {
	t.Helper()
	var st fdcapStatus
	if err := json.Unmarshal([]byte(out), &st); err != nil {
		t.Fatalf("gdsfs status --json: %v\n%s", err, out)
	}
	return st
}

// waitOpens waits (up to 20s) until uid holds want opens: the kernel sends
// RELEASE after a process closed its files, asynchronously.
func waitOpens(t testing.TB, mnt string, uid uint32, want int64) {
	t.Helper()
	deadline := time.Now().Add(20 * time.Second)
	for {
		st := openStatus(t, mnt)
		if st.uid(uid) == want {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("uid %d holds %d opens 20s after closing, want %d", uid, st.uid(uid), want)
		}
		time.Sleep(20 * time.Millisecond) // polling: RELEASE has no event a test can wait on
	}
}

// mountCLILimited is mountCLI with the daemon started under RLIMIT_NOFILE
// nofile (soft and hard), returning the mountpoint, the backing directory
// (open to other uids) and the log file.
func mountCLILimited(t testing.TB, nofile int, extra ...string) (mnt, backing, logFile string) {
	t.Helper()
	requireRoot(t)
	dir := t.TempDir()
	backing, mnt = mountDirs(t, dir)
	openToOtherUIDs(t, dir)
	logFile = filepath.Join(dir, "gdsfs.log")
	lim := strconv.Itoa(nofile)
	args := append([]string{"--nofile=" + lim + ":" + lim, gdsfsBin(t), "mount", "--background", "--log-file", logFile, "--source", backing}, extra...)
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	out, err := exec.CommandContext(ctx, "prlimit", append(args, mnt)...).CombinedOutput()
	if err != nil {
		t.Fatalf("prlimit %v: %v: %s", args, err, out)
	}
	pid := 0
	if i := strings.Index(string(out), "(daemon pid "); i >= 0 {
		fmt.Sscanf(string(out[i:]), "(daemon pid %d)", &pid)
	}
	t.Cleanup(func() {
		alive := pid > 0 && syscall.Kill(pid, 0) == nil
		if !alive {
			t.Errorf("the daemon (pid %d) died", pid)
		}
		if out, code := runGdsfs(t, "unmount", mnt); code != 0 {
			t.Errorf("gdsfs unmount %s: exit %d: %s", mnt, code, out)
			runGdsfs(t, "unmount", "--force", mnt)
		}
		waitMounted(t, mnt, false)
		waitExited(t, pid)
		if t.Failed() {
			if b, err := os.ReadFile(logFile); err == nil {
				t.Logf("daemon log:\n%s", b)
			}
		}
	})
	return mnt, backing, logFile
}
