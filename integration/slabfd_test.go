package integration

import (
	"bufio"
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"math/rand/v2"
	"net"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/gdsfs/gdsfs/ctl"
	"github.com/gdsfs/gdsfs/handoff"
)

// The uids of the slab-socket test: the slab's owner and another user.
const (
	slabOwnerUID = 10001
	slabOtherUID = 10002
)

// TestSlabSocketTwoUIDs drives the daemon's slab socket (the descriptor
// handoff that CUDA VMM slabs need; host slabs serve it too) as two
// non-root uids, one process each: the owner gets a descriptor of its
// slab, whose memory holds its lease's bytes; the other uid, presenting
// the owner's live token and slab id, a forged token, or its own token
// with the owner's slab id, gets no descriptor (EPERM); clients killed
// before or after sending a request leave no descriptor behind in the
// daemon. It runs with the default abstract socket and with a path
// (--slab-socket).
func TestSlabSocketTwoUIDs(t *testing.T) {
	requireRoot(t)
	for _, tc := range []struct {
		name string
		path bool
	}{{"abstract", false}, {"path", true}} {
		t.Run(tc.name, func(t *testing.T) { testSlabSocketTwoUIDs(t, tc.path) })
	}
}

func testSlabSocketTwoUIDs(t *testing.T, pathSocket bool) {
	dir := t.TempDir()
	backing, mnt := mountDirs(t, dir)
	openToOtherUIDs(t, dir)
	files := map[uint32]string{slabOwnerUID: "owner.bin", slabOtherUID: "other.bin"}
	for uid, name := range files {
		b := make([]byte, 300000)
		r := rand.New(rand.NewPCG(uint64(uid), 5))
		for i := range b {
			b[i] = byte(r.Uint32())
		}
		p := filepath.Join(backing, name)
		if err := os.WriteFile(p, b, 0o600); err != nil {
			t.Fatal(err)
		}
		if err := os.Chown(p, int(uid), int(uid)); err != nil {
			t.Fatal(err)
		}
	}
	flags := []string{"--engine", "host", "--allow-other", "--host-pool", "64MiB", "--slab-size", "4MiB"}
	if pathSocket {
		flags = append(flags, "--slab-socket", filepath.Join(dir, "slabs.sock"))
	}
	d := startBinDaemon(t, backing, mnt, flags...)
	// Warm up (go-fuse keeps reader goroutines it started for a while):
	// one session that maps a slab through the socket, then the baseline.
	warm, err := ctl.OpenSession(mnt)
	if err != nil {
		t.Fatal(err)
	}
	wl, _, err := readLease(warm, filepath.Join(mnt, files[slabOwnerUID]))
	if err != nil {
		t.Fatal(err)
	}
	wf, _, err := warm.SlabFD(context.Background(), wl.Slab)
	if err != nil {
		t.Fatal(err)
	}
	wf.Close()
	warm.Close()
	base, err := d.waitIdle(idleFigures{fds: 1 << 20, goroutines: 1 << 20, pipeFDs: 1 << 20})
	if err != nil {
		t.Fatal(err)
	}
	bin := worldExecutable(t, os.Args[0])

	// The owner: maps its slab through the socket and holds its session.
	owner := slabChild(bin, slabOwnerUID, "owner", map[string]string{"MNT": mnt, "FILE": filepath.Join(mnt, files[slabOwnerUID])}).cmd(t)
	stdin, err := owner.StdinPipe()
	if err != nil {
		t.Fatal(err)
	}
	stdout, err := owner.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	var ownerErr bytes.Buffer
	owner.Stderr = &ownerErr
	if err := owner.Start(); err != nil {
		t.Fatal(err)
	}
	ownerDone := false
	t.Cleanup(func() { // a failed test must not leave the mount busy
		if !ownerDone {
			owner.Process.Kill()
			owner.Wait()
		}
	})
	line, err := bufio.NewReader(stdout).ReadString('\n')
	if err != nil {
		t.Fatalf("owner: %v\n%s", err, ownerErr.String())
	}
	var tok ctl.Token
	var slab uint64
	if _, err := fmt.Sscanf(line, "READY %d:%d %d", &tok.Session, &tok.Secret, &slab); err != nil {
		t.Fatalf("owner said %q: %v\n%s", line, err, ownerErr.String())
	}

	// The other uid, with what it could have learnt of the owner's.
	out := slabChild(bin, slabOtherUID, "other", map[string]string{
		"MNT": mnt, "FILE": filepath.Join(mnt, files[slabOtherUID]),
		"TOKEN": tokenString(tok), "SLAB": strconv.FormatUint(slab, 10)}).mustRun(t, time.Minute)
	for _, want := range []string{"owner's token: EPERM", "forged token: EPERM", "own token, owner's slab: EPERM", "zero token: EPERM", "own slab: ok"} {
		if !strings.Contains(out, want+"\n") {
			t.Errorf("other uid: no %q in its output:\n%s", want, out)
		}
	}

	// Clients of the owner's uid killed mid-handshake: after connecting,
	// and after sending a request whose reply (a descriptor) they never
	// read.
	for _, mode := range []string{"connect", "request"} {
		c := slabChild(bin, slabOwnerUID, "die-"+mode, map[string]string{"MNT": mnt, "TOKEN": tokenString(tok), "SLAB": strconv.FormatUint(slab, 10)}).cmd(t)
		cout, err := c.StdoutPipe()
		if err != nil {
			t.Fatal(err)
		}
		if err := c.Start(); err != nil {
			t.Fatal(err)
		}
		if l, err := bufio.NewReader(cout).ReadString('\n'); err != nil || l != "SENT\n" {
			c.Process.Kill()
			c.Wait()
			t.Fatalf("dying client %s said %q, %v", mode, l, err)
		}
		if err := c.Process.Kill(); err != nil {
			t.Fatal(err)
		}
		c.Wait()
	}

	stdin.Close() // the owner exits, ending its session
	ownerDone = true
	if err := owner.Wait(); err != nil {
		t.Fatalf("owner: %v\n%s", err, ownerErr.String())
	}
	if !strings.Contains(ownerErr.String(), "mapped ok") {
		t.Errorf("owner did not map its slab:\n%s", ownerErr.String())
	}
	// A connection or descriptor the slab socket leaked would be a
	// descriptor of the daemon: those must be back to idle exactly. The
	// goroutine count also moves with go-fuse's reader goroutines and the
	// runtime's GC workers (seen: +1 after the clients, neither the
	// socket's), so it gets slack.
	limit := base
	limit.goroutines += 8
	after, err := d.waitIdle(limit)
	if err != nil {
		t.Fatal(err)
	}
	t.Logf("slab socket: idle after the clients: %d fds (idle %d), %d goroutines (idle %d)", after.fds, base.fds, after.goroutines, base.goroutines)
}

// slabChild is a slab-socket client of uid (TestSlabFDChild) running bin.
func slabChild(bin string, uid uint32, mode string, env map[string]string) child {
	return child{bin: bin, family: "SLABFD", mode: mode, env: env, uid: uid}
}

// TestSlabFDChild is not a test: TestSlabSocketTwoUIDs runs the test
// binary in this mode as its client processes.
func TestSlabFDChild(t *testing.T) {
	mode, env := childMode(t, "SLABFD")
	var err error
	switch mode {
	case "owner":
		err = slabOwner(env("MNT"), env("FILE"))
	case "other":
		err = slabOther(env("MNT"), env("FILE"), env("TOKEN"), env("SLAB"))
	case "die-connect", "die-request":
		err = slabDier(env("MNT"), env("TOKEN"), env("SLAB"), mode == "die-request")
	default:
		err = fmt.Errorf("unknown mode %q", mode)
	}
	childExit(err)
}

// readLease reads a range of file into a lease of cl and returns it with
// the bytes pread gives for it.
func readLease(cl *ctl.Client, file string) (ctl.Lease, []byte, error) {
	f, err := os.Open(file)
	if err != nil {
		return ctl.Lease{}, nil, err
	}
	defer f.Close()
	ls, err := cl.Read(context.Background(), f, ctl.HostDevice, []ctl.Range{{Offset: 12345, Length: 200000}})
	if err != nil {
		return ctl.Lease{}, nil, err
	}
	want := make([]byte, 200000)
	if _, err := f.ReadAt(want, 12345); err != nil {
		return ctl.Lease{}, nil, err
	}
	return ls[0], want, nil
}

// mapFD checks that the memory behind f holds want at off.
func mapFD(f *os.File, n uint64, off uint64, want []byte) error {
	m, err := unix.Mmap(int(f.Fd()), 0, int(n), unix.PROT_READ, unix.MAP_SHARED)
	if err != nil {
		return fmt.Errorf("mmap the slab descriptor: %w", err)
	}
	defer unix.Munmap(m)
	if off+uint64(len(want)) > uint64(len(m)) || !bytes.Equal(m[off:off+uint64(len(want))], want) {
		return errors.New("the slab descriptor's memory does not hold the lease's bytes")
	}
	return nil
}

func slabOwner(mnt, file string) error {
	cl, err := ctl.OpenSession(mnt)
	if err != nil {
		return err
	}
	defer cl.Close()
	if cl.Hello().Caps&ctl.CapSlabFD == 0 || cl.Hello().SlabSocket == "" {
		return fmt.Errorf("HELLO announces no slab socket (caps %#x)", cl.Hello().Caps)
	}
	l, want, err := readLease(cl, file)
	if err != nil {
		return err
	}
	f, rep, err := cl.SlabFD(context.Background(), l.Slab)
	if err != nil {
		return err
	}
	defer f.Close()
	if err := mapFD(f, rep.Bytes, l.Offset, want); err != nil {
		return err
	}
	fmt.Fprintln(os.Stderr, "mapped ok")
	fmt.Printf("READY %d:%d %d\n", cl.Token().Session, cl.Token().Secret, l.Slab)
	io.Copy(io.Discard, os.Stdin) // hold the session until the test closes stdin
	return nil
}

func slabOther(mnt, file, token, slabStr string) error {
	tok, err := parseToken(token)
	if err != nil {
		return err
	}
	slab, err := strconv.ParseUint(slabStr, 10, 64)
	if err != nil {
		return err
	}
	own, err := ctl.OpenSession(mnt)
	if err != nil {
		return err
	}
	defer own.Close()
	h := own.Hello()
	ctx := context.Background()
	try := func(what string, r handoff.Request) error {
		f, _, err := handoff.Fetch(ctx, h.SlabSocket, int(h.DaemonPID), r)
		if f != nil {
			f.Close()
			return fmt.Errorf("%s: the daemon handed over a descriptor", what)
		}
		var errno syscall.Errno
		if !errors.As(err, &errno) {
			return fmt.Errorf("%s: %v, want the daemon's refusal", what, err)
		}
		fmt.Printf("%s: %s\n", what, unix.ErrnoName(errno))
		return nil
	}
	mine := own.Token()
	for _, c := range []struct {
		what string
		r    handoff.Request
	}{
		{"owner's token", handoff.Request{Session: tok.Session, Secret: tok.Secret, Slab: slab}},
		{"forged token", handoff.Request{Session: tok.Session, Secret: tok.Secret + 1, Slab: slab}},
		{"own token, owner's slab", handoff.Request{Session: mine.Session, Secret: mine.Secret, Slab: slab}},
		{"zero token", handoff.Request{Slab: slab}},
	} {
		if err := try(c.what, c.r); err != nil {
			return err
		}
	}
	l, want, err := readLease(own, file)
	if err != nil {
		return err
	}
	f, rep, err := own.SlabFD(ctx, l.Slab)
	if err != nil {
		return fmt.Errorf("own slab: %w", err)
	}
	defer f.Close()
	if err := mapFD(f, rep.Bytes, l.Offset, want); err != nil {
		return err
	}
	fmt.Println("own slab: ok")
	return nil
}

// slabDier connects to the slab socket (and sends a request for the
// session's slab when request is set), says SENT and waits to be killed.
func slabDier(mnt, token, slabStr string, request bool) error {
	tok, err := parseToken(token)
	if err != nil {
		return err
	}
	slab, err := strconv.ParseUint(slabStr, 10, 64)
	if err != nil {
		return err
	}
	cl, err := ctl.Attach(mnt, tok)
	if err != nil {
		return err
	}
	h := cl.Hello()
	c, err := net.DialUnix("unixpacket", nil, &net.UnixAddr{Name: h.SlabSocket, Net: "unixpacket"})
	if err != nil {
		return err
	}
	if request {
		if _, err := c.Write(handoff.EncodeRequest(handoff.Request{Session: tok.Session, Secret: tok.Secret, Slab: slab})); err != nil {
			return err
		}
	}
	fmt.Println("SENT")
	select {} // killed here
}
