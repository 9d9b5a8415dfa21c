package integration

import (
	"bufio"
	"bytes"
	"context"
	"encoding/binary"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"runtime"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/gdsfs/gdsfs/ctl"
	"github.com/gdsfs/gdsfs/ctlserver"
	"github.com/gdsfs/gdsfs/internal/xattr"
)

// Hostile local users (issue 12): each test runs the attack as a non-root
// uid in a child process (TestHostileChild) against a --allow-other mount
// and checks what the daemon gives away or how it holds up.

const (
	attackerUID = 10001
	victimUID   = 10002
)

// TestHostileChild is not a test: the hostile tests re-exec the test binary
// with GDSFS_HOSTILE_CHILD set to run one attacker or bystander process.
func TestHostileChild(t *testing.T) {
	mode, env := childMode(t, "HOSTILE")
	var err error
	switch mode {
	case "write-only":
		err = childWriteOnly(env("MNT"), env("FILE"))
	case "fifo-swap":
		n, _ := strconv.Atoi(env("N"))
		err = childFIFOSwap(env("MNT"), env("DIR"), n)
	case "bystander":
		err = childBystander(env("MNT"), env("FILE"))
	case "stats":
		err = childStats(env("MNT"), env("WAIT") != "")
	case "info":
		n, _ := strconv.Atoi(env("N"))
		err = childInfo(env("FILE"), n)
	case "xattr-swap":
		err = childXattrSwap(env("MNT"), env("BACKING"), env("SECRET"))
	default:
		err = fmt.Errorf("unknown child mode %q", mode)
	}
	childExit(err)
}

// hostile is a child of the hostile tests (TestHostileChild) running
// bin (worldExecutable's copy, one per test, made before any child starts)
// as uid.
func hostile(bin, mode string, uid uint32, env map[string]string) child {
	return child{bin: bin, family: "HOSTILE", mode: mode, env: env, uid: uid}
}

// mkdirOwned makes a directory owned by uid.
func mkdirOwned(t testing.TB, p string, uid int) {
	t.Helper()
	if err := os.Mkdir(p, 0o755); err != nil {
		t.Fatal(err)
	}
	if err := os.Chown(p, uid, uid); err != nil {
		t.Fatal(err)
	}
}

// TestHostileWriteOnlyDescriptor: a user holding only an O_WRONLY
// descriptor of a file it cannot read (mode 0200) gets EBADF from READ
// (a cold read large enough for the O_DIRECT path included), READ_NAMES
// and INDEX, and learns nothing of the contents (item 3).
func TestHostileWriteOnlyDescriptor(t *testing.T) {
	bin := worldExecutable(t, os.Args[0])
	m := startMount(t, mountOpts{Daemon: true, OtherUIDs: true, SlabBytes: 64 << 20, BudgetBytes: 128 << 20})
	// A tar shard (INDEX would list its members) of 40 MiB: larger than
	// the 32 MiB from which a cold read goes through O_DIRECT.
	p := filepath.Join(m.backing, "secret.tar")
	indexTar(t, p, 4)
	f, err := os.OpenFile(p, os.O_WRONLY|os.O_APPEND, 0)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := f.Write(bytes.Repeat([]byte("SECRET!!"), 40<<20/8)); err != nil {
		t.Fatal(err)
	}
	if err := f.Sync(); err != nil {
		t.Fatal(err)
	}
	// Out of the page cache, so the engine takes its O_DIRECT path.
	if err := unix.Fadvise(int(f.Fd()), 0, 0, unix.FADV_DONTNEED); err != nil {
		t.Fatal(err)
	}
	f.Close()
	if err := os.Chown(p, attackerUID, attackerUID); err != nil {
		t.Fatal(err)
	}
	if err := os.Chmod(p, 0o200); err != nil {
		t.Fatal(err)
	}
	out := hostile(bin, "write-only", attackerUID, map[string]string{"MNT": m.mnt, "FILE": filepath.Join(m.mnt, "secret.tar")}).mustRun(t, time.Minute)
	for _, op := range []string{"open-read", "index", "read-small", "read-cold", "read-names"} {
		want := op + " EBADF"
		if op == "open-read" {
			want = op + " EACCES"
		}
		if !strings.Contains(out, want+"\n") {
			t.Errorf("%s through a write-only descriptor: want %q in the child's report:\n%s", op, want, out)
		}
	}
	if strings.Contains(out, "SECRET") {
		t.Errorf("the child saw the file's contents:\n%s", out)
	}
}

// childWriteOnly opens file write-only and tries every request that would
// read it, reporting "<op> <errno name>" per line.
func childWriteOnly(mnt, file string) error {
	ctx := context.Background()
	report := func(op string, err error) {
		var errno syscall.Errno
		switch {
		case err == nil:
			fmt.Println(op, "OK")
		case errors.As(err, &errno):
			fmt.Println(op, unix.ErrnoName(errno))
		default:
			fmt.Println(op, err)
		}
	}
	_, err := os.Open(file)
	report("open-read", err)
	f, err := os.OpenFile(file, os.O_WRONLY, 0)
	if err != nil {
		return err
	}
	defer f.Close()
	cl, err := ctl.OpenSession(mnt)
	if err != nil {
		return err
	}
	defer cl.Close()
	doc, err := cl.Index(ctx, f)
	report("index", err)
	if err == nil {
		fmt.Printf("index leaked: %.200s\n", doc)
	}
	readAndShow := func(op string, ranges []ctl.Range) {
		ls, err := cl.Read(ctx, f, ctl.HostDevice, ranges)
		report(op, err)
		for _, l := range ls {
			if b, err := cl.Bytes(ctx, l); err == nil {
				fmt.Printf("%s leaked: %q\n", op, b[len(b)-min(len(b), 16):])
			}
		}
	}
	readAndShow("read-small", []ctl.Range{{Offset: 0, Length: 4096}})
	readAndShow("read-cold", []ctl.Range{{Offset: 0, Length: 40 << 20}})
	ls, err := cl.ReadNames(ctx, f, ctl.HostDevice, []string{"sample/0"})
	report("read-names", err)
	if err == nil {
		fmt.Printf("read-names leaked %d leases\n", len(ls))
	}
	return nil
}

// TestHostileFIFOSwap: several users open a file O_WRONLY, rename it
// through the mount, put a FIFO at the old name and ask for INDEX, many
// times at once (item 7). The daemon must neither open the FIFO nor grow
// its threads without bound, and must keep serving another uid.
func TestHostileFIFOSwap(t *testing.T) {
	bin := worldExecutable(t, os.Args[0])
	if gdsfsBin(t) == "" {
		t.Skip("GDSFS_BIN not set (make build)")
	}
	backing, mnt := t.TempDir(), t.TempDir()
	for _, d := range []string{filepath.Dir(mnt), filepath.Dir(backing)} {
		os.Chmod(d, 0o755)
	}
	os.Chmod(backing, 0o755)
	os.Chmod(mnt, 0o755)
	indexTar(t, filepath.Join(backing, "shared.tar"), 8)
	const attackers, perAttacker = 4, 40
	for i := range attackers {
		mkdirOwned(t, filepath.Join(backing, fmt.Sprintf("a%d", i)), attackerUID)
	}
	d := startBinDaemon(t, backing, mnt, "--engine", "host", "--host-pool", "64MiB", "--slab-size", "4MiB", "--allow-other")
	before := procStatus(t, d.pid())["Threads"]

	var wg sync.WaitGroup
	outs := make([]string, attackers)
	errs := make([]error, attackers)
	for i := range attackers {
		wg.Go(func() {
			outs[i], errs[i] = hostile(bin, "fifo-swap", attackerUID, map[string]string{
				"MNT": mnt, "DIR": filepath.Join(mnt, fmt.Sprintf("a%d", i)), "N": strconv.Itoa(perAttacker)}).run(t, time.Minute)
		})
	}
	wg.Wait()
	peak := procStatus(t, d.pid())["Threads"]
	for i := range attackers {
		if errs[i] != nil {
			t.Errorf("attacker %d: %v\n%s", i, errs[i], outs[i])
		}
	}
	// Another uid is still served, promptly and correctly.
	out := hostile(bin, "bystander", victimUID, map[string]string{"MNT": mnt, "FILE": filepath.Join(mnt, "shared.tar")}).mustRun(t, time.Minute)
	if !strings.Contains(out, "bystander ok") {
		t.Errorf("bystander: %s", out)
	}
	after := procStatus(t, d.pid())["Threads"]
	t.Logf("daemon threads: %d before, %d after %d attacks, %d after the bystander", before, peak, attackers*perAttacker, after)
	// Threads are the Go runtime's (up to one per CPU running, go-fuse's
	// at most 16 request readers) plus those blocked in syscalls: a daemon
	// that blocks per request grows by one per attack (160 here).
	if bound := before + 16 + 2*runtime.NumCPU() + 16; peak > bound || after > bound {
		t.Errorf("daemon threads grew from %d to %d (%d after the bystander), bound %d: requests block in the daemon", before, peak, after, bound)
	}
	if !d.running() {
		t.Fatal("daemon died")
	}
}

// childFIFOSwap runs n swaps in dir concurrently: every INDEX must be
// answered (EBADF: the descriptor is write-only) within 20s.
func childFIFOSwap(mnt, dir string, n int) error {
	cl, err := ctl.OpenSession(mnt)
	if err != nil {
		return err
	}
	defer cl.Close()
	results := make(chan error, n)
	for i := range n {
		p := filepath.Join(dir, fmt.Sprintf("f%d", i))
		f, err := os.OpenFile(p, os.O_WRONLY|os.O_CREATE|os.O_EXCL, 0o600)
		if err != nil {
			return err
		}
		defer f.Close()
		if _, err := f.Write(make([]byte, 10240)); err != nil {
			return err
		}
		if err := os.Rename(p, p+".moved"); err != nil {
			return err
		}
		if err := syscall.Mkfifo(p, 0o600); err != nil {
			return err
		}
		go func() {
			ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
			defer cancel()
			_, err := cl.Index(ctx, f)
			results <- err
		}()
	}
	deadline := time.After(20 * time.Second)
	for i := range n {
		select {
		case err := <-results:
			if !errors.Is(err, syscall.EBADF) {
				return fmt.Errorf("INDEX on a write-only descriptor: %v, want EBADF", err)
			}
		case <-deadline:
			return fmt.Errorf("%d of %d INDEX requests unanswered after 20s (the daemon blocks)", n-i, n)
		}
	}
	fmt.Println("fifo-swap answered", n)
	return nil
}

// childBystander checks the mount serves this uid: stat, read, HELLO,
// READ and INDEX of file, within 20s.
func childBystander(mnt, file string) error {
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	done := make(chan error, 1)
	go func() {
		want, err := os.ReadFile(file)
		if err != nil {
			done <- err
			return
		}
		f, err := os.Open(file)
		if err != nil {
			done <- err
			return
		}
		defer f.Close()
		cl, err := ctl.OpenSession(mnt)
		if err != nil {
			done <- err
			return
		}
		defer cl.Close()
		ls, err := cl.Read(ctx, f, ctl.HostDevice, []ctl.Range{{Offset: 0, Length: 4096}})
		if err != nil {
			done <- err
			return
		}
		b, err := cl.Bytes(ctx, ls[0])
		if err != nil || !bytes.Equal(b, want[:4096]) {
			done <- fmt.Errorf("READ: %v, bytes equal %v", err, bytes.Equal(b, want[:min(len(want), 4096)]))
			return
		}
		if _, err := cl.Index(ctx, f); err != nil {
			done <- err
			return
		}
		done <- nil
	}()
	select {
	case err := <-done:
		if err != nil {
			return err
		}
	case <-ctx.Done():
		return errors.New("the mount did not answer within 20s")
	}
	fmt.Println("bystander ok")
	return nil
}

// procStatus reads the numeric fields of /proc/<pid>/status (kB for sizes).
func procStatus(t testing.TB, pid int) map[string]int {
	t.Helper()
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/status", pid))
	if err != nil {
		t.Fatal(err)
	}
	m := make(map[string]int)
	sc := bufio.NewScanner(bytes.NewReader(b))
	for sc.Scan() {
		k, v, ok := strings.Cut(sc.Text(), ":")
		if !ok {
			continue
		}
		fields := strings.Fields(v)
		if len(fields) == 0 {
			continue
		}
		if n, err := strconv.Atoi(fields[0]); err == nil {
			m[k] = n
		}
	}
	return m
}

// TestHostileStatsIsolation: user.gdsfs.stats and STATUS show a non-root
// user its own sessions only (item 6), with totals; root sees everyone.
func TestHostileStatsIsolation(t *testing.T) {
	bin := worldExecutable(t, os.Args[0])
	m := startMount(t, mountOpts{Daemon: true, OtherUIDs: true, SlabBytes: 1 << 20, BudgetBytes: 64 << 20})
	// uid 10001 holds a lease while uid 10002 looks.
	holder := hostile(bin, "stats", attackerUID, map[string]string{"MNT": m.mnt, "WAIT": "1"}).cmd(t)
	stdin, err := holder.StdinPipe()
	if err != nil {
		t.Fatal(err)
	}
	stdout, err := holder.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	var holderErr bytes.Buffer
	holder.Stderr = &holderErr
	if err := holder.Start(); err != nil {
		t.Fatal(err)
	}
	defer holder.Wait()
	defer stdin.Close()
	rd := bufio.NewReader(stdout)
	if line, err := rd.ReadString('\n'); err != nil || !strings.HasPrefix(line, "holding") {
		t.Fatalf("holder: %q %v\n%s", line, err, holderErr.String())
	}

	out := hostile(bin, "stats", victimUID, map[string]string{"MNT": m.mnt}).mustRun(t, time.Minute)
	for _, doc := range strings.Split(strings.TrimSpace(out), "\n") {
		if !strings.HasPrefix(doc, "{") {
			continue
		}
		checkOwnStats(t, doc, victimUID, 2*4096) // both users' leases
	}
	root, err := unixGetxattr(m.mnt, "user.gdsfs.stats")
	if err != nil {
		t.Fatal(err)
	}
	var st ctlserver.Stats
	if err := json.Unmarshal(root, &st); err != nil {
		t.Fatal(err)
	}
	if !hasUID(st, attackerUID) {
		t.Errorf("root's user.gdsfs.stats does not show uid %d's session: %s", attackerUID, root)
	}
	stdin.Close()
	rest, _ := io.ReadAll(rd)
	if err := holder.Wait(); err != nil {
		t.Fatalf("holder: %v\n%s", err, holderErr.String())
	}
	for _, doc := range strings.Split(strings.TrimSpace(string(rest)), "\n") {
		if strings.HasPrefix(doc, "{") {
			checkOwnStats(t, doc, attackerUID, -1)
		}
	}
}

// checkOwnStats checks that a stats document seen by uid lists only uid's
// sessions and uids, and at least one session of its own; minLeased > 0 is
// the pool's total (all users) the document must still report at least.
func checkOwnStats(t *testing.T, doc string, uid uint32, minLeased int64) {
	t.Helper()
	var st ctlserver.Stats
	if err := json.Unmarshal([]byte(doc), &st); err != nil {
		t.Fatalf("stats of uid %d: %v: %s", uid, err, doc)
	}
	own := 0
	for _, s := range st.Pool.Sessions {
		if s.UID != uid {
			t.Errorf("uid %d sees a session of uid %d: %s", uid, s.UID, doc)
		}
		own++
	}
	for _, u := range st.Pool.UIDs {
		if u.UID != uid {
			t.Errorf("uid %d sees the figures of uid %d: %s", uid, u.UID, doc)
		}
	}
	if own == 0 {
		t.Errorf("uid %d does not see its own session: %s", uid, doc)
	}
	if st.Sessions < 1 || len(st.Pool.Devices) == 0 {
		t.Errorf("uid %d lacks the totals: %s", uid, doc)
	}
	if minLeased > 0 && st.Pool.Devices[0].LeasedBytes < minLeased {
		t.Errorf("uid %d sees %d leased bytes in total, want the pool's total (>= %d)", uid, st.Pool.Devices[0].LeasedBytes, minLeased)
	}
}

func hasUID(st ctlserver.Stats, uid uint32) bool {
	for _, s := range st.Pool.Sessions {
		if s.UID == uid {
			return true
		}
	}
	return false
}

func unixGetxattr(p, name string) ([]byte, error) {
	b, err := xattr.Get(p, name)
	if err != nil {
		return nil, fmt.Errorf("getxattr %s %s: %w", p, name, err)
	}
	return b, nil
}

// childStats holds a lease and prints user.gdsfs.stats and STATUS (one
// JSON document per line); with wait, it first prints "holding" and waits
// for stdin to close.
func childStats(mnt string, wait bool) error {
	ctx := context.Background()
	cl, err := ctl.OpenSession(mnt)
	if err != nil {
		return err
	}
	defer cl.Close()
	if _, err := cl.Alloc(ctx, ctl.HostDevice, 4096); err != nil {
		return err
	}
	if wait {
		fmt.Println("holding")
		io.Copy(io.Discard, os.Stdin)
	}
	x, err := unixGetxattr(mnt, "user.gdsfs.stats")
	if err != nil {
		return err
	}
	s, err := cl.Status(ctx)
	if err != nil {
		return err
	}
	fmt.Printf("%s\n%s\n", x, s)
	return nil
}

// craftSafetensors writes a valid safetensors file whose header is about
// headerBytes of zero-length tensors (the costliest header to parse).
func craftSafetensors(t testing.TB, p string, headerBytes int) {
	t.Helper()
	var hdr bytes.Buffer
	hdr.Grow(headerBytes + 100)
	hdr.WriteByte('{')
	for i := 0; hdr.Len() < headerBytes; i++ {
		if i > 0 {
			hdr.WriteByte(',')
		}
		fmt.Fprintf(&hdr, `"t%08d":{"dtype":"U8","shape":[0],"data_offsets":[0,0]}`, i)
	}
	hdr.WriteByte('}')
	var n [8]byte
	binary.LittleEndian.PutUint64(n[:], uint64(hdr.Len()))
	if err := os.WriteFile(p, append(n[:], hdr.Bytes()...), 0o644); err != nil {
		t.Fatal(err)
	}
}

// TestHostileParserMemory: users asking user.gdsfs.info of a crafted
// safetensors file with a 97 MB header, four at once and again, cost the
// daemon little memory, are answered with the reason, and the file is
// parsed (refused) once (item 8).
func TestHostileParserMemory(t *testing.T) {
	bin := worldExecutable(t, os.Args[0])
	if gdsfsBin(t) == "" {
		t.Skip("GDSFS_BIN not set (make build)")
	}
	backing, mnt := t.TempDir(), t.TempDir()
	for _, d := range []string{filepath.Dir(mnt), filepath.Dir(backing), backing, mnt} {
		os.Chmod(d, 0o755)
	}
	craftSafetensors(t, filepath.Join(backing, "crafted.safetensors"), 97_000_000)
	d := startBinDaemon(t, backing, mnt, "--engine", "host", "--host-pool", "64MiB", "--slab-size", "4MiB", "--allow-other")
	before := procStatus(t, d.pid())
	const users, rounds = 4, 2
	var wg sync.WaitGroup
	outs := make([]string, users)
	for i := range users {
		wg.Go(func() {
			outs[i] = hostile(bin, "info", attackerUID, map[string]string{"FILE": filepath.Join(mnt, "crafted.safetensors"), "N": strconv.Itoa(rounds)}).mustRun(t, time.Minute)
		})
	}
	wg.Wait()
	after := procStatus(t, d.pid())
	grew := after["VmHWM"] - before["VmRSS"]
	t.Logf("daemon memory: VmRSS %d kB before, VmHWM %d kB after %d info requests (+%d kB)", before["VmRSS"], after["VmHWM"], users*rounds, grew)
	if grew > 128<<10 {
		t.Errorf("daemon peak memory grew by %d MiB for %d user.gdsfs.info requests on a crafted file (bound 128 MiB)", grew>>10, users*rounds)
	}
	for i, out := range outs {
		if !strings.Contains(out, "16 MiB") {
			t.Errorf("user %d: user.gdsfs.info does not say why the file has no index:\n%s", i, out)
		}
	}
	root, err := unixGetxattr(mnt, "user.gdsfs.stats")
	if err != nil {
		t.Fatal(err)
	}
	var st ctlserver.Stats
	if err := json.Unmarshal(root, &st); err != nil {
		t.Fatal(err)
	}
	if st.Index == nil || st.Index.Parses != 1 {
		t.Errorf("index parses after %d requests of one file: %+v, want 1 (the refusal is cached)", users*rounds, st.Index)
	}
}

// childInfo reads user.gdsfs.info of file n times and prints the last.
func childInfo(file string, n int) error {
	var doc []byte
	for range n {
		var err error
		if doc, err = unixGetxattr(file, "user.gdsfs.info"); err != nil {
			return err
		}
	}
	fmt.Printf("%s\n", doc)
	return nil
}

// TestHostileXattrSwap: a user who can write a directory of the backing
// tree swaps a file the kernel already knows for a symlink to root's 0600
// shard, then for a FIFO, and asks for the xattrs through the mount
// (items 4 and 7, daemon side). The daemon must neither serve the root
// file's index nor block.
func TestHostileXattrSwap(t *testing.T) {
	bin := worldExecutable(t, os.Args[0])
	// The kernel keeps the name's node and attributes for the whole test,
	// so the xattr requests reach the daemon for the node it knows.
	m := startMount(t, mountOpts{Daemon: true, OtherUIDs: true, EntryTimeout: time.Hour, AttrTimeout: time.Hour})
	secret := filepath.Join(m.backing, "secret.tar")
	indexTar(t, secret, 3)
	if err := os.Chmod(secret, 0o600); err != nil {
		t.Fatal(err)
	}
	mkdirOwned(t, filepath.Join(m.backing, "u"), attackerUID)
	out := hostile(bin, "xattr-swap", attackerUID, map[string]string{"MNT": m.mnt, "BACKING": m.backing, "SECRET": secret}).mustRun(t, time.Minute)
	// The daemon answers ESTALE (the name holds another file than the
	// node); the kernel then looks the name up again and answers for what
	// is there now: root's 0600 file through the symlink (EACCES), a FIFO.
	for _, want := range []string{"symlink index EACCES", "symlink info EACCES"} {
		if !strings.Contains(out, want+"\n") {
			t.Errorf("want %q in the attacker's report:\n%s", want, out)
		}
	}
	for _, bad := range []string{"sample-", "blocked", `"format"`, `"type":"file"`} {
		if strings.Contains(out, bad) {
			t.Errorf("the attacker's report has %q (root's shard index, or a blocked daemon):\n%s", bad, out)
		}
	}
}

// childXattrSwap creates u/s.tar through the mount, then swaps its backing
// name for a symlink to secret and for a FIFO, reporting what the xattrs
// answer through the mount ("<swap> <xattr> <errno name or value>").
func childXattrSwap(mnt, backing, secret string) error {
	p := filepath.Join(mnt, "u", "s.tar")
	bp := filepath.Join(backing, "u", "s.tar")
	if err := os.WriteFile(p, make([]byte, 10240), 0o644); err != nil {
		return err
	}
	if _, err := unixGetxattr(p, "user.gdsfs.info"); err != nil {
		return err
	}
	ask := func(swap string) {
		for _, name := range []string{"index", "info"} {
			done := make(chan string, 1)
			go func() {
				v, err := unixGetxattr(p, "user.gdsfs."+name)
				var errno syscall.Errno
				switch {
				case errors.As(err, &errno):
					done <- unix.ErrnoName(errno)
				case err != nil:
					done <- err.Error()
				default:
					done <- fmt.Sprintf("%.300s", v)
				}
			}()
			select {
			case r := <-done:
				fmt.Println(swap, name, r)
			case <-time.After(20 * time.Second):
				fmt.Println(swap, name, "blocked")
			}
		}
	}
	if err := os.Rename(bp, bp+".old"); err != nil {
		return err
	}
	if err := os.Symlink(secret, bp); err != nil {
		return err
	}
	ask("symlink")
	if err := os.Remove(bp); err != nil {
		return err
	}
	if err := syscall.Mkfifo(bp, 0o644); err != nil {
		return err
	}
	ask("fifo")
	return nil
}
