package handoffserver

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"syscall"
	"testing"
	"time"

	"github.com/gdsfs/gdsfs/handoff"
	"golang.org/x/sys/unix"
)

// fakeSessions is a Source over memfd files: each session has an owner uid
// and a secret, and holds leases in some slabs.
type fakeSessions struct {
	sessions map[uint64]fakeSession
	slabs    map[uint64][]byte // slab id -> its bytes
}

type fakeSession struct {
	uid    uint32
	secret uint64
	slabs  []uint64 // slabs the session holds a lease in
}

func (f *fakeSessions) SlabFD(_ context.Context, peer handoff.Peer, req handoff.Request) (Handle, syscall.Errno) {
	s, ok := f.sessions[req.Session]
	if !ok || s.secret != req.Secret || s.uid != peer.UID {
		return Handle{}, syscall.EPERM
	}
	data, ok := f.slabs[req.Slab]
	if !ok {
		return Handle{}, syscall.ENOENT
	}
	held := false
	for _, id := range s.slabs {
		held = held || id == req.Slab
	}
	if !held {
		return Handle{}, syscall.EPERM
	}
	fd, err := unix.MemfdCreate(fmt.Sprintf("slab-%d", req.Slab), unix.MFD_CLOEXEC)
	if err != nil {
		return Handle{}, syscall.EIO
	}
	f2 := os.NewFile(uintptr(fd), "slab")
	if _, err := f2.Write(data); err != nil {
		f2.Close()
		return Handle{}, syscall.EIO
	}
	return Handle{File: f2, Bytes: uint64(len(data))}, 0
}

// The uids of the cross-uid tests: the owner of session 2 and a stranger.
const (
	ownerUID    = 10001
	strangerUID = 10002
)

func newFake() *fakeSessions {
	return &fakeSessions{
		sessions: map[uint64]fakeSession{
			1: {uid: uint32(os.Getuid()), secret: 0x1111, slabs: []uint64{7}},
			2: {uid: ownerUID, secret: 0x2222, slabs: []uint64{8}},
		},
		slabs: map[uint64][]byte{7: []byte("bytes of slab 7, session 1"), 8: []byte("bytes of slab 8, session 2")},
	}
}

// startServer serves src on a fresh abstract socket until the test ends.
// connDone, if not nil, receives a value each time a connection is gone.
func startServer(t *testing.T, src Source, opts Options, connDone chan struct{}) *Server {
	t.Helper()
	s, err := Listen(opts)
	if err != nil {
		t.Fatal(err)
	}
	if connDone != nil {
		s.connDone = func() { connDone <- struct{}{} }
	}
	if err := s.Serve(src); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		if err := s.Close(); err != nil {
			t.Error(err)
		}
	})
	return s
}

func ctxT(t *testing.T) context.Context {
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	t.Cleanup(cancel)
	return ctx
}

func readAll(t *testing.T, f *os.File) []byte {
	t.Helper()
	b, err := io.ReadAll(io.NewSectionReader(f, 0, 1<<20))
	if err != nil {
		t.Fatal(err)
	}
	return b
}

// TestFetch: what the caller's own session may map arrives as a
// descriptor of that memory; everything else is refused with no
// descriptor, and the connection keeps serving after a refusal.
func TestFetch(t *testing.T) {
	src := newFake()
	done := make(chan struct{}, 1)
	s := startServer(t, src, Options{}, done)
	ctx := ctxT(t)
	c, err := handoff.Dial(ctx, s.Addr(), os.Getpid())
	if err != nil {
		t.Fatal(err)
	}
	cases := []struct {
		name string
		req  handoff.Request
		want syscall.Errno
	}{
		{"own slab", handoff.Request{Session: 1, Secret: 0x1111, Slab: 7}, 0},
		{"forged secret", handoff.Request{Session: 1, Secret: 0x1112, Slab: 7}, syscall.EPERM},
		{"zero token", handoff.Request{Slab: 7}, syscall.EPERM},
		{"unknown session", handoff.Request{Session: 99, Secret: 0x1111, Slab: 7}, syscall.EPERM},
		{"slab without a lease of the session", handoff.Request{Session: 1, Secret: 0x1111, Slab: 8}, syscall.EPERM},
		{"unknown slab", handoff.Request{Session: 1, Secret: 0x1111, Slab: 9}, syscall.ENOENT},
		{"another uid's session with its own secret", handoff.Request{Session: 2, Secret: 0x2222, Slab: 8}, syscall.EPERM},
		{"own slab again", handoff.Request{Session: 1, Secret: 0x1111, Slab: 7}, 0},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			f, rep, err := c.Fetch(ctx, tc.req)
			if tc.want != 0 {
				if !errors.Is(err, tc.want) || f != nil {
					t.Fatalf("Fetch = %v, %v; want %v and no descriptor", f, err, tc.want)
				}
				return
			}
			if err != nil {
				t.Fatal(err)
			}
			defer f.Close()
			if got := readAll(t, f); !bytes.Equal(got, src.slabs[tc.req.Slab]) || rep.Bytes != uint64(len(got)) || rep.Slab != tc.req.Slab {
				t.Fatalf("descriptor holds %q (reply %+v), want %q", got, rep, src.slabs[tc.req.Slab])
			}
		})
	}
	c.Close()
	<-done // the server is done counting that connection's requests
	st := s.Stats()
	if st.Served != 2 || st.Refused != 6 {
		t.Errorf("stats %+v, want 2 served and 6 refused", st)
	}
}

// TestDialChecksServer: a client refuses a socket not served by the daemon
// it expects (a name squatted after the daemon exited).
func TestDialChecksServer(t *testing.T) {
	s := startServer(t, newFake(), Options{}, nil)
	if _, err := handoff.Dial(ctxT(t), s.Addr(), os.Getpid()+1); err == nil || !bytes.Contains([]byte(err.Error()), []byte("not the daemon")) {
		t.Fatalf("Dial with another pid = %v, want a refusal naming the pid", err)
	}
}

// rawConn connects without the client's checks, for sending what a
// hostile or dying client would.
func rawConn(t *testing.T, addr string) *net.UnixConn {
	t.Helper()
	c, err := net.DialUnix("unixpacket", nil, &net.UnixAddr{Name: addr, Net: "unixpacket"})
	if err != nil {
		t.Fatal(err)
	}
	return c
}

func openFDs(t *testing.T) int {
	t.Helper()
	ents, err := os.ReadDir("/proc/self/fd")
	if err != nil {
		t.Fatal(err)
	}
	return len(ents)
}

// TestMalformedAndDyingClients: a malformed message is answered EINVAL and
// its connection closed; a client that sends a request and goes away
// before the reply, or that sends descriptors of its own, leaves no
// descriptor and no connection behind in the server.
func TestMalformedAndDyingClients(t *testing.T) {
	done := make(chan struct{}, 16)
	s := startServer(t, newFake(), Options{}, done)
	base := openFDs(t)
	good := handoff.EncodeRequest(handoff.Request{Session: 1, Secret: 0x1111, Slab: 7})
	longer := append(append([]byte(nil), good...), 0)
	reserved := append([]byte(nil), good...)
	reserved[39] = 1
	badOp := append([]byte(nil), good...)
	badOp[6] = 2
	cases := []struct {
		name    string
		msg     []byte
		sendFDs bool
		einval  bool // the server answers EINVAL before closing
	}{
		{"short", good[:3], false, true},
		{"long", longer, false, true},
		{"reserved bytes", reserved, false, true},
		{"unknown op", badOp, false, true},
		{"request, then gone before the reply", good, false, false},
		{"request with descriptors attached, then gone", good, true, false},
		{"connect and vanish", nil, false, false},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			c := rawConn(t, s.Addr())
			if tc.msg != nil {
				var oob []byte
				if tc.sendFDs {
					oob = unix.UnixRights(0, 1, 2)
				}
				if _, _, err := c.WriteMsgUnix(tc.msg, oob, nil); err != nil {
					t.Fatal(err)
				}
			}
			if tc.einval {
				buf := make([]byte, handoff.ReplyBytes)
				n, err := c.Read(buf)
				if err != nil {
					t.Fatal(err)
				}
				if rep, err := handoff.DecodeReply(buf[:n]); err != nil || rep.Errno != syscall.EINVAL {
					t.Fatalf("reply %+v, %v; want EINVAL", rep, err)
				}
				// Then EOF: the server closed the connection.
				if _, err := c.Read(buf); err == nil {
					t.Fatal("connection still open after a malformed request")
				}
			}
			c.Close()
			<-done // the server's side of the connection is gone
		})
	}
	if got := openFDs(t); got > base {
		t.Errorf("%d descriptors open after the clients left, %d before", got, base)
	}
	if st := s.Stats(); st.Conns != 0 {
		t.Errorf("stats %+v: connections left open", st)
	}
}

// TestConnLimits: one uid cannot hold more than MaxConnsPerUID
// connections; one beyond is closed at once, and a slot frees when a
// connection ends.
func TestConnLimits(t *testing.T) {
	done := make(chan struct{}, 16)
	s := startServer(t, newFake(), Options{MaxConnsPerUID: 2}, done)
	ctx := ctxT(t)
	var held []*handoff.Conn
	for range 2 {
		c, err := handoff.Dial(ctx, s.Addr(), 0)
		if err != nil {
			t.Fatal(err)
		}
		held = append(held, c)
		if _, _, err := c.Fetch(ctx, handoff.Request{Session: 1, Secret: 0x1111, Slab: 7}); err != nil {
			t.Fatal(err) // served, so registered before the next dial
		}
	}
	over, err := handoff.Dial(ctx, s.Addr(), 0)
	if err != nil {
		t.Fatal(err)
	}
	if _, _, err := over.Fetch(ctx, handoff.Request{Session: 1, Secret: 0x1111, Slab: 7}); err == nil {
		t.Fatal("a third connection of one uid was served with MaxConnsPerUID 2")
	}
	over.Close()
	if st := s.Stats(); st.Rejected != 1 {
		t.Errorf("stats %+v, want 1 rejected", st)
	}
	held[0].Close()
	<-done
	again, err := handoff.Dial(ctx, s.Addr(), 0)
	if err != nil {
		t.Fatal(err)
	}
	defer again.Close()
	f, _, err := again.Fetch(ctx, handoff.Request{Session: 1, Secret: 0x1111, Slab: 7})
	if err != nil {
		t.Fatalf("after a connection closed: %v", err)
	}
	f.Close()
	held[1].Close()
}

// TestPathSocket: a path address is created for every uid to connect to
// and removed by Close.
func TestPathSocket(t *testing.T) {
	p := filepath.Join(t.TempDir(), "slabs.sock")
	s, err := Listen(Options{Addr: p})
	if err != nil {
		t.Fatal(err)
	}
	if err := s.Serve(newFake()); err != nil {
		t.Fatal(err)
	}
	fi, err := os.Stat(p)
	if err != nil || fi.Mode()&os.ModeSocket == 0 || fi.Mode().Perm() != 0o666 {
		t.Fatalf("socket %s: %v, %v; want a socket of mode 0666", p, fi, err)
	}
	f, _, err := handoff.Fetch(ctxT(t), p, os.Getpid(), handoff.Request{Session: 1, Secret: 0x1111, Slab: 7})
	if err != nil {
		t.Fatal(err)
	}
	f.Close()
	if err := s.Close(); err != nil {
		t.Fatal(err)
	}
	if _, err := os.Stat(p); !errors.Is(err, os.ErrNotExist) {
		t.Fatalf("socket still there after Close: %v", err)
	}
}

// TestPathSocketStale: a socket file left by a killed daemon is replaced;
// one a live server listens on, or a file that is not a socket, is not.
func TestPathSocketStale(t *testing.T) {
	dir := t.TempDir()
	stale := filepath.Join(dir, "stale.sock")
	l, err := net.ListenUnix("unixpacket", &net.UnixAddr{Name: stale, Net: "unixpacket"})
	if err != nil {
		t.Fatal(err)
	}
	l.SetUnlinkOnClose(false)
	l.Close() // the file stays, nobody listens: what a killed daemon leaves
	s, err := Listen(Options{Addr: stale})
	if err != nil {
		t.Fatalf("Listen over a stale socket: %v", err)
	}
	if _, err := Listen(Options{Addr: stale}); err == nil {
		t.Fatal("a second server took over a live socket")
	}
	s.Close()
	plain := filepath.Join(dir, "plain")
	if err := os.WriteFile(plain, nil, 0o600); err != nil {
		t.Fatal(err)
	}
	if _, err := Listen(Options{Addr: plain}); err == nil {
		t.Fatal("Listen replaced a regular file")
	}
	if _, err := os.Stat(plain); err != nil {
		t.Fatalf("the regular file is gone: %v", err)
	}
}

// TestOtherUID runs clients as two other uids (needs root): the owner of
// session 2 gets its slab; a stranger presenting the owner's token and
// slab id, or root's, gets nothing.
func TestOtherUID(t *testing.T) {
	if os.Getuid() != 0 {
		t.Skip("needs root to run clients as other uids")
	}
	src := newFake()
	s := startServer(t, src, Options{}, nil)
	bin := worldExecutable(t, os.Args[0])
	cases := []struct {
		name    string
		uid     uint32
		session uint64
		secret  uint64
		slab    uint64
		want    string
	}{
		{"owner gets its slab", ownerUID, 2, 0x2222, 8, "ok " + string(src.slabs[8])},
		{"stranger with the owner's token", strangerUID, 2, 0x2222, 8, "refused EPERM"},
		{"stranger with root's token", strangerUID, 1, 0x1111, 7, "refused EPERM"},
		{"owner with root's token", ownerUID, 1, 0x1111, 7, "refused EPERM"},
		{"stranger with a forged token", strangerUID, 2, 0x2223, 8, "refused EPERM"},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			cmd := exec.Command(bin, "-test.run=^TestHandoffChild$", "-test.count=1")
			cmd.Env = append(os.Environ(), "HANDOFF_CHILD="+s.Addr(), "HANDOFF_CHILD_PID="+strconv.Itoa(os.Getpid()),
				fmt.Sprintf("HANDOFF_CHILD_REQ=%d:%d:%d", tc.session, tc.secret, tc.slab))
			cmd.SysProcAttr = &syscall.SysProcAttr{Credential: &syscall.Credential{Uid: tc.uid, Gid: tc.uid}}
			cmd.Dir = "/"
			out, err := cmd.CombinedOutput()
			if err != nil {
				t.Fatalf("child: %v\n%s", err, out)
			}
			if !bytes.Contains(out, []byte("RESULT "+tc.want+"\n")) {
				t.Fatalf("child said:\n%s\nwant RESULT %s", out, tc.want)
			}
		})
	}
}

// TestHandoffChild is the client side of TestOtherUID (run only by it).
func TestHandoffChild(t *testing.T) {
	addr := os.Getenv("HANDOFF_CHILD")
	if addr == "" {
		t.Skip("only run by TestOtherUID")
	}
	pid, _ := strconv.Atoi(os.Getenv("HANDOFF_CHILD_PID"))
	var r handoff.Request
	if _, err := fmt.Sscanf(os.Getenv("HANDOFF_CHILD_REQ"), "%d:%d:%d", &r.Session, &r.Secret, &r.Slab); err != nil {
		t.Fatal(err)
	}
	f, _, err := handoff.Fetch(ctxT(t), addr, pid, r)
	var errno syscall.Errno
	switch {
	case err == nil:
		fmt.Printf("RESULT ok %s\n", readAll(t, f))
		f.Close()
	case errors.As(err, &errno):
		fmt.Printf("RESULT refused %s\n", unix.ErrnoName(errno))
	default:
		t.Fatal(err)
	}
}

// worldExecutable copies the executable at p where every uid can run it
// (go test builds into a private directory).
func worldExecutable(t *testing.T, p string) string {
	t.Helper()
	dir, err := os.MkdirTemp("", "gdsfs-handoff-test-")
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
	dst := filepath.Join(dir, "handoff.test")
	if err := os.WriteFile(dst, b, 0o755); err != nil {
		t.Fatal(err)
	}
	return dst
}
