package integration

import (
	"bufio"
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"runtime/debug"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/gdsfs/gdsfs/ctl"
)

// The pool isolation tests run the gdsfs binary (host engine, a small
// --host-pool, --allow-other) and two client processes of two non-root
// uids. The parent drives them over their stdin and stdout, one command and
// one answer per line, so every step happens in a known order without
// sleeps.

const (
	poolUIDA = 10001
	poolUIDB = 10002
	// Slab bytes and pool size of the isolation daemon: uid A fills it
	// with two slabs.
	poolSlab = 4 << 20
	poolSize = 2 * poolSlab
)

// Bytes uid A writes into every lease it holds. Uid B's data never
// contains them in a run (its file is random and its ALLOC buffer is
// filled with poolFillB); A's retained mappings may show only poolFillA
// and zeroes.
const (
	poolFillA  = 0xAA
	poolFillB  = 0xBB
	poolScrawl = 0xEE // what A tries to write through its retained mappings
)

// TestPoolChild is not a test: the pool tests re-exec the test binary with
// GDSFS_POOL_CHILD set to run a client process as another uid. It does
// nothing otherwise.
func TestPoolChild(t *testing.T) {
	mode, env := childMode(t, "POOL")
	c := &poolChild{in: bufio.NewScanner(os.Stdin), mnt: env("MNT")}
	var err error
	switch mode {
	case "attacker":
		err = c.attacker()
	case "victim":
		err = c.victim(env("FILE"), env("OUT"))
	case "alloc":
		err = c.allocs()
	case "hoarder":
		err = c.hoarder()
	case "truncator":
		err = c.truncator(env("FILE"), env("OUT"))
	default:
		err = fmt.Errorf("unknown child mode %q", mode)
	}
	if err != nil {
		fmt.Println("error:", err)
		os.Exit(1)
	}
	os.Exit(0)
}

// poolChild is one client process's side of the line protocol.
type poolChild struct {
	in  *bufio.Scanner
	mnt string
}

// wait reads the parent's next command; it must start with want.
func (c *poolChild) wait(want string) ([]string, error) {
	if !c.in.Scan() {
		return nil, fmt.Errorf("parent closed stdin while the child waited for %q", want)
	}
	f := strings.Fields(c.in.Text())
	if len(f) == 0 || f[0] != want {
		return nil, fmt.Errorf("parent said %q, want %q", c.in.Text(), want)
	}
	return f[1:], nil
}

// attacker fills the pool, maps every slab and keeps the mappings and the
// slab files open after releasing its leases; then, once the victim holds
// its data, it looks through everything it kept and tries to write
// through it, to open the victim's slab files and to use the victim's
// session.
func (c *poolChild) attacker() error {
	ctx := context.Background()
	cl, err := ctl.OpenSession(c.mnt)
	if err != nil {
		return err
	}
	defer cl.Close()
	var (
		ids   []uint64
		maps  [][]byte
		files []*os.File
		seen  = map[uint64]bool{}
	)
	for {
		l, err := cl.Alloc(ctx, ctl.HostDevice, poolSlab)
		if errors.Is(err, syscall.EAGAIN) {
			break
		}
		if err != nil {
			return err
		}
		ids = append(ids, l.ID)
		b, err := cl.Bytes(ctx, l)
		if err != nil {
			return err
		}
		for i := range b {
			b[i] = poolFillA
		}
		if seen[l.Slab] {
			continue
		}
		seen[l.Slab] = true
		r, err := cl.Slab(ctx, l.Slab)
		if err != nil {
			return err
		}
		f, err := os.OpenFile(string(r.Handle), os.O_RDWR, 0)
		if err != nil {
			return fmt.Errorf("open own slab file %s: %w", r.Handle, err)
		}
		defer f.Close()
		files = append(files, f)
		// The attacker's own mapping of the whole slab, as any program
		// would make it (the client keeps slab mappings to itself).
		st, err := f.Stat()
		if err != nil {
			return err
		}
		whole, err := unix.Mmap(int(f.Fd()), 0, int(st.Size()), unix.PROT_READ|unix.PROT_WRITE, unix.MAP_SHARED)
		if err != nil {
			return fmt.Errorf("map own slab file %s: %w", r.Handle, err)
		}
		maps = append(maps, whole)
		fmt.Println("handle", l.Slab, string(r.Handle))
	}
	if len(ids) == 0 {
		return errors.New("the pool refused the first ALLOC")
	}
	fmt.Println("filled", len(ids))
	if err := cl.Release(ctx, ids...); err != nil {
		return err
	}
	fmt.Println("released")

	args, err := c.wait("probe")
	if err != nil {
		return err
	}
	if len(args) < 1 {
		return errors.New("probe without the victim's token")
	}
	var problems []string
	for i, m := range maps {
		faulted, leaked := scanRetained(m)
		if leaked >= 0 {
			problems = append(problems, fmt.Sprintf("retained mapping %d shows byte %#x at %d after the victim's use", i, m[leaked], leaked))
		}
		if !faulted {
			// A write through it must not reach the victim either.
			scrawl(m)
		}
		fmt.Println("mapping", i, "faulted", faulted)
	}
	for i, f := range files {
		b, err := io.ReadAll(io.NewSectionReader(f, 0, 1<<40))
		if err != nil {
			problems = append(problems, fmt.Sprintf("read retained slab file %d: %v", i, err))
		}
		if j := foreignByte(b); j >= 0 {
			problems = append(problems, fmt.Sprintf("retained slab file %d shows byte %#x at %d", i, b[j], j))
		}
		// Writing through the descriptor must not reach the victim either.
		if _, err := f.WriteAt(bytes.Repeat([]byte{poolScrawl}, 1<<16), 0); err != nil {
			problems = append(problems, fmt.Sprintf("write own retained slab file %d: %v", i, err))
		}
		fmt.Println("file", i, "bytes", len(b))
	}
	tok, err := parseToken(args[0])
	if err != nil {
		return err
	}
	for _, a := range args[1:] {
		id, path, ok := strings.Cut(a, "=")
		if !ok {
			return fmt.Errorf("bad slab argument %q", a)
		}
		if f, err := os.OpenFile(path, os.O_RDONLY, 0); err == nil {
			f.Close()
			problems = append(problems, fmt.Sprintf("opened the victim's slab file %s", path))
		} else if !errors.Is(err, os.ErrPermission) {
			problems = append(problems, fmt.Sprintf("open the victim's slab file %s: %v, want EACCES", path, err))
		}
		n, err := strconv.ParseUint(id, 10, 64)
		if err != nil {
			return err
		}
		if _, err := cl.Slab(ctx, n); !errors.Is(err, syscall.EPERM) {
			problems = append(problems, fmt.Sprintf("SLAB %d (the victim's) on the attacker's session: %v, want EPERM", n, err))
		}
		stolen, err := ctl.Attach(c.mnt, tok)
		if err != nil {
			return err
		}
		_, err = stolen.Slab(ctx, n)
		stolen.Close()
		if !errors.Is(err, syscall.EPERM) {
			problems = append(problems, fmt.Sprintf("SLAB %d with the victim's token: %v, want EPERM", n, err))
		}
	}
	if len(problems) > 0 {
		return errors.New(strings.Join(problems, "; "))
	}
	fmt.Println("probed")
	_, err = c.wait("exit")
	return err
}

// scanRetained reads m through a fault guard: a mapping of a file that
// was truncated faults (SIGBUS) on first touch. It returns whether it
// faulted and the index of the first byte neither the attacker's nor
// zero (-1 when none).
func scanRetained(m []byte) (faulted bool, leaked int) {
	defer debug.SetPanicOnFault(debug.SetPanicOnFault(true))
	leaked = -1
	defer func() {
		if recover() != nil {
			faulted = true
		}
	}()
	leaked = foreignByte(m)
	return false, leaked
}

// scrawl writes over m through a fault guard.
func scrawl(m []byte) {
	defer debug.SetPanicOnFault(debug.SetPanicOnFault(true))
	defer func() { _ = recover() }()
	for i := range m {
		m[i] = poolScrawl
	}
}

// foreignByte is the index of the first byte of b that is neither the
// attacker's fill nor zero, or -1.
func foreignByte(b []byte) int {
	for i, x := range b {
		if x != 0 && x != poolFillA && x != poolScrawl {
			return i
		}
	}
	return -1
}

// victim reads its own 0600 file and ALLOCs a buffer it fills, prints its
// token and slab handles, and once the attacker has probed checks that its
// leases still hold exactly its bytes and that WRITE puts exactly them into
// its file.
func (c *poolChild) victim(file, out string) error {
	ctx := context.Background()
	want, err := os.ReadFile(file)
	if err != nil {
		return err
	}
	f, err := os.Open(file)
	if err != nil {
		return err
	}
	defer f.Close()
	dst, err := os.OpenFile(out, os.O_RDWR, 0)
	if err != nil {
		return err
	}
	defer dst.Close()
	cl, err := ctl.OpenSession(c.mnt)
	if err != nil {
		return err
	}
	defer cl.Close()
	ls, err := cl.Read(ctx, f, ctl.HostDevice, []ctl.Range{{Offset: 0, Length: uint64(len(want))}})
	if err != nil {
		return fmt.Errorf("READ own file: %w", err)
	}
	wl, err := cl.Alloc(ctx, ctl.HostDevice, poolSlab)
	if err != nil {
		return fmt.Errorf("ALLOC: %w", err)
	}
	wb, err := cl.Bytes(ctx, wl)
	if err != nil {
		return err
	}
	for i := range wb {
		wb[i] = poolFillB
	}
	check := func(when string) error {
		got, err := cl.Bytes(ctx, ls[0])
		if err != nil {
			return err
		}
		if !bytes.Equal(got, want) {
			return fmt.Errorf("%s: READ lease differs from the file at byte %d", when, firstDiff(got, want))
		}
		if i := notFill(wb, poolFillB); i >= 0 {
			return fmt.Errorf("%s: ALLOC buffer changed at byte %d", when, i)
		}
		return nil
	}
	if err := check("before the probe"); err != nil {
		return err
	}
	line := []string{"victim", tokenString(cl.Token())}
	for _, id := range []uint64{ls[0].Slab, wl.Slab} {
		r, err := cl.Slab(ctx, id)
		if err != nil {
			return err
		}
		line = append(line, fmt.Sprintf("%d=%s", id, r.Handle))
	}
	fmt.Println(strings.Join(line, " "))

	if _, err := c.wait("check"); err != nil {
		return err
	}
	if err := check("after the probe"); err != nil {
		return err
	}
	if err := cl.Write(ctx, dst, wl, 0, 0, poolSlab, true); err != nil {
		return fmt.Errorf("WRITE: %w", err)
	}
	got, err := os.ReadFile(out)
	if err != nil {
		return err
	}
	if i := notFill(got, poolFillB); len(got) != poolSlab || i >= 0 {
		return fmt.Errorf("WRITE put %d bytes into the file, not exactly the ALLOC buffer (first differing byte %d)", len(got), i)
	}
	fmt.Println("checked")
	_, err = c.wait("exit")
	return err
}

// notFill is the index of the first byte of b that is not fill, or -1.
func notFill(b []byte, fill byte) int {
	for i, x := range b {
		if x != fill {
			return i
		}
	}
	return -1
}

func firstDiff(a, b []byte) int {
	for i := range min(len(a), len(b)) {
		if a[i] != b[i] {
			return i
		}
	}
	return min(len(a), len(b))
}

// allocs serves "alloc N TIMES" commands and holds every lease until
// "exit".
func (c *poolChild) allocs() error {
	ctx := context.Background()
	cl, err := ctl.OpenSession(c.mnt)
	if err != nil {
		return err
	}
	defer cl.Close()
	for c.in.Scan() {
		f := strings.Fields(c.in.Text())
		switch {
		case len(f) == 1 && f[0] == "exit":
			return nil
		case len(f) == 3 && f[0] == "alloc":
			// alloc N TIMES: answers the outcome of each, "ok" or the
			// errno's name, on one line.
			n, err := strconv.ParseInt(f[1], 10, 64)
			if err != nil {
				return err
			}
			times, err := strconv.Atoi(f[2])
			if err != nil {
				return err
			}
			var got []string
			for range times {
				_, err = cl.Alloc(ctx, ctl.HostDevice, n)
				var errno syscall.Errno
				switch {
				case err == nil:
					got = append(got, "ok")
				case errors.Is(err, syscall.EAGAIN):
					got = append(got, "EAGAIN")
				case errors.As(err, &errno):
					got = append(got, fmt.Sprintf("errno%d", int(errno)))
				default:
					return err
				}
			}
			fmt.Println("alloc", strings.Join(got, " "))
		default:
			return fmt.Errorf("unknown command %q", c.in.Text())
		}
	}
	return errors.New("parent closed stdin without exit")
}

// poolProc is a running child as the parent sees it.
type poolProc struct {
	t    *testing.T
	name string
	cmd  *exec.Cmd
	in   io.WriteCloser
	out  *bufio.Scanner
	log  bytes.Buffer // every line it printed, for failure messages
	done chan struct{}
}

// startPoolChild starts the test binary in pool-child mode as uid (with
// file and outFile: the victim's and truncator's files).
func startPoolChild(t *testing.T, bin, mnt, mode string, uid uint32, file, outFile string) *poolProc {
	t.Helper()
	env := map[string]string{"MNT": mnt}
	if file != "" {
		env["FILE"], env["OUT"] = file, outFile
	}
	cmd := child{bin: bin, family: "POOL", mode: mode, env: env, uid: uid}.cmd(t)
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
	p := &poolProc{t: t, name: fmt.Sprintf("%s (uid %d)", mode, uid), cmd: cmd, in: in, out: bufio.NewScanner(out), done: make(chan struct{})}
	t.Cleanup(func() {
		in.Close()
		// A child stuck on the daemon must not hang the test run.
		timer := time.AfterFunc(30*time.Second, func() { cmd.Process.Kill() })
		defer timer.Stop()
		_ = cmd.Wait()
	})
	return p
}

// send writes one command line.
func (p *poolProc) send(line string) {
	p.t.Helper()
	if _, err := fmt.Fprintln(p.in, line); err != nil {
		p.t.Fatalf("%s: send %q: %v\n%s", p.name, line, err, p.log.String())
	}
}

// expect reads lines until one starts with prefix and returns it; a line
// starting with "error:" or the end of the output fails the test.
func (p *poolProc) expect(prefix string) string {
	p.t.Helper()
	for p.out.Scan() {
		l := p.out.Text()
		p.log.WriteString(l + "\n")
		if strings.HasPrefix(l, "error:") {
			p.t.Fatalf("%s: %s\n(output so far)\n%s", p.name, l, p.log.String())
		}
		if strings.HasPrefix(l, prefix) {
			return l
		}
	}
	p.t.Fatalf("%s ended before printing %q; output:\n%s", p.name, prefix, p.log.String())
	return ""
}

// poolMount starts the binary with allow_other on directories other uids
// can reach, and returns it and the world-executable test binary.
func poolMount(t *testing.T, extra ...string) (*binDaemon, string) {
	t.Helper()
	requireRoot(t)
	dir := t.TempDir()
	openToOtherUIDs(t, dir)
	backing, mnt := mountDirs(t, dir)
	args := append([]string{"--engine", "host", "--allow-other", "--host-pool", strconv.Itoa(poolSize), "--slab-size", strconv.Itoa(poolSlab)}, extra...)
	d := startBinDaemon(t, backing, mnt, args...)
	return d, worldExecutable(t, os.Args[0])
}

// ownedFile writes data to a new file of the backing directory, mode 0600,
// owned by uid.
func ownedFile(t *testing.T, backing, name string, data []byte, uid int) string {
	t.Helper()
	p := filepath.Join(backing, name)
	if err := os.WriteFile(p, data, 0o600); err != nil {
		t.Fatal(err)
	}
	if err := os.Chown(p, uid, uid); err != nil {
		t.Fatal(err)
	}
	return p
}

// TestPoolIsolation (issue 12, item 2): uid A fills the pool, releases
// everything and keeps its mappings and slab files open; uid B then reads
// its own 0600 file and ALLOCs and WRITEs. Nothing A kept shows or alters
// B's bytes, A cannot open B's slab files or use B's slabs through either
// session, and B's READ and WRITE results are exactly B's.
func TestPoolIsolation(t *testing.T) {
	// The whole pool for one uid: the case where another uid's memory
	// can only come from what the first one held.
	d, bin := poolMount(t, "--uid-share", "1")
	secret := randomBytes(77, 3<<20+123)
	ownedFile(t, d.backing, "secret", secret, poolUIDB)
	ownedFile(t, d.backing, "out", nil, poolUIDB)

	a := startPoolChild(t, bin, d.mnt, "attacker", poolUIDA, "", "")
	if n := a.expect("filled"); n != "filled 2" {
		t.Fatalf("attacker: %q, want the %d-byte pool filled with 2 slabs", n, poolSize)
	}
	a.expect("released")

	b := startPoolChild(t, bin, d.mnt, "victim", poolUIDB, filepath.Join(d.mnt, "secret"), filepath.Join(d.mnt, "out"))
	v := strings.Fields(b.expect("victim "))
	a.send("probe " + strings.Join(v[1:], " "))
	a.expect("probed")
	b.send("check")
	b.expect("checked")

	// The attacker's handles are useless to the victim too.
	for _, l := range strings.Split(a.log.String(), "\n") {
		if f := strings.Fields(l); len(f) == 3 && f[0] == "handle" {
			if f, err := openAs(poolUIDB, f[2]); err == nil {
				t.Errorf("uid %d opened uid %d's slab file %s", poolUIDB, poolUIDA, f)
			}
			// Nor can it tell that they exist (which uids use the pool, how much).
			if err := asUID(poolUIDB, `[ -e "$1" ] || [ -e "${1%/*}/." ]`, f[2]); err == nil {
				t.Errorf("uid %d can see uid %d's slab file or its directory (%s)", poolUIDB, poolUIDA, f[2])
			}
		}
	}
	t.Logf("attacker's view:\n%s", a.log.String())
	a.send("exit")
	b.send("exit")
	if got, err := os.ReadFile(filepath.Join(d.backing, "out")); err != nil || len(got) != poolSlab || got[0] != poolFillB {
		t.Errorf("the victim's file after WRITE: %d bytes (%v), want %d bytes of %#x", len(got), err, poolSlab, poolFillB)
	}
}

// openAs opens path for reading as uid (in a child process: the test's
// own credentials cannot change per thread) and returns path if it could.
func openAs(uid int, path string) (string, error) {
	if err := asUID(uid, `exec 3<"$1"`, path); err != nil {
		return "", err
	}
	return path, nil
}

// asUID runs the shell script with arg as $1 as uid; nil when it exits 0.
func asUID(uid int, script, arg string) error {
	cmd := exec.Command("/bin/sh", "-c", script, "sh", arg)
	cmd.SysProcAttr = &syscall.SysProcAttr{Credential: &syscall.Credential{Uid: uint32(uid), Gid: uint32(uid)}}
	return cmd.Run()
}

// TestPoolFairShare (issue 12, item 9): with the default --uid-share (half
// the pool), uid A holding its whole share gets EAGAIN beyond it and does
// not make uid B's ALLOC fail; gdsfs status and the metrics show each
// uid's memory and refusals; A retrying in a loop logs one warning, not
// one per refusal (item 10).
func TestPoolFairShare(t *testing.T) {
	d, bin := poolMount(t)
	a := startPoolChild(t, bin, d.mnt, "alloc", poolUIDA, "", "")
	b := startPoolChild(t, bin, d.mnt, "alloc", poolUIDB, "", "")
	a.send(fmt.Sprintf("alloc %d 1", poolSlab))
	if got := a.expect("alloc"); got != "alloc ok" {
		t.Fatalf("uid %d's first ALLOC of its share: %q", poolUIDA, got)
	}
	const retries = 200
	a.send(fmt.Sprintf("alloc 4096 %d", retries))
	if got := a.expect("alloc"); got != "alloc"+strings.Repeat(" EAGAIN", retries) {
		t.Fatalf("uid %d beyond its share: %q, want EAGAIN every time", poolUIDA, got)
	}
	b.send(fmt.Sprintf("alloc %d 1", poolSlab))
	if got := b.expect("alloc"); got != "alloc ok" {
		t.Fatalf("uid %d's ALLOC while uid %d holds its share: %q, want ok", poolUIDB, poolUIDA, got)
	}

	out, err := exec.Command(gdsfsBin(t), "status", d.mnt).CombinedOutput()
	if err != nil {
		t.Fatalf("gdsfs status: %v\n%s", err, out)
	}
	for _, want := range []string{
		"4.0 MiB per uid",
		fmt.Sprintf("uid %d: 1 sessions, 4.0 MiB leased, 4.0 MiB allocated, %d allocations refused", poolUIDA, retries),
		fmt.Sprintf("uid %d: 1 sessions, 4.0 MiB leased, 4.0 MiB allocated, 0 allocations refused", poolUIDB),
	} {
		if !strings.Contains(string(out), want) {
			t.Errorf("gdsfs status lacks %q:\n%s", want, out)
		}
	}
	s := d.mustScrape()
	for _, m := range []struct {
		name, uid string
		want      float64
	}{
		{"gdsfs_pool_uid_refused_total", strconv.Itoa(poolUIDA), retries},
		{"gdsfs_pool_uid_refused_total", strconv.Itoa(poolUIDB), 0},
		{"gdsfs_pool_uid_allocated_bytes", strconv.Itoa(poolUIDB), poolSlab},
	} {
		if got, ok := s.Get(m.name, "uid", m.uid); !ok || got != m.want {
			t.Errorf("%s{uid=%q} = %v (present %v), want %v", m.name, m.uid, got, ok, m.want)
		}
	}
	if got, ok := s.Get("gdsfs_pool_uid_share_bytes", "device", "host"); !ok || got != poolSlab {
		t.Errorf("gdsfs_pool_uid_share_bytes = %v (present %v), want %d", got, ok, poolSlab)
	}
	log, err := os.ReadFile(d.logPath)
	if err != nil {
		t.Fatal(err)
	}
	if n := bytes.Count(log, []byte("gpubuf: pool exhausted")); n < 1 || n > 2 {
		t.Errorf("%d exhaustion warnings logged for %d refusals, want 1 (or 2 across a period boundary)", n, retries)
	}
	a.send("exit")
	b.send("exit")
}

// truncator shrinks its own slab file to nothing while it holds a lease
// in it (the owner may: the file is its), then asks the daemon to READ
// into and WRITE from that slab. The daemon must answer with an error,
// not die of SIGBUS.
func (c *poolChild) truncator(file, out string) error {
	ctx := context.Background()
	cl, err := ctl.OpenSession(c.mnt)
	if err != nil {
		return err
	}
	defer cl.Close()
	l, err := cl.Alloc(ctx, ctl.HostDevice, 4096)
	if err != nil {
		return err
	}
	r, err := cl.Slab(ctx, l.Slab)
	if err != nil {
		return err
	}
	if err := os.Truncate(string(r.Handle), 0); err != nil {
		return fmt.Errorf("truncate own slab file: %w", err)
	}
	f, err := os.Open(file)
	if err != nil {
		return err
	}
	defer f.Close()
	dst, err := os.OpenFile(out, os.O_RDWR, 0)
	if err != nil {
		return err
	}
	defer dst.Close()
	_, rerr := cl.Read(ctx, f, ctl.HostDevice, []ctl.Range{{Offset: 0, Length: 8192}})
	werr := cl.Write(ctx, dst, l, 0, 0, 4096, false)
	for _, e := range []error{rerr, werr} {
		if errors.Is(e, syscall.ENOTCONN) || errors.Is(e, syscall.ECONNABORTED) {
			return fmt.Errorf("the daemon died: %w", e)
		}
	}
	fmt.Println("survived", rerr != nil, werr != nil)
	_, err = c.wait("exit")
	return err
}

// TestPoolOwnerTruncatesOwnSlab: a uid that truncates its own slab file
// under the daemon's mapping breaks only its own requests; the daemon
// stays up and serves everyone else.
func TestPoolOwnerTruncatesOwnSlab(t *testing.T) {
	d, bin := poolMount(t)
	data := randomBytes(5, 1<<20)
	ownedFile(t, d.backing, "mine", data, poolUIDA)
	ownedFile(t, d.backing, "out", nil, poolUIDA)
	a := startPoolChild(t, bin, d.mnt, "truncator", poolUIDA, filepath.Join(d.mnt, "mine"), filepath.Join(d.mnt, "out"))
	got := a.expect("survived")
	t.Logf("uid %d truncated its own slab; READ failed, WRITE failed: %s", poolUIDA, strings.TrimPrefix(got, "survived "))
	if !d.running() {
		t.Fatal("the daemon died after a client truncated its own slab file")
	}
	cl := openSession(t, d.mnt)
	f := openRO(t, filepath.Join(d.mnt, "mine"))
	ls, err := cl.Read(context.Background(), f, ctl.HostDevice, []ctl.Range{{Offset: 0, Length: uint64(len(data))}})
	if err != nil {
		t.Fatalf("root's READ after uid %d truncated its slab: %v", poolUIDA, err)
	}
	b, err := cl.Bytes(context.Background(), ls[0])
	if err != nil || !bytes.Equal(b, data) {
		t.Fatalf("root's READ: %v, bytes equal %v", err, bytes.Equal(b, data))
	}
	a.send("exit")
}

// hoarder leases, fills and releases dedicated slabs (larger than a
// regular slab) again and again, keeping every mapping, as a client that
// caches mappings per slab does; it prints the shared memory resident in
// its mappings after each release.
func (c *poolChild) hoarder() error {
	ctx := context.Background()
	cl, err := ctl.OpenSession(c.mnt)
	if err != nil {
		return err
	}
	defer cl.Close()
	for range 8 {
		l, err := cl.Alloc(ctx, ctl.HostDevice, poolSize-poolSlab/2)
		if err != nil {
			return err
		}
		b, err := cl.Bytes(ctx, l)
		if err != nil {
			return err
		}
		for i := range b {
			b[i] = poolFillA
		}
		if err := cl.Release(ctx, l.ID); err != nil {
			return err
		}
	}
	st, err := os.ReadFile("/proc/self/status")
	if err != nil {
		return err
	}
	for _, line := range strings.Split(string(st), "\n") {
		if f := strings.Fields(line); len(f) == 3 && f[0] == "RssShmem:" {
			fmt.Println("rssshmem_kib", f[1])
			_, err = c.wait("exit")
			return err
		}
	}
	return errors.New("no RssShmem in /proc/self/status")
}

// TestPoolReleasedMappingsHoldNoMemory (issue 12, item 10): mappings a
// client keeps of freed slabs hold no memory, so they cannot add up beyond
// --host-pool (eight 6 MiB slabs through an 8 MiB pool held 48 MiB before).
func TestPoolReleasedMappingsHoldNoMemory(t *testing.T) {
	d, bin := poolMount(t, "--uid-share", "1")
	a := startPoolChild(t, bin, d.mnt, "hoarder", poolUIDA, "", "")
	f := strings.Fields(a.expect("rssshmem_kib"))
	kib, err := strconv.Atoi(f[1])
	if err != nil {
		t.Fatal(err)
	}
	t.Logf("after 8 x %d MiB leased, filled and released with mappings kept: %d KiB of shared memory resident in the client (pool %d MiB)",
		(poolSize-poolSlab/2)>>20, kib, poolSize>>20)
	if kib*1024 > poolSize {
		t.Errorf("the client's kept mappings hold %d KiB, more than the %d MiB pool", kib, poolSize>>20)
	}
	a.send("exit")
}
