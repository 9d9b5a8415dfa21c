package ctlserver

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"os"
	"sync"
	"syscall"
	"testing"

	"github.com/gdsfs/gdsfs/ctl"
	"github.com/gdsfs/gdsfs/handoff"
	"github.com/gdsfs/gdsfs/handoffserver"
)

// TestSlabFD: the slab socket's source gives a session's own slab to a
// process of the session's uid, as a descriptor of the very memory its
// lease's bytes are in, and nothing to anyone else.
func TestSlabFD(t *testing.T) {
	e := newEnv(t, envOptions{slabBytes: 1 << 20, budgetBytes: 64 << 20})
	const uid, other = 1000, 1001
	a := e.client(uid, ctl.Token{})
	b := e.client(uid, ctl.Token{}) // same uid, another session, no lease
	f, data := e.file("f", 100000, os.O_RDONLY)
	ls, err := a.Read(context.Background(), f, ctl.HostDevice, []ctl.Range{{Offset: 5000, Length: 70000}})
	if err != nil {
		t.Fatal(err)
	}
	l := ls[0]
	tokA, tokB := a.Token(), b.Token()
	ctx := context.Background()
	cases := []struct {
		name string
		peer uint32
		req  handoff.Request
		want syscall.Errno
	}{
		{"own session, own slab", uid, handoff.Request{Session: tokA.Session, Secret: tokA.Secret, Slab: l.Slab}, 0},
		{"another uid with the owner's token", other, handoff.Request{Session: tokA.Session, Secret: tokA.Secret, Slab: l.Slab}, syscall.EPERM},
		{"forged secret", uid, handoff.Request{Session: tokA.Session, Secret: tokA.Secret ^ 1, Slab: l.Slab}, syscall.EPERM},
		{"zero token", uid, handoff.Request{Slab: l.Slab}, syscall.EPERM},
		{"session of the same uid without a lease in the slab", uid, handoff.Request{Session: tokB.Session, Secret: tokB.Secret, Slab: l.Slab}, syscall.EPERM},
		{"slab 0", uid, handoff.Request{Session: tokA.Session, Secret: tokA.Secret, Slab: 0}, syscall.ENOENT},
		{"slab id beyond 32 bits", uid, handoff.Request{Session: tokA.Session, Secret: tokA.Secret, Slab: 1 << 40}, syscall.ENOENT},
		{"unknown slab", uid, handoff.Request{Session: tokA.Session, Secret: tokA.Secret, Slab: l.Slab + 1000}, syscall.ENOENT},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			h, errno := e.srv.SlabFD(ctx, handoff.Peer{PID: 1, UID: tc.peer, GID: tc.peer}, tc.req)
			if errno != tc.want {
				if h.File != nil {
					h.File.Close()
				}
				t.Fatalf("SlabFD = %v, want %v", errno, tc.want)
			}
			if tc.want != 0 {
				if h.File != nil {
					t.Fatal("a refusal came with a descriptor")
				}
				return
			}
			defer h.File.Close()
			got := make([]byte, l.Valid)
			if _, err := h.File.ReadAt(got, int64(l.Offset)); err != nil && !errors.Is(err, io.EOF) {
				t.Fatal(err)
			}
			if !bytes.Equal(got, data[5000:75000]) {
				t.Fatal("the descriptor's memory does not hold the lease's bytes")
			}
			if int64(h.Bytes) < int64(l.Offset+l.Valid) {
				t.Fatalf("descriptor of %d bytes for a lease ending at %d", h.Bytes, l.Offset+l.Valid)
			}
		})
	}
	// Released, the session holds no lease in the slab any more.
	if err := a.Release(ctx, l.ID); err != nil {
		t.Fatal(err)
	}
	if _, errno := e.srv.SlabFD(ctx, handoff.Peer{UID: uid}, handoff.Request{Session: tokA.Session, Secret: tokA.Secret, Slab: l.Slab}); errno != syscall.EPERM {
		t.Fatalf("SlabFD after release = %v, want EPERM", errno)
	}
	// Ended, the session's token is refused.
	a.Close()
	if _, errno := e.srv.SlabFD(ctx, handoff.Peer{UID: uid}, handoff.Request{Session: tokA.Session, Secret: tokA.Secret, Slab: l.Slab}); errno != syscall.EPERM {
		t.Fatalf("SlabFD of an ended session = %v, want EPERM", errno)
	}
}

// TestHelloSlabSocket: HELLO announces the slab socket with CapSlabFD, and
// only when there is one.
func TestHelloSlabSocket(t *testing.T) {
	cases := []struct {
		name, addr string
	}{
		{"none", ""},
		{"abstract", "@gdsfs-slabs-1-0123456789abcdef"},
		{"path", "/run/gdsfs/slabs.sock"},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			e := newEnv(t, envOptions{slabBytes: 1 << 20, budgetBytes: 8 << 20})
			e.srv.opts.SlabSocket = tc.addr
			h := e.client(1000, ctl.Token{}).Hello()
			if got := h.Caps&ctl.CapSlabFD != 0; got != (tc.addr != "") || h.SlabSocket != tc.addr {
				t.Fatalf("HELLO caps %#x socket %q, want CapSlabFD=%v socket %q", h.Caps, h.SlabSocket, tc.addr != "", tc.addr)
			}
		})
	}
	long := Options{Pool: newEnv(t, envOptions{slabBytes: 1 << 20, budgetBytes: 8 << 20}).pool, Engines: fixedEngine{}, SlabSocket: "@" + string(bytes.Repeat([]byte("x"), ctl.SlabSocketBytes))}
	if err := long.Validate(); err == nil {
		t.Fatal("a slab socket address longer than HELLO's room validated")
	}
}

// TestSlabFDOverSocket: end to end through a real handoff server, as the
// daemon wires it: the test process (uid of its session) gets the
// descriptor and reads the lease's bytes through it.
func TestSlabFDOverSocket(t *testing.T) {
	e := newEnv(t, envOptions{slabBytes: 1 << 20, budgetBytes: 64 << 20})
	hs, err := handoffserver.Listen(handoffserver.Options{})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { hs.Close() })
	if err := hs.Serve(e.srv); err != nil {
		t.Fatal(err)
	}
	e.srv.opts.SlabSocket = hs.Addr()
	cl := e.client(uint32(os.Getuid()), ctl.Token{}) // the socket sees this process
	f, data := e.file("g", 9000, os.O_RDONLY)
	ls, err := cl.Read(context.Background(), f, ctl.HostDevice, []ctl.Range{{Offset: 1, Length: 8000}})
	if err != nil {
		t.Fatal(err)
	}
	sf, rep, err := cl.SlabFD(context.Background(), ls[0].Slab)
	if err != nil {
		t.Fatal(err)
	}
	defer sf.Close()
	got := make([]byte, ls[0].Valid)
	if _, err := sf.ReadAt(got, int64(ls[0].Offset)); err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(got, data[1:8001]) || rep.Slab != ls[0].Slab {
		t.Fatalf("bytes through the socket's descriptor differ (reply %+v)", rep)
	}
}

// TestSlabWireRoundTrip: HELLO's slab socket (up to its full room) and a
// kind-3 SLAB reply (no handle bytes) survive encoding.
func TestSlabWireRoundTrip(t *testing.T) {
	for _, addr := range []string{"", "@gdsfs-slabs-1-0123456789abcdef", "/" + string(bytes.Repeat([]byte("s"), ctl.SlabSocketBytes-2))} {
		h := ctl.HelloReply{Version: 1, Caps: ctl.CapCUDASlabs | ctl.CapSlabFD, DaemonPID: 7, Engine: "posix", SlabSocket: addr}
		b := make([]byte, ctl.SizeHello)
		h.Encode(b)
		got, err := ctl.DecodeHelloReply(b)
		if err != nil || got != h {
			t.Errorf("hello with socket %q: got %+v, %v", addr, got, err)
		}
	}
	r := ctl.SlabReply{Slab: 9, Size: 64 << 20, Kind: ctl.SlabCUDAFD, Device: 0}
	b := make([]byte, ctl.SizeSlab)
	r.Encode(b)
	got, err := ctl.DecodeSlabReply(b)
	if err != nil || got.Kind != ctl.SlabCUDAFD || len(got.Handle) != 0 || got.Size != r.Size || got.Slab != r.Slab {
		t.Errorf("kind-3 slab reply: got %+v, %v", got, err)
	}
}

// TestSlabFDConcurrentClose: SlabFD racing the session's end (run with
// -race) either hands a descriptor of the session's own slab or refuses;
// once the session is gone, it refuses.
func TestSlabFDConcurrentClose(t *testing.T) {
	e := newEnv(t, envOptions{slabBytes: 1 << 20, budgetBytes: 64 << 20})
	a := e.client(1000, ctl.Token{})
	f, _ := e.file("c", 50000, os.O_RDONLY)
	ls, err := a.Read(context.Background(), f, ctl.HostDevice, []ctl.Range{{Offset: 0, Length: 50000}})
	if err != nil {
		t.Fatal(err)
	}
	tok := a.Token()
	req := handoff.Request{Session: tok.Session, Secret: tok.Secret, Slab: ls[0].Slab}
	peer := handoff.Peer{PID: 1, UID: 1000}
	var wg sync.WaitGroup
	errs := make(chan error, 4)
	for range 4 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for range 200 {
				h, errno := e.srv.SlabFD(context.Background(), peer, req)
				switch {
				case errno == 0 && h.File != nil:
					h.File.Close()
				case errno == syscall.EPERM && h.File == nil:
				default:
					errs <- fmt.Errorf("SlabFD = %v, %v during close", h.File, errno)
					return
				}
			}
		}()
	}
	a.Close()
	wg.Wait()
	close(errs)
	for err := range errs {
		t.Error(err)
	}
	if _, errno := e.srv.SlabFD(context.Background(), peer, req); errno != syscall.EPERM {
		t.Fatalf("SlabFD after the session ended = %v, want EPERM", errno)
	}
	e.checkIdle()
}
