package fs

import (
	"bufio"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/rs/zerolog"
	"golang.org/x/sys/unix"
)

// lockAgentSrc is a process that takes file locks on commands read from
// stdin, one JSON array a line, and answers each with one JSON line: "ok",
// an errno's name, or F_GETLK's [type, whence, start, len, pid]. Its first
// line is its pid.
const lockAgentSrc = `
import errno, fcntl, json, os, struct, sys
root = sys.argv[1]
FMT = "hh4xqqi4x"  # struct flock on 64-bit Linux
fds = {}
def reply(v):
    sys.stdout.write(json.dumps(v) + "\n")
    sys.stdout.flush()
reply(os.getpid())
for line in sys.stdin:
    c = json.loads(line)
    try:
        if c[0] == "open":
            mode = {"r": os.O_RDONLY, "w": os.O_WRONLY, "rw": os.O_RDWR}[c[3]]
            fds[c[1]] = os.open(os.path.join(root, c[2]), mode)
            reply("ok")
        elif c[0] == "close":
            os.close(fds.pop(c[1]))
            reply("ok")
        elif c[0] == "lk":
            _, fd, cmd, typ, whence, start, ln = c
            r = fcntl.fcntl(fds[fd], cmd, struct.pack(FMT, typ, whence, start, ln, 0))
            if cmd in (fcntl.F_GETLK, 36):
                reply(list(struct.unpack(FMT, r)))
            else:
                reply("ok")
        elif c[0] == "lockf":
            fcntl.lockf(fds[c[1]], c[2], c[3], c[4])
            reply("ok")
        elif c[0] == "flock":
            fcntl.flock(fds[c[1]], c[2])
            reply("ok")
        elif c[0] == "unlink":
            os.unlink(os.path.join(root, c[1]))
            reply("ok")
    except OSError as e:
        reply(errno.errorcode.get(e.errno, str(e.errno)))
`

// Lock commands and types as fcntl(2) numbers them.
const (
	cmdGetlk     = syscall.F_GETLK
	cmdSetlk     = syscall.F_SETLK
	cmdSetlkw    = syscall.F_SETLKW
	cmdOFDGetlk  = 36
	cmdOFDSetlk  = 37
	cmdOFDSetlkw = 38
	rd           = syscall.F_RDLCK
	wr           = syscall.F_WRLCK
	un           = syscall.F_UNLCK
)

// lockAgent is one running lockAgentSrc.
type lockAgent struct {
	name  string
	cmd   *exec.Cmd
	in    io.WriteCloser
	lines chan string
	pid   int
	dead  bool
}

// lockAgentUIDs are the users the agents run as: two users, and a second
// process of the first.
var lockAgentUIDs = map[string]uint32{"A": 10001, "B": 10002, "C": 10001}

func startLockAgent(t *testing.T, name, root string) *lockAgent {
	t.Helper()
	uid := lockAgentUIDs[name]
	cmd := exec.Command("/usr/bin/python3", "-c", lockAgentSrc, root)
	cmd.SysProcAttr = &syscall.SysProcAttr{Credential: &syscall.Credential{Uid: uid, Gid: uid}}
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
		t.Fatalf("start lock agent: %v", err)
	}
	a := &lockAgent{name: name, cmd: cmd, in: in, lines: make(chan string, 16)}
	go func() {
		sc := bufio.NewScanner(out)
		for sc.Scan() {
			a.lines <- sc.Text()
		}
		close(a.lines)
	}()
	first := a.recv()
	if _, err := fmt.Sscan(first, &a.pid); err != nil {
		t.Fatalf("lock agent %s: first line %q: %v", name, first, err)
	}
	return a
}

// lockAgentPatience bounds a wait for an answer that should come: a
// request still blocked after it is reported as "hung" (never reached in a
// passing run; it keeps a broken daemon from hanging the test).
const lockAgentPatience = 20 * time.Second

func (a *lockAgent) send(c []any) {
	b, _ := json.Marshal(c)
	a.in.Write(append(b, '\n'))
}

func (a *lockAgent) recv() string {
	select {
	case l, ok := <-a.lines:
		if !ok {
			return "exited"
		}
		return l
	case <-time.After(lockAgentPatience):
		return "hung"
	}
}

// kill sends SIGKILL and reaps the agent: "killed", or "hung" when it
// did not die (a process blocked in a FUSE request the daemon never
// answers cannot die).
func (a *lockAgent) kill() string {
	a.dead = true
	a.cmd.Process.Kill()
	done := make(chan struct{})
	go func() { a.cmd.Wait(); close(done) }()
	select {
	case <-done:
		return "killed"
	case <-time.After(lockAgentPatience):
		return "hung"
	}
}

// lkStep is one step of a lock scenario, done by agent who.
type lkStep struct {
	who   string
	do    []any
	async bool // send only; a later await step reads the answer
	await bool
	kill  bool
	noPid bool // F_GETLK's pid is not compared (see TestPOSIXLocksAsBacking)
	// blocked waits until who's F_SETLKW (sent async) waits for a lock.
	blocked bool
}

func lkOpen(who, fd, file, mode string) lkStep {
	return lkStep{who: who, do: []any{"open", fd, file, mode}}
}
func lkClose(who, fd string) lkStep { return lkStep{who: who, do: []any{"close", fd}} }
func lk(who, fd string, cmd, typ, whence int, start, n int64) lkStep {
	return lkStep{who: who, do: []any{"lk", fd, cmd, typ, whence, start, n}}
}
func lkSet(who, fd string, typ int, start, n int64) lkStep {
	return lk(who, fd, cmdSetlk, typ, 0, start, n)
}
func lkGet(who, fd string, typ int, start, n int64) lkStep {
	return lk(who, fd, cmdGetlk, typ, 0, start, n)
}
func lkFlock(who, fd string, op int) lkStep { return lkStep{who: who, do: []any{"flock", fd, op}} }
func lkAsync(s lkStep) lkStep               { s.async = true; return s }
func lkAwait(who string) lkStep             { return lkStep{who: who, await: true} }
func lkKill(who string) lkStep              { return lkStep{who: who, kill: true} }
func lkBlocked(who string) lkStep           { return lkStep{who: who, blocked: true} }
func lkNoPid(s lkStep) lkStep               { s.noPid = true; return s }

// runLockScenario runs steps with agents whose paths are relative to root
// and returns what each step answered, pids named by agent. blocked tells
// whether a process waits in F_SETLKW.
func runLockScenario(t *testing.T, root string, steps []lkStep, blocked func(pid int) bool) []string {
	t.Helper()
	agents := map[string]*lockAgent{}
	defer func() {
		for _, a := range agents {
			if !a.dead {
				a.in.Close()
				a.kill()
			}
		}
	}()
	var got []string
	for _, s := range steps {
		a := agents[s.who]
		if a == nil {
			a = startLockAgent(t, s.who, root)
			agents[s.who] = a
		}
		var ans string
		switch {
		case s.kill:
			ans = a.kill()
		case s.await:
			ans = a.recv()
		case s.blocked:
			ans = "blocked"
			for start := time.Now(); !blocked(a.pid); time.Sleep(time.Millisecond) {
				if time.Since(start) > lockAgentPatience {
					ans = "not blocked"
					break
				}
			}
		default:
			a.send(s.do)
			if s.async {
				continue
			}
			ans = a.recv()
		}
		ans = namePids(ans, agents, s.noPid)
		got = append(got, fmt.Sprintf("%s %v%s%s -> %s", s.who, s.do, map[bool]string{true: " (await)"}[s.await], map[bool]string{true: " (blocked)"}[s.blocked], ans))
	}
	return got
}

// namePids rewrites an F_GETLK answer's pid as the agent's name.
func namePids(ans string, agents map[string]*lockAgent, noPid bool) string {
	var fl []int64
	if json.Unmarshal([]byte(ans), &fl) != nil || len(fl) != 5 {
		return ans
	}
	pid := fmt.Sprint(fl[4])
	for _, a := range agents {
		if int64(a.pid) == fl[4] {
			pid = a.name
		}
	}
	if noPid {
		pid = "*"
	}
	return fmt.Sprintf("type=%d whence=%d start=%d len=%d pid=%s", fl[0], fl[1], fl[2], fl[3], pid)
}

// lockScenarios are lock sequences whose answers on the mount must equal
// those on the backing filesystem. A, B and C are processes; A and C run
// as one user, B as another. Each scenario's file holds 100 bytes.
var lockScenarios = []struct {
	name  string
	steps []lkStep
}{
	{"one process, two descriptors", []lkStep{
		lkOpen("A", "a1", "f", "rw"), lkOpen("A", "a2", "f", "rw"),
		lkSet("A", "a1", wr, 0, 10), lkSet("A", "a2", wr, 0, 10),
		lkSet("A", "a2", rd, 5, 20),
		lkOpen("B", "b", "f", "rw"), lkGet("B", "b", wr, 0, 0),
		lkSet("B", "b", rd, 0, 1),
	}},
	{"close of another descriptor drops the process's locks", []lkStep{
		lkOpen("A", "a1", "f", "rw"), lkOpen("A", "a2", "f", "rw"),
		lkSet("A", "a1", wr, 0, 0), lkClose("A", "a2"),
		lkOpen("B", "b", "f", "rw"), lkSet("B", "b", wr, 0, 0),
	}},
	{"close of a read-only descriptor drops a write lock", []lkStep{
		lkOpen("A", "a1", "f", "rw"), lkSet("A", "a1", wr, 0, 0),
		lkOpen("A", "r", "f", "r"), lkClose("A", "r"),
		lkOpen("B", "b", "f", "rw"), lkSet("B", "b", wr, 0, 0),
	}},
	{"read lock on a read-only descriptor, dropped by its close", []lkStep{
		lkOpen("A", "r", "f", "r"), lkSet("A", "r", rd, 0, 0),
		lkOpen("B", "b", "f", "rw"), lkSet("B", "b", wr, 0, 0),
		lkClose("A", "r"), lkSet("B", "b", wr, 0, 0),
	}},
	{"read lock through a read-only open, then a write lock through a write open", []lkStep{
		lkOpen("A", "r", "f", "r"), lkSet("A", "r", rd, 0, 10),
		lkOpen("A", "w", "f", "w"), lkSet("A", "w", wr, 5, 20),
		lkOpen("B", "b", "f", "rw"), lkGet("B", "b", rd, 0, 0), lkGet("B", "b", wr, 0, 0),
		lkSet("B", "b", rd, 0, 5), lkSet("B", "b", rd, 5, 1),
		lkClose("A", "r"), lkSet("B", "b", wr, 0, 0),
	}},
	{"a second process of the same user conflicts", []lkStep{
		lkOpen("A", "a", "f", "rw"), lkSet("A", "a", wr, 0, 100),
		lkOpen("C", "c", "f", "rw"),
		lkSet("C", "c", wr, 50, 10), lkSet("C", "c", rd, 99, 1),
		lkSet("C", "c", wr, 100, 100), lkGet("C", "c", wr, 0, 10),
		lkGet("C", "c", rd, 100, 0), lkGet("A", "a", wr, 0, 0),
	}},
	{"F_SETLKW waits for the holder's unlock, then its close", []lkStep{
		lkOpen("A", "a", "f", "rw"), lkSet("A", "a", wr, 0, 0),
		lkOpen("B", "b", "f", "rw"), lkAsync(lk("B", "b", cmdSetlkw, wr, 0, 0, 10)),
		lkBlocked("B"), lkOpen("C", "c", "f", "r"), lkGet("C", "c", rd, 0, 0),
		lkSet("A", "a", un, 0, 5), lkSet("A", "a", un, 5, 0), lkAwait("B"),
		lkGet("C", "c", rd, 0, 0),
		lkAsync(lk("A", "a", cmdSetlkw, rd, 0, 0, 0)), lkBlocked("A"), lkGet("C", "c", rd, 0, 0),
		lkClose("B", "b"), lkAwait("A"), lkGet("C", "c", wr, 0, 0),
	}},
	{"ranges split and merge", []lkStep{
		lkOpen("A", "a", "f", "rw"), lkSet("A", "a", wr, 0, 100),
		lkSet("A", "a", un, 40, 20), lkOpen("B", "b", "f", "rw"),
		lkGet("B", "b", wr, 0, 0), lkGet("B", "b", wr, 40, 0),
		lkSet("B", "b", wr, 40, 20), lkSet("B", "b", wr, 39, 2),
		lkSet("A", "a", rd, 100, 10), lkSet("A", "a", rd, 110, 10),
		lkGet("B", "b", wr, 100, 0), lkSet("A", "a", rd, 60, 40),
		lkGet("B", "b", wr, 60, 0),
		lkSet("A", "a", un, 0, 0), lkGet("B", "b", wr, 0, 0),
	}},
	{"upgrade and downgrade", []lkStep{
		lkOpen("A", "a", "f", "rw"), lkOpen("B", "b", "f", "rw"), lkOpen("C", "c", "f", "rw"),
		lkSet("A", "a", rd, 0, 100), lkSet("B", "b", rd, 0, 100),
		lkSet("A", "a", wr, 0, 100), lkGet("A", "a", wr, 0, 100),
		lkSet("B", "b", un, 0, 0), lkSet("A", "a", wr, 10, 10),
		lkSet("C", "c", rd, 0, 0), lkGet("C", "c", rd, 0, 0),
		lkSet("A", "a", rd, 0, 100), lkSet("C", "c", rd, 0, 0),
		lkSet("C", "c", wr, 0, 0), lkGet("C", "c", wr, 0, 0),
	}},
	{"whence, negative lengths, odd ranges", []lkStep{
		lkOpen("A", "a", "f", "rw"), lkOpen("B", "b", "f", "rw"),
		lk("A", "a", cmdSetlk, wr, 2, -10, 5), lkGet("B", "b", wr, 0, 0),
		lk("A", "a", cmdSetlk, wr, 0, 50, -10), lkGet("B", "b", wr, 0, 0),
		lk("A", "a", cmdSetlk, wr, 0, 5, -10), lk("A", "a", cmdSetlk, wr, 2, -200, 1),
		lk("A", "a", cmdSetlk, rd, 0, 1<<62, 1<<62), lk("A", "a", cmdSetlk, rd, 0, 1<<62-1, 1<<62),
		lk("A", "a", cmdSetlk, rd, 0, 1<<63-2, 0), lkGet("B", "b", wr, 1<<62, 0),
		lk("A", "a", cmdSetlk, rd, 0, 1000, 10), lk("A", "a", cmdSetlk, 7, 0, 0, 0),
		lk("A", "a", cmdSetlk, wr, 1, 0, 10), lk("A", "a", cmdSetlk, wr, 9, 0, 10),
		lkGet("B", "b", wr, 990, 100), lk("B", "b", cmdGetlk, un, 0, 0, 0),
	}},
	{"lockf", []lkStep{
		lkOpen("A", "a", "f", "rw"), lkOpen("B", "b", "f", "rw"),
		{who: "A", do: []any{"lockf", "a", syscall.LOCK_EX | syscall.LOCK_NB, 0, 0}},
		{who: "B", do: []any{"lockf", "b", syscall.LOCK_EX | syscall.LOCK_NB, 10, 0}},
		{who: "A", do: []any{"lockf", "a", syscall.LOCK_UN, 0, 0}},
		{who: "B", do: []any{"lockf", "b", syscall.LOCK_EX | syscall.LOCK_NB, 10, 0}},
	}},
	{"flock stays per open file", []lkStep{
		lkOpen("A", "a1", "f", "r"), lkOpen("A", "a2", "f", "r"), lkOpen("B", "b", "f", "r"),
		lkFlock("A", "a1", syscall.LOCK_EX), lkFlock("A", "a2", syscall.LOCK_EX|syscall.LOCK_NB),
		lkFlock("B", "b", syscall.LOCK_SH|syscall.LOCK_NB), lkSet("A", "a2", rd, 0, 0),
		lkClose("A", "a2"), lkFlock("B", "b", syscall.LOCK_SH|syscall.LOCK_NB),
		lkClose("A", "a1"), lkFlock("B", "b", syscall.LOCK_SH),
	}},
	// ext4 reports an OFD lock's pid as -1; a FUSE daemon cannot (the
	// kernel maps the pid it answers into the caller's namespace, and -1
	// is none: 0), so the pid of conflicts with OFD locks is not compared.
	{"OFD locks stay per open file", []lkStep{
		lkOpen("A", "a1", "f", "rw"), lkOpen("A", "a2", "f", "rw"),
		lk("A", "a1", cmdOFDSetlk, wr, 0, 0, 10), lk("A", "a2", cmdOFDSetlk, wr, 0, 5, 10),
		lkSet("A", "a2", wr, 20, 10), lkNoPid(lk("A", "a2", cmdOFDGetlk, wr, 0, 0, 0)),
		lkNoPid(lkGet("A", "a2", rd, 0, 0)), lkClose("A", "a2"),
		lkOpen("B", "b", "f", "rw"), lkNoPid(lkGet("B", "b", wr, 0, 0)), lkSet("B", "b", wr, 20, 10),
		lkClose("A", "a1"), lk("B", "b", cmdSetlkw, wr, 0, 0, 10),
	}},
	{"kill -9 drops the holder's locks and frees a waiter", []lkStep{
		lkOpen("A", "a", "f", "rw"), lkSet("A", "a", wr, 0, 0),
		lkOpen("B", "b", "f", "rw"), lkAsync(lk("B", "b", cmdSetlkw, wr, 0, 0, 0)),
		lkBlocked("B"), lkOpen("C", "c", "f", "rw"), lkGet("C", "c", wr, 0, 0),
		lkKill("B"), lkGet("C", "c", wr, 0, 0), lkKill("A"),
		lkSet("C", "c", wr, 0, 0),
	}},
	{"deadlock between two processes", []lkStep{
		lkOpen("A", "a", "f", "rw"), lkOpen("B", "b", "f", "rw"),
		lkSet("A", "a", wr, 0, 10), lkSet("B", "b", wr, 10, 10),
		lkAsync(lk("A", "a", cmdSetlkw, wr, 0, 10, 10)), lkBlocked("A"), lkOpen("C", "c", "f", "r"),
		lkGet("C", "c", rd, 0, 0), lk("B", "b", cmdSetlkw, wr, 0, 0, 10),
		lkSet("B", "b", un, 10, 10), lkAwait("A"),
	}},
}

// TestPOSIXLocksAsBacking runs each lock scenario on a file of the backing
// directory and on the same file through two mounts of it (--allow-other,
// the processes two users), one serving files with passthrough where the
// kernel offers it and one without: every answer must be the backing
// filesystem's.
func TestPOSIXLocksAsBacking(t *testing.T) {
	mnt, backing, srv := testMountWith(t, Options{AllowOther: true})
	for d := filepath.Dir(backing); d != "/" && d != os.TempDir(); d = filepath.Dir(d) {
		if err := os.Chmod(d, 0o755); err != nil {
			t.Fatal(err)
		}
	}
	mnt2 := filepath.Join(filepath.Dir(mnt), "mnt2")
	if err := os.Mkdir(mnt2, 0o755); err != nil {
		t.Fatal(err)
	}
	srv2, err := Mount(context.Background(), Options{Source: backing, Mountpoint: mnt2, AllowOther: true, NoPassthrough: true, Logger: zerolog.Nop()})
	if err != nil {
		t.Fatalf("Mount: %v", err)
	}
	t.Cleanup(func() {
		if err := srv2.Unmount(); err != nil {
			t.Errorf("unmount: %v", err)
			srv2.UnmountLazy()
		}
		srv2.Wait()
	})
	mounts := []struct {
		name string
		dir  string
		srv  *Server
	}{{"passthrough", mnt, srv}, {"no passthrough", mnt2, srv2}}
	for i, sc := range lockScenarios {
		t.Run(sc.name, func(t *testing.T) {
			sub := fmt.Sprintf("s%d", i)
			if err := os.Mkdir(filepath.Join(backing, sub), 0o755); err != nil {
				t.Fatal(err)
			}
			if err := os.WriteFile(filepath.Join(backing, sub, "f"), make([]byte, 100), 0o666); err != nil {
				t.Fatal(err)
			}
			if err := os.Chmod(filepath.Join(backing, sub, "f"), 0o666); err != nil {
				t.Fatal(err)
			}
			want := runLockScenario(t, filepath.Join(backing, sub), sc.steps, blockedOnBacking)
			for _, m := range mounts {
				got := runLockScenario(t, filepath.Join(m.dir, sub), sc.steps, func(pid int) bool {
					return m.srv.m.lockWaits.waiting(uint32(pid))
				})
				if strings.Join(got, "\n") != strings.Join(want, "\n") {
					t.Errorf("through the mount, %s (-) vs on the backing filesystem (+):\n%s", m.name, lockDiff(got, want))
				}
			}
		})
	}
	if ok, _ := srv.Passthrough(); ok && srv.Stats().Passthrough == 0 {
		t.Errorf("the kernel offers passthrough, but no file was opened with it (%+v)", srv.Stats())
	}
}

// blockedOnBacking reports whether process pid waits for a lock of the
// local filesystem: /proc/locks lists its request after "->".
func blockedOnBacking(pid int) bool {
	b, err := os.ReadFile("/proc/locks")
	if err != nil {
		return false
	}
	for _, l := range strings.Split(string(b), "\n") {
		if f := strings.Fields(l); len(f) > 5 && f[1] == "->" && f[5] == fmt.Sprint(pid) {
			return true
		}
	}
	return false
}

// lockDiff lists two transcripts side by side, marking the lines that
// differ.
func lockDiff(got, want []string) string {
	var b strings.Builder
	for i := 0; i < max(len(got), len(want)); i++ {
		g, w := "", ""
		if i < len(got) {
			g = got[i]
		}
		if i < len(want) {
			w = want[i]
		}
		if g == w {
			fmt.Fprintf(&b, "  %s\n", g)
		} else {
			fmt.Fprintf(&b, "- %s\n+ %s\n", g, w)
		}
	}
	return b.String()
}

// TestLockWaitersHoldNoThreads blocks lockWaiters processes in F_SETLKW
// and blocking flock through the mount: the daemon must not hold a thread
// for each (go-fuse's loopback blocked one in fcntl or flock per waiter,
// so enough waiters of one user crashed the daemon for everyone at Go's
// 10000-thread limit), and each waiter must get its lock once the holder
// lets go.
func TestLockWaitersHoldNoThreads(t *testing.T) {
	const lockWaiters = 24
	mnt, _, srv := testMountWith(t, Options{})
	var holders []*os.File
	for _, name := range []string{"posix", "flock"} {
		f, err := os.OpenFile(filepath.Join(mnt, name), os.O_RDWR|os.O_CREATE, 0o644)
		if err != nil {
			t.Fatal(err)
		}
		defer f.Close()
		holders = append(holders, f)
	}
	wl := unix.Flock_t{Type: unix.F_WRLCK}
	if err := unix.FcntlFlock(holders[0].Fd(), unix.F_SETLK, &wl); err != nil {
		t.Fatal(err)
	}
	if err := unix.Flock(int(holders[1].Fd()), unix.LOCK_EX); err != nil {
		t.Fatal(err)
	}
	before := threadCount(t)
	var waiters []*exec.Cmd
	defer func() {
		for _, c := range waiters {
			c.Process.Kill()
			c.Wait()
		}
	}()
	for i := range lockWaiters {
		kind := []string{"posix", "flock"}[i%2]
		c := exec.Command(os.Args[0], "-test.run=^TestLockWaiterProcess$")
		c.Env = append(os.Environ(), "GDSFS_LOCK_WAITER="+filepath.Join(mnt, kind), "GDSFS_LOCK_WAITER_KIND="+kind)
		c.Stderr = os.Stderr
		if err := c.Start(); err != nil {
			t.Fatal(err)
		}
		waiters = append(waiters, c)
	}
	for start := time.Now(); ; time.Sleep(5 * time.Millisecond) {
		setlkw, flocks := srv.m.lockWaits.count()
		if setlkw == lockWaiters/2 && flocks == lockWaiters/2 {
			break
		}
		if time.Since(start) > lockAgentPatience {
			t.Fatalf("%d F_SETLKW and %d flock waiters waiting, want %d each", setlkw, flocks, lockWaiters/2)
		}
	}
	grown := threadCount(t) - before
	t.Logf("threads %d before, %d grown with %d waiters", before, grown, lockWaiters)
	if grown >= lockWaiters/2 {
		t.Errorf("the daemon's threads grew by %d for %d blocked lock waiters", grown, lockWaiters)
	}
	holders[0].Close()
	holders[1].Close()
	for _, c := range waiters {
		done := make(chan error, 1)
		go func() { done <- c.Wait() }()
		select {
		case err := <-done:
			if err != nil {
				t.Errorf("waiter: %v", err)
			}
		case <-time.After(lockAgentPatience):
			t.Fatal("a waiter never got its lock")
		}
	}
	waiters = nil
}

// TestLockWaiterProcess is TestLockWaitersHoldNoThreads' waiter: it takes
// a blocking lock of GDSFS_LOCK_WAITER and exits.
func TestLockWaiterProcess(t *testing.T) {
	p := os.Getenv("GDSFS_LOCK_WAITER")
	if p == "" {
		t.Skip("run by TestLockWaitersHoldNoThreads")
	}
	f, err := os.OpenFile(p, os.O_RDWR, 0)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	if os.Getenv("GDSFS_LOCK_WAITER_KIND") == "flock" {
		err = unix.Flock(int(f.Fd()), unix.LOCK_EX)
	} else {
		wl := unix.Flock_t{Type: unix.F_WRLCK}
		err = unix.FcntlFlock(f.Fd(), unix.F_SETLKW, &wl)
	}
	if err != nil {
		t.Fatal(err)
	}
}

// threadCount is this process's (the daemon's) thread count.
func threadCount(t *testing.T) int {
	b, err := os.ReadFile("/proc/self/status")
	if err != nil {
		t.Fatal(err)
	}
	for _, l := range strings.Split(string(b), "\n") {
		if n, ok := strings.CutPrefix(l, "Threads:"); ok {
			var v int
			fmt.Sscan(n, &v)
			return v
		}
	}
	t.Fatal("no Threads in /proc/self/status")
	return 0
}
