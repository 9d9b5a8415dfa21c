package fs

import (
	"bufio"
	"errors"
	"os"
	"os/exec"
	"path/filepath"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/rs/zerolog"
)

func TestNewOpenBudget(t *testing.T) {
	cases := []struct {
		limit, perUID             int64
		wantReserve, wantPerUID   int64
		wantTotalOpenForEveryUser int64
	}{
		{limit: 256, wantReserve: 64, wantPerUID: 48, wantTotalOpenForEveryUser: 192},
		{limit: 1024, wantReserve: 128, wantPerUID: 224, wantTotalOpenForEveryUser: 896},
		{limit: 524288, wantReserve: 8192, wantPerUID: 129024, wantTotalOpenForEveryUser: 516096},
		{limit: 1048576, wantReserve: 8192, wantPerUID: 260096, wantTotalOpenForEveryUser: 1040384},
		{limit: 1048576, perUID: 1000, wantReserve: 8192, wantPerUID: 1000, wantTotalOpenForEveryUser: 1040384},
		{limit: 16, wantReserve: 64, wantPerUID: 1, wantTotalOpenForEveryUser: 1},
	}
	for _, c := range cases {
		b := newOpenBudget(c.limit, c.perUID, zerolog.Nop())
		if b.reserve != c.wantReserve || b.perUID != c.wantPerUID || b.total != c.wantTotalOpenForEveryUser {
			t.Errorf("limit %d, per uid %d: reserve %d, per uid %d, total %d; want %d, %d, %d", c.limit, c.perUID,
				b.reserve, b.perUID, b.total, c.wantReserve, c.wantPerUID, c.wantTotalOpenForEveryUser)
		}
	}
}

// TestOpenBudgetAccounting charges and releases in every order the open
// paths do: a uid stops at its budget with EMFILE while another goes on,
// every uid together stop short of the reserve with ENFILE, and a refusal
// charges nothing.
func TestOpenBudgetAccounting(t *testing.T) {
	b := newOpenBudget(256, 0, zerolog.Nop()) // 48 per uid, 192 in all
	steps := []struct {
		uid     uint32
		n       int64 // > 0 acquire, < 0 release
		times   int
		want    syscall.Errno
		wantUID int64 // uid's charge after the step
	}{
		{uid: 1, n: 1, times: 48, wantUID: 48},
		{uid: 1, n: 1, times: 3, want: syscall.EMFILE, wantUID: 48},
		{uid: 1, n: 2, want: syscall.EMFILE, wantUID: 48},
		{uid: 2, n: 2, times: 24, wantUID: 48},
		{uid: 1, n: -1, wantUID: 47},
		{uid: 1, n: 1, wantUID: 48},
		{uid: 3, n: 48, wantUID: 48},
		{uid: 4, n: 48, wantUID: 48}, // 192: every uid together at the total
		{uid: 5, n: 1, want: syscall.ENFILE, wantUID: 0},
		{uid: 4, n: -48, wantUID: 0},
		{uid: 5, n: 1, wantUID: 1},
		{uid: 5, n: -1, wantUID: 0},
	}
	for i, s := range steps {
		for range max(s.times, 1) {
			if s.n < 0 {
				b.release(s.uid, -s.n)
				continue
			}
			if got := b.acquire(s.uid, s.n); got != s.want {
				t.Fatalf("step %d: uid %d acquire %d: %v, want %v", i, s.uid, s.n, got, s.want)
			}
		}
		if got := b.of(s.uid).open.Load(); got != s.wantUID {
			t.Fatalf("step %d: uid %d holds %d, want %d", i, s.uid, got, s.wantUID)
		}
	}
	st := b.stats()
	if st.Open != 48+48+48 || st.Refused != 5 || len(st.UIDs) != 4 || st.UIDs[0].UID != 1 || st.UIDs[0].Refused != 4 {
		t.Errorf("stats %+v", st)
	}
}

// TestOpenBudgetConcurrent charges and releases from many goroutines of a
// few uids at once (run it with -race): nothing is lost or left over.
func TestOpenBudgetConcurrent(t *testing.T) {
	b := newOpenBudget(1<<20, 64, zerolog.Nop())
	var wg sync.WaitGroup
	for g := range 16 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			uid := uint32(g % 3)
			for range 2000 {
				if b.acquire(uid, 1) == 0 {
					b.release(uid, 1)
				}
			}
		}()
	}
	wg.Wait()
	if st := b.stats(); st.Open != 0 || len(st.UIDs) != 0 && st.Refused == 0 {
		t.Errorf("after balanced charges: %+v", st)
	}
	for uid := range uint32(3) {
		if n := b.of(uid).open.Load(); n != 0 {
			t.Errorf("uid %d holds %d", uid, n)
		}
	}
}

// waitOpenBudget waits (up to 20s) until every uid's opens hold want: the
// kernel sends RELEASE after the last close, asynchronously.
func waitOpenBudget(t *testing.T, srv *Server, want int64, what string) {
	t.Helper()
	deadline := time.Now().Add(20 * time.Second)
	for {
		st := srv.OpenStats()
		if st.Open == want {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("%s: the opens hold %d descriptors, want %d (%+v)", what, st.Open, want, st)
		}
		time.Sleep(5 * time.Millisecond) // polling: RELEASE has no event a test can wait on
	}
}

// TestOpenBudgetReleased opens through a real mount in every way that
// charges the budget and ends each in every way an open ends: a RELEASE
// (close), a failed open, a refused open, a process killed while it holds
// files, and processes killed while their opens are in flight. The charge
// always goes back to zero.
func TestOpenBudgetReleased(t *testing.T) {
	ctl := newFakeControl()
	mnt, backing, srv := testMountWith(t, Options{Control: ctl, MaxOpenPerUser: 40, EntryTimeout: time.Hour})
	for _, name := range []string{"a", "gone"} {
		if err := os.WriteFile(filepath.Join(backing, name), []byte("contents"), 0o644); err != nil {
			t.Fatal(err)
		}
	}
	if err := os.Mkdir(filepath.Join(backing, "d"), 0o755); err != nil {
		t.Fatal(err)
	}
	a := filepath.Join(mnt, "a")
	open := func(p string) *os.File {
		t.Helper()
		f, err := os.Open(p)
		if err != nil {
			t.Fatal(err)
		}
		return f
	}

	// RELEASE of files, a file with the control path's duplicate, a
	// directory and a control session.
	f1, f2 := open(a), open(a)
	waitOpenBudget(t, srv, 2, "two files open")
	if _, err := ioctl(f1.Fd(), iowr(2, 16), make([]byte, 16)); err != nil {
		t.Fatalf("control ioctl: %v", err)
	}
	waitOpenBudget(t, srv, 3, "one with the control path's descriptor")
	// A tty probe costs nothing.
	if _, err := ioctl(f2.Fd(), 0x5401, make([]byte, 64)); !errors.Is(err, syscall.ENOTTY) {
		t.Fatalf("TCGETS: %v, want ENOTTY", err)
	}
	d := open(filepath.Join(mnt, "d"))
	if _, err := d.Readdirnames(-1); err != nil {
		t.Fatal(err)
	}
	s := open(filepath.Join(mnt, controlName))
	waitOpenBudget(t, srv, 3+dirCharge+1, "files, a directory and a session")
	for _, f := range []*os.File{f1, f2, d, s} {
		f.Close()
	}
	waitOpenBudget(t, srv, 0, "all closed")

	// A failed open: the name is cached by the kernel (EntryTimeout),
	// the backing file gone.
	if _, err := os.Stat(filepath.Join(mnt, "gone")); err != nil {
		t.Fatal(err)
	}
	if err := os.Remove(filepath.Join(backing, "gone")); err != nil {
		t.Fatal(err)
	}
	if f, err := os.Open(filepath.Join(mnt, "gone")); err == nil {
		f.Close()
		t.Fatal("open of a file removed behind the mount worked")
	}
	ctl.mu.Lock()
	ctl.refuseSessions = syscall.EACCES
	ctl.mu.Unlock()
	if f, err := os.Open(filepath.Join(mnt, controlName)); err == nil {
		f.Close()
		t.Fatal("refused session opened")
	}
	waitOpenBudget(t, srv, 0, "after failed opens")

	// Refused opens (EMFILE past the budget) charge nothing.
	var held []*os.File
	for range 40 {
		held = append(held, open(a))
	}
	if f, err := os.Open(a); !errors.Is(err, syscall.EMFILE) {
		f.Close()
		t.Fatalf("open past the budget: %v, want EMFILE", err)
	}
	if err := os.Mkdir(filepath.Join(mnt, "x"), 0o755); err != nil {
		t.Fatalf("mkdir at the budget: %v", err) // no open: not charged
	}
	for _, f := range held {
		f.Close()
	}
	waitOpenBudget(t, srv, 0, "after the refusals")

	// A process killed while it holds files.
	sh := exec.Command("/bin/sh", "-c", `exec 3<"$1" 4<"$1"; echo ready; exec sleep 60`, "sh", a)
	out, err := sh.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	if err := sh.Start(); err != nil {
		t.Fatal(err)
	}
	if line, err := bufio.NewReader(out).ReadString('\n'); err != nil || line != "ready\n" {
		t.Fatalf("holder: %q, %v", line, err)
	}
	waitOpenBudget(t, srv, 2, "held by a process")
	sh.Process.Kill()
	sh.Wait()
	waitOpenBudget(t, srv, 0, "after its kill")

	// Processes killed while they open and close in a loop: some die
	// with an OPEN in flight, which the kernel abandons.
	for range 5 {
		sh := exec.Command("/bin/sh", "-c", `echo go; while :; do exec 3<"$1"; exec 3<&-; done`, "sh", a)
		out, err := sh.StdoutPipe()
		if err != nil {
			t.Fatal(err)
		}
		if err := sh.Start(); err != nil {
			t.Fatal(err)
		}
		bufio.NewReader(out).ReadString('\n')
		sh.Process.Kill()
		sh.Wait()
	}
	waitOpenBudget(t, srv, 0, "after processes killed while opening")
	if st := srv.OpenStats(); st.PerUID != 40 || st.Refused != 1 {
		t.Errorf("stats %+v, want 40 per uid and one refusal", st)
	}
}

// BenchmarkOpenBudget is the budget's cost per open and close, from
// parallel goroutines of one uid (the contended case: one user's
// DataLoader workers).
func BenchmarkOpenBudget(b *testing.B) {
	ob := newOpenBudget(1<<20, 0, zerolog.Nop())
	b.RunParallel(func(pb *testing.PB) {
		for pb.Next() {
			if ob.acquire(1000, 1) == 0 {
				ob.release(1000, 1)
			}
		}
	})
}
