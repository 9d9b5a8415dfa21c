package integration

import (
	"bufio"
	"bytes"
	"context"
	"crypto/rand"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	mrand "math/rand/v2"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"
	"unsafe"

	"golang.org/x/sys/unix"

	"github.com/gdsfs/gdsfs/ctl"
	"github.com/gdsfs/gdsfs/ctlserver"
)

func randHex(n int) string {
	b := make([]byte, n)
	rand.Read(b)
	return hex.EncodeToString(b)
}

// leased is the pool's lease count and leased bytes.
func (m *testMount) leased() (int, int64) {
	var n int
	var b int64
	for _, d := range m.d.Pool().Stats().Devices {
		n += d.Leases
		b += d.LeasedBytes
	}
	return n, b
}

// waitIdle waits (up to 10s) until the pool holds no lease: sessions end
// when the kernel sends the control file's RELEASE, after the closing
// process is gone, and there is no event to wait on.
func (m *testMount) waitIdle(t testing.TB) {
	t.Helper()
	deadline := time.Now().Add(10 * time.Second)
	for {
		n, b := m.leased()
		if n == 0 && b == 0 {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("pool still holds %d leases (%d bytes) 10s after every client closed", n, b)
		}
		time.Sleep(10 * time.Millisecond)
	}
}

// addFile writes n random bytes to name in the backing directory.
func (m *testMount) addFile(t testing.TB, name string, n int, seed uint64) []byte {
	t.Helper()
	data := randomBytes(seed, n)
	writeFile(t, filepath.Join(m.backing, name), data)
	return data
}

func openSession(t testing.TB, mnt string) *ctl.Client {
	t.Helper()
	cl, err := ctl.OpenSession(mnt)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { cl.Close() })
	return cl
}

func openRO(t testing.TB, p string) *os.File {
	t.Helper()
	f, err := os.Open(p)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { f.Close() })
	return f
}

// verifyLeases checks every lease against data (the file's contents).
func verifyLeases(ctx context.Context, cl *ctl.Client, ranges []ctl.Range, ls []ctl.Lease, data []byte) error {
	if len(ls) != len(ranges) {
		return fmt.Errorf("%d leases for %d ranges", len(ls), len(ranges))
	}
	for i, r := range ranges {
		end := min(r.Offset+r.Length, uint64(len(data)))
		want := data[r.Offset:end]
		if ls[i].Valid != uint64(len(want)) || ls[i].Length != r.Length {
			return fmt.Errorf("range %+v: lease valid %d length %d, want %d %d", r, ls[i].Valid, ls[i].Length, len(want), r.Length)
		}
		got, err := cl.Bytes(ctx, ls[i])
		if err != nil {
			return err
		}
		if !bytes.Equal(got, want) {
			return fmt.Errorf("range %+v: bytes differ from the file", r)
		}
	}
	return nil
}

// randomRanges returns n random ranges of a file of size bytes, some
// unaligned, some running past the end, some empty.
func randomRanges(r *mrand.Rand, size uint64, n int, maxLen uint64) []ctl.Range {
	out := make([]ctl.Range, n)
	for i := range out {
		off := r.Uint64N(size + 1)
		if r.IntN(4) == 0 {
			off &^= 4095
		}
		out[i] = ctl.Range{Offset: off, Length: r.Uint64N(maxLen + 1)}
	}
	return out
}

func TestControlByteExact(t *testing.T) {
	m := startMount(t, mountOpts{Daemon: true, OtherUIDs: true, SlabBytes: 4 << 20, BudgetBytes: 256 << 20})
	ctx := context.Background()
	cl := openSession(t, m.mnt)
	r := mrand.New(mrand.NewPCG(1, 2))
	for i, size := range []int{0, 1, 4095, 4096, 4097, 5<<20 + 3, 40 << 20} {
		name := fmt.Sprintf("f%d", i)
		data := m.addFile(t, name, size, uint64(i))
		f := openRO(t, filepath.Join(m.mnt, name))
		ranges := append([]ctl.Range{{Offset: 0, Length: uint64(size)}, {Offset: uint64(size), Length: 1}, {Offset: 0, Length: 1}}, randomRanges(r, uint64(size), 60, 1<<20)...)
		ls, err := cl.Read(ctx, f, ctl.HostDevice, ranges)
		if err != nil {
			t.Fatalf("%s: %v", name, err)
		}
		if err := verifyLeases(ctx, cl, ranges, ls, data); err != nil {
			t.Errorf("%s (%d bytes): %v", name, size, err)
		}
		var ids []uint64
		for _, l := range ls {
			if l.ID != 0 {
				ids = append(ids, l.ID)
			}
		}
		if err := cl.Release(ctx, ids...); err != nil {
			t.Fatal(err)
		}
	}
	if n, _ := m.leased(); n != 0 {
		t.Errorf("%d leases left after release", n)
	}
}

// ioctlErr issues one raw ioctl and returns its errno (0 on success).
func ioctlErr(f *os.File, cmd uint32, buf []byte) syscall.Errno {
	var p uintptr
	if len(buf) > 0 {
		p = uintptr(unsafe.Pointer(&buf[0]))
	}
	_, _, errno := unix.Syscall(unix.SYS_IOCTL, f.Fd(), uintptr(cmd), p)
	return errno
}

func readReq(tok ctl.Token, dev int32, ranges ...ctl.Range) []byte {
	b := make([]byte, ctl.SizeRead)
	(&ctl.ReadRequest{Token: tok, Device: dev, Ranges: ranges}).Encode(b)
	return b
}

// TestControlRefusals: every refusal through the kernel, then the daemon
// still serves correct bytes.
func TestControlRefusals(t *testing.T) {
	m := startMount(t, mountOpts{Daemon: true, OtherUIDs: true, SlabBytes: 1 << 20, BudgetBytes: 4 << 20})
	ctx := context.Background()
	data := m.addFile(t, "data", 1<<20, 3)
	cl := openSession(t, m.mnt)
	tok := cl.Token()
	f := openRO(t, filepath.Join(m.mnt, "data"))
	dir := openRO(t, m.mnt)
	ctlf := openRO(t, filepath.Join(m.mnt, ctl.ControlName))

	huge := make([]ctl.Range, 0, 8)
	for range 8 {
		huge = append(huge, ctl.Range{Offset: 0, Length: 1 << 20})
	}
	for _, tc := range []struct {
		name string
		f    *os.File
		cmd  uint32
		buf  []byte
		want syscall.Errno
	}{
		{"wrong secret", f, ctl.CmdRead, readReq(ctl.Token{Session: tok.Session, Secret: tok.Secret ^ 1}, -1, ctl.Range{Offset: 0, Length: 1}), syscall.EPERM},
		{"past EOF", f, ctl.CmdRead, readReq(tok, -1, ctl.Range{Offset: 1<<20 + 1, Length: 1}), syscall.EINVAL},
		{"overflow", f, ctl.CmdRead, readReq(tok, -1, ctl.Range{Offset: 1<<63 - 10, Length: 20}), syscall.ERANGE},
		{"too many ranges", f, ctl.CmdRead, func() []byte {
			b := readReq(tok, -1, ctl.Range{Offset: 0, Length: 1})
			b[40], b[41] = 1, 1 // count 257
			return b
		}(), syscall.E2BIG},
		{"more than the pool", f, ctl.CmdRead, readReq(tok, -1, huge...), syscall.E2BIG},
		{"unknown command", f, 0xC0104799, make([]byte, 16), syscall.ENOTTY},
		{"READ on a directory", dir, ctl.CmdRead, readReq(tok, -1, ctl.Range{Offset: 0, Length: 1}), syscall.ENOTTY},
		{"READ on the control file", ctlf, ctl.CmdRead, readReq(tok, -1, ctl.Range{Offset: 0, Length: 1}), syscall.ENOTTY},
		{"HELLO on a data file", f, ctl.CmdHello, func() []byte { b := make([]byte, ctl.SizeHello); ctl.EncodeHello(b); return b }(), syscall.ENOTTY},
		{"GPU device on a host daemon", f, ctl.CmdRead, readReq(tok, 0, ctl.Range{Offset: 0, Length: 1}), syscall.ENODEV},
		{"WRITE on a read-only descriptor", f, ctl.CmdWrite, func() []byte {
			b := make([]byte, ctl.SizeWrite)
			(&ctl.WriteRequest{Token: tok, Lease: 1, Length: 1}).Encode(b)
			return b
		}(), syscall.EBADF},
	} {
		t.Run(tc.name, func(t *testing.T) {
			if got := ioctlErr(tc.f, tc.cmd, tc.buf); got != tc.want {
				t.Errorf("got %v (%d), want %v", got, got, tc.want)
			}
		})
	}

	// Pool exhausted: EAGAIN, and fast.
	var held []uint64
	for {
		start := time.Now()
		ls, err := cl.Read(ctx, f, ctl.HostDevice, []ctl.Range{{Offset: 0, Length: 1 << 20}})
		if errors.Is(err, syscall.EAGAIN) {
			if d := time.Since(start); d > 2*time.Second {
				t.Errorf("EAGAIN took %v", d)
			}
			break
		}
		if err != nil {
			t.Fatal(err)
		}
		held = append(held, ls[0].ID)
		if len(held) > 10 {
			t.Fatal("a 4 MiB pool granted more than 10 MiB-leases")
		}
	}
	if err := cl.Release(ctx, held...); err != nil {
		t.Fatal(err)
	}

	// Another uid: a token it was handed is refused, its own session works.
	out := m.child("otheruid", map[string]string{"TOKEN": tokenString(tok), "FILE": filepath.Join(m.mnt, "data")}, 1000).mustRun(t, 2*time.Minute)
	if !strings.Contains(out, "eperm ok") || !strings.Contains(out, "own ok") {
		t.Errorf("uid 1000 child: %s", out)
	}

	ranges := []ctl.Range{{Offset: 17, Length: 300000}}
	ls, err := cl.Read(ctx, f, ctl.HostDevice, ranges)
	if err != nil {
		t.Fatalf("read after refusals: %v", err)
	}
	if err := verifyLeases(ctx, cl, ranges, ls, data); err != nil {
		t.Error(err)
	}
}

func TestControlReadOnlyMount(t *testing.T) {
	m := startMount(t, mountOpts{Daemon: true, OtherUIDs: true, ReadOnly: true})
	m.addFile(t, "ckpt", 100, 1)
	cl := openSession(t, m.mnt)
	f := openRO(t, filepath.Join(m.mnt, "ckpt"))
	ctx := context.Background()
	if _, err := cl.Alloc(ctx, ctl.HostDevice, 4096); !errors.Is(err, syscall.EROFS) {
		t.Errorf("ALLOC on a read-only mount: %v, want EROFS", err)
	}
	if err := cl.Write(ctx, f, ctl.Lease{ID: 1}, 0, 0, 1, false); !errors.Is(err, syscall.EROFS) {
		t.Errorf("WRITE on a read-only mount: %v, want EROFS", err)
	}
}

func tokenString(t ctl.Token) string { return fmt.Sprintf("%d:%d", t.Session, t.Secret) }

func parseToken(s string) (ctl.Token, error) {
	var t ctl.Token
	_, err := fmt.Sscanf(s, "%d:%d", &t.Session, &t.Secret)
	return t, err
}

// child is a control-client process of m (TestControlChild) in mode, as
// uid (0: as is), with m's mountpoint and backing directory in its
// environment (GDSFS_CTL_MNT, GDSFS_CTL_BACKING) besides env.
func (m *testMount) child(mode string, env map[string]string, uid uint32) child {
	e := map[string]string{"MNT": m.mnt, "BACKING": m.backing}
	for k, v := range env {
		e[k] = v
	}
	return child{family: "CTL", mode: mode, env: e, uid: uid}
}

// worldExecutable copies the executable at p to a directory every uid can
// reach (go test builds into a private one) and returns the copy's path.
func worldExecutable(t testing.TB, p string) string {
	t.Helper()
	dir, err := os.MkdirTemp("", "gdsfs-itest-bin-")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.RemoveAll(dir) })
	if err := os.Chmod(dir, 0o755); err != nil {
		t.Fatal(err)
	}
	b, err := os.ReadFile(p)
	if err != nil {
		t.Fatal(err)
	}
	dst := filepath.Join(dir, filepath.Base(p))
	if err := os.WriteFile(dst, b, 0o755); err != nil {
		t.Fatal(err)
	}
	return dst
}

// TestControlCrossProcess: a forked worker inherits the session and its
// leases outlive it; a process handed the token uses the session too;
// kill -9 of a client frees everything it held.
func TestControlCrossProcess(t *testing.T) {
	m := startMount(t, mountOpts{Daemon: true, OtherUIDs: true, SlabBytes: 1 << 20, BudgetBytes: 64 << 20})
	ctx := context.Background()
	data := m.addFile(t, "shard", 3<<20, 9)
	ctlFile, err := os.Open(filepath.Join(m.mnt, ctl.ControlName))
	if err != nil {
		t.Fatal(err)
	}
	cl, err := ctl.NewClient(ctlFile)
	if err != nil {
		t.Fatal(err)
	}
	defer cl.Close()

	// A "DataLoader worker": inherits the control descriptor (fd 3).
	cmd := m.child("worker", map[string]string{"FILE": filepath.Join(m.mnt, "shard")}, 0).cmd(t)
	cmd.ExtraFiles = []*os.File{ctlFile}
	out, err := cmd.CombinedOutput()
	if err != nil {
		t.Fatalf("worker: %v\n%s", err, out)
	}
	leases := parseLeases(t, string(out))
	// Another process of the same uid, handed the token.
	out2 := m.child("worker", map[string]string{"FILE": filepath.Join(m.mnt, "shard"), "TOKEN": tokenString(cl.Token())}, 0).mustRun(t, 2*time.Minute)
	leases = append(leases, parseLeases(t, out2)...)
	if len(leases) == 0 {
		t.Fatal("workers returned no leases")
	}
	// Both workers have exited; their leases are the session's and hold the data.
	for _, wl := range leases {
		cl.Adopt(wl.Lease)
		got, err := cl.Bytes(ctx, wl.Lease)
		if err != nil {
			t.Fatal(err)
		}
		if !bytes.Equal(got, data[wl.Offset:wl.Offset+wl.Lease.Valid]) {
			t.Errorf("worker lease %d (file offset %d) lost its bytes after the worker exited", wl.Lease.ID, wl.Offset)
		}
	}
	if n, _ := m.leased(); n != len(leases) {
		t.Errorf("pool holds %d leases, workers took %d", n, len(leases))
	}
	cl.Close()
	m.waitIdle(t)

	// kill -9 of a client holding leases.
	holder := m.child("hold", map[string]string{"FILE": filepath.Join(m.mnt, "shard")}, 0).cmd(t)
	stdout, err := holder.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	holder.Stderr = os.Stderr
	if err := holder.Start(); err != nil {
		t.Fatal(err)
	}
	line, err := bufio.NewReader(stdout).ReadString('\n')
	if err != nil || !strings.HasPrefix(line, "ready") {
		holder.Process.Kill()
		holder.Wait()
		t.Fatalf("holder: %q, %v", line, err)
	}
	if n, _ := m.leased(); n == 0 {
		t.Error("holder holds no lease before the kill")
	}
	holder.Process.Signal(syscall.SIGKILL)
	holder.Wait()
	m.waitIdle(t)
}

// workerLease is a lease a worker took, with the file offset it read.
type workerLease struct {
	Lease  ctl.Lease
	Offset uint64
}

func parseLeases(t testing.TB, out string) []workerLease {
	t.Helper()
	for _, l := range strings.Split(out, "\n") {
		if rest, ok := strings.CutPrefix(l, "leases "); ok {
			var ws []workerLease
			if err := json.Unmarshal([]byte(rest), &ws); err != nil {
				t.Fatalf("worker output %q: %v", l, err)
			}
			return ws
		}
	}
	t.Fatalf("worker printed no leases:\n%s", out)
	return nil
}

// TestControlRandomIoctls fires random ioctls at the data file, the control
// file and a directory of a live mount; the daemon must answer each, keep
// serving correct bytes and return the pool to idle.
func TestControlRandomIoctls(t *testing.T) {
	m := startMount(t, mountOpts{Daemon: true, OtherUIDs: true, SlabBytes: 1 << 20, BudgetBytes: 32 << 20})
	data := m.addFile(t, "data", 2<<20, 5)
	cl := openSession(t, m.mnt)
	tok := cl.Token()
	f, err := os.OpenFile(filepath.Join(m.mnt, "data"), os.O_RDWR, 0)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	ctlf := openRO(t, filepath.Join(m.mnt, ctl.ControlName))
	dir := openRO(t, m.mnt)
	targets := []*os.File{f, ctlf, dir}
	known := []uint32{ctl.CmdHello, ctl.CmdSlab, ctl.CmdAlloc, ctl.CmdRelease, ctl.CmdStatus, ctl.CmdRead, ctl.CmdReadNames, ctl.CmdWrite, ctl.CmdIndex}
	r := mrand.New(mrand.NewPCG(11, 12))
	buf := make([]byte, 16384)
	answered := map[syscall.Errno]int{}
	for i := range 3000 {
		var cmd uint32
		switch r.IntN(3) {
		case 0: // a real command, random payload (with a live token half the time)
			cmd = known[r.IntN(len(known))]
		case 1: // our type byte, random number, size and direction
			cmd = r.Uint32()&^0xff00 | 'G'<<8
		default: // anything, except the generic VFS ioctls the kernel serves itself
			cmd = r.Uint32()
			if vfsIoctl(cmd) {
				continue
			}
		}
		for j := range buf {
			buf[j] = byte(r.Uint32())
		}
		if r.IntN(2) == 0 {
			// A plausible header makes the decoders go deeper.
			binaryPut32(buf[0:], ctl.Magic)
			buf[4], buf[5], buf[6], buf[7] = 1, 0, 0, 0
			binaryPut64(buf[8:], tok.Session)
			binaryPut64(buf[16:], tok.Secret)
			clear(buf[24:32])
			if r.IntN(2) == 0 {
				clear(buf[32:64])
				buf[40] = byte(r.IntN(4)) // a small count
				binaryPut32(buf[32:], uint32(0xffffffff))
			}
		}
		if r.IntN(4) == 0 {
			// A well-formed request with random values: reaches the
			// server's semantics (leases taken, released, written).
			cmd = known[r.IntN(len(known))]
			validRequest(r, cmd, tok, uint64(len(data)), buf[:ctl.CmdSize(cmd)])
		}
		tgt := targets[r.IntN(len(targets))]
		errno := ioctlErr(tgt, cmd, buf)
		answered[errno]++
		if i%500 == 0 {
			checkStillServes(t, cl, f, data)
		}
	}
	t.Logf("answers by errno: %v", answered)
	if err := f.Sync(); err != nil {
		t.Fatal(err)
	}
	// Random WRITEs may have changed the file (a live token, a real
	// lease): compare with what it holds now.
	now, err := os.ReadFile(filepath.Join(m.backing, "data"))
	if err != nil {
		t.Fatal(err)
	}
	checkStillServes(t, cl, f, now)
	cl.Close()
	ctlf.Close()
	m.waitIdle(t)
}

// validRequest encodes a well-formed request for cmd with random values
// into b (of cmd's size).
func validRequest(r *mrand.Rand, cmd uint32, tok ctl.Token, size uint64, b []byte) {
	small := func() uint64 { return r.Uint64N(64) }
	switch cmd {
	case ctl.CmdHello:
		ctl.EncodeHello(b)
	case ctl.CmdSlab:
		(&ctl.SlabRequest{Slab: small()}).Encode(b)
	case ctl.CmdAlloc:
		(&ctl.AllocRequest{Device: -1, Length: r.Uint64N(3 << 20)}).Encode(b)
	case ctl.CmdRelease:
		(&ctl.ReleaseRequest{IDs: []uint64{small(), small(), small()}}).Encode(b)
	case ctl.CmdStatus, ctl.CmdIndex:
		(&ctl.PageRequest{Offset: r.Uint64N(2)}).Encode(b)
	case ctl.CmdRead:
		(&ctl.ReadRequest{Token: tok, Device: -1, Ranges: randomRanges(r, size, r.IntN(4)+1, 1<<20)}).Encode(b)
	case ctl.CmdReadNames:
		_ = (&ctl.ReadNamesRequest{Token: tok, Device: -1, Names: []string{"data", "x"}}).Encode(b)
	case ctl.CmdWrite:
		(&ctl.WriteRequest{Token: tok, Lease: small(), LeaseOffset: small(), FileOffset: r.Uint64N(size), Length: r.Uint64N(5000) + 1}).Encode(b)
	}
}

// vfsIoctl reports whether the kernel serves cmd itself on any file (the
// generic ioctls of fs/ioctl.c and tty/socket type bytes), which a random
// test must not issue (FIFREEZE would freeze the filesystem).
func vfsIoctl(cmd uint32) bool {
	switch (cmd >> 8) & 0xff {
	case 0x00, 'T', 'X', 'f', 0x94, 0x15, 0x12, 'v':
		return true
	}
	return false
}

func binaryPut32(b []byte, v uint32) {
	b[0], b[1], b[2], b[3] = byte(v), byte(v>>8), byte(v>>16), byte(v>>24)
}

func binaryPut64(b []byte, v uint64) {
	binaryPut32(b, uint32(v))
	binaryPut32(b[4:], uint32(v>>32))
}

func checkStillServes(t *testing.T, cl *ctl.Client, f *os.File, data []byte) {
	t.Helper()
	ctx := context.Background()
	ranges := []ctl.Range{{Offset: 1, Length: 100000}, {Offset: uint64(len(data)) - 10, Length: 100}}
	ls, err := cl.Read(ctx, f, ctl.HostDevice, ranges)
	if err != nil {
		t.Fatalf("daemon stopped serving: %v", err)
	}
	if err := verifyLeases(ctx, cl, ranges, ls, data); err != nil {
		t.Fatal(err)
	}
	cl.Release(ctx, ls[0].ID, ls[1].ID)
}

// TestControlEndToEnd: several processes read random ranges of several
// files concurrently through the mount, verifying every byte, while another
// process writes checkpoints through the write ioctl, fsyncs them and
// checks them with sha256sum.
func TestControlEndToEnd(t *testing.T) {
	m := startMount(t, mountOpts{Daemon: true, OtherUIDs: true, SlabBytes: 4 << 20, BudgetBytes: 512 << 20})
	var files []string
	for i, size := range []int{1, 100000, 7<<20 + 5, 24 << 20} {
		name := fmt.Sprintf("shard-%d.bin", i)
		m.addFile(t, name, size, uint64(40+i))
		files = append(files, filepath.Join(m.mnt, name))
	}
	const readers = 4
	var wg sync.WaitGroup
	errs := make(chan error, readers+1)
	for i := range readers {
		wg.Go(func() {
			cmd := m.child("e2e-read", map[string]string{"FILES": strings.Join(files, ","), "SEED": fmt.Sprint(i)}, 0).cmd(t)
			if out, err := cmd.CombinedOutput(); err != nil {
				errs <- fmt.Errorf("reader %d: %v\n%s", i, err, out)
			}
		})
	}
	wg.Go(func() {
		cmd := m.child("e2e-write", map[string]string{"DIR": m.mnt}, 0).cmd(t)
		out, err := cmd.CombinedOutput()
		if err != nil {
			errs <- fmt.Errorf("writer: %v\n%s", err, out)
			return
		}
		// The writer printed name and sha256 of each checkpoint: check
		// them in the backing directory too (what reached the disk).
		for _, l := range strings.Split(strings.TrimSpace(string(out)), "\n") {
			name, sum, ok := strings.Cut(l, " ")
			if !ok || !strings.HasPrefix(name, "ckpt-") {
				continue
			}
			got, err := exec.Command("sha256sum", filepath.Join(m.backing, name)).Output()
			if err != nil || strings.Fields(string(got))[0] != sum {
				errs <- fmt.Errorf("checkpoint %s in the backing dir: %s, want %s (%v)", name, got, sum, err)
			}
		}
	})
	wg.Wait()
	close(errs)
	for err := range errs {
		t.Error(err)
	}
	m.waitIdle(t)
}

// TestControlXattrs: the virtual attributes are readable, not listed, not
// settable, and cp -a copies none of them; real user attributes pass.
func TestControlXattrs(t *testing.T) {
	m := startMount(t, mountOpts{Daemon: true, OtherUIDs: true})
	m.addFile(t, "a.bin", 5000, 1)
	p := filepath.Join(m.mnt, "a.bin")
	if err := unix.Setxattr(p, "user.note", []byte("real"), 0); err != nil {
		t.Fatal(err)
	}
	out := run(t, "", "getfattr", "--absolute-names", "--only-values", "-n", "user.gdsfs.info", p)
	var info map[string]any
	if err := json.Unmarshal([]byte(out), &info); err != nil {
		t.Fatalf("user.gdsfs.info %q: %v", out, err)
	}
	if info["engine"] != "host" || info["size"] != float64(5000) || info["path"] != filepath.Join(m.backing, "a.bin") {
		t.Errorf("user.gdsfs.info: %v", info)
	}
	if got := run(t, "", "getfattr", "--absolute-names", "--only-values", "-n", "user.gdsfs.backing", p); got != filepath.Join(m.backing, "a.bin") {
		t.Errorf("user.gdsfs.backing %q", got)
	}
	stats := run(t, "", "getfattr", "--absolute-names", "--only-values", "-n", "user.gdsfs.stats", m.mnt)
	if !json.Valid([]byte(stats)) || !strings.Contains(stats, `"pool"`) {
		t.Errorf("user.gdsfs.stats %q", stats)
	}
	if _, err := unix.Getxattr(p, "user.gdsfs.stats", make([]byte, 100)); !errors.Is(err, unix.ENODATA) {
		t.Errorf("user.gdsfs.stats off the root: %v, want ENODATA", err)
	}
	list := run(t, "", "getfattr", "--absolute-names", "-d", "-m", "-", p)
	if strings.Contains(list, "gdsfs") || !strings.Contains(list, "user.note") {
		t.Errorf("listxattr: %q, want user.note and no user.gdsfs.*", list)
	}
	if err := unix.Setxattr(p, "user.gdsfs.info", []byte("x"), 0); err == nil {
		t.Error("setting user.gdsfs.info succeeded")
	}
	dst := t.TempDir()
	run(t, "", "cp", "-a", p, filepath.Join(dst, "a.bin"))
	copied := run(t, "", "getfattr", "--absolute-names", "-d", "-m", "-", filepath.Join(dst, "a.bin"))
	if strings.Contains(copied, "gdsfs") || !strings.Contains(copied, "user.note") {
		t.Errorf("cp -a copied %q, want user.note only", copied)
	}
}

// TestControlCLI drives gdsfs read, stat and status against a mount.
func TestControlCLI(t *testing.T) {
	m := startMount(t, mountOpts{Daemon: true, OtherUIDs: true, SlabBytes: 1 << 20, BudgetBytes: 64 << 20})
	data := m.addFile(t, "big.bin", 20<<20+77, 21)
	m.addFile(t, "empty", 0, 1)
	p := filepath.Join(m.mnt, "big.bin")
	for _, tc := range []struct {
		args     []string
		from, to int
	}{
		{[]string{"read", p}, 0, len(data)},
		{[]string{"read", "--offset", "4097", "--length", "9000000", p}, 4097, 4097 + 9000000},
		{[]string{"read", "--offset", fmt.Sprint(len(data) - 5), "--length", "100", p}, len(data) - 5, len(data)},
		{[]string{"read", "--offset", fmt.Sprint(len(data)), p}, len(data), len(data)},
	} {
		cmd := exec.Command(gdsfsBin(t), tc.args...)
		var stderr bytes.Buffer
		cmd.Stderr = &stderr
		out, err := cmd.Output()
		if err != nil {
			t.Fatalf("gdsfs %v: %v\n%s", tc.args, err, stderr.String())
		}
		want := sha256.Sum256(data[tc.from:tc.to])
		if got := sha256.Sum256(out); got != want {
			t.Errorf("gdsfs %v: %d bytes, sha256 differs from the file's range", tc.args, len(out))
		}
	}
	if out, code := runGdsfs(t, "read", filepath.Join(m.mnt, "empty")); code != 0 || out != "" {
		t.Errorf("read of an empty file: %q, exit %d", out, code)
	}
	for _, tc := range []struct {
		args []string
		want string
	}{
		{[]string{"read", "--offset", "-1", p}, "--offset"},
		{[]string{"read", "--offset", fmt.Sprint(len(data) + 1), p}, "past the end"},
		{[]string{"read", "/etc/hostname"}, "not on a gdsfs mount"},
		{[]string{"read", "--device", "0", p}, "host memory only"},
		{[]string{"read", "--parallel", "2", p}, "--discard"},
		{[]string{"stat", "/etc/hostname"}, "not on a gdsfs mount"},
		{[]string{"status", "/tmp"}, "not a gdsfs mountpoint"},
	} {
		out, code := runGdsfs(t, tc.args...)
		if code != 2 || !strings.Contains(out, tc.want) {
			t.Errorf("gdsfs %v: exit %d, %q; want exit 2 mentioning %q", tc.args, code, out, tc.want)
		}
	}
	out, code := runGdsfs(t, "read", "--discard", "--parallel", "3", p)
	if code != 0 || !strings.Contains(out, fmt.Sprintf("control-path read: %d bytes", len(data))) {
		t.Errorf("gdsfs read --discard: exit %d, %q", code, out)
	}
	out, code = runGdsfs(t, "stat", p)
	if code != 0 || !strings.Contains(out, "engine:") || !strings.Contains(out, "host") || !strings.Contains(out, "20971597") {
		t.Errorf("gdsfs stat: exit %d\n%s", code, out)
	}
	out, code = runGdsfs(t, "status", m.mnt)
	if code != 0 || !strings.Contains(out, "pool host") || !strings.Contains(out, "reads:") {
		t.Errorf("gdsfs status: exit %d\n%s", code, out)
	}
	out, code = runGdsfs(t, "status", "--json", m.mnt)
	var st ctlserver.Stats
	if code != 0 || json.Unmarshal([]byte(out), &st) != nil || st.Counters.Reads == 0 {
		t.Errorf("gdsfs status --json: exit %d\n%s", code, out)
	}
	m.waitIdle(t)
}
